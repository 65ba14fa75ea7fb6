/* The integer formats' scale search (quant/intq.py `_search`): for every group and every
   candidate (scale, zero), the weighted squared error of round-to-nearest with that candidate,
       q = (clamp(round_half_even(x / s') + z, 0, top) - z) * s      (s' = s, or 1 where s = 0)
       err = sum_k w_k (q_k - x_k)^2
   with q, the difference, its square and the weighting in float32 exactly as torch computes them,
   summed in 16 float32 lanes and then in double (torch sums in float32 in its own order, so
   near-ties between candidates may be decided differently; each implementation is deterministic). One pass over a group's values
   per candidate while they sit in L1, where torch makes ~8 passes over the whole matrix per
   candidate.

   x: [groups, g] contiguous; weight: NULL or [wgroups, g], group i using row i % wgroups (the
   per-input-channel weights repeat for every output row); scales, zeros: [cands, groups] (zeros
   NULL: the fixed zero point `mid`); errors: [cands, groups]. */

#include <math.h>
#include <stdint.h>

#define LANES 16

int lowbit_int_scale_errors(const float *x, int64_t groups, int64_t g, const float *weight, int64_t wgroups,
                            int64_t cands, const float *scales, const float *zeros, float mid, float top,
                            double *errors, int threads) {
    if (groups <= 0 || g <= 0 || cands <= 0) return 0;
    if (weight && wgroups <= 0) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (groups * cands * g > (1 << 16) && threads > 1)
    for (int64_t i = 0; i < groups; i++) {
        const float *xi = x + i * g;
        const float *wi = weight ? weight + (i % wgroups) * g : 0;
        for (int64_t c = 0; c < cands; c++) {
            const float s = scales[c * groups + i];
            const float d = s == 0.0f ? 1.0f : s;
            const float z = zeros ? zeros[c * groups + i] : mid;
            /* 16 float lanes (vectorized), each summing every 16th term, then the lanes and the
               tail in double in a fixed order */
            float lanes[LANES] = {0};
            int64_t k0 = 0;
            for (; k0 + LANES <= g; k0 += LANES) {
                for (int l = 0; l < LANES; l++) {
                    float q = nearbyintf(xi[k0 + l] / d) + z;
                    q = q < 0.0f ? 0.0f : q;
                    q = q > top ? top : q;
                    const float diff = (q - z) * s - xi[k0 + l];
                    lanes[l] += wi ? diff * diff * wi[k0 + l] : diff * diff;
                }
            }
            double acc = 0.0;
            for (int l = 0; l < LANES; l++) acc += (double)lanes[l];
            for (int64_t k = k0; k < g; k++) {
                float q = nearbyintf(xi[k] / d) + z;
                q = q < 0.0f ? 0.0f : q;
                q = q > top ? top : q;
                const float diff = (q - z) * s - xi[k];
                acc += (double)(wi ? diff * diff * wi[k] : diff * diff);
            }
            errors[c * groups + i] = acc;
        }
    }
    return 0;
}

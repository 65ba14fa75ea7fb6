/* GPTQ's column loop over one block of columns, for integer grids (compress/gptq.py `_integer_loop`,
   lowbit_gptq_int_block) and for element grids (`_grid_loop`, lowbit_gptq_grid_block: minifloats
   and NF4, whose element quantizer is a table lookup; see the end of this file).

   In Python the loop costs a few torch calls per column (~50 us each column of a 135M model,
   ~10 s of a GPTQ run) for very little arithmetic; here a block of up to 128 columns is one call.

   Layout: every [B, N] array is B visited columns of N stacked weight rows, row stride N (the
   column-major working copies of compress/gptq.py). For column i of the block and every row n:
       t      = clamp(round_half_even(x / divisor), lo, hi)
       value  = t * scale
       err    = (x - value) / u[i][i]
       x[r]   = fma(-u[i][r], err, x[r])  for the block's later columns r > i
   the operations of the torch loop (quant/gptq.int_block_torch) in float32, built in ISO C mode
   without -ffast-math so that nothing else is contracted. torch's addr_ fuses the update in its
   vector body but not in its scalar tails (the last n mod 16 weight rows on AVX-512, and the last
   rows of each of its threads' shares), so the two agree bit for bit but there, where they may
   differ by a rounding (tested: under 1 % of the elements). Weight rows never interact, so
   threads split them; each row's arithmetic does not depend on the split.

   lo/hi: arrays [B, N] (asymmetric: -zero and top - zero), or NULL to use lo_s/hi_s for all.
   keep/kept (outliers, or NULL): where keep is set the weight is held in bf16 instead of coded,
   t = 0 (its code stands for 0), value = 0, kept = bf16(x) and err = (x - kept) / u[i][i];
   elsewhere kept = 0. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define ROWS_PER_TASK 256

/* x rounded to bfloat16 (nearest, ties to even) and back, as torch's x.to(bfloat16).float();
   NaN stays NaN. */
static inline float bf16_round(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return x;
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &bits, 4);
    return x;
}

/* Column i's scaled errors e fed into the block's later columns r > i, rows n0..n1. */
static inline void update_later_columns(float *block, int64_t b, int64_t n, const float *u, int64_t ldu, int64_t i,
                                        const float *e, int64_t n0, int64_t n1) {
    for (int64_t r = i + 1; r < b; r++) {
        const float c = u[i * ldu + r];
        float *y = block + r * n;
        for (int64_t k = n0; k < n1; k++) y[k] = fmaf(-c, e[k], y[k]);
    }
}

/* The weight rows n0..n1 of one task: threads split the rows, which never interact. */
static inline void task_rows(int64_t task, int64_t n, int64_t *n0, int64_t *n1) {
    *n0 = task * ROWS_PER_TASK;
    *n1 = *n0 + ROWS_PER_TASK < n ? *n0 + ROWS_PER_TASK : n;
}

int lowbit_gptq_int_block(float *block, int64_t b, int64_t n, const float *u, int64_t ldu,
                          const float *divisor, const float *scale, const float *lo, const float *hi,
                          float lo_s, float hi_s, float *ints, float *values, float *errors,
                          const uint8_t *keep, float *kept, int threads) {
    if (b <= 0 || n <= 0) return 0;
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1 && threads > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t n0, n1;
        task_rows(task, n, &n0, &n1);
        for (int64_t i = 0; i < b; i++) {
            float *x = block + i * n;
            float *t = ints + i * n, *v = values + i * n, *e = errors + i * n;
            const float *d = divisor + i * n, *s = scale + i * n;
            const float diag = u[i * ldu + i];
            if (lo) {
                const float *l = lo + i * n, *h = hi + i * n;
                for (int64_t k = n0; k < n1; k++) {
                    float q = nearbyintf(x[k] / d[k]);
                    q = q < l[k] ? l[k] : q;
                    q = q > h[k] ? h[k] : q;
                    t[k] = q;
                    v[k] = q * s[k];
                    e[k] = (x[k] - v[k]) / diag;
                }
            } else {
                for (int64_t k = n0; k < n1; k++) {
                    float q = nearbyintf(x[k] / d[k]);
                    q = q < lo_s ? lo_s : q;
                    q = q > hi_s ? hi_s : q;
                    t[k] = q;
                    v[k] = q * s[k];
                    e[k] = (x[k] - v[k]) / diag;
                }
            }
            if (keep) {
                const uint8_t *m = keep + i * n;
                float *kp = kept + i * n;
                for (int64_t k = n0; k < n1; k++) {
                    if (m[k]) {
                        kp[k] = bf16_round(x[k]);
                        t[k] = 0.0f;
                        v[k] = 0.0f;
                        e[k] = (x[k] - kp[k]) / diag;
                    } else {
                        kp[k] = 0.0f;
                    }
                }
            }
            update_later_columns(block, b, n, u, ldu, i, e, n0, n1);
        }
    }
    return 0;
}

/* The same loop for formats whose element quantizer is "the nearest value of x / divisor on a
   grid" (minifloats, NF4; quant/element_grid.py): g values ascending (magnitudes when
   sign_bit is set, the code then taking sign_bit for negative x, -0 included), g - 1 midpoints in
   double, x exactly on midpoint j going up when tie_up[j]. Beyond the last midpoint it saturates.
   Writes the codes (uint8) where the integer loop writes integers; value = grid value * scale. */
int lowbit_gptq_grid_block(float *block, int64_t b, int64_t n, const float *u, int64_t ldu,
                           const float *divisor, const float *scale, int64_t g, const double *mids,
                           const uint8_t *tie_up, const float *grid, const uint8_t *grid_codes, int sign_bit,
                           uint8_t *codes, float *values, float *errors, const uint8_t *keep, float *kept,
                           int threads) {
    if (b <= 0 || n <= 0 || g <= 0) return g <= 0;
    const int64_t tasks = (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for num_threads(threads) schedule(static) if (tasks > 1 && threads > 1)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t n0, n1;
        task_rows(task, n, &n0, &n1);
        for (int64_t i = 0; i < b; i++) {
            const float *x = block + i * n, *d = divisor + i * n, *s = scale + i * n;
            const uint8_t *m = keep ? keep + i * n : 0;
            uint8_t *c = codes + i * n;
            float *v = values + i * n, *e = errors + i * n, *kp = kept ? kept + i * n : 0;
            const float diag = u[i * ldu + i];
            for (int64_t k = n0; k < n1; k++) {
                const int held = m && m[k];
                const float r = held ? 0.0f : x[k] / d[k];  /* a kept weight's code stands for +0 */
                const double a = sign_bit ? fabs((double)r) : (double)r;
                int64_t lo = 0, hi = g - 1;  /* lo = how many midpoints lie below a */
                while (lo < hi) {
                    const int64_t mid = (lo + hi) / 2;
                    if (mids[mid] < a) lo = mid + 1;
                    else hi = mid;
                }
                if (lo < g - 1 && a == mids[lo] && tie_up[lo]) lo++;
                float value = grid[lo];
                uint8_t code = grid_codes[lo];
                if (sign_bit && signbit(r)) {
                    value = -value;
                    code |= (uint8_t)sign_bit;
                }
                c[k] = code;
                if (held) {
                    kp[k] = bf16_round(x[k]);
                    v[k] = 0.0f;
                    e[k] = (x[k] - kp[k]) / diag;
                } else {
                    if (kp) kp[k] = 0.0f;
                    v[k] = value * s[k];
                    e[k] = (x[k] - v[k]) / diag;
                }
            }
            update_later_columns(block, b, n, u, ldu, i, e, n0, n1);
        }
    }
    return 0;
}

/* Mixture-of-experts routing (runtime/models/moe.py) in C: the router's choice of experts and
   their weights per token, and Qwen2-MoE's shared-expert gate.

   Why C: the model's forward and the one-call decode step (decode_layers.c) must route a token
   identically, bit for bit, and torch's softmax (its own vectorized exp) cannot be called from C.
   So both paths call these functions on CPU float32 rows.

   Per row of x [rows, hidden] (float32), each function alone (batch-invariant):
     logit_e = (float)(sum_h (double)x_h * (double)W[e, h])   h in order, in double: a float32 sum's
               blocking could move a logit's last bit with the batch, and top-k turns a last bit into
               another expert
     p_e     = expf(logit_e - max) / sum_e' expf(logit_e' - max)   (float32, the sum in expert order)
     the top_k largest p (ties: the lower expert), in descending order, and with norm_topk each
     divided by their float32 sum (summed in that order), as transformers renormalizes.
   The shared-expert gate: sigmoid(logit) = 1 / (1 + expf(-logit)) of its one-row W. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "lowbit_native.h"

#define MAX_EXPERTS 1024

/* (float)(x . w) summed in double, four interleaved double partial sums then a fixed order. */
static float logit(const float *x, const float *w, int64_t n) {
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += (double)x[i + j] * (double)w[i + j];
    for (int j = 0; i < n; i++, j++) s[j] += (double)x[i] * (double)w[i];
    return (float)((s[0] + s[1]) + (s[2] + s[3]));
}

#if defined(__AVX512F__)
/* logit() of four experts' rows at once, the very same sums: lane 4e + j of a vector holds expert
   e's partial sum s[j], so each lane adds the same exact double products in the same order as
   logit() does; a product of two floats is exact in double, so the adds are all that round. Four
   independent chains where logit() ran one expert's at a time, waiting on each add (~3 of a MoE
   layer's ~11 us of routing on one thread for 8 experts x 1024). */
static void logits4(const float *x, const float *const w[4], int64_t n, float *out) {
    __m512d s01 = _mm512_setzero_pd(), s23 = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m256d xd = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
        const __m512d xx = _mm512_insertf64x4(_mm512_castpd256_pd512(xd), xd, 1);
        const __m512d w01 = _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_cvtps_pd(_mm_loadu_ps(w[0] + i))),
                                               _mm256_cvtps_pd(_mm_loadu_ps(w[1] + i)), 1);
        const __m512d w23 = _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_cvtps_pd(_mm_loadu_ps(w[2] + i))),
                                               _mm256_cvtps_pd(_mm_loadu_ps(w[3] + i)), 1);
        s01 = _mm512_add_pd(s01, _mm512_mul_pd(xx, w01));
        s23 = _mm512_add_pd(s23, _mm512_mul_pd(xx, w23));
    }
    double s[16];
    _mm512_storeu_pd(s, s01);
    _mm512_storeu_pd(s + 8, s23);
    for (int e = 0; e < 4; e++) {
        double *se = s + 4 * e;
        for (int64_t t = i, j = 0; t < n; t++, j++) se[j] += (double)x[t] * (double)w[e][t];
        out[e] = (float)((se[0] + se[1]) + (se[2] + se[3]));
    }
}
#endif

typedef struct {
    const float *x, *gate;
    int64_t ldx, hidden, experts, top_k;
    int norm_topk;
    float *weights;
    int64_t *chosen;
} Route;

static void route_rows(const void *args, int64_t lo, int64_t hi) {
    const Route *a = args;
    float p[MAX_EXPERTS];
    for (int64_t r = lo; r < hi; r++) {
        const float *xr = a->x + r * a->ldx;
        float mx = -INFINITY;
        int64_t e0 = 0;
#if defined(__AVX512F__)
        for (; e0 + 4 <= a->experts; e0 += 4) {
            const float *w[4] = {a->gate + e0 * a->hidden, a->gate + (e0 + 1) * a->hidden, a->gate + (e0 + 2) * a->hidden,
                                 a->gate + (e0 + 3) * a->hidden};
            logits4(xr, w, a->hidden, p + e0);
        }
#endif
        for (int64_t e = e0; e < a->experts; e++) p[e] = logit(xr, a->gate + e * a->hidden, a->hidden);
        for (int64_t e = 0; e < a->experts; e++) mx = p[e] > mx || isnan(p[e]) ? p[e] : mx;
        float sum = 0.0f;
        for (int64_t e = 0; e < a->experts; e++) {
            p[e] = expf(p[e] - mx);
            sum += p[e];
        }
        for (int64_t e = 0; e < a->experts; e++) p[e] = p[e] / sum;
        float *w = a->weights + r * a->top_k;
        int64_t *c = a->chosen + r * a->top_k;
        for (int64_t j = 0; j < a->top_k; j++) { /* selection: top_k is small */
            int64_t best = -1;
            for (int64_t e = 0; e < a->experts; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= c[i] == e;
                if (!taken && (best < 0 || p[e] > p[best] || (isnan(p[e]) && !isnan(p[best])))) best = e;
            }
            c[j] = best;
            w[j] = p[best];
        }
        if (a->norm_topk) {
            float total = 0.0f;
            for (int64_t j = 0; j < a->top_k; j++) total += w[j];
            for (int64_t j = 0; j < a->top_k; j++) w[j] = w[j] / total;
        }
    }
}

/* weights [rows, top_k] float32 and chosen [rows, top_k] int64 for x [rows, ldx]; gate [experts,
   hidden]. Returns 0, or 1 for bad sizes. */
int lowbit_moe_route(const float *x, int64_t ldx, int64_t rows, int64_t hidden, const float *gate, int64_t experts,
                     int64_t top_k, int norm_topk, float *weights, int64_t *chosen, int threads) {
    if (rows < 0 || hidden <= 0 || experts <= 0 || experts > MAX_EXPERTS || top_k <= 0 || top_k > experts) return 1;
    const Route a = {x, gate, ldx, hidden, experts, top_k, norm_topk, weights, chosen};
    /* a row is experts x hidden multiply-adds: thread only when there are enough of them */
    lowbit_for_items(rows, rows * experts * hidden >= (1 << 18) && threads > 1 && rows > 1, threads, route_rows, &a);
    return 0;
}

/* out[r] = sigmoid(x_r . w) for Qwen2-MoE's shared-expert gate (w [hidden]). */
int lowbit_moe_shared_gate(const float *x, int64_t ldx, int64_t rows, int64_t hidden, const float *w, float *out) {
    if (rows < 0 || hidden <= 0) return 1;
    for (int64_t r = 0; r < rows; r++) out[r] = 1.0f / (1.0f + expf(-logit(x + r * ldx, w, hidden)));
    return 0;
}

/* CPU decode attention over the engine's paged KV pool, with the rotary embedding and the KV
   write fused in: one call per layer replaces ~25 small torch ops (rotate q and k, write k and v
   at the step's slots, gather each sequence's context, mask, SDPA).

   Rows t = 0..T-1 are the step's new tokens (decodes and short verifies, all of the step).
   For each row: k_t and q_t are rotated (half-split RoPE, cos/sin of the row's position, float32
   arithmetic on the stored dtype's values), k_t and v_t are written at slots[t]; then each query
   head attends to its sequence's positions lo..pos[t] (lo = pos - window + 1 with a sliding
   window), reading slots through the sequence's block table: scores in float32, max-subtracted
   softmax, weighted sum of values, output rounded once to the stored dtype.

   Every (row, head) gets the same operations in the same order whatever else is in the step
   (the query heads of a GQA group share each key and value read, but keep their own sums): the
   output of a row does not depend on the other rows of the step (batch invariance, which keeps
   speculative verification exact). dtype: 0 float32, 1 bf16 (q/k/v/cos/sin/out and the pool alike),
   2 float32 q/k/v/cos/sin/out over a bf16 pool (a float32 model's `--kv-dtype bf16`: k rotated in
   float32, then k and v rounded to bf16 as they are written; scores and value sums read the bf16
   pool widened exactly, against float32 queries and weights). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lowbit_native.h"

/* Short names for the shared element access and bf16 rounding (lowbit_native.h). */
#define ld lowbit_load
#define st lowbit_store
#define r16 lowbit_bf16_round

#define MAXD 512
#define MAXG 64 /* query heads per KV head */

/* Pool slot of position j: block_size is a power of two in the engine (16 by default), where a
   shift and mask replace two 64-bit divisions per position. */
static inline int64_t slot_of(const int64_t *bt, int64_t j, int64_t block_size) {
    if ((block_size & (block_size - 1)) == 0) {
        const int sh = __builtin_ctzll((unsigned long long)block_size);
        return (bt[j >> sh] << sh) + (j & (block_size - 1));
    }
    return bt[j / block_size] * block_size + j % block_size;
}

#if defined(__AVX512F__)
#define HAVE_AVX512_ATTN 1
#include <immintrin.h>
/* 16 pool values from element i on, as float32 (bf16 widened exactly by a 16-bit shift). */
static inline __m512 load16(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    return lowbit_bf16_widen16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
}

/* Each lane rounded to bf16 (nearest even, NaN kept quiet) exactly as st() does, as float32. */
static inline __m512 round16(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(lowbit_bf16_bits16(x), 16)); }

/* The sum of x's 16 lanes in one fixed order: y_l = x_l + x_{l+8}, z_l = y_l + y_{l+4}, then
   (z_0 + z_2) + (z_1 + z_3) (GCC's _mm512_reduce_add_ps order, written out so that hsum16x4
   below gives the very same bits four at a time whatever the compiler). */
static inline float hsum16(__m512 x) {
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    const __m128 z = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    const __m128 w = _mm_add_ps(z, _mm_permute_ps(z, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ps(w, _mm_permute_ps(w, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* hsum16 of four vectors at once, [hsum16(a0), .., hsum16(a3)], each by the same additions:
   17 instructions for four sums where four reductions take ~36 (the scores' reductions were
   half their instructions at head size 64). */
static inline __m128 hsum16x4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 b01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 2, 3, 2))); /* y of a0 | y of a1 */
    const __m512 b23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(b01, b23, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(b01, b23, _MM_SHUFFLE(3, 1, 3, 1))); /* z of a0 | a1 | a2 | a3 */
    const __m512 w = _mm512_add_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 v = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v));
}

/* e^x for x <= 0 (softmax numerators after the max is subtracted): Cody-Waite reduction by
   ln 2 and a degree-7 polynomial, within ~1 ulp of expf; below -87 the result is ~1e-38, which
   no sum of ones notices. 16 lanes per call instead of 16 calls into libm. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Without AVX-512: 8-lane versions of the generic loops' dot products, value sums and softmax
   exponentials (numbers of their own, batch-invariant the same way), the dot products four
   positions side by side and the value sums in registers (same bits as the plain 8-lane loops). */
#define HAVE_AVX2_ATTN 1
static inline __m256 load8(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    return lowbit_bf16_widen8(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}

/* exp16's reduction and polynomial in 8 lanes; 2^n built in the exponent bits (n >= -126 for
   x >= -87, so always a normal number). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* x (D values at src) rotated into out[D] (float32). bf16 rounds each product and sum, as
   torch's bf16 elementwise ops do; float32 rounds them too (no fused multiply-add), as torch. */
static inline void rotate(const void *src, int64_t off, const void *cs, const void *sn, int64_t coff, int64_t D,
                          int bf16, float *out) {
    const int64_t half = D / 2;
    int64_t i = 0;
#ifdef HAVE_AVX512_ATTN
    for (; i + 16 <= half; i += 16) {
        const __m512 x1 = load16(src, off + i, bf16), x2 = load16(src, off + half + i, bf16);
        const __m512 c = load16(cs, coff + i, bf16), s = load16(sn, coff + i, bf16);
        __m512 a, b;
        if (bf16) {
            a = round16(_mm512_sub_ps(round16(_mm512_mul_ps(x1, c)), round16(_mm512_mul_ps(x2, s))));
            b = round16(_mm512_add_ps(round16(_mm512_mul_ps(x2, c)), round16(_mm512_mul_ps(x1, s))));
        } else {
            a = _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s));
            b = _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s));
        }
        _mm512_storeu_ps(out + i, a);
        _mm512_storeu_ps(out + half + i, b);
    }
#endif
    for (; i < half; i++) {
        float x1 = ld(src, off + i, bf16), x2 = ld(src, off + half + i, bf16);
        float c = ld(cs, coff + i, bf16), s = ld(sn, coff + i, bf16);
        if (bf16) {
            out[i] = r16(r16(x1 * c) - r16(x2 * s));
            out[half + i] = r16(r16(x2 * c) + r16(x1 * s));
        } else {
            out[i] = x1 * c - x2 * s;
            out[half + i] = x2 * c + x1 * s;
        }
    }
}

/* Software prefetch. A step's keys and values come from DRAM (30 layers of a 16-sequence step
   outgrow the caches), scattered over blocks: without prefetching, a 16-row step read them at
   a fraction of the streaming rate. */
#define PREFETCH_AHEAD 16        /* positions */
#define PREFETCH_VALUES_MAX 1024 /* positions whose values the key pass fetches for the value pass */

/* Into L2 (prefetcht1) rather than L1: on a 16-row SmolLM2 step replayed over 30 pools, 16
   positions ahead into L2 was faster than 8 ahead into L1. */
static inline void prefetch_row(const void *pool, int64_t elem, int64_t bytes, int esize) {
    const char *a = (const char *)pool + elem * esize;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(a + b, 0, 2);
}

/* The register versions' (NV = D / 16, HC heads) for head size D and hc <= regs_heads(D) heads:
   CALL(NV, HC) with constants, then return. */
#define BY_HEADS(D, hc, CALL)                                  \
    do {                                                       \
        if ((D) == 64) {                                       \
            switch (hc) {                                      \
            case 1: CALL(4, 1); return;                        \
            case 2: CALL(4, 2); return;                        \
            case 3: CALL(4, 3); return;                        \
            case 4: CALL(4, 4); return;                        \
            default: CALL(4, 5); return;                       \
            }                                                  \
        }                                                      \
        if ((D) == 128) {                                      \
            if ((hc) == 1) CALL(8, 1); else CALL(8, 2);        \
            return;                                            \
        }                                                      \
        switch (hc) {                                          \
        case 1: CALL(16, 1); return;                           \
        case 2: CALL(16, 2); return;                           \
        case 3: CALL(16, 3); return;                           \
        default: CALL(16, 4); return;                          \
        }                                                      \
    } while (0)

/* Largest head count per scores_regs / values_regs call for head size D (0: no register version). */
static int64_t regs_heads(int64_t D) {
#ifdef HAVE_AVX512_ATTN
    return D == 64 ? 5 : D == 128 ? 2 : D == 256 ? 4 : 0;
#else
    (void)D;
    return 0;
#endif
}

#if defined(HAVE_AVX512_ATTN) && defined(__AVX512BF16__)
#define HAVE_BF16_SCORES 1
/* scores_regs() for bf16 pools: the rotated queries are bf16 values already, so the keys' raw
   bf16 pairs go straight into `vdpbf16ps` (products exact in float32), 32 elements per
   instruction and no widening of the keys. */
static inline __attribute__((always_inline)) void scores_bf16(const int NV, const int HC, const float *qv, int64_t nk,
                                                             int64_t lo, int64_t p, const int64_t *bt, int64_t block_size,
                                                             int64_t row, int64_t off, const void *kpool, const void *vpool,
                                                             float scale, float *sc, int64_t ml, int fetch_values) {
    const int64_t bytes = nk * 16 * NV * 2;
    __m512bh qb[64 * 8 / 2]; /* nk * HC * NV / 2 pair vectors (up to MAXG heads of 256 / 32) */
    for (int64_t h = 0; h < nk * HC; h++)
        for (int i = 0; i < NV / 2; i++)
            qb[h * (NV / 2) + i] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qv + h * 16 * NV + 32 * i + 16),
                                                        _mm512_loadu_ps(qv + h * 16 * NV + 32 * i));
    for (int64_t j = lo; j <= p; j++) {
        const int64_t base = slot_of(bt, j, block_size) * row + off;
        if (j + PREFETCH_AHEAD <= p) prefetch_row(kpool, slot_of(bt, j + PREFETCH_AHEAD, block_size) * row + off, bytes, 2);
        if (fetch_values) prefetch_row(vpool, base, bytes, 2);
        for (int64_t k = 0; k < nk; k++) {
            __m512bh kr[8];
            for (int i = 0; i < NV / 2; i++)
                kr[i] = (__m512bh)_mm512_loadu_si512((const uint16_t *)kpool + base + k * 16 * NV + 32 * i);
            const __m512bh *qk = qb + k * HC * (NV / 2);
            float *sk = sc + k * HC * ml + j - lo;
            for (int g = 0; g < HC; g++) {
                __m512 lanes = _mm512_dpbf16_ps(_mm512_setzero_ps(), qk[g * (NV / 2)], kr[0]);
                for (int i = 1; i < NV / 2; i++) lanes = _mm512_dpbf16_ps(lanes, qk[g * (NV / 2) + i], kr[i]);
                sk[g * ml] = _mm512_reduce_add_ps(lanes) * scale;
            }
        }
    }
}
#endif

#ifdef HAVE_AVX512_ATTN
/* scores() for HC query heads per KV head and D = 16 * NV (constant per call site), each key
   row in registers while its heads use it, from position j0 on. The first product starts each
   sum, as 0 + x = x does in the generic loop. */
static inline __attribute__((always_inline)) void scores_regs(const int NV, const int HC, const float *qv, int64_t nk,
                                                             int64_t lo, int64_t p, const int64_t *bt, int64_t block_size,
                                                             int64_t row, int64_t off, const void *kpool, const void *vpool,
                                                             int bf16, float scale, float *sc, int64_t ml, int fetch_values,
                                                             int64_t j0) {
    const int esize = bf16 ? 2 : 4;
    const int64_t bytes = nk * 16 * NV * esize;
    for (int64_t j = j0; j <= p; j++) {
        const int64_t base = slot_of(bt, j, block_size) * row + off;
        if (j + PREFETCH_AHEAD <= p) prefetch_row(kpool, slot_of(bt, j + PREFETCH_AHEAD, block_size) * row + off, bytes, esize);
        if (fetch_values) prefetch_row(vpool, base, bytes, esize);
        for (int64_t k = 0; k < nk; k++) {
            __m512 kr[16];
            for (int i = 0; i < NV; i++) kr[i] = load16(kpool, base + k * 16 * NV + 16 * i, bf16);
            const float *qk = qv + k * HC * 16 * NV;
            float *sk = sc + k * HC * ml + j - lo;
            for (int g = 0; g < HC; g++) {
                __m512 lanes = _mm512_mul_ps(_mm512_loadu_ps(qk + g * 16 * NV), kr[0]);
                for (int i = 1; i < NV; i++) lanes = _mm512_add_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(qk + g * 16 * NV + 16 * i), kr[i]));
                sk[g * ml] = hsum16(lanes) * scale;
            }
        }
    }
}

/* scores_regs over positions lo.. four at a time, their lanes summed together (hsum16x4: the
   same bits as one by one, half the instructions of the reductions); returns the first position
   left for scores_regs. Taken with several heads per KV head or a bf16 pool (10-15 % faster at
   2048 positions on SmolLM2, prefill and decode); not for one head over a float32 pool, where
   decode measured 15 % slower with it, the keys' reads bounding the loop. */
static inline __attribute__((always_inline)) int64_t scores_regs4(const int NV, const int HC, const float *qv, int64_t nk,
                                                                 int64_t lo, int64_t p, const int64_t *bt, int64_t block_size,
                                                                 int64_t row, int64_t off, const void *kpool, const void *vpool,
                                                                 int bf16, float scale, float *sc, int64_t ml, int fetch_values) {
    const int esize = bf16 ? 2 : 4;
    const int64_t bytes = nk * 16 * NV * esize;
    const __m128 sv = _mm_set1_ps(scale);
    int64_t j = lo;
    for (; j + 3 <= p; j += 4) {
        int64_t base[4];
        for (int b = 0; b < 4; b++) {
            base[b] = slot_of(bt, j + b, block_size) * row + off;
            if (j + b + PREFETCH_AHEAD <= p)
                prefetch_row(kpool, slot_of(bt, j + b + PREFETCH_AHEAD, block_size) * row + off, bytes, esize);
            if (fetch_values) prefetch_row(vpool, base[b], bytes, esize);
        }
        for (int64_t k = 0; k < nk; k++) {
            const float *qk = qv + k * HC * 16 * NV;
            __m512 lanes[5][4];
            for (int b = 0; b < 4; b++) {
                __m512 kr[16];
                for (int i = 0; i < NV; i++) kr[i] = load16(kpool, base[b] + k * 16 * NV + 16 * i, bf16);
                for (int g = 0; g < HC; g++) {
                    __m512 l = _mm512_mul_ps(_mm512_loadu_ps(qk + g * 16 * NV), kr[0]);
                    for (int i = 1; i < NV; i++) l = _mm512_add_ps(l, _mm512_mul_ps(_mm512_loadu_ps(qk + g * 16 * NV + 16 * i), kr[i]));
                    lanes[g][b] = l;
                }
            }
            float *sk = sc + k * HC * ml + j - lo;
            for (int g = 0; g < HC; g++)
                _mm_storeu_ps(sk + g * ml, _mm_mul_ps(hsum16x4(lanes[g][0], lanes[g][1], lanes[g][2], lanes[g][3]), sv));
        }
    }
    return j;
}

/* scores_regs4 for the head size and head count of BY_HEADS, its first position left for
   scores_regs into *j0, behind one call that is never inlined: inlined into scores() beside the
   per-position loops, it made the compiler lay out those loops worse (one head over a float32
   pool at 2048 positions: 6.8 -> 8.5 ms for 30 layers). */
static __attribute__((noinline)) void scores_blocks(int64_t D, int64_t hc, const float *qv, int64_t nk, int64_t lo,
                                                    int64_t p, const int64_t *bt, int64_t block_size, int64_t row,
                                                    int64_t off, const void *kpool, const void *vpool, int bf16, float scale,
                                                    float *sc, int64_t ml, int fetch_values, int64_t *j0) {
#define S4(NV, HC) *j0 = scores_regs4(NV, HC, qv, nk, lo, p, bt, block_size, row, off, kpool, vpool, bf16, scale, sc, ml, fetch_values)
    BY_HEADS(D, hc, S4);
#undef S4
}
#endif

#ifdef HAVE_AVX2_ATTN
#define SCORE_BLOCK 4 /* positions whose dot products run side by side */
/* The generic AVX2 loop's dot products (below), SCORE_BLOCK positions at a time: each (position,
   head) gets the very same operations (a chain of 8-lane multiply, then add, from zero, then
   lowbit_hsum8), but four independent chains keep the adder busy where one waited on its own
   latency. Returns the first position left to the generic loop. */
static int64_t scores_avx2_blocks(const float *qv, int64_t nk, int64_t hc, int64_t D, int64_t lo, int64_t p, const int64_t *bt,
                                  int64_t block_size, int64_t row, int64_t off, const void *kpool, const void *vpool, int bf16,
                                  float scale, float *sc, int64_t ml, int64_t bytes, int fetch_values) {
    const int esize = bf16 ? 2 : 4;
    int64_t j = lo;
    for (; j + SCORE_BLOCK - 1 <= p; j += SCORE_BLOCK) {
        int64_t base[SCORE_BLOCK];
        for (int b = 0; b < SCORE_BLOCK; b++) {
            base[b] = slot_of(bt, j + b, block_size) * row + off;
            if (j + b + PREFETCH_AHEAD <= p)
                prefetch_row(kpool, slot_of(bt, j + b + PREFETCH_AHEAD, block_size) * row + off, bytes, esize);
            if (fetch_values) prefetch_row(vpool, base[b], bytes, esize);
        }
        for (int64_t h = 0; h < nk * hc; h++) {
            const int64_t kh = (h / hc) * D;
            const float *qh = qv + h * D;
            __m256 l0 = _mm256_setzero_ps(), l1 = _mm256_setzero_ps(), l2 = _mm256_setzero_ps(), l3 = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 q = _mm256_loadu_ps(qh + d);
                l0 = _mm256_add_ps(l0, _mm256_mul_ps(q, load8(kpool, base[0] + kh + d, bf16)));
                l1 = _mm256_add_ps(l1, _mm256_mul_ps(q, load8(kpool, base[1] + kh + d, bf16)));
                l2 = _mm256_add_ps(l2, _mm256_mul_ps(q, load8(kpool, base[2] + kh + d, bf16)));
                l3 = _mm256_add_ps(l3, _mm256_mul_ps(q, load8(kpool, base[3] + kh + d, bf16)));
            }
            float *sh = sc + h * ml + j - lo;
            sh[0] = lowbit_hsum8(l0) * scale;
            sh[1] = lowbit_hsum8(l1) * scale;
            sh[2] = lowbit_hsum8(l2) * scale;
            sh[3] = lowbit_hsum8(l3) * scale;
        }
    }
    return j;
}
#endif

/* Query-key scores against positions lo..p for nk consecutive KV heads (from element `off` of a
   pool row) with hc query heads each: head k * hc + g has its rotated query at qv[(k * hc + g) * D]
   and gets sc[(k * hc + g) * ml + j - lo] = (q . k_j) * scale. A position's keys are read once
   for all the heads, in pool order; the keys PREFETCH_AHEAD positions on, and (for contexts up
   to PREFETCH_VALUES_MAX) this position's values, are prefetched. */
static void scores(const float *qv, int64_t nk, int64_t hc, int64_t D, int64_t lo, int64_t p, const int64_t *bt,
                   int64_t block_size, int64_t row, int64_t off, const void *kpool, const void *vpool, int bf16, int q_bf16,
                   float scale, float *sc, int64_t ml) {
    const int esize = bf16 ? 2 : 4;
    const int64_t bytes = nk * D * esize;
    const int fetch_values = p - lo < PREFETCH_VALUES_MAX;
    for (int64_t j = lo; j < lo + PREFETCH_AHEAD && j <= p; j++) prefetch_row(kpool, slot_of(bt, j, block_size) * row + off, bytes, esize);
#ifdef HAVE_AVX512_ATTN
    if (regs_heads(D) >= hc) {
        /* several heads per KV head, or a bf16 pool: four positions at a time first (scores_regs4) */
        int64_t j0 = lo;
        if ((hc > 1 || bf16) && !(bf16 && q_bf16) && !(D > 128 && hc > 1))
            scores_blocks(D, hc, qv, nk, lo, p, bt, block_size, row, off, kpool, vpool, bf16, scale, sc, ml, fetch_values, &j0);
#ifdef HAVE_BF16_SCORES
#define SR(NV, HC)                                                                                                 \
    do {                                                                                                           \
        if (bf16 && q_bf16) scores_bf16(NV, HC, qv, nk, lo, p, bt, block_size, row, off, kpool, vpool, scale, sc, ml, fetch_values); \
        else scores_regs(NV, HC, qv, nk, lo, p, bt, block_size, row, off, kpool, vpool, bf16, scale, sc, ml, fetch_values, j0); \
    } while (0)
#else
#define SR(NV, HC) scores_regs(NV, HC, qv, nk, lo, p, bt, block_size, row, off, kpool, vpool, bf16, scale, sc, ml, fetch_values, j0)
    (void)q_bf16;
#endif
        BY_HEADS(D, hc, SR);
#undef SR
    }
#endif
    int64_t j = lo;
#ifdef HAVE_AVX2_ATTN
    if (D % 8 == 0) j = scores_avx2_blocks(qv, nk, hc, D, lo, p, bt, block_size, row, off, kpool, vpool, bf16, scale, sc, ml,
                                           bytes, fetch_values);
#endif
    for (; j <= p; j++) {
        const int64_t base = slot_of(bt, j, block_size) * row + off;
        if (j + PREFETCH_AHEAD <= p) prefetch_row(kpool, slot_of(bt, j + PREFETCH_AHEAD, block_size) * row + off, bytes, esize);
        if (fetch_values) prefetch_row(vpool, base, bytes, esize);
        for (int64_t h = 0; h < nk * hc; h++) {
            const int64_t kb = base + (h / hc) * D;
            const float *qh = qv + h * D;
#ifdef HAVE_AVX512_ATTN
            if (D % 16 == 0) {
                __m512 lanes = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 16)
                    lanes = _mm512_add_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(qh + d), load16(kpool, kb + d, bf16)));
                sc[h * ml + j - lo] = hsum16(lanes) * scale;
                continue;
            }
#elif defined(HAVE_AVX2_ATTN)
            if (D % 8 == 0) {
                __m256 lanes = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8)
                    lanes = _mm256_add_ps(lanes, _mm256_mul_ps(_mm256_loadu_ps(qh + d), load8(kpool, kb + d, bf16)));
                sc[h * ml + j - lo] = lowbit_hsum8(lanes) * scale;
                continue;
            }
#endif
            float lanes[16] = {0};
            for (int64_t d = 0; d < D; d++) lanes[d & 15] += qh[d] * ld(kpool, kb + d, bf16);
            float s = 0.0f;
            for (int i = 0; i < 16; i++) s += lanes[i];
            sc[h * ml + j - lo] = s * scale;
        }
    }
}

/* sc[0..n) -> exp(sc - max) in place; returns their sum (the softmax denominator). */
static float softmax_numerators(float *sc, int64_t n) {
#ifdef HAVE_AVX512_ATTN
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lowbit_lanes(n - i);
        mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, sc + i));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = lowbit_lanes(n - i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + i), m));
        _mm512_mask_storeu_ps(sc + i, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
#elif defined(HAVE_AVX2_ATTN)
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = sc[i] > mx ? sc[i] : mx;
    const __m256 m = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), m));
        _mm256_storeu_ps(sc + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (i < n) { /* the tail through a padded copy: the same polynomial for every position */
        float t[8];
        for (int j = 0; j < 8; j++) t[j] = i + j < n ? sc[i + j] - mx : -INFINITY;
        _mm256_storeu_ps(t, exp8(_mm256_loadu_ps(t)));
        float tail = 0.0f;
        for (int j = 0; i + j < n; j++) {
            sc[i + j] = t[j];
            tail += t[j];
        }
        return lowbit_hsum8(sum) + tail;
    }
    return lowbit_hsum8(sum);
#else
    float mx = -INFINITY, total = 0.0f;
    for (int64_t i = 0; i < n; i++) mx = sc[i] > mx ? sc[i] : mx;
    for (int64_t i = 0; i < n; i++) {
        sc[i] = expf(sc[i] - mx);
        total += sc[i];
    }
    return total;
#endif
}

#ifdef HAVE_AVX512_ATTN
/* acc[g * D ..] = sum_j e[g * ml + j - lo] * v_j for HC heads and D = 16 * NV, the HC * NV
   accumulator vectors held in registers (constant HC, NV per call site: an array indexed at run
   time would live in memory and chain every position through store-to-load forwarding). Each
   value row is read once for the HC heads. */
static inline __attribute__((always_inline)) void values_regs(const int NV, const int HC, const float *e, int64_t ml,
                                                             int64_t lo, int64_t p, const int64_t *bt, int64_t block_size,
                                                             int64_t row, int64_t off, const void *vpool, int bf16, float *acc) {
    const int64_t bytes = 16 * NV * (bf16 ? 2 : 4);
    if (HC * NV > 24) {
        /* D = 256 with several heads: 64 values of the row at a time, HC * 4 accumulators (the
           same fused multiply-add per lane and position in order as below, so the same bits);
           each row's slice read once for the HC heads */
        for (int i0 = 0; i0 < NV; i0 += 4) {
            __m512 c[4][4];
            for (int g = 0; g < HC; g++)
                for (int i = 0; i < 4; i++) c[g][i] = _mm512_setzero_ps();
            for (int64_t j = lo; j <= p; j++) {
                const int64_t base = slot_of(bt, j, block_size) * row + off + 16 * i0;
                if (i0 == 0 && j + PREFETCH_AHEAD <= p)
                    prefetch_row(vpool, slot_of(bt, j + PREFETCH_AHEAD, block_size) * row + off, bytes, bf16 ? 2 : 4);
                __m512 v[4];
                for (int i = 0; i < 4; i++) v[i] = load16(vpool, base + 16 * i, bf16);
                for (int g = 0; g < HC; g++) {
                    const __m512 ev = _mm512_set1_ps(e[g * ml + j - lo]);
                    for (int i = 0; i < 4; i++) c[g][i] = _mm512_fmadd_ps(ev, v[i], c[g][i]);
                }
            }
            for (int g = 0; g < HC; g++)
                for (int i = 0; i < 4; i++) _mm512_storeu_ps(acc + g * 16 * NV + 16 * (i0 + i), c[g][i]);
        }
        return;
    }
    __m512 a[24];
    for (int i = 0; i < HC * NV; i++) a[i] = _mm512_setzero_ps();
    for (int64_t j = lo; j <= p; j++) {
        const int64_t base = slot_of(bt, j, block_size) * row + off;
        if (j + PREFETCH_AHEAD <= p) prefetch_row(vpool, slot_of(bt, j + PREFETCH_AHEAD, block_size) * row + off, bytes, bf16 ? 2 : 4);
        __m512 v[16];
        for (int i = 0; i < NV; i++) v[i] = load16(vpool, base + 16 * i, bf16);
        for (int g = 0; g < HC; g++) {
            const __m512 ev = _mm512_set1_ps(e[g * ml + j - lo]);
            for (int i = 0; i < NV; i++) a[g * NV + i] = _mm512_fmadd_ps(ev, v[i], a[g * NV + i]);
        }
    }
    for (int g = 0; g < HC; g++)
        for (int i = 0; i < NV; i++) _mm512_storeu_ps(acc + g * 16 * NV + 16 * i, a[g * NV + i]);
}
#endif

/* The weighted value sums of hc heads into acc[hc * D]; the same operations per head whatever
   hc is, so the bits do not depend on how heads are grouped. */
static void values(const float *e, int64_t hc, int64_t ml, int64_t D, int64_t lo, int64_t p, const int64_t *bt,
                   int64_t block_size, int64_t row, int64_t off, const void *vpool, int bf16, float *acc) {
#ifdef HAVE_AVX512_ATTN
    if (regs_heads(D) >= hc) {
#define VR(NV, HC) values_regs(NV, HC, e, ml, lo, p, bt, block_size, row, off, vpool, bf16, acc)
        BY_HEADS(D, hc, VR);
#undef VR
    }
#endif
#ifdef HAVE_AVX2_ATTN
    if (D % 64 == 0) {
        /* The generic loop's sums (each element: multiply, then add, position by position) with
           the accumulators of one head's 64-value slice in registers instead of in acc, where
           every position's add waited on the previous one's store. */
        for (int64_t g = 0; g < hc; g++)
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
                for (int64_t j = lo; j <= p; j++) {
                    const int64_t base = slot_of(bt, j, block_size) * row + off + d0;
                    const __m256 ev = _mm256_set1_ps(e[g * ml + j - lo]);
                    for (int i = 0; i < 8; i++) a[i] = _mm256_add_ps(a[i], _mm256_mul_ps(ev, load8(vpool, base + 8 * i, bf16)));
                }
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + g * D + d0 + 8 * i, a[i]);
            }
        return;
    }
#endif
    for (int64_t i = 0; i < hc * D; i++) acc[i] = 0.0f;
    for (int64_t j = lo; j <= p; j++) {
        const int64_t base = slot_of(bt, j, block_size) * row + off;
        for (int64_t g = 0; g < hc; g++) {
            const float w = e[g * ml + j - lo];
            float *a = acc + g * D;
#ifdef HAVE_AVX512_ATTN
            if (D % 16 == 0) {
                const __m512 ev = _mm512_set1_ps(w);
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(a + d, _mm512_add_ps(_mm512_loadu_ps(a + d), _mm512_mul_ps(ev, load16(vpool, base + d, bf16))));
                continue;
            }
#elif defined(HAVE_AVX2_ATTN)
            if (D % 8 == 0) {
                const __m256 ev = _mm256_set1_ps(w);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(a + d, _mm256_add_ps(_mm256_loadu_ps(a + d), _mm256_mul_ps(ev, load8(vpool, base + d, bf16))));
                continue;
            }
#endif
            for (int64_t d = 0; d < D; d++) a[d] += w * ld(vpool, base + d, bf16);
        }
    }
}

/* out[off .. off + D) = acc * inv, rounded once to the stored dtype. */
static void store_scaled(void *out, int64_t off, const float *acc, float inv, int64_t D, int bf16) {
    int64_t d = 0;
#ifdef HAVE_AVX512_ATTN
    const __m512 iv = _mm512_set1_ps(inv);
    for (; d + 16 <= D; d += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(acc + d), iv);
        if (bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + off + d), _mm512_cvtepi32_epi16(lowbit_bf16_bits16(x)));
        else
            _mm512_storeu_ps((float *)out + off + d, x);
    }
#endif
    for (; d < D; d++) st(out, off + d, acc[d] * inv, bf16);
}

/* The arguments of every entry point below (lowbit_paged_decode's). */
#define PAGED_ARGS                                                                                                   \
    const void *q, int64_t ldq, const void *k, int64_t ldk, const void *v, int64_t ldv, const void *cs, const void *sn, \
        int dtype, const int64_t *pos, const int64_t *slots, const int64_t *item, const int64_t *tables, int64_t nb,   \
        void *kpool, void *vpool, void *out, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t block_size,       \
        int64_t window, float scale, int threads

static int bad_shape(int dtype, int64_t H, int64_t KVH, int64_t D) {
    return dtype < 0 || dtype > 2 || D > MAXD || D % 2 || H / KVH > MAXG || (H / KVH) * KVH != H;
}

/* 1. rotate k and write k, v into the pool (bf16 rotations are already rounded, so the store
   below only drops zero bits; float32 ones into a bf16 pool are rounded there). A part call
   (lowbit_native.h) writes its share of the rows. */
int lowbit_paged_write(PAGED_ARGS) {
    (void)q, (void)ldq, (void)pos, (void)item, (void)tables, (void)nb, (void)out, (void)H, (void)block_size, (void)window,
        (void)scale;
    if (bad_shape(dtype, H, KVH, D)) return -1;
    const int bf16 = dtype == 1, pool16 = dtype == 1 || dtype == 2;
    const int64_t half = D / 2, row = KVH * D, esize = bf16 ? 2 : 4, psize = pool16 ? 2 : 4;
    lowbit_team(threads); /* no region here: only a part call's share of the rows matters */
    int64_t t0 = 0, t1 = T;
    lowbit_part_share(T, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        float buf[MAXD];
        for (int64_t h = 0; h < KVH; h++) {
            char *kdst = (char *)kpool + (slots[t] * row + h * D) * psize;
            char *vdst = (char *)vpool + (slots[t] * row + h * D) * psize;
            if (cs) {
                rotate(k, t * ldk + h * D, cs, sn, t * half, D, bf16, buf);
                for (int64_t d = 0; d < D; d++) st(kdst, d, buf[d], pool16);
            } else if (bf16 == pool16) {
                memcpy(kdst, (const char *)k + (t * ldk + h * D) * esize, (size_t)(D * esize));
            } else {
                for (int64_t d = 0; d < D; d++) st(kdst, d, ld(k, t * ldk + h * D + d, bf16), pool16);
            }
            if (bf16 == pool16) {
                memcpy(vdst, (const char *)v + (t * ldv + h * D) * esize, (size_t)(D * esize));
            } else {
                for (int64_t d = 0; d < D; d++) st(vdst, d, ld(v, t * ldv + h * D + d, bf16), pool16);
            }
        }
    }
    return 0;
}

/* The work items of an attention call and what every item reads. */
typedef struct {
    const void *q, *cs, *sn;
    int64_t ldq;
    const int64_t *pos, *item, *tables;
    int64_t nb;
    const void *kpool, *vpool;
    void *out;
    int64_t H, KVH, D, block_size, window, group, most, maxlen;
    float scale;
    int bf16, pool16, whole_rows;
} Attend;

/* The first position row t attends to, and how many. */
static inline int64_t row_first(const Attend *a, int64_t t) {
    const int64_t p = a->pos[t];
    return a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
}
static inline int64_t row_positions(const Attend *a, int64_t t) { return a->pos[t] - row_first(a, t) + 1; }

/* Query heads h0..h0+n-1 of row t into out: n heads of KV head kh's group (nk = 1), or nk whole
   groups from KV head 0 (h0 = kh = 0, n = group). Per-thread buffers sc [H, maxlen], qv and acc
   [H, D]. */
static void attend_heads(const Attend *a, int64_t t, int64_t kh, int64_t h0, int64_t nk, int64_t n, float *sc, float *qv,
                         float *acc) {
    const int64_t D = a->D, half = D / 2, row = a->KVH * D, maxlen = a->maxlen;
    for (int64_t g = 0; g < nk * n; g++) {
        if (a->cs) rotate(a->q, t * a->ldq + (h0 + g) * D, a->cs, a->sn, t * half, D, a->bf16, qv + g * D);
        else for (int64_t d = 0; d < D; d++) qv[g * D + d] = ld(a->q, t * a->ldq + (h0 + g) * D + d, a->bf16);
    }
    const int64_t p = a->pos[t], lo = row_first(a, t);
    const int64_t *bt = a->tables + a->item[t] * a->nb;
    scores(qv, nk, n, D, lo, p, bt, a->block_size, row, kh * D, a->kpool, a->vpool, a->pool16, a->bf16, a->scale, sc, maxlen);
    for (int64_t k = 0; k < nk; k++) {
        float inv[MAXG];
        float *sk = sc + k * n * maxlen;
        for (int64_t g = 0; g < n; g++) inv[g] = 1.0f / softmax_numerators(sk + g * maxlen, p - lo + 1);
        values(sk, n, maxlen, D, lo, p, bt, a->block_size, row, (kh + k) * D, a->vpool, a->pool16, acc);
        for (int64_t g = 0; g < n; g++)
            store_scaled(a->out, t * a->H * D + (h0 + k * n + g) * D, acc + g * D, inv[g], D, a->bf16);
    }
}

/* Row t whole: every KV head's group of query heads. */
static void attend_row(const Attend *a, int64_t t, float *sc, float *qv, float *acc) {
    attend_heads(a, t, 0, 0, a->KVH, a->group, sc, qv, acc);
}

/* Part `part` of `parts` of the rows' query heads [*lo, *hi) (row t's head h is t * H + h), cut
   where the positions read so far reach part / parts of the step's: a head costs its row's
   positions (and a few for its query), so a prefill chunk's early rows, which attend to fewer
   positions, are not all one thread's. */
static void heads_share(const Attend *a, int64_t T, int part, int parts, int64_t *lo, int64_t *hi) {
    double total = 0.0;
    for (int64_t t = 0; t < T; t++) total += (double)a->H * (double)(row_positions(a, t) + 16);
    const double from = total * part / parts, to = total * (part + 1) / parts;
    double at = 0.0;
    *lo = *hi = T * a->H;
    int found_lo = 0;
    for (int64_t t = 0; t < T; t++) {
        const double c = (double)(row_positions(a, t) + 16);
        for (int64_t h = 0; h < a->H; h++, at += c) {
            if (!found_lo && at >= from) *lo = t * a->H + h, found_lo = 1;
            if (at >= to) {
                *hi = t * a->H + h;
                return;
            }
        }
    }
}

/* A thread's share of a step of few rows: query heads lo..hi-1 of the rows' heads in order (row
   t's head h is t * H + h), in runs of up to `most` heads of one KV head. A thread's heads are
   contiguous, so a KV head's group goes to one thread or two, and each run reads its keys and
   values once for all its heads: at one row, a thread holding heads 0-4 of SmolLM2's 9 (3 per KV
   head) reads two KV heads, where one head an item dealt out in turn had both threads read all
   three, for each head on its own (at 1024 positions 4.4-5.1 ms a token against 5.6-6.2, the same
   tokens). */
static void attend_heads_share(const Attend *a, int64_t lo, int64_t hi, float *sc, float *qv, float *acc) {
    for (int64_t x = lo; x < hi;) {
        const int64_t t = x / a->H, kh = (x % a->H) / a->group;
        int64_t stop = t * a->H + (kh + 1) * a->group; /* the end of the KV head's group */
        if (stop > hi) stop = hi;
        if (stop > x + a->most) stop = x + a->most;
        attend_heads(a, t, kh, x % a->H, 1, stop - x, sc, qv, acc);
        x = stop;
    }
}

/* One thread's scratch for attend_heads: scores [H, maxlen], a query and an accumulator [H, D];
   all three or none (scores NULL). 0, or -2 when out of memory. */
typedef struct {
    float *scores, *q, *acc;
} Scratch;

static void scratch_free(Scratch *s) {
    free(s->scores);
    free(s->q);
    free(s->acc);
    s->scores = s->q = s->acc = NULL;
}

static int scratch_new(const Attend *a, Scratch *s) {
    s->scores = malloc((size_t)(a->H * a->maxlen) * sizeof(float));
    s->q = malloc((size_t)(a->H * a->D) * sizeof(float));
    s->acc = malloc((size_t)(a->H * a->D) * sizeof(float));
    if (s->scores && s->q && s->acc) return 0;
    scratch_free(s);
    return -2;
}

/* 2. attention, once every row's k and v are in the pool. With enough rows, a thread's share is
   whole rows: each position's keys and values for all KV heads are one contiguous run of the pool,
   read once for all query heads. With few rows (batch 1, short verifies) it is a contiguous range
   of the rows' query heads (heads_share, attend_heads_share), so both threads get work. A head's result is the same
   whatever share computes it. A part call (lowbit_native.h) computes its share on the calling
   thread. */
int lowbit_paged_attend(PAGED_ARGS) {
    (void)k, (void)ldk, (void)v, (void)ldv, (void)slots;
    if (bad_shape(dtype, H, KVH, D)) return -1;
    threads = lowbit_team(threads);
    const int team = lowbit_part_count ? lowbit_part_count : threads;
    Attend a = {.q = q, .cs = cs, .sn = sn, .ldq = ldq, .pos = pos, .item = item, .tables = tables, .nb = nb, .kpool = kpool,
                .vpool = vpool, .out = out, .H = H, .KVH = KVH, .D = D, .block_size = block_size, .window = window,
                .group = H / KVH, .maxlen = 1, .scale = scale, .bf16 = dtype == 1, .pool16 = dtype == 1 || dtype == 2};
    for (int64_t t = 0; t < T; t++) a.maxlen = pos[t] + 1 > a.maxlen ? pos[t] + 1 : a.maxlen;
    a.most = regs_heads(D) > 0 ? regs_heads(D) : 8; /* query heads per KV head in one pass */
    a.whole_rows = T >= 2 * team && a.group <= a.most && H * D <= 8192; /* 8192: scores_bf16's query buffer */
    if (lowbit_part_count) { /* a part call: its share, on this thread */
        Scratch sc;
        const int rc = scratch_new(&a, &sc);
        /* whole rows dealt out in turn: a prefill chunk's later rows attend to more positions */
        if (rc == 0 && a.whole_rows) {
            for (int64_t t = lowbit_part_id; t < T; t += lowbit_part_count) attend_row(&a, t, sc.scores, sc.q, sc.acc);
        } else if (rc == 0) {
            int64_t lo, hi;
            heads_share(&a, T, lowbit_part_id, lowbit_part_count, &lo, &hi);
            attend_heads_share(&a, lo, hi, sc.scores, sc.q, sc.acc);
        }
        scratch_free(&sc);
        return rc;
    }
    int fail = 0;
#pragma omp parallel num_threads(threads)
    {
        Scratch sc;
        const int ok = scratch_new(&a, &sc) == 0;
        if (!ok) {
#pragma omp atomic write
            fail = 1;
        }
        if (a.whole_rows) {
#pragma omp for schedule(dynamic)
            for (int64_t t = 0; t < T; t++)
                if (ok) attend_row(&a, t, sc.scores, sc.q, sc.acc);
        } else if (ok) {
            int64_t lo, hi;
            heads_share(&a, T, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            attend_heads_share(&a, lo, hi, sc.scores, sc.q, sc.acc);
        }
        scratch_free(&sc);
    }
    return fail ? -2 : 0;
}

/* Both steps (the write, then attention over the pool it completed). */
int lowbit_paged_decode(PAGED_ARGS) {
    const int rc = lowbit_paged_write(q, ldq, k, ldk, v, ldv, cs, sn, dtype, pos, slots, item, tables, nb, kpool, vpool, out, T,
                                      H, KVH, D, block_size, window, scale, threads);
    if (rc != 0) return rc;
    return lowbit_paged_attend(q, ldq, k, ldk, v, ldv, cs, sn, dtype, pos, slots, item, tables, nb, kpool, vpool, out, T, H,
                               KVH, D, block_size, window, scale, threads);
}

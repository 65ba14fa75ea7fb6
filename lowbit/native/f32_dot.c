/* CPU matmul for dense float32 weights at a few rows of activations (decode steps, speculative
   verifies), with arithmetic per row that does not depend on how many rows are in the call:
   y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).

   Why: torch's float32 Linear takes a matrix-vector route for one row and a GEMM route that
   packs the weight for two or more (several times slower for the same weights), so a verify of
   1 + k rows cost about twice a plain step, and its rounding need not
   match the plain step's. Here every (m, n) is one 16-lane accumulator over k in order (the last
   partial vector masked), then one fixed horizontal sum, whatever M is and however rows are
   tiled; the weight is read from memory once per call.

   Layout: w [N, ldw] row-major float32 (lowbit_f32_matmul) or bfloat16 (lowbit_bf16w_matmul), x [M, ldx]
   row-major float32, y [M, ldy].

   lowbit_bf16_matmul is the bf16 model's version (AVX512-BF16): bf16 x and w, each product exact
   in float32 inside `vdpbf16ps` (two k per lane per instruction: twice the multiply-adds of a
   float32 FMA), float32 sums in the same fixed order for every row, y rounded once to bf16 (or
   left float32). Batch-invariant the same way. */

#include <stdint.h>
#include <stdlib.h>

#include "lowbit_native.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_F32DOT 1
#else
#define HAVE_F32DOT 0
#endif

#if HAVE_F32DOT && defined(__AVX512BF16__)
#define HAVE_BF16DOT 1
#else
#define HAVE_BF16DOT 0
#endif

/* Without AVX-512: the float32 modes through AVX2 + FMA, four 8-lane accumulators per output
   (numbers of their own, batch-invariant the same way; no bf16 x bf16 mode). */
#if !HAVE_F32DOT && defined(__AVX2__) && defined(__FMA__)
#define HAVE_F32AVX2 1
#else
#define HAVE_F32AVX2 0
#endif

/* bf16 x bf16 in passes of four x rows over a 4 x 4 tile (bf16_tile16); 0: passes of MT rows */
#if HAVE_BF16DOT && !defined(BF16_TILE16)
#define BF16_TILE16 1
#endif
#ifndef BF16_TILE16
#define BF16_TILE16 0
#endif

int lowbit_f32dot_available(void) { return HAVE_F32DOT || HAVE_F32AVX2; }
int lowbit_bf16dot_available(void) { return HAVE_BF16DOT; }

#if HAVE_F32DOT
#define NT 4 /* weight rows per tile */
/* Passes of 5 and more x rows (f32_tile; up to 4 read row by row, f32_rows below): each k step
   also prefetches, into L2, the same k of the next tile's rows: a tile's four rows are four short
   streams (2.3 KB each at K = 576) that the hardware prefetcher barely learns before they end.
   Into L2 beat no prefetch at 1 and 4 rows on SmolLM2's Linears; into L1 (_MM_HINT_T0) was slower
   at 4 rows, and two tiles ahead no better. */
#define PREFETCH_TILE 1
#define MT 6 /* x rows per pass: 24 accumulators, 6 x vectors, one weight vector (a verify of 1 + 4 or 1 + 5 rows is one pass; bf16 x bf16 passes: pass_rows) */

/* Sixteen weights as float32: WB = 4 reads float32, WB = 2 reads bfloat16 and widens it exactly
   (a bf16 is the top half of its float32), so a bf16 weight gives bit for bit the float32 result
   of its widened copy, from half the bytes. */
INLINE __m512 wload(const int WB, const void *w, int64_t i) {
    if (WB == 4) return _mm512_loadu_ps((const float *)w + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i))), 16));
}

INLINE __m512 wload_tail(const int WB, __mmask16 mask, const void *w, int64_t i) {
    if (WB == 4) return _mm512_maskz_loadu_ps(mask, (const float *)w + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + i)), 16));
}

INLINE void f32_tile(const int WB, const int NB, const int MB, const void *w, int64_t ldw, int64_t K, const float *x,
                     int64_t ldx, float *out) {
    const char *wb = (const char *)w;
    __m512 acc[NT][MT];
    for (int nb = 0; nb < NB; nb++)
        for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[MT];
        for (int m = 0; m < MB; m++) xv[m] = _mm512_loadu_ps(x + m * ldx + k);
        for (int nb = 0; nb < NB; nb++) {
            _mm_prefetch(wb + ((PREFETCH_TILE * NT + nb) * ldw + k) * WB, _MM_HINT_T1);
            const __m512 wv = wload(WB, wb + nb * ldw * WB, k);
            for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_fmadd_ps(wv, xv[m], acc[nb][m]);
        }
    }
    if (k < K) {
        const __mmask16 mask = lowbit_lanes(K - k);
        __m512 xv[MT];
        for (int m = 0; m < MB; m++) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
        for (int nb = 0; nb < NB; nb++) {
            const __m512 wv = wload_tail(WB, mask, wb + nb * ldw * WB, k);
            for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_fmadd_ps(wv, xv[m], acc[nb][m]);
        }
    }
    for (int nb = 0; nb < NB; nb++)
        for (int m = 0; m < MB; m++) out[m * NB + nb] = _mm512_reduce_add_ps(acc[nb][m]);
}

/* Up to 4 x rows (decode steps, small verifies): each weight row read front to back on its own,
   one accumulator per x row, with the row ROW_PREFETCH on pulled into L1 a line at a time, as the
   AVX2 section does. The same sums as f32_tile (one 16-lane accumulator per (n, m) over k in order,
   the masked tail, one reduce), so the same bits. Reading a tile's four rows side by side instead
   (four short streams, L2 prefetch of the next tile), SmolLM2's 30 bf16 layers from memory took
   7.8-8.3 / 7.5 / 7.2 ms at 1 / 2 / 4 rows against 5.8-6.3 / 5.8 / 6.4 ms row by row, and its
   49152 x 576 head at one row 1.67 against 1.30 ms (2 Zen 5 cores, alternated C calls).
   Prefetching 2, 8 or 16 rows ahead was slower than 4 there. On 2 Zen 4 cores, the head at one
   row called alternately with a build prefetching 4 rows ahead, each call after a 64 MB read had
   evicted it (as a decode step's layers do), 400 pairs: one row ahead 6.10 against 7.18 ms on
   Gemma-3's 262144 x 640, 2.76 against 2.98 on the synthetic MoE's 49152 x 1024, 1.47 against
   1.53 on SmolLM2's (none: mixed, two: between); in the engine SmolLM2 bf16's head 1.69-1.74
   against 2.00-2.01 ms, its layers 2 % faster, Gemma's the same at 36 GB/s. */
#ifndef ROW_PREFETCH
#define ROW_PREFETCH 1
#endif
INLINE void f32_rows(const int WB, const int NB, const int MB, const void *w, int64_t ldw, int64_t K, const float *x,
                     int64_t ldx, float *out) {
    for (int nb = 0; nb < NB; nb++) {
        const char *row = (const char *)w + nb * ldw * WB;
        const char *ahead = row + ROW_PREFETCH * ldw * WB;
        __m512 acc[MT];
        for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            if (ROW_PREFETCH && ((k * WB) & 63) == 0) _mm_prefetch(ahead + k * WB, _MM_HINT_T0);
            const __m512 wv = wload(WB, row, k);
            for (int m = 0; m < MB; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * ldx + k), acc[m]);
        }
        if (k < K) {
            const __mmask16 mask = lowbit_lanes(K - k);
            const __m512 wv = wload_tail(WB, mask, row, k);
            for (int m = 0; m < MB; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * ldx + k), acc[m]);
        }
        for (int m = 0; m < MB; m++) out[m * NB + nb] = _mm512_reduce_add_ps(acc[m]);
    }
}

/* A constant NB and MB per case so each compiles to its own fully unrolled loop. */
INLINE void f32_pass(const int WB, const int NB, int mb, const void *w, int64_t ldw, int64_t K, const float *x,
                     int64_t ldx, float *out) {
    switch (mb) {
    case 1: f32_rows(WB, NB, 1, w, ldw, K, x, ldx, out); break;
    case 2: f32_rows(WB, NB, 2, w, ldw, K, x, ldx, out); break;
    case 3: f32_rows(WB, NB, 3, w, ldw, K, x, ldx, out); break;
    case 4: f32_rows(WB, NB, 4, w, ldw, K, x, ldx, out); break;
    case 5: f32_tile(WB, NB, 5, w, ldw, K, x, ldx, out); break;
    default: f32_tile(WB, NB, 6, w, ldw, K, x, ldx, out); break;
    }
}

#if HAVE_BF16DOT
/* One 16-lane sum in a fixed tree: lanes j + (j + 8), then lowbit_hsum8's + 4, + 2, + 1 apart.
   hsum16_many gives every output the same tree, sixteen at a time. The upper 256 bits come
   through the AVX512F extract (the float32 one needs AVX512DQ). */
INLINE float hsum16(__m512 a) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return lowbit_hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), hi));
}

/* The sums of acc[0..15] (each by hsum16's tree: the same pairs added in the same order, so the
   same bits), lowbit_reduce16's: 45 vector operations instead of sixteen separate trees. Lane
   4k + p of the vector is accumulator 4p + k; hsum16_many stores them in order.
   bf16 x bf16 at q|k|v, o, gate|up and down of SmolLM2 (2 Zen 4 cores, alternated C calls, the
   same bits as GCC's _mm512_reduce_add_ps per output): 0.85x the time at 16 rows, 0.92x at 64,
   0.96x at 512. Dropping the next tile's prefetch as well gained nothing. */
INLINE __m512 hsum16_vec(const __m512 *acc) { return lowbit_reduce16(0, acc); }

INLINE void hsum16_many(const __m512 *acc, float *out) {
    const __m512 z = hsum16_vec(acc);
    float lanes[16];
    _mm512_storeu_ps(lanes, z);
    for (int k = 0; k < 4; k++)
        for (int p = 0; p < 4; p++) out[4 * p + k] = lanes[4 * k + p];
}

/* acc[nb][m] += the bf16 products of NB weight rows and MB x rows, 32 k per step: whole 32s loaded
   unmasked, the tail alone masked (the same operands either way). */
INLINE void bf16_accumulate(const int NB, const int MB, const uint16_t *w, int64_t ldw, int64_t K, const uint16_t *x,
                            int64_t ldx, __m512 acc[NT][MT]) {
    const int64_t k32 = K / 32 * 32;
    for (int64_t k = 0; k < k32; k += 32) {
        __m512bh xv[MT];
        for (int m = 0; m < MB; m++) xv[m] = (__m512bh)_mm512_loadu_si512((const void *)(x + m * ldx + k));
        for (int nb = 0; nb < NB; nb++) {
            _mm_prefetch((const char *)(w + (PREFETCH_TILE * NT + nb) * ldw + k), _MM_HINT_T1);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + nb * ldw + k));
            for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_dpbf16_ps(acc[nb][m], wv, xv[m]);
        }
    }
    if (k32 < K) {
        const __mmask32 mask = (__mmask32)((1u << (K - k32)) - 1u);
        __m512bh xv[MT];
        for (int m = 0; m < MB; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k32);
        for (int nb = 0; nb < NB; nb++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + nb * ldw + k32);
            for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_dpbf16_ps(acc[nb][m], wv, xv[m]);
        }
    }
}

/* NB weight rows x MB x rows of bf16; out[m * NB + nb] the float32 dot products, each summed by
   hsum16's tree (sixteen at a time through hsum16_many). */
INLINE void bf16_tile(const int NB, const int MB, const uint16_t *w, int64_t ldw, int64_t K, const uint16_t *x,
                      int64_t ldx, float *out) {
    __m512 acc[NT][MT];
    for (int nb = 0; nb < NB; nb++)
        for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_setzero_ps();
    bf16_accumulate(NB, MB, w, ldw, K, x, ldx, acc);
    /* in out's order, padded with zeros to whole sixteens */
    __m512 flat[32];
    const int count = NB * MB, padded = (count + 15) / 16 * 16;
    for (int m = 0; m < MB; m++)
        for (int nb = 0; nb < NB; nb++) flat[m * NB + nb] = acc[nb][m];
    for (int i = count; i < padded; i++) flat[i] = _mm512_setzero_ps();
    float sums[32];
    for (int i = 0; i < padded; i += 16) hsum16_many(flat + i, sums + i);
    for (int i = 0; i < count; i++) out[i] = sums[i];
}

/* bf16_tile's sums for four weight rows by four x rows, as one vector: lane 4m + nb holds (x row m,
   weight row nb), each summed by hsum16's tree (its place among the sixteen changes none of its
   additions). Four rows of x a pass rather than six: sixteen accumulators make one whole
   hsum16_vec with no padding, and a row's four outputs leave as one 128-bit store, where six rows'
   24 sums went through a padded pair of reductions, a copy and 24 scalar stores. */
INLINE __m512 bf16_tile16(const uint16_t *w, int64_t ldw, int64_t K, const uint16_t *x, int64_t ldx) {
    __m512 acc[NT][MT];
    for (int nb = 0; nb < 4; nb++)
        for (int m = 0; m < 4; m++) acc[nb][m] = _mm512_setzero_ps();
    bf16_accumulate(4, 4, w, ldw, K, x, ldx, acc);
    __m512 flat[16]; /* [nb * 4 + m]: row m's four outputs in lanes 4m..4m+3 of the sum */
    for (int nb = 0; nb < 4; nb++)
        for (int m = 0; m < 4; m++) flat[nb * 4 + m] = acc[nb][m];
    return hsum16_vec(flat);
}

/* bf16_tile16's sums (+ bias) into y rows m0..m0+3, columns n0..n0+3: float32, or bf16 rounded as
   lowbit_store rounds. */
INLINE void store_tile16(__m512 z, const float *bias, void *y, int y_bf16, int64_t ldy, int64_t m0, int64_t n0) {
    if (bias) z = _mm512_add_ps(z, _mm512_broadcast_f32x4(_mm_loadu_ps(bias + n0)));
    if (y_bf16) {
        uint64_t rows[4]; /* row m's four bf16 values */
        _mm256_storeu_si256((__m256i *)rows, _mm512_cvtepi32_epi16(lowbit_bf16_bits16(z)));
        for (int m = 0; m < 4; m++) memcpy((uint16_t *)y + (m0 + m) * ldy + n0, rows + m, 8);
    } else {
        float *yf = (float *)y;
        _mm_storeu_ps(yf + (m0 + 0) * ldy + n0, _mm512_extractf32x4_ps(z, 0));
        _mm_storeu_ps(yf + (m0 + 1) * ldy + n0, _mm512_extractf32x4_ps(z, 1));
        _mm_storeu_ps(yf + (m0 + 2) * ldy + n0, _mm512_extractf32x4_ps(z, 2));
        _mm_storeu_ps(yf + (m0 + 3) * ldy + n0, _mm512_extractf32x4_ps(z, 3));
    }
}

/* One x row (a decode step): each weight row read front to back on its own with the row
   ROW_PREFETCH on pulled into L1, as f32_rows does for float32 x; bf16_tile's sums (one 16-lane
   accumulator per (n, m) over k in steps of 32, the masked tail, one reduce), so the same bits.
   SmolLM2's 30 layers from memory at one row, alternated C calls on 2 Zen 4 cores: 8.0 against
   8.4 ms, the 49152 x 576 head 1.59 against 1.83 ms; at 2 and 4 rows the tile was faster
   (8.1-8.2 against 9.6 ms), so they keep it. Whole 32s load unmasked, the tail alone masked (the
   same operands): the head at one row went from 1.07x the float32-x call's time to 0.95-1.0x. */
INLINE void bf16_rows(const int NB, const int MB, const uint16_t *w, int64_t ldw, int64_t K, const uint16_t *x,
                      int64_t ldx, float *out) {
    const int64_t k32 = K / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (K - k32)) - 1u);
    for (int nb = 0; nb < NB; nb++) {
        const uint16_t *row = w + nb * ldw;
        const char *ahead = (const char *)(row + ROW_PREFETCH * ldw);
        __m512 acc[MT];
        for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k < k32; k += 32) {
            if (ROW_PREFETCH) _mm_prefetch(ahead + k * 2, _MM_HINT_T0);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(row + k));
            for (int m = 0; m < MB; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512((const void *)(x + m * ldx + k)));
        }
        if (k < K) {
            if (ROW_PREFETCH) _mm_prefetch(ahead + k * 2, _MM_HINT_T0);
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + k);
            for (int m = 0; m < MB; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * ldx + k));
        }
        for (int m = 0; m < MB; m++) out[m * NB + nb] = hsum16(acc[m]);
    }
}

INLINE void bf16_pass(const int NB, int mb, const uint16_t *w, int64_t ldw, int64_t K, const uint16_t *x, int64_t ldx,
                      float *out) {
    switch (mb) {
    case 1: bf16_rows(NB, 1, w, ldw, K, x, ldx, out); break;
    case 2: bf16_tile(NB, 2, w, ldw, K, x, ldx, out); break;
    case 3: bf16_tile(NB, 3, w, ldw, K, x, ldx, out); break;
    case 4: bf16_tile(NB, 4, w, ldw, K, x, ldx, out); break;
    case 5: bf16_tile(NB, 5, w, ldw, K, x, ldx, out); break;
    default: bf16_tile(NB, 6, w, ldw, K, x, ldx, out); break;
    }
}
#endif

#endif

#if HAVE_F32AVX2
#define NT 4 /* weight rows per tile */
#define MT 3 /* x rows per pass: 4 accumulators each, 12 in all, beside a weight vector */
/* Each weight row is read front to back on its own (one stream), while the row PREFETCH_ROWS on
   is pulled into L1 a line per 32 k. Reading a tile's four rows side by side (four short streams,
   as the AVX-512 section does) ran the 49152 x 576 bf16 head at 3.2 ms on 2 Zen 3 cores; row by row
   with this prefetch, 2.65 ms (22 GB/s of ~26 streaming), and 4.4 against 5.6 ms on one core. */
#define PREFETCH_ROWS 4

INLINE __m256 wload8(const int WB, const void *w, int64_t i) {
    if (WB == 4) return _mm256_loadu_ps((const float *)w + i);
    return lowbit_bf16_widen8(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
}

/* The k past the last whole 32 (from k), into each x row's first accumulator acc[m * stride]: the
   remaining whole vectors, then the last partial one through zero-padded copies (AVX2 has no
   16-bit masked load). */
INLINE void tail8(const int WB, const int MB, const char *row, int64_t K, int64_t k, const float *x, int64_t ldx,
                  __m256 *acc, int stride) {
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = wload8(WB, row, k);
        for (int m = 0; m < MB; m++) acc[m * stride] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k), acc[m * stride]);
    }
    if (k < K) {
        float wt[8] = {0};
        for (int64_t i = k; i < K; i++) wt[i - k] = lowbit_load(row, i, WB == 2);
        const __m256 wv = _mm256_loadu_ps(wt);
        for (int m = 0; m < MB; m++) {
            float xt[8] = {0};
            for (int64_t i = k; i < K; i++) xt[i - k] = x[m * ldx + i];
            acc[m * stride] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xt), acc[m * stride]);
        }
    }
}

/* out[m * NB + nb] for NB weight rows and MB x rows. Per (m, n): four 8-lane accumulators over
   k in steps of 32 (k + 0, 8, 16, 24), the remaining whole vectors and then the zero-padded last
   partial one into the first, then (a0 + a1) + (a2 + a3) and one fixed horizontal sum - the
   same operations whatever MB or NB, so every output is batch-invariant. */
INLINE void f32_tile(const int WB, const int NB, const int MB, const void *w, int64_t ldw, int64_t K, const float *x,
                     int64_t ldx, float *out) {
    for (int nb = 0; nb < NB; nb++) {
        const char *row = (const char *)w + nb * ldw * WB;
        const char *ahead = row + PREFETCH_ROWS * ldw * WB;
        __m256 acc[MT][4];
        for (int m = 0; m < MB; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            _mm_prefetch(ahead + k * WB, _MM_HINT_T0);
            if (WB == 4) _mm_prefetch(ahead + k * WB + 64, _MM_HINT_T0);
            for (int j = 0; j < 4; j++) {
                const __m256 wv = wload8(WB, row, k + 8 * j);
                for (int m = 0; m < MB; m++) acc[m][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k + 8 * j), acc[m][j]);
            }
        }
        tail8(WB, MB, row, K, k, x, ldx, &acc[0][0], 4);
        for (int m = 0; m < MB; m++)
            out[m * NB + nb] = lowbit_hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
    }
}

/* f32_tile's numbers for a whole tile (NT weight rows x MT x rows) with one accumulator per (row, x
   row) live instead of four: the four accumulators of a pair are independent sums, each over its k
   in order, so running them one after another (k + 0 over the whole K block, then k + 8, ...) gives
   the same bits. Twelve pairs in registers read 4 weight and 3 x vectors per 12 FMAs, where
   f32_tile reads 4 vectors per 3 (one weight row against 3 x rows, four accumulators each): at 16
   rows and more (the head at 16 concurrent, prefill) loads, not FMAs, bounded it. K runs in blocks
   of KBLK so the tile's rows stay in L1 between the four passes; the partial sums wait in `keep`. */
#define KBLK 1024
INLINE void f32_tile_wide(const int WB, const void *w, int64_t ldw, int64_t K, const float *x, int64_t ldx, float *out) {
    __m256 keep[4][NT][MT];
    for (int j = 0; j < 4; j++)
        for (int n = 0; n < NT; n++)
            for (int m = 0; m < MT; m++) keep[j][n][m] = _mm256_setzero_ps();
    const int64_t k32 = K / 32 * 32;
    for (int64_t kb = 0; kb < k32; kb += KBLK) {
        const int64_t ke = kb + KBLK < k32 ? kb + KBLK : k32;
        for (int j = 0; j < 4; j++) {
            __m256 acc[NT][MT];
            for (int n = 0; n < NT; n++)
                for (int m = 0; m < MT; m++) acc[n][m] = keep[j][n][m];
            for (int64_t k = kb + 8 * j; k < ke; k += 32) {
                __m256 xv[MT];
                for (int m = 0; m < MT; m++) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
                for (int n = 0; n < NT; n++) {
                    const __m256 wv = wload8(WB, (const char *)w + n * ldw * WB, k);
                    for (int m = 0; m < MT; m++) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
                }
            }
            for (int n = 0; n < NT; n++)
                for (int m = 0; m < MT; m++) keep[j][n][m] = acc[n][m];
        }
    }
    for (int n = 0; n < NT; n++) { /* f32_tile's tail, into the first accumulator */
        const char *row = (const char *)w + n * ldw * WB;
        tail8(WB, MT, row, K, k32, x, ldx, &keep[0][n][0], 1);
        for (int m = 0; m < MT; m++)
            out[m * NT + n] = lowbit_hsum8(_mm256_add_ps(_mm256_add_ps(keep[0][n][m], keep[1][n][m]),
                                                         _mm256_add_ps(keep[2][n][m], keep[3][n][m])));
    }
}

INLINE void f32_pass(const int WB, const int NB, int mb, const void *w, int64_t ldw, int64_t K, const float *x,
                     int64_t ldx, float *out) {
    if (NB == NT && mb == MT) {
        f32_tile_wide(WB, w, ldw, K, x, ldx, out);
        return;
    }
    switch (mb) {
    case 1: f32_tile(WB, NB, 1, w, ldw, K, x, ldx, out); break;
    case 2: f32_tile(WB, NB, 2, w, ldw, K, x, ldx, out); break;
    default: f32_tile(WB, NB, 3, w, ldw, K, x, ldx, out); break;
    }
}
#endif

/* ---- bf16 weights packed in 12 bits, losslessly (lowbit_bf16p_*) --------------------------------
   A bf16 is [sign | exponent 8 | mantissa 7]; its low byte (the exponent's last bit and the
   mantissa) is kept whole and its high byte (the sign and the exponent's top 7 bits) becomes a
   4-bit code into its row's table of 16 high bytes: either sign with the row's 7 largest values of
   the exponent's top bits (14 binades below the row's largest weight), or 0 (zeros, and numbers
   below 2^-125). A 32-weight block holding any other high byte is kept whole in a side list, which
   the weights of trained models leave empty or nearly (SmolLM2's and Gemma-3's tied embeddings:
   none; their only small values are exact zeros). Decoding gives back the very bf16 values, so a
   matmul gives bit for bit lowbit_bf16xw_matmul's outputs from three quarters of the bytes: a
   decode step reads a bf16 head and a bf16 model's Linears (kernels/cpu_bf16pack.py) whole per
   token at the memory's speed, so it takes about three quarters of the time.
   Block layout (48 bytes): 32 low bytes, weight v of the block at place v for v < 8 and v >= 24,
   v + 8 for 8 <= v < 16, v - 8 for 16 <= v < 24 (so that an in-lane byte interleave with the
   high bytes yields the weights in order), then 16 bytes whose low nibble j is place j's code and
   high nibble place j + 16's. */
typedef struct {
    const uint8_t *blocks;    /* [N / 2 rounded up, K / 32, 2, 48]: rows in pairs, block by block (PK_AT) */
    const uint8_t *tables;    /* [N, 16] high byte by code */
    const int32_t *esc_start; /* [N + 1]: row n's whole blocks are entries esc_start[n] .. esc_start[n + 1] - 1 */
    const int32_t *esc_block; /* each entry's block within its row, ascending within a row */
    const uint16_t *esc_raw;  /* [entries, 32] their bf16 values */
    int64_t N, K;
} Bf16Packed;

#define PK_BLOCK 48
/* Block b of row n: a pair of rows is one stream, block by block, so that pk_rows reads two rows
   side by side (two chains of sums in flight) in one sequential stream. */
#define PK_AT(blocks, n, b, nblk) ((blocks) + (((n) >> 1) * (nblk) + (b)) * 2 * PK_BLOCK + ((n) & 1) * PK_BLOCK)
/* Software prefetch of the packed stream: pk_tile, tiles ahead and the hint (two tiles into L2:
   SmolLM2's head from memory at 2 / 4 / 6 / 16 rows 1.50 / 1.36 / 0.85 / 0.79x the bf16 tiles' speed,
   against 1.46 / 1.23 / 0.67 / 0.60x with the next tile into L1); pk_rows, pairs of rows ahead (one
   pair into L1 measured as well as two pairs or 4-8 rows into L2). */
#ifndef PK_TILES_AHEAD
#define PK_TILES_AHEAD 2
#endif
#ifndef PK_HINT
#define PK_HINT _MM_HINT_T1
#endif
#ifndef PK_ROWS_AHEAD
#define PK_ROWS_AHEAD 1
#endif
#ifndef PK_ROWS_HINT
#define PK_ROWS_HINT _MM_HINT_T0
#endif
#define PK_ZERO 7 /* code & 7 of a zero high byte (code 15: the sign alone) */

/* Place of block weight v (the layout above); a macro too, for the VBMI decode's constant table. */
#define PK_PLACE(v) ((v) < 8 || (v) >= 24 ? (v) : (v) < 16 ? (v) + 8 : (v) - 8)
static inline int pk_place(int v) { return PK_PLACE(v); }

/* The code of high byte h in a row whose largest exponent-top is top, or -1 when its table lacks it. */
static inline int pk_code(int h, int top) {
    const int s = h >> 7, e = h & 0x7F, d = top - e;
    if (e == 0) return s * 8 + PK_ZERO;
    return d >= 0 && d < PK_ZERO ? s * 8 + d : -1;
}

static int pk_top(const uint16_t *row, int64_t K) {
    int top = 0;
    for (int64_t k = 0; k < K; k++) {
        const int e = (row[k] >> 8) & 0x7F;
        top = e > top ? e : top;
    }
    return top;
}

/* Whether block b of a row (top: pk_top) needs the side list. */
static int pk_escapes(const uint16_t *row, int64_t b, int top) {
    for (int v = 0; v < 32; v++)
        if (pk_code(row[32 * b + v] >> 8, top) < 0) return 1;
    return 0;
}

#if HAVE_BF16DOT
#if defined(__AVX512VBMI__)
/* A row's table of 16 high bytes, four times over: vpermb indexes 64 bytes by an index byte's low
   6 bits, so a code byte's bits 4-5 (the other place's nibble) select the same entry. */
typedef __m512i PkTable;
static inline PkTable pk_table(const uint8_t *t) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t)); }

/* Block b of a packed row as 32 bf16 in order (the layout above), in three shuffles: one byte
   permutation spreads the block into words [low byte | code byte], a masked word shift moves the
   high nibble down in the words whose place is 16 or more, and a masked permutation looks up the
   table into the odd (high) bytes alone, where the unpack-based decode below takes ~9
   instructions, 5 of them shuffles: one row of a 512 x 1024 weight from L2 on one Zen 4 core, 3.6
   against 4.05 cycles a block (from memory the same: the stream bounds it there). */
static inline __m512i pk_decode(const uint8_t *q, PkTable table) {
    static const uint8_t spread[64] __attribute__((aligned(64))) = {
#define PK_W(v) PK_PLACE(v), 32 + (PK_PLACE(v) & 15)
        PK_W(0), PK_W(1), PK_W(2), PK_W(3), PK_W(4), PK_W(5), PK_W(6), PK_W(7), PK_W(8), PK_W(9), PK_W(10),
        PK_W(11), PK_W(12), PK_W(13), PK_W(14), PK_W(15), PK_W(16), PK_W(17), PK_W(18), PK_W(19), PK_W(20),
        PK_W(21), PK_W(22), PK_W(23), PK_W(24), PK_W(25), PK_W(26), PK_W(27), PK_W(28), PK_W(29), PK_W(30), PK_W(31)
#undef PK_W
    };
    /* words whose place is 16 or more (pk_place: v = 8..15 and 24..31) take the high nibble */
    const __mmask32 high_nibble = 0xFF00FF00u;
    const __m512i words = _mm512_permutexvar_epi8(_mm512_load_si512((const void *)spread),
                                                  _mm512_maskz_loadu_epi8(0xFFFFFFFFFFFFull, q)); /* 48 bytes */
    const __m512i codes = _mm512_mask_srli_epi16(words, high_nibble, words, 4);
    return _mm512_mask_permutexvar_epi8(words, 0xAAAAAAAAAAAAAAAAull, codes, table);
}
#else
typedef __m256i PkTable;
static inline PkTable pk_table(const uint8_t *t) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t)); }

/* Block b of a packed row as 32 bf16 in order (the layout above). */
static inline __m512i pk_decode(const uint8_t *q, PkTable table) {
    const __m128i nib = _mm_set1_epi8(15), c = _mm_loadu_si128((const __m128i *)(q + 32));
    const __m256i codes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(c, nib)), _mm_and_si128(_mm_srli_epi16(c, 4), nib), 1);
    const __m256i high = _mm256_shuffle_epi8(table, codes), low = _mm256_loadu_si256((const __m256i *)q);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi8(low, high)), _mm256_unpackhi_epi8(low, high), 1);
}
#endif

/* Block b of packed row n as 32 bf16: from the side list when it is entry *e there (then *e moves
   on; e_end: the row's last entry + 1), else decoded with the row's table. Callers pass a local
   copy of the struct: the vector stores around them may alias anything, and would otherwise make
   every block reload its fields (a 4-row call took 1.15x the time). */
static inline __m512i pk_block(const Bf16Packed *p, int64_t n, int64_t b, int64_t nblk, PkTable table, int32_t *e, int32_t e_end) {
    if (*e < e_end && p->esc_block[*e] == b) return _mm512_loadu_si512((const void *)(p->esc_raw + (int64_t)(*e)++ * 32));
    return pk_decode(PK_AT(p->blocks, n, b, nblk), table);
}

/* Rows n0..n0+nb-1 of p (n0 even) decoded into dst [nb, K] (bf16, exactly the packed values); the
   next rows' blocks are prefetched as these decode. */
static void pk_tile(const Bf16Packed *packed, int64_t n0, int nb, uint16_t *dst) {
    const Bf16Packed copy = *packed, *p = &copy; /* see pk_block */
    const int64_t K = p->K, nblk = K / 32;
    const char *next = (const char *)PK_AT(p->blocks, n0 + NT * PK_TILES_AHEAD, 0, nblk); /* a later tile's pairs */
    for (int i = 0; i < nb; i++) {
        const int64_t n = n0 + i;
        const PkTable table = pk_table(p->tables + 16 * n);
        int32_t e = p->esc_start[n];
        const int32_t e_end = p->esc_start[n + 1];
        uint16_t *out = dst + i * K;
        for (int64_t b = 0; b < nblk; b++) {
            const int64_t at = i * nblk + b; /* this block's place in the tile's stream */
            if ((at & 3) == 0) /* 4 blocks are 3 lines */
                for (int l = 0; l < 3; l++) _mm_prefetch(next + at * PK_BLOCK + 64 * l, PK_HINT);
            _mm512_storeu_si512((void *)(out + 32 * b), pk_block(p, n, b, nblk, table, &e, e_end));
        }
    }
}

/* One x row against packed rows n0..n1-1 into out[0..]: bf16_rows' sums (one accumulator over k in
   steps of 32, hsum16), each block decoded in registers (a decode step: no scratch). RB rows side
   by side: a row's chain of `vdpbf16ps` waits on each sum (~6 cycles), and with a decode's dozen
   instructions per block one row at a time left too few rows in flight to hide it. */
INLINE void pk_rows(const int RB, const Bf16Packed *packed, int64_t n0, const uint16_t *x, float *out) {
    const Bf16Packed copy = *packed, *p = &copy; /* see pk_block */
    const int64_t nblk = p->K / 32;
    const char *ahead = (const char *)PK_AT(p->blocks, n0 + 2 * PK_ROWS_AHEAD, 0, nblk); /* pairs ahead */
    PkTable table[2];
    int32_t e[2], e_end[2];
    __m512 acc[2];
    for (int r = 0; r < RB; r++) {
        table[r] = pk_table(p->tables + 16 * (n0 + r));
        e[r] = p->esc_start[n0 + r], e_end[r] = p->esc_start[n0 + r + 1];
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nblk; b++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + 32 * b));
        if ((b & 1) == 0) /* two blocks of a pair are 3 lines */
            for (int l = 0; l < 3; l++) _mm_prefetch(ahead + b * 2 * PK_BLOCK + 64 * l, PK_ROWS_HINT);
        for (int r = 0; r < RB; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)pk_block(p, n0 + r, b, nblk, table[r], &e[r], e_end[r]), xv);
    }
    for (int r = 0; r < RB; r++) out[r] = hsum16(acc[r]);
}

static void pk_rows1(const Bf16Packed *p, int64_t n0, int64_t n1, const uint16_t *x, float *out) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) pk_rows(2, p, n, x, out + (n - n0));
    if (n < n1) pk_rows(1, p, n, x, out + (n - n0));
}
#endif

#if HAVE_F32DOT || HAVE_F32AVX2
/* One pass of NB weight rows against mb x rows. MODE 4: float32 w, 2: bf16 w (both with float32
   x), 1: bf16 w and bf16 x (vdpbf16ps). */
INLINE void dense_pass(const int MODE, const int NB, int mb, const char *w, int64_t ldw, int64_t K, const char *x,
                       int64_t ldx, float *out) {
#if HAVE_BF16DOT
    if (MODE == 1) {
        bf16_pass(NB, mb, (const uint16_t *)w, ldw, K, (const uint16_t *)x, ldx, out);
        return;
    }
#endif
    f32_pass(MODE, NB, mb, w, ldw, K, (const float *)x, ldx, out);
}

/* The whole matmul in MODE (dense_pass); y float32, or bf16 with y_bf16 (rounded once). Rows of x
   go in blocks of about XBLOCK bytes, each block against all of a thread's weight tiles: x stays in
   L2 while a tile's rows are in L1 (a prefill's 512 rows of x are 1.3 MB at K = 640, more than a
   Zen 2 core's L2, and were read from L3 for every tile). The order of the work changes, not any
   output's arithmetic. */
#define XBLOCK (192 * 1024)
/* x rows of the next pass with `rem` left: bf16 x bf16 in fours (bf16_tile16), a last five or six in
   one pass (a verify of 1 + 4 or 1 + 5 rows), else up to MT. */
INLINE int pass_rows(const int MODE, int64_t rem) {
    if (BF16_TILE16 && MODE == 1) return rem >= 8 || rem == 4 ? 4 : rem <= 6 ? (int)rem : 4;
    return rem >= MT ? MT : (int)rem;
}
/* Tiles ta..tb-1 of y (one thread's share, or a part call's), x in blocks of rows. */
INLINE void dense_share(const int MODE, const void *w, int64_t N, int64_t K, int64_t ldw, const float *bias, const void *x,
                        int64_t ldx, int64_t M, void *y, int y_bf16, int64_t ldy, int64_t ta, int64_t tb, const void *pk,
                        uint16_t *scratch) {
    const int WB = MODE == 4 ? 4 : 2, XB = MODE == 1 ? 2 : 4; /* bytes of a weight, of an x element */
    const int PR = pass_rows(MODE, MT + 8); /* the rows of a full pass */
    const char *wb = (const char *)w, *xb = (const char *)x;
    int64_t mblock = XBLOCK / (K * XB) / PR * PR;
    if (mblock < PR) mblock = PR;
    float out[NT * MT];
#if HAVE_BF16DOT
    if (MODE == 1 && pk && M == 1) { /* a decode step: each block decoded in registers */
        const int64_t n0 = ta * NT, n1 = tb * NT < N ? tb * NT : N;
        for (int64_t c0 = n0; c0 < n1; c0 += NT * MT) {
            const int64_t c1 = c0 + NT * MT < n1 ? c0 + NT * MT : n1;
            pk_rows1((const Bf16Packed *)pk, c0, c1, (const uint16_t *)x, out);
            for (int64_t n = c0; n < c1; n++) lowbit_store(y, n, out[n - c0] + (bias ? bias[n] : 0.0f), y_bf16);
        }
        return;
    }
#endif
    for (int64_t mb0 = 0; mb0 < M; mb0 += mblock) {
        const int64_t me = mb0 + mblock < M ? mb0 + mblock : M;
        for (int64_t t = ta; t < tb; t++) {
            const int64_t n0 = t * NT;
            const int nb = N - n0 >= NT ? NT : (int)(N - n0);
            const char *wt = wb + n0 * ldw * WB; /* the tile's rows, ld apart */
            int64_t ld = ldw;
#if HAVE_BF16DOT
            if (MODE == 1 && pk) { /* a packed weight (pk_tile): the tile's rows decoded, then as any bf16 tile */
                pk_tile((const Bf16Packed *)pk, n0, nb, scratch);
                wt = (const char *)scratch, ld = K;
            }
#else
            (void)pk, (void)scratch;
#endif
            for (int64_t m0 = mb0, mb; m0 < me; m0 += mb) {
                mb = pass_rows(MODE, me - m0);
                const char *xm = xb + m0 * ldx * XB;
#if BF16_TILE16
                if (MODE == 1 && nb == NT && mb == 4) {
                    store_tile16(bf16_tile16((const uint16_t *)wt, ld, K, (const uint16_t *)xm, ldx), bias,
                                 y, y_bf16, ldy, m0, n0);
                    continue;
                }
#endif
                if (nb == NT) {
                    dense_pass(MODE, NT, mb, wt, ld, K, xm, ldx, out);
                } else { /* the ragged last tile, one weight row at a time (same per-row arithmetic) */
                    for (int i = 0; i < nb; i++) {
                        float row[MT];
                        dense_pass(MODE, 1, mb, wt + i * ld * WB, ld, K, xm, ldx, row);
                        for (int m = 0; m < mb; m++) out[m * NT + i] = row[m];
                    }
                }
                for (int m = 0; m < mb; m++)
                    for (int i = 0; i < nb; i++)
                        lowbit_store(y, (m0 + m) * ldy + n0 + i, out[m * NT + i] + (bias ? bias[n0 + i] : 0.0f), y_bf16);
            }
        }
    }
}

/* threads: a part call's (lowbit_native.h) share on this thread, else a region of `threads`. pk: a
   packed weight (MODE 1; w unused), each thread decoding a tile at a time into a scratch of its own.
   Returns 0, or -2 when that scratch cannot be had. */
INLINE int dense_matmul(const int MODE, const void *w, int64_t N, int64_t K, int64_t ldw, const float *bias, const void *x,
                        int64_t ldx, int64_t M, void *y, int y_bf16, int64_t ldy, int threads, const void *pk) {
    const int64_t tiles = (N + NT - 1) / NT;
    const int tiles_decoded = pk && M > 1; /* one row decodes in registers (pk_rows) */
    const size_t scratch_bytes = (size_t)((NT * K * 2 + 63) / 64 * 64);
    int64_t ta, tb;
    if (lowbit_part_share(tiles, &ta, &tb)) {
        uint16_t *scratch = tiles_decoded ? aligned_alloc(64, scratch_bytes) : NULL;
        if (tiles_decoded && !scratch) return -2;
        dense_share(MODE, w, N, K, ldw, bias, x, ldx, M, y, y_bf16, ldy, ta, tb, pk, scratch);
        free(scratch);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        lowbit_thread_share(tiles, &lo, &hi);
        uint16_t *scratch = tiles_decoded ? aligned_alloc(64, scratch_bytes) : NULL;
        if (tiles_decoded && !scratch) failed = 1;
        else dense_share(MODE, w, N, K, ldw, bias, x, ldx, M, y, y_bf16, ldy, lo, hi, pk, scratch);
        free(scratch);
    }
    return failed ? -2 : 0;
}
#endif

/* Returns 0, or -1 when the build has neither AVX-512 nor AVX2. */
int lowbit_f32_matmul(const float *w, int64_t N, int64_t K, int64_t ldw, const float *bias, const float *x, int64_t ldx,
                      int64_t M, float *y, int64_t ldy, int threads) {
#if !HAVE_F32DOT && !HAVE_F32AVX2
    (void)w; (void)N; (void)K; (void)ldw; (void)bias; (void)x; (void)ldx; (void)M; (void)y; (void)ldy; (void)threads;
    return -1;
#else
    return dense_matmul(4, w, N, K, ldw, bias, x, ldx, M, y, 0, ldy, lowbit_team(threads), NULL);
#endif
}

/* The same with bfloat16 weights (ldw in elements): float32 x, float32 sums in the same order. */
int lowbit_bf16w_matmul(const uint16_t *w, int64_t N, int64_t K, int64_t ldw, const float *bias, const float *x,
                        int64_t ldx, int64_t M, float *y, int64_t ldy, int threads) {
#if !HAVE_F32DOT && !HAVE_F32AVX2
    (void)w; (void)N; (void)K; (void)ldw; (void)bias; (void)x; (void)ldx; (void)M; (void)y; (void)ldy; (void)threads;
    return -1;
#else
    return dense_matmul(2, w, N, K, ldw, bias, x, ldx, M, y, 0, ldy, lowbit_team(threads), NULL);
#endif
}

/* bf16 x [M, ldx] times bf16 w [N, ldw] (+ float32 bias) into y [M, ldy], bf16 (y_bf16) or float32.
   Returns 0, or -1 when the build has no AVX512-BF16. */
int lowbit_bf16_matmul(const uint16_t *w, int64_t N, int64_t K, int64_t ldw, const float *bias, const uint16_t *x,
                       int64_t ldx, int64_t M, void *y, int y_bf16, int64_t ldy, int threads) {
#if !HAVE_BF16DOT
    (void)w; (void)N; (void)K; (void)ldw; (void)bias; (void)x; (void)ldx; (void)M; (void)y; (void)y_bf16; (void)ldy;
    (void)threads;
    return -1;
#else
    return dense_matmul(1, w, N, K, ldw, bias, x, ldx, M, y, y_bf16, ldy, lowbit_team(threads), NULL);
#endif
}

#if HAVE_BF16DOT
/* x [M, ldx] float32 rounded to bf16 into a buffer per thread that only grows (a fresh allocation
   per prefill call would pay a page fault per 4 KB), rows K apart; NULL when it cannot grow. */
static const uint16_t *bf16_copy(const float *x, int64_t ldx, int64_t M, int64_t K, int threads) {
    static __thread uint16_t *xbuf = NULL;
    static __thread int64_t xcap = 0;
    const int64_t need = M * K;
    if (need > xcap) { /* 64-byte aligned: every 32-value load of a row is then one cache line */
        uint16_t *grown = (uint16_t *)aligned_alloc(64, (size_t)((need * 2 + 63) / 64 * 64));
        if (!grown) return NULL;
        free(xbuf);
        xbuf = grown;
        xcap = need;
    }
    uint16_t *xb = xbuf;
    if (need >= 65536 && threads > 1) {
#pragma omp parallel for num_threads(threads)
        for (int64_t m = 0; m < M; m++) lowbit_bf16_row(x + m * ldx, xb + m * K, K);
    } else { /* a region costs ~1 us even when it runs on this thread alone */
        for (int64_t m = 0; m < M; m++) lowbit_bf16_row(x + m * ldx, xb + m * K, K);
    }
    return xb;
}
#endif

/* float32 x rounded to bf16 (nearest even, as torch rounds; bf16_copy), then lowbit_bf16_matmul's
   arithmetic into a float32 y: a bf16 weight's product with an activation the way llama.cpp's BF16
   type computes it (x converted to bf16, `vdpbf16ps`), at twice the multiply-adds of
   lowbit_bf16w_matmul's float32 FMAs. The same signature as lowbit_bf16w_matmul, so the decode
   chain calls either. Returns 0, -1 without AVX512-BF16, -2 when x's buffer cannot grow. */
int lowbit_bf16xw_matmul(const uint16_t *w, int64_t N, int64_t K, int64_t ldw, const float *bias, const float *x,
                         int64_t ldx, int64_t M, float *y, int64_t ldy, int threads) {
#if !HAVE_BF16DOT
    (void)w; (void)N; (void)K; (void)ldw; (void)bias; (void)x; (void)ldx; (void)M; (void)y; (void)ldy; (void)threads;
    return -1;
#else
    threads = lowbit_team(threads); /* a part call converts all of x for itself, then its share */
    const uint16_t *xb = bf16_copy(x, ldx, M, K, threads);
    if (!xb) return -2;
    return dense_matmul(1, w, N, K, ldw, bias, xb, K, M, y, 0, ldy, threads, NULL);
#endif
}

/* lowbit_bf16xw_matmul for a packed weight (w: its Bf16Packed; ldw unused): the same outputs, bit
   for bit. The same signature, so the decode chain calls either. */
int lowbit_bf16pxw_matmul(const void *w, int64_t N, int64_t K, int64_t ldw, const float *bias, const float *x, int64_t ldx,
                          int64_t M, float *y, int64_t ldy, int threads) {
    (void)ldw;
#if !HAVE_BF16DOT
    (void)w; (void)N; (void)K; (void)bias; (void)x; (void)ldx; (void)M; (void)y; (void)ldy; (void)threads;
    return -1;
#else
    const Bf16Packed *p = (const Bf16Packed *)w;
    if (p->N != N || p->K != K || K % 32) return -1;
    threads = lowbit_team(threads);
    const uint16_t *xb = bf16_copy(x, ldx, M, K, threads);
    if (!xb) return -2;
    return dense_matmul(1, NULL, N, K, K, bias, xb, K, M, y, 0, ldy, threads, p);
#endif
}

/* Packing (any CPU). esc_start [N + 1] gets each row's first entry in the side list (the last: the
   entries in all); returns that count, or -1 when K is not a multiple of 32. */
int lowbit_bf16p_escapes(const uint16_t *w, int64_t N, int64_t K, int64_t ldw, int32_t *esc_start, int threads) {
    if (K % 32 || K <= 0) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *row = w + n * ldw;
        const int top = pk_top(row, K);
        int32_t count = 0;
        for (int64_t b = 0; b < K / 32; b++) count += pk_escapes(row, b, top);
        esc_start[n + 1] = count;
    }
    esc_start[0] = 0;
    for (int64_t n = 0; n < N; n++) esc_start[n + 1] += esc_start[n];
    return (int)esc_start[N];
}

/* w [N, ldw] bf16 into blocks [N / 2 rounded up, K / 32 * 96] (an odd N's last row's partner
   left as it is), tables [N, 16] and the side list (esc_start from
   lowbit_bf16p_escapes; esc_block and esc_raw [entries, 32] filled here). Returns 0, or -1 when K
   is not a multiple of 32. */
int lowbit_bf16p_pack(const uint16_t *w, int64_t N, int64_t K, int64_t ldw, uint8_t *blocks, uint8_t *tables,
                      const int32_t *esc_start, int32_t *esc_block, uint16_t *esc_raw, int threads) {
    if (K % 32 || K <= 0) return -1;
    const int64_t nblk = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *row = w + n * ldw;
        const int top = pk_top(row, K);
        for (int c = 0; c < 16; c++) {
            const int d = c & 7, e = d == PK_ZERO || top - d < 0 ? 0 : top - d;
            tables[n * 16 + c] = (uint8_t)((c >> 3) << 7 | e);
        }
        int32_t entry = esc_start[n];
        for (int64_t b = 0; b < nblk; b++) {
            uint8_t *q = PK_AT(blocks, n, b, nblk);
            memset(q, 0, PK_BLOCK);
            if (pk_escapes(row, b, top)) { /* whole, in the side list */
                esc_block[entry] = (int32_t)b;
                memcpy(esc_raw + (int64_t)entry * 32, row + 32 * b, 64);
                entry++;
                continue;
            }
            for (int v = 0; v < 32; v++) {
                const uint16_t bits = row[32 * b + v];
                const int place = pk_place(v), code = pk_code(bits >> 8, top);
                q[place] = (uint8_t)(bits & 0xFF);
                q[32 + (place & 15)] |= (uint8_t)(place < 16 ? code : code << 4);
            }
        }
    }
    return 0;
}

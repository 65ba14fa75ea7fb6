/* CPU matmul for integer 4-bit codes through bf16 dot products (AVX512-BF16 `vdpbf16ps`), with
   arithmetic per row of x that does not depend on how many rows are in the call:
   y[m, n] = sum_j (s[n, j] * (sum_{k in group j} T[c[n, k]] * xb[m, k]) - sz[n, j] * xsum[m, j])

   T[c] is an integer table (0..15 or -8..7), exact in bf16, so every product T * xb is exact in
   float32; xb is x rounded to bf16 and xsum[m, j] the float32 sum of xb over group j; s is the
   group scale and sz = s * z its scale times zero point (NULL when symmetric). The result is the
   float32 dequantize-then-matmul of bf16-rounded activations up to float32 summation order.

   Layout (a GEMM microkernel's): the 16 lanes of a vector are 16 OUTPUT rows. Each `vdpbf16ps`
   multiplies, per lane, one k pair (w[n, k], w[n, k + 1]) by the pair (x[m, k], x[m, k + 1])
   broadcast to every lane, so a group's dot products of 16 rows sit in one accumulator per x
   row, the scale is one vector FMA, and nothing is reduced horizontally. kernels/cpu_int4dot.py
   repacks the codes in tiles of 16 output rows, K zero-padded to a multiple of 64: per 4 k (a
   chunk, 32 bytes), byte 2i+p holds row i's code k+p in the low nibble and k+2+p in the high
   one, so one widening load, a mask or a shift and a table lookup give the pair vectors (k, k+1)
   and (k+2, k+3). Four tiles (64 rows, padded) are interleaved chunk by chunk
   ([N / 64, chunks, 4, 32]): one row of x then reads one sequential stream of 128 bytes per
   chunk (four separate streams, one per tile, were 15 % slower at one row). Scales (and sz)
   are [tiles, G, 16].

   Batch invariance (what makes speculative verification exact): every (m, n) is accumulated in
   one fixed order - chunks in order, pair (k, k+1) then (k+2, k+3) into one accumulator per
   group, the group folded into a running vector with one FMA (and the zero point with one
   more) - whatever M is and however rows and tiles are grouped; x rows are converted and summed
   alone. How many tiles run side by side (TT) depends on the rows in the pass, never the order.

   Cost (2-core EPYC, Zen 4: one 512-bit vdpbf16ps per cycle per core): one row is bound by the
   weight read; TT tiles side by side give it independent accumulator chains and read whole
   cache lines. Many rows are
   bound by the dot products: one unpacked chunk feeds up to 16 rows from registers (16
   accumulators; the group totals live in memory, touched once per group). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lowbit_native.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_I4DOT 1
#else
#define HAVE_I4DOT 0
#endif

typedef struct {
    const uint8_t *codes;  /* [ceil(tiles / 4), chunks, 4, 32] */
    int64_t tile_bytes;    /* chunks * 32: a group of four tiles takes 4 * tile_bytes */
    const uint16_t *table; /* [32] bf16 value of each code (entries 16..31 unused) */
    const float *scales;   /* [tiles, G, 16] */
    const float *szs;      /* [tiles, G, 16] scale * zero point, or NULL */
    int64_t N, K, chunks, G;
    int32_t cpg;           /* chunks per group (group / 4); chunks for one group per row */
} I4Weight;

int lowbit_i4_available(void) { return HAVE_I4DOT; }

#if HAVE_I4DOT
#define ROWS 16  /* output rows per tile: one per lane */
#define MAXMB LOWBIT_PASS_ROWS /* x rows per pass: 16 accumulators */
#define STRIDE 128 /* bytes from one chunk of a tile to its next: four tiles interleaved */
/* Prefetch distance in the stream of codes (bytes ahead; one to two 128-byte chunks per 4-16
   ns of dot products, so this is ~20-60 ns early; 0 to rely on the hardware prefetcher alone). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 512
#endif

/* Tiles t0..t0+TT-1 (within one group of four) against x rows m0..m0+MB-1; tot[(t * MB + m) * 16 + lane]. xq holds x as
   bf16, interleaved by chunk: xq[(c * M + m) * 4 + i] = xb[m, 4c + i]. */
INLINE void tiles(const int TT, const int MB, const I4Weight *w, int64_t t0, const uint16_t *xq, int64_t M,
                  const float *xsum, int64_t m0, float *tot) {
    const __m512i tab = _mm512_loadu_si512((const void *)w->table);
    const __m512i low = _mm512_set1_epi16(15);
    const int64_t G = w->G, C = w->chunks;
    const uint8_t *base = w->codes + (t0 / 4) * 4 * w->tile_bytes + (t0 % 4) * 32;
    for (int i = 0; i < TT * MB; i++) _mm512_storeu_ps(tot + i * 16, _mm512_setzero_ps());
    int64_t c = 0;
    for (int64_t j = 0; j < G; j++) {
        const int64_t c_end = j == G - 1 ? C : (j + 1) * w->cpg;
        __m512 acc[4][MAXMB];
        for (int t = 0; t < TT; t++)
            for (int m = 0; m < MB; m++) acc[t][m] = _mm512_setzero_ps();
        for (; c < c_end; c++) {
            __m512bh wl[4], wh[4];
            if (PREFETCH_BYTES) {
                _mm_prefetch((const char *)(base + c * STRIDE + PREFETCH_BYTES), _MM_HINT_T0);
                _mm_prefetch((const char *)(base + c * STRIDE + PREFETCH_BYTES + 64), _MM_HINT_T0);
            }
            for (int t = 0; t < TT; t++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(base + c * STRIDE + t * 32)));
                wl[t] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(raw, low), tab);
                wh[t] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), tab);
            }
            const uint16_t *xc = xq + (c * M + m0) * 4;
            if (TT == 1) {
                /* one dot product per x pair: an embedded broadcast saves a vpbroadcastd each
                   (gcc does not fold it here; ~7 % at 16 rows) */
                for (int m = 0; m < MB; m++) {
                    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc[0][m]) : "v"(wl[0]), "m"(*(const int32_t *)(xc + m * 4)));
                    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc[0][m]) : "v"(wh[0]), "m"(*(const int32_t *)(xc + m * 4 + 2)));
                }
            } else for (int m = 0; m < MB; m++) {
                int32_t p0, p1;
                memcpy(&p0, xc + m * 4, 4);
                memcpy(&p1, xc + m * 4 + 2, 4);
                const __m512bh xl = (__m512bh)_mm512_set1_epi32(p0), xh = (__m512bh)_mm512_set1_epi32(p1);
                for (int t = 0; t < TT; t++) {
                    acc[t][m] = _mm512_dpbf16_ps(acc[t][m], wl[t], xl);
                    acc[t][m] = _mm512_dpbf16_ps(acc[t][m], wh[t], xh);
                }
            }
        }
        for (int t = 0; t < TT; t++) {
            const __m512 s = _mm512_loadu_ps(w->scales + ((t0 + t) * G + j) * ROWS);
            for (int m = 0; m < MB; m++) {
                float *tp = tot + (t * MB + m) * 16;
                __m512 v = _mm512_fmadd_ps(acc[t][m], s, _mm512_loadu_ps(tp));
                if (w->szs)
                    v = _mm512_fnmadd_ps(_mm512_loadu_ps(w->szs + ((t0 + t) * G + j) * ROWS),
                                         _mm512_set1_ps(xsum[(m0 + m) * G + j]), v);
                _mm512_storeu_ps(tp, v);
            }
        }
    }
}

/* One pass: a constant TT and MB per case, so each compiles to its own fully unrolled loop. */
#define MB_CASE(TT, MB) case MB: tiles(TT, MB, w, t0, xq, M, xsum, m0, tot); break;
static void pass(int tt, int mb, const I4Weight *w, int64_t t0, const uint16_t *xq, int64_t M, const float *xsum,
                 int64_t m0, float *tot) {
    LOWBIT_TILE_PASSES(tt, mb, MB_CASE);
}
#undef MB_CASE

/* Row m of x as bf16 into row (K padded with zeros to kp), and its group sums (a fixed order:
   16 lanes along k, then a fixed horizontal sum) when the weight has zero points. */
static void convert_row(const I4Weight *w, const void *x, int x_bf16, int64_t ldx_in, int64_t m, int64_t kp,
                        uint16_t *row, float *xsum) {
    const int64_t K = w->K;
    if (x_bf16) {
        memcpy(row, (const uint16_t *)x + m * ldx_in, (size_t)K * 2);
    } else {
        lowbit_bf16_row((const float *)x + m * ldx_in, row, K);
    }
    memset(row + K, 0, (size_t)(kp - K) * 2);
    if (!w->szs) return;
    for (int64_t j = 0; j < w->G; j++) {
        const int64_t k0 = j * w->cpg * 4, k1 = j == w->G - 1 ? kp : k0 + w->cpg * 4;
        __m512 s = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += 16)
            s = _mm512_add_ps(s, lowbit_bf16_widen16(_mm256_loadu_si256((const __m256i *)(row + k))));
        xsum[m * w->G + j] = _mm512_reduce_add_ps(s);
    }
}

/* The 16 output rows of tile t for x row m (lanes past N are not written). */
static inline void store_tile(const float *v, void *y, int y_bf16, int64_t ldy, int64_t m, int64_t t, int64_t N) {
    const int64_t n0 = t * ROWS;
    const __mmask16 mask = lowbit_lanes(N - n0);
    const __m512 r = _mm512_loadu_ps(v);
    if (y_bf16) _mm256_mask_storeu_epi16((uint16_t *)y + m * ldy + n0, mask, (__m256i)_mm512_cvtneps_pbh(r));
    else _mm512_mask_storeu_ps((float *)y + m * ldy + n0, mask, r);
}

/* xq: x as bf16 by chunk; xs: the group sums xsum. */
static void run_tiles(LowbitTileCall *c, int tt, int mb, int64_t t, int64_t m0) {
    const I4Weight *w = c->w;
    pass(tt, mb, w, t, c->xq, c->M, c->xs, m0, c->tot);
    for (int i = 0; i < tt; i++)
        for (int m = 0; m < mb; m++) store_tile(c->tot + (i * mb + m) * 16, c->y, c->y_bf16, c->ldy, m0 + m, t + i, w->N);
}
#endif

#if HAVE_I4DOT
/* Tiles ta..tb-1 of y on this thread (one thread's share of a call, or a part call's). Each thread
   converts x for itself: reading a buffer another core just wrote, line by line inside the
   dot-product loop, cost cross-core cache misses at every row; a bulk copy of x streams. 0, or
   -2 when out of memory. */
static int share(const I4Weight *w, const void *x, int x_bf16, int64_t ldx_in, int64_t M, void *y, int y_bf16, int64_t ldy,
                 int64_t ta, int64_t tb) {
    if (ta >= tb) return 0;
    const int64_t G = w->G, C = w->chunks, kp = C * 4;
    uint16_t *rows = malloc((size_t)(M * kp) * 2), *xq = aligned_alloc(64, (size_t)((M * kp * 2 + 63) / 64 * 64));
    float *xsum = malloc((size_t)(M * G) * sizeof(float) + 4);
    const int ok = rows && xq && xsum;
    if (ok) {
        for (int64_t m = 0; m < M; m++) convert_row(w, x, x_bf16, ldx_in, m, kp, rows + m * kp, xsum);
        lowbit_chunks_by_row(xq, rows, M, C, kp * 2);
        LowbitTileCall call = {.w = w, .xq = xq, .xs = xsum, .M = M, .ldy = ldy, .y = y, .y_bf16 = y_bf16};
        lowbit_tile_runs(ta, tb, run_tiles, &call, LOWBIT_PASS_ROWS, 0);
    }
    free(rows);
    free(xq);
    free(xsum);
    return ok ? 0 : -2;
}
#endif

/* x: [M, ldx_in] float32 (x_bf16 = 0) or bf16 (1); y: [M, ldy] float32 or bf16 (y_bf16).
   Returns 0, or -1 when the build has no AVX512-BF16, -2 when out of memory. A part call
   (lowbit_native.h) computes its share of the tiles on the calling thread. */
int lowbit_i4_matmul(const I4Weight *w, const void *x, int x_bf16, int64_t ldx_in, int64_t M, void *y, int y_bf16,
                     int64_t ldy, int threads) {
#if !HAVE_I4DOT
    (void)w; (void)x; (void)x_bf16; (void)ldx_in; (void)M; (void)y; (void)y_bf16; (void)ldy; (void)threads;
    return -1;
#else
    const int64_t n_tiles = (w->N + ROWS - 1) / ROWS;
    threads = lowbit_team(threads);
    int64_t ta, tb; /* contiguous ranges of tiles: each thread streams one stretch of the codes */
    if (lowbit_part_share(n_tiles, &ta, &tb)) return share(w, x, x_bf16, ldx_in, M, y, y_bf16, ldy, ta, tb);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        lowbit_thread_share(n_tiles, &lo, &hi);
        if (share(w, x, x_bf16, ldx_in, M, y, y_bf16, ldy, lo, hi) != 0) failed = 1;
    }
    return failed ? -2 : 0;
#endif
}

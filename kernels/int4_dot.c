/* CPU matmul for integer 4-bit codes through bf16 dot products (AVX512-BF16 `vdpbf16ps`), with
   arithmetic per row of x that does not depend on how many rows are in the call:
   y[m, n] = sum_j s[n, j] * (sum_{k in group j} T[c[n, k]] * xb[m, k]) - sum_j sz[n, j] * xsum[m, j]

   T[c] is an integer table (0..15 or -8..7), exact in bf16, so every product T * xb is exact in
   float32; xb is x rounded to bf16 and xsum[m, j] the float32 sum of xb over group j; s is the
   group scale and sz = s * z its scale times zero point (NULL when symmetric). The result is the
   float32 dequantize-then-matmul of bf16-rounded activations up to float32 summation order.

   Batch invariance (what makes speculative verification exact): every (m, n) is accumulated in
   one fixed order - blocks of 64 in order, low 32 elements then high 32 into one accumulator
   per group, the group folded into a running vector with one FMA, a fixed horizontal sum at the
   end - whatever M is and however rows are tiled, and x rows are converted and summed alone.

   Layout: codes repacked by kernels/cpu_int4dot.py in 64-element blocks of 32 bytes (byte i:
   element i low nibble, element 32 + i high nibble), rows zero-padded to whole blocks; groups
   are multiples of 64 (or one group per row).

   Cost (measured on the 2-core EPYC): one row is bound by the two dependent dot products per
   block and accumulator, not by unpacking (a variant that skipped unpacking was no faster), and
   more rows by loads and dot-product throughput, so x rows go through a tile MT at a time, each
   unpacked block feeding MT rows from registers: M = 3/4/5 cost ~1.9/2.5/3.5x one row
   (2.5/3.0/4.0x in pairs of rows). The weight is read from memory once per call. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_I4DOT 1
#include <immintrin.h>
#endif

typedef struct {
    const uint8_t *codes;  /* [N, row_bytes] */
    int64_t row_bytes;     /* 32 * blocks */
    const uint16_t *table; /* [32] bf16 value of each code (entries 16..31 unused) */
    const float *scales;   /* [N, G] */
    const float *szs;      /* [N, G] scale * zero point, or NULL */
    int64_t N, K, blocks, G;
    int32_t bpg;           /* blocks per group (group / 64); blocks for one group per row */
} I4Weight;

int lowbit_i4_available(void) {
#ifdef HAVE_I4DOT
    return 1;
#else
    return 0;
#endif
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);                                           /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#ifdef HAVE_I4DOT
#define INLINE static inline __attribute__((always_inline))
#define NT 4 /* output rows per tile */
#define PREFETCH_TILES 2
#define MT 4 /* x rows per pass: 4 x 4 accumulators, 8 x vectors, the unpacked block */

/* Output rows n0..n0+NB against x rows m0..m0+MB; out[m * NB + nb]. Each unpacked block of 64
   codes (two bf16 vectors) feeds all MB rows from registers, and the MB x vectors feed all NB
   output rows. */
INLINE void tile(const int NB, const int MB, const I4Weight *w, int64_t n0, const uint16_t *xb, int64_t ldx,
                 const float *xsum, int64_t m0, float *out) {
    const __m512i tab = _mm512_loadu_si512((const void *)w->table);
    const __m512i low = _mm512_set1_epi16(15);
    const int64_t G = w->G, blocks = w->blocks;
    __m512 tot[NT][MT];
    float zt[NT][MT];
    for (int nb = 0; nb < NB; nb++)
        for (int m = 0; m < MB; m++) { tot[nb][m] = _mm512_setzero_ps(); zt[nb][m] = 0.0f; }
    int64_t b = 0;
    for (int64_t j = 0; j < G; j++) {
        int64_t b_end = (j + 1) * w->bpg;
        if (b_end > blocks || j == G - 1) b_end = blocks;
        __m512 acc[NT][MT];
        for (int nb = 0; nb < NB; nb++)
            for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_setzero_ps();
        for (; b < b_end; b++) {
            __m512bh xl[MT], xh[MT];
            for (int m = 0; m < MB; m++) {
                const uint16_t *xr = xb + (m0 + m) * ldx + b * 64;
                xl[m] = (__m512bh)_mm512_loadu_si512((const void *)xr);
                xh[m] = (__m512bh)_mm512_loadu_si512((const void *)(xr + 32));
            }
            for (int nb = 0; nb < NB; nb++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w->codes + (n0 + nb) * w->row_bytes + b * 32)));
                __m512bh wl = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(raw, low), tab);
                __m512bh wh = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), tab);
                for (int m = 0; m < MB; m++) {
                    acc[nb][m] = _mm512_dpbf16_ps(acc[nb][m], wl, xl[m]);
                    acc[nb][m] = _mm512_dpbf16_ps(acc[nb][m], wh, xh[m]);
                }
            }
        }
        for (int nb = 0; nb < NB; nb++) {
            const float s = w->scales[(n0 + nb) * G + j];
            for (int m = 0; m < MB; m++) tot[nb][m] = _mm512_fmadd_ps(_mm512_set1_ps(s), acc[nb][m], tot[nb][m]);
            if (w->szs) {
                const float sz = w->szs[(n0 + nb) * G + j];
                for (int m = 0; m < MB; m++) zt[nb][m] += sz * xsum[(m0 + m) * G + j];
            }
        }
    }
    for (int nb = 0; nb < NB; nb++)
        for (int m = 0; m < MB; m++) out[m * NB + nb] = _mm512_reduce_add_ps(tot[nb][m]) - zt[nb][m];
}

/* One pass of mb (1..MT) rows; a constant MB per case so each compiles to its own loop. */
INLINE void pass(const int NB, int mb, const I4Weight *w, int64_t n0, const uint16_t *xb, int64_t ldx,
                 const float *xsum, int64_t m0, float *out) {
    switch (mb) {
    case 1: tile(NB, 1, w, n0, xb, ldx, xsum, m0, out); break;
    case 2: tile(NB, 2, w, n0, xb, ldx, xsum, m0, out); break;
    case 3: tile(NB, 3, w, n0, xb, ldx, xsum, m0, out); break;
    default: tile(NB, 4, w, n0, xb, ldx, xsum, m0, out); break;
    }
}

static void store(float v, void *y, int y_bf16, int64_t idx) {
    if (y_bf16) ((uint16_t *)y)[idx] = f32_to_bf16(v);
    else ((float *)y)[idx] = v;
}
#endif

/* x: [M, ldx_in] float32 (x_bf16 = 0) or bf16 (1); y: [M, ldy] float32 or bf16 (y_bf16).
   Returns 0, or -1 when the build has no AVX512-BF16, -2 when out of memory. */
int lowbit_i4_matmul(const I4Weight *w, const void *x, int x_bf16, int64_t ldx_in, int64_t M, void *y, int y_bf16,
                     int64_t ldy, int threads) {
#ifndef HAVE_I4DOT
    (void)w; (void)x; (void)x_bf16; (void)ldx_in; (void)M; (void)y; (void)y_bf16; (void)ldy; (void)threads;
    return -1;
#else
    const int64_t K = w->K, G = w->G, width = w->blocks * 64;
    /* 64 bytes past the row: rows whose stride is a multiple of 4 KiB would share L1 sets */
    const int64_t ldx = width + ((width * 2) % 4096 == 0 ? 32 : 0);
    uint16_t *xb = aligned_alloc(64, (size_t)((M * ldx * 2 + 63) / 64 * 64));
    float *xsum = malloc((size_t)(M * G) * sizeof(float));
    if (!xb || !xsum) { free(xb); free(xsum); return -2; }
    for (int64_t m = 0; m < M; m++) {
        uint16_t *row = xb + m * ldx;
        if (x_bf16) memcpy(row, (const uint16_t *)x + m * ldx_in, (size_t)K * 2);
        else for (int64_t k = 0; k < K; k++) row[k] = f32_to_bf16(((const float *)x)[m * ldx_in + k]);
        memset(row + K, 0, (size_t)(ldx - K) * 2);
        for (int64_t j = 0; j < G; j++) {
            int64_t k0 = j * w->bpg * 64, k1 = j == G - 1 ? K : k0 + w->bpg * 64;
            if (k1 > K) k1 = K;
            float s = 0.0f;
            for (int64_t k = k0; k < k1; k++) s += bf16_to_f32(row[k]);
            xsum[m * G + j] = s;
        }
    }
    const int64_t tiles = (w->N + NT - 1) / NT;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NT;
        float out[NT * MT];
        /* Rows are a few hundred bytes, too short for the hardware prefetcher to ramp up on
           each, so fetch the tile PREFETCH_TILES ahead while this one computes. */
        if (t + PREFETCH_TILES < tiles) {
            const uint8_t *ahead = w->codes + (n0 + PREFETCH_TILES * NT) * w->row_bytes;
            const int64_t n_ahead = (w->N - n0 - PREFETCH_TILES * NT) < NT ? (w->N - n0 - PREFETCH_TILES * NT) : NT;
            for (int64_t off = 0; off < n_ahead * w->row_bytes; off += 64) _mm_prefetch((const char *)(ahead + off), _MM_HINT_T0);
        }
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mb = M - m0 >= MT ? MT : (int)(M - m0);
            if (n0 + NT <= w->N) {
                pass(NT, mb, w, n0, xb, ldx, xsum, m0, out);
                for (int m = 0; m < mb; m++)
                    for (int i = 0; i < NT; i++) store(out[m * NT + i], y, y_bf16, (m0 + m) * ldy + n0 + i);
            } else {
                for (int64_t n = n0; n < w->N; n++) {
                    pass(1, mb, w, n, xb, ldx, xsum, m0, out);
                    for (int m = 0; m < mb; m++) store(out[m], y, y_bf16, (m0 + m) * ldy + n);
                }
            }
        }
    }
    free(xb);
    free(xsum);
    return 0;
#endif
}

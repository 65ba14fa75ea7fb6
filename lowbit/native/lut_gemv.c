/* CPU matmul straight from lowbit's packed codes: y[m, n] = sum_k x[m, k] * w[n, k].

   w[n, k] = (T[code] - z[n, j]) * s[n, j] for group j = k / g; T is a 16-entry float table for
   4-bit codes (NF4, E2M1, or the integers 0..15 / -8..7) and a decoder for 8-bit codes (signed
   int8, E4M3, E5M2). Scales are either float32 [R, G] or uint8 codes through a 256-entry float
   table (E8M0, E4M3 * global scale); row n reads scale row n / row_div (fp8 blocks share rows).

   4-bit codes arrive repacked by kernels/cpu_lut.py: chunk c (32 elements) of a row is 16 bytes,
   byte i holding element 32c+i in its low nibble and 32c+16+i in its high nibble, so one 16-byte
   load gives two 16-lane vectors already in element order. Rows are zero-padded to whole chunks
   and x is zero-padded to the same width, so no masks are needed; 8-bit codes are unpadded and
   their tails are masked. The weight is decoded once per 16 elements and used for every row of
   x, so small batches cost about what one row costs. Accumulation is float32, per group then
   scaled once. Built with -O3 -march=native and no fast-math (subnormal scales must survive). */

#include <stdint.h>
#include <string.h>
#include <math.h>

#include "lowbit_native.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define USE_AVX512 1
#endif

#define MAX_M 16

/* One weight, as both entry points receive it (see lowbit_lut_matmul). */
typedef struct {
    int bits, kind;
    const uint8_t *codes;
    int64_t row_bytes;
    const float *table;
    const void *scales;
    int scale_mode;
    const float *scale_table, *zeros;
    int64_t N, K, G, g, row_div;
} Lut;

static inline float scale_of(const void *scales, int scale_mode, const float *scale_table, int64_t idx) {
    if (scale_mode == 0) return ((const float *)scales)[idx];
    return scale_table[((const uint8_t *)scales)[idx]];
}

/* Value of an 8-bit code: kind 0 signed int8, 1 E4M3 (fn), 2 E5M2. */
static inline float decode8(uint8_t c, int kind) {
    if (kind == 0) return (float)(int8_t)c;
    if (kind == 1) {
        uint32_t bits = (uint32_t)(c & 0x7F) << 20;
        float f; memcpy(&f, &bits, 4);
        f *= 0x1p120f; /* exponent rebias; also scales E4M3 subnormals correctly */
        return (c & 0x80) ? -f : f;
    }
    int e = (c >> 2) & 0x1F, m = c & 3;
    float f = e == 0 ? ldexpf((float)m, -16) : ldexpf(1.0f + m / 4.0f, e - 15);
    return (c & 0x80) ? -f : f;
}

#ifdef USE_AVX512
static inline __attribute__((always_inline)) __m512 decode8_vec(__m128i bytes, int kind) {
    __m512i v = _mm512_cvtepu8_epi32(bytes);
    if (kind == 0) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    if (kind == 1) {
        __m512i mag = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7F)), 20);
        __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
        __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
        return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
    }
    __m256i half = _mm512_cvtepi32_epi16(_mm512_slli_epi32(v, 8));
    return _mm512_cvtph_ps(half);
}
#endif

#define MB_MAX 4 /* rows of x per pass: their accumulators stay in registers */

#ifdef USE_AVX512
/* A row's four accumulator chains, summed in a fixed order. */
INLINE float sum4(const __m512 *acc) {
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

INLINE int64_t group_of(int64_t k, int gshift, int64_t G) {
    if (gshift < 0) return 0;
    int64_t j = k >> gshift;
    return j < G ? j : G - 1; /* the padding past K reads the last group's scale; x is 0 there */
}

/* Weight vector for elements [k, k+16) of a 4-bit row: table lookup, zero point, scale. */
INLINE __m512 weights4(const int has_zero, __m512i c, const __m512 tab, const void *scales, int scale_mode,
                       const float *scale_table, const float *zrow, int64_t srow, int64_t j) {
    __m512 w = _mm512_permutexvar_ps(c, tab);
    if (has_zero) w = _mm512_sub_ps(w, _mm512_set1_ps(zrow[j]));
    return _mm512_mul_ps(w, _mm512_set1_ps(scale_of(scales, scale_mode, scale_table, srow + j)));
}

/* Rows m0..m0+MB of x against output row n. MB and has_zero are compile-time constants at every
   call site, so the loops over m unroll and the accumulators stay in registers; four
   accumulator chains per row hide the FMA latency. */
INLINE void row4_block(const int MB, const int has_zero, const uint8_t *crow, const __m512 tab,
                       const void *scales, int scale_mode, const float *scale_table, const float *zrow,
                       int64_t srow, int64_t G, int gshift, int64_t K, const float *x, int64_t ldx, float *out) {
    const __m512i low = _mm512_set1_epi32(15);
    __m512 acc[MB_MAX][4];
    for (int m = 0; m < MB; m++)
        for (int a = 0; a < 4; a++) acc[m][a] = _mm512_setzero_ps();
    const int64_t chunks = (K + 31) / 32;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t k = c * 32;
        const int a = (int)(c & 1) * 2;
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(crow + c * 16)));
        __m512 wlo = weights4(has_zero, _mm512_and_si512(b, low), tab, scales, scale_mode, scale_table, zrow, srow, group_of(k, gshift, G));
        __m512 whi = weights4(has_zero, _mm512_srli_epi32(b, 4), tab, scales, scale_mode, scale_table, zrow, srow, group_of(k + 16, gshift, G));
        for (int m = 0; m < MB; m++) {
            acc[m][a] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k), wlo, acc[m][a]);
            acc[m][a + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * ldx + k + 16), whi, acc[m][a + 1]);
        }
    }
    for (int m = 0; m < MB; m++) out[m] = sum4(acc[m]);
}

INLINE void row8_block(const int MB, const int kind, const uint8_t *crow, const void *scales, int scale_mode,
                       const float *scale_table, int64_t srow, int64_t G, int gshift, int64_t K,
                       const float *x, int64_t ldx, float *out) {
    __m512 acc[MB_MAX][4];
    for (int m = 0; m < MB; m++)
        for (int a = 0; a < 4; a++) acc[m][a] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const int a = (int)((k >> 4) & 3);
        int64_t left = K - k;
        __mmask16 mask = lowbit_lanes(left);
        __m512 w = decode8_vec(_mm_maskz_loadu_epi8(mask, crow + k), kind);
        w = _mm512_mul_ps(w, _mm512_set1_ps(scale_of(scales, scale_mode, scale_table, srow + group_of(k, gshift, G))));
        for (int m = 0; m < MB; m++)
            acc[m][a] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * ldx + k), w, acc[m][a]);
    }
    for (int m = 0; m < MB; m++) out[m] = sum4(acc[m]);
}
#endif

/* The k >> gshift of a column's group: g is a power of two; -1 for one group per row. */
static inline int group_shift(const Lut *L) { return L->G == 1 ? -1 : __builtin_ctzll((unsigned long long)L->g); }

/* Output row n of a 4-bit weight for the mb <= MB_MAX rows of x at xb: out[0..mb). */
static void row4(const Lut *L, int64_t n, const float *xb, int64_t ldx, int64_t mb, float *out) {
    const uint8_t *crow = L->codes + n * L->row_bytes;
    const int64_t G = L->G, K = L->K, srow = (n / L->row_div) * G;
    const float *zrow = L->zeros ? L->zeros + n * G : 0;
    const void *scales = L->scales;
    const int scale_mode = L->scale_mode;
    const float *scale_table = L->scale_table;
#ifdef USE_AVX512
    const int gshift = group_shift(L);
    const __m512 tab = _mm512_loadu_ps(L->table);
#define R4(MB, Z) row4_block(MB, Z, crow, tab, scales, scale_mode, scale_table, zrow, srow, G, gshift, K, xb, ldx, out)
    if (zrow) {
        switch (mb) { case 1: R4(1, 1); break; case 2: R4(2, 1); break; case 3: R4(3, 1); break; default: R4(4, 1); }
    } else {
        switch (mb) { case 1: R4(1, 0); break; case 2: R4(2, 0); break; case 3: R4(3, 0); break; default: R4(4, 0); }
    }
#undef R4
#else
    const int64_t g = L->g;
    const float *table = L->table;
    for (int64_t m = 0; m < mb; m++) out[m] = 0.0f;
    for (int64_t j = 0; j < G; j++) {
        int64_t k0 = j * g, k1 = k0 + g < K ? k0 + g : K;
        float s = scale_of(scales, scale_mode, scale_table, srow + j);
        float z = zrow ? zrow[j] : 0.0f;
        for (int64_t m = 0; m < mb; m++) {
            float part = 0.0f, xsum = 0.0f;
            for (int64_t k = k0; k < k1; k++) {
                uint8_t byte = crow[(k >> 5) * 16 + (k & 15)];
                part += xb[m * ldx + k] * table[(k & 16) ? byte >> 4 : byte & 15];
                xsum += xb[m * ldx + k];
            }
            out[m] += s * (part - z * xsum);
        }
    }
#endif
}

/* row4 for 8-bit codes (unpadded rows of K bytes). */
static void row8(const Lut *L, int64_t n, const float *xb, int64_t ldx, int64_t mb, float *out) {
    const int64_t G = L->G, K = L->K, srow = (n / L->row_div) * G;
    const uint8_t *crow = L->codes + n * K;
    const int kind = L->kind;
    const void *scales = L->scales;
    const int scale_mode = L->scale_mode;
    const float *scale_table = L->scale_table;
#ifdef USE_AVX512
    const int gshift = group_shift(L);
#define R8(MB, KIND) row8_block(MB, KIND, crow, scales, scale_mode, scale_table, srow, G, gshift, K, xb, ldx, out)
#define R8K(MB) do { if (kind == 0) R8(MB, 0); else if (kind == 1) R8(MB, 1); else R8(MB, 2); } while (0)
    switch (mb) { case 1: R8K(1); break; case 2: R8K(2); break; case 3: R8K(3); break; default: R8K(4); }
#undef R8K
#undef R8
#else
    const int64_t g = L->g;
    for (int64_t m = 0; m < mb; m++) out[m] = 0.0f;
    for (int64_t j = 0; j < G; j++) {
        int64_t k0 = j * g, k1 = k0 + g < K ? k0 + g : K;
        float s = scale_of(scales, scale_mode, scale_table, srow + j);
        for (int64_t m = 0; m < mb; m++) {
            float part = 0.0f;
            for (int64_t k = k0; k < k1; k++) part += xb[m * ldx + k] * decode8(crow[k], kind);
            out[m] += s * part;
        }
    }
#endif
}

/* bits: 4 or 8. kind (8-bit): 0 int8, 1 E4M3, 2 E5M2. M <= MAX_M rows per call. */
int lowbit_lut_matmul(int bits, int kind, const uint8_t *codes, int64_t row_bytes, const float *table,
                      const void *scales, int scale_mode, const float *scale_table, const float *zeros,
                      int64_t N, int64_t K, int64_t G, int64_t g, int64_t row_div, const float *x,
                      int64_t ldx, int64_t M, float *y, int threads) {
    if (M > MAX_M || M < 1) return -1;
    const Lut L = {bits, kind, codes, row_bytes, table, scales, scale_mode, scale_table, zeros, N, K, G, g, row_div};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        /* one output row n for all M rows of x (fp32 [M, ldx]), in passes of MB_MAX rows */
        float out[MB_MAX];
        for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
            const int64_t mb = M - m0 < MB_MAX ? M - m0 : MB_MAX;
            if (bits == 4) row4(&L, n, x + m0 * ldx, ldx, mb, out);
            else row8(&L, n, x + m0 * ldx, ldx, mb, out);
            for (int64_t m = 0; m < mb; m++) y[(m0 + m) * N + n] = out[m];
        }
    }
    return 0;
}

/* The dense float32 weight [N, ldw] (columns >= K untouched), for large batches. */
int lowbit_lut_dequant(int bits, int kind, const uint8_t *codes, int64_t row_bytes, const float *table,
                       const void *scales, int scale_mode, const float *scale_table, const float *zeros,
                       int64_t N, int64_t K, int64_t G, int64_t g, int64_t row_div, float *w, int64_t ldw,
                       int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t srow = (n / row_div) * G;
        for (int64_t k = 0; k < K; k++) {
            int64_t j = k / g;
            float s = scale_of(scales, scale_mode, scale_table, srow + j);
            float v;
            if (bits == 4) {
                uint8_t byte = codes[n * row_bytes + (k >> 5) * 16 + (k & 15)];
                v = table[(k & 16) ? byte >> 4 : byte & 15];
                if (zeros) v -= zeros[n * G + j];
            } else {
                v = decode8(codes[n * K + k], kind);
            }
            w[n * ldw + k] = v * s;
        }
    }
    return 0;
}

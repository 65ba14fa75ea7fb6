/* CPU matmul for 4-bit codes through bf16 dot products (AVX512-BF16 `vdpbf16ps`):
   y[m, n] = post * sum_k x[m, k] * w[n, k], x in bf16, accumulation in float32.

   w[n, k] = (T[code] - z[n, j]) * s[n, j] for group j = k >> gshift. Per group the kernel turns
   the 16-entry float table into a 16-entry bf16 table of weights (scale and zero point folded in)
   and decodes 32 codes at a time with one `vpermw`; one `vdpbf16ps` then multiplies 32 weights
   by 32 activations per row of x. Python (kernels/cpu_bf16.py) only chooses this kernel when every
   such weight is a bf16 number (E2M1 times a power-of-two or E4M3 scale: at most 6 significant
   bits), or runs it in "pair" mode, where each weight is the sum of two bf16 numbers (hi = bf16(w),
   lo = bf16(w - hi); |w - hi - lo| <= 2^-17 |w|) and each row takes two dot products.

   Scales are float32 [R, G] (tables built in registers per group: multiply, convert) or one-byte
   codes [R, G] whose 256 possible tables were built at load time (a 32-byte load per group).
   `post` multiplies every output (nvfp4's global scale, kept out of the bf16 weights).

   Codes are repacked by Python in blocks of 64 elements: byte i of a block holds element i in its
   low nibble and element 32 + i in its high nibble, so a zero-extension to 16-bit lanes and one
   AND / one shift give the codes of elements 0-31 and 32-63 in order. Rows are zero-padded to
   whole blocks and x to the same width (ldx = 64 * blocks), so there are no masks. */

#include <stdint.h>
#include <string.h>

#include "lowbit_native.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_BF16DOT 1
#else
#define HAVE_BF16DOT 0
#endif

/* One prepared weight; kernels/cpu_bf16.py builds the same struct with ctypes. */
typedef struct {
    const uint8_t *codes;        /* [N, row_bytes] repacked codes */
    int64_t row_bytes;
    const float *table;          /* [16] value of each code at scale 1 */
    const void *scales;          /* float32 [R, G] (mode 0) or uint8 codes [R, G] (mode 1) */
    const uint16_t *code_tables; /* mode 1: [256][16] bf16 weights for each scale code */
    const float *zeros;          /* float32 [N, G] or NULL */
    int64_t N, blocks, G;        /* rows, 64-element blocks per row, groups per row */
    int64_t row_div;             /* rows sharing one scale row */
    int32_t gshift;              /* log2 group (>= 4); 62 for one group per row */
    int32_t mode, pair;
    float post;                  /* multiplies every output */
} Weight;

int lowbit_bf16_available(void) { return HAVE_BF16DOT; }

#if HAVE_BF16DOT
#define MB_MAX 8
#define MAX_M 8     /* rows of x per pass over a weight tile */
#define ROW_TILE 16 /* weight rows per tile: re-read from cache for each pass over x */

INLINE int64_t clamp_group(int64_t j, int64_t G) { return j < G ? j : G - 1; }

/* 16 float32 weights of group j for a mode-0 row: (T - z) * s. */
INLINE __m512 group_values(const Weight *w, const __m512 tab, int has_zero, int64_t srow, int64_t zrow, int64_t j) {
    __m512 v = tab;
    if (has_zero) v = _mm512_sub_ps(v, _mm512_set1_ps(w->zeros[zrow + j]));
    return _mm512_mul_ps(v, _mm512_set1_ps(((const float *)w->scales)[srow + j]));
}

/* 32-entry bf16 table: words 0-15 = bf16(a), 16-31 = bf16(b). */
INLINE __m512i two_tables(__m512 a, __m512 b) { return (__m512i)_mm512_cvtne2ps_pbh(b, a); }

/* Pair mode: words 0-15 = hi = bf16(f), 16-31 = lo = bf16(f - hi). */
INLINE __m512i hi_lo_table(__m512 f) {
    __m512 hi = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(f));
    return two_tables(f, _mm512_sub_ps(f, hi));
}

INLINE __m512i coded_table(const Weight *w, int64_t srow, int64_t j) {
    const uint8_t c = ((const uint8_t *)w->scales)[srow + j];
    return _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w->code_tables + 16 * (int64_t)c)));
}

INLINE __m512i coded_tables2(const Weight *w, int64_t srow, int64_t j0, int64_t j1) {
    const uint8_t *s = (const uint8_t *)w->scales + srow;
    __m512i t = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w->code_tables + 16 * (int64_t)s[j0])));
    return _mm512_inserti64x4(t, _mm256_loadu_si256((const __m256i *)(w->code_tables + 16 * (int64_t)s[j1])), 1);
}

/* The tables for the two halves of block b (elements 64b..64b+31 and 64b+32..64b+63).
   GM: 16, 32 or 64 (groups of >= 64 elements, one table reused while the group lasts). */
INLINE void block_tables(const int GM, const int MODE, const int HZ, const int PAIR, const Weight *w,
                         const __m512 tab, int64_t srow, int64_t zrow, int64_t b, int first, __m512i *tlo, __m512i *thi) {
    const int64_t G = w->G;
    if (GM == 16) {
        int64_t j = 4 * b;
        if (MODE == 1) {
            *tlo = coded_tables2(w, srow, clamp_group(j, G), clamp_group(j + 1, G));
            *thi = coded_tables2(w, srow, clamp_group(j + 2, G), clamp_group(j + 3, G));
        } else {
            *tlo = two_tables(group_values(w, tab, HZ, srow, zrow, clamp_group(j, G)), group_values(w, tab, HZ, srow, zrow, clamp_group(j + 1, G)));
            *thi = two_tables(group_values(w, tab, HZ, srow, zrow, clamp_group(j + 2, G)), group_values(w, tab, HZ, srow, zrow, clamp_group(j + 3, G)));
        }
    } else if (GM == 32) {
        int64_t j = 2 * b;
        if (MODE == 1) {
            *tlo = coded_table(w, srow, clamp_group(j, G));
            *thi = coded_table(w, srow, clamp_group(j + 1, G));
        } else {
            __m512 a = group_values(w, tab, HZ, srow, zrow, clamp_group(j, G));
            __m512 c = group_values(w, tab, HZ, srow, zrow, clamp_group(j + 1, G));
            *tlo = PAIR ? hi_lo_table(a) : two_tables(a, a);
            *thi = PAIR ? hi_lo_table(c) : two_tables(c, c);
        }
    } else {
        const int64_t k = 64 * b;
        if (first || (k & ((1LL << w->gshift) - 1)) == 0) { /* a new group (or K tile) starts here */
            int64_t j = clamp_group(k >> w->gshift, G);
            if (MODE == 1) {
                *tlo = coded_table(w, srow, j);
            } else {
                __m512 a = group_values(w, tab, HZ, srow, zrow, j);
                *tlo = PAIR ? hi_lo_table(a) : two_tables(a, a);
            }
            *thi = *tlo;
        }
    }
}

/* Rows 0..MB of x against weight row n over blocks [b0, b1): sums added to out[0..MB). */
INLINE void row_block(const int MB, const int GM, const int MODE, const int HZ, const int PAIR, const Weight *w,
                      int64_t n, int64_t b0, int64_t b1, const uint16_t *x, int64_t ldx, float *out) {
    const int CH = MB <= 2 ? 4 : 2; /* accumulator chains per row: enough to hide the dot latency */
    const uint8_t *crow = w->codes + n * w->row_bytes;
    const int64_t srow = (n / w->row_div) * w->G;
    const int64_t zrow = n * w->G;
    const __m512 tab = _mm512_loadu_ps(w->table);
    const __m512i low = _mm512_set1_epi16(15);
    /* g = 16: lanes 16-31 of each half belong to the next group, the table's upper 16 words */
    const __m512i upper = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    const __m512i lo_part = _mm512_set1_epi16(16);
    __m512 acc[MB_MAX][4];
    for (int m = 0; m < MB; m++)
        for (int a = 0; a < CH; a++) acc[m][a] = _mm512_setzero_ps();
    __m512i tlo = _mm512_setzero_si512(), thi = _mm512_setzero_si512();
    for (int64_t b = b0; b < b1; b++) {
        block_tables(GM, MODE, HZ, PAIR, w, tab, srow, zrow, b, b == b0, &tlo, &thi);
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(crow + 32 * b)));
        __m512i ilo = _mm512_and_si512(v, low);
        __m512i ihi = _mm512_srli_epi16(v, 4);
        if (GM == 16) {
            ilo = _mm512_or_si512(ilo, upper);
            ihi = _mm512_or_si512(ihi, upper);
        }
        __m512bh wlo = (__m512bh)_mm512_permutexvar_epi16(ilo, tlo);
        __m512bh whi = (__m512bh)_mm512_permutexvar_epi16(ihi, thi);
        const int a = CH == 4 ? (int)(b & 1) * 2 : 0;
        const uint16_t *xb = x + 64 * b;
        for (int m = 0; m < MB; m++) {
            __m512bh xlo = (__m512bh)_mm512_loadu_si512((const void *)(xb + m * ldx));
            __m512bh xhi = (__m512bh)_mm512_loadu_si512((const void *)(xb + m * ldx + 32));
            acc[m][a] = _mm512_dpbf16_ps(acc[m][a], xlo, wlo);
            acc[m][a + 1] = _mm512_dpbf16_ps(acc[m][a + 1], xhi, whi);
        }
        if (PAIR) {
            __m512bh rlo = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(ilo, lo_part), tlo);
            __m512bh rhi = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(ihi, lo_part), thi);
            const int c = CH == 4 ? a ^ 2 : 0;
            for (int m = 0; m < MB; m++) {
                __m512bh xlo = (__m512bh)_mm512_loadu_si512((const void *)(xb + m * ldx));
                __m512bh xhi = (__m512bh)_mm512_loadu_si512((const void *)(xb + m * ldx + 32));
                acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xlo, rlo);
                acc[m][c + 1] = _mm512_dpbf16_ps(acc[m][c + 1], xhi, rhi);
            }
        }
    }
    for (int m = 0; m < MB; m++) {
        __m512 s = _mm512_add_ps(acc[m][0], acc[m][1]);
        if (CH == 4) s = _mm512_add_ps(s, _mm512_add_ps(acc[m][2], acc[m][3]));
        out[m] += _mm512_reduce_add_ps(s);
    }
}

/* Pair mode with groups of >= 64 and no zero point (NF4): the code book itself is split once,
   T = T_hi + T_lo, each group's dot products are summed unscaled and the sum is multiplied by the
   group's float32 scale. Same weights as T[c] * s up to 2^-17 relative, fewer table builds. */
INLINE void row_block_outer(const int MB, const Weight *w, int64_t n, int64_t b0, int64_t b1,
                            const uint16_t *x, int64_t ldx, float *out) {
    const int CH = MB <= 4 ? 4 : 2;
    const uint8_t *crow = w->codes + n * w->row_bytes;
    const float *srow = (const float *)w->scales + (n / w->row_div) * w->G;
    const __m512i t = hi_lo_table(_mm512_loadu_ps(w->table));
    const __m512i low = _mm512_set1_epi16(15), lo_part = _mm512_set1_epi16(16);
    const int64_t gmask = (1LL << w->gshift) - 1;
    __m512 acc[MB_MAX], part[MB_MAX][4];
    for (int m = 0; m < MB; m++) {
        acc[m] = _mm512_setzero_ps();
        for (int a = 0; a < CH; a++) part[m][a] = _mm512_setzero_ps();
    }
    float s = srow[clamp_group((64 * b0) >> w->gshift, w->G)];
    for (int64_t b = b0; b < b1; b++) {
        if (b > b0 && ((64 * b) & gmask) == 0) { /* group boundary: scale the finished group's sums */
            const __m512 vs = _mm512_set1_ps(s);
            for (int m = 0; m < MB; m++) {
                __m512 p = _mm512_add_ps(part[m][0], part[m][1]);
                if (CH == 4) p = _mm512_add_ps(p, _mm512_add_ps(part[m][2], part[m][3]));
                acc[m] = _mm512_fmadd_ps(p, vs, acc[m]);
                for (int a = 0; a < CH; a++) part[m][a] = _mm512_setzero_ps();
            }
            s = srow[clamp_group((64 * b) >> w->gshift, w->G)];
        }
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(crow + 32 * b)));
        __m512i ilo = _mm512_and_si512(v, low), ihi = _mm512_srli_epi16(v, 4);
        __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(ilo, t);
        __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(ihi, t);
        __m512bh r0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(ilo, lo_part), t);
        __m512bh r1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(ihi, lo_part), t);
        const uint16_t *xb = x + 64 * b;
        for (int m = 0; m < MB; m++) {
            __m512bh xlo = (__m512bh)_mm512_loadu_si512((const void *)(xb + m * ldx));
            __m512bh xhi = (__m512bh)_mm512_loadu_si512((const void *)(xb + m * ldx + 32));
            part[m][0] = _mm512_dpbf16_ps(part[m][0], xlo, w0);
            part[m][1] = _mm512_dpbf16_ps(part[m][1], xhi, w1);
            part[m][CH - 2] = _mm512_dpbf16_ps(part[m][CH - 2], xlo, r0);
            part[m][CH - 1] = _mm512_dpbf16_ps(part[m][CH - 1], xhi, r1);
        }
    }
    const __m512 vs = _mm512_set1_ps(s);
    for (int m = 0; m < MB; m++) {
        __m512 p = _mm512_add_ps(part[m][0], part[m][1]);
        if (CH == 4) p = _mm512_add_ps(p, _mm512_add_ps(part[m][2], part[m][3]));
        out[m] += _mm512_reduce_add_ps(_mm512_fmadd_ps(p, vs, acc[m]));
    }
}

/* Rows 0..M (M <= 8) of x against weight row n over blocks [b0, b1), split into blocks of 8, 4,
   2, 1 so each block's accumulators stay in registers; sums added to out[0..M). */
#define ROWS_FOR(GM, MODE, HZ, PAIR)                                                                  \
    static void rows_##GM##_##MODE##_##HZ##_##PAIR(const Weight *w, int64_t n, int64_t b0, int64_t b1, \
                                                   const uint16_t *x, int64_t ldx, int64_t M,       \
                                                   float *out) {                                    \
        for (int64_t m0 = 0; m0 < M;) {                                                             \
            int64_t left = M - m0, mb = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;          \
            const uint16_t *xb = x + m0 * ldx;                                                      \
            if (PAIR && GM == 64 && MODE == 0 && !HZ) {                                             \
                if (mb == 8) row_block_outer(8, w, n, b0, b1, xb, ldx, out + m0);                   \
                else if (mb == 4) row_block_outer(4, w, n, b0, b1, xb, ldx, out + m0);              \
                else if (mb == 2) row_block_outer(2, w, n, b0, b1, xb, ldx, out + m0);              \
                else row_block_outer(1, w, n, b0, b1, xb, ldx, out + m0);                           \
            } else if (mb == 8) row_block(8, GM, MODE, HZ, PAIR, w, n, b0, b1, xb, ldx, out + m0);         \
            else if (mb == 4) row_block(4, GM, MODE, HZ, PAIR, w, n, b0, b1, xb, ldx, out + m0);    \
            else if (mb == 2) row_block(2, GM, MODE, HZ, PAIR, w, n, b0, b1, xb, ldx, out + m0);    \
            else row_block(1, GM, MODE, HZ, PAIR, w, n, b0, b1, xb, ldx, out + m0);                 \
            m0 += mb;                                                                               \
        }                                                                                           \
    }

typedef void (*rows_fn)(const Weight *, int64_t, int64_t, int64_t, const uint16_t *, int64_t, int64_t, float *);

/* The compiled variants (group 16/32/64+, mode, zero point, pair): X(GM, MODE, HZ, PAIR) each. */
#define VARIANTS(X)                                                                                   \
    X(16, 1, 0, 0) X(32, 1, 0, 0) X(64, 1, 0, 0)                                                      \
    X(16, 0, 0, 0) X(32, 0, 0, 0) X(64, 0, 0, 0) X(16, 0, 1, 0) X(32, 0, 1, 0) X(64, 0, 1, 0)         \
    X(32, 0, 0, 1) X(64, 0, 0, 1) X(32, 0, 1, 1) X(64, 0, 1, 1)
VARIANTS(ROWS_FOR)

static rows_fn pick(int gm, int mode, int hz, int pair) {
#define P(GM, MODE, HZ, PAIR) if (gm == GM && mode == MODE && hz == HZ && pair == PAIR) return rows_##GM##_##MODE##_##HZ##_##PAIR;
    VARIANTS(P)
#undef P
    return 0;
}
#endif

/* y[M, N] = x[M, 64 * blocks] (bf16, zero-padded, row stride ldx) times the weight; y is float32, or bf16 when
   out_bf16 (rounded to nearest even, as torch does). Returns 0, or -1 for an unsupported weight. */
int lowbit_bf16_matmul(const Weight *w, const uint16_t *x, int64_t ldx, int64_t M, void *y, int out_bf16, int threads) {
#if HAVE_BF16DOT
    const int gm = w->gshift == 4 ? 16 : w->gshift == 5 ? 32 : 64;
    rows_fn fn = pick(gm, w->mode, w->zeros != 0, w->pair);
    if (!fn || M < 1 || w->gshift < 4 || ldx < 64 * w->blocks) return -1;
    const int64_t N = w->N;
    float *yf = out_bf16 ? 0 : (float *)y;
    uint16_t *yb = out_bf16 ? (uint16_t *)y : 0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += ROW_TILE) {
        float out[ROW_TILE * MAX_M];
        const int64_t nt = N - n0 < ROW_TILE ? N - n0 : ROW_TILE;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            const int64_t mt = M - m0 < MAX_M ? M - m0 : MAX_M;
            for (int64_t i = 0; i < nt * MAX_M; i++) out[i] = 0.0f;
            for (int64_t i = 0; i < nt; i++) fn(w, n0 + i, 0, w->blocks, x + m0 * ldx, ldx, mt, out + i * MAX_M);
            for (int64_t m = 0; m < mt; m++)
                for (int64_t i = 0; i < nt; i++) {
                    float v = out[i * MAX_M + m] * w->post;
                    if (yb) yb[(m0 + m) * N + n0 + i] = lowbit_bf16_bits(v); /* as torch rounds */
                    else yf[(m0 + m) * N + n0 + i] = v;
                }
        }
    }
    return 0;
#else
    (void)w; (void)x; (void)ldx; (void)M; (void)y; (void)out_bf16; (void)threads;
    return -1;
#endif
}

/* The bf16 weight [N, ldo] (columns past 64 * blocks untouched): part 0 = the weights (hi in pair
   mode), part 1 = the pair's lo parts. For large batches, which then run one bf16 GEMM per part. */
int lowbit_bf16_dequant(const Weight *w, uint16_t *out, int64_t ldo, int part, int threads) {
#if HAVE_BF16DOT
    if (w->gshift < 4 || ldo < 64 * w->blocks || (part && !w->pair)) return -1;
    const int gm = w->gshift == 4 ? 16 : w->gshift == 5 ? 32 : 64;
    const int hz = w->zeros != 0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < w->N; n++) {
        const uint8_t *crow = w->codes + n * w->row_bytes;
        const int64_t srow = (n / w->row_div) * w->G, zrow = n * w->G;
        const __m512 tab = _mm512_loadu_ps(w->table);
        const __m512i low = _mm512_set1_epi16(15);
        const __m512i upper = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
        const __m512i sel = _mm512_set1_epi16(part ? 16 : 0);
        __m512i tlo = _mm512_setzero_si512(), thi = _mm512_setzero_si512();
        for (int64_t b = 0; b < w->blocks; b++) {
            if (gm == 16) block_tables(16, w->mode, hz, w->pair, w, tab, srow, zrow, b, b == 0, &tlo, &thi);
            else if (gm == 32) block_tables(32, w->mode, hz, w->pair, w, tab, srow, zrow, b, b == 0, &tlo, &thi);
            else block_tables(64, w->mode, hz, w->pair, w, tab, srow, zrow, b, b == 0, &tlo, &thi);
            __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(crow + 32 * b)));
            __m512i ilo = _mm512_or_si512(_mm512_and_si512(v, low), sel);
            __m512i ihi = _mm512_or_si512(_mm512_srli_epi16(v, 4), sel);
            if (gm == 16) {
                ilo = _mm512_or_si512(ilo, upper);
                ihi = _mm512_or_si512(ihi, upper);
            }
            _mm512_storeu_si512((void *)(out + n * ldo + 64 * b), _mm512_permutexvar_epi16(ilo, tlo));
            _mm512_storeu_si512((void *)(out + n * ldo + 64 * b + 32), _mm512_permutexvar_epi16(ihi, thi));
        }
    }
    return 0;
#else
    (void)w; (void)out; (void)ldo; (void)part; (void)threads;
    return -1;
#endif
}

/* CPU matmul for symmetric int8 weights with float32 activations (the cpu-int8f path,
   kernels/cpu_int8.py): y[m, n] = sum_j s[n, j] * sum_{k in group j} x[m, k] * q[n, k].

   Why: torch's `_weight_int8pack_mm` rounds x to bf16 and was slower at one row than the same
   matrix in bf16, although int8 reads half the bytes; the W8A8 kernel (int4_vnni.c) is fast but
   rounds x to int8. Here each code is widened to float32 (exact) and multiplied by the float32
   activation (an exact product inside the FMA), so the only roundings are float32 sums.

   Batch-invariant: every output (m, n) is computed by the same instructions in the same order
   whatever M is and however rows are tiled or split over threads: per group one 16-lane
   accumulator over k in order (the last partial vector masked), then tot = acc * s + tot per
   group (acc * s when the row has one group), then one fixed horizontal sum. A speculative
   verify's row i therefore equals a one-row call bit for bit.

   Layout: q int8 [N, ldw] row-major (the stored signed codes), s float32 [N, G], groups of
   `group` columns (a multiple of 16, the last one may be shorter) or one group per row (G = 1,
   any K), x float32 [M, ldx], y float32 [M, ldy]. */

#include <stdint.h>

#include "lowbit_native.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_INT8F 1
#else
#define HAVE_INT8F 0
#endif
/* Without AVX-512 (Zen 2/3, most laptops): the same tiling in 8 lanes (section below); its sums
   run over 8 lanes instead of 16, so its bits are its own, batch-invariant the same way. */
#if !HAVE_INT8F && defined(__AVX2__) && defined(__FMA__)
#define HAVE_INT8F_AVX2 1
#else
#define HAVE_INT8F_AVX2 0
#endif

typedef struct {
    const int8_t *q;
    const float *s;
    int64_t N, K, ldw, G, group;
} Weight8;

/* 1: AVX-512; 2: AVX2; 0: neither. */
int lowbit_int8f_available(void) { return HAVE_INT8F ? 1 : HAVE_INT8F_AVX2 ? 2 : 0; }

#if HAVE_INT8F
#define NT 4 /* weight rows per tile */
/* x rows per pass over a tile. One group per row: 24 accumulators + 6 x vectors + 1 weight (a
   verify of 1 + 4 or 1 + 5 rows is one pass). Grouped: 12 group accumulators + 12 totals + 3 x
   + 1 weight. Slower here (AMD EPYC, 512-bit ops on 256-bit units), all tried: 2 weight rows x 6
   x rows (spills), totals kept in L1 with 6 x rows, and a float32 copy of the tile shared by the
   passes (the widening it saves costs as much as the copy). */
#define MT 6
#define MT_GROUP 3
#define MT_MAX 6 /* the larger of MT and MT_GROUP: run_tiles' buffers */
#define PREFETCH_TILES 4
#define MC 128     /* x rows per sweep over a thread's tiles (prefill): 288 KB of x at K = 576 stays in L2 */

/* Sixteen codes as float32 (exact). */
INLINE __m512 codes16(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

INLINE __m512 codes16_tail(__mmask16 mask, const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}

/* Weight rows n0..n0+NB-1 against x rows 0..MB-1: out[m * NB + nb]. ONE: one group per row. */
INLINE void int8_tile(const int ONE, const int NB, const int MB, const Weight8 *w, int64_t n0, const float *x, int64_t ldx,
                      float *out) {
    const int8_t *q = w->q + n0 * w->ldw;
    const int64_t ldw = w->ldw, K = w->K, G = ONE ? 1 : w->G, group = ONE ? K : w->group;
    const float *s = w->s + n0 * G;
    __m512 acc[NT][MT], tot[NT][MT];
    for (int nb = 0; nb < NB; nb++)
        for (int m = 0; m < MB; m++) tot[nb][m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < G; j++) {
        const int64_t k0 = j * group, k1 = k0 + group < K ? k0 + group : K;
        for (int nb = 0; nb < NB; nb++)
            for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; k + 16 <= k1; k += 16) {
            __m512 xv[MT];
            for (int m = 0; m < MB; m++) xv[m] = _mm512_loadu_ps(x + m * ldx + k);
            for (int nb = 0; nb < NB; nb++) {
                /* the same k of the rows PREFETCH_TILES tiles on, into L2: short streams the
                   hardware prefetcher learns late (as in f32_dot.c). One tile ahead left one row
                   at 2.1 ms, four 1.4; once per 64-byte line 1.2 with one group per row, while
                   grouped rows ran faster with one per 16 bytes (SmolLM2's head, one thread). */
                if (!ONE || (k & 63) == 0) _mm_prefetch((const char *)(q + (PREFETCH_TILES * NB + nb) * ldw + k), _MM_HINT_T1);
                const __m512 wv = codes16(q + nb * ldw + k);
                for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_fmadd_ps(wv, xv[m], acc[nb][m]);
            }
        }
        if (k < k1) {
            const __mmask16 mask = lowbit_lanes(k1 - k);
            __m512 xv[MT];
            for (int m = 0; m < MB; m++) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
            for (int nb = 0; nb < NB; nb++) {
                const __m512 wv = codes16_tail(mask, q + nb * ldw + k);
                for (int m = 0; m < MB; m++) acc[nb][m] = _mm512_fmadd_ps(wv, xv[m], acc[nb][m]);
            }
        }
        for (int nb = 0; nb < NB; nb++) {
            const __m512 sv = _mm512_set1_ps(s[nb * G + j]);
            for (int m = 0; m < MB; m++)
                tot[nb][m] = ONE ? _mm512_mul_ps(acc[nb][m], sv) : _mm512_fmadd_ps(acc[nb][m], sv, tot[nb][m]);
        }
    }
    for (int nb = 0; nb < NB; nb++)
        for (int m = 0; m < MB; m++) out[m * NB + nb] = _mm512_reduce_add_ps(tot[nb][m]);
}

/* Constant ONE, NB and MB per case, so each compiles to its own unrolled loop (grouped passes
   have at most MT_GROUP rows: the larger cases are never called with ONE = 0). */
#define TILE_CASES(ONE, NB)                                            \
    switch (mb) {                                                      \
    case 1: int8_tile(ONE, NB, 1, w, n0, x, ldx, out); break;          \
    case 2: int8_tile(ONE, NB, 2, w, n0, x, ldx, out); break;          \
    case 3: int8_tile(ONE, NB, 3, w, n0, x, ldx, out); break;          \
    case 4: int8_tile(ONE, NB, 4, w, n0, x, ldx, out); break;          \
    case 5: int8_tile(ONE, NB, 5, w, n0, x, ldx, out); break;          \
    default: int8_tile(ONE, NB, 6, w, n0, x, ldx, out); break;         \
    }

typedef void (*pass_fn)(const Weight8 *, int64_t, int, const float *, int64_t, float *);
#define PASS(NAME, ONE, NB) \
    static void NAME(const Weight8 *w, int64_t n0, int mb, const float *x, int64_t ldx, float *out) { TILE_CASES(ONE, NB) }
PASS(pass_one_tile, 1, NT) PASS(pass_one_row, 1, 1) PASS(pass_grp_tile, 0, NT) PASS(pass_grp_row, 0, 1)
#endif

#if HAVE_INT8F_AVX2
/* AVX2: 16 ymm registers, so fewer x rows per pass (one group per row: 8 accumulators + 2 x + 1
   weight; grouped: one x row at a time through grouped_rows8 below, or up to MT_GROUP rows through
   grouped_rows8_mb). */
#define NT 4
#define MT 2
#define MT_GROUP 4
#define MT_MAX 4 /* the larger of MT and MT_GROUP: run_tiles' buffers */
#define PREFETCH_TILES 4
#define MC 128

/* Eight codes as float32 (exact). */
INLINE __m256 codes8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

/* One group per row (per-channel weights): the int8_tile of the AVX-512 section in 8 lanes, one
   accumulator over k in order (the last partial vector zero-padded), times the row's scale, one
   fixed horizontal sum (lowbit_hsum8). */
INLINE void channel_tile8(const int NB, const int MB, const Weight8 *w, int64_t n0, const float *x, int64_t ldx, float *out) {
    const int8_t *q = w->q + n0 * w->ldw;
    const int64_t ldw = w->ldw, K = w->K;
    __m256 acc[NT][MT];
    for (int nb = 0; nb < NB; nb++)
        for (int m = 0; m < MB; m++) acc[nb][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[MT];
        for (int m = 0; m < MB; m++) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
        for (int nb = 0; nb < NB; nb++) {
            if ((k & 63) == 0) _mm_prefetch((const char *)(q + (PREFETCH_TILES * NB + nb) * ldw + k), _MM_HINT_T1);
            const __m256 wv = codes8(q + nb * ldw + k);
            for (int m = 0; m < MB; m++) acc[nb][m] = _mm256_fmadd_ps(wv, xv[m], acc[nb][m]);
        }
    }
    if (k < K) { /* zero-padded copies of the last partial vector */
        const int64_t n = K - k;
        __m256 xv[MT];
        for (int m = 0; m < MB; m++) {
            float pad[8] = {0};
            for (int64_t i = 0; i < n; i++) pad[i] = x[m * ldx + k + i];
            xv[m] = _mm256_loadu_ps(pad);
        }
        for (int nb = 0; nb < NB; nb++) {
            int8_t pad[8] = {0};
            for (int64_t i = 0; i < n; i++) pad[i] = q[nb * ldw + k + i];
            const __m256 wv = codes8(pad);
            for (int m = 0; m < MB; m++) acc[nb][m] = _mm256_fmadd_ps(wv, xv[m], acc[nb][m]);
        }
    }
    for (int nb = 0; nb < NB; nb++)
        for (int m = 0; m < MB; m++) out[m * NB + nb] = lowbit_hsum8(_mm256_mul_ps(acc[nb][m], _mm256_set1_ps(w->s[n0 + nb])));
}

/* One group's accumulator (one x row): over k in order, the last partial vector zero-padded. */
INLINE __m256 group_acc8(const int8_t *q, const float *x, int64_t k, int64_t k1) {
    __m256 acc = _mm256_setzero_ps();
    for (; k + 8 <= k1; k += 8) acc = _mm256_fmadd_ps(codes8(q + k), _mm256_loadu_ps(x + k), acc);
    if (k < k1) {
        float xp[8] = {0};
        int8_t qp[8] = {0};
        for (int64_t i = 0; i < k1 - k; i++) xp[i] = x[k + i], qp[i] = q[k + i];
        acc = _mm256_fmadd_ps(codes8(qp), _mm256_loadu_ps(xp), acc);
    }
    return acc;
}

/* Grouped weights at one x row, row by row: each group's accumulator over k in order, then
   tot = acc * s + tot in group order, one horizontal sum (the numbers of the tiled loop this
   replaced, which read a tile's four rows side by side); each weight row is read front to back on
   its own, four groups side by side (four independent FMA chains), with the row PREFETCH_ROWS on pulled into L1 - the order that took SmolLM2's bf16
   head from 3.2 to 2.65 ms in f32_dot.c. int8-g32 on 2 Zen 3 cores: see docs/kernels.md. */
#define PREFETCH_ROWS 4
static void grouped_rows8(const Weight8 *w, int64_t n0, int nb, const float *x, float *out) {
    const int64_t K = w->K, G = w->G, group = w->group, ldw = w->ldw;
    for (int i = 0; i < nb; i++) {
        const int8_t *q = w->q + (n0 + i) * ldw, *ahead = q + PREFETCH_ROWS * ldw;
        const float *s = w->s + (n0 + i) * G;
        __m256 tot = _mm256_setzero_ps();
        int64_t j = 0;
        if (group % 8 == 0)
            for (; j + 4 <= G && (j + 4) * group <= K; j += 4) { /* four whole groups */
                const int64_t k0 = j * group;
                for (int64_t b = 0; b < 4 * group; b += 64) _mm_prefetch((const char *)(ahead + k0 + b), _MM_HINT_T0);
                __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t k = 0; k < group; k += 8)
                    for (int g = 0; g < 4; g++)
                        acc[g] = _mm256_fmadd_ps(codes8(q + k0 + g * group + k), _mm256_loadu_ps(x + k0 + g * group + k), acc[g]);
                for (int g = 0; g < 4; g++) tot = _mm256_fmadd_ps(acc[g], _mm256_set1_ps(s[j + g]), tot);
            }
        for (; j < G; j++) { /* the rest, one group at a time (the same arithmetic) */
            const int64_t k0 = j * group, k1 = k0 + group < K ? k0 + group : K;
            tot = _mm256_fmadd_ps(group_acc8(q, x, k0, k1), _mm256_set1_ps(s[j]), tot);
        }
        out[i] = lowbit_hsum8(tot);
    }
}

/* Grouped weights at MB x rows (2-4: a speculative verify, several sequences' decode step): each
   weight vector widened once for all MB rows, two groups side by side (8 accumulators + 4 totals
   + 1 weight + 1 x at MB = 4). Per (row, x row) the arithmetic of grouped_rows8: each group's
   accumulator over k in order, tot = acc * s + tot in group order, one horizontal sum, so every
   row's bits are its one-row call's. At 16 rows the one-row-at-a-time loop widened every code 16
   times: 116 ms for SmolLM2's 30 layers of int8-g32 on 2 Zen 2 cores. */
INLINE void grouped_rows8_mb(const int MB, const Weight8 *w, int64_t n0, int nb, const float *x, int64_t ldx, float *out) {
    const int64_t K = w->K, G = w->G, group = w->group, ldw = w->ldw;
    for (int i = 0; i < nb; i++) {
        const int8_t *q = w->q + (n0 + i) * ldw;
        const float *s = w->s + (n0 + i) * G;
        __m256 tot[MT_GROUP];
        for (int m = 0; m < MB; m++) tot[m] = _mm256_setzero_ps();
        int64_t j = 0;
        if (group % 8 == 0)
            for (; j + 2 <= G && (j + 2) * group <= K; j += 2) { /* two whole groups */
                const int64_t k0 = j * group;
                __m256 acc[2][MT_GROUP];
                for (int m = 0; m < MB; m++) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
                for (int64_t k = 0; k < group; k += 8)
                    for (int g = 0; g < 2; g++) {
                        const __m256 wv = codes8(q + k0 + g * group + k);
                        for (int m = 0; m < MB; m++)
                            acc[g][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k0 + g * group + k), acc[g][m]);
                    }
                for (int g = 0; g < 2; g++) {
                    const __m256 sv = _mm256_set1_ps(s[j + g]);
                    for (int m = 0; m < MB; m++) tot[m] = _mm256_fmadd_ps(acc[g][m], sv, tot[m]);
                }
            }
        for (; j < G; j++) { /* the rest, one group at a time (the same arithmetic) */
            const int64_t k0 = j * group, k1 = k0 + group < K ? k0 + group : K;
            for (int m = 0; m < MB; m++) tot[m] = _mm256_fmadd_ps(group_acc8(q, x + m * ldx, k0, k1), _mm256_set1_ps(s[j]), tot[m]);
        }
        for (int m = 0; m < MB; m++) out[m * nb + i] = lowbit_hsum8(tot[m]);
    }
}

static void grouped_pass8(const Weight8 *w, int64_t n0, int nb, int mb, const float *x, int64_t ldx, float *out) {
    switch (mb) {
    case 1: grouped_rows8(w, n0, nb, x, out); break; /* one row: the streaming-tuned loop */
    case 2: grouped_rows8_mb(2, w, n0, nb, x, ldx, out); break;
    case 3: grouped_rows8_mb(3, w, n0, nb, x, ldx, out); break;
    default: grouped_rows8_mb(4, w, n0, nb, x, ldx, out); break;
    }
}

typedef void (*pass_fn)(const Weight8 *, int64_t, int, const float *, int64_t, float *);
#define PASS(NAME, ONE, NB)                                                                          \
    static void NAME(const Weight8 *w, int64_t n0, int mb, const float *x, int64_t ldx, float *out) { \
        if (!ONE) grouped_pass8(w, n0, NB, mb, x, ldx, out);                                         \
        else if (mb >= 2) channel_tile8(NB, 2, w, n0, x, ldx, out);                                  \
        else channel_tile8(NB, 1, w, n0, x, ldx, out);                                              \
    }
PASS(pass_one_tile, 1, NT) PASS(pass_one_row, 1, 1) PASS(pass_grp_tile, 0, NT) PASS(pass_grp_row, 0, 1)
#endif

#if HAVE_INT8F || HAVE_INT8F_AVX2

/* Tiles ta..tb-1 against all M rows of x, MC rows of x at a time. */
static void run_tiles(const Weight8 *w, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, int64_t ta, int64_t tb) {
    const int one = w->G == 1;
    const int64_t nt = NT, mt = one ? MT : MT_GROUP;
    const pass_fn tile = one ? pass_one_tile : pass_grp_tile, row1 = one ? pass_one_row : pass_grp_row;
    float out[NT * MT_MAX], row[MT_MAX];
    for (int64_t mc = 0; mc < M; mc += MC) {
        const int64_t me = mc + MC < M ? mc + MC : M;
        for (int64_t t = ta; t < tb; t++) {
            const int64_t n0 = t * nt;
            const int nb = w->N - n0 >= nt ? (int)nt : (int)(w->N - n0);
            for (int64_t m0 = mc; m0 < me; m0 += mt) {
                const int mb = me - m0 >= mt ? (int)mt : (int)(me - m0);
                const float *xm = x + m0 * ldx;
                if (nb == nt) {
                    tile(w, n0, mb, xm, ldx, out);
                } else { /* the ragged last tile, one weight row at a time (the same per-row arithmetic) */
                    for (int i = 0; i < nb; i++) {
                        row1(w, n0 + i, mb, xm, ldx, row);
                        for (int m = 0; m < mb; m++) out[m * nt + i] = row[m];
                    }
                }
                for (int m = 0; m < mb; m++)
                    for (int i = 0; i < nb; i++) y[(m0 + m) * ldy + n0 + i] = out[m * nt + i];
            }
        }
    }
}
#endif

/* Returns 0; -1 when the build has neither AVX-512 nor AVX2; -2 for a group that is not a multiple of 16
   (unless G = 1) or groups that do not cover K. */
int lowbit_int8f_matmul(const int8_t *q, int64_t N, int64_t K, int64_t ldw, const float *s, int64_t G, int64_t group,
                        const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, int threads) {
#if !HAVE_INT8F && !HAVE_INT8F_AVX2
    (void)q; (void)N; (void)K; (void)ldw; (void)s; (void)G; (void)group; (void)x; (void)ldx; (void)M; (void)y; (void)ldy;
    (void)threads;
    return -1;
#else
    if (G < 1 || (G > 1 && (group % 16 != 0 || (G - 1) * group >= K || G * group < K))) return -2;
    const Weight8 w = {q, s, N, K, ldw, G, G == 1 ? K : group};
    const int64_t tiles = (N + NT - 1) / NT;
    threads = lowbit_team(threads);
    int64_t ta, tb;
    if (lowbit_part_share(tiles, &ta, &tb)) { /* a part call (lowbit_native.h): its share, here */
        run_tiles(&w, x, ldx, M, y, ldy, ta, tb);
        return 0;
    }
    if (threads <= 1 || tiles < 2) {
        run_tiles(&w, x, ldx, M, y, ldy, 0, tiles);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        lowbit_thread_share(tiles, &lo, &hi);
        run_tiles(&w, x, ldx, M, y, ldy, lo, hi);
    }
    return 0;
#endif
}

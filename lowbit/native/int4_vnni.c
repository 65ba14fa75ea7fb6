/* CPU matmul for integer 4-bit (or 8-bit) codes against int8 activations through AVX512-VNNI
   `vpdpbusd` (64 byte products per instruction, twice the multiply-adds of int4_dot.c's
   `vdpbf16ps`), or AVX2 on CPUs without AVX-512 (4-bit codes, the same bits; section below):

   y[m, n] = sum_j s[n, j] * sx[m, j] * (sum_{k in group j} c[n, k] * a[m, k] - z[n, j] * asum[m, j])

   c is the unsigned code 0..15 (0..255) and z the code of zero: the table offset (8 for
   symmetric int4, whose values are c - 8; 128 for int8) plus the group's zero point when the
   format has one. Each row of x is
   quantized per weight group: sx = max|x| / 127, a = round_half_even(x * (127 / max|x|)) in
   -127..127, asum = sum of a. The integer sums are exact (|c * a| <= 1905 for 4-bit codes, so a
   group fits int32 for any K below a million; 32385 for 8-bit, K below 66k), so the only
   rounding after x's own quantization is the group total's conversion to float32 (exact below
   2^24: any 4-bit group, 8-bit groups up to ~1000 k), the float32 product of the two scales and
   the running float32 sum over groups.

   Batch invariance (speculative verification stays exact): a row's quantization reads only that
   row, its integer sums are exact whatever the order, and the groups are folded in order with one
   FMA each, so a row's output is bit-identical whatever M is and however rows are grouped.

   Layout (kernels/cpu_int4dot.py `tile_codes_vnni`): as in int4_dot.c the 16 lanes of a vector
   are 16 OUTPUT rows. A chunk is 8 k; per tile and chunk, 64 bytes: byte 4i+b holds row i's code
   k+b in the low nibble and k+4+b in the high one, so an AND gives lanes of four codes (k..k+3)
   and a shift and an AND the next four - each a `vpdpbusd` operand against four bytes of x
   broadcast to every lane. Four tiles are interleaved chunk by chunk ([N / 64, chunks, 4, 64]).
   Scales are [tiles, G, 16] and zero codes (when per group) [tiles, G, 16] int32. 8-bit codes:
   128 bytes per tile and chunk, the lanes' bytes k..k+3 then k+4..k+7 (two plain loads). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lowbit_native.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_I4VNNI 1
#else
#define HAVE_I4VNNI 0
#endif
/* Without AVX-512 (Zen 2/3, most laptops): the same layout and numbers through AVX2, 4-bit codes
   only (see the AVX2 section below). */
#if !HAVE_I4VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_I4AVX2 1
#else
#define HAVE_I4AVX2 0
#endif

typedef struct {
    const uint8_t *codes;  /* [ceil(tiles / 4), chunks, 4, 64] */
    int64_t tile_bytes;    /* chunks * 64 */
    const float *scales;   /* [tiles, G, 16] */
    const int32_t *zeros;  /* [tiles, G, 16] code of zero per group, or NULL: `offset` everywhere */
    int64_t N, K, chunks, G;
    int32_t cpg;           /* 8-k chunks per group */
    int32_t offset;        /* code of zero when `zeros` is NULL (8 for symmetric int4) */
    int32_t bits;          /* 4 or 8 */
    /* The scales as float16, [tiles, G, 16], when every one is exactly a float16 (Q4_0's own
       scale type: lowbit's RTN and GPTQ scales are), else NULL; `scales` is then NULL. Both
       sections read them (the same values, converted exactly by vcvtph2ps): a group-32 weight's
       bytes fall by a tenth, 4.5 instead of 5 bits a weight. */
    const uint16_t *scales16;
    /* x's groups per weight scale group (scales and zeros have G / gps columns): 1, or more where the
       weight has coarser scales than x is quantized in (a per-channel weight: x rounded per 32, as
       Q8_0 rounds it, not by one scale over the whole row). The integer sums stay per x group. */
    int32_t gps;
} I4VWeight;

/* 1: 4- and 8-bit codes (AVX512-VNNI); 2: 4-bit codes only (AVX2); 0: neither. */
int lowbit_i4v_available(void) { return HAVE_I4VNNI ? 1 : HAVE_I4AVX2 ? 2 : 0; }

#if HAVE_I4VNNI
#define ROWS 16
/* x rows per pass: 8. Two tiles side by side at 8 rows had taken 0.92-0.97x the time of 16 rows
   at one tile (16-256 rows, groups of 32 and 64, 2 Zen 5 cores, SmolLM2's layers); both kept 32
   registers of sums and totals, and GCC spilled sums inside the chunk loop. The lean pass shapes
   (lowbit_tile_runs: one tile at 6-8 rows, two at 4-5) keep at most 10 sums and 10 totals: 17-30 % faster at 8-64
   rows on 2 Zen 4 cores, each x dword broadcast (a load) for one tile only. */
#define MAXMB 8
/* 4-bit codes at 8 rows or more: passes of 4 rows over two tiles, not 8 over one. Each x dword
   broadcast then serves two tiles (half the broadcasts a `vpdpbusd`) for twice the unpacking of
   each tile's codes, which costs less: SmolLM2's four int4 matrices of a layer from cache (C
   harness, 2 Zen 4 threads, the engine's part calls, minimum of 2000 repetitions) at 16 rows g32
   0.190 -> 0.181 ms and 0.212 -> 0.186, g64 0.171 -> 0.161 and 0.195 -> 0.168, 8 rows 0.098 ->
   0.092, 32 and 64 rows 5 % faster; passes of 2 or 3 rows were slower than 4. In the engine (16
   sequences, median step of each run, alternated with 8-row passes three times): int4-g32 11.3-13.4
   against 13.9-14.1 ms, g64 10.6-12.2 against 13.6-13.9; 8 sequences 6.9-7.6 against 7.9-8.1 and
   6.4-6.9 against 7.7-7.9; an earlier run, int4-g32 at 16: 11.0-11.2 against 11.4-11.7. At 5-7 rows one pass of them all stays (4 + 1 rows took 1.1x
   the time at 5, a speculative verify), and 8-bit codes keep 8 (one engine run: 1.07x the time).
   Measured on Zen 4 only (double-pumped 512-bit units); on a CPU whose broadcast is a plain load
   the balance may differ: bench/int4_pass_shapes.py measures both shapes there (PASS_ROWS4). */
#ifndef PASS_ROWS4
#define PASS_ROWS4 4
#endif
#define TILE_CHUNK(BITS) ((BITS) * 16)    /* bytes of one tile's chunk of 8 k */
#define STRIDE(BITS) (4 * TILE_CHUNK(BITS)) /* from one chunk of a tile to its next: four tiles interleaved */
/* 4-bit codes: how far ahead of a pass's stream to prefetch (PREFETCH_HINT: into L1), 0 for none:
   the hardware prefetchers alone, which follow the one contiguous stream of a group of four tiles across the
   2 MB pages the engine places weights on (kernels/hugepages.py). On 2 Zen 4 cores, one row, 48
   matrices of the synthetic MoE's expert shapes (117 MB, int4 g32, huge pages, C calls): none
   30 GB/s on one core against 20-21 at 4096 and 22-23 at 16384 into L2 (streaming read 34), 41.5
   against 34-38 GB/s on two; g64 3-10 % faster; at 16 rows (compute-bound) within 4 %. In the
   engine the MoE's layers took 4.2-4.3 against 5.7-5.8 ms a token, SmolLM2's 2.31 against 2.65.
   (On 2 Zen 5 cores 4096 had beaten 1024 by 3-10 %; none was not tried there.) */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 0
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
/* Beyond two rows a pass covers fewer than the four interleaved tiles of a group, so it reads one
   line in four (4-bit codes; two in eight for 8-bit) of the group's stream, the next tiles' passes the
   others: a pattern the hardware prefetchers follow poorly from memory, and the passes stalled on it.
   So each pass of a row block's first rows prefetches its own tiles' lines of the NEXT group into L2,
   spreading the next group's read over the current group's passes (the later rows' passes find them
   in cache). SmolLM2's 30 layers' matmuls (2 Zen 4 cores, C calls, alternated builds): int4-g32 at 5
   rows 4.3 -> 3.2-3.3 ms, at 16 rows 9.2 -> 7.5-7.8; int8-g32 at 5 rows 5.9-6.2 -> 5.1-5.3, at 16 rows
   9.9-10.4 -> 8.8-9.3. (Prefetching the current group's four lines ahead in the first pass alone, the
   whole group's read in an eighth of the time at 16 rows, had got int4 to 7.1-8.3 ms at 16 rows and did
   not add to this.) Those weights were not on huge pages (bench/int4_pass_shapes.c); measured again on
   them (2026-12-06, two alternations): at 16 rows int4 7.1-7.2 -> 6.0-6.1 ms, int8 8.9 -> 6.9; at 5
   rows int4 3.1-3.9 -> 2.0-3.4, int8 5.0-7.2 -> 3.8-4.8. */
#ifndef NEXT_GROUP
#define NEXT_GROUP 1
#endif
/* 8-bit codes (two lines a tile and chunk, twice the bytes per instruction) do gain from a
   prefetch into L2 2 KB ahead: SmolLM2 int8 decode layers (the engine's C chain, alternated
   engines in one process, 2 Zen 4 cores) 2.79-2.80 against 2.92 ms at one row and 3.41-3.54
   against 3.88 at a slower moment; 12.6 against 13.0 ms at 16 rows; into L1 it took 4.0 ms. */
#ifndef PREFETCH8_BYTES
#define PREFETCH8_BYTES 2048
#endif
#ifndef PREFETCH8_HINT
#define PREFETCH8_HINT _MM_HINT_T1
#endif

/* Tiles t0..t0+TT-1 (within one group of four) against x rows m0..m0+MB-1 into
   tot[(t * MB + m) * 16 + lane]. xq: x as int8 interleaved by chunk, xq[(c * M + m) * 8 + i] =
   a[m, 8c + i]; xs / xa: [M, G] scales and integer sums (without per-group zero codes, the sums
   times -offset: see vshare). */
INLINE void vtiles(const int BITS, const int TT, const int MB, const I4VWeight *w, int64_t t0, const int8_t *xq, int64_t M,
                   const float *xs, const int32_t *xa, int64_t m0, float *tot, int ahead) {
    const __m512i low = _mm512_set1_epi8(15);
    const int64_t G = w->G, C = w->chunks;
    const uint8_t *base = w->codes + (t0 / 4) * 4 * w->tile_bytes + (t0 % 4) * TILE_CHUNK(BITS);
    /* the running totals in registers where they fit (the compiler spills the rest, as the stores
       to tot once did every group) */
    __m512 tv[4][MAXMB];
    for (int t = 0; t < TT; t++)
        for (int m = 0; m < MB; m++) tv[t][m] = _mm512_setzero_ps();
    int64_t c = 0;
    for (int64_t j = 0; j < G; j++) {
        const int64_t c_end = j == G - 1 ? C : (j + 1) * w->cpg;
        __m512i acc[4][MAXMB];
        /* Without per-group zero codes each sum starts at -offset * asum, so it ends as the exact
           integer sum_k (c - offset) * a with no subtraction per group (the same integer) */
        for (int m = 0; m < MB; m++) {
            const __m512i start = w->zeros ? _mm512_setzero_si512() : _mm512_set1_epi32(xa[(m0 + m) * G + j]);
            for (int t = 0; t < TT; t++) acc[t][m] = start;
        }
        for (; c < c_end; c++) {
            __m512i wl[4], wh[4];
            if (NEXT_GROUP && ahead)
                for (int t = 0; t < TT; t++)
                    for (int l = 0; l < BITS / 4; l++)
                        _mm_prefetch((const char *)(base + 4 * w->tile_bytes + c * STRIDE(BITS) + t * TILE_CHUNK(BITS) + 64 * l),
                                     _MM_HINT_T1);
            for (int t = 0; t < TT; t++) {
                const uint8_t *p = base + c * STRIDE(BITS) + t * TILE_CHUNK(BITS);
                if (BITS == 4) {
                    if (PREFETCH_BYTES) _mm_prefetch((const char *)(p + PREFETCH_BYTES), PREFETCH_HINT);
                    const __m512i raw = _mm512_loadu_si512((const void *)p);
                    wl[t] = _mm512_and_si512(raw, low);
                    wh[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                } else {
                    if (PREFETCH8_BYTES) {
                        _mm_prefetch((const char *)(p + PREFETCH8_BYTES), PREFETCH8_HINT);
                        _mm_prefetch((const char *)(p + PREFETCH8_BYTES + 64), PREFETCH8_HINT);
                    }
                    wl[t] = _mm512_loadu_si512((const void *)p);
                    wh[t] = _mm512_loadu_si512((const void *)(p + 64));
                }
            }
            const int8_t *xc = xq + (c * M + m0) * 8;
            /* x dwords broadcast from registers: vpdpbusd with an embedded {1to16} broadcast ran
               at two thirds the speed on Zen 4 (unlike vdpbf16ps in int4_dot.c) */
            for (int m = 0; m < MB; m++) {
                int32_t p0, p1;
                memcpy(&p0, xc + m * 8, 4);
                memcpy(&p1, xc + m * 8 + 4, 4);
                const __m512i xl = _mm512_set1_epi32(p0), xh = _mm512_set1_epi32(p1);
                for (int t = 0; t < TT; t++) {
                    acc[t][m] = _mm512_dpbusd_epi32(acc[t][m], wl[t], xl);
                    acc[t][m] = _mm512_dpbusd_epi32(acc[t][m], wh[t], xh);
                }
            }
        }
        for (int t = 0; t < TT; t++) {
            const int64_t at = ((t0 + t) * (G / w->gps) + j / w->gps) * ROWS;
            /* float16 scales where exact (the same values, a tenth fewer bytes at group 32) */
            const __m512 s = w->scales16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales16 + at)))
                                         : _mm512_loadu_ps(w->scales + at);
            const __m512i z = w->zeros ? _mm512_loadu_si512((const void *)(w->zeros + at)) : _mm512_setzero_si512();
            for (int m = 0; m < MB; m++) {
                const int64_t mj = (m0 + m) * G + j;
                const __m512i exact = w->zeros ? _mm512_sub_epi32(acc[t][m], _mm512_mullo_epi32(z, _mm512_set1_epi32(xa[mj])))
                                               : acc[t][m];
                tv[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(s, _mm512_set1_ps(xs[mj])), tv[t][m]);
            }
        }
    }
    for (int t = 0; t < TT; t++)
        for (int m = 0; m < MB; m++) _mm512_storeu_ps(tot + (t * MB + m) * 16, tv[t][m]);
}

#define MB_CASE(TT, MB) \
    case MB: { \
        if (w->bits == 8) vtiles(8, TT, MB, w, t0, xq, M, xs, xa, m0, tot, ahead); \
        else vtiles(4, TT, MB, w, t0, xq, M, xs, xa, m0, tot, ahead); \
    } break;
static void vpass(int tt, int mb, const I4VWeight *w, int64_t t0, const int8_t *xq, int64_t M, const float *xs,
                  const int32_t *xa, int64_t m0, float *tot, int ahead) {
    LOWBIT_TILE_PASSES_8(tt, mb, MB_CASE); /* passes of MAXMB = 8 rows */
}
#undef MB_CASE

/* The 16 reductions of a[0..15] (max, or int32 sum in float32 bits; lowbit_reduce16's tree), lane j
   holding a[j]'s. Either operation is exact in any order, so the values are a vector's own reduction's. */
INLINE __m512 vreduce16(const int ADD, const __m512 *a) {
    /* lane 4k + p holds a[4p + k]: transpose the 4 x 4 */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), lowbit_reduce16(ADD ? 2 : 1, a));
}

/* Group j's 16-value vectors of a row: [j * vpg, (j + 1) * vpg), the last group to the row's end
   (kp / 16). NV: vpg when constant (groups of 32, 64, 128), 0 for any. */
#define GROUP_VECTORS(NV, j) \
    const int64_t v0 = (j) * vpg, v1 = (j) == G - 1 ? kp / 16 : v0 + ((NV) ? (NV) : vpg)

/* Row m of x quantized group by group into row (int8, K padded with zeros to kp), with each
   group's scale and integer sum times `mult` (see vshare). A group whose max is not finite gets a NaN
   scale, so the row's outputs are NaN rather than finite garbage. Sixteen groups at a time: their
   maxima, then their scales and sums, each reduced together (vreduce16), where a group's own two
   reductions and loops of unknown length had made x cost ~3 of a thread's ~4.6 us in a 16-row,
   K = 576 call of one tile. float32 x with K = kp is read in place. NV: see GROUP_VECTORS. */
INLINE void quantize_row_nv(const int NV, const I4VWeight *w, const float *p, int64_t m, int64_t kp, int8_t *row, float *xs,
                            int32_t *xa, int32_t mult) {
    const int64_t G = w->G, vpg = w->cpg / 2;
    for (int64_t j0 = 0; j0 < G; j0 += 16) {
        const int n = G - j0 < 16 ? (int)(G - j0) : 16;
        __m512 mx[16], sums[16];
        __mmask16 nan = 0; /* max_ps drops NaN, so look for it separately */
        for (int i = 0; i < 16; i++) {
            mx[i] = sums[i] = _mm512_setzero_ps();
            if (i >= n) continue;
            GROUP_VECTORS(NV, j0 + i);
            __mmask16 un = 0;
            for (int64_t v = v0; v < v1; v++) {
                const __m512 x = _mm512_loadu_ps(p + 16 * v);
                un |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
                mx[i] = _mm512_max_ps(mx[i], _mm512_abs_ps(x));
            }
            if (un) nan |= (__mmask16)(1u << i);
        }
        const __m512 amax = _mm512_mask_mov_ps(vreduce16(0, mx), nan, _mm512_set1_ps(NAN));
        /* the groups with a positive, finite max; the others (all zeros, or a NaN or an infinity)
           get zero codes and the scale 0 (all zeros) or NaN */
        const __mmask16 good = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ)
                               & _mm512_cmp_ps_mask(amax, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
        float invs[16];
        _mm512_storeu_ps(invs, _mm512_div_ps(_mm512_set1_ps(127.0f), amax));
        for (int i = 0; i < n; i++) {
            GROUP_VECTORS(NV, j0 + i);
            if (!(good >> i & 1)) {
                memset(row + 16 * v0, 0, (size_t)(16 * (v1 - v0)));
                continue;
            }
            const __m512 s = _mm512_set1_ps(invs[i]);
            __m512i sum = _mm512_setzero_si512();
            for (int64_t v = v0; v < v1; v++) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p + 16 * v), s)); /* round half to even */
                sum = _mm512_add_epi32(sum, q);
                _mm_storeu_si128((__m128i *)(row + 16 * v), _mm512_cvtsepi32_epi8(q));
            }
            sums[i] = _mm512_castsi512_ps(sum);
        }
        const __mmask16 zero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_EQ_OQ);
        const __m512 scale = _mm512_maskz_mov_ps(~zero, _mm512_mask_div_ps(_mm512_set1_ps(NAN), good, amax, _mm512_set1_ps(127.0f)));
        const __m512i total = _mm512_maskz_mullo_epi32(good, _mm512_castps_si512(vreduce16(1, sums)), _mm512_set1_epi32(mult));
        const __mmask16 lanes = (__mmask16)((1u << n) - 1u);
        _mm512_mask_storeu_ps(xs + m * G + j0, lanes, scale);
        _mm512_mask_storeu_epi32(xa + m * G + j0, lanes, total);
    }
}

/* quantize_row_nv for row m of x (float32 or bf16, ldx_in apart); f: a row's float32 scratch [kp]. */
static void quantize_row(const I4VWeight *w, const void *x, int x_bf16, int64_t ldx_in, int64_t m, int64_t kp, float *f,
                         int8_t *row, float *xs, int32_t *xa, int32_t mult) {
    const int64_t K = w->K;
    const float *p = f;
    if (x_bf16) {
        const uint16_t *src = (const uint16_t *)x + m * ldx_in;
        for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 mask = lowbit_lanes(K - k);
            _mm512_mask_storeu_ps(f + k, mask, lowbit_bf16_widen16(_mm256_maskz_loadu_epi16(mask, src + k)));
        }
    } else if (K == kp) {
        p = (const float *)x + m * ldx_in;
    } else {
        memcpy(f, (const float *)x + m * ldx_in, (size_t)K * sizeof(float));
    }
    if (p == f)
        for (int64_t k = K; k < kp; k++) f[k] = 0.0f;
    switch (w->cpg) {
    case 4: quantize_row_nv(2, w, p, m, kp, row, xs, xa, mult); break;
    case 8: quantize_row_nv(4, w, p, m, kp, row, xs, xa, mult); break;
    case 16: quantize_row_nv(8, w, p, m, kp, row, xs, xa, mult); break;
    default: quantize_row_nv(0, w, p, m, kp, row, xs, xa, mult); break;
    }
}

static inline void vstore_tile(const float *v, void *y, int y_bf16, int64_t ldy, int64_t m, int64_t t, int64_t N) {
    const int64_t n0 = t * ROWS;
    const __mmask16 mask = lowbit_lanes(N - n0);
    const __m512 r = _mm512_loadu_ps(v);
    if (y_bf16) { /* round to nearest even, NaN kept NaN (no AVX512-BF16 needed) */
        _mm256_mask_storeu_epi16((uint16_t *)y + m * ldy + n0, mask, _mm512_cvtepi32_epi16(lowbit_bf16_bits16(r)));
    } else {
        _mm512_mask_storeu_ps((float *)y + m * ldy + n0, mask, r);
    }
}

/* Tile t's logits v of row m screened (LowbitScreen, lowbit_native.h) for part p: its lower bound
   raised, its tile_up set, the tile recorded where an entry's upper bound reaches the parts' best
   lower bound - tiny. The parts' lo are read and written relaxed: any value read is a lower bound. */
static void vscreen_tile(const LowbitScreen *s, int p, const float *v, int64_t m, int64_t t, int64_t N) {
    const int64_t n0 = t * ROWS, pm = p * s->M + m, tiles = (N + ROWS - 1) / ROWS;
    const __mmask16 live = lowbit_lanes(N - n0);
    const __m512 a = _mm512_loadu_ps(v);
    const __m512 b = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_set1_ps(s->x2f[m]), _mm512_maskz_loadu_ps(live, s->err2 + n0),
                                                   _mm512_mul_ps(_mm512_set1_ps(s->cf[m]), _mm512_maskz_loadu_ps(live, s->norm2 + n0))),
                                   _mm512_set1_ps(1.0f + 0x1p-16f));
    const __m512 slack = _mm512_mul_ps(_mm512_add_ps(_mm512_abs_ps(a), b), _mm512_set1_ps(0x1p-20f));
    /* not finite: NaN compares unordered, inf has |a| = inf */
    if (_mm512_mask_cmp_ps_mask(live, _mm512_abs_ps(a), _mm512_set1_ps(INFINITY), _CMP_NLT_UQ)) {
        s->fail[p] = 1;
        return;
    }
    const float low = _mm512_mask_reduce_max_ps(live, _mm512_sub_ps(_mm512_sub_ps(a, b), slack));
    float own;
    __atomic_load(&s->lo[pm], &own, __ATOMIC_RELAXED);
    if (low > own) __atomic_store(&s->lo[pm], &low, __ATOMIC_RELAXED), own = low;
    float bound = own;
    for (int q = 0; q < s->parts; q++) {
        float o;
        __atomic_load(&s->lo[q * s->M + m], &o, __ATOMIC_RELAXED);
        bound = o > bound ? o : bound;
    }
    const __m512 up = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_add_ps(_mm512_add_ps(a, b), slack));
    const float top = _mm512_reduce_max_ps(up);
    s->tile_up[m * tiles + t] = top;
    if (!(top >= bound - s->tiny[m]) || s->over[pm]) return;
    if (s->count[pm] == s->cap) {
        s->over[pm] = 1;
        return;
    }
    const int64_t i = pm * s->cap + s->count[pm]++;
    s->tiles[i] = (int32_t)t;
    _mm512_storeu_ps(s->upper + i * 16, up);
}

/* xq: x as int8 by chunk; xs, xa: the groups' scales and integer sums. */
static void vrun_tiles(LowbitTileCall *c, int tt, int mb, int64_t t, int64_t m0) {
    const I4VWeight *w = c->w;
    /* a pass of a row block's first rows, narrower than a group: prefetches the next group (NEXT_GROUP) */
    const int ahead = tt < 4 && m0 % LOWBIT_ROW_BLOCK == 0;
    vpass(tt, mb, w, t, c->xq, c->M, c->xs, c->xa, m0, c->tot, ahead);
    for (int i = 0; i < tt; i++)
        for (int m = 0; m < mb; m++) {
            const float *v = c->tot + (i * mb + m) * 16;
            if (c->screen) vscreen_tile(c->screen, c->part, v, m0 + m, t + i, w->N);
            else vstore_tile(v, c->y, c->y_bf16, c->ldy, m0 + m, t + i, w->N);
        }
}
#endif


#if HAVE_I4AVX2
/* AVX2: a 256-bit register holds 8 lanes, so each 64-byte tile chunk is two halves (rows 0-7,
   rows 8-15), read one after the other from the same cache line. `vpdpbusd` becomes
   `vpmaddubsw` (code x activation, adjacent pairs summed into int16) then `vpmaddwd` by ones
   (pairs of those into int32). The int16 sums stay exact: a pair is at most 2 * 15 * 127 = 3810,
   a chunk adds two pairs per lane, so four chunks (30480) fit below 2^15 before they are widened.
   The group totals are the same integers as the AVX-512 kernel's and the float steps are the
   same operations in the same order, so both ISAs give bit-identical outputs. */
#define ROWS 16
#define HALF 8
#define MAXMB2 4        /* x rows per pass: beyond this the accumulators spill out of 16 registers */
#define CHUNKS16 4      /* chunks summed in int16 before widening (see above) */
#ifndef TT1
#define TT1 4 /* tiles side by side at one x row: 4 measured 5-15 % faster than 2 on SmolLM2's shapes */
#endif

INLINE void vtiles2(const int TT, const int MB, const I4VWeight *w, int64_t t0, const int8_t *xq, int64_t M,
                    const float *xs, const int32_t *xa, int64_t m0, float *tot) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const int64_t G = w->G, C = w->chunks;
    const uint8_t *base = w->codes + (t0 / 4) * 4 * w->tile_bytes + (t0 % 4) * 64;
    for (int i = 0; i < TT * MB * ROWS; i++) tot[i] = 0.0f;
    int64_t c = 0;
    for (int64_t j = 0; j < G; j++) {
        const int64_t c_end = j == G - 1 ? C : (j + 1) * w->cpg;
        __m256i acc[4][MAXMB2][2];
        for (int t = 0; t < TT; t++)
            for (int m = 0; m < MB; m++) acc[t][m][0] = acc[t][m][1] = _mm256_setzero_si256();
        while (c < c_end) {
            const int64_t c_stop = c + CHUNKS16 < c_end ? c + CHUNKS16 : c_end;
            __m256i s16[4][MAXMB2][2];
            for (int t = 0; t < TT; t++)
                for (int m = 0; m < MB; m++) s16[t][m][0] = s16[t][m][1] = _mm256_setzero_si256();
            for (; c < c_stop; c++) {
                const int8_t *xc = xq + (c * M + m0) * 8;
                __m256i xl[MAXMB2], xh[MAXMB2];
                for (int m = 0; m < MB; m++) {
                    int32_t p0, p1;
                    memcpy(&p0, xc + m * 8, 4);
                    memcpy(&p1, xc + m * 8 + 4, 4);
                    xl[m] = _mm256_set1_epi32(p0);
                    xh[m] = _mm256_set1_epi32(p1);
                }
                for (int t = 0; t < TT; t++) {
                    const uint8_t *p = base + c * 256 + t * 64;
                    _mm_prefetch((const char *)(p + 1024), _MM_HINT_T0);
                    for (int h = 0; h < 2; h++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 32 * h));
                        const __m256i wl = _mm256_and_si256(raw, low);
                        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                        for (int m = 0; m < MB; m++)
                            s16[t][m][h] = _mm256_add_epi16(s16[t][m][h], _mm256_add_epi16(_mm256_maddubs_epi16(wl, xl[m]),
                                                                                          _mm256_maddubs_epi16(wh, xh[m])));
                    }
                }
            }
            for (int t = 0; t < TT; t++)
                for (int m = 0; m < MB; m++)
                    for (int h = 0; h < 2; h++) acc[t][m][h] = _mm256_add_epi32(acc[t][m][h], _mm256_madd_epi16(s16[t][m][h], ones));
        }
        for (int t = 0; t < TT; t++)
            for (int h = 0; h < 2; h++) {
                const int64_t at = ((t0 + t) * (G / w->gps) + j / w->gps) * ROWS + h * HALF;
                const __m256 s = w->scales16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->scales16 + at)))
                                             : _mm256_loadu_ps(w->scales + at);
                const __m256i z = w->zeros ? _mm256_loadu_si256((const __m256i *)(w->zeros + at)) : _mm256_setzero_si256();
                for (int m = 0; m < MB; m++) {
                    const int64_t mj = (m0 + m) * G + j;
                    const __m256i exact = w->zeros ? _mm256_sub_epi32(acc[t][m][h], _mm256_mullo_epi32(z, _mm256_set1_epi32(xa[mj])))
                                                   : _mm256_sub_epi32(acc[t][m][h], _mm256_set1_epi32(w->offset * xa[mj]));
                    float *tp = tot + (t * MB + m) * ROWS + h * HALF;
                    _mm256_storeu_ps(tp, _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(s, _mm256_set1_ps(xs[mj])),
                                                         _mm256_loadu_ps(tp)));
                }
            }
    }
}

static void vpass2(int tt, int mb, const I4VWeight *w, int64_t t0, const int8_t *xq, int64_t M, const float *xs,
                   const int32_t *xa, int64_t m0, float *tot) {
    if (tt > 1) { /* vtile_runs2 puts tiles side by side only at one row */
        switch (tt) {
            case 2: vtiles2(2, 1, w, t0, xq, M, xs, xa, m0, tot); break;
            case 3: vtiles2(3, 1, w, t0, xq, M, xs, xa, m0, tot); break;
            default: vtiles2(4, 1, w, t0, xq, M, xs, xa, m0, tot); break;
        }
        return;
    }
    switch (mb) {
        case 1: vtiles2(1, 1, w, t0, xq, M, xs, xa, m0, tot); break;
        case 2: vtiles2(1, 2, w, t0, xq, M, xs, xa, m0, tot); break;
        case 3: vtiles2(1, 3, w, t0, xq, M, xs, xa, m0, tot); break;
        default: vtiles2(1, 4, w, t0, xq, M, xs, xa, m0, tot); break;
    }
}

/* The AVX-512 quantize_row in 8 lanes: the same max, scale and round-half-to-even (vcvtps2dq in
   the default rounding mode, as nearbyintf), so x's int8 codes are the same on either ISA. Groups
   are whole multiples of 32 values (cpg * 8, and kp a multiple of 64). */
static void quantize_row(const I4VWeight *w, const void *x, int x_bf16, int64_t ldx_in, int64_t m, int64_t kp,
                         float *f, int8_t *row, float *xs, int32_t *xa) {
    const int64_t K = w->K, G = w->G;
    for (int64_t k = 0; k < K; k++) f[k] = lowbit_load(x, m * ldx_in + k, x_bf16);
    for (int64_t k = K; k < kp; k++) f[k] = 0.0f;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleave */
    for (int64_t j = 0; j < G; j++) {
        const int64_t k0 = j * w->cpg * 8, k1 = j == G - 1 ? kp : k0 + w->cpg * 8;
        __m256 mx = _mm256_setzero_ps(), unord = _mm256_setzero_ps();
        for (int64_t k = k0; k < k1; k += 8) {
            const __m256 v = _mm256_loadu_ps(f + k);
            unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)); /* max_ps drops NaN */
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
        }
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, mx);
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        if (_mm256_movemask_ps(unord)) amax = NAN;
        if (!(amax > 0.0f) || !isfinite(amax)) {
            memset(row + k0, 0, (size_t)(k1 - k0));
            xs[m * G + j] = amax == 0.0f ? 0.0f : NAN;
            xa[m * G + j] = 0;
            continue;
        }
        const __m256 inv = _mm256_set1_ps(127.0f / amax);
        __m256i sum = _mm256_setzero_si256();
        for (int64_t k = k0; k < k1; k += 32) {
            __m256i q[4];
            for (int i = 0; i < 4; i++) {
                q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(f + k + 8 * i), inv));
                sum = _mm256_add_epi32(sum, q[i]);
            }
            const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(row + k), _mm256_permutevar8x32_epi32(b, order));
        }
        int32_t total[8], s = 0;
        _mm256_storeu_si256((__m256i *)total, sum);
        for (int i = 0; i < 8; i++) s += total[i];
        xs[m * G + j] = amax / 127.0f;
        xa[m * G + j] = s;
    }
}

static void vrun_tiles(LowbitTileCall *c, int tt, int mb, int64_t t, int64_t m0) {
    const I4VWeight *w = c->w;
    vpass2(tt, mb, w, t, c->xq, c->M, c->xs, c->xa, m0, c->tot);
    for (int i = 0; i < tt; i++)
        for (int m = 0; m < mb; m++) {
            const int64_t n0 = (t + i) * ROWS, lanes = w->N - n0 < ROWS ? w->N - n0 : ROWS;
            const float *v = c->tot + (i * mb + m) * ROWS;
            for (int64_t l = 0; l < lanes; l++) lowbit_store(c->y, (m0 + m) * c->ldy + n0 + l, v[l], c->y_bf16);
        }
}

/* lowbit_tile_runs with AVX2's pass sizes: up to 4 rows, TT1 tiles side by side at one row (a run stays
   within its group of four interleaved tiles). */
static void vtile_runs2(int64_t ta, int64_t tb, LowbitTileCall *call) {
    for (int64_t m0 = 0; m0 < call->M; m0 += MAXMB2) {
        const int mb = call->M - m0 >= MAXMB2 ? MAXMB2 : (int)(call->M - m0);
        for (int64_t t = ta; t < tb;) {
            int tt = mb == 1 ? TT1 : 1;
            if (tb - t < tt) tt = (int)(tb - t);
            if (t % 4 + tt > 4) tt = 4 - (int)(t % 4);
            vrun_tiles(call, tt, mb, t, m0);
            t += tt;
        }
    }
}
#endif

#if HAVE_I4VNNI || HAVE_I4AVX2
/* Tiles ta..tb-1 of y on this thread (one thread's share of a call, or a part call's), or with
   `screen` those tiles screened as part `part` (lowbit_i4v_screen_matmul): x quantized for itself
   (see int4_dot.c: cheaper than sharing across cores). 0, or -2 when out of memory. */
static int vshare(const I4VWeight *w, const void *x, int x_bf16, int64_t ldx_in, int64_t M, void *y, int y_bf16, int64_t ldy,
                  int64_t ta, int64_t tb, const LowbitScreen *screen, int part) {
    if (ta >= tb) return 0;
    const int64_t G = w->G, C = w->chunks, kp = C * 8;
    /* one block: xq (chunk layout), xs, xa, a row of float32 x, and x's int8 rows */
#define ROUND64(b) (((size_t)(b) + 63) / 64 * 64)
    const size_t xq_b = ROUND64(M * kp), xs_b = ROUND64(M * G * 4), f_b = ROUND64(kp * 4);
    char *block = aligned_alloc(64, 2 * xq_b + 2 * xs_b + f_b);
#undef ROUND64
    if (!block) return -2;
    int8_t *xq = (int8_t *)block, *rows = (int8_t *)(block + xq_b + 2 * xs_b + f_b);
    float *xs = (float *)(block + xq_b), *f = (float *)(block + xq_b + 2 * xs_b);
    int32_t *xa = (int32_t *)(block + xq_b + xs_b);
    {
#if HAVE_I4VNNI
        /* Without zero codes a pass needs each group's sum only as its sums' start, -offset * sum:
           stored so, it is one broadcast from memory per row and group, where a multiply and a move
           from a general register had been (SmolLM2's int4-g32 gate|up, 3072 x 576, at 16 rows on
           one core from cache: 197 -> 185 us). */
        const int32_t mult = w->zeros ? 1 : -w->offset;
        for (int64_t m = 0; m < M; m++) quantize_row(w, x, x_bf16, ldx_in, m, kp, f, rows + m * kp, xs, xa, mult);
#else
        for (int64_t m = 0; m < M; m++) quantize_row(w, x, x_bf16, ldx_in, m, kp, f, rows + m * kp, xs, xa);
#endif
        lowbit_chunks_by_row(xq, rows, M, C, kp);
        LowbitTileCall call = {.w = w, .xq = xq, .xs = xs, .xa = xa, .M = M, .ldy = ldy, .y = y, .y_bf16 = y_bf16,
                               .screen = screen, .part = part};
#if HAVE_I4VNNI
        lowbit_tile_runs(ta, tb, vrun_tiles, &call, w->bits == 4 && M >= 8 ? PASS_ROWS4 : MAXMB, 1);
#else
        vtile_runs2(ta, tb, &call);
#endif
    }
    free(block);
    return 0;
}
#endif

/* x: [M, ldx_in] float32 (x_bf16 = 0) or bf16 (1); y: [M, ldy] float32 or bf16 (y_bf16).
   Returns 0, or -1 when the build has neither AVX512-VNNI nor (4-bit codes) AVX2, -2 when out of
   memory. A part call (lowbit_native.h) computes its share of the tiles on the calling thread. */
int lowbit_i4v_matmul(const I4VWeight *w, const void *x, int x_bf16, int64_t ldx_in, int64_t M, void *y, int y_bf16,
                      int64_t ldy, int threads) {
#if !HAVE_I4VNNI && !HAVE_I4AVX2
    (void)w; (void)x; (void)x_bf16; (void)ldx_in; (void)M; (void)y; (void)y_bf16; (void)ldy; (void)threads;
    return -1;
#else
    if (!HAVE_I4VNNI && w->bits != 4) return -1;
    const int64_t n_tiles = (w->N + ROWS - 1) / ROWS;
    threads = lowbit_team(threads);
    int64_t ta, tb;
    if (lowbit_part_share(n_tiles, &ta, &tb)) return vshare(w, x, x_bf16, ldx_in, M, y, y_bf16, ldy, ta, tb, NULL, 0);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        lowbit_thread_share(n_tiles, &lo, &hi);
        if (vshare(w, x, x_bf16, ldx_in, M, y, y_bf16, ldy, lo, hi, NULL, 0) != 0) failed = 1;
    }
    return failed ? -2 : 0;
#endif
}

/* The copy w (8-bit codes: lowbit_i4v_screen8) at x [M, K] float32, its logits screened tile by tile
   into s (LowbitScreen, lowbit_native.h) instead of stored: s->lo set to -inf and s->count, s->over
   and s->fail to 0 here, for parts up to `threads`; s->parts gets the team's size. Returns 0, -1 without
   AVX512-VNNI or in a part call, -2 when out of memory. */
int lowbit_i4v_screen_matmul(const I4VWeight *w, const float *x, int64_t M, LowbitScreen *s, int threads) {
#if !HAVE_I4VNNI
    (void)w; (void)x; (void)M; (void)s; (void)threads;
    return -1;
#else
    if (threads < 1 || M != s->M) return -1;
    const int64_t n_tiles = (w->N + ROWS - 1) / ROWS;
    for (int64_t i = 0; i < threads * M; i++) s->lo[i] = -INFINITY, s->count[i] = 0, s->over[i] = 0;
    for (int p = 0; p < threads; p++) s->fail[p] = 0;
    s->parts = threads; /* the parts' lo read (all -inf until written) until the team's size is known */
    int failed = 0, team = 1;
#pragma omp parallel num_threads(threads)
    {
        int64_t lo, hi;
        lowbit_thread_share(n_tiles, &lo, &hi);
#ifdef _OPENMP
        const int p = omp_get_thread_num();
        if (p == 0) team = omp_get_num_threads();
#else
        const int p = 0;
#endif
        if (vshare(w, x, 0, w->K, M, NULL, 0, 0, lo, hi, s, p) != 0) failed = 1;
    }
    s->parts = team;
    return failed ? -2 : 0;
#endif
}

/* A dense weight [N, K] (float32, or bf16 with w_bf16; ldw elements apart; K a multiple of 32)
   rounded to this kernel's 8-bit codes in groups of 32 for a head's screen (decode_layers.c
   screened_argmax, kernels/screened_head.py): scale = max|w| / 127 rounded to float16 (0 where that
   is 0: codes of zero), code = 128 + round-half-even(w / scale) within 1..255, written in
   tile_codes_vnni's 8-bit layout (codes [ceil(N / 64), kp * 64], kp = K rounded up to 64, padding
   codes 128) with the scales float16 [ceil(N / 16), K / 32, 16] (padding rows 0). Per row also
   err2 >= ||w - w^|| and norm2 >= max(||w||, ||w^||) (w^ = (code - 128) * scale, exact in float32):
   float32 sums of squares grown by 2^-12, then rounded up. Returns 0, or -1 for K not a multiple of 32 or a build without
   AVX512-VNNI (whose kernel would not read the codes). */
int lowbit_i4v_screen8(const void *w, int w_bf16, int64_t N, int64_t K, int64_t ldw, uint8_t *codes, uint16_t *scales16,
                       float *err2, float *norm2, int threads) {
#if !HAVE_I4VNNI
    (void)w; (void)w_bf16; (void)N; (void)K; (void)ldw; (void)codes; (void)scales16; (void)err2; (void)norm2; (void)threads;
    return -1;
#else
    if (K <= 0 || K % 32 || N <= 0) return -1;
    const int64_t kp = (K + 63) / 64 * 64, G = K / 32, quads = (N + 63) / 64, tiles = quads * 4;
    memset(codes, 128, (size_t)(quads * kp * 64));
    memset(scales16, 0, (size_t)(tiles * G * 16) * sizeof(uint16_t));
#pragma omp parallel for num_threads(lowbit_team(threads)) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        /* float32 sums of squares: each term and sum rounds by at most 2^-24 relative, K + 2 times
           over, far inside the 2^-12 the totals are grown by below */
        __m512 e = _mm512_setzero_ps(), ww = _mm512_setzero_ps(), qq = _mm512_setzero_ps();
        uint8_t *quad = codes + (n / 64) * kp * 64 + ((n / 16) % 4) * 128 + (n % 16) * 4;
        for (int64_t j = 0; j < G; j++) {
            __m512 v[2];
            for (int h = 0; h < 2; h++)
                v[h] = w_bf16 ? lowbit_bf16_widen16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + n * ldw + j * 32 + 16 * h)))
                              : _mm512_loadu_ps((const float *)w + n * ldw + j * 32 + 16 * h);
            /* max_ps drops NaN (a NaN weight's err2 is NaN below all the same) */
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            const uint16_t hs = (uint16_t)_cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
            const float scale = _cvtsh_ss(hs);
            const int live = scale > 0.0f; /* else codes of zero and a zero scale */
            scales16[((n / 16) * G + j) * 16 + n % 16] = live ? hs : 0;
            const __m512 sv = _mm512_set1_ps(live ? scale : 1.0f), lim = _mm512_set1_ps(127.0f);
            for (int h = 0; h < 2; h++) {
                __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v[h], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q = _mm512_max_ps(_mm512_min_ps(q, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim)); /* NaN -> 127 or -127 */
                if (!live) q = _mm512_setzero_ps();
                const __m512 back = _mm512_mul_ps(q, _mm512_set1_ps(live ? scale : 0.0f)), d = _mm512_sub_ps(v[h], back);
                e = _mm512_fmadd_ps(d, d, e);
                ww = _mm512_fmadd_ps(v[h], v[h], ww);
                qq = _mm512_fmadd_ps(back, back, qq);
                uint32_t bytes[4];
                _mm_storeu_si128((__m128i *)bytes, _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128))));
                for (int t = 0; t < 4; t++) { /* codes k..k+3 of the tile's row: one dword of its chunk */
                    const int64_t k = j * 32 + 16 * h + 4 * t;
                    memcpy(quad + (k / 8) * 512 + ((k % 8) / 4) * 64, &bytes[t], 4);
                }
            }
        }
        const double grow = 1.0 + 0x1p-12;
        const double es = sqrt((double)_mm512_reduce_add_ps(e)) * grow;
        const double big = sqrt((double)fmaxf(_mm512_reduce_add_ps(ww), _mm512_reduce_add_ps(qq))) * grow;
        float f = (float)es;
        err2[n] = isnan(f) || (double)f >= es ? f : nextafterf(f, INFINITY);
        f = (float)big;
        norm2[n] = isnan(f) || (double)f >= big ? f : nextafterf(f, INFINITY);
    }
    return 0;
#endif
}

/* What the C kernels of lowbit/native share: each .c file is its own library (native/build.py
   compiles them one by one, and every file's cache key includes this header's bytes).

   Only helpers that move bits or split work live here: bf16 conversions (integer operations, so
   every caller's values are exactly what its own copy computed), the fixed-order horizontal sums
   (the AVX2 sections' of 8 lanes, sixteen vectors' at once), lane masks, the OpenMP share of
   a thread, the run-on-this-thread-or-fan-out loop and the int4 kernels' tile dispatch. No
   floating-point arithmetic is reordered by using them. */

#ifndef LOWBIT_NATIVE_H
#define LOWBIT_NATIVE_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Always inlined, so that callers passing constants get their own unrolled copies (and a loop
   calling the element helpers below stays a loop the compiler vectorizes: left to itself, gcc kept
   lowbit_load as a call inside rowops.c's activation loop). */
#define INLINE static inline __attribute__((always_inline))

/* ---- bf16 (the upper half of a float32), scalar ------------------------------------------- */

/* float32 -> bf16 bits: round to nearest even; NaN stays a quiet NaN (torch's rounding). A
   select, not a branch, so loops calling it vectorize. */
INLINE uint16_t lowbit_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded);
}

/* bf16 bits -> float32 (exact). */
INLINE float lowbit_bf16_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f rounded to bf16, as float32 (torch's x.to(bfloat16).float()). */
INLINE float lowbit_bf16_round(float f) { return lowbit_bf16_float(lowbit_bf16_bits(f)); }

/* Element i of a float32 (bf16 = 0) or bf16 (bf16 = 1) array, as float32. */
INLINE float lowbit_load(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    return lowbit_bf16_float(((const uint16_t *)p)[i]);
}

/* ---- float16, scalar ---------------------------------------------------------------------- */

/* float16 bits -> float32, exact for every value (normal, subnormal, zero, inf, NaN), without F16C
   (the portable build has none). */
INLINE float lowbit_half_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: man * 2^-24, normalized */
        int e = -1;
        uint32_t m = man;
        do {
            m <<= 1;
            e++;
        } while (!(m & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* f stored as element i of a float32 or bf16 array (bf16: rounded to nearest even). */
INLINE void lowbit_store(void *p, int64_t i, float f, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = lowbit_bf16_bits(f);
    else ((float *)p)[i] = f;
}

/* ---- vector lanes -------------------------------------------------------------------------- */

/* The mask of the first n of 16 lanes (all 16 when n >= 16). */
static inline uint16_t lowbit_lanes(int64_t n) { return n >= 16 ? (uint16_t)0xFFFF : (uint16_t)((1u << n) - 1u); }

#if defined(__AVX512F__)
/* 16 float32 -> their bf16 bits in the low half of each 32-bit lane (upper half zero): round to
   nearest even, NaN kept a quiet NaN, exactly as lowbit_bf16_bits. Needs no AVX512-BF16 (whose
   vcvtneps2bf16 also flushes subnormal inputs, which this does not). */
static inline __m512i lowbit_bf16_bits16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

/* K float32 -> bf16 (lowbit_bf16_bits16's rounding), 16 at a time, the tail masked. */
static inline void lowbit_bf16_row(const float *src, uint16_t *dst, int64_t K) {
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = lowbit_lanes(K - k);
        _mm256_mask_storeu_epi16(dst + k, mask, _mm512_cvtepi32_epi16(lowbit_bf16_bits16(_mm512_maskz_loadu_ps(mask, src + k))));
    }
}

/* 16 bf16 values -> float32 (exact: a 16-bit shift). */
static inline __m512 lowbit_bf16_widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The reductions of the 16 lanes of each of a[0..15], in one fixed tree for all sixteen: lanes l and
   l + 8, then 4, 2 and 1 apart, pairs of vectors sharing each shuffle (4 x 16 vector operations where
   sixteen separate reductions take ~8 x 16). Lane 4k + p of the result reduces a[4p + k]. OP 0: float32
   add (every caller's sums are then added in this one order), 1: float32 max, 2: int32 add (the lanes
   float32 bits). */
INLINE __m512 lowbit_reduce16(const int OP, const __m512 *a) {
#define LOWBIT_RED(p, q) \
    (OP == 0 ? _mm512_add_ps(p, q) : OP == 1 ? _mm512_max_ps(p, q) \
             : _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_castps_si512(q))))
    __m512 t[8], v[4], u[2];
    for (int i = 0; i < 8; i++) /* lanes l and l + 8: a[2i] in lanes 0-7, a[2i + 1] in 8-15 */
        t[i] = LOWBIT_RED(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 4; j++) /* + 4 apart: quarter q is a[4j + q] */
        v[j] = LOWBIT_RED(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int j = 0; j < 2; j++) /* + 2 apart */
        u[j] = LOWBIT_RED(_mm512_shuffle_ps(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return LOWBIT_RED(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
#undef LOWBIT_RED
}
#endif

#if defined(__AVX2__)
/* The AVX2 sections' shared pieces (CPUs without AVX-512). 8 bf16 values -> float32 (exact). */
static inline __m256 lowbit_bf16_widen8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The eight lanes of v summed in one fixed order (halves, then pairs, then the last two), so
   every caller's horizontal sums round alike. */
static inline float lowbit_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* ---- threads ------------------------------------------------------------------------------- */

/* Parts: native/decode_layers.c runs a whole step inside one OpenMP region (opening a region per
   kernel cost 1-2 us each, ~10 a layer) and calls each kernel from every thread of that team with
   threads = LOWBIT_PART(part, parts). The kernel then computes, on the calling thread and without
   a region of its own (a nested one-thread region still cost ~0.8 us), the share that thread
   `part` of its own team of `parts` would have computed (the same items, so the same bits), and
   the caller's barrier joins the shares. A kernel taking part calls passes its `threads` through
   lowbit_team first, which notes the part (per library and per thread) for lowbit_part_share and
   lowbit_for_items, and returns the team size for a region of its own (1 in a part call). */
#define LOWBIT_PART_LIMIT 4096
#define LOWBIT_PART(part, parts) (-(int)((part) * LOWBIT_PART_LIMIT + (parts)))
static __thread int lowbit_part_id __attribute__((unused)), lowbit_part_count __attribute__((unused)); /* count 0: no part */

static inline __attribute__((unused)) int lowbit_team(int threads) {
    if (threads < 0) {
        lowbit_part_id = -threads / LOWBIT_PART_LIMIT;
        lowbit_part_count = -threads % LOWBIT_PART_LIMIT;
        return 1;
    }
    lowbit_part_count = 0;
    return threads;
}

/* Share `id` of `n`, contiguous, of total items: [*lo, *hi). Every split below is this one. */
static inline void lowbit_share(int64_t total, int64_t id, int64_t n, int64_t *lo, int64_t *hi) {
    *lo = total * id / n;
    *hi = total * (id + 1) / n;
}

/* In a part call (noted by lowbit_team on this thread): its share [*lo, *hi) of total items, and 1;
   else 0. */
static inline int lowbit_part_share(int64_t total, int64_t *lo, int64_t *hi) {
    if (!lowbit_part_count) return 0;
    lowbit_share(total, lowbit_part_id, lowbit_part_count, lo, hi);
    return 1;
}

/* Inside an OpenMP parallel region: this thread's contiguous share [*lo, *hi) of total items. */
static inline void lowbit_thread_share(int64_t total, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    lowbit_share(total, omp_get_thread_num(), omp_get_num_threads(), lo, hi);
#else
    lowbit_share(total, 0, 1, lo, hi);
#endif
}

/* fn(args, lo, hi) computes items lo..hi-1, each alone (its result does not depend on the others). */
typedef void (*lowbit_items_fn)(const void *args, int64_t lo, int64_t hi);

/* Items 0..count-1: in one call on the calling thread unless `parallel` (waking a team costs more
   than small calls), else one call per item, split statically over `threads` OpenMP threads; in
   a part call, the part's static share in one call. */
static inline void lowbit_for_items(int64_t count, int parallel, int threads, lowbit_items_fn fn, const void *args) {
    int64_t lo, hi;
    if (lowbit_part_share(count, &lo, &hi)) { /* a part call: its share, here */
        if (lo < hi) fn(args, lo, hi);
        return;
    }
    if (!parallel) {
        fn(args, 0, count);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < count; i++) fn(args, i, i + 1);
}

/* ---- the int4 kernels' tiles (int4_dot.c, int4_vnni.c) -------------------------------------- */

/* Both keep 16 output rows per tile (one per vector lane), four tiles interleaved, and run x rows
   in passes of up to LOWBIT_PASS_ROWS (int4_vnni.c: 8). */

/* x rows (converted, row_bytes apart) regrouped chunk by chunk for the passes: the 8 bytes of chunk
   c of row m go to xq + (c * M + m) * 8, so a pass reads one chunk of all its rows together. */
static inline void lowbit_chunks_by_row(void *xq, const void *rows, int64_t M, int64_t C, int64_t row_bytes) {
    for (int64_t c = 0; c < C; c++)
        for (int64_t m = 0; m < M; m++) memcpy((char *)xq + (c * M + m) * 8, (const char *)rows + m * row_bytes + c * 8, 8);
}

#define LOWBIT_PASS_ROWS 16

/* One thread's share of a call: the weight, x as this thread prepared it (xq, and per row and
   group xs / xa: sums, or scales and integer sums), where y goes, and a pass's totals
   tot[(tile * mb + row) * 16 + lane]. */
typedef struct {
    const void *w, *xq, *xs, *xa;
    int64_t M, ldy;
    void *y;
    int y_bf16;
    /* or, instead of storing y, each tile screened (int4_vnni.c: a LowbitScreen and this thread's part) */
    const void *screen;
    int part;
    float tot[4 * LOWBIT_PASS_ROWS * 16];
} LowbitTileCall;

/* A dense head's argmax screened inside its int8 copy's matmul (int4_vnni.c lowbit_i4v_screen_matmul,
   decode_layers.c screened_argmax): each 16-entry tile's logits a of each row m are set against the
   bound B = (X2_m err2_v + C_m norm2_v)(1 + 2^-16), never stored. Each entry's lower bound a - B -
   slack and upper bound a + B + slack (slack = (|a| + B) 2^-20 covers the float32 rounding of a +- B)
   bracket its exact logit e_v, so any lower bound seen is one of max_v e_v. Per part p (a thread's
   contiguous share of the tiles, lowbit_thread_share's) and row m: lo = the largest lower bound seen
   (each part reads the others' too); every tile's largest upper bound into tile_up; and the tiles
   whose largest upper bound reaches (the largest lo) - tiny_m at the time are recorded with their 16
   upper bounds (-inf past N), in ascending order, up to cap (then `over` is set and the tile_up of
   the part's tiles stands in for its records). The bounds only rise, so a tile holding an entry
   whose exact logit is the largest is among the records (or the tile_up) whatever came after it. */
typedef struct {
    const float *err2, *norm2;   /* [N] */
    const float *x2f, *cf, *tiny; /* [M] */
    int64_t M, cap;              /* rows; tiles a part and row may record */
    float *lo;                   /* [parts, M] */
    int32_t *tiles;              /* [parts, M, cap] */
    float *upper;                /* [parts, M, cap, 16] */
    int64_t *count;              /* [parts, M] */
    int32_t *over;               /* [parts, M]: 1 where a row had more than cap tiles to record */
    float *tile_up;              /* [M, ceil(N / 16)] */
    int32_t *fail;               /* [parts]: 1 where a logit was not finite */
    int32_t parts;               /* set by the call: its team's size */
} LowbitScreen;

/* run(call, tt, mb, t, m0): tiles t..t+tt-1 against x rows m0..m0+mb-1, computed and stored. */
typedef void (*lowbit_tile_run_fn)(LowbitTileCall *call, int tt, int mb, int64_t t, int64_t m0);

/* x rows whose passes run one group of four tiles at a time: the group's codes are read from memory
   once for all of them (then from L1/L2), where pass after pass over all the thread's tiles read
   them once per pass - at 16 rows twice, at 64 rows eight times. 64 rows of x (K bytes each as
   int8) stay in L2. */
#ifndef LOWBIT_ROW_BLOCK
#define LOWBIT_ROW_BLOCK 64
#endif

/* A thread's tiles ta..tb-1 against x rows 0..M-1: passes of up to pass_rows rows (at most
   LOWBIT_PASS_ROWS), each over runs of up to tt_max tiles side by side (enough independent
   accumulators to cover the dot product's latency, at most 16 in all), a run staying within its
   group of four interleaved tiles. lean: at most 10 tiles x rows (one tile at 6-8 rows, two at
   4-5, three at 3, four at 1-2), for a kernel that keeps a float total beside each integer sum in
   registers (int4_vnni.c): at 16 of each GCC spilled sums to the stack inside the chunk loop, and
   SmolLM2's int4 matmuls at 8-64 rows ran 17-30 % slower (Zen 4, alternated in one process; the
   same bits). Blocks of LOWBIT_ROW_BLOCK rows run group by group, every pass
   of the block on a group before the next group. The passes are the same rows as pass after pass
   over everything (block starts are multiples of pass_rows), and each (tile, pass) is computed
   alone, so the order changes no output. */
static inline void lowbit_tile_runs(int64_t ta, int64_t tb, lowbit_tile_run_fn run, LowbitTileCall *call, int pass_rows,
                                    int lean) {
    const int64_t M = call->M;
    const int64_t block = LOWBIT_ROW_BLOCK > pass_rows ? LOWBIT_ROW_BLOCK / pass_rows * pass_rows : pass_rows;
    for (int64_t b0 = 0; b0 < M; b0 += block) {
        const int64_t be = b0 + block < M ? b0 + block : M;
        for (int64_t g = ta; g < tb;) {
            const int64_t ge = (g / 4 + 1) * 4 < tb ? (g / 4 + 1) * 4 : tb; /* the rest of g's group of four */
            for (int64_t m0 = b0; m0 < be; m0 += pass_rows) {
                const int mb = be - m0 >= pass_rows ? pass_rows : (int)(be - m0);
                const int tt_max = lean ? (mb <= 2 ? 4 : mb == 3 ? 3 : mb <= 5 ? 2 : 1) : mb <= 4 ? 4 : mb <= 8 ? 2 : 1;
                for (int64_t t = g; t < ge;) {
                    const int tt = ge - t < tt_max ? (int)(ge - t) : tt_max;
                    run(call, tt, mb, t, m0);
                    t += tt;
                }
            }
            g = ge;
        }
    }
}

/* switch over (tt, mb) to CASE(TT, MB) (each `case MB: ...; break;`) for the pairs
   lowbit_tile_runs makes, so every pass compiles with constant TT and MB: LOWBIT_TILE_PASSES for
   passes of up to 16 rows, LOWBIT_TILE_PASSES_8 for passes of up to 8. */
#define LOWBIT_MB_UPTO4(CASE, TT) CASE(TT, 1) CASE(TT, 2) CASE(TT, 3) CASE(TT, 4)
#define LOWBIT_MB_5TO8(CASE, TT) CASE(TT, 5) CASE(TT, 6) CASE(TT, 7) CASE(TT, 8)
#define LOWBIT_MB_9TO16(CASE, TT) \
    CASE(TT, 9) CASE(TT, 10) CASE(TT, 11) CASE(TT, 12) CASE(TT, 13) CASE(TT, 14) CASE(TT, 15) CASE(TT, 16)
#define LOWBIT_NO_CASES(CASE, TT)
/* WIDE: the one-tile cases beyond 8 rows (LOWBIT_MB_9TO16 or LOWBIT_NO_CASES) */
#define LOWBIT_TILE_PASSES_UPTO(tt, mb, CASE, WIDE)                                 \
    do {                                                                            \
        if ((tt) == 4) {                                                            \
            switch (mb) { LOWBIT_MB_UPTO4(CASE, 4) }                                \
        } else if ((tt) == 3) {                                                     \
            switch (mb) { LOWBIT_MB_UPTO4(CASE, 3) }                                \
        } else if ((tt) == 2) {                                                     \
            switch (mb) { LOWBIT_MB_UPTO4(CASE, 2) LOWBIT_MB_5TO8(CASE, 2) }        \
        } else {                                                                    \
            switch (mb) { LOWBIT_MB_UPTO4(CASE, 1) LOWBIT_MB_5TO8(CASE, 1) WIDE(CASE, 1) } \
        }                                                                           \
    } while (0)
#define LOWBIT_TILE_PASSES(tt, mb, CASE) LOWBIT_TILE_PASSES_UPTO(tt, mb, CASE, LOWBIT_MB_9TO16)
#define LOWBIT_TILE_PASSES_8(tt, mb, CASE) LOWBIT_TILE_PASSES_UPTO(tt, mb, CASE, LOWBIT_NO_CASES)

#endif

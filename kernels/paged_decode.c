/* CPU decode attention over the engine's paged KV pool, with the rotary embedding and the KV
   write fused in: one call per layer replaces ~25 small torch ops (rotate q and k, write k and v
   at the step's slots, gather each sequence's context, mask, SDPA).

   Rows t = 0..T-1 are the step's new tokens (decodes and short verifies, all of the step).
   For each row: k_t and q_t are rotated (half-split RoPE, cos/sin of the row's position, float32
   arithmetic on the stored dtype's values), k_t and v_t are written at slots[t]; then each query
   head attends to its sequence's positions lo..pos[t] (lo = pos - window + 1 with a sliding
   window), reading slots through the sequence's block table: scores in float32, max-subtracted
   softmax, weighted sum of values, output rounded once to the stored dtype.

   Every (row, head) is computed alone, in a fixed order, from the pool's contents: the output of
   a row does not depend on the other rows of the step (batch invariance, which keeps speculative
   verification exact). dtype: 0 float32, 1 bf16 (q/k/v/cos/sin/out and the pool alike). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float ld(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void st(void *p, int64_t i, float f, int bf16) {
    if (!bf16) { ((float *)p)[i] = f; return; }
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) { ((uint16_t *)p)[i] = (uint16_t)((u >> 16) | 0x40); return; }
    u += 0x7FFFu + ((u >> 16) & 1u);
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

static inline float r16(float f) {
    uint16_t h;
    st(&h, 0, f, 1);
    return ld(&h, 0, 1);
}

#if defined(__AVX512F__)
#define HAVE_AVX512_ATTN 1
#include <immintrin.h>
/* 16 pool values from element i on, as float32 (bf16 widened exactly by a 16-bit shift). */
static inline __m512 load16(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

/* x (D values at src) rotated into out[D] (float32). */
static inline void rotate(const void *src, int64_t off, const void *cs, const void *sn, int64_t coff, int64_t D,
                          int bf16, float *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        float x1 = ld(src, off + i, bf16), x2 = ld(src, off + half + i, bf16);
        float c = ld(cs, coff + i, bf16), s = ld(sn, coff + i, bf16);
        if (bf16) { /* bf16 rounds each product and sum, as torch's bf16 elementwise ops do */
            out[i] = r16(r16(x1 * c) - r16(x2 * s));
            out[half + i] = r16(r16(x2 * c) + r16(x1 * s));
        } else {
            out[i] = x1 * c - x2 * s;
            out[half + i] = x2 * c + x1 * s;
        }
    }
}

#define MAXD 512

/* Pool slot of position j: block_size is a power of two in the engine (16 by default), where a
   shift and mask replace two 64-bit divisions per position. */
static inline int64_t slot_of(const int64_t *bt, int64_t j, int64_t block_size) {
    if ((block_size & (block_size - 1)) == 0) {
        const int sh = __builtin_ctzll((unsigned long long)block_size);
        return (bt[j >> sh] << sh) + (j & (block_size - 1));
    }
    return bt[j / block_size] * block_size + j % block_size;
}

#ifdef HAVE_AVX512_ATTN
/* The weighted sum of values for one (row, head) with the NV accumulator vectors held in
   registers (a constant NV per call site; an array indexed at run time would live in memory and
   chain every position through store-to-load forwarding). Same operations in the same order as
   the generic loop, so the same bits. Returns the softmax denominator. */
static inline __attribute__((always_inline)) float values(const int NV, const float *sc, int64_t lo, int64_t p, float mx,
                                                          const int64_t *bt, int64_t block_size, int64_t row, int64_t off,
                                                          const void *vpool, int bf16, float *acc) {
    __m512 a[16];
    for (int i = 0; i < NV; i++) a[i] = _mm512_setzero_ps();
    float total = 0.0f;
    for (int64_t j = lo; j <= p; j++) {
        const float e = expf(sc[j - lo] - mx);
        total += e;
        const int64_t base = slot_of(bt, j, block_size) * row + off;
        const __m512 ev = _mm512_set1_ps(e);
        for (int i = 0; i < NV; i++) a[i] = _mm512_add_ps(a[i], _mm512_mul_ps(ev, load16(vpool, base + 16 * i, bf16)));
    }
    for (int i = 0; i < NV; i++) _mm512_storeu_ps(acc + 16 * i, a[i]);
    return total;
}
#endif

int lowbit_paged_decode(const void *q, int64_t ldq, const void *k, int64_t ldk, const void *v, int64_t ldv,
                        const void *cs, const void *sn, int dtype, const int64_t *pos, const int64_t *slots,
                        const int64_t *item, const int64_t *tables, int64_t nb, void *kpool, void *vpool,
                        void *out, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                        int64_t window, float scale, int threads) {
    const int bf16 = dtype == 1;
    const int64_t half = D / 2, row = KVH * D;
    if (D > MAXD || D % 2) return -1;
    /* 1. rotate k and write k, v into the pool */
    for (int64_t t = 0; t < T; t++) {
        float buf[MAXD];
        for (int64_t h = 0; h < KVH; h++) {
            if (cs) rotate(k, t * ldk + h * D, cs, sn, t * half, D, bf16, buf);
            else for (int64_t d = 0; d < D; d++) buf[d] = ld(k, t * ldk + h * D + d, bf16);
            for (int64_t d = 0; d < D; d++) {
                st(kpool, slots[t] * row + h * D + d, buf[d], bf16);
                st(vpool, slots[t] * row + h * D + d, ld(v, t * ldv + h * D + d, bf16), bf16);
            }
        }
    }
    /* 2. attention per (row, query head) */
    int64_t maxlen = 1;
    for (int64_t t = 0; t < T; t++) maxlen = pos[t] + 1 > maxlen ? pos[t] + 1 : maxlen;
    const int64_t group = H / KVH;
    int fail = 0;
#pragma omp parallel num_threads(threads)
    {
        float *sc = malloc((size_t)maxlen * sizeof(float));
        float qv[MAXD], acc[MAXD];
        if (!sc) fail = 1;
#pragma omp for schedule(static)
        for (int64_t th = 0; th < T * H; th++) {
            if (!sc) continue;
            const int64_t t = th / H, h = th % H, kh = h / group;
            if (cs) rotate(q, t * ldq + h * D, cs, sn, t * half, D, bf16, qv);
            else for (int64_t d = 0; d < D; d++) qv[d] = ld(q, t * ldq + h * D + d, bf16);
            const int64_t p = pos[t], lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            const int64_t *bt = tables + item[t] * nb;
            float mx = -INFINITY;
#ifdef HAVE_AVX512_ATTN
            if (D % 16 == 0) { /* same sums as below, 16 lanes at a time (the pool read dominates) */
                for (int64_t j = lo; j <= p; j++) {
                    const int64_t base = slot_of(bt, j, block_size) * row + kh * D;
                    __m512 lanes = _mm512_setzero_ps();
                    for (int64_t d = 0; d < D; d += 16)
                        lanes = _mm512_add_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(qv + d), load16(kpool, base + d, bf16)));
                    const float s = _mm512_reduce_add_ps(lanes) * scale;
                    sc[j - lo] = s;
                    if (s > mx) mx = s;
                }
            } else
#endif
            for (int64_t j = lo; j <= p; j++) {
                const int64_t base = slot_of(bt, j, block_size) * row + kh * D;
                float lanes[16] = {0};
                for (int64_t d = 0; d < D; d++) lanes[d & 15] += qv[d] * ld(kpool, base + d, bf16);
                float s = 0.0f;
                for (int i = 0; i < 16; i++) s += lanes[i];
                s *= scale;
                sc[j - lo] = s;
                if (s > mx) mx = s;
            }
            float total = 0.0f;
            for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
#ifdef HAVE_AVX512_ATTN
            if (D == 64 || D == 128 || D == 256) {
                total = D == 64 ? values(4, sc, lo, p, mx, bt, block_size, row, kh * D, vpool, bf16, acc)
                      : D == 128 ? values(8, sc, lo, p, mx, bt, block_size, row, kh * D, vpool, bf16, acc)
                                 : values(16, sc, lo, p, mx, bt, block_size, row, kh * D, vpool, bf16, acc);
            } else if (D % 16 == 0) {
                for (int64_t j = lo; j <= p; j++) {
                    const float e = expf(sc[j - lo] - mx);
                    total += e;
                    const int64_t base = slot_of(bt, j, block_size) * row + kh * D;
                    const __m512 ev = _mm512_set1_ps(e);
                    for (int64_t d = 0; d < D; d += 16)
                        _mm512_storeu_ps(acc + d, _mm512_add_ps(_mm512_loadu_ps(acc + d), _mm512_mul_ps(ev, load16(vpool, base + d, bf16))));
                }
            } else
#endif
            for (int64_t j = lo; j <= p; j++) {
                const float e = expf(sc[j - lo] - mx);
                total += e;
                const int64_t base = slot_of(bt, j, block_size) * row + kh * D;
                for (int64_t d = 0; d < D; d++) acc[d] += e * ld(vpool, base + d, bf16);
            }
            const float inv = 1.0f / total;
            for (int64_t d = 0; d < D; d++) st(out, t * H * D + h * D + d, acc[d] * inv, bf16);
        }
        free(sc);
    }
    return fail ? -2 : 0;
}

/* The decoder layers of one engine step in one call: Llama-family and Gemma-3 layers (pre-norm
   attention and gated MLP, optional q/k norms and Gemma's post-norms) over the paged KV cache, for
   steps whose items are all short (decodes, speculative verifies), in float32.

   Why: a decode step of a small model is ~7 kernel calls per layer, each tens of microseconds.
   Made from Python, every call paid the interpreter's and ctypes' fixed cost, and the pause between
   two calls was long enough for the OpenMP workers to fall asleep, so each kernel also paid a
   wake-up (measured on SmolLM2-135M int4, AVX2, 2 threads: the step took 23 ms, of which the int4
   kernels were 4 ms in a tight loop). Here the same kernels run back to back from C.

   Nothing is computed here: every step is a call of the very kernel the Python path calls
   (native/int4_vnni.c or int4_dot.c, int8_gemv.c, f32_dot.c, rowops.c, paged_decode.c), through the entry
   point the caller passes, with the same arguments in the same order. So the result is bit for
   bit the Python path's (the layers' `forward_deferred`, DecoderModel's final norm), and stays
   batch-invariant as those kernels are.

   MoE layers (Mixtral, Qwen2/3-MoE, OLMoE) route through moe_route.c, as the model does.

   Per layer, on rows x [M, hidden] (the residual stream, updated in place) and the residual r the
   previous layer left pending (layer `first` has none; P is the previous layer's post_ffn norm,
   the identity when it has none):
     x += P(r); h = norm_in(x)                   (rmsnorm alone for the first layer)
     qkv = h W_qkv; q, k = q_norm(q), k_norm(k)  (when the layer has them)
     attn = paged_decode(rope(q), rope(k) and v written at the rows' slots)
     x += post_attn(attn W_o); h = norm_mlp(x)   (post_attn: Gemma's, else the identity)
     r = (act(h W_gate) * (h W_up)) W_down       (gate|up joined in one weight; a MoE block: the routed
                                                 experts' weighted sum, plus a shared expert)
   and after the last layer out = final_norm(x + P(r)) (or x += P(r) when there is no final norm).
   These are runtime/models/llama.py's and gemma3.py's `forward_deferred`. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lowbit_native.h"

/* The kernels' signatures (their own files document them). */
typedef int (*int4_fn)(const void *w, const void *x, int x_bf16, int64_t ldx, int64_t M, void *y, int y_bf16, int64_t ldy,
                       int threads);
typedef int (*int8f_fn)(const int8_t *q, int64_t N, int64_t K, int64_t ldw, const float *s, int64_t G, int64_t group,
                        const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, int threads);
typedef int (*dense_fn)(const void *w, int64_t N, int64_t K, int64_t ldw, const float *bias, const float *x, int64_t ldx,
                        int64_t M, float *y, int64_t ldy, int threads);
typedef int (*rmsnorm_fn)(const void *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t dim, const void *w, float eps,
                          int unit_offset, int dtype, void *out, int64_t out_stride, int threads);
typedef int (*add_rmsnorm_fn)(const void *x, int64_t x_stride, const void *r, int64_t r_stride, const void *r_w, int64_t rows,
                              int64_t dim, const void *w, float eps, int unit_offset, int dtype, void *sum_out,
                              int64_t sum_stride, void *out, int64_t out_stride, int threads);
typedef int (*act_mul_fn)(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride, int64_t rows, int64_t n,
                          int act, int dtype, void *out, int64_t out_stride, int threads);
typedef int (*moe_route_fn)(const float *x, int64_t ldx, int64_t rows, int64_t hidden, const float *gate, int64_t experts,
                            int64_t top_k, int norm_topk, float *weights, int64_t *chosen, int threads);
typedef int (*moe_shared_gate_fn)(const float *x, int64_t ldx, int64_t rows, int64_t hidden, const float *w, float *out);
typedef int (*paged_decode_fn)(const void *q, int64_t ldq, const void *k, int64_t ldk, const void *v, int64_t ldv,
                               const void *cs, const void *sn, int dtype, const int64_t *pos, const int64_t *slots,
                               const int64_t *item, const int64_t *tables, int64_t nb, void *kpool, void *vpool, void *out,
                               int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t window, float scale,
                               int threads);

typedef int (*logit_rows_fn)(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t *argmax, int threads);
typedef int (*top_rows_fn)(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t k, int64_t *idx);
typedef int (*rescore_rows_fn)(float *y, int64_t ldy, int64_t rows, const int64_t *idx, int64_t k, const int64_t *vocab,
                               const void *w, int w_bf16, int64_t K, const float *x, int64_t ldx, const float *bias);

enum { LINEAR_INT4 = 1, LINEAR_DENSE = 2, LINEAR_INT8F = 3 };

/* One projection: `fn` is lowbit_i4v_matmul / lowbit_i4_matmul (kind LINEAR_INT4, `w` its weight
   struct), lowbit_f32_matmul / lowbit_bf16w_matmul / lowbit_bf16xw_matmul (LINEAR_DENSE, `w` the
   weight's data) or lowbit_int8f_matmul (LINEAR_INT8F, `w` the int8 codes, `scales` [n, groups]).
   A bf16 weight's packed copy (kernels/cpu_bf16pack.py): `packed` its Bf16Packed, `packed_fn`
   lowbit_bf16pxw_matmul (lowbit_bf16xw_matmul's arguments and outputs), called for steps of up to
   `packed_rows` rows. */
typedef struct {
    int32_t kind, pad;
    const void *fn;
    const void *w;
    const float *bias;   /* dense only, or NULL */
    int64_t n, k, ldw;
    const float *scales; /* int8 only */
    int64_t groups, group;
    const void *packed_fn, *packed; /* or NULL */
    int64_t packed_rows;
} ChainLinear;

/* A gated MLP: gate|up joined into one weight [2I, hidden], then down [hidden, I]. */
typedef struct {
    ChainLinear gate_up, down;
} ChainMLP;

/* A sparse MoE block (runtime/models/moe.py): the router, each expert's MLP, and Qwen2-MoE's
   shared expert with its sigmoid gate. */
typedef struct {
    const float *router; /* [experts, hidden] float32 */
    int64_t experts, top_k;
    int32_t norm_topk, pad;
    const ChainMLP *expert;    /* [experts] */
    const ChainMLP *shared;    /* or NULL */
    const float *shared_gate;  /* [hidden], with shared */
} ChainMoE;

typedef struct {
    const float *norm_in;  /* before attention */
    const float *norm_mlp; /* before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward) */
    ChainLinear qkv, o;
    ChainMLP mlp;          /* unless moe */
    const ChainMoE *moe;   /* a sparse MoE block instead of the MLP, or NULL */
    void *kpool, *vpool; /* [slots, kv_heads, head_dim] float32, or bf16 (Chain.pool_bf16) */
    int64_t window;      /* 0: none */
    int64_t rope;        /* index of this layer's cos/sin tables in the step */
    /* optional (NULL: none): q/k RMSNorm over slices of q_norm_width / k_norm_width values (a head,
       or the whole projection), and Gemma's norms of the attention and MLP outputs */
    const float *q_norm, *k_norm;
    int64_t q_norm_width, k_norm_width;
    const float *post_attn, *post_ffn;
} ChainLayer;

typedef struct {
    const void *rmsnorm, *add_rmsnorm, *act_mul;
    const void *moe_route, *moe_shared_gate; /* moe_route.c's entry points (MoE layers only) */
    const ChainLayer *layers;
    int64_t n_layers, hidden, heads, kv_heads, head_dim;
    int64_t inter;       /* the widest MLP's I (dense, expert or shared) */
    int64_t max_top_k;   /* 0 without MoE layers */
    int64_t block_size;
    float eps, scale;
    int32_t unit_offset, act;
    int32_t pool_bf16;      /* 1: the KV pools hold bf16 (a float32 model's --kv-dtype bf16) */
    int32_t team;           /* 1: on 2+ threads a step runs in one OpenMP region (run_layers) */
    const void *paged_write, *paged_attend; /* paged_decode.c's two halves (a barrier between them) */
} Chain;

#define MAX_ROPES 4
#define LOWBIT_MAX_ROWS_MOE 4096 /* rows of one step through a MoE block (the engine's token budget is smaller) */

/* What changes from step to step: the rows' positions, KV slots, items and block tables
   (runtime/engine/paged_attention.py DecodeIndex), and the rotary tables, whole [positions,
   head_dim / 2], which the step indexes by position itself. With ids, the step also fills x: row
   t = embed[ids[t]] (float32 or bf16 widened) times embed_scale, as the model's embedding does
   (Gemma scales by sqrt(hidden), others by 1). Both spare the engine ~0.1 ms of torch calls a step.
   A table quantized to int8 or int4 codes in groups (a tied head quantized with --quantize-head,
   runtime/quant_embedding.py) is read the same way: element d of row id is (code - zero) times its
   group's scale in float32 (zero: 2^(bits-1), or the group's zero point), then times embed_scale,
   as QuantEmbedding dequantizes it (quant/intq.py; the torch calls had cost a Gemma-3 int8-head
   decode ~0.4 ms a step, their code and data cold). */
typedef struct {
    int64_t rows, nb;
    const int64_t *pos, *slots, *items, *tables;
    const float *cos_table[MAX_ROPES], *sin_table[MAX_ROPES];
    int64_t table_rows;  /* positions in each cos_table/sin_table */
    const int64_t *ids;  /* or NULL: x is given */
    const void *embed;   /* [embed_rows, hidden]: float32, bf16 (embed_bf16) or codes (embed_scales) */
    int64_t embed_rows;
    int32_t embed_bf16;
    float embed_scale;
    const void *embed_scales;  /* or NULL: the codes' scales [embed_rows, groups] */
    int64_t embed_group;       /* the codes' group size (hidden for one scale a row) */
    int32_t embed_scale_dtype; /* the scales' dtype: 0 float32, 1 bf16, 2 float16 */
    int32_t embed_bits;        /* 8: int8 [rows, hidden] holding code - 128; 4: two codes a byte, the low nibble first */
    const uint8_t *embed_zeros; /* or NULL (symmetric): zero points [embed_rows, groups] */
} ChainStep;

static float embed_scale_at(const ChainStep *s, int64_t i) {
    if (s->embed_scale_dtype == 2) return lowbit_half_float(((const uint16_t *)s->embed_scales)[i]);
    return lowbit_load(s->embed_scales, i, s->embed_scale_dtype == 1);
}

static int linear(const ChainLinear *l, const float *x, int64_t ldx, int64_t M, float *y, int threads) {
    if (l->kind == LINEAR_INT4) return ((int4_fn)l->fn)(l->w, x, 0, ldx, M, y, 0, l->n, threads);
    if (l->kind == LINEAR_DENSE && l->packed && M <= l->packed_rows)
        return ((dense_fn)l->packed_fn)(l->packed, l->n, l->k, l->k, l->bias, x, ldx, M, y, l->n, threads);
    if (l->kind == LINEAR_DENSE) return ((dense_fn)l->fn)(l->w, l->n, l->k, l->ldw, l->bias, x, ldx, M, y, l->n, threads);
    if (l->kind == LINEAR_INT8F)
        return ((int8f_fn)l->fn)(l->w, l->n, l->k, l->ldw, l->scales, l->groups, l->group, x, ldx, M, y, l->n, threads);
    return -100;
}


/* Rows of float32 activations, 64-byte aligned (a kernel's 16-float loads along a row are then
   whole cache lines; x converted to bf16 at 16-byte alignment had made the bf16 kernel's loads
   split lines, 1.3-1.4x its time). */
static float *rows_buffer(int64_t rows, int64_t n) {
    return aligned_alloc(64, (size_t)((rows * n * (int64_t)sizeof(float) + 63) / 64 * 64));
}

/* Scratch of one call: an MLP's gate|up and activation rows, and the MoE block's. */
typedef struct {
    float *gu, *act;       /* [cap, 2 * inter], [cap, inter] */
    float *xe, *ye;        /* [cap, hidden]: a batch of experts' gathered rows and their outputs */
    float *wts, *sig;      /* [M, top_k], [M] */
    int64_t *sel, *idx;    /* [M, top_k], [cap]: each gathered row's token */
    float *scale;          /* [cap]: each gathered row's routing weight */
    int64_t cap;           /* rows of the buffers above: M, or M * top_k for a MoE step of few rows */
} Scratch;

/* Routed experts per batch (team_moe), and the rows a MoE step's scratch holds so that all of a
   step's routed rows fit one batch: a decode step's k experts then run their phases together. */
#define LOWBIT_MOE_BATCH 128
#define LOWBIT_MOE_BATCH_ROWS 256

/* The step's buffers, shared by the team; xalt and own for steps of fewer rows than threads
   (run_layers' `solo`): the residual's other buffer, and each thread but the first its own
   normed rows and sums ([threads - 1][2][rows, hidden]). */
typedef struct {
    float *h, *qkv, *att, *a, *r, *qn, *kn;
    const Scratch *w;
    float *xalt, *own;
} TeamBuffers;

/* For each of n MLPs b: y rows first[b].. (count[b] of them) = down_b(act(gate_b) * up_b) of the
   same rows of x [., H], as GatedMLP.forward with gate|up joined: three phases (every MLP's gate|up,
   then their activations, then their down projections), a barrier after each (pt: see run_layers).
   The MLPs write disjoint rows, so within a phase they need no barrier between them. */
static int team_mlps(const Chain *c, const ChainMLP *const *m, int64_t n, const int64_t *first, const int64_t *count,
                     const float *x, int one_x, const Scratch *w, float *y, int pt) {
    const int64_t H = c->hidden, I = c->inter; /* the scratch's row widths */
    int rc = 0;
    for (int64_t b = 0; b < n; b++) /* one_x: every MLP reads x's first row (one token's experts) */
        rc |= linear(&m[b]->gate_up, x + (one_x ? 0 : first[b]) * H, H, count[b], w->gu + first[b] * 2 * I, pt);
#pragma omp barrier
    for (int64_t b = 0; b < n; b++) {
        const int64_t Ib = m[b]->gate_up.n / 2;
        float *gu = w->gu + first[b] * 2 * I;
        rc |= ((act_mul_fn)c->act_mul)(gu, 2 * Ib, gu + Ib, 2 * Ib, count[b], Ib, c->act, 0, w->act + first[b] * I, Ib, pt);
    }
#pragma omp barrier
    for (int64_t b = 0; b < n; b++)
        rc |= linear(&m[b]->down, w->act + first[b] * I, m[b]->gate_up.n / 2, count[b], y + first[b] * H, pt);
#pragma omp barrier
    return rc;
}

/* y [M, H] = one MLP of rows h [M, H] (team_mlps). */
static int team_mlp(const Chain *c, const ChainMLP *m, const float *h, int64_t M, const Scratch *w, float *y, int pt) {
    const int64_t first = 0;
    return team_mlps(c, &m, 1, &first, &M, h, 0, w, y, pt);
}

/* r[idx[i]] += ye[i] * scale[i] for the gathered rows i = 0..rows-1 of a batch, in order: in expert
   order, each expert's rows in token order, so r gets the sums of one expert at a time. */
static void scatter_add(const Scratch *w, int64_t rows, int64_t H, float *r) {
    for (int64_t i = 0; i < rows; i++) {
        float *ri = r + w->idx[i] * H;
        const float *yi = w->ye + i * H;
        for (int64_t d = 0; d < H; d++) ri[d] += yi[d] * w->scale[i];
    }
}

/* team_moe for one token in a team: every thread routes the token itself (the same call on the
   same row, so the same experts and weights), and the routed experts' MLPs read the token's row h
   in place, so the two barriers around the first thread's routing and gathering are gone, and the
   other threads no longer wait for them (~11 us a layer of the synthetic MoE on that thread). The
   experts in ascending order, as team_moe batches them, and r gets the same sums in the same
   order. h: this thread's normed row (run_layers' own rows for a one-row step). */
static int team_moe_token(const Chain *c, const ChainMoE *e, const float *h, const Scratch *w, float *r, int pt, int lead) {
    const int64_t H = c->hidden, k = e->top_k;
    float wts[LOWBIT_MOE_BATCH];
    int64_t sel[LOWBIT_MOE_BATCH], first[LOWBIT_MOE_BATCH], count[LOWBIT_MOE_BATCH];
    const ChainMLP *mlps[LOWBIT_MOE_BATCH];
    float scale[LOWBIT_MOE_BATCH];
    int rc = ((moe_route_fn)c->moe_route)(h, H, 1, H, e->router, e->experts, k, e->norm_topk, wts, sel, 1);
    int64_t nb = 0;
    for (int64_t ex = 0; ex < e->experts && nb < k; ex++)
        for (int64_t q = 0; q < k; q++)
            if (sel[q] == ex) {
                first[nb] = nb, count[nb] = 1, mlps[nb] = e->expert + ex, scale[nb] = wts[q];
                nb++;
                break;
            }
    rc |= team_mlps(c, mlps, nb, first, count, h, 1, w, w->ye, pt);
    if (lead) {
        for (int64_t i = 0; i < H; i++) r[i] = 0.0f;
        for (int64_t b = 0; b < nb; b++) w->idx[b] = 0, w->scale[b] = scale[b];
        scatter_add(w, nb, H, r);
    }
#pragma omp barrier
    return rc;
}

/* r [M, H] = the MoE block of rows h, as SparseMoE.forward computes it: route each row (the C
   routing the model uses too), then per expert in order its rows gathered, its MLP, and
   r[row] += y * weight for each (a token's experts are distinct: one add per expert); then the
   shared expert, r = r + sigmoid(gate) * shared(h). In a team (pt a part, run_layers) the routing,
   the gathers and the scatter-adds run on part 0 alone, the scatter-adds in expert order (so r
   gets the same sums in the same order), each routed expert's MLP and the shared expert's as
   parts. The routed experts run in batches of up to w->cap rows: one gather for the batch, then its
   experts' MLPs phase by phase (team_mlps); so a decode step's k experts cost four barriers, not
   four each (the same calls on the same rows: the same bits). Every thread forms the batches from the routing (read after a barrier), so all
   meet the same barriers. Ends with a barrier. */
static int team_moe(const Chain *c, const ChainMoE *e, const float *h, int64_t M, const Scratch *w, float *r, int pt) {
    const int64_t H = c->hidden, k = e->top_k;
    const int lead = pt == 1 || -pt / LOWBIT_PART_LIMIT == 0; /* part 0, or the only thread */
    int rc = 0;
    if (M == 1 && pt < 0 && k <= LOWBIT_MOE_BATCH && !e->shared) return team_moe_token(c, e, h, w, r, pt, lead);
    if (lead) {
        rc |= ((moe_route_fn)c->moe_route)(h, H, M, H, e->router, e->experts, k, e->norm_topk, w->wts, w->sel, pt > 0 ? pt : 1);
        for (int64_t i = 0; i < M * H; i++) r[i] = 0.0f;
    }
#pragma omp barrier
    int64_t ex = 0;
    while (ex < e->experts) {
        /* the batch: the next experts with rows, each whole, in at most cap rows (an expert has at
           most M rows and cap >= M) */
        int64_t first[LOWBIT_MOE_BATCH], count[LOWBIT_MOE_BATCH];
        const ChainMLP *mlps[LOWBIT_MOE_BATCH];
        int64_t nb = 0, rows = 0;
        for (; ex < e->experts && nb < LOWBIT_MOE_BATCH; ex++) {
            int64_t n = 0;
            for (int64_t i = 0; i < M * k; i++) n += w->sel[i] == ex;
            if (n == 0) continue;
            if (rows + n > w->cap) break;
            if (lead) /* the expert's rows in token order, gathered after the batch's earlier rows */
                for (int64_t t = 0, j = rows; t < M; t++)
                    for (int64_t q = 0; q < k; q++)
                        if (w->sel[t * k + q] == ex) {
                            w->idx[j] = t;
                            w->scale[j] = w->wts[t * k + q];
                            memcpy(w->xe + j * H, h + t * H, (size_t)H * sizeof(float));
                            j++;
                        }
            first[nb] = rows, count[nb] = n, mlps[nb] = e->expert + ex;
            rows += n, nb++;
        }
        if (nb == 0) break; /* no expert left with rows */
#pragma omp barrier
        rc |= team_mlps(c, mlps, nb, first, count, w->xe, 0, w, w->ye, pt);
        if (lead) scatter_add(w, rows, H, r);
    }
    if (e->shared) {
        if (lead) rc |= ((moe_shared_gate_fn)c->moe_shared_gate)(h, H, M, H, e->shared_gate, w->sig);
        /* the shared MLP reads h and writes ye: the last batch's scatter (part 0) read ye */
#pragma omp barrier
        rc |= team_mlp(c, e->shared, h, M, w, w->ye, pt);
        if (lead)
            for (int64_t t = 0; t < M; t++)
                for (int64_t d = 0; d < H; d++) r[t * H + d] = r[t * H + d] + w->sig[t] * w->ye[t * H + d];
    }
#pragma omp barrier
    return rc;
}

/* lowbit_decode_layers' layers, each kernel called with pt: inside the step's one OpenMP region a
   part (LOWBIT_PART, lowbit_native.h), every thread calling every kernel and computing, without a
   region of its own, the share the kernel's own team would have given it, a barrier ending each
   phase; outside any region (one thread, or LOWBIT_CHAIN_TEAM=0) the thread count, each kernel then
   opening its own region, the barriers binding to no team and doing nothing. The same kernels,
   arguments and shares either way, so the same bits; what the one region saves is the region each
   of ~10 calls a layer opened and closed (1-2 us each on 2 cores). A kernel's failure (out of
   memory) is noted and the phases go on, so every thread meets every barrier. Returns the or of
   the kernels' codes (0 when all succeeded). */
static int run_layers(const Chain *c, const ChainStep *s, int64_t first, int64_t last, float *x, const float *final_norm,
                      float *out, const TeamBuffers *b, const float *const *cs, const float *const *sn, int pt) {
    const int64_t M = s->rows, H = c->hidden, D = c->head_dim;
    const int64_t qs = c->heads * D, kvs = c->kv_heads * D, qkv_n = qs + 2 * kvs;
    const rmsnorm_fn rmsnorm = (rmsnorm_fn)c->rmsnorm;
    const add_rmsnorm_fn add_rmsnorm = (add_rmsnorm_fn)c->add_rmsnorm;
    const paged_decode_fn paged_write = (paged_decode_fn)c->paged_write, paged_attend = (paged_decode_fn)c->paged_attend;
    int rc = 0; /* this thread's kernels' codes, or-ed (0 when all succeeded) */
    const float *pending_norm = NULL;
    /* Fewer rows than threads (a decode step of one sequence): every thread computes each norm of
       the rows whole, on its own (the first into the step's buffers, the others into their own),
       rather than the share a part call gives it, which was all of it for one thread while the
       others waited; the next matmul then reads each thread's own rows with no barrier between.
       The residual's sums go to x and xalt in turn (by the first thread), so that no thread
       writes what another may still read. The same arithmetic on the same rows: the same bits. */
    const int parts = pt < 0 ? -pt % LOWBIT_PART_LIMIT : 1, id = pt < 0 ? -pt / LOWBIT_PART_LIMIT : 0;
    const int solo = parts > 1 && M < parts;
    float *h = solo && id > 0 ? b->own + (id - 1) * 2 * M * H : b->h; /* this thread's normed rows */
    float *mine = h + M * H;                                            /* a helper's sums (solo) */
    float *xc = x;                                                      /* the residual now */
#define RESIDUAL_NORM(r_, r_w, w_)                                                                                        \
    do {                                                                                                                \
        float *next = !solo ? x : id > 0 ? mine : xc == x ? b->xalt : x;                                                \
        rc |= add_rmsnorm(xc, H, r_, H, r_w, M, H, w_, c->eps, c->unit_offset, 0, next, H, h, H, solo ? 1 : pt);       \
        if (solo) xc = xc == x ? b->xalt : x;                                                                           \
    } while (0)
    for (int64_t i = first; i < last; i++) {
        const ChainLayer *L = c->layers + i;
        if (i == first) rc |= rmsnorm(xc, H, M, 1, H, L->norm_in, c->eps, c->unit_offset, 0, h, H, solo ? 1 : pt);
        else RESIDUAL_NORM(b->r, pending_norm, L->norm_in);
        if (!solo) {
#pragma omp barrier
        }
        rc |= linear(&L->qkv, h, H, M, b->qkv, pt);
#pragma omp barrier
        const float *q = b->qkv, *k = b->qkv + qs;
        int64_t ldq = qkv_n, ldk = qkv_n;
        if (L->q_norm) {
            rc |= rmsnorm(b->qkv, qkv_n, M, qs / L->q_norm_width, L->q_norm_width, L->q_norm, c->eps, c->unit_offset, 0, b->qn,
                          qs, pt);
            q = b->qn, ldq = qs;
        }
        if (L->k_norm) {
            rc |= rmsnorm(b->qkv + qs, qkv_n, M, kvs / L->k_norm_width, L->k_norm_width, L->k_norm, c->eps, c->unit_offset, 0,
                          b->kn, kvs, pt);
            k = b->kn, ldk = kvs;
        }
        if (L->q_norm || L->k_norm) {
#pragma omp barrier
        }
        const int dtype = c->pool_bf16 ? 2 : 0;
        rc |= paged_write(q, ldq, k, ldk, b->qkv + qs + kvs, qkv_n, cs[L->rope], sn[L->rope], dtype, s->pos, s->slots, s->items,
                          s->tables, s->nb, L->kpool, L->vpool, b->att, M, c->heads, c->kv_heads, D, c->block_size, L->window,
                          c->scale, pt);
#pragma omp barrier
        rc |= paged_attend(q, ldq, k, ldk, b->qkv + qs + kvs, qkv_n, cs[L->rope], sn[L->rope], dtype, s->pos, s->slots,
                           s->items, s->tables, s->nb, L->kpool, L->vpool, b->att, M, c->heads, c->kv_heads, D, c->block_size,
                           L->window, c->scale, pt);
#pragma omp barrier
        rc |= linear(&L->o, b->att, qs, M, b->a, pt);
#pragma omp barrier
        RESIDUAL_NORM(b->a, L->post_attn, L->norm_mlp);
        if (!solo) {
#pragma omp barrier
        }
        /* (a MoE block routes and gathers on the first thread, from its rows: b->h) */
        if (L->moe) rc |= team_moe(c, L->moe, M == 1 && solo ? h : b->h, M, b->w, b->r, pt);
        else rc |= team_mlp(c, &L->mlp, h, M, b->w, b->r, pt);
        pending_norm = L->post_ffn;
    }
#undef RESIDUAL_NORM
    if (solo && id > 0) return rc; /* the last sum and norm: the first thread's, into x and out */
    const int last_pt = solo ? 1 : pt;
    if (final_norm) rc |= add_rmsnorm(xc, H, b->r, H, pending_norm, M, H, final_norm, c->eps, c->unit_offset, 0, x, H, out, H, last_pt);
    else rc |= add_rmsnorm(xc, H, b->r, H, pending_norm, M, H, NULL, c->eps, c->unit_offset, 0, x, H, NULL, H, last_pt);
    return rc;
}

/* Layers first..last-1 on x [rows, hidden] (float32, updated in place). With final_norm, out gets
   final_norm(x + r) and x keeps x + r; without, x gets x + r and out is untouched. Returns 0, -1
   for a malformed chain, -3 when out of memory, else the failing kernel's code. */
int lowbit_decode_layers(const Chain *c, const ChainStep *s, int64_t first, int64_t last, float *x, const float *final_norm,
                         float *out, int threads) {
    const int64_t M = s->rows, H = c->hidden, D = c->head_dim;
    const int64_t qs = c->heads * D, kvs = c->kv_heads * D, qkv_n = qs + 2 * kvs, I = c->inter;
    if (M <= 0 || first < 0 || last > c->n_layers || first >= last || (c->max_top_k && M > LOWBIT_MAX_ROWS_MOE)) return -1;
    const int64_t kk = c->max_top_k > 0 ? c->max_top_k : 1;
    float *h = rows_buffer(M, H), *qkv = rows_buffer(M, qkv_n), *att = rows_buffer(M, qs), *a = rows_buffer(M, H);
    float *r = rows_buffer(M, H), *qn = rows_buffer(M, qs), *kn = rows_buffer(M, kvs);
    /* run_layers' solo steps (fewer rows than threads) only */
    const int few = threads > 1 && M < threads;
    float *xalt = few ? rows_buffer(M, H) : NULL, *own = few ? rows_buffer(M * 2 * (threads - 1), H) : NULL;
    const int64_t cap = c->max_top_k > 0 && M * kk <= LOWBIT_MOE_BATCH_ROWS ? M * kk : M;
    Scratch w = {rows_buffer(cap, 2 * I), rows_buffer(cap, I), rows_buffer(cap, H), rows_buffer(cap, H),
                 malloc((size_t)(M * kk) * sizeof(float)), malloc((size_t)M * sizeof(float)),
                 malloc((size_t)(M * kk) * sizeof(int64_t)), malloc((size_t)cap * sizeof(int64_t)),
                 malloc((size_t)cap * sizeof(float)), cap};
    const int64_t half = D / 2;
    float *ropes = malloc((size_t)(MAX_ROPES * 2 * M * half) * sizeof(float));
    const float *cs[MAX_ROPES], *sn[MAX_ROPES];
    int rc = -3;
    if (!h || !qkv || !att || !a || !r || !qn || !kn || (few && (!xalt || !own)) || !ropes || !w.gu || !w.act || !w.xe || !w.ye || !w.wts || !w.sig || !w.sel
        || !w.idx || !w.scale)
        goto done;
    rc = -1;
    for (int ri = 0; ri < MAX_ROPES; ri++) {
        cs[ri] = sn[ri] = NULL;
        if (!s->cos_table[ri] || !s->sin_table[ri]) continue;
        float *c0 = ropes + (2 * ri) * M * half, *s0 = ropes + (2 * ri + 1) * M * half;
        for (int64_t t = 0; t < M; t++) {
            if (s->pos[t] < 0 || s->pos[t] >= s->table_rows) goto done;
            memcpy(c0 + t * half, s->cos_table[ri] + s->pos[t] * half, (size_t)half * sizeof(float));
            memcpy(s0 + t * half, s->sin_table[ri] + s->pos[t] * half, (size_t)half * sizeof(float));
        }
        cs[ri] = c0, sn[ri] = s0;
    }
    if (s->ids) {
        if (s->embed_scales && (s->embed_group <= 0 || s->embed_scale_dtype < 0 || s->embed_scale_dtype > 2
                                || (s->embed_bits != 8 && s->embed_bits != 4)))
            goto done;
        for (int64_t t = 0; t < M; t++) {
            const int64_t id = s->ids[t];
            if (id < 0 || id >= s->embed_rows) goto done;
            if (s->embed_scales) {
                const int64_t g = s->embed_group, groups = (H + g - 1) / g, width = s->embed_bits == 8 ? H : (H + 1) / 2;
                const uint8_t *q = (const uint8_t *)s->embed + id * width;
                const float mid = s->embed_bits == 8 ? 128.0f : 8.0f;
                for (int64_t d = 0; d < H; d++) {
                    const int code = s->embed_bits == 8 ? (int)(int8_t)q[d] + 128 : (q[d / 2] >> (4 * (d & 1))) & 15;
                    const float zero = s->embed_zeros ? (float)s->embed_zeros[id * groups + d / g] : mid;
                    const float v = ((float)code - zero) * embed_scale_at(s, id * groups + d / g);
                    x[t * H + d] = v * s->embed_scale;
                }
            } else {
                for (int64_t d = 0; d < H; d++) x[t * H + d] = lowbit_load(s->embed, id * H + d, s->embed_bf16) * s->embed_scale;
            }
        }
    }
    for (int64_t i = first; i < last; i++) {
        const ChainLayer *L = c->layers + i;
        if (L->qkv.n != qkv_n || (!L->moe && L->mlp.gate_up.n > 2 * I) || (L->moe && (L->moe->top_k > kk || !c->moe_route))
            || L->rope < 0 || L->rope >= MAX_ROPES || !cs[L->rope]
            || (L->q_norm && (L->q_norm_width <= 0 || qs % L->q_norm_width)) || (L->k_norm && (L->k_norm_width <= 0 || kvs % L->k_norm_width))
            || !c->paged_write || !c->paged_attend)
            goto done; /* rc is -1 */
    }
    const TeamBuffers b = {h, qkv, att, a, r, qn, kn, &w, xalt, own};
    if (c->team && threads > 1) {
        int failed = 0;
#pragma omp parallel num_threads(threads)
        {
            const int parts = omp_get_num_threads();
            const int code = run_layers(c, s, first, last, x, final_norm, out, &b, cs, sn,
                                        parts > 1 ? LOWBIT_PART(omp_get_thread_num(), parts) : 1);
            if (code) {
#pragma omp atomic write
                failed = code;
            }
        }
        rc = failed;
    } else {
        rc = run_layers(c, s, first, last, x, final_norm, out, &b, cs, sn, threads);
    }
done:
    free(ropes);
    free(qn);
    free(kn);
    free(h);
    free(qkv);
    free(att);
    free(a);
    free(r);
    free(xalt);
    free(own);
    free(w.gu);
    free(w.act);
    free(w.xe);
    free(w.ye);
    free(w.wts);
    free(w.sig);
    free(w.sel);
    free(w.idx);
    free(w.scale);
    return rc;
}

/* ---- A dense head's greedy argmax through its int8 copy ----------------------------------------
   A several-step greedy call needs each row's argmax of the head's logits, not the logits. A
   dense bf16 head (SmolLM2's 49152 x 576, Gemma-3's 262144 x 640, tied embeddings) is read whole
   for it every step; its int8 copy in groups of 32 (int4_vnni.c's 8-bit codes, made by
   lowbit_i4v_screen8) is 0.56 of the bytes and runs on the int8-activation kernel. The copy's
   logit a_v and the head's own e_v differ by at most (Cauchy-Schwarz on x.(W - W^) and
   (x - x^).W^, then each kernel's float32 sums)
       B_v = X2 err2_v + (D2 + gamma (2 X2 + D2)) norm2_v,
   X2 = ||x|| (x as the head's kernel rounds it: bf16 for the bf16 kernels), D2 = ||x - x^|| (x^ the
   int8 rounding the copy's kernel makes of each group of 32), err2_v >= ||W_v - W^_v||, norm2_v >=
   max(||W_v||, ||W^_v||), gamma = (K + G + 48) 2^-23 for the sums' rounding. So a v whose e_v is
   the largest has a_v + B_v >= max_u (a_u - B_u): the candidates. The copy's matmul screens its
   logits tile by tile as it makes them (lowbit_i4v_screen_matmul, LowbitScreen in lowbit_native.h:
   a running lower bound of the best and the tiles that reach it), so the [M, V] logits are neither
   written nor read back (Gemma-3 at 16 rows: 17 MB written and read twice a step had cost ~1.5 ms);
   the candidates go through the head's own kernel one weight row each (a logit's arithmetic does
   not depend on the rows beside it: f32_dot.c), and the first largest of those exact logits is the
   head's argmax, ties included: every index holding the largest logit is a candidate. Candidates
   per row on real hidden states: SmolLM2 13 median, 39 mean, 620 at most over 300 positions;
   Gemma-3 7, 13, 157 (the x rounding's D2 term dominates B; rounding x and the copy per 64 instead
   of 32 gave SmolLM2 77, 324, 4500, per 192 1793 median: the copy's float step per group saved is
   worth far less than rescoring those). */

#define SCREEN_BLOCK 16        /* head rows a record covers (one tile of the copy's logits) */
/* tiles recorded per row and thread; candidates per row: 16 times that, beyond which the step reads
   the whole head */
#define SCREEN_MAX_BLOCKS 2048
/* Rows one screen pass takes; a step of more screens them in passes of this many (each pass reads
   the copy again: compute-bound from 16 rows on, so that costs little). The head alone (C calls,
   real hidden states, 2 Zen 4 cores, alternated) took SmolLM2 0.67x, 0.57x and 0.80x the whole
   head's time at 1, 8 and 16 rows, Gemma-3 0.73x, 0.62x, 0.71x; at 16 / 32 / 64 rows (2026-12-06,
   the same tokens at every position) SmolLM2 0.72x / 0.72x / 0.68x, Gemma-3 0.68x / 0.49x / 0.51x
   (its whole head at 64 rows 99.5 ms, screened 51.1). Where the screen had stopped at 16 rows, 17
   or more read the whole head. */
#define SCREEN_MAX_ROWS 64
#define SCREEN_MAX_PARTS 64 /* threads the screen's matmul runs on (more: the first 64) */

typedef struct {
    ChainLinear approx;        /* the int8 copy (8-bit codes; its w, an I4VWeight, is what screen_fn reads) */
    const float *err2, *norm2; /* [V] */
    int32_t x_bf16;            /* the head's kernel rounds x to bf16 first (lowbit_bf16xw / bf16pxw) */
    int32_t w_bytes;           /* bytes of one head weight: 2 (bf16) or 4 (float32) */
    int64_t group;             /* x's rounding group in the copy's kernel (32) */
    const void *screen_fn;     /* int4_vnni.c lowbit_i4v_screen_matmul */
} ChainScreen;
typedef int (*screen_matmul_fn)(const void *w, const float *x, int64_t M, LowbitScreen *s, int threads);

/* A float32 at least v (v >= 0). */
static float up_float(double v) {
    float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

/* Row x's X2 and C = D2 + gamma (2 X2 + D2), each inflated by 2^-20 and rounded up, and an absolute
   slack for the bf16 kernel's flushing of subnormal inputs and products (below 2^-126 each); -1
   when x holds NaN or inf. x^ is int4_vnni.c quantize_row's: per group, amax = max|x|,
   a = rint(x * (127 / amax)) in float32, x^ = a * (amax / 127). */
static int screen_row(const ChainScreen *s, const float *x, int64_t K, float *x2f, float *cf, float *tiny) {
    double x2 = 0.0, d2 = 0.0;
    for (int64_t j = 0; j < K; j += s->group) {
        const int64_t end = j + s->group < K ? j + s->group : K;
        float amax = 0.0f;
        for (int64_t k = j; k < end; k++) {
            if (!isfinite(x[k])) return -1;
            amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, sx = amax / 127.0f;
        for (int64_t k = j; k < end; k++) {
            const double xb = s->x_bf16 ? (double)lowbit_bf16_round(x[k]) : (double)x[k];
            const double dx = xb - (double)rintf(x[k] * inv) * (double)sx;
            x2 += xb * xb;
            d2 += dx * dx;
        }
    }
    const double X2 = sqrt(x2) * (1.0 + 1e-12), D2 = sqrt(d2) * (1.0 + 1e-12);
    const double gamma = (double)(K + K / s->group + 48) * 0x1p-23;
    *x2f = up_float(X2 * (1.0 + 0x1p-20));
    *cf = up_float((D2 + gamma * (2.0 * X2 + D2)) * (1.0 + 0x1p-20) + (double)K * 0x1p-125);
    *tiny = up_float((X2 * sqrt((double)K) + (double)K) * 0x1p-125);
    return 0;
}

typedef struct {
    const ChainLinear *head;
    const ChainScreen *s;
    const float *x;
    int64_t K;
    const int32_t *ids;   /* row r's candidates (ascending) from ids + r * stride */
    int64_t stride;
    const int64_t *count; /* [M] */
    int64_t *tokens;
} RescoreArgs;

/* A buffer of this thread's that only grows (slot 0: gathered head rows, 1: recorded tiles, 2: their
   upper bounds, 3: candidates, 4: every tile's largest upper bound), so a
   step neither maps fresh pages for it (glibc maps blocks past 128 KB anew, each page then faulting
   in) nor frees it; NULL when it cannot grow. */
static void *grown(int slot, size_t bytes) {
    static __thread void *buf[5];
    static __thread size_t cap[5];
    if (bytes > cap[slot]) {
        void *p = malloc(bytes);
        if (!p) return NULL;
        free(buf[slot]);
        buf[slot] = p, cap[slot] = bytes;
    }
    return buf[slot];
}

#define GATHER_ROWS 512 /* head rows a rescoring call takes */

/* The head's logits at x of the `have` weight rows gathered in `rows` (K apart), ids their indices
   (ascending), folded into the row's running first largest (*best, *arg; a strict >, so the first
   index among equal logits stays): one part call on this thread (no region of its own), the same
   arithmetic per logit as the whole head's call. */
static int rescore_rows(const ChainLinear *head, const char *rows, const int64_t *ids, int64_t have, const float *x,
                        int64_t K, float *best, int64_t *arg) {
    ChainLinear view = *head;
    view.w = rows, view.n = have, view.ldw = K;
    view.packed = NULL, view.packed_fn = NULL; /* the packed copy's bits are the unpacked weight's */
    float y[GATHER_ROWS];
    const int rc = linear(&view, x, K, 1, y, LOWBIT_PART(0, 1));
    for (int64_t j = 0; j < have && !rc; j++)
        if (y[j] > *best) *best = y[j], *arg = ids[j];
    return rc;
}

/* Row r's candidates through the head's own kernel, GATHER_ROWS at a time (their weight rows copied
   together: one call each), and its first largest logit into tokens[r]; nonzero when none is finite
   or a kernel fails. Each logit's arithmetic is its own (f32_dot.c: one accumulator and one fixed
   horizontal sum per output), so the rows around it in a call change none of its bits. */
static int rescore_row(const RescoreArgs *a, int64_t r) {
    const int64_t K = a->K, wb = a->s->w_bytes, row_bytes = K * wb;
    char *rows = grown(0, (size_t)(GATHER_ROWS * row_bytes));
    if (!rows) return 1;
    const float *x = a->x + r * K;
    const int32_t *cand = a->ids + r * a->stride;
    float best = -INFINITY;
    int64_t ids[GATHER_ROWS], arg = -1, have = 0;
    int rc = 0;
    for (int64_t i = 0; i < a->count[r] && !rc; i++) {
        const int64_t n = cand[i];
        memcpy(rows + have * row_bytes, (const char *)a->head->w + n * a->head->ldw * wb, (size_t)row_bytes);
        ids[have++] = n;
        if (have == GATHER_ROWS || i + 1 == a->count[r]) {
            rc = rescore_rows(a->head, rows, ids, have, x, K, &best, &arg);
            have = 0;
        }
    }
    if (rc || arg < 0 || !isfinite(best)) return 1;
    a->tokens[r] = arg;
    return 0;
}

/* Each row's greedy argmax of `head` (dense, no bias) at x [M, K], M <= SCREEN_MAX_ROWS, into tokens, through screen `s`:
   the copy's matmul screens its logits as it makes them (lowbit_i4v_screen_matmul: each part's
   lower bound of the best logit and its recorded tiles), the records below the rows' final bounds
   are dropped, and the rest go through the head's own kernel. 0; 1 where the screen cannot decide (x
   or the copy's logits not finite, too many candidates: the caller runs the whole head); else a
   kernel's code. */
static int screen_pass(const ChainLinear *head, const ChainScreen *s, const float *x, int64_t M, int64_t *tokens,
                       int threads) {
    const int64_t V = head->n, K = head->k, cap = SCREEN_MAX_BLOCKS;
    float rowv[3 * SCREEN_MAX_ROWS];
    float *x2f = rowv, *cf = rowv + M, *tiny = rowv + 2 * M;
    for (int64_t r = 0; r < M; r++)
        if (screen_row(s, x + r * K, K, &x2f[r], &cf[r], &tiny[r])) return 1;
    /* per part and row: lo, count, over; the records and the tiles' upper bounds (grown: kept
       between steps, never mapped afresh) */
    float lo[SCREEN_MAX_PARTS * SCREEN_MAX_ROWS];
    int64_t count[SCREEN_MAX_PARTS * SCREEN_MAX_ROWS];
    int32_t over[SCREEN_MAX_PARTS * SCREEN_MAX_ROWS], fail[SCREEN_MAX_PARTS];
    const int parts = threads < SCREEN_MAX_PARTS ? threads : SCREEN_MAX_PARTS;
    const int64_t tiles = (V + SCREEN_BLOCK - 1) / SCREEN_BLOCK;
    int32_t *recorded = grown(1, (size_t)(parts * M * cap) * sizeof(int32_t));
    float *upper = grown(2, (size_t)(parts * M * cap * SCREEN_BLOCK) * sizeof(float));
    float *tile_up = grown(4, (size_t)(M * tiles) * sizeof(float));
    if (!recorded || !upper || !tile_up) return -2;
    LowbitScreen scr = {s->err2, s->norm2, x2f, cf, tiny, M, cap, lo, recorded, upper, count, over, tile_up, fail, 0};
    int rc = ((screen_matmul_fn)s->screen_fn)(s->approx.w, x, M, &scr, parts);
    if (rc) return rc == -2 ? -2 : 1;
    for (int p = 0; p < scr.parts; p++)
        if (fail[p]) return 1;
    /* each row's candidates, in order (parts hold ascending runs of tiles): the entries of its records
       whose upper bounds reach its final lower bound, or where a part ran out of records, every entry
       of the part's tiles whose largest upper bound does; past `stride` of them, the whole head */
    const int64_t stride = SCREEN_MAX_BLOCKS * SCREEN_BLOCK;
    int32_t *ids = grown(3, (size_t)(M * stride) * sizeof(int32_t));
    if (!ids) return -2;
    int64_t n_ids[SCREEN_MAX_ROWS];
    for (int64_t r = 0; r < M; r++) {
        float thr = -INFINITY;
        for (int p = 0; p < scr.parts; p++) thr = lo[p * M + r] > thr ? lo[p * M + r] : thr;
        thr -= tiny[r];
        if (!(thr > -INFINITY)) return 1; /* no finite bound (a weight's table not finite) */
        int32_t *out = ids + r * stride;
        int64_t n = 0;
        for (int p = 0; p < scr.parts; p++) {
            const int64_t pr = p * M + r;
            if (over[pr]) { /* the part's tiles, as lowbit_thread_share gave them to it */
                int64_t t0, t1;
                lowbit_share(tiles, p, scr.parts, &t0, &t1);
                for (int64_t t = t0; t < t1; t++) {
                    if (!(tile_up[r * tiles + t] >= thr)) continue;
                    if (n + SCREEN_BLOCK > stride) return 1;
                    for (int64_t v = t * SCREEN_BLOCK; v < (t + 1) * SCREEN_BLOCK && v < V; v++) out[n++] = (int32_t)v;
                }
                continue;
            }
            for (int64_t i = 0; i < count[pr]; i++) {
                const float *u = upper + (pr * cap + i) * SCREEN_BLOCK;
                if (n + SCREEN_BLOCK > stride) return 1;
                for (int l = 0; l < SCREEN_BLOCK; l++)
                    if (u[l] >= thr) out[n++] = recorded[pr * cap + i] * SCREEN_BLOCK + l;
            }
        }
        n_ids[r] = n;
    }
    /* the exact logits of each row's candidates, and the first largest */
    const RescoreArgs args = {head, s, x, K, ids, stride, n_ids, tokens};
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic) if (M > 1 && threads > 1) reduction(| : failed)
    for (int64_t r = 0; r < M; r++) failed |= rescore_row(&args, r);
    return failed;
}

/* screen_pass over M rows in passes of up to SCREEN_MAX_ROWS; 1 as soon as one pass cannot decide
   (the caller reads the whole head for every row). */
static int screened_argmax(const ChainLinear *head, const ChainScreen *s, const float *x, int64_t M, int64_t *tokens,
                           int threads) {
    if (head->kind != LINEAR_DENSE || head->bias || s->approx.n != head->n || s->approx.k != head->k || M <= 0 ||
        !s->screen_fn || threads < 1)
        return 1;
    for (int64_t r0 = 0; r0 < M; r0 += SCREEN_MAX_ROWS) {
        const int64_t rows = M - r0 < SCREEN_MAX_ROWS ? M - r0 : SCREEN_MAX_ROWS;
        const int rc = screen_pass(head, s, x + r0 * head->k, rows, tokens + r0, threads);
        if (rc) return rc;
    }
    return 0;
}

/* screen_row's three numbers for row x [K] into out (tests hold them against the formula); -1 for x
   that is not finite. */
int lowbit_screen_row(const ChainScreen *s, const float *x, int64_t K, float *out) {
    return screen_row(s, x, K, &out[0], &out[1], &out[2]);
}

/* screened_argmax on its own (kernels/screened_head.py: tests and measurements). */
int lowbit_screened_argmax(const ChainLinear *head, const ChainScreen *s, const float *x, int64_t M,
                           int64_t *tokens, int threads) {
    return screened_argmax(head, s, x, M, tokens, threads);
}

/* A draft's head whose quantized logits' `top` best per row get the float head's values (rowops.c
lowbit_top_rows and lowbit_rescore_rows, as runtime/engine/draft_models.py RescoredHead calls them),
   over `vocab`'s tokens: the chosen index is then vocab[index]. */
typedef struct {
    const void *top_rows, *rescore_rows;
    const void *exact;    /* the float head [vocab size, K], float32 or bf16 (exact_bf16) */
    int32_t exact_bf16, pad;
    const int64_t *vocab; /* the quantized head's rows' token ids (ascending), or NULL: every token */
    const float *bias;    /* [vocab size] or NULL */
    int64_t top;
} ChainRescore;

/* n greedy decode steps of the same M rows in one call: step i embeds ids (step 0: first->ids,
   then the tokens step i - 1 chose), runs every layer and the final norm at positions pos[i * M ..]
   and KV slots slots[i * M ..] (the rows' items and block tables stay first's), then the head
   (`head`, as the runner's lm_head runs it: the same kernel, so the same logits) into logits
   [M, vocab] and each row's first largest logit (rowops.c lowbit_logit_rows, the engine's greedy
   argmax) into tokens[i * M ..]. Why: a step's Python between the C calls (scheduling, metadata,
   sampling, bookkeeping) cost ~0.3 ms of a ~3.4 ms SmolLM2 int4 token, its code and data cold
   after each token's weights streamed through the caches; the engine takes n tokens at once where
   nothing but greedy argmax would happen between them (runtime/engine/multi_step.py).
   With `screen`, a dense head's argmax goes through its int8 copy (screened_argmax: the same tokens);
   with `rescore`, a draft's quantized head has its best candidates rescored first (ChainRescore).
   x, hidden: [M, hidden] scratch. Returns 0; -5 with *done = i when step i's logits hold NaN or
   inf (tokens from step i on unset); else lowbit_decode_layers' or the head kernel's code. */
int lowbit_decode_steps(const Chain *c, const ChainStep *first, const ChainLinear *head, const ChainScreen *screen,
                        const ChainRescore *rescore, const void *logit_rows, int64_t n, const int64_t *pos,
                        const int64_t *slots, int64_t *tokens, const float *final_norm, float *x, float *hidden,
                        float *logits, int64_t *done, int threads) {
    const int64_t M = first->rows, V = head->n;
    *done = 0;
    if (n <= 0 || !first->ids || !first->embed || !logit_rows || head->k != c->hidden) return -1;
    int64_t *top = rescore ? malloc((size_t)(M * rescore->top) * sizeof(int64_t)) : NULL;
    if (rescore && !top) return -2;
    ChainStep s = *first;
    int rc = 0;
    for (int64_t i = 0; i < n && !rc; i++) {
        s.pos = pos + i * M;
        s.slots = slots + i * M;
        if (i > 0) s.ids = tokens + (i - 1) * M;
        rc = lowbit_decode_layers(c, &s, 0, c->n_layers, x, final_norm, hidden, threads);
        if (rc) break;
        rc = screen ? screened_argmax(head, screen, hidden, M, tokens + i * M, threads) : 1;
        if (rc == 1) { /* no screen, or it could not decide: the whole head */
            rc = linear(head, hidden, c->hidden, M, logits, threads);
            if (rc) break;
            /* a rescored head with fewer than `top` logits that are not NaN, or NaN or inf logits:
               step i's tokens unset (a draft's caller goes on step by step, the engine's refuses) */
            if ((rescore && (((top_rows_fn)rescore->top_rows)(logits, V, M, V, rescore->top, top) ||
                             ((rescore_rows_fn)rescore->rescore_rows)(logits, V, M, top, rescore->top, rescore->vocab,
                                                                      rescore->exact, rescore->exact_bf16, c->hidden,
                                                                      hidden, c->hidden, rescore->bias))) ||
                ((logit_rows_fn)logit_rows)(logits, V, M, V, tokens + i * M, threads)) {
                rc = -5;
                break;
            }
            if (rescore && rescore->vocab)
                for (int64_t r = 0; r < M; r++) tokens[i * M + r] = rescore->vocab[tokens[i * M + r]];
        } else if (rc) {
            break;
        }
        *done = i + 1;
    }
    free(top);
    return rc;
}

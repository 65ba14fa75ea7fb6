/* GPTQ's column loop over one block of columns, for integer grids (compress/gptq.py `_integer_loop`,
   lowbit_gptq_int_block) and for element grids (`_grid_loop`, lowbit_gptq_grid_block: minifloats
   and NF4, whose element quantizer is a table lookup; see the end of this file).

   In Python the loop costs a few torch calls per column (their fixed cost dominates at a 135M
   model's sizes) for very little arithmetic; here a block of up to 128 columns is one call.

   Layout: every [B, N] array is B visited columns of N stacked weight rows, row stride N (the
   column-major working copies of compress/gptq.py). For column i of the block and every row n:
       t      = clamp(round_half_even(x / divisor), lo, hi)
       value  = t * scale
       err    = (x - value) / u[i][i]
       x[r]   = fma(-u[i][r], err, x[r])  for the block's later columns r > i
   the operations of the torch loop (quant/gptq.int_block_torch) in float32, built in ISO C mode
   without -ffast-math so that nothing else is contracted. torch's addr_ fuses the update in its
   vector body but not in its scalar tails (the last n mod 16 weight rows on AVX-512, and the last
   rows of each of its threads' shares), so the two agree bit for bit but there, where they may
   differ by a rounding (tested: under 1 % of the elements). Weight rows never interact, so
   threads split them; each row's arithmetic does not depend on the split.

   lo/hi: arrays [B, N] (asymmetric: -zero and top - zero), or NULL to use lo_s/hi_s for all.
   keep/kept (outliers, or NULL): where keep is set the weight is held in bf16 instead of coded,
   t = 0 (its code stands for 0), value = 0, kept = bf16(x) and err = (x - kept) / u[i][i];
   elsewhere kept = 0. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lowbit_native.h"

#define ROWS_PER_TASK 256

/* x rounded to bfloat16 (nearest, ties to even) and back, as torch's x.to(bfloat16).float();
   NaN stays NaN (the very same NaN). */
static inline float bf16_round(float x) { return isnan(x) ? x : lowbit_bf16_round(x); }

/* One call's arrays (see the entry points below). */
typedef struct {
    float *block;
    int64_t b, n, ldu;
    const float *u, *divisor, *scale;
    const float *lo, *hi; /* integer grid: per-element bounds, or NULL for lo_s / hi_s */
    float lo_s, hi_s;
    int64_t g; /* element grid: g values, g - 1 midpoints */
    const double *mids;
    const uint8_t *tie_up;
    const float *grid;
    const uint8_t *grid_codes;
    int sign_bit;
    float *ints;    /* integer grid: the integers */
    uint8_t *codes; /* element grid: the codes */
    float *values, *errors;
    const uint8_t *keep;
    float *kept;
} Block;

/* Column i's scaled errors e fed into the block's later columns r > i, rows n0..n1. */
static inline void update_later_columns(const Block *a, int64_t i, const float *e, int64_t n0, int64_t n1) {
    for (int64_t r = i + 1; r < a->b; r++) {
        const float c = a->u[i * a->ldu + r];
        float *y = a->block + r * a->n;
        for (int64_t k = n0; k < n1; k++) y[k] = fmaf(-c, e[k], y[k]);
    }
}

/* Column i of an integer grid, rows n0..n1. */
static void int_column(const Block *a, int64_t i, int64_t n0, int64_t n1) {
    const int64_t n = a->n;
    float *x = a->block + i * n;
    float *t = a->ints + i * n, *v = a->values + i * n, *e = a->errors + i * n;
    const float *d = a->divisor + i * n, *s = a->scale + i * n;
    const float diag = a->u[i * a->ldu + i];
    if (a->lo) {
        const float *l = a->lo + i * n, *h = a->hi + i * n;
        for (int64_t k = n0; k < n1; k++) {
            float q = nearbyintf(x[k] / d[k]);
            q = q < l[k] ? l[k] : q;
            q = q > h[k] ? h[k] : q;
            t[k] = q;
            v[k] = q * s[k];
            e[k] = (x[k] - v[k]) / diag;
        }
    } else {
        const float lo_s = a->lo_s, hi_s = a->hi_s;
        for (int64_t k = n0; k < n1; k++) {
            float q = nearbyintf(x[k] / d[k]);
            q = q < lo_s ? lo_s : q;
            q = q > hi_s ? hi_s : q;
            t[k] = q;
            v[k] = q * s[k];
            e[k] = (x[k] - v[k]) / diag;
        }
    }
    if (a->keep) {
        const uint8_t *m = a->keep + i * n;
        float *kp = a->kept + i * n;
        for (int64_t k = n0; k < n1; k++) {
            if (m[k]) {
                kp[k] = bf16_round(x[k]);
                t[k] = 0.0f;
                v[k] = 0.0f;
                e[k] = (x[k] - kp[k]) / diag;
            } else {
                kp[k] = 0.0f;
            }
        }
    }
}

/* Column i of an element grid, rows n0..n1 (see lowbit_gptq_grid_block). */
static void grid_column(const Block *a, int64_t i, int64_t n0, int64_t n1) {
    const int64_t n = a->n, g = a->g;
    const double *mids = a->mids;
    const int sign_bit = a->sign_bit;
    const float *x = a->block + i * n, *d = a->divisor + i * n, *s = a->scale + i * n;
    const uint8_t *m = a->keep ? a->keep + i * n : 0;
    uint8_t *c = a->codes + i * n;
    float *v = a->values + i * n, *e = a->errors + i * n, *kp = a->kept ? a->kept + i * n : 0;
    const float diag = a->u[i * a->ldu + i];
    for (int64_t k = n0; k < n1; k++) {
        const int held = m && m[k];
        const float r = held ? 0.0f : x[k] / d[k];  /* a kept weight's code stands for +0 */
        const double abs_r = sign_bit ? fabs((double)r) : (double)r;
        int64_t lo = 0, hi = g - 1;  /* lo = how many midpoints lie below abs_r */
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (mids[mid] < abs_r) lo = mid + 1;
            else hi = mid;
        }
        if (lo < g - 1 && abs_r == mids[lo] && a->tie_up[lo]) lo++;
        float value = a->grid[lo];
        uint8_t code = a->grid_codes[lo];
        if (sign_bit && signbit(r)) {
            value = -value;
            code |= (uint8_t)sign_bit;
        }
        c[k] = code;
        if (held) {
            kp[k] = bf16_round(x[k]);
            v[k] = 0.0f;
            e[k] = (x[k] - kp[k]) / diag;
        } else {
            if (kp) kp[k] = 0.0f;
            v[k] = value * s[k];
            e[k] = (x[k] - v[k]) / diag;
        }
    }
}

/* Tasks lo..hi-1 (ROWS_PER_TASK weight rows each) through the block's columns in order: each
   column quantized, then its errors fed into the later columns. */
static inline void run_tasks(const Block *a, int64_t lo, int64_t hi, void (*column)(const Block *, int64_t, int64_t, int64_t)) {
    for (int64_t task = lo; task < hi; task++) {
        const int64_t n0 = task * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < a->n ? n0 + ROWS_PER_TASK : a->n;
        for (int64_t i = 0; i < a->b; i++) {
            column(a, i, n0, n1);
            update_later_columns(a, i, a->errors + i * a->n, n0, n1);
        }
    }
}

static void int_tasks(const void *a, int64_t lo, int64_t hi) { run_tasks(a, lo, hi, int_column); }
static void grid_tasks(const void *a, int64_t lo, int64_t hi) { run_tasks(a, lo, hi, grid_column); }

/* Threads split the weight rows (in tasks), which never interact. */
static int run(const Block *a, int threads, lowbit_items_fn tasks_fn) {
    const int64_t tasks = (a->n + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    lowbit_for_items(tasks, tasks > 1 && threads > 1, threads, tasks_fn, a);
    return 0;
}

int lowbit_gptq_int_block(float *block, int64_t b, int64_t n, const float *u, int64_t ldu,
                          const float *divisor, const float *scale, const float *lo, const float *hi,
                          float lo_s, float hi_s, float *ints, float *values, float *errors,
                          const uint8_t *keep, float *kept, int threads) {
    if (b <= 0 || n <= 0) return 0;
    const Block a = {.block = block, .b = b, .n = n, .ldu = ldu, .u = u, .divisor = divisor, .scale = scale,
                     .lo = lo, .hi = hi, .lo_s = lo_s, .hi_s = hi_s, .ints = ints, .values = values,
                     .errors = errors, .keep = keep, .kept = kept};
    return run(&a, threads, int_tasks);
}

/* The same loop for formats whose element quantizer is "the nearest value of x / divisor on a
   grid" (minifloats, NF4; quant/element_grid.py): g values ascending (magnitudes when
   sign_bit is set, the code then taking sign_bit for negative x, -0 included), g - 1 midpoints in
   double, x exactly on midpoint j going up when tie_up[j]. Beyond the last midpoint it saturates.
   Writes the codes (uint8) where the integer loop writes integers; value = grid value * scale. */
int lowbit_gptq_grid_block(float *block, int64_t b, int64_t n, const float *u, int64_t ldu,
                           const float *divisor, const float *scale, int64_t g, const double *mids,
                           const uint8_t *tie_up, const float *grid, const uint8_t *grid_codes, int sign_bit,
                           uint8_t *codes, float *values, float *errors, const uint8_t *keep, float *kept,
                           int threads) {
    if (b <= 0 || n <= 0 || g <= 0) return g <= 0;
    const Block a = {.block = block, .b = b, .n = n, .ldu = ldu, .u = u, .divisor = divisor, .scale = scale, .g = g,
                     .mids = mids, .tie_up = tie_up, .grid = grid, .grid_codes = grid_codes, .sign_bit = sign_bit,
                     .codes = codes, .values = values, .errors = errors, .keep = keep, .kept = kept};
    return run(&a, threads, grid_tasks);
}

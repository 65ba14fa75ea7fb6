/* C harness for bench/int4_pass_shapes.py: SmolLM2-135M's four int4 matrices a layer (q|k|v 960 x 576,
   o 576 x 576, gate|up 3072 x 576, down 576 x 1536) through native/int4_vnni.c at M rows, as the
   engine's one-call step runs them: 2 threads, each a part call of its share of the tiles, a
   barrier after every matrix. LAYERS copies of the layer (1: from cache, 30: the model, from
   memory), random codes, scales 1/16 as float16, x the same each repetition. The pass shape is
   whatever PASS_ROWS4 this file is compiled with. Prints the minimum, the 10th percentile and the
   median over the repetitions of one pass over all layers, in ms.

   usage: int4_pass_shapes REPS ROWS LAYERS GROUP */
#define _GNU_SOURCE
#include "int4_vnni.c"

#include <omp.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

typedef struct {
    int64_t N, K;
} Shape;
static const Shape SHAPES[4] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};

/* Weights on 2 MB pages, as the engine places them (kernels/hugepages.py): every matrix cut from
   one 2 MB-aligned arena. A mapping of its own per matrix, as this harness had, got none: the
   kernel only backs whole aligned 2 MB ranges with a huge page, and SmolLM2's matrices are 0.2-0.9
   MB, so "from memory" had paid a TLB miss per 4 KB (30 layers at 16 rows: 6.6-7.5 against 5.9-6.1 ms,
   six alternations on 2 Zen 4 cores). */
#define ARENA_BYTES ((size_t)1 << 30)
static char *arena_at, *arena_end;
static void *huge(size_t bytes) {
    if (!arena_at) {
        char *m = mmap(NULL, ARENA_BYTES + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return NULL;
        arena_at = (char *)(((uintptr_t)m + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
        arena_end = arena_at + ARENA_BYTES;
        madvise(arena_at, ARENA_BYTES, MADV_HUGEPAGE);
    }
    bytes = (bytes + 63) / 64 * 64;
    if ((size_t)(arena_end - arena_at) < bytes) return NULL;
    void *p = arena_at;
    arena_at += bytes;
    return p;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s REPS ROWS LAYERS GROUP\n", argv[0]);
        return 2;
    }
    const int reps = atoi(argv[1]), M = atoi(argv[2]), L = atoi(argv[3]), group = atoi(argv[4]);
    if (reps < 3 || M < 1 || L < 1 || (group != 32 && group != 64 && group != 128)) return 2;
    I4VWeight *w = calloc((size_t)L * 4, sizeof(I4VWeight));
    float *x[4], *y[4];
    for (int m = 0; m < 4; m++) {
        x[m] = aligned_alloc(64, (size_t)(SHAPES[m].K * M * 4 + 63) / 64 * 64);
        y[m] = aligned_alloc(64, (size_t)(SHAPES[m].N * M * 4 + 63) / 64 * 64);
        for (int64_t k = 0; k < SHAPES[m].K * M; k++) x[m][k] = (float)((k * 37) % 17) - 8.0f;
    }
    for (int l = 0; l < L; l++)
        for (int m = 0; m < 4; m++) {
            const int64_t N = SHAPES[m].N, K = SHAPES[m].K, chunks = K / 8, G = K / group, tiles = N / 16, quads = N / 64;
            uint8_t *codes = huge((size_t)(quads * 4 * chunks * 64));
            uint16_t *scales = huge((size_t)(tiles * G * 16 * 2));
            if (!codes || !scales) return 1;
            for (int64_t i = 0; i < quads * 4 * chunks * 64; i++) codes[i] = (uint8_t)(i * 2654435761u >> 13);
            for (int64_t i = 0; i < tiles * G * 16; i++) scales[i] = 0x2C00; /* 1/16 */
            w[l * 4 + m] = (I4VWeight){.codes = codes, .tile_bytes = chunks * 64, .N = N, .K = K, .chunks = chunks, .G = G,
                                       .cpg = group / 8, .offset = 8, .bits = 4, .scales16 = scales, .gps = 1};
        }
    double *times = calloc((size_t)reps, sizeof(double));
#pragma omp parallel num_threads(2)
    {
        const int id = omp_get_thread_num();
        for (int r = 0; r < reps; r++) {
            const double t0 = now();
            for (int i = 0; i < L * 4; i++) {
                lowbit_i4v_matmul(&w[i], x[i % 4], 0, w[i].K, M, y[i % 4], 0, w[i].N, LOWBIT_PART(id, 2));
#pragma omp barrier
            }
            if (id == 0) times[r] = now() - t0;
        }
    }
    qsort(times + 2, (size_t)(reps - 2), sizeof(double), by_value); /* the first two warm up */
    const int n = reps - 2;
    printf("%.4f %.4f %.4f\n", times[2] * 1e3, times[2 + n / 10] * 1e3, times[2 + n / 2] * 1e3);
    return 0;
}

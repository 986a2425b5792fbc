/* Checks paged decode attention (paged_attention.c, and whichever path it takes for the ISA it is
 * compiled for: paged_attention_vec.c on AVX2 / NEON, the portable loop on plain C) against a
 * float64 reference, on scattered blocks: several shapes (SmolLM2's, 7 query heads per KV head,
 * heads a multiple of 32 or not), float32 and bfloat16, with and without a sliding window, 1 and
 * 2 threads. Built with the kernels' own sources (test_isa_levels.py: at v3 and for aarch64
 * under qemu, where the Python kernel tests cannot run). Prints one line per failure and
 * "failures=N"; exits 1 on any. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"

int kernel_vector_exp_check(void);
int paged_decode_window(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        const int64_t *block_tables, int64_t bt_stride, const int64_t *context_lens,
                        void *out, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int dtype,
                        int num_threads, int64_t window);

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float rnd(void) { /* xorshift64 -> [-2, 2) */
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 4.0 - 2.0);
}

/* one element of a float32 or bfloat16 array, as float */
static float get(const void *p, int64_t i, int bf16) { return ld(p, i, bf16); }

static int check(int64_t H, int64_t KVH, int64_t D, int64_t bs, int bf16, int64_t window,
                 int threads) {
    enum { R = 6 };
    const int64_t lens[R] = {1, 7, 16, 17, 95, 130};
    int64_t width = 0, blocks = 0;
    for (int r = 0; r < R; r++) {
        const int64_t nb = (lens[r] + bs - 1) / bs;
        width = nb > width ? nb : width;
        blocks += nb;
    }
    const int64_t row = KVH * D, esz = bf16 ? 2 : 4, cache = blocks * bs * row;
    char *k = malloc((size_t)(cache * esz)), *v = malloc((size_t)(cache * esz));
    char *q = malloc((size_t)(R * H * D * esz)), *out = malloc((size_t)(R * H * D * esz));
    int64_t *table = calloc((size_t)(R * width), sizeof(int64_t));
    for (int64_t i = 0; i < cache; i++) {
        const float a = rnd(), b = rnd();
        if (bf16) ((uint16_t *)k)[i] = f32_to_bf16(a), ((uint16_t *)v)[i] = f32_to_bf16(b);
        else ((float *)k)[i] = a, ((float *)v)[i] = b;
    }
    for (int64_t i = 0; i < R * H * D; i++) {
        if (bf16) ((uint16_t *)q)[i] = f32_to_bf16(rnd());
        else ((float *)q)[i] = rnd();
    }
    /* blocks handed out backwards and interleaved across requests: never consecutive */
    int64_t next = blocks - 1;
    for (int64_t b = 0; b < width; b++)
        for (int r = 0; r < R; r++)
            if (b * bs < lens[r]) table[r * width + b] = next--;
    const float scale = 1.0f / sqrtf((float)D);
    if (paged_decode_window(q, H * D, k, v, table, width, lens, out, R, H, KVH, D, bs, scale,
                            bf16, threads, window) != 0) {
        printf("FAIL H=%lld KVH=%lld D=%lld: the kernel returned an error\n", (long long)H,
               (long long)KVH, (long long)D);
        return 1;
    }
    int bad = 0;
    double *s = malloc(sizeof(double) * 256);
    for (int r = 0; r < R; r++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / (H / KVH), n = lens[r];
            const int64_t lo = window > 0 && n > window ? n - window : 0;
            double mx = -INFINITY, sum = 0;
            for (int64_t p = lo; p < n; p++) {
                const int64_t at = (table[r * width + p / bs] * bs + p % bs) * row + g * D;
                double d = 0;
                for (int64_t e = 0; e < D; e++)
                    d += (double)get(q, (r * H + h) * D + e, bf16) * get(k, at + e, bf16);
                s[p - lo] = d * scale;
                mx = s[p - lo] > mx ? s[p - lo] : mx;
            }
            for (int64_t p = lo; p < n; p++) sum += (s[p - lo] = exp(s[p - lo] - mx));
            for (int64_t e = 0; e < D; e++) {
                double o = 0;
                for (int64_t p = lo; p < n; p++) {
                    const int64_t at = (table[r * width + p / bs] * bs + p % bs) * row + g * D;
                    o += s[p - lo] * get(v, at + e, bf16);
                }
                o /= sum;
                const double got = get(out, (r * H + h) * D + e, bf16);
                const double tol = bf16 ? 8e-3 * fabs(o) + 2e-3 : 1e-5 + 1e-5 * fabs(o);
                if (!(fabs(got - o) <= tol) && bad++ < 3)
                    printf("FAIL H=%lld KVH=%lld D=%lld bs=%lld bf16=%d window=%lld threads=%d "
                           "r=%d h=%lld e=%lld: got %.7g want %.7g\n", (long long)H,
                           (long long)KVH, (long long)D, (long long)bs, bf16, (long long)window,
                           threads, r, (long long)h, (long long)e, got, o);
            }
        }
    free(s), free(k), free(v), free(q), free(out), free(table);
    return bad;
}

int main(void) {
    kernel_vector_exp_check();
    /* heads, KV heads, head size, block size */
    static const int64_t shapes[][4] = {{9, 3, 64, 16}, {14, 2, 96, 8}, {8, 2, 32, 4},
                                        {4, 4, 128, 16}, {6, 2, 48, 16}, {4, 1, 256, 1}};
    int failures = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int bf16 = 0; bf16 < 2; bf16++)
            for (int window = 0; window < 2; window++)
                failures += check(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], bf16,
                                  window ? 20 : 0, 1 + (int)(i % 2));
    printf("failures=%d\n", failures);
    return failures != 0;
}

/* Checks float32 prefill attention (prefill_attention_f32.c, on whichever vector layer it is
 * compiled for: NEON's 8-row score and 4-row value passes on aarch64) against a float64 causal
 * softmax(q k^T * scale) v: chunk lengths around the 16-row query blocks and the key vectors
 * (1, 7, 16, 17, 40, 100), grouped query heads, head sizes of 16, 64 and 80, strided rows,
 * 1 and 2 threads. Built with the kernel's own source (test_isa_levels.py: for aarch64 under
 * qemu, where the Python kernel tests cannot run). Prints one line per failure and
 * "built=B failures=N"; exits 1 on any. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int prefill_f32_supported(void);
int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                          const float *v, int64_t v_stride, float *out, int64_t n,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                          int num_threads);

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float rnd(void) { /* xorshift64 -> [-2, 2) */
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 4.0 - 2.0);
}

static int failures = 0;

static void check(int64_t n, int64_t H, int64_t KVH, int64_t D, int threads) {
    const int64_t qs = H * D + 8, ks = KVH * D + 4; /* rows wider than their heads: strides */
    float *q = malloc(sizeof(float) * (size_t)(n * qs)), *k = malloc(sizeof(float) * (size_t)(n * ks));
    float *v = malloc(sizeof(float) * (size_t)(n * ks)), *out = malloc(sizeof(float) * (size_t)(n * H * D));
    double *p = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n * qs; i++) q[i] = rnd();
    for (int64_t i = 0; i < n * ks; i++) { k[i] = rnd(); v[i] = rnd(); }
    const float scale = 1.0f / sqrtf((float)D);
    const int rc = prefill_attention_f32(q, qs, k, ks, v, ks, out, n, H, KVH, D, scale, threads);
    if (rc != 0) {
        printf("n %ld heads %ld/%ld dim %ld: returned %d\n", (long)n, (long)H, (long)KVH, (long)D, rc);
        failures++;
    } else {
        int bad = 0;
        for (int64_t i = 0; i < n && bad < 3; i++)
            for (int64_t h = 0; h < H && bad < 3; h++) {
                const int64_t kh = h / (H / KVH);
                double mx = -INFINITY, sum = 0.0;
                for (int64_t j = 0; j <= i; j++) {
                    double s = 0.0;
                    for (int64_t d = 0; d < D; d++) s += (double)q[i * qs + h * D + d] * k[j * ks + kh * D + d];
                    p[j] = s * scale;
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int64_t j = 0; j <= i; j++) { p[j] = exp(p[j] - mx); sum += p[j]; }
                for (int64_t d = 0; d < D; d++) {
                    double ref = 0.0;
                    for (int64_t j = 0; j <= i; j++) ref += p[j] * v[j * ks + kh * D + d];
                    ref /= sum;
                    const double got = out[(i * H + h) * D + d];
                    if (!(fabs(got - ref) <= 2e-5 * (1.0 + fabs(ref)))) {
                        printf("n %ld heads %ld/%ld dim %ld threads %d: out[%ld][%ld][%ld] = %.8g, "
                               "want %.8g\n", (long)n, (long)H, (long)KVH, (long)D, threads,
                               (long)i, (long)h, (long)d, got, ref);
                        failures++;
                        bad++;
                        break;
                    }
                }
            }
    }
    free(q); free(k); free(v); free(out); free(p);
}

int main(void) {
    const int64_t lens[] = {1, 7, 16, 17, 40, 100};
    for (int i = 0; i < 6; i++) {
        check(lens[i], 3, 1, 64, 1 + i % 2);
        check(lens[i], 4, 2, 16, 2 - i % 2);
        check(lens[i], 2, 2, 80, 1);
    }
    printf("built=%d failures=%d\n", prefill_f32_supported(), failures);
    return failures != 0;
}

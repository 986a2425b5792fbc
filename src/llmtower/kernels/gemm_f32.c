/* float32 products of a decode step's rows (tens to a few hundred) against weights laid out
 * once for streaming.
 *
 *   gemm_f32_pack      W [N, K] row-major -> panels of 32 output columns: panel p holds, for
 *                      each input k in order, the 32 weights W[32p .. 32p+31, k] (zero columns
 *                      past N). One panel's weights are one sequential run. With `up` given,
 *                      a panel holds 16 gate rows then the 16 matching up rows instead.
 *   gemm_f32           out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])
 *   gemm_f32_silu_mul  out[m, i] = silu(g) * u with g, u the gate and up products of row m
 *                      (the SwiGLU MLP's first half; silu as fused_ops.c computes it).
 *
 * Why: oneDNN's float32 GEMM reaches ~440-490 GFLOP/s on SmolLM2's shapes when a layer's
 * weights sit in cache, but ~290-370 at 64 rows when they come from memory, as they do in a
 * decode step (30 layers x 14 MB). Here each thread walks its own run of panels; a panel
 * (K x 128 bytes) is read from memory once and stays in L2 while every row block of the step
 * passes over it, and the next panel is prefetched into L2 while the current one is computed,
 * so the memory read overlaps the arithmetic.
 *
 * Micro-kernel: up to 12 rows x 32 columns, 24 accumulators; per input k two weight vectors
 * and one broadcast per row. Each output is one float32 accumulator summing x[m, k] * W[n, k]
 * in k order with fused multiply-adds, then + bias: a row's result does not depend on the
 * other rows or on the thread count. Rows are taken in near-equal chunks of at most CHUNK_BYTES
 * of x (which stays in L2 while the panels pass) and split into near-equal blocks of at most 12.
 *
 * The fast path is written on kernels/vec.h (AVX-512: 12 rows x 32 columns; AVX2 and NEON: 6 rows
 * x 16 columns per pass, two passes per panel), and computes the portable path's sums (fmaf, k
 * order) bit for bit. The portable path is for tests (and LLMTOWER_CPU_ISA=v2); Python uses the
 * kernel only where the fast path exists (``gemm_f32_fast``).
 */
#include <stdint.h>
#include "gemm_f32_panels.h"

int gemm_f32_fast(void) { return F32_FAST; }

int64_t gemm_f32_packed_numel(int64_t n, int64_t k, int silu_pair) {
    int64_t cols = silu_pair ? F32_HALF : F32_NP;
    return ((n + cols - 1) / cols) * F32_NP * k;
}

/* W (and up, for a silu pair; else NULL) [n, k] -> panels (see the top of the file). */
void gemm_f32_pack(const float *w, const float *up, int64_t n, int64_t k, float *out) {
    const int64_t cols = up ? F32_HALF : F32_NP, panels = (n + cols - 1) / cols;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < F32_NP; c++) {
                const float *src = up && c >= F32_HALF ? up : w;
                int64_t row = p * cols + (up ? c % F32_HALF : c);
                out[(p * k + kk) * F32_NP + c] = row < n ? src[row * k + kk] : 0.0f;
            }
}

static int gemm_any(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
                    int64_t k, const float *bias, float *out, int64_t ldo, int num_threads,
                    int silu, int path) {
    if (m < 0 || n <= 0 || k <= 0 || ldx < k || ldo < n) return 1;
    if (m == 0) return 0;
    const int64_t panels = f32_panels(n, silu);
    const int nt = kernel_threads(num_threads, panels);
#pragma omp parallel num_threads(nt)
    f32_product_shared(x, m, ldx, packed, n, k, bias, out, ldo, silu, path, NULL, 0, 0, 0);
    return 0;
}

int gemm_f32(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n, int64_t k,
             const float *bias, float *out, int64_t ldo, int num_threads, int path) {
    return gemm_any(x, m, ldx, packed, n, k, bias, out, ldo, num_threads, 0, path);
}

int gemm_f32_silu_mul(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
                      int64_t k, float *out, int64_t ldo, int num_threads, int path) {
    return gemm_any(x, m, ldx, packed, n, k, NULL, out, ldo, num_threads, 1, path);
}

/* bfloat16 products of a decode step's rows (9 to a few hundred) against the few-row kernel's
 * packed weights (gemv_bf16.c's layout, the same buffer: no second copy).
 *
 *   gemm_bf16           out[m, n] = bf16(sum_k x[m, k] * W[n, k] (+ bias[n]))
 *   gemm_bf16_silu_mul  out[m, i] = bf16(bf16(silu(g)) * u) over a gate/up pair's tiles
 *
 * Why: a decode step of tens of rows reads every weight matrix from memory (SmolLM2: 30 layers,
 * 270 MB in bfloat16); oneDNN's bfloat16 GEMM runs ~25% below its in-cache rate there. Here each
 * thread walks its share of 64-column tiles; a tile is read from memory once per step, stays in
 * L2 while every row block passes over it, and the next tile is prefetched while it is computed.
 * The tile code is gemm_bf16_tiles.h (usable inside a caller's parallel region); each output is
 * summed as gemv_bf16 sums it, so a row's result is bit for bit the few-row kernel's, whatever
 * the row count or thread count.
 *
 * Only the AVX512_BF16 path is fast; the portable path computes the same sums in C (tests), and
 * Python uses the kernel only where the fast path exists (``gemv_bf16_fast``).
 */
#include "gemm_bf16_tiles.h"
#include "threads.h"

int gemm_bf16_fast(void) { return HAVE_FAST; }

static int gemm_any(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *wp, int64_t n,
                    int64_t k, const uint16_t *bias, uint16_t *out, int64_t ldo, int num_threads,
                    int silu, int path) {
    if (m < 0 || n <= 0 || k <= 0 || (m > 1 && ldx < k) || ldo < n) return 1;
    if (m == 0) return 0;
    const int fast = HAVE_FAST && path == 0;
    const int64_t tiles = (n + (silu ? TILE / 2 : TILE) - 1) / (silu ? TILE / 2 : TILE);
    const int nt = kernel_threads(num_threads, tiles * m);
#pragma omp parallel num_threads(nt) if (nt > 1)
    gemm_bf16_tiles(x, m, ldx, wp, n, k, bias, out, ldo, silu, fast);
    return 0;
}

/* path: 0 = the fast path where compiled in, 1 = the portable C path (tests compare them). */
int gemm_bf16(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *wp, int64_t n,
              int64_t k, const uint16_t *bias, uint16_t *out, int64_t ldo, int num_threads,
              int path) {
    return gemm_any(x, m, ldx, wp, n, k, bias, out, ldo, num_threads, 0, path);
}

int gemm_bf16_silu_mul(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *wp,
                       int64_t ni, int64_t k, uint16_t *out, int64_t ldo, int num_threads,
                       int path) {
    return gemm_any(x, m, ldx, wp, ni, k, NULL, out, ldo, num_threads, 1, path);
}

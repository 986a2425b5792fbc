/* bfloat16 products of a few rows (decode steps) against weights laid out once for streaming.
 *
 *   gemv_bf16_pack      W [N, K] row-major -> tiles of 64 output columns: for tile t and input
 *                       pair p, 64 columns x 2 inputs (t, p, column, pair element), zero-padded
 *                       to whole tiles and an even K. One tile's weights are one sequential run.
 *   gemv_bf16           out[m, n] = bf16(sum_k x[m, k] * W[n, k] (+ bias[n]))
 *   gemv_bf16_silu_mul  the SwiGLU MLP's first half over a matrix whose tiles hold 32 gate rows
 *                       then the 32 matching up rows: out[m, i] = bf16(bf16(silu(g)) * u).
 *
 * A decode step multiplies one to a few rows by each matrix, so the time is reading the matrix:
 * each 64-byte load of a tile feeds one `vdpbf16ps` per row (16 columns x one input pair), with
 * 4 x rows independent float32 accumulators, and no horizontal sums (the columns are the lanes).
 * Each output sums its input pairs in order into one float32 accumulator, as oneDNN's bfloat16
 * GEMM does, so on a CPU with AVX512_BF16 the results are those of oneDNN's (measured bit for bit on
 * SmolLM2's shapes; tests/kernels/test_gemv_bf16.py checks them against a float32 reference). The
 * portable path (no AVX512_BF16) computes the same sums in C; Python uses the kernel only where
 * the fast path exists (``gemv_bf16_fast``), and oneDNN elsewhere.
 * Tiles are shared out to OpenMP threads in contiguous runs. No software prefetch by default:
 * the hardware's stream prefetch kept up (a step's 269 MB of SmolLM2 weights took 7.1 ms, ~38
 * GB/s, at 2 threads when a plain read of 269 MB took 7.7 ms; prefetching 4-12 KB ahead was
 * 5-15% slower). gemv_bf16_tiles_set_prefetch (Python: gemv_bf16.set_prefetch) turns on a
 * prefetch of each pair's lines with a chosen hint and distance; NTA 1-2 KB ahead made the host
 * code between steps faster (less cache evicted) but the products no faster, one stream's
 * tok/s within noise (docs/performance.md), so it stays off.
 */
#include "gemv_bf16_tiles.h"
#include "threads.h"

int gemv_bf16_fast(void) { return HAVE_FAST; }

/* The few-row tiles' prefetch (one setting for the whole library: gemv_bf16 and decode_layer's
 * layers read it). */
int gemv_pf_hint = 0;
int64_t gemv_pf_dist = 1024;

void gemv_bf16_tiles_set_prefetch(int hint, int64_t dist) {
    gemv_pf_hint = hint;
    gemv_pf_dist = dist;
}

int64_t gemv_bf16_packed_numel(int64_t n, int64_t k) {
    return ((n + TILE - 1) / TILE) * TILE * ((k + 1) / 2) * 2;
}

void gemv_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    const int64_t pairs = (k + 1) / 2, tiles = (n + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t c = 0; c < TILE; c++)
                for (int64_t e = 0; e < 2; e++) {
                    int64_t row = t * TILE + c, col = 2 * p + e;
                    out[((t * pairs + p) * TILE + c) * 2 + e] =
                        row < n && col < k ? w[row * k + col] : 0;
                }
}

/* path: 0 = the fast path where compiled in, 1 = the portable C path (tests compare them). */
int gemv_bf16(const uint16_t *x, int64_t m, int64_t x_stride, const uint16_t *wp, int64_t n,
              int64_t k, const uint16_t *bias, uint16_t *out, int64_t out_stride,
              int num_threads, int path) {
    if (m < 0 || n <= 0 || k <= 0) return 1;
    const int fast = HAVE_FAST && path == 0;
    const int nt = kernel_threads(num_threads, (n + TILE - 1) / TILE);
#pragma omp parallel num_threads(nt) if (nt > 1)
    few_rows_tiles(x, m, x_stride, wp, n, k, bias, out, out_stride, 0, fast);
    return 0;
}

/* wp: a packed [2 * i_pad, K] matrix whose tile t holds gate rows 32t..32t+31 then up rows
 * 32t..32t+31 (i_pad = ni rounded up to 32). out [m, ni] with row stride out_stride. */
int gemv_bf16_silu_mul(const uint16_t *x, int64_t m, int64_t x_stride, const uint16_t *wp,
                       int64_t ni, int64_t k, uint16_t *out, int64_t out_stride,
                       int num_threads, int path) {
    if (m < 0 || ni <= 0 || k <= 0) return 1;
    const int fast = HAVE_FAST && path == 0;
    const int nt = kernel_threads(num_threads, (ni + TILE / 2 - 1) / (TILE / 2));
#pragma omp parallel num_threads(nt) if (nt > 1)
    few_rows_tiles(x, m, x_stride, wp, ni, k, NULL, out, out_stride, 1, fast);
    return 0;
}

/* The bfloat16 decode-step GEMM's tile code (gemm_bf16.c says what and why), for callers that
 * want it inside a parallel region of their own (e.g. a fused decode layer).
 *
 * Layout: the few-row kernel's (gemv_bf16.c): tiles of 64 output columns, per input pair p the
 * 64 columns x 2 inputs, zero-padded; a silu pair's tile holds 32 gate then 32 up columns. The
 * SAME packed buffer serves both kernels, and each output is summed exactly as gemv_bf16 sums it
 * (one float32 accumulator, input pairs in order, one `vdpbf16ps` each; the same epilogue), so a
 * row's bfloat16 result does not depend on which of the two kernels ran it, on how many rows ran
 * beside it, or on the thread count.
 *
 *   gemm_bf16_tiles(x, m, ldx, wp, n, k, bias, out, ldo, silu, fast)
 *       out[m, n] = bf16(x @ W.T (+ bias)), or with silu != 0 (wp a gate/up pair, n = the
 *       intermediate size) out[m, n] = bf16(bf16(silu(g)) * u). Call it from every thread of
 *       an enclosing `omp parallel` region (or outside one: it then runs serially); each thread
 *       takes an equal share of the (tile, row) work in tile-major order, and the function ends
 *       with `omp barrier`, so `out` is complete for all threads when it returns. No
 *       allocation; x may be a strided view (ldx >= k), as may out (ldo >= n).
 *
 * Micro-kernel: gemv_bf16_tiles.h's bf16_tile_fast, up to MR = 6 rows x 64 columns: 24 float32
 * accumulators, 4 weight vectors per input pair, the row's pair broadcast; the epilogue is its
 * bf16_tile_store. Rows of one thread's tile run in near-equal blocks of at
 * most MR, and while they run, the next tile of the thread's share is prefetched (spread over the
 * blocks), so the memory read overlaps the arithmetic; the tile (K x 128 bytes) stays in L2 while
 * every block passes over it. Rows are taken in chunks of at most CHUNK_BYTES of x.
 */
#ifndef LLMTOWER_GEMM_BF16_TILES_H
#define LLMTOWER_GEMM_BF16_TILES_H

#include "gemv_bf16_tiles.h" /* TILE, the micro-kernel, the epilogue, HAVE_FAST */
#include "threads.h"

#define GEMM_BF16_MR BF16_MAX_R
#define GEMM_BF16_CHUNK_BYTES (512 * 1024)

#if HAVE_FAST
#define GEMM_BF16_CASE(R) \
    case R: bf16_tile_fast(x, ldx, R, tile, k, acc, PF_SPREAD, 0, pf, pf_lines, pf_q); return;

static void gemm_bf16_block_fast(const uint16_t *x, int64_t ldx, int rows, const uint16_t *tile,
                                 int64_t k, float *acc, const char *pf, int64_t pf_lines,
                                 int pf_q) {
    switch (rows) {
        GEMM_BF16_CASE(1) GEMM_BF16_CASE(2) GEMM_BF16_CASE(3)
        GEMM_BF16_CASE(4) GEMM_BF16_CASE(5) GEMM_BF16_CASE(6)
        default: return;
    }
}
#endif

/* One thread's share within rows c0 .. c0+mc: the (tile, row) units u0 .. u1 of tiles x mc. */
static void gemm_bf16_share(const uint16_t *x, int64_t ldx, int64_t mc, const uint16_t *wp,
                            int64_t n, int64_t k, const uint16_t *bias, uint16_t *out,
                            int64_t ldo, int silu, int fast, int64_t u0, int64_t u1) {
    const int64_t cols = silu ? TILE / 2 : TILE;
    const int64_t tile_numel = ((k + 1) / 2) * TILE * 2;
    const int64_t lines = tile_numel * 2 / 64; /* a tile's cache lines */
    const int64_t pairs = (k + 1) / 2;
    float acc[GEMM_BF16_MR * TILE] __attribute__((aligned(64)));
    (void)lines; (void)pairs;
    if (u0 >= u1) return;
    const int64_t t_first = u0 / mc, t_last = (u1 - 1) / mc;
    for (int64_t t = t_first; t <= t_last; t++) {
        const int64_t r_begin = t == t_first ? u0 - t * mc : 0;
        const int64_t r_end = t == t_last ? u1 - t * mc : mc;
        const int64_t rows_t = r_end - r_begin;
        const uint16_t *tile = wp + t * tile_numel;
        const int ncols = (int)(n - t * cols < cols ? n - t * cols : cols);
        const int64_t nb = (rows_t + GEMM_BF16_MR - 1) / GEMM_BF16_MR;
        const char *next = t < t_last ? (const char *)(tile + tile_numel)
                                                              : NULL;
        /* the next tile's lines, spread over this tile's blocks: per block `per`, per pair q */
        const int64_t per = (lines + nb - 1) / nb;
        int q = (int)((per + pairs - 1) / pairs);
        if (q < 1) q = 1;
        int64_t r0 = r_begin;
        for (int64_t b = 0; b < nb; b++) {
            const int rows = (int)(rows_t / nb + (b < rows_t % nb));
            const uint16_t *xr = x + r0 * ldx;
            const int64_t first = b * per;
            int64_t count = 0;
            if (next && first < lines) count = lines - first < per ? lines - first : per;
#if HAVE_FAST
            if (fast)
                gemm_bf16_block_fast(xr, ldx, rows, tile, k, acc,
                                     count ? next + first * 64 : NULL, count, q);
            else
#endif
                tile_portable(xr, ldx, rows, tile, k, acc);
            (void)fast; (void)count; (void)q;
            bf16_tile_store(acc, rows, out + r0 * ldo + t * cols, ldo, ncols,
                            bias ? bias + t * cols : NULL, silu);
            r0 += rows;
        }
    }
}

static void gemm_bf16_tiles(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *wp,
                            int64_t n, int64_t k, const uint16_t *bias, uint16_t *out,
                            int64_t ldo, int silu, int fast) {
    const int64_t t = kernel_thread(), team = kernel_team();
    const int64_t tiles = (n + (silu ? TILE / 2 : TILE) - 1) / (silu ? TILE / 2 : TILE);
    int64_t chunk = GEMM_BF16_CHUNK_BYTES / (k * 2);
    if (chunk < GEMM_BF16_MR) chunk = GEMM_BF16_MR;
    const int64_t chunks = m > 0 ? (m + chunk - 1) / chunk : 0;
    if (chunks) chunk = (m + chunks - 1) / chunks;
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
        const int64_t mc = m - c0 < chunk ? m - c0 : chunk, units = tiles * mc;
        gemm_bf16_share(x + c0 * ldx, ldx, mc, wp, n, k, bias, out + c0 * ldo, ldo, silu, fast,
                        units * t / team, units * (t + 1) / team);
    }
#pragma omp barrier
}

#endif

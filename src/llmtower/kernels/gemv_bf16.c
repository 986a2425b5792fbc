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
 * Tiles are shared out to OpenMP threads in contiguous runs. No software prefetch: the
 * hardware's stream prefetch kept up (a step's 269 MB of SmolLM2 weights took 7.1 ms, ~38 GB/s,
 * at 2 threads when a plain read of 269 MB took 7.7 ms; prefetching 4-12 KB ahead was 5-15%
 * slower).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_FAST 1
#else
#define HAVE_FAST 0
#endif

#define TILE 64 /* output columns per tile: 4 vectors of 16 float32 accumulators */
#define MAX_CHUNK 4 /* rows computed together (4 x 4 accumulators + 4 weight vectors fit) */


int gemv_bf16_fast(void) { return HAVE_FAST; }

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

/* The float32 sums of `rows` rows of x against tile t: acc[r * TILE + c]. */
static void tile_portable(const uint16_t *x, int64_t x_stride, int rows, const uint16_t *tile,
                          int64_t k, float *acc) {
    const int64_t pairs = (k + 1) / 2;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < TILE; c++) {
            float s = 0.0f;
            for (int64_t p = 0; p < pairs; p++) {
                const uint16_t *wv = tile + (p * TILE + c) * 2;
                float x0 = bf16_to_f32(x[r * x_stride + 2 * p]);
                float x1 = 2 * p + 1 < k ? bf16_to_f32(x[r * x_stride + 2 * p + 1]) : 0.0f;
                s += bf16_to_f32(wv[0]) * x0 + bf16_to_f32(wv[1]) * x1;
            }
            acc[r * TILE + c] = s;
        }
}

#if HAVE_FAST
/* One input pair of row r as a 32-bit broadcast; the odd K's last pair gets a zero partner. */
static inline __m512bh pair_of(const uint16_t *xr, int64_t p, int64_t k) {
    uint32_t v;
    if (2 * p + 1 < k) memcpy(&v, xr + 2 * p, sizeof v);
    else v = xr[2 * p];
    return (__m512bh)_mm512_set1_epi32((int)v);
}

static inline __attribute__((always_inline)) void tile_fast(
        const uint16_t *x, int64_t x_stride, const int ROWS, const uint16_t *tile, int64_t k,
        float *acc) {
    const int64_t pairs = (k + 1) / 2, full = k / 2;
    __m512 a[MAX_CHUNK][4];
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < 4; b++) a[r][b] = _mm512_setzero_ps();
    const uint32_t *x32[MAX_CHUNK];
    for (int r = 0; r < ROWS; r++) x32[r] = (const uint32_t *)(const void *)(x + r * x_stride);
    int64_t p = 0;
    for (; p < full; p++) {
        const uint16_t *wp = tile + p * TILE * 2;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64);
        __m512bh w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
        for (int r = 0; r < ROWS; r++) {
            uint32_t xv;
            memcpy(&xv, x32[r] + p, sizeof xv);
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xv);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], w0, xb);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], w1, xb);
            a[r][2] = _mm512_dpbf16_ps(a[r][2], w2, xb);
            a[r][3] = _mm512_dpbf16_ps(a[r][3], w3, xb);
        }
    }
    for (; p < pairs; p++) { /* odd K: the last input has no partner */
        const uint16_t *wp = tile + p * TILE * 2;
        for (int r = 0; r < ROWS; r++) {
            __m512bh xb = pair_of(x + r * x_stride, p, k);
            for (int b = 0; b < 4; b++)
                a[r][b] = _mm512_dpbf16_ps(a[r][b], (__m512bh)_mm512_loadu_si512(wp + 32 * b), xb);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < 4; b++) _mm512_storeu_ps(acc + r * TILE + 16 * b, a[r][b]);
}
#endif

static void tile_sums(const uint16_t *x, int64_t x_stride, int rows, const uint16_t *tile,
                      int64_t k, float *acc, int fast) {
#if HAVE_FAST
    if (fast) {
        switch (rows) {
        case 1: tile_fast(x, x_stride, 1, tile, k, acc); return;
        case 2: tile_fast(x, x_stride, 2, tile, k, acc); return;
        case 3: tile_fast(x, x_stride, 3, tile, k, acc); return;
        default: tile_fast(x, x_stride, 4, tile, k, acc); return;
        }
    }
#endif
    (void)fast;
    tile_portable(x, x_stride, rows, tile, k, acc);
}

/* path: 0 = the fast path where compiled in, 1 = the portable C path (tests compare them). */
int gemv_bf16(const uint16_t *x, int64_t m, int64_t x_stride, const uint16_t *wp, int64_t n,
              int64_t k, const uint16_t *bias, uint16_t *out, int64_t out_stride,
              int num_threads, int path) {
    if (m < 0 || n <= 0 || k <= 0) return 1;
    const int fast = HAVE_FAST && path == 0;
    const int64_t tiles = (n + TILE - 1) / TILE, tile_numel = ((k + 1) / 2) * TILE * 2;
#pragma omp parallel for num_threads(num_threads) if (tiles > 1 && num_threads > 1) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        float acc[MAX_CHUNK * TILE];
        const int64_t c_end = n - t * TILE < TILE ? n - t * TILE : TILE;
        for (int64_t m0 = 0; m0 < m; m0 += MAX_CHUNK) {
            int rows = (int)(m - m0 < MAX_CHUNK ? m - m0 : MAX_CHUNK);
            tile_sums(x + m0 * x_stride, x_stride, rows, wp + t * tile_numel, k, acc, fast);
            for (int r = 0; r < rows; r++) {
                uint16_t *o = out + (m0 + r) * out_stride + t * TILE;
                for (int64_t c = 0; c < c_end; c++) {
                    float v = acc[r * TILE + c];
                    if (bias) v += bf16_to_f32(bias[t * TILE + c]);
                    o[c] = f32_to_bf16(v);
                }
            }
        }
    }
    return 0;
}

/* wp: a packed [2 * i_pad, K] matrix whose tile t holds gate rows 32t..32t+31 then up rows
 * 32t..32t+31 (i_pad = ni rounded up to 32). out [m, ni] with row stride out_stride. */
int gemv_bf16_silu_mul(const uint16_t *x, int64_t m, int64_t x_stride, const uint16_t *wp,
                       int64_t ni, int64_t k, uint16_t *out, int64_t out_stride,
                       int num_threads, int path) {
    if (m < 0 || ni <= 0 || k <= 0) return 1;
    const int fast = HAVE_FAST && path == 0;
    const int64_t half = TILE / 2, tiles = (ni + half - 1) / half;
    const int64_t tile_numel = ((k + 1) / 2) * TILE * 2;
#pragma omp parallel for num_threads(num_threads) if (tiles > 1 && num_threads > 1) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        float acc[MAX_CHUNK * TILE];
        const int64_t c_end = ni - t * half < half ? ni - t * half : half;
        for (int64_t m0 = 0; m0 < m; m0 += MAX_CHUNK) {
            int rows = (int)(m - m0 < MAX_CHUNK ? m - m0 : MAX_CHUNK);
            tile_sums(x + m0 * x_stride, x_stride, rows, wp + t * tile_numel, k, acc, fast);
            for (int r = 0; r < rows; r++) {
                uint16_t *o = out + (m0 + r) * out_stride + t * half;
                const float *g = acc + r * TILE, *u = g + half;
#pragma omp simd
                for (int64_t c = 0; c < c_end; c++) {
                    /* as oneDNN's fused path: silu(gate) stored in bfloat16, times the up sum */
                    float s = bf16_to_f32(f32_to_bf16(g[c] / (1.0f + expf(-g[c]))));
                    o[c] = f32_to_bf16(s * u[c]);
                }
            }
        }
    }
    return 0;
}

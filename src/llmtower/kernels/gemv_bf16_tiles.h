/* The few-row bfloat16 product's tile code (see gemv_bf16.c for the layout and why), shared
 * by gemv_bf16.c and decode_layer_bf16.c. ``gemv_tiles`` and ``silu_mul_tiles`` share their
 * tiles out with an orphaned ``omp for``: called inside a parallel region they split the work
 * among its threads (ending in the loop's barrier), called outside one they run serially. */
#ifndef LLMTOWER_GEMV_BF16_TILES_H
#define LLMTOWER_GEMV_BF16_TILES_H

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

/* Software prefetch of the tile being read, `gemv_pf_dist` bytes ahead of the loads, with
 * hint `gemv_pf_hint` (0: none, 1: NTA, 2: T0, 3: T1, 4: T2). Per shared object (each .so that
 * includes this header has its own copy); benchmarks set it with gemv_bf16_tiles_set_prefetch. */
static int gemv_pf_hint __attribute__((unused)) = 0;
static int64_t gemv_pf_dist __attribute__((unused)) = 1024;
void gemv_bf16_tiles_set_prefetch(int hint, int64_t dist);
void gemv_bf16_tiles_set_prefetch(int hint, int64_t dist) {
    gemv_pf_hint = hint;
    gemv_pf_dist = dist;
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
        float *acc, const int PF, int64_t pf_dist) {
    const int64_t pairs = (k + 1) / 2, full = k / 2;
    __m512 a[MAX_CHUNK][4];
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < 4; b++) a[r][b] = _mm512_setzero_ps();
    const uint32_t *x32[MAX_CHUNK];
    for (int r = 0; r < ROWS; r++) x32[r] = (const uint32_t *)(const void *)(x + r * x_stride);
    int64_t p = 0;
    for (; p < full; p++) {
        const uint16_t *wp = tile + p * TILE * 2;
        if (PF) { /* the pair's 4 lines, pf_dist bytes ahead (past the tile: the next one) */
            const char *q = (const char *)wp + pf_dist;
            for (int j = 0; j < 4; j++) {
                if (PF == 1) _mm_prefetch(q + 64 * j, _MM_HINT_NTA);
                else if (PF == 2) _mm_prefetch(q + 64 * j, _MM_HINT_T0);
                else if (PF == 3) _mm_prefetch(q + 64 * j, _MM_HINT_T1);
                else _mm_prefetch(q + 64 * j, _MM_HINT_T2);
            }
        }
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
        const int64_t d = gemv_pf_dist;
#define GEMV_ROWS(PF)                                                          \
        switch (rows) {                                                        \
        case 1: tile_fast(x, x_stride, 1, tile, k, acc, PF, d); return;        \
        case 2: tile_fast(x, x_stride, 2, tile, k, acc, PF, d); return;        \
        case 3: tile_fast(x, x_stride, 3, tile, k, acc, PF, d); return;        \
        default: tile_fast(x, x_stride, 4, tile, k, acc, PF, d); return;       \
        }
        switch (gemv_pf_hint) {
        case 1: GEMV_ROWS(1)
        case 2: GEMV_ROWS(2)
        case 3: GEMV_ROWS(3)
        case 4: GEMV_ROWS(4)
        default: GEMV_ROWS(0)
        }
#undef GEMV_ROWS
    }
#endif
    (void)fast;
    tile_portable(x, x_stride, rows, tile, k, acc);
}

/* out[m, n] = bf16(x @ W.T (+ bias)): the tiles shared out to the enclosing region's threads. */
static void gemv_tiles(const uint16_t *x, int64_t m, int64_t x_stride, const uint16_t *wp,
                       int64_t n, int64_t k, const uint16_t *bias, uint16_t *out,
                       int64_t out_stride, int fast) {
    const int64_t tiles = (n + TILE - 1) / TILE, tile_numel = ((k + 1) / 2) * TILE * 2;
#pragma omp for schedule(static)
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
}

/* out[m, ni] = bf16(bf16(silu(x @ gate.T)) * (x @ up.T)) over the interleaved gate/up tiles. */
static void silu_mul_tiles(const uint16_t *x, int64_t m, int64_t x_stride, const uint16_t *wp,
                           int64_t ni, int64_t k, uint16_t *out, int64_t out_stride, int fast) {
    const int64_t half = TILE / 2, tiles = (ni + half - 1) / half;
    const int64_t tile_numel = ((k + 1) / 2) * TILE * 2;
#pragma omp for schedule(static)
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
}

#endif

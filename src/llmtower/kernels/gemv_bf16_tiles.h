/* The bfloat16 products' tile code (see gemv_bf16.c for the layout and why), shared by
 * gemv_bf16.c, gemm_bf16_tiles.h, decode_layer.c and greedy_head.c: the one micro-kernel that
 * sums a tile (bf16_tile_fast, or tile_portable without AVX512_BF16) and the one epilogue that
 * stores it (bf16_tile_store), so every bfloat16 product sums and rounds alike.
 * ``few_rows_tiles`` shares its tiles out with an orphaned ``omp for``:
 * called inside a parallel region they split the work among its threads (ending in the loop's
 * barrier), called outside one they run serially. */
#ifndef LLMTOWER_GEMV_BF16_TILES_H
#define LLMTOWER_GEMV_BF16_TILES_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#include "vec_exp.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_FAST 1
#else
#define HAVE_FAST 0
#endif

#define TILE 64 /* output columns per tile: 4 vectors of 16 float32 accumulators */
#define MAX_CHUNK 4 /* rows the few-row path computes together */
#define BF16_MAX_R 6 /* most rows of one micro-kernel call: 24 accumulators + 4 weights fit */

/* Software prefetch of the few-row tiles: hint gemv_pf_hint (0: none, 1: NTA, 2: T0, 3: T1,
 * 4: T2) gemv_pf_dist bytes ahead of the loads (lib_init.c holds them, once per library;
 * benchmarks set them with gemv_bf16_tiles_set_prefetch). */
extern int gemv_pf_hint;
extern int64_t gemv_pf_dist;
/* Whether exp16 is this libm's expf to the bit (lib_init.c: kernel_vector_exp_check); the
 * silu epilogue computes 16 lanes at once only then, so it equals the scalar expf's. */
extern int kernel_vector_exp;

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

/* The prefetch a tile's sums issue (PF, a constant in every caller): none; each pair's 4 lines
 * `pf_dist` bytes ahead with a hint (the few-row path: past the tile, the next one); or the
 * gemm path's `pf_lines` lines of `pf` (the next tile of its share), `pf_q` per input pair. */
enum { PF_NONE, PF_NTA, PF_T0, PF_T1, PF_T2, PF_SPREAD };

/* acc[r * TILE + c] for R rows (1..BF16_MAX_R) of tile `tile`: per output one float32
 * accumulator, input pairs in order, one `vdpbf16ps` each. */
static inline __attribute__((always_inline)) void bf16_tile_fast(
        const uint16_t *x, int64_t ldx, const int R, const uint16_t *tile, int64_t k, float *acc,
        const int PF, int64_t pf_dist, const char *pf, int64_t pf_lines, int pf_q) {
    const int64_t pairs = (k + 1) / 2, full = k / 2;
    __m512 a[BF16_MAX_R][4];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < 4; b++) a[r][b] = _mm512_setzero_ps();
    const uint32_t *x32[BF16_MAX_R];
    for (int r = 0; r < R; r++) x32[r] = (const uint32_t *)(const void *)(x + r * ldx);
    const int64_t pf_pairs = PF == PF_SPREAD && pf ? (pf_lines + pf_q - 1) / pf_q : 0;
    int64_t p = 0;
    for (; p < full; p++) {
        const uint16_t *wp = tile + p * TILE * 2;
        if (PF >= PF_NTA && PF <= PF_T2) {
            const char *q = (const char *)wp + pf_dist;
            for (int j = 0; j < 4; j++) {
                if (PF == PF_NTA) _mm_prefetch(q + 64 * j, _MM_HINT_NTA);
                else if (PF == PF_T0) _mm_prefetch(q + 64 * j, _MM_HINT_T0);
                else if (PF == PF_T1) _mm_prefetch(q + 64 * j, _MM_HINT_T1);
                else _mm_prefetch(q + 64 * j, _MM_HINT_T2);
            }
        }
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64);
        __m512bh w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
        if (PF == PF_SPREAD && p < pf_pairs)
            for (int j = 0; j < pf_q; j++) _mm_prefetch(pf + (p * pf_q + j) * 64, _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
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
        for (int r = 0; r < R; r++) {
            __m512bh xb = pair_of(x + r * ldx, p, k);
            for (int b = 0; b < 4; b++)
                a[r][b] = _mm512_dpbf16_ps(a[r][b], (__m512bh)_mm512_loadu_si512(wp + 32 * b), xb);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < 4; b++) _mm512_storeu_ps(acc + r * TILE + 16 * b, a[r][b]);
}
#endif

/* The few-row path's sums of `rows` (1..MAX_CHUNK) rows, with its prefetch setting. */
static void tile_sums(const uint16_t *x, int64_t x_stride, int rows, const uint16_t *tile,
                      int64_t k, float *acc, int fast) {
#if HAVE_FAST
    if (fast) {
        const int64_t d = gemv_pf_dist;
#define GEMV_ROWS(PF)                                                                         \
        switch (rows) {                                                                       \
        case 1: bf16_tile_fast(x, x_stride, 1, tile, k, acc, PF, d, NULL, 0, 1); return;      \
        case 2: bf16_tile_fast(x, x_stride, 2, tile, k, acc, PF, d, NULL, 0, 1); return;      \
        case 3: bf16_tile_fast(x, x_stride, 3, tile, k, acc, PF, d, NULL, 0, 1); return;      \
        default: bf16_tile_fast(x, x_stride, 4, tile, k, acc, PF, d, NULL, 0, 1); return;     \
        }
        switch (gemv_pf_hint) {
        case 1: GEMV_ROWS(PF_NTA)
        case 2: GEMV_ROWS(PF_T0)
        case 3: GEMV_ROWS(PF_T1)
        case 4: GEMV_ROWS(PF_T2)
        default: GEMV_ROWS(PF_NONE)
        }
#undef GEMV_ROWS
    }
#endif
    (void)fast;
    tile_portable(x, x_stride, rows, tile, k, acc);
}

/* The finished sums of `rows` rows (acc[r * TILE + c]) into out, ncols columns: bias added in
 * float32 and one rounding to bfloat16; or, for a gate/up tile (`silu`: 32 gate sums then the 32
 * up sums), as oneDNN's fused path: silu(gate) stored in bfloat16, times the up sum. */
static void bf16_tile_store(const float *acc, int rows, uint16_t *out, int64_t ldo, int ncols,
                            const uint16_t *bias, int silu) {
    for (int r = 0; r < rows; r++) {
        uint16_t *o = out + r * ldo;
        if (silu) {
            const float *g = acc + r * TILE, *u = g + TILE / 2;
            int c = 0;
#if HAVE_FAST
            if (kernel_vector_exp)
                for (; c + 16 <= ncols; c += 16) {
                    const __m512 sb = _mm512_castsi512_ps(_mm512_slli_epi32(
                            f32x16_to_bf16(silu16(_mm512_loadu_ps(g + c))), 16));
                    _mm256_storeu_si256((__m256i *)(void *)(o + c), _mm512_cvtepi32_epi16(
                            f32x16_to_bf16(_mm512_mul_ps(sb, _mm512_loadu_ps(u + c)))));
                }
#endif
            for (; c < ncols; c++) {
                float s = bf16_to_f32(f32_to_bf16(g[c] / (1.0f + expf(-g[c]))));
                o[c] = f32_to_bf16(s * u[c]);
            }
            continue;
        }
        const float *a = acc + r * TILE;
#if HAVE_FAST
        for (int c0 = 0; c0 < ncols; c0 += 16) {
            const int nc = ncols - c0 < 16 ? ncols - c0 : 16;
            const __mmask16 msk = (__mmask16)((1u << nc) - 1);
            __m512 v = _mm512_loadu_ps(a + c0);
            if (bias) v = _mm512_add_ps(v, bf16x16_to_f32(_mm256_maskz_loadu_epi16(msk, bias + c0)));
            _mm256_mask_storeu_epi16(o + c0, msk, _mm512_cvtepi32_epi16(f32x16_to_bf16(v)));
        }
#else
        for (int c = 0; c < ncols; c++) {
            float v = a[c];
            if (bias) v += bf16_to_f32(bias[c]);
            o[c] = f32_to_bf16(v);
        }
#endif
    }
}

/* out[m, n] = bf16(x @ W.T (+ bias)), or with `silu` (wp the interleaved gate/up tiles, n the
 * intermediate size) out[m, n] = bf16(bf16(silu(x @ gate.T)) * (x @ up.T)): the tiles shared
 * out to the enclosing region's threads. */
static void few_rows_tiles(const uint16_t *x, int64_t m, int64_t x_stride, const uint16_t *wp,
                           int64_t n, int64_t k, const uint16_t *bias, uint16_t *out,
                           int64_t out_stride, int silu, int fast) {
    const int64_t cols = silu ? TILE / 2 : TILE, tiles = (n + cols - 1) / cols;
    const int64_t tile_numel = ((k + 1) / 2) * TILE * 2;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        float acc[MAX_CHUNK * TILE];
        const int ncols = (int)(n - t * cols < cols ? n - t * cols : cols);
        for (int64_t m0 = 0; m0 < m; m0 += MAX_CHUNK) {
            int rows = (int)(m - m0 < MAX_CHUNK ? m - m0 : MAX_CHUNK);
            tile_sums(x + m0 * x_stride, x_stride, rows, wp + t * tile_numel, k, acc, fast);
            bf16_tile_store(acc, rows, out + m0 * out_stride + t * cols, out_stride, ncols,
                            bias ? bias + t * cols : NULL, silu);
        }
    }
}

#endif

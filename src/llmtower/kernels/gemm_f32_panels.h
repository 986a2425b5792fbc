/* The float32 panel product's code (see gemm_f32.c for the layout and why), shared by
 * gemm_f32.c and decode_layer.c. ``f32_product_shared`` splits a product's panels among the
 * threads of the enclosing OpenMP region (each thread its own run of panels, as gemm_f32's
 * threads do) and ends in a barrier; called outside a region it runs the whole product on the
 * calling thread. A row's result is the same either way (one accumulator per output, k order). */
#ifndef LLMTOWER_GEMM_F32_PANELS_H
#define LLMTOWER_GEMM_F32_PANELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "threads.h"
#include "vec.h"
#include "vec_exp.h"

#define F32_FAST VEC_FAST
#define F32_NP 32     /* output columns per panel */
#define F32_HALF 16   /* gate (or up) columns per panel of a silu pair */
/* The micro-kernel's tile: F32_MR rows x F32_TV vectors of a panel's columns (the panel's
 * F32_NP / (F32_TV * VEC_LANES) column blocks one after the other), sized to the registers:
 * AVX-512 (32): 12 x 2 = 24 accumulators + 2 weights + a broadcast; AVX2 (16): 6 x 2 = 12 + 3;
 * NEON (32): 6 x 4 = 24 + 5. */
#if VEC_LANES == 16
#define F32_MR 12
#define F32_TV 2
#else
#define F32_MR 6
#define F32_TV (VEC_LANES == 8 ? 2 : 4)
#endif
#define F32_TW (F32_TV * VEC_LANES) /* columns per tile */
#define F32_CHUNK_BYTES (640 * 1024) /* x rows per pass over the panels: what stays in L2 beside a panel */

static inline float f32_silu(float g) { return g / (1.0f + expf(-g)); }

/* Per-row terms added to a product's sums before its bias or SiLU (the fused decode layer's
 * LoRA deltas): row i of the product (`index[i]` >= 0) takes d[index[i] * ld + column], the
 * columns of a plain product as they are, those of a silu pair's gate at 0.., of its up at
 * half.. (-1: the row takes nothing). */
typedef struct {
    const float *d;
    const int64_t *index;
    int64_t ld, half;
} F32Addend;

/* The finished sums of `rows` rows x 32 columns (acc[r * F32_NP + c]) of panel p, rows row0..
 * of the product, into out (`add`: terms added first, or NULL). */
static void f32_store_tile(float *acc, int rows, float *out, int64_t ldo, int ncols,
                       const float *bias, int silu, int path, const F32Addend *add,
                       int64_t row0, int64_t p) {
    for (int r = 0; add && r < rows; r++) {
        const int64_t i = add->index[row0 + r];
        if (i < 0) continue;
        float *a = acc + r * F32_NP;
        const float *d = add->d + i * add->ld;
        if (silu) {
            for (int c = 0; c < ncols; c++) {
                a[c] += d[p * F32_HALF + c];
                a[F32_HALF + c] += d[add->half + p * F32_HALF + c];
            }
        } else {
            for (int c = 0; c < ncols; c++) a[c] += d[p * F32_NP + c];
        }
    }
    for (int r = 0; r < rows; r++) {
        const float *a = acc + r * F32_NP;
        float *o = out + r * ldo;
        if (silu) {
#if defined(__AVX512F__)
            if (path == 0) {
                const __m512 s = silu16(_mm512_loadu_ps(a)), u = _mm512_loadu_ps(a + F32_HALF);
                _mm512_mask_storeu_ps(o, (__mmask16)((1u << ncols) - 1), _mm512_mul_ps(s, u));
                continue;
            }
#elif F32_FAST
            if (path == 0 && ncols == F32_HALF) { /* f32_silu's steps, vf_exp libm's expf */
                for (int c = 0; c < F32_HALF; c += VEC_LANES) {
                    const vf g = vf_load(a + c);
                    const vf e = vf_exp(vf_sub(vf_zero(), g));
                    vf_store(o + c, vf_mul(vf_div(g, vf_add(vf_set1(1.0f), e)),
                                           vf_load(a + F32_HALF + c)));
                }
                continue;
            }
#endif
            for (int c = 0; c < ncols; c++) o[c] = f32_silu(a[c]) * a[F32_HALF + c];
        } else {
            for (int c = 0; c < ncols; c++) o[c] = bias ? a[c] + bias[c] : a[c];
        }
    }
}

static void f32_tile_portable(const float *x, int64_t ldx, int rows, const float *pw, int64_t k,
                          float *acc) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < F32_NP; c++) {
            float s = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) s = fmaf(x[r * ldx + kk], pw[kk * F32_NP + c], s);
            acc[r * F32_NP + c] = s;
        }
}

#if F32_FAST
/* acc[r * F32_NP + c] for R rows; prefetches `pf_lines` 64-byte lines from `pf`, one per k (in
 * the first column block's pass). Each output: one accumulator, k order, fused multiply-adds. */
static inline __attribute__((always_inline)) void f32_tile_fast(
        const float *x, int64_t ldx, const int R, const float *pw, int64_t k, float *acc,
        const char *pf, int64_t pf_lines, const char *side, int64_t side_lines) {
    for (int c0 = 0; c0 < F32_NP; c0 += F32_TW) {
        vf a[F32_MR][F32_TV];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < F32_TV; v++) a[r][v] = vf_zero();
        for (int64_t kk = 0; kk < k; kk++) {
            vf w[F32_TV];
            for (int v = 0; v < F32_TV; v++) w[v] = vf_load(pw + kk * F32_NP + c0 + v * VEC_LANES);
            if (c0 == 0) {
                if (kk < pf_lines) vec_prefetch_l2(pf + kk * 64);
                else if (kk - pf_lines < side_lines) vec_prefetch_l2(side + (kk - pf_lines) * 64);
            }
            for (int r = 0; r < R; r++) {
                const vf xb = vf_set1(x[r * ldx + kk]);
                for (int v = 0; v < F32_TV; v++) a[r][v] = vf_fma(xb, w[v], a[r][v]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < F32_TV; v++)
                vf_store(acc + r * F32_NP + c0 + v * VEC_LANES, a[r][v]);
    }
}

#define F32_CASE(R) \
    case R: f32_tile_fast(xr, ldx, R, pw, k, acc, pf, pf_lines, side, side_lines); break;

static void f32_tile_dispatch(const float *xr, int64_t ldx, int rows, const float *pw, int64_t k,
                              float *acc, const char *pf, int64_t pf_lines, const char *side,
                              int64_t side_lines) {
    switch (rows) {
        F32_CASE(1) F32_CASE(2) F32_CASE(3) F32_CASE(4) F32_CASE(5) F32_CASE(6)
#if F32_MR > 6
        F32_CASE(7) F32_CASE(8) F32_CASE(9) F32_CASE(10) F32_CASE(11) F32_CASE(12)
#endif
        default: break;
    }
}
#endif

/* A further stream of lines to prefetch in the micro-kernel's spare k steps (e.g. the next
 * attention's KV blocks): take(state, max, &ptr) gives up to max contiguous lines at ptr and
 * moves on (0: none left). Per thread; NULL: none. */
typedef struct {
    int64_t (*take)(void *state, int64_t max, const char **ptr);
    void *state;
} F32Side;
static __thread F32Side *f32_side;
/* Terms the products of this thread add to their sums (NULL: none); set around one product. */
static __thread const F32Addend *f32_addend;

/* One thread's share: panels p0..p1 over rows 0..m. While its last panel is computed (in the
 * last row chunk), `after_lines` lines at `after` are prefetched: the thread's first panel of
 * the product that follows (NULL: none). */
static void f32_run_panels(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
                           int64_t k, const float *bias, float *out, int64_t ldo, int64_t p0,
                           int64_t p1, int silu, int path, const char *after,
                           int64_t after_lines) {
    const int64_t cols = silu ? F32_HALF : F32_NP;
    const int64_t lines = k * F32_NP * (int64_t)sizeof(float) / 64; /* a panel's cache lines */
    float acc[F32_MR * F32_NP] __attribute__((aligned(64)));
    const F32Addend *add = f32_addend;
    int64_t chunk = F32_CHUNK_BYTES / (k * (int64_t)sizeof(float));
    if (chunk < F32_MR) chunk = F32_MR;
    const int64_t chunks = (m + chunk - 1) / chunk;
    chunk = (m + chunks - 1) / chunks;
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
        const int64_t mc = m - c0 < chunk ? m - c0 : chunk;
        const int64_t nb = (mc + F32_MR - 1) / F32_MR; /* near-equal blocks of at most F32_MR rows */
        for (int64_t p = p0; p < p1; p++) {
            const float *pw = packed + p * k * F32_NP;
            const char *next = p + 1 < p1 ? (const char *)(pw + k * F32_NP) : NULL;
            int64_t next_lines = lines;
            if (!next && c0 + mc >= m) next = after, next_lines = after_lines;
            const int64_t per = (next_lines + nb - 1) / nb; /* lines prefetched per block */
            const int ncols = (int)(n - p * cols < cols ? n - p * cols : cols);
            int64_t r0 = 0;
            for (int64_t b = 0; b < nb; b++) {
                const int rows = (int)(mc / nb + (b < mc % nb));
                const float *xr = x + (c0 + r0) * ldx;
                int64_t first = b * per, count = 0;
                if (next && first < next_lines)
                    count = next_lines - first < per ? next_lines - first : per;
                if (count > k) count = k;
                const char *side = NULL;
                int64_t side_lines = 0;
                if (f32_side && count < k)
                    side_lines = f32_side->take(f32_side->state, k - count, &side);
#if F32_FAST
                if (path == 0) f32_tile_dispatch(xr, ldx, rows, pw, k, acc,
                                                 next ? next + first * 64 : NULL, count, side,
                                                 side_lines);
                else
#endif
                    f32_tile_portable(xr, ldx, rows, pw, k, acc);
                f32_store_tile(acc, rows, out + (c0 + r0) * ldo + p * cols, ldo, ncols,
                               bias ? bias + p * cols : NULL, silu, path, add, c0 + r0, p);
                r0 += rows;
            }
        }
    }
}

/* A product's panels as the threads of a team share them. */
static inline int64_t f32_panels(int64_t n, int silu) {
    return (n + (silu ? F32_HALF : F32_NP) - 1) / (silu ? F32_HALF : F32_NP);
}

/* out = x @ W.T (+ bias), or silu(gate) * up for a silu pair: this thread's share of the
 * panels, then a barrier (the next phase reads every thread's columns). `after` (or NULL): the
 * packed weights of the product this thread runs next, [after_n, after_k] (`after_silu`), whose
 * first panel of this thread's share is prefetched while the last one here is computed. */
static void f32_product_shared(const float *x, int64_t m, int64_t ldx, const float *packed,
                               int64_t n, int64_t k, const float *bias, float *out, int64_t ldo,
                               int silu, int path, const float *after, int64_t after_n,
                               int64_t after_k, int after_silu) {
    const int64_t t = kernel_thread(), team = kernel_team(), panels = f32_panels(n, silu);
    const char *pf = NULL;
    int64_t pf_lines = 0;
    if (after) {
        const int64_t a0 = f32_panels(after_n, after_silu) * t / team;
        if (a0 < f32_panels(after_n, after_silu) * (t + 1) / team) {
            pf = (const char *)(after + a0 * after_k * F32_NP);
            pf_lines = after_k * F32_NP * (int64_t)sizeof(float) / 64;
        }
    }
    f32_run_panels(x, m, ldx, packed, n, k, bias, out, ldo, panels * t / team,
                   panels * (t + 1) / team, silu, path, pf, pf_lines);
#pragma omp barrier
}

#endif

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
 * Only the AVX-512 path is fast; the portable path computes the same sums (fmaf, k order) for
 * tests, and Python uses the kernel only where the fast path exists (``gemm_f32_fast``).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_FAST 1
#else
#define HAVE_FAST 0
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define NP 32     /* output columns per panel: two vectors of 16 */
#define HALF 16   /* gate (or up) columns per panel of a silu pair */
#define MR 12     /* most rows per micro-kernel call: 24 accumulators + 2 weights + broadcast */
#define CHUNK_BYTES (640 * 1024) /* x rows per pass over the panels: what stays in L2 beside a panel */

int gemm_f32_fast(void) { return HAVE_FAST; }

int64_t gemm_f32_packed_numel(int64_t n, int64_t k, int silu_pair) {
    int64_t cols = silu_pair ? HALF : NP;
    return ((n + cols - 1) / cols) * NP * k;
}

/* W (and up, for a silu pair; else NULL) [n, k] -> panels (see the top of the file). */
void gemm_f32_pack(const float *w, const float *up, int64_t n, int64_t k, float *out) {
    const int64_t cols = up ? HALF : NP, panels = (n + cols - 1) / cols;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < NP; c++) {
                const float *src = up && c >= HALF ? up : w;
                int64_t row = p * cols + (up ? c % HALF : c);
                out[(p * k + kk) * NP + c] = row < n ? src[row * k + kk] : 0.0f;
            }
}

static inline float silu_f(float g) { return g / (1.0f + expf(-g)); }

#if HAVE_FAST
/* exp(v) for 16 lanes: v = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7
 * (truncation < 1e-8 relative, below float32's half ulp), then scaled by 2^n. Within ~1 ulp
 * of expf; PyTorch's own vectorized silu differs from expf by as much. */
static inline __m512 exp16(__m512 v) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);  /* ln2, high part */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      /* ln2, low part */
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* The finished sums of `rows` rows x 32 columns (acc[r * NP + c]) into out. */
static void store_tile(const float *acc, int rows, float *out, int64_t ldo, int ncols,
                       const float *bias, int silu, int path) {
    for (int r = 0; r < rows; r++) {
        const float *a = acc + r * NP;
        float *o = out + r * ldo;
        if (silu) {
#if HAVE_FAST
            if (path == 0) {
                const __m512 g = _mm512_loadu_ps(a), u = _mm512_loadu_ps(a + HALF);
                const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
                const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
                _mm512_mask_storeu_ps(o, (__mmask16)((1u << ncols) - 1), _mm512_mul_ps(s, u));
                continue;
            }
#endif
            for (int c = 0; c < ncols; c++) o[c] = silu_f(a[c]) * a[HALF + c];
        } else {
            for (int c = 0; c < ncols; c++) o[c] = bias ? a[c] + bias[c] : a[c];
        }
    }
}

static void tile_portable(const float *x, int64_t ldx, int rows, const float *pw, int64_t k,
                          float *acc) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < NP; c++) {
            float s = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) s = fmaf(x[r * ldx + kk], pw[kk * NP + c], s);
            acc[r * NP + c] = s;
        }
}

#if HAVE_FAST
/* acc[r * NP + c] for R rows; prefetches `pf_lines` 64-byte lines from `pf`, one per k. */
static inline __attribute__((always_inline)) void tile_fast(
        const float *x, int64_t ldx, const int R, const float *pw, int64_t k, float *acc,
        const char *pf, int64_t pf_lines) {
    __m512 a[MR][2];
    for (int r = 0; r < R; r++) { a[r][0] = _mm512_setzero_ps(); a[r][1] = _mm512_setzero_ps(); }
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 w0 = _mm512_loadu_ps(pw + kk * NP), w1 = _mm512_loadu_ps(pw + kk * NP + 16);
        if (kk < pf_lines) _mm_prefetch(pf + kk * 64, _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(x[r * ldx + kk]);
            a[r][0] = _mm512_fmadd_ps(xb, w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(xb, w1, a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(acc + r * NP, a[r][0]);
        _mm512_storeu_ps(acc + r * NP + 16, a[r][1]);
    }
}

#define FAST_CASE(R) case R: tile_fast(xr, ldx, R, pw, k, acc, pf, pf_lines); break;

static void tile_dispatch(const float *xr, int64_t ldx, int rows, const float *pw, int64_t k,
                          float *acc, const char *pf, int64_t pf_lines) {
    switch (rows) {
        FAST_CASE(1) FAST_CASE(2) FAST_CASE(3) FAST_CASE(4) FAST_CASE(5) FAST_CASE(6)
        FAST_CASE(7) FAST_CASE(8) FAST_CASE(9) FAST_CASE(10) FAST_CASE(11) FAST_CASE(12)
        default: break;
    }
}
#endif

/* One thread's share: panels p0..p1 over rows 0..m. */
static void run_panels(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
                       int64_t k, const float *bias, float *out, int64_t ldo, int64_t p0,
                       int64_t p1, int silu, int path) {
    const int64_t cols = silu ? HALF : NP;
    const int64_t lines = k * NP * (int64_t)sizeof(float) / 64; /* a panel's cache lines */
    float acc[MR * NP] __attribute__((aligned(64)));
    int64_t chunk = CHUNK_BYTES / (k * (int64_t)sizeof(float));
    if (chunk < MR) chunk = MR;
    const int64_t chunks = (m + chunk - 1) / chunk;
    chunk = (m + chunks - 1) / chunks;
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
        const int64_t mc = m - c0 < chunk ? m - c0 : chunk;
        const int64_t nb = (mc + MR - 1) / MR; /* near-equal blocks of at most MR rows */
        const int64_t per = (lines + nb - 1) / nb; /* next-panel lines prefetched per block */
        for (int64_t p = p0; p < p1; p++) {
            const float *pw = packed + p * k * NP;
            const char *next = p + 1 < p1 ? (const char *)(pw + k * NP) : NULL;
            const int ncols = (int)(n - p * cols < cols ? n - p * cols : cols);
            int64_t r0 = 0;
            for (int64_t b = 0; b < nb; b++) {
                const int rows = (int)(mc / nb + (b < mc % nb));
                const float *xr = x + (c0 + r0) * ldx;
                int64_t first = b * per, count = 0;
                if (next && first < lines) count = lines - first < per ? lines - first : per;
                if (count > k) count = k;
#if HAVE_FAST
                if (path == 0) tile_dispatch(xr, ldx, rows, pw, k, acc,
                                             next ? next + first * 64 : NULL, count);
                else
#endif
                    tile_portable(xr, ldx, rows, pw, k, acc);
                store_tile(acc, rows, out + (c0 + r0) * ldo + p * cols, ldo, ncols,
                           bias ? bias + p * cols : NULL, silu, path);
                r0 += rows;
            }
        }
    }
}

static int gemm_any(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t n,
                    int64_t k, const float *bias, float *out, int64_t ldo, int num_threads,
                    int silu, int path) {
    if (m < 0 || n <= 0 || k <= 0 || ldx < k || ldo < n) return 1;
    if (m == 0) return 0;
    const int64_t panels = (n + (silu ? HALF : NP) - 1) / (silu ? HALF : NP);
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > panels) nt = (int)panels;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
#else
        const int t = 0, team = 1;
#endif
        run_panels(x, m, ldx, packed, n, k, bias, out, ldo, panels * t / team,
                   panels * (t + 1) / team, silu, path);
    }
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

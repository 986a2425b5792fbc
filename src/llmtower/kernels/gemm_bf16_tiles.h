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
 * Micro-kernel: up to MR = 6 rows x 64 columns: 24 float32 accumulators, 4 weight vectors per
 * input pair, the row's pair broadcast. Rows of one thread's tile run in near-equal blocks of at
 * most MR, and while they run, the next tile of the thread's share is prefetched (spread over the
 * blocks), so the memory read overlaps the arithmetic; the tile (K x 128 bytes) stays in L2 while
 * every block passes over it. Rows are taken in chunks of at most CHUNK_BYTES of x.
 */
#ifndef LLMTOWER_GEMM_BF16_TILES_H
#define LLMTOWER_GEMM_BF16_TILES_H

#include "gemv_bf16_tiles.h" /* TILE, tile_portable, pair_of, HAVE_FAST, bf16 conversions */
#ifdef _OPENMP
#include <omp.h>
#endif

#define GEMM_BF16_MR 6
#define GEMM_BF16_CHUNK_BYTES (512 * 1024)

#if HAVE_FAST
/* acc[r * TILE + c] for R rows of tile `tile`, the sums of gemv_bf16_tiles.h's tile_fast;
 * `pf_q` lines of `pf` prefetched per input pair, `pf_lines` in all. */
static inline __attribute__((always_inline)) void gemm_bf16_micro(
        const uint16_t *x, int64_t ldx, const int R, const uint16_t *tile, int64_t k, float *acc,
        const char *pf, int64_t pf_lines, int pf_q) {
    const int64_t pairs = (k + 1) / 2, full = k / 2;
    __m512 a[GEMM_BF16_MR][4];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < 4; b++) a[r][b] = _mm512_setzero_ps();
    const uint32_t *x32[GEMM_BF16_MR];
    for (int r = 0; r < R; r++) x32[r] = (const uint32_t *)(const void *)(x + r * ldx);
    const int64_t pf_pairs = pf ? (pf_lines + pf_q - 1) / pf_q : 0;
    int64_t p = 0;
    for (; p < full; p++) {
        const uint16_t *wp = tile + p * TILE * 2;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64);
        __m512bh w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
        if (p < pf_pairs)
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

#define GEMM_BF16_CASE(R) \
    case R: gemm_bf16_micro(x, ldx, R, tile, k, acc, pf, pf_lines, pf_q); return;

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

#if HAVE_FAST
/* expf(x) for 16 lanes, bit for bit glibc's (2.27+) expf as its FMA variant computes it (the one
 * glibc picks on any CPU with AVX512_BF16): in double, k = round(x * 32 / ln2) by the shift
 * trick, 2^(k/32) from a 32-entry table, a degree-3 polynomial, one rounding to float. Lanes
 * glibc sends to its special path (|x| >= ~88: overflow, underflow, inf, NaN) are flagged in
 * *special (their values here are meaningless); the caller computes those with expf.
 * gemm_bf16_exp_agrees() (gemm_bf16.c) checks it against this libm's expf once at load.
 * The method and its constants (the table's 2^(i/32) with i/32 taken out of the exponent, the
 * polynomial's coefficients) are those of Arm's optimized-routines expf (MIT OR Apache-2.0),
 * which glibc adopted; matching them is what makes the result glibc's to the bit. */
static const uint64_t gemm_bf16_exp_tab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};

static inline __m512d gemm_bf16_d(uint64_t bits) {
    return _mm512_castsi512_pd(_mm512_set1_epi64((long long)bits));
}

static inline __m256 gemm_bf16_exp8(__m256 xf) {
    const __m512d xd = _mm512_cvtps_pd(xf);
    const __m512d inv = gemm_bf16_d(0x40471547652b82feull), shift = gemm_bf16_d(0x4338000000000000ull);
    const __m512d kd = _mm512_fmadd_pd(inv, xd, shift);
    const __m512i ki = _mm512_castpd_si512(kd);
    const __m512d r = _mm512_fmsub_pd(inv, xd, _mm512_sub_pd(kd, shift));
    const __m512i idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
    const __m512i lo = _mm512_permutex2var_epi64(_mm512_loadu_si512(gemm_bf16_exp_tab), idx,
                                                 _mm512_loadu_si512(gemm_bf16_exp_tab + 8));
    const __m512i hi = _mm512_permutex2var_epi64(_mm512_loadu_si512(gemm_bf16_exp_tab + 16), idx,
                                                 _mm512_loadu_si512(gemm_bf16_exp_tab + 24));
    const __mmask8 upper = _mm512_test_epi64_mask(idx, _mm512_set1_epi64(16));
    const __m512i t = _mm512_add_epi64(_mm512_mask_mov_epi64(lo, upper, hi),
                                       _mm512_slli_epi64(ki, 47));
    const __m512d sc = _mm512_castsi512_pd(t);
    const __m512d z = _mm512_fmadd_pd(r, gemm_bf16_d(0x3ebc6af84b912394ull), gemm_bf16_d(0x3f2ebfce50fac4f3ull));
    const __m512d r2 = _mm512_mul_pd(r, r);
    __m512d y = _mm512_fmadd_pd(r, gemm_bf16_d(0x3f962e42ff0c52d6ull), _mm512_set1_pd(1.0));
    y = _mm512_fmadd_pd(z, r2, y);
    return _mm512_cvtpd_ps(_mm512_mul_pd(y, sc));
}

static inline __m512 gemm_bf16_exp16(__m512 x, __mmask16 *special) {
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20),
                                         _mm512_set1_epi32(0x7ff));
    *special = _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(0x42a));
    const __m256 a = gemm_bf16_exp8(_mm512_castps512_ps256(x));
    const __m256 b = gemm_bf16_exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)),
                                               _mm256_castps_pd(b), 1));
}

/* f32_to_bf16 in 16 lanes, in the low 16 bits of each 32-bit lane (integer ops:
 * vcvtneps2bf16 would flush denormals). */
static inline __m512i gemm_bf16_round(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rnd = _mm512_srli_epi32(_mm512_add_epi32(
            _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(rnd, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16),
                                                           _mm512_set1_epi32(0x40)));
}
#endif

/* Whether gemm_bf16_exp16 is this libm's expf (set once at load by gemm_bf16_exp_agrees). */
static int gemm_bf16_vector_exp = 0;
/* Whether the next tile is prefetched (benchmarks switch it off to measure what it brings). */
static int gemm_bf16_prefetch = 1;

/* The finished sums of `rows` rows (acc[r * TILE + c]) into out: gemv_bf16_tiles.h's epilogue
 * (bias added in float32, one rounding to bfloat16; silu as there, in scalar expf). */
static void gemm_bf16_store(const float *acc, int rows, uint16_t *out, int64_t ldo, int ncols,
                            const uint16_t *bias, int silu) {
    for (int r = 0; r < rows; r++) {
        uint16_t *o = out + r * ldo;
        if (silu) {
            const float *g = acc + r * TILE, *u = g + TILE / 2;
            int c = 0;
#if HAVE_FAST
            if (gemm_bf16_vector_exp)
                for (; c + 16 <= ncols; c += 16) {
                    const __m512 gv = _mm512_loadu_ps(g + c);
                    __mmask16 special;
                    const __m512 e = gemm_bf16_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv),
                                                     &special);
                    if (special) break; /* these 16 and the rest: expf below */
                    const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
                    const __m512 sb = _mm512_castsi512_ps(_mm512_slli_epi32(gemm_bf16_round(sv), 16));
                    _mm256_storeu_si256((__m256i *)(void *)(o + c), _mm512_cvtepi32_epi16(
                            gemm_bf16_round(_mm512_mul_ps(sb, _mm512_loadu_ps(u + c)))));
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
            if (bias)
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(msk, bias + c0)), 16)));
            _mm256_mask_storeu_epi16(o + c0, msk, _mm512_cvtepi32_epi16(gemm_bf16_round(v)));
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
        const char *next = gemm_bf16_prefetch && t < t_last ? (const char *)(tile + tile_numel)
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
            gemm_bf16_store(acc, rows, out + r0 * ldo + t * cols, ldo, ncols,
                            bias ? bias + t * cols : NULL, silu);
            r0 += rows;
        }
    }
}

static void gemm_bf16_tiles(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *wp,
                            int64_t n, int64_t k, const uint16_t *bias, uint16_t *out,
                            int64_t ldo, int silu, int fast) {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
#else
    const int64_t t = 0, team = 1;
#endif
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

/* Causal self-attention of a fresh prefill chunk in float32 with AVX-512 (the float32 sibling
 * of prefill_attention.c).
 *
 *   q   : [n, num_heads, head_dim]     rows q_stride elements apart, heads and dims contiguous
 *   k, v: [n, num_kv_heads, head_dim]  rows k_stride / v_stride apart, likewise
 *   out : [n, num_heads, head_dim]     contiguous
 *
 * Query row i attends to keys 0 .. i (the chunk starts at position 0); query head h reads KV
 * head h / (num_heads / num_kv_heads). PyTorch's CPU SDPA takes ~1 s of a float32 64-prompt
 * SmolLM2 run for ~55 GFLOP of attention; here both products are register-blocked FMAs:
 *
 *   1. pack each KV head's keys transposed, [dim][key] (16 keys are one vector, a query's dim
 *      one broadcast);
 *   2. per (KV head, block of 16 query rows), for each of its query heads: the scores of 8
 *      rows x 32 keys per pass (16 accumulators), summed over the dims in order, times scale;
 *   3. exact softmax per row (maximum subtracted, exp, sum; keys past the row's own position
 *      get 0);
 *   4. weights x values, 4 rows x 64 dims per pass, float32 accumulators summed over the keys
 *      in order; the output is that sum divided by the exp sum.
 *
 * Every operation is float32 (no narrower rounding anywhere); the results differ from SDPA's
 * in summation order and in exp's last bits (vec_exp.h's, glibc's expf). Work units go largest first (later query blocks
 * see more keys) to OpenMP threads. Built only where the compiler targets AVX-512
 * (prefill_f32_supported() says whether it was); elsewhere the caller keeps SDPA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#include "vec_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PREFILL_F32_OK 1

enum { QB = 16, SR = 8, VR = 4 }; /* query rows per unit; rows per score / value pass */

/* sc[r * ld + j .. +32) = scale * sum_d q_r[d] * kt[d * npad + j ..] for R rows (NV: 1 or 2
 * vectors of 16 keys). */
static inline __attribute__((always_inline)) void score_pass(
        const float *q, int64_t qs, const int R, const float *kt, int64_t npad, int64_t d,
        int64_t j, const int NV, float scale, float *sc, int64_t ld) {
    __m512 a[SR][2];
    for (int r = 0; r < R; r++) { a[r][0] = _mm512_setzero_ps(); a[r][1] = _mm512_setzero_ps(); }
    for (int64_t dd = 0; dd < d; dd++) {
        const float *kr = kt + dd * npad + j;
        const __m512 k0 = _mm512_loadu_ps(kr);
        const __m512 k1 = NV > 1 ? _mm512_loadu_ps(kr + 16) : k0;
        for (int r = 0; r < R; r++) {
            const __m512 qb = _mm512_set1_ps(q[r * qs + dd]);
            a[r][0] = _mm512_fmadd_ps(qb, k0, a[r][0]);
            if (NV > 1) a[r][1] = _mm512_fmadd_ps(qb, k1, a[r][1]);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(sc + r * ld + j, _mm512_mul_ps(a[r][0], s));
        if (NV > 1) _mm512_storeu_ps(sc + r * ld + j + 16, _mm512_mul_ps(a[r][1], s));
    }
}

#define SCORE_CASE(R) case R: \
    if (two) score_pass(q, qs, R, kt, npad, d, j, 2, scale, sc, ld); \
    else score_pass(q, qs, R, kt, npad, d, j, 1, scale, sc, ld); break;

static void scores(const float *q, int64_t qs, int rows, const float *kt, int64_t npad,
                   int64_t d, int64_t kpad, float scale, float *sc, int64_t ld) {
    for (int64_t j = 0; j < kpad; j += 32) {
        const int two = j + 16 < kpad;
        switch (rows) {
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4)
            SCORE_CASE(5) SCORE_CASE(6) SCORE_CASE(7) SCORE_CASE(8)
            default: break;
        }
    }
}

/* out_r[dc .. dc + 16 NV) = sum_{j < kend} p_r[j] * v[j][dc ..] / sums[r] for R rows. */
static inline __attribute__((always_inline)) void value_pass(
        const float *p, int64_t ld, const int R, const float *v, int64_t vs, int64_t kend,
        const int NV, const float *sums, float *out, int64_t os) {
    __m512 a[VR][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < NV; i++) a[r][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kend; j++) {
        __m512 vb[4];
        for (int i = 0; i < NV; i++) vb[i] = _mm512_loadu_ps(v + j * vs + 16 * i);
        for (int r = 0; r < R; r++) {
            const __m512 pb = _mm512_set1_ps(p[r * ld + j]);
            for (int i = 0; i < NV; i++) a[r][i] = _mm512_fmadd_ps(pb, vb[i], a[r][i]);
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512 s = _mm512_set1_ps(sums[r]);
        for (int i = 0; i < NV; i++) _mm512_storeu_ps(out + r * os + 16 * i, _mm512_div_ps(a[r][i], s));
    }
}

#define VALUE_ROWS(R) case R: switch (nv) { \
    case 1: value_pass(p, ld, R, v, vs, kend, 1, sums, out, os); break; \
    case 2: value_pass(p, ld, R, v, vs, kend, 2, sums, out, os); break; \
    case 3: value_pass(p, ld, R, v, vs, kend, 3, sums, out, os); break; \
    default: value_pass(p, ld, R, v, vs, kend, 4, sums, out, os); break; } break;

static void values(const float *p, int64_t ld, int rows, const float *v, int64_t vs,
                   int64_t kend, int nv, const float *sums, float *out, int64_t os) {
    switch (rows) {
        VALUE_ROWS(1) VALUE_ROWS(2) VALUE_ROWS(3) VALUE_ROWS(4)
        default: break;
    }
}

/* One work unit: query rows r0 .. r0 + rows of every query head of KV head kh. */
static void unit(const float *q, int64_t qs, const float *kt, const float *v, int64_t vs,
                 float *out, int64_t n, int64_t h, int64_t G, int64_t d, int64_t npad,
                 int64_t kh, int64_t r0, int rows, float scale, float *sc, float *sums) {
    const int64_t kend = r0 + rows, kpad = (kend + 15) / 16 * 16;
    const float *ktk = kt + kh * d * npad;
    for (int64_t g = 0; g < G; g++) {
        const int64_t hq = kh * G + g;
        for (int rr = 0; rr < rows; rr += SR)
            scores(q + (r0 + rr) * qs + hq * d, qs, rows - rr < SR ? rows - rr : SR, ktk, npad, d,
                   kpad, scale, sc + rr * npad, npad);
        for (int r = 0; r < rows; r++) {
            float *s = sc + r * npad;
            const int64_t valid = r0 + r + 1; /* keys 0 .. r0 + r */
            __m512 mx = _mm512_set1_ps(-INFINITY);
            int64_t j = 0;
            for (; j + 16 <= valid; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
            const __mmask16 tail = (__mmask16)((1u << (valid - j)) - 1);
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, s + j));
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 sum = _mm512_setzero_ps();
            for (j = 0; j < kpad; j += 16) {
                __mmask16 live = j + 16 <= valid ? 0xffff
                    : j < valid ? (__mmask16)((1u << (valid - j)) - 1) : 0;
                __m512 e = _mm512_maskz_mov_ps(live, exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
                _mm512_storeu_ps(s + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            sums[r] = _mm512_reduce_add_ps(sum);
        }
        for (int64_t dc = 0; dc < d; dc += 64) {
            const int nv = (int)((d - dc) / 16 < 4 ? (d - dc) / 16 : 4);
            for (int rr = 0; rr < rows; rr += VR)
                values(sc + rr * npad, npad, rows - rr < VR ? rows - rr : VR, v + kh * d + dc, vs,
                       r0 + rr + (rows - rr < VR ? rows - rr : VR), nv, sums + rr,
                       out + ((r0 + rr) * h + hq) * d + dc, h * d);
        }
    }
    (void)n;
}
#else
#define PREFILL_F32_OK 0
#endif

int prefill_f32_supported(void) { return PREFILL_F32_OK; }

/* 0: done; -1: out of memory; 1: bad arguments; 2: not built for this CPU. */
int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                          const float *v, int64_t v_stride, float *out, int64_t n,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                          int num_threads) {
#if PREFILL_F32_OK
    if (n < 0 || num_kv_heads < 1 || num_heads % num_kv_heads || head_dim % 16 || head_dim < 16)
        return 1;
    if (n == 0) return 0;
    const int64_t d = head_dim, G = num_heads / num_kv_heads, npad = (n + 15) / 16 * 16;
    const int64_t nblocks = (n + QB - 1) / QB, units = num_kv_heads * nblocks;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(num_kv_heads * d * npad));
    if (!kt) return -1;
    int failed = 0;
#pragma omp parallel num_threads(kernel_threads(num_threads, units)) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {
            float *dst = kt + kh * d * npad;
            for (int64_t j = 0; j < npad; j++)
                for (int64_t dd = 0; dd < d; dd++)
                    dst[dd * npad + j] = j < n ? k[j * k_stride + kh * d + dd] : 0.0f;
        }
        float *sc = malloc(sizeof(float) * (size_t)(QB * npad));
        float *sums = malloc(sizeof(float) * QB);
        if (!sc || !sums) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            if (!sc || !sums) continue;
            const int64_t b = nblocks - 1 - u / num_kv_heads, kh = u % num_kv_heads;
            const int64_t r0 = b * QB;
            unit(q, q_stride, kt, v, v_stride, out, n, num_heads, G, d, npad, kh, r0,
                 (int)(n - r0 < QB ? n - r0 : QB), scale, sc, sums);
        }
        free(sc);
        free(sums);
    }
    free(kt);
    return failed ? -1 : 0;
#else
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)out;
    (void)n; (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)scale; (void)num_threads;
    return 2;
#endif
}

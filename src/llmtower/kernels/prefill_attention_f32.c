/* Causal self-attention of a fresh prefill chunk in float32 on vec.h's vector layer (AVX-512,
 * AVX2 + FMA, NEON; the float32 sibling of prefill_attention.c).
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
 * in summation order and in exp's last bits (vec_exp.h's, glibc's expf). Work units go largest
 * first (later query blocks see more keys) to OpenMP threads. The passes' sizes above are
 * AVX-512's (16 lanes); AVX2 takes 6 rows x 16 keys and 4 rows x 16 dims per pass, NEON 8 x 8
 * and 4 x 16 (the registers: vec.h's VEC_LANES and 16 or 32 of them). Built where vec.h has a
 * vector layer (prefill_f32_supported() says whether it was); elsewhere the caller keeps SDPA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threads.h"
#include "vec.h"

#if VEC_FAST
#define PREFILL_F32_OK 1

/* query rows per unit; rows per score pass (2 vectors of keys each) / value pass, and vectors
 * of dims per value pass: sized to the registers (AVX-512, NEON: 32, 8 x 2 + 3 and 4 x 4 + 5;
 * AVX2: 16, 6 x 2 + 3 and 4 x 2 + 3) */
#define QB 16
#define VR 4
#if VEC_LANES == 16 || defined(__aarch64__)
#define SR 8
#define VN 4
#else
#define SR 6
#define VN 2
#endif
#define L VEC_LANES

/* sc[r * ld + j .. +2L) = scale * sum_d q_r[d] * kt[d * npad + j ..] for R rows (NV: 1 or 2
 * vectors of L keys). */
static inline __attribute__((always_inline)) void score_pass(
        const float *q, int64_t qs, const int R, const float *kt, int64_t npad, int64_t d,
        int64_t j, const int NV, float scale, float *sc, int64_t ld) {
    vf a[SR][2];
    for (int r = 0; r < R; r++) { a[r][0] = vf_zero(); a[r][1] = vf_zero(); }
    for (int64_t dd = 0; dd < d; dd++) {
        const float *kr = kt + dd * npad + j;
        const vf k0 = vf_load(kr);
        const vf k1 = NV > 1 ? vf_load(kr + L) : k0;
        for (int r = 0; r < R; r++) {
            const vf qb = vf_set1(q[r * qs + dd]);
            a[r][0] = vf_fma(qb, k0, a[r][0]);
            if (NV > 1) a[r][1] = vf_fma(qb, k1, a[r][1]);
        }
    }
    const vf s = vf_set1(scale);
    for (int r = 0; r < R; r++) {
        vf_store(sc + r * ld + j, vf_mul(a[r][0], s));
        if (NV > 1) vf_store(sc + r * ld + j + L, vf_mul(a[r][1], s));
    }
}

#define SCORE_CASE(R) case R: \
    if (two) score_pass(q, qs, R, kt, npad, d, j, 2, scale, sc, ld); \
    else score_pass(q, qs, R, kt, npad, d, j, 1, scale, sc, ld); break;

static void scores(const float *q, int64_t qs, int rows, const float *kt, int64_t npad,
                   int64_t d, int64_t kpad, float scale, float *sc, int64_t ld) {
    for (int64_t j = 0; j < kpad; j += 2 * L) {
        const int two = j + L < kpad;
        switch (rows) {
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4)
            SCORE_CASE(5) SCORE_CASE(6)
#if SR > 6
            SCORE_CASE(7) SCORE_CASE(8)
#endif
            default: break;
        }
    }
}

/* out_r[dc .. dc + L NV) = sum_{j < kend} p_r[j] * v[j][dc ..] / sums[r] for R rows. */
static inline __attribute__((always_inline)) void value_pass(
        const float *p, int64_t ld, const int R, const float *v, int64_t vs, int64_t kend,
        const int NV, const float *sums, float *out, int64_t os) {
    vf a[VR][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < NV; i++) a[r][i] = vf_zero();
    for (int64_t j = 0; j < kend; j++) {
        vf vb[4];
        for (int i = 0; i < NV; i++) vb[i] = vf_load(v + j * vs + L * i);
        for (int r = 0; r < R; r++) {
            const vf pb = vf_set1(p[r * ld + j]);
            for (int i = 0; i < NV; i++) a[r][i] = vf_fma(pb, vb[i], a[r][i]);
        }
    }
    for (int r = 0; r < R; r++) {
        const vf s = vf_set1(sums[r]);
        for (int i = 0; i < NV; i++) vf_store(out + r * os + L * i, vf_div(a[r][i], s));
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
            vf mx = vf_set1(-INFINITY);
            int64_t j = 0;
            for (; j + L <= valid; j += L) mx = vf_max(mx, vf_load(s + j));
            mx = vf_max(mx, vf_load_n(s + j, valid - j, -INFINITY));
            const vf m = vf_set1(vf_reduce_max(mx));
            vf sum = vf_zero();
            for (j = 0; j < kpad; j += L) {
                const vf e = vf_keep_n(vf_exp_nonpos(vf_sub(vf_load(s + j), m)), valid - j);
                vf_store(s + j, e);
                sum = vf_add(sum, e);
            }
            sums[r] = vf_reduce_add(sum);
        }
        for (int64_t dc = 0; dc < d; dc += VN * L) {
            const int nv = (int)((d - dc) / L < VN ? (d - dc) / L : VN);
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

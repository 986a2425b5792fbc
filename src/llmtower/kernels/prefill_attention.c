/* Causal self-attention of a fresh prefill chunk in bfloat16 with AVX-512 BF16 (vdpbf16ps).
 *
 *   q   : [n, num_heads, head_dim]     rows q_stride elements apart, heads and dims contiguous
 *   k, v: [n, num_kv_heads, head_dim]  rows k_stride / v_stride apart, likewise
 *   out : [n, num_heads, head_dim]     contiguous
 *
 * Query row i attends to keys 0 .. i (the chunk starts at position 0); query head h reads KV
 * head h / (num_heads / num_kv_heads). PyTorch's CPU SDPA (flash attention) runs these shapes
 * (SmolLM2: 9 heads, 3 KV heads, 64 dims, 32-2048 rows) at ~50 GFLOP/s in bfloat16, slower
 * than in float32; this kernel computes both products as blocked matrix products on the
 * bfloat16 dot-product instruction, 32 products per instruction:
 *
 *   1. pack: per KV head, the keys as [tile of 16 keys][dim pair][16 keys][2] (so that a score
 *      tile of 16 keys is one register and a query's dim pair one broadcast), and the values as
 *      [key pair][dim][2] (a weight pair broadcast times 16 dims' pairs is one instruction);
 *   2. per (KV head, block of 16 query rows): the scores of the block's 16 x G query vectors
 *      against keys 0 .. the block's last row, in float32 (4 queries x 32 keys per pass);
 *   3. exact softmax per query vector (maximum subtracted, exp, sum; keys past the row's own
 *      position get 0), the numerators rounded to bfloat16 (as PyTorch's flash attention
 *      rounds its weights before their product with the values);
 *   4. weights x values, 4 queries x head_dim per pass, float32 accumulators; the output is
 *      the sum divided by the exp sum, rounded to nearest-even bfloat16.
 *
 * Each product of two bfloat16 numbers is exact in float32, so the results differ from SDPA's
 * only in summation order and in where the scale is applied (to the float32 score). Built
 * only where the compiler targets AVX-512 BF16 (prefill_supported() says whether it was);
 * elsewhere, and in float32, the caller keeps SDPA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "threads.h"
#include "vec_exp.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PREFILL_OK 1

enum { QB = 16 }; /* query rows per work unit */

static inline __m512bh bh(__m512i x) { return (__m512bh)x; }

/* scores[x][0 .. kend) for NQ (1..4) query vectors, 32 keys per pass (two 16-key tiles) */
static inline __attribute__((always_inline)) void score_block(
        const uint32_t *kp, const uint32_t *const *qx, float *const *sx, int64_t kend,
        float scale, const int64_t D, const int NQ) {
    const int64_t P = D / 2; /* dim pairs */
    const __m512 sc = _mm512_set1_ps(scale);
    int64_t t0 = 0;
    for (; t0 + 32 <= kend; t0 += 32) {
        const uint32_t *k0 = kp + (t0 / 16) * P * 16, *k1 = k0 + P * 16;
        __m512 a0[4], a1[4];
        for (int i = 0; i < NQ; i++) a0[i] = a1[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < P; c++) {
            const __m512i v0 = _mm512_loadu_si512(k0 + c * 16), v1 = _mm512_loadu_si512(k1 + c * 16);
            for (int i = 0; i < NQ; i++) {
                const __m512i b = _mm512_set1_epi32((int)qx[i][c]);
                a0[i] = _mm512_dpbf16_ps(a0[i], bh(b), bh(v0));
                a1[i] = _mm512_dpbf16_ps(a1[i], bh(b), bh(v1));
            }
        }
        for (int i = 0; i < NQ; i++) {
            _mm512_storeu_ps(sx[i] + t0, _mm512_mul_ps(a0[i], sc));
            _mm512_storeu_ps(sx[i] + t0 + 16, _mm512_mul_ps(a1[i], sc));
        }
    }
    for (; t0 < kend; t0 += 16) { /* a last tile of 16 (keys past kend are packed as zeros) */
        const uint32_t *k0 = kp + (t0 / 16) * P * 16;
        __m512 a0[4];
        for (int i = 0; i < NQ; i++) a0[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < P; c++) {
            const __m512i v0 = _mm512_loadu_si512(k0 + c * 16);
            for (int i = 0; i < NQ; i++)
                a0[i] = _mm512_dpbf16_ps(a0[i], bh(_mm512_set1_epi32((int)qx[i][c])), bh(v0));
        }
        for (int i = 0; i < NQ; i++) _mm512_storeu_ps(sx[i] + t0, _mm512_mul_ps(a0[i], sc));
    }
}

/* acc[i][0 .. D) = sum_p w[i][p] v[p] for NQ (1..4) query vectors over key pairs 0 .. npair */
static inline __attribute__((always_inline)) void weigh_block(
        const uint32_t *vp, const uint32_t *const *wx, float *const *ax, int64_t npair,
        const int64_t D, const int NQ) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) { /* 4 x 16 dims per pass: 16 accumulators */
        const int CW = D - d0 >= 64 ? 4 : (int)((D - d0) / 16);
        __m512 a[4][4];
        for (int i = 0; i < NQ; i++)
            for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_ps();
        for (int64_t pp = 0; pp < npair; pp++) {
            const uint32_t *row = vp + pp * D + d0;
            __m512i v[4];
            for (int c = 0; c < 4; c++)
                if (c < CW) v[c] = _mm512_loadu_si512(row + c * 16);
            for (int i = 0; i < NQ; i++) {
                const __m512i b = _mm512_set1_epi32((int)wx[i][pp]);
                for (int c = 0; c < 4; c++)
                    if (c < CW) a[i][c] = _mm512_dpbf16_ps(a[i][c], bh(b), bh(v[c]));
            }
        }
        for (int i = 0; i < NQ; i++)
            for (int c = 0; c < 4; c++)
                if (c < CW) _mm512_storeu_ps(ax[i] + d0 + c * 16, a[i][c]);
    }
}

typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    int64_t n, q_stride, k_stride, v_stride, H, Hkv, D;
    float scale;
    uint32_t *kp, *vp; /* packed keys / values of every KV head */
    int64_t ntiles, npairs;
} Job;

static void pack(const Job *j, int64_t g) {
    const int64_t D = j->D, P = D / 2;
    uint32_t *kp = j->kp + g * j->ntiles * P * 16;
    for (int64_t tile = 0; tile < j->ntiles; tile++)
        for (int64_t t = 0; t < 16; t++) {
            const int64_t p = tile * 16 + t;
            const uint32_t *src = (const uint32_t *)(j->k + p * j->k_stride + g * D);
            uint32_t *dst = kp + tile * P * 16 + t;
            for (int64_t c = 0; c < P; c++) dst[c * 16] = p < j->n ? src[c] : 0u;
        }
    uint16_t *vp = (uint16_t *)(j->vp + g * j->npairs * D);
    for (int64_t pp = 0; pp < j->npairs; pp++)
        for (int64_t e = 0; e < 2; e++) {
            const int64_t p = 2 * pp + e;
            const uint16_t *src = j->v + p * j->v_stride + g * D;
            for (int64_t d = 0; d < D; d++) vp[(pp * D + d) * 2 + e] = p < j->n ? src[d] : 0;
        }
}

/* One (KV head g, query rows r0 .. r0 + QB - 1) unit. Scratch: qv [QB*G][P] query pairs,
 * scores [QB*G][kpad] float, w [QB*G][kpad] bfloat16 weights, acc [QB*G][D], sums [QB*G]. */
static void unit(const Job *j, int64_t g, int64_t r0, uint32_t *qv, float *scores, uint16_t *w,
                 float *acc, float *sums, int64_t kpad) {
    const int64_t D = j->D, P = D / 2, G = j->H / j->Hkv;
    const int64_t nr = j->n - r0 < QB ? j->n - r0 : QB, Q = nr * G, kend = r0 + nr;
    const int64_t kp16 = (kend + 15) / 16 * 16, npair = (kend + 1) / 2;
    for (int64_t x = 0; x < Q; x++) /* x = i * G + jj: row r0 + i, query head g * G + jj */
        memcpy(qv + x * P, j->q + (r0 + x / G) * j->q_stride + (g * G + x % G) * D, D * 2);
    const uint32_t *kp = j->kp + g * j->ntiles * P * 16;
    const uint32_t *vp = j->vp + g * j->npairs * D;
    for (int64_t x0 = 0; x0 < Q; x0 += 4) {
        const int nq = Q - x0 < 4 ? (int)(Q - x0) : 4;
        const uint32_t *qx[4];
        float *sx[4];
        for (int i = 0; i < 4; i++) {
            const int64_t x = x0 + (i < nq ? i : 0);
            qx[i] = qv + x * P;
            sx[i] = scores + x * kpad;
        }
        switch (nq) {
            case 1: score_block(kp, qx, sx, kp16, j->scale, D, 1); break;
            case 2: score_block(kp, qx, sx, kp16, j->scale, D, 2); break;
            case 3: score_block(kp, qx, sx, kp16, j->scale, D, 3); break;
            default: score_block(kp, qx, sx, kp16, j->scale, D, 4);
        }
    }
    for (int64_t x = 0; x < Q; x++) { /* softmax numerators; row r0 + x / G sees len keys */
        const int64_t len = r0 + x / G + 1;
        float *sx = scores + x * kpad;
        uint16_t *wx = w + x * kpad;
        __m512 m = _mm512_set1_ps(-INFINITY);
        int64_t p = 0;
        for (; p + 16 <= len; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sx + p));
        const __mmask16 tail = (__mmask16)((1u << (len - p)) - 1u);
        m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, sx + p));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (p = 0; p < 2 * npair; p += 16) {
            const int64_t left = len - p;
            const __mmask16 live = left >= 16 ? (__mmask16)0xffff
                                 : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
            const __m512 e = _mm512_maskz_mov_ps(live, exp16_nonpos(
                _mm512_sub_ps(_mm512_maskz_loadu_ps(live, sx + p), mx)));
            const __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
            /* the sum of the weights as rounded, so that they sum to 1 after the division */
            sum = _mm512_add_ps(sum, bf16x16_to_f32(eb));
            const int64_t room = 2 * npair - p; /* whole pairs: npair * 2 may end inside a tile */
            const __mmask16 st = room >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << room) - 1u);
            _mm256_mask_storeu_epi16(wx + p, st, eb);
        }
        sums[x] = _mm512_reduce_add_ps(sum);
    }
    for (int64_t x0 = 0; x0 < Q; x0 += 4) {
        const int nq = Q - x0 < 4 ? (int)(Q - x0) : 4;
        const uint32_t *wx[4];
        float *ax[4];
        for (int i = 0; i < 4; i++) {
            const int64_t x = x0 + (i < nq ? i : 0);
            wx[i] = (const uint32_t *)(w + x * kpad);
            ax[i] = acc + x * D;
        }
        switch (nq) {
            case 1: weigh_block(vp, wx, ax, npair, D, 1); break;
            case 2: weigh_block(vp, wx, ax, npair, D, 2); break;
            case 3: weigh_block(vp, wx, ax, npair, D, 3); break;
            default: weigh_block(vp, wx, ax, npair, D, 4);
        }
    }
    for (int64_t x = 0; x < Q; x++) {
        const float inv = 1.f / sums[x];
        uint16_t *o = j->out + ((r0 + x / G) * j->H + g * G + x % G) * D;
        for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(acc[x * D + d] * inv);
    }
}
#endif

/* 1 when this build has the kernel (AVX-512 BF16), else 0 */
int prefill_supported(void) {
#ifdef PREFILL_OK
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, -1 (no memory for the scratch), -2 (shapes: head_dim not a multiple of 32, heads
 * not a multiple of the KV heads, n < 1) or -3 (built without AVX-512 BF16). */
int prefill_attention(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                      const void *v, int64_t v_stride, void *out, int64_t n, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, float scale, int num_threads) {
#ifdef PREFILL_OK
    if (n < 1 || head_dim % 32 || head_dim > 512 || num_kv_heads < 1 || num_heads % num_kv_heads)
        return -2;
    const int64_t D = head_dim, G = num_heads / num_kv_heads;
    const int64_t ntiles = (n + 15) / 16, npairs = (n + 1) / 2;
    Job j = {q, k, v, out, n, q_stride, k_stride, v_stride, num_heads, num_kv_heads, D, scale,
             malloc(sizeof(uint32_t) * (size_t)(num_kv_heads * ntiles * 16 * D / 2)),
             malloc(sizeof(uint32_t) * (size_t)(num_kv_heads * npairs * D)), ntiles, npairs};
    const int64_t kpad = ntiles * 16, Qmax = QB * G;
    const int64_t nblocks = (n + QB - 1) / QB, units = nblocks * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(kernel_threads(num_threads, units)) reduction(| : failed)
    {
        uint32_t *qv = malloc(sizeof(uint32_t) * (size_t)(Qmax * D / 2));
        float *scores = malloc(sizeof(float) * (size_t)(Qmax * kpad));
        uint16_t *w = malloc(sizeof(uint16_t) * (size_t)(Qmax * kpad));
        float *acc = malloc(sizeof(float) * (size_t)(Qmax * D));
        float *sums = malloc(sizeof(float) * (size_t)Qmax);
        /* (failed is this thread's reduction copy, 0 here: test everything itself) */
        const int ok = j.kp && j.vp && qv && scores && w && acc && sums;
        failed = !ok;
        if (j.kp && j.vp) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < num_kv_heads; g++) pack(&j, g);
            /* the last query blocks see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < units; u++)
                if (ok) unit(&j, u % num_kv_heads, (nblocks - 1 - u / num_kv_heads) * QB, qv,
                             scores, w, acc, sums, kpad);
        }
        free(qv);
        free(scores);
        free(w);
        free(acc);
        free(sums);
    }
    free(j.kp);
    free(j.vp);
    return failed ? -1 : 0;
#else
    (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)out; (void)n;
    (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)scale; (void)num_threads;
    return -3;
#endif
}

/* Paged decode attention over an int8 KV cache (--kv-cache-dtype int8) on CPU: the int8 twin
 * of paged_attention.c (same block tables; one query row per request as paged_decode, or several
 * causal rows per request as paged_decode_mq), reading
 * the quantized rows in place and widening them to float32 on the fly.
 *
 *   k_cache, v_cache : int8 [num_blocks, block_size, num_kv_heads, head_dim + 4 * groups]
 *                      contiguous; each (token, KV head) row: head_dim int8 values x[i], then
 *                      one float32 scale s_g per group of `gsize` channels (head_dim / gsize
 *                      groups); the stored value i is s_{i / gsize} * x[i] (kernels/kv_quant.py)
 *   block_tables     : [num_reqs, bt_stride] int64;  context_lens : [num_reqs] int64
 *   q, out           : [num_reqs, num_heads, head_dim] float32 or bfloat16 (one dtype);
 *                      consecutive q rows q_stride elements apart, out contiguous
 *
 * A group's scale factors out of its part of the dot product and of the weighted sum:
 *   score_t = sum_g s_tg * (q_g . x_tg),   out_g = sum_t (p_t * s_tg) * x_tg
 * so the inner loops multiply int8 values widened to float, with one scale per group. Work is
 * shared out by (request, KV head): the query heads of one KV head read each row once. The
 * softmax is exact (max, then exp and sum); all arithmetic is float32; bfloat16 results are
 * rounded to nearest-even on store. Built and loaded by llmtower/kernels/build.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "threads.h"

static inline float group_scale(const int8_t *row, int64_t head_dim, int64_t g) {
    float s;
    memcpy(&s, row + head_dim + 4 * g, sizeof s); /* packed behind the values; maybe unaligned */
    return s;
}

/* One (request, KV head): its nq query rows x `group` query heads (query vector x = i * group
 * + jj: row i, head g * group + jj) against the request's context; row i sees the keys up to
 * position first + i (first = ctx - nq), so one row per request is the plain decode; with a
 * window (> 0) only the keys after first + i - window.
 * qf [Q][D], acc [Q][D], scores [Q][ctx] with Q = nq * group: the calling thread's scratch. */
static void attend(const void *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                   const int64_t *table, int64_t ctx, int64_t q0, int64_t nq, void *out,
                   int64_t g, int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t bs,
                   int64_t gsize, float scale, int bf16, float *qf, float *acc, float *scores,
                   int64_t window) {
    const int64_t group = num_heads / num_kv_heads, ng = D / gsize, W = D + 4 * ng;
    const int64_t h0 = g * group, Q = nq * group, first = ctx - nq;
    /* the first row's first key; key t is seen by the rows before (t - first + window) */
    const int64_t lo = window > 0 && first + 1 > window ? first + 1 - window : 0;
#define SEEN_BY(t) (window > 0 && ((t) - first + window) * group < Q ? ((t) - first + window) * group : Q)
    for (int64_t x = 0; x < Q; x++) {
        for (int64_t i = 0; i < D; i++) {
            int64_t e = (q0 + x / group) * q_stride + (h0 + x % group) * D + i;
            float v = bf16 ? bf16_to_f32(((const uint16_t *)q)[e]) : ((const float *)q)[e];
            qf[x * D + i] = v * scale;
        }
    }
    for (int64_t t = lo; t < ctx; t++) {
        const int8_t *row = k_cache + ((table[t / bs] * bs + t % bs) * num_kv_heads + g) * W;
        for (int64_t x = (t > first ? t - first : 0) * group; x < SEEN_BY(t); x++) {
            const float *qj = qf + x * D;
            float total = 0.0f;
            for (int64_t c = 0; c < ng; c++) {
                const int8_t *xs = row + c * gsize;
                const float *qc = qj + c * gsize;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < gsize; i++) dot += qc[i] * (float)xs[i];
                total += group_scale(row, D, c) * dot;
            }
            scores[x * ctx + t] = total;
        }
    }
    for (int64_t x = 0; x < Q; x++) {
        const int64_t len = first + x / group + 1;
        const int64_t lx = window > 0 && len > window ? len - window : 0;
        float *sc = scores + x * ctx, m = -INFINITY, sum = 0.0f;
        for (int64_t t = lx; t < len; t++) m = sc[t] > m ? sc[t] : m;
        for (int64_t t = lx; t < len; t++) {
            sc[t] = expf(sc[t] - m);
            sum += sc[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = lx; t < len; t++) sc[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * Q * D);
    for (int64_t t = lo; t < ctx; t++) {
        const int8_t *row = v_cache + ((table[t / bs] * bs + t % bs) * num_kv_heads + g) * W;
        for (int64_t x = (t > first ? t - first : 0) * group; x < SEEN_BY(t); x++) {
            const float p = scores[x * ctx + t];
            for (int64_t c = 0; c < ng; c++) {
                const float w = p * group_scale(row, D, c);
                const int8_t *xs = row + c * gsize;
                float *ac = acc + x * D + c * gsize;
#pragma omp simd
                for (int64_t i = 0; i < gsize; i++) ac[i] += w * (float)xs[i];
            }
        }
    }
    for (int64_t x = 0; x < Q; x++) {
        for (int64_t i = 0; i < D; i++) {
            int64_t e = ((q0 + x / group) * num_heads + h0 + x % group) * D + i;
            if (bf16) ((uint16_t *)out)[e] = f32_to_bf16(acc[x * D + i]);
            else ((float *)out)[e] = acc[x * D + i];
        }
    }
#undef SEEN_BY
}

/* 0: done; -1: out of memory for the scratch buffers; -2: bad shapes. query_start: NULL for
 * one query row per request (row r), else [num_reqs + 1] offsets: request r owns the rows
 * query_start[r] .. query_start[r + 1] - 1, its newest tokens (paged_decode_mq's contract).
 * window > 0: a row at position p sees keys > p - window (0: none). */
int paged_decode_int8(const void *q, int64_t q_stride, const int8_t *k_cache,
                      const int8_t *v_cache, const int64_t *block_tables, int64_t bt_stride,
                      const int64_t *context_lens, const int64_t *query_start, void *out,
                      int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t gsize, float scale, int bf16,
                      int num_threads, int64_t window) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim < 1 || block_size < 1
        || gsize < 1 || head_dim % gsize)
        return -2;
    const int64_t group = num_heads / num_kv_heads, jobs = num_reqs * num_kv_heads;
    int64_t max_scores = 1, max_q = 1;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t nq = query_start ? query_start[r + 1] - query_start[r] : 1;
        if (nq < 1 || context_lens[r] < nq) return -2;
        max_scores = nq * context_lens[r] > max_scores ? nq * context_lens[r] : max_scores;
        max_q = nq > max_q ? nq : max_q;
    }
    int failed = 0;
#pragma omp parallel num_threads(kernel_threads(num_threads, jobs))
    {
        float *qf = malloc(sizeof(float) * (size_t)(max_q * group * head_dim));
        float *acc = malloc(sizeof(float) * (size_t)(max_q * group * head_dim));
        float *scores = malloc(sizeof(float) * (size_t)(group * max_scores));
        if (!qf || !acc || !scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < jobs; w++) {
            if (!qf || !acc || !scores) continue;
            const int64_t r = w / num_kv_heads, g = w % num_kv_heads;
            const int64_t q0 = query_start ? query_start[r] : r;
            const int64_t nq = query_start ? query_start[r + 1] - q0 : 1;
            attend(q, q_stride, k_cache, v_cache, block_tables + r * bt_stride, context_lens[r],
                   q0, nq, out, g, num_heads, num_kv_heads, head_dim, block_size, gsize, scale,
                   bf16, qf, acc, scores, window);
        }
        free(qf);
        free(acc);
        free(scores);
    }
    return failed ? -1 : 0;
}

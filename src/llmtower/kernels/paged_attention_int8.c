/* Paged decode attention over an int8 KV cache (--kv-cache-dtype int8) on CPU: the int8 twin
 * of paged_attention.c (same block tables, same one-query-token-per-request contract), reading
 * the quantized rows in place and widening them to float32 on the fly.
 *
 *   k_cache, v_cache : int8 [num_blocks, block_size, num_kv_heads, head_dim + 4 * groups]
 *                      contiguous; each (token, KV head) row: head_dim int8 values x[i], then
 *                      one float32 scale s_g per group of `gsize` channels (head_dim / gsize
 *                      groups); the stored value i is s_{i / gsize} * x[i] (executor/kv_quant.py)
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

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float group_scale(const int8_t *row, int64_t head_dim, int64_t g) {
    float s;
    memcpy(&s, row + head_dim + 4 * g, sizeof s); /* packed behind the values; maybe unaligned */
    return s;
}

/* One (request, KV head): its `group` query heads against the request's context.
 * qf [group][D] and acc [group][D], scores [group][ctx]: the calling thread's scratch. */
static void attend(const void *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                   const int64_t *table, int64_t ctx, void *out, int64_t r, int64_t g,
                   int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t bs,
                   int64_t gsize, float scale, int bf16, float *qf, float *acc, float *scores) {
    const int64_t group = num_heads / num_kv_heads, ng = D / gsize, W = D + 4 * ng;
    const int64_t h0 = g * group;
    for (int64_t j = 0; j < group; j++) {
        for (int64_t i = 0; i < D; i++) {
            int64_t e = r * q_stride + (h0 + j) * D + i;
            float x = bf16 ? bf16_to_f32(((const uint16_t *)q)[e]) : ((const float *)q)[e];
            qf[j * D + i] = x * scale;
        }
    }
    for (int64_t t = 0; t < ctx; t++) {
        const int8_t *row = k_cache + ((table[t / bs] * bs + t % bs) * num_kv_heads + g) * W;
        for (int64_t j = 0; j < group; j++) {
            const float *qj = qf + j * D;
            float total = 0.0f;
            for (int64_t c = 0; c < ng; c++) {
                const int8_t *x = row + c * gsize;
                const float *qc = qj + c * gsize;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < gsize; i++) dot += qc[i] * (float)x[i];
                total += group_scale(row, D, c) * dot;
            }
            scores[j * ctx + t] = total;
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float *sc = scores + j * ctx, m = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < ctx; t++) m = sc[t] > m ? sc[t] : m;
        for (int64_t t = 0; t < ctx; t++) {
            sc[t] = expf(sc[t] - m);
            sum += sc[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; t++) sc[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * group * D);
    for (int64_t t = 0; t < ctx; t++) {
        const int8_t *row = v_cache + ((table[t / bs] * bs + t % bs) * num_kv_heads + g) * W;
        for (int64_t j = 0; j < group; j++) {
            const float p = scores[j * ctx + t];
            for (int64_t c = 0; c < ng; c++) {
                const float w = p * group_scale(row, D, c);
                const int8_t *x = row + c * gsize;
                float *ac = acc + j * D + c * gsize;
#pragma omp simd
                for (int64_t i = 0; i < gsize; i++) ac[i] += w * (float)x[i];
            }
        }
    }
    for (int64_t j = 0; j < group; j++) {
        for (int64_t i = 0; i < D; i++) {
            int64_t e = (r * num_heads + h0 + j) * D + i;
            if (bf16) ((uint16_t *)out)[e] = f32_to_bf16(acc[j * D + i]);
            else ((float *)out)[e] = acc[j * D + i];
        }
    }
}

/* 0: done; -1: out of memory for the scratch buffers; -2: bad shapes. */
int paged_decode_int8(const void *q, int64_t q_stride, const int8_t *k_cache,
                      const int8_t *v_cache, const int64_t *block_tables, int64_t bt_stride,
                      const int64_t *context_lens, void *out, int64_t num_reqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t gsize, float scale, int bf16,
                      int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim < 1 || block_size < 1
        || gsize < 1 || head_dim % gsize)
        return -2;
    int64_t max_ctx = 0;
    for (int64_t r = 0; r < num_reqs; r++)
        max_ctx = context_lens[r] > max_ctx ? context_lens[r] : max_ctx;
    const int64_t group = num_heads / num_kv_heads, jobs = num_reqs * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        float *qf = malloc(sizeof(float) * (size_t)(group * head_dim));
        float *acc = malloc(sizeof(float) * (size_t)(group * head_dim));
        float *scores = malloc(sizeof(float) * (size_t)(group * max_ctx));
        if (!qf || !acc || !scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < jobs; w++) {
            if (!qf || !acc || !scores) continue;
            const int64_t r = w / num_kv_heads, g = w % num_kv_heads;
            attend(q, q_stride, k_cache, v_cache, block_tables + r * bt_stride, context_lens[r],
                   out, r, g, num_heads, num_kv_heads, head_dim, block_size, gsize, scale, bf16, qf,
                   acc, scores);
        }
        free(qf);
        free(acc);
        free(scores);
    }
    return failed ? -1 : 0;
}

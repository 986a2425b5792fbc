/* What the paged decode-attention kernels share (paged_attention.c: one query row per request;
 * paged_attention_grouped.c: the AVX-512 grouped-query path both entry points use;
 * paged_attention_vec.c: paged_decode's grouped path on vec.h where AVX-512 is missing;
 * paged_attention_mq.c: several query rows per request): the job description and the grouped
 * path's entry. See paged_attention.c for the layouts. */
#ifndef LLMTOWER_PAGED_ATTENTION_H
#define LLMTOWER_PAGED_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "threads.h"
#include "vec.h"

typedef struct {
    const void *q, *k, *v; /* float or uint16_t (bfloat16) elements */
    const int64_t *block_tables, *context_lens;
    void *out;
    int64_t num_reqs, q_stride, bt_stride, num_heads, num_kv_heads, head_dim, block_size;
    int64_t max_context;
    float scale;
    /* NULL: one query row per request; else request r owns the rows query_start[r] ..
     * query_start[r + 1] - 1 (paged_decode_mq, grouped path only) */
    const int64_t *query_start;
    /* > 0: a sliding window, a query at position p sees keys > p - window; 0: none */
    int64_t window;
} Job;

/* The first key a query at position pos sees (0 without a window). */
static inline int64_t window_first(const Job *j, int64_t pos) {
    const int64_t lo = j->window > 0 ? pos + 1 - j->window : 0;
    return lo > 0 ? lo : 0;
}

/* The portable paths' softmax numerators, in place: s[p] = expf(s[p] - max) for p < len;
 * returns their sum (each output is divided by it at the end). */
static inline float softmax_row(float *s, int64_t len) {
    float m = s[0], sum = 0.f;
    for (int64_t p = 1; p < len; p++) m = s[p] > m ? s[p] : m;
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < len; p++) {
        s[p] = expf(s[p] - m);
        sum += s[p];
    }
    return sum;
}

/* out[o0 .. o0 + D) = acc[0 .. D) / sum, in the output's dtype (bfloat16 rounded once): the last
 * step of every path, the softmax's division done on the weighted values. */
static inline __attribute__((always_inline)) void store_row(void *out, int64_t o0,
                                                            const float *acc, float sum,
                                                            int64_t D, const int BF16) {
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; d++) {
        const float o = acc[d] * inv;
        if (BF16) ((uint16_t *)out)[o0 + d] = f32_to_bf16(o);
        else ((float *)out)[o0 + d] = o;
    }
}

#if defined(__AVX512F__)
#define PAGED_GQA 1
/* The grouped path's loop (paged_attention_grouped.c) for the units of `j`, whose requests have
 * at most max_rows query rows; returns nonzero when scratch could not be had. */
int paged_decode_grouped(const Job *j, int64_t max_rows, int dtype, int num_threads);
#elif VEC_FAST
#define PAGED_VEC 1
/* softmax_row's numerators and sum on vec.h: vf_exp_nonpos (libm's expf of max(x, -87.3)), a
 * vector at a time, the tail lane by lane alike */
static inline float softmax_vec(float *s, int64_t len) {
    vf mx = vf_set1(-INFINITY);
    int64_t p = 0;
    for (; p + VEC_LANES <= len; p += VEC_LANES) mx = vf_max(mx, vf_load(s + p));
    const float m = vf_reduce_max(vf_max(mx, vf_load_n(s + p, len - p, -INFINITY)));
    const vf mv = vf_set1(m);
    vf sum = vf_zero();
    for (p = 0; p + VEC_LANES <= len; p += VEC_LANES) {
        const vf e = vf_exp_nonpos(vf_sub(vf_load(s + p), mv));
        vf_store(s + p, e);
        sum = vf_add(sum, e);
    }
    float total = vf_reduce_add(sum);
    for (; p < len; p++) {
        const float x = s[p] - m;
        s[p] = expf(x > -87.3f ? x : -87.3f);
        total += s[p];
    }
    return total;
}

/* paged_decode's loop on the vector layer (paged_attention_vec.c) for head sizes that are a
 * multiple of 32 up to 256; returns nonzero when scratch could not be had. */
int paged_decode_vec(const Job *j, int dtype, int num_threads);
#endif

#endif

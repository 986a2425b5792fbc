/* ---------------------------------------------------------------- multi-query decode
 * paged_decode_mq: the same attention for requests with q_len >= 1 query rows each: a decode
 * with k draft tokens (its last token + the drafts, verified in one pass), or a short chunk
 * after a cached context. Request r owns the flat rows query_start[r] .. query_start[r+1] - 1
 * of q and out: its newest q_len tokens, whose keys and values are already in the cache (the
 * attention layer writes every new token's K/V before any request attends). Row i (0-based)
 * sits at position context_lens[r] - q_len + i and attends to keys 0 .. that position: the
 * context plus the rows before it (causal), so context_lens[r] >= q_len.
 *
 * A work unit is one (request, KV head): its q_len * G query vectors (G query heads per KV
 * head) are widened once; the context is walked block by block, and each block's keys (then
 * values) of that head, 4 KiB in float32 at SmolLM2's shape, are read from memory once and
 * from L1 by every query that sees them. The per-row causal limit only drops keys at the tail
 * (the request's own new tokens).
 * Exact softmax, float32 arithmetic, bfloat16 rounded on store, as in paged_attention.c. Where every request
 * has one row, paged_decode is faster (it reads each slot's heads in one contiguous run).
 * With AVX-512 and a head size of 16-wide slices, paged_decode_mq runs attend_group
 * (paged_attention_grouped.c) instead (the grouped path, with each unit's rows x heads as its
 * query vectors); attend_mq is the path of other machines and head sizes.
 */
#include "paged_attention.h"

static inline __attribute__((always_inline)) void attend_mq(const Job *j, int64_t r, int64_t g,
                                                            float *scores, float *acc,
                                                            const int64_t D, const int BF16) {
    const int64_t H = j->num_heads, G = H / j->num_kv_heads, bs = j->block_size;
    const int64_t row = j->num_kv_heads * D, ctx = j->context_lens[r];
    const int64_t q0 = j->query_start[r], nq = j->query_start[r + 1] - q0;
    const int64_t first = ctx - nq; /* keys every row sees; row i also sees first .. first + i */
    const int64_t Q = nq * G;       /* query vector x = i * G + jj: row i, query head g * G + jj */
    const int64_t *table = j->block_tables + r * j->bt_stride;
    const void *restrict K = j->k, *restrict V = j->v;
    float *restrict qv = acc + Q * D; /* the widened, scaled queries; then the Q sums */
    float *restrict sums = qv + Q * D;
    for (int64_t i = 0; i < nq; i++)
        for (int64_t jj = 0; jj < G; jj++) {
            const int64_t src = (q0 + i) * j->q_stride + (g * G + jj) * D;
            float *dst = qv + (i * G + jj) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = ld(j->q, src + d, BF16) * j->scale;
        }

    /* scores[x * ctx + p] = scale * (q_x . k_p) for the keys query x sees, one block at a
     * time (its keys for this head stay in L1 while every query reads them), four keys per
     * pass so that four sums are in flight */
    const int64_t b0 = window_first(j, first) / bs * bs; /* the first row's window's block */
    for (int64_t p0 = b0; p0 < ctx; p0 += bs) {
        const int64_t kb = table[p0 / bs] * bs * row + g * D;
        const int64_t n = ctx - p0 < bs ? ctx - p0 : bs;
        if (p0 + bs < ctx) { /* the next block's keys of this head, while this one is used */
            const char *next = (const char *)K + (table[p0 / bs + 1] * bs * row + g * D) * (BF16 ? 2 : 4);
            for (int64_t t = 0; t < bs; t++) __builtin_prefetch(next + t * row * (BF16 ? 2 : 4));
        }
        for (int64_t x = 0; x < Q; x++) {
            const int64_t lim = first + x / G + 1 - p0;
            const int64_t m = lim < n ? lim : n;
            const float *qx = qv + x * D;
            float *sx = scores + x * ctx + p0;
            int64_t t = 0;
            for (; t + 4 <= m; t += 4) {
                const int64_t k0 = kb + t * row, k1 = k0 + row, k2 = k1 + row, k3 = k2 + row;
                float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t d = 0; d < D; d++) {
                    s0 += qx[d] * ld(K, k0 + d, BF16);
                    s1 += qx[d] * ld(K, k1 + d, BF16);
                    s2 += qx[d] * ld(K, k2 + d, BF16);
                    s3 += qx[d] * ld(K, k3 + d, BF16);
                }
                sx[t] = s0;
                sx[t + 1] = s1;
                sx[t + 2] = s2;
                sx[t + 3] = s3;
            }
            for (; t < m; t++) {
                const int64_t kt = kb + t * row;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qx[d] * ld(K, kt + d, BF16);
                sx[t] = s;
            }
        }
    }
    for (int64_t x = 0; x < Q; x++) {
        const int64_t lo = window_first(j, first + x / G);
        sums[x] = softmax_row(scores + x * ctx + lo, first + x / G + 1 - lo);
    }
    /* acc[x] = sum_p exp_score[x][p] * v_p, one block at a time: the block's values for this
     * head stay in L1 while every query adds its share into a register-held partial sum */
    for (int64_t i = 0; i < Q * D; i++) acc[i] = 0.f;
    for (int64_t p0 = b0; p0 < ctx; p0 += bs) {
        const int64_t vb = table[p0 / bs] * bs * row + g * D;
        const int64_t n = ctx - p0 < bs ? ctx - p0 : bs;
        for (int64_t x = 0; x < Q; x++) {
            const int64_t lim = first + x / G + 1 - p0; /* keys of this block query x sees */
            const int64_t m = lim < n ? lim : n;
            if (m <= 0) continue;
            const float *sx = scores + x * ctx + p0;
            float part[D];
            for (int64_t d = 0; d < D; d++) part[d] = 0.f;
            const int64_t lo = window_first(j, first + x / G);
            for (int64_t t = lo > p0 ? lo - p0 : 0; t < m; t++) {
                const float w = sx[t];
                const int64_t vt = vb + t * row;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) part[d] += w * ld(V, vt + d, BF16);
            }
            float *restrict ax = acc + x * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ax[d] += part[d];
        }
    }
    for (int64_t x = 0; x < Q; x++)
        store_row(j->out, ((q0 + x / G) * H + g * G + x % G) * D, acc + x * D, sums[x], D, BF16);
}

static void attend_mq_one(const Job *j, int64_t r, int64_t g, float *scores, float *acc,
                          int bf16) {
    switch (j->head_dim * 2 + bf16) {
        case 64 * 2: attend_mq(j, r, g, scores, acc, 64, 0); break;
        case 64 * 2 + 1: attend_mq(j, r, g, scores, acc, 64, 1); break;
        case 128 * 2: attend_mq(j, r, g, scores, acc, 128, 0); break;
        case 128 * 2 + 1: attend_mq(j, r, g, scores, acc, 128, 1); break;
        default:
            if (bf16) attend_mq(j, r, g, scores, acc, j->head_dim, 1);
            else attend_mq(j, r, g, scores, acc, j->head_dim, 0);
    }
}

/* q [query_start[num_reqs], H, D] rows q_stride apart; out [query_start[num_reqs], H, D]
 * contiguous; the rest as paged_decode. Returns 0, -1 (no memory for the scratch buffers) or
 * -2 (a request with q_len < 1 or a context shorter than its q_len). window > 0: row at
 * position p sees keys > p - window (paged_decode_mq: none). */
int paged_decode_mq_window(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    const int64_t *block_tables, int64_t bt_stride, const int64_t *context_lens,
                    const int64_t *query_start, void *out, int64_t num_reqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                    int dtype, int num_threads, int64_t window) {
    Job j = {q, k_cache, v_cache, block_tables, context_lens, out, num_reqs, q_stride,
             bt_stride, num_heads, num_kv_heads, head_dim, block_size, 1, scale, query_start,
             window};
    if (num_kv_heads < 1 || num_heads % num_kv_heads) return -2;
    int64_t max_scores = 1, max_q = 1;
    const int64_t G = num_heads / num_kv_heads;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t nq = query_start[r + 1] - query_start[r];
        if (nq < 1 || context_lens[r] < nq) return -2;
        if (nq * G * context_lens[r] > max_scores) max_scores = nq * G * context_lens[r];
        if (nq * G > max_q) max_q = nq * G;
    }
#ifdef PAGED_GQA
    if (head_dim % 16 == 0 && head_dim <= 256) { /* the grouped path, several rows per request */
        int64_t max_rows = 1;
        for (int64_t r = 0; r < num_reqs; r++) {
            if (context_lens[r] > j.max_context) j.max_context = context_lens[r];
            if (query_start[r + 1] - query_start[r] > max_rows)
                max_rows = query_start[r + 1] - query_start[r];
        }
        return paged_decode_grouped(&j, max_rows, dtype, num_threads) ? -1 : 0;
    }
#endif
    const int64_t units = num_reqs * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(kernel_threads(num_threads, units)) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)max_scores);
        /* per query vector: D accumulators, D widened query values, one sum */
        float *acc = malloc(sizeof(float) * (size_t)(max_q * (2 * head_dim + 1)));
        failed = !scores || !acc;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < units; w++)
            if (!failed) attend_mq_one(&j, w / num_kv_heads, w % num_kv_heads, scores, acc,
                                       dtype == 1);
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}

int paged_decode_mq(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    const int64_t *block_tables, int64_t bt_stride, const int64_t *context_lens,
                    const int64_t *query_start, void *out, int64_t num_reqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                    int dtype, int num_threads) {
    return paged_decode_mq_window(q, q_stride, k_cache, v_cache, block_tables, bt_stride,
                                  context_lens, query_start, out, num_reqs, num_heads,
                                  num_kv_heads, head_dim, block_size, scale, dtype, num_threads,
                                  0);
}

/* Paged decode attention on CPU (float32 or bfloat16): each query token attends to its
 * request's KV blocks in place, through the block table, so every key and value is read exactly
 * once per layer; the pure-PyTorch path must first gather a request's scattered blocks into one
 * tensor (a copy) before scaled_dot_product_attention reads them again.
 *
 *   k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]   one layer, contiguous
 *                       a token at position p of request r lives in block
 *                       block_tables[r][p / block_size], slot p % block_size
 *   block_tables     : [num_reqs, bt_stride]   physical block ids, int64
 *   context_lens     : [num_reqs]              keys to attend to (the query's position + 1)
 *   q                : [num_reqs, num_heads, head_dim], consecutive requests q_stride apart
 *   out              : [num_reqs, num_heads, head_dim], contiguous
 *
 * q, the caches and out share one dtype; the arithmetic is float32 either way (bfloat16 is
 * widened on load and rounded to nearest-even on the final store, as PyTorch's CPU SDPA does).
 * Query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention).
 * (With AVX-512 and grouped-query heads the grouped path, paged_attention_grouped.c, runs
 * instead; with AVX2 or NEON paged_attention_vec.c; several query rows per request: paged_attention_mq.c.)
 * One request at a time per thread: scores for all heads (keys read block by block, slot by
 * slot, so memory is walked forwards), an exact softmax (max, then exp and sum), then the
 * values weighted by the scores. Requests are shared out to num_threads OpenMP threads: loaded
 * into a process that has loaded PyTorch, this library binds to PyTorch's own libgomp
 * (same soname), so the kernel runs on PyTorch's warm thread pool instead of fighting its
 * spinning threads for the cores. Built and loaded by llmtower/kernels/build.py; the numbers
 * match PyTorch's SDPA up to summation order.
 */
#include "paged_attention.h"
#include "vec.h"

/* While slot t of a block is computed, ask for slice t of the first PREFETCH_BYTES of the next
 * block. A fresh pool hands a request consecutive blocks, which the hardware prefetcher
 * streams through; after churn (a long-running server) a request's blocks are scattered and
 * the prefetcher stops at every jump. Measured with 64 decodes of 96-320 tokens on randomly
 * scattered blocks, 2 threads: SmolLM2's 12 KiB blocks 1.66 -> 1.0 ms per layer, W1's 48 KiB
 * blocks unchanged (prefetching W1's whole next block made it 30% slower); on a fresh pool
 * (the W1 benchmark) no change either way. */
enum { PREFETCH_BYTES = 8192 };

static inline __attribute__((always_inline)) void prefetch_next_block(
        const void *cache, const int64_t *table, int64_t p0, int64_t t, int64_t ctx, int64_t bs,
        int64_t row, const int BF16) {
    if (p0 + bs >= ctx) return; /* the last block */
    const int64_t esz = BF16 ? 2 : 4, size = bs * row * esz;
    const int64_t bytes = size < PREFETCH_BYTES ? size : PREFETCH_BYTES, slice = (bytes + bs - 1) / bs;
    const char *next = (const char *)cache + table[p0 / bs + 1] * size;
    for (int64_t b = t * slice; b < (t + 1) * slice && b < bytes; b += 64)
        __builtin_prefetch(next + b);
}

#ifdef PAGED_VEC
/* head sizes paged_attention_vec.c does not take: the portable loop, its softmax a vector at a
 * time (with libm's expf lane by lane it was ~a sixth of a SmolLM2 layer call at v3) */
#define SOFTMAX softmax_vec
#else
#define SOFTMAX softmax_row
#endif

/* Always inlined, so that each call in attend_one with a constant head_dim and dtype gets its
 * own copy whose inner loops the compiler unrolls and vectorizes completely. */
static inline __attribute__((always_inline)) void attend(const Job *j, int64_t r, float *scores,
                                                         float *acc, const int64_t D,
                                                         const int BF16) {
    const int64_t H = j->num_heads, bs = j->block_size;
    const int64_t G = H / j->num_kv_heads, ctx = j->context_lens[r], row = j->num_kv_heads * D;
    const int64_t *table = j->block_tables + r * j->bt_stride;
    const void *restrict K = j->k, *restrict V = j->v;
    float *restrict q = acc + H * (D + 1); /* the query, widened to float32 once */
    for (int64_t i = 0; i < H * D; i++) q[i] = ld(j->q, r * j->q_stride + i, BF16) * j->scale;

    /* scores[h][p] = scale * (q_h . k_p), from the window's first block */
    const int64_t lo = window_first(j, ctx - 1), b0 = lo / bs * bs;
    for (int64_t p0 = b0; p0 < ctx; p0 += bs) {
        const int64_t kb = table[p0 / bs] * bs * row; /* element offset of the block */
        const int64_t n = ctx - p0 < bs ? ctx - p0 : bs;
        for (int64_t t = 0; t < n; t++) {
            prefetch_next_block(K, table, p0, t, ctx, bs, row, BF16);
            for (int64_t h = 0; h < H; h++) {
                const int64_t kh = kb + t * row + (h / G) * D;
                const float *qh = q + h * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qh[d] * ld(K, kh + d, BF16);
                scores[h * ctx + p0 + t] = s;
            }
        }
    }
    /* softmax numerators in place; each head's sum divides its output at the end */
    for (int64_t h = 0; h < H; h++) acc[H * D + h] = SOFTMAX(scores + h * ctx + lo, ctx - lo);
    /* acc[h] = sum_p exp_score[h][p] * v_p */
    for (int64_t i = 0; i < H * D; i++) acc[i] = 0.f;
    for (int64_t p0 = b0; p0 < ctx; p0 += bs) {
        const int64_t vb = table[p0 / bs] * bs * row;
        const int64_t n = ctx - p0 < bs ? ctx - p0 : bs;
        for (int64_t t = lo > p0 ? lo - p0 : 0; t < n; t++) {
            prefetch_next_block(V, table, p0, t, ctx, bs, row, BF16);
            for (int64_t h = 0; h < H; h++) {
                const int64_t vh = vb + t * row + (h / G) * D;
                const float w = scores[h * ctx + p0 + t];
                float *restrict ah = acc + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ah[d] += w * ld(V, vh + d, BF16);
            }
        }
    }
    for (int64_t h = 0; h < H; h++)
        store_row(j->out, (r * H + h) * D, acc + h * D, acc[H * D + h], D, BF16);
}

static void attend_one(const Job *j, int64_t r, float *scores, float *acc, int bf16) {
    switch (j->head_dim * 2 + bf16) { /* the common head sizes get fully unrolled copies */
        case 64 * 2: attend(j, r, scores, acc, 64, 0); break;
        case 64 * 2 + 1: attend(j, r, scores, acc, 64, 1); break;
        case 128 * 2: attend(j, r, scores, acc, 128, 0); break;
        case 128 * 2 + 1: attend(j, r, scores, acc, 128, 1); break;
        default:
            if (bf16) attend(j, r, scores, acc, j->head_dim, 1);
            else attend(j, r, scores, acc, j->head_dim, 0);
    }
}

/* dtype 0: float32, 1: bfloat16; window > 0: a query at position p sees keys > p - window.
 * Returns 0 on success, -1 when memory for the scores could not be had, -2 on a context length
 * below 1. */
int paged_decode_window(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                 const int64_t *block_tables, int64_t bt_stride, const int64_t *context_lens,
                 void *out, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, int64_t block_size, float scale, int dtype, int num_threads,
                 int64_t window) {
    Job j = {q, k_cache, v_cache, block_tables, context_lens, out, num_reqs, q_stride, bt_stride,
             num_heads, num_kv_heads, head_dim, block_size, 1, scale, NULL, window};
    for (int64_t r = 0; r < num_reqs; r++) {
        if (context_lens[r] < 1) return -2;
        if (context_lens[r] > j.max_context) j.max_context = context_lens[r];
    }
#ifdef PAGED_VEC
    if (head_dim % 32 == 0 && head_dim <= 256 && num_kv_heads > 0 && num_heads % num_kv_heads == 0)
        return paged_decode_vec(&j, dtype, num_threads) ? -1 : 0;
#endif
#ifdef PAGED_GQA
    if (head_dim % 16 == 0 && head_dim <= 256 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
        num_heads > num_kv_heads) /* without grouping, attend's contiguous slot rows win */
        return paged_decode_grouped(&j, 1, dtype, num_threads) ? -1 : 0;
#endif
    int failed = 0;
#pragma omp parallel num_threads(kernel_threads(num_threads, num_reqs)) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * j.num_heads * j.max_context);
        /* per head: D accumulators, then the H sums, then the widened query */
        float *acc = malloc(sizeof(float) * j.num_heads * (2 * j.head_dim + 1));
        failed = !scores || !acc;
        /* dynamic: contexts differ in length, so equal shares of requests are unequal work */
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_reqs; r++)
            if (!failed) attend_one(&j, r, scores, acc, dtype == 1);
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}

/* paged_decode_window without a window (the signature decode_layer.c calls by address). */
int paged_decode(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                 const int64_t *block_tables, int64_t bt_stride, const int64_t *context_lens,
                 void *out, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, int64_t block_size, float scale, int dtype, int num_threads) {
    return paged_decode_window(q, q_stride, k_cache, v_cache, block_tables, bt_stride,
                               context_lens, out, num_reqs, num_heads, num_kv_heads, head_dim,
                               block_size, scale, dtype, num_threads, 0);
}

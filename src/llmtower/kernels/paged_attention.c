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
 * (With AVX-512 and grouped-query heads the grouped path further down runs instead.)
 * One request at a time per thread: scores for all heads (keys read block by block, slot by
 * slot, so memory is walked forwards), an exact softmax (max, then exp and sum), then the
 * values weighted by the scores. Requests are shared out to num_threads OpenMP threads: loaded
 * into a process that has loaded PyTorch, this library binds to PyTorch's own libgomp
 * (same soname), so the kernel runs on PyTorch's warm thread pool instead of fighting its
 * spinning threads for the cores. Built and loaded by llmtower/kernels/build.py; the numbers
 * match PyTorch's SDPA up to summation order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"

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
} Job;


/* Element i of a float or bfloat16 array; BF16 is a constant in every caller, so the branch
 * folds away. */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int BF16) {
    return BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

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

    /* scores[h][p] = scale * (q_h . k_p) */
    for (int64_t p0 = 0; p0 < ctx; p0 += bs) {
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
    for (int64_t h = 0; h < H; h++) {
        float *sh = scores + h * ctx, m = sh[0], sum = 0.f;
        for (int64_t p = 1; p < ctx; p++) m = sh[p] > m ? sh[p] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < ctx; p++) {
            sh[p] = expf(sh[p] - m);
            sum += sh[p];
        }
        acc[H * D + h] = sum;
    }
    /* acc[h] = sum_p exp_score[h][p] * v_p */
    for (int64_t i = 0; i < H * D; i++) acc[i] = 0.f;
    for (int64_t p0 = 0; p0 < ctx; p0 += bs) {
        const int64_t vb = table[p0 / bs] * bs * row;
        const int64_t n = ctx - p0 < bs ? ctx - p0 : bs;
        for (int64_t t = 0; t < n; t++) {
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
    for (int64_t h = 0; h < H; h++) {
        const float inv = 1.f / acc[H * D + h];
        for (int64_t d = 0; d < D; d++) {
            const float o = acc[h * D + d] * inv;
            const int64_t i = (r * H + h) * D + d;
            if (BF16) ((uint16_t *)j->out)[i] = f32_to_bf16(o);
            else ((float *)j->out)[i] = o;
        }
    }
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

/* exp(x) for x <= 0 (a score minus its row's maximum), in a form the compiler vectorizes: the
 * C library's expf is a call per element, which costs as much as the dot products once a
 * request has several query rows. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-7
 * polynomial for e^r (within 2 ulp of float32), times 2^n built in the exponent bits. Below
 * -87.3 the result would be subnormal: clamped there (the weight is < 1e-37 of the maximum's). */
static inline float exp_nonpos(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* ---------------------------------------------------------------- grouped one-query decode
 * With AVX-512 and a head size that is a multiple of 16 (up to 256), paged_decode works on one
 * (request, KV head) at a time instead of one request: the G query heads that share the KV
 * head are scored together, so each key row (and each value row) is read once for the group
 * instead of once per query head. attend above computes every score as a 64-wide dot product
 * ending in its own horizontal sum; here 16 keys are scored per tile: each key's D/16 vectors
 * are multiplied into one 16-lane partial per query head, and hsum16 folds the tile's 16
 * partials into the 16 scores with 15 shuffle-adds (one horizontal sum each would cost ~8 per
 * score). The values are weighted in 16-dim slices with up to four heads' accumulators in
 * registers across the whole context. Softmax exact as above (maximum subtracted), with
 * exp16_nonpos (exp_nonpos on 16 lanes). Same float32 arithmetic; only the summation order
 * differs from attend. In bfloat16 with AVX-512 BF16 the scores come from vdpbf16ps on the
 * stored query and key pairs (exact products, float32 sums), scaled afterwards. Each thread
 * claims its next unit before it starts the current one and fetches the next one's K and V
 * into L2 meanwhile (Ahead), so that the memory stays busy while a unit computes; measured on
 * SmolLM2's shape with 30 cold layers (benchmarks/paged_attention_cold.py), these and the
 * register-held accumulators took a layer call from 0.65 to 0.38 ms (bfloat16) and from 0.94
 * to 0.69 ms (float32), 2 threads. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGED_GQA 1
#ifndef GQA_AHEAD
#define GQA_AHEAD 16
#endif


/* 16 float32 elements of a float or bfloat16 array, widened */
static inline __attribute__((always_inline)) __m512 ld16(const void *p, int64_t i, const int BF16) {
    if (BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}

/* Lane t of the result: the sum of the 16 lanes of the partial of key t, where key t's partial
 * sits in v[tile_slot(t)] (that order makes the shuffle tree below leave key t in lane t). */
static inline int tile_slot(int t) { return (t >> 2) + 4 * (t & 3); }

static inline __m512 hsum16(const __m512 *v) {
    __m512 w[8], u[4], s[2];
    for (int i = 0; i < 8; i++) /* each 512-bit half keeps 8 lanes of one input */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* each 128-bit quarter keeps 4 lanes of one input */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* 2 lanes of one input */
        s[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x88), _mm512_shuffle_ps(s[0], s[1], 0xDD));
}

/* exp_nonpos on 16 lanes (the same polynomial and reduction; 2^n by vscalefps). GCC leaves
 * exp_nonpos's loop scalar (floorf and the int conversion), which cost ~20% of a decode. */
static inline __m512 exp16_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* In place: s[p] = exp(s[p] - max) for p < len, 0 for len <= p < ctx; returns the sum. */
static inline float softmax_numerators(float *s, int64_t len, int64_t ctx) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t p = 0;
    for (; p + 16 <= len; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + p));
    const __mmask16 tail = (__mmask16)((1u << (len - p)) - 1);
    m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + p));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (p = 0; p + 16 <= len; p += 16) {
        const __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(s + p), mx));
        _mm512_storeu_ps(s + p, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (p < len) {
        const __m512 e = _mm512_maskz_mov_ps(
            tail, exp16_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + p), mx)));
        _mm512_mask_storeu_ps(s + p, tail, e);
        sum = _mm512_add_ps(sum, e);
    }
    for (p = len; p < ctx; p++) s[p] = 0.f;
    return _mm512_reduce_add_ps(sum);
}

/* The next work unit of this thread, fetched into L2 while the current one computes. A unit's
 * own prefetch (GQA_AHEAD keys ahead) starts it on a cold cache and leaves the memory idle
 * while its scores are reduced, its softmax taken and its values weighed (the values are in L1
 * by then); claiming the next unit first and spreading its K and V rows over the current
 * unit's two passes keeps the memory busy throughout. */
typedef struct {
    const char *k, *v;
    const int64_t *rows; /* element offsets of the next unit's rows (of its first KV head) */
    int64_t keys, row_bytes, esz; /* row_bytes: all the unit's KV heads, contiguous */
    int64_t key, at;     /* the next line to ask for: its key, its byte in that key's row */
    int64_t per_step;    /* lines (of K and of V) per step of the current unit */
} Ahead;

static inline __attribute__((always_inline)) void ahead_step(Ahead *a) {
    for (int64_t i = 0; i < a->per_step && a->key < a->keys; i++) {
        const int64_t off = a->rows[a->key] * a->esz + a->at;
        _mm_prefetch(a->k + off, _MM_HINT_T1);
        _mm_prefetch(a->v + off, _MM_HINT_T1);
        a->at += 64;
        if (a->at >= a->row_bytes) {
            a->at = 0;
            a->key++;
        }
    }
}

/* Scratch of one thread, for a group of G query heads and contexts up to max_context. */
typedef struct {
    float *scores;    /* [G][stride]: stride = max_context rounded up to 16 */
    int64_t *rows;    /* [max_context]: element offset of each key's row of this KV head */
    int64_t *next_rows; /* [max_context]: the same for the thread's next unit */
    float *q, *part;  /* [G][D] widened scaled queries; [G][16][16] one tile's partials */
    float *sums;      /* [G] */
    int64_t stride;
} GroupScratch;

/* the value pass for NH (1..4) heads g0.. of the group, CW * 16 dims at a time: NH * CW
 * accumulators stay in registers across the whole context, enough independent chains to hide
 * the FMA latency */
static inline __attribute__((always_inline)) void weigh_values(
        const void *V, const GroupScratch *w, int64_t ctx, int64_t g0, float *out_acc,
        Ahead *ahead, const int64_t D, const int BF16, const int NH, const int CW) {
    const float *s[4];
    for (int i = 0; i < 4; i++) s[i] = w->scores + (g0 + (i < NH ? i : 0)) * w->stride;
    for (int64_t c0 = 0; c0 < D; c0 += CW * 16) {
        /* fixed sizes: arrays sized by NH / CW would be variable-length arrays, which GCC
         * keeps on the stack (a load and a store around every FMA); these stay in registers */
        __m512 a[4][4];
        for (int i = 0; i < NH; i++)
            for (int c = 0; c < CW; c++) a[i][c] = _mm512_setzero_ps();
        for (int64_t p = 0; p < ctx; p++) {
            ahead_step(ahead);
            __m512 v[4];
            for (int c = 0; c < CW; c++) v[c] = ld16(V, w->rows[p] + c0 + c * 16, BF16);
            for (int i = 0; i < NH; i++) {
                const __m512 e = _mm512_set1_ps(s[i][p]);
                for (int c = 0; c < CW; c++) a[i][c] = _mm512_fmadd_ps(e, v[c], a[i][c]);
            }
        }
        for (int i = 0; i < NH; i++)
            for (int c = 0; c < CW; c++) _mm512_storeu_ps(out_acc + (g0 + i) * D + c0 + c * 16, a[i][c]);
    }
}

/* rows[p]: the element offset of key p's row of KV head g of request r */
static void unit_rows(const Job *j, int64_t r, int64_t g, int64_t *rows) {
    const int64_t bs = j->block_size, ctx = j->context_lens[r];
    const int64_t row = j->num_kv_heads * j->head_dim;
    const int64_t *table = j->block_tables + r * j->bt_stride;
    for (int64_t p0 = 0; p0 < ctx; p0 += bs) { /* walk the block table once, no divisions */
        const int64_t base = table[p0 / bs] * bs * row + g * j->head_dim;
        const int64_t n = ctx - p0 < bs ? ctx - p0 : bs;
        for (int64_t t = 0; t < n; t++) rows[p0 + t] = base + t * row;
    }
}

/* one unit; w->rows already holds its rows (unit_rows) */
static inline __attribute__((always_inline)) void attend_group(const Job *j, int64_t r, int64_t g,
                                                               const GroupScratch *w, float *acc,
                                                               Ahead *ahead, const int64_t D,
                                                               const int BF16) {
    const int64_t H = j->num_heads, G = H / j->num_kv_heads;
    const int64_t ctx = j->context_lens[r], st = w->stride;
    /* query vector x = i * G + jj: row i of the request (at position ctx - nq + i, so it sees
     * keys 0 .. ctx - nq + i), query head g * G + jj */
    const int64_t q0 = j->query_start ? j->query_start[r] : r;
    const int64_t nq = j->query_start ? j->query_start[r + 1] - q0 : 1, Q = nq * G;
    const void *restrict K = j->k, *restrict V = j->v;
#ifdef __AVX512BF16__
    /* bfloat16 with AVX-512 BF16: vdpbf16ps multiplies the stored query and key pairs exactly
     * and adds them in float32 (no widening of each key, half the instructions); the scale
     * multiplies the scores instead of the query */
    const int DP = BF16 && D % 32 == 0;
#else
    const int DP = 0;
#endif
    uint16_t *qb = (uint16_t *)w->q; /* DP: the raw bfloat16 queries */
    for (int64_t i = 0; i < nq; i++)
        for (int64_t e = 0; e < G * D; e++) {
            const int64_t src = (q0 + i) * j->q_stride + g * G * D + e;
            if (DP) qb[i * G * D + e] = ((const uint16_t *)j->q)[src];
            else w->q[i * G * D + e] = ld(j->q, src, BF16) * j->scale;
        }

    /* scores[x][p] = q_x . k_p, 16 keys per tile */
    __m512 *part = (__m512 *)w->part;
    for (int64_t p0 = 0; p0 < ctx; p0 += 16) {
        const int64_t n = ctx - p0 < 16 ? ctx - p0 : 16;
        for (int t = 0; t < 16; t++) {
            const int slot = tile_slot(t);
            if (t >= n) {
                for (int64_t x = 0; x < Q; x++) part[x * 16 + slot] = _mm512_setzero_ps();
                continue;
            }
            if (p0 + t + GQA_AHEAD < ctx) { /* key and value GQA_AHEAD ahead: 2-4 lines each */
                const int64_t at = w->rows[p0 + t + GQA_AHEAD] * (BF16 ? 2 : 4);
                for (int64_t b = 0; b < D * (BF16 ? 2 : 4); b += 64) {
                    __builtin_prefetch((const char *)K + at + b);
                    __builtin_prefetch((const char *)V + at + b);
                }
            }
            ahead_step(ahead);
#ifdef __AVX512BF16__
            if (DP) {
                __m512i kb[8]; /* 32 dims each, D <= 256 */
                const uint16_t *kr = (const uint16_t *)K + w->rows[p0 + t];
                for (int64_t c = 0; c < D / 32; c++) kb[c] = _mm512_loadu_si512(kr + c * 32);
                for (int64_t x = 0; x < Q; x++) {
                    const uint16_t *qx = qb + x * D;
                    __m512 s = _mm512_setzero_ps();
                    for (int64_t c = 0; c < D / 32; c++)
                        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qx + c * 32),
                                             (__m512bh)kb[c]);
                    part[x * 16 + slot] = s;
                }
                continue;
            }
#endif
            __m512 k[16]; /* D <= 256; a fixed size keeps it out of the stack (no VLA) */
            for (int64_t c = 0; c < D / 16; c++) k[c] = ld16(K, w->rows[p0 + t] + c * 16, BF16);
            for (int64_t x = 0; x < Q; x++) {
                const float *qx = w->q + x * D;
                __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qx), k[0]);
                for (int64_t c = 1; c < D / 16; c++)
                    s = _mm512_fmadd_ps(_mm512_loadu_ps(qx + c * 16), k[c], s);
                part[x * 16 + slot] = s;
            }
        }
        const __m512 sc = _mm512_set1_ps(DP ? j->scale : 1.f);
        for (int64_t x = 0; x < Q; x++)
            _mm512_storeu_ps(w->scores + x * st + p0, _mm512_mul_ps(hsum16(part + x * 16), sc));
    }
    /* softmax numerators in place; each head's sum divides its output at the end. A row's
     * keys past its own position (later rows of its request) get weight 0. */
    for (int64_t x = 0; x < Q; x++) {
        w->sums[x] = softmax_numerators(w->scores + x * st, ctx - nq + x / G + 1, ctx);
    }
    /* acc[x] = sum_p exp_score[x][p] * v_p: each value row read once per four heads */
    for (int64_t g0 = 0; g0 < Q; g0 += 4) {
        const int nh = Q - g0 < 4 ? (int)(Q - g0) : 4;
        if (D % 64 == 0) { /* 4 slices of 16 dims per pass */
            switch (nh) {
                case 1: weigh_values(V, w, ctx, g0, acc, ahead, D, BF16, 1, 4); break;
                case 2: weigh_values(V, w, ctx, g0, acc, ahead, D, BF16, 2, 4); break;
                case 3: weigh_values(V, w, ctx, g0, acc, ahead, D, BF16, 3, 4); break;
                default: weigh_values(V, w, ctx, g0, acc, ahead, D, BF16, 4, 4);
            }
        } else {
            switch (nh) {
                case 1: weigh_values(V, w, ctx, g0, acc, ahead, D, BF16, 1, 1); break;
                case 2: weigh_values(V, w, ctx, g0, acc, ahead, D, BF16, 2, 1); break;
                case 3: weigh_values(V, w, ctx, g0, acc, ahead, D, BF16, 3, 1); break;
                default: weigh_values(V, w, ctx, g0, acc, ahead, D, BF16, 4, 1);
            }
        }
    }
    for (int64_t x = 0; x < Q; x++) {
        const float inv = 1.f / w->sums[x];
        const int64_t o0 = ((q0 + x / G) * H + g * G + x % G) * D;
        for (int64_t d = 0; d < D; d++) {
            const float o = acc[x * D + d] * inv;
            if (BF16) ((uint16_t *)j->out)[o0 + d] = f32_to_bf16(o);
            else ((float *)j->out)[o0 + d] = o;
        }
    }
}

static void attend_group_one(const Job *j, int64_t r, int64_t g, const GroupScratch *w,
                             float *acc, Ahead *ahead, int bf16) {
    switch (j->head_dim * 2 + bf16) {
        case 64 * 2: attend_group(j, r, g, w, acc, ahead, 64, 0); break;
        case 64 * 2 + 1: attend_group(j, r, g, w, acc, ahead, 64, 1); break;
        case 128 * 2: attend_group(j, r, g, w, acc, ahead, 128, 0); break;
        case 128 * 2 + 1: attend_group(j, r, g, w, acc, ahead, 128, 1); break;
        default: /* a multiple of 16 up to 256 (checked by the caller) */
            if (bf16) attend_group(j, r, g, w, acc, ahead, j->head_dim, 1);
            else attend_group(j, r, g, w, acc, ahead, j->head_dim, 0);
    }
}

/* paged_decode's (and paged_decode_mq's) loop for the grouped path; returns nonzero when scratch could not be had */
static int paged_decode_grouped(const Job *j, int64_t max_rows, int dtype, int num_threads) {
    /* Q: the most query vectors of one unit (G query heads x the most rows of a request) */
    const int64_t Q = j->num_heads / j->num_kv_heads * max_rows, D = j->head_dim;
    /* a unit: one KV head of one request (whole requests, all heads' rows read by one thread
     * in one go, measured no faster: 0.37 vs 0.36 ms per SmolLM2 layer in bfloat16) */
    const int64_t hkv = j->num_kv_heads, units = j->num_reqs * hkv;
    const int64_t stride = (j->max_context + 15) / 16 * 16;
    int failed = 0;
    int64_t claimed = 0; /* units handed out so far (shared: dynamic scheduling, one at a time) */
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(| : failed)
    {
        GroupScratch w = {malloc(sizeof(float) * (size_t)(Q * stride)),
                          malloc(sizeof(int64_t) * (size_t)stride),
                          malloc(sizeof(int64_t) * (size_t)stride),
                          malloc(sizeof(float) * (size_t)(Q * D)),
                          aligned_alloc(64, sizeof(float) * (size_t)(Q * 256)),
                          malloc(sizeof(float) * (size_t)Q), stride};
        float *acc = malloc(sizeof(float) * (size_t)(Q * D));
        failed = !w.scores || !w.rows || !w.next_rows || !w.q || !w.part || !w.sums || !acc;
        /* dynamic scheduling by hand: each thread claims its next unit before it starts the
         * current one, so that it can fetch the next one's K and V meanwhile (Ahead) */
        const int64_t esz = dtype == 1 ? 2 : 4;
        int64_t u = failed ? units : __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (u < units) {
            const int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const int64_t r = u / hkv, g = u % hkv;
            Ahead ahead = {j->k, j->v, NULL, 0, D * esz, esz, 0, 0, 0};
            if (next < units) { /* its lines spread evenly over this unit's 2 * ctx steps */
                const int64_t rn = next / hkv, steps = 2 * j->context_lens[r];
                unit_rows(j, rn, next % hkv, w.next_rows);
                ahead.rows = w.next_rows;
                ahead.keys = j->context_lens[rn];
                const int64_t lines = ahead.keys * ((ahead.row_bytes + 63) / 64);
                ahead.per_step = (lines + steps - 1) / steps;
            }
            unit_rows(j, r, g, w.rows);
            attend_group_one(j, r, g, &w, acc, &ahead, dtype == 1);
            u = next;
        }
        free(w.scores);
        free(w.rows);
        free(w.next_rows);
        free(w.q);
        free(w.part);
        free(w.sums);
        free(acc);
    }
    return failed;
}
#endif

/* dtype 0: float32, 1: bfloat16. Returns 0 on success, -1 when memory for the scores could not
 * be had, -2 on a context length below 1. */
int paged_decode(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                 const int64_t *block_tables, int64_t bt_stride, const int64_t *context_lens,
                 void *out, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, int64_t block_size, float scale, int dtype, int num_threads) {
    Job j = {q, k_cache, v_cache, block_tables, context_lens, out, num_reqs, q_stride, bt_stride,
             num_heads, num_kv_heads, head_dim, block_size, 1, scale, NULL};
    for (int64_t r = 0; r < num_reqs; r++) {
        if (context_lens[r] < 1) return -2;
        if (context_lens[r] > j.max_context) j.max_context = context_lens[r];
    }
#ifdef PAGED_GQA
    if (head_dim % 16 == 0 && head_dim <= 256 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
        num_heads > num_kv_heads) /* without grouping, attend's contiguous slot rows win */
        return paged_decode_grouped(&j, 1, dtype, num_threads) ? -1 : 0;
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
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
 * (the request's own new tokens). The softmax's exponentials use exp_nonpos, which vectorizes.
 * Exact softmax, float32 arithmetic, bfloat16 rounded on store, as above. Where every request
 * has one row, paged_decode is faster (it reads each slot's heads in one contiguous run).
 * With AVX-512 and a head size of 16-wide slices, paged_decode_mq runs attend_group above
 * instead (the grouped path, with each unit's rows x heads as its query vectors); attend_mq
 * is the path of other machines and head sizes.
 */
typedef struct {
    const void *q, *k, *v;
    const int64_t *block_tables, *context_lens, *query_start;
    void *out;
    int64_t q_stride, bt_stride, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} MQJob;

static inline __attribute__((always_inline)) void attend_mq(const MQJob *j, int64_t r, int64_t g,
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
    for (int64_t p0 = 0; p0 < ctx; p0 += bs) {
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
        const int64_t len = first + x / G + 1;
        float *sx = scores + x * ctx, m = sx[0], sum = 0.f;
        for (int64_t p = 1; p < len; p++) m = sx[p] > m ? sx[p] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < len; p++) {
            sx[p] = exp_nonpos(sx[p] - m);
            sum += sx[p];
        }
        sums[x] = sum;
    }
    /* acc[x] = sum_p exp_score[x][p] * v_p, one block at a time: the block's values for this
     * head stay in L1 while every query adds its share into a register-held partial sum */
    for (int64_t i = 0; i < Q * D; i++) acc[i] = 0.f;
    for (int64_t p0 = 0; p0 < ctx; p0 += bs) {
        const int64_t vb = table[p0 / bs] * bs * row + g * D;
        const int64_t n = ctx - p0 < bs ? ctx - p0 : bs;
        for (int64_t x = 0; x < Q; x++) {
            const int64_t lim = first + x / G + 1 - p0; /* keys of this block query x sees */
            const int64_t m = lim < n ? lim : n;
            if (m <= 0) continue;
            const float *sx = scores + x * ctx + p0;
            float part[D];
            for (int64_t d = 0; d < D; d++) part[d] = 0.f;
            for (int64_t t = 0; t < m; t++) {
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
    for (int64_t x = 0; x < Q; x++) {
        const float inv = 1.f / sums[x];
        const int64_t dst = ((q0 + x / G) * H + g * G + x % G) * D;
        for (int64_t d = 0; d < D; d++) {
            const float o = acc[x * D + d] * inv;
            if (BF16) ((uint16_t *)j->out)[dst + d] = f32_to_bf16(o);
            else ((float *)j->out)[dst + d] = o;
        }
    }
}

static void attend_mq_one(const MQJob *j, int64_t r, int64_t g, float *scores, float *acc,
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
 * -2 (a request with q_len < 1 or a context shorter than its q_len). */
int paged_decode_mq(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                    const int64_t *block_tables, int64_t bt_stride, const int64_t *context_lens,
                    const int64_t *query_start, void *out, int64_t num_reqs, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                    int dtype, int num_threads) {
    MQJob j = {q, k_cache, v_cache, block_tables, context_lens, query_start, out, q_stride,
               bt_stride, num_heads, num_kv_heads, head_dim, block_size, scale};
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
        Job g = {q, k_cache, v_cache, block_tables, context_lens, out, num_reqs, q_stride,
                 bt_stride, num_heads, num_kv_heads, head_dim, block_size, 1, scale, query_start};
        int64_t max_rows = 1;
        for (int64_t r = 0; r < num_reqs; r++) {
            if (context_lens[r] > g.max_context) g.max_context = context_lens[r];
            if (query_start[r + 1] - query_start[r] > max_rows)
                max_rows = query_start[r + 1] - query_start[r];
        }
        return paged_decode_grouped(&g, max_rows, dtype, num_threads) ? -1 : 0;
    }
#endif
    const int64_t units = num_reqs * num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(| : failed)
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

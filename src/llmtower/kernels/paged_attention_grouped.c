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
 * exp16_nonpos (vec_exp.h). Same float32 arithmetic; only the summation order
 * differs from attend. In bfloat16 with AVX-512 BF16 the scores come from vdpbf16ps on the
 * stored query and key pairs (exact products, float32 sums), scaled afterwards. Each thread
 * claims its next unit before it starts the current one and fetches the next one's K and V
 * into L2 meanwhile (Ahead), so that the memory stays busy while a unit computes; measured on
 * SmolLM2's shape with 30 cold layers (benchmarks/paged_attention_cold.py), these and the
 * register-held accumulators took a layer call from 0.65 to 0.38 ms (bfloat16) and from 0.94
 * to 0.69 ms (float32), 2 threads. */
#include "paged_attention.h"
#include "vec_exp.h"

#ifdef PAGED_GQA
#include <immintrin.h>
#ifndef GQA_AHEAD
#define GQA_AHEAD 16
#endif


/* 16 float32 elements of a float or bfloat16 array, widened */
static inline __attribute__((always_inline)) __m512 ld16(const void *p, int64_t i, const int BF16) {
    if (BF16) {
        return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
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
    int64_t lo, first; /* the unit's first key read (its first row's window start; 0: no
                        * window) and the 16-key tile that holds it */
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
        for (int64_t p = w->lo; p < ctx; p++) {
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

/* The first key of request r's unit: its first row's window start. */
static int64_t unit_first(const Job *j, int64_t r) {
    const int64_t nq = j->query_start ? j->query_start[r + 1] - j->query_start[r] : 1;
    return window_first(j, j->context_lens[r] - nq);
}

/* rows[p]: the element offset of key p's row of KV head g of request r (from unit_first's
 * block on) */
static void unit_rows(const Job *j, int64_t r, int64_t g, int64_t *rows) {
    const int64_t bs = j->block_size, ctx = j->context_lens[r];
    const int64_t row = j->num_kv_heads * j->head_dim;
    const int64_t *table = j->block_tables + r * j->bt_stride;
    for (int64_t p0 = unit_first(j, r) / bs * bs; p0 < ctx; p0 += bs) { /* walk the block table once, no divisions */
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
    for (int64_t p0 = w->first; p0 < ctx; p0 += 16) {
        const int64_t n = ctx - p0 < 16 ? ctx - p0 : 16;
        for (int t = 0; t < 16; t++) {
            const int slot = tile_slot(t);
            if (t >= n || p0 + t < w->lo) { /* past the end, or before the window */
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
        const int64_t len = ctx - nq + x / G + 1, lo = window_first(j, len - 1);
        float *s = w->scores + x * st;
        w->sums[x] = softmax_numerators(s + lo, len - lo, ctx - lo);
        for (int64_t p = w->first; p < lo; p++) s[p] = 0.f; /* before the row's window */
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
    for (int64_t x = 0; x < Q; x++)
        store_row(j->out, ((q0 + x / G) * H + g * G + x % G) * D, acc + x * D, w->sums[x], D, BF16);
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
int paged_decode_grouped(const Job *j, int64_t max_rows, int dtype, int num_threads) {
    /* Q: the most query vectors of one unit (G query heads x the most rows of a request) */
    const int64_t Q = j->num_heads / j->num_kv_heads * max_rows, D = j->head_dim;
    /* a unit: one KV head of one request (whole requests, all heads' rows read by one thread
     * in one go, measured no faster: 0.37 vs 0.36 ms per SmolLM2 layer in bfloat16) */
    const int64_t hkv = j->num_kv_heads, units = j->num_reqs * hkv;
    const int64_t stride = (j->max_context + 15) / 16 * 16;
    int failed = 0;
    int64_t claimed = 0; /* units handed out so far (shared: dynamic scheduling, one at a time) */
#pragma omp parallel num_threads(kernel_threads(num_threads, units)) reduction(| : failed)
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
                ahead.rows = w.next_rows + unit_first(j, rn);
                ahead.keys = j->context_lens[rn] - unit_first(j, rn);
                const int64_t lines = ahead.keys * ((ahead.row_bytes + 63) / 64);
                ahead.per_step = (lines + steps - 1) / steps;
            }
            unit_rows(j, r, g, w.rows);
            w.lo = unit_first(j, r);
            w.first = w.lo / 16 * 16;
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

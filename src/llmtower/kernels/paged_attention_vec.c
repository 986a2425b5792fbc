/* ------------------------------------------------- grouped one-query decode on the vector layer
 * Where the AVX-512 grouped path (paged_attention_grouped.c) is not built but vec.h has a vector
 * layer (AVX2 + FMA, NEON) and the head size is a multiple of 32 (up to 256), paged_decode runs
 * this instead of the portable `attend`. One request per thread at a time, as there; what
 * changes is how each key and value row is used:
 *
 * - scores: slot by slot (the cache's rows walked contiguously, all KV heads of a slot at once),
 *   each KV head's key row multiplied into one partial vector per query head of its group (two
 *   FMA chains), and every VEC_LANES keys the partials folded into VEC_LANES scores at once
 *   (vf_sum_tile: ~1 instruction per score, where a reduction per score costs ~5);
 * - values: up to VH query heads x VC vectors of their dims held in registers across the
 *   whole context, one pass per (KV head, head triple, 32 dims), so each value vector is loaded
 *   once per triple and no accumulator goes through memory (`attend` loads and stores every
 *   accumulator once per key and head);
 * - memory: the rows of the key PF_AHEAD slots ahead (K and V, all heads) are asked for while a
 *   slot's scores are computed, and the next request's first rows while the values are weighed,
 *   so the value passes (which walk one KV head's slice of each row) find their lines in cache.
 *
 * The arithmetic is float32 throughout (bfloat16 widened on load, rounded once on the store);
 * only the summation order differs from `attend` (and from PyTorch's SDPA). */
#include "paged_attention.h"
#include "vec.h"

#if VEC_FAST && !defined(PAGED_GQA)
/* value pass: VH heads x VC vectors (32 dims) of accumulators; AVX2's 16 registers hold the
 * 12 of 3 x 4 plus a broadcast weight (the values come in as memory operands), NEON's 32 the
 * 24 of 3 x 8 */
enum { VH = 3, VC = 32 / VEC_LANES, PF_AHEAD = 8 };

static inline __attribute__((always_inline)) vf ldv(const void *p, int64_t i, const int BF16) {
    return BF16 ? vf_load_bf16((const uint16_t *)p + i) : vf_load((const float *)p + i);
}

/* Scratch of one thread, for H query heads and contexts up to max_context. */
typedef struct {
    float *scores;  /* [H][stride]: the weights of keys lo.. (index 0 = key lo) */
    float *q, *acc; /* [H][D] the widened scaled query; the weighted values */
    float *sums;    /* [H] */
    vf *part;       /* [H][VEC_LANES] one tile's partial vectors */
    int64_t *rows;  /* [max_context] element offset of each key's slot row (all KV heads) */
    int64_t stride;
} VecScratch;

/* rows[p - lo] for keys lo .. ctx - 1 of request r; returns lo */
static int64_t slot_rows(const Job *j, int64_t r, int64_t *rows) {
    const int64_t bs = j->block_size, ctx = j->context_lens[r], row = j->num_kv_heads * j->head_dim;
    const int64_t lo = window_first(j, ctx - 1);
    const int64_t *table = j->block_tables + r * j->bt_stride;
    for (int64_t p0 = lo / bs * bs; p0 < ctx; p0 += bs) {
        const int64_t base = table[p0 / bs] * bs * row;
        const int64_t n = ctx - p0 < bs ? ctx - p0 : bs;
        for (int64_t t = p0 < lo ? lo - p0 : 0; t < n; t++) rows[p0 + t - lo] = base + t * row;
    }
    return lo;
}

/* asks for the `bytes` of one slot row of K and of V */
static inline void prefetch_row(const char *k, const char *v, int64_t at, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) {
        vec_prefetch_l2(k + at + b);
        vec_prefetch_l2(v + at + b);
    }
}

/* the weighted values of heads h0 .. h0 + NH - 1 (one KV head's), dims off .. off + 32 of its
 * rows, over the n keys: acc[i * D + ...] */
static inline __attribute__((always_inline)) void weigh(const void *V, const int64_t *rows,
                                                        int64_t n, int64_t off, const float *s,
                                                        int64_t st, float *acc, const int64_t D,
                                                        const int BF16, const int NH) {
    vf a[VH][VC];
    for (int i = 0; i < NH; i++)
        for (int c = 0; c < VC; c++) a[i][c] = vf_zero();
    for (int64_t p = 0; p < n; p++) {
        const int64_t at = rows[p] + off;
        for (int i = 0; i < NH; i++) {
            const vf e = vf_set1(s[i * st + p]);
            for (int c = 0; c < VC; c++) a[i][c] = vf_fma(e, ldv(V, at + c * VEC_LANES, BF16), a[i][c]);
            /* float32: each head's FMAs take the values from memory again. Kept in registers
             * for all heads (the compiler's choice) they leave one accumulator too few, and
             * the one spilled went through a store and a load every key (AVX2, three heads). */
            if (!BF16 && i + 1 < NH) __asm__ volatile("" ::: "memory");
        }
    }
    for (int i = 0; i < NH; i++)
        for (int c = 0; c < VC; c++) vf_store(acc + i * D + c * VEC_LANES, a[i][c]);
}

static inline __attribute__((always_inline)) void attend_vec(const Job *j, int64_t r,
                                                             int64_t next, const VecScratch *w,
                                                             const int64_t D, const int BF16) {
    const int64_t H = j->num_heads, nkv = j->num_kv_heads, G = H / nkv, st = w->stride;
    const int64_t ctx = j->context_lens[r], row = nkv * D, esz = BF16 ? 2 : 4;
    const int64_t lo = slot_rows(j, r, w->rows), n = ctx - lo, *rows = w->rows;
    const char *K = j->k, *V = j->v;
    for (int64_t i = 0; i < H * D; i++) w->q[i] = ld(j->q, r * j->q_stride + i, BF16) * j->scale;
    for (int64_t p = 0; p < n && p < PF_AHEAD; p++) prefetch_row(K, V, rows[p] * esz, row * esz);

    /* scores[h][p] = q_h . k_p, VEC_LANES keys per tile */
    for (int64_t p = 0; p < n; p++) {
        if (p + PF_AHEAD < n) prefetch_row(K, V, rows[p + PF_AHEAD] * esz, row * esz);
        const int64_t slot = p % VEC_LANES;
        for (int64_t g = 0; g < nkv; g++) {
            const int64_t kr = rows[p] + g * D;
            for (int64_t x = 0; x < G; x++) {
                const float *qh = w->q + (g * G + x) * D;
                vf s0 = vf_zero(), s1 = vf_zero();
                for (int64_t c = 0; c < D; c += 2 * VEC_LANES) {
                    s0 = vf_fma(vf_load(qh + c), ldv(K, kr + c, BF16), s0);
                    s1 = vf_fma(vf_load(qh + c + VEC_LANES), ldv(K, kr + c + VEC_LANES, BF16), s1);
                }
                w->part[(g * G + x) * VEC_LANES + slot] = vf_add(s0, s1);
            }
        }
        if (slot == VEC_LANES - 1 || p == n - 1) {
            for (int64_t h = 0; h < H; h++) {
                for (int64_t l = slot + 1; l < VEC_LANES; l++) w->part[h * VEC_LANES + l] = vf_zero();
                vf_store(w->scores + h * st + p - slot, vf_sum_tile(w->part + h * VEC_LANES));
            }
        }
    }
    /* softmax numerators in place; each head's sum divides its output at the end */
    for (int64_t h = 0; h < H; h++) w->sums[h] = softmax_vec(w->scores + h * st, n);
    /* the next request's first rows, for when this one's values are done */
    if (next >= 0) {
        const int64_t *tn = j->block_tables + next * j->bt_stride, bs = j->block_size;
        const int64_t lon = window_first(j, j->context_lens[next] - 1);
        const int64_t first = tn[lon / bs] * bs * row + (lon % bs) * row;
        const int64_t m = j->context_lens[next] - lon < PF_AHEAD ? j->context_lens[next] - lon : PF_AHEAD;
        for (int64_t p = 0; p < m && lon % bs + p < bs; p++)
            prefetch_row(K, V, (first + p * row) * esz, row * esz);
    }
    /* acc[h] = sum_p weight[h][p] * v_p */
    for (int64_t g = 0; g < nkv; g++)
        for (int64_t x0 = 0; x0 < G; x0 += VH) {
            const int64_t h0 = g * G + x0;
            const float *s = w->scores + h0 * st;
            float *acc = w->acc + h0 * D;
            for (int64_t c0 = 0; c0 < D; c0 += 32) {
                switch (G - x0 < VH ? G - x0 : VH) {
                    case 1: weigh(V, rows, n, g * D + c0, s, st, acc + c0, D, BF16, 1); break;
                    case 2: weigh(V, rows, n, g * D + c0, s, st, acc + c0, D, BF16, 2); break;
                    default: weigh(V, rows, n, g * D + c0, s, st, acc + c0, D, BF16, 3);
                }
            }
        }
    for (int64_t h = 0; h < H; h++)
        store_row(j->out, (r * H + h) * D, w->acc + h * D, w->sums[h], D, BF16);
}

static void attend_vec_one(const Job *j, int64_t r, int64_t next, const VecScratch *w, int bf16) {
    switch (j->head_dim * 2 + bf16) { /* the common head sizes get fully unrolled copies */
        case 64 * 2: attend_vec(j, r, next, w, 64, 0); break;
        case 64 * 2 + 1: attend_vec(j, r, next, w, 64, 1); break;
        case 128 * 2: attend_vec(j, r, next, w, 128, 0); break;
        case 128 * 2 + 1: attend_vec(j, r, next, w, 128, 1); break;
        default: /* a multiple of 32 up to 256 (checked by the caller) */
            if (bf16) attend_vec(j, r, next, w, j->head_dim, 1);
            else attend_vec(j, r, next, w, j->head_dim, 0);
    }
}

int paged_decode_vec(const Job *j, int dtype, int num_threads) {
    const int64_t H = j->num_heads, D = j->head_dim;
    const int64_t stride = (j->max_context + VEC_LANES - 1) / VEC_LANES * VEC_LANES;
    int failed = 0;
    int64_t claimed = 0; /* requests handed out so far (dynamic scheduling, one at a time) */
#pragma omp parallel num_threads(kernel_threads(num_threads, j->num_reqs)) reduction(| : failed)
    {
        VecScratch w = {malloc(sizeof(float) * (size_t)(H * stride)),
                        malloc(sizeof(float) * (size_t)(H * D)),
                        malloc(sizeof(float) * (size_t)(H * D)),
                        malloc(sizeof(float) * (size_t)H),
                        aligned_alloc(64, sizeof(vf) * (size_t)(H * VEC_LANES)),
                        malloc(sizeof(int64_t) * (size_t)stride), stride};
        failed = !w.scores || !w.q || !w.acc || !w.sums || !w.part || !w.rows;
        /* each thread claims its next request before it starts the current one, so that it
         * can ask for the next one's first rows meanwhile */
        int64_t r = failed ? j->num_reqs : __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (r < j->num_reqs) {
            const int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            attend_vec_one(j, r, next < j->num_reqs ? next : -1, &w, dtype == 1);
            r = next;
        }
        free(w.scores);
        free(w.q);
        free(w.acc);
        free(w.sums);
        free(w.part);
        free(w.rows);
    }
    return failed;
}
#endif

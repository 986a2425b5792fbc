/* One decoder layer's work between two attentions, for a decode step, in one call and one
 * OpenMP parallel region (bfloat16 or float32, the step's `bf16` flag):
 *
 *   x  = attn_out @ Wo.T (+ o_bias)
 *   h += x;  n = post_norm * rmsnorm(h)                (fused_rows.h, as fused_ops.c)
 *   y  = silu(n @ Wg.T) * (n @ Wu.T)                   (the interleaved gate/up weights)
 *   x  = y @ Wd.T
 *   h += x;  n = next_norm * rmsnorm(h)                (the next layer's input norm)
 *   qkv = n @ Wqkv.T (+ qkv_bias)                      (the next layer's fused projection)
 *   RoPE of q and k; k and v written to their KV slots; q to q_out.
 *
 * The products: bfloat16, the tiles of gemv_bf16 (gemv_bf16_tiles.h, a few rows) or of
 * gemm_bf16 (gemm_bf16_tiles.h, more rows; the same packed weights and the same sums); float32,
 * the panels of gemm_f32 (gemm_f32_panels.h, up to a few hundred rows).
 * Separately, each of these seven operations is a Python dispatch, an output allocation, a
 * ctypes call and an OpenMP fork/join; a decode step makes ~250 of them. Here each product
 * shares its work out to the region's threads (a barrier after each), and the row-wise steps
 * share the rows. Each step is computed by the same code as the separate kernels, and a row's
 * values depend neither on the other rows nor on the thread count, so the results are bit for
 * bit those of the unfused path.
 */
#include <stdint.h>
#include "bf16.h"
#include "fused_rows.h"
#include "gemv_bf16_tiles.h"
#include "gemm_bf16_tiles.h"
#include "gemm_f32_panels.h"
#include "threads.h"

/* bfloat16 products of at most this many rows take the few-row tiles, larger ones gemm_bf16's
 * (both sum alike: the choice changes the speed only). */
#define FEW_ROWS 8
/* Whether decode_layers prefetches the next attention's K/V during the float32 products. */
int decode_layer_prefetch_kv = 1;

/* One layer's matrices in its dtype's kernel layout and its vectors (the step's dtype);
 * `layer` its index (the LoRA products of the pair: layer's o, gate_up, down, layer + 1's qkv). */
typedef struct {
    const void *o, *o_bias, *post_norm, *gate_up, *down, *next_norm, *qkv, *qkv_bias;
    int64_t layer;
} DecodeLayerWeights;

/* LoRA (float32): one fused product's low-rank matrices in one layer for every adapter of the
 * step's active set (slot s). Part p (q, k, v of qkv; gate, up of a silu pair; the whole of o
 * or down) owns rank rows p*r .. p*r + r - 1 of each slot's A and output columns cols[p] ..
 * cols[p + 1] (cols[nparts] = n; a silu pair's gate 0..inter, up inter..2*inter, as in
 * F32Addend). a NULL: no adapter of the set targets this product. */
typedef struct {
    const float *a; /* [slots][nparts * r][k]: A (rank rows of zero past an adapter's rank) */
    const float *b; /* [slots][part p][r][cols[p+1] - cols[p]]: B.T (scaling folded in) */
    int64_t nparts, r;
    int64_t cols[4];
} LoraProduct;

/* LoRA: a step's (or its sampled rows') adapter rows, grouped by slot: rows[starts[s] ..
 * starts[s + 1]) use slot s; index[row] is a row's position in `rows` (its row of s and d),
 * -1 for a row without an adapter. s and d: work buffers [count, ld_s] and [count, ld_d]. */
typedef struct {
    const LoraProduct *products; /* [layers][4]: qkv, o, gate_up, down */
    const int64_t *rows, *starts, *index;
    int64_t slots;
    float *s, *d;
    int64_t ld_s, ld_d;
} LoraRows;

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_PRODUCTS };

/* What every layer of one step shares: shapes, dtype, rotary tables, indices and work
 * buffers. */
typedef struct {
    int64_t t, hidden, inter, nh, nkv, d;
    float eps;
    int num_threads;
    int bf16;
    const void *cos, *sin;
    const int64_t *positions, *slots;
    void *x, *n, *y, *qkv, *q_out; /* [t, hidden] x 2, [t, inter], [t, qkv], [t, nh * d] */
    const LoraRows *lora; /* float32 only; NULL: no row has an adapter */
} DecodeStep;

/* Whether the products of a dtype have their fast code here (bf16: AVX512_BF16; float32:
 * AVX-512F); Python uses the fused layer only where they do. */
int decode_layer_fast(int bf16) { return bf16 ? HAVE_FAST : F32_FAST; }

/* out = x @ W.T (+ bias), or silu(gate) * up (`silu`): the region's threads share the work,
 * and all of them have finished when it returns. float32: `after` [an, ak] (`asilu`) is the
 * next product's weights, whose first panels are prefetched (NULL: none). */
static inline __attribute__((always_inline)) void product(
        const void *x, int64_t m, int64_t ldx, const void *w, int64_t n, int64_t k,
        const void *bias, void *out, int64_t ldo, int silu, const int BF16, const void *after,
        int64_t an, int64_t ak, int asilu) {
    if (BF16 && m > FEW_ROWS) {
        gemm_bf16_tiles(x, m, ldx, w, n, k, bias, out, ldo, silu, HAVE_FAST);
    } else if (BF16) {
        few_rows_tiles(x, m, ldx, w, n, k, silu ? NULL : bias, out, ldo, silu, HAVE_FAST);
    } else {
        f32_product_shared(x, m, ldx, w, n, k, bias, out, ldo, silu, F32_FAST ? 0 : 1, after,
                           an, ak, asilu);
    }
}

/* Two rows' dot products with four rows of A (A rows k apart): s0[v] = x0 . a_v, s1[v] =
 * x1 . a_v (s1 NULL: x1 is x0 again, not stored); eight independent vector accumulators. */
static inline void lora_dot_2x4(const float *x0, const float *x1, const float *a, int64_t k,
                                float *s0, float *s1) {
    vf c0[4], c1[4];
    for (int v = 0; v < 4; v++) c0[v] = c1[v] = vf_zero();
    int64_t kk = 0;
    for (; kk + VEC_LANES <= k; kk += VEC_LANES) {
        const vf xa = vf_load(x0 + kk), xb = vf_load(x1 + kk);
        for (int v = 0; v < 4; v++) {
            const vf w = vf_load(a + v * k + kk);
            c0[v] = vf_fma(xa, w, c0[v]);
            c1[v] = vf_fma(xb, w, c1[v]);
        }
    }
    for (int v = 0; v < 4; v++) {
        float t0 = vf_reduce_add(c0[v]), t1 = vf_reduce_add(c1[v]);
        for (int64_t i = kk; i < k; i++) {
            t0 += x0[i] * a[v * k + i];
            t1 += x1[i] * a[v * k + i];
        }
        s0[v] = t0;
        if (s1) s1[v] = t1;
    }
}

/* Two rows' expand over `nv` (1..4) vectors of columns: d0/d1[c..] = sum_j s0/s1[j] * b[j][c..]
 * (b rows np apart; d1 NULL: not stored). */
static inline __attribute__((always_inline)) void lora_expand_2(
        const float *s0, const float *s1, const float *b, int64_t np, int64_t r, int nv,
        float *d0, float *d1) {
    vf c0[4], c1[4];
    for (int v = 0; v < 4; v++) c0[v] = c1[v] = vf_zero();
    for (int64_t j = 0; j < r; j++) {
        const vf xa = vf_set1(s0[j]), xb = vf_set1(s1[j]);
        for (int v = 0; v < nv; v++) {
            const vf w = vf_load(b + j * np + v * VEC_LANES);
            c0[v] = vf_fma(xa, w, c0[v]);
            c1[v] = vf_fma(xb, w, c1[v]);
        }
    }
    for (int v = 0; v < nv; v++) {
        vf_store(d0 + v * VEC_LANES, c0[v]);
        if (d1) vf_store(d1 + v * VEC_LANES, c1[v]);
    }
}

/* Part p of product P for slot sl's rows: their shrink s[., p*r ..] = x . A_p.T, then their
 * expand d[., cols of p] = s . B_p.T, two rows at a time (the part's A and B stay in cache
 * across the slot's rows). */
static void lora_part(const LoraRows *L, const LoraProduct *P, int64_t sl, int64_t p,
                      const float *x, int64_t ldx, int64_t k) {
    const int64_t r = P->r, rr = P->nparts * r, n = P->cols[P->nparts];
    const int64_t np = P->cols[p + 1] - P->cols[p];
    const float *a = P->a + (sl * rr + p * r) * k;      /* [r][k] */
    const float *b = P->b + sl * r * n + r * P->cols[p]; /* [r][np] */
    for (int64_t i = L->starts[sl]; i < L->starts[sl + 1]; i += 2) {
        const int two = i + 1 < L->starts[sl + 1];
        const float *x0 = x + L->rows[i] * ldx, *x1 = two ? x + L->rows[i + 1] * ldx : x0;
        float *s0 = L->s + i * L->ld_s + p * r, *s1 = two ? s0 + L->ld_s : NULL;
        int64_t j = 0;
        for (; j + 4 <= r; j += 4) lora_dot_2x4(x0, x1, a + j * k, k, s0 + j, s1 ? s1 + j : NULL);
        for (; j < r; j++) {
            float t0 = 0.0f, t1 = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) {
                t0 += x0[kk] * a[j * k + kk];
                t1 += x1[kk] * a[j * k + kk];
            }
            s0[j] = t0;
            if (s1) s1[j] = t1;
        }
        const float *e1 = s1 ? s1 : s0;
        float *d0 = L->d + i * L->ld_d + P->cols[p], *d1 = two ? d0 + L->ld_d : NULL;
        int64_t c = 0;
        for (; c + 4 * VEC_LANES <= np; c += 4 * VEC_LANES)
            lora_expand_2(s0, e1, b + c, np, r, 4, d0 + c, d1 ? d1 + c : NULL);
        for (; c + VEC_LANES <= np; c += VEC_LANES)
            lora_expand_2(s0, e1, b + c, np, r, 1, d0 + c, d1 ? d1 + c : NULL);
        for (; c < np; c++) {
            float t0 = 0.0f, t1 = 0.0f;
            for (int64_t jj = 0; jj < r; jj++) {
                t0 += s0[jj] * b[jj * np + c];
                t1 += e1[jj] * b[jj * np + c];
            }
            d0[c] = t0;
            if (d1) d1[c] = t1;
        }
    }
}

/* The LoRA deltas of product P for the rows of L, into L->d (row index[i], columns 0..n):
 * each (slot, part) one job of the region's threads, a barrier after them. x [t, k] rows ldx
 * apart. Returns the terms for the product's epilogue (f32_addend). */
static const F32Addend *lora_delta(const LoraRows *L, const LoraProduct *P, const float *x,
                                   int64_t ldx, int64_t k, int silu, F32Addend *add) {
#pragma omp for schedule(static)
    for (int64_t job = 0; job < L->slots * P->nparts; job++)
        lora_part(L, P, job / P->nparts, job % P->nparts, x, ldx, k);
    add->d = L->d;
    add->index = L->index;
    add->ld = L->ld_d;
    add->half = silu ? P->cols[P->nparts] / 2 : 0;
    return add;
}

/* The LoRA product `which` of layer `layer` (NULL: no rows, bfloat16, or no adapter on it). */
static inline const LoraProduct *lora_product(const LoraRows *L, int64_t layer, int which,
                                              const int BF16) {
    if (BF16 || !L) return NULL;
    const LoraProduct *P = &L->products[layer * LORA_PRODUCTS + which];
    return P->a ? P : NULL;
}

/* product() with the LoRA deltas of P (or none) added to its sums. */
static inline __attribute__((always_inline)) void lora_product_call(
        const LoraRows *L, const LoraProduct *P, const void *x, int64_t m, int64_t ldx,
        const void *w, int64_t n, int64_t k, const void *bias, void *out, int64_t ldo,
        int silu, const int BF16, const void *after, int64_t an, int64_t ak, int asilu) {
    F32Addend add;
    if (P) f32_addend = lora_delta(L, P, x, ldx, k, silu, &add);
    product(x, m, ldx, w, n, k, bias, out, ldo, silu, BF16, after, an, ak, asilu);
    f32_addend = NULL;
}

/* The layer's phases, run by every thread of the region (BF16 a constant in each caller). */
static inline __attribute__((always_inline)) void layer_body(
        const DecodeLayerWeights *w, const DecodeStep *s, void *h, const void *attn_out,
        int64_t attn_stride, void *k_cache, void *v_cache, const int BF16) {
    const int64_t t = s->t, hid = s->hidden, qd = s->nh * s->d;
    const int64_t qkv_n = (s->nh + 2 * s->nkv) * s->d;
    const LoraRows *L = s->lora;
    lora_product_call(L, lora_product(L, w->layer, LORA_O, BF16), attn_out, t, attn_stride,
                      w->o, hid, qd, w->o_bias, s->x, hid, 0, BF16, w->gate_up, s->inter, hid,
                      1);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++)
        add_rms_norm_row(h, s->x, w->post_norm, s->n, r, hid, s->eps, BF16);
    lora_product_call(L, lora_product(L, w->layer, LORA_GATE_UP, BF16), s->n, t, hid,
                      w->gate_up, s->inter, hid, NULL, s->y, s->inter, 1, BF16, w->down, hid,
                      s->inter, 0);
    lora_product_call(L, lora_product(L, w->layer, LORA_DOWN, BF16), s->y, t, s->inter,
                      w->down, hid, s->inter, NULL, s->x, hid, 0, BF16, w->qkv, qkv_n, hid, 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++)
        add_rms_norm_row(h, s->x, w->next_norm, s->n, r, hid, s->eps, BF16);
    /* the attention's KV reads come between it and the next o */
    lora_product_call(L, lora_product(L, w->layer + 1, LORA_QKV, BF16), s->n, t, hid, w->qkv,
                      qkv_n, hid, w->qkv_bias, s->qkv, qkv_n, 0, BF16, NULL, 0, 0, 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++)
        rope_kv_row(s->qkv, qkv_n, r, s->nh, s->nkv, s->d, s->cos, s->sin, s->positions,
                    s->slots, k_cache, v_cache, s->q_out, NULL, BF16);
}

/* One function per dtype, so that the row code is compiled for it. */
static void layer_bf16(const DecodeLayerWeights *w, const DecodeStep *s, void *h,
                       const void *attn_out, int64_t attn_stride, void *k_cache, void *v_cache) {
    layer_body(w, s, h, attn_out, attn_stride, k_cache, v_cache, 1);
}

static void layer_f32(const DecodeLayerWeights *w, const DecodeStep *s, void *h,
                      const void *attn_out, int64_t attn_stride, void *k_cache, void *v_cache) {
    layer_body(w, s, h, attn_out, attn_stride, k_cache, v_cache, 0);
}

/* h [t, hidden] is the residual stream (updated in place); attn_out [t, nh * d] rows
 * attn_stride apart; k_cache / v_cache the next layer's caches. Returns 0, or 1 for bad
 * sizes. */
int decode_layer(const DecodeLayerWeights *w, const DecodeStep *s, void *h, const void *attn_out,
                 int64_t attn_stride, void *k_cache, void *v_cache) {
    if (s->t <= 0 || s->hidden <= 0 || s->inter <= 0 || s->d <= 0 || s->d % 2
            || attn_stride < s->nh * s->d)
        return 1;
#pragma omp parallel num_threads(s->num_threads) if (s->num_threads > 1)
    {
        if (s->bf16) layer_bf16(w, s, h, attn_out, attn_stride, k_cache, v_cache);
        else layer_f32(w, s, h, attn_out, attn_stride, k_cache, v_cache);
    }
    return 0;
}

/* kernels/paged_attention.c's paged_decode (one query row per request), called by address so
 * that a step's layers need no Python between them (decode_layer.py checks its declared
 * signature before handing the address over). */
typedef int (*PagedDecodeFn)(const void *q, int64_t q_stride, const void *k_cache,
                             const void *v_cache, const int64_t *block_tables, int64_t bt_stride,
                             const int64_t *context_lens, void *out, int64_t num_reqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, float scale, int dtype, int num_threads);

/* One step's decode attention: the kernel, the requests' tables and lengths (checked once per
 * step by the Python caller), and the output buffer [t, nh * d]. */
typedef struct {
    PagedDecodeFn fn;
    const int64_t *block_tables;
    int64_t bt_stride;
    const int64_t *context_lens;
    int64_t block_size;
    float scale;
    void *out;
} DecodeAttention;

/* The next attention's K and V blocks as a prefetch stream (F32Side): requests r .. r_end,
 * each one's blocks in table order, K then V. */
typedef struct {
    const char *k, *v;
    const int64_t *bt, *lens;
    int64_t bt_stride, bs, block_lines, r, r_end, blk, kv, line;
} KvStream;

static int64_t kv_take(void *state, int64_t max, const char **ptr) {
    KvStream *q = state;
    while (q->r < q->r_end) {
        const int64_t blocks = (q->lens[q->r] + q->bs - 1) / q->bs;
        if (q->blk >= blocks) { q->r++; q->blk = 0; continue; }
        const int64_t id = q->bt[q->r * q->bt_stride + q->blk];
        const char *base = (q->kv ? q->v : q->k) + id * q->block_lines * 64;
        int64_t n = q->block_lines - q->line;
        if (n > max) n = max;
        *ptr = base + q->line * 64;
        q->line += n;
        if (q->line >= q->block_lines) {
            q->line = 0;
            if (++q->kv == 2) { q->kv = 0; q->blk++; }
        }
        return n;
    }
    return 0;
}

/* decode_layer with the next attention's K/V blocks (k_cache, v_cache: the next layer's, whose
 * attention follows) prefetched into L2 in the float32 products' spare k steps (F32Side), each
 * thread its share of the requests. The products are compute-bound and the attention reads
 * ~20 MB per layer from memory at 64 requests (SmolLM2, float32): read during the products,
 * part of it is still in L2/L3 when the attention runs. bfloat16 products take no side stream. */
static int decode_layer_pf(const DecodeLayerWeights *w, const DecodeStep *s,
                           const DecodeAttention *a, void *h, const void *attn_out,
                           int64_t attn_stride, void *k_cache, void *v_cache) {
    if (s->t <= 0 || s->hidden <= 0 || s->inter <= 0 || s->d <= 0 || s->d % 2
            || attn_stride < s->nh * s->d)
        return 1;
    const int64_t block_lines = a->block_size * s->nkv * s->d * (s->bf16 ? 2 : 4) / 64;
#pragma omp parallel num_threads(s->num_threads) if (s->num_threads > 1)
    {
        const int64_t th = kernel_thread(), team = kernel_team();
        KvStream q = {k_cache, v_cache, a->block_tables, a->context_lens, a->bt_stride,
                      a->block_size, block_lines, s->t * th / team, s->t * (th + 1) / team,
                      0, 0, 0};
        F32Side side = {kv_take, &q};
        f32_side = block_lines > 0 && a->block_size > 0 ? &side : NULL;
        if (s->bf16) layer_bf16(w, s, h, attn_out, attn_stride, k_cache, v_cache);
        else layer_f32(w, s, h, attn_out, attn_stride, k_cache, v_cache);
        f32_side = NULL;
    }
    return 0;
}

/* Layers first .. first + count - 1 (count >= 0), each: its attention over q in s->q_out and
 * its caches, then decode_layer through the next layer's qkv (w: the model's array of layer
 * pairs). Returns 0, paged_decode's nonzero code, or 1 for bad sizes. */
int decode_layers(const DecodeLayerWeights *w, const DecodeStep *s, const DecodeAttention *a,
                  void *h, void *const *k_caches, void *const *v_caches, int64_t first,
                  int64_t count) {
    const int64_t qd = s->nh * s->d;
    for (int64_t i = first; i < first + count; i++) {
        /* paged_decode's dtype codes: 0 float32, 1 bfloat16 */
        int rc = a->fn(s->q_out, qd, k_caches[i], v_caches[i], a->block_tables, a->bt_stride,
                       a->context_lens, a->out, s->t, s->nh, s->nkv, s->d, a->block_size,
                       a->scale, s->bf16 ? 1 : 0, s->num_threads);
        if (rc) return rc;
        rc = decode_layer_prefetch_kv ? decode_layer_pf(&w[i], s, a, h, a->out, qd, k_caches[i + 1], v_caches[i + 1])
                         : decode_layer(&w[i], s, h, a->out, qd, k_caches[i + 1], v_caches[i + 1]);
        if (rc) return rc;
    }
    return 0;
}

/* The two ends of a pure one-row decode step, for decode_step: layer 0's input norm and qkv
 * (the embedding rows come in as h), the last layer's work after its attention, the model's
 * final norm and (bfloat16) the output layer. Vectors in the step's dtype, matrices in its
 * kernel layout. */
typedef struct {
    const void *first_norm, *first_qkv, *first_qkv_bias;
    const void *o, *o_bias, *post_norm, *gate_up, *down, *final_norm;
    const void *head; /* [vocab, hidden] in the kernel layout, or NULL: Python's */
    int64_t vocab;
    int64_t last; /* the last layer's index (its LoRA products) */
} DecodeEnds;

/* One step's sampled rows (the step's logits_indices) and where their results go. */
typedef struct {
    const int64_t *rows;
    int64_t m;
    void *h_rows, *attn_rows; /* scratch [m, hidden] and [m, nh * d]: the rows gathered */
    void *out;                /* [m, hidden]: the final norm's rows */
    void *logits_bf16;        /* [m, vocab] the output layer's bfloat16 results (bf16 head) */
    float *logits;            /* [m, vocab] those as float32 (head only) */
    const LoraRows *lora;     /* the sampled rows' adapters (rows 0..m-1), or NULL: none */
} DecodeTail;

/* Layer 0 up to its attention: n = input_norm * rmsnorm(h), its qkv, RoPE, K/V written, q to
 * q_out (as fused_ops' add_rms_norm and rope_kv_write after the qkv product). */
static inline __attribute__((always_inline)) void first_body(
        const DecodeEnds *e, const DecodeStep *s, void *h, void *k_cache, void *v_cache,
        const int BF16) {
    const int64_t t = s->t, hid = s->hidden, qkv_n = (s->nh + 2 * s->nkv) * s->d;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++)
        add_rms_norm_row(h, NULL, e->first_norm, s->n, r, hid, s->eps, BF16);
    lora_product_call(s->lora, lora_product(s->lora, 0, LORA_QKV, BF16), s->n, t, hid,
                      e->first_qkv, qkv_n, hid, e->first_qkv_bias, s->qkv, qkv_n, 0, BF16, NULL,
                      0, 0, 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++)
        rope_kv_row(s->qkv, qkv_n, r, s->nh, s->nkv, s->d, s->cos, s->sin, s->positions,
                    s->slots, k_cache, v_cache, s->q_out, NULL, BF16);
}

/* The last layer after its attention, for the sampled rows only (gathered first unless they
 * are all rows in order: `gather`): o projection, residual + post norm, MLP, residual + the
 * final norm into tail->out, then (head) the output layer and its float32 copy. */
static inline __attribute__((always_inline)) void last_body(
        const DecodeEnds *e, const DecodeStep *s, const DecodeTail *tl, void *h,
        const void *attn_out, int gather, const int BF16) {
    const int64_t m = tl->m, hid = s->hidden, qd = s->nh * s->d;
    const size_t es = BF16 ? 2 : 4;
    const void *ao = attn_out;
    void *hr = h;
    if (gather) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            memcpy((char *)tl->attn_rows + r * qd * es, (const char *)attn_out + tl->rows[r] * qd * es,
                   qd * es);
            memcpy((char *)tl->h_rows + r * hid * es, (const char *)h + tl->rows[r] * hid * es,
                   hid * es);
        }
        ao = tl->attn_rows;
        hr = tl->h_rows;
    }
    const LoraRows *L = tl->lora;
    lora_product_call(L, lora_product(L, e->last, LORA_O, BF16), ao, m, qd, e->o, hid, qd,
                      e->o_bias, s->x, hid, 0, BF16, e->gate_up, s->inter, hid, 1);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        add_rms_norm_row(hr, s->x, e->post_norm, s->n, r, hid, s->eps, BF16);
    lora_product_call(L, lora_product(L, e->last, LORA_GATE_UP, BF16), s->n, m, hid,
                      e->gate_up, s->inter, hid, NULL, s->y, s->inter, 1, BF16, e->down, hid,
                      s->inter, 0);
    lora_product_call(L, lora_product(L, e->last, LORA_DOWN, BF16), s->y, m, s->inter, e->down,
                      hid, s->inter, NULL, s->x, hid, 0, BF16, NULL, 0, 0, 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        add_rms_norm_row(hr, s->x, e->final_norm, tl->out, r, hid, s->eps, BF16);
    /* tl->logits NULL: the caller wants the final norm's rows only (greedy_head reads them) */
    if (e->head && tl->logits && BF16) {
        product(tl->out, m, hid, e->head, e->vocab, hid, NULL, tl->logits_bf16, e->vocab, 0, BF16,
                NULL, 0, 0, 0);
        const int64_t total = m * e->vocab;
        const uint16_t *restrict src = tl->logits_bf16;
        float *restrict dst = tl->logits;
#pragma omp for simd schedule(static)
        for (int64_t i = 0; i < total; i++) dst[i] = bf16_to_f32(src[i]);
    } else if (e->head && tl->logits) {
        product(tl->out, m, hid, e->head, e->vocab, hid, NULL, tl->logits, e->vocab, 0, BF16,
                NULL, 0, 0, 0);
    }
}

static void first_bf16(const DecodeEnds *e, const DecodeStep *s, void *h, void *kc, void *vc) {
    first_body(e, s, h, kc, vc, 1);
}

static void first_f32(const DecodeEnds *e, const DecodeStep *s, void *h, void *kc, void *vc) {
    first_body(e, s, h, kc, vc, 0);
}

static void last_bf16(const DecodeEnds *e, const DecodeStep *s, const DecodeTail *tl, void *h,
                      const void *ao, int gather) {
    last_body(e, s, tl, h, ao, gather, 1);
}

static void last_f32(const DecodeEnds *e, const DecodeStep *s, const DecodeTail *tl, void *h,
                     const void *ao, int gather) {
    last_body(e, s, tl, h, ao, gather, 0);
}

/* A whole pure one-row decode step of num_layers >= 2 layers: layer 0's norm, qkv, RoPE and
 * K/V write over h (the embedding rows, the residual stream, updated in place), every layer's
 * attention and the work between them (decode_layers), and the last layer's rest with the
 * final norm for the sampled rows, and (e->head) the output layer: three OpenMP regions
 * beside the attentions. Tables and lengths checked by the caller. Returns 0, paged_decode's
 * nonzero code, 1 for bad sizes, 2 for a sampled row outside 0..t-1. */
int decode_step(const DecodeLayerWeights *w, const DecodeEnds *e, const DecodeStep *s,
                const DecodeAttention *a, const DecodeTail *tl, void *h, void *const *k_caches,
                void *const *v_caches, int64_t num_layers) {
    if (s->t <= 0 || s->hidden <= 0 || s->inter <= 0 || s->d <= 0 || s->d % 2
            || num_layers < 2 || tl->m <= 0 || tl->m > s->t)
        return 1;
    int gather = tl->m != s->t;
    for (int64_t r = 0; r < tl->m; r++) {
        if (tl->rows[r] < 0 || tl->rows[r] >= s->t) return 2;
        if (tl->rows[r] != r) gather = 1;
    }
    const int64_t qd = s->nh * s->d, last = num_layers - 1;
#pragma omp parallel num_threads(s->num_threads) if (s->num_threads > 1)
    {
        if (s->bf16) first_bf16(e, s, h, k_caches[0], v_caches[0]);
        else first_f32(e, s, h, k_caches[0], v_caches[0]);
    }
    int rc = decode_layers(w, s, a, h, k_caches, v_caches, 0, last);
    if (rc) return rc;
    rc = a->fn(s->q_out, qd, k_caches[last], v_caches[last], a->block_tables, a->bt_stride,
               a->context_lens, a->out, s->t, s->nh, s->nkv, s->d, a->block_size, a->scale,
               s->bf16 ? 1 : 0, s->num_threads);
    if (rc) return rc;
#pragma omp parallel num_threads(s->num_threads) if (s->num_threads > 1)
    {
        if (s->bf16) last_bf16(e, s, tl, h, a->out, gather);
        else last_f32(e, s, tl, h, a->out, gather);
    }
    return 0;
}

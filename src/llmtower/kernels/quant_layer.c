/* One decoder layer's work between two attentions over GGUF block weights (float32 steps of
 * a few rows: decodes), in one call and one OpenMP parallel region:
 *
 *   x  = attn_out @ Wo.T (+ o_bias)
 *   h += x;  n = post_norm * rmsnorm(h)
 *   g  = n @ Wgate_up.T;  y = silu(g[:, :I]) * g[:, I:]
 *   x  = y @ Wd.T
 *   h += x;  n = next_norm * rmsnorm(h)            (the next layer's input norm)
 *   qkv = n @ Wqkv.T (+ qkv_bias);  RoPE of q and k, k and v to their KV slots, q to q_out
 *
 * Called one by one from Python, these are ~15 ctypes calls, tensor allocations and eight
 * OpenMP fork/joins per layer (the activations' int8 forms, each product, each row op); at one
 * row a 1B model's decode step is ~16 x 15 of them around ~20 ms of weight reads. Here the
 * products share their weight rows out to the region's threads (quant_gemm_share,
 * quant_gemm_k_share: the separate kernels' own code), a barrier after each, and the row-wise
 * steps (norms, SiLU, quantizing the next product's activations) share the rows. Each value is
 * computed by the same code in the same order as the separate calls (quant_gemm.py,
 * fused_ops.c), so the results are bit for bit the unfused path's.
 *
 * quant_layers runs whole layers, each one's decode attention included (paged_decode called
 * by address, one query row per request), as decode_layer.c's decode_layers does.
 */
#include <stdint.h>
#include "fused_rows.h"
#include "quant_blocks.h"
#include "threads.h"

void silu_mul_row_f32(const float *y, float *out, int64_t r, int64_t n); /* fused_ops.c */

#define QL_PARTS 4

/* One linear layer's weight [sum n, k]: runs of one block format stacked along the rows
 * (q, k and v of different formats stay apart), each in the file's layout. */
typedef struct {
    const uint8_t *w[QL_PARTS];
    int64_t row_bytes[QL_PARTS], n[QL_PARTS];
    int fmt[QL_PARTS];
    int64_t nparts;
} QuantMatrix;

/* Layer i's o projection and MLP with layer i + 1's input norm and qkv (float32 vectors;
 * biases NULL where the model has none). */
typedef struct {
    QuantMatrix o, gate_up, down, qkv;
    const float *o_bias, *post_norm, *next_norm, *qkv_bias;
} QuantLayerWeights;

/* What every layer of one step shares: shapes, rotary tables, indices, float32 work buffers
 * (x, n [t, hidden]; g [t, 2 * inter]; y [t, inter]; qkv [t, qkv]; q_out [t, nh * d]) and the
 * activations' int8 forms for the largest k (kmax): per 32 values qa [t * kmax], da, fa
 * [t * kmax / 32], ns [t * kmax / 4]; per 256 qa_k [t * kmax], da_k [t * kmax / 256], bs_k
 * [t * kmax / 16]; qa_kn and bs_kn as qa_k and bs_k in Q4_K / Q5_K's nibble order. */
typedef struct {
    int64_t t, hidden, inter, nh, nkv, d;
    float eps;
    int num_threads;
    const float *cos, *sin;
    const int64_t *positions, *slots;
    float *x, *n, *g, *y, *qkv, *q_out;
    int8_t *qa;
    float *da, *fa;
    int32_t *ns;
    int8_t *qa_k;
    float *da_k;
    int16_t *bs_k;
    int8_t *qa_kn; /* per 256 in Q4_K / Q5_K's nibble order (the same scales da_k) */
    int16_t *bs_kn;
} QuantStep;

static inline int is_k(int fmt) { return fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q6_K; }
static inline int nibble_order(int fmt) { return fmt == F_Q4_K || fmt == F_Q5_K; }

/* Row r of x (k values) in the int8 forms W's parts read (as quantize_activations does). */
static inline void quantize_row(const QuantMatrix *W, const QuantStep *s, const float *x,
                                int64_t r, int64_t k) {
    int want32 = 0, want256 = 0, want256n = 0;
    for (int64_t p = 0; p < W->nparts; p++) {
        if (nibble_order(W->fmt[p])) want256n = 1;
        else if (is_k(W->fmt[p])) want256 = 1;
        else want32 = 1;
    }
    if (want32)
        quant_act(x, 1, k, k, s->qa + r * k, s->da + r * (k / 32), s->fa + r * (k / 32),
                  s->ns + r * (k / 32) * 8);
    if (want256)
        quant_act_k(x, 1, k, k, s->qa_k + r * k, s->da_k + r * (k / 256), s->bs_k + r * (k / 16),
                    0);
    if (want256n)
        quant_act_k(x, 1, k, k, s->qa_kn + r * k, s->da_k + r * (k / 256),
                    s->bs_kn + r * (k / 16), 1);
}

/* y [t, ldy] = the quantized rows @ W.T, the region's threads sharing each part's weight rows;
 * every thread has finished when it returns. */
static void product(const QuantMatrix *W, const QuantStep *s, int64_t k, float *y, int64_t ldy) {
    int64_t at = 0;
    for (int64_t p = 0; p < W->nparts; p++) {
        if (is_k(W->fmt[p])) {
            const int nib = nibble_order(W->fmt[p]);
            quant_gemm_k_share(W->fmt[p], W->w[p], W->row_bytes[p], W->n[p], k, s->t,
                               nib ? s->qa_kn : s->qa_k, s->da_k, nib ? s->bs_kn : s->bs_k,
                               y + at, ldy, 0);
        }
        else
            quant_gemm_share(W->fmt[p], W->w[p], W->row_bytes[p], W->n[p], k, s->t, s->qa,
                             s->da, s->fa, s->ns, y + at, ldy, 0);
        at += W->n[p];
    }
#pragma omp barrier
}

static void layer_body(const QuantLayerWeights *w, const QuantStep *s, float *h,
                       const float *attn_out, int64_t attn_stride, float *k_cache,
                       float *v_cache) {
    const int64_t t = s->t, hid = s->hidden, inter = s->inter, qd = s->nh * s->d;
    const int64_t qkv_n = (s->nh + 2 * s->nkv) * s->d;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++) quantize_row(&w->o, s, attn_out + r * attn_stride, r, qd);
    product(&w->o, s, qd, s->x, hid);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++) {
        if (w->o_bias)
            for (int64_t i = 0; i < hid; i++) s->x[r * hid + i] += w->o_bias[i];
        add_rms_norm_row(h, s->x, w->post_norm, s->n, r, hid, s->eps, 0);
        quantize_row(&w->gate_up, s, s->n + r * hid, r, hid);
    }
    product(&w->gate_up, s, hid, s->g, 2 * inter);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++) {
        silu_mul_row_f32(s->g, s->y, r, inter);
        quantize_row(&w->down, s, s->y + r * inter, r, inter);
    }
    product(&w->down, s, inter, s->x, hid);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++) {
        add_rms_norm_row(h, s->x, w->next_norm, s->n, r, hid, s->eps, 0);
        quantize_row(&w->qkv, s, s->n + r * hid, r, hid);
    }
    product(&w->qkv, s, hid, s->qkv, qkv_n);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < t; r++) {
        if (w->qkv_bias)
            for (int64_t i = 0; i < qkv_n; i++) s->qkv[r * qkv_n + i] += w->qkv_bias[i];
        rope_kv_row(s->qkv, qkv_n, r, s->nh, s->nkv, s->d, s->cos, s->sin, s->positions,
                    s->slots, k_cache, v_cache, s->q_out, NULL, 0);
    }
}

static int bad_step(const QuantStep *s, int64_t attn_stride) {
    return s->t <= 0 || s->hidden <= 0 || s->inter <= 0 || s->d <= 0 || s->d % 2
           || attn_stride < s->nh * s->d || s->hidden % 256 || s->inter % 256
           || (s->nh * s->d) % 256;
}

/* h [t, hidden] float32 is the residual stream (updated in place); attn_out [t, nh * d] rows
 * attn_stride apart; k_cache / v_cache the next layer's caches (float32). Returns 0, or 1 for
 * bad sizes (every k must be a multiple of 256: the K formats' super-blocks). */
int quant_layer(const QuantLayerWeights *w, const QuantStep *s, float *h, const float *attn_out,
                int64_t attn_stride, float *k_cache, float *v_cache) {
    if (bad_step(s, attn_stride)) return 1;
#pragma omp parallel num_threads(s->num_threads) if (s->num_threads > 1)
    layer_body(w, s, h, attn_out, attn_stride, k_cache, v_cache);
    return 0;
}

/* kernels/paged_attention.c's paged_decode, called by address (quant_layer.py checks its
 * declared signature before handing it over). */
typedef int (*QuantPagedDecodeFn)(const void *q, int64_t q_stride, const void *k_cache,
                                  const void *v_cache, const int64_t *block_tables,
                                  int64_t bt_stride, const int64_t *context_lens, void *out,
                                  int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, float scale, int dtype,
                                  int num_threads);

/* One step's decode attention: the kernel, the requests' tables and lengths (checked once per
 * step by the Python caller), and the output buffer [t, nh * d]. */
typedef struct {
    QuantPagedDecodeFn fn;
    const int64_t *block_tables;
    int64_t bt_stride;
    const int64_t *context_lens;
    int64_t block_size;
    float scale;
    float *out;
} QuantAttention;

/* Layers first .. first + count - 1, each: its attention over q in s->q_out, then quant_layer
 * through the next layer's qkv (w: the model's array of layer pairs). Returns 0,
 * paged_decode's nonzero code, or 1 for bad sizes. */
int quant_layers(const QuantLayerWeights *w, const QuantStep *s, const QuantAttention *a,
                 float *h, void *const *k_caches, void *const *v_caches, int64_t first,
                 int64_t count) {
    const int64_t qd = s->nh * s->d;
    for (int64_t i = first; i < first + count; i++) {
        int rc = a->fn(s->q_out, qd, k_caches[i], v_caches[i], a->block_tables, a->bt_stride,
                       a->context_lens, a->out, s->t, s->nh, s->nkv, s->d, a->block_size,
                       a->scale, 0, s->num_threads);
        if (rc) return rc;
        rc = quant_layer(&w[i], s, h, a->out, qd, k_caches[i + 1], v_caches[i + 1]);
        if (rc) return rc;
    }
    return 0;
}

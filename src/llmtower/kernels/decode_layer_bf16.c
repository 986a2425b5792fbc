/* One bfloat16 decoder layer's work between two attentions, for a decode step of a few rows,
 * in one call and one OpenMP parallel region:
 *
 *   x  = attn_out @ Wo.T (+ o_bias)                    (the few-row tiles of gemv_bf16)
 *   h += x;  n = post_norm * rmsnorm(h)                (fused_rows.h, as fused_ops.c)
 *   y  = bf16(silu(n @ Wg.T)) * (n @ Wu.T)             (the interleaved gate/up tiles)
 *   x  = y @ Wd.T
 *   h += x;  n = next_norm * rmsnorm(h)                (the next layer's input norm)
 *   qkv = n @ Wqkv.T (+ qkv_bias)                      (the next layer's fused projection)
 *   RoPE of q and k; k and v written to their KV slots; q to q_out.
 *
 * At batch 1 the Python around these steps (a dispatch, an output allocation and a ctypes call
 * for each of seven operations per layer) cost about as much as the attention itself; here
 * each step's products share their tiles out to the region's threads with the loops' own
 * barriers between steps, and the row-wise steps run on one thread (a few rows of 576 values).
 * Each step is computed by the same code as the separate kernels (gemv_bf16_tiles.h,
 * fused_rows.h), so the results are bit for bit those of the unfused path.
 */
#include <stdint.h>
#include "bf16.h"
#include "fused_rows.h"
#include "gemv_bf16_tiles.h"

/* One layer's matrices in the few-row kernel's layout and its vectors (bfloat16). */
typedef struct {
    const uint16_t *o, *o_bias, *post_norm, *gate_up, *down, *next_norm, *qkv, *qkv_bias;
} DecodeLayerWeights;

/* What every layer of one step shares: shapes, rotary tables, indices and work buffers. */
typedef struct {
    int64_t t, hidden, inter, nh, nkv, d;
    float eps;
    int num_threads;
    const uint16_t *cos, *sin;
    const int64_t *positions, *slots;
    uint16_t *x, *n, *y, *qkv, *q_out; /* [t, hidden] x 2, [t, inter], [t, qkv], [t, nh * d] */
} DecodeStep;

int decode_layer_bf16_fast(void) { return HAVE_FAST; }

/* h [t, hidden] is the residual stream (updated in place); attn_out [t, nh * d] rows
 * attn_stride apart; k_cache / v_cache the next layer's caches. Returns 0, or 1 for bad
 * sizes. */
int decode_layer_bf16(const DecodeLayerWeights *w, const DecodeStep *s, uint16_t *h,
                      const uint16_t *attn_out, int64_t attn_stride, uint16_t *k_cache,
                      uint16_t *v_cache) {
    const int64_t t = s->t, hid = s->hidden, qd = s->nh * s->d, qkv_n = (s->nh + 2 * s->nkv) * s->d;
    if (t <= 0 || hid <= 0 || s->inter <= 0 || s->d % 2) return 1;
    const int fast = HAVE_FAST;
#pragma omp parallel num_threads(s->num_threads) if (s->num_threads > 1)
    {
        gemv_tiles(attn_out, t, attn_stride, w->o, hid, qd, w->o_bias, s->x, hid, fast);
#pragma omp single
        for (int64_t r = 0; r < t; r++)
            add_rms_norm_row(h, s->x, w->post_norm, s->n, r, hid, s->eps, 1);
        silu_mul_tiles(s->n, t, hid, w->gate_up, s->inter, hid, s->y, s->inter, fast);
        gemv_tiles(s->y, t, s->inter, w->down, hid, s->inter, NULL, s->x, hid, fast);
#pragma omp single
        for (int64_t r = 0; r < t; r++)
            add_rms_norm_row(h, s->x, w->next_norm, s->n, r, hid, s->eps, 1);
        gemv_tiles(s->n, t, hid, w->qkv, qkv_n, hid, w->qkv_bias, s->qkv, qkv_n, fast);
#pragma omp single
        for (int64_t r = 0; r < t; r++)
            rope_kv_row(s->qkv, qkv_n, r, s->nh, s->nkv, s->d, s->cos, s->sin, s->positions,
                        s->slots, k_cache, v_cache, s->q_out, NULL, 1);
    }
    return 0;
}

/* kernels/paged_attention.c's paged_decode (one query row per request), called by address so
 * that a step's layers need no Python between them (decode_layer_bf16.py checks its
 * declared signature before handing the address over). */
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
    uint16_t *out;
} DecodeAttention;

/* Layers first .. first + count - 1 (count >= 0), each: its attention over q in s->q_out and
 * its caches, then decode_layer_bf16 through the next layer's qkv (w: the model's array of
 * layer pairs). Returns 0, paged_decode's nonzero code, or 1 for bad sizes. */
int decode_layers_bf16(const DecodeLayerWeights *w, const DecodeStep *s, const DecodeAttention *a,
                       uint16_t *h, void *const *k_caches, void *const *v_caches, int64_t first,
                       int64_t count) {
    const int64_t qd = s->nh * s->d;
    for (int64_t i = first; i < first + count; i++) {
        int rc = a->fn(s->q_out, qd, k_caches[i], v_caches[i], a->block_tables, a->bt_stride,
                       a->context_lens, a->out, s->t, s->nh, s->nkv, s->d, a->block_size,
                       a->scale, 1, s->num_threads);
        if (rc) return rc;
        rc = decode_layer_bf16(&w[i], s, h, a->out, qd, k_caches[i + 1], v_caches[i + 1]);
        if (rc) return rc;
    }
    return 0;
}

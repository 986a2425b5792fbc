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

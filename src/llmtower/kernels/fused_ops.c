/* The small per-layer operations of a decoder step, fused (float32 or bfloat16).
 *
 * At batch 1 a SmolLM2 layer is a handful of GEMVs and a dozen small tensor ops (RMSNorm alone
 * is seven); each op costs a few microseconds of dispatch whatever its size, which adds up to
 * more than the arithmetic over 30 layers. These functions do each group in one pass:
 *
 *   add_rms_norm   residual += x (optional); out = weight * rmsnorm(residual)
 *   rope_kv_write  rotate q and k of the fused qkv rows, write k and v into their KV slots,
 *                  q (and k) also to contiguous outputs for attention
 *   silu_mul       out = silu(y[:, :I]) * y[:, I:]  (the fused gate/up product's second half)
 *
 * Rounding follows PyTorch op by op, so the results equal the unfused torch code up to
 * summation order (the RMS) and fused multiply-adds: bfloat16 values are widened to float32,
 * and each result PyTorch would store in bfloat16 is rounded to nearest-even where PyTorch
 * rounds it (transformers' RMSNorm: the normalized value, then the product with the weight).
 * Rows are shared out to OpenMP threads only when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#include "fused_rows.h"
#include "vec.h"


/* Rows shared out to threads only from this many on: one row is a few hundred floats. */
#define PARALLEL_ROWS 16

int add_rms_norm(void *residual, const void *x, const void *weight, void *out, int64_t t,
                 int64_t h, float eps, int bf16, int num_threads) {
    if (t < 0 || h <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) if (t >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < t; r++) {
        if (bf16) add_rms_norm_row(residual, x, weight, out, r, h, eps, 1);
        else add_rms_norm_row(residual, x, weight, out, r, h, eps, 0);
    }
    return 0;
}

int rope_kv_write(const void *qkv, int64_t qkv_stride, int64_t t, int64_t nh, int64_t nkv,
                  int64_t d, const void *cos, const void *sin, const int64_t *positions,
                  const int64_t *slots, void *k_cache, void *v_cache, void *q_out, void *k_out,
                  int bf16, int num_threads) {
    if (t < 0 || d % 2) return 1;
#pragma omp parallel for num_threads(num_threads) if (t >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < t; r++) {
        if (bf16) rope_kv_row(qkv, qkv_stride, r, nh, nkv, d, cos, sin, positions, slots,
                              k_cache, v_cache, q_out, k_out, 1);
        else rope_kv_row(qkv, qkv_stride, r, nh, nkv, d, cos, sin, positions, slots,
                         k_cache, v_cache, q_out, k_out, 0);
    }
    return 0;
}

static inline __attribute__((always_inline)) void silu_mul_row(const void *y, void *out,
                                                               int64_t r, int64_t n, const int BF16) {
    int64_t i = 0;
#if VEC_FAST
    if (!BF16) { /* the same steps on vec.h (vf_exp: libm's expf to the bit, a vector at a time) */
        const float *g = (const float *)y + r * 2 * n, *u = g + n;
        float *o = (float *)out + r * n;
        for (; i + VEC_LANES <= n; i += VEC_LANES) {
            const vf gv = vf_load(g + i);
            const vf e = vf_exp(vf_sub(vf_zero(), gv));
            vf_store(o + i, vf_mul(vf_div(gv, vf_add(vf_set1(1.0f), e)), vf_load(u + i)));
        }
    }
#endif
#pragma omp simd
    for (int64_t c = i; c < n; c++) {
        float g = ld(y, r * 2 * n + c, BF16);
        float s = g / (1.0f + expf(-g));
        if (BF16) s = bf16_to_f32(f32_to_bf16(s)); /* F.silu, then the product */
        st(out, r * n + c, s * ld(y, r * 2 * n + n + c, BF16), BF16);
    }
}

/* One float32 row of silu_mul, for quant_layer.c's fused layer (the same code, so the same bits). */
void silu_mul_row_f32(const float *y, float *out, int64_t r, int64_t n) {
    silu_mul_row(y, out, r, n, 0);
}

int silu_mul(const void *y, void *out, int64_t t, int64_t n, int bf16, int num_threads) {
    if (t < 0 || n <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) if (t >= PARALLEL_ROWS) schedule(static)
    for (int64_t r = 0; r < t; r++) {
        if (bf16) silu_mul_row(y, out, r, n, 1);
        else silu_mul_row(y, out, r, n, 0);
    }
    return 0;
}

/* The per-row bodies of the fused per-layer operations (see fused_ops.c for what they compute
 * and how they round), shared by fused_ops.c and decode_layer.c so that both round
 * alike. BF16 is a compile-time 0/1 in every caller. */
#ifndef LLMTOWER_FUSED_ROWS_H
#define LLMTOWER_FUSED_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"

/* Store v as the dtype holds it; returns the stored value widened back (what a later op reads). */
static inline __attribute__((always_inline)) float st(void *p, int64_t i, float v, const int BF16) {
    if (BF16) {
        uint16_t b = f32_to_bf16(v);
        ((uint16_t *)p)[i] = b;
        return bf16_to_f32(b);
    }
    ((float *)p)[i] = v;
    return v;
}

static inline __attribute__((always_inline)) void add_rms_norm_row(
        void *residual, const void *x, const void *weight, void *out, int64_t r, int64_t h,
        float eps, const int BF16) {
    const int64_t base = r * h;
    float ss = 0.0f;
    if (x) {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < h; i++) {
            float v = st(residual, base + i, ld(residual, base + i, BF16) + ld(x, base + i, BF16), BF16);
            ss += v * v;
        }
    } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < h; i++) {
            float v = ld(residual, base + i, BF16);
            ss += v * v;
        }
    }
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; i++) {
        float n = ld(residual, base + i, BF16) * inv;
        if (BF16) n = bf16_to_f32(f32_to_bf16(n)); /* hidden.to(bfloat16), then weight * it */
        st(out, base + i, ld(weight, i, BF16) * n, BF16);
    }
}

/* One head of D values at src (element offset so), rotated by the full-width tables
 * cos = cat(c, c), sin = cat(-s, s) of its position: out = x * cos + cat(x2, x1) * sin. */
static inline __attribute__((always_inline)) void rope_head(
        const void *src, int64_t so, const void *cos, const void *sin, int64_t to, void *dst,
        int64_t dof, int64_t d, const int BF16) {
    const int64_t half = d / 2;
#pragma omp simd
    for (int64_t i = 0; i < d; i++) {
        float x = ld(src, so + i, BF16);
        float sw = ld(src, so + (i < half ? i + half : i - half), BF16);
        float a = x * ld(cos, to + i, BF16);
        if (BF16) a = bf16_to_f32(f32_to_bf16(a)); /* x * cos is its own op in torch */
        st(dst, dof + i, a + sw * ld(sin, to + i, BF16), BF16);
    }
}

static inline __attribute__((always_inline)) void rope_kv_row(
        const void *qkv, int64_t qkv_stride, int64_t r, int64_t nh, int64_t nkv, int64_t d,
        const void *cos, const void *sin, const int64_t *positions, const int64_t *slots,
        void *k_cache, void *v_cache, void *q_out, void *k_out, const int BF16) {
    const int64_t row = r * qkv_stride, to = positions[r] * d, slot = slots[r] * nkv * d;
    for (int64_t hh = 0; hh < nh; hh++)
        rope_head(qkv, row + hh * d, cos, sin, to, q_out, (r * nh + hh) * d, d, BF16);
    for (int64_t hh = 0; hh < nkv; hh++) {
        const int64_t src = row + (nh + hh) * d;
        rope_head(qkv, src, cos, sin, to, k_cache, slot + hh * d, d, BF16);
        if (k_out) {
            const size_t e = BF16 ? 2 : 4;
            memcpy((char *)k_out + ((r * nkv + hh) * d) * e, (char *)k_cache + (slot + hh * d) * e, d * e);
        }
    }
    const size_t e = BF16 ? 2 : 4;
    memcpy((char *)v_cache + slot * e, (const char *)qkv + (row + (nh + nkv) * d) * e, nkv * d * e);
}

#endif

/* The C kernels' vector layer: the few float32 operations their inner loops need, one spelling
 * per instruction set, so that each kernel has ONE source whose inner loops compile to AVX-512,
 * AVX2 (+FMA, F16C), NEON or plain C (the ISA is picked by the compiler's target:
 * LLMTOWER_CPU_ISA in kernels/build.py).
 *
 *   vf                      a vector of VEC_LANES float32 lanes
 *   vf_zero / vf_set1       all lanes 0 / x
 *   vf_load / vf_store      VEC_LANES floats from / to memory (unaligned)
 *   vf_load_bf16            VEC_LANES bfloat16 values widened to float32 (exact)
 *   vf_fma(a, b, c)         a * b + c in each lane, rounded once (as C's fmaf)
 *   vf_add / vf_mul / vf_max
 *   vf_reduce_add           the lanes' sum (in a fixed order per ISA; not across ISAs)
 *   vf_reduce_max           the lanes' maximum
 *   vf_exp                  expf in each lane, libm's to the bit (AVX-512: vec_exp.h's exp16
 *                           where it is glibc's; elsewhere libm's expf lane by lane)
 *   vec_prefetch_l2(p)      a hint to bring p's cache line towards L2
 *
 * VEC_FAST is 1 where the vector code beats the portable C loops (AVX-512, AVX2 with FMA,
 * NEON): kernels report it through their *_fast() functions and Python uses them only there.
 * The plain-C layer has VEC_LANES 4 and fmaf, so it computes what the vector ones compute
 * (lane-wise results identical everywhere; only vf_reduce_add's order depends on VEC_LANES).
 * tests/kernels/vec_neon_check.c compares the NEON layer with the plain one under qemu. */
#ifndef LLMTOWER_VEC_H
#define LLMTOWER_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "vec_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VEC_ISA "avx512"
#define VEC_LANES 16
#define VEC_FAST 1
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vf_reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_reduce_max(vf v) { return _mm512_reduce_max_ps(v); }

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC_ISA "avx2"
#define VEC_LANES 8
#define VEC_FAST 1
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vf_reduce_add(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_reduce_max(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define VEC_ISA "neon"
#define VEC_LANES 4
#define VEC_FAST 1
typedef float32x4_t vf;
static inline vf vf_zero(void) { return vdupq_n_f32(0.0f); }
static inline vf vf_set1(float x) { return vdupq_n_f32(x); }
static inline vf vf_load(const float *p) { return vld1q_f32(p); }
static inline void vf_store(float *p, vf v) { vst1q_f32(p, v); }
static inline vf vf_load_bf16(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_max(vf a, vf b) { return vmaxq_f32(a, b); }
static inline float vf_reduce_add(vf v) {  /* (l0 + l2) + (l1 + l3), as the plain layer sums */
    const float32x2_t h = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
}
static inline float vf_reduce_max(vf v) { return vmaxvq_f32(v); }

#else
#define VEC_ISA "c"
#define VEC_LANES 4
#define VEC_FAST 0
typedef struct { float v[4]; } vf;
static inline vf vf_zero(void) { vf r = {{0.0f, 0.0f, 0.0f, 0.0f}}; return r; }
static inline vf vf_set1(float x) { vf r = {{x, x, x, x}}; return r; }
static inline vf vf_load(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
static inline void vf_store(float *p, vf v) { memcpy(p, v.v, sizeof v.v); }
static inline vf vf_load_bf16(const uint16_t *p) {
    vf r;
    for (int i = 0; i < 4; i++) {
        const uint32_t u = (uint32_t)p[i] << 16;
        memcpy(&r.v[i], &u, sizeof u);
    }
    return r;
}
static inline vf vf_fma(vf a, vf b, vf c) {
    for (int i = 0; i < 4; i++) c.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
static inline vf vf_add(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] += b.v[i]; return a; }
static inline vf vf_mul(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] *= b.v[i]; return a; }
static inline vf vf_max(vf a, vf b) {  /* b where a is not greater (NaN: b), as maxps */
    for (int i = 0; i < 4; i++) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return a;
}
static inline float vf_reduce_add(vf v) { return (v.v[0] + v.v[2]) + (v.v[1] + v.v[3]); }
static inline float vf_reduce_max(vf v) {
    const float a = v.v[0] > v.v[2] ? v.v[0] : v.v[2], b = v.v[1] > v.v[3] ? v.v[1] : v.v[3];
    return a > b ? a : b;
}
#endif

/* expf of every lane, libm's to the bit (see the top) */
static inline vf vf_exp(vf x) {
#if defined(__AVX512F__)
    extern int kernel_vector_exp;
    if (kernel_vector_exp) {
        __mmask16 special;
        vf e = exp16(x, &special);
        if (!special) return e;
    }
#endif
    float t[VEC_LANES];
    vf_store(t, x);
    for (int i = 0; i < VEC_LANES; i++) t[i] = expf(t[i]);
    return vf_load(t);
}

static inline void vec_prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }

#endif

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
 *   vf_sum_tile(v)          lane l = the sum of v[l]'s lanes, for VEC_LANES vectors v[0..]
 *                           (VEC_LANES dot products' partials folded at once: a transpose-add
 *                           tree on AVX2 / NEON, ~1 instruction per sum instead of ~5)
 *   vf_sub / vf_div
 *   vf_load_n(p, n, fill)   lanes < n from p (no lane past them is read), the rest fill
 *   vf_keep_n(v, n)         lanes < n of v, the rest 0
 *   vf_exp                  expf in each lane, libm's to the bit (AVX-512 / AVX2: vec_exp.h's
 *                           exp16 / exp8_avx2 where it is glibc's; elsewhere libm's expf lane by
 *                           lane)
 *   vf_exp_nonpos           exp of lanes <= 0 (a softmax's): below -87.3 clamped there (a weight
 *                           < 1e-37), so no lane takes libm's special path
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
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline float vf_reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
static inline __mmask16 vf_mask_n(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}
static inline vf vf_load_n(const float *p, int64_t n, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), vf_mask_n(n), p);
}
static inline vf vf_keep_n(vf v, int64_t n) { return _mm512_maskz_mov_ps(vf_mask_n(n), v); }

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
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline __m256i vf_mask_n(int64_t n) {
    const int m = n >= 8 ? 8 : n <= 0 ? 0 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf vf_load_n(const float *p, int64_t n, float fill) {
    const __m256i m = vf_mask_n(n);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
static inline vf vf_keep_n(vf v, int64_t n) { return _mm256_and_ps(v, _mm256_castsi256_ps(vf_mask_n(n))); }
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
#define VF_SUM_TILE 1
static inline vf vf_sum_tile(const vf *v) {
    /* hadd pairs within each 128-bit half, twice; then each half's partial sums of lanes 0-3
     * and 4-7 of every input are added across the halves */
    const vf a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const vf b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
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
static inline vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vf_div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vf_load_n(const float *p, int64_t n, float fill) {
    float t[4] = {fill, fill, fill, fill};
    memcpy(t, p, sizeof(float) * (size_t)(n >= 4 ? 4 : n <= 0 ? 0 : n));
    return vld1q_f32(t);
}
static inline vf vf_keep_n(vf v, int64_t n) {
    const uint32_t idx[4] = {0, 1, 2, 3};
    const uint32x4_t live = vcltq_u32(vld1q_u32(idx), vdupq_n_u32((uint32_t)(n >= 4 ? 4 : n <= 0 ? 0 : n)));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(v), live));
}
static inline float vf_reduce_add(vf v) {  /* (l0 + l2) + (l1 + l3), as the plain layer sums */
    const float32x2_t h = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
}
static inline float vf_reduce_max(vf v) { return vmaxvq_f32(v); }
#define VF_SUM_TILE 1
static inline vf vf_sum_tile(const vf *v) { /* pairwise adds: ((l0 + l1) + (l2 + l3)) */
    return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
}

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
static inline vf vf_sub(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] -= b.v[i]; return a; }
static inline vf vf_div(vf a, vf b) { for (int i = 0; i < 4; i++) a.v[i] /= b.v[i]; return a; }
static inline vf vf_load_n(const float *p, int64_t n, float fill) {
    vf r = {{fill, fill, fill, fill}};
    memcpy(r.v, p, sizeof(float) * (size_t)(n >= 4 ? 4 : n <= 0 ? 0 : n));
    return r;
}
static inline vf vf_keep_n(vf v, int64_t n) {
    for (int i = 0; i < 4; i++) v.v[i] = i < n ? v.v[i] : 0.0f;
    return v;
}
static inline float vf_reduce_add(vf v) { return (v.v[0] + v.v[2]) + (v.v[1] + v.v[3]); }
static inline float vf_reduce_max(vf v) {
    const float a = v.v[0] > v.v[2] ? v.v[0] : v.v[2], b = v.v[1] > v.v[3] ? v.v[1] : v.v[3];
    return a > b ? a : b;
}
#endif

#ifndef VF_SUM_TILE
static inline vf vf_sum_tile(const vf *v) { /* AVX-512, plain C: a reduction per vector */
    float t[VEC_LANES];
    for (int l = 0; l < VEC_LANES; l++) t[l] = vf_reduce_add(v[l]);
    return vf_load(t);
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
#elif defined(__AVX2__) && defined(__FMA__)
    extern int kernel_vector_exp;
    if (kernel_vector_exp) {
        int special;
        vf e = exp8_avx2(x, &special);
        if (!special) return e;
    }
#endif
    float t[VEC_LANES];
    vf_store(t, x);
    for (int i = 0; i < VEC_LANES; i++) t[i] = expf(t[i]);
    return vf_load(t);
}

/* exp of lanes <= 0, clamped at -87.3 (see the top) */
static inline vf vf_exp_nonpos(vf x) {
#if defined(__AVX512F__)
    return exp16_nonpos(x);
#else
    return vf_exp(vf_max(x, vf_set1(-87.3f)));
#endif
}

static inline void vec_prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }

/* Integer pair products (greedy_head.c's int8 screen): VEC_LANES int32 lanes, each the exact
 * sum of its two int16 products.
 *
 *   vi, vw                  VEC_LANES int32 lanes; 2 * VEC_LANES int16 lanes (lane pairs)
 *   vi_zero / vi_store      all lanes 0 / VEC_LANES int32 to memory (unaligned)
 *   vw_load_i8(p)           2 * VEC_LANES int8 widened to int16 (sign kept)
 *   vw_set1_pair(u)         every pair = the two int16 halves of u (low half first)
 *   vi_dot_pairs(a, w, x)   a + w[2l] x[2l] + w[2l + 1] x[2l + 1] in lane l (int32, exact
 *                           while the sums fit: the caller bounds them)
 *
 * VI_FAST is 1 where these are vector instructions (AVX-512 BW, with VNNI's vpdpwssd where
 * built for it; AVX2, with AVX-VNNI's where built for it; NEON); elsewhere plain C. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VI_FAST 1
typedef __m512i vi;
typedef __m512i vw;
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline void vi_store(int32_t *p, vi v) { _mm512_storeu_si512(p, v); }
static inline vw vw_load_i8(const int8_t *p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
static inline vw vw_set1_pair(uint32_t u) { return _mm512_set1_epi32((int)u); }
static inline vi vi_dot_pairs(vi a, vw w, vw x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(a, w, x);
#else
    return _mm512_add_epi32(a, _mm512_madd_epi16(w, x));
#endif
}
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define VI_FAST 1
typedef __m256i vi;
typedef __m256i vw;
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline void vi_store(int32_t *p, vi v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline vw vw_load_i8(const int8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}
static inline vw vw_set1_pair(uint32_t u) { return _mm256_set1_epi32((int)u); }
static inline vi vi_dot_pairs(vi a, vw w, vw x) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(a, w, x);
#else
    return _mm256_add_epi32(a, _mm256_madd_epi16(w, x));
#endif
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define VI_FAST 1
typedef int32x4_t vi;
typedef int16x8_t vw;
static inline vi vi_zero(void) { return vdupq_n_s32(0); }
static inline void vi_store(int32_t *p, vi v) { vst1q_s32(p, v); }
static inline vw vw_load_i8(const int8_t *p) { return vmovl_s8(vld1_s8(p)); }
static inline vw vw_set1_pair(uint32_t u) { return vreinterpretq_s16_u32(vdupq_n_u32(u)); }
static inline vi vi_dot_pairs(vi a, vw w, vw x) {  /* products 0..7, then pairwise sums */
    const int32x4_t lo = vmull_s16(vget_low_s16(w), vget_low_s16(x));
    return vaddq_s32(a, vpaddq_s32(lo, vmull_high_s16(w, x)));
}
#else
#define VI_FAST 0
typedef struct { int32_t v[VEC_LANES]; } vi;
typedef struct { int16_t v[2 * VEC_LANES]; } vw;
static inline vi vi_zero(void) { vi r; memset(&r, 0, sizeof r); return r; }
static inline void vi_store(int32_t *p, vi v) { memcpy(p, v.v, sizeof v.v); }
static inline vw vw_load_i8(const int8_t *p) {
    vw r;
    for (int i = 0; i < 2 * VEC_LANES; i++) r.v[i] = p[i];
    return r;
}
static inline vw vw_set1_pair(uint32_t u) {
    vw r;
    for (int i = 0; i < VEC_LANES; i++) {
        r.v[2 * i] = (int16_t)(u & 0xffffu);
        r.v[2 * i + 1] = (int16_t)(u >> 16);
    }
    return r;
}
static inline vi vi_dot_pairs(vi a, vw w, vw x) {
    for (int i = 0; i < VEC_LANES; i++)
        a.v[i] += (int32_t)w.v[2 * i] * x.v[2 * i] + (int32_t)w.v[2 * i + 1] * x.v[2 * i + 1];
    return a;
}
#endif

#endif

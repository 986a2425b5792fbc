/* bfloat16 <-> float32 for the C kernels, the one copy every kernel uses: a bfloat16 is the top
 * half of a float32, and a float32 rounds to it to nearest even (NaN stays NaN), as PyTorch
 * rounds. Scalar always; with AVX-512, 16 lanes at once (integer ops: vcvtneps2bf16 would flush
 * denormals, so the vector rounding is the scalar one lane by lane). */
#ifndef LLMTOWER_BF16_H
#define LLMTOWER_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of a float or bfloat16 array, as float32; BF16 is a constant in every caller, so the
 * branch folds away. */
static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int BF16) {
    return BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 values (packed in a __m256i) widened to float32 */
static inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* f32_to_bf16 in 16 lanes, each result in the low 16 bits of its 32-bit lane */
static inline __m512i f32x16_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rnd = _mm512_srli_epi32(_mm512_add_epi32(
            _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(rnd, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16),
                                                           _mm512_set1_epi32(0x40)));
}
#endif

#endif

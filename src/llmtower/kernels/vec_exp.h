/* The one vectorised exp of the C kernels: expf for 16 float32 lanes, bit for bit glibc's (2.27+)
 * expf as its FMA variant computes it (the one glibc picks on any CPU with AVX-512). Scalar code
 * calls libm's expf itself, so a vector lane and a scalar element agree wherever this libm is
 * glibc's (lib_init.c checks that once at load: kernel_vector_exp).
 *
 * Method: in double, k = round(x * 32 / ln2) by the shift trick, 2^(k/32) from a 32-entry table,
 * a degree-3 polynomial, one rounding to float. Lanes glibc sends to its special path (|x| >= ~88:
 * overflow, underflow, inf, NaN) are flagged in *special (their values here are meaningless);
 * callers compute those with expf, or clamp first (exp16_nonpos). The method and its constants
 * (the table's 2^(i/32) with i/32 taken out of the exponent, the polynomial's coefficients) are
 * those of Arm's optimized-routines expf (MIT OR Apache-2.0), which glibc adopted; matching them
 * is what makes the result glibc's to the bit.
 *
 * Why this variant of the six the kernels once had (Cephes' degree-7 polynomial in three
 * spellings, a Taylor series, this one): it is the most accurate (glibc's expf, < 0.51 ulp), and
 * it makes the attention softmax and the silu epilogues compute what the portable paths and
 * PyTorch's scalar expf compute. */
#ifndef LLMTOWER_VEC_EXP_H
#define LLMTOWER_VEC_EXP_H

#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

static const uint64_t vec_exp_tab[32] __attribute__((aligned(64))) = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* The same method for AVX2: 4 lanes of double per step, the table read by a gather; the same
 * double operations in the same order, so the same bits. */
static inline __m128 vec_exp4_avx2(__m128 xf) {
    const __m256d xd = _mm256_cvtps_pd(xf);
    const __m256d inv = _mm256_castsi256_pd(_mm256_set1_epi64x(0x40471547652b82fell));
    const __m256d shift = _mm256_castsi256_pd(_mm256_set1_epi64x(0x4338000000000000ll));
    const __m256d kd = _mm256_fmadd_pd(inv, xd, shift);
    const __m256i ki = _mm256_castpd_si256(kd);
    const __m256d r = _mm256_fmsub_pd(inv, xd, _mm256_sub_pd(kd, shift));
    const __m256i idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    const __m256i t = _mm256_add_epi64(
        _mm256_i64gather_epi64((const long long *)vec_exp_tab, idx, 8), _mm256_slli_epi64(ki, 47));
    const __m256d sc = _mm256_castsi256_pd(t);
    const __m256d z = _mm256_fmadd_pd(r, _mm256_castsi256_pd(_mm256_set1_epi64x(0x3ebc6af84b912394ll)),
                                      _mm256_castsi256_pd(_mm256_set1_epi64x(0x3f2ebfce50fac4f3ll)));
    const __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(r, _mm256_castsi256_pd(_mm256_set1_epi64x(0x3f962e42ff0c52d6ll)),
                                _mm256_set1_pd(1.0));
    y = _mm256_fmadd_pd(z, r2, y);
    return _mm256_cvtpd_ps(_mm256_mul_pd(y, sc));
}

/* expf of 8 lanes; *special: a bit per lane to recompute with expf (as exp16's) */
static inline __m256 exp8_avx2(__m256 x, int *special) {
    const __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20),
                                         _mm256_set1_epi32(0x7ff));
    *special = _mm256_movemask_ps(_mm256_castsi256_ps(
        _mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a))));
    const __m128 a = vec_exp4_avx2(_mm256_castps256_ps128(x));
    const __m128 b = vec_exp4_avx2(_mm256_extractf128_ps(x, 1));
    return _mm256_insertf128_ps(_mm256_castps128_ps256(a), b, 1);
}
#endif

#if defined(__AVX512F__)

static inline __m512d vec_exp_d(uint64_t bits) {
    return _mm512_castsi512_pd(_mm512_set1_epi64((long long)bits));
}

static inline __m256 vec_exp8(__m256 xf) {
    const __m512d xd = _mm512_cvtps_pd(xf);
    const __m512d inv = vec_exp_d(0x40471547652b82feull), shift = vec_exp_d(0x4338000000000000ull);
    const __m512d kd = _mm512_fmadd_pd(inv, xd, shift);
    const __m512i ki = _mm512_castpd_si512(kd);
    const __m512d r = _mm512_fmsub_pd(inv, xd, _mm512_sub_pd(kd, shift));
    const __m512i idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
    const __m512i lo = _mm512_permutex2var_epi64(_mm512_loadu_si512(vec_exp_tab), idx,
                                                 _mm512_loadu_si512(vec_exp_tab + 8));
    const __m512i hi = _mm512_permutex2var_epi64(_mm512_loadu_si512(vec_exp_tab + 16), idx,
                                                 _mm512_loadu_si512(vec_exp_tab + 24));
    const __mmask8 upper = _mm512_test_epi64_mask(idx, _mm512_set1_epi64(16));
    const __m512i t = _mm512_add_epi64(_mm512_mask_mov_epi64(lo, upper, hi),
                                       _mm512_slli_epi64(ki, 47));
    const __m512d sc = _mm512_castsi512_pd(t);
    const __m512d z = _mm512_fmadd_pd(r, vec_exp_d(0x3ebc6af84b912394ull),
                                      vec_exp_d(0x3f2ebfce50fac4f3ull));
    const __m512d r2 = _mm512_mul_pd(r, r);
    __m512d y = _mm512_fmadd_pd(r, vec_exp_d(0x3f962e42ff0c52d6ull), _mm512_set1_pd(1.0));
    y = _mm512_fmadd_pd(z, r2, y);
    return _mm512_cvtpd_ps(_mm512_mul_pd(y, sc));
}

/* expf of 16 lanes; *special: the lanes to recompute with expf (see the top) */
static inline __m512 exp16(__m512 x, __mmask16 *special) {
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 20),
                                         _mm512_set1_epi32(0x7ff));
    *special = _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(0x42a));
    const __m256 a = vec_exp8(_mm512_castps512_ps256(x));
    const __m256 b = vec_exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)),
                                               _mm256_castps_pd(b), 1));
}

/* exp(x) for x <= 0 (a score minus its row's maximum: the softmax). Below -87.3 the result would
 * be subnormal (glibc's special path): clamped there, a weight < 1e-37 of the maximum's, so no
 * lane is ever special. */
static inline __m512 exp16_nonpos(__m512 x) {
    __mmask16 special;
    return exp16(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), &special);
}

/* silu(g) = g / (1 + exp(-g)) for 16 lanes, with libm's expf for the special lanes (|g| >= ~88),
 * so every lane is what the scalar g / (1.0f + expf(-g)) gives where exp16 is this libm's expf */
static inline __m512 silu16(__m512 g) {
    __mmask16 special;
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g), &special);
    if (special) {
        float gs[16], es[16];
        _mm512_storeu_ps(gs, g);
        _mm512_storeu_ps(es, e);
        for (int i = 0; i < 16; i++)
            if (special >> i & 1) es[i] = expf(-gs[i]);
        e = _mm512_loadu_ps(es);
    }
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

#endif

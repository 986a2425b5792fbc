/* GGUF's block formats as the block kernels read them (quant_gemm.c, quant_gemm_k.c): the ggml
 * type ids, the float16 scales, the K formats' packed 6-bit scales and a portable decoder of one
 * 32-value sub-block (w = s * (u - o) - m).
 *
 * QG_FAST: whether the block products' vector code is built: 256-bit integer dot products,
 * from AVX2 + FMA + F16C (x86-64-v3) on. QG_512: whether the AVX512_VNNI code beside it is
 * (the 16-weight-row groups, the bfloat16 rows, the 512-bit K-format bodies, the activations'
 * quantization in 16 lanes). QG_DPBUSD: whether vpdpbusd exists (AVX512_VNNI, or AVX-VNNI's
 * 256-bit form); without it a dot of four bytes is vpmaddubsw then vpmaddwd by ones, whose
 * int16 pair sums would saturate for unsigned bytes above 127 (Q8_0 then takes |w| and
 * the activations' signs flipped by w's instead of w + 128). QG_NEON: aarch64's NEON bodies of
 * the same products (signed bytes times signed bytes: sdot where ARMv8.2's dot product is built,
 * else two widening multiplies). QG_VEC: either vector code is built (the products' fast path). */
#ifndef LLMTOWER_QUANT_BLOCKS_H
#define LLMTOWER_QUANT_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__)
#define QG_512 1
#else
#define QG_512 0
#endif
#if QG_512 || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#define QG_FAST 1
#else
#define QG_FAST 0
#endif
#if QG_512 || (QG_FAST && defined(__AVXVNNI__))
#define QG_DPBUSD 1
#else
#define QG_DPBUSD 0
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define QG_NEON 1
#else
#define QG_NEON 0
#endif
#define QG_VEC (QG_FAST || QG_NEON)

#if QG_FAST
/* acc + per int32 lane the four products of u's unsigned bytes by s's signed ones. Without
 * vpdpbusd, u's bytes must be at most 127 (the int16 pair sums of vpmaddubsw saturate above:
 * 2 * 255 * 127 > 32767); the sums are the same integers either way. */
static inline __m256i qg_dpbusd(__m256i acc, __m256i u, __m256i s) {
#if QG_512
    return _mm256_dpbusd_epi32(acc, u, s);
#elif QG_DPBUSD
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* The sum of v's 8 lanes (vec.h's vf_reduce_add where vf is 8 lanes; these kernels use
 * 8-lane vectors on AVX-512 builds too). */
static inline float qg_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

int64_t quant_block_values(int fmt);
int64_t quant_block_bytes(int fmt);
/* The activations' int8 forms (quant_gemm.c per 32 values, quant_gemm_k.c per 256) and each
 * product's work for the calling thread of an enclosing team (quant_layer.c shares one parallel
 * region among a layer's products). */
void quant_act(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *qa, float *da,
               float *fa, int32_t *ns);
void quant_act_k(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *qa, float *da,
                 int16_t *bs, int nibble_order);
void quant_gemm_share(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                      int64_t m, const int8_t *qa, const float *da, const float *fa,
                      const int32_t *ns, float *y, int64_t ldy, int path);
void quant_gemm_k_share(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                        int64_t m, const int8_t *qa, const float *da, const int16_t *bs, float *y,
                        int64_t ldy, int path);
#if QG_512
/* quant_gemm_k.c: one row of K-format super-blocks as bfloat16 (gguf's values, rounded). */
void kq_dequant_row_bf16(int fmt, const uint8_t *row, int64_t nb, uint16_t *o);
/* quant_gemm_16.c: groups [g0, g1) of 16 weight rows of a Q4_0 / Q8_0 matrix times m rows of x. */
void c16_groups(int fmt, const uint8_t *w, int64_t row_bytes, int64_t g0, int64_t g1, int64_t k,
                int64_t m, const int8_t *qa, const float *da, const int32_t *ns, float *y,
                int64_t ldy);
/* quant_gemm_k16.c: groups [g0, g1) of 16 weight rows of a K-format matrix times m rows of x. */
void kc_groups(int fmt, const uint8_t *w, int64_t row_bytes, int64_t g0, int64_t g1, int64_t k,
               int64_t m, const int8_t *qa, const float *da, const int16_t *bs, float *y,
               int64_t ldy);
#endif

#if QG_FAST && !QG_512
/* The activations' int8 quantizers on 8 lanes (quant_act, quant_act_k), the same values as
 * the portable loops and the AVX-512 ones: max |x| (n a multiple of 8), and 8 values times id
 * rounded to nearest even (the default rounding mode, as lrintf), stored as int8 (|v| <= 127
 * after the scaling, so the saturating packs change nothing), returning their int32 lanes. */
static inline float qg_absmax(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline __m256i qg_round_store8(const float *x, __m256 id, int8_t *q) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(w, w));
    return v;
}

static inline int qg_hsum_epi32(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}
#endif

#if QG_NEON
/* acc + per int32 lane a sum of four products of a's and b's signed bytes (lanes differ between
 * the two forms; the sum of the lanes is the same integer: each product fits int16, |-128 *
 * -128| included). */
static inline int32x4_t qg_sdot(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    return vpadalq_s16(vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b))),
                       vmull_high_s8(a, b));
#endif
}

/* Lanes [sum a, sum b, sum c, sum d]. */
static inline int32x4_t qg_sum4(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
    return vpaddq_s32(vpaddq_s32(a, b), vpaddq_s32(c, d));
}

/* The activations' quantizers on 4 lanes: max |x| (n a multiple of 4), and 16 values times id
 * rounded to nearest even (vcvtnq, as lrintf in the default mode) stored as int8 (|v| <= 127,
 * the saturating narrows change nothing), returning their sum. */
static inline float qg_absmax(const float *x, int n) {
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int j = 0; j < n; j += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + j)));
    return vmaxvq_f32(m);
}

static inline int qg_round_store16(const float *x, float id, int8_t *q) {
    int32x4_t v[4];
    for (int i = 0; i < 4; i++) v[i] = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + 4 * i), id));
    const int16x8_t a = vcombine_s16(vqmovn_s32(v[0]), vqmovn_s32(v[1]));
    const int16x8_t b = vcombine_s16(vqmovn_s32(v[2]), vqmovn_s32(v[3]));
    vst1q_s8(q, vcombine_s8(vqmovn_s16(a), vqmovn_s16(b)));
    return vaddvq_s32(vaddq_s32(vaddq_s32(v[0], v[1]), vaddq_s32(v[2], v[3])));
}
#endif

#if QG_512
/* P[v] lane i (i = 4L + c): dword v of the 16 bytes at p0 + i * row_bytes: sixteen weight rows
 * transposed so that int32 lane i holds row i (quant_gemm.c cols16, quant_gemm_k16.c). */
static inline __attribute__((always_inline)) void
transpose16(const uint8_t *p0, int64_t row_bytes, __m512i P[4]) {
    __m512i A[4]; /* A[c] 128-bit lane L: row 4L + c */
    for (int c = 0; c < 4; c++) {
        __m512i a = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p0 + c * row_bytes)));
        a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i *)(p0 + (4 + c) * row_bytes)), 1);
        a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i *)(p0 + (8 + c) * row_bytes)), 2);
        a = _mm512_inserti32x4(a, _mm_loadu_si128((const __m128i *)(p0 + (12 + c) * row_bytes)), 3);
        A[c] = a;
    }
    const __m512i t0 = _mm512_unpacklo_epi32(A[0], A[1]), t1 = _mm512_unpackhi_epi32(A[0], A[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(A[2], A[3]), t3 = _mm512_unpackhi_epi32(A[2], A[3]);
    P[0] = _mm512_unpacklo_epi64(t0, t2);
    P[1] = _mm512_unpackhi_epi64(t0, t2);
    P[2] = _mm512_unpacklo_epi64(t1, t3);
    P[3] = _mm512_unpackhi_epi64(t1, t3);
}
#endif

/* Decoded weight rows a prefill product holds for all its rows of x (a panel: a quarter of a
 * 1 MiB L2; quant_gemm.c q4_0_panels, quant_gemm_k.c kq_panels). Where all the rows' int8
 * activations fit in L1 (m * k bytes up to PANEL_ACT_BYTES) a panel is one weight row: its
 * decoded form stays in L1 beside them (4-8% faster at 16 and 32 rows of k = 2048). */
#define PANEL_BYTES (256 * 1024)
#define PANEL_ACT_BYTES (32 * 1024)

/* Weight rows in a panel of `row_bytes` decoded bytes each, for m rows of k activations and
 * the rows [j0, j1) to do. */
static inline int64_t panel_rows(int64_t row_bytes, int64_t m, int64_t k, int64_t j0, int64_t j1) {
    int64_t rows = m * k <= PANEL_ACT_BYTES ? 1 : PANEL_BYTES / (row_bytes > 0 ? row_bytes : 1);
    return rows < 1 ? 1 : rows > j1 - j0 ? (j1 - j0 > 0 ? j1 - j0 : 1) : rows;
}

enum { F_Q4_0 = 2, F_Q4_1 = 3, F_Q8_0 = 8, F_Q4_K = 12, F_Q5_K = 13, F_Q6_K = 14 };

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if QG_FAST
    return _cvtsh_ss(h);
#elif QG_NEON
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j from the 12 packed bytes. */
static inline void k_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* ------------------------------------------------------------------ decoding, portable */

/* Sub-block `sb` (32 values) of the block at `blk`: its unsigned values u[32], the scales of
 * its two halves, its integer offset (o) and its float minimum (m): w = s * (u - o) - m. */
typedef struct {
    uint8_t u[32];
    float s[2];
    int o;
    float m;
} subblock;

static inline void decode_sub(int fmt, const uint8_t *blk, int sb, subblock *r) {
    r->o = 0;
    r->m = 0.0f;
    switch (fmt) {
    case F_Q4_0: case F_Q4_1: {
        const int has_min = fmt == F_Q4_1;
        const uint8_t *qs = blk + (has_min ? 4 : 2);
        for (int i = 0; i < 16; i++) {
            r->u[i] = qs[i] & 0xF;
            r->u[i + 16] = qs[i] >> 4;
        }
        r->s[0] = r->s[1] = half_to_float(blk);
        if (has_min) r->m = -half_to_float(blk + 2);
        else r->o = 8;
        break;
    }
    case F_Q8_0:
        for (int i = 0; i < 32; i++) r->u[i] = blk[2 + i] ^ 0x80;
        r->s[0] = r->s[1] = half_to_float(blk);
        r->o = 128;
        break;
    case F_Q4_K: case F_Q5_K: {
        const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        uint8_t sc, mn;
        k_scale_min(blk + 4, sb, &sc, &mn);
        const int five = fmt == F_Q5_K;
        const uint8_t *qs = blk + (five ? 48 : 16) + 32 * (sb / 2);
        const int shift = (sb & 1) * 4;
        for (int i = 0; i < 32; i++) {
            int v = (qs[i] >> shift) & 0xF;
            if (five) v |= ((blk[16 + i] >> sb) & 1) << 4;
            r->u[i] = (uint8_t)v;
        }
        r->s[0] = r->s[1] = d * (float)sc;
        r->m = dmin * (float)mn;
        break;
    }
    case F_Q6_K: {
        const float d = half_to_float(blk + 208);
        const int c = sb / 4, t = sb % 4;
        const uint8_t *ql = blk + 64 * c + (t & 1) * 32, *qh = blk + 128 + 32 * c;
        const int lshift = (t >> 1) * 4, hshift = 2 * t;
        for (int i = 0; i < 32; i++)
            r->u[i] = (uint8_t)(((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4));
        const int8_t *sc = (const int8_t *)(blk + 192);
        r->s[0] = d * (float)sc[2 * sb];
        r->s[1] = d * (float)sc[2 * sb + 1];
        r->o = 32;
        break;
    }
    }
}

#endif

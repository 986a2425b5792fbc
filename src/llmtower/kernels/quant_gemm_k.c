/* Products by weights in GGUF's K formats (Q4_K, Q5_K, Q6_K: super-blocks of 256 values), read
 * in place, against activations quantized to int8 per 256 values.
 *
 * The activations of a row are quantized once per call (quant_act_k): per 256 values one float
 * scale da (max|x| / 127), 256 int8 qa, and the sums of each 16 qa (int16). A super-block's
 * weights are small unsigned integers u with an integer scale per 16 or 32 values (6-bit
 * unsigned in Q4_K/Q5_K, int8 in Q6_K) under one float16 factor d, and an offset: a 6-bit
 * minimum per 32 under dmin (w = d*sc*u - dmin*mn) or 32 (Q6_K: w = d*sc*(u - 32)). So
 *
 *   sum w a = da * (d * sum_g sc_g (u . qa)_g  -  c * sum_g mn_g * bsum_g)
 *
 * where everything inside the two sums is an integer (c = dmin, or 32 d with mn = sc), and the
 * float work is two multiply-adds per super-block and row instead of one per 32 values (what
 * per-32 activations cost, quant_gemm.c). u . qa runs as vpmaddubsw (unsigned weight bytes
 * times signed activation bytes, pairs summed to int16: at most 2 * 63 * 127, no saturation),
 * and the scales enter through vpdpwssd (int16 pairs times int16 scales into int32 lanes).
 *
 * The ISA-specific pieces are the unpacking of one super-block into four 64-byte vectors of u
 * with their per-lane int16 scales (kq_unpack_*) and the per-row dot (kq_dot): AVX-512 VNNI
 * bodies, and AVX2 ones on eight 32-byte vectors (vpmaddubsw, then vpmaddwd by the scales and
 * an add where vpdpwssd would take both), and NEON ones on sixteen 16-byte vectors (sdot, the
 * four 16-sums of a vector of scales added at once). Elsewhere the portable code computes the
 * same integer sums in scalar C (through decode_sub, quant_blocks.h).
 *
 * The error against the float product of the dequantized weights is that of rounding each
 * activation to its 256-block's int8 grid (at most max|x| / 254 per value); tests bound it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "quant_blocks.h"
#include "threads.h"

#define QK_MR 8 /* most rows of x per pass over a weight row */
/* Fewest rows of x for the 16-weight-row code (quant_gemm_k16.c): below, unpacking a chunk for
 * all 16 rows costs more than the one-row code's repeated unpacking saves (CPU ms, 1 thread,
 * Q4_K [16384x2048] at 4 / 6 rows: 1.62 vs 1.28 / 2.01 vs 2.13; Q6_K [2048x8192] 1.15 vs 0.78
 * / 1.39 vs 1.61). */
#define KC_MIN_ROWS 5

static inline int is_k_format(int fmt) { return fmt == F_Q4_K || fmt == F_Q5_K || fmt == F_Q6_K; }

/* Where sub-block sb (32 values) of a super-block sits in Q4_K / Q5_K's nibble order: 64 bytes
 * of their packed values hold sub-blocks 4h and 4h + 2 in the low nibbles, 4h + 1 and 4h + 3 in
 * the high ones, so one 64-byte load and a mask (or a shift) give 64 values in that order. */
static inline int kq_pos(int sb) { return (sb & 4) | ((sb & 1) << 1) | ((sb >> 1) & 1); }

/* ------------------------------------------------------------------ activations */

/* x [m, k] (row stride ldx, k a multiple of 256) -> per row: int8 qa[k], da[k / 256], the sums
 * of each 16 qa in bs[k / 16]. Rounds to nearest even (the default rounding mode), as lrintf.
 * nibble_order: each 256 values' 32-value sub-blocks stored in Q4_K / Q5_K's nibble order
 * (kq_pos: 0 2 1 3 4 6 5 7), bs likewise; else in their own order (Q6_K). */
void quant_act_k(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *qa, float *da,
                 int16_t *bs, int nibble_order) {
    const int64_t nb = k / 256;
#pragma omp parallel for if (m >= 64) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xr + 256 * b;
            int8_t *q = qa + r * k + 256 * b;
            int16_t *s = bs + r * (k / 16) + 16 * b;
            float amax = 0.0f;
#if QG_512
            __m512 vmax = _mm512_setzero_ps();
            for (int j = 0; j < 256; j += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xb + j)));
            amax = _mm512_reduce_max_ps(vmax);
#elif QG_FAST || QG_NEON
            amax = qg_absmax(xb, 256);
#else
            for (int j = 0; j < 256; j++) amax = fmaxf(amax, fabsf(xb[j]));
#endif
            da[r * nb + b] = amax / 127.0f;
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
#if QG_512
            const __m512 vid = _mm512_set1_ps(id);
            for (int g = 0; g < 16; g++) {
                const int to = nibble_order ? 2 * kq_pos(g / 2) + (g & 1) : g;
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * g), vid));
                _mm_storeu_si128((__m128i *)(q + 16 * to), _mm512_cvtsepi32_epi8(v));
                s[to] = (int16_t)_mm512_reduce_add_epi32(v);
            }
#elif QG_FAST
            const __m256 vid = _mm256_set1_ps(id);
            for (int g = 0; g < 16; g++) {
                const int to = nibble_order ? 2 * kq_pos(g / 2) + (g & 1) : g;
                const __m256i a = qg_round_store8(xb + 16 * g, vid, q + 16 * to);
                const __m256i b = qg_round_store8(xb + 16 * g + 8, vid, q + 16 * to + 8);
                s[to] = (int16_t)qg_hsum_epi32(_mm256_add_epi32(a, b));
            }
#elif QG_NEON
            for (int g = 0; g < 16; g++) {
                const int to = nibble_order ? 2 * kq_pos(g / 2) + (g & 1) : g;
                s[to] = (int16_t)qg_round_store16(xb + 16 * g, id, q + 16 * to);
            }
#else
            for (int g = 0; g < 16; g++) {
                const int to = nibble_order ? 2 * kq_pos(g / 2) + (g & 1) : g;
                int sum = 0;
                for (int j = 0; j < 16; j++) {
                    const int v = (int)lrintf(xb[16 * g + j] * id);
                    q[16 * to + j] = (int8_t)v;
                    sum += v;
                }
                s[to] = (int16_t)sum;
            }
#endif
        }
    }
}

/* ------------------------------------------------------------------ products, portable */

static void krows_portable(int fmt, const uint8_t *wrow, int64_t nb, int64_t k, int mr,
                           const int8_t *qa, const float *da, const int16_t *bs, float *out) {
    const int64_t bb = quant_block_bytes(fmt);
    float acc[QK_MR] = {0};
    subblock s;
    for (int64_t b = 0; b < nb; b++)
        for (int sb = 0; sb < 8; sb++) {
            decode_sub(fmt, wrow + b * bb, sb, &s);
            const int at = fmt == F_Q6_K ? sb : kq_pos(sb); /* the activations' order */
            for (int r = 0; r < mr; r++) {
                const int8_t *q = qa + r * k + 256 * b + 32 * at;
                const int16_t *g = bs + r * (k / 16) + 16 * b + 2 * at;
                int d0 = 0, d1 = 0;
                for (int j = 0; j < 16; j++) d0 += (int)s.u[j] * q[j];
                for (int j = 16; j < 32; j++) d1 += (int)s.u[j] * q[j];
                d0 -= s.o * g[0];
                d1 -= s.o * g[1];
                acc[r] += da[r * (k / 256) + b] *
                          (s.s[0] * (float)d0 + s.s[1] * (float)d1 - s.m * (float)(g[0] + g[1]));
            }
        }
    for (int r = 0; r < mr; r++) out[r] = acc[r];
}

#if QG_VEC
/* Q4_K / Q5_K's eight 6-bit scales and minimums from the 12 packed bytes: the bytes of
 * (sc0..3, sc4..7) and (mn0..3, mn4..7) as two pairs of 32-bit words (k_scale_min for all
 * eight at once). */
static inline void k_scales_mins(const uint8_t *q, uint32_t sc[2], uint32_t mn[2]) {
    uint32_t a, b, c;
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    sc[0] = a & 0x3f3f3f3fu;
    mn[0] = b & 0x3f3f3f3fu;
    sc[1] = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    mn[1] = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
}
#endif

#if QG_FAST

/* Q4_K / Q5_K's minimums, each for both of its 16s, sub-blocks in the nibble order: the
 * factors of the activations' 16-sums (kq_block's mn). */
static inline __m256i k_mins16(const uint32_t mn[2]) {
    const __m128i mn8 = _mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]);
    const __m128i twice = _mm_setr_epi8(0, 0, 2, 2, 1, 1, 3, 3, 4, 4, 6, 6, 5, 5, 7, 7);
    return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(mn8, twice));
}
#endif

/* ------------------------------------------------------------------ products, AVX-512 VNNI */
#if QG_512
/* One super-block unpacked: u[g] the 64 unsigned values g*64 .. g*64+63 of the activations'
 * order (Q6_K: the values' own; Q4_K / Q5_K: the nibble order, kq_pos), sc[g] the int16 scale
 * of each pair of them (vpmaddubsw's lanes), mn the 16 int16 factors of the activations'
 * 16-sums (the minimum of each 32 twice, or Q6_K's scale of each 16), d and c: sum w a = da *
 * (d * sum sc*(u.qa) - c * sum mn * bsum). */
typedef struct {
    __m512i u[4], sc[4];
    __m256i mn;
    float d, c;
} kq_block;

/* The scale of each int16 lane of vector g (vpermw indices): Q4_K/Q5_K one per 32 values (16
 * lanes), Q6_K one per 16 (8 lanes). */
#define R16(v) v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v
#define R8(v) v, v, v, v, v, v, v, v
static const int16_t KQ_LANE_SCALE[2][4][32] = {
    {{R16(0), R16(2)}, {R16(1), R16(3)}, {R16(4), R16(6)}, {R16(5), R16(7)}}, /* nibble order */
    {{R8(0), R8(1), R8(2), R8(3)}, {R8(4), R8(5), R8(6), R8(7)},
     {R8(8), R8(9), R8(10), R8(11)}, {R8(12), R8(13), R8(14), R8(15)}},
};
#undef R16
#undef R8
/* The two sub-blocks of Q4_K / Q5_K's vector g (nibble order). */
static const int KQ_SUB[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};

static inline __attribute__((always_inline)) void
kq_unpack_q45k(const uint8_t *blk, const int FIVE, const __m512i idx[4], kq_block *o) {
    uint32_t sc[2], mn[2];
    k_scales_mins(blk + 4, sc, mn);
    o->d = half_to_float(blk);
    o->c = half_to_float(blk + 2);
    const __m128i sc8 = _mm_set_epi32(0, 0, (int)sc[1], (int)sc[0]);
    const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sc8));
    o->mn = k_mins16(mn);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m256i qh = FIVE ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
    const uint8_t *qs = blk + (FIVE ? 48 : 16);
    for (int h = 0; h < 2; h++) {
        /* bytes 64h..: low nibbles are sub-blocks 4h and 4h + 2, high ones 4h + 1 and 4h + 3 */
        const __m512i q = _mm512_loadu_si512(qs + 64 * h);
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        if (FIVE) { /* bit sb of each qh byte is bit 4 of sub-block sb's value */
            const __m512i one = _mm512_set1_epi8(1);
            const __m512i bl = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 4 * h)),
                                                  _mm256_srli_epi16(qh, 4 * h + 2), 1);
            const __m512i bh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 4 * h + 1)),
                                                  _mm256_srli_epi16(qh, 4 * h + 3), 1);
            lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(bl, one), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(bh, one), 4));
        }
        o->u[2 * h] = lo;
        o->u[2 * h + 1] = hi;
    }
    for (int g = 0; g < 4; g++) o->sc[g] = _mm512_permutexvar_epi16(idx[g], sc16);
}

static inline __attribute__((always_inline)) void
kq_unpack_q6k(const uint8_t *blk, const __m512i idx[4], kq_block *o) {
    const float d = half_to_float(blk + 208);
    o->d = d;
    o->c = 32.0f * d;
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    o->mn = s16;
    const __m512i sc16 = _mm512_castsi256_si512(s16);
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03);
    for (int c = 0; c < 2; c++) {
        /* 128 values: ql's 64 bytes (low nibbles: values 0..63, high: 64..127), qh's 32 bytes
         * (bits 0-1: values 0..31, 2-3: 32..63, 4-5: 64..95, 6-7: 96..127) */
        const __m512i ql = _mm512_loadu_si512(blk + 64 * c);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
        const __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
        o->u[2 * c] = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                      _mm512_slli_epi16(_mm512_and_si512(h, m3), 4));
        o->u[2 * c + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 4), m3), 4));
    }
    for (int g = 0; g < 4; g++) o->sc[g] = _mm512_permutexvar_epi16(idx[g], sc16);
}

/* One row's integer sums for one unpacked super-block: sum sc * (u . qa) in 16 int32 lanes. */
static inline __attribute__((always_inline)) __m512i kq_dot(const kq_block *w, const int8_t *q) {
    __m512i acc = _mm512_setzero_si512();
    for (int g = 0; g < 4; g++)
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(w->u[g], _mm512_loadu_si512(q + 64 * g)),
                                  w->sc[g]);
    return acc;
}

/* One weight row times MR rows of x: out[r] (pre: unused here, the AVX2 body's). */
static inline __attribute__((always_inline)) void
krows_fast(const int FMT, const uint8_t *wrow, int64_t nb, int64_t k, const int MR,
           const int8_t *qa, const float *da, const int16_t *bs, const kq_block *pre, float *out) {
    (void)pre;
    const int64_t nbk = k / 256, nbs = k / 16;
    __m512i idx[4];
    for (int g = 0; g < 4; g++) idx[g] = _mm512_loadu_si512(KQ_LANE_SCALE[FMT == F_Q6_K][g]);
    __m512 acc[QK_MR];
    __m256 macc[QK_MR];
    for (int r = 0; r < MR; r++) { acc[r] = _mm512_setzero_ps(); macc[r] = _mm256_setzero_ps(); }
    const int64_t bb = FMT == F_Q4_K ? 144 : FMT == F_Q5_K ? 176 : 210;
    for (int64_t b = 0; b < nb; b++) {
        kq_block w;
        if (FMT == F_Q6_K) kq_unpack_q6k(wrow + b * bb, idx, &w);
        else kq_unpack_q45k(wrow + b * bb, FMT == F_Q5_K, idx, &w);
        for (int r = 0; r < MR; r++) {
            const float a = da[r * nbk + b];
            const __m512i dot = kq_dot(&w, qa + r * k + 256 * b);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(w.d * a), acc[r]);
            const __m256i off = _mm256_madd_epi16(w.mn, _mm256_loadu_si256((const __m256i *)(bs + r * nbs + 16 * b)));
            macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(-w.c * a), macc[r]);
        }
    }
    for (int r = 0; r < MR; r++) out[r] = _mm512_reduce_add_ps(acc[r]) + qg_hsum8(macc[r]);
}

/* 16 float32 values rounded to bfloat16 and stored. */
static inline void store_bf16x16(uint16_t *o, __m512 v) {
    _mm256_storeu_si256((__m256i *)o, _mm512_cvtepi32_epi16(f32x16_to_bf16(v)));
}

/* One row of K-format super-blocks as bfloat16 (a prefill slab, quant_dequant_bf16): gguf's
 * float32 values, the same products and differences as dequant_row (no fused multiply-add),
 * rounded to nearest even; 16 values per vector instead of one. */
__attribute__((optimize("fp-contract=off")))
void kq_dequant_row_bf16(int fmt, const uint8_t *row, int64_t nb, uint16_t *o) {
    __m512i idx[4];
    for (int g = 0; g < 4; g++) idx[g] = _mm512_loadu_si512(KQ_LANE_SCALE[fmt == F_Q6_K][g]);
    const int64_t bb = quant_block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        kq_block w;
        float s[16], m[16]; /* scale and minimum of each 16 values */
        if (fmt == F_Q6_K) {
            kq_unpack_q6k(blk, idx, &w);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int i = 0; i < 16; i++) { s[i] = w.d * (float)sc[i]; m[i] = 0.0f; }
        } else {
            kq_unpack_q45k(blk, fmt == F_Q5_K, idx, &w);
            uint32_t sc4[2], mn4[2];
            k_scales_mins(blk + 4, sc4, mn4);
            const uint8_t *sc = (const uint8_t *)sc4, *mn = (const uint8_t *)mn4;
            for (int i = 0; i < 16; i++) {
                s[i] = w.d * (float)sc[i / 2];
                m[i] = w.c * (float)mn[i / 2];
            }
        }
        for (int g = 0; g < 4; g++)
            for (int h = 0; h < 4; h++) {
                /* values 16i .. 16i+15: vector g's quarter h (Q4_K / Q5_K: nibble order) */
                const int i = fmt == F_Q6_K ? 4 * g + h : 2 * KQ_SUB[g][h / 2] + (h & 1);
                __m512i u = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(w.u[g], h));
                __m512 y;
                if (fmt == F_Q6_K) {
                    u = _mm512_sub_epi32(u, _mm512_set1_epi32(32));
                    y = _mm512_mul_ps(_mm512_set1_ps(s[i]), _mm512_cvtepi32_ps(u));
                } else {
                    y = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s[i]), _mm512_cvtepi32_ps(u)),
                                      _mm512_set1_ps(m[i]));
                }
                store_bf16x16(o + 256 * b + 16 * i, y);
            }
    }
}
#elif QG_FAST
/* ------------------------------------------------------------------ products, AVX2 */
/* One super-block unpacked for 256-bit vectors: u[j] the 32 unsigned values j*32 .. j*32+31 of
 * the activations' order (the 512-bit body's u[j / 2], half j % 2), sc[j] the int16 scale of
 * each pair of them; mn, d and c as there. Its sums are the same integers, in 8 lanes. */
typedef struct {
    __m256i u[8], sc[8];
    __m256i mn;
    float d, c;
} kq_block;

static inline __attribute__((always_inline)) void
kq_unpack_q45k(const uint8_t *blk, const int FIVE, kq_block *o) {
    uint32_t sc[2], mn[2];
    k_scales_mins(blk + 4, sc, mn);
    o->d = half_to_float(blk);
    o->c = half_to_float(blk + 2);
    o->mn = k_mins16(mn);
    const uint8_t *s8 = (const uint8_t *)sc;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i qh = FIVE ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
    const uint8_t *qs = blk + (FIVE ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        /* unit j is sub-block kq_pos(j): bytes 32 * (j % 2) of the 64 at 64 * (j / 4), their
         * low nibbles for j % 4 < 2, else their high ones; Q5_K: bit kq_pos(j) of qh's bytes */
        const int sb = kq_pos(j);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 64 * (j / 4) + 32 * (j & 1)));
        __m256i u = _mm256_and_si256((j & 2) ? _mm256_srli_epi16(q, 4) : q, m4);
        if (FIVE)
            u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, sb), one), 4));
        o->u[j] = u;
        o->sc[j] = _mm256_set1_epi16(s8[sb]);
    }
}

static inline __attribute__((always_inline)) void kq_unpack_q6k(const uint8_t *blk, kq_block *o) {
    const float d = half_to_float(blk + 208);
    o->d = d;
    o->c = 32.0f * d;
    const int8_t *sc = (const int8_t *)(blk + 192);
    o->mn = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    for (int j = 0; j < 8; j++) {
        /* unit j = 4c + t (decode_sub's sub-block j): ql's bytes 32 * (t % 2) of the 64 at
         * 64 c, low nibbles for t < 2; bits 2t, 2t + 1 of qh's 32 bytes at 128 + 32 c */
        const int c = j / 4, t = j % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * (t & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
        const __m256i lo = _mm256_and_si256((t & 2) ? _mm256_srli_epi16(ql, 4) : ql, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), m3);
        o->u[j] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        /* one scale per 16 values: int16 lanes 0-7 (values 0..15), 8-15 (16..31) */
        o->sc[j] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
    }
}

/* One row's integer sums for one unpacked super-block: sum sc * (u . qa) in 8 int32 lanes. */
static inline __attribute__((always_inline)) __m256i kq_dot(const kq_block *w, const int8_t *q) {
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++)
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(
            _mm256_maddubs_epi16(w->u[j], _mm256_loadu_si256((const __m256i *)(q + 32 * j))),
            w->sc[j]));
    return acc;
}

/* One weight row times MR rows of x: out[r]. One accumulator per row (16 registers: the
 * unpacked block is read from the stack as memory operands). pre (or NULL): the row's
 * super-blocks unpacked already (kq_unpack_row), for the many rows of a prefill chunk. */
static inline __attribute__((always_inline)) void
krows_fast(const int FMT, const uint8_t *wrow, int64_t nb, int64_t k, const int MR,
           const int8_t *qa, const float *da, const int16_t *bs, const kq_block *pre, float *out) {
    const int64_t nbk = k / 256, nbs = k / 16;
    __m256 acc[QK_MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    const int64_t bb = FMT == F_Q4_K ? 144 : FMT == F_Q5_K ? 176 : 210;
    for (int64_t b = 0; b < nb; b++) {
        kq_block one;
        const kq_block *w = pre ? pre + b : &one; /* read in place, not copied */
        if (!pre) {
            if (FMT == F_Q6_K) kq_unpack_q6k(wrow + b * bb, &one);
            else kq_unpack_q45k(wrow + b * bb, FMT == F_Q5_K, &one);
        }
        for (int r = 0; r < MR; r++) {
            const float a = da[r * nbk + b];
            const __m256i dot = kq_dot(w, qa + r * k + 256 * b);
            const __m256i off = _mm256_madd_epi16(w->mn, _mm256_loadu_si256((const __m256i *)(bs + r * nbs + 16 * b)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(w->d * a), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(-w->c * a), acc[r]);
        }
    }
    for (int r = 0; r < MR; r++) out[r] = qg_hsum8(acc[r]);
}
#endif

/* ------------------------------------------------------------------ products, NEON */
#if QG_NEON
/* One super-block unpacked for NEON: u[g] the 16 unsigned values g*16 .. g*16+15 of the
 * activations' order (Q4_K / Q5_K: the nibble order, kq_pos) as bytes, sc the int32 scale of
 * each 16 (lanes of sc[g / 4]), mn the 16 int16 factors of the activations' 16-sums, d and c as
 * the AVX2 body's: sum w a = da * (d * sum sc*(u.qa) - c * sum mn * bsum). */
typedef struct {
    int8x16_t u[16];
    int32x4_t sc[4];
    int16x8_t mn[2];
    float d, c;
} kq_block;

static inline __attribute__((always_inline)) void
kq_unpack_q45k(const uint8_t *blk, const int FIVE, kq_block *o) {
    uint32_t sc[2], mn[2];
    k_scales_mins(blk + 4, sc, mn);
    o->d = half_to_float(blk);
    o->c = half_to_float(blk + 2);
    const uint8_t *s8 = (const uint8_t *)sc, *m8 = (const uint8_t *)mn;
    int32_t sc16[16];
    int16_t mn16[16];
    const uint8x16_t m4 = vdupq_n_u8(0x0F), one = vdupq_n_u8(1);
    const uint8_t *qs = blk + (FIVE ? 48 : 16);
    for (int j = 0; j < 8; j++) { /* unit j is sub-block kq_pos(j), as in the AVX2 body */
        const int sb = kq_pos(j);
        for (int h = 0; h < 2; h++) {
            const uint8x16_t q = vld1q_u8(qs + 64 * (j / 4) + 32 * (j & 1) + 16 * h);
            uint8x16_t u = (j & 2) ? vshrq_n_u8(q, 4) : vandq_u8(q, m4);
            if (FIVE) {
                const uint8x16_t qh = vld1q_u8(blk + 16 + 16 * h);
                u = vorrq_u8(u, vshlq_n_u8(vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)-sb)), one), 4));
            }
            o->u[2 * j + h] = vreinterpretq_s8_u8(u);
            sc16[2 * j + h] = s8[sb];
            mn16[2 * j + h] = m8[sb];
        }
    }
    for (int i = 0; i < 4; i++) o->sc[i] = vld1q_s32(sc16 + 4 * i);
    o->mn[0] = vld1q_s16(mn16);
    o->mn[1] = vld1q_s16(mn16 + 8);
}

static inline __attribute__((always_inline)) void kq_unpack_q6k(const uint8_t *blk, kq_block *o) {
    const float d = half_to_float(blk + 208);
    o->d = d;
    o->c = 32.0f * d;
    const int8x16_t sc = vld1q_s8((const int8_t *)blk + 192);
    o->mn[0] = vmovl_s8(vget_low_s8(sc));
    o->mn[1] = vmovl_high_s8(sc);
    o->sc[0] = vmovl_s16(vget_low_s16(o->mn[0]));
    o->sc[1] = vmovl_high_s16(o->mn[0]);
    o->sc[2] = vmovl_s16(vget_low_s16(o->mn[1]));
    o->sc[3] = vmovl_high_s16(o->mn[1]);
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(0x03);
    for (int j = 0; j < 8; j++) { /* unit j = 4c + t, as in the AVX2 body */
        const int c = j / 4, t = j % 4;
        for (int h = 0; h < 2; h++) {
            const uint8x16_t ql = vld1q_u8(blk + 64 * c + 32 * (t & 1) + 16 * h);
            const uint8x16_t qh = vld1q_u8(blk + 128 + 32 * c + 16 * h);
            const uint8x16_t lo = (t & 2) ? vshrq_n_u8(ql, 4) : vandq_u8(ql, m4);
            const uint8x16_t hi = vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(-2 * t))), m3);
            o->u[2 * j + h] = vreinterpretq_s8_u8(vorrq_u8(lo, vshlq_n_u8(hi, 4)));
        }
    }
}

/* One row's integer sums for one unpacked super-block: sum sc * (u . qa) in 4 int32 lanes
 * (at most 16 * 16 * 63 * 127 * 128 in all: no overflow). */
static inline __attribute__((always_inline)) int32x4_t kq_dot(const kq_block *w, const int8_t *q) {
    const int32x4_t z = vdupq_n_s32(0);
    int32x4_t acc = z;
    for (int i = 0; i < 4; i++) {
        int32x4_t d[4];
        for (int g = 0; g < 4; g++) d[g] = qg_sdot(z, w->u[4 * i + g], vld1q_s8(q + 64 * i + 16 * g));
        acc = vmlaq_s32(acc, qg_sum4(d[0], d[1], d[2], d[3]), w->sc[i]);
    }
    return acc;
}

/* One weight row times MR rows of x: out[r]; pre as in the AVX2 body. */
static inline __attribute__((always_inline)) void
krows_fast(const int FMT, const uint8_t *wrow, int64_t nb, int64_t k, const int MR,
           const int8_t *qa, const float *da, const int16_t *bs, const kq_block *pre, float *out) {
    const int64_t nbk = k / 256, nbs = k / 16;
    float32x4_t acc[QK_MR];
    for (int r = 0; r < MR; r++) acc[r] = vdupq_n_f32(0.0f);
    const int64_t bb = FMT == F_Q4_K ? 144 : FMT == F_Q5_K ? 176 : 210;
    for (int64_t b = 0; b < nb; b++) {
        kq_block one;
        const kq_block *w = pre ? pre + b : &one;
        if (!pre) {
            if (FMT == F_Q6_K) kq_unpack_q6k(wrow + b * bb, &one);
            else kq_unpack_q45k(wrow + b * bb, FMT == F_Q5_K, &one);
        }
        for (int r = 0; r < MR; r++) {
            const float a = da[r * nbk + b];
            const int16_t *g = bs + r * nbs + 16 * b;
            const int16x8_t g0 = vld1q_s16(g), g1 = vld1q_s16(g + 8);
            int32x4_t off = vmull_s16(vget_low_s16(w->mn[0]), vget_low_s16(g0));
            off = vmlal_high_s16(off, w->mn[0], g0);
            off = vmlal_s16(off, vget_low_s16(w->mn[1]), vget_low_s16(g1));
            off = vmlal_high_s16(off, w->mn[1], g1);
            acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(kq_dot(w, qa + r * k + 256 * b)), w->d * a);
            acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(off), -w->c * a);
        }
    }
    for (int r = 0; r < MR; r++) out[r] = vaddvq_f32(acc[r]);
}
#endif

#if QG_VEC
/* constant format and row count (1, 2, 4 or 8): the accumulators stay in registers */
#define KQ_ROWS(FMT)                                                                             \
    switch (mr) {                                                                                \
    case 1: krows_fast(FMT, wrow, nb, k, 1, qa, da, bs, pre, out); break;                        \
    case 2: krows_fast(FMT, wrow, nb, k, 2, qa, da, bs, pre, out); break;                        \
    case 4: krows_fast(FMT, wrow, nb, k, 4, qa, da, bs, pre, out); break;                        \
    default: krows_fast(FMT, wrow, nb, k, 8, qa, da, bs, pre, out); break;                       \
    }

static void krows_fast_any(int fmt, const uint8_t *wrow, int64_t nb, int64_t k, int mr,
                           const int8_t *qa, const float *da, const int16_t *bs,
                           const kq_block *pre, float *out) {
    switch (fmt) {
    case F_Q4_K: KQ_ROWS(F_Q4_K) break;
    case F_Q5_K: KQ_ROWS(F_Q5_K) break;
    default: KQ_ROWS(F_Q6_K) break;
    }
}
#endif

#if QG_FAST && !QG_512 || QG_NEON
#define KQ_PANELS 1
/* A weight row's nb super-blocks unpacked (krows_fast's pre). */
static void kq_unpack_row(int fmt, const uint8_t *wrow, int64_t nb, kq_block *o) {
    const int64_t bb = quant_block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        if (fmt == F_Q6_K) kq_unpack_q6k(wrow + b * bb, o + b);
        else if (fmt == F_Q5_K) kq_unpack_q45k(wrow + b * bb, 1, o + b);
        else kq_unpack_q45k(wrow + b * bb, 0, o + b);
    }
}

/* Weight rows [j0, j1) times m rows of x (more than one pass takes), a panel of weight rows
 * at a time (AVX2 and NEON: the 16-weight-row groups are AVX-512's):
 *
 *   panel: rows p0 .. p0+P unpacked once (kq_block a super-block, ~PANEL_BYTES: in L2)
 *   for each 8 rows of x (their int8 forms, in L1)
 *     for each row of the panel: krows_fast on the unpacked row
 *
 * One weight row at a time instead streamed all m rows' activations past each weight row
 * (from L2, or L3 for a 512-row chunk): Q4_K [8192 x 2048], one thread, v3, 93 GOP/s at 512
 * rows against 111 at 64. False where the panel could not be had (the caller unpacks per
 * pass). */
static int kq_panels(int fmt, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1,
                     int64_t k, int64_t m, const int8_t *qa, const float *da, const int16_t *bs,
                     float *y, int64_t ldy) {
    const int64_t nb = k / 256;
    const int64_t rows = panel_rows(nb * (int64_t)sizeof(kq_block), m, k, j0, j1);
    kq_block *pre = aligned_alloc(_Alignof(kq_block), sizeof(kq_block) * (size_t)(rows * nb));
    if (!pre) return 0;
    float out[QK_MR];
    for (int64_t p0 = j0; p0 < j1; p0 += rows) {
        const int64_t pe = p0 + rows < j1 ? p0 + rows : j1;
        for (int64_t j = p0; j < pe; j++) kq_unpack_row(fmt, w + j * row_bytes, nb, pre + (j - p0) * nb);
        for (int64_t r0 = 0; r0 < m;) {
            const int64_t left = m - r0;
            const int mr = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            for (int64_t j = p0; j < pe; j++) {
                krows_fast_any(fmt, w + j * row_bytes, nb, k, mr, qa + r0 * k, da + r0 * nb,
                               bs + r0 * (k / 16), pre + (j - p0) * nb, out);
                for (int r = 0; r < mr; r++) y[(r0 + r) * ldy + j] = out[r];
            }
            r0 += mr;
        }
    }
    free(pre);
    return 1;
}
#else
#define KQ_PANELS 0
#endif

/* y[r * ldy + j] = sum_i x_r[i] w_j[i] for the m rows of x quantized by quant_act_k and the n
 * rows of w (a K format, row_bytes each). path 1: the portable code; path 2: the fast code one
 * weight row at a time only. Returns -1 for a format that is not a K format or a k that 256
 * does not divide. */
int quant_gemm_k(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, int64_t m,
                 const int8_t *qa, const float *da, const int16_t *bs, float *y, int64_t ldy,
                 int nthreads, int path) {
    if (!is_k_format(fmt) || k % 256) return -1;
#pragma omp parallel num_threads(kernel_threads(nthreads, n / 8))
    quant_gemm_k_share(fmt, w, row_bytes, n, k, m, qa, da, bs, y, ldy, path);
    return 0;
}

/* quant_gemm_k's work for the calling thread of the enclosing team (its share of the weight
 * rows; no barrier), for quant_layer.c's one region per layer; the caller checks fmt and k. */
void quant_gemm_k_share(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                        int64_t m, const int8_t *qa, const float *da, const int16_t *bs, float *y,
                        int64_t ldy, int path) {
    const int64_t nb = k / 256;
    const int fast = QG_VEC && path != 1;
    /* from KC_MIN_ROWS rows of x on the fast path: groups of 16 weight rows (quant_gemm_k16.c),
     * the rest one by one; path 2: one by one only (benchmarks and tests compare) */
    const int64_t n16 = QG_512 && fast && path != 2 && m >= KC_MIN_ROWS ? n / 16 * 16 : 0;
    {
        const int64_t t = kernel_thread(), team = kernel_team();
#if QG_512
        if (n16) kc_groups(fmt, w, row_bytes, n16 / 16 * t / team, n16 / 16 * (t + 1) / team, k, m,
                           qa, da, bs, y, ldy);
#endif
        int64_t j0 = n16 + (n - n16) * t / team;
        const int64_t j1 = n16 + (n - n16) * (t + 1) / team;
        float out[QK_MR];
        int mr = 1;
#if KQ_PANELS
        /* AVX2 / NEON, more rows of x than one pass takes: panels of weight rows unpacked once */
        if (fast && m > 8 && kq_panels(fmt, w, row_bytes, j0, j1, k, m, qa, da, bs, y, ldy))
            j0 = j1;
#endif
        for (int64_t j = j0; j < j1; j++) {
            const uint8_t *wrow = w + j * row_bytes;
            for (int64_t r0 = 0; r0 < m; r0 += mr) {
                const int64_t left = m - r0;
                /* the fast code takes 1, 2, 4 or 8 rows; the portable code any up to 8 */
                mr = fast ? (left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1)
                          : (int)(left < QK_MR ? left : QK_MR);
                const int8_t *q = qa + r0 * k;
                const float *d = da + r0 * nb;
                const int16_t *s = bs + r0 * (k / 16);
#if QG_VEC
                if (fast)
                    krows_fast_any(fmt, wrow, nb, k, mr, q, d, s, NULL, out);
                else
#endif
                    krows_portable(fmt, wrow, nb, k, mr, q, d, s, out);
                for (int r = 0; r < mr; r++) y[(r0 + r) * ldy + j] = out[r];
            }
        }
    }
}

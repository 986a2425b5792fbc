/* Products by weights in GGUF's K formats (Q4_K, Q5_K, Q6_K) for many rows of x (a prefill
 * chunk, a batch's decode step): sixteen weight rows at a time, the way quant_gemm.c's cols16
 * reads Q4_0, instead of quant_gemm_k.c's one weight row against up to 8 rows of x (whose
 * unpacking of a super-block is repeated for every 8 rows, and whose per-row work ends in
 * horizontal sums).
 *
 * A chunk of KC_CHUNK super-blocks of 16 weight rows is unpacked once into a small buffer that
 * stays in L1 (kc_block: the values transposed so that int32 lane i holds 4 consecutive values
 * of weight row i, the rows' integer scales and minimums as vectors, their float16 factors as
 * floats); every row of x then runs over it. For one super-block and one row of x, with the
 * activations quantized per 256 (quant_act_k: qa, da, the sums of each 16 bs):
 *
 *   S1 = sum_s sc_s * (u . qa)_s      vpdpbusd per 4 values (qa broadcast), vpmulld per sub-block
 *   S2 = sum_s mn_s * bsum_s          vpdpwssd on int16 pairs (8 per super-block)
 *   y += da * (d * S1 - c * S2)       two float multiply-adds for all 16 weight rows
 *
 * (Q4_K / Q5_K: sub-blocks of 32, c = dmin, mn the 6-bit minimums; Q6_K: sub-blocks of 16,
 * c = 32 d, mn = sc.) Everything in S1 and S2 is an exact integer (at most 16 * 128 * 16 * 63 *
 * 127 < 2^31 in Q6_K), so the result differs from quant_gemm_k.c's only by float rounding: the
 * error against the float product of the dequantized weights is the activations' int8
 * rounding, as there.
 */
#include <stdint.h>
#include <string.h>
#include "quant_blocks.h"

#if QG_512
#define KC_MR 8    /* most rows of x per pass over an unpacked chunk (accumulators in registers) */
#define KC_CHUNK 4 /* super-blocks unpacked at once: 4 x 5.8 KB, within L1 */

/* One super-block of 16 weight rows, unpacked. u[s * G + g] lane i: values 4g .. 4g+3 of
 * sub-block s of row i (G = 8 for sub-blocks of 32, 4 for Q6_K's 16); sc[s] lane i: row i's
 * scale of sub-block s; mn[p] lane i: the int16 pair that multiplies the activations' pair of
 * 16-sums p (Q4_K / Q5_K: sub-block p's minimum twice; Q6_K: the scales of sub-blocks 2p and
 * 2p + 1); d, c: each row's factors. */
typedef struct {
    __m512i u[64];
    int32_t sc[16][16];
    int32_t mn[8][16];
    float d[16], c[16];
} kc_block;

/* Where sub-block s's activations start in a 256 (Q4_K / Q5_K: the nibble order, as
 * quant_gemm_k.c's kq_pos), and where pair p of their 16-sums is. */
static inline int kc_apos(const int FMT, int s) {
    return FMT == F_Q6_K ? 16 * s : 32 * ((s & 4) | ((s & 1) << 1) | ((s >> 1) & 1));
}
static inline int kc_bpos(const int FMT, int p) { return kc_apos(FMT, p) / (FMT == F_Q6_K ? 8 : 16); }

static inline __attribute__((always_inline)) void
kc_unpack(const int FMT, const uint8_t *blk, int64_t row_bytes, kc_block *o) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03), one = _mm512_set1_epi8(1);
    for (int i = 0; i < 16; i++) { /* the per-row scalars */
        const uint8_t *b = blk + i * row_bytes;
        if (FMT == F_Q6_K) {
            const float d = half_to_float(b + 208);
            o->d[i] = d;
            o->c[i] = 32.0f * d;
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int s = 0; s < 16; s++) o->sc[s][i] = sc[s];
            for (int p = 0; p < 8; p++)
                o->mn[p][i] = (int32_t)((uint32_t)(uint16_t)sc[2 * p] | ((uint32_t)(uint16_t)sc[2 * p + 1] << 16));
        } else {
            o->d[i] = half_to_float(b);
            o->c[i] = half_to_float(b + 2);
            for (int s = 0; s < 8; s++) {
                uint8_t sc, mn;
                k_scale_min(b + 4, s, &sc, &mn);
                o->sc[s][i] = sc;
                o->mn[s][i] = (int32_t)(mn | ((uint32_t)mn << 16));
            }
        }
    }
    __m512i P[4], Q[4];
    if (FMT == F_Q6_K) {
        for (int c = 0; c < 2; c++) { /* 128 values: ql 64 bytes, qh 32 */
            __m512i L[4][4], H[2][4];
            for (int t = 0; t < 4; t++) transpose16(blk + 64 * c + 16 * t, row_bytes, L[t]);
            for (int t = 0; t < 2; t++) transpose16(blk + 128 + 32 * c + 16 * t, row_bytes, H[t]);
            for (int t = 0; t < 2; t++)     /* which 16 of each 32 */
                for (int qt = 0; qt < 4; qt++) { /* which 32 of the 128 */
                    const int s = 8 * c + 2 * qt + t;
                    for (int v = 0; v < 4; v++) {
                        const __m512i l = L[t + 2 * (qt & 1)][v];
                        const __m512i lo = qt < 2 ? _mm512_and_si512(l, m4)
                                                  : _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
                        const __m512i h = _mm512_and_si512(_mm512_srli_epi16(H[t][v], 2 * qt), m3);
                        o->u[4 * s + v] = _mm512_or_si512(lo, _mm512_slli_epi16(h, 4));
                    }
                }
        }
        return;
    }
    const uint8_t *qs = blk + (FMT == F_Q5_K ? 48 : 16);
    __m512i QH[8];
    if (FMT == F_Q5_K) {
        transpose16(blk + 16, row_bytes, QH);
        transpose16(blk + 32, row_bytes, QH + 4);
    }
    for (int j = 0; j < 4; j++) { /* 32 bytes: sub-block 2j in the low nibbles, 2j + 1 high */
        transpose16(qs + 32 * j, row_bytes, P);
        transpose16(qs + 32 * j + 16, row_bytes, Q);
        for (int v = 0; v < 8; v++) {
            const __m512i q = v < 4 ? P[v] : Q[v - 4];
            __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            if (FMT == F_Q5_K) { /* bit s of each qh byte: bit 4 of sub-block s's value */
                lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(QH[v], 2 * j), one), 4));
                hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(QH[v], 2 * j + 1), one), 4));
            }
            o->u[8 * (2 * j) + v] = lo;
            o->u[8 * (2 * j + 1) + v] = hi;
        }
    }
}

/* The nc unpacked super-blocks of blocks[] (super-blocks b0 ..) times MR rows of x, added to
 * (first: stored in) y[r * ldy + 0 .. 15]. */
static inline __attribute__((always_inline)) void
kc_rows(const int FMT, const int MR, const kc_block *blocks, int nc, int64_t b0, int64_t k, int first,
        const int8_t *qa, const float *da, const int16_t *bs, float *y, int64_t ldy) {
    const int NS = FMT == F_Q6_K ? 16 : 8, G = FMT == F_Q6_K ? 4 : 8;
    const int64_t nbk = k / 256, nbs = k / 16;
    __m512 acc[KC_MR];
    for (int r = 0; r < MR; r++) acc[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy);
    for (int c = 0; c < nc; c++) {
        const kc_block *w = blocks + c;
        const int64_t b = b0 + c;
        __m512i s1[KC_MR];
        for (int r = 0; r < MR; r++) s1[r] = _mm512_setzero_si512();
        for (int s = 0; s < NS; s++) {
            __m512i u[8];
            for (int g = 0; g < G; g++) u[g] = _mm512_load_si512(w->u + s * G + g);
            const __m512i sc = _mm512_loadu_si512(w->sc[s]);
            const int at = kc_apos(FMT, s);
            for (int r = 0; r < MR; r++) {
                const int8_t *q = qa + r * k + 256 * b + at;
                __m512i dot = _mm512_setzero_si512();
                for (int g = 0; g < G; g++) {
                    int32_t q4;
                    memcpy(&q4, q + 4 * g, 4);
                    dot = _mm512_dpbusd_epi32(dot, u[g], _mm512_set1_epi32(q4));
                }
                s1[r] = _mm512_add_epi32(s1[r], _mm512_mullo_epi32(dot, sc));
            }
        }
        const __m512 d = _mm512_loadu_ps(w->d), cc = _mm512_loadu_ps(w->c);
        for (int r = 0; r < MR; r++) {
            const int16_t *sums = bs + r * nbs + 16 * b;
            __m512i s2 = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++) {
                int32_t pair;
                memcpy(&pair, sums + kc_bpos(FMT, p), 4);
                s2 = _mm512_dpwssd_epi32(s2, _mm512_loadu_si512(w->mn[p]), _mm512_set1_epi32(pair));
            }
            const __m512 a = _mm512_set1_ps(da[r * nbk + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[r]), _mm512_mul_ps(d, a), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(s2), _mm512_mul_ps(cc, a), acc[r]);
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* Weight rows w .. w + 15 times the m rows of x: y[r * ldy + 0 .. 15]. prefetch: the next 16
 * rows (contiguous) are fetched while these are unpacked (column-wise reads of 16 rows are
 * not a pattern the hardware prefetcher follows well). */
static inline __attribute__((always_inline)) void
kc_group(const int FMT, const uint8_t *w, int64_t row_bytes, int64_t nb, int64_t k, int64_t m,
         int prefetch, const int8_t *qa, const float *da, const int16_t *bs, float *y, int64_t ldy) {
    const int64_t bb = FMT == F_Q4_K ? 144 : FMT == F_Q5_K ? 176 : 210;
    const int64_t nbk = k / 256, nbs = k / 16;
    const uint8_t *next = w + 16 * row_bytes;
    const int64_t ahead = (16 * row_bytes + nb - 1) / nb; /* bytes of it per super-block */
    kc_block blocks[KC_CHUNK] __attribute__((aligned(64)));
    for (int64_t b0 = 0; b0 < nb; b0 += KC_CHUNK) {
        const int nc = (int)(nb - b0 < KC_CHUNK ? nb - b0 : KC_CHUNK);
        for (int c = 0; c < nc; c++) {
            if (prefetch)
                for (int64_t o = 0; o < ahead; o += 64)
                    _mm_prefetch((const char *)(next + (b0 + c) * ahead + o), _MM_HINT_T0);
            kc_unpack(FMT, w + (b0 + c) * bb, row_bytes, blocks + c);
        }
        for (int64_t r0 = 0; r0 < m;) {
            const int64_t left = m - r0;
            const int8_t *q = qa + r0 * k;
            const float *d = da + r0 * nbk;
            const int16_t *s = bs + r0 * nbs;
            float *yr = y + r0 * ldy;
            const int first = b0 == 0;
            if (left >= 8) { kc_rows(FMT, 8, blocks, nc, b0, k, first, q, d, s, yr, ldy); r0 += 8; }
            else if (left >= 4) { kc_rows(FMT, 4, blocks, nc, b0, k, first, q, d, s, yr, ldy); r0 += 4; }
            else if (left >= 2) { kc_rows(FMT, 2, blocks, nc, b0, k, first, q, d, s, yr, ldy); r0 += 2; }
            else { kc_rows(FMT, 1, blocks, nc, b0, k, first, q, d, s, yr, ldy); r0 += 1; }
        }
    }
}

/* Groups [g0, g1) of 16 weight rows of a K-format matrix times the m rows of x (quantized per
 * 256 by quant_act_k, Q4_K / Q5_K in the nibble order): y[r * ldy + 16 g ..]. */
void kc_groups(int fmt, const uint8_t *w, int64_t row_bytes, int64_t g0, int64_t g1, int64_t k,
               int64_t m, const int8_t *qa, const float *da, const int16_t *bs, float *y, int64_t ldy) {
    const int64_t nb = k / 256;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wg = w + 16 * g * row_bytes;
        float *yg = y + 16 * g;
        const int pf = g + 1 < g1;
        switch (fmt) {
        case F_Q4_K: kc_group(F_Q4_K, wg, row_bytes, nb, k, m, pf, qa, da, bs, yg, ldy); break;
        case F_Q5_K: kc_group(F_Q5_K, wg, row_bytes, nb, k, m, pf, qa, da, bs, yg, ldy); break;
        default: kc_group(F_Q6_K, wg, row_bytes, nb, k, m, pf, qa, da, bs, yg, ldy); break;
        }
    }
}
#endif

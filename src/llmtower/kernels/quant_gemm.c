/* Products by weights kept in GGUF's block formats, read in place (no repacking), and their
 * exact dequantization.
 *
 * Formats (ggml type ids): Q4_0 (2), Q4_1 (3), Q8_0 (8) in blocks of 32 values; Q4_K (12),
 * Q5_K (13), Q6_K (14) in super-blocks of 256. A weight row is a run of blocks, rows one after
 * another (the file's layout).
 *
 * Every format is read as 32-value sub-blocks of small unsigned integers u with a float scale
 * per 16 values and an offset: w = s * (u - o) (Q4_0: o = 8, Q8_0: 128 by flipping the sign
 * bit, Q6_K: 32) or w = s * u - m (Q4_1, Q4_K, Q5_K: a float minimum). The activations are
 * quantized once per call to int8 per 32 values (a = da * qa, da = max|x| / 127), so a
 * sub-block's dot product is an integer one (vpdpbusd: unsigned weight bytes times signed
 * activation bytes, four products per int32 lane; 8 lanes: lanes 0-3 the first 16 values,
 * 4-7 the second), corrected by the activations' sums:
 *
 *   sum w a = da * (s_lo * (u_lo . qa_lo - o * sum qa_lo) + s_hi * (...))      (offset o)
 *   sum w a = da * s * (u . qa) - m * da * sum qa                              (minimum m)
 *
 * The "- o * sum qa" term enters the integer lanes before the dot (lane 0 and lane 4 start at
 * -o * sum of their half), so it costs one shift per sub-block. Rows of x are taken up to
 * QG_MR at a time, so a weight sub-block is decoded once for all of them.
 *
 * quant_dequant gives the float32 values gguf's reference dequantization gives, bit for bit:
 * the same operations in the same order, without fused multiply-adds (the function is built
 * with -ffp-contract=off).
 *
 * The fast path needs AVX512_VNNI with AVX512VL (256-bit vpdpbusd) and F16C; elsewhere the
 * portable code computes the same sums in scalar C (its own summation order).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "threads.h"
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define QG_FAST 1
#else
#define QG_FAST 0
#endif

#define QG_MR 4 /* rows of x per pass over a weight row */

enum { F_Q4_0 = 2, F_Q4_1 = 3, F_Q8_0 = 8, F_Q4_K = 12, F_Q5_K = 13, F_Q6_K = 14 };

int quant_gemm_fast(void) { return QG_FAST; }

/* (values, bytes) of one block of `fmt`; 0 values for a format this file cannot read. */
int64_t quant_block_values(int fmt) {
    switch (fmt) {
    case F_Q4_0: case F_Q4_1: case F_Q8_0: return 32;
    case F_Q4_K: case F_Q5_K: case F_Q6_K: return 256;
    default: return 0;
    }
}

int64_t quant_block_bytes(int fmt) {
    switch (fmt) {
    case F_Q4_0: return 18;
    case F_Q4_1: return 20;
    case F_Q8_0: return 34;
    case F_Q4_K: return 144;
    case F_Q5_K: return 176;
    case F_Q6_K: return 210;
    default: return 0;
    }
}

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if QG_FAST
    return _cvtsh_ss(h);
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

static void decode_sub(int fmt, const uint8_t *blk, int sb, subblock *r) {
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

/* ------------------------------------------------------------------ dequantization */

/* One row of `nb` blocks (`bv` values, `bb` bytes each) at `row` as float32 into o: gguf's
 * reference values, bit for bit. */
__attribute__((optimize("fp-contract=off")))
static void dequant_row(int fmt, const uint8_t *row, int64_t nb, int64_t bv, int64_t bb,
                        float *o) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        float *y = o + b * bv;
        switch (fmt) {
        case F_Q4_0: {
            const float d = half_to_float(blk);
            for (int j = 0; j < 16; j++) {
                y[j] = d * (float)((int)(blk[2 + j] & 0xF) - 8);
                y[j + 16] = d * (float)((int)(blk[2 + j] >> 4) - 8);
            }
            break;
        }
        case F_Q4_1: {
            const float d = half_to_float(blk), m = half_to_float(blk + 2);
            for (int j = 0; j < 16; j++) {
                const float lo = d * (float)(blk[4 + j] & 0xF), hi = d * (float)(blk[4 + j] >> 4);
                y[j] = lo + m;
                y[j + 16] = hi + m;
            }
            break;
        }
        case F_Q8_0: {
            const float d = half_to_float(blk);
            for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)blk[2 + j] * d;
            break;
        }
        default: { /* the super-block formats, one sub-block at a time */
            subblock s;
            for (int sb = 0; sb < 8; sb++) {
                decode_sub(fmt, blk, sb, &s);
                float *ys = y + 32 * sb;
                if (fmt == F_Q6_K) {
                    for (int j = 0; j < 32; j++) {
                        const float q = (float)((int)s.u[j] - 32);
                        ys[j] = s.s[j / 16] * q;
                    }
                } else {
                    for (int j = 0; j < 32; j++) {
                        const float t = s.s[0] * (float)s.u[j];
                        ys[j] = t - s.m;
                    }
                }
            }
        }
        }
    }
}

/* Rows `rows[i]` (or 0 .. nrows-1 when rows is NULL) of the [*, k] matrix at w (row_bytes per
 * row) as float32 into out[i * k ..]: gguf's reference values, bit for bit. Returns -1 for a
 * format this file cannot read. */
__attribute__((optimize("fp-contract=off")))
int quant_dequant(int fmt, const uint8_t *w, int64_t row_bytes, int64_t nrows, int64_t k,
                  const int64_t *rows, float *out, int nthreads) {
    const int64_t bv = quant_block_values(fmt), bb = quant_block_bytes(fmt);
    if (bv == 0 || k % bv) return -1;
    const int64_t nb = k / bv;
#pragma omp parallel for num_threads(kernel_threads(nthreads, nrows)) schedule(static)
    for (int64_t i = 0; i < nrows; i++)
        dequant_row(fmt, w + (rows ? rows[i] : i) * row_bytes, nb, bv, bb, out + i * k);
    return 0;
}

/* quant_dequant's rows rounded to bfloat16 (to nearest even, as torch's .to(torch.bfloat16)),
 * through one float32 row per thread: a prefill product needs the matrix in bfloat16, and a
 * float32 copy of it first would double the memory it takes and the bytes written. */
int quant_dequant_bf16(int fmt, const uint8_t *w, int64_t row_bytes, int64_t nrows, int64_t k,
                       const int64_t *rows, uint16_t *out, int nthreads) {
    const int64_t bv = quant_block_values(fmt);
    if (bv == 0 || k % bv) return -1;
    const int64_t nb = k / bv, bb = quant_block_bytes(fmt);
    int failed = 0;
#pragma omp parallel num_threads(kernel_threads(nthreads, nrows))
    {
        float *tmp = malloc((size_t)k * sizeof(float));
        if (!tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nrows; i++) {
            if (!tmp) continue;
            dequant_row(fmt, w + (rows ? rows[i] : i) * row_bytes, nb, bv, bb, tmp);
            uint16_t *o = out + i * k;
            int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            for (; j + 16 <= k; j += 16)
                _mm256_storeu_si256((__m256i *)(o + j),
                                    _mm512_cvtepi32_epi16(f32x16_to_bf16(_mm512_loadu_ps(tmp + j))));
#endif
            for (; j < k; j++) o[j] = f32_to_bf16(tmp[j]);
        }
        free(tmp);
    }
    return failed ? -2 : 0;
}

/* ------------------------------------------------------------------ activations */

/* x [m, k] (row stride ldx) -> per row: int8 qa[k], da[k / 32] (scale), fa[k / 32] (da * sum
 * of the 32 qa), ns[k / 32 * 8] (lanes 0 and 4: minus the sum of each 16, others 0). */
void quant_act(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *qa, float *da,
               float *fa, int32_t *ns) {
    const int64_t nb = k / 32;
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xr + 32 * b;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, id = d > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = qa + r * k + 32 * b;
            int s0 = 0, s1 = 0;
            for (int j = 0; j < 32; j++) {
                const int v = (int)lrintf(xb[j] * id);
                q[j] = (int8_t)v;
                if (j < 16) s0 += v; else s1 += v;
            }
            const int64_t i = r * nb + b;
            da[i] = d;
            fa[i] = d * (float)(s0 + s1);
            int32_t *n = ns + 8 * i;
            memset(n, 0, 8 * sizeof *n);
            n[0] = -s0;
            n[4] = -s1;
        }
    }
}

/* ------------------------------------------------------------------ products, portable */

static void rows_portable(int fmt, const uint8_t *wrow, int64_t nb, int64_t k, int mr,
                          const int8_t *qa, const float *da, const float *fa, float *out) {
    const int64_t bv = quant_block_values(fmt), bb = quant_block_bytes(fmt), nsub = bv / 32;
    float acc[QG_MR] = {0};
    subblock s;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t sb = 0; sb < nsub; sb++) {
            decode_sub(fmt, wrow + b * bb, (int)sb, &s);
            const int64_t ab = b * nsub + sb; /* the activations' block of 32 */
            for (int r = 0; r < mr; r++) {
                const int8_t *q = qa + r * k + 32 * ab;
                int d0 = 0, d1 = 0;
                for (int j = 0; j < 16; j++) d0 += ((int)s.u[j] - s.o) * q[j];
                for (int j = 16; j < 32; j++) d1 += ((int)s.u[j] - s.o) * q[j];
                const float a = da[r * (k / 32) + ab];
                acc[r] += a * (s.s[0] * (float)d0 + s.s[1] * (float)d1) - s.m * fa[r * (k / 32) + ab];
            }
        }
    for (int r = 0; r < mr; r++) out[r] = acc[r];
}

/* ------------------------------------------------------------------ products, VNNI */
#if QG_FAST
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One sub-block's products for MR rows: lanes start at -o * (sum of each half) (ns << shift),
 * take u . qa, and are added scaled (sv: the weight's scales per lane) into acc[r]. */
#define SUB_DOT(MR, U, SV, SHIFT, AB)                                                          \
    for (int r = 0; r < MR; r++) {                                                             \
        __m256 *acc = accs + jr * MR;                                                          \
        const int64_t i_ = r * nbk + (AB);                                                     \
        __m256i init = (SHIFT) ? _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(ns + 8 * i_)), (SHIFT)) \
                               : _mm256_setzero_si256();                                       \
        const __m256i l_ = _mm256_dpbusd_epi32(init, (U), _mm256_loadu_si256((const __m256i *)(qa + 32 * i_))); \
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l_), _mm256_mul_ps((SV), _mm256_set1_ps(da[i_])), acc[r]); \
    }

/* NR weight rows (row_bytes apart) times MR rows of x: out[jr * MR + r]. The NR * MR
 * accumulators are independent chains (a one-row decode takes 4 weight rows at once). */
static inline __attribute__((always_inline)) void
rows_fast(int fmt, const uint8_t *w0, int64_t row_bytes, const int NR, int64_t nb, int64_t k,
          const int MR, const int8_t *qa, const float *da, const float *fa, const int32_t *ns,
          float *out) {
    const int64_t nbk = k / 32;
    __m256 accs[8];
    float maccs[8];
    for (int r = 0; r < NR * MR; r++) { accs[r] = _mm256_setzero_ps(); maccs[r] = 0.0f; }
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i m4y = _mm256_set1_epi8(0x0F), m3y = _mm256_set1_epi8(0x03);
    switch (fmt) {
    case F_Q4_0: case F_Q8_0:
        for (int64_t b = 0; b < nb; b++) for (int jr = 0; jr < NR; jr++) {
            const uint8_t *blk = w0 + jr * row_bytes + b * (fmt == F_Q4_0 ? 18 : 34);
            const __m256 sv = _mm256_set1_ps(half_to_float(blk));
            __m256i u;
            if (fmt == F_Q4_0) {
                const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2));
                u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
                SUB_DOT(MR, u, sv, 3, b)
            } else {
                u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8((char)0x80));
                SUB_DOT(MR, u, sv, 7, b)
            }
        }
        break;
    case F_Q4_1:
        for (int64_t b = 0; b < nb; b++) for (int jr = 0; jr < NR; jr++) {
            const uint8_t *blk = w0 + jr * row_bytes + b * 20;
            float *macc = maccs + jr * MR;
            const __m256 sv = _mm256_set1_ps(half_to_float(blk));
            const float mn = half_to_float(blk + 2);
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 4));
            const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
            SUB_DOT(MR, u, sv, 0, b)
            for (int r = 0; r < MR; r++) macc[r] += mn * fa[r * nbk + b];
        }
        break;
    case F_Q4_K: case F_Q5_K: {
        const int five = fmt == F_Q5_K;
        const int64_t bb = five ? 176 : 144;
        for (int64_t b = 0; b < nb; b++) for (int jr = 0; jr < NR; jr++) {
            const uint8_t *blk = w0 + jr * row_bytes + b * bb;
            float *macc = maccs + jr * MR;
            const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + (five ? 48 : 16) + 32 * j));
                for (int h = 0; h < 2; h++) {
                    const int sb = 2 * j + h;
                    uint8_t sc, mn;
                    k_scale_min(blk + 4, sb, &sc, &mn);
                    __m256i u = h ? _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4y) : _mm256_and_si256(qs, m4y);
                    if (five) {
                        /* bit sb of each qh byte -> 16 */
                        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, sb), _mm256_set1_epi8(1));
                        u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 4));
                    }
                    const __m256 sv = _mm256_set1_ps(d * (float)sc);
                    const float m = dmin * (float)mn;
                    const int64_t ab = 8 * b + sb;
                    SUB_DOT(MR, u, sv, 0, ab)
                    for (int r = 0; r < MR; r++) macc[r] -= m * fa[r * nbk + ab];
                }
            }
        }
        break;
    }
    case F_Q6_K:
        for (int64_t b = 0; b < nb; b++) for (int jr = 0; jr < NR; jr++) {
            const uint8_t *blk = w0 + jr * row_bytes + b * 210;
            const float d = half_to_float(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int c = 0; c < 2; c++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * c));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
                for (int t = 0; t < 4; t++) {
                    const __m256i ql = (t & 1) ? ql1 : ql0;
                    const __m256i lo = (t >> 1) ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4y)
                                                : _mm256_and_si256(ql, m4y);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), m3y);
                    const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                    const int sb = 4 * c + t;
                    const __m256 sv = _mm256_set_m128(_mm_set1_ps(d * (float)sc[2 * sb + 1]),
                                                      _mm_set1_ps(d * (float)sc[2 * sb]));
                    const int64_t ab = 8 * b + sb;
                    SUB_DOT(MR, u, sv, 5, ab)
                }
            }
        }
        break;
    }
    for (int r = 0; r < NR * MR; r++) out[r] = hsum8(accs[r]) + maccs[r];
}

static void rows_fast_any(int fmt, const uint8_t *wrow, int64_t row_bytes, int nr, int64_t nb,
                          int64_t k, int mr, const int8_t *qa, const float *da, const float *fa,
                          const int32_t *ns, float *out) {
    /* constant row counts: the accumulators stay in registers */
    if (nr == 4) {
        rows_fast(fmt, wrow, row_bytes, 4, nb, k, 1, qa, da, fa, ns, out);
        return;
    }
    switch (mr) {
    case 1: rows_fast(fmt, wrow, row_bytes, 1, nb, k, 1, qa, da, fa, ns, out); break;
    case 2: rows_fast(fmt, wrow, row_bytes, 1, nb, k, 2, qa, da, fa, ns, out); break;
    case 3: rows_fast(fmt, wrow, row_bytes, 1, nb, k, 3, qa, da, fa, ns, out); break;
    default: rows_fast(fmt, wrow, row_bytes, 1, nb, k, 4, qa, da, fa, ns, out); break;
    }
}
#endif

/* y[r * ldy + j] = sum_i x_r[i] w_j[i] for the m rows of x quantized by quant_act and the n
 * rows of w (row_bytes each). path 1: the portable code. Returns -1 for an unknown format or
 * a k the blocks do not divide. */
int quant_gemm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, int64_t m,
               const int8_t *qa, const float *da, const float *fa, const int32_t *ns, float *y,
               int64_t ldy, int nthreads, int path) {
    const int64_t bv = quant_block_values(fmt);
    if (bv == 0 || k % bv) return -1;
    const int64_t nb = k / bv, nbk = k / 32;
    const int fast = QG_FAST && path == 0;
    (void)ns;
    (void)fast;
#pragma omp parallel num_threads(kernel_threads(nthreads, n / 8))
    {
        const int64_t t = kernel_thread(), team = kernel_team();
        int64_t j0 = n * t / team;
        const int64_t j1 = n * (t + 1) / team;
        float out[8];
#if QG_FAST
        if (fast && m == 1) { /* decode: four weight rows at a time, one row of x */
            int64_t j = j0;
            for (; j + 4 <= j1; j += 4) {
                rows_fast_any(fmt, w + j * row_bytes, row_bytes, 4, nb, k, 1, qa, da, fa, ns, out);
                for (int c = 0; c < 4; c++) y[j + c] = out[c];
            }
            for (; j < j1; j++) {
                rows_fast_any(fmt, w + j * row_bytes, row_bytes, 1, nb, k, 1, qa, da, fa, ns, out);
                y[j] = out[0];
            }
            j0 = j1; /* done */
        }
#endif
        for (int64_t j = j0; j < j1; j++) {
            const uint8_t *wrow = w + j * row_bytes;
            for (int64_t r0 = 0; r0 < m; r0 += QG_MR) {
                const int mr = (int)(m - r0 < QG_MR ? m - r0 : QG_MR);
                const int8_t *q = qa + r0 * k;
                const float *d = da + r0 * nbk, *f = fa + r0 * nbk;
#if QG_FAST
                if (fast)
                    rows_fast_any(fmt, wrow, row_bytes, 1, nb, k, mr, q, d, f, ns + 8 * r0 * nbk, out);
                else
#endif
                    rows_portable(fmt, wrow, nb, k, mr, q, d, f, out);
                for (int r = 0; r < mr; r++) y[(r0 + r) * ldy + j] = out[r];
            }
        }
    }
    return 0;
}

/* Products by weights kept in GGUF's block formats of 32 values, read in place (no repacking),
 * and every block format's exact dequantization.
 *
 * Formats (ggml type ids): Q4_0 (2), Q4_1 (3), Q8_0 (8) in blocks of 32 values; Q4_K (12),
 * Q5_K (13), Q6_K (14) in super-blocks of 256 (their products: quant_gemm_k.c). A weight row is
 * a run of blocks, rows one after another (the file's layout).
 *
 * A block is 32 small unsigned integers u with a float scale and an offset: w = s * (u - o)
 * (Q4_0: o = 8, Q8_0: 128 by flipping the sign bit) or w = s * u - m (Q4_1: a float minimum).
 * The activations are quantized once per call to int8 per 32 values (a = da * qa, da = max|x|
 * / 127), so a block's dot product is an integer one (vpdpbusd: unsigned weight bytes times
 * signed activation bytes, four products per int32 lane; 8 lanes: lanes 0-3 the first 16
 * values, 4-7 the second), corrected by the activations' sums:
 *
 *   sum w a = da * s * (u . qa - o * sum qa)       (offset o)
 *   sum w a = da * s * (u . qa) - m * da * sum qa  (minimum m)
 *
 * The "- o * sum qa" term enters the integer lanes before the dot (lane 0 and lane 4 start at
 * -o * sum of their half), so it costs one shift per block. Rows of x are taken up to QG_MR at
 * a time, so a weight block is decoded once for all of them.
 *
 * quant_dequant gives the float32 values gguf's reference dequantization gives, bit for bit:
 * the same operations in the same order, without fused multiply-adds (the function is built
 * with -ffp-contract=off).
 *
 * The fast path needs AVX2, FMA and F16C (its vectors are 256-bit; vpdpbusd where AVX512_VNNI
 * or AVX-VNNI has it, else vpmaddubsw + vpmaddwd: quant_blocks.h qg_dpbusd); the groups of 16
 * weight rows (quant_gemm_16.c) need AVX512_VNNI. On aarch64 NEON bodies take signed weight
 * bytes (Q4_0's nibbles less 8: no offset term) times the activations, four blocks at a time.
 * Elsewhere the portable code computes the same sums in scalar C (its own summation order).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "quant_blocks.h"
#include "threads.h"

#define QG_MR 4 /* rows of x per pass over a weight row */

int quant_gemm_fast(void) { return QG_VEC; }

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

#if QG_512
/* One row of Q4_0 / Q4_1 / Q8_0 blocks as bfloat16: dequant_row's float32 values (the same
 * operations, vectorized) rounded to nearest even. */
__attribute__((optimize("fp-contract=off")))
static void dequant_row_bf16_32(int fmt, const uint8_t *row, int64_t nb, uint16_t *o) {
    const int64_t bb = quant_block_bytes(fmt);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        const __m512 d = _mm512_set1_ps(half_to_float(blk));
        __m512 y0, y1;
        if (fmt == F_Q8_0) {
            y0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))), d);
            y1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))), d);
        } else {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (fmt == F_Q4_1 ? 4 : 2)));
            __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(qs, m4));
            __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), m4));
            if (fmt == F_Q4_0) {
                lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
                hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
            }
            y0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo));
            y1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi));
            if (fmt == F_Q4_1) {
                const __m512 mn = _mm512_set1_ps(half_to_float(blk + 2));
                y0 = _mm512_add_ps(y0, mn);
                y1 = _mm512_add_ps(y1, mn);
            }
        }
        _mm256_storeu_si256((__m256i *)(o + 32 * b), _mm512_cvtepi32_epi16(f32x16_to_bf16(y0)));
        _mm256_storeu_si256((__m256i *)(o + 32 * b + 16), _mm512_cvtepi32_epi16(f32x16_to_bf16(y1)));
    }
}
#endif

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
            uint16_t *o = out + i * k;
#if QG_512
            if (bv == 256) {
                kq_dequant_row_bf16(fmt, w + (rows ? rows[i] : i) * row_bytes, nb, o);
                continue;
            }
            dequant_row_bf16_32(fmt, w + (rows ? rows[i] : i) * row_bytes, nb, o);
            continue;
#endif
            if (!tmp) continue;
            dequant_row(fmt, w + (rows ? rows[i] : i) * row_bytes, nb, bv, bb, tmp);
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
/* The same in AVX-512 where built (the same operations per value: a prefill chunk quantizes
 * 144 x 8192 values per product). Rows are shared out to threads from 64 rows on (a prefill
 * chunk; not a decode step, whose fork would cost more than it saves). */
void quant_act(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *qa, float *da,
               float *fa, int32_t *ns) {
    const int64_t nb = k / 32;
#pragma omp parallel for if (m >= 64) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xr + 32 * b;
            int8_t *q = qa + r * k + 32 * b;
            int s0 = 0, s1 = 0;
            float amax = 0.0f, d, id;
#if QG_512
            const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            d = amax / 127.0f;
            id = d > 0.0f ? 127.0f / amax : 0.0f;
            const __m512 vid = _mm512_set1_ps(id);
            const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid));
            const __m512i v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
            _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(v0));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(v1));
            s0 = _mm512_reduce_add_epi32(v0);
            s1 = _mm512_reduce_add_epi32(v1);
#elif QG_FAST
            amax = qg_absmax(xb, 32);
            d = amax / 127.0f;
            id = d > 0.0f ? 127.0f / amax : 0.0f;
            const __m256 vid = _mm256_set1_ps(id);
            s0 = qg_hsum_epi32(_mm256_add_epi32(qg_round_store8(xb, vid, q), qg_round_store8(xb + 8, vid, q + 8)));
            s1 = qg_hsum_epi32(_mm256_add_epi32(qg_round_store8(xb + 16, vid, q + 16),
                                                qg_round_store8(xb + 24, vid, q + 24)));
#elif QG_NEON
            amax = qg_absmax(xb, 32);
            d = amax / 127.0f;
            id = d > 0.0f ? 127.0f / amax : 0.0f;
            s0 = qg_round_store16(xb, id, q);
            s1 = qg_round_store16(xb + 16, id, q + 16);
#else
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            d = amax / 127.0f;
            id = d > 0.0f ? 127.0f / amax : 0.0f;
            for (int j = 0; j < 32; j++) {
                const int v = (int)lrintf(xb[j] * id);
                q[j] = (int8_t)v;
                if (j < 16) s0 += v; else s1 += v;
            }
#endif
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

/* ------------------------------------------------------------------ products, 256-bit vectors */
#if QG_FAST
/* One sub-block's products for MR rows: lanes start at -o * (sum of each half) (ns << shift),
 * take u . qa (FLIP: qa's bytes under the signs of SIGNS' bytes first), and are added
 * scaled (sv: the weight's scales per lane) into acc[r]. */
#define SUB_DOT(MR, U, SV, SHIFT, AB, FLIP, SIGNS)                                             \
    for (int r = 0; r < MR; r++) {                                                             \
        __m256 *acc = accs + jr * MR;                                                          \
        const int64_t i_ = r * nbk + (AB);                                                     \
        __m256i init = (SHIFT) ? _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(ns + 8 * i_)), (SHIFT)) \
                               : _mm256_setzero_si256();                                       \
        __m256i q_ = _mm256_loadu_si256((const __m256i *)(qa + 32 * i_));                     \
        if (FLIP) q_ = _mm256_sign_epi8(q_, (SIGNS));                                          \
        const __m256i l_ = qg_dpbusd(init, (U), q_);                                           \
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
    switch (fmt) {
    case F_Q4_0: case F_Q8_0:
        for (int64_t b = 0; b < nb; b++) for (int jr = 0; jr < NR; jr++) {
            const uint8_t *blk = w0 + jr * row_bytes + b * (fmt == F_Q4_0 ? 18 : 34);
            const __m256 sv = _mm256_set1_ps(half_to_float(blk));
            __m256i u;
            if (fmt == F_Q4_0) {
                const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2));
                u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
                SUB_DOT(MR, u, sv, 3, b, 0, u)
            } else {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));
#if QG_DPBUSD
                u = _mm256_xor_si256(wv, _mm256_set1_epi8((char)0x80)); /* w + 128 */
                SUB_DOT(MR, u, sv, 7, b, 0, u)
#else
                /* |w| (128 for -128, as an unsigned byte) times qa under w's signs: no offset */
                u = _mm256_sign_epi8(wv, wv);
                SUB_DOT(MR, u, sv, 0, b, 1, wv)
#endif
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
            SUB_DOT(MR, u, sv, 0, b, 0, u)
            for (int r = 0; r < MR; r++) macc[r] += mn * fa[r * nbk + b];
        }
        break;
    }
    for (int r = 0; r < NR * MR; r++) out[r] = qg_hsum8(accs[r]) + maccs[r];
}

#if !QG_512
/* Blocks b0 .. b0 + 7 of a Q4_0 / Q8_0 weight row: u[i] the unsigned bytes the dot takes
 * (Q4_0's nibbles, low then high; Q8_0's |w|), and their eight scales as floats (gathered in a
 * register: a vector load after eight 2-byte stores stalls). */
static inline __attribute__((always_inline)) __m256
decode8(const int FMT, const uint8_t *wrow, int64_t b0, __m256i u[8]) {
    const int64_t bb = FMT == F_Q4_0 ? 18 : 34;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m128i sw = _mm_setzero_si128();
    for (int i = 0; i < 8; i++) {
        const uint8_t *blk = wrow + (b0 + i) * bb;
        uint16_t h;
        memcpy(&h, blk, 2);
        sw = _mm_insert_epi16(sw, h, i);
        if (FMT == F_Q4_0) {
            const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 2));
            u[i] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), m4);
        } else {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
            u[i] = _mm256_sign_epi8(w, w);
        }
    }
    return _mm256_cvtph_ps(sw);
}

/* One weight row of Q4_0 or Q8_0 times MR rows of x on 256-bit vectors without AVX-512, eight
 * blocks at a time: each block's integer dot in 8 lanes (u . qa: vpmaddubsw, vpmaddwd), the
 * eight dots summed to one lane each (a vphaddd tree), then the float work once per eight
 * blocks in 8 lanes, one block a lane:
 *
 *   acc += s_w * (da * dot - o * fa)       (o = 8 for Q4_0's unsigned nibbles, 0 for Q8_0)
 *
 * where rows_fast pays a scale broadcast, a conversion and a multiply-add (and the offset's
 * shift) per block and row: ~17 instructions a block there, ~10 here (one row of x). The eight
 * blocks' weights are decoded once for the MR rows, or (Q4_0, ub not NULL) taken decoded from
 * ub (the nibbles of block b as 32 bytes at ub[b]) and sb (the scales of blocks 8c .. 8c + 7
 * at sb[c]): a prefill chunk's rows of x run four at a time over one weight row decoded once.
 * Q8_0 takes |w| and qa under w's signs (vpmaddubsw's pair sums stay below 2^15). Blocks past
 * the last eight: rows_fast. */
static inline __attribute__((always_inline)) void
rows8_q4_0_q8_0(const int FMT, const uint8_t *wrow, int64_t nb, int64_t k, const int MR,
                const int8_t *qa, const float *da, const float *fa, const int32_t *ns,
                const __m256i *ub, const __m256 *sb, float *out) {
    const int64_t nbk = k / 32, bb = FMT == F_Q4_0 ? 18 : 34;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 off = _mm256_set1_ps(FMT == F_Q4_0 ? 8.0f : 0.0f);
    __m256 acc[4];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    int64_t b0 = 0;
    for (; b0 + 8 <= nb; b0 += 8) {
        __m256i u[8];
        __m256 sv;
        if (FMT == F_Q4_0 && ub) {
            for (int i = 0; i < 8; i++) u[i] = _mm256_load_si256(ub + b0 + i);
            sv = sb[b0 / 8];
        } else {
            sv = decode8(FMT, wrow, b0, u);
        }
        for (int r = 0; r < MR; r++) {
            const int64_t i0 = r * nbk + b0;
            __m256i d[8];
            for (int i = 0; i < 8; i++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(qa + 32 * (i0 + i)));
                if (FMT == F_Q8_0)
                    q = _mm256_sign_epi8(q, _mm256_loadu_si256((const __m256i *)(wrow + (b0 + i) * bb + 2)));
                d[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], q), ones);
            }
            /* per 128-bit half: [d0 d1 d2 d3] and [d4 d5 d6 d7] sums of that half; then the halves */
            const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
            const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
            const __m256i dots = _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20),
                                                  _mm256_permute2x128_si256(g0, g1, 0x31));
            const __m256 t = _mm256_fnmadd_ps(off, _mm256_loadu_ps(fa + i0),
                                              _mm256_mul_ps(_mm256_cvtepi32_ps(dots), _mm256_loadu_ps(da + i0)));
            acc[r] = _mm256_fmadd_ps(t, sv, acc[r]);
        }
    }
    float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (b0 < nb)
        rows_fast(FMT, wrow + b0 * bb, 0, 1, nb - b0, k, MR, qa + 32 * b0, da + b0, fa + b0,
                  ns + 8 * b0, tail);
    for (int r = 0; r < MR; r++) out[r] = qg_hsum8(acc[r]) + tail[r];
}

/* rows8_q4_0_q8_0 with constant format and row count (1, 2 or 4). */
static void rows8_any(int fmt, const uint8_t *wrow, int64_t nb, int64_t k, int mr,
                      const int8_t *qa, const float *da, const float *fa, const int32_t *ns,
                      const __m256i *ub, const __m256 *sb, float *out) {
#define ROWS8(FMT)                                                                               \
    switch (mr) {                                                                                \
    case 1: rows8_q4_0_q8_0(FMT, wrow, nb, k, 1, qa, da, fa, ns, ub, sb, out); break;            \
    case 2: rows8_q4_0_q8_0(FMT, wrow, nb, k, 2, qa, da, fa, ns, ub, sb, out); break;            \
    default: rows8_q4_0_q8_0(FMT, wrow, nb, k, 4, qa, da, fa, ns, ub, sb, out); break;           \
    }
    if (fmt == F_Q4_0) { ROWS8(F_Q4_0) } else { ROWS8(F_Q8_0) }
#undef ROWS8
}

/* The first nb / 8 * 8 blocks of a Q4_0 row decoded for rows8_q4_0_q8_0 (ub, sb). */
static void q4_0_decode_row(const uint8_t *wrow, int64_t nb, __m256i *ub, __m256 *sb) {
    for (int64_t b0 = 0; b0 + 8 <= nb; b0 += 8) sb[b0 / 8] = decode8(F_Q4_0, wrow, b0, ub + b0);
}

/* Weight rows [j0, j1) of Q4_0 times m > 4 rows of x, a panel of weight rows at a time:
 *
 *   panel: rows p0 .. p0+P decoded once (32 bytes a block, ~PANEL_BYTES: in L2)
 *   for each 4 rows of x (their int8 forms: 4 k bytes, in L1)
 *     for each row of the panel: rows8_q4_0_q8_0 on the decoded row
 *
 * So a 4-row group's activations stay in L1 over the whole panel, and each decoded block is
 * read from L2 once per 4 rows of x. One weight row at a time instead (its decoded row in L1,
 * all m rows of x streamed past it) read a 512-row chunk's 1.3 MB of activations from L3 for
 * every weight row: 155 against 130 ms ([8192 x 2048], one thread, v3). A panel is one row
 * where the activations fit in L1 (panel_rows). False where the panel's buffers could not be
 * had (the caller then decodes per pass). */
static int q4_0_panels(const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t k,
                       int64_t m, const int8_t *qa, const float *da, const float *fa,
                       const int32_t *ns, float *y, int64_t ldy) {
    const int64_t nb = k / 32, nb8 = nb / 8 * 8, nbk = k / 32;
    const int64_t rows = panel_rows(nb8 * 36, m, k, j0, j1);
    __m256i *ub = nb8 ? aligned_alloc(32, sizeof(__m256i) * (size_t)(rows * nb8)) : NULL;
    __m256 *sb = nb8 ? aligned_alloc(32, sizeof(__m256) * (size_t)(rows * (nb8 / 8))) : NULL;
    if (!ub || !sb) {
        free(ub);
        free(sb);
        return 0;
    }
    float out[4];
    for (int64_t p0 = j0; p0 < j1; p0 += rows) {
        const int64_t pe = p0 + rows < j1 ? p0 + rows : j1;
        for (int64_t j = p0; j < pe; j++)
            q4_0_decode_row(w + j * row_bytes, nb, ub + (j - p0) * nb8, sb + (j - p0) * (nb8 / 8));
        for (int64_t r0 = 0; r0 < m;) {
            const int mr = m - r0 >= 4 ? 4 : m - r0 >= 2 ? 2 : 1;
            for (int64_t j = p0; j < pe; j++) {
                rows8_any(F_Q4_0, w + j * row_bytes, nb, k, mr, qa + r0 * k, da + r0 * nbk,
                          fa + r0 * nbk, ns + 8 * r0 * nbk, ub + (j - p0) * nb8,
                          sb + (j - p0) * (nb8 / 8), out);
                for (int r = 0; r < mr; r++) y[(r0 + r) * ldy + j] = out[r];
            }
            r0 += mr;
        }
    }
    free(ub);
    free(sb);
    return 1;
}
#endif

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

/* ------------------------------------------------------------------ products, NEON */
#if QG_NEON
/* One Q4_0 / Q4_1 / Q8_0 block's 32 values as signed bytes, two vectors (Q4_0: nibble - 8, so
 * no offset term; Q4_1: the nibbles; Q8_0: as stored). */
static inline __attribute__((always_inline)) void
neon_decode1(const int FMT, const uint8_t *blk, int8x16_t v[2]) {
    if (FMT == F_Q8_0) {
        v[0] = vld1q_s8((const int8_t *)blk + 2);
        v[1] = vld1q_s8((const int8_t *)blk + 18);
        return;
    }
    const uint8x16_t q = vld1q_u8(blk + (FMT == F_Q4_1 ? 4 : 2));
    v[0] = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F)));
    v[1] = vreinterpretq_s8_u8(vshrq_n_u8(q, 4));
    if (FMT == F_Q4_0) {
        v[0] = vsubq_s8(v[0], vdupq_n_s8(8));
        v[1] = vsubq_s8(v[1], vdupq_n_s8(8));
    }
}

/* Blocks b0 .. b0 + 3 of a weight row decoded (neon_decode1), their scales and (Q4_1)
 * minimums as 4 floats. */
static inline __attribute__((always_inline)) void
neon_decode4(const int FMT, const uint8_t *wrow, int64_t b0, int8x16_t v[8], float32x4_t *sv,
             float32x4_t *mv) {
    const int64_t bb = FMT == F_Q4_0 ? 18 : FMT == F_Q4_1 ? 20 : 34;
    float s[4], mn[4];
    for (int i = 0; i < 4; i++) {
        const uint8_t *blk = wrow + (b0 + i) * bb;
        s[i] = half_to_float(blk);
        neon_decode1(FMT, blk, v + 2 * i);
        mn[i] = FMT == F_Q4_1 ? half_to_float(blk + 2) : 0.0f;
    }
    *sv = vld1q_f32(s);
    *mv = vld1q_f32(mn);
}

/* One weight row of Q4_0 / Q4_1 / Q8_0 times MR rows of x, four blocks at a time: each block's
 * dot in 4 int32 lanes (two sdots), the four blocks' dots summed to one lane each, then the
 * float work once per four blocks, a block a lane:
 *
 *   acc += s_w * (da * dot)  (+ m_w * fa for Q4_1's minimum)
 *
 * The blocks are decoded once for the MR rows, or taken decoded from pre (two vectors a block)
 * with their scales ps and minimums pm: a prefill chunk's rows run four at a time over one
 * weight row decoded once. The last nb % 4 blocks: one lane sum each. */
static inline __attribute__((always_inline)) void
rows_neon(const int FMT, const uint8_t *wrow, int64_t nb, int64_t k, const int MR,
          const int8_t *qa, const float *da, const float *fa, const int8x16_t *pre,
          const float *ps, const float *pm, float *out) {
    const int64_t nbk = k / 32, bb = FMT == F_Q4_0 ? 18 : FMT == F_Q4_1 ? 20 : 34;
    const int32x4_t z = vdupq_n_s32(0);
    float32x4_t acc[4];
    for (int r = 0; r < MR; r++) acc[r] = vdupq_n_f32(0.0f);
    int64_t b0 = 0;
    for (; b0 + 4 <= nb; b0 += 4) {
        int8x16_t v[8];
        float32x4_t sv, mv = vdupq_n_f32(0.0f);
        if (pre) {
            for (int i = 0; i < 8; i++) v[i] = pre[2 * b0 + i];
            sv = vld1q_f32(ps + b0);
            if (FMT == F_Q4_1) mv = vld1q_f32(pm + b0);
        } else {
            neon_decode4(FMT, wrow, b0, v, &sv, &mv);
        }
        for (int r = 0; r < MR; r++) {
            const int64_t i0 = r * nbk + b0;
            const int8_t *q = qa + 32 * i0;
            int32x4_t d[4];
            for (int i = 0; i < 4; i++)
                d[i] = qg_sdot(qg_sdot(z, v[2 * i], vld1q_s8(q + 32 * i)), v[2 * i + 1],
                               vld1q_s8(q + 32 * i + 16));
            const float32x4_t t = vmulq_f32(vcvtq_f32_s32(qg_sum4(d[0], d[1], d[2], d[3])),
                                            vld1q_f32(da + i0));
            acc[r] = vfmaq_f32(acc[r], t, sv);
            if (FMT == F_Q4_1) acc[r] = vfmaq_f32(acc[r], mv, vld1q_f32(fa + i0));
        }
    }
    float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (; b0 < nb; b0++) {
        const uint8_t *blk = wrow + b0 * bb;
        const float s = half_to_float(blk), mn = FMT == F_Q4_1 ? half_to_float(blk + 2) : 0.0f;
        int8x16_t v[2];
        neon_decode1(FMT, blk, v);
        for (int r = 0; r < MR; r++) {
            const int64_t i = r * nbk + b0;
            const int dot = vaddvq_s32(qg_sdot(qg_sdot(z, v[0], vld1q_s8(qa + 32 * i)), v[1],
                                               vld1q_s8(qa + 32 * i + 16)));
            tail[r] += s * (da[i] * (float)dot) + mn * fa[i];
        }
    }
    for (int r = 0; r < MR; r++) out[r] = vaddvq_f32(acc[r]) + tail[r];
}

/* rows_neon with constant format and row count (1, 2 or 4). */
static void rows_neon_any(int fmt, const uint8_t *wrow, int64_t nb, int64_t k, int mr,
                          const int8_t *qa, const float *da, const float *fa, const int8x16_t *pre,
                          const float *ps, const float *pm, float *out) {
#define ROWS4(FMT)                                                                               \
    switch (mr) {                                                                                \
    case 1: rows_neon(FMT, wrow, nb, k, 1, qa, da, fa, pre, ps, pm, out); break;                 \
    case 2: rows_neon(FMT, wrow, nb, k, 2, qa, da, fa, pre, ps, pm, out); break;                 \
    default: rows_neon(FMT, wrow, nb, k, 4, qa, da, fa, pre, ps, pm, out); break;                \
    }
    switch (fmt) {
    case F_Q4_0: ROWS4(F_Q4_0) break;
    case F_Q4_1: ROWS4(F_Q4_1) break;
    default: ROWS4(F_Q8_0) break;
    }
#undef ROWS4
}

/* The first nb / 4 * 4 blocks of a weight row decoded for rows_neon (pre, ps, pm). */
static void neon_decode_row(int fmt, const uint8_t *wrow, int64_t nb, int8x16_t *pre, float *ps,
                            float *pm) {
    for (int64_t b0 = 0; b0 + 4 <= nb; b0 += 4) {
        float32x4_t sv, mv;
        switch (fmt) {
        case F_Q4_0: neon_decode4(F_Q4_0, wrow, b0, pre + 2 * b0, &sv, &mv); break;
        case F_Q4_1: neon_decode4(F_Q4_1, wrow, b0, pre + 2 * b0, &sv, &mv); break;
        default: neon_decode4(F_Q8_0, wrow, b0, pre + 2 * b0, &sv, &mv); break;
        }
        vst1q_f32(ps + b0, sv);
        vst1q_f32(pm + b0, mv);
    }
}

/* quant_gemm_share's rows [j0, j1) on NEON, up to 4 rows of x a pass. More than 4 rows: a
 * panel of weight rows decoded at a time (q4_0_panels' order: each 4 rows of x over the
 * whole panel), or per pass where the panel could not be had. */
static void neon_share(int fmt, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1,
                       int64_t k, int64_t m, const int8_t *qa, const float *da, const float *fa,
                       float *y, int64_t ldy) {
    const int64_t nb = k / 32, nb4 = nb / 4 * 4, nbk = k / 32;
    int64_t rows = panel_rows(nb4 * 40, m, k, j0, j1);
    /* a panel row: 2 vectors a block (pre), its scales (ps) and minimums (pm) a float each */
    int8x16_t *pre = m > 4 && nb4 ? malloc(sizeof(int8x16_t) * (size_t)(2 * rows * nb4)) : NULL;
    float *ps = pre ? malloc(sizeof(float) * (size_t)(rows * nb4)) : NULL;
    float *pm = ps ? malloc(sizeof(float) * (size_t)(rows * nb4)) : NULL;
    if (!pm) { free(pre); free(ps); pre = NULL; rows = 1; }
    float out[4];
    for (int64_t p0 = j0; p0 < j1; p0 += rows) {
        const int64_t pe = p0 + rows < j1 ? p0 + rows : j1;
        for (int64_t j = p0; pre && j < pe; j++)
            neon_decode_row(fmt, w + j * row_bytes, nb, pre + 2 * (j - p0) * nb4,
                            ps + (j - p0) * nb4, pm + (j - p0) * nb4);
        for (int64_t r0 = 0; r0 < m;) {
            const int mr = m - r0 >= 4 ? 4 : m - r0 >= 2 ? 2 : 1;
            for (int64_t j = p0; j < pe; j++) {
                const int64_t o = (j - p0) * nb4;
                rows_neon_any(fmt, w + j * row_bytes, nb, k, mr, qa + r0 * k, da + r0 * nbk,
                              fa + r0 * nbk, pre ? pre + 2 * o : NULL, pre ? ps + o : NULL,
                              pre ? pm + o : NULL, out);
                for (int r = 0; r < mr; r++) y[(r0 + r) * ldy + j] = out[r];
            }
            r0 += mr;
        }
    }
    free(pre);
    free(ps);
    free(pm);
}
#endif

/* quant_gemm's work for the calling thread of the enclosing team (its share of the weight
 * rows; no barrier): quant_layer.c runs a layer's products in one parallel region. The format
 * and k are the caller's to check (quant_gemm does). */
void quant_gemm_share(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                      int64_t m, const int8_t *qa, const float *da, const float *fa,
                      const int32_t *ns, float *y, int64_t ldy, int path) {
    const int64_t nb = k / 32, nbk = k / 32;
    const int fast = QG_VEC && path == 0;
    /* Q4_0 / Q8_0 on the fast path: groups of 16 weight rows (quant_gemm_16.c), the rest one by one */
    const int64_t n16 = QG_512 && fast && (fmt == F_Q4_0 || fmt == F_Q8_0) ? n / 16 * 16 : 0;
    (void)ns;
    {
        const int64_t t = kernel_thread(), team = kernel_team();
#if QG_512
        if (n16) c16_groups(fmt, w, row_bytes, n16 / 16 * t / team, n16 / 16 * (t + 1) / team, k, m,
                            qa, da, ns, y, ldy);
#endif
        int64_t j0 = n16 + (n - n16) * t / team;
        const int64_t j1 = n16 + (n - n16) * (t + 1) / team;
        float out[8];
#if QG_NEON
        if (fast) {
            neon_share(fmt, w, row_bytes, j0, j1, k, m, qa, da, fa, y, ldy);
            j0 = j1; /* done */
        }
#endif
#if QG_FAST
#if !QG_512
        /* eight blocks at a time, up to 4 rows of x: Q4_0 always, Q8_0 for a decode's one row
         * (more rows of it ran faster below: 7.0 against 8.4 ms at 16 rows, 51 against 62 at
         * 144, [8192 x 2048], one thread; the flipped activations cost one vpsignb a row) */
        if (fast && (fmt == F_Q4_0 || (fmt == F_Q8_0 && m == 1))) {
            /* more than 4 rows of Q4_0: panels of weight rows decoded once for all of them */
            if (!(fmt == F_Q4_0 && m > 4 && q4_0_panels(w, row_bytes, j0, j1, k, m, qa, da, fa,
                                                        ns, y, ldy)))
                for (int64_t j = j0; j < j1; j++)
                    for (int64_t r0 = 0; r0 < m;) {
                        const int mr = m - r0 >= 4 ? 4 : m - r0 >= 2 ? 2 : 1;
                        rows8_any(fmt, w + j * row_bytes, nb, k, mr, qa + r0 * k, da + r0 * nbk,
                                  fa + r0 * nbk, ns + 8 * r0 * nbk, NULL, NULL, out);
                        for (int r = 0; r < mr; r++) y[(r0 + r) * ldy + j] = out[r];
                        r0 += mr;
                    }
            j0 = j1;
        }
#endif
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
}

/* y[r * ldy + j] = sum_i x_r[i] w_j[i] for the m rows of x quantized by quant_act and the n
 * rows of w (row_bytes each; Q4_0, Q4_1 or Q8_0). path 1: the portable code. Returns -1 for
 * another format (the K formats: quant_gemm_k) or a k the blocks do not divide. */
int quant_gemm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, int64_t m,
               const int8_t *qa, const float *da, const float *fa, const int32_t *ns, float *y,
               int64_t ldy, int nthreads, int path) {
    const int64_t bv = quant_block_values(fmt);
    if (bv != 32 || k % bv) return -1;
#pragma omp parallel num_threads(kernel_threads(nthreads, n / 8))
    quant_gemm_share(fmt, w, row_bytes, n, k, m, qa, da, fa, ns, y, ldy, path);
    return 0;
}

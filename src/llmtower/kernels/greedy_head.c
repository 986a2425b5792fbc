/* Greedy tokens from the output layer without reading all of it: an int8 screen, then exact
 * logits for the few rows that could be the maximum.
 *
 * A greedy step needs only argmax(h @ W.T) of each sampled row h, not the logits. W (the output
 * layer, [V, K]; 49152 x 576 on SmolLM2) is the largest matrix a decode step reads: 56.6 MB of
 * SmolLM2's 274 in bfloat16, 113 MB of 540 in float32. Here a step reads an int8 copy of it
 * (28.3 MB) and a bound on every row's error, keeps the rows whose logit could reach the
 * largest lower bound, and computes those rows exactly, with the very code and packed weights
 * the full output layer uses (gemv_bf16_tiles.h's tiles, gemm_f32's panels). The token is then
 * the one the full logits would give, bit for bit, ties included (the first index).
 *
 * The int8 copy, laid out as gemv_bf16 lays bfloat16 out (tile t of 64 output rows, input
 * pair p; zero past V and K; greedy_head.py packs it):
 *
 *   tile 0                               tile 1
 *   | p=0: w[0,0] w[0,1] w[1,0] .. w[63,1] | p=1: .. | ... | p=0: w[64,0] ..
 *   |<------------- 128 bytes ------------>|
 *
 * Per row v of W: s_v = max|w_v| / 127, q_v = round(w_v / s_v), e_v = w_v - s_v q_v. The
 * screen quantizes h to 15-bit integers, h = s_h r + d, and sums q_v . r exactly in int32
 * (vec.h's vi_dot_pairs: the int8 weights widened to int16, two products per lane; vpdpwssd
 * with VNNI, vpmaddwd on AVX2, NEON's widening multiplies). Then
 *
 *   w_v . h = s_v s_h (q_v . r) + s_v (q_v . d) + e_v . h
 *   |w_v . h - s_v s_h (q_v . r)| <= s_v |q_v| |d| + |e_v| |h|          (Cauchy-Schwarz)
 *
 * and the kernel's float32 sum y_v differs from w_v . h by at most gamma_K |w_v| |h| (K
 * roundings). The per-row constants (s_v, |e_v| + gamma_K |w_v|, s_v |q_v|) are computed at
 * load in float64 and rounded up. Measured on SmolLM2 (1,024 decode rows of chat and random
 * prompts, bfloat16): the bound is ~1.9 logits wide on average, the true error at most a fifth
 * of it, and the rows left to compute exactly number 1 (median), 10 (p90), 481 (max) of 49,152.
 *
 * A row whose h is not finite, whose bounds are not (logits past float32's range), or with
 * more candidates than the caller's cap is left to the full output layer (token -1).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "gemv_bf16_tiles.h" /* TILE (64), tile_sums: the bfloat16 output layer's own code */
#include "gemm_f32_panels.h" /* F32_NP (32): the float32 output layer's panels */
/* the screen's pair products on vec.h's integer layer (AVX-512 BW / VNNI, AVX2 / AVX-VNNI,
 * NEON); the epilogue's float32 work on its float one */
#if VI_FAST && VEC_FAST
#define SCREEN_FAST 1
#else
#define SCREEN_FAST 0
#endif

#define MAX_ROWS 256     /* rows per call: a decode step of the products' kernels */
#define SCREEN_CHUNK 4   /* rows screened together per tile */
#define SCREEN_VECS (TILE / VEC_LANES) /* vectors of int32 sums per row of a tile */
#if defined(__AVX512F__) || defined(__aarch64__)
#define SCREEN_REGS 32   /* vector registers */
#else
#define SCREEN_REGS 16
#endif

/* The bfloat16 screen's exact pass reads the output layer's gemv tiles, whose portable code
 * runs where AVX512_BF16 is missing (a bfloat16 head has those tiles only where gemv_bf16 is
 * on, models/layers/head.py); the float32 one needs the float panels' vector code. */
int greedy_head_fast(void) { return SCREEN_FAST && F32_FAST; }
/* Rows a call takes: all of a decode step's. With AVX2's vpmaddwd + vpaddd (no VNNI) a pair
 * product costs as many instructions as a float32 FMA per product, but two integer pipes and
 * the halved weight read still beat the float32 layer at every row count: measured at v3 (two
 * threads, SmolLM2's head, screen_avx2_4): 1.55x at 8 rows, 1.39x at 32, 1.37x at 64, 1.34x
 * at 128, 1.64x at 256 (it stopped at 32 rows while gcc's register copies slowed the loop). */
int greedy_head_max_rows(void) { return MAX_ROWS; }

/* ------------------------------------------------------------------ the screen */

/* int32 sums q_v . r of `rows` rows against tile `tile`: acc[r * TILE + c]. */
static void screen_portable(const int16_t *r16, int64_t pairs, int rows, const int8_t *tile,
                            int32_t *acc) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < TILE; c++) {
            int32_t s = 0;
            const int16_t *x = r16 + r * pairs * 2;
            for (int64_t p = 0; p < pairs; p++) {
                const int8_t *w = tile + (p * TILE + c) * 2;
                s += (int32_t)w[0] * x[2 * p] + (int32_t)w[1] * x[2 * p + 1];
            }
            acc[r * TILE + c] = s;
        }
}

#if SCREEN_FAST
/* Vectors of a tile's columns per pass for ROWS rows: the most (a power of two) whose
 * accumulators, weights (kept for the next row where there is one) and broadcast all stay in
 * registers (AVX-512: the whole tile, 4 x 4 + 4 + 1; AVX2: all 8 of its vectors for one row, 4
 * or 2 for more, the tile then read from cache again per pass). */
static inline int screen_pass_vecs(const int ROWS) {
    int cv = SCREEN_VECS;
    while (cv > 1 && cv * ROWS + (ROWS > 1 ? cv : 1) + 1 > SCREEN_REGS) cv /= 2;
    return cv;
}

static inline __attribute__((always_inline)) void screen_fast(
        const int16_t *r16, int64_t pairs, const int ROWS, const int8_t *tile, int32_t *acc) {
    const int CV = screen_pass_vecs(ROWS);
    const uint32_t *x32[SCREEN_CHUNK];
    for (int r = 0; r < ROWS; r++) x32[r] = (const uint32_t *)(const void *)(r16 + r * pairs * 2);
    for (int v0 = 0; v0 < SCREEN_VECS; v0 += CV) {
        /* fixed sizes (no VLAs): they stay in registers */
        vi a[SCREEN_CHUNK][SCREEN_VECS];
        for (int r = 0; r < ROWS; r++)
            for (int b = 0; b < CV; b++) a[r][b] = vi_zero();
        for (int64_t p = 0; p < pairs; p++) {
            const int8_t *wp = tile + p * TILE * 2 + v0 * VEC_LANES * 2;
            vw w[SCREEN_VECS];
            for (int b = 0; b < CV; b++) w[b] = vw_load_i8(wp + 2 * VEC_LANES * b);
            for (int r = 0; r < ROWS; r++) {
                const vw xb = vw_set1_pair(x32[r][p]);
                for (int b = 0; b < CV; b++) a[r][b] = vi_dot_pairs(a[r][b], w[b], xb);
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int b = 0; b < CV; b++) vi_store(acc + r * TILE + (v0 + b) * VEC_LANES, a[r][b]);
    }
}
#endif

#if SCREEN_FAST && defined(__AVX2__) && !defined(__AVX512F__)
/* screen_fast for 4 rows on AVX2, its 8 accumulators (4 rows x 2 vectors of a pass) named
 * one by one: gcc kept screen_fast's array in registers but shuffled it through ~9 register
 * copies and a stack store per pair, ~35 instructions where these 26 do (measured at v3, 64
 * rows, one thread: 25.8 -> 23.9 ms a call). Same sums, same order. */
static void screen_avx2_4(const int16_t *r16, int64_t pairs, const int8_t *tile, int32_t *acc) {
    const int32_t *x0 = (const int32_t *)(const void *)r16;
    const int32_t *x1 = x0 + pairs, *x2 = x1 + pairs, *x3 = x2 + pairs;
    for (int v0 = 0; v0 < SCREEN_VECS; v0 += 2) {
        __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00;
        __m256i a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        const int8_t *wp = tile + v0 * VEC_LANES * 2;
        for (int64_t p = 0; p < pairs; p++, wp += TILE * 2) {
            const __m256i w0 = vw_load_i8(wp), w1 = vw_load_i8(wp + 2 * VEC_LANES);
            __m256i x = _mm256_set1_epi32(x0[p]);
            a00 = vi_dot_pairs(a00, w0, x);
            a01 = vi_dot_pairs(a01, w1, x);
            x = _mm256_set1_epi32(x1[p]);
            a10 = vi_dot_pairs(a10, w0, x);
            a11 = vi_dot_pairs(a11, w1, x);
            x = _mm256_set1_epi32(x2[p]);
            a20 = vi_dot_pairs(a20, w0, x);
            a21 = vi_dot_pairs(a21, w1, x);
            x = _mm256_set1_epi32(x3[p]);
            a30 = vi_dot_pairs(a30, w0, x);
            a31 = vi_dot_pairs(a31, w1, x);
        }
        int32_t *o = acc + v0 * VEC_LANES;
        vi_store(o, a00);
        vi_store(o + VEC_LANES, a01);
        vi_store(o + TILE, a10);
        vi_store(o + TILE + VEC_LANES, a11);
        vi_store(o + 2 * TILE, a20);
        vi_store(o + 2 * TILE + VEC_LANES, a21);
        vi_store(o + 3 * TILE, a30);
        vi_store(o + 3 * TILE + VEC_LANES, a31);
    }
}
#define SCREEN_AVX2_4 1
#else
#define SCREEN_AVX2_4 0
#endif

static void screen_tile(const int16_t *r16, int64_t pairs, int rows, const int8_t *tile,
                        int32_t *acc, int fast) {
#if SCREEN_FAST
    if (fast) {
#if SCREEN_AVX2_4
        if (rows >= 4) { screen_avx2_4(r16, pairs, tile, acc); return; }
#endif
        switch (rows) {
        case 1: screen_fast(r16, pairs, 1, tile, acc); return;
        case 2: screen_fast(r16, pairs, 2, tile, acc); return;
        case 3: screen_fast(r16, pairs, 3, tile, acc); return;
        default: screen_fast(r16, pairs, 4, tile, acc); return;
        }
    }
#endif
    (void)fast;
    screen_portable(r16, pairs, rows, tile, acc);
}

/* One sampled row's quantized input and the terms of its bound (float32 copies for the
 * screen's epilogue, each rounded up). */
typedef struct {
    double s_h;     /* h ~ s_h * r */
    double h_norm;  /* |h|, rounded up */
    double d_norm;  /* |h - s_h r|, rounded up */
    double tiny;    /* what no relative term covers: flushed denormals */
    float sf, hf, df, tf; /* s_h, h_norm, d_norm, tiny as float32 (the last three rounded up) */
    float lower;    /* the largest lower bound over the vocabulary */
} RowScreen;

static inline double up(double v) { return v * (1.0 + 1e-12) + 1e-300; }

static inline float up_f(double v) {
    float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

/* The epilogue of one screened row over columns [c0, c0 + n): from the int32 sums, each
 * column's interval [lo, hi] around its logit; hi into `upper`, the largest lo returned.
 * `allow` (or NULL: every column): the row's grammar bitmask, bit v of word v / 32 set where
 * token v is allowed; a disallowed column's logit is -inf, as apply_token_bitmask makes it.
 * In float32 with slack for its roundings: center c = acc * (s_v * s_h) carries at most ~3
 * roundings (2^-22 |c|), rad = (a h + b d + tiny) three more, hi and lo one each; RAD_SLACK
 * and CENTER_SLACK cover them many times over, so hi and lo bound the float64 interval. */
#define RAD_SLACK (1.0f + 0x1p-16f)
#define CENTER_SLACK 0x1p-16f
static float epilogue(const int32_t *acc, const float *cs_s, const float *cs_a, const float *cs_b,
                      const RowScreen *rs, int64_t n, float *upper, float lower,
                      const uint32_t *allow, int64_t c0, int fast) {
    int64_t c = 0;
#if SCREEN_FAST && defined(__AVX512F__)
    if (fast) {
        const __m512 sh = _mm512_set1_ps(rs->sf), hn = _mm512_set1_ps(rs->hf);
        const __m512 dn = _mm512_set1_ps(rs->df), tn = _mm512_set1_ps(rs->tf);
        const __m512 rs_k = _mm512_set1_ps(RAD_SLACK), cs_k = _mm512_set1_ps(CENTER_SLACK);
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        __m512 lo_max = ninf;
        for (; c + 16 <= n; c += 16) {
            __m512 cen = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + c)),
                                       _mm512_mul_ps(_mm512_loadu_ps(cs_s + c), sh));
            __m512 rad = _mm512_fmadd_ps(_mm512_loadu_ps(cs_a + c), hn,
                                         _mm512_fmadd_ps(_mm512_loadu_ps(cs_b + c), dn, tn));
            rad = _mm512_fmadd_ps(_mm512_abs_ps(cen), cs_k, _mm512_mul_ps(rad, rs_k));
            __m512 hi = _mm512_add_ps(cen, rad), lo = _mm512_sub_ps(cen, rad);
            if (allow) { /* c0 + c is a multiple of 16: its 16 bits sit in one word */
                const int64_t col = c0 + c;
                const __mmask16 keep = (__mmask16)(allow[col >> 5] >> (col & 31));
                hi = _mm512_mask_mov_ps(ninf, keep, hi);
                lo = _mm512_mask_mov_ps(ninf, keep, lo);
            }
            _mm512_storeu_ps(upper + c, hi);
            lo_max = _mm512_max_ps(lo_max, lo);
        }
        lower = fmaxf(lower, _mm512_reduce_max_ps(lo_max));
    }
#elif SCREEN_FAST && defined(__AVX2__)
    /* the same on 8 lanes; a bitmask's 8 bits become lane masks by a test against each lane's
     * own bit. Without it the masked columns took the scalar loop below, ~15 instructions a
     * column: at 64 rows (every row masked while min_tokens holds EOS back) more than the
     * screen itself saved. */
    if (fast && allow) {
        const __m256 sh = _mm256_set1_ps(rs->sf), hn = _mm256_set1_ps(rs->hf);
        const __m256 dn = _mm256_set1_ps(rs->df), tn = _mm256_set1_ps(rs->tf);
        const __m256 rs_k = _mm256_set1_ps(RAD_SLACK), cs_k = _mm256_set1_ps(CENTER_SLACK);
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        __m256 lo_max = ninf;
        for (; c + 8 <= n; c += 8) {
            const __m256 cen = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(acc + c))),
                _mm256_mul_ps(_mm256_loadu_ps(cs_s + c), sh));
            __m256 rad = _mm256_fmadd_ps(_mm256_loadu_ps(cs_a + c), hn,
                                         _mm256_fmadd_ps(_mm256_loadu_ps(cs_b + c), dn, tn));
            rad = _mm256_fmadd_ps(_mm256_and_ps(cen, abs_mask), cs_k, _mm256_mul_ps(rad, rs_k));
            /* c0 + c is a multiple of 8: its 8 bits sit in one word */
            const int64_t col = c0 + c;
            const __m256i bits = _mm256_set1_epi32((int)((allow[col >> 5] >> (col & 31)) & 0xffu));
            const __m256 keep = _mm256_castsi256_ps(
                _mm256_cmpeq_epi32(_mm256_and_si256(bits, lane_bit), lane_bit));
            const __m256 hi = _mm256_blendv_ps(ninf, _mm256_add_ps(cen, rad), keep);
            const __m256 lo = _mm256_blendv_ps(ninf, _mm256_sub_ps(cen, rad), keep);
            _mm256_storeu_ps(upper + c, hi);
            lo_max = _mm256_max_ps(lo_max, lo);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(lo_max), _mm256_extractf128_ps(lo_max, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        lower = fmaxf(lower, _mm_cvtss_f32(m4));
    }
#endif
    (void)fast;
    if (!allow) { /* the same steps in a loop the compiler vectorizes (a maximum is order-free) */
        float lo_max = lower;
#pragma omp simd reduction(max : lo_max)
        for (int64_t i = c; i < n; i++) {
            const float cen = (float)acc[i] * (cs_s[i] * rs->sf);
            float rad = fmaf(cs_a[i], rs->hf, fmaf(cs_b[i], rs->df, rs->tf));
            rad = fmaf(fabsf(cen), CENTER_SLACK, rad * RAD_SLACK);
            upper[i] = cen + rad;
            const float lo = cen - rad;
            lo_max = lo > lo_max ? lo : lo_max;
        }
        return lo_max;
    }
    for (; c < n; c++) {
        if (allow && !((allow[(c0 + c) >> 5] >> ((c0 + c) & 31)) & 1u)) {
            upper[c] = -INFINITY;
            continue;
        }
        float cen = (float)acc[c] * (cs_s[c] * rs->sf);
        float rad = fmaf(cs_a[c], rs->hf, fmaf(cs_b[c], rs->df, rs->tf));
        rad = fmaf(fabsf(cen), CENTER_SLACK, rad * RAD_SLACK);
        upper[c] = cen + rad;
        lower = fmaxf(lower, cen - rad);
    }
    return lower;
}

/* x row (bfloat16 or float32) -> r (int16 pairs, zero-padded) and its terms; 0 if not finite. */
static int quantize_row(const void *x, int bf16, int64_t k, int64_t pairs, int16_t *r,
                        RowScreen *rs) {
    double amax = 0.0, hh = 0.0;
    for (int64_t i = 0; i < k; i++) {
        double v = bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        if (!isfinite(v)) return 0;
        amax = fmax(amax, fabs(v));
        hh += v * v;
    }
    /* |q_v . r| <= K * 127 * r_max must fit int32 (the sum is exact, partial sums included) */
    int64_t r_max = (INT32_MAX / 127) / (pairs * 2);
    if (r_max > 16383) r_max = 16383;
    if (r_max < 1) return 0;
    /* a float32 scale (the screen's epilogue multiplies by it), so h - s_h r is exact below */
    const double s_h = amax > 0.0 ? (double)(float)(amax / (double)r_max) : 1.0;
    if (!(s_h >= FLT_MIN)) return 0;
    double dd = 0.0;
    for (int64_t i = 0; i < pairs * 2; i++) {
        double v = i < k ? (bf16 ? bf16_to_f32(((const uint16_t *)x)[i])
                                 : ((const float *)x)[i]) : 0.0;
        double q = nearbyint(v / s_h);
        if (q > (double)r_max) q = (double)r_max;
        if (q < -(double)r_max) q = -(double)r_max;
        r[i] = (int16_t)q;
        double d = v - s_h * q;
        dd += d * d;
    }
    rs->s_h = s_h;
    rs->h_norm = up(sqrt(hh));
    /* s_h * q is rounded in float64: 1e-15 of |h| per element covers it */
    rs->d_norm = up(sqrt(dd)) + 1e-15 * rs->h_norm * sqrt((double)k);
    rs->tiny = 1e-30 * (1.0 + rs->h_norm) * (double)k;
    rs->sf = (float)s_h;
    rs->hf = up_f(rs->h_norm);
    rs->df = up_f(rs->d_norm);
    rs->tf = up_f(rs->tiny);
    rs->lower = -INFINITY;
    return 1;
}

/* ------------------------------------------------------------------ exact candidates */

/* The bfloat16 output layer's logit for output rows `cand` [nc] (ascending) of row x: the
 * tiles holding them, summed by gemv's tile code, rounded to bfloat16 as gemv rounds. */
static void exact_bf16(const uint16_t *x, int64_t k, const uint16_t *wp, const int64_t *cand,
                       int64_t nc, float *val) {
    const int64_t tile_numel = ((k + 1) / 2) * TILE * 2;
    float acc[TILE];
    int64_t cur = -1;
    for (int64_t i = 0; i < nc; i++) {
        const int64_t t = cand[i] / TILE;
        if (t != cur) {
            tile_sums(x, k, 1, wp + t * tile_numel, k, acc, HAVE_FAST);
            cur = t;
        }
        val[i] = bf16_to_f32(f32_to_bf16(acc[cand[i] % TILE]));
    }
}

/* The float32 output layer's logit for output rows `cand` of row x: gemm_f32's one float32
 * accumulator per output, k in order, fused multiply-adds (a lane per column, so the vector
 * and the scalar code give the same sums). */
static void exact_f32(const float *x, int64_t k, const float *wp, const int64_t *cand,
                      int64_t nc, float *val) {
    float acc[F32_NP];
    int64_t cur = -1;
    for (int64_t i = 0; i < nc; i++) {
        const int64_t p = cand[i] / F32_NP;
        if (p != cur) {
            const float *panel = wp + p * k * F32_NP;
#if F32_FAST
            f32_tile_fast(x, k, 1, panel, k, acc, NULL, 0, NULL, 0);
#else
            for (int c = 0; c < F32_NP; c++) {
                float s = 0.0f;
                for (int64_t kk = 0; kk < k; kk++) s = fmaf(x[kk], panel[kk * F32_NP + c], s);
                acc[c] = s;
            }
#endif
            cur = p;
        }
        val[i] = acc[cand[i] % F32_NP];
    }
}

/* Bounds u[v0 .. v1) against thr: each at or above it appended to cr (nc of cap); 1 where
 * the row is "over" (an infinite or NaN bound, or more candidates than cap), else 0. */
static int scan_bounds(const float *u, int64_t v0, int64_t v1, float thr, int64_t *cr,
                       int64_t *nc, int64_t cap) {
    for (int64_t v = v0; v < v1; v++) {
        if (isnan(u[v]) || u[v] == INFINITY) return 1;
        if (u[v] >= thr) {
            if (*nc == cap) return 1;
            cr[(*nc)++] = v;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ the call */

/* x [m, k] (row stride x_stride; bfloat16 if bf16 else float32), m <= MAX_ROWS.
 * qp: the int8 copy (tile layout above); cs [3, n rounded up to 64]: s_v, then
 * |e_v| + gamma_K |w_v|, then s_v |q_v| (zero past n).
 * wp: the output layer's own packed weights (gemv_bf16 tiles or gemm_f32 panels).
 * upper: scratch [m, n]; cand [m, cap] and cand_val [m, cap]: each row's candidates and their
 * exact logits (first num_cand[r]); tokens [m]: the greedy token, or -1 (the full layer must
 * decide this row). allow [m, allow_words] (or NULL): each row's grammar bitmask (all ones for
 * a row without a grammar); allow_words must cover n. path: 0 fast where compiled in, 1
 * portable (tests compare them). Returns 0, or 1 on bad sizes. */
int greedy_head_tokens(const void *x, int64_t m, int64_t x_stride, int bf16, const int8_t *qp,
                       const float *cs, const void *wp, int64_t n, int64_t k, float *upper,
                       int64_t *cand, float *cand_val, int64_t cap, int64_t *num_cand,
                       int64_t *tokens, const uint32_t *allow, int64_t allow_words,
                       int num_threads, int path) {
    if (m < 1 || m > MAX_ROWS || n <= 0 || k <= 0 || cap < 1 || x_stride < k
            || (allow && allow_words * 32 < n))
        return 1;
    const int64_t pairs = (k + 1) / 2, tiles = (n + TILE - 1) / TILE, n_pad = tiles * TILE;
    const int fast = SCREEN_FAST && path == 0;
    const size_t es = bf16 ? 2 : 4;
    int16_t *r16 = malloc(sizeof(int16_t) * (size_t)(m * pairs * 2));
    if (!r16) return -1;
    RowScreen rs[MAX_ROWS];
    int ok[MAX_ROWS];
    /* rows that screen: the rest go to the full layer */
    int64_t live[MAX_ROWS], nl = 0;
    for (int64_t r = 0; r < m; r++) {
        const void *xr = (const char *)x + (size_t)(r * x_stride) * es;
        ok[r] = quantize_row(xr, bf16, k, pairs, r16 + nl * pairs * 2, &rs[r]);
        num_cand[r] = 0;
        tokens[r] = -1;
        if (ok[r]) live[nl++] = r;
    }
    if (nl) {
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
        {
            float lower[MAX_ROWS];
            for (int64_t j = 0; j < nl; j++) lower[j] = -INFINITY;
            int32_t acc[SCREEN_CHUNK * TILE];
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t c0 = t * TILE, c_end = n - c0 < TILE ? n - c0 : TILE;
                for (int64_t j0 = 0; j0 < nl; j0 += SCREEN_CHUNK) {
                    int rows = (int)(nl - j0 < SCREEN_CHUNK ? nl - j0 : SCREEN_CHUNK);
                    screen_tile(r16 + j0 * pairs * 2, pairs, rows, qp + c0 * pairs * 2, acc, fast);
                    for (int j = 0; j < rows; j++) {
                        const int64_t r = live[j0 + j];
                        lower[j0 + j] = epilogue(acc + j * TILE, cs + c0, cs + n_pad + c0,
                                                 cs + 2 * n_pad + c0, &rs[r], c_end,
                                                 upper + r * n + c0, lower[j0 + j],
                                                 allow ? allow + r * allow_words : NULL, c0,
                                                 fast);
                    }
                }
            }
#pragma omp critical
            for (int64_t j = 0; j < nl; j++) rs[live[j]].lower = fmaxf(rs[live[j]].lower, lower[j]);
        }
    }
    free(r16);
    for (int64_t j = 0; j < nl; j++) {
        const int64_t r = live[j];
        const double lo = (double)rs[r].lower;
        if (!isfinite(lo)) continue;
        /* A row whose logit is below lo - margin rounds (bfloat16: to the nearest of 8
         * significant bits) strictly below the maximum's rounding: it is not the argmax. */
        const double margin = ldexp(fabs(lo), -6) + rs[r].tiny;
        const float thr = (float)(lo - margin);
        const float thr_lo = (double)thr > lo - margin ? nextafterf(thr, -INFINITY) : thr;
        const float *u = upper + r * n;
        int64_t *cr = cand + r * cap, nc = 0;
        int over = 0;
        /* A NaN or +inf upper bound (a logit past float32's range) proves nothing: the full
         * layer decides such a row ("over"). */
        int64_t v = 0;
#if SCREEN_FAST && defined(__AVX512F__)
        const __m512 tv = _mm512_set1_ps(thr_lo), inf = _mm512_set1_ps(INFINITY);
        for (; v + 16 <= n && !over; v += 16) {
            const __m512 uv = _mm512_loadu_ps(u + v);
            if (_mm512_cmp_ps_mask(uv, uv, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(uv, inf, _CMP_EQ_OQ)) {
                over = 1;
                break;
            }
            uint32_t mask = _mm512_cmp_ps_mask(uv, tv, _CMP_GE_OQ);
            for (; mask; mask &= mask - 1) {
                if (nc == cap) { over = 1; break; }
                cr[nc++] = v + __builtin_ctz(mask);
            }
        }
#else
        /* 64 bounds at a time through a loop the compiler vectorizes: only a chunk holding a
         * candidate, an infinity or a NaN (!(u < thr) for each) is looked at one by one */
        for (; v + 64 <= n && !over; v += 64) {
            int hit = 0;
#pragma omp simd reduction(| : hit)
            for (int i = 0; i < 64; i++) hit |= !(u[v + i] < thr_lo);
            if (hit) over = scan_bounds(u, v, v + 64, thr_lo, cr, &nc, cap);
        }
#endif
        if (!over) over = scan_bounds(u, v, n, thr_lo, cr, &nc, cap);
        if (over || nc == 0) continue;
        float *val = cand_val + r * cap;
        const void *xr = (const char *)x + (size_t)(r * x_stride) * es;
        if (bf16) exact_bf16(xr, k, wp, cr, nc, val);
        else exact_f32(xr, k, wp, cr, nc, val);
        num_cand[r] = nc;
        int64_t best = 0;
        int bad = 0;
        for (int64_t i = 0; i < nc; i++) {
            if (isnan(val[i])) { bad = 1; break; }
            if (val[i] > val[best]) best = i;
        }
        if (!bad) tokens[r] = cr[best];
    }
    return 0;
}

/* Checks the GGUF block products (quant_gemm.c, quant_gemm_k.c, and whichever path they take for
 * the ISA they are compiled for: the NEON bodies on aarch64, the AVX2 / AVX-512 ones on x86) on
 * random blocks of every format:
 *
 * - the activations' int8 forms (quant_act per 32 values, quant_act_k per 256, in both orders)
 *   against a scalar recomputation (lrintf), exactly;
 * - the fast path (path 0) and the portable one (path 1) against a float64 reference: the
 *   dequantized weights (quant_dequant, gguf's values) times the activations as quantized
 *   (qa * da), within 1e-5 of the sum of |w| |a| (the integer sums are exact; only the float
 *   work's order differs), for 1 to 17 rows of x (the row groups, the decoded-row reuse of a
 *   prefill chunk and their tails), block counts that leave tails, 1 and 2 threads, and
 *   chunks whose activations overflow L1 over several panels of decoded weight rows;
 * - Q8_0 weights of -128 and 127 against activations of 127 (sums that saturate int16 pairs).
 *
 * Built with the kernels' own sources (test_isa_levels.py: for aarch64 under qemu, where the
 * Python kernel tests cannot run). Prints one line per failure and "failures=N"; exits 1 on any. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int quant_gemm_fast(void);
int64_t quant_block_values(int fmt);
int64_t quant_block_bytes(int fmt);
int quant_dequant(int fmt, const uint8_t *w, int64_t row_bytes, int64_t nrows, int64_t k,
                  const int64_t *rows, float *out, int nthreads);
void quant_act(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *qa, float *da,
               float *fa, int32_t *ns);
void quant_act_k(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *qa, float *da,
                 int16_t *bs, int nibble_order);
int quant_gemm(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, int64_t m,
               const int8_t *qa, const float *da, const float *fa, const int32_t *ns, float *y,
               int64_t ldy, int nthreads, int path);
int quant_gemm_k(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, int64_t m,
                 const int8_t *qa, const float *da, const int16_t *bs, float *y, int64_t ldy,
                 int nthreads, int path);

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
static float rnd(void) { return (float)((double)(next() >> 11) / 9007199254740992.0 * 4.0 - 2.0); }

/* a float16 of magnitude 2^-9 .. 2^-3 (a block scale's range), either sign where `sign` */
static void put_half(uint8_t *p, int sign) {
    const uint16_t h = (uint16_t)(((sign && (next() & 1)) << 15) | ((6 + next() % 7) << 10) |
                                  (next() & 0x3ff));
    memcpy(p, &h, 2);
}

/* n rows of k values of fmt, random bytes with sane float16 fields */
static uint8_t *random_matrix(int fmt, int64_t n, int64_t k, int64_t *row_bytes) {
    const int64_t bv = quant_block_values(fmt), bb = quant_block_bytes(fmt), nb = n * (k / bv);
    *row_bytes = k / bv * bb;
    uint8_t *w = malloc((size_t)(nb * bb));
    for (int64_t i = 0; i < nb * bb; i++) w[i] = (uint8_t)next();
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * bb;
        switch (fmt) {
        case Q4_1: put_half(blk, 1); put_half(blk + 2, 1); break;
        case Q4_K: case Q5_K: put_half(blk, 0); put_half(blk + 2, 0); break;
        case Q6_K: put_half(blk + 208, 1); break;
        default: put_half(blk, 1); break;
        }
    }
    return w;
}

static int failures = 0;

/* where Q4_K / Q5_K's activations keep sub-block g (kq_pos in quant_gemm_k.c) */
static int nibble_pos(int g) { return (g & 4) | ((g & 1) << 1) | ((g >> 1) & 1); }

/* the activations of m rows, quantized, checked against a scalar recomputation; qa * da back
 * as float (in the values' own order) into a */
static void quantize(int fmt, const float *x, int64_t m, int64_t k, int8_t *qa, float *da,
                     float *fa, int32_t *ns, int16_t *bs, double *a) {
    const int kf = fmt >= Q4_K, per = kf ? 256 : 32, order = fmt == Q4_K || fmt == Q5_K;
    if (kf) quant_act_k(x, m, k, k, qa, da, bs, order);
    else quant_act(x, m, k, k, qa, da, fa, ns);
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < k / per; b++) {
            const float *xb = x + r * k + b * per;
            float amax = 0.0f;
            for (int j = 0; j < per; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            const int64_t i = r * (k / per) + b;
            if (da[i] != d) { printf("fmt %d act scale row %ld block %ld\n", fmt, (long)r, (long)b); failures++; }
            int sums[16] = {0};
            for (int j = 0; j < per; j++) {
                const int v = (int)lrintf(xb[j] * id);
                const int g = j / 32, at = kf && order ? 32 * nibble_pos(g) + j % 32 : j;
                if (qa[r * k + b * per + at] != v) {
                    printf("fmt %d act value row %ld index %ld: %d, want %d\n", fmt, (long)r,
                           (long)(b * per + j), qa[r * k + b * per + at], v);
                    failures++;
                }
                sums[at / 16] += v;
                a[r * k + b * per + j] = (double)d * v;
            }
            if (kf) {
                for (int s = 0; s < 16; s++)
                    if (bs[r * (k / 16) + b * 16 + s] != sums[s]) { printf("fmt %d 16-sum\n", fmt); failures++; }
            } else if (ns[8 * i] != -sums[0] || ns[8 * i + 4] != -sums[1] ||
                       fa[i] != d * (float)(sums[0] + sums[1])) {
                printf("fmt %d act sums row %ld block %ld\n", fmt, (long)r, (long)b);
                failures++;
            }
        }
}

static void check(int fmt, int64_t n, int64_t k, int64_t m, int threads, int extremes) {
    int64_t rb;
    uint8_t *w = random_matrix(fmt, n, k, &rb);
    float *x = malloc((size_t)(m * k) * sizeof(float));
    for (int64_t i = 0; i < m * k; i++) x[i] = rnd();
    if (extremes) { /* Q8_0: every weight -128 or 127, activations all +-the block's max */
        for (int64_t b = 0; b < n * (k / 32); b++)
            for (int j = 0; j < 32; j++) w[b * 34 + 2 + j] = (next() & 1) ? 0x80 : 0x7f;
        for (int64_t i = 0; i < m * k; i++) x[i] = (next() & 1) ? 1.0f : -1.0f;
    }
    int8_t *qa = malloc((size_t)(m * k));
    float *da = malloc((size_t)(m * k / 32 + 1) * sizeof(float)), *fa = malloc((size_t)(m * k / 32 + 1) * sizeof(float));
    int32_t *ns = malloc((size_t)(m * k / 4 + 8) * sizeof(int32_t));
    int16_t *bs = malloc((size_t)(m * k / 16 + 1) * sizeof(int16_t));
    double *a = malloc((size_t)(m * k) * sizeof(double));
    quantize(fmt, x, m, k, qa, da, fa, ns, bs, a);
    float *wf = malloc((size_t)(n * k) * sizeof(float)), *y = malloc((size_t)(m * n) * sizeof(float));
    if (quant_dequant(fmt, w, rb, n, k, NULL, wf, 1) != 0) { printf("dequant refused fmt %d\n", fmt); failures++; }
    for (int path = 0; path < 2; path++) {
        const int rc = fmt >= Q4_K ? quant_gemm_k(fmt, w, rb, n, k, m, qa, da, bs, y, n, threads, path)
                                   : quant_gemm(fmt, w, rb, n, k, m, qa, da, fa, ns, y, n, threads, path);
        if (rc != 0) { printf("fmt %d refused\n", fmt); failures++; continue; }
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++) {
                double ref = 0.0, mag = 0.0;
                for (int64_t i = 0; i < k; i++) {
                    ref += (double)wf[j * k + i] * a[r * k + i];
                    mag += fabs((double)wf[j * k + i] * a[r * k + i]);
                }
                const double got = y[r * n + j];
                if (!(fabs(got - ref) <= 1e-5 * mag + 1e-30)) {
                    printf("fmt %d path %d n %ld k %ld m %ld threads %d%s: y[%ld][%ld] = %.9g, "
                           "want %.9g (scale %.3g)\n", fmt, path, (long)n, (long)k, (long)m,
                           threads, extremes ? " extremes" : "", (long)r, (long)j, got, ref, mag);
                    failures++;
                }
            }
    }
    free(w); free(x); free(qa); free(da); free(fa); free(ns); free(bs); free(a); free(wf); free(y);
}

int main(void) {
    const int small[] = {Q4_0, Q4_1, Q8_0}, large[] = {Q4_K, Q5_K, Q6_K};
    const int64_t ms[] = {1, 2, 3, 4, 5, 8, 9, 17};
    for (int f = 0; f < 3; f++)
        for (int mi = 0; mi < 8; mi++) {
            check(small[f], 7, 32 * 13, ms[mi], 1 + mi % 2, 0); /* 13 blocks: 4s and a tail */
            check(small[f], 5, 32 * 3, ms[mi], 1, 0);           /* tail only */
        }
    for (int f = 0; f < 3; f++)
        for (int mi = 0; mi < 8; mi++) check(large[f], 5, 256 * 3, ms[mi], 1 + mi % 2, 0);
    for (int mi = 0; mi < 8; mi++) check(Q8_0, 6, 32 * 9, ms[mi], 1, 1);
    /* prefill chunks past L1 (m * k > 32 KiB): weight rows a panel at a time, 70 rows making
     * two or more panels (quant_blocks.h PANEL_BYTES), with 4- or 8-row groups and their tails */
    for (int f = 0; f < 3; f++) {
        check(small[f], 70, 32 * 130, 9, 2, 0);
        check(large[f], 70, 256 * 12, 11, 1 + f % 2, 0);
    }
    printf("fast=%d failures=%d\n", quant_gemm_fast(), failures);
    return failures != 0;
}

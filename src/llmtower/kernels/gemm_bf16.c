/* bfloat16 products of a decode step's rows (9 to a few hundred) against the few-row kernel's
 * packed weights (gemv_bf16.c's layout, the same buffer: no second copy).
 *
 *   gemm_bf16           out[m, n] = bf16(sum_k x[m, k] * W[n, k] (+ bias[n]))
 *   gemm_bf16_silu_mul  out[m, i] = bf16(bf16(silu(g)) * u) over a gate/up pair's tiles
 *
 * Why: a decode step of tens of rows reads every weight matrix from memory (SmolLM2: 30 layers,
 * 270 MB in bfloat16); oneDNN's bfloat16 GEMM runs ~25% below its in-cache rate there. Here each
 * thread walks its share of 64-column tiles; a tile is read from memory once per step, stays in
 * L2 while every row block passes over it, and the next tile is prefetched while it is computed.
 * The tile code is gemm_bf16_tiles.h (usable inside a caller's parallel region); each output is
 * summed as gemv_bf16 sums it, so a row's result is bit for bit the few-row kernel's, whatever
 * the row count or thread count.
 *
 * Only the AVX512_BF16 path is fast; the portable path computes the same sums in C (tests), and
 * Python uses the kernel only where the fast path exists (``gemv_bf16_fast``).
 */
#include "gemm_bf16_tiles.h"

int gemm_bf16_fast(void) { return HAVE_FAST; }

void gemm_bf16_set_prefetch(int on) { gemm_bf16_prefetch = on; }

/* Checks the vector expf against this libm's expf on every 127th float bit pattern of
 * [-88.7, 88.7] (and turns it on when they all agree, off otherwise); returns 1 if on. The
 * silu epilogue then computes what gemv_bf16 computes with the scalar expf, 16 lanes at once. */
int gemm_bf16_exp_agrees(void) {
    int ok = 0;
#if HAVE_FAST
    ok = 1;
    float in[16], got[16];
    int fill = 0;
    for (uint32_t sign = 0; sign < 2 && ok; sign++)
        for (uint32_t b = 0; b <= 0x42b17218u && ok; b += 127) {
            const uint32_t bits = b | (sign << 31);
            memcpy(&in[fill++], &bits, sizeof bits);
            if (fill < 16) continue;
            fill = 0;
            __mmask16 special;
            _mm512_storeu_ps(got, gemm_bf16_exp16(_mm512_loadu_ps(in), &special));
            for (int i = 0; i < 16; i++) {
                if (special >> i & 1) continue;
                const float want = expf(in[i]);
                if (memcmp(&want, &got[i], sizeof want) != 0) ok = 0;
            }
        }
#endif
    gemm_bf16_vector_exp = ok;
    return ok;
}

static int gemm_any(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *wp, int64_t n,
                    int64_t k, const uint16_t *bias, uint16_t *out, int64_t ldo, int num_threads,
                    int silu, int path) {
    if (m < 0 || n <= 0 || k <= 0 || (m > 1 && ldx < k) || ldo < n) return 1;
    if (m == 0) return 0;
    const int fast = HAVE_FAST && path == 0;
    const int64_t tiles = (n + (silu ? TILE / 2 : TILE) - 1) / (silu ? TILE / 2 : TILE);
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > tiles * m) nt = (int)(tiles * m);
#pragma omp parallel num_threads(nt) if (nt > 1)
    gemm_bf16_tiles(x, m, ldx, wp, n, k, bias, out, ldo, silu, fast);
    return 0;
}

/* path: 0 = the fast path where compiled in, 1 = the portable C path (tests compare them). */
int gemm_bf16(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *wp, int64_t n,
              int64_t k, const uint16_t *bias, uint16_t *out, int64_t ldo, int num_threads,
              int path) {
    return gemm_any(x, m, ldx, wp, n, k, bias, out, ldo, num_threads, 0, path);
}

int gemm_bf16_silu_mul(const uint16_t *x, int64_t m, int64_t ldx, const uint16_t *wp,
                       int64_t ni, int64_t k, uint16_t *out, int64_t ldo, int num_threads,
                       int path) {
    return gemm_any(x, m, ldx, wp, ni, k, NULL, out, ldo, num_threads, 1, path);
}

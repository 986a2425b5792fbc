/* Products by Q4_0 / Q8_0 weights sixteen weight rows at once, read from the file's layout
 * (quant_gemm.c's fast path for those formats).
 *
 * The rows' blocks b are transposed in registers so that int32 lane i of a vector holds row i's
 * values 4g .. 4g+3; one vpdpbusd against those 4 activation bytes broadcast then adds all 16
 * rows' products, the 16 rows' scales are one vector (a gather of their float16s), and a
 * block's float work is one multiply-add per 16 rows instead of one per row.
 *
 * Up to C16_MR rows of x (a decode step) the transposition is done per block in registers and
 * shared by those rows. For more (a prefill chunk) a chunk of C16_CHUNK blocks is transposed
 * once into a buffer that stays in L1 and every C16_MR rows of x run over it, instead of
 * transposing the same blocks again for each C16_MR rows.
 */
#include <stdint.h>
#include <string.h>
#include "quant_blocks.h"

#if QG_512
#define C16_MR 8     /* rows of x per pass (their accumulators in registers) */
#define C16_CHUNK 32 /* blocks transposed at once for many rows: 32 x 576 bytes, within L1 */

/* One block of 16 weight rows, transposed: u[g] lane i: row i's values 4g .. 4g+3 (unsigned:
 * Q8_0's sign bit flipped), sv: the rows' scales. */
typedef struct {
    __m512i u[8];
    __m512 sv;
} c16_block;

static inline __attribute__((always_inline)) void
c16_unpack(const int FMT, const uint8_t *blk, int64_t row_bytes, __m512i rowoff, __m512i u[8],
           __m512 *sv) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    /* the 16 rows' float16 scales: the low halves of a dword gather */
    const __m512i sh = _mm512_i32gather_epi32(rowoff, (const void *)blk, 1);
    *sv = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sh));
    __m512i P[4];
    if (FMT == F_Q4_0) {
        transpose16(blk + 2, row_bytes, P);
        for (int v = 0; v < 4; v++) {
            u[v] = _mm512_and_si512(P[v], m4);
            u[4 + v] = _mm512_and_si512(_mm512_srli_epi16(P[v], 4), m4);
        }
    } else {
        for (int h = 0; h < 2; h++) {
            transpose16(blk + 2 + 16 * h, row_bytes, P);
            for (int v = 0; v < 4; v++) u[4 * h + v] = _mm512_xor_si512(P[v], flip);
        }
    }
}

/* Block b's products for MR rows of x, added to acc[r]: lanes start at -o * sum qa (ns: minus
 * the sums of the two halves). */
static inline __attribute__((always_inline)) void
c16_dot(const int FMT, const int MR, const __m512i u[8], __m512 sv, int64_t b, int64_t nbk,
        const int8_t *qa, const float *da, const int32_t *ns, __m512 *acc) {
    const int off = FMT == F_Q4_0 ? 8 : 128;
    /* unrolled over the rows so that acc[] stays in registers (rolled, gcc kept it on the stack:
     * a load and a store per row and block), and two chains of vpdpbusd per row instead of one
     * chain of eight */
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        const int64_t i = r * nbk + b;
        const int8_t *q = qa + 32 * i;
        __m512i dot0 = _mm512_set1_epi32((ns[8 * i] + ns[8 * i + 4]) * off);
        __m512i dot1 = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int g = 0; g < 8; g += 2) {
            int32_t q4, q5;
            memcpy(&q4, q + 4 * g, 4);
            memcpy(&q5, q + 4 * g + 4, 4);
            dot0 = _mm512_dpbusd_epi32(dot0, u[g], _mm512_set1_epi32(q4));
            dot1 = _mm512_dpbusd_epi32(dot1, u[g + 1], _mm512_set1_epi32(q5));
        }
        const __m512i dot = _mm512_add_epi32(dot0, dot1);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv, _mm512_set1_ps(da[i])), acc[r]);
    }
}

static inline __m512i c16_rowoff(int64_t row_bytes) {
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32((int)row_bytes));
}

/* Weight rows w .. w + 15 (row_bytes apart) times MR rows of x: y[r * ldy + 0 .. 15], each
 * block transposed in registers. PREFETCH: the next 16 rows (contiguous) are fetched while
 * these are read (the column-wise reads of 16 rows are not a pattern the hardware prefetcher
 * follows well). */
static inline __attribute__((always_inline)) void
cols16_fast(const int FMT, const int PREFETCH, const uint8_t *w, int64_t row_bytes, int64_t nb,
            int64_t k, const int MR, const int8_t *qa, const float *da, const int32_t *ns, float *y,
            int64_t ldy) {
    const int64_t nbk = k / 32, bb = FMT == F_Q4_0 ? 18 : 34;
    __m512 acc[C16_MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    const __m512i rowoff = c16_rowoff(row_bytes);
    const uint8_t *next = w + 16 * row_bytes;
    const int64_t ahead = (16 * row_bytes + nb - 1) / nb; /* bytes of it per block */
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        if (PREFETCH)
            for (int64_t o = 0; o < ahead; o += 64) _mm_prefetch((const char *)(next + b * ahead + o), _MM_HINT_T0);
        __m512i u[8];
        __m512 sv;
        c16_unpack(FMT, blk, row_bytes, rowoff, u, &sv);
        c16_dot(FMT, MR, u, sv, b, nbk, qa, da, ns, acc);
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* The nc transposed blocks of blocks[] (blocks b0 ..) times MR rows of x, added to (first:
 * stored in) y[r * ldy + 0 .. 15]. */
static inline __attribute__((always_inline)) void
c16_rows(const int FMT, const int MR, const c16_block *blocks, int nc, int64_t b0, int64_t k,
         int first, const int8_t *qa, const float *da, const int32_t *ns, float *y, int64_t ldy) {
    __m512 acc[C16_MR];
    for (int r = 0; r < MR; r++) acc[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy);
    for (int c = 0; c < nc; c++) {
        __m512i u[8];
        for (int g = 0; g < 8; g++) u[g] = _mm512_load_si512(blocks[c].u + g);
        c16_dot(FMT, MR, u, blocks[c].sv, b0 + c, k / 32, qa, da, ns, acc);
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

/* Weight rows w .. w + 15 times the m (> C16_MR) rows of x, a chunk of blocks transposed at
 * a time. */
static inline __attribute__((always_inline)) void
c16_group_many(const int FMT, const uint8_t *w, int64_t row_bytes, int64_t nb, int64_t k, int64_t m,
               int prefetch, const int8_t *qa, const float *da, const int32_t *ns, float *y,
               int64_t ldy) {
    const int64_t nbk = k / 32, bb = FMT == F_Q4_0 ? 18 : 34;
    const __m512i rowoff = c16_rowoff(row_bytes);
    const uint8_t *next = w + 16 * row_bytes;
    const int64_t ahead = (16 * row_bytes + nb - 1) / nb;
    c16_block blocks[C16_CHUNK] __attribute__((aligned(64)));
    for (int64_t b0 = 0; b0 < nb; b0 += C16_CHUNK) {
        const int nc = (int)(nb - b0 < C16_CHUNK ? nb - b0 : C16_CHUNK);
        for (int c = 0; c < nc; c++) {
            if (prefetch)
                for (int64_t o = 0; o < ahead; o += 64)
                    _mm_prefetch((const char *)(next + (b0 + c) * ahead + o), _MM_HINT_T0);
            c16_unpack(FMT, w + (b0 + c) * bb, row_bytes, rowoff, blocks[c].u, &blocks[c].sv);
        }
        const int first = b0 == 0;
        for (int64_t r0 = 0; r0 < m;) {
            const int64_t left = m - r0;
            const int8_t *q = qa + r0 * k;
            const float *d = da + r0 * nbk;
            const int32_t *s = ns + 8 * r0 * nbk;
            float *yr = y + r0 * ldy;
            if (left >= 8) { c16_rows(FMT, 8, blocks, nc, b0, k, first, q, d, s, yr, ldy); r0 += 8; }
            else if (left >= 4) { c16_rows(FMT, 4, blocks, nc, b0, k, first, q, d, s, yr, ldy); r0 += 4; }
            else if (left >= 2) { c16_rows(FMT, 2, blocks, nc, b0, k, first, q, d, s, yr, ldy); r0 += 2; }
            else { c16_rows(FMT, 1, blocks, nc, b0, k, first, q, d, s, yr, ldy); r0 += 1; }
        }
    }
}

#define COLS16(FMT, PF)                                                                          \
    switch (mr) {                                                                                \
    case 1: cols16_fast(FMT, PF, w, row_bytes, nb, k, 1, qa, da, ns, y, ldy); break;               \
    case 2: cols16_fast(FMT, PF, w, row_bytes, nb, k, 2, qa, da, ns, y, ldy); break;               \
    case 4: cols16_fast(FMT, PF, w, row_bytes, nb, k, 4, qa, da, ns, y, ldy); break;               \
    default: cols16_fast(FMT, PF, w, row_bytes, nb, k, 8, qa, da, ns, y, ldy); break;              \
    }

/* mr: 1, 2, 4 or 8 (constant row counts: the accumulators stay in registers) */
static void cols16_any(int fmt, int prefetch, const uint8_t *w, int64_t row_bytes, int64_t nb,
                       int64_t k, int mr, const int8_t *qa, const float *da, const int32_t *ns, float *y,
                       int64_t ldy) {
    if (fmt == F_Q4_0) {
        if (prefetch) COLS16(F_Q4_0, 1) else COLS16(F_Q4_0, 0)
    } else {
        if (prefetch) COLS16(F_Q8_0, 1) else COLS16(F_Q8_0, 0)
    }
}

/* Groups [g0, g1) of 16 weight rows (Q4_0 or Q8_0) times the m rows of x (quantized per 32 by
 * quant_act): y[r * ldy + 16 g ..]. The last group prefetches nothing (it may be the matrix's
 * end). */
void c16_groups(int fmt, const uint8_t *w, int64_t row_bytes, int64_t g0, int64_t g1, int64_t k,
                int64_t m, const int8_t *qa, const float *da, const int32_t *ns, float *y,
                int64_t ldy) {
    const int64_t nb = k / 32, nbk = k / 32;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wg = w + 16 * g * row_bytes;
        float *yg = y + 16 * g;
        const int pf = g + 1 < g1;
        if (m > C16_MR) {
            if (fmt == F_Q4_0) c16_group_many(F_Q4_0, wg, row_bytes, nb, k, m, pf, qa, da, ns, yg, ldy);
            else c16_group_many(F_Q8_0, wg, row_bytes, nb, k, m, pf, qa, da, ns, yg, ldy);
            continue;
        }
        for (int64_t r0 = 0; r0 < m;) {
            const int64_t left = m - r0;
            const int mr = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            cols16_any(fmt, pf && r0 == 0, wg, row_bytes, nb, k, mr, qa + r0 * k, da + r0 * nbk,
                       ns + 8 * r0 * nbk, yg + r0 * ldy, ldy);
            r0 += mr;
        }
    }
}
#endif

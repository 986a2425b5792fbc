/* Checks the kernels' vector layer (src/llmtower/kernels/vec.h) for whatever ISA it is compiled
 * for (AVX-512, AVX2, NEON under qemu, plain C) against plain C on random inputs, and the
 * float32 panel micro-kernel built on it (gemm_f32_panels.h) against its portable loop, bit for
 * bit. Prints the layer's name and one line per failure; exits 1 on any (test_isa_levels.py). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "vec.h"
#include "gemm_f32_panels.h"

int kernel_vector_exp = 0; /* lib_init.c's flag: libm's expf lane by lane here */

static uint64_t rng = 88172645463325252ull;
static float rnd(void) { /* xorshift64 -> [-4, 4) */
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 8.0 - 4.0);
}

static int failures = 0;
static void expect_same(const char *what, int i, float got, float want) {
    if (memcmp(&got, &want, sizeof got) != 0 && failures++ < 20)
        printf("FAIL %s[%d]: got %.9g want %.9g\n", what, i, got, want);
}

int main(void) {
    enum { N = 64 };
    float a[N], b[N], c[N], out[N];
    uint16_t h[N];
    for (int round = 0; round < 200; round++) {
        for (int i = 0; i < N; i++) {
            a[i] = rnd(), b[i] = rnd(), c[i] = rnd() * 1e-3f;
            uint32_t u;
            memcpy(&u, &a[i], sizeof u);
            h[i] = (uint16_t)(u >> 16);
        }
        for (int i = 0; i < N; i += VEC_LANES) {
            vf_store(out + i, vf_fma(vf_load(a + i), vf_load(b + i), vf_load(c + i)));
            for (int l = 0; l < VEC_LANES; l++)
                expect_same("fma", i + l, out[i + l], fmaf(a[i + l], b[i + l], c[i + l]));
            vf_store(out + i, vf_add(vf_mul(vf_load(a + i), vf_set1(b[0])), vf_zero()));
            for (int l = 0; l < VEC_LANES; l++)
                expect_same("mul", i + l, out[i + l], a[i + l] * b[0]);
            vf_store(out + i, vf_max(vf_load(a + i), vf_load(b + i)));
            for (int l = 0; l < VEC_LANES; l++)
                expect_same("max", i + l, out[i + l], a[i + l] > b[i + l] ? a[i + l] : b[i + l]);
            vf_store(out + i, vf_load_bf16(h + i));
            for (int l = 0; l < VEC_LANES; l++) {
                const uint32_t u = (uint32_t)h[i + l] << 16;
                float want;
                memcpy(&want, &u, sizeof want);
                expect_same("bf16", i + l, out[i + l], want);
            }
            for (int vector_exp = 0; vector_exp < 2; vector_exp++) {
                /* libm lane by lane, then vec_exp.h's vector exp (AVX-512, AVX2; glibc's to the
                 * bit), with lanes past +-88 in some vectors (libm's special path) */
                kernel_vector_exp = vector_exp;
                const float f = round % 3 ? 20.0f : 25.0f;
                vf_store(out + i, vf_exp(vf_mul(vf_load(a + i), vf_set1(f))));
                for (int l = 0; l < VEC_LANES; l++)
                    expect_same(vector_exp ? "exp (vector)" : "exp", i + l, out[i + l],
                                expf(a[i + l] * f));
                vf_store(out + i, vf_exp_nonpos(vf_mul(vf_load(a + i), vf_set1(f))));
                for (int l = 0; l < VEC_LANES; l++) {
                    const float x = a[i + l] * f;
                    expect_same("exp_nonpos", i + l, out[i + l], x <= 0.0f
                                ? expf(x > -87.3f ? x : -87.3f) : out[i + l]);
                }
            }
            kernel_vector_exp = 0;
            vf_store(out + i, vf_div(vf_sub(vf_load(a + i), vf_load(b + i)), vf_load(c + i)));
            for (int l = 0; l < VEC_LANES; l++)
                expect_same("sub_div", i + l, out[i + l], (a[i + l] - b[i + l]) / c[i + l]);
            for (int keep = 0; keep <= VEC_LANES; keep++) {
                vf_store(out + i, vf_keep_n(vf_load(a + i), keep - (keep == 0)));
                for (int l = 0; l < VEC_LANES; l++)
                    expect_same("keep_n", i + l, out[i + l], l < keep ? a[i + l] : 0.0f);
                /* the first `keep` lanes end at the array's last element */
                vf_store(out + i, vf_load_n(a + N - keep, keep, -1.5f));
                for (int l = 0; l < VEC_LANES; l++)
                    expect_same("load_n", i + l, out[i + l], l < keep ? a[N - keep + l] : -1.5f);
            }
            float mx = a[i], sum = 0.0f;
            for (int l = 0; l < VEC_LANES; l++) mx = a[i + l] > mx ? a[i + l] : mx;
            expect_same("reduce_max", i, vf_reduce_max(vf_load(a + i)), mx);
            for (int l = 0; l < VEC_LANES; l++) sum += a[i + l];
            const float got = vf_reduce_add(vf_load(a + i));
            if (fabsf(got - sum) > 1e-5f * (1.0f + fabsf(sum)) && failures++ < 20)
                printf("FAIL reduce_add[%d]: got %.9g want %.9g\n", i, got, sum);
        }
        /* VEC_LANES vectors (rows of a, b, c, h's widening, wrapped) folded to their sums */
        {
            vf tile[VEC_LANES];
            float sums[VEC_LANES];
            for (int l = 0; l < VEC_LANES; l++) tile[l] = vf_load(a + (l * 5 * VEC_LANES) % N);
            vf_store(sums, vf_sum_tile(tile));
            for (int l = 0; l < VEC_LANES; l++) {
                float want = 0.0f;
                for (int e = 0; e < VEC_LANES; e++) want += a[(l * 5 * VEC_LANES) % N + e];
                if (fabsf(sums[l] - want) > 1e-5f * (1.0f + fabsf(want)) && failures++ < 20)
                    printf("FAIL sum_tile[%d]: got %.9g want %.9g\n", l, sums[l], want);
            }
        }
    }
    /* the integer pair products (the greedy screen's): int8 weights x int16 pairs, summed in
     * int32 exactly, against plain C */
    {
        int8_t w8[2 * VEC_LANES];
        int16_t x16[2];
        int32_t got[VEC_LANES], want[VEC_LANES] = {0};
        vi acc = vi_zero();
        for (int round = 0; round < 300; round++) {
            for (int i = 0; i < 2 * VEC_LANES; i++) w8[i] = (int8_t)(int)(rnd() * 31.9f);
            x16[0] = (int16_t)(int)(rnd() * 4095.0f);
            x16[1] = round % 7 == 0 ? (int16_t)-16383 : (int16_t)(int)(rnd() * 4095.0f);
            uint32_t pair;
            memcpy(&pair, x16, sizeof pair);
            acc = vi_dot_pairs(acc, vw_load_i8(w8), vw_set1_pair(pair));
            for (int l = 0; l < VEC_LANES; l++)
                want[l] += (int32_t)w8[2 * l] * x16[0] + (int32_t)w8[2 * l + 1] * x16[1];
        }
        vi_store(got, acc);
        for (int l = 0; l < VEC_LANES; l++)
            if (got[l] != want[l] && failures++ < 20)
                printf("FAIL dot_pairs[%d]: got %d want %d\n", l, (int)got[l], (int)want[l]);
    }
#if F32_FAST
    /* the panel micro-kernel at every row count against the portable loop (k order, fmaf) */
    enum { K = 37 };
    static float x[F32_MR * K], pw[K * F32_NP], fast[F32_MR * F32_NP], slow[F32_MR * F32_NP];
    for (int i = 0; i < F32_MR * K; i++) x[i] = rnd();
    for (int i = 0; i < K * F32_NP; i++) pw[i] = rnd();
    for (int rows = 1; rows <= F32_MR; rows++) {
        memset(fast, 0, sizeof fast);
        f32_tile_dispatch(x, K, rows, pw, K, fast, NULL, 0, NULL, 0);
        f32_tile_portable(x, K, rows, pw, K, slow);
        for (int i = 0; i < rows * F32_NP; i++) expect_same("f32_tile", i, fast[i], slow[i]);
    }
#endif
    printf("%s lanes=%d fast=%d int=%d failures=%d\n", VEC_ISA, VEC_LANES, VEC_FAST, VI_FAST,
           failures);
    return failures != 0;
}

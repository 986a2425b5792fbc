/* What the whole kernel library shares, defined once (every kernel is linked into one shared
 * object, kernels/build.py): the vector exp's check against libm, and what this build was
 * compiled for. Python reads both once, in kernels/ops.py's capabilities. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "vec_exp.h"

/* Whether exp16 / exp8_avx2 (vec_exp.h) is this libm's expf to the bit: set by
 * kernel_vector_exp_check. */
int kernel_vector_exp = 0;

/* Checks exp16 (AVX2: exp8_avx2) against this libm's expf on every 127th float bit pattern of [-88.7, 88.7] and
 * turns the vector silu epilogue on when they all agree (off otherwise); returns 1 if on. */
int kernel_vector_exp_check(void) {
    int ok = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    ok = 1;
    float in[16], got[16];
    int fill = 0;
    for (uint32_t sign = 0; sign < 2 && ok; sign++)
        for (uint32_t b = 0; b <= 0x42b17218u && ok; b += 127) {
            const uint32_t bits = b | (sign << 31);
            memcpy(&in[fill++], &bits, sizeof bits);
            if (fill < 16) continue;
            fill = 0;
#if defined(__AVX512F__)
            __mmask16 special;
            _mm512_storeu_ps(got, exp16(_mm512_loadu_ps(in), &special));
#else
            int lo, hi;
            _mm256_storeu_ps(got, exp8_avx2(_mm256_loadu_ps(in), &lo));
            _mm256_storeu_ps(got + 8, exp8_avx2(_mm256_loadu_ps(in + 8), &hi));
            const int special = lo | hi << 8;
#endif
            for (int i = 0; i < 16; i++) {
                if (special >> i & 1) continue;
                const float want = expf(in[i]);
                if (memcmp(&want, &got[i], sizeof want) != 0) ok = 0;
            }
        }
#endif
    kernel_vector_exp = ok;
    return ok;
}

/* The instruction sets this build was compiled for (-march=native: this CPU's, as far as the
 * compiler knows them), by their /proc/cpuinfo names, space-separated (kernels/ops.py). */
static const char build_isa[] = ""
#ifdef __AVX512F__
    " avx512f"
#endif
#ifdef __AVX512BW__
    " avx512bw"
#endif
#ifdef __AVX512BF16__
    " avx512_bf16"
#endif
#ifdef __AVX512VNNI__
    " avx512_vnni"
#endif
#ifdef __AVX2__
    " avx2"
#endif
#ifdef __FMA__
    " fma"
#endif
#ifdef __F16C__
    " f16c"
#endif
#ifdef __AVXVNNI__
    " avx_vnni"
#endif
#if defined(__ARM_NEON) || defined(__ARM_NEON__)
    " asimd"
#endif
    ;

const char *kernel_isa(void) { return build_isa; }

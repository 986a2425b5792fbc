/* bfloat16 <-> float32 for the C kernels: a bfloat16 is the top half of a float32. Included
 * by every kernel that reads or writes bfloat16 (build.py hashes this header into each
 * kernel's cache key, so a change here rebuilds them all). */
#ifndef LLMTOWER_BF16_H
#define LLMTOWER_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif

/* A mixture-of-experts layer's routed experts for a decode step's few tokens, in one call:
 * for each token, its k chosen experts' gate/up products with the SwiGLU activation, their down
 * products, each weighted by its router weight and summed.
 *
 *   moe_experts_bf16  bfloat16 weights in the few-row tiles of gemv_bf16.c (gate/up as a silu
 *                     pair: 32 gate rows then the 32 matching up rows per tile)
 *   moe_experts_f32   float32 weights in the panels of gemm_f32.c (gate/up as a silu pair)
 *
 * The experts' packed matrices are not copied: the caller passes two tables of addresses
 * (gate_up[e], down[e] for expert e), the ones the per-expert products already read, so the
 * layer's weights exist once. Why one call: a one-token step otherwise makes 2k kernel calls
 * and ~4k tensor ops from Python per layer, for k matrices that each take microseconds to
 * stream; here the k experts' tiles are shared out to the threads together (one barrier
 * between the gate/up and the down phase), and the weighted sum is done in C.
 *
 * The arithmetic is the per-expert path's (models/layers/moe.py: silu_mul, then down, then
 * y * w added to a zeroed output in ascending expert order), rounding for rounding:
 *   bfloat16: h = bf16(bf16(silu(g)) * u); y = bf16(h @ down.T); p = bf16(y * bf16(w));
 *             out = bf16(out + p), out starting at +0.
 *   float32:  the same sums (one accumulator per output, k order); y * w and out + that as
 *             two float32 roundings (never fused into an FMA: see moe_weighted_sum_f32).
 * So a step gives the tokens the per-expert path gives them, bit for bit
 * (tests/kernels/test_moe_experts.py).
 *
 * Each token's experts are sorted here (k is small). An expert id outside [0, num_experts) or
 * k outside [1, MOE_MAX_K] returns 2 before anything runs (the caller raises).
 *
 * Routing in the same call (`router` not NULL: the plain [num_experts, hidden] router matrix in
 * the weights' dtype): the logits (one float32 sum per expert, rounded to bfloat16 for bfloat16
 * weights, as F.linear would), their softmax in float32, the top k (ties: the lower id), and with
 * `normalize` those k divided by their sum; written to ids / weights, which are then outputs.
 * This is transformers' routing (Mixtral, Qwen-MoE, OLMoE) up to the logits' summation order,
 * so it saves a decode step ~6 tensor ops per layer; the tests compare it with torch's.
 */
#include <stdint.h>
#include "bf16.h"
#include "gemv_bf16_tiles.h"
#include "gemm_f32_panels.h"
#include "threads.h"

#define MOE_MAX_K 64
#define MOE_MAX_E 1024 /* most experts the in-call routing takes */

int moe_experts_fast(int bf16) { return bf16 ? HAVE_FAST : F32_FAST; }

/* Token t's choices in ascending expert order: order[j] = index into ids/weights. */
static void moe_sorted(const int64_t *ids, int64_t k, int *order) {
    for (int j = 0; j < k; j++) {
        int i = j;
        while (i > 0 && ids[order[i - 1]] > ids[j]) {
            order[i] = order[i - 1];
            i--;
        }
        order[i] = j;
    }
}

static int moe_check(const int64_t *ids, int64_t tokens, int64_t k, int64_t num_experts,
                     const void *router) {
    if (k < 1 || k > MOE_MAX_K || tokens < 0) return 2;
    if (router) return num_experts >= k && num_experts <= MOE_MAX_E ? 0 : 2;
    for (int64_t i = 0; i < tokens * k; i++)
        if (ids[i] < 0 || ids[i] >= num_experts) return 2;
    return 0;
}

/* Expert e's router logit for row x: one float32 sum over the hidden size (16 lanes, then the
 * lanes), rounded to bfloat16 for bfloat16 weights. */
static float moe_logit(const void *x, const void *router, int64_t e, int64_t hidden, int bf16) {
    vf acc = vf_zero();
    int64_t i = 0;
    float tail = 0.0f;
    if (bf16) {
        const uint16_t *xr = x, *w = (const uint16_t *)router + e * hidden;
        for (; i + VEC_LANES <= hidden; i += VEC_LANES)
            acc = vf_fma(vf_load_bf16(xr + i), vf_load_bf16(w + i), acc);
        for (; i < hidden; i++) tail += bf16_to_f32(xr[i]) * bf16_to_f32(w[i]);
        return bf16_to_f32(f32_to_bf16(vf_reduce_add(acc) + tail));
    }
    const float *xr = x, *w = (const float *)router + e * hidden;
    for (; i + VEC_LANES <= hidden; i += VEC_LANES) acc = vf_fma(vf_load(xr + i), vf_load(w + i), acc);
    for (; i < hidden; i++) tail += xr[i] * w[i];
    return vf_reduce_add(acc) + tail;
}

/* Softmax over the logits, the top k (ties: lower id first), renormalized if asked. */
static void moe_pick(const float *logits, int64_t num_experts, int64_t k, int normalize,
                     int64_t *ids, float *weights) {
    float mx = logits[0], sum = 0.0f;
    for (int64_t e = 1; e < num_experts; e++) mx = logits[e] > mx ? logits[e] : mx;
    for (int64_t e = 0; e < num_experts; e++) sum += expf(logits[e] - mx);
    float total = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < num_experts; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[j] = best;
        weights[j] = expf(logits[best] - mx) / sum;
        total += weights[j];
    }
    if (normalize)
        for (int64_t j = 0; j < k; j++) weights[j] /= total;
}

/* All threads' share of token t's routing (when router is set): the logits split among them,
 * the pick on one. Ends in a barrier. */
static void moe_route_shared(const void *xt, const void *router, int64_t num_experts,
                             int64_t hidden, int bf16, int64_t k, int normalize, float *logits,
                             int64_t *ids, float *weights) {
#pragma omp for schedule(static)
    for (int64_t e = 0; e < num_experts; e++) logits[e] = moe_logit(xt, router, e, hidden, bf16);
#pragma omp single
    moe_pick(logits, num_experts, k, normalize, ids, weights);
}

/* x [tokens, hidden] (row stride ldx); ids [tokens, k]; weights float32 [tokens, k] (outputs
 * when router is set); h scratch [k, inter]; out [tokens, hidden]. */
int moe_experts_bf16(const uint16_t *x, int64_t tokens, int64_t ldx, const int64_t *gate_up,
                     const int64_t *down, int64_t num_experts, int64_t *ids, float *weights,
                     int64_t k, int64_t hidden, int64_t inter, const uint16_t *router,
                     int normalize, uint16_t *h, uint16_t *out, int num_threads, int path) {
    if (hidden <= 0 || inter <= 0) return 1;
    if (moe_check(ids, tokens, k, num_experts, router)) return 2;
    float logits[MOE_MAX_E];
    const int fast = HAVE_FAST && path == 0;
    const int64_t half = TILE / 2, gu_tiles = (inter + half - 1) / half;
    const int64_t d_tiles = (hidden + TILE - 1) / TILE;
    const int64_t gu_numel = ((hidden + 1) / 2) * TILE * 2, d_numel = ((inter + 1) / 2) * TILE * 2;
    const int64_t units = k * gu_tiles > d_tiles ? k * gu_tiles : d_tiles;
    const int nt = kernel_threads(num_threads, units);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int order[MOE_MAX_K];
        float acc[TILE];
        uint16_t y[TILE];
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t *id = ids + t * k;
            const float *w = weights + t * k;
            const uint16_t *xt = x + t * ldx;
            if (router)
                moe_route_shared(xt, router, num_experts, hidden, 1, k, normalize, logits,
                                 ids + t * k, weights + t * k);
            moe_sorted(id, k, order);
#pragma omp for schedule(static)
            for (int64_t u = 0; u < k * gu_tiles; u++) {
                const int64_t j = u / gu_tiles, tile = u % gu_tiles;
                const uint16_t *wp = (const uint16_t *)(intptr_t)gate_up[id[order[j]]];
                const int ncols = (int)(inter - tile * half < half ? inter - tile * half : half);
                tile_sums(xt, ldx, 1, wp + tile * gu_numel, hidden, acc, fast);
                bf16_tile_store(acc, 1, h + j * inter + tile * half, inter, ncols, NULL, 1);
            }
            uint16_t *o = out + t * hidden;
#pragma omp for schedule(static)
            for (int64_t d = 0; d < d_tiles; d++) {
                const int ncols = (int)(hidden - d * TILE < TILE ? hidden - d * TILE : TILE);
                float sum[TILE];
                for (int c = 0; c < ncols; c++) sum[c] = 0.0f;
                for (int64_t j = 0; j < k; j++) {
                    const uint16_t *wp = (const uint16_t *)(intptr_t)down[id[order[j]]];
                    tile_sums(h + j * inter, inter, 1, wp + d * d_numel, inter, acc, fast);
                    bf16_tile_store(acc, 1, y, TILE, ncols, NULL, 0);
                    const float wj = bf16_to_f32(f32_to_bf16(w[order[j]]));
                    for (int c = 0; c < ncols; c++) {
                        /* bf16 x bf16 is exact in float32: one rounding, as torch's mul_ */
                        const float p = bf16_to_f32(f32_to_bf16(bf16_to_f32(y[c]) * wj));
                        sum[c] = bf16_to_f32(f32_to_bf16(sum[c] + p));
                    }
                }
                for (int c = 0; c < ncols; c++) o[d * TILE + c] = f32_to_bf16(sum[c]);
            }
        }
    }
    return 0;
}

/* out[c] = (((0 + y0 * w0) + y1 * w1) + ...) over columns c0..c1, each product and each sum
 * rounded to float32 on its own, as the per-expert path's mul_ then +=: GCC contracts a
 * product and a sum across statements by default (-ffp-contract=fast), hence the attribute;
 * clang contracts only within one expression. */
__attribute__((optimize("fp-contract=off")))
static void moe_weighted_sum_f32(const float *y, int64_t hidden, int64_t k, const float *w,
                                 const int *order, int64_t c0, int64_t c1, float *out) {
    for (int64_t c = c0; c < c1; c++) out[c] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float wj = w[order[j]], *yj = y + j * hidden;
        for (int64_t c = c0; c < c1; c++) {
            const float p = yj[c] * wj;
            out[c] = out[c] + p;
        }
    }
}

/* x [tokens, hidden] (row stride ldx); ids [tokens, k]; weights [tokens, k]; h scratch
 * [k, inter]; y scratch [k, hidden]; out [tokens, hidden]. */
int moe_experts_f32(const float *x, int64_t tokens, int64_t ldx, const int64_t *gate_up,
                    const int64_t *down, int64_t num_experts, int64_t *ids, float *weights,
                    int64_t k, int64_t hidden, int64_t inter, const float *router,
                    int normalize, float *h, float *y, float *out, int num_threads, int path) {
    if (hidden <= 0 || inter <= 0) return 1;
    if (moe_check(ids, tokens, k, num_experts, router)) return 2;
    float logits[MOE_MAX_E];
    const int64_t gu_panels = f32_panels(inter, 1), d_panels = f32_panels(hidden, 0);
    const int64_t units = k * gu_panels > d_panels ? k * gu_panels : d_panels;
    const int nt = kernel_threads(num_threads, units);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int order[MOE_MAX_K];
        const int64_t th = kernel_thread(), team = kernel_team();
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t *id = ids + t * k;
            const float *xt = x + t * ldx;
            if (router)
                moe_route_shared(xt, router, num_experts, hidden, 0, k, normalize, logits,
                                 ids + t * k, weights + t * k);
            moe_sorted(id, k, order);
            /* gate/up: the k experts' panels end to end, one near-equal run per thread */
            const int64_t u0 = k * gu_panels * th / team, u1 = k * gu_panels * (th + 1) / team;
            for (int64_t u = u0; u < u1;) {
                const int64_t j = u / gu_panels, p0 = u % gu_panels;
                const int64_t p1 = u1 - j * gu_panels < gu_panels ? u1 - j * gu_panels : gu_panels;
                const float *wp = (const float *)(intptr_t)gate_up[id[order[j]]];
                f32_run_panels(xt, 1, hidden, wp, inter, hidden, NULL, h + j * inter, inter, p0,
                               p1, 1, path, NULL, 0);
                u += p1 - p0;
            }
#pragma omp barrier
            const int64_t q0 = d_panels * th / team, q1 = d_panels * (th + 1) / team;
            if (q0 < q1) {
                for (int64_t j = 0; j < k; j++) {
                    const float *wp = (const float *)(intptr_t)down[id[order[j]]];
                    f32_run_panels(h + j * inter, 1, inter, wp, hidden, inter, NULL,
                                   y + j * hidden, hidden, q0, q1, 0, path, NULL, 0);
                }
                const int64_t c1 = q1 * F32_NP < hidden ? q1 * F32_NP : hidden;
                moe_weighted_sum_f32(y, hidden, k, weights + t * k, order, q0 * F32_NP, c1,
                                     out + t * hidden);
            }
#pragma omp barrier
        }
    }
    return 0;
}

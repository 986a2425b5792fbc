/* The thread helpers of the C kernels (OpenMP, the runtime PyTorch already loaded: a kernel runs
 * on PyTorch's warm pool instead of fighting its spinning threads for the cores).
 *
 *   kernel_threads(n, units)  the team size for `units` pieces of work when the caller asked for
 *                             n threads: at least 1, at most units (idle threads cost a wake-up)
 *   kernel_thread()           this thread's index in the enclosing team (0 outside a region)
 *   kernel_team()             the enclosing team's size (1 outside a region)
 *
 * Code shared into a caller's parallel region (the tiles of gemv/gemm, decode_layer's layers)
 * splits its work with kernel_thread() / kernel_team(); compiled without OpenMP it runs serially. */
#ifndef LLMTOWER_THREADS_H
#define LLMTOWER_THREADS_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline int kernel_threads(int n, int64_t units) {
    if (n < 1) n = 1;
    if (units < 1) units = 1;
    return n > units ? (int)units : n;
}

static inline int64_t kernel_thread(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int64_t kernel_team(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

#endif

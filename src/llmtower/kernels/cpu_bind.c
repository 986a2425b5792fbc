/* Pins the threads of the OpenMP pool that torch and llmtower's kernels share, one CPU each.
 *
 * Thread i of a team of n runs on cpus[i]. libgomp keeps a pool of threads and gives a team of
 * the same size the same threads in the same order, so the pinning holds for every later
 * parallel region of that size (torch's GEMMs, our kernels). Part of the kernel library
 * (compiled with -fopenmp, loaded after torch): it binds the libgomp torch already loaded, not a
 * copy.
 */
#define _GNU_SOURCE
#include <sched.h>
#include "threads.h"

/* Returns how many threads could not be pinned (0: all of them were). */
int llmtower_bind_threads(const int *cpus, int n) {
    int failed = 0;
#pragma omp parallel num_threads(n) reduction(+ : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[kernel_thread()], &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0) failed++;
    }
    return failed;
}

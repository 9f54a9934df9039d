// at::parallel_for(begin, end, grain, f) as torch runs it with its OpenMP backend, for the
// kernels here, which are built without torch's headers: chunks of ceil(n / threads) items, at
// most n / grain threads, serial on one thread or when nested. `threads` is torch's thread
// count (torch.get_num_threads(), passed in by kernels.py); it is set in the calling thread as
// torch sets it. The process shares torch's OpenMP runtime (the same libgomp.so.1).
#pragma once

#include <algorithm>
#include <cstdint>

#include <omp.h>

namespace disagg {

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, int threads, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  if (!(n > grain && n > 1 && !omp_in_parallel() && threads > 1)) {
    f(begin, end);
    return;
  }
  if (omp_get_max_threads() != threads) omp_set_num_threads(threads);
#pragma omp parallel
  {
    int64_t num_threads = omp_get_num_threads();
    if (grain > 0) num_threads = std::min(num_threads, (n + grain - 1) / grain);
    const int64_t tid = omp_get_thread_num();
    const int64_t chunk = (n + num_threads - 1) / num_threads;
    const int64_t b = begin + tid * chunk;
    if (b < end) f(b, std::min(end, b + chunk));
  }
}

}  // namespace disagg

// The OpenMP team's threads as the kernel sees them (a torch custom op).
//
// Op (namespace `pagedserve`):
//   omp_thread_ids(int n) -> int[]   the Linux thread id (gettid) of each of the n threads of
//                                    a parallel region started by the calling thread, by team
//                                    index (index 0: the calling thread itself)
//
// The worker pins these threads one per core (--cpu-bind) and reads each one's scheduler
// statistics (/proc/self/task/<tid>/schedstat: time spent runnable but not running) to see
// whether other load on the machine is taking its cores (services/worker/cpu_threads.py).
// libgomp keeps one pool of threads per thread that starts parallel regions and gives a team
// of n the first n of them in the same order every time, so the ids hold for every later
// region of at most n threads started by the same calling thread (the worker's forward thread).
// vLLM does the same from C++ (csrc/cpu/utils.cpp, init_cpu_threads_env).

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace pagedserve {

std::vector<int64_t> omp_thread_ids(int64_t n) {
  TORCH_CHECK_VALUE(n >= 1 && n <= 4096, "omp_thread_ids: n must be in [1, 4096], got ", n);
  std::vector<int64_t> ids(static_cast<size_t>(n), -1);
#pragma omp parallel num_threads(static_cast<int>(n))
  {
    const int t = omp_get_thread_num();
    if (t < n) ids[static_cast<size_t>(t)] = static_cast<int64_t>(syscall(SYS_gettid));
  }
  return ids;  // (-1 where the runtime gave the team fewer threads than asked: dynamic teams)
}

}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("omp_thread_ids(int n) -> int[]", &pagedserve::omp_thread_ids);
}

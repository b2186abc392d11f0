// Row argmax of float32 logits (a torch custom op): the greedy token of each row.
//
// Op (namespace `pagedserve`):
//   argmax(x) -> Tensor     x [M, N] float32 (rows contiguous), -> [M] int64
// The index of each row's largest value, the first one on a tie, and of its first NaN when it
// has one: torch.argmax(x, dim=-1)'s answer, bitwise. ATen's CPU argmax walks a row one element
// at a time (2.7 ms for SmolLM2's 128 x 49,152 logits on an AMD EPYC, where amax takes
// 0.19-0.28 ms; this op 0.4 ms); here vectorized passes per row: its max, then the
// first index holding it (a NaN or infinity in the row sends it through a scan for NaN first).
//
// The body is compiled for AVX-512 and the baseline and picked at run time (cpu_isa.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "cpu_isa.h"

#define PS_INLINE inline __attribute__((always_inline))

namespace pagedserve {
namespace {

constexpr int64_t kRun = 64;  // values checked at once by the second pass

// The first index in [0, n) whose value satisfies `is` (a vectorized test per run of kRun
// values, then the run's values in order), or -1.
template <typename Is>
PS_INLINE int64_t first_index(const float* x, int64_t n, Is is) {
  for (int64_t r = 0; r < n; r += kRun) {
    const int64_t end = r + kRun < n ? r + kRun : n;
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = r; i < end; ++i) hit |= is(x[i]) ? 1 : 0;
    if (hit) {
      for (int64_t i = r; i < end; ++i) {
        if (is(x[i])) return i;
      }
    }
  }
  return -1;
}

PS_INLINE int64_t row_argmax(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  float probe = 0.0f;  // NaN iff the row holds a NaN or an infinity (x * 0)
#pragma omp simd reduction(+ : probe)
  for (int64_t i = 0; i < n; ++i) probe += x[i] * 0.0f;
  if (probe != probe) {  // rare: a NaN is the answer if there is one
    const int64_t first_nan = first_index(x, n, [](float v) { return v != v; });
    if (first_nan >= 0) return first_nan;
  }
  const int64_t first_max = first_index(x, n, [m](float v) { return v == m; });
  return first_max >= 0 ? first_max : 0;  // (every value -inf: 0, torch's answer too)
}

using RowsFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t*);

#define PS_DEFINE_ARGMAX(NAME, TARGET)                                                     \
  TARGET void NAME(const float* x, int64_t ld, int64_t n, int64_t rows, int64_t* out) {    \
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * ld, n);                 \
  }
#if defined(__x86_64__)
PS_DEFINE_ARGMAX(argmax_avx512, PS_TARGET_AVX512)
PS_DEFINE_ARGMAX(argmax_avx2, PS_TARGET_AVX2)
#endif
PS_DEFINE_ARGMAX(argmax_scalar, )

at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                        x.device().is_cpu() && x.size(1) > 0,
                    "argmax: x must be a float32 CPU tensor [M, N] with N > 0 and rows "
                    "contiguous, got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), n = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  RowsFn fn = argmax_scalar;
#if defined(__x86_64__)
  const Isa isa = active_isa();
  if (isa >= Isa::kAvx512) {
    fn = argmax_avx512;
  } else if (isa >= Isa::kAvx2) {
    fn = argmax_avx2;
  }
#endif
  const float* base = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    fn(base + r0 * ld, ld, n, r1 - r0, dst + r0);
  });
  return out;
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) { m.def("argmax(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("argmax", &pagedserve::argmax); }

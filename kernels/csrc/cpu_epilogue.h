// The linear layers' epilogue, shared by the native kernels (cpu_linear.cpp, cpu_int8_linear.cpp):
// one (rows tile, 32-column block) of float32 sums -> y in its dtype, + bias, or SwiGLU's
// silu(gate) * up. Included in each kernel's translation unit, inlined into its target bodies.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "cpu_math.h"

#ifndef PS_INLINE
#define PS_INLINE inline __attribute__((always_inline))
#endif

namespace pagedserve {

constexpr int64_t kBlockN = 32;  // output features per packed block (every packed layout)

// A linear op's output side, checked once for every op (`op` names it in the errors): y
// [M, N] (silu_mul: [M, N / 2]) in out_dtype (default x's; float32, bfloat16 or float16) and
// the bias as contiguous float32 [N] (undefined: none). ValueError (c10::ValueError) on a
// bias of another shape, another out_dtype, or silu_mul with N not a multiple of 32.
struct Output {
  at::Tensor y;
  at::Tensor bias;
};

inline Output make_output(const char* op, const at::Tensor& x, int64_t out_features,
                          std::optional<at::ScalarType> out_dtype_in,
                          const std::optional<at::Tensor>& bias_in, bool silu_mul) {
  const auto out_dtype = out_dtype_in.value_or(x.scalar_type());
  TORCH_CHECK_VALUE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 ||
                        out_dtype == at::kHalf,
                    op, ": out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
  Output out;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK_VALUE(bias_in->dim() == 1 && bias_in->size(0) == out_features, op,
                      ": bias must be [", out_features, "], got ", bias_in->sizes());
    out.bias = bias_in->to(at::kFloat).contiguous();
  }
  TORCH_CHECK_VALUE(!silu_mul || out_features % kBlockN == 0, op,
                    ": silu_mul needs out_features a multiple of ", kBlockN,
                    " (blocks of 16 gate and 16 up features), got ", out_features);
  out.y = at::empty({x.size(0), silu_mul ? out_features / 2 : out_features},
                    x.options().dtype(out_dtype));
  return out;
}

// float32 -> bf16 bits with c10::BFloat16's rounding (nearest even, NaN -> 0x7FC0), in a form
// the compiler vectorizes (a scalar c10 conversion per element cost as much as the AMX product
// of a 128-row tile).
PS_INLINE uint16_t bf16_bits(float v) {
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return v != v ? uint16_t{0x7FC0} : rounded;
}

template <typename Out>
PS_INLINE void store_row(const float* a, int64_t cols, const float* bias, Out* dst) {
  if constexpr (std::is_same_v<Out, c10::BFloat16>) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) d[c] = bf16_bits(a[c] + bias[c]);
    } else {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) d[c] = bf16_bits(a[c]);
    }
  } else if (bias != nullptr) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<Out>(a[c] + bias[c]);
  } else {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<Out>(a[c]);
  }
}

template <typename Out>
PS_INLINE void store_tile(const float* acc, int64_t rows, int64_t cols, const float* bias,
                          Out* y, int64_t ldy) {
  for (int64_t m = 0; m < rows; ++m) store_row<Out>(acc + m * kBlockN, cols, bias, y + m * ldy);
}

// The SiLU-gated epilogue (silu_mul): a block's 32 columns are 16 gate features g then the 16
// up features u of the same outputs; y = silu(g + b_g) * (u + b_u), 16 outputs per row, in
// float32, rounded once to Out.
template <typename Out>
PS_INLINE void store_tile_silu_mul(const float* acc, int64_t rows, const float* bias, Out* y,
                                   int64_t ldy) {
  constexpr int64_t kHalf = kBlockN / 2;
  for (int64_t m = 0; m < rows; ++m) {
    const float* a = acc + m * kBlockN;
    float v[kHalf];
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < kHalf; ++c) v[c] = silu(a[c] + bias[c]) * (a[kHalf + c] + bias[kHalf + c]);
    } else {
#pragma omp simd
      for (int64_t c = 0; c < kHalf; ++c) v[c] = silu(a[c]) * a[kHalf + c];
    }
    store_row<Out>(v, kHalf, nullptr, y + m * ldy);
  }
}

// One work item's float32 sums acc [rows][32] (rows m0.., column block `block` of n) -> y
// [M, n] (+ bias [n], float32 or nullptr), or with silu_mul the gated y [M, n / 2].
template <typename Out>
PS_INLINE void store_block(const float* acc, int64_t m0, int64_t rows, int64_t block, int64_t n,
                           const float* bias, bool silu_mul, void* y) {
  const int64_t n0 = block * kBlockN, cols = std::min(kBlockN, n - n0);
  const float* b = bias != nullptr ? bias + n0 : nullptr;
  if (silu_mul) {
    store_tile_silu_mul<Out>(acc, rows, b, static_cast<Out*>(y) + m0 * (n / 2) + n0 / 2, n / 2);
  } else {
    store_tile<Out>(acc, rows, cols, b, static_cast<Out*>(y) + m0 * n + n0, n);
  }
}

}  // namespace pagedserve

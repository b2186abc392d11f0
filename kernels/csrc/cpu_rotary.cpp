// Rotate-half rotary position embedding (RoPE) of query and key, in place (a torch custom op).
//
// Op (namespace `pagedserve`):
//   rotary_embedding(query!, key!, cos, sin)
//     query [T, H, D], key [T, K, D]: float32 / bfloat16 / float16, head_dim contiguous (any
//       strides on the first two dims: q and k are views of the fused qkv projection)
//     cos, sin [T, D] float32 (or [T, 1, D]), contiguous: cos / sin of theta = position *
//       inv_freq repeated over both halves of D (kernels.torch_ops.torch_rope_cos_sin)
//
// With x1 = x[:D/2], x2 = x[D/2:] and c, s the token's cos / sin rounded to x's dtype (as
// kernels.torch_ops.torch_rotary_embedding casts them):
//   x1' = x1 c - x2 s,   x2' = x2 c + x1 s
// float32: two products and a sum, each rounded, no fused multiply-add, so the result is
// bitwise torch's `x * cos + rotate_half(x) * sin` (the float32 models match transformers
// exactly); 16-bit: the same in float32 from the 16-bit values, rounded once at the end.
// Algorithm: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding".
//
// The body is compiled for AVX-512 and the baseline and picked at run time (cpu_isa.h).

// NOTE: no contraction into FMAs in this file (see above); the other kernels keep theirs.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cpu_isa.h"

#define PS_INLINE inline __attribute__((always_inline))

namespace pagedserve {
namespace {

PS_INLINE float widen(float v) { return v; }
PS_INLINE float widen(c10::BFloat16 v) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(v.x) << 16);
}
PS_INLINE float widen(c10::Half v) { return static_cast<float>(v); }

// float32 -> T -> float32: the value a cast to T keeps (nearest even).
template <typename T>
PS_INLINE float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t u = __builtin_bit_cast(uint32_t, v);
    const uint32_t r = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
    return v != v ? v : __builtin_bit_cast(float, r);
  } else {
    return static_cast<float>(c10::Half(v));
  }
}

template <typename T>
PS_INLINE T narrow(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t u = __builtin_bit_cast(uint32_t, v);
    c10::BFloat16 b;
    b.x = v != v ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return b;
  } else {
    return c10::Half(v);
  }
}

struct Rows {
  void* data;
  int64_t stride_tok, stride_head, heads;
};

// Rotates every head of tokens [t0, t1) of both tensors; c, s: [D] per token, float32.
template <typename T>
PS_INLINE void rotate_tokens(Rows q, Rows k, const float* cos, const float* sin, int64_t d,
                             int64_t t0, int64_t t1) {
  const int64_t h = d / 2;
  float c[512], s[512];  // the token's cos / sin rounded to T (D <= 1024)
  for (int64_t t = t0; t < t1; ++t) {
    const float* ct = cos + t * d;
    const float* st = sin + t * d;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) {
      c[i] = round_to<T>(ct[i]);
      s[i] = round_to<T>(st[i]);
    }
    for (const Rows& x : {q, k}) {
      T* base = static_cast<T*>(x.data) + t * x.stride_tok;
      for (int64_t head = 0; head < x.heads; ++head) {
        T* row = base + head * x.stride_head;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) {
          const float x1 = widen(row[i]), x2 = widen(row[h + i]);
          const float a = x1 * c[i], b = x2 * s[i];
          const float e = x2 * c[i], f = x1 * s[i];
          row[i] = narrow<T>(a - b);
          row[h + i] = narrow<T>(e + f);
        }
      }
    }
  }
}

using RotateFn = void (*)(Rows, Rows, const float*, const float*, int64_t, int64_t, int64_t);

#define PS_DEFINE_ROTATE(NAME, TARGET)                                                       \
  TARGET void NAME##_f32(Rows q, Rows k, const float* c, const float* s, int64_t d,          \
                         int64_t t0, int64_t t1) {                                           \
    rotate_tokens<float>(q, k, c, s, d, t0, t1);                                             \
  }                                                                                          \
  TARGET void NAME##_bf16(Rows q, Rows k, const float* c, const float* s, int64_t d,         \
                          int64_t t0, int64_t t1) {                                          \
    rotate_tokens<c10::BFloat16>(q, k, c, s, d, t0, t1);                                     \
  }                                                                                          \
  TARGET void NAME##_f16(Rows q, Rows k, const float* c, const float* s, int64_t d,          \
                         int64_t t0, int64_t t1) {                                           \
    rotate_tokens<c10::Half>(q, k, c, s, d, t0, t1);                                         \
  }
#if defined(__x86_64__)
PS_DEFINE_ROTATE(rot_avx512, PS_TARGET_AVX512)
PS_DEFINE_ROTATE(rot_avx2, PS_TARGET_AVX2)
#endif
PS_DEFINE_ROTATE(rot_scalar, )

Rows rows_of(const at::Tensor& x) {
  return {x.data_ptr(), x.stride(0), x.stride(1), x.size(1)};
}

void rotary_embedding(at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK_VALUE(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 &&
                        key.stride(2) == 1,
                    "rotary_embedding: query and key must be [T, heads, head_dim] with head_dim "
                    "contiguous, got ", query.sizes(), " and ", key.sizes());
  const int64_t t = query.size(0), d = query.size(2);
  TORCH_CHECK_VALUE(key.size(0) == t && key.size(2) == d && d % 2 == 0 && d <= 1024,
                    "rotary_embedding: query ", query.sizes(), " and key ", key.sizes(),
                    " need the same tokens and an even head_dim of at most 1024");
  const auto dtype = query.scalar_type();
  TORCH_CHECK_VALUE(key.scalar_type() == dtype &&
                        (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
                    "rotary_embedding: query and key must share float32, bfloat16 or float16, "
                    "got ", dtype, " and ", key.scalar_type());
  for (const at::Tensor* c : {&cos, &sin}) {
    TORCH_CHECK_VALUE(c->scalar_type() == at::kFloat && c->is_contiguous() &&
                          c->numel() == t * d && c->size(0) == t && c->size(-1) == d,
                      "rotary_embedding: cos and sin must be contiguous float32 [T, head_dim] = [",
                      t, ", ", d, "], got ", c->sizes());
  }
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&query, &key, &cos, &sin}) {
    TORCH_CHECK_VALUE(x->device().is_cpu(), "rotary_embedding: CPU tensors only");
  }
  if (t == 0) return;
  const Isa isa = at_most(active_isa(), Isa::kAvx512);
  PS_ISA_DTYPE_TABLE(RotateFn, table, rot_scalar, rot_avx2, rot_avx512);
  const RotateFn fn = table[static_cast<int>(isa)][dtype_index(dtype)];
  const Rows q = rows_of(query), k = rows_of(key);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t t0, int64_t t1) { fn(q, k, c, s, d, t0, t1); });
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rotary_embedding", &pagedserve::rotary_embedding);
}

TORCH_LIBRARY_IMPL(pagedserve, Meta, m) {
  m.impl("rotary_embedding",
         [](at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&) {});
}

// Group-quantized weights times int8 activations on the CPU ("A8"): 4-bit or int8 weight codes
// with a float32 scale (and optional min) per group of K, the activations quantized to int8 per
// group of 32 k in the op, int8 products summed exactly in int32 per group, the scales applied
// in float32 (torch custom ops). llama.cpp's form for its quantized types against Q8
// activations (ggml-cpu quants.c: ggml_vec_dot_q4_1_q8_1, ggml_vec_dot_q8_0_q8_0), for the
// layers pagedserve serves as stored (GGUF, AWQ, GPTQ) when asked for (PAGEDSERVE_CPU_A8=1,
// services/worker/quantized_linear.py): W4A8 and W8A8 with GGUF's own groups.
//
// Ops (namespace `pagedserve`, schemas at the bottom):
//   pack_a8_weight(codes) -> packed               K % 32 == 0, N zero-padded to blocks of 32
//       4-bit: codes [N, K] uint8 in 0..15 -> [ceil(N/32), K/8, 32, 4] uint8: the four bytes
//         of (k octet j, column c) hold codes k = 8j .. 8j + 3 in their low nibbles and
//         8j + 4 .. 8j + 7 in their high ones (one vpand, one shift + vpand: two VNNI-4 quads)
//       int8: codes [N, K] int8 in [-127, 127] -> [ceil(N/32), K/4, 32, 4] int8 (VNNI-4)
//   a8_linear(x, packed, out_features, weight_scale, weight_min=None, bias=None,
//             out_dtype=None, silu_mul=False) -> y
//       x [M, K] float32 / bfloat16 / float16; weight_scale / weight_min float32 in
//       cpu_linear's per-group layout [ceil(N/32), K/G, 32], G a multiple of 32; bias [N];
//       y [M, N] (silu_mul: [M, N / 2]) in out_dtype (default x's)
//
// What it computes, for each row m (row-invariant: nothing depends on the other rows):
//   per activation group a of 32 k: s_x[m, a] = max |x[m, k]| / 127 (1 for zeros),
//   xq[m, k] = round_half_even(x / s_x) in [-127, 127] (float32 division, as W8A8's);
//   D[m, n, a] = sum over k in a of xq[m, k] q[n, k], exact in int32;
//   y[m, n] = sum over a, in order, of float(D) * (s_x[m, a] * s[n, g(a)])       (fma)
//           + sum over weight groups g, after each, of min[n, g] * X[m, g]         (fma)
//           + bias[n],
//   X[m, g] = sum over the activation groups a in g of s_x[m, a] * sum_k xq[m, k]: the group's
//   sum of the quantized activations (llama.cpp's y.s), so y is the weight-only product of
//   the dequantized activations xq * s_x. (The sum of x itself would leave the codes' offset,
//   s q in 0..15 s, alone against the quantization error: larger errors, measured.)
// The bodies differ only in rounding (fma on AVX2 / AVX-512, mul + add on the scalar path):
// each is tested against a float64 reference of that formula.
//
// Bodies (cpu_vnni.h; AVX-VNNI CPUs run the avx2 body here), tiles of 4 rows:
//   vnni512  vpdpbusd, 32 columns: 4-bit codes are its unsigned operand as they are; int8
//            codes become q + 128 (one vpxor) and D = sum (q + 128) xq - 128 sum xq, the
//            activations' group sums from the prologue (exact); x's quads broadcast the
//            signed operand
//   avx2     8 columns: 4-bit: vpmaddubsw (codes x xq, |pair| <= 2 * 15 * 127) summed in
//            int16 over the group (<= 8 * 3810 < 2^15), one vpmaddwd per group; int8:
//            vpmaddubsw(|xq|, q with xq's sign) (|pair| <= 2 * 127 * 127 < 2^15), vpmaddwd
//            per quad (this is why an int8 code of -128 is refused)
//   scalar   int32 loops

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_epilogue.h"
#include "cpu_isa.h"
#include "cpu_vnni.h"

namespace pagedserve {
namespace {

constexpr int64_t kChunkRows = 256;                // rows per work item
constexpr int64_t kGroupA = 32;                    // k per activation group
constexpr int64_t kStepBytes = kBlockN * 4;        // one k octet (4-bit) or quad (int8)
constexpr int64_t kOctetsPerGroup = kGroupA / 8;   // 4-bit: 4 steps of 8 k a group
constexpr int64_t kQuadsPerGroup = kGroupA / 4;    // int8: 8 steps of 4 k
constexpr int kTileRows = 4;

// ---------------------------------------------------------------------------------------------
// Packing

at::Tensor pack_a8_weight(const at::Tensor& codes) {
  const bool u4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK_VALUE(codes.dim() == 2 && (u4 || codes.scalar_type() == at::kChar) &&
                        codes.device().is_cpu(),
                    "pack_a8_weight: codes must be uint8 (4-bit) or int8 [N, K] on the CPU, got ",
                    codes.scalar_type(), " ", codes.sizes());
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK_VALUE(k % kGroupA == 0, "pack_a8_weight: K must be a multiple of ", kGroupA,
                    ", got ", k);
  if (u4) {
    TORCH_CHECK_VALUE(codes.numel() == 0 || codes.max().item<uint8_t>() <= 15,
                      "pack_a8_weight: 4-bit codes must be 0..15");
  } else {
    TORCH_CHECK_VALUE(codes.numel() == 0 || codes.min().item<int8_t>() >= -127,
                      "pack_a8_weight: int8 codes must lie in [-127, 127], got -128");
  }
  const int64_t nb = (n + kBlockN - 1) / kBlockN;
  at::Tensor w = at::zeros({nb * kBlockN, k}, codes.options());
  w.narrow(0, 0, n).copy_(codes);
  if (!u4) return w.view({nb, kBlockN, k / 4, 4}).transpose(1, 2).contiguous();
  // [nb, 32, K/8, 2, 4]: (low half, high half) of each octet -> one byte per (octet, c, i)
  at::Tensor v = w.view({nb, kBlockN, k / 8, 2, 4});
  at::Tensor bytes = v.select(3, 0).bitwise_or(v.select(3, 1).bitwise_left_shift(4));
  return bytes.transpose(1, 2).contiguous();  // [nb, K/8, 32, 4]
}

// ---------------------------------------------------------------------------------------------
// Prologue: each row of x -> int8 codes per group of 32 k, their scales, and (with mins) the
// weight groups' float sums of x

struct Prologue {
  const void* x;
  at::ScalarType dtype;
  int64_t k;
  int64_t group;   // the weights' group size G (X[m, g] is over it)
  int8_t* xq;      // [M, K]
  float* sx;       // [M, K / 32]
  float* xsum;     // [M, K / G] or nullptr
  int32_t* xqsum;  // [M, K / 32]: each group's sum of codes
  float* asum;     // scratch [K / 32]: s_x times the group's sum of codes
};

template <typename T>
PS_INLINE void prologue_body(const Prologue& p, int64_t begin, int64_t end, float* xf) {
  const int64_t k = p.k, na = k / kGroupA;
  for (int64_t r = begin; r < end; ++r) {
    const T* row = static_cast<const T*>(p.x) + r * k;
#pragma omp simd
    for (int64_t j = 0; j < k; ++j) xf[j] = static_cast<float>(row[j]);
    for (int64_t a = 0; a < na; ++a) {
      const float* xa = xf + a * kGroupA;
      float amax = 0.0f;
#pragma omp simd reduction(max : amax)
      for (int64_t j = 0; j < kGroupA; ++j) amax = std::max(amax, std::fabs(xa[j]));
      const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
      int8_t* dst = p.xq + r * k + a * kGroupA;
      int32_t codes = 0;
#pragma omp simd reduction(+ : codes)
      for (int64_t j = 0; j < kGroupA; ++j) {
        dst[j] = static_cast<int8_t>(std::clamp(__builtin_roundevenf(xa[j] / s), -127.0f, 127.0f));
        codes += dst[j];
      }
      p.sx[r * na + a] = s;
      p.xqsum[r * na + a] = codes;
      p.asum[a] = s * static_cast<float>(codes);
    }
    if (p.xsum != nullptr) {
      const int64_t ng = k / p.group, per = p.group / kGroupA;
      for (int64_t g = 0; g < ng; ++g) {
        float sum = 0.0f;
        for (int64_t a = g * per; a < (g + 1) * per; ++a) sum += p.asum[a];
        p.xsum[r * ng + g] = sum;
      }
    }
  }
}

using PrologueFn = void (*)(Prologue, int64_t, int64_t, float*);

#define PS_DEFINE_PROLOGUE(NAME, TARGET)                                                    \
  TARGET void NAME(Prologue p, int64_t begin, int64_t end, float* xf) {                     \
    p.asum = xf + p.k; /* (the scratch's tail) */                                           \
    switch (p.dtype) {                                                                       \
      case at::kFloat: prologue_body<float>(p, begin, end, xf); break;                      \
      case at::kBFloat16: prologue_body<c10::BFloat16>(p, begin, end, xf); break;           \
      default: prologue_body<c10::Half>(p, begin, end, xf); break;                          \
    }                                                                                        \
  }
#if defined(__x86_64__)
PS_DEFINE_PROLOGUE(prologue_avx512, PS_TARGET_AVX512)
PS_DEFINE_PROLOGUE(prologue_avx2, PS_TARGET_AVX2)
#endif
PS_DEFINE_PROLOGUE(prologue_baseline, )

// ---------------------------------------------------------------------------------------------
// Tiles: MR rows x one packed block (32 columns) -> float32 sums acc [MR][32] (no bias)

struct Tile {
  const int8_t* xq;      // the tile's first row
  int64_t k;             // xq's row stride, K
  const float* sx;       // [rows][K / 32]
  const int32_t* xqsum;  // [rows][K / 32]
  const float* xsum;     // [rows][K / G] or nullptr
  const void* w;         // the block: [K / 8][32][4] 4-bit or [K / 4][32][4] int8
  const float* sw;       // the block's scales [K / G][32]
  const float* mw;       // its mins, or nullptr
  int64_t group;         // G
};

// Column c's code at k of a block (the scalar body's reader).
template <bool kU4>
PS_INLINE int32_t code_at(const void* w, int64_t k, int64_t c) {
  if constexpr (kU4) {
    const uint8_t b = static_cast<const uint8_t*>(w)[(k / 8) * kStepBytes + c * 4 + k % 4];
    return (k % 8) < 4 ? (b & 0x0F) : (b >> 4);
  } else {
    return static_cast<const int8_t*>(w)[(k / 4) * kStepBytes + c * 4 + k % 4];
  }
}

template <int MR, bool kU4>
void tile_scalar(const Tile& t, float* acc) {
  const int64_t na = t.k / kGroupA, ng = t.k / t.group, per = t.group / kGroupA;
  for (int r = 0; r < MR; ++r) {
    const int8_t* x = t.xq + r * t.k;
    for (int64_t c = 0; c < kBlockN; ++c) {
      float sum = 0.0f;
      for (int64_t a = 0; a < na; ++a) {
        int32_t d = 0;
        for (int64_t j = a * kGroupA; j < (a + 1) * kGroupA; ++j) {
          d += int32_t{x[j]} * code_at<kU4>(t.w, j, c);
        }
        const int64_t g = a / per;
        sum += static_cast<float>(d) * (t.sx[r * na + a] * t.sw[g * kBlockN + c]);
        if (t.mw != nullptr && (a + 1) % per == 0) sum += t.mw[g * kBlockN + c] * t.xsum[r * ng + g];
      }
      acc[r * kBlockN + c] = sum;
    }
  }
}

#if defined(__x86_64__)
template <int MR, bool kU4>
PS_TARGET_VNNI512 void tile_vnni512(const Tile& t, float* acc) {
  const int64_t na = t.k / kGroupA, ng = t.k / t.group, per = t.group / kGroupA;
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(-128);
  __m512 f0[MR], f1[MR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) f0[r] = f1[r] = _mm512_setzero_ps();
  for (int64_t a = 0; a < na; ++a) {
    __m512i d0[MR], d1[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) d0[r] = d1[r] = _mm512_setzero_si512();
    if constexpr (kU4) {
#pragma GCC unroll 4
      for (int64_t o = a * kOctetsPerGroup; o < (a + 1) * kOctetsPerGroup; ++o) {
        const uint8_t* wo = static_cast<const uint8_t*>(t.w) + o * kStepBytes;
        const __m512i v0 = _mm512_loadu_si512(wo), v1 = _mm512_loadu_si512(wo + 64);
        const __m512i lo0 = _mm512_and_si512(v0, nibble), lo1 = _mm512_and_si512(v1, nibble);
        const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nibble);
        const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nibble);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = t.xq + r * t.k + 8 * o;
          const __m512i xa = _mm512_set1_epi32(quad_bits(x));
          const __m512i xb = _mm512_set1_epi32(quad_bits(x + 4));
          d0[r] = _mm512_dpbusd_epi32(d0[r], lo0, xa);
          d1[r] = _mm512_dpbusd_epi32(d1[r], lo1, xa);
          d0[r] = _mm512_dpbusd_epi32(d0[r], hi0, xb);
          d1[r] = _mm512_dpbusd_epi32(d1[r], hi1, xb);
        }
      }
    } else {
#pragma GCC unroll 8
      for (int64_t j = a * kQuadsPerGroup; j < (a + 1) * kQuadsPerGroup; ++j) {
        const int8_t* wj = static_cast<const int8_t*>(t.w) + j * kStepBytes;
        const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(wj), flip);  // q + 128
        const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(wj + 64), flip);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const __m512i xb = _mm512_set1_epi32(quad_bits(t.xq + r * t.k + 4 * j));
          d0[r] = _mm512_dpbusd_epi32(d0[r], w0, xb);
          d1[r] = _mm512_dpbusd_epi32(d1[r], w1, xb);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {  // - 128 sum xq: the offset's share
        const __m512i off = _mm512_set1_epi32(128 * t.xqsum[r * na + a]);
        d0[r] = _mm512_sub_epi32(d0[r], off);
        d1[r] = _mm512_sub_epi32(d1[r], off);
      }
    }
    const int64_t g = a / per;
    const __m512 s0 = _mm512_loadu_ps(t.sw + g * kBlockN);
    const __m512 s1 = _mm512_loadu_ps(t.sw + g * kBlockN + 16);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512 xs = _mm512_set1_ps(t.sx[r * na + a]);
      f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0[r]), _mm512_mul_ps(xs, s0), f0[r]);
      f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1[r]), _mm512_mul_ps(xs, s1), f1[r]);
    }
    if (t.mw != nullptr && (a + 1) % per == 0) {
      const __m512 m0 = _mm512_loadu_ps(t.mw + g * kBlockN);
      const __m512 m1 = _mm512_loadu_ps(t.mw + g * kBlockN + 16);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m512 xs = _mm512_set1_ps(t.xsum[r * ng + g]);
        f0[r] = _mm512_fmadd_ps(m0, xs, f0[r]);
        f1[r] = _mm512_fmadd_ps(m1, xs, f1[r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(acc + r * kBlockN, f0[r]);
    _mm512_storeu_ps(acc + r * kBlockN + 16, f1[r]);
  }
}

// A quarter of the block (8 columns, one ymm) at a time: 16 ymm registers.
template <int MR, bool kU4>
PS_TARGET_AVX2 void tile_avx2(const Tile& t, float* acc) {
  const int64_t na = t.k / kGroupA, ng = t.k / t.group, per = t.group / kGroupA;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int qc = 0; qc < 4; ++qc) {
    __m256 f[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) f[r] = _mm256_setzero_ps();
    for (int64_t a = 0; a < na; ++a) {
      __m256i d[MR];  // 4-bit: int16 pairs of products over the group; int8: int32 sums
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) d[r] = _mm256_setzero_si256();
      if constexpr (kU4) {
#pragma GCC unroll 4
        for (int64_t o = a * kOctetsPerGroup; o < (a + 1) * kOctetsPerGroup; ++o) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              static_cast<const uint8_t*>(t.w) + o * kStepBytes + 32 * qc));
          const __m256i lo = _mm256_and_si256(v, nibble);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const int8_t* x = t.xq + r * t.k + 8 * o;
            const __m256i xa = _mm256_set1_epi32(quad_bits(x));
            const __m256i xb = _mm256_set1_epi32(quad_bits(x + 4));
            d[r] = _mm256_add_epi16(d[r], _mm256_maddubs_epi16(lo, xa));
            d[r] = _mm256_add_epi16(d[r], _mm256_maddubs_epi16(hi, xb));
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) d[r] = _mm256_madd_epi16(d[r], ones);
      } else {
#pragma GCC unroll 8
        for (int64_t j = a * kQuadsPerGroup; j < (a + 1) * kQuadsPerGroup; ++j) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              static_cast<const int8_t*>(t.w) + j * kStepBytes + 32 * qc));
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i xb = _mm256_set1_epi32(quad_bits(t.xq + r * t.k + 4 * j));
            const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(w, xb));
            d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(p, ones));
          }
        }
      }
      const int64_t g = a / per;
      const __m256 s = _mm256_loadu_ps(t.sw + g * kBlockN + 8 * qc);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]),
                               _mm256_mul_ps(_mm256_set1_ps(t.sx[r * na + a]), s), f[r]);
      }
      if (t.mw != nullptr && (a + 1) % per == 0) {
        const __m256 m = _mm256_loadu_ps(t.mw + g * kBlockN + 8 * qc);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          f[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(t.xsum[r * ng + g]), f[r]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(acc + r * kBlockN + 8 * qc, f[r]);
  }
}
#endif

using TileFn = void (*)(const Tile&, float*);

struct Tiles {
  TileFn fn[kTileRows];  // fn[r - 1]: r rows
};

template <bool kU4>
Tiles tiles_of(Body body) {
#if defined(__x86_64__)
  if (body == Body::kVnni512) {
    return {{tile_vnni512<1, kU4>, tile_vnni512<2, kU4>, tile_vnni512<3, kU4>,
             tile_vnni512<4, kU4>}};
  }
  if (body != Body::kScalar) {
    return {{tile_avx2<1, kU4>, tile_avx2<2, kU4>, tile_avx2<3, kU4>, tile_avx2<4, kU4>}};
  }
#endif
  return {{tile_scalar<1, kU4>, tile_scalar<2, kU4>, tile_scalar<3, kU4>, tile_scalar<4, kU4>}};
}

// ---------------------------------------------------------------------------------------------
// Epilogue (+ bias, or the SiLU gate), rounded once to the output dtype

struct Store {
  const float* bias;
  void* y;
  int64_t n;
  at::ScalarType out_dtype;
  bool silu_mul;
};

template <typename Out>
PS_INLINE void store_body(const Store& s, int64_t m0, int64_t rows, int64_t block, float* acc) {
  store_block<Out>(acc, m0, rows, block, s.n, s.bias, s.silu_mul, s.y);
}

using StoreFn = void (*)(const Store&, int64_t, int64_t, int64_t, float*);

#define PS_DEFINE_A8_STORE(NAME, TARGET)                                                  \
  TARGET void NAME(const Store& s, int64_t m0, int64_t rows, int64_t block, float* acc) {   \
    switch (s.out_dtype) {                                                                   \
      case at::kFloat: store_body<float>(s, m0, rows, block, acc); break;                   \
      case at::kBFloat16: store_body<c10::BFloat16>(s, m0, rows, block, acc); break;        \
      default: store_body<c10::Half>(s, m0, rows, block, acc); break;                       \
    }                                                                                        \
  }
#if defined(__x86_64__)
PS_DEFINE_A8_STORE(store_avx512, PS_TARGET_AVX512)
PS_DEFINE_A8_STORE(store_avx2, PS_TARGET_AVX2)
#endif
PS_DEFINE_A8_STORE(store_baseline, )

// ---------------------------------------------------------------------------------------------
// The op

at::Tensor a8_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t out_features,
                       const at::Tensor& weight_scale,
                       const std::optional<at::Tensor>& weight_min,
                       const std::optional<at::Tensor>& bias_in,
                       std::optional<at::ScalarType> out_dtype_in, bool silu_mul) {
  TORCH_CHECK_VALUE(x_in.dim() == 2, "a8_linear: x must be [M, K], got ", x_in.sizes());
  const auto x_dtype = x_in.scalar_type();
  TORCH_CHECK_VALUE(x_dtype == at::kFloat || x_dtype == at::kBFloat16 || x_dtype == at::kHalf,
                    "a8_linear: x must be float32, bfloat16 or float16, got ", x_dtype);
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && packed.device().is_cpu() &&
                        weight_scale.device().is_cpu(),
                    "a8_linear: every tensor must be on the CPU");
  const int64_t m = x_in.size(0), k = x_in.size(1);
  const bool u4 = packed.scalar_type() == at::kByte;  // else int8 codes
  TORCH_CHECK_VALUE((u4 || packed.scalar_type() == at::kChar) && packed.is_contiguous() &&
                        packed.dim() == 4 && packed.size(2) == kBlockN && packed.size(3) == 4,
                    "a8_linear: packed weight of shape ", packed.sizes(),
                    " is not pack_a8_weight's output");
  const int64_t num_blocks = packed.size(0), k_per_step = u4 ? 8 : 4;
  TORCH_CHECK_VALUE(packed.size(1) * k_per_step == k, "a8_linear: x has K = ", k,
                    " features, the packed weight ", packed.size(1) * k_per_step);
  TORCH_CHECK_VALUE(out_features > (num_blocks - 1) * kBlockN &&
                        out_features <= num_blocks * kBlockN,
                    "a8_linear: out_features ", out_features, " does not fit ", num_blocks,
                    " packed blocks of ", kBlockN);
  TORCH_CHECK_VALUE(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                        weight_scale.dim() == 3 && weight_scale.size(0) == num_blocks &&
                        weight_scale.size(2) == kBlockN && weight_scale.size(1) > 0 &&
                        k % weight_scale.size(1) == 0 &&
                        (k / weight_scale.size(1)) % kGroupA == 0,
                    "a8_linear: weight_scale must be float32 [", num_blocks,
                    ", K / G, 32] with G a multiple of ", kGroupA, " dividing K = ", k,
                    ", got ", weight_scale.sizes());
  const int64_t group = k / weight_scale.size(1);
  const bool has_min = weight_min.has_value() && weight_min->defined();
  if (has_min) {
    TORCH_CHECK_VALUE(weight_min->scalar_type() == at::kFloat && weight_min->is_contiguous() &&
                          weight_min->sizes() == weight_scale.sizes(),
                      "a8_linear: weight_min must be a contiguous float32 tensor of "
                      "weight_scale's shape, got ", weight_min->sizes());
  }
  const Output out = make_output("a8_linear", x_in, out_features, out_dtype_in, bias_in,
                                 silu_mul);
  const at::Tensor y = out.y, bias = out.bias;  // (named: lambdas below capture them)
  const auto out_dtype = y.scalar_type();
  if (m == 0) return y;

  const at::Tensor x = x_in.contiguous();
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({m, k / kGroupA}, x.options().dtype(at::kFloat));
  at::Tensor xsum;
  if (has_min) xsum = at::empty({m, k / group}, x.options().dtype(at::kFloat));
  at::Tensor xqsum = at::empty({m, k / kGroupA}, x.options().dtype(at::kInt));
  const Prologue pro{x.data_ptr(), x_dtype, k, group, xq.data_ptr<int8_t>(),
                     sx.data_ptr<float>(), has_min ? xsum.data_ptr<float>() : nullptr,
                     xqsum.data_ptr<int32_t>(), nullptr};
  const Isa isa = active_isa();
#if defined(__x86_64__)
  const PrologueFn prologue = isa >= Isa::kAvx512 ? prologue_avx512
                              : isa >= Isa::kAvx2  ? prologue_avx2
                                                   : prologue_baseline;
  const StoreFn store = isa >= Isa::kAvx512 ? store_avx512
                        : isa >= Isa::kAvx2  ? store_avx2
                                             : store_baseline;
#else
  const PrologueFn prologue = prologue_baseline;
  const StoreFn store = store_baseline;
  (void)isa;
#endif
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> xf(k + k / kGroupA);  // x as floats, asum
                     prologue(pro, begin, end, xf.data());
                   });

  const Tiles tiles = u4 ? tiles_of<true>(pick_body()) : tiles_of<false>(pick_body());
  const Store st{bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr(), out_features,
                 out_dtype, silu_mul};
  const int64_t na = k / kGroupA, ng = k / group;
  const auto* w_all = static_cast<const uint8_t*>(packed.data_ptr());
  const float* sw_all = weight_scale.data_ptr<float>();
  const float* mw_all = has_min ? weight_min->data_ptr<float>() : nullptr;
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  const int64_t items = chunks * num_blocks;  // item i: rows chunk i / nb, block i % nb
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(std::min(kChunkRows, m) * kBlockN);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i / num_blocks, block = i % num_blocks;
      const int64_t m0 = chunk * kChunkRows, rows = std::min(kChunkRows, m - m0);
      Tile t;
      t.k = k;
      t.w = w_all + block * (k / k_per_step) * kStepBytes;
      t.sw = sw_all + block * ng * kBlockN;
      t.mw = mw_all != nullptr ? mw_all + block * ng * kBlockN : nullptr;
      t.group = group;
      for (int64_t r = 0; r < rows; r += kTileRows) {
        const int64_t mt = std::min<int64_t>(kTileRows, rows - r);
        t.xq = xq.data_ptr<int8_t>() + (m0 + r) * k;
        t.sx = sx.data_ptr<float>() + (m0 + r) * na;
        t.xqsum = xqsum.data_ptr<int32_t>() + (m0 + r) * na;
        t.xsum = has_min ? xsum.data_ptr<float>() + (m0 + r) * ng : nullptr;
        tiles.fn[mt - 1](t, acc.data() + r * kBlockN);
      }
      store(st, m0, rows, block, acc.data());
    }
  });
  return y;
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("pack_a8_weight(Tensor codes) -> Tensor");
  m.def(
      "a8_linear(Tensor x, Tensor packed_weight, int out_features, Tensor weight_scale, "
      "Tensor? weight_min=None, Tensor? bias=None, ScalarType? out_dtype=None, "
      "bool silu_mul=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("pack_a8_weight", &pagedserve::pack_a8_weight);
  m.impl("a8_linear", &pagedserve::a8_linear);
}

// W8A8 linear layers on the CPU: int8 weights with a float32 scale per output channel, int8
// activations with a float32 scale per token (quantized in the op's prologue), exact int32
// sums, the scales applied in the epilogue (torch custom ops).
//
// Ops (namespace `pagedserve`, schemas at the bottom):
//   pack_w8a8_weight(q) -> (packed, compensation)
//       q [N, K] int8 in [-127, 127] -> packed [ceil(N/32), ceil(K/4), 32, 4] int8 (VNNI-4:
//       W[n, k] at [n / 32, k / 4, n % 32, k % 4], N and K zero-padded) and compensation
//       [32 ceil(N/32)] int32, 128 * sum_k q[n, k] (the VNNI bodies' offset, below)
//   w8a8_linear(x, packed, compensation, out_features, weight_scale, bias=None,
//               out_dtype=None, silu_mul=False) -> y
//       x [M, K] float32 / bfloat16 / float16; weight_scale [N] float32; bias [N] any float
//       dtype; y [M, N] (silu_mul: [M, N / 2], cpu_linear.cpp's SwiGLU epilogue) in
//       out_dtype (default x's)
//   w8a8_linear_body() -> str                 the body w8a8_linear runs now (tests, logs)
//
// What it computes (kernels/int8_linear.py's w8a8_linear, bit for bit without silu_mul):
//   s_x[m] = max_k |x[m, k]| / 127 (1 for a zero row), xq[m, k] = round_half_even(x / s_x)
//   clamped to [-127, 127]; acc[m, n] = sum_k xq[m, k] q[n, k] in int32; then
//   y[m, n] = (float(acc) * s_x[m]) * s_w[n] + bias[n], rounded once to out_dtype.
// The sums are integers, exact in any order, so every body gives the same y, and a row's y
// never depends on the other rows of the step (row- and batch-invariant by construction).
// Work is split over (rows chunk, 32-column block) items, as in cpu_linear.cpp.
//
// Bodies (cpu_vnni.h: picked at each call, PAGEDSERVE_CPU_ISA caps them as it caps the other
// kernels and PAGEDSERVE_CPU_VNNI=0 turns the VNNI ones off, so each is tested where it runs):
//   vnni512  AVX512-VNNI vpdpbusd (u8 x s8: four products summed into each int32 lane), tiles
//            of up to 12 rows x 32 columns; x is fed as u8 = xq + 128 and each sum corrected
//            by the weight's compensation 128 sum_k q[n, k] (oneDNN's way of giving vpdpbusd
//            signed activations); integer, so exact
//   avxvnni  AVX-VNNI vpdpbusd on 256-bit registers (Alder Lake and later, Zen 5): 6 rows x
//            16 columns, the same offset
//   avx2     vpmaddubsw on |xq| and q carrying xq's sign (vpsignb), then vpmaddwd into int32:
//            4 rows x 16 columns; no int16 saturation, |pair sum| <= 2 * 127 * 127 < 2^15
//            (this is why q = -128 is refused: its sign cannot be flipped in int8)
//   scalar   int32 loops (any CPU)
//   brgemm   items of 16 rows or more as one call of ATen's cpublas::brgemm (oneDNN's ukernel:
//            AMX-INT8 tiles on an AMX CPU, where it is the default; PAGEDSERVE_CPU_W8A8_BRGEMM
//            forces it on or off), fewer rows on the vnni512 tiles; integer, so exact

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_epilogue.h"
#include "cpu_isa.h"
#include "cpu_vnni.h"

namespace pagedserve {
namespace {

constexpr int64_t kChunkRows = 256;  // rows per work item
constexpr int64_t kQuad = 4;         // k per int32 lane (VNNI-4)
constexpr int64_t kQuadBytes = kBlockN * kQuad;  // one k quad of a packed block
// From this many rows an item's block is one brgemm call (when brgemm is on, below).
constexpr int64_t kBrgemmRows = 16;

// Whether items of kBrgemmRows rows or more take oneDNN's ukernel through ATen's
// cpublas::brgemm (u8 x s8 -> s32 on the VNNI-4 blocks as packed, K whole, x fed as xq + 128
// as on vnni512): AMX-INT8 tiles on an AMX CPU, oneDNN's own AVX512-VNNI code elsewhere.
// The sums are integers, so it gives the tiles' y bit for bit. On by default where the active
// ISA is amx (PAGEDSERVE_CPU_ISA caps it); off elsewhere: on AVX512-VNNI without AMX it ran
// at 0.94-1.02x the vnni512 tiles' speed (benchmarks/kernels/w8a8_brgemm.py,
// docs/benchmarks.md). PAGEDSERVE_CPU_W8A8_BRGEMM=1 / 0
// forces it on / off, so that it is tested on any AVX512-VNNI CPU. Only with the vnni512 body
// (the +128 offset).
bool use_brgemm(Body body) {
  if (body != Body::kVnni512) return false;
  const char* env = std::getenv("PAGEDSERVE_CPU_W8A8_BRGEMM");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  if (env != nullptr && std::strcmp(env, "1") == 0) return true;
  return active_isa() == Isa::kAmx;
}

// ---------------------------------------------------------------------------------------------
// Packing

std::tuple<at::Tensor, at::Tensor> pack_w8a8_weight(const at::Tensor& q) {
  TORCH_CHECK_VALUE(q.dim() == 2 && q.scalar_type() == at::kChar && q.device().is_cpu(),
                    "pack_w8a8_weight: q must be int8 [N, K] on the CPU, got ", q.scalar_type(),
                    " ", q.sizes());
  TORCH_CHECK_VALUE(q.numel() == 0 || q.min().item<int8_t>() >= -127,
                    "pack_w8a8_weight: q must lie in [-127, 127] (symmetric int8), got -128");
  const int64_t n = q.size(0), k = q.size(1);
  const int64_t nb = (n + kBlockN - 1) / kBlockN, k4 = (k + kQuad - 1) / kQuad;
  at::Tensor w = at::zeros({nb * kBlockN, k4 * kQuad}, q.options());  // N and K zero-padded
  w.narrow(0, 0, n).narrow(1, 0, k).copy_(q);
  at::Tensor compensation = w.sum(1, /*keepdim=*/false, at::kInt).mul_(128);
  // [nb, 32, K4, 4] -> [nb, K4, 32, 4]
  at::Tensor packed = w.view({nb, kBlockN, k4, kQuad}).transpose(1, 2).contiguous();
  return {packed, compensation};
}

// ---------------------------------------------------------------------------------------------
// Prologue: each row of x -> int8 codes (or u8 = code + 128 for the VNNI bodies) and a scale

// Rows [begin, end) of x [M, K] -> xq [M, ldq] (ldq = 4 ceil(K / 4), padding the code 0) and
// s_x [M]; `offset` adds 128 to each code (stored as its u8 bits). `xf`: K floats of scratch.
// Compiled for AVX-512, AVX2 and the baseline (roundeven and the IEEE division vectorize
// without changing a value).
template <typename T>
PS_INLINE void quantize_rows_body(const T* x, int64_t k, int64_t begin, int64_t end, bool offset,
                                  int8_t* xq, int64_t ldq, float* sx, float* xf) {
  const int8_t flip = offset ? static_cast<int8_t>(0x80) : 0;
  for (int64_t r = begin; r < end; ++r) {
    const T* row = x + r * k;
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t j = 0; j < k; ++j) {
      xf[j] = static_cast<float>(row[j]);
      amax = std::max(amax, std::fabs(xf[j]));
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    int8_t* dst = xq + r * ldq;
#pragma omp simd
    for (int64_t j = 0; j < k; ++j) {  // round half to even, as torch.round
      const float v = __builtin_roundevenf(xf[j] / s);
      dst[j] = static_cast<int8_t>(static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f)) ^ flip);
    }
    for (int64_t j = k; j < ldq; ++j) dst[j] = flip;
    sx[r] = s;
  }
}

struct QuantizeArgs {
  const void* x;
  at::ScalarType dtype;
  int64_t k;
  bool offset;
  int8_t* xq;
  int64_t ldq;
  float* sx;
};

using QuantizeFn = void (*)(const QuantizeArgs&, int64_t, int64_t, float*);

#define PS_DEFINE_QUANTIZE(NAME, TARGET)                                                       \
  TARGET void NAME(const QuantizeArgs& q, int64_t begin, int64_t end, float* xf) {             \
    switch (q.dtype) {                                                                          \
      case at::kFloat:                                                                          \
        quantize_rows_body(static_cast<const float*>(q.x), q.k, begin, end, q.offset, q.xq,   \
                           q.ldq, q.sx, xf);                                                    \
        break;                                                                                  \
      case at::kBFloat16:                                                                       \
        quantize_rows_body(static_cast<const c10::BFloat16*>(q.x), q.k, begin, end, q.offset, \
                           q.xq, q.ldq, q.sx, xf);                                              \
        break;                                                                                  \
      default:                                                                                  \
        quantize_rows_body(static_cast<const c10::Half*>(q.x), q.k, begin, end, q.offset,     \
                           q.xq, q.ldq, q.sx, xf);                                              \
    }                                                                                           \
  }
#if defined(__x86_64__)
PS_DEFINE_QUANTIZE(quantize_avx512, PS_TARGET_AVX512)
PS_DEFINE_QUANTIZE(quantize_avx2, PS_TARGET_AVX2)
#endif
PS_DEFINE_QUANTIZE(quantize_baseline, )

// ---------------------------------------------------------------------------------------------
// Tiles: MR rows of xq x one packed block (32 columns), int32 sums into acc [MR][32]

template <int MR>
void tile_scalar(const int8_t* x, int64_t ldx, const int8_t* w, int64_t k4, int32_t* acc) {
  for (int r = 0; r < MR; ++r) {
    int32_t sums[kBlockN] = {};
    for (int64_t j = 0; j < k4; ++j) {
      const int8_t* xj = x + r * ldx + kQuad * j;
      const int8_t* wj = w + j * kQuadBytes;
      for (int64_t c = 0; c < kBlockN; ++c) {
        for (int64_t i = 0; i < kQuad; ++i) sums[c] += int32_t{xj[i]} * int32_t{wj[c * kQuad + i]};
      }
    }
    std::memcpy(acc + r * kBlockN, sums, sizeof(sums));
  }
}

#if defined(__x86_64__)
// vpdpbusd on zmm: lane l of a k quad's 64 bytes holds column l's four k; the row's four
// codes are broadcast to every lane. MR <= 3 keeps two accumulator sets (even and odd quads)
// so that short tiles are not bound by vpdpbusd's latency.
template <int MR>
PS_TARGET_VNNI512 PS_INLINE void quad_vnni512(const int8_t* x, int64_t ldx, const int8_t* wj,
                                              int64_t j, __m512i* c0, __m512i* c1) {
  const __m512i w0 = _mm512_loadu_si512(wj), w1 = _mm512_loadu_si512(wj + 64);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    const __m512i xb = _mm512_set1_epi32(quad_bits(x + r * ldx + kQuad * j));
    c0[r] = _mm512_dpbusd_epi32(c0[r], xb, w0);
    c1[r] = _mm512_dpbusd_epi32(c1[r], xb, w1);
  }
}

template <int MR>
PS_TARGET_VNNI512 void tile_vnni512(const int8_t* x, int64_t ldx, const int8_t* w, int64_t k4,
                                    int32_t* acc) {
  __m512i c0[MR], c1[MR], d0[MR], d1[MR];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = d0[r] = d1[r] = _mm512_setzero_si512();
  int64_t j = 0;
  if constexpr (MR <= 3) {  // two sets (even, odd quads): not bound by vpdpbusd's latency
    for (; j + 2 <= k4; j += 2) {
      quad_vnni512<MR>(x, ldx, w + j * kQuadBytes, j, c0, c1);
      quad_vnni512<MR>(x, ldx, w + (j + 1) * kQuadBytes, j + 1, d0, d1);
    }
  }
  for (; j < k4; ++j) quad_vnni512<MR>(x, ldx, w + j * kQuadBytes, j, c0, c1);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    __m512i a0 = c0[r], a1 = c1[r];
    if constexpr (MR <= 3) {
      a0 = _mm512_add_epi32(a0, d0[r]);
      a1 = _mm512_add_epi32(a1, d1[r]);
    }
    _mm512_storeu_si512(acc + r * kBlockN, a0);
    _mm512_storeu_si512(acc + r * kBlockN + 16, a1);
  }
}

// vpdpbusd on ymm (16 registers): each half of the block (16 columns, two ymm) in turn.
template <int MR>
PS_TARGET_AVXVNNI void tile_avxvnni(const int8_t* x, int64_t ldx, const int8_t* w, int64_t k4,
                                    int32_t* acc) {
  for (int h = 0; h < 2; ++h) {
    __m256i c0[MR], c1[MR];
    for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm256_setzero_si256();
    for (int64_t j = 0; j < k4; ++j) {
      const int8_t* wj = w + j * kQuadBytes + h * 64;
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 32));
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m256i xb = _mm256_set1_epi32(quad_bits(x + r * ldx + kQuad * j));
        c0[r] = _mm256_dpbusd_avx_epi32(c0[r], xb, w0);
        c1[r] = _mm256_dpbusd_avx_epi32(c1[r], xb, w1);
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kBlockN + 16 * h), c0[r]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kBlockN + 16 * h + 8), c1[r]);
    }
  }
}

// vpmaddubsw(|x|, q with x's sign) = pairs of x q in int16 (exact, see the top), vpmaddwd by
// ones sums each pair of pairs into the column's int32 lane.
template <int MR>
PS_TARGET_AVX2 void tile_avx2(const int8_t* x, int64_t ldx, const int8_t* w, int64_t k4,
                              int32_t* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256i c0[MR], c1[MR];
    for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm256_setzero_si256();
    for (int64_t j = 0; j < k4; ++j) {
      const int8_t* wj = w + j * kQuadBytes + h * 64;
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 32));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256i xb = _mm256_set1_epi32(quad_bits(x + r * ldx + kQuad * j));
        const __m256i ax = _mm256_abs_epi8(xb);
        const __m256i p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb));
        const __m256i p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb));
        c0[r] = _mm256_add_epi32(c0[r], _mm256_madd_epi16(p0, ones));
        c1[r] = _mm256_add_epi32(c1[r], _mm256_madd_epi16(p1, ones));
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kBlockN + 16 * h), c0[r]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kBlockN + 16 * h + 8), c1[r]);
    }
  }
}
#endif

using TileFn = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, int32_t*);

// A body's tiles by row count: [rows - 1] for 1 .. MR rows (the full tile last).
#define PS_TILE_TABLE(NAME, FN)                                                             \
  template <int... R>                                                                       \
  constexpr std::array<TileFn, sizeof...(R)> NAME##_table(std::integer_sequence<int, R...>) { \
    return {&FN<R + 1>...};                                                                 \
  }
PS_TILE_TABLE(scalar, tile_scalar)
#if defined(__x86_64__)
PS_TILE_TABLE(vnni512, tile_vnni512)
PS_TILE_TABLE(avxvnni, tile_avxvnni)
PS_TILE_TABLE(avx2, tile_avx2)
#endif

struct Tiles {
  const TileFn* fn;  // fn[r - 1]: a tile of r rows, r = 1 .. mr
  int mr;
};

Tiles tiles_for(Body body) {
  static constexpr auto scalar = scalar_table(std::make_integer_sequence<int, 4>{});
#if defined(__x86_64__)
  static constexpr auto v512 = vnni512_table(std::make_integer_sequence<int, 12>{});
  static constexpr auto vavx = avxvnni_table(std::make_integer_sequence<int, 6>{});
  static constexpr auto avx2 = avx2_table(std::make_integer_sequence<int, 4>{});
  switch (body) {
    case Body::kVnni512: return {v512.data(), 12};
    case Body::kAvxVnni: return {vavx.data(), 6};
    case Body::kAvx2: return {avx2.data(), 4};
    default: break;
  }
#endif
  return {scalar.data(), 4};
}

// ---------------------------------------------------------------------------------------------
// Epilogue: int32 sums of one item -> float32 (float(acc - compensation) * s_x) * s_w -> y

struct Args {
  const int8_t* xq;
  int64_t ldq;
  const float* sx;
  const int8_t* packed;
  int64_t k4;
  const int32_t* compensation;  // nullptr: the body's sums are already the true ones
  const float* sw;
  const float* bias;
  void* y;
  int64_t n;
  at::ScalarType out_dtype;
  bool silu_mul;
};

template <typename Out>
PS_INLINE void store_body(const Args& a, int64_t m0, int64_t rows, int64_t block,
                          const int32_t* acc, float* facc) {
  const int64_t n0 = block * kBlockN, cols = std::min(kBlockN, a.n - n0);
  const float* sw = a.sw + n0;
  for (int64_t m = 0; m < rows; ++m) {
    const int32_t* in = acc + m * kBlockN;
    float* out = facc + m * kBlockN;
    const float s = a.sx[m0 + m];
    if (a.compensation != nullptr) {
      const int32_t* comp = a.compensation + n0;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<float>(in[c] - comp[c]) * s * sw[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<float>(in[c]) * s * sw[c];
    }
  }
  store_block<Out>(facc, m0, rows, block, a.n, a.bias, a.silu_mul, a.y);
}

using StoreFn = void (*)(const Args&, int64_t, int64_t, int64_t, const int32_t*, float*);

#define PS_DEFINE_INT8_STORE(NAME, TARGET)                                                   \
  TARGET void NAME(const Args& a, int64_t m0, int64_t rows, int64_t block, const int32_t* acc, \
                   float* facc) {                                                            \
    switch (a.out_dtype) {                                                                   \
      case at::kFloat: store_body<float>(a, m0, rows, block, acc, facc); break;              \
      case at::kBFloat16: store_body<c10::BFloat16>(a, m0, rows, block, acc, facc); break;   \
      default: store_body<c10::Half>(a, m0, rows, block, acc, facc); break;                  \
    }                                                                                        \
  }
#if defined(__x86_64__)
PS_DEFINE_INT8_STORE(store_avx512, PS_TARGET_AVX512)
PS_DEFINE_INT8_STORE(store_avx2, PS_TARGET_AVX2)
#endif
PS_DEFINE_INT8_STORE(store_baseline, )

// ---------------------------------------------------------------------------------------------
// The op

at::Tensor w8a8_linear(const at::Tensor& x_in, const at::Tensor& packed,
                       const at::Tensor& compensation, int64_t out_features,
                       const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias_in,
                       std::optional<at::ScalarType> out_dtype_in, bool silu_mul) {
  TORCH_CHECK_VALUE(x_in.dim() == 2, "w8a8_linear: x must be [M, K], got ", x_in.sizes());
  const auto x_dtype = x_in.scalar_type();
  TORCH_CHECK_VALUE(x_dtype == at::kFloat || x_dtype == at::kBFloat16 || x_dtype == at::kHalf,
                    "w8a8_linear: x must be float32, bfloat16 or float16, got ", x_dtype);
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && packed.device().is_cpu() &&
                        compensation.device().is_cpu() && weight_scale.device().is_cpu(),
                    "w8a8_linear: every tensor must be on the CPU");
  const int64_t m = x_in.size(0), k = x_in.size(1);
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                        packed.dim() == 4 && packed.size(2) == kBlockN && packed.size(3) == kQuad,
                    "w8a8_linear: packed weight of shape ", packed.sizes(),
                    " is not pack_w8a8_weight's output");
  const int64_t num_blocks = packed.size(0), k4 = packed.size(1);
  TORCH_CHECK_VALUE((k + kQuad - 1) / kQuad == k4, "w8a8_linear: x has K = ", k,
                    " features, the packed weight ", k4 * kQuad);
  TORCH_CHECK_VALUE(out_features > (num_blocks - 1) * kBlockN &&
                        out_features <= num_blocks * kBlockN,
                    "w8a8_linear: out_features ", out_features, " does not fit ", num_blocks,
                    " packed blocks of ", kBlockN);
  TORCH_CHECK_VALUE(compensation.scalar_type() == at::kInt && compensation.is_contiguous() &&
                        compensation.dim() == 1 && compensation.size(0) == num_blocks * kBlockN,
                    "w8a8_linear: compensation must be pack_w8a8_weight's int32 [",
                    num_blocks * kBlockN, "], got ", compensation.sizes());
  TORCH_CHECK_VALUE(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                        weight_scale.dim() == 1 && weight_scale.size(0) == out_features,
                    "w8a8_linear: weight_scale must be a contiguous float32 [", out_features,
                    "], got ", weight_scale.scalar_type(), " ", weight_scale.sizes());
  const Output out = make_output("w8a8_linear", x_in, out_features, out_dtype_in, bias_in,
                                 silu_mul);
  const at::Tensor y = out.y, bias = out.bias;  // (named: lambdas below capture them)
  const auto out_dtype = y.scalar_type();
  if (m == 0) return y;

  const Body body = pick_body();
  const bool offset = body == Body::kVnni512 || body == Body::kAvxVnni;
  const at::Tensor x = x_in.contiguous();
  const int64_t ldq = k4 * kQuad;
  at::Tensor xq = at::empty({m, ldq}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({m}, x.options().dtype(at::kFloat));
  const QuantizeArgs qa{x.data_ptr(), x_dtype, k, offset, xq.data_ptr<int8_t>(), ldq,
                        sx.data_ptr<float>()};
#if defined(__x86_64__)
  const Isa isa = active_isa();
  const QuantizeFn quantize = isa >= Isa::kAvx512 ? quantize_avx512
                              : isa >= Isa::kAvx2  ? quantize_avx2
                                                   : quantize_baseline;
#else
  const QuantizeFn quantize = quantize_baseline;
#endif
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> xf(k);
                     quantize(qa, begin, end, xf.data());
                   });

  Args a;
  a.xq = xq.data_ptr<int8_t>();
  a.ldq = ldq;
  a.sx = sx.data_ptr<float>();
  a.packed = packed.data_ptr<int8_t>();
  a.k4 = k4;
  a.compensation = offset ? compensation.data_ptr<int32_t>() : nullptr;
  a.sw = weight_scale.data_ptr<float>();
  a.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  a.y = y.data_ptr();
  a.n = out_features;
  a.out_dtype = out_dtype;
  a.silu_mul = silu_mul;
  const Tiles tiles = tiles_for(body);
#if defined(__x86_64__)
  const StoreFn store = isa >= Isa::kAvx512 ? store_avx512
                        : isa >= Isa::kAvx2  ? store_avx2
                                             : store_baseline;
#else
  const StoreFn store = store_baseline;
#endif

  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  const int64_t items = chunks * num_blocks;  // item i: rows chunk i / nb, block i % nb
  const bool brgemm = use_brgemm(body);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> acc(std::min(kChunkRows, m) * kBlockN);
    std::vector<float> facc(acc.size());
    bool used_brgemm = false;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i / num_blocks, block = i % num_blocks;
      const int64_t m0 = chunk * kChunkRows, rows = std::min(kChunkRows, m - m0);
      const int8_t* w = a.packed + block * k4 * kQuadBytes;
      if (brgemm && rows >= kBrgemmRows) {  // one call, K whole (integers: any order)
        at::native::cpublas::brgemm(rows, kBlockN, ldq, ldq, kBlockN, kBlockN, false,
                                    reinterpret_cast<const unsigned char*>(a.xq + m0 * ldq),
                                    reinterpret_cast<const signed char*>(w), acc.data(),
                                    /*is_vnni=*/true);
        used_brgemm = true;
      } else {
        for (int64_t r = 0; r < rows; r += tiles.mr) {
          const int64_t mt = std::min<int64_t>(tiles.mr, rows - r);
          tiles.fn[mt - 1](a.xq + (m0 + r) * ldq, ldq, w, k4, acc.data() + r * kBlockN);
        }
      }
      store(a, m0, rows, block, acc.data(), facc.data());
    }
    if (used_brgemm) at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  });
  return y;
}

}  // namespace

std::string w8a8_linear_body() {
  const Body body = pick_body();
  return use_brgemm(body) ? "brgemm" : body_name(body);
}

}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("pack_w8a8_weight(Tensor q) -> (Tensor, Tensor)");
  m.def(
      "w8a8_linear(Tensor x, Tensor packed_weight, Tensor compensation, int out_features, "
      "Tensor weight_scale, Tensor? bias=None, ScalarType? out_dtype=None, "
      "bool silu_mul=False) -> Tensor");
  m.def("w8a8_linear_body() -> str", &pagedserve::w8a8_linear_body);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("pack_w8a8_weight", &pagedserve::pack_w8a8_weight);
  m.impl("w8a8_linear", &pagedserve::w8a8_linear);
}

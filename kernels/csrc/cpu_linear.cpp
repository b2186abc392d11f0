// Row-invariant linear layers on the CPU: y = x W^T (+ b), W prepacked once (torch custom ops).
//
// Ops (namespace `pagedserve`, schemas at the bottom):
//   pack_linear_weight(weight) -> packed     weight [N, K] float32 / bfloat16 / float16 / int8
//   linear(x, packed, out_features, bias=None, out_dtype=None, weight_scale=None,
//          silu_mul=False, weight_min=None) -> y
//                                            x [M, K] in the weight's dtype (quantized
//                                            weights: x float32 / bfloat16 / float16), y [M, N]
//                                            in out_dtype (default x's), bias [N] any float
//                                            dtype, weight_scale / weight_min float32:
//                                            quantized weights only (below);
//                                            silu_mul: y [M, N / 2] = silu(gate) * up, each
//                                            32-column block 16 gate then 16 up features
//                                            (SwiGLU, Shazeer 2020), from the float32 sums
//
// Why our own: (1) a bf16 model's logits must leave the LM head in float32 (a bf16 matmul
// rounds them to a 0.125 grid at |logit| ~ 20, which turns near-ties into exact ties), and
// ATen's CPU matmul has no bf16 x bf16 -> float32 form; (2) a row's result must not depend on
// how many rows the step has (prefix-cache hits, chunked prefill, --batch-invariant): MKL and
// oneDNN choose kernels, blockings and K splits by M, so the same row can come out different.
//
// Row invariance, by construction: every output element is one float32 accumulator that
// walks k = 0 .. K-1 in order (one FMA per k, or one vdpbf16ps per pair of k, or AMX tiles),
// whatever M is, whichever M-tile the row falls in, and however many threads run. Work is
// split over (rows chunk, 32-column block) items only, never over K.
//
// Packed layout: the N output features in blocks of 32 (the last zero-padded);
//   16-bit weights: [num_blocks, K2, 32, 2], K2 = ceil(K / 2): W[n, k] sits at
//     [n / 32, k / 2, n % 32, k % 2] (VNNI-2, the layout vdpbf16ps and AMX's tdpbf16ps read);
//   float32 weights: [num_blocks, K, 32]: W[n, k] at [n / 32, k, n % 32];
//   int8 weights: as 16-bit ones, [num_blocks, K2, 32, 2] int8;
//   4-bit weights: uint8 [num_blocks, K2, 32], K even: codes 0..15 of W[n, 2 j] in the low
//     nibble of [n / 32, j, n % 32] and of W[n, 2 j + 1] in its high nibble (packed by
//     kernels/cpu_linear.py's pack_uint4_weight).
//
// Quantized weights (int8: `--quantization int8`, GGUF Q8_0 / Q5_0 / Q5_1 / Q5_K / Q6_K;
// 4-bit: GGUF Q4_0 / Q4_1 / Q4_K, AWQ, GPTQ) are read inside the GEMM, never copied out in the
// compute dtype. `weight_scale`, float32, is either
//   per output channel: [N] (int8 only); one packed block per work item is unpacked to the
//     int8 values themselves (exact in bf16 and float32) into a per-thread buffer on which the
//     float bodies run, and the epilogue scales the float32 accumulators, y = (x q^T) s + b;
//   per group of G consecutive k (GGUF: G = 32, or 16 for Q6_K; AWQ / GPTQ 32..128 or K):
//     [num_blocks, K / G, 32] (group g of W[n, :] at [n / 32, g, n % 32]), G even, with
//     `weight_min` (same layout) an optional offset per group: W = q * s + m. Off AMX the sums
//     are factored per group (qtile_f32 / qtile_bf16: s (x . q) + m sum(x), llama.cpp's form),
//     the codes turned into floats or bf16 in registers, so each stored weight is taken
//     exactly (q * s is exact in float32 for every format served), not rounded to x's dtype.
//     On AMX each block is converted to bf16 weights q * s + m, rounded to nearest even (a bf16
//     model's copy of them), for the tiles. 4-bit weights always have group scales.

// Instruction sets (cpu_isa.h; PAGEDSERVE_CPU_ISA forces a lower one):
//   amx          bf16: ATen's cpublas::brgemm (oneDNN ukernel, AMX tiles) on each
//                (rows tile <= 32, 32-column block), K whole in one call;
//   avx512_bf16  bf16: vdpbf16ps micro-kernel (rows tile <= 8, 32 columns = 2 zmm);
//   avx512 / avx2 / scalar: float32 FMA micro-kernel (avx2: intrinsics, 6 rows x 16
//                columns per call; avx512 and scalar: plain loops with `omp simd`, compiled
//                for each target), a 16-bit or int8 weight block unpacked to float32 once
//                per item, a float32 one read in place; the only path for float32 and
//                float16 weights. Group-quantized weights: factored tiles (qtile_f32, in
//                AVX-512 intrinsics on avx512, compiled loops on avx2 and the baseline);
//                on avx512_bf16 qtile_bf16 (vdpbf16ps on the codes as bf16).
// The paths differ in rounding (vdpbf16ps sums each pair before it accumulates), so results
// are bitwise stable per path, not across paths; each is tested against a float64 reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_epilogue.h"
#include "cpu_isa.h"
#include "cpu_math.h"

#define PS_INLINE inline __attribute__((always_inline))

namespace pagedserve {
namespace {

constexpr int64_t kChunkM = 256;    // rows per work item (bounds the per-thread x slice)
constexpr int64_t kTileMF32 = 4;    // rows per float32 micro-kernel call
constexpr int64_t kTileMBf16 = 8;   // rows per vdpbf16ps micro-kernel call
constexpr int kTileMQ = 6;          // rows per factored quantized vdpbf16ps call
// From this many rows an item converts its quantized codes once into a buffer for its tiles
// (fewer: each tile converts them in registers, cheaper than a buffer's write and reads).
constexpr int64_t kCodesOnceRows = 24;
constexpr int64_t kTileMAmx = 256;  // rows per brgemm call

// ---------------------------------------------------------------------------------------------
// Packing

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2, "pack_linear_weight: weight must be [N, K], got ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.device().is_cpu(), "pack_linear_weight: weight must be on the CPU");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf ||
                        dtype == at::kChar,
                    "pack_linear_weight supports float32, bfloat16, float16 and int8, got ",
                    dtype);
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t nb = (n + kBlockN - 1) / kBlockN;
  at::Tensor w = at::zeros({nb * kBlockN, k}, weight.options());  // N zero-padded
  w.narrow(0, 0, n).copy_(weight);
  if (dtype == at::kFloat) {  // [nb, 32, K] -> [nb, K, 32]
    return w.view({nb, kBlockN, k}).transpose(1, 2).contiguous();
  }
  const int64_t k2 = (k + 1) / 2;
  if (k2 * 2 != k) w = at::cat({w, at::zeros({nb * kBlockN, 1}, w.options())}, 1);
  // [nb, 32, K2, 2] -> [nb, K2, 32, 2]
  return w.view({nb, kBlockN, k2, 2}).transpose(1, 2).contiguous();
}

// ---------------------------------------------------------------------------------------------
// float32 FMA path (every ISA): the item's weight block unpacked to float32 [K][32] once, then
// tiles of rows, each element one FMA chain over k in order.

PS_INLINE float half_bits_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <typename W>
PS_INLINE void unpack_block(const W* wb, int64_t k, float* wf) {
  if constexpr (std::is_same_v<W, float>) {
    std::memcpy(wf, wb, k * kBlockN * sizeof(float));
  } else {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(wb);
    const int64_t k2 = (k + 1) / 2;
    for (int64_t kp = 0; kp < k2; ++kp) {
      const uint16_t* src = w + kp * 2 * kBlockN;  // [32][2]
      float* even = wf + 2 * kp * kBlockN;
      float* odd = even + kBlockN;
      const bool has_odd = 2 * kp + 1 < k;
      if constexpr (std::is_same_v<W, c10::BFloat16>) {
#pragma omp simd
        for (int64_t c = 0; c < kBlockN; ++c) {
          even[c] = __builtin_bit_cast(float, static_cast<uint32_t>(src[2 * c]) << 16);
        }
        if (has_odd) {
#pragma omp simd
          for (int64_t c = 0; c < kBlockN; ++c) {
            odd[c] = __builtin_bit_cast(float, static_cast<uint32_t>(src[2 * c + 1]) << 16);
          }
        }
      } else {
        for (int64_t c = 0; c < kBlockN; ++c) even[c] = half_bits_to_float(src[2 * c]);
        if (has_odd) {
          for (int64_t c = 0; c < kBlockN; ++c) odd[c] = half_bits_to_float(src[2 * c + 1]);
        }
      }
    }
  }
}

// The codes of k pair `kp` of a block as floats, column c at even[c] (k = 2 kp) and odd[c]
// (k = 2 kp + 1): int8 codes [K2][32][2] (signed), or 4-bit codes [K2][32] one byte a column,
// k = 2 kp in its low nibble and 2 kp + 1 in its high one (unsigned, 0..15).
template <bool kU4>
PS_INLINE void pair_codes(const void* w, int64_t kp, float* even, float* odd) {
  if constexpr (kU4) {
    const uint8_t* src = static_cast<const uint8_t*>(w) + kp * kBlockN;  // [32]
#pragma omp simd
    for (int64_t c = 0; c < kBlockN; ++c) {
      even[c] = static_cast<float>(src[c] & 0x0F);
      odd[c] = static_cast<float>(src[c] >> 4);
    }
  } else {
    const int8_t* src = static_cast<const int8_t*>(w) + kp * 2 * kBlockN;  // [32][2]
#pragma omp simd
    for (int64_t c = 0; c < kBlockN; ++c) {
      even[c] = static_cast<float>(src[2 * c]);
      odd[c] = static_cast<float>(src[2 * c + 1]);
    }
  }
}

// An int8 block with per-channel scales -> float32 [K][32]: the codes themselves (exact);
// the epilogue applies the scales to the float32 sums.
PS_INLINE void unpack_block_codes(const int8_t* w, int64_t k, float* wf) {
  alignas(64) float spare[kBlockN];
  for (int64_t kp = 0; kp < (k + 1) / 2; ++kp) {
    float* even = wf + 2 * kp * kBlockN;
    pair_codes<false>(w, kp, even, 2 * kp + 1 < k ? even + kBlockN : spare);
  }
}

// Group-quantized weights (a scale s and optionally a min m per group of G k and column),
// factored as llama.cpp's dot products are (ggml-cpu quants.c, vec_dot_q4_1_q8_1):
//
//   y[m, n] = sum over groups g of  s[n, g] * D[m, n, g] + m[n, g] * X[m, g],
//   D[m, n, g] = sum over k in g of x[m, k] * q[n, k],   X[m, g] = sum over k in g of x[m, k]
//
// each D one float32 chain over the group's k in order, the groups added in order into one
// float32 accumulator per output (fma), whatever the rows. The codes are read as they are
// stored and turned into floats in registers: nothing is dequantized to the compute dtype, and
// the weights taken are the stored ones exactly (q * s + m), not rounded to x's dtype.
// `xs`: X, [rows][ldxs] (the groups' sums of each row of x), or nullptr without mins.
// `wf`: the block's codes as floats [K][32] (unpack_codes: an item of kCodesOnceRows converts
// them once), or nullptr: read from `w` in each tile. The same values either way.
template <int MR, bool kU4>
PS_INLINE void qtile_f32(const float* x, int64_t ldx, const void* w, const float* wf, int64_t k,
                         const float* gs, const float* gm, int64_t group, const float* xs,
                         int64_t ldxs, float* acc) {
  float a[MR][kBlockN];
  for (int m = 0; m < MR; ++m) {
#pragma omp simd
    for (int64_t c = 0; c < kBlockN; ++c) a[m][c] = 0.0f;
  }
  alignas(64) float ce[kBlockN], co[kBlockN];
  const int64_t pairs = group / 2;
  for (int64_t g = 0; g < k / group; ++g) {
    float d[MR][kBlockN];
    for (int m = 0; m < MR; ++m) {
#pragma omp simd
      for (int64_t c = 0; c < kBlockN; ++c) d[m][c] = 0.0f;
    }
    for (int64_t kp = g * pairs; kp < (g + 1) * pairs; ++kp) {
      const float* we = ce;
      if (wf != nullptr) {
        we = wf + 2 * kp * kBlockN;
      } else {
        pair_codes<kU4>(w, kp, ce, co);
      }
      const float* wo = we == ce ? co : we + kBlockN;
      for (int m = 0; m < MR; ++m) {
        const float xe = x[m * ldx + 2 * kp], xo = x[m * ldx + 2 * kp + 1];
#pragma omp simd
        for (int64_t c = 0; c < kBlockN; ++c) d[m][c] += xe * we[c];
#pragma omp simd
        for (int64_t c = 0; c < kBlockN; ++c) d[m][c] += xo * wo[c];
      }
    }
    const float* sg = gs + g * kBlockN;
    for (int m = 0; m < MR; ++m) {
#pragma omp simd
      for (int64_t c = 0; c < kBlockN; ++c) a[m][c] += sg[c] * d[m][c];
    }
    if (gm != nullptr) {
      const float* mg = gm + g * kBlockN;
      for (int m = 0; m < MR; ++m) {
        const float xg = xs[m * ldxs + g];
#pragma omp simd
        for (int64_t c = 0; c < kBlockN; ++c) a[m][c] += mg[c] * xg;
      }
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(acc + m * kBlockN, a[m], kBlockN * sizeof(float));
}

// A block's codes as floats [K][32] (K even), for the tiles of an item of many rows.
template <bool kU4>
PS_INLINE void unpack_codes(const void* w, int64_t k, float* wf) {
  for (int64_t kp = 0; kp < k / 2; ++kp) {
    pair_codes<kU4>(w, kp, wf + 2 * kp * kBlockN, wf + (2 * kp + 1) * kBlockN);
  }
}

// Rows of one item in tiles of MR (the remainder one at a time: the same chain per row); an
// item of kCodesOnceRows rows or more converts its codes once into `wf` ([K][32] floats).
template <int MR, bool kU4>
PS_INLINE void qrows_f32(const float* x, int64_t ldx, int64_t rows, const void* w, int64_t k,
                         const float* gs, const float* gm, int64_t group, const float* xs,
                         int64_t ldxs, float* acc, float* wf) {
  const float* codes = nullptr;
  if (rows >= kCodesOnceRows) {
    unpack_codes<kU4>(w, k, wf);
    codes = wf;
  }
  int64_t m = 0;
  for (; m + MR <= rows; m += MR) {
    qtile_f32<MR, kU4>(x + m * ldx, ldx, w, codes, k, gs, gm, group,
                       xs != nullptr ? xs + m * ldxs : nullptr, ldxs, acc + m * kBlockN);
  }
  for (; m < rows; ++m) {
    qtile_f32<1, kU4>(x + m * ldx, ldx, w, codes, k, gs, gm, group,
                      xs != nullptr ? xs + m * ldxs : nullptr, ldxs, acc + m * kBlockN);
  }
}

template <int MR>
PS_INLINE void tile_f32(const float* x, int64_t ldx, const float* wf, int64_t k, float* acc) {
  float a[MR][kBlockN];
  for (int m = 0; m < MR; ++m) {
#pragma omp simd
    for (int64_t c = 0; c < kBlockN; ++c) a[m][c] = 0.0f;
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* wk = wf + kk * kBlockN;
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * ldx + kk];
#pragma omp simd
      for (int64_t c = 0; c < kBlockN; ++c) a[m][c] += xv * wk[c];
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(acc + m * kBlockN, a[m], kBlockN * sizeof(float));
}

PS_INLINE void rows_f32(const float* x, int64_t ldx, int64_t rows, const float* wf, int64_t k,
                        float* acc, const float* /*ahead: the AVX2 body's prefetch only*/) {
  int64_t m = 0;
  for (; m + kTileMF32 <= rows; m += kTileMF32) {
    tile_f32<kTileMF32>(x + m * ldx, ldx, wf, k, acc + m * kBlockN);
  }
  switch (rows - m) {
    case 3: tile_f32<3>(x + m * ldx, ldx, wf, k, acc + m * kBlockN); break;
    case 2: tile_f32<2>(x + m * ldx, ldx, wf, k, acc + m * kBlockN); break;
    case 1: tile_f32<1>(x + m * ldx, ldx, wf, k, acc + m * kBlockN); break;
    default: break;
  }
}

// Everything one item needs: rows [m0, m0 + rows) of x (float32 [M, K], ldx = K), column
// block `block` of the packed weight, the output.
struct LinearArgs {
  const void* x;       // float32 [M, K] (f32 path) or 16-bit [M, ldx] with ldx even (bf16 paths)
  int64_t ldx;
  const void* packed;  // see the layout above
  int64_t k, k2, n, m;
  const float* bias;   // [N] float32 or nullptr
  void* y;             // [M, N] in out_dtype
  at::ScalarType w_dtype, out_dtype;
  at::ScalarType x_dtype;    // the op's x (the f32 path reads it converted to float32)
  const float* scale;        // int8 weights: per output channel [N], or nullptr
  const float* group_scale;  // quantized weights: per group [num_blocks, K / group, 32], or
                             // nullptr
  const float* group_min;    // the groups' mins, as group_scale, or nullptr (none: 0)
  int64_t group;             // k per group (group_scale), else 0
  const float* xsum;         // the groups' sums of x, [M, K / group] (qtile_f32's X), or nullptr
  bool silu_mul;             // the SiLU-gated epilogue: y [M, N / 2] (store_tile_silu_mul)
};

#if defined(__x86_64__)
// The AVX2 micro-kernel: MR rows x 16 columns (half h of the 32-column block), 2 ymm
// accumulators per row, the two weight vectors of k loaded once for all MR rows and x[m, k]
// broadcast (12 accumulators + 2 weights + 1 broadcast of the 16 ymm registers at MR = 6).
// Each element is the same FMA chain over k as tile_f32's, for every MR.
// `pf`: the lines of the block this thread reads next, asked for one every pf.every k steps
// across the item's tiles (so the reads run at about the pace of the products instead of
// stalling one tile on a burst of them; a prefetch holds a miss buffer until its line lands).
struct PrefetchStream {
  const char* next;  // the next line to ask for (nullptr: none)
  const char* end;
  int64_t every, count;
};

template <int MR>
PS_TARGET_AVX2 PS_INLINE void tile_f32_avx2(const float* x, int64_t ldx, const float* wf,
                                            int64_t k, float* acc, PrefetchStream& pf) {
  for (int h = 0; h < 2; ++h) {
    const float* w = wf + 16 * h;
    __m256 c0[MR], c1[MR];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      c0[m] = _mm256_setzero_ps();
      c1[m] = _mm256_setzero_ps();
    }
    for (int64_t kk = 0; kk < k; ++kk) {
      const __m256 w0 = _mm256_loadu_ps(w + kk * kBlockN);
      const __m256 w1 = _mm256_loadu_ps(w + kk * kBlockN + 8);
      if (--pf.count == 0) {
        pf.count = pf.every;
        if (pf.next < pf.end) {
          _mm_prefetch(pf.next, _MM_HINT_T1);
          pf.next += 64;
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * ldx + kk);
        c0[m] = _mm256_fmadd_ps(xv, w0, c0[m]);
        c1[m] = _mm256_fmadd_ps(xv, w1, c1[m]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      _mm256_storeu_ps(acc + m * kBlockN + 16 * h, c0[m]);
      _mm256_storeu_ps(acc + m * kBlockN + 16 * h + 8, c1[m]);
    }
  }
}

constexpr int kTileMAvx2 = 6;  // rows per AVX2 micro-kernel call

// Not inlined: item_f32_body (no target of its own) calls it. The tiles ask for the lines of
// `ahead` (the thread's next float32 block, or nullptr) at an even pace over the item: the
// weights stream from memory in a decode step, and without it the next block's first pass
// stalls on them.
PS_TARGET_AVX2 void rows_f32_avx2(const float* x, int64_t ldx, int64_t rows,
                                  const float* wf, int64_t k, float* acc, const float* ahead) {
  // 2 k lines per block row, 2 k steps per tile (two halves): one line every `tiles` steps
  const int64_t tiles = (rows + kTileMAvx2 - 1) / kTileMAvx2;
  PrefetchStream pf{nullptr, nullptr, tiles, tiles};
  if (ahead != nullptr) {
    pf.next = reinterpret_cast<const char*>(ahead);
    pf.end = reinterpret_cast<const char*>(ahead + k * kBlockN);
  }
  int64_t m = 0;
  for (; m + kTileMAvx2 <= rows; m += kTileMAvx2) {
    tile_f32_avx2<kTileMAvx2>(x + m * ldx, ldx, wf, k, acc + m * kBlockN, pf);
  }
  const float* xt = x + m * ldx;
  float* at = acc + m * kBlockN;
  switch (rows - m) {
    case 5: tile_f32_avx2<5>(xt, ldx, wf, k, at, pf); break;
    case 4: tile_f32_avx2<4>(xt, ldx, wf, k, at, pf); break;
    case 3: tile_f32_avx2<3>(xt, ldx, wf, k, at, pf); break;
    case 2: tile_f32_avx2<2>(xt, ldx, wf, k, at, pf); break;
    case 1: tile_f32_avx2<1>(xt, ldx, wf, k, at, pf); break;
    default: break;
  }
}
#endif

// RowsFn: rows_f32, or rows_f32_avx2 in the AVX2 bodies. A float32 block is read in place
// (the packed layout is already [K][32] float32); others are unpacked into `wf` first.
// `next_block`: the block of the item this thread runs next (-1: none).
template <typename W, auto RowsFn>
PS_INLINE void item_f32_body(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,
                             int64_t next_block, float* wf, float* acc) {
  const float* w;
  const float* ahead = nullptr;
  if constexpr (std::is_same_v<W, float>) {
    w = static_cast<const float*>(a.packed) + block * a.k * kBlockN;
    if (next_block >= 0) ahead = static_cast<const float*>(a.packed) + next_block * a.k * kBlockN;
  } else {
    unpack_block(static_cast<const W*>(a.packed) + block * a.k2 * 2 * kBlockN, a.k, wf);
    w = wf;
  }
  const float* x = static_cast<const float*>(a.x);
  RowsFn(x + m0 * a.ldx, a.ldx, rows, w, a.k, acc, ahead);
}

#if defined(__x86_64__)
// qtile_f32 in AVX-512 intrinsics (the compiled loop kept its codes on the stack, in halves
// that its 512-bit loads could not forward: 2x slower than the AVX2 build on an EPYC): the
// same chain per element, the codes of 16 columns of a k pair converted in registers.
template <bool kU4>
PS_TARGET_AVX512 PS_INLINE void pair_codes_avx512(const void* w, int64_t kp, int h, __m512& even,
                                                  __m512& odd) {
  if constexpr (kU4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint8_t*>(w) + kp * kBlockN + 16 * h)));
    even = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
    odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  } else {  // [16][2] int8 -> 16 lanes of (even | odd << 16) as int16 pairs
    const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const int8_t*>(w) + kp * 2 * kBlockN + 2 * 16 * h)));
    even = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 16));
    odd = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 16));
  }
}

template <int MR, bool kU4>
PS_TARGET_AVX512 PS_INLINE void qtile_f32_avx512(const float* x, int64_t ldx, const void* w,
                                                 const float* wf, int64_t k, const float* gs,
                                                 const float* gm, int64_t group,
                                                 const float* xs, int64_t ldxs, float* acc) {
  __m512 a0[MR], a1[MR];
  for (int m = 0; m < MR; ++m) {
    a0[m] = _mm512_setzero_ps();
    a1[m] = _mm512_setzero_ps();
  }
  const int64_t pairs = group / 2;
  for (int64_t g = 0; g < k / group; ++g) {
    __m512 d0[MR], d1[MR];
    for (int m = 0; m < MR; ++m) {
      d0[m] = _mm512_setzero_ps();
      d1[m] = _mm512_setzero_ps();
    }
    for (int64_t kp = g * pairs; kp < (g + 1) * pairs; ++kp) {
      __m512 e0, o0, e1, o1;
      if (wf != nullptr) {
        const float* we = wf + 2 * kp * kBlockN;
        e0 = _mm512_loadu_ps(we);
        e1 = _mm512_loadu_ps(we + 16);
        o0 = _mm512_loadu_ps(we + kBlockN);
        o1 = _mm512_loadu_ps(we + kBlockN + 16);
      } else {
        pair_codes_avx512<kU4>(w, kp, 0, e0, o0);
        pair_codes_avx512<kU4>(w, kp, 1, e1, o1);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512 xe = _mm512_set1_ps(x[m * ldx + 2 * kp]);
        const __m512 xo = _mm512_set1_ps(x[m * ldx + 2 * kp + 1]);
        d0[m] = _mm512_fmadd_ps(xo, o0, _mm512_fmadd_ps(xe, e0, d0[m]));
        d1[m] = _mm512_fmadd_ps(xo, o1, _mm512_fmadd_ps(xe, e1, d1[m]));
      }
    }
    const __m512 s0 = _mm512_loadu_ps(gs + g * kBlockN), s1 = _mm512_loadu_ps(gs + g * kBlockN + 16);
    for (int m = 0; m < MR; ++m) {
      a0[m] = _mm512_fmadd_ps(s0, d0[m], a0[m]);
      a1[m] = _mm512_fmadd_ps(s1, d1[m], a1[m]);
    }
    if (gm != nullptr) {
      const __m512 m0 = _mm512_loadu_ps(gm + g * kBlockN), m1 = _mm512_loadu_ps(gm + g * kBlockN + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 xg = _mm512_set1_ps(xs[m * ldxs + g]);
        a0[m] = _mm512_fmadd_ps(m0, xg, a0[m]);
        a1[m] = _mm512_fmadd_ps(m1, xg, a1[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(acc + m * kBlockN, a0[m]);
    _mm512_storeu_ps(acc + m * kBlockN + 16, a1[m]);
  }
}

template <int MR, bool kU4>
PS_TARGET_AVX512 void qrows_f32_avx512(const float* x, int64_t ldx, int64_t rows, const void* w,
                                       int64_t k, const float* gs, const float* gm,
                                       int64_t group, const float* xs, int64_t ldxs,
                                       float* acc, float* wf) {
  const float* codes = nullptr;
  if (rows >= kCodesOnceRows) {  // (as qrows_f32)
    unpack_codes<kU4>(w, k, wf);
    codes = wf;
  }
  int64_t m = 0;
  for (; m + MR <= rows; m += MR) {
    qtile_f32_avx512<MR, kU4>(x + m * ldx, ldx, w, codes, k, gs, gm, group,
                              xs != nullptr ? xs + m * ldxs : nullptr, ldxs, acc + m * kBlockN);
  }
  for (; m < rows; ++m) {
    qtile_f32_avx512<1, kU4>(x + m * ldx, ldx, w, codes, k, gs, gm, group,
                             xs != nullptr ? xs + m * ldxs : nullptr, ldxs, acc + m * kBlockN);
  }
}
#endif

// Quantized weights: group scales factored (QRowsFn: qrows_f32 or qrows_f32_avx512), or
// per-channel int8 codes unpacked to float32 and run by RowsFn as float weights are.
template <bool kU4, auto QRowsFn, auto RowsFn>
PS_INLINE void item_f32_q_body(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,
                               int64_t /*next_block*/, float* wf, float* acc) {
  const void* w = static_cast<const int8_t*>(a.packed) + block * a.k2 * (kU4 ? 1 : 2) * kBlockN;
  const float* x = static_cast<const float*>(a.x) + m0 * a.ldx;
  if (a.group_scale == nullptr) {  // (int8 only)
    unpack_block_codes(static_cast<const int8_t*>(w), a.k, wf);
    RowsFn(x, a.ldx, rows, wf, a.k, acc, nullptr);
    return;
  }
  const int64_t ngroups = a.k / a.group, offset = block * ngroups * kBlockN;
  QRowsFn(x, a.ldx, rows, w, a.k, a.group_scale + offset,
                     a.group_min != nullptr ? a.group_min + offset : nullptr, a.group,
                     a.xsum != nullptr ? a.xsum + m0 * ngroups : nullptr, ngroups, acc, wf);
}

using ItemF32Fn = void (*)(const LinearArgs&, int64_t, int64_t, int64_t, int64_t, float*,
                           float*);

#define PS_DEFINE_F32(NAME, TARGET, ROWS, QROWS)                                           \
  TARGET void NAME##_f32(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,     \
                         int64_t next, float* wf, float* acc) {                            \
    item_f32_body<float, ROWS>(a, m0, rows, block, next, wf, acc);                         \
  }                                                                                        \
  TARGET void NAME##_bf16(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,    \
                          int64_t next, float* wf, float* acc) {                           \
    item_f32_body<c10::BFloat16, ROWS>(a, m0, rows, block, next, wf, acc);                 \
  }                                                                                        \
  TARGET void NAME##_f16(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,     \
                         int64_t next, float* wf, float* acc) {                            \
    item_f32_body<c10::Half, ROWS>(a, m0, rows, block, next, wf, acc);                     \
  }                                                                                        \
  TARGET void NAME##_i8(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,      \
                        int64_t next, float* wf, float* acc) {                             \
    item_f32_q_body<false, QROWS<false>, ROWS>(a, m0, rows, block, next, wf, acc);         \
  }                                                                                        \
  TARGET void NAME##_u4(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,      \
                        int64_t next, float* wf, float* acc) {                             \
    item_f32_q_body<true, QROWS<true>, ROWS>(a, m0, rows, block, next, wf, acc);           \
  }
#if defined(__x86_64__)
// QROWS: the factored quantized tiles (rows per tile: as many as keep its sums in registers)
template <bool kU4> constexpr auto qrows_avx512 = qrows_f32_avx512<8, kU4>;
template <bool kU4> constexpr auto qrows_avx2 = qrows_f32<2, kU4>;
template <bool kU4> constexpr auto qrows_scalar = qrows_f32<2, kU4>;
PS_DEFINE_F32(lin_avx512, PS_TARGET_AVX512, rows_f32, qrows_avx512)
PS_DEFINE_F32(lin_avx2, PS_TARGET_AVX2, rows_f32_avx2, qrows_avx2)
#endif
PS_DEFINE_F32(lin_scalar, , rows_f32, qrows_scalar)

ItemF32Fn pick_f32(Isa isa, at::ScalarType w_dtype) {
  if (w_dtype == at::kChar || w_dtype == at::kByte) {
    const bool u4 = w_dtype == at::kByte;
#if defined(__x86_64__)
    if (isa >= Isa::kAvx512) return u4 ? lin_avx512_u4 : lin_avx512_i8;
    if (isa >= Isa::kAvx2) return u4 ? lin_avx2_u4 : lin_avx2_i8;
#endif
    return u4 ? lin_scalar_u4 : lin_scalar_i8;
  }
  PS_ISA_DTYPE_TABLE(ItemF32Fn, table, lin_scalar, lin_avx2, lin_avx512);
  return table[static_cast<int>(at_most(isa, Isa::kAvx512))][dtype_index(w_dtype)];
}

// ---------------------------------------------------------------------------------------------
// AVX512-BF16 path: bf16 x and weights, vdpbf16ps; each element is one float32 accumulator
// that adds x[2j] w[2j] + x[2j+1] w[2j+1] for j = 0 .. K2-1 in order.

#if defined(__x86_64__)

template <int MR>
PS_BF16_TARGET PS_INLINE void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w,
                                        int64_t k2, float* acc) {
  __m512 a0[MR], a1[MR];
  for (int m = 0; m < MR; ++m) {
    a0[m] = _mm512_setzero_ps();
    a1[m] = _mm512_setzero_ps();
  }
  for (int64_t kp = 0; kp < k2; ++kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * 2 * kBlockN);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kp * 2 * kBlockN + kBlockN);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      a0[m] = _mm512_dpbf16_ps(a0[m], xb, w0);
      a1[m] = _mm512_dpbf16_ps(a1[m], xb, w1);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(acc + m * kBlockN, a0[m]);
    _mm512_storeu_ps(acc + m * kBlockN + 16, a1[m]);
  }
}

// One item on bf16 weights `w` (a packed block, or an int8 block converted to bf16).
PS_BF16_TARGET void item_bf16_dp(const LinearArgs& a, int64_t m0, int64_t rows,
                                 const uint16_t* w, float* acc) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * a.ldx;
  int64_t m = 0;
  for (; m + kTileMBf16 <= rows; m += kTileMBf16) {
    tile_bf16<kTileMBf16>(x + m * a.ldx, a.ldx, w, a.k2, acc + m * kBlockN);
  }
  const uint16_t* xt = x + m * a.ldx;
  float* at = acc + m * kBlockN;
  switch (rows - m) {
    case 7: tile_bf16<7>(xt, a.ldx, w, a.k2, at); break;
    case 6: tile_bf16<6>(xt, a.ldx, w, a.k2, at); break;
    case 5: tile_bf16<5>(xt, a.ldx, w, a.k2, at); break;
    case 4: tile_bf16<4>(xt, a.ldx, w, a.k2, at); break;
    case 3: tile_bf16<3>(xt, a.ldx, w, a.k2, at); break;
    case 2: tile_bf16<2>(xt, a.ldx, w, a.k2, at); break;
    case 1: tile_bf16<1>(xt, a.ldx, w, a.k2, at); break;
    default: break;
  }
}

// Group-quantized weights on vdpbf16ps, factored as qtile_f32 (D per group, then s D + m X
// into one float32 accumulator per output), the codes turned into bf16 in registers:
//   4-bit: code q as the bf16 128 + q (bits 0x4300 | q, exact), so D' = sum x (128 + q) and
//     D = D' - 128 X (one rounding): a nibble becomes a bf16 in two integer ops;
//   int8: q as the bf16 q (exact: |q| <= 128 fits bf16's 8 significant bits).
// Each product of a bf16 x and such a code is exact in float32.

// 16 columns of a 4-bit k pair (16 bytes, low nibble k even) -> 16 bf16 pairs (128 + q).
PS_BF16_TARGET PS_INLINE __m512i codes_u4_bf16(const uint8_t* src) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m512i even = _mm512_and_si512(v, _mm512_set1_epi32(0x0F));
  const __m512i odd = _mm512_and_si512(_mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000F0000));
  // even | odd | 0x43004300 (vpternlogd: A | B | C)
  return _mm512_ternarylogic_epi32(even, odd, _mm512_set1_epi32(0x43004300), 0xFE);
}

// 16 columns of an int8 k pair (32 bytes [16][2]) -> 16 bf16 pairs, the same order.
PS_BF16_TARGET PS_INLINE __m512i codes_i8_bf16(const int8_t* src) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// `wb`: the block's codes as those bf16 [K2][32][2] (an item of kCodesOnceRows rows or more
// converts them once), or nullptr: converted from `w` in each tile. The same values either way.
// k pair `kp` of a block's codes as bf16 pairs: columns 0..15 in w0, 16..31 in w1.
template <bool kU4>
PS_BF16_TARGET PS_INLINE void codes_bf16(const void* w, int64_t kp, __m512i& w0, __m512i& w1) {
  if constexpr (kU4) {
    const uint8_t* src = static_cast<const uint8_t*>(w) + kp * kBlockN;
    w0 = codes_u4_bf16(src);
    w1 = codes_u4_bf16(src + 16);
  } else {
    const int8_t* src = static_cast<const int8_t*>(w) + kp * 2 * kBlockN;
    w0 = codes_i8_bf16(src);
    w1 = codes_i8_bf16(src + kBlockN);
  }
}

template <int MR, bool kU4>
PS_BF16_TARGET PS_INLINE void qtile_bf16(const uint16_t* x, int64_t ldx, const void* w,
                                         const uint16_t* wb, int64_t k2, const float* gs,
                                         const float* gm, int64_t pairs, const float* xs,
                                         int64_t ldxs, float* acc) {
  __m512 a0[MR], a1[MR];
  for (int m = 0; m < MR; ++m) {
    a0[m] = _mm512_setzero_ps();
    a1[m] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < k2 / pairs; ++g) {
    __m512 d0[MR], d1[MR];
    for (int m = 0; m < MR; ++m) {
      d0[m] = _mm512_setzero_ps();
      d1[m] = _mm512_setzero_ps();
    }
    for (int64_t kp = g * pairs; kp < (g + 1) * pairs; ++kp) {
      __m512i w0, w1;
      if (wb != nullptr) {
        w0 = _mm512_loadu_si512(wb + kp * 2 * kBlockN);
        w1 = _mm512_loadu_si512(wb + kp * 2 * kBlockN + kBlockN);
      } else {
        codes_bf16<kU4>(w, kp, w0, w1);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * ldx + 2 * kp, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        d0[m] = _mm512_dpbf16_ps(d0[m], xb, (__m512bh)w0);
        d1[m] = _mm512_dpbf16_ps(d1[m], xb, (__m512bh)w1);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(gs + g * kBlockN), s1 = _mm512_loadu_ps(gs + g * kBlockN + 16);
    for (int m = 0; m < MR; ++m) {
      __m512 xg = _mm512_setzero_ps();
      if (xs != nullptr) xg = _mm512_set1_ps(xs[m * ldxs + g]);
      if constexpr (kU4) {  // D = D' - 128 X, rounded once
        const __m512 x128 = _mm512_mul_ps(xg, _mm512_set1_ps(128.0f));  // (exact)
        d0[m] = _mm512_sub_ps(d0[m], x128);
        d1[m] = _mm512_sub_ps(d1[m], x128);
      }
      a0[m] = _mm512_fmadd_ps(s0, d0[m], a0[m]);
      a1[m] = _mm512_fmadd_ps(s1, d1[m], a1[m]);
      if (gm != nullptr) {
        a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(gm + g * kBlockN), xg, a0[m]);
        a1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(gm + g * kBlockN + 16), xg, a1[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(acc + m * kBlockN, a0[m]);
    _mm512_storeu_ps(acc + m * kBlockN + 16, a1[m]);
  }
}

// One item of group-quantized weights on the vdpbf16ps path.
template <bool kU4>
PS_BF16_TARGET void item_bf16_q(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,
                                float* acc, uint16_t* wb) {
  const void* w = static_cast<const int8_t*>(a.packed) + block * a.k2 * (kU4 ? 1 : 2) * kBlockN;
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * a.ldx;
  const int64_t ngroups = a.k / a.group, offset = block * ngroups * kBlockN;
  const float* gs = a.group_scale + offset;
  const float* gm = a.group_min != nullptr ? a.group_min + offset : nullptr;
  const float* xs = a.xsum != nullptr ? a.xsum + m0 * ngroups : nullptr;
  const int64_t pairs = a.group / 2;
  const uint16_t* codes = nullptr;
  if (rows >= kCodesOnceRows) {  // many tiles: the codes converted once
    for (int64_t kp = 0; kp < a.k2; ++kp) {
      __m512i w0, w1;
      codes_bf16<kU4>(w, kp, w0, w1);
      _mm512_storeu_si512(wb + kp * 2 * kBlockN, w0);
      _mm512_storeu_si512(wb + kp * 2 * kBlockN + kBlockN, w1);
    }
    codes = wb;
  }
  int64_t m = 0;
  for (; m + kTileMQ <= rows; m += kTileMQ) {
    qtile_bf16<kTileMQ, kU4>(x + m * a.ldx, a.ldx, w, codes, a.k2, gs, gm, pairs,
                                xs != nullptr ? xs + m * ngroups : nullptr, ngroups,
                                acc + m * kBlockN);
  }
  // the rest in one tile of their own (a row's chain is the same in a tile of any size)
  const uint16_t* xt = x + m * a.ldx;
  const float* xst = xs != nullptr ? xs + m * ngroups : nullptr;
  float* at = acc + m * kBlockN;
  switch (rows - m) {
#define PS_QTAIL(R) \
  case R: qtile_bf16<R, kU4>(xt, a.ldx, w, codes, a.k2, gs, gm, pairs, xst, ngroups, at); break;
    PS_QTAIL(7)
    PS_QTAIL(6)
    PS_QTAIL(5)
    PS_QTAIL(4)
    PS_QTAIL(3)
    PS_QTAIL(2)
    PS_QTAIL(1)
#undef PS_QTAIL
    default: break;
  }
}

// A quantized block -> bf16 [K2][32][2] (the bf16 bodies' weights): int8 codes [K2][32][2]
// as they are (exact; per-channel scales), or q * s + m with each group's scale and min
// (`group_scale` / `group_min`: [K / group][32] of this block; no min: 0), rounded to nearest
// even as a float32 -> bf16 cast rounds (the float copy's values: the AMX path's). 4-bit codes
// ([K2][32], k = 2 kp in the low nibble) always have group scales.
PS_BF16_TARGET void convert_block_i8_bf16(const int8_t* w, int64_t k2, const float* group_scale,
                                          const float* group_min, int64_t group,
                                          uint16_t* dst) {
  // element j of a k pair's 64 is column j / 2: the 16 floats of quarter i are columns
  // 8 i .. 8 i + 7, each twice
  const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const float* s = group_scale;  // this k pair's group's scales (and mins at `mn`)
  const float* mn = group_min;
  const int64_t pairs_per_group = group / 2;
  int64_t left = pairs_per_group;  // k pairs left in the group of `s`
  for (int64_t kp = 0; kp < k2; ++kp) {
    const int8_t* src = w + kp * 2 * kBlockN;
    __m512 f[4];
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * i));
      f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    }
    if (group_scale != nullptr) {
      if (left == 0) {
        s += kBlockN;
        if (mn != nullptr) mn += kBlockN;
        left = pairs_per_group;
      }
      --left;
      for (int i = 0; i < 4; ++i) {
        const __m512 s2 = _mm512_permutexvar_ps(
            twice, _mm512_castps256_ps512(_mm256_loadu_ps(s + 8 * i)));
        if (mn == nullptr) {
          f[i] = _mm512_mul_ps(f[i], s2);
        } else {  // (q * s is exact: the fma rounds as q * s + m does)
          f[i] = _mm512_fmadd_ps(f[i], s2, _mm512_permutexvar_ps(
              twice, _mm512_castps256_ps512(_mm256_loadu_ps(mn + 8 * i))));
        }
      }
    }
    _mm512_storeu_si512(dst + kp * 2 * kBlockN, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
    _mm512_storeu_si512(dst + kp * 2 * kBlockN + kBlockN,
                        (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]));
  }
}

PS_BF16_TARGET void convert_block_u4_bf16(const uint8_t* w, int64_t k2, const float* group_scale,
                                          const float* group_min, int64_t group,
                                          uint16_t* dst) {
  const __m512i low = _mm512_set1_epi32(0x0F);
  const float* s = group_scale;
  const float* mn = group_min;
  const int64_t pairs_per_group = group / 2;
  int64_t left = pairs_per_group;
  for (int64_t kp = 0; kp < k2; ++kp) {
    if (left == 0) {
      s += kBlockN;
      if (mn != nullptr) mn += kBlockN;
      left = pairs_per_group;
    }
    --left;
    for (int h = 0; h < 2; ++h) {  // columns 16 h .. 16 h + 15
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kp * kBlockN + 16 * h)));
      __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
      __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
      const __m512 sv = _mm512_loadu_ps(s + 16 * h);
      if (mn == nullptr) {
        even = _mm512_mul_ps(even, sv);
        odd = _mm512_mul_ps(odd, sv);
      } else {
        const __m512 mv = _mm512_loadu_ps(mn + 16 * h);
        even = _mm512_fmadd_ps(even, sv, mv);
        odd = _mm512_fmadd_ps(odd, sv, mv);
      }
      // column c's pair (k even, k odd) is one 32-bit lane: even's bf16 low, odd's high
      const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
      const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
      _mm512_storeu_si512(dst + kp * 2 * kBlockN + 2 * 16 * h,
                          _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
    }
  }
}
#endif

// AMX path: one brgemm per (rows tile, column block), K whole, on bf16 weights `w_bits`.
void item_bf16_amx(const LinearArgs& a, int64_t m0, int64_t rows, const uint16_t* w_bits,
                   float* acc) {
  const auto* w = reinterpret_cast<const at::BFloat16*>(w_bits);
  const auto* x = static_cast<const at::BFloat16*>(a.x) + m0 * a.ldx;
  for (int64_t m = 0; m < rows; m += kTileMAmx) {
    const int64_t mt = std::min(kTileMAmx, rows - m);
    at::native::cpublas::brgemm(mt, kBlockN, a.k2 * 2, a.ldx, kBlockN, kBlockN, false,
                                x + m * a.ldx, w, acc + m * kBlockN, /*is_vnni=*/true);
  }
}

// ---------------------------------------------------------------------------------------------
// The op

// The epilogue of one item: its float32 accumulators (+ bias) -> y in out_dtype. Compiled for
// AVX-512, AVX2 and the baseline.
template <typename Out>
PS_INLINE void store_item_body(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,
                               float* acc) {
  const int64_t n0 = block * kBlockN, cols = std::min(kBlockN, a.n - n0);
  if (a.scale != nullptr) {  // int8 weights, a scale per output channel
    const float* s = a.scale + n0;
    for (int64_t m = 0; m < rows; ++m) {
      float* row = acc + m * kBlockN;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) row[c] *= s[c];
    }
  }
  store_block<Out>(acc, m0, rows, block, a.n, a.bias, a.silu_mul, a.y);
}

using StoreFn = void (*)(const LinearArgs&, int64_t, int64_t, int64_t, float*);

#define PS_DEFINE_STORE(NAME, TARGET)                                                       \
  TARGET void NAME(const LinearArgs& a, int64_t m0, int64_t rows, int64_t block,            \
                   float* acc) {                                                            \
    switch (a.out_dtype) {                                                                  \
      case at::kFloat: store_item_body<float>(a, m0, rows, block, acc); break;              \
      case at::kBFloat16: store_item_body<c10::BFloat16>(a, m0, rows, block, acc); break;   \
      default: store_item_body<c10::Half>(a, m0, rows, block, acc); break;                  \
    }                                                                                       \
  }
#if defined(__x86_64__)
PS_DEFINE_STORE(store_item_avx512, PS_TARGET_AVX512)
PS_DEFINE_STORE(store_item_avx2, PS_TARGET_AVX2)
#endif
PS_DEFINE_STORE(store_item_baseline, )

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t out_features,
                  const std::optional<at::Tensor>& bias_in,
                  std::optional<at::ScalarType> out_dtype_in,
                  const std::optional<at::Tensor>& weight_scale, bool silu_mul,
                  const std::optional<at::Tensor>& weight_min) {
  TORCH_CHECK_VALUE(x_in.dim() == 2, "linear: x must be [M, K], got ", x_in.sizes());
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && packed.device().is_cpu(),
                    "linear: x and the packed weight must be on the CPU");
  const auto w_dtype = packed.scalar_type();
  const auto x_dtype = x_in.scalar_type();
  const bool u4_weight = w_dtype == at::kByte;  // 4-bit codes, two k a byte
  const bool int8_weight = w_dtype == at::kChar || u4_weight;  // quantized: int8 or 4-bit codes
  const bool has_scale = weight_scale.has_value() && weight_scale->defined();
  const bool has_min = weight_min.has_value() && weight_min->defined();
  if (int8_weight) {
    const char* kind = u4_weight ? "4-bit" : "int8";
    TORCH_CHECK_VALUE(x_dtype == at::kFloat || x_dtype == at::kBFloat16 || x_dtype == at::kHalf,
                      "linear: x must be float32, bfloat16 or float16 with ", kind,
                      " weights, got ", x_dtype);
    TORCH_CHECK_VALUE(has_scale, "linear: ", kind, " weights need weight_scale");
  } else {
    TORCH_CHECK_VALUE(x_dtype == w_dtype, "linear: x is ", x_dtype, " but the packed weight is ",
                      w_dtype);
    TORCH_CHECK_VALUE(!has_scale && !has_min,
                      "linear: weight_scale is for int8 weights (and 4-bit ones), not ", w_dtype);
  }
  const int64_t m = x_in.size(0), k = x_in.size(1);
  const bool f32_weight = w_dtype == at::kFloat;
  TORCH_CHECK_VALUE(packed.is_contiguous() && packed.dim() == (f32_weight || u4_weight ? 3 : 4) &&
                        packed.size(2) == kBlockN &&
                        (f32_weight || u4_weight || packed.size(3) == 2),
                    "linear: packed weight of shape ", packed.sizes(),
                    " is not pack_linear_weight's output");
  const int64_t num_blocks = packed.size(0);
  const int64_t k2 = f32_weight ? k : packed.size(1);
  TORCH_CHECK_VALUE(f32_weight ? packed.size(1) == k : (k + 1) / 2 == k2, "linear: x has K = ",
                    k, " features, the packed weight ",
                    f32_weight ? packed.size(1) : 2 * packed.size(1));
  TORCH_CHECK_VALUE(out_features > (num_blocks - 1) * kBlockN &&
                        out_features <= num_blocks * kBlockN,
                    "linear: out_features ", out_features, " does not fit ", num_blocks,
                    " packed blocks of ", kBlockN);
  const float* scale = nullptr;
  const float* group_scale = nullptr;
  int64_t group = 0;
  if (int8_weight) {
    const at::Tensor& s = *weight_scale;
    TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat && s.is_contiguous() && s.device().is_cpu(),
                      "linear: weight_scale must be a contiguous float32 CPU tensor");
    if (s.dim() == 1) {
      TORCH_CHECK_VALUE(s.size(0) == out_features, "linear: weight_scale per output channel "
                        "must be [", out_features, "], got ", s.sizes());
      scale = s.data_ptr<float>();
    } else {
      TORCH_CHECK_VALUE(s.dim() == 3 && s.size(0) == num_blocks && s.size(2) == kBlockN &&
                            s.size(1) > 0 && k % s.size(1) == 0 && (k / s.size(1)) % 2 == 0,
                        "linear: weight_scale per group must be [", num_blocks,
                        ", K / G, 32] with an even group size G dividing K = ", k, ", got ",
                        s.sizes());
      group_scale = s.data_ptr<float>();
      group = k / s.size(1);
    }
  }
  TORCH_CHECK_VALUE(!u4_weight || group_scale != nullptr,
                    "linear: 4-bit weights need a weight_scale per group");
  const float* group_min = nullptr;
  if (has_min) {
    const at::Tensor& mn = *weight_min;
    TORCH_CHECK_VALUE(group_scale != nullptr && mn.scalar_type() == at::kFloat &&
                          mn.is_contiguous() && mn.device().is_cpu() &&
                          mn.sizes() == weight_scale->sizes(),
                      "linear: weight_min must be a contiguous float32 CPU tensor of the "
                      "per-group weight_scale's shape, got ", mn.sizes());
    group_min = mn.data_ptr<float>();
  }
  const Output out = make_output("linear", x_in, out_features, out_dtype_in, bias_in,
                                 silu_mul);
  const at::Tensor y = out.y, bias = out.bias;  // (named: lambdas below capture them)
  const auto out_dtype = y.scalar_type();
  if (m == 0) return y;

  const Isa isa = active_isa();
  enum class Path { kF32, kBf16Dp, kAmx } path = Path::kF32;
  if ((w_dtype == at::kBFloat16 || (int8_weight && x_dtype == at::kBFloat16)) &&
      isa >= Isa::kAvx512Bf16) {
    path = isa >= Isa::kAmx ? Path::kAmx : Path::kBf16Dp;
  }
  at::Tensor x;  // what the items read
  if (path == Path::kF32) {
    x = x_in.to(at::kFloat).contiguous();
  } else if (k % 2 != 0 || !x_in.is_contiguous()) {  // pairs: K even, rows contiguous
    x = at::zeros({m, 2 * k2}, x_in.options());
    x.narrow(1, 0, k).copy_(x_in);
  } else {
    x = x_in;
  }
  LinearArgs a;
  a.x = x.data_ptr();
  a.ldx = x.size(1);
  a.packed = packed.data_ptr();
  a.k = k;
  a.k2 = k2;
  a.n = out_features;
  a.m = m;
  a.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
  a.y = y.data_ptr();
  a.w_dtype = w_dtype;
  a.out_dtype = out_dtype;
  a.x_dtype = x_dtype;
  a.scale = scale;
  a.group_scale = group_scale;
  a.group_min = group_min;
  a.group = group;
  // The group sums of x (qtile_f32's / qtile_bf16's X), from the values the items read, one
  // float32 chain per (row, group): where mins are added, or 4-bit codes are read as 128 + q.
  const bool factored = group_scale != nullptr && path != Path::kAmx;
  at::Tensor xsum;
  if (factored && (group_min != nullptr || (u4_weight && path == Path::kBf16Dp))) {
    const int64_t ngroups = k / group;
    xsum = at::empty({m, ngroups}, x_in.options().dtype(at::kFloat));
    float* xs = xsum.data_ptr<float>();
    const bool f32_x = path == Path::kF32;
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t g = 0; g < ngroups; ++g) {
          float sum = 0.0f;
          for (int64_t j = g * group; j < (g + 1) * group; ++j) {
            sum += f32_x ? static_cast<const float*>(a.x)[r * a.ldx + j]
                         : static_cast<float>(static_cast<const c10::BFloat16*>(a.x)[r * a.ldx + j]);
          }
          xs[r * ngroups + g] = sum;
        }
      }
    });
  }
  a.xsum = xsum.defined() ? xsum.data_ptr<float>() : nullptr;
  a.silu_mul = silu_mul;
  const ItemF32Fn f32_fn = pick_f32(isa, w_dtype);
#if defined(__x86_64__)
  const StoreFn store_fn = isa >= Isa::kAvx512 ? store_item_avx512
                           : isa >= Isa::kAvx2  ? store_item_avx2
                                                : store_item_baseline;
#else
  const StoreFn store_fn = store_item_baseline;
#endif

  const int64_t chunks = (m + kChunkM - 1) / kChunkM;
  const int64_t items = chunks * num_blocks;  // item i: rows chunk i / num_blocks, block i % nb
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(std::min(kChunkM, m) * kBlockN);
    // the f32 path's unpacked weight block, or a quantized block's codes (a float32 weight is
    // read in place)
    std::vector<float> wf(path == Path::kF32 && !f32_weight ? k * kBlockN : 0);
    // quantized weights on a bf16 path: the item's block converted to bf16 (its weights; with
    // group scales off AMX, its codes)
    std::vector<uint16_t> wbf(path != Path::kF32 && int8_weight ? k2 * 2 * kBlockN : 0);
    const int64_t num_groups = group > 0 ? k / group : 0;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i / num_blocks, block = i % num_blocks;
      const int64_t m0 = chunk * kChunkM, rows = std::min(kChunkM, m - m0);
      const uint16_t* w = nullptr;  // the bf16 paths' weights
      if (path != Path::kF32 && !int8_weight) {
        w = static_cast<const uint16_t*>(a.packed) + block * k2 * 2 * kBlockN;
      }
#if defined(__x86_64__)
      if (path == Path::kBf16Dp && factored) {
        if (u4_weight) {
          item_bf16_q<true>(a, m0, rows, block, acc.data(), wbf.data());
        } else {
          item_bf16_q<false>(a, m0, rows, block, acc.data(), wbf.data());
        }
        store_fn(a, m0, rows, block, acc.data());
        continue;
      }
      if (path != Path::kF32 && int8_weight) {
        const int64_t g = block * num_groups * kBlockN;
        const float* gs = group_scale != nullptr ? group_scale + g : nullptr;
        const float* gm = group_min != nullptr ? group_min + g : nullptr;
        if (u4_weight) {
          convert_block_u4_bf16(static_cast<const uint8_t*>(a.packed) + block * k2 * kBlockN,
                                k2, gs, gm, group, wbf.data());
        } else {
          convert_block_i8_bf16(static_cast<const int8_t*>(a.packed) + block * k2 * 2 * kBlockN,
                                k2, gs, gm, group, wbf.data());
        }
        w = wbf.data();
      }
#endif
      switch (path) {
        case Path::kAmx: item_bf16_amx(a, m0, rows, w, acc.data()); break;
#if defined(__x86_64__)
        case Path::kBf16Dp: item_bf16_dp(a, m0, rows, w, acc.data()); break;
#endif
        default:
          f32_fn(a, m0, rows, block, i + 1 < end ? (i + 1) % num_blocks : -1, wf.data(),
                 acc.data());
          break;
      }
      store_fn(a, m0, rows, block, acc.data());
    }
    if (path == Path::kAmx) at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  });
  return y;
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def(
      "linear(Tensor x, Tensor packed_weight, int out_features, Tensor? bias=None, "
      "ScalarType? out_dtype=None, Tensor? weight_scale=None, bool silu_mul=False, "
      "Tensor? weight_min=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("pack_linear_weight", &pagedserve::pack_linear_weight);
  m.impl("linear", &pagedserve::linear);
}

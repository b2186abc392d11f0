// The integer products of paged attention over an int8 cache in the pair layout
// (cpu_paged_attention.cpp, Path::kI8; kernels/kv_layout.py draws the layout):
//
//   K^T  [head_dim / 2][block_size][2] int8, then block_size scale codes   per (block, KV head)
//   V    [block_size / 2][head_dim][2] int8, then block_size scale codes
//
// Nothing is dequantized: each row's scale is folded into the float32 epilogue of its product.
//   S = Q K^T   Q quantized per row to int16 (round(q * 32767 / max|q|), scale qs), the int8
//               K pairs widened to int16 in registers, exact int32 sums over the head dims,
//               s[m][t] = (float(sum) * qs[m]) * ks[t]   (ks[t]: key t's scale)
//   P V         w[t] = p[t] * vs[t] (V's scale folded into P), quantized per row and chunk to
//               int16 (round(w * W / max w), W = at most 32767, scale ws), exact int32 sums
//               over the chunk's key pairs, acc[m][e] += float(sum) * ws[m]
// Both are products of int16 pairs summed into int32 (vpdpwssd on AVX512-VNNI; vpmaddwd +
// vpaddd on AVX2; int32 loops on the scalar body): exact, so every body gives the same sums in
// any order and a row's result depends on its own keys only (row invariance). int16 keeps
// ~15 significant bits of Q and of P (bf16 keeps 8); overflow is ruled out by the bounds
// 32767 * 127 * head_dim (head_dim <= 512) and W * 127 * chunk (the caller picks W).
// llama.cpp's q8_0 cache also multiplies quantized Q by quantized K (ggml vec_dot_q8_0_q8_0),
// with 8-bit Q; vLLM's CPU backend dequantizes an fp8 cache to the compute dtype instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_vnni.h"

#ifndef PS_INLINE
#define PS_INLINE inline __attribute__((always_inline))
#endif

namespace pagedserve {

// x [d] float32 -> q [d] int16 = round-half-even(x * 32767 / max|x|); returns the row's scale
// max|x| / 32767 (0 and all-zero q for an all-zero row).
PS_INLINE float quantize_i16_row(const float* x, int64_t d, int16_t* q) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (!(amax > 0.0f)) {
    std::fill(q, q + d, int16_t{0});
    return 0.0f;
  }
  const float f = 32767.0f / amax;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    q[i] = static_cast<int16_t>(std::clamp(std::nearbyint(x[i] * f), -32767.0f, 32767.0f));
  }
  return amax / 32767.0f;
}

// Two int16 values as one int32 (a pair, for a broadcast).
PS_INLINE int32_t pair_bits(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// s[m][0 .. 16 * NR) for MR rows: key runs of 16 (run r's pair j at k[r] + j * ld[r] bytes,
// 32 bytes: 16 keys x 2 dims; ld 0 for a run of zeros), q [MR][d] int16 (row m at q + m * d),
// scaled by qs[m] and ks[0 .. 16 * NR). One function per body (each with its target).
template <int MR, int NR>
PS_INLINE void qk_tile_i8_scalar(const int16_t* q, int64_t d, const int8_t* const* k,
                                 const int64_t* ld, const float* qs, const float* ks, float* s,
                                 int64_t ldk) {
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) {
      int32_t acc[16] = {0};
      for (int64_t j = 0; j < d / 2; ++j) {
        const int8_t* kr = k[r] + j * ld[r];
        const int32_t q0 = q[m * d + 2 * j], q1 = q[m * d + 2 * j + 1];
        for (int t = 0; t < 16; ++t) acc[t] += q0 * kr[2 * t] + q1 * kr[2 * t + 1];
      }
      for (int t = 0; t < 16; ++t) {
        s[m * ldk + 16 * r + t] = (static_cast<float>(acc[t]) * qs[m]) * ks[16 * r + t];
      }
    }
  }
}

// acc[m][e0 .. e0 + 16 * NE) += ws[m] * sum over the key pairs [i0, i1) of w[m][2i], w[m][2i+1]
// (int16, row m at w + m * ldw) times pair row vpair[i] ([head_dim][2] int8: dims e of keys
// 2i, 2i + 1) for MR rows; ctx.pump() every 16 pairs (the caller's prefetch queue).
template <int MR, int NE, typename Ctx>
PS_INLINE void pv_tile_i8_scalar(const int16_t* w, int64_t ldw, const int8_t* const* vpair,
                                 int64_t i0, int64_t i1, int64_t e0, const float* ws, float* acc,
                                 int64_t d, Ctx& ctx) {
  for (int m = 0; m < MR; ++m) {
    int32_t a[16 * NE] = {0};
    for (int64_t i = i0; i < i1; ++i) {
      if (m == 0 && (i - i0) % 16 == 0) ctx.pump();
      const int8_t* v = vpair[i] + 2 * e0;
      const int32_t w0 = w[m * ldw + 2 * i], w1 = w[m * ldw + 2 * i + 1];
      for (int e = 0; e < 16 * NE; ++e) a[e] += w0 * v[2 * e] + w1 * v[2 * e + 1];
    }
    for (int e = 0; e < 16 * NE; ++e) acc[m * d + e0 + e] += static_cast<float>(a[e]) * ws[m];
  }
}

#if defined(__x86_64__)
template <int MR, int NR>
PS_TARGET_VNNI512 PS_INLINE void qk_tile_i8_vnni512(const int16_t* q, int64_t d,
                                                    const int8_t* const* k, const int64_t* ld,
                                                    const float* qs, const float* ks, float* s,
                                                    int64_t ldk) {
  __m512i acc[MR][NR];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_si512();
  }
  for (int64_t j = 0; j < d / 2; ++j) {
    __m512i kv[NR];
    for (int r = 0; r < NR; ++r) {
      kv[r] = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k[r] + j * ld[r])));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i qb = _mm512_set1_epi32(pair_bits(q + m * d + 2 * j));
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpwssd_epi32(acc[m][r], kv[r], qb);
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 sq = _mm512_set1_ps(qs[m]);
    for (int r = 0; r < NR; ++r) {
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[m][r]), sq);
      _mm512_storeu_ps(s + m * ldk + 16 * r, _mm512_mul_ps(v, _mm512_loadu_ps(ks + 16 * r)));
    }
  }
}

template <int MR, int NE, typename Ctx>
PS_TARGET_VNNI512 PS_INLINE void pv_tile_i8_vnni512(const int16_t* w, int64_t ldw,
                                                    const int8_t* const* vpair, int64_t i0,
                                                    int64_t i1, int64_t e0, const float* ws,
                                                    float* acc, int64_t d, Ctx& ctx) {
  __m512i a[MR][NE];
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NE; ++n) a[m][n] = _mm512_setzero_si512();
  }
  for (int64_t i = i0; i < i1; ++i) {
    if ((i - i0) % 16 == 0) ctx.pump();
    __m512i vv[NE];
    for (int n = 0; n < NE; ++n) {
      vv[n] = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vpair[i] + 2 * (e0 + 16 * n))));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i wb = _mm512_set1_epi32(pair_bits(w + m * ldw + 2 * i));
      for (int n = 0; n < NE; ++n) a[m][n] = _mm512_dpwssd_epi32(a[m][n], vv[n], wb);
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 sw = _mm512_set1_ps(ws[m]);
    for (int n = 0; n < NE; ++n) {
      float* dst = acc + m * d + e0 + 16 * n;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst),
                                          _mm512_mul_ps(_mm512_cvtepi32_ps(a[m][n]), sw)));
    }
  }
}

// AVX2: 8 keys / dims per register, vpmaddwd + vpaddd for each pair product.
template <int MR, int NR>
PS_TARGET_AVX2 PS_INLINE void qk_tile_i8_avx2(const int16_t* q, int64_t d, const int8_t* const* k,
                                              const int64_t* ld, const float* qs, const float* ks,
                                              float* s, int64_t ldk) {
  __m256i acc[MR][2 * NR];
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < 2 * NR; ++r) acc[m][r] = _mm256_setzero_si256();
  }
  for (int64_t j = 0; j < d / 2; ++j) {
    __m256i kv[2 * NR];
    for (int r = 0; r < NR; ++r) {
      const int8_t* src = k[r] + j * ld[r];
      kv[2 * r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      kv[2 * r + 1] =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
    }
    for (int m = 0; m < MR; ++m) {
      const __m256i qb = _mm256_set1_epi32(pair_bits(q + m * d + 2 * j));
      for (int r = 0; r < 2 * NR; ++r) {
        acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(kv[r], qb));
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m256 sq = _mm256_set1_ps(qs[m]);
    for (int r = 0; r < 2 * NR; ++r) {
      const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][r]), sq);
      _mm256_storeu_ps(s + m * ldk + 8 * r, _mm256_mul_ps(v, _mm256_loadu_ps(ks + 8 * r)));
    }
  }
}

template <int MR, int NE, typename Ctx>
PS_TARGET_AVX2 PS_INLINE void pv_tile_i8_avx2(const int16_t* w, int64_t ldw,
                                              const int8_t* const* vpair, int64_t i0, int64_t i1,
                                              int64_t e0, const float* ws, float* acc, int64_t d,
                                              Ctx& ctx) {
  __m256i a[MR][2 * NE];
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < 2 * NE; ++n) a[m][n] = _mm256_setzero_si256();
  }
  for (int64_t i = i0; i < i1; ++i) {
    if ((i - i0) % 16 == 0) ctx.pump();
    __m256i vv[2 * NE];
    for (int n = 0; n < 2 * NE; ++n) {
      vv[n] = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(vpair[i] + 2 * (e0 + 8 * n))));
    }
    for (int m = 0; m < MR; ++m) {
      const __m256i wb = _mm256_set1_epi32(pair_bits(w + m * ldw + 2 * i));
      for (int n = 0; n < 2 * NE; ++n) {
        a[m][n] = _mm256_add_epi32(a[m][n], _mm256_madd_epi16(vv[n], wb));
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m256 sw = _mm256_set1_ps(ws[m]);
    for (int n = 0; n < 2 * NE; ++n) {
      float* dst = acc + m * d + e0 + 8 * n;
      _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst),
                                          _mm256_mul_ps(_mm256_cvtepi32_ps(a[m][n]), sw)));
    }
  }
}
#endif

// The tiles over rows [0, rows) in tiles of 4, the last 1 .. 3 wide (a decode's G rows in one):
// qk_rows_i8_<body><NR>(q, d, k, ld, qs, ks, s, ldk, rows) and
// pv_rows_i8_<body><NE>(w, ldw, vpair, i0, i1, e0, ws, acc, d, rows, ctx), one function per body
// with its target (called, not inlined, from the generic chunk code).
#define PS_I8_ROWS(BODY, TARGET)                                                                \
  template <int NR>                                                                             \
  TARGET void qk_rows_i8_##BODY(const int16_t* q, int64_t d, const int8_t* const* k,            \
                                const int64_t* ld, const float* qs, const float* ks, float* s,  \
                                int64_t ldk, int64_t rows) {                                    \
    int64_t m = 0;                                                                              \
    for (; m + 4 <= rows; m += 4) {                                                             \
      qk_tile_i8_##BODY<4, NR>(q + m * d, d, k, ld, qs + m, ks, s + m * ldk, ldk);              \
    }                                                                                           \
    switch (rows - m) {                                                                         \
      case 3: qk_tile_i8_##BODY<3, NR>(q + m * d, d, k, ld, qs + m, ks, s + m * ldk, ldk); break; \
      case 2: qk_tile_i8_##BODY<2, NR>(q + m * d, d, k, ld, qs + m, ks, s + m * ldk, ldk); break; \
      case 1: qk_tile_i8_##BODY<1, NR>(q + m * d, d, k, ld, qs + m, ks, s + m * ldk, ldk); break; \
      default: break;                                                                           \
    }                                                                                           \
  }                                                                                             \
  template <int NE, typename Ctx>                                                               \
  TARGET void pv_rows_i8_##BODY(const int16_t* w, int64_t ldw, const int8_t* const* vpair,      \
                                int64_t i0, int64_t i1, int64_t e0, const float* ws, float* acc, \
                                int64_t d, int64_t rows, Ctx& ctx) {                            \
    int64_t m = 0;                                                                              \
    for (; m + 4 <= rows; m += 4) {                                                             \
      pv_tile_i8_##BODY<4, NE>(w + m * ldw, ldw, vpair, i0, i1, e0, ws + m, acc + m * d, d, ctx); \
    }                                                                                           \
    switch (rows - m) {                                                                         \
      case 3:                                                                                   \
        pv_tile_i8_##BODY<3, NE>(w + m * ldw, ldw, vpair, i0, i1, e0, ws + m, acc + m * d, d, ctx); \
        break;                                                                                  \
      case 2:                                                                                   \
        pv_tile_i8_##BODY<2, NE>(w + m * ldw, ldw, vpair, i0, i1, e0, ws + m, acc + m * d, d, ctx); \
        break;                                                                                  \
      case 1:                                                                                   \
        pv_tile_i8_##BODY<1, NE>(w + m * ldw, ldw, vpair, i0, i1, e0, ws + m, acc + m * d, d, ctx); \
        break;                                                                                  \
      default: break;                                                                           \
    }                                                                                           \
  }

PS_I8_ROWS(scalar, )
#if defined(__x86_64__)
PS_I8_ROWS(vnni512, PS_TARGET_VNNI512)
PS_I8_ROWS(avx2, PS_TARGET_AVX2)
#endif
#undef PS_I8_ROWS

}  // namespace pagedserve

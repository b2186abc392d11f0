// Float math shared by the native CPU kernels (attention's softmax, the linear layers' SiLU).
#pragma once

#include <cstdint>

#ifndef PS_INLINE
#define PS_INLINE inline __attribute__((always_inline))
#endif

namespace pagedserve {

// exp(x) in float32, vectorizable (Cephes expf: range reduction x = n ln2 + r, degree-6
// polynomial, 2^n through the exponent bits; ~1 ulp). Exactly 0 below -87.33 (and for -inf),
// so masked or far-below-max scores weigh nothing.
PS_INLINE float exp_approx(float x) {
  const float lo = -87.3365447504019f, hi = 88.3762626647949f;
  float xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const float fx = xc * 1.44269504088896341f + 0.5f;
  int32_t n = static_cast<int32_t>(fx);
  n -= (static_cast<float>(n) > fx) ? 1 : 0;  // floor
  const float fn = static_cast<float>(n);
  const float r = xc - fn * 0.693359375f + fn * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const float pow2n = __builtin_bit_cast(float, static_cast<uint32_t>(n + 127) << 23);
  // x < lo as a mask, not a select of two products: GCC keeps a loop with that select scalar
  const uint32_t keep = x < lo ? 0u : 0xFFFFFFFFu;
  return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, y * pow2n) & keep);
}

// SiLU (Hendrycks & Gimpel 2016, "GELUs"; Elfwing et al. 2017): x / (1 + exp(-x)), float32,
// vectorizable; x for x > 87 (exp(-x) is 0), -0 for x < -88 (exp(-x) clamps to 2^127).
PS_INLINE float silu(float x) { return x / (1.0f + exp_approx(-x)); }

}  // namespace pagedserve

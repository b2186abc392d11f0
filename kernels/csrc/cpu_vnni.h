// The int8-product bodies shared by the W8A8 and A8 ops (cpu_int8_linear.cpp,
// cpu_a8_linear.cpp): which one runs, and their target attributes.
//
//   vnni512  AVX512-VNNI vpdpbusd (u8 x s8, four products summed into each int32 lane)
//   avxvnni  AVX-VNNI vpdpbusd on 256-bit registers (Alder Lake and later, Zen 5)
//   avx2     vpmaddubsw (u8 x s8 pairs into int16) + vpmaddwd (pairs of pairs into int32)
//   scalar   int32 loops
// PAGEDSERVE_CPU_ISA caps them as it caps the other kernels; PAGEDSERVE_CPU_VNNI=0 turns the
// VNNI ones off, so that each can be tested where the CPU has it.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_isa.h"

#ifndef PS_INLINE
#define PS_INLINE inline __attribute__((always_inline))
#endif

#define PS_TARGET_VNNI512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define PS_TARGET_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))

namespace pagedserve {

enum class Body : int { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kVnni512 = 3 };

inline const char* body_name(Body b) {
  switch (b) {
    case Body::kVnni512: return "vnni512";
    case Body::kAvxVnni: return "avxvnni";
    case Body::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// The body to run now: the best the CPU has at or below PAGEDSERVE_CPU_ISA (read each call).
inline Body pick_body() {
#if defined(__x86_64__)
  const Isa isa = active_isa();
  const char* env = std::getenv("PAGEDSERVE_CPU_VNNI");
  const bool vnni = env == nullptr || std::strcmp(env, "0") != 0;
  if (vnni && isa >= Isa::kAvx512 && __builtin_cpu_supports("avx512vnni")) return Body::kVnni512;
  if (vnni && isa >= Isa::kAvx2 && __builtin_cpu_supports("avxvnni")) return Body::kAvxVnni;
  if (isa >= Isa::kAvx2) return Body::kAvx2;
#endif
  return Body::kScalar;
}

// Four bytes as one int32 (a k quad of int8 codes, for a broadcast).
PS_INLINE int32_t quad_bits(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

}  // namespace pagedserve

// Instruction-set choice shared by the native CPU kernels (attention and linear layers).
//
// One ladder, each step implying the ones below it:
//   scalar       the compiler's baseline (x86-64: SSE2)
//   avx2         AVX2 + FMA
//   avx512       AVX-512 F/BW/VL/DQ
//   avx512_bf16  + AVX512-BF16 (vdpbf16ps: bf16 pairs multiplied and summed into float32)
//   amx          + AMX-BF16 tiles, reached through ATen's cpublas::brgemm (oneDNN's ukernel)
// The best step the CPU has is found once (__builtin_cpu_supports; AMX: cpublas::could_pack,
// which is true where oneDNN packs bf16 for AMX, the OS permission included).
// PAGEDSERVE_CPU_ISA=scalar|avx2|avx512|avx512_bf16|amx|auto forces a lower step (read at every
// call; asking for more than the CPU has is an error). Each kernel takes the highest step it
// has a body for at or below the active one: attention has none above avx512.
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace pagedserve {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmx: return "amx";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

inline Isa best_isa() {
#if defined(__x86_64__)
  static const Isa best = [] {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))) {
      return (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? Isa::kAvx2
                                                                               : Isa::kScalar;
    }
    if (!__builtin_cpu_supports("avx512bf16")) return Isa::kAvx512;
    return at::native::cpublas::could_pack(at::kBFloat16) ? Isa::kAmx : Isa::kAvx512Bf16;
  }();
  return best;
#else
  return Isa::kScalar;
#endif
}

// The step to run now: the best the CPU has, or the lower one PAGEDSERVE_CPU_ISA asks for.
inline Isa active_isa() {
  const Isa best = best_isa();
  const char* env = std::getenv("PAGEDSERVE_CPU_ISA");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) return best;
  static const Isa all[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx};
  for (Isa want : all) {
    if (std::strcmp(env, isa_name(want)) != 0) continue;
    TORCH_CHECK_VALUE(static_cast<int>(want) <= static_cast<int>(best), "PAGEDSERVE_CPU_ISA=",
                      env, " but this CPU supports at most ", isa_name(best));
    return want;
  }
  TORCH_CHECK_VALUE(false, "PAGEDSERVE_CPU_ISA=", env,
                    " is not one of auto, scalar, avx2, avx512, avx512_bf16, amx");
  return best;  // (unreachable)
}

// `isa` capped at `top`: the step a kernel whose best body is `top` runs.
inline Isa at_most(Isa isa, Isa top) {
  return static_cast<int>(isa) <= static_cast<int>(top) ? isa : top;
}

// The targets a kernel body is compiled for besides the baseline (every body is compiled on
// every x86-64 machine and picked at run time).
#define PS_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
// AVX-512 + AVX512-BF16 (vdpbf16ps) + F16C: the bf16 bodies, and the AMX path's packing.
#define PS_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define PS_TARGET_AVX2 __attribute__((target("avx2,fma")))

// A body's column in the dispatch tables below: float32 0, bfloat16 1, float16 2.
inline int dtype_index(at::ScalarType dtype) {
  return dtype == at::kFloat ? 0 : dtype == at::kBFloat16 ? 1 : 2;
}

// `static const FN name[3][3]`, indexed [scalar / avx2 / avx512][dtype_index]: the functions
// SCALAR_f32, SCALAR_bf16, SCALAR_f16, AVX2_..., AVX512_... (the scalar ones off x86-64).
#if defined(__x86_64__)
#define PS_ISA_DTYPE_TABLE(FN, name, SCALAR, AVX2, AVX512)           \
  static const FN name[3][3] = {{SCALAR##_f32, SCALAR##_bf16, SCALAR##_f16}, \
                                {AVX2##_f32, AVX2##_bf16, AVX2##_f16},       \
                                {AVX512##_f32, AVX512##_bf16, AVX512##_f16}}
#else
#define PS_ISA_DTYPE_TABLE(FN, name, SCALAR, AVX2, AVX512)           \
  static const FN name[3][3] = {{SCALAR##_f32, SCALAR##_bf16, SCALAR##_f16}, \
                                {SCALAR##_f32, SCALAR##_bf16, SCALAR##_f16}, \
                                {SCALAR##_f32, SCALAR##_bf16, SCALAR##_f16}}
#endif

}  // namespace pagedserve

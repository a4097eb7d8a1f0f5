// The instruction sets hotswap's quantized CPU kernels have a path for, and the one table that
// picks a path at run time.
//
// Every path is compiled on every box: a path's functions carry their own target attribute
// (`HOTSWAP_TARGET_*` below) rather than relying on -march=native, so a missing intrinsic
// is a build error everywhere and a library built on a Zen 4 runs on an AVX2-only CPU. The
// path is chosen per call from what the CPU reports (`Supported`) and what the caller asks
// for (`Pick`): tests ask for each path the box can run, the engine asks for the best.

#pragma once

#include <cstdint>

namespace hotswap {

// Ordered best first; the numbers are the FFI attribute `isa` (`kernels/cpu_isa.py`).
enum class Isa : int32_t {
  kAvx512Vnni = 0,  // AVX-512 F/BW/VL + AVX512_VNNI (vpdpbusd): int8 x int8 dots
  kAvx512Bf16 = 1,  // AVX-512 F/BW/VL + AVX512_BF16 (vdpbf16ps): bf16 x bf16 dots
  kAvx512 = 2,      // AVX-512 F/BW/VL: f32 FMA, 16 lanes
  kAvx2Fma = 3,     // AVX2 + FMA: f32 FMA, 8 lanes
  kScalar = 4,      // plain C++: any CPU
  kAuto = -1,       // the best this CPU supports (`Best`)
};

// Each AVX-512 target includes AVX2's (avx512f implies avx2; every AVX-512 CPU has fma and f16c),
// so an AVX2 helper inlines into an AVX-512 path.
#define HOTSWAP_TARGET_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define HOTSWAP_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define HOTSWAP_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define HOTSWAP_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

inline bool Supported(Isa isa) {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case Isa::kAvx512Vnni:
      return avx512 && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx512Bf16:
      return avx512 && __builtin_cpu_supports("avx512bf16");
    case Isa::kAvx512:
      return avx512;
    case Isa::kAvx2Fma:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kScalar:
      return true;
    default:
      return false;
  }
}

// The best of `offered` (a kernel's paths, best first) this CPU supports; kScalar if none.
template <int N>
inline Isa Best(const Isa (&offered)[N]) {
  for (Isa isa : offered)
    if (Supported(isa)) return isa;
  return Isa::kScalar;
}

// The path a call runs: `asked` if the CPU supports it and the kernel offers it, the best
// offered one for kAuto; -1 cast to Isa (the caller returns an FFI error naming it) otherwise.
template <int N>
inline Isa Pick(int32_t asked, const Isa (&offered)[N]) {
  const Isa want = static_cast<Isa>(asked);
  if (want == Isa::kAuto) return Best(offered);
  bool offers = want == Isa::kScalar;
  for (Isa isa : offered) offers = offers || isa == want;
  return offers && Supported(want) ? want : Isa::kAuto;
}

}  // namespace hotswap

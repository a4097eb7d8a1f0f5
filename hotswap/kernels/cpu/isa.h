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
#include <string>

namespace hotswap {

// The numbers are the FFI attribute `isa` (`kernels/cpu_isa.py`) and never change (kernels built
// from other sources share them): a new path takes the next number. Which path is best is each
// kernel's `offered` list, best first.
enum class Isa : int32_t {
  kAvx512Vnni = 0,  // AVX-512 F/BW/VL + AVX512_VNNI (vpdpbusd zmm): int8 x int8 dots
  kAvx512Bf16 = 1,  // AVX-512 F/BW/VL + AVX512_BF16 (vdpbf16ps): bf16 x bf16 dots
  kAvx512 = 2,      // AVX-512 F/BW/VL: f32 FMA, 16 lanes
  kAvx2Fma = 3,     // AVX2 + FMA: f32 FMA, 8 lanes
  kScalar = 4,      // plain C++: any CPU
  kAvxVnni = 5,     // AVX2 + FMA + AVX-VNNI (VEX vpdpbusd ymm; Alder Lake, Sierra Forest, Zen 5): int8 dots
  kAuto = -1,       // the best this CPU supports (`Best`)
};

// The CPU features the table reads, one bit each (cpuinfo's names in `kernels/cpu_isa.py`): the
// table is a pure function of a feature set, so a test can ask what a CPU it is not on would run.
enum Feature : uint32_t {
  kFeatAvx2 = 1u << 0,
  kFeatFma = 1u << 1,
  kFeatAvx512f = 1u << 2,
  kFeatAvx512bw = 1u << 3,
  kFeatAvx512vl = 1u << 4,
  kFeatAvx512dq = 1u << 5,
  kFeatAvx512Vnni = 1u << 6,
  kFeatAvx512Bf16 = 1u << 7,
  kFeatAvxVnni = 1u << 8,
};

// Each AVX-512 target includes AVX2's (avx512f implies avx2; every AVX-512 CPU has fma and f16c),
// so an AVX2 helper inlines into an AVX-512 path.
#define HOTSWAP_TARGET_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define HOTSWAP_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define HOTSWAP_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define HOTSWAP_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-VNNI is the VEX form of AVX512_VNNI's 256-bit vpdpbusd (`_mm256_dpbusd_avx_epi32`), for AVX2
// CPUs without AVX-512.
#define HOTSWAP_TARGET_AVX_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// This CPU's features (CPUID, through the compiler's runtime).
inline uint32_t HostFeatures() {
  __builtin_cpu_init();
  uint32_t f = 0;
  f |= __builtin_cpu_supports("avx2") ? kFeatAvx2 : 0;
  f |= __builtin_cpu_supports("fma") ? kFeatFma : 0;
  f |= __builtin_cpu_supports("avx512f") ? kFeatAvx512f : 0;
  f |= __builtin_cpu_supports("avx512bw") ? kFeatAvx512bw : 0;
  f |= __builtin_cpu_supports("avx512vl") ? kFeatAvx512vl : 0;
  f |= __builtin_cpu_supports("avx512dq") ? kFeatAvx512dq : 0;
  f |= __builtin_cpu_supports("avx512vnni") ? kFeatAvx512Vnni : 0;
  f |= __builtin_cpu_supports("avx512bf16") ? kFeatAvx512Bf16 : 0;
  f |= __builtin_cpu_supports("avxvnni") ? kFeatAvxVnni : 0;
  return f;
}

// The table: the features each path needs (kUnknown, which no CPU has, for a number that names no path).
constexpr uint32_t kUnknown = 1u << 31;
constexpr uint32_t Needs(Isa isa) {
  const uint32_t avx2 = kFeatAvx2 | kFeatFma, avx512 = kFeatAvx512f | kFeatAvx512bw | kFeatAvx512vl | kFeatAvx512dq;
  switch (isa) {
    case Isa::kAvx512Vnni:
      return avx512 | kFeatAvx512Vnni;
    case Isa::kAvx512Bf16:
      return avx512 | kFeatAvx512Bf16;
    case Isa::kAvx512:
      return avx512;
    case Isa::kAvx2Fma:
      return avx2;
    case Isa::kAvxVnni:
      return avx2 | kFeatAvxVnni;
    case Isa::kScalar:
      return 0;
    default:
      return kUnknown;
  }
}

// Whether a CPU with `features` runs `isa`'s path.
constexpr bool Supported(Isa isa, uint32_t features) { return (features & ~kUnknown & Needs(isa)) == Needs(isa); }

// `features` by cpuinfo's names ("avx2 fma"), for errors that say what a CPU lacks.
inline std::string FeatureNames(uint32_t features) {
  static constexpr const char* kNames[] = {"avx2",     "fma",      "avx512f",     "avx512bw", "avx512vl",
                                           "avx512dq", "avx512_vnni", "avx512_bf16", "avx_vnni"};
  std::string out;
  for (uint32_t bit = 0; bit < sizeof(kNames) / sizeof(kNames[0]); ++bit)
    if (features & (1u << bit)) out += (out.empty() ? "" : " ") + std::string(kNames[bit]);
  return out;
}

inline bool Supported(Isa isa) { return Supported(isa, HostFeatures()); }

// The best of `offered` (a kernel's paths, best first) a CPU with `features` supports; kScalar if none.
template <int N>
inline Isa Best(const Isa (&offered)[N], uint32_t features = HostFeatures()) {
  for (Isa isa : offered)
    if (Supported(isa, features)) return isa;
  return Isa::kScalar;
}

// The path a call runs: `asked` if the CPU supports it and the kernel offers it, the best
// offered one for kAuto; -1 cast to Isa (the caller returns an FFI error naming it) otherwise.
template <int N>
inline Isa Pick(int32_t asked, const Isa (&offered)[N], uint32_t features = HostFeatures()) {
  const Isa want = static_cast<Isa>(asked);
  if (want == Isa::kAuto) return Best(offered, features);
  bool offers = want == Isa::kScalar;
  for (Isa isa : offered) offers = offers || isa == want;
  return offers && Supported(want, features) ? want : Isa::kAuto;
}

}  // namespace hotswap

// CPU feature detection, variant names, and the cached kernel table per variant.
#include "cpu.h"

#include <sys/syscall.h>
#include <unistd.h>
#if CONDUIT_X86
#include <cpuid.h>
#endif

#include <cerrno>
#include <mutex>

#include "kernels.h"

namespace conduit {

// ---------------------------------------------------------------------------------------------------------------
// Detection

namespace {

#if CONDUIT_X86
uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// AMX tile data is 8 KiB of register state that Linux (5.16+) saves only for processes that asked for it: until a
// process requests XTILEDATA with arch_prctl, its first tile instruction faults. The permission is process-wide,
// so asking once before any kernel thread runs covers every thread.
constexpr int kArchGetXcompSupp = 0x1022, kArchReqXcompPerm = 0x1023, kArchGetXcompPerm = 0x1025;
constexpr unsigned kXfeatureXtiledata = 18;

void request_amx_permission(CpuFeatures& f) {
  uint64_t supported = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompSupp, &supported) != 0) {
    f.amx_status = "the kernel cannot grant AMX (arch_prctl ARCH_GET_XCOMP_SUPP unsupported: Linux 5.16+ needed)";
    return;
  }
  if (!(supported & (uint64_t{1} << kXfeatureXtiledata))) {
    f.amx_status = "the kernel does not offer AMX tile data to processes";
    return;
  }
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    f.amx_status = errno == EPERM ? "the kernel refused AMX tile data (EPERM: signal stack too small?)"
                                  : "the kernel refused AMX tile data";
    return;
  }
  uint64_t permitted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &permitted) != 0 ||
      !(permitted & (uint64_t{1} << kXfeatureXtiledata))) {
    f.amx_status = "the kernel acknowledged the AMX request but does not list the permission";
    return;
  }
  f.amx_permitted = true;
  f.amx_status = "granted";
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax, ebx, ecx, edx;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx)) {
    f.intel = ebx == 0x756e6547 && edx == 0x49656e69 && ecx == 0x6c65746e;  // "Genu" "ineI" "ntel"
  }
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = ecx & (1u << 27);
  const bool avx = ecx & (1u << 28);
  const bool fma = ecx & (1u << 12);
  const bool f16c = ecx & (1u << 29);
  f.sse42 = ecx & (1u << 20);
  f.pclmulqdq = ecx & (1u << 1);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = read_xcr0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;        // XMM and YMM state
  const bool os_avx512 = (xcr0 & 0xE6) == 0xE6;   // plus opmask and both ZMM halves
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;  // XTILECFG and XTILEDATA
  if (!os_avx) return f;

  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  unsigned b7 = 0, c7 = 0, d7 = 0, a71 = 0;
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, eax, b7, c7, d7);
    unsigned b71, c71, d71;
    __cpuid_count(7, 1, a71, b71, c71, d71);
  }
  f.fma = fma;
  f.f16c = f16c;
  f.avx2 = b7 & (1u << 5);
  f.vpclmulqdq = c7 & (1u << 10);
  if (os_avx512) {
    f.avx512f = b7 & (1u << 16);
    f.avx512dq = b7 & (1u << 17);
    f.avx512bw = b7 & (1u << 30);
    f.avx512vl = b7 & (1u << 31);
    f.avx512vnni = c7 & (1u << 11);
    f.avx512bf16 = a71 & (1u << 5);
  }
  if (os_amx) {
    f.amx_bf16 = d7 & (1u << 22);
    f.amx_tile = d7 & (1u << 24);
    f.amx_int8 = d7 & (1u << 25);
  }
  if (f.amx_tile) request_amx_permission(f);
  return f;
}
#else
CpuFeatures detect() { return CpuFeatures{}; }  // no x86 features: the generic kernels
#endif

}  // namespace

bool decode_prefetch_ahead() {
  static const bool ahead = cpu_features().intel;
  return ahead;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

Variant best_supported_variant() {
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  if (avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni) {
    // Without the permission the first tile instruction would fault (see request_amx_permission).
    return f.amx_tile && f.amx_int8 && f.amx_permitted ? Variant::Amx : Variant::Avx512;
  }
  if (avx2) return Variant::Avx2;
  return Variant::Generic;
}

bool variant_supported(Variant v) {
  const int best = static_cast<int>(best_supported_variant());
  if (v == Variant::AmxModel) return best >= static_cast<int>(Variant::Avx512);
  return static_cast<int>(v) <= best;
}

// ---------------------------------------------------------------------------------------------------------------
// Names

const char* variant_name(Variant v) {
  switch (v) {
    case Variant::Generic: return "generic";
    case Variant::Avx2: return "avx2";
    case Variant::Avx512: return "avx512";
    case Variant::Amx: return "amx";
    case Variant::AmxModel: return "amx-model";
  }
  return "unknown";
}

bool parse_variant(const char* name, Variant* out) {
  for (int i = 0; i < kNumVariants; ++i) {
    const Variant v = static_cast<Variant>(i);
    if (std::strcmp(name, variant_name(v)) == 0) {
      *out = v;
      return true;
    }
  }
  return false;
}

bool is_supported_type(int type) {
  switch (type) {
    case kF32: case kF16: case kBF16: case kQ8_0: case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ4_K: case kQ5_K: case kQ6_K:
      return true;
    default: return false;
  }
}

const char* type_name(int type) {
  switch (type) {
    case kF32: return "f32";
    case kF16: return "f16";
    case kBF16: return "bf16";
    case kQ8_0: return "q8_0";
    case kQ4_0: return "q4_0";
    case kQ4_1: return "q4_1";
    case kQ5_0: return "q5_0";
    case kQ5_1: return "q5_1";
    case kQ4_K: return "q4_k";
    case kQ5_K: return "q5_k";
    case kQ6_K: return "q6_k";
    default: return "unsupported";
  }
}

int type_block_elements(int type) {
  switch (type) {
    case kQ8_0: case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: return 32;
    case kQ4_K: case kQ5_K: case kQ6_K: return kQK_K;
    default: return 1;
  }
}

int type_block_bytes(int type) {
  switch (type) {
    case kF32: return 4;
    case kF16: case kBF16: return 2;
    case kQ8_0: return sizeof(BlockQ8_0);
    case kQ4_0: return sizeof(BlockQ4_0);
    case kQ4_1: return sizeof(BlockQ4_1);
    case kQ5_0: return sizeof(BlockQ5_0);
    case kQ5_1: return sizeof(BlockQ5_1);
    case kQ4_K: return sizeof(BlockQ4_K);
    case kQ5_K: return sizeof(BlockQ5_K);
    case kQ6_K: return sizeof(BlockQ6_K);
    default: return 0;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Kernel tables: each variant's table is the one below it plus its own overrides.

const KernelTable& kernel_table(Variant v) {
  static KernelTable tables[kNumVariants];
  static std::once_flag once;
  std::call_once(once, [] {
    register_ops_generic(tables[0]);
    register_matmul_generic(tables[0]);
    register_attention_generic(tables[0]);
    tables[1] = tables[0];
#if CONDUIT_X86
    register_ops_avx2(tables[1]);
    register_matmul_avx2(tables[1]);
    register_attention_avx2(tables[1]);
    tables[2] = tables[1];
    register_ops_avx512(tables[2]);
    register_matmul_avx512(tables[2]);
    register_attention_avx512(tables[2]);
    // Registration only fills in function pointers: building the amx table executes no tile instruction.
    tables[3] = tables[2];
    register_matmul_amx(tables[3]);
    tables[4] = tables[2];
    register_matmul_amx_model(tables[4]);
#else
    // Never chosen (detection finds no x86 feature); a variant forced by name runs the generic kernels.
    for (int v = 2; v < kNumVariants; ++v) tables[v] = tables[0];
#endif
  });
  return tables[static_cast<int>(v)];
}

}  // namespace conduit

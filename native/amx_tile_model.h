// A software model of the AMX instructions the amx matmul kernels use (LDTILECFG, TILEZERO, TILELOADD, TILESTORED,
// TDPBSUD, TILERELEASE), written from the operation sections of Intel's ISA reference, so the kernels can run, and
// be compared bit for bit with the avx512 ones, on CPUs without AMX (the `amx-model` variant).
//
// Plain scalar C++ in its own translation unit, compiled for the baseline ISA: it shares no code with the VNNI
// kernels it is compared against, and no copy of it built for a wider ISA can be merged into the addon's other code.
// One instance is the tile state of one logical processor: 8 tiles of up to 16 rows of 64 bytes, the palette-1
// configuration, and TILES_CONFIGURED. The instructions' fault conditions (#GP for a bad configuration, #UD for a
// tile or shape the configuration does not allow) throw AmxFault, so a kernel that would fault on the hardware fails
// here too instead of computing something.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace conduit {

// The 64-byte memory operand of LDTILECFG. A plain aggregate (zero it with `AmxTileConfig c{}`): no constructor
// exists to be compiled once per ISA and merged across the files that use it.
struct alignas(64) AmxTileConfig {
  uint8_t palette_id;  // 0: the INIT state (tiles unconfigured); 1: 8 tiles of at most 16 rows x 64 bytes
  uint8_t start_row;   // row an interrupted load or store resumes from; 0 otherwise
  uint8_t reserved0[14];
  uint16_t colsb[16];  // bytes per row of tiles 0..7; entries 8..15 are reserved (zero)
  uint8_t rows[16];    // rows of tiles 0..7; entries 8..15 are reserved (zero)
};
static_assert(sizeof(AmxTileConfig) == 64, "LDTILECFG reads 64 bytes");

// What palette 1 allows (CPUID leaves 0x1D and 0x1E report these on every AMX processor so far).
constexpr int kAmxTiles = 8;
constexpr int kAmxMaxRows = 16;
constexpr int kAmxRowBytes = 64;
constexpr int kAmxMaxK = 16;  // dwords of a TDP* source row (tmul_maxk)
constexpr int kAmxMaxN = 16;  // dwords of a TDP* destination row (tmul_maxn)

// A fault the hardware would raise: "<INSTRUCTION>: #GP|#UD (<why>)".
struct AmxFault : std::logic_error {
  using std::logic_error::logic_error;
};

// Every member function is defined in amx_tile_model.cc (compiled for the baseline ISA), none inline, for the same
// reason.
class AmxTileModel {
 public:
  AmxTileModel();

  void ldtilecfg(const void* mem);
  void tilezero(int tile);
  // Row r of the tile is the colsb bytes at base + r * stride.
  void tileloadd(int tile, const void* base, int64_t stride);
  void tilestored(int tile, void* base, int64_t stride);
  // dst[m][n] += sum over k of the dot product of the 4 signed bytes of src1[m] dword k and the 4 unsigned bytes
  // of src2[k] dword n, in 32-bit wrapping arithmetic.
  void tdpbsud(int dst, int src1, int src2);
  void tilerelease();

  bool configured() const;
  // The configured shape of a tile (0 when the tiles are unconfigured or the tile is unused).
  int rows(int tile) const;
  int colsb(int tile) const;

 private:
  void zero_all_tiles();
  void check_tile(const char* instruction, int tile) const;
  void check_start_row(const char* instruction, int tile) const;

  bool configured_ = false;
  uint8_t start_row_ = 0;
  uint8_t rows_[kAmxTiles] = {};
  uint16_t colsb_[kAmxTiles] = {};
  uint8_t data_[kAmxTiles][kAmxMaxRows][kAmxRowBytes];
};

}  // namespace conduit

// The software AMX model (see amx_tile_model.h). Each instruction follows the "Operation" pseudo-code of Intel's
// ISA reference, and raises the faults of its exception class that a user-mode program can trigger: LDTILECFG
// (AMX-E1) #GP on an invalid configuration; TILELOADD/TILESTORED (AMX-E3) and TILEZERO (AMX-E5) #UD on an
// unconfigured or unused tile or a restart row past the tile; TDPBSUD (AMX-E4) #UD unless the three tiles are
// distinct, configured, and shaped as C[m x n] += A[m x k] . B[k x n] within the TMUL limits.
#include "amx_tile_model.h"

#include <cstring>

namespace conduit {

namespace {

[[noreturn]] void fault(const char* instruction, const char* exception, const std::string& why) {
  throw AmxFault(std::string(instruction) + ": " + exception + " (" + why + ")");
}

bool all_zero(const uint8_t* bytes, int begin, int end) {
  for (int i = begin; i < end; ++i) {
    if (bytes[i] != 0) return false;
  }
  return true;
}

uint32_t read_dword(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

AmxTileModel::AmxTileModel() { zero_all_tiles(); }

void AmxTileModel::zero_all_tiles() { std::memset(data_, 0, sizeof(data_)); }

bool AmxTileModel::configured() const { return configured_; }

int AmxTileModel::rows(int tile) const {
  return configured_ && tile >= 0 && tile < kAmxTiles ? rows_[tile] : 0;
}

int AmxTileModel::colsb(int tile) const {
  return configured_ && tile >= 0 && tile < kAmxTiles ? colsb_[tile] : 0;
}

void AmxTileModel::ldtilecfg(const void* mem) {
  uint8_t buf[64];
  std::memcpy(buf, mem, 64);
  const uint8_t palette = buf[0];
  if (palette > 1) fault("LDTILECFG", "#GP", "palette " + std::to_string(palette) + " does not exist");
  if (palette == 0) {  // the INIT state
    tilerelease();
    return;
  }
  if (!all_zero(buf, 2, 16)) fault("LDTILECFG", "#GP", "reserved bytes 2-15 are not zero");
  uint16_t colsb[kAmxTiles];
  uint8_t rows[kAmxTiles];
  for (int t = 0; t < kAmxTiles; ++t) {
    colsb[t] = static_cast<uint16_t>(buf[16 + 2 * t] | (buf[17 + 2 * t] << 8));
    if (colsb[t] > kAmxRowBytes) {
      fault("LDTILECFG", "#GP", "tile " + std::to_string(t) + " has " + std::to_string(colsb[t]) + " bytes per row");
    }
  }
  if (!all_zero(buf, 16 + 2 * kAmxTiles, 48)) fault("LDTILECFG", "#GP", "colsb of tiles past the palette's 8");
  for (int t = 0; t < kAmxTiles; ++t) {
    rows[t] = buf[48 + t];
    if (rows[t] > kAmxMaxRows) {
      fault("LDTILECFG", "#GP", "tile " + std::to_string(t) + " has " + std::to_string(rows[t]) + " rows");
    }
  }
  if (!all_zero(buf, 48 + kAmxTiles, 64)) fault("LDTILECFG", "#GP", "rows of tiles past the palette's 8");
  for (int t = 0; t < kAmxTiles; ++t) {
    if ((rows[t] == 0) != (colsb[t] == 0)) {
      fault("LDTILECFG", "#GP", "tile " + std::to_string(t) + " has rows or bytes per row zero, not both");
    }
  }
  start_row_ = buf[1];
  std::memcpy(rows_, rows, sizeof(rows_));
  std::memcpy(colsb_, colsb, sizeof(colsb_));
  zero_all_tiles();
  configured_ = true;
}

void AmxTileModel::check_tile(const char* instruction, int tile) const {
  if (!configured_) fault(instruction, "#UD", "tiles are not configured");
  if (tile < 0 || tile >= kAmxTiles) fault(instruction, "#UD", "tile " + std::to_string(tile) + " does not exist");
  if (rows_[tile] == 0) fault(instruction, "#UD", "tile " + std::to_string(tile) + " is not configured");
}

void AmxTileModel::check_start_row(const char* instruction, int tile) const {
  if (colsb_[tile] % 4 != 0) {
    fault(instruction, "#UD", "tile " + std::to_string(tile) + " has bytes per row not a multiple of 4");
  }
  if (start_row_ >= rows_[tile]) {
    fault(instruction, "#UD", "start_row " + std::to_string(start_row_) + " is past tile " + std::to_string(tile));
  }
}

void AmxTileModel::tilezero(int tile) {
  check_tile("TILEZERO", tile);
  std::memset(data_[tile], 0, sizeof(data_[tile]));
  start_row_ = 0;
}

void AmxTileModel::tileloadd(int tile, const void* base, int64_t stride) {
  check_tile("TILELOADD", tile);
  check_start_row("TILELOADD", tile);
  const uint8_t* mem = static_cast<const uint8_t*>(base);
  // Rows from start_row on are replaced: the loaded bytes, then zeros to the end of the row; rows past the
  // configured ones become zero.
  for (int r = start_row_; r < kAmxMaxRows; ++r) std::memset(data_[tile][r], 0, kAmxRowBytes);
  for (int r = start_row_; r < rows_[tile]; ++r) std::memcpy(data_[tile][r], mem + r * stride, colsb_[tile]);
  start_row_ = 0;
}

void AmxTileModel::tilestored(int tile, void* base, int64_t stride) {
  check_tile("TILESTORED", tile);
  check_start_row("TILESTORED", tile);
  uint8_t* mem = static_cast<uint8_t*>(base);
  for (int r = start_row_; r < rows_[tile]; ++r) std::memcpy(mem + r * stride, data_[tile][r], colsb_[tile]);
  start_row_ = 0;
}

void AmxTileModel::tdpbsud(int dst, int src1, int src2) {
  const char* kName = "TDPBSUD";
  if (dst == src1 || dst == src2 || src1 == src2) fault(kName, "#UD", "the three tiles must be distinct");
  check_tile(kName, dst);
  check_tile(kName, src1);
  check_tile(kName, src2);
  for (int t : {dst, src1, src2}) {
    if (colsb_[t] % 4 != 0) fault(kName, "#UD", "tile " + std::to_string(t) + " has bytes per row not a multiple of 4");
  }
  // C = m x n (dst), A = m x k (src1), B = k x n (src2), in dwords.
  const int m_rows = rows_[dst], n_dwords = colsb_[dst] / 4, k_dwords = colsb_[src1] / 4;
  if (colsb_[src2] != colsb_[dst]) fault(kName, "#UD", "src2 and dst differ in bytes per row");
  if (rows_[src1] != rows_[dst]) fault(kName, "#UD", "src1 and dst differ in rows");
  if (rows_[src2] != k_dwords) fault(kName, "#UD", "src1's dwords per row differ from src2's rows");
  if (n_dwords > kAmxMaxN || k_dwords > kAmxMaxK) fault(kName, "#UD", "shape beyond the TMUL limits");

  for (int m = 0; m < m_rows; ++m) {
    uint32_t tmp[kAmxRowBytes / 4];
    for (int n = 0; n < n_dwords; ++n) tmp[n] = read_dword(data_[dst][m] + 4 * n);
    for (int k = 0; k < k_dwords; ++k) {
      const uint8_t* x = data_[src1][m] + 4 * k;
      for (int n = 0; n < n_dwords; ++n) {
        const uint8_t* y = data_[src2][k] + 4 * n;
        // Each product fits in 32 bits (|-128 * 255| < 2^15); the sum wraps modulo 2^32, as the dword does.
        uint32_t c = tmp[n];
        for (int j = 0; j < 4; ++j) {
          const int32_t product = static_cast<int32_t>(static_cast<int8_t>(x[j])) * static_cast<int32_t>(y[j]);
          c += static_cast<uint32_t>(product);
        }
        tmp[n] = c;
      }
    }
    std::memset(data_[dst][m], 0, kAmxRowBytes);
    std::memcpy(data_[dst][m], tmp, 4 * static_cast<size_t>(n_dwords));
  }
  for (int m = m_rows; m < kAmxMaxRows; ++m) std::memset(data_[dst][m], 0, kAmxRowBytes);
  start_row_ = 0;
}

void AmxTileModel::tilerelease() {
  zero_all_tiles();
  configured_ = false;
  start_row_ = 0;
  std::memset(rows_, 0, sizeof(rows_));
  std::memset(colsb_, 0, sizeof(colsb_));
}

}  // namespace conduit

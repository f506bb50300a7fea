// LoRA adapters in the native forward pass: per adapter slot, the low-rank matrices A [rank x in] and B [out x rank]
// of each projection it corrects, and the batched kernel that adds scale * B (A x) to the base matmul's output for
// every row whose slot names an adapter (S-LoRA / Punica style: rows of different adapters and of the base model
// in one step). The TypeScript reference is src/model/lora.ts applyLoraRows.
//
// Storage (LoraDtype, chosen per adapter when it is loaded): A and B transposed (Bt [rank x out], the reading order
// of the up-projection) are kept as f32 (exact), bf16 (8-bit mantissa, round to nearest even) or q8: int8 with one
// f32 scale per row (row k of A and row k of Bt: the scale is the row's largest magnitude / 127, a value is
// round(w / scale)). Each element of a q8 row is then within scale/2 = absmax_row/254 of its f32 value; for one
// output that bounds the error against the f32 product by
//   |dy_o| <= |s| * sum_k ( |B_ok| * |du_k| + (bt_scale_k / 2) * |u_k| ),  |du_k| <= (a_scale_k / 2) * sum_i |x_i|
// (plus f32 rounding), which test/kernels/lora-kernel.test.ts checks for every variant.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels.h"
#include "thread_pool.h"

namespace conduit {

// The projections an adapter may correct, in the order of src/model/lora.ts LORA_TARGETS.
enum LoraTarget { kLoraQ = 0, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown, kLoraTargetCount };

struct LoraMatrix {
  int64_t rank = 0, in = 0, out = 0;  // rank 0: the projection is not adapted
  std::vector<float> a;               // [rank x in] f32 as given; released once packed
  std::vector<float> b;               // [out x rank] f32 as given; released once packed
  // Made by LoraSet::set in the adapter's dtype: A [rank x in] and B transposed [rank x out], rows of
  // lora_dtype_bytes each, and per row the q8 scale (1 for f32 and bf16).
  std::vector<uint8_t> a_packed, bt_packed;
  std::vector<float> a_scale, bt_scale;

  LoraMatrixView view(int dtype) const {
    return LoraMatrixView{dtype, rank, in, out, a_packed.data(), bt_packed.data(), a_scale.data(), bt_scale.data()};
  }
};

struct LoraAdapter {
  float scale = 1.0f;
  int dtype = kLoraF32;  // LoraDtype of the packed matrices
  std::vector<std::array<LoraMatrix, kLoraTargetCount>> layers;
};

// Packs a matrix's f32 A and B into `dtype` (A rows, B transposed) and releases the f32 copies.
void lora_pack(LoraMatrix& m, int dtype);

// The adapters a model holds, by slot.
class LoraSet {
 public:
  // Puts an adapter in a slot (growing the table), packing its matrices in its dtype, or empties it (nullptr).
  void set(int slot, std::unique_ptr<LoraAdapter> adapter);
  const LoraAdapter* get(int slot) const {
    return slot >= 0 && slot < static_cast<int>(slots_.size()) ? slots_[slot].get() : nullptr;
  }
  int size() const { return static_cast<int>(slots_.size()); }

 private:
  std::vector<std::unique_ptr<LoraAdapter>> slots_;
};

// y[r * ldy + o] += scale * sum_k B[o][k] * (sum_i A[k][i] * x[r * ldx + i]) for each row r in [0, rows) whose slot
// (slots[r]) holds an adapter that adapts `target` in `layer`. Rows are grouped by adapter so each adapter's
// matrices are read once per call whatever the number of its rows; every row is still computed by itself in a fixed
// order, so its result does not depend on the rows beside it (batch invariance).
void lora_apply(const KernelTable& kt, ThreadPool& pool, const LoraSet& set, const int32_t* slots, int64_t rows,
                int64_t layer, LoraTarget target, const float* x, int64_t ldx, float* y, int64_t ldy);

// One projection's input and output for lora_apply_many.
struct LoraOutput {
  LoraTarget target;
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
};

// lora_apply for several projections of the same rows: Q, K and V, or gate and up, share the hand-overs to the
// thread pool (one for the down-projections of all of them, none when they are small enough for the calling
// thread, and one for the up-projections).
void lora_apply_many(const KernelTable& kt, ThreadPool& pool, const LoraSet& set, const int32_t* slots, int64_t rows,
                     int64_t layer, const LoraOutput* outputs, int count);

}  // namespace conduit

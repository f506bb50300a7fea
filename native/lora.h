// LoRA adapters in the native forward pass: per adapter slot, the low-rank matrices A [rank x in] and B [out x rank]
// of each projection it corrects, and the batched kernel that adds scale * B (A x) to the base matmul's output for
// every row whose slot names an adapter (S-LoRA / Punica style: rows of different adapters and of the base model
// in one step). The TypeScript reference is src/model/lora.ts applyLoraRows.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "thread_pool.h"

namespace conduit {

// The projections an adapter may correct, in the order of src/model/lora.ts LORA_TARGETS.
enum LoraTarget { kLoraQ = 0, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown, kLoraTargetCount };

struct LoraMatrix {
  int64_t rank = 0, in = 0, out = 0;  // rank 0: the projection is not adapted
  std::vector<float> a;               // [rank x in]
  std::vector<float> b;               // [out x rank]
  std::vector<float> bt;              // B transposed, [rank x out] (made by LoraSet::set): the kernel's reading order
};

struct LoraAdapter {
  float scale = 1.0f;
  std::vector<std::array<LoraMatrix, kLoraTargetCount>> layers;
};

// The adapters a model holds, by slot.
class LoraSet {
 public:
  // Puts an adapter in a slot (growing the table), or empties it (nullptr).
  void set(int slot, std::unique_ptr<LoraAdapter> adapter);
  const LoraAdapter* get(int slot) const {
    return slot >= 0 && slot < static_cast<int>(slots_.size()) ? slots_[slot].get() : nullptr;
  }
  int size() const { return static_cast<int>(slots_.size()); }

 private:
  std::vector<std::unique_ptr<LoraAdapter>> slots_;
};

// y[r * ldy + o] += scale * sum_k B[o][k] * (sum_i A[k][i] * x[r * ldx + i]) for each row r in [0, rows) whose slot
// (slots[r]) holds an adapter that adapts `target` in `layer`. Every row is computed by itself in a fixed order, so
// a row's result does not depend on the rows beside it (batch invariance).
void lora_apply(ThreadPool& pool, const LoraSet& set, const int32_t* slots, int64_t rows, int64_t layer,
                LoraTarget target, const float* x, int64_t ldx, float* y, int64_t ldy);

// One projection's input and output for lora_apply_many.
struct LoraOutput {
  LoraTarget target;
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
};

// lora_apply for several projections of the same rows in one parallel loop (rows x outputs items): Q, K and V, or
// gate and up, cost one hand-over to the thread pool instead of one each.
void lora_apply_many(ThreadPool& pool, const LoraSet& set, const int32_t* slots, int64_t rows, int64_t layer,
                     const LoraOutput* outputs, int count);

}  // namespace conduit

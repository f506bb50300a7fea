// Mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE) for one layer of a step.
//
// Per row: router scores (one matmul over the step's rows), softmax, the top-k experts and their weights
// (renormalized when the model says so). Then the rows are grouped by expert so that each selected expert's three
// matrices are streamed once per step whatever the number of rows that chose it: gather that expert's rows,
// gate+up in one matmul call, SwiGLU, down. Each row's output is the weighted sum of its experts' outputs taken in
// its own rank order (best expert first), so a row gets the same bits whatever else is in the batch.
#pragma once

#include <cstdint>
#include <vector>

#include "compute.h"
#include "model.h"

namespace conduit {

struct MoeShape {
  int64_t dim = 0, ffn = 0, n_expert = 0, n_used = 0;
  bool normalize = true;
};

class MoeBlock {
 public:
  // out[r] (rows x dim) = the block's output for xn[r]; out is overwritten. W.gate_exps/up_exps/down_exps hold one
  // TensorRef per expert (slices of the file's stacked tensors, packed copies where the kernel has them).
  void forward(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const MoeShape& shape, const LayerRefs& W,
               const float* xn, int64_t rows, float* out);

  // Experts that had rows in the last forward (for the profile / tests).
  int64_t last_active_experts() const { return last_active_; }

  // Bytes its per-step buffers hold now (they grow to the largest step and are kept).
  size_t scratch_bytes() const;

 private:
  std::vector<float> scores_;         // rows x n_expert
  std::vector<int32_t> chosen_;       // rows x n_used expert ids, rank order
  std::vector<float> weights_;        // rows x n_used
  std::vector<int32_t> counts_, starts_, fill_;  // per expert
  std::vector<int32_t> pair_of_;      // rows x n_used -> position in the grouped order
  std::vector<int32_t> row_of_;       // grouped position -> row
  std::vector<float> xg_, gate_, up_, down_;  // grouped inputs, activations, outputs
  int64_t last_active_ = 0;
};

}  // namespace conduit

// Mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE) for one layer of a step.
//
// Per row: router scores (one matmul over the step's rows), softmax, the top-k experts and their weights
// (renormalized when the model says so). Then the rows are grouped by expert so that each selected expert's three
// matrices are streamed once per step whatever the number of rows that chose it, and all the experts' work of the
// layer runs as one parallel job over work items:
//   - gate+up items (expert, tile of kMatmulTileRows intermediate columns): the gate and up tiles of every row that
//     chose the expert, then SwiGLU on those columns; the thread finishing an expert's last gate+up item quantizes
//     the expert's intermediate rows for the down matmul and marks the expert ready;
//   - down items (expert, tile of kMatmulTileRows output columns): they wait (spin, then yield) for their expert to
//     be ready.
// Each expert's items are claimed in that order from the expert's own counter. Each thread first drains the experts
// of its share (a contiguous run of the active experts), one after the other, so it streams whole experts' weights
// front to back and the two threads read different experts; then it helps with the others' experts, from the last
// one back (the one their owner reaches last). In both passes a thread leaves an expert whose next item is a down
// item while the expert is not ready, and does other work; only a last pass over whatever is left waits. The waits
// end: a down item waits only for its expert's gate+up items, all claimed before it from the same counter by threads
// that are running them, and gate+up items wait for nothing.
// Each row's output is then the weighted sum of its experts' outputs taken in its own rank order (best expert first).
// Every tile kernel gives a row the same bits whatever rows it shares the tile with, each input row is quantized on
// its own, and the sum's order is the row's: a row gets the same bits whatever else is in the batch and however the
// items fall on the threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
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
  //
  // With a profile enabled (ws.profile), besides the sections' times it counts, as the "calls" of sections that take
  // no time: "moe experts streamed" (experts with rows), "moe expert tiles" (tile kernel calls on expert matrices),
  // "moe expert tile rows" (their activation rows summed), "moe expert weight bytes" (the ggml bytes of the weight
  // rows those calls read) and "moe expert tiles revisited" (calls on an expert matrix tile already read in the same
  // layer of the same step: 0 when every expert's weights stream once per step); and the experts' job's scheduling:
  // "moe expert ready waits" (down items that found their expert not ready yet: their number, and the seconds the
  // threads spent waiting, summed over threads) and "moe expert items helped" (items a thread ran from another
  // thread's share).
  void forward(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const MoeShape& shape, const LayerRefs& W,
               const float* xn, int64_t rows, float* out);

  // Experts that had rows in the last forward (for the profile / tests).
  int64_t last_active_experts() const { return last_active_; }

  // Bytes its per-step buffers hold now (they grow to the largest step and are kept).
  size_t scratch_bytes() const;

 private:
  // An active expert's claim counter: items [0, gate_up_tiles) are its gate+up tiles, the rest its down tiles.
  struct alignas(64) Cursor {
    std::atomic<int32_t> next{0};
  };
  // An activation format of the expert matmuls' inputs (the quantizer of a weight type; null: float rows).
  struct Format {
    void (*quantize)(const float* x, int64_t K, uint8_t* out) = nullptr;
    size_t stride = 0;  // bytes per row, 64-byte aligned
    size_t offset = 0;  // in act_
  };

  void route(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const MoeShape& s, const LayerRefs& W,
             const float* xn, int64_t rows);
  void resize_sync(int64_t n_expert, int64_t visit_slots);

  std::vector<float> scores_;         // rows x n_expert
  std::vector<int32_t> chosen_;       // rows x n_used expert ids, rank order
  std::vector<float> weights_;        // rows x n_used
  std::vector<uint8_t> taken_;        // per thread x n_expert: top-k selection flags
  std::vector<int32_t> counts_, starts_, fill_;  // per expert
  std::vector<int32_t> active_;       // experts with rows, ascending
  std::vector<int32_t> pair_of_;      // rows x n_used -> position in the grouped order
  std::vector<int32_t> row_of_;       // grouped position -> row
  std::vector<float> xg_;             // grouped float inputs (float gate/up weights only)
  std::vector<float> gate_, up_, down_;  // grouped activations (gate_ holds SwiGLU's output) and outputs
  Scratch act_;                       // grouped quantized inputs of gate/up, then of down
  // Per expert: gate+up items not finished yet, and whether its intermediate rows are complete (and quantized).
  std::unique_ptr<std::atomic<int32_t>[]> pending_, ready_;
  // Per active expert (in active_ order): its claim counter.
  std::unique_ptr<Cursor[]> cursors_;
  // Per expert matrix tile (profile only): kernel calls on it in this layer.
  std::unique_ptr<std::atomic<int32_t>[]> visits_;
  int64_t sync_size_ = 0, visit_size_ = 0;
  int64_t last_active_ = 0;
};

}  // namespace conduit

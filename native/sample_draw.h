// The sampler's random draw of one logits row, whole, in native code: what src/engine/sampler.ts does for a row with
// no logit processors (Sampler.drawPlain; drawTruncated, its top_p path through selectTopP or its top_k one through
// heapSelectTop; drawTopK; then selectTopByMass and drawFromKept), given the uniform the sequence's generator drew
// for it. Every step is the
// TypeScript one in the same order with the same IEEE operations (the weighing pass is the kernel table's, bit for bit
// weighCandidates; the rest is comparisons, integer work and double additions in one order), so a seed draws the
// same token here as there (test/kernels/native-ops.test.ts checks it per variant). Model::sample_rows runs it over a
// step's rows on the model's threads: that is why it exists, so that a step's draws are shared by all the threads
// instead of taken one after another on the engine's while the others wait.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace conduit {
namespace sample {

// One row's draw, kDrawSpecWords doubles: the factor values are read at (1 / temperature, 1 at temperature 1; 0: a
// greedy row, its argmax, the other words unused), the natural log of min_p (-inf for none), top_p (1 or more: no cut
// by mass), the uniform in [0, 1), top_k (0: none; else fewer than the row's values).
constexpr int kDrawSpecWords = 5;

// A thread's scratch for draw_row, grown to the vocabulary on first use.
struct DrawScratch {
  std::vector<double> weights, block_totals, bin_mass;
  std::vector<int32_t> order, bin_count;
  std::vector<float> scaled;
  void reserve(int64_t n);
  size_t bytes() const;
};

// The token drawn from row[0, n) by spec; -1 when the row has a NaN or nothing above -inf (the TypeScript sampler
// then reports the row as it always has).
int64_t draw_row(const KernelTable& kt, const float* row, int64_t n, const double* spec, DrawScratch& scratch);

}  // namespace sample
}  // namespace conduit

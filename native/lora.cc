#include "lora.h"

#include <algorithm>

namespace conduit {

void LoraSet::set(int slot, std::unique_ptr<LoraAdapter> adapter) {
  if (adapter) {
    for (auto& layer : adapter->layers) {
      for (LoraMatrix& m : layer) {
        if (m.rank == 0) continue;
        m.bt.resize(m.b.size());
        for (int64_t o = 0; o < m.out; ++o) {
          for (int64_t k = 0; k < m.rank; ++k) m.bt[k * m.out + o] = m.b[o * m.rank + k];
        }
      }
    }
  }
  if (slot >= static_cast<int>(slots_.size())) slots_.resize(slot + 1);
  slots_[slot] = std::move(adapter);
}

namespace {

constexpr int kLanes = 8;

// u[k] = A[k] . x for k < rank. Eight partial sums per dot product (element i goes to lane i mod 8), added in a
// fixed order at the end: the compiler vectorizes the lanes without reassociating anything, so the result is the
// same whatever the batch or the thread.
void down_project(const LoraMatrix& m, const float* x, float* u) {
  const int64_t in = m.in;
  const int64_t body = in - in % kLanes;
  for (int64_t k = 0; k < m.rank; ++k) {
    const float* a = m.a.data() + k * in;
    float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < body; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * x[i + j];
    }
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (int64_t i = body; i < in; ++i) s += a[i] * x[i];
    u[k] = s;
  }
}

// y[o] += scale * sum_k B[o][k] u[k], k ascending for every o: over B transposed, one pass per k across all
// outputs (vectorized across o), into t, then added to y.
void up_project(const LoraMatrix& m, const float* u, float scale, float* t, float* y) {
  const int64_t out = m.out;
  const float* bt = m.bt.data();
  for (int64_t o = 0; o < out; ++o) t[o] = bt[o] * u[0];
  for (int64_t k = 1; k < m.rank; ++k) {
    const float* row = bt + k * out;
    const float uk = u[k];
    for (int64_t o = 0; o < out; ++o) t[o] += row[o] * uk;
  }
  for (int64_t o = 0; o < out; ++o) y[o] += scale * t[o];
}

}  // namespace

void lora_apply(ThreadPool& pool, const LoraSet& set, const int32_t* slots, int64_t rows, int64_t layer,
                LoraTarget target, const float* x, int64_t ldx, float* y, int64_t ldy) {
  const LoraOutput output{target, x, ldx, y, ldy};
  lora_apply_many(pool, set, slots, rows, layer, &output, 1);
}

void lora_apply_many(ThreadPool& pool, const LoraSet& set, const int32_t* slots, int64_t rows, int64_t layer,
                     const LoraOutput* outputs, int count) {
  if (!slots || set.size() == 0 || count <= 0) return;
  auto matrix_of = [&](int64_t r, LoraTarget target) -> const LoraMatrix* {
    const LoraAdapter* adapter = set.get(slots[r]);
    if (!adapter || layer >= static_cast<int64_t>(adapter->layers.size())) return nullptr;
    const LoraMatrix& m = adapter->layers[layer][target];
    return m.rank > 0 ? &m : nullptr;
  };
  bool any = false;
  for (int64_t r = 0; r < rows && !any; ++r) {
    for (int c = 0; c < count && !any; ++c) any = matrix_of(r, outputs[c].target) != nullptr;
  }
  if (!any) return;
  pool.parallel_for(rows * count, [&](int64_t item, int) {
    const int64_t r = item / count;
    const LoraOutput& out = outputs[item % count];
    const LoraMatrix* m = matrix_of(r, out.target);
    if (!m) return;
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(m->rank + m->out)) scratch.resize(m->rank + m->out);
    float* u = scratch.data();
    down_project(*m, out.x + r * out.ldx, u);
    up_project(*m, u, set.get(slots[r])->scale, u + m->rank, out.y + r * out.ldy);
  });
}

}  // namespace conduit

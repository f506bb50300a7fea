#include "lora.h"

#include <algorithm>

namespace conduit {

void LoraSet::set(int slot, std::unique_ptr<LoraAdapter> adapter) {
  if (slot >= static_cast<int>(slots_.size())) slots_.resize(slot + 1);
  slots_[slot] = std::move(adapter);
}

namespace {

// u[k] = A[k] . x for k < rank: four rows of A at a time share each load of x.
void down_project(const LoraMatrix& m, const float* x, float* u) {
  const int64_t in = m.in;
  int64_t k = 0;
  for (; k + 4 <= m.rank; k += 4) {
    const float* a0 = m.a.data() + k * in;
    const float* a1 = a0 + in;
    const float* a2 = a1 + in;
    const float* a3 = a2 + in;
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int64_t i = 0; i < in; ++i) {
      const float xi = x[i];
      s0 += a0[i] * xi;
      s1 += a1[i] * xi;
      s2 += a2[i] * xi;
      s3 += a3[i] * xi;
    }
    u[k] = s0;
    u[k + 1] = s1;
    u[k + 2] = s2;
    u[k + 3] = s3;
  }
  for (; k < m.rank; ++k) {
    const float* a = m.a.data() + k * in;
    float s = 0;
    for (int64_t i = 0; i < in; ++i) s += a[i] * x[i];
    u[k] = s;
  }
}

// y[o] += scale * B[o] . u.
void up_project(const LoraMatrix& m, const float* u, float scale, float* y) {
  const int64_t rank = m.rank;
  for (int64_t o = 0; o < m.out; ++o) {
    const float* b = m.b.data() + o * rank;
    float s = 0;
    for (int64_t k = 0; k < rank; ++k) s += b[k] * u[k];
    y[o] += scale * s;
  }
}

}  // namespace

void lora_apply(ThreadPool& pool, const LoraSet& set, const int32_t* slots, int64_t rows, int64_t layer,
                LoraTarget target, const float* x, int64_t ldx, float* y, int64_t ldy) {
  if (!slots || set.size() == 0) return;
  auto matrix_of = [&](int64_t r) -> const LoraMatrix* {
    const LoraAdapter* adapter = set.get(slots[r]);
    if (!adapter || layer >= static_cast<int64_t>(adapter->layers.size())) return nullptr;
    const LoraMatrix& m = adapter->layers[layer][target];
    return m.rank > 0 ? &m : nullptr;
  };
  bool any = false;
  for (int64_t r = 0; r < rows && !any; ++r) any = matrix_of(r) != nullptr;
  if (!any) return;
  pool.parallel_for(rows, [&](int64_t r, int) {
    const LoraMatrix* m = matrix_of(r);
    if (!m) return;
    float u[256];
    std::vector<float> big;
    float* up = u;
    if (m->rank > 256) {
      big.resize(m->rank);
      up = big.data();
    }
    down_project(*m, x + r * ldx, up);
    up_project(*m, up, set.get(slots[r])->scale, y + r * ldy);
  });
}

}  // namespace conduit

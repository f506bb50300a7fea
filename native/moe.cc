#include "moe.h"

#include <algorithm>
#include <cmath>
#include <optional>

namespace conduit {

void MoeBlock::forward(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const MoeShape& s, const LayerRefs& W,
                       const float* xn, int64_t rows, float* out) {
  const int64_t E = s.n_expert, K = s.n_used, dim = s.dim, ffn = s.ffn;
  Profile* prof = ws.profile;
  std::optional<ProfileScope> scope(std::in_place, prof, "moe router");

  // Router scores of every row, then softmax and top-k per row.
  scores_.resize(rows * E);
  const MatmulOutput router{W.gate_inp.data, W.gate_inp.type, E, scores_.data(), E, false};
  matmul(kt, pool, ws, xn, rows, dim, &router, 1);
  chosen_.resize(rows * K);
  weights_.resize(rows * K);
  for (int64_t r = 0; r < rows; ++r) {
    float* p = scores_.data() + r * E;
    kt.softmax(p, E);
    int32_t* c = chosen_.data() + r * K;
    float* w = weights_.data() + r * K;
    // Selection by repeated maximum: k is small; ties go to the lower expert id.
    for (int64_t j = 0; j < K; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken = taken || c[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      c[j] = static_cast<int32_t>(best);
      w[j] = p[best];
    }
    if (s.normalize) {
      float sum = 0;
      for (int64_t j = 0; j < K; ++j) sum += w[j];
      for (int64_t j = 0; j < K; ++j) w[j] /= sum;
    }
  }

  // Group (row, rank) pairs by expert, rows ascending within an expert.
  scope.emplace(prof, "moe grouping");
  counts_.assign(E, 0);
  for (int64_t i = 0; i < rows * K; ++i) ++counts_[chosen_[i]];
  starts_.resize(E + 1);
  starts_[0] = 0;
  for (int64_t e = 0; e < E; ++e) starts_[e + 1] = starts_[e] + counts_[e];
  fill_.assign(starts_.begin(), starts_.end() - 1);
  pair_of_.resize(rows * K);
  row_of_.resize(rows * K);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = chosen_[r * K + j];
      const int32_t at = fill_[e]++;
      pair_of_[r * K + j] = at;
      row_of_[at] = static_cast<int32_t>(r);
    }
  }
  const int64_t pairs = rows * K;
  xg_.resize(pairs * dim);
  gate_.resize(pairs * ffn);
  up_.resize(pairs * ffn);
  down_.resize(pairs * dim);
  for (int64_t i = 0; i < pairs; ++i) std::copy_n(xn + row_of_[i] * dim, dim, xg_.data() + i * dim);

  auto ref_output = [](const TensorRef& t, float* y, int64_t ldy) {
    return t.packed ? MatmulOutput{t.packed, t.type, t.rows, y, ldy, true} : MatmulOutput{t.data, t.type, t.rows, y, ldy, false};
  };

  // Gate and up of each active expert. A single row (one-token decode) shares its input with every expert it
  // chose, so all their gate and up matrices go into one matmul call (one quantization, one parallel job).
  scope.emplace(prof, "moe matmul gate+up");
  last_active_ = 0;
  std::vector<MatmulOutput> outs;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = counts_[e];
    if (n == 0) continue;
    ++last_active_;
    const int64_t at = starts_[e];
    const MatmulOutput gu[2] = {ref_output(W.gate_exps[e], gate_.data() + at * ffn, ffn),
                                ref_output(W.up_exps[e], up_.data() + at * ffn, ffn)};
    if (rows == 1) {
      outs.push_back(gu[0]);
      outs.push_back(gu[1]);
    } else {
      matmul(kt, pool, ws, xg_.data() + at * dim, n, dim, gu, 2);
    }
  }
  if (rows == 1) matmul(kt, pool, ws, xn, 1, dim, outs.data(), static_cast<int>(outs.size()));
  // The profile counts the experts streamed (its "calls"; no time of its own).
  if (prof && prof->enabled) prof->sections["moe experts streamed"].calls += last_active_;

  scope.emplace(prof, "moe swiglu");
  pool.parallel_for(div_ceil(pairs, 16), [&](int64_t item, int) {
    const int64_t r0 = item * 16, r1 = min64(pairs, r0 + 16);
    kt.swiglu(gate_.data() + r0 * ffn, up_.data() + r0 * ffn, gate_.data() + r0 * ffn, (r1 - r0) * ffn);
  });

  scope.emplace(prof, "moe matmul down");
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = counts_[e];
    if (n == 0) continue;
    const int64_t at = starts_[e];
    const MatmulOutput d = ref_output(W.down_exps[e], down_.data() + at * dim, dim);
    matmul(kt, pool, ws, gate_.data() + at * ffn, n, ffn, &d, 1);
  }

  // Weighted sum per row in rank order.
  scope.emplace(prof, "moe combine");
  pool.parallel_for(div_ceil(rows, 16), [&](int64_t item, int) {
    for (int64_t r = item * 16; r < min64(rows, item * 16 + 16); ++r) {
      float* o = out + r * dim;
      std::fill_n(o, dim, 0.0f);
      for (int64_t j = 0; j < K; ++j) {
        const float w = weights_[r * K + j];
        const float* d = down_.data() + static_cast<int64_t>(pair_of_[r * K + j]) * dim;
        for (int64_t i = 0; i < dim; ++i) o[i] += w * d[i];
      }
    }
  });
}

size_t MoeBlock::scratch_bytes() const {
  const size_t floats = scores_.capacity() + weights_.capacity() + xg_.capacity() + gate_.capacity() + up_.capacity() +
                        down_.capacity();
  const size_t ints = chosen_.capacity() + counts_.capacity() + starts_.capacity() + fill_.capacity() +
                      pair_of_.capacity() + row_of_.capacity();
  return floats * sizeof(float) + ints * sizeof(int32_t);
}

}  // namespace conduit

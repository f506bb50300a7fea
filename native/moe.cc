#include "moe.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#if CONDUIT_X86
#include <immintrin.h>
#endif

namespace conduit {

namespace {

constexpr size_t kAlign = 64;
inline size_t align_up(size_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

// Router rows per tile: at one token the router (n_expert x dim, f32 in the files) is a few hundred KB, worth
// spreading over the threads.
constexpr int64_t kRouterTileRows = 16;
// Pairs (row, expert) per work item when the grouped inputs are quantized.
constexpr int64_t kPairsPerItem = 16;

// Waits for an expert's intermediate rows: spins briefly (the item it waits for is running on another thread), then
// yields, so a descheduled thread holding that item gets the core back.
void wait_ready(const std::atomic<int32_t>& flag) {
  for (int spins = 0; flag.load(std::memory_order_acquire) == 0; ++spins) {
    if (spins < 4096) {
#if CONDUIT_X86
      _mm_pause();
#elif defined(__aarch64__)
      __asm__ volatile("yield");
#endif
    } else {
      sched_yield();
    }
  }
}

// One tile kernel call on an expert matrix (packed copy when the model has one).
void run_tile(const KernelTable& kt, const TensorRef& w, int64_t K, const float* x, const uint8_t* act,
              size_t act_stride, int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy, uint8_t* scratch) {
  const MatmulKernel& mk = kt.matmul[w.type];
  MatmulTile t;
  t.x = x;
  t.act = act;
  t.act_stride = act_stride;
  t.M = M;
  t.K = K;
  t.w = w.packed ? w.packed : w.data;
  t.w_row_bytes = row_bytes(w.type, K);
  t.n0 = n0;
  t.n1 = n1;
  t.n_total = w.rows;
  t.y = y;
  t.ldy = ldy;
  t.scratch = scratch;
  if (w.packed) {
    mk.packed_tile(t);
  } else {
    mk.tile(t);
  }
}

}  // namespace

void MoeBlock::resize_sync(int64_t n_expert, int64_t visit_slots) {
  if (n_expert > sync_size_) {
    pending_.reset(new std::atomic<int32_t>[n_expert]);
    ready_.reset(new std::atomic<int32_t>[n_expert]);
    cursors_.reset(new Cursor[n_expert]);
    sync_size_ = n_expert;
  }
  if (visit_slots > visit_size_) {
    visits_.reset(new std::atomic<int32_t>[visit_slots]);
    visit_size_ = visit_slots;
  }
}

// Router scores of every row (tiles of kRouterTileRows experts in one parallel job), then per row softmax, the top-k
// by repeated maximum (ties to the lower expert id) and the weights.
void MoeBlock::route(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const MoeShape& s, const LayerRefs& W,
                     const float* xn, int64_t rows) {
  const int64_t E = s.n_expert, K = s.n_used;
  scores_.resize(rows * E);
  // The router is never packed (Model::pack_weights leaves it), so row slices of it are matrices of their own.
  std::vector<MatmulOutput> router;
  const size_t router_row = row_bytes(W.gate_inp.type, s.dim);
  for (int64_t e0 = 0; e0 < E; e0 += kRouterTileRows) {
    router.push_back({W.gate_inp.data + e0 * router_row, W.gate_inp.type, min64(kRouterTileRows, E - e0),
                      scores_.data() + e0, E, false});
  }
  matmul(kt, pool, ws, xn, rows, s.dim, router.data(), static_cast<int>(router.size()));

  chosen_.resize(rows * K);
  weights_.resize(rows * K);
  taken_.assign(static_cast<size_t>(pool.size()) * E, 0);
  pool.parallel_for(div_ceil(rows, 16), [&](int64_t item, int thread) {
    uint8_t* taken = taken_.data() + static_cast<size_t>(thread) * E;
    for (int64_t r = item * 16; r < min64(rows, item * 16 + 16); ++r) {
      float* p = scores_.data() + r * E;
      kt.softmax(p, E);
      int32_t* c = chosen_.data() + r * K;
      float* w = weights_.data() + r * K;
      for (int64_t j = 0; j < K; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
          if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        }
        taken[best] = 1;
        c[j] = static_cast<int32_t>(best);
        w[j] = p[best];
      }
      for (int64_t j = 0; j < K; ++j) taken[c[j]] = 0;
      if (s.normalize) {
        float sum = 0;
        for (int64_t j = 0; j < K; ++j) sum += w[j];
        for (int64_t j = 0; j < K; ++j) w[j] /= sum;
      }
    }
  });
}

void MoeBlock::forward(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const MoeShape& s, const LayerRefs& W,
                       const float* xn, int64_t rows, float* out) {
  const int64_t E = s.n_expert, K = s.n_used, dim = s.dim, ffn = s.ffn;
  Profile* prof = ws.profile;
  const bool counting = prof && prof->enabled;
  std::optional<ProfileScope> scope(std::in_place, prof, "moe router");
  route(kt, pool, ws, s, W, xn, rows);

  // Group (row, rank) pairs by expert, rows ascending within an expert.
  scope.emplace(prof, "moe grouping");
  counts_.assign(E, 0);
  for (int64_t i = 0; i < rows * K; ++i) ++counts_[chosen_[i]];
  starts_.resize(E + 1);
  starts_[0] = 0;
  for (int64_t e = 0; e < E; ++e) starts_[e + 1] = starts_[e] + counts_[e];
  fill_.assign(starts_.begin(), starts_.end() - 1);
  const int64_t pairs = rows * K;
  pair_of_.resize(pairs);
  row_of_.resize(pairs);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = chosen_[r * K + j];
      const int32_t at = fill_[e]++;
      pair_of_[r * K + j] = at;
      row_of_[at] = static_cast<int32_t>(r);
    }
  }
  active_.clear();
  for (int64_t e = 0; e < E; ++e) {
    if (counts_[e] > 0) active_.push_back(static_cast<int32_t>(e));
  }
  last_active_ = static_cast<int64_t>(active_.size());

  // The experts' matrices of this layer share one type each (slices of one stacked tensor).
  const TensorRef& g0 = W.gate_exps[0];
  const TensorRef& u0 = W.up_exps[0];
  const TensorRef& d0 = W.down_exps[0];
  const MatmulKernel &gk = kt.matmul[g0.type], &uk = kt.matmul[u0.type], &dk = kt.matmul[d0.type];

  // Input formats of gate and up (one when their types share a quantizer), then the down input's. A single row (one
  // token) is every expert's only input row: quantized once, read by every expert; otherwise each pair gets its row.
  scope.emplace(prof, "moe quantize inputs");
  const int64_t src_rows = rows == 1 ? 1 : pairs;
  Format fmt[3];  // gate, up, down
  size_t act_bytes = 0;
  auto add_format = [&](Format& f, const MatmulKernel& mk, int64_t k, int64_t n) {
    if (!mk.act_row_bytes) return;
    f.quantize = mk.quantize_act;
    f.stride = align_up(mk.act_row_bytes(k));
    f.offset = act_bytes;
    act_bytes += f.stride * static_cast<size_t>(n);
  };
  add_format(fmt[0], gk, dim, src_rows);
  if (uk.act_row_bytes && uk.quantize_act == gk.quantize_act) {
    fmt[1] = fmt[0];
  } else {
    add_format(fmt[1], uk, dim, src_rows);
  }
  add_format(fmt[2], dk, ffn, pairs);
  uint8_t* act = act_.get(std::max<size_t>(act_bytes, kAlign));
  const bool float_input = !gk.act_row_bytes || !uk.act_row_bytes;
  const bool shared_up = fmt[1].quantize && fmt[1].quantize == fmt[0].quantize;
  if (rows > 1 && float_input) xg_.resize(pairs * dim);
  auto prepare = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* x = xn + (rows == 1 ? 0 : row_of_[i]) * dim;
      if (fmt[0].quantize) fmt[0].quantize(x, dim, act + fmt[0].offset + i * fmt[0].stride);
      if (fmt[1].quantize && !shared_up) fmt[1].quantize(x, dim, act + fmt[1].offset + i * fmt[1].stride);
      if (rows > 1 && float_input) std::copy_n(x, dim, xg_.data() + i * dim);
    }
  };
  if (src_rows == 1) {
    prepare(0, 1);
  } else {
    pool.parallel_for(div_ceil(src_rows, kPairsPerItem), [&](int64_t item, int) {
      prepare(item * kPairsPerItem, min64(src_rows, item * kPairsPerItem + kPairsPerItem));
    });
  }
  gate_.resize(pairs * ffn);
  up_.resize(pairs * ffn);
  down_.resize(pairs * dim);

  // The experts' job: each active expert's gate+up tiles, then its down tiles, claimed from its own counter.
  scope.emplace(prof, "moe experts");
  const int32_t gu_tiles = static_cast<int32_t>(div_ceil(ffn, kMatmulTileRows));
  const int32_t d_tiles = static_cast<int32_t>(div_ceil(dim, kMatmulTileRows));
  const int32_t expert_items = gu_tiles + d_tiles;
  const int64_t slots = static_cast<int64_t>(2 * gu_tiles + d_tiles);
  const int64_t n_active = static_cast<int64_t>(active_.size());
  resize_sync(E, counting ? E * slots : 0);
  for (int64_t a = 0; a < n_active; ++a) {
    const int32_t e = active_[a];
    pending_[e].store(gu_tiles, std::memory_order_relaxed);
    ready_[e].store(0, std::memory_order_relaxed);
    cursors_[a].next.store(0, std::memory_order_relaxed);
  }
  if (counting) {
    for (int64_t i = 0; i < E * slots; ++i) visits_[i].store(0, std::memory_order_relaxed);
  }
  std::atomic<int64_t> tiles{0}, tile_rows{0}, weight_bytes{0}, revisits{0}, waits{0}, wait_ns{0}, helped{0};
  auto count = [&](int32_t e, int64_t slot, int64_t m, int64_t n, const TensorRef& w, int64_t k) {
    tiles.fetch_add(1, std::memory_order_relaxed);
    tile_rows.fetch_add(m, std::memory_order_relaxed);
    weight_bytes.fetch_add(n * static_cast<int64_t>(row_bytes(w.type, k)), std::memory_order_relaxed);
    if (visits_[e * slots + slot].fetch_add(1, std::memory_order_relaxed) > 0) {
      revisits.fetch_add(1, std::memory_order_relaxed);
    }
  };

  const size_t scratch_bytes = std::max({align_up(gk.scratch_bytes(dim)), align_up(uk.scratch_bytes(dim)),
                                         align_up(dk.scratch_bytes(ffn)), kAlign});
  uint8_t* scratch = ws.per_thread.get(scratch_bytes * static_cast<size_t>(pool.size()));
  auto run_item = [&](int32_t e, int32_t item, int thread) {
    const int64_t n = counts_[e], at = starts_[e];
    uint8_t* my_scratch = scratch + scratch_bytes * static_cast<size_t>(thread);
    if (item < gu_tiles) {
      const int64_t n0 = static_cast<int64_t>(item) * kMatmulTileRows, n1 = min64(ffn, n0 + kMatmulTileRows);
      const int64_t src = rows == 1 ? 0 : at;
      const float* x = rows == 1 ? xn : (float_input ? xg_.data() + at * dim : nullptr);
      float* g = gate_.data() + at * ffn;
      float* u = up_.data() + at * ffn;
      run_tile(kt, W.gate_exps[e], dim, x, act + fmt[0].offset + src * fmt[0].stride, fmt[0].stride, n, n0, n1, g,
               ffn, my_scratch);
      run_tile(kt, W.up_exps[e], dim, x, act + fmt[1].offset + src * fmt[1].stride, fmt[1].stride, n, n0, n1, u,
               ffn, my_scratch);
      if (counting) {
        count(e, item, n, n1 - n0, W.gate_exps[e], dim);
        count(e, gu_tiles + item, n, n1 - n0, W.up_exps[e], dim);
      }
      for (int64_t r = 0; r < n; ++r) kt.swiglu(g + r * ffn + n0, u + r * ffn + n0, g + r * ffn + n0, n1 - n0);
      // The last gate+up item of the expert sees every other one's SwiGLU output (acq_rel on the count) and
      // publishes the expert's rows, quantized for down, to the down items.
      if (pending_[e].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        if (fmt[2].quantize) {
          for (int64_t r = 0; r < n; ++r) {
            fmt[2].quantize(g + r * ffn, ffn, act + fmt[2].offset + (at + r) * fmt[2].stride);
          }
        }
        ready_[e].store(1, std::memory_order_release);
      }
    } else {
      const int32_t tile = item - gu_tiles;
      const int64_t n0 = static_cast<int64_t>(tile) * kMatmulTileRows, n1 = min64(dim, n0 + kMatmulTileRows);
      if (ready_[e].load(std::memory_order_acquire) == 0) {
        const auto t0 = counting ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
        wait_ready(ready_[e]);
        if (counting) {
          waits.fetch_add(1, std::memory_order_relaxed);
          wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
                                .count(),
                            std::memory_order_relaxed);
        }
      }
      run_tile(kt, W.down_exps[e], ffn, gate_.data() + at * ffn, act + fmt[2].offset + at * fmt[2].stride,
               fmt[2].stride, n, n0, n1, down_.data() + at * dim, dim, my_scratch);
      if (counting) count(e, 2 * gu_tiles + tile, n, n1 - n0, W.down_exps[e], ffn);
    }
  };
  // Runs the unclaimed items of active expert a; returns how many this thread ran. With `pass_unready` it leaves
  // the expert when its next item is a down item and the expert is not ready (another thread still runs one of its
  // gate+up items, or was descheduled holding one): the thread does other work instead of waiting.
  auto drain = [&](int64_t a, int thread, bool pass_unready) {
    const int32_t e = active_[a];
    std::atomic<int32_t>& next = cursors_[a].next;
    int64_t ran = 0;
    for (int32_t i = next.load(std::memory_order_relaxed); i < expert_items;) {
      if (pass_unready && i >= gu_tiles && ready_[e].load(std::memory_order_acquire) == 0) break;
      if (!next.compare_exchange_weak(i, i + 1, std::memory_order_relaxed)) continue;  // i reloaded
      run_item(e, i, thread);
      ++ran;
      i = next.load(std::memory_order_relaxed);
    }
    return ran;
  };
  // One loop item per thread's share (an empty share when there are fewer active experts than threads): whoever
  // runs share s drains its experts in order, then helps with the other shares' experts, last first, passing over
  // experts not ready for their down items; last, it takes whatever is left, waiting for readiness only then. A
  // thread that starts late finds its share taken over and returns.
  const int shares = pool.size();
  auto share_begin = [&](int64_t s) { return n_active * s / shares; };
  pool.parallel_for(shares, [&](int64_t share, int thread) {
    for (int64_t a = share_begin(share); a < share_begin(share + 1); ++a) drain(a, thread, true);
    int64_t others = 0;
    for (int k = 1; k < shares; ++k) {
      const int64_t victim = (share + k) % shares;
      for (int64_t a = share_begin(victim + 1) - 1; a >= share_begin(victim); --a) others += drain(a, thread, true);
    }
    for (int k = 0; k < shares; ++k) {
      const int64_t s = (share + k) % shares;
      for (int64_t a = share_begin(s); a < share_begin(s + 1); ++a) {
        const int64_t ran = drain(a, thread, false);
        if (k > 0) others += ran;
      }
    }
    if (counting) helped.fetch_add(others, std::memory_order_relaxed);
  });
  if (counting) {
    prof->sections["moe experts streamed"].calls += last_active_;
    prof->sections["moe expert tiles"].calls += tiles.load();
    prof->sections["moe expert tile rows"].calls += tile_rows.load();
    prof->sections["moe expert weight bytes"].calls += weight_bytes.load();
    prof->sections["moe expert tiles revisited"].calls += revisits.load();
    Profile::Section& w = prof->sections["moe expert ready waits"];
    w.calls += waits.load();
    w.seconds += 1e-9 * static_cast<double>(wait_ns.load());
    prof->sections["moe expert items helped"].calls += helped.load();
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

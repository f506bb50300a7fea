#include "compute.h"

#include "lora.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#if CONDUIT_X86
#include <immintrin.h>
#endif

namespace conduit {

bool kquant_dot_enabled() {
  const char* v = std::getenv("CONDUIT_KQUANT_DOT");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Matmul

namespace {
constexpr size_t kAlign = 64;
inline size_t align_up(size_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }
// Activation rows quantized per work item: enough to amortise the hand-out, small enough to balance.
constexpr int64_t kQuantizeRowsPerItem = 16;
static_assert(kMatmulTileRows <= kLoraUpChunk && kMatmulTileRows % kLoraBtBlock == 0, "a tile's LoRA up-projection is one kernel call on whole Bt blocks");
// Pauses a thread spins waiting for the LoRA down-projections before it yields its core.
constexpr int kDownsSpins = 20000;

// Per-call arrays indexed by output: inline up to kInlineOutputs (every matmul of a forward pass: Q, K and V at most),
// so a decode step's few dozen calls allocate nothing; on the heap beyond (the MoE router's slices).
constexpr int kInlineOutputs = 4;
template <typename T, int N>
class SmallArray {
 public:
  explicit SmallArray(int n, T fill = T()) : heap_(n > N ? new T[n] : nullptr) {
    data_ = n > N ? heap_.get() : inline_;
    std::fill_n(data_, n, fill);
  }
  SmallArray(const SmallArray&) = delete;
  SmallArray& operator=(const SmallArray&) = delete;
  T& operator[](int64_t i) { return data_[i]; }
  const T& operator[](int64_t i) const { return data_[i]; }

 private:
  T inline_[N];
  std::unique_ptr<T[]> heap_;
  T* data_;
};

inline void spin_pause() {
#if CONDUIT_X86
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}
}  // namespace

void matmul(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const float* x, int64_t m, int64_t k,
            const MatmulOutput* outputs, int count, const LoraPlan* lora) {
  if (m == 0 || count == 0) return;

  // One activation buffer per distinct quantizer among the outputs (in practice at most one).
  struct Format {
    const MatmulKernel* kernel = nullptr;
    size_t offset = 0, stride = 0;
  };
  SmallArray<Format, kInlineOutputs> formats(count);
  SmallArray<int, kInlineOutputs> format_of(count, -1);
  int num_formats = 0;
  size_t act_bytes = 0, scratch_bytes = 0;
  for (int i = 0; i < count; ++i) {
    const MatmulKernel& mk = kt.matmul[outputs[i].type];
    scratch_bytes = std::max(scratch_bytes, align_up(mk.scratch_bytes(k)));
    if (!mk.act_row_bytes) continue;
    for (int f = 0; f < num_formats; ++f) {
      if (formats[f].kernel->quantize_act == mk.quantize_act) format_of[i] = f;
    }
    if (format_of[i] < 0) {
      const size_t stride = align_up(mk.act_row_bytes(k));
      format_of[i] = num_formats;
      formats[num_formats++] = {&mk, act_bytes, stride};
      act_bytes += stride * static_cast<size_t>(m);
    }
  }
  // Each thread's slice of the scratch: the tile kernels' bytes, then the LoRA up-projection's floats.
  const size_t tile_scratch_bytes = scratch_bytes;
  if (lora) scratch_bytes += align_up(lora->up_scratch_floats() * sizeof(float));
  uint8_t* act = num_formats == 0 ? nullptr : ws.activations.get(act_bytes);
  uint8_t* scratch = ws.per_thread.get(scratch_bytes * static_cast<size_t>(pool.size()));

  // The LoRA down-projections (u = A x of each adapted row) must be done before any tile's up-projection. Many (a
  // prefill's) are items of the quantization's job; few (a decode step's) run in the tiles' job, below.
  const int64_t lora_downs = lora ? lora->down_items() : 0;
  const bool downs_in_tiles = lora_downs > 0 && lora->down_macs() <= kLoraInlineDownMacs;
  const int64_t pooled_downs = downs_in_tiles ? 0 : lora_downs;
  if (num_formats > 0 || pooled_downs > 0) {
    ProfileScope scope(ws.profile, "quantize activations");
    const int64_t items = div_ceil(m, kQuantizeRowsPerItem);
    const int64_t quantize_items = items * num_formats;
    pool.parallel_for(quantize_items + pooled_downs, [&](int64_t item, int) {
      if (item >= quantize_items) {
        lora->down(kt, item - quantize_items);
        return;
      }
      const Format& f = formats[item / items];
      const int64_t r0 = (item % items) * kQuantizeRowsPerItem, r1 = min64(m, r0 + kQuantizeRowsPerItem);
      for (int64_t r = r0; r < r1; ++r) f.kernel->quantize_act(x + r * k, k, act + f.offset + r * f.stride);
    });
  }

  // Few down-projections run in the tiles' job, ahead of the tiles: every thread, on its first tile, takes down items
  // until none is left and then waits for the ones still running on other threads (one item at most each, a few
  // microseconds), so the threads share them and none sits idle while another runs them all.
  std::atomic<int64_t> downs_next{0}, downs_done{downs_in_tiles ? 0 : lora_downs};
  auto ensure_downs = [&] {
    if (downs_done.load(std::memory_order_acquire) == lora_downs) return;
    for (int64_t d = downs_next.fetch_add(1, std::memory_order_relaxed); d < lora_downs;
         d = downs_next.fetch_add(1, std::memory_order_relaxed)) {
      lora->prefetch_down(d + 1);
      lora->down(kt, d);
      downs_done.fetch_add(1, std::memory_order_release);
    }
    for (int spins = 0; downs_done.load(std::memory_order_acquire) != lora_downs; ++spins) {
      if (spins < kDownsSpins) {
        spin_pause();
      } else {
        std::this_thread::yield();  // a thread running one was descheduled
      }
    }
  };

  // Tiles of all outputs in one list: tile_start[i] is the first tile of output i.
  SmallArray<int64_t, kInlineOutputs + 1> tile_start(count + 1, 0);
  for (int i = 0; i < count; ++i) tile_start[i + 1] = tile_start[i] + div_ceil(outputs[i].n, kMatmulTileRows);
  pool.parallel_for_ranges(tile_start[count], [&](int64_t tile, int thread) {
    int i = 0;
    while (tile >= tile_start[i + 1]) ++i;
    if (downs_in_tiles) ensure_downs();
    const MatmulOutput& o = outputs[i];
    const MatmulKernel& mk = kt.matmul[o.type];
    MatmulTile t;
    t.x = x;
    t.act = format_of[i] >= 0 ? act + formats[format_of[i]].offset : nullptr;
    t.act_stride = format_of[i] >= 0 ? formats[format_of[i]].stride : 0;
    t.M = m;
    t.K = k;
    t.w = o.w;
    t.w_row_bytes = row_bytes(o.type, k);
    t.n0 = (tile - tile_start[i]) * kMatmulTileRows;
    t.n1 = min64(o.n, t.n0 + kMatmulTileRows);
    t.n_total = o.n;
    t.y = o.y;
    t.ldy = o.ldy;
    t.scratch = scratch + scratch_bytes * static_cast<size_t>(thread);
    if (lora) {
      if (lora->adapts(i)) lora->prefetch_up(i, t.n0, t.n1);
      lora->prefetch_next(tile, tile_start[count]);
    }
    if (o.packed) {
      mk.packed_tile(t);
    } else {
      mk.tile(t);
    }
    // The tile's columns are final: add the LoRA products of every adapted row to them (kMatmulTileRows <=
    // kLoraUpChunk, so one up-projection call per adapter).
    if (lora && lora->adapts(i)) {
      lora->up(kt, i, t.n0, t.n1, reinterpret_cast<float*>(t.scratch + tile_scratch_bytes));
    }
  });
}

WeightBytes matmul_worker_weights(const KernelTable& kt, const ThreadPool& pool, int64_t k, const MatmulOutput* outputs,
                                  int count) {
  if (pool.size() < 2 || count == 0) return {};
  int64_t tiles = 0;
  for (int i = 0; i < count; ++i) tiles += div_ceil(outputs[i].n, kMatmulTileRows);
  const MatmulOutput& last = outputs[count - 1];
  const int64_t last_start = tiles - div_ceil(last.n, kMatmulTileRows);
  const int64_t row0 = (std::max(tiles / pool.size(), last_start) - last_start) * kMatmulTileRows;
  if (row0 >= last.n) return {};
  const MatmulKernel& mk = kt.matmul[last.type];
  // Where a row starts: every packed layout stores whole panels in row order, packed_bytes(rows, k) before it.
  auto offset = [&](int64_t rows) {
    return last.packed ? mk.packed_bytes(rows, k) : static_cast<size_t>(rows) * row_bytes(last.type, k);
  };
  return {last.w + offset(row0), offset(last.n) - offset(row0)};
}

// ---------------------------------------------------------------------------------------------------------------
// RoPE

std::vector<double> rope_inverse_frequencies(const RopeConfig& c) {
  const int half = c.rope_dim / 2;
  std::vector<double> inv(half);
  for (int i = 0; i < half; ++i) {
    double freq = std::pow(c.theta, -2.0 * i / c.rope_dim);
    if (c.scaling == RopeConfig::Scaling::LongRope) {
      freq /= c.freq_factors[i];
    } else if (c.scaling == RopeConfig::Scaling::Linear) {
      freq /= c.factor;
    } else if (c.scaling == RopeConfig::Scaling::Llama3) {
      // Llama 3.1: long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
      const double low_freq_wavelen = c.original_context / c.low_freq_factor;
      const double high_freq_wavelen = c.original_context / c.high_freq_factor;
      const double wavelen = 2.0 * M_PI / freq;
      if (wavelen > low_freq_wavelen) {
        freq /= c.factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth =
            (c.original_context / wavelen - c.low_freq_factor) / (c.high_freq_factor - c.low_freq_factor);
        freq = (1.0 - smooth) * freq / c.factor + smooth * freq;
      }
    }
    inv[i] = freq;
  }
  return inv;
}

void RopeTable::compute(ThreadPool& pool, const std::vector<double>& inv_freq, const int32_t* positions,
                        int64_t rows, double mscale) {
  half = static_cast<int>(inv_freq.size());
  cos.resize(static_cast<size_t>(rows) * half);
  sin.resize(static_cast<size_t>(rows) * half);
  constexpr int64_t kRowsPerItem = 32;
  pool.parallel_for(div_ceil(rows, kRowsPerItem), [&](int64_t item, int) {
    for (int64_t r = item * kRowsPerItem; r < min64(rows, (item + 1) * kRowsPerItem); ++r) {
      for (int i = 0; i < half; ++i) {
        const double angle = static_cast<double>(positions[r]) * inv_freq[i];
        cos[r * half + i] = static_cast<float>(std::cos(angle) * mscale);
        sin[r * half + i] = static_cast<float>(std::sin(angle) * mscale);
      }
    }
  });
}

void apply_rope(const KernelTable& kt, ThreadPool& pool, const RopeTable& table, const RopeParams& p, float* x,
                int64_t rows) {
  const int64_t stride = static_cast<int64_t>(p.num_heads) * p.head_dim;
  constexpr int64_t kRowsPerItem = 32;
  pool.parallel_for(div_ceil(rows, kRowsPerItem), [&](int64_t item, int) {
    for (int64_t r = item * kRowsPerItem; r < min64(rows, (item + 1) * kRowsPerItem); ++r) {
      kt.rope(x + r * stride, p, table.cos.data() + r * table.half, table.sin.data() + r * table.half);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// KV store

void kv_write(const KernelTable& kt, const float* k, const float* v, int64_t rows, int64_t row_elems,
              const int32_t* slots, uint8_t* k_region, uint8_t* v_region, bool f16) {
  const int64_t row_bytes_in_pool = row_elems * (f16 ? 2 : 4);
  for (int64_t r = 0; r < rows; ++r) {
    kt.kv_store(k + r * row_elems, k_region + slots[r] * row_bytes_in_pool, row_elems, f16);
    kt.kv_store(v + r * row_elems, v_region + slots[r] * row_bytes_in_pool, row_elems, f16);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Attention

namespace {

// Whole-context rows, units of (sequence, KV heads, rows): the kernels without split-K (generic).
void attention_by_heads(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const AttentionArgs& a, int num_seqs) {
  // Units of up to kAttentionRowsPerUnit rows of one sequence; the costliest (latest rows of long sequences) are
  // listed first so the dynamic hand-out ends with small units and the threads finish together. With enough
  // sequences to keep every thread busy, a unit takes all KV heads of its sequence: the heads of one position
  // share cache lines, which then come from one thread's L2 instead of being fetched by both.
  struct Unit {
    int seq, head_begin, head_end, row_begin, row_end;
    int64_t cost;  // score/value rows touched
  };
  const int heads_per_unit = num_seqs >= 4 * pool.size() ? a.num_kv_heads : 1;
  std::vector<Unit> units;
  int max_context = 1;
  for (int s = 0; s < num_seqs; ++s) {
    const int rows = a.query_start_loc[s + 1] - a.query_start_loc[s];
    const int cached = a.seq_lens[s] - rows;
    max_context = std::max(max_context, a.seq_lens[s]);
    for (int r1 = rows; r1 > 0; r1 -= kAttentionRowsPerUnit) {
      const int r0 = std::max(0, r1 - kAttentionRowsPerUnit);
      const int64_t cost = static_cast<int64_t>(cached + r1) * (r1 - r0) * heads_per_unit;
      for (int h = 0; h < a.num_kv_heads; h += heads_per_unit) {
        units.push_back({s, h, std::min(h + heads_per_unit, a.num_kv_heads), r0, r1, cost});
      }
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& x, const Unit& y) { return x.cost > y.cost; });
  const size_t group = static_cast<size_t>(a.num_heads / a.num_kv_heads);
  const size_t floats = align_up(attention_scratch_floats(max_context, a.head_dim, static_cast<int>(group)) * 4) / 4;
  float* scratch = reinterpret_cast<float*>(ws.per_thread.get(floats * sizeof(float) * pool.size()));
  pool.parallel_for(static_cast<int64_t>(units.size()), [&](int64_t i, int thread) {
    const Unit& u = units[i];
    for (int h = u.head_begin; h < u.head_end; ++h) {
      kt.attention(a, u.seq, h, u.row_begin, u.row_end, scratch + floats * thread);
    }
  });
}

// Rows per range at most this many to be split by chunk over threads (decode, speculative decode): beyond that a
// range has work enough of its own and its partials would take too much memory.
constexpr int kAttentionSplitMaxRows = 4;
// Partials of split ranges at most this many floats (16 MiB); ranges beyond it fold their chunks in one unit.
// A partial is all heads' outputs of one row and chunk, so very long contexts of wide models would otherwise
// take tens of megabytes per row.
constexpr size_t kAttentionPartialBudget = size_t{4} << 20;

}  // namespace

void attention(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const AttentionArgs& a, int num_seqs) {
  if (!kt.attention_chunks) return attention_by_heads(kt, pool, ws, a, num_seqs);
  // Ranges of up to kAttentionRowsPerUnit rows of one sequence, each unit covering all KV heads. When there are
  // too few ranges to keep the threads busy (a few decode rows), short ranges are split into one unit per chunk
  // whose partials are merged afterwards; otherwise a unit folds all chunks of its range itself. Both give the
  // same bits (kernels.h), so this choice may depend on the batch and the pool.
  struct Range {
    int seq, row_begin, row_end, chunks;
    int first_chunk;  // chunks before it are outside every row's sliding window
    size_t partials;  // offset of its partials in the partial buffer (split ranges)
    bool split;
  };
  struct Unit {
    int range, chunk;  // chunk -1: all chunks
    int64_t cost;      // positions x rows
  };
  std::vector<Range> ranges;
  for (int s = 0; s < num_seqs; ++s) {
    const int rows = a.query_start_loc[s + 1] - a.query_start_loc[s];
    const int cached = a.seq_lens[s] - rows;
    for (int r1 = rows; r1 > 0; r1 -= kAttentionRowsPerUnit) {
      const int r0 = std::max(0, r1 - kAttentionRowsPerUnit);
      const int first_chunk = attention_first_position(a, cached + r0 + 1) / kAttentionChunk;
      ranges.push_back({s, r0, r1, attention_chunks(cached + r1), first_chunk, 0, false});
    }
  }
  const bool few = ranges.size() < static_cast<size_t>(4 * pool.size());
  const size_t partial_floats = attention_partial_floats(a.num_heads, a.head_dim);
  size_t partial_total = 0;
  std::vector<Unit> units;
  bool any_split = false;
  for (int i = 0; i < static_cast<int>(ranges.size()); ++i) {
    Range& r = ranges[i];
    const int cached = a.seq_lens[r.seq] - (a.query_start_loc[r.seq + 1] - a.query_start_loc[r.seq]);
    const size_t need = static_cast<size_t>(r.row_end - r.row_begin) * r.chunks * partial_floats;
    r.split = few && pool.size() > 1 && r.chunks - r.first_chunk > 1 &&
              r.row_end - r.row_begin <= kAttentionSplitMaxRows && partial_total + need <= kAttentionPartialBudget;
    if (!r.split) {
      const int64_t positions = cached + r.row_end - static_cast<int64_t>(r.first_chunk) * kAttentionChunk;
      units.push_back({i, -1, positions * (r.row_end - r.row_begin)});
      continue;
    }
    r.partials = partial_total;
    partial_total += need;
    for (int c = r.first_chunk; c < r.chunks; ++c) {
      const int positions = std::min(kAttentionChunk, cached + r.row_end - c * kAttentionChunk);
      units.push_back({i, c, static_cast<int64_t>(positions) * (r.row_end - r.row_begin)});
    }
    any_split = true;
  }
  // When every range is split (a few decode rows at a long context), the units are listed range by range, chunk by
  // chunk, and each thread takes a contiguous share of them (parallel_for_ranges): its K and V reads are one
  // sequential stream over its part of the context, which the prefetchers follow across chunk boundaries, instead
  // of every other chunk. Otherwise the costliest units go first so the dynamic hand-out ends with small ones.
  bool all_split = true;
  for (const Range& r : ranges) all_split = all_split && r.split;
  if (!all_split) {
    std::stable_sort(units.begin(), units.end(), [](const Unit& x, const Unit& y) { return x.cost > y.cost; });
  }
  const size_t floats = align_up(attention_chunk_scratch_floats(a.num_heads, a.head_dim) * 4) / 4;
  float* scratch = reinterpret_cast<float*>(ws.per_thread.get((floats * pool.size() + partial_total) * sizeof(float)));
  float* partials = scratch + floats * pool.size();
  // A split range's rows are merged by the thread that finishes its last chunk, inside the same parallel loop: a
  // second loop just for the merges cost a hand-over per layer, with one thread idle while the other merged.
  // (acq_rel: the merging thread sees every other thread's partials of the range.)
  std::unique_ptr<std::atomic<int>[]> chunks_left;
  if (any_split) {
    chunks_left.reset(new std::atomic<int>[ranges.size()]);
    for (size_t i = 0; i < ranges.size(); ++i) {
      chunks_left[i].store(ranges[i].chunks - ranges[i].first_chunk, std::memory_order_relaxed);
    }
  }
  auto run_unit = [&](int64_t i, int thread) {
    const Unit& u = units[i];
    const Range& r = ranges[u.range];
    const size_t row_stride = static_cast<size_t>(r.chunks) * partial_floats;
    float* thread_scratch = scratch + floats * thread;
    kt.attention_chunks(a, r.seq, r.row_begin, r.row_end, u.chunk, u.chunk < 0 ? nullptr : partials + r.partials,
                        row_stride, thread_scratch);
    if (u.chunk < 0 || chunks_left[u.range].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    for (int row = r.row_begin; row < r.row_end; ++row) {
      kt.attention_merge(a, r.seq, row, partials + r.partials + (row - r.row_begin) * row_stride, thread_scratch);
    }
  };
  if (all_split) {
    pool.parallel_for_ranges(static_cast<int64_t>(units.size()), [&](int64_t i, int thread) { run_unit(i, thread); });
  } else {
    pool.parallel_for(static_cast<int64_t>(units.size()), [&](int64_t i, int thread) { run_unit(i, thread); });
  }
}

}  // namespace conduit

#include "lora.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "common.h"
#include "memory.h"

namespace conduit {

namespace {

uint16_t fp32_to_bf16(float f) {
  const uint32_t x = float_to_bits(f);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // nan stays a quiet nan
  return static_cast<uint16_t>((x + 0x7FFF + ((x >> 16) & 1)) >> 16);                 // round to nearest even
}

// Writes `rows` rows of `cols` values (value(r, c)) in `dtype` into bytes (zeroed), with per-row scales: element
// (r, c) at element index index(r, c).
template <typename Value, typename Index>
void pack_rows(int64_t rows, int64_t cols, int dtype, Value value, Index index, uint8_t* bytes, float* scales) {
  for (int64_t r = 0; r < rows; ++r) {
    scales[r] = 1.0f;
    if (dtype == kLoraF32) {
      float* dst = reinterpret_cast<float*>(bytes);
      for (int64_t c = 0; c < cols; ++c) dst[index(r, c)] = value(r, c);
    } else if (dtype == kLoraBF16) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(bytes);
      for (int64_t c = 0; c < cols; ++c) dst[index(r, c)] = fp32_to_bf16(value(r, c));
    } else {
      float absmax = 0.0f;
      for (int64_t c = 0; c < cols; ++c) absmax = std::max(absmax, std::fabs(value(r, c)));
      const float scale = absmax / 127.0f;
      scales[r] = scale;
      int8_t* dst = reinterpret_cast<int8_t*>(bytes);
      if (scale == 0.0f) continue;
      for (int64_t c = 0; c < cols; ++c) {
        const float q = std::nearbyint(value(r, c) / scale);
        dst[index(r, c)] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, q)));
      }
    }
  }
}

constexpr size_t align64(size_t n) { return (n + 63) & ~size_t{63}; }

// The packed pieces of m: A, Bt, A's scales, Bt's scales.
std::array<size_t, 4> packed_piece_bytes(const LoraMatrix& m, int dtype) {
  const size_t element = lora_dtype_bytes(dtype);
  return {align64(static_cast<size_t>(m.rank * m.in) * element),
          align64(static_cast<size_t>(lora_bt_elements(dtype, m.rank, m.out)) * element),
          align64(static_cast<size_t>(m.rank) * sizeof(float)), align64(static_cast<size_t>(m.rank) * sizeof(float))};
}

// Prefetches [p, p + bytes) into L2 (a no-op where the compiler has no prefetch).
inline void prefetch_range(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  const uintptr_t first = reinterpret_cast<uintptr_t>(c) & ~uintptr_t{63};
  for (uintptr_t a = first; a < reinterpret_cast<uintptr_t>(c) + bytes; a += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
  }
}

}  // namespace

size_t lora_packed_bytes(const LoraMatrix& m, int dtype) {
  if (m.rank == 0) return 0;
  const std::array<size_t, 4> pieces = packed_piece_bytes(m, dtype);
  return pieces[0] + pieces[1] + pieces[2] + pieces[3];
}

void lora_pack(LoraMatrix& m, int dtype, uint8_t* at) {
  if (m.rank == 0) return;
  const std::array<size_t, 4> pieces = packed_piece_bytes(m, dtype);
  const float* a = m.a.data();
  const float* b = m.b.data();
  const int64_t in = m.in, rank = m.rank;
  m.a_packed = {at, static_cast<size_t>(rank * in) * lora_dtype_bytes(dtype)};
  m.bt_packed = {at + pieces[0], static_cast<size_t>(lora_bt_elements(dtype, rank, m.out)) * lora_dtype_bytes(dtype)};
  m.a_scale = {reinterpret_cast<float*>(at + pieces[0] + pieces[1]), static_cast<size_t>(rank)};
  m.bt_scale = {reinterpret_cast<float*>(at + pieces[0] + pieces[1] + pieces[2]), static_cast<size_t>(rank)};
  pack_rows(
      rank, in, dtype, [&](int64_t k, int64_t i) { return a[k * in + i]; }, [&](int64_t k, int64_t i) { return k * in + i; },
      m.a_packed.data(), m.a_scale.data());
  pack_rows(
      rank, m.out, dtype, [&](int64_t k, int64_t o) { return b[o * rank + k]; },
      [&](int64_t k, int64_t o) { return lora_bt_index(dtype, rank, k, o); }, m.bt_packed.data(), m.bt_scale.data());
  if (dtype == kLoraQ8) {
    // Offset by 128 (unsigned bytes: the operand VPDPBUSD takes unsigned); Bt's padding becomes 128, a zero weight.
    for (size_t i = 0; i < m.a_packed.size(); ++i) m.a_packed.data()[i] ^= 0x80;
    for (size_t i = 0; i < m.bt_packed.size(); ++i) m.bt_packed.data()[i] ^= 0x80;
  }
  std::vector<float>().swap(m.a);
  std::vector<float>().swap(m.b);
}

void LoraSet::set(int slot, std::unique_ptr<LoraAdapter> adapter) {
  if (adapter) {
    size_t total = 0;
    for (const auto& layer : adapter->layers) {
      for (const LoraMatrix& m : layer) total += lora_packed_bytes(m, adapter->dtype);
    }
    constexpr size_t kHugePage = size_t{2} << 20;
    const bool huge = total >= (size_t{1} << 20);
    const size_t bytes = huge ? (total + kHugePage - 1) & ~(kHugePage - 1) : std::max<size_t>(align64(total), 64);
    uint8_t* arena = static_cast<uint8_t*>(std::aligned_alloc(huge ? kHugePage : 64, bytes));
    if (!arena) throw std::bad_alloc();
    adapter->arena.reset(arena);
    adapter->arena_bytes = bytes;
    if (huge) advise_huge_pages(arena, bytes, false);  // before the first touch, so the faults take huge pages
    std::memset(arena, 0, bytes);
    size_t offset = 0;
    for (auto& layer : adapter->layers) {
      for (LoraMatrix& m : layer) {
        lora_pack(m, adapter->dtype, arena + offset);
        offset += lora_packed_bytes(m, adapter->dtype);
      }
    }
  }
  if (slot >= static_cast<int>(slots_.size())) slots_.resize(slot + 1);
  slots_[slot] = std::move(adapter);
}

size_t LoraSet::bytes() const {
  size_t total = 0;
  for (const std::unique_ptr<LoraAdapter>& adapter : slots_) {
    if (!adapter) continue;
    total += adapter->arena_bytes;
    for (const auto& layer : adapter->layers) {
      for (const LoraMatrix& m : layer) total += (m.a.capacity() + m.b.capacity()) * sizeof(float);
    }
  }
  return total;
}

bool lora_fuse_enabled() {
  const char* v = std::getenv("CONDUIT_LORA_FUSE");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

bool LoraPlan::plan(const LoraSet& set, const int32_t* slots, int64_t rows, int64_t layer, const LoraOutput* outputs,
                    int count) {
  jobs_.clear();
  downs_.clear();
  next_.clear();
  next_end_.clear();
  down_macs_ = 0;
  up_scratch_floats_ = 0;
  if (!slots || set.size() == 0 || count <= 0 || rows <= 0) return false;
  slot_count_.assign(static_cast<size_t>(set.size()) + 1, 0);
  int64_t adapted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (set.get(slots[r])) {
      ++slot_count_[slots[r] + 1];
      ++adapted;
    }
  }
  if (adapted == 0) return false;
  for (int s = 0; s < set.size(); ++s) slot_count_[s + 1] += slot_count_[s];
  rows_by_slot_.resize(static_cast<size_t>(adapted));
  groups_.clear();
  for (int s = 0; s < set.size(); ++s) {
    if (slot_count_[s + 1] > slot_count_[s]) groups_.push_back({set.get(s), slot_count_[s], slot_count_[s + 1]});
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (set.get(slots[r])) rows_by_slot_[slot_count_[slots[r]]++] = static_cast<int32_t>(r);
  }

  // Rows per down-projection item: a prefill's many rows of one adapter are split over the threads.
  constexpr int64_t kDownRows = 32;
  outputs_.assign(outputs, outputs + count);
  job_start_.assign(static_cast<size_t>(count) + 1, 0);
  size_t u_floats = 0;
  for (int c = 0; c < count; ++c) {
    job_start_[c] = static_cast<int64_t>(jobs_.size());
    for (const Group& g : groups_) {
      if (layer >= static_cast<int64_t>(g.adapter->layers.size())) continue;
      const LoraMatrix& m = g.adapter->layers[layer][outputs_[c].target];
      if (m.rank == 0) continue;
      const int64_t job = static_cast<int64_t>(jobs_.size());
      jobs_.push_back({g.adapter, &m, &outputs_[c], g.begin, g.end, u_floats});
      u_floats += static_cast<size_t>((g.end - g.begin) * lora_u_stride(g.adapter->dtype, m.rank));
      for (int64_t r0 = g.begin; r0 < g.end; r0 += kDownRows) {
        const int64_t r1 = std::min(g.end, r0 + kDownRows);
        downs_.push_back({job, r0, r1});
        down_macs_ += (r1 - r0) * m.rank * m.in;
      }
      up_scratch_floats_ = std::max(up_scratch_floats_, lora_up_scratch_floats(m.rank));
    }
  }
  job_start_[count] = static_cast<int64_t>(jobs_.size());
  if (jobs_.empty()) return false;
  if (u_.size() < u_floats) u_.resize(u_floats);
  return true;
}

void LoraPlan::down(const KernelTable& kt, int64_t item) const {
  const Down& d = downs_[item];
  const Job& j = jobs_[d.job];
  const int dtype = j.adapter->dtype;
  float* u = u_.data() + j.u_offset + (d.r0 - j.begin) * lora_u_stride(dtype, j.m->rank);
  kt.lora_down[dtype](j.m->view(dtype), j.out->x, j.out->ldx, rows_by_slot_.data() + d.r0, d.r1 - d.r0, u);
}

void LoraPlan::prefetch_down(int64_t item) const {
  if (item < 0 || item >= down_items()) return;
  const LoraMatrix& m = *jobs_[downs_[item].job].m;
  prefetch_range(m.a_packed.data(), m.a_packed.size());
  prefetch_range(m.a_scale.data(), m.a_scale.size() * sizeof(float));
}

void LoraPlan::set_next(int64_t layer, const LoraTarget* targets, int count) {
  next_.clear();
  next_end_.clear();
  if (jobs_.empty()) return;
  size_t total = 0;
  auto add = [&](const void* p, size_t bytes) {
    if (bytes == 0) return;
    next_.push_back({static_cast<const uint8_t*>(p), bytes});
    next_end_.push_back(total += bytes);
  };
  for (const Group& g : groups_) {
    if (layer < 0 || layer >= static_cast<int64_t>(g.adapter->layers.size())) continue;
    for (int c = 0; c < count; ++c) {
      const LoraMatrix& m = g.adapter->layers[layer][targets[c]];
      if (m.rank == 0) continue;
      add(m.a_packed.data(), m.a_packed.size());
      add(m.a_scale.data(), m.a_scale.size() * sizeof(float));
    }
  }
}

void LoraPlan::prefetch_next(int64_t part, int64_t parts) const {
  if (next_.empty() || parts <= 0 || part < 0 || part >= parts) return;
  const size_t total = next_end_.back();
  // total * parts stays far from overflow: an adapter's matrices are megabytes, a matmul's tiles thousands.
  size_t begin = total * static_cast<size_t>(part) / static_cast<size_t>(parts);
  const size_t end = total * static_cast<size_t>(part + 1) / static_cast<size_t>(parts);
  size_t i = static_cast<size_t>(std::upper_bound(next_end_.begin(), next_end_.end(), begin) - next_end_.begin());
  for (; begin < end && i < next_.size(); ++i) {
    const size_t range_begin = next_end_[i] - next_[i].bytes;
    const size_t stop = std::min(end, next_end_[i]);
    prefetch_range(next_[i].p + (begin - range_begin), stop - begin);
    begin = stop;
  }
}

void LoraPlan::prefetch_up(int output, int64_t o0, int64_t o1) const {
  for (int64_t job = job_start_[output]; job < job_start_[output + 1]; ++job) {
    const LoraMatrix& m = *jobs_[job].m;
    const int dtype = jobs_[job].adapter->dtype;
    const size_t bytes = lora_dtype_bytes(dtype);
    const int64_t block = lora_bt_rows(dtype, m.rank) * kLoraBtBlock;
    const int64_t b0 = o0 / kLoraBtBlock, b1 = div_ceil(min64(o1, m.out), kLoraBtBlock);
    if (b1 <= b0) continue;
    prefetch_range(m.bt_packed.data() + static_cast<size_t>(b0 * block) * bytes, static_cast<size_t>((b1 - b0) * block) * bytes);
    prefetch_range(m.bt_scale.data(), m.bt_scale.size() * sizeof(float));
  }
}

void LoraPlan::up_job(const KernelTable& kt, int64_t job, int64_t o0, int64_t o1, float* scratch) const {
  const Job& j = jobs_[job];
  const int dtype = j.adapter->dtype;
  kt.lora_up[dtype](j.m->view(dtype), u_.data() + j.u_offset, rows_by_slot_.data() + j.begin, j.end - j.begin,
                    j.adapter->scale, j.out->y, j.out->ldy, o0, o1, scratch);
}

void LoraPlan::up(const KernelTable& kt, int output, int64_t o0, int64_t o1, float* scratch) const {
  for (int64_t job = job_start_[output]; job < job_start_[output + 1]; ++job) up_job(kt, job, o0, o1, scratch);
}

void lora_apply(const KernelTable& kt, ThreadPool& pool, LoraPlan& plan, const LoraSet& set, const int32_t* slots,
                int64_t rows, int64_t layer, LoraTarget target, const float* x, int64_t ldx, float* y, int64_t ldy) {
  const LoraOutput output{target, x, ldx, y, ldy};
  lora_apply_many(kt, pool, plan, set, slots, rows, layer, &output, 1);
}

void lora_apply_many(const KernelTable& kt, ThreadPool& pool, LoraPlan& plan, const LoraSet& set,
                     const int32_t* slots, int64_t rows, int64_t layer, const LoraOutput* outputs, int count) {
  if (!plan.plan(set, slots, rows, layer, outputs, count)) return;
  const LoraPlan& p = plan;
  // Down-projections: each adapter's A read once for all its rows (once per 32 rows in a long prefill).
  if (p.down_macs() <= kLoraInlineDownMacs) {
    for (int64_t i = 0; i < p.down_items(); ++i) p.down(kt, i);
  } else {
    pool.parallel_for(p.down_items(), [&](int64_t i, int) { p.down(kt, i); });
  }
  // Up-projections: each adapter's B read once for all its rows, its outputs split in chunks over the threads.
  struct Up {
    int64_t job;
    int64_t o0, o1;
  };
  thread_local std::vector<Up> ups;  // the caller's (only the thread running a forward pass calls this)
  ups.clear();
  for (int64_t j = 0; j < p.jobs(); ++j) {
    const int64_t out = p.up_job_columns(j);
    for (int64_t o0 = 0; o0 < out; o0 += kLoraUpChunk) ups.push_back({j, o0, std::min(out, o0 + kLoraUpChunk)});
  }
  const Up* up_items = ups.data();  // the pool's threads see their own (empty) thread_local vectors
  const size_t scratch_floats = p.up_scratch_floats();
  pool.parallel_for(static_cast<int64_t>(ups.size()), [&](int64_t i, int) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
    const Up& up = up_items[i];
    p.up_job(kt, up.job, up.o0, up.o1, scratch.data());
  });
}

}  // namespace conduit

#include "lora.h"

#include <algorithm>
#include <cmath>

#include "common.h"

namespace conduit {

namespace {

uint16_t fp32_to_bf16(float f) {
  const uint32_t x = float_to_bits(f);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // nan stays a quiet nan
  return static_cast<uint16_t>((x + 0x7FFF + ((x >> 16) & 1)) >> 16);                 // round to nearest even
}

// Writes `rows` rows of `cols` values (value(r, c)) in `dtype` into bytes, with per-row scales.
template <typename Value>
void pack_rows(int64_t rows, int64_t cols, int dtype, Value value, std::vector<uint8_t>& bytes,
               std::vector<float>& scales) {
  bytes.assign(static_cast<size_t>(rows * cols) * lora_dtype_bytes(dtype), 0);
  scales.assign(static_cast<size_t>(rows), 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    if (dtype == kLoraF32) {
      float* dst = reinterpret_cast<float*>(bytes.data()) + r * cols;
      for (int64_t c = 0; c < cols; ++c) dst[c] = value(r, c);
    } else if (dtype == kLoraBF16) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(bytes.data()) + r * cols;
      for (int64_t c = 0; c < cols; ++c) dst[c] = fp32_to_bf16(value(r, c));
    } else {
      float absmax = 0.0f;
      for (int64_t c = 0; c < cols; ++c) absmax = std::max(absmax, std::fabs(value(r, c)));
      const float scale = absmax / 127.0f;
      scales[r] = scale;
      int8_t* dst = reinterpret_cast<int8_t*>(bytes.data()) + r * cols;
      if (scale == 0.0f) continue;
      for (int64_t c = 0; c < cols; ++c) {
        const float q = std::nearbyint(value(r, c) / scale);
        dst[c] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, q)));
      }
    }
  }
}

}  // namespace

void lora_pack(LoraMatrix& m, int dtype) {
  if (m.rank == 0) return;
  const float* a = m.a.data();
  const float* b = m.b.data();
  const int64_t in = m.in, rank = m.rank;
  pack_rows(rank, in, dtype, [&](int64_t k, int64_t i) { return a[k * in + i]; }, m.a_packed, m.a_scale);
  pack_rows(rank, m.out, dtype, [&](int64_t k, int64_t o) { return b[o * rank + k]; }, m.bt_packed, m.bt_scale);
  std::vector<float>().swap(m.a);
  std::vector<float>().swap(m.b);
}

void LoraSet::set(int slot, std::unique_ptr<LoraAdapter> adapter) {
  if (adapter) {
    for (auto& layer : adapter->layers) {
      for (LoraMatrix& m : layer) lora_pack(m, adapter->dtype);
    }
  }
  if (slot >= static_cast<int>(slots_.size())) slots_.resize(slot + 1);
  slots_[slot] = std::move(adapter);
}

void lora_apply(const KernelTable& kt, ThreadPool& pool, const LoraSet& set, const int32_t* slots, int64_t rows,
                int64_t layer, LoraTarget target, const float* x, int64_t ldx, float* y, int64_t ldy) {
  const LoraOutput output{target, x, ldx, y, ldy};
  lora_apply_many(kt, pool, set, slots, rows, layer, &output, 1);
}

void lora_apply_many(const KernelTable& kt, ThreadPool& pool, const LoraSet& set, const int32_t* slots, int64_t rows,
                     int64_t layer, const LoraOutput* outputs, int count) {
  if (!slots || set.size() == 0 || count <= 0) return;
  // The rows of each adapter (slot ascending, rows ascending within), reused across calls: only the thread that
  // runs the forward pass calls this.
  struct Group {
    const LoraAdapter* adapter;
    int64_t begin, end;  // into rows_by_slot
  };
  // One adapter's matrix for one output: its rows (rows_by_slot[begin, end)), their u at u_offset.
  struct Job {
    const LoraAdapter* adapter;
    const LoraMatrix* m;
    const LoraOutput* out;
    int64_t begin, end;
    size_t u_offset;
  };
  // Down-projection items: a job's rows [r0, r1) (a prefill's many rows of one adapter split over the threads).
  struct Down {
    int64_t job;
    int64_t r0, r1;
  };
  // Up-projection items: a job's outputs [o0, o1).
  struct Up {
    int64_t job;
    int64_t o0, o1;
  };
  thread_local std::vector<int32_t> rows_by_slot;
  thread_local std::vector<int64_t> slot_count;
  thread_local std::vector<Group> groups;
  thread_local std::vector<Job> jobs;
  thread_local std::vector<Down> downs;
  thread_local std::vector<Up> ups;
  thread_local std::vector<float> u;

  slot_count.assign(static_cast<size_t>(set.size()) + 1, 0);
  int64_t adapted = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (set.get(slots[r])) {
      ++slot_count[slots[r] + 1];
      ++adapted;
    }
  }
  if (adapted == 0) return;
  for (int s = 0; s < set.size(); ++s) slot_count[s + 1] += slot_count[s];
  rows_by_slot.resize(static_cast<size_t>(adapted));
  groups.clear();
  for (int s = 0; s < set.size(); ++s) {
    if (slot_count[s + 1] > slot_count[s]) groups.push_back({set.get(s), slot_count[s], slot_count[s + 1]});
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (set.get(slots[r])) rows_by_slot[slot_count[slots[r]]++] = static_cast<int32_t>(r);
  }

  // Rows per down-projection item: a decode step's few rows per adapter stay one item.
  constexpr int64_t kDownRows = 32;
  jobs.clear();
  downs.clear();
  ups.clear();
  size_t u_floats = 0;
  for (const Group& g : groups) {
    if (layer >= static_cast<int64_t>(g.adapter->layers.size())) continue;
    for (int c = 0; c < count; ++c) {
      const LoraMatrix& m = g.adapter->layers[layer][outputs[c].target];
      if (m.rank == 0) continue;
      const int64_t job = static_cast<int64_t>(jobs.size());
      jobs.push_back({g.adapter, &m, &outputs[c], g.begin, g.end, u_floats});
      u_floats += static_cast<size_t>((g.end - g.begin) * m.rank);
      for (int64_t r0 = g.begin; r0 < g.end; r0 += kDownRows) downs.push_back({job, r0, std::min(g.end, r0 + kDownRows)});
      for (int64_t o0 = 0; o0 < m.out; o0 += kLoraUpChunk) ups.push_back({job, o0, std::min(m.out, o0 + kLoraUpChunk)});
    }
  }
  if (jobs.empty()) return;
  if (u.size() < u_floats) u.resize(u_floats);
  // The lambdas below run on the pool's threads, where the thread_local names above are other (empty) vectors:
  // they read these pointers to the caller's.
  float* u_data = u.data();
  const int32_t* order = rows_by_slot.data();
  const Job* job_items = jobs.data();
  const Down* down_items = downs.data();
  const Up* up_items = ups.data();

  // Down-projections: each adapter's A read once for all its rows (once per 32 rows in a long prefill). A decode
  // step's are a few hundred thousand multiply-adds: the caller runs them, sparing the pool a hand-over.
  auto down = [&](int64_t i, int) {
    const Down& d = down_items[i];
    const Job& j = job_items[d.job];
    const int dtype = j.adapter->dtype;
    kt.lora_down[dtype](j.m->view(dtype), j.out->x, j.out->ldx, order + d.r0, d.r1 - d.r0,
                        u_data + j.u_offset + (d.r0 - j.begin) * j.m->rank);
  };
  int64_t down_macs = 0;
  for (const Down& d : downs) down_macs += (d.r1 - d.r0) * jobs[d.job].m->rank * jobs[d.job].m->in;
  if (down_macs <= (int64_t{1} << 20)) {
    for (int64_t i = 0; i < static_cast<int64_t>(downs.size()); ++i) down(i, 0);
  } else {
    pool.parallel_for(static_cast<int64_t>(downs.size()), [&](int64_t i, int thread) { down(i, thread); });
  }
  // Up-projections: each adapter's B read once for all its rows, its outputs split in chunks over the threads.
  pool.parallel_for(static_cast<int64_t>(ups.size()), [&](int64_t i, int) {
    const Up& up = up_items[i];
    const Job& j = job_items[up.job];
    thread_local std::vector<float> scratch;
    const size_t need = lora_up_scratch_floats(j.m->rank);
    if (scratch.size() < need) scratch.resize(need);
    const int dtype = j.adapter->dtype;
    kt.lora_up[dtype](j.m->view(dtype), u_data + j.u_offset, order + j.begin, j.end - j.begin, j.adapter->scale,
                      j.out->y, j.out->ldy, up.o0, up.o1, scratch.data());
  });
}

}  // namespace conduit

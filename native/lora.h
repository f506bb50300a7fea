// LoRA adapters in the native forward pass: per adapter slot, the low-rank matrices A [rank x in] and B [out x rank]
// of each projection it corrects, and the batched kernel that adds scale * B (A x) to the base matmul's output for
// every row whose slot names an adapter (S-LoRA / Punica style: rows of different adapters and of the base model
// in one step). The TypeScript reference is src/model/lora.ts applyLoraRows.
//
// Storage (LoraDtype, chosen per adapter when it is loaded): A and B transposed (Bt [rank x out], the reading order
// of the up-projection) are kept as f32 (exact), bf16 (8-bit mantissa, round to nearest even) or q8: int8 with one
// f32 scale per row (row k of A and row k of Bt: the scale is the row's largest magnitude / 127, a value is
// round(w / scale)), stored offset by 128 as unsigned bytes (the operand VPDPBUSD takes unsigned). Each element of a
// q8 row is within scale/2 = absmax_row/254 of its f32 value. q8 also multiplies 8-bit activations, as a Q8_0
// matmul does (kernels.h kLoraQ8Block): x in blocks of 32, each element within dx_i = absmax_block/254 of its
// value, and f_k = bt_scale_k * u_k in blocks of 32 k, within df = max_block |f_k| / 254; the integer sums are
// exact. For one output that bounds the error against the f32 product by
//   |dy_o| <= |s| * sum_k ( |B_ok| * |du_k| + (bt_scale_k / 2) * |u_k| + |Bq_ko| * df ),
//   |du_k| <= sum_i ( (a_scale_k / 2) * |x_i| + |A_ki| * dx_i ),  Bq_ko = B_ok / bt_scale_k the stored integer
// (plus f32 rounding), which test/kernels/lora-kernel.test.ts checks for every variant (f32 and bf16: without the
// activation terms).
#pragma once

#include <array>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels.h"
#include "thread_pool.h"

namespace conduit {

// The projections an adapter may correct, in the order of src/model/lora.ts LORA_TARGETS.
enum LoraTarget { kLoraQ = 0, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown, kLoraTargetCount };

struct LoraMatrix {
  int64_t rank = 0, in = 0, out = 0;  // rank 0: the projection is not adapted
  std::vector<float> a;               // [rank x in] f32 as given; released once packed
  std::vector<float> b;               // [out x rank] f32 as given; released once packed
  // Made by LoraSet::set in the adapter's dtype, in its arena: A [rank x in] and B transposed [rank x out] (in
  // blocks of kLoraBtBlock columns: kernels.h lora_bt_index), elements of lora_dtype_bytes each (q8: offset by 128,
  // unsigned), and per row the q8 scale (1 for f32 and bf16).
  template <typename T>
  struct Span {
    T* p = nullptr;
    size_t n = 0;
    T* data() const { return p; }
    size_t size() const { return n; }
  };
  Span<uint8_t> a_packed, bt_packed;
  Span<float> a_scale, bt_scale;

  LoraMatrixView view(int dtype) const {
    return LoraMatrixView{dtype, rank, in, out, a_packed.data(), bt_packed.data(), a_scale.data(), bt_scale.data()};
  }
};

struct LoraAdapter {
  float scale = 1.0f;
  int dtype = kLoraF32;  // LoraDtype of the packed matrices
  std::vector<std::array<LoraMatrix, kLoraTargetCount>> layers;
  // One allocation for all the packed matrices, layer by layer in the order the forward pass reads them. From a
  // megabyte up it is whole 2 MiB pages advised huge (memory.h): a step that reads many adapters then walks a few
  // huge pages per adapter instead of hundreds of 4 KiB ones (the TLB misses cost as much as the bytes).
  std::unique_ptr<uint8_t, void (*)(void*)> arena{nullptr, std::free};
  size_t arena_bytes = 0;
};

// Bytes matrix m takes packed in `dtype`: A, Bt and their scales, each 64-byte aligned.
size_t lora_packed_bytes(const LoraMatrix& m, int dtype);
// Packs m's f32 A and B into `dtype` (A rows, B transposed) at `at` (lora_packed_bytes of zeroed memory) and
// releases the f32 copies.
void lora_pack(LoraMatrix& m, int dtype, uint8_t* at);

// The adapters a model holds, by slot.
class LoraSet {
 public:
  // Puts an adapter in a slot (growing the table), packing its matrices in its dtype, or empties it (nullptr).
  void set(int slot, std::unique_ptr<LoraAdapter> adapter);
  const LoraAdapter* get(int slot) const {
    return slot >= 0 && slot < static_cast<int>(slots_.size()) ? slots_[slot].get() : nullptr;
  }
  int size() const { return static_cast<int>(slots_.size()); }
  // Bytes the adapters in the slots hold: their packed matrices and scales (and any f32 copy not yet packed).
  size_t bytes() const;

 private:
  std::vector<std::unique_ptr<LoraAdapter>> slots_;
};

// One projection's input and output for the LoRA products.
struct LoraOutput {
  LoraTarget target;
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
};

// The LoRA products of one call, planned before it runs: the rows of each adapter (slot ascending, rows ascending
// within), one job per (output, adapter) that adapts the output's target in the layer, the jobs' down-projection
// items (up to 32 rows of one job each: a decode step's few rows per adapter stay one item) and u = A x of every
// job's rows. Every row is computed by itself in a fixed order, so its result does not depend on the rows beside it
// or on how the items are spread over threads (batch invariance). Run the down items first (any order, any
// threads), then the up-projections (any column ranges, each column of each output once).
//
// matmul (compute.h) takes a plan and runs its down items and each tile's up-projection (right after the tile) in
// the matmul's own jobs; lora_apply runs one in jobs of its own.
class LoraPlan {
 public:
  // Plans the products of `outputs` for rows [0, rows) with slots[r] (-1 or an empty slot: not adapted) in
  // `layer`. Returns false when there is nothing to do (the plan must not be run then). Reuses its buffers; the
  // previous plan is gone.
  bool plan(const LoraSet& set, const int32_t* slots, int64_t rows, int64_t layer, const LoraOutput* outputs,
            int count);

  int64_t down_items() const { return static_cast<int64_t>(downs_.size()); }
  // Asks for the bytes down item `item` reads (A and its scales) to be brought into cache (L2), ahead of the kernel:
  // a decode step's items are one row each, so their A comes from DRAM with nothing to hide the latency behind.
  void prefetch_down(int64_t item) const;
  // Multiply-adds of all down items (what decides whether the caller runs them alone).
  int64_t down_macs() const { return down_macs_; }
  void down(const KernelTable& kt, int64_t item) const;

  // Up-projections of output `output` (an index into the planned outputs), columns [o0, o1) (at most
  // kLoraUpChunk) for every adapted row; scratch: up_scratch_floats() floats.
  void up(const KernelTable& kt, int output, int64_t o0, int64_t o1, float* scratch) const;
  size_t up_scratch_floats() const { return up_scratch_floats_; }
  // The A matrices (and scales) the next planned call will read, for this plan's adapters: `targets` of `layer`
  // (the caller's forward pass knows which matmul comes next; any layer or target without data is skipped). Only a
  // hint for prefetch_next; set after plan(), which clears it.
  void set_next(int64_t layer, const LoraTarget* targets, int count);
  bool has_next() const { return !next_.empty(); }
  // Prefetches part `part` of `parts` of the next call's A bytes: matmul spreads them over its tiles, so the next
  // call's down-projections find them in cache (L2, or L3 once the base weights' stream has pushed them out).
  void prefetch_next(int64_t part, int64_t parts) const;
  // Asks for the Bt blocks (and scales) that up(output, o0, o1) reads to be brought into cache (L2): matmul issues it
  // before the tile whose columns they are, so the reads arrive while the tile runs.
  void prefetch_up(int output, int64_t o0, int64_t o1) const;
  // Bytes its buffers hold (u, the row order and the item lists).
  size_t allocated_bytes() const {
    return u_.capacity() * sizeof(float) + rows_by_slot_.capacity() * sizeof(int32_t) +
           slot_count_.capacity() * sizeof(int64_t) + groups_.capacity() * sizeof(Group) +
           outputs_.capacity() * sizeof(LoraOutput) + jobs_.capacity() * sizeof(Job) +
           job_start_.capacity() * sizeof(int64_t) + downs_.capacity() * sizeof(Down) +
           next_.capacity() * sizeof(Range) + next_end_.capacity() * sizeof(size_t);
  }
  // Whether any job adapts output `output`.
  bool adapts(int output) const { return job_start_[output + 1] > job_start_[output]; }

  // The same work one job (one adapter's matrix for one output) at a time: jobs() of them, job j's outputs
  // [0, up_job_columns(j)), up_job adding columns [o0, o1) (at most kLoraUpChunk) of its rows.
  int64_t jobs() const { return static_cast<int64_t>(jobs_.size()); }
  int64_t up_job_columns(int64_t job) const { return jobs_[job].m->out; }
  void up_job(const KernelTable& kt, int64_t job, int64_t o0, int64_t o1, float* scratch) const;

 private:
  struct Job {
    const LoraAdapter* adapter;
    const LoraMatrix* m;
    const LoraOutput* out;
    int64_t begin, end;  // into rows_by_slot_
    size_t u_offset;
  };
  struct Down {
    int64_t job;
    int64_t r0, r1;  // into rows_by_slot_
  };
  struct Group {
    const LoraAdapter* adapter;
    int64_t begin, end;
  };
  std::vector<int32_t> rows_by_slot_;
  std::vector<int64_t> slot_count_;
  std::vector<Group> groups_;
  std::vector<LoraOutput> outputs_;
  std::vector<Job> jobs_;
  std::vector<int64_t> job_start_;  // jobs of output c: [job_start_[c], job_start_[c + 1])
  std::vector<Down> downs_;
  struct Range {
    const uint8_t* p;
    size_t bytes;
  };
  std::vector<Range> next_;
  std::vector<size_t> next_end_;  // next_end_[i]: bytes of next_[0 .. i]
  mutable std::vector<float> u_;  // written by down(), each item its own rows' slice
  int64_t down_macs_ = 0;
  size_t up_scratch_floats_ = 0;
};

// Whether the LoRA products run inside the base matmuls' jobs (the default) or as lora_apply's jobs after them
// (CONDUIT_LORA_FUSE=0, the baseline the benchmark compares with; read when a model is made). Both give the same
// bits.
bool lora_fuse_enabled();

// A plan whose down items all together are at most this many multiply-adds (a decode step's are a few hundred
// thousand) gets no job of its own for them: lora_apply runs them on the calling thread, matmul ahead of the tiles
// in its tiles' job.
constexpr int64_t kLoraInlineDownMacs = int64_t{1} << 20;

// y[r * ldy + o] += scale * sum_k B[o][k] * (sum_i A[k][i] * x[r * ldx + i]) for each row r in [0, rows) whose slot
// (slots[r]) holds an adapter that adapts `target` in `layer`, in jobs of its own: the down-projections (on the
// calling thread when small), then one job for the up-projections. `plan` is the caller's, reused.
void lora_apply(const KernelTable& kt, ThreadPool& pool, LoraPlan& plan, const LoraSet& set, const int32_t* slots,
                int64_t rows, int64_t layer, LoraTarget target, const float* x, int64_t ldx, float* y, int64_t ldy);

// lora_apply for several projections of the same rows: Q, K and V, or gate and up, share the hand-overs to the
// thread pool.
void lora_apply_many(const KernelTable& kt, ThreadPool& pool, LoraPlan& plan, const LoraSet& set,
                     const int32_t* slots, int64_t rows, int64_t layer, const LoraOutput* outputs, int count);

}  // namespace conduit

// Drivers that split kernels over the thread pool: matmul (activation quantization + tiles), RoPE (cos/sin per
// token), KV store through the slot mapping, paged attention (units of sequence x rows x context chunk, all KV
// heads; sequence x KV head x rows for kernels without split-K). The forward
// pass and the per-kernel test entry points both go through these, so the tests exercise the real work split.
#pragma once

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "kernels.h"
#include "thread_pool.h"

namespace conduit {

// ---------------------------------------------------------------------------------------------------------------
// Scratch memory that grows to the largest request and is reused across steps (64-byte aligned).
class Scratch {
 public:
  // Throws std::bad_alloc when it cannot grow, keeping the buffer it had (a later smaller request still gets it).
  uint8_t* get(size_t bytes) {
    if (bytes > capacity_) {
      const size_t capacity = (bytes + 4095) & ~static_cast<size_t>(4095);
      uint8_t* grown = static_cast<uint8_t*>(std::aligned_alloc(64, capacity));
      if (!grown) throw std::bad_alloc();
      data_.reset(grown);
      capacity_ = capacity;
    }
    return data_.get();
  }
  // Bytes allocated now (the largest request so far, rounded up to 4 KiB).
  size_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  size_t capacity_ = 0;
};

// ---------------------------------------------------------------------------------------------------------------
// Wall time per named section of forward passes, for the kernel benchmark's profile (off unless enabled: a
// disabled scope costs one branch), and the CPU time the calling thread spent in it. With one thread the caller runs
// every kernel itself, so cpu_seconds is each section's own CPU cost, which time slices lost to other processes do
// not inflate (wall time does); with more threads it is the caller's share only.
struct Profile {
  struct Section {
    double seconds = 0;
    int64_t calls = 0;
    double cpu_seconds = 0;
  };
  bool enabled = false;
  std::map<std::string, Section> sections;
  void add(const char* name, double seconds, double cpu_seconds) {
    Section& s = sections[name];
    s.seconds += seconds;
    s.cpu_seconds += cpu_seconds;
    ++s.calls;
  }
};

// CPU time of the calling thread, in seconds.
inline double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

class ProfileScope {
 public:
  ProfileScope(Profile* p, const char* name) : profile_(p && p->enabled ? p : nullptr), name_(name) {
    if (profile_) {
      start_ = std::chrono::steady_clock::now();
      cpu_start_ = thread_cpu_seconds();
    }
  }
  ~ProfileScope() {
    if (profile_) {
      profile_->add(name_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(),
                    thread_cpu_seconds() - cpu_start_);
    }
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  Profile* profile_;
  const char* name_;
  std::chrono::steady_clock::time_point start_;
  double cpu_start_ = 0;
};

struct Workspace {
  Scratch activations;  // quantized activations of the current matmul input
  Scratch per_thread;   // tile / attention scratch, one slice per thread
  Profile* profile = nullptr;
};

// ---------------------------------------------------------------------------------------------------------------
// Matmul: every output reads the same input x [m x k]; outputs sharing an activation format share one
// quantization, and all their tiles go into one parallel job (so Q, K and V, or gate and up, cost one barrier).
struct MatmulOutput {
  const uint8_t* w;  // [n x k] in `type`
  int type;
  int64_t n;
  float* y;          // y[row * ldy + j]
  int64_t ldy;
  bool packed = false;  // w is the kernel's load-time packed layout (MatmulKernel::pack), not ggml rows
};

// With `lora` (planned for these rows and outputs, output c of the plan being outputs[c]), the LoRA products are
// added in the same jobs: the plan's down-projections as items of the activation quantization's job, or, when
// small (a decode step's), in the tiles' job, taken by every thread before its first tile; each tile's
// up-projection right after the tile, on the thread that wrote it. A row's result is bit for bit lora_apply's after a plain
// matmul.
class LoraPlan;
void matmul(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const float* x, int64_t m, int64_t k,
            const MatmulOutput* outputs, int count, const LoraPlan* lora = nullptr);

// The weights the pool's workers start on when matmul runs these outputs: the tiles past the calling thread's share
// of the tile list (ThreadPool::parallel_for_ranges), as far as they lie in the last output, one contiguous range.
// Empty ({nullptr, 0}) on a pool without workers.
struct WeightBytes {
  const uint8_t* begin = nullptr;
  size_t bytes = 0;
};
WeightBytes matmul_worker_weights(const KernelTable& kt, const ThreadPool& pool, int64_t k, const MatmulOutput* outputs,
                                  int count);

// ---------------------------------------------------------------------------------------------------------------
// RoPE
struct RopeConfig {
  double theta = 10000.0;
  int rope_dim = 0;
  bool neox = false;
  enum class Scaling { None, Linear, Llama3, LongRope } scaling = Scaling::None;
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_context = 8192.0;
  // LongRoPE (Phi-3): a divisor per frequency, and the scale of the rotated dimensions (cos and sin times it).
  std::vector<double> freq_factors;
  double mscale = 1.0;
};

// rope_dim/2 inverse frequencies with the scaling applied.
std::vector<double> rope_inverse_frequencies(const RopeConfig& c);

// cos and sin of each row's angles, [rows x rope_dim/2] each, computed once per step and shared by Q and K of
// every layer (the angles are in double from the exact position, then rounded: long contexts keep full f32
// accuracy).
struct RopeTable {
  std::vector<float> cos, sin;
  int half = 0;
  size_t allocated_bytes() const { return (cos.capacity() + sin.capacity()) * sizeof(float); }
  // mscale multiplies cos and sin (LongRoPE's attention factor; 1 otherwise).
  void compute(ThreadPool& pool, const std::vector<double>& inv_freq, const int32_t* positions, int64_t rows,
               double mscale = 1.0);
};

// Rotates x [rows x num_heads*head_dim] in place, row i with row first_row + i of the table.
void apply_rope(const KernelTable& kt, ThreadPool& pool, const RopeTable& table, const RopeParams& p, float* x,
                int64_t rows);

// ---------------------------------------------------------------------------------------------------------------
// KV store: row i of k and v (row_elems each) goes to pool slot slots[i] of this layer's K and V regions.
void kv_write(const KernelTable& kt, const float* k, const float* v, int64_t rows, int64_t row_elems,
              const int32_t* slots, uint8_t* k_region, uint8_t* v_region, bool f16);

// ---------------------------------------------------------------------------------------------------------------
// Paged attention for all sequences of a batch. With few rows (single-stream decode) each row's context chunks
// are spread over the threads and merged after; otherwise a unit takes all chunks of its rows. Either way a row
// gets the same bits.
void attention(const KernelTable& kt, ThreadPool& pool, Workspace& ws, const AttentionArgs& a, int num_seqs);

}  // namespace conduit

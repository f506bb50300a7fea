#include "thread_pool.h"

#include <immintrin.h>
#include <sched.h>

#include <chrono>

namespace conduit {

namespace {
// Spin iterations before a waiting thread sleeps (workers) or yields (the caller). A pause is ~40-140 cycles, so
// this is well under a millisecond: long enough to cover the gap between two loops of one forward pass, short
// enough not to burn a shared core.
constexpr int kSpinsBeforeSleep = 20000;

template <typename Done>
void spin_until(Done done) {
  for (int spins = 0; !done(); ++spins) {
    if (spins < kSpinsBeforeSleep) {
      _mm_pause();
    } else {
      sched_yield();  // the thread we wait for was descheduled: give the core back rather than spin against it
    }
  }
}
}  // namespace

int default_thread_count() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(num_threads < 1 ? 1 : num_threads), shares_(new Share[num_threads < 1 ? 1 : num_threads]) {
  workers_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

// ---------------------------------------------------------------------------------------------------------------
// Claims for parallel_for_ranges

int64_t ThreadPool::claim_front(int thread) {
  std::atomic<uint64_t>& bounds = shares_[thread].bounds;
  uint64_t cur = bounds.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t front = static_cast<uint32_t>(cur), back = static_cast<uint32_t>(cur >> 32);
    if (front >= back) return -1;
    if (bounds.compare_exchange_weak(cur, pack_bounds(front + 1, back), std::memory_order_relaxed)) return front;
  }
}

int64_t ThreadPool::claim_back(int thread) {
  std::atomic<uint64_t>& bounds = shares_[thread].bounds;
  uint64_t cur = bounds.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t front = static_cast<uint32_t>(cur), back = static_cast<uint32_t>(cur >> 32);
    if (front >= back) return -1;
    if (bounds.compare_exchange_weak(cur, pack_bounds(front, back - 1), std::memory_order_relaxed)) return back - 1;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Jobs

void ThreadPool::publish(Job job, void* ctx, bool all_threads) {
  job_ = job;
  ctx_ = ctx;
  all_threads_ = all_threads;
  {
    // Publishing under the mutex means a worker about to sleep either sees the new generation in its wait
    // predicate or is already waiting and gets the notification: no lost wake-up.
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1, std::memory_order_seq_cst);
  }
  wake_.notify_all();
}

void ThreadPool::run_on_all(Job job, void* ctx) {
  if (num_threads_ == 1) {
    job(ctx, 0);
    return;
  }
  pending_.store(num_threads_ - 1, std::memory_order_relaxed);
  publish(job, ctx, true);
  job(ctx, 0);
  spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
}

void ThreadPool::run_items(Job job, void* ctx, const std::atomic<int64_t>& done, int64_t count) {
  open_.store(true, std::memory_order_seq_cst);
  publish(job, ctx, false);
  job(ctx, 0);
  const bool timed = timing_.enabled;
  const auto waiting = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  // Every item has been claimed; wait for the ones other threads are still finishing.
  spin_until([&] { return done.load(std::memory_order_acquire) == count; });
  // Close the job, then wait for workers that joined it (they find nothing left to claim, or are finishing the
  // claiming loop) to leave before the caller's context goes out of scope.
  open_.store(false, std::memory_order_seq_cst);
  spin_until([&] { return inside_.load(std::memory_order_seq_cst) == 0; });
  if (timed) {
    ++timing_.jobs;
    timing_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting).count();
  }
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spins = 0; gen == seen && spins < kSpinsBeforeSleep; ++spins) {
      _mm_pause();
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      gen = generation_.load(std::memory_order_acquire);
    }
    if (stopping_.load(std::memory_order_acquire)) return;
    seen = gen;
    const bool all_threads = all_threads_;
    // A newer job may have been published since `gen` (only an items job can be superseded before every worker
    // ran it): then these fields belong to it, and the next iteration picks it up.
    if (generation_.load(std::memory_order_acquire) != gen) continue;
    if (all_threads) {
      job_(ctx_, index);
      pending_.fetch_sub(1, std::memory_order_release);
      continue;
    }
    // Join the items job only if it is still the one we woke for and still open; otherwise the caller may have
    // returned already and its context is gone.
    inside_.fetch_add(1, std::memory_order_seq_cst);
    if (open_.load(std::memory_order_seq_cst) && generation_.load(std::memory_order_seq_cst) == gen) {
      job_(ctx_, index);
    }
    inside_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace conduit

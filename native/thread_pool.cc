#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include "common.h"
#if CONDUIT_X86
#include <immintrin.h>
#endif

#include <chrono>
#include <string>

#include "crash_handler.h"

namespace conduit {

namespace {
// Spin iterations before a waiting thread sleeps (workers) or yields (the caller). A pause is ~40-140 cycles, so
// this is well under a millisecond: long enough to cover the gap between two loops of one forward pass, short
// enough not to burn a shared core.
constexpr int kSpinsBeforeSleep = 20000;

// The spin-wait hint: PAUSE on x86, YIELD on arm64, nothing elsewhere.
inline void cpu_relax() {
#if CONDUIT_X86
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

template <typename Done>
void spin_until(Done done) {
  for (int spins = 0; !done(); ++spins) {
    if (spins < kSpinsBeforeSleep) {
      cpu_relax();
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
    stopping_.store(true, std::memory_order_seq_cst);
    state_.store((generation_ + 1) << 1, std::memory_order_seq_cst);  // a new generation wakes every worker
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

void ThreadPool::open_job(Job job, void* ctx, bool all_threads) {
  // No worker is inside a job here (the previous one was closed and drained), so nobody reads these fields.
  job_ = job;
  ctx_ = ctx;
  all_threads_ = all_threads;
  ++generation_;
  state_.store((generation_ << 1) | 1, std::memory_order_seq_cst);
  // Most jobs find every worker spinning, and then the mutex and the notification are skipped (they cost about a
  // quarter of a microsecond a job, a few dozen jobs a decode step). A worker about to sleep announces itself in
  // sleepers_ before it checks the generation under the mutex; both sides store and then load, sequentially
  // consistent, so either it sees the new generation and stays awake, or it is counted here and woken. Taking the
  // mutex before notifying means a worker that was counted but has not reached its wait yet is past its check first.
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> lock(mutex_); }
    wake_.notify_all();
  }
}

void ThreadPool::close_job() {
  state_.store(generation_ << 1, std::memory_order_seq_cst);
  // Workers that entered finish (they find nothing left to claim, or are leaving the claiming loop); any later
  // one sees the job closed. Only then may the caller's context go out of scope or the fields be rewritten.
  spin_until([&] { return inside_.load(std::memory_order_seq_cst) == 0; });
}

void ThreadPool::run_on_all(Job job, void* ctx) {
  if (num_threads_ == 1) {
    job(ctx, 0);
    return;
  }
  pending_.store(num_threads_ - 1, std::memory_order_relaxed);
  open_job(job, ctx, true);
  job(ctx, 0);
  // The job stays open until every worker ran it, so none can miss it.
  spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
  close_job();
}

void ThreadPool::run_items(Job job, void* ctx, const std::atomic<int64_t>& done, int64_t count) {
  open_job(job, ctx, false);
  job(ctx, 0);
  const bool timed = timing_.enabled;
  const auto waiting = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  // Every item has been claimed; wait for the ones other threads are still finishing.
  spin_until([&] { return done.load(std::memory_order_acquire) == count; });
  close_job();
  if (timed) {
    ++timing_.jobs;
    timing_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting).count();
  }
}

void ThreadPool::prefetch_while_idle(const void* begin, size_t bytes) {
  // A worker taking a turn while these change may request lines of the old range or past it: prefetches do not
  // fault, so that costs at most a few wasted requests.
  const uintptr_t b = reinterpret_cast<uintptr_t>(begin);
  idle_prefetch_.end.store(0, std::memory_order_relaxed);
  idle_prefetch_.next.store(b, std::memory_order_relaxed);
  idle_prefetch_.end.store(bytes > 0 ? b + bytes : 0, std::memory_order_relaxed);
}

bool ThreadPool::idle_prefetch_step() {
#if CONDUIT_X86
  // Eight lines a turn: few enough that a job published meanwhile is seen within a fraction of a microsecond.
  constexpr uintptr_t kTurnBytes = 8 * 64;
  const uintptr_t end = idle_prefetch_.end.load(std::memory_order_relaxed);
  if (idle_prefetch_.next.load(std::memory_order_relaxed) >= end) return false;
  const uintptr_t p = idle_prefetch_.next.fetch_add(kTurnBytes, std::memory_order_relaxed);
  if (p >= end) return false;
  for (uintptr_t a = p; a < p + kTurnBytes && a < end; a += 64) _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T1);
  return true;
#else
  return false;
#endif
}

void ThreadPool::worker_loop(int index) {
  // Named for crash reports and debuggers; an alternate signal stack lets the crash handler report a stack overflow.
  pthread_setname_np(pthread_self(), ("conduit-pool-" + std::to_string(index)).substr(0, 15).c_str());
  SignalStackScope signal_stack;
  uint64_t seen = 0;  // the generation this worker last handled
  for (;;) {
    uint64_t state = state_.load(std::memory_order_acquire);
    for (int spins = 0; (state >> 1) == seen && spins < kSpinsBeforeSleep; ++spins) {
      if (!idle_prefetch_step()) cpu_relax();
      state = state_.load(std::memory_order_acquire);
    }
    if ((state >> 1) == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, [&] { return (state_.load(std::memory_order_seq_cst) >> 1) != seen; });
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      state = state_.load(std::memory_order_acquire);
    }
    if (stopping_.load(std::memory_order_acquire)) return;
    seen = state >> 1;
    const uint64_t open_state = (seen << 1) | 1;
    inside_.fetch_add(1, std::memory_order_seq_cst);
    // Enter only the job this worker woke for, and only while it is open: a run_on_all job is open until every
    // worker ran it, an items job may already be finished and closed (then the caller did the work).
    if (state_.load(std::memory_order_seq_cst) == open_state) {
      const bool all_threads = all_threads_;
      job_(ctx_, index);
      if (all_threads) pending_.fetch_sub(1, std::memory_order_release);
    }
    inside_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace conduit

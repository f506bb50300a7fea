// A fixed pool of worker threads. A forward pass runs a few dozen parallel loops back to back, so workers spin
// briefly between them (waking a sleeping thread costs tens of microseconds) and sleep on a condition variable
// once idle for longer, so an idle model costs no CPU.
//
// Parallel loops never wait for a worker that has not started: the caller works too, takes over items nobody has
// claimed, and returns as soon as every item is done. On a machine busy with other processes a descheduled worker
// then costs at most the item it holds, not a scheduler time slice per loop.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace conduit {

class ThreadPool {
 public:
  using Job = void (*)(void* ctx, int thread_index);

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }

  // Optional accounting for profiles: jobs handed to the workers, and the time the caller spent waiting for
  // them after finishing its own share (imbalance plus the hand-over itself). Loops of one item run inline and
  // are not counted.
  struct Timing {
    bool enabled = false;
    int64_t jobs = 0;
    double wait_seconds = 0;
  };
  Timing& timing() { return timing_; }

  // Calls job(ctx, i) once on each thread i = 0..size-1 (the caller is thread 0) and returns when all have
  // returned: for work that needs every thread (bandwidth and peak measurements).
  void run_on_all(Job job, void* ctx);

  // Bytes [begin, begin + bytes) the workers request into their caches while they wait between jobs, a few lines
  // per turn of their wait; a job arriving stops them within a turn. Replaces the range asked for before (bytes 0: none).
  // Only a hint: addresses that are stale by then are harmless to request.
  void prefetch_while_idle(const void* begin, size_t bytes);

  // Runs body(item, thread_index) for item in [0, count), items handed out one at a time in order.
  template <typename Body>
  void parallel_for(int64_t count, Body&& body);

  // Like parallel_for, but thread t starts on the t-th contiguous share of [0, count) and walks it in order, so
  // consecutive items of one thread are neighbours in memory (the hardware and software prefetchers can run
  // ahead across item boundaries). A thread that runs out steals items from the back of the others' shares.
  template <typename Body>
  void parallel_for_ranges(int64_t count, Body&& body);

 private:
  // One thread's remaining share [front, back), packed into one word so a claim is a single compare-exchange.
  struct alignas(64) Share {
    std::atomic<uint64_t> bounds{0};
  };
  static uint64_t pack_bounds(uint32_t front, uint32_t back) { return (static_cast<uint64_t>(back) << 32) | front; }
  int64_t claim_front(int thread);
  int64_t claim_back(int thread);
  // One turn of a waiting worker's prefetch_while_idle: false when nothing is left to request.
  bool idle_prefetch_step();

  // The job protocol. `state_` packs the job's generation with an open bit ((generation << 1) | open), so one
  // atomic load tells a worker both which job is published and whether it still takes workers:
  //   caller:  [no worker inside] write job_/ctx_/all_threads_ -> state_ = (g << 1) | 1 -> run its share ->
  //            wait for the job's items -> state_ = (g << 1) -> wait until inside_ == 0
  //   worker:  see generation g -> inside_ += 1 -> run the job only if state_ is still (g << 1) | 1 -> inside_ -= 1
  // A worker that saw an older generation, or arrives after the job closed, never reads job_/ctx_: they may
  // already describe the next job, or a context the caller has left. The close and the worker's entry are both
  // sequentially consistent (store then load on each side), so either the worker sees the job closed or the
  // caller sees it inside and waits for it.
  void run_items(Job job, void* ctx, const std::atomic<int64_t>& done, int64_t count);
  void open_job(Job job, void* ctx, bool all_threads);
  void close_job();
  void worker_loop(int index);

  int num_threads_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;              // the caller's count of published jobs (only the caller touches it)
  std::atomic<uint64_t> state_{0};       // (generation << 1) | open
  std::atomic<int> inside_{0};           // workers that entered (or are checking whether to enter) the job
  std::atomic<int> pending_{0};          // run_on_all: workers that have not finished
  std::atomic<bool> stopping_{false};
  // The published job: written by the caller only while no worker is inside, read by workers only inside.
  Job job_ = nullptr;
  void* ctx_ = nullptr;
  bool all_threads_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};         // workers asleep on wake_, or about to check whether to sleep
  std::unique_ptr<Share[]> shares_;
  // prefetch_while_idle's range: the next line to request and the end, on a line of their own (the waiting workers
  // advance `next`, the caller only sets them).
  struct alignas(64) IdlePrefetch {
    std::atomic<uintptr_t> next{0}, end{0};
  };
  IdlePrefetch idle_prefetch_;
  Timing timing_;
};

template <typename Body>
void ThreadPool::parallel_for(int64_t count, Body&& body) {
  if (count <= 0) return;
  if (num_threads_ == 1 || count == 1) {
    for (int64_t i = 0; i < count; ++i) body(i, 0);
    return;
  }
  struct Ctx {
    Body* body;
    int64_t count;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  } ctx{&body, count};
  run_items(
      [](void* p, int thread_index) {
        Ctx& c = *static_cast<Ctx*>(p);
        // Each thread reports its items once, when it can claim no more: one item at a time, every thread's
        // increment moved the counter's line between cores (and the caller spins on it), which perf put at 3% of a
        // two-thread decode step. The caller still waits only for items in progress: between a thread's last item
        // and its report there is only a failed claim.
        int64_t finished = 0;
        for (int64_t i = c.next.fetch_add(1, std::memory_order_relaxed); i < c.count;
             i = c.next.fetch_add(1, std::memory_order_relaxed)) {
          (*c.body)(i, thread_index);
          ++finished;
        }
        if (finished > 0) c.done.fetch_add(finished, std::memory_order_release);
      },
      &ctx, ctx.done, count);
}

template <typename Body>
void ThreadPool::parallel_for_ranges(int64_t count, Body&& body) {
  if (count <= 0) return;
  if (num_threads_ == 1 || count == 1) {
    for (int64_t i = 0; i < count; ++i) body(i, 0);
    return;
  }
  for (int t = 0; t < num_threads_; ++t) {
    shares_[t].bounds.store(pack_bounds(static_cast<uint32_t>(count * t / num_threads_),
                                        static_cast<uint32_t>(count * (t + 1) / num_threads_)),
                            std::memory_order_relaxed);
  }
  struct Ctx {
    ThreadPool* pool;
    Body* body;
    std::atomic<int64_t> done{0};
  } ctx{this, &body};
  run_items(
      [](void* p, int t) {
        Ctx& c = *static_cast<Ctx*>(p);
        // Reported once per thread, as in parallel_for.
        int64_t finished = 0;
        for (int64_t i = c.pool->claim_front(t); i >= 0; i = c.pool->claim_front(t)) {
          (*c.body)(i, t);
          ++finished;
        }
        for (int k = 1; k < c.pool->num_threads_; ++k) {
          const int victim = (t + k) % c.pool->num_threads_;
          for (int64_t i = c.pool->claim_back(victim); i >= 0; i = c.pool->claim_back(victim)) {
            (*c.body)(i, t);
            ++finished;
          }
        }
        if (finished > 0) c.done.fetch_add(finished, std::memory_order_release);
      },
      &ctx, ctx.done, count);
}

// CPUs this process may run on (its affinity mask; at least 1).
int default_thread_count();

}  // namespace conduit

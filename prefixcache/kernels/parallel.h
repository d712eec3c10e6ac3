// Work items handed out one at a time to the step's threads (dynamic scheduling), on a pool of
// our own whose join waits only for the threads that took part.
//
// Why dynamic items: at::parallel_for splits a range into one static share per thread, so a
// region lasts as long as its slowest thread. On a shared 2-core machine another process (a
// benchmark client, the server's own event loop) regularly takes one core for a few ms; the other
// thread then waits at the region's end with its share done. Here a thread that is running takes
// the next item, so the delayed one only holds up the item it is on.
//
// Why a pool of our own: an OpenMP region (what at::parallel_for is) still ends in a barrier that
// every thread of the team must reach, a thread that took no item included, so a helper that was
// descheduled before the region began holds the caller until the scheduler runs it again; and
// under OMP_WAIT_POLICY=PASSIVE (which benchmarks/servers.py gives every server) each of a prefill
// step's hundreds of regions wakes its helpers through the kernel. Here the caller starts on the
// items at once, a helper joins when it arrives, and the caller's join waits only for helpers that
// joined and are finishing an item: a late helper finds the job closed and does nothing. Helpers
// spin a short while for the next job (prefill steps run their regions microseconds apart), then
// sleep on a futex (no CPU between steps). Measured in docs/benchmarks-journal.md ("The softmax
// across queries, and a pool whose join waits only for its participants").
//
// The pool runs only while OpenMP's own threads sleep between regions (pool_enabled): spinning
// OpenMP threads, the runtime's default, took the helpers' cores after every torch op (Gemma 3's
// closed loop 13.4-14.3 s against 9.2-10.3 s with OpenMP alone). prefixcache makes them sleep
// when it is imported before torch (prefixcache/__init__.py); otherwise the items go to an
// OpenMP region, claimed one at a time as before.
//
// Which thread computes an item never changes its numbers (each output is computed whole by one
// item), so the bits do not depend on the schedule, the pool or the thread count.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

namespace prefixcache {

namespace pool_detail {

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Whether this thread is running a pool job's items (a nested call runs serially).
inline thread_local bool tl_in_job = false;

// One parallel call: call(fn, i) for every i in [0, n), items claimed through `next`.
struct Job {
  void (*call)(const void*, int64_t);
  const void* fn;
  int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first item's exception (written by the thread that set failed)

  void run_items() noexcept {
    tl_in_job = true;
    try {
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n; i = next.fetch_add(1, std::memory_order_relaxed)) {
        if (failed.load(std::memory_order_relaxed)) break;
        call(fn, i);
      }
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
      next.store(n, std::memory_order_relaxed);  // the others stop at their next claim
    }
    tl_in_job = false;
  }

  // After every thread's run_items returned: the first item's exception, if any, to the caller.
  void rethrow() const {
    if (failed.load(std::memory_order_acquire)) std::rethrow_exception(error);
  }
};

// The helpers' shared state. `state` packs the current job's admission: bits 0-15 the helpers
// inside it, bits 16-31 how many may join, bit 32 closed. A helper joins by raising the count
// while the job is open and not full; the caller closes it when its own claims run out and then
// waits for the count to fall to 0. So the caller never waits for a helper that did not join, and
// a helper that joined holds the job (on the caller's stack) alive until it leaves.
class Pool {
 public:
  static constexpr uint64_t kCount = 0xFFFF, kClosed = uint64_t{1} << 32;

  // Runs `job` on the caller and up to `helpers` pool threads; returns when every item is done.
  void run(Job& job, int helpers) {
    grow(helpers);
    job_.store(&job, std::memory_order_relaxed);
    state_.store(static_cast<uint64_t>(helpers) << 16, std::memory_order_release);  // open, empty
    seq_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&seq_);
    job.run_items();
    state_.fetch_or(kClosed, std::memory_order_acq_rel);
    int spins = 0;
    while ((state_.load(std::memory_order_acquire) & kCount) != 0) {
      _mm_pause();
      if (++spins > (1 << 14)) std::this_thread::yield(), spins = 0;  // a helper descheduled mid-item
    }
    job.rethrow();
  }

  std::mutex busy;  // one caller at a time (another caller runs its items alone)

  // How long a helper spins for the next job before sleeping: PREFIXCACHE_POOL_SPIN_US, default 100.
  static int64_t spin_ns() {
    static const int64_t ns = [] {
      const char* v = std::getenv("PREFIXCACHE_POOL_SPIN_US");
      return (v != nullptr && *v != '\0' ? std::max<int64_t>(0, std::atoll(v)) : 100) * 1000;
    }();
    return ns;
  }

 private:
  void grow(int helpers) {
    while (started_ < helpers) {
      ++started_;
      std::thread([this, seen = seq_.load(std::memory_order_acquire)] { helper(seen); }).detach();
    }
  }

  void helper(uint32_t seen) {
    pthread_setname_np(pthread_self(), "pc-kernel-pool");  // (at most 15 characters)
    for (;;) {
      // wait for a job newer than the last seen: spin, then sleep
      const auto t0 = std::chrono::steady_clock::now();
      while (seq_.load(std::memory_order_acquire) == seen) {
        for (int i = 0; i < 32; ++i) _mm_pause();
        if (std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count() >=
            spin_ns()) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          futex_wait(&seq_, seen);  // returns at once if a job came meanwhile
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          break;
        }
      }
      const uint32_t now = seq_.load(std::memory_order_acquire);
      if (now == seen) continue;  // a spurious wake
      seen = now;
      uint64_t s = state_.load(std::memory_order_acquire);
      bool joined = false;
      while (!(s & kClosed) && (s & kCount) < ((s >> 16) & kCount)) {
        if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
          joined = true;
          break;
        }
      }
      if (!joined) continue;  // closed or full: the caller is not waiting for us
      job_.load(std::memory_order_acquire)->run_items();
      state_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::atomic<uint64_t> state_{kClosed};
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint32_t> seq_{0};  // bumped per job: the helpers' futex word
  std::atomic<int> sleepers_{0};
  int started_ = 0;  // helper threads (grown under `busy`)
};

// The process's pool. A forked child has none of the parent's threads: it starts a new pool
// (the parent's object is left as it was, never touched again).
inline Pool*& pool_slot() {
  static Pool* p = [] {
    pthread_atfork(nullptr, nullptr, [] { pool_slot() = new Pool(); });
    return new Pool();
  }();
  return p;
}

// Whether the pool runs the items: only while OpenMP's threads sleep between regions
// (OMP_WAIT_POLICY=PASSIVE, which prefixcache sets when it is imported before torch). Spinning
// OpenMP threads (the runtime's default) would share the cores with the pool's helpers after
// every torch op, and the items go to an OpenMP region instead, as before the pool.
// PREFIXCACHE_POOL=0 or 1 overrides (for measuring).
inline bool pool_enabled() {
  static const bool on = [] {
    const char* force = std::getenv("PREFIXCACHE_POOL");
    if (force != nullptr && *force != '\0') return *force == '1';
    const char* v = std::getenv("OMP_WAIT_POLICY");
    if (v == nullptr) return false;
    std::string s(v);
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s == "passive";
  }();
  return on;
}

}  // namespace pool_detail

// fn(i) for every i in [0, n), each exactly once, on up to at::get_num_threads() threads: the
// caller and the pool's helpers (or an OpenMP team's threads: pool_enabled).
template <typename F>
void parallel_items(int64_t n, const F& fn) {
  if (n <= 0) return;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  const auto serial = [&] {
    for (int64_t i = 0; i < n; ++i) fn(i);
  };
  if (nt <= 1 || pool_detail::tl_in_job || at::in_parallel_region()) return serial();
  pool_detail::Job job;
  job.call = [](const void* f, int64_t i) { (*static_cast<const F*>(f))(i); };
  job.fn = &fn;
  job.n = n;
  if (!pool_detail::pool_enabled()) {  // an OpenMP region, the items still claimed one at a time
    at::parallel_for(0, nt, 1, [&](int64_t, int64_t) { job.run_items(); });
    return job.rethrow();
  }
  pool_detail::Pool* pool = pool_detail::pool_slot();
  std::unique_lock<std::mutex> lock(pool->busy, std::try_to_lock);
  if (!lock.owns_lock()) return serial();  // another thread's job holds the pool
  pool->run(job, static_cast<int>(std::min<int64_t>(nt - 1, pool_detail::Pool::kCount)));
}

// fn(begin, end) over [0, n) in chunks of `grain` rows (the last one shorter), as parallel_items.
template <typename F>
void parallel_chunks(int64_t n, int64_t grain, const F& fn) {
  const int64_t chunks = (n + grain - 1) / grain;
  parallel_items(chunks, [&](int64_t c) { fn(c * grain, std::min(n, (c + 1) * grain)); });
}

}  // namespace prefixcache

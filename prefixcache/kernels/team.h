// One thread team for a whole decode-only step (decode_forward.cpp, exact_decode.cpp): the
// step's phases alternate between splitting rows and handing out column runs or attention
// items, separated by spin barriers, in a single OpenMP region instead of one per operation.
//
// Why spin: the threads of a step are all busy on it, so a futex sleep per phase (tens of
// phases a layer) would cost more than it saves; a thread that spins long yields, in case its
// sibling was descheduled on a shared machine.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>

namespace prefixcache {

// Sense-reversing barrier that spins (with pause, yielding after a while).
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void wait() {
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    int spins = 0;
    while (gen_.load(std::memory_order_acquire) == gen) {
      _mm_pause();
      if (++spins > (1 << 14)) {
        std::this_thread::yield();  // a descheduled sibling: let it run
        spins = 0;
      }
    }
  }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int> gen_{0};
};

// [begin, end) of n items for thread t of nt, boundaries on multiples of `align`.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int nt, int64_t align = 1) {
  const int64_t units = (n + align - 1) / align;
  const int64_t b = units * t / nt * align, e = units * (t + 1) / nt * align;
  return {std::min(b, n), std::min(e, n)};
}

// fn(t, nt, barrier) on every thread t of one OpenMP team of up to `threads` (nt: the team's
// actual size, which the runtime may make smaller), all sharing one barrier of nt.
template <typename F>
void run_team(int threads, const F& fn) {
  int team = 1;
  SpinBarrier* barrier = nullptr;
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    {
      team = omp_get_num_threads();
      barrier = new SpinBarrier(team);
    }  // implicit barrier: every thread sees team and barrier
    fn(omp_get_thread_num(), team, barrier);
  }
  delete barrier;
}

}  // namespace prefixcache

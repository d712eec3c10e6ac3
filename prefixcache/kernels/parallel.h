// Work items handed out one at a time to the step's threads (dynamic scheduling).
//
// Why: at::parallel_for splits a range into one static share per thread, so a region lasts as
// long as its slowest thread. On a shared 2-core machine another process (a benchmark client,
// the server's own event loop) regularly takes one core for a few ms; the other thread then
// waits at the region's end with its share done. Here a thread that is running takes the next
// item, so the delayed one only holds up the item it is on. Which thread computes an item never
// changes its numbers (each output is computed whole by one item), so the bits do not depend on
// the schedule.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace prefixcache {

// fn(i) for every i in [0, n), each exactly once, on up to at::get_num_threads() threads.
template <typename F>
void parallel_items(int64_t n, const F& fn) {
  if (n <= 0) return;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  if (nt <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i);
  });
}

}  // namespace prefixcache

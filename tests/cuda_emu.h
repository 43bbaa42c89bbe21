// A CPU emulation of the CUDA subset that gnncompile/kernels/csrc/spmm.cu uses, for its tests.
//
// Force-included (g++ -include) before the kernel source: every CUDA thread of a block runs as an
// OS thread (blocks one after another), so warp shuffles are real exchanges between threads. A
// shuffle waits, with a timeout, for exactly the lanes its mask names: lanes that diverge from
// their group (a missing or extra shuffle) fail the launch instead of computing something. Atomic
// adds are std::atomic_ref adds. Loads, stores and __ldg are plain memory accesses.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
// A device load faults on an address not aligned to its type (float2: 8 bytes, float4: 16).
template <typename T>
inline T __ldg(const T* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % alignof(T)) throw std::runtime_error("emulated load: misaligned address");
  return *p;
}
inline float fmaf(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline float __int_as_float(int v) {
  float f;
  std::memcpy(&f, &v, sizeof f);
  return f;
}
inline float expf(float v) { return std::exp(v); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }

namespace emu {

// A reusable barrier for a fixed number of lanes, whose wait fails after a timeout.
struct Barrier {
  explicit Barrier(int n) : count(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    const long gen = generation;
    if (++arrived == count) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lock, std::chrono::seconds(10), [&] { return generation != gen; }))
      throw std::runtime_error("emulated shuffle: lanes of a group diverged (a barrier timed out)");
  }
  std::mutex m;
  std::condition_variable cv;
  int count, arrived = 0;
  long generation = 0;
};

struct Block {
  std::mutex m;
  std::map<std::pair<unsigned, unsigned>, std::unique_ptr<Barrier>> barriers;  // (warp, mask)
  std::vector<uint64_t> slots;  // one per thread
  Barrier& barrier(unsigned warp, unsigned mask) {
    std::lock_guard<std::mutex> lock(m);
    auto& b = barriers[{warp, mask}];
    if (!b) b = std::make_unique<Barrier>(__builtin_popcount(mask));
    return *b;
  }
};

inline thread_local Block* block = nullptr;
inline thread_local unsigned linear = 0;

template <typename T>
T exchange(unsigned mask, T v, unsigned src) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffled values are at most 8 bytes");
  const unsigned lane = linear & 31u, warp = linear >> 5;
  if (!(mask >> lane & 1u)) throw std::runtime_error("emulated shuffle: calling lane not in the mask");
  if (!(mask >> src & 1u)) throw std::runtime_error("emulated shuffle: source lane not in the mask");
  Barrier& bar = block->barrier(warp, mask);
  uint64_t word = 0;
  std::memcpy(&word, &v, sizeof(T));
  block->slots[linear] = word;
  bar.wait();
  T out;
  std::memcpy(&out, &block->slots[(warp << 5) | src], sizeof(T));
  bar.wait();
  return out;
}

}  // namespace emu

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const unsigned lane = emu::linear & 31u;
  return emu::exchange(mask, v, (lane & ~(unsigned)(width - 1)) + ((unsigned)src & (unsigned)(width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const unsigned lane = emu::linear & 31u;
  const unsigned src = lane ^ (unsigned)lane_mask;
  // outside the caller's width-section the lane reads its own value (CUDA's rule)
  const bool same = (src & ~(unsigned)(width - 1)) == (lane & ~(unsigned)(width - 1));
  return emu::exchange(mask, v, same ? src : lane);
}

namespace emu {

using Thunk = std::function<void(void**)>;

template <typename... A, std::size_t... K>
void call(void (*k)(A...), void** p, std::index_sequence<K...>) {
  k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[K])...);
}

template <typename... A>
Thunk thunk(void (*k)(A...)) {
  return [k](void** p) { call(k, p, std::index_sequence_for<A...>{}); };
}

inline std::map<std::string, Thunk>& registry() {
  static std::map<std::string, Thunk> r;
  return r;
}

struct Register {
  Register(const char* name, Thunk t) { registry()[name] = std::move(t); }
};

}  // namespace emu

#define EMU_CAT2(a, b) a##b
#define EMU_CAT(a, b) EMU_CAT2(a, b)
// Registers a kernel instance under its name expression, e.g. EMU_REGISTER("f<int, 4>", f<int, 4>).
#define EMU_REGISTER(name, ...) \
  static emu::Register EMU_CAT(emu_reg_, __COUNTER__)(name, emu::thunk(&__VA_ARGS__));

namespace emu {

// The block's threads, kept between blocks and launches: a launch hands each block to all of
// them and waits until every one has run it.
struct Pool {
  std::mutex m;
  std::condition_variable start, done;
  std::vector<std::thread> threads;
  std::function<void(unsigned)> work;
  long round = 0;
  unsigned running = 0;

  void run(unsigned n, std::function<void(unsigned)> fn) {
    std::unique_lock<std::mutex> lock(m);
    while (threads.size() < n) {
      const unsigned t = threads.size();
      threads.emplace_back([this, t] { loop(t); });
      threads.back().detach();
    }
    work = std::move(fn);
    running = threads.size();
    ++round;
    start.notify_all();
    done.wait(lock, [&] { return running == 0; });
  }

  void loop(unsigned t) {
    long seen = 0;
    std::unique_lock<std::mutex> lock(m);
    for (;;) {
      start.wait(lock, [&] { return round != seen; });
      seen = round;
      auto fn = work;
      lock.unlock();
      fn(t);
      lock.lock();
      if (--running == 0) done.notify_all();
    }
  }
};

inline Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: its detached threads outlive static destruction
  return *p;
}

}  // namespace emu

// Runs kernel `name` on a grid of blocks with `args` as cuLaunchKernel's kernelParams. Returns 0,
// or 1 (unknown kernel) or 2 (a thread failed) with the message in `error`.
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, void** args, char* error, int error_size) {
  auto it = emu::registry().find(name);
  if (it == emu::registry().end()) {
    std::snprintf(error, error_size, "no emulated kernel %s", name);
    return 1;
  }
  gridDim = {gx, gy, gz};
  blockDim = {bx, by, bz};
  const unsigned threads = bx * by * bz;
  std::string failure;
  std::mutex failure_m;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        emu::Block blk;
        blk.slots.assign(threads, 0);
        emu::pool().run(threads, [&](unsigned t) {
          if (t >= threads) return;
          emu::block = &blk;
          emu::linear = t;
          threadIdx = {t % bx, t / bx % by, t / (bx * by)};
          blockIdx = {x, y, z};
          try {
            it->second(args);
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lock(failure_m);
            if (failure.empty()) failure = e.what();
          }
        });
        if (!failure.empty()) {
          std::snprintf(error, error_size, "%s", failure.c_str());
          return 2;
        }
      }
  return 0;
}

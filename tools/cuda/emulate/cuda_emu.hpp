// A CPU emulation of the CUDA features rltune's kernels use, to run them where there is no GPU
// (CI): a launch runs the grid's blocks one after another, each block's threads as real threads
// meeting at real barriers (__syncthreads, and a warp's barrier for its shuffles), so the
// kernels' indexing, tiling and synchronization are exercised as written. Not emulated: timing,
// memory coalescing, bank conflicts, fast-math differences. Include it before the .cu file.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
// Blocks run one at a time, so a function's static array is its block's shared array.
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace emu {
inline thread_local dim3 thread_idx, block_idx;
inline dim3 block_dim, grid_dim;
inline std::vector<float> dynamic_shared;
inline std::unique_ptr<std::barrier<>> block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<float> exchange;

// Runs kernel() for every thread of a grid of `grid` blocks of `block` threads (x only), with
// `shared_bytes` of dynamic shared memory, poisoned with NaN before each block. One set of
// threads runs the blocks in turn, meeting at a barrier between two blocks.
template <class F> void launch(unsigned grid, unsigned block, size_t shared_bytes, F kernel) {
  if (block % 32 != 0) throw "emu::launch: the block must be whole warps";
  block_dim = {block, 1, 1};
  grid_dim = {grid, 1, 1};
  exchange.assign(block, 0.0f);
  dynamic_shared.assign(shared_bytes / sizeof(float) + 1, NAN);
  block_barrier = std::make_unique<std::barrier<>>(block);
  warp_barriers.clear();
  for (unsigned w = 0; w < block / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
  std::barrier<> between(block);
  std::vector<std::thread> threads;
  threads.reserve(block);
  for (unsigned tx = 0; tx < block; ++tx) {
    threads.emplace_back([&, tx] {
      thread_idx = {tx, 0, 0};
      for (unsigned bx = 0; bx < grid; ++bx) {
        block_idx = {bx, 0, 0};
        kernel();
        between.arrive_and_wait(); // the block is done
        if (tx == 0) std::fill(dynamic_shared.begin(), dynamic_shared.end(), NAN);
        between.arrive_and_wait();
      }
    });
  }
  for (auto &t : threads) t.join();
}
} // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim
#define RLTUNE_DYNAMIC_SHARED(type, name) type *name = reinterpret_cast<type *>(emu::dynamic_shared.data())

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

// Every lane of the warp must call it (the kernels' full-mask shuffles).
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const unsigned t = threadIdx.x, base = t & ~31u;
  auto &bar = *emu::warp_barriers[t / 32];
  emu::exchange[t] = v;
  bar.arrive_and_wait();
  const float r = emu::exchange[base | ((t & 31u) ^ static_cast<unsigned>(lane_mask))];
  bar.arrive_and_wait();
  return r;
}

// CPU emulation of the CUDA execution model, enough to run kvgate's kernels unchanged in CI
// (no GPU): the same .cu source is compiled by g++ -std=c++20 with KVGATE_CUDA_EMU defined.
//
// A launch starts one OS thread per CUDA thread of a block; the threads run the grid's blocks
// one after another (a barrier between blocks), so `static` storage serves as __shared__.
// __syncthreads is a std::barrier over the block; warp shuffles go through a per-warp slot
// array between two 32-lane barriers (write, wait, read, wait), so every lane of a warp must
// reach every shuffle, as the kernels guarantee. Launches are serialised by a mutex: shared
// memory and the launch geometry are process-wide.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

#define KERNEL extern "C"
#define DEVICE static inline
#define __global__
#define __shared__ static
#define __launch_bounds__(...)
#define DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(emu::dynamic_shared())

using std::max;
using std::min;

namespace emu {

struct Warp {
    std::barrier<> bar{32};
    uint64_t slot[32];
};

struct State {
    std::mutex launch;
    std::unique_ptr<std::barrier<>> block_barrier;
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<uint64_t> smem;  // 8-byte aligned dynamic shared memory
};

inline State& state() {
    static State s;
    return s;
}

inline void* dynamic_shared() { return state().smem.data(); }

inline unsigned linear_thread() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

template <class T>
T shfl_xor(T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    const unsigned t = linear_thread();
    Warp& w = *state().warps[t / 32];
    const unsigned lane = t % 32;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slot[lane] = bits;
    w.bar.arrive_and_wait();
    const uint64_t theirs = w.slot[lane ^ (unsigned)lane_mask];
    w.bar.arrive_and_wait();
    T out;
    std::memcpy(&out, &theirs, sizeof(T));
    return out;
}

// Geometry as the host passes it (C ABI, shared with the Rust tests).
struct Launch {
    uint32_t grid[3];
    uint32_t block[3];
    uint64_t shared_bytes;
};

template <class Body>
void launch(const Launch& l, Body body) {
    State& s = state();
    std::lock_guard<std::mutex> guard(s.launch);
    blockDim = dim3{l.block[0], l.block[1], l.block[2]};
    gridDim = dim3{l.grid[0], l.grid[1], l.grid[2]};
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    if (n == 0 || n % 32 != 0 || n > 1024) {
        std::fprintf(stderr, "emu: block of %u threads (must be a multiple of 32, <= 1024)\n", n);
        std::abort();
    }
    s.block_barrier = std::make_unique<std::barrier<>>(n);
    s.warps.clear();
    for (unsigned i = 0; i < n / 32; ++i) s.warps.push_back(std::make_unique<Warp>());
    // Poisoned (NaN bytes) so a kernel reading shared memory it never wrote shows up in results.
    s.smem.assign((l.shared_bytes + 7) / 8, 0x7fc07fc07fc07fc0ull);
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned t = 0; t < n; ++t) {
        threads.emplace_back([t, &body, &s] {
            threadIdx = dim3{t % blockDim.x, (t / blockDim.x) % blockDim.y,
                             t / (blockDim.x * blockDim.y)};
            for (unsigned z = 0; z < gridDim.z; ++z)
                for (unsigned y = 0; y < gridDim.y; ++y)
                    for (unsigned x = 0; x < gridDim.x; ++x) {
                        blockIdx = dim3{x, y, z};
                        body();
                        // Every thread leaves the block before the next one reuses shared memory.
                        s.block_barrier->arrive_and_wait();
                    }
        });
    }
    for (auto& th : threads) th.join();
}

}  // namespace emu

#define __syncthreads() emu::state().block_barrier->arrive_and_wait()
#define SHFL_XOR(v, lane_mask) emu::shfl_xor((v), (lane_mask))

DEVICE float f16_to_f32(uint16_t bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return (float)h;
}

DEVICE uint16_t f32_to_f16(float f) {
    const _Float16 h = (_Float16)f;  // round to nearest even, as cvt.rn.f16.f32
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}

DEVICE int dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) {
        c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    }
    return c;
}

// Exposes kernel NAME to the Rust tests as `emu_NAME(const emu::Launch*, params...)`.
#define EMU_STRIP(...) __VA_ARGS__
#define EMU_LAUNCHER(name, params, args)                                  \
    extern "C" void emu_##name(const emu::Launch* l, EMU_STRIP params) { \
        emu::launch(*l, [&] { name args; });                             \
    }

// CPU emulation of the CUDA execution model, enough to run kvgate's kernels unchanged in CI
// (no GPU): the same .cu source is compiled by g++ -std=c++20 with KVGATE_CUDA_EMU defined.
//
// Each CUDA thread of a block is a fiber: its own stack, switched cooperatively on the
// launching OS thread. The fibers run round robin; one that reaches __syncthreads or a warp
// shuffle waits there (handing over to the next) until every thread the barrier counts has
// arrived; a thread that returned counts as arrived, as on the hardware. Blocks run one after
// another, so `static` storage serves as __shared__. Warp shuffles go through a per-warp slot
// array between two 32-lane barriers (write, wait, read, wait), so every lane of a warp must
// reach every shuffle, as the kernels guarantee; a barrier that can never complete (threads
// waiting at different ones, a shuffle in divergent code) aborts the launch with a message
// instead of hanging. Launches are serialised by a mutex:
// shared memory and the launch geometry are process-wide.
//
// Fibers, not one OS thread per CUDA thread (as before): every barrier then put up to 1024
// threads to sleep and woke them again, and on a 2-core CI machine that context switching,
// not the kernels' arithmetic, was most of the emulated tests' time.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

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

#if defined(__x86_64__)
// The context switch: saves the callee-saved registers, MXCSR and the x87 control word on
// the current stack, stores the stack pointer in *save, loads `load` and restores the same
// from it. A new fiber's stack is prepared (emu::Context::init) so that the restore
// "returns" into kvgate_emu_start, which calls kvgate_emu_fiber_main.
extern "C" void kvgate_emu_switch(void** save, void* load);
extern "C" void kvgate_emu_start();
asm(R"(
    .text
    .p2align 4
    .globl kvgate_emu_switch
    .hidden kvgate_emu_switch
    .type kvgate_emu_switch, @function
kvgate_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvgate_emu_switch, .-kvgate_emu_switch

    .p2align 4
    .globl kvgate_emu_start
    .hidden kvgate_emu_start
    .type kvgate_emu_start, @function
kvgate_emu_start:
    call kvgate_emu_fiber_main
    ud2
    .size kvgate_emu_start, .-kvgate_emu_start
)");
#endif

extern "C" __attribute__((visibility("hidden"), used, noreturn)) void kvgate_emu_fiber_main();

namespace emu {

// Where a fiber (or the launching thread) continues when switched to.
struct Context {
#if defined(__x86_64__)
    void* sp = nullptr;

    // A fresh fiber on the stack [lo, lo + size): the first switch to it enters
    // kvgate_emu_fiber_main with the ABI's alignment.
    void init(char* lo, size_t size) {
        char* top = lo + size;  // 16-byte aligned (page-aligned stacks)
        // Popped by the switch: 16 bytes of MXCSR / x87 control word, six registers, and the
        // return address; kvgate_emu_start then runs with a 16-byte aligned stack pointer.
        uint64_t* frame = reinterpret_cast<uint64_t*>(top - 72);
        std::memset(frame, 0, 72);
        const uint32_t mxcsr = 0x1f80;   // the ABI's default: round to nearest, no FTZ/DAZ
        const uint16_t x87_cw = 0x037f;  // the ABI's default
        std::memcpy(frame, &mxcsr, 4);
        std::memcpy(reinterpret_cast<char*>(frame) + 4, &x87_cw, 2);
        frame[8] = reinterpret_cast<uint64_t>(&kvgate_emu_start);
        sp = frame;
    }
    static void swap(Context& from, Context& to) { kvgate_emu_switch(&from.sp, to.sp); }
#else
    ucontext_t uc;

    void init(char* lo, size_t size) {
        getcontext(&uc);
        uc.uc_stack.ss_sp = lo;
        uc.uc_stack.ss_size = size;
        uc.uc_link = nullptr;
        makecontext(&uc, kvgate_emu_fiber_main, 0);
    }
    static void swap(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif
};

struct Barrier {
    unsigned expected = 0;
    unsigned arrived = 0;
    uint64_t generation = 0;
};

struct Warp {
    Barrier bar;
    uint64_t slot[32];
};

struct Fiber {
    Context context;
    dim3 idx;
    bool done = false;
};

// Bytes of stack per fiber, and the guard page below each one (an overflow faults at once).
inline constexpr size_t STACK_BYTES = 256 * 1024;

struct State {
    std::mutex launch;
    Barrier block_barrier;
    std::vector<Warp> warps;
    std::vector<uint64_t> smem;  // 8-byte aligned dynamic shared memory
    std::vector<Fiber> fibers;
    Context launcher;
    unsigned current = 0;
    unsigned live = 0;
    // Barrier arrivals and finished fibers so far: a waiting fiber that finds it unchanged
    // after every other fiber has had its turn is waiting for something that cannot happen.
    uint64_t progress = 0;
    void (*entry)(void*) = nullptr;
    void* entry_arg = nullptr;
    char* stacks = nullptr;
    size_t stack_slots = 0;

    size_t slot_bytes() const { return STACK_BYTES + (size_t)sysconf(_SC_PAGESIZE); }

    // Stacks for n fibers, kept across launches (pages are touched only when used).
    void reserve_stacks(unsigned n) {
        if (n <= stack_slots) return;
        if (stacks != nullptr) munmap(stacks, stack_slots * slot_bytes());
        const size_t bytes = n * slot_bytes();
        void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (mem == MAP_FAILED) {
            std::fprintf(stderr, "emu: cannot map %zu bytes of fiber stacks\n", bytes);
            std::abort();
        }
        stacks = static_cast<char*>(mem);
        stack_slots = n;
        for (unsigned i = 0; i < n; ++i) {
            mprotect(stacks + i * slot_bytes(), slot_bytes() - STACK_BYTES, PROT_NONE);
        }
    }

    char* stack_of(unsigned i) const { return stacks + i * slot_bytes() + (slot_bytes() - STACK_BYTES); }

    // The next unfinished fiber after the current one, round robin (the current one itself
    // when it is the only one left).
    unsigned next_live() const {
        const unsigned n = (unsigned)fibers.size();
        for (unsigned step = 1; step <= n; ++step) {
            const unsigned i = (current + step) % n;
            if (!fibers[i].done) return i;
        }
        return current;
    }

    // Hands the OS thread from the current fiber to fiber `to`.
    void switch_to(unsigned to) {
        const unsigned from = current;
        if (to == from) return;
        current = to;
        threadIdx = fibers[to].idx;
        Context::swap(fibers[from].context, fibers[to].context);
    }
};

inline State& state() {
    static State s;
    return s;
}

inline void* dynamic_shared() { return state().smem.data(); }

inline unsigned linear_thread() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

// Waits until every thread `b` counts has arrived, letting the other fibers run meanwhile.
inline void wait(Barrier& b, const char* what) {
    State& s = state();
    const uint64_t generation = b.generation;
    ++s.progress;
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        ++b.generation;
        return;
    }
    uint64_t seen = s.progress;
    while (b.generation == generation) {
        s.switch_to(s.next_live());
        if (b.generation == generation && s.progress == seen) {
            std::fprintf(stderr,
                         "emu: %s can never complete: %u of %u threads arrived and every other "
                         "thread of block (%u,%u,%u) waits elsewhere or has returned\n",
                         what, b.arrived, b.expected, blockIdx.x, blockIdx.y, blockIdx.z);
            std::abort();
        }
        seen = s.progress;
    }
}

inline void sync_threads() { wait(state().block_barrier, "__syncthreads"); }

template <class T>
T shfl_xor(T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    const unsigned t = linear_thread();
    Warp& w = state().warps[t / 32];
    const unsigned lane = t % 32;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slot[lane] = bits;
    wait(w.bar, "a warp shuffle");
    const uint64_t theirs = w.slot[lane ^ (unsigned)lane_mask];
    wait(w.bar, "a warp shuffle");
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

// A thread that returned no longer takes part in barriers, as on the hardware: it counts as
// arrived at every later one (so a warp that returns early does not hold up the block's
// __syncthreads).
inline void retire(Barrier& b) {
    --b.expected;
    if (b.expected > 0 && b.arrived == b.expected) {
        b.arrived = 0;
        ++b.generation;
    }
}

// Runs the current block's fibers until every one has returned.
inline void run_block(State& s, unsigned n) {
    s.block_barrier = Barrier{n, 0, 0};
    s.warps.assign(n / 32, Warp{});
    for (Warp& w : s.warps) w.bar.expected = 32;
    s.fibers.resize(n);
    for (unsigned t = 0; t < n; ++t) {
        Fiber& f = s.fibers[t];
        f.idx = dim3{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
        f.done = false;
        f.context.init(s.stack_of(t), STACK_BYTES);
    }
    s.live = n;
    s.current = 0;
    threadIdx = s.fibers[0].idx;
    Context::swap(s.launcher, s.fibers[0].context);
}

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
    // Poisoned (NaN bytes) so a kernel reading shared memory it never wrote shows up in results.
    s.smem.assign((l.shared_bytes + 7) / 8, 0x7fc07fc07fc07fc0ull);
    s.reserve_stacks(n);
    s.entry = [](void* b) { (*static_cast<Body*>(b))(); };
    s.entry_arg = &body;
    for (unsigned z = 0; z < gridDim.z; ++z)
        for (unsigned y = 0; y < gridDim.y; ++y)
            for (unsigned x = 0; x < gridDim.x; ++x) {
                blockIdx = dim3{x, y, z};
                run_block(s, n);
            }
}

}  // namespace emu

// A fiber's whole life: the kernel body for its thread of the current block, then the next
// unfinished fiber, or the launching thread when it was the last one.
extern "C" void kvgate_emu_fiber_main() {
    emu::State& s = emu::state();
    s.entry(s.entry_arg);
    emu::Fiber& self = s.fibers[s.current];
    self.done = true;
    ++s.progress;
    emu::retire(s.block_barrier);
    emu::retire(s.warps[s.current / 32].bar);
    if (--s.live == 0) {
        emu::Context::swap(self.context, s.launcher);
    } else {
        s.switch_to(s.next_live());
    }
    std::fprintf(stderr, "emu: a finished fiber was resumed\n");
    std::abort();
}

#define __syncthreads() emu::sync_threads()
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

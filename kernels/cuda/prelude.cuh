// Prepended to every kernel source (kvgate_kernels::cuda::program_source). Two targets:
//  * NVRTC: no CUDA headers are needed (the host may have only libnvrtc and a driver), so the
//    fixed-width integer types are defined here and f16 conversions, dp4a and 16-byte loads go
//    through inline PTX;
//  * the CPU emulator (KVGATE_CUDA_EMU, emu/emu.h): the same source compiled by g++ with a
//    fiber per CUDA thread, so CI runs every kernel without a GPU.
// Kernels keep to what both targets support: every lane of a warp reaches each shuffle and every
// thread of a block each __syncthreads (early returns are warp- or block-uniform), dynamic shared
// memory through DYN_SMEM, f16 data as uint16_t bits.
#ifdef KVGATE_CUDA_EMU
#include "emu/emu.h"
#else
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

#define KERNEL extern "C" __global__
#define DEVICE __device__ __forceinline__
#define DYN_SMEM(T, name) extern __shared__ T name[]

DEVICE float f16_to_f32(uint16_t bits) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
}

DEVICE uint16_t f32_to_f16(float f) {
    uint16_t bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f));
    return bits;
}

// Signed 8-bit dot product of four lanes, accumulated into c (sm_61+).
DEVICE int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

#define SHFL_XOR(v, lane_mask) __shfl_xor_sync(0xffffffffu, (v), (lane_mask))
#endif

struct alignas(16) u32x4 {
    uint32_t x, y, z, w;
};

#define WARP 32
#define NEG_INF (-(1.0f / 0.0f))

// Rounds to f16 and back: the CPU path stores q, probabilities and the KV cache as f16.
DEVICE float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

// Sum over the 32 lanes of a warp (float, double or int); every lane gets the total.
template <class T>
DEVICE T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += SHFL_XOR(v, o);
    return v;
}

DEVICE float warp_max_f(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, SHFL_XOR(v, o));
    return v;
}

// GGML type ids of the weight formats the kernels read.
#define GGML_F32 0
#define GGML_F16 1
#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q5_0 6
#define GGML_Q5_1 7
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14

// Bytes of one 32-element block (Q8_1 activations: d, s = d*sum(q) as f16, 32 x int8).
#define Q4_0_BYTES 18
#define Q4_1_BYTES 20
#define Q5_0_BYTES 22
#define Q5_1_BYTES 24
#define Q8_0_BYTES 34
#define Q8_1_BYTES 36
// Bytes of one 256-element K-quant super-block (layouts: kernels/src/quant/kquants.rs).
#define QK_K 256
#define Q4_K_BYTES 144
#define Q5_K_BYTES 176
#define Q6_K_BYTES 210

DEVICE uint16_t load_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }

// Four bytes at a 2-byte aligned address (Q4_0 and Q8_0 blocks are 18 and 34 bytes long).
DEVICE int load_i32_a2(const uint8_t* p) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return (int)((uint32_t)h[0] | ((uint32_t)h[1] << 16));
}

DEVICE int load_i32_a4(const uint8_t* p) { return *reinterpret_cast<const int*>(p); }

// One Q8_1 activation block (f16 scale, f16 sum, 32 int8): its 32 values as eight packed words
// for dp4a, and its scale.
DEVICE float load_q8_1_values(const uint8_t* x, int xq[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) xq[i] = load_i32_a4(x + 4 + 4 * i);
    return f16_to_f32(load_u16(x));
}

// The four low bits of `bits` moved to bit 4 of bytes 0..3: the fifth bits of four 5-bit
// values (Q5_0/Q5_1's qh), ready to OR onto their nibbles.
DEVICE int spread_bit4(uint32_t bits) {
    return (int)(((bits & 1u) << 4) | ((bits & 2u) << 11) | ((bits & 4u) << 18) |
                 ((bits & 8u) << 25));
}

// Q4_K/Q5_K sub-block j's 6-bit scale and minimum from the 12 packed bytes (ggml's
// get_scale_min_k4; kernels/src/quant/kquants.rs scale_min_k4).
DEVICE void scale_min_k4(const uint8_t* q, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

//! CPU kernels for kvgate's runtime: GGML-compatible quantized blocks, quantized matrix products,
//! normalisation / RoPE / activation ops, and paged attention over f16 KV blocks.
//!
//! Numerics deliberately follow ggml's CPU backend as compiled for x86 with AVX2 (activations
//! quantized to 8-bit blocks for quantized dot products, 8-lane f32 accumulators reduced in ggml's
//! order, f16 KV cache) so that greedy output matches llama.cpp on the same GGUF — with one
//! deliberate exception: Q4_1 products sum each block in integers before one FMA (see
//! `dot::dot_q4_1_q8_1`), which rounds differently but makes batched decode much faster. SIMD
//! paths are chosen at run time (`is_x86_feature_detected!`); the scalar reference
//! implementations compute bit-identical results and are the oracle the tests compare against.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod cuda;
pub mod dot;
pub mod matmul;
mod matrix;
pub mod mmap;
pub mod ops;
pub mod quant;
mod simd;

pub use attention::{
    AttentionRow, AttentionScratch, KvLayout, ReductionOrder, paged_attention,
    paged_attention_batch, write_kv,
};
pub use dot::KQuantOrder;
pub use matmul::{
    MatmulScratch, QMatrix, matmul, matmul_fused, matmul_fused_ordered, matmul_ordered,
};
pub use ops::{RopeMode, rms_norm, rope, rope_with_freq_factors, swiglu};
pub use quant::{QK, WeightType};

/// Errors for inputs that come from outside the crate (e.g. tensor shapes read from a GGUF file).
/// Shape mismatches between buffers that the caller sized itself are programming errors and
/// panic with a message instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error("{ty:?} rows need a multiple of {block} columns, got {cols}")]
    ColsNotBlockMultiple {
        ty: WeightType,
        cols: usize,
        block: usize,
    },
    #[error("{ty:?} matrix of {rows}x{cols} needs {expected} bytes, got {actual}")]
    DataSize {
        ty: WeightType,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    #[error("matrix dimensions {rows}x{cols} overflow")]
    Overflow { rows: usize, cols: usize },
}

/// Which SIMD implementation the dispatching entry points use on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    /// Portable Rust; also the test oracle.
    Scalar,
    /// AVX2 + FMA + F16C (Haswell and later, Zen and later).
    Avx2,
    /// AVX2 as above, plus AVX512-VNNI and AVX512VL (Ice Lake and later, Zen 4 and later): the
    /// batched Q4_1 kernel sums its blocks with 512-bit `vpdpbusd`; every other kernel is AVX2's.
    /// `KVGATE_KERNELS_AVX2` caps the level at [`SimdLevel::Avx2`].
    Avx512Vnni,
}

/// Detects the best available implementation once; cheap to call on the hot path.
pub fn simd_level() -> SimdLevel {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(detect_simd_level)
}

/// `KVGATE_KERNELS_SCALAR` forces the scalar kernels, `KVGATE_KERNELS_AVX2` the AVX2 ones
/// without VNNI (both read once, at the first product).
fn detect_simd_level() -> SimdLevel {
    if std::env::var_os("KVGATE_KERNELS_SCALAR").is_some() {
        return SimdLevel::Scalar;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            if std::env::var_os("KVGATE_KERNELS_AVX2").is_none()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                return SimdLevel::Avx512Vnni;
            }
            return SimdLevel::Avx2;
        }
    }
    SimdLevel::Scalar
}

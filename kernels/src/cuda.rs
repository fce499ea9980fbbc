//! The CUDA C kernels (`kernels/cuda/*.cu`), embedded in the binary, and the facts their
//! launch code needs: program sources for NVRTC, the kernel names, compile options and the
//! launch geometry constants the sources define.
//!
//! The sources are compiled at start-up by NVRTC for the device's exact architecture (a CUBIN,
//! not PTX). Nothing here needs a GPU or the CUDA toolkit: CI checks every kernel two ways
//! without one — NVRTC from the PyPI wheel compiles each program for sm_80 and sm_90 and fails
//! on any warning or register spill ([`nvrtc_check`]), and the same sources run on the CPU
//! under a small C++ emulation of the CUDA execution model (`kernels/cuda/emu/`), compared with
//! this crate's CPU kernels ([`emu`]).
//!
//! [`device::DeviceOps`] is what the CUDA backend (in `kvgate-runtime`) launches through:
//! [`cudarc_device`] on a GPU, `emu_device` (feature `cuda-emu`) on the CPU emulator.

/// Included at the top of every program (integer types, f16 and dp4a through inline PTX, warp
/// reductions, GGML block sizes).
pub const PRELUDE: &str = include_str!("../cuda/prelude.cuh");

/// The quantized block products (`kernels/cuda/qdot.cuh`) that the matvec and the tiled
/// kernels share, as (file name, text): one copy of that code in both programs is what makes
/// their outputs bit-identical.
pub const QDOT: (&str, &str) = ("qdot.cuh", include_str!("../cuda/qdot.cuh"));

/// One NVRTC program: a `.cu` file and the kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct Program {
    /// File name under `kernels/cuda/`.
    pub name: &'static str,
    pub source: &'static str,
    /// Shared device code placed between the prelude and the file, as (file name, text).
    pub includes: &'static [(&'static str, &'static str)],
    pub kernels: &'static [&'static str],
}

/// Every program kvgate compiles.
pub const PROGRAMS: &[Program] = &[
    Program {
        name: "elementwise.cu",
        source: include_str!("../cuda/elementwise.cu"),
        includes: &[],
        kernels: &[
            "embed_rows",
            "dequantize_f16",
            "rms_norm",
            "rope_norm",
            "swiglu",
            "add_inplace",
            "argmax_rows",
        ],
    },
    Program {
        name: "attention.cu",
        source: include_str!("../cuda/attention.cu"),
        includes: &[],
        kernels: &[
            "write_kv",
            "paged_attention_d32",
            "paged_attention_d64",
            "paged_attention_d128",
            "paged_attention_tiled_d32",
            "paged_attention_tiled_d64",
            "paged_attention_tiled_d128",
            "attention_reduce",
        ],
    },
    Program {
        name: "matvec.cu",
        source: include_str!("../cuda/matvec.cu"),
        includes: &[QDOT],
        kernels: &[
            "quantize_q8_1",
            "matvec_q4_0",
            "matvec_q4_1",
            "matvec_q5_0",
            "matvec_q5_1",
            "matvec_q8_0",
            "matvec_q4_k",
            "matvec_q5_k",
            "matvec_q6_k",
            "matvec_f16",
        ],
    },
    Program {
        name: "mmq.cu",
        source: include_str!("../cuda/mmq.cu"),
        includes: &[QDOT],
        kernels: &[
            "mmq_q4_0", "mmq_q4_1", "mmq_q5_0", "mmq_q5_1", "mmq_q8_0", "mmq_q4_k", "mmq_q5_k",
            "mmq_q6_k", "mm_f16",
        ],
    },
];

impl Program {
    /// The text NVRTC compiles: the prelude, the includes, then the file (each with a
    /// `#line` so that messages name the file's own lines).
    pub fn full_source(&self) -> String {
        let mut text = String::from(PRELUDE);
        for (name, source) in self.includes.iter().chain([&(self.name, self.source)]) {
            text.push_str(&format!("\n#line 1 \"{name}\"\n{source}"));
        }
        text
    }
}

/// NVRTC options for `arch` (e.g. `sm_90`): a CUBIN for that exact architecture, C++17, the
/// ptxas report that the compile check reads register and spill counts from.
pub fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".into(),
        "--ptxas-options=--verbose".into(),
    ]
}

/// Tokens per KV block the kernels are written for (`KV_BLOCK` in attention.cu).
pub const KV_BLOCK: usize = 16;
/// Threads of one attention block (`ATTN_THREADS`).
pub const ATTN_THREADS: u32 = 128;
/// Context tokens one attention block covers; longer contexts are split and reduced
/// (`ATTN_PARTITION`). A constant, so a row's split never depends on the batch.
pub const ATTN_PARTITION: usize = 512;
const ATTN_WARPS: usize = 4;
/// Most query heads per KV head (`ATTN_MAX_GROUP`).
pub const ATTN_MAX_GROUP: usize = 8;
/// Head dimensions with a paged-attention instance (`paged_attention_d{32,64,128}` and
/// `paged_attention_tiled_d{32,64,128}`).
pub const ATTN_HEAD_DIMS: &[usize] = &[32, 64, 128];
/// Query heads (tile rows × group) one tiled attention block covers (`ATTN_TILE_HEADS`).
pub const ATTN_TILE_HEADS: usize = 16;
/// Threads of a matvec block: one warp per weight row (`MV_THREADS`).
pub const MV_THREADS: u32 = 128;
/// Weight rows per matvec block (`MV_WARPS`).
pub const MV_ROWS_PER_BLOCK: usize = 4;
/// Most activation rows one matvec launch multiplies (`MV_MAX_BATCH`).
pub const MV_MAX_BATCH: usize = 8;
/// Threads of a tiled (mmq) block (`MMQ_THREADS`).
pub const MMQ_THREADS: u32 = 256;
/// Weight rows per tiled block: the grid's x extent is `rows.div_ceil(MMQ_ROWS)` (`MMQ_ROWS`).
pub const MMQ_ROWS: usize = 16;
/// Activation rows per tiled block: the grid's y extent is `batch.div_ceil(MMQ_COLS)`
/// (`MMQ_COLS`).
pub const MMQ_COLS: usize = 32;
/// Dynamic shared memory of a tiled block: one stage of MMQ_COLS x 32 Q8_1 blocks
/// (`MMQ_SMEM_BYTES`).
pub const MMQ_SMEM_BYTES: usize = MMQ_COLS * 32 * 36;
/// Threads of a tiled F16 (`mm_f16`) block (`MMF_THREADS`).
pub const MMF_THREADS: u32 = 256;
/// Weight rows per `mm_f16` block: the grid's x extent is `rows.div_ceil(MMF_ROWS)`
/// (`MMF_ROWS`).
pub const MMF_ROWS: usize = 16;
/// Activation rows per `mm_f16` block: the grid's y extent is `batch.div_ceil(MMF_COLS)`
/// (`MMF_COLS`).
pub const MMF_COLS: usize = 32;
/// Dynamic shared memory of an `mm_f16` block: one stage of MMF_COLS activation rows × 128
/// columns as f32 (`MMF_SMEM_BYTES`).
pub const MMF_SMEM_BYTES: usize = MMF_COLS * 128 * 4;
/// Threads of an rms_norm block (`NORM_THREADS`).
pub const NORM_THREADS: u32 = 256;
/// Threads of an argmax block (`ARGMAX_THREADS`).
pub const ARGMAX_THREADS: u32 = 256;

/// The GGML type id the kernels take for a weight type (`GGML_*` in prelude.cuh), `None` for
/// types no CUDA kernel reads.
#[allow(unreachable_patterns)] // new CPU-only weight types must not break this build
pub fn ggml_type_id(ty: crate::quant::WeightType) -> Option<i32> {
    use crate::quant::WeightType;
    match ty {
        WeightType::F32 => Some(0),
        WeightType::F16 => Some(1),
        WeightType::Q4_0 => Some(2),
        WeightType::Q4_1 => Some(3),
        WeightType::Q5_0 => Some(6),
        WeightType::Q5_1 => Some(7),
        WeightType::Q8_0 => Some(8),
        WeightType::Q4_K => Some(12),
        WeightType::Q5_K => Some(13),
        WeightType::Q6_K => Some(14),
        _ => None,
    }
}

/// The matvec kernel for weights of `ty` (in `matvec.cu`), `None` for types that have none
/// (F32 is read only as an embedding table). Every quantized one takes Q8_1 activations
/// (`quantize_q8_1`), `matvec_f16` the f32 rows.
#[allow(unreachable_patterns)] // new CPU-only weight types must not break this build
pub fn matvec_kernel(ty: crate::quant::WeightType) -> Option<&'static str> {
    use crate::quant::WeightType;
    Some(match ty {
        WeightType::F16 => "matvec_f16",
        WeightType::Q4_0 => "matvec_q4_0",
        WeightType::Q4_1 => "matvec_q4_1",
        WeightType::Q5_0 => "matvec_q5_0",
        WeightType::Q5_1 => "matvec_q5_1",
        WeightType::Q8_0 => "matvec_q8_0",
        WeightType::Q4_K => "matvec_q4_k",
        WeightType::Q5_K => "matvec_q5_k",
        WeightType::Q6_K => "matvec_q6_k",
        _ => return None,
    })
}

/// The tiled quantized matrix-matrix kernel for weights of `ty` (in `mmq.cu`), `None` for the
/// float types (F16 has its own tiled kernel, `mm_f16`, see [`tiled_matmul`]). Same
/// parameters as the matvec kernels, with any batch; every output is bit-identical to the
/// matvec kernel's for the same weight and activation rows (see mmq.cu).
#[allow(unreachable_patterns)] // new CPU-only weight types must not break this build
pub fn mmq_kernel(ty: crate::quant::WeightType) -> Option<&'static str> {
    use crate::quant::WeightType;
    Some(match ty {
        WeightType::Q4_0 => "mmq_q4_0",
        WeightType::Q4_1 => "mmq_q4_1",
        WeightType::Q5_0 => "mmq_q5_0",
        WeightType::Q5_1 => "mmq_q5_1",
        WeightType::Q8_0 => "mmq_q8_0",
        WeightType::Q4_K => "mmq_q4_k",
        WeightType::Q5_K => "mmq_q5_k",
        WeightType::Q6_K => "mmq_q6_k",
        _ => return None,
    })
}

/// The tiled matrix-matrix kernel for weights of `ty` and its launch over `rows` weight rows
/// and `batch` activation rows: `mmq_*` for the quantized types (x as Q8_1 blocks, like their
/// matvec), `mm_f16` for F16 (x as f32 rows, like `matvec_f16`); `None` for types with no tiled
/// kernel. Parameters are the matvec kernels' (`out`, `w`, `x`, rows, cols, batch) with any
/// batch, and every output is bit-identical to the matvec kernel's (see mmq.cu).
#[allow(unreachable_patterns)] // new CPU-only weight types must not break this build
pub fn tiled_matmul(
    ty: crate::quant::WeightType,
    rows: usize,
    batch: usize,
) -> Option<(&'static str, device::LaunchDims)> {
    let grid = |rows_per_block: usize, cols_per_block: usize| {
        [
            u32::try_from(rows.div_ceil(rows_per_block)).unwrap_or(u32::MAX),
            u32::try_from(batch.div_ceil(cols_per_block)).unwrap_or(u32::MAX),
            1,
        ]
    };
    if ty == crate::quant::WeightType::F16 {
        let dims = device::LaunchDims::new(grid(MMF_ROWS, MMF_COLS), MMF_THREADS, MMF_SMEM_BYTES);
        return Some(("mm_f16", dims));
    }
    let dims = device::LaunchDims::new(grid(MMQ_ROWS, MMQ_COLS), MMQ_THREADS, MMQ_SMEM_BYTES);
    mmq_kernel(ty).map(|name| (name, dims))
}

/// Dynamic shared memory of one paged-attention block for a query group of `group` heads of
/// `head_dim`: queries, one partition of scores, per-warp partial outputs, max and sum.
pub fn attention_smem_bytes(group: usize, head_dim: usize) -> usize {
    4 * (group * head_dim + group * ATTN_PARTITION + ATTN_WARPS * group * head_dim + 2 * group)
}

/// Query rows of one sequence a tiled attention block (`paged_attention_tiled_d*`) covers for
/// a query group of `group` heads: as many as fit [`ATTN_TILE_HEADS`] heads (16 rows at group
/// 1, 4 at group 4, 2 at group 8). At least 1, so a tile table built from it always makes
/// progress; groups over [`ATTN_MAX_GROUP`] are refused before any launch.
pub fn attention_tile_rows(group: usize) -> usize {
    (ATTN_TILE_HEADS / group.max(1)).max(1)
}

/// Dynamic shared memory of one tiled attention block of `head_dim` (laid out for
/// [`ATTN_TILE_HEADS`] heads whatever the group): queries, one partition of scores, per-warp
/// partial outputs, max and sum, and each head's token count.
pub fn attention_tiled_smem_bytes(head_dim: usize) -> usize {
    let h = ATTN_TILE_HEADS;
    4 * (h * head_dim + h * ATTN_PARTITION + ATTN_WARPS * h * head_dim + 2 * h + h)
}

/// Partitions of the longest context in a step: the z extent of the attention grid and the
/// stride of the partial results.
pub fn attention_partitions(max_context: usize) -> usize {
    max_context.div_ceil(ATTN_PARTITION).max(1)
}

pub mod cudarc_device;
pub mod device;
pub mod nvrtc;
pub mod probe;

#[cfg(any(test, feature = "cuda-emu"))]
pub mod emu_device;

#[cfg(test)]
mod emu;
#[cfg(test)]
mod nvrtc_check;

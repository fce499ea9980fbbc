//! Device buffers for the largest step the backend accepts (`max_batched_tokens` tokens,
//! `max_num_seqs` sequences, contexts up to the model's length), allocated once: a step never
//! allocates device memory, so serving cannot run the device out of memory after start-up.

use kvgate_kernels::cuda::device::{DevBuf, DeviceOps};
use kvgate_kernels::cuda::{KV_BLOCK, attention_partitions};

use super::{CudaBackendOptions, device_error};
use crate::backend::BackendError;
use crate::model::ModelConfig;

/// Bytes of one Q8_1 block (32 activations).
pub const Q8_1_BYTES: usize = 36;

/// Element counts of every workspace buffer, computed without a device so the memory plan can
/// size the workspace before anything is allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceShape {
    pub max_tokens: usize,
    pub max_seqs: usize,
    pub max_blocks_per_seq: usize,
    pub max_parts: usize,
}

impl WorkspaceShape {
    pub fn new(config: &ModelConfig, options: &CudaBackendOptions) -> WorkspaceShape {
        WorkspaceShape {
            max_tokens: options.max_batched_tokens,
            // Every sequence in a step has at least one token.
            max_seqs: options.max_num_seqs.min(options.max_batched_tokens),
            max_blocks_per_seq: config.context_length.div_ceil(KV_BLOCK),
            max_parts: attention_partitions(config.context_length),
        }
    }

    /// i32 values of the step inputs: token ids, positions, slots, row → sequence, row →
    /// context (a row per token), the tiled attention kernel's tile table (a (first row, rows)
    /// pair per tile, at most one tile per row), logit rows, then the block tables.
    pub fn input_words(&self) -> usize {
        7 * self.max_tokens + self.max_seqs + self.max_seqs * self.max_blocks_per_seq
    }

    /// Bytes of each buffer, in [`DeviceWorkspace`] field order.
    fn sizes(&self, c: &ModelConfig) -> [usize; 15] {
        let (t, s) = (self.max_tokens, self.max_seqs);
        let (d, kvd, ff) = (c.hidden_size, c.kv_dim(), c.ffn_size);
        let f = 4;
        [
            t * d * f,                                         // x
            t * d * f,                                         // xn
            t * d * f,                                         // q
            t * kvd * f,                                       // k
            t * kvd * f,                                       // v
            t * d * f,                                         // att
            t * d * f,                                         // proj
            t * ff * f,                                        // gate
            t * ff * f,                                        // up
            t * ff * f,                                        // act
            t * d.max(ff) / 32 * Q8_1_BYTES,                   // xq
            t * c.num_heads * self.max_parts * c.head_dim * f, // part_out
            t * c.num_heads * self.max_parts * 2 * f,          // part_stats
            s * d * f + s * c.vocab_size * f,                  // last rows + logits
            self.input_words() * 4,                            // inputs
        ]
    }

    /// Total device bytes of the workspace.
    pub fn bytes(&self, config: &ModelConfig) -> usize {
        self.sizes(config).iter().sum()
    }
}

pub struct DeviceWorkspace {
    pub shape: WorkspaceShape,
    /// Residual stream [T][d].
    pub x: DevBuf,
    /// Normalised rows [T][d].
    pub xn: DevBuf,
    pub q: DevBuf,
    pub k: DevBuf,
    pub v: DevBuf,
    pub att: DevBuf,
    pub proj: DevBuf,
    pub gate: DevBuf,
    pub up: DevBuf,
    pub act: DevBuf,
    /// Activations quantized to Q8_1 for the quantized matvec kernels.
    pub xq: DevBuf,
    /// Per-partition attention outputs and (max, sum) of rows longer than one partition.
    pub part_out: DevBuf,
    pub part_stats: DevBuf,
    /// The logit rows' hidden states [S][d], then their logits [S][vocab].
    pub head: DevBuf,
    /// The step's integer inputs ([`WorkspaceShape::input_words`]).
    pub inputs: DevBuf,
    pub bytes: u64,
}

impl DeviceWorkspace {
    pub fn new<D: DeviceOps>(
        dev: &mut D,
        config: &ModelConfig,
        options: &CudaBackendOptions,
    ) -> Result<DeviceWorkspace, BackendError> {
        let shape = WorkspaceShape::new(config, options);
        let sizes = shape.sizes(config);
        let mut bufs = Vec::with_capacity(sizes.len());
        for &bytes in &sizes {
            bufs.push(dev.alloc(bytes).map_err(device_error)?);
        }
        let [
            x,
            xn,
            q,
            k,
            v,
            att,
            proj,
            gate,
            up,
            act,
            xq,
            part_out,
            part_stats,
            head,
            inputs,
        ] = bufs[..]
        else {
            unreachable!("one buffer per size");
        };
        Ok(DeviceWorkspace {
            shape,
            x,
            xn,
            q,
            k,
            v,
            att,
            proj,
            gate,
            up,
            act,
            xq,
            part_out,
            part_stats,
            head,
            inputs,
            bytes: sizes.iter().sum::<usize>() as u64,
        })
    }
}

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
    /// `None` where that overflows.
    pub fn input_words(&self) -> Option<usize> {
        let tables = self.max_seqs.checked_mul(self.max_blocks_per_seq)?;
        7usize
            .checked_mul(self.max_tokens)?
            .checked_add(self.max_seqs)?
            .checked_add(tables)
    }

    /// Bytes of each buffer, in [`DeviceWorkspace`] field order; `None` where a size or their
    /// sum overflows (a `--max-batched-tokens` or `--max-num-seqs` far beyond any device).
    fn sizes(&self, c: &ModelConfig) -> Option<[usize; 15]> {
        let sizes = self.buffer_sizes(c)?;
        sizes
            .iter()
            .try_fold(0usize, |acc, &bytes| acc.checked_add(bytes))?;
        Some(sizes)
    }

    fn buffer_sizes(&self, c: &ModelConfig) -> Option<[usize; 15]> {
        let (t, s) = (self.max_tokens, self.max_seqs);
        let (d, kvd, ff) = (c.hidden_size, c.kv_dim(), c.ffn_size);
        // Every size is a product of these factors (4: f32 and i32 bytes).
        let product = |factors: &[usize]| {
            factors
                .iter()
                .try_fold(1usize, |acc, &factor| acc.checked_mul(factor))
        };
        let parts = self.max_parts;
        Some([
            product(&[t, d, 4])?,                              // x
            product(&[t, d, 4])?,                              // xn
            product(&[t, d, 4])?,                              // q
            product(&[t, kvd, 4])?,                            // k
            product(&[t, kvd, 4])?,                            // v
            product(&[t, d, 4])?,                              // att
            product(&[t, d, 4])?,                              // proj
            product(&[t, ff, 4])?,                             // gate
            product(&[t, ff, 4])?,                             // up
            product(&[t, ff, 4])?,                             // act
            product(&[t, d.max(ff) / 32, Q8_1_BYTES])?,        // xq
            product(&[t, c.num_heads, parts, c.head_dim, 4])?, // part_out
            product(&[t, c.num_heads, parts, 2, 4])?,          // part_stats
            product(&[s, d + c.vocab_size, 4])?,               // last rows + logits
            product(&[self.input_words()?, 4])?,               // inputs
        ])
    }

    /// Device bytes of all the buffers; `None` where that overflows.
    pub fn bytes(&self, config: &ModelConfig) -> Option<usize> {
        // `sizes` checked that the sum fits.
        Some(self.sizes(config)?.iter().sum())
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
        let sizes = shape
            .sizes(config)
            .ok_or_else(|| BackendError::OutOfMemory(overflow_message(options)))?;
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

/// The error for a workspace whose size overflows: the step limits are beyond any device.
fn overflow_message(options: &CudaBackendOptions) -> String {
    format!(
        "--max-batched-tokens {} / --max-num-seqs {} are too large: the device workspace for \
         that many tokens and sequences overflows a 64-bit size",
        options.max_batched_tokens, options.max_num_seqs
    )
}

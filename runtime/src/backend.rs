//! The seam between the integer bookkeeping (scheduler, block pool) and the tensor code.
//!
//! The engine lowers one scheduler step into a [`BatchInputs`]: flat arrays of token ids,
//! positions and KV slots plus per-sequence block tables, the same shape stock paged-attention
//! kernels consume. A [`Backend`] runs the model over it, writes the KV cache at the given slots
//! and returns one logits row per sequence that asked for one. Keeping this seam integer-only
//! means the scheduler can be tested with a fake backend and no model.

pub mod cpu;
pub mod cuda;
pub(crate) mod step_plan;

/// One scheduler step: the tokens of every scheduled sequence, back to back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchInputs {
    /// All tokens computed this step, sequence after sequence.
    pub token_ids: Vec<u32>,
    /// Position of each token within its own sequence.
    pub positions: Vec<u32>,
    /// KV slot of each token: `block_id * block_size + offset_in_block`.
    pub slot_mapping: Vec<u32>,
    /// Per-sequence view of the step, in the order their tokens appear in `token_ids`.
    pub seqs: Vec<SeqInputs>,
}

/// One sequence's share of a [`BatchInputs`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqInputs {
    /// Index of this sequence's first token in `token_ids`.
    pub token_start: usize,
    /// Tokens of this sequence in this step (a prefill chunk, or 1 for a decode).
    pub num_tokens: usize,
    /// Tokens in KV for this sequence after this step (= position of its last token + 1).
    pub context_len: usize,
    /// Block ids covering positions `0..context_len`, in order.
    pub block_table: Vec<u32>,
    /// True for the last prefill chunk or a decode: the step needs logits for the last token.
    pub needs_logits: bool,
    /// Length of the sequence's prompt: positions below it are prompt tokens, the rest were
    /// generated. The CPU backend sums attention in an order chosen by this, never by how the
    /// step was cut (see `kvgate_kernels::ReductionOrder::for_token`).
    pub prompt_len: usize,
}

impl BatchInputs {
    /// Empties every array but keeps their capacity, so steps reuse the same buffers.
    pub fn clear(&mut self) {
        self.token_ids.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.seqs.clear();
    }

    /// Number of sequences that will receive a logits row.
    pub fn num_logits_rows(&self) -> usize {
        self.seqs.iter().filter(|s| s.needs_logits).count()
    }
}

/// Bytes a backend holds, for `EngineStats` and `kvgate plan`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Model weights (mapped or copied).
    pub weights_bytes: u64,
    /// The paged KV cache.
    pub kv_bytes: u64,
    /// Activations and scratch buffers.
    pub workspace_bytes: u64,
    /// The device's own view, on a backend that runs on one (the CUDA driver's `cuMemGetInfo`,
    /// read at each step); `None` on the CPU.
    pub device: Option<DeviceMemoryView>,
}

/// Memory of the whole device as its driver reports it: every process on it counts, not only
/// this one, so it shows what the backend's own accounting cannot (another process growing into
/// the memory kvgate planned around).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemoryView {
    pub used_bytes: u64,
    pub total_bytes: u64,
}

impl DeviceMemoryView {
    /// From the driver's (free, total).
    pub fn from_free_total((free, total): (u64, u64)) -> Self {
        DeviceMemoryView {
            used_bytes: total.saturating_sub(free),
            total_bytes: total,
        }
    }
}

impl MemoryUsage {
    /// Everything together.
    pub fn total_bytes(&self) -> u64 {
        self.weights_bytes + self.kv_bytes + self.workspace_bytes
    }
}

/// Why a forward pass failed. The engine reports it to every sequence in the batch.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The inputs break the seam's contract (e.g. a slot beyond the cache, ragged arrays).
    #[error("invalid batch inputs: {0}")]
    InvalidInputs(String),
    /// The backend could not get memory it needs for this step.
    #[error("backend out of memory: {0}")]
    OutOfMemory(String),
    /// Anything else the device or kernels reported.
    #[error("backend failure: {0}")]
    Other(String),
}

/// A model executor over a paged KV cache.
pub trait Backend: Send {
    /// Short name for logs and stats ("cpu", "cuda", "fake").
    fn name(&self) -> &'static str;
    /// Length of one logits row.
    fn vocab_size(&self) -> usize;
    /// Runs one step. Writes one row of `vocab_size` logits per seq with `needs_logits`, in seq
    /// order, into `logits` (cleared/resized by the backend; its capacity is reused across steps).
    fn forward(&mut self, inputs: &BatchInputs, logits: &mut Vec<f32>) -> Result<(), BackendError>;
    /// Memory currently held: weights, KV cache, workspace.
    fn memory(&self) -> MemoryUsage;
}

#[cfg(test)]
mod tests {
    use super::DeviceMemoryView;

    #[test]
    fn the_drivers_free_and_total_become_used_and_total() {
        let view = DeviceMemoryView::from_free_total((3 << 30, 8 << 30));
        assert_eq!((view.used_bytes, view.total_bytes), (5 << 30, 8 << 30));
        // A driver reporting more free than total (never expected) reads as nothing used.
        assert_eq!(DeviceMemoryView::from_free_total((9, 8)).used_bytes, 0);
    }
}

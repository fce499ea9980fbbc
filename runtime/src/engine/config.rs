//! Engine sizing and limits, validated once at spawn.

use super::EngineError;
use crate::scheduler::SchedulerConfig;

/// Sizes and limits of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool (the backend's KV cache must hold at least this many).
    pub num_blocks: usize,
    /// Bytes of one block in the backend's cache (reporting only).
    pub bytes_per_block: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Token budget per step.
    pub max_batched_tokens: usize,
    /// Largest prefill chunk per sequence per step; 0 = only the budget limits it.
    pub long_prefill_threshold: usize,
    /// Prompt + max_tokens may not exceed this.
    pub max_model_len: usize,
    /// Capacity of the submit queue (and of the engine's waiting list).
    pub command_queue: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 1024,
            bytes_per_block: 0,
            max_num_seqs: 64,
            max_batched_tokens: 512,
            long_prefill_threshold: 256,
            max_model_len: 8192,
            command_queue: 256,
        }
    }
}

impl EngineConfig {
    pub(super) fn validate(&self) -> Result<(), EngineError> {
        let positive = [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_batched_tokens", self.max_batched_tokens),
            ("max_model_len", self.max_model_len),
            ("command_queue", self.command_queue),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(EngineError::InvalidConfig(format!(
                "{name} must be at least 1"
            )));
        }
        let slots = self.num_blocks.checked_mul(self.block_size);
        if slots.is_none_or(|s| s > u32::MAX as usize) {
            return Err(EngineError::InvalidConfig(format!(
                "num_blocks × block_size must fit in u32 KV slots (got {} × {})",
                self.num_blocks, self.block_size
            )));
        }
        Ok(())
    }

    pub(super) fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            long_prefill_threshold: self.long_prefill_threshold,
        }
    }
}

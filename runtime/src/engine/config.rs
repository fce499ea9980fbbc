//! Engine sizing and limits, validated once at spawn.

use std::time::Duration;

use super::EngineError;
use crate::scheduler::{PrefillOrder, SchedulerConfig};

/// Step-time target while sequences decode, unless configured: long enough that prompt
/// tokens still go through in chunks of useful size on a small CPU (the flooding tenant of
/// BENCHMARKS.md's tenant-isolation run keeps its throughput), short enough that a stream's
/// tokens keep coming however many prompts queue behind it.
pub const DEFAULT_TARGET_ITL: Duration = Duration::from_millis(100);

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
    /// While any sequence decodes, each step takes only the prompt tokens that keep its
    /// predicted time within this; `None` lets every step use the whole budget.
    pub target_itl: Option<Duration>,
    /// How prompt tokens are shared between sequences (and tenants) with prefill left.
    pub prefill_order: PrefillOrder,
    /// Reuse the K/V of full blocks whose prefix (and cache salt) a request repeats. Off,
    /// every request computes its whole prompt (`--prefix-cache off`, for comparisons).
    pub prefix_caching: bool,
}

/// Largest `command_queue`. The submit queue is a bounded channel that allocates its whole
/// capacity up front (`--engine-queue 4294967295` asked for 137 GB and aborted); far more
/// requests than any engine runs at once can still wait, in admission's queue.
pub const MAX_COMMAND_QUEUE: usize = 65_536;

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
            target_itl: Some(DEFAULT_TARGET_ITL),
            prefill_order: PrefillOrder::TenantFair,
            prefix_caching: true,
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
        if self.command_queue > MAX_COMMAND_QUEUE {
            return Err(EngineError::InvalidConfig(format!(
                "command_queue must be at most {MAX_COMMAND_QUEUE} (got {})",
                self.command_queue
            )));
        }
        let slots = self.num_blocks.checked_mul(self.block_size);
        if slots.is_none_or(|s| s > u32::MAX as usize) {
            return Err(EngineError::InvalidConfig(format!(
                "num_blocks × block_size must fit in u32 KV slots (got {} × {})",
                self.num_blocks, self.block_size
            )));
        }
        if self.target_itl.is_some_and(|t| t.is_zero()) {
            return Err(EngineError::InvalidConfig(
                "target_itl must be positive (or None for no target)".into(),
            ));
        }
        Ok(())
    }

    pub(super) fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            long_prefill_threshold: self.long_prefill_threshold,
            target_step_time: self.target_itl,
            prefill_order: self.prefill_order,
        }
    }
}

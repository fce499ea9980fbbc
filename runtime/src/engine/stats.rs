//! What the engine reports about itself: counters and gauges ([`EngineStats`]) and one
//! [`SeqSnapshot`] per live sequence. The engine thread refreshes both every step; handles read
//! copies, so readers never wait on a step.

use std::sync::Arc;

use crate::backend::MemoryUsage;
use crate::sequence::{SeqId, SeqStatus};

/// Counters and gauges, refreshed by the engine thread after every step.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    pub preemptions_total: u64,
    pub cancellations_total: u64,
    pub finished_total: u64,
    pub errors_total: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Allocated KV slots not holding a token, over running sequences (last-block tails).
    pub kv_waste_slots: usize,
    pub last_batch_seqs: usize,
    pub last_batch_tokens: usize,
    /// Wall time of the last step's forward + sampling, in microseconds.
    pub last_step_micros: u64,
    /// Largest `backend.memory()` total seen since start.
    pub peak_memory_bytes: u64,
    #[serde(skip)]
    pub memory: MemoryUsage,
}

/// One sequence as `/admin/kv` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SeqSnapshot {
    pub id: SeqId,
    #[serde(serialize_with = "serialize_label")]
    pub label: Arc<str>,
    pub state: SeqStatus,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub computed_tokens: usize,
    pub blocks: usize,
    /// Blocks still promised to it by its reservation.
    pub reserved_blocks: usize,
    pub preemptions: u32,
}

fn serialize_label<S: serde::Serializer>(label: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(label)
}

//! What the engine reports about itself: counters, gauges and per-step histograms
//! ([`EngineStats`]) and one [`SeqSnapshot`] per live sequence. The engine thread refreshes both
//! every step (and publishes the stats once at spawn, so memory is known before any request);
//! handles read copies, so readers never wait on a step.

use std::sync::Arc;

use crate::backend::MemoryUsage;
use crate::sequence::{SeqId, SeqStatus};

/// Upper bounds (inclusive) of the buckets of every [`StepHistogram`]: powers of two, enough for
/// sequences per step (≤ `max_num_seqs`) and tokens per step (≤ `max_batched_tokens`). Larger
/// values land in the implicit `+Inf` bucket.
pub const STEP_BUCKET_BOUNDS: [u64; 14] = [
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
];

/// A cumulative histogram of one per-step quantity with the fixed [`STEP_BUCKET_BOUNDS`]: the
/// engine records every step into it (a few integer operations, no allocation), and copying it
/// into the published stats is a plain copy. Counts only grow, so a scraper can export it as a
/// Prometheus histogram and miss no step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StepHistogram {
    /// `counts[i]`: observations in `(bounds[i - 1], bounds[i]]`; the last entry counts those
    /// above every bound.
    counts: [u64; STEP_BUCKET_BOUNDS.len() + 1],
    sum: u64,
    count: u64,
}

impl StepHistogram {
    /// The finite bucket upper bounds, increasing.
    pub const BOUNDS: &'static [u64] = &STEP_BUCKET_BOUNDS;

    /// Counts one observation.
    pub fn record(&mut self, value: u64) {
        let bucket = Self::BOUNDS.partition_point(|&bound| bound < value);
        self.counts[bucket] = self.counts[bucket].saturating_add(1);
        self.sum = self.sum.saturating_add(value);
        self.count = self.count.saturating_add(1);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of every observation so far.
    pub fn sum(&self) -> u64 {
        self.sum
    }

    /// Prometheus buckets: `(Some(bound), observations ≤ bound)` for each of [`Self::BOUNDS`] in
    /// order, then `(None, count)` for `+Inf`. Non-decreasing by construction.
    pub fn cumulative(&self) -> impl Iterator<Item = (Option<u64>, u64)> + '_ {
        let bounds = Self::BOUNDS.iter().map(|&b| Some(b)).chain([None]);
        bounds
            .zip(self.counts.iter())
            .scan(0u64, |total, (bound, &n)| {
                *total = total.saturating_add(n);
                Some((bound, *total))
            })
    }
}

/// Counters, gauges and histograms, refreshed by the engine thread after every step.
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
    /// Sequences in each step, every step since start (`count == steps`).
    pub batch_seqs: StepHistogram,
    /// Tokens computed in each step (prefill chunks + decodes), every step since start.
    pub batch_tokens: StepHistogram,
    /// Wall time of the last step's forward + sampling, in microseconds.
    pub last_step_micros: u64,
    /// Largest `backend.memory()` total seen since start (set at spawn, before any step).
    pub peak_memory_bytes: u64,
    /// `backend.memory()` as of the last step, or as of spawn before the first one.
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
    /// Tokens the step in flight is computing (their KV slots are being written now).
    pub scheduled_tokens: usize,
    pub blocks: usize,
    /// Blocks still promised to it by its reservation.
    pub reserved_blocks: usize,
    pub preemptions: u32,
}

fn serialize_label<S: serde::Serializer>(label: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(label)
}

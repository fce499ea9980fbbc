//! What the engine reports about itself: counters, gauges and per-step histograms
//! ([`EngineStats`]) and one [`SeqSnapshot`] per live sequence. The engine thread refreshes both
//! every step (and publishes the stats once at spawn, so memory is known before any request);
//! handles read copies, so readers never wait on a step.

use std::sync::Arc;

use crate::backend::MemoryUsage;
use crate::scheduler::StepCost;
use crate::sequence::{SeqId, SeqStatus};

/// Upper bounds (inclusive) of the buckets of the per-step count histograms: powers of two,
/// enough for sequences per step (≤ `max_num_seqs`) and tokens per step (≤
/// `max_batched_tokens`). Larger values land in the implicit `+Inf` bucket.
pub const STEP_BUCKET_BOUNDS: [u64; 14] = [
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
];

/// Upper bounds of the step-duration histogram, in microseconds (1 ms to 10 s): fine around
/// the inter-token latencies a target is usually set to (25–250 ms).
pub const STEP_MICROS_BUCKET_BOUNDS: [u64; 14] = [
    1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 75_000, 100_000, 150_000, 250_000, 500_000,
    1_000_000, 2_500_000, 10_000_000,
];

/// A cumulative histogram of one per-step quantity with fixed bounds ([`STEP_BUCKET_BOUNDS`]
/// unless made [`StepHistogram::with_bounds`]): the engine records every step into it (a few
/// integer operations, no allocation), and copying it into the published stats is a plain
/// copy. Counts only grow, so a scraper can export it as a Prometheus histogram and miss no
/// step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StepHistogram {
    #[serde(skip)]
    bounds: &'static [u64; 14],
    /// `counts[i]`: observations in `(bounds[i - 1], bounds[i]]`; the last entry counts those
    /// above every bound.
    counts: [u64; 15],
    sum: u64,
    count: u64,
}

impl Default for StepHistogram {
    fn default() -> Self {
        StepHistogram::with_bounds(&STEP_BUCKET_BOUNDS)
    }
}

impl StepHistogram {
    /// An empty histogram over `bounds` (increasing).
    pub const fn with_bounds(bounds: &'static [u64; 14]) -> StepHistogram {
        StepHistogram {
            bounds,
            counts: [0; 15],
            sum: 0,
            count: 0,
        }
    }

    /// The finite bucket upper bounds, increasing.
    pub fn bounds(&self) -> &'static [u64] {
        self.bounds
    }

    /// Counts one observation.
    pub fn record(&mut self, value: u64) {
        let bucket = self.bounds.partition_point(|&bound| bound < value);
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

    /// Prometheus buckets: `(Some(bound), observations ≤ bound)` for each bound in order,
    /// then `(None, count)` for `+Inf`. Non-decreasing by construction.
    pub fn cumulative(&self) -> impl Iterator<Item = (Option<u64>, u64)> + '_ {
        let bounds = self.bounds.iter().map(|&b| Some(b)).chain([None]);
        bounds
            .zip(self.counts.iter())
            .scan(0u64, |total, (bound, &n)| {
                *total = total.saturating_add(n);
                Some((bound, *total))
            })
    }
}

/// A [`StepHistogram`] of step wall times in microseconds, over
/// [`STEP_MICROS_BUCKET_BOUNDS`] (also by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(transparent)]
pub struct StepDurationHistogram(pub StepHistogram);

impl Default for StepDurationHistogram {
    fn default() -> Self {
        StepDurationHistogram(StepHistogram::with_bounds(&STEP_MICROS_BUCKET_BOUNDS))
    }
}

impl std::ops::Deref for StepDurationHistogram {
    type Target = StepHistogram;
    fn deref(&self) -> &StepHistogram {
        &self.0
    }
}

impl std::ops::DerefMut for StepDurationHistogram {
    fn deref_mut(&mut self) -> &mut StepHistogram {
        &mut self.0
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
    /// Prompt tokens computed by the backend: prefill chunks and recomputation after
    /// preemption, without the tokens the prefix cache served.
    pub prefill_tokens_computed_total: u64,
    /// Prompt tokens of admitted requests looked up in the prefix cache (vLLM's
    /// `prefix_cache_queries`), and how many of them it served (`prefix_cache_hits`).
    pub prefix_cache_queries_total: u64,
    pub prefix_cache_hits_total: u64,
    /// Whether the engine reuses cached prefixes at all (`EngineConfig::prefix_caching`).
    pub prefix_caching: bool,
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
    /// Wall time of every step (scheduling to streamed tokens), in microseconds
    /// ([`STEP_MICROS_BUCKET_BOUNDS`]): what a decoding stream waits per token.
    pub step_micros: StepDurationHistogram,
    /// Most prompt tokens the last step could take: below the budget when the step-time
    /// target capped it because sequences were decoding.
    pub prefill_cap_tokens: usize,
    /// The step-time target the cap follows; `None` when off.
    pub target_step_micros: Option<u64>,
    /// The cost model's current fit (what the cap is computed from).
    pub step_cost: StepCost,
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

//! KV-waste measurement for BENCHMARKS.md: run a mixed-length workload through the engine and,
//! while it runs, compare the KV the paged pool has allocated with the KV actually holding
//! tokens, next to what two contiguous allocation schemes would have had to set aside for the
//! same running sequences (a max-context buffer per request, or a buffer of prompt +
//! max_tokens per request).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{BenchError, bench_prompt, drive};
use crate::engine::SeqStatus;
use crate::loader::Runtime;

/// The workload: `requests` requests submitted together, prompt and output lengths spread
/// deterministically over the given ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvWasteOptions {
    pub requests: usize,
    pub prompt_tokens: (usize, usize),
    pub output_tokens: (usize, usize),
    /// How often the engine's sequences are sampled.
    pub sample_every: Duration,
}

impl Default for KvWasteOptions {
    fn default() -> Self {
        KvWasteOptions {
            requests: 48,
            prompt_tokens: (16, 400),
            output_tokens: (8, 160),
            sample_every: Duration::from_millis(10),
        }
    }
}

/// Averages over the samples taken while sequences were running.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KvWasteReport {
    pub requests: usize,
    pub samples: usize,
    pub block_size: usize,
    pub pool_tokens: usize,
    pub max_context: usize,
    /// Mean KV slots allocated to running sequences / slots holding a token.
    pub paged_allocated_per_used: f64,
    /// The same for one max-context buffer per running request.
    pub max_context_allocated_per_used: f64,
    /// The same for one prompt + max_tokens buffer per running request.
    pub reservation_allocated_per_used: f64,
    /// Most sequences the paged pool held at once.
    pub peak_running: usize,
    /// Requests a pool of this size could hold with one max-context buffer each.
    pub max_context_capacity: usize,
    pub preemptions: u64,
}

/// Runs the workload on `runtime` and samples its sequences until every request finished.
pub fn measure_kv_waste(
    runtime: &Runtime,
    options: &KvWasteOptions,
) -> Result<KvWasteReport, BenchError> {
    let engine = &runtime.engine;
    let vocab = runtime.config.vocab_size;
    let spread = |i: usize, (lo, hi): (usize, usize)| lo + (i * 7919) % (hi.saturating_sub(lo) + 1);
    let requests: Vec<(Vec<u32>, usize)> = (0..options.requests)
        .map(|i| {
            let prompt = bench_prompt(1000 + i, spread(i, options.prompt_tokens).max(1), vocab);
            (prompt, spread(i * 3 + 1, options.output_tokens).max(1))
        })
        .collect();
    let budgets: Vec<usize> = requests.iter().map(|(p, m)| p.len() + m).collect();
    let preemptions_before = engine.stats().preemptions_total;
    let block_size = runtime.block_size;
    let max_context = runtime.config.context_length;

    let done = AtomicBool::new(false);
    let (result, totals) = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut t = Totals::default();
            while !done.load(Ordering::Acquire) {
                t.sample(&engine.inspect(), block_size, max_context, &budgets);
                std::thread::sleep(options.sample_every);
            }
            t
        });
        let result = drive(engine, "kvwaste", requests);
        done.store(true, Ordering::Release);
        (result, sampler.join().unwrap_or_default())
    });
    result?;
    let ratio = |a: usize| {
        if totals.used == 0 {
            0.0
        } else {
            a as f64 / totals.used as f64
        }
    };
    let pool_tokens = runtime.num_blocks * block_size;
    Ok(KvWasteReport {
        requests: options.requests,
        samples: totals.samples,
        block_size,
        pool_tokens,
        max_context,
        paged_allocated_per_used: ratio(totals.paged),
        max_context_allocated_per_used: ratio(totals.max_context),
        reservation_allocated_per_used: ratio(totals.reservation),
        peak_running: totals.peak_running,
        max_context_capacity: pool_tokens / max_context.max(1),
        preemptions: engine.stats().preemptions_total - preemptions_before,
    })
}

/// Slot sums over all samples.
#[derive(Debug, Default)]
struct Totals {
    samples: usize,
    used: usize,
    paged: usize,
    max_context: usize,
    reservation: usize,
    peak_running: usize,
}

impl Totals {
    fn sample(
        &mut self,
        seqs: &[crate::engine::SeqSnapshot],
        block_size: usize,
        max_context: usize,
        budgets: &[usize],
    ) {
        let running: Vec<_> = seqs
            .iter()
            .filter(|s| s.state == SeqStatus::Running)
            .collect();
        if running.is_empty() {
            return;
        }
        self.samples += 1;
        self.peak_running = self.peak_running.max(running.len());
        for s in running {
            // Slots the step in flight is writing hold tokens too (the snapshot is published
            // when a step is scheduled, so mid-step the computed count lags its blocks).
            self.used += s.computed_tokens + s.scheduled_tokens;
            self.paged += s.blocks * block_size;
            self.max_context += max_context;
            let index = s
                .label
                .rsplit('-')
                .next()
                .and_then(|i| i.parse::<usize>().ok());
            self.reservation += index
                .and_then(|i| budgets.get(i))
                .copied()
                .unwrap_or(max_context);
        }
    }
}

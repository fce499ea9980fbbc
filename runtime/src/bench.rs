//! `kvgate bench`: throughput of the runtime measured through the real engine (scheduler,
//! continuous batching, sampling, streaming), not the bare backend.
//!
//! * prefill: one 200-token prompt, time from submission to the first token;
//! * decode: 128 tokens (EOS ignored) of one stream whose context starts `decode_depth` tokens
//!   deep (0 by default: a one-token prompt, like llama-bench's `tg128`; `-d N` there is
//!   `--decode-depth N` here), time from its first to its last token, so prefill is excluded;
//! * aggregate decode at N concurrent streams: N requests submitted together; the rate counts
//!   the tokens that arrive after the last stream got its first token (every prefill is done
//!   by then) over the time from that moment to the last token.
//!
//! Every figure is the median of `repeats` runs (single-stream ones after one warm-up run), so
//! that one noisy run on a shared machine does not decide a ratio between them.

mod kv_waste;
mod prefix;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::engine::{Engine, GenerationRequest, TokenEvent};
use crate::loader::Runtime;

pub use kv_waste::{KvWasteOptions, KvWasteReport, measure_kv_waste};
pub use prefix::{
    PrefixBenchOptions, PrefixBenchReport, PrefixPassReport, PrefixWorkload, run_prefix_bench,
};

/// What to run. `Default` is the workload the README's numbers use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchOptions {
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    /// Context already in the KV cache when the timed decode starts (llama-bench's depth).
    pub decode_depth: usize,
    /// Stream counts for the aggregate decode measurement.
    pub concurrency: Vec<usize>,
    /// Prompt length and generated tokens of each concurrent stream.
    pub concurrent_prompt_tokens: usize,
    pub concurrent_decode_tokens: usize,
    /// Timed runs of each measurement (the median is reported).
    pub repeats: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            prompt_tokens: 200,
            decode_tokens: 128,
            decode_depth: 0,
            concurrency: vec![1, 4, 16, 64],
            concurrent_prompt_tokens: 32,
            concurrent_decode_tokens: 64,
            repeats: 3,
        }
    }
}

/// Results, serialised as `{"threads", "prefill_tok_s", "decode_tok_s",
/// "aggregate_decode_tok_s": {"1": …, "4": …}}`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BenchReport {
    pub threads: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub aggregate_decode_tok_s: BTreeMap<usize, f64>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BenchError {
    #[error("bench request could not be submitted: {0}")]
    Submit(String),
    #[error("bench request failed: {0}")]
    Failed(String),
    #[error("bench request produced {got} tokens, expected {expected}")]
    ShortOutput { got: usize, expected: usize },
    #[error("invalid bench options: {0}")]
    InvalidOptions(String),
}

/// Arrival time of every token of one request.
#[derive(Debug, Clone)]
pub(crate) struct Trace {
    pub submitted: Instant,
    pub tokens: Vec<Instant>,
}

/// Runs the whole benchmark on `runtime`'s engine.
pub fn run_bench(runtime: &Runtime, options: &BenchOptions) -> Result<BenchReport, BenchError> {
    if options.prompt_tokens == 0
        || options.decode_tokens == 0
        || options.concurrent_decode_tokens < 2
    {
        return Err(BenchError::InvalidOptions(
            "prompt and decode lengths must be at least 1 (2 for concurrent streams)".into(),
        ));
    }
    let engine = &runtime.engine;
    let vocab = runtime.config.vocab_size;
    let single = || -> Result<(f64, f64), BenchError> {
        let prompt = bench_prompt(0, options.prompt_tokens, vocab);
        let trace = drive(engine, "bench", vec![(prompt, 1)])?.remove(0);
        let prefill = options.prompt_tokens as f64 / secs(trace.tokens[0] - trace.submitted);
        let prompt = bench_prompt(0, options.decode_depth.max(1), vocab);
        let trace = drive(engine, "bench", vec![(prompt, options.decode_tokens + 1)])?.remove(0);
        let (first, last) = (trace.tokens[0], trace.tokens[trace.tokens.len() - 1]);
        let decode = options.decode_tokens as f64 / secs(last - first);
        Ok((prefill, decode))
    };
    single()?; // warm-up: page in the weights, grow the scratch buffers
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for _ in 0..options.repeats.max(1) {
        let (p, d) = single()?;
        prefill.push(p);
        decode.push(d);
    }

    let mut aggregate = BTreeMap::new();
    for &n in &options.concurrency {
        let mut rates = Vec::new();
        for _ in 0..options.repeats.max(1) {
            let requests = (0..n)
                .map(|i| {
                    let prompt = bench_prompt(i + 1, options.concurrent_prompt_tokens, vocab);
                    (prompt, options.concurrent_decode_tokens)
                })
                .collect();
            let traces = drive(engine, "bench", requests)?;
            rates.push(steady_decode_rate(&traces));
        }
        aggregate.insert(n, median(&mut rates));
    }
    Ok(BenchReport {
        threads: runtime.threads,
        prefill_tok_s: median(&mut prefill),
        decode_tok_s: median(&mut decode),
        aggregate_decode_tok_s: aggregate,
    })
}

/// Tokens per second once every stream is decoding: tokens after the last first token, over
/// the time from then to the last token.
pub(crate) fn steady_decode_rate(traces: &[Trace]) -> f64 {
    let Some(start) = traces
        .iter()
        .filter_map(|t| t.tokens.first())
        .max()
        .copied()
    else {
        return 0.0;
    };
    let end = traces
        .iter()
        .filter_map(|t| t.tokens.last())
        .max()
        .copied()
        .unwrap_or(start);
    let tokens = traces
        .iter()
        .map(|t| t.tokens.iter().filter(|&&at| at > start).count())
        .sum::<usize>();
    if end <= start {
        0.0
    } else {
        tokens as f64 / secs(end - start)
    }
}

/// Submits every `(prompt, max_tokens)` request at once (greedy, EOS ignored, so each yields
/// exactly `max_tokens` tokens) labelled `{label}-{index}`, and records token arrival times,
/// one reader thread per stream.
pub(crate) fn drive(
    engine: &Engine,
    label: &str,
    requests: Vec<(Vec<u32>, usize)>,
) -> Result<Vec<Trace>, BenchError> {
    let mut handles = Vec::with_capacity(requests.len());
    for (i, (prompt, max_tokens)) in requests.into_iter().enumerate() {
        let submitted = Instant::now();
        let mut request =
            GenerationRequest::greedy(prompt, max_tokens, format!("{label}-{i}")).ignoring_eos();
        // Throughput runs repeat their prompts: a cache hit would time nothing.
        request.cache_salt = None;
        let handle = engine
            .submit(request)
            .map_err(|e| BenchError::Submit(e.to_string()))?;
        handles.push((submitted, max_tokens, handle));
    }
    std::thread::scope(|scope| {
        let readers: Vec<_> = handles
            .into_iter()
            .map(|(submitted, max_tokens, mut handle)| {
                scope.spawn(move || -> Result<Trace, BenchError> {
                    let mut tokens = Vec::with_capacity(max_tokens);
                    while let Some(event) = handle.events.blocking_recv() {
                        match event {
                            TokenEvent::Token { .. } => tokens.push(Instant::now()),
                            TokenEvent::Finished { .. } => break,
                            TokenEvent::Error(msg) => return Err(BenchError::Failed(msg)),
                        }
                    }
                    if tokens.len() != max_tokens {
                        return Err(BenchError::ShortOutput {
                            got: tokens.len(),
                            expected: max_tokens,
                        });
                    }
                    Ok(Trace { submitted, tokens })
                })
            })
            .collect();
        readers
            .into_iter()
            .map(|r| {
                r.join()
                    .unwrap_or_else(|_| Err(BenchError::Failed("reader thread panicked".into())))
            })
            .collect()
    })
}

/// A deterministic prompt of `len` ordinary token ids, different for each `request`. Token ids
/// below 256 (special and byte tokens in most vocabularies) are avoided; compute cost does not
/// depend on which ids are used.
pub(crate) fn bench_prompt(request: usize, len: usize, vocab: usize) -> Vec<u32> {
    let span = vocab.saturating_sub(256).max(1) as u64;
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ (request as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (256 + state % span) as u32
        })
        .collect()
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64().max(1e-9)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_serialises_with_string_concurrency_keys() {
        let report = BenchReport {
            threads: 2,
            prefill_tok_s: 600.5,
            decode_tok_s: 120.0,
            aggregate_decode_tok_s: [(1, 118.0), (4, 300.0), (16, 420.0), (64, 450.0)].into(),
        };
        let json = serde_json::to_value(&report).expect("serialises");
        assert_eq!(json["threads"], 2);
        assert_eq!(json["aggregate_decode_tok_s"]["16"], 420.0);
        let keys: Vec<&String> = json.as_object().expect("object").keys().collect();
        assert_eq!(keys.len(), 4);
        let back: BenchReport = serde_json::from_value(json).expect("round trips");
        assert_eq!(back, report);
    }

    #[test]
    fn steady_rate_counts_only_tokens_after_every_prefill() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Stream A starts decoding at 0 ms, stream B only at 100 ms; both end at 200 ms.
        let a = Trace {
            submitted: t0,
            tokens: (0..=20).map(|i| at(i * 10)).collect(),
        };
        let b = Trace {
            submitted: t0,
            tokens: (10..=20).map(|i| at(i * 10)).collect(),
        };
        // After 100 ms: A has 10 tokens, B has 10 → 20 tokens in 0.1 s.
        let rate = steady_decode_rate(&[a, b]);
        assert!((rate - 200.0).abs() < 1e-6, "{rate}");
        assert_eq!(steady_decode_rate(&[]), 0.0);
    }

    #[test]
    fn bench_prompts_are_deterministic_distinct_and_in_range() {
        let a = bench_prompt(1, 200, 49152);
        assert_eq!(a, bench_prompt(1, 200, 49152));
        assert_ne!(a, bench_prompt(2, 200, 49152));
        assert!(a.iter().all(|&t| (256..49152).contains(&t)));
        assert_eq!(a.len(), 200);
    }

    #[test]
    fn median_picks_the_middle() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut []), 0.0);
    }
}

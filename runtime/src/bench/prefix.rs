//! `kvgate bench --workload shared-prompt|multi-turn`: what the prefix cache buys, measured
//! side by side in one run on one engine. Each workload runs twice: first with every request
//! opting out of the cache (`cache_salt: None`, exactly what `--prefix-cache off` does), then
//! with one salt for all requests (as one tenant's traffic has). The opted-out pass neither
//! reads nor fills the cache, so the second pass starts from a cold cache too.
//!
//! * **shared-prompt**: `clients` threads, each sending `turns` requests one after another;
//!   every prompt is the same `system_tokens`-token system prompt followed by a short user
//!   turn of its own.
//! * **multi-turn**: `clients` chats; each turn resends the whole conversation so far (the
//!   system prompt, every earlier user turn and every earlier answer) plus a new user turn.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{BenchError, bench_prompt, median, secs};
use crate::engine::{Engine, GenerationRequest, TokenEvent};
use crate::loader::Runtime;

/// Which prefix workload to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixWorkload {
    SharedPrompt,
    MultiTurn,
}

/// Sizes of a prefix workload. `for_workload` gives the ones BENCHMARKS.md uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixBenchOptions {
    pub workload: PrefixWorkload,
    pub clients: usize,
    /// Requests per client (shared-prompt) or turns per chat (multi-turn).
    pub turns: usize,
    pub system_tokens: usize,
    pub user_tokens: usize,
    pub output_tokens: usize,
}

impl PrefixBenchOptions {
    pub fn for_workload(workload: PrefixWorkload) -> PrefixBenchOptions {
        match workload {
            PrefixWorkload::SharedPrompt => PrefixBenchOptions {
                workload,
                clients: 16,
                turns: 1,
                system_tokens: 1000,
                user_tokens: 24,
                output_tokens: 16,
            },
            PrefixWorkload::MultiTurn => PrefixBenchOptions {
                workload,
                clients: 2,
                turns: 8,
                system_tokens: 200,
                user_tokens: 40,
                output_tokens: 32,
            },
        }
    }
}

/// One pass of a workload (cache off or on).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PrefixPassReport {
    pub prefix_cache: bool,
    pub requests: usize,
    pub prompt_tokens: u64,
    /// Prompt tokens the backend computed (prefill and recomputation after preemption).
    pub prefill_tokens_computed: u64,
    /// Cached tokens ÷ prompt tokens looked up.
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    /// Generated tokens per second of wall time over the whole pass.
    pub output_tok_s: f64,
    pub wall_s: f64,
    /// Most sequences holding KV blocks at once (sampled every 2 ms).
    pub peak_running: usize,
    pub preemptions: u64,
}

/// Both passes of one workload.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PrefixBenchReport {
    pub workload: &'static str,
    pub clients: usize,
    pub turns: usize,
    pub threads: usize,
    pub kv_pool_tokens: usize,
    pub off: PrefixPassReport,
    pub on: PrefixPassReport,
}

/// Runs `options.workload` with the cache off, then on.
pub fn run_prefix_bench(
    runtime: &Runtime,
    options: &PrefixBenchOptions,
) -> Result<PrefixBenchReport, BenchError> {
    if options.clients == 0 || options.turns == 0 || options.output_tokens == 0 {
        return Err(BenchError::InvalidOptions(
            "clients, turns and output tokens must be at least 1".into(),
        ));
    }
    if !runtime.engine.config().prefix_caching {
        return Err(BenchError::InvalidOptions(
            "the prefix workloads compare the cache off and on; start without --prefix-cache off"
                .into(),
        ));
    }
    let options = &fitted_to_context(options, runtime.engine.config().max_model_len)?;
    // Warm-up outside both passes: page in the weights, grow the scratch buffers.
    let warm = bench_prompt(5000, 64, runtime.config.vocab_size);
    run_one(&runtime.engine, warm, 2, None)?;
    // Each pass is printed as it ends: a run cut short on a slow machine still says something.
    let off = run_pass(runtime, options, false)?;
    eprintln!("prefix cache off: {off:?}");
    let on = run_pass(runtime, options, true)?;
    eprintln!("prefix cache on: {on:?}");
    Ok(PrefixBenchReport {
        workload: match options.workload {
            PrefixWorkload::SharedPrompt => "shared-prompt",
            PrefixWorkload::MultiTurn => "multi-turn",
        },
        clients: options.clients,
        turns: options.turns,
        threads: runtime.threads,
        kv_pool_tokens: runtime.num_blocks * runtime.block_size,
        off,
        on,
    })
}

/// `options` with the system prompt shortened so that the longest request (the last turn of a
/// multi-turn chat) fits the model's context of `max_context` tokens, said on stderr when it
/// changes; an error when not even a 16-token system prompt fits.
fn fitted_to_context(
    options: &PrefixBenchOptions,
    max_context: usize,
) -> Result<PrefixBenchOptions, BenchError> {
    let per_turn = options.user_tokens + options.output_tokens;
    let rest = match options.workload {
        PrefixWorkload::SharedPrompt => per_turn,
        PrefixWorkload::MultiTurn => per_turn.saturating_mul(options.turns),
    };
    let room = max_context.saturating_sub(rest);
    if room >= options.system_tokens {
        return Ok(options.clone());
    }
    const MIN_SYSTEM_TOKENS: usize = 16;
    if room < MIN_SYSTEM_TOKENS {
        return Err(BenchError::InvalidOptions(format!(
            "the model's context of {max_context} tokens cannot hold this workload's requests \
             ({rest} tokens besides the system prompt)"
        )));
    }
    eprintln!(
        "system prompt shortened from {} to {room} tokens to fit the model's context of \
         {max_context}",
        options.system_tokens
    );
    Ok(PrefixBenchOptions {
        system_tokens: room,
        ..options.clone()
    })
}

/// What one request gave back.
struct Outcome {
    ttft: Duration,
    tokens: Vec<u32>,
}

fn run_one(
    engine: &Engine,
    prompt: Vec<u32>,
    max_tokens: usize,
    salt: Option<&str>,
) -> Result<Outcome, BenchError> {
    let mut request = GenerationRequest::greedy(prompt, max_tokens, "bench").ignoring_eos();
    request.cache_salt = salt.map(str::to_owned);
    let submitted = Instant::now();
    let mut handle = engine
        .submit(request)
        .map_err(|e| BenchError::Submit(e.to_string()))?;
    let mut ttft = None;
    let mut tokens = Vec::with_capacity(max_tokens);
    while let Some(event) = handle.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, .. } => {
                ttft.get_or_insert_with(|| submitted.elapsed());
                tokens.push(id);
            }
            TokenEvent::Finished { .. } => break,
            TokenEvent::Error(msg) => return Err(BenchError::Failed(msg)),
        }
    }
    match ttft {
        Some(ttft) if tokens.len() == max_tokens => Ok(Outcome { ttft, tokens }),
        _ => Err(BenchError::ShortOutput {
            got: tokens.len(),
            expected: max_tokens,
        }),
    }
}

fn run_pass(
    runtime: &Runtime,
    options: &PrefixBenchOptions,
    cached: bool,
) -> Result<PrefixPassReport, BenchError> {
    let engine = &runtime.engine;
    let vocab = runtime.config.vocab_size;
    // A different system prompt per pass: the second pass must not find the first's blocks
    // (the off pass fills nothing, but this keeps the passes independent by construction).
    let system = bench_prompt(
        if cached { 7001 } else { 7000 },
        options.system_tokens,
        vocab,
    );
    let salt = cached.then_some("bench");
    let before = engine.stats();
    let done = AtomicBool::new(false);
    let peak = AtomicUsize::new(0);
    let started = Instant::now();
    let results: Vec<Result<Vec<Outcome>, BenchError>> = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            while !done.load(Ordering::Acquire) {
                let running = engine.inspect().iter().filter(|s| s.blocks > 0).count();
                peak.fetch_max(running, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let clients: Vec<_> = (0..options.clients)
            .map(|client| {
                let system = &system;
                scope.spawn(move || {
                    let mut outcomes = Vec::with_capacity(options.turns);
                    let mut conversation = system.clone();
                    for turn in 0..options.turns {
                        let user =
                            bench_prompt(10_000 + client * 100 + turn, options.user_tokens, vocab);
                        let prompt = match options.workload {
                            PrefixWorkload::SharedPrompt => {
                                let mut p = system.clone();
                                p.extend(&user);
                                p
                            }
                            PrefixWorkload::MultiTurn => {
                                conversation.extend(&user);
                                conversation.clone()
                            }
                        };
                        let outcome = run_one(engine, prompt, options.output_tokens, salt)?;
                        if options.workload == PrefixWorkload::MultiTurn {
                            conversation.extend(&outcome.tokens);
                        }
                        outcomes.push(outcome);
                    }
                    Ok(outcomes)
                })
            })
            .collect();
        let results = clients
            .into_iter()
            .map(|c| {
                c.join()
                    .unwrap_or_else(|_| Err(BenchError::Failed("client thread panicked".into())))
            })
            .collect();
        done.store(true, Ordering::Release);
        let _ = sampler.join();
        results
    });
    let wall = started.elapsed();
    let mut ttfts = Vec::new();
    let mut generated = 0usize;
    for result in results {
        for outcome in result? {
            ttfts.push(outcome.ttft.as_secs_f64() * 1e3);
            generated += outcome.tokens.len();
        }
    }
    let after = engine.stats();
    let queries = after.prefix_cache_queries_total - before.prefix_cache_queries_total;
    let hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total;
    let requests = ttfts.len();
    let mut sorted = ttfts.clone();
    sorted.sort_by(f64::total_cmp);
    let p90 = sorted
        .get((sorted.len() * 9 / 10).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0.0);
    Ok(PrefixPassReport {
        prefix_cache: cached,
        requests,
        prompt_tokens: after.prompt_tokens_total - before.prompt_tokens_total,
        prefill_tokens_computed: after.prefill_tokens_computed_total
            - before.prefill_tokens_computed_total,
        hit_rate: if queries == 0 {
            0.0
        } else {
            hits as f64 / queries as f64
        },
        ttft_p50_ms: median(&mut ttfts),
        ttft_p90_ms: p90,
        output_tok_s: generated as f64 / secs(wall),
        wall_s: wall.as_secs_f64(),
        peak_running: peak.load(Ordering::Relaxed),
        preemptions: after.preemptions_total - before.preemptions_total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workload_too_long_for_the_context_is_shortened_to_fit() {
        let shared = PrefixBenchOptions::for_workload(PrefixWorkload::SharedPrompt);
        // 1000 + 24 + 16 fits 2048 as it is, and needs a 984-token system prompt in 1024.
        assert_eq!(fitted_to_context(&shared, 2048).unwrap(), shared);
        assert_eq!(fitted_to_context(&shared, 1024).unwrap().system_tokens, 984);
        // Multi-turn: 8 turns of 40 + 32 tokens leave 1024 - 576 = 448 for the system prompt.
        let chat = PrefixBenchOptions::for_workload(PrefixWorkload::MultiTurn);
        assert_eq!(fitted_to_context(&chat, 1024).unwrap(), chat);
        assert_eq!(fitted_to_context(&chat, 700).unwrap().system_tokens, 124);
        assert!(fitted_to_context(&chat, 590).is_err());
    }

    #[test]
    fn the_documented_workloads_match_the_issue() {
        let shared = PrefixBenchOptions::for_workload(PrefixWorkload::SharedPrompt);
        assert_eq!((shared.clients, shared.system_tokens), (16, 1000));
        let chats = PrefixBenchOptions::for_workload(PrefixWorkload::MultiTurn);
        assert!(chats.turns >= 2, "a multi-turn chat resends earlier turns");
    }
}

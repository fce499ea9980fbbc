//! Batch invariance through the real engine: a sequence's greedy tokens are the same whether
//! it runs alone, inside a batch of 16 mixed-length sequences, or next to sequences that get
//! preempted or cancelled.

mod common;

use common::model_path;
use kvgate_runtime::engine::{GenerationRequest, TokenEvent, generate_blocking};
use kvgate_runtime::loader::{Runtime, RuntimeOptions};

fn runtime(kv_memory_bytes: u64) -> Runtime {
    let opts = RuntimeOptions {
        kv_memory_bytes,
        threads: Some(2),
        ..RuntimeOptions::default()
    };
    Runtime::start(&model_path(), opts).expect("runtime starts")
}

fn request(prompt: Vec<u32>, max_tokens: usize, label: &str) -> GenerationRequest {
    GenerationRequest::greedy(prompt, max_tokens, label).ignoring_eos()
}

fn observed_prompt(rt: &Runtime) -> Vec<u32> {
    rt.tokenizer.encode(
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
        true,
    )
}

/// Mixed-length filler prompts (5..120 tokens).
fn filler(rt: &Runtime, i: usize) -> Vec<u32> {
    let text = "The history of paged memory in operating systems begins with the Atlas computer. "
        .repeat(1 + i % 8);
    let mut ids = rt.tokenizer.encode(&format!("{i}: {text}"), false);
    ids.truncate(5 + (i * 37) % 116);
    ids
}

/// Drains a stream, returning its token ids.
fn collect(mut handle: kvgate_runtime::engine::GenerationHandle) -> Vec<u32> {
    let mut ids = Vec::new();
    while let Some(event) = handle.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, .. } => ids.push(id),
            TokenEvent::Finished { .. } => break,
            TokenEvent::Error(msg) => panic!("generation failed: {msg}"),
        }
    }
    ids
}

#[test]
fn greedy_tokens_do_not_depend_on_the_batch() {
    let rt = runtime(256 << 20);
    let prompt = observed_prompt(&rt);
    let alone = generate_blocking(&rt.engine, request(prompt.clone(), 24, "alone"))
        .expect("alone")
        .tokens;
    assert_eq!(alone.len(), 24);

    // The observed sequence first, then 15 others of mixed lengths, all submitted together.
    let observed = rt
        .engine
        .submit(request(prompt.clone(), 24, "observed"))
        .expect("submit");
    let others: Vec<_> = (0..15)
        .map(|i| {
            rt.engine
                .submit(request(filler(&rt, i), 8 + i * 2, "filler"))
                .expect("submit")
        })
        .collect();
    let batched = collect(observed);
    for (i, h) in others.into_iter().enumerate() {
        assert_eq!(collect(h).len(), 8 + i * 2);
    }
    assert_eq!(batched, alone, "a batch of 16 changed the greedy tokens");
    rt.engine.shutdown();
}

#[test]
fn preempting_or_cancelling_neighbours_does_not_change_a_sequence() {
    // 40 blocks of 16 tokens. The observed sequence holds a reservation for all it needs (as
    // the gateway's admission gives it), so it is never the victim; five ~214-token neighbours (150 prompt + 64)
    // cannot all fit and get preempted (recomputed later).
    let rt = runtime(40 * 16 * 23_040);
    let prompt = observed_prompt(&rt);
    let alone = generate_blocking(&rt.engine, request(prompt.clone(), 40, "alone"))
        .expect("alone")
        .tokens;

    let blocks = (prompt.len() + 40).div_ceil(16);
    let reservation = rt.engine.pool().try_reserve(blocks).expect("pool is empty");
    let mut observed_request = request(prompt.clone(), 40, "observed");
    observed_request.reservation = Some(reservation);
    let observed = rt.engine.submit(observed_request).expect("submit");
    let mut neighbours = (0..5).map(|i| {
        rt.engine
            .submit(request(neighbour_prompt(&rt, i), 64, "neighbour"))
            .expect("submit")
    });
    // Cancel one neighbour once it has produced a token.
    let mut cancelled = neighbours.next().expect("a neighbour");
    while let Some(event) = cancelled.events.blocking_recv() {
        if matches!(event, TokenEvent::Token { .. }) {
            break;
        }
    }
    drop(cancelled);
    let neighbours: Vec<_> = neighbours.collect();
    let got = collect(observed);
    let resumed: Vec<Vec<u32>> = neighbours.into_iter().map(collect).collect();
    for ids in &resumed {
        assert_eq!(ids.len(), 64, "a preempted sequence still finishes");
    }
    let stats = rt.engine.stats();
    assert!(
        stats.preemptions_total > 0,
        "the workload was meant to force preemption: {stats:?}"
    );
    assert!(stats.cancellations_total > 0, "{stats:?}");
    assert_eq!(
        got, alone,
        "preemption or cancellation of neighbours changed the greedy tokens"
    );
    // A preempted sequence recomputes its generated tokens as one chunk, where they were first
    // computed one step each: the same numbers, so it resumes with the tokens it would have
    // produced running alone.
    for (i, ids) in resumed.iter().enumerate() {
        let alone = generate_blocking(
            &rt.engine,
            request(neighbour_prompt(&rt, i + 1), 64, "alone"),
        )
        .expect("alone")
        .tokens;
        assert_eq!(ids, &alone, "neighbour {} after preemption", i + 1);
    }
    rt.engine.shutdown();
}

/// The ~150-token prompt of neighbour `i` of the preemption test.
fn neighbour_prompt(rt: &Runtime, i: usize) -> Vec<u32> {
    let long_text =
        "Paged attention stores the key and value vectors of each sequence in fixed-size blocks. "
            .repeat(20);
    let mut p = rt
        .tokenizer
        .encode(&format!("Neighbour {i}. {long_text}"), false);
    p.truncate(150);
    p
}

/// `request` with the prefix cache on (salt `s`) or off (`None`).
fn salted(prompt: Vec<u32>, max_tokens: usize, salt: Option<&str>) -> GenerationRequest {
    let mut req = request(prompt, max_tokens, "prefix");
    req.cache_salt = salt.map(str::to_owned);
    req
}

#[test]
fn a_cached_prefix_gives_the_same_greedy_tokens_as_recomputing_it() {
    let rt = runtime(256 << 20);
    let block = rt.block_size;
    let chunk = rt.engine.config().long_prefill_threshold;
    let text = "Paged attention stores the key and value vectors of each sequence in fixed-size \
                blocks, so memory is allocated on demand. "
        .repeat(12);
    let base = rt.tokenizer.encode(&text, false);
    assert!(
        base.len() > chunk + 2 * block,
        "the prompt spans a chunk boundary"
    );
    let tail = rt
        .tokenizer
        .encode(" Now something else entirely: a recipe for bread.", false);
    // Fill the cache with the base prompt.
    let first = generate_blocking(&rt.engine, salted(base.clone(), 4, Some("t"))).expect("runs");
    assert_eq!(first.cached_tokens, 0);
    // Shared prefixes ending on block boundaries, on the chunk boundary, one token short of
    // a block, and the whole prompt (its last token is still computed).
    let offsets = [
        block,
        3 * block,
        3 * block - 1,
        chunk,
        chunk - 1,
        base.len(),
    ];
    let mut cached_total = 0;
    for shared in offsets {
        let mut prompt = base[..shared].to_vec();
        if shared < base.len() {
            prompt.extend(&tail);
        }
        let uncached =
            generate_blocking(&rt.engine, salted(prompt.clone(), 16, None)).expect("uncached");
        let cached =
            generate_blocking(&rt.engine, salted(prompt.clone(), 16, Some("t"))).expect("cached");
        assert_eq!(uncached.cached_tokens, 0);
        assert_eq!(
            cached.cached_tokens,
            (shared.min(prompt.len() - 1) / block) * block,
            "shared {shared}"
        );
        assert_eq!(
            cached.tokens, uncached.tokens,
            "cached prefix of {shared} tokens"
        );
        cached_total += cached.cached_tokens;
    }
    assert!(cached_total > 0);

    // A hit that leaves exactly one prompt token to compute (the prompt is whole blocks of
    // the cached one plus one token): that token runs as a step of one, where the uncached
    // prompt computes it inside a chunk.
    for blocks in [1, 3] {
        let prompt = base[..blocks * block + 1].to_vec();
        let uncached =
            generate_blocking(&rt.engine, salted(prompt.clone(), 16, None)).expect("uncached");
        let cached =
            generate_blocking(&rt.engine, salted(prompt.clone(), 16, Some("t"))).expect("cached");
        assert_eq!(cached.cached_tokens, blocks * block);
        assert_eq!(
            cached.tokens, uncached.tokens,
            "a hit leaving one token after {blocks} blocks"
        );
    }

    // The next turn of a conversation: the prompt resends the previous answer, whose blocks
    // were cached as that request generated them one token at a time.
    let turn = generate_blocking(&rt.engine, salted(base[..40].to_vec(), 40, Some("t")))
        .expect("first turn");
    let mut next = base[..40].to_vec();
    next.extend(&turn.tokens);
    next.extend(&tail);
    let uncached = generate_blocking(&rt.engine, salted(next.clone(), 16, None)).expect("uncached");
    let cached =
        generate_blocking(&rt.engine, salted(next.clone(), 16, Some("t"))).expect("cached");
    assert!(
        cached.cached_tokens > 40,
        "the answer's blocks are hit: {}",
        cached.cached_tokens
    );
    assert_eq!(
        cached.tokens, uncached.tokens,
        "the next turn of a conversation"
    );

    // In a mixed batch: cached requests next to uncached fillers, all submitted together.
    let expected = generate_blocking(&rt.engine, salted(base.clone(), 16, None))
        .expect("alone")
        .tokens;
    let observed: Vec<_> = (0..3)
        .map(|_| {
            rt.engine
                .submit(salted(base.clone(), 16, Some("t")))
                .expect("submit")
        })
        .collect();
    let fillers: Vec<_> = (0..5)
        .map(|i| {
            rt.engine
                .submit(request(filler(&rt, i), 8, "filler"))
                .expect("submit")
        })
        .collect();
    for handle in observed {
        assert_eq!(
            collect(handle),
            expected,
            "a cached prefix in a mixed batch"
        );
    }
    for handle in fillers {
        assert_eq!(collect(handle).len(), 8);
    }
    rt.engine.shutdown();
}

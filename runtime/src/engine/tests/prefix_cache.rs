//! Prefix caching through the whole engine: the fake backend reads every context token back
//! through the block table, so a cached block holding anything but the prefix it was found
//! under changes the output or fails the step.

use super::*;

fn cached_config(prefix_caching: bool) -> EngineConfig {
    // Blocks of 4, chunks of 5, budget 8: cached prefixes end on block boundaries that are
    // not chunk boundaries, and the rest of a prompt is chunked.
    EngineConfig {
        prefix_caching,
        ..config(4, 64, 8, 5)
    }
}

fn run(engine: &Engine, prompt: &[u32], label: &str) -> GenerationOutput {
    let req = GenerationRequest::greedy(prompt.to_vec(), 6, label);
    generate_blocking(engine, req).expect("runs")
}

/// `base[..shared]` followed by tokens no cached prompt has.
fn sharing(base: &[u32], shared: usize, len: usize) -> Vec<u32> {
    let mut p = base[..shared].to_vec();
    p.extend(prompt(99, len - shared).iter().map(|t| 1 + (t + 31) % 62));
    p
}

#[test]
fn cached_prefixes_at_every_offset_give_the_uncached_output() {
    let on = start(Mode::Hash, FakeDecoder::letters(), cached_config(true));
    let off = start(Mode::Hash, FakeDecoder::letters(), cached_config(false));
    let base = prompt(1, 24);
    let first = run(&on, &base, "t");
    assert_eq!(first.cached_tokens, 0, "nothing cached yet");
    // (shared prefix, prompt length, cached tokens expected): block boundaries, the chunk
    // boundary (5), one token short of a block (7, 11), and the whole prompt again, whose
    // last token must still be computed (24 → 20, and 8 of 8 → 4).
    let cases = [
        (4, 12, 4),
        (8, 12, 8),
        (5, 12, 4),
        (7, 12, 4),
        (11, 16, 8),
        (23, 24, 20),
        (24, 24, 20),
        (8, 8, 4),
        (3, 12, 0),
    ];
    for (shared, len, cached) in cases {
        let p = sharing(&base, shared, len);
        let with_cache = run(&on, &p, "t");
        let without = run(&off, &p, "t");
        let reference = reference_greedy(&p, 6);
        assert_eq!(with_cache.tokens, reference, "shared {shared} of {len}");
        assert_eq!(without.tokens, reference, "shared {shared} of {len}");
        assert_eq!(with_cache.cached_tokens, cached, "shared {shared} of {len}");
        assert_eq!(without.cached_tokens, 0);
    }
    let stats = on.stats();
    assert!(stats.prefix_cache_hits_total >= 64);
    assert!(stats.prefix_cache_queries_total > stats.prefix_cache_hits_total);
    assert_eq!(off.stats().prefix_cache_queries_total, 0);
    assert!(
        stats.prefill_tokens_computed_total < off.stats().prefill_tokens_computed_total,
        "cached tokens are not computed"
    );
    // Everything is back; cached blocks count as free.
    let occ = on.pool().snapshot();
    assert_eq!((occ.used_blocks, occ.free_blocks), (0, 64));
    assert!(occ.cached_blocks > 0);
}

#[test]
fn mixed_batches_share_blocks_in_use_and_a_resent_answer_is_cached_once_computed_as_prompt() {
    let engine = start(Mode::Hash, FakeDecoder::letters(), cached_config(true));
    let base = prompt(2, 20);
    // Several prompts sharing prefixes of different lengths, with unrelated ones, at once:
    // later ones hit blocks earlier ones registered while they still run.
    let prompts: Vec<Vec<u32>> = vec![
        base.clone(),
        sharing(&base, 16, 22),
        prompt(3, 9),
        sharing(&base, 9, 13),
        base.clone(),
        prompt(4, 17),
        sharing(&base, 19, 21),
    ];
    let mut handles: Vec<GenerationHandle> = prompts
        .iter()
        .map(|p| engine.submit(request(p.clone(), 7)).expect("accepted"))
        .collect();
    for (p, handle) in prompts.iter().zip(&mut handles) {
        assert_eq!(tokens_of(&collect(handle)), reference_greedy(p, 7));
    }
    // A second turn resends the conversation. Blocks filled while decoding are not cached
    // (their tokens were computed in the decode order; as prompt they take the prompt order,
    // see `Scheduler::postprocess`): only the first turn's 20 prompt tokens (5 blocks) hit.
    let answer = reference_greedy(&base, 7);
    let mut turn = base.clone();
    turn.extend(&answer);
    turn.extend(prompt(5, 6));
    let second = run(&engine, &turn, "test");
    assert_eq!(second.tokens, reference_greedy(&turn, 6));
    assert_eq!(second.cached_tokens, 20);
    // Computed as this turn's prompt, the answer's blocks now serve the next request.
    let again = run(&engine, &turn, "test");
    assert_eq!(again.tokens, second.tokens);
    assert_eq!(again.cached_tokens, (turn.len() - 1) / 4 * 4);
}

#[test]
fn tenants_do_not_share_a_salted_prefix() {
    let engine = start(Mode::Hash, FakeDecoder::letters(), cached_config(true));
    let p = prompt(6, 17);
    assert_eq!(run(&engine, &p, "a").cached_tokens, 0);
    assert_eq!(run(&engine, &p, "b").cached_tokens, 0, "another salt");
    assert_eq!(run(&engine, &p, "a").cached_tokens, 16);
    let mut unsalted = GenerationRequest::greedy(p.clone(), 6, "a");
    unsalted.cache_salt = None;
    let out = generate_blocking(&engine, unsalted).expect("runs");
    assert_eq!(out.cached_tokens, 0, "no salt: no cache");
    assert_eq!(out.tokens, reference_greedy(&p, 6));
}

#[test]
fn preempted_sequences_recompute_through_the_cache() {
    // 10 blocks of 4; four 14-token prompts sharing 12 tokens, 12 tokens each to generate:
    // they cannot all grow at once, so some are preempted and come back through the cache.
    let engine = start(
        Mode::Hash,
        FakeDecoder::letters(),
        EngineConfig {
            prefix_caching: true,
            ..config(4, 10, 32, 0)
        },
    );
    let base = prompt(7, 14);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| sharing(&base, 12 + i % 2, 14)).collect();
    let mut handles: Vec<GenerationHandle> = prompts
        .iter()
        .map(|p| engine.submit(request(p.clone(), 12)).expect("accepted"))
        .collect();
    for (p, handle) in prompts.iter().zip(&mut handles) {
        assert_eq!(tokens_of(&collect(handle)), reference_greedy(p, 12));
    }
    let stats = engine.stats();
    assert!(
        stats.preemptions_total > 0,
        "the pool was too small not to preempt"
    );
    let occ = engine.pool().snapshot();
    assert_eq!(
        (occ.used_blocks, occ.reserved_blocks, occ.free_blocks),
        (0, 0, 10)
    );
}

//! Scheduler behaviour without a backend: steps are simulated by `postprocess` with made-up
//! sampled tokens, and sequences finish when they reach prompt + max_tokens.

use std::collections::HashSet;

use proptest::prelude::*;
use tokio::sync::mpsc;

use super::*;
use crate::block_pool::Reservation;
use crate::sequence::{SamplingParams, SeqId, StopParams, TokenEvent};

fn config(
    block_size: usize,
    max_num_seqs: usize,
    budget: usize,
    threshold: usize,
) -> SchedulerConfig {
    SchedulerConfig {
        block_size,
        max_num_seqs,
        max_batched_tokens: budget,
        long_prefill_threshold: threshold,
    }
}

fn seq(
    id: u64,
    prompt: usize,
    max_tokens: usize,
    credit: Reservation,
) -> (Sequence, mpsc::Receiver<TokenEvent>) {
    let (tx, rx) = mpsc::channel(max_tokens + 4);
    let stop = StopParams {
        max_tokens,
        ..StopParams::default()
    };
    let prompt = (0..prompt as u32).collect();
    let seq = Sequence::new(
        SeqId(id),
        "t".into(),
        prompt,
        SamplingParams::default(),
        stop,
        credit,
        tx,
    );
    (seq, rx)
}

/// Runs one step: schedule, "sample" token 7 for every sequence needing logits, finish those at
/// their length limit. Returns the batch.
fn step(s: &mut Scheduler) -> ScheduledBatch {
    let mut batch = ScheduledBatch::default();
    s.schedule(&mut batch);
    let sampled = vec![7; batch.seqs.iter().filter(|e| e.needs_logits).count()];
    s.postprocess(&batch, &sampled);
    for seq in s.running_mut() {
        if seq.num_output_tokens() >= seq.stop.max_tokens {
            seq.status = SeqStatus::Finished;
        }
    }
    let mut done = Vec::new();
    s.take_finished(&mut done);
    batch
}

#[test]
fn long_prompt_is_chunked_and_decodes_ride_along() {
    let pool = BlockPool::new(64, 4, 1);
    let mut s = Scheduler::new(config(4, 8, 10, 6), pool.clone());
    let (a, _ra) = seq(1, 3, 5, pool.empty_reservation());
    s.add(a);
    let first = step(&mut s);
    assert_eq!(first.seqs[0].num_tokens, 3, "short prompt in one go");
    let (b, _rb) = seq(2, 20, 2, pool.empty_reservation());
    s.add(b);
    let second = step(&mut s);
    // Running decode first (1 token), then the long prompt capped by the threshold (6).
    assert_eq!(second.seqs.len(), 2);
    assert_eq!(
        (second.seqs[0].num_tokens, second.seqs[0].needs_logits),
        (1, true)
    );
    assert_eq!((second.seqs[1].start, second.seqs[1].num_tokens), (0, 6));
    assert!(
        !second.seqs[1].needs_logits,
        "mid-prompt chunk samples nothing"
    );
    let third = step(&mut s);
    assert_eq!(
        third.seqs[1].start, 6,
        "next chunk continues where the last ended"
    );
    assert!(third.num_tokens <= 10);
}

#[test]
fn budget_and_max_num_seqs_are_respected() {
    let pool = BlockPool::new(64, 4, 1);
    let mut s = Scheduler::new(config(4, 2, 5, 0), pool.clone());
    let mut receivers = Vec::new();
    for id in 0..4 {
        let (q, rx) = seq(id, 4, 3, pool.empty_reservation());
        receivers.push(rx);
        s.add(q);
    }
    let batch = step(&mut s);
    assert_eq!(s.running().len(), 2);
    assert_eq!(batch.num_tokens, 5, "4 + first token of the second prompt");
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn preemption_picks_the_least_computed_and_requeues_it_first() {
    // 4 blocks of 2 tokens. Three sequences fill the pool; growth forces a preemption.
    let pool = BlockPool::new(4, 2, 1);
    let mut s = Scheduler::new(config(2, 8, 64, 0), pool.clone());
    let (a, _ra) = seq(1, 3, 4, pool.empty_reservation()); // 2 blocks
    let (b, _rb) = seq(2, 2, 4, pool.empty_reservation()); // 1 block
    let (c, _rc) = seq(3, 2, 4, pool.empty_reservation()); // 1 block
    s.add(a);
    s.add(b);
    s.add(c);
    step(&mut s);
    assert_eq!(s.running().len(), 3);
    assert_eq!(pool.snapshot().free_blocks, 0);
    // Next step: a (4 tokens, fits block 2) ok; b needs a block: victim is the least computed
    // (b and c have 2 computed each; c is newer).
    let batch = step(&mut s);
    assert_eq!(batch.num_preempted, 1);
    let waiting: Vec<SeqId> = s.waiting().map(|q| q.id).collect();
    assert_eq!(waiting, vec![SeqId(3)]);
    let c = s.waiting().next().expect("c waits");
    assert_eq!(
        (c.num_computed_tokens, c.status, c.block_table.len()),
        (0, SeqStatus::Preempted, 0)
    );
    assert_eq!(c.len(), 3, "its generated token is kept for recompute");
    assert_eq!(s.preemptions_total(), 1);
}

#[test]
fn fully_reserved_sequences_are_not_victims_while_others_exist() {
    let pool = BlockPool::new(4, 2, 1);
    let mut s = Scheduler::new(config(2, 8, 64, 0), pool.clone());
    // r: 2-token prompt, 3 max tokens → at most 4 KV tokens = 2 blocks, all reserved.
    // u: at most 5 KV tokens = 3 blocks, unreserved. Together they need 5 of 4 blocks.
    let (r, _rr) = seq(1, 2, 3, pool.try_reserve(2).expect("free"));
    let (u, _ru) = seq(2, 3, 3, pool.empty_reservation());
    s.add(u);
    s.add(r);
    step(&mut s);
    // u fills the free blocks; when it needs a third, r is newer and less computed but its
    // reservation covers it, so u preempts itself instead.
    let mut steps = 0;
    while s.has_work() {
        step(&mut s);
        assert!(
            s.waiting().all(|q| q.id != SeqId(1)),
            "the reserved sequence was preempted"
        );
        steps += 1;
        assert!(steps < 100, "no progress");
    }
    assert!(s.preemptions_total() >= 1, "u had to give way");
}

#[test]
fn partial_credits_cannot_deadlock() {
    // Two sequences each reserved 2 of 4 blocks but need 3: one must give way.
    let pool = BlockPool::new(4, 2, 1);
    let mut s = Scheduler::new(config(2, 8, 64, 0), pool.clone());
    let (a, _ra) = seq(1, 4, 3, pool.try_reserve(2).expect("free"));
    let (b, _rb) = seq(2, 4, 3, pool.try_reserve(2).expect("free"));
    s.add(a);
    s.add(b);
    let mut steps = 0;
    while s.has_work() {
        step(&mut s);
        steps += 1;
        assert!(steps < 100, "no progress");
    }
    let occ = pool.snapshot();
    assert_eq!(
        (occ.used_blocks, occ.reserved_blocks, occ.free_blocks),
        (0, 0, 4)
    );
}

#[test]
fn waiting_head_blocks_free_blocks_but_not_self_reserved_requests() {
    let pool = BlockPool::new(4, 2, 1);
    let mut s = Scheduler::new(config(2, 8, 64, 0), pool.clone());
    let held = pool.try_reserve(1).expect("free"); // someone else's reservation
    let (hog, _rh) = seq(1, 4, 2, pool.empty_reservation());
    s.add(hog);
    step(&mut s); // hog: 2 blocks, 1 free left
    let (head, _r1) = seq(2, 4, 2, pool.empty_reservation()); // needs 2 free: blocked
    // Partly reserved (needs 2 blocks, holds 1) but its first chunk fits its credit.
    let (reserved, _r2) = seq(3, 2, 3, held);
    s.add(head);
    s.add(reserved);
    let mut batch = ScheduledBatch::default();
    s.schedule(&mut batch);
    let ids: Vec<SeqId> = batch.seqs.iter().map(|e| s.running()[e.index].id).collect();
    assert!(
        ids.contains(&SeqId(3)),
        "credit-backed request passes the blocked head"
    );
    assert!(!ids.contains(&SeqId(2)));
}

/// A workload step for the property test: new requests arrive, optionally with reservations.
#[derive(Debug, Clone)]
struct Arrival {
    prompt: usize,
    max_tokens: usize,
    reserve: bool,
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (1..20usize, 1..12usize, any::<bool>()).prop_map(|(prompt, max_tokens, reserve)| Arrival {
        prompt,
        max_tokens,
        reserve,
    })
}

proptest! {
    #[test]
    fn random_workloads_keep_invariants_and_finish(
        block_size in 1..5usize,
        extra_blocks in 0..12usize,
        max_num_seqs in 1..6usize,
        budget in 1..24usize,
        threshold in 0..8usize,
        arrivals in prop::collection::vec(prop::collection::vec(arrival(), 0..3), 1..12),
    ) {
        // The pool always fits the largest single request (as the engine's submit check ensures).
        let total = (20 + 12usize).div_ceil(block_size) + extra_blocks;
        let pool = BlockPool::new(total, block_size, 1);
        let cfg = config(block_size, max_num_seqs, budget, threshold);
        let mut s = Scheduler::new(cfg, pool.clone());
        let mut receivers = Vec::new();
        let mut next_id = 0;
        let mut rounds = arrivals.into_iter();
        let mut steps = 0;
        loop {
            for a in rounds.next().unwrap_or_default() {
                let needed = blocks_for_tokens(a.prompt + a.max_tokens, block_size);
                let credit = if a.reserve { pool.try_reserve(needed) } else { None };
                let credit = credit.unwrap_or_else(|| pool.empty_reservation());
                let (q, rx) = seq(next_id, a.prompt, a.max_tokens, credit);
                next_id += 1;
                receivers.push(rx);
                s.add(q);
            }
            let mut batch = ScheduledBatch::default();
            s.schedule(&mut batch);
            prop_assert!(batch.num_tokens <= budget);
            prop_assert!(s.running().len() <= max_num_seqs);
            let mut seen = HashSet::new();
            let mut held = 0;
            for q in s.running() {
                for &b in &q.block_table {
                    prop_assert!(seen.insert(b), "block {} shared", b);
                }
                held += q.block_table.len();
                let covered = q.num_computed_tokens + q.num_scheduled_tokens;
                prop_assert!(q.block_table.len() >= blocks_for_tokens(covered, block_size));
                if threshold > 0 {
                    prop_assert!(q.num_scheduled_tokens <= threshold);
                }
            }
            for q in s.waiting() {
                prop_assert!(q.block_table.is_empty() && q.num_computed_tokens == 0);
            }
            let occ = pool.snapshot();
            prop_assert_eq!(occ.used_blocks, held);
            prop_assert_eq!(occ.used_blocks + occ.reserved_blocks + occ.free_blocks, total);
            let sampled = vec![3; batch.seqs.iter().filter(|e| e.needs_logits).count()];
            s.postprocess(&batch, &sampled);
            for q in s.running_mut() {
                if q.num_output_tokens() >= q.stop.max_tokens {
                    q.status = SeqStatus::Finished;
                }
            }
            let mut done = Vec::new();
            s.take_finished(&mut done);
            steps += 1;
            if !s.has_work() && rounds.len() == 0 {
                break;
            }
            prop_assert!(steps < 2000, "workload did not drain");
        }
        let occ = pool.snapshot();
        prop_assert_eq!((occ.used_blocks, occ.reserved_blocks), (0, 0));
    }
}

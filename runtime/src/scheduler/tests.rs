//! Scheduler behaviour without a backend: steps are simulated by `postprocess` with made-up
//! sampled tokens, and sequences finish when they reach prompt + max_tokens.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::time::Duration;

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
        target_step_time: None,
        prefill_order: PrefillOrder::TenantFair,
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

/// A sequence of `tenant` with fair-share `weight`.
fn tenant_seq(
    id: u64,
    tenant: &str,
    weight: u32,
    prompt: usize,
    max_tokens: usize,
    credit: Reservation,
) -> (Sequence, mpsc::Receiver<TokenEvent>) {
    let (mut q, rx) = seq(id, prompt, max_tokens, credit);
    q.label = tenant.into();
    q.weight = NonZeroU32::new(weight).unwrap_or(NonZeroU32::MIN);
    (q, rx)
}

/// Prompt (non-decode) tokens each tenant got in `batch`.
fn prefill_by_tenant(s: &Scheduler, batch: &ScheduledBatch) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for e in &batch.seqs {
        let q = &s.running()[e.index];
        if !q.is_decoding() {
            *out.entry(q.label.to_string()).or_insert(0) += e.num_tokens;
        }
    }
    out
}

/// Runs one step: schedule, "sample" token 7 for every sequence needing logits, finish those at
/// their length limit. Returns the batch.
fn step(s: &mut Scheduler) -> ScheduledBatch {
    let mut batch = ScheduledBatch::default();
    s.schedule(&mut batch);
    finish_step(s, &batch);
    batch
}

/// The second half of [`step`], for tests that inspect a batch between scheduling and
/// postprocessing.
fn finish_step(s: &mut Scheduler, batch: &ScheduledBatch) {
    let sampled = vec![7; batch.seqs.iter().filter(|e| e.needs_logits).count()];
    s.postprocess(batch, &sampled);
    for seq in s.running_mut() {
        if seq.num_output_tokens() >= seq.stop.max_tokens {
            seq.status = SeqStatus::Finished;
        }
    }
    let mut done = Vec::new();
    s.take_finished(&mut done);
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

/// Ten sequences decoding (prompt of 4, long outputs) in a scheduler with `target`, and the
/// cost model `cost`.
fn decoding_scheduler(
    pool: &Arc<BlockPool>,
    target: Option<Duration>,
    cost: StepCost,
) -> (Scheduler, Vec<mpsc::Receiver<TokenEvent>>) {
    let mut cfg = config(4, 16, 512, 0);
    cfg.target_step_time = target;
    let mut s = Scheduler::new(cfg, pool.clone());
    s.set_cost_model(StepCostModel::with_cost(cost));
    let mut receivers = Vec::new();
    for id in 0..10 {
        let (q, rx) = seq(id, 4, 1000, pool.empty_reservation());
        receivers.push(rx);
        s.add(q);
    }
    step(&mut s);
    assert!(s.running().iter().all(Sequence::is_decoding));
    (s, receivers)
}

const CPU_COST: StepCost = StepCost {
    per_step_us: 5000.0,
    per_prefill_token_us: 1000.0,
    per_decode_seq_us: 2000.0,
    per_attended_token_ns: 0.0,
};

/// [`decoding_scheduler`] at [`CPU_COST`] with one new prompt of `prompt` tokens (sequence
/// 100) added; the receivers keep every sequence's stream open.
fn decoding_with_prompt(
    pool: &Arc<BlockPool>,
    target: Option<Duration>,
    prompt: usize,
) -> (Scheduler, Vec<mpsc::Receiver<TokenEvent>>) {
    let (mut s, mut receivers) = decoding_scheduler(pool, target, CPU_COST);
    let (q, rx) = seq(100, prompt, 4, pool.empty_reservation());
    receivers.push(rx);
    s.add(q);
    (s, receivers)
}

#[test]
fn prefill_cap_follows_the_cost_model() {
    let pool = BlockPool::new(4096, 4, 1);
    let target = Some(Duration::from_millis(100));
    let (mut s, _rx) = decoding_with_prompt(&pool, target, 2000);
    let batch = step(&mut s);
    // 5 ms + 10 decodes × 2 ms = 25 ms; the other 75 ms buy 75 prompt tokens at 1 ms each.
    assert_eq!(batch.prefill_cap, 75);
    assert_eq!(batch.num_tokens, 10 + 75);
    assert_eq!(batch.shape.decode_seqs, 10);
    assert_eq!(batch.shape.prefill_tokens, 75);

    // Twice the cost per prompt token: half the tokens.
    s.set_cost_model(StepCostModel::with_cost(StepCost {
        per_prefill_token_us: 2000.0,
        ..CPU_COST
    }));
    let batch = step(&mut s);
    assert_eq!((batch.prefill_cap, batch.shape.prefill_tokens), (37, 37));

    // The model learns from measured steps: on a machine 3× slower than the given model, after
    // a mix of steps (prompts alone, decodes alone, both), the cap is a third as large.
    let slow = |shape: &StepShape| {
        let ms = 15.0 + 3.0 * shape.prefill_tokens as f64 + 6.0 * shape.decode_seqs as f64;
        Duration::from_secs_f64(ms / 1e3)
    };
    let mut s2 = decoding_scheduler(&pool, target, CPU_COST).0;
    let (long, _rl2) = seq(200, 4000, 4, pool.empty_reservation());
    s2.add(long);
    let mut batch = ScheduledBatch::default();
    s2.schedule(&mut batch);
    assert_eq!(
        batch.prefill_cap, 75,
        "before any measurement: the given model"
    );
    for i in 0..80 {
        let mut measured = ScheduledBatch::default();
        measured.shape.add_prefill(0, (i * 37) % 200);
        for _ in 0..(i * 7) % 13 {
            measured.shape.add_decode(30);
        }
        s2.observe_step(&measured, slow(&measured.shape));
    }
    let sampled = vec![7; batch.seqs.iter().filter(|e| e.needs_logits).count()];
    s2.postprocess(&batch, &sampled);
    s2.schedule(&mut batch);
    // (100 − 15 − 10 × 6) / 3 = 8.3.
    assert!(
        (7..=9).contains(&batch.prefill_cap),
        "{} {:?}",
        batch.prefill_cap,
        s2.cost_model().cost()
    );
    assert_eq!(batch.shape.prefill_tokens, batch.prefill_cap);
}

#[test]
fn a_whole_prompt_just_over_the_cap_stretches_it_to_finish_in_one_step() {
    let pool = BlockPool::new(4096, 4, 1);
    let target = Some(Duration::from_millis(100));
    // The cap is 75 (see prefill_cap_follows_the_cost_model); 75 + 75 / 4 = 93.
    let (mut s, _rx) = decoding_with_prompt(&pool, target, 93);
    let batch = step(&mut s);
    assert_eq!((batch.prefill_cap, batch.shape.prefill_tokens), (93, 93));
    let first_token = batch
        .seqs
        .iter()
        .find(|e| e.num_tokens == 93)
        .expect("scheduled");
    assert!(
        first_token.needs_logits,
        "its first token comes from this step"
    );

    // One token more: no stretch, the prompt takes two steps.
    let (mut s, _rx) = decoding_with_prompt(&pool, target, 94);
    let batch = step(&mut s);
    assert_eq!((batch.prefill_cap, batch.shape.prefill_tokens), (75, 75));

    // A prompt under way never stretches a step, even when its rest would fit: 160 tokens
    // leave 85 after the first step, within 93, but the cap stays.
    let (mut s, _rx) = decoding_with_prompt(&pool, target, 160);
    let batch = step(&mut s);
    assert_eq!(batch.shape.prefill_tokens, 75);
    let batch = step(&mut s);
    assert_eq!((batch.prefill_cap, batch.shape.prefill_tokens), (75, 75));

    // Without a target nothing is capped, so nothing stretches past the budget.
    let (mut s, _rx) = decoding_with_prompt(&pool, None, 600);
    let batch = step(&mut s);
    assert_eq!((batch.prefill_cap, batch.num_tokens), (502, 512));
}

#[test]
fn prefill_gets_the_whole_budget_when_nothing_decodes_or_without_a_target() {
    let pool = BlockPool::new(4096, 4, 1);
    let mut cfg = config(4, 16, 512, 0);
    cfg.target_step_time = Some(Duration::from_millis(10));
    let mut s = Scheduler::new(cfg, pool.clone());
    s.set_cost_model(StepCostModel::with_cost(CPU_COST));
    let (long, _rl) = seq(1, 2000, 4, pool.empty_reservation());
    s.add(long);
    let batch = step(&mut s);
    assert_eq!((batch.prefill_cap, batch.num_tokens), (512, 512));

    let (mut s, _rx) = decoding_with_prompt(&pool, None, 2000);
    let batch = step(&mut s);
    assert_eq!((batch.prefill_cap, batch.num_tokens), (502, 512));

    // Decodes alone over the target: prefill still moves, one block a step.
    let target = Some(Duration::from_millis(20));
    let (mut s, _rx) = decoding_with_prompt(&pool, target, 2000);
    let batch = step(&mut s);
    assert_eq!((batch.prefill_cap, batch.shape.prefill_tokens), (4, 4));
}

#[test]
fn weighted_shares_over_many_steps_match_the_weights() {
    let pool = BlockPool::new(8192, 16, 1);
    let mut s = Scheduler::new(config(16, 64, 96, 0), pool.clone());
    let weights = [("gold", 3u32), ("silver", 2), ("bronze", 1)];
    let mut receivers = Vec::new();
    let mut next_id = 0;
    let mut totals: HashMap<String, usize> = HashMap::new();
    for n in 0..600 {
        // Keep every tenant backlogged with prompts of varied length.
        for (tenant, weight) in weights {
            while s.waiting().filter(|q| &*q.label == tenant).count() < 3 {
                let prompt = 20 + (next_id as usize * 37) % 300;
                let (q, rx) =
                    tenant_seq(next_id, tenant, weight, prompt, 1, pool.empty_reservation());
                next_id += 1;
                receivers.push(rx);
                s.add(q);
            }
        }
        let mut batch = ScheduledBatch::default();
        s.schedule(&mut batch);
        assert_eq!(batch.num_tokens, 96, "step {n} leaves budget idle");
        for (tenant, tokens) in prefill_by_tenant(&s, &batch) {
            *totals.entry(tenant).or_insert(0) += tokens;
        }
        finish_step(&mut s, &batch);
    }
    let all: usize = totals.values().sum();
    for (tenant, weight) in weights {
        let share = totals[tenant] as f64 / all as f64;
        let expected = f64::from(weight) / 6.0;
        assert!(
            (share - expected).abs() <= 0.05 * expected,
            "{tenant}: {share:.4} of the prompt tokens, weight share {expected:.4} ({totals:?})"
        );
    }
}

#[test]
fn a_short_prompt_is_not_stuck_behind_another_tenants_long_ones() {
    let steps_to_first_token = |order: PrefillOrder| {
        let pool = BlockPool::new(4096, 16, 1);
        let mut cfg = config(16, 64, 64, 0);
        cfg.prefill_order = order;
        let mut s = Scheduler::new(cfg, pool.clone());
        let mut receivers = Vec::new();
        for id in 0..5 {
            let (q, rx) = tenant_seq(id, "flood", 3, 400, 8, pool.empty_reservation());
            receivers.push(rx);
            s.add(q);
        }
        step(&mut s);
        let (chat, _rc) = tenant_seq(99, "chat", 2, 40, 8, pool.empty_reservation());
        s.add(chat);
        for n in 1..200 {
            step(&mut s);
            let chat = s.running().iter().find(|q| q.id == SeqId(99));
            if chat.is_some_and(|q| q.num_output_tokens() > 0) {
                return n;
            }
        }
        panic!("the chat never got its first token");
    };
    // Weight 2 of 5 is 25 of each 64-token step, but the whole 40-token prompt fits in one:
    // it borrows the other 15 from the flood (repaid from its later shares, see fair.rs), so
    // its first token comes after one step, not two.
    assert_eq!(steps_to_first_token(PrefillOrder::TenantFair), 1);
    assert!(steps_to_first_token(PrefillOrder::Fcfs) >= 25);
}

#[test]
fn a_long_prompt_is_not_starved_by_a_stream_of_short_ones() {
    // Within one tenant the shortest prefill goes first, so three new 8-token prompts per step
    // would take a 24-token budget forever; aging lets the long prompt through.
    let pool = BlockPool::new(16384, 8, 1);
    let mut s = Scheduler::new(config(8, 256, 24, 0), pool.clone());
    let (long, _rl) = seq(0, 400, 1, pool.empty_reservation());
    s.add(long);
    let mut receivers = Vec::new();
    let mut next_id = 1;
    let mut finished_at = None;
    for n in 0..200 {
        for _ in 0..3 {
            let (q, rx) = seq(next_id, 8, 1, pool.empty_reservation());
            next_id += 1;
            receivers.push(rx);
            s.add(q);
        }
        let mut batch = ScheduledBatch::default();
        s.schedule(&mut batch);
        let long_done = batch
            .seqs
            .iter()
            .any(|e| e.needs_logits && s.running()[e.index].id == SeqId(0));
        finish_step(&mut s, &batch);
        if long_done {
            finished_at = Some(n);
            break;
        }
    }
    // Passed by shorter prompts for (400 − 8) / 16 ≈ 25 steps, then 400 / 24 ≈ 17 steps alone.
    let finished_at = finished_at.expect("the long prompt finished");
    assert!(finished_at <= 45, "took {finished_at} steps");
    assert!(
        finished_at >= 17,
        "it cannot beat the budget: {finished_at}"
    );
}

#[test]
fn preemption_and_cancellation_free_blocks_under_tenant_fair_prefill() {
    // A pool far too small for everyone: sequences are preempted and recomputed, some are
    // cancelled mid-flight; at the end every block and reservation is back.
    let pool = BlockPool::new(24, 4, 1);
    let mut cfg = config(4, 8, 32, 12);
    cfg.target_step_time = Some(Duration::from_millis(30));
    let mut s = Scheduler::new(cfg, pool.clone());
    s.set_cost_model(StepCostModel::with_cost(CPU_COST));
    let mut receivers = Vec::new();
    for id in 0..12u64 {
        let tenant = ["a", "b", "c"][id as usize % 3];
        let credit = if id % 4 == 0 {
            pool.try_reserve(3)
                .unwrap_or_else(|| pool.empty_reservation())
        } else {
            pool.empty_reservation()
        };
        let (q, rx) = tenant_seq(
            id,
            tenant,
            1 + id as u32 % 3,
            10 + id as usize * 3,
            20,
            credit,
        );
        receivers.push(rx);
        s.add(q);
    }
    let mut cancelled = Vec::new();
    let mut steps = 0;
    while s.has_work() {
        step(&mut s);
        steps += 1;
        if steps % 7 == 0 {
            let victim = SeqId(steps / 7 * 2);
            s.remove_where(|q| q.id == victim, &mut cancelled);
        }
        let occ = pool.snapshot();
        let held: usize = s.running().iter().map(|q| q.block_table.len()).sum();
        assert_eq!(occ.used_blocks, held);
        assert!(steps < 5000, "no progress");
    }
    assert!(
        s.preemptions_total() > 0,
        "the pool was meant to be too small"
    );
    assert!(!cancelled.is_empty());
    let occ = pool.snapshot();
    assert_eq!(
        (occ.used_blocks, occ.reserved_blocks, occ.free_blocks),
        (0, 0, 24)
    );
}

/// A sequence of tenant "t" whose prompt is `0..prompt` except from `diverge_at` on, where
/// it is `base + i` (so sequences with one `base` share a prompt), cached under `salt`.
fn salted_seq(
    id: u64,
    prompt: usize,
    diverge_at: usize,
    base: u32,
    salt: &str,
    pool: &Arc<BlockPool>,
) -> (Sequence, mpsc::Receiver<TokenEvent>) {
    let (mut q, rx) = seq(id, prompt, 2, pool.empty_reservation());
    for (i, t) in q.token_ids.iter_mut().enumerate().skip(diverge_at) {
        *t = base + i as u32;
    }
    q.cache_salt = Some(salt.into());
    (q, rx)
}

/// True when `batch` prefills some running sequence cached under `salt`: the only thing a
/// sequence may be held back behind.
fn prefills_salt(s: &Scheduler, batch: &ScheduledBatch, salt: &str) -> bool {
    batch.seqs.iter().any(|e| {
        let q = &s.running()[e.index];
        !q.is_decoding() && q.cache_salt.as_deref() == Some(salt)
    })
}

/// Prompt tokens computed for sequence `id` in `batch` (0 if not scheduled or decoding).
fn prefill_of(s: &Scheduler, batch: &ScheduledBatch, id: u64) -> usize {
    batch
        .seqs
        .iter()
        .map(|e| (&s.running()[e.index], e.num_tokens))
        .filter(|(q, _)| q.id == SeqId(id) && !q.is_decoding())
        .map(|(_, n)| n)
        .sum()
}

#[test]
fn a_shared_prefix_is_held_back_until_computed_then_hit() {
    // A and B share their first 24 tokens (6 blocks of 4) and arrive together; the step has
    // room for both (budget 16, chunks of 8), but B waits while A computes the shared blocks,
    // then takes all 6 from the cache and computes only its own 6 tokens.
    let pool = BlockPool::new(64, 4, 1);
    let mut s = Scheduler::new(config(4, 8, 16, 8), pool.clone());
    let (a, _ra) = salted_seq(1, 30, 30, 0, "t", &pool);
    let (b, _rb) = salted_seq(2, 30, 24, 500, "t", &pool);
    s.add(a);
    s.add(b);
    let mut b_prefill = 0;
    let mut deferred_steps = 0;
    for _ in 0..20 {
        let mut batch = ScheduledBatch::default();
        s.schedule(&mut batch);
        if s.waiting().any(|q| q.id == SeqId(2)) {
            deferred_steps += 1;
            assert!(
                s.waiting().all(|q| q.block_table.is_empty()),
                "a deferred sequence keeps no pinned blocks"
            );
            assert_eq!(prefill_of(&s, &batch, 1), 8, "A computes meanwhile");
        }
        b_prefill += prefill_of(&s, &batch, 2);
        finish_step(&mut s, &batch);
        if !s.has_work() {
            break;
        }
    }
    assert!(!s.has_work(), "both finished");
    // A computes tokens 0..8, 8..16, 16..24 in steps 1-3; B is admitted in step 4.
    assert_eq!(deferred_steps, 3);
    assert_eq!(s.holdbacks_total(), 3);
    assert_eq!(b_prefill, 6, "B computed only its own tail");
    assert_eq!(s.prefix_cache_tokens(), (60, 24));
}

#[test]
fn a_reservation_beyond_what_a_shared_prefix_leaves_to_draw_goes_back_at_admission() {
    // A and B share their first 24 tokens (6 blocks of 4) and each reserved its whole request
    // (30 + 2 - 1 KV tokens: 8 blocks), as the gateway does when nothing is cached yet. B waits
    // while A computes the shared blocks, then finds them cached and in use: it draws only its
    // own 2 blocks, so the 6 it reserved for the prefix go back to the pool when it starts.
    let pool = BlockPool::new(64, 4, 1);
    let mut s = Scheduler::new(config(4, 8, 16, 8), pool.clone());
    let (mut a, _ra) = salted_seq(1, 30, 30, 0, "t", &pool);
    let (mut b, _rb) = salted_seq(2, 30, 24, 500, "t", &pool);
    a.credit = pool.try_reserve(8).expect("free");
    b.credit = pool.try_reserve(8).expect("free");
    s.add(a);
    s.add(b);
    while s.waiting().any(|q| q.id == SeqId(2)) {
        let batch = step(&mut s);
        assert!(!batch.seqs.is_empty(), "no progress");
    }
    let b = s
        .running()
        .iter()
        .find(|q| q.id == SeqId(2))
        .expect("B runs");
    assert_eq!(b.num_computed_tokens + b.num_scheduled_tokens, 30);
    assert_eq!(b.block_table.len(), 8, "6 shared blocks and 2 of its own");
    assert_eq!(
        b.credit.blocks(),
        0,
        "B can draw no more, so it keeps no reservation"
    );
    assert!(b.is_fully_covered(4));
    let a = s
        .running()
        .iter()
        .find(|q| q.id == SeqId(1))
        .expect("A runs");
    let occupancy = pool.snapshot();
    assert_eq!(occupancy.used_blocks, 10, "A's 8 and B's own 2");
    assert_eq!(occupancy.reserved_blocks, a.credit.blocks());
    while s.has_work() {
        let batch = step(&mut s);
        assert!(!batch.seqs.is_empty(), "no progress");
    }
    let occupancy = pool.snapshot();
    assert_eq!((occupancy.used_blocks, occupancy.reserved_blocks), (0, 0));
}

#[test]
fn identical_prompts_admitted_together_all_hit_the_first_ones_blocks() {
    // Four copies of one 40-token prompt: the first computes it, the other three wait and then
    // compute only the last block (the last token is always computed, for its logits).
    let pool = BlockPool::new(64, 4, 1);
    let mut s = Scheduler::new(config(4, 8, 64, 16), pool.clone());
    let mut receivers = Vec::new();
    for id in 1..=4 {
        let (q, rx) = salted_seq(id, 40, 40, 0, "t", &pool);
        receivers.push(rx);
        s.add(q);
    }
    let (mut prefill, mut steps) = (0, 0);
    while s.has_work() {
        let batch = step(&mut s);
        prefill += batch.shape.prefill_tokens;
        steps += 1;
        assert!(steps < 100, "no progress");
    }
    assert_eq!(s.holdbacks_total(), 3 * 3, "three waited for three steps");
    // 40 by the first, then 4 (tokens 36..40) by each of the others.
    assert_eq!(prefill, 40 + 3 * 4);
    assert_eq!(s.prefix_cache_tokens(), (160, 3 * 36));
}

#[test]
fn another_salt_is_not_held_back() {
    let pool = BlockPool::new(64, 4, 1);
    let mut s = Scheduler::new(config(4, 8, 16, 8), pool.clone());
    let (a, _ra) = salted_seq(1, 30, 30, 0, "t", &pool);
    let (b, _rb) = salted_seq(2, 30, 30, 0, "u", &pool);
    s.add(a);
    s.add(b);
    let first = step(&mut s);
    assert_eq!(
        (prefill_of(&s, &first, 1), prefill_of(&s, &first, 2)),
        (8, 8)
    );
    assert_eq!(s.holdbacks_total(), 0);
}

#[test]
fn a_sequence_without_salt_is_never_held_back_nor_holds_back() {
    let pool = BlockPool::new(64, 4, 1);
    let mut s = Scheduler::new(config(4, 8, 24, 8), pool.clone());
    let (a, _ra) = salted_seq(1, 30, 30, 0, "t", &pool);
    let (mut b, _rb) = salted_seq(2, 30, 30, 0, "t", &pool);
    b.cache_salt = None;
    let (c, _rc) = salted_seq(3, 30, 30, 0, "t", &pool);
    s.add(b);
    s.add(a);
    s.add(c);
    let first = step(&mut s);
    // B (no salt) computes alongside A, and does not make C wait; C waits for A.
    assert_eq!(
        (
            prefill_of(&s, &first, 1),
            prefill_of(&s, &first, 2),
            prefill_of(&s, &first, 3)
        ),
        (8, 8, 0)
    );
    assert_eq!(s.holdbacks_total(), 1);
}

#[test]
fn a_held_back_sequence_proceeds_when_the_computing_one_is_cancelled() {
    let pool = BlockPool::new(64, 4, 1);
    let mut s = Scheduler::new(config(4, 8, 16, 8), pool.clone());
    let (a, _ra) = salted_seq(1, 30, 30, 0, "t", &pool);
    let (b, _rb) = salted_seq(2, 30, 30, 0, "t", &pool);
    s.add(a);
    s.add(b);
    let first = step(&mut s);
    assert_eq!(prefill_of(&s, &first, 2), 0, "B waits for A");
    let mut cancelled = Vec::new();
    s.remove_where(|q| q.id == SeqId(1), &mut cancelled);
    let second = step(&mut s);
    // A's first two blocks were registered before it went; B hits them and goes on.
    assert_eq!(prefill_of(&s, &second, 2), 8);
    assert_eq!(
        s.prefix_cache_tokens(),
        (30 + 30, 8),
        "A found nothing, B 8 tokens"
    );
    while s.has_work() {
        step(&mut s);
    }
    let occ = pool.snapshot();
    assert_eq!((occ.used_blocks, occ.reserved_blocks), (0, 0));
}

#[test]
fn a_held_back_sequence_proceeds_when_the_computing_one_is_preempted() {
    // 10 blocks of 4. C (another salt, admitted first, fully reserved) decodes long; A
    // prefills a 30-token prompt that B shares. When A cannot grow, A is preempted (least
    // computed of those freeing shared blocks); B must not wait behind a sequence that no
    // longer runs, and the workload drains.
    let pool = BlockPool::new(10, 4, 1);
    let mut s = Scheduler::new(config(4, 8, 16, 8), pool.clone());
    let credit = pool
        .try_reserve(4)
        .unwrap_or_else(|| pool.empty_reservation());
    let (mut c, _rc) = seq(3, 4, 12, credit);
    c.cache_salt = Some("other".into());
    s.add(c);
    step(&mut s);
    let (a, _ra) = salted_seq(1, 30, 30, 0, "t", &pool);
    let (b, _rb) = salted_seq(2, 30, 30, 0, "t", &pool);
    s.add(a);
    s.add(b);
    let mut steps = 0;
    while s.has_work() {
        let held_back = s.holdbacks_total();
        let mut batch = ScheduledBatch::default();
        s.schedule(&mut batch);
        if s.holdbacks_total() > held_back {
            assert!(prefills_salt(&s, &batch, "t"), "held back behind nothing");
        }
        finish_step(&mut s, &batch);
        steps += 1;
        assert!(steps < 500, "no progress");
    }
    assert!(
        s.preemptions_total() > 0,
        "the pool was meant to be too small"
    );
    assert!(s.holdbacks_total() > 0);
    let occ = pool.snapshot();
    assert_eq!((occ.used_blocks, occ.reserved_blocks), (0, 0));
}

/// A workload step for the property test: new requests arrive, optionally with reservations.
#[derive(Debug, Clone)]
struct Arrival {
    prompt: usize,
    max_tokens: usize,
    reserve: bool,
    /// One of three tenants, weighted 1, 2 and 3.
    tenant: usize,
}

fn arrival() -> impl Strategy<Value = Arrival> {
    (1..20usize, 1..12usize, any::<bool>(), 0..3usize).prop_map(
        |(prompt, max_tokens, reserve, tenant)| Arrival {
            prompt,
            max_tokens,
            reserve,
            tenant,
        },
    )
}

proptest! {
    #[test]
    fn random_workloads_keep_invariants_and_finish(
        block_size in 1..5usize,
        extra_blocks in 0..12usize,
        max_num_seqs in 1..6usize,
        budget in 1..24usize,
        threshold in 0..8usize,
        fair in any::<bool>(),
        target_ms in prop::option::of(1..40u64),
        salted in any::<bool>(),
        arrivals in prop::collection::vec(prop::collection::vec(arrival(), 0..3), 1..12),
    ) {
        // The pool always fits the largest single request (as the engine's submit check ensures).
        let total = (20 + 12usize).div_ceil(block_size) + extra_blocks;
        let pool = BlockPool::new(total, block_size, 1);
        let mut cfg = config(block_size, max_num_seqs, budget, threshold);
        cfg.prefill_order = if fair { PrefillOrder::TenantFair } else { PrefillOrder::Fcfs };
        cfg.target_step_time = target_ms.map(Duration::from_millis);
        let mut s = Scheduler::new(cfg, pool.clone());
        s.set_cost_model(StepCostModel::with_cost(CPU_COST));
        let mut receivers = Vec::new();
        let mut next_id = 0;
        let mut rounds = arrivals.into_iter();
        let mut steps = 0;
        loop {
            for a in rounds.next().unwrap_or_default() {
                let needed = blocks_for_tokens(a.prompt + a.max_tokens, block_size);
                let credit = if a.reserve { pool.try_reserve(needed) } else { None };
                let credit = credit.unwrap_or_else(|| pool.empty_reservation());
                let tenant = ["a", "b", "c"][a.tenant];
                let (mut q, rx) =
                    tenant_seq(next_id, tenant, a.tenant as u32 + 1, a.prompt, a.max_tokens, credit);
                // Prompts are 0..n, so a tenant's sequences share prefixes: with salts they
                // hit each other's blocks and are held back behind each other's prefills.
                if salted {
                    q.cache_salt = Some(tenant.into());
                }
                next_id += 1;
                receivers.push(rx);
                s.add(q);
            }
            let held_back = s.holdbacks_total();
            let mut batch = ScheduledBatch::default();
            s.schedule(&mut batch);
            if s.holdbacks_total() > held_back {
                // Only ever behind a prefill that runs in this very step.
                let prefilling = ["a", "b", "c"].iter().any(|t| prefills_salt(&s, &batch, t));
                prop_assert!(prefilling, "held back behind nothing");
            }
            prop_assert!(batch.num_tokens <= budget);
            prop_assert!(batch.shape.prefill_tokens <= batch.prefill_cap);
            prop_assert_eq!(
                batch.shape.prefill_tokens + batch.shape.decode_seqs,
                batch.num_tokens
            );
            prop_assert!(s.running().len() <= max_num_seqs);
            let mut seen = HashSet::new();
            for q in s.running() {
                for &b in &q.block_table {
                    // Only cached prefix blocks are shared, and only between salted sequences.
                    prop_assert!(seen.insert(b) || salted, "block {} shared", b);
                }
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
            prop_assert_eq!(occ.used_blocks, seen.len());
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

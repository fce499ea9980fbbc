//! Unit and property tests for the block pool's accounting.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;

fn assert_consistent(pool: &BlockPool) {
    let occ = pool.snapshot();
    assert_eq!(
        occ.used_blocks + occ.reserved_blocks + occ.free_blocks,
        occ.total_blocks
    );
}

#[test]
fn reservations_are_atomic_and_return_on_drop() {
    let pool = BlockPool::new(10, 16, 1024);
    let a = pool.try_reserve(6).expect("6 of 10 free");
    assert!(pool.try_reserve(5).is_none(), "only 4 left");
    let b = pool.try_reserve(4).expect("exactly 4 left");
    assert_eq!(pool.snapshot().free_blocks, 0);
    drop(a);
    assert_eq!(pool.snapshot().reserved_blocks, 4);
    drop(b);
    assert_eq!(
        pool.snapshot(),
        Occupancy {
            total_blocks: 10,
            used_blocks: 0,
            reserved_blocks: 0,
            free_blocks: 10,
            cached_blocks: 0,
            block_size: 16,
            bytes_per_block: 1024,
        }
    );
}

#[test]
fn a_reservation_gives_back_what_it_holds_beyond_a_bound() {
    let pool = BlockPool::new(10, 16, 1024);
    let mut credit = pool.try_reserve(6).expect("6 of 10 free");
    let waiter = pool.wait_for_free();
    tokio::pin!(waiter);
    waiter.as_mut().enable();
    assert_eq!(credit.release_beyond(8), 0, "nothing beyond 8 of 6");
    assert_eq!(credit.release_beyond(2), 4);
    assert_eq!(credit.blocks(), 2);
    assert_eq!(pool.snapshot().reserved_blocks, 2);
    assert_consistent(&pool);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(
        std::future::Future::poll(waiter.as_mut(), &mut context).is_ready(),
        "waiters hear of the blocks given back"
    );
    let _other = pool
        .try_reserve(8)
        .expect("the 4 given back are free again");
    drop(credit);
    assert_eq!(pool.snapshot().reserved_blocks, 8);
}

#[test]
fn reserve_within_respects_the_limit_including_used_blocks() {
    let pool = BlockPool::new(10, 16, 1);
    let mut credit = pool.empty_reservation();
    let mut table = Vec::new();
    assert!(pool.allocate_n(3, &mut credit, &mut table));
    assert!(pool.try_reserve_within(6, 8).is_none(), "3 used + 6 > 8");
    let held = pool.try_reserve_within(5, 8).expect("3 used + 5 = 8");
    assert_eq!(held.blocks(), 5);
    assert!(
        pool.try_reserve_within(0, 8).is_some(),
        "zero always fits at the limit"
    );
    assert!(pool.try_reserve_within(1, 8).is_none());
}

#[test]
fn allocation_draws_credit_first_then_free_blocks() {
    let pool = BlockPool::new(4, 16, 1);
    let mut credit = pool.try_reserve(2).expect("free");
    let mut table = Vec::new();
    assert!(pool.allocate_n(3, &mut credit, &mut table));
    assert_eq!(table, vec![0, 1, 2]);
    assert_eq!((credit.blocks(), credit.drawn()), (0, 2));
    let occ = pool.snapshot();
    assert_eq!(
        (occ.used_blocks, occ.reserved_blocks, occ.free_blocks),
        (3, 0, 1)
    );
    // All-or-nothing: 2 more do not fit, nothing changes.
    assert!(!pool.allocate_n(2, &mut credit, &mut table));
    assert_eq!(table.len(), 3);
    assert_eq!(pool.allocate(&mut credit), Some(3));
    assert_eq!(pool.allocate(&mut credit), None);
}

#[test]
fn reserved_blocks_are_not_available_to_others() {
    let pool = BlockPool::new(3, 16, 1);
    let _held = pool.try_reserve(2).expect("free");
    let mut other = pool.empty_reservation();
    assert!(pool.allocate(&mut other).is_some());
    assert!(
        pool.allocate(&mut other).is_none(),
        "the remaining 2 are promised"
    );
}

#[test]
fn preempted_sequence_keeps_its_promised_capacity() {
    let pool = BlockPool::new(4, 16, 1);
    let mut credit = pool.try_reserve(2).expect("free");
    let mut table = Vec::new();
    assert!(pool.allocate_n(3, &mut credit, &mut table)); // 2 from credit, 1 free
    pool.free_into(&table, &mut credit);
    table.clear();
    assert_eq!((credit.blocks(), credit.drawn()), (2, 0));
    let occ = pool.snapshot();
    assert_eq!(
        (occ.used_blocks, occ.reserved_blocks, occ.free_blocks),
        (0, 2, 2)
    );
    drop(credit);
    assert_eq!(pool.snapshot().free_blocks, 4);
}

#[test]
fn shared_blocks_return_only_when_the_last_reference_goes() {
    let pool = BlockPool::new(2, 16, 1);
    let mut credit = pool.empty_reservation();
    let block = pool.allocate(&mut credit).expect("free");
    pool.fork(&[block]);
    pool.free(&[block]);
    assert_eq!(pool.snapshot().used_blocks, 1);
    pool.free(&[block]);
    assert_eq!(pool.snapshot().used_blocks, 0);
    pool.free(&[block, 99]); // double free and unknown id are ignored
    assert_eq!(pool.snapshot().free_blocks, 2);
}

#[test]
fn credit_from_another_pool_is_not_drawn() {
    let pool = BlockPool::new(2, 16, 1);
    let other = BlockPool::new(2, 16, 1);
    let mut foreign = other.try_reserve(2).expect("free");
    let mut table = Vec::new();
    assert!(pool.allocate_n(2, &mut foreign, &mut table));
    assert_eq!(foreign.blocks(), 2);
    assert_eq!(other.snapshot().reserved_blocks, 2);
}

#[tokio::test]
async fn freed_wakes_waiters() {
    let pool = BlockPool::new(1, 16, 1);
    let held = pool.try_reserve(1).expect("free");
    let waiter = {
        let pool = Arc::clone(&pool);
        tokio::spawn(async move {
            loop {
                let notified = pool.wait_for_free();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if let Some(r) = pool.try_reserve(1) {
                    return r.blocks();
                }
                notified.await;
            }
        })
    };
    tokio::task::yield_now().await;
    drop(held);
    assert_eq!(waiter.await.expect("task"), 1);
}

/// A sequence's view for the prefix-cache tests: its blocks and their hash chain.
#[derive(Default)]
struct Held {
    table: Vec<BlockId>,
    hashes: Vec<BlockHash>,
}

/// Allocates blocks for all of `tokens` and registers the full ones, as a sequence that
/// computed its prompt does.
fn compute(pool: &Arc<BlockPool>, salt: &str, tokens: &[u32]) -> Held {
    let mut held = Held::default();
    let blocks = tokens.len().div_ceil(pool.block_size());
    assert!(pool.allocate_n(blocks, &mut pool.empty_reservation(), &mut held.table));
    pool.register_full_blocks(salt, &held.table, tokens, &mut held.hashes);
    held
}

fn acquire(pool: &Arc<BlockPool>, salt: &str, tokens: &[u32], credit: &mut Reservation) -> Held {
    let mut held = Held::default();
    let max = (tokens.len() - 1) / pool.block_size();
    pool.acquire_cached_prefix(salt, tokens, max, credit, &mut held.table, &mut held.hashes);
    held
}

#[test]
fn full_blocks_are_shared_while_in_use_and_cached_after() {
    let pool = BlockPool::new(8, 4, 1);
    let prompt: Vec<u32> = (0..10).collect(); // 2 full blocks + 2 tokens
    let first = compute(&pool, "t", &prompt);
    assert_eq!(
        first.hashes.len(),
        2,
        "the partial third block is never registered"
    );
    // In use: a hit adds references, costs no free block.
    let free_before = pool.snapshot().free_blocks;
    let second = acquire(&pool, "t", &prompt, &mut pool.empty_reservation());
    assert_eq!(second.table, first.table[..2]);
    assert_eq!(second.hashes, first.hashes);
    assert_eq!(pool.snapshot().free_blocks, free_before);
    pool.free(&first.table);
    pool.free(&second.table);
    let occ = pool.snapshot();
    assert_eq!(
        (occ.used_blocks, occ.free_blocks, occ.cached_blocks),
        (0, 8, 2)
    );
    // Free but cached: a hit revives them (and pays for them as for an allocation).
    let mut credit = pool.try_reserve(3).expect("free");
    let third = acquire(&pool, "t", &prompt, &mut credit);
    assert_eq!(third.table, first.table[..2]);
    assert_eq!((credit.blocks(), credit.drawn()), (1, 2));
    let occ = pool.snapshot();
    assert_eq!(
        (occ.used_blocks, occ.cached_blocks, occ.reserved_blocks),
        (2, 0, 1)
    );
    // The whole prompt cached still leaves its last token to compute.
    let exact: Vec<u32> = (0..8).collect();
    assert_eq!(
        pool.cached_prefix_blocks("t", &exact, (exact.len() - 1) / 4),
        1
    );
}

#[test]
fn a_reservation_with_a_prefix_pins_the_hit_and_reserves_only_the_rest() {
    let pool = BlockPool::new(10, 4, 1);
    let prompt: Vec<u32> = (0..14).collect(); // 3 full blocks + 2 tokens
    let first = compute(&pool, "t", &prompt); // 4 blocks in use
    // Needs 5 blocks in all; 3 are cached and in use, so only 2 are reserved.
    let r = pool
        .try_reserve_prefix_within(5, 10, "t", &prompt)
        .expect("2 new blocks fit");
    assert_eq!((r.blocks(), r.pinned_blocks()), (2, 3));
    let occ = pool.snapshot();
    assert_eq!((occ.used_blocks, occ.reserved_blocks), (4, 2));
    // The first sequence goes: the pinned prefix stays in use, it cannot be evicted.
    pool.free(&first.table);
    let occ = pool.snapshot();
    assert_eq!((occ.used_blocks, occ.cached_blocks), (3, 0));
    let mut filler = Held::default();
    assert!(
        !pool.allocate_n(6, &mut pool.empty_reservation(), &mut filler.table),
        "5 free blocks only: the pinned 3 are not free"
    );
    // The sequence takes the pin, and allocates the rest from the credit.
    let mut credit = r;
    let mut seq = acquire(&pool, "t", &prompt, &mut credit);
    assert_eq!(seq.table, first.table[..3]);
    assert_eq!(seq.hashes, first.hashes);
    assert!(pool.allocate_n(1, &mut credit, &mut seq.table));
    assert_eq!((credit.blocks(), credit.drawn()), (1, 1));
    // Preempted: the pin still holds the prefix for its return.
    pool.free_into(&seq.table, &mut credit);
    assert_eq!(credit.blocks(), 2);
    assert_eq!(pool.snapshot().used_blocks, 3);
    drop(credit);
    let occ = pool.snapshot();
    assert_eq!(
        (
            occ.used_blocks,
            occ.reserved_blocks,
            occ.free_blocks,
            occ.cached_blocks
        ),
        (0, 0, 10, 3)
    );
}

#[test]
fn a_free_cached_hit_costs_capacity_and_a_refusal_pins_nothing() {
    let pool = BlockPool::new(6, 4, 1);
    let prompt: Vec<u32> = (0..9).collect(); // 2 full blocks + 1 token
    let first = compute(&pool, "t", &prompt);
    pool.free(&first.table); // 2 cached and free, 4 plain free
    let before = pool.snapshot();
    // 3 blocks: the 2 free cached hits are taken like allocations, so the cost is 3.
    assert!(pool.try_reserve_prefix_within(3, 2, "t", &prompt).is_none());
    assert_eq!(pool.snapshot(), before, "a refusal changes nothing");
    let r = pool
        .try_reserve_prefix_within(3, 3, "t", &prompt)
        .expect("cost 3 fits the limit of 3");
    assert_eq!((r.blocks(), r.pinned_blocks()), (1, 2));
    let occ = pool.snapshot();
    assert_eq!(
        (occ.used_blocks, occ.reserved_blocks, occ.cached_blocks),
        (2, 1, 0)
    );
    // Another salt, or a prompt that is not the pinned one, never uses the pin.
    let mut other = pool.empty_reservation();
    assert!(acquire(&pool, "u", &prompt, &mut other).table.is_empty());
    drop(r);
    let occ = pool.snapshot();
    assert_eq!(
        (
            occ.used_blocks,
            occ.reserved_blocks,
            occ.free_blocks,
            occ.cached_blocks
        ),
        (0, 0, 6, 2)
    );
}

#[test]
fn salt_and_every_earlier_token_separate_prefixes() {
    let pool = BlockPool::new(8, 4, 1);
    let prompt: Vec<u32> = (0..9).collect();
    let _held = compute(&pool, "tenant-a", &prompt);
    assert_eq!(pool.cached_prefix_blocks("tenant-a", &prompt, 2), 2);
    assert_eq!(pool.cached_prefix_blocks("tenant-b", &prompt, 2), 0);
    let mut changed_first = prompt.clone();
    changed_first[0] = 99;
    assert_eq!(
        pool.cached_prefix_blocks("tenant-a", &changed_first, 2),
        0,
        "same second block after a different first one is another prefix"
    );
    let mut changed_second = prompt.clone();
    changed_second[5] = 99;
    assert_eq!(pool.cached_prefix_blocks("tenant-a", &changed_second, 2), 1);
}

#[test]
fn a_hash_hit_with_other_tokens_is_a_miss() {
    let pool = BlockPool::new(4, 4, 1);
    let prompt: Vec<u32> = (0..5).collect();
    let held = compute(&pool, "t", &prompt);
    // Forge a collision: the entry under the prompt's hash now claims other tokens.
    if let Some(entry) = pool.state.lock().entries[held.table[0] as usize].as_mut() {
        entry.tokens = vec![9, 9, 9, 9].into();
    }
    let got = acquire(&pool, "t", &prompt, &mut pool.empty_reservation());
    assert!(
        got.table.is_empty(),
        "a collision must never serve the block"
    );
}

#[test]
fn fresh_blocks_come_from_plain_free_ones_before_evicting_the_oldest_cached() {
    let pool = BlockPool::new(4, 2, 1);
    let empty = pool.cache_generation();
    let a = compute(&pool, "t", &[1, 1]);
    let b = compute(&pool, "t", &[2, 2]);
    let registered = pool.cache_generation();
    assert_ne!(registered, empty, "registering moves the cache generation");
    let again = compute(&pool, "t", &[2, 2]);
    assert_eq!(
        pool.cache_generation(),
        registered,
        "content already cached registers nothing new"
    );
    pool.free(&again.table);
    pool.free(&a.table); // freed first: evicted first
    pool.free(&b.table);
    let mut table = Vec::new();
    let mut credit = pool.empty_reservation();
    assert!(pool.allocate_n(2, &mut credit, &mut table));
    assert_eq!(
        pool.snapshot().cached_blocks,
        2,
        "two plain free blocks went first"
    );
    assert_eq!(pool.cache_generation(), registered, "nothing evicted yet");
    assert!(pool.allocate_n(1, &mut credit, &mut table));
    assert_eq!(table[2], a.table[0]);
    assert_ne!(pool.cache_generation(), registered, "an eviction moves it");
    assert_eq!(pool.cached_prefix_blocks("t", &[1, 1, 0], 1), 0, "evicted");
    assert_eq!(
        pool.cached_prefix_blocks("t", &[2, 2, 0], 1),
        1,
        "still cached"
    );
    // A revived block may not take capacity promised to someone else.
    let _promised = pool
        .try_reserve(1)
        .expect("the cached block is free capacity");
    let held = acquire(&pool, "t", &[2, 2, 0], &mut pool.empty_reservation());
    assert!(held.table.is_empty());
}

/// One step of the gateway/engine interleaving the property test drives.
#[derive(Debug, Clone)]
enum Op {
    Reserve {
        blocks: usize,
        limit: usize,
    },
    CancelPending(usize),
    Submit(usize),
    SubmitUnreserved,
    Grow {
        seq: usize,
        blocks: usize,
    },
    GrowOne(usize),
    Fork(usize),
    Preempt(usize),
    Finish(usize),
    /// A new sequence of prompt `prompt` under salt `salt` pins its cached prefix, drawing on
    /// pending reservation `credit` when there is one.
    Hit {
        prompt: usize,
        salt: usize,
        credit: usize,
    },
    /// Sequence `seq` has computed every block it holds: register the full ones.
    Register(usize),
    /// The gateway reserves `blocks` for prompt `prompt` under salt `salt`, pinning its
    /// cached prefix with the reservation.
    ReservePrefix {
        prompt: usize,
        salt: usize,
        blocks: usize,
        limit: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..8usize, 0..40usize).prop_map(|(blocks, limit)| Op::Reserve { blocks, limit }),
        (0..8usize).prop_map(Op::CancelPending),
        (0..8usize).prop_map(Op::Submit),
        Just(Op::SubmitUnreserved),
        (0..8usize, 0..6usize).prop_map(|(seq, blocks)| Op::Grow { seq, blocks }),
        (0..8usize).prop_map(Op::GrowOne),
        (0..8usize).prop_map(Op::Fork),
        (0..8usize).prop_map(Op::Preempt),
        (0..8usize).prop_map(Op::Finish),
        (0..PROMPTS.len(), 0..2usize, 0..10usize).prop_map(|(prompt, salt, credit)| Op::Hit {
            prompt,
            salt,
            credit
        }),
        (0..8usize).prop_map(Op::Register),
        (0..PROMPTS.len(), 0..2usize, 0..8usize, 0..40usize).prop_map(
            |(prompt, salt, blocks, limit)| Op::ReservePrefix {
                prompt,
                salt,
                blocks,
                limit
            }
        ),
    ]
}

/// Block size of the property test: small, so prompts span several blocks.
const PROP_BLOCK: usize = 2;
/// Prompts sharing prefixes of different lengths (and one token short of a block).
const PROMPTS: [&[u32]; 4] = [
    &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    &[1, 2, 3, 4, 9, 9, 9, 9],
    &[1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 1, 1],
    &[7, 7, 7],
];
const SALTS: [&str; 2] = ["tenant-a", "tenant-b"];

struct Seq {
    credit: Reservation,
    table: Vec<BlockId>,
    /// Which prompt and salt it runs, and its chain of registered / hit block hashes.
    prompt: usize,
    salt: usize,
    hashes: Vec<BlockHash>,
}

impl Seq {
    fn new(credit: Reservation) -> Seq {
        Seq {
            credit,
            table: Vec::new(),
            prompt: 0,
            salt: 0,
            hashes: Vec::new(),
        }
    }

    /// What block `b` of this sequence holds: its salt and every token up to the block's end
    /// (a block's K/V depends on the whole prefix).
    fn content(&self, b: usize) -> (usize, Vec<u32>) {
        let tokens = PROMPTS[self.prompt];
        let end = ((b + 1) * PROP_BLOCK).min(tokens.len());
        (self.salt, tokens[..end].to_vec())
    }
}

fn check_model(pool: &BlockPool, pending: &[Reservation], seqs: &[Seq]) {
    let occ = pool.snapshot();
    assert_eq!(
        occ.used_blocks + occ.reserved_blocks + occ.free_blocks,
        occ.total_blocks
    );
    let mut refs: HashMap<BlockId, u32> = HashMap::new();
    let pins = pending
        .iter()
        .chain(seqs.iter().map(|s| &s.credit))
        .flat_map(|r| r.pinned.iter());
    for &id in pins {
        *refs.entry(id).or_default() += 1;
    }
    for seq in seqs {
        for &id in &seq.table {
            assert!((id as usize) < occ.total_blocks, "block id out of range");
            *refs.entry(id).or_default() += 1;
        }
    }
    assert_eq!(refs.len(), occ.used_blocks, "used = distinct blocks held");
    let state = pool.state.lock();
    for (id, count) in refs {
        assert_eq!(
            state.ref_counts[id as usize], count,
            "refcount of block {id}"
        );
    }
    drop(state);
    let promised: usize = pending.iter().map(Reservation::blocks).sum::<usize>()
        + seqs.iter().map(|s| s.credit.blocks()).sum::<usize>();
    assert_eq!(
        promised, occ.reserved_blocks,
        "reserved = sum of live credits"
    );
    let state = pool.state.lock();
    let cached_free = (0..occ.total_blocks)
        .filter(|&i| state.ref_counts[i] == 0 && state.entries[i].is_some())
        .count();
    assert_eq!(
        occ.cached_blocks, cached_free,
        "cached = free blocks with an entry"
    );
    assert!(occ.cached_blocks <= occ.free_blocks + occ.reserved_blocks);
    assert_eq!(state.by_hash.len(), state.entries.iter().flatten().count());
    for (hash, &id) in &state.by_hash {
        let entry = state.entries[id as usize]
            .as_ref()
            .expect("mapped block has an entry");
        assert_eq!(&entry.hash, hash);
    }
}

proptest! {
    #[test]
    fn any_interleaving_keeps_the_books_and_returns_every_block(
        total in 0..24usize,
        ops in prop::collection::vec(op(), 0..80),
    ) {
        let pool = BlockPool::new(total, PROP_BLOCK, 64);
        // What each block was last written with by its owner (model of the backend's KV).
        let mut written: HashMap<BlockId, (usize, Vec<u32>)> = HashMap::new();
        let mut pending: Vec<Reservation> = Vec::new();
        let mut seqs: Vec<Seq> = Vec::new();
        for op in ops {
            match op {
                Op::Reserve { blocks, limit } => {
                    let before = pool.snapshot();
                    match pool.try_reserve_within(blocks, limit) {
                        Some(r) => {
                            let after = pool.snapshot();
                            prop_assert!(after.used_blocks + after.reserved_blocks <= limit);
                            pending.push(r);
                        }
                        None => prop_assert!(
                            blocks > before.free_blocks
                                || before.used_blocks + before.reserved_blocks + blocks > limit
                        ),
                    }
                }
                Op::CancelPending(i) if i < pending.len() => drop(pending.swap_remove(i)),
                Op::Submit(i) if i < pending.len() => {
                    seqs.push(Seq::new(pending.swap_remove(i)));
                }
                Op::SubmitUnreserved => {
                    seqs.push(Seq::new(pool.empty_reservation()));
                }
                Op::Grow { seq, blocks } if seq < seqs.len() => {
                    let s = &mut seqs[seq];
                    let before = s.table.len();
                    let free = pool.snapshot().free_blocks;
                    let ok = pool.allocate_n(blocks, &mut s.credit, &mut s.table);
                    prop_assert_eq!(ok, blocks <= free + s.credit.blocks() + (s.table.len() - before));
                    prop_assert_eq!(s.table.len(), if ok { before + blocks } else { before });
                }
                Op::GrowOne(i) if i < seqs.len() => {
                    let s = &mut seqs[i];
                    let could = s.credit.blocks() + pool.snapshot().free_blocks > 0;
                    let credit_before = s.credit.blocks();
                    match pool.allocate(&mut s.credit) {
                        Some(id) => {
                            prop_assert!(could);
                            prop_assert_eq!(s.credit.blocks(), credit_before.saturating_sub(1));
                            s.table.push(id);
                        }
                        None => prop_assert!(!could),
                    }
                }
                Op::Fork(i) if i < seqs.len() => {
                    let table = seqs[i].table.clone();
                    pool.fork(&table);
                    let mut fork = Seq::new(pool.empty_reservation());
                    fork.table = table;
                    fork.prompt = seqs[i].prompt;
                    fork.salt = seqs[i].salt;
                    seqs.push(fork);
                }
                Op::Preempt(i) if i < seqs.len() => {
                    let s = &mut seqs[i];
                    pool.free_into(&s.table, &mut s.credit);
                    s.table.clear();
                    s.hashes.clear();
                }
                Op::Finish(i) if i < seqs.len() => {
                    let mut s = seqs.swap_remove(i);
                    pool.free_into(&s.table, &mut s.credit);
                }
                Op::Hit { prompt, salt, credit } => {
                    let credit = if credit < pending.len() {
                        pending.swap_remove(credit)
                    } else {
                        pool.empty_reservation()
                    };
                    let mut s = Seq::new(credit);
                    (s.prompt, s.salt) = (prompt, salt);
                    let tokens = PROMPTS[prompt];
                    // Never the whole prompt: its last token must be computed for logits.
                    let max = (tokens.len() - 1) / PROP_BLOCK;
                    let peek = pool.cached_prefix_blocks(SALTS[salt], tokens, max);
                    let got = pool.acquire_cached_prefix(
                        SALTS[salt], tokens, max, &mut s.credit, &mut s.table, &mut s.hashes,
                    );
                    prop_assert!(got <= peek && got <= max);
                    prop_assert_eq!(s.table.len(), got);
                    prop_assert_eq!(s.hashes.len(), got);
                    if got < peek {
                        // Nothing left to pay for a free cached block is the only reason to
                        // stop before the cached prefix ends.
                        let after = pool.snapshot();
                        prop_assert!(after.free_blocks == 0 && s.credit.blocks() == 0);
                    }
                    for (b, &id) in s.table.iter().enumerate() {
                        prop_assert_eq!(
                            written.get(&id), Some(&s.content(b)),
                            "block {} serves another prompt's KV", id
                        );
                    }
                    seqs.push(s);
                }
                Op::ReservePrefix { prompt, salt, blocks, limit } => {
                    let tokens = PROMPTS[prompt];
                    let before = pool.snapshot();
                    match pool.try_reserve_prefix_within(blocks, limit, SALTS[salt], tokens) {
                        Some(r) => {
                            let after = pool.snapshot();
                            prop_assert!(after.used_blocks + after.reserved_blocks <= limit);
                            prop_assert_eq!(r.blocks() + r.pinned_blocks(), blocks);
                            let max = (tokens.len() - 1) / PROP_BLOCK;
                            prop_assert!(r.pinned_blocks() <= max);
                            let model = Seq { prompt, salt, ..Seq::new(pool.empty_reservation()) };
                            for (b, &id) in r.pinned.iter().enumerate() {
                                prop_assert_eq!(
                                    written.get(&id), Some(&model.content(b)),
                                    "pinned block {} holds another prompt's KV", id
                                );
                            }
                            pending.push(r);
                        }
                        None => prop_assert_eq!(pool.snapshot(), before),
                    }
                }
                Op::Register(i) if i < seqs.len() => {
                    let s = &mut seqs[i];
                    let tokens = PROMPTS[s.prompt];
                    // Blocks past the prompt hold no token of it: only the prompt is "computed".
                    for b in s.hashes.len()..s.table.len() {
                        written.insert(s.table[b], s.content(b));
                    }
                    pool.register_full_blocks(SALTS[s.salt], &s.table, tokens, &mut s.hashes);
                    prop_assert_eq!(s.hashes.len(), (tokens.len() / PROP_BLOCK).min(s.table.len()));
                }
                _ => {}
            }
            check_model(&pool, &pending, &seqs);
        }
        for mut s in seqs.drain(..) {
            pool.free_into(&s.table, &mut s.credit);
        }
        pending.clear();
        assert_consistent(&pool);
        prop_assert_eq!(pool.snapshot().free_blocks, total);
    }
}

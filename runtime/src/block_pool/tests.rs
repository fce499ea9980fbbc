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
            block_size: 16,
            bytes_per_block: 1024,
        }
    );
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

/// One step of the gateway/engine interleaving the property test drives.
#[derive(Debug, Clone)]
enum Op {
    Reserve { blocks: usize, limit: usize },
    CancelPending(usize),
    Submit(usize),
    SubmitUnreserved,
    Grow { seq: usize, blocks: usize },
    GrowOne(usize),
    Fork(usize),
    Preempt(usize),
    Finish(usize),
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
    ]
}

struct Seq {
    credit: Reservation,
    table: Vec<BlockId>,
}

fn check_model(pool: &BlockPool, pending: &[Reservation], seqs: &[Seq]) {
    let occ = pool.snapshot();
    assert_eq!(
        occ.used_blocks + occ.reserved_blocks + occ.free_blocks,
        occ.total_blocks
    );
    let mut refs: HashMap<BlockId, u32> = HashMap::new();
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
}

proptest! {
    #[test]
    fn any_interleaving_keeps_the_books_and_returns_every_block(
        total in 0..24usize,
        ops in prop::collection::vec(op(), 0..80),
    ) {
        let pool = BlockPool::new(total, 16, 64);
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
                    seqs.push(Seq { credit: pending.swap_remove(i), table: Vec::new() });
                }
                Op::SubmitUnreserved => {
                    seqs.push(Seq { credit: pool.empty_reservation(), table: Vec::new() });
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
                    seqs.push(Seq { credit: pool.empty_reservation(), table });
                }
                Op::Preempt(i) if i < seqs.len() => {
                    let s = &mut seqs[i];
                    pool.free_into(&s.table, &mut s.credit);
                    s.table.clear();
                }
                Op::Finish(i) if i < seqs.len() => {
                    let mut s = seqs.swap_remove(i);
                    pool.free_into(&s.table, &mut s.credit);
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

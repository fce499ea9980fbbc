use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;

use super::*;

const ROOMY: QueueLimits = QueueLimits {
    max_requests: 10_000,
    max_tokens: u64::MAX,
};

fn entry(tenant: &str, weight: u32, lane: Lane, tokens: u64, limits: QueueLimits) -> NewEntry<u64> {
    let now = Instant::now();
    NewEntry {
        tenant: tenant.to_string(),
        weight: NonZeroU32::new(weight).unwrap_or(NonZeroU32::MIN),
        lane,
        tokens,
        limits,
        enqueued_at: now,
        deadline: now + Duration::from_secs(tokens),
        payload: tokens,
    }
}

/// Starts whatever the queue picks next (everything eligible).
fn start_next(queue: &mut FairQueue<u64>) -> Option<QueueEntry<u64>> {
    let id = queue.peek_next(|_| true)?.id;
    queue.start(id)
}

#[test]
fn bounds_by_requests_and_by_tokens_hand_the_payload_back() {
    let mut queue = FairQueue::new();
    let limits = QueueLimits {
        max_requests: 2,
        max_tokens: 100,
    };
    assert!(queue.push(entry("a", 1, Lane::Short, 40, limits)).is_ok());
    assert!(matches!(
        queue.push(entry("a", 1, Lane::Short, 70, limits)),
        Err((
            QueueFull::Tokens {
                queued: 40,
                requested: 70,
                limit: 100
            },
            70
        ))
    ));
    assert!(queue.push(entry("a", 1, Lane::Long, 60, limits)).is_ok());
    assert!(matches!(
        queue.push(entry("a", 1, Lane::Short, 1, limits)),
        Err((
            QueueFull::Requests {
                queued: 2,
                limit: 2
            },
            1
        ))
    ));
    // Another tenant has its own bounds.
    assert!(queue.push(entry("b", 1, Lane::Short, 100, limits)).is_ok());
    assert_eq!(queue.len(), 3);
    assert_eq!(queue.queued_tokens(), 200);
}

#[test]
fn weights_split_service_in_proportion() {
    let mut queue = FairQueue::new();
    for _ in 0..40 {
        queue
            .push(entry("heavy", 3, Lane::Short, 10, ROOMY))
            .unwrap();
        queue
            .push(entry("light", 1, Lane::Short, 10, ROOMY))
            .unwrap();
    }
    let mut served = BTreeMap::<String, u64>::new();
    for _ in 0..40 {
        let started = start_next(&mut queue).unwrap();
        *served.entry(started.tenant).or_default() += started.tokens;
    }
    assert_eq!(served["heavy"], 300);
    assert_eq!(served["light"], 100);
}

#[test]
fn a_flooding_tenant_delays_a_newcomer_by_at_most_one_request() {
    let mut queue = FairQueue::new();
    for _ in 0..1000 {
        queue
            .push(entry("flood", 1, Lane::Short, 500, ROOMY))
            .unwrap();
    }
    for _ in 0..10 {
        start_next(&mut queue).unwrap();
    }
    queue
        .push(entry("newcomer", 1, Lane::Short, 50, ROOMY))
        .unwrap();
    let next_two: Vec<String> = (0..2)
        .map(|_| start_next(&mut queue).unwrap().tenant)
        .collect();
    assert!(next_two.contains(&"newcomer".to_string()), "{next_two:?}");
}

#[test]
fn idle_time_banks_no_credit() {
    let mut queue = FairQueue::new();
    queue
        .push(entry("early", 1, Lane::Short, 10, ROOMY))
        .unwrap();
    start_next(&mut queue).unwrap();
    for _ in 0..20 {
        queue
            .push(entry("busy", 1, Lane::Short, 10, ROOMY))
            .unwrap();
    }
    for _ in 0..10 {
        start_next(&mut queue).unwrap();
    }
    // "early" was idle while "busy" was served; it now alternates instead of taking 10 in a row.
    for _ in 0..5 {
        queue
            .push(entry("early", 1, Lane::Short, 10, ROOMY))
            .unwrap();
    }
    let order: Vec<String> = (0..4)
        .map(|_| start_next(&mut queue).unwrap().tenant)
        .collect();
    assert_eq!(
        order.iter().filter(|t| *t == "early").count(),
        2,
        "{order:?}"
    );
}

#[test]
fn a_blocked_long_lane_does_not_hold_back_short_requests() {
    let mut queue = FairQueue::new();
    let long = queue.push(entry("a", 1, Lane::Long, 3000, ROOMY)).unwrap();
    let short = queue.push(entry("a", 1, Lane::Short, 20, ROOMY)).unwrap();
    assert_eq!(
        queue.peek_next(|_| true).map(|e| e.id),
        Some(long),
        "FIFO within a tenant"
    );
    assert_eq!(
        queue.peek_next(|e| e.lane == Lane::Short).map(|e| e.id),
        Some(short)
    );
    assert_eq!(queue.peek_next(|_| false).map(|e| e.id), None);
}

#[test]
fn removal_is_free_and_deadlines_follow_the_queue() {
    let mut queue = FairQueue::new();
    let a = queue.push(entry("a", 1, Lane::Short, 30, ROOMY)).unwrap();
    queue.push(entry("b", 1, Lane::Short, 10, ROOMY)).unwrap();
    let earliest = queue.entries().map(|e| e.deadline).min();
    assert_eq!(queue.next_deadline(), earliest);
    assert_eq!(queue.remove(a).map(|e| e.payload), Some(30));
    assert!(queue.remove(a).is_none(), "an entry leaves only once");
    let gone = queue.remove_where(|e| e.tenant == "b");
    assert_eq!(gone.len(), 1);
    assert!(queue.is_empty());
    assert_eq!(queue.next_deadline(), None);
    assert!(queue.backlogs().is_empty());
}

#[derive(Debug, Clone)]
enum Op {
    Push {
        tenant: usize,
        lane: bool,
        tokens: u64,
    },
    Start,
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3usize, any::<bool>(), 1..200u64).prop_map(|(tenant, lane, tokens)| Op::Push {
            tenant,
            lane,
            tokens
        }),
        Just(Op::Start),
        (0..64usize).prop_map(Op::Remove),
    ]
}

proptest! {
    /// Continuously backlogged tenants: normalised service never differs by more than one
    /// request's worth (the larger of the two tenants' max cost / weight).
    #[test]
    fn fairness_bound_holds_for_backlogged_tenants(
        weights in proptest::collection::vec(1..5u32, 2..4),
        costs in proptest::collection::vec(proptest::collection::vec(1..300u64, 30..60), 4),
    ) {
        let mut queue = FairQueue::new();
        let names: Vec<String> = (0..weights.len()).map(|i| format!("t{i}")).collect();
        for (i, weight) in weights.iter().enumerate() {
            for &cost in &costs[i] {
                queue.push(entry(&names[i], *weight, Lane::Short, cost, ROOMY)).unwrap();
            }
        }
        let max_cost = |i: usize| costs[i].iter().copied().max().unwrap_or(0) as f64 / f64::from(weights[i]);
        let mut served = vec![0u64; weights.len()];
        let mut left: Vec<usize> = (0..weights.len()).map(|i| costs[i].len()).collect();
        while let Some(started) = start_next(&mut queue) {
            let i = names.iter().position(|n| *n == started.tenant).unwrap();
            served[i] += started.tokens;
            left[i] -= 1;
            if left.contains(&0) {
                break; // someone is no longer backlogged; the bound covers backlogged tenants
            }
            for a in 0..weights.len() {
                for b in 0..weights.len() {
                    let gap = served[a] as f64 / f64::from(weights[a]) - served[b] as f64 / f64::from(weights[b]);
                    prop_assert!(gap <= max_cost(a).max(max_cost(b)) + 0.01, "gap {gap} served {served:?}");
                }
            }
        }
    }

    /// Random pushes, starts and removals: bounds are never exceeded and every entry that went
    /// in comes out exactly once (started or removed) or is still queued.
    #[test]
    fn bounds_hold_and_nothing_is_lost(ops in proptest::collection::vec(op(), 1..200)) {
        let limits = QueueLimits { max_requests: 5, max_tokens: 500 };
        let mut queue = FairQueue::new();
        let mut inside = BTreeSet::new();
        let mut pushed = Vec::new();
        for op in ops {
            match op {
                Op::Push { tenant, lane, tokens } => {
                    let lane = if lane { Lane::Long } else { Lane::Short };
                    if let Ok(id) = queue.push(entry(&format!("t{tenant}"), tenant as u32 + 1, lane, tokens, limits)) {
                        prop_assert!(inside.insert(id));
                        pushed.push(id);
                    }
                }
                Op::Start => {
                    if let Some(started) = start_next(&mut queue) {
                        prop_assert!(inside.remove(&started.id));
                    }
                }
                Op::Remove(index) => {
                    if let Some(&id) = pushed.get(index) {
                        let removed = queue.remove(id);
                        prop_assert_eq!(removed.is_some(), inside.remove(&id));
                    }
                }
            }
            prop_assert_eq!(queue.len(), inside.len());
            for backlog in queue.backlogs() {
                prop_assert!(backlog.requests <= limits.max_requests);
                prop_assert!(backlog.tokens <= limits.max_tokens);
            }
            let ids: BTreeSet<EntryId> = queue.entries().map(|e| e.id).collect();
            prop_assert_eq!(&ids, &inside);
        }
    }
}

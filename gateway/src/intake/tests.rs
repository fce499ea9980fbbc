use std::time::Duration;

use super::*;

const ONE: NonZeroU32 = NonZeroU32::MIN;
use crate::policy::parse_policy;

fn tenant(name: &str, max_validating: usize) -> TenantPolicy {
    let policy = parse_policy("t.toml", &format!("[tenants.{name}]\n")).unwrap();
    let mut tenant = TenantPolicy::clone(&policy.tenant(name).unwrap());
    tenant.max_validating = max_validating;
    tenant
}

#[test]
fn the_in_flight_cap_is_per_tenant_and_freed_by_the_permit() {
    let intake = Intake::new(2);
    let (a, b) = (tenant("a", 2), tenant("b", 1));
    let first = intake.enter(&a).expect("room for a");
    let _second = intake.enter(&a).expect("room for a second");
    assert_eq!(
        intake.enter(&a).unwrap_err(),
        IntakeFull {
            tenant: "a".into(),
            limit: 2
        }
    );
    // Another tenant is unaffected by a's full intake.
    let _b = intake.enter(&b).expect("b has its own cap");
    assert!(intake.enter(&b).is_err());
    assert_eq!(intake.in_flight("a"), 2);
    drop(first);
    assert_eq!(intake.in_flight("a"), 1);
    assert!(intake.enter(&a).is_ok());
}

/// Whether a waiting `worker` future has been granted, without waiting.
fn granted(waiter: &mut tokio::task::JoinHandle<ValidationWorker>) -> bool {
    waiter.is_finished()
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(20)).await;
}

#[tokio::test]
async fn a_freed_worker_goes_to_the_tenant_holding_fewest_not_the_longest_queue() {
    let intake = Intake::new(1);
    let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
    let held = intake.worker(&a, ONE).await;
    // a queues three more, then b queues one.
    let mut a_waiters: Vec<_> = (0..3)
        .map(|_| {
            let (intake, a) = (intake.clone(), Arc::clone(&a));
            tokio::spawn(async move { intake.worker(&a, ONE).await })
        })
        .collect();
    settle().await;
    let mut b_waiter = {
        let (intake, b) = (intake.clone(), Arc::clone(&b));
        tokio::spawn(async move { intake.worker(&b, ONE).await })
    };
    settle().await;
    assert!(!granted(&mut b_waiter) && a_waiters.iter_mut().all(|w| !granted(w)));

    // a's worker frees up: b (holding none, never served) goes before a's backlog.
    drop(held);
    let b_worker = tokio::time::timeout(Duration::from_secs(5), &mut b_waiter)
        .await
        .expect("b is served next")
        .unwrap();
    assert!(a_waiters.iter_mut().all(|w| !granted(w)));
    // Then a's oldest waiter.
    drop(b_worker);
    let first_a = tokio::time::timeout(Duration::from_secs(5), &mut a_waiters[0])
        .await
        .expect("a's oldest waiter next")
        .unwrap();
    assert!(a_waiters[1..].iter_mut().all(|w| !granted(w)));
    drop(first_a);
    for waiter in &mut a_waiters[1..] {
        drop(
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("every waiter is served in turn")
                .unwrap(),
        );
    }
    assert_eq!(intake.shared.state.lock().busy, 0);
}

#[tokio::test]
async fn workers_are_shared_by_tenant_weight() {
    let intake = Intake::new(1);
    let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
    let three = NonZeroU32::new(3).unwrap();
    let held = intake.worker(&a, three).await;
    // Both tenants keep a backlog of 12: a of weight 3, b of weight 1. Each waiter reports
    // its tenant once served; the test then frees the worker for the next.
    let (served_tx, mut served) = tokio::sync::mpsc::unbounded_channel();
    for (tenant, weight) in [(&a, three), (&b, ONE)] {
        for _ in 0..12 {
            let (intake, tenant, served_tx) =
                (intake.clone(), Arc::clone(tenant), served_tx.clone());
            tokio::spawn(async move {
                let worker = intake.worker(&tenant, weight).await;
                let _ = served_tx.send((tenant, worker));
            });
        }
    }
    settle().await;
    drop(held);
    let mut order = String::new();
    for _ in 0..16 {
        let (tenant, worker) = tokio::time::timeout(Duration::from_secs(5), served.recv())
            .await
            .expect("the worker is handed on")
            .expect("a waiter");
        order.push_str(&tenant);
        drop(worker);
    }
    // b first (a already had the worker), then three to one once both clocks run.
    assert!(order.starts_with("baab"), "order {order}");
    let steady = &order[4..];
    let count = |t: char| steady.chars().filter(|&c| c == t).count();
    assert_eq!((count('a'), count('b')), (9, 3), "order {order}");
    assert!(
        !order.contains("aaaa"),
        "b is never passed over more than three times: {order}"
    );
}

#[tokio::test]
async fn a_waiter_that_left_does_not_keep_the_worker() {
    let intake = Intake::new(1);
    let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
    let held = intake.worker(&a, ONE).await;
    let gone = {
        let (intake, b) = (intake.clone(), Arc::clone(&b));
        tokio::spawn(async move { intake.worker(&b, ONE).await })
    };
    settle().await;
    gone.abort();
    settle().await;
    let mut next = {
        let (intake, a) = (intake.clone(), Arc::clone(&a));
        tokio::spawn(async move { intake.worker(&a, ONE).await })
    };
    settle().await;
    drop(held);
    let worker = tokio::time::timeout(Duration::from_secs(5), &mut next)
        .await
        .expect("the worker skips the waiter that left")
        .unwrap();
    drop(worker);
    let state = intake.shared.state.lock();
    assert_eq!(state.busy, 0);
    assert!(state.tenants.is_empty(), "no tenant entry outlives its use");
}

#[tokio::test]
async fn validate_holds_permit_and_worker_until_the_job_returns() {
    let intake = Intake::new(1);
    let a = tenant("a", 1);
    let permit = intake.enter(&a).unwrap();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (finish_tx, finish_rx) = std::sync::mpsc::channel::<()>();
    let job = {
        let intake = intake.clone();
        tokio::spawn(async move {
            intake
                .validate(permit, move || {
                    started_tx.send(()).unwrap();
                    finish_rx.recv().unwrap();
                    7
                })
                .await
        })
    };
    tokio::task::spawn_blocking(move || started_rx.recv().unwrap())
        .await
        .unwrap();
    // The caller stops waiting (its client left): the job still runs and still counts.
    job.abort();
    settle().await;
    assert_eq!(intake.in_flight("a"), 1);
    assert!(intake.enter(&a).is_err());
    finish_tx.send(()).unwrap();
    wait_for(|| intake.in_flight("a") == 0).await;
    assert_eq!(intake.shared.state.lock().busy, 0);
}

async fn wait_for(mut condition: impl FnMut() -> bool) {
    for _ in 0..500 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition never held");
}

#[tokio::test]
async fn validate_inline_waits_its_fair_turn_runs_here_and_survives_a_panic() {
    let intake = Intake::new(1);
    let a = tenant("a", 2);
    let held = intake.worker(&Arc::from("b"), ONE).await;
    let permit = intake.enter(&a).unwrap();
    let caller = std::thread::current().id();
    let mut job = {
        let intake = intake.clone();
        tokio::spawn(async move {
            intake
                .validate_inline(permit, move || std::thread::current().id())
                .await
        })
    };
    settle().await;
    assert!(!job.is_finished(), "no worker free: it waits its turn");
    drop(held);
    let ran_on = (&mut job).await.unwrap().expect("no panic");
    // A current-thread test runtime: the job ran on the task's own thread, not a blocking one.
    assert_eq!(ran_on, caller);
    assert_eq!(intake.in_flight("a"), 0, "the permit is released");

    let permit = intake.enter(&a).unwrap();
    let panicked = intake
        .validate_inline(permit, || -> u32 { panic!("a bug in validation") })
        .await;
    assert_eq!(panicked, None);
    assert_eq!(intake.in_flight("a"), 0);
    assert_eq!(intake.shared.state.lock().busy, 0, "the worker is back");
}

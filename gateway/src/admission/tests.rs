use std::sync::Arc;
use std::time::Duration;

use kvgate_runtime::block_pool::{BlockId, BlockPool, Reservation};
use tokio::task::JoinHandle;

use super::*;
use crate::policy::parse_policy;

const BLOCK_SIZE: usize = 16;

/// `policy` with a key for every tenant, `test-key-NAME` (see [`credential_of`]): a queued
/// request's credential is checked again on every reload.
fn keyed(policy: &str) -> String {
    policy
        .lines()
        .map(|line| {
            match line
                .trim()
                .strip_prefix("[tenants.")
                .and_then(|rest| rest.strip_suffix(']'))
            {
                Some(name) => format!(
                    "{line}\nkey_sha256 = [\"{}\"]\n",
                    crate::auth::hash_key(&format!("test-key-{name}"))
                ),
                None => format!("{line}\n"),
            }
        })
        .collect()
}

/// The credential of tenant `name`'s requests under a [`keyed`] policy.
fn credential_of(name: &str) -> Credential {
    Credential::Key(crate::auth::digest_key(&format!("test-key-{name}")))
}

/// Admission over a pool of `blocks` blocks of 16 tokens, under the policy text `policy`.
fn setup(blocks: usize, policy: &str) -> (Admission, Arc<BlockPool>, PolicyStore) {
    let store = PolicyStore::from_policy(parse_policy("test.toml", &keyed(policy)).unwrap());
    let pool = BlockPool::new(blocks, BLOCK_SIZE, 1024);
    (
        Admission::new(store.clone(), Arc::clone(&pool)),
        pool,
        store,
    )
}

fn ticket(
    store: &PolicyStore,
    tenant: &str,
    prompt_tokens: usize,
    max_output_tokens: usize,
) -> AdmissionTicket {
    AdmissionTicket {
        tenant: store.current().tenant(tenant).unwrap(),
        credential: credential_of(tenant),
        prompt_tokens,
        max_output_tokens,
        prompt_param: "messages",
        request_id: format!("req-{tenant}-{prompt_tokens}"),
        pool: PoolId::LOCAL,
        prefix: None,
    }
}

fn spawn_admit(
    admission: &Admission,
    ticket: AdmissionTicket,
) -> JoinHandle<Result<Admitted, Rejection>> {
    let admission = admission.clone();
    tokio::spawn(async move { admission.admit(ticket).await })
}

/// Lets the dispatcher run (without advancing paused time) until `condition` holds.
async fn until(mut condition: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if condition() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("condition never became true");
}

fn queued(admission: &Admission) -> usize {
    admission
        .queue_snapshot()
        .iter()
        .map(|row| row.queued_requests)
        .sum()
}

async fn admitted(handle: JoinHandle<Result<Admitted, Rejection>>) -> Admitted {
    match handle.await.unwrap() {
        Ok(admitted) => admitted,
        Err(rejection) => panic!("expected admission, got {}", rejection.message()),
    }
}

/// Teaches tenant `a` its slot hold time: one request of 16 prompt and 16 output tokens that
/// runs for `runs` (on tokio's paused clock).
async fn teach_hold_time(admission: &Admission, store: &PolicyStore, runs: Duration) {
    let mut first = admission.admit(ticket(store, "a", 16, 16)).await.unwrap();
    first.mark_started();
    tokio::time::advance(runs).await;
    first.record_completion(16);
    drop(first);
}

#[tokio::test(start_paused = true)]
async fn admits_at_once_and_the_guard_owns_the_reservation() {
    let (admission, pool, store) = setup(100, "[tenants.a]\n");
    let mut first = admission.admit(ticket(&store, "a", 100, 60)).await.unwrap();
    assert_eq!(first.reserved_blocks(), 10, "ceil(160 / 16)");
    assert_eq!(pool.snapshot().reserved_blocks, 10);
    assert_eq!(first.queue_wait(), Duration::ZERO);
    assert_eq!(admission.queue_snapshot()[0].in_flight, 1);

    // The engine takes the reservation; the guard still holds the slot.
    let reservation = first.take_reservation().unwrap();
    assert!(first.take_reservation().is_none());
    drop(first);
    assert_eq!(
        pool.snapshot().reserved_blocks,
        10,
        "the engine's reservation is untouched"
    );
    drop(reservation);
    assert_eq!(pool.snapshot().reserved_blocks, 0);
    assert!(admission.queue_snapshot().is_empty());
}

#[tokio::test(start_paused = true)]
async fn requests_that_can_never_fit_are_refused_at_once() {
    let (admission, pool, store) = setup(10, "[tenants.a]\n[kv]\nhigh_watermark = 0.9\n");
    // 10 blocks needed, 9 allowed under the watermark.
    let rejection = admission
        .admit(ticket(&store, "a", 100, 60))
        .await
        .unwrap_err();
    assert_eq!(
        rejection,
        Rejection::NeverFits {
            needed_blocks: 10,
            total_blocks: 10,
            limit_blocks: 9,
            limit: NeverFitsLimit::Watermark,
            param: "messages",
        }
    );
    assert_eq!(
        (rejection.status(), rejection.code()),
        (400, "context_length_exceeded")
    );
    assert_eq!(pool.snapshot().reserved_blocks, 0);
}

#[tokio::test(start_paused = true)]
async fn prompt_mode_reserves_prompt_plus_headroom_but_refuses_sequences_longer_than_the_pool() {
    let policy = "[tenants.a]\n[kv]\nreservation = \"prompt\"\nprompt_headroom_blocks = 2\n";
    let (admission, pool, store) = setup(10, policy);
    let admitted = admission.admit(ticket(&store, "a", 40, 100)).await.unwrap();
    assert_eq!(admitted.reserved_blocks(), 5, "ceil(40 / 16) + 2");
    assert_eq!(pool.snapshot().reserved_blocks, 5);
    drop(admitted);
    // 16 + 160 tokens = 11 blocks: more than the whole pool, whatever is reserved up front.
    // Its reservation (1 + 2 blocks) is well under the watermark's 9, so the message names the
    // pool, and the param names a completion's field.
    let rejection = admission
        .admit(AdmissionTicket {
            prompt_param: "prompt",
            ..ticket(&store, "a", 16, 160)
        })
        .await
        .unwrap_err();
    assert_eq!(
        rejection,
        Rejection::NeverFits {
            needed_blocks: 11,
            total_blocks: 10,
            limit_blocks: 9,
            limit: NeverFitsLimit::Pool,
            param: "prompt",
        }
    );
    assert_eq!(rejection.param(), Some("prompt"));
    let message = rejection.message();
    assert!(
        message.contains("11 KV cache blocks") && message.contains("only 10 blocks"),
        "{message}"
    );
    assert!(!message.contains("can be reserved"), "{message}");
}

#[tokio::test(start_paused = true)]
async fn reservations_stay_under_the_watermark_and_freed_blocks_wake_the_queue() {
    let (admission, pool, store) = setup(10, "[tenants.a]\n[kv]\nhigh_watermark = 0.5\n");
    let mut big = admission.admit(ticket(&store, "a", 64, 0)).await.unwrap(); // 4 blocks
    let waiting = spawn_admit(&admission, ticket(&store, "a", 32, 0)); // 2 blocks: 6 > 5
    until(|| queued(&admission) == 1).await;
    assert_eq!(pool.snapshot().reserved_blocks, 4);

    // Returning blocks to the pool (not the slot) must be enough to start the waiter.
    drop(big.take_reservation());
    let small = admitted(waiting).await;
    assert_eq!(pool.snapshot().reserved_blocks, 2);
    assert!(small.queue_wait() < Duration::from_secs(1));
    drop(big);
}

#[tokio::test(start_paused = true)]
async fn a_request_that_waits_too_long_times_out_with_503() {
    let (admission, pool, store) = setup(10, "[tenants.a]\nmax_queue_wait = \"2s\"\n");
    let _blocker = pool.try_reserve(10).unwrap();
    // Paused time advances by itself to the queue deadline once everything is idle.
    let rejection = admission
        .admit(ticket(&store, "a", 16, 16))
        .await
        .unwrap_err();
    match &rejection {
        Rejection::QueueTimeout {
            waited,
            retry_after,
            ..
        } => {
            assert!(*waited >= Duration::from_secs(2));
            assert!(*retry_after >= MIN_CAPACITY_RETRY_AFTER && *retry_after <= MAX_RETRY_AFTER);
        }
        other => panic!("expected QueueTimeout, got {other:?}"),
    }
    assert_eq!(
        (rejection.status(), rejection.code()),
        (503, "queue_timeout")
    );
    assert_eq!(queued(&admission), 0);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_future_leaves_the_queue_and_releases_nothing_twice() {
    let policy = "[tenants.a]\nrequests_per_minute = 10\ntokens_per_minute = 1000\n";
    let (admission, pool, store) = setup(10, policy);
    let blocker = pool.try_reserve(10).unwrap();
    let client = spawn_admit(&admission, ticket(&store, "a", 40, 40));
    until(|| queued(&admission) == 1).await;
    client.abort();
    until(|| queued(&admission) == 0).await;

    // The abandoned request was never charged: its debit came back.
    let headers = admission.rate_headers(&store.current().tenant("a").unwrap());
    assert_eq!(headers.requests.map(|s| s.remaining), Some(10));
    assert_eq!(headers.tokens.map(|s| s.remaining), Some(1000));

    drop(blocker);
    assert_eq!(pool.snapshot().reserved_blocks, 0);
    let next = admission.admit(ticket(&store, "a", 40, 40)).await.unwrap();
    assert_eq!(pool.snapshot().reserved_blocks, next.reserved_blocks());
    assert_eq!(admission.queue_snapshot()[0].in_flight, 1);
}

#[tokio::test(start_paused = true)]
async fn tenant_concurrency_holds_the_excess_in_the_queue() {
    let (admission, _pool, store) = setup(100, "[tenants.a]\nmax_concurrency = 1\n[tenants.b]\n");
    let first = admission.admit(ticket(&store, "a", 10, 10)).await.unwrap();
    let second = spawn_admit(&admission, ticket(&store, "a", 10, 10));
    until(|| queued(&admission) == 1).await;
    // Another tenant is not held back by a's limit.
    drop(admission.admit(ticket(&store, "b", 10, 10)).await.unwrap());
    assert!(!second.is_finished());
    drop(first);
    drop(admitted(second).await);
}

#[tokio::test(start_paused = true)]
async fn short_prompts_pass_a_full_long_lane() {
    let policy =
        "[tenants.a]\n[tenants.b]\n[lanes]\nlong_prompt_tokens = 100\nlong_max_concurrency = 1\n";
    let (admission, _pool, store) = setup(100, policy);
    let long = admission.admit(ticket(&store, "a", 200, 10)).await.unwrap();
    assert_eq!(long.lane(), Lane::Long);
    let second_long = spawn_admit(&admission, ticket(&store, "b", 150, 10));
    until(|| queued(&admission) == 1).await;
    let short = admission.admit(ticket(&store, "b", 20, 10)).await.unwrap();
    assert_eq!(short.lane(), Lane::Short);
    drop(long);
    assert_eq!(admitted(second_long).await.lane(), Lane::Long);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_is_refused_with_429() {
    let policy = "[tenants.a]\nmax_concurrency = 1\nqueue_depth = 1\n";
    let (admission, _pool, store) = setup(100, policy);
    let _running = admission.admit(ticket(&store, "a", 10, 10)).await.unwrap();
    let _waiting = spawn_admit(&admission, ticket(&store, "a", 10, 10));
    until(|| queued(&admission) == 1).await;
    let rejection = admission
        .admit(ticket(&store, "a", 10, 10))
        .await
        .unwrap_err();
    assert_eq!((rejection.status(), rejection.code()), (429, "queue_full"));
    assert_eq!(
        rejection.retry_after(),
        Some(MIN_CAPACITY_RETRY_AFTER),
        "no drain data yet"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_bigger_than_the_queue_token_bound_is_refused_as_final() {
    let policy = "[tenants.a]\nqueue_tokens = 100\n";
    let (admission, _pool, store) = setup(100, policy);
    // 60 + 50 tokens can never fit a queue of 100 tokens, even an empty one.
    let rejection = admission
        .admit(ticket(&store, "a", 60, 50))
        .await
        .unwrap_err();
    assert_eq!(
        (
            rejection.status(),
            rejection.code(),
            rejection.should_retry()
        ),
        (429, "insufficient_quota", false)
    );
    assert_eq!(rejection.retry_after(), None);
    let mut headers = http::HeaderMap::new();
    rejection.apply_headers(&mut headers);
    assert_eq!(headers["x-should-retry"], "false");
    assert!(headers.get("retry-after").is_none(), "{headers:?}");
    assert!(
        rejection.message().contains("100"),
        "{}",
        rejection.message()
    );
    assert_eq!(queued(&admission), 0);
    // One that fits the bound exactly is admitted.
    admission.admit(ticket(&store, "a", 50, 50)).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_queue_timeout_says_when_its_turn_would_come_not_when_the_pool_empties() {
    let policy = "[tenants.a]\nmax_concurrency = 1\nmax_queue_wait = \"3s\"\n[tenants.b]\n";
    // KV to spare: the tenant's concurrency is what holds the queue.
    let (admission, _pool, store) = setup(400, policy);
    // 160 tokens per second, taught by another tenant: `a` has no hold time yet, so its slot
    // forecast cannot refuse the two below before their deadline (a queue timeout is the
    // subject here; `a_queue_held_back_by_the_tenants_concurrency_cap_is_refused_as_such` is
    // the forecast's).
    teach_drain_rate(&admission, &store, "b").await;
    // A long request runs (its reservation counts for nothing below: it drains for everyone).
    let _running = admission
        .admit(ticket(&store, "a", 500, 500))
        .await
        .unwrap();
    let first = spawn_admit(&admission, ticket(&store, "a", 20, 300)); // 20 blocks
    until(|| queued(&admission) == 1).await;
    let second = spawn_admit(&admission, ticket(&store, "a", 20, 300));
    until(|| queued(&admission) == 2).await;
    let retry = |outcome: Result<Result<Admitted, Rejection>, _>| {
        let rejection = outcome.expect("joined").expect_err("timed out");
        assert_eq!(rejection.code(), "queue_timeout");
        rejection.retry_after()
    };
    // The first to time out queues again behind the second: 320 + 320 tokens at 160/s.
    assert_eq!(retry(first.await), Some(Duration::from_secs(4)));
    // The second has nothing of its tenant ahead any more: its own 320 tokens.
    assert_eq!(retry(second.await), Some(Duration::from_secs(2)));
}

/// Fills tenant `a`'s one-entry queue behind one running request, and returns the rejection of
/// the next request with the queued entry's guard-to-be.
async fn queue_full_rejection(
    admission: &Admission,
    store: &PolicyStore,
    queued_output_tokens: usize,
    waited: Duration,
) -> (Rejection, Admitted, JoinHandle<Result<Admitted, Rejection>>) {
    let running = admission.admit(ticket(store, "a", 10, 10)).await.unwrap();
    let before = queued(admission);
    let waiting = spawn_admit(admission, ticket(store, "a", 20, queued_output_tokens));
    until(|| queued(admission) == before + 1).await;
    tokio::time::advance(waited).await;
    let rejection = admission
        .admit(ticket(store, "a", 10, 10))
        .await
        .unwrap_err();
    assert_eq!(rejection.code(), "queue_full");
    (rejection, running, waiting)
}

#[tokio::test(start_paused = true)]
async fn before_any_drain_rate_a_full_queue_uses_the_engine_service_time() {
    let policy = "[tenants.a]\nmax_concurrency = 1\nqueue_depth = 1\n";
    let (admission, _pool, store) = setup(100, policy);
    // 25 ms per generated token, all running sequences together.
    admission.set_service_time_probe(|| Some(Duration::from_millis(25)));
    let (rejection, _running, _waiting) =
        queue_full_rejection(&admission, &store, 200, Duration::ZERO).await;
    // The queued entry generates up to 200 tokens: 200 × 25 ms.
    assert_eq!(rejection.retry_after(), Some(Duration::from_secs(5)));
    let mut headers = http::HeaderMap::new();
    rejection.apply_headers(&mut headers);
    assert_eq!(headers["retry-after"], "5");
}

#[tokio::test(start_paused = true)]
async fn the_service_time_estimate_is_shared_fairly_and_capped() {
    let policy = "[tenants.a]\nmax_concurrency = 1\nqueue_depth = 1\n\
                  [tenants.b]\nmax_concurrency = 1\nweight = 3\n";
    let (admission, _pool, store) = setup(100, policy);
    admission.set_service_time_probe(|| Some(Duration::from_millis(25)));
    // Tenant b is backlogged too: a gets a quarter of the engine.
    let _b_running = admission.admit(ticket(&store, "b", 10, 10)).await.unwrap();
    let _b_waiting = spawn_admit(&admission, ticket(&store, "b", 10, 10));
    until(|| queued(&admission) == 1).await;
    let (rejection, _running, _waiting) =
        queue_full_rejection(&admission, &store, 40, Duration::ZERO).await;
    // 40 × 25 ms = 1 s at the full rate, 4 s at a quarter of it.
    assert_eq!(rejection.retry_after(), Some(Duration::from_secs(4)));

    // A slow engine never yields more than the 120 s cap.
    let (admission, _pool, store) = setup(100, policy);
    admission.set_service_time_probe(|| Some(Duration::from_secs(5)));
    let (rejection, _running, _waiting) =
        queue_full_rejection(&admission, &store, 200, Duration::ZERO).await;
    assert_eq!(rejection.retry_after(), Some(MAX_RETRY_AFTER));
}

#[tokio::test(start_paused = true)]
async fn without_any_timing_a_full_queue_waits_as_long_as_its_oldest_entry() {
    let policy = "[tenants.a]\nmax_concurrency = 1\nqueue_depth = 1\n";
    let (admission, _pool, store) = setup(100, policy);
    // The engine has not timed a step yet.
    admission.set_service_time_probe(|| None::<ServiceTime>);
    let (rejection, _running, _waiting) =
        queue_full_rejection(&admission, &store, 200, Duration::from_millis(7300)).await;
    assert_eq!(rejection.retry_after(), Some(Duration::from_millis(7300)));

    // A fresh queue has waited for nothing yet: the 1 s floor.
    let (admission, _pool, store) = setup(100, policy);
    let (rejection, _running, _waiting) =
        queue_full_rejection(&admission, &store, 200, Duration::ZERO).await;
    assert_eq!(rejection.retry_after(), Some(MIN_CAPACITY_RETRY_AFTER));
}

#[tokio::test(start_paused = true)]
async fn a_measured_drain_rate_wins_over_the_service_time_prior() {
    let policy = "[tenants.a]\nmax_concurrency = 1\nqueue_depth = 1\n";
    let (admission, _pool, store) = setup(100, policy);
    admission.set_service_time_probe(|| Some(Duration::from_secs(1)));
    // Teach the drain rate: 160 tokens of capacity back per second.
    for _ in 0..2 {
        let mut done = admission.admit(ticket(&store, "a", 80, 80)).await.unwrap();
        // Running for a second of the pool's busy time (idle time does not count).
        tokio::time::advance(Duration::from_secs(1)).await;
        done.record_completion(80);
        drop(done);
    }
    // The queued entry holds 20 + 300 = 320 tokens: 2 s at 160 tokens/s (not 300 s).
    let (rejection, _running, _waiting) =
        queue_full_rejection(&admission, &store, 300, Duration::ZERO).await;
    assert_eq!(rejection.retry_after(), Some(Duration::from_secs(2)));
}

/// A machine of 10 ms per step, 1 ms per prompt token and 5 ms per decoding sequence.
const MODEL_COST: StepCost = StepCost {
    per_step_us: 10_000.0,
    per_prefill_token_us: 1_000.0,
    per_decode_seq_us: 5_000.0,
    per_attended_token_ns: 0.0,
};

#[test]
fn the_step_cost_model_prices_the_running_requests_prefill_and_decodes() {
    let ledger = ledger::Ledger::default();
    ledger.set_service_time_probe(Arc::new(|| Some(ServiceTime::Model(MODEL_COST))));
    let footprint = ledger::Footprint {
        reserved_tokens: 160,
        prompt_tokens: 100,
        output_tokens: 60,
    };
    assert_eq!(
        ledger.per_token_service_time(PoolId::LOCAL),
        Some(Duration::from_millis(15)),
        "nothing runs: one sequence's step, 10 + 5 ms"
    );
    let started_at = tokio::time::Instant::now();
    ledger.start("a", PoolId::LOCAL, Lane::Short, footprint, started_at);
    ledger.start("a", PoolId::LOCAL, Lane::Short, footprint, started_at);
    let millis = |tokens| {
        ledger
            .kv_drain_time(PoolId::LOCAL, tokens)
            .map(|t| t.as_secs_f64() * 1e3)
            .map(f64::round)
    };
    // Two running: a step of 10 + 2 × 5 ms serves two tokens, 10 ms each. Their capacity (320
    // tokens) comes back after both prompts (2 × 100 ms) and 120 tokens (1.2 s).
    assert_eq!(
        ledger.per_token_service_time(PoolId::LOCAL),
        Some(Duration::from_millis(10))
    );
    assert_eq!(millis(320), Some(1400.0));
    // More than that needs another generation like them: prompts again, then 120 tokens.
    assert_eq!(millis(321), Some(2800.0));
    // Their first tokens: the prefills are done and 118 tokens are left.
    ledger.generated(PoolId::LOCAL, 100);
    ledger.generated(PoolId::LOCAL, 100);
    assert_eq!(millis(320), Some(1180.0));
    // One ends without reporting (an opaque stream): the totals lose exactly its share.
    let slot = ledger::SlotUse {
        started_at,
        ran: true,
    };
    ledger.finish("a", PoolId::LOCAL, Lane::Short, footprint, (59, 0), slot);
    // One running, 59 tokens left at 15 ms.
    assert_eq!(millis(160), Some(885.0));
    let stats = kvgate_runtime::engine::EngineStats {
        step_cost: MODEL_COST,
        ..Default::default()
    };
    assert_eq!(
        engine_service_time(&stats),
        Some(ServiceTime::Model(MODEL_COST)),
        "the engine's published fit"
    );
}

/// A step cost of 25 ms and nothing else: one sequence decodes at 25 ms per token and prompts
/// cost nothing.
const STEP_25MS: StepCost = StepCost {
    per_step_us: 25_000.0,
    per_prefill_token_us: 0.0,
    per_decode_seq_us: 0.0,
    per_attended_token_ns: 0.0,
};

/// The 48 MiB scenario in miniature: with the engine's cost model wired in, the forecast
/// exists before any step has been timed, so what cannot start in time is refused when it is
/// enqueued (no time passes), not at the first re-forecast after a measurement.
#[tokio::test(start_paused = true)]
async fn with_the_cost_model_a_burst_is_refused_at_enqueue_before_any_step() {
    let policy = "[tenants.a]\nmax_queue_wait = \"3500ms\"\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, _pool, store) = setup(20, policy);
    // 25 ms per step and nothing else: one sequence decodes at 25 ms per token and prompts
    // cost nothing, so the forecasts are those of the re-forecast test below.
    let cost = STEP_25MS;
    admission.set_service_time_probe(move || Some(ServiceTime::Model(cost)));
    let start = tokio::time::Instant::now();
    let holder = admission.admit(ticket(&store, "a", 240, 80)).await.unwrap();
    // The k-th request needs 10·k blocks back: 2 s for the first two, 4 s for the third. A
    // refused request adds nothing to the backlog, so the fourth and fifth are forecast 4 s too.
    let waiting: Vec<_> = (0..5)
        .map(|_| spawn_admit(&admission, ticket(&store, "a", 80, 80)))
        .collect();
    let mut waiting = waiting.into_iter();
    let (fits, late): (Vec<_>, Vec<_>) = (waiting.by_ref().take(2).collect(), waiting.collect());
    for handle in late {
        match handle.await.unwrap() {
            Err(Rejection::KvSaturated { estimated_wait, .. }) => {
                assert_eq!(estimated_wait.as_millis(), 4000);
            }
            other => panic!("expected KvSaturated, got {other:?}"),
        }
    }
    assert_eq!(start.elapsed(), Duration::ZERO, "refused at enqueue");
    assert_eq!(queued(&admission), 2, "2 s of backlog fits 3.5 s");
    drop(holder);
    for handle in fits {
        drop(admitted(handle).await);
    }
}

/// A forecast just inside the deadline is refused at enqueue (within the margin kept for the
/// forecast's error), where the same forecast for a queued request keeps it queued.
#[tokio::test(start_paused = true)]
async fn a_forecast_within_the_margin_of_the_deadline_is_refused_at_enqueue_not_later() {
    // The first waiting request is forecast 2 s (10 blocks back at 25 ms per token, as above).
    let policy = "[tenants.a]\nmax_queue_wait = \"2150ms\"\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, _pool, store) = setup(20, policy);
    let cost = STEP_25MS;
    admission.set_service_time_probe(move || Some(ServiceTime::Model(cost)));
    let holder = admission.admit(ticket(&store, "a", 240, 80)).await.unwrap();
    // 2 s ≤ 2.15 s, but over 90% of it: refused now, not a few seconds into its wait.
    match admission.admit(ticket(&store, "a", 80, 80)).await {
        Err(Rejection::KvSaturated { estimated_wait, .. }) => {
            assert_eq!(estimated_wait.as_millis(), 2000);
        }
        other => panic!("expected KvSaturated, got {other:?}"),
    }
    drop(holder);

    // With 2.25 s the same forecast is within the margin: the request queues, and a re-forecast
    // of 2 s against the 2 s it has left after the first re-forecast period keeps it queued (no
    // engine runs here, so the forecast does not shrink as a real one would).
    let policy = "[tenants.a]\nmax_queue_wait = \"2250ms\"\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, pool, store) = setup(20, policy);
    admission.set_service_time_probe(move || Some(ServiceTime::Model(cost)));
    let holder = admission.admit(ticket(&store, "a", 240, 80)).await.unwrap();
    let waiting = spawn_admit(&admission, ticket(&store, "a", 80, 80));
    until(|| queued(&admission) == 1).await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(queued(&admission), 1, "still queued after a re-forecast");
    drop(holder);
    let admitted = admitted(waiting).await;
    assert_eq!(admitted.reserved_blocks(), 10);
    drop(admitted);
    assert_eq!(pool.snapshot().reserved_blocks, 0);
}

#[tokio::test(start_paused = true)]
async fn rate_limits_apply_before_queueing() {
    let (admission, _pool, store) = setup(
        100,
        "[tenants.a]\nrequests_per_minute = 1\ntokens_per_minute = 100\n",
    );
    let rejection = admission
        .admit(ticket(&store, "a", 60, 50))
        .await
        .unwrap_err();
    assert_eq!(
        (rejection.code(), rejection.should_retry()),
        ("insufficient_quota", false)
    );
    let _first = admission.admit(ticket(&store, "a", 10, 10)).await.unwrap();
    let rejection = admission
        .admit(ticket(&store, "a", 10, 10))
        .await
        .unwrap_err();
    assert_eq!(rejection.code(), "rate_limit_exceeded");
    assert_eq!(rejection.retry_after(), Some(Duration::from_secs(60)));
}

#[tokio::test(start_paused = true)]
async fn completion_refunds_unused_tokens() {
    let (admission, _pool, store) = setup(100, "[tenants.a]\ntokens_per_minute = 1000\n");
    let tenant = store.current().tenant("a").unwrap();
    let mut running = admission
        .admit(ticket(&store, "a", 100, 200))
        .await
        .unwrap();
    assert_eq!(
        running.rate_headers().tokens.map(|s| s.remaining),
        Some(700)
    );
    running.record_completion(20);
    drop(running);
    assert_eq!(
        admission.rate_headers(&tenant).tokens.map(|s| s.remaining),
        Some(880)
    );
}

#[tokio::test(start_paused = true)]
async fn a_backlog_that_cannot_drain_in_time_is_refused_at_once() {
    let (admission, pool, store) = setup(
        20,
        "[tenants.a]\n[tenants.quick]\nmax_queue_wait = \"500ms\"\n[kv]\nhigh_watermark = 1.0\n",
    );
    // Teach the drain-rate estimate: 10 blocks (160 tokens) returned per second.
    for _ in 0..2 {
        let mut done = admission.admit(ticket(&store, "a", 80, 80)).await.unwrap();
        // Running for a second of the pool's busy time (idle time does not count).
        tokio::time::advance(Duration::from_secs(1)).await;
        done.record_completion(80);
        drop(done);
    }
    let _full = pool.try_reserve(20).unwrap();
    // Needs 10 blocks = 160 tokens of capacity back: about 1 s, more than 500 ms.
    let rejection = admission
        .admit(ticket(&store, "quick", 80, 80))
        .await
        .unwrap_err();
    match &rejection {
        Rejection::KvSaturated {
            needed_blocks: 10,
            estimated_wait,
            retry_after,
            ..
        } => {
            assert_eq!(*estimated_wait, Duration::from_secs(1));
            assert_eq!(*retry_after, Duration::from_secs(1));
        }
        other => panic!("expected KvSaturated, got {other:?}"),
    }
    assert_eq!(
        (rejection.status(), rejection.code()),
        (429, "kv_cache_saturated")
    );
    // A tenant that may wait longer is queued instead.
    let patient = spawn_admit(&admission, ticket(&store, "a", 80, 80));
    until(|| queued(&admission) == 1).await;
    patient.abort();
}

#[tokio::test(start_paused = true)]
async fn a_guard_dropped_before_the_engine_took_its_reservation_refunds_everything() {
    let (admission, pool, store) = setup(
        100,
        "[tenants.a]\nrequests_per_minute = 5\ntokens_per_minute = 1000\n",
    );
    let tenant = store.current().tenant("a").unwrap();
    drop(
        admission
            .admit(ticket(&store, "a", 100, 100))
            .await
            .unwrap(),
    );
    let headers = admission.rate_headers(&tenant);
    assert_eq!(headers.requests.map(|s| s.remaining), Some(5));
    assert_eq!(headers.tokens.map(|s| s.remaining), Some(1000));
    assert_eq!(pool.snapshot().reserved_blocks, 0);

    // Once the engine accepted it the request ran: without a count of what it generated the
    // full charge stays.
    let mut ran = admission
        .admit(ticket(&store, "a", 100, 100))
        .await
        .unwrap();
    let reservation = ran.take_reservation();
    ran.mark_started();
    drop(ran);
    drop(reservation);
    assert_eq!(
        admission.rate_headers(&tenant).tokens.map(|s| s.remaining),
        Some(800)
    );
}

#[tokio::test(start_paused = true)]
async fn a_flooding_tenant_does_not_hold_back_a_newcomer() {
    // Room for exactly one request at a time (4 blocks of 16 tokens each).
    let (admission, _pool, store) = setup(
        4,
        "[tenants.flood]\n[tenants.newcomer]\n[kv]\nhigh_watermark = 1.0\n",
    );
    let running = admission
        .admit(ticket(&store, "flood", 32, 32))
        .await
        .unwrap();
    let floods: Vec<_> = (0..3)
        .map(|_| spawn_admit(&admission, ticket(&store, "flood", 32, 32)))
        .collect();
    until(|| queued(&admission) == 3).await;
    let newcomer = spawn_admit(&admission, ticket(&store, "newcomer", 32, 32));
    until(|| queued(&admission) == 4).await;

    drop(running);
    let admitted_newcomer = admitted(newcomer).await;
    assert_eq!(admitted_newcomer.tenant().name, "newcomer");
    assert!(
        floods.iter().all(|flood| !flood.is_finished()),
        "the newcomer went first"
    );
    drop(admitted_newcomer);
    for flood in floods {
        drop(admitted(flood).await);
    }
}

// === Several pools: the embedded engine's and upstreams' ===

/// Admission over a local pool of `local` blocks and one upstream pool of `upstream` blocks.
fn setup_with_upstream(
    local: usize,
    upstream: usize,
    policy: &str,
) -> (Admission, Arc<BlockPool>, PoolId, PolicyStore) {
    let store = PolicyStore::from_policy(parse_policy("test.toml", &keyed(policy)).unwrap());
    let local = BlockPool::new(local, BLOCK_SIZE, 1024);
    let remote = BlockPool::new(upstream, BLOCK_SIZE, 0);
    let limit = PoolLimit::new(Arc::clone(&remote));
    let admission = Admission::with_pools(store.clone(), local, vec![limit]);
    let id = admission
        .pool_id(&remote)
        .expect("the upstream pool is registered");
    (admission, remote, id, store)
}

fn upstream_ticket(
    store: &PolicyStore,
    pool: PoolId,
    tenant: &str,
    prompt_tokens: usize,
    max_output_tokens: usize,
) -> AdmissionTicket {
    AdmissionTicket {
        pool,
        ..ticket(store, tenant, prompt_tokens, max_output_tokens)
    }
}

#[tokio::test(start_paused = true)]
async fn each_ticket_reserves_from_the_pool_it_names() {
    let (admission, remote, id, store) = setup_with_upstream(10, 20, "[tenants.a]\n");
    assert_ne!(id, PoolId::LOCAL);
    assert_eq!(admission.pool_id(&BlockPool::new(1, 16, 0)), None);
    let upstream = admission
        .admit(upstream_ticket(&store, id, "a", 100, 60))
        .await
        .unwrap();
    assert_eq!((upstream.pool(), upstream.reserved_blocks()), (id, 10));
    assert_eq!(remote.snapshot().reserved_blocks, 10);
    // 10 blocks would not fit the local pool's watermark, but the local pool is untouched.
    let local = admission.admit(ticket(&store, "a", 16, 16)).await.unwrap();
    assert_eq!(local.pool(), PoolId::LOCAL);
    assert_eq!(remote.snapshot().reserved_blocks, 10);
    drop(upstream);
    assert_eq!(remote.snapshot().reserved_blocks, 0, "the guard held it");
    // A request larger than the upstream's whole capacity can never run there.
    let never = admission
        .admit(upstream_ticket(&store, id, "a", 300, 100))
        .await
        .unwrap_err();
    assert_eq!(never.code(), "context_length_exceeded");
    drop(local);
}

#[tokio::test(start_paused = true)]
async fn a_saturated_upstream_does_not_hold_back_the_embedded_engine() {
    let policy = "[tenants.a]\nmax_queue_wait = \"10s\"\n[tenants.b]\n";
    let (admission, remote, id, store) = setup_with_upstream(100, 10, policy);
    let blocker = remote.try_reserve(10).unwrap();
    let waiting = spawn_admit(&admission, upstream_ticket(&store, id, "a", 32, 0));
    until(|| queued(&admission) == 1).await;
    // Past half its max wait the blocked request stops both lanes, of its own pool only.
    tokio::time::advance(Duration::from_secs(6)).await;
    let local = admission.admit(ticket(&store, "b", 200, 10)).await.unwrap();
    assert_eq!(local.pool(), PoolId::LOCAL);
    assert!(!waiting.is_finished());
    // Capacity coming back to the upstream pool wakes its queue.
    drop(blocker);
    let started = admitted(waiting).await;
    assert_eq!((started.pool(), started.reserved_blocks()), (id, 2));
}

/// Admission over a local pool and an upstream pool of `upstream` blocks of which none is usable
/// (every replica ejected), and the limit that moves it.
fn setup_with_ejected_upstream(
    upstream: usize,
    policy: &str,
) -> (
    Admission,
    Arc<BlockPool>,
    Arc<PoolLimit>,
    PoolId,
    PolicyStore,
) {
    let store = PolicyStore::from_policy(parse_policy("test.toml", &keyed(policy)).unwrap());
    let remote = BlockPool::new(upstream, BLOCK_SIZE, 0);
    let limit = PoolLimit::new(Arc::clone(&remote));
    limit.set_usable_blocks(0);
    let local = BlockPool::new(100, BLOCK_SIZE, 1024);
    let admission = Admission::with_pools(store.clone(), local, vec![Arc::clone(&limit)]);
    let id = admission.pool_id(&remote).unwrap();
    (admission, remote, limit, id, store)
}

#[tokio::test(start_paused = true)]
async fn an_upstream_without_usable_capacity_queues_until_its_capacity_comes_back() {
    let policy = "[tenants.a]\nmax_queue_wait = \"30s\"\n";
    let (admission, remote, limit, id, store) = setup_with_ejected_upstream(20, policy);
    let waiting = spawn_admit(&admission, upstream_ticket(&store, id, "a", 32, 32));
    until(|| queued(&admission) == 1).await;
    // Every block of the pool is free, but none is usable: the request waits, well past
    // several re-forecasts, with nothing reserved.
    tokio::time::advance(Duration::from_secs(5)).await;
    until(|| queued(&admission) == 1).await;
    assert!(!waiting.is_finished());
    assert_eq!(remote.snapshot().reserved_blocks, 0);
    // One replica readmitted: part of the pool comes back, and the raise itself wakes the
    // dispatcher (`until` never lets paused time reach the next re-forecast).
    limit.set_usable_blocks(10);
    until(|| waiting.is_finished()).await;
    let started = admitted(waiting).await;
    assert_eq!((started.pool(), started.reserved_blocks()), (id, 4));
    // A second one would pass the watermark of the 10 usable blocks (90%: 9), not of the 20.
    let second = spawn_admit(&admission, upstream_ticket(&store, id, "a", 64, 32));
    until(|| queued(&admission) == 1).await;
    limit.set_usable_blocks(20);
    until(|| second.is_finished()).await;
    assert_eq!(admitted(second).await.reserved_blocks(), 6);
}

#[tokio::test(start_paused = true)]
async fn a_pool_added_while_serving_gates_its_requests_like_the_others() {
    let (admission, _pool, store) = setup(100, "[tenants.a]\nmax_queue_wait = \"30s\"\n");
    let remote = BlockPool::new(20, BLOCK_SIZE, 0);
    let limit = PoolLimit::new(Arc::clone(&remote));
    limit.set_usable_blocks(0);
    let id = admission.add_pool(Arc::clone(&limit));
    assert_ne!(id, PoolId::LOCAL);
    assert_eq!(admission.pool_id(&remote), Some(id));
    assert_eq!(admission.add_pool(Arc::clone(&limit)), id, "added once");
    // No usable capacity yet: the request waits in the fair queue, and the upkeep task, which
    // learnt of the pool when it was added, starts it once its capacity is raised.
    let waiting = spawn_admit(&admission, upstream_ticket(&store, id, "a", 32, 32));
    until(|| queued(&admission) == 1).await;
    assert!(!waiting.is_finished());
    limit.set_usable_blocks(20);
    until(|| waiting.is_finished()).await;
    let started = admitted(waiting).await;
    assert_eq!((started.pool(), started.reserved_blocks()), (id, 4));
    assert_eq!(remote.snapshot().reserved_blocks, 4);
    // Its watermark is its own: 90% of 20 = 18 blocks, so 14 more fit and 15 do not.
    drop(
        admission
            .admit(upstream_ticket(&store, id, "a", 14 * 16, 0))
            .await
            .unwrap(),
    );
    let over = spawn_admit(&admission, upstream_ticket(&store, id, "a", 15 * 16, 0));
    until(|| queued(&admission) == 1).await;
    drop(started);
    drop(admitted(over).await);
}

#[tokio::test(start_paused = true)]
async fn an_upstream_without_usable_capacity_answers_queue_timeout_at_the_deadline() {
    let policy = "[tenants.a]\nmax_queue_wait = \"1s\"\n";
    let (admission, _remote, _limit, id, store) = setup_with_ejected_upstream(20, policy);
    let waiting = spawn_admit(&admission, upstream_ticket(&store, id, "a", 32, 32));
    let rejection = waiting.await.unwrap().unwrap_err();
    assert_eq!(rejection.code(), "queue_timeout", "{}", rejection.message());
}

#[tokio::test(start_paused = true)]
async fn a_request_started_upstream_keeps_its_token_charge() {
    let policy = "[tenants.a]\ntokens_per_minute = 1000\n";
    let (admission, _remote, id, store) = setup_with_upstream(10, 100, policy);
    let tenant = store.current().tenant("a").unwrap();
    let remaining = || admission.rate_headers(&tenant).tokens.map(|s| s.remaining);

    // Refused or unreachable upstream: never started, everything comes back.
    let unstarted = admission
        .admit(upstream_ticket(&store, id, "a", 100, 100))
        .await
        .unwrap();
    assert_eq!(remaining(), Some(800));
    drop(unstarted);
    assert_eq!(remaining(), Some(1000));

    // Forwarded: its real size is unknown, so the whole up-front charge stays.
    let mut started = admission
        .admit(upstream_ticket(&store, id, "a", 100, 100))
        .await
        .unwrap();
    started.mark_started();
    drop(started);
    assert_eq!(remaining(), Some(800));
}

// === Issue 16: fair forecasts, exact refunds, reloads ===

/// Teaches `admission` a drain rate of 160 tokens (10 blocks) of capacity per second.
async fn teach_drain_rate(admission: &Admission, store: &PolicyStore, tenant: &str) {
    for _ in 0..2 {
        let mut done = admission
            .admit(ticket(store, tenant, 80, 80))
            .await
            .unwrap();
        // Running for a second of the pool's busy time (idle time does not count).
        tokio::time::advance(Duration::from_secs(1)).await;
        done.record_completion(80);
        drop(done);
    }
}

#[tokio::test(start_paused = true)]
async fn another_tenants_backlog_does_not_refuse_a_newcomer_the_fair_queue_would_serve() {
    let policy = "[tenants.flood]\nmax_queue_wait = \"600s\"\n\
                  [tenants.quick]\nmax_queue_wait = \"3s\"\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, pool, store) = setup(20, policy);
    teach_drain_rate(&admission, &store, "flood").await;
    let full = pool.try_reserve(20).unwrap();
    // The flood queues 100 blocks: about 10 s of drain, all of it ahead of nobody but itself.
    let floods: Vec<_> = (0..10)
        .map(|_| spawn_admit(&admission, ticket(&store, "flood", 80, 80)))
        .collect();
    until(|| queued(&admission) == 10).await;
    // The newcomer's own 10 blocks plus its fair share of the flood's (another 10): about
    // 2 s, within its 3 s. Summing everyone's backlog (11 s) would refuse it.
    let quick = spawn_admit(&admission, ticket(&store, "quick", 80, 80));
    until(|| queued(&admission) == 11 || quick.is_finished()).await;
    assert!(!quick.is_finished(), "{:?}", quick.await.unwrap().err());
    drop(full);
    let started = admitted(quick).await;
    assert_eq!(started.tenant().name, "quick");
    drop(started);
    for flood in floods {
        flood.abort();
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_whose_submit_failed_is_refunded_in_full() {
    let (admission, pool, store) = setup(
        100,
        "[tenants.a]\nrequests_per_minute = 5\ntokens_per_minute = 1000\n",
    );
    let tenant = store.current().tenant("a").unwrap();
    let mut admitted = admission
        .admit(ticket(&store, "a", 100, 100))
        .await
        .unwrap();
    // The handler hands the reservation to the engine, which refuses the request (QueueFull,
    // ShutDown) and releases the reservation with it.
    drop(admitted.take_reservation());
    drop(admitted);
    let headers = admission.rate_headers(&tenant);
    assert_eq!(headers.requests.map(|s| s.remaining), Some(5));
    assert_eq!(headers.tokens.map(|s| s.remaining), Some(1000));
    assert_eq!(pool.snapshot().reserved_blocks, 0);
}

/// A policy store backed by a real file, so tests can reload it. The file is removed when the
/// returned guard drops (on a panic too): keep it for the whole test.
fn setup_reloadable(
    blocks: usize,
    policy: &str,
) -> (Admission, Arc<BlockPool>, PolicyStore, tempfile::TempPath) {
    let file = tempfile::Builder::new()
        .prefix("kvgate-admission-")
        .suffix(".toml")
        .tempfile()
        .unwrap()
        .into_temp_path();
    std::fs::write(&file, keyed(policy)).unwrap();
    let store = PolicyStore::load(&file).unwrap();
    let pool = BlockPool::new(blocks, BLOCK_SIZE, 1024);
    (
        Admission::new(store.clone(), Arc::clone(&pool)),
        pool,
        store,
        file,
    )
}

fn reload(store: &PolicyStore, policy: &str) {
    std::fs::write(store.path(), keyed(policy)).unwrap();
    store.reload().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_reload_that_lowers_the_watermark_refuses_queued_requests_that_no_longer_fit() {
    let policy = "[tenants.a]\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, pool, store, _policy_file) = setup_reloadable(10, policy);
    let blocker = pool.try_reserve(10).unwrap();
    let big = spawn_admit(&admission, ticket(&store, "a", 128, 0)); // 8 blocks
    let small = spawn_admit(&admission, ticket(&store, "a", 32, 0)); // 2 blocks
    until(|| queued(&admission) == 2).await;
    // 8 blocks can never be reserved under 0.5 × 10: refused as if it had just arrived.
    reload(&store, "[tenants.a]\n[kv]\nhigh_watermark = 0.5\n");
    let rejection = big.await.unwrap().unwrap_err();
    assert_eq!(
        rejection,
        Rejection::NeverFits {
            needed_blocks: 8,
            total_blocks: 10,
            limit_blocks: 5,
            limit: NeverFitsLimit::Watermark,
            param: "messages",
        }
    );
    // The request behind it is no longer stuck behind a request that can never start.
    drop(blocker);
    let started = admitted(small).await;
    assert_eq!(started.reserved_blocks(), 2);
    let _ = std::fs::remove_file(store.path());
}

#[tokio::test(start_paused = true)]
async fn a_reload_refuses_the_queued_requests_of_a_removed_key_and_applies_new_limits() {
    let policy = "[tenants.a]\nmax_queue_wait = \"60s\"\n[tenants.b]\n";
    let (admission, pool, store, _policy_file) = setup_reloadable(10, policy);
    let blocker = pool.try_reserve(10).unwrap();
    let start = tokio::time::Instant::now();
    let removed = spawn_admit(&admission, ticket(&store, "b", 16, 16));
    let kept = spawn_admit(&admission, ticket(&store, "a", 16, 16));
    until(|| queued(&admission) == 2).await;
    reload(&store, "[tenants.a]\nmax_queue_wait = \"2s\"\n");
    let rejection = removed.await.unwrap().unwrap_err();
    assert_eq!(
        (rejection.status(), rejection.code()),
        (401, "invalid_api_key")
    );
    // a's new max_queue_wait applies to the request already queued.
    let rejection = kept.await.unwrap().unwrap_err();
    assert_eq!(rejection.code(), "queue_timeout");
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    drop(blocker);
    let _ = std::fs::remove_file(store.path());
}

#[tokio::test(start_paused = true)]
async fn a_reload_that_rotates_or_moves_a_key_refuses_the_requests_queued_under_it() {
    let (admission, pool, store, _policy_file) =
        setup_reloadable(10, "[tenants.a]\n[tenants.b]\n[tenants.c]\n");
    let blocker = pool.try_reserve(10).unwrap();
    let rotated = spawn_admit(&admission, ticket(&store, "a", 16, 16));
    let moved = spawn_admit(&admission, ticket(&store, "b", 16, 16));
    let kept = spawn_admit(&admission, ticket(&store, "c", 16, 16));
    until(|| queued(&admission) == 3).await;
    // a's key is replaced, b's now belongs to tenant d; c keeps its key. The tenants' names
    // all stay, so only the credential can tell.
    let hash = |name: &str| crate::auth::hash_key(&format!("test-key-{name}"));
    let next = format!(
        "[tenants.a]\nkey_sha256 = [\"{}\"]\n[tenants.b]\n[tenants.c]\nkey_sha256 = [\"{}\"]\n\
         [tenants.d]\nkey_sha256 = [\"{}\"]\n",
        hash("a-rotated"),
        hash("c"),
        hash("b"),
    );
    std::fs::write(store.path(), next).unwrap();
    store.reload().unwrap();
    for (queued, tenant) in [(rotated, "a"), (moved, "b")] {
        let rejection = queued.await.unwrap().unwrap_err();
        assert_eq!(
            (rejection.status(), rejection.code()),
            (401, "invalid_api_key"),
            "tenant {tenant}"
        );
    }
    assert_eq!(queued(&admission), 1, "c's request still waits");
    drop(blocker);
    let admitted = kept
        .await
        .unwrap()
        .expect("an unchanged key keeps its place");
    drop(admitted);
    let _ = std::fs::remove_file(store.path());
}

#[tokio::test(start_paused = true)]
async fn a_reload_that_lowers_queue_and_length_limits_refuses_the_queued_requests_over_them() {
    let (admission, pool, store, _policy_file) = setup_reloadable(10, "[tenants.a]\n");
    let blocker = pool.try_reserve(10).unwrap();
    // Queued in this order: 32, 80, 32 and 32 tokens.
    let first = spawn_admit(&admission, ticket(&store, "a", 16, 16));
    until(|| queued(&admission) == 1).await;
    let long_prompt = spawn_admit(&admission, ticket(&store, "a", 64, 16));
    until(|| queued(&admission) == 2).await;
    let third = spawn_admit(&admission, ticket(&store, "a", 16, 16));
    until(|| queued(&admission) == 3).await;
    let fourth = spawn_admit(&admission, ticket(&store, "a", 16, 16));
    until(|| queued(&admission) == 4).await;

    reload(
        &store,
        "[tenants.a]\nqueue_depth = 2\nmax_input_tokens = 32\n",
    );
    // Over the new input limit: validation's own error, naming the ticket's prompt field (a
    // chat request's `messages`).
    let rejection = long_prompt.await.unwrap().unwrap_err();
    assert_eq!(
        (rejection.status(), rejection.code(), rejection.param()),
        (400, "context_length_exceeded", Some("messages"))
    );
    assert!(
        rejection.message().contains("maximum input length is 32"),
        "{}",
        rejection.message()
    );
    // Of the three left, the oldest two fit the new depth; the youngest is refused.
    let rejection = fourth.await.unwrap().unwrap_err();
    assert_eq!((rejection.status(), rejection.code()), (429, "queue_full"));
    assert!(rejection.retry_after().is_some());
    assert_eq!(queued(&admission), 2);

    // A token bound of 40 holds one of the two 32-token requests: the younger goes.
    reload(
        &store,
        "[tenants.a]\nqueue_depth = 2\nmax_input_tokens = 32\nqueue_tokens = 40\n",
    );
    let rejection = third.await.unwrap().unwrap_err();
    assert_eq!(rejection.code(), "queue_full");
    assert!(
        rejection.message().contains("tokens"),
        "{}",
        rejection.message()
    );
    assert_eq!(queued(&admission), 1);

    assert_eq!(queued(&admission), 1);
    drop(blocker);
    assert_eq!(admitted(first).await.reserved_blocks(), 2);
    let _ = std::fs::remove_file(store.path());
}

#[tokio::test(start_paused = true)]
async fn a_reload_that_lowers_the_output_limit_refuses_the_queued_requests_over_it() {
    let (admission, pool, store, _policy_file) = setup_reloadable(10, "[tenants.a]\n");
    let blocker = pool.try_reserve(10).unwrap();
    let short = spawn_admit(&admission, ticket(&store, "a", 8, 16));
    let long = spawn_admit(&admission, ticket(&store, "a", 8, 24));
    until(|| queued(&admission) == 2).await;
    reload(&store, "[tenants.a]\nmax_output_tokens = 20\n");
    // Validation's own error for a max_tokens over the tenant's limit.
    let rejection = long.await.unwrap().unwrap_err();
    assert_eq!(
        (rejection.status(), rejection.code(), rejection.param()),
        (400, "invalid_value", Some("max_tokens"))
    );
    assert!(
        rejection.message().contains("20"),
        "{}",
        rejection.message()
    );
    assert_eq!(queued(&admission), 1);
    drop(blocker);
    assert_eq!(admitted(short).await.reserved_blocks(), 2);
    let _ = std::fs::remove_file(store.path());
}

#[tokio::test(start_paused = true)]
async fn every_stage_settles_the_debit_exactly() {
    let (admission, _pool, store) = setup(100, "[tenants.a]\ntokens_per_minute = 1000\n");
    let tenant = store.current().tenant("a").unwrap();
    let remaining = || admission.rate_headers(&tenant).tokens.map(|s| s.remaining);
    let start = || async {
        admission
            .admit(ticket(&store, "a", 100, 200))
            .await
            .unwrap()
    };

    // Refused by the engine before it started: nothing is charged.
    let mut refused = start().await;
    drop(refused.take_reservation());
    refused.mark_failed_before_start();
    assert_eq!(refused.stage(), Stage::FailedBeforeStart);
    refused.record_generated(); // ignored: it never ran
    drop(refused);
    assert_eq!(remaining(), Some(1000));

    // Cancelled (client gone, request timeout) after 7 tokens: prompt + 7.
    let mut cancelled = start().await;
    cancelled.mark_started();
    for _ in 0..7 {
        cancelled.record_generated();
    }
    assert_eq!(cancelled.stage(), Stage::Running { generated: Some(7) });
    drop(cancelled);
    assert_eq!(remaining(), Some(1000 - 107));

    // Finished with 20 tokens: prompt + 20, whatever was counted on the way.
    let mut finished = start().await;
    finished.mark_started();
    finished.record_generated();
    finished.record_completion(20);
    finished.mark_failed_before_start(); // too late: it ran
    drop(finished);
    assert_eq!(remaining(), Some(1000 - 107 - 120));
}

#[tokio::test(start_paused = true)]
async fn admission_never_runs_more_than_the_engine_queue_takes() {
    let (admission, _pool, store) = setup(100, "[tenants.a]\nmax_concurrency = 10\n");
    admission.limit_in_flight(PoolId::LOCAL, 2);
    let first = admission.admit(ticket(&store, "a", 16, 16)).await.unwrap();
    let second = admission.admit(ticket(&store, "a", 16, 16)).await.unwrap();
    let third = spawn_admit(&admission, ticket(&store, "a", 16, 16));
    until(|| queued(&admission) == 1).await;
    assert!(
        !third.is_finished(),
        "a third would overflow the engine queue"
    );
    drop(first);
    drop(admitted(third).await);
    drop(second);
}

#[tokio::test(start_paused = true)]
async fn queued_requests_the_forecast_says_cannot_start_in_time_are_refused_at_once() {
    let policy = "[tenants.a]\nmax_queue_wait = \"3500ms\"\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, _pool, store) = setup(20, policy);
    // Holds the whole pool (320 tokens of capacity) with 80 tokens left to generate.
    let holder = admission.admit(ticket(&store, "a", 240, 80)).await.unwrap();
    let start = tokio::time::Instant::now();
    // No drain rate and no service time yet: nothing to forecast with, so all five wait.
    let waiting: Vec<_> = (0..5)
        .map(|_| spawn_admit(&admission, ticket(&store, "a", 80, 80))) // 10 blocks each
        .collect();
    until(|| queued(&admission) == 5).await;
    // The engine times a step: 25 ms per token. The holder's 320 tokens of capacity come back
    // when its 80 tokens are done (2 s); each further 320 tokens take another 2 s. The k-th
    // request needs 10·k blocks (160·k tokens) back: 2, 2, 4, 4 and 6 s.
    admission.set_service_time_probe(|| Some(Duration::from_millis(25)));
    let mut waiting = waiting.into_iter();
    let (fits, late): (Vec<_>, Vec<_>) = (waiting.by_ref().take(2).collect(), waiting.collect());
    for (handle, forecast) in late.into_iter().zip([4, 4, 6]) {
        match handle.await.unwrap() {
            Err(Rejection::KvSaturated {
                estimated_wait,
                retry_after,
                ..
            }) => {
                assert_eq!(estimated_wait, Duration::from_secs(forecast));
                assert_eq!(retry_after, Duration::from_secs(forecast));
            }
            other => panic!("expected KvSaturated, got {other:?}"),
        }
    }
    assert!(
        start.elapsed() <= REFORECAST_EVERY,
        "refused at the next re-forecast, not at the deadline: {:?}",
        start.elapsed()
    );
    assert_eq!(queued(&admission), 2, "2 s of backlog fits 3.5 s");
    drop(holder);
    for handle in fits {
        drop(admitted(handle).await);
    }
}

#[tokio::test(start_paused = true)]
async fn upstream_pools_learn_a_drain_rate_and_refuse_what_cannot_start_in_time() {
    let policy =
        "[tenants.a]\n[tenants.quick]\nmax_queue_wait = \"500ms\"\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, remote, id, store) = setup_with_upstream(10, 20, policy);
    // Two forwarded requests of a second each; their bodies are never metered (no completion
    // count), yet each end returns 160 tokens of capacity: 160 tokens per second.
    for _ in 0..2 {
        let mut forwarded = admission
            .admit(upstream_ticket(&store, id, "a", 80, 80))
            .await
            .unwrap();
        forwarded.mark_started();
        tokio::time::advance(Duration::from_secs(1)).await;
        drop(forwarded);
    }
    let _full = remote.try_reserve(20).unwrap();
    let rejection = admission
        .admit(upstream_ticket(&store, id, "quick", 80, 80))
        .await
        .unwrap_err();
    match rejection {
        Rejection::KvSaturated { estimated_wait, .. } => {
            assert_eq!(estimated_wait, Duration::from_secs(1));
        }
        other => panic!("expected KvSaturated, got {other:?}"),
    }
}

/// A ticket whose prompt starts with the `cached` tokens 0, 1, 2… and has one more token.
fn prefixed_ticket(store: &PolicyStore, cached: usize, max_output: usize) -> AdmissionTicket {
    let mut prompt: Vec<u32> = (0..cached as u32).collect();
    prompt.push(9_999);
    AdmissionTicket {
        prefix: Some(PromptPrefix {
            salt: "tenant:a".into(),
            prompt_ids: prompt.into(),
        }),
        ..ticket(store, "a", cached + 1, max_output)
    }
}

#[tokio::test(start_paused = true)]
async fn a_cached_prefix_is_pinned_at_admission_and_only_the_rest_is_reserved() {
    let policy = "[tenants.a]\nmax_concurrency = 64\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, pool, store) = setup(20, policy);
    // A running sequence holds a computed 160-token prompt: 10 blocks, registered.
    let prompt: Vec<u32> = (0..160).collect();
    let mut holder = Vec::new();
    assert!(pool.allocate_n(10, &mut pool.empty_reservation(), &mut holder));
    pool.register_full_blocks("tenant:a", &holder, &prompt, &mut Vec::new());

    // 161 + 15 tokens = 11 blocks each, 10 of them cached: 5 such requests start at once in
    // the 10 free blocks, where without the cache not even one would (11 > 10).
    let mut running = Vec::new();
    for _ in 0..5 {
        let admitted = admission
            .admit(prefixed_ticket(&store, 160, 15))
            .await
            .expect("1 new block each fits");
        assert_eq!(admitted.reserved_blocks(), 1);
        running.push(admitted);
    }
    let occ = pool.snapshot();
    assert_eq!((occ.used_blocks, occ.reserved_blocks), (10, 5));
    let uncached = spawn_admit(&admission, ticket(&store, "a", 161, 15));
    until(|| queued(&admission) == 1).await;
    uncached.abort();
    until(|| queued(&admission) == 0).await;

    // The sequence that computed the prefix finishes: the admitted requests' pins keep it in
    // use, so it cannot be evicted before they are scheduled.
    pool.free(&holder);
    let occ = pool.snapshot();
    assert_eq!((occ.used_blocks, occ.cached_blocks), (10, 0));
    // A guard dropped before the engine took its reservation (a cancelled client, a failed
    // submit) releases its pin with its reservation; the last one leaves the prefix cached.
    drop(running.pop());
    assert_eq!(pool.snapshot().reserved_blocks, 4);
    drop(running);
    let occ = pool.snapshot();
    assert_eq!(
        (
            occ.used_blocks,
            occ.reserved_blocks,
            occ.free_blocks,
            occ.cached_blocks
        ),
        (0, 0, 20, 10)
    );
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_pins_its_prefix_when_it_is_dispatched() {
    let policy = "[tenants.a]\nmax_concurrency = 64\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, pool, store) = setup(20, policy);
    let prompt: Vec<u32> = (0..160).collect();
    let mut holder = Vec::new();
    assert!(pool.allocate_n(10, &mut pool.empty_reservation(), &mut holder));
    pool.register_full_blocks("tenant:a", &holder, &prompt, &mut Vec::new());
    let blocker = pool.try_reserve(10).expect("the other 10 are free");
    let waiting = spawn_admit(&admission, prefixed_ticket(&store, 160, 15));
    until(|| queued(&admission) == 1).await;
    // The prefix goes free but stays cached while the request waits; one block for the rest.
    pool.free(&holder);
    drop(blocker);
    let admitted = admitted(waiting).await;
    assert_eq!(admitted.reserved_blocks(), 1);
    let occ = pool.snapshot();
    // The cached blocks were free, so pinning them took them like an allocation.
    assert_eq!(
        (occ.used_blocks, occ.reserved_blocks, occ.cached_blocks),
        (10, 1, 0)
    );
    drop(admitted);
    assert_eq!(pool.snapshot().cached_blocks, 10);
}

/// Admission with a drain rate of 10 blocks a second, a 2.5 s queue wait, a running sequence
/// computing a 160-token prompt (10 blocks, not registered yet) and the rest of the pool taken;
/// two requests sharing that prompt queued before it is cached (11 blocks each, 2.2 s of drain).
async fn two_queued_before_their_prompt_is_cached() -> (
    Admission,
    Arc<BlockPool>,
    PolicyStore,
    Vec<BlockId>,
    Vec<JoinHandle<Result<Admitted, Rejection>>>,
    Reservation,
) {
    let policy = "[tenants.a]\nmax_concurrency = 64\nmax_queue_wait = \"2500ms\"\n\
                  [kv]\nhigh_watermark = 1.0\n";
    let (admission, pool, store) = setup(50, policy);
    teach_drain_rate(&admission, &store, "a").await;
    let mut holder = Vec::new();
    assert!(pool.allocate_n(10, &mut pool.empty_reservation(), &mut holder));
    let full = pool.try_reserve(40).expect("the other 40 are free");
    let waiting: Vec<_> = (0..2)
        .map(|_| spawn_admit(&admission, prefixed_ticket(&store, 160, 15)))
        .collect();
    until(|| queued(&admission) == 2).await;
    (admission, pool, store, holder, waiting, full)
}

fn register_prompt(pool: &BlockPool, holder: &[BlockId]) {
    let prompt: Vec<u32> = (0..160).collect();
    pool.register_full_blocks("tenant:a", holder, &prompt, &mut Vec::new());
}

#[tokio::test(start_paused = true)]
async fn requests_queued_before_their_prompt_was_cached_do_not_refuse_a_newcomer() {
    let (admission, pool, store, holder, waiting, _full) =
        two_queued_before_their_prompt_is_cached().await;
    // While the prompt is not cached a third would need 11 blocks too: 33 in all, 3.3 s. Once
    // it is, the third adds 1 block. Counting the queued two as enqueued (22 blocks) it
    // would still be forecast at 2.3 s and refused; re-estimated, the backlog is 3 blocks.
    register_prompt(&pool, &holder);
    let third = spawn_admit(&admission, prefixed_ticket(&store, 160, 15));
    until(|| queued(&admission) == 3 || third.is_finished()).await;
    assert!(!third.is_finished(), "{:?}", third.await.unwrap().err());
    third.abort();
    for handle in waiting {
        handle.abort();
    }
}

/// How many of the two stay queued 600 ms on, when the youngest has 1.9 s left and its
/// forecast, counting what was queued as it was enqueued, is 2.2 s.
async fn queued_after_600ms(prompt_cached: bool) -> usize {
    let (admission, pool, _store, holder, waiting, _full) =
        two_queued_before_their_prompt_is_cached().await;
    if prompt_cached {
        register_prompt(&pool, &holder);
    }
    for _ in 0..6 {
        tokio::time::advance(Duration::from_millis(100)).await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    }
    let still = queued(&admission);
    for handle in waiting {
        handle.abort();
    }
    still
}

#[tokio::test(start_paused = true)]
async fn requests_queued_before_their_prompt_was_cached_are_re_estimated_not_refused() {
    assert_eq!(
        queued_after_600ms(false).await,
        1,
        "uncached, the youngest cannot start in time and is refused at a re-forecast"
    );
    assert_eq!(
        queued_after_600ms(true).await,
        2,
        "cached, each adds 1 block: both can start in time"
    );
}

// === A caller's own step decides as the upkeep task's would ===

/// What became of one request, as far as a test can compare two runs.
#[derive(Debug, Clone, PartialEq)]
enum Decision {
    Waiting,
    Admitted {
        reserved_blocks: usize,
        lane: Lane,
        queue_wait: Duration,
    },
    Refused {
        status: u16,
        code: &'static str,
        retry_after: Option<Duration>,
    },
}

/// Answers not yet collected, by request index, and how many requests were answered.
#[derive(Default)]
struct Answers {
    new: Vec<(usize, Result<Admitted, Rejection>)>,
    count: usize,
}

/// One admission under test and the requests sent to it, in order.
struct Run {
    admission: Admission,
    store: PolicyStore,
    answers: Arc<parking_lot::Mutex<Answers>>,
    decisions: Vec<Decision>,
    held: Vec<Admitted>,
}

impl Run {
    fn new(queue_only: bool) -> Run {
        let policy = "[tenants.a]\nmax_concurrency = 3\nqueue_depth = 4\nmax_queue_wait = \"3s\"\n\
                      [tenants.b]\nweight = 3\nmax_concurrency = 2\nqueue_depth = 6\n\
                      max_queue_wait = \"2s\"\n\
                      [tenants.c]\nqueue_depth = 2\nmax_queue_wait = \"5s\"\n\
                      [lanes]\nlong_prompt_tokens = 80\nlong_max_concurrency = 1\n\
                      [kv]\nhigh_watermark = 0.9\n";
        let (admission, _pool, store) = setup(24, policy);
        admission
            .core
            .queue_only
            .store(queue_only, std::sync::atomic::Ordering::Relaxed);
        Run {
            admission,
            store,
            answers: Arc::default(),
            decisions: Vec::new(),
            held: Vec::new(),
        }
    }

    fn steps(&self) -> u64 {
        self.admission.core.dispatcher.lock().steps
    }

    fn queued(&self) -> usize {
        self.admission.core.dispatcher.lock().queued_len()
    }

    /// The upkeep task has run every step it had due by now (paused time may have moved).
    fn caught_up(&self) -> bool {
        let due = self.admission.core.dispatcher.lock().upkeep_wake();
        due.is_none_or(|at| at > tokio::time::Instant::now())
    }

    /// Every request sent has an answer or is queued.
    fn settled(&self) -> bool {
        self.answers.lock().count + self.queued() == self.decisions.len()
    }

    fn send(&mut self, tenant: &str, prompt: usize, output: usize) {
        let index = self.decisions.len();
        self.decisions.push(Decision::Waiting);
        let (admission, answers) = (self.admission.clone(), Arc::clone(&self.answers));
        let ticket = ticket(&self.store, tenant, prompt, output);
        tokio::spawn(async move {
            let outcome = admission.admit(ticket).await;
            let mut answers = answers.lock();
            answers.new.push((index, outcome));
            answers.count += 1;
        });
    }

    /// Records the new answers (keeping the guards, in request order) and returns every
    /// request's decision so far.
    fn collect(&mut self) -> Vec<Decision> {
        let mut new = std::mem::take(&mut self.answers.lock().new);
        new.sort_by_key(|(index, _)| *index);
        for (index, outcome) in new {
            self.decisions[index] = match outcome {
                Ok(admitted) => {
                    let decision = Decision::Admitted {
                        reserved_blocks: admitted.reserved_blocks(),
                        lane: admitted.lane(),
                        queue_wait: admitted.queue_wait(),
                    };
                    self.held.push(admitted);
                    decision
                }
                Err(rejection) => Decision::Refused {
                    status: rejection.status(),
                    code: rejection.code(),
                    retry_after: rejection.retry_after(),
                },
            };
        }
        self.decisions.clone()
    }
}

/// Lets both runs' tasks go until each has taken a step since `before` (where its `step` is
/// true), has an answer or a queue entry for every request, and its upkeep task has run the
/// steps it had due.
async fn settle(runs: &[&Run], before: &[u64], step: &[bool]) {
    until(|| {
        runs.iter()
            .zip(before)
            .zip(step)
            .all(|((run, before), step)| {
                (!step || run.steps() > *before) && run.settled() && run.caught_up()
            })
    })
    .await;
    // Whatever else the last change woke (the upkeep task after a caller's step) runs too.
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn releases_wake_the_upkeep_task_only_while_something_is_queued() {
    let policy = "[tenants.a]\nmax_concurrency = 1\n";
    let (admission, _pool, store) = setup(100, policy);
    let steps = || admission.core.dispatcher.lock().steps;
    let settle = || async {
        for _ in 0..200 {
            tokio::task::yield_now().await;
        }
    };
    settle().await;

    // Nothing queued: admitting and finishing a request is the caller's step alone.
    let before = steps();
    let first = admission.admit(ticket(&store, "a", 10, 10)).await.unwrap();
    drop(first);
    settle().await;
    assert_eq!(steps(), before + 1, "only the caller's own step ran");

    // One running, one queued behind the tenant's concurrency: the release must still start
    // the queued one at once (no time passes), through the upkeep task.
    let running = admission.admit(ticket(&store, "a", 10, 10)).await.unwrap();
    let waiting = spawn_admit(&admission, ticket(&store, "a", 20, 10));
    until(|| queued(&admission) == 1).await;
    settle().await;
    let before = steps();
    drop(running);
    let started = admitted(waiting).await;
    assert!(steps() > before, "the upkeep task stepped for the release");
    assert_eq!(queued(&admission), 0);
    drop(started);
}

/// Small deterministic generator (xorshift64*), so a failing sequence can be replayed.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

#[tokio::test(start_paused = true)]
async fn admitting_on_the_callers_task_decides_as_the_upkeep_task_would() {
    for seed in 1..=12u64 {
        // `fast`: callers run the step themselves (what the server does); `queued`: callers
        // only queue and the upkeep task decides every request (the path before).
        let mut fast = Run::new(false);
        let mut queued = Run::new(true);
        let mut dice = Dice(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut admitted_at_once = 0;
        for op in 0..150 {
            let before = [fast.steps(), queued.steps()];
            match dice.below(20) {
                0..=10 => {
                    let tenant = ["a", "b", "c"][dice.below(3) as usize];
                    let prompt = 1 + dice.below(120) as usize;
                    let output = 1 + dice.below(60) as usize;
                    fast.send(tenant, prompt, output);
                    queued.send(tenant, prompt, output);
                    settle(&[&fast, &queued], &before, &[true, true]).await;
                }
                11..=17 => {
                    if fast.held.is_empty() {
                        continue;
                    }
                    let which = dice.below(fast.held.len() as u64) as usize;
                    let completion = dice.below(30) as usize;
                    // A release steps only a run with something queued: with the queue empty
                    // it can start nothing, and the upkeep task does not listen for it.
                    let step = [fast.queued() > 0, queued.queued() > 0];
                    for run in [&mut fast, &mut queued] {
                        let mut guard = run.held.swap_remove(which);
                        guard.mark_started();
                        guard.record_completion(completion);
                    }
                    settle(&[&fast, &queued], &before, &step).await;
                }
                _ => {
                    tokio::time::advance(Duration::from_millis(dice.below(1500))).await;
                    settle(&[&fast, &queued], &before, &[false, false]).await;
                }
            }
            let (a, b) = (fast.collect(), queued.collect());
            assert_eq!(a, b, "seed {seed}, operation {op}: decisions differ");
            assert_eq!(
                fast.admission.queue_snapshot(),
                queued.admission.queue_snapshot(),
                "seed {seed}, operation {op}"
            );
            assert_eq!(fast.held.len(), queued.held.len());
            admitted_at_once = a
                .iter()
                .filter(
                    |d| matches!(d, Decision::Admitted { queue_wait, .. } if queue_wait.is_zero()),
                )
                .count();
        }
        let decided =
            |wanted: fn(&Decision) -> bool| fast.decisions.iter().filter(|d| wanted(d)).count();
        // The sequences must exercise every path, or the comparison proves little.
        assert!(admitted_at_once > 0, "seed {seed}");
        assert!(
            decided(
                |d| matches!(d, Decision::Admitted { queue_wait, .. } if !queue_wait.is_zero())
            ) > 0,
            "seed {seed}: nothing was admitted from the queue"
        );
        assert!(
            decided(|d| matches!(d, Decision::Refused { .. })) > 0,
            "seed {seed}: nothing was refused"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn closing_refuses_the_queued_requests_and_every_later_one_with_503() {
    let (admission, _pool, store) = setup(100, "[tenants.a]\nmax_concurrency = 1\n");
    let running = admission.admit(ticket(&store, "a", 10, 10)).await.unwrap();
    let waiting = spawn_admit(&admission, ticket(&store, "a", 10, 10));
    until(|| queued(&admission) == 1).await;
    admission.close();
    let Err(refused) = waiting.await.unwrap() else {
        panic!("a queued request must be refused when admission closes");
    };
    assert!(matches!(refused, Rejection::Unavailable), "{refused:?}");
    assert_eq!(refused.status(), 503);
    assert!(refused.retry_after().is_some(), "with a Retry-After");
    assert_eq!(queued(&admission), 0);
    // The running request keeps its guard; nothing starts any more, even with a free slot.
    drop(running);
    let late = admission.admit(ticket(&store, "a", 10, 10)).await;
    assert!(
        matches!(late, Err(Rejection::Unavailable)),
        "refused at once"
    );
}

/// QA's D3 in miniature: a tenant limited to 2 requests at once, with KV to spare. What keeps
/// its queue waiting is its own concurrency cap, so a request whose turn would come after its
/// deadline is refused at once as `concurrency_saturated` (not `kv_cache_saturated`, and not
/// left to wait its whole `max_queue_wait` for a 503).
#[tokio::test(start_paused = true)]
async fn a_queue_held_back_by_the_tenants_concurrency_cap_is_refused_as_such() {
    let policy = |cap: usize| {
        format!(
            "[tenants.a]\nmax_concurrency = {cap}\nmax_queue_wait = \"10s\"\n[kv]\nhigh_watermark = 1.0\n"
        )
    };
    let (admission, pool, store, _policy_file) = setup_reloadable(1000, &policy(2));
    teach_hold_time(&admission, &store, Duration::from_secs(4)).await;

    let mut running = Vec::new();
    for _ in 0..2 {
        let mut admitted = admission.admit(ticket(&store, "a", 16, 16)).await.unwrap();
        admitted.mark_started();
        running.push(admitted);
    }
    // Both slots come free in 4 s, then again 4 s later: the queued requests' turns come at
    // 4, 4, 8 and 8 s (within 90% of 10 s), the fifth's at 12 s.
    let queued_ones: Vec<_> = (0..4)
        .map(|_| spawn_admit(&admission, ticket(&store, "a", 16, 16)))
        .collect();
    until(|| queued(&admission) == 4).await;
    let rejection = admission
        .admit(ticket(&store, "a", 16, 16))
        .await
        .unwrap_err();
    match &rejection {
        Rejection::ConcurrencySaturated {
            max_concurrency: 2,
            queued_ahead: 4,
            estimated_wait,
            retry_after,
            ..
        } => {
            assert_eq!(*estimated_wait, Duration::from_secs(12));
            assert_eq!(*retry_after, Duration::from_secs(12));
        }
        other => panic!("expected ConcurrencySaturated, got {other:?}"),
    }
    assert_eq!(
        (rejection.status(), rejection.code(), rejection.reason()),
        (
            429,
            "concurrency_saturated",
            crate::metrics::RejectReason::ConcurrencySaturation
        )
    );
    assert!(rejection.message().contains("at most 2 at once"));
    assert!(pool.snapshot().reserved_blocks <= 6, "KV was never short");
    // The next refusal of the burst has the same forecast but is told to come back one slot
    // interval later (4 s hold ÷ 2 slots), and the one after that another interval on: the
    // refused burst retries at the pace slots free up, not all at once.
    for expected in [14, 16] {
        match admission.admit(ticket(&store, "a", 16, 16)).await {
            Err(Rejection::ConcurrencySaturated {
                estimated_wait,
                retry_after,
                ..
            }) => {
                assert_eq!(estimated_wait, Duration::from_secs(12));
                assert_eq!(retry_after, Duration::from_secs(expected));
            }
            other => panic!("expected ConcurrencySaturated, got {other:?}"),
        }
    }
    // Clients that come straight back (or never) must not push the spread out without bound:
    // it stops at the tenant's max queue wait past the forecast, 12 s + 10 s.
    let mut told = Vec::new();
    for _ in 0..8 {
        match admission.admit(ticket(&store, "a", 16, 16)).await {
            Err(Rejection::ConcurrencySaturated { retry_after, .. }) => {
                told.push(retry_after.as_secs())
            }
            other => panic!("expected ConcurrencySaturated, got {other:?}"),
        }
    }
    assert_eq!(told, [18, 20, 22, 22, 22, 22, 22, 22]);

    // A reload lowers the cap to 1: one slot every 4 s, so only the first two queued start
    // within their 10 s; the re-forecast refuses the other two now.
    reload(&store, &policy(1));
    let mut queued_ones = queued_ones.into_iter();
    let (kept, refused): (Vec<_>, Vec<_>) = (
        queued_ones.by_ref().take(2).collect(),
        queued_ones.collect(),
    );
    for handle in refused {
        match handle.await.unwrap() {
            Err(Rejection::ConcurrencySaturated { estimated_wait, .. }) => {
                assert!(
                    estimated_wait > Duration::from_secs(10),
                    "{estimated_wait:?}"
                );
            }
            other => panic!("expected ConcurrencySaturated, got {other:?}"),
        }
    }
    assert_eq!(queued(&admission), 2);
    drop(running);
    for handle in kept {
        let mut admitted = admitted(handle).await;
        admitted.mark_started();
        drop(admitted);
    }
}

/// QA's 503 in miniature: the request holding the tenant's only slot runs far past its forecast
/// (a long prompt; the forecast prices max_tokens). Counted as freeing its slot "any moment"
/// for as long as it ran, the request queued behind it was forecast to start at once until
/// its deadline, then got 503 `queue_timeout`; now the time it has run raises the forecast,
/// and the queued request is refused with a 429 before its deadline.
#[tokio::test(start_paused = true)]
async fn a_request_behind_one_that_overruns_is_refused_before_its_deadline() {
    let policy = "[tenants.a]\nmax_concurrency = 1\nmax_queue_wait = \"2s\"\n\
                  [kv]\nhigh_watermark = 1.0\n";
    let (admission, _pool, store) = setup(1000, policy);
    teach_hold_time(&admission, &store, Duration::from_millis(400)).await;
    // Forecast to hold its slot 0.4 s, like the first; it will run much longer.
    let mut overrunning = admission
        .admit(ticket(&store, "a", 1800, 16))
        .await
        .unwrap();
    overrunning.mark_started();
    let start = tokio::time::Instant::now();
    let queued_one = spawn_admit(&admission, ticket(&store, "a", 16, 16));
    until(|| queued(&admission) == 1).await;
    match queued_one.await.unwrap() {
        Err(Rejection::ConcurrencySaturated { retry_after, .. }) => {
            let waited = start.elapsed();
            assert!(
                waited < Duration::from_secs(2),
                "refused before its deadline, after {waited:?}"
            );
            assert!(retry_after >= Duration::from_millis(500), "{retry_after:?}");
        }
        other => panic!("expected ConcurrencySaturated, got {other:?}"),
    }
    drop(overrunning);
}

/// Requests a re-forecast refuses together are told to come back in their queue order, each
/// at its own turn: answered youngest first, the front of the queue was told to come back
/// after the whole burst (QA: 16 refused at once, the one with 1 ahead told 51 s, the one with
/// 16 ahead 27 s, and the engine idle for 25 s).
#[tokio::test(start_paused = true)]
async fn requests_refused_together_come_back_in_their_queue_order() {
    let policy = |wait: &str| {
        format!(
            "[tenants.a]\nmax_concurrency = 1\nmax_queue_wait = \"{wait}\"\n[kv]\nhigh_watermark = 1.0\n"
        )
    };
    let (admission, _pool, store, _policy_file) = setup_reloadable(1000, &policy("10s"));
    teach_hold_time(&admission, &store, Duration::from_secs(4)).await;
    let mut running = admission.admit(ticket(&store, "a", 16, 16)).await.unwrap();
    running.mark_started();
    // Their turns come in 4 s and 8 s, within 10 s; a reload cuts the wait to 3 s.
    let queued_ones: Vec<_> = (0..2)
        .map(|_| spawn_admit(&admission, ticket(&store, "a", 16, 16)))
        .collect();
    until(|| queued(&admission) == 2).await;
    reload(&store, &policy("3s"));
    let mut told = Vec::new();
    for handle in queued_ones {
        match handle.await.unwrap() {
            Err(Rejection::ConcurrencySaturated { retry_after, .. }) => {
                told.push(retry_after.as_secs())
            }
            other => panic!("expected ConcurrencySaturated, got {other:?}"),
        }
    }
    assert_eq!(told, [4, 8], "each at its turn, the older first");
    drop(running);
}

/// Before any request of the tenant has finished there is no slot forecast, and the KV
/// forecast (priced at the pace of the few requests the cap lets run) may be what refuses a
/// request. While the tenant is at its cap and the pool has the blocks, the refusal still names
/// the cap: KV was not what held the request (QA D3's first burst on a fresh server).
#[tokio::test(start_paused = true)]
async fn a_refusal_names_the_concurrency_cap_while_it_holds_the_queue_and_kv_is_free() {
    let policy = "[tenants.a]\nmax_concurrency = 1\nmax_queue_wait = \"1500ms\"\n\
                  [kv]\nhigh_watermark = 1.0\n";
    let (admission, pool, store) = setup(60, policy);
    let cost = STEP_25MS;
    admission.set_service_time_probe(move || Some(ServiceTime::Model(cost)));
    let holder = admission.admit(ticket(&store, "a", 240, 80)).await.unwrap(); // 20 blocks
    // 40 blocks free: four 10-block requests fit them (no KV wait), the fifth's backlog needs
    // 10 blocks back, 80 tokens at 25 ms = 2 s: later than 90% of 1.5 s.
    let queued_ones: Vec<_> = (0..4)
        .map(|_| spawn_admit(&admission, ticket(&store, "a", 80, 80)))
        .collect();
    until(|| queued(&admission) == 4).await;
    match admission.admit(ticket(&store, "a", 80, 80)).await {
        Err(Rejection::ConcurrencySaturated {
            max_concurrency: 1,
            queued_ahead: 4,
            estimated_wait,
            ..
        }) => assert_eq!(estimated_wait, Duration::from_secs(2)),
        other => panic!("expected ConcurrencySaturated, got {other:?}"),
    }
    assert_eq!(
        pool.snapshot().reserved_blocks,
        20,
        "the pool had 40 blocks free"
    );

    // Once the pool cannot hold the next request, the same 2 s forecast names KV.
    for handle in queued_ones {
        handle.abort();
    }
    until(|| queued(&admission) == 0).await;
    let full = pool.try_reserve(40).unwrap();
    match admission.admit(ticket(&store, "a", 80, 80)).await {
        Err(Rejection::KvSaturated { estimated_wait, .. }) => {
            assert_eq!(estimated_wait, Duration::from_secs(2));
        }
        other => panic!("expected KvSaturated, got {other:?}"),
    }
    drop((full, holder));
}

/// A freed slot is not taken at once while another tenant holds the blocks: each grant of the
/// tenant waits its turn at the KV, and the forecast counts those waits on the way to a
/// request's slot. Without them a tenant with one slot, two requests ahead of the new one and
/// grants that wait seconds was forecast to start within its queue wait, was queued, and got a
/// 503 at its deadline instead of an early 429 (QA: gamma, cap 1, behind alpha and beta at
/// weights 3 and 2 in a full cache).
#[tokio::test(start_paused = true)]
async fn a_forecast_counts_the_waits_for_grants_on_the_way_to_its_slot() {
    let policy = "[tenants.a]\nmax_concurrency = 1\nmax_queue_wait = \"5s\"\n\
                  [tenants.b]\n[kv]\nhigh_watermark = 1.0\n";
    let (admission, _pool, store) = setup(10, policy);
    // Each of a's requests (16 + 16 tokens: 2 blocks) holds its slot 2 s.
    teach_hold_time(&admission, &store, Duration::from_secs(2)).await;
    // Twice, b holds 9 of the 10 blocks while a's next request, its slot free, waits 3 s for
    // its grant; dropped unstarted, they teach no hold time.
    for _ in 0..2 {
        let holder = admission.admit(ticket(&store, "b", 100, 44)).await.unwrap();
        let waiting = spawn_admit(&admission, ticket(&store, "a", 16, 16));
        until(|| queued(&admission) == 1).await;
        tokio::time::advance(Duration::from_secs(3)).await;
        drop(holder);
        drop(admitted(waiting).await);
    }
    // Now KV is free: one of a's requests runs (2 s left) and one waits for its slot (2 s
    // more). The slots alone say 4 s, within 90% of 5 s. a's grants have waited 0 s (the
    // first), 3 s, 3 s and 0 s (the running one): 0.864 s on average, a fifth of the way each
    // time. With that for each of the two grants on the way, 4 + 2 × 0.864 = 5.728 s: refused
    // now, not at its deadline.
    let mut running = admission.admit(ticket(&store, "a", 16, 16)).await.unwrap();
    running.mark_started();
    let ahead = spawn_admit(&admission, ticket(&store, "a", 16, 16));
    until(|| queued(&admission) == 1).await;
    let asked = tokio::time::Instant::now();
    match admission.admit(ticket(&store, "a", 16, 16)).await {
        Err(Rejection::ConcurrencySaturated {
            queued_ahead: 1,
            estimated_wait,
            ..
        }) => {
            assert_eq!(estimated_wait, Duration::from_millis(5728));
            assert_eq!(asked.elapsed(), Duration::ZERO, "refused at once");
        }
        other => panic!("expected ConcurrencySaturated, got {other:?}"),
    }
    drop(running);
    drop(admitted(ahead).await);
}

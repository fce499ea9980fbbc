//! Admission's core through the real server and model (issue 16): `reservation = "prompt"`
//! with preemption, the engine's submit-queue bound (and its `QueueFull`), reloads while requests are queued, a
//! `max_queue_wait` longer than the request timeout, and fail-fast 429s for a KV backlog
//! that cannot drain in time (a scaled-down version of the 48 MiB measurement).

mod common;

use std::time::{Duration, Instant};

use common::{
    Client, LONG_ANSWER, Options, Reply, TenantSpec, TestServer, chat, hold_slot, policy, queued,
    wait_until,
};
use hyper::StatusCode;
use kvgate_gateway::admission::PoolId;
use kvgate_runtime::scheduler::StepShape;

const CHAT: &str = "/v1/chat/completions";
const WAIT: Duration = Duration::from_secs(120);

/// A server whose policy has one tenant, `a` (key `sk-a`), with the tenant settings `extra`
/// and the policy-level `sections` (e.g. `[kv]` settings).
async fn tenant_a_server(extra: &str, sections: &str, options: Options) -> TestServer {
    let spec = [TenantSpec {
        name: "a",
        key: "sk-a",
        extra,
    }];
    TestServer::start_with(&policy(&spec, sections), options).await
}

/// `n` concurrent chats of tenant `a`, each asking for `max_tokens` of a long answer; each
/// task yields its reply and the time from its own send to the reply.
fn spawn_long_chats(
    client: &Client,
    n: usize,
    max_tokens: u32,
) -> Vec<tokio::task::JoinHandle<(Reply, Duration)>> {
    (0..n)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                let sent = Instant::now();
                let reply = client
                    .post(CHAT, Some("sk-a"), &chat(LONG_ANSWER, max_tokens))
                    .await;
                (reply, sent.elapsed())
            })
        })
        .collect()
}

/// prompt_tokens + completion_tokens of a 200 reply.
fn used_tokens(reply: &Reply) -> u64 {
    let usage = &reply.json()["usage"];
    usage["prompt_tokens"].as_u64().expect("prompt_tokens")
        + usage["completion_tokens"]
            .as_u64()
            .expect("completion_tokens")
}

/// The tenant's token bucket now.
fn remaining_tokens(server: &TestServer, tenant: &str) -> u64 {
    let policy = server.store.current().tenant(tenant).expect("tenant");
    let headers = server.admission.rate_headers(&policy);
    u64::from(headers.tokens.expect("a token limit").remaining)
}

/// The bucket ends where real usage puts it: the limit less what the served requests used,
/// plus at most what refilled since `since` (tokens_per_minute / 60 per second).
fn assert_bucket_reflects_usage(server: &TestServer, limit: u64, used: u64, since: Instant) {
    let remaining = remaining_tokens(server, "a");
    let refill = (limit as f64 * since.elapsed().as_secs_f64() / 60.0).ceil() as u64 + 1;
    let floor = limit.saturating_sub(used);
    assert!(
        remaining >= floor && remaining <= (floor + refill).min(limit),
        "remaining {remaining}, limit {limit}, used {used}, refill ≤ {refill}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_reservations_overcommit_preempt_and_still_finish_every_request() {
    // 24 blocks of 16 tokens. Each request (~40 prompt tokens + 100) needs 9 blocks to finish,
    // so full reservations would run two at a time; prompt reservations (3 + 1 headroom)
    // admit four, whose growth (36 blocks) overflows the pool: the engine must preempt.
    let options = Options {
        num_blocks: 24,
        ..Options::default()
    };
    let limit = 100_000;
    let extra = format!("tokens_per_minute = {limit}\nmax_concurrency = 4");
    let server = tenant_a_server(
        &extra,
        "[kv]\nreservation = \"prompt\"\nprompt_headroom_blocks = 1\nhigh_watermark = 1.0\n",
        options,
    )
    .await;
    let start = Instant::now();
    let requests = spawn_long_chats(&server.client(), 4, 100);
    let mut used = 0;
    for request in requests {
        let (reply, _) = request.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json());
        assert_eq!(reply.json()["usage"]["completion_tokens"], 100);
        used += used_tokens(&reply);
    }
    assert!(
        server.engine.stats().preemptions_total > 0,
        "the pool was overcommitted: {:?}",
        server.engine.stats().preemptions_total
    );
    server.wait_for_idle_kv(WAIT).await;
    assert_bucket_reflects_usage(&server, limit, used, start);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_engine_queue_wait_in_admission_instead_of_failing() {
    // An engine whose submit queue takes one request: without the gate (the server caps
    // admission at the engine's queue) the other three would be answered 503 `QueueFull`.
    let options = Options {
        engine_queue: 1,
        ..Options::default()
    };
    let server = tenant_a_server(
        "max_concurrency = 8\ntokens_per_minute = 100000",
        "",
        options,
    )
    .await;
    let client = server.client();
    let running = hold_slot(&client, "sk-a", 300).await;
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { client.post(CHAT, Some("sk-a"), &chat("hi", 4)).await })
        })
        .collect();
    wait_until(
        "three requests queue behind the engine's bound",
        WAIT,
        || queued(&server, "a") == 3,
    )
    .await;
    assert_eq!(
        server.engine.stats().running + server.engine.stats().waiting,
        1
    );
    drop(running);
    for request in waiting {
        let reply = request.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json());
    }
    server.wait_for_idle_kv(WAIT).await;
}

/// The engine's own `QueueFull`, end to end: should the engine's queue fill although admission
/// admitted the request (here admission's cap is lifted above the engine's queue of one, and the
/// engine runs one sequence at a time), the request is answered 503 `engine_unavailable` with a
/// Retry-After, and its request and tokens go back to the tenant's buckets exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_engine_queue_refuses_gets_503_and_is_refunded_exactly() {
    let options = Options {
        engine_queue: 1,
        max_num_seqs: 1,
        ..Options::default()
    };
    // Slow buckets (one request per 10 s, 10 tokens per second): a charge for the refused
    // request (one request, ~25 tokens) would show through what refills while it is answered.
    let extra = "max_concurrency = 8\nrequests_per_minute = 6\ntokens_per_minute = 600";
    let server = tenant_a_server(extra, "", options).await;
    server.admission.limit_in_flight(PoolId::LOCAL, 8);
    let client = server.client();
    // Running (the engine's one sequence), then one in its waiting list, one in its queue:
    // one at a time, since the engine moves its queue to its waiting list only between steps.
    let running = hold_slot(&client, "sk-a", 300).await;
    let in_flight = || -> usize {
        let rows = server.admission.queue_snapshot();
        rows.iter().map(|row| row.in_flight).sum()
    };
    let spawn_short = || {
        let client = client.clone();
        tokio::spawn(async move { client.post(CHAT, Some("sk-a"), &chat("hi", 4)).await })
    };
    let waiting = spawn_short();
    wait_until("a request waits in the engine", WAIT, || {
        server.engine.stats().waiting == 1
    })
    .await;
    let queued_in_engine = spawn_short();
    wait_until("a request sits in the engine's queue", WAIT, || {
        in_flight() == 3
    })
    .await;
    let accepted = [waiting, queued_in_engine];
    let policy = server.store.current().tenant("a").expect("tenant");
    let before = server.admission.rate_headers(&policy);
    let refused = client.post(CHAT, Some("sk-a"), &chat("hi", 4)).await;
    assert_eq!(
        (refused.status, refused.error_code().as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "engine_unavailable"),
        "{:?}",
        refused.json()
    );
    assert!(refused.header("retry-after").is_some());
    let after = server.admission.rate_headers(&policy);
    let remaining = |h: &kvgate_gateway::ratelimit::RateLimitHeaders| {
        (
            h.requests.as_ref().map(|s| s.remaining),
            h.tokens.as_ref().map(|s| s.remaining),
        )
    };
    // Refills only raise `after`; a charge would lower it.
    // (Answered within ~2 s, as it should be, a charge outweighs the refill.)
    let (requests_before, tokens_before) = remaining(&before);
    let (requests_after, tokens_after) = remaining(&after);
    assert!(
        requests_after >= requests_before && tokens_after >= tokens_before,
        "before {before:?}, after {after:?}"
    );
    drop(running);
    for request in accepted {
        let reply = request.await.unwrap();
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.json());
    }
    server.wait_for_idle_kv(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_while_requests_are_queued_refuses_a_removed_keys_requests() {
    let options = Options {
        num_blocks: 48,
        ..Options::default()
    };
    let tenants = |with_b: bool| {
        let mut specs = vec![TenantSpec {
            name: "a",
            key: "sk-a",
            extra: "max_concurrency = 1",
        }];
        if with_b {
            specs.push(TenantSpec {
                name: "b",
                key: "sk-b",
                extra: "",
            });
        }
        specs
    };
    let before = policy(&tenants(true), "[kv]\nhigh_watermark = 1.0\n");
    let server = TestServer::start_with(&before, options).await;
    let client = server.client();
    let running = hold_slot(&client, "sk-a", 300).await;
    let post = |key: &'static str, max_tokens: u32| {
        let client = client.clone();
        tokio::spawn(async move { client.post(CHAT, Some(key), &chat("hi", max_tokens)).await })
    };
    // Held back by a's concurrency (1).
    let small = post("sk-a", 4);
    // The holder reserved ~21 of the 48 blocks; ~30 + 500 tokens (34 blocks) wait for KV.
    let big = post("sk-b", 500);
    wait_until("both requests queue", WAIT, || {
        queued(&server, "a") == 1 && queued(&server, "b") == 1
    })
    .await;
    // b's key is removed: its queued request is refused, not started.
    let after = policy(&tenants(false), "[kv]\nhigh_watermark = 1.0\n");
    std::fs::write(&server.policy_path, after).unwrap();
    server.store.reload().expect("the new policy is valid");
    let refused = big.await.unwrap();
    assert_eq!(
        refused.status,
        StatusCode::UNAUTHORIZED,
        "{:?}",
        refused.json()
    );
    assert_eq!(refused.error_code(), "invalid_api_key");
    // a's queued request stays and starts when the holder leaves.
    drop(running);
    let served = small.await.unwrap();
    assert_eq!(served.status, StatusCode::OK, "{:?}", served.json());
    server.wait_for_idle_kv(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_lowers_the_watermark_refuses_queued_requests_that_no_longer_fit() {
    let options = Options {
        num_blocks: 48,
        ..Options::default()
    };
    let spec = [TenantSpec {
        name: "a",
        key: "sk-a",
        // Long enough that the forecast (500 tokens of the running request) never refuses the
        // second request on a slow machine: it must queue.
        extra: "max_input_tokens = 400\nmax_output_tokens = 700\nmax_total_tokens = 1100\n\
                max_queue_wait = \"100s\"",
    }];
    let server =
        TestServer::start_with(&policy(&spec, "[kv]\nhigh_watermark = 1.0\n"), options).await;
    let client = server.client();
    // ~30 + 500 tokens: 34 blocks held; the next one (34 more) waits for KV.
    let running = hold_slot(&client, "sk-a", 500).await;
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move { client.post(CHAT, Some("sk-a"), &chat("hi", 500)).await })
    };
    wait_until("the second request queues", WAIT, || {
        assert!(
            !waiting.is_finished(),
            "the second request was answered before it queued"
        );
        queued(&server, "a") == 1
    })
    .await;
    std::fs::write(
        &server.policy_path,
        policy(&spec, "[kv]\nhigh_watermark = 0.5\n"),
    )
    .unwrap();
    server.store.reload().expect("the new policy is valid");
    let refused = waiting.await.unwrap();
    assert_eq!(
        refused.status,
        StatusCode::BAD_REQUEST,
        "{:?}",
        refused.json()
    );
    assert_eq!(refused.error_code(), "context_length_exceeded");
    assert_eq!(queued(&server, "a"), 0);
    drop(running);
    server.wait_for_idle_kv(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_wait_longer_than_the_request_timeout_ends_in_admissions_answer() {
    let mut options = Options::default();
    options.serve.request_timeout = Duration::from_secs(2);
    let server = tenant_a_server(
        "max_concurrency = 1\nmax_queue_wait = \"60s\"\nrequests_per_minute = 2\nmax_output_tokens = 2000\nmax_total_tokens = 2100",
        "",
        options,
    )
    .await;
    let client = server.client();
    // A stream outlives the request timeout (it bounds the headers, not the body).
    // Long enough to outlast the 1.8 s queue wait on a fast idle machine too (300 tokens took
    // under 1.5 s there, and the queued request was then served).
    let running = hold_slot(&client, "sk-a", 2000).await;
    let started = Instant::now();
    let waited = client.post(CHAT, Some("sk-a"), &chat("hi", 1)).await;
    // Admission's 503 with Retry-After, before the timeout layer's bare 504.
    assert_eq!(
        waited.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        waited.json()
    );
    assert_eq!(waited.error_code(), "queue_timeout");
    assert!(waited.header("retry-after").is_some());
    assert!(started.elapsed() < Duration::from_secs(60));
    assert_eq!(queued(&server, "a"), 0);
    // It never ran: its request was refunded (2 per minute, the holder spent one).
    let policy = server.store.current().tenant("a").unwrap();
    let requests = server.admission.rate_headers(&policy).requests.unwrap();
    assert!(requests.remaining >= 1, "{requests:?}");
    drop(running);
    server.wait_for_idle_kv(WAIT).await;
}

/// The 48 MiB measurement of issue 16, scaled down to run in seconds: a pool that holds one
/// request at a time, 8 concurrent requests of ~40 + 200 tokens, a `max_queue_wait` of a
/// quarter of one request's 200 decode steps as this machine's step cost model prices them
/// (fitted at start; a fixed wait would be longer than those steps on a fast enough CPU), so
/// whoever is not first cannot start in time. They are told so when they are enqueued (429
/// `kv_cache_saturated` with a Retry-After), from that model, before the engine has served
/// anything: every refusal arrives before the first served request's answer. Nobody waits
/// out the deadline for a 503, and the token bucket ends where the served requests' usage
/// puts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_backlog_that_cannot_drain_in_time_is_refused_at_once_and_the_rest_served() {
    // 21 blocks under the 0.9 watermark; a request needs ~15.
    let options = Options {
        num_blocks: 24,
        ..Options::default()
    };
    let limit: u64 = 4000;
    let extra = |wait: &str| {
        format!("max_concurrency = 16\ntokens_per_minute = {limit}\nmax_queue_wait = \"{wait}\"")
    };
    let server = tenant_a_server(&extra("60s"), "", options).await;
    let cost = server.engine.stats().step_cost;
    let one_request: Duration = (0..200)
        .map(|i| {
            let mut decode = StepShape::default();
            decode.add_decode(40 + i);
            cost.predict(&decode)
        })
        .sum();
    let wait = (one_request / 4).max(Duration::from_millis(20));
    let spec = [TenantSpec {
        name: "a",
        key: "sk-a",
        extra: &extra(&format!("{}ms", wait.as_millis())),
    }];
    std::fs::write(&server.policy_path, policy(&spec, "")).expect("write the policy");
    server.store.reload().expect("the new policy is valid");
    let start = Instant::now();
    let requests = spawn_long_chats(&server.client(), 8, 200);
    let (mut served, mut refused, mut used) = (Vec::new(), Vec::new(), 0);
    for request in requests {
        let (reply, took) = request.await.unwrap();
        match reply.status {
            StatusCode::OK => {
                served.push(took);
                used += used_tokens(&reply);
            }
            StatusCode::TOO_MANY_REQUESTS => {
                refused.push(took);
                assert_eq!(reply.error_code(), "kv_cache_saturated");
                let retry: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                assert!((1..=120).contains(&retry), "retry-after {retry}");
            }
            other => panic!("{other}: {:?}", reply.json()),
        }
    }
    let first_served = served.iter().min().copied().expect("one request is served");
    assert!(!refused.is_empty(), "served {served:?}, none refused");
    let last_refused = refused.iter().max().copied().unwrap_or_default();
    assert!(
        last_refused < first_served,
        "refusals {refused:?} must all come before the first answer ({first_served:?})"
    );
    server.wait_for_idle_kv(WAIT).await;
    assert_bucket_reflects_usage(&server, limit, used, start);
}

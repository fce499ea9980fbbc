//! `/metrics` and `/admin/kv` through the real server and model: occupancy follows the load and
//! returns to baseline, memory is reported from the first scrape and its peak never decreases,
//! the batch histograms count every engine step, every refused request is counted once under
//! its reason (KV saturation and a request larger than the pool included), and a real scrape
//! passes `promtool check metrics` with and without the vLLM compatibility names.
//!
//! Request-path counters live in one process-wide recorder shared by the tests of this binary,
//! so each test uses its own tenant names and compares scrapes before and after.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{Options, TenantSpec, TestServer, chat, hold_slot, policy, queued, wait_until};
use hyper::StatusCode;
use kvgate_gateway::auth::hash_key;
use kvgate_gateway::metrics::exposition::Scrape;
use kvgate_gateway::metrics::{
    Compat, ENGINE_STEPS_TOTAL, KV_BLOCKS, KV_USAGE_RATIO, MEMORY_ALLOCATED_BYTES,
    MEMORY_BUDGET_BYTES, MEMORY_PEAK_ALLOCATED_BYTES, MEMORY_RESERVED_BYTES, REQUESTS_IN_FLIGHT,
    REQUESTS_REJECTED_TOTAL, REQUESTS_TOTAL, RejectReason, SEQUENCES,
};

const CHAT: &str = "/v1/chat/completions";
const WAIT: Duration = Duration::from_secs(120);
const ADMIN_KEY: &str = "sk-metrics-admin";

/// The Prometheus recorder is process-wide: counters such as the `unauthenticated` tenant's auth
/// rejections are shared by every server in this test binary, so the tests run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn scrape(server: &TestServer) -> Scrape {
    let reply = server.client().get("/metrics", None).await;
    assert_eq!(reply.status, StatusCode::OK);
    let text = std::str::from_utf8(&reply.body).expect("/metrics is UTF-8");
    Scrape::parse(text).unwrap_or_else(|e| panic!("/metrics is not valid exposition: {e}\n{text}"))
}

fn gauge(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .value(name, labels)
        .unwrap_or_else(|| panic!("{name}{labels:?} missing from the scrape"))
}

fn with_admin_key(policy: String) -> String {
    format!("admin_key_sha256 = [\"{}\"]\n{policy}", hash_key(ADMIN_KEY))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn occupancy_rises_under_load_returns_to_baseline_and_the_peak_never_drops() {
    let _serial = SERIAL.lock().await;
    let tenants = [TenantSpec {
        name: "m-occ",
        key: "sk-occ",
        extra: "",
    }];
    let server = TestServer::start(&with_admin_key(policy(&tenants, ""))).await;
    let client = server.client();
    let tenant = [("tenant", "m-occ")];
    let mut peaks = Vec::new();

    let idle = scrape(&server).await;
    assert_eq!(gauge(&idle, KV_BLOCKS, &[("state", "used")]), 0.0);
    assert_eq!(
        gauge(&idle, KV_BLOCKS, &[("state", "total")]),
        server.kv().total_blocks as f64
    );
    assert_eq!(
        gauge(&idle, REQUESTS_IN_FLIGHT, &tenant),
        0.0,
        "configured tenants report 0, not nothing"
    );
    peaks.push(gauge(&idle, MEMORY_PEAK_ALLOCATED_BYTES, &[]));

    let first = hold_slot(&client, "sk-occ", 250).await;
    let second = hold_slot(&client, "sk-occ", 250).await;
    let busy = scrape(&server).await;
    let used = gauge(&busy, KV_BLOCKS, &[("state", "used")]);
    let reserved = gauge(&busy, KV_BLOCKS, &[("state", "reserved")]);
    assert!(used >= 2.0, "two running sequences hold blocks, saw {used}");
    assert!(
        used + reserved >= 2.0 * 16.0,
        "each reserved its prompt + 250 tokens: {used} + {reserved}"
    );
    assert!(gauge(&busy, KV_USAGE_RATIO, &[]) > 0.0);
    assert_eq!(gauge(&busy, REQUESTS_IN_FLIGHT, &tenant), 2.0);
    assert_eq!(gauge(&busy, SEQUENCES, &[("state", "running")]), 2.0);
    peaks.push(gauge(&busy, MEMORY_PEAK_ALLOCATED_BYTES, &[]));

    // The admin view attributes the blocks to the tenant and lists the two holders.
    let denied = client.get("/admin/kv", Some("sk-occ")).await;
    assert_eq!(
        denied.status,
        StatusCode::UNAUTHORIZED,
        "a tenant key is not an admin key"
    );
    let report = client.get("/admin/kv", Some(ADMIN_KEY)).await;
    assert_eq!(report.status, StatusCode::OK);
    let report = report.json();
    let row = report["tenants"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["tenant"] == "m-occ"));
    let row = row.unwrap_or_else(|| panic!("no m-occ row in {report}"));
    assert_eq!(row["sequences"], 2);
    assert!(row["blocks"].as_u64().unwrap_or(0) >= 2, "{row}");
    assert_eq!(report["largest"].as_array().map(Vec::len), Some(2));

    drop(first);
    drop(second);
    server.wait_for_idle_kv(WAIT).await;
    wait_until("the engine to drop both sequences", WAIT, || {
        server.engine.stats().running == 0
    })
    .await;
    let after = scrape(&server).await;
    assert_eq!(gauge(&after, KV_BLOCKS, &[("state", "used")]), 0.0);
    assert_eq!(gauge(&after, KV_BLOCKS, &[("state", "reserved")]), 0.0);
    assert_eq!(
        gauge(&after, KV_BLOCKS, &[("state", "free")]),
        server.kv().total_blocks as f64
    );
    assert_eq!(gauge(&after, REQUESTS_IN_FLIGHT, &tenant), 0.0);
    peaks.push(gauge(&after, MEMORY_PEAK_ALLOCATED_BYTES, &[]));
    peaks.push(gauge(
        &scrape(&server).await,
        MEMORY_PEAK_ALLOCATED_BYTES,
        &[],
    ));

    assert!(
        peaks.windows(2).all(|w| w[0] <= w[1]),
        "the peak never decreases: {peaks:?}"
    );
    // Every step the engine took is in the batch histograms, once: their counts are the step
    // counter of the same scrape, and the buckets are cumulative.
    let last = scrape(&server).await;
    if let Err(problem) = last.check_histograms() {
        panic!("malformed histogram: {problem}");
    }
    let steps = gauge(&last, ENGINE_STEPS_TOTAL, &[]);
    assert!(steps >= 2.0, "two prefills at least, saw {steps} steps");
    for family in [
        "kvgate_batch_size",
        "kvgate_batch_tokens",
        "kvgate_engine_step_duration_seconds",
    ] {
        let count = gauge(&last, &format!("{family}_count"), &[]);
        assert_eq!(count, steps, "{family} counts every step");
        assert_eq!(
            gauge(&last, &format!("{family}_bucket"), &[("le", "+Inf")]),
            count
        );
    }
    // Latencies carry the tenant whose streams saw them.
    let first_tokens = gauge(&last, "kvgate_time_to_first_token_seconds_count", &tenant);
    assert!(first_tokens >= 1.0, "TTFT per tenant: {first_tokens}");
    // ... and the model that served them: the embedded one's name, here for every series.
    let served = [("tenant", "m-occ"), ("model", common::MODEL)];
    for family in [
        "kvgate_time_to_first_token_seconds_count",
        "kvgate_prompt_tokens_total",
        "kvgate_generation_tokens_total",
    ] {
        assert_eq!(
            gauge(&last, family, &served),
            gauge(&last, family, &tenant),
            "{family}: the tenant's series is the embedded model's"
        );
    }
    let durations = [("model", common::MODEL)];
    assert!(gauge(&last, "kvgate_request_duration_seconds_count", &durations) >= 2.0);
    let cap = gauge(&last, "kvgate_engine_prefill_cap_tokens", &[]);
    assert!(cap >= 1.0, "prefill cap {cap}");
    let sequences = gauge(&last, "kvgate_batch_size_sum", &[]);
    assert!(
        sequences >= steps && sequences <= 2.0 * steps,
        "1 or 2 sequences per step: {sequences} over {steps} steps"
    );
    assert!(
        peaks[peaks.len() - 1] > 0.0,
        "the peak covers at least the weights: {peaks:?}"
    );
    server.shutdown().await;
}

/// Rejections of `tenant` by reason, and its requests counted as rejected.
fn rejections(scrape: &Scrape, tenant: &str) -> (Vec<(RejectReason, f64)>, f64) {
    let by_reason = RejectReason::ALL
        .iter()
        .map(|r| {
            (
                *r,
                scrape.sum(
                    REQUESTS_REJECTED_TOTAL,
                    &[("tenant", tenant), ("reason", r.as_str())],
                ),
            )
        })
        .collect();
    (
        by_reason,
        scrape.sum(
            REQUESTS_TOTAL,
            &[("tenant", tenant), ("outcome", "rejected")],
        ),
    )
}

/// Asserts that between two scrapes `tenant` gained exactly `expected` rejections under
/// `reason`, none under any other reason, and as many rejected requests in total.
fn assert_counted(
    before: &Scrape,
    after: &Scrape,
    tenant: &str,
    reason: RejectReason,
    expected: f64,
) {
    let (old, old_total) = rejections(before, tenant);
    let (new, new_total) = rejections(after, tenant);
    for ((r, was), (_, now)) in old.iter().zip(&new) {
        let want = if *r == reason { expected } else { 0.0 };
        assert_eq!(
            now - was,
            want,
            "{tenant}: {} rejections counted under {}",
            now - was,
            r.as_str()
        );
    }
    if reason != RejectReason::Auth {
        assert_eq!(
            new_total - old_total,
            expected,
            "{tenant}: requests_total{{outcome=rejected}}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rejection_is_counted_once_under_its_reason() {
    let _serial = SERIAL.lock().await;
    let tenants = [
        TenantSpec {
            name: "m-len",
            key: "sk-len",
            extra: "max_input_tokens = 40",
        },
        TenantSpec {
            name: "m-bad",
            key: "sk-bad",
            extra: "",
        },
        TenantSpec {
            name: "m-rate",
            key: "sk-rate",
            extra: "requests_per_minute = 1",
        },
        TenantSpec {
            name: "m-quota",
            key: "sk-quota",
            extra: "tokens_per_minute = 200",
        },
        TenantSpec {
            name: "m-full",
            key: "sk-full",
            extra: "max_concurrency = 1\nqueue_depth = 1",
        },
        TenantSpec {
            name: "m-slow",
            key: "sk-slow",
            extra: "max_concurrency = 1\nqueue_depth = 4\nmax_queue_wait = \"300ms\"",
        },
    ];
    let server = TestServer::start(&policy(&tenants, "")).await;
    let client = server.client();
    let before = scrape(&server).await;

    for key in [Some("sk-nobody"), None] {
        assert_eq!(
            client.post(CHAT, key, &chat("hi", 1)).await.status,
            StatusCode::UNAUTHORIZED
        );
    }
    let long = "word ".repeat(60);
    assert_eq!(
        client
            .post(CHAT, Some("sk-len"), &chat(&long, 5))
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    let broken = client
        .post_bytes(CHAT, Some("sk-bad"), "{\"model\": ")
        .await;
    assert_eq!(broken.status, StatusCode::BAD_REQUEST);
    let mut no_messages = chat("hi", 1);
    no_messages["messages"] = serde_json::json!([]);
    assert_eq!(
        client.post(CHAT, Some("sk-bad"), &no_messages).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        client
            .post(CHAT, Some("sk-rate"), &chat("hi", 1))
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        client
            .post(CHAT, Some("sk-rate"), &chat("hi", 1))
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
    let quota = client.post(CHAT, Some("sk-quota"), &chat("hi", 250)).await;
    assert_eq!(quota.error_code(), "insufficient_quota");

    let running = hold_slot(&client, "sk-full", 250).await;
    let waiting = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .post(CHAT, Some("sk-full"), &chat("hi", 1))
                .await
                .status
        }
    });
    wait_until("a request queues behind the running one", WAIT, || {
        queued(&server, "m-full") == 1
    })
    .await;
    assert_eq!(
        client
            .post(CHAT, Some("sk-full"), &chat("hi", 1))
            .await
            .error_code(),
        "queue_full"
    );
    drop(running);
    assert_eq!(waiting.await.expect("queued request task"), StatusCode::OK);

    let running = hold_slot(&client, "sk-slow", 250).await;
    assert_eq!(
        client
            .post(CHAT, Some("sk-slow"), &chat("hi", 1))
            .await
            .error_code(),
        "queue_timeout"
    );
    drop(running);
    server.wait_for_idle_kv(WAIT).await;

    let after = scrape(&server).await;
    assert_counted(&before, &after, "unauthenticated", RejectReason::Auth, 2.0);
    assert_counted(&before, &after, "m-len", RejectReason::Length, 1.0);
    assert_counted(&before, &after, "m-bad", RejectReason::BadRequest, 2.0);
    assert_counted(&before, &after, "m-rate", RejectReason::Rate, 1.0);
    assert_counted(&before, &after, "m-quota", RejectReason::Quota, 1.0);
    assert_counted(&before, &after, "m-full", RejectReason::QueueFull, 1.0);
    assert_counted(&before, &after, "m-slow", RejectReason::QueueTimeout, 1.0);
    let admitted = |s: &Scrape| {
        s.sum(
            REQUESTS_TOTAL,
            &[("tenant", "m-rate"), ("outcome", "admitted")],
        )
    };
    assert_eq!(
        admitted(&after) - admitted(&before),
        1.0,
        "the admitted request is not a rejection"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_is_reported_from_the_first_scrape_before_any_request() {
    let _serial = SERIAL.lock().await;
    let budget = 3u64 << 30;
    let mut options = Options::default();
    options.serve.metrics.memory_budget_bytes = Some(budget);
    let tenants = [TenantSpec {
        name: "m-mem",
        key: "sk-mem",
        extra: "",
    }];
    let server = TestServer::start_with(&policy(&tenants, ""), options).await;

    // Nothing has run yet: the engine published its memory when it started.
    let first = scrape(&server).await;
    assert_eq!(gauge(&first, ENGINE_STEPS_TOTAL, &[]), 0.0, "no step yet");
    let weights = gauge(&first, MEMORY_ALLOCATED_BYTES, &[("kind", "weights")]);
    let kv = gauge(&first, MEMORY_ALLOCATED_BYTES, &[("kind", "kv")]);
    let workspace = gauge(&first, MEMORY_ALLOCATED_BYTES, &[("kind", "workspace")]);
    assert!(
        weights > 50e6,
        "a 135M-parameter Q4_1 model: {weights} bytes of weights"
    );
    assert!(kv > 0.0, "the KV cache is allocated at start: {kv}");
    let allocated = weights + kv + workspace;
    assert_eq!(gauge(&first, MEMORY_RESERVED_BYTES, &[]), allocated);
    let peak = gauge(&first, MEMORY_PEAK_ALLOCATED_BYTES, &[]);
    assert!(peak >= allocated, "peak {peak} < allocated {allocated}");
    assert_eq!(gauge(&first, MEMORY_BUDGET_BYTES, &[]), budget as f64);
    assert_eq!(gauge(&first, "kvgate_batch_size_count", &[]), 0.0);
    if let Err(problem) = first.check_histograms() {
        panic!("malformed histogram: {problem}");
    }

    // After a request the peak covers at least what is allocated then, and never went down.
    assert_eq!(
        server
            .client()
            .post(CHAT, Some("sk-mem"), &chat("hi", 2))
            .await
            .status,
        StatusCode::OK
    );
    let after = scrape(&server).await;
    let allocated_after: f64 = ["weights", "kv", "workspace"]
        .iter()
        .map(|kind| gauge(&after, MEMORY_ALLOCATED_BYTES, &[("kind", kind)]))
        .sum();
    let peak_after = gauge(&after, MEMORY_PEAK_ALLOCATED_BYTES, &[]);
    assert!(peak_after >= peak && peak_after >= allocated_after);
    assert!(
        gauge(&after, ENGINE_STEPS_TOTAL, &[]) >= 2.0,
        "prefill + decode"
    );
    server.shutdown().await;
}

/// KV refusals through a real server with a 64-block pool (1024 tokens): a request that can
/// never fit under the watermark is a `length` refusal (400); a request that must wait for
/// blocks longer than its tenant's `max_queue_wait`, by the measured drain rate, is a
/// `kv_saturation` refusal (429). Each is counted once per refused request, under its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_refusals_are_counted_once_under_their_reason() {
    let _serial = SERIAL.lock().await;
    let tenants = [
        TenantSpec {
            name: "m-kvhold",
            key: "sk-kvhold",
            extra: "",
        },
        TenantSpec {
            name: "m-kvsat",
            key: "sk-kvsat",
            extra: "max_queue_wait = \"2s\"",
        },
        TenantSpec {
            name: "m-kvlen",
            key: "sk-kvlen",
            extra: "",
        },
    ];
    let options = Options {
        num_blocks: 64,
        ..Options::default()
    };
    let server = TestServer::start_with(&policy(&tenants, ""), options).await;
    let client = server.client();
    let before = scrape(&server).await;

    // ~600 prompt tokens + 500 = ~70 blocks: over the 57 the 0.9 watermark allows, and over the
    // whole pool. The tenant's limits (1024 in, 1536 in total) allow it: only KV refuses it.
    let long = "word ".repeat(600);
    let too_big = client.post(CHAT, Some("sk-kvlen"), &chat(&long, 500)).await;
    assert_eq!(
        too_big.status,
        StatusCode::BAD_REQUEST,
        "{:?}",
        too_big.json()
    );
    assert_eq!(too_big.error_code(), "context_length_exceeded");

    // Teach admission the drain rate: two completions more than a second apart. The second
    // returns at most 2-3 blocks (~48 tokens) over ≥ 1.2 s: under 40 tokens/s.
    for pause in [true, false] {
        let reply = client.post(CHAT, Some("sk-kvhold"), &chat("hi", 1)).await;
        assert_eq!(reply.status, StatusCode::OK);
        if pause {
            tokio::time::sleep(Duration::from_millis(1200)).await;
        }
    }
    // A running request holds ~35 blocks (prompt + 500), leaving ~22 of the 57 allowed.
    let holder = hold_slot(&client, "sk-kvhold", 500).await;
    // Each of these needs ~35 blocks: ~13 blocks (~208 tokens) must drain first, > 5 s at the
    // learned rate, more than m-kvsat's 2 s max_queue_wait: refused at once, not queued.
    for _ in 0..2 {
        let refused = client
            .post(CHAT, Some("sk-kvsat"), &chat(common::LONG_ANSWER, 500))
            .await;
        assert_eq!(
            (refused.status, refused.error_code().as_str()),
            (StatusCode::TOO_MANY_REQUESTS, "kv_cache_saturated"),
            "{:?}",
            refused.json()
        );
        assert!(
            refused.header("retry-after").is_some(),
            "429 says when to retry"
        );
    }
    drop(holder);
    server.wait_for_idle_kv(WAIT).await;

    let after = scrape(&server).await;
    assert_counted(&before, &after, "m-kvlen", RejectReason::Length, 1.0);
    assert_counted(&before, &after, "m-kvsat", RejectReason::KvSaturation, 2.0);
    assert_counted(&before, &after, "m-kvhold", RejectReason::KvSaturation, 0.0);
    server.shutdown().await;
}

/// Runs scripts/check-metrics.sh (curl + promtool, vllm: lines filtered) against the server.
fn check_metrics_script(server: &TestServer) -> std::process::Output {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/check-metrics.sh");
    Command::new("bash")
        .arg(script)
        .arg(format!("http://{}", server.addr))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {script}: {e}"))
}

async fn assert_promtool_accepts(compat: Compat) {
    let mut options = Options::default();
    options.serve.metrics.compat = compat;
    let tenants = [TenantSpec {
        name: "m-lint",
        key: "sk-lint",
        extra: "requests_per_minute = 600",
    }];
    let server = TestServer::start_with(&policy(&tenants, ""), options).await;
    let client = server.client();
    // Populate every recorded family: a finished request, a rejection, a queue wait.
    assert_eq!(
        client
            .post(CHAT, Some("sk-lint"), &chat("hi", 3))
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        client
            .post(CHAT, Some("sk-wrong"), &chat("hi", 1))
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );

    let scrape = scrape(&server).await;
    let compat_lines = scrape
        .samples
        .iter()
        .filter(|s| s.name.starts_with("vllm:"))
        .count();
    match compat {
        Compat::Vllm => {
            assert!(compat_lines >= 7, "vLLM names exported: {compat_lines}");
            let total = server.kv().total_blocks.to_string();
            assert_eq!(
                scrape.value(
                    "vllm:cache_config_info",
                    &[("num_gpu_blocks", total.as_str())]
                ),
                Some(1.0)
            );
            assert_eq!(
                scrape.value("vllm:kv_cache_usage_perc", &[]),
                scrape.value(KV_USAGE_RATIO, &[])
            );
        }
        Compat::None => assert_eq!(
            compat_lines, 0,
            "no vLLM names without --metrics-compat vllm"
        ),
    }

    let output = check_metrics_script(&server);
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "promtool check metrics failed ({compat:?}); install promtool with `apt-get install prometheus`:\n{report}"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_a_real_scrape_without_compat_names() {
    let _serial = SERIAL.lock().await;
    assert_promtool_accepts(Compat::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_a_real_scrape_with_vllm_compat_filtered() {
    let _serial = SERIAL.lock().await;
    assert_promtool_accepts(Compat::Vllm).await;
}

/// A client that leaves while its request is queued ends that request as `abandoned`: it is
/// neither admitted nor rejected, but it is counted (it used to be in no outcome at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_leaves_while_queued_is_counted_as_abandoned() {
    let _serial = SERIAL.lock().await;
    let tenants = [TenantSpec {
        name: "m-gone",
        key: "sk-gone",
        extra: "max_concurrency = 1\nqueue_depth = 4",
    }];
    let server = TestServer::start(&policy(&tenants, "")).await;
    let client = server.client();
    let outcome = |s: &Scrape, outcome: &str| {
        s.sum(
            REQUESTS_TOTAL,
            &[("tenant", "m-gone"), ("outcome", outcome)],
        )
    };
    let before = scrape(&server).await;

    let running = hold_slot(&client, "sk-gone", 250).await;
    let waiting = tokio::spawn({
        let client = client.clone();
        async move { client.post(CHAT, Some("sk-gone"), &chat("hi", 1)).await }
    });
    wait_until("a request queues behind the running one", WAIT, || {
        queued(&server, "m-gone") == 1
    })
    .await;
    waiting.abort();
    let _ = waiting.await;
    wait_until("the queued request is abandoned", WAIT, || {
        queued(&server, "m-gone") == 0
    })
    .await;
    drop(running);
    server.wait_for_idle_kv(WAIT).await;

    let after = scrape(&server).await;
    assert_eq!(
        outcome(&after, "abandoned") - outcome(&before, "abandoned"),
        1.0
    );
    assert_eq!(
        outcome(&after, "rejected") - outcome(&before, "rejected"),
        0.0
    );
    // The slot holder was admitted; the one that left was not.
    assert_eq!(
        outcome(&after, "admitted") - outcome(&before, "admitted"),
        1.0
    );
    server.shutdown().await;
}

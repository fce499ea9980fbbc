//! Lifetimes through the real server: disconnects free KV (streaming, non-streaming, queued),
//! policy reloads (good and bad), graceful shutdown that loses no in-flight request, with
//! its pre-drain (cut short by a second signal to the real binary), and the end of its grace
//! period, which answers what is still running or queued instead of cutting it off.

mod common;

use std::time::Duration;

use common::client::{raw_connect, raw_post};
use common::process::{scratch_dir, serve};
use common::{
    LONG_ANSWER, TenantSpec, TestServer, chat, hold_slot, one_tenant_policy, policy, queued,
    wait_until,
};
use hyper::StatusCode;

const CHAT: &str = "/v1/chat/completions";
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnecting_a_stream_returns_kv_to_baseline() {
    let server = TestServer::start(&one_tenant_policy("a", "sk-a", "")).await;
    let baseline = server.kv();
    assert_eq!(baseline.used_blocks + baseline.reserved_blocks, 0);
    let stream = hold_slot(&server.client(), "sk-a", 250).await;
    assert!(
        server.kv().used_blocks > 0,
        "the running stream holds blocks"
    );
    drop(stream);
    server.wait_for_idle_kv(WAIT).await;
    // The engine frees the blocks before it publishes its counters.
    wait_until("the engine counts the cancellation", WAIT, || {
        server.engine.stats().cancellations_total >= 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnecting_a_non_streamed_request_cancels_it() {
    let server = TestServer::start(&one_tenant_policy("a", "sk-a", "")).await;
    let body = chat(LONG_ANSWER, 250).to_string();
    let connection = raw_connect(server.addr, &raw_post(CHAT, "sk-a", &body)).await;
    wait_until("the request runs", WAIT, || server.kv().used_blocks > 0).await;
    drop(connection);
    server.wait_for_idle_kv(WAIT).await;
    wait_until("the engine counts the cancellation", WAIT, || {
        server.engine.stats().cancellations_total >= 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnecting_while_queued_leaves_the_queue() {
    let extra = "max_concurrency = 1";
    let server = TestServer::start(&one_tenant_policy("a", "sk-a", extra)).await;
    let running = hold_slot(&server.client(), "sk-a", 300).await;
    let body = chat("hi", 1).to_string();
    let waiting = raw_connect(server.addr, &raw_post(CHAT, "sk-a", &body)).await;
    wait_until("the second request queues", WAIT, || {
        queued(&server, "a") == 1
    })
    .await;
    drop(waiting);
    wait_until("the queue forgets it", WAIT, || queued(&server, "a") == 0).await;
    drop(running);
    server.wait_for_idle_kv(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_reload_applies_good_files_and_keeps_the_old_on_bad_ones() {
    let server = TestServer::start(&one_tenant_policy("a", "sk-a", "")).await;
    let client = server.client();
    assert_eq!(
        client
            .post(CHAT, Some("sk-new"), &chat("hi", 1))
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );

    let grown = policy(
        &[
            TenantSpec {
                name: "a",
                key: "sk-a",
                extra: "",
            },
            TenantSpec {
                name: "b",
                key: "sk-new",
                extra: "",
            },
        ],
        "",
    );
    std::fs::write(&server.policy_path, grown).unwrap();
    server.store.reload().expect("a good policy reloads");
    assert_eq!(
        client
            .post(CHAT, Some("sk-new"), &chat("hi", 1))
            .await
            .status,
        StatusCode::OK
    );

    std::fs::write(&server.policy_path, "[defaults]\nmax_concurrency = -3\n").unwrap();
    let error = server.store.reload().expect_err("a bad policy is refused");
    assert!(error.to_string().contains("max_concurrency"), "{error}");
    // The previous policy is still in force.
    assert_eq!(
        client
            .post(CHAT, Some("sk-new"), &chat("hi", 1))
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(server.store.reload_counts().failure, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_in_flight_requests() {
    let mut server = TestServer::start(&one_tenant_policy("a", "sk-a", "")).await;
    let client = server.client();
    // Long enough that the second request starts while the first still streams, on a fast
    // machine too (both must be running at once).
    let mut stream = hold_slot(&client, "sk-a", 200).await;
    let plain = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .post(CHAT, Some("sk-a"), &chat(LONG_ANSWER, 200))
                .await
        }
    });
    wait_until("both requests run", WAIT, || {
        server.engine.stats().running >= 2
    })
    .await;

    let stopped = server.begin_shutdown();
    // The listener closes as soon as the drain begins: no new connections.
    wait_until("the listener closes", WAIT, || {
        std::net::TcpStream::connect(server.addr).is_err()
    })
    .await;

    // Both in-flight requests complete normally.
    let mut last = String::new();
    while let Some(data) = stream.next_data().await {
        last = data;
    }
    assert_eq!(last, "[DONE]");
    let reply = plain.await.unwrap();
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.json()["choices"][0]["message"]["content"].is_string());
    stopped.await.expect("the server stops after draining");
    assert!(
        tokio::net::TcpStream::connect(server.addr).await.is_err(),
        "no longer accepting"
    );
}

/// When the grace period is over nothing is cut off without an answer: a stream still running
/// gets an OpenAI error event before its connection closes, a non-streamed request still
/// generating gets a 503, and a request still queued behind its tenant's concurrency a 503
/// with Retry-After; the server stops within the grace plus a short flush window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_end_of_the_grace_period_answers_what_is_still_running_or_queued() {
    let grace = Duration::from_millis(500);
    let mut options = common::Options::default();
    options.serve.shutdown_grace = grace;
    let mut server = TestServer::start_with(
        &policy(
            &[
                TenantSpec {
                    name: "a",
                    key: "sk-a",
                    extra: "max_concurrency = 1",
                },
                TenantSpec {
                    name: "b",
                    key: "sk-b",
                    extra: "",
                },
            ],
            "",
        ),
        options,
    )
    .await;
    let client = server.client();
    // Far longer than the grace: 512 tokens (the tenant's limit) take seconds.
    let mut stream = hold_slot(&client, "sk-a", 512).await;
    let plain = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .post(CHAT, Some("sk-b"), &chat(LONG_ANSWER, 512))
                .await
        }
    });
    let waiting = tokio::spawn({
        let client = client.clone();
        async move { client.post(CHAT, Some("sk-a"), &chat("Hi.", 1)).await }
    });
    wait_until("a request queues behind a's slot", WAIT, || {
        queued(&server, "a") == 1
    })
    .await;
    wait_until("both generations run", WAIT, || {
        server.engine.stats().running >= 2
    })
    .await;

    let began = tokio::time::Instant::now();
    let stopped = server.begin_shutdown();
    let mut last = String::new();
    while let Some(data) = stream.next_data().await {
        last = data;
    }
    let event: serde_json::Value = serde_json::from_str(&last)
        .unwrap_or_else(|e| panic!("the stream ends with a JSON event ({e}): {last:?}"));
    assert_eq!(
        event["error"]["code"], "shutting_down",
        "the stream ends with an error event, not a cut: {event}"
    );
    assert_ne!(last, "[DONE]");

    let reply = waiting.await.expect("the queued request gets an answer");
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        reply.body
    );
    assert_eq!(reply.error_code(), "service_unavailable");
    assert_eq!(reply.json()["error"]["type"], "server_error");
    let retry: u64 = reply
        .header("retry-after")
        .expect("a Retry-After")
        .parse()
        .expect("whole seconds");
    assert!(retry >= 1, "{retry}");

    let reply = plain
        .await
        .expect("the non-streamed request gets an answer");
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        reply.body
    );
    assert_eq!(reply.error_code(), "shutting_down");
    assert!(reply.header("retry-after").is_some());

    // Within the grace plus the flush window (half a second) and some slack for the test.
    tokio::time::timeout(grace + Duration::from_secs(3), stopped)
        .await
        .expect("the server stops within the grace and its flush window")
        .expect("the server task ends cleanly");
    assert!(
        began.elapsed() >= grace,
        "answered at the end of the grace, not before: {:?}",
        began.elapsed()
    );
    server.wait_for_idle_kv(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_fails_readiness_first_and_keeps_serving_through_the_pre_drain() {
    let mut options = common::Options::default();
    options.serve.pre_drain = Duration::from_secs(4);
    let mut server = TestServer::start_with(&one_tenant_policy("a", "sk-a", ""), options).await;
    let client = server.client();
    assert_eq!(client.get("/readyz", None).await.status, StatusCode::OK);

    let stopped = server.begin_shutdown();
    let deadline = tokio::time::Instant::now() + WAIT;
    while client.get("/readyz", None).await.status != StatusCode::SERVICE_UNAVAILABLE {
        assert!(
            tokio::time::Instant::now() < deadline,
            "readiness never failed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Still within the pre-drain delay: new connections are accepted and requests served as
    // usual (a load balancer may still send some before it sees the failed probe).
    let fresh = common::Client::new(server.addr);
    let reply = fresh.post(CHAT, Some("sk-a"), &chat("Hi.", 1)).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    // Liveness stays good: draining is not a reason for a restart.
    assert_eq!(fresh.get("/healthz", None).await.status, StatusCode::OK);

    // Then the listener closes and the server stops.
    wait_until("the listener closes", WAIT, || {
        std::net::TcpStream::connect(server.addr).is_err()
    })
    .await;
    stopped.await.expect("the server stops after the pre-drain");
}

/// `kvgate serve` with a pre-drain far longer than the test: the first SIGTERM starts it, a
/// second signal (SIGINT here, as from Ctrl-C) ends it at once and the server exits cleanly.
#[test]
fn a_second_signal_cuts_the_pre_drain_short() {
    let dir = scratch_dir("pre-drain");
    let mut served = serve(
        &[
            "--listen",
            "127.0.0.1:0",
            "--pre-drain",
            "600s",
            "--kv-memory",
            "16MiB",
        ],
        &dir,
    );
    served.signal("TERM");
    served
        .wait_for_line("not ready; still serving", WAIT)
        .expect("the first signal starts the pre-drain");
    // Still serving during the pre-drain (readiness failed, the listener is open).
    assert!(std::net::TcpStream::connect(served.addr).is_ok());
    served.signal("INT");
    served
        .wait_for_line("pre-drain cut short", WAIT)
        .expect("the second signal ends the pre-drain");
    let status = served
        .wait_exit(WAIT)
        .expect("the server exits long before its 600 s pre-drain is over");
    assert!(status.success(), "{status}");
}

/// A client still uploading its body when the grace period ends gets a 503 `shutting_down`
/// in the flush window, not a cut connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_still_uploading_at_the_end_of_the_grace_gets_a_503() {
    let grace = Duration::from_millis(500);
    let mut options = common::Options::default();
    options.serve.shutdown_grace = grace;
    let tenants = [TenantSpec {
        name: "a",
        key: "sk-a",
        extra: "",
    }];
    let mut server = TestServer::start_with(&policy(&tenants, ""), options).await;
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer sk-a\r\n\
         Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n{{\"model\":"
    );
    let mut upload = raw_connect(server.addr, head.as_bytes()).await;
    // Let the server take the request and start reading its body.
    tokio::time::sleep(Duration::from_millis(200)).await;

    let began = tokio::time::Instant::now();
    let stopped = server.begin_shutdown();
    let answer = tokio::time::timeout(WAIT, common::client::read_to_close(&mut upload))
        .await
        .expect("the upload gets an answer and its connection closes");
    assert!(
        answer.starts_with("HTTP/1.1 503"),
        "a 503, not a cut connection: {answer:?}"
    );
    assert!(answer.contains("\"shutting_down\""), "{answer}");
    assert!(
        began.elapsed() >= grace,
        "answered at the end of the grace, not before: {:?}",
        began.elapsed()
    );
    tokio::time::timeout(grace + Duration::from_secs(3), stopped)
        .await
        .expect("the server stops within the grace and its flush window")
        .expect("the server task ends cleanly");
}

//! Scale-out end to end: one gateway in front of a pool of replicas of one model.
//!
//! * Two real `kvgate serve` engine nodes (child processes, loopback): killing one mid-run
//!   ends its streams with an error event, new requests go to the other, and the circuit
//!   breaker readmits it once it is restarted on the same port.
//! * With every replica ejected, requests wait in the fair queue instead of failing: one is
//!   served once its only replica is restarted; with a short `max_queue_wait` the answer is
//!   503 `queue_timeout`, not 502.
//! * Stub replicas (a few lines of hyper) that publish a KV usage the test sets: new work goes
//!   to the emptier one; a shared system prompt sticks to one replica until it saturates.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::process::{Served, scratch_dir, serve, serve_in_scratch};
use common::{LONG_ANSWER, MODEL, TestServer, chat, proxy_gateway, wait_until};
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kvgate_gateway::metrics::exposition::Scrape;
use kvgate_gateway::upstream;
use serde_json::{Value, json};
use tokio::net::TcpListener;

const KEY: &str = "sk-scaleout-test";
/// The pooled model's name.
const POOLED: &str = "pooled";

fn for_pool(mut body: Value) -> Value {
    body["model"] = json!(POOLED);
    body
}

/// A gateway (with its own embedded model, unused here) proxying `replicas` as model
/// [`POOLED`]; each value is `URL[,options]`.
async fn gateway(replicas: &[String]) -> TestServer {
    gateway_with(replicas, "max_concurrency = 16").await
}

/// [`gateway`] whose tenant has `tenant_extra` limits.
async fn gateway_with(replicas: &[String], tenant_extra: &str) -> TestServer {
    let upstreams: Vec<String> = replicas
        .iter()
        .map(|value| format!("{POOLED}={value}"))
        .collect();
    proxy_gateway(KEY, &upstreams, tenant_extra).await
}

/// A short chat for the pool; it must succeed.
async fn ask(gateway: &TestServer, content: &str) {
    ask_with(gateway, for_pool(chat(content, 4))).await;
}

/// Posts `body` to the gateway; it must succeed and carry the pool's name.
async fn ask_with(gateway: &TestServer, body: Value) {
    let reply = gateway
        .client()
        .post("/v1/chat/completions", Some(KEY), &body)
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["model"], POOLED, "renamed to the pool's name");
}

// === Real engine nodes ===

/// `kvgate serve` on `listen` with the built-in policy (an anonymous tenant: the gateway sends
/// no key).
fn engine_node(listen: &str) -> Served {
    serve_in_scratch(
        "scaleout-node",
        &["--listen", listen, "--kv-memory", "64MiB"],
    )
}

/// Requests each replica of [`POOLED`] has been sent, by port.
fn sent_by_port(gateway: &TestServer) -> Vec<(u16, u64)> {
    let upstream = gateway.upstreams.get(POOLED).expect("pooled model");
    upstream
        .replicas()
        .replicas()
        .iter()
        .map(|replica| {
            let port = replica.base_url().rsplit(':').next().unwrap();
            (port.parse().unwrap(), replica.requests_sent())
        })
        .collect()
}

/// The replica of [`POOLED`] listening on `port`.
fn replica_at(gateway: &TestServer, port: u16) -> Arc<upstream::Replica> {
    let upstream = gateway.upstreams.get(POOLED).expect("pooled model");
    let suffix = format!(":{port}");
    upstream
        .replicas()
        .replicas()
        .iter()
        .find(|replica| replica.base_url().ends_with(&suffix))
        .cloned()
        .expect("replica")
}

fn ejected(gateway: &TestServer, port: u16) -> bool {
    replica_at(gateway, port).is_ejected()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_fails_its_streams_the_other_serves_and_the_breaker_readmits_it() {
    let first = engine_node("127.0.0.1:0");
    let second = engine_node("127.0.0.1:0");
    let (first_addr, second_addr) = (first.addr, second.addr);
    let gateway = gateway(&[
        format!("http://{first_addr},capacity=8192,model={MODEL}"),
        format!("http://{second_addr},capacity=8192,model={MODEL}"),
    ])
    .await;
    let client = gateway.client();

    // Four long streams: the router spreads them, two per replica (equal load).
    let mut streams = Vec::new();
    for i in 0..4 {
        // Distinct first words: no shared prefix block pulls them onto one replica.
        let mut body = for_pool(chat(&format!("{i}. {LONG_ANSWER}"), 200));
        body["stream"] = json!(true);
        let mut reply = client
            .stream("/v1/chat/completions", Some(KEY), &body)
            .await;
        assert_eq!(reply.status, StatusCode::OK);
        let first_event = reply.next_data().await.expect("a first chunk");
        assert!(
            first_event.contains("chat.completion.chunk"),
            "{first_event}"
        );
        streams.push(reply);
    }
    let spread = sent_by_port(&gateway);
    assert!(
        spread.iter().all(|(_, sent)| *sent == 2),
        "equal replicas share the work: {spread:?}"
    );

    // Kill the first node (SIGKILL: no drain) while its two streams run.
    drop(first);
    let mut failed = 0;
    let mut finished = 0;
    for reply in streams {
        let events = tokio::time::timeout(Duration::from_secs(120), reply.collect_data())
            .await
            .expect("no stream hangs");
        let last = events.last().cloned().unwrap_or_default();
        if last == "[DONE]" {
            finished += 1;
        } else {
            let error: Value = serde_json::from_str(&last).expect("an error event");
            assert_eq!(error["error"]["code"], "upstream_unavailable", "{last}");
            failed += 1;
        }
    }
    assert_eq!(
        (failed, finished),
        (2, 2),
        "the killed node's streams end with an error"
    );

    // New requests all succeed: the dead replica fails before any byte reached the client,
    // so the request is retried on the other; then the breaker ejects it.
    for i in 0..6 {
        ask(&gateway, &format!("Say hi {i}.")).await;
    }
    assert!(
        ejected(&gateway, first_addr.port()),
        "the breaker ejected it"
    );

    // Restart on the same port: the half-open probe readmits it, and it gets work again.
    let restarted = engine_node(&first_addr.to_string());
    wait_until(
        "the restarted replica is readmitted",
        Duration::from_secs(60),
        || !ejected(&gateway, first_addr.port()),
    )
    .await;
    let before = sent_by_port(&gateway);
    for i in 0..4 {
        ask(&gateway, &format!("Say bye {i}.")).await;
    }
    let after = sent_by_port(&gateway);
    let gained = |port: u16| {
        let at = |list: &[(u16, u64)]| list.iter().find(|(p, _)| *p == port).unwrap().1;
        at(&after) - at(&before)
    };
    assert!(gained(first_addr.port()) >= 1, "{before:?} -> {after:?}");
    drop(restarted);
    drop(second);
}

/// Requests queued in the gateway's admission (all tenants).
fn queued(gateway: &TestServer) -> usize {
    gateway
        .admission
        .queue_snapshot()
        .iter()
        .map(|row| row.queued_requests)
        .sum()
}

/// Sends short requests to `gateway` (whose pool's only replica at `port` is down) until its
/// breaker ejects it; each fails with 502 `upstream_unavailable` (no replica to retry on).
async fn fail_until_ejected(gateway: &TestServer, port: u16) {
    for i in 0..upstream::FAILURE_THRESHOLD {
        let reply = gateway
            .client()
            .post(
                "/v1/chat/completions",
                Some(KEY),
                &for_pool(chat(&format!("fail {i}"), 4)),
            )
            .await;
        assert_eq!(reply.status, StatusCode::BAD_GATEWAY, "{:?}", reply.body);
        assert_eq!(reply.json()["error"]["code"], "upstream_unavailable");
    }
    assert!(
        ejected(gateway, port),
        "the breaker ejected the only replica"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_its_only_replica_ejected_a_request_waits_and_is_served_after_the_restart() {
    let node = engine_node("127.0.0.1:0");
    let addr = node.addr;
    let gateway = gateway_with(
        &[format!("http://{addr},capacity=8192,model={MODEL}")],
        "max_queue_wait = \"90s\"",
    )
    .await;
    ask(&gateway, "Say hi.").await;

    drop(node);
    fail_until_ejected(&gateway, addr.port()).await;

    // No usable capacity: the next request waits in the fair queue, not a 502.
    let client = gateway.client();
    let waiting = tokio::spawn(async move {
        client
            .post(
                "/v1/chat/completions",
                Some(KEY),
                &for_pool(chat("Say hello.", 4)),
            )
            .await
    });
    wait_until("the request is queued", Duration::from_secs(30), || {
        queued(&gateway) == 1
    })
    .await;
    assert!(!waiting.is_finished());

    // Restarted on the same port: the half-open probe readmits it, its capacity comes back,
    // and the queued request is served there.
    let restarted = engine_node(&addr.to_string());
    let reply = tokio::time::timeout(Duration::from_secs(120), waiting)
        .await
        .expect("the queued request is answered")
        .unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["model"], POOLED);
    assert!(!ejected(&gateway, addr.port()));
    assert_eq!(queued(&gateway), 0);
    drop(restarted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_replica_ejected_a_short_queue_wait_ends_in_queue_timeout_not_502() {
    // A replica address nothing listens on (bound, then released).
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    let gateway = gateway_with(
        &[format!("http://{addr},capacity=8192")],
        "max_queue_wait = \"1s\"",
    )
    .await;
    fail_until_ejected(&gateway, addr.port()).await;

    let reply = gateway
        .client()
        .post(
            "/v1/chat/completions",
            Some(KEY),
            &for_pool(chat("Anyone?", 4)),
        )
        .await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        reply.body
    );
    assert_eq!(reply.json()["error"]["code"], "queue_timeout");
    assert!(reply.header("retry-after").is_some(), "{:?}", reply.headers);
    assert!(ejected(&gateway, addr.port()), "still down");
}

// === Stub replicas with a KV usage the test controls ===

/// A stand-in engine: answers any completion at once, and `/metrics` with the KV usage the
/// test set (in thousandths).
struct Stub {
    addr: SocketAddr,
    kv_permille: Arc<AtomicU64>,
    completions: Arc<AtomicUsize>,
}

impl Stub {
    async fn start() -> Stub {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let kv_permille = Arc::new(AtomicU64::new(100));
        let completions = Arc::new(AtomicUsize::new(0));
        let (kv, done) = (Arc::clone(&kv_permille), Arc::clone(&completions));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (kv, done) = (Arc::clone(&kv), Arc::clone(&done));
                let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                    let (kv, done) = (Arc::clone(&kv), Arc::clone(&done));
                    async move { Ok::<_, Infallible>(stub_answer(request.uri().path(), &kv, &done)) }
                });
                tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
            }
        });
        Stub {
            addr,
            kv_permille,
            completions,
        }
    }

    fn set_kv(&self, usage: f64) {
        self.kv_permille
            .store((usage * 1000.0) as u64, Ordering::SeqCst);
    }

    fn completions(&self) -> usize {
        self.completions.load(Ordering::SeqCst)
    }

    /// The `--upstream` value (after `NAME=`) of this stub, scraped as a kvgate node.
    fn spec(&self) -> String {
        let addr = self.addr;
        format!("http://{addr},capacity=100000,metrics=http://{addr}/metrics,kv_metric=kvgate")
    }
}

fn stub_answer(path: &str, kv: &AtomicU64, done: &AtomicUsize) -> Response<Full<Bytes>> {
    let (content_type, body) = match path {
        "/metrics" => (
            "text/plain; version=0.0.4",
            format!(
                "# TYPE kvgate_kv_usage_ratio gauge\nkvgate_kv_usage_ratio {}\n",
                kv.load(Ordering::SeqCst) as f64 / 1000.0
            ),
        ),
        "/v1/chat/completions" => {
            done.fetch_add(1, Ordering::SeqCst);
            (
                "application/json",
                json!({"id": "chatcmpl-stub", "object": "chat.completion", "created": 0,
                       "model": "stub", "choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": "ok"}}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                .to_string(),
            )
        }
        _ => ("text/plain", "ok".to_owned()),
    };
    Response::builder()
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// Waits until `gateway`'s last scrape of each stub reports the KV usage the stub was set to
/// (a fixed sleep could end before a starved scrape task ran).
async fn wait_for_scrapes(gateway: &TestServer, stubs: &[&Stub]) {
    let limit = Duration::from_secs(30);
    wait_until(
        "the gateway scraped every replica's KV usage",
        limit,
        || {
            stubs.iter().all(|stub| {
                let expected = stub.kv_permille.load(Ordering::SeqCst) as f64 / 1000.0;
                replica_at(gateway, stub.addr.port())
                    .load()
                    .scraped
                    .is_some_and(|scraped| (scraped.kv_usage - expected).abs() < 0.002)
            })
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_work_goes_to_the_replica_reporting_less_kv_usage() {
    let (a, b) = (Stub::start().await, Stub::start().await);
    let gateway = gateway(&[a.spec(), b.spec()]).await;
    a.set_kv(0.85);
    b.set_kv(0.10);
    wait_for_scrapes(&gateway, &[&a, &b]).await;
    for i in 0..6 {
        ask(&gateway, &format!("question {i}")).await;
    }
    assert_eq!((a.completions(), b.completions()), (0, 6));

    a.set_kv(0.05);
    b.set_kv(0.80);
    wait_for_scrapes(&gateway, &[&a, &b]).await;
    for i in 0..6 {
        ask(&gateway, &format!("question {i}")).await;
    }
    assert_eq!((a.completions(), b.completions()), (6, 6));

    // Each replica's answers are counted under its own label, and timed per upstream.
    let metrics = gateway.client().get("/metrics", None).await;
    let scrape = Scrape::parse(std::str::from_utf8(&metrics.body).unwrap()).unwrap();
    for stub in [&a, &b] {
        let replica = format!("http://{}", stub.addr);
        let labels = [
            ("upstream", POOLED),
            ("replica", replica.as_str()),
            ("result", "ok"),
        ];
        assert_eq!(
            scrape.value("kvgate_upstream_requests_total", &labels),
            Some(6.0),
            "{replica}"
        );
    }
    let timed = scrape.value(
        "kvgate_upstream_response_seconds_count",
        &[("upstream", POOLED)],
    );
    assert!(timed.is_some_and(|count| count >= 12.0), "{timed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_system_prompt_sticks_to_one_replica_until_it_saturates() {
    let (a, b) = (Stub::start().await, Stub::start().await);
    let gateway = gateway(&[a.spec(), b.spec()]).await;
    wait_for_scrapes(&gateway, &[&a, &b]).await;
    // A system prompt of a few hundred tokens, then a different question each time.
    let system = "You are a meticulous assistant for the ACME support desk. ".repeat(20);
    let with_system = |question: String| {
        for_pool(json!({
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 4,
        }))
    };
    for i in 0..8 {
        ask_with(&gateway, with_system(format!("Q{i}?"))).await;
    }
    let (on_a, on_b) = (a.completions(), b.completions());
    assert!(
        (on_a, on_b) == (8, 0) || (on_a, on_b) == (0, 8),
        "affinity keeps the prefix on one replica: {on_a}/{on_b}"
    );
    // The home replica saturates: the load guard sends the same prefix elsewhere.
    let (home, other) = if on_a == 8 { (&a, &b) } else { (&b, &a) };
    home.set_kv(0.95);
    wait_for_scrapes(&gateway, &[home, other]).await;
    for i in 0..4 {
        ask_with(&gateway, with_system(format!("R{i}?"))).await;
    }
    assert_eq!(
        home.completions(),
        8,
        "nothing more to the saturated replica"
    );
    assert_eq!(other.completions(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstreams_reported_usage_settles_the_token_debit() {
    let stub = Stub::start().await;
    // 1000 tokens a minute refill 17 a second: small against the 499 tokens at stake.
    let gateway = gateway_with(&[stub.spec()], "tokens_per_minute = 1000").await;
    let remaining = |reply: &common::Reply| -> i64 {
        reply
            .header("x-ratelimit-remaining-tokens")
            .expect("rate headers")
            .parse()
            .unwrap()
    };
    let body = for_pool(chat("Hi.", 500));
    let client = gateway.client();
    let started = std::time::Instant::now();
    let first = client.post("/v1/chat/completions", Some(KEY), &body).await;
    assert_eq!(first.status, StatusCode::OK, "{:?}", first.body);
    // The debit at admission is prompt + max_tokens (from a full bucket: nothing refilled).
    let prompt = 1000 - remaining(&first) - 500;
    let second = client.post("/v1/chat/completions", Some(KEY), &body).await;
    assert_eq!(second.status, StatusCode::OK, "{:?}", second.body);
    // What refilled between the two debits, at most (both lie within `started..now`).
    let refilled = (1000.0 * started.elapsed().as_secs_f64() / 60.0).ceil() as i64 + 1;
    // The stub reported 1 completion token: the first request cost prompt + 1, not + 500, so
    // between the debits the bucket lost prompt + 500 - 499 less what refilled (without the
    // refund it would have lost 499 more).
    let spent_between = remaining(&first) - remaining(&second);
    let expected = prompt + 500 - 499;
    assert!(
        spent_between <= expected + 1 && spent_between >= expected - refilled,
        "second debit {spent_between} after a refund of 499; expected {expected} less at \
         most {refilled} refilled"
    );
}

/// `kvgate serve` (the built-in policy: anonymous tenant) proxying the models of the upstreams
/// `file`, run in `home`.
fn serve_upstreams_file(file: &std::path::Path, home: &std::path::Path) -> Served {
    let upstreams = file.display().to_string();
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--kv-memory",
        "64MiB",
        "--upstreams",
        &upstreams,
    ];
    serve(&args, home)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_binary_reloads_its_upstreams_file_and_keeps_it_on_a_bad_edit() {
    let (a, b) = (Stub::start().await, Stub::start().await);
    let home = scratch_dir("scaleout-file");
    let file = home.join("upstreams.toml");
    let replica = |stub: &Stub| {
        format!(
            "[[replica]]\nname = \"{POOLED}\"\nurl = \"http://{}\"\ncapacity = 100000\n",
            stub.addr
        )
    };
    std::fs::write(&file, replica(&a)).unwrap();
    let server = serve_upstreams_file(&file, &home);
    let client = common::Client::new(server.addr);
    let ask_pool = |content: &'static str| {
        let client = client.clone();
        async move {
            let reply = client
                .post("/v1/chat/completions", None, &for_pool(chat(content, 4)))
                .await;
            assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        }
    };
    ask_pool("first").await;
    assert_eq!((a.completions(), b.completions()), (1, 0));

    // Replace the replica: new requests go to the new one, without a restart.
    let staged = home.join("upstreams.toml.new");
    std::fs::write(&staged, replica(&b)).unwrap();
    std::fs::rename(&staged, &file).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        ask_pool("again").await;
        if b.completions() > 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not reloaded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A bad edit keeps the running replica; its location is logged.
    std::fs::write(&file, "[[replica]]\nname = \"pooled\"\nurl = \"ftp://x\"\n").unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = b.completions();
    ask_pool("still").await;
    assert_eq!(
        b.completions(),
        before + 1,
        "the last good set still serves"
    );
    let (_, log) = server.stop();
    assert!(
        log.iter()
            .any(|line| line.contains("upstreams reload failed")
                && line.contains("upstreams.toml:3:7")),
        "{log:#?}"
    );
}

// === Capacity gauges ===

/// `kvgate_upstream_capacity_tokens{model}` and `kvgate_upstream_replicas{model,state}` by
/// state (healthy, ejected, half_open) from the gateway's `/metrics`.
async fn capacity_gauges(gateway: &TestServer) -> (f64, [f64; 3]) {
    let reply = gateway.client().get("/metrics", None).await;
    let scrape = Scrape::parse(std::str::from_utf8(&reply.body).unwrap()).unwrap();
    let replicas = |state| {
        scrape
            .value(
                "kvgate_upstream_replicas",
                &[("model", POOLED), ("state", state)],
            )
            .unwrap_or_else(|| panic!("no {state} replicas series"))
    };
    let capacity = scrape
        .value("kvgate_upstream_capacity_tokens", &[("model", POOLED)])
        .expect("a capacity series");
    (
        capacity,
        [
            replicas("healthy"),
            replicas("ejected"),
            replicas("half_open"),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_gauges_follow_the_breakers_and_reloads() {
    let stub = Stub::start().await;
    // A replica address nothing listens on (bound, then released).
    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let dead_spec = format!("http://{dead_addr},capacity=8192");
    let gateway = gateway(&[stub.spec(), dead_spec.clone()]).await;
    assert_eq!(
        capacity_gauges(&gateway).await,
        (100_000.0 + 8192.0, [2.0, 0.0, 0.0]),
        "both replicas start healthy"
    );

    // Requests that land on the dead replica fail over to the stub (each still answers 200)
    // and count against its breaker until it is ejected.
    for i in 0.. {
        if ejected(&gateway, dead_addr.port()) {
            break;
        }
        assert!(i < 50, "the dead replica was never ejected");
        ask(&gateway, &format!("spread {i}")).await;
    }
    let (capacity, [healthy, ejected_now, half_open]) = capacity_gauges(&gateway).await;
    assert_eq!(capacity, 100_000.0, "only the healthy replica's capacity");
    assert_eq!(healthy, 1.0);
    // Its half-open probe may be out at the moment of the scrape.
    assert_eq!(ejected_now + half_open, 1.0, "{ejected_now} + {half_open}");

    // A reload that drops the dead replica: the gauges follow at once.
    gateway
        .upstreams
        .reload(vec![format!("{POOLED}={}", stub.spec()).parse().unwrap()])
        .unwrap();
    assert_eq!(
        capacity_gauges(&gateway).await,
        (100_000.0, [1.0, 0.0, 0.0])
    );
}

// === Models added and removed by an upstreams-file reload ===

/// A replica whose chat answers are SSE streams that send one chunk at once and finish only
/// when the test releases them (one release per stream).
struct HeldStreams {
    addr: SocketAddr,
    release: Arc<tokio::sync::Semaphore>,
}

type AnyBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

fn sse_chunk(content: &str) -> String {
    let chunk = json!({"id": "chatcmpl-held", "object": "chat.completion.chunk", "created": 0,
                       "model": "held", "choices": [{"index": 0, "delta": {"content": content},
                       "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

impl HeldStreams {
    async fn start() -> HeldStreams {
        use http_body_util::{BodyExt, StreamBody};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let gate = Arc::clone(&release);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let gate = Arc::clone(&gate);
                let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                    let gate = Arc::clone(&gate);
                    async move {
                        if request.uri().path() != "/v1/chat/completions" {
                            let ok: AnyBody = Full::new(Bytes::from("ok")).boxed_unsync();
                            return Ok::<_, Infallible>(Response::new(ok));
                        }
                        let frames = futures::stream::unfold(0u8, move |step| {
                            let gate = Arc::clone(&gate);
                            async move {
                                let text = match step {
                                    0 => sse_chunk("Hello"),
                                    1 => {
                                        gate.acquire().await.unwrap().forget();
                                        format!("{}data: [DONE]\n\n", sse_chunk(" world"))
                                    }
                                    _ => return None,
                                };
                                let frame = hyper::body::Frame::data(Bytes::from(text));
                                Some((Ok::<_, Infallible>(frame), step + 1))
                            }
                        });
                        let body: AnyBody = StreamBody::new(frames).boxed_unsync();
                        let response = Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(body)
                            .unwrap();
                        Ok(response)
                    }
                });
                tokio::spawn(http1::Builder::new().serve_connection(TokioIo::new(stream), service));
            }
        });
        HeldStreams { addr, release }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_adds_a_routable_model_and_removes_one_while_its_stream_finishes() {
    const EXTRA: &str = "extra";
    let (plain, held) = (Stub::start().await, HeldStreams::start().await);
    let home = scratch_dir("scaleout-models");
    let file = home.join("upstreams.toml");
    let pooled = format!(
        "[[replica]]\nname = \"{POOLED}\"\nurl = \"http://{}\"\ncapacity = 100000\n",
        plain.addr
    );
    let extra = format!(
        "[[replica]]\nname = \"{EXTRA}\"\nurl = \"http://{}\"\ncapacity = 50000\n",
        held.addr
    );
    // Written whole, then renamed over the file: the watcher never reads half a file.
    let write = |text: &str| {
        let staged = home.join("upstreams.toml.new");
        std::fs::write(&staged, text).unwrap();
        std::fs::rename(&staged, &file).unwrap();
    };
    write(&pooled);
    let server = serve_upstreams_file(&file, &home);
    let client = common::Client::new(server.addr);
    let listed = |client: common::Client| async move {
        let models = client.get("/v1/models", None).await.json();
        let ids = models["data"].as_array().unwrap().iter();
        ids.map(|card| card["id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let mut streamed = chat("Say hello.", 8);
    streamed["model"] = json!(EXTRA);
    streamed["stream"] = json!(true);
    let missing = client.post("/v1/chat/completions", None, &streamed).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND, "{:?}", missing.body);

    // Added: listed and routable without a restart.
    write(&format!("{pooled}{extra}"));
    wait_for(
        || listed(client.clone()),
        |ids| ids.iter().any(|id| id == EXTRA),
    )
    .await;
    let mut stream = client.stream("/v1/chat/completions", None, &streamed).await;
    assert_eq!(stream.status, StatusCode::OK);
    let first: Value = serde_json::from_str(&stream.next_data().await.unwrap()).unwrap();
    assert_eq!(first["choices"][0]["delta"]["content"], "Hello");
    assert_eq!(first["model"], EXTRA, "renamed to the added model's name");

    // Removed while that stream is held: new requests get 404, the stream is untouched.
    write(&pooled);
    wait_for(
        || listed(client.clone()),
        |ids| ids.iter().all(|id| id != EXTRA),
    )
    .await;
    let gone = client.post("/v1/chat/completions", None, &streamed).await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND, "{:?}", gone.body);
    assert_eq!(gone.json()["error"]["code"], "model_not_found");
    held.release.add_permits(1);
    let rest = stream.collect_data().await;
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "{rest:?}");
    assert!(rest.iter().any(|data| data.contains(" world")), "{rest:?}");
    assert!(
        !rest.iter().any(|data| data.contains("\"error\"")),
        "{rest:?}"
    );

    // The model that stayed serves as before.
    let reply = client
        .post(
            "/v1/chat/completions",
            None,
            &for_pool(chat("Still there?", 4)),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(plain.completions(), 1);
    let _ = server.stop();
}

/// Polls `read` every 100 ms until `done` holds for what it read; panics after 30 s.
async fn wait_for<T: std::fmt::Debug, F: std::future::Future<Output = T>>(
    mut read: impl FnMut() -> F,
    done: impl Fn(&T) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let value = read().await;
        if done(&value) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not reloaded: {value:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

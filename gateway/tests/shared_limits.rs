//! Tenant limits shared by gateway replicas through a real `redis-server` on loopback.
//!
//! Each "replica" is an [`Admission`] of its own (its own local buckets, dispatcher and pool),
//! as in two gateway processes; they share only the Redis named by the policy's `[shared]`.
//! Every test starts its own `redis-server` on an ephemeral port (no persistence) and kills it
//! when done. Without `redis-server` on PATH the tests skip, unless `KVGATE_REQUIRE_REDIS=1`
//! (CI sets it) makes that a failure.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvgate_gateway::admission::{Admission, AdmissionTicket, Admitted, PoolId, Rejection};
use kvgate_gateway::auth::Credential;
use kvgate_gateway::policy::{SharedPolicy, parse_policy};
use kvgate_gateway::ratelimit::shared::SharedLimiter;
use kvgate_gateway::ratelimit::{LimitKind, SharedDecision};
use kvgate_gateway::reload::PolicyStore;
use kvgate_runtime::block_pool::BlockPool;

/// A `redis-server` child on 127.0.0.1, killed on drop.
struct RedisServer {
    child: Option<Child>,
    port: u16,
}

impl RedisServer {
    /// Starts one, or `None` (skip) when `redis-server` is not installed and CI does not
    /// require it.
    fn start() -> Option<RedisServer> {
        if Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            assert!(
                std::env::var("KVGATE_REQUIRE_REDIS").as_deref() != Ok("1"),
                "redis-server is not installed and KVGATE_REQUIRE_REDIS=1 (apt-get install redis-server)"
            );
            eprintln!("skipping: redis-server is not installed");
            return None;
        }
        // Another test may take the port between our probe and redis binding it: try again.
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("an ephemeral port")
                .port();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server");
            let mut server = RedisServer {
                child: Some(child),
                port,
            };
            if server.wait_ready() {
                return Some(server);
            }
            server.stop();
        }
        panic!("redis-server did not start");
    }

    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(Ok(Some(_exited))) = self.child.as_mut().map(|c| c.try_wait()) {
                return false;
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Kills the server and starts a fresh one (no data kept) on the same port.
    fn restart(&mut self) {
        self.stop();
        for _ in 0..50 {
            let child = Command::new("redis-server")
                .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server");
            self.child = Some(child);
            if self.wait_ready() {
                return;
            }
            // The old server's port may not be free yet.
            self.stop();
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("redis-server did not restart on port {}", self.port);
    }

    /// Kills the server (Redis "stopped mid-run").
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One gateway replica's admission under `policy`.
fn replica(policy: &str) -> (Admission, PolicyStore) {
    let store = PolicyStore::from_policy(parse_policy("shared.toml", policy).unwrap());
    let pool = BlockPool::new(10_000, 16, 1024);
    (Admission::new(store.clone(), pool), store)
}

fn policy(redis: &RedisServer, shared_extra: &str, tenant: &str) -> String {
    format!(
        "[shared]\nredis = \"{}\"\ntimeout = \"1s\"\n{shared_extra}\n[tenants.a]\n{tenant}\n",
        redis.url()
    )
}

fn ticket(store: &PolicyStore, n: usize, prompt: usize, max_output: usize) -> AdmissionTicket {
    AdmissionTicket {
        tenant: store.current().tenant("a").unwrap(),
        // Checked again only by a policy reload, which these tests never do.
        credential: Credential::NoKey,
        prompt_tokens: prompt,
        max_output_tokens: max_output,
        prompt_param: "messages",
        request_id: format!("req-{n}"),
        pool: PoolId::LOCAL,
        prefix: None,
    }
}

/// Admits `ticket`, and checks the answer came well within the store timeout plus slack: a
/// failing store must never hang admission.
async fn admit(admission: &Admission, ticket: AdmissionTicket) -> Result<Admitted, Rejection> {
    let started = Instant::now();
    let answer = admission.admit(ticket).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "admission took {took:?}");
    answer
}

/// Polls `condition` every 20 ms for up to `limit`.
async fn eventually<F: std::future::Future<Output = bool>>(
    limit: Duration,
    mut condition: impl FnMut() -> F,
) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if condition().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Retries an admission every 20 ms for up to `limit` (a release or refund travels to Redis
/// in the background after a drop); the first success, if any.
async fn admit_within(
    limit: Duration,
    admission: &Admission,
    ticket: impl Fn() -> AdmissionTicket,
) -> Option<Admitted> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(admitted) = admission.admit(ticket()).await {
            return Some(admitted);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

#[tokio::test]
async fn two_replicas_enforce_one_requests_per_minute_limit_together() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let text = policy(
        &redis,
        "replicas = 2",
        "requests_per_minute = 10\nmax_concurrency = 100",
    );
    let (first, first_store) = replica(&text);
    let (second, second_store) = replica(&text);
    let mut held = Vec::new();
    let mut refused = 0;
    for n in 0..30 {
        let (admission, store) = if n % 2 == 0 {
            (&first, &first_store)
        } else {
            (&second, &second_store)
        };
        match admit(admission, ticket(store, n, 10, 10)).await {
            // Held: a request dropped before it ran is refunded, which would reopen the bucket.
            Ok(admitted) => held.push(admitted),
            Err(Rejection::RateLimited {
                kind, retry_after, ..
            }) => {
                assert_eq!(kind, LimitKind::Requests);
                assert!(retry_after > Duration::ZERO);
                refused += 1;
            }
            Err(other) => panic!("unexpected rejection: {}", other.message()),
        }
    }
    // Alone, each replica would have admitted 10 (20 in all).
    assert!(
        (10..=12).contains(&held.len()),
        "admitted {} of 30 across two replicas sharing 10/min",
        held.len()
    );
    assert_eq!(held.len() + refused, 30);
}

#[tokio::test]
async fn two_replicas_enforce_one_concurrency_limit_and_release_on_drop() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let text = policy(&redis, "replicas = 2", "max_concurrency = 3");
    let (first, first_store) = replica(&text);
    let (second, second_store) = replica(&text);
    let mut a1 = admit(&first, ticket(&first_store, 1, 10, 10))
        .await
        .unwrap();
    a1.mark_started();
    let _a2 = admit(&first, ticket(&first_store, 2, 10, 10))
        .await
        .unwrap();
    let _b1 = admit(&second, ticket(&second_store, 3, 10, 10))
        .await
        .unwrap();
    // Each replica runs fewer than 3, but the tenant runs 3 across both.
    for (admission, store) in [(&first, &first_store), (&second, &second_store)] {
        match admit(admission, ticket(store, 4, 10, 10)).await {
            Err(
                rejection @ Rejection::RateLimited {
                    kind: LimitKind::Concurrency,
                    ..
                },
            ) => {
                assert_eq!(rejection.status(), 429);
                assert!(rejection.retry_after().is_some());
            }
            other => panic!(
                "expected a shared concurrency refusal, got {:?}",
                other.map(|_| ())
            ),
        }
    }
    a1.record_completion(3);
    drop(a1);
    // The lease is released in the background: the other replica gets the slot soon after.
    let freed = admit_within(Duration::from_secs(2), &second, || {
        ticket(&second_store, 5, 10, 10)
    })
    .await;
    assert!(
        freed.is_some(),
        "the released lease never freed a slot for the other replica"
    );
}

#[tokio::test]
async fn token_debits_are_settled_to_what_the_stream_used() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let text = policy(&redis, "", "tokens_per_minute = 100\nmax_concurrency = 10");
    let (admission, store) = replica(&text);
    let mut first = admit(&admission, ticket(&store, 1, 10, 80)).await.unwrap();
    // 90 of 100 charged: another 90 does not fit now.
    match admit(&admission, ticket(&store, 2, 10, 80)).await {
        Err(Rejection::RateLimited {
            kind: LimitKind::Tokens,
            ..
        }) => {}
        other => panic!("expected a token refusal, got {:?}", other.map(|_| ())),
    }
    first.mark_started();
    first.record_completion(5);
    drop(first); // used 15: 75 come back
    let refunded = admit_within(Duration::from_secs(2), &admission, || {
        ticket(&store, 3, 10, 70)
    })
    .await;
    assert!(
        refunded.is_some(),
        "the unused tokens were never refunded to the shared bucket"
    );
}

#[tokio::test]
async fn leases_are_renewed_while_held_and_expire_when_their_replica_dies() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let text = policy(&redis, "", "max_concurrency = 1");
    let shared: SharedPolicy = parse_policy("shared.toml", &text)
        .unwrap()
        .shared
        .clone()
        .unwrap();
    let tenant = parse_policy("shared.toml", &text)
        .unwrap()
        .tenant("a")
        .unwrap();
    let ttl = Duration::from_millis(600);

    // A live holder keeps its lease past the ttl by renewing it.
    let holder = SharedLimiter::with_lease_ttl(&shared, ttl).unwrap();
    let other = SharedLimiter::with_lease_ttl(&shared, ttl).unwrap();
    let SharedDecision::Admitted(charge) = holder.acquire(&tenant, "held", 1).await else {
        panic!("first lease refused");
    };
    tokio::time::sleep(ttl * 2).await;
    assert!(matches!(
        other.acquire(&tenant, "other", 1).await,
        SharedDecision::Refused(_)
    ));
    drop(charge);

    // A replica that dies holding a lease (its runtime and renewer gone, no release sent).
    let crashed_shared = shared.clone();
    let crashed_tenant = tenant.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let limiter = SharedLimiter::with_lease_ttl(&crashed_shared, ttl).unwrap();
            let admitted = eventually(Duration::from_secs(2), || async {
                match limiter.acquire(&crashed_tenant, "crashed", 1).await {
                    SharedDecision::Admitted(charge) => {
                        std::mem::forget(charge);
                        true
                    }
                    _ => false,
                }
            })
            .await;
            assert!(admitted);
        });
    })
    .join()
    .unwrap();
    assert!(matches!(
        other.acquire(&tenant, "other", 1).await,
        SharedDecision::Refused(_)
    ));
    let expired = eventually(ttl * 4, || async {
        matches!(
            other.acquire(&tenant, "other", 1).await,
            SharedDecision::Admitted(_)
        )
    })
    .await;
    assert!(expired, "a dead replica's lease never expired");
}

#[tokio::test]
async fn redis_stopped_mid_run_falls_back_to_the_local_share() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let text = policy(
        &redis,
        "replicas = 2\non_store_error = \"local\"",
        "requests_per_minute = 10\nmax_concurrency = 100",
    );
    let (admission, store) = replica(&text);
    let mut held = vec![admit(&admission, ticket(&store, 0, 10, 10)).await.unwrap()];
    redis.stop();
    let mut refused = 0;
    for n in 1..=12 {
        match admit(&admission, ticket(&store, n, 10, 10)).await {
            Ok(admitted) => held.push(admitted),
            Err(Rejection::RateLimited {
                kind: LimitKind::Requests,
                ..
            }) => refused += 1,
            Err(other) => panic!("unexpected rejection: {}", other.message()),
        }
    }
    // 1 through Redis, then this replica's share: 10 ÷ 2 = 5 locally.
    assert_eq!(held.len(), 6, "refused {refused}");
}

#[tokio::test]
async fn redis_stopped_mid_run_denies_with_503_when_the_policy_says_deny() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let text = policy(
        &redis,
        "on_store_error = \"deny\"",
        "requests_per_minute = 10",
    );
    let (admission, store) = replica(&text);
    let _ok = admit(&admission, ticket(&store, 0, 10, 10)).await.unwrap();
    redis.stop();
    for n in 1..=3 {
        match admit(&admission, ticket(&store, n, 10, 10)).await {
            Err(rejection @ Rejection::StoreUnavailable { .. }) => {
                assert_eq!(rejection.status(), 503);
                assert_eq!(rejection.code(), "rate_limit_store_unavailable");
                assert!(rejection.retry_after().is_some());
            }
            other => panic!("expected 503, got {:?}", other.map(|_| ())),
        }
    }
}

#[tokio::test]
async fn redis_stopped_mid_run_admits_unlimited_when_the_policy_says_allow() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let text = policy(
        &redis,
        "on_store_error = \"allow\"",
        "requests_per_minute = 2\nmax_concurrency = 100",
    );
    let (admission, store) = replica(&text);
    let mut held = vec![admit(&admission, ticket(&store, 0, 10, 10)).await.unwrap()];
    redis.stop();
    for n in 1..=5 {
        held.push(admit(&admission, ticket(&store, n, 10, 10)).await.unwrap());
    }
    assert_eq!(held.len(), 6);
}

/// QA's repro, reduced: Redis stalls (here `CLIENT PAUSE`, which makes the server hold every
/// command it receives until the pause ends) for longer than the per-call timeout while a
/// request acquires. The gateway gives up (`on_store_error` decides that request), but the
/// script is still queued and runs when Redis resumes; it must not leave a lease or a charge
/// that no `SharedCharge` will ever give back.
#[tokio::test]
async fn an_admission_that_timed_out_in_a_stalled_store_leaves_no_lease_or_charge() {
    let Some(redis) = RedisServer::start() else {
        return;
    };
    // Slow rates, so a leaked charge would outlive the test: one request holds the rpm key for
    // 10 s and 500 tokens hold the tpm key for 30 s; the lease would hold for 30 s.
    let text = format!(
        "[shared]\nredis = \"{}\"\ntimeout = \"50ms\"\n[tenants.a]\n\
         requests_per_minute = 6\ntokens_per_minute = 1000\nmax_concurrency = 1\n",
        redis.url()
    );
    let parsed = parse_policy("shared.toml", &text).unwrap();
    let shared = parsed.shared.clone().unwrap();
    let tenant = parsed.tenant("a").unwrap();
    let limiter = SharedLimiter::new(&shared).unwrap();
    let client = redis::Client::open(redis.url()).unwrap();
    let mut probe = client.get_multiplexed_async_connection().await.unwrap();

    // Connected, and the script cached: the stalled call below is one EVALSHA.
    let SharedDecision::Admitted(warm) = limiter.acquire(&tenant, "warm", 1).await else {
        panic!("the warm-up admission was refused");
    };
    drop(warm);
    let clean = |probe: redis::aio::MultiplexedConnection| async move {
        let mut probe = probe;
        let leases: i64 = redis::cmd("ZCARD")
            .arg("kvgate:{a}:leases")
            .query_async(&mut probe)
            .await
            .unwrap();
        let rpm: Option<String> = redis::cmd("GET")
            .arg("kvgate:{a}:rpm")
            .query_async(&mut probe)
            .await
            .unwrap();
        let tpm: Option<String> = redis::cmd("GET")
            .arg("kvgate:{a}:tpm")
            .query_async(&mut probe)
            .await
            .unwrap();
        leases == 0 && rpm.is_none() && tpm.is_none()
    };
    assert!(
        eventually(Duration::from_secs(2), || clean(probe.clone())).await,
        "the warm-up admission was not released"
    );

    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(400)
        .arg("ALL")
        .query_async(&mut probe)
        .await
        .unwrap();
    let started = Instant::now();
    let decision = limiter.acquire(&tenant, "stalled", 500).await;
    assert!(
        matches!(decision, SharedDecision::StoreError(_)),
        "expected a store timeout, got {decision:?}"
    );
    assert!(started.elapsed() < Duration::from_millis(300));

    // Redis resumes and runs the queued admit; nothing it wrote may outlive the cancel.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        eventually(Duration::from_secs(3), || clean(probe.clone())).await,
        "the timed-out admission left a lease or a charge behind"
    );
    // And the tenant's one concurrency slot is free for the next request.
    assert!(matches!(
        limiter.acquire(&tenant, "after", 1).await,
        SharedDecision::Admitted(_)
    ));
}

/// A restart drops the connection every replica holds; the first call after it finds the
/// connection broken. That call is sent again once on a fresh connection instead of counting
/// as a store error: with `deny`, a store error would refuse a request the restarted store
/// admits (and with `local` it would admit past the shared limit).
#[tokio::test]
async fn the_first_admission_after_a_redis_restart_goes_through_the_new_store() {
    let Some(mut redis) = RedisServer::start() else {
        return;
    };
    let text = policy(
        &redis,
        "on_store_error = \"deny\"",
        "requests_per_minute = 100\nmax_concurrency = 100",
    );
    let (admission, store) = replica(&text);
    let mut held = vec![admit(&admission, ticket(&store, 0, 10, 10)).await.unwrap()];
    redis.restart();
    for n in 1..=3 {
        match admit(&admission, ticket(&store, n, 10, 10)).await {
            Ok(admitted) => held.push(admitted),
            Err(rejection) => panic!(
                "admission {n} after the restart was refused: {}",
                rejection.message()
            ),
        }
    }
    // Charged in the new store: its rpm bucket exists again.
    let client = redis::Client::open(redis.url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("kvgate:{a}:*")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert!(
        keys.iter().any(|k| k.ends_with(":rpm")),
        "the new store holds no charge: {keys:?}"
    );
}

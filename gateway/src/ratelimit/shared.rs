//! Tenant limits shared by every gateway replica through Redis (`[shared]` in the policy).
//!
//! Without it each replica keeps its own buckets, so N replicas admit N × a tenant's limit.
//! With it, one Lua script per request decides against state in Redis, atomically:
//!
//! - requests per minute and tokens per minute as GCRA (one key per bucket holding the
//!   theoretical arrival time, TAT, in milliseconds of Redis's own clock from `TIME`, so the
//!   replicas' clocks never matter); the request is charged prompt + max_tokens up front, as the
//!   local limiter does, and the unused part is refunded when the response ends (the TAT moves
//!   back, never before now);
//! - tenant concurrency as leases: a sorted set per tenant, member = this replica's id + the
//!   request id, score = expiry. Acquiring prunes expired leases first, so the leases of a
//!   replica that crashed free themselves after [`LEASE_TTL`]; a live stream renews its lease
//!   every third of that; the end of the response removes it.
//!
//! Nothing is written unless all three pass, so a refusal costs the tenant nothing. Keys carry
//! the tenant in a hash tag (`kvgate:{tenant}:rpm`), so a Redis Cluster keeps one tenant's keys
//! on one shard and the script stays legal there.
//!
//! Every call is bounded by the policy's `timeout`. A failed or slow call is the caller's to
//! decide (`on_store_error`): [`SharedDecision::StoreError`] says so, and
//! [`SharedLimiter::record_store_error`] logs (at most once per [`LOG_EVERY`]) and counts it.
//!
//! A call the gateway gave up on may still run: a stalled Redis keeps it queued and runs it
//! when it resumes, taking a lease and charging rates that no [`SharedCharge`] will ever give
//! back (the tenant then sees 429s with nothing running until the leases expire). So every
//! admission is made idempotent-cancellable through a per-request *receipt* key,
//! `kvgate:{tenant}:admit:<member>`: the admit script writes `1` there when it admits, and a
//! call that failed or timed out is followed by [`CANCEL_LUA`] for the same member (spawned,
//! retried, counted in `kvgate_shared_compensations_total`). The cancel script undoes exactly
//! what a receipt says was done (ZREM the lease, refund the request and its tokens) and leaves
//! a `0` tombstone; finding no receipt, it leaves the tombstone anyway, and an admit that runs
//! after it sees the tombstone and writes nothing. So the outcome is the same whichever of the
//! two Redis runs first (they normally run in order on the one multiplexed connection, but a
//! reconnect in between could swap them), a cancel retried twice is a no-op, and nothing
//! depends on the gateway's clock agreeing with Redis's (a deadline checked against `TIME`
//! would). Receipts and tombstones expire with the lease ttl, measured from when Redis ran
//! them; a charge's release deletes its receipt, so they only cost memory while requests live.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use redis::Script;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{BucketStatus, LimitKind, RateLimitError, RateLimitHeaders};
use crate::policy::{SharedPolicy, TenantPolicy};

/// How long a lease outlives its last renewal: how long a crashed replica's requests keep
/// counting against their tenant's concurrency.
pub const LEASE_TTL: Duration = Duration::from_secs(30);
/// At most one store-error log line per this long (each error is still counted).
const LOG_EVERY: Duration = Duration::from_secs(10);
/// Retry-After for a tenant at its shared concurrency limit: a lease frees when some stream
/// ends, which the store cannot forecast; a second is the capacity rejections' floor.
const CONCURRENCY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Decides or refuses one request: RPM, TPM and the concurrency lease in one round trip.
///
/// KEYS: rpm, tpm, leases, receipt. ARGV: rpm limit, tpm limit (0 = none), tokens, lease
/// limit (0 = none), lease member, lease ttl ms (also the receipt's). Returns {verdict, wait
/// ms, rpm remaining, rpm reset ms, tpm remaining, tpm reset ms}; verdict 0 = admitted, 1 =
/// rpm, 2 = tpm, 3 = concurrency, 4 = already cancelled (a [`CANCEL_LUA`] for this member ran
/// first: nothing is written).
const ADMIT_LUA: &str = r"
if redis.call('EXISTS', KEYS[4]) == 1 then return {4, 0, 0, 0, 0, 0} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local period = 60000
local function gcra(key, limit, cost)
  if limit <= 0 then return true, now, 0, 0 end
  local interval = period / limit
  local tat = now
  local stored = redis.call('GET', key)
  if stored then tat = math.max(tonumber(stored), now) end
  local new = tat + cost * interval
  if new - now > period then
    return false, new, (new - now) - period, 0
  end
  return true, new, 0, math.floor((period - (new - now)) / interval)
end
local rpm_limit, tpm_limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local tokens, lease_limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local rpm_ok, rpm_tat, rpm_wait, rpm_left = gcra(KEYS[1], rpm_limit, 1)
local tpm_ok, tpm_tat, tpm_wait, tpm_left = gcra(KEYS[2], tpm_limit, tokens)
local function status(verdict, wait)
  return {verdict, math.ceil(wait), rpm_left, math.ceil(rpm_tat - now), tpm_left,
          math.ceil(tpm_tat - now)}
end
if not rpm_ok then return status(1, rpm_wait) end
if not tpm_ok then return status(2, tpm_wait) end
if lease_limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= lease_limit then return status(3, 0) end
  local ttl = tonumber(ARGV[6])
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[5])
  redis.call('PEXPIRE', KEYS[3], ttl * 2)
end
if rpm_limit > 0 then redis.call('SET', KEYS[1], rpm_tat, 'PX', math.max(1, math.ceil(rpm_tat - now))) end
if tpm_limit > 0 then redis.call('SET', KEYS[2], tpm_tat, 'PX', math.max(1, math.ceil(tpm_tat - now))) end
redis.call('SET', KEYS[4], '1', 'PX', tonumber(ARGV[6]))
return status(0, 0)
";

/// Lua shared by [`CANCEL_LUA`] and [`REFUND_LUA`]: `now` from the server's clock, and
/// `refund(key, limit, cells)`, which moves a GCRA TAT back by `cells` intervals, never before
/// now (the key goes when nothing is left to wait for). A macro so `concat!` can splice it.
macro_rules! refund_with_server_time {
    () => {
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local function refund(key, limit, cells)
  if limit <= 0 or cells <= 0 then return end
  local stored = redis.call('GET', key)
  if not stored then return end
  local tat = math.max(tonumber(stored) - cells * 60000 / limit, now)
  if tat - now < 1 then redis.call('DEL', key) return end
  redis.call('SET', key, tat, 'PX', math.ceil(tat - now))
end
"
    };
}

/// Undoes an admission the gateway gave up on (see the module docs): with a receipt, removes
/// the lease and refunds the request and its tokens; always leaves a tombstone, so a later
/// admit for this member writes nothing and a repeated cancel does nothing.
/// KEYS: rpm, tpm, leases, receipt. ARGV: rpm limit, tpm limit, tokens, lease member, ttl ms.
/// Returns 2 = an admission was undone, 1 = none had run (tombstoned), 0 = already cancelled.
const CANCEL_LUA: &str = concat!(
    r"
local receipt = redis.call('GET', KEYS[4])
if receipt == '0' then return 0 end
redis.call('SET', KEYS[4], '0', 'PX', tonumber(ARGV[5]))
if not receipt then return 1 end
",
    refund_with_server_time!(),
    r"redis.call('ZREM', KEYS[3], ARGV[4])
refund(KEYS[1], tonumber(ARGV[1]), 1)
refund(KEYS[2], tonumber(ARGV[2]), tonumber(ARGV[3]))
return 2
"
);

/// How many times a cancel is sent before giving up (each attempt is idempotent).
const CANCEL_ATTEMPTS: u32 = 5;
/// Most cancels in flight at once. A stalled store fails every admission, and each failure's
/// cancel lives for its retries (seconds): past this many, further cancels are not sent (their
/// leases and charges lapse on their own, as a cancel that never gets through would), so a
/// long stall under load cannot pile up tasks without bound.
const MAX_CANCELS_IN_FLIGHT: usize = if cfg!(test) { 4 } else { 1024 };
/// The least time one cancel attempt waits for its answer: longer than an admission may wait,
/// since nobody waits on it and a slow store is why it is sent.
const CANCEL_TIMEOUT_FLOOR: Duration = Duration::from_secs(1);

/// Gives unused cells back: moves each TAT back by refund × interval, never before now.
/// KEYS: rpm, tpm. ARGV: rpm limit, requests refunded, tpm limit, tokens refunded.
const REFUND_LUA: &str = concat!(
    "\n",
    refund_with_server_time!(),
    r"refund(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))
refund(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[4]))
return 0
"
);

/// Extends a live lease (never re-creates one that was pruned or released).
/// KEYS: leases. ARGV: member, ttl ms.
const RENEW_LUA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local ttl = tonumber(ARGV[2])
local renewed = redis.call('ZADD', KEYS[1], 'XX', 'CH', now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return renewed
";

/// The outcome of [`SharedLimiter::acquire`].
#[derive(Debug)]
pub enum SharedDecision {
    Admitted(SharedCharge),
    Refused(RateLimitError),
    /// The store failed or did not answer within the timeout: `on_store_error` decides.
    StoreError(String),
}

/// A connection to the shared store plus its scripts. Cheap to clone.
#[derive(Clone)]
pub struct SharedLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    policy: SharedPolicy,
    connection: ConnectionManager,
    admit: Script,
    refund: Script,
    renew: Script,
    cancel: Script,
    /// Names this gateway process in lease members, so two replicas' request ids never clash.
    replica: String,
    next_lease: AtomicU64,
    lease_ttl: Duration,
    last_logged: Mutex<Option<Instant>>,
    /// The same throttle for cancels that never got through (a dead store fails them all).
    last_cancel_logged: Mutex<Option<Instant>>,
    /// Cancel tasks running now (at most [`MAX_CANCELS_IN_FLIGHT`]).
    cancels_in_flight: AtomicUsize,
}

impl std::fmt::Debug for SharedLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLimiter")
            .field("policy", &self.inner.policy)
            .field("replica", &self.inner.replica)
            .finish()
    }
}

impl SharedLimiter {
    /// A limiter for `policy`. Does not dial: the connection manager connects on first use and
    /// reconnects in the background, so a store that is down now is `on_store_error`'s case.
    /// Must be called inside a tokio runtime.
    pub fn new(policy: &SharedPolicy) -> Result<SharedLimiter, String> {
        SharedLimiter::with_lease_ttl(policy, LEASE_TTL)
    }

    /// [`SharedLimiter::new`] with a shorter lease (tests of crashed replicas).
    pub fn with_lease_ttl(
        policy: &SharedPolicy,
        lease_ttl: Duration,
    ) -> Result<SharedLimiter, String> {
        let client = redis::Client::open(policy.redis_url.as_str()).map_err(|e| e.to_string())?;
        // The manager's own timeouts match the policy's, so a dead store fails each call fast
        // instead of queueing calls behind a hung connection.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(policy.timeout))
            .set_response_timeout(Some(policy.timeout))
            .set_max_delay(Duration::from_secs(1));
        let connection =
            ConnectionManager::new_lazy_with_config(client, config).map_err(|e| e.to_string())?;
        Ok(SharedLimiter {
            inner: Arc::new(Inner {
                policy: policy.clone(),
                connection,
                admit: Script::new(ADMIT_LUA),
                refund: Script::new(REFUND_LUA),
                renew: Script::new(RENEW_LUA),
                cancel: Script::new(CANCEL_LUA),
                replica: format!("{:016x}", rand::random::<u64>()),
                next_lease: AtomicU64::new(0),
                lease_ttl,
                last_logged: Mutex::new(None),
                last_cancel_logged: Mutex::new(None),
                cancels_in_flight: AtomicUsize::new(0),
            }),
        })
    }

    /// The `[shared]` policy this limiter was built for.
    pub fn policy(&self) -> &SharedPolicy {
        &self.inner.policy
    }

    /// Charges one request and `tokens` tokens to `tenant` and takes a concurrency lease, all
    /// or nothing, within the policy's timeout.
    pub async fn acquire(
        &self,
        tenant: &TenantPolicy,
        request_id: &str,
        tokens: u32,
    ) -> SharedDecision {
        let rpm = tenant.requests_per_minute.map_or(0, |n| n.get());
        let tpm = tenant.tokens_per_minute.map_or(0, |n| n.get());
        if tpm > 0 && tokens > tpm {
            let headers = self.headers_full(rpm, tpm);
            return SharedDecision::Refused(RateLimitError::ExceedsBucket {
                kind: LimitKind::Tokens,
                limit: tpm,
                requested: tokens,
                headers,
            });
        }
        let leases = u32::try_from(tenant.max_concurrency).unwrap_or(u32::MAX);
        let lease_number = self.inner.next_lease.fetch_add(1, Ordering::Relaxed);
        let member = format!("{}:{lease_number}:{request_id}", self.inner.replica);
        let keys = Keys::of(&tenant.name);
        let mut invocation = self.inner.admit.prepare_invoke();
        invocation
            .key(&keys.rpm)
            .key(&keys.tpm)
            .key(&keys.leases)
            .key(keys.receipt(&member))
            .arg(rpm)
            .arg(tpm)
            .arg(tokens)
            .arg(leases)
            .arg(&member)
            .arg(self.inner.lease_ttl.as_millis() as u64);
        // Sent again if the connection had died (safe: if the first send did run, the receipt
        // makes the second answer 4, which is cancelled below).
        let answer = send_within(
            self.inner.policy.timeout,
            &self.inner.connection,
            |mut c| {
                let invocation = &invocation;
                async move { invocation.invoke_async::<Vec<i64>>(&mut c).await }
            },
        )
        .await;
        // Without an answer the script may still have run, or may run later (a stalled store
        // keeps it queued): whatever it did is cancelled, so no lease or charge is left behind.
        let answer = match answer {
            Ok(Ok(reply)) if reply.len() == 6 && reply[0] != 4 => Ok(reply),
            Ok(Ok(reply)) => Err(format!("unexpected reply {reply:?}")),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err(format!("no answer within {:?}", self.inner.policy.timeout)),
        };
        let reply = match answer {
            Ok(reply) => reply,
            Err(error) => {
                self.spawn_cancel(&tenant.name, keys, member, [rpm, tpm, tokens]);
                return SharedDecision::StoreError(error);
            }
        };
        let millis = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
        let status = |limit: u32, remaining: i64, reset: i64| BucketStatus {
            limit,
            remaining: u32::try_from(remaining).unwrap_or(0).min(limit),
            reset: millis(reset),
        };
        let headers = RateLimitHeaders {
            requests: (rpm > 0).then(|| status(rpm, reply[2], reply[3])),
            tokens: (tpm > 0).then(|| status(tpm, reply[4], reply[5])),
        };
        let (kind, limit, requested, wait) = match reply[0] {
            0 => {
                let renewer =
                    (leases > 0).then(|| self.spawn_renewer(keys.leases.clone(), member.clone()));
                return SharedDecision::Admitted(SharedCharge {
                    limiter: self.clone(),
                    receipt: keys.receipt(&member),
                    keys,
                    rpm,
                    tpm,
                    tokens,
                    refund: Refund::All,
                    lease: (leases > 0).then_some(member),
                    renewer,
                    headers,
                });
            }
            1 => (LimitKind::Requests, rpm, 1, millis(reply[1])),
            2 => (LimitKind::Tokens, tpm, tokens, millis(reply[1])),
            _ => (LimitKind::Concurrency, leases, 1, CONCURRENCY_RETRY_AFTER),
        };
        SharedDecision::Refused(RateLimitError::Limited {
            kind,
            limit,
            requested,
            wait,
            headers,
        })
    }

    /// Counts a failed store call for `tenant` under the `on_store_error` behaviour applied and
    /// logs it, at most once per [`LOG_EVERY`] so a dead store cannot flood the log.
    pub fn record_store_error(&self, tenant: &str, behaviour: &'static str, error: &str) {
        crate::metrics::record_shared_store_error(tenant, behaviour);
        let now = Instant::now();
        let mut last = self.inner.last_logged.lock();
        if last.is_none_or(|at| now.duration_since(at) >= LOG_EVERY) {
            *last = Some(now);
            tracing::warn!(
                store = %self.inner.policy.redis_url,
                tenant,
                on_store_error = behaviour,
                error,
                "shared rate-limit store failed; applying on_store_error (logged at most every 10s)"
            );
        }
    }

    fn headers_full(&self, rpm: u32, tpm: u32) -> RateLimitHeaders {
        let full = |limit: u32| BucketStatus {
            limit,
            remaining: limit,
            reset: Duration::ZERO,
        };
        RateLimitHeaders {
            requests: (rpm > 0).then(|| full(rpm)),
            tokens: (tpm > 0).then(|| full(tpm)),
        }
    }

    /// Sends [`CANCEL_LUA`] for an admission whose answer never came, in the background, until
    /// Redis answers it or [`CANCEL_ATTEMPTS`] fail; each outcome is counted in
    /// `kvgate_shared_compensations_total{tenant,outcome}`. Queued on the same connection
    /// right after the admit, it normally runs right after it; if not, the tombstone makes the
    /// order irrelevant. A cancel that never gets through leaves at worst what the admit
    /// wrote, which the lease ttl and the GCRA window clear on their own (logged).
    fn spawn_cancel(&self, tenant: &str, keys: Keys, member: String, [rpm, tpm, tokens]: [u32; 3]) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(slot) = CancelSlot::take(&self.inner) else {
            crate::metrics::record_shared_compensation(tenant, "dropped");
            self.log_cancel_failure(tenant, &member, "too many cancels in flight");
            return;
        };
        let limiter = self.clone();
        let tenant = tenant.to_owned();
        runtime.spawn(async move {
            let _slot = slot;
            let ttl = limiter.inner.lease_ttl.as_millis() as u64;
            let timeout = limiter.inner.policy.timeout.max(CANCEL_TIMEOUT_FLOOR);
            let receipt = keys.receipt(&member);
            let mut last_error = String::new();
            for attempt in 0..CANCEL_ATTEMPTS {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(100) * 2u32.pow(attempt)).await;
                }
                let mut connection = limiter.inner.connection.clone();
                let mut invocation = limiter.inner.cancel.prepare_invoke();
                invocation
                    .key(&keys.rpm)
                    .key(&keys.tpm)
                    .key(&keys.leases)
                    .key(&receipt)
                    .arg(rpm)
                    .arg(tpm)
                    .arg(tokens)
                    .arg(&member)
                    .arg(ttl);
                let call = invocation.invoke_async::<i64>(&mut connection);
                match tokio::time::timeout(timeout, call).await {
                    Ok(Ok(done)) => {
                        let outcome = match done {
                            2 => "undone",
                            1 => "not_run",
                            _ => "already_cancelled",
                        };
                        crate::metrics::record_shared_compensation(&tenant, outcome);
                        tracing::debug!(
                            tenant,
                            member,
                            outcome,
                            "cancelled a shared admission whose answer never came"
                        );
                        return;
                    }
                    Ok(Err(error)) => last_error = error.to_string(),
                    Err(_) => last_error = format!("no answer within {timeout:?}"),
                }
            }
            crate::metrics::record_shared_compensation(&tenant, "failed");
            limiter.log_cancel_failure(&tenant, &member, &last_error);
        });
    }

    /// Cancels running now (tests).
    pub fn cancels_in_flight(&self) -> usize {
        self.inner.cancels_in_flight.load(Ordering::Relaxed)
    }

    /// Logs a cancel that was not sent or never got through, at most once per [`LOG_EVERY`].
    fn log_cancel_failure(&self, tenant: &str, member: &str, error: &str) {
        let now = Instant::now();
        {
            let mut last = self.inner.last_cancel_logged.lock();
            if last.is_some_and(|at| now.duration_since(at) < LOG_EVERY) {
                return;
            }
            *last = Some(now);
        }
        tracing::warn!(
            store = %self.inner.policy.redis_url,
            tenant,
            member,
            error,
            "could not cancel a timed-out shared admission; its lease and charge (if it \
             ran) lapse on their own within the lease ttl and the rate window (logged at \
             most every 10s)"
        );
    }

    /// Renews the lease every third of its ttl until aborted (by the charge's drop). A failed
    /// renewal is retried at the next tick; the lease only lapses if three in a row fail.
    fn spawn_renewer(&self, leases: String, member: String) -> JoinHandle<()> {
        let limiter = self.clone();
        tokio::spawn(async move {
            let ttl = limiter.inner.lease_ttl;
            let mut tick = tokio::time::interval_at(Instant::now() + ttl / 3, ttl / 3);
            loop {
                tick.tick().await;
                let mut connection = limiter.inner.connection.clone();
                let mut invocation = limiter.inner.renew.prepare_invoke();
                invocation
                    .key(&leases)
                    .arg(&member)
                    .arg(ttl.as_millis() as u64);
                let call = invocation.invoke_async::<i64>(&mut connection);
                if let Ok(Err(error)) =
                    tokio::time::timeout(limiter.inner.policy.timeout, call).await
                {
                    tracing::debug!(%error, "renewing a shared concurrency lease failed");
                }
            }
        })
    }
}

/// One tenant's keys; the `{tenant}` hash tag keeps them on one Redis Cluster shard.
#[derive(Debug, Clone)]
struct Keys {
    rpm: String,
    tpm: String,
    leases: String,
}

impl Keys {
    fn of(tenant: &str) -> Keys {
        Keys {
            rpm: format!("kvgate:{{{tenant}}}:rpm"),
            tpm: format!("kvgate:{{{tenant}}}:tpm"),
            leases: format!("kvgate:{{{tenant}}}:leases"),
        }
    }

    /// The admission receipt (or cancel tombstone) of one lease member: the tenant's prefix
    /// (same hash tag) plus the member.
    fn receipt(&self, member: &str) -> String {
        let prefix = self.leases.strip_suffix("leases").unwrap_or(&self.leases);
        format!("{prefix}admit:{member}")
    }
}

/// What a charge gives back when it ends.
#[derive(Debug, Clone, Copy)]
enum Refund {
    /// The request never ran: its request cell and all its tokens.
    All,
    /// It ran and used this many tokens: the rest of the up-front charge.
    UnusedOf(u32),
}

/// One admitted request's share of the shared limits: its up-front token charge and its
/// concurrency lease. Dropping it releases the lease and refunds what was not used (everything
/// unless [`SharedCharge::settle`] said otherwise), in a background task: a drop cannot wait.
pub struct SharedCharge {
    limiter: SharedLimiter,
    keys: Keys,
    rpm: u32,
    tpm: u32,
    tokens: u32,
    refund: Refund,
    lease: Option<String>,
    /// This admission's receipt key, deleted with the release.
    receipt: String,
    renewer: Option<JoinHandle<()>>,
    headers: RateLimitHeaders,
}

impl std::fmt::Debug for SharedCharge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCharge")
            .field("tenant_keys", &self.keys)
            .field("tokens", &self.tokens)
            .field("lease", &self.lease)
            .finish()
    }
}

impl SharedCharge {
    /// The response used `used_tokens`: the rest of the up-front charge is refunded on drop.
    pub fn settle(&mut self, used_tokens: u32) {
        self.refund = Refund::UnusedOf(used_tokens);
    }

    /// The tenant's shared state right after this request's charge.
    pub fn headers(&self) -> RateLimitHeaders {
        self.headers.clone()
    }
}

impl Drop for SharedCharge {
    fn drop(&mut self) {
        if let Some(renewer) = self.renewer.take() {
            renewer.abort();
        }
        let (requests, tokens) = match self.refund {
            Refund::All => (1, self.tokens),
            Refund::UnusedOf(used) => (0, self.tokens.saturating_sub(used)),
        };
        let lease = self.lease.take();
        let receipt = std::mem::take(&mut self.receipt);
        // Outside a runtime (a test's teardown) the lease expires on its own and the refund is
        // lost, which only ever errs on the strict side.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let limiter = self.limiter.clone();
        let keys = self.keys.clone();
        let (rpm, tpm) = (self.rpm, self.tpm);
        runtime.spawn(async move {
            let timeout = limiter.inner.policy.timeout;
            // The receipt is only needed while the admission could still be cancelled, which
            // an admission that got its answer never is: delete it so receipts cost memory only
            // while their requests live.
            let mut release = redis::pipe();
            release.cmd("DEL").arg(&receipt).ignore();
            if let Some(lease) = &lease {
                release.cmd("ZREM").arg(&keys.leases).arg(lease).ignore();
            }
            let released = send_within(timeout, &limiter.inner.connection, |mut c| {
                let release = &release;
                async move { release.query_async::<()>(&mut c).await }
            });
            if let Ok(Err(error)) = released.await {
                tracing::debug!(%error, "releasing a shared concurrency lease failed; it expires on its own");
            }
            if requests > 0 || tokens > 0 {
                let mut invocation = limiter.inner.refund.prepare_invoke();
                invocation
                    .key(&keys.rpm)
                    .key(&keys.tpm)
                    .arg(rpm)
                    .arg(requests)
                    .arg(tpm)
                    .arg(tokens);
                // Not sent again: a refund is not idempotent (a dropped connection may have
                // run it), and a lost one only errs on the strict side.
                let mut connection = limiter.inner.connection.clone();
                let refund = invocation.invoke_async::<i64>(&mut connection);
                if let Ok(Err(error)) = tokio::time::timeout(timeout, refund).await {
                    tracing::debug!(%error, "refunding a shared rate-limit charge failed");
                }
            }
        });
    }
}

/// One of the [`MAX_CANCELS_IN_FLIGHT`] places; given back on drop.
struct CancelSlot(Arc<Inner>);

impl CancelSlot {
    fn take(inner: &Arc<Inner>) -> Option<CancelSlot> {
        let taken =
            inner
                .cancels_in_flight
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < MAX_CANCELS_IN_FLIGHT).then_some(n + 1)
                });
        taken.is_ok().then(|| CancelSlot(Arc::clone(inner)))
    }
}

impl Drop for CancelSlot {
    fn drop(&mut self) {
        self.0.cancels_in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs the call `send` makes, within `timeout` in all. A connection that died since the last
/// call (a Redis restart, an idle timeout, a failover) fails the next call at once, before
/// anything reached Redis in the usual case: that call is sent once more, on the fresh
/// connection the manager makes, within the same deadline, instead of counting as a store
/// error. Only for calls that are safe to repeat.
async fn send_within<T, F>(
    timeout: Duration,
    connection: &ConnectionManager,
    send: impl Fn(ConnectionManager) -> F,
) -> Result<redis::RedisResult<T>, tokio::time::error::Elapsed>
where
    F: std::future::Future<Output = redis::RedisResult<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let first = tokio::time::timeout_at(deadline, send(connection.clone())).await;
    match first {
        Ok(Err(error)) if error.is_connection_dropped() => {
            tracing::debug!(%error, "shared store connection dropped; sending again");
            tokio::time::timeout_at(deadline, send(connection.clone())).await
        }
        answer => answer,
    }
}

/// The admit/cancel pair against a real `redis-server` (skipped when it is not installed,
/// unless `KVGATE_REQUIRE_REDIS=1`), in both orders. The stalled-store path through
/// [`SharedLimiter::acquire`] is in `gateway/tests/shared_limits.rs`.
#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::*;

    struct Server(std::process::Child, u16);

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn server() -> Option<Server> {
        if Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_err()
        {
            assert!(std::env::var("KVGATE_REQUIRE_REDIS").as_deref() != Ok("1"));
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = Server(child, port);
        for _ in 0..250 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(server);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server did not start");
    }

    /// rpm 6, tpm 1000, 500 tokens, 1 lease, member "m".
    async fn admit(connection: &mut redis::aio::MultiplexedConnection, keys: &Keys) -> i64 {
        let reply: Vec<i64> = Script::new(ADMIT_LUA)
            .key(&keys.rpm)
            .key(&keys.tpm)
            .key(&keys.leases)
            .key(keys.receipt("m"))
            .arg(6)
            .arg(1000)
            .arg(500)
            .arg(1)
            .arg("m")
            .arg(30_000)
            .invoke_async(connection)
            .await
            .unwrap();
        reply[0]
    }

    async fn cancel(connection: &mut redis::aio::MultiplexedConnection, keys: &Keys) -> i64 {
        Script::new(CANCEL_LUA)
            .key(&keys.rpm)
            .key(&keys.tpm)
            .key(&keys.leases)
            .key(keys.receipt("m"))
            .arg(6)
            .arg(1000)
            .arg(500)
            .arg("m")
            .arg(30_000)
            .invoke_async(connection)
            .await
            .unwrap()
    }

    /// No lease and no rate charge left for the tenant.
    async fn clean(connection: &mut redis::aio::MultiplexedConnection, keys: &Keys) -> bool {
        let leases: i64 = redis::cmd("ZCARD")
            .arg(&keys.leases)
            .query_async(connection)
            .await
            .unwrap();
        let charged: i64 = redis::cmd("EXISTS")
            .arg(&keys.rpm)
            .arg(&keys.tpm)
            .query_async(connection)
            .await
            .unwrap();
        leases == 0 && charged == 0
    }

    #[tokio::test]
    async fn a_cancel_undoes_an_admit_before_it_and_bars_one_after_it() {
        let Some(server) = server() else {
            return;
        };
        let client = redis::Client::open(format!("redis://127.0.0.1:{}/0", server.1)).unwrap();
        let mut connection = client.get_multiplexed_async_connection().await.unwrap();

        // Admit, then cancel (the usual order): undone once, a retry is a no-op.
        let keys = Keys::of("ordered");
        assert_eq!(admit(&mut connection, &keys).await, 0);
        assert!(!clean(&mut connection, &keys).await);
        assert_eq!(cancel(&mut connection, &keys).await, 2);
        assert!(clean(&mut connection, &keys).await);
        assert_eq!(cancel(&mut connection, &keys).await, 0);
        assert!(clean(&mut connection, &keys).await);

        // Cancel, then admit (reordered by a reconnect): the admit writes nothing.
        let keys = Keys::of("reordered");
        assert_eq!(cancel(&mut connection, &keys).await, 1);
        assert_eq!(admit(&mut connection, &keys).await, 4);
        assert!(clean(&mut connection, &keys).await);
    }

    fn shared_policy(port: u16) -> SharedPolicy {
        SharedPolicy {
            redis_url: format!("redis://127.0.0.1:{port}/0"),
            timeout: Duration::from_millis(50),
            on_store_error: crate::policy::OnStoreError::Deny,
            replicas: 1,
        }
    }

    fn limited_tenant() -> TenantPolicy {
        let policy = crate::policy::parse_policy(
            "t.toml",
            "[tenants.t]\nrequests_per_minute = 10\nmax_concurrency = 2\n",
        )
        .unwrap();
        TenantPolicy::clone(&policy.tenant("t").unwrap())
    }

    #[tokio::test]
    async fn a_stalled_store_holds_at_most_the_bounded_number_of_cancels() {
        // Accepts connections (the kernel's backlog) and never answers: every call times out,
        // and each cancel waits out its retries.
        let blackhole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = blackhole.local_addr().unwrap().port();
        let limiter = SharedLimiter::new(&shared_policy(port)).unwrap();
        for n in 0..MAX_CANCELS_IN_FLIGHT + 3 {
            let decision = limiter
                .acquire(&limited_tenant(), &format!("r{n}"), 10)
                .await;
            assert!(matches!(decision, SharedDecision::StoreError(_)));
        }
        assert_eq!(limiter.cancels_in_flight(), MAX_CANCELS_IN_FLIGHT);
        drop(blackhole);
    }
}

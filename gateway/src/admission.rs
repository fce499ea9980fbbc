//! Admission: the one gate between a validated request and the engine.
//!
//! In order, cheapest first: a request that can never fit the KV pool is refused at once
//! (400); the tenant's request and token rate limits are debited (429 with governor's exact
//! wait); then the request joins the dispatcher's fair queue. One dispatcher state owns the
//! queue, behind one lock (so no check-then-act races), and starts a request only when its
//! tenant and lane have a free concurrency slot *and* the block pool atomically reserves its KV
//! blocks under the high watermark. The caller runs a dispatcher step itself right after
//! queueing, so a request that can start now is admitted on its own task; a queued one is
//! started by a later step (another caller's, or the upkeep task's when capacity comes back).
//! The caller gets an [`Admitted`] guard (not Clone) that owns the slot, the rate-limit debit
//! and the [`Reservation`]; dropping it gives all three back exactly once.
//!
//! [`Admission::admit`] is cancel-safe: if the client goes away and the future is dropped, the
//! queued entry is removed (and nothing it did not get is released).
//!
//! Admission may gate several block pools ([`Admission::with_pools`]): the embedded engine's
//! KV pool ([`PoolId::LOCAL`]) and one pool per upstream engine, sized from the capacity the
//! upstream declares (see `upstream.rs`). Each ticket names its pool. Rate limits, tenant
//! concurrency and the fair queue are shared by all pools; KV reservations, the watermark, the
//! long lane's cap and the drain-rate estimate are per pool, so a saturated upstream never
//! holds back requests for the embedded engine (or the other way round). An upstream pool's
//! usable part follows its healthy replicas ([`PoolLimit`]): while replicas are ejected their
//! share is withdrawn, so requests wait in the fair queue instead of failing, and start when
//! the capacity comes back.

mod capacity;
mod dispatcher;
mod ledger;
mod rejection;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::HeaderMap;
use kvgate_runtime::block_pool::{BlockPool, Occupancy, Reservation};
use kvgate_runtime::engine::{EngineStats, StepCost};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

pub use crate::metrics::TenantQueueSnapshot;
pub use capacity::PoolLimit;
pub use rejection::{MAX_RETRY_AFTER, MIN_CAPACITY_RETRY_AFTER, NeverFitsLimit, Rejection};

use crate::auth::{Credential, authenticate};
use crate::metrics::QueueSource;
use crate::policy::{KvPolicy, OnStoreError, Policy, ReservationMode, TenantPolicy};
use crate::queue::Lane;
use crate::ratelimit::{
    Debit, RateLimitError, RateLimitHeaders, RateLimits, RequestCell, SharedDecision, SharedLimiter,
};
use crate::reload::PolicyStore;
#[cfg(test)]
use dispatcher::REFORECAST_EVERY;
use dispatcher::{Core, Dispatcher, Pending};
use ledger::{Footprint, Ledger, SlotUse};

/// Which block pool a request reserves its capacity from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub(crate) usize);

impl PoolId {
    /// The embedded engine's KV pool.
    pub const LOCAL: PoolId = PoolId(0);
}

/// The admission handle that handlers use. Cheap to clone.
#[derive(Clone)]
pub struct Admission {
    core: Arc<Core>,
    /// Closed when the last handle drops, which ends the dispatcher's upkeep task.
    _alive: mpsc::Sender<std::convert::Infallible>,
    store: PolicyStore,
    /// Indexed by [`PoolId`]; the first is [`PoolId::LOCAL`]. Grows when a reload adds an
    /// upstream model ([`Admission::add_pool`]); ids are never reused.
    pools: Arc<parking_lot::RwLock<Arc<[Arc<BlockPool>]>>>,
    limits: Arc<RateLimits>,
    /// The shared-store limiter for the policy's `[shared]` section, rebuilt when a reload
    /// changes that section (`None` while the policy has none).
    shared: Arc<parking_lot::Mutex<Option<SharedLimiter>>>,
    ledger: Arc<Ledger>,
    next_key: Arc<AtomicU64>,
}

/// What admission needs to know about a validated request.
#[derive(Debug, Clone)]
pub struct AdmissionTicket {
    pub tenant: Arc<TenantPolicy>,
    /// What authenticated the request: a policy reload while it is queued checks that it still
    /// maps to `tenant` (a removed or moved key is refused with 401).
    pub credential: Credential,
    pub prompt_tokens: usize,
    pub max_output_tokens: usize,
    /// The request field holding the prompt (`messages` or `prompt`, see
    /// [`crate::validate::Endpoint::prompt_param`]): what a length refusal names as `param`.
    pub prompt_param: &'static str,
    pub request_id: String,
    /// The pool to reserve from ([`PoolId::LOCAL`] for the embedded engine).
    pub pool: PoolId,
    /// The prompt and cache salt, when its pool caches prefixes (the embedded engine's, for a
    /// tenant whose `prefix_cache` is not "off"): admission then pins the cached part of the
    /// prompt with the reservation and reserves only the blocks the request adds.
    pub prefix: Option<PromptPrefix>,
}

/// What admission needs to find a request's cached prefix in its pool.
#[derive(Debug, Clone)]
pub struct PromptPrefix {
    /// The salt the engine registers the request's blocks under (from the tenant, never the
    /// request).
    pub salt: Arc<str>,
    pub prompt_ids: Arc<[u32]>,
}

impl Admission {
    /// Admission over the embedded engine's pool alone. Starts the dispatcher task; must be
    /// called inside a tokio runtime.
    pub fn new(store: PolicyStore, pool: Arc<BlockPool>) -> Admission {
        Admission::with_pools(store, pool, Vec::new())
    }

    /// Admission over the embedded engine's pool (`local`, always whole) and `others` (one
    /// per upstream, each with the limit its owner moves); [`Admission::pool_id`] says which
    /// id each got. Starts the dispatcher task; must be called inside a tokio runtime.
    pub fn with_pools(
        store: PolicyStore,
        local: Arc<BlockPool>,
        others: Vec<Arc<PoolLimit>>,
    ) -> Admission {
        let usable: Arc<[Arc<PoolLimit>]> = std::iter::once(PoolLimit::new(local))
            .chain(others)
            .collect();
        let pools: Arc<[Arc<BlockPool>]> = usable
            .iter()
            .map(|limit| Arc::clone(limit.pool()))
            .collect();
        let limits = Arc::new(RateLimits::new());
        let ledger = Arc::new(Ledger::default());
        let dispatcher = Dispatcher::new(
            store.clone(),
            usable,
            Arc::clone(&limits),
            Arc::clone(&ledger),
        );
        let core = Arc::new(Core {
            dispatcher: parking_lot::Mutex::new(dispatcher),
            changed: tokio::sync::Notify::new(),
            #[cfg(test)]
            queue_only: std::sync::atomic::AtomicBool::new(false),
        });
        let (alive, closed) = mpsc::channel(1);
        tokio::spawn(dispatcher::run(Arc::clone(&core), closed));
        Admission {
            core,
            _alive: alive,
            store,
            pools: Arc::new(parking_lot::RwLock::new(pools)),
            limits,
            shared: Arc::default(),
            ledger,
            next_key: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The id of `pool` if admission gates it (the same `Arc`), else `None`.
    pub fn pool_id(&self, pool: &Arc<BlockPool>) -> Option<PoolId> {
        self.pools
            .read()
            .iter()
            .position(|known| Arc::ptr_eq(known, pool))
            .map(PoolId)
    }

    /// Gates `limit`'s pool from now on, with the same rules as the pools given at start
    /// (an upstream model added by an upstreams-file reload); returns its id. A pool is never
    /// removed: a model taken out of service keeps its id (queued and running requests of it
    /// finish), and one brought back reuses it.
    pub fn add_pool(&self, limit: Arc<PoolLimit>) -> PoolId {
        let mut dispatcher = self.core.dispatcher.lock();
        if let Some(known) = self.pool_id(limit.pool()) {
            return known;
        }
        let id = dispatcher.add_pool(limit);
        // Under the dispatcher's lock, so ids and the two lists stay in the same order.
        *self.pools.write() = Arc::clone(dispatcher.pools());
        drop(dispatcher);
        // The upkeep task must watch the new pool's freed blocks too.
        self.core.changed.notify_one();
        id
    }

    /// Shutdown's grace period is over: every queued request is answered 503 `Unavailable`
    /// (with Retry-After) now, and any request that reaches admission later gets the same at
    /// once; nothing starts any more. Running requests keep their guards.
    pub fn close(&self) {
        self.core.dispatcher.lock().close();
        self.core.changed.notify_one();
    }

    /// Waits until the request may start, or says why it may not.
    pub async fn admit(&self, ticket: AdmissionTicket) -> Result<Admitted, Rejection> {
        self.admit_prepaid(ticket, None).await
    }

    /// [`Admission::admit`] for a request whose request cell was taken before its body
    /// ([`Admission::reserve_request`]): only its tokens are debited here.
    pub async fn admit_prepaid(
        &self,
        ticket: AdmissionTicket,
        prepaid: Option<RequestCell>,
    ) -> Result<Admitted, Rejection> {
        let policy = self.store.current();
        let tenant = Arc::clone(&ticket.tenant);
        let pool = self.pools.read().get(ticket.pool.0).cloned();
        let Some(pool) = pool else {
            // Tickets only name pools that `pool_id` returned: this is a wiring bug.
            crate::request_log::in_request_span(|| {
                tracing::error!(
                    pool = ticket.pool.0,
                    "admission ticket names an unknown pool"
                )
            });
            return Err(Rejection::Unavailable);
        };
        let occupancy = pool.snapshot();
        let needed_blocks = match check_fit(&policy.kv, &occupancy, &ticket) {
            Ok(fit) => fit.needed_blocks,
            Err(rejection) => {
                rejection.count(&tenant.name);
                return Err(rejection);
            }
        };

        let budget_tokens = ticket
            .prompt_tokens
            .saturating_add(ticket.max_output_tokens);
        let debit = self
            .debit(&policy, &tenant, &ticket.request_id, budget_tokens, prepaid)
            .await
            .inspect_err(|rejection| rejection.count(&tenant.name))?;

        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let lane = lane_of(&policy, ticket.prompt_tokens);
        let (reply, answer) = oneshot::channel();
        let expected_blocks = expected_new_blocks(&pool, &ticket, needed_blocks);
        let pending = Pending {
            key,
            ticket,
            lane,
            full_blocks: needed_blocks,
            needed_blocks: expected_blocks,
            reserved_tokens: (expected_blocks * occupancy.block_size) as u64,
            debit,
            enqueued_at: Instant::now(),
            reply,
        };
        // Queued and, if it can start now, started, under the dispatcher's lock: no other task
        // has to run for a request that can start at once.
        if self.core.submit(pending) {
            // The upkeep task must look at the queue's new deadlines.
            self.core.changed.notify_one();
        }
        self.answer(key, answer).await
    }

    /// Waits for the dispatcher's answer to the request queued under `key`. If this future is
    /// dropped first (the client left), the entry leaves the queue.
    async fn answer(
        &self,
        key: u64,
        answer: oneshot::Receiver<Result<Admitted, Rejection>>,
    ) -> Result<Admitted, Rejection> {
        let mut cancel = CancelOnDrop {
            key,
            core: Arc::clone(&self.core),
            armed: true,
        };
        let answer = answer.await;
        cancel.armed = false;
        answer.unwrap_or(Err(Rejection::Unavailable))
    }

    /// Charges the request to its tenant's rate limits: the local buckets, or with `[shared]`
    /// the shared store, whose failure `on_store_error` answers (the local buckets at the
    /// limits ÷ replicas, no limit, or a 503), so a dead store never hangs a request.
    async fn debit(
        &self,
        policy: &Policy,
        tenant: &TenantPolicy,
        request_id: &str,
        tokens: usize,
        prepaid: Option<RequestCell>,
    ) -> Result<Debit, Rejection> {
        let local = |tenant: &TenantPolicy, prepaid| {
            self.limits
                .try_debit_prepaid(tenant, tokens, prepaid)
                .map_err(|error| rate_rejection(&tenant.name, error))
        };
        let shared = match self.shared_limiter(policy) {
            Ok(Some(shared)) => shared,
            Ok(None) => return local(tenant, prepaid),
            Err((behaviour, error)) => {
                return self.on_store_error(policy, behaviour, tenant, tokens, None, &error);
            }
        };
        // With a shared store nothing was taken before the body (`reserve_request`).
        drop(prepaid);
        let charged = u32::try_from(tokens).unwrap_or(u32::MAX);
        match shared.acquire(tenant, request_id, charged).await {
            SharedDecision::Admitted(charge) => {
                Ok(self.limits.debit_elsewhere(tenant, Some(charge)))
            }
            SharedDecision::Refused(error) => Err(rate_rejection(&tenant.name, error)),
            SharedDecision::StoreError(error) => {
                let behaviour = shared.policy().on_store_error;
                self.on_store_error(policy, behaviour, tenant, tokens, Some(&shared), &error)
            }
        }
    }

    /// What `on_store_error` makes of a failed shared-store call; logged and counted.
    fn on_store_error(
        &self,
        policy: &Policy,
        behaviour: OnStoreError,
        tenant: &TenantPolicy,
        tokens: usize,
        shared: Option<&SharedLimiter>,
        error: &str,
    ) -> Result<Debit, Rejection> {
        match shared {
            Some(shared) => shared.record_store_error(&tenant.name, behaviour.as_str(), error),
            None => {
                crate::metrics::record_shared_store_error(&tenant.name, behaviour.as_str());
                crate::request_log::in_request_span(
                    || tracing::warn!(tenant = %tenant.name, error, "no shared rate-limit store"),
                );
            }
        }
        match behaviour {
            OnStoreError::Local => {
                let replicas = policy.shared.as_ref().map_or(1, |s| s.replicas);
                let share = local_share(tenant, replicas);
                self.limits
                    .try_debit_prepaid(&share, tokens, None)
                    .map_err(|error| rate_rejection(&tenant.name, error))
            }
            OnStoreError::Allow => Ok(self.limits.debit_elsewhere(tenant, None)),
            OnStoreError::Deny => Err(Rejection::StoreUnavailable {
                tenant: tenant.name.clone(),
            }),
        }
    }

    /// The limiter for `policy.shared`, built on first use and rebuilt when a reload changed
    /// the section. `Err` carries the behaviour to apply when it cannot be built.
    fn shared_limiter(
        &self,
        policy: &Policy,
    ) -> Result<Option<SharedLimiter>, (OnStoreError, String)> {
        let Some(config) = &policy.shared else {
            return Ok(None);
        };
        let mut current = self.shared.lock();
        if let Some(limiter) = current.as_ref()
            && limiter.policy() == config
        {
            return Ok(Some(limiter.clone()));
        }
        let limiter = SharedLimiter::new(config).map_err(|e| (config.on_store_error, e))?;
        *current = Some(limiter.clone());
        Ok(Some(limiter))
    }

    /// Gives admission the engine's per-token service time (see [`engine_service_time`]; a
    /// plain `Duration` is a decode time): the prior its forecasts and Retry-After estimates
    /// use until completions have measured a drain rate.
    pub fn set_service_time_probe<T: Into<ServiceTime>>(
        &self,
        probe: impl Fn() -> Option<T> + Send + Sync + 'static,
    ) {
        self.ledger
            .set_service_time_probe(Arc::new(move || probe().map(Into::into)));
    }

    /// Queue and in-flight state per tenant (last dispatcher step), sorted by tenant.
    pub fn queue_snapshot(&self) -> Vec<TenantQueueSnapshot> {
        self.ledger.snapshot()
    }

    /// Caps every tenant's `max_queue_wait` at `cap`. The server passes a little less than its
    /// request timeout: a request that cannot start in time then gets admission's answer (429
    /// with a forecast, or 503 `queue_timeout`, both with Retry-After) rather than the timeout
    /// layer's bare 504, however long the policy lets tenants queue.
    pub fn cap_queue_wait(&self, cap: Duration) {
        self.ledger.set_queue_wait_cap(cap);
    }

    /// Admits at most `max_requests` requests at once into `pool` (running or waiting in its
    /// engine). For the embedded engine this is its submit queue's bound: an engine that holds
    /// no more requests than its queue can take never answers `QueueFull`, so excess requests
    /// wait in the fair queue (and get its forecasts and 429s) instead of failing with 503.
    pub fn limit_in_flight(&self, pool: PoolId, max_requests: usize) {
        self.ledger.limit_requests(pool, max_requests);
        // Wake the dispatcher: a raised limit may let queued requests start.
        self.ledger.released.notify_one();
    }

    /// The tenant's rate-limit headers, for responses that never reached admission.
    pub fn rate_headers(&self, tenant: &TenantPolicy) -> RateLimitHeaders {
        self.limits.headers(tenant)
    }

    /// The rate-limit state to report on a response to a request with these headers, when no
    /// handler reported one (refused keys, unknown routes, body-limit and timeout errors, the
    /// probes): the live state of the tenant the request's key maps to (the anonymous tenant
    /// when it has no key and the policy names one).
    ///
    /// A request whose key maps to no tenant gets the `[defaults]` limits with nothing spent.
    /// It has touched no bucket, and an unauthenticated caller must not learn any tenant's
    /// live usage; `[defaults]` is what every key gets unless its tenant overrides it, so it
    /// is the one true statement about limits that needs no identity.
    pub fn rate_headers_for_request(&self, request: &HeaderMap) -> RateLimitHeaders {
        let policy = self.store.current();
        match authenticate(&policy, request) {
            Ok(tenant) => self.limits.headers(&tenant),
            Err(_) => {
                let defaults = policy.default_rates();
                RateLimitHeaders::full(defaults.requests_per_minute, defaults.tokens_per_minute)
            }
        }
    }

    /// The policy store admission reads limits from.
    pub fn policy_store(&self) -> &PolicyStore {
        &self.store
    }

    /// Takes one request from `tenant`'s request bucket before its body is read (see
    /// `intake.rs`), or refuses it (429 with governor's wait; counted like admission's own
    /// refusals). Pass the cell to [`Admission::admit_prepaid`]: the request is then not
    /// charged a second time. Dropping it (the body or validation failed, the client left)
    /// returns it, as any request refused before it ran is refunded.
    pub fn reserve_request(&self, tenant: &TenantPolicy) -> Result<RequestCell, Rejection> {
        if self.store.current().shared.is_some() {
            // The shared store decides at admission, in one round trip with the tokens; a
            // local early check here would spend this replica's buckets for nothing.
            return Ok(self.limits.untaken_request(tenant));
        }
        self.limits.reserve_request(tenant).map_err(|error| {
            let rejection = rate_rejection(&tenant.name, error);
            rejection.count(&tenant.name);
            rejection
        })
    }
}

impl QueueSource for Admission {
    /// [`Admission::queue_snapshot`] plus a zero row for every configured tenant without queue
    /// state, so per-tenant gauges read 0 instead of vanishing when a tenant goes idle.
    fn tenant_queues(&self) -> Vec<TenantQueueSnapshot> {
        let mut rows = self.queue_snapshot();
        let policy = self.store.current();
        for tenant in policy.tenants() {
            if !rows.iter().any(|r| r.tenant == tenant.name) {
                rows.push(TenantQueueSnapshot {
                    tenant: tenant.name.clone(),
                    queued_requests: 0,
                    queued_tokens: 0,
                    in_flight: 0,
                });
            }
        }
        rows.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        rows
    }
}

/// Takes the entry out of the queue when an `admit` future is dropped while it may be queued
/// (an entry whose reply channel closed is also skipped by dispatch, should this ever miss).
struct CancelOnDrop {
    key: u64,
    core: Arc<Core>,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.core.dispatcher.lock().withdraw(self.key);
        }
    }
}

/// How fast the engine serves, for forecasts made before completions have measured a drain
/// rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ServiceTime {
    /// A fixed wall time per generated token, all running sequences together.
    PerToken(Duration),
    /// The engine's step cost model ([`EngineStats::step_cost`]): admission prices the decode
    /// steps and prefills of requests like the running ones with it. `Runtime::start` fits it
    /// to the machine before serving and every step refits it, so it answers from the first
    /// request of a burst on, before any real step has been timed.
    Model(StepCost),
}

impl From<Duration> for ServiceTime {
    fn from(per_token: Duration) -> ServiceTime {
        ServiceTime::PerToken(per_token)
    }
}

/// What the engine's stats say about its pace: its step cost model's current fit.
pub fn engine_service_time(stats: &EngineStats) -> Option<ServiceTime> {
    Some(ServiceTime::Model(stats.step_cost))
}

/// How a request fits a pool under the KV policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fit {
    /// Blocks it reserves to start.
    pub needed_blocks: usize,
}

/// Whether a request can ever start in a pool of `occupancy`'s size under `kv`: its
/// reservation must fit under the watermark and, in `prompt` mode (where the reservation is
/// smaller than the sequence), the whole sequence must fit the pool or it could never finish.
/// Checked at `admit` and again for queued requests when a reload changes the KV policy.
pub(crate) fn check_fit(
    kv: &KvPolicy,
    occupancy: &Occupancy,
    ticket: &AdmissionTicket,
) -> Result<Fit, Rejection> {
    let (prompt_tokens, max_output_tokens) = (ticket.prompt_tokens, ticket.max_output_tokens);
    let needed_blocks = blocks_needed(kv, occupancy.block_size, prompt_tokens, max_output_tokens);
    let limit_blocks = watermark_limit(occupancy.total_blocks, kv.high_watermark);
    let sequence_blocks = prompt_tokens
        .saturating_add(max_output_tokens)
        .div_ceil(occupancy.block_size.max(1));
    // Name the limit actually exceeded: in `prompt` mode the reservation may fit under the
    // watermark while the whole sequence is over the pool itself.
    let exceeded = if needed_blocks > limit_blocks {
        Some((needed_blocks, NeverFitsLimit::Watermark))
    } else if sequence_blocks > occupancy.total_blocks {
        Some((sequence_blocks, NeverFitsLimit::Pool))
    } else {
        None
    };
    if let Some((needed_blocks, limit)) = exceeded {
        return Err(Rejection::NeverFits {
            needed_blocks,
            total_blocks: occupancy.total_blocks,
            limit_blocks,
            limit,
            param: ticket.prompt_param,
        });
    }
    Ok(Fit { needed_blocks })
}

/// The lane a prompt of this length queues in.
/// Of the `full_blocks` a request holds, how many it is expected to add to `pool`: those past
/// its prefix cached right now. An estimate for forecasts and backlogs (nothing is pinned, the
/// cache may change before the request is dispatched); the dispatcher's reservation pins the
/// prefix and settles the real number.
fn expected_new_blocks(pool: &BlockPool, ticket: &AdmissionTicket, full_blocks: usize) -> usize {
    let Some(prefix) = &ticket.prefix else {
        return full_blocks;
    };
    let max = pool.cacheable_prefix_blocks(prefix.prompt_ids.len());
    let cached = pool.cached_prefix_blocks(&prefix.salt, &prefix.prompt_ids, max);
    full_blocks.saturating_sub(cached)
}

pub(crate) fn lane_of(policy: &Policy, prompt_tokens: usize) -> Lane {
    if prompt_tokens >= policy.lanes.long_prompt_tokens {
        Lane::Long
    } else {
        Lane::Short
    }
}

/// KV blocks a request reserves before it starts.
fn blocks_needed(
    kv: &KvPolicy,
    block_size: usize,
    prompt_tokens: usize,
    max_output_tokens: usize,
) -> usize {
    let block_size = block_size.max(1);
    match kv.reservation {
        ReservationMode::Full => prompt_tokens
            .saturating_add(max_output_tokens)
            .div_ceil(block_size),
        ReservationMode::Prompt => prompt_tokens
            .div_ceil(block_size)
            .saturating_add(kv.prompt_headroom_blocks),
    }
}

/// Most blocks admission may have committed: ⌊total × watermark⌋.
fn watermark_limit(total_blocks: usize, high_watermark: f64) -> usize {
    ((total_blocks as f64) * high_watermark).floor() as usize
}

/// This replica's share of `tenant`'s rate limits when the shared store is down and the policy
/// says `on_store_error = "local"`: each limit ÷ `replicas`, at least 1.
fn local_share(tenant: &TenantPolicy, replicas: u32) -> TenantPolicy {
    let share = |limit: Option<std::num::NonZeroU32>| {
        limit.map(|l| {
            std::num::NonZeroU32::new(l.get() / replicas.max(1))
                .unwrap_or(std::num::NonZeroU32::MIN)
        })
    };
    TenantPolicy {
        requests_per_minute: share(tenant.requests_per_minute),
        tokens_per_minute: share(tenant.tokens_per_minute),
        ..tenant.clone()
    }
}

fn rate_rejection(tenant: &str, error: RateLimitError) -> Rejection {
    let tenant = tenant.to_string();
    match error {
        RateLimitError::Limited {
            kind,
            limit,
            requested,
            wait,
            headers,
        } => Rejection::RateLimited {
            tenant,
            kind,
            limit,
            requested,
            retry_after: wait.min(MAX_RETRY_AFTER),
            headers,
        },
        RateLimitError::ExceedsBucket {
            kind,
            limit,
            requested,
            headers,
        } => Rejection::InsufficientQuota {
            tenant,
            kind,
            limit,
            requested,
            headers,
        },
    }
}

/// Where an admitted request is in its life. Every way out of [`Admitted`] is one of these, so
/// its drop settles the rate-limit debit exactly (queued requests are the dispatcher's
/// `Pending`, refunded in full whenever they leave the queue without starting).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Admitted, not yet accepted by an engine: dropping it refunds everything, whether or not
    /// its reservation was handed out (an engine that refuses a request releases it).
    Admitted,
    /// Accepted by an engine. `generated` counts the output tokens reported so far; `None`
    /// when nobody counts them (an upstream's opaque body), so the whole up-front charge stays.
    Running { generated: Option<usize> },
    /// Generation ended normally with this many output tokens.
    Finished { completion_tokens: usize },
    /// The engine refused it before it started (`QueueFull`, `ShutDown`, an upstream error).
    FailedBeforeStart,
}

/// A request that may run. Owns its tenant + lane concurrency slot, its rate-limit debit and
/// its KV [`Reservation`]; not Clone, so each is given back exactly once, when this drops.
/// Keep it alive for the whole response (move it into the streamed body), and tell it where
/// the request is ([`Admitted::mark_started`], [`Admitted::record_generated`],
/// [`Admitted::record_completion`], [`Admitted::mark_failed_before_start`]): the tenant is
/// charged what the request used by the stage it ended in.
#[derive(Debug)]
pub struct Admitted {
    tenant: Arc<TenantPolicy>,
    pool: PoolId,
    lane: Lane,
    request_id: String,
    prompt_tokens: usize,
    max_output_tokens: usize,
    reserved_blocks: usize,
    reserved_tokens: u64,
    queue_wait: Duration,
    /// When it took its concurrency slot.
    started_at: Instant,
    headers: RateLimitHeaders,
    stage: Stage,
    /// Output tokens reported to the ledger through [`Admitted::record_generated`].
    reported_output: usize,
    reservation: Option<Reservation>,
    debit: Option<Debit>,
    ledger: Arc<Ledger>,
}

impl Admitted {
    /// The KV reservation, to hand to the engine with the request (once). Handing it out does
    /// not start the request: call [`Admitted::mark_started`] once the engine accepted it.
    pub fn take_reservation(&mut self) -> Option<Reservation> {
        self.reservation.take()
    }

    /// The engine accepted the request: from now on it is charged what it uses. Without
    /// [`Admitted::record_generated`] or [`Admitted::record_completion`] calls that is the full
    /// up-front charge (an upstream's body is not metered).
    pub fn mark_started(&mut self) {
        if self.stage == Stage::Admitted {
            self.stage = Stage::Running { generated: None };
        }
    }

    /// The engine refused the request before it started: everything is refunded on drop.
    pub fn mark_failed_before_start(&mut self) {
        if self.stage == Stage::Admitted {
            self.stage = Stage::FailedBeforeStart;
        }
    }

    /// One more output token was generated: a request cancelled or timed out from here on is
    /// charged its prompt and the tokens generated so far, not prompt + max_tokens.
    pub fn record_generated(&mut self) {
        if let Stage::Running { generated } = &mut self.stage {
            *generated = Some(generated.unwrap_or(0) + 1);
            // The forecasts' model of the engine learns how far its requests are.
            if self.reported_output < self.max_output_tokens {
                let prefilled = if self.reported_output == 0 {
                    self.prompt_tokens as u64
                } else {
                    0
                };
                self.reported_output += 1;
                self.ledger.generated(self.pool, prefilled);
            }
        }
    }

    /// Records how many tokens the response generated: the unused part of the token debit is
    /// refunded when this guard drops.
    pub fn record_completion(&mut self, completion_tokens: usize) {
        if matches!(self.stage, Stage::Admitted | Stage::Running { .. }) {
            self.stage = Stage::Finished { completion_tokens };
        }
    }

    /// Where the request is now.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The pool this request's capacity was reserved from.
    pub fn pool(&self) -> PoolId {
        self.pool
    }

    /// Time spent queued before admission.
    pub fn queue_wait(&self) -> Duration {
        self.queue_wait
    }

    /// The tenant's rate-limit state right after this request's debit.
    pub fn rate_headers(&self) -> RateLimitHeaders {
        self.headers.clone()
    }

    pub fn tenant(&self) -> &Arc<TenantPolicy> {
        &self.tenant
    }

    pub fn lane(&self) -> Lane {
        self.lane
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// KV blocks reserved for this request at admission.
    pub fn reserved_blocks(&self) -> usize {
        self.reserved_blocks
    }

    /// What it adds to its pool's in-flight totals while it runs.
    fn footprint(&self) -> Footprint {
        Footprint {
            reserved_tokens: self.reserved_tokens,
            prompt_tokens: self.prompt_tokens as u64,
            output_tokens: self.max_output_tokens as u64,
        }
    }

    /// Tokens this request is charged for, by the stage it is in; `None` when it never ran.
    fn used_tokens(&self) -> Option<usize> {
        let used_output = match self.stage {
            Stage::Admitted | Stage::FailedBeforeStart => return None,
            Stage::Running { generated: None } => self.max_output_tokens,
            Stage::Running {
                generated: Some(generated),
            } => generated,
            Stage::Finished { completion_tokens } => completion_tokens,
        };
        Some(self.prompt_tokens.saturating_add(used_output))
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let used = self.used_tokens();
        if let Some(debit) = self.debit.take() {
            match used {
                Some(used) => debit.settle(used),
                None => debit.cancel(),
            }
        }
        if used.is_some() {
            // Every request that ran gives its capacity back now: a drain-rate sample for its
            // pool, embedded engine or upstream alike.
            self.ledger
                .record_drained(self.pool, self.reserved_tokens, Instant::now());
        }
        // Blocks first, then the slot: the dispatcher woken by the slot sees the blocks free.
        drop(self.reservation.take());
        let unprefilled = if self.reported_output == 0 {
            self.prompt_tokens as u64
        } else {
            0
        };
        self.ledger.finish(
            &self.tenant.name,
            self.pool,
            self.lane,
            self.footprint(),
            (
                (self.max_output_tokens - self.reported_output) as u64,
                unprefilled,
            ),
            SlotUse {
                started_at: self.started_at,
                ran: used.is_some(),
            },
        );
    }
}

#[cfg(test)]
mod tests;

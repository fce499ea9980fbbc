//! Admission: the one gate between a validated request and the engine.
//!
//! In order, cheapest first: a request that can never fit the KV pool is refused at once
//! (400); the tenant's request and token rate limits are debited (429 with governor's exact
//! wait); then the request joins the dispatcher's fair queue. A single dispatcher task owns the
//! queue (an actor: commands over a bounded channel, so no check-then-act races) and starts a
//! request only when its tenant and lane have a free concurrency slot *and* the block pool
//! atomically reserves its KV blocks under the high watermark. The caller gets an [`Admitted`]
//! guard (not Clone) that owns the slot, the rate-limit debit and the [`Reservation`]; dropping
//! it gives all three back exactly once.
//!
//! [`Admission::admit`] is cancel-safe: if the client goes away and the future is dropped, the
//! queued entry is removed (and nothing it did not get is released).
//!
//! Admission may gate several block pools ([`Admission::with_pools`]): the embedded engine's
//! KV pool ([`PoolId::LOCAL`]) and one pool per upstream engine, sized from the capacity the
//! upstream declares (see `upstream.rs`). Each ticket names its pool. Rate limits, tenant
//! concurrency and the fair queue are shared by all pools; KV reservations, the watermark, the
//! long lane's cap and the drain-rate estimate are per pool, so a saturated upstream never
//! holds back requests for the embedded engine (or the other way round).

mod dispatcher;
mod ledger;
mod rejection;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::HeaderMap;
use kvgate_runtime::block_pool::{BlockPool, Reservation};
use kvgate_runtime::engine::EngineStats;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

pub use ledger::TenantQueueSnapshot;
pub use rejection::{MAX_RETRY_AFTER, MIN_CAPACITY_RETRY_AFTER, Rejection};

use crate::auth::authenticate;
use crate::policy::{KvPolicy, ReservationMode, TenantPolicy};
use crate::queue::Lane;
use crate::ratelimit::{Debit, RateLimitError, RateLimitHeaders, RateLimits};
use crate::reload::PolicyStore;
use dispatcher::{Command, Dispatcher, Pending};
use ledger::Ledger;

/// Commands waiting for the dispatcher; senders wait when it is full (backpressure).
const COMMAND_CAPACITY: usize = 1024;

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
    commands: mpsc::Sender<Command>,
    store: PolicyStore,
    /// Indexed by [`PoolId`]; the first is [`PoolId::LOCAL`].
    pools: Arc<[Arc<BlockPool>]>,
    limits: Arc<RateLimits>,
    ledger: Arc<Ledger>,
    next_key: Arc<AtomicU64>,
}

/// What admission needs to know about a validated request.
#[derive(Debug, Clone)]
pub struct AdmissionTicket {
    pub tenant: Arc<TenantPolicy>,
    pub prompt_tokens: usize,
    pub max_output_tokens: usize,
    pub request_id: String,
    /// The pool to reserve from ([`PoolId::LOCAL`] for the embedded engine).
    pub pool: PoolId,
}

impl Admission {
    /// Admission over the embedded engine's pool alone. Starts the dispatcher task; must be
    /// called inside a tokio runtime.
    pub fn new(store: PolicyStore, pool: Arc<BlockPool>) -> Admission {
        Admission::with_pools(store, pool, Vec::new())
    }

    /// Admission over the embedded engine's pool (`local`) and `others` (one per upstream);
    /// [`Admission::pool_id`] says which id each got. Starts the dispatcher task; must be
    /// called inside a tokio runtime.
    pub fn with_pools(
        store: PolicyStore,
        local: Arc<BlockPool>,
        others: Vec<Arc<BlockPool>>,
    ) -> Admission {
        let pools: Arc<[Arc<BlockPool>]> = std::iter::once(local).chain(others).collect();
        let (commands, receiver) = mpsc::channel(COMMAND_CAPACITY);
        let limits = Arc::new(RateLimits::new());
        let ledger = Arc::new(Ledger::default());
        let dispatcher = Dispatcher::new(
            receiver,
            store.clone(),
            Arc::clone(&pools),
            Arc::clone(&limits),
            Arc::clone(&ledger),
        );
        tokio::spawn(dispatcher.run());
        Admission {
            commands,
            store,
            pools,
            limits,
            ledger,
            next_key: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The id of `pool` if admission gates it (the same `Arc`), else `None`.
    pub fn pool_id(&self, pool: &Arc<BlockPool>) -> Option<PoolId> {
        self.pools
            .iter()
            .position(|known| Arc::ptr_eq(known, pool))
            .map(PoolId)
    }

    /// Waits until the request may start, or says why it may not.
    pub async fn admit(&self, ticket: AdmissionTicket) -> Result<Admitted, Rejection> {
        let policy = self.store.current();
        let tenant = Arc::clone(&ticket.tenant);
        let Some(pool) = self.pools.get(ticket.pool.0) else {
            // Tickets only name pools that `pool_id` returned: this is a wiring bug.
            tracing::error!(
                pool = ticket.pool.0,
                "admission ticket names an unknown pool"
            );
            return Err(Rejection::Unavailable);
        };
        let occupancy = pool.snapshot();
        let needed_blocks = blocks_needed(
            &policy.kv,
            occupancy.block_size,
            ticket.prompt_tokens,
            ticket.max_output_tokens,
        );
        let limit_blocks = watermark_limit(occupancy.total_blocks, policy.kv.high_watermark);
        // In `prompt` mode the reservation is smaller than the whole sequence, but a sequence
        // longer than the entire pool could still never finish.
        let sequence_blocks = (ticket.prompt_tokens)
            .saturating_add(ticket.max_output_tokens)
            .div_ceil(occupancy.block_size.max(1));
        if needed_blocks > limit_blocks || sequence_blocks > occupancy.total_blocks {
            let rejection = Rejection::NeverFits {
                needed_blocks: needed_blocks.max(sequence_blocks),
                total_blocks: occupancy.total_blocks,
                limit_blocks,
            };
            rejection.count(&tenant.name);
            return Err(rejection);
        }

        let budget_tokens = ticket
            .prompt_tokens
            .saturating_add(ticket.max_output_tokens);
        let debit = self
            .limits
            .try_debit(&tenant, budget_tokens)
            .map_err(|error| {
                let rejection = rate_rejection(&tenant.name, error);
                rejection.count(&tenant.name);
                rejection
            })?;

        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let lane = if ticket.prompt_tokens >= policy.lanes.long_prompt_tokens {
            Lane::Long
        } else {
            Lane::Short
        };
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            key,
            ticket,
            lane,
            needed_blocks,
            reserved_tokens: (needed_blocks * occupancy.block_size) as u64,
            debit,
            enqueued_at: Instant::now(),
            reply,
        };
        // From here on, dropping this future must take the entry out of the queue.
        let mut cancel = CancelOnDrop {
            key,
            commands: self.commands.clone(),
            armed: true,
        };
        if self.commands.send(Command::Enqueue(pending)).await.is_err() {
            cancel.armed = false;
            return Err(Rejection::Unavailable);
        }
        let answer = answer.await;
        cancel.armed = false;
        answer.unwrap_or(Err(Rejection::Unavailable))
    }

    /// Gives admission the engine's per-token service time (see [`per_token_service_time`]):
    /// the prior its Retry-After estimates use until completions have measured a drain rate.
    pub fn set_service_time_probe(
        &self,
        probe: impl Fn() -> Option<Duration> + Send + Sync + 'static,
    ) {
        self.ledger.set_service_time_probe(Arc::new(probe));
    }

    /// Queue and in-flight state per tenant (last dispatcher step), sorted by tenant.
    pub fn queue_snapshot(&self) -> Vec<TenantQueueSnapshot> {
        self.ledger.snapshot()
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

    /// Refuses a request of `tenant` whose request bucket is empty now, before its body is read
    /// (see `intake.rs`). Spends nothing: [`Admission::admit`] debits the request as usual, so a
    /// request that passes here can still be refused there by a burst that came in meanwhile.
    /// A refusal is counted like admission's own.
    pub fn check_request_rate(&self, tenant: &TenantPolicy) -> Result<(), Rejection> {
        self.limits.check_request(tenant).map_err(|error| {
            let rejection = rate_rejection(&tenant.name, error);
            rejection.count(&tenant.name);
            rejection
        })
    }
}

/// Sends `Cancel` when an `admit` future is dropped while its entry may be queued. If the
/// channel is full the dispatcher still finds the entry later: its reply channel is closed.
struct CancelOnDrop {
    key: u64,
    commands: mpsc::Sender<Command>,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.commands.try_send(Command::Cancel(self.key));
        }
    }
}

/// The engine's per-token service time as of its last step: the step's wall time divided by
/// the sequences in it (each running sequence gains one token per step). `None` before the
/// first step. A prefill-heavy step makes it pessimistic, never optimistic.
pub fn per_token_service_time(stats: &EngineStats) -> Option<Duration> {
    let sequences = u32::try_from(stats.last_batch_seqs)
        .ok()
        .filter(|n| *n > 0)?;
    let step = Duration::from_micros(stats.last_step_micros);
    (!step.is_zero()).then(|| step / sequences)
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

/// A request that may run. Owns its tenant + lane concurrency slot, its rate-limit debit and
/// its KV [`Reservation`]; not Clone, so each is given back exactly once, when this drops.
/// Keep it alive for the whole response (move it into the streamed body).
#[derive(Debug)]
pub struct Admitted {
    tenant: Arc<TenantPolicy>,
    pool: PoolId,
    lane: Lane,
    request_id: String,
    prompt_tokens: usize,
    reserved_blocks: usize,
    reserved_tokens: u64,
    queue_wait: Duration,
    headers: RateLimitHeaders,
    completion_tokens: Option<usize>,
    /// Handed to an engine that holds no reservation of ours (an upstream).
    started_elsewhere: bool,
    reservation: Option<Reservation>,
    debit: Option<Debit>,
    ledger: Arc<Ledger>,
}

impl Admitted {
    /// The KV reservation, to hand to the engine with the request (once).
    pub fn take_reservation(&mut self) -> Option<Reservation> {
        self.reservation.take()
    }

    /// Records how many tokens the response generated: the unused part of the token debit is
    /// refunded when this guard drops, and the completion feeds the drain-rate estimate used
    /// for capacity Retry-After values. Without a call the full up-front charge stays once the
    /// reservation was taken (the request ran); if it was never taken, all is refunded.
    pub fn record_completion(&mut self, completion_tokens: usize) {
        if self.completion_tokens.is_none() {
            self.ledger
                .record_drained(self.pool, self.reserved_tokens, Instant::now());
        }
        self.completion_tokens = Some(completion_tokens);
    }

    /// Records that the request was handed to an engine that takes no reservation from us (an
    /// upstream): it ran, so unless [`Admitted::record_completion`] says how far, the full
    /// up-front token charge stays. The reservation stays with this guard, which holds the
    /// upstream's capacity until it drops (keep it in the response body).
    pub fn mark_started(&mut self) {
        self.started_elsewhere = true;
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
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if let Some(debit) = self.debit.take() {
            match self.completion_tokens {
                Some(completion) => debit.settle(self.prompt_tokens.saturating_add(completion)),
                // Still holding its reservation: never handed to an engine, so it never ran.
                None if self.reservation.is_some() && !self.started_elsewhere => debit.cancel(),
                // Ran, but how far is unknown: keep the full up-front charge.
                None => debit.settle(usize::MAX),
            }
        }
        // Blocks first, then the slot: the dispatcher woken by the slot sees the blocks free.
        drop(self.reservation.take());
        self.ledger.finish(
            &self.tenant.name,
            self.pool,
            self.lane,
            self.reserved_tokens,
        );
    }
}

#[cfg(test)]
mod tests;

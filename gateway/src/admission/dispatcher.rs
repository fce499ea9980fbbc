//! The admission dispatcher: one state (the fair queue and its counters, behind one lock) that
//! decides, step by step, which queued request starts next. Both the callers and a small
//! upkeep task run its steps under that lock, so there are no check-then-act races:
//!
//! * **the caller of `admit`** ([`Dispatcher::submit`]) enqueues its request and runs a step at
//!   once. A request that can start now (its tenant and lane have a free slot, its pool has
//!   the blocks, and the fair queue has nobody ahead of it) leaves with its [`Admitted`] guard
//!   on its own task, without waiting for another task to be scheduled; one that cannot stays
//!   queued, exactly as the step left it. Cancelling (the client left) is a step too.
//! * **the upkeep task** ([`run`]) runs a step whenever something else may let a queued request
//!   start or must refuse one: a running request released its slot, the block pool returned
//!   blocks, a queue deadline passed, a policy reload, and every [`REFORECAST_EVERY`] while
//!   anything is queued. Each step expires, re-forecasts, dispatches and publishes. While the
//!   queue is empty it listens only for a caller that leaves a request queued (and reloads):
//!   a release then starts nothing, and waking a task for it on every finished request was a
//!   cross-thread wake-up and a step per request for nothing.
//!
//! The step is the same code whoever runs it, so a request admitted on its own task gets the
//! decision the upkeep task would have made at that moment (`tests.rs` runs the same sequences
//! both ways and compares every decision).
//!
//! Dispatch takes the fair-queue candidate and asks its pool to reserve its blocks atomically
//! under the watermark. If that fails, KV is the bottleneck for that lane of that pool and the
//! lane stops there (the fair-next request must get the blocks first, or it would starve behind
//! smaller ones); the other lane, and every other pool, may go on. Once the blocked request has
//! waited half its `max_queue_wait`, both lanes of its pool stop so freed blocks accumulate for
//! it.
//!
//! **Forecasts follow the fair queue.** A tenant's request waits for its own backlog in its
//! pool and, because the queue shares service by weight, for the part of every other tenant's
//! backlog that is served meanwhile: min(their backlog, own backlog × their weight / own
//! weight). Not everyone's sum: a flooding tenant cannot make a newcomer's forecast exceed its
//! `max_queue_wait`. A request also waits for one of its tenant's concurrency slots, which may
//! be the tighter limit while KV is free: that forecast ([`Ledger::slot_forecast`], sized by
//! each request's max_tokens, plus the tenant's recent grant wait for each grant on the way to
//! the slot) counts only the tenant's own queue, and the longer of the two binds
//! ([`Forecast`]). When the forecast says a
//! request cannot start before its deadline it is refused at once with 429
//! `kv_cache_saturated` (or `concurrency_saturated` when the slots bind) and the forecast as
//! Retry-After — at enqueue
//! (with a margin for the forecast's error: [`ENQUEUE_FORECAST_MARGIN`]),
//! and again whenever a step runs (the drain rate and the backlog change), youngest
//! entry of each tenant first, so nobody holds a client for its whole deadline only to answer
//! 503.
//!
//! **Per-step cost does not grow with the queue.** Expiry pops an ordered deadline set,
//! cancellation and start find entries through the queue's index, forecasts read per-pool and
//! per-tenant counters kept up to date on every queue change, and the re-forecast looks at one
//! entry per backlogged tenant (plus each one it refuses): O(T + log N) per step for T
//! backlogged tenants and N queued requests (`benches/dispatch.rs`). Only a policy reload walks
//! the whole queue, once; and a forecast about to refuse a request first re-estimates the
//! queued entries' blocks against the prefix cache (entries queued before their prompt was
//! cached count it in full), at most once per [`REFORECAST_EVERY`] per pool and only after the
//! cache changed ([`Dispatcher::refresh_estimates`]).

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::num::NonZeroU64;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kvgate_runtime::block_pool::{BlockPool, Occupancy, Reservation};
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use super::capacity::PoolLimit;
use super::ledger::{Ledger, QueuedAhead};
use super::rejection::{Rejection, clamp_retry_after};
use super::{
    AdmissionTicket, Admitted, MIN_CAPACITY_RETRY_AFTER, PoolId, PromptPrefix, Stage,
    watermark_limit,
};
use crate::metrics::QUEUE_ABANDONED_TOTAL;
use crate::policy::{Policy, TenantPolicy};
use crate::queue::{EntryId, FairQueue, Lane, NewEntry, QueueEntry, QueueFull, QueueLimits};
use crate::ratelimit::{Debit, RateLimits};
use crate::reload::PolicyStore;
use crate::validate::ValidationError;

/// How often queued requests are re-forecast when nothing else wakes the dispatcher: the drain
/// rate and the engine's service time change with every step, not only on events.
pub(super) const REFORECAST_EVERY: Duration = Duration::from_millis(250);

/// At enqueue a request is refused when its forecast wait exceeds this share of its
/// `max_queue_wait`, while a queued one is refused only once the forecast exceeds all the time
/// it has left. The margin absorbs the forecast's own error: without it, a request forecast to
/// start just inside its deadline is queued, and refused a few seconds later when the running
/// requests prove slightly slower than predicted, instead of at once (issue 16's 48 MiB burst).
pub(super) const ENQUEUE_FORECAST_MARGIN: f64 = 0.9;

/// Which limit a queued request is forecast to wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bottleneck {
    /// KV blocks coming back to its pool.
    Kv,
    /// One of its tenant's concurrency slots coming free.
    Concurrency,
}

/// A queued request's forecast wait and the limit that sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Forecast {
    pub wait: Duration,
    pub bottleneck: Bottleneck,
}

impl Forecast {
    /// The request starts once both limits allow it: the longer wait is the forecast. `None`
    /// when neither can be forecast yet; one alone is used as it is.
    ///
    /// The bottleneck is the tenant's slots when theirs is the longer wait, and also when
    /// `held_by_slots` (the tenant has no free slot while its pool has the blocks for this
    /// request now): the KV forecast prices capacity at the pace of the requests running, and
    /// when a concurrency cap keeps them few, that pace is the cap's, not the cache's. Naming
    /// KV then sent operators to add memory while a quarter of it sat unused (QA D3).
    fn binding(kv: Option<Duration>, slot: Option<Duration>, held_by_slots: bool) -> Option<Self> {
        let wait = match (kv, slot) {
            (Some(kv), Some(slot)) => kv.max(slot),
            (kv, slot) => kv.or(slot)?,
        };
        let slots_longer = slot.is_some_and(|slot| kv.is_none_or(|kv| slot > kv));
        let bottleneck = if slots_longer || held_by_slots {
            Bottleneck::Concurrency
        } else {
            Bottleneck::Kv
        };
        Some(Forecast { wait, bottleneck })
    }
}

/// What the handles and the upkeep task share: the dispatcher behind its lock, and the
/// upkeep task's wake-up for changes made by callers.
pub(super) struct Core {
    pub dispatcher: Mutex<Dispatcher>,
    /// Wakes the upkeep task to re-arm its timer after a caller's step left it a wake-up
    /// earlier than the one it planned (a new deadline), or to watch a pool added since.
    /// The caller's step has done the work, so the upkeep task runs none for this alone.
    /// `notify_one` stores the wake-up while the task is busy: none is lost.
    pub changed: Notify,
    /// Tests only: callers just queue and the upkeep task's steps decide (the path every
    /// request took before callers ran steps themselves), to show both decide alike.
    #[cfg(test)]
    pub queue_only: std::sync::atomic::AtomicBool,
}

impl Core {
    /// Queues a caller's request and, unless tests asked for the queued path alone, runs a
    /// step at once ([`Dispatcher::submit`]). True when the upkeep task must re-arm its timer.
    pub fn submit(&self, pending: Pending) -> bool {
        let mut dispatcher = self.dispatcher.lock();
        #[cfg(test)]
        if self.queue_only.load(std::sync::atomic::Ordering::Relaxed) {
            dispatcher.enqueue(pending);
            dispatcher.step_requested = true;
            return true;
        }
        dispatcher.submit(pending)
    }
}

/// A request waiting in the queue.
pub(super) struct Pending {
    pub key: u64,
    pub ticket: AdmissionTicket,
    pub lane: Lane,
    /// KV blocks the whole request holds (recomputed when a reload changes the KV policy).
    pub full_blocks: usize,
    /// Of those, the blocks it is expected to add (those past its prefix cached at enqueue):
    /// what the backlog and the forecasts count. The reservation settles the real number.
    pub needed_blocks: usize,
    /// `needed_blocks × block_size`: the KV capacity it is expected to add while running.
    pub reserved_tokens: u64,
    pub debit: Debit,
    pub enqueued_at: Instant,
    pub reply: oneshot::Sender<Result<Admitted, Rejection>>,
}

pub(super) struct Dispatcher {
    store: PolicyStore,
    /// Indexed by [`PoolId`].
    pools: Arc<[Arc<BlockPool>]>,
    /// The part of each pool admission may fill now (indexed by [`PoolId`]).
    usable: Arc<[Arc<PoolLimit>]>,
    limits: Arc<RateLimits>,
    ledger: Arc<Ledger>,
    queue: FairQueue<Pending>,
    /// Queued KV blocks per pool (indexed by [`PoolId`]), in total and per tenant: what the
    /// forecasts read, kept in step with the queue so no forecast scans it.
    backlog: Vec<PoolBacklog>,
    /// Which queued entry belongs to which `admit` call, for `Cancel`.
    keys: HashMap<u64, EntryId>,
    /// Queued max_tokens per tenant (all pools), for queue-full Retry-After estimates.
    queued_output: HashMap<String, u64>,
    /// Per pool (indexed by [`PoolId`]): the prefix-cache generation and time of the last
    /// re-estimate of queued entries' expected blocks (see [`Dispatcher::refresh_estimates`]).
    estimated_at: Vec<Option<(u64, Instant)>>,
    /// Per tenant, when the latest `concurrency_saturated` refusal was told to come back plus
    /// one slot interval: the next refusal is told no sooner, so a refused burst does not
    /// retry at one instant into the same full slots (QA: 15 refusals all said 6 s). One
    /// entry per tenant ever refused so, which the policy bounds.
    retry_horizon: HashMap<String, Instant>,
    /// Steps run so far (tests wait for the upkeep task's).
    #[cfg(test)]
    pub steps: u64,
    /// When the upkeep task means to run its next step unprompted (`None`: only when woken).
    upkeep_wake: Option<Instant>,
    /// Shutdown's grace period is over ([`Dispatcher::close`]): nothing queues or starts.
    closed: bool,
    /// Tests only: a request was queued without a step; the upkeep task's next wake-up runs one.
    #[cfg(test)]
    pub step_requested: bool,
}

/// Queued KV blocks of one pool.
#[derive(Debug, Default, Clone)]
struct PoolBacklog {
    blocks: usize,
    per_tenant: HashMap<String, usize>,
}

impl PoolBacklog {
    fn add(&mut self, tenant: &str, blocks: usize) {
        self.blocks += blocks;
        *self.per_tenant.entry(tenant.to_owned()).or_default() += blocks;
    }

    fn remove(&mut self, tenant: &str, blocks: usize) {
        self.blocks = self.blocks.saturating_sub(blocks);
        if let Some(queued) = self.per_tenant.get_mut(tenant) {
            *queued = queued.saturating_sub(blocks);
            if *queued == 0 {
                self.per_tenant.remove(tenant);
            }
        }
    }

    fn of(&self, tenant: &str) -> usize {
        self.per_tenant.get(tenant).copied().unwrap_or(0)
    }
}

impl Dispatcher {
    pub fn new(
        store: PolicyStore,
        usable: Arc<[Arc<PoolLimit>]>,
        limits: Arc<RateLimits>,
        ledger: Arc<Ledger>,
    ) -> Dispatcher {
        let usable_len = usable.len();
        Dispatcher {
            store,
            limits,
            backlog: vec![PoolBacklog::default(); usable.len()],
            pools: usable
                .iter()
                .map(|limit| Arc::clone(limit.pool()))
                .collect(),
            usable,
            ledger,
            queue: FairQueue::new(),
            keys: HashMap::new(),
            queued_output: HashMap::new(),
            estimated_at: vec![None; usable_len],
            retry_horizon: HashMap::new(),
            #[cfg(test)]
            steps: 0,
            upkeep_wake: None,
            closed: false,
            #[cfg(test)]
            step_requested: false,
        }
    }

    /// A caller's request: queued, then a step runs at once, so it leaves with its guard (or
    /// its refusal) now if it can start now. True when the queue now needs a wake-up earlier
    /// than the one the upkeep task planned (a new, sooner deadline; or the queue was empty).
    pub fn submit(&mut self, pending: Pending) -> bool {
        if self.closed {
            let tenant = Arc::clone(&pending.ticket.tenant);
            drop(pending.debit);
            self.reject(pending.reply, Rejection::Unavailable, &tenant);
            return false;
        }
        let now = Instant::now();
        self.enqueue(pending);
        self.step(now);
        let next = self.next_wake(now);
        next.is_some_and(|next| self.upkeep_wake.is_none_or(|planned| next < planned))
    }

    /// The `admit` future with this `key` was dropped: its entry leaves the queue, which may
    /// let the next one start.
    pub fn withdraw(&mut self, key: u64) {
        self.cancel(key);
        self.step(Instant::now());
    }

    /// Shutdown's grace period is over: every queued request is answered `Unavailable` (503,
    /// its debit refunded), and from now on nothing queues or starts; a request submitted
    /// later is refused the same way at once. O(N), once.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let ids: Vec<EntryId> = self.queue.entries().map(|entry| entry.id).collect();
        let mut refused = 0usize;
        for id in ids {
            let Some(entry) = self.unqueue(id) else {
                continue;
            };
            let QueueEntry { payload, .. } = entry;
            let tenant = Arc::clone(&payload.ticket.tenant);
            drop(payload.debit);
            if payload.reply.is_closed() {
                count_abandoned(&tenant.name);
                continue;
            }
            refused += 1;
            self.reject(payload.reply, Rejection::Unavailable, &tenant);
        }
        if refused > 0 {
            tracing::info!(refused, "grace period over: refused the queued requests");
        }
        self.ledger.publish(self.queue.backlogs());
    }

    /// One step: expire, re-forecast, dispatch, publish.
    fn step(&mut self, now: Instant) {
        self.expire(now);
        self.refuse_late(now);
        self.dispatch(now);
        self.ledger.publish(self.queue.backlogs());
        #[cfg(test)]
        {
            self.steps += 1;
        }
    }

    /// Gates one more pool from now on (an upstream model added by a reload); its id.
    pub fn add_pool(&mut self, limit: Arc<PoolLimit>) -> PoolId {
        let id = PoolId(self.pools.len());
        let pools: Vec<Arc<BlockPool>> = self
            .pools
            .iter()
            .cloned()
            .chain(std::iter::once(Arc::clone(limit.pool())))
            .collect();
        let usable: Vec<Arc<PoolLimit>> = self
            .usable
            .iter()
            .cloned()
            .chain(std::iter::once(limit))
            .collect();
        self.pools = pools.into();
        self.usable = usable.into();
        self.backlog.push(PoolBacklog::default());
        self.estimated_at.push(None);
        id
    }

    /// The pools gated now, indexed by [`PoolId`].
    pub fn pools(&self) -> &Arc<[Arc<BlockPool>]> {
        &self.pools
    }

    /// Requests queued now.
    #[cfg(test)]
    pub fn queued_len(&self) -> usize {
        self.queue.len()
    }

    /// When the upkeep task means to run its next step unprompted.
    #[cfg(test)]
    pub fn upkeep_wake(&self) -> Option<Instant> {
        self.upkeep_wake
    }

    /// The upkeep task's next unprompted step ([`Dispatcher::next_wake`]), remembered so that
    /// callers wake it only for an earlier one.
    fn plan_wake(&mut self, now: Instant) -> Option<Instant> {
        self.upkeep_wake = self.next_wake(now);
        self.upkeep_wake
    }

    /// When the next step is due with nothing else happening: the earliest queue deadline,
    /// or the next re-forecast while anything is queued.
    fn next_wake(&self, now: Instant) -> Option<Instant> {
        let deadline = self.queue.next_deadline().map(Instant::from_std);
        let reforecast = (!self.queue.is_empty()).then(|| now + REFORECAST_EVERY);
        match (deadline, reforecast) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// After a reload: forgets the rate-limit state of removed tenants, and re-checks every
    /// queued request under the new policy, as if it had just arrived, oldest first. A removed
    /// tenant's requests are refused (401); the others take the tenant's new policy (weight,
    /// concurrency, max_queue_wait, hence deadline) and the new KV policy (blocks needed,
    /// lane). Those that no longer fit are refused with the error they would get now: over
    /// the pool (400), over the tenant's lowered length limits (400, as validation says), or
    /// beyond its lowered `queue_depth` / `queue_tokens` (429 `queue_full` for the youngest
    /// ones, or `insufficient_quota` for one bigger than the whole token bound). The one O(N)
    /// step, taken once per reload.
    fn apply_reload(&mut self) {
        let policy = self.store.current();
        self.limits.retain(|tenant| policy.tenant(tenant).is_some());
        let pools = Arc::clone(&self.pools);
        let ledger = Arc::clone(&self.ledger);
        let mut refused: HashMap<EntryId, Refusal> = HashMap::new();
        // What each tenant keeps queued so far (requests, tokens), in arrival order.
        let mut kept: HashMap<String, (usize, u64)> = HashMap::new();
        let dropped = self.queue.rewrite(|entry| {
            let tenant = match requeue(&policy, &pools, &mut entry.payload) {
                Ok(tenant) => tenant,
                Err(rejection) => {
                    refused.insert(entry.id, Refusal::Now(rejection));
                    return false;
                }
            };
            let (requests, tokens) = kept.entry(tenant.name.clone()).or_default();
            let limit = tenant.queue_tokens as u64;
            let over = if entry.tokens > limit {
                Some(Refusal::NeverQueues {
                    requested: entry.tokens,
                    limit,
                })
            } else if *requests >= tenant.queue_depth {
                let (queued, limit) = (*requests, tenant.queue_depth);
                Some(Refusal::QueueFull(QueueFull::Requests { queued, limit }))
            } else if *tokens + entry.tokens > limit {
                let (queued, requested) = (*tokens, entry.tokens);
                Some(Refusal::QueueFull(QueueFull::Tokens {
                    queued,
                    requested,
                    limit,
                }))
            } else {
                None
            };
            if let Some(refusal) = over {
                refused.insert(entry.id, refusal);
                return false;
            }
            *requests += 1;
            *tokens += entry.tokens;
            entry.lane = entry.payload.lane;
            entry.deadline = entry.enqueued_at + ledger.max_queue_wait(tenant.max_queue_wait);
            true
        });
        for tenant in policy.tenants() {
            self.queue.set_weight(&tenant.name, tenant.weight);
        }
        self.recount_backlog();
        let now = Instant::now();
        for entry in dropped {
            self.keys.remove(&entry.payload.key);
            let Pending {
                ticket,
                debit,
                reply,
                ..
            } = entry.payload;
            drop(debit);
            let tenant = Arc::clone(&ticket.tenant);
            let rejection = match refused.remove(&entry.id) {
                Some(Refusal::Now(rejection)) => rejection,
                Some(Refusal::NeverQueues { requested, limit }) => Rejection::QueueNeverFits {
                    tenant: tenant.name.clone(),
                    requested,
                    limit,
                    headers: self.limits.headers(&tenant),
                },
                Some(Refusal::QueueFull(reason)) => Rejection::QueueFull {
                    tenant: tenant.name.clone(),
                    reason,
                    retry_after: self.queue_slot_wait(&tenant, ticket.pool, now),
                    headers: self.limits.headers(&tenant),
                },
                None => continue,
            };
            self.reject(reply, rejection, &tenant);
        }
    }

    /// Rebuilds the per-pool backlog counters from the queue (after a reload rewrote it).
    fn recount_backlog(&mut self) {
        let mut backlog = vec![PoolBacklog::default(); self.pools.len()];
        let mut queued_output = HashMap::<String, u64>::new();
        for entry in self.queue.entries() {
            let pending = &entry.payload;
            backlog[pending.ticket.pool.0].add(&entry.tenant, pending.needed_blocks);
            *queued_output.entry(entry.tenant.clone()).or_default() +=
                pending.ticket.max_output_tokens as u64;
        }
        self.backlog = backlog;
        self.queued_output = queued_output;
    }

    fn enqueue(&mut self, pending: Pending) {
        let tenant = Arc::clone(&pending.ticket.tenant);
        let tokens = pending
            .ticket
            .prompt_tokens
            .saturating_add(pending.ticket.max_output_tokens) as u64;
        // Every request passes through the queue: one bigger than the tenant's whole queue
        // token bound can never pass, so it is refused as such (no Retry-After), not queue_full.
        if tokens > tenant.queue_tokens as u64 {
            drop(pending.debit);
            let rejection = Rejection::QueueNeverFits {
                tenant: tenant.name.clone(),
                requested: tokens,
                limit: tenant.queue_tokens as u64,
                headers: self.limits.headers(&tenant),
            };
            return self.reject(pending.reply, rejection, &tenant);
        }
        let pool = pending.ticket.pool;
        let max_wait = self.ledger.max_queue_wait(tenant.max_queue_wait);
        // Every queued request of the tenant is ahead of a new one.
        let ahead = self.queued_ahead(&tenant.name, None);
        let forecast = |this: &Self, now: Instant| {
            let own_blocks = this.backlog[pool.0].of(&tenant.name) + pending.needed_blocks;
            let ahead = (ahead, pending.needed_blocks);
            this.forecast(pool, (&tenant, tenant.weight), own_blocks, ahead, now)
        };
        let too_late = |f: &Forecast| f.wait > max_wait.mul_f64(ENQUEUE_FORECAST_MARGIN);
        let now = Instant::now();
        let mut estimate = forecast(self, now);
        if estimate
            .as_ref()
            .is_some_and(|f| too_late(f) && f.bottleneck == Bottleneck::Kv)
            && self.refresh_estimates(pool, now)
        {
            estimate = forecast(self, now);
        }
        if let Some(late) = estimate.filter(too_late) {
            let needed_blocks = pending.needed_blocks;
            drop(pending.debit);
            let sizes = (needed_blocks, pending.ticket.max_output_tokens as u64);
            let rejection = self.saturated(&tenant, sizes, ahead.requests, late);
            return self.reject(pending.reply, rejection, &tenant);
        }
        let now = pending.enqueued_at.into_std();
        let (key, needed_blocks) = (pending.key, pending.needed_blocks);
        let output_tokens = pending.ticket.max_output_tokens as u64;
        let new = NewEntry {
            tenant: tenant.name.clone(),
            weight: tenant.weight,
            lane: pending.lane,
            tokens,
            limits: QueueLimits {
                max_requests: tenant.queue_depth,
                max_tokens: tenant.queue_tokens as u64,
            },
            enqueued_at: now,
            deadline: now + max_wait,
            payload: pending,
        };
        match self.queue.push(new) {
            Ok(id) => {
                self.keys.insert(key, id);
                self.backlog[pool.0].add(&tenant.name, needed_blocks);
                *self.queued_output.entry(tenant.name.clone()).or_default() += output_tokens;
            }
            Err((reason, pending)) => {
                drop(pending.debit);
                let rejection = Rejection::QueueFull {
                    tenant: tenant.name.clone(),
                    reason,
                    retry_after: self.queue_slot_wait(&tenant, pool, Instant::now()),
                    headers: self.limits.headers(&tenant),
                };
                self.reject(pending.reply, rejection, &tenant);
            }
        }
    }

    /// Takes an entry out of the queue (not started) and out of the counters.
    fn unqueue(&mut self, id: EntryId) -> Option<QueueEntry<Pending>> {
        let entry = self.queue.remove(id)?;
        self.forget(&entry);
        Some(entry)
    }

    /// Updates the counters for an entry that left the queue.
    fn forget(&mut self, entry: &QueueEntry<Pending>) {
        let pending = &entry.payload;
        self.keys.remove(&pending.key);
        self.backlog[pending.ticket.pool.0].remove(&entry.tenant, pending.needed_blocks);
        if let Some(queued) = self.queued_output.get_mut(&entry.tenant) {
            *queued = queued.saturating_sub(pending.ticket.max_output_tokens as u64);
            if *queued == 0 {
                self.queued_output.remove(&entry.tenant);
            }
        }
    }

    fn cancel(&mut self, key: u64) {
        if let Some(&id) = self.keys.get(&key)
            && let Some(entry) = self.unqueue(id)
        {
            count_abandoned(&entry.tenant);
        }
    }

    /// Answers every entry whose deadline has passed with `QueueTimeout` (the forecast was
    /// wrong, or capacity went elsewhere): earliest deadline first, O(log N) each.
    fn expire(&mut self, now: Instant) {
        while let Some(entry) = self.queue.pop_expired(now.into_std()) {
            self.forget(&entry);
            let QueueEntry { payload, .. } = entry;
            let tenant = Arc::clone(&payload.ticket.tenant);
            let pool = payload.ticket.pool;
            drop(payload.debit);
            if payload.reply.is_closed() {
                count_abandoned(&tenant.name);
                continue;
            }
            let estimate = self.retry_after_timeout(&tenant, pool, payload.reserved_tokens);
            let rejection = Rejection::QueueTimeout {
                tenant: tenant.name.clone(),
                waited: now.saturating_duration_since(payload.enqueued_at),
                retry_after: clamp_retry_after(estimate),
                headers: self.limits.headers(&tenant),
            };
            self.reject(payload.reply, rejection, &tenant);
        }
    }

    /// Retry-After for a request of `tenant` that timed out in `pool`'s queue needing
    /// `needed_tokens` of its capacity: a retry queues behind the tenant's entries still
    /// waiting, so the time for that much capacity (theirs and its own) to come back at the
    /// tenant's fair share of the measured drain rate. Not the whole pool's backlog and
    /// reservations: those drain for every tenant at once, and waiting for all of them told
    /// a client to come back ten times later than its turn (1 s before any drain is measured).
    fn retry_after_timeout(
        &self,
        tenant: &TenantPolicy,
        pool: PoolId,
        needed_tokens: u64,
    ) -> Duration {
        let ahead = (self.backlog[pool.0].of(&tenant.name) * self.block_size(pool)) as u64;
        let share = self.fair_share(tenant);
        self.ledger
            .time_to_drain(pool, ahead + needed_tokens)
            .map(|at_full_rate| {
                Duration::from_secs_f64((at_full_rate.as_secs_f64() / share).min(1e6))
            })
            .unwrap_or(MIN_CAPACITY_RETRY_AFTER)
    }

    /// `tenant`'s share of the engine among the tenants with queued requests (its weight over
    /// theirs), in (0, 1].
    fn fair_share(&self, tenant: &TenantPolicy) -> f64 {
        let share = f64::from(tenant.weight.get()) / self.queue.backlogged_weight().max(1) as f64;
        share.clamp(f64::MIN_POSITIVE, 1.0)
    }

    /// Refuses queued requests that the forecast says cannot start before their deadline:
    /// per backlogged tenant, its youngest entry (the one with the most of its own backlog
    /// ahead), then the next youngest while they keep failing. O(T + refused). The refusals
    /// are answered oldest first, so that their staggered Retry-Afters ([`Self::saturated`])
    /// follow their places in the queue: answered youngest first, the request at the front
    /// was told to come back last, after the whole burst, and the engine idled meanwhile.
    fn refuse_late(&mut self, now: Instant) {
        let tenants: Vec<(String, NonZeroU32)> = self
            .queue
            .backlogged_tenants()
            .map(|(tenant, weight)| (tenant.to_owned(), weight))
            .collect();
        for (tenant, weight) in tenants {
            let mut refused = Vec::new();
            while let Some(entry) = self.queue.youngest(&tenant) {
                let (id, pool) = (entry.id, entry.payload.ticket.pool);
                let left = Instant::from_std(entry.deadline).saturating_duration_since(now);
                // The weight the queue has now, the limits the entry's (reloaded) policy has.
                let policy = Arc::clone(&entry.payload.ticket.tenant);
                let own_output = entry.payload.ticket.max_output_tokens as u64;
                // The youngest: every other queued request of the tenant is ahead of it.
                let ahead = self.queued_ahead(&tenant, Some(own_output));
                let needed_blocks = entry.payload.needed_blocks;
                let forecast = |this: &Self| {
                    let own_blocks = this.backlog[pool.0].of(&tenant);
                    let ahead = (ahead, needed_blocks);
                    this.forecast(pool, (&policy, weight), own_blocks, ahead, now)
                };
                let Some(mut late) = forecast(self) else {
                    break;
                };
                if late.wait > left
                    && late.bottleneck == Bottleneck::Kv
                    && self.refresh_estimates(pool, now)
                {
                    let Some(refreshed) = forecast(self) else {
                        break;
                    };
                    late = refreshed;
                }
                if late.wait <= left {
                    break;
                }
                let Some(entry) = self.unqueue(id) else { break };
                let Pending {
                    ticket,
                    needed_blocks,
                    debit,
                    reply,
                    ..
                } = entry.payload;
                drop(debit);
                if reply.is_closed() {
                    count_abandoned(&tenant);
                    continue;
                }
                let sizes = (needed_blocks, ticket.max_output_tokens as u64);
                refused.push((reply, ticket.tenant, sizes, ahead.requests, late));
            }
            for (reply, policy, sizes, ahead, late) in refused.into_iter().rev() {
                let rejection = self.saturated(&policy, sizes, ahead, late);
                self.reject(reply, rejection, &policy);
            }
        }
    }

    /// Re-estimates the blocks every queued entry of `pool` is expected to add, against the
    /// prefix cache as it is now; true when any estimate changed (the backlog counters follow).
    ///
    /// Entries count the blocks past their prefix cached *at enqueue*. When many requests share
    /// a prompt nobody has computed yet, they all count it in full, while the running ones
    /// return only the blocks they added: the backlog stays inflated and the forecast turns
    /// pessimistic once the prompt is cached. Called only when a forecast is about to refuse
    /// a request, and it walks the queue at most once per [`REFORECAST_EVERY`] per pool, and
    /// only after the cache changed (its generation moved) — so the walk is amortised over
    /// the commands of that period instead of paid on each.
    fn refresh_estimates(&mut self, pool: PoolId, now: Instant) -> bool {
        let Some(block_pool) = self.pools.get(pool.0) else {
            return false;
        };
        let generation = block_pool.cache_generation();
        if let Some((seen, at)) = self.estimated_at[pool.0]
            && (seen == generation || now.saturating_duration_since(at) < REFORECAST_EVERY)
        {
            return false;
        }
        self.estimated_at[pool.0] = Some((generation, now));
        let block_size = block_pool.block_size() as u64;
        let backlog = &mut self.backlog[pool.0];
        let mut changed = false;
        for pending in self.queue.payloads_mut() {
            if pending.ticket.pool != pool || pending.ticket.prefix.is_none() {
                continue;
            }
            let expected =
                super::expected_new_blocks(block_pool, &pending.ticket, pending.full_blocks);
            if expected == pending.needed_blocks {
                continue;
            }
            let tenant = &pending.ticket.tenant.name;
            backlog.remove(tenant, pending.needed_blocks);
            backlog.add(tenant, expected);
            pending.needed_blocks = expected;
            pending.reserved_tokens = expected as u64 * block_size;
            changed = true;
        }
        changed
    }

    /// The refusal of a request that cannot start before its deadline, naming the limit that
    /// binds; `queued_ahead`: the tenant's requests queued before it, `max_output_tokens` its
    /// own (what its slot interval is sized by).
    fn saturated(
        &mut self,
        tenant: &TenantPolicy,
        (needed_blocks, max_output_tokens): (usize, u64),
        queued_ahead: usize,
        late: Forecast,
    ) -> Rejection {
        let headers = self.limits.headers(tenant);
        let (tenant_name, estimated_wait) = (tenant.name.clone(), late.wait);
        match late.bottleneck {
            Bottleneck::Kv => Rejection::KvSaturated {
                tenant: tenant_name,
                needed_blocks,
                estimated_wait,
                retry_after: clamp_retry_after(estimated_wait),
                headers,
            },
            Bottleneck::Concurrency => Rejection::ConcurrencySaturated {
                tenant: tenant_name,
                max_concurrency: u32::try_from(tenant.max_concurrency).unwrap_or(u32::MAX),
                queued_ahead: u32::try_from(queued_ahead).unwrap_or(u32::MAX),
                estimated_wait,
                retry_after: clamp_retry_after(self.staggered_retry(
                    tenant,
                    max_output_tokens,
                    late,
                )),
                headers,
            },
        }
    }

    /// When a request refused for its tenant's slots should come back: when its forecast says
    /// its turn would have come, but no sooner than one slot interval (its hold time ÷ the
    /// tenant's cap) after the previous such refusal's time, so a refused burst comes back
    /// spread at the pace the slots free up — and never more than the tenant's max queue wait
    /// after its own forecast. A client back within that much of its turn waits in the queue
    /// for it, so spreading wider only leaves the engine idle; and the spread must stay
    /// bounded, since refusals are no promise to return: clients that retry without waiting,
    /// or never come back, each pushed the next refusal one interval later, up to the 120 s
    /// maximum for every refusal that followed (QA: 469 refusals in a row told 120 s while
    /// the forecast said 2–5 s).
    fn staggered_retry(
        &mut self,
        tenant: &TenantPolicy,
        max_output_tokens: u64,
        late: Forecast,
    ) -> Duration {
        let now = Instant::now();
        let forecast_at = now + late.wait;
        let mut retry_at = forecast_at;
        if let Some(hold) = self.ledger.hold_for(&tenant.name, max_output_tokens) {
            let interval = hold / u32::try_from(tenant.max_concurrency.max(1)).unwrap_or(u32::MAX);
            let latest = forecast_at + self.ledger.max_queue_wait(tenant.max_queue_wait);
            let horizon = self
                .retry_horizon
                .entry(tenant.name.clone())
                .or_insert(retry_at);
            retry_at = retry_at.max((*horizon).min(latest));
            *horizon = retry_at + interval;
        }
        retry_at.saturating_duration_since(now)
    }

    /// Starts queued requests while slots and KV blocks allow.
    fn dispatch(&mut self, now: Instant) {
        if self.queue.is_empty() {
            return;
        }
        let policy = self.store.current();
        let long_cap = policy.lanes.long_max_concurrency;
        // Per pool, per lane: KV is what the fair-next request there lacks.
        let mut kv_blocked = vec![[false, false]; self.pools.len()];
        loop {
            let candidate = {
                let in_flight = self.ledger.in_flight();
                self.queue
                    .peek_next(|entry| {
                        let pool = entry.payload.ticket.pool;
                        !kv_blocked[pool.0][lane_index(entry.lane)]
                            && in_flight.may_start(
                                &entry.tenant,
                                entry.payload.ticket.tenant.max_concurrency,
                                pool,
                                entry.lane,
                                long_cap,
                            )
                    })
                    .map(|entry| Candidate::of(entry, now, &self.ledger))
            };
            let Some(candidate) = candidate else { break };
            if candidate.abandoned {
                // Its client left (its `admit` future was dropped before it withdrew).
                if let Some(entry) = self.unqueue(candidate.id) {
                    count_abandoned(&entry.tenant);
                }
                continue;
            }
            let pool = &self.pools[candidate.pool.0];
            let limit_blocks =
                watermark_limit(self.usable_blocks(candidate.pool), policy.kv.high_watermark);
            // Lookup, pin and reservation are one step in the pool: a cached prefix found
            // here cannot be evicted before the engine schedules the request.
            let reserved = match &candidate.prefix {
                Some(prefix) => pool.try_reserve_prefix_within(
                    candidate.full_blocks,
                    limit_blocks,
                    &prefix.salt,
                    &prefix.prompt_ids,
                ),
                None => pool.try_reserve_within(candidate.full_blocks, limit_blocks),
            };
            match reserved {
                Some(reservation) => self.grant(candidate.id, reservation, now),
                None if candidate.waited >= candidate.max_wait / 2 => {
                    kv_blocked[candidate.pool.0] = [true, true];
                }
                None => kv_blocked[candidate.pool.0][lane_index(candidate.lane)] = true,
            }
        }
    }

    /// Moves a queued entry into a running [`Admitted`] and hands it to its caller.
    fn grant(&mut self, id: EntryId, reservation: Reservation, now: Instant) {
        let Some(entry) = self.queue.start(id) else {
            return;
        };
        self.forget(&entry);
        let QueueEntry { payload, lane, .. } = entry;
        let Pending {
            ticket,
            debit,
            enqueued_at,
            reply,
            ..
        } = payload;
        // What it really adds to the pool: the blocks reserved now (the prefix pinned with
        // them is shared or was cached, and is counted as used by the pool).
        let reserved_blocks = reservation.blocks();
        let reserved_tokens = (reserved_blocks * self.block_size(ticket.pool)) as u64;
        tracing::debug!(
            tenant = %ticket.tenant.name,
            queued = ?now.saturating_duration_since(enqueued_at),
            blocks = reserved_blocks,
            "admission grant"
        );
        let admitted = Admitted {
            headers: debit.headers(),
            tenant: ticket.tenant,
            pool: ticket.pool,
            lane,
            request_id: ticket.request_id,
            prompt_tokens: ticket.prompt_tokens,
            max_output_tokens: ticket.max_output_tokens,
            reserved_blocks,
            reserved_tokens,
            queue_wait: now.saturating_duration_since(enqueued_at),
            started_at: now,
            stage: Stage::Admitted,
            reported_output: 0,
            reservation: Some(reservation),
            debit: Some(debit),
            ledger: Arc::clone(&self.ledger),
        };
        self.ledger
            .record_grant(&admitted.tenant.name, enqueued_at, now);
        self.ledger.start(
            &admitted.tenant.name,
            admitted.pool,
            lane,
            admitted.footprint(),
            now,
        );
        // If the client left since the last purge, the guard comes back and drops here: it still
        // holds its reservation, so slot, blocks and the whole debit are returned, once.
        let _ = reply.send(Ok(admitted));
    }

    fn reject(
        &self,
        reply: oneshot::Sender<Result<Admitted, Rejection>>,
        rejection: Rejection,
        tenant: &TenantPolicy,
    ) {
        rejection.count(&tenant.name);
        let _ = reply.send(Err(rejection));
    }

    /// The forecast wait of a queued request of `tenant` with `ahead` of the tenant's requests
    /// before it, in `pool` with `own_blocks` of the tenant's queued blocks up to and including
    /// it (and `needed_blocks` its own): the
    /// longer of what KV ([`Dispatcher::kv_wait`]) and the tenant's concurrency cap
    /// ([`Ledger::slot_forecast`]) make it wait, and which of the two that is. `None` while
    /// neither can be forecast.
    /// `weight` is the tenant's weight in the fair queue (the queue's own, for a queued entry).
    fn forecast(
        &self,
        pool: PoolId,
        (tenant, weight): (&TenantPolicy, NonZeroU32),
        own_blocks: usize,
        (ahead, needed_blocks): (QueuedAhead, usize),
        now: Instant,
    ) -> Option<Forecast> {
        let kv = self.kv_wait(pool, &tenant.name, weight, own_blocks);
        // The fair queue serves a tenant's own requests oldest first, so only its own queue is
        // ahead of it for its own slots.
        let slot = self
            .ledger
            .slot_forecast(&tenant.name, tenant.max_concurrency, ahead, now)
            .map(|slot| {
                // A freed slot is not taken at once while KV is contended: each grant on the
                // way waits for the tenant's turn at the blocks, as long as its grants have
                // waited of late. The slot forecast leaves those waits out and the KV one
                // counts them as if they ran alongside the holds, not one after the other, so
                // a low-weight tenant with a small cap was forecast to start long before it
                // did and got a 503 at its deadline instead of an early 429 (QA: gamma, cap 1,
                // behind alpha and beta at weights 3 and 2 in a full cache).
                let turn = self.ledger.grant_wait(&tenant.name).unwrap_or_default();
                slot.wait.saturating_add(turn.saturating_mul(slot.grants))
            });
        let held = self.held_by_slots(pool, tenant, needed_blocks);
        let forecast = Forecast::binding(kv, slot, held);
        tracing::debug!(
            tenant = %tenant.name,
            ahead = ahead.requests,
            own_blocks,
            ?kv,
            ?slot,
            held,
            ?forecast,
            "admission forecast"
        );
        forecast
    }

    /// Whether `tenant`'s concurrency cap is what keeps a request needing `needed_blocks`
    /// from starting now: the tenant has no free slot, and `pool` has the blocks.
    fn held_by_slots(&self, pool: PoolId, tenant: &TenantPolicy, needed_blocks: usize) -> bool {
        let running = self.ledger.in_flight().running(&tenant.name);
        running >= tenant.max_concurrency && self.available_blocks(pool) >= needed_blocks
    }

    /// The tenant's queued requests, less `own` (the max_tokens of a queued request being
    /// forecast) when it is one of them: what is ahead of it, or of a new one. O(1).
    fn queued_ahead(&self, tenant: &str, own: Option<u64>) -> QueuedAhead {
        let requests = self.queue.queued_requests(tenant);
        let output_tokens = self.queued_output.get(tenant).copied().unwrap_or(0);
        match own {
            Some(own) => QueuedAhead {
                requests: requests.saturating_sub(1),
                output_tokens: output_tokens.saturating_sub(own),
            },
            None => QueuedAhead {
                requests,
                output_tokens,
            },
        }
    }

    /// The forecast wait of a request of `tenant` in `pool` with `own_blocks` of the tenant's
    /// queued blocks up to and including it: the capacity that must come back before the fair
    /// queue reaches it — its own backlog plus the others' fair share of the same time (see
    /// the module docs) — at the pool's drain rate. Zero when that fits now; `None` when the
    /// pool has no rate to forecast with yet.
    pub(super) fn kv_wait(
        &self,
        pool: PoolId,
        tenant: &str,
        weight: NonZeroU32,
        own_blocks: usize,
    ) -> Option<Duration> {
        let occupancy = self.pools.get(pool.0)?.snapshot();
        let available = self.available_in(pool, &occupancy);
        let backlog = &self.backlog[pool.0];
        let mut demand = own_blocks;
        if backlog.blocks > backlog.of(tenant) {
            for (other, other_weight) in self.queue.backlogged_tenants() {
                if other == tenant {
                    continue;
                }
                let share =
                    own_blocks as u128 * u128::from(other_weight.get()) / u128::from(weight.get());
                let share = usize::try_from(share).unwrap_or(usize::MAX);
                demand = demand.saturating_add(backlog.of(other).min(share));
            }
        }
        if demand <= available {
            return Some(Duration::ZERO);
        }
        let deficit_tokens = (demand - available).saturating_mul(occupancy.block_size);
        self.ledger.kv_drain_time(pool, deficit_tokens as u64)
    }

    /// The blocks of `pool` a request could reserve now: free, and under the watermark.
    fn available_blocks(&self, pool: PoolId) -> usize {
        self.pools.get(pool.0).map_or(0, |block_pool| {
            self.available_in(pool, &block_pool.snapshot())
        })
    }

    /// [`Dispatcher::available_blocks`] of `pool` at `occupancy`.
    fn available_in(&self, pool: PoolId, occupancy: &Occupancy) -> usize {
        let policy = self.store.current();
        let limit = watermark_limit(self.usable_blocks(pool), policy.kv.high_watermark);
        let committed = occupancy.used_blocks + occupancy.reserved_blocks;
        limit.saturating_sub(committed).min(occupancy.free_blocks)
    }

    /// The blocks of `pool` admission may fill now (an upstream's ejected replicas' share is
    /// withdrawn): the base of the watermark, for dispatch and forecasts alike.
    fn usable_blocks(&self, pool: PoolId) -> usize {
        self.usable
            .get(pool.0)
            .map_or(0, |limit| limit.usable_blocks())
    }

    fn block_size(&self, pool: PoolId) -> usize {
        self.pools
            .get(pool.0)
            .map_or(1, |p| p.snapshot().block_size)
    }

    /// Estimated time until the tenant's queue has room again: one of its average entries
    /// served at its fair share of the engine. In order of preference:
    ///
    /// 1. the measured drain rate of `pool` (the refused request's): the entry's KV capacity
    ///    (prompt + max_tokens) coming back;
    /// 2. before a drain rate exists (the first completions), and only for the embedded
    ///    engine's pool, the engine's per-token service time: the entry's max_tokens generated
    ///    one per step, the steps shared by every running sequence (the same fluid model as 1,
    ///    in tokens generated instead of capacity returned; prefill is left out, it is a small
    ///    part of a request's time);
    /// 3. before the engine has timed a step: how long the tenant's oldest queued entry has
    ///    waited. The queue has not moved for that long, so a retry sooner would likely find
    ///    it still full.
    ///
    /// Always within [1 s, 120 s].
    fn queue_slot_wait(&self, tenant: &TenantPolicy, pool: PoolId, now: Instant) -> Duration {
        let Some(backlog) = self.queue.tenant_backlog(&tenant.name) else {
            return MIN_CAPACITY_RETRY_AFTER;
        };
        let Some(count) = NonZeroU64::new(backlog.requests as u64) else {
            return MIN_CAPACITY_RETRY_AFTER;
        };
        let queued_output = self.queued_output.get(&tenant.name).copied().unwrap_or(0);
        let average_entry = backlog.tokens / count;
        let average_output = queued_output / count;
        let share = self.fair_share(tenant);
        let measured = self.ledger.time_to_drain(pool, average_entry);
        let prior = || {
            if pool != PoolId::LOCAL {
                return None;
            }
            let per_token = self.ledger.per_token_service_time(pool)?;
            Some(per_token.mul_f64(average_output as f64))
        };
        let oldest_wait = || {
            let oldest = self.queue.oldest(&tenant.name).map(|e| e.enqueued_at);
            oldest.map_or(Duration::ZERO, |at| {
                now.into_std().saturating_duration_since(at)
            })
        };
        let estimate = match measured.or_else(prior) {
            // A share may be tiny; keep the division finite before clamping.
            Some(at_full_rate) => {
                Duration::from_secs_f64((at_full_rate.as_secs_f64() / share).min(1e6))
            }
            None => oldest_wait(),
        };
        clamp_retry_after(estimate)
    }
}

/// The upkeep task: runs a step whenever something may let a queued request start or must
/// refuse one (see the module docs), until `closed` says every [`super::Admission`] handle is
/// gone. Queued requests then get `Unavailable` (their reply channels close).
pub(super) async fn run(core: Arc<Core>, mut closed: mpsc::Receiver<std::convert::Infallible>) {
    let (ledger, store) = {
        let dispatcher = core.dispatcher.lock();
        (Arc::clone(&dispatcher.ledger), dispatcher.store.clone())
    };
    let mut wakers = Wakers {
        closed: &mut closed,
        policy_updates: store.subscribe(),
    };
    loop {
        // Read each time: a reload may add a pool (it wakes this task through `changed`).
        let pools = Arc::clone(core.dispatcher.lock().pools());
        let busy = {
            // Register for wake-ups *before* looking at the state, so a release that happens
            // while the step runs is not missed (a pool notifies only current waiters). They
            // stay registered while the timer is re-armed in `wait_busy`.
            let mut freed: Vec<_> = pools
                .iter()
                .map(|pool| Box::pin(pool.freed().notified()))
                .collect();
            for notified in &mut freed {
                notified.as_mut().enable();
            }
            let freed = any_notified(freed);
            let released = ledger.released.notified();
            tokio::pin!(freed, released);
            released.as_mut().enable();

            match step_now(&core) {
                Some(wake_at) => {
                    let releases = Releases {
                        freed: freed.as_mut(),
                        released: released.as_mut(),
                    };
                    Some(
                        wakers
                            .wait_busy(&core, pools.len(), wake_at, releases)
                            .await,
                    )
                }
                None => None,
            }
        };
        // With nothing queued, the registrations above are gone (the block dropped them).
        let woke = match busy {
            Some(woke) => woke,
            None => wakers.wait_idle(&core).await,
        };
        if let Woke::Closed = woke {
            // Every handle is gone: drop the queue now (its reply channels close).
            drop(std::mem::take(&mut core.dispatcher.lock().queue));
            return;
        }
    }
}

/// Why the upkeep task stopped waiting.
enum Woke {
    /// Something may start or time out: step again.
    Step,
    /// Every [`super::Admission`] handle is gone.
    Closed,
}

/// Runs one step; `Some(next planned wake-up)` while requests stay queued, `None` once the
/// queue is empty.
fn step_now(core: &Core) -> Option<Option<Instant>> {
    let mut dispatcher = core.dispatcher.lock();
    #[cfg(test)]
    {
        dispatcher.step_requested = false;
    }
    let now = Instant::now();
    dispatcher.step(now);
    let wake_at = dispatcher.plan_wake(now);
    (!dispatcher.queue.is_empty()).then_some(wake_at)
}

/// The wake-ups that matter only while something is queued: blocks freed in a pool, and
/// concurrency slots released. Registered before the step that decided to wait for them.
struct Releases<'a, F, R> {
    freed: Pin<&'a mut F>,
    released: Pin<&'a mut R>,
}

/// The wake-ups the upkeep task always listens for.
struct Wakers<'a> {
    closed: &'a mut mpsc::Receiver<std::convert::Infallible>,
    policy_updates: tokio::sync::watch::Receiver<Arc<Policy>>,
}

impl Wakers<'_> {
    /// Waits while requests are queued: for a release, a reload, the planned wake-up (a
    /// deadline or a forecast), or the end. `pools`: how many pools the releases watch.
    async fn wait_busy<F, R>(
        &mut self,
        core: &Core,
        pools: usize,
        mut wake_at: Option<Instant>,
        mut releases: Releases<'_, F, R>,
    ) -> Woke
    where
        F: Future<Output = ()>,
        R: Future<Output = ()>,
    {
        loop {
            let changed = core.changed.notified();
            let wake = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                None = self.closed.recv() => return Woke::Closed,
                () = releases.freed.as_mut() => return Woke::Step,
                () = releases.released.as_mut() => return Woke::Step,
                Ok(()) = self.policy_updates.changed() => {
                    core.dispatcher.lock().apply_reload();
                    return Woke::Step;
                }
                () = wake => return Woke::Step,
                () = changed => {
                    // A caller's step needs an earlier wake-up than planned: re-arm the timer,
                    // no step (the caller's did the work).
                    let mut dispatcher = core.dispatcher.lock();
                    if dispatcher.pools().len() != pools {
                        // A pool was added: watch its freed blocks too (from the top).
                        return Woke::Step;
                    }
                    #[cfg(test)]
                    if dispatcher.step_requested {
                        return Woke::Step;
                    }
                    wake_at = dispatcher.plan_wake(Instant::now());
                }
            }
        }
    }

    /// Waits while nothing is queued. Freed blocks and released slots cannot start anything
    /// then, so they are not listened to, or every finished request would wake this task for
    /// a step with nothing to do. A caller that leaves an entry queued wakes it (`submit`
    /// answers true: the empty queue had no wake-up planned), and the step after registering
    /// again sees every release since.
    async fn wait_idle(&mut self, core: &Core) -> Woke {
        tokio::select! {
            biased;
            None = self.closed.recv() => Woke::Closed,
            Ok(()) = self.policy_updates.changed() => {
                core.dispatcher.lock().apply_reload();
                Woke::Step
            }
            () = core.changed.notified() => Woke::Step,
        }
    }
}

/// Why a reload refuses a queued request: a rejection known at once, or one about the queue's
/// bounds, whose headers and Retry-After are read once the queue has been rewritten (the
/// rewrite holds the queue).
enum Refusal {
    Now(Rejection),
    /// Bigger than the tenant's whole `queue_tokens`.
    NeverQueues {
        requested: u64,
        limit: u64,
    },
    QueueFull(QueueFull),
}

/// What dispatch needs from the fair-queue candidate (copied so the queue can be mutated).
struct Candidate {
    id: EntryId,
    /// The client went away (its `admit` future was dropped).
    abandoned: bool,
    pool: PoolId,
    lane: Lane,
    full_blocks: usize,
    prefix: Option<PromptPrefix>,
    waited: Duration,
    max_wait: Duration,
}

impl Candidate {
    fn of(entry: &QueueEntry<Pending>, now: Instant, ledger: &Ledger) -> Candidate {
        Candidate {
            id: entry.id,
            abandoned: entry.payload.reply.is_closed(),
            pool: entry.payload.ticket.pool,
            lane: entry.lane,
            full_blocks: entry.payload.full_blocks,
            prefix: entry.payload.ticket.prefix.clone(),
            waited: now.saturating_duration_since(entry.payload.enqueued_at),
            max_wait: ledger.max_queue_wait(entry.payload.ticket.tenant.max_queue_wait),
        }
    }
}

/// Resolves when any of the (already enabled) `freed` notifications fires.
async fn any_notified(freed: Vec<Pin<Box<tokio::sync::futures::Notified<'_>>>>) {
    if freed.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(freed).await;
}

/// A queued request whose client went away; its debit was refunded when it dropped.
fn count_abandoned(tenant: &str) {
    metrics::counter!(QUEUE_ABANDONED_TOTAL, "tenant" => tenant.to_string()).increment(1);
}

fn lane_index(lane: Lane) -> usize {
    match lane {
        Lane::Short => 0,
        Lane::Long => 1,
    }
}

/// Re-checks a queued request under a reloaded policy and updates it (tenant policy, blocks
/// needed, lane); the tenant's new policy, or the rejection it now gets.
fn requeue(
    policy: &Policy,
    pools: &[Arc<BlockPool>],
    pending: &mut Pending,
) -> Result<Arc<TenantPolicy>, Rejection> {
    // The credential must still choose the same tenant: a tenant removed, its key rotated or
    // moved to another tenant, or anonymous access withdrawn all refuse the queued request as
    // they would refuse it now at the door.
    let revoked = || Rejection::KeyRevoked {
        tenant: pending.ticket.tenant.name.clone(),
    };
    let tenant =
        crate::auth::tenant_for(policy, &pending.ticket.credential).map_err(|_| revoked())?;
    if tenant.name != pending.ticket.tenant.name {
        return Err(revoked());
    }
    let Some(pool) = pools.get(pending.ticket.pool.0) else {
        return Err(Rejection::Unavailable);
    };
    let occupancy = pool.snapshot();
    let (prompt, output) = (
        pending.ticket.prompt_tokens,
        pending.ticket.max_output_tokens,
    );
    check_tenant_lengths(&tenant, prompt, output, pending.ticket.prompt_param)?;
    let fit = super::check_fit(&policy.kv, &occupancy, &pending.ticket)?;
    pending.full_blocks = fit.needed_blocks;
    pending.needed_blocks = super::expected_new_blocks(pool, &pending.ticket, fit.needed_blocks);
    pending.reserved_tokens = (pending.needed_blocks * occupancy.block_size) as u64;
    pending.lane = super::lane_of(policy, prompt);
    pending.ticket.tenant = Arc::clone(&tenant);
    Ok(tenant)
}

/// The tenant's input, output and total length limits, as validation applies them (a reload
/// may have lowered them below a queued request). The error names the ticket's prompt field
/// (`what`), as validation would.
fn check_tenant_lengths(
    tenant: &TenantPolicy,
    prompt: usize,
    output: usize,
    what: &'static str,
) -> Result<(), Rejection> {
    let clip = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let (prompt_tokens, max_tokens) = (clip(prompt), clip(output));
    let error = if prompt_tokens > clip(tenant.max_input_tokens) {
        ValidationError::InputTooLong {
            prompt_tokens,
            limit: clip(tenant.max_input_tokens),
            what,
        }
    } else if max_tokens > clip(tenant.max_output_tokens) {
        // Validation would refuse the same budget now; a request that took the old default is
        // refused too (its budget is already part of its reservation and debit).
        ValidationError::MaxTokensTooLarge {
            param: "max_tokens",
            given: i64::from(max_tokens),
            limit: clip(tenant.max_output_tokens),
            limit_name: "This tenant's policy",
        }
    } else if u64::from(prompt_tokens) + u64::from(max_tokens) > tenant.max_total_tokens as u64 {
        ValidationError::ContextLengthExceeded {
            prompt_tokens,
            max_tokens,
            limit: clip(tenant.max_total_tokens),
            limit_name: "tenant's maximum total length",
            what,
        }
    } else {
        return Ok(());
    };
    Err(Rejection::OverTenantLimit {
        tenant: tenant.name.clone(),
        error,
    })
}

//! The admission actor: one task owns the fair queue and decides, step by step, which queued
//! request starts next. It wakes when a request arrives or is cancelled, when a running request
//! releases its slot, when the block pool returns blocks, and when a queue deadline passes;
//! each wake-up expires, purges and dispatches. (A policy reload also wakes it, to forget the
//! rate-limit state of removed tenants.)
//!
//! Dispatch takes the fair-queue candidate and asks its pool to reserve its blocks atomically
//! under the watermark. If that fails, KV is the bottleneck for that lane of that pool and the
//! lane stops there (the fair-next request must get the blocks first, or it would starve behind
//! smaller ones); the other lane, and every other pool, may go on. Once the blocked request has
//! waited half its `max_queue_wait`, both lanes of its pool stop so freed blocks accumulate for
//! it.

use std::num::NonZeroU64;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kvgate_runtime::block_pool::{BlockPool, Reservation};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::ledger::Ledger;
use super::rejection::{Rejection, clamp_retry_after};
use super::{AdmissionTicket, Admitted, MIN_CAPACITY_RETRY_AFTER, PoolId, watermark_limit};
use crate::metrics::QUEUE_ABANDONED_TOTAL;
use crate::policy::TenantPolicy;
use crate::queue::{EntryId, FairQueue, Lane, NewEntry, QueueEntry, QueueLimits};
use crate::ratelimit::{Debit, RateLimits};
use crate::reload::PolicyStore;

pub(super) enum Command {
    Enqueue(Pending),
    /// The `admit` future with this key was dropped.
    Cancel(u64),
}

/// A request waiting in the queue.
pub(super) struct Pending {
    pub key: u64,
    pub ticket: AdmissionTicket,
    pub lane: Lane,
    pub needed_blocks: usize,
    /// `needed_blocks × block_size`: the KV capacity it will hold while running.
    pub reserved_tokens: u64,
    pub debit: Debit,
    pub enqueued_at: Instant,
    pub reply: oneshot::Sender<Result<Admitted, Rejection>>,
}

pub(super) struct Dispatcher {
    commands: mpsc::Receiver<Command>,
    store: PolicyStore,
    /// Indexed by [`PoolId`].
    pools: Arc<[Arc<BlockPool>]>,
    limits: Arc<RateLimits>,
    ledger: Arc<Ledger>,
    queue: FairQueue<Pending>,
}

impl Dispatcher {
    pub fn new(
        commands: mpsc::Receiver<Command>,
        store: PolicyStore,
        pools: Arc<[Arc<BlockPool>]>,
        limits: Arc<RateLimits>,
        ledger: Arc<Ledger>,
    ) -> Dispatcher {
        Dispatcher {
            commands,
            store,
            pools,
            limits,
            ledger,
            queue: FairQueue::new(),
        }
    }

    /// Runs until every [`super::Admission`] handle is gone. Queued requests then get
    /// `Unavailable` (their reply channels close).
    pub async fn run(mut self) {
        let pools = Arc::clone(&self.pools);
        let ledger = Arc::clone(&self.ledger);
        let mut policy_updates = self.store.subscribe();
        loop {
            // Register for wake-ups *before* looking at the state, so a release that happens
            // while dispatching is not missed (a pool notifies only current waiters).
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

            let now = Instant::now();
            self.expire(now);
            self.purge_abandoned();
            self.dispatch(now);
            self.ledger.publish(self.queue.backlogs());

            let deadline = self.queue.next_deadline().map(Instant::from_std);
            let deadline_passes = async {
                match deadline {
                    Some(deadline) => tokio::time::sleep_until(deadline).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                command = self.commands.recv() => match command {
                    Some(Command::Enqueue(pending)) => self.enqueue(pending),
                    Some(Command::Cancel(key)) => self.cancel(key),
                    None => break,
                },
                () = &mut freed => {}
                () = &mut released => {}
                Ok(()) = policy_updates.changed() => self.forget_removed_tenants(),
                () = deadline_passes => {}
            }
        }
    }

    /// After a reload, drops rate-limit state of tenants the policy no longer has.
    fn forget_removed_tenants(&self) {
        let policy = self.store.current();
        self.limits.retain(|tenant| policy.tenant(tenant).is_some());
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
        if let Some(estimated_wait) =
            self.kv_backlog_wait(pending.ticket.pool, pending.needed_blocks)
            && estimated_wait > tenant.max_queue_wait
        {
            let needed_blocks = pending.needed_blocks;
            drop(pending.debit);
            let rejection = Rejection::KvSaturated {
                tenant: tenant.name.clone(),
                needed_blocks,
                estimated_wait,
                retry_after: clamp_retry_after(estimated_wait),
                headers: self.limits.headers(&tenant),
            };
            return self.reject(pending.reply, rejection, &tenant);
        }
        let now = pending.enqueued_at.into_std();
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
            deadline: now + tenant.max_queue_wait,
            payload: pending,
        };
        if let Err((reason, pending)) = self.queue.push(new) {
            drop(pending.debit);
            let rejection = Rejection::QueueFull {
                tenant: tenant.name.clone(),
                reason,
                retry_after: self.queue_slot_wait(&tenant, pending.ticket.pool, Instant::now()),
                headers: self.limits.headers(&tenant),
            };
            self.reject(pending.reply, rejection, &tenant);
        }
    }

    fn cancel(&mut self, key: u64) {
        for entry in self.queue.remove_where(|entry| entry.payload.key == key) {
            count_abandoned(&entry.tenant);
        }
    }

    /// Answers every entry whose deadline has passed with `QueueTimeout`.
    fn expire(&mut self, now: Instant) {
        let now_std = now.into_std();
        for entry in self.queue.remove_where(|entry| entry.deadline <= now_std) {
            let QueueEntry { payload, .. } = entry;
            let tenant = Arc::clone(&payload.ticket.tenant);
            let pool = payload.ticket.pool;
            drop(payload.debit);
            let queued_tokens: u64 = self
                .queue
                .entries()
                .filter(|entry| entry.payload.ticket.pool == pool)
                .map(|entry| entry.tokens)
                .sum();
            let backlog_tokens = queued_tokens + self.ledger.in_flight().reserved_tokens(pool);
            let estimate = self
                .ledger
                .time_to_drain(pool, backlog_tokens)
                .unwrap_or(MIN_CAPACITY_RETRY_AFTER);
            let rejection = Rejection::QueueTimeout {
                tenant: tenant.name.clone(),
                waited: now.saturating_duration_since(payload.enqueued_at),
                retry_after: clamp_retry_after(estimate),
                headers: self.limits.headers(&tenant),
            };
            self.reject(payload.reply, rejection, &tenant);
        }
    }

    /// Drops entries whose client is gone (their `admit` future was dropped).
    fn purge_abandoned(&mut self) {
        for entry in self
            .queue
            .remove_where(|entry| entry.payload.reply.is_closed())
        {
            count_abandoned(&entry.tenant);
        }
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
                    .map(|entry| Candidate::of(entry, now))
            };
            let Some(candidate) = candidate else { break };
            let pool = &self.pools[candidate.pool.0];
            let limit_blocks = watermark_limit(pool.total_blocks(), policy.kv.high_watermark);
            match pool.try_reserve_within(candidate.needed_blocks, limit_blocks) {
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
        let Some(QueueEntry { payload, lane, .. }) = self.queue.start(id) else {
            return;
        };
        let Pending {
            ticket,
            needed_blocks,
            reserved_tokens,
            debit,
            enqueued_at,
            reply,
            ..
        } = payload;
        self.ledger
            .start(&ticket.tenant.name, ticket.pool, lane, reserved_tokens);
        let admitted = Admitted {
            headers: debit.headers(),
            tenant: ticket.tenant,
            pool: ticket.pool,
            lane,
            request_id: ticket.request_id,
            prompt_tokens: ticket.prompt_tokens,
            reserved_blocks: needed_blocks,
            reserved_tokens,
            queue_wait: now.saturating_duration_since(enqueued_at),
            completion_tokens: None,
            started_elsewhere: false,
            reservation: Some(reservation),
            debit: Some(debit),
            ledger: Arc::clone(&self.ledger),
        };
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

    /// When KV blocks of `pool` are what this request lacks now: the estimated time until
    /// enough capacity is returned for the queue ahead of it (in that pool) and itself. `None`
    /// when blocks are available now or there is no drain-rate data for the pool yet.
    fn kv_backlog_wait(&self, pool: PoolId, needed_blocks: usize) -> Option<Duration> {
        let policy = self.store.current();
        let occupancy = self.pools.get(pool.0)?.snapshot();
        let limit = watermark_limit(occupancy.total_blocks, policy.kv.high_watermark);
        let committed = occupancy.used_blocks + occupancy.reserved_blocks;
        let available = limit.saturating_sub(committed).min(occupancy.free_blocks);
        if needed_blocks <= available {
            return None;
        }
        let queued_blocks: usize = self
            .queue
            .entries()
            .filter(|entry| entry.payload.ticket.pool == pool)
            .map(|entry| entry.payload.needed_blocks)
            .sum();
        let deficit_blocks = queued_blocks + needed_blocks - available;
        self.ledger
            .time_to_drain(pool, (deficit_blocks * occupancy.block_size) as u64)
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
        let entries: Vec<&Pending> = self
            .queue
            .entries()
            .filter(|entry| entry.tenant == tenant.name)
            .map(|entry| &entry.payload)
            .collect();
        let Some(count) = NonZeroU64::new(entries.len() as u64) else {
            return MIN_CAPACITY_RETRY_AFTER;
        };
        let total = |tokens: fn(&AdmissionTicket) -> usize| -> u64 {
            entries.iter().map(|p| tokens(&p.ticket) as u64).sum()
        };
        let average_entry = total(|t| t.prompt_tokens.saturating_add(t.max_output_tokens)) / count;
        let average_output = total(|t| t.max_output_tokens) / count;
        let share = f64::from(tenant.weight.get()) / self.queue.backlogged_weight().max(1) as f64;
        let share = share.clamp(f64::MIN_POSITIVE, 1.0);
        let measured = self.ledger.time_to_drain(pool, average_entry);
        let prior = || {
            if pool != PoolId::LOCAL {
                return None;
            }
            let per_token = self.ledger.per_token_service_time()?;
            Some(per_token.mul_f64(average_output as f64))
        };
        let oldest_wait = || {
            let oldest = entries.iter().map(|p| p.enqueued_at).min();
            oldest.map_or(Duration::ZERO, |at| now.saturating_duration_since(at))
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

/// What dispatch needs from the fair-queue candidate (copied so the queue can be mutated).
struct Candidate {
    id: EntryId,
    pool: PoolId,
    lane: Lane,
    needed_blocks: usize,
    waited: Duration,
    max_wait: Duration,
}

impl Candidate {
    fn of(entry: &QueueEntry<Pending>, now: Instant) -> Candidate {
        Candidate {
            id: entry.id,
            pool: entry.payload.ticket.pool,
            lane: entry.lane,
            needed_blocks: entry.payload.needed_blocks,
            waited: now.saturating_duration_since(entry.payload.enqueued_at),
            max_wait: entry.payload.ticket.tenant.max_queue_wait,
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

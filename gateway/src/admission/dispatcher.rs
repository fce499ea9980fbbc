//! The admission actor: one task owns the fair queue and decides, step by step, which queued
//! request starts next. It wakes when a request arrives or is cancelled, when a running request
//! releases its slot, when the block pool returns blocks, and when a queue deadline passes;
//! each wake-up expires, purges and dispatches. (A policy reload also wakes it, to forget the
//! rate-limit state of removed tenants.)
//!
//! Dispatch takes the fair-queue candidate and asks the pool to reserve its blocks atomically
//! under the watermark. If that fails, KV is the bottleneck for that lane and the lane stops
//! (the fair-next request must get the blocks first, or it would starve behind smaller ones);
//! the other lane may go on. Once the blocked request has waited half its `max_queue_wait`,
//! both lanes stop so freed blocks accumulate for it.

use std::sync::Arc;
use std::time::Duration;

use kvgate_runtime::block_pool::{BlockPool, Reservation};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::ledger::Ledger;
use super::rejection::{Rejection, clamp_retry_after};
use super::{AdmissionTicket, Admitted, MIN_CAPACITY_RETRY_AFTER, watermark_limit};
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
    pool: Arc<BlockPool>,
    limits: Arc<RateLimits>,
    ledger: Arc<Ledger>,
    queue: FairQueue<Pending>,
}

impl Dispatcher {
    pub fn new(
        commands: mpsc::Receiver<Command>,
        store: PolicyStore,
        pool: Arc<BlockPool>,
        limits: Arc<RateLimits>,
        ledger: Arc<Ledger>,
    ) -> Dispatcher {
        Dispatcher {
            commands,
            store,
            pool,
            limits,
            ledger,
            queue: FairQueue::new(),
        }
    }

    /// Runs until every [`super::Admission`] handle is gone. Queued requests then get
    /// `Unavailable` (their reply channels close).
    pub async fn run(mut self) {
        let pool = Arc::clone(&self.pool);
        let ledger = Arc::clone(&self.ledger);
        let mut policy_updates = self.store.subscribe();
        loop {
            // Register for wake-ups *before* looking at the state, so a release that happens
            // while dispatching is not missed (the pool notifies only current waiters).
            let freed = pool.freed().notified();
            let released = ledger.released.notified();
            tokio::pin!(freed, released);
            freed.as_mut().enable();
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
        if let Some(estimated_wait) = self.kv_backlog_wait(pending.needed_blocks)
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
            tokens: pending
                .ticket
                .prompt_tokens
                .saturating_add(pending.ticket.max_output_tokens) as u64,
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
                retry_after: self.queue_slot_wait(&tenant),
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
            drop(payload.debit);
            let backlog_tokens =
                self.queue.queued_tokens() + self.ledger.in_flight().reserved_tokens;
            let estimate = self
                .ledger
                .time_to_drain(backlog_tokens)
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
        let limit_blocks = watermark_limit(self.pool.total_blocks(), policy.kv.high_watermark);
        let mut kv_blocked = [false, false];
        loop {
            let candidate = {
                let in_flight = self.ledger.in_flight();
                self.queue
                    .peek_next(|entry| {
                        !kv_blocked[lane_index(entry.lane)]
                            && in_flight.may_start(
                                &entry.tenant,
                                entry.payload.ticket.tenant.max_concurrency,
                                entry.lane,
                                long_cap,
                            )
                    })
                    .map(|entry| Candidate::of(entry, now))
            };
            let Some(candidate) = candidate else { break };
            match self
                .pool
                .try_reserve_within(candidate.needed_blocks, limit_blocks)
            {
                Some(reservation) => self.grant(candidate.id, reservation, now),
                None if candidate.waited >= candidate.max_wait / 2 => break,
                None => kv_blocked[lane_index(candidate.lane)] = true,
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
            .start(&ticket.tenant.name, lane, reserved_tokens);
        let admitted = Admitted {
            headers: debit.headers(),
            tenant: ticket.tenant,
            lane,
            request_id: ticket.request_id,
            prompt_tokens: ticket.prompt_tokens,
            reserved_blocks: needed_blocks,
            reserved_tokens,
            queue_wait: now.saturating_duration_since(enqueued_at),
            completion_tokens: None,
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

    /// When KV blocks are what this request lacks now: the estimated time until enough
    /// capacity is returned for the queue ahead of it and itself. `None` when blocks are
    /// available now or there is no drain-rate data yet.
    fn kv_backlog_wait(&self, needed_blocks: usize) -> Option<Duration> {
        let policy = self.store.current();
        let occupancy = self.pool.snapshot();
        let limit = watermark_limit(occupancy.total_blocks, policy.kv.high_watermark);
        let committed = occupancy.used_blocks + occupancy.reserved_blocks;
        let available = limit.saturating_sub(committed).min(occupancy.free_blocks);
        if needed_blocks <= available {
            return None;
        }
        let queued_blocks: usize = self
            .queue
            .entries()
            .map(|entry| entry.payload.needed_blocks)
            .sum();
        let deficit_blocks = queued_blocks + needed_blocks - available;
        self.ledger
            .time_to_drain((deficit_blocks * occupancy.block_size) as u64)
    }

    /// Estimated time until the tenant's queue has room again: one of its average entries
    /// served at its fair share of the drain rate. 1 s without data.
    fn queue_slot_wait(&self, tenant: &TenantPolicy) -> Duration {
        let backlog = self
            .queue
            .backlogs()
            .into_iter()
            .find(|b| b.tenant == tenant.name);
        let Some(backlog) = backlog.filter(|b| b.requests > 0) else {
            return MIN_CAPACITY_RETRY_AFTER;
        };
        let average_entry = backlog.tokens / backlog.requests as u64;
        let share = f64::from(tenant.weight.get()) / self.queue.backlogged_weight().max(1) as f64;
        let estimate = self
            .ledger
            .time_to_drain(average_entry)
            .map(|at_full_rate| at_full_rate.div_f64(share.clamp(f64::MIN_POSITIVE, 1.0)));
        clamp_retry_after(estimate.unwrap_or(MIN_CAPACITY_RETRY_AFTER))
    }
}

/// What dispatch needs from the fair-queue candidate (copied so the queue can be mutated).
struct Candidate {
    id: EntryId,
    lane: Lane,
    needed_blocks: usize,
    waited: Duration,
    max_wait: Duration,
}

impl Candidate {
    fn of(entry: &QueueEntry<Pending>, now: Instant) -> Candidate {
        Candidate {
            id: entry.id,
            lane: entry.lane,
            needed_blocks: entry.payload.needed_blocks,
            waited: now.saturating_duration_since(entry.payload.enqueued_at),
            max_wait: entry.payload.ticket.tenant.max_queue_wait,
        }
    }
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

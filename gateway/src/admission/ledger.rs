//! State shared between the dispatcher and the [`super::Admitted`] guards, which may drop on any
//! thread: running requests per tenant and, per block pool, the running requests and their cap,
//! the long lane, the capacity held and the drain-rate estimate; and the dispatcher's last
//! published queue snapshot.
//!
//! A guard's `Drop` cannot await or send on a bounded channel without risking a lost release,
//! so releases update this ledger under a short lock and wake the dispatcher with
//! `Notify::notify_one`, which stores the wake-up if the dispatcher is busy: none is lost.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use kvgate_runtime::scheduler::StepShape;

use super::{PoolId, ServiceTime};
use crate::metrics::TenantQueueSnapshot;
use crate::queue::{Lane, TenantBacklog};

#[derive(Debug, Default)]
pub(super) struct Ledger {
    in_flight: Mutex<InFlight>,
    /// One estimate per pool: an upstream returns capacity at its own pace.
    drain: Mutex<HashMap<PoolId, DrainRate>>,
    service_time: ServiceTimeSlot,
    backlogs: Mutex<Vec<TenantBacklog>>,
    /// The longest any request may queue, whatever its tenant's `max_queue_wait`.
    queue_wait_cap: Mutex<Option<Duration>>,
    /// Fired when a running request releases its slot.
    pub released: Notify,
}

/// Weight of the newest request in a tenant's average slot hold time per token and in its
/// average grant wait: about the last ten requests dominate.
const HOLD_TIME_ALPHA: f64 = 0.2;

/// A request holds its slot for about the tenant's hold time per token × (its max_tokens + this):
/// the part of a request's time that does not grow with its output (prefill, the round trip),
/// in tokens. Without it a 4-token request would be forecast to take nearly nothing.
const HOLD_OVERHEAD_TOKENS: u64 = 16;

/// Where and how a tenant's running request holds its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotHeld {
    started_at: Instant,
    /// Its max_tokens: what its hold time is forecast from.
    max_output_tokens: u64,
}

/// The tokens a request's hold time is counted in ([`HOLD_OVERHEAD_TOKENS`]).
fn hold_tokens(max_output_tokens: u64) -> f64 {
    max_output_tokens.saturating_add(HOLD_OVERHEAD_TOKENS) as f64
}

/// Seconds a request with this max_tokens is expected to hold its slot, at `per_token`.
fn expected_hold(per_token: f64, max_output_tokens: u64) -> f64 {
    per_token * hold_tokens(max_output_tokens)
}

/// A running request is expected to hold its slot at least this fraction of what it has run
/// already, longer still ([`residual_hold`]).
const RESIDUAL_PER_SECOND_RUN: f64 = 0.5;

/// Seconds a request expected to hold its slot `expected` s, running for `ran` s, still holds
/// it: what is left of `expected`, but never less than [`RESIDUAL_PER_SECOND_RUN`] × `ran`
/// (the two meet at two thirds of `expected`). A request that outruns its forecast is evidence
/// of a longer one — a long prompt (the forecast prices max_tokens only), a busy engine — and
/// the longer it has run, the longer it is likely to run on. Counting it as freeing its slot
/// at once, as long as it ran, kept the requests behind it forecast to start at once until
/// their deadline passed and they got a 503 instead of an early 429 (QA: a 2 s queue wait
/// behind a 64-token request with an 1,800-token prompt, 4.5 s of work forecast at 0.4 s).
fn residual_hold(expected: f64, ran: f64) -> f64 {
    (expected - ran).max(RESIDUAL_PER_SECOND_RUN * ran)
}

/// Sets `tenant`'s value in `map`. These per-tenant maps are written on every request: the
/// name is copied only the first time.
fn set_for<V>(map: &mut HashMap<String, V>, tenant: &str, value: V) {
    match map.get_mut(tenant) {
        Some(slot) => *slot = value,
        None => {
            map.insert(tenant.to_owned(), value);
        }
    }
}

/// Moves `tenant`'s average in `map` [`HOLD_TIME_ALPHA`] of the way to `sample` (the first
/// sample is the average).
fn add_to_average(map: &mut HashMap<String, f64>, tenant: &str, sample: f64) {
    match map.get_mut(tenant) {
        Some(average) => *average += HOLD_TIME_ALPHA * (sample - *average),
        None => set_for(map, tenant, sample),
    }
}

/// When a queued request gets one of its tenant's slots ([`Ledger::slot_forecast`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotForecast {
    /// Until the slot comes free, if each freed slot is granted to the next request at once.
    pub wait: Duration,
    /// How many of the tenant's requests, this one included, must be granted one after the
    /// other before it starts on that slot: each grant may wait for KV, which `wait` leaves
    /// out (the dispatcher adds it). Zero when a slot is free for it now: then its own wait
    /// for KV is all there is, and the KV forecast prices it.
    pub grants: u32,
}

/// Reads how fast the engine serves (see [`ServiceTime`]); `None` while it cannot say.
pub type ServiceTimeProbe = Arc<dyn Fn() -> Option<ServiceTime> + Send + Sync>;

/// Where the [`ServiceTimeProbe`] lives (empty until the server wires the engine in).
#[derive(Default)]
struct ServiceTimeSlot(Mutex<Option<ServiceTimeProbe>>);

impl std::fmt::Debug for ServiceTimeSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.0.lock().is_some();
        f.debug_tuple("ServiceTimeSlot").field(&set).finish()
    }
}

/// The engine's pace for the requests running in one pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Pace {
    /// Wall time per generated token, all running sequences together.
    pub per_output_token: Duration,
    /// Wall time of the prompts of one generation of requests like the running ones (zero
    /// when the probe gives only a per-token time).
    pub per_generation_prefill: Duration,
}

/// What a running request adds to its pool's in-flight totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Footprint {
    /// KV capacity (in tokens) it holds.
    pub reserved_tokens: u64,
    pub prompt_tokens: u64,
    /// Its max_tokens.
    pub output_tokens: u64,
}

/// A tenant's requests queued ahead of the one being forecast, for [`Ledger::slot_forecast`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct QueuedAhead {
    pub requests: usize,
    /// Their max_tokens, summed.
    pub output_tokens: u64,
}

/// How a running request gives its tenant's concurrency slot back, for [`Ledger::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SlotUse {
    /// When it took the slot (what [`Ledger::start`] was given).
    pub started_at: Instant,
    /// Whether the request ran: one the engine refused before it started says nothing about
    /// how long the tenant's requests hold a slot.
    pub ran: bool,
}

/// Running requests. A tenant's concurrency counts its requests in every pool; the long lane
/// is per pool, because it protects one engine's steps from long prefills.
#[derive(Debug, Default)]
pub(super) struct InFlight {
    /// Per tenant, its running requests' slots (one entry per request).
    per_tenant: HashMap<String, Vec<SlotHeld>>,
    per_pool: HashMap<PoolId, PoolInFlight>,
    /// Per tenant, how long its requests hold a concurrency slot per token of theirs
    /// ([`hold_tokens`]), in seconds: an average over those that ran, from the slot taken to
    /// the slot given back (see [`Ledger::slot_forecast`]). Per token, because a tenant's requests
    /// may differ a hundredfold in size.
    hold_per_token: HashMap<String, f64>,
    /// Per tenant, when it last took or gave back a slot: from then on (or from its arrival,
    /// if later) its next queued request may start as far as its slots are concerned.
    slot_moved_at: HashMap<String, Instant>,
    /// Per tenant, how long a request of it that its slots let start waits for its grant
    /// (KV, the fair queue's other tenants), in seconds: an average over its grants
    /// ([`Ledger::grant_wait`]).
    grant_wait: HashMap<String, f64>,
}

/// Running requests of one pool.
#[derive(Debug, Default, Clone, Copy)]
struct PoolInFlight {
    requests: usize,
    /// At most this many at once (the engine's submit queue bound); `None`: no cap.
    max_requests: Option<usize>,
    long_lane: usize,
    /// KV capacity (in tokens) held by running requests.
    reserved_tokens: u64,
    /// Prompt tokens of the running requests.
    prompt_tokens: u64,
    /// Prompt tokens of the running requests that have not reported a token yet: prefill
    /// the engine still has to do.
    unprefilled_prompt_tokens: u64,
    /// Output tokens (max_tokens) of the running requests.
    max_output_tokens: u64,
    /// Output tokens the running requests may still generate: max_tokens less what they
    /// reported generating.
    remaining_output_tokens: u64,
}

impl InFlight {
    /// Whether one more request of `tenant` in `lane` of `pool` stays within both caps.
    pub fn may_start(
        &self,
        tenant: &str,
        max_concurrency: usize,
        pool: PoolId,
        lane: Lane,
        long_max_concurrency: usize,
    ) -> bool {
        let running = self.running(tenant);
        let pool = self.per_pool.get(&pool).copied().unwrap_or_default();
        running < max_concurrency
            && pool.max_requests.is_none_or(|max| pool.requests < max)
            && (lane == Lane::Short || pool.long_lane < long_max_concurrency)
    }

    /// Requests of `tenant` running now (its concurrency slots taken).
    pub fn running(&self, tenant: &str) -> usize {
        self.per_tenant.get(tenant).map_or(0, Vec::len)
    }

    /// KV capacity (in tokens) that running requests hold in `pool`.
    #[cfg(test)]
    pub fn reserved_tokens(&self, pool: PoolId) -> u64 {
        self.per_pool.get(&pool).map_or(0, |p| p.reserved_tokens)
    }
}

impl Ledger {
    pub fn in_flight(&self) -> parking_lot::MutexGuard<'_, InFlight> {
        self.in_flight.lock()
    }

    /// A request of `tenant` queued at `queued_at` is granted at `now` (before its
    /// [`Ledger::start`]): it may have started once it arrived and its tenant last took or gave
    /// back a slot, so what it waited beyond that was for its grant.
    pub fn record_grant(&self, tenant: &str, queued_at: Instant, now: Instant) {
        let mut in_flight = self.in_flight.lock();
        let eligible = in_flight
            .slot_moved_at
            .get(tenant)
            .map_or(queued_at, |&moved| moved.max(queued_at));
        let waited = now.saturating_duration_since(eligible).as_secs_f64();
        add_to_average(&mut in_flight.grant_wait, tenant, waited);
    }

    /// How long a request of `tenant` that may start by its slots waits for its grant, on
    /// average; `None` before its first grant.
    pub fn grant_wait(&self, tenant: &str) -> Option<Duration> {
        let seconds = *self.in_flight.lock().grant_wait.get(tenant)?;
        Some(Duration::from_secs_f64(seconds.clamp(0.0, 1e6)))
    }

    /// A request of `tenant` takes a concurrency slot at `now` (give the same instant to
    /// [`Ledger::finish`] in its [`SlotUse`]).
    pub fn start(
        &self,
        tenant: &str,
        pool_id: PoolId,
        lane: Lane,
        footprint: Footprint,
        now: Instant,
    ) {
        let mut in_flight = self.in_flight.lock();
        in_flight
            .per_tenant
            .entry(tenant.to_string())
            .or_default()
            .push(SlotHeld {
                started_at: now,
                max_output_tokens: footprint.output_tokens,
            });
        set_for(&mut in_flight.slot_moved_at, tenant, now);
        let pool = in_flight.per_pool.entry(pool_id).or_default();
        if lane == Lane::Long {
            pool.long_lane += 1;
        }
        pool.requests += 1;
        if pool.requests == 1 {
            // Under the in-flight lock, so busy and idle reach the drain rate in order.
            self.drain
                .lock()
                .entry(pool_id)
                .or_default()
                .busy(Instant::now());
        }
        pool.reserved_tokens += footprint.reserved_tokens;
        pool.prompt_tokens += footprint.prompt_tokens;
        pool.unprefilled_prompt_tokens += footprint.prompt_tokens;
        pool.max_output_tokens += footprint.output_tokens;
        pool.remaining_output_tokens += footprint.output_tokens;
    }

    /// A running request of `pool` generated one more token; `prefilled_prompt` is its prompt
    /// length with its first token (its prefill is done), else 0.
    pub fn generated(&self, pool: PoolId, prefilled_prompt: u64) {
        if let Some(pool) = self.in_flight.lock().per_pool.get_mut(&pool) {
            pool.remaining_output_tokens = pool.remaining_output_tokens.saturating_sub(1);
            pool.unprefilled_prompt_tokens = pool
                .unprefilled_prompt_tokens
                .saturating_sub(prefilled_prompt);
        }
    }

    /// Caps the requests `pool` may run at once.
    pub fn limit_requests(&self, pool: PoolId, max_requests: usize) {
        let mut in_flight = self.in_flight.lock();
        in_flight.per_pool.entry(pool).or_default().max_requests = Some(max_requests);
    }

    /// A running request ends: it gives back its `footprint`, and `unreported` is what of its
    /// (output, prompt) tokens [`Ledger::generated`] did not take off the totals.
    pub fn finish(
        &self,
        tenant: &str,
        pool_id: PoolId,
        lane: Lane,
        footprint: Footprint,
        (unreported_output, unprefilled_prompt): (u64, u64),
        slot: SlotUse,
    ) {
        {
            let mut in_flight = self.in_flight.lock();
            if let Some(running) = in_flight.per_tenant.get_mut(tenant) {
                // Its own entry (start and size); any one if it is not there (it always is).
                let at = running.iter().position(|held| {
                    held.started_at == slot.started_at
                        && held.max_output_tokens == footprint.output_tokens
                });
                if let Some(index) = at.or(running.len().checked_sub(1)) {
                    running.swap_remove(index);
                }
                if running.is_empty() {
                    in_flight.per_tenant.remove(tenant);
                }
            }
            set_for(&mut in_flight.slot_moved_at, tenant, Instant::now());
            if slot.ran {
                let held = Instant::now().saturating_duration_since(slot.started_at);
                let per_token = held.as_secs_f64() / hold_tokens(footprint.output_tokens);
                add_to_average(&mut in_flight.hold_per_token, tenant, per_token);
            }
            if let Some(pool) = in_flight.per_pool.get_mut(&pool_id) {
                if lane == Lane::Long {
                    pool.long_lane = pool.long_lane.saturating_sub(1);
                }
                pool.requests = pool.requests.saturating_sub(1);
                if pool.requests == 0
                    && let Some(drain) = self.drain.lock().get_mut(&pool_id)
                {
                    drain.idle(Instant::now());
                }
                pool.reserved_tokens = pool
                    .reserved_tokens
                    .saturating_sub(footprint.reserved_tokens);
                pool.prompt_tokens = pool.prompt_tokens.saturating_sub(footprint.prompt_tokens);
                pool.unprefilled_prompt_tokens = pool
                    .unprefilled_prompt_tokens
                    .saturating_sub(unprefilled_prompt);
                pool.max_output_tokens = pool
                    .max_output_tokens
                    .saturating_sub(footprint.output_tokens);
                pool.remaining_output_tokens = pool
                    .remaining_output_tokens
                    .saturating_sub(unreported_output);
            }
        }
        self.released.notify_one();
    }

    /// [`Ledger::slot_forecast`]'s wait alone.
    #[cfg(test)]
    pub fn slot_wait(
        &self,
        tenant: &str,
        max_concurrency: usize,
        ahead: QueuedAhead,
        now: Instant,
    ) -> Option<Duration> {
        self.slot_forecast(tenant, max_concurrency, ahead, now)
            .map(|forecast| forecast.wait)
    }

    /// How long until a queued request of `tenant` can take one of the tenant's
    /// `max_concurrency` slots, as far as that cap is concerned (KV is
    /// [`Ledger::kv_drain_time`]'s part), with `ahead` of the tenant's requests queued before it
    /// ([`QueuedAhead`]). Zero when a slot is free for it now; `None` before any of the
    /// tenant's requests has finished (no hold time to forecast with).
    ///
    /// A request holds its slot for h = s × (its max_tokens + [`HOLD_OVERHEAD_TOKENS`]), s the
    /// tenant's average hold time per token. A running request frees its slot after its h less
    /// what it has run, or half of what it has run if that is longer ([`residual_hold`]); a
    /// free slot is taken at once by a request ahead and
    /// held for h̄, the mean h of the requests ahead. So the slots come free at the times
    /// b₁ ≤ … ≤ b_C, then each h̄ later, and the j-th request that must wait for a slot starts at
    /// b_((j−1) mod C) + ⌊(j−1)/C⌋·h̄. Running requests beyond a cap that a reload lowered free
    /// no slot: the first of them to end are skipped.
    ///
    /// With the wait, how many grants lead to the request's slot ([`SlotForecast::grants`]).
    pub fn slot_forecast(
        &self,
        tenant: &str,
        max_concurrency: usize,
        ahead: QueuedAhead,
        now: Instant,
    ) -> Option<SlotForecast> {
        let in_flight = self.in_flight.lock();
        let held = in_flight
            .per_tenant
            .get(tenant)
            .map_or(&[][..], Vec::as_slice);
        let running = held.len();
        let free = max_concurrency.saturating_sub(running);
        let position = ahead.requests.saturating_add(1);
        if position <= free {
            // Its own wait for the blocks is the KV forecast's: nothing comes before it.
            return Some(SlotForecast {
                wait: Duration::ZERO,
                grants: 0,
            });
        }
        let per_token = *in_flight.hold_per_token.get(tenant)?;
        // Mean hold of the requests ahead (they hold the free slots and later rounds).
        let mean_ahead = match ahead.requests {
            0 => 0.0,
            n => {
                let tokens = ahead
                    .output_tokens
                    .saturating_add(HOLD_OVERHEAD_TOKENS.saturating_mul(n as u64));
                per_token * tokens as f64 / n as f64
            }
        };
        let cap = max_concurrency.max(1);
        let waiting = position - free - 1;
        let rounds = waiting / cap;
        let slot = waiting % cap + running.saturating_sub(cap);
        // Grants on this request's slot: one per round and its own, and one more when the
        // slot is free now (a request ahead takes it first).
        let grants = u32::try_from(rounds)
            .unwrap_or(u32::MAX)
            .saturating_add(if slot < running { 1 } else { 2 });
        let first_free = if slot < running {
            let mut remaining: Vec<f64> = held
                .iter()
                .map(|h| {
                    let ran = now.saturating_duration_since(h.started_at).as_secs_f64();
                    residual_hold(expected_hold(per_token, h.max_output_tokens), ran)
                })
                .collect();
            *remaining.select_nth_unstable_by(slot, f64::total_cmp).1
        } else {
            mean_ahead
        };
        let seconds = first_free + rounds as f64 * mean_ahead;
        Some(SlotForecast {
            wait: Duration::from_secs_f64(seconds.clamp(0.0, 1e6)),
            grants,
        })
    }

    /// How long a request of `tenant` with this max_tokens is expected to hold its slot
    /// ([`Ledger::slot_forecast`]'s h); `None` before any of the tenant's requests has finished.
    pub fn hold_for(&self, tenant: &str, max_output_tokens: u64) -> Option<Duration> {
        let per_token = *self.in_flight.lock().hold_per_token.get(tenant)?;
        let seconds = expected_hold(per_token, max_output_tokens);
        Some(Duration::from_secs_f64(seconds.clamp(0.0, 1e6)))
    }

    pub fn record_drained(&self, pool: PoolId, tokens: u64, now: Instant) {
        self.drain
            .lock()
            .entry(pool)
            .or_default()
            .record(tokens, now);
    }

    /// Estimated time for `tokens` of `pool`'s capacity to be returned; `None` before any data.
    pub fn time_to_drain(&self, pool: PoolId, tokens: u64) -> Option<Duration> {
        self.drain.lock().get(&pool)?.time_for(tokens)
    }

    /// Estimated time for `tokens` of `pool`'s capacity to be returned, for forecasts: the
    /// measured drain rate, or before there is one (the first completions take seconds), for
    /// the embedded engine, a model of its running requests priced at the engine's [`Pace`].
    /// They hold R tokens of capacity; R comes back once they have finished their prefill
    /// (P₀ prompt tokens left) and generated the G tokens they still may — in a lump, since a
    /// request frees its blocks only when it ends; each further R needs a whole generation of
    /// requests like them (their prompts, then max_tokens M in all). So `tokens` take
    /// prefill(P₀) + G·s + (⌈tokens / R⌉ − 1)·(prefill(generation) + M·s) for a per-token
    /// time s: never the optimistic fluid R/(G·s) rate, which would promise capacity before
    /// any request ends. `None` without either.
    pub fn kv_drain_time(&self, pool: PoolId, tokens: u64) -> Option<Duration> {
        if let Some(measured) = self.time_to_drain(pool, tokens) {
            return Some(measured);
        }
        if pool != PoolId::LOCAL {
            return None;
        }
        let running = {
            let in_flight = self.in_flight.lock();
            in_flight.per_pool.get(&pool).copied().unwrap_or_default()
        };
        if running.reserved_tokens == 0 || running.max_output_tokens == 0 {
            return None;
        }
        let pace = self.pace(&running)?;
        let rounds = tokens.div_ceil(running.reserved_tokens).max(1);
        let s = pace.per_output_token.as_secs_f64();
        let generation = pace.per_generation_prefill.as_secs_f64();
        let pending_prefill = if running.prompt_tokens == 0 {
            0.0
        } else {
            generation * running.unprefilled_prompt_tokens as f64 / running.prompt_tokens as f64
        };
        let seconds = pending_prefill
            + s * running.remaining_output_tokens as f64
            + (rounds - 1) as f64 * (generation + s * running.max_output_tokens as f64);
        Some(Duration::from_secs_f64(seconds.min(1e6)))
    }

    /// The engine's per-token service time for `pool`'s running requests (one when none runs);
    /// `None` without a probe or an answer.
    pub fn per_token_service_time(&self, pool: PoolId) -> Option<Duration> {
        let running = {
            let in_flight = self.in_flight.lock();
            in_flight.per_pool.get(&pool).copied().unwrap_or_default()
        };
        Some(self.pace(&running)?.per_output_token)
    }

    /// How fast the engine serves requests like `running`'s. With its step cost model: a
    /// decode step of all N of them (one when none runs) at their average reserved context,
    /// divided by N; and their prompts prefilled one request at a time, each costing its
    /// tokens and their attention beyond the fixed per-step cost.
    fn pace(&self, running: &PoolInFlight) -> Option<Pace> {
        // Called outside the slot's lock: the probe takes the engine's stats lock.
        let probe = self.service_time.0.lock().clone()?;
        match probe()? {
            ServiceTime::PerToken(per_token) => Some(Pace {
                per_output_token: per_token,
                per_generation_prefill: Duration::ZERO,
            }),
            ServiceTime::Model(cost) => {
                let n = running.requests.max(1);
                let context = usize::try_from(running.reserved_tokens / n as u64)
                    .unwrap_or(usize::MAX)
                    .max(1);
                let mut decode = StepShape::default();
                for _ in 0..n {
                    decode.add_decode(context - 1);
                }
                let per_output_token = cost.predict(&decode) / u32::try_from(n).ok()?;
                let prompt = usize::try_from(running.prompt_tokens / n as u64).unwrap_or(0);
                let mut prefill = StepShape::default();
                prefill.add_prefill(0, prompt);
                let fixed = cost.predict(&StepShape::default());
                let per_request = cost.predict(&prefill).saturating_sub(fixed);
                let per_generation_prefill = per_request * u32::try_from(n).ok()?;
                (!per_output_token.is_zero()).then_some(Pace {
                    per_output_token,
                    per_generation_prefill,
                })
            }
        }
    }

    pub fn set_queue_wait_cap(&self, cap: Duration) {
        *self.queue_wait_cap.lock() = Some(cap);
    }

    /// How long a request of a tenant with this `max_queue_wait` may queue.
    pub fn max_queue_wait(&self, tenant_max: Duration) -> Duration {
        self.queue_wait_cap
            .lock()
            .map_or(tenant_max, |cap| cap.min(tenant_max))
    }

    pub fn set_service_time_probe(&self, probe: ServiceTimeProbe) {
        *self.service_time.0.lock() = Some(probe);
    }

    pub fn publish(&self, backlogs: Vec<TenantBacklog>) {
        *self.backlogs.lock() = backlogs;
    }

    /// Published queue state joined with live in-flight counts.
    pub fn snapshot(&self) -> Vec<TenantQueueSnapshot> {
        let mut rows: Vec<TenantQueueSnapshot> = self
            .backlogs
            .lock()
            .iter()
            .map(|b| TenantQueueSnapshot {
                tenant: b.tenant.clone(),
                queued_requests: b.requests,
                queued_tokens: b.tokens,
                in_flight: 0,
            })
            .collect();
        for (tenant, running) in &self.in_flight.lock().per_tenant {
            match rows.iter_mut().find(|row| row.tenant == *tenant) {
                Some(row) => row.in_flight = running.len(),
                None => rows.push(TenantQueueSnapshot {
                    tenant: tenant.clone(),
                    queued_requests: 0,
                    queued_tokens: 0,
                    in_flight: running.len(),
                }),
            }
        }
        rows.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        rows
    }
}

/// Exponential moving average of how fast completed requests return KV capacity, in tokens
/// per second of the pool's busy time. Samples are taken over windows of at least
/// [`DrainRate::WINDOW`] of busy time; time with no request running does not count, so idle
/// time does not read as a slow server, and a window left open longer than [`DrainRate::IDLE`]
/// restarts.
#[derive(Debug, Default)]
pub(super) struct DrainRate {
    /// The pool's busy clock: time with at least one request running, summed. Windows are
    /// measured on it, so the gaps between requests of a pool that is not saturated (a client
    /// thinking between calls) do not pass for a slow engine.
    busy_before: Duration,
    /// Since when the pool has been busy (`None` while idle).
    busy_since: Option<Instant>,
    /// The busy clock when the current window opened.
    window_start: Option<Duration>,
    window_tokens: u64,
    tokens_per_sec: Option<f64>,
}

impl DrainRate {
    const WINDOW: Duration = Duration::from_secs(1);
    /// A window open this long on the busy clock is abandoned, not sampled.
    const IDLE: Duration = Duration::from_secs(30);
    /// Weight of the newest window: about the last five windows dominate.
    const ALPHA: f64 = 0.3;

    /// The pool's first request started.
    pub fn busy(&mut self, now: Instant) {
        self.busy_since.get_or_insert(now);
    }

    /// The pool's last request ended.
    pub fn idle(&mut self, now: Instant) {
        if let Some(since) = self.busy_since.take() {
            self.busy_before += now.saturating_duration_since(since);
        }
    }

    fn busy_clock(&self, now: Instant) -> Duration {
        self.busy_before
            + self
                .busy_since
                .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

    pub fn record(&mut self, tokens: u64, now: Instant) {
        let clock = self.busy_clock(now);
        let Some(start) = self
            .window_start
            .filter(|start| clock.saturating_sub(*start) <= Self::IDLE)
        else {
            // First completion (or first after a long window) only opens a window: the time
            // it took is unknown, so its tokens would overstate the rate.
            self.window_start = Some(clock);
            self.window_tokens = 0;
            return;
        };
        self.window_tokens += tokens;
        let elapsed = clock.saturating_sub(start);
        if elapsed >= Self::WINDOW {
            let sample = self.window_tokens as f64 / elapsed.as_secs_f64();
            self.tokens_per_sec = Some(match self.tokens_per_sec {
                Some(average) => average + Self::ALPHA * (sample - average),
                None => sample,
            });
            self.window_start = Some(clock);
            self.window_tokens = 0;
        }
    }

    pub fn time_for(&self, tokens: u64) -> Option<Duration> {
        let rate = self.tokens_per_sec.filter(|rate| *rate > 0.0)?;
        Some(Duration::from_secs_f64((tokens as f64 / rate).min(1e6)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_rate_averages_windows_and_ignores_idle_gaps() {
        let t0 = Instant::now();
        let mut rate = DrainRate::default();
        rate.busy(t0);
        assert_eq!(rate.time_for(100), None);
        rate.record(500, t0);
        assert_eq!(
            rate.time_for(100),
            None,
            "one completion says nothing about speed"
        );
        rate.record(100, t0 + Duration::from_millis(500));
        rate.record(100, t0 + Duration::from_secs(1));
        assert_eq!(
            rate.time_for(400),
            Some(Duration::from_secs(2)),
            "200 tokens over 1 s"
        );
        rate.record(400, t0 + Duration::from_secs(2));
        // EMA: 200 + 0.3 * (400 - 200) = 260 tokens/s.
        let expected = Duration::from_secs_f64(520.0 / 260.0);
        assert_eq!(rate.time_for(520), Some(expected));

        // The pool empties for 20 s (a client between calls), then one request runs for 1 s
        // and returns 260 tokens: 260 tokens per busy second, not 260 over 21 s.
        rate.idle(t0 + Duration::from_secs(2));
        rate.busy(t0 + Duration::from_secs(22));
        rate.record(260, t0 + Duration::from_secs(23));
        assert_eq!(
            rate.time_for(520),
            Some(expected),
            "idle time is not engine time"
        );

        // Busy but without completions for longer than IDLE: a new window, not a sample.
        rate.record(5, t0 + Duration::from_secs(100));
        assert_eq!(
            rate.time_for(520),
            Some(expected),
            "a long gap is not a sample"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_ledger_runs_the_busy_clock_while_a_pool_has_requests() {
        let ledger = Ledger::default();
        let pool = PoolId::LOCAL;
        let footprint = Footprint {
            reserved_tokens: 100,
            prompt_tokens: 50,
            output_tokens: 50,
        };
        // One request after another, each 1 s long with 10 s of idle between them.
        for _ in 0..4 {
            let started_at = Instant::now();
            ledger.start("a", pool, Lane::Short, footprint, started_at);
            tokio::time::advance(Duration::from_secs(1)).await;
            ledger.record_drained(pool, 100, Instant::now());
            let slot = SlotUse {
                started_at,
                ran: true,
            };
            ledger.finish("a", pool, Lane::Short, footprint, (0, 0), slot);
            tokio::time::advance(Duration::from_secs(10)).await;
        }
        // 100 tokens per busy second (a wall clock would read ~9 per second).
        assert_eq!(
            ledger.time_to_drain(pool, 200),
            Some(Duration::from_secs(2))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_tenants_queued_requests_get_its_slots_as_its_running_ones_end() {
        let ledger = Ledger::default();
        let pool = PoolId::LOCAL;
        // Every request here has max_tokens 16: 32 hold tokens with the overhead.
        let footprint = Footprint {
            output_tokens: 16,
            ..Footprint::default()
        };
        let secs = |s: u64| Some(Duration::from_secs(s));
        let ahead_of = |position: usize| QueuedAhead {
            requests: position - 1,
            output_tokens: 16 * (position as u64 - 1),
        };
        let wait = |cap, position| ledger.slot_wait("a", cap, ahead_of(position), Instant::now());
        let run = |started_at: Instant, ran: bool| {
            ledger.start("a", pool, Lane::Short, footprint, started_at);
            move |ledger: &Ledger| {
                let slot = SlotUse { started_at, ran };
                ledger.finish("a", pool, Lane::Short, footprint, (0, 0), slot);
            }
        };
        assert_eq!(wait(2, 2), secs(0), "free slots need no history");
        assert_eq!(
            wait(2, 3),
            None,
            "no request has finished: no hold time yet"
        );

        // One that the engine refused says nothing; one that ran 4 s teaches the hold time.
        let refused = run(Instant::now(), false);
        let first = run(Instant::now(), true);
        tokio::time::advance(Duration::from_secs(4)).await;
        refused(&ledger);
        first(&ledger);
        assert_eq!(
            wait(2, 3),
            secs(4),
            "two take the free slots, the third waits for one"
        );

        // Two running for 1 s of their 4: their slots come free in 3 s, then every 4 s.
        let ends: Vec<_> = (0..2).map(|_| run(Instant::now(), true)).collect();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(wait(2, 1), secs(3));
        assert_eq!(wait(2, 2), secs(3));
        assert_eq!(wait(2, 3), secs(7));
        assert_eq!(wait(2, 5), secs(11));
        assert_eq!(wait(3, 1), secs(0), "a cap of 3 leaves one slot free");
        assert_eq!(wait(3, 2), secs(3));
        assert_eq!(
            wait(3, 4),
            secs(4),
            "the slot taken now frees after a whole hold"
        );
        assert_eq!(wait(3, 5), secs(7));
        // The forecast follows the size of what is queued: ahead of the third, one request like
        // these and one of max_tokens 496 (512 hold tokens, 16 times as long), so the rounds
        // after the first take their mean, (4 s + 64 s) / 2.
        let mixed = QueuedAhead {
            requests: 2,
            output_tokens: 16 + 496,
        };
        assert_eq!(
            ledger.slot_wait("a", 2, mixed, Instant::now()),
            secs(3 + 34)
        );
        // A reload lowered the cap to 1: the first of the two to end frees no slot.
        assert_eq!(wait(1, 1), secs(3));
        assert_eq!(wait(1, 2), secs(7));
        // Past two thirds of their 4 s, the time they have run is the better guide: at 3 s,
        // 1.5 s more (not 1 s); overdue at 11 s, 5.5 s more (not "any moment now", which
        // forecast the requests behind them to start at once until their deadline).
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(wait(2, 1), Some(Duration::from_millis(1500)));
        tokio::time::advance(Duration::from_secs(8)).await;
        assert_eq!(wait(2, 1), Some(Duration::from_millis(5500)));
        assert_eq!(wait(2, 3), Some(Duration::from_millis(9500)));
        for end in ends {
            end(&ledger);
        }
        // Each held 11 s: the average moves a fifth of the way each time, 4 → 5.4 → 6.52 s
        // for requests of this size.
        let hold = wait(1, 2).expect("a hold time").as_secs_f64();
        assert!((hold - 6.52).abs() < 1e-6, "{hold}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_grant_counts_its_wait_from_when_its_tenant_could_start_it() {
        let ledger = Ledger::default();
        let secs = |s: f64| Some(Duration::from_secs_f64(s));
        assert_eq!(ledger.grant_wait("a"), None, "no grant yet");
        // Queued 1 s before its grant, its tenant's slots untouched meanwhile: 1 s.
        let queued_at = Instant::now();
        tokio::time::advance(Duration::from_secs(1)).await;
        ledger.record_grant("a", queued_at, Instant::now());
        assert_eq!(ledger.grant_wait("a"), secs(1.0));
        // Queued while its tenant's one slot was taken, granted 0.5 s after the slot came
        // back: the 0.5 s count, not the 3 s in the queue (that was the slot's wait).
        let footprint = Footprint::default();
        let started_at = Instant::now();
        ledger.start("a", PoolId::LOCAL, Lane::Short, footprint, started_at);
        let queued_at = Instant::now();
        tokio::time::advance(Duration::from_millis(2500)).await;
        let slot = SlotUse {
            started_at,
            ran: true,
        };
        ledger.finish("a", PoolId::LOCAL, Lane::Short, footprint, (0, 0), slot);
        tokio::time::advance(Duration::from_millis(500)).await;
        ledger.record_grant("a", queued_at, Instant::now());
        // The average moves a fifth of the way: 1 → 0.9 s.
        let wait = ledger.grant_wait("a").expect("a wait").as_secs_f64();
        assert!((wait - 0.9).abs() < 1e-9, "{wait}");
        assert_eq!(ledger.grant_wait("b"), None, "per tenant");

        // The grants on the way to a slot (the hold time is known now).
        let grants = |cap, requests| {
            let ahead = QueuedAhead {
                requests,
                output_tokens: 0,
            };
            let forecast = ledger.slot_forecast("a", cap, ahead, Instant::now());
            forecast.expect("a hold time").grants
        };
        assert_eq!(grants(1, 0), 0, "a free slot: only KV stands before it");
        ledger.start("a", PoolId::LOCAL, Lane::Short, footprint, Instant::now());
        assert_eq!(grants(1, 0), 1, "its own, when the running one ends");
        assert_eq!(grants(1, 1), 2, "the one ahead, then its own");
        assert_eq!(grants(2, 1), 1, "the one ahead takes the free slot");
        assert_eq!(grants(2, 2), 2, "the free slot's taker, then its own");
    }

    #[test]
    fn in_flight_caps_per_tenant_and_long_lane() {
        let ledger = Ledger::default();
        let (local, upstream) = (PoolId::LOCAL, PoolId(1));
        let footprint = Footprint {
            reserved_tokens: 10,
            prompt_tokens: 5,
            output_tokens: 5,
        };
        let started_at = Instant::now();
        ledger.start("a", local, Lane::Long, footprint, started_at);
        assert!(!ledger.in_flight().may_start("a", 1, local, Lane::Short, 5));
        assert!(
            !ledger
                .in_flight()
                .may_start("a", 1, upstream, Lane::Short, 5),
            "a tenant's concurrency counts every pool"
        );
        assert!(ledger.in_flight().may_start("b", 1, local, Lane::Short, 1));
        assert!(!ledger.in_flight().may_start("b", 1, local, Lane::Long, 1));
        assert!(
            ledger
                .in_flight()
                .may_start("b", 1, upstream, Lane::Long, 1),
            "the long lane is per pool"
        );
        assert_eq!(ledger.in_flight().reserved_tokens(local), 10);
        assert_eq!(ledger.in_flight().reserved_tokens(upstream), 0);
        let slot = SlotUse {
            started_at,
            ran: true,
        };
        ledger.finish("a", local, Lane::Long, footprint, (5, 5), slot);
        assert!(ledger.in_flight().may_start("a", 1, local, Lane::Long, 1));
        assert_eq!(ledger.in_flight().reserved_tokens(local), 0);
        assert!(ledger.snapshot().is_empty());
    }
}

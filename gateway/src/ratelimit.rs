//! Per-tenant requests-per-minute and tokens-per-minute limits (governor's GCRA), and the
//! OpenAI `x-ratelimit-*` headers that report them.
//!
//! Tokens are debited up front (prompt + max_tokens, the most a request can use) so a burst of
//! admitted streams can never overshoot the limit, and the unused part is refunded when the
//! response ends. governor cannot un-consume cells, so a refund goes into a per-bucket *credit*
//! that later debits spend before asking governor. The credit is capped so that credit plus
//! governor's remaining capacity never exceeds the bucket size: a refund restores capacity, it
//! never creates burst beyond the quota. Wait times come from governor's `NotUntil`, so a
//! Retry-After is exact, not a guessed window.
//!
//! Time is read through [`TokioClock`], so tests drive it with `tokio::time::pause`/`advance`.

mod clock;
mod headers;
pub mod shared;

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::middleware::StateInformationMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use parking_lot::Mutex;
use tokio::time::Instant;

pub use clock::{TokioClock, TokioInstant};
pub use headers::{BucketStatus, HEADER_NAMES, RateLimitHeaders, UNLIMITED, format_reset};
pub use shared::{SharedCharge, SharedDecision, SharedLimiter};

use crate::policy::TenantPolicy;

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    Tokens,
    /// Requests in flight at once across gateway replicas (`[shared]` leases).
    Concurrency,
}

impl LimitKind {
    /// OpenAI's `type` for a rate-limit error: "requests" or "tokens".
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Requests | LimitKind::Concurrency => "requests",
            LimitKind::Tokens => "tokens",
        }
    }
}

/// A refused debit.
#[derive(Debug, Clone, PartialEq)]
pub enum RateLimitError {
    /// Over the limit now; `wait` is governor's exact time until the debit would pass.
    Limited {
        kind: LimitKind,
        limit: u32,
        requested: u32,
        wait: Duration,
        headers: RateLimitHeaders,
    },
    /// Bigger than the bucket: it can never pass, so retrying is pointless.
    ExceedsBucket {
        kind: LimitKind,
        limit: u32,
        requested: u32,
        headers: RateLimitHeaders,
    },
}

/// The rate-limit state of every tenant. Cheap to share (`Arc`); thread-safe.
#[derive(Debug, Default)]
pub struct RateLimits {
    tenants: Mutex<HashMap<String, Arc<TenantSlot>>>,
}

impl RateLimits {
    pub fn new() -> RateLimits {
        RateLimits::default()
    }

    /// Debits one request and `tokens` tokens from the tenant's buckets, all or nothing.
    pub fn try_debit(&self, tenant: &TenantPolicy, tokens: usize) -> Result<Debit, RateLimitError> {
        self.try_debit_prepaid(tenant, tokens, None)
    }

    /// [`RateLimits::try_debit`] for a request whose request cell was taken before its body
    /// ([`RateLimits::reserve_request`]): only the tokens are debited, and the [`Debit`] takes
    /// the cell over (refunded with it). On a refusal the cell is returned too: all or nothing.
    pub fn try_debit_prepaid(
        &self,
        tenant: &TenantPolicy,
        tokens: usize,
        prepaid: Option<RequestCell>,
    ) -> Result<Debit, RateLimitError> {
        let slot = self.slot(tenant);
        let buckets = slot.current();
        let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        if let Some(bucket) = &buckets.tokens
            && tokens > bucket.limit.get()
        {
            let (kind, limit, headers) = (LimitKind::Tokens, bucket.limit.get(), buckets.headers());
            return Err(RateLimitError::ExceedsBucket {
                kind,
                limit,
                requested: tokens,
                headers,
            });
        }
        if let Some(bucket) = &buckets.tokens
            && let Err(wait) = bucket.debit(tokens)
        {
            let (kind, limit, headers) = (LimitKind::Tokens, bucket.limit.get(), buckets.headers());
            return Err(RateLimitError::Limited {
                kind,
                limit,
                requested: tokens,
                wait,
                headers,
            });
        }
        // A cell taken from this tenant's slot before the body stands for this request's; the
        // debit takes it over (so the cell's own drop returns nothing).
        let prepaid = prepaid
            .filter(|cell| Arc::ptr_eq(&cell.slot, &slot))
            .map(|mut cell| std::mem::take(&mut cell.taken));
        if let Some(request_taken) = prepaid {
            return Ok(Debit {
                slot,
                tokens,
                request_taken,
                settled: false,
                shared: None,
            });
        }
        if let Some(bucket) = &buckets.requests
            && let Err(wait) = bucket.debit(1)
        {
            // All or nothing: give back the tokens just taken.
            if let Some(token_bucket) = &buckets.tokens {
                token_bucket.refund(tokens);
            }
            let (kind, limit, headers) =
                (LimitKind::Requests, bucket.limit.get(), buckets.headers());
            return Err(RateLimitError::Limited {
                kind,
                limit,
                requested: 1,
                wait,
                headers,
            });
        }
        Ok(Debit {
            request_taken: buckets.requests.is_some(),
            slot,
            tokens,
            settled: false,
            shared: None,
        })
    }

    /// A debit that takes nothing from this gateway's own buckets: the shared store charged
    /// the request (`shared`), or nobody did (`None`: the store failed and the policy says
    /// `on_store_error = "allow"`).
    pub fn debit_elsewhere(&self, tenant: &TenantPolicy, shared: Option<SharedCharge>) -> Debit {
        Debit {
            slot: self.slot(tenant),
            tokens: 0,
            request_taken: false,
            settled: false,
            shared: shared.map(Box::new),
        }
    }

    /// A [`RequestCell`] that took nothing (the shared store decides this tenant's requests at
    /// admission, after the body).
    pub fn untaken_request(&self, tenant: &TenantPolicy) -> RequestCell {
        RequestCell {
            slot: self.slot(tenant),
            taken: false,
        }
    }

    /// Takes one request from the tenant's request bucket before the request's body is read,
    /// so that a burst of concurrent requests cannot all pass a check and be refused only
    /// after their bodies were read and tokenized: the excess is refused from the headers
    /// (with governor's exact wait). The cell comes back when the [`RequestCell`] drops,
    /// unless [`RateLimits::try_debit_prepaid`] took it over for the request's debit.
    pub fn reserve_request(&self, tenant: &TenantPolicy) -> Result<RequestCell, RateLimitError> {
        let slot = self.slot(tenant);
        let buckets = slot.current();
        let taken = match &buckets.requests {
            Some(bucket) => match bucket.debit(1) {
                Ok(()) => true,
                Err(wait) => {
                    return Err(RateLimitError::Limited {
                        kind: LimitKind::Requests,
                        limit: bucket.limit.get(),
                        requested: 1,
                        wait,
                        headers: buckets.headers(),
                    });
                }
            },
            None => false,
        };
        Ok(RequestCell { slot, taken })
    }

    /// The tenant's current state, for responses that never reached a debit.
    pub fn headers(&self, tenant: &TenantPolicy) -> RateLimitHeaders {
        self.slot(tenant).current().headers()
    }

    /// Forgets tenants for which `keep` is false (e.g. removed by a policy reload).
    pub fn retain(&self, mut keep: impl FnMut(&str) -> bool) {
        self.tenants.lock().retain(|name, _| keep(name));
    }

    /// The tenant's buckets. When a policy reload changed its quotas they are rebuilt with
    /// what was spent carried over: a reload changes the limit, it does not refill the bucket
    /// (or a tenant could reset its quota by asking for a reload).
    fn slot(&self, tenant: &TenantPolicy) -> Arc<TenantSlot> {
        let mut tenants = self.tenants.lock();
        let quotas = (tenant.requests_per_minute, tenant.tokens_per_minute);
        let slot = tenants.entry(tenant.name.clone()).or_insert_with(|| {
            Arc::new(TenantSlot {
                current: Mutex::new(Arc::new(TenantBuckets::fresh(quotas))),
            })
        });
        let mut current = slot.current.lock();
        if current.quotas != quotas {
            *current = Arc::new(current.rebuilt(quotas));
        }
        drop(current);
        Arc::clone(slot)
    }
}

/// Where a tenant's buckets live. Debits hold the slot, not the buckets, so a refund after a
/// reload reaches the buckets in force.
#[derive(Debug)]
struct TenantSlot {
    current: Mutex<Arc<TenantBuckets>>,
}

impl TenantSlot {
    fn current(&self) -> Arc<TenantBuckets> {
        Arc::clone(&self.current.lock())
    }
}

/// A debit that has passed: one request and `tokens` tokens. Not Clone, so it is given back at
/// most once. [`Debit::settle`] keeps what the response used; dropping it unsettled refunds
/// everything, because then the request never ran (rejected later, or its client left).
#[derive(Debug)]
pub struct Debit {
    slot: Arc<TenantSlot>,
    tokens: u32,
    /// Whether a request cell was taken (the tenant had a request limit then).
    request_taken: bool,
    settled: bool,
    /// The charge in the shared store, when that decided instead of the local buckets (then
    /// `tokens` is 0 and no local cell was taken). Its own drop refunds and releases.
    /// Boxed: a `Debit` travels inside every queued request, and most have no shared charge.
    shared: Option<Box<SharedCharge>>,
}

/// One request taken from a tenant's request bucket before its body was read
/// ([`RateLimits::reserve_request`]). Returned when dropped, unless a [`Debit`] took it over.
#[derive(Debug)]
pub struct RequestCell {
    slot: Arc<TenantSlot>,
    /// A cell was taken (the tenant has a request limit) and is still this guard's to return.
    taken: bool,
}

impl Drop for RequestCell {
    fn drop(&mut self) {
        if self.taken
            && let Some(bucket) = &self.slot.current().requests
        {
            bucket.refund(1);
        }
    }
}

impl Debit {
    /// Tokens charged up front.
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// The response ended having used `used_tokens`: refund the rest of the up-front charge.
    pub fn settle(mut self, used_tokens: usize) {
        let used = u32::try_from(used_tokens).unwrap_or(u32::MAX);
        if let Some(shared) = &mut self.shared {
            shared.settle(used);
        }
        if let Some(bucket) = &self.slot.current().tokens {
            bucket.refund(self.tokens.saturating_sub(used));
        }
        self.settled = true;
    }

    /// The request never ran: refund it all (same as dropping it).
    pub fn cancel(self) {}

    /// The buckets' state now (the shared store's, as of this debit, when it decided).
    pub fn headers(&self) -> RateLimitHeaders {
        match &self.shared {
            Some(shared) => shared.headers(),
            None => self.slot.current().headers(),
        }
    }
}

impl Drop for Debit {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let buckets = self.slot.current();
        if self.request_taken
            && let Some(bucket) = &buckets.requests
        {
            bucket.refund(1);
        }
        if let Some(bucket) = &buckets.tokens {
            bucket.refund(self.tokens);
        }
    }
}

/// One tenant's two buckets and the quotas they were built from.
#[derive(Debug)]
struct TenantBuckets {
    quotas: (Option<NonZeroU32>, Option<NonZeroU32>),
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

impl TenantBuckets {
    fn fresh(quotas: (Option<NonZeroU32>, Option<NonZeroU32>)) -> TenantBuckets {
        TenantBuckets {
            quotas,
            requests: quotas.0.map(Bucket::per_minute),
            tokens: quotas.1.map(Bucket::per_minute),
        }
    }

    /// New buckets for `quotas` that start with what these have spent already.
    fn rebuilt(&self, quotas: (Option<NonZeroU32>, Option<NonZeroU32>)) -> TenantBuckets {
        let now = Instant::now();
        let spent = |bucket: &Option<Bucket>| bucket.as_ref().map_or(0, |b| b.spent(now));
        let fresh = TenantBuckets::fresh(quotas);
        if let Some(bucket) = &fresh.requests {
            bucket.take(spent(&self.requests));
        }
        if let Some(bucket) = &fresh.tokens {
            bucket.take(spent(&self.tokens));
        }
        fresh
    }

    fn headers(&self) -> RateLimitHeaders {
        let now = Instant::now();
        RateLimitHeaders {
            requests: self.requests.as_ref().map(|b| b.status(now)),
            tokens: self.tokens.as_ref().map(|b| b.status(now)),
        }
    }
}

type Gcra = RateLimiter<NotKeyed, InMemoryState, TokioClock, StateInformationMiddleware>;

/// A per-minute GCRA bucket (burst = the per-minute limit) plus the refund credit.
struct Bucket {
    limit: NonZeroU32,
    /// Time for one cell to replenish: a minute / limit.
    cell_period: Duration,
    gcra: Gcra,
    state: Mutex<BucketState>,
}

/// What governor does not expose: refund credit, and its remaining capacity at the last debit,
/// from which the remaining capacity at any later time follows (one cell per `cell_period`).
#[derive(Debug)]
struct BucketState {
    credit: u32,
    remaining_at_last_debit: u32,
    last_debit: Instant,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bucket")
            .field("limit", &self.limit)
            .field("state", &self.state)
            .finish()
    }
}

impl Bucket {
    fn per_minute(limit: NonZeroU32) -> Bucket {
        let gcra = RateLimiter::direct_with_clock(Quota::per_minute(limit), TokioClock)
            .with_middleware::<StateInformationMiddleware>();
        Bucket {
            limit,
            cell_period: Duration::from_secs(60) / limit.get(),
            gcra,
            state: Mutex::new(BucketState {
                credit: 0,
                remaining_at_last_debit: limit.get(),
                last_debit: Instant::now(),
            }),
        }
    }

    /// Takes `n` cells (credit first), or says how long until they would fit.
    fn debit(&self, n: u32) -> Result<(), Duration> {
        let now = Instant::now();
        let mut state = self.state.lock();
        self.trim_credit(&mut state, now);
        let from_credit = state.credit.min(n);
        let Some(from_gcra) = NonZeroU32::new(n - from_credit) else {
            state.credit -= from_credit;
            return Ok(());
        };
        match self.gcra.check_n(from_gcra) {
            Ok(Ok(snapshot)) => {
                state.credit -= from_credit;
                state.remaining_at_last_debit = snapshot.remaining_burst_capacity();
                state.last_debit = now;
                Ok(())
            }
            Ok(Err(not_until)) => Err(not_until.wait_time_from(TokioInstant::from(now))),
            // Callers check n against the limit first; treat it as a full window if not.
            Err(_insufficient) => Err(Duration::from_secs(60)),
        }
    }

    /// Cells spent and not yet replenished at `now`.
    fn spent(&self, now: Instant) -> u32 {
        self.limit.get() - self.status(now).remaining
    }

    /// Takes up to `n` cells at once, however few are left (a rebuilt bucket inheriting what its
    /// predecessor had spent).
    fn take(&self, n: u32) {
        let Some(n) = NonZeroU32::new(n.min(self.limit.get())) else {
            return;
        };
        let now = Instant::now();
        let mut state = self.state.lock();
        if let Ok(Ok(snapshot)) = self.gcra.check_n(n) {
            state.remaining_at_last_debit = snapshot.remaining_burst_capacity();
            state.last_debit = now;
        }
    }

    /// Returns `n` unused cells as credit.
    fn refund(&self, n: u32) {
        let now = Instant::now();
        let mut state = self.state.lock();
        state.credit = state.credit.saturating_add(n);
        self.trim_credit(&mut state, now);
    }

    /// Keeps credit + governor's remaining capacity within the bucket size.
    fn trim_credit(&self, state: &mut BucketState, now: Instant) {
        let room = self.limit.get() - self.gcra_remaining(state, now);
        state.credit = state.credit.min(room);
    }

    /// governor's remaining capacity at `now`: what was left at the last debit plus what has
    /// replenished since (may under-count by one cell: the fraction of a period is dropped).
    fn gcra_remaining(&self, state: &BucketState, now: Instant) -> u32 {
        let elapsed = now.saturating_duration_since(state.last_debit);
        let replenished = elapsed.as_nanos() / self.cell_period.as_nanos().max(1);
        let remaining = u128::from(state.remaining_at_last_debit) + replenished;
        remaining.min(u128::from(self.limit.get())) as u32
    }

    fn status(&self, now: Instant) -> BucketStatus {
        let state = self.state.lock();
        let remaining = (self.gcra_remaining(&state, now) + state.credit).min(self.limit.get());
        BucketStatus {
            limit: self.limit.get(),
            remaining,
            reset: self.cell_period * (self.limit.get() - remaining),
        }
    }
}

#[cfg(test)]
mod tests;

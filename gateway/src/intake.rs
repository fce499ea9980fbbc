//! Intake: what a tenant's request meets before admission, where it is still cheap to refuse.
//!
//! Reading a body (up to the body limit, at the client's pace), rendering the chat template
//! and tokenizing are the expensive steps before any per-tenant limit in admission. Without a
//! bound of their own, one valid key sending slow 4 MiB bodies or huge prompts could hold the
//! validation workers and stall every other tenant. So, per tenant:
//!
//! 1. **In-flight cap** ([`Intake::enter`]): at most `max_validating` requests of a tenant are
//!    being read, waiting for a validation worker, or validated. The excess is refused (429)
//!    from the headers alone, before a byte of its body is read. The [`IntakePermit`] is held
//!    until validation ends (the blocking task returns, even if the client left meanwhile), so
//!    the cap also bounds the CPU work a tenant has queued.
//! 2. **Weighted fair validation workers** ([`Intake::validate`]): the blocking threads that
//!    render and tokenize are a small fixed pool (CPU bound; more would only slow each other).
//!    Workers are shared by the tenants' policy `weight`, as the fair queue and the engine share
//!    their capacity: each tenant has a virtual clock that a grant advances by 1 / weight, and
//!    a worker that frees up goes to the waiting tenant whose clock is furthest behind (ties to
//!    the tenant served longest ago), within a tenant to its oldest waiter. A tenant that was
//!    idle starts at the current virtual time, so idleness banks no credit. A tenant with a
//!    backlog of huge prompts therefore delays another by at most one validation, and two
//!    backlogged tenants of weights 3 and 1 get three validations to one.
//!    A small body (at most [`INLINE_VALIDATION_BYTES`]) takes its worker the same way but is
//!    validated on the request's own task ([`Intake::validate_inline`]): its few microseconds
//!    of work cost less than the hand-off to a blocking thread and back. This relies on the
//!    chat template's step budget (`kvgate_runtime::chat_template`, ~10 ms for a conversation
//!    this small): without it, a template that never ends would hold an async worker for good.
//!
//! The request-rate debit that also runs before the body is admission's
//! ([`crate::admission::Admission::reserve_request`]): the buckets are admission's.
//! The HTTP side (the extractor that calls [`Intake::enter`]) is in `extract.rs`.

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroU32;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::policy::TenantPolicy;

/// Largest request body whose validation runs on the request's own task
/// ([`Intake::validate_inline`]); larger ones go to a blocking thread.
pub const INLINE_VALIDATION_BYTES: usize = 2048;

/// Per-tenant intake limits and the fair validation workers. Cheap to clone.
#[derive(Clone)]
pub struct Intake {
    shared: Arc<Shared>,
}

struct Shared {
    /// Validation workers in total (blocking threads running at once).
    workers: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Requests holding an [`IntakePermit`], per tenant (absent: none).
    in_flight: HashMap<Arc<str>, usize>,
    /// Workers in use.
    busy: usize,
    /// Tenants that hold workers or wait for one (absent: neither).
    tenants: HashMap<Arc<str>, TenantWorkers>,
    /// Grants so far; orders tenants by when they were last served.
    grants: u64,
    /// The virtual time of the last grant (see the module docs), in [`GRANT`] units.
    virtual_time: u128,
}

/// One grant in virtual-time units: a grant advances a tenant's clock by `GRANT / weight`.
/// Divisible by every weight up to 16 (and by many more), so the usual weights share exactly
/// (with a float, three grants of 1/3 can fall short of 1 and skew the turns).
const GRANT: u128 = 720_720 * 1_000_000;

struct TenantWorkers {
    held: usize,
    /// The grant number of this tenant's last worker (0: never served).
    last_served: u64,
    /// Where this tenant's virtual clock stands: each grant advances it by GRANT / weight.
    virtual_finish: u128,
    /// The tenant's policy weight, as of its latest request.
    weight: NonZeroU32,
    /// Oldest first. Bounded: every waiter holds one of the tenant's intake permits.
    waiters: VecDeque<oneshot::Sender<ValidationWorker>>,
}

/// Why [`Intake::enter`] refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntakeFull {
    pub tenant: String,
    /// The tenant's `max_validating`.
    pub limit: usize,
}

/// One request of a tenant in intake; dropping it leaves room for the next.
pub struct IntakePermit {
    shared: Arc<Shared>,
    tenant: Arc<str>,
    weight: NonZeroU32,
}

impl TenantWorkers {
    fn new(weight: NonZeroU32) -> TenantWorkers {
        TenantWorkers {
            held: 0,
            last_served: 0,
            virtual_finish: 0,
            weight,
            waiters: VecDeque::new(),
        }
    }
}

/// One validation worker, held by a tenant; dropping it hands the worker on fairly.
pub struct ValidationWorker {
    shared: Arc<Shared>,
    tenant: Arc<str>,
}

impl Intake {
    /// Intake with `workers` validation workers (at least one).
    pub fn new(workers: usize) -> Intake {
        Intake {
            shared: Arc::new(Shared {
                workers: workers.max(1),
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// Lets one more request of `tenant` into intake, unless it already has `max_validating`
    /// being read or validated.
    pub fn enter(&self, tenant: &TenantPolicy) -> Result<IntakePermit, IntakeFull> {
        let mut state = self.shared.state.lock();
        let name: Arc<str> = match state.in_flight.get_key_value(tenant.name.as_str()) {
            Some((name, _)) => Arc::clone(name),
            None => Arc::from(tenant.name.as_str()),
        };
        let count = state.in_flight.entry(Arc::clone(&name)).or_default();
        if *count >= tenant.max_validating {
            return Err(IntakeFull {
                tenant: tenant.name.clone(),
                limit: tenant.max_validating,
            });
        }
        *count += 1;
        Ok(IntakePermit {
            shared: Arc::clone(&self.shared),
            tenant: name,
            weight: tenant.weight,
        })
    }

    /// Runs `job` on a blocking thread once the permit's tenant gets a validation worker.
    /// The permit and the worker are released when `job` returns, also when the caller stops
    /// waiting (the client left): a running job cannot be stopped, and its CPU stays counted.
    /// `None` when the blocking task panicked.
    pub async fn validate<T: Send + 'static>(
        &self,
        permit: IntakePermit,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let worker = self.worker(&permit.tenant, permit.weight).await;
        tokio::task::spawn_blocking(move || {
            let _held = (permit, worker);
            job()
        })
        .await
        .ok()
    }

    /// [`Intake::validate`] for a job known to be small (a body of at most
    /// [`INLINE_VALIDATION_BYTES`]): the same fair worker grant, but the job runs on the
    /// calling task. Rendering and tokenizing a few KiB take microseconds, less than the hand-off
    /// to a blocking thread and back, which would be most of the request's cost in front of a
    /// fast upstream. `None` when the job panicked.
    pub async fn validate_inline<T>(
        &self,
        permit: IntakePermit,
        job: impl FnOnce() -> T,
    ) -> Option<T> {
        let worker = self.worker(&permit.tenant, permit.weight).await;
        let _held = (permit, worker);
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).ok()
    }

    /// Requests of `tenant` in intake now.
    pub fn in_flight(&self, tenant: &str) -> usize {
        let state = self.shared.state.lock();
        state.in_flight.get(tenant).copied().unwrap_or(0)
    }

    /// Waits for a validation worker for `tenant` of policy `weight` (see the module docs for
    /// the order).
    async fn worker(&self, tenant: &Arc<str>, weight: NonZeroU32) -> ValidationWorker {
        loop {
            let receiver = {
                let mut state = self.shared.state.lock();
                state
                    .tenants
                    .entry(Arc::clone(tenant))
                    .or_insert_with(|| TenantWorkers::new(weight))
                    .weight = weight;
                if state.busy < self.shared.workers {
                    // Free workers exist only while nobody waits: `release` hands a freed
                    // worker straight to a waiter.
                    state.grant(tenant);
                    return ValidationWorker {
                        shared: Arc::clone(&self.shared),
                        tenant: Arc::clone(tenant),
                    };
                }
                let (sender, receiver) = oneshot::channel();
                let entry = state
                    .tenants
                    .entry(Arc::clone(tenant))
                    .or_insert_with(|| TenantWorkers::new(weight));
                entry.waiters.push_back(sender);
                receiver
            };
            // A sender is only dropped unsent together with the state, which `self` keeps
            // alive; should it happen anyway, waiting again is the safe answer.
            if let Ok(worker) = receiver.await {
                return worker;
            }
        }
    }
}

impl State {
    /// Records a worker going to `tenant` (which has an entry: its caller made it) and
    /// advances its virtual clock.
    fn grant(&mut self, tenant: &Arc<str>) {
        self.busy += 1;
        self.grants += 1;
        let (grants, now) = (self.grants, self.virtual_time);
        let Some(entry) = self.tenants.get_mut(tenant) else {
            return;
        };
        entry.held += 1;
        entry.last_served = grants;
        let start = entry.virtual_finish.max(now);
        entry.virtual_finish = start + GRANT / u128::from(entry.weight.get());
        self.virtual_time = start;
    }

    /// The waiting tenant that gets the next free worker: the one whose virtual clock is
    /// furthest behind (an idle tenant's counts as now), then the one served longest ago.
    fn next_tenant(&self) -> Option<Arc<str>> {
        let now = self.virtual_time;
        self.tenants
            .iter()
            .filter(|(_, entry)| !entry.waiters.is_empty())
            .min_by_key(|(_, entry)| (entry.virtual_finish.max(now), entry.last_served))
            .map(|(name, _)| Arc::clone(name))
    }

    /// Forgets a tenant that neither holds nor waits for a worker.
    fn tidy(&mut self, tenant: &str) {
        if self
            .tenants
            .get(tenant)
            .is_some_and(|entry| entry.held == 0 && entry.waiters.is_empty())
        {
            self.tenants.remove(tenant);
        }
    }
}

impl Shared {
    /// A worker of `tenant` is free: hand it to the fairest waiter, or put it back.
    fn release(self: &Arc<Self>, tenant: &str) {
        let handoff = {
            let mut state = self.state.lock();
            state.busy = state.busy.saturating_sub(1);
            if let Some(entry) = state.tenants.get_mut(tenant) {
                entry.held = entry.held.saturating_sub(1);
            }
            state.tidy(tenant);
            state.next_tenant().and_then(|next| {
                let sender = state.tenants.get_mut(&next)?.waiters.pop_front()?;
                state.grant(&next);
                Some((next, sender))
            })
        };
        // Sent outside the lock: a waiter that is gone returns the worker, whose drop releases
        // it again (to the next waiter) and needs the lock.
        if let Some((next, sender)) = handoff {
            let worker = ValidationWorker {
                shared: Arc::clone(self),
                tenant: next,
            };
            drop(sender.send(worker));
        }
    }
}

impl Drop for ValidationWorker {
    fn drop(&mut self) {
        self.shared.release(&self.tenant);
    }
}

impl Drop for IntakePermit {
    fn drop(&mut self) {
        let mut state = self.shared.state.lock();
        if let Some(count) = state.in_flight.get_mut(&*self.tenant) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                state.in_flight.remove(&*self.tenant);
            }
        }
    }
}

impl std::fmt::Debug for IntakePermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IntakePermit")
            .field("tenant", &self.tenant)
            .finish()
    }
}

#[cfg(test)]
mod tests;

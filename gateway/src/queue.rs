//! Bounded per-tenant queues with weighted fair dequeue counted in tokens.
//!
//! Fairness follows the virtual token counter idea (VTC, "Fairness in Serving Large Language
//! Models", OSDI '24): each tenant has a counter of the tokens it was served divided by its
//! weight, and the next request comes from the eligible backlogged tenant with the smallest
//! counter. A tenant that becomes backlogged after being idle has its counter lifted to the
//! system's virtual time (the counter of the last request served), so idling never banks
//! credit. For continuously backlogged tenants i, j the normalised service never differs by more
//! than one request: |Wᵢ/wᵢ − Wⱼ/wⱼ| ≤ max(costᵢ/wᵢ, costⱼ/wⱼ). A tenant flooding its queue
//! therefore delays a newcomer by at most one of its own requests.
//!
//! Each tenant has one FIFO per lane (short/long prompts), so its short requests never wait
//! behind its own long ones. Whether an entry may start now (tenant concurrency, lane cap, KV
//! space) is the caller's decision, passed in as a predicate: this module is pure bookkeeping,
//! no clocks, no tasks, so it is tested exhaustively with proptest.

use std::collections::{BTreeMap, VecDeque};
use std::num::NonZeroU32;
use std::time::Instant;

/// Identifies a queued entry.
pub type EntryId = u64;

/// Counter units per token, so that dividing by a weight keeps precision in integers.
const COUNTER_SCALE: u128 = 1 << 16;

/// Requests are split by prompt length so short ones never wait behind long prefills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    Short,
    Long,
}

impl Lane {
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Short => "short",
            Lane::Long => "long",
        }
    }

    fn index(self) -> usize {
        match self {
            Lane::Short => 0,
            Lane::Long => 1,
        }
    }
}

/// A tenant's queue bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimits {
    pub max_requests: usize,
    pub max_tokens: u64,
}

/// Why an entry was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueFull {
    #[error("{queued} requests are already queued (limit {limit})")]
    Requests { queued: usize, limit: usize },
    #[error(
        "{queued} tokens are already queued; {requested} more would exceed the limit of {limit}"
    )]
    Tokens {
        queued: u64,
        requested: u64,
        limit: u64,
    },
}

/// What the caller supplies to queue something.
#[derive(Debug)]
pub struct NewEntry<T> {
    pub tenant: String,
    pub weight: NonZeroU32,
    pub lane: Lane,
    /// Cost in tokens (prompt + max output): what fairness and the token bound count.
    pub tokens: u64,
    pub limits: QueueLimits,
    pub enqueued_at: Instant,
    pub deadline: Instant,
    pub payload: T,
}

/// A queued request.
#[derive(Debug)]
pub struct QueueEntry<T> {
    pub id: EntryId,
    pub tenant: String,
    pub lane: Lane,
    pub tokens: u64,
    pub enqueued_at: Instant,
    pub deadline: Instant,
    pub payload: T,
}

/// How much one tenant has queued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantBacklog {
    pub tenant: String,
    pub requests: usize,
    pub tokens: u64,
}

/// One tenant's FIFOs and fairness counter.
#[derive(Debug)]
struct Flow<T> {
    lanes: [VecDeque<QueueEntry<T>>; 2],
    weight: NonZeroU32,
    /// Tokens served / weight, in `COUNTER_SCALE` units.
    counter: u128,
    queued_tokens: u64,
}

impl<T> Flow<T> {
    fn len(&self) -> usize {
        self.lanes.iter().map(VecDeque::len).sum()
    }
}

/// The queues of all tenants.
#[derive(Debug)]
pub struct FairQueue<T> {
    flows: BTreeMap<String, Flow<T>>,
    /// Counter of the last tenant served (before its charge); idle tenants are lifted to it.
    virtual_time: u128,
    next_id: EntryId,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue {
            flows: BTreeMap::new(),
            virtual_time: 0,
            next_id: 0,
            len: 0,
        }
    }
}

impl<T> FairQueue<T> {
    pub fn new() -> FairQueue<T> {
        FairQueue::default()
    }

    /// Queues an entry, or hands the payload back when the tenant's bounds are reached.
    pub fn push(&mut self, new: NewEntry<T>) -> Result<EntryId, (QueueFull, T)> {
        let virtual_time = self.virtual_time;
        let flow = self
            .flows
            .entry(new.tenant.clone())
            .or_insert_with(|| Flow {
                lanes: [VecDeque::new(), VecDeque::new()],
                weight: new.weight,
                counter: virtual_time,
                queued_tokens: 0,
            });
        let queued = flow.len();
        if queued >= new.limits.max_requests {
            return Err((
                QueueFull::Requests {
                    queued,
                    limit: new.limits.max_requests,
                },
                new.payload,
            ));
        }
        if flow.queued_tokens.saturating_add(new.tokens) > new.limits.max_tokens {
            let error = QueueFull::Tokens {
                queued: flow.queued_tokens,
                requested: new.tokens,
                limit: new.limits.max_tokens,
            };
            return Err((error, new.payload));
        }
        if queued == 0 {
            // Becoming backlogged: no credit for the time spent idle.
            flow.counter = flow.counter.max(virtual_time);
        }
        flow.weight = new.weight;
        flow.queued_tokens += new.tokens;
        let id = self.next_id;
        self.next_id += 1;
        flow.lanes[new.lane.index()].push_back(QueueEntry {
            id,
            tenant: new.tenant,
            lane: new.lane,
            tokens: new.tokens,
            enqueued_at: new.enqueued_at,
            deadline: new.deadline,
            payload: new.payload,
        });
        self.len += 1;
        Ok(id)
    }

    /// The entry that should start next among those `eligible` says may start: the oldest
    /// eligible lane head of the tenant with the smallest fairness counter.
    pub fn peek_next(
        &self,
        mut eligible: impl FnMut(&QueueEntry<T>) -> bool,
    ) -> Option<&QueueEntry<T>> {
        let mut best: Option<(u128, &QueueEntry<T>)> = None;
        for flow in self.flows.values() {
            let head = flow
                .lanes
                .iter()
                .filter_map(VecDeque::front)
                .filter(|entry| eligible(entry))
                .min_by_key(|entry| entry.id);
            if let Some(head) = head
                && best.is_none_or(|(counter, _)| flow.counter < counter)
            {
                best = Some((flow.counter, head));
            }
        }
        best.map(|(_, entry)| entry)
    }

    /// Removes an entry that is starting and charges its tenant for it.
    pub fn start(&mut self, id: EntryId) -> Option<QueueEntry<T>> {
        let entry = self.take(id)?;
        if let Some(flow) = self.flows.get_mut(&entry.tenant) {
            self.virtual_time = self.virtual_time.max(flow.counter);
            flow.counter +=
                u128::from(entry.tokens) * COUNTER_SCALE / u128::from(flow.weight.get());
        }
        self.forget_idle_flow(&entry.tenant);
        Some(entry)
    }

    /// Removes an entry without charging anyone (client gone, deadline passed).
    pub fn remove(&mut self, id: EntryId) -> Option<QueueEntry<T>> {
        let entry = self.take(id)?;
        self.forget_idle_flow(&entry.tenant);
        Some(entry)
    }

    /// Removes every entry `doomed` selects (abandoned or expired), without charging anyone.
    pub fn remove_where(
        &mut self,
        mut doomed: impl FnMut(&QueueEntry<T>) -> bool,
    ) -> Vec<QueueEntry<T>> {
        let ids: Vec<EntryId> = self.entries().filter(|e| doomed(e)).map(|e| e.id).collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// The earliest deadline of any queued entry.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries().map(|entry| entry.deadline).min()
    }

    /// Entries queued, all tenants.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens queued, all tenants.
    pub fn queued_tokens(&self) -> u64 {
        self.flows.values().map(|flow| flow.queued_tokens).sum()
    }

    /// What each tenant with queued entries has waiting.
    pub fn backlogs(&self) -> Vec<TenantBacklog> {
        let busy = self.flows.iter().filter(|(_, flow)| flow.len() > 0);
        busy.map(|(tenant, flow)| TenantBacklog {
            tenant: tenant.clone(),
            requests: flow.len(),
            tokens: flow.queued_tokens,
        })
        .collect()
    }

    /// Sum of the weights of tenants with queued entries.
    pub fn backlogged_weight(&self) -> u64 {
        let busy = self.flows.values().filter(|flow| flow.len() > 0);
        busy.map(|flow| u64::from(flow.weight.get())).sum()
    }

    /// Every queued entry, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = &QueueEntry<T>> {
        self.flows
            .values()
            .flat_map(|flow| flow.lanes.iter().flatten())
    }

    fn take(&mut self, id: EntryId) -> Option<QueueEntry<T>> {
        for flow in self.flows.values_mut() {
            for lane in &mut flow.lanes {
                if let Some(position) = lane.iter().position(|entry| entry.id == id) {
                    let entry = lane.remove(position)?;
                    flow.queued_tokens -= entry.tokens;
                    self.len -= 1;
                    return Some(entry);
                }
            }
        }
        None
    }

    /// Drops an idle tenant's state once it has nothing to remember: a counter at or below
    /// virtual time would be lifted to it anyway on the next push.
    fn forget_idle_flow(&mut self, tenant: &str) {
        if self
            .flows
            .get(tenant)
            .is_some_and(|flow| flow.len() == 0 && flow.counter <= self.virtual_time)
        {
            self.flows.remove(tenant);
        }
    }
}

#[cfg(test)]
mod tests;

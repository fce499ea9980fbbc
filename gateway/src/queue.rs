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
//!
//! Every operation costs O(log N) in the number of queued entries, or O(T) in the number of
//! backlogged tenants (picking the fairest head), never O(N): entries are found by id through
//! an index, each lane is an ordered map (ids grow, so id order is FIFO order) and deadlines
//! sit in an ordered set, so the admission actor's per-command work does not grow with the
//! queue.

use std::collections::{BTreeMap, BTreeSet, HashMap};
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

/// One tenant's FIFOs (ordered by id, which is arrival order) and fairness counter.
#[derive(Debug)]
struct Flow<T> {
    lanes: [BTreeMap<EntryId, QueueEntry<T>>; 2],
    weight: NonZeroU32,
    /// Tokens served / weight, in `COUNTER_SCALE` units.
    counter: u128,
    queued_tokens: u64,
}

impl<T> Flow<T> {
    fn len(&self) -> usize {
        self.lanes.iter().map(BTreeMap::len).sum()
    }
}

/// The queues of all tenants.
#[derive(Debug)]
pub struct FairQueue<T> {
    flows: BTreeMap<String, Flow<T>>,
    /// Where each queued entry is: its tenant and lane.
    index: HashMap<EntryId, (String, Lane)>,
    /// Every queued entry's deadline, earliest first.
    deadlines: BTreeSet<(Instant, EntryId)>,
    /// Sum of the weights of tenants with queued entries.
    backlogged_weight: u64,
    /// Counter of the last tenant served (before its charge); idle tenants are lifted to it.
    virtual_time: u128,
    next_id: EntryId,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue {
            flows: BTreeMap::new(),
            index: HashMap::new(),
            deadlines: BTreeSet::new(),
            backlogged_weight: 0,
            virtual_time: 0,
            next_id: 0,
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
                lanes: [BTreeMap::new(), BTreeMap::new()],
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
            self.backlogged_weight += u64::from(new.weight.get());
        } else {
            self.backlogged_weight += u64::from(new.weight.get());
            self.backlogged_weight -= u64::from(flow.weight.get());
        }
        flow.weight = new.weight;
        flow.queued_tokens += new.tokens;
        let id = self.next_id;
        self.next_id += 1;
        self.index.insert(id, (new.tenant.clone(), new.lane));
        self.deadlines.insert((new.deadline, id));
        flow.lanes[new.lane.index()].insert(
            id,
            QueueEntry {
                id,
                tenant: new.tenant,
                lane: new.lane,
                tokens: new.tokens,
                enqueued_at: new.enqueued_at,
                deadline: new.deadline,
                payload: new.payload,
            },
        );
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
                .filter_map(|lane| lane.first_key_value().map(|(_, entry)| entry))
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

    /// Removes every entry `doomed` selects, without charging anyone. O(N): for tests and
    /// rare bulk changes (a policy reload), never per command.
    pub fn remove_where(
        &mut self,
        mut doomed: impl FnMut(&QueueEntry<T>) -> bool,
    ) -> Vec<QueueEntry<T>> {
        let ids: Vec<EntryId> = self.entries().filter(|e| doomed(e)).map(|e| e.id).collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Removes the entry with the earliest deadline if that deadline is at or before `now`
    /// (without charging anyone).
    pub fn pop_expired(&mut self, now: Instant) -> Option<QueueEntry<T>> {
        let &(deadline, id) = self.deadlines.first()?;
        (deadline <= now).then(|| self.remove(id)).flatten()
    }

    /// The earliest deadline of any queued entry.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|(deadline, _)| *deadline)
    }

    /// The queued entry with this id.
    pub fn get(&self, id: EntryId) -> Option<&QueueEntry<T>> {
        let (tenant, lane) = self.index.get(&id)?;
        self.flows.get(tenant)?.lanes[lane.index()].get(&id)
    }

    /// The tenant's most recently queued entry (either lane).
    pub fn youngest(&self, tenant: &str) -> Option<&QueueEntry<T>> {
        let flow = self.flows.get(tenant)?;
        let tails = flow.lanes.iter().filter_map(|lane| lane.last_key_value());
        tails.max_by_key(|(id, _)| **id).map(|(_, entry)| entry)
    }

    /// The tenant's oldest queued entry (either lane).
    pub fn oldest(&self, tenant: &str) -> Option<&QueueEntry<T>> {
        let flow = self.flows.get(tenant)?;
        let heads = flow.lanes.iter().filter_map(|lane| lane.first_key_value());
        heads.min_by_key(|(id, _)| **id).map(|(_, entry)| entry)
    }

    /// What one tenant has queued; `None` when nothing.
    pub fn tenant_backlog(&self, tenant: &str) -> Option<TenantBacklog> {
        let flow = self.flows.get(tenant).filter(|flow| flow.len() > 0)?;
        Some(TenantBacklog {
            tenant: tenant.to_owned(),
            requests: flow.len(),
            tokens: flow.queued_tokens,
        })
    }

    /// How many of the tenant's requests are queued (either lane).
    pub fn queued_requests(&self, tenant: &str) -> usize {
        self.flows.get(tenant).map_or(0, |flow| flow.len())
    }

    /// Sets a backlogged tenant's weight (a policy reload changed it); a tenant that is not
    /// backlogged takes its weight from its next push.
    pub fn set_weight(&mut self, tenant: &str, weight: NonZeroU32) {
        if let Some(flow) = self.flows.get_mut(tenant)
            && flow.len() > 0
        {
            self.backlogged_weight -= u64::from(flow.weight.get());
            self.backlogged_weight += u64::from(weight.get());
            flow.weight = weight;
        }
    }

    /// Lets `keep` update every queued entry in arrival order (its `lane`, `deadline` and
    /// payload; not its tenant or tokens) or drop it; returns the dropped ones. Fairness
    /// counters and ids stay as they were. O(N log N): for policy reloads, not per command.
    pub fn rewrite(
        &mut self,
        mut keep: impl FnMut(&mut QueueEntry<T>) -> bool,
    ) -> Vec<QueueEntry<T>> {
        let mut all: Vec<QueueEntry<T>> = Vec::with_capacity(self.len());
        for flow in self.flows.values_mut() {
            for lane in &mut flow.lanes {
                all.extend(std::mem::take(lane).into_values());
            }
            flow.queued_tokens = 0;
        }
        all.sort_by_key(|entry| entry.id);
        self.index.clear();
        self.deadlines.clear();
        self.backlogged_weight = 0;
        let mut dropped = Vec::new();
        for mut entry in all {
            if !keep(&mut entry) {
                dropped.push(entry);
                continue;
            }
            let Some(flow) = self.flows.get_mut(&entry.tenant) else {
                dropped.push(entry);
                continue;
            };
            if flow.len() == 0 {
                self.backlogged_weight += u64::from(flow.weight.get());
            }
            flow.queued_tokens += entry.tokens;
            self.index
                .insert(entry.id, (entry.tenant.clone(), entry.lane));
            self.deadlines.insert((entry.deadline, entry.id));
            flow.lanes[entry.lane.index()].insert(entry.id, entry);
        }
        let tenants: Vec<String> = self.flows.keys().cloned().collect();
        for tenant in tenants {
            self.forget_idle_flow(&tenant);
        }
        dropped
    }

    /// Tenants with queued entries, with their weights.
    pub fn backlogged_tenants(&self) -> impl Iterator<Item = (&str, NonZeroU32)> {
        let busy = self.flows.iter().filter(|(_, flow)| flow.len() > 0);
        busy.map(|(tenant, flow)| (tenant.as_str(), flow.weight))
    }

    /// Entries queued, all tenants.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
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
        self.backlogged_weight
    }

    /// Every queued entry, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = &QueueEntry<T>> {
        self.flows
            .values()
            .flat_map(|flow| flow.lanes.iter().flat_map(BTreeMap::values))
    }

    /// Every queued entry's payload, mutably, in no particular order. The queue's own
    /// bookkeeping (tokens, deadlines, order) lives outside the payload and is not affected.
    pub fn payloads_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.flows.values_mut().flat_map(|flow| {
            flow.lanes
                .iter_mut()
                .flat_map(|lane| lane.values_mut().map(|entry| &mut entry.payload))
        })
    }

    fn take(&mut self, id: EntryId) -> Option<QueueEntry<T>> {
        let (tenant, lane) = self.index.remove(&id)?;
        let flow = self.flows.get_mut(&tenant)?;
        let entry = flow.lanes[lane.index()].remove(&id)?;
        flow.queued_tokens -= entry.tokens;
        if flow.len() == 0 {
            self.backlogged_weight -= u64::from(flow.weight.get());
        }
        self.deadlines.remove(&(entry.deadline, id));
        Some(entry)
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

//! Continuous-batching scheduler in the vLLM v1 style: every step spends a token budget.
//!
//! There are no prefill and decode phases. Each sequence simply moves `num_computed_tokens`
//! towards `len()`: a decode is 1 token, a prefill is a chunk of up to `long_prefill_threshold`
//! tokens, and both share one step. A step is built in this order:
//!
//! 1. **Decodes**, every running sequence that computes its last sampled token, in order.
//! 2. **The prefill cap.** While anything decodes, the prompt tokens of the step are capped so
//!    that its time, predicted by a cost model fitted to the engine's own measured steps
//!    ([`StepCostModel`]), stays within `target_step_time`: a decoding stream waits one step
//!    per token, so this bounds its inter-token latency however long the prompts queued behind
//!    it are (Sarathi-Serve's stall-free batching). With nothing decoding, prefill gets the
//!    whole budget. A whole prompt at most a quarter over the cap stretches it to fit, so a
//!    short chat's first token takes one step, not two ([`STRETCH_DIVISOR`]).
//! 3. **Prefill**, shared between the sequences with prompt left (running ones mid-prompt and
//!    waiting ones to admit). With [`PrefillOrder::TenantFair`] the tokens go to tenants by
//!    weighted deficit round robin ([`fair`]), so one tenant's flood of long prompts cannot
//!    hold back another tenant's short ones; within a tenant the shortest remaining prefill
//!    goes first, aged by [`AGING_TOKENS_PER_STEP`] per step waited so a long prompt cannot be
//!    passed forever. Tokens a sequence cannot use (no KV blocks, no slot) go to the others.
//!    [`PrefillOrder::Fcfs`] is the order before tenants were known here: running prefills,
//!    then the waiting queue first come first served.
//!
//! Waiting sequences are admitted only if nothing was preempted this step, while fewer than
//! `max_num_seqs` run and budget is left.
//!
//! When a running sequence cannot get the blocks for its next chunk, the scheduler preempts by
//! recompute: the victim's blocks go back (blocks drawn from its reservation back into that
//! reservation), its `num_computed_tokens` drops to 0, and it returns to the *front* of the
//! waiting queue. The victim is the least-computed (then newest) sequence among those whose
//! preemption frees shared blocks, preferring sequences that still compete for free blocks over
//! ones whose reservation covers all their remaining growth. If the best victim is the sequence
//! itself, it gives up its blocks and waits. (A sequence with only a partial reservation may be
//! made to forfeit it, see `pick_victim`, so two of them cannot wait on each other forever.)
//!
//! Waiting sequences whose reservation covers everything are admitted first (they take no
//! shared blocks) and rank first within their tenant; once one cannot get free blocks, only
//! sequences their own credit serves may be admitted after it, so nobody jumps the queue for
//! shared capacity.
//!
//! **Prefix cache.** A sequence with a cache salt looks up its longest cached prefix when it is
//! admitted (also after a preemption: it recomputes through the cache) and starts its prefill
//! after it; at least its last token is always computed, since the step needs its logits. The
//! lookup pins the blocks in the same critical section, so a hit cannot be evicted before use.
//! If the rest cannot get its blocks, the hit blocks go straight back (still cached): a waiting
//! sequence never holds blocks, which the preemption rules above rely on. After each step every
//! block that became full and computed is registered (prefill and decode alike). An admitted
//! sequence keeps only the reservation it can still draw: a hit found after the gateway sized
//! the reservation (a prefix another request computed meanwhile) gives the rest back at once.
//!
//! **Hold-back** (SGLang's cache-aware scheduling, for requests that share a prompt and arrive
//! together): a waiting sequence whose first uncached full block is being computed right now
//! by a running prefill (same hash, so same salt and same tokens up to that block's end) is
//! not admitted this step; it keeps its place and finds that block cached once it is done,
//! instead of computing the same prefix a second time. It waits only behind a sequence that
//! is scheduled in this very step, so it can never wait on one that is stalled, preempted or
//! gone: then it is admitted as usual.
//!
//! Integers only on the KV side: the scheduler never sees tensors, and never over-commits the
//! pool because every allocation goes through the pool's all-or-nothing `allocate_n`.

mod cost;
mod fair;

use std::cmp::Reverse;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::block_pool::{BlockHash, BlockPool};
use crate::kv_math::blocks_for_tokens;
use crate::sequence::{SeqId, SeqStatus, Sequence};

pub use cost::{StepCost, StepCostModel, StepShape, attended_by_chunk};
pub use fair::{TenantDemand, TenantShares};

/// How much a waiting prompt's rank improves per step it waits, in tokens of remaining
/// prefill: a prompt of L tokens can be passed by shorter ones of its own tenant only for
/// about L / 16 steps after its arrival, then it ranks ahead of everything that came later.
pub const AGING_TOKENS_PER_STEP: u64 = 16;

/// A whole prompt up to the prefill cap plus this fraction of it (1/4) stretches the cap so it
/// gets its first token from one step (`Scheduler::stretch_for_a_whole_prompt`).
pub const STRETCH_DIVISOR: usize = 4;

/// How the prompt tokens of a step are shared between sequences with prefill left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillOrder {
    /// Weighted deficit round robin over tokens between tenants; shortest remaining prefill
    /// first within a tenant, aged so long prompts are not starved.
    #[default]
    TenantFair,
    /// Running prefills in admission order, then waiting sequences first come first served,
    /// whoever they belong to (the behaviour before tenant fairness; kept for comparison).
    Fcfs,
}

/// Limits of one scheduler step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub block_size: usize,
    /// Most sequences running (holding blocks) at once.
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunks + decodes).
    pub max_batched_tokens: usize,
    /// Largest prefill chunk one sequence may take in a step, so a long prompt cannot starve
    /// the decodes; 0 means no cap beyond the budget.
    pub long_prefill_threshold: usize,
    /// While any sequence decodes, prompt tokens are added to a step only as far as its
    /// predicted time stays within this (what a decoding stream waits per token); `None`
    /// lets every step use the whole budget.
    pub target_step_time: Option<Duration>,
    pub prefill_order: PrefillOrder,
}

/// One sequence's part in a step. `index` points into [`Scheduler::running`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub index: usize,
    /// Position of the first token computed this step (= `num_computed_tokens` before it).
    pub start: usize,
    pub num_tokens: usize,
    /// The chunk reaches the end of the sequence, so the step yields a token for it.
    pub needs_logits: bool,
}

/// The outcome of [`Scheduler::schedule`]; reused across steps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScheduledBatch {
    /// Scheduled sequences in `running` order.
    pub seqs: Vec<ScheduledSeq>,
    pub num_tokens: usize,
    /// Sequences preempted while building this step.
    pub num_preempted: usize,
    /// The work of the step, as the cost model prices it.
    pub shape: StepShape,
    /// Most prompt tokens this step could take: the cost model's cap while something decodes
    /// under a target, else what the budget left after the decodes.
    pub prefill_cap: usize,
}

impl ScheduledBatch {
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// What a preempted sequence does with its reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Forfeit {
    KeepCredit,
    DropCredit,
}

/// A sequence with prompt left, and what this step gives it.
#[derive(Debug, Clone)]
struct PrefillCandidate {
    id: SeqId,
    /// Index of its tenant in `Scheduler::demands`.
    tenant: usize,
    waiting: bool,
    /// Rank within its tenant, smaller first: (needs shared blocks to be admitted, aged
    /// remaining prefill, id).
    rank: (bool, u64, SeqId),
    /// Tokens it could compute this step (remaining prefill, capped per sequence).
    want: usize,
    /// `want` is all of its remaining prompt: granted in full, it finishes its prefill.
    completes: bool,
    /// `want` is its whole prompt (nothing computed yet): granted in full, it gets its first
    /// token from this one step.
    whole: bool,
    /// Its part of its tenant's grant.
    granted: usize,
}

/// Waiting and running sequences and the step logic over them.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    pool: Arc<BlockPool>,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    preemptions_total: u64,
    /// Steps planned so far: the clock of `Sequence::arrival_step`.
    steps: u64,
    cost: StepCostModel,
    shares: TenantShares,
    /// This step's prefill plan and tenants (buffers reused every step).
    candidates: Vec<PrefillCandidate>,
    demands: Vec<TenantDemand>,
    decoding: Vec<SeqId>,
    /// The order this step plans prefill in: the configured one, or FCFS under KV pressure.
    order: PrefillOrder,
    /// Steps before `PrefillOrder::TenantFair` applies again after KV pressure.
    fcfs_until_step: u64,
    /// An admission failed for want of blocks this step.
    admission_blocked: bool,
    /// Prompt tokens of admitted sequences looked up in the prefix cache, and those found
    /// (first admissions only; vLLM's `prefix_cache_queries` / `_hits`).
    prefix_query_tokens: u64,
    prefix_hit_tokens: u64,
    /// Hashes of the full blocks that sequences scheduled for prefill in this step have yet
    /// to compute (rebuilt for every admission pass; see the hold-back in the module docs).
    in_flight: HashSet<BlockHash>,
    /// Sequences the hold-back deferred in this step, and how many (per sequence and step)
    /// since the start.
    held_back: HashSet<SeqId>,
    holdbacks_total: u64,
}

/// Steps of FCFS prefill after a preemption or an admission refused for blocks, see
/// [`Scheduler::schedule`].
const KV_PRESSURE_STEPS: u64 = 16;

impl Scheduler {
    pub fn new(config: SchedulerConfig, pool: Arc<BlockPool>) -> Scheduler {
        Scheduler {
            config,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions_total: 0,
            steps: 0,
            cost: StepCostModel::default(),
            shares: TenantShares::new(config.max_batched_tokens),
            candidates: Vec::new(),
            demands: Vec::new(),
            decoding: Vec::new(),
            order: config.prefill_order,
            fcfs_until_step: 0,
            admission_blocked: false,
            prefix_query_tokens: 0,
            prefix_hit_tokens: 0,
            in_flight: HashSet::new(),
            held_back: HashSet::new(),
            holdbacks_total: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a new sequence behind the others.
    pub fn add(&mut self, mut seq: Sequence) {
        seq.status = SeqStatus::Waiting;
        seq.arrival_step = self.steps;
        self.waiting.push_back(seq);
    }

    pub fn running(&self) -> &[Sequence] {
        &self.running
    }

    pub fn running_mut(&mut self) -> &mut [Sequence] {
        &mut self.running
    }

    pub fn waiting(&self) -> impl ExactSizeIterator<Item = &Sequence> {
        self.waiting.iter()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn preemptions_total(&self) -> u64 {
        self.preemptions_total
    }

    /// (prompt tokens looked up in the prefix cache, of which found), since the start.
    pub fn prefix_cache_tokens(&self) -> (u64, u64) {
        (self.prefix_query_tokens, self.prefix_hit_tokens)
    }

    /// Admissions the hold-back deferred so far (a sequence deferred for three steps counts
    /// three times).
    pub fn holdbacks_total(&self) -> u64 {
        self.holdbacks_total
    }

    /// The step cost model (its fit is what the prefill cap follows).
    pub fn cost_model(&self) -> &StepCostModel {
        &self.cost
    }

    /// Replaces the cost model (tests, and callers that know their machine).
    pub fn set_cost_model(&mut self, cost: StepCostModel) {
        self.cost = cost;
    }

    /// Feeds the measured wall time of the step `batch` described to the cost model.
    pub fn observe_step(&mut self, batch: &ScheduledBatch, elapsed: Duration) {
        self.cost.observe(&batch.shape, elapsed);
    }

    /// Prompt tokens `seq` could compute in one step.
    fn prefill_want(&self, seq: &Sequence) -> usize {
        let mut n = seq.num_uncomputed_tokens();
        if self.config.long_prefill_threshold > 0 {
            n = n.min(self.config.long_prefill_threshold);
        }
        n
    }

    /// Pins the longest cached prefix of a sequence that holds no blocks and marks those tokens
    /// computed. Never the whole sequence: its last token must run to give logits.
    fn reuse_cached_prefix(pool: &BlockPool, block_size: usize, seq: &mut Sequence) {
        let Some(salt) = seq.cache_salt.as_deref() else {
            return;
        };
        if !seq.block_table.is_empty() || seq.num_computed_tokens != 0 {
            return;
        }
        let max_blocks = Self::cacheable_blocks(pool, block_size, seq);
        let hit = pool.acquire_cached_prefix(
            salt,
            &seq.token_ids,
            max_blocks,
            &mut seq.credit,
            &mut seq.block_table,
            &mut seq.block_hashes,
        );
        seq.num_computed_tokens = hit * block_size;
    }

    /// How many leading blocks of `seq` the cache may serve: whole-prompt blocks only (a
    /// preempted sequence's generated tokens are recomputed as they were first computed, see
    /// [`Scheduler::postprocess`]), and never the block holding its last token.
    fn cacheable_blocks(pool: &BlockPool, block_size: usize, seq: &Sequence) -> usize {
        pool.cacheable_prefix_blocks(seq.len())
            .min(seq.prompt_len / block_size.max(1))
    }

    /// Gives back what [`Scheduler::reuse_cached_prefix`] pinned for a sequence that could not
    /// be admitted after all (the blocks stay cached).
    fn unpin_cached_prefix(pool: &BlockPool, seq: &mut Sequence) {
        pool.free_into(&seq.block_table, &mut seq.credit);
        seq.block_table.clear();
        seq.block_hashes.clear();
        seq.num_computed_tokens = 0;
    }

    /// Adds to `in_flight` the hashes of the full blocks of `seq` (a sequence scheduled for
    /// prefill this step) that it has not computed yet: it will register each of them as its
    /// prefill passes it, unless an identical block is cached by then.
    fn note_in_flight(pool: &BlockPool, in_flight: &mut HashSet<BlockHash>, seq: &mut Sequence) {
        let Some(salt) = seq.cache_salt.as_deref() else {
            return;
        };
        // Only prompt blocks are ever registered, so only they are worth waiting for.
        pool.extend_block_hashes(
            salt,
            &seq.token_ids[..seq.prompt_len],
            usize::MAX,
            &mut seq.token_block_hashes,
        );
        let computed = seq.block_hashes.len();
        if let Some(pending) = seq.token_block_hashes.get(computed..) {
            in_flight.extend(pending.iter().copied());
        }
    }

    /// Rebuilds `in_flight` from the running sequences that prefill in this step.
    fn collect_in_flight(&mut self) {
        self.in_flight.clear();
        for seq in &mut self.running {
            if seq.num_scheduled_tokens > 0 && !seq.is_decoding() {
                Self::note_in_flight(&self.pool, &mut self.in_flight, seq);
            }
        }
    }

    /// Whether `seq`, after [`Scheduler::reuse_cached_prefix`], should wait for a running
    /// prefill to compute its next full block rather than compute it too (the hold-back).
    fn waits_for_in_flight(
        pool: &BlockPool,
        in_flight: &HashSet<BlockHash>,
        seq: &mut Sequence,
    ) -> bool {
        let Some(salt) = seq.cache_salt.as_deref() else {
            return false;
        };
        let next = seq.block_hashes.len();
        if in_flight.is_empty() || next >= Self::cacheable_blocks(pool, pool.block_size(), seq) {
            return false;
        }
        pool.extend_block_hashes(salt, &seq.token_ids, next + 1, &mut seq.token_block_hashes);
        seq.token_block_hashes
            .get(next)
            .is_some_and(|hash| in_flight.contains(hash))
    }

    /// Allocates the blocks `seq` needs to compute `n` more tokens; all or nothing.
    fn grow(pool: &BlockPool, block_size: usize, seq: &mut Sequence, n: usize) -> bool {
        let needed = blocks_for_tokens(seq.num_computed_tokens + n, block_size)
            .saturating_sub(seq.block_table.len());
        pool.allocate_n(needed, &mut seq.credit, &mut seq.block_table)
    }

    /// Plans the next step into `batch`.
    ///
    /// Under KV pressure (a preemption, or an admission refused for want of blocks, in the
    /// last [`KV_PRESSURE_STEPS`] steps) prefill is planned FCFS whatever the configured
    /// order: the preemption and admission rules above keep sequences with partial or no
    /// reservations live in that order, while a fair order could keep admitting a sequence
    /// that must preempt itself before the one holding the blocks it needs finishes. The
    /// gateway reserves whole requests, so its sequences never meet that pressure.
    pub fn schedule(&mut self, batch: &mut ScheduledBatch) {
        batch.seqs.clear();
        batch.num_tokens = 0;
        batch.num_preempted = 0;
        batch.shape = StepShape::default();
        self.steps += 1;
        self.order = if self.steps < self.fcfs_until_step {
            PrefillOrder::Fcfs
        } else {
            self.config.prefill_order
        };
        self.admission_blocked = false;
        self.held_back.clear();
        let mut budget = self.config.max_batched_tokens;
        for seq in &mut self.running {
            seq.num_scheduled_tokens = 0;
        }

        // 1. Decodes, in running order.
        self.decoding.clear();
        let decoding = self.running.iter().filter(|s| s.is_decoding());
        self.decoding.extend(decoding.map(|s| s.id));
        for k in 0..self.decoding.len() {
            if budget == 0 {
                break;
            }
            let id = self.decoding[k];
            self.schedule_running(id, 1, &mut budget, batch, true);
        }

        // 2. and 3. The prefill cap, and prefill shared under it.
        let (running, waiting) = (&self.running, &self.waiting);
        self.shares
            .retain(|t| running.iter().chain(waiting).any(|s| &*s.label == t));
        self.plan_prefill(budget, batch);
        let mut prefill_left = budget.min(batch.prefill_cap);
        self.run_prefill_plan(&mut budget, &mut prefill_left, batch);
        if batch.num_preempted == 0 && self.running.is_empty() && !self.waiting.is_empty() {
            // Nothing runs and nobody could be admitted: partial credits may be waiting on
            // each other. Release them and try again with every waiting sequence.
            self.release_partial_waiting_credits();
            self.plan_prefill(budget, batch);
            prefill_left = budget.min(batch.prefill_cap);
            self.run_prefill_plan(&mut budget, &mut prefill_left, batch);
        }
        if batch.num_preempted > 0 || self.admission_blocked {
            self.fcfs_until_step = self.steps + KV_PRESSURE_STEPS;
        }

        for (index, seq) in self.running.iter().enumerate() {
            let n = seq.num_scheduled_tokens;
            if n == 0 {
                continue;
            }
            let start = seq.num_computed_tokens;
            batch.seqs.push(ScheduledSeq {
                index,
                start,
                num_tokens: n,
                needs_logits: start + n == seq.len(),
            });
            batch.num_tokens += n;
            if seq.is_decoding() {
                batch.shape.add_decode(start);
            } else {
                batch.shape.add_prefill(start, n);
            }
        }
    }

    /// Gives running sequence `id` `n` tokens this step in total, preempting others (or itself)
    /// for blocks when `may_preempt`. The caller guarantees the budget covers the increase.
    /// Returns whether it got them.
    fn schedule_running(
        &mut self,
        id: SeqId,
        n: usize,
        budget: &mut usize,
        batch: &mut ScheduledBatch,
        may_preempt: bool,
    ) -> bool {
        let block_size = self.config.block_size;
        loop {
            let Some(i) = self.running.iter().position(|s| s.id == id) else {
                return false;
            };
            let before = self.running[i].num_scheduled_tokens;
            if Self::grow(&self.pool, block_size, &mut self.running[i], n) {
                self.running[i].num_scheduled_tokens = n;
                *budget = (*budget + before).saturating_sub(n);
                return true;
            }
            if !may_preempt {
                return false;
            }
            let Some((victim, forfeit)) = self.pick_victim() else {
                // Preempting anyone would free nothing: this one sits out the step.
                return false;
            };
            *budget += self.running[victim].num_scheduled_tokens;
            self.preempt(victim, forfeit);
            batch.num_preempted += 1;
            if victim == i {
                return false; // it gave up its own blocks
            }
        }
    }

    /// Lists the sequences with prompt left (running ones, and waiting ones when admission is
    /// open), sets `batch.prefill_cap`, and shares the capped budget between them.
    fn plan_prefill(&mut self, budget: usize, batch: &mut ScheduledBatch) {
        let block_size = self.config.block_size;
        self.candidates.clear();
        self.demands.clear();
        let admit = batch.num_preempted == 0 && self.running.len() < self.config.max_num_seqs;
        let running = self
            .running
            .iter()
            .filter(|s| s.num_scheduled_tokens == 0 && !s.is_decoding())
            .map(|s| (s, false));
        let waiting = self.waiting.iter().filter(|_| admit).map(|s| (s, true));
        for (seq, is_waiting) in running.chain(waiting) {
            let want = self.prefill_want(seq);
            if want == 0 {
                continue;
            }
            let tenant = match self.demands.iter().position(|d| d.tenant == seq.label) {
                Some(t) => t,
                None => {
                    self.demands.push(TenantDemand {
                        tenant: Arc::clone(&seq.label),
                        weight: seq.weight.get(),
                        want: 0,
                        finish: 0,
                        granted: 0,
                    });
                    self.demands.len() - 1
                }
            };
            let demand = &mut self.demands[tenant];
            demand.weight = demand.weight.max(seq.weight.get());
            let remaining = seq.num_uncomputed_tokens() as u64;
            let aged = remaining + seq.arrival_step.saturating_mul(AGING_TOKENS_PER_STEP);
            let needs_shared = is_waiting && !seq.is_fully_covered(block_size);
            let completes = want == seq.num_uncomputed_tokens();
            self.candidates.push(PrefillCandidate {
                id: seq.id,
                tenant,
                waiting: is_waiting,
                rank: (needs_shared, aged, seq.id),
                want,
                completes,
                whole: completes && seq.num_computed_tokens == 0,
                granted: 0,
            });
        }

        batch.prefill_cap = self.stretch_for_a_whole_prompt(self.prefill_cap(budget), budget);
        let prefill_budget = budget.min(batch.prefill_cap);
        match self.order {
            PrefillOrder::Fcfs => {
                // Running in admission order, then the waiting queue, those whose reservation
                // covers them first (see `admit_pass`: they must not wait for a slot an
                // unreserved sequence holds while it waits for their reserved blocks).
                self.candidates.sort_by_key(|c| (c.waiting, c.rank.0));
                let mut left = prefill_budget;
                for c in &mut self.candidates {
                    c.granted = c.want.min(left);
                    left -= c.granted;
                }
            }
            PrefillOrder::TenantFair => {
                // When the free slots do not cover the waiting sequences whose reservation
                // covers them, those get the slots, whatever their tenants' shares: an
                // unreserved one holding the last slot while it waits for blocks they have
                // reserved would livelock both (the FCFS order gets this from `admit_pass`).
                let free_slots = self.config.max_num_seqs.saturating_sub(self.running.len());
                let covered = self.candidates.iter().filter(|c| c.waiting && !c.rank.0);
                if covered.count() >= free_slots {
                    self.candidates.retain(|c| !c.rank.0);
                }
                self.candidates.sort_by_key(|c| c.rank);
                // A tenant can use at most one waiting sequence per free slot.
                let mut slots = vec![0usize; self.demands.len()];
                for c in &self.candidates {
                    if c.waiting {
                        if slots[c.tenant] == free_slots {
                            continue;
                        }
                        slots[c.tenant] += 1;
                    }
                    let demand = &mut self.demands[c.tenant];
                    // The tenant's first sequence in plan order is the one its grant serves
                    // first: if its whole prompt fits, it may borrow to finish (fair.rs).
                    if demand.want == 0 && c.completes {
                        demand.finish = c.want;
                    }
                    demand.want += c.want;
                }
                self.shares.split(prefill_budget, &mut self.demands);
                let mut left: Vec<usize> = self.demands.iter().map(|d| d.granted).collect();
                for c in &mut self.candidates {
                    c.granted = c.want.min(left[c.tenant]);
                    left[c.tenant] -= c.granted;
                }
            }
        }
    }

    /// The most prompt tokens this step may take, see the module docs.
    fn prefill_cap(&self, budget: usize) -> usize {
        let Some(target) = self.config.target_step_time else {
            return budget;
        };
        let mut decodes = StepShape::default();
        for seq in self.running.iter().filter(|s| s.num_scheduled_tokens > 0) {
            decodes.add_decode(seq.num_computed_tokens);
        }
        if decodes.decode_seqs == 0 {
            return budget;
        }
        // Each prompt token attends to about the middle of what its sequence has left.
        let context = if self.candidates.is_empty() {
            0.0
        } else {
            let total: usize = self
                .candidates
                .iter()
                .map(|c| self.context_of(c.id, c.waiting) + c.want / 2)
                .sum();
            total as f64 / self.candidates.len() as f64
        };
        let floor = self.config.block_size;
        self.cost
            .prefill_cap(target, &decodes, context, floor, budget)
    }

    /// A prompt a little longer than the cap would otherwise need two steps for its first
    /// token, each a whole step of its time to first token (the short chat under a flood: ~40
    /// prompt tokens against a cap of ~35). If a candidate's whole prompt exceeds the cap by at
    /// most 1/[`STRETCH_DIVISOR`] of it, the cap grows to fit the shortest such prompt; the
    /// step then runs at most that much over the target (the cap's tokens are what the target
    /// leaves after the decodes), and only in the step that gives the prompt its first token.
    /// Prompts already under way never stretch a step: the long prompts of a flood would
    /// otherwise stretch every step that carries a last chunk.
    fn stretch_for_a_whole_prompt(&self, cap: usize, budget: usize) -> usize {
        if cap >= budget {
            return cap;
        }
        let limit = (cap + cap / STRETCH_DIVISOR).min(budget);
        self.candidates
            .iter()
            .filter(|c| c.whole && c.want > cap && c.want <= limit)
            .map(|c| c.want)
            .min()
            .unwrap_or(cap)
    }

    fn context_of(&self, id: SeqId, waiting: bool) -> usize {
        let found = if waiting {
            self.waiting.iter().find(|s| s.id == id)
        } else {
            self.running.iter().find(|s| s.id == id)
        };
        found.map_or(0, |s| s.num_computed_tokens)
    }

    /// Schedules the plan: first every candidate's grant (running ones, which may preempt
    /// for blocks, then admissions), then, work-conserving, what is left of the prefill budget
    /// to candidates in plan order up to what they could use.
    fn run_prefill_plan(
        &mut self,
        budget: &mut usize,
        prefill_left: &mut usize,
        batch: &mut ScheduledBatch,
    ) {
        for use_whole_want in [false, true] {
            for k in 0..self.candidates.len() {
                let c = &self.candidates[k];
                if c.waiting || *prefill_left == 0 || *budget == 0 {
                    continue;
                }
                let (id, limit) = (c.id, if use_whole_want { c.want } else { c.granted });
                let Some(seq) = self.running.iter().find(|s| s.id == id) else {
                    continue;
                };
                let before = seq.num_scheduled_tokens;
                let n = limit.min(before + (*prefill_left).min(*budget));
                if n <= before {
                    continue;
                }
                // Only a fair grant may preempt; extra tokens are taken only if blocks are free.
                if self.schedule_running(id, n, budget, batch, !use_whole_want) {
                    *prefill_left -= n - before;
                }
            }
            if batch.num_preempted == 0 {
                self.admit_pass(budget, prefill_left, true, use_whole_want);
                self.admit_pass(budget, prefill_left, false, use_whole_want);
            }
        }
        self.settle_shares();
    }

    /// Admits waiting candidates in plan order while slots and budget last. Sequences whose
    /// reservation covers their whole remaining growth go first: they take nothing from the
    /// shared blocks, and letting an unreserved sequence hold the last slot while it waits for
    /// blocks they have reserved would livelock both. Then the rest; once one cannot get free
    /// blocks, only sequences their own credit serves may pass it.
    fn admit_pass(
        &mut self,
        budget: &mut usize,
        prefill_left: &mut usize,
        only_fully_covered: bool,
        use_whole_want: bool,
    ) {
        let block_size = self.config.block_size;
        let mut head_blocked = false;
        if self.waiting.iter().any(|s| s.cache_salt.is_some()) {
            self.collect_in_flight();
        } else {
            self.in_flight.clear();
        }
        for k in 0..self.candidates.len() {
            if self.running.len() >= self.config.max_num_seqs || *budget == 0 || *prefill_left == 0
            {
                break;
            }
            let c = &self.candidates[k];
            if !c.waiting {
                continue;
            }
            let limit = if use_whole_want { c.want } else { c.granted };
            let Some(idx) = self.waiting.iter().position(|s| s.id == c.id) else {
                continue; // admitted already
            };
            let seq = &mut self.waiting[idx];
            let skip = only_fully_covered && !seq.is_fully_covered(block_size);
            if skip || limit.min(*budget).min(*prefill_left) == 0 {
                continue;
            }
            Self::reuse_cached_prefix(&self.pool, block_size, seq);
            if Self::waits_for_in_flight(&self.pool, &self.in_flight, seq) {
                // Keeps its place; the blocks it would compute are being computed this step.
                Self::unpin_cached_prefix(&self.pool, seq);
                if self.held_back.insert(seq.id) {
                    self.holdbacks_total += 1;
                }
                continue;
            }
            let n = limit
                .min(*budget)
                .min(*prefill_left)
                .min(seq.num_uncomputed_tokens());
            let needed = blocks_for_tokens(seq.num_computed_tokens + n, block_size)
                .saturating_sub(seq.block_table.len());
            if !only_fully_covered && head_blocked && needed > seq.credit.blocks() {
                Self::unpin_cached_prefix(&self.pool, seq);
                continue;
            }
            if !Self::grow(&self.pool, block_size, seq, n) {
                Self::unpin_cached_prefix(&self.pool, seq);
                head_blocked = true;
                self.admission_blocked = true;
                continue;
            }
            // The reservation was sized by the gateway from the prefix cached at admission;
            // blocks found since in the cache and shared with a running sequence cost nothing,
            // so what it can no longer draw goes back now, to admit the next request, instead
            // of idling until this one ends. It stays fully covered.
            seq.credit
                .release_beyond(seq.remaining_block_growth(block_size));
            if seq.num_preemptions == 0 && seq.cache_salt.is_some() {
                seq.num_cached_tokens = seq.num_computed_tokens.min(seq.prompt_len);
                self.prefix_query_tokens += seq.prompt_len as u64;
                self.prefix_hit_tokens += seq.num_cached_tokens as u64;
            }
            let Some(mut seq) = self.waiting.remove(idx) else {
                break;
            };
            seq.status = SeqStatus::Running;
            seq.num_scheduled_tokens = n;
            *budget -= n;
            *prefill_left -= n;
            // Later candidates with the same prompt wait for this one's blocks.
            Self::note_in_flight(&self.pool, &mut self.in_flight, &mut seq);
            self.running.push(seq);
        }
    }

    /// Credits each tenant the granted tokens its sequences could not use, and charges the
    /// extra ones they took.
    fn settle_shares(&mut self) {
        if self.order != PrefillOrder::TenantFair {
            return;
        }
        for (t, demand) in self.demands.iter().enumerate() {
            let used: usize = self
                .candidates
                .iter()
                .filter(|c| c.tenant == t)
                .filter_map(|c| self.running.iter().find(|s| s.id == c.id))
                .map(|s| s.num_scheduled_tokens)
                .sum();
            self.shares.settle(&demand.tenant, demand.granted, used);
        }
    }

    /// The running sequence to preempt, see the module docs, and whether it must also give up
    /// its reservation. `None` if no preemption can free anything.
    ///
    /// Candidates free shared blocks when preempted, or hold only a partial reservation from
    /// which they drew all their blocks: keeping that credit could leave two such sequences
    /// waiting on each other forever, so such a victim forfeits it (its guarantee was partial
    /// anyway; the gateway reserves whole requests). Fully covered sequences come last.
    fn pick_victim(&self) -> Option<(usize, Forfeit)> {
        let block_size = self.config.block_size;
        self.running
            .iter()
            .enumerate()
            .filter(|(_, seq)| {
                seq.releasable_blocks() > 0
                    || (!seq.block_table.is_empty() && !seq.is_fully_covered(block_size))
            })
            .min_by_key(|(_, seq)| {
                (
                    seq.is_fully_covered(block_size),
                    seq.num_computed_tokens,
                    Reverse(seq.id),
                )
            })
            .map(|(index, seq)| {
                let forfeit = if seq.releasable_blocks() > 0 {
                    Forfeit::KeepCredit
                } else {
                    Forfeit::DropCredit
                };
                (index, forfeit)
            })
    }

    /// Recompute preemption: blocks back, progress reset, front of the waiting queue.
    fn preempt(&mut self, index: usize, forfeit: Forfeit) {
        let mut seq = self.running.remove(index);
        match forfeit {
            Forfeit::KeepCredit => self.pool.free_into(&seq.block_table, &mut seq.credit),
            Forfeit::DropCredit => {
                self.pool.free(&seq.block_table);
                seq.credit = self.pool.empty_reservation();
            }
        }
        seq.block_table.clear();
        seq.block_hashes.clear();
        seq.num_computed_tokens = 0;
        seq.num_scheduled_tokens = 0;
        seq.num_preemptions += 1;
        seq.status = SeqStatus::Preempted;
        self.preemptions_total += 1;
        tracing::debug!(seq = %seq.id, tokens = seq.len(), "preempted (recompute)");
        self.waiting.push_front(seq);
    }

    /// With nothing running, waiting sequences that hold only part of what they need could
    /// each wait for the other's reserved blocks forever; release their credits so the head
    /// of the queue can use free blocks.
    fn release_partial_waiting_credits(&mut self) {
        let block_size = self.config.block_size;
        for seq in &mut self.waiting {
            if seq.credit.blocks() > 0 && !seq.is_fully_covered(block_size) {
                seq.credit = self.pool.empty_reservation();
            }
        }
    }

    /// Records the step's results: every scheduled sequence advances by its chunk, and each one
    /// that needed logits gets its sampled token (`sampled` is in `batch.seqs` logits order).
    pub fn postprocess(&mut self, batch: &ScheduledBatch, sampled: &[u32]) {
        let mut tokens = sampled.iter();
        for entry in &batch.seqs {
            let Some(seq) = self.running.get_mut(entry.index) else {
                continue;
            };
            seq.num_computed_tokens += entry.num_tokens;
            seq.num_scheduled_tokens = 0;
            // The step wrote these tokens' K/V: blocks it filled can serve other sequences.
            // Only whole-prompt blocks: a generated token's numbers come from the decode-step
            // attention order (`ReductionOrder::for_token`), and a later request that resends
            // it as prompt computes it in the prompt order, so a hit there would change that
            // request's output. Such a request registers those blocks itself, for the next.
            if let Some(salt) = seq.cache_salt.as_deref() {
                let computed_prompt = seq.num_computed_tokens.min(seq.prompt_len);
                self.pool.register_full_blocks(
                    salt,
                    &seq.block_table,
                    &seq.token_ids[..computed_prompt],
                    &mut seq.block_hashes,
                );
            }
            if entry.needs_logits
                && let Some(&token) = tokens.next()
            {
                seq.token_ids.push(token);
            }
        }
    }

    /// Removes every sequence (waiting or running) that `should_remove` selects, returning its
    /// blocks and the rest of its reservation to the pool now, and appends it to `removed`.
    pub fn remove_where(
        &mut self,
        mut should_remove: impl FnMut(&Sequence) -> bool,
        removed: &mut Vec<Sequence>,
    ) {
        let pool = &self.pool;
        let mut release = |mut seq: Sequence| {
            pool.free(&seq.block_table);
            seq.block_table.clear();
            seq.credit = pool.empty_reservation();
            seq.status = SeqStatus::Finished;
            removed.push(seq);
        };
        let mut i = 0;
        while i < self.running.len() {
            if should_remove(&self.running[i]) {
                release(self.running.remove(i));
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.waiting.len() {
            if should_remove(&self.waiting[i])
                && let Some(seq) = self.waiting.remove(i)
            {
                release(seq);
            } else {
                i += 1;
            }
        }
    }

    /// Removes the sequences marked `Finished`, see [`Scheduler::remove_where`].
    pub fn take_finished(&mut self, removed: &mut Vec<Sequence>) {
        self.remove_where(|seq| seq.status == SeqStatus::Finished, removed);
    }

    /// Allocated KV slots not holding a token, over running sequences.
    pub fn kv_waste_slots(&self) -> usize {
        self.running
            .iter()
            .map(|s| s.wasted_slots(self.config.block_size))
            .sum()
    }
}

#[cfg(test)]
mod tests;

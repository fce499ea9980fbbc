//! Continuous-batching scheduler in the vLLM v1 style: every step spends a token budget.
//!
//! There are no prefill and decode phases. Each sequence simply moves `num_computed_tokens`
//! towards `len()`: a decode is 1 token, a prefill is a chunk of up to `long_prefill_threshold`
//! tokens, and both share one step. Running sequences are served first, in order; waiting ones
//! are admitted after them, only if nothing was preempted this step, while fewer than
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
//! shared blocks); the rest FCFS, and once the head cannot get free blocks, only sequences their
//! own credit serves may pass it, so nobody jumps the queue for shared capacity.
//!
//! Integers only: the scheduler never sees tensors, and never over-commits the pool because
//! every allocation goes through the pool's all-or-nothing `allocate_n`.

use std::cmp::Reverse;
use std::collections::VecDeque;
use std::sync::Arc;

use crate::block_pool::BlockPool;
use crate::kv_math::blocks_for_tokens;
use crate::sequence::{SeqStatus, Sequence};

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

/// Waiting and running sequences and the step logic over them.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    pool: Arc<BlockPool>,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    preemptions_total: u64,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, pool: Arc<BlockPool>) -> Scheduler {
        Scheduler {
            config,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions_total: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a new sequence behind the others.
    pub fn add(&mut self, mut seq: Sequence) {
        seq.status = SeqStatus::Waiting;
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

    /// Tokens of a step for `seq` given what is left of the budget.
    fn chunk_size(&self, seq: &Sequence, budget: usize) -> usize {
        let mut n = seq.num_uncomputed_tokens().min(budget);
        if self.config.long_prefill_threshold > 0 {
            n = n.min(self.config.long_prefill_threshold);
        }
        n
    }

    /// Allocates the blocks `seq` needs to compute `n` more tokens; all or nothing.
    fn grow(pool: &BlockPool, block_size: usize, seq: &mut Sequence, n: usize) -> bool {
        let needed = blocks_for_tokens(seq.num_computed_tokens + n, block_size)
            .saturating_sub(seq.block_table.len());
        pool.allocate_n(needed, &mut seq.credit, &mut seq.block_table)
    }

    /// Plans the next step into `batch`.
    pub fn schedule(&mut self, batch: &mut ScheduledBatch) {
        batch.seqs.clear();
        batch.num_tokens = 0;
        batch.num_preempted = 0;
        let block_size = self.config.block_size;
        let mut budget = self.config.max_batched_tokens;
        for seq in &mut self.running {
            seq.num_scheduled_tokens = 0;
        }

        // 1. Running sequences, in order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let n = self.chunk_size(&self.running[i], budget);
            if n == 0 {
                i += 1;
                continue;
            }
            loop {
                if Self::grow(&self.pool, block_size, &mut self.running[i], n) {
                    self.running[i].num_scheduled_tokens = n;
                    budget -= n;
                    i += 1;
                    break;
                }
                let Some((victim, forfeit)) = self.pick_victim() else {
                    // Preempting anyone would free nothing: this one sits out the step.
                    i += 1;
                    break;
                };
                budget += self.running[victim].num_scheduled_tokens;
                self.preempt(victim, forfeit);
                batch.num_preempted += 1;
                if victim == i {
                    break; // it gave up its own blocks; the next sequence is now at `i`
                }
                if victim < i {
                    i -= 1;
                }
            }
        }

        // 2. Waiting sequences, only if nobody was preempted (they would just take back the
        //    blocks a running sequence lost).
        if batch.num_preempted == 0 {
            self.admit_waiting(&mut budget);
            if self.running.is_empty() && !self.waiting.is_empty() {
                self.release_partial_waiting_credits();
                self.admit_waiting(&mut budget);
            }
        }

        for (index, seq) in self.running.iter().enumerate() {
            if seq.num_scheduled_tokens > 0 {
                let start = seq.num_computed_tokens;
                batch.seqs.push(ScheduledSeq {
                    index,
                    start,
                    num_tokens: seq.num_scheduled_tokens,
                    needs_logits: start + seq.num_scheduled_tokens == seq.len(),
                });
                batch.num_tokens += seq.num_scheduled_tokens;
            }
        }
    }

    /// Moves waiting sequences into `running` while slots and budget last. Sequences whose
    /// reservation covers their whole remaining growth go first: they take nothing from the
    /// shared blocks, and letting an unreserved sequence hold the last slot while it waits for
    /// blocks they have reserved would livelock both. Then FCFS; once the head cannot get free
    /// blocks, only sequences their own credit serves may pass it.
    fn admit_waiting(&mut self, budget: &mut usize) {
        self.admit_pass(budget, true);
        self.admit_pass(budget, false);
    }

    fn admit_pass(&mut self, budget: &mut usize, only_fully_covered: bool) {
        let block_size = self.config.block_size;
        let mut idx = 0;
        let mut head_blocked = false;
        while idx < self.waiting.len()
            && self.running.len() < self.config.max_num_seqs
            && *budget > 0
        {
            let n = self.chunk_size(&self.waiting[idx], *budget);
            let seq = &mut self.waiting[idx];
            let needed = blocks_for_tokens(seq.num_computed_tokens + n, block_size)
                .saturating_sub(seq.block_table.len());
            let skip = if only_fully_covered {
                !seq.is_fully_covered(block_size)
            } else {
                head_blocked && needed > seq.credit.blocks()
            };
            if skip {
                idx += 1;
                continue;
            }
            if n == 0 || !Self::grow(&self.pool, block_size, seq, n) {
                head_blocked = true;
                idx += 1;
                continue;
            }
            let Some(mut seq) = self.waiting.remove(idx) else {
                break;
            };
            seq.status = SeqStatus::Running;
            seq.num_scheduled_tokens = n;
            *budget -= n;
            self.running.push(seq);
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

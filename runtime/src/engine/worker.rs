//! The engine thread's loop. Each iteration: take new requests, drop cancelled sequences,
//! schedule, lower to `BatchInputs`, run the backend, sample, record, stream events, remove
//! finished sequences, publish stats. All buffers (batch, inputs, logits, sampled ids) live in
//! the worker and are reused every step; the per-step histograms in the stats are fixed arrays.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc as tokio_mpsc;
use tokio::sync::mpsc::error::TrySendError;

use super::{Command, EngineStats, SeqSnapshot, Shared, TokenDecoder};
use crate::backend::{Backend, BatchInputs, SeqInputs};
use crate::batch::{build_inputs, slot_of};
use crate::block_pool::BlockPool;
use crate::kv_math::blocks_for_tokens;
use crate::sampler::Sampler;
use crate::scheduler::{
    ScheduledBatch, Scheduler, SchedulerConfig, StepCost, StepCostModel, StepShape,
};
use crate::sequence::{
    FinishReason, SamplingParams, SeqId, SeqStatus, Sequence, StopParams, TokenEvent,
};

/// How long a stalled engine (work queued, nothing schedulable: every free block is reserved
/// elsewhere) waits for a command before looking at the pool and cancellations again.
const STALL_POLL: Duration = Duration::from_millis(5);

/// The synthetic sequences [`Worker::calibrate`] times, as (prompt tokens, max_tokens). Their
/// steps differ in every term the cost model prices: one prefill of 136 tokens whose
/// attention reaches 96 deep, then decodes by three, two and one sequences at different
/// depths (each finishes at its max_tokens): 15 decode steps, enough that one descheduled
/// step on a busy machine does not decide the split between per-step and per-sequence cost.
/// Small enough for a 12-block pool of 16-token blocks and well under a second on a small
/// idle CPU.
const CALIBRATION: [(usize, usize); 3] = [(96, 4), (32, 8), (8, 16)];
/// Context of the decode steps [`Worker::calibrate`] times after [`CALIBRATION`] (capped by the
/// model's context and the pool), and how many. The calibration sequences attend at most ~100
/// tokens deep, where attention is a few percent of a step and moves together with the other
/// terms: the fit kept the attention coefficient at its prior (0.5 µs per attended token), and
/// admission's forecast of a 700 + 300-token request came out at 10.6 s against 14.6 s measured
/// on a two-core Xeon. One sequence decoding a thousand tokens deep is what long requests cost,
/// for a few tens of milliseconds of start-up.
const DEEP_DECODE_CONTEXT: usize = 1024;
const DEEP_DECODE_STEPS: usize = 6;
/// Runs first and is forgotten: the first forwards page in the weights and grow buffers,
/// which would read as a slow machine.
const CALIBRATION_WARMUP: [(usize, usize); 1] = [(8, 2)];
/// More steps than the calibration sequences can take; a stalled run stops here.
const CALIBRATION_MAX_STEPS: usize = 64;

pub(super) struct Worker {
    backend: Box<dyn Backend>,
    decoder: Arc<dyn TokenDecoder + Send + Sync>,
    pool: Arc<BlockPool>,
    scheduler: Scheduler,
    sampler: Sampler,
    commands: Receiver<Command>,
    /// Most sequences held in the waiting list before the command queue is left to fill up.
    max_waiting: usize,
    shared: Arc<Shared>,
    stats: EngineStats,
    batch: ScheduledBatch,
    inputs: BatchInputs,
    logits: Vec<f32>,
    sampled: Vec<u32>,
    removed: Vec<Sequence>,
    snapshots: Vec<SeqSnapshot>,
}

impl Worker {
    pub(super) fn new(
        backend: Box<dyn Backend>,
        decoder: Arc<dyn TokenDecoder + Send + Sync>,
        pool: Arc<BlockPool>,
        config: SchedulerConfig,
        max_waiting: usize,
        commands: Receiver<Command>,
        shared: Arc<Shared>,
    ) -> Worker {
        // Start from what `spawn` published (memory, peak), so the first publish keeps it.
        let stats = shared.stats.lock().clone();
        Worker {
            backend,
            decoder,
            scheduler: Scheduler::new(config, Arc::clone(&pool)),
            pool,
            sampler: Sampler::new(),
            commands,
            max_waiting,
            shared,
            stats,
            batch: ScheduledBatch::default(),
            inputs: BatchInputs::default(),
            logits: Vec::new(),
            sampled: Vec::new(),
            removed: Vec::new(),
            snapshots: Vec::new(),
        }
    }

    pub(super) fn run(mut self) {
        loop {
            if !self.take_commands() || self.shared.shutting_down.load(Ordering::Acquire) {
                break;
            }
            self.drop_cancelled();
            let progressed = self.step();
            self.publish();
            self.send_final_events();
            if !progressed && self.scheduler.has_work() && !self.wait_for_command() {
                break;
            }
        }
        self.abort_all("engine shut down");
        self.publish();
        self.send_final_events();
    }

    /// Moves queued commands into the scheduler. Blocks when there is nothing to do. Returns
    /// false when every handle is gone.
    fn take_commands(&mut self) -> bool {
        if !self.scheduler.has_work() {
            match self.commands.recv() {
                Ok(command) => self.apply(command),
                Err(_) => return false,
            }
        }
        while self.scheduler.num_waiting() < self.max_waiting {
            match self.commands.try_recv() {
                Ok(command) => self.apply(command),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
        true
    }

    /// Waits briefly for a command while stalled. Returns false when every handle is gone.
    fn wait_for_command(&mut self) -> bool {
        match self.commands.recv_timeout(STALL_POLL) {
            Ok(command) => {
                self.apply(command);
                true
            }
            Err(RecvTimeoutError::Timeout) => true,
            Err(RecvTimeoutError::Disconnected) => false,
        }
    }

    fn apply(&mut self, command: Command) {
        match command {
            Command::Submit(seq) => {
                self.stats.prompt_tokens_total += seq.prompt_len as u64;
                self.scheduler.add(*seq);
            }
            Command::Wake => {}
            Command::Calibrate { reply, max_context } => {
                let fit = self.calibrate(max_context);
                let _ = reply.send(fit);
            }
        }
    }

    /// See [`super::Engine::calibrate`]. Runs only while idle, so no request ever waits for
    /// it. Afterwards the scheduler starts afresh with the fitted cost model (no fairness
    /// state or step clock left over from the synthetic sequences) and the stats are as
    /// before, but for the fit.
    fn calibrate(&mut self, max_context: usize) -> StepCost {
        let block_size = self.scheduler.config().block_size;
        let blocks: usize = CALIBRATION
            .iter()
            .map(|&(prompt, max_tokens)| blocks_for_tokens(prompt + max_tokens, block_size))
            .sum();
        if self.scheduler.has_work() || blocks > self.pool.snapshot().free_blocks {
            tracing::debug!("step cost model not calibrated: engine busy or pool too small");
            return self.scheduler.cost_model().cost();
        }
        let saved = self.stats.clone();
        self.run_synthetic(&CALIBRATION_WARMUP);
        self.scheduler.set_cost_model(StepCostModel::default());
        self.run_synthetic(&CALIBRATION);
        let mut model = self.scheduler.cost_model().clone();
        self.time_deep_decodes(max_context, &mut model);
        self.scheduler = Scheduler::new(*self.scheduler.config(), Arc::clone(&self.pool));
        self.scheduler.set_cost_model(model);
        self.stats = EngineStats {
            step_cost: self.scheduler.cost_model().cost(),
            memory: self.stats.memory,
            peak_memory_bytes: self.stats.peak_memory_bytes,
            ..saved
        };
        self.publish();
        self.stats.step_cost
    }

    /// Times [`DEEP_DECODE_STEPS`] decodes of one sequence at [`DEEP_DECODE_CONTEXT`] (or the
    /// deepest the model and the free blocks allow) and feeds them to `model`. The context's
    /// blocks are drawn from the pool like a sequence's and freed afterwards (which drops any
    /// prefix-cache entry they held), so no live or cached K/V is touched; what they contain
    /// does not matter, only the time to read it. Skipped when the depth would not reach well
    /// beyond the calibration sequences', or the backend refuses the step.
    fn time_deep_decodes(&mut self, max_context: usize, model: &mut StepCostModel) {
        let block_size = self.scheduler.config().block_size;
        let free_blocks = self.pool.snapshot().free_blocks;
        let depth = DEEP_DECODE_CONTEXT
            .min(max_context)
            .min(free_blocks * block_size);
        if depth < 4 * CALIBRATION[0].0 {
            return;
        }
        let mut credit = self.pool.empty_reservation();
        let mut table = Vec::new();
        if !self.pool.allocate_n(
            blocks_for_tokens(depth, block_size),
            &mut credit,
            &mut table,
        ) {
            return;
        }
        let position = depth - 1;
        let mut inputs = BatchInputs::default();
        // Any id in the vocabulary: the logits are thrown away.
        inputs.token_ids.push(0);
        inputs.positions.push(position as u32);
        inputs
            .slot_mapping
            .push(slot_of(&table, position, block_size));
        inputs.seqs.push(SeqInputs {
            token_start: 0,
            num_tokens: 1,
            context_len: depth,
            block_table: table,
            needs_logits: true,
            // A decode: the token is a generated one.
            prompt_len: 0,
        });
        let mut shape = StepShape::default();
        shape.add_decode(position);
        for _ in 0..DEEP_DECODE_STEPS {
            let started = Instant::now();
            if let Err(e) = self.backend.forward(&inputs, &mut self.logits) {
                tracing::debug!("deep decode calibration skipped: {e}");
                break;
            }
            model.observe(&shape, started.elapsed());
        }
        self.pool.free(&inputs.seqs[0].block_table);
    }

    /// Runs `seqs` (prompt tokens, max_tokens) of arbitrary in-vocabulary tokens to the end,
    /// ignoring end-of-generation, and drops their events.
    fn run_synthetic(&mut self, seqs: &[(usize, usize)]) {
        let vocab = self.backend.vocab_size().max(1);
        let mut streams = Vec::with_capacity(seqs.len());
        for (i, &(prompt_len, max_tokens)) in seqs.iter().enumerate() {
            // Spread over the vocabulary; the ids only need to be valid.
            let prompt = (0..prompt_len)
                .map(|t| ((t * 7919 + i * 104_729 + 1) % vocab) as u32)
                .collect();
            let (sender, events) = tokio_mpsc::channel(max_tokens + 4);
            let stop = StopParams {
                max_tokens,
                ignore_eos: true,
                ..StopParams::default()
            };
            self.scheduler.add(Sequence::new(
                SeqId(u64::MAX - i as u64),
                Arc::from("calibration"),
                prompt,
                SamplingParams::default(),
                stop,
                self.pool.empty_reservation(),
                sender,
            ));
            streams.push(events);
        }
        for _ in 0..CALIBRATION_MAX_STEPS {
            if !self.scheduler.has_work() || !self.step() {
                break;
            }
            self.removed.clear();
        }
        self.scheduler.remove_where(|_| true, &mut self.removed);
        self.removed.clear();
    }

    /// A closed event channel means the caller went away: free the sequence now.
    fn drop_cancelled(&mut self) {
        let first = self.removed.len();
        self.scheduler
            .remove_where(|seq| seq.events.is_closed(), &mut self.removed);
        for seq in &self.removed[first..] {
            tracing::debug!(seq = %seq.id, "cancelled by the client");
            self.stats.cancellations_total += 1;
        }
    }

    /// One scheduler step. Returns false when nothing could be scheduled.
    fn step(&mut self) -> bool {
        let scheduled_at = Instant::now();
        self.scheduler.schedule(&mut self.batch);
        self.stats.preemptions_total = self.scheduler.preemptions_total();
        (
            self.stats.prefix_cache_queries_total,
            self.stats.prefix_cache_hits_total,
        ) = self.scheduler.prefix_cache_tokens();
        if self.batch.is_empty() {
            return false;
        }
        // Show this step's allocations while the (long) forward runs.
        self.publish();
        let started = Instant::now();
        let block_size = self.scheduler.config().block_size;
        let lowered = build_inputs(
            &self.batch,
            self.scheduler.running(),
            block_size,
            &mut self.inputs,
        );
        let result = match lowered {
            Ok(()) => self.forward(),
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(()) => {
                self.stats.prefill_tokens_computed_total += self.batch.shape.prefill_tokens as u64;
                self.scheduler.postprocess(&self.batch, &self.sampled);
                self.emit_tokens();
            }
            Err(message) => self.fail_batch(&message),
        }
        self.scheduler.take_finished(&mut self.removed);
        self.stats.steps += 1;
        self.stats.last_batch_seqs = self.batch.seqs.len();
        self.stats.last_batch_tokens = self.batch.num_tokens;
        self.stats.batch_seqs.record(self.batch.seqs.len() as u64);
        self.stats.batch_tokens.record(self.batch.num_tokens as u64);
        self.stats.last_step_micros = started.elapsed().as_micros() as u64;
        // The whole step, as a decoding stream waits for it, feeds the cost model the prefill
        // cap follows.
        let step_time = scheduled_at.elapsed();
        self.scheduler.observe_step(&self.batch, step_time);
        self.stats.step_micros.record(step_time.as_micros() as u64);
        self.stats.prefill_cap_tokens = self.batch.prefill_cap;
        self.stats.step_cost = self.scheduler.cost_model().cost();
        true
    }

    /// Runs the backend and samples one token per sequence that needs logits.
    fn forward(&mut self) -> Result<(), String> {
        self.backend
            .forward(&self.inputs, &mut self.logits)
            .map_err(|e| e.to_string())?;
        let memory = self.backend.memory();
        self.stats.memory = memory;
        self.stats.peak_memory_bytes = self.stats.peak_memory_bytes.max(memory.total_bytes());
        let vocab = self.backend.vocab_size();
        let rows = self.inputs.num_logits_rows();
        if self.logits.len() < rows * vocab {
            return Err(format!(
                "backend returned {} logits for {rows} rows of {vocab}",
                self.logits.len()
            ));
        }
        self.sampled.clear();
        let running = self.scheduler.running_mut();
        let mut rows_iter = self.logits.chunks_exact(vocab);
        for entry in self.batch.seqs.iter().filter(|e| e.needs_logits) {
            let (Some(row), Some(seq)) = (rows_iter.next(), running.get_mut(entry.index)) else {
                return Err("logits rows do not match the batch".into());
            };
            self.sampled
                .push(self.sampler.sample(row, &seq.sampling, &mut seq.rng));
        }
        Ok(())
    }

    /// Streams the token each sequence just got and applies the stop conditions.
    fn emit_tokens(&mut self) {
        let running = self.scheduler.running_mut();
        for entry in self.batch.seqs.iter().filter(|e| e.needs_logits) {
            let Some(seq) = running.get_mut(entry.index) else {
                continue;
            };
            let Some(&id) = seq.token_ids.last() else {
                continue;
            };
            self.stats.generation_tokens_total += 1;
            seq.first_token_at.get_or_insert_with(Instant::now);
            let bytes = if self.decoder.is_special(id) {
                &[][..]
            } else {
                self.decoder.token_bytes(id)
            };
            let delta = seq.output.push(bytes);
            let reason = if delta.stopped || (!seq.stop.ignore_eos && self.decoder.is_eog(id)) {
                Some(FinishReason::Stop)
            } else if seq.num_output_tokens() >= seq.stop.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            let mut text = delta.text;
            if reason.is_some() && !delta.stopped {
                text.push_str(&seq.output.finish());
            }
            let delivered = send(seq, TokenEvent::Token { id, text });
            if let Some(reason) = reason {
                seq.status = SeqStatus::Finished;
                self.stats.finished_total += 1;
                seq.final_event = Some(TokenEvent::Finished {
                    reason,
                    prompt_tokens: seq.prompt_len,
                    completion_tokens: seq.num_output_tokens(),
                    cached_tokens: seq.num_cached_tokens,
                });
            } else if !delivered {
                seq.status = SeqStatus::Finished;
                self.stats.cancellations_total += 1;
            }
        }
    }

    /// The step failed: every sequence in it gets an error and is removed.
    fn fail_batch(&mut self, message: &str) {
        tracing::error!(
            error = message,
            seqs = self.batch.seqs.len(),
            "engine step failed"
        );
        let running = self.scheduler.running_mut();
        for entry in &self.batch.seqs {
            if let Some(seq) = running.get_mut(entry.index) {
                seq.final_event = Some(TokenEvent::Error(message.to_string()));
                seq.status = SeqStatus::Finished;
                self.stats.errors_total += 1;
            }
        }
    }

    fn abort_all(&mut self, message: &str) {
        let first = self.removed.len();
        self.scheduler.remove_where(|_| true, &mut self.removed);
        for seq in &mut self.removed[first..] {
            seq.final_event = Some(TokenEvent::Error(message.to_string()));
            self.stats.errors_total += 1;
        }
    }

    /// Ends the streams of removed sequences; their blocks are already back in the pool and the
    /// published stats already count them.
    fn send_final_events(&mut self) {
        for mut seq in self.removed.drain(..) {
            if let Some(event) = seq.final_event.take() {
                send(&seq, event);
            }
        }
    }

    /// Copies stats and per-sequence snapshots where the handles can read them.
    fn publish(&mut self) {
        self.stats.running = self.scheduler.running().len();
        self.stats.waiting = self.scheduler.num_waiting();
        self.stats.kv_waste_slots = self.scheduler.kv_waste_slots();
        self.snapshots.clear();
        let live = self
            .scheduler
            .running()
            .iter()
            .chain(self.scheduler.waiting());
        self.snapshots.extend(live.map(snapshot));
        self.shared.stats.lock().clone_from(&self.stats);
        self.shared.snapshots.lock().clone_from(&self.snapshots);
    }
}

fn snapshot(seq: &Sequence) -> SeqSnapshot {
    SeqSnapshot {
        id: seq.id,
        label: Arc::clone(&seq.label),
        state: seq.status,
        prompt_tokens: seq.prompt_len,
        output_tokens: seq.num_output_tokens(),
        computed_tokens: seq.num_computed_tokens,
        scheduled_tokens: seq.num_scheduled_tokens,
        blocks: seq.block_table.len(),
        reserved_blocks: seq.credit.blocks(),
        preemptions: seq.num_preemptions,
    }
}

/// Sends without blocking. False when the receiver is gone (or, against the sizing contract,
/// full): either way the caller treats the sequence as cancelled.
fn send(seq: &Sequence, event: TokenEvent) -> bool {
    match seq.events.try_send(event) {
        Ok(()) => true,
        Err(TrySendError::Closed(_)) => false,
        Err(TrySendError::Full(_)) => {
            tracing::warn!(seq = %seq.id, "event channel full; cancelling the sequence");
            false
        }
    }
}

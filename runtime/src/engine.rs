//! The engine: a dedicated thread that owns the scheduler and the backend, and a cheap `Clone`
//! handle ([`Engine`]) that the gateway and the CLI use to submit requests and read state.
//!
//! Requests cross into the engine thread through a bounded command channel; tokens come back on
//! a per-request bounded tokio channel sized so the engine never blocks on a slow reader
//! (capacity `max_tokens + 4`; at most `max_tokens + 1` events are ever sent). Dropping the
//! [`GenerationHandle`] closes that channel, which the engine treats as cancellation: the
//! sequence is removed and its blocks are back in the pool by the next step. A stream's final
//! `Finished`/`Error` is sent only after the sequence's blocks and reservation are back in the
//! pool and the stats count it.
//!
//! Shutdown (explicit, or when the last `Engine` handle is dropped) aborts: every waiting and
//! running sequence receives `TokenEvent::Error("engine shut down")` and the thread exits. A
//! graceful drain is the gateway's job (stop admitting, wait for streams), before it calls this.

mod config;
mod stats;
mod worker;

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::thread::JoinHandle;

use parking_lot::Mutex;
use tokio::sync::mpsc as tokio_mpsc;

use crate::backend::Backend;
use crate::block_pool::{BlockPool, Reservation};
use crate::kv_math::blocks_for_tokens;
use crate::tokenizer::Tokenizer;

pub use self::config::{DEFAULT_TARGET_ITL, EngineConfig, MAX_COMMAND_QUEUE};
pub use self::stats::{
    EngineStats, STEP_BUCKET_BOUNDS, STEP_MICROS_BUCKET_BOUNDS, SeqSnapshot, StepDurationHistogram,
    StepHistogram,
};
pub use crate::scheduler::{PrefillOrder, StepCost};
pub use crate::sequence::{
    FinishReason, SamplingParams, SeqId, SeqStatus, Sequence, StopParams, TokenEvent,
};

/// What the engine needs from a tokenizer to stream text and detect the end of generation.
pub trait TokenDecoder: Send + Sync {
    /// Raw bytes of a token (may be part of a UTF-8 character).
    fn token_bytes(&self, id: u32) -> &[u8];
    /// End-of-generation token (eos, eot, `<|im_end|>`…).
    fn is_eog(&self, id: u32) -> bool;
    /// Special tokens produce no text in the stream.
    fn is_special(&self, id: u32) -> bool;
}

impl TokenDecoder for Tokenizer {
    fn token_bytes(&self, id: u32) -> &[u8] {
        Tokenizer::token_bytes(self, id)
    }
    fn is_eog(&self, id: u32) -> bool {
        Tokenizer::is_eog(self, id)
    }
    fn is_special(&self, id: u32) -> bool {
        Tokenizer::is_special(self, id)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine config: {0}")]
    InvalidConfig(String),
    #[error("could not start the engine thread: {0}")]
    Spawn(#[from] std::io::Error),
}

/// Why a request was not accepted. Nothing was queued; its reservation has been released.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("engine queue is full")]
    QueueFull,
    #[error("request needs {needed_blocks} KV blocks but the whole pool has {total}")]
    TooLong { needed_blocks: usize, total: usize },
    #[error("engine has shut down")]
    ShutDown,
    #[error("invalid request: {0}")]
    InvalidRequest(String),
}

/// One generation job.
#[derive(Debug)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopParams,
    /// Capacity reserved by admission on this engine's pool; `None` draws on free blocks only.
    pub reservation: Option<Reservation>,
    /// Tenant name: shown by `inspect`, and the unit the scheduler shares prompt tokens
    /// between.
    pub label: String,
    /// The tenant's fair-share weight (the policy's `weight`); requests without a tenant use 1.
    pub weight: NonZeroU32,
    /// Prefix-cache salt: requests share cached prompt blocks only with requests of the same
    /// salt, so the gateway sets it from the authenticated tenant (never from the client)
    /// unless the tenant's policy shares its cache. `None`: this request neither reads nor
    /// fills the cache.
    pub cache_salt: Option<String>,
}

impl GenerationRequest {
    /// Greedy decoding of at most `max_tokens` after `prompt`, stopping at EOS, with no
    /// reservation (benchmarks, tests, the CLI's plain runs).
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize, label: impl Into<String>) -> Self {
        GenerationRequest {
            prompt,
            sampling: SamplingParams::default(),
            stop: StopParams {
                max_tokens,
                ..StopParams::default()
            },
            reservation: None,
            cache_salt: None,
            label: label.into(),
            weight: NonZeroU32::MIN,
        }
        .with_cache_salt_from_label()
    }

    /// Uses the label (the tenant) as the prefix-cache salt: the default isolation.
    pub fn with_cache_salt_from_label(mut self) -> Self {
        self.cache_salt = Some(self.label.clone());
        self
    }

    /// Keeps generating past EOS until `max_tokens` (fixed-length benchmark runs).
    pub fn ignoring_eos(mut self) -> Self {
        self.stop.ignore_eos = true;
        self
    }
}

/// The caller's end of a request. Dropping it (or `events`) cancels the sequence.
#[derive(Debug)]
pub struct GenerationHandle {
    pub id: SeqId,
    pub events: tokio_mpsc::Receiver<TokenEvent>,
}

enum Command {
    Submit(Box<Sequence>),
    /// Look at the shutdown flag now.
    Wake,
    /// Fit the step cost model with synthetic steps ([`Engine::calibrate`]) and answer with
    /// the fit; `max_context` (the model's) bounds the deep decodes.
    Calibrate {
        reply: SyncSender<StepCost>,
        max_context: usize,
    },
}

/// State shared between handles and the engine thread.
struct Shared {
    stats: Mutex<EngineStats>,
    snapshots: Mutex<Vec<SeqSnapshot>>,
    /// Set by `shutdown`; the engine checks it every loop iteration.
    shutting_down: AtomicBool,
}

struct Inner {
    commands: SyncSender<Command>,
    pool: Arc<BlockPool>,
    shared: Arc<Shared>,
    config: EngineConfig,
    vocab_size: usize,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Handle to a running engine; clones share it.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Starts the engine thread over `backend`, with a fresh block pool of `config.num_blocks`.
    pub fn spawn(
        backend: Box<dyn Backend>,
        decoder: Arc<dyn TokenDecoder + Send + Sync>,
        config: EngineConfig,
    ) -> Result<Engine, EngineError> {
        config.validate()?;
        let vocab_size = backend.vocab_size();
        if vocab_size == 0 {
            return Err(EngineError::InvalidConfig(
                "backend reports an empty vocabulary".into(),
            ));
        }
        let pool = BlockPool::new(config.num_blocks, config.block_size, config.bytes_per_block);
        // Published before the thread starts: memory (weights, KV) is known before any step.
        let memory = backend.memory();
        let initial = EngineStats {
            memory,
            peak_memory_bytes: memory.total_bytes(),
            prefill_cap_tokens: config.max_batched_tokens,
            step_cost: crate::scheduler::StepCostModel::default().cost(),
            target_step_micros: config.target_itl.map(|t| t.as_micros() as u64),
            prefix_caching: config.prefix_caching,
            ..EngineStats::default()
        };
        let shared = Arc::new(Shared {
            stats: Mutex::new(initial),
            snapshots: Mutex::new(Vec::new()),
            shutting_down: AtomicBool::new(false),
        });
        let (commands, receiver) = mpsc::sync_channel(config.command_queue);
        let worker = worker::Worker::new(
            backend,
            decoder,
            Arc::clone(&pool),
            config.scheduler(),
            config.command_queue,
            receiver,
            Arc::clone(&shared),
        );
        let thread = std::thread::Builder::new()
            .name("kvgate-engine".into())
            .spawn(move || worker.run())?;
        Ok(Engine {
            inner: Arc::new(Inner {
                commands,
                pool,
                shared,
                config,
                vocab_size,
                next_id: AtomicU64::new(1),
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.inner.pool
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Queues a request. Fails fast (never blocks): a full queue is `QueueFull`.
    pub fn submit(&self, req: GenerationRequest) -> Result<GenerationHandle, SubmitError> {
        if self.inner.shared.shutting_down.load(Ordering::Acquire) {
            return Err(SubmitError::ShutDown);
        }
        self.check(&req)?;
        let id = SeqId(self.inner.next_id.fetch_add(1, Ordering::Relaxed));
        let credit = match req.reservation {
            Some(reservation) => reservation,
            None => self.inner.pool.empty_reservation(),
        };
        // Token events ≤ max_tokens, then one Finished or Error: the engine never waits.
        let (sender, events) = tokio_mpsc::channel(req.stop.max_tokens + 4);
        let label: Arc<str> = req.label.into();
        let mut seq = Sequence::new(
            id,
            label,
            req.prompt,
            req.sampling,
            req.stop,
            credit,
            sender,
        );
        seq.weight = req.weight;
        if self.inner.config.prefix_caching {
            seq.cache_salt = req.cache_salt.map(Arc::from);
        }
        match self.inner.commands.try_send(Command::Submit(Box::new(seq))) {
            Ok(()) => Ok(GenerationHandle { id, events }),
            Err(TrySendError::Full(_)) => Err(SubmitError::QueueFull),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::ShutDown),
        }
    }

    fn check(&self, req: &GenerationRequest) -> Result<(), SubmitError> {
        let config = &self.inner.config;
        let invalid = |msg: String| Err(SubmitError::InvalidRequest(msg));
        if req.prompt.is_empty() {
            return invalid("prompt has no tokens".into());
        }
        if req.stop.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        let total_tokens = req.prompt.len().saturating_add(req.stop.max_tokens);
        if total_tokens > config.max_model_len {
            return invalid(format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the model's context of {} tokens",
                req.prompt.len(),
                req.stop.max_tokens,
                config.max_model_len
            ));
        }
        if let Some(bad) = req
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.inner.vocab_size)
        {
            return invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.inner.vocab_size
            ));
        }
        let s = &req.sampling;
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            return invalid(format!(
                "temperature must be a finite number ≥ 0, got {}",
                s.temperature
            ));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return invalid(format!("top_p must be in (0, 1], got {}", s.top_p));
        }
        if let Some(r) = &req.reservation
            && !r.belongs_to(&self.inner.pool)
        {
            return invalid("reservation was made on another engine's pool".into());
        }
        let needed_blocks = blocks_for_tokens(total_tokens, config.block_size);
        if needed_blocks > config.num_blocks {
            return Err(SubmitError::TooLong {
                needed_blocks,
                total: config.num_blocks,
            });
        }
        Ok(())
    }

    /// Whether the engine thread is alive and accepting work: false once [`Engine::shutdown`]
    /// has begun, and false once the thread has exited for any other reason (a panic in the
    /// backend or the scheduler ends it), even though nobody has joined it yet.
    pub fn is_running(&self) -> bool {
        if self.inner.shared.shutting_down.load(Ordering::Acquire) {
            return false;
        }
        self.inner
            .thread
            .lock()
            .as_ref()
            .is_some_and(|thread| !thread.is_finished())
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.shared.stats.lock().clone()
    }

    /// Fits the step cost model to this machine before the first request: the engine thread
    /// runs a few synthetic sequences through the real scheduler and backend (one warm-up
    /// sequence first, whose timing is discarded: the first forward pages in the weights) and
    /// times every step as it times real ones, then a few decode steps of one sequence whose
    /// context is a thousand tokens deep (blocks taken from the pool and given back; their K/V
    /// is not computed, only its reading is timed), without streaming or counting them in the
    /// stats. Until then the model holds a generic prior, and everything priced from it is
    /// off by the ratio between that guess and this machine: the prefill cap, and admission's
    /// forecasts of how long queued requests wait (the gateway refuses at once what cannot
    /// start in time, so the first burst after start needs a forecast before any real step).
    ///
    /// Blocks for those few steps; call it once after [`Engine::spawn`], before serving. An
    /// engine that already has work, or a pool too small for the synthetic sequences, keeps
    /// its model as it is. Returns the fit (the engine's current model in those cases), or
    /// `None` when the engine thread is gone.
    pub fn calibrate(&self) -> Option<StepCost> {
        let (reply, fit) = mpsc::sync_channel(1);
        let max_context = self.inner.config.max_model_len;
        let command = Command::Calibrate { reply, max_context };
        self.inner.commands.send(command).ok()?;
        fit.recv().ok()
    }

    /// Every live sequence (waiting and running), as of the last step.
    pub fn inspect(&self) -> Vec<SeqSnapshot> {
        self.inner.shared.snapshots.lock().clone()
    }

    /// Stops the engine: live sequences get `TokenEvent::Error`, the thread is joined. Blocks
    /// for at most one step; call it outside async code (or in `spawn_blocking`). Idempotent.
    pub fn shutdown(&self) {
        self.inner
            .shared
            .shutting_down
            .store(true, Ordering::Release);
        // Wakes an idle engine. If the queue is full the engine is busy and sees the flag anyway.
        let _ = self.inner.commands.try_send(Command::Wake);
        let thread = self.inner.thread.lock().take();
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            tracing::error!("engine thread panicked");
        }
    }
}

/// Everything a finished generation produced, from [`generate_blocking`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerationOutput {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens served by the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error("generation failed: {0}")]
    Failed(String),
    #[error("engine stopped before the generation finished")]
    Interrupted,
}

/// Submits `req` and waits for the whole result. For tests, the CLI and batch-invariance checks;
/// it blocks the calling thread, so do not call it from inside an async task.
pub fn generate_blocking(
    engine: &Engine,
    req: GenerationRequest,
) -> Result<GenerationOutput, GenerateError> {
    let mut handle = engine.submit(req)?;
    let mut tokens = Vec::new();
    let mut text = String::new();
    while let Some(event) = handle.events.blocking_recv() {
        match event {
            TokenEvent::Token { id, text: delta } => {
                tokens.push(id);
                text.push_str(&delta);
            }
            TokenEvent::Finished {
                reason,
                prompt_tokens,
                cached_tokens,
                ..
            } => {
                return Ok(GenerationOutput {
                    tokens,
                    text,
                    finish_reason: reason,
                    prompt_tokens,
                    cached_tokens,
                });
            }
            TokenEvent::Error(msg) => return Err(GenerateError::Failed(msg)),
        }
    }
    Err(GenerateError::Interrupted)
}

#[cfg(test)]
mod tests;

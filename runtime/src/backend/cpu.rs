//! The CPU backend: llama forward passes over the kvgate kernels with a paged f16 KV cache.
//!
//! Weights stay in the GGUF memory map; the KV cache and all activation buffers are allocated
//! once in [`CpuBackend::new`], sized by the block count and the step token budget, so a
//! forward pass allocates nothing once the first steps have grown the scratch vectors. The
//! whole pass runs inside the backend's own rayon pool (one hand-off per step instead of one
//! per matmul); matmuls split weight rows across the pool and attention splits (token, KV head)
//! pairs.

mod forward;
mod kv_cache;
mod weights;
mod workspace;

use std::sync::Arc;

use kvgate_kernels::KvLayout;

use crate::backend::step_plan::{StepLimits, StepPlan};
use crate::backend::{Backend, BackendError, BatchInputs, MemoryUsage};
use crate::gguf::GgufFile;
use crate::model::ModelConfig;
use forward::Step;
use kv_cache::PagedKvCache;
use weights::CpuModel;
use workspace::Workspace;

/// Sizes of a [`CpuBackend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuBackendOptions {
    /// KV blocks in the cache (the engine's pool hands out ids below this).
    pub num_blocks: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Largest number of tokens one step may carry (sizes the activation buffers).
    pub max_batched_tokens: usize,
    /// Worker threads; `None` = all available cores.
    pub threads: Option<usize>,
}

/// Llama on the CPU.
pub struct CpuBackend {
    model: CpuModel,
    kv: PagedKvCache,
    ws: Workspace,
    plan: StepPlan,
    pool: rayon::ThreadPool,
    /// Tensor bytes of the model file, computed once (the engine asks every step).
    weights_bytes: u64,
}

impl CpuBackend {
    /// Binds the weights of `config` in `gguf`, allocates the KV cache and the workspace and
    /// starts the thread pool.
    pub fn new(
        gguf: Arc<GgufFile>,
        config: ModelConfig,
        options: CpuBackendOptions,
    ) -> Result<CpuBackend, BackendError> {
        if options.num_blocks == 0 || options.block_size == 0 || options.max_batched_tokens == 0 {
            return Err(BackendError::InvalidInputs(format!(
                "num_blocks, block_size and max_batched_tokens must be at least 1 (got {options:?})"
            )));
        }
        let slots = options.num_blocks.checked_mul(options.block_size);
        if slots.is_none_or(|s| s > u32::MAX as usize) {
            return Err(BackendError::InvalidInputs(format!(
                "{} blocks × {} tokens do not fit in u32 KV slots",
                options.num_blocks, options.block_size
            )));
        }
        let threads = options.threads.unwrap_or_else(default_threads).max(1);
        let layout = KvLayout {
            block_size: options.block_size,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
        };
        let model = CpuModel::load(gguf, config)?;
        let kv = PagedKvCache::new(model.config.num_layers, options.num_blocks, layout)
            .ok_or_else(|| {
                BackendError::OutOfMemory(format!(
                    "cannot allocate a KV cache of {} blocks × {} tokens",
                    options.num_blocks, options.block_size
                ))
            })?;
        let ws = Workspace::new(&model.config, options.max_batched_tokens).ok_or_else(|| {
            BackendError::OutOfMemory(format!(
                "cannot allocate the activation workspace of {} tokens per step",
                options.max_batched_tokens
            ))
        })?;
        if threads > default_threads() {
            // Every step waits for its slowest thread: threads beyond the cores only queue for
            // them (512 threads on 2 cores made one token take 34 s).
            tracing::warn!(
                threads,
                cores = default_threads(),
                "more compute threads than cores: steps will be slower, not faster"
            );
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvgate-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Other(format!("cannot start {threads} CPU threads: {e}")))?;
        Ok(CpuBackend {
            kv,
            ws,
            plan: StepPlan::default(),
            pool,
            weights_bytes: model.gguf.tensor_bytes(),
            model,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    pub fn gguf(&self) -> &Arc<GgufFile> {
        &self.model.gguf
    }
}

/// Bytes of the activation workspace for `max_batched_tokens` tokens per step, or `None` where
/// that overflows.
pub fn workspace_bytes(config: &ModelConfig, max_batched_tokens: usize) -> Option<u64> {
    Workspace::bytes_for(config, max_batched_tokens)
}

/// Cores this process may use (1 if unknown).
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    fn forward(&mut self, inputs: &BatchInputs, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let limits = StepLimits {
            max_tokens: self.ws.max_tokens(),
            vocab_size: self.model.config.vocab_size,
            num_blocks: self.kv.num_blocks,
            block_size: self.kv.layout.block_size,
        };
        self.plan.build(inputs, limits)?;
        if inputs.token_ids.is_empty() {
            logits.clear();
            return Ok(());
        }
        let Self {
            model,
            kv,
            ws,
            plan,
            pool,
            ..
        } = self;
        let step = Step {
            model,
            inputs,
            plan,
            layout: kv.layout,
            pool,
        };
        let layers = &mut kv.layers;
        pool.install(|| forward::run(&step, layers, ws, logits))
    }

    fn memory(&self) -> MemoryUsage {
        MemoryUsage {
            weights_bytes: self.weights_bytes,
            kv_bytes: self.kv.bytes(),
            workspace_bytes: self.ws.bytes(),
            device: None,
        }
    }
}

#[cfg(test)]
mod tests;

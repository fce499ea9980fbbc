//! One call from a model path to a running runtime: open the GGUF file, read the model config,
//! build the tokenizer, size the KV pool from a memory budget, start the CPU backend and the
//! engine, and fit the engine's step cost model to this machine. The CLI, the gateway and the
//! tests all start kvgate through [`Runtime::start`], so they cannot disagree about how the
//! pool is sized.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::cpu::{CpuBackend, CpuBackendOptions, default_threads};
use crate::backend::cuda::{
    CudaBackend, CudaBackendOptions, MemoryPlan, MemoryPlanError, MemoryPlanInputs, workspace_bytes,
};
use crate::backend::{Backend, BackendError, MemoryUsage};
use crate::engine::{DEFAULT_TARGET_ITL, Engine, EngineConfig, EngineError, PrefillOrder};
use crate::gguf::{GgufError, GgufFile};
use crate::kv_math::HumanSize;
use crate::model::{ModelConfig, ModelError};
use crate::tokenizer::{Tokenizer, TokenizerError};
use kvgate_kernels::cuda::KV_BLOCK;
use kvgate_kernels::cuda::cudarc_device::CudarcDevice;
use kvgate_kernels::cuda::device::DeviceOps;

/// How to size and run the runtime. `Default` gives 256 MiB of KV, blocks of 16 tokens, all
/// cores, 64 sequences, 512 tokens per step, the default step-time target and tenant-fair
/// prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuntimeOptions {
    /// Bytes of KV cache (the pool gets as many whole blocks as fit).
    pub kv_memory_bytes: u64,
    pub block_size: usize,
    /// CPU worker threads; `None` = all available cores.
    pub threads: Option<usize>,
    pub max_num_seqs: usize,
    /// Token budget of one engine step (also sizes the backend's activation buffers).
    pub max_batched_tokens: usize,
    /// Step-time target while sequences decode (`None`: no cap on prompt tokens per step).
    pub target_itl: Option<Duration>,
    pub prefill_order: PrefillOrder,
    /// Capacity of the engine's submit queue and of its waiting list (the gateway admits no
    /// more requests at once than this).
    pub command_queue: usize,
    /// Reuse cached prompt prefixes (`EngineConfig::prefix_caching`).
    pub prefix_caching: bool,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions {
            kv_memory_bytes: 256 << 20,
            block_size: 16,
            threads: None,
            max_num_seqs: 64,
            max_batched_tokens: 512,
            target_itl: Some(DEFAULT_TARGET_ITL),
            prefill_order: PrefillOrder::TenantFair,
            command_queue: EngineConfig::default().command_queue,
            prefix_caching: true,
        }
    }
}

/// Why the runtime did not start. Each variant names the stage that failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Its message names the file already.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("model config: {0}")]
    Model(#[from] ModelError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
    #[error("GPU memory plan: {0}")]
    MemoryPlan(#[from] MemoryPlanError),
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error(
        "KV memory budget {budget} is smaller than one block ({block_bytes} bytes for {block_size} tokens); raise --kv-memory"
    )]
    KvBudgetTooSmall {
        budget: HumanSize,
        block_bytes: usize,
        block_size: usize,
    },
}

/// A loaded model serving through an engine.
pub struct Runtime {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    pub config: ModelConfig,
    /// The model file's name without `.gguf`, used as the OpenAI `model` id.
    pub model_name: String,
    pub gguf: Arc<GgufFile>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub threads: usize,
    /// Backend memory right after start (weights, KV, workspace).
    pub memory: MemoryUsage,
}

impl Runtime {
    /// Opens `model_path` and starts the engine on a CPU backend sized by `opts`.
    pub fn start(model_path: &Path, opts: RuntimeOptions) -> Result<Runtime, LoadError> {
        Self::start_on(model_path, opts, BackendChoice::Cpu)
    }

    /// As [`Runtime::start`], on the chosen backend. On a GPU the KV cache is sized by the
    /// device memory plan (`--gpu-memory-utilization`), not `opts.kv_memory_bytes`.
    pub fn start_on(
        model_path: &Path,
        opts: RuntimeOptions,
        backend: BackendChoice,
    ) -> Result<Runtime, LoadError> {
        let gguf = Arc::new(GgufFile::open(model_path)?);
        let config = ModelConfig::from_gguf(&gguf)?;
        let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf)?);

        let kv_shape = config.kv_shape();
        let block_size = opts.block_size.max(1);
        let threads = opts.threads.unwrap_or_else(default_threads).max(1);
        let (backend, num_blocks): (Box<dyn Backend>, usize) = match backend {
            BackendChoice::Cpu => {
                let budget = usize::try_from(opts.kv_memory_bytes).unwrap_or(usize::MAX);
                let num_blocks = kv_shape.blocks_for_budget(budget, block_size);
                if num_blocks == 0 {
                    return Err(LoadError::KvBudgetTooSmall {
                        budget: HumanSize(budget),
                        block_bytes: kv_shape.bytes_per_block(block_size),
                        block_size,
                    });
                }
                let backend = CpuBackend::new(
                    Arc::clone(&gguf),
                    config.clone(),
                    CpuBackendOptions {
                        num_blocks,
                        block_size,
                        max_batched_tokens: opts.max_batched_tokens,
                        threads: Some(threads),
                    },
                )?;
                (Box::new(backend), num_blocks)
            }
            BackendChoice::Cuda(cuda) => {
                let backend = start_cuda(&gguf, &config, &opts, cuda)?;
                let blocks = backend.num_blocks();
                (Box::new(backend), blocks)
            }
        };
        let memory = backend.memory();
        let tokens = num_blocks * block_size;
        tracing::info!(
            "KV cache: {num_blocks} blocks = {tokens} tokens ({}), max concurrency at context {} = {:.2}x",
            HumanSize(memory.kv_bytes as usize),
            config.context_length,
            tokens as f64 / config.context_length as f64
        );
        tracing::info!(
            "model {}: {} layers, d={}, {} heads / {} KV heads, vocab {}, weights {}, {} backend, {} threads",
            config.architecture,
            config.num_layers,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.vocab_size,
            HumanSize(memory.weights_bytes as usize),
            backend.name(),
            threads
        );

        let engine_config = EngineConfig {
            block_size,
            num_blocks,
            bytes_per_block: kv_shape.bytes_per_block(block_size),
            max_num_seqs: opts.max_num_seqs,
            max_batched_tokens: opts.max_batched_tokens,
            long_prefill_threshold: EngineConfig::default()
                .long_prefill_threshold
                .min(opts.max_batched_tokens),
            max_model_len: config.context_length,
            target_itl: opts.target_itl,
            prefill_order: opts.prefill_order,
            command_queue: opts.command_queue,
            prefix_caching: opts.prefix_caching,
        };
        let decoder = Arc::clone(&tokenizer);
        let engine = Engine::spawn(backend, decoder, engine_config)?;
        // Admission forecasts queue waits from the step cost model from the first request on
        // (see `Engine::calibrate`): fit it to this machine before anything is served.
        if let Some(cost) = engine.calibrate() {
            tracing::info!(
                "step cost: {:.0} µs per step + {:.0} µs per prompt token + {:.0} µs per decoding sequence + {:.1} ns per attended token",
                cost.per_step_us,
                cost.per_prefill_token_us,
                cost.per_decode_seq_us,
                cost.per_attended_token_ns
            );
        }
        Ok(Runtime {
            engine,
            tokenizer,
            config,
            model_name: model_name(model_path),
            gguf,
            num_blocks,
            block_size,
            threads,
            memory,
        })
    }
}

/// Which backend [`Runtime::start_on`] runs the model on.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendChoice {
    Cpu,
    Cuda(CudaChoice),
}

/// A GPU and how much of its memory kvgate may plan for.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaChoice {
    pub ordinal: usize,
    /// `--gpu-memory-utilization`: the share of device memory for weights, workspace and KV.
    pub gpu_memory_utilization: f64,
    /// Where compiled kernels (CUBINs) are cached between runs.
    pub cubin_cache: std::path::PathBuf,
}

/// Opens the GPU, plans its memory (weights, the largest step's workspace, the rest up to the
/// utilization share as KV blocks), logs the plan and loads the model.
fn start_cuda(
    gguf: &Arc<GgufFile>,
    config: &ModelConfig,
    opts: &RuntimeOptions,
    cuda: CudaChoice,
) -> Result<CudaBackend<CudarcDevice>, LoadError> {
    let device_error = |e: kvgate_kernels::cuda::device::DeviceError| {
        LoadError::Backend(BackendError::Other(e.to_string()))
    };
    let dev = CudarcDevice::open(cuda.ordinal, &cuda.cubin_cache).map_err(device_error)?;
    let (free, total) = dev
        .memory()
        .driver_free_total
        .ok_or_else(|| LoadError::Backend(BackendError::Other("cuMemGetInfo failed".into())))?;
    let mut options = CudaBackendOptions {
        num_blocks: 1,
        // Anything but the kernels' KV_BLOCK is refused by CudaBackend::new with the reason.
        block_size: opts.block_size,
        max_batched_tokens: opts.max_batched_tokens,
        max_num_seqs: opts.max_num_seqs,
    };
    let plan = MemoryPlan::compute(&MemoryPlanInputs {
        device_total: total,
        device_free: free,
        utilization: cuda.gpu_memory_utilization,
        weights_bytes: gguf.tensor_bytes(),
        workspace_bytes: workspace_bytes(config, &options) as u64,
        kv_shape: config.kv_shape(),
        block_size: KV_BLOCK,
        context_length: config.context_length,
    })?;
    tracing::info!("{} on {}", plan, dev.describe());
    options.num_blocks = plan.num_blocks;
    Ok(CudaBackend::new(
        dev,
        Arc::clone(gguf),
        config.clone(),
        options,
    )?)
}

/// `…/SmolLM2-135M-Instruct.Q4_1.gguf` → `SmolLM2-135M-Instruct.Q4_1`.
fn model_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    file.strip_suffix(".gguf")
        .map(str::to_string)
        .unwrap_or(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_name_drops_the_extension_only() {
        assert_eq!(
            model_name(Path::new("/m/SmolLM2-135M-Instruct.Q4_1.gguf")),
            "SmolLM2-135M-Instruct.Q4_1"
        );
        assert_eq!(model_name(Path::new("model.bin")), "model.bin");
    }

    #[test]
    fn missing_file_is_a_model_file_error() {
        let err = Runtime::start(Path::new("/nonexistent/x.gguf"), RuntimeOptions::default())
            .err()
            .expect("missing file fails");
        assert!(matches!(err, LoadError::Gguf(_)), "{err}");
        assert!(err.to_string().contains("/nonexistent/x.gguf"), "{err}");
    }
}

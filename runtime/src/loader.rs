//! One call from a model path to a running runtime: open the GGUF file, read the model config,
//! build the tokenizer, size the KV pool from a memory budget, start the CPU backend and the
//! engine, and fit the engine's step cost model to this machine. The CLI, the gateway and the
//! tests all start kvgate through [`Runtime::start`], so they cannot disagree about how the
//! pool is sized.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::cpu::workspace_bytes as cpu_workspace_bytes;
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
    #[error(
        "KV memory budget {budget} plus the model's weights {weights}{workspace} is more than the \
         memory this host has available ({available}, MemAvailable in /proc/meminfo); lower \
         --kv-memory{lower}"
    )]
    HostMemory {
        budget: HumanSize,
        weights: HumanSize,
        /// `" and the activation workspace SIZE (--max-batched-tokens)"` where it counts.
        workspace: String,
        /// `" or --max-batched-tokens"` where the workspace is over a tenth of the total.
        lower: &'static str,
        available: HumanSize,
    },
    /// `--max-batched-tokens` so large its activation workspace size overflows.
    #[error(
        "--max-batched-tokens {0} is too large: the activation workspace for that many tokens \
         per step overflows"
    )]
    WorkspaceOverflow(usize),
    /// A count given as 0, e.g. the block size or the thread count (`--{0}`).
    #[error("--{0} must be at least 1")]
    Zero(&'static str),
}

/// `/proc/meminfo`, or `None` where it cannot be read (not Linux, a sandbox without /proc).
fn read_mem_available() -> Option<String> {
    std::fs::read_to_string("/proc/meminfo").ok()
}

/// Bytes of `MemAvailable` in a `/proc/meminfo` text (its values are in KiB, written `kB`).
fn mem_available_bytes(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let value = line.strip_prefix("MemAvailable:")?.trim();
        let kib: u64 = value.strip_suffix("kB")?.trim().parse().ok()?;
        kib.checked_mul(1024)
    })
}

/// Refuses a KV pool that, with the weights, is more than the host can give this process.
///
/// The measure is `MemAvailable`, not `MemTotal`: it is the kernel's own estimate of what can
/// still be allocated without swapping (free memory plus the page cache and slabs it can
/// reclaim), so memory other processes already hold counts against the budget, as it does when
/// the pool's pages are touched; a budget under `MemTotal` but over `MemAvailable` would still
/// end in swapping or the OOM killer. The weights are mapped from the model file; counting
/// them is slightly conservative where their pages are already cached (and so also counted as
/// available), which errs on the side of a clear refusal at startup. Where `meminfo` is `None`
/// or has no `MemAvailable` line (kernels before 3.14), nothing is refused.
///
/// The activation workspace (`--max-batched-tokens` rows of every intermediate) counts too:
/// `--max-batched-tokens 100000000` asked for 230 GB, and allocating it aborted the process.
fn check_host_memory(
    kv_budget: usize,
    weights: u64,
    workspace: u64,
    meminfo: Option<&str>,
) -> Result<(), LoadError> {
    let Some(available) = meminfo.and_then(mem_available_bytes) else {
        return Ok(());
    };
    let needed = (kv_budget as u64)
        .saturating_add(weights)
        .saturating_add(workspace);
    if needed > available {
        let human = |bytes: u64| HumanSize(usize::try_from(bytes).unwrap_or(usize::MAX));
        return Err(LoadError::HostMemory {
            budget: HumanSize(kv_budget),
            weights: human(weights),
            workspace: match workspace {
                0 => String::new(),
                bytes => format!(
                    " and the activation workspace {} (--max-batched-tokens)",
                    human(bytes)
                ),
            },
            lower: if workspace > needed / 10 {
                " or --max-batched-tokens"
            } else {
                ""
            },
            available: human(available),
        });
    }
    Ok(())
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
        // Zero is refused, not clamped (a user who typed 0 did not mean 1), and before the
        // model is read: a flag mistake is reported in milliseconds.
        let block_size = match opts.block_size {
            0 => return Err(LoadError::Zero("block-size")),
            n => n,
        };
        let threads = match opts.threads {
            Some(0) => return Err(LoadError::Zero("threads")),
            Some(n) => n,
            None => default_threads().max(1),
        };
        let gguf = Arc::new(GgufFile::open(model_path)?);
        let config = ModelConfig::from_gguf(&gguf)?;
        let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf)?);

        let kv_shape = config.kv_shape();
        let (backend, num_blocks): (Box<dyn Backend>, usize) = match backend {
            BackendChoice::Cpu => {
                let budget = usize::try_from(opts.kv_memory_bytes).unwrap_or(usize::MAX);
                let num_blocks = kv_shape.blocks_for_budget(budget, block_size);
                if num_blocks == 0 {
                    return Err(LoadError::KvBudgetTooSmall {
                        budget: HumanSize(budget),
                        block_bytes: kv_shape
                            .checked_bytes_per_block(block_size)
                            .unwrap_or(usize::MAX),
                        block_size,
                    });
                }
                // Before anything is allocated: a pool the host cannot hold would be allocated
                // until the kernel's OOM killer ends this process (or another one).
                let workspace = cpu_workspace_bytes(&config, opts.max_batched_tokens)
                    .ok_or(LoadError::WorkspaceOverflow(opts.max_batched_tokens))?;
                check_host_memory(
                    budget,
                    gguf.tensor_bytes(),
                    workspace,
                    read_mem_available().as_deref(),
                )?;
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
        workspace_bytes: workspace_bytes(config, &options)
            .ok_or(LoadError::WorkspaceOverflow(opts.max_batched_tokens))?,
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

    const MEMINFO: &str = "MemTotal:       24683584 kB\nMemFree:         1000000 kB\n\
                           MemAvailable:    2097152 kB\nBuffers:          123456 kB\n";

    #[test]
    fn mem_available_is_read_in_bytes() {
        assert_eq!(mem_available_bytes(MEMINFO), Some(2 << 30));
        assert_eq!(
            mem_available_bytes("MemTotal: 1024 kB\n"),
            None,
            "old kernels"
        );
        assert_eq!(mem_available_bytes("MemAvailable: lots kB\n"), None);
        assert_eq!(mem_available_bytes(""), None);
    }

    #[test]
    fn a_pool_and_weights_over_mem_available_are_refused_and_unknown_memory_is_not() {
        // 2 GiB available: 1.5 GiB of KV and 256 MiB of weights fit, 1 TiB does not.
        assert!(check_host_memory(3 << 29, 256 << 20, 0, Some(MEMINFO)).is_ok());
        let err = check_host_memory(1 << 40, 256 << 20, 0, Some(MEMINFO)).expect_err("1TiB");
        assert_eq!(
            err.to_string(),
            "KV memory budget 1TiB plus the model's weights 256MiB is more than the memory this \
             host has available (2GiB, MemAvailable in /proc/meminfo); lower --kv-memory"
        );
        // The weights count: 2 GiB of KV alone fits exactly, with weights it does not.
        assert!(check_host_memory(2 << 30, 0, 0, Some(MEMINFO)).is_ok());
        assert!(check_host_memory(2 << 30, 1, 0, Some(MEMINFO)).is_err());
        assert!(check_host_memory(usize::MAX, u64::MAX, u64::MAX, Some(MEMINFO)).is_err());
        // No /proc/meminfo, or no MemAvailable in it: nothing to compare with, nothing refused.
        assert!(check_host_memory(1 << 40, 0, 0, None).is_ok());
        assert!(check_host_memory(1 << 40, 0, 0, Some("MemTotal: 1 kB\n")).is_ok());
    }

    #[test]
    fn the_activation_workspace_counts_against_mem_available() {
        // 2 GiB available: 1 GiB of KV with 1 GiB of workspace fits, with 1 byte more it does not.
        assert!(check_host_memory(1 << 30, 0, 1 << 30, Some(MEMINFO)).is_ok());
        let err = check_host_memory(1 << 28, 1 << 20, 230 << 30, Some(MEMINFO))
            .expect_err("230 GiB of workspace");
        assert_eq!(
            err.to_string(),
            "KV memory budget 256MiB plus the model's weights 1MiB and the activation workspace \
             230GiB (--max-batched-tokens) is more than the memory this host has available \
             (2GiB, MemAvailable in /proc/meminfo); lower --kv-memory or --max-batched-tokens"
        );
    }

    #[test]
    fn zero_block_size_and_threads_are_refused_not_clamped() {
        // Checked before the model file is opened: the missing file is not the error.
        for (options, flag) in [
            (
                RuntimeOptions {
                    block_size: 0,
                    ..RuntimeOptions::default()
                },
                "--block-size",
            ),
            (
                RuntimeOptions {
                    threads: Some(0),
                    ..RuntimeOptions::default()
                },
                "--threads",
            ),
        ] {
            let err = Runtime::start(Path::new("/nonexistent/x.gguf"), options)
                .err()
                .expect("zero is refused");
            assert_eq!(err.to_string(), format!("{flag} must be at least 1"));
        }
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

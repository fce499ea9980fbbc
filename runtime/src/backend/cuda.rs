//! The CUDA backend: the llama forward pass as a sequence of kernel launches over a paged f16
//! KV cache in device memory. A sibling of `backend/cpu`, behind the same [`Backend`] trait,
//! so the engine, scheduler, block pool and metrics do not know which one runs.
//!
//! The backend is generic over [`DeviceOps`] (allocate, copy, launch a kernel by name): the
//! launch sequence of a step ([`step`]) exists once and runs on a real GPU through cudarc, or
//! on the CPU through the CUDA emulator, which is how CI proves the whole step against
//! [`CpuBackend`](super::cpu::CpuBackend) logits without a GPU. Everything (weights, KV cache,
//! workspace for the largest step) is allocated in [`CudaBackend::new`]; a step only copies
//! its inputs in and its logits out.

mod memory_plan;
mod step;
mod weights;
mod workspace;

use std::sync::Arc;

use kvgate_kernels::cuda::KV_BLOCK;
use kvgate_kernels::cuda::device::{DevBuf, DeviceError, DeviceMemory, DeviceOps};

pub use memory_plan::{MemoryPlan, MemoryPlanError, MemoryPlanInputs};
pub use step::MMQ_MIN_EXCLUSIVE_BATCH;

use crate::backend::step_plan::{StepLimits, StepPlan};
use crate::backend::{Backend, BackendError, BatchInputs, DeviceMemoryView, MemoryUsage};
use crate::gguf::GgufFile;
use crate::model::ModelConfig;
use weights::DeviceModel;
use workspace::DeviceWorkspace;

/// Sizes of a [`CudaBackend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaBackendOptions {
    /// KV blocks in the cache (the engine's pool hands out ids below this).
    pub num_blocks: usize,
    /// Tokens per KV block: must be the kernels' `KV_BLOCK` (16).
    pub block_size: usize,
    /// Largest number of tokens one step may carry.
    pub max_batched_tokens: usize,
    /// Most sequences in one step (sizes the block tables and logits buffers).
    pub max_num_seqs: usize,
}

/// One layer's K and V caches: `[num_blocks][n_kv_heads][KV_BLOCK][head_dim]` f16 each.
#[derive(Clone, Copy, Debug)]
struct LayerKv {
    k: DevBuf,
    v: DevBuf,
}

/// Llama on a CUDA device (or its CPU emulation).
pub struct CudaBackend<D: DeviceOps> {
    dev: D,
    model: DeviceModel,
    kv: Vec<LayerKv>,
    ws: DeviceWorkspace,
    plan: StepPlan,
    options: CudaBackendOptions,
    kv_bytes: u64,
    /// Host staging for the step's inputs and logits (its capacity is reused every step).
    staging: Vec<u8>,
}

pub(crate) fn device_error(e: DeviceError) -> BackendError {
    match e {
        DeviceError::OutOfMemory { .. } => BackendError::OutOfMemory(e.to_string()),
        other => BackendError::Other(other.to_string()),
    }
}

/// Device bytes of the workspace a backend with `options` allocates (for the memory plan,
/// before anything is allocated); `None` where that size overflows.
pub fn workspace_bytes(config: &ModelConfig, options: &CudaBackendOptions) -> Option<u64> {
    let bytes = workspace::WorkspaceShape::new(config, options).bytes(config)?;
    u64::try_from(bytes).ok()
}

/// Bytes of one layer's K (or V) cache.
pub fn kv_layer_bytes(config: &ModelConfig, num_blocks: usize) -> Option<usize> {
    num_blocks
        .checked_mul(KV_BLOCK)?
        .checked_mul(config.kv_dim())?
        .checked_mul(2)
}

impl<D: DeviceOps> CudaBackend<D> {
    /// Copies the weights of `config` in `gguf` to `dev` and allocates the KV cache and the
    /// workspace of the largest step.
    pub fn new(
        mut dev: D,
        gguf: Arc<GgufFile>,
        config: ModelConfig,
        options: CudaBackendOptions,
    ) -> Result<CudaBackend<D>, BackendError> {
        if options.num_blocks == 0 || options.max_batched_tokens == 0 || options.max_num_seqs == 0 {
            return Err(BackendError::InvalidInputs(format!(
                "num_blocks, max_batched_tokens and max_num_seqs must be at least 1 (got {options:?})"
            )));
        }
        if options.block_size != KV_BLOCK {
            return Err(BackendError::InvalidInputs(format!(
                "the CUDA kernels use {KV_BLOCK}-token KV blocks, got --block-size {}",
                options.block_size
            )));
        }
        // Slots are i32 on the device.
        if options
            .num_blocks
            .checked_mul(KV_BLOCK)
            .is_none_or(|s| s > i32::MAX as usize)
        {
            return Err(BackendError::InvalidInputs(format!(
                "{} blocks × {KV_BLOCK} tokens do not fit in i32 KV slots",
                options.num_blocks
            )));
        }
        let model = DeviceModel::upload(&mut dev, &gguf, config)?;
        let layer_bytes = kv_layer_bytes(&model.config, options.num_blocks).ok_or_else(|| {
            BackendError::OutOfMemory(format!("{} KV blocks overflow", options.num_blocks))
        })?;
        let mut kv = Vec::with_capacity(model.config.num_layers);
        for _ in 0..model.config.num_layers {
            kv.push(LayerKv {
                k: dev.alloc(layer_bytes).map_err(device_error)?,
                v: dev.alloc(layer_bytes).map_err(device_error)?,
            });
        }
        let ws = DeviceWorkspace::new(&mut dev, &model.config, &options)?;
        Ok(CudaBackend {
            kv_bytes: 2 * layer_bytes as u64 * model.config.num_layers as u64,
            dev,
            model,
            kv,
            ws,
            plan: StepPlan::default(),
            options,
            staging: Vec::new(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    pub fn num_blocks(&self) -> usize {
        self.options.num_blocks
    }

    /// The device's own accounting: allocated and peak bytes, and the driver's free/total.
    pub fn device_memory(&self) -> DeviceMemory {
        self.dev.memory()
    }

    /// For logs: which device runs the model.
    pub fn describe_device(&self) -> String {
        self.dev.describe()
    }
}

impl<D: DeviceOps> Backend for CudaBackend<D> {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    fn forward(&mut self, inputs: &BatchInputs, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        let limits = StepLimits {
            max_tokens: self.options.max_batched_tokens,
            vocab_size: self.model.config.vocab_size,
            num_blocks: self.options.num_blocks,
            block_size: KV_BLOCK,
        };
        self.plan.build(inputs, limits)?;
        if inputs.token_ids.is_empty() {
            logits.clear();
            return Ok(());
        }
        step::run(
            &mut self.dev,
            &self.model,
            &self.kv,
            &self.ws,
            step::StepInputs {
                inputs,
                plan: &self.plan,
            },
            &mut self.staging,
            logits,
        )
    }

    fn memory(&self) -> MemoryUsage {
        MemoryUsage {
            weights_bytes: self.model.bytes,
            kv_bytes: self.kv_bytes,
            workspace_bytes: self.ws.bytes,
            device: self
                .dev
                .memory()
                .driver_free_total
                .map(DeviceMemoryView::from_free_total),
        }
    }
}

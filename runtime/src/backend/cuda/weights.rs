//! The model on the device: every weight matrix copied once, as its GGUF blocks (quantized
//! weights stay quantized; the matvec kernels read Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants
//! Q4_K/Q5_K/Q6_K and F16 directly), norm weights as f32. Shapes and types the kernels cannot
//! run are refused here, at load, with the tensor named, never discovered mid-step.

use kvgate_kernels::cuda::device::{DevBuf, DeviceOps};
use kvgate_kernels::cuda::{ATTN_HEAD_DIMS, ATTN_MAX_GROUP, ggml_type_id, matvec_kernel};
use kvgate_kernels::{RopeMode, WeightType};

use super::device_error;
use crate::backend::BackendError;
use crate::gguf::{GgmlType, GgufFile};
use crate::model::{BoundTensor, ModelConfig, ModelWeights};

/// A weight matrix in device memory, `rows` × `cols` in GGML blocks of `ty`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceMat {
    pub buf: DevBuf,
    pub ty: WeightType,
    pub rows: usize,
    pub cols: usize,
}

impl DeviceMat {
    /// Bytes of one row (the embedding lookup's stride).
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }

    /// Whether a matmul with this matrix quantizes its activations to Q8_1 first.
    pub fn is_quantized(&self) -> bool {
        self.ty != WeightType::F16
    }
}

pub struct DeviceLayer {
    pub attn_norm: DevBuf,
    pub wq: DeviceMat,
    pub wk: DeviceMat,
    pub wv: DeviceMat,
    pub wo: DeviceMat,
    pub ffn_norm: DevBuf,
    pub gate: DeviceMat,
    pub up: DeviceMat,
    pub down: DeviceMat,
}

pub struct DeviceModel {
    pub config: ModelConfig,
    pub embd: DeviceMat,
    pub layers: Vec<DeviceLayer>,
    pub output_norm: DevBuf,
    pub output: DeviceMat,
    /// Bytes copied to the device.
    pub bytes: u64,
}

/// Refuses model geometry the attention kernels have no instance for.
pub fn check_geometry(config: &ModelConfig) -> Result<(), BackendError> {
    let unsupported = |what: String| Err(BackendError::Other(format!("CUDA backend: {what}")));
    // The RoPE kernel rotates adjacent pairs (ggml NORM mode, llama); qwen2's half-split pairs
    // would run silently wrong.
    if config.rope_mode != RopeMode::Norm {
        return unsupported(format!(
            "{:?} RoPE (architecture {}) is not supported yet; use --device cpu",
            config.rope_mode, config.architecture
        ));
    }
    if config.rope_dim != config.head_dim {
        return unsupported(format!(
            "partial RoPE (rope dimension {} < head dim {}) is not supported",
            config.rope_dim, config.head_dim
        ));
    }
    if !ATTN_HEAD_DIMS.contains(&config.head_dim) {
        return unsupported(format!(
            "head dimension {} has no attention kernel (have {ATTN_HEAD_DIMS:?})",
            config.head_dim
        ));
    }
    let group = config.num_heads / config.num_kv_heads;
    if group > ATTN_MAX_GROUP {
        return unsupported(format!(
            "{group} query heads per KV head exceed the attention kernel's {ATTN_MAX_GROUP}"
        ));
    }
    Ok(())
}

struct Uploader<'a, D> {
    dev: &'a mut D,
    gguf: &'a GgufFile,
    bytes: u64,
}

impl<D: DeviceOps> Uploader<'_, D> {
    fn raw(&mut self, data: &[u8]) -> Result<DevBuf, BackendError> {
        let buf = self.dev.alloc(data.len()).map_err(device_error)?;
        self.dev.upload(buf, 0, data).map_err(device_error)?;
        self.bytes += data.len() as u64;
        Ok(buf)
    }

    /// A matrix the matvec kernels can multiply (`lookup_only`: the embedding table, which
    /// `embed_rows` reads in any GGML type it knows, F32 included).
    fn mat(&mut self, t: &BoundTensor, lookup_only: bool) -> Result<DeviceMat, BackendError> {
        let refuse = |why: &str| {
            Err(BackendError::Other(format!(
                "CUDA backend: tensor `{}` ({}): {why}",
                t.info.name,
                t.ty().name()
            )))
        };
        let ty = match t.ty() {
            GgmlType::F16 => WeightType::F16,
            GgmlType::Q4_0 => WeightType::Q4_0,
            GgmlType::Q4_1 => WeightType::Q4_1,
            GgmlType::Q5_0 => WeightType::Q5_0,
            GgmlType::Q5_1 => WeightType::Q5_1,
            GgmlType::Q8_0 => WeightType::Q8_0,
            GgmlType::Q4_K => WeightType::Q4_K,
            GgmlType::Q5_K => WeightType::Q5_K,
            GgmlType::Q6_K => WeightType::Q6_K,
            GgmlType::F32 if lookup_only => WeightType::F32,
            _ => {
                return refuse(
                    "no matvec kernel for this type (have Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, \
                     Q5_K, Q6_K, F16)",
                );
            }
        };
        if ggml_type_id(ty).is_none() || (!lookup_only && matvec_kernel(ty).is_none()) {
            return refuse("no CUDA kernel reads this type");
        }
        if !t.cols.is_multiple_of(32) {
            return refuse("rows must be a multiple of 32 values (Q8_1 activation blocks)");
        }
        if !t.cols.is_multiple_of(ty.block_elems()) {
            return refuse("rows must be whole blocks of the type");
        }
        let data = t.data(self.gguf);
        if data.len() != ty.row_bytes(t.cols) * t.rows {
            return refuse("tensor bytes do not match its shape");
        }
        Ok(DeviceMat {
            buf: self.raw(data)?,
            ty,
            rows: t.rows,
            cols: t.cols,
        })
    }

    fn norm(&mut self, t: &BoundTensor) -> Result<DevBuf, BackendError> {
        // F32 checked at bind time; copied as stored (little-endian f32).
        let data = t.data(self.gguf).to_vec();
        self.raw(&data)
    }
}

/// Refuses tensors the step does not apply (Q/K/V biases of qwen2, Llama 3.1's RoPE frequency
/// factors): ignoring them would compute silently wrong logits.
fn check_extras(weights: &ModelWeights) -> Result<(), BackendError> {
    let unsupported = |what: &str| {
        Err(BackendError::Other(format!(
            "CUDA backend: {what} are not supported yet; use --device cpu"
        )))
    };
    if weights.rope_freqs.is_some() {
        return unsupported("RoPE frequency factors (rope_freqs.weight)");
    }
    if weights
        .layers
        .iter()
        .any(|l| l.bq.is_some() || l.bk.is_some() || l.bv.is_some())
    {
        return unsupported("Q/K/V biases");
    }
    Ok(())
}

impl DeviceModel {
    /// Binds every tensor of `config` in `gguf` and copies it to `dev`.
    pub fn upload<D: DeviceOps>(
        dev: &mut D,
        gguf: &GgufFile,
        config: ModelConfig,
    ) -> Result<DeviceModel, BackendError> {
        check_geometry(&config)?;
        let weights = ModelWeights::bind(gguf, &config)
            .map_err(|e| BackendError::Other(format!("model weights: {e}")))?;
        check_extras(&weights)?;
        let mut up = Uploader {
            dev,
            gguf,
            bytes: 0,
        };
        // Only looked up unless tied (then it is the output head too, and needs a matvec type).
        let embd = up.mat(&weights.token_embd, !config.tied_embeddings)?;
        let mut layers = Vec::with_capacity(weights.layers.len());
        for l in &weights.layers {
            layers.push(DeviceLayer {
                attn_norm: up.norm(&l.attn_norm)?,
                wq: up.mat(&l.wq, false)?,
                wk: up.mat(&l.wk, false)?,
                wv: up.mat(&l.wv, false)?,
                wo: up.mat(&l.wo, false)?,
                ffn_norm: up.norm(&l.ffn_norm)?,
                gate: up.mat(&l.ffn_gate, false)?,
                up: up.mat(&l.ffn_up, false)?,
                down: up.mat(&l.ffn_down, false)?,
            });
        }
        let output_norm = up.norm(&weights.output_norm)?;
        // Tied embeddings: the one copy serves as the output head (it must then be a type the
        // matvec kernels read, which `mat(.., false)` would have checked).
        let output = if config.tied_embeddings {
            if embd.ty == WeightType::F32 {
                return Err(BackendError::Other(
                    "CUDA backend: tied F32 embeddings have no matvec kernel".into(),
                ));
            }
            embd
        } else {
            up.mat(&weights.output, false)?
        };
        let bytes = up.bytes;
        Ok(DeviceModel {
            config,
            embd,
            layers,
            output_norm,
            output,
            bytes,
        })
    }
}

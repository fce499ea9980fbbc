//! The model's tensors in the form the kernels take: matrices as (kernel type, bound tensor)
//! pairs viewed as [`QMatrix`] over the mapped file on each use, norm weights copied to f32
//! vectors (a few hundred KB; everything else stays in the map).

use std::sync::Arc;

use kvgate_kernels::{QMatrix, WeightType};

use crate::backend::BackendError;
use crate::gguf::{GgmlType, GgufFile};
use crate::model::{BoundTensor, ModelConfig, ModelWeights};

/// A weight matrix whose type and byte size were checked against the kernels at load time.
pub struct Mat {
    pub ty: WeightType,
    pub tensor: BoundTensor,
}

impl Mat {
    fn new(gguf: &GgufFile, tensor: &BoundTensor) -> Result<Mat, BackendError> {
        let ty = weight_type(tensor)?;
        QMatrix::new(ty, tensor.data(gguf), tensor.rows, tensor.cols)
            .map_err(|e| BackendError::Other(format!("tensor `{}`: {e}", tensor.info.name)))?;
        Ok(Mat {
            ty,
            tensor: tensor.clone(),
        })
    }

    /// The matrix over the mapped bytes (no copy).
    pub fn view<'g>(&self, gguf: &'g GgufFile) -> QMatrix<'g> {
        QMatrix {
            ty: self.ty,
            data: self.tensor.data(gguf),
            rows: self.tensor.rows,
            cols: self.tensor.cols,
        }
    }

    /// Bytes of row `r` (for embedding lookup).
    pub fn row<'g>(&self, gguf: &'g GgufFile, r: usize) -> &'g [u8] {
        let bytes = self.ty.row_bytes(self.tensor.cols);
        &self.tensor.data(gguf)[r * bytes..(r + 1) * bytes]
    }
}

fn weight_type(tensor: &BoundTensor) -> Result<WeightType, BackendError> {
    Ok(match tensor.ty() {
        GgmlType::F32 => WeightType::F32,
        GgmlType::F16 => WeightType::F16,
        GgmlType::Q4_0 => WeightType::Q4_0,
        GgmlType::Q4_1 => WeightType::Q4_1,
        GgmlType::Q8_0 => WeightType::Q8_0,
        GgmlType::Q5_0 => WeightType::Q5_0,
        GgmlType::Q5_1 => WeightType::Q5_1,
        GgmlType::Q4_K => WeightType::Q4_K,
        GgmlType::Q5_K => WeightType::Q5_K,
        GgmlType::Q6_K => WeightType::Q6_K,
        GgmlType::Other(id) => {
            return Err(BackendError::Other(format!(
                "tensor `{}` has ggml type {id}, which the CPU kernels do not support",
                tensor.info.name
            )));
        }
    })
}

/// One transformer block's weights.
pub struct LayerMats {
    pub attn_norm: Vec<f32>,
    pub wq: Mat,
    pub wk: Mat,
    pub wv: Mat,
    pub wo: Mat,
    pub ffn_norm: Vec<f32>,
    pub gate: Mat,
    pub up: Mat,
    pub down: Mat,
    /// Q/K/V biases (qwen2), added to the projections before RoPE.
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
}

/// The whole model as the CPU forward pass uses it.
pub struct CpuModel {
    pub gguf: Arc<GgufFile>,
    pub config: ModelConfig,
    pub embd: Mat,
    pub layers: Vec<LayerMats>,
    pub output_norm: Vec<f32>,
    pub output: Mat,
    /// Llama 3.1+ RoPE frequency factors (one per rotated pair), checked finite and positive.
    pub rope_freqs: Option<Vec<f32>>,
}

impl CpuModel {
    /// Binds and checks every tensor of `config` in `gguf`.
    pub fn load(gguf: Arc<GgufFile>, config: ModelConfig) -> Result<CpuModel, BackendError> {
        let weights = ModelWeights::bind(&gguf, &config)
            .map_err(|e| BackendError::Other(format!("model weights: {e}")))?;
        if config.rope_dim != config.head_dim {
            return Err(BackendError::Other(format!(
                "partial RoPE (rope dimension {} < head dim {}) is not supported",
                config.rope_dim, config.head_dim
            )));
        }
        let g = &*gguf;
        let mut layers = Vec::with_capacity(weights.layers.len());
        for l in &weights.layers {
            layers.push(LayerMats {
                attn_norm: l.attn_norm.f32_values(g),
                wq: Mat::new(g, &l.wq)?,
                wk: Mat::new(g, &l.wk)?,
                wv: Mat::new(g, &l.wv)?,
                wo: Mat::new(g, &l.wo)?,
                ffn_norm: l.ffn_norm.f32_values(g),
                gate: Mat::new(g, &l.ffn_gate)?,
                up: Mat::new(g, &l.ffn_up)?,
                down: Mat::new(g, &l.ffn_down)?,
                bq: l.bq.as_ref().map(|t| t.f32_values(g)),
                bk: l.bk.as_ref().map(|t| t.f32_values(g)),
                bv: l.bv.as_ref().map(|t| t.f32_values(g)),
            });
        }
        let rope_freqs = weights.rope_freqs.as_ref().map(|t| t.f32_values(g));
        // A zero or non-finite factor would turn every angle of its pair into NaN.
        if let Some(bad) = rope_freqs
            .iter()
            .flatten()
            .find(|f| !(f.is_finite() && **f > 0.0))
        {
            return Err(BackendError::Other(format!(
                "tensor `rope_freqs.weight` holds {bad}; frequency factors must be finite and positive"
            )));
        }
        Ok(CpuModel {
            rope_freqs,
            embd: Mat::new(g, &weights.token_embd)?,
            output_norm: weights.output_norm.f32_values(g),
            output: Mat::new(g, &weights.output)?,
            layers,
            config,
            gguf,
        })
    }
}

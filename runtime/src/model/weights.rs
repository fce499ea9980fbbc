//! Binds every tensor the llama graph needs to its place in the GGUF file, checking names,
//! shapes and types up front.
//!
//! The result holds tensor descriptions only; the backend borrows the bytes from the mapped file
//! when it computes (`BoundTensor::data`), so the ~97 MB of weights are never copied.

use super::{ModelConfig, ModelError};
use crate::gguf::{GgmlType, GgufFile, TensorInfo};

/// Types a weight matrix may have (the kernels have dot products for each).
const MATRIX_TYPES: &[GgmlType] = &[
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::F16,
    GgmlType::F32,
];
/// Norm weights (and biases, frequency factors) are applied element-wise in f32, as llama.cpp
/// stores them.
const NORM_TYPES: &[GgmlType] = &[GgmlType::F32];

/// One tensor located in the file: `rows` rows of `cols` elements (GGML `ne1` × `ne0`).
#[derive(Debug, Clone)]
pub struct BoundTensor {
    pub info: TensorInfo,
    pub rows: usize,
    pub cols: usize,
}

impl BoundTensor {
    pub fn ty(&self) -> GgmlType {
        self.info.ty
    }

    /// The tensor's bytes, borrowed from the memory map.
    pub fn data<'g>(&self, gguf: &'g GgufFile) -> &'g [u8] {
        gguf.tensor_data(&self.info)
    }

    /// The tensor as f32 values; only for F32 tensors (norm weights), checked at bind time.
    pub fn f32_values(&self, gguf: &GgufFile) -> Vec<f32> {
        self.data(gguf)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }
}

/// The tensors of one transformer block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: BoundTensor,
    pub wq: BoundTensor,
    pub wk: BoundTensor,
    pub wv: BoundTensor,
    pub wo: BoundTensor,
    pub ffn_norm: BoundTensor,
    pub ffn_gate: BoundTensor,
    pub ffn_up: BoundTensor,
    pub ffn_down: BoundTensor,
    /// Q/K/V projection biases (qwen2 has them; llama.cpp's llama graph accepts them too).
    pub bq: Option<BoundTensor>,
    pub bk: Option<BoundTensor>,
    pub bv: Option<BoundTensor>,
}

/// Every tensor of a llama-family model.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub token_embd: BoundTensor,
    pub layers: Vec<LayerWeights>,
    pub output_norm: BoundTensor,
    /// `output.weight`, or the token embedding again when the model ties them.
    pub output: BoundTensor,
    /// Llama 3.1+ RoPE frequency factors, one per rotated pair (`rope_freqs.weight`).
    pub rope_freqs: Option<BoundTensor>,
}

impl ModelWeights {
    /// Finds and checks every tensor `config` implies.
    pub fn bind(gguf: &GgufFile, config: &ModelConfig) -> Result<ModelWeights, ModelError> {
        let d = config.hidden_size as u64;
        let kv = config.kv_dim() as u64;
        let ff = config.ffn_size as u64;
        let vocab = config.vocab_size as u64;
        reject_unsupported_extras(gguf, config)?;

        let token_embd = bind(gguf, "token_embd.weight", &[d, vocab], MATRIX_TYPES)?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let name = |t: &str| format!("blk.{i}.{t}.weight");
            layers.push(LayerWeights {
                attn_norm: bind(gguf, &name("attn_norm"), &[d], NORM_TYPES)?,
                wq: bind(gguf, &name("attn_q"), &[d, d], MATRIX_TYPES)?,
                wk: bind(gguf, &name("attn_k"), &[d, kv], MATRIX_TYPES)?,
                wv: bind(gguf, &name("attn_v"), &[d, kv], MATRIX_TYPES)?,
                wo: bind(gguf, &name("attn_output"), &[d, d], MATRIX_TYPES)?,
                ffn_norm: bind(gguf, &name("ffn_norm"), &[d], NORM_TYPES)?,
                ffn_gate: bind(gguf, &name("ffn_gate"), &[d, ff], MATRIX_TYPES)?,
                ffn_up: bind(gguf, &name("ffn_up"), &[d, ff], MATRIX_TYPES)?,
                ffn_down: bind(gguf, &name("ffn_down"), &[ff, d], MATRIX_TYPES)?,
                bq: bind_optional(gguf, &format!("blk.{i}.attn_q.bias"), &[d])?,
                bk: bind_optional(gguf, &format!("blk.{i}.attn_k.bias"), &[kv])?,
                bv: bind_optional(gguf, &format!("blk.{i}.attn_v.bias"), &[kv])?,
            });
        }
        let output_norm = bind(gguf, "output_norm.weight", &[d], NORM_TYPES)?;
        let output = if config.tied_embeddings {
            token_embd.clone()
        } else {
            bind(gguf, "output.weight", &[d, vocab], MATRIX_TYPES)?
        };
        let pairs = (config.rope_dim / 2) as u64;
        let rope_freqs = bind_optional(gguf, "rope_freqs.weight", &[pairs])?;
        Ok(ModelWeights {
            token_embd,
            layers,
            output_norm,
            output,
            rope_freqs,
        })
    }
}

/// [`bind`] for a tensor the graph uses only when the file has it (an F32 vector).
fn bind_optional(
    gguf: &GgufFile,
    name: &str,
    shape: &[u64],
) -> Result<Option<BoundTensor>, ModelError> {
    match gguf.tensor(name) {
        Some(_) => bind(gguf, name, shape, NORM_TYPES).map(Some),
        None => Ok(None),
    }
}

/// Looks up `name` and checks its shape (GGML order, innermost first) and type.
fn bind(
    gguf: &GgufFile,
    name: &str,
    shape: &[u64],
    allowed: &[GgmlType],
) -> Result<BoundTensor, ModelError> {
    let info = gguf
        .tensor(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    // GGUF writers may pad trailing dimensions with 1s; they do not change the layout.
    let mut found = info.dims.clone();
    while found.len() > shape.len() && found.last() == Some(&1) {
        found.pop();
    }
    if found != shape {
        return Err(ModelError::ShapeMismatch {
            name: name.to_string(),
            found: info.dims.clone(),
            expected: shape.to_vec(),
        });
    }
    if !allowed.contains(&info.ty) {
        let allowed: Vec<String> = allowed.iter().map(|t| t.name()).collect();
        return Err(ModelError::UnsupportedType {
            name: name.to_string(),
            found: info.ty.name(),
            allowed: allowed.join(", "),
        });
    }
    Ok(BoundTensor {
        info: info.clone(),
        rows: shape.get(1).copied().unwrap_or(1) as usize,
        cols: shape[0] as usize,
    })
}

/// Tensors that mean the file needs a graph kvgate does not have (an attention output bias,
/// mixture of experts). Running without them would silently give wrong output, so they are
/// errors. (Q/K/V biases are part of the graph: see [`LayerWeights`].)
fn reject_unsupported_extras(gguf: &GgufFile, config: &ModelConfig) -> Result<(), ModelError> {
    let arch = &config.architecture;
    if gguf
        .get_u64(&format!("{arch}.expert_count"))
        .is_some_and(|n| n > 0)
    {
        return Err(ModelError::Unsupported("mixture-of-experts layers".into()));
    }
    for i in 0..config.num_layers {
        let name = format!("blk.{i}.attn_output.bias");
        if gguf.tensor(&name).is_some() {
            return Err(ModelError::Unsupported(format!("attention bias `{name}`")));
        }
    }
    Ok(())
}

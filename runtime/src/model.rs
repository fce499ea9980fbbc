//! The llama-family model description: hyper-parameters read from GGUF metadata and the
//! per-layer weight tensors bound (by name, with shape and type checks) to the mapped file.
//!
//! Binding happens once at load time so a file with a missing tensor or a wrong shape fails with
//! a message naming the tensor, instead of producing garbage on the first forward pass. Bound
//! weights are descriptions ([`BoundTensor`]), not copies: the bytes stay in the GGUF memory map
//! and are borrowed at compute time with [`BoundTensor::data`].

use crate::gguf::GgufFile;
use crate::kv_math::{KvDtype, KvShape};
use kvgate_kernels::RopeMode;

/// Architectures whose GGUF files kvgate can run. llama.cpp writes Llama 2 and 3, Mistral-7B,
/// SmolLM and TinyLlama as "llama" (Llama 3.1+ adds `rope_freqs.weight`); "qwen2" is the same
/// graph with Q/K/V biases and NEOX-style RoPE. The other names llama.cpp knows (gemma, phi3,
/// granite, ...) add norms, scaling factors or layouts that this graph lacks.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2"];

/// Why a GGUF file could not be turned into a runnable model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("metadata key `general.architecture` is missing: not a model GGUF file")]
    MissingArchitecture,
    #[error("unsupported model architecture `{0}`: kvgate runs {SUPPORTED_ARCHITECTURES:?} only")]
    UnsupportedArchitecture(String),
    #[error("metadata key `{0}` is missing")]
    MissingKey(String),
    #[error("metadata key `{key}` has an invalid value: {reason}")]
    InvalidValue { key: String, reason: String },
    #[error("tensor `{0}` is missing from the model file")]
    MissingTensor(String),
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("tensor `{name}` has type {found}, which kvgate cannot use here (allowed: {allowed})")]
    UnsupportedType {
        name: String,
        found: String,
        allowed: String,
    },
    #[error("unsupported model feature: {0}")]
    Unsupported(String),
}

/// Hyper-parameters of a llama-family decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub ffn_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head that RoPE rotates (the rest pass through).
    pub rope_dim: usize,
    /// Which elements RoPE pairs: adjacent ones (llama, whose converter permutes Q/K for it)
    /// or the two halves of a head (qwen2), as llama.cpp's `llama_model_rope_type` says.
    pub rope_mode: RopeMode,
    pub rope_freq_base: f32,
    pub rms_eps: f32,
    /// Context length the model was trained for (the longest sequence kvgate will admit).
    pub context_length: usize,
    pub vocab_size: usize,
    /// True when there is no `output.weight` and the token embedding doubles as the output head.
    pub tied_embeddings: bool,
}

impl ModelConfig {
    /// Reads the hyper-parameters of a llama-family model from GGUF metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<ModelConfig, ModelError> {
        let arch = gguf
            .get_str("general.architecture")
            .ok_or(ModelError::MissingArchitecture)?;
        if !SUPPORTED_ARCHITECTURES.contains(&arch) {
            return Err(ModelError::UnsupportedArchitecture(arch.to_string()));
        }
        let key = |suffix: &str| format!("{arch}.{suffix}");
        let required = |suffix: &str| -> Result<usize, ModelError> {
            let k = key(suffix);
            let v = gguf
                .get(&k)
                .ok_or_else(|| ModelError::MissingKey(k.clone()))?;
            let n = v.as_u64().ok_or_else(|| ModelError::InvalidValue {
                key: k.clone(),
                reason: format!("expected a non-negative integer, found {v:?}"),
            })?;
            positive(&k, n)
        };

        let num_layers = required("block_count")?;
        let hidden_size = required("embedding_length")?;
        let ffn_size = required("feed_forward_length")?;
        let num_heads = required("attention.head_count")?;
        let num_kv_heads = match gguf.get_u64(&key("attention.head_count_kv")) {
            Some(n) => positive(&key("attention.head_count_kv"), n)?,
            None => num_heads,
        };
        let context_length = required("context_length")?;
        if hidden_size % num_heads != 0 {
            return Err(invalid(
                &key("embedding_length"),
                format!("{hidden_size} is not divisible by head_count {num_heads}"),
            ));
        }
        if num_heads % num_kv_heads != 0 {
            return Err(invalid(
                &key("attention.head_count_kv"),
                format!("{num_kv_heads} does not divide head_count {num_heads}"),
            ));
        }
        let head_dim = hidden_size / num_heads;
        let rope_dim = match gguf.get_u64(&key("rope.dimension_count")) {
            Some(n) => positive(&key("rope.dimension_count"), n)?,
            None => head_dim,
        };
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(invalid(
                &key("rope.dimension_count"),
                format!("{rope_dim} must be even and at most head_dim {head_dim}"),
            ));
        }
        check_no_rope_scaling(gguf, arch)?;

        let rope_freq_base = float_or(gguf, &key("rope.freq_base"), 10_000.0)?;
        let rms_eps = match gguf.get(&key("attention.layer_norm_rms_epsilon")) {
            None => {
                return Err(ModelError::MissingKey(key(
                    "attention.layer_norm_rms_epsilon",
                )));
            }
            Some(_) => float_or(gguf, &key("attention.layer_norm_rms_epsilon"), 0.0)?,
        };

        let embd = gguf
            .tensor("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let vocab_size = match gguf.get_str_array("tokenizer.ggml.tokens") {
            Some(tokens) => tokens.len(),
            None => embd.dims.get(1).copied().unwrap_or(0) as usize,
        };
        if vocab_size == 0 {
            return Err(invalid(
                "tokenizer.ggml.tokens",
                "the vocabulary is empty".into(),
            ));
        }
        Ok(ModelConfig {
            architecture: arch.to_string(),
            num_layers,
            hidden_size,
            ffn_size,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_dim,
            rope_mode: if arch == "qwen2" {
                RopeMode::Neox
            } else {
                RopeMode::Norm
            },
            rope_freq_base,
            rms_eps,
            context_length,
            vocab_size,
            tied_embeddings: gguf.tensor("output.weight").is_none(),
        })
    }

    /// Width of the K (and V) projection: all KV heads side by side.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Query heads that share one KV head (grouped-query attention).
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// The KV cache shape this model needs; the CPU backend stores K and V as f16.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: self.num_layers,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            dtype: KvDtype::F16,
        }
    }
}

fn positive(key: &str, n: u64) -> Result<usize, ModelError> {
    match usize::try_from(n) {
        Ok(n) if n > 0 && n <= (1 << 24) => Ok(n),
        _ => Err(invalid(key, format!("{n} is out of range (1..=16777216)"))),
    }
}

fn invalid(key: &str, reason: String) -> ModelError {
    ModelError::InvalidValue {
        key: key.to_string(),
        reason,
    }
}

fn float_or(gguf: &GgufFile, key: &str, default: f32) -> Result<f32, ModelError> {
    let Some(v) = gguf.get(key) else {
        return Ok(default);
    };
    match v.as_f32() {
        Some(f) if f.is_finite() && f >= 0.0 => Ok(f),
        _ => Err(invalid(
            key,
            format!("expected a finite non-negative float, found {v:?}"),
        )),
    }
}

/// RoPE scaling (linear, YaRN) changes the rotation angles; kvgate does not implement it, and
/// silently ignoring it would produce a subtly wrong model. Llama 3.1's scaling is not a
/// scaling type in GGUF but per-pair factors in `rope_freqs.weight`, which kvgate applies
/// (bound with the weights).
fn check_no_rope_scaling(gguf: &GgufFile, arch: &str) -> Result<(), ModelError> {
    let scaling = gguf.get_str(&format!("{arch}.rope.scaling.type"));
    if let Some(kind) = scaling.filter(|k| *k != "none") {
        return Err(ModelError::Unsupported(format!("rope scaling `{kind}`")));
    }
    let factor = gguf.get_f32(&format!("{arch}.rope.scaling.factor"));
    if factor.is_some_and(|f| f != 0.0 && f != 1.0) {
        return Err(ModelError::Unsupported(format!(
            "rope scaling factor {factor:?}"
        )));
    }
    Ok(())
}

mod weights;
pub use weights::{BoundTensor, LayerWeights, ModelWeights};

#[cfg(test)]
pub(crate) mod testutil;

#[cfg(test)]
mod tests {
    use super::testutil::{
        TINY, tiny_arch, tiny_llama, with_qkv_biases, with_rope_freqs, write_temp,
    };
    use super::*;

    fn open(name: &str, bytes: Vec<u8>) -> GgufFile {
        GgufFile::open(write_temp(name, &bytes)).expect("test file opens")
    }

    #[test]
    fn parses_tiny_llama_config_and_binds_weights() {
        let gguf = open("tiny.gguf", tiny_llama(TINY, None).build());
        let config = ModelConfig::from_gguf(&gguf).expect("config parses");
        assert_eq!(config.num_layers, 2);
        assert_eq!(config.head_dim, 32);
        assert_eq!(config.kv_dim(), 32);
        assert_eq!(config.group_size(), 2);
        assert_eq!(config.rope_dim, 32, "rope dim defaults to head dim");
        assert_eq!(config.vocab_size, TINY.vocab);
        assert!(config.tied_embeddings);
        let weights = ModelWeights::bind(&gguf, &config).expect("weights bind");
        assert_eq!(weights.layers.len(), 2);
        assert_eq!(
            (weights.layers[0].wk.rows, weights.layers[0].wk.cols),
            (32, 64)
        );
        assert_eq!(weights.output.info.name, "token_embd.weight");
        assert_eq!(weights.layers[1].ffn_norm.f32_values(&gguf).len(), 64);
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let gguf = open(
            "gemma.gguf",
            tiny_llama(TINY, None)
                .str("general.architecture", "gemma2")
                .build(),
        );
        let err = ModelConfig::from_gguf(&gguf).expect_err("gemma2 is not supported");
        assert_eq!(err, ModelError::UnsupportedArchitecture("gemma2".into()));
        let msg = err.to_string();
        assert!(
            msg.contains("gemma2") && msg.contains("llama") && msg.contains("qwen2"),
            "{msg}"
        );
    }

    #[test]
    fn missing_key_and_tensor_are_named() {
        // A key set to the wrong type reads as missing/invalid; drop one by renaming arch keys.
        let gguf = open(
            "nokey.gguf",
            tiny_llama(TINY, None)
                .str("llama.block_count", "thirty")
                .build(),
        );
        let err = ModelConfig::from_gguf(&gguf).expect_err("string block count");
        assert!(err.to_string().contains("llama.block_count"), "{err}");

        let gguf = open(
            "notensor.gguf",
            tiny_llama(TINY, Some("blk.1.ffn_up.weight")).build(),
        );
        let config = ModelConfig::from_gguf(&gguf).expect("config does not need the tensor");
        let err = ModelWeights::bind(&gguf, &config).expect_err("tensor missing");
        assert_eq!(err, ModelError::MissingTensor("blk.1.ffn_up.weight".into()));
    }

    #[test]
    fn shape_mismatch_is_reported() {
        // Claim a wider FFN than the tensors have.
        let gguf = open(
            "shape.gguf",
            tiny_llama(TINY, None)
                .u32("llama.feed_forward_length", 128)
                .build(),
        );
        let config = ModelConfig::from_gguf(&gguf).expect("config parses");
        let err = ModelWeights::bind(&gguf, &config).expect_err("ffn shape differs");
        assert!(
            matches!(&err, ModelError::ShapeMismatch { name, .. } if name == "blk.0.ffn_gate.weight"),
            "{err}"
        );
    }

    #[test]
    fn inconsistent_heads_are_rejected() {
        let gguf = open(
            "heads.gguf",
            tiny_llama(TINY, None)
                .u32("llama.attention.head_count_kv", 3)
                .build(),
        );
        let err = ModelConfig::from_gguf(&gguf).expect_err("3 does not divide 2");
        assert!(err.to_string().contains("head_count_kv"), "{err}");
        let gguf = open(
            "zero.gguf",
            tiny_llama(TINY, None)
                .u32("llama.attention.head_count", 0)
                .build(),
        );
        assert!(ModelConfig::from_gguf(&gguf).is_err());
    }

    #[test]
    fn rope_scaling_is_refused_not_ignored() {
        let gguf = open(
            "yarn.gguf",
            tiny_llama(TINY, None)
                .str("llama.rope.scaling.type", "yarn")
                .build(),
        );
        let err = ModelConfig::from_gguf(&gguf).expect_err("yarn unsupported");
        assert!(err.to_string().contains("yarn"), "{err}");
    }

    #[test]
    fn qwen2_reads_its_own_keys_and_uses_neox_rope() {
        let gguf = open("qwen2.gguf", tiny_arch("qwen2", TINY, None).build());
        let config = ModelConfig::from_gguf(&gguf).expect("qwen2 config parses");
        assert_eq!(config.architecture, "qwen2");
        assert_eq!(config.rope_mode, RopeMode::Neox);
        assert_eq!((config.num_layers, config.hidden_size), (2, 64));
        let llama = open("llama.gguf", tiny_llama(TINY, None).build());
        let llama = ModelConfig::from_gguf(&llama).expect("llama config parses");
        assert_eq!(llama.rope_mode, RopeMode::Norm);
    }

    #[test]
    fn qkv_biases_and_rope_freqs_bind_with_shape_checks() {
        let gguf = open(
            "bias.gguf",
            with_rope_freqs(with_qkv_biases(tiny_arch("qwen2", TINY, None), TINY), TINY).build(),
        );
        let config = ModelConfig::from_gguf(&gguf).expect("config");
        let w = ModelWeights::bind(&gguf, &config).expect("binds");
        let l = &w.layers[1];
        let lens = |t: &Option<BoundTensor>| t.as_ref().map(|t| t.cols);
        assert_eq!(
            (lens(&l.bq), lens(&l.bk), lens(&l.bv)),
            (Some(64), Some(32), Some(32))
        );
        assert_eq!(w.rope_freqs.as_ref().map(|t| t.cols), Some(16));
        // Without them: plain llama.
        let plain = open("plain.gguf", tiny_llama(TINY, None).build());
        let cfg = ModelConfig::from_gguf(&plain).expect("config");
        let w = ModelWeights::bind(&plain, &cfg).expect("binds");
        assert!(w.layers[0].bq.is_none() && w.rope_freqs.is_none());
        // A bias of the wrong width names the tensor.
        let bad = open(
            "badbias.gguf",
            tiny_llama(TINY, None)
                .tensor("blk.0.attn_k.bias", &[64], 0, vec![0; 256])
                .build(),
        );
        let cfg = ModelConfig::from_gguf(&bad).expect("config");
        let err = ModelWeights::bind(&bad, &cfg).expect_err("k bias is kv_dim wide");
        assert!(err.to_string().contains("blk.0.attn_k.bias"), "{err}");
        // An output bias is a graph kvgate lacks: refused, not ignored.
        let bo = open(
            "bo.gguf",
            tiny_llama(TINY, None)
                .tensor("blk.0.attn_output.bias", &[64], 0, vec![0; 256])
                .build(),
        );
        let cfg = ModelConfig::from_gguf(&bo).expect("config");
        let err = ModelWeights::bind(&bo, &cfg).expect_err("bo unsupported");
        assert!(err.to_string().contains("attn_output.bias"), "{err}");
    }

    #[test]
    fn kv_shape_is_f16_per_layer() {
        let gguf = open("kv.gguf", tiny_llama(TINY, None).build());
        let config = ModelConfig::from_gguf(&gguf).expect("config parses");
        assert_eq!(config.kv_shape().bytes_per_token(), 2 * 2 * 32 * 2);
    }
}

//! Synthetic llama-family GGUF files: the real shapes of SmolLM2-135M, Llama-2-7B and
//! Llama-2-13B (or a tiny test shape), deterministic random weights, and a small self-contained
//! byte-level BPE vocabulary of the model's real size.
//!
//! Why: device checks run on machines that cannot download anything and receive at most a few
//! MiB, so they build their models on the spot (`kvgate synth-model`). The weights are random,
//! so the text is gibberish, but every tensor has the shape, type and byte layout a real file of
//! that model has, which is all that kernels, memory plans and throughput depend on.
//!
//! Determinism: every tensor row chunk draws from its own generator seeded by (seed, tensor,
//! chunk), so the same spec gives the same bytes whatever the thread count. A file is written
//! in one streaming pass (a 13B Q4_0 file is 7 GiB; nothing holds more than one batch of row
//! chunks in memory) to a temporary `OUT.partial.*`, then renamed, so an interrupted run leaves no file that
//! looks complete.

use std::fmt;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use half::f16;
use rayon::prelude::*;

use kvgate_kernels::quant::kquants::quantize_row_k;
use kvgate_kernels::quant::{KQuantType, QK_K, WeightType};

use crate::gguf::MetaValue;
use crate::tokenizer::byte_to_char;

/// GGUF data alignment (the format's default; no `general.alignment` key is written).
const ALIGNMENT: u64 = 32;
/// Values generated per parallel task: big enough to amortise scheduling, small enough that a
/// batch of tasks stays a few MiB.
const VALUES_PER_TASK: usize = 1 << 16;
/// Tasks whose bytes are held before they are written, in order.
const TASKS_PER_BATCH: usize = 64;

/// The model shapes `kvgate synth-model` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthShape {
    /// 2 layers, hidden 128, 4 heads over 2 KV heads, vocabulary 512: for tests.
    Tiny,
    /// The tiny shape widened to hidden 256, FFN 512, 4 heads of 64 over 2 KV heads: every
    /// matrix is a whole number of 256-wide K-quant super-blocks. For K-quant tests.
    TinyK,
    /// The tiny-k shape as a `qwen2` file: Q/K/V biases, NEOX RoPE (llama.cpp's rope type for
    /// qwen2), Qwen2.5's RoPE base 1e6 and RMS epsilon 1e-6.
    TinyQwen2,
    /// The tiny-k shape as a Llama 3.1 file: RoPE base 500000 and the `rope_freqs.weight`
    /// factors of Llama 3.1's `rope_scaling` (type llama3, factor 8), as llama.cpp's converter
    /// writes them (it writes no scaling type for llama3).
    TinyLlama3,
    /// SmolLM2-135M (kvgate's default model): 30 layers, hidden 576, GQA 9/3, tied embeddings.
    Smollm2_135m,
    /// Llama-2-7B: 32 layers, hidden 4096, 32 heads, vocabulary 32000.
    Llama2_7b,
    /// Llama-2-13B, the worked example of KV sizing: 40 layers, hidden 5120, 40 heads.
    Llama2_13b,
}

/// Hyper-parameters of a shape, as its GGUF metadata states them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShapeSpec {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_freq_base: f32,
    pub rms_eps: f32,
    /// No `output.weight`: the token embedding is the output head (SmolLM2 ties them).
    pub tied_embeddings: bool,
    /// `general.architecture`: "llama" or "qwen2" (whose metadata keys start with it).
    pub arch: &'static str,
    /// F32 `attn_{q,k,v}.bias` in every layer (qwen2 requires them).
    pub qkv_bias: bool,
    /// A `rope_freqs.weight` tensor of Llama 3.1's per-pair RoPE factors.
    pub llama3_rope_freqs: bool,
}

impl SynthShape {
    pub const ALL: [SynthShape; 7] = [
        SynthShape::Tiny,
        SynthShape::TinyK,
        SynthShape::TinyQwen2,
        SynthShape::TinyLlama3,
        SynthShape::Smollm2_135m,
        SynthShape::Llama2_7b,
        SynthShape::Llama2_13b,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SynthShape::Tiny => "tiny",
            SynthShape::TinyK => "tiny-k",
            SynthShape::TinyQwen2 => "tiny-qwen2",
            SynthShape::TinyLlama3 => "tiny-llama3",
            SynthShape::Smollm2_135m => "smollm2-135m",
            SynthShape::Llama2_7b => "llama2-7b",
            SynthShape::Llama2_13b => "llama2-13b",
        }
    }

    /// The published configurations (HF `config.json` of each model).
    pub fn spec(self) -> ShapeSpec {
        match self {
            SynthShape::Tiny => ShapeSpec {
                layers: 2,
                hidden: 128,
                heads: 4,
                kv_heads: 2,
                ffn: 320,
                vocab: 512,
                context: 1024,
                rope_freq_base: 10_000.0,
                rms_eps: 1e-5,
                tied_embeddings: false,
                arch: "llama",
                qkv_bias: false,
                llama3_rope_freqs: false,
            },
            SynthShape::TinyK => ShapeSpec {
                hidden: 256,
                ffn: 512,
                ..SynthShape::Tiny.spec()
            },
            SynthShape::TinyQwen2 => ShapeSpec {
                rope_freq_base: 1_000_000.0,
                rms_eps: 1e-6,
                arch: "qwen2",
                qkv_bias: true,
                ..SynthShape::TinyK.spec()
            },
            SynthShape::TinyLlama3 => ShapeSpec {
                rope_freq_base: 500_000.0,
                llama3_rope_freqs: true,
                ..SynthShape::TinyK.spec()
            },
            SynthShape::Smollm2_135m => ShapeSpec {
                layers: 30,
                hidden: 576,
                heads: 9,
                kv_heads: 3,
                ffn: 1536,
                vocab: 49152,
                context: 8192,
                rope_freq_base: 100_000.0,
                rms_eps: 1e-5,
                tied_embeddings: true,
                arch: "llama",
                qkv_bias: false,
                llama3_rope_freqs: false,
            },
            SynthShape::Llama2_7b => ShapeSpec {
                layers: 32,
                hidden: 4096,
                heads: 32,
                kv_heads: 32,
                ffn: 11008,
                vocab: 32000,
                context: 4096,
                rope_freq_base: 10_000.0,
                rms_eps: 1e-5,
                tied_embeddings: false,
                arch: "llama",
                qkv_bias: false,
                llama3_rope_freqs: false,
            },
            SynthShape::Llama2_13b => ShapeSpec {
                layers: 40,
                hidden: 5120,
                heads: 40,
                kv_heads: 40,
                ffn: 13824,
                vocab: 32000,
                context: 4096,
                rope_freq_base: 10_000.0,
                rms_eps: 1e-5,
                tied_embeddings: false,
                arch: "llama",
                qkv_bias: false,
                llama3_rope_freqs: false,
            },
        }
    }
}

impl FromStr for SynthShape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|shape| shape.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|s| s.name()).collect();
                format!("unknown shape `{s}` (known: {})", names.join(", "))
            })
    }
}

impl fmt::Display for SynthShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Storage type of the weight matrices (norm weights are always F32, as llama.cpp writes them).
/// The K-quant types store each matrix whose width is a multiple of 256 in that type and the
/// rest in llama.cpp's fallback (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, as its quantizer
/// does); `q4_k_m` mixes Q4_K and Q6_K the way llama.cpp's Q4_K_M does.
#[allow(non_camel_case_types)] // llama.cpp's names
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthDtype {
    Q4_0,
    Q4_1,
    Q8_0,
    F16,
    Q4_K,
    Q5_K,
    Q6_K,
    /// Q4_K, with Q6_K for the output head and for `attn_v`/`ffn_down` in the layers
    /// llama.cpp's `use_more_bits` picks (the first and last eighth, every third between).
    Q4_K_M,
}

impl SynthDtype {
    pub const ALL: [SynthDtype; 8] = [
        SynthDtype::Q4_0,
        SynthDtype::Q4_1,
        SynthDtype::Q8_0,
        SynthDtype::F16,
        SynthDtype::Q4_K,
        SynthDtype::Q5_K,
        SynthDtype::Q6_K,
        SynthDtype::Q4_K_M,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SynthDtype::Q4_0 => "q4_0",
            SynthDtype::Q4_1 => "q4_1",
            SynthDtype::Q8_0 => "q8_0",
            SynthDtype::F16 => "f16",
            SynthDtype::Q4_K => "q4_k",
            SynthDtype::Q5_K => "q5_k",
            SynthDtype::Q6_K => "q6_k",
            SynthDtype::Q4_K_M => "q4_k_m",
        }
    }

    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`; plain K types as the `_S` mixes).
    fn file_type(self) -> u32 {
        match self {
            SynthDtype::Q4_0 => 2,
            SynthDtype::Q4_1 => 3,
            SynthDtype::Q8_0 => 7,
            SynthDtype::F16 => 1,
            SynthDtype::Q4_K => 14,
            SynthDtype::Q4_K_M => 15,
            SynthDtype::Q5_K => 16,
            SynthDtype::Q6_K => 18,
        }
    }

    /// The storage type of matrix `name` (`cols` wide) in layer `layer` of `layers`.
    fn matrix_type(
        self,
        name: &str,
        layer: Option<usize>,
        layers: usize,
        cols: usize,
    ) -> WeightType {
        let k = |ty: WeightType| {
            if cols.is_multiple_of(QK_K) {
                ty
            } else {
                match ty {
                    WeightType::Q4_K => WeightType::Q5_0,
                    WeightType::Q5_K => WeightType::Q5_1,
                    _ => WeightType::Q8_0,
                }
            }
        };
        match self {
            SynthDtype::Q4_0 => WeightType::Q4_0,
            SynthDtype::Q4_1 => WeightType::Q4_1,
            SynthDtype::Q8_0 => WeightType::Q8_0,
            SynthDtype::F16 => WeightType::F16,
            SynthDtype::Q4_K => k(WeightType::Q4_K),
            SynthDtype::Q5_K => k(WeightType::Q5_K),
            SynthDtype::Q6_K => k(WeightType::Q6_K),
            SynthDtype::Q4_K_M => {
                let more_bits = layer.is_some_and(|i| {
                    i < layers / 8 || i >= 7 * layers / 8 || (i - layers / 8) % 3 == 2
                });
                let wide = name == "output.weight"
                    || (more_bits
                        && (name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight")));
                k(if wide {
                    WeightType::Q6_K
                } else {
                    WeightType::Q4_K
                })
            }
        }
    }
}

/// GGML tensor type id of a storage type.
fn ggml_type(ty: WeightType) -> u32 {
    match ty {
        WeightType::F32 => 0,
        WeightType::F16 => 1,
        WeightType::Q4_0 => 2,
        WeightType::Q4_1 => 3,
        WeightType::Q5_0 => 6,
        WeightType::Q5_1 => 7,
        WeightType::Q8_0 => 8,
        WeightType::Q4_K => 12,
        WeightType::Q5_K => 13,
        WeightType::Q6_K => 14,
    }
}

/// Converts one row of f32 values (a multiple of the type's block) into `ty`.
fn encode_row(ty: WeightType, x: &[f32], out: &mut Vec<u8>) {
    match ty {
        WeightType::F32 => out.extend(x.iter().flat_map(|v| v.to_le_bytes())),
        WeightType::F16 => out.extend(x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes())),
        WeightType::Q4_0 | WeightType::Q4_1 | WeightType::Q5_0 | WeightType::Q5_1 => {
            let bits = if matches!(ty, WeightType::Q4_0 | WeightType::Q4_1) {
                4
            } else {
                5
            };
            for block in x.chunks_exact(32) {
                if matches!(ty, WeightType::Q4_0 | WeightType::Q5_0) {
                    quantize_block_symmetric(block, bits, out);
                } else {
                    quantize_block_min(block, bits, out);
                }
            }
        }
        WeightType::Q8_0 => {
            let start = out.len();
            out.resize(start + ty.row_bytes(x.len()), 0);
            kvgate_kernels::quant::quantize_row_q8_0(x, &mut out[start..]);
        }
        WeightType::Q4_K => quantize_row_k(KQuantType::Q4K, x, out),
        WeightType::Q5_K => quantize_row_k(KQuantType::Q5K, x, out),
        WeightType::Q6_K => quantize_row_k(KQuantType::Q6K, x, out),
    }
}

impl FromStr for SynthDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|dtype| dtype.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|d| d.name()).collect();
                format!("unknown dtype `{s}` (known: {})", known.join(", "))
            })
    }
}

impl fmt::Display for SynthDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthSpec {
    pub shape: SynthShape,
    pub dtype: SynthDtype,
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("cannot write {path}")]
    Io { path: PathBuf, source: io::Error },
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// RMSNorm weights: 1 ± 0.1, stored as F32.
    Norm,
    /// A Q/K/V bias: uniform in ±`scale`, stored as F32 (as llama.cpp's converter keeps them).
    Bias { scale: f32 },
    /// Llama 3.1's RoPE factors for `base` (see [`llama3_rope_factors`]), stored as F32.
    RopeFreqs { base: f32, head_dim: usize },
    /// A weight matrix: uniform in ±`scale`, stored in the spec's dtype.
    Matrix { scale: f32 },
}

#[derive(Clone, Debug)]
struct SynthTensor {
    name: String,
    /// GGML order: cols (contiguous), then rows.
    cols: usize,
    rows: usize,
    fill: Fill,
    /// Storage type (F32 for norms; matrices by the spec's dtype and the tensor's place).
    ty: WeightType,
    /// Offset from the start of the data section.
    offset: u64,
}

/// A synthetic model laid out: metadata, tensor directory and offsets, ready to be written.
#[derive(Clone, Debug)]
pub struct SynthModel {
    spec: SynthSpec,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<SynthTensor>,
    header_len: u64,
    data_len: u64,
}

impl SynthModel {
    pub fn new(spec: SynthSpec) -> SynthModel {
        let s = spec.shape.spec();
        let metadata = metadata(spec, &s);
        let head_dim = s.hidden / s.heads;
        let kv_dim = s.kv_heads * head_dim;
        // Uniform(±a) has variance a²/3: a = sqrt(3 / cols) keeps each output's variance near
        // its input's, so activations neither vanish nor blow up over the layers. The output
        // head is 4x that, so logits are spread enough for greedy decoding to have clear
        // winners (batch-invariance checks compare argmaxes).
        let matrix = |cols: usize, gain: f32| Fill::Matrix {
            scale: gain * (3.0 / cols as f32).sqrt(),
        };
        let mut tensors = Vec::new();
        let mut add = |name: String, cols: usize, rows: usize, fill: Fill| {
            let layer = name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|i| i.parse().ok());
            let ty = match fill {
                Fill::Norm | Fill::Bias { .. } | Fill::RopeFreqs { .. } => WeightType::F32,
                Fill::Matrix { .. } => spec.dtype.matrix_type(&name, layer, s.layers, cols),
            };
            tensors.push(SynthTensor {
                name,
                cols,
                rows,
                fill,
                ty,
                offset: 0,
            })
        };
        add(
            "token_embd.weight".into(),
            s.hidden,
            s.vocab,
            matrix(s.hidden, if s.tied_embeddings { 4.0 } else { 1.0 }),
        );
        if s.llama3_rope_freqs {
            add(
                "rope_freqs.weight".into(),
                head_dim / 2,
                1,
                Fill::RopeFreqs {
                    base: s.rope_freq_base,
                    head_dim,
                },
            );
        }
        // Biases of the size of the projections' own spread, so they visibly move Q, K and V.
        let bias = Fill::Bias { scale: 1.0 };
        for i in 0..s.layers {
            let n = |t: &str| format!("blk.{i}.{t}.weight");
            add(n("attn_norm"), s.hidden, 1, Fill::Norm);
            add(n("attn_q"), s.hidden, s.hidden, matrix(s.hidden, 1.0));
            add(n("attn_k"), s.hidden, kv_dim, matrix(s.hidden, 1.0));
            add(n("attn_v"), s.hidden, kv_dim, matrix(s.hidden, 1.0));
            if s.qkv_bias {
                let b = |t: &str| format!("blk.{i}.{t}.bias");
                add(b("attn_q"), s.hidden, 1, bias);
                add(b("attn_k"), kv_dim, 1, bias);
                add(b("attn_v"), kv_dim, 1, bias);
            }
            add(n("attn_output"), s.hidden, s.hidden, matrix(s.hidden, 1.0));
            add(n("ffn_norm"), s.hidden, 1, Fill::Norm);
            add(n("ffn_gate"), s.hidden, s.ffn, matrix(s.hidden, 1.0));
            add(n("ffn_up"), s.hidden, s.ffn, matrix(s.hidden, 1.0));
            add(n("ffn_down"), s.ffn, s.hidden, matrix(s.ffn, 1.0));
        }
        add("output_norm.weight".into(), s.hidden, 1, Fill::Norm);
        if !s.tied_embeddings {
            add(
                "output.weight".into(),
                s.hidden,
                s.vocab,
                matrix(s.hidden, 4.0),
            );
        }
        let mut offset = 0u64;
        for t in &mut tensors {
            t.offset = offset;
            offset = align(offset + tensor_bytes(t));
        }
        let mut model = SynthModel {
            spec,
            metadata,
            tensors,
            header_len: 0,
            data_len: offset,
        };
        model.header_len = model.header_bytes().len() as u64;
        model
    }

    pub fn spec(&self) -> SynthSpec {
        self.spec
    }

    /// The same model with `template` as its `tokenizer.chat_template` (synthetic models have
    /// none, so chats get ChatML): for tests of how a model file's own template is handled.
    pub fn with_chat_template(mut self, template: &str) -> SynthModel {
        const KEY: &str = "tokenizer.chat_template";
        self.metadata.retain(|(key, _)| key != KEY);
        self.metadata
            .push((KEY.to_owned(), MetaValue::String(template.to_owned())));
        // Tensor offsets count from the data section, so only the header's length changes.
        self.header_len = self.header_bytes().len() as u64;
        self
    }

    /// Bytes of the whole file.
    pub fn file_len(&self) -> u64 {
        self.header_len + self.data_len
    }

    /// Bytes of the header (metadata and tensor directory, padded to the data alignment).
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// Writes the header: magic, version 3, metadata, tensor directory, padding.
    pub fn write_header(&self, w: &mut impl Write) -> io::Result<()> {
        w.write_all(&self.header_bytes())
    }

    fn header_bytes(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        buf.extend(b"GGUF");
        buf.extend(3u32.to_le_bytes());
        buf.extend((self.tensors.len() as u64).to_le_bytes());
        buf.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut buf, key);
            put_value(&mut buf, value);
        }
        for t in &self.tensors {
            put_string(&mut buf, &t.name);
            let dims: &[u64] = if t.rows == 1 {
                &[t.cols as u64]
            } else {
                &[t.cols as u64, t.rows as u64]
            };
            buf.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                buf.extend(d.to_le_bytes());
            }
            buf.extend(ggml_type(t.ty).to_le_bytes());
            buf.extend(t.offset.to_le_bytes());
        }
        buf.resize(align(buf.len() as u64) as usize, 0);
        buf
    }

    /// Writes every tensor's values, in directory order, padded to the alignment.
    /// `progress` is called with the bytes written so far after each batch.
    pub fn write_data(&self, w: &mut impl Write, progress: &mut dyn FnMut(u64)) -> io::Result<()> {
        let mut written = 0u64;
        for (index, t) in self.tensors.iter().enumerate() {
            let rows_per_task = (VALUES_PER_TASK / t.cols).max(1);
            let tasks = t.rows.div_ceil(rows_per_task);
            let mut first = 0;
            while first < tasks {
                let last = (first + TASKS_PER_BATCH).min(tasks);
                let chunks: Vec<Vec<u8>> = (first..last)
                    .into_par_iter()
                    .map(|task| {
                        let rows = task * rows_per_task..((task + 1) * rows_per_task).min(t.rows);
                        self.tensor_rows(index, t, task, rows.len())
                    })
                    .collect();
                for chunk in &chunks {
                    w.write_all(chunk)?;
                    written += chunk.len() as u64;
                }
                progress(written);
                first = last;
            }
            let bytes = tensor_bytes(t);
            let pad = align(bytes) - bytes;
            w.write_all(&vec![0u8; pad as usize])?;
            written += pad;
        }
        progress(written);
        Ok(())
    }

    /// The bytes of `rows` rows of tensor `index` starting at row chunk `task`.
    fn tensor_rows(&self, index: usize, t: &SynthTensor, task: usize, rows: usize) -> Vec<u8> {
        let mut rng = SplitMix64::new(
            self.spec.seed ^ mix(index as u64 + 1) ^ mix((task as u64) << 32 | 0x5eed),
        );
        let mut values = vec![0f32; t.cols];
        match t.fill {
            Fill::Norm => {
                values
                    .iter_mut()
                    .for_each(|v| *v = 1.0 + 0.1 * rng.symmetric());
                values.iter().flat_map(|v| v.to_le_bytes()).collect()
            }
            Fill::Bias { scale } => {
                values.iter_mut().for_each(|v| *v = scale * rng.symmetric());
                values.iter().flat_map(|v| v.to_le_bytes()).collect()
            }
            Fill::RopeFreqs { base, head_dim } => llama3_rope_factors(base, head_dim)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            Fill::Matrix { scale } => {
                let mut out = Vec::with_capacity(rows * t.ty.row_bytes(t.cols));
                for _ in 0..rows {
                    values.iter_mut().for_each(|v| *v = scale * rng.symmetric());
                    encode_row(t.ty, &values, &mut out);
                }
                out
            }
        }
    }

    /// Writes the whole file to `path` (through a temporary file, renamed when complete; see
    /// [`crate::out_file`]).
    pub fn write_to(&self, path: &Path, progress: &mut dyn FnMut(u64)) -> Result<(), SynthError> {
        crate::out_file::write_via_partial(path, |file| {
            let mut w = BufWriter::with_capacity(8 << 20, file);
            self.write_header(&mut w)?;
            self.write_data(&mut w, progress)?;
            w.flush()
        })
        .map_err(|source| SynthError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Llama 3.1's RoPE frequency factors, one per rotated pair, as llama.cpp's
/// `convert_hf_to_gguf.py` computes `rope_freqs.weight` from `rope_scaling` {type llama3,
/// factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192}:
/// 1 for short wavelengths, 8 for long ones, a smooth blend between. (Computed in f64: the
/// values only need to be reproducible, both engines read them from the file.)
pub fn llama3_rope_factors(base: f32, head_dim: usize) -> Vec<f32> {
    const FACTOR: f64 = 8.0;
    const LOW_FREQ_FACTOR: f64 = 1.0;
    const HIGH_FREQ_FACTOR: f64 = 4.0;
    const OLD_CONTEXT: f64 = 8192.0;
    let (low_wavelen, high_wavelen) = (
        OLD_CONTEXT / LOW_FREQ_FACTOR,
        OLD_CONTEXT / HIGH_FREQ_FACTOR,
    );
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / f64::from(base).powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let factor = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                FACTOR
            } else {
                let smooth = (OLD_CONTEXT / wavelen - LOW_FREQ_FACTOR)
                    / (HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR);
                1.0 / ((1.0 - smooth) / FACTOR + smooth)
            };
            factor as f32
        })
        .collect()
}

fn align(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}

fn tensor_bytes(t: &SynthTensor) -> u64 {
    (t.rows * t.ty.row_bytes(t.cols)) as u64
}

/// The llama hyper-parameters and the tokenizer, in the keys llama.cpp writes.
fn metadata(spec: SynthSpec, s: &ShapeSpec) -> Vec<(String, MetaValue)> {
    let vocab = Vocabulary::new(s.vocab);
    let u32v = |n: usize| MetaValue::U32(n as u32);
    let key = |suffix: &str| format!("{}.{suffix}", s.arch);
    let entries: Vec<(String, MetaValue)> = vec![
        (
            "general.architecture".into(),
            MetaValue::String(s.arch.into()),
        ),
        (
            "general.name".into(),
            MetaValue::String(format!(
                "synthetic {} {} seed {}",
                spec.shape, spec.dtype, spec.seed
            )),
        ),
        (
            "general.file_type".into(),
            MetaValue::U32(spec.dtype.file_type()),
        ),
        ("kvgate.synthetic.seed".into(), MetaValue::U64(spec.seed)),
        (key("context_length"), u32v(s.context)),
        (key("embedding_length"), u32v(s.hidden)),
        (key("block_count"), u32v(s.layers)),
        (key("feed_forward_length"), u32v(s.ffn)),
        (key("attention.head_count"), u32v(s.heads)),
        (key("attention.head_count_kv"), u32v(s.kv_heads)),
        (key("rope.dimension_count"), u32v(s.hidden / s.heads)),
        (key("rope.freq_base"), MetaValue::F32(s.rope_freq_base)),
        (
            key("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(s.rms_eps),
        ),
        (key("vocab_size"), u32v(s.vocab)),
        (
            "tokenizer.ggml.model".into(),
            MetaValue::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".into(),
            MetaValue::String("gpt-2".into()),
        ),
        ("tokenizer.ggml.tokens".into(), strings(vocab.tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            MetaValue::Array(vocab.types.into_iter().map(MetaValue::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), strings(vocab.merges)),
        (
            "tokenizer.ggml.bos_token_id".into(),
            MetaValue::U32(IM_START),
        ),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(IM_END)),
        (
            "tokenizer.ggml.add_bos_token".into(),
            MetaValue::Bool(false),
        ),
    ];
    entries
}

fn strings(items: Vec<String>) -> MetaValue {
    MetaValue::Array(items.into_iter().map(MetaValue::String).collect())
}

/// Control tokens, at SmolLM2's ids, so the ChatML fallback template applies.
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const IM_START: u32 = 1;
const IM_END: u32 = 2;

/// A byte-level BPE vocabulary: the control tokens, the 256 byte tokens, then two-byte merges
/// (printable ASCII pairs first) until the vocabulary has the model's size. Every token spells
/// real bytes, so generated ids decode to text as a real model's would.
struct Vocabulary {
    tokens: Vec<String>,
    types: Vec<i32>,
    merges: Vec<String>,
}

impl Vocabulary {
    fn new(size: usize) -> Vocabulary {
        let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
        let mut types = vec![3; SPECIALS.len()];
        let mut bytes: Vec<u8> = (0x20..0x7f).collect();
        bytes.extend((0..=255u8).filter(|b| !(0x20..0x7f).contains(b)));
        for b in 0..=255u8 {
            tokens.push(byte_to_char(b).to_string());
            types.push(1);
        }
        let mut merges = Vec::new();
        'fill: for &a in &bytes {
            for &b in &bytes {
                if tokens.len() >= size {
                    break 'fill;
                }
                let (l, r) = (byte_to_char(a), byte_to_char(b));
                merges.push(format!("{l} {r}"));
                tokens.push(format!("{l}{r}"));
                types.push(1);
            }
        }
        // Shapes are fixed and all >= 259 + 1 tokens and <= 259 + 65536, so the size is exact.
        debug_assert_eq!(tokens.len(), size);
        Vocabulary {
            tokens,
            types,
            merges,
        }
    }
}

fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend((s.len() as u64).to_le_bytes());
    buf.extend(s.as_bytes());
}

/// GGUF value type id.
fn value_type(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

/// A typed value (type id, then payload); array elements share one type id, the first's.
fn put_value(buf: &mut Vec<u8>, v: &MetaValue) {
    buf.extend(value_type(v).to_le_bytes());
    put_payload(buf, v);
}

fn put_payload(buf: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => buf.push(*x),
        MetaValue::I8(x) => buf.extend(x.to_le_bytes()),
        MetaValue::U16(x) => buf.extend(x.to_le_bytes()),
        MetaValue::I16(x) => buf.extend(x.to_le_bytes()),
        MetaValue::U32(x) => buf.extend(x.to_le_bytes()),
        MetaValue::I32(x) => buf.extend(x.to_le_bytes()),
        MetaValue::U64(x) => buf.extend(x.to_le_bytes()),
        MetaValue::I64(x) => buf.extend(x.to_le_bytes()),
        MetaValue::F32(x) => buf.extend(x.to_le_bytes()),
        MetaValue::F64(x) => buf.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => buf.push(u8::from(*x)),
        MetaValue::String(s) => put_string(buf, s),
        MetaValue::Array(items) => {
            let elem = items.first().map_or(8, value_type);
            buf.extend(elem.to_le_bytes());
            buf.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_payload(buf, item);
            }
        }
    }
}

/// ggml's `quantize_row_q{4,5}_0_ref` for one block of `bits`-bit values: d = the signed value
/// of largest magnitude divided by −2^(bits−1), q = min(2^bits − 1, trunc(x/d + 2^(bits−1) + ½)).
/// Writes d, then the packed values.
fn quantize_block_symmetric(x: &[f32], bits: u32, out: &mut Vec<u8>) {
    let half = (1u32 << (bits - 1)) as f32;
    let max = x
        .iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -half;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    let top = (1i32 << bits) - 1;
    // ggml adds the constant 8.5 / 16.5 in one step (the sum is exact in f32).
    let q: [u8; 32] =
        std::array::from_fn(|j| ((x[j] * id + (half + 0.5)) as i32).clamp(0, top) as u8);
    pack_values(&q, bits, out);
}

/// ggml's `quantize_row_q{4,5}_1_ref` for one block: d = (max − min)/(2^bits − 1), m = min,
/// q = min(2^bits − 1, trunc((x − min)/d + ½)). Writes d, m, then the packed values.
fn quantize_block_min(x: &[f32], bits: u32, out: &mut Vec<u8>) {
    let top = (1i32 << bits) - 1;
    let min = x.iter().fold(f32::INFINITY, |m, &v| m.min(v));
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let d = (max - min) / top as f32;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(f16::from_f32(min).to_le_bytes());
    let q: [u8; 32] =
        std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as i32).clamp(0, top) as u8);
    pack_values(&q, bits, out);
}

/// 32 values of 4 bits as 16 nibble bytes (low nibbles = elements 0..16); of 5 bits, first the
/// little-endian `qh` word of fifth bits (bit `j` = element `j`), then the same nibble bytes.
fn pack_values(q: &[u8; 32], bits: u32, out: &mut Vec<u8>) {
    if bits == 5 {
        let qh = q
            .iter()
            .enumerate()
            .fold(0u32, |h, (j, &v)| h | (u32::from(v >> 4) << j));
        out.extend(qh.to_le_bytes());
    }
    out.extend((0..16).map(|j| (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4)));
}

/// splitmix64's finaliser: spreads a counter over all 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// splitmix64: tiny, fast, and fully specified, so files are reproducible across versions of
/// any external crate.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// Uniform in [−1, 1).
    fn symmetric(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let bits = mix(self.0) >> 40;
        bits as f32 / (1u64 << 23) as f32 - 1.0
    }
}

#[cfg(test)]
mod tests;

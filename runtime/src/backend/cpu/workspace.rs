//! Activation buffers of one forward pass, sized once for the largest step
//! (`max_batched_tokens` rows) and reused, so the hot path never allocates.

use kvgate_kernels::MatmulScratch;

use crate::model::ModelConfig;

/// Row-major `[tokens × width]` activations for every intermediate of a llama block.
pub struct Workspace {
    /// Residual stream.
    pub x: Vec<f32>,
    /// Normalised input of the attention or FFN block.
    pub xn: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Attention output (before the output projection).
    pub att: Vec<f32>,
    /// Output of a projection before it is added to the residual stream.
    pub proj: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub act: Vec<f32>,
    pub matmul: MatmulScratch,
    max_tokens: usize,
}

impl Workspace {
    /// Buffers for up to `max_tokens` tokens per step.
    pub fn new(config: &ModelConfig, max_tokens: usize) -> Workspace {
        let rows = |width: usize| vec![0.0f32; max_tokens * width];
        let (d, kv, ff) = (config.hidden_size, config.kv_dim(), config.ffn_size);
        Workspace {
            x: rows(d),
            xn: rows(d),
            q: rows(d),
            k: rows(kv),
            v: rows(kv),
            att: rows(d),
            proj: rows(d),
            gate: rows(ff),
            up: rows(ff),
            act: rows(ff),
            matmul: MatmulScratch::new(),
            max_tokens,
        }
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Bytes held by the activation buffers (the kernels' own scratch, a few KB per thread
    /// plus the quantized activations of one matmul, is not counted).
    pub fn bytes(&self) -> u64 {
        let f32s = [
            &self.x, &self.xn, &self.q, &self.k, &self.v, &self.att, &self.proj, &self.gate,
            &self.up, &self.act,
        ]
        .iter()
        .map(|b| b.capacity())
        .sum::<usize>();
        (f32s * std::mem::size_of::<f32>()) as u64
    }
}

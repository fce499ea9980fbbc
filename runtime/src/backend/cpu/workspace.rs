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

/// Floats per token of each buffer, in field order: x, xn, q, k, v, att, proj, gate, up, act.
fn widths(config: &ModelConfig) -> [usize; 10] {
    let (d, kv, ff) = (config.hidden_size, config.kv_dim(), config.ffn_size);
    [d, d, d, kv, kv, d, d, ff, ff, ff]
}

impl Workspace {
    /// Bytes of the activation buffers for `max_tokens` tokens per step, or `None` where that
    /// overflows (`--max-batched-tokens 18446744073709551615`): what the loader compares with
    /// the host's memory before anything is allocated.
    pub fn bytes_for(config: &ModelConfig, max_tokens: usize) -> Option<u64> {
        let floats = widths(config)
            .iter()
            .try_fold(0usize, |sum, w| sum.checked_add(w.checked_mul(max_tokens)?))?;
        u64::try_from(floats.checked_mul(std::mem::size_of::<f32>())?).ok()
    }

    /// Buffers for up to `max_tokens` tokens per step; `None` where their size overflows or
    /// the allocator cannot give them (an error for the caller, where `vec!` would abort).
    pub fn new(config: &ModelConfig, max_tokens: usize) -> Option<Workspace> {
        Self::bytes_for(config, max_tokens)?;
        let mut rows = widths(config).into_iter().map(|width| {
            let len = max_tokens.checked_mul(width)?;
            let mut buf = Vec::new();
            buf.try_reserve_exact(len).ok()?;
            buf.resize(len, 0.0f32);
            Some(buf)
        });
        let mut next = || rows.next().flatten();
        Some(Workspace {
            x: next()?,
            xn: next()?,
            q: next()?,
            k: next()?,
            v: next()?,
            att: next()?,
            proj: next()?,
            gate: next()?,
            up: next()?,
            act: next()?,
            matmul: MatmulScratch::new(),
            max_tokens,
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::model::testutil::{TINY, tiny_llama, write_temp};

    #[test]
    fn sizes_that_overflow_or_cannot_be_allocated_are_none_not_a_panic() {
        let path = write_temp("workspace.gguf", &tiny_llama(TINY, None).build());
        let config =
            ModelConfig::from_gguf(&GgufFile::open(&path).expect("opens")).expect("config");
        let ws = Workspace::new(&config, 4).expect("4 tokens");
        assert_eq!(Workspace::bytes_for(&config, 4), Some(ws.bytes()));
        // `--max-batched-tokens 18446744073709551615` overflowed `max_tokens * width`.
        assert_eq!(Workspace::bytes_for(&config, usize::MAX), None);
        assert!(Workspace::new(&config, usize::MAX).is_none());
        // Exabytes: the size fits a u64, the allocator refuses it (`vec!` aborted).
        let huge = usize::MAX / 4096;
        assert!(Workspace::bytes_for(&config, huge / 64).is_some());
        assert!(Workspace::new(&config, huge / 64).is_none());
    }
}

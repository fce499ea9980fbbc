//! A tiny random llama model written as a GGUF file, for tests that must not depend on the
//! real 97 MB model (config parsing edge cases, backend vs. reference forward).

use crate::gguf::testutil::GgufBuilder;
/// The model tests' files are written as every GGUF test's are, removed when their guard drops.
pub use crate::gguf::testutil::write_temp;

/// Shape of the tiny model. Head dim 32 keeps every row a whole number of 32-element blocks.
#[derive(Debug, Clone, Copy)]
pub struct TinyShape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub vocab: usize,
}

pub const TINY: TinyShape = TinyShape {
    layers: 2,
    hidden: 64,
    heads: 2,
    kv_heads: 1,
    ffn: 96,
    vocab: 40,
};

/// Deterministic pseudo-random values in [-scale, scale).
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// GGUF builder with the metadata of `shape` and all-F32 random weights, leaving out
/// `skip_tensor` if given. Later builder calls override keys (the reader keeps the last value),
/// which error-path tests use to corrupt one entry.
pub fn tiny_llama(shape: TinyShape, skip_tensor: Option<&str>) -> GgufBuilder {
    tiny_arch("llama", shape, skip_tensor)
}

/// [`tiny_llama`] with the metadata keys (and `general.architecture`) of `arch`.
pub fn tiny_arch(arch: &str, shape: TinyShape, skip_tensor: Option<&str>) -> GgufBuilder {
    let s = shape;
    let key = |k: &str| format!("{arch}.{k}");
    let kv_dim = (s.hidden / s.heads * s.kv_heads) as u64;
    let (d, ff, vocab) = (s.hidden as u64, s.ffn as u64, s.vocab as u64);
    let tokens: Vec<String> = (0..s.vocab).map(|i| format!("t{i}")).collect();
    let token_refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut b = GgufBuilder::new()
        .str("general.architecture", arch)
        .u32(&key("block_count"), s.layers as u32)
        .u32(&key("context_length"), 256)
        .u32(&key("embedding_length"), s.hidden as u32)
        .u32(&key("feed_forward_length"), s.ffn as u32)
        .u32(&key("attention.head_count"), s.heads as u32)
        .u32(&key("attention.head_count_kv"), s.kv_heads as u32)
        .f32(&key("rope.freq_base"), 10000.0)
        .f32(&key("attention.layer_norm_rms_epsilon"), 1e-5)
        .str_array("tokenizer.ggml.tokens", &token_refs);
    let mut seed = 1;
    let mut add = |b: GgufBuilder, name: &str, dims: &[u64], scale: f32, offset: f32| {
        if skip_tensor == Some(name) {
            return b;
        }
        seed += 1;
        let n = dims.iter().product::<u64>() as usize;
        let v: Vec<f32> = values(seed, n, scale).iter().map(|x| x + offset).collect();
        b.tensor(name, dims, 0, f32_bytes(&v))
    };
    b = add(b, "token_embd.weight", &[d, vocab], 1.0, 0.0);
    for i in 0..s.layers {
        let n = |t: &str| format!("blk.{i}.{t}.weight");
        b = add(b, &n("attn_norm"), &[d], 0.2, 1.0);
        b = add(b, &n("attn_q"), &[d, d], 0.3, 0.0);
        b = add(b, &n("attn_k"), &[d, kv_dim], 0.3, 0.0);
        b = add(b, &n("attn_v"), &[d, kv_dim], 0.3, 0.0);
        b = add(b, &n("attn_output"), &[d, d], 0.2, 0.0);
        b = add(b, &n("ffn_norm"), &[d], 0.2, 1.0);
        b = add(b, &n("ffn_gate"), &[d, ff], 0.2, 0.0);
        b = add(b, &n("ffn_up"), &[d, ff], 0.2, 0.0);
        b = add(b, &n("ffn_down"), &[ff, d], 0.2, 0.0);
    }
    add(b, "output_norm.weight", &[d], 0.2, 1.0)
}

/// Adds random F32 Q/K/V biases to every layer (qwen2's extra tensors).
pub fn with_qkv_biases(mut b: GgufBuilder, s: TinyShape) -> GgufBuilder {
    let kv_dim = (s.hidden / s.heads * s.kv_heads) as u64;
    for i in 0..s.layers {
        for (t, width, seed) in [
            ("q", s.hidden as u64, 101),
            ("k", kv_dim, 102),
            ("v", kv_dim, 103),
        ] {
            let v = values(seed + 10 * i as u64, width as usize, 0.5);
            b = b.tensor(
                &format!("blk.{i}.attn_{t}.bias"),
                &[width],
                0,
                f32_bytes(&v),
            );
        }
    }
    b
}

/// Adds Llama 3.1-style RoPE frequency factors: 1 for the high frequencies rising to 8 for
/// the lowest, one per rotated pair.
pub fn with_rope_freqs(b: GgufBuilder, s: TinyShape) -> GgufBuilder {
    let pairs = s.hidden / s.heads / 2;
    let ff: Vec<f32> = (0..pairs)
        .map(|i| 1.0 + 7.0 * (i as f32 / (pairs - 1) as f32).powi(2))
        .collect();
    b.tensor("rope_freqs.weight", &[pairs as u64], 0, f32_bytes(&ff))
}

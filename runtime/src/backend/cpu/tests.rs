//! CPU backend tests on a tiny random F32 llama: agreement with a plain reference forward, and
//! the paged-KV properties the engine relies on (chunking and batching do not change results).

use std::sync::Arc;

use half::f16;

use super::{CpuBackend, CpuBackendOptions};
use crate::backend::{Backend, BackendError, BatchInputs, SeqInputs};
use crate::gguf::GgufFile;
use crate::model::testutil::{
    TINY, tiny_arch, tiny_llama, with_qkv_biases, with_rope_freqs, write_temp,
};
use crate::model::{ModelConfig, ModelWeights};

const BLOCK: usize = 4;

fn tiny() -> (Arc<GgufFile>, ModelConfig) {
    open_model(&tiny_llama(TINY, None).build())
}

fn open_model(bytes: &[u8]) -> (Arc<GgufFile>, ModelConfig) {
    let path = write_temp("cpu-tiny.gguf", bytes);
    let gguf = Arc::new(GgufFile::open(path).expect("tiny model opens"));
    let config = ModelConfig::from_gguf(&gguf).expect("tiny config");
    (gguf, config)
}

fn backend(threads: usize) -> CpuBackend {
    let (gguf, config) = tiny();
    backend_of(gguf, config, threads)
}

fn backend_of(gguf: Arc<GgufFile>, config: ModelConfig, threads: usize) -> CpuBackend {
    let options = CpuBackendOptions {
        num_blocks: 32,
        block_size: BLOCK,
        max_batched_tokens: 64,
        threads: Some(threads),
    };
    CpuBackend::new(gguf, config, options).expect("backend starts")
}

/// One sequence's share of a step: `tokens` at positions `start..`, stored via `blocks`.
struct Part<'a> {
    tokens: &'a [u32],
    start: usize,
    blocks: &'a [u32],
}

fn batch(parts: &[Part]) -> BatchInputs {
    let mut b = BatchInputs::default();
    for p in parts {
        let token_start = b.token_ids.len();
        for (i, &t) in p.tokens.iter().enumerate() {
            let pos = p.start + i;
            b.token_ids.push(t);
            b.positions.push(pos as u32);
            b.slot_mapping
                .push(p.blocks[pos / BLOCK] * BLOCK as u32 + (pos % BLOCK) as u32);
        }
        b.seqs.push(SeqInputs {
            token_start,
            num_tokens: p.tokens.len(),
            context_len: p.start + p.tokens.len(),
            block_table: p.blocks.to_vec(),
            needs_logits: true,
            // Every token of these tests is a prompt token, however the steps cut them.
            prompt_len: p.start + p.tokens.len(),
        });
    }
    b
}

fn run(backend: &mut CpuBackend, parts: &[Part]) -> Vec<Vec<f32>> {
    let mut logits = Vec::new();
    backend
        .forward(&batch(parts), &mut logits)
        .expect("forward succeeds");
    logits.chunks(TINY.vocab).map(<[f32]>::to_vec).collect()
}

const PROMPT: [u32; 9] = [3, 17, 5, 39, 0, 22, 8, 8, 31];

/// Plain f64 llama forward (K, V, q and probabilities rounded to f16 like the backend) giving
/// the logits after every position of `tokens`.
fn reference(tokens: &[u32]) -> Vec<Vec<f32>> {
    let (gguf, cfg) = tiny();
    reference_of(&gguf, &cfg, tokens)
}

/// [`reference`] for any tiny model: Q/K/V biases when present, the config's RoPE pairing and
/// the file's frequency factors.
fn reference_of(gguf: &GgufFile, cfg: &ModelConfig, tokens: &[u32]) -> Vec<Vec<f32>> {
    let w = ModelWeights::bind(gguf, cfg).expect("bind");
    let vals = |t: &crate::model::BoundTensor| -> Vec<f64> {
        t.f32_values(gguf).iter().map(|&v| f64::from(v)).collect()
    };
    let freqs = w.rope_freqs.as_ref().map(vals);
    let add_bias = |x: &mut Vec<f64>, b: &Option<crate::model::BoundTensor>| {
        if let Some(b) = b {
            x.iter_mut().zip(vals(b)).for_each(|(a, b)| *a += b);
        }
    };
    let (d, hd) = (cfg.hidden_size, cfg.head_dim);
    let matvec = |m: &[f64], x: &[f64]| -> Vec<f64> {
        m.chunks(x.len())
            .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    let norm = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + f64::from(cfg.rms_eps)).sqrt();
        x.iter().zip(w).map(|(v, w)| v * s * w).collect()
    };
    let rope = |x: &mut [f64], pos: usize| {
        for head in x.chunks_mut(hd) {
            for i in 0..hd / 2 {
                let ff = freqs.as_ref().map_or(1.0, |f| f[i]);
                let theta = pos as f64
                    * f64::from(cfg.rope_freq_base).powf(-2.0 * i as f64 / hd as f64)
                    / ff;
                let (ia, ib) = match cfg.rope_mode {
                    kvgate_kernels::RopeMode::Norm => (2 * i, 2 * i + 1),
                    kvgate_kernels::RopeMode::Neox => (i, i + hd / 2),
                };
                let (a, b) = (head[ia], head[ib]);
                head[ia] = a * theta.cos() - b * theta.sin();
                head[ib] = a * theta.sin() + b * theta.cos();
            }
        }
    };
    let h16 = |v: f64| f64::from(f16::from_f64(v).to_f32());
    let embd = vals(&w.token_embd);
    let mut ks: Vec<Vec<Vec<f64>>> = vec![Vec::new(); cfg.num_layers];
    let mut vs: Vec<Vec<Vec<f64>>> = vec![Vec::new(); cfg.num_layers];
    let mut out = Vec::new();
    for (pos, &tok) in tokens.iter().enumerate() {
        let mut x: Vec<f64> = embd[tok as usize * d..(tok as usize + 1) * d].to_vec();
        for (l, lw) in w.layers.iter().enumerate() {
            let xn = norm(&x, &vals(&lw.attn_norm));
            let mut q = matvec(&vals(&lw.wq), &xn);
            let mut k = matvec(&vals(&lw.wk), &xn);
            let mut v = matvec(&vals(&lw.wv), &xn);
            add_bias(&mut q, &lw.bq);
            add_bias(&mut k, &lw.bk);
            add_bias(&mut v, &lw.bv);
            rope(&mut q, pos);
            rope(&mut k, pos);
            ks[l].push(k.iter().map(|&v| h16(v)).collect());
            vs[l].push(v.iter().map(|&v| h16(v)).collect());
            let mut att = vec![0.0; d];
            for h in 0..cfg.num_heads {
                let kvh = h / cfg.group_size();
                let qh: Vec<f64> = q[h * hd..(h + 1) * hd].iter().map(|&v| h16(v)).collect();
                let scores: Vec<f64> = ks[l]
                    .iter()
                    .map(|k| {
                        k[kvh * hd..(kvh + 1) * hd]
                            .iter()
                            .zip(&qh)
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (p, v) in scores.iter().zip(&vs[l]) {
                    let prob = h16((p - max).exp() / sum);
                    for i in 0..hd {
                        att[h * hd + i] += prob * v[kvh * hd + i];
                    }
                }
            }
            let o = matvec(&vals(&lw.wo), &att);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let xn = norm(&x, &vals(&lw.ffn_norm));
            let g = matvec(&vals(&lw.ffn_gate), &xn);
            let u = matvec(&vals(&lw.ffn_up), &xn);
            let act: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let o = matvec(&vals(&lw.ffn_down), &act);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
        let xn = norm(&x, &vals(&w.output_norm));
        out.push(matvec(&embd, &xn).iter().map(|&v| v as f32).collect());
    }
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn token_by_token_matches_the_reference_forward() {
    let want = reference(&PROMPT);
    let mut be = backend(2);
    let blocks = [5, 2, 9];
    for (pos, want) in want.iter().enumerate() {
        let got = run(
            &mut be,
            &[Part {
                tokens: &PROMPT[pos..=pos],
                start: pos,
                blocks: &blocks,
            }],
        );
        let diff = max_abs_diff(&got[0], want);
        assert!(diff < 2e-3, "position {pos}: max |diff| {diff}");
        assert!(got[0].iter().all(|v| v.is_finite()));
    }
}

#[test]
fn qwen2_and_llama3_rope_factors_match_the_reference_forward() {
    // qwen2: Q/K/V biases and NEOX pairs; llama with rope_freqs: Llama 3.1's factors. Each
    // feature alone changes the logits well beyond the tolerance (checked against plain llama),
    // so a backend that ignored one would fail here.
    let plain = reference(&PROMPT);
    let models = [
        (
            "qwen2",
            with_qkv_biases(tiny_arch("qwen2", TINY, None), TINY).build(),
        ),
        (
            "llama3",
            with_rope_freqs(tiny_llama(TINY, None), TINY).build(),
        ),
    ];
    for (name, bytes) in models {
        let (gguf, cfg) = open_model(&bytes);
        let want = reference_of(&gguf, &cfg, &PROMPT);
        let differs = max_abs_diff(&want[PROMPT.len() - 1], &plain[PROMPT.len() - 1]);
        assert!(
            differs > 0.05,
            "{name}: the feature must matter ({differs})"
        );
        let mut be = backend_of(Arc::clone(&gguf), cfg, 2);
        // A whole-prompt chunk, then token by token on a second sequence.
        let whole = run(
            &mut be,
            &[Part {
                tokens: &PROMPT,
                start: 0,
                blocks: &[4, 6, 8],
            }],
        );
        let last = max_abs_diff(&whole[0], &want[PROMPT.len() - 1]);
        assert!(last < 2e-3, "{name} chunk: max |diff| {last}");
        for (pos, want) in want.iter().enumerate() {
            let got = run(
                &mut be,
                &[Part {
                    tokens: &PROMPT[pos..=pos],
                    start: pos,
                    blocks: &[5, 2, 9],
                }],
            );
            let diff = max_abs_diff(&got[0], want);
            assert!(diff < 2e-3, "{name} position {pos}: max |diff| {diff}");
        }
    }
}

#[test]
fn one_chunk_several_chunks_and_single_tokens_agree() {
    let blocks = [1, 7, 3];
    let mut one = backend(2);
    let whole = run(
        &mut one,
        &[Part {
            tokens: &PROMPT,
            start: 0,
            blocks: &blocks,
        }],
    );

    let mut chunked = backend(1);
    let mut last = Vec::new();
    for (start, end) in [(0, 4), (4, 5), (5, 9)] {
        last = run(
            &mut chunked,
            &[Part {
                tokens: &PROMPT[start..end],
                start,
                blocks: &blocks,
            }],
        );
    }
    // Bit for bit: how a sequence is split into steps (a prefix-cache hit leaving one token,
    // a preempted sequence recomputing what it generated one step at a time, a chunk boundary)
    // must not change its numbers, or greedy output would depend on it.
    assert_eq!(whole[0], last[0], "chunking changed the logits");

    let reference = reference(&PROMPT);
    assert!(max_abs_diff(&whole[0], &reference[PROMPT.len() - 1]) < 2e-3);
}

#[test]
fn a_sequence_gives_identical_logits_alone_and_in_a_batch() {
    let a_blocks = [0, 1, 2];
    let b_blocks = [10, 11, 12];
    let c_blocks = [20, 21];
    let mut alone = backend(2);
    run(
        &mut alone,
        &[Part {
            tokens: &PROMPT[..8],
            start: 0,
            blocks: &a_blocks,
        }],
    );
    let a_alone = run(
        &mut alone,
        &[Part {
            tokens: &PROMPT[8..],
            start: 8,
            blocks: &a_blocks,
        }],
    );

    let mut batched = backend(2);
    // A's prefill shares a step with C's prefill, then A decodes next to B's prefill and C.
    let first = run(
        &mut batched,
        &[
            Part {
                tokens: &PROMPT[2..7],
                start: 0,
                blocks: &c_blocks,
            },
            Part {
                tokens: &PROMPT[..8],
                start: 0,
                blocks: &a_blocks,
            },
        ],
    );
    let second = run(
        &mut batched,
        &[
            Part {
                tokens: &PROMPT[..9],
                start: 0,
                blocks: &b_blocks,
            },
            Part {
                tokens: &PROMPT[8..],
                start: 8,
                blocks: &a_blocks,
            },
            Part {
                tokens: &[4],
                start: 5,
                blocks: &c_blocks,
            },
        ],
    );
    assert_eq!(first.len(), 2);
    assert_eq!(
        a_alone[0], second[1],
        "batching changed sequence A's logits"
    );

    // And a sequence's prefill logits do not depend on its batch-mates either.
    let mut c_alone = backend(1);
    let c = run(
        &mut c_alone,
        &[Part {
            tokens: &PROMPT[2..7],
            start: 0,
            blocks: &c_blocks,
        }],
    );
    assert_eq!(c[0], first[0]);
}

#[test]
fn invalid_inputs_are_rejected_and_the_backend_keeps_working() {
    let mut be = backend(2);
    let mut bad = batch(&[Part {
        tokens: &PROMPT[..3],
        start: 0,
        blocks: &[31],
    }]);
    bad.seqs[0].block_table[0] = 32;
    let mut logits = Vec::new();
    let err = be
        .forward(&bad, &mut logits)
        .expect_err("block 32 is outside the cache");
    assert!(matches!(err, BackendError::InvalidInputs(_)), "{err}");
    let ok = run(
        &mut be,
        &[Part {
            tokens: &PROMPT[..3],
            start: 0,
            blocks: &[31],
        }],
    );
    assert_eq!(ok.len(), 1);
}

#[test]
fn only_sequences_that_ask_get_logits_and_memory_is_reported() {
    let mut be = backend(2);
    let mut inputs = batch(&[
        Part {
            tokens: &PROMPT[..4],
            start: 0,
            blocks: &[0],
        },
        Part {
            tokens: &PROMPT[..2],
            start: 0,
            blocks: &[1],
        },
    ]);
    inputs.seqs[0].needs_logits = false;
    let mut logits = Vec::new();
    be.forward(&inputs, &mut logits).expect("forward");
    assert_eq!(logits.len(), TINY.vocab);
    let mem = be.memory();
    // 2 layers × K,V × 32 blocks × 4 slots × 32 values × 2 bytes.
    assert_eq!(mem.kv_bytes, 2 * 2 * 32 * 4 * 32 * 2);
    assert!(mem.weights_bytes > 0 && mem.workspace_bytes > 0);
}

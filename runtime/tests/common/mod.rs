//! Shared helpers for the runtime's real-model tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use kvgate_runtime::backend::cpu::{CpuBackend, CpuBackendOptions};
use kvgate_runtime::backend::{Backend, BatchInputs, SeqInputs};
use kvgate_runtime::gguf::GgufFile;
use kvgate_runtime::model::ModelConfig;

/// The provisioned default model. A missing file fails the test (it must not silently pass).
pub fn model_path() -> PathBuf {
    let path = kvgate_runtime::provision::default_model_location()
        .unwrap_or_else(|error| panic!("{error}"));
    assert!(
        path.is_file(),
        "the default model is missing at {}: provision it first with `cargo run -- fetch-model`",
        path.display()
    );
    path
}

pub fn open_model() -> (Arc<GgufFile>, ModelConfig) {
    let gguf = Arc::new(GgufFile::open(model_path()).expect("the default model opens"));
    let config = ModelConfig::from_gguf(&gguf).expect("the default model's config parses");
    (gguf, config)
}

pub const BLOCK: usize = 16;

/// A CPU backend over the default model with `num_blocks` blocks of 16 tokens.
pub fn backend(num_blocks: usize, threads: usize) -> CpuBackend {
    backend_at(&model_path(), num_blocks, threads)
}

/// A CPU backend over the GGUF at `path`, as [`backend`].
pub fn backend_at(path: &std::path::Path, num_blocks: usize, threads: usize) -> CpuBackend {
    let gguf =
        Arc::new(GgufFile::open(path).unwrap_or_else(|e| panic!("{} opens: {e}", path.display())));
    let config = ModelConfig::from_gguf(&gguf).expect("the model's config parses");
    let options = CpuBackendOptions {
        num_blocks,
        block_size: BLOCK,
        max_batched_tokens: 512,
        threads: Some(threads),
    };
    CpuBackend::new(gguf, config, options).expect("CPU backend starts")
}

/// One sequence's share of a step: `tokens` at positions `start..`, stored in `blocks`.
pub struct Part<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub blocks: &'a [u32],
}

pub fn batch(parts: &[Part]) -> BatchInputs {
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
            // Prompt tokens, however the steps cut them; [`greedy`] marks its decode steps.
            prompt_len: p.start + p.tokens.len(),
        });
    }
    b
}

/// Runs one step and returns one logits row per part.
pub fn step(backend: &mut CpuBackend, parts: &[Part]) -> Vec<Vec<f32>> {
    step_inputs(backend, &batch(parts))
}

/// Runs one step of `inputs` and returns one logits row per sequence.
pub fn step_inputs(backend: &mut CpuBackend, inputs: &BatchInputs) -> Vec<Vec<f32>> {
    let mut logits = Vec::new();
    backend
        .forward(inputs, &mut logits)
        .expect("forward succeeds");
    logits
        .chunks(backend.vocab_size())
        .map(<[f32]>::to_vec)
        .collect()
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding straight on the backend: the prompt as one prefill chunk, then one token
/// per step, stopping after `eos` or `steps` tokens. Blocks 0.. are used.
pub fn greedy(
    backend: &mut CpuBackend,
    prompt: &[u32],
    steps: usize,
    eos: Option<u32>,
) -> Vec<u32> {
    let blocks: Vec<u32> = (0..(prompt.len() + steps).div_ceil(BLOCK) as u32).collect();
    let mut logits = step(
        backend,
        &[Part {
            tokens: prompt,
            start: 0,
            blocks: &blocks,
        }],
    );
    let mut out = Vec::new();
    for i in 0..steps {
        let next = argmax(&logits[0]);
        out.push(next);
        if Some(next) == eos || i + 1 == steps {
            break;
        }
        let mut inputs = batch(&[Part {
            tokens: &[next],
            start: prompt.len() + i,
            blocks: &blocks,
        }]);
        // A generated token, as in llama.cpp's decode steps.
        inputs.seqs[0].prompt_len = prompt.len();
        logits = step_inputs(backend, &inputs);
    }
    out
}

/// A JSON fixture from tests/fixtures/llama_cpp (llama.cpp's recorded outputs).
pub fn llama_cpp_fixture(name: &str) -> serde_json::Value {
    let path = format!(
        "{}/../tests/fixtures/llama_cpp/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} does not parse: {e}"))
}

/// A JSON array of token ids.
pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of token ids")
        .iter()
        .map(|x| x.as_u64().expect("a token id") as u32)
        .collect()
}

/// Greedy decoding of every case of a llama.cpp greedy fixture (greedy.json's format): a
/// divergence from llama.cpp's ids is accepted only at a step where llama.cpp's own top-2 logit
/// margin is below `max_margin`; after it the contexts differ and that case's comparison stops.
/// Returns one report line per case.
pub fn assert_greedy_matches(
    be: &mut CpuBackend,
    fixtures: &serde_json::Value,
    max_margin: f64,
) -> Vec<String> {
    let eos = fixtures["eos_id"].as_u64().map(|e| e as u32);
    let steps = fixtures["steps"].as_u64().expect("steps") as usize;
    let mut report = Vec::new();
    for (n, case) in fixtures["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .enumerate()
    {
        let prompt = json_ids(&case["prompt_ids"]);
        let want = json_ids(&case["greedy_ids"]);
        let margins: Vec<f64> = case["top2_margins"]
            .as_array()
            .expect("margins")
            .iter()
            .map(|m| m.as_f64().expect("a margin"))
            .collect();
        let got = greedy(be, &prompt, steps, eos);
        match got.iter().zip(&want).position(|(a, b)| a != b) {
            None => {
                assert_eq!(
                    got.len(),
                    want.len(),
                    "case {n}: same tokens but a different length"
                );
                report.push(format!("case {n}: identical ({} tokens)", got.len()));
            }
            Some(i) => {
                assert!(
                    margins[i] < max_margin,
                    "case {n}: diverged at step {i} where llama.cpp's top-2 margin is {} \
                     (only < {max_margin} is acceptable)\n  kvgate:    {got:?}\n  llama.cpp: {want:?}",
                    margins[i]
                );
                report.push(format!(
                    "case {n}: diverged at step {i} (margin {:.3})",
                    margins[i]
                ));
            }
        }
    }
    report
}

/// First-step logits of every case of a greedy fixture against llama.cpp's recorded top 10:
/// each within `tolerance`, and kvgate's argmax one of llama.cpp's top 10 whose logit is within
/// `max_margin` of llama.cpp's best (llama.cpp's own pick, or a near tie). Returns the mean
/// |deviation|.
pub fn assert_first_step_close(
    be: &mut CpuBackend,
    fixtures: &serde_json::Value,
    tolerance: f32,
    max_margin: f64,
) -> f64 {
    let (mut total_deviation, mut compared) = (0.0f64, 0usize);
    for (n, case) in fixtures["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .enumerate()
    {
        let prompt = json_ids(&case["prompt_ids"]);
        let blocks: Vec<u32> = (0..prompt.len().div_ceil(BLOCK) as u32).collect();
        let logits = step(
            be,
            &[Part {
                tokens: &prompt,
                start: 0,
                blocks: &blocks,
            }],
        );
        let top = case["first_step_top10"].as_array().expect("top10");
        for pair in top {
            let id = pair[0].as_u64().expect("id") as usize;
            let want = pair[1].as_f64().expect("logit") as f32;
            let got = logits[0][id];
            assert!(
                (got - want).abs() < tolerance,
                "case {n}: logit of token {id} is {got}, llama.cpp has {want}"
            );
            total_deviation += f64::from((got - want).abs());
            compared += 1;
        }
        let ours = argmax(&logits[0]) as u64;
        let best = top[0][1].as_f64().expect("logit");
        assert!(
            top.iter().any(|pair| pair[0].as_u64() == Some(ours)
                && best - pair[1].as_f64().expect("logit") < max_margin.max(f64::MIN_POSITIVE)),
            "case {n}: argmax {ours} ({}), llama.cpp's top two {} {}",
            logits[0][ours as usize],
            top[0],
            top[1]
        );
    }
    total_deviation / compared as f64
}

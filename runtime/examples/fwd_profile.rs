#![allow(clippy::needless_range_loop)]
// Temporary profiling harness (backend only).
use std::sync::Arc;
use std::time::Instant;
use kvgate_runtime::backend::cpu::{CpuBackend, CpuBackendOptions};
use kvgate_runtime::backend::{Backend, BatchInputs, SeqInputs};
use kvgate_runtime::gguf::GgufFile;
use kvgate_runtime::model::ModelConfig;

const BS: usize = 16;
fn push(b: &mut BatchInputs, toks: &[u32], start: usize, blocks: &[u32]) {
    let ts = b.token_ids.len();
    for (i, &t) in toks.iter().enumerate() {
        let p = start + i;
        b.token_ids.push(t);
        b.positions.push(p as u32);
        b.slot_mapping.push(blocks[p / BS] * BS as u32 + (p % BS) as u32);
    }
    b.seqs.push(SeqInputs { token_start: ts, num_tokens: toks.len(), context_len: start + toks.len(), block_table: blocks.to_vec(), needs_logits: true });
}
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let mode = args.get(2).cloned().unwrap_or("all".into());
    let path = kvgate_runtime::provision::default_model_location();
    let gguf = Arc::new(GgufFile::open(path).unwrap());
    let cfg = ModelConfig::from_gguf(&gguf).unwrap();
    let mut be = CpuBackend::new(gguf, cfg, CpuBackendOptions { num_blocks: 1024, block_size: BS, max_batched_tokens: 512, threads: Some(threads) }).unwrap();
    let prompt: Vec<u32> = (0..200).map(|i| (i * 7919 % 40000 + 100) as u32).collect();
    let mut logits = Vec::new();
    let blocks: Vec<u32> = (0..22).collect();
    if mode == "all" || mode == "single" {
        for rep in 0..3 {
            let mut b = BatchInputs::default();
            push(&mut b, &prompt, 0, &blocks);
            let t = Instant::now();
            be.forward(&b, &mut logits).unwrap();
            let pf = t.elapsed().as_secs_f64();
            let t = Instant::now();
            for i in 0..128 {
                let mut b = BatchInputs::default();
                push(&mut b, &[(i * 31 + 5) as u32], 200 + i, &blocks);
                be.forward(&b, &mut logits).unwrap();
            }
            let dc = t.elapsed().as_secs_f64();
            println!("rep {rep}: prefill {:.1} tok/s, decode {:.1} tok/s", 200.0 / pf, 128.0 / dc);
        }
    }
    if mode == "all" || mode == "batch" {
        for n in [1usize, 4, 16, 64] {
            // n seqs, each with 32-token context, decode 32 steps.
            let tables: Vec<Vec<u32>> = (0..n).map(|s| (0..5).map(|j| (100 + s * 5 + j) as u32).collect()).collect();
            let mut b = BatchInputs::default();
            for s in 0..n { push(&mut b, &prompt[s % 100..s % 100 + 32], 0, &tables[s]); }
            // prefill in chunks of <=512 tokens
            let mut start = 0;
            while start < n { let end = (start + 16).min(n); let mut bb = BatchInputs::default(); for s in start..end { push(&mut bb, &prompt[s % 100..s % 100 + 32], 0, &tables[s]); } be.forward(&bb, &mut logits).unwrap(); start = end; }
            let t = Instant::now();
            for i in 0..32 {
                let mut b = BatchInputs::default();
                for s in 0..n { push(&mut b, &[(i * 31 + s) as u32], 32 + i, &tables[s]); }
                be.forward(&b, &mut logits).unwrap();
            }
            let dt = t.elapsed().as_secs_f64();
            println!("batch {n}: {:.1} tok/s aggregate", (32 * n) as f64 / dt);
        }
    }
}

//! One llama forward pass over a whole scheduler step: every token of every sequence goes
//! through each weight matrix in a single matmul (so a batched decode reads the weights once),
//! while RoPE, the KV write and attention are per token, reading each sequence's own blocks.
//!
//! The order of operations and roundings is llama.cpp's `llm_build_llama` (see DESIGN.md,
//! Seam 1). Like llama.cpp, the last layer only computes queries, attention and the FFN for the
//! rows that need logits; the other rows only contribute their K and V.

use kvgate_kernels::attention::AttentionScratch;
use kvgate_kernels::quant::dequantize_row;
use kvgate_kernels::{
    KvLayout, ReductionOrder, RopeMode, matmul, paged_attention, rms_norm, rope, swiglu, write_kv,
};
use rayon::prelude::*;

use super::kv_cache::LayerKv;
use super::step_plan::StepPlan;
use super::weights::{CpuModel, LayerMats};
use super::workspace::Workspace;
use crate::backend::{BackendError, BatchInputs};

/// Everything a layer reads that stays fixed for the step.
pub struct Step<'a> {
    pub model: &'a CpuModel,
    pub inputs: &'a BatchInputs,
    pub plan: &'a StepPlan,
    pub layout: KvLayout,
    pub pool: &'a rayon::ThreadPool,
}

impl Step<'_> {
    /// Token index of query row `row`: all tokens, or in the last layer only the logit rows.
    fn query_token(&self, row: usize, outputs_only: bool) -> usize {
        if outputs_only {
            self.plan.logit_rows[row]
        } else {
            row
        }
    }
}

/// Runs the step; writes `logit_rows.len() × vocab` logits.
pub fn run(
    step: &Step,
    kv: &mut [LayerKv],
    ws: &mut Workspace,
    logits: &mut Vec<f32>,
) -> Result<(), BackendError> {
    let model = step.model;
    let cfg = &model.config;
    let d = cfg.hidden_size;
    let n = step.inputs.token_ids.len();
    embed(step, &mut ws.x[..n * d])?;

    let last = model.layers.len().saturating_sub(1);
    let mut rows = n;
    for (l, (layer, layer_kv)) in model.layers.iter().zip(kv.iter_mut()).enumerate() {
        rows = attention_block(step, layer, layer_kv, ws, l == last);
        ffn_block(step, layer, ws, rows);
    }

    let r = rows;
    for j in 0..r {
        rms_norm(
            &ws.x[j * d..(j + 1) * d],
            &model.output_norm,
            cfg.rms_eps,
            &mut ws.xn[j * d..(j + 1) * d],
        );
    }
    logits.clear();
    logits.resize(r * cfg.vocab_size, 0.0);
    let head = model.output.view(&model.gguf);
    matmul(&head, &ws.xn[..r * d], r, logits, &mut ws.matmul, step.pool);
    Ok(())
}

/// Residual stream rows = dequantized embedding rows of the step's tokens.
fn embed(step: &Step, x: &mut [f32]) -> Result<(), BackendError> {
    let model = step.model;
    let d = model.config.hidden_size;
    for (&id, row) in step.inputs.token_ids.iter().zip(x.chunks_exact_mut(d)) {
        let bytes = model.embd.row(&model.gguf, id as usize);
        dequantize_row(model.embd.ty, bytes, row)
            .map_err(|e| BackendError::Other(format!("token embedding: {e}")))?;
    }
    Ok(())
}

/// Pre-norm attention with residual. Returns how many rows continue (all tokens, or the logit
/// rows compacted to the front in the last layer).
fn attention_block(
    step: &Step,
    layer: &LayerMats,
    kv: &mut LayerKv,
    ws: &mut Workspace,
    last: bool,
) -> usize {
    let cfg = &step.model.config;
    let gguf = &*step.model.gguf;
    let (d, kvd, hd) = (cfg.hidden_size, cfg.kv_dim(), cfg.head_dim);
    let n = step.inputs.token_ids.len();
    let positions = &step.inputs.positions;

    for t in 0..n {
        rms_norm(
            &ws.x[t * d..(t + 1) * d],
            &layer.attn_norm,
            cfg.rms_eps,
            &mut ws.xn[t * d..(t + 1) * d],
        );
    }
    // Every token's K and V go into the cache, including rows that need no output.
    matmul(
        &layer.wk.view(gguf),
        &ws.xn[..n * d],
        n,
        &mut ws.k[..n * kvd],
        &mut ws.matmul,
        step.pool,
    );
    matmul(
        &layer.wv.view(gguf),
        &ws.xn[..n * d],
        n,
        &mut ws.v[..n * kvd],
        &mut ws.matmul,
        step.pool,
    );
    for t in 0..n {
        let k_row = &mut ws.k[t * kvd..(t + 1) * kvd];
        rope(
            k_row,
            cfg.num_kv_heads,
            hd,
            positions[t],
            cfg.rope_freq_base,
            RopeMode::Norm,
        );
        let slot = step.inputs.slot_mapping[t] as usize;
        write_kv(
            &step.layout,
            &mut kv.k,
            &mut kv.v,
            slot,
            k_row,
            &ws.v[t * kvd..(t + 1) * kvd],
        );
    }

    let outputs_only = last && step.plan.logit_rows.len() < n;
    let m = if outputs_only {
        for (j, &t) in step.plan.logit_rows.iter().enumerate() {
            ws.xn.copy_within(t * d..(t + 1) * d, j * d);
            ws.x.copy_within(t * d..(t + 1) * d, j * d);
        }
        step.plan.logit_rows.len()
    } else {
        n
    };
    matmul(
        &layer.wq.view(gguf),
        &ws.xn[..m * d],
        m,
        &mut ws.q[..m * d],
        &mut ws.matmul,
        step.pool,
    );
    for j in 0..m {
        let pos = positions[step.query_token(j, outputs_only)];
        rope(
            &mut ws.q[j * d..(j + 1) * d],
            cfg.num_heads,
            hd,
            pos,
            cfg.rope_freq_base,
            RopeMode::Norm,
        );
    }
    attend(
        step,
        kv,
        &ws.q[..m * d],
        &mut ws.att[..m * d],
        &mut ws.attn_scratch,
        outputs_only,
    );
    matmul(
        &layer.wo.view(gguf),
        &ws.att[..m * d],
        m,
        &mut ws.proj[..m * d],
        &mut ws.matmul,
        step.pool,
    );
    add_in_place(&mut ws.x[..m * d], &ws.proj[..m * d]);
    m
}

/// Attention of every query row, split into contiguous runs of rows over the pool (one scratch
/// buffer per run). Each token sees positions `0..=pos` of its own sequence.
fn attend(
    step: &Step,
    kv: &LayerKv,
    q: &[f32],
    att: &mut [f32],
    scratch: &mut [AttentionScratch],
    outputs_only: bool,
) {
    let cfg = &step.model.config;
    let d = cfg.hidden_size;
    let m = q.len() / d.max(1);
    if m == 0 {
        return;
    }
    let runs = scratch.len().clamp(1, m);
    let rows_per_run = m.div_ceil(runs);
    let scale = 1.0f32 / (cfg.head_dim as f32).sqrt();
    att.par_chunks_mut(rows_per_run * d)
        .zip(scratch.par_iter_mut())
        .enumerate()
        .for_each(|(run, (out_rows, scratch))| {
            for (i, out) in out_rows.chunks_exact_mut(d).enumerate() {
                let row = run * rows_per_run + i;
                let t = step.query_token(row, outputs_only);
                let seq = &step.inputs.seqs[step.plan.token_seq[t]];
                // A sequence's own step size picks the summation order llama.cpp would use when
                // running it alone, so its result does not depend on what it is batched with.
                let order = ReductionOrder::for_step(seq.num_tokens);
                let context = step.inputs.positions[t] as usize + 1;
                paged_attention(
                    &step.layout,
                    &q[row * d..(row + 1) * d],
                    cfg.num_heads,
                    &kv.k,
                    &kv.v,
                    &seq.block_table,
                    context,
                    scale,
                    order,
                    out,
                    scratch,
                );
            }
        });
}

/// Pre-norm SwiGLU feed-forward with residual, over the first `m` rows.
fn ffn_block(step: &Step, layer: &LayerMats, ws: &mut Workspace, m: usize) {
    let cfg = &step.model.config;
    let gguf = &*step.model.gguf;
    let (d, ff) = (cfg.hidden_size, cfg.ffn_size);
    for j in 0..m {
        rms_norm(
            &ws.x[j * d..(j + 1) * d],
            &layer.ffn_norm,
            cfg.rms_eps,
            &mut ws.xn[j * d..(j + 1) * d],
        );
    }
    matmul(
        &layer.gate.view(gguf),
        &ws.xn[..m * d],
        m,
        &mut ws.gate[..m * ff],
        &mut ws.matmul,
        step.pool,
    );
    matmul(
        &layer.up.view(gguf),
        &ws.xn[..m * d],
        m,
        &mut ws.up[..m * ff],
        &mut ws.matmul,
        step.pool,
    );
    for j in 0..m {
        let r = j * ff..(j + 1) * ff;
        swiglu(&ws.gate[r.clone()], &ws.up[r.clone()], &mut ws.act[r]);
    }
    matmul(
        &layer.down.view(gguf),
        &ws.act[..m * ff],
        m,
        &mut ws.proj[..m * d],
        &mut ws.matmul,
        step.pool,
    );
    add_in_place(&mut ws.x[..m * d], &ws.proj[..m * d]);
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

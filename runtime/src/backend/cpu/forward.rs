//! One llama forward pass over a whole scheduler step: every token of every sequence goes
//! through each weight matrix in a single matmul (so a batched decode reads the weights once),
//! while RoPE, the KV write and attention are per token, reading each sequence's own blocks.
//!
//! The order of operations and roundings is llama.cpp's `llm_build_llama` (see DESIGN.md,
//! Seam 1). Where ggml's rounding depends on how many tokens a product holds (attention's
//! [`ReductionOrder`], K-quant matmuls' [`KQuantOrder`]), each token gets the order of
//! llama.cpp's plain run (its prompt as one batch, then one token per step), whatever step it
//! is computed in. Like llama.cpp, the last layer only computes queries, attention and the FFN for the
//! rows that need logits; the other rows only contribute their K and V.

use kvgate_kernels::attention::{AttentionRow, paged_attention_batch};
use kvgate_kernels::quant::dequantize_row;
use kvgate_kernels::{
    KQuantOrder, KvLayout, ReductionOrder, matmul, matmul_fused_ordered, matmul_ordered, rms_norm,
    rope_with_freq_factors, swiglu, write_kv,
};

use super::kv_cache::LayerKv;
use super::weights::{CpuModel, LayerMats};
use super::workspace::Workspace;
use crate::backend::step_plan::StepPlan;
use crate::backend::{BackendError, BatchInputs};

/// Everything a layer reads that stays fixed for the step.
pub struct Step<'a> {
    pub model: &'a CpuModel,
    pub inputs: &'a BatchInputs,
    pub plan: &'a StepPlan,
    pub layout: KvLayout,
    pub pool: &'a rayon::ThreadPool,
}

/// What attention needs per query row: the row's sequence (block table, visible positions)
/// and the summation order to use.
pub struct QueryRows<'a> {
    /// Token index (into the step) of each query row.
    tokens: Vec<usize>,
    rows: Vec<AttentionRow<'a>>,
    orders: Vec<ReductionOrder>,
    /// Each row's K-quant matmul order (see [`KQuantOrder::for_token`]).
    kq_orders: Vec<KQuantOrder>,
}

impl<'a> QueryRows<'a> {
    /// Query rows for `tokens` of the step.
    fn new(inputs: &'a BatchInputs, plan: &StepPlan, tokens: impl Iterator<Item = usize>) -> Self {
        let mut q = QueryRows {
            tokens: Vec::new(),
            rows: Vec::new(),
            orders: Vec::new(),
            kq_orders: Vec::new(),
        };
        for t in tokens {
            let seq = &inputs.seqs[plan.token_seq[t]];
            q.tokens.push(t);
            q.rows.push(AttentionRow {
                block_table: &seq.block_table,
                context_len: inputs.positions[t] as usize + 1,
            });
            // Chosen by what the token is (prompt or generated), never by how the step was cut,
            // so the same token gets the same numbers in every computation of it.
            q.orders.push(ReductionOrder::for_token(
                inputs.positions[t] as usize,
                seq.prompt_len,
            ));
            q.kq_orders.push(KQuantOrder::for_token(
                inputs.positions[t] as usize,
                seq.prompt_len,
            ));
        }
        q
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

    let every_token = QueryRows::new(step.inputs, step.plan, 0..n);
    let logit_tokens = QueryRows::new(step.inputs, step.plan, step.plan.logit_rows.iter().copied());
    let last = model.layers.len().saturating_sub(1);
    let mut rows = n;
    for (l, (layer, layer_kv)) in model.layers.iter().zip(kv.iter_mut()).enumerate() {
        // Like llama.cpp, the last layer carries on only with the rows that need logits; the
        // other rows only had to leave their K and V in the cache.
        let queries = if l == last && logit_tokens.tokens.len() < n {
            &logit_tokens
        } else {
            &every_token
        };
        rows = attention_block(step, layer, layer_kv, ws, &every_token, queries);
        // In llama.cpp's plain run the last layer's feed-forward sees only the one row that
        // needs logits, so it never takes the tiled K-quant order there.
        let ffn_orders: &[KQuantOrder] = if l == last { &[] } else { &queries.kq_orders };
        ffn_block(step, layer, ws, rows, ffn_orders);
    }

    for j in 0..rows {
        let r = j * d..(j + 1) * d;
        rms_norm(
            &ws.x[r.clone()],
            &model.output_norm,
            cfg.rms_eps,
            &mut ws.xn[r],
        );
    }
    // Every element is overwritten by the matmul; resizing (not clearing) skips re-zeroing
    // the part of the buffer the previous step already sized.
    logits.resize(rows * cfg.vocab_size, 0.0);
    let head = model.output.view(&model.gguf);
    matmul(
        &head,
        &ws.xn[..rows * d],
        rows,
        logits,
        &mut ws.matmul,
        step.pool,
    );
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

/// Pre-norm attention with residual: K and V of every token into the cache, then queries,
/// attention and the output projection for `queries` (compacted to the first rows when they
/// are not all tokens). Returns the number of rows that continue.
fn attention_block(
    step: &Step,
    layer: &LayerMats,
    kv: &mut LayerKv,
    ws: &mut Workspace,
    all: &QueryRows,
    queries: &QueryRows,
) -> usize {
    let cfg = &step.model.config;
    let gguf = &*step.model.gguf;
    let pool = step.pool;
    let (d, kvd, hd) = (cfg.hidden_size, cfg.kv_dim(), cfg.head_dim);
    let n = step.inputs.token_ids.len();
    let positions = &step.inputs.positions;

    for t in 0..n {
        let r = t * d..(t + 1) * d;
        rms_norm(
            &ws.x[r.clone()],
            &layer.attn_norm,
            cfg.rms_eps,
            &mut ws.xn[r],
        );
    }
    let (wq, wk, wv) = (
        layer.wq.view(gguf),
        layer.wk.view(gguf),
        layer.wv.view(gguf),
    );
    let m = queries.tokens.len();
    let xn = &ws.xn[..n * d];
    let (k, v) = (&mut ws.k[..n * kvd], &mut ws.v[..n * kvd]);
    let every = &all.kq_orders;
    if m == n {
        // Every token continues: Q, K and V in one pass over the activations.
        let q = &mut ws.q[..n * d];
        let parts = [(&wq, q), (&wk, k), (&wv, v)];
        matmul_fused_ordered(parts, xn, n, every, &mut ws.matmul, pool);
        add_bias(&mut ws.q[..n * d], layer.bq.as_deref());
    } else {
        matmul_fused_ordered([(&wk, k), (&wv, v)], xn, n, every, &mut ws.matmul, pool);
    }
    // llama.cpp adds the biases to the projections (ggml_add) before RoPE.
    add_bias(&mut ws.k[..n * kvd], layer.bk.as_deref());
    add_bias(&mut ws.v[..n * kvd], layer.bv.as_deref());
    let freq_factors = step.model.rope_freqs.as_deref();
    let rows = ws.k[..n * kvd]
        .chunks_exact_mut(kvd)
        .zip(ws.v.chunks_exact(kvd));
    for ((k_row, v_row), (&pos, &slot)) in rows.zip(positions.iter().zip(&step.inputs.slot_mapping))
    {
        rope_with_freq_factors(
            k_row,
            cfg.num_kv_heads,
            hd,
            pos,
            cfg.rope_freq_base,
            cfg.rope_mode,
            freq_factors,
        );
        write_kv(
            &step.layout,
            &mut kv.k,
            &mut kv.v,
            slot as usize,
            k_row,
            v_row,
        );
    }

    if m < n {
        // Rows only move towards the front (query tokens are ascending), so in place is safe.
        for (j, &t) in queries.tokens.iter().enumerate() {
            ws.xn.copy_within(t * d..(t + 1) * d, j * d);
            ws.x.copy_within(t * d..(t + 1) * d, j * d);
        }
        matmul_ordered(
            &wq,
            &ws.xn[..m * d],
            m,
            &queries.kq_orders,
            &mut ws.q[..m * d],
            &mut ws.matmul,
            pool,
        );
        add_bias(&mut ws.q[..m * d], layer.bq.as_deref());
    }
    for (j, &t) in queries.tokens.iter().enumerate() {
        let q_row = &mut ws.q[j * d..(j + 1) * d];
        rope_with_freq_factors(
            q_row,
            cfg.num_heads,
            hd,
            positions[t],
            cfg.rope_freq_base,
            cfg.rope_mode,
            freq_factors,
        );
    }
    attend(step, kv, &ws.q[..m * d], &mut ws.att[..m * d], queries);
    matmul_ordered(
        &layer.wo.view(gguf),
        &ws.att[..m * d],
        m,
        &queries.kq_orders,
        &mut ws.proj[..m * d],
        &mut ws.matmul,
        pool,
    );
    add_in_place(&mut ws.x[..m * d], &ws.proj[..m * d]);
    m
}

/// Attention of every query row over its own sequence's blocks, spread over the pool by
/// (row, KV head); one kernel call per run of rows sharing a summation order.
fn attend(step: &Step, kv: &LayerKv, q: &[f32], att: &mut [f32], queries: &QueryRows) {
    let cfg = &step.model.config;
    let d = cfg.hidden_size;
    let m = queries.tokens.len();
    let scale = 1.0f32 / (cfg.head_dim as f32).sqrt();
    let mut start = 0;
    while start < m {
        let order = queries.orders[start];
        let end = (start..m)
            .find(|&j| queries.orders[j] != order)
            .unwrap_or(m);
        paged_attention_batch(
            &step.layout,
            &q[start * d..end * d],
            &queries.rows[start..end],
            cfg.num_heads,
            &kv.k,
            &kv.v,
            scale,
            order,
            &mut att[start * d..end * d],
            step.pool,
        );
        start = end;
    }
}

/// Pre-norm SwiGLU feed-forward with residual, over the first `m` rows.
fn ffn_block(step: &Step, layer: &LayerMats, ws: &mut Workspace, m: usize, orders: &[KQuantOrder]) {
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
    let (gate, up) = (layer.gate.view(gguf), layer.up.view(gguf));
    matmul_fused_ordered(
        [(&gate, &mut ws.gate[..m * ff]), (&up, &mut ws.up[..m * ff])],
        &ws.xn[..m * d],
        m,
        orders,
        &mut ws.matmul,
        step.pool,
    );
    for j in 0..m {
        let r = j * ff..(j + 1) * ff;
        swiglu(&ws.gate[r.clone()], &ws.up[r.clone()], &mut ws.act[r]);
    }
    matmul_ordered(
        &layer.down.view(gguf),
        &ws.act[..m * ff],
        m,
        orders,
        &mut ws.proj[..m * d],
        &mut ws.matmul,
        step.pool,
    );
    add_in_place(&mut ws.x[..m * d], &ws.proj[..m * d]);
}

/// Adds `bias` (one row's width) to every row of `x`; nothing when the model has none.
fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            add_in_place(row, b);
        }
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

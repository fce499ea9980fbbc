//! The launch sequence of one forward step — the only place it is written. Generic over
//! [`DeviceOps`], so the same code drives a GPU and, in CI, the CUDA emulator.
//!
//! Per step: one copy of the integer inputs in, then per layer RMSNorm → Q/K/V matvecs →
//! RoPE → K/V written through the slot mapping → paged attention (row or tiled kernel, see
//! [`attention_kernel`]; + the reduce pass for rows longer than one partition) → output
//! projection + residual → RMSNorm → gate/up → SwiGLU → down + residual; then the rows that
//! need logits are gathered, normalised and multiplied by the output head, and one copy brings
//! the logits back. Numerics follow the CPU backend (activations quantized to Q8_1 per matmul,
//! f16 K/V, f32 softmax), see DESIGN.md.
//!
//! Unlike the CPU path, the last layer runs for every row, not only the logit rows: each row's
//! result is the same either way, and one code path is simpler to check.

use kvgate_kernels::cuda::device::{DevBuf, DeviceOps, KernelArg, LaunchDims};
use kvgate_kernels::cuda::{
    ATTN_THREADS, MV_MAX_BATCH, MV_ROWS_PER_BLOCK, MV_THREADS, NORM_THREADS, attention_partitions,
    attention_smem_bytes, attention_tile_rows, attention_tiled_smem_bytes, ggml_type_id,
    matvec_kernel, tiled_matmul,
};

use super::weights::{DeviceMat, DeviceModel};
use super::workspace::{DeviceWorkspace, Q8_1_BYTES};
use super::{LayerKv, device_error};
use crate::backend::step_plan::StepPlan;
use crate::backend::{BackendError, BatchInputs};

/// Threads of the row kernels with no fixed block size (embedding, RoPE, KV write, reduce).
const ROW_THREADS: u32 = 128;
/// Threads and most blocks of the grid-stride element-wise kernels.
const ELEMENTWISE_THREADS: u32 = 256;
const ELEMENTWISE_MAX_BLOCKS: usize = 4096;
const F32: usize = 4;

/// Steps of more rows than this multiply weights with the tiled kernels (`mmq_*` for quantized
/// weights, `mm_f16` for F16; one launch, each weight element read once per 32 rows) instead
/// of the matvec kernels in chunks of `MV_MAX_BATCH` rows (every weight matrix read once per 8
/// rows). Both give the same bits for every output (kernels/cuda/mmq.cu), so this choice never
/// changes results, only speed. NOT MEASURED on a device yet: 16 is a guess (a tiled launch
/// at 9..16 rows leaves half of its 32-row activation tile idle); `scripts/gpu-check.sh`
/// prints tiled vs chunked matvec times at 8..512 rows on Llama-2-13B-shaped matrices
/// (`GPU-CHECK mmq_…`), from which the next GPU session should set the crossover.
pub const MMQ_MIN_EXCLUSIVE_BATCH: usize = 16;

use KernelArg::{F32 as Float, I32 as Int, I64 as Long};

/// Where each section of the step inputs sits in `ws.inputs` (i32 offsets), sized as in
/// [`super::workspace::WorkspaceShape::input_words`].
struct InputLayout {
    ids: usize,
    positions: usize,
    slots: usize,
    row_seq: usize,
    row_ctx: usize,
    /// The tiled attention kernel's tiles: (first row, rows) pairs, at most one per row.
    tiles: usize,
    logit_rows: usize,
    tables: usize,
}

impl InputLayout {
    fn new(max_tokens: usize, max_seqs: usize) -> InputLayout {
        let t = max_tokens;
        InputLayout {
            ids: 0,
            positions: t,
            slots: 2 * t,
            row_seq: 3 * t,
            row_ctx: 4 * t,
            tiles: 5 * t,
            logit_rows: 7 * t,
            tables: 7 * t + max_seqs,
        }
    }
}

/// What [`upload_inputs`] derived from the step for the attention launches.
struct AttentionGeometry {
    /// Longest block table.
    max_blocks: usize,
    /// Longest row context.
    max_ctx: usize,
    /// Tiles in the uploaded tile table.
    tiles: usize,
    /// Whether some tile has more than one row (the step has a prefill chunk).
    multi_row_tiles: bool,
}

/// The attention kernel of a step with heads of `head_dim`, `tiled` when the step has a
/// prefill chunk.
///
/// Steps with a prefill chunk (a tile of more than one row) run `paged_attention_tiled_dD`
/// over the step's tiles: each prefill chunk is cut into tiles of up to
/// [`attention_tile_rows`] consecutive rows, each decode row is a tile of its own, so one
/// launch covers every row and each K/V token row is read once per tile instead of once per
/// row. Decode-only steps keep `paged_attention_dD` (one block per row; it needs less shared
/// memory than a tiled block sized for a whole tile). The tiled kernel produces the row
/// kernel's bits for every row (kernels/cuda/attention.cu; the emulator tests compare them),
/// so which kernel a step gets, and how its rows are tiled, never changes a result: a
/// sequence's logits do not depend on what else is in the step.
fn attention_kernel(head_dim: usize, tiled: bool) -> Result<&'static str, BackendError> {
    Ok(match (head_dim, tiled) {
        (32, false) => "paged_attention_d32",
        (64, false) => "paged_attention_d64",
        (128, false) => "paged_attention_d128",
        (32, true) => "paged_attention_tiled_d32",
        (64, true) => "paged_attention_tiled_d64",
        (128, true) => "paged_attention_tiled_d128",
        (other, _) => {
            return Err(BackendError::Other(format!(
                "no attention kernel for head_dim {other}"
            )));
        }
    })
}

/// The launches of one step over `dev`.
struct Launcher<'a, D> {
    dev: &'a mut D,
    ws: &'a DeviceWorkspace,
}

fn int(v: usize) -> KernelArg {
    // Every count passed as i32 is bounded by the workspace shape or the model geometry,
    // both checked to fit at start-up.
    Int(i32::try_from(v).unwrap_or(i32::MAX))
}

impl<D: DeviceOps> Launcher<'_, D> {
    fn launch(
        &mut self,
        name: &str,
        dims: LaunchDims,
        args: &[KernelArg],
    ) -> Result<(), BackendError> {
        self.dev.launch(name, dims, args).map_err(device_error)
    }

    fn input(&self, word: usize) -> KernelArg {
        self.ws.inputs.at(word * 4)
    }

    fn rms_norm(
        &mut self,
        out: DevBuf,
        x: DevBuf,
        w: DevBuf,
        rows: usize,
        n: usize,
        eps: f32,
    ) -> Result<(), BackendError> {
        self.launch(
            "rms_norm",
            LaunchDims::linear(rows, NORM_THREADS),
            &[out.arg(), x.arg(), w.arg(), int(n), Float(eps)],
        )
    }

    fn elementwise(
        &mut self,
        name: &str,
        n: usize,
        args: &[KernelArg],
    ) -> Result<(), BackendError> {
        let blocks = n
            .div_ceil(ELEMENTWISE_THREADS as usize)
            .clamp(1, ELEMENTWISE_MAX_BLOCKS);
        let mut all = args.to_vec();
        all.push(Long(n as i64));
        self.launch(name, LaunchDims::linear(blocks, ELEMENTWISE_THREADS), &all)
    }

    /// `out[m][w.rows] = x[m][w.cols] · wᵀ` for each `(w, out)`, reading `x` once: quantized
    /// weights (32-element blocks and K-quants alike) take `x` as Q8_1 blocks (quantized here
    /// once for all of them), F16 weights the f32 rows. In steps of more than
    /// [`MMQ_MIN_EXCLUSIVE_BATCH`] rows every weight matrix goes through one tiled launch
    /// (`mmq_*` for quantized weights, `mm_f16` for F16: [`tiled_matmul`]); otherwise the
    /// matvec kernels take at most `MV_MAX_BATCH` rows, so larger steps run in chunks of that
    /// many rows. A row's result never depends on which rows share its step: each output is
    /// computed alone in both kernels, and the tiled kernels' bits are the matvec kernels'.
    /// Each output is a buffer and the byte offset its rows start at.
    fn project(
        &mut self,
        x: DevBuf,
        m: usize,
        outputs: &[(&DeviceMat, (DevBuf, usize))],
    ) -> Result<(), BackendError> {
        let cols = outputs[0].0.cols;
        if outputs.iter().any(|(w, _)| w.is_quantized()) {
            let blocks = m * cols / 32;
            self.launch(
                "quantize_q8_1",
                LaunchDims::linear(blocks.div_ceil(4), 128),
                &[self.ws.xq.arg(), x.arg(), Long(blocks as i64)],
            )?;
        }
        for &(w, (out, out_offset)) in outputs {
            let tiled = tiled_matmul(w.ty, w.rows, m).filter(|_| m > MMQ_MIN_EXCLUSIVE_BATCH);
            if let Some((name, dims)) = tiled {
                let x_arg = if w.is_quantized() {
                    self.ws.xq.arg()
                } else {
                    x.arg()
                };
                let args = [
                    out.at(out_offset),
                    w.buf.arg(),
                    x_arg,
                    int(w.rows),
                    int(cols),
                    int(m),
                ];
                self.launch(name, dims, &args)?;
                continue;
            }
            let dims = LaunchDims::linear(w.rows.div_ceil(MV_ROWS_PER_BLOCK), MV_THREADS);
            for start in (0..m).step_by(MV_MAX_BATCH) {
                let batch = MV_MAX_BATCH.min(m - start);
                let out_at = out.at(out_offset + start * w.rows * F32);
                let name = matvec_kernel(w.ty).ok_or_else(|| {
                    BackendError::Other(format!("no CUDA matvec for {:?} weights", w.ty))
                })?;
                let x_at = if w.is_quantized() {
                    self.ws.xq.at(start * cols / 32 * Q8_1_BYTES)
                } else {
                    x.at(start * cols * F32)
                };
                self.launch(
                    name,
                    dims,
                    &[
                        out_at,
                        w.buf.arg(),
                        x_at,
                        int(w.rows),
                        int(cols),
                        int(batch),
                    ],
                )?;
            }
        }
        Ok(())
    }
}

/// Packs the step's integer inputs into `ws.staging` at the [`InputLayout`] offsets and copies
/// them to the device in one transfer. The tile table cuts each sequence's rows (consecutive
/// positions, checked by the step plan) into tiles of at most `tile_rows` rows.
fn upload_inputs<D: DeviceOps>(
    dev: &mut D,
    ws: &DeviceWorkspace,
    staging: &mut Vec<u8>,
    inputs: &BatchInputs,
    plan: &StepPlan,
    layout: &InputLayout,
    tile_rows: usize,
) -> Result<AttentionGeometry, BackendError> {
    let n = inputs.token_ids.len();
    let shape = ws.shape;
    if inputs.seqs.len() > shape.max_seqs {
        return Err(BackendError::InvalidInputs(format!(
            "{} sequences in one step exceed the backend's max_num_seqs {}",
            inputs.seqs.len(),
            shape.max_seqs
        )));
    }
    let max_blocks = inputs
        .seqs
        .iter()
        .map(|s| s.context_len.div_ceil(kvgate_kernels::cuda::KV_BLOCK))
        .max()
        .unwrap_or(0)
        .max(1);
    if max_blocks > shape.max_blocks_per_seq {
        return Err(BackendError::InvalidInputs(format!(
            "a context of {max_blocks} blocks exceeds the model's context length ({} blocks)",
            shape.max_blocks_per_seq
        )));
    }
    let words = layout.tables + inputs.seqs.len() * max_blocks;
    let mut values = vec![0i32; words];
    let mut put = |at: usize, v: usize| values[at] = v as i32;
    for t in 0..n {
        put(layout.ids + t, inputs.token_ids[t] as usize);
        put(layout.positions + t, inputs.positions[t] as usize);
        put(layout.slots + t, inputs.slot_mapping[t] as usize);
        put(layout.row_seq + t, plan.token_seq[t]);
        put(layout.row_ctx + t, inputs.positions[t] as usize + 1);
    }
    let mut tiles = 0;
    let mut multi_row_tiles = false;
    for seq in &inputs.seqs {
        let end = seq.token_start + seq.num_tokens;
        for first in (seq.token_start..end).step_by(tile_rows) {
            let rows = tile_rows.min(end - first);
            put(layout.tiles + 2 * tiles, first);
            put(layout.tiles + 2 * tiles + 1, rows);
            tiles += 1;
            multi_row_tiles |= rows > 1;
        }
    }
    for (j, &row) in plan.logit_rows.iter().enumerate() {
        put(layout.logit_rows + j, row);
    }
    for (s, seq) in inputs.seqs.iter().enumerate() {
        let needed = seq.context_len.div_ceil(kvgate_kernels::cuda::KV_BLOCK);
        for (b, &block) in seq.block_table[..needed].iter().enumerate() {
            put(layout.tables + s * max_blocks + b, block as usize);
        }
    }
    staging.clear();
    staging.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    dev.upload(ws.inputs, 0, staging).map_err(device_error)?;
    let max_ctx = inputs
        .positions
        .iter()
        .map(|&p| p as usize + 1)
        .max()
        .unwrap_or(1);
    Ok(AttentionGeometry {
        max_blocks,
        max_ctx,
        tiles,
        multi_row_tiles,
    })
}

/// A step's inputs and what validating them derived.
pub struct StepInputs<'a> {
    pub inputs: &'a BatchInputs,
    pub plan: &'a StepPlan,
}

/// Runs the step (validated by `plan`); writes `plan.logit_rows.len() × vocab` logits.
pub fn run<D: DeviceOps>(
    dev: &mut D,
    model: &DeviceModel,
    kv: &[LayerKv],
    ws: &DeviceWorkspace,
    step: StepInputs,
    staging: &mut Vec<u8>,
    logits: &mut Vec<f32>,
) -> Result<(), BackendError> {
    let StepInputs { inputs, plan } = step;
    let cfg = &model.config;
    let (d, ff, hd) = (cfg.hidden_size, cfg.ffn_size, cfg.head_dim);
    let (heads, kv_heads) = (cfg.num_heads, cfg.num_kv_heads);
    let group = heads / kv_heads;
    let n = inputs.token_ids.len();
    let layout = InputLayout::new(ws.shape.max_tokens, ws.shape.max_seqs);
    let geometry = upload_inputs(
        dev,
        ws,
        staging,
        inputs,
        plan,
        &layout,
        attention_tile_rows(group),
    )?;
    let parts = attention_partitions(geometry.max_ctx);
    let scale = 1.0f32 / (hd as f32).sqrt();
    let tiled = geometry.multi_row_tiles;
    let attention = attention_kernel(hd, tiled)?;
    // The row kernel's grid has a block per row, the tiled kernel's one per tile, which reads
    // its rows from the tile table (an extra parameter after row_ctx).
    let (attention_blocks, attention_smem) = if tiled {
        (geometry.tiles, attention_tiled_smem_bytes(hd))
    } else {
        (n, attention_smem_bytes(group, hd))
    };
    let attention_dims = LaunchDims::new(
        [
            kv_heads as u32,
            u32::try_from(attention_blocks).unwrap_or(u32::MAX),
            parts as u32,
        ],
        ATTN_THREADS,
        attention_smem,
    );
    let embd_ty = ggml_type_id(model.embd.ty).ok_or_else(|| {
        BackendError::Other(format!("no embedding kernel for {:?}", model.embd.ty))
    })?;

    let mut l = Launcher { dev, ws };
    l.launch(
        "embed_rows",
        LaunchDims::linear(n, ROW_THREADS),
        &[
            ws.x.arg(),
            model.embd.buf.arg(),
            l.input(layout.ids),
            Int(embd_ty),
            int(d),
            Long(model.embd.row_bytes() as i64),
        ],
    )?;
    let rows = LaunchDims::linear(n, ROW_THREADS);
    for (layer, cache) in model.layers.iter().zip(kv) {
        // Attention block.
        l.rms_norm(ws.xn, ws.x, layer.attn_norm, n, d, cfg.rms_eps)?;
        l.project(
            ws.xn,
            n,
            &[
                (&layer.wq, (ws.q, 0)),
                (&layer.wk, (ws.k, 0)),
                (&layer.wv, (ws.v, 0)),
            ],
        )?;
        for (buf, nh) in [(ws.q, heads), (ws.k, kv_heads)] {
            l.launch(
                "rope_norm",
                rows,
                &[
                    buf.arg(),
                    l.input(layout.positions),
                    int(nh),
                    int(hd),
                    int(hd),
                    Float(cfg.rope_freq_base),
                ],
            )?;
        }
        l.launch(
            "write_kv",
            rows,
            &[
                cache.k.arg(),
                cache.v.arg(),
                ws.k.arg(),
                ws.v.arg(),
                l.input(layout.slots),
                int(kv_heads),
                int(hd),
            ],
        )?;
        let mut args = vec![
            ws.att.arg(),
            ws.part_out.arg(),
            ws.part_stats.arg(),
            ws.q.arg(),
            cache.k.arg(),
            cache.v.arg(),
            l.input(layout.tables),
            l.input(layout.row_seq),
            l.input(layout.row_ctx),
        ];
        if tiled {
            args.push(l.input(layout.tiles));
        }
        args.extend([
            int(geometry.max_blocks),
            int(kv_heads),
            int(group),
            int(parts),
            Float(scale),
        ]);
        l.launch(attention, attention_dims, &args)?;
        if parts > 1 {
            l.launch(
                "attention_reduce",
                LaunchDims::new([heads as u32, n as u32, 1], 64, 0),
                &[
                    ws.att.arg(),
                    ws.part_out.arg(),
                    ws.part_stats.arg(),
                    l.input(layout.row_ctx),
                    int(heads),
                    int(hd),
                    int(parts),
                ],
            )?;
        }
        l.project(ws.att, n, &[(&layer.wo, (ws.proj, 0))])?;
        l.elementwise("add_inplace", n * d, &[ws.x.arg(), ws.proj.arg()])?;

        // Feed-forward block.
        l.rms_norm(ws.xn, ws.x, layer.ffn_norm, n, d, cfg.rms_eps)?;
        l.project(
            ws.xn,
            n,
            &[(&layer.gate, (ws.gate, 0)), (&layer.up, (ws.up, 0))],
        )?;
        l.elementwise(
            "swiglu",
            n * ff,
            &[ws.act.arg(), ws.gate.arg(), ws.up.arg()],
        )?;
        l.project(ws.act, n, &[(&layer.down, (ws.proj, 0))])?;
        l.elementwise("add_inplace", n * d, &[ws.x.arg(), ws.proj.arg()])?;
    }

    // Output head over the rows that need logits: gathered from the residual stream (an f32
    // "embedding lookup" of x by row index), normalised, projected.
    let s = plan.logit_rows.len();
    logits.clear();
    if s == 0 {
        return Ok(());
    }
    l.launch(
        "embed_rows",
        LaunchDims::linear(s, ROW_THREADS),
        &[
            ws.head.arg(),
            ws.x.arg(),
            l.input(layout.logit_rows),
            Int(0), // GGML_F32: the rows of x are plain f32
            int(d),
            Long((d * F32) as i64),
        ],
    )?;
    l.rms_norm(ws.xn, ws.head, model.output_norm, s, d, cfg.rms_eps)?;
    // The logits follow the gathered rows in `head`.
    let logits_at = ws.shape.max_seqs * d * F32;
    l.project(ws.xn, s, &[(&model.output, (ws.head, logits_at))])?;
    staging.clear();
    staging.resize(s * cfg.vocab_size * F32, 0);
    l.dev
        .download(ws.head, logits_at, staging)
        .map_err(device_error)?;
    logits.extend(
        staging
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    );
    Ok(())
}

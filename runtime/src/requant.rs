//! `kvgate quantize IN OUT --type q4_k_m`: llama.cpp's `llama-quantize --allow-requantize`
//! reproduced byte for byte for llama-family files.
//!
//! Why: the parity test for K-quant files needs a Q4_K_M file of a real model, and CI cannot
//! build llama.cpp. Publishing such a file is not an option either, so kvgate writes the same
//! bytes llama.cpp's quantizer writes from the same input: the same tensor types (its
//! `llama_tensor_get_type` rules for Q4_K_M, including the fallbacks for rows that are not a
//! multiple of 256), the same quantized values (ports of ggml's `quantize_row_*_ref`, which is
//! what `ggml_quantize_chunk` runs without an importance matrix), and the same GGUF layout (the
//! input's metadata in order, `general.quantization_version` and `general.file_type` moved to the
//! end as `gguf_set_val_u32` does, tensors sorted by layer then name, 32-byte alignment).
//!
//! Float evaluation order follows the C source exactly and never fuses a multiply-add: ggml's
//! quantizers live in `libggml-base`, which is compiled for baseline x86-64 (no FMA) even in a
//! `GGML_NATIVE` build, so every product and sum rounds on its own.

use std::fmt;
use std::io::Write;
use std::path::Path;

use half::f16;

use crate::gguf::{GgufFile, MetaValue, alignment_of, decode_value};
use crate::out_file;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
const QK_K: usize = 256;
/// ggml's `GROUP_MAX_EPS`: a sub-block whose largest magnitude is below this quantizes to zero.
const GROUP_MAX_EPS: f32 = 1e-15;
/// `GGML_QNT_VERSION`, written as `general.quantization_version`.
const QNT_VERSION: u32 = 2;
/// `LLAMA_FTYPE_MOSTLY_Q4_K_M`.
const FTYPE_Q4_K_M: u32 = 15;

/// GGML tensor types this module reads or writes (ids as in `ggml.h`).
#[allow(non_camel_case_types)] // ggml's names
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl QType {
    fn from_id(id: u32) -> Option<QType> {
        Some(match id {
            0 => QType::F32,
            1 => QType::F16,
            2 => QType::Q4_0,
            3 => QType::Q4_1,
            6 => QType::Q5_0,
            8 => QType::Q8_0,
            12 => QType::Q4_K,
            13 => QType::Q5_K,
            14 => QType::Q6_K,
            _ => return None,
        })
    }

    fn id(self) -> u32 {
        match self {
            QType::F32 => 0,
            QType::F16 => 1,
            QType::Q4_0 => 2,
            QType::Q4_1 => 3,
            QType::Q5_0 => 6,
            QType::Q8_0 => 8,
            QType::Q4_K => 12,
            QType::Q5_K => 13,
            QType::Q6_K => 14,
        }
    }

    /// (elements per block, bytes per block).
    fn block(self) -> (usize, usize) {
        match self {
            QType::F32 => (1, 4),
            QType::F16 => (1, 2),
            QType::Q4_0 => (32, 18),
            QType::Q4_1 => (32, 20),
            QType::Q5_0 => (32, 22),
            QType::Q8_0 => (32, 34),
            QType::Q4_K => (256, 144),
            QType::Q5_K => (256, 176),
            QType::Q6_K => (256, 210),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QType::F32 => "f32",
            QType::F16 => "f16",
            QType::Q4_0 => "q4_0",
            QType::Q4_1 => "q4_1",
            QType::Q5_0 => "q5_0",
            QType::Q8_0 => "q8_0",
            QType::Q4_K => "q4_K",
            QType::Q5_K => "q5_K",
            QType::Q6_K => "q6_K",
        }
    }

    fn row_bytes(self, n: usize) -> usize {
        let (qk, bytes) = self.block();
        n / qk * bytes
    }
}

impl fmt::Display for QType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The mixes `kvgate quantize` writes.
#[allow(non_camel_case_types)] // llama.cpp's names
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    Q4_K_M,
}

impl std::str::FromStr for QuantMix {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "q4_k_m" => Ok(QuantMix::Q4_K_M),
            _ => Err(format!("unknown quantization type `{s}` (known: q4_k_m)")),
        }
    }
}

/// One tensor of the written file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizedTensor {
    pub name: String,
    pub from: QType,
    pub to: QType,
    /// Byte range of the tensor's data in the written file.
    pub offset: u64,
    pub len: u64,
}

/// What [`quantize_file`] wrote.
#[derive(Clone, Debug)]
pub struct QuantizeReport {
    pub tensors: Vec<QuantizedTensor>,
    pub bytes: u64,
}

/// Reads the GGUF at `input`, writes its Q4_K_M requantization to `output` (through a
/// temporary file, renamed when complete; see [`crate::out_file`]). Errors are one line,
/// naming the file.
pub fn quantize_file(input: &Path, output: &Path, mix: QuantMix) -> Result<QuantizeReport, String> {
    let out_error = |e: std::io::Error| format!("{}: {e}", output.display());
    // Before the work: an output that cannot be replaced is refused in milliseconds.
    out_file::check_output(output).map_err(out_error)?;
    // Opened as the loader opens a model: mapped (not read whole; `/dev/zero` and other files
    // that are not regular are refused) and checked (tensor extents, dimensions, repeated
    // names, alignment) before any byte is requantized. Its errors name the file.
    let gguf = GgufFile::open(input).map_err(|e| e.to_string())?;
    let (bytes, tensors) =
        quantize_bytes(gguf.bytes(), mix).map_err(|e| format!("{}: {e}", input.display()))?;
    out_file::write_via_partial(output, |f| f.write_all(&bytes)).map_err(out_error)?;
    Ok(QuantizeReport {
        tensors,
        bytes: bytes.len() as u64,
    })
}

/// A tensor directory entry of the input.
struct InTensor {
    name: String,
    dims: Vec<u64>,
    ty: QType,
    offset: u64,
}

/// Little-endian reader over the header with error messages carrying the byte offset.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| format!("truncated GGUF header at byte {}", self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self) -> Result<usize, String> {
        let at = self.pos;
        usize::try_from(self.u64()?).map_err(|_| format!("length too large at byte {at}"))
    }
    fn string(&mut self) -> Result<String, String> {
        let at = self.pos;
        let n = self.len()?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("string at byte {at} is not UTF-8"))
    }
    /// Skips one value of GGUF type `ty`.
    fn skip_value(&mut self, ty: u32) -> Result<(), String> {
        let fixed = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => {
                let n = self.len()?;
                self.take(n)?;
                return Ok(());
            }
            9 => {
                let item = self.u32()?;
                let n = self.len()?;
                for _ in 0..n {
                    self.skip_value(item)?;
                }
                return Ok(());
            }
            other => {
                return Err(format!(
                    "unknown GGUF value type {other} at byte {}",
                    self.pos
                ));
            }
        };
        self.take(fixed)?;
        Ok(())
    }
}

fn pad(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_u32_kv(out: &mut Vec<u8>, key: &str, v: u32) {
    put_string(out, key);
    out.extend(4u32.to_le_bytes());
    out.extend(v.to_le_bytes());
}

/// The whole requantization in memory: the output file's bytes and its tensor directory.
pub fn quantize_bytes(
    data: &[u8],
    mix: QuantMix,
) -> Result<(Vec<u8>, Vec<QuantizedTensor>), String> {
    let QuantMix::Q4_K_M = mix;
    let mut c = Cursor { buf: data, pos: 0 };
    if c.take(4)? != GGUF_MAGIC {
        return Err("not a GGUF file (bad magic)".into());
    }
    let version = c.u32()?;
    if version != 3 {
        return Err(format!("GGUF version {version} is not supported (3 is)"));
    }
    let n_tensors = c.len()?;
    let n_kv = c.len()?;
    // Raw key/value records in order, minus the two keys llama.cpp re-appends.
    let mut kv_out = Vec::new();
    let mut kv_count = 0u64;
    let mut alignment = DEFAULT_ALIGNMENT;
    let mut block_count = None;
    for _ in 0..n_kv {
        let start = c.pos;
        let key = c.string()?;
        let ty = c.u32()?;
        let value_at = c.pos;
        c.skip_value(ty)?;
        let value = &data[value_at..c.pos];
        // Read as the loader reads them, in any integer width: reading only UINT32 once
        // shifted every tensor of a file whose alignment was a UINT64.
        if key == "general.alignment" {
            let value = decode_value(ty, value).ok_or("general.alignment cannot be read")?;
            let a = alignment_of(Some(&value))?;
            // At most MAX_ALIGNMENT (1 MiB), so it fits a usize; checked before anything is
            // padded with it.
            alignment = usize::try_from(a).map_err(|_| format!("general.alignment is {a}"))?;
        }
        if key.ends_with(".block_count") {
            block_count = decode_value(ty, value).as_ref().and_then(MetaValue::as_u64);
        }
        if matches!(
            key.as_str(),
            "general.quantization_version"
                | "general.file_type"
                | "split.no"
                | "split.count"
                | "split.tensors.count"
        ) {
            continue;
        }
        kv_out.extend(&data[start..c.pos]);
        kv_count += 1;
    }
    // The count comes from the file: cap the up-front allocation, not the count.
    let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16));
    for _ in 0..n_tensors {
        let name = c.string()?;
        let n_dims = c.u32()?;
        if n_dims == 0 || n_dims > 4 {
            return Err(format!("tensor {name}: {n_dims} dimensions"));
        }
        let dims = (0..n_dims)
            .map(|_| c.u64())
            .collect::<Result<Vec<_>, _>>()?;
        // Rows are counted by dividing by the first dimension.
        if dims.contains(&0) {
            return Err(format!("tensor {name}: a dimension is 0"));
        }
        let ty_id = c.u32()?;
        let ty = QType::from_id(ty_id)
            .ok_or_else(|| format!("tensor {name}: ggml type {ty_id} is not supported"))?;
        let offset = c.u64()?;
        tensors.push(InTensor {
            name,
            dims,
            ty,
            offset,
        });
    }
    let data_start = pad(c.pos, alignment);
    let n_layers = block_count
        .and_then(|n| usize::try_from(n).ok())
        .ok_or("no <arch>.block_count key")?;
    let tied = !tensors.iter().any(|t| t.name == "output.weight");

    // llama.cpp's loader keeps tensors in a map ordered by layer (non-layer tensors first),
    // then by name; the quantizer writes them in that order.
    let layer_of = |name: &str| -> i64 {
        name.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(-1)
    };
    tensors.sort_by(|a, b| {
        (layer_of(&a.name), a.name.as_bytes()).cmp(&(layer_of(&b.name), b.name.as_bytes()))
    });

    // Choose types and lay out the output directory.
    let mut plan = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for t in &tensors {
        let to = target_type(t, n_layers, tied, layer_of(&t.name))?;
        let (qk, _) = t.ty.block();
        let ne0 = t.dims[0] as usize;
        let n = t
            .dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d as usize))
            .filter(|&n| n <= data.len().saturating_mul(8))
            .ok_or_else(|| format!("tensor {}: dimensions {:?} are too large", t.name, t.dims))?;
        if !ne0.is_multiple_of(qk) || !ne0.is_multiple_of(to.block().0) {
            return Err(format!(
                "tensor {}: row of {ne0} does not fit its blocks",
                t.name
            ));
        }
        let len = to.row_bytes(ne0) * (n / ne0);
        plan.push(QuantizedTensor {
            name: t.name.clone(),
            from: t.ty,
            to,
            offset: offset as u64,
            len: len as u64,
        });
        offset += pad(len, alignment);
    }

    let mut out = Vec::with_capacity(data_start + offset);
    out.extend(GGUF_MAGIC);
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kv_count + 2).to_le_bytes());
    out.extend(&kv_out);
    put_u32_kv(&mut out, "general.quantization_version", QNT_VERSION);
    put_u32_kv(&mut out, "general.file_type", FTYPE_Q4_K_M);
    for (t, p) in tensors.iter().zip(&plan) {
        put_string(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(p.to.id().to_le_bytes());
        out.extend(p.offset.to_le_bytes());
    }
    out.resize(pad(out.len(), alignment), 0);
    let out_data_start = out.len();

    let mut row = Vec::new();
    for (t, p) in tensors.iter().zip(plan.iter_mut()) {
        let ne0 = t.dims[0] as usize;
        let n: usize = t.dims.iter().map(|&d| d as usize).product(); // checked above
        let in_len = t.ty.row_bytes(ne0) * (n / ne0);
        let start = usize::try_from(t.offset)
            .ok()
            .and_then(|o| o.checked_add(data_start))
            .filter(|&s| s.checked_add(in_len).is_some_and(|e| e <= data.len()))
            .ok_or_else(|| format!("tensor {}: data lies outside the file", t.name))?;
        let src = &data[start..start + in_len];
        if t.ty == p.to {
            out.extend(src);
        } else {
            row.resize(ne0, 0.0);
            for src_row in src.chunks_exact(t.ty.row_bytes(ne0)) {
                dequantize_row(t.ty, src_row, &mut row);
                quantize_row(p.to, &row, &mut out);
            }
        }
        out.resize(
            out_data_start + pad(out.len() - out_data_start, alignment),
            0,
        );
        p.offset += out_data_start as u64;
    }
    Ok((out, plan))
}

/// llama.cpp's `llama_tensor_get_type` for Q4_K_M on a dense llama-family model, then
/// `tensor_type_fallback` for rows that are not a multiple of 256.
fn target_type(t: &InTensor, n_layers: usize, tied: bool, layer: i64) -> Result<QType, String> {
    let name = t.name.as_str();
    // ggml_n_dims ≥ 2: some dimension past the first is not 1.
    let quantize = t.dims.iter().skip(1).any(|&d| d > 1)
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight");
    if !quantize {
        return Ok(t.ty);
    }
    if name.contains("attn_qkv") || name.contains("_exps") || t.dims.len() > 2 {
        // Fused QKV (Q5_K in Q4_K_M) and mixture-of-experts rules are not ported.
        return Err(format!(
            "tensor {name}: fused or expert tensors are not supported"
        ));
    }
    let ne0 = t.dims[0] as usize;
    let use_more_bits =
        |i: usize, n: usize| i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64) % 3 == 2;
    let layer = usize::try_from(layer).ok();
    let mut ty = QType::Q4_K;
    if name == "output.weight" || (tied && name == "token_embd.weight") {
        // Output head (or the embedding table standing in for it).
        ty = if !ne0.is_multiple_of(QK_K) {
            QType::Q8_0
        } else {
            QType::Q6_K
        };
    } else if name.ends_with("attn_v.weight") {
        if layer.is_some_and(|i| use_more_bits(i, n_layers)) {
            ty = QType::Q6_K;
        } else if n_layers == 80 {
            // llama.cpp's LLM_TYPE_70B: 8 heads share attn_v, so it gets more bits.
            ty = QType::Q5_K;
        }
    } else if name.ends_with("ffn_down.weight") && layer.is_some_and(|i| use_more_bits(i, n_layers))
    {
        ty = QType::Q6_K;
    }
    if !ne0.is_multiple_of(ty.block().0) {
        ty = match ty {
            QType::Q4_K => QType::Q5_0,
            QType::Q6_K => QType::Q8_0,
            // llama.cpp falls back to Q5_1, whose quantizer is not ported.
            other => {
                return Err(format!(
                    "tensor {name}: {other} rows of {ne0} need a fallback kvgate does not write"
                ));
            }
        };
        if !ne0.is_multiple_of(ty.block().0) {
            ty = QType::F16;
        }
    }
    Ok(ty)
}

fn read_f16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// ggml-base's `dequantize_row_*`, unfused (see the module docs).
fn dequantize_row(ty: QType, src: &[u8], out: &mut [f32]) {
    match ty {
        QType::F32 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        QType::F16 => {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        QType::Q4_1 => {
            for (ob, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(20)) {
                let d = read_f16(b, 0);
                let m = read_f16(b, 2);
                for (j, &q) in b[4..].iter().enumerate() {
                    ob[j] = f32::from(q & 0x0F) * d + m;
                    ob[j + 16] = f32::from(q >> 4) * d + m;
                }
            }
        }
        QType::Q4_0 => {
            for (ob, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(18)) {
                let d = read_f16(b, 0);
                for (j, &q) in b[2..].iter().enumerate() {
                    ob[j] = (i32::from(q & 0x0F) - 8) as f32 * d;
                    ob[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
                }
            }
        }
        QType::Q8_0 => {
            for (ob, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(34)) {
                let d = read_f16(b, 0);
                for (o, &q) in ob.iter_mut().zip(&b[2..]) {
                    *o = f32::from(q as i8) * d;
                }
            }
        }
        QType::Q5_0 => {
            for (ob, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(22)) {
                let d = read_f16(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (j, &q) in b[6..].iter().enumerate() {
                    let h0 = ((qh >> j) << 4) & 0x10;
                    let h1 = (qh >> (j + 12)) & 0x10;
                    ob[j] = ((u32::from(q & 0x0F) | h0) as i32 - 16) as f32 * d;
                    ob[j + 16] = ((u32::from(q >> 4) | h1) as i32 - 16) as f32 * d;
                }
            }
        }
        QType::Q4_K | QType::Q5_K | QType::Q6_K => {
            // K-quant dequantization rounds once per value whatever the order (see
            // kvgate_kernels::quant::kquants), so the kernels' version is ggml's.
            let wt = match ty {
                QType::Q4_K => kvgate_kernels::WeightType::Q4_K,
                QType::Q5_K => kvgate_kernels::WeightType::Q5_K,
                _ => kvgate_kernels::WeightType::Q6_K,
            };
            if kvgate_kernels::quant::dequantize_row(wt, src, out).is_err() {
                unreachable!("row sizes are checked by quantize_bytes");
            }
        }
    }
}

fn quantize_row(ty: QType, x: &[f32], out: &mut Vec<u8>) {
    match ty {
        QType::F32 => out.extend(x.iter().flat_map(|v| v.to_le_bytes())),
        QType::F16 => out.extend(x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes())),
        QType::Q5_0 => x.chunks_exact(32).for_each(|b| quantize_block_q5_0(b, out)),
        QType::Q8_0 => x.chunks_exact(32).for_each(|b| quantize_block_q8_0(b, out)),
        QType::Q4_K => x
            .chunks_exact(QK_K)
            .for_each(|b| quantize_block_q4_k(b, out)),
        QType::Q6_K => x
            .chunks_exact(QK_K)
            .for_each(|b| quantize_block_q6_k(b, out)),
        QType::Q4_0 | QType::Q4_1 | QType::Q5_K => {
            unreachable!("Q4_K_M never targets {ty}")
        }
    }
}

/// ggml's `nearest_int`: round half to even through the 1.5·2^23 trick (|x| < 2^22).
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// `quantize_row_q5_0_ref` for one block.
fn quantize_block_q5_0(x: &[f32], out: &mut Vec<u8>) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    // (int8_t)(x0 + 16.5f) truncates toward zero; x0 ≥ −16, so the sum is positive.
    let q = |v: f32| ((v * id + 16.5) as i8 as u8).min(31);
    let mut qh = 0u32;
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let (a, b) = (q(x[j]), q(x[j + 16]));
        qs[j] = (a & 0x0F) | ((b & 0x0F) << 4);
        qh |= u32::from((a & 0x10) >> 4) << j;
        qh |= u32::from((b & 0x10) >> 4) << (j + 16);
    }
    out.extend(qh.to_le_bytes());
    out.extend(qs);
}

/// `quantize_row_q8_0_ref` for one block (`roundf`: half away from zero).
fn quantize_block_q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}

/// ggml's `make_qkx2_quants`: a scale and (negated) minimum for `x` with levels 0..=nmax,
/// searching `nstep + 1` candidate scales around the min-max one for the least weighted error.
#[allow(clippy::too_many_arguments)] // the C signature, kept for line-by-line comparison
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    laux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.iter_mut().for_each(|l| *l = 0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min));
        l_out[i] = l.clamp(0, nmax) as u8;
        let diff = scale * f32::from(l_out[i]) + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(laux[i]) + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `get_scale_min_k4`.
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// `quantize_row_q4_K_ref` for one super-block.
fn quantize_block_q4_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 32];
    let mut weights = [0.0f32; 32];
    let mut mins = [0.0f32; 8];
    let mut scales = [0.0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(
            15,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            &mut laux,
            -1.0,
            0.1,
            20,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 12];
    for j in 0..8 {
        // (uint8_t)nearest_int(..) wraps, then MIN(63, ..).
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let d16 = f16::from_f32(max_scale / 63.0);
    let dmin16 = f16::from_f32(max_min / 63.0);
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &sc);
        let d = d16.to_f32() * f32::from(s);
        if d == 0.0 {
            continue;
        }
        let dm = dmin16.to_f32() * f32::from(m);
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, 15) as u8;
        }
    }
    out.extend(d16.to_le_bytes());
    out.extend(dmin16.to_le_bytes());
    out.extend(sc);
    for j in (0..QK_K).step_by(64) {
        out.extend((0..32).map(|i| l[j + i] | (l[j + i + 32] << 4)));
    }
}

/// ggml's `make_qx_quants` with `rmse_type` 1 and no importance weights: levels −nmax..nmax−1
/// (stored offset by nmax), trying 18 scales around the max-based one.
fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let n = x.len();
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.iter_mut().for_each(|l| *l = 0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let mut iscale = -nmaxf / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = x[i] * x[i];
        let lf = l as f32;
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmaxf + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let lf = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let l = nearest_int(iscale * x[i]);
                l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `quantize_row_q6_K_ref` for one super-block.
fn quantize_block_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ib in 0..16 {
        let s = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = s;
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        out.extend([0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d16 = f16::from_f32(1.0 / iscale);
    let mut sc = [0i8; 16];
    for ib in 0..16 {
        sc[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
    }
    for j in 0..16 {
        let d = d16.to_f32() * f32::from(sc[j]);
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let v = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
            l[16 * j + ii] = (v + 32) as i8;
        }
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for (half, j) in (0..QK_K).step_by(128).enumerate() {
        let (ql, qh) = (&mut ql[64 * half..], &mut qh[32 * half..]);
        for i in 0..32 {
            let q = |k: usize| l[j + i + k] as u8;
            ql[i] = (q(0) & 0xF) | ((q(64) & 0xF) << 4);
            ql[i + 32] = (q(32) & 0xF) | ((q(96) & 0xF) << 4);
            qh[i] = (q(0) >> 4) | ((q(32) >> 4) << 2) | ((q(64) >> 4) << 4) | ((q(96) >> 4) << 6);
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(sc.map(|s| s as u8));
    out.extend(d16.to_le_bytes());
}

#[cfg(test)]
mod tests;

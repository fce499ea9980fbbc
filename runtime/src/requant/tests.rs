use super::*;

#[test]
fn nearest_int_rounds_half_to_even() {
    assert_eq!(nearest_int(0.5), 0);
    assert_eq!(nearest_int(1.5), 2);
    assert_eq!(nearest_int(2.5), 2);
    assert_eq!(nearest_int(-0.5), 0);
    assert_eq!(nearest_int(-1.5), -2);
    assert_eq!(nearest_int(-3.7), -4);
}

#[test]
fn q8_0_ref_rounds_half_away_from_zero() {
    // amax 127 gives d = 1 and id = 1, so the values are rounded as given.
    let mut x = [0.0f32; 32];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = -2.5;
    x[3] = 0.5;
    let mut out = Vec::new();
    quantize_block_q8_0(&x, &mut out);
    assert_eq!(out.len(), 34);
    assert_eq!(f16::from_le_bytes([out[0], out[1]]).to_f32(), 1.0);
    assert_eq!(
        out[2..6].iter().map(|&b| b as i8).collect::<Vec<_>>(),
        [127, 3, -3, 1]
    );
}

/// Values in [−1, 1) from a fixed sequence.
fn sample(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

#[test]
fn k_quants_round_trip_within_their_step() {
    let x = sample(2 * QK_K, 7);
    for (ty, wt, tol) in [
        (QType::Q4_K, kvgate_kernels::WeightType::Q4_K, 0.15),
        (QType::Q6_K, kvgate_kernels::WeightType::Q6_K, 0.04),
        (QType::Q5_0, kvgate_kernels::WeightType::Q5_0, 0.07),
        (QType::Q8_0, kvgate_kernels::WeightType::Q8_0, 0.01),
    ] {
        let mut out = Vec::new();
        quantize_row(ty, &x, &mut out);
        assert_eq!(out.len(), ty.row_bytes(x.len()), "{ty}");
        let mut back = vec![0.0; x.len()];
        kvgate_kernels::quant::dequantize_row(wt, &out, &mut back).expect("row size");
        let err = x
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < tol, "{ty}: max error {err}");
    }
}

#[test]
fn all_zero_blocks_quantize_to_zero() {
    let x = vec![0.0f32; QK_K];
    let mut out = Vec::new();
    quantize_row(QType::Q6_K, &x, &mut out);
    assert!(out.iter().all(|&b| b == 0));
    out.clear();
    quantize_row(QType::Q4_K, &x, &mut out);
    assert!(out.iter().all(|&b| b == 0));
}

fn tensor(name: &str, dims: &[u64]) -> InTensor {
    InTensor {
        name: name.into(),
        dims: dims.to_vec(),
        ty: QType::Q4_1,
        offset: 0,
    }
}

#[test]
fn q4_k_m_type_rules_match_llama_cpp_on_smollm2_shapes() {
    let ty = |name: &str, dims: &[u64], layer: i64| {
        target_type(&tensor(name, dims), 30, true, layer).expect("supported")
    };
    // 576-wide rows fall back: Q4_K → Q5_0, Q6_K → Q8_0.
    assert_eq!(ty("blk.5.attn_q.weight", &[576, 576], 5), QType::Q5_0);
    assert_eq!(ty("blk.0.attn_v.weight", &[576, 192], 0), QType::Q8_0);
    assert_eq!(ty("blk.4.attn_v.weight", &[576, 192], 4), QType::Q5_0);
    // use_more_bits(i, 30): i < 3, i >= 26, (i − 3) % 3 == 2.
    assert_eq!(ty("blk.5.ffn_down.weight", &[1536, 576], 5), QType::Q6_K);
    assert_eq!(ty("blk.6.ffn_down.weight", &[1536, 576], 6), QType::Q4_K);
    assert_eq!(ty("blk.26.ffn_down.weight", &[1536, 576], 26), QType::Q6_K);
    // The tied embedding table stands in for the output head.
    assert_eq!(ty("token_embd.weight", &[576, 49152], -1), QType::Q8_0);
    assert_eq!(ty("blk.0.attn_norm.weight", &[576], 0), QType::Q4_1);
    assert!(target_type(&tensor("blk.0.attn_qkv.weight", &[576, 960]), 30, true, 0).is_err());
}

#[test]
fn rejects_files_that_are_not_gguf() {
    let err = quantize_bytes(b"GGML\x03\0\0\0", QuantMix::Q4_K_M).unwrap_err();
    assert!(err.contains("not a GGUF"), "{err}");
    let err = quantize_bytes(b"GGUF\x03\0\0\0\x01", QuantMix::Q4_K_M).unwrap_err();
    assert!(err.contains("truncated"), "{err}");
}

/// A two-layer file of F32 norms (kept as they are by Q4_K_M) with `extra` metadata.
fn norms_file(
    extra: impl FnOnce(crate::gguf::testutil::GgufBuilder) -> crate::gguf::testutil::GgufBuilder,
    first_dim: u64,
) -> Vec<u8> {
    let values = |base: f32| -> Vec<u8> {
        (0..first_dim)
            .flat_map(|i| (base + i as f32).to_le_bytes())
            .collect()
    };
    extra(crate::gguf::testutil::GgufBuilder::new())
        .str("general.architecture", "llama")
        .u32("llama.block_count", 2)
        .tensor("blk.0.attn_norm.weight", &[first_dim], 0, values(1.0))
        .tensor("blk.1.attn_norm.weight", &[first_dim], 0, values(100.0))
        .build()
}

/// `bytes` written to `name` in a fresh temp dir, where the tests also write their outputs; the
/// dir and all in it are removed when the returned guard drops (keep it while the files are used).
fn scratch_file(name: &str, bytes: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("kvgate-requant-")
        .tempdir()
        .expect("temp dir");
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("write temp file");
    (dir, path)
}

#[test]
fn an_alignment_of_any_integer_width_is_honoured_as_the_loader_does() {
    // general.alignment = 64 as a UINT64: read as 32 before, which shifted every tensor.
    let bytes = norms_file(|b| b.u64("general.alignment", 64).padded_to(64), 32);
    let (_dir, input) = scratch_file("align-u64.gguf", &bytes);
    let output = input.with_file_name("align-u64.q4km.gguf");
    quantize_file(&input, &output, QuantMix::Q4_K_M).expect("quantizes");
    let (before, after) = (
        crate::gguf::GgufFile::open(&input).expect("input opens"),
        crate::gguf::GgufFile::open(&output).expect("output opens"),
    );
    for name in ["blk.0.attn_norm.weight", "blk.1.attn_norm.weight"] {
        let data = |g: &crate::gguf::GgufFile| g.tensor_data(g.tensor(name).expect(name)).to_vec();
        assert_eq!(data(&after), data(&before), "{name}");
    }
}

#[test]
fn a_huge_alignment_is_refused_before_anything_is_padded_with_it() {
    let bytes = norms_file(|b| b.u32("general.alignment", 1 << 31), 32);
    let err = quantize_bytes(&bytes, QuantMix::Q4_K_M).unwrap_err();
    assert_eq!(
        err,
        "general.alignment is 2147483648; at most 1048576 is accepted"
    );
}

#[test]
fn a_zero_dimension_is_an_error_not_a_division_by_zero() {
    let bytes = norms_file(|b| b, 0);
    let err = quantize_bytes(&bytes, QuantMix::Q4_K_M).unwrap_err();
    assert_eq!(err, "tensor blk.0.attn_norm.weight: a dimension is 0");
    // Through the file, the loader's checks refuse it first, naming the file.
    let (_dir, input) = scratch_file("dim0.gguf", &bytes);
    let err = quantize_file(&input, &input.with_extension("out"), QuantMix::Q4_K_M).unwrap_err();
    assert!(
        err.contains("dim0.gguf") && err.contains("a dimension of 0"),
        "{err}"
    );
}

#[test]
fn an_input_or_output_that_is_not_a_regular_file_is_refused() {
    let (_dir, input) = scratch_file("ok.gguf", &norms_file(|b| b, 32));
    // /dev/zero was read without end.
    let err = quantize_file(
        Path::new("/dev/zero"),
        &input.with_extension("out"),
        QuantMix::Q4_K_M,
    )
    .unwrap_err();
    assert_eq!(err, "/dev/zero: not a regular file");
    let dir = input.with_file_name("out-dir");
    std::fs::create_dir_all(&dir).expect("dir");
    for out in [Path::new("/dev/null"), &dir] {
        let err = quantize_file(&input, out, QuantMix::Q4_K_M).unwrap_err();
        assert_eq!(
            err,
            format!(
                "{}: exists and is not a regular file; name a file to write",
                out.display()
            )
        );
    }
    assert_eq!(
        std::fs::read_dir(&dir).expect("lists").count(),
        0,
        "no temporary file"
    );
}

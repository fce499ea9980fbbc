//! Synthetic models open, bind, tokenize and generate like real ones; files are reproducible;
//! the 13B shape is checked through its header on a sparse file (its 7 GiB of weights are
//! never written here).

use super::*;
use crate::engine::{GenerationRequest, TokenEvent};
use crate::gguf::testutil::temp_path;
use crate::gguf::{GgmlType, GgufFile};
use crate::loader::{Runtime, RuntimeOptions};
use crate::model::{ModelConfig, ModelWeights};
use crate::plan::{PlanArgs, PlanReport};
use crate::tokenizer::Tokenizer;
use kvgate_kernels::quant::{WeightType, dequantize_row};
use tempfile::TempPath;

/// `spec` written to a temp file ending in `name`, removed when the returned guard drops.
fn write(spec: SynthSpec, name: &str) -> TempPath {
    let path = temp_path(name);
    SynthModel::new(spec)
        .write_to(&path, &mut |_| {})
        .expect("synthetic model is written");
    path
}

fn tiny(dtype: SynthDtype, seed: u64) -> SynthSpec {
    SynthSpec {
        shape: SynthShape::Tiny,
        dtype,
        seed,
    }
}

#[test]
fn tiny_model_of_every_dtype_opens_binds_and_has_the_planned_size() {
    for dtype in SynthDtype::ALL {
        let spec = tiny(dtype, 7);
        let path = write(spec, &format!("tiny-{dtype}.gguf"));
        let len = std::fs::metadata(&path).expect("file exists").len();
        assert_eq!(len, SynthModel::new(spec).file_len(), "{dtype}");
        let gguf = GgufFile::open(&path).expect("opens");
        let config = ModelConfig::from_gguf(&gguf).expect("config");
        let s = SynthShape::Tiny.spec();
        assert_eq!(
            (config.num_layers, config.hidden_size, config.num_heads),
            (s.layers, s.hidden, s.heads)
        );
        assert_eq!(
            (config.num_kv_heads, config.vocab_size),
            (s.kv_heads, s.vocab)
        );
        let weights = ModelWeights::bind(&gguf, &config).expect("every tensor binds");
        let expected = match dtype {
            SynthDtype::Q4_0 => GgmlType::Q4_0,
            SynthDtype::Q4_1 => GgmlType::Q4_1,
            SynthDtype::Q8_0 => GgmlType::Q8_0,
            SynthDtype::F16 => GgmlType::F16,
            // 320-wide ffn_down is not a whole number of 256-wide super-blocks: llama.cpp's
            // fallback types.
            // (Q4_K_M gives the last layer's ffn_down Q6_K bits, whose fallback is Q8_0.)
            SynthDtype::Q4_K => GgmlType::Q5_0,
            SynthDtype::Q5_K => GgmlType::Q5_1,
            SynthDtype::Q6_K | SynthDtype::Q4_K_M => GgmlType::Q8_0,
        };
        assert_eq!(weights.layers[1].ffn_down.ty(), expected);
        if dtype == SynthDtype::Q4_K_M {
            assert_eq!(weights.layers[0].ffn_down.ty(), GgmlType::Q5_0);
        }
        assert_eq!(weights.output_norm.ty(), GgmlType::F32);
        assert!(!config.tied_embeddings);
    }
}

#[test]
fn same_seed_same_bytes_other_seed_other_weights() {
    let a = std::fs::read(write(tiny(SynthDtype::Q4_0, 3), "a.gguf")).expect("read");
    let b = std::fs::read(write(tiny(SynthDtype::Q4_0, 3), "b.gguf")).expect("read");
    let c = std::fs::read(write(tiny(SynthDtype::Q4_0, 4), "c.gguf")).expect("read");
    assert!(a == b, "the same spec must give the same bytes");
    assert_eq!(a.len(), c.len());
    let header = SynthModel::new(tiny(SynthDtype::Q4_0, 3)).header_len() as usize;
    let differing = a[header..]
        .iter()
        .zip(&c[header..])
        .filter(|(x, y)| x != y)
        .count();
    assert!(
        differing > (a.len() - header) / 2,
        "another seed must change most weight bytes, changed {differing}"
    );
}

#[test]
fn weights_have_the_intended_scale_after_quantization() {
    // Dequantized rows of attn_q must look like uniform(±sqrt(3/hidden)): mean near 0, variance
    // near 1/hidden, for every dtype (a broken quantizer would be off by a large factor).
    for (shape, dtype, ty) in [
        (SynthShape::Tiny, SynthDtype::Q4_0, WeightType::Q4_0),
        (SynthShape::Tiny, SynthDtype::Q4_1, WeightType::Q4_1),
        (SynthShape::Tiny, SynthDtype::Q8_0, WeightType::Q8_0),
        (SynthShape::Tiny, SynthDtype::F16, WeightType::F16),
        (SynthShape::TinyK, SynthDtype::Q4_K, WeightType::Q4_K),
        (SynthShape::TinyK, SynthDtype::Q5_K, WeightType::Q5_K),
        (SynthShape::TinyK, SynthDtype::Q6_K, WeightType::Q6_K),
    ] {
        let hidden = shape.spec().hidden;
        let spec = SynthSpec {
            shape,
            dtype,
            seed: 11,
        };
        let path = write(spec, &format!("scale-{shape}-{dtype}.gguf"));
        let gguf = GgufFile::open(&path).expect("opens");
        let info = gguf.tensor("blk.0.attn_q.weight").expect("tensor");
        let data = gguf.tensor_data(info);
        let mut values = vec![0f32; hidden * hidden];
        for (row, out) in data
            .chunks_exact(ty.row_bytes(hidden))
            .zip(values.chunks_exact_mut(hidden))
        {
            dequantize_row(ty, row, out).expect("dequantizes");
        }
        let n = values.len() as f64;
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = values.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n;
        let want = 1.0 / hidden as f64;
        assert!(mean.abs() < 0.01, "{dtype}: mean {mean}");
        assert!(
            (var / want - 1.0).abs() < 0.2,
            "{dtype}: variance {var}, want about {want}"
        );
    }
}

#[test]
fn quantizers_reconstruct_within_their_step() {
    // Values in ±0.182 (14 × 0.013), the first of largest magnitude negative.
    let x: Vec<f32> = (0..32)
        .map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.013)
        .collect();
    let amax = 14.0 * 0.013;
    let decode = |ty: WeightType, block: &[u8]| {
        let mut y = vec![0f32; 32];
        dequantize_row(ty, block, &mut y).expect("dequantizes");
        y
    };
    let first_max = x
        .iter()
        .position(|v| v.abs() >= amax - 1e-6)
        .expect("extreme");
    for (bits, ty) in [(4, WeightType::Q4_0), (5, WeightType::Q5_0)] {
        // Q4_0/Q5_0 (ggml): d = -max/half spans [-half·d, (half−1)·d]; the largest magnitude
        // is exact, values are within half a step except at the clipped opposite end (at most
        // one step).
        let half = (1 << (bits - 1)) as f32;
        let mut block = Vec::new();
        quantize_block_symmetric(&x, bits, &mut block);
        assert_eq!(block.len(), ty.block_bytes());
        let y = decode(ty, &block);
        let step = amax / half;
        assert!(
            (y[first_max] - x[first_max]).abs() < 1e-3,
            "{ty:?}: extreme value kept"
        );
        for (a, b) in x.iter().zip(&y) {
            let bound = if *a > (half - 1.0) * step {
                step
            } else {
                step * 0.5
            };
            assert!((a - b).abs() <= bound + 1e-3, "{ty:?}: {a} vs {b}");
        }
    }
    for (bits, ty) in [(4, WeightType::Q4_1), (5, WeightType::Q5_1)] {
        // Q4_1/Q5_1: min + (2^bits − 1) steps covers the range; half a step everywhere.
        let mut block = Vec::new();
        quantize_block_min(&x, bits, &mut block);
        assert_eq!(block.len(), ty.block_bytes());
        let y = decode(ty, &block);
        let step = 2.0 * amax / ((1 << bits) - 1) as f32;
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= step * 0.5 + 1e-3, "{ty:?}: {a} vs {b}");
        }
    }
}

#[test]
fn vocabulary_round_trips_text_and_has_chatml_tokens() {
    let path = write(tiny(SynthDtype::Q8_0, 1), "vocab.gguf");
    let gguf = GgufFile::open(&path).expect("opens");
    let tokenizer = Tokenizer::from_gguf(&gguf).expect("tokenizer builds");
    assert_eq!(tokenizer.vocab_size(), 512);
    let text = "Hello, world! ünïcödé\n\t0123";
    let ids = tokenizer.encode(text, false);
    assert!(ids.len() < text.len(), "merges must apply: {ids:?}");
    assert_eq!(tokenizer.decode(&ids), text);
    assert_eq!(tokenizer.eos_id(), Some(IM_END));
    assert!(tokenizer.is_eog(IM_END));
    let chat = tokenizer.encode("<|im_start|>user", true);
    assert_eq!(chat[0], IM_START);
}

/// Greedy-generates 12 tokens (EOS ignored) from `path` on one thread.
fn generate_12(path: &Path) -> Vec<u32> {
    {
        let runtime = Runtime::start(
            path,
            RuntimeOptions {
                kv_memory_bytes: 4 << 20,
                threads: Some(1),
                ..RuntimeOptions::default()
            },
        )
        .expect("runtime starts on the synthetic model");
        let prompt = runtime.tokenizer.encode("The quick brown fox", false);
        let mut request = GenerationRequest::greedy(prompt, 12, "synth");
        request.stop.ignore_eos = true;
        let mut handle = runtime.engine.submit(request).expect("accepted");
        let mut ids = Vec::new();
        while let Some(event) = handle.events.blocking_recv() {
            match event {
                TokenEvent::Token { id, .. } => ids.push(id),
                TokenEvent::Finished { .. } => break,
                TokenEvent::Error(e) => panic!("generation failed: {e}"),
            }
        }
        ids
    }
}

#[test]
fn tiny_model_generates_through_the_cpu_backend_deterministically() {
    let path = write(tiny(SynthDtype::Q4_1, 5), "generate.gguf");
    let run = || generate_12(&path);
    let first = run();
    assert_eq!(first.len(), 12, "{first:?}");
    assert!(first.iter().all(|&id| (id as usize) < 512));
    let distinct: std::collections::BTreeSet<_> = first.iter().collect();
    assert!(
        distinct.len() > 1,
        "random weights should not repeat one token: {first:?}"
    );
    assert_eq!(run(), first, "greedy generation is deterministic");
}

/// Writes `spec` and opens, configures and binds it.
fn write_and_bind(spec: SynthSpec, name: &str) -> (TempPath, GgufFile, ModelConfig, ModelWeights) {
    let path = write(spec, name);
    let gguf = GgufFile::open(&path).expect("opens");
    let config = ModelConfig::from_gguf(&gguf).expect("config");
    let weights = ModelWeights::bind(&gguf, &config).expect("every tensor binds");
    (path, gguf, config, weights)
}

#[test]
fn q4_k_m_mix_binds_the_llama_cpp_types_and_generates() {
    // tiny-k has 2 layers: llama.cpp's use_more_bits picks layer 1 (the last eighth), so its
    // attn_v and ffn_down are Q6_K, like the output head; everything else is Q4_K.
    let spec = SynthSpec {
        shape: SynthShape::TinyK,
        dtype: SynthDtype::Q4_K_M,
        seed: 9,
    };
    let (path, gguf, _config, w) = write_and_bind(spec, "q4_k_m.gguf");
    assert_eq!(w.output.ty(), GgmlType::Q6_K);
    assert_eq!(w.token_embd.ty(), GgmlType::Q4_K);
    assert_eq!(
        (w.layers[0].wv.ty(), w.layers[0].ffn_down.ty()),
        (GgmlType::Q4_K, GgmlType::Q4_K)
    );
    assert_eq!(
        (w.layers[1].wv.ty(), w.layers[1].ffn_down.ty()),
        (GgmlType::Q6_K, GgmlType::Q6_K)
    );
    assert_eq!(w.layers[1].wq.ty(), GgmlType::Q4_K);
    assert_eq!(gguf.get_u64("general.file_type"), Some(15));

    let ids = generate_12(&path);
    assert_eq!(ids.len(), 12, "{ids:?}");
    let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
    assert!(distinct.len() > 1, "{ids:?}");
    assert_eq!(
        generate_12(&path),
        ids,
        "greedy generation is deterministic"
    );
}

#[test]
fn every_k_quant_dtype_generates() {
    // Each type runs through its own dot product end to end: tiny-k stores every matrix in the
    // K type (all widths are multiples of 256), tiny every matrix in its fallback (Q4_K →
    // Q5_0, Q5_K → Q5_1: no width of tiny is a multiple of 256).
    let cases = [
        (SynthShape::TinyK, SynthDtype::Q4_K),
        (SynthShape::TinyK, SynthDtype::Q5_K),
        (SynthShape::TinyK, SynthDtype::Q6_K),
        (SynthShape::Tiny, SynthDtype::Q4_K),
        (SynthShape::Tiny, SynthDtype::Q5_K),
    ];
    for (shape, dtype) in cases {
        let spec = SynthSpec {
            shape,
            dtype,
            seed: 9,
        };
        let path = write(spec, &format!("gen-{shape}-{dtype}.gguf"));
        let ids = generate_12(&path);
        assert_eq!(ids.len(), 12, "{dtype}: {ids:?}");
        assert!(ids.iter().all(|&id| (id as usize) < 512), "{dtype}");
    }
}

/// The model's header followed by a sparse data section (reads as zeros, takes no disk space):
/// everything but the weights' values, at the real size.
fn header_only(shape: SynthShape, dtype: SynthDtype, name: &str) -> TempPath {
    let model = SynthModel::new(SynthSpec {
        shape,
        dtype,
        seed: 0,
    });
    let path = temp_path(name);
    let mut file = std::fs::File::create(&path).expect("create");
    model.write_header(&mut file).expect("header");
    file.set_len(model.file_len()).expect("extend");
    path
}

#[test]
fn llama2_13b_header_loads_binds_and_plans_without_writing_the_weights() {
    let path = header_only(SynthShape::Llama2_13b, SynthDtype::Q4_0, "llama2-13b.gguf");
    let gguf = GgufFile::open(&path).expect("the 13B directory is consistent");
    let config = ModelConfig::from_gguf(&gguf).expect("config");
    assert_eq!(config.num_layers, 40);
    assert_eq!(config.hidden_size, 5120);
    assert_eq!((config.num_heads, config.num_kv_heads), (40, 40));
    assert_eq!((config.ffn_size, config.vocab_size), (13824, 32000));
    assert_eq!(config.context_length, 4096);
    ModelWeights::bind(&gguf, &config).expect("every tensor binds");
    // 13.0e9 weights at 4.5 bits, plus f32 norms.
    let weights = gguf.tensor_bytes();
    assert!(
        (7_000_000_000..7_500_000_000).contains(&weights),
        "{weights}"
    );

    let report = PlanReport::compute(&PlanArgs {
        model: Some(path.to_path_buf()),
        memory: "40GiB".into(),
        ..PlanArgs::default()
    })
    .expect("plan reads the 13B shape");
    // The seeds' worked example: 800 KiB per token, 12.5 MiB per 16-token block.
    assert_eq!(report.kv_bytes_per_token, 819_200);
    assert_eq!(report.num_blocks, 3276);
    assert_eq!(report.max_concurrency, 12);
    assert_eq!(report.weights_bytes, Some(weights));
    std::fs::remove_file(&path).ok();
}

#[test]
fn smollm2_shape_matches_the_default_model_config() {
    let path = header_only(SynthShape::Smollm2_135m, SynthDtype::Q4_1, "smollm2.gguf");
    let gguf = GgufFile::open(&path).expect("opens");
    let config = ModelConfig::from_gguf(&gguf).expect("config");
    assert_eq!(
        (
            config.num_layers,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads
        ),
        (30, 576, 9, 3)
    );
    assert_eq!((config.head_dim, config.ffn_size), (64, 1536));
    assert_eq!(
        (config.vocab_size, config.rope_freq_base),
        (49152, 100_000.0)
    );
    assert!(config.tied_embeddings);
    ModelWeights::bind(&gguf, &config).expect("binds");
    let tokenizer = Tokenizer::from_gguf(&gguf).expect("49152-token vocabulary builds");
    assert_eq!(tokenizer.vocab_size(), 49152);
    std::fs::remove_file(&path).ok();
}

#[test]
fn names_parse_and_unknown_names_are_listed() {
    assert_eq!(
        "llama2-13b".parse::<SynthShape>(),
        Ok(SynthShape::Llama2_13b)
    );
    assert_eq!("Q4_0".parse::<SynthDtype>(), Ok(SynthDtype::Q4_0));
    let err = "llama3".parse::<SynthShape>().unwrap_err();
    assert!(
        err.contains("smollm2-135m") && err.contains("tiny"),
        "{err}"
    );
    assert_eq!("Q4_K_M".parse::<SynthDtype>(), Ok(SynthDtype::Q4_K_M));
    assert_eq!("tiny-k".parse::<SynthShape>(), Ok(SynthShape::TinyK));
    let err = "iq2_xxs".parse::<SynthDtype>().unwrap_err();
    assert!(err.contains("q6_k") && err.contains("q4_k_m"), "{err}");
}

#[test]
fn qwen2_and_llama3_shapes_carry_their_architecture_features_and_generate() {
    use kvgate_kernels::RopeMode;
    // qwen2: its own metadata keys, NEOX RoPE, F32 Q/K/V biases in every layer.
    let spec = SynthSpec {
        shape: SynthShape::TinyQwen2,
        dtype: SynthDtype::Q4_K_M,
        seed: 3,
    };
    let (path, gguf, config, weights) = write_and_bind(spec, "qwen2.gguf");
    assert_eq!(gguf.get_str("general.architecture"), Some("qwen2"));
    assert!(gguf.get("llama.block_count").is_none());
    assert_eq!(config.rope_mode, RopeMode::Neox);
    assert_eq!(config.rms_eps, 1e-6);
    for layer in &weights.layers {
        let bk = layer.bk.as_ref().expect("a K bias");
        assert_eq!(bk.ty(), GgmlType::F32);
        assert!(layer.bq.is_some() && layer.bv.is_some());
        assert!(bk.f32_values(&gguf).iter().any(|&v| v.abs() > 0.5));
    }
    assert!(weights.rope_freqs.is_none());
    let qwen_ids = generate_12(&path);
    assert_eq!(qwen_ids.len(), 12);

    // llama3: RoPE base 500000 and Llama 3.1's factors: 1 for the fast pairs, 8 for the slow
    // ones, a blend between (base 500000, 64-wide heads: pairs 0..=14, 18..=31, 15..=17).
    let spec = SynthSpec {
        shape: SynthShape::TinyLlama3,
        dtype: SynthDtype::Q5_K,
        seed: 3,
    };
    let (path, gguf, config, weights) = write_and_bind(spec, "llama3.gguf");
    assert_eq!(config.architecture, "llama");
    assert_eq!(config.rope_freq_base, 500_000.0);
    let factors = weights
        .rope_freqs
        .as_ref()
        .expect("rope_freqs.weight")
        .f32_values(&gguf);
    assert_eq!(factors, llama3_rope_factors(500_000.0, 64));
    assert_eq!(factors.len(), 32);
    assert!(factors[..15].iter().all(|&f| f == 1.0), "{factors:?}");
    assert!(factors[18..].iter().all(|&f| f == 8.0), "{factors:?}");
    assert!(
        factors[15..18].iter().all(|&f| f > 1.0 && f < 8.0),
        "{factors:?}"
    );
    assert!(weights.layers[0].bq.is_none());
    assert_eq!(generate_12(&path).len(), 12);
}

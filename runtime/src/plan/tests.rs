use std::path::PathBuf;

use super::*;
use crate::kv_math::parse_size;
use crate::loader::{Runtime, RuntimeOptions};

/// `kvgate plan --layers 40 --hidden 5120 --dtype f16 --max-context 4096 --memory 40GiB`
fn thirteen_b_example() -> PlanArgs {
    PlanArgs {
        layers: Some(40),
        hidden: Some(5120),
        dtype: Some("f16".into()),
        max_context: Some(4096),
        memory: "40GiB".into(),
        ..PlanArgs::default()
    }
}

fn smollm2_path() -> PathBuf {
    match crate::provision::default_model_path() {
        Ok(path) => path,
        Err(e) => panic!("the default model is needed for this test: {e}"),
    }
}

fn compute(args: &PlanArgs) -> PlanReport {
    match PlanReport::compute(args) {
        Ok(report) => report,
        Err(e) => panic!("plan failed: {e}"),
    }
}

#[test]
fn the_documented_13b_example_needs_3_125_gib_per_request() {
    let report = compute(&thirteen_b_example());
    assert_eq!(report.kv_bytes_per_token, 800 * 1024, "40·2·5120·2 B");
    assert_eq!(
        report.kv_bytes_per_request,
        3 * (1 << 30) + (1 << 27),
        "3.125 GiB"
    );
    assert_eq!(report.blocks_per_request, 256);
    // 40 GiB / (800 KiB · 16) = 3276.8 → 3276 whole blocks.
    assert_eq!(report.num_blocks, 3276);
    assert_eq!(report.pool_tokens, 3276 * 16);
    assert_eq!(report.max_concurrency, 12);
    // 3276 · 0.85 = 2784.6 → 2784 usable blocks → 10 requests of 256 blocks.
    assert_eq!(report.max_concurrency_with_margin, 10);
    assert_eq!(report.weights_bytes, None);
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);

    let text = report.to_string();
    assert!(
        text.contains("shape            40 layers, KV width 5120"),
        "{text}"
    );
    assert!(
        text.contains("KV per request   3.12GiB (4096 tokens = 256 blocks)"),
        "{text}"
    );
    assert!(text.contains("KV per token     800KiB"), "{text}");
    assert!(text.contains("max concurrency  12"), "{text}");
}

#[test]
fn hidden_and_explicit_heads_give_the_same_bytes_without_gqa() {
    let by_heads = PlanArgs {
        hidden: None,
        kv_heads: Some(40),
        head_dim: Some(128),
        ..thirteen_b_example()
    };
    assert_eq!(
        compute(&by_heads).kv_bytes_per_token,
        compute(&thirteen_b_example()).kv_bytes_per_token
    );
}

#[test]
fn json_output_carries_every_number() {
    let json = match serde_json::to_value(compute(&thirteen_b_example())) {
        Ok(v) => v,
        Err(e) => panic!("serialize: {e}"),
    };
    assert_eq!(json["kv_bytes_per_token"], 819_200);
    assert_eq!(json["num_blocks"], 3276);
    assert_eq!(json["max_concurrency_with_margin"], 10);
    assert_eq!(json["dtype"], "f16");
    assert!(json["weights_bytes"].is_null());
}

#[test]
fn gguf_plan_matches_the_pool_the_runtime_builds_for_the_same_kv_budget() {
    let path = smollm2_path();
    for (memory, block_size) in [("64MiB", 16), ("100MiB", 32), ("7MiB", 16)] {
        let report = compute(&PlanArgs {
            model: Some(path.clone()),
            memory: memory.into(),
            block_size,
            ..PlanArgs::default()
        });
        // The real loader, as `kvgate serve --kv-memory MEMORY --block-size N` starts it.
        let options = RuntimeOptions {
            kv_memory_bytes: parse_size(memory).unwrap_or(0) as u64,
            block_size,
            threads: Some(1),
            max_num_seqs: 4,
            max_batched_tokens: 64,
            ..RuntimeOptions::default()
        };
        let runtime = match Runtime::start(&path, options) {
            Ok(runtime) => runtime,
            Err(e) => panic!("runtime start: {e}"),
        };
        let pool = runtime.engine.pool().snapshot();
        runtime.engine.shutdown();
        assert_eq!(
            report.num_blocks, runtime.num_blocks,
            "{memory}, block size {block_size}"
        );
        assert_eq!(report.num_blocks, pool.total_blocks);
        assert_eq!(report.kv_bytes_per_block, pool.bytes_per_block);
        assert_eq!(
            report.max_context, runtime.config.context_length,
            "defaults to the model's context"
        );
    }
}

#[test]
fn gguf_shape_is_the_models() {
    let path = smollm2_path();
    let report = compute(&PlanArgs {
        model: Some(path.clone()),
        memory: "64MiB".into(),
        ..PlanArgs::default()
    });
    let gguf = match GgufFile::open(&path) {
        Ok(g) => g,
        Err(e) => panic!("{e}"),
    };
    // SmolLM2-135M: 30 layers × 3 KV heads × 64, f16 → 23 040 B per token.
    assert_eq!(
        (report.layers, report.kv_heads, report.head_dim),
        (30, 3, 64)
    );
    assert_eq!(report.kv_bytes_per_token, 23_040);
    assert_eq!(report.num_blocks, (64 << 20) / (23_040 * 16));
    assert_eq!(report.weights_bytes, Some(gguf.tensor_bytes()));
}

#[test]
fn weights_are_reported_beside_the_pool_not_taken_from_it() {
    let report = compute(&PlanArgs {
        model: Some(smollm2_path()),
        memory: "1GiB".into(),
        max_context: Some(2048),
        ..PlanArgs::default()
    });
    let weights = report.weights_bytes.unwrap_or(0);
    assert!(
        weights > 50 << 20,
        "SmolLM2 Q4_1 weighs about 90 MiB, got {weights}"
    );
    assert_eq!(
        report.kv_budget_bytes,
        1 << 30,
        "--memory is the KV pool, like --kv-memory"
    );
    assert_eq!(report.total_bytes, Some(weights + (1 << 30)));
    assert!(report.to_string().contains("weights + KV"));
}

#[test]
fn a_request_larger_than_the_pool_is_a_warning_with_zero_concurrency() {
    let report = compute(&PlanArgs {
        memory: "1GiB".into(),
        ..thirteen_b_example()
    });
    assert_eq!(report.max_concurrency, 0);
    assert_eq!(report.max_concurrency_with_margin, 0);
    assert_eq!(report.warnings.len(), 1);
    assert!(
        report
            .to_string()
            .contains("warning: one 4096-token request needs 256 blocks")
    );
}

#[test]
fn margin_changes_concurrency_but_never_the_pool() {
    let none = compute(&PlanArgs {
        margin: 0.0,
        ..thirteen_b_example()
    });
    let half = compute(&PlanArgs {
        margin: 0.5,
        ..thirteen_b_example()
    });
    assert_eq!(none.num_blocks, half.num_blocks);
    assert_eq!(none.max_concurrency_with_margin, none.max_concurrency);
    assert_eq!(
        half.max_concurrency_with_margin, 6,
        "1638 usable blocks / 256"
    );
}

#[test]
fn q8_counts_scales_and_block_size_changes_rounding() {
    let q8 = compute(&PlanArgs {
        dtype: Some("q8".into()),
        ..thirteen_b_example()
    });
    // 5120 values = 160 Q8 blocks of 34 bytes, ×2 (K,V) ×40 layers.
    assert_eq!(q8.kv_bytes_per_token, 2 * 40 * 160 * 34);
    let odd = compute(&PlanArgs {
        max_context: Some(4097),
        block_size: 32,
        ..thirteen_b_example()
    });
    assert_eq!(
        odd.blocks_per_request, 129,
        "4097 tokens round up to a whole block"
    );
    assert_eq!(odd.kv_bytes_per_request, 129 * 32 * 800 * 1024);
}

fn error(args: PlanArgs) -> String {
    match PlanReport::compute(&args) {
        Ok(report) => panic!("expected an error, got {report:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_inputs_give_clear_errors() {
    let base = thirteen_b_example;
    let from_model = || PlanArgs {
        model: Some(smollm2_path()),
        layers: None,
        hidden: None,
        ..base()
    };
    let cases = [
        (PlanArgs::default(), "no model shape"),
        (
            PlanArgs {
                layers: None,
                ..base()
            },
            "--layers is required",
        ),
        (
            PlanArgs {
                hidden: None,
                ..base()
            },
            "needs its width",
        ),
        (
            PlanArgs {
                kv_heads: Some(8),
                ..base()
            },
            "not both",
        ),
        (
            PlanArgs {
                hidden: None,
                kv_heads: Some(8),
                ..base()
            },
            "given together",
        ),
        (
            PlanArgs {
                layers: Some(0),
                ..base()
            },
            "--layers must be at least 1",
        ),
        (
            PlanArgs {
                block_size: 0,
                ..base()
            },
            "--block-size must be at least 1",
        ),
        (
            PlanArgs {
                max_context: None,
                ..base()
            },
            "--max-context is required",
        ),
        (
            PlanArgs {
                max_context: Some(0),
                ..base()
            },
            "--max-context must be at least 1",
        ),
        (
            PlanArgs {
                dtype: Some("int4".into()),
                ..base()
            },
            "--dtype: unknown KV dtype",
        ),
        (
            PlanArgs {
                memory: "40 parsecs".into(),
                ..base()
            },
            "--memory: unknown size unit",
        ),
        (
            PlanArgs {
                memory: String::new(),
                ..base()
            },
            "--memory: empty size",
        ),
        (
            PlanArgs {
                margin: 1.0,
                ..base()
            },
            "--margin must be in [0, 1)",
        ),
        (
            PlanArgs {
                margin: f64::NAN,
                ..base()
            },
            "--margin must be in [0, 1)",
        ),
        (
            PlanArgs {
                model: Some("/nonexistent/model.gguf".into()),
                ..from_model()
            },
            "/nonexistent/model.gguf",
        ),
        (
            PlanArgs {
                layers: Some(30),
                ..from_model()
            },
            "cannot be combined",
        ),
    ];
    for (args, expected) in cases {
        let message = error(args);
        assert!(
            message.contains(expected),
            "{message:?} should mention {expected:?}"
        );
    }
}

#[test]
fn sizes_that_overflow_are_errors_naming_the_value_and_the_flags() {
    // `--layers 4294967295 --hidden 4294967295 --memory 1GiB --max-context 4294967295`
    let per_token = error(PlanArgs {
        layers: Some(u32::MAX as usize),
        hidden: Some(u32::MAX as usize),
        max_context: Some(u32::MAX as usize),
        memory: "1GiB".into(),
        ..PlanArgs::default()
    });
    assert_eq!(
        per_token,
        "KV bytes per token overflows: 2 × 4294967295 layers × 1 KV heads × 4294967295 values \
         of f16 is more than 2^64 bytes; lower --layers, --kv-heads, --head-dim or --hidden"
    );
    let per_block = error(PlanArgs {
        block_size: usize::MAX,
        ..thirteen_b_example()
    });
    assert!(
        per_block
            .starts_with("KV bytes per block overflows: 819200 bytes per token × --block-size"),
        "{per_block}"
    );
    assert!(per_block.ends_with("lower --block-size"), "{per_block}");
    // Fits per block and in the pool; only the full-length request overflows.
    let per_request = error(PlanArgs {
        layers: Some(1),
        hidden: Some(1),
        block_size: 1,
        memory: "1KiB".into(),
        max_context: Some(usize::MAX / 2),
        ..PlanArgs::default()
    });
    assert!(
        per_request.starts_with("KV bytes per request overflows: "),
        "{per_request}"
    );
    assert!(
        per_request.ends_with("lower --max-context"),
        "{per_request}"
    );
}

#[test]
fn a_block_larger_than_the_budget_is_refused_as_the_server_refuses_it() {
    // `--block-size 4294967295`: one block is 3.1 PiB against a 40 GiB budget.
    let message = error(PlanArgs {
        block_size: u32::MAX as usize,
        ..thirteen_b_example()
    });
    assert!(
        message.starts_with("--memory 40GiB is smaller than one KV block ("),
        "{message}"
    );
    assert!(message.contains("for 4294967295 tokens"), "{message}");
    assert!(
        message.ends_with("raise --memory or lower --block-size"),
        "{message}"
    );
    // The largest block size that still leaves one block is planned as usual.
    let fits = compute(&PlanArgs {
        block_size: (40 << 30) / (800 * 1024),
        ..thirteen_b_example()
    });
    assert_eq!(fits.num_blocks, 1);
}

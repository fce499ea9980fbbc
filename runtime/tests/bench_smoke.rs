//! The bench harness end to end on the real model, with tiny workloads (it checks the
//! harness works and reports sane shapes; the numbers themselves are not asserted).

mod common;

use common::model_path;
use kvgate_runtime::bench::{BenchOptions, KvWasteOptions, measure_kv_waste, run_bench};
use kvgate_runtime::loader::{Runtime, RuntimeOptions};

fn runtime() -> Runtime {
    let opts = RuntimeOptions {
        threads: Some(2),
        ..RuntimeOptions::default()
    };
    Runtime::start(&model_path(), opts).expect("runtime starts")
}

#[test]
fn bench_reports_every_concurrency_level() {
    let rt = runtime();
    let options = BenchOptions {
        prompt_tokens: 16,
        decode_tokens: 4,
        decode_depth: 12,
        concurrency: vec![1, 3],
        concurrent_prompt_tokens: 8,
        concurrent_decode_tokens: 4,
        repeats: 1,
    };
    let report = run_bench(&rt, &options).expect("bench runs");
    assert_eq!(report.threads, 2);
    assert!(
        report.prefill_tok_s > 0.0 && report.decode_tok_s > 0.0,
        "{report:?}"
    );
    assert_eq!(
        report
            .aggregate_decode_tok_s
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        vec![1, 3]
    );
    assert!(
        report.aggregate_decode_tok_s.values().all(|&r| r > 0.0),
        "{report:?}"
    );
    rt.engine.shutdown();
}

#[test]
fn kv_waste_compares_paged_with_contiguous_allocation() {
    let rt = runtime();
    let options = KvWasteOptions {
        requests: 6,
        prompt_tokens: (5, 40),
        output_tokens: (3, 12),
        ..KvWasteOptions::default()
    };
    let report = measure_kv_waste(&rt, &options).expect("workload runs");
    assert!(report.samples > 0, "{report:?}");
    // Paged allocation can only waste the unfilled tail of each sequence's last block.
    assert!(report.paged_allocated_per_used >= 1.0, "{report:?}");
    assert!(
        report.paged_allocated_per_used < report.max_context_allocated_per_used,
        "{report:?}"
    );
    assert_eq!(report.max_context_capacity, 11_648 / 8192);
    rt.engine.shutdown();
}

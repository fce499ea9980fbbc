//! Runs `kvgate_runtime::bench` on the default model and prints the JSON report.
//!
//! ```text
//! cargo run --release -p kvgate-runtime --example bench -- [--threads N] [--kv-waste] [--model PATH]
//! ```

use std::path::PathBuf;

use kvgate_runtime::bench::{BenchOptions, KvWasteOptions, measure_kv_waste, run_bench};
use kvgate_runtime::loader::{Runtime, RuntimeOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut threads = None;
    let mut model = None;
    let mut kv_waste = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--threads" => threads = Some(args.next().ok_or("--threads needs a value")?.parse()?),
            "--model" => model = Some(PathBuf::from(args.next().ok_or("--model needs a path")?)),
            "--kv-waste" => kv_waste = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let model = match model {
        Some(path) => path,
        None => kvgate_runtime::provision::default_model_path()?,
    };
    let runtime = Runtime::start(
        &model,
        RuntimeOptions {
            threads,
            ..RuntimeOptions::default()
        },
    )?;
    if kv_waste {
        let report = measure_kv_waste(&runtime, &KvWasteOptions::default())?;
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let report = run_bench(&runtime, &BenchOptions::default())?;
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    runtime.engine.shutdown();
    Ok(())
}

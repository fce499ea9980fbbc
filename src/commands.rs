//! The one-shot commands: generate, tokenize, bench, plan, policy, top, fetch-model,
//! synth-model, quantize.

use std::io::{Read, Write};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvgate_gateway::{auth, policy};
use kvgate_kernels::cuda::probe::DeviceProbe;
use kvgate_runtime::bench::{
    BenchOptions, KvWasteOptions, PrefixBenchOptions, PrefixWorkload, measure_kv_waste,
    run_prefix_bench,
};
use kvgate_runtime::chat_template::ChatMessage;
use kvgate_runtime::device::{Device, select_device};
use kvgate_runtime::engine::{GenerationRequest, TokenEvent};
use kvgate_runtime::gguf::GgufFile;
use kvgate_runtime::kv_math::{HumanSize, parse_size};
use kvgate_runtime::loader::{BackendChoice, CudaChoice, LoadError, Runtime, RuntimeOptions};
use kvgate_runtime::plan::{PlanArgs, PlanReport};
use kvgate_runtime::provision;
use kvgate_runtime::sequence::{SamplingParams, StopParams};
use kvgate_runtime::synth::{SynthModel, SynthSpec};
use kvgate_runtime::tokenizer::Tokenizer;

use crate::cli::{
    BenchArgs, BenchWorkload, GenerateArgs, LogFormat, ModelArgs, PlanCliArgs, PolicyCommand,
    QuantizeArgs, Switch, SynthModelArgs, TokenizeArgs, TopArgs,
};

/// Loads the model named by `args` (fetching the default one if needed) and starts the engine.
pub fn start_runtime(args: &ModelArgs) -> Result<Runtime> {
    // Before the model loads: a device that cannot be used is a one-line error in milliseconds.
    let choice = select_device(args.device, DeviceProbe::run)?;
    tracing::info!("{choice}");
    let path = provision::resolve_model(args.model.as_deref())?;
    let kv_memory = parse_size(&args.kv_memory).context("--kv-memory")?;
    let opts = RuntimeOptions {
        kv_memory_bytes: kv_memory as u64,
        block_size: args.block_size,
        threads: args.threads,
        max_num_seqs: args.max_num_seqs,
        max_batched_tokens: args.max_batched_tokens,
        target_itl: args.target_itl.0,
        prefill_order: args.prefill_order.into(),
        prefix_caching: args.prefix_cache == Switch::On,
        command_queue: args.engine_queue as usize,
    };
    let backend = match choice.device {
        Device::Cpu => BackendChoice::Cpu,
        Device::Cuda(ordinal) => BackendChoice::Cuda(CudaChoice {
            ordinal,
            gpu_memory_utilization: args.gpu_memory_utilization,
            cubin_cache: provision::cache_dir()?.join("cubin"),
        }),
    };
    Runtime::start_on(&path, opts, backend).map_err(|error| match error {
        // Its message names the file and what is wrong with it.
        LoadError::Gguf(_) => anyhow::Error::new(error),
        other => anyhow::Error::new(other).context(format!("loading {}", path.display())),
    })
}

/// Logs of the one-shot commands go to stderr and stay quiet unless `RUST_LOG` asks (e.g.
/// `RUST_LOG=info` shows the device choice and the KV plan): stdout carries only results, and
/// a failure stays one line on stderr.
pub fn generate(args: GenerateArgs) -> Result<()> {
    crate::logging::init(LogFormat::Plain, "warn");
    if !(0.0..=2.0).contains(&args.temperature) {
        bail!(
            "--temperature must be within [0, 2], got {}",
            args.temperature
        );
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be within (0, 1], got {}", args.top_p);
    }
    let runtime = start_runtime(&args.model)?;
    let prompt = if args.raw {
        runtime.tokenizer.encode_with_specials(&args.prompt, false)
    } else {
        // The prompt is message content: only the template's markup becomes control tokens.
        runtime
            .tokenizer
            .encode_chat(&[ChatMessage::new("user", args.prompt.as_str())], true)?
    };
    let mut handle = runtime.engine.submit(GenerationRequest {
        prompt,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: 0,
            seed: args.seed,
        },
        stop: StopParams {
            max_tokens: args.max_tokens,
            stop_strings: Vec::new(),
            ignore_eos: false,
        },
        reservation: None,
        label: "cli".to_owned(),
        weight: std::num::NonZeroU32::MIN,
        // One prompt per process: nothing to share.
        cache_salt: None,
    })?;
    // Stream text as it is generated; only generated text goes to stdout.
    let mut out = std::io::stdout().lock();
    while let Some(event) = handle.events.blocking_recv() {
        match event {
            TokenEvent::Token { text, .. } => {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            TokenEvent::Finished { .. } => {
                writeln!(out)?;
                return Ok(());
            }
            TokenEvent::Error(msg) => bail!("generation failed: {msg}"),
        }
    }
    bail!("the engine stopped before the generation finished")
}

pub fn tokenize(args: TokenizeArgs) -> Result<()> {
    let path = provision::resolve_model(args.model.as_deref())?;
    let gguf = GgufFile::open(&path)?;
    // Worded as `generate` words it, naming the file: the vocabulary's error does not.
    let tokenizer = Tokenizer::from_gguf(&gguf)
        .with_context(|| format!("loading {}: tokenizer", path.display()))?;
    let ids = if args.add_special {
        tokenizer.encode_with_specials(&args.text, !args.no_special)
    } else {
        tokenizer.encode(&args.text, !args.no_special)
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&ids)?)?;
    out.flush()?;
    Ok(())
}

pub fn bench(args: BenchArgs) -> Result<()> {
    crate::logging::init(LogFormat::Plain, "warn");
    let runtime = start_runtime(&args.model)?;
    let mut out = std::io::stdout().lock();
    if args.kv_waste {
        let report = measure_kv_waste(&runtime, &KvWasteOptions::default())?;
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
        out.flush()?;
        return Ok(());
    }
    let workload = match args.workload {
        BenchWorkload::Throughput => None,
        BenchWorkload::SharedPrompt => Some(PrefixWorkload::SharedPrompt),
        BenchWorkload::MultiTurn => Some(PrefixWorkload::MultiTurn),
    };
    if let Some(workload) = workload {
        let options = PrefixBenchOptions::for_workload(workload);
        let report = run_prefix_bench(&runtime, &options)?;
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
        out.flush()?;
        return Ok(());
    }
    let options = BenchOptions {
        decode_depth: args.decode_depth,
        concurrency: args.streams.0.clone(),
        ..BenchOptions::default()
    };
    let report = kvgate_runtime::bench::run_bench(&runtime, &options)?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
    } else {
        writeln!(out, "threads                     {}", report.threads)?;
        writeln!(
            out,
            "prefill                     {:8.1} tok/s",
            report.prefill_tok_s
        )?;
        writeln!(
            out,
            "decode (single stream)      {:8.1} tok/s",
            report.decode_tok_s
        )?;
        for (seqs, rate) in &report.aggregate_decode_tok_s {
            writeln!(out, "aggregate decode, {seqs:>2} seqs   {rate:8.1} tok/s")?;
        }
    }
    out.flush()?;
    Ok(())
}

pub fn plan(args: PlanCliArgs) -> Result<()> {
    if let Some(model) = &args.model {
        provision::check_model_file(model)?;
    }
    let report = PlanReport::compute(&PlanArgs {
        model: args.model,
        layers: args.layers,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        hidden: args.hidden,
        dtype: Some(args.dtype),
        memory: args.memory,
        max_context: args.max_context,
        block_size: args.block_size,
        margin: args.margin,
    })?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        write!(out, "{report}")?;
    }
    out.flush()?;
    Ok(())
}

pub fn policy(cmd: PolicyCommand) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match cmd {
        PolicyCommand::Check { file } => {
            let summary = policy::check_policy_file(&file)?;
            writeln!(out, "{}: OK", file.display())?;
            writeln!(out, "{summary}")?;
        }
        PolicyCommand::CheckUpstreams { file } => {
            let specs = kvgate_gateway::upstream::file::load_upstreams_file(&file)?;
            // Grouping finds what the file alone cannot (a replica URL twice for one model).
            let upstreams = kvgate_gateway::upstream::Upstreams::new(specs.clone())?;
            writeln!(out, "{}: OK", file.display())?;
            for upstream in upstreams.list().iter() {
                writeln!(
                    out,
                    "{}: {} replica(s)",
                    upstream.name(),
                    upstream.replicas().replicas().len()
                )?;
            }
            for spec in specs {
                writeln!(out, "  {spec}")?;
            }
        }
        PolicyCommand::HashKey { key } => {
            let key = match key {
                Some(key) => key,
                None => {
                    let mut buf = String::new();
                    std::io::stdin().read_to_string(&mut buf)?;
                    buf.trim_end_matches(['\r', '\n']).to_owned()
                }
            };
            if key.is_empty() {
                bail!("the key is empty");
            }
            writeln!(out, "{}", auth::hash_key(&key))?;
        }
        PolicyCommand::NewKey => {
            let key = auth::new_key().context("reading the operating system's random source")?;
            writeln!(out, "key     {key}")?;
            writeln!(out, "sha256  {}", auth::hash_key(&key))?;
            // The key must reach stdout before the advice says it was given.
            out.flush()?;
            eprintln!(
                "Give the key to its user; store only the sha256 in the policy (key_sha256). \
                 The key cannot be shown again."
            );
        }
    }
    out.flush()?;
    Ok(())
}

pub fn top(args: TopArgs) -> Result<()> {
    // Checked when parsed (positive, at most an hour), so it converts; checked again here
    // rather than panicking in `from_secs_f64` should the two ever disagree.
    let interval = Duration::try_from_secs_f64(args.interval)
        .ok()
        .filter(|interval| !interval.is_zero())
        .context("--interval must be a positive number of seconds")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(crate::top::run(args.url, interval, args.once))
}

pub fn fetch_model() -> Result<()> {
    let path = provision::default_model_path()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", path.display())?;
    out.flush()?;
    Ok(())
}

pub fn quantize(args: QuantizeArgs) -> Result<()> {
    let report = kvgate_runtime::requant::quantize_file(&args.input, &args.out, args.mix)
        .map_err(|e| anyhow::anyhow!(e))?;
    let requantized = report.tensors.iter().filter(|t| t.from != t.to).count();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{}: {} tensors ({requantized} requantized), {}",
        args.out.display(),
        report.tensors.len(),
        HumanSize(report.bytes as usize)
    )?;
    out.flush()?;
    Ok(())
}

pub fn synth_model(args: SynthModelArgs) -> Result<()> {
    let model = SynthModel::new(SynthSpec {
        shape: args.shape,
        dtype: args.dtype,
        seed: args.seed,
    });
    // Large shapes take a while (a 13B Q4_0 file is 7 GiB): show progress on stderr only.
    let bar = indicatif::ProgressBar::new(model.file_len());
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bytes}/{total_bytes} {wide_bar} {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let header = model.header_len();
    model.write_to(&args.out, &mut |written| bar.set_position(header + written))?;
    bar.finish_and_clear();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{}: synthetic {} {} seed {} ({} tensors, {})",
        args.out.display(),
        args.shape,
        args.dtype,
        args.seed,
        model.num_tensors(),
        HumanSize(model.file_len() as usize)
    )?;
    out.flush()?;
    Ok(())
}

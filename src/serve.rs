//! `kvgate serve`: load the model, start the engine, load the policy, serve the OpenAI API (and
//! proxy the `--upstream` models) until SIGTERM/SIGINT, drain in-flight requests within the
//! grace period, exit 0.

use std::time::Duration;

use anyhow::{Context, Result};
use kvgate_gateway::admission::Admission;
use kvgate_gateway::metrics::{Compat, MetricsConfig};
use kvgate_gateway::reload::PolicyStore;
use kvgate_gateway::server::{self, ServeConfig};
use kvgate_gateway::shutdown;
use kvgate_gateway::upstream::Upstreams;
use tracing_subscriber::EnvFilter;

use kvgate_runtime::kv_math::parse_size;

use crate::cli::{LogFormat, MetricsCompat, ServeArgs};
use crate::commands::start_runtime;

pub fn run(args: ServeArgs) -> Result<()> {
    init_logging(args.log_format);
    // Check the policy before spending time on the model: a typo should fail in milliseconds.
    let store = PolicyStore::load(&args.policy)?;
    let memory_budget_bytes = match &args.memory_budget {
        Some(text) => Some(parse_size(text).context("--memory-budget")? as u64),
        None => None,
    };
    // Also before the model: builds the upstreams' tiktoken encodings once, up front.
    let upstreams = Upstreams::new(args.upstreams.clone())?;
    let runtime = start_runtime(&args.model)?;
    let config = ServeConfig {
        listen: args.listen,
        metrics_listen: args.metrics_listen,
        pre_drain: args.pre_drain,
        model_name: runtime.model_name.clone(),
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
        metrics: MetricsConfig {
            compat: match args.metrics_compat {
                Some(MetricsCompat::Vllm) => Compat::Vllm,
                None => Compat::None,
            },
            version: env!("CARGO_PKG_VERSION").to_owned(),
            backend: "cpu".to_owned(),
            model: runtime.model_name.clone(),
            memory_budget_bytes,
        },
        ..ServeConfig::default()
    };
    let engine = runtime.engine.clone();
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    tokio.block_on(async {
        let _reload = store
            .watch()
            .context("watching the policy file for changes")?;
        let admission =
            Admission::with_pools(store.clone(), engine.pool().clone(), upstreams.pools());
        tracing::info!(listen = %config.listen, policy = %args.policy.display(), "kvgate ready");
        server::serve(
            config,
            engine.clone(),
            runtime.tokenizer.clone(),
            store,
            admission,
            upstreams,
            shutdown::signal(),
        )
        .await
        .context("serving")
    })?;
    engine.shutdown();
    Ok(())
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Plain => builder.init(),
    }
}

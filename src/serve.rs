//! `kvgate serve`: load the policy, bind the listener, load the model, start the engine, serve
//! the OpenAI API (and proxy the `--upstream` models) until SIGTERM/SIGINT, drain in-flight
//! requests within the grace period, exit 0.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvgate_gateway::admission::Admission;
use kvgate_gateway::metrics::{Compat, MetricsConfig};
use kvgate_gateway::policy::parse_policy;
use kvgate_gateway::reload::PolicyStore;
use kvgate_gateway::server::{self, ServeConfig, ServeError};
use kvgate_gateway::shutdown;
use kvgate_gateway::upstream::Upstreams;
use kvgate_gateway::upstream::file::{load_upstreams_file, watch_upstreams_file};
use kvgate_gateway::validate::PromptCodec;

use kvgate_runtime::kv_math::parse_size;

use crate::cli::{MetricsCompat, ServeArgs};
use crate::commands::start_runtime;

/// `policies/default.toml`, built in: `kvgate serve` without `--policy` works from any
/// directory, not only from a checkout.
pub const DEFAULT_POLICY: &str = include_str!("../policies/default.toml");
/// How the built-in policy is named in logs and errors.
const DEFAULT_POLICY_NAME: &str = "(built-in policies/default.toml)";

pub fn run(args: ServeArgs) -> Result<()> {
    crate::logging::init(args.log_format, "info");
    // Check the policy before spending time on the model: a typo should fail in milliseconds.
    let store = load_policy(args.policy.as_deref())?;
    let memory_budget_bytes = match &args.memory_budget {
        Some(text) => Some(parse_size(text).context("--memory-budget")? as u64),
        None => None,
    };
    // Also before the model: builds the upstreams' tiktoken encodings once, up front.
    let mut specs = args.upstreams.clone();
    if let Some(path) = &args.upstreams_file {
        specs.extend(load_upstreams_file(path)?);
    }
    let upstreams = Upstreams::new(specs)?;
    let mut tokio = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = args.http_workers {
        tokio.worker_threads(usize::from(workers));
    }
    let tokio = tokio
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Bind before loading the model: a taken port fails at once, not after the load, and
    // "ready" is logged only once the listener exists.
    let listener = tokio
        .block_on(server::listen(args.listen))
        .map_err(bind_error)?;
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
    let codec: Arc<dyn PromptCodec> = runtime.tokenizer.clone();
    tokio.block_on(async {
        let _reload = match &args.policy {
            Some(_) => Some(
                store
                    .watch()
                    .context("watching the policy file for changes")?,
            ),
            None => {
                ignore_hangups()?;
                None
            }
        };
        let _upstreams_reload = match &args.upstreams_file {
            Some(path) => Some(
                watch_upstreams_file(upstreams.clone(), path.clone(), args.upstreams.clone())
                    .context("watching the upstreams file for changes")?,
            ),
            None => None,
        };
        let admission =
            Admission::with_pools(store.clone(), engine.pool().clone(), upstreams.pools());
        let server = server::bind_on(
            listener,
            &config,
            engine.clone(),
            codec,
            store.clone(),
            admission,
            upstreams,
        )
        .await?;
        // Signals are handled from before "ready" on; a second SIGTERM/SIGINT cuts the
        // pre-drain short.
        let signals = shutdown::Signals::listen();
        let listen = server.local_addr().context("reading the bound address")?;
        tracing::info!(
            %listen,
            policy = %store.path().display(),
            model = %config.model_name,
            "kvgate ready"
        );
        server.run_until(signals.first(), signals.second()).await;
        anyhow::Ok(())
    })?;
    engine.shutdown();
    Ok(())
}

/// `--policy FILE`, or the built-in default policy (logged, so nobody wonders which limits
/// apply).
fn load_policy(path: Option<&Path>) -> Result<PolicyStore> {
    let Some(path) = path else {
        let policy = parse_policy(DEFAULT_POLICY_NAME, DEFAULT_POLICY)
            .context("the built-in default policy is invalid")?;
        tracing::info!(
            "no --policy given: using the built-in default policy (policies/default.toml: one \
             anonymous tenant, any or no API key)"
        );
        return Ok(PolicyStore::from_policy(policy));
    };
    if !path.exists() {
        bail!(
            "--policy {}: no such file; pass the path of a policy TOML file (examples: \
             policies/ in the repository), or leave out --policy to use the built-in default",
            path.display()
        );
    }
    Ok(PolicyStore::load(path)?)
}

/// With the built-in policy there is no file to reload; SIGHUP (which would otherwise end the
/// process) only says so.
fn ignore_hangups() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            tracing::warn!(
                "SIGHUP: the built-in default policy has no file to reload; start with \
                 --policy FILE to change limits while serving"
            );
        }
    });
    Ok(())
}

/// One line for a listener that could not be bound, naming the usual cause.
fn bind_error(error: ServeError) -> anyhow::Error {
    match &error {
        ServeError::Bind { addr, source } if source.kind() == std::io::ErrorKind::AddrInUse => {
            anyhow::anyhow!(
                "cannot listen on {addr}: the address is already in use (is another kvgate \
                 running?); pick a free one with --listen"
            )
        }
        _ => error.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_policy_file_the_built_in_default_loads() {
        let store = load_policy(None).unwrap();
        assert_eq!(store.path(), Path::new(DEFAULT_POLICY_NAME));
        assert!(store.current().anonymous_tenant().is_some());
    }

    #[test]
    fn a_missing_policy_file_says_how_to_pass_one() {
        let error = load_policy(Some(Path::new("/nonexistent/policy.toml")))
            .err()
            .unwrap()
            .to_string();
        assert!(
            error.starts_with("--policy /nonexistent/policy.toml: no such file;"),
            "{error}"
        );
        assert!(error.contains("leave out --policy"), "{error}");
    }
}

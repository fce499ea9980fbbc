//! Prometheus metrics: every metric name kvgate exports, the recording helpers the request path
//! calls, and the `/metrics` renderer.
//!
//! Two kinds of metrics, two mechanisms:
//!
//! * **Events** (requests, rejections, latencies, token counts) are recorded where they happen
//!   through the `metrics` facade into one process-wide `metrics-exporter-prometheus` recorder,
//!   installed by [`install_recorder`] with per-metric histogram buckets.
//! * **State** (KV blocks, memory, sequences, queues, engine counters, per-step batch
//!   histograms) belongs to one engine and one admission instance. [`Metrics::render`] reads it
//!   fresh from `Engine::stats()`, `pool().snapshot()` and a [`QueueSource`] (admission) at
//!   scrape time and writes it directly ([`state`]), so a scrape is never stale and two servers
//!   in one test process never overwrite each other's gauges. Engine counters and the batch
//!   histograms ([`BATCH_SIZE`], [`BATCH_TOKENS`]) are the engine's cumulative totals over every
//!   step, hence monotonic and exact. The engine publishes its memory at spawn, so memory
//!   gauges are real from the first scrape.
//!
//! With `--metrics-compat vllm` the renderer also writes the vLLM names routers scrape
//! (`vllm:kv_cache_usage_perc`, `vllm:num_requests_waiting`, ...), see [`vllm`].

pub mod exposition;
mod handles;
mod names;
mod state;
mod vllm;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvgate_runtime::engine::Engine;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use parking_lot::Mutex;

pub use names::*;

// This module is a leaf of the gateway: admission, reload and the handlers record into it and
// hand it their state through the types below; it imports none of them (no import circles).

/// One tenant's queue and running requests, for metrics and `/admin` inspection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantQueueSnapshot {
    pub tenant: String,
    pub queued_requests: usize,
    pub queued_tokens: u64,
    pub in_flight: usize,
}

/// Whoever owns the queues (admission): their per-tenant state at scrape time, one row per
/// configured tenant, sorted by tenant.
pub trait QueueSource: Send + Sync {
    fn tenant_queues(&self) -> Vec<TenantQueueSnapshot>;
}

/// One upstream model's replicas as their circuit breakers stand now, for
/// [`UPSTREAM_CAPACITY_TOKENS`] and [`UPSTREAM_REPLICAS`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpstreamCapacitySnapshot {
    /// The configured model name.
    pub model: String,
    /// Declared capacity (tokens) of the healthy replicas.
    pub capacity_tokens: u64,
    pub healthy: usize,
    pub ejected: usize,
    pub half_open: usize,
}

/// Whoever owns the upstream replica pools: their state at scrape time, one row per model.
pub trait UpstreamSource: Send + Sync {
    fn upstream_capacity(&self) -> Vec<UpstreamCapacitySnapshot>;
}

/// Whether extra, foreign-named metrics are exported for tools built for another server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compat {
    #[default]
    None,
    /// vLLM's `vllm:` gauges and counters, for gateways (GIE EPP, llm-d) that scrape them.
    Vllm,
}

impl std::str::FromStr for Compat {
    type Err = MetricsError;
    fn from_str(text: &str) -> Result<Compat, MetricsError> {
        match text.trim().to_ascii_lowercase().as_str() {
            "none" | "off" | "" => Ok(Compat::None),
            "vllm" => Ok(Compat::Vllm),
            other => Err(MetricsError::UnknownCompat(other.to_string())),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("unknown --metrics-compat {0:?}: use none or vllm")]
    UnknownCompat(String),
    #[error("invalid histogram buckets for {name}: {reason}")]
    Buckets { name: &'static str, reason: String },
    #[error("another metrics recorder is already installed in this process")]
    ForeignRecorder,
}

/// Static facts about this server, shown in `kvgate_build_info` and the vLLM info metric.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MetricsConfig {
    pub compat: Compat,
    pub version: String,
    pub backend: String,
    /// Model name as served (also vLLM's `model_name` label).
    pub model: String,
    /// Memory the server may use (weights + KV + workspace); `None` when no budget was set.
    pub memory_budget_bytes: Option<u64>,
}

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
static INSTALL: Mutex<()> = Mutex::new(());

/// Whether kvgate's recorder is the process's (the request path then caches its handles).
fn recorder_installed() -> bool {
    HANDLE.get().is_some()
}

/// Installs the process-wide recorder (once; later calls return the same handle, so several
/// servers in one test process share it) and registers HELP texts.
pub fn install_recorder() -> Result<PrometheusHandle, MetricsError> {
    if let Some(handle) = HANDLE.get() {
        return Ok(handle.clone());
    }
    let _installing = INSTALL.lock();
    if let Some(handle) = HANDLE.get() {
        return Ok(handle.clone());
    }
    let handle = build_recorder()?;
    names::describe_all();
    Ok(HANDLE.get_or_init(|| handle).clone())
}

fn build_recorder() -> Result<PrometheusHandle, MetricsError> {
    let mut builder = PrometheusBuilder::new();
    for (name, buckets) in names::HISTOGRAM_BUCKETS {
        builder = builder
            .set_buckets_for_metric(Matcher::Full((*name).to_string()), buckets)
            .map_err(|e| MetricsError::Buckets {
                name,
                reason: e.to_string(),
            })?;
    }
    builder
        .install_recorder()
        .map_err(|_| MetricsError::ForeignRecorder)
}

/// Why a request was refused; the `reason` label of [`REQUESTS_REJECTED_TOTAL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// Missing or unknown API key (401).
    Auth,
    /// Prompt + max_tokens over the model context or the KV pool (400).
    Length,
    /// Over the tenant's request or token rate (429, retryable).
    Rate,
    /// The request alone exceeds the tenant's token bucket or queue token bound (429
    /// insufficient_quota, final).
    Quota,
    QueueFull,
    QueueTimeout,
    /// KV blocks are the bottleneck and the backlog will not drain in time (429).
    KvSaturation,
    /// The tenant's concurrency cap is the bottleneck and its queued requests will not get a
    /// slot in time (429).
    ConcurrencySaturation,
    /// Malformed or invalid request (400/404/422).
    BadRequest,
    /// Shutting down or the engine is gone (503).
    Unavailable,
}

impl RejectReason {
    pub const ALL: [RejectReason; 10] = [
        RejectReason::Auth,
        RejectReason::Length,
        RejectReason::Rate,
        RejectReason::Quota,
        RejectReason::QueueFull,
        RejectReason::QueueTimeout,
        RejectReason::KvSaturation,
        RejectReason::ConcurrencySaturation,
        RejectReason::BadRequest,
        RejectReason::Unavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::Auth => "auth",
            RejectReason::Length => "length",
            RejectReason::Rate => "rate",
            RejectReason::Quota => "quota",
            RejectReason::QueueFull => "queue_full",
            RejectReason::QueueTimeout => "queue_timeout",
            RejectReason::KvSaturation => "kv_saturation",
            RejectReason::ConcurrencySaturation => "concurrency_saturation",
            RejectReason::BadRequest => "bad_request",
            RejectReason::Unavailable => "unavailable",
        }
    }
}

/// Counts one refused request in [`REQUESTS_REJECTED_TOTAL`]. Call it exactly once per refused
/// request, at the place that decides the refusal (admission counts its own; the HTTP layer
/// counts auth, validation and length refusals it makes before admission).
pub fn record_rejection(tenant: &str, reason: RejectReason) {
    let labels = [("tenant", tenant), ("reason", reason.as_str())];
    handles::counter(REQUESTS_REJECTED_TOTAL, &labels).increment(1);
}

/// Counts one failed or timed-out call to the shared rate-limit store in
/// [`SHARED_STORE_ERRORS_TOTAL`], labelled with the `on_store_error` behaviour that decided
/// the request instead.
pub fn record_shared_store_error(tenant: &str, behaviour: &'static str) {
    let labels = [("tenant", tenant), ("behaviour", behaviour)];
    handles::counter(SHARED_STORE_ERRORS_TOTAL, &labels).increment(1);
}

/// Counts one cancel of a shared admission call that failed or timed out in
/// [`SHARED_COMPENSATIONS_TOTAL`], by `outcome` (undone, not_run, already_cancelled, failed, dropped).
pub fn record_shared_compensation(tenant: &str, outcome: &'static str) {
    let labels = [("tenant", tenant), ("outcome", outcome)];
    handles::counter(SHARED_COMPENSATIONS_TOTAL, &labels).increment(1);
}

/// How a request that reached a handler ended, for [`REQUESTS_TOTAL`]'s `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    Admitted,
    /// Refused: counted under a reason in [`REQUESTS_REJECTED_TOTAL`] too.
    Rejected,
    /// The server failed it (a 5xx that is no refusal: an internal error, a failed generation,
    /// a broken chat template, an upstream's server error).
    Failed,
    /// The handler never answered: the client went away (while the request was read,
    /// validated or queued), or the request timeout cut it (a 504).
    Abandoned,
}

impl RequestOutcome {
    pub fn label(self) -> &'static str {
        match self {
            RequestOutcome::Admitted => "admitted",
            RequestOutcome::Rejected => "rejected",
            RequestOutcome::Failed => "failed",
            RequestOutcome::Abandoned => "abandoned",
        }
    }
}

/// Counts one request in [`REQUESTS_TOTAL`] with its final outcome. Call it exactly once per
/// request that reached a handler; `route` is a static route name ("chat", ...).
pub fn record_request(tenant: &str, route: &'static str, outcome: RequestOutcome) {
    let labels = [
        ("tenant", tenant),
        ("route", route),
        ("outcome", outcome.label()),
    ];
    handles::counter(REQUESTS_TOTAL, &labels).increment(1);
}

/// Time a request spent in admission (queue + reservation) before it started.
pub fn record_queue_wait(tenant: &str, wait: Duration) {
    handles::histogram(QUEUE_WAIT_SECONDS, &[("tenant", tenant)]).record(wait.as_secs_f64());
}

/// From the request's arrival to its first generated token leaving the server. `model` is
/// the name the request was served under: the embedded model's or a configured upstream's,
/// never a client-supplied unknown name (those end in 404 before any token), so the label's
/// values are bounded by the configuration.
pub fn record_time_to_first_token(tenant: &str, model: &str, elapsed: Duration) {
    let labels = [("tenant", tenant), ("model", model)];
    handles::histogram(TIME_TO_FIRST_TOKEN_SECONDS, &labels).record(elapsed.as_secs_f64());
}

/// Gap between two successive tokens of one stream (labels as [`record_time_to_first_token`]).
pub fn record_inter_token_latency(tenant: &str, model: &str, gap: Duration) {
    let labels = [("tenant", tenant), ("model", model)];
    handles::histogram(INTER_TOKEN_LATENCY_SECONDS, &labels).record(gap.as_secs_f64());
}

/// A request that ran in the engine, or was relayed from an upstream, has ended (finished,
/// stopped, cancelled or failed); `model` as for [`record_time_to_first_token`].
pub fn record_request_finished(
    tenant: &str,
    model: &str,
    duration: Duration,
    prompt_tokens: usize,
    generation_tokens: usize,
    cached_tokens: Option<usize>,
) {
    let by_model = [("model", model)];
    handles::histogram(REQUEST_DURATION_SECONDS, &by_model).record(duration.as_secs_f64());
    handles::histogram(PROMPT_TOKENS, &by_model).record(prompt_tokens as f64);
    handles::histogram(GENERATION_TOKENS, &by_model).record(generation_tokens as f64);
    let by_tenant_model = [("tenant", tenant), ("model", model)];
    handles::counter(PROMPT_TOKENS_TOTAL, &by_tenant_model).increment(prompt_tokens as u64);
    handles::counter(GENERATION_TOKENS_TOTAL, &by_tenant_model).increment(generation_tokens as u64);
    // Only requests the engine finished report their cached tokens; a cancelled one's lookup
    // is not counted, so queries and hits stay a true ratio.
    if let Some(cached) = cached_tokens {
        let by_tenant = [("tenant", tenant)];
        handles::counter(PREFIX_CACHE_QUERIES_TOTAL, &by_tenant).increment(prompt_tokens as u64);
        handles::counter(PREFIX_CACHE_HITS_TOTAL, &by_tenant).increment(cached as u64);
    }
}

/// A policy file reload was attempted.
pub fn record_policy_reload(success: bool) {
    let result = if success { "success" } else { "failure" };
    metrics::counter!(POLICY_RELOADS_TOTAL, "result" => result).increment(1);
}

pub fn record_upstream_reload(success: bool) {
    let result = if success { "success" } else { "failure" };
    metrics::counter!(UPSTREAM_RELOADS_TOTAL, "result" => result).increment(1);
}

/// A replica of `upstream` at `replica` (its URL) was ejected (`ejected`) or readmitted.
pub fn record_breaker_transition(upstream: &str, replica: &str, ejected: bool) {
    let to = if ejected { "ejected" } else { "readmitted" };
    metrics::counter!(UPSTREAM_BREAKER_TOTAL, "upstream" => upstream.to_owned(),
                      "replica" => replica.to_owned(), "to" => to)
    .increment(1);
}

/// What became of one request sent to an upstream replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamResult {
    Ok,
    ClientError,
    ServerError,
    Unreachable,
}

/// One request sent to replica `replica` (its URL) of model `upstream`, answered (or not)
/// after `waited`.
pub fn record_upstream_attempt(
    upstream: &str,
    replica: &str,
    result: UpstreamResult,
    waited: Duration,
) {
    let result = match result {
        UpstreamResult::Ok => "ok",
        UpstreamResult::ClientError => "client_error",
        UpstreamResult::ServerError => "server_error",
        UpstreamResult::Unreachable => "unreachable",
    };
    let labels = [
        ("upstream", upstream),
        ("replica", replica),
        ("result", result),
    ];
    handles::counter(UPSTREAM_REQUESTS_TOTAL, &labels).increment(1);
    if result != "unreachable" {
        handles::histogram(UPSTREAM_RESPONSE_SECONDS, &[("upstream", upstream)])
            .record(waited.as_secs_f64());
    }
}

/// The `/metrics` renderer of one server: the shared recorder plus this server's engine and
/// admission state. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    handle: PrometheusHandle,
    config: MetricsConfig,
    engine: Engine,
    queues: Option<Arc<dyn QueueSource>>,
    upstreams: Option<Arc<dyn UpstreamSource>>,
    state: state::StateTracker,
}

impl Metrics {
    /// Installs the recorder if needed and binds it to this server's engine and queues
    /// (admission; `None` without one, e.g. `kvgate generate`).
    pub fn new(
        config: MetricsConfig,
        engine: Engine,
        queues: Option<Arc<dyn QueueSource>>,
    ) -> Result<Metrics, MetricsError> {
        Metrics::with_upstreams(config, engine, queues, None)
    }

    /// [`Metrics::new`], also reporting the capacity of the upstream models of `upstreams`.
    pub fn with_upstreams(
        config: MetricsConfig,
        engine: Engine,
        queues: Option<Arc<dyn QueueSource>>,
        upstreams: Option<Arc<dyn UpstreamSource>>,
    ) -> Result<Metrics, MetricsError> {
        let handle = install_recorder()?;
        Ok(Metrics {
            inner: Arc::new(Inner {
                handle,
                config,
                engine,
                queues,
                upstreams,
                state: state::StateTracker::default(),
            }),
        })
    }

    /// The full exposition: fresh engine and admission state, then the recorded events.
    pub fn render(&self) -> String {
        let inner = &self.inner;
        let snapshot = state::Snapshot::take(&inner.engine, inner.queues.as_deref());
        let mut out = exposition::Writer::default();
        inner.state.write(&mut out, &snapshot, &inner.config);
        if let Some(upstreams) = &inner.upstreams {
            state::write_upstreams(&mut out, &upstreams.upstream_capacity());
        }
        if inner.config.compat == Compat::Vllm {
            vllm::write(&mut out, &snapshot, &inner.config);
        }
        let mut text = out.finish();
        text.push_str(&inner.handle.render());
        text
    }

    /// Samples the engine every `interval`: keeps the memory peak between scrapes and runs the
    /// recorder's upkeep (which bounds the memory histograms use between scrapes). Batch sizes
    /// need no sampling: the engine counts every step itself. Stops when the returned handle is
    /// aborted.
    pub fn spawn_sampler(&self, interval: Duration) -> tokio::task::JoinHandle<()> {
        let metrics = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(10)));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                ticker.tick().await;
                let stats = metrics.inner.engine.stats();
                metrics.inner.state.sample(&stats);
                metrics.inner.handle.run_upkeep();
            }
        })
    }
}

#[cfg(test)]
mod tests;

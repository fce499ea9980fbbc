//! The HTTP server: [`ServeConfig`], the routes, and [`bind`] → [`Server::run`].
//!
//! Binding and running are separate so callers (main, the end-to-end tests) can listen on
//! port 0 and learn the real address from [`Server::local_addr`] before traffic starts.
//! [`bind_with_upstreams`] also serves the models of other engines (see `upstream.rs`).
//!
//! With `metrics_listen` set, a second listener serves the operator's routes (`/metrics`,
//! `/admin/kv`, detailed `/readyz`, `/healthz`), so they can sit on a loopback or
//! cluster-internal address while the API address is public; the API address then serves
//! only the API and the status-only probes. Without it, the API address serves everything (the
//! probes still without detail).
//!
//! Shutdown is two-step (see [`Server::run`]): readiness fails first, requests are still served
//! for `pre_drain`, then the listener closes and in-flight requests drain.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use kvgate_runtime::engine::Engine;
use kvgate_runtime::tokenizer::Tokenizer;
use tokio::net::TcpListener;

use crate::admission::{Admission, PoolId, engine_service_time};
use crate::generate;
use crate::handlers;
use crate::metrics::{Metrics, MetricsConfig, MetricsError, QueueSource, UpstreamSource};
use crate::reload::PolicyStore;
use crate::shutdown::{self, ConnectionLimits};
use crate::stack::{self, GatewayService, StackConfig};
use crate::state::{AppState, BodyLimits, StateParts};
use crate::upstream::{UpstreamError, Upstreams};
use crate::validate::PromptCodec;

/// Everything about how the server listens and treats connections.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    /// Serve `/metrics`, `/admin/kv` and the detailed probes here instead of on `listen`.
    pub metrics_listen: Option<SocketAddr>,
    /// The model id clients must send (`model` field) and `/v1/models` lists.
    pub model_name: String,
    /// Longest time to receive a request's headers, including idle keep-alive time.
    pub header_read_timeout: Duration,
    /// Longest stall of a body upload, or of a write the client does not read.
    pub idle_timeout: Duration,
    /// Longest time until response headers (covers non-streamed generation).
    pub request_timeout: Duration,
    pub body_limit_bytes: usize,
    /// After a shutdown signal: how long `/readyz` fails while requests are still accepted and
    /// served, so load balancers see it and stop routing here before the listener closes.
    pub pre_drain: Duration,
    /// How long in-flight requests (streams included) may take to finish after shutdown.
    pub shutdown_grace: Duration,
    /// API requests handled at once (until their response headers) before load shedding (503).
    pub max_in_flight: usize,
    pub max_connections: usize,
    /// Blocking threads that render templates and tokenize at once.
    pub validation_workers: usize,
    /// What `/metrics` reports about this server (`model` defaults to `model_name`).
    pub metrics: MetricsConfig,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            metrics_listen: None,
            model_name: "SmolLM2-135M-Instruct".to_owned(),
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(300),
            body_limit_bytes: 4 * 1024 * 1024,
            pre_drain: DEFAULT_PRE_DRAIN,
            shutdown_grace: Duration::from_secs(30),
            max_in_flight: 1024,
            max_connections: 4096,
            validation_workers: 2,
            metrics: MetricsConfig::default(),
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: io::Error },
    #[error("cannot set up metrics: {0}")]
    Metrics(#[from] MetricsError),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
}

/// Default pre-drain delay: a typical readiness probe period (Kubernetes probes every 10 s by
/// default; 5 s covers load balancers that probe faster and most deployments' preStop hooks).
pub const DEFAULT_PRE_DRAIN: Duration = Duration::from_secs(5);

/// How often the memory peak is sampled from the engine between scrapes (batch sizes need no
/// sampling: the engine counts every step).
const METRICS_SAMPLE_INTERVAL: Duration = Duration::from_millis(500);

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    service: GatewayService,
    /// The operator's listener and its service, when `metrics_listen` is set.
    operator: Option<(TcpListener, GatewayService)>,
    state: AppState,
    limits: ConnectionLimits,
    pre_drain: Duration,
}

/// Binds `config.listen` and builds the service; nothing is accepted until [`Server::run`].
pub async fn bind(
    config: &ServeConfig,
    engine: Engine,
    codec: Arc<dyn PromptCodec>,
    store: PolicyStore,
    admission: Admission,
) -> Result<Server, ServeError> {
    bind_with_upstreams(
        config,
        engine,
        codec,
        store,
        admission,
        Upstreams::default(),
    )
    .await
}

/// [`bind`], also proxying the models of `upstreams`. `admission` must gate their capacity
/// pools ([`Admission::with_pools`] with [`Upstreams::pools`]).
pub async fn bind_with_upstreams(
    config: &ServeConfig,
    engine: Engine,
    codec: Arc<dyn PromptCodec>,
    store: PolicyStore,
    admission: Admission,
    upstreams: Upstreams,
) -> Result<Server, ServeError> {
    let listener = listen(config.listen).await?;
    bind_on(listener, config, engine, codec, store, admission, upstreams).await
}

/// Binds `addr`. `kvgate serve` calls this before loading the model, so a taken port fails in
/// milliseconds, and hands the listener to [`bind_on`].
pub async fn listen(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// [`bind_with_upstreams`] on an already bound `listener` (`config.listen` is not used;
/// `config.metrics_listen`, if set, is bound here).
pub async fn bind_on(
    listener: TcpListener,
    config: &ServeConfig,
    engine: Engine,
    codec: Arc<dyn PromptCodec>,
    store: PolicyStore,
    admission: Admission,
    upstreams: Upstreams,
) -> Result<Server, ServeError> {
    // From here on a reload may also add models: each gets its own pool in `admission`.
    upstreams.attach(&config.model_name, &admission)?;
    // Replica scrapes and health probes run while the upstreams live (they end with them).
    upstreams.start_upkeep();
    let operator_listener = match config.metrics_listen {
        Some(addr) => Some(listen(addr).await?),
        None => None,
    };
    let mut metrics_config = config.metrics.clone();
    if metrics_config.model.is_empty() {
        metrics_config.model = config.model_name.clone();
    }
    let queues: Arc<dyn QueueSource> = Arc::new(admission.clone());
    let capacity: Arc<dyn UpstreamSource> = Arc::new(upstreams.clone());
    let metrics =
        Metrics::with_upstreams(metrics_config, engine.clone(), Some(queues), Some(capacity))?;
    let rate_view = admission.clone();
    // Until completions have measured a drain rate, forecasts and Retry-After estimates price
    // the queued work with the engine's step cost model (fitted at start, refitted every step).
    let probed = engine.clone();
    admission.set_service_time_probe(move || engine_service_time(&probed.stats()));
    // Never more requests in the engine than its submit queue takes: no `QueueFull` 503s.
    admission.limit_in_flight(PoolId::LOCAL, engine.config().command_queue);
    // Admission answers a request that cannot start in time before the request timeout does.
    admission.cap_queue_wait(config.request_timeout.mul_f64(0.9));
    let state = AppState::new(StateParts {
        engine,
        codec,
        store,
        admission,
        metrics,
        model_name: config.model_name.clone(),
        upstreams,
        body: BodyLimits {
            max_bytes: config.body_limit_bytes,
            idle_timeout: config.idle_timeout,
        },
        validation_workers: config.validation_workers,
    });
    let stack_config = StackConfig {
        request_timeout: config.request_timeout,
        body_limit_bytes: config.body_limit_bytes,
    };
    let operator = operator_listener.map(|listener| {
        let service = stack::build(
            operator_routes(state.clone()),
            stack_config,
            rate_view.clone(),
        );
        (listener, service)
    });
    let service = stack::build(
        api_routes(state.clone(), config.max_in_flight, operator.is_none()),
        stack_config,
        rate_view,
    );
    let limits = ConnectionLimits {
        header_read_timeout: config.header_read_timeout,
        idle_timeout: config.idle_timeout,
        max_connections: config.max_connections,
        shutdown_grace: config.shutdown_grace,
    };
    Ok(Server {
        listener,
        service,
        operator,
        state,
        limits,
        pre_drain: config.pre_drain,
    })
}

impl Server {
    /// The address actually bound (port 0 resolved).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The operator address actually bound, when `metrics_listen` was set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.operator
            .as_ref()
            .and_then(|(listener, _)| listener.local_addr().ok())
    }

    /// Serves until `shutdown` resolves; then readiness fails at once, requests are still
    /// accepted and served for the pre-drain delay, and only then the listener closes and
    /// in-flight requests drain within the grace period. The operator listener keeps serving
    /// (metrics of the drain included) until the drain is over.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        self.run_until(shutdown, std::future::pending()).await;
    }

    /// [`Server::run`] with a way to end the pre-drain early: once `hurry` resolves (after
    /// `shutdown`, e.g. a second signal, [`shutdown::Signals::second`]) the listener closes at
    /// once and the drain begins.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()>,
        hurry: impl Future<Output = ()>,
    ) {
        let state = self.state;
        let sampler = state.metrics().spawn_sampler(METRICS_SAMPLE_INTERVAL);
        if let Ok(addr) = self.listener.local_addr() {
            tracing::debug!(%addr, "serving");
        }
        let (operator_stop, operator_task) = match self.operator {
            Some((listener, service)) => {
                if let Ok(addr) = listener.local_addr() {
                    tracing::info!(%addr, "serving metrics and probes");
                }
                let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
                let task = tokio::spawn(shutdown::serve_until(
                    listener,
                    service,
                    self.limits,
                    async move {
                        let _ = stopped.await;
                    },
                    || {},
                    || {},
                ));
                (Some(stop), Some(task))
            }
            None => (None, None),
        };
        let pre_drain = self.pre_drain;
        let unready = state.clone();
        let shutdown = async move {
            shutdown.await;
            unready.begin_shutdown();
            if !pre_drain.is_zero() {
                tracing::info!(?pre_drain, "shutting down: not ready; still serving");
                tokio::select! {
                    () = tokio::time::sleep(pre_drain) => {}
                    () = hurry => tracing::info!("pre-drain cut short"),
                }
            }
        };
        let graceless = state.clone();
        shutdown::serve_until(
            self.listener,
            self.service,
            self.limits,
            shutdown,
            move || {
                state.start_draining();
            },
            move || graceless.end_grace(),
        )
        .await;
        if let (Some(stop), Some(task)) = (operator_stop, operator_task) {
            let _ = stop.send(());
            let _ = task.await;
        }
        sampler.abort();
        tracing::info!("drained; server stopped");
    }
}

/// Binds and serves until `shutdown` resolves (e.g. [`shutdown::signal`]), then drains.
/// `upstreams` may be empty; see [`bind_with_upstreams`].
pub async fn serve(
    config: ServeConfig,
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    store: PolicyStore,
    admission: Admission,
    upstreams: Upstreams,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let codec: Arc<dyn PromptCodec> = tokenizer;
    let server = bind_with_upstreams(&config, engine, codec, store, admission, upstreams).await?;
    server.run(shutdown).await;
    Ok(())
}

/// The API address's routes. Only the API routes are load-shed (see [`stack::api_limit`]).
/// The probes answer status only; `/metrics` and `/admin/kv` are here only when there is no
/// operator address (`with_operator_routes`).
fn api_routes(state: AppState, max_in_flight: usize, with_operator_routes: bool) -> Router {
    let router = Router::new()
        .route("/v1/chat/completions", post(generate::chat_completions))
        .route("/v1/completions", post(generate::completions))
        .route("/v1/models", get(handlers::list_models))
        .route_layer(stack::api_limit(max_in_flight))
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz));
    let router = if with_operator_routes {
        router
            .route("/metrics", get(handlers::metrics))
            .route("/admin/kv", get(handlers::admin_kv))
    } else {
        router
    };
    router
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .with_state(state)
}

/// The operator address's routes (`--metrics-listen`): metrics, the KV report, and the probes
/// with their detail.
fn operator_routes(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(handlers::metrics))
        .route("/admin/kv", get(handlers::admin_kv))
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz_detail))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .with_state(state)
}

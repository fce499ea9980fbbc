//! The state every handler shares, and the small handlers: models, health, readiness, metrics,
//! the KV report, and the JSON 404/405 fallbacks. The generation endpoints live in
//! `generate.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};
use kvgate_runtime::engine::Engine;
use tokio::sync::Semaphore;

use crate::admission::Admission;
use crate::error::GatewayError;
use crate::extract::Tenant;
use crate::inspect;
use crate::metrics::Metrics;
use crate::openai::{ModelCard, ModelList};
use crate::reload::PolicyStore;
use crate::upstream::UpstreamRoute;
use crate::validate::PromptCodec;

/// Everything the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub(crate) inner: Arc<StateInner>,
}

pub(crate) struct StateInner {
    pub(crate) engine: Engine,
    pub(crate) codec: Arc<dyn PromptCodec>,
    pub(crate) store: PolicyStore,
    pub(crate) admission: Admission,
    pub(crate) metrics: Metrics,
    pub(crate) model_name: String,
    /// Models served by other engines, proxied (see `upstream.rs`).
    pub(crate) upstreams: Vec<UpstreamRoute>,
    created: u64,
    body: BodyLimits,
    /// Tokenizing is CPU work on blocking threads; this bounds how many run at once.
    pub(crate) validation_slots: Semaphore,
    /// Set when shutdown begins: readiness fails and new generations are refused.
    draining: AtomicBool,
}

/// How request bodies are read.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub max_bytes: usize,
    /// Longest gap between two body frames before 408.
    pub idle_timeout: Duration,
}

/// What [`AppState::new`] needs.
pub struct StateParts {
    pub engine: Engine,
    pub codec: Arc<dyn PromptCodec>,
    pub store: PolicyStore,
    pub admission: Admission,
    pub metrics: Metrics,
    pub model_name: String,
    /// [`crate::upstream::Upstreams::routes`]; empty when this server fronts no other engine.
    pub upstreams: Vec<UpstreamRoute>,
    pub body: BodyLimits,
    pub validation_workers: usize,
}

impl AppState {
    pub fn new(parts: StateParts) -> AppState {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        AppState {
            inner: Arc::new(StateInner {
                engine: parts.engine,
                codec: parts.codec,
                store: parts.store,
                admission: parts.admission,
                metrics: parts.metrics,
                model_name: parts.model_name,
                upstreams: parts.upstreams,
                created,
                body: parts.body,
                validation_slots: Semaphore::new(parts.validation_workers.max(1)),
                draining: AtomicBool::new(false),
            }),
        }
    }

    pub fn policy_store(&self) -> &PolicyStore {
        &self.inner.store
    }

    pub fn body_limits(&self) -> BodyLimits {
        self.inner.body
    }

    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    pub fn admission(&self) -> &Admission {
        &self.inner.admission
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The upstream serving model `name`, if it is not the embedded model.
    pub fn upstream(&self, name: &str) -> Option<&UpstreamRoute> {
        self.inner
            .upstreams
            .iter()
            .find(|route| route.upstream().name() == name)
    }

    /// Marks the server as draining (called once shutdown begins).
    pub fn start_draining(&self) {
        self.inner.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }
}

/// `GET /v1/models`: the model this server runs, then every upstream model it proxies
/// (`owned_by: "upstream"`). The key must be valid (the `Tenant` extractor); the stack's
/// rate-limit layer adds the tenant's `x-ratelimit-*` headers.
pub async fn list_models(State(state): State<AppState>, Tenant(_tenant): Tenant) -> Response {
    let card = |id: &str, owned_by: &str| ModelCard {
        id: id.to_owned(),
        object: "model".to_owned(),
        created: state.inner.created,
        owned_by: owned_by.to_owned(),
    };
    let mut data = vec![card(&state.inner.model_name, "kvgate")];
    for route in &state.inner.upstreams {
        data.push(card(route.upstream().name(), "upstream"));
    }
    axum::Json(ModelList {
        object: "list".to_owned(),
        data,
    })
    .into_response()
}

/// `GET /healthz`: the process is up and serving HTTP.
pub async fn healthz() -> Response {
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}

/// `GET /readyz`: a policy is loaded, the engine thread is alive, and the server is not
/// draining. Load balancers stop sending here as soon as shutdown begins, and when the engine
/// thread has stopped (shut down or panicked): every generation would fail there.
pub async fn readyz(State(state): State<AppState>) -> Response {
    if state.is_draining() {
        return GatewayError::NotReady("shutting down".to_owned()).into_response();
    }
    if !state.inner.engine.is_running() {
        return GatewayError::NotReady("the inference engine is not running".to_owned())
            .into_response();
    }
    let policy = state.inner.store.current();
    let stats = state.inner.engine.stats();
    axum::Json(serde_json::json!({
        "status": "ready",
        "model": state.inner.model_name,
        "policy": policy.source().display().to_string(),
        "tenants": policy.tenants().count(),
        "engine": {"running": stats.running, "waiting": stats.waiting},
        "kv": state.inner.engine.pool().snapshot(),
    }))
    .into_response()
}

/// `GET /metrics`: Prometheus text exposition.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let text = state.inner.metrics.render();
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}

/// `GET /admin/kv`: per-sequence and per-tenant KV holdings (admin key required).
pub async fn admin_kv(State(state): State<AppState>, headers: HeaderMap) -> Response {
    match inspect::admin_kv(&state.inner.engine, &state.inner.admission, &headers) {
        Ok(report) => report.into_response(),
        Err(error) => error.into_response(),
    }
}

/// Unknown route: 404 JSON.
pub async fn not_found(method: Method, uri: Uri) -> GatewayError {
    GatewayError::NotFound {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

/// Known route, wrong method: 405 JSON.
pub async fn method_not_allowed(method: Method, uri: Uri) -> GatewayError {
    GatewayError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

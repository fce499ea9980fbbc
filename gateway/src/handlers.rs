//! The small handlers: models, health, readiness, metrics, the KV report, and the JSON 404/405
//! fallbacks. The generation endpoints live in `generate.rs`, the shared state in `state.rs`.
//!
//! The probes come in two forms. On the API address (public) they answer status only; the
//! detailed readiness (policy file, tenant count, engine and KV state) is served on the
//! metrics address (`--metrics-listen`), with `/metrics` and `/admin/kv`.

use axum::extract::State;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};

use crate::error::GatewayError;
use crate::extract::Tenant;
use crate::inspect;
use crate::openai::{ModelCard, ModelList};
use crate::state::{AppState, Phase};

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
    for upstream in state.upstreams().list().iter() {
        data.push(card(upstream.name(), "upstream"));
    }
    axum::Json(ModelList {
        object: "list".to_owned(),
        data,
    })
    .into_response()
}

/// `GET /healthz` (liveness): the process serves HTTP *and* its engine thread is alive. A
/// process whose engine died answers every generation with 503 and never recovers by itself:
/// failing liveness gets it restarted. (Load and draining do not fail it; see `/readyz`.)
pub async fn healthz(State(state): State<AppState>) -> Response {
    if !state.engine().is_running() {
        return GatewayError::EngineUnavailable("the inference engine has stopped".to_owned())
            .into_response();
    }
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}

/// `GET /readyz` on the API address: status only. Load balancers stop sending here as soon as
/// shutdown begins (before the listener closes; see `server.rs`), and when the engine thread
/// has stopped (shut down or panicked): every generation would fail there.
pub async fn readyz(State(state): State<AppState>) -> Response {
    match not_ready(&state) {
        Some(error) => error.into_response(),
        None => axum::Json(serde_json::json!({"status": "ready"})).into_response(),
    }
}

/// `GET /readyz` on the metrics address: the same verdict, with the detail an operator needs
/// (the policy file, how many tenants it has, engine and KV state) that the public probe must
/// not show.
pub async fn readyz_detail(State(state): State<AppState>) -> Response {
    if let Some(error) = not_ready(&state) {
        return error.into_response();
    }
    let policy = state.policy_store().current();
    let stats = state.engine().stats();
    axum::Json(serde_json::json!({
        "status": "ready",
        "model": state.inner.model_name,
        "policy": policy.source().display().to_string(),
        "tenants": policy.tenants().count(),
        "engine": {"running": stats.running, "waiting": stats.waiting},
        "kv": state.engine().pool().snapshot(),
    }))
    .into_response()
}

/// Why the server should get no new traffic, if it should not.
fn not_ready(state: &AppState) -> Option<GatewayError> {
    if state.phase() != Phase::Serving {
        return Some(GatewayError::NotReady("shutting down".to_owned()));
    }
    if !state.engine().is_running() {
        return Some(GatewayError::NotReady(
            "the inference engine is not running".to_owned(),
        ));
    }
    None
}

/// `GET /metrics`: Prometheus text exposition.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let text = state.metrics().render();
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}

/// `GET /admin/kv`: per-sequence and per-tenant KV holdings (admin key required).
pub async fn admin_kv(State(state): State<AppState>, headers: HeaderMap) -> Response {
    match inspect::admin_kv(state.engine(), state.admission(), &headers) {
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

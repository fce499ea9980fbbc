//! Route handlers, kept thin: authenticate (extractor) → parse (extractor) → validate →
//! admit → submit → respond. Each step is one call into the module that owns it; this file
//! only wires them together and decides which headers a response carries.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderValue, Method, Uri};
use axum::response::{IntoResponse, Response};
use kvgate_runtime::engine::{Engine, GenerationRequest, SamplingParams, StopParams};
use tokio::sync::Semaphore;

use crate::admission::{Admission, AdmissionTicket, Admitted};
use crate::error::GatewayError;
use crate::extract::{OpenAiJson, RequestId, Tenant};
use crate::openai::{ChatCompletionRequest, CompletionRequest, ModelCard, ModelList};
use crate::policy::TenantPolicy;
use crate::reload::PolicyStore;
use crate::stream::{ResponseMeta, collect, full_response, sse_body};
use crate::validate::{
    Limits, PromptCodec, ValidRequest, ValidationError, validate_chat, validate_completion,
};

/// Everything the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<StateInner>,
}

struct StateInner {
    engine: Engine,
    codec: Arc<dyn PromptCodec>,
    store: PolicyStore,
    admission: Admission,
    model_name: String,
    created: u64,
    body: BodyLimits,
    /// Tokenizing is CPU work on blocking threads; this bounds how many run at once.
    validation_slots: Semaphore,
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
    pub model_name: String,
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
                model_name: parts.model_name,
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

    /// Marks the server as draining (called once shutdown begins).
    pub fn start_draining(&self) {
        self.inner.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }
}

// === Generation ===

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    RequestId(request_id): RequestId,
    Tenant(tenant): Tenant,
    OpenAiJson(request): OpenAiJson<ChatCompletionRequest>,
) -> Response {
    let validate = move |limits: &Limits, codec: &dyn PromptCodec, model: &str| {
        validate_chat(&request, model, limits, codec)
    };
    respond(&state, &tenant, generate(&state, &tenant, request_id, validate).await)
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    RequestId(request_id): RequestId,
    Tenant(tenant): Tenant,
    OpenAiJson(request): OpenAiJson<CompletionRequest>,
) -> Response {
    let validate = move |limits: &Limits, codec: &dyn PromptCodec, model: &str| {
        validate_completion(&request, model, limits, codec)
    };
    respond(&state, &tenant, generate(&state, &tenant, request_id, validate).await)
}

/// Validation → admission → engine → response, for both generation endpoints.
async fn generate<F>(
    state: &AppState,
    tenant: &Arc<TenantPolicy>,
    request_id: String,
    validate: F,
) -> Result<Response, GatewayError>
where
    F: FnOnce(&Limits, &dyn PromptCodec, &str) -> Result<ValidRequest, ValidationError>
        + Send
        + 'static,
{
    if state.is_draining() {
        return Err(GatewayError::ShuttingDown);
    }
    let valid = validate_off_thread(state, tenant, validate).await?;
    let mut admitted = state
        .inner
        .admission
        .admit(AdmissionTicket {
            tenant: Arc::clone(tenant),
            prompt_tokens: valid.prompt_ids.len(),
            max_output_tokens: valid.max_tokens as usize,
            request_id,
        })
        .await?;
    let meta = ResponseMeta::new(valid.endpoint, &state.inner.model_name, valid.include_usage);
    let stream = valid.stream;
    let dropped = valid.dropped_messages;
    let handle = state
        .inner
        .engine
        .submit(generation_request(valid, &mut admitted, &tenant.name))
        .map_err(submit_error)?;
    let mut response = if stream {
        let headers = admitted.rate_headers();
        let mut response = sse_body(meta, handle, admitted);
        headers.apply(response.headers_mut());
        response
    } else {
        let collected = collect(handle, &mut admitted).await?;
        let mut response = full_response(&meta, collected);
        admitted.rate_headers().apply(response.headers_mut());
        response
    };
    if dropped > 0 {
        response
            .headers_mut()
            .insert("x-kvgate-dropped-messages", HeaderValue::from(dropped));
    }
    Ok(response)
}

/// Runs validation (template rendering and tokenization) on a blocking thread, bounded.
async fn validate_off_thread<F>(
    state: &AppState,
    tenant: &Arc<TenantPolicy>,
    validate: F,
) -> Result<ValidRequest, GatewayError>
where
    F: FnOnce(&Limits, &dyn PromptCodec, &str) -> Result<ValidRequest, ValidationError>
        + Send
        + 'static,
{
    let _slot = state
        .inner
        .validation_slots
        .acquire()
        .await
        .map_err(|_| GatewayError::ShuttingDown)?;
    let limits = tenant_limits(tenant, state.inner.engine.config().max_model_len);
    let codec = Arc::clone(&state.inner.codec);
    let model = state.inner.model_name.clone();
    let outcome = tokio::task::spawn_blocking(move || validate(&limits, codec.as_ref(), &model))
        .await
        .map_err(|error| GatewayError::Internal(format!("validation task failed: {error}")))?;
    Ok(outcome?)
}

/// The tenant's limits clipped by the model's context window.
pub fn tenant_limits(tenant: &TenantPolicy, model_context: usize) -> Limits {
    let clip = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Limits {
        max_input_tokens: clip(tenant.max_input_tokens),
        max_output_tokens: clip(tenant.max_output_tokens),
        max_total_tokens: clip(tenant.max_total_tokens),
        max_messages: clip(tenant.max_messages),
        overflow: tenant.overflow,
        model_context: clip(model_context),
    }
}

fn generation_request(
    valid: ValidRequest,
    admitted: &mut Admitted,
    tenant: &str,
) -> GenerationRequest {
    GenerationRequest {
        prompt: valid.prompt_ids,
        sampling: SamplingParams {
            temperature: valid.temperature,
            top_p: valid.top_p,
            top_k: 0,
            // Without a seed each request samples differently, as OpenAI does.
            seed: valid.seed.unwrap_or_else(rand::random),
        },
        stop: StopParams {
            max_tokens: valid.max_tokens as usize,
            stop_strings: valid.stop,
            ignore_eos: false,
        },
        reservation: admitted.take_reservation(),
        label: tenant.to_owned(),
    }
}

fn submit_error(error: kvgate_runtime::engine::SubmitError) -> GatewayError {
    use kvgate_runtime::engine::SubmitError;
    match error {
        SubmitError::QueueFull => GatewayError::EngineUnavailable(error.to_string()),
        SubmitError::ShutDown => GatewayError::ShuttingDown,
        // Validation and admission check both of these first: reaching them is our bug.
        SubmitError::TooLong { .. } | SubmitError::InvalidRequest(_) => {
            GatewayError::Internal(error.to_string())
        }
    }
}

/// Turns a handler outcome into a response; errors that never reached admission still carry
/// the tenant's rate-limit headers (a rejection carries its own).
fn respond(state: &AppState, tenant: &TenantPolicy, outcome: Result<Response, GatewayError>) -> Response {
    match outcome {
        Ok(response) => response,
        Err(error) => {
            let already_has_headers = matches!(error, GatewayError::Rejected(_));
            let mut response = error.into_response();
            if !already_has_headers {
                state.inner.admission.rate_headers(tenant).apply(response.headers_mut());
            }
            response
        }
    }
}

// === Models, health, fallbacks ===

/// `GET /v1/models`: the one model this server runs.
pub async fn list_models(State(state): State<AppState>, Tenant(tenant): Tenant) -> Response {
    let mut response = axum::Json(ModelList {
        object: "list".to_owned(),
        data: vec![ModelCard {
            id: state.inner.model_name.clone(),
            object: "model".to_owned(),
            created: state.inner.created,
            owned_by: "kvgate".to_owned(),
        }],
    })
    .into_response();
    state.inner.admission.rate_headers(&tenant).apply(response.headers_mut());
    response
}

/// `GET /healthz`: the process is up and serving HTTP.
pub async fn healthz() -> Response {
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}

/// `GET /readyz`: a policy is loaded and the server is not draining.
pub async fn readyz(State(state): State<AppState>) -> Response {
    if state.is_draining() {
        return GatewayError::NotReady("shutting down".to_owned()).into_response();
    }
    let policy = state.inner.store.current();
    axum::Json(serde_json::json!({
        "status": "ready",
        "model": state.inner.model_name,
        "tenants": policy.tenants().count(),
        "kv": state.inner.engine.pool().snapshot(),
    }))
    .into_response()
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

//! The two generation endpoints, kept thin: authenticate and per-tenant intake limits
//! (extractor, before the body) → parse (extractor) → validate → admit → submit → respond. Each step is one call into the module that owns it;
//! this file wires them together, decides which headers a response carries, and makes sure
//! everything a request holds is owned by something that dies with the client's connection.
//!
//! A request for an upstream model (`--upstream`) takes the same steps, with tiktoken counting
//! its prompt, the upstream's capacity pool in admission, and a forward to the upstream instead
//! of the engine ([`proxy`]).

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvgate_runtime::engine::{GenerationRequest, SamplingParams, StopParams, SubmitError};
use tokio::time::Instant;

use crate::admission::{AdmissionTicket, Admitted, PoolId, PromptPrefix};
use crate::auth::Credential;
use crate::error::GatewayError;
use crate::extract::{OpenAiBody, RequestId, TenantIntake};
use crate::intake::{INLINE_VALIDATION_BYTES, IntakePermit};
use crate::metrics::{
    RejectReason, RequestOutcome, UpstreamResult, record_queue_wait, record_rejection,
    record_request, record_upstream_attempt,
};
use crate::openai::{ChatCompletionRequest, CompletionRequest};
use crate::policy::TenantPolicy;
use crate::ratelimit::{RateLimitHeaders, RequestCell};
use crate::state::AppState;
use crate::stream::{ResponseMeta, collect, full_response, sse_body};
use crate::telemetry::GenerationTelemetry;
use crate::upstream::prefix::block_hashes;
use crate::upstream::{self, UpstreamRoute, UsageCell};
use crate::validate::{
    Engine, Limits, PromptCodec, ValidRequest, ValidationError, validate_chat, validate_completion,
};

/// Header naming how many old messages `truncate_oldest` dropped (absent when none).
pub const DROPPED_MESSAGES_HEADER: &str = "x-kvgate-dropped-messages";

type ValidateFn = Box<
    dyn FnOnce(&Limits, &dyn PromptCodec, &str) -> Result<ValidRequest, ValidationError> + Send,
>;

/// The validation of one request, and the size of its body (small ones validate inline).
struct Validator {
    run: ValidateFn,
    body_bytes: usize,
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    RequestId(request_id): RequestId,
    intake: TenantIntake,
    body: Result<OpenAiBody<ChatCompletionRequest>, GatewayError>,
) -> Response {
    generation(state, request_id, intake, body).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    RequestId(request_id): RequestId,
    intake: TenantIntake,
    body: Result<OpenAiBody<CompletionRequest>, GatewayError>,
) -> Response {
    generation(state, request_id, intake, body).await
}

/// Validates a parsed body for the model it will be served under (`validate.rs`).
type ValidateBody<B> =
    fn(&B, &str, &Limits, &dyn PromptCodec, Engine) -> Result<ValidRequest, ValidationError>;

/// What the two endpoints differ in: the body, the route label of their metrics, and the
/// validation of the body.
trait GenerationBody: Send + Sized + 'static {
    /// The `route` label of `kvgate_requests_total` and the other per-route series.
    const ROUTE: &'static str;
    const VALIDATE: ValidateBody<Self>;
    fn model(&self) -> &str;
}

impl GenerationBody for ChatCompletionRequest {
    const ROUTE: &'static str = "chat";
    const VALIDATE: ValidateBody<Self> = validate_chat;
    fn model(&self) -> &str {
        &self.model
    }
}

impl GenerationBody for CompletionRequest {
    const ROUTE: &'static str = "completions";
    const VALIDATE: ValidateBody<Self> = validate_completion;
    fn model(&self) -> &str {
        &self.model
    }
}

/// Either endpoint: counts the request under its route, and runs it (a parse error is
/// answered as it is).
async fn generation<B: GenerationBody>(
    state: AppState,
    request_id: String,
    TenantIntake {
        tenant,
        credential,
        permit,
        request: cell,
    }: TenantIntake,
    body: Result<OpenAiBody<B>, GatewayError>,
) -> Response {
    let arrived = Instant::now();
    let count = RequestCount::new(&tenant.name, B::ROUTE);
    let outcome = match body {
        Ok(OpenAiBody { request, raw }) => {
            let upstream = state.upstream(request.model());
            let engine = engine_for(upstream.as_ref());
            let validate = Validator {
                run: Box::new(move |limits, codec, model| {
                    B::VALIDATE(&request, model, limits, codec, engine)
                }),
                body_bytes: raw.len(),
            };
            run(
                &state,
                &tenant,
                (permit, cell, credential),
                (request_id, arrived),
                upstream.as_ref(),
                validate,
                raw,
            )
            .await
        }
        Err(error) => Err(error),
    };
    respond(count, &tenant, outcome)
}

/// Who answers a request for a model with this route: options the embedded engine cannot
/// honour are refused for it alone, and forwarded as written to an upstream engine.
fn engine_for(upstream: Option<&UpstreamRoute>) -> Engine {
    if upstream.is_some() {
        Engine::Upstream
    } else {
        Engine::Embedded
    }
}

/// Both endpoints after parsing: relayed to the model's upstream pool when it has one, else
/// served by the embedded engine.
async fn run(
    state: &AppState,
    tenant: &Arc<TenantPolicy>,
    intake: (IntakePermit, RequestCell, Credential),
    (request_id, arrived): (String, Instant),
    upstream: Option<&UpstreamRoute>,
    validate: Validator,
    raw: Bytes,
) -> Result<Response, GatewayError> {
    let work = async {
        match upstream {
            Some(route) => {
                proxy(
                    state,
                    tenant,
                    intake,
                    (request_id, arrived),
                    route,
                    validate,
                    raw,
                )
                .await
            }
            None => generate(state, tenant, intake, request_id, arrived, validate).await,
        }
    };
    // Until its headers: a request still validating, queued or (non-streamed) generating when
    // shutdown's grace period ends is answered 503 rather than cut off with its connection.
    // The work first: admission's own 503 for a queued request, or a stream's headers, win.
    let mut grace = state.grace_over();
    tokio::select! {
        biased;
        result = work => result,
        () = grace.wait() => Err(GatewayError::ShuttingDown),
    }
}

/// Validation → admission → engine → response, for both endpoints.
async fn generate(
    state: &AppState,
    tenant: &Arc<TenantPolicy>,
    (permit, cell, credential): (IntakePermit, RequestCell, Credential),
    request_id: String,
    arrived: Instant,
    validate: Validator,
) -> Result<Response, GatewayError> {
    if state.is_draining() {
        return Err(GatewayError::ShuttingDown);
    }
    let limits = tenant_limits(tenant, state.engine().config().max_model_len);
    let codec = Arc::clone(&state.inner.codec);
    let model = state.inner.model_name.clone();
    let valid = validate_off_thread(state, permit, limits, codec, model, validate).await?;
    let mut admitted = admit(
        state,
        (tenant, credential),
        &valid,
        cell,
        request_id,
        PoolId::LOCAL,
    )
    .await?;
    let meta = ResponseMeta::new(valid.endpoint, &state.inner.model_name, valid.include_usage);
    let telemetry = GenerationTelemetry::new(
        &tenant.name,
        &state.inner.model_name,
        arrived,
        valid.prompt_ids.len(),
    );
    let (stream, dropped) = (valid.stream, valid.dropped_messages);
    let rate_headers = admitted.rate_headers();
    let request = generation_request(valid, &mut admitted, tenant);
    let handle = match state.engine().submit(request) {
        Ok(handle) => {
            admitted.mark_started();
            handle
        }
        Err(error) => {
            // Never ran: the guard refunds the whole debit (the engine released the blocks).
            admitted.mark_failed_before_start();
            return Err(submit_error(error));
        }
    };

    let mut response = if stream {
        // The body now owns the handle, the admission guard and the telemetry.
        sse_body(meta, handle, admitted, Some(telemetry), state.grace_over())
    } else {
        // Owned by this future: if hyper drops it (client gone), the sequence is cancelled.
        let collected = collect(handle, &mut admitted, Some(telemetry)).await?;
        full_response(&meta, collected)
    };
    finish_headers(&mut response, &rate_headers, dropped);
    Ok(response)
}

/// Validation → admission (the model's capacity pool) → choose a replica → forward → relay,
/// for a model served by upstream engines. The upstream's context window is unknown here: the
/// tenant's limits apply to the tiktoken count, and the upstream enforces its own window (its
/// 400 is relayed). A replica that cannot be reached, answers nothing in time or answers 5xx
/// counts against its breaker, and the request goes to the next best replica (at most
/// [`upstream::MAX_ATTEMPTS`] in all): nothing has reached the client yet. An answer the
/// upstream runs is timed and counted under the tenant like an embedded one (`arrived` starts
/// its time to first token).
async fn proxy(
    state: &AppState,
    tenant: &Arc<TenantPolicy>,
    (permit, cell, credential): (IntakePermit, RequestCell, Credential),
    (request_id, arrived): (String, Instant),
    route: &UpstreamRoute,
    validate: Validator,
    raw: Bytes,
) -> Result<Response, GatewayError> {
    if state.is_draining() {
        return Err(GatewayError::ShuttingDown);
    }
    let upstream = route.upstream();
    let limits = tenant_limits(tenant, usize::MAX);
    let codec: Arc<dyn PromptCodec> = Arc::clone(upstream.counter()) as _;
    let model = upstream.name().to_owned();
    let valid = validate_off_thread(state, permit, limits, codec, model, validate).await?;
    let mut admitted = admit(
        state,
        (tenant, credential),
        &valid,
        cell,
        request_id.clone(),
        route.pool(),
    )
    .await?;
    let rate_headers = admitted.rate_headers();
    // Seeded by model and tenant: affinity never crosses tenants (see `upstream/prefix.rs`).
    let seed = format!("{}\u{0}{}", upstream.name(), tenant.name);
    let hashes = block_hashes(&seed, &valid.prompt_ids);
    let tokens = valid.prompt_ids.len() + valid.max_tokens as usize;
    let mut tried = Vec::new();
    let mut failure = None;
    // The last replica's 5xx, relayed as such if no other replica is left to try.
    let mut server_error = None;
    while tried.len() < upstream::MAX_ATTEMPTS {
        let Some(lease) = upstream.replicas().choose(&hashes, tokens, &tried) else {
            break;
        };
        let replica = Arc::clone(lease.replica());
        tried.push(replica.id());
        let body = match upstream::forwarded_body(&raw, &valid, &replica.spec().model) {
            Ok(body) => body,
            Err(error) => {
                admitted.mark_failed_before_start();
                return Err(error);
            }
        };
        // Owned by this future until the headers arrive: a client that leaves drops the
        // request (and the lease).
        let sent = Instant::now();
        let outcome = replica.send(valid.endpoint, body, &request_id).await;
        let result = match &outcome {
            Ok(answer) if answer.status().is_server_error() => UpstreamResult::ServerError,
            Ok(answer) if answer.status().is_success() => UpstreamResult::Ok,
            Ok(_) => UpstreamResult::ClientError,
            Err(_) => UpstreamResult::Unreachable,
        };
        record_upstream_attempt(upstream.name(), replica.base_url(), result, sent.elapsed());
        match outcome {
            Ok(answer) if answer.status().is_server_error() => {
                if replica.failed(&format!("answered {}", answer.status())) {
                    upstream.replicas().forget(replica.id());
                }
                server_error = Some((answer, lease));
            }
            Ok(answer) => {
                // The replica's breaker hears of this answer when its body ends (a stream
                // that breaks is a failure although its headers came): see `upstream::relay`.
                let telemetry = if answer.status().is_success() {
                    admitted.mark_started();
                    let prompt = valid.prompt_ids.len();
                    // Labelled by the configured name the client asked for (the route's).
                    let model = upstream.name();
                    // The upstream's reported usage counts at most the budget it was sent,
                    // as the debit settled on it does.
                    Some(
                        GenerationTelemetry::new(&tenant.name, model, arrived, prompt)
                            .capping_completion_at(valid.max_tokens as usize)
                            .capping_prompt_at(prompt.max(tenant.max_total_tokens)),
                    )
                } else {
                    admitted.mark_failed_before_start();
                    None
                };
                // The relayed body now owns the admission guard and the replica lease:
                // capacity and load are held until it ends, and the debit is settled on the
                // answer's reported usage then.
                let usage = UsageCell::default();
                let settle = SettleOnUsage {
                    admitted,
                    _lease: lease,
                    usage: usage.clone(),
                };
                let mut response = upstream::relay(
                    answer,
                    settle,
                    &replica,
                    usage,
                    telemetry,
                    state.grace_over(),
                );
                finish_headers(&mut response, &rate_headers, valid.dropped_messages);
                return Ok(response);
            }
            Err(error) => {
                if replica.failed("unreachable or no response in time") {
                    upstream.replicas().forget(replica.id());
                }
                failure = Some(error);
            }
        }
    }
    // Nothing started: slot, capacity and debit all come back when `admitted` drops.
    admitted.mark_failed_before_start();
    if let Some((answer, lease)) = server_error {
        let replica = Arc::clone(lease.replica());
        let usage = UsageCell::default();
        return Ok(upstream::relay(
            answer,
            (admitted, lease),
            &replica,
            usage,
            None,
            state.grace_over(),
        ));
    }
    Err(
        failure.unwrap_or_else(|| GatewayError::UpstreamUnavailable {
            upstream: upstream.name().to_owned(),
            reason: "every replica is ejected by its circuit breaker; retry shortly".to_owned(),
            detail: format!(
                "{} replicas, none available",
                upstream.replicas().replicas().len()
            ),
        }),
    )
}

/// The prompt and salt admission looks up in the embedded engine's prefix cache, under the
/// salt the engine will register the request's blocks with ([`generation_request`]). Upstream
/// pools cache nothing that admission could pin, nor does an engine run with caching off.
fn prompt_prefix(
    state: &AppState,
    tenant: &TenantPolicy,
    valid: &ValidRequest,
    pool: PoolId,
) -> Option<PromptPrefix> {
    if pool != PoolId::LOCAL || !state.engine().config().prefix_caching {
        return None;
    }
    let salt = tenant.prefix_cache.salt(&tenant.name)?;
    Some(PromptPrefix {
        salt: salt.into(),
        prompt_ids: valid.prompt_ids.as_slice().into(),
    })
}

/// What a relayed upstream body holds until it ends: the admission guard and the replica lease.
/// When it drops, a completion count the answer reported (`usage.completion_tokens`) settles
/// the token debit on it (the unused part of max_tokens is refunded); without one the whole
/// up-front charge stays, as for any unmetered body.
struct SettleOnUsage {
    admitted: Admitted,
    _lease: upstream::ReplicaLease,
    usage: UsageCell,
}

impl Drop for SettleOnUsage {
    fn drop(&mut self) {
        if let Some(completion_tokens) = self.usage.completion_tokens() {
            self.admitted.record_completion(completion_tokens);
        }
    }
}

/// Queues `valid` for `pool`'s capacity under the tenant's limits and records the wait. If the
/// client leaves while this waits, the future is dropped and admission unqueues the request.
async fn admit(
    state: &AppState,
    (tenant, credential): (&Arc<TenantPolicy>, Credential),
    valid: &ValidRequest,
    cell: RequestCell,
    request_id: String,
    pool: PoolId,
) -> Result<Admitted, GatewayError> {
    let ticket = AdmissionTicket {
        tenant: Arc::clone(tenant),
        credential,
        prompt_tokens: valid.prompt_ids.len(),
        max_output_tokens: valid.max_tokens as usize,
        prompt_param: valid.endpoint.prompt_param(),
        request_id,
        pool,
        prefix: prompt_prefix(state, tenant, valid, pool),
    };
    let admitted = state.admission().admit_prepaid(ticket, Some(cell)).await?;
    record_queue_wait(&tenant.name, admitted.queue_wait());
    Ok(admitted)
}

/// The rate-limit state at admission, and how many old turns `truncate_oldest` dropped.
fn finish_headers(response: &mut Response, rate_headers: &RateLimitHeaders, dropped: usize) {
    rate_headers.apply(response.headers_mut());
    if dropped > 0 {
        response
            .headers_mut()
            .insert(DROPPED_MESSAGES_HEADER, HeaderValue::from(dropped));
    }
}

/// Runs validation (template rendering and tokenization) on a blocking thread, when the
/// tenant's turn for a validation worker comes (fair between tenants; see `intake.rs`), so the
/// async workers never stall on CPU work; a small body (at most
/// [`INLINE_VALIDATION_BYTES`]) is validated on this task, its turn taken the same way. The
/// intake permit is released when it ends.
async fn validate_off_thread(
    state: &AppState,
    permit: IntakePermit,
    limits: Limits,
    codec: Arc<dyn PromptCodec>,
    model: String,
    validate: Validator,
) -> Result<ValidRequest, GatewayError> {
    let Validator { run, body_bytes } = validate;
    let job = move || run(&limits, codec.as_ref(), &model);
    let outcome = if body_bytes <= INLINE_VALIDATION_BYTES {
        state.intake().validate_inline(permit, job).await
    } else {
        state.intake().validate(permit, job).await
    };
    let outcome =
        outcome.ok_or_else(|| GatewayError::Internal("the validation task panicked".to_owned()))?;
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
    tenant: &TenantPolicy,
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
        // The engine shares prompt tokens between tenants by these.
        label: tenant.name.clone(),
        weight: tenant.weight,
        // From the authenticated tenant, never from the request: a caller who could choose
        // the salt could choose whose prompts to probe.
        cache_salt: tenant.prefix_cache.salt(&tenant.name),
    }
}

fn submit_error(error: SubmitError) -> GatewayError {
    match error {
        SubmitError::QueueFull => GatewayError::EngineUnavailable(error.to_string()),
        SubmitError::ShutDown => GatewayError::ShuttingDown,
        // Validation and admission check both of these first: reaching them is our bug.
        SubmitError::TooLong { .. } | SubmitError::InvalidRequest(_) => {
            GatewayError::Internal(error.to_string())
        }
    }
}

/// Counts a request in `kvgate_requests_total` exactly once: with its outcome when the handler
/// answers ([`respond`]), or as `abandoned` when the handler is dropped before that (the
/// client went away while its request was read, validated or queued, or the request timeout
/// cut it). Without it such requests were in no outcome at all.
struct RequestCount<'a> {
    tenant: &'a str,
    route: &'static str,
    counted: bool,
}

impl<'a> RequestCount<'a> {
    fn new(tenant: &'a str, route: &'static str) -> Self {
        RequestCount {
            tenant,
            route,
            counted: false,
        }
    }

    fn record(mut self, outcome: RequestOutcome) {
        record_request(self.tenant, self.route, outcome);
        self.counted = true;
    }
}

impl Drop for RequestCount<'_> {
    fn drop(&mut self) {
        if !self.counted {
            record_request(self.tenant, self.route, RequestOutcome::Abandoned);
        }
    }
}

/// Turns the outcome into a response and counts it. A rejection by the rate limits or the
/// queues carries that moment's `x-ratelimit-*` headers; every other error gets the tenant's
/// live state from the stack's rate-limit layer.
fn respond(
    count: RequestCount<'_>,
    tenant: &TenantPolicy,
    outcome: Result<Response, GatewayError>,
) -> Response {
    let error = match outcome {
        Ok(response) => {
            count.record(RequestOutcome::Admitted);
            return response;
        }
        Err(error) => error,
    };
    // Admission counts its own rejections; count the ones decided here.
    let reason = match &error {
        GatewayError::Rejected(_) => None,
        // A server fault (500), like an internal error: no refusal of the request.
        GatewayError::Invalid(ValidationError::BrokenTemplate(_)) => None,
        GatewayError::Invalid(invalid) if invalid.is_context_length() => Some(RejectReason::Length),
        GatewayError::Invalid(_) | GatewayError::BadBody { .. } => Some(RejectReason::BadRequest),
        GatewayError::PayloadTooLarge { .. }
        | GatewayError::BodyTimeout { .. }
        | GatewayError::UnsupportedEncoding { .. } => Some(RejectReason::BadRequest),
        GatewayError::ShuttingDown
        | GatewayError::EngineUnavailable(_)
        | GatewayError::UpstreamUnavailable { .. } => Some(RejectReason::Unavailable),
        _ => None,
    };
    if let Some(reason) = reason {
        record_rejection(&tenant.name, reason);
    }
    // A server fault (an internal error, a failed generation, a broken template, an upstream's
    // 5xx) refused nothing: it is counted as failed, so every `rejected` request has a reason.
    let refused = reason.is_some() || matches!(error, GatewayError::Rejected(_));
    let outcome = if !refused && error.status().is_server_error() {
        RequestOutcome::Failed
    } else {
        RequestOutcome::Rejected
    };
    count.record(outcome);
    error.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::exposition::Scrape;
    use crate::metrics::install_recorder;
    use crate::metrics::{REQUESTS_REJECTED_TOTAL, REQUESTS_TOTAL};

    /// Every `rejected` request has a reason; a server fault is `failed`, not a refusal (QA: a
    /// 500 was counted as rejected with no reason, so the two counters disagreed).
    #[test]
    fn a_server_fault_is_counted_as_failed_and_a_refusal_under_its_reason() {
        let handle = install_recorder().unwrap_or_else(|e| panic!("{e}"));
        let policy = crate::policy::parse_policy("t.toml", "[tenants.respond-outcomes]\n")
            .unwrap_or_else(|e| panic!("{e}"));
        let tenant = policy.tenant("respond-outcomes").expect("the tenant");
        let name = tenant.name.as_str();
        let fault = GatewayError::Internal("a bug".into());
        let refusal = GatewayError::BadBody {
            message: "not JSON".into(),
            param: None,
        };
        assert_eq!(
            respond(RequestCount::new(name, "chat"), &tenant, Err(fault)).status(),
            500
        );
        assert_eq!(
            respond(RequestCount::new(name, "chat"), &tenant, Err(refusal)).status(),
            400
        );
        let scrape = Scrape::parse(&handle.render()).unwrap_or_else(|e| panic!("{e}"));
        let outcome = |outcome| {
            let labels = [("tenant", name), ("route", "chat"), ("outcome", outcome)];
            scrape.value(REQUESTS_TOTAL, &labels)
        };
        assert_eq!(outcome("failed"), Some(1.0));
        assert_eq!(outcome("rejected"), Some(1.0));
        let reasons = scrape.sum(REQUESTS_REJECTED_TOTAL, &[("tenant", name)]);
        assert_eq!(reasons, 1.0, "one reason per rejected request");
    }
}

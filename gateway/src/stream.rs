//! Token events → OpenAI responses: one JSON body ([`collect`]), or SSE chunks ([`sse_body`]).
//!
//! Lifetimes are the point of this file. The SSE stream owns the [`GenerationHandle`] and the
//! admission guard, so the concurrency slot and the KV reservation live exactly as long as the
//! response *body*, not just until its headers (tower's `ConcurrencyLimit` gets this wrong for
//! streams). When the client goes away, hyper drops the body, which drops the handle (the engine
//! cancels the sequence) and the guard (admission gets its slot back). Both are released as soon
//! as `Finished` arrives, so a slow reader of the last few bytes holds nothing.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use kvgate_runtime::engine::{FinishReason as EngineFinish, GenerationHandle, TokenEvent};
use rand::Rng;
use rand::distr::Alphanumeric;

use crate::admission::Admitted;
use crate::error::GatewayError;
use crate::openai::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChunkChoice, Delta,
    FinishReason, TextChoice, TextCompletion, Usage,
};
use crate::shutdown::GraceOver;
use crate::telemetry::GenerationTelemetry;
use crate::validate::Endpoint;

/// Something that must live as long as the response body and learns how it ended.
pub trait BodyGuard: Send + 'static {
    /// Called once per generated token, so a response cut short is charged what it used.
    fn record_generated(&mut self) {}

    /// Called once, when generation finished normally.
    fn record_completion(&mut self, completion_tokens: usize);
}

impl BodyGuard for Admitted {
    fn record_generated(&mut self) {
        Admitted::record_generated(self);
    }

    fn record_completion(&mut self, completion_tokens: usize) {
        Admitted::record_completion(self, completion_tokens);
    }
}

/// The fields every response object of one request shares.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
    pub include_usage: bool,
}

impl ResponseMeta {
    /// A fresh `chatcmpl-…` / `cmpl-…` id stamped with the current time.
    pub fn new(endpoint: Endpoint, model: &str, include_usage: bool) -> ResponseMeta {
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completion => "cmpl-",
        };
        let suffix: String = rand::rng()
            .sample_iter(&Alphanumeric)
            .take(24)
            .map(char::from)
            .collect();
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs());
        ResponseMeta {
            id: format!("{prefix}{suffix}"),
            created,
            model: model.to_owned(),
            endpoint,
            include_usage,
        }
    }
}

/// A finished non-streaming generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    pub text: String,
    pub finish_reason: FinishReason,
    pub usage: Usage,
}

/// Waits for the whole generation. If the client disconnects, hyper drops the future that
/// awaits this, which drops `handle` and cancels the sequence: nothing outlives the request.
pub async fn collect(
    mut handle: GenerationHandle,
    guard: &mut impl BodyGuard,
    mut telemetry: Option<GenerationTelemetry>,
) -> Result<Collected, GatewayError> {
    let mut text = String::new();
    while let Some(event) = handle.events.recv().await {
        match event {
            TokenEvent::Token { text: delta, .. } => {
                guard.record_generated();
                if let Some(telemetry) = telemetry.as_mut() {
                    telemetry.on_token();
                }
                text.push_str(&delta);
            }
            TokenEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                guard.record_completion(completion_tokens);
                if let Some(telemetry) = telemetry.as_mut() {
                    telemetry.on_finished(completion_tokens, cached_tokens);
                }
                return Ok(Collected {
                    text,
                    finish_reason: finish_reason(reason),
                    usage: usage(prompt_tokens, completion_tokens, cached_tokens),
                });
            }
            TokenEvent::Error(message) => return Err(GatewayError::Generation(message)),
        }
    }
    Err(interrupted())
}

/// The non-streaming JSON answer for `collected`.
pub fn full_response(meta: &ResponseMeta, collected: Collected) -> Response {
    match meta.endpoint {
        Endpoint::Chat => axum::Json(ChatCompletion {
            id: meta.id.clone(),
            object: "chat.completion".to_owned(),
            created: meta.created,
            model: meta.model.clone(),
            system_fingerprint: None,
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant".to_owned(),
                    content: collected.text,
                },
                logprobs: None,
                finish_reason: collected.finish_reason,
            }],
            usage: collected.usage,
        })
        .into_response(),
        Endpoint::Completion => axum::Json(TextCompletion {
            id: meta.id.clone(),
            object: "text_completion".to_owned(),
            created: meta.created,
            model: meta.model.clone(),
            system_fingerprint: None,
            choices: vec![TextChoice {
                text: collected.text,
                index: 0,
                logprobs: None,
                finish_reason: Some(collected.finish_reason),
            }],
            usage: Some(Some(collected.usage)),
        })
        .into_response(),
    }
}

/// The SSE response: a role chunk (chat), one chunk per text delta, a finish chunk, the usage
/// chunk when asked for, then `data: [DONE]`. A failure after the headers went out is sent as
/// an OpenAI error event and ends the stream (no `[DONE]`); so is the end of shutdown's grace
/// period (`grace`) while the stream still runs: 503-style `shutting_down`, then the end.
pub fn sse_body<G: BodyGuard>(
    meta: ResponseMeta,
    handle: GenerationHandle,
    guard: G,
    telemetry: Option<GenerationTelemetry>,
    grace: GraceOver,
) -> Response {
    Sse::new(event_stream(meta, handle, guard, telemetry, grace))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Where the stream is. Each step of [`event_stream`] emits exactly one event.
enum Phase {
    Start,
    Streaming,
    Usage(Usage),
    Done,
    Ended,
}

struct StreamState<G> {
    meta: ResponseMeta,
    /// `None` once generation ended: dropping it early frees the sequence promptly.
    handle: Option<GenerationHandle>,
    guard: Option<G>,
    telemetry: Option<GenerationTelemetry>,
    /// Shutdown's grace period is over: a running stream sends an error event and ends.
    grace: GraceOver,
    phase: Phase,
}

fn event_stream<G: BodyGuard>(
    meta: ResponseMeta,
    handle: GenerationHandle,
    guard: G,
    telemetry: Option<GenerationTelemetry>,
    grace: GraceOver,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let state = StreamState {
        meta,
        handle: Some(handle),
        guard: Some(guard),
        telemetry,
        grace,
        phase: Phase::Start,
    };
    futures::stream::unfold(state, |mut state| async move {
        let event = state.next_event().await?;
        Some((Ok(event), state))
    })
}

impl<G: BodyGuard> StreamState<G> {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            match std::mem::replace(&mut self.phase, Phase::Ended) {
                Phase::Start => {
                    self.phase = Phase::Streaming;
                    if self.meta.endpoint == Endpoint::Chat {
                        let role = Delta {
                            role: Some("assistant".to_owned()),
                            content: Some(String::new()),
                        };
                        return Some(self.chunk(role, None));
                    }
                }
                Phase::Streaming => {
                    let event = match self.handle.as_mut() {
                        // The grace first: an engine that keeps producing tokens must not
                        // keep the stream past it.
                        Some(handle) => tokio::select! {
                            biased;
                            () = self.grace.wait() => Err(()),
                            event = handle.events.recv() => Ok(event),
                        },
                        None => Ok(None),
                    };
                    let Ok(event) = event else {
                        return Some(self.fail(GatewayError::ShuttingDown));
                    };
                    self.phase = Phase::Streaming;
                    if let Some(TokenEvent::Token { .. }) = &event {
                        if let Some(guard) = self.guard.as_mut() {
                            guard.record_generated();
                        }
                        if let Some(telemetry) = self.telemetry.as_mut() {
                            telemetry.on_token();
                        }
                    }
                    match event {
                        // Held-back bytes and special tokens produce no text: nothing to send.
                        Some(TokenEvent::Token { text, .. }) if text.is_empty() => continue,
                        Some(TokenEvent::Token { text, .. }) => {
                            return Some(self.chunk(text_delta(text), None));
                        }
                        Some(TokenEvent::Finished {
                            reason,
                            prompt_tokens,
                            completion_tokens,
                            cached_tokens,
                        }) => {
                            self.release(Some((completion_tokens, cached_tokens)));
                            let usage = usage(prompt_tokens, completion_tokens, cached_tokens);
                            self.phase = if self.meta.include_usage {
                                Phase::Usage(usage)
                            } else {
                                Phase::Done
                            };
                            let reason = Some(finish_reason(reason));
                            return Some(self.chunk(Delta::default(), reason));
                        }
                        Some(TokenEvent::Error(message)) => {
                            return Some(self.fail(GatewayError::Generation(message)));
                        }
                        None => return Some(self.fail(interrupted())),
                    }
                }
                Phase::Usage(usage) => {
                    self.phase = Phase::Done;
                    return Some(self.usage_chunk(usage));
                }
                Phase::Done => return Some(Event::default().data("[DONE]")),
                Phase::Ended => return None,
            }
        }
    }

    /// Gives back the sequence and the admission guard; records the completion if known
    /// (`finished`: completion tokens and cached prompt tokens, from the engine).
    fn release(&mut self, finished: Option<(usize, usize)>) {
        drop(self.handle.take());
        if let Some((n, cached)) = finished {
            if let Some(guard) = self.guard.as_mut() {
                guard.record_completion(n);
            }
            if let Some(telemetry) = self.telemetry.as_mut() {
                telemetry.on_finished(n, cached);
            }
        }
        drop(self.guard.take());
        drop(self.telemetry.take());
    }

    fn fail(&mut self, error: GatewayError) -> Event {
        if matches!(error, GatewayError::ShuttingDown) {
            tracing::warn!(id = %self.meta.id, "grace period over: ending a running stream");
        } else {
            tracing::error!(
                error = %error,
                detail = error.detail().unwrap_or(""),
                id = %self.meta.id,
                "stream failed after it started"
            );
        }
        self.release(None);
        self.phase = Phase::Ended;
        error.sse_event()
    }

    /// One content chunk (chat: a delta; completions: a text choice).
    fn chunk(&self, delta: Delta, finish: Option<FinishReason>) -> Event {
        let usage = self.meta.include_usage.then_some(None);
        match self.meta.endpoint {
            Endpoint::Chat => json_event(&ChatCompletionChunk {
                id: self.meta.id.clone(),
                object: "chat.completion.chunk".to_owned(),
                created: self.meta.created,
                model: self.meta.model.clone(),
                system_fingerprint: None,
                choices: vec![ChunkChoice {
                    index: 0,
                    delta,
                    logprobs: None,
                    finish_reason: finish,
                }],
                usage,
            }),
            Endpoint::Completion => json_event(&TextCompletion {
                id: self.meta.id.clone(),
                object: "text_completion".to_owned(),
                created: self.meta.created,
                model: self.meta.model.clone(),
                system_fingerprint: None,
                choices: vec![TextChoice {
                    text: delta.content.unwrap_or_default(),
                    index: 0,
                    logprobs: None,
                    finish_reason: finish,
                }],
                usage,
            }),
        }
    }

    /// The `stream_options.include_usage` chunk: no choices, just the usage.
    fn usage_chunk(&self, usage: Usage) -> Event {
        let meta = &self.meta;
        match meta.endpoint {
            Endpoint::Chat => json_event(&ChatCompletionChunk {
                id: meta.id.clone(),
                object: "chat.completion.chunk".to_owned(),
                created: meta.created,
                model: meta.model.clone(),
                system_fingerprint: None,
                choices: Vec::new(),
                usage: Some(Some(usage)),
            }),
            Endpoint::Completion => json_event(&TextCompletion {
                id: meta.id.clone(),
                object: "text_completion".to_owned(),
                created: meta.created,
                model: meta.model.clone(),
                system_fingerprint: None,
                choices: Vec::new(),
                usage: Some(Some(usage)),
            }),
        }
    }
}

fn text_delta(text: String) -> Delta {
    Delta {
        role: None,
        content: Some(text),
    }
}

fn json_event(value: &impl serde::Serialize) -> Event {
    match serde_json::to_string(value) {
        Ok(json) => Event::default().data(json),
        Err(error) => {
            let error = GatewayError::Internal(format!("cannot serialize a chunk: {error}"));
            error.log(error.status());
            error.sse_event()
        }
    }
}

fn finish_reason(reason: EngineFinish) -> FinishReason {
    match reason {
        EngineFinish::Stop => FinishReason::Stop,
        EngineFinish::Length => FinishReason::Length,
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Usage {
    let clip = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Usage::new(clip(prompt_tokens), clip(completion_tokens)).with_cached_tokens(clip(cached_tokens))
}

fn interrupted() -> GatewayError {
    GatewayError::Generation("the engine stopped before the generation finished".to_owned())
}

#[cfg(test)]
mod tests;

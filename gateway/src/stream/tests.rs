//! Shapes and lifetimes of streamed and collected responses, driven by hand-fed token events.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use http_body_util::BodyExt;
use kvgate_runtime::engine::{FinishReason as EngineFinish, GenerationHandle, SeqId, TokenEvent};
use serde_json::Value;
use tokio::sync::mpsc;

use super::*;

/// Records what the stream did with it.
#[derive(Clone, Default)]
struct Probe {
    completion: Arc<AtomicUsize>,
    dropped: Arc<AtomicBool>,
}

struct FakeGuard(Probe);

impl BodyGuard for FakeGuard {
    fn record_completion(&mut self, completion_tokens: usize) {
        self.0
            .completion
            .store(completion_tokens + 1, Ordering::SeqCst);
    }
}

impl Drop for FakeGuard {
    fn drop(&mut self) {
        self.0.dropped.store(true, Ordering::SeqCst);
    }
}

fn handle(events: Vec<TokenEvent>) -> (GenerationHandle, mpsc::Sender<TokenEvent>) {
    let (tx, rx) = mpsc::channel(64);
    for event in events {
        tx.try_send(event).unwrap();
    }
    (
        GenerationHandle {
            id: SeqId(1),
            events: rx,
        },
        tx,
    )
}

fn token(text: &str) -> TokenEvent {
    TokenEvent::Token {
        id: 5,
        text: text.to_owned(),
    }
}

fn finished(reason: EngineFinish, completion_tokens: usize) -> TokenEvent {
    TokenEvent::Finished {
        reason,
        prompt_tokens: 7,
        completion_tokens,
        cached_tokens: 4,
    }
}

/// The `data:` payloads of an SSE body, in order (keep-alive comments skipped).
async fn sse_data(response: Response) -> Vec<String> {
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    text.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

fn json(data: &str) -> Value {
    serde_json::from_str(data).unwrap()
}

#[tokio::test]
async fn chat_stream_has_role_deltas_finish_usage_and_done() {
    let probe = Probe::default();
    let events = vec![
        token("Hel"),
        token(""),
        token("lo"),
        finished(EngineFinish::Stop, 3),
    ];
    let (handle, tx) = handle(events);
    drop(tx);
    let meta = ResponseMeta::new(Endpoint::Chat, "m", true);
    let data = sse_data(sse_body(
        meta,
        handle,
        FakeGuard(probe.clone()),
        None,
        GraceOver::never(),
    ))
    .await;

    assert_eq!(data.len(), 6, "{data:?}"); // role, "Hel", "lo", finish, usage, [DONE]
    let first = json(&data[0]);
    assert!(first["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["usage"], Value::Null);
    assert!(first.as_object().unwrap().contains_key("usage"));
    assert_eq!(json(&data[1])["choices"][0]["delta"]["content"], "Hel");
    assert_eq!(json(&data[2])["choices"][0]["delta"]["content"], "lo");
    let finish = json(&data[3]);
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    assert_eq!(finish["choices"][0]["delta"], serde_json::json!({}));
    let usage = json(&data[4]);
    assert_eq!(usage["choices"], serde_json::json!([]));
    assert_eq!(
        usage["usage"],
        serde_json::json!({
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 4}
        })
    );
    assert_eq!(data[5], "[DONE]");
    assert_eq!(probe.completion.load(Ordering::SeqCst), 4);
    assert!(probe.dropped.load(Ordering::SeqCst));
}

#[tokio::test]
async fn completion_stream_without_usage_omits_the_field() {
    let (handle, tx) = handle(vec![token("a"), finished(EngineFinish::Length, 1)]);
    drop(tx);
    let meta = ResponseMeta::new(Endpoint::Completion, "m", false);
    let data = sse_data(sse_body(
        meta,
        handle,
        FakeGuard(Probe::default()),
        None,
        GraceOver::never(),
    ))
    .await;
    assert_eq!(data.len(), 3, "{data:?}"); // "a", finish, [DONE]: no role chunk for completions
    let first = json(&data[0]);
    assert!(first["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["text"], "a");
    assert!(!first.as_object().unwrap().contains_key("usage"));
    assert_eq!(json(&data[1])["choices"][0]["finish_reason"], "length");
    assert_eq!(data[2], "[DONE]");
}

#[tokio::test]
async fn an_error_after_the_start_is_an_openai_error_event_without_done() {
    let probe = Probe::default();
    let (handle, tx) = handle(vec![
        token("a"),
        TokenEvent::Error("backend failure".into()),
    ]);
    drop(tx);
    let meta = ResponseMeta::new(Endpoint::Chat, "m", false);
    let data = sse_data(sse_body(
        meta,
        handle,
        FakeGuard(probe.clone()),
        None,
        GraceOver::never(),
    ))
    .await;
    let last = json(data.last().unwrap());
    assert_eq!(last["error"]["type"], "server_error");
    // The engine's message is logged, not sent.
    assert!(
        !last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("backend failure")
    );
    assert_eq!(last["error"]["code"], "generation_failed");
    assert!(!data.contains(&"[DONE]".to_owned()));
    assert_eq!(
        probe.completion.load(Ordering::SeqCst),
        0,
        "no completion recorded on failure"
    );
    assert!(probe.dropped.load(Ordering::SeqCst));
}

#[tokio::test]
async fn a_stream_cut_short_by_the_engine_ends_with_an_error_event() {
    let (handle, tx) = handle(vec![token("a")]);
    drop(tx); // no Finished ever comes
    let meta = ResponseMeta::new(Endpoint::Chat, "m", false);
    let data = sse_data(sse_body(
        meta,
        handle,
        FakeGuard(Probe::default()),
        None,
        GraceOver::never(),
    ))
    .await;
    assert_eq!(
        json(data.last().unwrap())["error"]["code"],
        "generation_failed"
    );
}

#[tokio::test]
async fn dropping_the_body_cancels_the_sequence_and_frees_the_guard() {
    let probe = Probe::default();
    let (handle, tx) = handle(vec![token("a")]);
    let meta = ResponseMeta::new(Endpoint::Chat, "m", false);
    let mut body = sse_body(
        meta,
        handle,
        FakeGuard(probe.clone()),
        None,
        GraceOver::never(),
    )
    .into_body();
    // Read the role chunk and the first delta, then the client goes away.
    let _ = body.frame().await.unwrap().unwrap();
    let _ = body.frame().await.unwrap().unwrap();
    assert!(!tx.is_closed());
    drop(body);
    assert!(
        tx.is_closed(),
        "the engine sees the receiver closed: the sequence is cancelled"
    );
    assert!(probe.dropped.load(Ordering::SeqCst));
}

#[tokio::test]
async fn collect_joins_text_and_reports_usage() {
    let probe = Probe::default();
    let (handle, _tx) = handle(vec![
        token("Hi"),
        token(" there"),
        finished(EngineFinish::Stop, 2),
    ]);
    let mut guard = FakeGuard(probe.clone());
    let collected = collect(handle, &mut guard, None).await.unwrap();
    assert_eq!(collected.text, "Hi there");
    assert_eq!(collected.finish_reason, FinishReason::Stop);
    assert_eq!(collected.usage.total_tokens, 9);
    let details = collected.usage.prompt_tokens_details;
    assert_eq!(details.map(|d| d.cached_tokens), Some(4));
    assert_eq!(probe.completion.load(Ordering::SeqCst), 3);

    let meta = ResponseMeta::new(Endpoint::Chat, "m", false);
    let bytes = full_response(&meta, collected)
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes();
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(
        body["choices"][0]["message"],
        serde_json::json!({"role": "assistant", "content": "Hi there"})
    );
    assert_eq!(body["choices"][0]["logprobs"], Value::Null);
    assert_eq!(body["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn collect_turns_engine_errors_into_generation_failures() {
    let (handle, _tx) = handle(vec![TokenEvent::Error("boom".into())]);
    let err = collect(handle, &mut FakeGuard(Probe::default()), None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("generation_failed"));
}

#[tokio::test]
async fn the_end_of_the_grace_period_ends_a_running_stream_with_an_error_event() {
    let probe = Probe::default();
    // The engine keeps the sequence running (the sender stays open): it would never end.
    let (handle, tx) = handle(vec![token("a")]);
    let (over, grace) = tokio::sync::watch::channel(false);
    let meta = ResponseMeta::new(Endpoint::Chat, "m", false);
    let body = sse_body(
        meta,
        handle,
        FakeGuard(probe.clone()),
        None,
        GraceOver::new(grace),
    );
    let mut body = body.into_body();
    // The role chunk and the token already generated are sent as usual.
    let _ = body.frame().await.unwrap().unwrap();
    let _ = body.frame().await.unwrap().unwrap();
    over.send_replace(true);
    let rest = body.collect().await.unwrap().to_bytes();
    let text = String::from_utf8(rest.to_vec()).unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .collect();
    assert_eq!(data.len(), 1, "one error event, then the end: {data:?}");
    let error = json(data[0]);
    assert_eq!(error["error"]["code"], "shutting_down", "{error}");
    assert_eq!(error["error"]["type"], "server_error", "{error}");
    assert!(tx.is_closed(), "the sequence is cancelled");
    assert!(
        probe.dropped.load(Ordering::SeqCst),
        "the guard is released"
    );
    assert_eq!(
        probe.completion.load(Ordering::SeqCst),
        0,
        "no completion recorded: it did not finish"
    );
}

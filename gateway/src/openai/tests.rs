//! Wire shapes: what clients send parses, what we send matches OpenAI field for field.

use super::*;
use serde_json::json;

#[test]
fn content_is_a_string_or_text_parts() {
    let msg: ChatMessage =
        serde_json::from_value(json!({"role": "user", "content": "hi"})).unwrap();
    assert_eq!(msg.content, Some(MessageContent::Text("hi".into())));
    let parts =
        json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]});
    let msg: ChatMessage = serde_json::from_value(parts).unwrap();
    let Some(MessageContent::Parts(parts)) = msg.content else {
        panic!("expected parts")
    };
    assert_eq!(parts[0].text.as_deref(), Some("a"));
    assert_eq!(parts[1].kind, "image_url");
    let msg: ChatMessage =
        serde_json::from_value(json!({"role": "assistant", "content": null})).unwrap();
    assert_eq!(msg.content, None);
    let err =
        serde_json::from_value::<ChatMessage>(json!({"role": "user", "content": 5})).unwrap_err();
    assert!(
        err.to_string()
            .contains("a string or an array of content parts"),
        "{err}"
    );
}

#[test]
fn stop_and_prompt_accept_one_or_many() {
    let req: CompletionRequest =
        serde_json::from_value(json!({"model": "m", "prompt": "p", "stop": "x"})).unwrap();
    assert_eq!(req.stop, Some(StopSequences(vec!["x".into()])));
    assert_eq!(req.prompt, PromptInput(vec!["p".into()]));
    let req: CompletionRequest =
        serde_json::from_value(json!({"model": "m", "prompt": ["a", "b"], "stop": ["x", "y"]}))
            .unwrap();
    assert_eq!(req.stop, Some(StopSequences(vec!["x".into(), "y".into()])));
    assert_eq!(req.prompt.0.len(), 2);
}

#[test]
fn unknown_request_fields_are_ignored_and_developer_is_system() {
    let req: ChatCompletionRequest = serde_json::from_value(json!({
        "model": "m", "frequency_penalty": 0.5, "logit_bias": {},
        "messages": [{"role": "developer", "content": "be brief"}],
        "stream": true, "stream_options": {"include_usage": true}, "max_completion_tokens": 5
    }))
    .unwrap();
    assert_eq!(req.messages[0].role.template_name(), "system");
    assert_eq!(req.stream, Some(true));
    assert_eq!(req.stream_options.and_then(|o| o.include_usage), Some(true));
    assert_eq!(req.max_completion_tokens, Some(5));
}

#[test]
fn chat_completion_serializes_like_openai() {
    let response = ChatCompletion {
        id: "chatcmpl-1".into(),
        object: "chat.completion".into(),
        created: 1,
        model: "m".into(),
        system_fingerprint: None,
        choices: vec![ChatChoice {
            index: 0,
            message: AssistantMessage {
                role: "assistant".into(),
                content: "hi".into(),
            },
            logprobs: None,
            finish_reason: FinishReason::Length,
        }],
        usage: Usage::new(3, 2),
    };
    assert_eq!(
        serde_json::to_value(&response).unwrap(),
        json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "logprobs": null, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        })
    );
}

#[test]
fn chunk_usage_is_absent_null_or_present() {
    let chunk = |usage| ChatCompletionChunk {
        id: "c".into(),
        object: "chat.completion.chunk".into(),
        created: 1,
        model: "m".into(),
        system_fingerprint: None,
        choices: vec![ChunkChoice {
            index: 0,
            delta: Delta {
                role: None,
                content: Some("x".into()),
            },
            logprobs: None,
            finish_reason: None,
        }],
        usage,
    };
    let absent = serde_json::to_value(chunk(None)).unwrap();
    assert!(absent.get("usage").is_none());
    assert_eq!(
        absent["choices"][0]["finish_reason"],
        serde_json::Value::Null
    );
    assert_eq!(absent["choices"][0]["delta"], json!({"content": "x"}));
    let null = serde_json::to_value(chunk(Some(None))).unwrap();
    assert_eq!(null["usage"], serde_json::Value::Null);
    assert!(null.as_object().unwrap().contains_key("usage"));
    let present = serde_json::to_value(chunk(Some(Some(Usage::new(1, 1))))).unwrap();
    assert_eq!(present["usage"]["total_tokens"], 2);
}

#[test]
fn errors_always_have_all_four_fields() {
    let body = ErrorBody {
        error: ErrorDetail {
            message: "m".into(),
            error_type: "invalid_request_error".into(),
            param: None,
            code: None,
        },
    };
    assert_eq!(
        serde_json::to_value(body).unwrap(),
        json!({"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": null}})
    );
}

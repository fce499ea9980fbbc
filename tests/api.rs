//! The OpenAI surface end to end: shapes of answers and streams, headers, and every client
//! mistake answered with a JSON 4xx (never plain text, never 5xx).

mod common;

use std::time::Duration;

use common::client::{raw_connect, read_to_close};
use common::{MODEL, Options, TestServer, chat, one_tenant_policy};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const KEY: &str = "sk-api-test";

fn one_tenant() -> String {
    one_tenant_policy("alpha", KEY, "")
}

fn assert_openai_error(reply: &common::Reply, status: u16, code: &str) {
    assert_eq!(
        reply.status.as_u16(),
        status,
        "{:?}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let error = &reply.json()["error"];
    for field in ["message", "type", "param", "code"] {
        assert!(error.get(field).is_some(), "`{field}` missing: {error}");
    }
    assert_eq!(error["code"], code, "{error}");
    assert!(
        reply
            .header("x-request-id")
            .is_some_and(|id| !id.is_empty())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_answers_like_openai() {
    let server = TestServer::start(&one_tenant()).await;
    let reply = server
        .client()
        .post("/v1/chat/completions", Some(KEY), &chat("Say hello.", 8))
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let body = reply.json();
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], MODEL);
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000);
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(!choice["message"]["content"].as_str().unwrap().is_empty());
    assert_eq!(choice["logprobs"], Value::Null);
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    let usage = &body["usage"];
    let (prompt, completion) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(prompt > 5 && (1..=8).contains(&completion), "{usage}");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt + completion);
    assert!(reply.header("x-request-id").unwrap().starts_with("req_"));
    server.wait_for_idle_kv(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_sends_role_deltas_usage_and_done() {
    let server = TestServer::start(&one_tenant()).await;
    let mut body = chat("Say hello.", 6);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let reply = server
        .client()
        .stream("/v1/chat/completions", Some(KEY), &body)
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.headers["content-type"], "text/event-stream");
    let data = reply.collect_data().await;
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], id, "one id for the whole stream");
    }
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    let completion = usage_chunk["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=6).contains(&completion));
    let finish = &chunks[chunks.len() - 2];
    assert!(finish["choices"][0]["finish_reason"].is_string());
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty());
    // Every chunk but the last carries `"usage": null` when usage was asked for.
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c.get("usage") == Some(&Value::Null))
    );
    server.wait_for_idle_kv(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_plain_and_streamed() {
    let server = TestServer::start(&one_tenant()).await;
    let client = server.client();
    let body = json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let reply = client.post("/v1/completions", Some(KEY), &body).await;
    assert_eq!(reply.status, StatusCode::OK);
    let answer = reply.json();
    assert!(answer["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(answer["object"], "text_completion");
    assert!(answer["choices"][0]["text"].is_string());
    let completion = answer["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=4).contains(&completion));
    if answer["choices"][0]["finish_reason"] == "length" {
        assert_eq!(completion, 4);
    }

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let data = client
        .stream("/v1/completions", Some(KEY), &streamed)
        .await
        .collect_data()
        .await;
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let text: String = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_owned))
        .collect();
    // Greedy decoding: the streamed text equals the non-streamed one.
    assert_eq!(text, answer["choices"][0]["text"].as_str().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_readiness() {
    let server = TestServer::start(&one_tenant()).await;
    let client = server.client();
    let models = client.get("/v1/models", Some(KEY)).await;
    assert_eq!(models.status, StatusCode::OK);
    assert_eq!(models.json()["data"][0]["id"], MODEL);
    assert_eq!(models.json()["object"], "list");
    assert_eq!(client.get("/healthz", None).await.status, StatusCode::OK);
    let ready = client.get("/readyz", None).await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.json()["status"], "ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_mistakes_are_json_4xx() {
    let server = TestServer::start(&one_tenant()).await;
    let client = server.client();
    let chat_path = "/v1/chat/completions";

    assert_openai_error(&client.get("/v1/nope", Some(KEY)).await, 404, "unknown_url");
    assert_openai_error(
        &client.send_method(Method::GET, chat_path, Some(KEY)).await,
        405,
        "method_not_allowed",
    );
    assert_openai_error(
        &client.post_bytes(chat_path, Some(KEY), "{not json").await,
        400,
        "invalid_json",
    );
    assert_openai_error(
        &client
            .post_bytes(chat_path, Some(KEY), &b"{\"model\":\"\xff\xfe\"}"[..])
            .await,
        400,
        "invalid_json",
    );
    let wrong_type = client
        .post(
            chat_path,
            Some(KEY),
            &json!({"model": MODEL, "messages": "hi"}),
        )
        .await;
    assert_openai_error(&wrong_type, 400, "invalid_json");
    assert_eq!(wrong_type.json()["error"]["param"], "messages");
    // An announced 5 MiB body is refused before a byte of it is read.
    let head = format!(
        "POST {chat_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        5 * 1024 * 1024
    );
    let mut oversized = raw_connect(server.addr, head.as_bytes()).await;
    let answer = read_to_close(&mut oversized).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer.contains("request_too_large") && answer.contains("x-request-id"),
        "{answer}"
    );

    let mut unknown_model = chat("hi", 4);
    unknown_model["model"] = json!("gpt-4o");
    assert_openai_error(
        &client.post(chat_path, Some(KEY), &unknown_model).await,
        404,
        "model_not_found",
    );
    let cases = [
        (json!({"n": 2}), "n"),
        (json!({"temperature": 3}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": -1}), "max_tokens"),
        (json!({"max_tokens": 100000000}), "max_tokens"),
        (json!({"messages": []}), "messages"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
    ];
    for (patch, param) in cases {
        let mut body = chat("hi", 4);
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        let reply = client.post(chat_path, Some(KEY), &body).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(reply.json()["error"]["param"], param, "{body}");
        assert_eq!(reply.json()["error"]["type"], "invalid_request_error");
    }
    // Nothing above reached the engine.
    assert_eq!(server.kv().used_blocks + server.kv().reserved_blocks, 0);
}

/// A raw chat POST with `Content-Encoding: {encoding}` announcing `length` bytes of which only
/// `body` is sent, answered before the rest arrives (or never: the test waits for the close).
async fn encoded_post(
    server: &TestServer,
    encoding: &str,
    length: usize,
    body: &[u8],
) -> (String, Value) {
    let mut request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Encoding: {encoding}\r\n\
         Connection: close\r\nContent-Length: {length}\r\n\r\n"
    )
    .into_bytes();
    request.extend_from_slice(body);
    let mut stream = raw_connect(server.addr, &request).await;
    let answer = tokio::time::timeout(Duration::from_secs(30), read_to_close(&mut stream))
        .await
        .expect("answered without waiting for the rest of the body");
    let json = answer
        .split_once("\r\n\r\n")
        .and_then(|(_, body)| serde_json::from_str(body).ok())
        .unwrap_or(Value::Null);
    (answer, json)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoded_request_bodies_are_refused_with_415_before_they_are_read() {
    let server = TestServer::start(&one_tenant()).await;
    // A gzip member header; the other 990 announced bytes are never sent.
    let gzip = [0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03];
    for encoding in ["gzip", "br", "GZIP", "identity, gzip", "deflate"] {
        let (answer, json) = encoded_post(&server, encoding, 1000, &gzip).await;
        assert!(answer.starts_with("HTTP/1.1 415"), "{encoding}: {answer}");
        let error = &json["error"];
        assert_eq!(error["code"], "unsupported_content_encoding", "{answer}");
        assert_eq!(error["type"], "invalid_request_error", "{answer}");
        assert_eq!(error["param"], "Content-Encoding", "{answer}");
        let message = error["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&format!("Content-Encoding `{encoding}` is not supported")),
            "{message}"
        );
    }
    // `identity` is no encoding: the body is read and parsed as usual.
    let body = b"{not json";
    let (answer, json) = encoded_post(&server, "identity", body.len(), body).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(json["error"]["code"], "invalid_json", "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shape_errors_name_the_field_and_keep_the_message_short() {
    let server = TestServer::start(&one_tenant()).await;
    let client = server.client();
    let chat_path = "/v1/chat/completions";
    let error_of = |reply: &common::Reply| {
        assert_openai_error(reply, 400, reply.error_code().as_str());
        reply.json()["error"].clone()
    };

    // Valid JSON with a null (or absent, or numeric) role names the role, not a JSON syntax error.
    for message in [
        json!({"role": null, "content": "hi"}),
        json!({"content": "hi"}),
        json!({"role": 5, "content": "hi"}),
    ] {
        let body = json!({"model": MODEL, "messages": [message]});
        let error = error_of(&client.post(chat_path, Some(KEY), &body).await);
        assert_eq!(error["param"], "messages[0].role", "{body}: {error}");
        let text = error["message"].as_str().unwrap_or_default();
        assert!(
            text.contains("`messages[0].role`") && !text.contains("could not parse"),
            "{body}: {text}"
        );
    }
    // A missing `model` is named in `param` too.
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let error = error_of(&client.post(chat_path, Some(KEY), &body).await);
    assert_eq!(error["param"], "model", "{error}");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("Missing required parameter: `model`")),
        "{error}"
    );

    // Huge numbers are not echoed digit by digit, whether validation or serde rejects them.
    for (field, value) in [("temperature", "1e308"), ("max_tokens", "1e308")] {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"{field}":{value}}}"#
        );
        let error = error_of(&client.post_bytes(chat_path, Some(KEY), body).await);
        assert_eq!(error["param"], field, "{error}");
        let text = error["message"].as_str().unwrap_or_default();
        assert!(
            text.len() < 200 && text.contains("1e") && !text.contains("0000"),
            "{field}: {text}"
        );
    }
    // A long rejected string is cut, not echoed in full.
    let body =
        json!({"model": MODEL, "messages": [{"role": "x".repeat(100_000), "content": "hi"}]});
    let error = error_of(&client.post(chat_path, Some(KEY), &body).await);
    assert_eq!(error["param"], "messages[0].role", "{error}");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.chars().count() <= 501),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off() {
    let mut options = Options::default();
    options.serve.header_read_timeout = Duration::from_millis(500);
    options.serve.idle_timeout = Duration::from_millis(500);
    let server = TestServer::start_with(&one_tenant(), options).await;

    // Headers that never finish: the connection is closed.
    let mut slow_headers = raw_connect(
        server.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
    )
    .await;
    let _ = read_to_close(&mut slow_headers).await;

    // An idle keep-alive connection is closed too.
    let mut idle = raw_connect(server.addr, b"").await;
    let _ = read_to_close(&mut idle).await;

    // A body that stalls after 10 of 100 bytes: 408 JSON.
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"model\":"
    );
    let mut stalled = raw_connect(server.addr, head.as_bytes()).await;
    let mut response = vec![0u8; 4096];
    let n = stalled.read(&mut response).await.unwrap();
    let text = String::from_utf8_lossy(&response[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_timeout"), "{text}");
    let _ = stalled.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_sheds_api_requests_but_not_health_checks() {
    let mut options = Options::default();
    options.serve.max_in_flight = 1;
    let server = TestServer::start_with(&one_tenant(), options).await;
    let client = server.client();
    // A non-streamed request holds the only in-flight permit until its answer is complete.
    let body = chat(common::LONG_ANSWER, 200).to_string();
    let busy = raw_connect(
        server.addr,
        &common::client::raw_post("/v1/chat/completions", KEY, &body),
    )
    .await;
    common::wait_until("the request runs", Duration::from_secs(60), || {
        server.kv().used_blocks > 0
    })
    .await;

    let shed = client
        .post("/v1/chat/completions", Some(KEY), &chat("hi", 1))
        .await;
    assert_openai_error(&shed, 503, "overloaded");
    assert_eq!(shed.header("retry-after"), Some("1"));
    assert_eq!(shed.header("retry-after-ms"), Some("1000"));
    assert_eq!(client.get("/healthz", None).await.status, StatusCode::OK);
    assert_eq!(client.get("/readyz", None).await.status, StatusCode::OK);

    drop(busy);
    server.wait_for_idle_kv(Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_and_liveness_fail_once_the_engine_thread_has_stopped() {
    let server = TestServer::start(&one_tenant()).await;
    let client = server.client();
    assert_eq!(client.get("/readyz", None).await.status, StatusCode::OK);
    assert!(server.engine.is_running());

    let engine = server.engine.clone();
    tokio::task::spawn_blocking(move || engine.shutdown())
        .await
        .expect("engine stops");
    let ready = client.get("/readyz", None).await;
    assert_openai_error(&ready, 503, "not_ready");
    let message = ready.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("engine"), "{message}");
    // Liveness fails too: a process whose engine is gone only answers 503s and never recovers
    // by itself, so the orchestrator must restart it.
    let live = client.get("/healthz", None).await;
    assert_openai_error(&live, 503, "engine_unavailable");
}

/// The six `x-ratelimit-*` headers of a response, as (name suffix, value).
fn rate_headers(headers: &hyper::HeaderMap) -> Vec<(String, String)> {
    ["limit", "remaining", "reset"]
        .iter()
        .flat_map(|what| ["requests", "tokens"].map(|kind| format!("x-ratelimit-{what}-{kind}")))
        .map(|name| {
            let value = headers
                .get(&name)
                .unwrap_or_else(|| panic!("`{name}` missing in {headers:?}"))
                .to_str()
                .unwrap()
                .to_owned();
            (name, value)
        })
        .collect()
}

fn header_value(pairs: &[(String, String)], name: &str) -> String {
    pairs
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_carries_the_rate_limit_headers() {
    // Defaults: 100 requests and 50000 tokens per minute; alpha overrides the request rate.
    let text = one_tenant_policy("alpha", KEY, "requests_per_minute = 60").replacen(
        "[defaults]\n",
        "[defaults]\nrequests_per_minute = 100\ntokens_per_minute = 50000\n",
        1,
    );
    let server = TestServer::start(&text).await;
    let client = server.client();
    let chat_path = "/v1/chat/completions";

    // 401: no tenant is known, so the [defaults] limits with nothing spent.
    for key in [None, Some("sk-wrong")] {
        let refused = client.post(chat_path, key, &chat("hi", 4)).await;
        assert_openai_error(&refused, 401, "invalid_api_key");
        let headers = rate_headers(&refused.headers);
        assert_eq!(header_value(&headers, "x-ratelimit-limit-requests"), "100");
        assert_eq!(
            header_value(&headers, "x-ratelimit-remaining-requests"),
            "100"
        );
        assert_eq!(header_value(&headers, "x-ratelimit-reset-requests"), "0ms");
        assert_eq!(header_value(&headers, "x-ratelimit-limit-tokens"), "50000");
        assert_eq!(
            header_value(&headers, "x-ratelimit-remaining-tokens"),
            "50000"
        );
    }

    // 404 and 405 (the router's fallbacks) and a validation 400: the caller's tenant.
    let not_found = client.get("/v1/nope", Some(KEY)).await;
    assert_openai_error(&not_found, 404, "unknown_url");
    let headers = rate_headers(&not_found.headers);
    assert_eq!(header_value(&headers, "x-ratelimit-limit-requests"), "60");
    assert_eq!(
        header_value(&headers, "x-ratelimit-remaining-requests"),
        "60"
    );
    assert_eq!(header_value(&headers, "x-ratelimit-limit-tokens"), "50000");
    let anonymous_404 = client.get("/v1/nope", None).await;
    let headers = rate_headers(&anonymous_404.headers);
    assert_eq!(header_value(&headers, "x-ratelimit-limit-requests"), "100");
    let wrong_method = client.send_method(Method::GET, chat_path, Some(KEY)).await;
    assert_openai_error(&wrong_method, 405, "method_not_allowed");
    rate_headers(&wrong_method.headers);
    let mut invalid = chat("hi", 4);
    invalid["temperature"] = json!(3);
    let invalid = client.post(chat_path, Some(KEY), &invalid).await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        header_value(
            &rate_headers(&invalid.headers),
            "x-ratelimit-limit-requests"
        ),
        "60"
    );
    // Probes too.
    rate_headers(&client.get("/healthz", None).await.headers);

    // 413 from the body-limit layer, before routing and authentication.
    let head = format!(
        "POST {chat_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        5 * 1024 * 1024
    );
    let mut oversized = raw_connect(server.addr, head.as_bytes()).await;
    let answer = read_to_close(&mut oversized).await.to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 413"), "{answer}");
    for name in [
        "x-ratelimit-limit-requests: 60",
        "x-ratelimit-remaining-requests: 60",
        "x-ratelimit-reset-requests: 0ms",
        "x-ratelimit-limit-tokens: 50000",
        "x-ratelimit-remaining-tokens: 50000",
        "x-ratelimit-reset-tokens: 0ms",
    ] {
        assert!(answer.contains(name), "`{name}` missing in {answer}");
    }

    // 200: the state right after this request's debit.
    let ok = client.post(chat_path, Some(KEY), &chat("hi", 4)).await;
    assert_eq!(ok.status, StatusCode::OK);
    let headers = rate_headers(&ok.headers);
    assert_eq!(header_value(&headers, "x-ratelimit-limit-requests"), "60");
    assert_eq!(
        header_value(&headers, "x-ratelimit-remaining-requests"),
        "59"
    );
    let remaining_tokens: u32 = header_value(&headers, "x-ratelimit-remaining-tokens")
        .parse()
        .unwrap();
    assert!(remaining_tokens < 50000, "prompt + max_tokens were debited");
    server.wait_for_idle_kv(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_completions_default_to_sixteen_tokens() {
    let server = TestServer::start(&one_tenant()).await;
    let body = json!({"model": MODEL, "prompt": "Count from 1 to 100: 1, 2, 3,", "temperature": 0});
    let reply = server
        .client()
        .post("/v1/completions", Some(KEY), &body)
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let answer = reply.json();
    // The tenant allows 512 tokens; OpenAI's legacy default is 16.
    assert_eq!(answer["usage"]["completion_tokens"], 16, "{answer}");
    assert_eq!(answer["choices"][0]["finish_reason"], "length", "{answer}");
    server.wait_for_idle_kv(Duration::from_secs(30)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_the_embedded_engine_cannot_honour_are_refused_but_their_defaults_pass() {
    let server = TestServer::start(&one_tenant()).await;
    let client = server.client();
    let refused = [
        (
            "/v1/chat/completions",
            json!({"logprobs": true}),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"top_logprobs": -1}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (
            "/v1/chat/completions",
            json!({"tool_choice": "required"}),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            json!({"presence_penalty": 1}),
            "presence_penalty",
        ),
        ("/v1/completions", json!({"logprobs": 2}), "logprobs"),
        ("/v1/completions", json!({"best_of": 3}), "best_of"),
        ("/v1/completions", json!({"suffix": "!"}), "suffix"),
    ];
    for (path, patch, param) in refused {
        let mut body = if path == "/v1/completions" {
            json!({"model": MODEL, "prompt": "hi", "max_tokens": 4})
        } else {
            chat("hi", 4)
        };
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        let reply = client.post(path, Some(KEY), &body).await;
        assert_openai_error(&reply, 400, "unsupported_value");
        let error = &reply.json()["error"];
        assert_eq!(error["param"], param, "{body}");
        assert_eq!(error["type"], "invalid_request_error");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains("embedded engine"), "{message}");
    }
    // Nothing refused reached the engine.
    assert_eq!(server.kv().used_blocks + server.kv().reserved_blocks, 0);

    // The OpenAI defaults clients send on every request change nothing and are answered.
    let mut body = chat("Say hello.", 4);
    for (k, v) in json!({
        "logprobs": false, "top_logprobs": null, "frequency_penalty": 0, "presence_penalty": 0,
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
        "logit_bias": {},
    })
    .as_object()
    .unwrap()
    {
        body[k] = v.clone();
    }
    let reply = client.post("/v1/chat/completions", Some(KEY), &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["object"], "chat.completion");
    let body = json!({
        "model": MODEL, "prompt": "hi", "max_tokens": 4, "best_of": 1, "logprobs": null,
        "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "echo": false,
    });
    let reply = client.post("/v1/completions", Some(KEY), &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["object"], "text_completion");
    server.wait_for_idle_kv(Duration::from_secs(30)).await;
}

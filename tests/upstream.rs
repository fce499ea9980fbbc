//! Upstream mode end to end: a gateway that proxies model `remote` to another real kvgate node
//! (same model, its own engine) on an ephemeral port, and to stand-in upstreams that never
//! answer or are down.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{LONG_ANSWER, MODEL, SseReply, TestServer, chat, proxy_gateway, wait_until};
use hyper::StatusCode;
use kvgate_gateway::metrics::exposition::Scrape;
use kvgate_gateway::upstream::TiktokenCounter;
use kvgate_gateway::validate::TemplateTurn;
use kvgate_runtime::chat_template::ChatMessage;
use serde_json::{Value, json};
use tokio::net::TcpListener;

const KEY: &str = "sk-upstream-test";
/// The name clients use for the proxied model.
const REMOTE: &str = "remote";

/// A kvgate node to proxy to: it admits the gateway's requests, which carry no key.
async fn upstream_node() -> TestServer {
    upstream_node_with("").await
}

/// [`upstream_node`] whose tenant for the gateway has `extra` limits.
async fn upstream_node_with(extra: &str) -> TestServer {
    let text = format!(
        "anonymous_tenant = \"gateway\"\n\n[defaults]\nmax_input_tokens = 1024\n\
         max_output_tokens = 512\nmax_total_tokens = 1536\nmax_concurrency = 8\n\
         max_queue_wait = \"60s\"\n\n[tenants.gateway]\n{extra}\n"
    );
    TestServer::start(&text).await
}

/// A gateway (with its own embedded model) whose tenant `alpha` has `tenant_extra` limits and
/// which proxies these `--upstream` values.
async fn gateway(upstreams: &[String], tenant_extra: &str) -> TestServer {
    proxy_gateway(KEY, upstreams, tenant_extra).await
}

/// `remote` served by `addr` under the embedded model's id.
fn remote_at(addr: SocketAddr, extra: &str) -> String {
    format!("{REMOTE}=http://{addr},model={MODEL}{extra}")
}

fn for_model(mut body: Value, model: &str) -> Value {
    body["model"] = json!(model);
    body
}

/// Blocks of `name`'s capacity pool that admitted requests hold.
/// Opens a streamed chat completion of the remote model through `gateway`, as tenant alpha.
async fn stream_remote_chat(gateway: &TestServer, content: &str, max_tokens: u32) -> SseReply {
    let mut body = for_model(chat(content, max_tokens), REMOTE);
    body["stream"] = json!(true);
    gateway
        .client()
        .stream("/v1/chat/completions", Some(KEY), &body)
        .await
}

/// Waits until every block of the upstream's capacity pool is back (responses release their
/// reservation when their body ends, a moment after the client has read it).
async fn capacity_returned(gateway: &TestServer) {
    wait_until(
        "the upstream capacity is returned",
        Duration::from_secs(10),
        || upstream_reserved(gateway, REMOTE) == 0,
    )
    .await;
}

fn upstream_reserved(gateway: &TestServer, name: &str) -> usize {
    let upstream = gateway.upstreams.get(name).expect("configured upstream");
    upstream.pool().snapshot().reserved_blocks
}

/// A port where nothing listens.
async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    addr
}

/// An upstream that accepts connections, counts them, and never answers.
async fn black_hole() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            open.push(stream); // held open, never answered
        }
    });
    (addr, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_through_the_proxy_carry_the_upstreams_answer() {
    let node = upstream_node().await;
    let gateway = gateway(&[remote_at(node.addr, "")], "tokens_per_minute = 100000").await;
    let body = chat("Name three colors.", 12);

    let direct = node
        .client()
        .post("/v1/chat/completions", None, &body)
        .await;
    assert_eq!(direct.status, StatusCode::OK, "{:?}", direct.body);
    let proxied = gateway
        .client()
        .post("/v1/chat/completions", Some(KEY), &for_model(body, REMOTE))
        .await;
    assert_eq!(proxied.status, StatusCode::OK, "{:?}", proxied.body);
    assert_eq!(proxied.header("content-type"), Some("application/json"));
    let (direct, answer) = (direct.json(), proxied.json());
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(
        answer["choices"][0]["message"]["content"], direct["choices"][0]["message"]["content"],
        "greedy decoding upstream gives the same text as asking it directly"
    );
    assert_eq!(
        direct["model"], MODEL,
        "the upstream calls itself by its own id"
    );
    assert_eq!(
        answer["model"], REMOTE,
        "the client is told the name it asked for"
    );
    assert_eq!(
        token_counts(&answer["usage"]),
        token_counts(&direct["usage"]),
        "the upstream's own token counts"
    );
    // The client's rate-limit headers are this gateway's (alpha's 100000 TPM), not the
    // upstream's view of the gateway.
    assert_eq!(proxied.header("x-ratelimit-limit-tokens"), Some("100000"));
    assert!(proxied.header("x-request-id").unwrap().starts_with("req_"));

    let completion = gateway
        .client()
        .post(
            "/v1/completions",
            Some(KEY),
            &json!({"model": REMOTE, "prompt": "The capital of France is", "max_tokens": 4,
                    "temperature": 0}),
        )
        .await;
    assert_eq!(completion.status, StatusCode::OK, "{:?}", completion.body);
    assert_eq!(completion.json()["object"], "text_completion");
    assert_eq!(completion.json()["model"], REMOTE);
    let usage = &completion.json()["usage"];
    assert!(usage["completion_tokens"].as_u64().unwrap() <= 4, "{usage}");

    capacity_returned(&gateway).await;
    node.wait_for_idle_kv(Duration::from_secs(30)).await;
    assert_eq!(
        gateway.kv().reserved_blocks,
        0,
        "the embedded pool is not used"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_relayed_chunk_by_chunk_to_done() {
    let node = upstream_node().await;
    let gateway = gateway(&[remote_at(node.addr, "")], "").await;
    let body = chat("Write one sentence about the sea.", 24);
    let direct = node
        .client()
        .post("/v1/chat/completions", None, &body)
        .await
        .json();

    let mut streamed = for_model(body, REMOTE);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let mut reply = gateway
        .client()
        .stream("/v1/chat/completions", Some(KEY), &streamed)
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        reply.headers.get("content-type").unwrap(),
        "text/event-stream"
    );
    let role = reply.next_data().await.expect("role chunk");
    assert!(role.contains("\"role\":\"assistant\""), "{role}");
    let rest = reply.collect_data().await;
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = rest[..rest.len() - 1]
        .iter()
        .map(|data| serde_json::from_str(data).expect("JSON chunk"))
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        text,
        direct["choices"][0]["message"]["content"].as_str().unwrap()
    );
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        token_counts(usage),
        token_counts(&direct["usage"]),
        "the usage chunk comes through"
    );
    assert!(
        chunks.iter().all(|chunk| chunk["model"] == REMOTE),
        "every chunk names the model the client asked for: {chunks:?}"
    );

    capacity_returned(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_holds_upstream_capacity_and_a_client_that_leaves_cancels_it() {
    let node = upstream_node().await;
    let gateway = gateway(&[remote_at(node.addr, "")], "").await;
    let mut reply = stream_remote_chat(&gateway, LONG_ANSWER, 500).await;
    assert_eq!(reply.status, StatusCode::OK);
    reply.next_data().await.expect("role chunk");
    reply.next_data().await.expect("first token");
    assert_eq!(node.engine.stats().running, 1);
    assert_eq!(node.engine.stats().cancellations_total, 0);
    assert!(
        upstream_reserved(&gateway, REMOTE) > 0,
        "the reservation lives in the relayed body"
    );

    drop(reply);
    wait_until(
        "the upstream cancels the sequence",
        Duration::from_secs(20),
        || node.engine.stats().cancellations_total == 1,
    )
    .await;
    capacity_returned(&gateway).await;
    node.wait_for_idle_kv(Duration::from_secs(10)).await;
}

/// The first SSE chunk a [`half_stream`] upstream sends.
const FIRST_CHUNK: &str = r#"{"id":"chatcmpl-up","object":"chat.completion.chunk","choices":[]}"#;

/// Reads one whole request (headers, then content-length bytes of body) from `stream`, and
/// returns its body (empty if the connection closed first).
async fn read_request(stream: &mut tokio::net::TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            return Vec::new();
        }
        request.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&request).to_lowercase();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|line| line.strip_prefix("content-length:"))
                .and_then(|value| value.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if request.len() >= end + 4 + length {
                return request.split_off(end + 4);
            }
        }
    }
}

/// An upstream that answers every request with `response` (a whole raw HTTP response).
async fn answering(response: String) -> SocketAddr {
    use tokio::io::AsyncWriteExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            read_request(&mut stream).await;
            let _ = stream.write_all(response.as_bytes()).await;
        }
    });
    addr
}

/// Like [`answering`], also keeping every request body it read, as JSON.
async fn capturing(response: String) -> (SocketAddr, Arc<std::sync::Mutex<Vec<Value>>>) {
    use tokio::io::AsyncWriteExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = Arc::clone(&bodies);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let body = read_request(&mut stream).await;
            if let Ok(body) = serde_json::from_slice(&body) {
                kept.lock().unwrap().push(body);
            }
            let _ = stream.write_all(response.as_bytes()).await;
        }
    });
    (addr, bodies)
}

/// A whole HTTP/1.1 200 response carrying `body` as JSON.
fn json_answer(body: &Value) -> String {
    let body = body.to_string();
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_the_embedded_engine_refuses_are_forwarded_to_an_upstream() {
    let answer = json!({
        "id": "chatcmpl-up", "object": "chat.completion", "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "{}"},
                     "logprobs": {"content": []}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    });
    let (addr, bodies) = capturing(json_answer(&answer)).await;
    let gateway = gateway(&[remote_at(addr, "")], "").await;
    let options = json!({
        "logprobs": true, "top_logprobs": 2, "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "required", "frequency_penalty": 0.5, "presence_penalty": -0.5,
        "logit_bias": {"50256": -100},
    });
    let mut body = for_model(chat("Answer in JSON.", 4), REMOTE);
    for (k, v) in options.as_object().unwrap() {
        body[k] = v.clone();
    }
    let reply = gateway
        .client()
        .post("/v1/chat/completions", Some(KEY), &body)
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["model"], REMOTE);
    let sent = bodies
        .lock()
        .unwrap()
        .pop()
        .expect("the upstream got the request");
    for (k, v) in options.as_object().unwrap() {
        assert_eq!(&sent[k], v, "`{k}` is forwarded as written: {sent}");
    }
    // The same request for the embedded model is refused, naming the first such option.
    let refused = gateway
        .client()
        .post("/v1/chat/completions", Some(KEY), &for_model(body, MODEL))
        .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(refused.json()["error"]["param"], "logprobs");
    capacity_returned(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_server_error_keeps_its_status_and_retry_but_not_its_body() {
    let body = r#"{"detail":"Traceback: /srv/engine/secret_module.py line 3, db at 10.9.8.7"}"#;
    let addr = answering(format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 7\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    ))
    .await;
    let gateway = gateway(&[remote_at(addr, "")], "").await;
    let reply = gateway
        .client()
        .post(
            "/v1/chat/completions",
            Some(KEY),
            &for_model(chat("Hi.", 4), REMOTE),
        )
        .await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.error_code(), "upstream_error");
    assert_eq!(reply.header("retry-after"), Some("7"));
    let text = String::from_utf8_lossy(&reply.body).into_owned();
    assert!(text.contains(REMOTE), "{text}");
    for secret in ["secret_module", "10.9.8.7", "Traceback"] {
        assert!(!text.contains(secret), "{secret} leaked: {text}");
    }
    capacity_returned(&gateway).await;
}

/// An upstream that reads one request, answers SSE headers and [`FIRST_CHUNK`], then stalls
/// (holds the connection open, sending nothing) or, if `close`, drops the connection midway
/// through the chunked body.
async fn half_stream(close: bool) -> SocketAddr {
    let event = format!("data: {FIRST_CHUNK}\n\n");
    half_answer(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
             transfer-encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
            event.len()
        ),
        close,
    )
    .await
}

/// An upstream that reads each request and writes `head` (headers and the start of a body),
/// then stalls with the connection open or, if `close`, drops it before the body's end.
async fn half_answer(head: String, close: bool) -> SocketAddr {
    use tokio::io::AsyncWriteExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((mut stream, _)) = listener.accept().await {
            read_request(&mut stream).await;
            stream.write_all(head.as_bytes()).await.unwrap();
            stream.flush().await.unwrap();
            if close {
                drop(stream); // the body is cut short
            } else {
                open.push(stream); // held open, nothing more sent
            }
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_answer_that_stalls_or_breaks_midway_is_cut_not_left_waiting() {
    use tokio::io::AsyncReadExt;
    for close in [false, true] {
        let addr = half_answer(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
             content-length: 1000\r\n\r\n{\"id\":\"chatcmpl-up\","
                .to_owned(),
            close,
        )
        .await;
        let gateway = gateway(&[remote_at(addr, ",timeout=500ms")], "").await;
        let body = for_model(chat("Hi.", 4), REMOTE).to_string();
        let started = std::time::Instant::now();
        let mut stream = common::client::raw_connect(
            gateway.addr,
            &common::client::raw_post("/v1/chat/completions", KEY, &body),
        )
        .await;
        let mut answer = Vec::new();
        // Before the fix the connection stayed open (200, no body) until the client gave up.
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
            .await
            .unwrap_or_else(|_| panic!("the answer is cut within the timeout (close={close})"))
            .ok();
        let answer = String::from_utf8_lossy(&answer).into_owned();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(
            !answer.ends_with("0\r\n\r\n"),
            "the body must not end as if complete (close={close}): {answer}"
        );
        if !close {
            assert!(
                started.elapsed() >= Duration::from_millis(500),
                "not before the timeout"
            );
        }
        // The request's admission slot and upstream capacity come back.
        capacity_returned(&gateway).await;
        await_metric(&gateway, "kvgate_requests_in_flight", "alpha", 0.0).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_stream_that_fails_midway_ends_with_an_error_event() {
    for close in [false, true] {
        let addr = half_stream(close).await;
        let gateway = gateway(&[remote_at(addr, ",timeout=500ms")], "").await;
        let mut reply = stream_remote_chat(&gateway, "Hi.", 8).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.next_data().await.as_deref(), Some(FIRST_CHUNK));
        // Without a stall timeout the relay would wait forever: bound the wait here.
        let error = tokio::time::timeout(Duration::from_secs(10), reply.next_data())
            .await
            .expect("the stall is reported within the upstream's timeout")
            .unwrap_or_else(|| panic!("an error event, not an aborted stream (close={close})"));
        let error: Value = serde_json::from_str(&error).expect("JSON error event");
        assert_eq!(error["error"]["code"], "upstream_unavailable", "{error}");
        assert_eq!(error["error"]["type"], "server_error", "{error}");
        if !close {
            assert!(
                error["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("no data within 0.5s"),
                "{error}"
            );
        }
        assert_eq!(reply.next_data().await, None, "the stream ends there");
        capacity_returned(&gateway).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_refusal_passes_through_with_its_retry_after() {
    // The node allows the gateway one request per minute.
    let node = upstream_node_with("requests_per_minute = 1").await;
    let gateway = gateway(&[remote_at(node.addr, "")], "").await;
    let body = for_model(chat("Hi.", 2), REMOTE);
    let first = gateway
        .client()
        .post("/v1/chat/completions", Some(KEY), &body)
        .await;
    assert_eq!(first.status, StatusCode::OK, "{:?}", first.body);
    let second = gateway
        .client()
        .post("/v1/chat/completions", Some(KEY), &body)
        .await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(second.error_code(), "rate_limit_exceeded");
    let message = second.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("tenant gateway"),
        "the node's own body: {message}"
    );
    let retry_after: u64 = second.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    // The limits reported to the client are the gateway's (alpha has no RPM limit).
    assert_eq!(
        second.header("x-ratelimit-limit-requests"),
        Some(u32::MAX.to_string().as_str())
    );
    capacity_returned(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn length_limits_use_tiktoken_counts_and_refuse_before_the_upstream() {
    let (addr, accepted) = black_hole().await;
    let gateway = gateway(
        &[
            remote_at(addr, ",timeout=500ms"),
            format!("tiny=http://{addr},capacity=64"),
        ],
        "max_input_tokens = 40",
    )
    .await;
    let client = gateway.client();

    let tiktoken = |content: &str| {
        TiktokenCounter::for_model(MODEL).count_chat(&[TemplateTurn {
            role: "user",
            content: content.to_owned(),
        }])
    };
    let sentence = "The quick brown fox jumps over the lazy dog, and then it runs far away \
                    into the deep green forest where nobody can ever find it again.";
    let long = format!("{sentence} {sentence}");
    let counted = tiktoken(&long);
    assert!(counted > 40, "the prompt must be over the limit: {counted}");
    let reply = client
        .post(
            "/v1/chat/completions",
            Some(KEY),
            &for_model(chat(&long, 8), REMOTE),
        )
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{:?}", reply.body);
    let error = &reply.json()["error"];
    assert_eq!(error["code"], "context_length_exceeded");
    assert_eq!(error["param"], "messages");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("is {counted} tokens")) && message.contains("is 40 tokens"),
        "both numbers, the count being tiktoken's: {message}"
    );

    // More than the upstream's whole declared capacity (64 tokens): it could never run there.
    let reply = client
        .post(
            "/v1/chat/completions",
            Some(KEY),
            &for_model(chat("Hi.", 100), "tiny"),
        )
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{:?}", reply.body);
    assert_eq!(reply.error_code(), "context_length_exceeded");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "nothing reached the upstream"
    );

    // A request that fits by tiktoken's count is forwarded, even though the embedded model's
    // tokenizer and chat template would count it over the limit: the upstream's model is not
    // the embedded one. An upstream that never answers is a 502 after its timeout.
    assert!(tiktoken(sentence) <= 40, "{}", tiktoken(sentence));
    let embedded = common::tokenizer()
        .encode_chat(&[ChatMessage::new("user", sentence)], true)
        .unwrap()
        .len();
    assert!(embedded > 40, "{embedded}");
    let reply = client
        .post(
            "/v1/chat/completions",
            Some(KEY),
            &for_model(chat(sentence, 4), REMOTE),
        )
        .await;
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY, "{:?}", reply.body);
    assert_eq!(reply.error_code(), "upstream_unavailable");
    assert!(
        reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no response within 0.5s"),
        "{}",
        reply.json()
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    assert_eq!(upstream_reserved(&gateway, REMOTE), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_is_down_is_a_502_upstream_unavailable() {
    let gateway = gateway(
        &[remote_at(closed_port().await, "")],
        "tokens_per_minute = 100000",
    )
    .await;
    let client = gateway.client();
    for (path, body) in [
        ("/v1/chat/completions", for_model(chat("Hi.", 8), REMOTE)),
        (
            "/v1/completions",
            json!({"model": REMOTE, "prompt": "Hi", "max_tokens": 8}),
        ),
    ] {
        let reply = client.post(path, Some(KEY), &body).await;
        assert_eq!(reply.status, StatusCode::BAD_GATEWAY, "{path}");
        assert_eq!(reply.header("content-type"), Some("application/json"));
        let error = &reply.json()["error"];
        assert_eq!(error["code"], "upstream_unavailable", "{error}");
        assert_eq!(error["type"], "server_error");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains("remote"), "{error}");
        // The transport error (it names the upstream's address) is logged, not sent.
        assert!(message.contains("could not be reached"), "{error}");
        assert!(!message.contains("127.0.0.1"), "{error}");
        assert!(!message.to_lowercase().contains("connect"), "{error}");
        assert_eq!(reply.header("retry-after"), Some("1"));
        // Never started: the whole token debit came back.
        assert_eq!(
            reply.header("x-ratelimit-remaining-tokens"),
            Some("100000"),
            "{path}"
        );
    }
    assert_eq!(upstream_reserved(&gateway, REMOTE), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_lists_the_embedded_model_and_every_upstream() {
    let down = closed_port().await;
    let gateway = gateway(
        &[
            remote_at(down, ""),
            format!("second=http://{down},capacity=1024"),
        ],
        "",
    )
    .await;
    let reply = gateway.client().get("/v1/models", Some(KEY)).await;
    assert_eq!(reply.status, StatusCode::OK);
    let models = reply.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|card| card["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [MODEL, REMOTE, "second"]);
    assert_eq!(models["data"][1]["owned_by"], "upstream");

    // Any other model is still unknown.
    let reply = gateway
        .client()
        .post(
            "/v1/chat/completions",
            Some(KEY),
            &for_model(chat("Hi.", 8), "nope"),
        )
        .await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    assert_eq!(reply.error_code(), "model_not_found");
}

/// The token counts of an OpenAI `usage` object. The upstream's `prompt_tokens_details` is
/// relayed too, but differs between two identical requests: the second one hits the upstream's
/// prefix cache.
fn token_counts(usage: &Value) -> [&Value; 3] {
    let cached = &usage["prompt_tokens_details"]["cached_tokens"];
    assert!(
        cached
            .as_u64()
            .is_some_and(|c| Some(c) <= usage["prompt_tokens"].as_u64()),
        "cached tokens are part of the prompt: {usage}"
    );
    [
        &usage["prompt_tokens"],
        &usage["completion_tokens"],
        &usage["total_tokens"],
    ]
}

/// One value of `/metrics` for tenant `tenant` (0 when the series does not exist yet).
async fn tenant_metric(gateway: &TestServer, name: &str, tenant: &str) -> f64 {
    let reply = gateway.client().get("/metrics", None).await;
    let text = std::str::from_utf8(&reply.body).expect("/metrics is UTF-8");
    let scrape = Scrape::parse(text).expect("valid exposition");
    scrape.value(name, &[("tenant", tenant)]).unwrap_or(0.0)
}

/// Polls `/metrics` until `name{tenant}` reads `expected` (relayed answers are recorded when
/// their body is dropped, a moment after the client read its end); panics after 10 s.
async fn await_metric(gateway: &TestServer, name: &str, tenant: &str, expected: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let value = tenant_metric(gateway, name, tenant).await;
        if value == expected {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name}{{tenant=\"{tenant}\"}} is {value}, expected {expected}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_answers_are_timed_and_counted_under_their_tenant() {
    // A tenant no other test of this binary uses: the metrics recorder is process-wide.
    const TENANT: &str = "metered";
    const METERED_KEY: &str = "sk-upstream-metered";
    let node = upstream_node().await;
    let text = common::policy(
        &[common::TenantSpec {
            name: TENANT,
            key: METERED_KEY,
            extra: "",
        }],
        "",
    );
    let options = common::Options {
        upstreams: vec![remote_at(node.addr, "").parse().unwrap()],
        ..common::Options::default()
    };
    let gateway = TestServer::start_with(&text, options).await;

    let mut body = for_model(chat("Write one sentence about the sea.", 24), REMOTE);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let reply = gateway
        .client()
        .stream("/v1/chat/completions", Some(METERED_KEY), &body)
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    let events = reply.collect_data().await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|data| serde_json::from_str(data).expect("JSON chunk"))
        .collect();
    let text_chunks = chunks
        .iter()
        .filter(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|text| !text.is_empty())
        })
        .count();
    assert!(text_chunks >= 2, "{events:?}");
    let usage = chunks.last().unwrap()["usage"].clone();
    let completion = usage["completion_tokens"].as_f64().unwrap();
    let prompt = usage["prompt_tokens"].as_f64().unwrap();

    // The embedded engine's families, under the same tenant label.
    await_metric(
        &gateway,
        "kvgate_generation_tokens_total",
        TENANT,
        completion,
    )
    .await;
    await_metric(&gateway, "kvgate_prompt_tokens_total", TENANT, prompt).await;
    let ttft = "kvgate_time_to_first_token_seconds_count";
    let itl = "kvgate_inter_token_latency_seconds_count";
    assert_eq!(tenant_metric(&gateway, ttft, TENANT).await, 1.0);
    // Labelled with the model name the client asked for (the upstream's configured NAME).
    let reply = gateway.client().get("/metrics", None).await;
    let scrape = Scrape::parse(std::str::from_utf8(&reply.body).unwrap()).unwrap();
    let relayed = [("tenant", TENANT), ("model", REMOTE)];
    assert_eq!(scrape.value(ttft, &relayed), Some(1.0));
    assert_eq!(
        scrape.value("kvgate_prompt_tokens_total", &relayed),
        Some(prompt)
    );
    // Other tests of this binary relay to a model of the same name: at least this one.
    let durations = scrape.value(
        "kvgate_request_duration_seconds_count",
        &[("model", REMOTE)],
    );
    assert!(durations.is_some_and(|count| count >= 1.0), "{durations:?}");
    assert_eq!(
        tenant_metric(&gateway, itl, TENANT).await,
        (text_chunks - 1) as f64,
        "one gap between each two chunks with text"
    );

    // A non-streamed answer adds its reported counts (it has no first-token moment to time).
    let plain = for_model(chat("Name a color.", 8), REMOTE);
    let reply = gateway
        .client()
        .post("/v1/chat/completions", Some(METERED_KEY), &plain)
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let more = reply.json()["usage"]["completion_tokens"].as_f64().unwrap();
    await_metric(
        &gateway,
        "kvgate_generation_tokens_total",
        TENANT,
        completion + more,
    )
    .await;
    assert_eq!(tenant_metric(&gateway, ttft, TENANT).await, 1.0);
    drop(node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bogus_reported_usage_counts_no_more_than_the_budget() {
    // A tenant no other test of this binary uses: the metrics recorder is process-wide.
    const TENANT: &str = "bogus-usage";
    const BOGUS_KEY: &str = "sk-upstream-bogus";
    let answer = json!({
        "id": "chatcmpl-up", "object": "chat.completion", "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                     "logprobs": null, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 1_000_000_000_000_u64,
                  "total_tokens": 1_000_000_000_007_u64},
    });
    let addr = answering(json_answer(&answer)).await;
    let text = common::policy(
        &[common::TenantSpec {
            name: TENANT,
            key: BOGUS_KEY,
            extra: "",
        }],
        "",
    );
    let options = common::Options {
        upstreams: vec![remote_at(addr, "").parse().unwrap()],
        ..common::Options::default()
    };
    let gateway = TestServer::start_with(&text, options).await;
    let reply = gateway
        .client()
        .post(
            "/v1/chat/completions",
            Some(BOGUS_KEY),
            &for_model(chat("Hi.", 5), REMOTE),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    // Relayed as the upstream wrote it, but counted at most the 5 tokens it was allowed.
    assert_eq!(
        reply.json()["usage"]["completion_tokens"],
        1_000_000_000_000_u64
    );
    await_metric(&gateway, "kvgate_generation_tokens_total", TENANT, 5.0).await;
    assert_eq!(
        tenant_metric(&gateway, "kvgate_prompt_tokens_total", TENANT).await,
        7.0
    );
    capacity_returned(&gateway).await;
}

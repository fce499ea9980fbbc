//! API keys end to end on the two shipped policies: the official OpenAI SDKs always send
//! `Authorization: Bearer KEY`, so the keyless default policy must serve a placeholder key
//! (JSON and streaming), while the multi-tenant policy still refuses a key it does not know.

mod common;

use std::path::Path;

use common::{MODEL, TestServer, chat};
use hyper::StatusCode;
use kvgate_gateway::metrics::REQUESTS_TOTAL;
use kvgate_gateway::metrics::exposition::Scrape;
use serde_json::json;

fn shipped(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("policies")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_policy_serves_placeholder_keys_as_its_anonymous_tenant() {
    let server = TestServer::start(&shipped("default.toml")).await;
    let client = server.client();
    for key in [None, Some("unused-for-anonymous"), Some("sk-anything")] {
        let reply = client
            .post("/v1/chat/completions", key, &chat("Name three colors.", 6))
            .await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "key {key:?}: {:?}",
            reply.body
        );
        assert_eq!(reply.json()["model"], MODEL);
    }

    let mut body = chat("Write a haiku about the sea.", 6);
    body["stream"] = json!(true);
    let reply = client
        .stream("/v1/chat/completions", Some("unused-for-anonymous"), &body)
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    let data = reply.collect_data().await;
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    assert!(data.len() >= 3, "role, tokens, [DONE]: {data:?}");

    // Every one of those requests was the anonymous tenant's.
    let metrics = client.get("/metrics", None).await;
    let text = String::from_utf8_lossy(&metrics.body);
    let scrape = Scrape::parse(&text).expect("valid exposition");
    let admitted = [("tenant", "local"), ("outcome", "admitted")];
    assert_eq!(scrape.sum(REQUESTS_TOTAL, &admitted), 4.0, "{text}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_multi_tenant_policy_refuses_unknown_keys() {
    let server = TestServer::start(&shipped("multi-tenant.toml")).await;
    let client = server.client();
    for key in [Some("sk-demo-alhpa"), Some("unused-for-anonymous"), None] {
        let reply = client
            .post("/v1/chat/completions", key, &chat("Hi.", 2))
            .await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "key {key:?}");
        assert_eq!(reply.error_code(), "invalid_api_key");
    }
    let reply = client
        .post(
            "/v1/chat/completions",
            Some("sk-demo-alpha"),
            &chat("Hi.", 2),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    server.shutdown().await;
}

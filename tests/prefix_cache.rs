//! Prefix caching through the real server and model: `usage.prompt_tokens_details.cached_tokens`
//! (plain and streamed), per-tenant isolation by default, sharing only between `shared`
//! tenants, and the per-tenant hit counters.

mod common;

use std::time::Duration;

use common::{TenantSpec, TestServer, chat, policy};
use hyper::StatusCode;
use kvgate_gateway::metrics::exposition::Scrape;
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

/// A prompt of several full KV blocks, so a hit is many tokens.
fn long_prompt() -> String {
    "You are a careful assistant for a paged KV cache gateway. Answer in one short sentence. "
        .repeat(4)
        + "What does a block table map?"
}

async fn cached_tokens(server: &TestServer, key: &str, body: &Value) -> u64 {
    let reply = server.client().post(CHAT, Some(key), body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let usage = &reply.json()["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {usage}"));
    assert!(cached < usage["prompt_tokens"].as_u64().unwrap_or(0));
    cached
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_hit_only_their_own_prefixes_unless_both_share() {
    let tenants = [
        TenantSpec {
            name: "a",
            key: "sk-a",
            extra: "",
        },
        TenantSpec {
            name: "b",
            key: "sk-b",
            extra: "",
        },
        TenantSpec {
            name: "c",
            key: "sk-c",
            extra: "prefix_cache = \"shared\"",
        },
        TenantSpec {
            name: "d",
            key: "sk-d",
            extra: "prefix_cache = \"shared\"",
        },
        TenantSpec {
            name: "e",
            key: "sk-e",
            extra: "prefix_cache = \"off\"",
        },
    ];
    let server = TestServer::start(&policy(&tenants, "")).await;
    let body = chat(&long_prompt(), 4);

    assert_eq!(cached_tokens(&server, "sk-a", &body).await, 0, "cold cache");
    let again = cached_tokens(&server, "sk-a", &body).await;
    assert!(again >= 48 && again % 16 == 0, "a's own prefix: {again}");
    // The default salt is the tenant: b sending a's exact prompt gets nothing (and cannot
    // time a's prompts either).
    assert_eq!(
        cached_tokens(&server, "sk-b", &body).await,
        0,
        "isolated by default"
    );
    // Shared tenants share with each other, not with a's tenant-salted blocks.
    assert_eq!(cached_tokens(&server, "sk-c", &body).await, 0);
    assert_eq!(
        cached_tokens(&server, "sk-d", &body).await,
        again,
        "shared with c"
    );
    // `off` neither reads nor fills.
    assert_eq!(cached_tokens(&server, "sk-e", &body).await, 0);
    assert_eq!(cached_tokens(&server, "sk-e", &body).await, 0);

    // The last streamed chunk reports it too.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let reply = server.client().stream(CHAT, Some("sk-c"), &streamed).await;
    assert_eq!(reply.status, StatusCode::OK);
    let data = reply.collect_data().await;
    let usage_chunk = data
        .iter()
        .filter(|d| d.as_str() != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).expect("chunk is JSON"))
        .find(|chunk| !chunk["usage"].is_null())
        .expect("a usage chunk");
    assert_eq!(
        usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(again)
    );

    // Per-tenant counters, in tokens.
    let reply = server.client().get("/metrics", None).await;
    let text = String::from_utf8_lossy(&reply.body).into_owned();
    let scrape = Scrape::parse(&text).unwrap_or_else(|e| panic!("{e}"));
    let hits = |tenant: &str| {
        scrape
            .value("kvgate_prefix_cache_hits_total", &[("tenant", tenant)])
            .unwrap_or(0.0)
    };
    assert_eq!(hits("a"), again as f64);
    assert_eq!(hits("b"), 0.0);
    assert_eq!(hits("c"), again as f64);
    assert!(
        scrape
            .value("kvgate_prefix_cache_queries_total", &[("tenant", "b")])
            .is_some_and(|q| q > 0.0)
    );
    assert!(
        scrape
            .value("kvgate_kv_blocks", &[("state", "cached")])
            .is_some_and(|c| c > 0.0),
        "finished requests leave cached blocks"
    );
    server.wait_for_idle_kv(Duration::from_secs(30)).await;
}

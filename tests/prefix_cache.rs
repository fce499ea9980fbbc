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

/// A system prompt of many full blocks, shared by every request of the admission test.
fn system_prompt() -> String {
    "You are the support assistant of a gateway that keeps language model servers alive under \
     load. Keep answers short, factual and polite. "
        .repeat(16)
}

/// Sends `n` concurrent greedy requests of `key` that share [`system_prompt`] and returns the
/// most of them that held blocks of the pool at once (used or reserved), polled from the
/// engine's per-step snapshot of its sequences. Not from admission's in-flight count: that
/// drops when a response has been written, a moment after the engine freed its blocks, so a
/// queued request admitted into those blocks would briefly count alongside the one it replaced.
async fn most_holding_blocks(server: &TestServer, tenant: &str, key: &str, n: usize) -> usize {
    let body = json!({
        "model": common::MODEL,
        "messages": [
            {"role": "system", "content": system_prompt()},
            {"role": "user", "content": common::LONG_ANSWER},
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    });
    let requests: Vec<_> = (0..n)
        .map(|_| {
            let (client, body, key) = (server.client(), body.clone(), key.to_owned());
            tokio::spawn(async move { client.post(CHAT, Some(&key), &body).await })
        })
        .collect();
    let mut most = 0;
    while !requests.iter().all(|r| r.is_finished()) {
        let holding = server
            .engine
            .inspect()
            .iter()
            .filter(|seq| &*seq.label == tenant && seq.blocks + seq.reserved_blocks > 0)
            .count();
        most = most.max(holding);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for request in requests {
        // Those the forecast says cannot start in time are refused: they did not fit either.
        let reply = request.await.expect("request task");
        let refused = reply.status == StatusCode::TOO_MANY_REQUESTS
            && reply.error_code() == "kv_cache_saturated";
        assert!(
            reply.status == StatusCode::OK || refused,
            "{:?}",
            reply.body
        );
    }
    most
}

const MAX_TOKENS: u32 = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_system_prompt_lets_more_requests_hold_the_pool_at_once() {
    let tenants = [
        TenantSpec {
            name: "cached",
            key: "sk-cached",
            extra: "",
        },
        TenantSpec {
            name: "uncached",
            key: "sk-uncached",
            extra: "prefix_cache = \"off\"",
        },
    ];
    let options = common::Options {
        num_blocks: BLOCKS,
        ..common::Options::default()
    };
    let server =
        TestServer::start_with(&policy(&tenants, "[kv]\nhigh_watermark = 1.0\n"), options).await;
    // Warm the cache with one request, and learn the prompt's size.
    let warm = json!({
        "model": common::MODEL,
        "messages": [
            {"role": "system", "content": system_prompt()},
            {"role": "user", "content": common::LONG_ANSWER},
        ],
        "max_tokens": 1,
        "temperature": 0,
    });
    let reply = server.client().post(CHAT, Some("sk-cached"), &warm).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let prompt_tokens = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
    // Every request holds (prompt + max_tokens) tokens of blocks; the pool has room for two
    // of them without sharing, and the shared prefix makes room for at least two more.
    let full = (prompt_tokens + MAX_TOKENS as usize).div_ceil(16);
    let cached = (prompt_tokens - 1) / 16;
    assert!(
        2 * full <= BLOCKS && 3 * full > BLOCKS && full + 3 * (full - cached) <= BLOCKS,
        "sizes: prompt {prompt_tokens} tokens, {full} blocks each, {cached} cacheable"
    );

    let uncached = most_holding_blocks(&server, "uncached", "sk-uncached", 6).await;
    server.wait_for_idle_kv(Duration::from_secs(60)).await;
    let cached_at_once = most_holding_blocks(&server, "cached", "sk-cached", 6).await;
    assert!(uncached <= 2, "without the cache {uncached} fit at once");
    assert!(
        cached_at_once >= 4,
        "with the cache only {cached_at_once} fit at once (without: {uncached})"
    );
    server.wait_for_idle_kv(Duration::from_secs(60)).await;
}

/// Blocks of the admission test's pool (16 tokens each).
const BLOCKS: usize = 64;

//! A burst of 300 concurrent requests from three tenants, a third of them near the length
//! limit (half just under, half just over), against a deliberately small KV pool. Every
//! request must be answered with 200, a 4xx, or a 503 carrying Retry-After; no other 5xx; and
//! KV occupancy, sampled throughout, never exceeds the pool.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::{MODEL, Options, TenantSpec, TestServer, policy};
use kvgate_gateway::validate::{PromptCodec, TemplateTurn};
use serde_json::json;

const REQUESTS: usize = 300;
const MAX_INPUT: usize = 128;

/// A user message whose rendered chat prompt is exactly `tokens` long (or the nearest above).
fn prompt_of(tokens: usize) -> String {
    let tokenizer = common::tokenizer();
    let length = |words: usize| {
        let turn = TemplateTurn {
            role: "user",
            content: "apple ".repeat(words),
        };
        PromptCodec::encode_chat(tokenizer.as_ref(), &[turn])
            .expect("template renders")
            .len()
    };
    let words = (1..400)
        .find(|&w| length(w) >= tokens)
        .expect("some length reaches the target");
    "apple ".repeat(words)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_concurrent_requests_are_all_answered_within_kv_capacity() {
    let tenants = [
        TenantSpec {
            name: "a",
            key: "sk-a",
            extra: "weight = 3\nmax_concurrency = 8\nqueue_depth = 40",
        },
        TenantSpec {
            name: "b",
            key: "sk-b",
            extra: "weight = 2\nmax_concurrency = 6\nqueue_depth = 30",
        },
        TenantSpec {
            name: "c",
            key: "sk-c",
            extra: "max_concurrency = 4\nqueue_depth = 20\nrequests_per_minute = 60",
        },
    ];
    // Queued requests give up after 5 s (503 + Retry-After), which bounds the test's length.
    let text = policy(&tenants, "")
        .replacen(
            "max_input_tokens = 1024",
            &format!("max_input_tokens = {MAX_INPUT}"),
            1,
        )
        .replacen("max_queue_wait = \"60s\"", "max_queue_wait = \"5s\"", 1);
    // 128 blocks (115 admissible) against up to 18 running requests of 3–9 blocks each: KV
    // is contended, so admission's reservations are what keeps it within capacity.
    let options = Options {
        num_blocks: 128,
        ..Options::default()
    };
    let server = TestServer::start_with(&text, options).await;
    let total_blocks = server.kv().total_blocks;

    // Sample KV occupancy for the whole burst.
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicUsize::new(0));
    let sampler = tokio::spawn({
        let pool = Arc::clone(server.engine.pool());
        let (done, peak) = (Arc::clone(&done), Arc::clone(&peak));
        async move {
            while !done.load(Ordering::Acquire) {
                let kv = pool.snapshot();
                let committed = kv.used_blocks + kv.reserved_blocks;
                assert!(committed <= kv.total_blocks, "KV over capacity: {kv:?}");
                peak.fetch_max(committed, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });

    let under = prompt_of(MAX_INPUT - 8);
    let over = prompt_of(MAX_INPUT + 8);
    let client = server.client();
    let mut requests = Vec::with_capacity(REQUESTS);
    for i in 0..REQUESTS {
        let key = ["sk-a", "sk-b", "sk-c"][i % 3];
        let content = match i % 6 {
            0 => under.clone(),
            3 => over.clone(),
            _ => format!("Say the number {i}."),
        };
        let stream = i % 4 == 0;
        let over_limit = i % 6 == 3;
        let body = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
            "temperature": 0,
            "stream": stream,
        });
        let client = client.clone();
        requests.push(tokio::spawn(async move {
            if stream {
                let reply = client
                    .stream("/v1/chat/completions", Some(key), &body)
                    .await;
                let status = reply.status;
                let retry_after = reply.headers.get("retry-after").is_some();
                let data = reply.collect_data().await;
                if status.is_success() {
                    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
                }
                (status.as_u16(), retry_after, over_limit)
            } else {
                let reply = client.post("/v1/chat/completions", Some(key), &body).await;
                if reply.status.is_success() {
                    assert!(reply.json()["choices"][0]["message"]["content"].is_string());
                } else {
                    assert!(
                        reply.json()["error"]["code"].is_string(),
                        "errors are OpenAI JSON"
                    );
                }
                (
                    reply.status.as_u16(),
                    reply.header("retry-after").is_some(),
                    over_limit,
                )
            }
        }));
    }

    let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
    let mut over_limit_statuses: BTreeMap<u16, usize> = BTreeMap::new();
    for request in requests {
        let (status, retry_after, over_limit) = request.await.expect("request task");
        *by_status.entry(status).or_default() += 1;
        if over_limit {
            *over_limit_statuses.entry(status).or_default() += 1;
        }
        match status {
            200 | 400..=499 => {}
            503 => assert!(retry_after, "a 503 without Retry-After"),
            other => panic!("unexpected status {other}"),
        }
    }
    done.store(true, Ordering::Release);
    sampler.await.expect("KV never exceeded capacity");
    eprintln!(
        "burst: {by_status:?}, peak committed blocks {} of {total_blocks}",
        peak.load(Ordering::Relaxed)
    );
    assert_eq!(by_status.values().sum::<usize>(), REQUESTS);
    assert!(
        by_status.get(&200).copied().unwrap_or(0) > 0,
        "some requests succeed"
    );
    // The over-limit sixth is refused, every one of them: by validation (400), or before it
    // by its tenant's intake or queue limits (429) or a queue timeout (503). Validation does
    // see some of them.
    assert!(
        !over_limit_statuses.contains_key(&200),
        "an over-limit request was served: {over_limit_statuses:?}"
    );
    assert!(
        over_limit_statuses.get(&400).copied().unwrap_or(0) > 0,
        "validation refuses over-limit prompts: {over_limit_statuses:?}"
    );
    server.wait_for_idle_kv(Duration::from_secs(60)).await;
}

//! End-to-end harness: the real server on 127.0.0.1:0 in front of the real default model, a
//! policy written to a temporary file, and a small HTTP client (hyper-util's legacy client; raw
//! TCP where a test needs to misbehave).
//!
//! Every test gets its own engine (and so its own KV pool), so KV assertions never see another
//! test's sequences. The model file is opened once per test binary and shared read-only.

#![allow(dead_code)] // each test binary uses a different part of the harness

pub mod client;
pub mod process;
pub mod readme;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvgate_gateway::admission::Admission;
use kvgate_gateway::auth::hash_key;
use kvgate_gateway::reload::PolicyStore;
use kvgate_gateway::server::{ServeConfig, bind_with_upstreams};
use kvgate_gateway::upstream::{UpstreamSpec, Upstreams};
use kvgate_gateway::validate::PromptCodec;
use kvgate_runtime::block_pool::Occupancy;
use kvgate_runtime::engine::Engine;
use kvgate_runtime::gguf::GgufFile;
use kvgate_runtime::loader::{Runtime, RuntimeOptions};
use kvgate_runtime::model::ModelConfig;
use kvgate_runtime::tokenizer::Tokenizer;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[allow(unused_imports)] // not every test binary uses every type
pub use client::{Client, Reply, SseReply};

/// The id clients send as `model`: the loader names the model after its file.
pub const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// The default model: its path and config, looked up once per test binary.
struct ModelFile {
    path: PathBuf,
    config: ModelConfig,
    tokenizer: Arc<Tokenizer>,
}

fn model() -> &'static ModelFile {
    static MODEL_CELL: OnceLock<ModelFile> = OnceLock::new();
    MODEL_CELL.get_or_init(|| {
        let path = kvgate_runtime::provision::default_model_path()
            .unwrap_or_else(|e| panic!("the default model is needed for end-to-end tests: {e}"));
        let gguf = GgufFile::open(&path).expect("default model opens");
        let config = ModelConfig::from_gguf(&gguf).expect("default model config");
        let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).expect("default model tokenizer"));
        ModelFile {
            path,
            config,
            tokenizer,
        }
    })
}

/// The model's tokenizer, for tests that size prompts in tokens.
pub fn tokenizer() -> Arc<Tokenizer> {
    Arc::clone(&model().tokenizer)
}

/// Engine and server knobs a test may change.
#[derive(Debug, Clone)]
pub struct Options {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    /// The engine's submit queue (and waiting list) capacity.
    pub engine_queue: usize,
    pub serve: ServeConfig,
    /// Models proxied to other engines (`--upstream`); none by default.
    pub upstreams: Vec<UpstreamSpec>,
}

impl Default for Options {
    fn default() -> Self {
        let serve = ServeConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            model_name: MODEL.to_owned(),
            header_read_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(120),
            shutdown_grace: Duration::from_secs(60),
            // Tests stop at once; the pre-drain tests set their own.
            pre_drain: Duration::ZERO,
            ..ServeConfig::default()
        };
        Options {
            num_blocks: 512,
            block_size: 16,
            max_num_seqs: 32,
            engine_queue: RuntimeOptions::default().command_queue,
            serve,
            upstreams: Vec::new(),
        }
    }
}

/// A running server and the handles a test inspects it through.
pub struct TestServer {
    pub addr: SocketAddr,
    /// The operator address (`metrics_listen`), when the options asked for one.
    pub metrics_addr: Option<SocketAddr>,
    pub engine: Engine,
    pub store: PolicyStore,
    pub admission: Admission,
    pub upstreams: Upstreams,
    /// The policy file, removed when the server drops (on a panic too).
    pub policy_path: tempfile::TempPath,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl TestServer {
    pub async fn start(policy: &str) -> TestServer {
        TestServer::start_with(policy, Options::default()).await
    }

    pub async fn start_with(policy: &str, options: Options) -> TestServer {
        let policy_path = write_policy(policy);
        let store = PolicyStore::load(&policy_path).expect("test policy is valid");
        let runtime = start_runtime(&options);
        let engine = runtime.engine.clone();
        let upstreams = Upstreams::new(options.upstreams.clone()).expect("test upstreams");
        let admission =
            Admission::with_pools(store.clone(), Arc::clone(engine.pool()), upstreams.pools());
        let codec: Arc<dyn PromptCodec> = runtime.tokenizer.clone();
        let mut serve = options.serve.clone();
        serve.model_name = runtime.model_name.clone();
        let server = bind_with_upstreams(
            &serve,
            engine.clone(),
            codec,
            store.clone(),
            admission.clone(),
            upstreams.clone(),
        )
        .await
        .expect("bind 127.0.0.1:0");
        let addr = server.local_addr().expect("bound address");
        let metrics_addr = server.metrics_addr();
        let (shutdown, signal) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async {
            let _ = signal.await;
        }));
        TestServer {
            addr,
            metrics_addr,
            engine,
            store,
            admission,
            upstreams,
            policy_path,
            shutdown: Some(shutdown),
            task: Some(task),
        }
    }

    pub fn client(&self) -> Client {
        Client::new(self.addr)
    }

    /// Pool occupancy now.
    pub fn kv(&self) -> Occupancy {
        self.engine.pool().snapshot()
    }

    /// Waits (polling) until no block is used or reserved; panics after `limit`.
    pub async fn wait_for_idle_kv(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let kv = self.kv();
            if kv.used_blocks == 0 && kv.reserved_blocks == 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "KV never returned to idle: {kv:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the drain and waits for the server task to finish.
    pub async fn shutdown(mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("server task ends cleanly");
        }
    }

    /// Begins the drain without waiting; returns the server task to await later.
    pub fn begin_shutdown(&mut self) -> JoinHandle<()> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        self.task.take().expect("server still running")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// Starts the real runtime with a pool of exactly `options.num_blocks` blocks.
fn start_runtime(options: &Options) -> Runtime {
    let model = model();
    let bytes_per_block = model.config.kv_shape().bytes_per_block(options.block_size);
    let runtime = Runtime::start(
        &model.path,
        RuntimeOptions {
            kv_memory_bytes: (options.num_blocks * bytes_per_block) as u64,
            block_size: options.block_size,
            // Two compute threads whatever the machine: cargo runs a file's tests at once, each
            // with its engine, and the timing-based expectations (step cost, queue waits) were
            // set on two cores; all cores per engine would oversubscribe a large runner.
            threads: Some(2),
            max_num_seqs: options.max_num_seqs,
            max_batched_tokens: 256,
            command_queue: options.engine_queue,
            ..RuntimeOptions::default()
        },
    )
    .expect("runtime starts");
    assert_eq!(
        runtime.num_blocks, options.num_blocks,
        "KV pool sized as asked"
    );
    assert_eq!(runtime.model_name, MODEL);
    runtime
}

/// `text` in a new file `kvgate-test-XXXXXX.toml` in the system temp dir, deleted when the
/// returned guard drops.
fn write_policy(text: &str) -> tempfile::TempPath {
    let path = tempfile::Builder::new()
        .prefix("kvgate-test-")
        .suffix(".toml")
        .tempfile()
        .expect("create test policy")
        .into_temp_path();
    std::fs::write(&path, text).expect("write test policy");
    path
}

/// One tenant of a test policy: its name, its plain key, and extra TOML lines.
pub struct TenantSpec<'a> {
    pub name: &'a str,
    pub key: &'a str,
    pub extra: &'a str,
}

/// A policy with generous defaults (tests override what they exercise) and these tenants.
pub fn policy(tenants: &[TenantSpec<'_>], tail: &str) -> String {
    let mut text = String::from(
        "[defaults]\n\
         max_input_tokens = 1024\nmax_output_tokens = 512\nmax_total_tokens = 1536\n\
         max_messages = 32\nmax_concurrency = 8\nqueue_depth = 64\nqueue_tokens = 200000\n\
         max_queue_wait = \"60s\"\n",
    );
    for tenant in tenants {
        text.push_str(&format!(
            "\n[tenants.{}]\nkey_sha256 = [\"{}\"]\n{}\n",
            tenant.name,
            hash_key(tenant.key),
            tenant.extra
        ));
    }
    text.push('\n');
    text.push_str(tail);
    text
}

/// [`policy`] with one tenant.
pub fn one_tenant_policy(name: &str, key: &str, extra: &str) -> String {
    policy(&[TenantSpec { name, key, extra }], "")
}

/// A server (with its own embedded model) whose one tenant `alpha` (key `key`) has
/// `tenant_extra` limits, proxying these `--upstream` values (tests/upstream.rs,
/// tests/scaleout.rs).
pub async fn proxy_gateway(key: &str, upstreams: &[String], tenant_extra: &str) -> TestServer {
    let text = one_tenant_policy("alpha", key, tenant_extra);
    let options = Options {
        upstreams: upstreams
            .iter()
            .map(|value| value.parse::<UpstreamSpec>().expect("valid --upstream"))
            .collect(),
        ..Options::default()
    };
    TestServer::start_with(&text, options).await
}

/// A chat body with one user message.
pub fn chat(content: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// A prompt the model answers at length (greedy): used to keep a request running. Greedy, the
/// default model writes past 2,000 tokens without an end-of-sequence token (where "Count from
/// 1 to 500" stopped after 122 tokens, about a second on an idle machine: too short to hold a
/// slot).
pub const LONG_ANSWER: &str = "Write a very long story about a dragon.";

/// Starts a long greedy stream for `key` and returns once its first token arrived, so the
/// request is certainly admitted and running. Dropping the reply disconnects the client.
pub async fn hold_slot(client: &Client, key: &str, max_tokens: u32) -> SseReply {
    let mut body = chat(LONG_ANSWER, max_tokens);
    body["stream"] = serde_json::json!(true);
    let mut reply = client
        .stream("/v1/chat/completions", Some(key), &body)
        .await;
    assert_eq!(
        reply.status.as_u16(),
        200,
        "the slot-holding request must be admitted"
    );
    let role = reply.next_data().await.expect("role chunk");
    assert!(role.contains("\"role\":\"assistant\""), "{role}");
    let first = reply.next_data().await.expect("first token");
    assert!(first.contains("chat.completion.chunk"), "{first}");
    reply
}

/// Polls `condition` every 10 ms; panics with `what` if it does not hold within `limit`.
pub async fn wait_until(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Requests of `tenant` waiting in admission's queue (as of the dispatcher's last step).
pub fn queued(server: &TestServer, tenant: &str) -> usize {
    server
        .admission
        .queue_snapshot()
        .iter()
        .find(|row| row.tenant == tenant)
        .map_or(0, |row| row.queued_requests)
}

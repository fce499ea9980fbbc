//! A model file's own chat template through the real binary: a template that never ends is
//! stopped by its step budget, answered with a 500 naming the template, and neither wedges the
//! server (probes, SIGTERM) nor hangs `kvgate generate`.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::Client;
use common::process::{one_error_line, run, scratch_dir, serve};
use hyper::StatusCode;
use kvgate_runtime::synth::{SynthDtype, SynthModel, SynthShape, SynthSpec};

/// 10^10 loop steps: hours without a budget.
const NEVER_ENDS: &str =
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}ok";

/// A tiny synthetic model whose `tokenizer.chat_template` is `template`, named `NAME.gguf`.
fn model_with_template(dir: &Path, name: &str, template: &str) -> PathBuf {
    let path = dir.join(format!("{name}.gguf"));
    let spec = SynthSpec {
        shape: SynthShape::Tiny,
        dtype: SynthDtype::Q4_0,
        seed: 1,
    };
    SynthModel::new(spec)
        .with_chat_template(template)
        .write_to(&path, &mut |_| {})
        .expect("synthetic model written");
    path
}

fn chat_body(model: &str) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_never_ends_is_a_500_and_the_server_stays_responsive() {
    let home = scratch_dir("loop-template");
    let model = model_with_template(&home, "loops", NEVER_ENDS);
    let model_arg = model.to_str().expect("utf-8 path");
    let server = serve(
        &[
            "--model",
            model_arg,
            "--listen",
            "127.0.0.1:0",
            "--kv-memory",
            "16MiB",
        ],
        &home,
    );
    let client = Client::new(server.addr);
    // Two at once: small bodies are validated on the async workers, and QA saw two such
    // requests hold both of them for good.
    let started = Instant::now();
    let body = chat_body("loops");
    let (a, b) = tokio::join!(
        client.post("/v1/chat/completions", Some("k"), &body),
        client.post("/v1/chat/completions", Some("k"), &body),
    );
    for reply in [a, b] {
        assert_eq!(
            reply.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{:?}",
            reply.body
        );
        let error = &reply.json()["error"];
        assert_eq!(error["code"], "chat_template_error", "{error}");
        assert_eq!(error["type"], "server_error", "{error}");
        let message = error["message"].as_str().expect("message");
        assert!(message.contains("tokenizer.chat_template"), "{message}");
        assert_eq!(reply.header("x-should-retry"), Some("false"));
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let health = client.get("/healthz", None).await;
    assert_eq!(health.status, StatusCode::OK);

    let (status, rest) = server.stop();
    assert!(status.success(), "exit after SIGTERM: {status}");
    assert!(
        rest.iter()
            .any(|line| line.contains("ERROR") && line.contains("chat template")),
        "the failure is logged as an error: {rest:#?}"
    );
}

#[test]
fn generate_with_a_template_that_never_ends_fails_with_one_line() {
    let home = scratch_dir("loop-template-generate");
    let model = model_with_template(&home, "loops", NEVER_ENDS);
    let model_arg = model.to_str().expect("utf-8 path");
    let output = run(
        &[
            "generate",
            "--model",
            model_arg,
            "--max-tokens",
            "1",
            "--threads",
            "1",
            "hi",
        ],
        &home,
    );
    let line = one_error_line(&output);
    assert!(line.contains("budget"), "{line}");
}

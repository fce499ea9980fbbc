//! README.md's examples, run as written there: the blocks are read from the README itself, so
//! a README that stops telling the truth fails here. The Python SDK example runs in
//! `tests/python/test_readme.py`; that every `kvgate` command line parses is checked by the
//! binary's unit tests (`src/readme_commands.rs`).

mod common;

use std::path::Path;
use std::process::Command;

use common::process::{kvgate, run, scratch_dir, serve};
use common::readme::{commands, console_output, readme, the_block};
use common::{Client, MODEL};
use kvgate_gateway::metrics::KV_BLOCKS;
use kvgate_gateway::metrics::exposition::Scrape;
use kvgate_gateway::policy::{OnStoreError, UnknownKeys, parse_policy};
use kvgate_gateway::upstream::file::parse_upstreams_file;
use serde_json::Value;

/// Where the README's examples expect the server.
const README_ADDR: &str = "127.0.0.1:8080";

/// A README command line split as a shell would, without the leading `kvgate`.
fn kvgate_args(command: &str) -> Vec<String> {
    let words = shlex::split(command).unwrap_or_else(|| panic!("unbalanced quotes: {command}"));
    assert_eq!(
        words.first().map(String::as_str),
        Some("kvgate"),
        "{command}"
    );
    words[1..].to_vec()
}

/// The one command of `lang` block `marker` that starts with `prefix`.
fn readme_command(lang: &str, marker: &str, prefix: &str) -> String {
    let block = the_block(&readme(), lang, marker);
    let mut found: Vec<String> = commands(&block)
        .into_iter()
        .filter(|command| command.starts_with(prefix))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "README.md:{}: one `{prefix}` command",
        block.line
    );
    found.remove(0)
}

/// `sh -c SCRIPT` in `cwd`, with this build's `kvgate` first on PATH (as after
/// `cargo install --path .`); its stdout, which must be a success's.
fn shell(script: &str, cwd: &Path) -> String {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_kvgate")).parent().unwrap();
    let path = std::env::join_paths(std::iter::once(bin_dir.to_path_buf()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))
    .unwrap();
    let output = Command::new("sh")
        .args(["-c", script])
        .env("PATH", path)
        .current_dir(cwd)
        .output()
        .expect("sh runs");
    assert!(
        output.status.success(),
        "`{script}` failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_run_command_curl_top_and_plan_examples_work_on_a_live_server() {
    // The README's run command is `kvgate serve` with no flags (`cargo run --release -- serve`):
    // the same defaults here, except an ephemeral port, from a directory with no policies/.
    let run_command = readme_command("sh", "cargo run", "cargo run --release -- serve");
    assert_eq!(run_command, "cargo run --release -- serve");
    let home = scratch_dir("readme");
    let server = serve(&["--listen", "127.0.0.1:0"], &home);
    let addr = server.addr.to_string();

    // First request: the curl example, verbatim but for the port.
    let block = the_block(
        &readme(),
        "sh",
        "curl -s http://127.0.0.1:8080/v1/chat/completions",
    );
    assert!(block.body.contains(README_ADDR));
    let answer = shell(&block.body.replace(README_ADDR, &addr), &home);
    let answer: Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"));
    assert_eq!(answer["model"], MODEL);
    let content = answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(!content.trim().is_empty(), "{answer}");

    // `kvgate top`, once instead of forever.
    let top = readme_command("bash", "kvgate top", "kvgate top");
    let mut args = kvgate_args(&top.replace(README_ADDR, &addr));
    args.push("--once".into());
    let output = kvgate().args(&args).output().unwrap();
    let screen = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{top}: {output:?}");
    assert!(
        screen.contains(&format!("kvgate top — http://{addr}")),
        "{screen}"
    );
    assert!(screen.contains("\nKV   ["), "{screen}");

    // The README says plan's block count is exactly what serve allocates for the same budget:
    // the server runs with the default --kv-memory (256MiB), which is the example's --memory.
    let plan = readme_command("bash", "kvgate plan --model", "kvgate plan");
    assert!(plan.contains("--memory 256MiB"), "{plan}");
    let report: Value = serde_json::from_str(&shell(&plan, &home)).expect("--json output");
    assert_eq!(report["max_context"], 8192, "{report}");
    assert!(
        report["weights_bytes"].as_u64().unwrap_or(0) > 0,
        "{report}"
    );
    let metrics = Client::new(server.addr).get("/metrics", None).await;
    let scrape = Scrape::parse(&String::from_utf8_lossy(&metrics.body)).unwrap();
    assert_eq!(
        scrape.value(KV_BLOCKS, &[("state", "total")]),
        report["num_blocks"].as_f64(),
        "plan's block count is the server's"
    );

    let (status, _) = server.stop();
    assert!(status.success(), "{status}");
}

#[test]
fn the_readme_plan_output_is_what_kvgate_plan_prints() {
    let block = the_block(&readme(), "console", "$ kvgate plan");
    let command = commands(&block).remove(0);
    let output = run(
        &kvgate_args(&command)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        Path::new(env!("CARGO_MANIFEST_DIR")),
    );
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        console_output(&block),
        "README.md:{}: `{command}` prints something else",
        block.line
    );
}

#[test]
fn the_readme_policy_snippets_load_and_mean_what_the_readme_says() {
    let text = readme();
    let snippets = common::readme::blocks_in(&text, "toml");
    assert!(snippets.len() >= 2, "the README shows policy snippets");
    for block in &snippets {
        let name = format!("README.md:{}", block.line);
        // An upstreams file ("Scaling out"), not a policy: it must load as one.
        if block.body.starts_with("# upstreams.toml") {
            let specs = parse_upstreams_file(Path::new(&name), &block.body)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(specs.len() >= 2, "{name}: the example has two replicas");
            assert!(
                specs.iter().all(|spec| spec.name == specs[0].name),
                "{name}"
            );
            continue;
        }
        let policy = parse_policy(&name, &block.body).unwrap_or_else(|e| panic!("{e}"));
        // Each snippet states, in a comment, what an unknown key gets.
        let expected = if block.body.contains("# unknown keys: anonymous") {
            UnknownKeys::Anonymous
        } else if block.body.contains("# unknown keys: reject") {
            UnknownKeys::Reject
        } else {
            panic!("{name}: the snippet must say `# unknown keys: anonymous|reject`");
        };
        assert_eq!(policy.unknown_keys(), expected, "{name}");
        // The "Scaling out" snippet shares limits between two gateway replicas.
        if block.body.contains("[shared]") {
            let shared = policy.shared.as_ref().expect("[shared] parsed");
            assert_eq!(shared.replicas, 2, "{name}");
            assert_eq!(shared.on_store_error, OnStoreError::Local, "{name}");
        }
    }
}

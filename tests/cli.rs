//! The `kvgate` binary as a new user meets it: run from a directory that is not the checkout,
//! logs piped to a file, a taken port, a mistyped `--model` or `--policy`. Each failure must be
//! one line on stderr that names the cause once.

mod common;

use std::net::TcpListener;
use std::path::Path;

use common::process::{one_error_line, run, scratch_dir, serve};
use common::{Client, MODEL, chat};
use hyper::StatusCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_from_any_directory_on_the_built_in_policy_with_plain_piped_logs() {
    // No policies/ folder and no model under this directory: the built-in default policy and
    // the user-wide model cache (KVGATE_CACHE_DIR here) must be used.
    let home = scratch_dir("serve-anywhere");
    let server = serve(&["--listen", "localhost:0", "--kv-memory", "64MiB"], &home);
    assert!(server.addr.ip().is_loopback(), "{}", server.addr);
    assert!(
        server.addr.port() != 0,
        "the bound port, not the requested 0"
    );
    let ready = server.log.last().unwrap().clone();
    assert!(
        ready.contains("policy=(built-in policies/default.toml)"),
        "{ready}"
    );
    assert!(
        server
            .log
            .iter()
            .any(|line| line.contains("using the built-in default policy")),
        "{:#?}",
        server.log
    );

    // The official SDKs always send a key; on the keyless default policy a placeholder is
    // served as the anonymous tenant.
    let client = Client::new(server.addr);
    let reply = client
        .post(
            "/v1/chat/completions",
            Some("unused-for-anonymous"),
            &chat("Say hi.", 4),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["model"], MODEL);

    let mut log = server.log.clone();
    let (status, rest) = server.stop();
    assert!(status.success(), "exit after SIGTERM: {status}");
    log.extend(rest);
    assert!(
        log.iter().all(|line| !line.contains('\u{1b}')),
        "no ANSI escapes in a piped log: {log:#?}"
    );
}

#[test]
fn a_taken_port_is_one_error_line_before_the_model_loads_and_never_ready() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let home = scratch_dir("port-taken");
    let output = common::process::kvgate()
        .args(["serve", "--listen", &addr.to_string()])
        // A model that does not exist: if the port were bound after loading, this would be the
        // error instead.
        .args(["--model", "/nonexistent/model.gguf"])
        .env("RUST_LOG", "info")
        .current_dir(&home)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert!(!stderr.contains("kvgate ready"), "{stderr}");
    let error = stderr
        .lines()
        .filter(|line| line.starts_with("kvgate: error: "))
        .collect::<Vec<_>>();
    assert_eq!(
        error,
        [format!(
            "kvgate: error: cannot listen on {addr}: the address is already in use (is another \
             kvgate running?); pick a free one with --listen"
        )],
        "{stderr}"
    );
    assert!(!output.status.success());
    drop(taken);
}

#[test]
fn model_path_mistakes_are_one_line_naming_what_was_expected_and_found() {
    let home = scratch_dir("model-errors");
    let missing = one_error_line(&run(
        &["generate", "--model", "/nonexistent/m.gguf", "hi"],
        &home,
    ));
    assert_eq!(
        missing,
        "kvgate: error: --model /nonexistent/m.gguf: expected a GGUF model file, found nothing \
         at that path"
    );

    let dir = home.display().to_string();
    let directory = one_error_line(&run(&["tokenize", "--model", &dir, "hi"], &home));
    assert_eq!(
        directory,
        format!("kvgate: error: --model {dir}: expected a GGUF model file, found a directory")
    );

    let text = home.join("notes.txt");
    std::fs::write(&text, "just some text\n").unwrap();
    let text = text.display().to_string();
    let not_gguf = one_error_line(&run(&["generate", "--model", &text, "hi"], &home));
    assert_eq!(
        not_gguf,
        format!(
            "kvgate: error: {text}: not a GGUF file: expected it to start with \"GGUF\", found \
             \"just\""
        )
    );
    let plan = one_error_line(&run(
        &[
            "plan",
            "--model",
            "/nonexistent/m.gguf",
            "--memory",
            "1GiB",
            "--max-context",
            "64",
        ],
        &home,
    ));
    assert!(plan.contains("found nothing at that path"), "{plan}");
}

#[test]
fn a_missing_policy_file_says_so_and_how_to_pass_one() {
    let home = scratch_dir("policy-missing");
    let line = one_error_line(&run(&["serve", "--policy", "nope.toml"], &home));
    assert_eq!(
        line,
        "kvgate: error: --policy nope.toml: no such file; pass the path of a policy TOML file \
         (examples: policies/ in the repository), or leave out --policy to use the built-in \
         default"
    );
}

#[test]
fn listen_takes_ip_port_or_host_port_and_explains_anything_else() {
    let home = scratch_dir("listen");
    let output = run(&["serve", "--listen", "8080"], &home);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("expected IP:PORT or HOST:PORT"), "{stderr}");
    assert!(
        !stderr.contains("invalid socket address syntax"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_workers_sets_the_threads_serving_http_and_refuses_zero() {
    let home = scratch_dir("http-workers");
    let output = run(&["serve", "--http-workers", "0"], &home);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("--http-workers"), "{stderr}");

    let server = serve(
        &[
            "--listen",
            "127.0.0.1:0",
            "--kv-memory",
            "64MiB",
            "--http-workers",
            "3",
        ],
        &home,
    );
    // The async runtime names its workers; the engine's threads are named otherwise.
    let workers = std::fs::read_dir(format!("/proc/{}/task", server.pid()))
        .expect("/proc lists the server's threads")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "tokio-rt-worker")
        .count();
    // 3: not the default (one per core) on the machines this runs on.
    assert_eq!(workers, 3, "threads named tokio-rt-worker");
    let reply = Client::new(server.addr)
        .post("/v1/chat/completions", None, &chat("Say hi.", 4))
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let (status, _) = server.stop();
    assert!(status.success(), "exit after SIGTERM: {status}");
}

#[test]
fn policy_check_says_ok_once_and_which_unknown_keys_mode_applies() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let check = |file: &str| {
        let output = run(&["policy", "check", file], root);
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).unwrap()
    };
    let default = check("policies/default.toml");
    assert!(
        default.starts_with("policies/default.toml: OK\n"),
        "{default}"
    );
    assert_eq!(
        default.to_lowercase().matches(": ok").count(),
        1,
        "{default}"
    );
    assert!(default.contains("\nunknown keys: anonymous ("), "{default}");
    let multi = check("policies/multi-tenant.toml");
    assert!(multi.contains("\nunknown keys: reject ("), "{multi}");
}

#[test]
fn an_invalid_policy_is_one_line_with_its_location() {
    let home = scratch_dir("policy-invalid");
    let file = home.join("p.toml");
    std::fs::write(&file, "unknown_keys = \"anonymous\"\n[tenants.a]\n").unwrap();
    let file = file.display().to_string();
    let line = one_error_line(&run(&["policy", "check", &file], &home));
    assert!(
        line.starts_with(&format!("kvgate: error: {file}:1:16: `unknown_keys`: ")),
        "{line}"
    );
}

#[test]
fn an_upstreams_file_is_checked_with_locations_and_summarised() {
    let home = scratch_dir("upstreams-check");
    let file = home.join("upstreams.toml");
    let good = "[[replica]]\nname = \"m\"\nurl = \"http://10.0.0.5:8000\"\n\n\
                [[replica]]\nname = \"m\"\nurl = \"http://10.0.0.6:8000\"\ncapacity = 4096\n";
    std::fs::write(&file, good).unwrap();
    let path = file.display().to_string();
    let output = run(&["policy", "check-upstreams", &path], &home);
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(
        stdout.starts_with(&format!("{path}: OK\nm: 2 replica(s)\n")),
        "{stdout}"
    );

    std::fs::write(
        &file,
        "[[replica]]\nname = \"m\"\nurl = \"10.0.0.5:8000\"\n",
    )
    .unwrap();
    let line = one_error_line(&run(&["policy", "check-upstreams", &path], &home));
    assert!(
        line.starts_with(&format!("kvgate: error: {path}:3:7: `replica.url`: ")),
        "{line}"
    );
}

#[test]
fn logs_are_coloured_on_a_terminal_unless_no_color_is_set() {
    // `script` (util-linux, essential on Debian) gives the child a pseudo-terminal. A taken port
    // makes serve log one line and exit before any model work.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let command = format!(
        "{} serve --listen {}",
        env!("CARGO_BIN_EXE_kvgate"),
        taken.local_addr().unwrap()
    );
    let on_terminal = |no_color: Option<&str>| {
        let mut script = std::process::Command::new("script");
        script.args(["-q", "-e", "-c", &command, "/dev/null"]);
        script.env_remove("NO_COLOR").env("RUST_LOG", "info");
        if let Some(value) = no_color {
            script.env("NO_COLOR", value);
        }
        let output = script.output().expect("script runs");
        let text = String::from_utf8_lossy(&output.stdout).to_string();
        assert!(
            text.contains("using the built-in default policy"),
            "the log line was written: {text:?}"
        );
        text
    };
    assert!(
        on_terminal(None).contains("\u{1b}["),
        "colour on a terminal"
    );
    assert!(!on_terminal(Some("1")).contains("\u{1b}["), "NO_COLOR=1");
}

/// Runs `kvgate ARGS` with `stdout` as its standard output; returns its exit code and stderr.
fn run_with_stdout(args: &[&str], stdout: std::process::Stdio) -> (Option<i32>, String) {
    let home = scratch_dir("stdout");
    let output = common::process::kvgate()
        .args(args)
        .current_dir(&home)
        .stdout(stdout)
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).to_string(),
    )
}

const PLAN_13B: [&str; 10] = [
    "plan",
    "--layers",
    "40",
    "--hidden",
    "5120",
    "--max-context",
    "4096",
    "--memory",
    "40GiB",
    "--json",
];

#[test]
fn a_stdout_that_cannot_be_written_is_one_error_line_not_a_panic() {
    // /dev/full: every write fails with ENOSPC, as on a full disk.
    let full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full opens")
            .into()
    };
    for args in [
        &["tokenize", "hello"][..],
        &PLAN_13B[..],
        &["policy", "hash-key", "some-key"],
        &["policy", "new-key"],
    ] {
        assert_fails_with_one_line(
            args,
            full(),
            "kvgate: error: No space left on device (os error 28)\n",
        );
    }
}

/// Runs `kvgate ARGS` with `stdout` and checks it exits 1 with exactly `line` on stderr (no
/// panic, no backtrace).
fn assert_fails_with_one_line(args: &[&str], stdout: std::process::Stdio, line: &str) {
    let (code, stderr) = run_with_stdout(args, stdout);
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert_eq!(code, Some(1), "{args:?}: {stderr}");
    assert_eq!(stderr, line, "{args:?}");
}

#[test]
fn a_closed_pipe_on_stdout_is_the_error_generate_gives_not_a_panic() {
    // `kvgate plan ... | head -0`: the reader is gone before the first write.
    for args in [&PLAN_13B[..], &["tokenize", "hello"]] {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        assert_fails_with_one_line(
            args,
            writer.into(),
            "kvgate: error: Broken pipe (os error 32)\n",
        );
    }
}

#[test]
fn a_kv_budget_over_the_hosts_memory_is_refused_before_it_is_allocated() {
    let home = scratch_dir("kv-too-big");
    // Far above the memory of any machine these tests run on; allocating it would take the
    // host down (or abort), never end in one error line within seconds.
    let started = std::time::Instant::now();
    for command in ["serve", "generate"] {
        let mut args = vec![command, "--kv-memory", "64TiB"];
        match command {
            "serve" => args.extend(["--listen", "127.0.0.1:0"]),
            _ => args.push("hi"),
        }
        let output = run(&args, &home);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        // serve logs its startup (policy, device) before the error; the error is one line.
        let errors = stderr
            .lines()
            .filter(|line| line.contains("error"))
            .collect::<Vec<_>>();
        assert_eq!(errors.len(), 1, "{stderr}");
        let line = errors[0];
        assert!(line.starts_with("kvgate: error: loading "), "{line}");
        assert!(
            line.contains("KV memory budget 64TiB plus the model's weights ")
                && line.contains("MemAvailable in /proc/meminfo); lower --kv-memory"),
            "{line}"
        );
    }
    assert!(
        started.elapsed() < std::time::Duration::from_secs(120),
        "refused at startup: {:?}",
        started.elapsed()
    );
}

#[test]
fn plan_with_a_model_and_no_max_context_uses_the_models_trained_context() {
    let home = scratch_dir("plan-model-context");
    let model = run(&["fetch-model"], &home);
    assert!(model.status.success(), "{model:?}");
    let model = String::from_utf8(model.stdout).unwrap();
    let model = model.trim_end();
    let output = run(
        &["plan", "--model", model, "--memory", "256MiB", "--json"],
        &home,
    );
    assert!(output.status.success(), "{output:?}");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    // SmolLM2-135M's trained context (GGUF llama.context_length).
    assert_eq!(report["max_context"], 8192, "{report}");
    assert_eq!(report["blocks_per_request"], 8192 / 16, "{report}");

    // An explicit shape has no trained context to fall back on.
    let line = one_error_line(&run(
        &[
            "plan", "--layers", "2", "--hidden", "64", "--memory", "1MiB",
        ],
        &home,
    ));
    assert!(line.contains("--max-context is required"), "{line}");
}

#[test]
fn zero_counts_are_refused_naming_the_flag_never_clamped() {
    let home = scratch_dir("zero-counts");
    for args in [
        &["serve", "--block-size", "0"][..],
        &["generate", "--block-size", "0", "hi"],
        &["bench", "--threads", "0"],
        &["serve", "--threads", "0"],
        &[
            "plan",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--memory",
            "1MiB",
            "--max-context",
            "64",
            "--block-size",
            "0",
        ],
        &[
            "plan",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--memory",
            "1MiB",
            "--max-context",
            "0",
        ],
    ] {
        let output = run(args, &home);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(!output.status.success(), "{args:?}");
        let flag = args[args.iter().position(|a| *a == "0").unwrap() - 1];
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        let first = stderr.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("kvgate: error: invalid value '0' for '")
                && first.contains(flag)
                && first.ends_with("': must be at least 1"),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn plan_sizes_that_overflow_are_one_line_naming_the_value() {
    let home = scratch_dir("plan-overflow");
    let max = "4294967295";
    let line = one_error_line(&run(
        &[
            "plan",
            "--layers",
            max,
            "--hidden",
            max,
            "--memory",
            "1GiB",
            "--max-context",
            max,
            "--json",
        ],
        &home,
    ));
    assert!(
        line.starts_with("kvgate: error: KV bytes per token overflows: "),
        "{line}"
    );
    let line = one_error_line(&run(
        &[
            "plan",
            "--layers",
            "30",
            "--kv-heads",
            "3",
            "--head-dim",
            "64",
            "--memory",
            "1GiB",
            "--max-context",
            "4096",
            "--block-size",
            max,
        ],
        &home,
    ));
    assert!(
        line.starts_with("kvgate: error: --memory 1GiB is smaller than one KV block"),
        "{line}"
    );
}

/// Runs `kvgate ARGS` in `home` and returns its one stderr line, checking the exit code.
fn one_line_with_code(args: &[&str], home: &Path, code: i32) -> String {
    let output = run(args, home);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert_eq!(output.status.code(), Some(code), "{args:?}: {stderr}");
    one_error_line(&output)
}

#[test]
fn argument_errors_are_one_line_and_help_is_unchanged() {
    let home = scratch_dir("clap-one-line");
    for (args, needle) in [
        (&["serve", "--device", "tpu"][..], "'--device <DEVICE>'"),
        (&["generate", "--seed", "-1", "hi"], "'-1'"),
        (&["serve", "--engine-queue", "4294967295"], "--engine-queue"),
        (&["top", "--once", "--interval", "1e20"], "at most 3600"),
        (&["generate"], "<PROMPT>"),
    ] {
        let line = one_line_with_code(args, &home, 2);
        assert!(line.contains(needle), "{args:?}: {line}");
    }
    let help = run(&["serve", "--help"], &home);
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).lines().count() > 10);
}

/// A tiny synthetic model written into `home`.
fn tiny_model(home: &Path) -> String {
    let path = home.join("tiny.gguf");
    let path = path.to_str().expect("utf-8 path").to_owned();
    let output = run(
        &["synth-model", "--shape", "tiny", "--seed", "1", &path],
        home,
    );
    assert!(output.status.success(), "{output:?}");
    path
}

#[test]
fn step_budgets_too_large_for_memory_are_refused_before_allocating() {
    let home = scratch_dir("max-batched");
    let model = tiny_model(&home);
    let line = one_line_with_code(
        &[
            "generate",
            "--model",
            &model,
            "--max-batched-tokens",
            "18446744073709551615",
            "hi",
        ],
        &home,
        1,
    );
    assert!(
        line.ends_with(
            "--max-batched-tokens 18446744073709551615 is too large: the activation workspace \
             for that many tokens per step overflows"
        ),
        "{line}"
    );
    // Terabytes of workspace: refused by the MemAvailable check, not aborted by the allocator.
    let line = one_line_with_code(
        &[
            "generate",
            "--model",
            &model,
            "--max-batched-tokens",
            "10000000000",
            "hi",
        ],
        &home,
        1,
    );
    assert!(
        line.contains("(--max-batched-tokens) is more than the memory this host has available")
            && line.ends_with("lower --kv-memory or --max-batched-tokens"),
        "{line}"
    );
}

#[test]
fn outputs_that_are_not_regular_files_are_refused_and_left_as_they_were() {
    use std::os::unix::fs::FileTypeExt;
    let home = scratch_dir("out-not-file");
    let model = tiny_model(&home);
    let fifo = home.join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    let dir = home.join("dir");
    std::fs::create_dir(&dir).unwrap();
    for out in [&fifo, &dir] {
        let out = out.to_str().unwrap();
        for args in [
            &["synth-model", "--shape", "tiny", out][..],
            &["quantize", &model, out],
        ] {
            let line = one_line_with_code(args, &home, 1);
            assert_eq!(
                line,
                format!(
                    "kvgate: error: {}: exists and is not a regular file; name a file to write",
                    if args[0] == "quantize" {
                        out.to_owned()
                    } else {
                        format!("cannot write {out}")
                    }
                ),
                "{args:?}"
            );
        }
    }
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    let mut left: Vec<_> = std::fs::read_dir(&home)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["dir", "fifo", "tiny.gguf"], "no temporary files");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // An input that is not a regular file is refused, not read without end.
    let line = one_line_with_code(&["quantize", "/dev/zero", "out.gguf"], &home, 1);
    assert_eq!(line, "kvgate: error: /dev/zero: not a regular file");
}

#[test]
fn tokenize_names_the_model_file_in_its_errors() {
    let home = scratch_dir("tokenize-path");
    // A valid GGUF with one key and no vocabulary.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    bytes.extend(1u64.to_le_bytes());
    let key = "general.architecture";
    bytes.extend((key.len() as u64).to_le_bytes());
    bytes.extend(key.as_bytes());
    bytes.extend(8u32.to_le_bytes());
    bytes.extend(5u64.to_le_bytes());
    bytes.extend(b"llama");
    let path = home.join("novocab.gguf");
    std::fs::write(&path, bytes).unwrap();
    let path = path.to_str().unwrap();
    let line = one_line_with_code(&["tokenize", "--model", path, "hi"], &home, 1);
    assert_eq!(
        line,
        format!(
            "kvgate: error: loading {path}: tokenizer: GGUF file has no `tokenizer.ggml.model`"
        )
    );
}

/// A negative number is read as the flag's value and judged as one (QA: `--margin -0.1` and
/// `--seed -1` were "unexpected argument '-0' found").
#[test]
fn negative_numbers_are_values_named_in_the_error() {
    let home = scratch_dir("negative-values");
    let plan = one_error_line(&run(
        &[
            "plan",
            "--memory",
            "1GiB",
            "--layers",
            "2",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--margin",
            "-0.1",
        ],
        &home,
    ));
    assert!(
        plan.contains("--margin must be in [0, 1), got -0.1"),
        "{plan}"
    );
    let out = home.join("x.gguf").display().to_string();
    let synth = one_error_line(&run(
        &["synth-model", "--shape", "tiny", "--seed", "-1", &out],
        &home,
    ));
    assert!(
        synth.starts_with("kvgate: error: invalid value '-1' for '--seed"),
        "{synth}"
    );
}

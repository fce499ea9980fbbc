//! `--device` through the real binary: `cuda` without a driver is one error line naming it,
//! before any model is read; `auto` runs on the CPU and logs why; anything else is refused by
//! the parser with the accepted forms. The driver is pinned to a path that does not exist
//! (`KVGATE_CUDA_DRIVER_LIB`), so these hold on a GPU host too.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::process::{kvgate, scratch_dir};

const NO_DRIVER: &str = "/nonexistent/libcuda.so.1";

/// `kvgate ARGS` with the driver pinned away and `RUST_LOG` as given (None: unset).
fn run(args: &[&str], rust_log: Option<&str>, cwd: &Path) -> Output {
    let mut command: Command = kvgate();
    command
        .args(args)
        .current_dir(cwd)
        .env("KVGATE_CUDA_DRIVER_LIB", NO_DRIVER)
        .env_remove("RUST_LOG");
    if let Some(filter) = rust_log {
        command.env("RUST_LOG", filter);
    }
    command.output().expect("kvgate runs")
}

fn stderr_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn cuda_without_a_driver_is_one_line_naming_it_before_the_model_is_read() {
    let home = scratch_dir("device-cuda");
    // The model path does not exist either: the device is checked first, in milliseconds.
    let cases: [(&[&str], &str); 3] = [
        (
            &[
                "generate",
                "--device",
                "cuda",
                "--model",
                "/nonexistent/m.gguf",
                "hi",
            ],
            "cuda:0",
        ),
        (
            &[
                "bench",
                "--device",
                "cuda:1",
                "--model",
                "/nonexistent/m.gguf",
            ],
            "cuda:1",
        ),
        (
            &[
                "serve",
                "--device",
                "cuda",
                "--listen",
                "127.0.0.1:0",
                "--model",
                "/nonexistent/m.gguf",
            ],
            "cuda:0",
        ),
    ];
    for (args, shown) in cases {
        let output = run(args, None, &home);
        assert_eq!(output.status.code(), Some(1), "{args:?}");
        assert!(output.stdout.is_empty(), "{args:?}");
        let mut lines = stderr_lines(&output);
        if args[0] == "serve" {
            // serve logs at info by default (here: which policy it uses) before it fails.
            lines.retain(|line| !line.contains(" INFO "));
        }
        assert_eq!(
            lines.len(),
            1,
            "{args:?}: one line on stderr, got {lines:#?}"
        );
        let line = &lines[0];
        let start = format!("kvgate: error: --device {shown}: no NVIDIA driver ({NO_DRIVER}");
        assert!(line.starts_with(&start), "{line}");
        assert!(line.contains("install the NVIDIA driver"), "{line}");
        assert!(line.ends_with("; use --device cpu or auto"), "{line}");
        assert!(
            !line.contains("m.gguf"),
            "the model was not looked at: {line}"
        );
    }
}

#[test]
fn anything_but_the_accepted_forms_is_a_usage_error_listing_them() {
    let home = scratch_dir("device-invalid");
    for bad in ["gpu", "cuda:x", "cuda:", "CUDA"] {
        let output = run(&["generate", "--device", bad, "hi"], None, &home);
        assert_eq!(output.status.code(), Some(2), "{bad}: clap's usage error");
        let stderr = String::from_utf8_lossy(&output.stderr);
        // One line, as every CLI error (clap's own usage text is not printed).
        assert_eq!(
            stderr.trim_end(),
            format!(
                "kvgate: error: invalid value '{bad}' for '--device <DEVICE>': expected auto, \
                 cpu, cuda or cuda:N (N a GPU number, e.g. cuda:0), got `{bad}`"
            ),
        );
    }
}

#[test]
fn auto_runs_on_the_cpu_and_logs_why_once() {
    let home = scratch_dir("device-auto");
    let model = home.join("tiny.gguf");
    let model = model.to_str().expect("utf-8 temp path");
    let written = run(
        &["synth-model", "--shape", "tiny", "--seed", "3", model],
        None,
        &home,
    );
    assert!(written.status.success(), "{written:?}");

    let generate = |device: Option<&str>, rust_log: Option<&str>| {
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--raw",
            "--max-tokens",
            "4",
            "hi",
        ];
        if let Some(device) = device {
            args.extend(["--device", device]);
        }
        let output = run(&args, rust_log, &home);
        assert!(output.status.success(), "{device:?}: {output:?}");
        assert!(!output.stdout.is_empty(), "{device:?}: generated text");
        output
    };
    // With RUST_LOG=info every stderr line is a log line, and exactly one names the device.
    let device_line = |output: &Output| -> String {
        let lines = stderr_lines(output);
        assert!(lines.iter().all(|l| l.contains(" INFO ")), "{lines:#?}");
        let device: Vec<&String> = lines.iter().filter(|l| l.contains("device:")).collect();
        assert_eq!(device.len(), 1, "{lines:#?}");
        let line = device[0];
        line[line.find("device:").expect("filtered on it")..].to_owned()
    };

    let auto = generate(Some("auto"), Some("info"));
    let line = device_line(&auto);
    assert!(
        line.starts_with(&format!("device: cpu (no NVIDIA driver ({NO_DRIVER}")),
        "{line}"
    );
    let default = generate(None, Some("info"));
    assert_eq!(device_line(&default), line, "auto is the default");
    assert_eq!(default.stdout, auto.stdout);

    // Quiet without RUST_LOG: stdout is the text and stderr is empty.
    let quiet = generate(Some("auto"), None);
    assert!(
        quiet.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&quiet.stderr)
    );
    assert_eq!(quiet.stdout, auto.stdout);

    let cpu = generate(Some("cpu"), Some("info"));
    assert_eq!(device_line(&cpu), "device: cpu (--device cpu)");
    assert_eq!(cpu.stdout, auto.stdout, "the same CPU backend either way");
}

//! Every `kvgate` command line in README.md parses with the real command-line definition, so a
//! renamed flag or subcommand cannot leave the README behind. (What the commands print and
//! serve is checked by `tests/readme.rs` and `tests/python/test_readme.py`.)

#[path = "../tests/common/readme.rs"]
mod readme;

use clap::Parser;

use crate::cli::Cli;

/// The kvgate arguments of a README command line: `kvgate ARGS` or `cargo run ... -- ARGS`.
fn kvgate_args(command: &str) -> Option<Vec<String>> {
    let words = shlex::split(command)?;
    match words.first().map(String::as_str) {
        Some("kvgate") => Some(words[1..].to_vec()),
        Some("cargo") if words.get(1).map(String::as_str) == Some("run") => {
            let dashes = words.iter().position(|word| word == "--")?;
            Some(words[dashes + 1..].to_vec())
        }
        _ => None,
    }
}

#[test]
fn every_kvgate_command_in_the_readme_parses() {
    let text = readme::readme();
    let mut checked = 0;
    for block in readme::blocks(&text) {
        if !matches!(block.lang.as_str(), "sh" | "bash" | "console") {
            continue;
        }
        for command in readme::commands(&block) {
            let Some(args) = kvgate_args(&command) else {
                continue;
            };
            let argv = std::iter::once("kvgate".to_owned()).chain(args);
            if let Err(error) = Cli::try_parse_from(argv) {
                panic!(
                    "README.md:{}: `{command}` does not parse:\n{error}",
                    block.line
                );
            }
            checked += 1;
        }
    }
    // serve (cargo run), plan twice, top, the upstream example: the README has at least these.
    assert!(
        checked >= 5,
        "only {checked} kvgate commands found in README.md"
    );
}

#[test]
fn command_lines_are_found_in_console_and_shell_blocks() {
    let block = readme::Block {
        lang: "console".into(),
        body: "$ kvgate plan --layers 2 \\\n    --json\nshape  2 layers\n".into(),
        line: 1,
    };
    assert_eq!(readme::commands(&block), ["kvgate plan --layers 2 --json"]);
    assert_eq!(readme::console_output(&block), "shape  2 layers\n");
    assert_eq!(
        kvgate_args("cargo run --release -- serve --listen localhost:8080"),
        Some(vec![
            "serve".into(),
            "--listen".into(),
            "localhost:8080".into()
        ])
    );
    assert_eq!(kvgate_args("curl -s http://x"), None);
}

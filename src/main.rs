//! The `kvgate` binary: parse the command line, then hand off to one command.

mod cli;
mod commands;
mod logging;
#[cfg(test)]
mod readme_commands;
mod serve;
mod top;

use std::process::ExitCode;

use clap::Parser;

/// mimalloc instead of glibc's malloc: the gateway allocates many small, short-lived objects per
/// request (headers, JSON, futures), and in front of a fast upstream glibc's malloc and free
/// were about a tenth of the CPU a relayed request costs.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return clap_error(err),
    };
    let result = match cli.command {
        cli::Command::Serve(args) => serve::run(args),
        cli::Command::Generate(args) => commands::generate(args),
        cli::Command::Tokenize(args) => commands::tokenize(args),
        cli::Command::Bench(args) => commands::bench(args),
        cli::Command::Plan(args) => commands::plan(args),
        cli::Command::Policy(cmd) => commands::policy(cmd),
        cli::Command::Top(args) => commands::top(args),
        cli::Command::FetchModel => commands::fetch_model(),
        cli::Command::SynthModel(args) => commands::synth_model(args),
        cli::Command::Quantize(args) => commands::quantize(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvgate: error: {}", one_line(&err));
            ExitCode::FAILURE
        }
    }
}

/// `--help`, `--version` and a bare `kvgate` print as clap prints them; an argument error is
/// one line like every other error (clap's own take 3-7 lines: the error, a hint, the usage),
/// with clap's exit code 2.
fn clap_error(err: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        err.exit();
    }
    eprintln!("kvgate: error: {}", clap_line(&err.render().to_string()));
    ExitCode::from(2)
}

/// clap's rendered error on one line: its lines joined, without the `error: ` prefix, the
/// usage block and the pointer to `--help`.
fn clap_line(rendered: &str) -> String {
    let mut line = String::new();
    let mut in_usage = false;
    for part in rendered.lines().map(str::trim) {
        if part.starts_with("Usage:") {
            in_usage = true;
        }
        if part.is_empty() {
            in_usage = false;
        }
        if in_usage || part.is_empty() || part.starts_with("For more information") {
            continue;
        }
        let part = part.strip_prefix("error: ").unwrap_or(part);
        if !line.is_empty() {
            line.push_str(if line.ends_with(':') { " " } else { "; " });
        }
        line.push_str(part);
    }
    line
}

/// The error and its causes on one line, each cause only where its text is not already in the
/// line: many errors write their cause into their own message *and* return it as `source()`,
/// and printing the chain as is said the same OS error up to three times.
fn one_line(err: &anyhow::Error) -> String {
    let mut line = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    use super::*;

    #[test]
    fn clap_errors_are_one_line_without_usage_or_help_pointer() {
        let line = |args: &[&str]| {
            let err = cli::Cli::try_parse_from(args).expect_err("refused");
            clap_line(&err.render().to_string())
        };
        assert_eq!(
            line(&["kvgate", "serve", "--block-size", "0"]),
            "invalid value '0' for '--block-size <N>': must be at least 1"
        );
        let missing = line(&["kvgate", "generate"]);
        assert_eq!(
            missing,
            "the following required arguments were not provided: <PROMPT>"
        );
        let choice = line(&["kvgate", "serve", "--prefill-order", "fifo"]);
        assert!(
            choice.starts_with("invalid value 'fifo' for '--prefill-order <PREFILL_ORDER>'")
                && choice.contains("[possible values: tenant-fair, fcfs]"),
            "{choice}"
        );
        for text in [missing, choice] {
            assert!(
                !text.contains("Usage") && !text.contains("--help"),
                "{text}"
            );
        }
    }

    #[test]
    fn a_cause_already_in_the_message_is_said_once() {
        let os = std::io::Error::from_raw_os_error(2);
        let os_text = os.to_string();
        let wrapped = std::io::Error::other(format!("cannot open /m.gguf: {os_text}"));
        let err = Err::<(), _>(os)
            .context(wrapped.to_string())
            .context("loading /m.gguf")
            .unwrap_err();
        let line = one_line(&err);
        assert_eq!(line.matches(&os_text).count(), 1, "{line}");
        assert_eq!(
            line,
            format!("loading /m.gguf: cannot open /m.gguf: {os_text}")
        );
        let plain = anyhow::anyhow!("first").context("second");
        assert_eq!(one_line(&plain), "second: first");
    }
}

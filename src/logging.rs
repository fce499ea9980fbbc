//! Logging to stderr for every subcommand: `RUST_LOG` filters (else the subcommand's default
//! level), colour only where a person reads it, JSON on request.

use std::ffi::OsStr;
use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// Installs the process's subscriber. `default_level` applies when `RUST_LOG` is unset or
/// invalid: `serve` logs at `info`; one-shot commands (`generate`, `bench`) at `warn`, so their
/// stderr stays empty on success. A subscriber already set keeps its settings.
pub fn init(format: LogFormat, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let ansi = use_color(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Plain => builder.try_init(),
    };
}

/// Colour only on a terminal, and never when `NO_COLOR` is set to anything non-empty
/// (<https://no-color.org>): logs piped to files or journald stay plain text.
fn use_color(stderr_is_terminal: bool, no_color: Option<&OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|value| value.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_color(true, None));
        assert!(
            use_color(true, Some(OsStr::new(""))),
            "an empty NO_COLOR is unset"
        );
        assert!(!use_color(true, Some(OsStr::new("1"))));
        assert!(!use_color(false, None));
    }
}

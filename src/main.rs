//! The `kvgate` binary: parse the command line, then hand off to one command.

mod cli;
mod commands;
mod serve;
mod top;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvgate: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

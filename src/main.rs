//! The `distgpt` command.

mod cli;
#[cfg(test)]
#[path = "testdir.rs"]
mod testdir;

use std::process::ExitCode;

fn main() -> ExitCode {
    match cli::run() {
        Ok(cli::Outcome::Done) => ExitCode::SUCCESS,
        Ok(cli::Outcome::Stopped) => ExitCode::from(cli::STOPPED_EXIT_CODE),
        Err(e) => {
            distgpt::errln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

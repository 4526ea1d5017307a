//! The `stoker` binary: parses flags and hands over to the library.
#![forbid(unsafe_code)]

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = stoker_daemon::cli::Cli::parse();
    match stoker_daemon::cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("stoker: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

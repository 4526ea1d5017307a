//! The `stoker` binary's command line: the clap definition of every
//! subcommand and flag, and [`run`], which hands each subcommand to its module
//! (`serve` runs the daemon; the others are clients of it or offline checks).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use connect::Target;
use serve::LogFormat;

/// `print!` to stdout that ends the program quietly when the reader has gone
/// (`stoker datasets | head -1`) instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => { $crate::cli::output::stdout(format_args!($($arg)*), false) };
}

/// `println!` likewise.
macro_rules! outln {
    () => { $crate::cli::output::stdout(format_args!(""), true) };
    ($($arg:tt)*) => { $crate::cli::output::stdout(format_args!($($arg)*), true) };
}

mod cache;
mod connect;
mod datasets;
mod inspect;
mod output;
mod run;
mod serve;
mod status;
mod users;
mod validate;

pub use cache::format_cache;
pub use status::format_status;

/// stoker: a per-node daemon that serves training data through shared memory.
#[derive(Debug, Parser)]
#[command(name = "stoker", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon.
    Serve {
        /// Config file (TOML); without it the documented defaults apply.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Socket to listen on (overrides the config).
        #[arg(long, short)]
        socket: Option<PathBuf>,
        /// Log filter: a level (error, warn, info, debug, trace) or directives such as
        /// `info,stoker_daemon::server=debug` (default $STOKER_LOG, else $RUST_LOG, else info).
        #[arg(long, value_name = "FILTER")]
        log_level: Option<String>,
        /// Log format: `text` (without timestamps or colours under systemd, whose journal adds its own) or
        /// `json` (one object per line).
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
    },
    /// Run a command beside a daemon of its own: start `stoker serve`, wait
    /// until it answers, run the command with $STOKER_SOCKET set, forward
    /// signals to it, stop the daemon and exit with the command's status
    /// (`srun stoker run -- python train.py`).
    Run {
        /// Config file (TOML) for the daemon; without it the documented defaults apply.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Socket for the daemon (default: $TMPDIR/stoker-run-PID.sock, else /tmp/…).
        #[arg(long, short)]
        socket: Option<PathBuf>,
        /// Seconds to wait for the daemon to answer before giving up.
        #[arg(long, default_value_t = 60.0)]
        wait: f64,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true, value_name = "CMD")]
        command: Vec<String>,
    },
    /// Check a config file and print what the daemon would run with.
    Validate {
        /// Config file.
        file: PathBuf,
        /// Check values only: do not open the named datasets' files (for a
        /// service's pre-start check when data is mounted later).
        #[arg(long)]
        skip_files: bool,
    },
    /// Describe an HDF5 file or LMDB environments and suggest a dataset config
    /// that `stoker validate` accepts as printed.
    Inspect {
        /// HDF5 files (each described on its own), or LMDB environments
        /// (directories with data.mdb, or their data files) that make one dataset together,
        /// e.g. the LR and HR environments of a super-resolution set.
        #[arg(required = true)]
        file: Vec<PathBuf>,
        /// LMDB: values decoded to learn formats and shapes.
        #[arg(long, default_value_t = 64)]
        probe: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show the running daemon's clients and streams.
    Status {
        #[command(flatten)]
        target: Target,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Redraw every SECONDS (2 if not given) until Ctrl-C; with --json, one JSON object per line.
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
        watch: Option<f64>,
        /// Wait up to SECONDS (60 when no value is given) for a daemon that is not answering yet,
        /// e.g. one just started; exits 1 if none answers in time.
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "60")]
        wait: Option<f64>,
    },
    /// List the datasets named in the running daemon's config.
    Datasets {
        #[command(flatten)]
        target: Target,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Inspect, fill or empty the daemon's node-wide caches.
    Cache {
        #[command(subcommand)]
        action: CacheAction,
    },
    /// (Internal) An HDF5 helper process, started by the daemon: runs libhdf5
    /// on the files it is passed over the socket at descriptor FD.
    #[command(hide = true, name = "hdf5-helper")]
    Hdf5Helper {
        /// The socket shared with the daemon.
        #[arg(long)]
        fd: i32,
        /// CPU seconds one request may use (`RLIMIT_CPU`, renewed per request; 0: unbounded).
        #[arg(long, default_value_t = 0)]
        cpu_s: u64,
    },
}

#[derive(Debug, Subcommand)]
enum CacheAction {
    /// Per dataset: bytes and entries held, hit rate, evictions, and the policy.
    Ls {
        #[command(flatten)]
        target: Target,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Read a dataset named in the daemon's config through the daemon once
    /// (or N times) in order, so the jobs that follow start with hits.
    Warm {
        /// Dataset name (`stoker datasets` lists them).
        dataset: String,
        #[command(flatten)]
        target: Target,
        /// Passes over the dataset.
        #[arg(long, default_value_t = 1)]
        epochs: u64,
        /// Samples per batch read.
        #[arg(long, default_value_t = 64)]
        batch_size: u64,
        /// Print one JSON object when done instead of a progress bar.
        #[arg(long)]
        json: bool,
    },
    /// Drop the cache entries of one dataset (or, for root and the daemon's user, of all).
    Drop {
        /// Dataset name or label as `stoker cache ls` shows it.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        dataset: Option<String>,
        /// Every dataset's entries.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        target: Target,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve { config, socket, log_level, log_format } => {
            serve::run(config.as_deref(), socket, log_level, log_format)
        }
        Command::Run { config, socket, wait, command } => run::run(config.as_deref(), socket, wait, &command),
        Command::Validate { file, skip_files } => validate::run(&file, !skip_files),
        Command::Inspect { file, probe, json } => inspect::run(&file, probe, json),
        Command::Status { target, json, watch, wait } => status::run(&target, json, watch, wait),
        Command::Cache { action } => cache::run(action),
        Command::Datasets { target, json } => datasets::run(&target, json),
        Command::Hdf5Helper { fd, cpu_s } => {
            let sock = crate::helper::serve::socket(fd)?;
            crate::helper::serve::run(sock, cpu_s)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

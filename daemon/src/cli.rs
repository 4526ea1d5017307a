//! Subcommands of the `stoker` binary: `serve` runs the daemon; `status`,
//! `datasets` and `validate` are clients of it or offline checks.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use stoker_client::Client;
use stoker_proto::StatusReport;

use crate::config::{Config, Settings};

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
        /// Log level: error, warn, info, debug, trace (default $STOKER_LOG or info).
        #[arg(long)]
        log_level: Option<String>,
    },
    /// Check a config file and print what the daemon would run with.
    Validate {
        /// Config file.
        file: PathBuf,
    },
    /// Describe an HDF5 file or an LMDB environment and suggest a dataset config.
    Inspect {
        /// An HDF5 file, or an LMDB environment (directory with data.mdb, or its data file).
        file: PathBuf,
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
}

/// Which daemon a client subcommand talks to.
#[derive(Debug, clap::Args)]
struct Target {
    /// Daemon socket (default: $STOKER_SOCKET, else the config's, else /run/stoker/stoker.sock).
    #[arg(long, short)]
    socket: Option<PathBuf>,
    /// Read the socket path from this config file.
    #[arg(long, short)]
    config: Option<PathBuf>,
}

impl Target {
    fn connect(&self) -> anyhow::Result<Client> {
        let path = match (&self.socket, &self.config) {
            (Some(s), _) => s.clone(),
            (None, Some(c)) => Config::load(c)?.server.socket,
            (None, None) => Client::default_socket(),
        };
        Ok(Client::connect(path)?)
    }
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve { config, socket, log_level } => serve(config.as_deref(), socket, log_level),
        Command::Validate { file } => {
            let settings = Config::load(&file)?.validate(&file)?;
            println!("{} is valid", file.display());
            println!("  socket          {}", settings.socket.display());
            println!("  worker threads  {}", settings.worker_threads);
            println!("  ring depth      {}", settings.ring_depth);
            println!("  allowed roots   {:?}", settings.allowed_roots);
            println!("  datasets        {:?}", settings.datasets.keys().collect::<Vec<_>>());
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect { file, json, probe } if crate::inspect::is_lmdb(&file) => {
            let scan = crate::inspect::inspect_lmdb(&file, probe)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&scan)?);
            } else {
                print!("{}", crate::inspect::format_lmdb_report(&file, &scan));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect { file, json, .. } => {
            let reports = crate::inspect::inspect(&file)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&reports)?);
            } else {
                print!("{}", crate::inspect::format_report(&file, &reports));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { target, json, wait } => {
            let report = match wait {
                Some(seconds) => status_waiting(&target, seconds)?,
                None => target.connect()?.status()?,
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", format_status(&report));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Datasets { target, json } => {
            let list = target.connect()?.datasets()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else if list.is_empty() {
                println!("no named datasets (add [datasets.NAME] tables to the daemon's config)");
            } else {
                for ds in list {
                    let fields: Vec<String> = ds.fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    println!("{:<20} {:<6} {}  {}", ds.name, ds.format, ds.files, fields.join(" "));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `stoker status --wait`: asks for the status until a daemon answers or
/// `seconds` have passed. Connection failures are retried (nothing listening
/// yet, the socket not yet given its mode, a daemon draining before a
/// restart); an answer that no retry changes (this uid is not served, a
/// protocol mismatch, a bad config file) fails at once.
fn status_waiting(target: &Target, seconds: f64) -> anyhow::Result<StatusReport> {
    use std::time::{Duration, Instant};
    use stoker_client::ClientError;
    use stoker_proto::ErrorKind;
    let within = Duration::try_from_secs_f64(seconds)
        .map_err(|_| anyhow::anyhow!("--wait takes a number of seconds >= 0, not {seconds}"))?;
    let path = match (&target.socket, &target.config) {
        (Some(s), _) => s.clone(),
        (None, Some(c)) => Config::load(c)?.server.socket,
        (None, None) => Client::default_socket(),
    };
    let deadline =
        Instant::now().checked_add(within).ok_or_else(|| anyhow::anyhow!("--wait {seconds} s is too long"))?;
    let mut past = || Instant::now() >= deadline;
    loop {
        // A daemon that accepts but does not answer (still starting, or stopped)
        // must not hold the wait past its deadline.
        let error = match Client::connect_interruptible(&path, &mut past).and_then(|c| c.status()) {
            Ok(report) => return Ok(report),
            Err(e) => e,
        };
        let retry = match &error {
            ClientError::Unavailable { .. }
            | ClientError::SocketDenied { .. }
            | ClientError::Disconnected(_)
            | ClientError::Io(_)
            | ClientError::Interrupted => true,
            ClientError::Daemon { kind, .. } => *kind == ErrorKind::ShuttingDown,
            _ => false,
        };
        if !retry {
            return Err(error.into());
        }
        if past() {
            if matches!(error, ClientError::Interrupted) {
                anyhow::bail!(
                    "the stoker daemon at {} accepted the connection but did not answer within {seconds} s \
                     (stopped, or overloaded?)",
                    path.display()
                );
            }
            return Err(anyhow::Error::new(error)
                .context(format!("no stoker daemon answered at {} within {seconds} s", path.display())));
        }
        std::thread::sleep(Duration::from_millis(100).min(deadline.saturating_duration_since(Instant::now())));
    }
}

fn serve(config: Option<&Path>, socket: Option<PathBuf>, log_level: Option<String>) -> anyhow::Result<ExitCode> {
    let level = log_level.or_else(|| std::env::var("STOKER_LOG").ok()).unwrap_or_else(|| "info".into());
    let level: tracing::Level = level.parse().with_context(|| format!("invalid log level {level:?}"))?;
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();

    let (cfg, path) = match config {
        Some(p) => (Config::load(p)?, Some(p.to_owned())),
        None => (Config::default(), None),
    };
    let load = move |cfg: Config| -> anyhow::Result<Settings> {
        let shown = path.clone().unwrap_or_else(|| PathBuf::from("<defaults>"));
        let mut settings: Settings = cfg.validate(&shown)?;
        if let Some(s) = &socket {
            settings.socket = s.clone();
        }
        Ok(settings)
    };
    let reload_path = config.map(Path::to_owned);
    let settings = load(cfg)?;
    raise_nofile_limit();
    let socket = settings.socket.clone();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("stoker-io").enable_all().build()?;
    let result = runtime.block_on(async {
        let listener = crate::server::bind(&socket, &settings)?;
        let daemon = crate::server::Daemon::new(settings)?;
        notify(&[NotifyState::Ready, NotifyState::Status("listening")]);
        tokio::spawn(watchdog());
        let reloader = daemon.clone();
        tokio::spawn(reload_on_hup(move || {
            let cfg = match &reload_path {
                Some(p) => Config::load(p)?,
                None => Config::default(),
            };
            let settings = load(cfg)?;
            Ok(reloader.reload(settings))
        }));
        crate::server::run(daemon, listener, socket, shutdown_signal()).await
    });
    notify(&[NotifyState::Status("stopped")]);
    // Opens stuck in the kernel (a hung network filesystem) hold blocking-pool
    // threads; they must not keep a stopping daemon alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result?;
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

use sd_notify::NotifyState;

/// Tells systemd (when `$NOTIFY_SOCKET` is set) how the daemon is doing.
fn notify(state: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, state) {
        tracing::debug!(error = %e, "sd_notify failed");
    }
}

/// Pings systemd's watchdog at half its interval while the control loop runs
/// (the pings come from a task on the same runtime that serves clients).
async fn watchdog() {
    let mut usec = 0;
    if !sd_notify::watchdog_enabled(false, &mut usec) || usec == 0 {
        return;
    }
    let mut tick = tokio::time::interval(std::time::Duration::from_micros(usec / 2));
    loop {
        tick.tick().await;
        notify(&[NotifyState::Watchdog]);
    }
}

/// Reloads the config on every SIGHUP; a config that does not validate is
/// logged and the running one kept.
async fn reload_on_hup(reload: impl Fn() -> anyhow::Result<Vec<String>>) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::error!("cannot install the SIGHUP handler; config reloads need a restart");
        return;
    };
    while hup.recv().await.is_some() {
        let mut states = vec![NotifyState::Reloading];
        if let Ok(now) = NotifyState::monotonic_usec_now() {
            states.push(now);
        }
        notify(&states);
        match reload() {
            Ok(changes) if changes.is_empty() => tracing::info!("SIGHUP: config reloaded, nothing changed"),
            Ok(changes) => tracing::info!(changes = %changes.join("; "), "SIGHUP: config reloaded"),
            Err(e) => tracing::error!("SIGHUP: keeping the running config, the new one is invalid: {e:#}"),
        }
        notify(&[NotifyState::Ready, NotifyState::Status("listening")]);
    }
}

/// Raises the soft limit on open files to the hard limit: every dataset file,
/// connection and ring is a descriptor, and the usual soft limit of 1024 is
/// far below what a node-wide daemon needs.
fn raise_nofile_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let before = limit.current;
        limit.current = limit.maximum;
        match setrlimit(Resource::Nofile, limit) {
            Ok(()) => tracing::debug!(from = ?before, to = ?limit.current, "raised the open-files limit"),
            Err(e) => tracing::warn!(error = %e, "cannot raise the open-files limit"),
        }
    }
}

async fn shutdown_signal() -> crate::server::Shutdown {
    use crate::server::Shutdown;
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::error!("cannot install signal handlers; stop the daemon with SIGKILL");
        return std::future::pending().await;
    };
    let how = tokio::select! {
        _ = term.recv() => { tracing::info!("SIGTERM: draining"); Shutdown::Drain }
        _ = int.recv() => { tracing::info!("SIGINT: stopping"); Shutdown::Quick }
    };
    notify(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    how
}

/// The human-readable `stoker status` table.
pub fn format_status(r: &StatusReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "stoker {} (pid {}), up {}, {} worker threads",
        r.version,
        r.pid,
        human_duration(r.uptime_s),
        r.worker_threads
    );
    let c = &r.chunk_cache;
    let lookups = c.hits + c.misses;
    let _ = writeln!(
        out,
        "chunk cache: {:.1} / {:.1} MB, {} chunks, hit rate {}",
        c.bytes as f64 / 1e6,
        c.capacity as f64 / 1e6,
        c.entries,
        if lookups == 0 { "-".to_string() } else { format!("{:.1}%", 100.0 * c.hits as f64 / lookups as f64) }
    );
    for s in &r.skipped {
        let _ = writeln!(out, "dataset {}: {} bad samples skipped (see the daemon's log)", s.dataset, s.skipped);
    }
    let _ = writeln!(out, "\nclients: {}", r.clients.len());
    if !r.clients.is_empty() {
        let _ = writeln!(out, "  {:>4} {:>8} {:>6} {:>7} {:>10}", "id", "pid", "uid", "streams", "connected");
        for c in &r.clients {
            let _ = writeln!(
                out,
                "  {:>4} {:>8} {:>6} {:>7} {:>10}",
                c.id,
                c.pid,
                c.uid,
                c.streams,
                human_duration(c.connected_s)
            );
        }
    }
    let _ = writeln!(out, "\nstreams: {}", r.streams.len());
    if !r.streams.is_empty() {
        let _ = writeln!(
            out,
            "  {:>4} {:>8} {:<24} {:>5} {:>5} {:>11} {:>9} {:>9} {:>8} {:>11}",
            "id", "pid", "dataset", "rank", "epoch", "step", "batch/s", "MB/s", "wait s", "ring f/l/d"
        );
        for s in &r.streams {
            let dataset = shorten(&s.dataset, 24);
            let _ = writeln!(
                out,
                "  {:>4} {:>8} {:<24} {:>5} {:>5} {:>11} {:>9.1} {:>9.1} {:>8.2} {:>11}",
                s.id,
                s.pid,
                dataset,
                format!("{}/{}", s.rank, s.world_size),
                s.epoch,
                format!("{}/{}", s.step, s.batches_per_epoch),
                s.batches_per_s,
                s.mb_per_s,
                s.wait_s,
                format!("{}/{}/{}", s.slots_filled, s.slots_leased, s.depth)
            );
        }
    }
    out
}

/// `text` cut to its last `width - 1` characters behind an ellipsis when longer than `width`.
fn shorten(text: &str, width: usize) -> String {
    let chars = text.chars().count();
    if chars <= width {
        return text.to_string();
    }
    let tail: String = text.chars().skip(chars - (width - 1)).collect();
    format!("…{tail}")
}

fn human_duration(secs: f64) -> String {
    let s = secs as u64;
    match s {
        0..60 => format!("{secs:.1}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorten_cuts_at_characters_not_bytes() {
        assert_eq!(shorten("short", 24), "short");
        let long = "/données/températures/été/ß/日本語のデータ/ファイル.h5";
        let cut = shorten(long, 24);
        assert_eq!(cut.chars().count(), 24);
        assert!(cut.starts_with('…') && long.ends_with(&cut['…'.len_utf8()..]), "{cut}");
    }
}

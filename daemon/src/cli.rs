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
        /// Log filter: a level (error, warn, info, debug, trace) or directives such as
        /// `info,stoker_daemon::server=debug` (default $STOKER_LOG, else $RUST_LOG, else info).
        #[arg(long, value_name = "FILTER")]
        log_level: Option<String>,
        /// Log format: `text` (without timestamps or colours under systemd, whose journal adds its own) or
        /// `json` (one object per line).
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
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

/// How `stoker serve` writes its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, fields under `fields`.
    Json,
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
        Command::Serve { config, socket, log_level, log_format } => {
            serve(config.as_deref(), socket, log_level, log_format)
        }
        Command::Validate { file, skip_files } => validate(&file, !skip_files),
        Command::Inspect { file, json, probe } if file.iter().all(|f| stoker_data::inspect::is_lmdb(f)) => {
            let envs = stoker_data::inspect::inspect_lmdb(&file, probe)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&envs)?);
            } else {
                print!("{}", stoker_data::inspect::format_lmdb_report(&envs));
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Inspect { file, json, .. } => {
            if let Some(env) = file.iter().find(|f| stoker_data::inspect::is_lmdb(f)) {
                anyhow::bail!(
                    "{} is an LMDB environment and the others are not: inspect HDF5 files and LMDB environments \
                     separately",
                    env.display()
                );
            }
            let mut all = Vec::with_capacity(file.len());
            for f in &file {
                all.push((f, stoker_data::inspect::inspect(f)?));
            }
            if json {
                match all.as_slice() {
                    [(_, reports)] => println!("{}", serde_json::to_string_pretty(reports)?),
                    _ => {
                        let by_file: Vec<_> = all
                            .iter()
                            .map(|(f, r)| serde_json::json!({ "file": f.display().to_string(), "datasets": r }))
                            .collect();
                        println!("{}", serde_json::to_string_pretty(&by_file)?);
                    }
                }
            } else {
                for (i, (f, reports)) in all.iter().enumerate() {
                    if i > 0 {
                        println!();
                    }
                    print!("{}", stoker_data::inspect::format_report(f, reports));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { target, json, watch, wait } => {
            if let Some(seconds) = wait {
                status_waiting(&target, seconds)?;
            }
            status(&target, json, watch)
        }
        Command::Cache { action } => cache(action),
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

/// `stoker cache ls | warm | drop`.
fn cache(action: CacheAction) -> anyhow::Result<ExitCode> {
    match action {
        CacheAction::Ls { target, json } => {
            let report = target.connect()?.cache_list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", format_cache(&report));
            }
        }
        CacheAction::Drop { dataset, all: _, target, json } => {
            let (entries, bytes) = target.connect()?.cache_drop(dataset.as_deref())?;
            if json {
                println!("{}", serde_json::json!({ "dataset": dataset, "entries": entries, "bytes": bytes }));
            } else {
                println!(
                    "dropped {entries} entries ({}) of {}",
                    human_bytes(bytes),
                    dataset.as_deref().unwrap_or("every dataset")
                );
            }
        }
        CacheAction::Warm { dataset, target, epochs, batch_size, json } => {
            let client = target.connect()?;
            let before = client.cache_list()?;
            let open = stoker_proto::OpenStream {
                dataset: stoker_proto::DatasetRef::Named(dataset.clone()),
                batch_size,
                shuffle: false,
                block: None,
                seed: 0,
                drop_last: false,
                rank: 0,
                world_size: 1,
                epoch: 0,
                step: 0,
            };
            let stream = client.open_stream(open)?;
            let per_epoch = stream.info().batches_per_epoch;
            let bar = if json {
                indicatif::ProgressBar::hidden()
            } else {
                indicatif::ProgressBar::new(per_epoch.saturating_mul(epochs))
            };
            bar.set_style(
                indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} batches, {per_sec}, eta {eta}")
                    .map_err(|e| anyhow::anyhow!("{e}"))?
                    .progress_chars("=> "),
            );
            bar.set_message(format!("warming {dataset}"));
            let started = std::time::Instant::now();
            let mut samples = 0u64;
            for epoch in 0..epochs {
                stream.set_epoch(epoch, 0)?;
                while let Some(batch) = stream.next()? {
                    samples += batch.rows();
                    bar.inc(1);
                }
            }
            bar.finish_and_clear();
            stream.close()?;
            let after = client.cache_list()?;
            let held = |r: &stoker_proto::CacheReport| {
                r.datasets
                    .iter()
                    .filter(|d| d.dataset == dataset)
                    .map(|d| (d.bytes, d.entries))
                    .fold((0, 0), |(b, e), (db, de)| (b + db, e + de))
            };
            let ((b0, _), (b1, e1)) = (held(&before), held(&after));
            let seconds = started.elapsed().as_secs_f64();
            if json {
                let value = serde_json::json!({
                    "dataset": dataset, "epochs": epochs, "samples": samples, "seconds": seconds,
                    "bytes": b1, "entries": e1, "added_bytes": b1.saturating_sub(b0),
                });
                println!("{value}");
            } else {
                println!(
                    "warmed {dataset}: read {samples} samples in {seconds:.1} s; the caches hold {} of it in {e1} \
                     entries",
                    human_bytes(b1)
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `stoker cache ls` as a table.
pub fn format_cache(r: &stoker_proto::CacheReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let rate = |hits: u64, misses: u64| {
        let n = hits + misses;
        if n == 0 { "-".to_string() } else { format!("{:.1}%", 100.0 * hits as f64 / n as f64) }
    };
    for (name, c) in [("chunk cache", &r.chunks), ("sample cache", &r.samples)] {
        let _ = writeln!(
            out,
            "{name}: {} of {}, {} entries, hit rate {}, {} evictions",
            human_bytes(c.bytes),
            human_bytes(c.capacity),
            c.entries,
            rate(c.hits, c.misses),
            c.evictions
        );
    }
    let _ = writeln!(out, "policy: {}, planning over {} registered streams\n", r.policy, r.streams);
    if r.datasets.is_empty() {
        let _ = writeln!(out, "nothing cached yet");
        return out;
    }
    let rows = r.datasets.iter().map(|d| {
        vec![
            shorten(&d.dataset, 40),
            d.cache.clone(),
            human_bytes(d.bytes),
            d.entries.to_string(),
            rate(d.hits, d.misses),
            d.hits.to_string(),
            d.misses.to_string(),
            d.evictions.to_string(),
            d.rejected.to_string(),
        ]
    });
    table(
        &mut out,
        &["DATASET", "CACHE", "BYTES", "ENTRIES", "HIT RATE", "HITS", "MISSES", "EVICTED", "REFUSED"],
        rows,
    );
    out
}

/// `stoker validate FILE`: parses the config (a TOML error stops there: it
/// has one line), then reports every problem in its values and (unless
/// `open_files` is false) in the named datasets' files, each with its line,
/// and exits 1 when there are any.
fn validate(file: &Path, open_files: bool) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(file).with_context(|| format!("cannot read config {}", file.display()))?;
    let config = Config::parse(&text, file)?;
    let files = if open_files { crate::dataset::check::check_files(&config) } else { Vec::new() };
    let (settings, mut problems) = match config.check() {
        Ok(settings) => (Some(settings), Vec::new()),
        Err(problems) => (None, problems),
    };
    // A dataset whose values are wrong is reported for those, not again for its files.
    let named =
        |p: &crate::config::Problem| p.at.first().is_some_and(|t| t == "datasets").then(|| p.at.get(1).cloned());
    let wrong: Vec<_> = problems.iter().filter_map(named).collect();
    problems.extend(files.into_iter().filter(|f| !named(f).is_some_and(|name| wrong.contains(&name))));
    if !problems.is_empty() {
        let mut lines: Vec<(Option<usize>, &str)> =
            problems.iter().map(|p| (p.line(&text), p.message.as_str())).collect();
        // In the file's order; problems without a line (defaults) last.
        lines.sort_by_key(|(line, _)| line.unwrap_or(usize::MAX));
        let n = lines.len();
        eprintln!("{}: {n} {}", file.display(), if n == 1 { "error" } else { "errors" });
        for (line, message) in lines {
            match line {
                Some(line) => eprintln!("  {}:{line}: {message}", file.display()),
                None => eprintln!("  {}: {message}", file.display()),
            }
        }
        return Ok(ExitCode::FAILURE);
    }
    let Some(settings) = settings else { return Ok(ExitCode::FAILURE) };
    println!("{} is valid", file.display());
    println!("  socket          {}", settings.socket.display());
    println!("  worker threads  {}", settings.worker_threads);
    println!("  ring depth      {}", settings.ring_depth);
    println!("  allowed roots   {:?}", settings.allowed_roots);
    println!("  datasets        {:?}", settings.datasets.keys().collect::<Vec<_>>());
    Ok(ExitCode::SUCCESS)
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

fn serve(
    config: Option<&Path>,
    socket: Option<PathBuf>,
    log_level: Option<String>,
    log_format: LogFormat,
) -> anyhow::Result<ExitCode> {
    init_logging(log_level, log_format)?;

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
    // Taken before any thread starts: adopting them unsets LISTEN_* variables.
    let inherited = stoker_data::fsaccess::listen_fds();
    let socket = settings.socket.clone();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("stoker-io").enable_all().build()?;
    let result = runtime.block_on(async {
        let listener = crate::server::bind(&socket, &settings)?;
        let metrics = match settings.metrics_listen {
            Some(addr) => Some(crate::metrics::bind(addr).await?),
            None => None,
        };
        let daemon = crate::server::Daemon::new(settings)?;
        restore_caches(daemon.caches(), inherited);
        if let Some(metrics) = metrics {
            let daemon = daemon.clone();
            tokio::spawn(crate::metrics::serve(metrics, move || daemon.metrics_text()));
        }
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
        let caches = daemon.caches().clone();
        let result = crate::server::run(daemon, listener, socket, shutdown_signal()).await;
        store_caches(&caches);
        result
    });
    notify(&[NotifyState::Status("stopped")]);
    // Opens stuck in the kernel (a hung network filesystem) hold blocking-pool
    // threads; they must not keep a stopping daemon alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result?;
    tracing::info!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// Loads the caches a previous daemon of this unit left in systemd's fd
/// store, then asks systemd to drop its copy (the memory is freed once
/// loaded). Anything else passed in is closed.
fn restore_caches(caches: &stoker_data::cache::Caches, inherited: Vec<(std::os::fd::OwnedFd, String)>) {
    use stoker_data::cache::snapshot::FD_NAME;
    for (fd, name) in inherited {
        if name != FD_NAME {
            tracing::warn!(name = %name, "ignoring a file descriptor passed by systemd");
            continue;
        }
        let started = std::time::Instant::now();
        match caches.import(fd) {
            Ok(c) => tracing::info!(
                entries = c.entries,
                bytes = c.bytes,
                seconds = started.elapsed().as_secs_f64(),
                "caches restored from systemd's fd store"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot restore the caches from systemd's fd store: starting cold"),
        }
        notify(&[NotifyState::FdStoreRemove, NotifyState::FdName(FD_NAME)]);
    }
}

/// At a clean stop under systemd with an fd store (`FileDescriptorStoreMax=`
/// ≥ 1, which sets `$FDSTORE`), hands the caches to systemd in a sealed
/// memfd so the next daemon of the unit (a restart or upgrade of the same
/// version) starts warm.
fn store_caches(caches: &stoker_data::cache::Caches) {
    use stoker_data::cache::snapshot::FD_NAME;
    let wanted = std::env::var("FDSTORE").ok().and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n > 0);
    if !wanted || std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    let started = std::time::Instant::now();
    match caches.export() {
        Ok((fd, c)) if c.entries > 0 => {
            use std::os::fd::AsFd;
            let sent =
                sd_notify::notify_with_fds(false, &[NotifyState::FdStore, NotifyState::FdName(FD_NAME)], &[fd.as_fd()]);
            match sent {
                Ok(()) => tracing::info!(
                    entries = c.entries,
                    bytes = c.bytes,
                    seconds = started.elapsed().as_secs_f64(),
                    "caches handed to systemd's fd store for the next start"
                ),
                Err(e) => tracing::warn!(error = %e, "cannot hand the caches to systemd's fd store"),
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot write the caches for systemd's fd store"),
    }
}

/// Installs the log subscriber: `filter` (else `$STOKER_LOG`, else
/// `$RUST_LOG`, else `info`) in `RUST_LOG` syntax, written to stderr as text
/// or JSON. Under systemd (`$JOURNAL_STREAM` or `$INVOCATION_ID` set) text
/// lines carry neither timestamps nor colours: the journal stamps each line itself.
fn init_logging(filter: Option<String>, format: LogFormat) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let directives = filter
        .or_else(|| std::env::var("STOKER_LOG").ok())
        .or_else(|| std::env::var("RUST_LOG").ok())
        .filter(|d| !d.trim().is_empty())
        .unwrap_or_else(|| "info".into());
    let filter = parse_log_filter(&directives)?;
    let journald = std::env::var_os("JOURNAL_STREAM").is_some() || std::env::var_os("INVOCATION_ID").is_some();
    let log = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Json => log.json().init(),
        LogFormat::Text if journald => log.without_time().with_ansi(false).init(),
        LogFormat::Text => log.with_ansi(std::io::stderr().is_terminal()).init(),
    }
    Ok(())
}

/// A `RUST_LOG`-style filter. A bare word is a level, or a target of ours
/// (`stoker_daemon`): anything else is a typo that would silence the log.
fn parse_log_filter(directives: &str) -> anyhow::Result<tracing_subscriber::EnvFilter> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let hint = "give a level (error, warn, info, debug, trace) or directives such as \
                `info,stoker_daemon::server=debug`";
    for d in directives.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let bare = !d.contains(['=', '[', ':']);
        if bare && !LEVELS.contains(&d.to_ascii_lowercase().as_str()) && !d.starts_with("stoker") {
            anyhow::bail!("invalid log filter {directives:?}: {d:?} is not a level; {hint}");
        }
    }
    tracing_subscriber::EnvFilter::builder()
        .parse(directives)
        .with_context(|| format!("invalid log filter {directives:?}; {hint}"))
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

/// `stoker status`: one report, or (`watch`) a redraw every so many seconds until Ctrl-C.
fn status(target: &Target, json: bool, watch: Option<f64>) -> anyhow::Result<ExitCode> {
    let mut users = Users::default();
    let Some(every) = watch else {
        let report = target.connect()?.status()?;
        if json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{}", format_status(&report, &users.names(&report)));
        }
        return Ok(ExitCode::SUCCESS);
    };
    if !(every.is_finite() && every >= 0.05) {
        anyhow::bail!("--watch takes an interval in seconds of at least 0.05, not {every}");
    }
    use std::io::Write;
    let mut client: Option<Client> = None;
    loop {
        let report = match client.take() {
            Some(c) => Ok(c),
            None => target.connect(),
        }
        .and_then(|c| {
            let report = c.status()?;
            client = Some(c);
            Ok(report)
        });
        let mut out = std::io::stdout().lock();
        // A daemon restarting or not yet up is shown, and asked again next round.
        match (report, json) {
            (Ok(r), true) => writeln!(out, "{}", serde_json::to_string(&r)?)?,
            (Ok(r), false) => write!(
                out,
                "\x1b[H\x1b[2J{}every {every} s, Ctrl-C to stop\n\n{}",
                clock_utc(),
                format_status(&r, &users.names(&r))
            )?,
            (Err(e), true) => writeln!(out, "{}", serde_json::json!({ "error": format!("{e:#}") }))?,
            (Err(e), false) => write!(out, "\x1b[H\x1b[2J{}every {every} s, Ctrl-C to stop\n\n{e:#}\n", clock_utc())?,
        }
        out.flush()?;
        drop(out);
        std::thread::sleep(std::time::Duration::from_secs_f64(every));
    }
}

/// The wall-clock time of day (UTC) as `HH:MM:SS  `, for the top of a `--watch` frame.
fn clock_utc() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format!("{:02}:{:02}:{:02} UTC  ", secs / 3600 % 24, secs / 60 % 60, secs % 60)
}

/// User names by uid, looked up once each: `/etc/passwd`, then `getent passwd`
/// (LDAP or SSSD users on a cluster), else the number.
#[derive(Debug, Default)]
struct Users(std::collections::HashMap<u32, String>);

impl Users {
    /// The names of the users in `report`.
    fn names(&mut self, report: &StatusReport) -> std::collections::HashMap<u32, String> {
        for c in &report.clients {
            self.0.entry(c.uid).or_insert_with(|| user_name(c.uid).unwrap_or_else(|| c.uid.to_string()));
        }
        self.0.clone()
    }
}

/// The login name of `uid`, if the password database knows it.
fn user_name(uid: u32) -> Option<String> {
    let from_passwd = |text: &str| {
        text.lines().find_map(|line| {
            let mut parts = line.split(':');
            let name = parts.next()?;
            (parts.nth(1)?.parse() == Ok(uid)).then(|| name.to_string())
        })
    };
    if let Some(name) = std::fs::read_to_string("/etc/passwd").ok().as_deref().and_then(from_passwd) {
        return Some(name);
    }
    // A name service that hangs must not hang `status`: give getent two seconds.
    let mut child = std::process::Command::new("getent")
        .args(["passwd", &uid.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while child.try_wait().ok()?.is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take()?, &mut text).ok()?;
    from_passwd(&text)
}

/// The human-readable `stoker status` report; `users` names uids (others show as numbers).
pub fn format_status(r: &StatusReport, users: &std::collections::HashMap<u32, String>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "stoker {} (pid {}), up {}", r.version, r.pid, human_duration(r.uptime_s));
    let w = &r.workers;
    let _ = writeln!(
        out,
        "workers: {} threads, {:.0}% busy over the last {} ({:.3} s busy since start)",
        r.worker_threads,
        w.busy_percent,
        human_duration(w.window_s),
        w.busy_s
    );
    for (name, unit, c) in [("chunk cache", "chunks", &r.chunk_cache), ("sample cache", "samples", &r.sample_cache)] {
        let lookups = c.hits + c.misses;
        let _ = writeln!(
            out,
            "{name}: {} of {}, {} {unit}, hit rate {}",
            human_bytes(c.bytes),
            human_bytes(c.capacity),
            c.entries,
            if lookups == 0 { "-".to_string() } else { format!("{:.1}%", 100.0 * c.hits as f64 / lookups as f64) }
        );
    }
    let ring_bytes: u64 = r.datasets.iter().map(|d| d.ring_bytes).sum();
    let ring_streams: u64 = r.datasets.iter().map(|d| d.streams).sum();
    let _ = writeln!(out, "shared memory: {} in the rings of {ring_streams} streams", human_bytes(ring_bytes));

    let _ = writeln!(out, "\ndatasets open: {}", r.datasets.len());
    let rows = r.datasets.iter().map(|d| {
        vec![
            shorten(&d.dataset, 40),
            d.format.clone(),
            d.files.to_string(),
            human_bytes(d.bytes),
            d.samples.to_string(),
            d.streams.to_string(),
            human_bytes(d.ring_bytes),
            d.skipped.to_string(),
        ]
    });
    let headers = ["<dataset", "<format", "files", "on disk", "samples", "streams", "ring memory", "skipped"];
    table(&mut out, &headers, rows);

    let _ = writeln!(out, "\nclients: {}", r.clients.len());
    let rows = r.clients.iter().map(|c| {
        vec![
            c.id.to_string(),
            users.get(&c.uid).cloned().unwrap_or_else(|| c.uid.to_string()),
            c.pid.to_string(),
            c.job.clone().unwrap_or_else(|| "-".into()),
            c.streams.to_string(),
            human_duration(c.connected_s),
            format!("{:.1}%", c.stall_percent),
        ]
    });
    table(&mut out, &["id", "<user", "pid", "<slurm job", "streams", "connected", "data stall"], rows);

    let _ = writeln!(out, "\nstreams: {}", r.streams.len());
    let rows = r.streams.iter().map(|s| {
        vec![
            s.id.to_string(),
            s.client_id.to_string(),
            s.pid.to_string(),
            shorten(&s.dataset, 24),
            format!("{}/{}", s.rank, s.world_size),
            s.epoch.to_string(),
            format!("{}/{}", s.step, s.batches_per_epoch),
            format!("{:.1}", s.batches_per_s),
            format!("{:.1}", s.mb_per_s),
            format!("{:.1}%", s.stall_percent),
            s.slots_filled.to_string(),
            s.slots_leased.to_string(),
            s.depth.to_string(),
        ]
    });
    let headers = [
        "id",
        "client",
        "pid",
        "<dataset",
        "rank",
        "epoch",
        "step",
        "batches/s",
        "MB/s",
        "data stall",
        "ring filled",
        "ring leased",
        "ring depth",
    ];
    table(&mut out, &headers, rows);
    out
}

/// Writes an indented table: each column as wide as its widest cell; a header
/// starting with `<` marks a left-aligned column (numbers align right). Nothing
/// when there are no rows.
fn table(out: &mut String, headers: &[&str], rows: impl Iterator<Item = Vec<String>>) {
    let rows: Vec<Vec<String>> = rows.collect();
    if rows.is_empty() {
        return;
    }
    let cols: Vec<(&str, bool)> =
        headers.iter().map(|h| h.strip_prefix('<').map_or((*h, false), |h| (h, true))).collect();
    let widths: Vec<usize> = cols
        .iter()
        .enumerate()
        .map(|(i, (h, _))| {
            rows.iter().filter_map(|r| r.get(i)).map(|c| c.chars().count()).chain([h.len()]).max().unwrap_or(0)
        })
        .collect();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for ((cell, (_, left)), width) in cells.zip(&cols).zip(&widths) {
            let pad = " ".repeat(width.saturating_sub(cell.chars().count()));
            text.push_str("  ");
            if *left {
                text.push_str(cell);
                text.push_str(&pad);
            } else {
                text.push_str(&pad);
                text.push_str(cell);
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut cols.iter().map(|(h, _)| *h));
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
}

/// Bytes in decimal units (`1.2 MB`).
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", UNITS[unit]) }
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

    fn report() -> StatusReport {
        use stoker_proto::{CacheStatus, ClientStatus, DatasetStatus, StreamStatus, WorkerStatus};
        StatusReport {
            version: "0.1.0".into(),
            pid: 10,
            uptime_s: 75.0,
            worker_threads: 4,
            clients: vec![ClientStatus {
                id: 3,
                pid: 4321,
                uid: 1000,
                job: Some("987654".into()),
                streams: 1,
                connected_s: 60.0,
                wait_s: 6.0,
                stall_percent: 10.0,
            }],
            streams: vec![StreamStatus {
                id: 5,
                client_id: 3,
                pid: 4321,
                dataset: "train".into(),
                rank: 0,
                world_size: 2,
                epoch: 1,
                step: 7,
                batches_per_epoch: 50,
                batches: 57,
                batches_per_s: 12.5,
                mb_per_s: 100.0,
                wait_s: 6.0,
                open_s: 60.0,
                stall_percent: 10.0,
                slots_filled: 2,
                slots_leased: 1,
                depth: 4,
            }],
            chunk_cache: CacheStatus { bytes: 0, capacity: 1 << 20, entries: 0, hits: 0, misses: 0, evictions: 0 },
            sample_cache: CacheStatus { bytes: 0, capacity: 1 << 20, entries: 0, hits: 0, misses: 0, evictions: 0 },
            skipped: vec![],
            datasets: vec![DatasetStatus {
                dataset: "train".into(),
                format: "hdf5".into(),
                files: 3,
                bytes: 1_500_000,
                samples: 100,
                streams: 1,
                ring_bytes: 4096,
                skipped: 0,
            }],
            workers: WorkerStatus { busy_s: 30.0, busy_percent: 37.5, window_s: 10.0 },
        }
    }

    #[test]
    fn status_spells_out_its_columns_and_names_users() {
        let users = [(1000, "alice".to_string())].into_iter().collect();
        let text = format_status(&report(), &users);
        for needle in ["ring filled", "ring leased", "ring depth", "data stall", "slurm job", "alice", "987654"] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
        assert!(!text.contains("f/l/d"), "{text}");
        assert!(text.contains("38% busy over the last 10.0s"), "{text}");
        assert!(text.contains("1.5 MB"), "{text}");
        // Columns line up: every cell ends where its header ends (numbers align right).
        let lines: Vec<&str> = text.lines().collect();
        let header = lines.iter().position(|l| l.contains("ring depth")).unwrap();
        assert_eq!(lines[header].len(), lines[header + 1].len(), "{text}");
        assert!(lines[header + 1].ends_with(" 4"), "{text}");
        // Without a name the number is shown.
        let text = format_status(&report(), &Default::default());
        assert!(text.contains(" 1000 "), "{text}");
    }

    #[test]
    fn log_filters_take_levels_and_directives_and_refuse_typos() {
        for ok in ["info", "WARN", "warn,stoker_daemon::server=debug", "stoker_daemon=trace", "off"] {
            assert!(parse_log_filter(ok).is_ok(), "{ok}");
        }
        for bad in ["infoo", "verbose", "info,stoker_daemon=loud"] {
            let err = format!("{:#}", parse_log_filter(bad).unwrap_err());
            assert!(err.contains("invalid log filter") && err.contains(bad), "{err}");
        }
    }

    #[test]
    fn user_names_come_from_the_password_database() {
        assert_eq!(user_name(0).as_deref(), Some("root"));
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1_234_567), "1.2 MB");
    }

    #[test]
    fn shorten_cuts_at_characters_not_bytes() {
        assert_eq!(shorten("short", 24), "short");
        let long = "/données/températures/été/ß/日本語のデータ/ファイル.h5";
        let cut = shorten(long, 24);
        assert_eq!(cut.chars().count(), 24);
        assert!(cut.starts_with('…') && long.ends_with(&cut['…'.len_utf8()..]), "{cut}");
    }
}

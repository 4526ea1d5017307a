//! `stoker serve`: runs the daemon. Loads and validates the config, starts
//! the tokio runtime with the control server and metrics listener, and
//! handles the signals (SIGTERM/SIGINT stop it, SIGHUP reloads the config).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use sd_notify::NotifyState;

use crate::config::{Config, Settings};
use logging::init_logging;
use systemd::{notify, restore_caches, store_caches, watchdog};

mod logging;
mod systemd;

pub(super) use logging::LogFormat;

/// `stoker serve`: runs the daemon until SIGTERM or SIGINT.
pub(super) fn run(
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

/// Waits for SIGTERM (drain the connections, then stop) or SIGINT (stop
/// without waiting), and tells systemd the daemon is stopping.
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

//! `stoker run [--config C] [--socket S] -- CMD…`: a daemon for one command.
//!
//! Starts `stoker serve` as a child, waits until it answers on its socket,
//! runs the command with `$STOKER_SOCKET` set to it, forwards the signals a
//! job receives (TERM, INT, HUP, QUIT, USR1, USR2) to the command, then stops
//! the daemon (SIGTERM: it drains) and exits with the command's status (128 +
//! the signal's number if a signal ended it, as a shell reports it). The one
//! line a Slurm script needs: `srun stoker run -- python train.py`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::Context;
use rustix::process::{Pid, Signal};

use super::connect::Target;

/// How long the daemon has to drain and exit after the command ends.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// Runs `command` beside a daemon of its own.
pub(super) fn run(
    config: Option<&Path>,
    socket: Option<PathBuf>,
    wait: f64,
    command: &[String],
) -> anyhow::Result<ExitCode> {
    let (program, args) = command.split_first().context("stoker run needs a command after `--`")?;
    let socket = socket.unwrap_or_else(|| {
        let dir = std::env::var_os("TMPDIR").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
        dir.join(format!("stoker-run-{}.sock", std::process::id()))
    });
    let exe = std::env::current_exe().context("cannot find the stoker binary to start the daemon")?;
    let mut serve = Command::new(&exe);
    serve.arg("serve").arg("--socket").arg(&socket);
    if let Some(config) = config {
        serve.arg("--config").arg(config);
    }
    let mut daemon = Daemon(serve.spawn().with_context(|| format!("cannot start {} serve", exe.display()))?);
    let within =
        Duration::try_from_secs_f64(wait).map_err(|_| anyhow::anyhow!("--wait takes seconds >= 0, not {wait}"))?;
    let deadline = Instant::now() + within;
    let target = Target::at(socket.clone());
    loop {
        let Err(e) = super::status::status_waiting(&target, 0.25) else { break };
        if let Some(status) = daemon.0.try_wait()? {
            anyhow::bail!(
                "the daemon started for the command exited ({status}) before it answered; its messages are above"
            );
        }
        if Instant::now() >= deadline {
            return Err(e.context(format!(
                "the daemon started for the command did not answer on {} within {wait} s",
                socket.display()
            )));
        }
    }
    let mut child = Command::new(program)
        .args(args)
        .env(stoker_proto::SOCKET_ENV, &socket)
        .spawn()
        .with_context(|| format!("cannot run {program}"))?;
    let status = forward_signals_until_exit(&mut child)?;
    daemon.stop();
    Ok(exit_code(status))
}

/// The daemon child, stopped (SIGTERM, then SIGKILL after [`STOP_GRACE`])
/// however `run` ends.
struct Daemon(Child);

impl Daemon {
    fn stop(&mut self) {
        if matches!(self.0.try_wait(), Ok(Some(_))) {
            return;
        }
        if let Some(pid) = Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process(pid, Signal::TERM);
        }
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_)) | Err(_)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Waits for `child`, passing on the signals a job gets meanwhile.
fn forward_signals_until_exit(child: &mut Child) -> anyhow::Result<ExitStatus> {
    use tokio::signal::unix::{SignalKind, signal};
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let pid = Pid::from_raw(child.id() as i32).context("the command has no pid")?;
    runtime.block_on(async {
        let kinds = [
            (SignalKind::terminate(), Signal::TERM),
            (SignalKind::interrupt(), Signal::INT),
            (SignalKind::hangup(), Signal::HUP),
            (SignalKind::quit(), Signal::QUIT),
            (SignalKind::user_defined1(), Signal::USR1),
            (SignalKind::user_defined2(), Signal::USR2),
        ];
        let mut streams = Vec::new();
        for (kind, sig) in kinds {
            streams.push((signal(kind)?, sig));
        }
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            let received = futures_first(&mut streams);
            tokio::select! {
                sig = received => {
                    let _ = rustix::process::kill_process(pid, sig);
                }
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    })
}

/// The first of `streams` to deliver a signal, as the signal to forward.
async fn futures_first(streams: &mut [(tokio::signal::unix::Signal, Signal)]) -> Signal {
    std::future::poll_fn(|cx| {
        for (stream, sig) in streams.iter_mut() {
            if stream.poll_recv(cx).is_ready() {
                return std::task::Poll::Ready(*sig);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// The command's status as this process's: its code, or 128 + the signal
/// that ended it.
fn exit_code(status: ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        (None, Some(sig)) => ExitCode::from(u8::try_from(128 + sig).unwrap_or(1)),
        (None, None) => ExitCode::from(1),
    }
}

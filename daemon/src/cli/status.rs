//! `stoker status`: the running daemon's clients and streams as a table or
//! JSON, once or redrawn (`--watch`), after waiting for a daemon to answer
//! (`--wait`).

use std::collections::HashMap;
use std::process::ExitCode;

use stoker_client::Client;
use stoker_proto::StatusReport;

use super::connect::Target;
use super::output::{human_bytes, human_duration, shorten, table};
use super::users::Users;

/// `stoker status`: with `wait`, first waits that many seconds at most for a
/// daemon to answer; then [`show`]s its status.
pub(super) fn run(target: &Target, json: bool, watch: Option<f64>, wait: Option<f64>) -> anyhow::Result<ExitCode> {
    if let Some(seconds) = wait {
        status_waiting(target, seconds)?;
    }
    show(target, json, watch)
}

/// `stoker status --wait`: asks for the status until a daemon answers or
/// `seconds` have passed. Connection failures are retried (nothing listening
/// yet, the socket not yet given its mode, a daemon draining before a
/// restart); an answer that no retry changes (this uid is not served, a
/// protocol mismatch, a bad config file) fails at once.
pub(super) fn status_waiting(target: &Target, seconds: f64) -> anyhow::Result<StatusReport> {
    use std::time::{Duration, Instant};
    use stoker_client::ClientError;
    use stoker_proto::ErrorKind;
    let within = Duration::try_from_secs_f64(seconds)
        .map_err(|_| anyhow::anyhow!("--wait takes a number of seconds >= 0, not {seconds}"))?;
    let path = target.socket_path()?;
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

/// `stoker status`: one report, or (`watch`) a redraw every so many seconds until Ctrl-C.
fn show(target: &Target, json: bool, watch: Option<f64>) -> anyhow::Result<ExitCode> {
    let mut users = Users::default();
    let Some(every) = watch else {
        let report = target.connect()?.status()?;
        if json {
            outln!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            out!("{}", format_status(&report, &users.names(&report)));
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

/// The human-readable `stoker status` report; `users` names uids (others show as numbers).
pub fn format_status(r: &StatusReport, users: &HashMap<u32, String>) -> String {
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
    if r.memory.budget_bytes > 0 {
        let _ = writeln!(out, "memory budget: {} ({})", human_bytes(r.memory.budget_bytes), r.memory.source);
    }
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
            memory: stoker_proto::MemoryStatus {
                budget_bytes: 100 << 20,
                source: "half of the limit of cgroup /x".into(),
            },
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
        assert!(text.contains("memory budget: 104.9 MB (half of the limit of cgroup /x)"), "{text}");
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
}

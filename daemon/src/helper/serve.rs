//! The HDF5 helper process's side (`stoker hdf5-helper --fd N`): opens the
//! files it is passed with libhdf5 and answers the daemon's requests, one at a
//! time, until the daemon closes the socket. It runs with its trust domain's
//! credentials, no new privileges and bounded memory (set by the daemon before
//! exec, see `process.rs`); whatever a crafted file does to libhdf5 here, it
//! does to this process only.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use stoker_data::source::hdf5::{LibFile, LocalFile, ProbeError, probe};

use super::wire::{self, Reply, Request};

/// Files one helper keeps open at once (the daemon bounds its own open files
/// far below this; beyond it an open fails).
const MAX_OPEN: usize = 1 << 16;

/// The socket the daemon passed at descriptor `fd`, checked to be one.
pub fn socket(fd: i32) -> std::io::Result<UnixStream> {
    let path = format!("/proc/self/fd/{fd}");
    let target = std::fs::read_link(&path)?;
    if fd < 3 || !target.to_string_lossy().starts_with("socket:") {
        return Err(std::io::Error::other(format!(
            "hdf5-helper is started by the daemon, with a socket at --fd (descriptor {fd} is {})",
            target.display()
        )));
    }
    Ok(UnixStream::from(super::process::adopt(fd)))
}

/// Renews the CPU bound for the next request: `RLIMIT_CPU`'s soft limit
/// `cpu_s` seconds past what the helper has used so far (the kernel sends
/// SIGXCPU, which ends it, past that; the hard limit stays open so the next
/// request can renew it). The daemon's wall-clock `helper_timeout_s` bounds
/// a request too; this bounds it where the daemon's watch cannot, inside the
/// process, whatever libhdf5 does with threads.
fn bound_cpu(cpu_s: u64) {
    if cpu_s == 0 {
        return;
    }
    let used = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    let seconds = u64::try_from(used.tv_sec).unwrap_or(0) + 1;
    let limit = rustix::process::Rlimit { current: Some(seconds.saturating_add(cpu_s)), maximum: None };
    let _ = rustix::process::setrlimit(rustix::process::Resource::Cpu, limit);
}

/// Serves the daemon on `sock` until it closes it, under the helper's
/// seccomp filter (`sandbox.rs`), each request within `cpu_s` seconds of CPU.
pub fn run(sock: UnixStream, cpu_s: u64) -> std::io::Result<()> {
    if let Err(e) = super::sandbox::install() {
        // Still its own process, with its user's rights only: say so, go on.
        eprintln!("stoker hdf5-helper: cannot install the seccomp filter ({e}); running without it");
    }
    let mut files: HashMap<u64, LocalFile> = HashMap::new();
    let mut next = 1u64;
    let mut fds: Vec<OwnedFd> = Vec::new();
    loop {
        let Some(request) = wire::recv::<Request>(&sock, &mut fds)? else {
            return Ok(());
        };
        bound_cpu(cpu_s);
        match request {
            Request::Open { h5paths, fast_path } => {
                let reply = match fds.pop() {
                    None => Reply::OpenFailed(ProbeError::Helper("no file was passed with the open".into())),
                    Some(_) if files.len() >= MAX_OPEN => {
                        Reply::OpenFailed(ProbeError::Helper(format!("the helper holds {MAX_OPEN} files already")))
                    }
                    Some(fd) => match probe(&File::from(fd), &h5paths, fast_path) {
                        Ok((facts, local)) => {
                            let handle = next;
                            next += 1;
                            files.insert(handle, local);
                            Reply::Opened { handle, facts }
                        }
                        Err(e) => Reply::OpenFailed(e),
                    },
                };
                fds.clear();
                wire::send(&sock, &reply, None)?;
            }
            Request::Locate { handle, field, chunk } => {
                let reply = match files.get(&handle) {
                    None => Reply::Failed(format!("no open file {handle}")),
                    Some(f) => match f.locate(field as usize, &chunk) {
                        Ok(loc) => Reply::Located(loc),
                        Err(e) => Reply::Failed(e.to_string()),
                    },
                };
                wire::send(&sock, &reply, None)?;
            }
            Request::Read { handle, field, start, count, bytes } => {
                let result = match (files.get(&handle), usize::try_from(bytes)) {
                    (None, _) => Err(format!("no open file {handle}")),
                    (_, Err(_)) => Err(format!("a read of {bytes} bytes does not fit in memory")),
                    (Some(f), Ok(bytes)) => {
                        let mut buf = Vec::new();
                        match buf.try_reserve_exact(bytes) {
                            Err(_) => Err(format!("cannot allocate {bytes} bytes")),
                            Ok(()) => {
                                buf.resize(bytes, 0);
                                f.read(field as usize, &start, &count, &mut buf)
                                    .map(|()| buf)
                                    .map_err(|e| e.to_string())
                            }
                        }
                    }
                };
                match result {
                    Ok(buf) => {
                        wire::send(&sock, &Reply::Data, None)?;
                        wire::send_data(&sock, &buf)?;
                    }
                    Err(message) => wire::send(&sock, &Reply::Failed(message), None)?,
                }
            }
            Request::Close { handle } => {
                files.remove(&handle);
            }
        }
    }
}

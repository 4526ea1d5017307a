//! Starting an HDF5 helper: `/proc/self/exe hdf5-helper --fd N` with one
//! end of a socket pair, an empty environment (but `HDF5_PLUGIN_PATH`), and,
//! set between fork and exec: the trust domain's uid, gid and groups (when
//! the daemon runs as root), no capabilities beyond what reopening the files
//! needs, `no_new_privs`, no core dumps, and a bounded address space. The
//! helper itself bounds each request's CPU time (`--cpu-s`, see `serve.rs`).

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

use rustix::process::{Resource, Rlimit};
use rustix::thread::{CapabilitySet, CapabilitySets};

/// Whose rights a helper runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Creds {
    /// A client's: its uid, primary gid, and groups (primary first).
    User { uid: u32, gid: u32, groups: Vec<u32> },
    /// The daemon's own (datasets named in the config), without its
    /// capabilities but `CAP_DAC_READ_SEARCH` when it runs as root (the files
    /// of named datasets are opened with the daemon's rights).
    Daemon,
}

/// Starts a helper with `creds`, its address space bounded to `memory_bytes`
/// (0: unbounded) and each request to `cpu_s` seconds of CPU (0:
/// unbounded); returns it and the daemon's end of its socket.
pub(crate) fn spawn(creds: &Creds, memory_bytes: u64, cpu_s: u64) -> std::io::Result<(Child, UnixStream)> {
    let (ours, theirs) = UnixStream::pair()?;
    let fd = theirs.as_raw_fd();
    let root = rustix::process::geteuid().is_root();
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg("hdf5-helper").arg("--fd").arg(fd.to_string()).arg("--cpu-s").arg(cpu_s.to_string());
    cmd.env_clear();
    for keep in ["HDF5_PLUGIN_PATH", "LD_LIBRARY_PATH"] {
        if let Some(value) = std::env::var_os(keep) {
            cmd.env(keep, value);
        }
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
    let creds = creds.clone();
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe work is allowed: it makes raw system calls (rustix)
    // on values computed before the fork, and allocates nothing. `fd` stays
    // open in the parent (held by `theirs`) until `spawn` returns.
    unsafe {
        cmd.pre_exec(move || {
            // SAFETY: `fd` is open in this (child) process: inherited from the parent.
            let passed = BorrowedFd::borrow_raw(fd);
            rustix::io::fcntl_setfd(passed, rustix::io::FdFlags::empty())?;
            let no_core = Rlimit { current: Some(0), maximum: Some(0) };
            rustix::process::setrlimit(Resource::Core, no_core)?;
            if memory_bytes > 0 {
                let bound = Rlimit { current: Some(memory_bytes), maximum: Some(memory_bytes) };
                rustix::process::setrlimit(Resource::As, bound)?;
            }
            if root {
                match &creds {
                    Creds::User { uid, gid, groups } => set_ids(*uid, *gid, groups)?,
                    Creds::Daemon => {}
                }
                // Still root (the daemon's domain, or a root client's): keep
                // only what reopening the files passed needs.
                if rustix::process::geteuid().is_root() {
                    let keep = CapabilitySet::DAC_READ_SEARCH;
                    let sets = CapabilitySets { effective: keep, permitted: keep, inheritable: CapabilitySet::empty() };
                    rustix::thread::set_capabilities(None, sets)?;
                }
            }
            rustix::thread::set_no_new_privs(true)?;
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    drop(theirs);
    Ok((child, ours))
}

/// Becomes `uid`/`gid` with `groups` (raw per-thread calls: the forked
/// child has one thread). Changing every uid away from 0 drops all
/// capabilities.
fn set_ids(uid: u32, gid: u32, groups: &[u32]) -> std::io::Result<()> {
    const MAX: usize = 64;
    let mut gids = [rustix::fs::Gid::ROOT; MAX];
    let n = groups.len().min(MAX);
    for (slot, &g) in gids.iter_mut().zip(&groups[..n]) {
        *slot = rustix::fs::Gid::from_raw(g);
    }
    rustix::thread::set_thread_groups(&gids[..n])?;
    let gid = rustix::fs::Gid::from_raw(gid);
    rustix::thread::set_thread_res_gid(gid, gid, gid)?;
    let uid = rustix::fs::Uid::from_raw(uid);
    rustix::thread::set_thread_res_uid(uid, uid, uid)?;
    Ok(())
}

/// Takes ownership of descriptor `fd`, which the daemon passed to this
/// helper process at start (`--fd`); the caller checked that it is open and
/// a socket.
pub(super) fn adopt(fd: i32) -> OwnedFd {
    // SAFETY: `fd` is open (its /proc entry was just read) and owned by
    // nobody else in this process: it was inherited across exec for this
    // purpose, and adopted once, at start.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

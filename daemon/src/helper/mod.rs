//! HDF5 helper processes: the daemon never runs libhdf5 on a file a client
//! names. Each trust domain (a client uid for its ad-hoc datasets; the
//! daemon itself for datasets named in the config) has one helper process,
//! started on first use with that domain's credentials (`process.rs`), which
//! opens the files the daemon passes it and answers with plain facts
//! (shapes, types, layouts, chunk locations) and, for fields only libhdf5
//! reads, the bytes (`wire.rs`, [`serve`]). The daemon checks every number
//! before it reads a byte (`FieldReader::from_facts`, `check_sizes`) and
//! reads the fast paths itself.
//!
//! A helper that crashes, hangs past `[hdf5] helper_timeout_s` or breaks
//! the protocol is killed; what it owed fails with an error naming the file
//! and field (the daemon and other users never notice), its files are
//! opened again through a new helper, started with back-off after
//! repeated deaths. Each domain's requests take turns on its helper (its own
//! libhdf5, its own lock): one user's slow file does not hold another's.

#[allow(unsafe_code)] // fork/exec set-up of the helper (pre_exec)
mod process;
mod sandbox;
pub mod serve;
mod wire;

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::net::UnixStream;
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use stoker_data::fsaccess::Peer;
use stoker_data::source::hdf5::{FieldError, FieldFacts, Hdf5Opener, LibFile, LocalOpener, Location, ProbeError};

pub(crate) use process::Creds;
use wire::{Reply, Request};

/// How helpers run: `[hdf5] helper_timeout_s`, `helper_memory_bytes`.
#[derive(Debug, Clone, Copy)]
pub struct HelperLimits {
    /// Longest a request may take before its helper is killed.
    pub timeout: Duration,
    /// Address-space bound of a helper (0: none).
    pub memory_bytes: u64,
}

/// The helpers of every trust domain.
#[derive(Debug)]
pub struct Helpers {
    limits: HelperLimits,
    /// `None`: libhdf5 runs in this process (unit tests; never the daemon).
    isolated: bool,
    /// By domain: `Some(uid)` for a client's, `None` for the daemon's.
    by_domain: Mutex<HashMap<Option<u32>, Arc<Helper>>>,
    /// Helper deaths since start, of every domain.
    deaths: Arc<AtomicU64>,
}

/// Helpers in use at once beyond which the daemon warns (a node has few
/// users with open HDF5 datasets).
const MAX_HELPERS: usize = 256;

impl Helpers {
    /// Helpers with `limits`, started on demand.
    pub fn new(limits: HelperLimits) -> Arc<Helpers> {
        Arc::new(Helpers { limits, isolated: true, by_domain: Mutex::new(HashMap::new()), deaths: Arc::default() })
    }

    /// libhdf5 in this process, for tests of the code around it.
    pub fn in_process() -> Arc<Helpers> {
        let limits = HelperLimits { timeout: Duration::from_secs(60), memory_bytes: 0 };
        Arc::new(Helpers { limits, isolated: false, by_domain: Mutex::new(HashMap::new()), deaths: Arc::default() })
    }

    /// Where the files of a dataset opened by `peer` (`None`: a named
    /// dataset) are opened with libhdf5.
    pub fn opener(&self, peer: Option<&Peer>) -> Arc<dyn Hdf5Opener> {
        if !self.isolated {
            return Arc::new(LocalOpener);
        }
        let domain = peer.map(|p| p.uid);
        let mut by_domain = self.by_domain.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(helper) = by_domain.get(&domain) {
            return Arc::new(DomainOpener(helper.clone()));
        }
        // Helpers nobody holds any more (their user's HDF5 datasets are all
        // closed) are stopped; more than MAX_HELPERS in use are still served.
        by_domain.retain(|_, h| Arc::strong_count(h) > 1);
        if by_domain.len() >= MAX_HELPERS {
            tracing::warn!(helpers = by_domain.len(), "many HDF5 helper processes in use at once");
        }
        let creds = match peer {
            Some(p) => Creds::User { uid: p.uid, gid: p.gid, groups: p.groups() },
            None => Creds::Daemon,
        };
        let helper = Arc::new(Helper::new(creds, self.limits, self.deaths.clone()));
        by_domain.insert(domain, helper.clone());
        Arc::new(DomainOpener(helper))
    }

    /// Helper processes running now, and deaths (crashes and timeouts) so
    /// far. Never waits for a helper (a scrape runs on the async threads).
    pub fn counts(&self) -> (usize, u64) {
        let by_domain = self.by_domain.lock().unwrap_or_else(PoisonError::into_inner);
        let running = by_domain.values().filter(|h| h.running.load(Ordering::Relaxed)).count();
        (running, self.deaths.load(Ordering::Relaxed))
    }
}

/// One trust domain's helper: started on first use, restarted after it dies.
#[derive(Debug)]
struct Helper {
    creds: Creds,
    limits: HelperLimits,
    state: Mutex<State>,
    /// Whether its process runs (for counts that never wait on `state`).
    running: AtomicBool,
    /// The daemon-wide count of helper deaths.
    deaths: Arc<AtomicU64>,
}

#[derive(Debug)]
struct State {
    conn: Option<(Child, UnixStream)>,
    /// Bumped at every death: handles of an older generation are gone.
    generation: u64,
    /// Deaths in a row (back-off).
    failures: u32,
    /// No new helper before this (back-off after deaths).
    not_before: Option<Instant>,
}

impl Drop for Helper {
    fn drop(&mut self) {
        // Its process ends when the socket closes; reap it.
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some((mut child, sock)) = state.conn.take() {
            drop(sock);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Why a request to a helper did not get an answer.
#[derive(Debug)]
enum Lost {
    /// The handle belongs to a helper that has since died.
    Gone,
    /// The helper died or hung on this request (how; whether the request
    /// caused it: a hang or a fault, not a kill from outside).
    Died(String, bool),
    /// No helper could be started (why).
    Unavailable(String),
}

impl Lost {
    fn message(&self) -> String {
        match self {
            Lost::Gone => FieldError::Reopen.to_string(),
            Lost::Died(how, true) => format!(
                "the HDF5 library {how} reading it (in this user's HDF5 helper process; the daemon and other users \
                 are unaffected): the file may be crafted or corrupt, check it with h5dump; its reads fail until \
                 it changes"
            ),
            Lost::Died(how, false) => format!(
                "the HDF5 helper process reading it {how} (killed from outside, the out-of-memory killer perhaps; \
                 the next read starts a new one)"
            ),
            Lost::Unavailable(why) => format!("no HDF5 helper process could be started to read it: {why}"),
        }
    }

    /// The error of a request on an open file.
    fn field_error(self) -> FieldError {
        match self {
            Lost::Gone => FieldError::Reopen,
            Lost::Died(_, its_doing) => {
                let file_crashed_it = its_doing;
                FieldError::Helper { message: self.message(), file_crashed_it }
            }
            Lost::Unavailable(_) => FieldError::Helper { message: self.message(), file_crashed_it: false },
        }
    }
}

impl Helper {
    fn new(creds: Creds, limits: HelperLimits, deaths: Arc<AtomicU64>) -> Helper {
        let state = State { conn: None, generation: 0, failures: 0, not_before: None };
        Helper { creds, limits, state: Mutex::new(state), running: AtomicBool::new(false), deaths }
    }

    /// One round trip: sends `request` (with `fd`), waits for the answer,
    /// and for [`Reply::Data`] reads the bytes into `data`. `generation`:
    /// the handle's, `None` for an open (any helper will do).
    fn call(
        &self,
        request: &Request,
        fd: Option<&File>,
        generation: Option<u64>,
        data: Option<&mut [u8]>,
    ) -> Result<(Reply, u64), Lost> {
        // Only a library read waits by running other fills: it runs outside
        // every cache load (a lookup may run inside one, which a nested fill
        // of the same chunk would wait for).
        let mut state = if matches!(request, Request::Read { .. }) {
            self.lock_state()
        } else {
            self.state.lock().unwrap_or_else(PoisonError::into_inner)
        };
        // A helper that died since its last answer (killed from outside,
        // out of memory while idle) owed nothing: handles of it are gone,
        // and an open goes to a new one.
        if let Some((child, _)) = state.conn.as_mut()
            && matches!(child.try_wait(), Ok(Some(_)))
        {
            self.bury(&mut state, std::io::Error::other("exited while idle"));
        }
        if generation.is_some_and(|g| g != state.generation) {
            return Err(Lost::Gone);
        }
        if state.conn.is_none() {
            // After deaths in a row a new helper starts no sooner than the
            // back-off allows (at most 10 s): requests wait for it rather than
            // fail, so a crash loop of one file is throttled without failing
            // the reads of the domain's other files.
            if let Some(at) = state.not_before.take() {
                std::thread::sleep(at.saturating_duration_since(Instant::now()));
            }
            let (child, sock) =
                process::spawn(&self.creds, self.limits.memory_bytes, self.limits.timeout.as_secs().saturating_add(1))
                    .map_err(|e| Lost::Unavailable(format!("it could not be started ({e})")))?;
            let _ = sock.set_read_timeout(Some(self.limits.timeout));
            let _ = sock.set_write_timeout(Some(self.limits.timeout));
            state.conn = Some((child, sock));
            self.running.store(true, Ordering::Relaxed);
        }
        let generation = state.generation;
        let sock = &state.conn.as_ref().expect("started above").1;
        if let Err(e) = wire::send(sock, request, fd.map(wire::borrowed)) {
            // It never got the request: nothing of this request's doing.
            self.bury(&mut state, e);
            return Err(Lost::Gone);
        }
        match receive(sock, data) {
            Ok(reply) => {
                state.failures = 0;
                Ok((reply, generation))
            }
            Err(e) => {
                let (how, its_doing) = self.bury(&mut state, e);
                Err(Lost::Died(how, its_doing))
            }
        }
    }

    /// The helper's state, for one request. Its requests take turns, so a
    /// worker thread that finds the helper busy (another worker is waiting
    /// on this domain's libhdf5) runs other pending fills meanwhile, rayon
    /// `yield_now`, rather than block: one user's slow libhdf5 reads hold at
    /// most the worker inside the helper call, and other users' fills go on.
    fn lock_state(&self) -> std::sync::MutexGuard<'_, State> {
        thread_local! {
            /// Fills run inside this thread's waits, nested: bounded, so a
            /// pile of one domain's waiting fills cannot grow the stack.
            static DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
        }
        loop {
            match self.state.try_lock() {
                Ok(state) => return state,
                Err(std::sync::TryLockError::Poisoned(e)) => return e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
            let depth = DEPTH.with(|d| d.get());
            if depth >= 4 {
                return self.state.lock().unwrap_or_else(PoisonError::into_inner);
            }
            DEPTH.with(|d| d.set(depth + 1));
            let ran = rayon::yield_now();
            DEPTH.with(|d| d.set(depth));
            match ran {
                Some(rayon::Yield::Executed) => {}
                // Nothing else to do here (or not a worker): wait briefly.
                _ => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }

    /// Sends a request that gets no answer (best effort).
    fn tell(&self, request: &Request, generation: u64) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.generation != generation {
            return;
        }
        if let Some((_, sock)) = &state.conn
            && let Err(e) = wire::send(sock, request, None)
        {
            self.bury(&mut state, e);
        }
    }

    /// Kills the helper after `error`, reaps it, and says how it ended.
    /// Returns how it ended, and whether that was the request's doing: a
    /// hang, or a fault signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL,
    /// SIGSYS), not a kill from outside (the OOM killer's SIGKILL).
    fn bury(&self, state: &mut State, error: std::io::Error) -> (String, bool) {
        let Some((mut child, sock)) = state.conn.take() else { return ("ended".into(), false) };
        drop(sock);
        self.running.store(false, Ordering::Relaxed);
        self.deaths.fetch_add(1, Ordering::Relaxed);
        let timed_out = matches!(error.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut);
        let status = if timed_out {
            let _ = child.kill();
            child.wait().ok()
        } else {
            // It closed the socket: it is exiting or dead; wait briefly, then make sure.
            let deadline = Instant::now() + Duration::from_millis(500);
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => break Some(status),
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                    _ => {
                        let _ = child.kill();
                        break child.wait().ok();
                    }
                }
            }
        };
        use std::os::unix::process::ExitStatusExt;
        let signal = status.and_then(|s| s.signal());
        let faulted = matches!(
            signal,
            Some(
                libc::SIGSEGV
                    | libc::SIGBUS
                    | libc::SIGABRT
                    | libc::SIGFPE
                    | libc::SIGILL
                    | libc::SIGSYS
                    | libc::SIGXCPU
            )
        );
        let how = if timed_out {
            format!("did not answer within {} s (helper killed)", self.limits.timeout.as_secs_f64())
        } else {
            match signal {
                Some(signal) => format!("crashed (helper killed by signal {signal}{})", signal_name(signal)),
                None => format!("failed ({error}; helper exited: {})", status.map_or("?".into(), |s| s.to_string())),
            }
        };
        tracing::warn!(creds = ?self.creds, pid = child.id(), reason = %how, "HDF5 helper died; what it owed fails, the next use starts a new one");
        state.generation += 1;
        state.failures = state.failures.saturating_add(1);
        // 0 s after a first death, then 0.1, 0.2, ... up to 2 s between starts
        // (a file that crashed its helper is not read again until it changes,
        // so deaths in a row take many crafted files).
        let wait = Duration::from_millis(100).saturating_mul(1 << state.failures.saturating_sub(1).min(5));
        state.not_before = (state.failures > 1).then(|| Instant::now() + wait.min(Duration::from_secs(2)));
        (how, timed_out || faulted)
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGSEGV => " (SIGSEGV)",
        libc::SIGBUS => " (SIGBUS)",
        libc::SIGABRT => " (SIGABRT: out of memory or a failed check)",
        libc::SIGKILL => " (SIGKILL)",
        libc::SIGFPE => " (SIGFPE)",
        libc::SIGILL => " (SIGILL)",
        _ => "",
    }
}

/// Reads the answer to the request just sent (and any data into `data`,
/// whose length the request fixed).
fn receive(sock: &UnixStream, data: Option<&mut [u8]>) -> std::io::Result<Reply> {
    let mut fds = Vec::new();
    let reply: Reply = wire::recv(sock, &mut fds)?.ok_or(std::io::ErrorKind::UnexpectedEof)?;
    if let Reply::Data = reply {
        let Some(data) = data else {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "data nobody asked for"));
        };
        wire::recv_data(sock, data)?;
    }
    Ok(reply)
}

/// Opens files through one domain's helper.
#[derive(Debug)]
struct DomainOpener(Arc<Helper>);

impl Hdf5Opener for DomainOpener {
    fn open(
        &self,
        file: &File,
        h5paths: &[String],
        fast_path: bool,
    ) -> Result<(Vec<FieldFacts>, Arc<dyn LibFile>), ProbeError> {
        let request = Request::Open { h5paths: h5paths.to_vec(), fast_path };
        let mut answer = self.0.call(&request, Some(file), None, None);
        if let Err(Lost::Gone) = answer {
            // The helper was found dead before it got the open: a new one.
            answer = self.0.call(&request, Some(file), None, None);
        }
        match answer {
            Ok((Reply::Opened { handle, facts }, generation)) => {
                Ok((facts, Arc::new(RemoteFile { helper: self.0.clone(), handle, generation })))
            }
            Ok((Reply::OpenFailed(e), _)) => Err(e),
            Ok((other, _)) => Err(ProbeError::Helper(format!("the HDF5 helper answered {other:?} to an open"))),
            Err(lost) => Err(ProbeError::Helper(lost.message())),
        }
    }
}

/// A file open in a helper.
#[derive(Debug)]
struct RemoteFile {
    helper: Arc<Helper>,
    handle: u64,
    generation: u64,
}

impl LibFile for RemoteFile {
    fn locate(&self, field: usize, chunk_start: &[u64]) -> Result<Location, FieldError> {
        let request = Request::Locate { handle: self.handle, field: field as u32, chunk: chunk_start.to_vec() };
        match self.helper.call(&request, None, Some(self.generation), None) {
            Ok((Reply::Located(loc), _)) => Ok(loc),
            Ok((Reply::Failed(_), _)) => Err(FieldError::Locate { chunk: chunk_start.to_vec() }),
            Ok((other, _)) => Err(FieldError::Helper {
                message: format!("the HDF5 helper answered {other:?} to a lookup"),
                file_crashed_it: false,
            }),
            Err(lost) => Err(lost.field_error()),
        }
    }

    fn read(&self, field: usize, start: &[u64], count: &[u64], dst: &mut [u8]) -> Result<(), FieldError> {
        let request = Request::Read {
            handle: self.handle,
            field: field as u32,
            start: start.to_vec(),
            count: count.to_vec(),
            bytes: dst.len() as u64,
        };
        match self.helper.call(&request, None, Some(self.generation), Some(dst)) {
            Ok((Reply::Data, _)) => Ok(()),
            Ok((Reply::Failed(_), _)) => Err(FieldError::Library { start: start.to_vec(), count: count.to_vec() }),
            Ok((other, _)) => Err(FieldError::Helper {
                message: format!("the HDF5 helper answered {other:?} to a read"),
                file_crashed_it: false,
            }),
            Err(lost) => Err(lost.field_error()),
        }
    }
}

impl Drop for RemoteFile {
    fn drop(&mut self) {
        self.helper.tell(&Request::Close { handle: self.handle }, self.generation);
    }
}

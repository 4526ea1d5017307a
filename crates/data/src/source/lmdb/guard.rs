//! Guarded access to an LMDB environment's memory map: every LMDB call that
//! reads the map (transaction begin, lookups, cursor steps, copying a value
//! out) runs in the C shim `crates/data/csrc/lmdb_guard.c` under `sigsetjmp`, so a
//! SIGBUS (the file shrank under the map) or SIGSEGV (a corrupt page points
//! outside it) becomes a [`GuardError::Corrupt`] for that read, and the
//! environment is poisoned: later reads fail at once with the same message.
//!
//! Rust code never dereferences the map: [`Value`] is an address and a length
//! checked against the pages the environment uses, and its bytes reach Rust
//! only through [`Txn::copy`]. The only module of the daemon that calls LMDB.

#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::ptr::{self, NonNull};
use std::sync::{Once, OnceLock};

use ffi::{MDB_cursor, MDB_dbi, MDB_env, MDB_txn};
use lmdb_master_sys as ffi;

/// A guarded call was cut short by SIGBUS.
const STOKER_SIGBUS: c_int = -31001;
/// A guarded call was cut short by SIGSEGV.
const STOKER_SIGSEGV: c_int = -31002;
/// LMDB failed one of its internal assertions (debug builds of LMDB only).
const STOKER_ASSERT: c_int = -31003;
/// A key did not fit the buffer given.
const STOKER_KEY_TOO_LONG: c_int = -31004;

/// Longest key read while listing (LMDB's default limit is 511 bytes).
const MAX_KEY: usize = 4096;

const MDB_RDONLY: c_uint = 0x2_0000;
const MDB_NOSUBDIR: c_uint = 0x4000;
const MDB_NOLOCK: c_uint = 0x40_0000;
const MDB_NORDAHEAD: c_uint = 0x80_0000;

// The shim's functions (crates/data/csrc/lmdb_guard.c). Each returns 0, an LMDB
// error code, or one of the STOKER_* codes above.
unsafe extern "C" {
    fn stoker_guard_install() -> c_int;
    fn stoker_guard_fault_addr() -> *mut c_void;
    fn stoker_guard_assert_msg() -> *const c_char;
    fn stoker_env_open(path: *const c_char, flags: c_uint, env: *mut *mut MDB_env, dbi: *mut MDB_dbi) -> c_int;
    fn stoker_env_close(env: *mut MDB_env);
    fn stoker_txn_begin(env: *mut MDB_env, dbi: MDB_dbi, txn: *mut *mut MDB_txn, snap: *mut Snapshot) -> c_int;
    fn stoker_txn_abort(txn: *mut MDB_txn);
    fn stoker_get(
        txn: *mut MDB_txn,
        dbi: MDB_dbi,
        key: *const c_void,
        key_len: usize,
        data: *mut *const c_void,
        len: *mut usize,
    ) -> c_int;
    fn stoker_copy(dst: *mut c_void, src: *const c_void, len: usize) -> c_int;
    fn stoker_cursor_open(txn: *mut MDB_txn, dbi: MDB_dbi, cursor: *mut *mut MDB_cursor) -> c_int;
    fn stoker_cursor_close(cursor: *mut MDB_cursor);
    fn stoker_cursor_next(
        cursor: *mut MDB_cursor,
        first: c_int,
        key_buf: *mut c_void,
        key_cap: usize,
        key_len: *mut usize,
        data: *mut *const c_void,
        len: *mut usize,
    ) -> c_int;
}

/// What a read transaction sees of the file (`stoker_snapshot` in the shim).
/// A file that is not written while served never changes it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Snapshot {
    txnid: usize,
    last_pgno: usize,
    entries: usize,
    pages: usize,
    psize: c_uint,
    depth: c_uint,
}

/// What went wrong reading an environment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuardError {
    /// LMDB returned an error that says nothing about the file's integrity.
    #[error("{0}")]
    Lmdb(String),
    /// The data file is truncated or corrupt; the environment is poisoned.
    #[error("{0}")]
    Corrupt(String),
}

/// A value inside the map: where it lies, checked against the used pages.
#[derive(Debug, Clone, Copy)]
pub struct Value {
    addr: *const c_void,
    len: usize,
}

impl Value {
    /// The value's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
}

/// An environment open read-only, without a lock file, with its map guarded.
pub struct MappedEnv {
    env: NonNull<MDB_env>,
    dbi: MDB_dbi,
    /// The data file (for messages).
    data_file: PathBuf,
    /// Start of the map and the bytes of it LMDB may legitimately read
    /// (the pages up to the last used one, all present in the file at open).
    map: (usize, usize),
    /// What the first transaction saw; every later one must see the same.
    snapshot: Snapshot,
    /// Set by the first read that found the file truncated or corrupt.
    poisoned: OnceLock<String>,
}

// SAFETY: an LMDB environment may be shared between threads; opened with
// MDB_NOLOCK each read transaction is used by one thread at a time (`Txn` is
// neither Send nor Sync) and nothing writes through the environment.
unsafe impl Send for MappedEnv {}
// SAFETY: as above; `&MappedEnv` only begins read transactions.
unsafe impl Sync for MappedEnv {}

impl fmt::Debug for MappedEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedEnv")
            .field("data_file", &self.data_file)
            .field("snapshot", &self.snapshot)
            .field("poisoned", &self.poisoned.get())
            .finish_non_exhaustive()
    }
}

impl Drop for MappedEnv {
    fn drop(&mut self) {
        // SAFETY: every `Txn` borrows `self`, so none is alive; the pointer
        // came from `stoker_env_open` and is closed once.
        unsafe { stoker_env_close(self.env.as_ptr()) }
    }
}

fn install_handler() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: installs process-wide SIGBUS/SIGSEGV handlers that chain
        // to the previous ones for faults outside guarded calls.
        let rc = unsafe { stoker_guard_install() };
        if rc != 0 {
            tracing::warn!(
                errno = rc,
                "cannot install the SIGBUS/SIGSEGV handler: a truncated LMDB file will crash the daemon"
            );
        }
    });
}

fn strerror(code: c_int) -> String {
    // SAFETY: mdb_strerror returns a static string (or strerror's) for any code.
    let text = unsafe { ffi::mdb_strerror(code) };
    if text.is_null() {
        return format!("LMDB error {code}");
    }
    // SAFETY: non-null, NUL-terminated, valid until the next strerror call on this thread.
    unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
}

impl MappedEnv {
    /// Opens `path` (a directory holding `data.mdb`, or with `single_file`
    /// the data file) and checks the file holds every page the environment
    /// says it uses, so a file truncated at rest is refused here.
    ///
    /// With `data`, the data file already opened (and checked) by handle,
    /// LMDB opens that very inode through `/proc/self/fd/N` (`MDB_NOSUBDIR`):
    /// no path is looked up again, so nothing swapped in since (a FIFO, a
    /// symlink) is opened, and `path` only names it in messages.
    pub fn open(path: &Path, single_file: bool, data: Option<&std::fs::File>) -> Result<MappedEnv, GuardError> {
        install_handler();
        let data_file = if single_file { path.to_owned() } else { path.join("data.mdb") };
        let target = match data {
            Some(file) => crate::fsaccess::fd_path(file),
            None => path.to_owned(),
        };
        let c_path = CString::new(target.as_os_str().as_bytes())
            .map_err(|_| GuardError::Lmdb("the path contains a NUL byte".into()))?;
        let mut flags = MDB_RDONLY | MDB_NOLOCK | MDB_NORDAHEAD;
        if single_file || data.is_some() {
            flags |= MDB_NOSUBDIR;
        }
        let stat = match data {
            Some(file) => file.metadata(),
            None => std::fs::metadata(&data_file),
        };
        let before = stat
            .map(|m| file_mappings(std::os::unix::fs::MetadataExt::dev(&m), std::os::unix::fs::MetadataExt::ino(&m)))
            .unwrap_or_default();
        let mut env = ptr::null_mut();
        let mut dbi: MDB_dbi = 0;
        // SAFETY: valid out-pointers and a NUL-terminated path; the shim sets
        // `env` whenever mdb_env_create succeeded, even if opening failed.
        let rc = unsafe { stoker_env_open(c_path.as_ptr(), flags, &mut env, &mut dbi) };
        let Some(env) = NonNull::new(env) else {
            return Err(GuardError::Lmdb(strerror(rc)));
        };
        let mut mapped =
            MappedEnv { env, dbi, data_file, map: (0, 0), snapshot: Snapshot::default(), poisoned: OnceLock::new() };
        if rc != 0 {
            // LMDB sizes its map from the header: a header claiming more pages
            // than the file holds fails here (ENOMEM, say) and deserves a clearer word.
            let reopened;
            let file = match data {
                Some(file) => Some(file),
                None => {
                    reopened = std::fs::File::open(&mapped.data_file).ok();
                    reopened.as_ref()
                }
            };
            if let Some(why) = file.and_then(header_problem) {
                return Err(mapped.corrupt(why));
            }
            return Err(mapped.error(rc, "opening"));
        }
        let (txn, snapshot) = mapped.begin()?;
        drop(txn);
        mapped.snapshot = snapshot;
        let (dev, ino, file_len) =
            mapped.file_id().map_err(|e| GuardError::Lmdb(format!("cannot stat the data file: {e}")))?;
        let needed =
            (snapshot.last_pgno as u64).checked_add(1).and_then(|pages| pages.checked_mul(u64::from(snapshot.psize)));
        let needed = match needed {
            Some(needed) if needed <= file_len => needed,
            _ => {
                return Err(mapped.poison(format!(
                    "is truncated: it is {file_len} bytes but its header says it uses pages 0..={} of {} bytes ({} \
                     bytes)",
                    snapshot.last_pgno,
                    snapshot.psize,
                    needed.map_or("more than 2^64".to_string(), |n| n.to_string())
                )));
            }
        };
        // LMDB does not say where it mapped the file: the mapping of this
        // inode that appeared with this environment is it.
        let (start, len) = new_mapping(dev, ino, &before).ok_or_else(|| {
            GuardError::Lmdb(format!("cannot find the mapping of {} in /proc/self/maps", mapped.data_file.display()))
        })?;
        mapped.map = (start, len.min(usize::try_from(needed).unwrap_or(usize::MAX)));
        Ok(mapped)
    }

    /// Why the environment is unusable, once a read found it truncated or corrupt.
    pub fn poisoned(&self) -> Option<&str> {
        self.poisoned.get().map(String::as_str)
    }

    /// Begins a read transaction, checking the file still looks as it did at open.
    pub fn txn(&self) -> Result<Txn<'_>, GuardError> {
        self.check()?;
        let (txn, snapshot) = self.begin()?;
        if snapshot != self.snapshot {
            let (was, now) = (self.snapshot, snapshot);
            return Err(self.poison(format!(
                "changed while served (transaction {} → {}, {} → {} entries, last page {} → {}): an \
                 environment must not be written or replaced while served",
                was.txnid, now.txnid, was.entries, now.entries, was.last_pgno, now.last_pgno
            )));
        }
        Ok(txn)
    }

    fn begin(&self) -> Result<(Txn<'_>, Snapshot), GuardError> {
        let mut txn = ptr::null_mut();
        let mut snapshot = Snapshot::default();
        // SAFETY: an open environment, its main database and valid out-pointers.
        let rc = unsafe { stoker_txn_begin(self.env.as_ptr(), self.dbi, &mut txn, &mut snapshot) };
        // Aborted on drop, also when describing it failed.
        let txn = NonNull::new(txn).map(|txn| Txn { env: self, txn });
        match txn {
            Some(txn) if rc == 0 => Ok((txn, snapshot)),
            _ => Err(self.error(rc, "beginning a read transaction")),
        }
    }

    fn check(&self) -> Result<(), GuardError> {
        match self.poisoned.get() {
            Some(why) => Err(GuardError::Corrupt(why.clone())),
            None => Ok(()),
        }
    }

    /// Device, inode and length of the data file LMDB opened.
    pub fn file_id(&self) -> std::io::Result<(u64, u64, u64)> {
        let mut fd: ffi::mdb_filehandle_t = -1;
        // SAFETY: an open environment and a valid out-pointer.
        let rc = unsafe { ffi::mdb_env_get_fd(self.env.as_ptr(), &mut fd) };
        if rc != 0 || fd < 0 {
            return Err(std::io::Error::other(strerror(rc)));
        }
        // SAFETY: LMDB keeps the descriptor open until mdb_env_close, after this borrow ends.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let st = rustix::fs::fstat(fd)?;
        Ok((st.st_dev, st.st_ino, st.st_size.max(0) as u64))
    }

    /// Records `why` as the reason the environment is unusable and returns it as an error.
    fn poison(&self, why: String) -> GuardError {
        let first = self.poisoned.get_or_init(|| self.message(&why));
        GuardError::Corrupt(first.clone())
    }

    /// A corruption LMDB (or a bounds check) found without faulting: that
    /// read fails, the environment stays usable (`on_error = "skip"` may
    /// skip the value).
    fn corrupt(&self, why: String) -> GuardError {
        GuardError::Corrupt(self.message(&why))
    }

    fn message(&self, why: &str) -> String {
        format!(
            "the data file {} {why}; rebuild or restore the environment, then open the dataset again",
            self.data_file.display()
        )
    }

    /// Turns a shim return code into an error, poisoning on faults and corruption.
    fn error(&self, rc: c_int, doing: &str) -> GuardError {
        let offset = |addr: usize| match addr.checked_sub(self.map.0) {
            Some(off) if self.map.0 != 0 => format!("map offset {off}"),
            _ => format!("address {addr:#x}"),
        };
        match rc {
            STOKER_SIGBUS => {
                // SAFETY: reads this thread's record of its last fault.
                let addr = unsafe { stoker_guard_fault_addr() } as usize;
                self.poison(format!(
                    "is truncated (SIGBUS {doing} at {}: the file is shorter than its pages, truncated or \
                     rewritten while served)",
                    offset(addr)
                ))
            }
            STOKER_SIGSEGV => {
                // SAFETY: as above.
                let addr = unsafe { stoker_guard_fault_addr() } as usize;
                self.poison(format!("is corrupt (SIGSEGV {doing} at {}: a page points outside the map)", offset(addr)))
            }
            STOKER_ASSERT => {
                // SAFETY: the shim's thread-local buffer, always NUL-terminated.
                let msg = unsafe { CStr::from_ptr(stoker_guard_assert_msg()) }.to_string_lossy().into_owned();
                self.poison(format!("is corrupt (LMDB assertion failed {doing}: {msg})"))
            }
            ffi::MDB_CORRUPTED | ffi::MDB_PAGE_NOTFOUND | ffi::MDB_CURSOR_FULL => {
                self.corrupt(format!("is corrupt ({doing}: {})", strerror(rc)))
            }
            _ => GuardError::Lmdb(format!("{doing}: {}", strerror(rc))),
        }
    }

    /// `addr..addr+len` as a value inside the used pages, or poisons.
    fn value(&self, addr: *const c_void, len: usize, doing: &str) -> Result<Value, GuardError> {
        let (start, size) = self.map;
        let inside =
            (addr as usize).checked_sub(start).and_then(|off| off.checked_add(len)).is_some_and(|end| end <= size);
        if !inside {
            return Err(self.corrupt(format!(
                "is corrupt ({doing}: a value of {len} bytes at address {:#x} lies outside the {size} bytes of \
                 used pages)",
                addr as usize
            )));
        }
        Ok(Value { addr, len })
    }
}

/// Reads the meta pages with plain reads (no map) and says why the file
/// cannot hold what its newest valid header describes, if it cannot.
fn header_problem(file: &std::fs::File) -> Option<String> {
    use std::os::unix::fs::FileExt;
    // MDB_meta after the 16-byte page header: magic u32 @16, psize (the free
    // database's md_pad) u32 @40, mm_last_pg u64 @136, mm_txnid u64 @144.
    const MAGIC: u32 = 0xBEEF_C0DE;
    let len = file.metadata().ok()?.len();
    let meta = |at: u64| -> Option<(u32, u64, u64)> {
        let mut page = [0u8; 152];
        file.read_exact_at(&mut page, at).ok()?;
        let u32_at = |i: usize| page.get(i..i + 4).and_then(|b| b.try_into().ok()).map(u32::from_ne_bytes);
        let u64_at = |i: usize| page.get(i..i + 8).and_then(|b| b.try_into().ok()).map(u64::from_ne_bytes);
        (u32_at(16)? == MAGIC).then_some((u32_at(40)?, u64_at(136)?, u64_at(144)?))
    };
    let first = meta(0)?;
    let psize = first.0;
    if !psize.is_power_of_two() || !(512..=65536).contains(&psize) {
        return None;
    }
    let newest = match meta(u64::from(psize)) {
        Some(second) if second.2 > first.2 => second,
        _ => first,
    };
    let last = newest.1;
    let needed = last.checked_add(1).and_then(|n| n.checked_mul(u64::from(psize)));
    match needed {
        Some(needed) if needed <= len => None,
        _ => Some(format!(
            "is truncated or corrupt: it is {len} bytes but its header says it uses pages 0..={last} of {psize} bytes"
        )),
    }
}

/// Address ranges of this process's mappings of the file `(dev, ino)`.
fn file_mappings(dev: u64, ino: u64) -> Vec<(usize, usize)> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return Vec::new() };
    let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
    maps.lines()
        .filter_map(|line| {
            // start-end perms offset major:minor inode path
            let mut parts = line.split_ascii_whitespace();
            let (range, _, _, device, inode) =
                (parts.next()?, parts.next()?, parts.next()?, parts.next()?, parts.next()?);
            let (maj, min) = device.split_once(':')?;
            let same = u32::from_str_radix(maj, 16).ok()? == major
                && u32::from_str_radix(min, 16).ok()? == minor
                && inode.parse::<u64>().ok()? == ino;
            let (start, end) = range.split_once('-')?;
            let (start, end) = (usize::from_str_radix(start, 16).ok()?, usize::from_str_radix(end, 16).ok()?);
            same.then(|| (start, end.saturating_sub(start)))
        })
        .collect()
}

/// The mapping of `(dev, ino)` that is not among `before`.
fn new_mapping(dev: u64, ino: u64, before: &[(usize, usize)]) -> Option<(usize, usize)> {
    file_mappings(dev, ino).into_iter().find(|m| !before.contains(m))
}

/// A read transaction; aborted when dropped.
pub struct Txn<'e> {
    env: &'e MappedEnv,
    txn: NonNull<MDB_txn>,
}

impl fmt::Debug for Txn<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Txn").field("env", &self.env.data_file).finish_non_exhaustive()
    }
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        // SAFETY: the transaction came from stoker_txn_begin and is ended
        // once; aborting a read transaction frees it without reading the map.
        unsafe { stoker_txn_abort(self.txn.as_ptr()) }
    }
}

impl Txn<'_> {
    /// Looks `key` up: where its value lies in the map, or `None` when absent.
    pub fn get(&self, key: &[u8]) -> Result<Option<Value>, GuardError> {
        self.env.check()?;
        let (mut data, mut len) = (ptr::null(), 0usize);
        // SAFETY: a live transaction; `key` outlives the call; valid out-pointers.
        let rc =
            unsafe { stoker_get(self.txn.as_ptr(), self.env.dbi, key.as_ptr().cast(), key.len(), &mut data, &mut len) };
        match rc {
            0 => self.env.value(data, len, "looking a key up").map(Some),
            ffi::MDB_NOTFOUND => Ok(None),
            rc => Err(self.env.error(rc, "looking a key up")),
        }
    }

    /// Copies `value` (from this transaction) into `dst`, which must be exactly as long.
    pub fn copy(&self, value: Value, dst: &mut [u8]) -> Result<(), GuardError> {
        assert_eq!(dst.len(), value.len, "the destination holds exactly the value");
        self.env.check()?;
        // SAFETY: `value` lies inside the used pages of this environment's map
        // (checked by `MappedEnv::value`) and stays mapped while the
        // transaction lives; `dst` is a distinct, writable buffer of `len`
        // bytes. A fault reading the map is caught by the shim.
        let rc = unsafe { stoker_copy(dst.as_mut_ptr().cast(), value.addr, value.len) };
        match rc {
            0 => Ok(()),
            rc => Err(self.env.error(rc, "copying a value out of the map")),
        }
    }

    /// Reads the value of `key` into `buf` (resized to it); `false` when the key is absent.
    pub fn read(&self, key: &[u8], buf: &mut Vec<u8>) -> Result<bool, GuardError> {
        let Some(value) = self.get(key)? else { return Ok(false) };
        // No clear(): only bytes beyond the buffer's current length are zeroed.
        buf.resize(value.len, 0);
        self.copy(value, buf)?;
        Ok(true)
    }

    /// A cursor over the main database in key order.
    pub fn cursor(&self) -> Result<Cursor<'_, '_>, GuardError> {
        self.env.check()?;
        let mut cursor = ptr::null_mut();
        // SAFETY: a live transaction and a valid out-pointer.
        let rc = unsafe { stoker_cursor_open(self.txn.as_ptr(), self.env.dbi, &mut cursor) };
        match NonNull::new(cursor) {
            Some(cursor) if rc == 0 => Ok(Cursor { txn: self, cursor, started: false, seen: 0, key: vec![0; MAX_KEY] }),
            _ => Err(self.env.error(rc, "opening a cursor")),
        }
    }
}

/// A key (copied out of the map) and, when asked for, where its value lies.
pub type Entry<'a> = (&'a [u8], Option<Value>);

/// A cursor walking the main database; closed when dropped.
pub struct Cursor<'t, 'e> {
    txn: &'t Txn<'e>,
    cursor: NonNull<MDB_cursor>,
    started: bool,
    seen: u64,
    key: Vec<u8>,
}

impl fmt::Debug for Cursor<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cursor").field("seen", &self.seen).finish_non_exhaustive()
    }
}

impl Drop for Cursor<'_, '_> {
    fn drop(&mut self) {
        // SAFETY: opened by stoker_cursor_open in a transaction that is still
        // alive (borrowed); closing only frees it.
        unsafe { stoker_cursor_close(self.cursor.as_ptr()) }
    }
}

impl Cursor<'_, '_> {
    /// The next entry: its key (copied) and, with `want_value`, where its
    /// value lies (otherwise a large value's pages are not read); `None` at the end.
    pub fn next_entry(&mut self, want_value: bool) -> Result<Option<Entry<'_>>, GuardError> {
        let env = self.txn.env;
        env.check()?;
        let (mut key_len, mut data, mut len) = (0usize, ptr::null(), 0usize);
        // SAFETY: a live cursor; `self.key` is a writable buffer of its length; valid out-pointers.
        let rc = unsafe {
            stoker_cursor_next(
                self.cursor.as_ptr(),
                c_int::from(!self.started),
                self.key.as_mut_ptr().cast(),
                self.key.len(),
                &mut key_len,
                if want_value { &mut data } else { ptr::null_mut() },
                &mut len,
            )
        };
        self.started = true;
        match rc {
            0 => {}
            ffi::MDB_NOTFOUND => return Ok(None),
            STOKER_KEY_TOO_LONG => {
                return Err(env.corrupt(format!(
                    "is corrupt (listing keys: entry {} has a key of {key_len} bytes, LMDB keys are at most \
                     {MAX_KEY})",
                    self.seen
                )));
            }
            rc => return Err(env.error(rc, "listing keys")),
        }
        self.seen += 1;
        if self.seen > env.snapshot.entries as u64 {
            // A cycle among corrupt pages would otherwise walk forever.
            return Err(env.corrupt(format!(
                "is corrupt (listing keys: more entries than the {} the database records)",
                env.snapshot.entries
            )));
        }
        let value = if want_value { Some(env.value(data, len, "listing keys")?) } else { None };
        Ok(Some((&self.key[..key_len], value)))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use heed::types::Bytes;
    use heed::{CommitOrAbort, Database, EnvOpenOptions};

    use super::*;

    /// Writes `n` values of `size` bytes under keys `k000`… with heed; returns the data file.
    fn write_env(dir: &Path, n: usize, size: usize) -> PathBuf {
        let mut options = EnvOpenOptions::new();
        options.map_size(64 << 20);
        // SAFETY: a fresh environment in a test's own directory, used by this thread only.
        let env = unsafe { options.open(dir) }.unwrap();
        let wtxn = env.write_txn().unwrap();
        let db: Database<Bytes, Bytes> = env
            .create_databases_and_commit(wtxn, |creator, wtxn| -> heed::Result<_> {
                Ok(CommitOrAbort::<_, ()>::Commit(creator.create_database::<Bytes, Bytes>(wtxn, None)?))
            })
            .unwrap()
            .unwrap_commit();
        let mut wtxn = env.write_txn().unwrap();
        for i in 0..n {
            db.put(&mut wtxn, format!("k{i:03}").as_bytes(), &vec![i as u8; size]).unwrap();
        }
        wtxn.commit().unwrap();
        env.prepare_for_closing().wait();
        dir.join("data.mdb")
    }

    fn truncate(file: &Path, len: u64) {
        std::fs::OpenOptions::new().write(true).open(file).unwrap().set_len(len).unwrap();
    }

    #[test]
    fn reads_copy_values_and_list_keys() {
        let dir = tempfile::tempdir().unwrap();
        write_env(dir.path(), 20, 9000);
        let env = MappedEnv::open(dir.path(), false, None).unwrap();
        let txn = env.txn().unwrap();
        let mut buf = Vec::new();
        assert!(txn.read(b"k007", &mut buf).unwrap());
        assert_eq!(buf, vec![7u8; 9000]);
        assert!(!txn.read(b"nope", &mut buf).unwrap());
        let mut cursor = txn.cursor().unwrap();
        let mut keys = Vec::new();
        while let Some((key, value)) = cursor.next_entry(false).unwrap() {
            assert!(value.is_none());
            keys.push(key.to_vec());
        }
        assert_eq!(keys.len(), 20);
        assert_eq!(keys[19], b"k019");
        assert!(env.poisoned().is_none());
    }

    #[test]
    fn truncated_at_rest_is_refused_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let data = write_env(dir.path(), 20, 9000);
        let len = std::fs::metadata(&data).unwrap().len();
        truncate(&data, len - 1);
        let err = MappedEnv::open(dir.path(), false, None).unwrap_err();
        assert!(matches!(&err, GuardError::Corrupt(m) if m.contains("is truncated")), "{err}");
    }

    #[test]
    fn truncated_while_open_fails_the_read_and_poisons() {
        let dir = tempfile::tempdir().unwrap();
        let data = write_env(dir.path(), 40, 9000);
        let env = MappedEnv::open(dir.path(), false, None).unwrap();
        let txn = env.txn().unwrap();
        let value = txn.get(b"k039").unwrap().unwrap();
        // The value's pages (near the end of the file) go; the meta pages stay.
        truncate(&data, 8192);
        let mut buf = vec![0; value.len()];
        let err = txn.copy(value, &mut buf).unwrap_err();
        assert!(matches!(&err, GuardError::Corrupt(m) if m.contains("SIGBUS") && m.contains("is truncated")), "{err}");
        assert!(env.poisoned().is_some());
        drop(txn);
        // Poisoned: later reads fail at once with the first message.
        assert_eq!(env.txn().unwrap_err(), err);
    }

    #[test]
    fn header_beyond_the_file_is_described() {
        let dir = tempfile::tempdir().unwrap();
        let data = write_env(dir.path(), 5, 100);
        assert_eq!(header_problem(&std::fs::File::open(&data).unwrap()), None);
        let file = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
        use std::os::unix::fs::FileExt;
        for meta in [0u64, 4096] {
            file.write_all_at(&(1u64 << 40).to_ne_bytes(), meta + 136).unwrap();
        }
        let problem = header_problem(&std::fs::File::open(&data).unwrap()).unwrap();
        assert!(problem.contains("is truncated or corrupt") && problem.contains("1099511627776"), "{problem}");
    }

    /// A fault outside a guarded call still kills the process: run in a child.
    #[test]
    fn faults_outside_the_guard_still_crash() {
        if std::env::var_os("STOKER_GUARD_CRASH_CHILD").is_some() {
            install_handler();
            // SAFETY: deliberately not: this child process must die of SIGSEGV.
            let byte = unsafe { std::ptr::read_volatile(16 as *const u8) };
            std::process::exit(i32::from(byte));
        }
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "source::lmdb::guard::tests::faults_outside_the_guard_still_crash", "--nocapture"])
            .env("STOKER_GUARD_CRASH_CHILD", "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        // SIGSEGV is 11 on Linux.
        assert_eq!(status.signal(), Some(11), "{status:?}");
    }
}

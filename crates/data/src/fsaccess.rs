//! Opening the files a dataset names, once and by handle: a path is resolved
//! beneath its allowed root (`openat2(RESOLVE_BENEATH)`, so a symlink swapped
//! in after the check cannot lead outside it), only regular files (and LMDB
//! environment directories) are accepted, and ad-hoc files are opened with the
//! client's file-system rights when the daemon runs as root. Every later read
//! goes through the descriptor opened here (libraries that want a path get
//! `/proc/self/fd/N`), and each file is identified by [`FileId`].

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};

/// The client at the other end of the socket (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Process id (0 when unknown); its supplementary groups are read from `/proc/PID/status`.
    pub pid: u32,
}

impl Peer {
    /// The peer's groups, primary first: its supplementary groups from
    /// `/proc/PID/status` when that process is still the peer's (same
    /// effective uid: a pid may have been reused by another user's process
    /// since it connected), else only its primary group. The one reader of
    /// a peer's groups, for admission and for opening files with its rights.
    pub fn groups(&self) -> Vec<u32> {
        let mut groups = vec![self.gid];
        if self.pid == 0 {
            return groups;
        }
        let Ok(status) = std::fs::read_to_string(format!("/proc/{}/status", self.pid)) else {
            return groups;
        };
        let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::split_whitespace);
        let uid_matches =
            field("Uid:").and_then(|mut ids| ids.nth(1)).and_then(|s| s.parse::<u32>().ok()) == Some(self.uid);
        if uid_matches && let Some(list) = field("Groups:") {
            groups.extend(list.filter_map(|g| g.parse::<u32>().ok()).filter(|g| *g != self.gid));
        }
        groups
    }

    /// The daemon itself (for tests and for datasets named in the config).
    pub fn daemon() -> Peer {
        Peer {
            uid: rustix::process::getuid().as_raw(),
            gid: rustix::process::getgid().as_raw(),
            pid: std::process::id(),
        }
    }
}

/// Whose file-system rights open the files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rights {
    /// The daemon's own: datasets the admin named in the config.
    Daemon,
    /// The client's: ad-hoc datasets (`stoker.hdf5(...)`, ad-hoc LMDB).
    Client(Peer),
}

/// What makes a file the same file: where it lives and what it holds. A file
/// replaced (rename), rewritten or appended to gets a different id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    /// Device.
    pub dev: u64,
    /// Inode.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, in nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Status-change time, in nanoseconds since the epoch. Unlike the others
    /// a file's owner cannot set it (the kernel stamps it on every change),
    /// so a user's new file that reuses a freed inode and copies its size and
    /// mtime is still another file to the caches.
    pub ctime_ns: i128,
    /// Birth time (`statx`'s `btime`), in nanoseconds since the epoch, where
    /// the file system records it (ext4, xfs, btrfs; else 0). Also set by the
    /// kernel alone: an inode freed and handed to a new file is born again.
    pub btime_ns: i128,
}

impl FileId {
    /// The identity of an open file.
    pub fn of(file: &File) -> std::io::Result<FileId> {
        file.metadata().map(|m| FileId::from_meta(&m))
    }

    /// The identity of the file at `path` now (following symlinks).
    pub fn of_path(path: &Path) -> std::io::Result<FileId> {
        std::fs::metadata(path).map(|m| FileId::from_meta(&m))
    }

    fn from_meta(m: &std::fs::Metadata) -> FileId {
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
            // std reads it with statx where the kernel and file system have it.
            btime_ns: m
                .created()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(0)),
        }
    }

    /// How `now`'s contents may differ from `self`'s; `None` when they do
    /// not. A status change alone (`chmod`, a new link: only `ctime_ns`
    /// differs) is not a change of contents: a stream reading the file goes
    /// on, while the caches, keyed by the whole identity, start afresh.
    pub fn change(&self, now: &FileId) -> Option<FileChange> {
        if (self.dev, self.ino, self.btime_ns) != (now.dev, now.ino, now.btime_ns) {
            Some(FileChange::Replaced)
        } else if self.size != now.size {
            Some(FileChange::Resized { from: self.size, to: now.size })
        } else if self.mtime_ns != now.mtime_ns {
            Some(FileChange::Modified)
        } else {
            None
        }
    }
}

/// How a file differs from the one identified before (see [`FileId::change`]);
/// shown after the file's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FileChange {
    /// Another file (device, inode) is at its path now.
    #[error("was replaced by another file")]
    Replaced,
    /// Its size changed.
    #[error("changed size from {from} to {to} bytes")]
    Resized {
        /// The size before.
        from: u64,
        /// The size now.
        to: u64,
    },
    /// Same size, another modification time.
    #[error("was modified")]
    Modified,
}

/// Why a file being served cannot be read any more; shown after its path.
#[derive(Debug, thiserror::Error)]
pub enum ChangedError {
    /// Opening it again failed.
    #[error("could not be opened again while being served ({0})")]
    Reopen(AccessError),
    /// Its identity could not be read.
    #[error("cannot be checked for changes: {0}")]
    Unchecked(std::io::Error),
    /// It is no longer the file that was opened.
    #[error("{0} while being served; open a new Loader to read the new contents")]
    Changed(FileChange),
}

/// A file opened by [`open`], with the identity it had when opened.
#[derive(Debug)]
pub struct Opened {
    /// The path as the dataset names it (for messages).
    pub path: PathBuf,
    /// The resolved path (no symlinks) it was opened at.
    pub canonical: PathBuf,
    /// The allowed root it was opened beneath, if any.
    pub root: Option<PathBuf>,
    /// The open file (a directory for LMDB environment directories).
    pub file: File,
    /// Its identity when opened.
    pub id: FileId,
    /// Whether it is a directory.
    pub is_dir: bool,
}

impl Opened {
    /// Closes the file, keeping what identifies it (to open it again with
    /// [`reopen_same`] without holding a descriptor per file meanwhile).
    pub fn close(self) -> Checked {
        Checked { path: self.path, canonical: self.canonical, root: self.root, id: self.id }
    }
}

/// A file checked by [`open`] and closed again.
#[derive(Debug, Clone)]
pub struct Checked {
    /// The path as the dataset names it (for messages).
    pub path: PathBuf,
    /// The resolved path (no symlinks) it was opened at.
    pub canonical: PathBuf,
    /// The allowed root it was opened beneath, if any.
    pub root: Option<PathBuf>,
    /// Its identity when checked.
    pub id: FileId,
}

/// `/proc/self/fd/N` of an open file.
pub fn fd_path(file: &impl AsRawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// Why a file could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    /// Outside every allowed root.
    #[error(
        "{path} is outside the daemon's allowed_roots {roots:?}; ask the admin to add its directory \
         to [server] allowed_roots, or use a dataset named in the config"
    )]
    NotAllowed {
        /// The path.
        path: PathBuf,
        /// The roots in force.
        roots: Vec<PathBuf>,
    },
    /// Not a regular file (a FIFO, device, socket), or a directory where a file is needed.
    #[error("{path} is {kind}, not a regular file; stoker reads regular files only")]
    NotRegular {
        /// The path.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// The system refused (missing, permission denied, ...).
    #[error("cannot open {path}: {source}{hint}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
        /// What to do about it.
        hint: &'static str,
    },
    /// Switching to the client's rights failed.
    #[error("cannot take on the rights of uid {uid}: {message}")]
    Rights {
        /// The client's uid.
        uid: u32,
        /// What failed.
        message: String,
    },
}

impl AccessError {
    /// An I/O error; `rights` says whether the client's rights were in force (for the hint).
    pub fn io(path: &Path, source: impl Into<std::io::Error>, rights: bool) -> AccessError {
        let source = source.into();
        let hint = match source.raw_os_error() {
            Some(libc::EACCES) | Some(libc::EPERM) if rights => {
                " (the daemon opens ad-hoc files with the client's rights: check that you can read it)"
            }
            Some(libc::EXDEV) | Some(libc::ELOOP) => {
                " (it changed while being opened, or a symlink leads outside its allowed root)"
            }
            _ => "",
        };
        AccessError::Io { path: path.to_owned(), source, hint }
    }
}

/// Whether `f` should be run with the client's rights here, and which.
fn switch_to(rights: Rights) -> Option<Peer> {
    match rights {
        Rights::Client(peer) if rustix::process::geteuid().is_root() && peer.uid != 0 => Some(peer),
        _ => None,
    }
}

/// Runs `f` with `rights`: for a client of a daemon running as root, on a
/// short-lived thread whose file-system uid, gid and supplementary groups are
/// the client's (Linux keeps these per thread); otherwise right here, with
/// the daemon's own rights (which already bound what it can open).
pub fn with_rights<T: Send>(rights: Rights, f: impl FnOnce() -> T + Send) -> Result<T, AccessError> {
    let Some(peer) = switch_to(rights) else {
        return Ok(f());
    };
    let groups = peer.groups();
    std::thread::scope(|s| {
        let worker = std::thread::Builder::new()
            .name("stoker-open".into())
            .spawn_scoped(s, move || {
                become_client(&peer, &groups)?;
                Ok(f())
            })
            .map_err(|e| AccessError::Rights { uid: peer.uid, message: format!("cannot start a thread: {e}") })?;
        worker.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

#[allow(unsafe_code)]
fn become_client(peer: &Peer, groups: &[u32]) -> Result<(), AccessError> {
    let fail = |what: &str| AccessError::Rights {
        uid: peer.uid,
        message: format!("{what}: {}", std::io::Error::last_os_error()),
    };
    let gids: Vec<libc::gid_t> = groups.to_vec();
    // SAFETY: the raw syscall (not glibc's setgroups, which applies to every
    // thread of the process) changes only this thread's groups; `gids` is a
    // valid array of `gids.len()` gid_t for the duration of the call.
    let rc = unsafe { libc::syscall(libc::SYS_setgroups, gids.len(), gids.as_ptr()) };
    if rc != 0 {
        return Err(fail("setgroups"));
    }
    // SAFETY: setfsgid/setfsuid take plain integers and change only this
    // thread's file-system ids; they cannot fail in a way that breaks memory
    // safety. Success is checked by reading the value back (-1 leaves it as is).
    let gid_now = unsafe {
        libc::setfsgid(peer.gid);
        libc::setfsgid(u32::MAX)
    };
    // SAFETY: as above.
    let uid_now = unsafe {
        libc::setfsuid(peer.uid);
        libc::setfsuid(u32::MAX)
    };
    if gid_now as u32 != peer.gid || uid_now as u32 != peer.uid {
        return Err(AccessError::Rights { uid: peer.uid, message: "setfsuid/setfsgid did not take effect".into() });
    }
    Ok(())
}

/// What an open may accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// A regular file.
    File,
    /// A regular file or a directory (an LMDB environment).
    FileOrDir,
}

/// Opens `path` read-only, by handle: resolved once (symlinks followed
/// there), then, when `roots` are given, opened beneath the root that holds
/// it so that nothing swapped in afterwards can lead outside. FIFOs and
/// devices are refused before they are opened for reading (no blocking
/// open, no device side effects). Call it inside [`with_rights`].
pub fn open(path: &Path, roots: Option<&[PathBuf]>, want: Want) -> Result<Opened, AccessError> {
    let rights = roots.is_some();
    let canonical = path.canonicalize().map_err(|e| AccessError::io(path, e, rights))?;
    let (root, opath) = match roots {
        None => (None, rustix::fs::open(&canonical, path_flags(), Mode::empty())),
        Some(roots) => {
            let Some(root) = roots.iter().find(|r| canonical.starts_with(r)) else {
                return Err(AccessError::NotAllowed { path: path.to_owned(), roots: roots.to_vec() });
            };
            let rel = canonical.strip_prefix(root).unwrap_or(Path::new(""));
            let dir = rustix::fs::open(root, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| AccessError::io(root, e, rights))?;
            (Some(root.clone()), open_beneath(&dir, rel))
        }
    };
    let opath = opath.map_err(|e| AccessError::io(path, e, rights))?;
    let (file, is_dir) = reopen(path, opath, want, rights)?;
    let id = FileId::of(&file).map_err(|e| AccessError::io(path, e, rights))?;
    Ok(Opened { path: path.to_owned(), canonical, root, file, id, is_dir })
}

/// Opens `name` inside the directory `dir` (an LMDB environment's data.mdb),
/// not following a symlink there.
pub fn open_in(dir: &Opened, name: &str) -> Result<Opened, AccessError> {
    let path = dir.path.join(name);
    let rights = dir.root.is_some();
    let opath = rustix::fs::openat(dir.file.as_fd(), name, path_flags() | OFlags::NOFOLLOW, Mode::empty())
        .map_err(|e| AccessError::io(&path, e, rights))?;
    let (file, is_dir) = reopen(&path, opath, Want::File, rights)?;
    let id = FileId::of(&file).map_err(|e| AccessError::io(&path, e, rights))?;
    Ok(Opened { path, canonical: dir.canonical.join(name), root: dir.root.clone(), file, id, is_dir })
}

/// Opens the file at `canonical` again (after its descriptor was closed to
/// bound open files), with the daemon's rights, and checks it is still that
/// file: same device, inode, size and modification time.
/// The error says how it changed, without the path.
pub fn reopen_same(canonical: &Path, root: Option<&Path>, id: &FileId) -> Result<File, ChangedError> {
    let roots = root.map(|r| vec![r.to_owned()]);
    let opened = open(canonical, roots.as_deref(), Want::File).map_err(ChangedError::Reopen)?;
    match id.change(&opened.id) {
        None => Ok(opened.file),
        Some(change) => Err(ChangedError::Changed(change)),
    }
}

/// [`reopen_same`] with `rights`: a file closed to bound open files (or
/// opened again after its check) is reopened by path with the rights it was
/// first opened with, never the daemon's, so the reopen of a client's file
/// tells nothing of paths the client may not see.
pub fn reopen_as(rights: Rights, canonical: &Path, root: Option<&Path>, id: &FileId) -> Result<File, ChangedError> {
    with_rights(rights, || reopen_same(canonical, root, id)).map_err(ChangedError::Reopen)?
}

fn path_flags() -> OFlags {
    OFlags::PATH | OFlags::CLOEXEC
}

/// `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`; on kernels without
/// openat2, a walk of the components without following any symlink (the
/// path is canonical, so it has none unless one was swapped in).
fn open_beneath(dir: &OwnedFd, rel: &Path) -> rustix::io::Result<OwnedFd> {
    let rel_or_dot = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
    match rustix::fs::openat2(
        dir,
        rel_or_dot,
        path_flags(),
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
    ) {
        Err(rustix::io::Errno::NOSYS) => {}
        result => return result,
    }
    let mut at = rustix::io::dup(dir)?;
    for part in rel.components() {
        let Component::Normal(name) = part else {
            return Err(rustix::io::Errno::XDEV);
        };
        at = rustix::fs::openat(&at, name, path_flags() | OFlags::NOFOLLOW, Mode::empty())?;
    }
    Ok(at)
}

/// Turns an `O_PATH` descriptor into a readable one after checking what it is.
fn reopen(path: &Path, opath: OwnedFd, want: Want, rights: bool) -> Result<(File, bool), AccessError> {
    let opath = File::from(opath);
    let meta = opath.metadata().map_err(|e| AccessError::io(path, e, rights))?;
    let kind = meta.file_type();
    let is_dir = kind.is_dir();
    if !(kind.is_file() || (is_dir && want == Want::FileOrDir)) {
        let what = if is_dir {
            "a directory"
        } else if kind.is_fifo() {
            "a FIFO (named pipe)"
        } else if kind.is_char_device() {
            "a character device"
        } else if kind.is_block_device() {
            "a block device"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "a special file"
        };
        return Err(AccessError::NotRegular { path: path.to_owned(), kind: what });
    }
    if is_dir {
        return Ok((opath, true));
    }
    // Reopening through the descriptor's magic link opens that very inode,
    // with the permission check done now, under this thread's rights.
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let fd = rustix::fs::open(fd_path(&opath), flags, Mode::empty()).map_err(|e| AccessError::io(path, e, rights))?;
    let file = File::from(fd);
    let again = file.metadata().map_err(|e| AccessError::io(path, e, rights))?;
    if (again.dev(), again.ino()) != (meta.dev(), meta.ino()) {
        return Err(AccessError::io(path, rustix::io::Errno::XDEV, rights));
    }
    Ok((file, false))
}

/// The descriptors systemd passed this process (`LISTEN_FDS`, checked
/// against `LISTEN_PID`), with their names (`LISTEN_FDNAMES`), owned; the
/// variables are unset so children do not see them. Call once, at start.
#[allow(unsafe_code)]
pub fn listen_fds() -> Vec<(OwnedFd, String)> {
    let Ok(fds) = sd_notify::listen_fds_with_names(true) else { return Vec::new() };
    fds.map(|(fd, name)| {
        // SAFETY: systemd opened these descriptors for this process (sd_notify
        // checked LISTEN_PID) and nothing else in it owns them: they are
        // adopted once, here, and the variables naming them are unset.
        let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        (owned, name)
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_groups_come_from_its_process_only_while_it_is_the_peers() {
        let me = Peer::daemon();
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let listed: Vec<u32> = status
            .lines()
            .find_map(|l| l.strip_prefix("Groups:"))
            .map(|g| g.split_whitespace().filter_map(|n| n.parse().ok()).collect())
            .unwrap_or_default();
        let mine = me.groups();
        assert_eq!(mine[0], me.gid, "the primary group first");
        assert!(listed.iter().all(|g| mine.contains(g)), "{mine:?} lacks some of {listed:?}");
        // The same pid claimed by another uid (a pid reused since it
        // connected): only the primary group it connected with counts.
        let stranger = Peer { uid: me.uid.wrapping_add(12345), gid: 77, pid: me.pid };
        assert_eq!(stranger.groups(), [77]);
        assert_eq!(Peer { pid: 0, ..stranger }.groups(), [77], "no pid: the primary group");
    }

    #[test]
    fn symlink_out_of_root_is_refused_and_fifo_is_not_regular() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let root = root.canonicalize().unwrap();
        let outside = dir.path().join("secret");
        std::fs::write(&outside, b"x").unwrap();
        std::fs::write(root.join("ok"), b"hello").unwrap();
        let roots = vec![root.clone()];
        let ok = open(&root.join("ok"), Some(&roots), Want::File).unwrap();
        assert_eq!(ok.id.size, 5);
        assert!(!ok.is_dir);
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        assert!(matches!(open(&root.join("link"), Some(&roots), Want::File), Err(AccessError::NotAllowed { .. })));
        // A swap after canonicalisation: the component walk / openat2 stays beneath the root.
        let sub = root.join("sub");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join("f"), b"in").unwrap();
        let before = open(&sub.join("f"), Some(&roots), Want::File).unwrap();
        std::fs::remove_dir_all(&sub).unwrap();
        std::os::unix::fs::symlink(dir.path(), &sub).unwrap();
        let beneath = open_beneath(
            &rustix::fs::open(&root, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap(),
            Path::new("sub/secret"),
        );
        assert!(beneath.is_err(), "followed a swapped symlink out of the root");
        drop(before);
        let fifo = root.join("fifo");
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, rustix::fs::FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
        let err = open(&fifo, Some(&roots), Want::File).unwrap_err();
        assert!(err.to_string().contains("FIFO"), "{err}");
        let err = open(&root, Some(&roots), Want::File).unwrap_err();
        assert!(err.to_string().contains("directory"), "{err}");
        assert!(open(&root, Some(&roots), Want::FileOrDir).unwrap().is_dir);
    }

    #[test]
    fn identity_changes_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"abc").unwrap();
        let id = open(&path, None, Want::File).unwrap().id;
        assert_eq!(id.change(&id), None);
        std::fs::write(&path, b"abcd").unwrap();
        let now = open(&path, None, Want::File).unwrap().id;
        assert_eq!(id.change(&now), Some(FileChange::Resized { from: 3, to: 4 }));
        assert!(id.change(&now).unwrap().to_string().contains("size"));
        let err = reopen_same(&path.canonicalize().unwrap(), None, &id).unwrap_err();
        assert!(matches!(err, ChangedError::Changed(FileChange::Resized { .. })), "{err}");
        assert!(err.to_string().contains("while being served"), "{err}");
    }
}

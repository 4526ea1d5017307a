//! Environments open in this process, shared by every dataset that reads
//! them (opened once, by the checked handle, read-only without the lock file).

use std::collections::HashMap;
use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};

use regex::bytes::Regex;

use crate::source::SourceError;

use super::*;

/// An environment open in this process, shared by every dataset that reads it.
pub(super) struct SharedEnv {
    pub(super) path: PathBuf,
    pub(super) env: MappedEnv,
}

impl fmt::Debug for SharedEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedEnv").field("path", &self.path).finish_non_exhaustive()
    }
}

/// Environments open in this process, by data file (inode, or canonical path
/// where no checked handle was given): one mapping per environment, until a
/// read finds its file truncated or corrupt.
pub(super) static OPEN_ENVS: LazyLock<Mutex<HashMap<EnvKey, Weak<SharedEnv>>>> = LazyLock::new(Default::default);

/// What identifies an environment in [`OPEN_ENVS`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum EnvKey {
    /// The data file's device and inode (opened by handle).
    Inode(u64, u64),
    /// The canonical path (opened by name: the CLI and tests).
    Path(PathBuf),
}

impl SharedEnv {
    /// The environment at `path`, opened once per process. With `data`, its
    /// data file as checked by handle (the daemon's case), it is opened and
    /// found by that inode alone: no path is resolved again, with the
    /// daemon's rights or at all. The process-wide table is never locked
    /// across an open.
    pub(super) fn open(path: &Path, data: Option<&std::fs::File>) -> Result<Arc<SharedEnv>, SourceError> {
        let open_err = |message: String| SourceError::LmdbOpen { env: path.to_owned(), message };
        let (key, single_file) = match data {
            Some(file) => {
                let m = file.metadata().map_err(|e| open_err(format!("{e}")))?;
                (EnvKey::Inode(m.dev(), m.ino()), true)
            }
            None => {
                let canonical = path.canonicalize().map_err(|e| open_err(format!("{e}")))?;
                let single_file = canonical.is_file();
                if !single_file && !canonical.join("data.mdb").is_file() {
                    return Err(open_err(
                        "is a directory without data.mdb; give the environment directory, or its data file for \
                         environments written with subdir=False"
                            .into(),
                    ));
                }
                (EnvKey::Path(canonical), single_file)
            }
        };
        // A poisoned environment is never handed out again: the file may have
        // been restored since, and a fresh mapping reads it anew.
        // Nor is one whose file was written since it was mapped (a dataset
        // opened again to see new keys): beginning a transaction checks that.
        let current = |e: &Arc<SharedEnv>| e.env.poisoned().is_none() && e.env.txn().is_ok();
        let known = OPEN_ENVS.lock().unwrap_or_else(PoisonError::into_inner).get(&key).and_then(Weak::upgrade);
        if let Some(env) = known.filter(current) {
            return Ok(env);
        }
        // Read-only and without the lock file (MDB_NOLOCK): a served dataset
        // is not written (documented at the top of this module), so no
        // writer recycles pages under our readers.
        let env = MappedEnv::open(path, single_file, data).map_err(|e| match e {
            GuardError::Corrupt(message) => open_err(message),
            GuardError::Lmdb(message) => {
                let size = match data {
                    Some(file) => file.metadata().map(|m| m.len()),
                    None if single_file => std::fs::metadata(path).map(|m| m.len()),
                    None => std::fs::metadata(path.join("data.mdb")).map(|m| m.len()),
                };
                match size {
                    // Two meta pages of at least 4 KiB start every environment.
                    Ok(len) if len < 8192 => open_err(format!(
                        "not a readable LMDB environment ({message}): its data file is only {len} bytes, \
                         truncated or not LMDB; rebuild or restore the environment"
                    )),
                    _ => open_err(format!("not a readable LMDB environment: {message}")),
                }
            }
        })?;
        let shared = Arc::new(SharedEnv { path: path.to_owned(), env });
        let mut open = OPEN_ENVS.lock().unwrap_or_else(PoisonError::into_inner);
        // Another open of the same environment may have finished meanwhile: keep one.
        if let Some(env) = open.get(&key).and_then(Weak::upgrade).filter(current) {
            return Ok(env);
        }
        open.retain(|_, w| w.strong_count() > 0);
        open.insert(key, Arc::downgrade(&shared));
        Ok(shared)
    }

    /// The keys `filter` keeps, in LMDB order.
    pub(super) fn keys(&self, filter: &KeyFilter) -> Result<Keys, SourceError> {
        let regex = |pattern: &str| {
            Regex::new(pattern).map_err(|e| SourceError::LmdbOpen {
                env: self.path.clone(),
                message: format!("invalid key regex {pattern:?}: {e}"),
            })
        };
        let keep: KeyTest = match filter {
            KeyFilter::SkipMetadata => Box::new(|k| !is_metadata_key(k)),
            KeyFilter::All => Box::new(|_| true),
            KeyFilter::Prefix(prefix) => {
                let prefix = prefix.as_bytes().to_vec();
                Box::new(move |k| k.starts_with(&prefix))
            }
            KeyFilter::Include(pattern) => {
                let re = regex(pattern)?;
                Box::new(move |k| re.is_match(k))
            }
            KeyFilter::Exclude(pattern) => {
                let re = regex(pattern)?;
                Box::new(move |k| !re.is_match(k))
            }
        };
        let err =
            |e: GuardError| SourceError::LmdbOpen { env: self.path.clone(), message: format!("listing keys: {e}") };
        let txn = self.env.txn().map_err(err)?;
        let mut cursor = txn.cursor().map_err(err)?;
        let (mut keys, mut dropped) = (Keys::default(), 0u64);
        while let Some((key, _)) = cursor.next_entry(false).map_err(err)? {
            if keep(key) {
                keys.push(key);
            } else {
                dropped += 1;
            }
        }
        if dropped > 0 {
            tracing::info!(env = %self.path.display(), kept = keys.len(), dropped, ?filter, "LMDB key filter");
        }
        Ok(keys)
    }

    /// Fails naming the first of `keys` this environment lacks.
    pub(super) fn check_has(&self, keys: &Keys, field: &str) -> Result<(), SourceError> {
        let err = |e: GuardError| SourceError::LmdbOpen { env: self.path.clone(), message: e.to_string() };
        let txn = self.env.txn().map_err(err)?;
        let mut first = None;
        let mut missing = 0u64;
        for key in keys.iter() {
            if txn.get(key).map_err(err)?.is_none() {
                missing += 1;
                first.get_or_insert(key);
            }
        }
        match first {
            None => Ok(()),
            Some(key) => Err(SourceError::LmdbMissingKey {
                env: self.path.clone(),
                field: field.to_string(),
                key: show_key(key),
                missing,
                total: keys.len() as u64,
            }),
        }
    }
}

//! Which dataset a stream reads: resolves a client's [`DatasetRef`] (a name
//! from the config, or an ad-hoc HDF5 or LMDB description) into an open
//! [`Source`]. Ad-hoc files are opened by handle beneath `allowed_roots` with
//! the client's rights ([`stoker_data::fsaccess`]); named ones with the daemon's.
//! Opened sources are shared by later streams while their files are
//! unchanged (same device, inode, size and mtime, checked on every open) and
//! closed once no stream has used them for `[limits] idle_close_s` (and beyond
//! the [`KEEP_IDLE`] most recently used idle ones), which releases the files
//! and their HDF5 locks.

pub mod check;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use stoker_proto::hash::Fnv1a;
use stoker_proto::{DatasetInfo, DatasetRef, DatasetStatus, ErrorKind, Generation, LmdbDataset, Rescan};

use crate::config::{DatasetConfig, Settings};
use crate::error::WireError;
use crate::helper::Helpers;
use stoker_data::cache::{CacheCtx, Caches};
use stoker_data::fsaccess::{self, FileId, Peer, Rights, Want};
use stoker_data::source::hdf5::{self, Hdf5Source, Hdf5Spec, OpenFiles};
use stoker_data::source::lmdb::{CheckedLmdb, KeyFilter, LmdbField, LmdbSource, LmdbSpec, OnError};
use stoker_data::source::transformed::{FieldChain, Transformed, field_chains};
use stoker_data::source::{Source, SourceError};
use stoker_decode::codec::{Codec, Convert, RawLayout};
use stoker_decode::transform::{Pair, Step};

/// Idle sources (no open stream) kept open for the next stream that wants them.
pub const KEEP_IDLE: usize = 16;

/// An open dataset and how `stoker status` names it.
#[derive(Debug, Clone)]
pub struct Opened {
    /// Config name, or the ad-hoc path.
    pub label: String,
    /// The source.
    pub source: Arc<dyn Source>,
    /// Whether streams match the glob (list the keys) again at each new epoch.
    pub rescan: bool,
    /// Which files (keys) the source reads.
    pub generation: Generation,
    /// Fingerprint of its description and file identities: streams of the
    /// same fingerprint read the same samples under the same indices, so the
    /// caches plan eviction over all of them.
    pub fingerprint: u64,
}

/// One cached source: the identities of its files, and since when no stream uses it.
#[derive(Debug)]
struct Entry {
    opened: Opened,
    ids: Vec<FileId>,
    generation: Generation,
    used: Instant,
    idle_since: Option<Instant>,
}

type Registry = Mutex<HashMap<Resolved, Entry>>;

/// Every dataset the daemon has opened.
#[derive(Debug)]
pub struct Datasets {
    /// Replaced as a whole on SIGHUP; sources already open stay as they are.
    settings: RwLock<Arc<Settings>>,
    caches: Arc<Caches>,
    open_files: Arc<OpenFiles>,
    /// Keyed by the resolved description.
    open: Arc<Registry>,
    /// Where libhdf5 runs: a helper process per trust domain.
    helpers: Arc<Helpers>,
}

/// A dataset as the sources open it: also the registry's key and, with its
/// files' identities, the cache's dataset fingerprint (derived `Eq`/`Hash`,
/// so every parameter that changes the samples changes the identity).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Resolved {
    Hdf5(Hdf5Spec, Vec<FieldChain>),
    Lmdb(LmdbSpec),
}

impl Resolved {
    /// `"hdf5"` or `"lmdb"`, for `stoker status`.
    fn format(&self) -> &'static str {
        match self {
            Resolved::Hdf5(..) => "hdf5",
            Resolved::Lmdb(_) => "lmdb",
        }
    }
}

/// Files opened by handle for a dataset.
enum Files {
    Hdf5(Vec<fsaccess::Checked>),
    Lmdb(CheckedLmdb, Vec<(PathBuf, FileId)>),
}

impl Files {
    /// Each file (resolved path) with its identity.
    fn origins(&self) -> Vec<(PathBuf, FileId)> {
        match self {
            Files::Hdf5(files) => files.iter().map(|f| (f.canonical.clone(), f.id)).collect(),
            Files::Lmdb(_, ids) => ids.clone(),
        }
    }
}

impl Datasets {
    /// An empty registry for `settings`; closes idle datasets on a thread of its own.
    pub fn new(settings: Settings, caches: Arc<Caches>) -> Datasets {
        let open_files = OpenFiles::new(max_open_files(settings.limits.max_open_files));
        let open: Arc<Registry> = Arc::default();
        let idle = Duration::from_secs_f64(settings.limits.idle_close_s.max(0.0));
        let weak = Arc::downgrade(&open);
        let spawned =
            std::thread::Builder::new().name("stoker-idle-close".into()).spawn(move || close_idle(weak, idle));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the idle-close thread: idle datasets stay open");
        }
        // The crate's own unit tests are not the `stoker` binary: they run
        // libhdf5 in their process (the end-to-end tests run real helpers).
        let helpers = if cfg!(test) { Helpers::in_process() } else { Helpers::new(settings.helper_limits) };
        Datasets { settings: RwLock::new(Arc::new(settings)), caches, open_files, open, helpers }
    }

    /// HDF5 helper processes running, and helper deaths so far.
    pub fn helper_counts(&self) -> (usize, u64) {
        self.helpers.counts()
    }

    /// Uses `settings` for datasets opened from now on (limits such as
    /// `max_open_files` and `idle_close_s` keep their values from the start).
    pub fn reload(&self, settings: Settings) {
        *self.settings.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(settings);
    }

    fn settings(&self) -> Arc<Settings> {
        self.settings.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// HDF5 files open now, across all datasets.
    pub fn open_files(&self) -> usize {
        self.open_files.count()
    }

    /// Opens (or reuses) the dataset for the client `peer`. Blocking: call it
    /// off the async threads. Ad-hoc files are opened with the client's
    /// rights; files changed since a cached source opened them are opened anew.
    pub fn open(&self, dataset: &DatasetRef, peer: &Peer) -> Result<Opened, WireError> {
        let (label, mut resolved, rescan) = self.resolve(dataset)?;
        let settings = self.settings();
        match &mut resolved {
            Resolved::Lmdb(spec) => spec.max_value_bytes = settings.limits.max_sample_bytes,
            Resolved::Hdf5(spec, _) => {
                spec.max_chunk_bytes = settings.limits.max_sample_bytes;
                // A client's files are read by that client's helper, and what it
                // says is cached for that client only.
                spec.domain = (!matches!(dataset, DatasetRef::Named(_))).then_some(peer.uid);
            }
        }
        let key = resolved.clone();
        let rights = match dataset {
            DatasetRef::Named(_) => Rights::Daemon,
            _ => Rights::Client(*peer),
        };
        let roots = (!matches!(dataset, DatasetRef::Named(_))).then_some(settings.allowed_roots.as_slice());
        let (files, stats_origins) = fsaccess::with_rights(rights, || {
            let files = open_files(&resolved, roots)?;
            let stats = load_stats(resolved.steps_mut(), roots)?;
            Ok::<_, SourceError>((files, stats))
        })
        .map_err(|e| WireError::from(SourceError::from(e)))?
        .map_err(WireError::from)?;
        let mut origins = files.origins();
        origins.extend(stats_origins);
        let ids: Vec<FileId> = origins.iter().map(|(_, id)| *id).collect();
        let rescan = rescan == Rescan::Epoch;
        let fingerprint = stoker_data::cache::fingerprint(&(&key, &ids));
        self.caches.futures.label(fingerprint, &label);
        // What a cache snapshot checks again before it restores this dataset's entries.
        self.caches.futures.origins(fingerprint, origins);
        let cache = CacheCtx { caches: self.caches.clone(), dataset: fingerprint };
        // A poisoned source (its file found truncated or corrupt) is opened afresh.
        if let Some(entry) = self.lock().get_mut(&key)
            && entry.ids == ids
            && entry.opened.source.poisoned().is_none()
        {
            entry.used = Instant::now();
            return Ok(Opened {
                label,
                source: entry.opened.source.clone(),
                rescan,
                fingerprint,
                generation: entry.generation,
            });
        }
        // HDF5: the files as matched, with their identities (and those of
        // statistics files); LMDB: the key list (set below, once listed).
        let mut list = match &files {
            Files::Hdf5(checked) => files_fingerprint(checked.iter().map(|f| f.path.as_path()), &ids),
            Files::Lmdb(..) => Fnv1a::default(),
        };
        let file_count = match &files {
            Files::Hdf5(checked) => checked.len() as u64,
            Files::Lmdb(checked, _) => checked.envs.len() as u64,
        };
        let source: Arc<dyn Source> = match (resolved, files) {
            (Resolved::Hdf5(spec, chains), Files::Hdf5(files)) => {
                let opener = self.helpers.opener(spec.domain.is_some().then_some(peer));
                let source: Arc<dyn Source> = Arc::new(
                    Hdf5Source::open(&spec, files, cache, self.open_files.clone(), opener, rights)
                        .map_err(WireError::from)?,
                );
                if chains.is_empty() {
                    source
                } else {
                    Arc::new(
                        Transformed::new(source, &chains, &spec.files, settings.limits.max_sample_bytes)
                            .map_err(WireError::from)?,
                    )
                }
            }
            (Resolved::Lmdb(spec), Files::Lmdb(checked, _)) => {
                let source = LmdbSource::open_checked(&spec, &checked).map_err(WireError::from)?.with_cache(cache);
                list = keys_fingerprint(source.keys());
                Arc::new(source)
            }
            // `open_files` answers in the format it was asked; a mismatch is a
            // bug, and costs this open, never the daemon.
            _ => {
                return Err(WireError::new(
                    ErrorKind::Internal,
                    format!("dataset {label}: files opened for another format than the dataset's; please report this"),
                ));
            }
        };
        let generation = Generation { fingerprint: list.finish(), files: file_count, samples: source.len() };
        tracing::info!(dataset = %label, samples = source.len(), files = file_count, generation = %format_args!("{:016x}", generation.fingerprint), "opened dataset");
        let opened = Opened { label, source, fingerprint, rescan, generation };
        let mut open = self.lock();
        // A changed file replaces the old entry: streams reading the old one
        // keep it until they close (and fail if they read the changed bytes).
        open.insert(key, Entry { opened: opened.clone(), ids, generation, used: Instant::now(), idle_since: None });
        evict_idle(&mut open);
        Ok(opened)
    }

    /// Datasets named in the config, for `stoker datasets`, with skip counts of those opened.
    pub fn named(&self) -> Vec<DatasetInfo> {
        let open = self.lock();
        let skipped = |name: &str| {
            open.values().filter(|e| e.opened.label == name).map(|e| e.opened.source.skipped()).max().unwrap_or(0)
        };
        self.settings()
            .datasets
            .iter()
            .map(|(name, ds)| match ds {
                DatasetConfig::Hdf5(ds) => DatasetInfo {
                    name: name.clone(),
                    format: "hdf5".into(),
                    files: ds.files.clone(),
                    fields: ds.fields.0.clone(),
                    window: ds.window.map(|w| (w.size(), w.stride)),
                    per_item: ds.per_item.clone(),
                    skipped: skipped(name),
                },
                DatasetConfig::Lmdb(ds) => DatasetInfo {
                    name: name.clone(),
                    format: "lmdb".into(),
                    files: ds.fields.iter().map(|f| f.env.as_str()).collect::<Vec<_>>().join(" "),
                    fields: ds.fields.iter().map(|f| (f.name.clone(), f.codec.clone())).collect(),
                    window: None,
                    per_item: Vec::new(),
                    skipped: skipped(name),
                },
            })
            .collect()
    }

    /// Every open source with its label (idle ones included), for metrics.
    pub fn sources(&self) -> Vec<(String, Arc<dyn Source>)> {
        self.lock().values().map(|e| (e.opened.label.clone(), e.opened.source.clone())).collect()
    }

    /// `(label, samples skipped)` of every open dataset that skipped any.
    pub fn skips(&self) -> Vec<(String, u64)> {
        self.lock()
            .values()
            .map(|e| (e.opened.label.clone(), e.opened.source.skipped()))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Every open dataset with its files, their size on disk and its source
    /// (to match streams by); `streams` and `ring_bytes` are left for the caller.
    pub fn status(&self) -> Vec<(DatasetStatus, Arc<dyn Source>)> {
        let open = self.lock();
        let mut list: Vec<_> = open
            .iter()
            .map(|(key, e)| {
                let status = DatasetStatus {
                    dataset: e.opened.label.clone(),
                    format: key.format().to_string(),
                    files: e.ids.len() as u64,
                    bytes: e.ids.iter().map(|id| id.size).sum(),
                    samples: e.opened.source.len(),
                    streams: 0,
                    ring_bytes: 0,
                    skipped: e.opened.source.skipped(),
                };
                (status, e.opened.source.clone())
            })
            .collect();
        list.sort_by(|a, b| a.0.dataset.cmp(&b.0.dataset));
        list
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Resolved, Entry>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn resolve(&self, dataset: &DatasetRef) -> Result<(String, Resolved, Rescan), WireError> {
        let settings = self.settings();
        match dataset {
            DatasetRef::Named(name) => match settings.datasets.get(name) {
                Some(DatasetConfig::Hdf5(ds)) => {
                    let chains = field_chains(&ds.field_transforms())?;
                    Ok((
                        name.clone(),
                        Resolved::Hdf5(Hdf5Spec::from_dataset(ds, settings.hdf5_fast_path), chains),
                        ds.rescan,
                    ))
                }
                Some(DatasetConfig::Lmdb(ds)) => Ok((name.clone(), Resolved::Lmdb(lmdb_spec(ds, None)?), ds.rescan)),
                None => {
                    let known: Vec<_> = settings.datasets.keys().collect();
                    Err(WireError::new(
                        ErrorKind::NotFound,
                        format!(
                            "no dataset named {name:?} in the daemon's config (known: {known:?}); see `stoker datasets`"
                        ),
                    ))
                }
            },
            DatasetRef::Hdf5(ds) => {
                self.check_ad_hoc()?;
                if let Some(p) = ds.problems().into_iter().next() {
                    return Err(WireError::new(
                        ErrorKind::Dataset,
                        format!("ad-hoc dataset {:?}: {}", ds.files, p.message),
                    ));
                }
                let chains = field_chains(&ds.field_transforms())?;
                Ok((
                    ds.files.clone(),
                    Resolved::Hdf5(Hdf5Spec::from_dataset(ds, settings.hdf5_fast_path), chains),
                    ds.rescan,
                ))
            }
            DatasetRef::Lmdb(ds) => {
                self.check_ad_hoc()?;
                let label = ds.fields.first().map_or_else(String::new, |f| f.env.clone());
                Ok((label, Resolved::Lmdb(lmdb_spec(ds, Some(settings.allowed_roots.clone()))?), ds.rescan))
            }
        }
    }

    fn check_ad_hoc(&self) -> Result<(), WireError> {
        if self.settings().allowed_roots.is_empty() {
            return Err(WireError::new(
                ErrorKind::PermissionDenied,
                "this daemon serves only the datasets named in its config ([server] allowed_roots is empty); use a \
                 name from `stoker datasets`, or ask the admin to set allowed_roots"
                    .to_string(),
            ));
        }
        Ok(())
    }
}

/// Closes the least recently used idle sources beyond [`KEEP_IDLE`]. A source
/// is idle when only this registry holds it (no stream, no fill in flight).
fn evict_idle(open: &mut HashMap<Resolved, Entry>) {
    let mut idle: Vec<(Instant, Resolved)> = open
        .iter()
        .filter(|(_, e)| Arc::strong_count(&e.opened.source) == 1)
        .map(|(k, e)| (e.used, k.clone()))
        .collect();
    if idle.len() <= KEEP_IDLE {
        return;
    }
    idle.sort_by_key(|(used, _)| *used);
    for (_, key) in &idle[..idle.len() - KEEP_IDLE] {
        if let Some(e) = open.remove(key) {
            tracing::info!(dataset = %e.opened.label, "closed idle dataset");
        }
    }
}

/// Closes sources no stream has used for `idle`, until the registry is gone.
fn close_idle(open: Weak<Registry>, idle: Duration) {
    let tick = (idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
    loop {
        std::thread::sleep(tick);
        let Some(open) = open.upgrade() else { return };
        let mut open = open.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        open.retain(|_, e| {
            if Arc::strong_count(&e.opened.source) > 1 {
                e.idle_since = None;
                return true;
            }
            let since = *e.idle_since.get_or_insert(now);
            let keep = now.duration_since(since) < idle;
            if !keep {
                tracing::info!(dataset = %e.opened.label, "closed idle dataset (no stream uses it)");
            }
            keep
        });
    }
}

/// The bound on open HDF5 files: the configured one, but no more than half
/// the descriptors this process may open (each file takes two), less some
/// for sockets, rings and LMDB.
fn max_open_files(configured: usize) -> usize {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile).current.unwrap_or(u64::MAX);
    let by_fds = usize::try_from(soft.saturating_sub(128) / 2).unwrap_or(usize::MAX).max(16);
    if by_fds < configured {
        tracing::info!(
            max_open_files = by_fds,
            configured,
            fd_limit = soft,
            "fewer HDF5 files may be open at once than configured: the descriptor limit (ulimit -n) is low"
        );
    }
    configured.min(by_fds).max(1)
}

/// Opens every file of the dataset by handle (run with the requester's rights).
fn open_files(resolved: &Resolved, roots: Option<&[PathBuf]>) -> Result<Files, SourceError> {
    match resolved {
        Resolved::Hdf5(spec, _) => hdf5::check_files(spec, roots).map(Files::Hdf5),
        Resolved::Lmdb(spec) => {
            let mut checked = CheckedLmdb::default();
            let mut ids = Vec::new();
            for field in &spec.fields {
                if checked.envs.iter().any(|(p, _)| *p == field.env) {
                    continue;
                }
                let env = fsaccess::open(&field.env, roots, Want::FileOrDir)?;
                let data = if env.is_dir { fsaccess::open_in(&env, "data.mdb")? } else { env };
                ids.push((data.canonical.clone(), data.id));
                checked.envs.push((field.env.clone(), data.id));
                checked.data.push((field.env.clone(), data.file));
            }
            if let Some(path) = &spec.key_file {
                let key_file = fsaccess::open(path, roots, Want::File)?;
                ids.push((key_file.canonical.clone(), key_file.id));
                checked.key_file = Some(key_file.file);
            }
            Ok(Files::Lmdb(checked, ids))
        }
    }
}

/// An HDF5 generation's fingerprint: the files as matched (`paths`, in
/// order) and the identities of the files read (`ids`: the data files, then
/// statistics files). Loader state records it, so its value must not change
/// between versions for the same files (pinned by a golden test).
fn files_fingerprint<'a>(paths: impl Iterator<Item = &'a Path>, ids: &[FileId]) -> Fnv1a {
    let mut list = Fnv1a::default();
    for path in paths {
        list.write(path.as_os_str().as_encoded_bytes());
    }
    for id in ids {
        for word in [id.dev, id.ino, id.size] {
            list.write(&word.to_le_bytes());
        }
        list.write(&id.mtime_ns.to_le_bytes());
    }
    list
}

/// An LMDB generation's fingerprint: the key list, each key length-prefixed.
fn keys_fingerprint<'a>(keys: impl Iterator<Item = &'a [u8]>) -> Fnv1a {
    let mut list = Fnv1a::default();
    for key in keys {
        list.write(&(key.len() as u64).to_le_bytes());
        list.write(key);
    }
    list
}

fn duplicate<'a>(names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let mut seen = std::collections::HashSet::new();
    names.into_iter().find(|n| !seen.insert(*n))
}

/// Turns the wire/config description of an LMDB dataset into the source's spec.
pub fn lmdb_spec(ds: &LmdbDataset, allowed_roots: Option<Vec<PathBuf>>) -> Result<LmdbSpec, WireError> {
    let bad = |message: String| WireError::new(ErrorKind::Dataset, message);
    if ds.fields.is_empty() {
        return Err(bad("an LMDB dataset needs at least one field".into()));
    }
    if let Some(dup) = duplicate(ds.fields.iter().map(|f| f.name.as_str())) {
        return Err(bad(format!("field {dup:?} is given twice")));
    }
    let mut fields = Vec::with_capacity(ds.fields.len());
    for f in &ds.fields {
        let field_err = |message: String| bad(format!("field {:?} ({}): {message}", f.name, f.env));
        if !Path::new(&f.env).is_absolute() {
            return Err(field_err("the environment path must be absolute".into()));
        }
        let image = Codec::parse(&f.codec, None).ok().filter(Codec::is_image);
        let codec = match image {
            // An image field's dtype (and mode) is what its pixels are converted to.
            Some(image) if f.shape.is_none() => Convert::parse(f.mode.as_deref(), f.dtype.as_deref())
                .and_then(|convert| image.with_convert(convert))
                .map_err(|e| field_err(e.to_string()))?,
            _ => {
                if let Some(mode) = &f.mode {
                    return Err(field_err(format!(
                        "mode = {mode:?} only goes with png and jpeg values, not codec {:?}",
                        f.codec
                    )));
                }
                let raw = match (&f.dtype, &f.shape) {
                    (Some(dtype), Some(shape)) => {
                        Some(RawLayout::new(dtype, shape.clone()).map_err(|e| field_err(e.to_string()))?)
                    }
                    (None, None) => None,
                    _ => return Err(field_err("raw values need both dtype and shape".into())),
                };
                Codec::parse(&f.codec, raw).map_err(|e| field_err(e.to_string()))?
            }
        };
        let transforms = f.transforms.iter().map(|t| Step::from_def(t, &f.name)).collect::<Result<Vec<_>, _>>()?;
        fields.push(LmdbField {
            name: f.name.clone(),
            env: PathBuf::from(&f.env),
            codec,
            transforms,
            pair: f.pair.as_ref().map(|p| Pair { with: p.with.clone(), scale: p.scale }),
            max_sample_bytes: f.max_sample_bytes,
        });
    }
    let mut spec = LmdbSpec::new(fields);
    spec.filter = match (&ds.key_prefix, &ds.key_regex) {
        (Some(_), Some(_)) => return Err(bad("give key_prefix or key_regex, not both".into())),
        (Some(prefix), None) => KeyFilter::Prefix(prefix.clone()),
        (None, Some(regex)) => KeyFilter::Include(regex.clone()),
        (None, None) => KeyFilter::SkipMetadata,
    };
    spec.key_file = ds.key_file.as_ref().map(PathBuf::from);
    spec.on_error = match ds.on_error.as_deref() {
        None | Some("fail") => OnError::Fail,
        Some("skip") => OnError::Skip,
        Some(other) => return Err(bad(format!("on_error = {other:?}: use \"fail\" or \"skip\""))),
    };
    if let Some(probe) = ds.probe {
        spec.probe = probe.max(1) as usize;
    }
    spec.allowed_roots = allowed_roots;
    Ok(spec)
}

impl Resolved {
    /// Every transform step of the dataset, to fill in statistics read from files.
    fn steps_mut(&mut self) -> impl Iterator<Item = &mut Step> {
        let (hdf5, lmdb) = match self {
            Resolved::Hdf5(_, chains) => (Some(chains), None),
            Resolved::Lmdb(spec) => (None, Some(&mut spec.fields)),
        };
        let hdf5 = hdf5.into_iter().flatten().flat_map(|c| c.steps.iter_mut());
        let lmdb = lmdb.into_iter().flatten().flat_map(|f| f.transforms.iter_mut());
        hdf5.chain(lmdb)
    }
}

/// Reads the statistics files that `normalize` steps name (opened by handle,
/// beneath `roots` when given: run it with the requester's rights) and puts
/// their values in place of the steps; the files' identities.
pub fn load_stats<'a>(
    steps: impl Iterator<Item = &'a mut Step>,
    roots: Option<&[PathBuf]>,
) -> Result<Vec<(PathBuf, FileId)>, SourceError> {
    use std::io::Read;
    let mut ids = Vec::new();
    for step in steps {
        let Step::NormalizeFrom { stats, key, min_std } = step else { continue };
        let bad = |message: String| SourceError::Spec { pattern: stats.clone(), message };
        let opened = fsaccess::open(Path::new(stats.as_str()), roots, Want::File)?;
        if opened.id.size > stoker_decode::transform::stats::MAX_STATS_BYTES {
            return Err(bad(format!(
                "the statistics file has {} bytes, more than {}; is it the right file?",
                opened.id.size,
                stoker_decode::transform::stats::MAX_STATS_BYTES
            )));
        }
        let mut text = String::new();
        opened
            .file
            .take(stoker_decode::transform::stats::MAX_STATS_BYTES)
            .read_to_string(&mut text)
            .map_err(|e| bad(format!("cannot read the statistics file: {e}")))?;
        ids.push((opened.canonical.clone(), opened.id));
        *step = stoker_decode::transform::stats::normalize_step(&text, stats, key, *min_std)
            .map_err(|e| bad(e.to_string()))?;
    }
    Ok(ids)
}

#[cfg(test)]
mod tests;

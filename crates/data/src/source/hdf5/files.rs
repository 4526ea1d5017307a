//! The files of an HDF5 dataset: glob expansion under the client's rights,
//! checked opens by handle, the bounded set of open libhdf5 handles shared by
//! every reader, and the check that a file did not change under a stream.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};

use self::field::FieldReader;
use self::field::library::{FieldFacts, Hdf5Opener, LayoutFacts, ProbeError};
use super::glob::GlobError;
use crate::fsaccess::{self, ChangedError, FileId, Want};
use crate::source::{FieldSpec, SourceError};

use super::*;

/// One file of a dataset: what it is, and its handles while open.
#[derive(Debug)]
pub(super) struct Hdf5File {
    /// The path as matched (for messages).
    pub(super) path: PathBuf,
    /// Where it was opened (no symlinks), and beneath which allowed root.
    pub(super) canonical: PathBuf,
    pub(super) root: Option<PathBuf>,
    /// Its identity when the dataset was opened.
    pub(super) id: FileId,
    /// Samples per item (1 without a window).
    pub(super) windows: u64,
    /// Steps along axis 1 of its windowed fields (0 without a window).
    pub(super) steps: u64,
    /// `None` while closed to bound open files.
    pub(super) handle: RwLock<Option<Arc<OpenHdf5>>>,
    /// When it was last read (to within [`USE_GRAIN_US`]), in µs since [`EPOCH`].
    pub(super) used: AtomicU64,
    /// When its size and mtime were last checked, in µs since [`EPOCH`].
    pub(super) checked_us: AtomicU64,
    /// Set when a read of it crashed (or hung) its HDF5 helper: the error,
    /// given again for every later read without asking a helper (a crafted
    /// file must not crash helpers in a loop). A changed file is a new one.
    pub(super) crashed: std::sync::OnceLock<String>,
}

/// Reads of one file check it for changes at most this often (an `fstat`
/// per sample would cost as much as reading a small sample).
pub(super) const CHANGE_CHECK_US: u64 = 1_000;

/// Reads record that a file was used at most this often (no shared write per sample).
pub(super) const USE_GRAIN_US: u64 = 1_000;

/// The origin of `checked_us` and `used`.
pub(super) static EPOCH: std::sync::LazyLock<std::time::Instant> = std::sync::LazyLock::new(std::time::Instant::now);

pub(super) fn now_us() -> u64 {
    u64::try_from(EPOCH.elapsed().as_micros()).unwrap_or(u64::MAX).max(1)
}

/// The handles of an open file (its readers hold libhdf5's view of it).
#[derive(Debug)]
pub(super) struct OpenHdf5 {
    pub(super) raw: File,
    pub(super) fields: Vec<FieldReader>,
}

impl Hdf5File {
    pub(super) fn close(&self) {
        self.handle.write().unwrap_or_else(PoisonError::into_inner).take();
    }

    pub(super) fn touch(&self) {
        let now = now_us();
        if now.saturating_sub(self.used.load(Ordering::Relaxed)) >= USE_GRAIN_US {
            self.used.store(now, Ordering::Relaxed);
        }
    }
}

/// Bounds the HDF5 files open at once across every dataset of the daemon
/// (each holds two descriptors and libhdf5's caches): opening one more
/// closes the least recently read.
#[derive(Debug)]
pub struct OpenFiles {
    pub(super) max: usize,
    pub(super) open: Mutex<Vec<Weak<Hdf5File>>>,
}

impl OpenFiles {
    /// At most `max` files open (at least 1).
    pub fn new(max: usize) -> Arc<OpenFiles> {
        Arc::new(OpenFiles { max: max.max(1), open: Mutex::new(Vec::new()) })
    }

    /// Files open now.
    pub fn count(&self) -> usize {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.iter().filter(|w| w.strong_count() > 0).count()
    }

    /// Closes the open handles of files that have `id`'s device and inode but
    /// not its size or mtime: they were changed since they were opened.
    pub(super) fn close_changed(&self, id: &FileId) {
        let stale: Vec<Arc<Hdf5File>> = {
            let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
            let is_stale = |f: &Hdf5File| (f.id.dev, f.id.ino) == (id.dev, id.ino) && f.id != *id;
            let stale = open.iter().filter_map(Weak::upgrade).filter(|f| is_stale(f)).collect();
            open.retain(|w| w.upgrade().is_some_and(|f| !is_stale(&f)));
            stale
        };
        for file in stale {
            file.close();
        }
    }

    /// Records that `file` was opened and closes the least recently read
    /// beyond the bound. No file's handle lock is held while this runs.
    pub(super) fn opened(&self, file: &Arc<Hdf5File>) {
        file.used.store(now_us(), Ordering::Relaxed);
        let me = Arc::downgrade(file);
        let victims = {
            let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
            open.retain(|w| w.strong_count() > 0);
            if !open.iter().any(|w| w.ptr_eq(&me)) {
                open.push(me.clone());
            }
            let mut victims = Vec::new();
            while open.len() > self.max {
                let oldest = open
                    .iter()
                    .enumerate()
                    .filter(|(_, w)| !w.ptr_eq(&me))
                    .filter_map(|(i, w)| w.upgrade().map(|f| (f.used.load(Ordering::Relaxed), i)))
                    .min();
                let Some((_, i)) = oldest else { break };
                victims.extend(open.swap_remove(i).upgrade());
            }
            victims
        };
        for victim in victims {
            // Readers holding the handle keep it until they finish.
            victim.close();
        }
    }
}

/// Lists the files of `spec`'s glob (sorted) and checks each by opening it by
/// handle ([`fsaccess::open`]), beneath `allowed_roots` when given, then
/// closes it again (a dataset may have more files than descriptors). Runs
/// with the rights of whoever asked for the dataset ([`fsaccess::with_rights`]).
pub fn check_files(spec: &Hdf5Spec, allowed_roots: Option<&[PathBuf]>) -> Result<Vec<fsaccess::Checked>, SourceError> {
    let paths = expand(&spec.files, allowed_roots)?;
    paths.iter().map(|p| Ok(fsaccess::open(p, allowed_roots, Want::File)?.close())).collect()
}

/// The files matching `pattern`, sorted. Glob sees only what the caller may
/// list: when nothing matches because a directory is closed to the caller, or
/// the pattern names one file, that file's open reports why.
/// A file rewritten or appended to under a stream would deliver rows that
/// are neither the old nor the new contents: fail instead, naming it.
pub(super) fn check_unchanged(file: &Hdf5File, handle: &OpenHdf5) -> Result<(), SourceError> {
    let now_us = now_us();
    let last = file.checked_us.load(Ordering::Relaxed);
    if last != 0 && now_us.saturating_sub(last) < CHANGE_CHECK_US {
        return Ok(());
    }
    let changed = |problem| SourceError::Changed { path: file.path.clone(), problem };
    let now = FileId::of(&handle.raw).map_err(|e| changed(ChangedError::Unchecked(e)))?;
    if let Some(change) = file.id.change(&now) {
        return Err(changed(ChangedError::Changed(change)));
    }
    file.checked_us.store(now_us, Ordering::Relaxed);
    Ok(())
}

pub(super) fn expand(pattern: &str, allowed_roots: Option<&[PathBuf]>) -> Result<Vec<PathBuf>, SourceError> {
    let client = allowed_roots.is_some();
    let bad = |e: GlobError| match e {
        GlobError::Bound { .. } => SourceError::GlobTooBroad { pattern: pattern.to_string(), message: e.to_string() },
        _ => SourceError::BadGlob { pattern: pattern.to_string(), message: e.to_string() },
    };
    let (literal, rest) = super::glob::split(pattern).map_err(bad)?;
    // The walk starts beneath an allowed root, checked (resolved: no `..` or
    // symlink leads out) before anything is listed.
    let mut walk = true;
    if let Some(roots) = allowed_roots {
        match literal.canonicalize() {
            Ok(canonical) if roots.iter().any(|r| canonical.starts_with(r)) => {}
            Ok(_) => return Err(fsaccess::AccessError::NotAllowed { path: literal, roots: roots.to_vec() }.into()),
            // Missing, or closed to the client: nothing to list; said below.
            Err(_) => walk = false,
        }
    }
    let mut paths = if walk { super::glob::matches(&literal, &rest).map_err(bad)? } else { Vec::new() };
    // Directories are not data; anything else that matches is opened and
    // refused with a clear error if it is not a regular file (a FIFO).
    paths.retain(|p| !p.is_dir());
    if paths.is_empty() {
        if rest.is_empty() {
            return Ok(vec![literal]);
        }
        if let Err(e) = std::fs::read_dir(&literal)
            && e.kind() == std::io::ErrorKind::PermissionDenied
        {
            return Err(fsaccess::AccessError::io(&literal, e, client).into());
        }
        return Err(SourceError::NoFiles { pattern: pattern.to_string() });
    }
    Ok(paths)
}

/// Opens `raw` (the checked file at `path`, of identity `id`) with libhdf5
/// through `opener` and builds its readers from the facts it reports: the
/// handles, the field specs, the items, and the steps along axis 1 of the
/// windowed fields (0 without a window). A window longer than those steps is
/// refused, naming the file and field. The facts come from a helper process:
/// every number is checked here ([`FieldReader::from_facts`], [`check_sizes`])
/// before a byte is read.
pub(super) fn open_file(
    path: &Path,
    id: &FileId,
    raw: File,
    spec: &Hdf5Spec,
    roles: &[Role],
    geometry: Option<&Geometry>,
    opener: &dyn Hdf5Opener,
) -> Result<(OpenHdf5, Vec<FieldSpec>, u64, u64), SourceError> {
    let h5paths: Vec<String> = spec.fields.iter().map(|(_, h5path)| h5path.clone()).collect();
    let named = |field: usize| {
        let (name, h5path) = spec.fields.get(field).cloned().unwrap_or_default();
        (name, h5path)
    };
    let (facts, lib) = opener.open(&raw, &h5paths, spec.fast_path).map_err(|e| match e {
        ProbeError::Open(message) | ProbeError::Helper(message) => SourceError::Open { path: path.to_owned(), message },
        ProbeError::Missing { field } => {
            let (field, h5path) = named(field);
            SourceError::MissingField { path: path.to_owned(), field, h5path }
        }
        ProbeError::Dtype { field, found } => {
            let (field, h5path) = named(field);
            SourceError::Dtype { path: path.to_owned(), field, h5path, found }
        }
        ProbeError::Field { field, message } => {
            let (field, h5path) = named(field);
            SourceError::Inconsistent { path: path.to_owned(), field, h5path, message }
        }
    })?;
    if facts.len() != spec.fields.len() {
        return Err(SourceError::Open {
            path: path.to_owned(),
            message: format!(
                "the HDF5 helper described {} fields, not the {} asked for",
                facts.len(),
                spec.fields.len()
            ),
        });
    }
    let mut specs = Vec::with_capacity(spec.fields.len());
    let mut readers = Vec::with_capacity(spec.fields.len());
    // (length, field name) of the first field along axis 0, and along axis 1 for windowed fields.
    let mut lengths = Lengths::default();
    for (index, (((name, h5path), &role), facts)) in spec.fields.iter().zip(roles).zip(&facts).enumerate() {
        let at = FieldAt { path, name, h5path };
        let sample_shape = sample_shape(&at, role, &facts.shape, geometry, spec.sampling.n_steps_input, &mut lengths)?;
        check_sizes(&at, facts, &sample_shape, spec.max_chunk_bytes)?;
        // Chunks are keyed by what they are: this file's identity, the field's
        // HDF5 path, how it is stored and decoded, and whose helper said so
        // (a user's helper speaks only for that user's datasets).
        let cache_id = crate::cache::space_id(id, h5path, &(spec.domain, facts.dtype, &facts.chunk, &facts.layout));
        let reader =
            FieldReader::from_facts(facts, index, lib.clone(), cache_id).map_err(|e| at.error(e.to_string()))?;
        specs.push(FieldSpec {
            name: name.clone(),
            origin: h5path.clone(),
            dtype: facts.dtype,
            shape: sample_shape,
            max_sample_bytes: None,
        });
        readers.push(reader);
    }
    let items = lengths.items.map_or(0, |(len, _)| len);
    let steps = match lengths.steps {
        Some((time, ..)) => time,
        None => 0,
    };
    Ok((OpenHdf5 { raw, fields: readers }, specs, items, steps))
}

/// A field of a file, for its errors.
struct FieldAt<'a> {
    path: &'a Path,
    name: &'a str,
    h5path: &'a str,
}

impl FieldAt<'_> {
    /// The field disagrees with the others, or cannot be served as it is.
    fn error(&self, message: String) -> SourceError {
        SourceError::Inconsistent {
            path: self.path.to_owned(),
            field: self.name.to_string(),
            h5path: self.h5path.to_string(),
            message,
        }
    }
}

/// The lengths the fields of a file must share, as the first field that has
/// each gave it: `(length, field name)`.
#[derive(Default)]
struct Lengths<'a> {
    /// Along the item axis (axis 0).
    items: Option<(u64, &'a str)>,
    /// Along the time axis of the windowed fields.
    steps: Option<(u64, &'a str)>,
}

/// The shape of one sample of the field `at` of dataset shape `shape` in
/// `role`: checks its item axis and time axis against the other fields'
/// (`lengths`, which the first field to have each sets) and that a window
/// (`geometry`) fits in its steps.
fn sample_shape<'a>(
    at: &FieldAt<'a>,
    role: Role,
    shape: &[u64],
    geometry: Option<&Geometry>,
    n_steps_input: Option<u64>,
    lengths: &mut Lengths<'a>,
) -> Result<Vec<u64>, SourceError> {
    let name = at.name;
    let (len, rest) = match shape.split_first() {
        _ if !role.has_item_axis() => (None, shape),
        Some((&len, rest)) => (Some(len), rest),
        None => {
            return Err(at.error(
                "is a scalar; a field needs a first axis to index samples by (list it in constant to deliver \
                 it whole with every sample)"
                    .into(),
            ));
        }
    };
    match (lengths.items, len) {
        (_, None) => {}
        (None, Some(len)) => lengths.items = Some((len, name)),
        (Some((first_len, first_name)), Some(len)) if first_len != len => {
            return Err(at.error(format!(
                "has {len} items along the first axis but field {first_name:?} has {first_len}; \
                 all fields of a dataset must have the same length in each file (list fields without \
                 the item axis in constant)"
            )));
        }
        (Some(_), Some(_)) => {}
    }
    Ok(match role {
        Role::Constant => shape.to_vec(),
        Role::Item => rest.to_vec(),
        Role::Steps { count, .. } => {
            // `rest` follows the item axis; a time_only field's is its whole shape.
            let axis = if rest.len() == shape.len() { 0 } else { 1 };
            let Some((&time, trailing)) = rest.split_first() else {
                return Err(at.error(format!(
                    "has shape {shape:?}; a windowed field needs a time axis (axis 1); list it in per_item \
                     to deliver it whole per item, or in constant if it has no item axis either"
                )));
            };
            if let Some(g) = geometry.filter(|g| time < g.span) {
                return Err(at.error(window_too_long(g, time, n_steps_input)));
            }
            match lengths.steps {
                None => lengths.steps = Some((time, name)),
                Some((first_time, first_name)) if first_time != time => {
                    return Err(at.error(format!(
                        "has {time} steps along axis {axis} (its time axis) but windowed field {first_name:?} has \
                         {first_time}"
                    )));
                }
                Some(_) => {}
            }
            std::iter::once(count).chain(trailing.iter().copied()).collect()
        }
    })
}

/// Refuses a field whose offsets or sample size (of its dtype and dataset
/// shape, sample shape `sample_shape`) do not fit in 64 bits (and in
/// memory), or whose compressed chunks decode to more than `max_chunk_bytes`.
fn check_sizes(
    at: &FieldAt<'_>,
    facts: &FieldFacts,
    sample_shape: &[u64],
    max_chunk_bytes: u64,
) -> Result<(), SourceError> {
    let FieldAt { path, name, h5path } = at;
    let (dtype, shape) = (facts.dtype, &facts.shape);
    // Offsets into the dataset and the sample's size must fit in 64 bits
    // (and in memory) before any of them is computed.
    let sample_bytes = sample_shape.iter().try_fold(dtype.size() as u64, |acc: u64, &d| acc.checked_mul(d));
    let total_bytes = shape.iter().try_fold(dtype.size() as u64, |acc: u64, &d| acc.checked_mul(d));
    if sample_bytes.is_none_or(|b| b > isize::MAX as u64) || total_bytes.is_none() {
        let what = if sample_bytes.is_none_or(|b| b > isize::MAX as u64) {
            format!("one sample of {dtype} {sample_shape:?}")
        } else {
            format!("the whole dataset ({dtype} {shape:?})")
        };
        return Err(SourceError::Limit(format!(
            "{}: field {name:?} ({h5path:?}) has shape {shape:?}: {what} takes more than 2^63 bytes; stoker cannot \
             serve it (check the file; [limits] max_sample_bytes bounds what a sample may take)",
            path.display()
        )));
    }
    // Any read of a filtered chunk decodes it whole (here or in the helper):
    // its decoded size, from the chunk shape, is bounded before any read.
    let decoded = match &facts.layout {
        LayoutFacts::Chunked { chunk, filters, .. } if !filters.is_empty() => {
            Some(chunk.iter().try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d)).unwrap_or(u64::MAX))
        }
        _ => None,
    };
    if let Some(bytes) = decoded.max(facts.decoded_chunk_bytes)
        && bytes > max_chunk_bytes
    {
        let chunk = facts.chunk.clone().unwrap_or_default();
        return Err(SourceError::Limit(format!(
            "{}: field {name:?} ({h5path:?}) is stored in compressed chunks of {chunk:?} {dtype}, {bytes} bytes each \
             decoded, more than [limits] max_sample_bytes = {max_chunk_bytes} bytes; every read decodes a whole \
             chunk: rechunk the dataset to smaller chunks (e.g. h5repack -l {h5path}:CHUNK=...), or ask the \
             daemon's admin to raise the limit",
            path.display()
        )));
    }
    Ok(())
}

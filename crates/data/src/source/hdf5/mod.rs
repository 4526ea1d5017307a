//! HDF5 source: a sorted glob of files, each field an HDF5 dataset path.
//!
//! Without a window, sample `i` is row `i` along the first axis of the
//! concatenated files. With a window (`size`, `stride`) along axis 1, every
//! item (row) of a file holds `(T - span) / stride + 1` samples, where a
//! window spans `span = (size - 1)·min_dt_stride + 1` steps, and sample
//! `(item, w)` delivers `field[item, t0 : t0 + (size-1)·dt + 1 : dt]` with
//! `t0 = w·stride` for windowed fields (its first `n_steps_input` steps for
//! `input` fields, the rest for `output` fields) and `field[item]` for
//! per-item fields: The Well's `[trajectory, time, x, y, …]` layout and its
//! `WellDataset` sampling (`dt` drawn per sample when `max_dt_stride` is
//! larger). `constant` fields have no item axis: every sample of a file gets
//! the whole dataset. `Geometry` holds that index math, checked at open.
//!
//! Files arrive opened by handle ([`crate::fsaccess`]); libhdf5 opens the
//! same inode through `/proc/self/fd/N`. Metadata comes from libhdf5 at open;
//! data is read by `field::FieldReader` (pread and Rust decoders where it
//! can, libhdf5 where it must). At most [`OpenFiles`]' bound of files stay
//! open across all datasets: the least recently read are closed and opened
//! again on their next read, after checking they are still the same file.
//! A file that changes while served fails its reads with an error naming it.

#[allow(unsafe_code)] // calls libhdf5 (H5D/H5T/H5P) directly where the `hdf5` crate has no safe API
pub(crate) mod field;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};

use hdf5::types::{FloatSize, IntSize, TypeDescriptor};
use stoker_proto::{DType, Hdf5Dataset, Hdf5Sampling};

use self::field::FieldReader;
use super::{FieldOut, FieldSpec, SampleRef, Source, SourceError};
use crate::cache::CacheCtx;
use crate::fsaccess::{self, FileId, Want};
use field::ChunkUse;

/// A window along axis 1: samples are `size` consecutive steps, `stride` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Window {
    /// Steps per sample.
    pub size: u64,
    /// Steps between the starts of consecutive samples.
    pub stride: u64,
}

/// What to open.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Hdf5Spec {
    /// Absolute glob; files are taken in sorted order.
    pub files: String,
    /// `(field name, HDF5 path)` in delivery order.
    pub fields: Vec<(String, String)>,
    /// Optional window along axis 1.
    pub window: Option<Window>,
    /// Fields delivered whole per item (`field[item]`) when windowed.
    pub per_item: Vec<String>,
    /// Read with pread and the Rust decoders where possible; `false` sends
    /// every read through libhdf5 (for comparison, or to rule the fast path out).
    pub fast_path: bool,
    /// Split windows, step spacing, constant fields (The Well's sampling).
    pub sampling: Hdf5Sampling,
    /// The most bytes one decoded chunk of a filtered field may take (`[limits]
    /// max_sample_bytes`): any read of such a field decodes its chunk whole,
    /// so a small file could otherwise make every worker allocate 4 GiB.
    pub max_chunk_bytes: u64,
}

impl Hdf5Spec {
    /// The source spec of a dataset description (checked by
    /// [`Hdf5Dataset::problems`]); `max_chunk_bytes` unbounded until the
    /// caller sets its limit.
    pub fn from_dataset(ds: &Hdf5Dataset, fast_path: bool) -> Hdf5Spec {
        Hdf5Spec {
            files: ds.files.clone(),
            fields: ds.fields.0.clone(),
            window: ds.window.map(|w| Window { size: w.size(), stride: w.stride }),
            per_item: ds.per_item.clone(),
            fast_path,
            sampling: ds.sampling(),
            max_chunk_bytes: u64::MAX,
        }
    }
}

/// What a field delivers for one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// `field[item]`: every field without a window, `per_item` ones with one.
    Item,
    /// Steps `from .. from + count` of the sample's window (all of it, or
    /// its input or output part): `field[item, t0 + k·dt]` for each, or
    /// `field[t0 + k·dt]` for a `time_only` field (no item axis).
    Steps { from: u64, count: u64, item_axis: bool },
    /// The whole dataset, the same for every sample of the file.
    Constant,
}

impl Role {
    /// Whether the field's axis 0 is the item axis samples are indexed by.
    fn has_item_axis(self) -> bool {
        !matches!(self, Role::Constant | Role::Steps { item_axis: false, .. })
    }
}

/// A window's index math, checked at open against the values a user gave
/// (any `u64`): nothing here can overflow once [`Geometry::new`] accepted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// Steps per window.
    size: u64,
    /// Steps between the starts of consecutive windows.
    stride: u64,
    /// Spacing of the steps inside a window, `dt_min..=dt_max`.
    dt_min: u64,
    dt_max: u64,
    /// Steps one window spans at `dt_min`: `(size - 1)·dt_min + 1`.
    span: u64,
}

impl Geometry {
    /// Checks a window; the message names the value that is wrong.
    pub(crate) fn new(window: Window, dt_min: u64, dt_max: u64) -> Result<Geometry, SourceError> {
        let Window { size, stride } = window;
        if size == 0 || stride == 0 {
            return Err(SourceError::Spec {
                pattern: String::new(),
                message: format!("window size {size} and stride {stride} must both be at least 1"),
            });
        }
        if dt_min == 0 || dt_max < dt_min {
            return Err(SourceError::Spec {
                pattern: String::new(),
                message: format!(
                    "min_dt_stride {dt_min} and max_dt_stride {dt_max}: the step spacing must be at least 1, \
                     and max_dt_stride at least min_dt_stride"
                ),
            });
        }
        let span = (size - 1).checked_mul(dt_min).and_then(|s| s.checked_add(1)).ok_or_else(|| {
            SourceError::Limit(format!(
                "a window of {size} steps {dt_min} apart spans more than 2^64 steps; lower the window size or \
                 min_dt_stride"
            ))
        })?;
        Ok(Geometry { size, stride, dt_min, dt_max, span })
    }

    /// Windows per item of `steps` steps (0 when one window does not fit).
    pub(crate) fn windows(&self, steps: u64) -> u64 {
        match steps.checked_sub(self.span) {
            Some(room) => room / self.stride + 1,
            None => 0,
        }
    }

    /// The first step of window `w` (`w < windows(steps)`, so within `steps`).
    pub(crate) fn start(&self, w: u64) -> u64 {
        w.saturating_mul(self.stride)
    }

    /// The step spacing of the window starting at `t0` in an item of `steps`
    /// steps: `dt_min`, or with a range a draw from `word` between `dt_min`
    /// and the largest spacing whose window still ends within the item
    /// (capped at `dt_max`), as The Well's `WellDataset` draws it.
    pub(crate) fn dt(&self, t0: u64, steps: u64, word: u64) -> u64 {
        if self.dt_max == self.dt_min || self.size < 2 {
            return self.dt_min;
        }
        let fits = steps.saturating_sub(t0).saturating_sub(1) / (self.size - 1);
        let top = fits.min(self.dt_max);
        if top <= self.dt_min {
            return self.dt_min;
        }
        // top - dt_min + 1 ≤ u64::MAX since dt_min ≥ 1.
        let choices = top - self.dt_min + 1;
        self.dt_min + ((u128::from(word) * u128::from(choices)) >> 64) as u64
    }
}

/// The random word a sample's step spacing is drawn from, keyed by (seed, epoch, index).
fn dt_word(sample: SampleRef) -> u64 {
    fn mix(x: u64) -> u64 {
        let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    // A constant of its own keeps these draws apart from the transforms'.
    [sample.epoch, sample.index, 0x6474_5f73_7472_6964].into_iter().fold(mix(sample.seed), |h, v| mix(h ^ v))
}

/// One file of a dataset: what it is, and its handles while open.
#[derive(Debug)]
struct Hdf5File {
    /// The path as matched (for messages).
    path: PathBuf,
    /// Where it was opened (no symlinks), and beneath which allowed root.
    canonical: PathBuf,
    root: Option<PathBuf>,
    /// Its identity when the dataset was opened.
    id: FileId,
    /// Chunk-cache ids of its fields, kept across reopens.
    cache_ids: Vec<u64>,
    /// Samples per item (1 without a window).
    windows: u64,
    /// Steps along axis 1 of its windowed fields (0 without a window).
    steps: u64,
    /// `None` while closed to bound open files.
    handle: RwLock<Option<Arc<OpenHdf5>>>,
    /// When it was last read (to within [`USE_GRAIN_US`]), in µs since [`EPOCH`].
    used: AtomicU64,
    /// When its size and mtime were last checked, in µs since [`EPOCH`].
    checked_us: AtomicU64,
}

/// Reads of one file check it for changes at most this often (an `fstat`
/// per sample would cost as much as reading a small sample).
const CHANGE_CHECK_US: u64 = 1_000;

/// Reads record that a file was used at most this often (no shared write per sample).
const USE_GRAIN_US: u64 = 1_000;

/// The origin of `checked_us` and `used`.
static EPOCH: std::sync::LazyLock<std::time::Instant> = std::sync::LazyLock::new(std::time::Instant::now);

fn now_us() -> u64 {
    u64::try_from(EPOCH.elapsed().as_micros()).unwrap_or(u64::MAX).max(1)
}

/// The handles of an open file.
#[derive(Debug)]
struct OpenHdf5 {
    /// Keeps the HDF5 file open while the readers use it.
    _h5: hdf5::File,
    raw: File,
    fields: Vec<FieldReader>,
}

impl Hdf5File {
    fn close(&self) {
        self.handle.write().unwrap_or_else(PoisonError::into_inner).take();
    }

    fn touch(&self) {
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
    max: usize,
    open: Mutex<Vec<Weak<Hdf5File>>>,
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
    fn close_changed(&self, id: &FileId) {
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
    fn opened(&self, file: &Arc<Hdf5File>) {
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

/// An open HDF5 dataset.
#[derive(Debug)]
pub struct Hdf5Source {
    spec: Hdf5Spec,
    fields: Vec<FieldSpec>,
    /// Per field: what it delivers for a sample.
    roles: Vec<Role>,
    /// The window, checked.
    geometry: Option<Geometry>,
    files: Vec<Arc<Hdf5File>>,
    /// `starts[k]` is the global index of file k's first sample; one extra entry holds the total.
    starts: Vec<u64>,
    cache: CacheCtx,
    limit: Arc<OpenFiles>,
}

/// Lists the files of `spec`'s glob (sorted) and checks each by opening it by
/// handle ([`fsaccess::open`]), beneath `allowed_roots` when given, then
/// closes it again (a dataset may have more files than descriptors). Runs
/// with the rights of whoever asked for the dataset ([`fsaccess::with_rights`]).
pub fn check_files(spec: &Hdf5Spec, allowed_roots: Option<&[PathBuf]>) -> Result<Vec<fsaccess::Checked>, SourceError> {
    let paths = expand(&spec.files, allowed_roots.is_some())?;
    paths.iter().map(|p| Ok(fsaccess::open(p, allowed_roots, Want::File)?.close())).collect()
}

impl Hdf5Source {
    /// Opens the dataset over `opened`, the files of the spec's glob from
    /// [`check_files`], in order; each must still be the file checked.
    pub fn open(
        spec: &Hdf5Spec,
        opened: Vec<fsaccess::Checked>,
        cache: CacheCtx,
        limit: Arc<OpenFiles>,
    ) -> Result<Hdf5Source, SourceError> {
        let pattern = &spec.files;
        let (roles, geometry) = roles(spec).map_err(|e| match e {
            SourceError::Spec { message, .. } => SourceError::Spec { pattern: pattern.clone(), message },
            SourceError::Limit(message) => SourceError::Limit(format!("dataset {pattern:?}: {message}")),
            other => other,
        })?;
        if opened.is_empty() {
            return Err(SourceError::NoFiles { pattern: pattern.to_string() });
        }
        let mut specs: Option<Vec<FieldSpec>> = None;
        let mut files: Vec<Arc<Hdf5File>> = Vec::with_capacity(opened.len());
        let mut starts = vec![0u64];
        let mut slow: Vec<String> = Vec::new();
        let mut big_chunks: Vec<(String, usize)> = Vec::new();
        for checked in opened {
            // Chunks are keyed by what they are: this file's identity and the field's HDF5 path.
            let cache_ids: Vec<u64> =
                spec.fields.iter().map(|(_, h5path)| crate::cache::space_id(&checked.id, h5path, &())).collect();
            let raw = fsaccess::reopen_same(&checked.canonical, checked.root.as_deref(), &checked.id)
                .map_err(|message| SourceError::Changed { path: checked.path.clone(), message })?;
            // libhdf5 shares one open of a file (by device and inode) among its
            // handles: an older open of this file from before it changed would
            // hand us its stale metadata.
            limit.close_changed(&checked.id);
            let (handle, file_specs, items, steps) =
                open_file(&checked.path, raw, spec, &roles, geometry.as_ref(), &cache_ids)?;
            let windows = geometry.map_or(1, |g| g.windows(steps));
            match &specs {
                None => {
                    for (field, reader) in file_specs.iter().zip(&handle.fields) {
                        match &reader.layout {
                            field::Layout::Library { reason } => slow.push(format!("{} ({reason})", field.name)),
                            field::Layout::Chunked(c) if !c.filters.is_empty() => {
                                big_chunks.push((field.name.clone(), c.chunk_bytes))
                            }
                            _ => {}
                        }
                    }
                    specs = Some(file_specs)
                }
                Some(first) => check_same_fields(&checked.path, first, &file_specs, &files[0].path)?,
            }
            let total = items
                .checked_mul(windows)
                .and_then(|samples| starts.last().expect("starts is never empty").checked_add(samples))
                .ok_or_else(|| {
                    SourceError::Limit(format!(
                        "{pattern:?}: {} holds {items} items × {windows} windows, and the files together more than \
                         2^64 samples; check the files' shapes",
                        checked.path.display()
                    ))
                })?;
            starts.push(total);
            let file = Arc::new(Hdf5File {
                path: checked.path,
                canonical: checked.canonical,
                root: checked.root,
                id: checked.id,
                cache_ids,
                windows: windows.max(1),
                steps,
                handle: RwLock::new(Some(Arc::new(handle))),
                used: AtomicU64::new(0),
                checked_us: AtomicU64::new(0),
            });
            limit.opened(&file);
            files.push(file);
        }
        if files.len() > limit.max {
            tracing::warn!(
                dataset = %pattern,
                files = files.len(),
                max_open_files = limit.max,
                "the dataset has more files than may be open at once: files are closed and reopened as \
                 they are read; raise [limits] max_open_files if reads are slow"
            );
        }
        let fields = specs.expect("opened holds at least one file");
        if *starts.last().expect("starts is never empty") == 0 {
            return Err(SourceError::Empty { pattern: pattern.to_string() });
        }
        if !slow.is_empty() {
            tracing::info!(dataset = %pattern, fields = %slow.join(", "), "reading through libhdf5, under its global lock");
        }
        let capacity = cache.caches.chunks.capacity() as u64;
        for (field, chunk_bytes) in big_chunks {
            if chunk_bytes as u64 > capacity {
                tracing::warn!(
                    dataset = %pattern,
                    field = %field,
                    chunk_bytes,
                    cache_bytes = capacity,
                    "decoded chunks do not fit in the chunk cache: every sample will decompress its whole chunk; \
                     raise [cache] chunk_bytes or rechunk the file"
                );
            }
        }
        Ok(Hdf5Source { spec: spec.clone(), fields, roles, geometry, files, starts, cache, limit })
    }

    /// The file's handles, opening it again if it was closed to bound open
    /// files; fails when the file is no longer what the dataset opened.
    fn handle(&self, file: &Arc<Hdf5File>) -> Result<Arc<OpenHdf5>, SourceError> {
        let changed = |message: String| SourceError::Changed { path: file.path.clone(), message };
        if let Some(handle) = file.handle.read().unwrap_or_else(PoisonError::into_inner).as_ref() {
            file.touch();
            return Ok(handle.clone());
        }
        let mut slot = file.handle.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(handle) = slot.as_ref() {
            return Ok(handle.clone());
        }
        let raw = fsaccess::reopen_same(&file.canonical, file.root.as_deref(), &file.id).map_err(changed)?;
        let (handle, ..) =
            open_file(&file.path, raw, &self.spec, &self.roles, self.geometry.as_ref(), &file.cache_ids)?;
        let handle = Arc::new(handle);
        *slot = Some(handle.clone());
        drop(slot);
        self.limit.opened(file);
        Ok(handle)
    }

    /// The identities of the dataset's files when it was opened.
    pub fn file_ids(&self) -> Vec<FileId> {
        self.files.iter().map(|f| f.id).collect()
    }

    /// The spec the dataset was opened with.
    pub fn spec(&self) -> &Hdf5Spec {
        &self.spec
    }
}

impl Source for Hdf5Source {
    fn len(&self) -> u64 {
        *self.starts.last().expect("starts is never empty")
    }

    fn fields(&self) -> &[FieldSpec] {
        &self.fields
    }

    fn open_files(&self) -> u64 {
        // Never waits (a scrape runs on the async threads): a handle locked
        // for writing is being opened or closed; count it as open.
        let open = |f: &&Arc<Hdf5File>| match f.handle.try_read() {
            Ok(h) => h.is_some(),
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().is_some(),
            Err(std::sync::TryLockError::WouldBlock) => true,
        };
        self.files.iter().filter(open).count() as u64
    }

    fn read_sample(&self, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
        let index = sample.index;
        let file_idx = self.starts.partition_point(|&s| s <= index) - 1;
        let file = &self.files[file_idx];
        let handle = self.handle(file)?;
        check_unchanged(file, &handle)?;
        let local = index - self.starts[file_idx];
        let (item, w) = (local / file.windows, local % file.windows);
        let (t0, dt) = match &self.geometry {
            Some(g) => {
                let t0 = g.start(w);
                (t0, g.dt(t0, file.steps, dt_word(sample)))
            }
            None => (0, 1),
        };
        for (f, dst) in out.iter_mut().enumerate() {
            let reader = &handle.fields[f];
            let spec = &self.fields[f];
            let read_err = |message: String| SourceError::Read {
                path: file.path.clone(),
                field: spec.name.clone(),
                h5path: spec.origin.clone(),
                index,
                row: item,
                message,
            };
            let mut start = vec![0u64; reader.dims.len()];
            let mut count = reader.dims.clone();
            let cache = ChunkUse {
                ctx: &self.cache,
                items: match self.roles[f] {
                    Role::Constant => None,
                    _ => Some((self.starts[file_idx], file.windows)),
                },
            };
            match self.roles[f] {
                Role::Constant => reader.read_block(&handle.raw, &cache, &start, &count, dst.data),
                Role::Item => {
                    start[0] = item;
                    count[0] = 1;
                    reader.read_block(&handle.raw, &cache, &start, &count, dst.data)
                }
                Role::Steps { from, count: steps, item_axis } => {
                    // The time axis: 1 after the item axis, or 0 for a time_only field.
                    let t = usize::from(item_axis);
                    if item_axis {
                        start[0] = item;
                        count[0] = 1;
                    }
                    // Within the item: t0 + (size - 1)·dt < file.steps, checked at open and by `Geometry::dt`.
                    let step = |k: u64| t0 + (from + k) * dt;
                    if dt == 1 || steps <= 1 {
                        start[t] = step(0);
                        count[t] = steps;
                        reader.read_block(&handle.raw, &cache, &start, &count, dst.data)
                    } else {
                        count[t] = 1;
                        let step_bytes = dst.data.len() / steps as usize;
                        if step_bytes == 0 {
                            continue;
                        }
                        dst.data.chunks_exact_mut(step_bytes).zip(0..).try_for_each(|(part, k)| {
                            start[t] = step(k);
                            reader.read_block(&handle.raw, &cache, &start, &count, part)
                        })
                    }
                }
            }
            .map_err(read_err)?;
        }
        Ok(())
    }
}

/// Each field's role and the checked window, from the spec; refuses
/// contradictions (names that are not fields, fields with two roles, a split
/// without a window) with a message saying what to change.
fn roles(spec: &Hdf5Spec) -> Result<(Vec<Role>, Option<Geometry>), SourceError> {
    let invalid = |message: String| SourceError::Spec { pattern: String::new(), message };
    let s = &spec.sampling;
    let geometry = match spec.window {
        Some(w) => Some(Geometry::new(w, s.min_dt_stride, s.max_dt_stride)?),
        None if (s.min_dt_stride, s.max_dt_stride) != (1, 1) => {
            return Err(invalid(format!(
                "min_dt_stride {} / max_dt_stride {} space the steps of a window, but there is no window; add one",
                s.min_dt_stride, s.max_dt_stride
            )));
        }
        None => None,
    };
    let lists: [(&str, &[String]); 4] =
        [("per_item", &spec.per_item), ("constant", &s.constant), ("input", &s.input), ("output", &s.output)];
    for (i, (list, names)) in lists.iter().enumerate() {
        for name in names.iter() {
            if !spec.fields.iter().any(|(n, _)| n == name) {
                return Err(invalid(format!("{list} names {name:?}, which is not one of the fields")));
            }
            if let Some((other, _)) = lists[..i].iter().find(|(_, names)| names.contains(name)) {
                return Err(invalid(format!("field {name:?} is in both {other} and {list}; a field has one role")));
            }
        }
    }
    for name in &s.time_only {
        if !spec.fields.iter().any(|(n, _)| n == name) {
            return Err(invalid(format!("time_only names {name:?}, which is not one of the fields")));
        }
        if let Some((other, _)) = lists[..2].iter().find(|(_, names)| names.contains(name)) {
            return Err(invalid(format!(
                "field {name:?} is in both {other} and time_only; a time_only field takes the window's steps                  (it may also be in input or output)"
            )));
        }
        if spec.window.is_none() {
            return Err(invalid(format!(
                "time_only names {name:?} but there is no window; time_only fields take a window's steps"
            )));
        }
    }
    if spec.window.is_none()
        && let Some((list, name)) =
            lists.iter().filter(|(l, _)| *l != "constant").find_map(|(l, n)| n.first().map(|n| (l, n)))
    {
        let why = if *list == "per_item" {
            "without a window every field is per item"
        } else {
            "input and output fields take parts of a window"
        };
        return Err(invalid(format!("{list} names {name:?} but there is no window; {why}")));
    }
    let (size, n_in) = match (geometry, s.n_steps_input) {
        (Some(g), Some(n_in)) if n_in > g.size => {
            return Err(invalid(format!(
                "n_steps_input {n_in} is more than the window's {} steps (n_steps_input + n_steps_output)",
                g.size
            )));
        }
        (Some(g), Some(n_in)) => (g.size, n_in),
        (None, Some(n_in)) => {
            return Err(invalid(format!("n_steps_input {n_in} splits a window, but there is no window")));
        }
        (g, None) => {
            if let Some(name) = s.input.first().or(s.output.first()) {
                return Err(invalid(format!(
                    "field {name:?} is an input or output field, but the window has no split; give \
                     n_steps_input and n_steps_output instead of size"
                )));
            }
            (g.map_or(0, |g| g.size), 0)
        }
    };
    if s.n_steps_input.is_some() && s.input.is_empty() && s.output.is_empty() {
        return Err(invalid(
            "the window is split (n_steps_input, n_steps_output) but no field is listed in input or output; \
             list the fields that take the first n_steps_input steps in input and those that take the rest in \
             output"
                .into(),
        ));
    }
    let n_out = size - n_in;
    for (list, steps, key) in [("input", n_in, "n_steps_input"), ("output", n_out, "n_steps_output")] {
        let names = if list == "input" { &s.input } else { &s.output };
        if let Some(name) = names.first().filter(|_| steps == 0) {
            return Err(invalid(format!("{list} field {name:?} would get no steps: {key} is 0")));
        }
    }
    let roles: Vec<Role> = spec
        .fields
        .iter()
        .map(|(n, _)| {
            if s.constant.contains(n) {
                Role::Constant
            } else if geometry.is_none() || spec.per_item.contains(n) {
                Role::Item
            } else {
                let item_axis = !s.time_only.contains(n);
                if s.input.contains(n) {
                    Role::Steps { from: 0, count: n_in, item_axis }
                } else if s.output.contains(n) {
                    Role::Steps { from: n_in, count: n_out, item_axis }
                } else {
                    Role::Steps { from: 0, count: size, item_axis }
                }
            }
        })
        .collect();
    if geometry.is_some() && !roles.iter().any(|r| matches!(r, Role::Steps { .. })) {
        return Err(invalid(
            "a window needs at least one field that is not per_item or constant (the windowed fields)".into(),
        ));
    }
    if !roles.iter().any(|r| r.has_item_axis()) {
        return Err(invalid(
            "every field is constant or time_only; at least one field needs the item axis that samples are              indexed by"
                .into(),
        ));
    }
    Ok((roles, geometry))
}

/// The files matching `pattern`, sorted. Glob sees only what the caller may
/// list: when nothing matches because a directory is closed to the caller, or
/// the pattern names one file, that file's open reports why.
/// A file rewritten or appended to under a stream would deliver rows that
/// are neither the old nor the new contents: fail instead, naming it.
fn check_unchanged(file: &Hdf5File, handle: &OpenHdf5) -> Result<(), SourceError> {
    let now_us = now_us();
    let last = file.checked_us.load(Ordering::Relaxed);
    if last != 0 && now_us.saturating_sub(last) < CHANGE_CHECK_US {
        return Ok(());
    }
    let changed = |message: String| SourceError::Changed { path: file.path.clone(), message };
    let now = FileId::of(&handle.raw).map_err(|e| changed(format!("cannot be checked for changes: {e}")))?;
    if let Some(change) = file.id.change(&now) {
        return Err(changed(format!("{change} while being served; open a new Loader to read the new contents")));
    }
    file.checked_us.store(now_us, Ordering::Relaxed);
    Ok(())
}

fn expand(pattern: &str, client: bool) -> Result<Vec<PathBuf>, SourceError> {
    let bad = |message: String| SourceError::BadGlob { pattern: pattern.to_string(), message };
    let mut paths = Vec::new();
    for entry in glob::glob(pattern).map_err(|e| bad(e.to_string()))? {
        paths.push(entry.map_err(|e| bad(e.to_string()))?);
    }
    // Directories are not data; anything else that matches is opened and
    // refused with a clear error if it is not a regular file (a FIFO).
    paths.retain(|p| !p.is_dir());
    paths.sort();
    if paths.is_empty() {
        let is_glob = |c: &std::path::Component<'_>| c.as_os_str().to_string_lossy().contains(['*', '?', '[']);
        let literal: PathBuf = Path::new(pattern).components().take_while(|c| !is_glob(c)).collect();
        if literal.as_os_str().len() == pattern.len() {
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

/// Opens `raw` (the checked file at `path`) with libhdf5 and builds its
/// readers: the handles, the field specs, the items, and the steps along
/// axis 1 of the windowed fields (0 without a window). A window longer than
/// those steps is refused, naming the file and field.
fn open_file(
    path: &Path,
    raw: File,
    spec: &Hdf5Spec,
    roles: &[Role],
    geometry: Option<&Geometry>,
    cache_ids: &[u64],
) -> Result<(OpenHdf5, Vec<FieldSpec>, u64, u64), SourceError> {
    let open_err = |message: String| SourceError::Open { path: path.to_owned(), message };
    // libhdf5's default chunk cache is 1 MiB per dataset: reads of rows from a
    // few different chunks in turn (parallel fills) would decompress whole
    // chunks again for every row on the libhdf5 path. 16 MiB per dataset.
    let h5 = hdf5::File::with_options()
        .with_fapl(|fapl| fapl.chunk_cache(4093, 16 << 20, 0.75))
        .open(fsaccess::fd_path(&raw))
        .map_err(|e| open_err(e.to_string()))?;
    let mut specs = Vec::with_capacity(spec.fields.len());
    let mut readers = Vec::with_capacity(spec.fields.len());
    // (length, field name) of the first field along axis 0, and along axis 1 for windowed fields.
    let mut items: Option<(u64, &str)> = None;
    let mut steps: Option<(u64, &str)> = None;
    for (((name, h5path), &role), &cache_id) in spec.fields.iter().zip(roles).zip(cache_ids) {
        let field_err = |message: String| SourceError::Inconsistent {
            path: path.to_owned(),
            field: name.clone(),
            h5path: h5path.clone(),
            message,
        };
        let dataset = field::open_own_dataset(&h5, h5path).map_err(|why| match why.explain() {
            Some(message) => field_err(message),
            None => SourceError::MissingField { path: path.to_owned(), field: name.clone(), h5path: h5path.clone() },
        })?;
        let shape: Vec<u64> = dataset.shape().iter().map(|&d| d as u64).collect();
        let (len, rest) = match shape.split_first() {
            _ if !role.has_item_axis() => (None, &shape[..]),
            Some((&len, rest)) => (Some(len), rest),
            None => {
                return Err(field_err(
                    "is a scalar; a field needs a first axis to index samples by (list it in constant to deliver \
                     it whole with every sample)"
                        .into(),
                ));
            }
        };
        match (items, len) {
            (_, None) => {}
            (None, Some(len)) => items = Some((len, name)),
            (Some((first_len, first_name)), Some(len)) if first_len != len => {
                return Err(field_err(format!(
                    "has {len} items along the first axis but field {first_name:?} has {first_len}; \
                     all fields of a dataset must have the same length in each file (list fields without \
                     the item axis in constant)"
                )));
            }
            (Some(_), Some(_)) => {}
        }
        let sample_shape = match role {
            Role::Constant => shape.clone(),
            Role::Item => rest.to_vec(),
            Role::Steps { count, .. } => {
                // `rest` follows the item axis; a time_only field's is its whole shape.
                let axis = if rest.len() == shape.len() { 0 } else { 1 };
                let Some((&time, trailing)) = rest.split_first() else {
                    return Err(field_err(format!(
                        "has shape {shape:?}; a windowed field needs a time axis (axis 1); list it in per_item \
                         to deliver it whole per item, or in constant if it has no item axis either"
                    )));
                };
                if let Some(g) = geometry.filter(|g| time < g.span) {
                    return Err(field_err(window_too_long(g, time, spec.sampling.n_steps_input)));
                }
                match steps {
                    None => steps = Some((time, name)),
                    Some((first_time, first_name)) if first_time != time => {
                        return Err(field_err(format!(
                            "has {time} steps along axis {axis} (its time axis) but windowed field {first_name:?} has \
                         {first_time}"
                        )));
                    }
                    Some(_) => {}
                }
                std::iter::once(count).chain(trailing.iter().copied()).collect()
            }
        };
        let file_type = dataset.dtype().map_err(|e| field_err(e.to_string()))?;
        let (dtype, descriptor) = classify(&file_type).map_err(|found| SourceError::Dtype {
            path: path.to_owned(),
            field: name.clone(),
            h5path: h5path.clone(),
            found,
        })?;
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
        if let Some(bytes) = field::decoded_chunk_bytes(&dataset, dtype.size())
            && bytes > spec.max_chunk_bytes
        {
            let chunk = dataset.chunk().unwrap_or_default();
            return Err(SourceError::Limit(format!(
                "{}: field {name:?} ({h5path:?}) is stored in compressed chunks of {chunk:?} {dtype}, {bytes} bytes each \
                 decoded, more than [limits] max_sample_bytes = {} bytes; every read decodes a whole chunk: rechunk \
                 the dataset to smaller chunks (e.g. h5repack -l {h5path}:CHUNK=...), or ask the daemon's admin to \
                 raise the limit",
                path.display(),
                spec.max_chunk_bytes
            )));
        }
        let mem_type = mem_type(&file_type, &descriptor).map_err(|e| field_err(e.to_string()))?;
        let reader =
            FieldReader::new(dataset, dtype, &file_type, mem_type, cache_id, spec.fast_path).map_err(field_err)?;
        specs.push(FieldSpec {
            name: name.clone(),
            origin: h5path.clone(),
            dtype,
            shape: sample_shape,
            max_sample_bytes: None,
        });
        readers.push(reader);
    }
    let items = items.map_or(0, |(len, _)| len);
    let steps = match steps {
        Some((time, ..)) => time,
        None => 0,
    };
    Ok((OpenHdf5 { _h5: h5, raw, fields: readers }, specs, items, steps))
}

/// Why no window of `g` fits in `time` steps: the window's size (and
/// split), its spacing and span, and what to change.
fn window_too_long(g: &Geometry, time: u64, n_steps_input: Option<u64>) -> String {
    let split = match n_steps_input {
        Some(n_in) => format!(" (n_steps_input {n_in} + n_steps_output {})", g.size - n_in),
        None => String::new(),
    };
    let spacing = if g.dt_min == 1 { "consecutive".to_string() } else { format!("{} apart (min_dt_stride)", g.dt_min) };
    format!(
        "has {time} time steps (axis 1), fewer than one window spans: {} steps{split}, {spacing}, span {} steps \
         (window stride {}); no sample fits. Shorten the window or lower the step spacing, or leave this file out",
        g.size, g.span, g.stride
    )
}

/// Maps an HDF5 file type to the dtype served, or describes what it is.
///
/// Enums are served as their base integer type and bitfields (PyTables'
/// bool arrays) as unsigned integers of their size, as h5py reads both.
pub(crate) fn classify(file_type: &hdf5::Datatype) -> Result<(DType, TypeDescriptor), String> {
    if let Some(size) = field::bitfield_size(file_type) {
        let size = IntSize::from_int(size).ok_or_else(|| format!("{}-byte bitfield", size))?;
        return Ok((unsigned(size), TypeDescriptor::Unsigned(size)));
    }
    let descriptor = file_type.to_descriptor().map_err(|e| format!("unsupported ({e})"))?;
    let dtype = match &descriptor {
        TypeDescriptor::Boolean => DType::Bool,
        TypeDescriptor::Enum(e) if e.signed => signed(e.size),
        TypeDescriptor::Enum(e) => unsigned(e.size),
        TypeDescriptor::Integer(size) => signed(*size),
        TypeDescriptor::Unsigned(size) => unsigned(*size),
        TypeDescriptor::Float(size) => match size {
            FloatSize::U2 => DType::F16,
            FloatSize::U4 => DType::F32,
            FloatSize::U8 => DType::F64,
        },
        other => return Err(describe(other)),
    };
    Ok((dtype, descriptor))
}

fn signed(size: IntSize) -> DType {
    match size {
        IntSize::U1 => DType::I8,
        IntSize::U2 => DType::I16,
        IntSize::U4 => DType::I32,
        IntSize::U8 => DType::I64,
    }
}

fn unsigned(size: IntSize) -> DType {
    match size {
        IntSize::U1 => DType::U8,
        IntSize::U2 => DType::U16,
        IntSize::U4 => DType::U32,
        IntSize::U8 => DType::U64,
    }
}

/// Each filter of `dataset`'s pipeline: its name, id, and who decodes it
/// here (`"Rust"`, `"libhdf5"`, or `None`: nothing can), for `stoker inspect`.
pub(crate) fn field_filters(dataset: &hdf5::Dataset) -> Vec<(String, u32, Option<&'static str>)> {
    field::pipeline(dataset).iter().map(|f| (field::filter_name(f), f.id, field::decoder_of(f))).collect()
}

/// The in-memory type `H5Dread` converts a field to: the native form of
/// what [`classify`] returned (an enum stays an enum with the same members,
/// whose bytes are its base integers; a bitfield stays a native bitfield,
/// since libhdf5 converts neither to plain integers).
pub(crate) fn mem_type(file_type: &hdf5::Datatype, descriptor: &TypeDescriptor) -> hdf5::Result<hdf5::Datatype> {
    match field::bitfield_size(file_type) {
        Some(_) => field::native_type(file_type),
        None => hdf5::Datatype::from_descriptor(descriptor),
    }
}

fn describe(td: &TypeDescriptor) -> String {
    match td {
        TypeDescriptor::FixedAscii(_) | TypeDescriptor::FixedUnicode(_) => "fixed-length string".into(),
        TypeDescriptor::VarLenAscii | TypeDescriptor::VarLenUnicode => "variable-length string".into(),
        TypeDescriptor::VarLenArray(_) => "variable-length array".into(),
        TypeDescriptor::Compound(_) => "compound".into(),
        TypeDescriptor::Enum(_) => "enum".into(),
        TypeDescriptor::FixedArray(..) => "array".into(),
        other => format!("{other}"),
    }
}

fn check_same_fields(
    path: &Path,
    first: &[FieldSpec],
    these: &[FieldSpec],
    first_path: &Path,
) -> Result<(), SourceError> {
    for (a, b) in first.iter().zip(these) {
        if a.dtype != b.dtype || a.shape != b.shape {
            return Err(SourceError::Inconsistent {
                path: path.to_owned(),
                field: b.name.clone(),
                h5path: b.origin.clone(),
                message: format!(
                    "has samples of {} {:?} but {} has {} {:?}; every file must agree",
                    b.dtype,
                    b.shape,
                    first_path.display(),
                    a.dtype,
                    a.shape
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(size: u64, stride: u64, dt_min: u64, dt_max: u64) -> Result<Geometry, SourceError> {
        Geometry::new(Window { size, stride }, dt_min, dt_max)
    }

    /// the_well.data.utils.raw_steps_to_possible_sample_t0s.
    fn well_windows(steps: u64, size: u64, dt: u64) -> u64 {
        (steps + 1).saturating_sub(1 + dt * (size - 1))
    }

    #[test]
    fn windows_match_welldataset() {
        // The docstring's examples: (T, n_in + n_out, dt) → windows.
        for (steps, size, dt, expect) in [(5, 2, 1, 4), (5, 2, 2, 3), (5, 2, 3, 2), (5, 3, 2, 1), (5, 3, 3, 0)] {
            assert_eq!(geometry(size, 1, dt, dt).unwrap().windows(steps), expect, "T={steps} size={size} dt={dt}");
            assert_eq!(well_windows(steps, size, dt), expect);
        }
        for steps in 0..40 {
            for size in 1..6 {
                for dt in 1..4 {
                    let g = geometry(size, 1, dt, dt + 3).unwrap();
                    assert_eq!(g.windows(steps), well_windows(steps, size, dt));
                }
            }
        }
        // A start stride k keeps every k-th of those windows.
        assert_eq!(geometry(4, 2, 1, 1).unwrap().windows(11), 4);
    }

    #[test]
    fn drawn_dt_stays_inside_the_item_and_the_range() {
        for steps in 2..30u64 {
            for size in 2..5u64 {
                let g = geometry(size, 1, 1, 5).unwrap();
                for w in 0..g.windows(steps) {
                    let t0 = g.start(w);
                    // the_well.data.utils.maximum_stride_for_initial_index
                    let top = ((steps - t0 - 1) / (size - 1)).clamp(1, 5);
                    let mut seen = std::collections::BTreeSet::new();
                    for word in [0, 1 << 20, u64::MAX / 3, u64::MAX / 2, u64::MAX - 1, u64::MAX] {
                        let dt = g.dt(t0, steps, word);
                        assert!((1..=top).contains(&dt), "T={steps} size={size} t0={t0}: dt {dt} not in 1..={top}");
                        assert!(t0 + (size - 1) * dt < steps);
                        seen.insert(dt);
                    }
                    assert!(seen.contains(&1) && seen.contains(&top), "the range's ends are drawn");
                }
            }
        }
        // Fixed spacing: never drawn.
        assert_eq!(geometry(3, 1, 2, 2).unwrap().dt(0, 100, u64::MAX), 2);
    }

    #[test]
    fn hostile_window_values_are_refused_or_harmless() {
        assert!(matches!(geometry(0, 1, 1, 1), Err(SourceError::Spec { .. })));
        assert!(matches!(geometry(3, 0, 1, 1), Err(SourceError::Spec { .. })));
        assert!(matches!(geometry(3, 1, 0, 1), Err(SourceError::Spec { .. })));
        assert!(matches!(geometry(3, 1, 4, 2), Err(SourceError::Spec { .. })));
        let Err(SourceError::Limit(message)) = geometry(3, 1, 1 << 63, 1 << 63) else { panic!("overflow accepted") };
        assert!(message.contains("3 steps") && message.contains(&(1u64 << 63).to_string()), "{message}");
        assert!(matches!(geometry(u64::MAX, 1, 2, 2), Err(SourceError::Limit(_))));
        // Accepted extremes compute without overflow.
        for (size, stride, lo, hi) in
            [(u64::MAX, 1, 1, u64::MAX), (1, u64::MAX, u64::MAX, u64::MAX), (2, 1, 1, u64::MAX)]
        {
            let g = geometry(size, stride, lo, hi).unwrap();
            for steps in [0, 1, 2, u64::MAX - 1, u64::MAX] {
                let windows = g.windows(steps);
                assert!(windows <= steps);
                if windows > 0 {
                    let t0 = g.start(windows - 1);
                    for word in [0, u64::MAX] {
                        let dt = g.dt(t0, steps, word);
                        assert!(dt >= lo && dt <= hi.max(lo));
                    }
                }
            }
        }
    }

    fn spec(fields: &[&str], window: Option<Window>, sampling: Hdf5Sampling) -> Hdf5Spec {
        Hdf5Spec {
            files: "/x/*.h5".into(),
            fields: fields.iter().map(|f| (f.to_string(), f.to_string())).collect(),
            window,
            per_item: Vec::new(),
            fast_path: true,
            sampling,
            max_chunk_bytes: u64::MAX,
        }
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn roles_split_the_window() {
        let sampling = Hdf5Sampling {
            n_steps_input: Some(4),
            input: names(&["x"]),
            output: names(&["y"]),
            constant: names(&["c"]),
            ..Default::default()
        };
        let (roles, g) = roles(&spec(&["x", "y", "w", "c"], Some(Window { size: 5, stride: 1 }), sampling)).unwrap();
        assert_eq!(
            roles,
            [
                Role::Steps { from: 0, count: 4, item_axis: true },
                Role::Steps { from: 4, count: 1, item_axis: true },
                Role::Steps { from: 0, count: 5, item_axis: true },
                Role::Constant
            ]
        );
        assert_eq!(g.map(|g| g.span), Some(5));
    }

    #[test]
    fn time_only_fields_take_steps_without_the_item_axis() {
        let sampling = Hdf5Sampling {
            n_steps_input: Some(2),
            input: names(&["x", "t_in"]),
            output: names(&["t_out"]),
            time_only: names(&["t_in", "t_out", "t"]),
            ..Default::default()
        };
        let fields = ["x", "t_in", "t_out", "t"];
        let (got, _) = roles(&spec(&fields, Some(Window { size: 3, stride: 1 }), sampling)).unwrap();
        assert_eq!(
            got,
            [
                Role::Steps { from: 0, count: 2, item_axis: true },
                Role::Steps { from: 0, count: 2, item_axis: false },
                Role::Steps { from: 2, count: 1, item_axis: false },
                Role::Steps { from: 0, count: 3, item_axis: false },
            ]
        );
        assert!(got[0].has_item_axis() && !got[1].has_item_axis() && !Role::Constant.has_item_axis());
        let refused = |spec: Hdf5Spec, needle: &str| match roles(&spec) {
            Err(SourceError::Spec { message, .. }) => assert!(message.contains(needle), "{message}"),
            other => panic!("accepted or wrong error: {other:?}"),
        };
        let w = Some(Window { size: 3, stride: 1 });
        let only = |time_only: &[&str], constant: &[&str]| Hdf5Sampling {
            time_only: names(time_only),
            constant: names(constant),
            ..Default::default()
        };
        refused(spec(&["t"], w, only(&["t"], &[])), "needs the item axis");
        refused(spec(&["x", "t"], w, only(&["t"], &["t"])), "in both constant and time_only");
        refused(spec(&["x", "t"], None, only(&["t"], &[])), "no window");
        refused(spec(&["x"], w, only(&["z"], &[])), "not one of the fields");
    }

    #[test]
    fn contradictory_roles_are_refused() {
        let w = Some(Window { size: 3, stride: 1 });
        let split = |n_in, input: &[&str], output: &[&str]| Hdf5Sampling {
            n_steps_input: n_in,
            input: names(input),
            output: names(output),
            ..Default::default()
        };
        let refused = |spec: Hdf5Spec, needle: &str| match roles(&spec) {
            Err(SourceError::Spec { message, .. }) => assert!(message.contains(needle), "{message}"),
            other => panic!("accepted or wrong error: {other:?}"),
        };
        refused(spec(&["x"], w, split(Some(4), &["x"], &[])), "more than the window's 3 steps");
        refused(spec(&["x", "y"], w, split(Some(3), &["x"], &["y"])), "n_steps_output is 0");
        refused(spec(&["x"], w, split(None, &["x"], &[])), "no split");
        refused(spec(&["x"], w, split(Some(1), &[], &[])), "no field is listed");
        refused(spec(&["x"], w, split(Some(1), &["x"], &["x"])), "one role");
        refused(spec(&["x"], w, split(Some(1), &["z"], &[])), "not one of the fields");
        refused(spec(&["x"], None, split(Some(1), &["x"], &[])), "no window");
        let constant = Hdf5Sampling { constant: names(&["x"]), ..Default::default() };
        refused(spec(&["x"], None, constant), "every field is constant");
        let dt = Hdf5Sampling { min_dt_stride: 2, max_dt_stride: 2, ..Default::default() };
        refused(spec(&["x"], None, dt), "no window");
    }
}

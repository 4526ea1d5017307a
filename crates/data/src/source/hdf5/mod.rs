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
//! Files arrive opened by handle ([`crate::fsaccess`]). libhdf5 runs where
//! an [`Hdf5Opener`] puts it: in the daemon, an HDF5 helper process of the
//! dataset's trust domain, which opens the same inode (the descriptor is
//! passed to it) and answers with plain facts (shape, type, layout, chunk
//! locations) and, for the fields only libhdf5 reads, the bytes. The facts
//! are checked before use; data is read by `field::FieldReader` (pread and
//! Rust decoders in this process where it can, the helper's libhdf5 where it
//! must). At most [`OpenFiles`]' bound of files stay
//! open across all datasets: the least recently read are closed and opened
//! again on their next read, after checking they are still the same file.
//! A file that changes while served fails its reads with an error naming it.

#[allow(unsafe_code)] // calls libhdf5 (H5D/H5T/H5P) directly where the `hdf5` crate has no safe API
pub(crate) mod field;
mod files;
mod geometry;
mod glob;
mod types;

pub use field::library::{
    FieldFacts, Hdf5Opener, LayoutFacts, LibFile, LocalFile, LocalOpener, Location, ProbeError, probe,
};
pub use field::{FieldError, StoredChunk};
use files::*;
pub use files::{OpenFiles, check_files};
use geometry::*;
use types::*;
pub(crate) use types::{classify, field_filters};

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, PoisonError, RwLock};

use stoker_proto::{Hdf5Dataset, Hdf5Sampling};

use super::{FieldOut, FieldSpec, SampleRef, Source, SourceError};
use crate::cache::CacheCtx;
use crate::fsaccess::{self, FileId};
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
    /// Whose trust domain reads the files: `Some(uid)` for a client's ad-hoc
    /// dataset (that user's HDF5 helper), `None` for a dataset named in the
    /// config. Part of the chunk cache's keys: what one user's helper says
    /// about a file is never served to another user.
    pub domain: Option<u32>,
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
            domain: None,
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
    /// Where libhdf5 runs (opens and reopens).
    opener: Arc<dyn Hdf5Opener>,
    /// Whose rights files are (re)opened with.
    rights: fsaccess::Rights,
}

impl Hdf5Source {
    /// Opens the dataset over `opened`, the files of the spec's glob from
    /// [`check_files`], in order (each must still be the file checked), with
    /// libhdf5 where `opener` runs it; files are opened again (after the
    /// check, and after the open-files bound closed them) with `rights`, those
    /// of whoever asked for the dataset.
    pub fn open(
        spec: &Hdf5Spec,
        opened: Vec<fsaccess::Checked>,
        cache: CacheCtx,
        limit: Arc<OpenFiles>,
        opener: Arc<dyn Hdf5Opener>,
        rights: fsaccess::Rights,
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
        let mut read_paths = ReadPaths::default();
        for checked in opened {
            let raw = fsaccess::reopen_as(rights, &checked.canonical, checked.root.as_deref(), &checked.id)
                .map_err(|problem| SourceError::Changed { path: checked.path.clone(), problem })?;
            // libhdf5 shares one open of a file (by device and inode) among its
            // handles: an older open of this file from before it changed would
            // hand us its stale metadata.
            limit.close_changed(&checked.id);
            let (handle, file_specs, items, steps) =
                open_file(&checked.path, &checked.id, raw, spec, &roles, geometry.as_ref(), opener.as_ref())?;
            let windows = geometry.map_or(1, |g| g.windows(steps));
            match &specs {
                None => {
                    read_paths = ReadPaths::of(&file_specs, &handle);
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
                windows: windows.max(1),
                steps,
                handle: RwLock::new(Some(Arc::new(handle))),
                used: AtomicU64::new(0),
                checked_us: AtomicU64::new(0),
                crashed: std::sync::OnceLock::new(),
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
        read_paths.log(pattern, cache.caches.chunks.capacity() as u64);
        Ok(Hdf5Source { spec: spec.clone(), fields, roles, geometry, files, starts, cache, limit, opener, rights })
    }

    /// The file's handles, opening it again if it was closed to bound open
    /// files; fails when the file is no longer what the dataset opened.
    fn handle(&self, file: &Arc<Hdf5File>) -> Result<Arc<OpenHdf5>, SourceError> {
        let changed = |problem| SourceError::Changed { path: file.path.clone(), problem };
        if let Some(handle) = file.handle.read().unwrap_or_else(PoisonError::into_inner).as_ref() {
            file.touch();
            return Ok(handle.clone());
        }
        let mut slot = file.handle.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(handle) = slot.as_ref() {
            return Ok(handle.clone());
        }
        let raw = fsaccess::reopen_as(self.rights, &file.canonical, file.root.as_deref(), &file.id).map_err(changed)?;
        let (handle, ..) = open_file(
            &file.path,
            &file.id,
            raw,
            &self.spec,
            &self.roles,
            self.geometry.as_ref(),
            self.opener.as_ref(),
        )?;
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

/// How the fields of a dataset's first file are read, for the log: the
/// fields libhdf5 reads (with the reason), and the decoded chunk size of
/// each filtered field the fast path decodes.
#[derive(Debug, Default)]
struct ReadPaths {
    slow: Vec<String>,
    big_chunks: Vec<(String, usize)>,
}

impl ReadPaths {
    /// The read paths of `handle`'s fields (`specs`).
    fn of(specs: &[FieldSpec], handle: &OpenHdf5) -> ReadPaths {
        let mut paths = ReadPaths::default();
        for (field, reader) in specs.iter().zip(&handle.fields) {
            match &reader.layout {
                field::Layout::Library { reason } => paths.slow.push(format!("{} ({reason})", field.name)),
                field::Layout::Chunked(c) if !c.filters.is_empty() => {
                    paths.big_chunks.push((field.name.clone(), c.chunk_bytes))
                }
                _ => {}
            }
        }
        paths
    }

    /// Logs the fields read through libhdf5, and warns of filtered fields
    /// whose decoded chunks do not fit in the chunk cache (`capacity` bytes).
    fn log(&self, pattern: &str, capacity: u64) {
        if !self.slow.is_empty() {
            tracing::info!(dataset = %pattern, fields = %self.slow.join(", "), "reading through libhdf5, under its global lock");
        }
        for (field, chunk_bytes) in &self.big_chunks {
            if *chunk_bytes as u64 > capacity {
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
        // The helper that had the file open may have been restarted (another
        // file of the domain crashed it, perhaps again meanwhile): the file is
        // opened again and the sample read once more, a few times at most.
        let mut tries = 0;
        loop {
            let reopened = std::cell::Cell::new(false);
            match self.read_once(sample, out, &reopened) {
                Err(_) if reopened.get() && tries < 4 => tries += 1,
                result => return result,
            }
        }
    }
}

impl Hdf5Source {
    /// Reads `sample`; sets `reopened` when its file's helper had been
    /// restarted (the handle is dropped: the next read opens it again).
    fn read_once(
        &self,
        sample: SampleRef,
        out: &mut [FieldOut<'_>],
        reopened: &std::cell::Cell<bool>,
    ) -> Result<(), SourceError> {
        let index = sample.index;
        let file_idx = self.starts.partition_point(|&s| s <= index) - 1;
        let file = &self.files[file_idx];
        if let Some(why) = file.crashed.get() {
            let local = index - self.starts[file_idx];
            let first = self.fields.first();
            return Err(SourceError::Read {
                path: file.path.clone(),
                field: first.map_or_else(String::new, |f| f.name.clone()),
                h5path: first.map_or_else(String::new, |f| f.origin.clone()),
                index,
                row: local / file.windows,
                message: why.clone(),
            });
        }
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
            let read_err = |e: field::FieldError| {
                if let field::FieldError::Helper { message, file_crashed_it: true } = &e {
                    let _ = file.crashed.set(message.clone());
                }
                if matches!(e, field::FieldError::Helper { .. } | field::FieldError::Reopen) {
                    // The helper that had the file open is gone: the next
                    // read opens it again (through a new helper).
                    file.close();
                    reopened.set(matches!(e, field::FieldError::Reopen));
                }
                SourceError::Read {
                    path: file.path.clone(),
                    field: spec.name.clone(),
                    h5path: spec.origin.clone(),
                    index,
                    row: item,
                    message: e.to_string(),
                }
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
            domain: None,
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

//! HDF5 source: a sorted glob of files, each field an HDF5 dataset path.
//!
//! Without a window, sample `i` is row `i` along the first axis of the
//! concatenated files. With a window (`size`, `stride`) along axis 1, every
//! item (row) of a file holds `(T - size) / stride + 1` samples, and sample
//! `(item, start)` delivers `field[item, start : start + size]` for windowed
//! fields and `field[item]` for per-item fields: The Well's
//! `[trajectory, time, x, y, …]` layout.
//!
//! Files are opened once and stay open; metadata comes from libhdf5 at open;
//! data is read by `field::FieldReader` (pread and Rust decoders where it
//! can, libhdf5 where it must).

pub(crate) mod field;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hdf5::types::{FloatSize, IntSize, TypeDescriptor};
use stoker_proto::DType;

use self::field::FieldReader;
use super::{FieldOut, FieldSpec, SampleRef, Source, SourceError};
use crate::cache::ChunkCache;

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
}

#[derive(Debug)]
struct Hdf5File {
    path: PathBuf,
    /// Keeps the HDF5 file open for the datasets' lifetime.
    _h5: hdf5::File,
    raw: File,
    fields: Vec<FieldReader>,
    /// Samples per item (1 without a window).
    windows: u64,
}

/// An open HDF5 dataset.
#[derive(Debug)]
pub struct Hdf5Source {
    spec: Hdf5Spec,
    fields: Vec<FieldSpec>,
    /// Per field: windowed (true) or whole per item.
    windowed: Vec<bool>,
    files: Vec<Hdf5File>,
    /// `starts[k]` is the global index of file k's first sample; one extra entry holds the total.
    starts: Vec<u64>,
    cache: Arc<ChunkCache>,
}

impl Hdf5Source {
    /// Opens every file matching the spec's glob (sorted).
    ///
    /// `allowed_roots`, when given, must contain every matched file.
    pub fn open(
        spec: &Hdf5Spec,
        allowed_roots: Option<&[PathBuf]>,
        cache: Arc<ChunkCache>,
    ) -> Result<Hdf5Source, SourceError> {
        let pattern = &spec.files;
        let invalid = |message: String| SourceError::Spec { pattern: pattern.clone(), message };
        if let Some(w) = spec.window.filter(|w| w.size == 0 || w.stride == 0) {
            return Err(invalid(format!("window size {} and stride {} must both be at least 1", w.size, w.stride)));
        }
        for name in &spec.per_item {
            if !spec.fields.iter().any(|(n, _)| n == name) {
                return Err(invalid(format!("per_item names {name:?}, which is not one of the fields")));
            }
            if spec.window.is_none() {
                return Err(invalid(format!(
                    "per_item names {name:?} but there is no window; without a window every field is per item"
                )));
            }
        }
        let windowed: Vec<bool> =
            spec.fields.iter().map(|(n, _)| spec.window.is_some() && !spec.per_item.contains(n)).collect();
        if spec.window.is_some() && !windowed.contains(&true) {
            return Err(invalid("a window needs at least one field that is not per_item (the windowed fields)".into()));
        }
        let paths = expand(pattern)?;
        if let Some(roots) = allowed_roots {
            for path in &paths {
                let real = path.canonicalize().unwrap_or_else(|_| path.clone());
                if !roots.iter().any(|root| real.starts_with(root)) {
                    return Err(SourceError::NotAllowed { path: path.clone(), roots: roots.to_vec() });
                }
            }
        }
        let mut specs: Option<Vec<FieldSpec>> = None;
        let mut files: Vec<Hdf5File> = Vec::with_capacity(paths.len());
        let mut starts = vec![0u64];
        for path in paths {
            let (file, file_specs, samples) = open_file(&path, spec, &windowed, &cache)?;
            match &specs {
                None => specs = Some(file_specs),
                Some(first) => check_same_fields(&path, first, &file_specs, &files[0].path)?,
            }
            let total = starts.last().expect("starts is never empty").checked_add(samples).ok_or_else(|| {
                SourceError::Limit(format!("{pattern:?}: the files together hold more than 2^64 samples"))
            })?;
            starts.push(total);
            files.push(file);
        }
        let fields = specs.expect("expand returns at least one file");
        if *starts.last().expect("starts is never empty") == 0 {
            return Err(SourceError::Empty { pattern: pattern.to_string() });
        }
        let slow: Vec<String> = fields
            .iter()
            .zip(&files[0].fields)
            .filter_map(|(field, reader)| match &reader.layout {
                field::Layout::Library { reason } => Some(format!("{} ({reason})", field.name)),
                _ => None,
            })
            .collect();
        if !slow.is_empty() {
            tracing::info!(dataset = %pattern, fields = %slow.join(", "), "reading through libhdf5, under its global lock");
        }
        let capacity = cache.stats().capacity;
        for (field, reader) in fields.iter().zip(&files[0].fields) {
            if let field::Layout::Chunked(c) = &reader.layout
                && !c.filters.is_empty()
                && c.chunk_bytes as u64 > capacity
            {
                tracing::warn!(
                    dataset = %pattern,
                    field = %field.name,
                    chunk_bytes = c.chunk_bytes,
                    cache_bytes = capacity,
                    "decoded chunks do not fit in the chunk cache: every sample will decompress its whole chunk; \
                     raise [cache] chunk_bytes or rechunk the file"
                );
            }
        }
        Ok(Hdf5Source { spec: spec.clone(), fields, windowed, files, starts, cache })
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

    fn read_sample(&self, sample: SampleRef, out: &mut [FieldOut<'_>]) -> Result<(), SourceError> {
        let index = sample.index;
        let file_idx = self.starts.partition_point(|&s| s <= index) - 1;
        let file = &self.files[file_idx];
        let local = index - self.starts[file_idx];
        let (item, step) = (local / file.windows, local % file.windows);
        for (f, dst) in out.iter_mut().enumerate() {
            let reader = &file.fields[f];
            let spec = &self.fields[f];
            let mut start = vec![0u64; reader.dims.len()];
            let mut count = reader.dims.clone();
            start[0] = item;
            count[0] = 1;
            if self.windowed[f] {
                let w = self.spec.window.expect("windowed fields exist only with a window");
                start[1] = step * w.stride;
                count[1] = w.size;
            }
            reader.read_block(&file.raw, &self.cache, &start, &count, dst.data).map_err(|message| {
                SourceError::Read {
                    path: file.path.clone(),
                    field: spec.name.clone(),
                    h5path: spec.origin.clone(),
                    index,
                    row: item,
                    message,
                }
            })?;
        }
        Ok(())
    }
}

fn expand(pattern: &str) -> Result<Vec<PathBuf>, SourceError> {
    let bad = |message: String| SourceError::BadGlob { pattern: pattern.to_string(), message };
    let mut paths = Vec::new();
    for entry in glob::glob(pattern).map_err(|e| bad(e.to_string()))? {
        paths.push(entry.map_err(|e| bad(e.to_string()))?);
    }
    paths.retain(|p| p.is_file());
    paths.sort();
    if paths.is_empty() {
        return Err(SourceError::NoFiles { pattern: pattern.to_string() });
    }
    Ok(paths)
}

fn open_file(
    path: &Path,
    spec: &Hdf5Spec,
    windowed: &[bool],
    cache: &ChunkCache,
) -> Result<(Hdf5File, Vec<FieldSpec>, u64), SourceError> {
    let open_err = |message: String| SourceError::Open { path: path.to_owned(), message };
    // libhdf5's default chunk cache is 1 MiB per dataset: reads of rows from a
    // few different chunks in turn (parallel fills) would decompress whole
    // chunks again for every row on the libhdf5 path. 16 MiB per dataset.
    let h5 = hdf5::File::with_options()
        .with_fapl(|fapl| fapl.chunk_cache(4093, 16 << 20, 0.75))
        .open(path)
        .map_err(|e| open_err(e.to_string()))?;
    let raw = File::open(path).map_err(|e| open_err(e.to_string()))?;
    let mut specs = Vec::with_capacity(spec.fields.len());
    let mut readers = Vec::with_capacity(spec.fields.len());
    // (length, field name) of the first field along axis 0, and along axis 1 for windowed fields.
    let mut items: Option<(u64, &str)> = None;
    let mut steps: Option<(u64, &str)> = None;
    for ((name, h5path), &is_windowed) in spec.fields.iter().zip(windowed) {
        let field_err = |message: String| SourceError::Inconsistent {
            path: path.to_owned(),
            field: name.clone(),
            h5path: h5path.clone(),
            message,
        };
        let dataset = h5.dataset(h5path).map_err(|_| SourceError::MissingField {
            path: path.to_owned(),
            field: name.clone(),
            h5path: h5path.clone(),
        })?;
        let shape: Vec<u64> = dataset.shape().iter().map(|&d| d as u64).collect();
        let Some((&len, rest)) = shape.split_first() else {
            return Err(field_err("is a scalar; a field needs a first axis to index samples by".into()));
        };
        match items {
            None => items = Some((len, name)),
            Some((first_len, first_name)) if first_len != len => {
                return Err(field_err(format!(
                    "has {len} items along the first axis but field {first_name:?} has {first_len}; \
                     all fields of a dataset must have the same length in each file"
                )));
            }
            Some(_) => {}
        }
        let sample_shape = if is_windowed {
            let window = spec.window.expect("windowed fields exist only with a window");
            let Some((&time, trailing)) = rest.split_first() else {
                return Err(field_err(format!(
                    "has shape {shape:?}; a windowed field needs a time axis (axis 1); list it in per_item \
                     to deliver it whole per item"
                )));
            };
            match steps {
                None => steps = Some((time, name)),
                Some((first_time, first_name)) if first_time != time => {
                    return Err(field_err(format!(
                        "has {time} steps along axis 1 but windowed field {first_name:?} has {first_time}"
                    )));
                }
                Some(_) => {}
            }
            std::iter::once(window.size).chain(trailing.iter().copied()).collect()
        } else {
            rest.to_vec()
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
        let mem_type = hdf5::Datatype::from_descriptor(&descriptor).map_err(|e| field_err(e.to_string()))?;
        let reader = FieldReader::new(dataset, dtype, &file_type, mem_type, cache.new_id(), spec.fast_path)
            .map_err(field_err)?;
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
    let windows = match (spec.window, steps) {
        (Some(w), Some((time, _))) if time >= w.size => (time - w.size) / w.stride + 1,
        (Some(_), _) => 0,
        (None, _) => 1,
    };
    let samples = items.checked_mul(windows).ok_or_else(|| {
        SourceError::Limit(format!(
            "{}: {items} items × {windows} windows per item is more than 2^64 samples; check the file's shapes",
            path.display()
        ))
    })?;
    let file = Hdf5File { path: path.to_owned(), _h5: h5, raw, fields: readers, windows: windows.max(1) };
    Ok((file, specs, samples))
}

/// Maps an HDF5 file type to the dtype served, or describes what it is.
pub(crate) fn classify(file_type: &hdf5::Datatype) -> Result<(DType, TypeDescriptor), String> {
    let descriptor = file_type.to_descriptor().map_err(|e| format!("unsupported ({e})"))?;
    let dtype = match &descriptor {
        TypeDescriptor::Boolean => DType::Bool,
        TypeDescriptor::Integer(size) => match size {
            IntSize::U1 => DType::I8,
            IntSize::U2 => DType::I16,
            IntSize::U4 => DType::I32,
            IntSize::U8 => DType::I64,
        },
        TypeDescriptor::Unsigned(size) => match size {
            IntSize::U1 => DType::U8,
            IntSize::U2 => DType::U16,
            IntSize::U4 => DType::U32,
            IntSize::U8 => DType::U64,
        },
        TypeDescriptor::Float(size) => match size {
            FloatSize::U2 => DType::F16,
            FloatSize::U4 => DType::F32,
            FloatSize::U8 => DType::F64,
        },
        other => return Err(describe(other)),
    };
    Ok((dtype, descriptor))
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

//! HDF5 source: a sorted glob of files, each field an HDF5 dataset path,
//! sample `i` the `i`-th row along the first axis of the concatenated files.
//!
//! Files are opened once and stay open. Metadata (shape, dtype, layout) is read
//! through libhdf5 at open. Rows of contiguous datasets are read with `pread`
//! from the dataset's file offset, outside HDF5's global lock, and byte-swapped
//! in place when the file is big-endian; everything else (chunked, compact)
//! goes through `H5Dread` with a hyperslab, under the lock, straight into the
//! destination memory.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use hdf5::datatype::ByteOrder;
use hdf5::types::{FloatSize, IntSize, TypeDescriptor};
use stoker_proto::DType;

use super::{FieldSpec, SampleRef, Source, SourceError};

/// How one field of one file is read.
#[derive(Debug)]
struct FieldReader {
    dataset: hdf5::Dataset,
    /// In-memory type for `H5Dread` (native byte order).
    mem_type: hdf5::Datatype,
    /// File offset of row 0 when the dataset is contiguous and allocated.
    contiguous_at: Option<u64>,
    /// The file stores the field big-endian: swap after a raw read.
    swap: bool,
}

#[derive(Debug)]
struct Hdf5File {
    path: PathBuf,
    /// Keeps the HDF5 file open for the datasets' lifetime.
    _h5: hdf5::File,
    raw: File,
    fields: Vec<FieldReader>,
}

/// An open HDF5 dataset.
#[derive(Debug)]
pub struct Hdf5Source {
    pattern: String,
    fields: Vec<FieldSpec>,
    files: Vec<Hdf5File>,
    /// `starts[k]` is the global index of file k's row 0; one extra entry holds the total.
    starts: Vec<u64>,
}

impl Hdf5Source {
    /// Opens every file matching `pattern` (sorted) with `fields` as `(name, h5path)`.
    ///
    /// `allowed_roots`, when given, must contain every matched file.
    pub fn open(
        pattern: &str,
        fields: &[(String, String)],
        allowed_roots: Option<&[PathBuf]>,
    ) -> Result<Hdf5Source, SourceError> {
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
        let mut files = Vec::with_capacity(paths.len());
        let mut starts = vec![0u64];
        for path in paths {
            let (file, file_specs, rows) = open_file(&path, fields)?;
            match &specs {
                None => specs = Some(file_specs),
                Some(first) => check_same_fields(&path, first, &file_specs, &files)?,
            }
            starts.push(starts.last().expect("starts is never empty") + rows);
            files.push(file);
        }
        let specs = specs.expect("at least one file");
        if *starts.last().expect("starts is never empty") == 0 {
            return Err(SourceError::Empty { pattern: pattern.to_string() });
        }
        Ok(Hdf5Source { pattern: pattern.to_string(), fields: specs, files, starts })
    }

    /// The glob the dataset was opened with.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Writes field `field` of sample `index` into `dst` (exactly one sample's bytes).
    fn read(&self, field: usize, index: u64, dst: &mut [u8]) -> Result<(), SourceError> {
        let file_idx = self.starts.partition_point(|&s| s <= index) - 1;
        let file = &self.files[file_idx];
        let row = index - self.starts[file_idx];
        let spec = &self.fields[field];
        let reader = &file.fields[field];
        debug_assert_eq!(dst.len(), spec.sample_bytes());
        let err = |message: String| SourceError::Read {
            path: file.path.clone(),
            field: spec.name.clone(),
            h5path: spec.origin.clone(),
            index,
            row,
            message,
        };
        match reader.contiguous_at {
            Some(offset) => {
                let at = offset + row * dst.len() as u64;
                file.raw
                    .read_exact_at(dst, at)
                    .map_err(|e| err(format!("read of {} bytes at offset {at}: {e}", dst.len())))?;
                if reader.swap {
                    swap_in_place(dst, spec.dtype.size());
                }
                Ok(())
            }
            None => read_hyperslab(reader, &spec.shape, row, dst).map_err(err),
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

    fn read_sample(&self, sample: SampleRef, out: &mut [&mut [u8]]) -> Result<(), SourceError> {
        for (field, dst) in out.iter_mut().enumerate() {
            self.read(field, sample.index, dst)?;
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

fn open_file(path: &Path, fields: &[(String, String)]) -> Result<(Hdf5File, Vec<FieldSpec>, u64), SourceError> {
    let open_err = |message: String| SourceError::Open { path: path.to_owned(), message };
    let h5 = hdf5::File::open(path).map_err(|e| open_err(e.to_string()))?;
    let raw = File::open(path).map_err(|e| open_err(e.to_string()))?;
    let mut specs = Vec::with_capacity(fields.len());
    let mut readers = Vec::with_capacity(fields.len());
    let mut rows: Option<(u64, &str)> = None;
    for (name, h5path) in fields {
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
        let Some((&len, sample_shape)) = shape.split_first() else {
            return Err(field_err("is a scalar; a field needs a first axis to index samples by".into()));
        };
        match rows {
            None => rows = Some((len, name)),
            Some((first_len, first_name)) if first_len != len => {
                return Err(field_err(format!(
                    "has {len} samples along the first axis but field {first_name:?} has {first_len}; \
                     all fields of a dataset must have the same length in each file"
                )));
            }
            Some(_) => {}
        }
        let file_type = dataset.dtype().map_err(|e| field_err(e.to_string()))?;
        let (dtype, descriptor) = classify(&file_type).map_err(|found| SourceError::Dtype {
            path: path.to_owned(),
            field: name.clone(),
            h5path: h5path.clone(),
            found,
        })?;
        let mem_type = hdf5::Datatype::from_descriptor(&descriptor).map_err(|e| field_err(e.to_string()))?;
        let swap = file_type.byte_order() == ByteOrder::BigEndian && cfg!(target_endian = "little");
        let plain =
            dtype != DType::Bool && matches!(file_type.byte_order(), ByteOrder::LittleEndian | ByteOrder::BigEndian);
        let contiguous_at =
            (plain && dataset.layout() == hdf5::dataset::Layout::Contiguous).then(|| dataset.offset()).flatten();
        if contiguous_at.is_none() {
            tracing::debug!(file = %path.display(), field = %name, layout = ?dataset.layout(), "reading through libhdf5");
        }
        specs.push(FieldSpec { name: name.clone(), origin: h5path.clone(), dtype, shape: sample_shape.to_vec() });
        readers.push(FieldReader { dataset, mem_type, contiguous_at, swap });
    }
    let rows = rows.map_or(0, |(len, _)| len);
    Ok((Hdf5File { path: path.to_owned(), _h5: h5, raw, fields: readers }, specs, rows))
}

/// Maps an HDF5 file type to the dtype served, or describes what it is.
fn classify(file_type: &hdf5::Datatype) -> Result<(DType, TypeDescriptor), String> {
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
    earlier: &[Hdf5File],
) -> Result<(), SourceError> {
    let first_path = &earlier.first().expect("checked after the first file").path;
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

fn swap_in_place(bytes: &mut [u8], size: usize) {
    if size > 1 {
        for element in bytes.chunks_exact_mut(size) {
            element.reverse();
        }
    }
}

/// Reads one row through libhdf5 into `dst`, converting to the native type.
fn read_hyperslab(reader: &FieldReader, sample_shape: &[u64], row: u64, dst: &mut [u8]) -> Result<(), String> {
    use hdf5_sys::h5d::{H5Dget_space, H5Dread};
    use hdf5_sys::h5p::H5P_DEFAULT;
    use hdf5_sys::h5s::{H5S_seloper_t, H5Sclose, H5Screate_simple, H5Sselect_hyperslab};

    let mut start = vec![row];
    start.extend(sample_shape.iter().map(|_| 0u64));
    let mut count = vec![1u64];
    count.extend_from_slice(sample_shape);
    let elements: u64 = count.iter().product();
    let mem_dims = [elements];
    hdf5::sync::sync(|| {
        // SAFETY: every id passed is valid: the dataset and type are kept open
        // by `reader`, the spaces are created and closed here; `start`/`count`
        // have one entry per dataset dimension; `dst` holds exactly `elements`
        // values of `mem_type` (checked by the caller's sample_bytes); all of
        // it runs under hdf5-metno's global lock, as libhdf5 requires.
        unsafe {
            let file_space = H5Dget_space(reader.dataset.id());
            if file_space < 0 {
                return Err("H5Dget_space failed".to_string());
            }
            let mem_space = H5Screate_simple(1, mem_dims.as_ptr(), std::ptr::null());
            let mut status = H5Sselect_hyperslab(
                file_space,
                H5S_seloper_t::H5S_SELECT_SET,
                start.as_ptr(),
                std::ptr::null(),
                count.as_ptr(),
                std::ptr::null(),
            );
            if status >= 0 && mem_space >= 0 {
                status = H5Dread(
                    reader.dataset.id(),
                    reader.mem_type.id(),
                    mem_space,
                    file_space,
                    H5P_DEFAULT,
                    dst.as_mut_ptr().cast(),
                );
            }
            if mem_space >= 0 {
                H5Sclose(mem_space);
            }
            H5Sclose(file_space);
            if status < 0 || mem_space < 0 {
                return Err("H5Dread failed (corrupt chunk or unavailable filter?)".to_string());
            }
            Ok(())
        }
    })
}

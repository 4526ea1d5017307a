//! HDF5 datatypes as stoker dtypes, described for messages, and the check that
//! every file of a dataset declares the same fields.

use std::path::Path;

use hdf5::types::{FloatSize, IntSize, TypeDescriptor};
use stoker_proto::DType;

use crate::source::{FieldSpec, SourceError};

use super::*;

pub(super) fn signed(size: IntSize) -> DType {
    match size {
        IntSize::U1 => DType::I8,
        IntSize::U2 => DType::I16,
        IntSize::U4 => DType::I32,
        IntSize::U8 => DType::I64,
    }
}

pub(super) fn unsigned(size: IntSize) -> DType {
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

pub(super) fn describe(td: &TypeDescriptor) -> String {
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

pub(super) fn check_same_fields(
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

/// An HDF5 type stoker does not serve, as messages describe it (after "has dtype").
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unservable {
    /// A bitfield of a size (in bytes) no integer type has.
    #[error("{0}-byte bitfield")]
    Bitfield(usize),
    /// A type the `hdf5` crate cannot describe.
    #[error("unsupported ({0})")]
    Unsupported(hdf5::Error),
    /// A type that is not numeric: strings, compounds, arrays, ...
    #[error("{}", describe(.0))]
    NotNumeric(TypeDescriptor),
}

/// Maps an HDF5 file type to the dtype served, or says what it is.
///
/// Enums are served as their base integer type and bitfields (PyTables'
/// bool arrays) as unsigned integers of their size, as h5py reads both.
pub(crate) fn classify(file_type: &hdf5::Datatype) -> Result<(DType, TypeDescriptor), Unservable> {
    if let Some(size) = field::bitfield_size(file_type) {
        let size = IntSize::from_int(size).ok_or(Unservable::Bitfield(size))?;
        return Ok((unsigned(size), TypeDescriptor::Unsigned(size)));
    }
    let descriptor = file_type.to_descriptor().map_err(Unservable::Unsupported)?;
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
        other => return Err(Unservable::NotNumeric(other.clone())),
    };
    Ok((dtype, descriptor))
}

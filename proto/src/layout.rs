//! Where a batch's fields lie inside a ring slot.
//!
//! A stream's shared memory is one sealed memfd: a [`RING_HEADER_BYTES`]
//! header page (magic, layout version, depth, slot size; see
//! [`BatchLayout::header_bytes`]) followed by `depth` slots of
//! [`BatchLayout::slot_bytes`] each. Inside a slot the layout is field-major:
//! each field is one C-contiguous `[batch_size, *shape]` array starting at a
//! [`FIELD_ALIGN`]-aligned offset, so it becomes a numpy array without a copy.
//!
//! A *ragged* field (samples of varying shape, e.g. decoded images of
//! different sizes) instead holds, at its offset, a table of `batch_size ×
//! ndim` native-endian `u64` per-row shapes, then (at [`Ragged::data_offset`])
//! one [`Ragged::row_stride`]-byte region per row whose first
//! `prod(shape) · dtype.size()` bytes are the row's C-contiguous values.

use serde::{Deserialize, Serialize};

/// First eight bytes of every ring segment (`b"STOKRING"`, little-endian).
pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"STOKRING");
/// Version of the segment layout described here.
pub const RING_LAYOUT_VERSION: u32 = 1;
/// Bytes before slot 0: one page holding the segment header.
pub const RING_HEADER_BYTES: u64 = 4096;
/// Alignment of every field inside a slot (a cache line; what SIMD loads like).
pub const FIELD_ALIGN: u64 = 64;
/// Alignment of slot starts (a page, so slots can be registered and advised separately).
pub const SLOT_ALIGN: u64 = 4096;

/// Element type of a field, always delivered in the host's native byte order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// One byte, 0 or 1.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE 754 half precision.
    F16,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// numpy's name for this type (`np.dtype(name)` gives the native-endian dtype).
    pub fn numpy_name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.numpy_name())
    }
}

/// One field of a batch: a `[batch_size, *shape]` array inside the slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldLayout {
    /// Field name, as the client asked for it.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape of one sample of this field (without the batch axis); for a
    /// ragged field, 0 marks a dimension that varies from sample to sample.
    pub shape: Vec<u64>,
    /// Byte offset of the field's first sample (ragged: of its shape table) from the start of the slot.
    pub offset: u64,
    /// Where a ragged field's rows lie; `None` for fixed-shape fields.
    pub ragged: Option<Ragged>,
}

/// Placement of a ragged field's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ragged {
    /// Byte offset of row 0's values from the start of the slot.
    pub data_offset: u64,
    /// Bytes reserved per row (a multiple of [`FIELD_ALIGN`]).
    pub row_stride: u64,
}

/// A field to lay out: name, dtype, sample shape, and for a ragged field the
/// most bytes one sample may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldDecl {
    /// Field name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Sample shape (0 for dimensions that vary, when ragged).
    pub shape: Vec<u64>,
    /// `Some(max bytes per sample)` makes the field ragged.
    pub max_sample_bytes: Option<u64>,
}

impl FieldLayout {
    /// Bytes one row of this field occupies in the slot: the sample size, or a
    /// ragged field's per-row capacity.
    pub fn sample_bytes(&self) -> u64 {
        match self.ragged {
            Some(r) => r.row_stride,
            None => self.shape.iter().product::<u64>() * self.dtype.size() as u64,
        }
    }

    /// Bytes of a ragged field's shape table for `batch_size` rows.
    pub fn shape_table_bytes(&self, batch_size: u64) -> u64 {
        if self.ragged.is_some() { batch_size * self.shape.len() as u64 * 8 } else { 0 }
    }
}

/// The layout shared by every slot of one stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchLayout {
    /// Rows a slot has room for.
    pub batch_size: u64,
    /// Bytes per slot (a multiple of [`SLOT_ALIGN`]).
    pub slot_bytes: u64,
    /// Fields in the order the client declared them.
    pub fields: Vec<FieldLayout>,
}

impl BatchLayout {
    /// Lays out `fields` field-major for `batch_size` rows.
    pub fn new(batch_size: u64, fields: impl IntoIterator<Item = FieldDecl>) -> Self {
        let mut offset = 0u64;
        let fields = fields
            .into_iter()
            .map(|decl| {
                let ragged = decl.max_sample_bytes.map(|max| {
                    let table = batch_size * decl.shape.len() as u64 * 8;
                    Ragged {
                        data_offset: (offset + table).next_multiple_of(FIELD_ALIGN),
                        row_stride: max.max(1).next_multiple_of(FIELD_ALIGN),
                    }
                });
                let field = FieldLayout { name: decl.name, dtype: decl.dtype, shape: decl.shape, offset, ragged };
                let end = match ragged {
                    Some(r) => r.data_offset + r.row_stride * batch_size,
                    None => offset + field.sample_bytes() * batch_size,
                };
                offset = end.next_multiple_of(FIELD_ALIGN);
                field
            })
            .collect();
        BatchLayout { batch_size, slot_bytes: offset.max(1).next_multiple_of(SLOT_ALIGN), fields }
    }

    /// Bytes of the segment header in front of slot 0.
    pub fn header_bytes(&self) -> u64 {
        RING_HEADER_BYTES
    }

    /// Byte offset of `slot` from the start of the segment.
    pub fn slot_offset(&self, slot: u32) -> u64 {
        RING_HEADER_BYTES + u64::from(slot) * self.slot_bytes
    }

    /// Total segment size for a ring of `depth` slots.
    pub fn ring_bytes(&self, depth: u32) -> u64 {
        RING_HEADER_BYTES + u64::from(depth) * self.slot_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_aligned_and_disjoint() {
        let decl = |name: &str, dtype, shape: Vec<u64>, max| FieldDecl {
            name: name.into(),
            dtype,
            shape,
            max_sample_bytes: max,
        };
        let layout = BatchLayout::new(
            3,
            [
                decl("a", DType::U8, vec![5], None),
                decl("b", DType::F64, vec![2, 2], None),
                decl("img", DType::U8, vec![0, 0, 3], Some(1000)),
                decl("c", DType::Bool, vec![], None),
            ],
        );
        let mut end = 0;
        for f in &layout.fields {
            assert_eq!(f.offset % FIELD_ALIGN, 0);
            assert!(f.offset >= end);
            end = match f.ragged {
                Some(r) => {
                    assert!(r.data_offset >= f.offset + f.shape_table_bytes(3));
                    assert_eq!((r.data_offset % FIELD_ALIGN, r.row_stride), (0, 1024));
                    r.data_offset + r.row_stride * 3
                }
                None => f.offset + f.sample_bytes() * 3,
            };
        }
        assert!(end <= layout.slot_bytes);
        assert_eq!(layout.slot_bytes % SLOT_ALIGN, 0);
        assert_eq!(layout.slot_offset(2), RING_HEADER_BYTES + 2 * layout.slot_bytes);
    }
}

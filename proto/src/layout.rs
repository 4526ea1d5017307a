//! Where a batch's fields lie inside a ring slot.
//!
//! A stream's shared memory is one sealed memfd: a [`RING_HEADER_BYTES`]
//! header page (magic, layout version, depth, slot size; see
//! [`BatchLayout::header_bytes`]) followed by `depth` slots of
//! [`BatchLayout::slot_bytes`] each. Inside a slot the layout is field-major:
//! each field is one C-contiguous `[batch_size, *shape]` array starting at a
//! [`FIELD_ALIGN`]-aligned offset, so it becomes a numpy array without a copy.

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
    /// Shape of one sample of this field (without the batch axis).
    pub shape: Vec<u64>,
    /// Byte offset of the field's first sample from the start of the slot.
    pub offset: u64,
}

impl FieldLayout {
    /// Bytes of one sample of this field.
    pub fn sample_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size() as u64
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
    /// Lays out `fields` (name, dtype, sample shape) field-major for `batch_size` rows.
    pub fn new(batch_size: u64, fields: impl IntoIterator<Item = (String, DType, Vec<u64>)>) -> Self {
        let mut offset = 0u64;
        let fields = fields
            .into_iter()
            .map(|(name, dtype, shape)| {
                let field = FieldLayout { name, dtype, shape, offset };
                offset = (offset + field.sample_bytes() * batch_size).next_multiple_of(FIELD_ALIGN);
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
        let layout = BatchLayout::new(
            3,
            [
                ("a".to_string(), DType::U8, vec![5]),
                ("b".to_string(), DType::F64, vec![2, 2]),
                ("c".to_string(), DType::Bool, vec![]),
            ],
        );
        let mut end = 0;
        for f in &layout.fields {
            assert_eq!(f.offset % FIELD_ALIGN, 0);
            assert!(f.offset >= end);
            end = f.offset + f.sample_bytes() * 3;
        }
        assert!(end <= layout.slot_bytes);
        assert_eq!(layout.slot_bytes % SLOT_ALIGN, 0);
        assert_eq!(layout.slot_offset(2), RING_HEADER_BYTES + 2 * layout.slot_bytes);
    }
}

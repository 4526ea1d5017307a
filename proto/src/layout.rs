//! Where a batch's fields lie inside a ring slot.
//!
//! A stream's shared memory is one sealed memfd: a [`RING_HEADER_BYTES`]
//! header page (a [`RingHeader`]: magic, layout version, depth, slot size;
//! the rest of the page is zero) followed by `depth` slots of
//! [`BatchLayout::slot_bytes`] each. Inside a slot the layout is field-major:
//! each field is one C-contiguous `[batch_size, *shape]` array starting at a
//! [`FIELD_ALIGN`]-aligned offset, so it becomes a numpy array without a copy.
//!
//! A *ragged* field (samples of varying shape, e.g. decoded images of
//! different sizes) instead holds, at its offset, a table of `batch_size ×
//! ndim` native-endian `u64` per-row shapes, then (at [`Ragged::data_offset`])
//! one [`Ragged::row_stride`]-byte region per row whose first
//! `prod(shape) · dtype.size()` bytes are the row's C-contiguous values.
//!
//! Every size here comes from a client or a file, so all of it is checked
//! arithmetic ([`BatchLayout::new`] fails with a [`LayoutError`] rather than
//! overflow), and clippy's `arithmetic_side_effects` keeps it that way.
#![deny(clippy::arithmetic_side_effects)]

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

/// The header at the start of every ring segment, the one description of its
/// bytes: the daemon writes [`RingHeader::to_bytes`] at offset 0, the client
/// reads [`RingHeader::from_bytes`] and checks it with [`RingHeader::check`].
/// The fields lie at this type's `#[repr(C)]` offsets (pinned by the
/// assertions below), each stored little-endian; the rest of the
/// [`RING_HEADER_BYTES`] page is zero. Any change to it bumps
/// [`RING_LAYOUT_VERSION`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingHeader {
    /// [`RING_MAGIC`].
    pub magic: u64,
    /// [`RING_LAYOUT_VERSION`].
    pub version: u32,
    /// Slots in the segment (1 for an extra segment).
    pub depth: u32,
    /// Bytes per slot ([`BatchLayout::slot_bytes`]).
    pub slot_bytes: u64,
}

// The segment layout of version 1 (`docs/protocol.md`): any change here is a
// new RING_LAYOUT_VERSION.
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(RING_LAYOUT_VERSION == 1);
    assert!(offset_of!(RingHeader, magic) == 0);
    assert!(offset_of!(RingHeader, version) == 8);
    assert!(offset_of!(RingHeader, depth) == 12);
    assert!(offset_of!(RingHeader, slot_bytes) == 16);
    assert!(size_of::<RingHeader>() == 24, "no padding, nothing else");
    assert!(align_of::<RingHeader>() == 8);
    assert!(RingHeader::BYTES as u64 <= RING_HEADER_BYTES);
    assert!(RING_HEADER_BYTES.is_multiple_of(SLOT_ALIGN), "slot 0 starts aligned");
};

impl RingHeader {
    /// Bytes of the header proper at the start of the header page.
    pub const BYTES: usize = std::mem::size_of::<RingHeader>();

    /// The header of a segment of `depth` slots of `layout`.
    pub fn new(layout: &BatchLayout, depth: u32) -> RingHeader {
        RingHeader { magic: RING_MAGIC, version: RING_LAYOUT_VERSION, depth, slot_bytes: layout.slot_bytes }
    }

    /// The header as stored at the start of the segment.
    pub fn to_bytes(self) -> [u8; RingHeader::BYTES] {
        let RingHeader { magic, version, depth, slot_bytes } = self;
        let mut out = [0u8; RingHeader::BYTES];
        put(&mut out, std::mem::offset_of!(RingHeader, magic), magic.to_le_bytes());
        put(&mut out, std::mem::offset_of!(RingHeader, version), version.to_le_bytes());
        put(&mut out, std::mem::offset_of!(RingHeader, depth), depth.to_le_bytes());
        put(&mut out, std::mem::offset_of!(RingHeader, slot_bytes), slot_bytes.to_le_bytes());
        out
    }

    /// Reads a header from the first [`RingHeader::BYTES`] bytes of a segment
    /// (any bytes are some header; [`RingHeader::check`] says whether it is
    /// the expected one).
    pub fn from_bytes(bytes: &[u8; RingHeader::BYTES]) -> RingHeader {
        RingHeader {
            magic: u64::from_le_bytes(get(bytes, std::mem::offset_of!(RingHeader, magic))),
            version: u32::from_le_bytes(get(bytes, std::mem::offset_of!(RingHeader, version))),
            depth: u32::from_le_bytes(get(bytes, std::mem::offset_of!(RingHeader, depth))),
            slot_bytes: u64::from_le_bytes(get(bytes, std::mem::offset_of!(RingHeader, slot_bytes))),
        }
    }

    /// Checks a header read from a segment: this build's magic and layout
    /// version, and the `depth` and slot size the stream was opened with.
    pub fn check(&self, layout: &BatchLayout, depth: u32) -> Result<(), RingError> {
        if self.magic != RING_MAGIC {
            return Err(RingError::Magic { found: self.magic });
        }
        if self.version != RING_LAYOUT_VERSION {
            return Err(RingError::Version { found: self.version });
        }
        let want = RingHeader::new(layout, depth);
        if (self.depth, self.slot_bytes) != (want.depth, want.slot_bytes) {
            return Err(RingError::Geometry {
                depth: self.depth,
                slot_bytes: self.slot_bytes,
                want_depth: want.depth,
                want_slot_bytes: want.slot_bytes,
            });
        }
        Ok(())
    }
}

/// Writes `value` at `at` (inside the header: the assertions above).
fn put<const N: usize>(out: &mut [u8; RingHeader::BYTES], at: usize, value: [u8; N]) {
    out[at..][..N].copy_from_slice(&value);
}

/// The `N` bytes at `at` (inside the header: the assertions above).
fn get<const N: usize>(bytes: &[u8; RingHeader::BYTES], at: usize) -> [u8; N] {
    *bytes[at..].first_chunk().expect("a header field lies inside the header")
}

/// A ring segment that is not the one a stream's reply describes: another
/// build's (or no) ring, or a layout whose fields do not fit its slots.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The segment does not start with [`RING_MAGIC`].
    #[error(
        "the shared-memory segment is not a stoker ring (magic {found:#018x}, expected {RING_MAGIC:#018x}, \
         \"STOKRING\"); client and daemon versions differ, or the daemon is not stoker's"
    )]
    Magic {
        /// The first eight bytes, little-endian.
        found: u64,
    },
    /// The segment has another [`RING_LAYOUT_VERSION`].
    #[error(
        "the shared-memory ring has layout version {found}, this client reads version {RING_LAYOUT_VERSION} \
         (client and daemon versions differ)"
    )]
    Version {
        /// The version found.
        found: u32,
    },
    /// The header's depth or slot size is not the stream's.
    #[error(
        "the shared-memory ring holds {depth} slots of {slot_bytes} bytes, the stream was opened with \
         {want_depth} slots of {want_slot_bytes} bytes"
    )]
    Geometry {
        /// Slots, by the header.
        depth: u32,
        /// Slot size, by the header.
        slot_bytes: u64,
        /// Slots, by the stream's reply.
        want_depth: u32,
        /// Slot size, by the stream's layout.
        want_slot_bytes: u64,
    },
    /// The segment is shorter than the header page and its slots.
    #[error(
        "the shared-memory ring is {len} bytes; its header page and {depth} slots of {slot_bytes} bytes need {}",
        show_size(*need, "")
    )]
    TooShort {
        /// Bytes of the segment.
        len: u64,
        /// Slots expected.
        depth: u32,
        /// Bytes per slot.
        slot_bytes: u64,
        /// Bytes needed (`None`: more than 64 bits hold).
        need: Option<u64>,
    },
    /// The layout is not one [`BatchLayout::new`] makes: a field lies
    /// (partly) outside its slot or is misaligned.
    #[error("the stream's layout {problem} (client and daemon versions differ, or the daemon is not stoker's)")]
    Layout {
        /// What is wrong, naming the field.
        problem: String,
    },
}

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
    /// Every element type.
    pub const ALL: [DType; 12] = [
        DType::Bool,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::F32,
        DType::F64,
    ];

    /// The one table of numpy spellings and sizes: numpy's name, numpy's type
    /// code (`dtype.str` without its byte-order character: kind, then bytes)
    /// and the bytes per element. Every other spelling derives from it.
    const fn numpy(self) -> (&'static str, &'static str, usize) {
        match self {
            DType::Bool => ("bool", "b1", 1),
            DType::U8 => ("uint8", "u1", 1),
            DType::U16 => ("uint16", "u2", 2),
            DType::U32 => ("uint32", "u4", 4),
            DType::U64 => ("uint64", "u8", 8),
            DType::I8 => ("int8", "i1", 1),
            DType::I16 => ("int16", "i2", 2),
            DType::I32 => ("int32", "i4", 4),
            DType::I64 => ("int64", "i8", 8),
            DType::F16 => ("float16", "f2", 2),
            DType::F32 => ("float32", "f4", 4),
            DType::F64 => ("float64", "f8", 8),
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        self.numpy().2
    }

    /// numpy's name for this type (`np.dtype(name)` gives the native-endian dtype).
    pub const fn numpy_name(self) -> &'static str {
        self.numpy().0
    }

    /// numpy's type code without byte order (`"f4"`, `"u1"`, `"b1"`): what
    /// follows `<`, `>`, `=` or `|` in `dtype.str` and the array interface's `typestr`.
    pub const fn type_code(self) -> &'static str {
        self.numpy().1
    }

    /// numpy's `dtype.kind`: `'b'` (bool), `'u'`, `'i'` or `'f'`.
    pub const fn numpy_kind(self) -> char {
        self.type_code().as_bytes()[0] as char
    }

    /// The type numpy calls `name` (`"float32"`), if stoker serves it.
    pub fn from_numpy_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.numpy_name() == name)
    }

    /// The type of a type code without byte order (`"f4"`; `"?"` is numpy's
    /// character for bool), if stoker serves it.
    pub fn from_type_code(code: &str) -> Option<DType> {
        if code == "?" {
            return Some(DType::Bool);
        }
        DType::ALL.into_iter().find(|d| d.type_code() == code)
    }

    /// The type written either way (`"float32"` or `"f4"`), if stoker serves it.
    pub fn from_numpy(s: &str) -> Option<DType> {
        DType::from_numpy_name(s).or_else(|| DType::from_type_code(s))
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
    /// ragged field's per-row capacity. (Saturates instead of overflowing: a
    /// layout made by [`BatchLayout::new`] never comes near; one read off the
    /// wire then fails the size checks against the mapping.)
    pub fn sample_bytes(&self) -> u64 {
        match self.ragged {
            Some(r) => r.row_stride,
            None => fixed_sample_bytes(self.dtype, &self.shape).unwrap_or(u64::MAX),
        }
    }

    /// Bytes of a ragged field's shape table for `batch_size` rows.
    pub fn shape_table_bytes(&self, batch_size: u64) -> u64 {
        if self.ragged.is_some() { shape_table_bytes(batch_size, self.shape.len()).unwrap_or(u64::MAX) } else { 0 }
    }
}

/// Bytes of one fixed-shape sample, `None` when that overflows `u64`.
fn fixed_sample_bytes(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
}

/// Bytes of a ragged field's table of per-row shapes.
fn shape_table_bytes(batch_size: u64, ndim: usize) -> Option<u64> {
    batch_size.checked_mul(ndim as u64)?.checked_mul(8)
}

/// Ceilings a layout must stay under: the daemon's `[limits]
/// max_sample_bytes` and `max_batch_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutLimits {
    /// Most bytes one row of one field may take (a ragged field's reserved room included).
    pub max_sample_bytes: u64,
    /// Most bytes one slot (a whole batch) may take.
    pub max_batch_bytes: u64,
}

impl LayoutLimits {
    /// The defaults of the daemon's config.
    pub const DEFAULT: LayoutLimits =
        LayoutLimits { max_sample_bytes: DEFAULT_MAX_SAMPLE_BYTES, max_batch_bytes: DEFAULT_MAX_BATCH_BYTES };
}

/// Default of `[limits] max_sample_bytes`: 1 GiB per sample of one field.
pub const DEFAULT_MAX_SAMPLE_BYTES: u64 = 1 << 30;
/// Default of `[limits] max_batch_bytes`: 4 GiB per batch (one ring slot).
pub const DEFAULT_MAX_BATCH_BYTES: u64 = 4 << 30;

/// A batch that cannot be laid out within the limits (or within 64 bits).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// One row of a field is larger than `[limits] max_sample_bytes`.
    #[error(
        "field {field:?}: {what} {size}, more than [limits] max_sample_bytes = {limit} bytes; {hint}",
        what = if *ragged { "the room reserved per sample (the field's max_sample_bytes) is" }
               else { "one sample of this shape is" },
        size = show_size(*bytes, &format!(" ({dtype} {shape:?})")),
        hint = if *ragged { "lower the field's max_sample_bytes, or ask the daemon's admin to raise the limit" }
               else { "crop or resize the field, or ask the daemon's admin to raise the limit" }
    )]
    SampleTooLarge {
        /// Field name.
        field: String,
        /// Element type.
        dtype: DType,
        /// Sample shape (0 marks a varying dimension of a ragged field).
        shape: Vec<u64>,
        /// Whether the size is a ragged field's reserved room.
        ragged: bool,
        /// Bytes of one row; `None` when that does not even fit in 64 bits.
        bytes: Option<u64>,
        /// The limit in force.
        limit: u64,
    },
    /// One slot (a whole batch) is larger than `[limits] max_batch_bytes`.
    #[error(
        "a batch of {batch_size} rows takes {size}, more than [limits] max_batch_bytes = {limit} bytes; {hint}",
        size = show_size(*bytes, ""),
        hint = if *fits > 0 {
            format!("use batch_size {fits} or less")
        } else {
            "even one row does not fit: crop the fields, or ask the daemon's admin to raise the limit".to_string()
        }
    )]
    BatchTooLarge {
        /// Rows asked for.
        batch_size: u64,
        /// Bytes of the slot; `None` when that does not fit in 64 bits.
        bytes: Option<u64>,
        /// The largest batch size that fits (0: none).
        fits: u64,
        /// The limit in force.
        limit: u64,
    },
}

/// `N bytes (≈ X GiB)`, or "more than 2^64 bytes" when it overflowed.
fn show_size(bytes: Option<u64>, what: &str) -> String {
    match bytes {
        None => format!("more than 2^64 bytes{what}"),
        Some(b) if b >= 1 << 30 => format!("{b} bytes{what}, about {:.1} GiB", b as f64 / (1u64 << 30) as f64),
        Some(b) => format!("{b} bytes{what}"),
    }
}

/// Places `decls` (whose row sizes are `rows`) field-major for `batch_size`
/// rows: the slot size and the fields, or `None` when a size overflows `u64`.
fn place(batch_size: u64, decls: &[FieldDecl], rows: &[u64]) -> Option<(u64, Vec<FieldLayout>)> {
    let mut offset = 0u64;
    let mut fields = Vec::with_capacity(decls.len());
    for (decl, &row) in decls.iter().zip(rows) {
        let field_offset = offset;
        let ragged = match decl.max_sample_bytes {
            None => None,
            Some(_) => {
                let table = shape_table_bytes(batch_size, decl.shape.len())?;
                Some(Ragged {
                    data_offset: offset.checked_add(table)?.checked_next_multiple_of(FIELD_ALIGN)?,
                    row_stride: row,
                })
            }
        };
        let start = ragged.map_or(offset, |r| r.data_offset);
        offset = row.checked_mul(batch_size)?.checked_add(start)?.checked_next_multiple_of(FIELD_ALIGN)?;
        fields.push(FieldLayout {
            name: decl.name.clone(),
            dtype: decl.dtype,
            shape: decl.shape.clone(),
            offset: field_offset,
            ragged,
        });
    }
    Some((offset.max(1).checked_next_multiple_of(SLOT_ALIGN)?, fields))
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
    /// Lays out `fields` field-major for `batch_size` rows, checking every
    /// size against `limits` (and against overflow) before anything is
    /// allocated for it.
    pub fn new(
        batch_size: u64,
        fields: impl IntoIterator<Item = FieldDecl>,
        limits: &LayoutLimits,
    ) -> Result<Self, LayoutError> {
        let decls: Vec<FieldDecl> = fields.into_iter().collect();
        let mut rows = Vec::with_capacity(decls.len());
        for decl in &decls {
            let row = match decl.max_sample_bytes {
                Some(max) => max.max(1).checked_next_multiple_of(FIELD_ALIGN),
                None => fixed_sample_bytes(decl.dtype, &decl.shape),
            };
            match row {
                Some(row) if row <= limits.max_sample_bytes => rows.push(row),
                bytes => {
                    return Err(LayoutError::SampleTooLarge {
                        field: decl.name.clone(),
                        dtype: decl.dtype,
                        shape: decl.shape.clone(),
                        ragged: decl.max_sample_bytes.is_some(),
                        bytes,
                        limit: limits.max_sample_bytes,
                    });
                }
            }
        }
        let fits = |n: u64| place(n, &decls, &rows).is_some_and(|(slot, _)| slot <= limits.max_batch_bytes);
        let too_large = |bytes: Option<u64>| {
            // The largest batch size that fits: sizes grow with the rows, so bisect.
            let (mut lo, mut hi) = (0u64, batch_size);
            while lo < hi {
                let mid = hi.saturating_sub(hi.abs_diff(lo) / 2);
                if fits(mid) { lo = mid } else { hi = mid.saturating_sub(1) }
            }
            LayoutError::BatchTooLarge { batch_size, bytes, fits: lo, limit: limits.max_batch_bytes }
        };
        match place(batch_size, &decls, &rows) {
            None => Err(too_large(None)),
            Some((slot_bytes, _)) if slot_bytes > limits.max_batch_bytes => Err(too_large(Some(slot_bytes))),
            Some((slot_bytes, fields)) => Ok(BatchLayout { batch_size, slot_bytes, fields }),
        }
    }

    /// Bytes of the segment header in front of slot 0.
    pub fn header_bytes(&self) -> u64 {
        RING_HEADER_BYTES
    }

    /// Byte offset of `slot` from the start of the segment (saturating, like [`BatchLayout::ring_bytes`]).
    pub fn slot_offset(&self, slot: u32) -> u64 {
        u64::from(slot).saturating_mul(self.slot_bytes).saturating_add(RING_HEADER_BYTES)
    }

    /// Total segment size for a ring of `depth` slots; `None` when it overflows `u64`.
    pub fn checked_ring_bytes(&self, depth: u32) -> Option<u64> {
        u64::from(depth).checked_mul(self.slot_bytes)?.checked_add(RING_HEADER_BYTES)
    }

    /// Total segment size for a ring of `depth` slots (saturating: a size that
    /// does not fit in 64 bits matches no real segment).
    pub fn ring_bytes(&self, depth: u32) -> u64 {
        self.checked_ring_bytes(depth).unwrap_or(u64::MAX)
    }

    /// Checks that a segment of `len` bytes holds the header page and `depth`
    /// slots of this layout, and that every field lies aligned inside a slot:
    /// what a client checks of a layout the daemon sent before reading a
    /// segment by it ([`BatchLayout::new`] makes only such layouts).
    pub fn check_segment(&self, depth: u32, len: u64) -> Result<(), RingError> {
        let need = self.checked_ring_bytes(depth);
        if need.is_none_or(|need| len < need) {
            return Err(RingError::TooShort { len, depth, slot_bytes: self.slot_bytes, need });
        }
        let bad = |problem: String| Err(RingError::Layout { problem });
        if !self.slot_bytes.is_multiple_of(SLOT_ALIGN) {
            return bad(format!("has slots of {} bytes, not a multiple of {SLOT_ALIGN}", self.slot_bytes));
        }
        // End of `batch_size` rows of `stride` bytes from `at`.
        let rows_end = |at: u64, stride: u64| stride.checked_mul(self.batch_size)?.checked_add(at);
        for field in &self.fields {
            let name = &field.name;
            let (data, end) = match field.ragged {
                None => (field.offset, rows_end(field.offset, field.sample_bytes())),
                Some(r) => {
                    let table_end = field.offset.checked_add(field.shape_table_bytes(self.batch_size));
                    if table_end.is_none_or(|end| end > r.data_offset) {
                        return bad(format!("puts field {name:?}'s rows inside its shape table"));
                    }
                    if !r.row_stride.is_multiple_of(FIELD_ALIGN) {
                        return bad(format!(
                            "spaces field {name:?}'s rows {} bytes apart, not a multiple of {FIELD_ALIGN}",
                            r.row_stride
                        ));
                    }
                    (r.data_offset, rows_end(r.data_offset, r.row_stride))
                }
            };
            if !field.offset.is_multiple_of(FIELD_ALIGN) || !data.is_multiple_of(FIELD_ALIGN) {
                return bad(format!("puts field {name:?} at offset {data}, not {FIELD_ALIGN}-byte aligned"));
            }
            if end.is_none_or(|end| end > self.slot_bytes) {
                return bad(format!(
                    "lets field {name:?} end past its slot of {} bytes ({} rows from offset {data})",
                    self.slot_bytes, self.batch_size
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn decl(name: &str, dtype: DType, shape: Vec<u64>, max: Option<u64>) -> FieldDecl {
        FieldDecl { name: name.into(), dtype, shape, max_sample_bytes: max }
    }

    #[test]
    fn fields_are_aligned_and_disjoint() {
        let layout = BatchLayout::new(
            3,
            [
                decl("a", DType::U8, vec![5], None),
                decl("b", DType::F64, vec![2, 2], None),
                decl("img", DType::U8, vec![0, 0, 3], Some(1000)),
                decl("c", DType::Bool, vec![], None),
            ],
            &LayoutLimits::DEFAULT,
        )
        .unwrap();
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

    #[test]
    fn ragged_room_beyond_the_sample_limit_names_field_size_and_key() {
        // The issue's reproduction: max_sample_bytes = 2**58 with batch_size 64.
        let err = BatchLayout::new(64, [decl("img", DType::U8, vec![0, 0, 3], Some(1 << 58))], &LayoutLimits::DEFAULT)
            .unwrap_err();
        let msg = err.to_string();
        for needle in ["\"img\"", "288230376151711744", "[limits] max_sample_bytes", "1073741824"] {
            assert!(msg.contains(needle), "{needle} missing from: {msg}");
        }
        // Even with no limit at all, the slot size overflows instead of wrapping.
        let none = LayoutLimits { max_sample_bytes: u64::MAX, max_batch_bytes: u64::MAX };
        let err = BatchLayout::new(64, [decl("img", DType::U8, vec![0, 0, 3], Some(1 << 58))], &none).unwrap_err();
        assert!(matches!(err, LayoutError::BatchTooLarge { bytes: None, .. }), "{err:?}");
        assert!(err.to_string().contains("more than 2^64 bytes"), "{err}");
    }

    #[test]
    fn shapes_whose_size_overflows_are_errors_not_panics() {
        let err = BatchLayout::new(2, [decl("x", DType::F64, vec![1 << 31, 1 << 31, 2], None)], &LayoutLimits::DEFAULT)
            .unwrap_err();
        assert!(matches!(err, LayoutError::SampleTooLarge { bytes: None, .. }), "{err:?}");
        let none = LayoutLimits { max_sample_bytes: u64::MAX, max_batch_bytes: u64::MAX };
        for (batch, shape) in [(u64::MAX, vec![2]), (1 << 40, vec![1 << 30]), (3, vec![u64::MAX / 2])] {
            assert!(BatchLayout::new(batch, [decl("x", DType::U8, shape, None)], &none).is_err());
        }
        assert!(BatchLayout::new(u64::MAX, [decl("r", DType::U8, vec![0; 4], Some(1))], &none).is_err());
    }

    #[test]
    fn batch_limit_suggests_a_batch_size_that_fits() {
        let limits = LayoutLimits { max_sample_bytes: 1 << 30, max_batch_bytes: 1 << 20 };
        // 16 KiB per row: 64 rows are exactly the limit.
        let err = BatchLayout::new(100, [decl("x", DType::F32, vec![64, 64], None)], &limits).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("[limits] max_batch_bytes = 1048576") && msg.contains("100 rows"), "{msg}");
        assert!(msg.contains("use batch_size 64 or less"), "{msg}");
        BatchLayout::new(64, [decl("x", DType::F32, vec![64, 64], None)], &limits).unwrap();
        // With alignment between fields, the suggestion is what really fits.
        let fields = || [decl("a", DType::F32, vec![3], None), decl("b", DType::U8, vec![], None)];
        let limits = LayoutLimits { max_sample_bytes: 1 << 30, max_batch_bytes: 8192 };
        let LayoutError::BatchTooLarge { fits, .. } = BatchLayout::new(1000, fields(), &limits).unwrap_err() else {
            panic!("a batch error")
        };
        BatchLayout::new(fits, fields(), &limits).unwrap();
        assert!(BatchLayout::new(fits + 1, fields(), &limits).is_err());
        // Nothing fits under one page.
        let tiny = LayoutLimits { max_sample_bytes: 1 << 30, max_batch_bytes: 100 };
        let msg = BatchLayout::new(1, fields(), &tiny).unwrap_err().to_string();
        assert!(msg.contains("even one row does not fit"), "{msg}");
    }

    #[test]
    fn hostile_sizes_never_panic_and_what_is_accepted_is_consistent() {
        // Every combination of hostile dimensions, rooms and batch sizes, under
        // the default limits and under none: an error, or a layout whose fields
        // are aligned, disjoint, inside the slot, and within the limits.
        let dims = [0u64, 1, 3, 1 << 31, 1 << 32, 1 << 63, u64::MAX];
        let rooms = [None, Some(0), Some(1), Some(1 << 20), Some(1 << 58), Some(u64::MAX)];
        let batches = [1u64, 7, 64, 1 << 16, 1 << 40, u64::MAX];
        let none = LayoutLimits { max_sample_bytes: u64::MAX, max_batch_bytes: u64::MAX };
        for limits in [LayoutLimits::DEFAULT, none] {
            for &a in &dims {
                for &b in &dims {
                    for &room in &rooms {
                        for &batch in &batches {
                            let fields = [
                                decl("s", DType::U8, vec![], None),
                                decl("x", DType::F64, vec![a, b], None),
                                decl("r", DType::U16, vec![a, 0, b], room),
                            ];
                            let Ok(layout) = BatchLayout::new(batch, fields, &limits) else { continue };
                            assert!(layout.slot_bytes <= limits.max_batch_bytes);
                            let mut end = 0u64;
                            for f in &layout.fields {
                                assert!(f.offset >= end && f.offset % FIELD_ALIGN == 0);
                                assert!(f.sample_bytes() <= limits.max_sample_bytes);
                                let data = f.ragged.map_or(f.offset, |r| r.data_offset);
                                end = data + f.sample_bytes() * batch;
                            }
                            assert!(end <= layout.slot_bytes);
                            assert!(layout.checked_ring_bytes(1024).is_some() || limits == none);
                            if let Some(len) = layout.checked_ring_bytes(2) {
                                layout.check_segment(2, len).unwrap();
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_header_bytes_are_version_1s() {
        let layout = BatchLayout { batch_size: 1, slot_bytes: 0x1234_5000, fields: vec![] };
        let header = RingHeader::new(&layout, 7);
        let bytes = header.to_bytes();
        // magic "STOKRING", version 1 (u32 LE), depth (u32 LE), slot_bytes (u64 LE): docs/protocol.md.
        let mut want = b"STOKRING".to_vec();
        want.extend([1, 0, 0, 0, 7, 0, 0, 0, 0, 0x50, 0x34, 0x12, 0, 0, 0, 0]);
        assert_eq!(bytes.as_slice(), want.as_slice());
        assert_eq!(RingHeader::from_bytes(&bytes), header);
        header.check(&layout, 7).unwrap();
    }

    #[test]
    fn a_foreign_header_is_refused_by_what_differs() {
        let layout = BatchLayout { batch_size: 1, slot_bytes: 4096, fields: vec![] };
        let good = RingHeader::new(&layout, 2);
        let zeros = RingHeader::from_bytes(&[0; RingHeader::BYTES]);
        assert_eq!(zeros.check(&layout, 2), Err(RingError::Magic { found: 0 }));
        let err = RingHeader { version: 2, ..good }.check(&layout, 2).unwrap_err();
        assert_eq!(err, RingError::Version { found: 2 });
        assert!(err.to_string().contains("layout version 2") && err.to_string().contains("version 1"), "{err}");
        let err = good.check(&layout, 3).unwrap_err();
        assert!(matches!(err, RingError::Geometry { depth: 2, want_depth: 3, .. }), "{err:?}");
        let other = BatchLayout { slot_bytes: 8192, ..layout.clone() };
        assert!(matches!(good.check(&other, 2), Err(RingError::Geometry { slot_bytes: 4096, .. })));
        // A big-endian writer's header is not this one.
        let mut swapped = good.to_bytes();
        swapped[..8].reverse();
        assert!(matches!(RingHeader::from_bytes(&swapped).check(&layout, 2), Err(RingError::Magic { .. })));
    }

    #[test]
    fn segments_and_layouts_that_do_not_fit_are_refused() {
        let layout = BatchLayout::new(
            3,
            [decl("a", DType::F32, vec![5], None), decl("img", DType::U8, vec![0, 0, 3], Some(100))],
            &LayoutLimits::DEFAULT,
        )
        .unwrap();
        let len = layout.ring_bytes(2);
        layout.check_segment(2, len).unwrap();
        layout.check_segment(2, len + 1).unwrap();
        assert!(matches!(layout.check_segment(2, len - 1), Err(RingError::TooShort { need: Some(n), .. }) if n == len));
        assert!(matches!(layout.check_segment(3, len), Err(RingError::TooShort { .. })));
        let huge = BatchLayout { slot_bytes: u64::MAX / 2, ..layout.clone() };
        assert!(matches!(huge.check_segment(4, u64::MAX), Err(RingError::TooShort { need: None, .. })));
        let refused = |edit: &dyn Fn(&mut BatchLayout), needle: &str| {
            let mut bad = layout.clone();
            edit(&mut bad);
            let err = bad.check_segment(1, u64::MAX).unwrap_err();
            assert!(matches!(err, RingError::Layout { .. }) && err.to_string().contains(needle), "{needle}: {err}");
        };
        refused(&|l| l.slot_bytes += 64, "not a multiple of 4096");
        refused(&|l| l.fields[0].offset = l.slot_bytes, "\"a\" end past its slot");
        refused(&|l| l.fields[0].offset = 8, "\"a\" at offset 8");
        refused(&|l| l.fields[0].shape = vec![u64::MAX], "\"a\" end past its slot");
        refused(&|l| l.fields[1].ragged.as_mut().unwrap().data_offset = l.fields[1].offset, "inside its shape table");
        refused(&|l| l.fields[1].ragged.as_mut().unwrap().row_stride = 100, "100 bytes apart");
        refused(&|l| l.fields[1].ragged.as_mut().unwrap().row_stride = l.slot_bytes, "\"img\" end past its slot");
        refused(&|l| l.batch_size = 1 << 40, "end past its slot");
    }

    #[test]
    fn numpy_spellings_come_from_one_table() {
        for d in DType::ALL {
            let code = d.type_code();
            assert_eq!(code, format!("{}{}", d.numpy_kind(), d.size()));
            assert_eq!(DType::from_numpy_name(d.numpy_name()), Some(d));
            assert_eq!(DType::from_type_code(code), Some(d));
            assert_eq!((DType::from_numpy(d.numpy_name()), DType::from_numpy(code)), (Some(d), Some(d)));
            assert_eq!(d.to_string(), d.numpy_name());
        }
        assert_eq!(DType::ALL.iter().map(|d| d.numpy_name()).collect::<std::collections::HashSet<_>>().len(), 12);
        assert_eq!(DType::from_type_code("?"), Some(DType::Bool));
        assert_eq!((DType::F16.numpy_kind(), DType::Bool.numpy_kind(), DType::I8.size()), ('f', 'b', 1));
        for bad in ["", "f4 ", "<f4", "complex64", "float", "u3", "Float32", "object"] {
            assert_eq!(DType::from_numpy(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ring_sizes_saturate_instead_of_wrapping() {
        let layout = BatchLayout { batch_size: 1, slot_bytes: u64::MAX / 2, fields: vec![] };
        assert_eq!(layout.checked_ring_bytes(4), None);
        assert_eq!(layout.ring_bytes(4), u64::MAX);
        assert_eq!(layout.slot_offset(u32::MAX), u64::MAX);
        let field = FieldLayout { name: "x".into(), dtype: DType::F64, shape: vec![u64::MAX], offset: 0, ragged: None };
        assert_eq!(field.sample_bytes(), u64::MAX);
    }
}

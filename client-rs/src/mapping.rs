//! The client's read-only mapping of a stream's ring. This module is the only
//! place in the client that turns shared-memory addresses into slices.

use std::fs::File;
use std::os::fd::OwnedFd;

use memmap2::Mmap;
use stoker_proto::{BatchLayout, DType, RING_LAYOUT_VERSION, RING_MAGIC};

use crate::{ClientError, Result};

#[derive(Debug)]
pub(crate) struct Mapping {
    map: Mmap,
    layout: BatchLayout,
}

impl Mapping {
    pub(crate) fn new(fd: OwnedFd, layout: &BatchLayout, depth: u32) -> Result<Mapping> {
        let file = File::from(fd);
        let want = layout.ring_bytes(depth);
        let have = file.metadata()?.len();
        if have < want {
            return Err(ClientError::Protocol(format!("shared-memory ring is {have} bytes, the layout needs {want}")));
        }
        // SAFETY: the daemon sealed the memfd against shrinking (F_SEAL_SHRINK),
        // so the mapping can never extend past the end of the file (no SIGBUS).
        // The daemon writes only to slots this client does not hold, and all
        // slices handed out cover held slots, so no reader observes a write.
        let map = unsafe { Mmap::map(&file)? };
        let header = &map[..16];
        let magic = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
        let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        if magic != RING_MAGIC || version != RING_LAYOUT_VERSION {
            return Err(ClientError::Protocol(format!(
                "shared-memory ring has magic {magic:#x} version {version}; this client expects \
                 {RING_MAGIC:#x} version {RING_LAYOUT_VERSION} (client and daemon versions differ)"
            )));
        }
        Ok(Mapping { map, layout: layout.clone() })
    }

    pub(crate) fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    pub(crate) fn range(&self) -> (usize, usize) {
        (self.map.as_ptr() as usize, self.map.len())
    }

    /// `len` bytes at `offset` inside `slot`.
    ///
    /// Panics if the range lies outside the mapping, which the layout check in
    /// [`Mapping::new`] rules out for every field of every slot.
    pub(crate) fn slot_bytes(&self, slot: u32, offset: u64, len: usize) -> &[u8] {
        let start = (self.layout.slot_offset(slot) + offset) as usize;
        &self.map[start..start + len]
    }
}

/// Element types a field can be viewed as.
pub trait Element: Copy + sealed::Sealed {
    /// The field dtype this type matches.
    const DTYPE: DType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(u8 => U8, u16 => U16, u32 => U32, u64 => U64, i8 => I8, i16 => I16, i32 => I32, i64 => I64, f32 => F32, f64 => F64);

pub(crate) fn cast_slice<T: Element>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) && bytes.len().is_multiple_of(size),
        "field bytes are not aligned for their dtype; the daemon's layout keeps every field 64-byte aligned"
    );
    // SAFETY: alignment and length were checked above; every bit pattern is a
    // valid value of the integer and float types that implement `Element`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) }
}

//! Blosc2 (the HDF5 filter 32026 of hdf5-blosc2, PyTables ≥ 3.8's default
//! and `hdf5plugin.Blosc2`). The filter stores each HDF5 chunk as a Blosc2
//! contiguous frame ("cframe"): a msgpack header, one or more Blosc2 chunks,
//! an index chunk of their offsets and a trailer. Chunks of rank 2 to 8 are
//! stored as b2nd arrays: the frame carries a `b2nd` metalayer (shape,
//! chunk shape, block shape) and the data is laid out block by block, each
//! block padded to the block shape, which is undone here into C order.
//!
//! A Blosc2 chunk extends the Blosc 1.x header to 32 bytes (a filter
//! pipeline of six slots, special-value chunks, split flags); its streams use
//! the same codecs as [`super::blosc`]. Delta, dictionaries, user-defined
//! codecs and filters, lazy and variable-length-block chunks are reported
//! [`FilterError::Unsupported`] (libhdf5 with hdf5plugin may still read them).
//!
//! Every length read from the frame is checked against the frame and against
//! the decoded size the dataset's metadata gives before it is used.

use super::blosc::Format;
use super::codec::{Contexts, read_u32_be, read_u32_le, read_u64_be};
use super::shuffle::{unshuffle, untrans_bit_elem};
use super::{FilterError, corrupt, size_mismatch, truncated};

const F: &str = "blosc2";
/// Blosc2's extended chunk header.
const HEADER_LEN: usize = 32;
/// The frame header up to the metalayers (`FRAME_HEADER_MINLEN`).
const FRAME_MIN: usize = 87;
/// Highest rank a b2nd array has (`B2ND_MAX_DIM`).
const MAX_DIM: usize = 8;

// Chunk header flags (byte 2) and Blosc2 flags (byte 31).
const MEMCPYED: u8 = 0x2;
const EXTENDED: u8 = 0x1 | 0x4;
const DONT_SPLIT: u8 = 0x10;
const USE_DICT: u8 = 0x1;
const LAZY: u8 = 0x8;
const INSTRUMENTED: u8 = 0x80;
const VL_BLOCKS: u8 = 0x1;

// Filter ids of the pipeline slots.
const NOFILTER: u8 = 0;
const SHUFFLE: u8 = 1;
const BITSHUFFLE: u8 = 2;
const DELTA: u8 = 3;
const TRUNC_PREC: u8 = 4;

fn unsupported(reason: impl Into<String>) -> FilterError {
    FilterError::Unsupported { filter: F.to_string(), reason: reason.into() }
}

/// Decodes one HDF5 chunk stored by the Blosc2 filter into exactly `dst`.
pub(crate) fn decode(src: &[u8], dst: &mut [u8], ctx: &mut Contexts) -> Result<(), FilterError> {
    let frame = Frame::parse(src)?;
    match frame.b2nd()? {
        None => {
            if frame.nbytes != dst.len() as u64 {
                return Err(size_mismatch(F, dst.len(), frame.nbytes));
            }
            frame.decode_chunks(dst, ctx)
        }
        Some(array) => {
            let padded = array.check(frame.typesize, dst.len())?;
            if frame.nbytes != padded as u64 {
                return Err(size_mismatch(F, padded, frame.nbytes));
            }
            let mut blocks = vec![0u8; padded];
            frame.decode_chunks(&mut blocks, ctx)?;
            array.unblock(&blocks, frame.typesize, dst);
            Ok(())
        }
    }
}

/// A contiguous frame's header fields that decoding needs.
struct Frame<'a> {
    /// The frame, cut to its own length.
    bytes: &'a [u8],
    header_len: usize,
    nbytes: u64,
    cbytes: usize,
    typesize: usize,
    chunksize: usize,
}

impl<'a> Frame<'a> {
    fn parse(src: &'a [u8]) -> Result<Frame<'a>, FilterError> {
        if src.len() < FRAME_MIN {
            return Err(truncated(F, format!("{} bytes, shorter than a frame header ({FRAME_MIN})", src.len())));
        }
        if &src[2..10] != b"b2frame\0" {
            return Err(corrupt(F, "no \"b2frame\" magic: not a Blosc2 frame"));
        }
        let be32 = |at| read_u32_be(src, at).expect("inside the checked header") as usize;
        let be64 = |at| read_u64_be(src, at).expect("inside the checked header");
        let (header_len, frame_len) = (be32(11), be64(16));
        let frame_len = usize::try_from(frame_len).unwrap_or(usize::MAX);
        if frame_len > src.len() {
            return Err(truncated(F, format!("frame of {frame_len} bytes, have {}", src.len())));
        }
        if !(FRAME_MIN..=frame_len).contains(&header_len) {
            return Err(corrupt(F, format!("header length {header_len} in a {frame_len}-byte frame")));
        }
        let (flags, frame_type) = (src[25], src[26]);
        if flags & 0x30 != 0x10 {
            return Err(unsupported(format!("chunk offsets of type {} (only 64-bit)", (flags >> 4) & 3)));
        }
        if flags & 0x80 != 0 {
            return Err(unsupported("frame of variable-length-block chunks"));
        }
        if frame_type & 0x0f != 0 {
            return Err(unsupported(format!("frame type {} (only contiguous frames)", frame_type & 0x0f)));
        }
        let (nbytes, cbytes) = (be64(30), be64(39));
        let cbytes = usize::try_from(cbytes)
            .ok()
            .filter(|&c| c <= frame_len - header_len)
            .ok_or_else(|| corrupt(F, format!("{cbytes} compressed bytes do not fit a {frame_len}-byte frame")))?;
        let (typesize, chunksize) = (be32(48) as i32, be32(58) as i32);
        if typesize <= 0 || chunksize <= 0 {
            return Err(corrupt(F, format!("type size {typesize}, chunk size {chunksize}")));
        }
        Ok(Frame {
            bytes: &src[..frame_len],
            header_len,
            nbytes,
            cbytes,
            typesize: typesize as usize,
            chunksize: chunksize as usize,
        })
    }

    /// The `b2nd` (or older `caterva`) metalayer's array geometry, if any.
    fn b2nd(&self) -> Result<Option<B2nd>, FilterError> {
        let header = &self.bytes[..self.header_len];
        let get = |at: usize, n: usize| {
            header.get(at..at + n).ok_or_else(|| truncated(F, format!("metalayers end at byte {at} of the header")))
        };
        if get(FRAME_MIN, 1)?[0] != 0x93 || get(91, 1)?[0] != 0xde {
            return Err(corrupt(F, "malformed metalayer index"));
        }
        let count = u16::from_be_bytes(get(92, 2)?.try_into().expect("two bytes"));
        let mut at = 94;
        for _ in 0..count {
            let tag = get(at, 1)?[0];
            if tag & 0xe0 != 0xa0 {
                return Err(corrupt(F, format!("metalayer name tag {tag:#04x}")));
            }
            let len = usize::from(tag & 0x1f);
            let name = get(at + 1, len)?;
            at += 1 + len;
            if get(at, 1)?[0] != 0xd2 {
                return Err(corrupt(F, "metalayer offset is not an int32"));
            }
            let offset = read_u32_be(header, at + 1).ok_or_else(|| truncated(F, "metalayer offset"))? as usize;
            at += 5;
            if name == b"b2nd" || name == b"caterva" {
                if get(offset, 1)?[0] != 0xc6 {
                    return Err(corrupt(F, "b2nd metalayer is not a bin32"));
                }
                let len = read_u32_be(header, offset + 1).ok_or_else(|| truncated(F, "b2nd metalayer"))? as usize;
                let content = get(offset + 5, len)?;
                return B2nd::parse(content).map(Some);
            }
        }
        Ok(None)
    }

    /// Decodes the frame's chunks, one after the other, into `out` (exactly
    /// the frame's uncompressed size).
    fn decode_chunks(&self, out: &mut [u8], ctx: &mut Contexts) -> Result<(), FilterError> {
        let chunks = &self.bytes[self.header_len..];
        let nchunks = out.len().div_ceil(self.chunksize);
        // The index: one little-endian int64 offset per chunk, itself a Blosc2 chunk.
        let index_at = self.cbytes;
        let index_src = chunks.get(index_at..).filter(|s| s.len() >= HEADER_LEN).ok_or_else(|| {
            truncated(F, format!("no chunk index at byte {} of the frame", self.header_len + index_at))
        })?;
        let mut offsets = vec![0u8; nchunks.checked_mul(8).ok_or_else(|| corrupt(F, "too many chunks"))?];
        decode_chunk(index_src, &mut offsets, ctx).map_err(|e| in_part(e, "the chunk index"))?;
        for (i, (part, offset)) in out.chunks_mut(self.chunksize).zip(offsets.chunks_exact(8)).enumerate() {
            let offset = i64::from_le_bytes(offset.try_into().expect("eight bytes"));
            if offset < 0 {
                // A whole chunk of special values, coded in the offset's top byte.
                match (offset.to_le_bytes()[7] & 0x7, self.typesize) {
                    (1 | 4, _) => part.fill(0), // zeros; uninitialized (read as zeros)
                    (2, size) => fill_nan(part, size)?,
                    (other, _) => return Err(corrupt(F, format!("chunk {i}: special value {other}"))),
                }
                continue;
            }
            let src = chunks.get(offset as usize..index_at).filter(|s| !s.is_empty()).ok_or_else(|| {
                corrupt(F, format!("chunk {i} at offset {offset} is outside the {index_at} bytes of chunks"))
            })?;
            decode_chunk(src, part, ctx).map_err(|e| in_part(e, &format!("chunk {i}")))?;
        }
        Ok(())
    }
}

fn in_part(e: FilterError, part: &str) -> FilterError {
    match e {
        FilterError::Truncated { filter, reason } => truncated(filter, format!("{part}: {reason}")),
        FilterError::Corrupt { filter, reason } => corrupt(filter, format!("{part}: {reason}")),
        other => other,
    }
}

fn fill_nan(dst: &mut [u8], typesize: usize) -> Result<(), FilterError> {
    let nan: &[u8] = match typesize {
        4 => &f32::NAN.to_ne_bytes(),
        8 => &f64::NAN.to_ne_bytes(),
        other => return Err(corrupt(F, format!("NaN chunk of {other}-byte items"))),
    };
    if !dst.len().is_multiple_of(typesize) {
        return Err(corrupt(F, format!("NaN chunk of {} bytes, not whole {typesize}-byte items", dst.len())));
    }
    for item in dst.chunks_exact_mut(typesize) {
        item.copy_from_slice(nan);
    }
    Ok(())
}

/// A b2nd array's geometry (one frame chunk holding the whole array).
#[derive(Debug)]
struct B2nd {
    shape: Vec<usize>,
    blockshape: Vec<usize>,
}

impl B2nd {
    /// The metalayer: msgpack `[version, ndim, [int64 × ndim], [int32 × ndim] (chunk shape), [int32 × ndim] (block shape), ...]`.
    fn parse(meta: &[u8]) -> Result<B2nd, FilterError> {
        let bad = |what: &str| corrupt(F, format!("b2nd metalayer: {what}"));
        let byte = |at: usize| meta.get(at).copied().ok_or_else(|| bad("truncated"));
        if byte(0)? & 0xf0 != 0x90 {
            return Err(bad("not an array"));
        }
        let ndim = usize::from(byte(2)?);
        if !(1..=MAX_DIM).contains(&ndim) {
            return Err(bad(&format!("{ndim} dimensions (1 to {MAX_DIM})")));
        }
        let mut at = 3;
        let mut read = |tag: u8, width: usize| -> Result<Vec<i64>, FilterError> {
            if byte(at)? != 0x90 | ndim as u8 {
                return Err(bad("dimension list of the wrong length"));
            }
            at += 1;
            (0..ndim)
                .map(|_| {
                    if byte(at)? != tag {
                        return Err(bad("dimension of the wrong type"));
                    }
                    let b = meta.get(at + 1..at + 1 + width).ok_or_else(|| bad("truncated"))?;
                    at += 1 + width;
                    Ok(if width == 8 {
                        i64::from_be_bytes(b.try_into().expect("eight bytes"))
                    } else {
                        i64::from(i32::from_be_bytes(b.try_into().expect("four bytes")))
                    })
                })
                .collect()
        };
        let (shape, chunkshape, blockshape) = (read(0xd3, 8)?, read(0xd2, 4)?, read(0xd2, 4)?);
        if shape != chunkshape {
            return Err(unsupported(format!(
                "b2nd array {shape:?} in chunks {chunkshape:?} (the HDF5 filter writes one chunk)"
            )));
        }
        let positive = |v: Vec<i64>| -> Result<Vec<usize>, FilterError> {
            v.into_iter()
                .map(|d| usize::try_from(d).ok().filter(|&d| d > 0).ok_or_else(|| bad("dimension ≤ 0")))
                .collect()
        };
        Ok(B2nd { shape: positive(shape)?, blockshape: positive(blockshape)? })
    }

    /// Checks the shape against the HDF5 chunk (`expected` bytes of
    /// `itemsize`-byte items); returns the padded, blocked size in bytes.
    fn check(&self, itemsize: usize, expected: usize) -> Result<usize, FilterError> {
        let items = self.shape.iter().try_fold(itemsize, |acc, &d| acc.checked_mul(d));
        if items != Some(expected) {
            return Err(unsupported(format!(
                "b2nd array {:?} of {itemsize}-byte items is not the {expected}-byte HDF5 chunk",
                self.shape
            )));
        }
        // b2nd blocks fit in the chunk, so padding adds less than one block
        // per axis (under 2^ndim × the array), and a Blosc2 chunk holds
        // under 2 GiB: that bounds the buffer a hostile frame can ask for.
        if self.blockshape.iter().zip(&self.shape).any(|(b, d)| b > d) {
            return Err(corrupt(F, format!("block shape {:?} exceeds array {:?}", self.blockshape, self.shape)));
        }
        let padded = self
            .shape
            .iter()
            .zip(&self.blockshape)
            .try_fold(itemsize, |acc, (&d, &b)| acc.checked_mul(d.div_ceil(b).checked_mul(b)?))
            .filter(|&p| p <= i32::MAX as usize && p <= expected.saturating_mul(1 << self.shape.len()))
            .ok_or_else(|| corrupt(F, format!("block shape {:?} for array {:?}", self.blockshape, self.shape)))?;
        Ok(padded)
    }

    /// Copies the padded blocks of `blocks` (block after block in C order,
    /// each a C-order `blockshape` array) into `dst` in C order of `shape`.
    fn unblock(&self, blocks: &[u8], itemsize: usize, dst: &mut [u8]) {
        let ndim = self.shape.len();
        let (shape, block) = (&self.shape, &self.blockshape);
        let grid: Vec<usize> = shape.iter().zip(block).map(|(&d, &b)| d.div_ceil(b)).collect();
        let block_items: usize = block.iter().product();
        let last = ndim - 1;
        let row_items = block[last];
        let mut strides = vec![1usize; ndim]; // of `dst`, in items
        for k in (0..last).rev() {
            strides[k] = strides[k + 1] * shape[k + 1];
        }
        let mut g = vec![0usize; ndim]; // block coordinates
        for b in 0..grid.iter().product::<usize>() {
            let base = &blocks[b * block_items * itemsize..][..block_items * itemsize];
            // Each row (all coordinates but the last) of the block.
            let mut r = vec![0usize; ndim];
            for row in base.chunks_exact(row_items * itemsize) {
                let inside = (0..last).all(|k| g[k] * block[k] + r[k] < shape[k]);
                if inside {
                    let x0 = g[last] * row_items;
                    let n = row_items.min(shape[last] - x0);
                    let at: usize = (0..last).map(|k| (g[k] * block[k] + r[k]) * strides[k]).sum::<usize>() + x0;
                    dst[at * itemsize..(at + n) * itemsize].copy_from_slice(&row[..n * itemsize]);
                }
                step(&mut r[..last], &block[..last]);
            }
            step(&mut g, &grid);
        }
    }
}

/// Advances the C-order multi-index `index` within `dims` (wrapping to zero).
fn step(index: &mut [usize], dims: &[usize]) {
    for k in (0..index.len()).rev() {
        index[k] += 1;
        if index[k] < dims[k] {
            return;
        }
        index[k] = 0;
    }
}

/// Decodes one Blosc2 chunk (`blosc2_decompress`) into exactly `dst`.
fn decode_chunk(src: &[u8], dst: &mut [u8], ctx: &mut Contexts) -> Result<(), FilterError> {
    if src.len() < HEADER_LEN {
        return Err(truncated(F, format!("{} bytes, shorter than the 32-byte chunk header", src.len())));
    }
    let (version, flags, typesize) = (src[0], src[2], usize::from(src[3]));
    let le32 = |at| read_u32_le(src, at).expect("inside the header") as i32;
    let (nbytes, blocksize, cbytes) = (le32(4), le32(8), le32(12));
    if flags & EXTENDED != EXTENDED {
        return Err(unsupported(format!("chunk without the Blosc2 extended header (version {version})")));
    }
    if nbytes < 0 {
        return Err(corrupt(F, format!("chunk header gives a negative size ({nbytes})")));
    }
    if nbytes as usize != dst.len() {
        return Err(size_mismatch(F, dst.len(), nbytes));
    }
    let cbytes = usize::try_from(cbytes)
        .ok()
        .filter(|&c| c >= HEADER_LEN)
        .ok_or_else(|| corrupt(F, format!("compressed size {cbytes} is smaller than the header")))?;
    let src = src.get(..cbytes).ok_or_else(|| truncated(F, format!("chunk of {cbytes} bytes, have {}", src.len())))?;
    let filters: [u8; 6] = src[16..22].try_into().expect("six bytes");
    let meta: [u8; 6] = src[24..30].try_into().expect("six bytes");
    let (flags2, blosc2_flags) = (src[30], src[31]);

    match (blosc2_flags >> 4) & 0x7 {
        0 => {}
        1 | 4 => {
            dst.fill(0); // zeros; uninitialized values (read as zeros)
            return Ok(());
        }
        2 => return fill_nan(dst, typesize),
        3 => {
            // One value (its size is what follows the header) repeated.
            let value = &src[HEADER_LEN..];
            if value.is_empty() || !dst.len().is_multiple_of(value.len()) {
                return Err(corrupt(F, format!("repeated {}-byte value for {} bytes", value.len(), dst.len())));
            }
            dst.chunks_exact_mut(value.len()).for_each(|item| item.copy_from_slice(value));
            return Ok(());
        }
        other => return Err(corrupt(F, format!("special value {other}"))),
    }
    if blosc2_flags & LAZY != 0 {
        return Err(unsupported("lazy chunk"));
    }
    if blosc2_flags & USE_DICT != 0 {
        return Err(unsupported("chunk compressed with a dictionary"));
    }
    if blosc2_flags & INSTRUMENTED != 0 {
        return Err(unsupported("instrumented chunk"));
    }
    if flags2 & VL_BLOCKS != 0 {
        return Err(unsupported("variable-length blocks"));
    }
    if dst.is_empty() {
        return Ok(());
    }
    if flags & MEMCPYED != 0 {
        if cbytes != dst.len() + HEADER_LEN {
            return Err(size_mismatch(F, dst.len() + HEADER_LEN, cbytes));
        }
        dst.copy_from_slice(&src[HEADER_LEN..]);
        return Ok(());
    }
    let format = match flags >> 5 {
        6 => return Err(unsupported(format!("user-defined codec {}", src[22]))),
        _ => Format::from_flags(flags)?,
    };
    for &f in &filters {
        match f {
            NOFILTER | SHUFFLE | BITSHUFFLE | TRUNC_PREC => {}
            DELTA => return Err(unsupported("delta filter")),
            other => return Err(unsupported(format!("filter {other}"))),
        }
    }
    if typesize == 0 || blocksize <= 0 {
        return Err(corrupt(F, format!("block size {blocksize}, type size {typesize}")));
    }
    let blocksize = blocksize as usize;
    let nblocks = dst.len().div_ceil(blocksize);
    if nblocks.checked_mul(4).and_then(|n| n.checked_add(HEADER_LEN)).is_none_or(|end| end > cbytes) {
        return Err(truncated(F, format!("{nblocks} block offsets do not fit in {cbytes} bytes")));
    }
    let block = Block { src, flags, typesize, filters, meta, version, format };
    for (j, out) in dst.chunks_mut(blocksize).enumerate() {
        let start = le32(HEADER_LEN + 4 * j);
        let start = usize::try_from(start)
            .ok()
            .filter(|&s| s > 0 && s < cbytes)
            .ok_or_else(|| corrupt(F, format!("block {j} starts at {start}, outside the {cbytes}-byte chunk")))?;
        block.decode(start, out, out.len() < blocksize, ctx).map_err(|e| in_part(e, &format!("block {j}")))?;
    }
    Ok(())
}

/// What every block of a chunk shares.
struct Block<'a> {
    src: &'a [u8],
    flags: u8,
    typesize: usize,
    filters: [u8; 6],
    meta: [u8; 6],
    version: u8,
    format: Format,
}

impl Block<'_> {
    /// `blosc_d`: the block's streams from `src[start..]`, then the filter
    /// pipeline backwards, into `out`.
    fn decode(&self, start: usize, out: &mut [u8], leftover: bool, ctx: &mut Contexts) -> Result<(), FilterError> {
        let bsize = out.len();
        let nstreams = if self.flags & DONT_SPLIT == 0 && !leftover { self.typesize } else { 1 };
        if !bsize.is_multiple_of(nstreams) {
            return Err(corrupt(F, format!("{bsize}-byte block does not split into {nstreams} streams")));
        }
        let neblock = bsize / nstreams;
        let filtered = self.filters.iter().any(|&f| f == SHUFFLE || f == BITSHUFFLE);
        let (scratch, mut codecs) = ctx.split(if filtered { 2 * bsize } else { 0 });
        let (mut cur, mut spare) = scratch.split_at_mut(if filtered { bsize } else { 0 });
        let target: &mut [u8] = if filtered { &mut *cur } else { &mut *out };
        let src = self.src;
        let mut pos = start;
        for piece in target.chunks_exact_mut(neblock) {
            let csize = read_u32_le(src, pos).ok_or_else(|| truncated(F, format!("no stream size at byte {pos}")))?;
            let csize = csize as i32;
            pos += 4;
            if csize == 0 {
                piece.fill(0);
                continue;
            }
            if csize < 0 {
                let token = *src.get(pos).ok_or_else(|| truncated(F, format!("no stream token at byte {pos}")))?;
                pos += 1;
                if token & 1 == 0 || csize < -255 {
                    return Err(corrupt(F, format!("stream token {token:#04x} with size {csize}")));
                }
                piece.fill(csize.unsigned_abs() as u8);
                continue;
            }
            let csize = csize as usize;
            let input = src.get(pos..pos + csize).ok_or_else(|| {
                truncated(
                    F,
                    format!("stream needs {csize} bytes at byte {pos}, have {}", src.len().saturating_sub(pos)),
                )
            })?;
            if csize == neblock {
                piece.copy_from_slice(input);
            } else {
                self.format.decompress(input, piece, &mut codecs)?;
            }
            pos += csize;
        }
        if !filtered {
            return Ok(());
        }
        for i in (0..6).rev() {
            match self.filters[i] {
                SHUFFLE => {
                    let size = if self.meta[i] == 0 { self.typesize } else { usize::from(self.meta[i]) };
                    unshuffle(cur, spare, size);
                }
                BITSHUFFLE => {
                    let mut n = bsize / self.typesize;
                    if self.version == 2 && !n.is_multiple_of(8) {
                        spare.copy_from_slice(cur); // format 2 left such blocks unshuffled
                    } else {
                        n -= n % 8;
                        let whole = n * self.typesize;
                        untrans_bit_elem(&cur[..whole], &mut spare[..whole], self.typesize);
                        spare[whole..].copy_from_slice(&cur[whole..]);
                    }
                }
                _ => continue, // no filter; trunc_prec needs no undoing
            }
            std::mem::swap(&mut cur, &mut spare);
        }
        out.copy_from_slice(cur);
        Ok(())
    }
}

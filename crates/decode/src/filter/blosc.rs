//! Blosc 1.x frames (the HDF5 blosc filter, id 32001): a 16-byte header,
//! block offsets, and per block one or `typesize` compressed streams, byte-
//! or bit-shuffled. Inner codecs: BloscLZ, LZ4/LZ4HC, zlib and zstd; snappy
//! is reported unsupported.

use super::codec::{self, Codecs, Contexts, read_u32_le};
use super::shuffle::{unshuffle, untrans_bit_elem};
use super::{FilterError, corrupt, size_mismatch, truncated};

const F: &str = "blosc";
const HEADER_LEN: usize = 16;
/// Header flags (`blosc.h`).
const DOSHUFFLE: u8 = 0x1;
const MEMCPYED: u8 = 0x2;
const DOBITSHUFFLE: u8 = 0x4;
/// Set by blosc2 (delta filter); blosc 1.x refuses such frames too.
const FUTURE_FLAG: u8 = 0x8;
const DONT_SPLIT: u8 = 0x10;
/// Blocks are split into `typesize` streams only for types up to this size...
const MAX_SPLITS: usize = 16;
/// ...and blocks of at least this many elements.
const MIN_BUFFERSIZE: usize = 128;

/// Inner codec, from the top three bits of the flags byte (shared with Blosc2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    BloscLz,
    Lz4,
    Zlib,
    Zstd,
}

impl Format {
    pub(crate) fn from_flags(flags: u8) -> Result<Format, FilterError> {
        match flags >> 5 {
            0 => Ok(Format::BloscLz),
            1 => Ok(Format::Lz4),
            3 => Ok(Format::Zlib),
            4 => Ok(Format::Zstd),
            2 => Err(unsupported("snappy", "no snappy decoder")),
            other => Err(unsupported("unknown", &format!("compressor format {other}"))),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Format::BloscLz => "blosc/blosclz",
            Format::Lz4 => "blosc/lz4",
            Format::Zlib => "blosc/zlib",
            Format::Zstd => "blosc/zstd",
        }
    }

    /// Decompresses one stream into exactly `piece`.
    pub(crate) fn decompress(self, input: &[u8], piece: &mut [u8], codecs: &mut Codecs<'_>) -> Result<(), FilterError> {
        let name = self.name();
        match self {
            Format::BloscLz => codec::blosclz(input, piece),
            Format::Lz4 => codec::lz4_block(name, input, piece),
            Format::Zlib => codec::inflate_as(name, input, piece, codecs.inflate()),
            Format::Zstd => codec::zstd_as(name, input, piece, codecs.zstd()?),
        }
    }
}

fn unsupported(codec: &str, reason: &str) -> FilterError {
    FilterError::Unsupported { filter: format!("blosc/{codec}"), reason: reason.to_string() }
}

/// Checks the compressor code the HDF5 blosc filter keeps in `cd_values[6]`
/// (blosc's compcodes: 0 blosclz, 1 lz4, 2 lz4hc, 3 snappy, 4 zlib, 5 zstd).
pub(crate) fn check_compressor_code(code: u32) -> Result<(), FilterError> {
    match code {
        0 | 1 | 2 | 4 | 5 => Ok(()),
        3 => Err(unsupported("snappy", "no snappy decoder")),
        other => Err(unsupported("unknown", &format!("compressor code {other}"))),
    }
}

/// Decodes one blosc frame into exactly `dst`.
pub(crate) fn decode(src: &[u8], dst: &mut [u8], ctx: &mut Contexts) -> Result<(), FilterError> {
    if src.len() < HEADER_LEN {
        return Err(truncated(F, format!("{} bytes, shorter than the 16-byte header", src.len())));
    }
    let (version, flags, typesize) = (src[0], src[2], src[3] as usize);
    let header = |at| read_u32_le(src, at).expect("the header is 16 bytes") as usize;
    let (nbytes, blocksize, cbytes) = (header(4), header(8), header(12));
    if !(1..=2).contains(&version) {
        return Err(unsupported("frame", &format!("format version {version}; only blosc 1.x frames (1, 2)")));
    }
    if nbytes != dst.len() {
        return Err(size_mismatch(F, dst.len(), nbytes));
    }
    if cbytes > src.len() {
        return Err(truncated(F, format!("header says {cbytes} bytes, have {}", src.len())));
    }
    if cbytes < HEADER_LEN {
        return Err(corrupt(F, format!("compressed size {cbytes} is smaller than the header")));
    }
    let src = &src[..cbytes];
    if nbytes == 0 {
        return Ok(());
    }
    if flags & FUTURE_FLAG != 0 {
        return Err(unsupported("frame", "flag 0x08 (blosc2 delta)"));
    }
    if flags & MEMCPYED != 0 {
        if cbytes != nbytes + HEADER_LEN {
            return Err(size_mismatch(F, nbytes + HEADER_LEN, cbytes));
        }
        dst.copy_from_slice(&src[HEADER_LEN..]);
        return Ok(());
    }
    let format = Format::from_flags(flags)?;
    if blocksize == 0 || typesize == 0 {
        return Err(corrupt(F, format!("block size {blocksize}, type size {typesize}")));
    }
    let nblocks = nbytes.div_ceil(blocksize);
    let starts_end = nblocks.checked_mul(4).and_then(|n| n.checked_add(HEADER_LEN)).filter(|&end| end <= cbytes);
    if starts_end.is_none() {
        return Err(truncated(F, format!("{nblocks} block offsets do not fit in {cbytes} bytes")));
    }

    for (j, out) in dst.chunks_mut(blocksize).enumerate() {
        let start = read_u32_le(src, HEADER_LEN + 4 * j).expect("checked above") as usize;
        let leftover_block = out.len() < blocksize;
        decode_block(src, start, out, flags, typesize, leftover_block, format, ctx)
            .map_err(|e| add_block_context(e, j))?;
    }
    Ok(())
}

fn add_block_context(e: FilterError, block: usize) -> FilterError {
    match e {
        FilterError::Truncated { filter, reason } => truncated(filter, format!("block {block}: {reason}")),
        FilterError::Corrupt { filter, reason } => corrupt(filter, format!("block {block}: {reason}")),
        other => other,
    }
}

/// `blosc_d`: one block, from `src[start..]` into `out`.
#[allow(clippy::too_many_arguments)]
fn decode_block(
    src: &[u8],
    start: usize,
    out: &mut [u8],
    flags: u8,
    typesize: usize,
    leftover_block: bool,
    format: Format,
    ctx: &mut Contexts,
) -> Result<(), FilterError> {
    let bsize = out.len();
    let doshuffle = flags & DOSHUFFLE != 0 && typesize > 1;
    let dobitshuffle = flags & DOBITSHUFFLE != 0 && bsize >= typesize;
    // Frames written before the split flag existed split under the same
    // conditions, so the flag alone is not enough.
    let nsplits =
        if flags & DONT_SPLIT == 0 && typesize <= MAX_SPLITS && bsize / typesize >= MIN_BUFFERSIZE && !leftover_block {
            typesize
        } else {
            1
        };
    if !bsize.is_multiple_of(nsplits) {
        return Err(corrupt(F, format!("{bsize}-byte block does not split into {nsplits} streams")));
    }
    let neblock = bsize / nsplits;

    let (shuffled, mut codecs) = ctx.split(if doshuffle || dobitshuffle { bsize } else { 0 });
    let target: &mut [u8] = if doshuffle || dobitshuffle { &mut *shuffled } else { &mut *out };
    let mut pos = start;
    for piece in target.chunks_exact_mut(neblock) {
        let csize = read_u32_le(src, pos).ok_or_else(|| truncated(F, format!("no stream size at byte {pos}")))?;
        // blosc reads these as signed; a negative size is corrupt, not huge.
        let csize =
            i32::try_from(csize).map_err(|_| corrupt(F, format!("negative stream size at byte {pos}")))? as usize;
        pos += 4;
        let input = src.get(pos..pos + csize).ok_or_else(|| {
            truncated(F, format!("stream needs {csize} bytes at byte {pos}, have {}", src.len().saturating_sub(pos)))
        })?;
        if csize == neblock {
            piece.copy_from_slice(input);
        } else {
            format.decompress(input, piece, &mut codecs)?;
        }
        pos += csize;
    }

    if doshuffle {
        unshuffle(shuffled, out, typesize);
    } else if dobitshuffle {
        // blosc 1.x bit-transposes only blocks whose element count is a
        // multiple of 8, leaving a partial element at the end as it was;
        // other blocks are stored without any shuffle.
        let n = bsize / typesize;
        if n.is_multiple_of(8) {
            let whole = n * typesize;
            untrans_bit_elem(&shuffled[..whole], &mut out[..whole], typesize);
            out[whole..].copy_from_slice(&shuffled[whole..]);
        } else {
            out.copy_from_slice(shuffled);
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::filter::shuffle::tests::{shuffle, trans_bit_elem};

    /// Builds a blosc 1.x frame the way `blosc_compress` lays it out, with
    /// lz4, zlib or zstd streams (or raw ones when they do not shrink).
    pub(crate) fn encode(data: &[u8], typesize: usize, blocksize: usize, shuffle_mode: u8, format: u8) -> Vec<u8> {
        let nblocks = data.len().div_ceil(blocksize);
        let mut flags = shuffle_mode | format << 5;
        let split_ok =
            |bsize: usize, leftover: bool| typesize <= MAX_SPLITS && bsize / typesize >= MIN_BUFFERSIZE && !leftover;
        // Mark non-splitting frames the way blosc does (dont_split unless it splits).
        if !split_ok(blocksize, false) {
            flags |= DONT_SPLIT;
        }
        let mut out = vec![2, 1, flags, typesize as u8];
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(blocksize as u32).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend(std::iter::repeat_n(0, 4 * nblocks));
        for (j, block) in data.chunks(blocksize).enumerate() {
            let start = out.len() as u32;
            out[HEADER_LEN + 4 * j..HEADER_LEN + 4 * j + 4].copy_from_slice(&start.to_le_bytes());
            let shuffled = match shuffle_mode {
                DOSHUFFLE if typesize > 1 => shuffle(block, typesize),
                DOBITSHUFFLE if block.len() >= typesize && (block.len() / typesize).is_multiple_of(8) => {
                    let whole = block.len() / typesize * typesize;
                    let mut t = trans_bit_elem(&block[..whole], typesize);
                    t.extend_from_slice(&block[whole..]);
                    t
                }
                _ => block.to_vec(),
            };
            let leftover = block.len() < blocksize;
            let nsplits = if flags & DONT_SPLIT == 0 && split_ok(block.len(), leftover) { typesize } else { 1 };
            for piece in shuffled.chunks(block.len() / nsplits) {
                let c = match format {
                    1 => lz4_flex::block::compress(piece),
                    3 => {
                        use std::io::Write;
                        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(5));
                        e.write_all(piece).unwrap();
                        e.finish().unwrap()
                    }
                    4 => ::zstd::bulk::compress(piece, 3).unwrap(),
                    _ => unreachable!(),
                };
                let c = if c.len() >= piece.len() { piece.to_vec() } else { c };
                out.extend_from_slice(&(c.len() as u32).to_le_bytes());
                out.extend_from_slice(&c);
            }
        }
        let cbytes = out.len() as u32;
        out[12..16].copy_from_slice(&cbytes.to_le_bytes());
        out
    }

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| ((i / 5) as u8).wrapping_add((i % 3) as u8)).collect()
    }

    #[test]
    fn round_trips() {
        let mut ctx = Contexts::default();
        for format in [1u8, 3, 4] {
            for shuffle_mode in [0, DOSHUFFLE, DOBITSHUFFLE] {
                for typesize in [1usize, 2, 4, 8, 24] {
                    for (len, blocksize) in [(0, 1), (100, 100), (4096, 4096), (10_000, 4096), (9000, 1024), (1000, 96)]
                    {
                        let data = data(len);
                        let frame = encode(&data, typesize, blocksize, shuffle_mode, format);
                        let mut out = vec![0xaa; len];
                        decode(&frame, &mut out, &mut ctx).unwrap_or_else(|e| {
                            panic!("format {format} shuffle {shuffle_mode} typesize {typesize} len {len}: {e}")
                        });
                        assert_eq!(out, data, "format {format} shuffle {shuffle_mode} typesize {typesize} len {len}");
                    }
                }
            }
        }
    }

    #[test]
    fn memcpyed_frame() {
        let data = data(50);
        let mut frame = vec![2, 1, MEMCPYED | DOSHUFFLE, 4];
        frame.extend_from_slice(&50u32.to_le_bytes());
        frame.extend_from_slice(&50u32.to_le_bytes());
        frame.extend_from_slice(&66u32.to_le_bytes());
        frame.extend_from_slice(&data);
        let mut out = vec![0; 50];
        decode(&frame, &mut out, &mut Contexts::default()).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn rejects_bad_frames() {
        let mut ctx = Contexts::default();
        let data = data(10_000);
        let frame = encode(&data, 4, 4096, DOSHUFFLE, 1);
        let mut out = vec![0; data.len()];
        for cut in (0..frame.len()).step_by(7) {
            assert!(decode(&frame[..cut], &mut out, &mut ctx).is_err(), "cut {cut}");
        }
        for i in 0..frame.len() {
            for delta in [1u8, 0x80] {
                let mut bad = frame.clone();
                bad[i] = bad[i].wrapping_add(delta);
                let _ = decode(&bad, &mut out, &mut ctx);
            }
        }
        let mut snappy = frame.clone();
        snappy[2] = (snappy[2] & 0x1f) | 2 << 5;
        assert!(decode(&snappy, &mut out, &mut ctx).unwrap_err().is_unsupported());
        let mut blosc2 = frame.clone();
        blosc2[0] = 3;
        assert!(decode(&blosc2, &mut out, &mut ctx).unwrap_err().is_unsupported());
        let mut wrong = vec![0; data.len() - 1];
        assert!(matches!(decode(&frame, &mut wrong, &mut ctx), Err(FilterError::SizeMismatch { .. })));
    }
}

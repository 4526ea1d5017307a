//! Byte-stream decompressors: zlib (deflate), the HDF5 LZ4 plugin's block
//! framing, zstd frames, h5py's LZF and blosc's BloscLZ. Each fills an
//! output slice of exactly the expected size or fails.

use std::fmt;

use flate2::{Decompress, FlushDecompress, Status};

use super::{FilterError, corrupt, size_mismatch, truncated};

/// Codec contexts and a per-block buffer, reused across chunks.
#[derive(Default)]
pub(crate) struct Contexts {
    inflate: Option<Decompress>,
    zstd: Option<zstd::bulk::Decompressor<'static>>,
    /// One block of shuffled data (bitshuffle, blosc) before it is unshuffled.
    pub(crate) block: Vec<u8>,
}

impl fmt::Debug for Contexts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Contexts")
            .field("inflate", &self.inflate.is_some())
            .field("zstd", &self.zstd.is_some())
            .field("block_capacity", &self.block.capacity())
            .finish()
    }
}

impl Contexts {
    pub(crate) fn shrink_to(&mut self, max_bytes: usize) {
        if self.block.capacity() > max_bytes {
            self.block = Vec::new();
        }
    }

    /// The zlib context, reset for a new stream.
    pub(crate) fn inflate(&mut self) -> &mut Decompress {
        let ctx = self.inflate.get_or_insert_with(|| Decompress::new(true));
        ctx.reset(true);
        ctx
    }

    pub(crate) fn zstd(&mut self) -> Result<&mut zstd::bulk::Decompressor<'static>, FilterError> {
        zstd_context(&mut self.zstd)
    }

    /// The block buffer, `len` bytes long, and the zstd and zlib contexts
    /// beside it.
    pub(crate) fn split(&mut self, len: usize) -> (&mut [u8], Codecs<'_>) {
        super::set_len(&mut self.block, len);
        (&mut self.block[..], Codecs { inflate: &mut self.inflate, zstd: &mut self.zstd })
    }
}

/// Borrowed codec contexts, created on first use.
pub(crate) struct Codecs<'a> {
    inflate: &'a mut Option<Decompress>,
    zstd: &'a mut Option<zstd::bulk::Decompressor<'static>>,
}

impl Codecs<'_> {
    pub(crate) fn inflate(&mut self) -> &mut Decompress {
        let ctx = self.inflate.get_or_insert_with(|| Decompress::new(true));
        ctx.reset(true);
        ctx
    }

    pub(crate) fn zstd(&mut self) -> Result<&mut zstd::bulk::Decompressor<'static>, FilterError> {
        zstd_context(self.zstd)
    }
}

fn zstd_context<'a>(
    slot: &'a mut Option<zstd::bulk::Decompressor<'static>>,
) -> Result<&'a mut zstd::bulk::Decompressor<'static>, FilterError> {
    if slot.is_none() {
        let ctx = zstd::bulk::Decompressor::new().map_err(|e| corrupt("zstd", format!("creating a context: {e}")))?;
        *slot = Some(ctx);
    }
    Ok(slot.as_mut().expect("just filled"))
}

pub(crate) fn read_u32_be(src: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(src.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

pub(crate) fn read_u32_le(src: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(src.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

pub(crate) fn read_u64_be(src: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(src.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

/// Inflates one zlib stream into exactly `dst`. Bytes after the end of the
/// stream are ignored, as libhdf5 does.
pub(crate) fn inflate(src: &[u8], dst: &mut [u8], ctx: &mut Decompress) -> Result<(), FilterError> {
    inflate_as("deflate", src, dst, ctx)
}

pub(crate) fn inflate_as(
    filter: &'static str,
    src: &[u8],
    dst: &mut [u8],
    ctx: &mut Decompress,
) -> Result<(), FilterError> {
    let status = ctx.decompress(src, dst, FlushDecompress::Finish).map_err(|e| corrupt(filter, e.to_string()))?;
    let written = ctx.total_out();
    match status {
        Status::StreamEnd if written == dst.len() as u64 => Ok(()),
        Status::StreamEnd => Err(size_mismatch(filter, dst.len(), written)),
        // Output full, input left over: the stream is longer than the chunk.
        Status::Ok | Status::BufError if written == dst.len() as u64 && ctx.total_in() < src.len() as u64 => {
            Err(FilterError::TooLong { filter, expected: dst.len() })
        }
        Status::Ok | Status::BufError => {
            Err(truncated(filter, format!("zlib stream ends after {} of {} bytes", ctx.total_in(), src.len())))
        }
    }
}

/// Decodes the HDF5 LZ4 plugin's framing (`H5Zlz4.c`): a big-endian u64
/// decoded size and u32 block size, then per block a big-endian u32
/// compressed size and an LZ4 block, stored raw when it did not shrink.
pub(crate) fn hdf5_lz4(src: &[u8], dst: &mut [u8]) -> Result<(), FilterError> {
    const F: &str = "lz4";
    let (Some(total), Some(block)) = (read_u64_be(src, 0), read_u32_be(src, 8)) else {
        return Err(truncated(F, format!("{} bytes, shorter than the 12-byte header", src.len())));
    };
    if total != dst.len() as u64 {
        return Err(size_mismatch(F, dst.len(), total));
    }
    if dst.is_empty() {
        return Ok(());
    }
    // The plugin clamps the block size to the decoded size.
    let block = (block as usize).min(dst.len());
    if block == 0 {
        return Err(corrupt(F, "block size 0"));
    }
    let mut pos = 12;
    for (index, out) in dst.chunks_mut(block).enumerate() {
        let csize = read_u32_be(src, pos)
            .ok_or_else(|| truncated(F, format!("no size for block {index} at byte {pos}")))?
            as usize;
        pos += 4;
        let input = src.get(pos..pos.saturating_add(csize)).ok_or_else(|| {
            truncated(F, format!("block {index} needs {csize} bytes at byte {pos}, have {}", src.len() - pos))
        })?;
        if csize == out.len() {
            out.copy_from_slice(input);
        } else {
            lz4_block(F, input, out)?;
        }
        pos += csize;
    }
    Ok(())
}

/// Decompresses one raw LZ4 block into exactly `dst`.
pub(crate) fn lz4_block(filter: &'static str, src: &[u8], dst: &mut [u8]) -> Result<(), FilterError> {
    let n = lz4_flex::block::decompress_into(src, dst).map_err(|e| corrupt(filter, format!("lz4 block: {e}")))?;
    if n != dst.len() {
        return Err(size_mismatch(filter, dst.len(), n));
    }
    Ok(())
}

/// Decompresses zstd frame(s) into exactly `dst`.
pub(crate) fn zstd(src: &[u8], dst: &mut [u8], ctx: &mut zstd::bulk::Decompressor<'static>) -> Result<(), FilterError> {
    zstd_as("zstd", src, dst, ctx)
}

pub(crate) fn zstd_as(
    filter: &'static str,
    src: &[u8],
    dst: &mut [u8],
    ctx: &mut zstd::bulk::Decompressor<'static>,
) -> Result<(), FilterError> {
    let n = ctx.decompress_to_buffer(src, dst).map_err(|e| corrupt(filter, format!("zstd: {e}")))?;
    if n != dst.len() {
        return Err(size_mismatch(filter, dst.len(), n));
    }
    Ok(())
}

/// Copies a `len`-byte back-reference starting `dist` bytes behind `op`,
/// where the source may overlap the bytes being written. The caller has
/// checked `dist` against `op` and `op + len` against the buffer.
fn copy_match(buf: &mut [u8], op: usize, dist: usize, len: usize) {
    debug_assert!(dist >= 1 && dist <= op && op + len <= buf.len());
    if dist == 1 {
        let byte = buf[op - 1];
        buf[op..op + len].fill(byte);
    } else if dist >= len {
        buf.copy_within(op - dist..op - dist + len, op);
    } else {
        // The pattern repeats every `dist` bytes; copy it `dist` at a time.
        let mut done = 0;
        while done < len {
            let n = dist.min(len - done);
            buf.copy_within(op + done - dist..op + done - dist + n, op + done);
            done += n;
        }
    }
}

/// Decompresses h5py's LZF filter (liblzf's `lzf_decompress`) into exactly
/// `dst`.
pub(crate) fn lzf(src: &[u8], dst: &mut [u8]) -> Result<(), FilterError> {
    const F: &str = "lzf";
    let (mut ip, mut op) = (0usize, 0usize);
    while ip < src.len() {
        let ctrl = src[ip] as usize;
        ip += 1;
        if ctrl < 32 {
            let run = ctrl + 1;
            let literal = src
                .get(ip..ip + run)
                .ok_or_else(|| truncated(F, format!("literal run of {run} bytes at byte {}", ip - 1)))?;
            let expected = dst.len();
            dst.get_mut(op..op + run).ok_or(FilterError::TooLong { filter: F, expected })?.copy_from_slice(literal);
            ip += run;
            op += run;
        } else {
            let mut len = ctrl >> 5;
            let mut dist = ((ctrl & 0x1f) << 8) + 1;
            if len == 7 {
                len += *src.get(ip).ok_or_else(|| truncated(F, "back-reference length"))? as usize;
                ip += 1;
            }
            dist += *src.get(ip).ok_or_else(|| truncated(F, "back-reference offset"))? as usize;
            ip += 1;
            len += 2;
            if op + len > dst.len() {
                return Err(FilterError::TooLong { filter: F, expected: dst.len() });
            }
            if dist > op {
                return Err(corrupt(F, format!("back-reference {dist} bytes behind output position {op}")));
            }
            copy_match(dst, op, dist, len);
            op += len;
        }
    }
    if op != dst.len() {
        return Err(size_mismatch(F, dst.len(), op));
    }
    Ok(())
}

/// Decompresses blosc's BloscLZ (a FastLZ level-1 variant with 16-bit far
/// distances) into exactly `dst`.
pub(crate) fn blosclz(src: &[u8], dst: &mut [u8]) -> Result<(), FilterError> {
    const F: &str = "blosc/blosclz";
    /// Distances past this are coded as 31 << 8 | 255 plus a 16-bit extra.
    const MAX_DISTANCE: usize = 8191;
    let Some(&first) = src.first() else {
        return if dst.is_empty() { Ok(()) } else { Err(truncated(F, "empty stream")) };
    };
    // The first byte is always a literal run; its top bits carry the level.
    let mut ctrl = (first & 31) as usize;
    let (mut ip, mut op) = (1usize, 0usize);
    let byte = |ip: &mut usize| -> Result<usize, FilterError> {
        let b = *src.get(*ip).ok_or_else(|| truncated(F, format!("stream ends at byte {ip}")))?;
        *ip += 1;
        Ok(b as usize)
    };
    loop {
        if ctrl >= 32 {
            let mut len = (ctrl >> 5) - 1;
            let ofs = (ctrl & 31) << 8;
            if len == 6 {
                loop {
                    let code = byte(&mut ip)?;
                    len += code;
                    if code != 255 {
                        break;
                    }
                }
            }
            let code = byte(&mut ip)?;
            len += 3;
            let mut dist = ofs + code + 1;
            if code == 255 && ofs == 31 << 8 {
                let far = (byte(&mut ip)? << 8) + byte(&mut ip)?;
                dist = far + MAX_DISTANCE + 1;
            }
            if op + len > dst.len() {
                return Err(FilterError::TooLong { filter: F, expected: dst.len() });
            }
            if dist > op {
                return Err(corrupt(F, format!("back-reference {dist} bytes behind output position {op}")));
            }
            copy_match(dst, op, dist, len);
            op += len;
        } else {
            let run = ctrl + 1;
            let literal = src
                .get(ip..ip + run)
                .ok_or_else(|| truncated(F, format!("literal run of {run} bytes at byte {ip}")))?;
            let expected = dst.len();
            dst.get_mut(op..op + run).ok_or(FilterError::TooLong { filter: F, expected })?.copy_from_slice(literal);
            ip += run;
            op += run;
        }
        if ip >= src.len() {
            break;
        }
        ctrl = src[ip] as usize;
        ip += 1;
    }
    if op != dst.len() {
        return Err(size_mismatch(F, dst.len(), op));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::Write;

    use super::*;

    fn sample(n: usize) -> Vec<u8> {
        (0..n).map(|i| ((i / 7) as u8).wrapping_mul(3) ^ (i % 5) as u8).collect()
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        let mut enc = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(6));
        enc.write_all(data).unwrap();
        enc.finish().unwrap()
    }

    #[test]
    fn inflate_round_trip_and_errors() {
        let data = sample(10_000);
        let z = zlib(&data);
        let mut ctx = Decompress::new(true);
        let mut out = vec![0; data.len()];
        inflate(&z, &mut out, &mut ctx).unwrap();
        assert_eq!(out, data);
        // The context is reusable after a reset.
        ctx.reset(true);
        inflate(&z, &mut out, &mut ctx).unwrap();

        ctx.reset(true);
        let mut short = vec![0; data.len() - 1];
        assert!(matches!(inflate(&z, &mut short, &mut ctx), Err(FilterError::TooLong { .. })));
        ctx.reset(true);
        let mut long = vec![0; data.len() + 1];
        assert!(matches!(inflate(&z, &mut long, &mut ctx), Err(FilterError::SizeMismatch { .. })));
        for cut in [0, 1, 2, z.len() / 2, z.len() - 1] {
            ctx.reset(true);
            let err = inflate(&z[..cut], &mut out, &mut ctx).unwrap_err();
            assert!(matches!(err, FilterError::Truncated { .. } | FilterError::Corrupt { .. }), "{cut}: {err}");
        }
        ctx.reset(true);
        assert!(inflate(b"not a zlib stream at all", &mut out, &mut ctx).is_err());
    }

    /// Frames `data` the way the HDF5 LZ4 plugin does.
    pub(crate) fn hdf5_lz4_encode(data: &[u8], block: usize) -> Vec<u8> {
        let block = block.min(data.len());
        let mut v = (data.len() as u64).to_be_bytes().to_vec();
        v.extend_from_slice(&(block as u32).to_be_bytes());
        for piece in data.chunks(block.max(1)) {
            let c = lz4_flex::block::compress(piece);
            if c.len() >= piece.len() {
                v.extend_from_slice(&(piece.len() as u32).to_be_bytes());
                v.extend_from_slice(piece);
            } else {
                v.extend_from_slice(&(c.len() as u32).to_be_bytes());
                v.extend_from_slice(&c);
            }
        }
        v
    }

    #[test]
    fn lz4_framing_round_trip() {
        let mut data = sample(5000);
        // An incompressible tail, so some blocks are stored raw.
        let mut x = 0x1234_5678u32;
        data.extend((0..3000).map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        }));
        for block in [1, 7, 1000, 4096, 1 << 30] {
            let framed = hdf5_lz4_encode(&data, block);
            let mut out = vec![0; data.len()];
            hdf5_lz4(&framed, &mut out).unwrap();
            assert_eq!(out, data, "block {block}");
            // Every truncation fails cleanly.
            for cut in (0..framed.len()).step_by(97) {
                assert!(hdf5_lz4(&framed[..cut], &mut out).is_err(), "block {block} cut {cut}");
            }
        }
        let framed = hdf5_lz4_encode(&data, 4096);
        let mut wrong = vec![0; data.len() + 1];
        assert!(matches!(hdf5_lz4(&framed, &mut wrong), Err(FilterError::SizeMismatch { .. })));
        hdf5_lz4(&hdf5_lz4_encode(&[], 0), &mut []).unwrap();
    }

    #[test]
    fn lz4_framing_rejects_garbage_without_panicking() {
        let data = sample(3000);
        let framed = hdf5_lz4_encode(&data, 1024);
        let mut out = vec![0; data.len()];
        for i in 12..framed.len() {
            let mut bad = framed.clone();
            bad[i] ^= 0x5a;
            let _ = hdf5_lz4(&bad, &mut out);
        }
        // A huge declared size is refused before anything is allocated.
        let mut huge = framed.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(matches!(hdf5_lz4(&huge, &mut out), Err(FilterError::SizeMismatch { .. })));
    }

    #[test]
    fn zstd_round_trip_and_errors() {
        let data = sample(20_000);
        let z = ::zstd::bulk::compress(&data, 3).unwrap();
        let mut ctx = ::zstd::bulk::Decompressor::new().unwrap();
        let mut out = vec![0; data.len()];
        zstd(&z, &mut out, &mut ctx).unwrap();
        assert_eq!(out, data);
        let mut long = vec![0; data.len() + 3];
        assert!(matches!(zstd(&z, &mut long, &mut ctx), Err(FilterError::SizeMismatch { .. })));
        let mut short = vec![0; data.len() - 3];
        assert!(zstd(&z, &mut short, &mut ctx).is_err());
        for cut in [0, 4, z.len() / 2, z.len() - 1] {
            assert!(zstd(&z[..cut], &mut out, &mut ctx).is_err(), "cut {cut}");
        }
    }

    /// A minimal LZF encoder: literal runs plus run-length back-references,
    /// enough to exercise every token form of the decoder.
    fn lzf_encode(data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut lit: Vec<u8> = Vec::new();
        let flush = |out: &mut Vec<u8>, lit: &mut Vec<u8>| {
            for run in lit.chunks(32) {
                out.push(run.len() as u8 - 1);
                out.extend_from_slice(run);
            }
            lit.clear();
        };
        let mut i = 0;
        while i < data.len() {
            // Longest repeat of the previous byte (distance 1).
            let mut n = 0;
            while i > 0 && i + n < data.len() && data[i + n] == data[i - 1] && n < 264 {
                n += 1;
            }
            if n >= 3 {
                flush(&mut out, &mut lit);
                let len = n - 2;
                if len < 7 {
                    out.push((len << 5) as u8);
                } else {
                    out.push(7 << 5);
                    out.push((len - 7) as u8);
                }
                out.push(0); // distance 1
                i += n;
            } else {
                lit.push(data[i]);
                i += 1;
            }
        }
        flush(&mut out, &mut lit);
        out
    }

    #[test]
    fn lzf_round_trip_and_errors() {
        let mut data = sample(3000);
        data.extend(std::iter::repeat_n(9u8, 700));
        data.extend(sample(100));
        let z = lzf_encode(&data);
        assert!(z.len() < data.len());
        let mut out = vec![0; data.len()];
        lzf(&z, &mut out).unwrap();
        assert_eq!(out, data);
        for cut in [1, z.len() / 2, z.len() - 1] {
            assert!(lzf(&z[..cut], &mut out).is_err(), "cut {cut}");
        }
        let mut short = vec![0; data.len() - 1];
        assert!(matches!(lzf(&z, &mut short), Err(FilterError::TooLong { .. })));
        // A back-reference before the start of the output.
        assert!(matches!(lzf(&[0x20, 0x05], &mut out), Err(FilterError::Corrupt { .. })));
    }

    #[test]
    fn blosclz_tokens() {
        // literal "abc", then a match of 5 at distance 3, then a far match.
        let mut stream = vec![2, b'a', b'b', b'c'];
        // len field (5 - 2) = 3 -> ctrl = 3 << 5 | ofs_hi 0; code = dist - 1.
        stream.extend([3 << 5, 2]);
        let mut expected = b"abcabcab".to_vec();
        // Literal run of 32 bytes of filler, repeated until far away.
        let filler: Vec<u8> = (0..9000u32).map(|i| (i * 7 % 251) as u8).collect();
        for run in filler.chunks(32) {
            stream.push(run.len() as u8 - 1);
            stream.extend_from_slice(run);
            expected.extend_from_slice(run);
        }
        // Far match copying "abcabcab" + first filler bytes: distance = all output so far.
        let dist = expected.len();
        let far = dist - 8191 - 1;
        // len 10 -> (10 - 2) = 8 >= 7: ctrl len field 7, then extra 8 - 6 - 1... computed below.
        // len = (ctrl >> 5) - 1 = 6, += extra, += 3  => extra = 10 - 9 = 1.
        stream.extend([7 << 5 | 31, 1, 255, (far >> 8) as u8, far as u8]);
        let start = expected.len() - dist;
        let copied: Vec<u8> = expected[start..start + 10].to_vec();
        expected.extend_from_slice(&copied);
        // Ends with a literal, as the encoder always does.
        stream.extend([0, b'z']);
        expected.push(b'z');

        let mut out = vec![0; expected.len()];
        blosclz(&stream, &mut out).unwrap();
        assert_eq!(out, expected);
        for cut in [1, 5, stream.len() / 2, stream.len() - 1] {
            assert!(blosclz(&stream[..cut], &mut out).is_err(), "cut {cut}");
        }
        // A reference past the start of the output.
        assert!(matches!(blosclz(&[0, b'a', 1 << 5, 9, 0, b'b'], &mut [0; 5]), Err(FilterError::Corrupt { .. })));
    }

    #[test]
    fn copy_match_overlaps() {
        let mut buf = *b"ab______________";
        copy_match(&mut buf, 2, 2, 9);
        assert_eq!(&buf[..11], b"abababababa");
        let mut buf = *b"xyz_____";
        copy_match(&mut buf, 3, 1, 4);
        assert_eq!(&buf[..7], b"xyzzzzz");
        let mut buf = *b"abcdef______";
        copy_match(&mut buf, 6, 6, 6);
        assert_eq!(&buf, b"abcdefabcdef");
    }
}

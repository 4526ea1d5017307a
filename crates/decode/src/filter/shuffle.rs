//! Byte unshuffle (HDF5's shuffle filter) and bit unshuffle (the bitshuffle
//! filter, also used inside blosc), plus the bitshuffle filter's blocked,
//! optionally compressed framing.

use super::codec::{self, Contexts, read_u32_be, read_u64_be};
use super::{FilterError, corrupt, size_mismatch, truncated};

/// Undoes HDF5's byte shuffle: `src` holds byte 0 of every element, then
/// byte 1 of every element, and so on; bytes past the last whole element are
/// stored as they were. `src` and `dst` have the same length.
pub(crate) fn unshuffle(src: &[u8], dst: &mut [u8], element_size: usize) {
    debug_assert_eq!(src.len(), dst.len());
    let n = src.len() / element_size.max(1);
    if element_size <= 1 || n <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    match element_size {
        2 => unshuffle_pairs::<2, 1>(src, dst, n),
        4 => unshuffle_pairs::<4, 2>(src, dst, n),
        8 => unshuffle_pairs::<8, 4>(src, dst, n),
        _ => unshuffle_range(src, dst, n, element_size, 0),
    }
    let tail = n * element_size;
    dst[tail..].copy_from_slice(&src[tail..]);
}

/// Unshuffles elements `from..n`, one byte at a time.
fn unshuffle_range(src: &[u8], dst: &mut [u8], n: usize, element_size: usize, from: usize) {
    for j in 0..element_size {
        let plane = &src[j * n..(j + 1) * n];
        for (i, &byte) in plane.iter().enumerate().skip(from) {
            dst[i * element_size + j] = byte;
        }
    }
}

/// Unshuffle for `N`-byte elements (`H = N / 2`; 2, 4 and 8 bytes) in two
/// interleaves, a tile of `T` elements at a time through a stack buffer of
/// at most 4 KiB: byte planes `2k` and `2k + 1` into a plane of byte pairs,
/// then the `H` pair planes into elements. Each step is a plain two-way or
/// `H`-way interleave the compiler vectorizes; the direct `N`-way byte
/// interleave does not (`filter::tests::throughput`: about 18 GB/s for 2-,
/// 4- and 8-byte elements, against 3.6 GB/s for the direct 4- and 8-byte
/// interleave and 4.9 GB/s for a 32-element tiled 2-byte one).
fn unshuffle_pairs<const N: usize, const H: usize>(src: &[u8], dst: &mut [u8], n: usize) {
    const T: usize = 512;
    debug_assert_eq!(N, 2 * H);
    let mut pairs = [[[0u8; 2]; T]; H];
    let tiles = n / T;
    let (elements, _) = dst[..tiles * T * N].as_chunks_mut::<N>();
    for (t, elements) in elements.chunks_exact_mut(T).enumerate() {
        for (k, plane) in pairs.iter_mut().enumerate() {
            let lo = &src[2 * k * n + t * T..][..T];
            let hi = &src[(2 * k + 1) * n + t * T..][..T];
            for ((pair, &a), &b) in plane.iter_mut().zip(lo).zip(hi) {
                *pair = [a, b];
            }
        }
        for (i, element) in elements.iter_mut().enumerate() {
            let (out, _) = element.as_chunks_mut::<2>();
            for (o, plane) in out.iter_mut().zip(&pairs) {
                *o = plane[i];
            }
        }
    }
    unshuffle_range(src, dst, n, N, tiles * T);
}

/// Transposes the 8x8 bit matrix held in `x` (bit `8r + c` to bit `8c + r`).
#[inline]
fn transpose8(mut x: u64) -> u64 {
    let t = (x ^ (x >> 7)) & 0x00aa_00aa_00aa_00aa;
    x ^= t ^ (t << 7);
    let t = (x ^ (x >> 14)) & 0x0000_cccc_0000_cccc;
    x ^= t ^ (t << 14);
    let t = (x ^ (x >> 28)) & 0x0000_0000_f0f0_f0f0;
    x ^= t ^ (t << 28);
    x
}

/// Undoes bitshuffle's `bshuf_trans_bit_elem` on `n` elements (`n % 8 == 0`)
/// of `element_size` bytes. `src` holds `8 * element_size` rows of `n / 8`
/// bytes; row `8j + b` carries bit `b` of byte `j` of every element, element
/// `i` at bit `i % 8` of the row's byte `i / 8`.
pub(crate) fn untrans_bit_elem(src: &[u8], dst: &mut [u8], element_size: usize) {
    debug_assert_eq!(src.len(), dst.len());
    match element_size {
        1 => untrans_fixed::<1>(src, dst),
        2 => untrans_fixed::<2>(src, dst),
        4 => untrans_fixed::<4>(src, dst),
        8 => untrans_fixed::<8>(src, dst),
        es => untrans_any(src, dst, es),
    }
}

/// `untrans_bit_elem` for a fixed element size: each step gathers one byte
/// from each of the `8 * ES` rows, so 8 elements come out whole and the
/// output is written front to back.
fn untrans_fixed<const ES: usize>(src: &[u8], dst: &mut [u8]) {
    let nrow = src.len() / ES / 8;
    let rows: [[&[u8]; 8]; ES] =
        std::array::from_fn(|j| std::array::from_fn(|b| &src[(j * 8 + b) * nrow..(j * 8 + b + 1) * nrow]));
    for (g, out) in dst.chunks_exact_mut(8 * ES).enumerate() {
        let words: [[u8; 8]; ES] = std::array::from_fn(|j| {
            transpose8(u64::from_le_bytes(std::array::from_fn(|b| rows[j][b][g]))).to_le_bytes()
        });
        for (e, element) in out.chunks_exact_mut(ES).enumerate() {
            for (j, byte) in element.iter_mut().enumerate() {
                *byte = words[j][e];
            }
        }
    }
}

/// `untrans_bit_elem` for any element size, one byte column at a time.
fn untrans_any(src: &[u8], dst: &mut [u8], es: usize) {
    let nrow = src.len() / es / 8;
    for j in 0..es {
        let r: [&[u8]; 8] = std::array::from_fn(|b| &src[(j * 8 + b) * nrow..(j * 8 + b + 1) * nrow]);
        for (g, out) in dst.chunks_exact_mut(8 * es).enumerate() {
            let x = u64::from_le_bytes(std::array::from_fn(|b| r[b][g]));
            for (element, byte) in out.chunks_exact_mut(es).zip(transpose8(x).to_le_bytes()) {
                element[j] = byte;
            }
        }
    }
}

/// What the bitshuffle filter compresses each block with (`cd_values[4]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BitshuffleCompression {
    None,
    Lz4,
    Zstd,
}

/// The bitshuffle filter's client data (`bshuf_h5filter.c`): `[major, minor,
/// element size, block size in elements (0 = default), compression, level]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BitshuffleParams {
    element_size: usize,
    block_size: usize,
    compression: BitshuffleCompression,
}

/// `BSHUF_BLOCKED_MULT`: block sizes are multiples of eight elements.
const BLOCKED_MULT: usize = 8;

/// `bshuf_default_block_size`: about 8 KiB of elements, at least 128.
fn default_block_size(element_size: usize) -> usize {
    (8192 / element_size / BLOCKED_MULT * BLOCKED_MULT).max(128)
}

impl BitshuffleParams {
    /// Whether blocks are compressed (so the size changes).
    pub(crate) fn compresses(&self) -> bool {
        self.compression != BitshuffleCompression::None
    }

    pub(crate) fn parse(cd: &[u32]) -> Result<Self, FilterError> {
        let invalid = |reason: String| FilterError::InvalidParams { filter: "bitshuffle", reason };
        let Some(&element_size) = cd.get(2) else {
            return Err(invalid(format!("{} client data values; the element size is the third", cd.len())));
        };
        let element_size = element_size as usize;
        if element_size == 0 {
            return Err(invalid("element size 0".into()));
        }
        let block_size = cd.get(3).map_or(0, |&b| b as usize);
        if !block_size.is_multiple_of(BLOCKED_MULT) {
            return Err(invalid(format!("block size {block_size} is not a multiple of 8")));
        }
        let compression = match cd.get(4).copied().unwrap_or(0) {
            0 => BitshuffleCompression::None,
            2 => BitshuffleCompression::Lz4,
            3 => BitshuffleCompression::Zstd,
            other => {
                return Err(FilterError::Unsupported {
                    filter: "bitshuffle".into(),
                    reason: format!("compression code {other} (known: 0 none, 2 lz4, 3 zstd)"),
                });
            }
        };
        Ok(BitshuffleParams { element_size, block_size, compression })
    }
}

/// Undoes the bitshuffle filter on one chunk into exactly `dst`.
///
/// Without compression the chunk is bit-transposed in blocks of `block_size`
/// elements, the last block cut to a multiple of eight, and the final
/// `n % 8` elements stored as they were. With compression a 12-byte header
/// (big-endian u64 decoded size, u32 block size in bytes) comes first and
/// every transposed block is stored as a big-endian u32 size plus an LZ4
/// block or a zstd frame; the leftover elements follow uncompressed.
pub(crate) fn bitshuffle_filter(
    src: &[u8],
    dst: &mut [u8],
    params: BitshuffleParams,
    ctx: &mut Contexts,
) -> Result<(), FilterError> {
    let es = params.element_size;
    let (name, mut pos, block_size) = match params.compression {
        BitshuffleCompression::None => {
            if src.len() != dst.len() {
                return Err(size_mismatch("bitshuffle", dst.len(), src.len()));
            }
            ("bitshuffle", 0, params.block_size)
        }
        compression => {
            let name = if compression == BitshuffleCompression::Lz4 { "bitshuffle/lz4" } else { "bitshuffle/zstd" };
            let (Some(total), Some(block_bytes)) = (read_u64_be(src, 0), read_u32_be(src, 8)) else {
                return Err(truncated(name, format!("{} bytes, shorter than the 12-byte header", src.len())));
            };
            if total != dst.len() as u64 {
                return Err(size_mismatch(name, dst.len(), total));
            }
            let block_size = block_bytes as usize / es;
            if !block_size.is_multiple_of(BLOCKED_MULT) {
                return Err(corrupt(name, format!("block size {block_size} elements is not a multiple of 8")));
            }
            (name, 12, block_size)
        }
    };
    if !dst.len().is_multiple_of(es) {
        return Err(corrupt(name, format!("{} bytes is not a whole number of {es}-byte elements", dst.len())));
    }
    let block_size = if block_size == 0 { default_block_size(es) } else { block_size };
    let n = dst.len() / es;

    // Full blocks, then the rest of the elements cut down to a multiple of 8.
    let full = n / block_size;
    let last = n % block_size / BLOCKED_MULT * BLOCKED_MULT;
    let block_lens = std::iter::repeat_n(block_size, full).chain((last > 0).then_some(last));
    let mut at = 0;
    for (index, elements) in block_lens.enumerate() {
        let bytes = elements * es;
        let out = &mut dst[at..at + bytes];
        match params.compression {
            BitshuffleCompression::None => untrans_bit_elem(&src[at..at + bytes], out, es),
            compression => {
                let csize = read_u32_be(src, pos)
                    .ok_or_else(|| truncated(name, format!("no size for block {index} at byte {pos}")))?
                    as usize;
                pos += 4;
                let input = src.get(pos..pos.saturating_add(csize)).ok_or_else(|| {
                    truncated(
                        name,
                        format!("block {index} needs {csize} bytes at byte {pos}, have {}", src.len() - pos),
                    )
                })?;
                let (block, mut codecs) = ctx.split(bytes);
                if compression == BitshuffleCompression::Lz4 {
                    codec::lz4_block(name, input, block)?;
                } else {
                    codec::zstd_as(name, input, block, codecs.zstd()?)?;
                }
                untrans_bit_elem(block, out, es);
                pos += csize;
            }
        }
        at += bytes;
    }

    // The last n % 8 elements were never transposed.
    let leftover = dst.len() - at;
    let from = if params.compression == BitshuffleCompression::None { at } else { pos };
    let tail = src.get(from..from + leftover).ok_or_else(|| {
        truncated(name, format!("{leftover} leftover bytes at byte {from}, have {}", src.len() - from))
    })?;
    dst[at..].copy_from_slice(tail);
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Byte shuffle, written out plainly (the filter's forward direction).
    pub(crate) fn shuffle(data: &[u8], element_size: usize) -> Vec<u8> {
        let n = data.len() / element_size;
        let mut out = data.to_vec();
        for i in 0..n {
            for j in 0..element_size {
                out[j * n + i] = data[i * element_size + j];
            }
        }
        out
    }

    /// `bshuf_trans_bit_elem` one bit at a time.
    pub(crate) fn trans_bit_elem(data: &[u8], element_size: usize) -> Vec<u8> {
        let n = data.len() / element_size;
        assert_eq!(n % 8, 0);
        let nrow = n / 8;
        let mut out = vec![0u8; data.len()];
        for i in 0..n {
            for j in 0..element_size {
                for b in 0..8 {
                    let bit = (data[i * element_size + j] >> b) & 1;
                    out[(j * 8 + b) * nrow + i / 8] |= bit << (i % 8);
                }
            }
        }
        out
    }

    /// The bitshuffle filter's forward direction (blocking, leftovers and the
    /// optional compression framing).
    pub(crate) fn bitshuffle_encode(
        data: &[u8],
        element_size: usize,
        block_size: usize,
        compression: BitshuffleCompression,
    ) -> Vec<u8> {
        let block_size = if block_size == 0 { default_block_size(element_size) } else { block_size };
        let n = data.len() / element_size;
        let mut out = Vec::new();
        if compression != BitshuffleCompression::None {
            out.extend_from_slice(&(data.len() as u64).to_be_bytes());
            out.extend_from_slice(&((block_size * element_size) as u32).to_be_bytes());
        }
        let last = n % block_size / 8 * 8;
        let blocks = std::iter::repeat_n(block_size, n / block_size).chain((last > 0).then_some(last));
        let mut at = 0;
        for elements in blocks {
            let bytes = elements * element_size;
            let t = trans_bit_elem(&data[at..at + bytes], element_size);
            match compression {
                BitshuffleCompression::None => out.extend_from_slice(&t),
                BitshuffleCompression::Lz4 => {
                    let c = lz4_flex::block::compress(&t);
                    out.extend_from_slice(&(c.len() as u32).to_be_bytes());
                    out.extend_from_slice(&c);
                }
                BitshuffleCompression::Zstd => {
                    let c = ::zstd::bulk::compress(&t, 3).unwrap();
                    out.extend_from_slice(&(c.len() as u32).to_be_bytes());
                    out.extend_from_slice(&c);
                }
            }
            at += bytes;
        }
        out.extend_from_slice(&data[at..]);
        out
    }

    fn pseudo_random(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    #[test]
    fn transpose8_is_the_bit_transpose() {
        for seed in 1..50u32 {
            let bytes = pseudo_random(8, seed);
            let x = u64::from_le_bytes(bytes.clone().try_into().unwrap());
            let y = transpose8(x);
            for r in 0..8 {
                for c in 0..8 {
                    assert_eq!((x >> (8 * r + c)) & 1, (y >> (8 * c + r)) & 1);
                }
            }
        }
    }

    #[test]
    fn unshuffle_inverts_shuffle() {
        for element_size in [1, 2, 3, 4, 5, 8, 16] {
            for len in [0, 1, 2, 7, 8, 15, 16, 17, 31, 100, 257, 1000, 4099, 12_805] {
                let data = pseudo_random(len, (len * 31 + element_size) as u32);
                let shuffled = shuffle(&data, element_size);
                let mut out = vec![0xee; len];
                unshuffle(&shuffled, &mut out, element_size);
                assert_eq!(out, data, "element size {element_size}, {len} bytes");
            }
        }
    }

    #[test]
    fn untrans_inverts_trans() {
        for element_size in [1, 2, 3, 4, 8, 12] {
            for n in [0, 8, 16, 64, 72, 136, 512, 520, 1024] {
                let data = pseudo_random(n * element_size, (n + element_size) as u32);
                let t = trans_bit_elem(&data, element_size);
                let mut out = vec![0; data.len()];
                untrans_bit_elem(&t, &mut out, element_size);
                assert_eq!(out, data, "element size {element_size}, {n} elements");
            }
        }
    }

    #[test]
    fn bitshuffle_filter_round_trips() {
        let mut ctx = Contexts::default();
        for compression in [BitshuffleCompression::None, BitshuffleCompression::Lz4, BitshuffleCompression::Zstd] {
            for element_size in [1usize, 2, 4, 8, 3] {
                for n in [0usize, 1, 7, 8, 9, 100, 1003, 5000] {
                    for block_size in [0usize, 8, 64] {
                        // Compressible: small values.
                        let data: Vec<u8> = (0..n * element_size).map(|i| (i % 7 + i / 97) as u8).collect();
                        let encoded = bitshuffle_encode(&data, element_size, block_size, compression);
                        let params = BitshuffleParams { element_size, block_size, compression };
                        let mut out = vec![0; data.len()];
                        bitshuffle_filter(&encoded, &mut out, params, &mut ctx).unwrap();
                        assert_eq!(out, data, "{compression:?} es {element_size} n {n} block {block_size}");
                    }
                }
            }
        }
    }

    #[test]
    fn bitshuffle_filter_rejects_bad_input() {
        let mut ctx = Contexts::default();
        let data: Vec<u8> = (0..4000u32).map(|i| (i / 3) as u8).collect();
        let params = BitshuffleParams { element_size: 4, block_size: 0, compression: BitshuffleCompression::Lz4 };
        let encoded = bitshuffle_encode(&data, 4, 0, BitshuffleCompression::Lz4);
        let mut out = vec![0; data.len()];
        for cut in (0..encoded.len()).step_by(13) {
            assert!(bitshuffle_filter(&encoded[..cut], &mut out, params, &mut ctx).is_err(), "cut {cut}");
        }
        for i in 0..encoded.len() {
            let mut bad = encoded.clone();
            bad[i] = bad[i].wrapping_add(0x41);
            let _ = bitshuffle_filter(&bad, &mut out, params, &mut ctx);
        }
        let mut wrong_size = vec![0; data.len() + 4];
        assert!(matches!(
            bitshuffle_filter(&encoded, &mut wrong_size, params, &mut ctx),
            Err(FilterError::SizeMismatch { .. })
        ));
        // Not a whole number of elements.
        let plain = BitshuffleParams { element_size: 4, block_size: 0, compression: BitshuffleCompression::None };
        assert!(bitshuffle_filter(&[0; 10], &mut [0; 10], plain, &mut ctx).is_err());
    }

    #[test]
    fn params_parse() {
        assert!(BitshuffleParams::parse(&[0, 4]).is_err());
        assert!(BitshuffleParams::parse(&[0, 4, 0]).is_err());
        assert!(BitshuffleParams::parse(&[0, 4, 4, 12]).is_err());
        assert!(BitshuffleParams::parse(&[0, 4, 4, 0, 9]).unwrap_err().is_unsupported());
        let p = BitshuffleParams::parse(&[0, 4, 2, 64, 3, 5]).unwrap();
        assert_eq!((p.element_size, p.block_size, p.compression), (2, 64, BitshuffleCompression::Zstd));
        assert_eq!(default_block_size(1), 8192);
        assert_eq!(default_block_size(4), 2048);
        assert_eq!(default_block_size(100), 128);
        assert_eq!(default_block_size(24), 336);
    }
}

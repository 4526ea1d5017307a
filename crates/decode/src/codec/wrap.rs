//! The compression wrapper around a value: none, lz4 or zstd.
//!
//! `lz4` accepts what Python's `lz4` package writes: `lz4.frame.compress`
//! (the LZ4 frame format, told apart by its magic number) and
//! `lz4.block.compress` with its default 4-byte little-endian size prefix.

use std::io::{Cursor, Read};

use super::{CodecError, read_exact_all};

/// First bytes of an LZ4 frame (magic 0x184D2204, little-endian).
pub(super) const LZ4_FRAME_MAGIC: [u8; 4] = [0x04, 0x22, 0x4D, 0x18];
/// First bytes of a zstd frame (magic 0xFD2FB528, little-endian).
pub(super) const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
/// Largest decompressed value accepted, so a corrupt or hostile value cannot
/// make the daemon allocate without bound.
pub const MAX_DECOMPRESSED: usize = 1 << 31;

/// The most bytes a wrapped image (PNG/JPEG file bytes) may inflate to when
/// its decoded array may take `decoded` bytes: image files hold no more
/// than about their pixels (stored deflate blocks, JPEG at quality 100),
/// so twice that and 1 MiB of headers is generous.
pub(super) fn wrapped_limit(decoded: u64) -> u64 {
    decoded.saturating_mul(2).saturating_add(1 << 20)
}

/// Compression around a stored value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Wrap {
    /// The value is stored as is.
    None,
    /// LZ4: frame format, or a block with a 4-byte little-endian size prefix.
    Lz4,
    /// Zstandard frame(s).
    Zstd,
}

impl Wrap {
    /// The codec-name prefix (`lz4`, `zstd`; empty for none).
    pub fn name(self) -> &'static str {
        match self {
            Wrap::None => "",
            Wrap::Lz4 => "lz4",
            Wrap::Zstd => "zstd",
        }
    }

    fn err(self, message: impl Into<String>) -> CodecError {
        CodecError::Decompress { wrap: self.name(), message: message.into() }
    }

    /// A reader of the decompressed value.
    pub(super) fn reader<'a>(self, value: &'a [u8]) -> Result<Box<dyn Read + 'a>, CodecError> {
        match self {
            Wrap::None => Ok(Box::new(value)),
            Wrap::Lz4 if value.starts_with(&LZ4_FRAME_MAGIC) => Ok(Box::new(lz4_flex::frame::FrameDecoder::new(value))),
            Wrap::Lz4 => {
                let mut out = Vec::new();
                self.lz4_block(value, &mut out)?;
                Ok(Box::new(Cursor::new(out)))
            }
            Wrap::Zstd => {
                let decoder = zstd::stream::read::Decoder::with_buffer(value).map_err(|e| self.err(e.to_string()))?;
                Ok(Box::new(decoder))
            }
        }
    }

    /// Decompresses all of `value` into `out` (cleared first), refusing a
    /// value that inflates to more than `limit` bytes (at most
    /// [`MAX_DECOMPRESSED`]) before `out` grows past it.
    pub(super) fn decompress(self, value: &[u8], out: &mut Vec<u8>, limit: u64) -> Result<(), CodecError> {
        out.clear();
        let max = usize::try_from(limit).unwrap_or(usize::MAX).min(MAX_DECOMPRESSED);
        match self {
            Wrap::Lz4 if !value.starts_with(&LZ4_FRAME_MAGIC) => {
                self.lz4_block(value, out)?;
                if out.len() > max {
                    return Err(self.err(format!("value decompresses to more than {max} bytes")));
                }
                Ok(())
            }
            _ => {
                self.reader(value)?.take(max as u64 + 1).read_to_end(out).map_err(|e| self.err(e.to_string()))?;
                if out.len() > max {
                    return Err(self.err(format!("value decompresses to more than {max} bytes")));
                }
                Ok(())
            }
        }
    }

    /// Decompresses `value` straight into `dst`, which it must fill exactly.
    pub(super) fn decompress_exact(self, value: &[u8], dst: &mut [u8]) -> Result<(), CodecError> {
        match self {
            Wrap::None => read_exact_all(&mut &value[..], dst, "raw"),
            Wrap::Lz4 if !value.starts_with(&LZ4_FRAME_MAGIC) => {
                let (size, block) = self.lz4_block_size(value)?;
                if size != dst.len() {
                    return Err(self.err(format!(
                        "block holds {size} bytes but the field expects {} (check the declared dtype and shape)",
                        dst.len()
                    )));
                }
                let n = lz4_flex::block::decompress_into(block, dst).map_err(|e| self.err(e.to_string()))?;
                if n != size {
                    return Err(self.err(format!("block decompressed to {n} bytes, its prefix says {size}")));
                }
                Ok(())
            }
            Wrap::Lz4 => read_exact_all(&mut self.reader(value)?, dst, "lz4"),
            Wrap::Zstd => {
                let n = zstd::bulk::decompress_to_buffer(value, dst).map_err(|e| {
                    self.err(format!("{e} (does the value decompress to exactly {} bytes?)", dst.len()))
                })?;
                if n != dst.len() {
                    return Err(self.err(format!("value decompresses to {n} bytes, expected {}", dst.len())));
                }
                Ok(())
            }
        }
    }

    /// Splits an `lz4.block.compress` value into its stored size and the block.
    fn lz4_block_size(self, value: &[u8]) -> Result<(usize, &[u8]), CodecError> {
        let Some((prefix, block)) = value.split_first_chunk::<4>() else {
            return Err(self.err("value is shorter than the 4-byte size prefix of an lz4 block"));
        };
        let size = u32::from_le_bytes(*prefix) as usize;
        // LZ4 expands at most ~255×; a larger claim means this is not a size-prefixed block.
        if size > block.len().saturating_mul(255).saturating_add(16) || size > MAX_DECOMPRESSED {
            return Err(self.err(format!(
                "neither an LZ4 frame (magic 04 22 4D 18) nor a size-prefixed LZ4 block \
                 (prefix claims {size} bytes from {} compressed)",
                block.len()
            )));
        }
        Ok((size, block))
    }

    fn lz4_block(self, value: &[u8], out: &mut Vec<u8>) -> Result<(), CodecError> {
        let (size, block) = self.lz4_block_size(value)?;
        out.clear();
        out.resize(size, 0);
        let n = lz4_flex::block::decompress_into(block, out).map_err(|e| self.err(e.to_string()))?;
        if n != size {
            return Err(self.err(format!("block decompressed to {n} bytes, its prefix says {size}")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 22, finding 7: a wrapped value inflated to 2 GiB before the
    /// sample limit was checked. The limit now stops it as it inflates.
    #[test]
    fn a_wrapped_value_stops_inflating_at_its_limit() {
        let zeros = vec![0u8; 8 << 20];
        let packed = zstd::bulk::compress(&zeros, 3).unwrap();
        let mut out = Vec::new();
        let err = Wrap::Zstd.decompress(&packed, &mut out, 1 << 20).unwrap_err();
        assert!(err.to_string().contains("more than 1048576 bytes"), "{err}");
        assert!(out.capacity() <= 4 << 20, "grew to {} bytes before refusing", out.capacity());
        Wrap::Zstd.decompress(&packed, &mut out, 16 << 20).unwrap();
        assert_eq!(out, zeros);
        let lz4 = lz4_flex::frame::FrameEncoder::new(Vec::new());
        let mut lz4 = lz4;
        std::io::Write::write_all(&mut lz4, &zeros).unwrap();
        let framed = lz4.finish().unwrap();
        assert!(Wrap::Lz4.decompress(&framed, &mut out, 1 << 20).is_err());
        assert_eq!(wrapped_limit(100), 200 + (1 << 20));
    }
}

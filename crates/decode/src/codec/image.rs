//! PNG and JPEG values, decoded into HWC arrays: PNG with the `png` crate, JPEG
//! with libjpeg-turbo (through csrc/jpeg_turbo.c, with Pillow's settings),
//! optionally scaled in the DCT domain and cropped while decoding.
//!
//! PNG: 1/2/4/8-bit samples become uint8 (sub-byte gray scaled to 0–255, as
//! libpng and Pillow do), 16-bit become native-endian uint16; palettes expand
//! to RGB, and a `tRNS` chunk becomes an alpha channel (palette/RGB → RGBA,
//! gray → gray+alpha). JPEG: one-component images stay gray, everything else
//! becomes RGB. Gray images keep a channel axis: `[h, w, 1]`. EXIF
//! orientation is not applied (as `np.asarray(Image.open(..))` does not). A
//! truncated JPEG is an error, as in Pillow, not a gray-filled image.

use std::io::Cursor;
use stoker_proto::DType;

use super::{ArrayInfo, CodecError};
use crate::libjpeg;

/// The 8-byte PNG signature.
pub(super) const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
/// Largest width or height decoded.
const MAX_SIDE: usize = 1 << 20;

fn png_err(message: impl Into<String>) -> CodecError {
    CodecError::malformed("png", message)
}

fn jpeg_err(message: impl Into<String>) -> CodecError {
    CodecError::malformed("jpeg", message)
}

/// Reads a PNG's IHDR and the chunks before its first IDAT, nothing else.
pub(super) fn probe_png(value: &[u8]) -> Result<ArrayInfo, CodecError> {
    if !value.starts_with(PNG_SIGNATURE) {
        return Err(png_err("missing the PNG signature"));
    }
    let be32 =
        |at: usize| -> Option<u32> { value.get(at..at + 4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]])) };
    if value.get(12..16) != Some(b"IHDR") || be32(8) != Some(13) || value.len() < 8 + 8 + 13 {
        return Err(png_err("first chunk is not a complete IHDR"));
    }
    let width = be32(16).expect("length checked") as u64;
    let height = be32(20).expect("length checked") as u64;
    let depth = value[24];
    let color = value[25];
    if width == 0 || height == 0 {
        return Err(png_err(format!("image is {width}×{height}")));
    }
    let mut trns = false;
    let mut at = 8usize;
    while let (Some(len), Some(kind)) = (be32(at), value.get(at + 4..at + 8)) {
        match kind {
            b"IDAT" => break,
            b"tRNS" => trns = true,
            _ => {}
        }
        at = at.saturating_add(12).saturating_add(len as usize);
    }
    let channels = match (color, depth) {
        (0, 1 | 2 | 4 | 8 | 16) => 1 + u64::from(trns),
        (2, 8 | 16) => 3 + u64::from(trns),
        (3, 1 | 2 | 4 | 8) => 3 + u64::from(trns),
        (4, 8 | 16) => 2,
        (6, 8 | 16) => 4,
        _ => return Err(png_err(format!("invalid color type {color} with bit depth {depth}"))),
    };
    let dtype = if depth == 16 { DType::U16 } else { DType::U8 };
    Ok(ArrayInfo { dtype, shape: vec![height, width, channels] })
}

/// Decodes a PNG into `dst` (exactly the image's bytes); checks it against `expect` first.
pub(super) fn decode_png(value: &[u8], expect: Option<&ArrayInfo>, dst: &mut [u8]) -> Result<ArrayInfo, CodecError> {
    let found = probe_png(value)?;
    check(expect, &found, dst)?;
    // The decoder's own allocations (rows, ancillary chunks), not the image: it goes to `dst`.
    let limits = png::Limits { bytes: (64usize << 20).max(dst.len().saturating_mul(2)) };
    let mut decoder = png::Decoder::new_with_limits(Cursor::new(value), limits);
    // Palette → RGB, sub-byte gray → 0–255, tRNS → alpha: what `probe_png` promised.
    decoder.set_transformations(png::Transformations::EXPAND);
    decoder.ignore_checksums(false); // CRCs and the zlib Adler-32, as libpng/Pillow check them
    let mut reader = decoder.read_info().map_err(|e| png_err(e.to_string()))?;
    let size = reader.output_buffer_size().ok_or_else(|| png_err("image too large to address"))?;
    if size != dst.len() {
        return Err(png_err(format!("decodes to {size} bytes, not the {} its header promises", dst.len())));
    }
    reader.next_frame(dst).map_err(|e| png_err(e.to_string()))?;
    // Through IEND, CRCs checked: a cut file is an error, as in Pillow.
    reader.finish().map_err(|e| png_err(format!("after the image data: {e}")))?;
    if found.dtype == DType::U16 && cfg!(target_endian = "little") {
        for pair in dst.chunks_exact_mut(2) {
            pair.swap(0, 1); // PNG samples are big-endian
        }
    }
    Ok(found)
}

/// DCT-domain scale denominators libjpeg-turbo decodes at (1/1, 1/2, 1/4, 1/8).
pub const JPEG_SCALES: [u32; 4] = [1, 2, 4, 8];

/// A region of a decoded image: rows `top..top + height`, columns `left..left + width`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// First row kept.
    pub top: u32,
    /// First column kept.
    pub left: u32,
    /// Rows kept.
    pub height: u32,
    /// Columns kept.
    pub width: u32,
}

/// Reads a JPEG's markers up to the first scan.
pub(super) fn probe_jpeg(value: &[u8]) -> Result<ArrayInfo, CodecError> {
    probe_jpeg_scaled(value, 1)
}

/// The decoded dtype and shape of a JPEG decoded at 1/`denom` of its size
/// (`denom` one of [`JPEG_SCALES`]; each side becomes `ceil(side / denom)`).
pub fn probe_jpeg_scaled(value: &[u8], denom: u32) -> Result<ArrayInfo, CodecError> {
    assert!(JPEG_SCALES.contains(&denom), "JPEG scale 1/{denom} is not one of 1/1, 1/2, 1/4, 1/8");
    let (width, height, channels) = libjpeg::header(value, denom).map_err(CodecError::Jpeg)?;
    if width == 0 || height == 0 || width as usize > MAX_SIDE || height as usize > MAX_SIDE {
        return Err(jpeg_err(format!("image is {width}×{height}")));
    }
    Ok(ArrayInfo { dtype: DType::U8, shape: vec![u64::from(height), u64::from(width), u64::from(channels)] })
}

/// Decodes a JPEG into `dst` (exactly the image's bytes); checks it against `expect` first.
pub(super) fn decode_jpeg(value: &[u8], expect: Option<&ArrayInfo>, dst: &mut [u8]) -> Result<ArrayInfo, CodecError> {
    let found = probe_jpeg(value)?;
    check(expect, &found, dst)?;
    decode_jpeg_region(value, 1, &found, None, dst)
}

/// Decodes `region` (all of it if `None`) of a JPEG scaled to 1/`denom`
/// (`full`: what [`probe_jpeg_scaled`] says of it at that scale) into `dst`, which holds exactly the region's `height × width × channels` bytes;
/// returns the region's dtype and shape. Rows below the region are never
/// decoded, nor are whole iMCU columns (8–16 pixels at full scale) left or
/// right of it; the pixels equal those of the full decode at that scale.
pub fn decode_jpeg_region(
    value: &[u8],
    denom: u32,
    full: &ArrayInfo,
    region: Option<Region>,
    dst: &mut [u8],
) -> Result<ArrayInfo, CodecError> {
    let (height, width, channels) = (full.shape[0] as u32, full.shape[1] as u32, full.shape[2] as u32);
    let r = region.unwrap_or(Region { top: 0, left: 0, height, width });
    if r.height == 0
        || r.width == 0
        || u64::from(r.top) + u64::from(r.height) > u64::from(height)
        || u64::from(r.left) + u64::from(r.width) > u64::from(width)
    {
        return Err(jpeg_err(format!(
            "region {}×{} at ({}, {}) does not fit in the {height}×{width} image",
            r.height, r.width, r.top, r.left
        )));
    }
    let info =
        ArrayInfo { dtype: DType::U8, shape: vec![u64::from(r.height), u64::from(r.width), u64::from(channels)] };
    assert_eq!(dst.len(), info.bytes(), "JPEG destination must hold exactly the decoded region");
    if !ends_after_last_scan(value) {
        return Err(jpeg_err("truncated: no end-of-image marker after the last scan"));
    }
    libjpeg::decode(value, denom, width, (r.left, r.top, r.width, r.height), channels, dst)
        .map_err(CodecError::Jpeg)?;
    Ok(info)
}

/// Whether an EOI marker (FF D9) follows the last SOS marker (FF DA).
///
/// libjpeg, like browsers, fills a truncated image with gray; Pillow raises.
/// Entropy-coded data stuffs every FF byte (FF 00), so neither marker can
/// occur inside a scan: scanning back from the end for whichever comes first
/// tells a complete file (trailing bytes after EOI allowed) from a cut one.
fn ends_after_last_scan(value: &[u8]) -> bool {
    for at in (0..value.len().saturating_sub(1)).rev() {
        if value[at] == 0xFF {
            match value[at + 1] {
                0xD9 => return true,
                0xDA => return false,
                _ => {}
            }
        }
    }
    false
}

fn check(expect: Option<&ArrayInfo>, found: &ArrayInfo, dst: &[u8]) -> Result<(), CodecError> {
    if let Some(expected) = expect
        && expected != found
    {
        return Err(CodecError::Mismatch { expected: expected.clone(), found: found.clone() });
    }
    assert_eq!(dst.len(), found.bytes(), "image destination must hold exactly the decoded image");
    Ok(())
}

//! Per-field value decoding: a stored value (an LMDB value, say) becomes one
//! C-ordered, native-endian array. A [`Codec`] is a [`Format`] (`raw`, `npy`,
//! `png`, `jpeg`) optionally inside a [`Wrap`] (`lz4`, `zstd`).
//!
//! Decoding writes straight into the caller's memory (a slot row) when the
//! shape is known up front ([`Codec::decode_into`]), or into a reusable
//! [`AlignedBuf`] when a transform follows or the shape varies
//! ([`Codec::decode`]). [`Codec::probe`] reads only headers where the format
//! allows (npy, png, jpeg), so a source can learn shapes without decoding.

#![forbid(unsafe_code)]

mod image;
mod mode;
mod npy;
mod wrap;

use std::fmt;
use std::io::Read;
use std::str::FromStr;

use stoker_proto::DType;

pub use mode::{Convert, Mode};
pub use wrap::Wrap;

/// Element type and shape of a decoded value (C order, native byte order).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ArrayInfo {
    /// Element type.
    pub dtype: DType,
    /// Shape; images are `[height, width, channels]`.
    pub shape: Vec<u64>,
}

impl ArrayInfo {
    /// Bytes of the decoded value (saturating: a size beyond `usize` fails
    /// every limit check instead of wrapping to a small one).
    pub fn bytes(&self) -> usize {
        self.checked_bytes().and_then(|b| usize::try_from(b).ok()).unwrap_or(usize::MAX)
    }

    /// Bytes of the decoded value; `None` when that overflows `u64`.
    pub fn checked_bytes(&self) -> Option<u64> {
        self.shape.iter().try_fold(self.dtype.size() as u64, |acc, &d| acc.checked_mul(d))
    }

    /// Number of elements (saturating).
    pub fn elements(&self) -> usize {
        self.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?)).unwrap_or(usize::MAX)
    }

    /// Fails unless the value fits in `max_bytes` (`[limits] max_sample_bytes`).
    pub fn check_size(&self, max_bytes: u64) -> Result<usize, CodecError> {
        match self.checked_bytes() {
            Some(b) if b <= max_bytes => Ok(usize::try_from(b).expect("at most max_bytes, which fits in memory")),
            bytes => Err(CodecError::TooLarge { found: self.clone(), bytes, limit: max_bytes }),
        }
    }
}

impl fmt::Display for ArrayInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}", self.dtype, self.shape)
    }
}

/// Byte order of stored multi-byte elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ByteOrder {
    /// Least significant byte first.
    Little,
    /// Most significant byte first.
    Big,
}

impl ByteOrder {
    /// The host's byte order.
    pub const NATIVE: ByteOrder = if cfg!(target_endian = "little") { ByteOrder::Little } else { ByteOrder::Big };
}

/// What a `raw` value holds: bytes of a C-ordered array, declared in the config.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RawLayout {
    /// Element type.
    pub dtype: DType,
    /// Byte order of the stored elements.
    pub order: ByteOrder,
    /// Shape of one value.
    pub shape: Vec<u64>,
}

impl RawLayout {
    /// Parses a dtype written as numpy does (`"float32"`, `"uint8"`, `"<f4"`,
    /// `">u2"`, `"|b1"`; no prefix means native) with the value's shape.
    pub fn new(dtype: &str, shape: Vec<u64>) -> Result<RawLayout, CodecError> {
        let (dtype, order) = parse_dtype(dtype)?;
        Ok(RawLayout { dtype, order, shape })
    }

    fn info(&self) -> ArrayInfo {
        ArrayInfo { dtype: self.dtype, shape: self.shape.clone() }
    }
}

/// The value format inside the optional compression wrapper.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Format {
    /// Bytes of an array of declared dtype and shape; the size must match.
    Raw(RawLayout),
    /// A `.npy` file as `np.save` writes it (numeric dtypes, C or Fortran order, either byte order).
    Npy,
    /// A PNG image: 1/2/4/8-bit → uint8, 16-bit → uint16, `[h, w, c]`.
    Png,
    /// A JPEG image (baseline or progressive), uint8 `[h, w, 1 | 3]`.
    Jpeg,
}

impl Format {
    fn name(&self) -> &'static str {
        match self {
            Format::Raw(_) => "raw",
            Format::Npy => "npy",
            Format::Png => "png",
            Format::Jpeg => "jpeg",
        }
    }
}

/// How one field's stored values are decoded: `[wrap+]format`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Codec {
    /// Compression around the value, if any.
    pub wrap: Wrap,
    /// The value's format.
    pub format: Format,
    /// For `png`/`jpeg`: the mode and dtype decoded pixels are converted to.
    pub convert: Convert,
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.wrap {
            Wrap::None => f.write_str(self.format.name()),
            wrap => write!(f, "{}+{}", wrap.name(), self.format.name()),
        }?;
        if !self.convert.is_identity() {
            write!(f, " as {}", self.convert.output_name())?;
        }
        Ok(())
    }
}

/// Errors parsing a codec name or decoding a value.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The codec name is not one stoker knows.
    #[error("unknown codec {0:?}; expected raw, npy, png or jpeg, optionally wrapped as lz4+FORMAT or zstd+FORMAT")]
    UnknownCodec(String),
    /// `raw` was named without a dtype and shape, or a dtype and shape were given to another format.
    #[error("{0}")]
    RawLayout(String),
    /// A dtype string is not a numeric numpy dtype.
    #[error("unsupported dtype {0:?}; stoker serves bool, int8–int64, uint8–uint64 and float16/32/64")]
    Dtype(String),
    /// The value is not valid in its declared format.
    #[error("not a valid {format} value: {message}")]
    Malformed {
        /// `raw`, `npy`, `png`, `jpeg`.
        format: &'static str,
        /// What is wrong.
        message: String,
    },
    /// libjpeg refused a JPEG value (its header, or its data).
    #[error("not a valid jpeg value: {0}")]
    Jpeg(crate::libjpeg::JpegError),
    /// The compression wrapper could not be undone.
    #[error("{wrap} decompression failed: {message}")]
    Decompress {
        /// `lz4` or `zstd`.
        wrap: &'static str,
        /// What failed.
        message: String,
    },
    /// The value's header declares more bytes than the limit (checked before decoding).
    #[error(
        "value decodes to {found}, {size}, more than [limits] max_sample_bytes = {limit} bytes; crop or \
         downscale such values when writing the dataset (or ask the daemon's admin to raise the limit)",
        size = bytes.map_or_else(|| "more than 2^64 bytes".to_string(), |b| format!("{b} bytes"))
    )]
    TooLarge {
        /// What the header declares.
        found: ArrayInfo,
        /// Its bytes; `None` when that does not fit in 64 bits.
        bytes: Option<u64>,
        /// The limit in force.
        limit: u64,
    },
    /// The value decodes to a different dtype or shape than the field expects.
    #[error("value decodes to {found} but the field expects {expected}")]
    Mismatch {
        /// What the field was laid out for.
        expected: ArrayInfo,
        /// What this value holds.
        found: ArrayInfo,
    },
}

impl CodecError {
    fn malformed(format: &'static str, message: impl Into<String>) -> CodecError {
        CodecError::Malformed { format, message: message.into() }
    }
}

impl FromStr for Codec {
    type Err = CodecError;

    /// Parses `png`, `jpeg` (or `jpg`), `npy`, `lz4+npy`, `zstd+png`, …
    /// `raw` needs a layout: use [`Codec::parse`].
    fn from_str(s: &str) -> Result<Codec, CodecError> {
        Codec::parse(s, None)
    }
}

impl Codec {
    /// Parses a codec name; `raw` (and `lz4+raw`, `zstd+raw`) need `raw`, the declared layout.
    pub fn parse(name: &str, raw: Option<RawLayout>) -> Result<Codec, CodecError> {
        let lower = name.trim().to_ascii_lowercase();
        let (wrap, format) = match lower.split_once('+') {
            Some((wrap, format)) => (wrap, format),
            None => ("", lower.as_str()),
        };
        let unknown = || CodecError::UnknownCodec(name.to_string());
        let wrap = match wrap {
            "" => Wrap::None,
            "lz4" => Wrap::Lz4,
            "zstd" | "zst" => Wrap::Zstd,
            _ => return Err(unknown()),
        };
        let format = match (format, raw) {
            ("raw", Some(layout)) => Format::Raw(layout),
            ("raw", None) => {
                return Err(CodecError::RawLayout(format!(
                    "codec {name:?} needs the stored dtype and shape (a raw value carries no header)"
                )));
            }
            ("npy" | "png" | "jpeg" | "jpg", Some(_)) => {
                return Err(CodecError::RawLayout(format!(
                    "codec {name:?} reads dtype and shape from each value; a declared dtype and shape only go with raw"
                )));
            }
            ("npy", None) => Format::Npy,
            ("png", None) => Format::Png,
            ("jpeg" | "jpg", None) => Format::Jpeg,
            _ => return Err(unknown()),
        };
        Ok(Codec { wrap, format, convert: Convert::default() })
    }

    /// Dtype and shape of `value` once decoded, reading only headers where
    /// the format has them (a wrapped image is decompressed, not decoded).
    pub fn probe(&self, value: &[u8]) -> Result<ArrayInfo, CodecError> {
        let decoded = self.probe_decoded(value)?;
        Ok(if self.is_image() { self.convert.output(&decoded) } else { decoded })
    }

    /// Whether values are images (`png`, `jpeg`), which may take a [`Convert`].
    pub fn is_image(&self) -> bool {
        matches!(self.format, Format::Png | Format::Jpeg)
    }

    /// This codec with its decoded images converted by `convert`.
    pub fn with_convert(self, convert: Convert) -> Result<Codec, CodecError> {
        if !self.is_image() && !convert.is_identity() {
            return Err(CodecError::RawLayout(format!(
                "codec {self}: an image mode or dtype only goes with png and jpeg values"
            )));
        }
        Ok(Codec { convert, ..self })
    }

    /// Decodes an image, then converts it (see [`Convert`]) into `out`.
    fn decode_converted(
        &self,
        value: &[u8],
        expect: Option<&ArrayInfo>,
        out: &mut impl DecodeOutput,
        scratch: &mut Vec<u8>,
        max_bytes: u64,
    ) -> Result<ArrayInfo, CodecError> {
        let plain = Codec { convert: Convert::default(), ..self.clone() };
        let decoded = plain.probe(value)?;
        let converted = self.convert.output(&decoded);
        if let Some(expected) = expect
            && *expected != converted
        {
            return Err(CodecError::Mismatch { expected: expected.clone(), found: converted });
        }
        decoded.check_size(max_bytes)?;
        let bytes = converted.check_size(max_bytes)?;
        DECODED.with_borrow_mut(|pixels| -> Result<(), CodecError> {
            plain.decode(value, pixels, scratch, max_bytes)?;
            self.convert.apply(&decoded, pixels.as_slice(), out.alloc(bytes))
        })?;
        Ok(converted)
    }

    /// Dtype and shape of `value` as the format decodes it, before any [`Convert`].
    fn probe_decoded(&self, value: &[u8]) -> Result<ArrayInfo, CodecError> {
        match (&self.format, self.wrap) {
            (Format::Raw(layout), _) => Ok(layout.info()),
            (Format::Npy, Wrap::None) => Ok(npy::Header::parse(value)?.0.info),
            (Format::Npy, wrap) => Ok(npy::Header::read(&mut wrap.reader(value)?)?.info),
            (Format::Png, Wrap::None) => image::probe_png(value),
            (Format::Jpeg, Wrap::None) => image::probe_jpeg(value),
            (format, wrap) => {
                let mut plain = Vec::new();
                wrap.decompress(value, &mut plain, wrap::MAX_DECOMPRESSED as u64)?;
                match format {
                    Format::Png => image::probe_png(&plain),
                    _ => image::probe_jpeg(&plain),
                }
            }
        }
    }

    /// Decodes `value` straight into `dst`, which holds exactly `expect.bytes()`
    /// bytes (a slot row). Headers are checked against `expect` before anything
    /// is written; `scratch` is reused for decompressing wrapped images and
    /// Fortran-ordered npy.
    pub fn decode_into(
        &self,
        value: &[u8],
        expect: &ArrayInfo,
        dst: &mut [u8],
        scratch: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        assert_eq!(dst.len(), expect.bytes(), "decode_into: destination must hold exactly the expected array");
        if self.is_image() && !self.convert.is_identity() {
            // The decoded image is at most 8× the converted one (4 channels of uint16 to 1 of uint8).
            let limit = (expect.bytes() as u64).saturating_mul(8);
            return self.decode_converted(value, Some(expect), &mut SliceOut(dst), scratch, limit).map(drop);
        }
        let check = |found: ArrayInfo| -> Result<(), CodecError> {
            if found == *expect { Ok(()) } else { Err(CodecError::Mismatch { expected: expect.clone(), found }) }
        };
        match (&self.format, self.wrap) {
            (Format::Raw(layout), Wrap::None) => {
                check(layout.info())?;
                raw_from_slice(layout, value, dst)
            }
            (Format::Raw(layout), wrap) => {
                check(layout.info())?;
                wrap.decompress_exact(value, dst)?;
                swap_if_needed(dst, layout.dtype, layout.order);
                Ok(())
            }
            (Format::Npy, Wrap::None) => {
                let (header, body) = npy::Header::parse(value)?;
                check(header.info.clone())?;
                header.copy_body(body, dst)
            }
            (Format::Npy, wrap) => {
                let mut reader = wrap.reader(value)?;
                let header = npy::Header::read(&mut reader)?;
                check(header.info.clone())?;
                header.read_body(&mut reader, dst, scratch)
            }
            (Format::Png | Format::Jpeg, wrap) => {
                let plain: &[u8] = match wrap {
                    Wrap::None => value,
                    _ => {
                        wrap.decompress(value, scratch, wrap::wrapped_limit(expect.bytes() as u64))?;
                        scratch
                    }
                };
                if let Format::Png = self.format {
                    image::decode_png(plain, Some(expect), dst).map(drop)
                } else {
                    image::decode_jpeg(plain, Some(expect), dst).map(drop)
                }
            }
        }
    }

    /// Decodes `value` into `out` (resized to fit) and returns what it holds.
    /// For variable shapes and for values a transform works on next; a
    /// wrapped value is decompressed once. The size the header declares is
    /// checked against `max_bytes` before `out` grows.
    pub fn decode(
        &self,
        value: &[u8],
        out: &mut impl DecodeOutput,
        scratch: &mut Vec<u8>,
        max_bytes: u64,
    ) -> Result<ArrayInfo, CodecError> {
        if self.is_image() && !self.convert.is_identity() {
            return self.decode_converted(value, None, out, scratch, max_bytes);
        }
        if let Format::Raw(layout) = &self.format {
            let info = layout.info();
            let bytes = info.check_size(max_bytes)?;
            self.decode_into(value, &info, out.alloc(bytes), scratch)?;
            return Ok(info);
        }
        let plain: &[u8] = match self.wrap {
            Wrap::None => value,
            wrap => {
                wrap.decompress(value, scratch, wrap::wrapped_limit(max_bytes))?;
                scratch
            }
        };
        match self.format {
            Format::Npy => {
                let (header, body) = npy::Header::parse(plain)?;
                let bytes = header.info.check_size(max_bytes)?;
                // A header claiming more than the body holds fails before the allocation.
                header.check_body_len(body, bytes)?;
                header.copy_body(body, out.alloc(bytes))?;
                Ok(header.info)
            }
            Format::Png => {
                let info = image::probe_png(plain)?;
                let bytes = info.check_size(max_bytes)?;
                image::decode_png(plain, Some(&info), out.alloc(bytes))
            }
            _ => {
                let info = image::probe_jpeg(plain)?;
                let bytes = info.check_size(max_bytes)?;
                image::decode_jpeg(plain, Some(&info), out.alloc(bytes))
            }
        }
    }

    /// [`Codec::decode`], except that a JPEG is decoded scaled in the DCT
    /// domain (libjpeg-turbo's 1/2, 1/4 or 1/8) to the smallest size still at
    /// least `at_least` (height, width), choosing the scale as Pillow's
    /// `Image.draft` does, for a resize to that size that follows; other
    /// formats, and JPEGs less than twice as large, decode whole.
    pub fn decode_at_least(
        &self,
        value: &[u8],
        out: &mut impl DecodeOutput,
        scratch: &mut Vec<u8>,
        max_bytes: u64,
        at_least: (u64, u64),
    ) -> Result<ArrayInfo, CodecError> {
        if !matches!(self.format, Format::Jpeg) || !self.convert.is_identity() {
            return self.decode(value, out, scratch, max_bytes);
        }
        let plain: &[u8] = match self.wrap {
            Wrap::None => value,
            wrap => {
                wrap.decompress(value, scratch, wrap::wrapped_limit(max_bytes))?;
                scratch
            }
        };
        let full = image::probe_jpeg(plain)?;
        let (h, w) = (full.shape[0], full.shape[1]);
        // Pillow's `Image.draft` rule: the largest denominator d with d × target
        // ≤ the image on both sides (the scaled side, ceil(side / d), is then ≥ target).
        let denom = image::JPEG_SCALES
            .into_iter()
            .rev()
            .find(|&d| at_least.0.saturating_mul(u64::from(d)) <= h && at_least.1.saturating_mul(u64::from(d)) <= w)
            .unwrap_or(1);
        let info = if denom == 1 { full } else { image::probe_jpeg_scaled(plain, denom)? };
        let bytes = info.check_size(max_bytes)?;
        image::decode_jpeg_region(plain, denom, &info, None, out.alloc(bytes))
    }
    /// [`Codec::decode`], except that a JPEG (with no mode or dtype
    /// conversion) decodes only the window `crop` picks from its (height,
    /// width), skipping the rows below it and the iMCU columns beside it.
    /// Returns the whole image's dtype and shape, and the window's shape when
    /// `out` holds only the window (`None`: `out` holds the whole image, for
    /// other formats, where `crop` picks nothing, or where the window covers
    /// more than [`CROPPED_DECODE_MAX_AREA`] of the image).
    pub fn decode_cropped(
        &self,
        value: &[u8],
        out: &mut impl DecodeOutput,
        scratch: &mut Vec<u8>,
        max_bytes: u64,
        crop: impl FnOnce(u64, u64) -> Option<(u64, u64, u64, u64)>,
    ) -> Result<(ArrayInfo, Option<Vec<u64>>), CodecError> {
        if !matches!(self.format, Format::Jpeg) || !self.convert.is_identity() {
            return Ok((self.decode(value, out, scratch, max_bytes)?, None));
        }
        let plain: &[u8] = match self.wrap {
            Wrap::None => value,
            wrap => {
                wrap.decompress(value, scratch, wrap::wrapped_limit(max_bytes))?;
                scratch
            }
        };
        let full = image::probe_jpeg(plain)?;
        let full_bytes = full.check_size(max_bytes)?;
        let window = crop(full.shape[0], full.shape[1]).and_then(|(top, left, height, width)| {
            let fits = top.checked_add(height).is_some_and(|b| b <= full.shape[0])
                && left.checked_add(width).is_some_and(|r| r <= full.shape[1]);
            // The image is at most 2^20 a side (`probe_jpeg`), so these fit u32.
            // libjpeg-turbo's cropped decode costs more per pixel than a
            // whole decode (rows above are still entropy-decoded, the output
            // goes through a row buffer): it pays only for small windows.
            let small = height.saturating_mul(width) as f64
                <= CROPPED_DECODE_MAX_AREA * full.shape[0].saturating_mul(full.shape[1]) as f64;
            (fits && small).then_some(image::Region {
                top: top as u32,
                left: left as u32,
                height: height as u32,
                width: width as u32,
            })
        });
        let Some(region) = window else {
            image::decode_jpeg_region(plain, 1, &full, None, out.alloc(full_bytes))?;
            return Ok((full, None));
        };
        let shape = vec![u64::from(region.height), u64::from(region.width), full.shape[2]];
        let bytes = ArrayInfo { dtype: full.dtype, shape: shape.clone() }.bytes();
        image::decode_jpeg_region(plain, 1, &full, Some(region), out.alloc(bytes))?;
        Ok((full, Some(shape)))
    }
}

/// The largest share of a JPEG's area that [`Codec::decode_cropped`] decodes
/// as a window; a larger crop decodes the whole image. Measured with
/// `benches/lmdb_jpeg.py`'s images, one worker thread, crop 224 × 224 then
/// flip, normalize and CHW (docs/performance-images.md): from 256 × 256
/// (77% of the area) the whole decode is ≈1.35× faster, from 320 × 320 (49%)
/// they are even, from 384 × 384 (34%) and 512 × 512 (19%) the cropped decode
/// is ≈1.2× and ≈1.5× faster.
pub const CROPPED_DECODE_MAX_AREA: f64 = 0.5;

/// A reusable buffer [`Codec::decode`] sizes to the decoded value.
pub trait DecodeOutput {
    /// Makes the buffer `len` bytes long (contents unspecified) and returns it.
    fn alloc(&mut self, len: usize) -> &mut [u8];
}

thread_local! {
    /// Decoded pixels awaiting their [`Convert`], one buffer per worker thread.
    static DECODED: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::default();
}

/// A destination of exactly the right size (a slot row).
struct SliceOut<'a>(&'a mut [u8]);

impl DecodeOutput for SliceOut<'_> {
    fn alloc(&mut self, len: usize) -> &mut [u8] {
        assert_eq!(self.0.len(), len, "the destination holds exactly the converted image");
        self.0
    }
}

impl DecodeOutput for AlignedBuf {
    fn alloc(&mut self, len: usize) -> &mut [u8] {
        self.resize(len)
    }
}

impl DecodeOutput for Vec<u8> {
    fn alloc(&mut self, len: usize) -> &mut [u8] {
        self.clear();
        self.resize(len, 0);
        self
    }
}

/// Names the format of a stored value from its first bytes, for `stoker
/// inspect`: `png`, `jpeg`, `npy`, `lz4`, `zstd` or `unknown`.
pub fn sniff(value: &[u8]) -> &'static str {
    if value.starts_with(image::PNG_SIGNATURE) {
        "png"
    } else if value.starts_with(&[0xFF, 0xD8, 0xFF]) {
        "jpeg"
    } else if value.starts_with(npy::MAGIC) {
        "npy"
    } else if value.starts_with(&wrap::LZ4_FRAME_MAGIC) {
        "lz4"
    } else if value.starts_with(&wrap::ZSTD_MAGIC) {
        "zstd"
    } else {
        "unknown"
    }
}

/// A reusable byte buffer whose contents start 16-byte aligned, so decoded
/// u16/f32 pixels can be viewed as such (the resizer insists on it).
#[derive(Debug, Default)]
pub struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

/// Alignment of [`AlignedBuf`] contents.
pub const BUF_ALIGN: usize = 16;

impl AlignedBuf {
    /// An empty buffer.
    pub fn new() -> AlignedBuf {
        AlignedBuf::default()
    }

    /// Makes the buffer `len` bytes long (contents unspecified) and returns it.
    pub fn resize(&mut self, len: usize) -> &mut [u8] {
        if self.raw.len() < len + BUF_ALIGN {
            self.raw.resize(len + BUF_ALIGN, 0);
        }
        // The allocation may have moved: recompute where aligned memory starts.
        let addr = self.raw.as_ptr().addr();
        self.start = addr.next_multiple_of(BUF_ALIGN) - addr;
        self.len = len;
        &mut self.raw[self.start..self.start + len]
    }

    /// The contents.
    pub fn as_slice(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }

    /// The contents, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }

    /// Bytes held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes allocated (what the buffer keeps between uses).
    pub fn capacity(&self) -> usize {
        self.raw.capacity()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

fn raw_from_slice(layout: &RawLayout, value: &[u8], dst: &mut [u8]) -> Result<(), CodecError> {
    if value.len() != dst.len() {
        return Err(CodecError::malformed(
            "raw",
            format!(
                "value has {} bytes but {} {:?} needs {}; check the declared dtype and shape",
                value.len(),
                layout.dtype,
                layout.shape,
                dst.len()
            ),
        ));
    }
    dst.copy_from_slice(value);
    swap_if_needed(dst, layout.dtype, layout.order);
    Ok(())
}

/// Reverses each element's bytes when `order` is not the host's.
fn swap_if_needed(bytes: &mut [u8], dtype: DType, order: ByteOrder) {
    if order != ByteOrder::NATIVE && dtype.size() > 1 {
        for element in bytes.chunks_exact_mut(dtype.size()) {
            element.reverse();
        }
    }
}

/// Parses a numpy dtype string: a name (`"float32"`) or a type string
/// (`"<f4"`, `">i2"`, `"|u1"`, `"=f8"`, `"f4"`).
pub fn parse_dtype(s: &str) -> Result<(DType, ByteOrder), CodecError> {
    if let Some(dtype) = DType::from_numpy_name(s) {
        return Ok((dtype, ByteOrder::NATIVE));
    }
    let (order, code) = match s.as_bytes().first() {
        Some(b'<') => (ByteOrder::Little, &s[1..]),
        Some(b'>') => (ByteOrder::Big, &s[1..]),
        Some(b'|' | b'=') => (ByteOrder::NATIVE, &s[1..]),
        _ => (ByteOrder::NATIVE, s),
    };
    let dtype = DType::from_type_code(code).ok_or_else(|| CodecError::Dtype(s.to_string()))?;
    Ok((dtype, order))
}

/// Reads until `buf` is full, then checks nothing follows.
fn read_exact_all(reader: &mut dyn Read, buf: &mut [u8], wrap: &'static str) -> Result<(), CodecError> {
    let err = |message: String| CodecError::Decompress { wrap, message };
    reader.read_exact(buf).map_err(|e| err(format!("decompressed data ends early: {e}")))?;
    let mut probe = [0u8; 1];
    match reader.read(&mut probe) {
        Ok(0) => Ok(()),
        Ok(_) => Err(err(format!("decompressed data is longer than the expected {} bytes", buf.len()))),
        Err(e) => Err(err(e.to_string())),
    }
}

#[cfg(test)]
mod tests;

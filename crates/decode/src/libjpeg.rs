//! Safe wrappers over csrc/jpeg_turbo.c, the JPEG decoder over libjpeg-turbo's
//! libjpeg API (see `codec::image` for what is decoded how). The shim turns
//! libjpeg's errors (reported by longjmp) into return codes and messages; its
//! jumps stay inside C frames.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int};

unsafe extern "C" {
    fn stoker_jpeg_header(
        data: *const u8,
        len: usize,
        denom: c_int,
        width: *mut u32,
        height: *mut u32,
        channels: *mut u32,
        msg: *mut c_char,
        msg_len: usize,
    ) -> c_int;
    fn stoker_jpeg_decode(
        data: *const u8,
        len: usize,
        denom: c_int,
        left: u32,
        top: u32,
        width: u32,
        height: u32,
        channels: u32,
        dst: *mut u8,
        dst_len: usize,
        row: *mut u8,
        row_len: usize,
        msg: *mut c_char,
        msg_len: usize,
    ) -> c_int;
}

/// Why libjpeg (or the shim's checks around it) refused a JPEG: the shim's
/// message, by the stage that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JpegError {
    /// Reading the header (markers up to the first scan) failed.
    #[error("{message}")]
    Header {
        /// libjpeg's message.
        message: String,
    },
    /// Decoding the region failed (corrupt data, or the region, channels or
    /// destination disagree with the header).
    #[error("{message}")]
    Decode {
        /// libjpeg's or the shim's message.
        message: String,
    },
}

/// The message the shim left in `msg` (NUL-terminated, or the whole buffer).
fn message(msg: &[u8]) -> String {
    let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
    let text = String::from_utf8_lossy(&msg[..end]).into_owned();
    if text.is_empty() { "libjpeg failed without a message".into() } else { text }
}

/// `(width, height, channels)` of the image decoded at scale 1/`denom` (1, 2,
/// 4 or 8); channels are 1 (grayscale) or 3 (RGB, from YCbCr, RGB or CMYK).
pub fn header(value: &[u8], denom: u32) -> Result<(u32, u32, u32), JpegError> {
    let (mut width, mut height, mut channels) = (0u32, 0u32, 0u32);
    let mut msg = [0u8; 256];
    // SAFETY: `value` is a live slice the shim only reads, for its length; the
    // out-pointers are valid u32 locals; `msg` is writable for its length.
    let rc = unsafe {
        stoker_jpeg_header(
            value.as_ptr(),
            value.len(),
            denom as c_int,
            &mut width,
            &mut height,
            &mut channels,
            msg.as_mut_ptr().cast(),
            msg.len(),
        )
    };
    if rc != 0 { Err(JpegError::Header { message: message(&msg) }) } else { Ok((width, height, channels)) }
}

/// Decodes the region `(left, top, width, height)` of the image scaled to
/// 1/`denom` into `dst` (exactly `height × width × channels` bytes; the shim
/// checks the region, the channels and `dst.len()` against the header);
/// `full_width` is the scaled image's width, from [`header`].
pub fn decode(
    value: &[u8],
    denom: u32,
    full_width: u32,
    (left, top, width, height): (u32, u32, u32, u32),
    channels: u32,
    dst: &mut [u8],
) -> Result<(), JpegError> {
    let mut row = vec![0u8; 4 * full_width as usize];
    let mut msg = [0u8; 256];
    // SAFETY: `value` is only read, for its length. `dst`, `row` and `msg`
    // are writable for the lengths passed; the shim writes at most
    // `dst.len()` bytes to `dst` (it checks the region against that), one
    // scaled row of at most 4 bytes per pixel to `row` (it checks `row.len()`
    // against the header's width) and a NUL-terminated message to `msg`.
    let rc = unsafe {
        stoker_jpeg_decode(
            value.as_ptr(),
            value.len(),
            denom as c_int,
            left,
            top,
            width,
            height,
            channels,
            dst.as_mut_ptr(),
            dst.len(),
            row.as_mut_ptr(),
            row.len(),
            msg.as_mut_ptr().cast(),
            msg.len(),
        )
    };
    if rc != 0 { Err(JpegError::Decode { message: message(&msg) }) } else { Ok(()) }
}

//! Resizing with `fast_image_resize` (SIMD convolution): uint8, uint16 and
//! float32 pixels of 1–4 channels, channels treated independently (no alpha
//! premultiplication), the view's crop passed as the source crop box so a
//! crop before a resize costs no copy.

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions};
use stoker_proto::DType;

use super::{Backing, Filter, Scratch, View};

/// A resizer whose internal buffers are reused between samples.
#[derive(Debug, Default)]
pub(super) struct Resizer(fast_image_resize::Resizer);

fn pixel_type(dtype: DType, channels: u64) -> Option<PixelType> {
    Some(match (dtype, channels) {
        (DType::U8, 1) => PixelType::U8,
        (DType::U8, 2) => PixelType::U8x2,
        (DType::U8, 3) => PixelType::U8x3,
        (DType::U8, 4) => PixelType::U8x4,
        (DType::U16, 1) => PixelType::U16,
        (DType::U16, 2) => PixelType::U16x2,
        (DType::U16, 3) => PixelType::U16x3,
        (DType::U16, 4) => PixelType::U16x4,
        (DType::F32, 1) => PixelType::F32,
        (DType::F32, 2) => PixelType::F32x2,
        (DType::F32, 3) => PixelType::F32x3,
        (DType::F32, 4) => PixelType::F32x4,
        _ => return None,
    })
}

/// Why a resize cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResizeError {
    /// The pixels are of a type, or have a number of channels, resize does not handle.
    #[error(
        "resize handles uint8, uint16 and float32 data with 1–4 channels, not {dtype} with {shown} channels \
         (add to_f32 before resize for other types)",
        shown = channels.map_or("varying".to_string(), |c| c.to_string())
    )]
    Unsupported {
        /// The pixels' type.
        dtype: DType,
        /// Their channels; `None` where they vary between samples.
        channels: Option<u64>,
    },
    /// A width or height beyond `u32`.
    #[error("{what} {size} is beyond what resize handles (2^32 - 1)")]
    TooLarge {
        /// `width` or `height`.
        what: &'static str,
        /// The size.
        size: u64,
    },
    /// `fast_image_resize` refused the source image.
    #[error("resize source: {0}")]
    Source(fast_image_resize::ImageBufferError),
    /// `fast_image_resize` refused the target image.
    #[error("resize target: {0}")]
    Target(fast_image_resize::ImageBufferError),
    /// `fast_image_resize` failed to resize.
    #[error("resize: {0}")]
    Failed(fast_image_resize::ResizeError),
}

/// Whether pixels of `dtype` with `channels` (if known) can be resized.
pub(super) fn check(dtype: DType, channels: Option<u64>) -> Result<(), ResizeError> {
    let channels_ok = channels.is_none_or(|c| (1..=4).contains(&c));
    if matches!(dtype, DType::U8 | DType::U16 | DType::F32) && channels_ok {
        Ok(())
    } else {
        Err(ResizeError::Unsupported { dtype, channels })
    }
}

/// Resizes `view` to `height × width` into the scratch buffer it does not occupy.
pub(super) fn resize_to_scratch(
    input: &[u8],
    view: View,
    height: u64,
    width: u64,
    filter: Filter,
    scratch: &mut Scratch,
) -> Result<View, ResizeError> {
    check(view.dtype, Some(view.c))?;
    debug_assert!(!view.flipped, "flips are settled before resizing");
    let pixel = pixel_type(view.dtype, view.c).expect("checked above");
    let Scratch { a, b, resizer } = scratch;
    let (src, out, backing) = match view.backing {
        Backing::Input => (input, a, Backing::A),
        Backing::A => (a.as_slice(), b, Backing::B),
        Backing::B => (b.as_slice(), a, Backing::A),
    };
    let full_w = view.stride / view.c;
    let full_h = src.len() as u64 / (view.stride * view.dtype.size() as u64);
    let u32_of = |what: &'static str, size: u64| u32::try_from(size).map_err(|_| ResizeError::TooLarge { what, size });
    let source =
        ImageRef::new(u32_of("width", full_w)?, u32_of("height", full_h)?, src, pixel).map_err(ResizeError::Source)?;
    let bytes = (height * width * view.c) as usize * view.dtype.size();
    let mut target = Image::from_slice_u8(u32_of("width", width)?, u32_of("height", height)?, out.resize(bytes), pixel)
        .map_err(ResizeError::Target)?;
    let (top, left) = view.origin();
    let algorithm = match filter {
        Filter::Nearest => ResizeAlg::Nearest,
        Filter::Bilinear => ResizeAlg::Convolution(FilterType::Bilinear),
        Filter::Bicubic => ResizeAlg::Convolution(FilterType::CatmullRom),
        Filter::Lanczos3 => ResizeAlg::Convolution(FilterType::Lanczos3),
    };
    let options = ResizeOptions::new().resize_alg(algorithm).use_alpha(false).crop(
        left as f64,
        top as f64,
        view.w as f64,
        view.h as f64,
    );
    resizer.0.resize(&source, &mut target, &options).map_err(ResizeError::Failed)?;
    Ok(View {
        backing,
        offset: 0,
        h: height,
        w: width,
        c: view.c,
        stride: width * view.c,
        flipped: false,
        dtype: view.dtype,
    })
}

//! Image mode and dtype conversion after decoding, as Pillow's
//! `Image.open(f).convert(mode)` does, so a folder of mixed gray, RGB, RGBA,
//! palette and 16-bit images comes out uniform.
//!
//! The decoders give `[h, w, c]` with `c` = 1 (gray), 2 (gray + alpha), 3
//! (RGB; palettes expanded) or 4 (RGBA), uint8 or (16-bit PNG) uint16. A
//! [`Convert`] then works in two steps:
//!
//! 1. **Depth.** When the output is uint8 (the default for `L`/`RGB`/`RGBA`),
//!    16-bit samples become 8-bit first exactly as Pillow opens them: a
//!    one-channel 16-bit image is Pillow's `"I;16"`, whose conversion to
//!    `L`/`RGB`/`RGBA` *clips* at 255 (`Convert.c`: `I16_L` and friends); 16-bit
//!    gray + alpha, RGB and RGBA are opened by Pillow keeping the high byte
//!    (`v >> 8`, rawmodes `LA;16B`, `RGB;16B`, `RGBA;16B`). For uint16 and
//!    float32 output, 16-bit samples keep their full precision.
//! 2. **Channels**, as Pillow's `Convert.c`: to `L`, RGB becomes ITU-R 601-2
//!    luma with Pillow's fixed-point rounding, `(R·19595 + G·38470 + B·7471 +
//!    0x8000) >> 16`, alpha is dropped; to `RGB`, gray is replicated and alpha
//!    dropped (no premultiplication); to `RGBA`, gray is replicated and a
//!    missing alpha is opaque (255, or 65535 in 16-bit).
//!
//! Then the value range: uint8 → uint16 multiplies by 257 (255 → 65535, the
//! inverse of `>> 8`, as libpng and scikit-image's `img_as_uint` scale);
//! float32 divides by the stored type's maximum (255 or 65535), into `[0, 1]`,
//! as torchvision's `ToTensor()` and `v2.ToDtype(torch.float32, scale=True)`
//! do (Pillow itself has no normalised float mode: its `"F"` keeps 0–255).
//!
//! Known difference: a 16-bit gray PNG with a `tRNS` colour key decodes to
//! gray + alpha, so its uint8 conversion keeps the high byte where Pillow
//! (which opens it as `"I;16"` plus a transparency key) clips.

use std::str::FromStr;

use stoker_proto::DType;

use super::{ArrayInfo, CodecError};

/// The channel layout an image field is delivered in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Mode {
    /// As decoded: 1, 2, 3 or 4 channels.
    #[default]
    Unchanged,
    /// One channel: luma.
    L,
    /// Three channels.
    Rgb,
    /// Four channels.
    Rgba,
}

impl Mode {
    /// The name used in configs and on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Unchanged => "unchanged",
            Mode::L => "L",
            Mode::Rgb => "RGB",
            Mode::Rgba => "RGBA",
        }
    }
}

impl FromStr for Mode {
    type Err = CodecError;

    fn from_str(s: &str) -> Result<Mode, CodecError> {
        match s {
            "unchanged" => Ok(Mode::Unchanged),
            "L" => Ok(Mode::L),
            "RGB" => Ok(Mode::Rgb),
            "RGBA" => Ok(Mode::Rgba),
            _ => Err(CodecError::RawLayout(format!(
                "image mode {s:?} is not one stoker knows; use \"unchanged\", \"L\", \"RGB\" or \"RGBA\""
            ))),
        }
    }
}

/// What an image field's decoded pixels are converted to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Convert {
    /// Channel layout.
    pub mode: Mode,
    /// Element type; `None`: uint8 for `L`/`RGB`/`RGBA`, as decoded for `unchanged`.
    pub dtype: Option<DType>,
}

impl Convert {
    /// A conversion to `mode` (a name as [`Mode`] parses) and `dtype`
    /// (`"uint8"`, `"uint16"` or `"float32"`).
    pub fn parse(mode: Option<&str>, dtype: Option<&str>) -> Result<Convert, CodecError> {
        let mode = mode.map(str::parse).transpose()?.unwrap_or_default();
        let dtype = match dtype {
            None => None,
            Some("uint8") => Some(DType::U8),
            Some("uint16") => Some(DType::U16),
            Some("float32") => Some(DType::F32),
            Some(other) => {
                return Err(CodecError::RawLayout(format!(
                    "image dtype {other:?} is not one stoker converts to; use \"uint8\", \"uint16\" or \"float32\""
                )));
            }
        };
        Ok(Convert { mode, dtype })
    }

    /// `"RGB"`, `"L uint16"`, `"float32"`: what [`Convert::output`] makes, for messages.
    pub fn output_name(&self) -> String {
        match (self.mode, self.dtype) {
            (mode, None) => mode.name().to_string(),
            (Mode::Unchanged, Some(dtype)) => dtype.to_string(),
            (mode, Some(dtype)) => format!("{} {dtype}", mode.name()),
        }
    }

    /// Whether the decoded pixels are delivered as they are.
    pub fn is_identity(&self) -> bool {
        self.mode == Mode::Unchanged && self.dtype.is_none()
    }

    /// What a decoded image `decoded` (`[h, w, c]`, uint8 or uint16) becomes.
    pub fn output(&self, decoded: &ArrayInfo) -> ArrayInfo {
        let (h, w, c) = match decoded.shape[..] {
            [h, w, c] => (h, w, c),
            _ => return decoded.clone(),
        };
        let channels = match self.mode {
            Mode::Unchanged => c,
            Mode::L => 1,
            Mode::Rgb => 3,
            Mode::Rgba => 4,
        };
        let dtype = match (self.dtype, self.mode) {
            (Some(dtype), _) => dtype,
            (None, Mode::Unchanged) => decoded.dtype,
            (None, _) => DType::U8,
        };
        ArrayInfo { dtype, shape: vec![h, w, channels] }
    }

    /// Converts `src` (the decoded image `decoded`) into `dst`, which holds
    /// exactly `self.output(decoded).bytes()` bytes.
    pub fn apply(&self, decoded: &ArrayInfo, src: &[u8], dst: &mut [u8]) -> Result<(), CodecError> {
        let out = self.output(decoded);
        let bad = |message: String| CodecError::Malformed { format: "image", message };
        let c = match decoded.shape[..] {
            [_, _, c @ 1..=4] => c as usize,
            _ => return Err(bad(format!("cannot convert {decoded}: not [h, w, 1..4]"))),
        };
        let wide = match decoded.dtype {
            DType::U8 => false,
            DType::U16 => true,
            other => return Err(bad(format!("cannot convert {other} pixels; images are uint8 or uint16"))),
        };
        if src.len() != decoded.bytes() || dst.len() != out.bytes() {
            return Err(bad(format!("buffer sizes do not match {decoded} → {out}")));
        }
        let oc = out.shape[2] as usize;
        // Samples kept 16-bit only when the output can hold them.
        let keep16 = wide && out.dtype != DType::U8;
        let max: u32 = if keep16 { 65535 } else { 255 };
        let to_domain = |v: u32| -> u32 {
            match (wide, keep16) {
                (true, false) if c == 1 => v.min(255),
                (true, false) => v >> 8,
                _ => v,
            }
        };
        let pixels = src.len() / (c * if wide { 2 } else { 1 });
        let sample = |i: usize| -> u32 {
            if wide { u32::from(u16::from_ne_bytes([src[2 * i], src[2 * i + 1]])) } else { u32::from(src[i]) }
        };
        let out_size = out.dtype.size();
        for p in 0..pixels {
            let mut px = [0u32; 4];
            for (k, v) in px.iter_mut().enumerate().take(c) {
                *v = to_domain(sample(p * c + k));
            }
            let (gray, rgb, alpha) = match c {
                1 => (px[0], [px[0]; 3], max),
                2 => (px[0], [px[0]; 3], px[1]),
                3 => (luma(px[0], px[1], px[2]), [px[0], px[1], px[2]], max),
                _ => (luma(px[0], px[1], px[2]), [px[0], px[1], px[2]], px[3]),
            };
            let mut res = [0u32; 4];
            match self.mode {
                Mode::Unchanged => res = px,
                Mode::L => res[0] = gray,
                Mode::Rgb => res[..3].copy_from_slice(&rgb),
                Mode::Rgba => {
                    res[..3].copy_from_slice(&rgb);
                    res[3] = alpha;
                }
            }
            let row = &mut dst[p * oc * out_size..(p + 1) * oc * out_size];
            for (k, &v) in res.iter().enumerate().take(oc) {
                let at = &mut row[k * out_size..(k + 1) * out_size];
                match out.dtype {
                    DType::U8 => at[0] = v as u8,
                    DType::U16 => {
                        let v = if keep16 { v } else { v * 257 };
                        at.copy_from_slice(&(v as u16).to_ne_bytes());
                    }
                    _ => at.copy_from_slice(&(v as f32 / max as f32).to_ne_bytes()),
                }
            }
        }
        Ok(())
    }
}

/// ITU-R 601-2 luma with Pillow's rounding (`L24` in `Convert.c`); exact for
/// 8-bit samples, and the same weights for 16-bit ones.
fn luma(r: u32, g: u32, b: u32) -> u32 {
    ((u64::from(r) * 19595 + u64::from(g) * 38470 + u64::from(b) * 7471 + 0x8000) >> 16) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(dtype: DType, c: u64) -> ArrayInfo {
        ArrayInfo { dtype, shape: vec![1, 2, c] }
    }

    fn run(convert: Convert, decoded: &ArrayInfo, src: &[u8]) -> Vec<u8> {
        let mut dst = vec![0u8; convert.output(decoded).bytes()];
        convert.apply(decoded, src, &mut dst).unwrap();
        dst
    }

    #[test]
    fn rgb_to_l_uses_pillows_rounding() {
        let c = Convert { mode: Mode::L, dtype: None };
        assert_eq!(run(c, &info(DType::U8, 3), &[255, 255, 255, 10, 200, 30]), vec![255, 124]);
    }

    #[test]
    fn gray_expands_and_alpha_is_opaque() {
        let c = Convert { mode: Mode::Rgba, dtype: None };
        assert_eq!(run(c, &info(DType::U8, 1), &[7, 9]), vec![7, 7, 7, 255, 9, 9, 9, 255]);
        let c = Convert { mode: Mode::Rgba, dtype: None };
        assert_eq!(run(c, &info(DType::U8, 2), &[7, 1, 9, 2]), vec![7, 7, 7, 1, 9, 9, 9, 2]);
    }

    #[test]
    fn sixteen_bit_gray_clips_like_pillow_and_rgb_keeps_the_high_byte() {
        let c = Convert { mode: Mode::L, dtype: None };
        let src: Vec<u8> = [100u16, 1000].iter().flat_map(|v| v.to_ne_bytes()).collect();
        assert_eq!(run(c, &info(DType::U16, 1), &src), vec![100, 255]);
        let c = Convert { mode: Mode::Rgb, dtype: None };
        let src: Vec<u8> = [0x1234u16, 0xff00, 0x0100, 1, 2, 3].iter().flat_map(|v| v.to_ne_bytes()).collect();
        assert_eq!(run(c, &info(DType::U16, 3), &src), vec![0x12, 0xff, 0x01, 0, 0, 0]);
    }

    #[test]
    fn dtypes_scale_to_the_full_range() {
        let c = Convert { mode: Mode::Unchanged, dtype: Some(DType::U16) };
        let out = run(c, &info(DType::U8, 1), &[255, 1]);
        assert_eq!(out, [65535u16, 257].iter().flat_map(|v| v.to_ne_bytes()).collect::<Vec<u8>>());
        let c = Convert { mode: Mode::Unchanged, dtype: Some(DType::F32) };
        let out = run(c, &info(DType::U8, 1), &[255, 51]);
        assert_eq!(out, [1.0f32, 0.2].iter().flat_map(|v| v.to_ne_bytes()).collect::<Vec<u8>>());
    }

    #[test]
    fn names_parse_and_bad_ones_say_what_to_use() {
        assert_eq!(
            Convert::parse(Some("RGB"), Some("float32")).unwrap().output(&info(DType::U8, 1)),
            ArrayInfo { dtype: DType::F32, shape: vec![1, 2, 3] }
        );
        assert!(Convert::parse(Some("rgb"), None).unwrap_err().to_string().contains("\"RGB\""));
        assert!(Convert::parse(None, Some("int8")).unwrap_err().to_string().contains("float32"));
    }
}

//! Codec tests against fixtures written by Pillow, numpy, lz4 and zstandard
//! (`testdata/make.py`; `testdata/manifest.json` lists them).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use stoker_proto::DType;

use super::*;

#[derive(Debug, Deserialize)]
struct Fixture {
    file: String,
    codec: String,
    dtype: String,
    shape: Vec<u64>,
    expect: String,
    tolerance: Option<Tolerance>,
    raw: Option<Raw>,
}

#[derive(Debug, Deserialize)]
struct Tolerance {
    max: u8,
    mean: f64,
}

#[derive(Debug, Deserialize)]
struct Raw {
    dtype: String,
    shape: Vec<u64>,
}

fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/codec/testdata")
}

fn fixtures() -> Vec<Fixture> {
    let text = std::fs::read_to_string(testdata().join("manifest.json")).expect("manifest.json (run make.py)");
    serde_json::from_str(&text).expect("manifest parses")
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(testdata().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn codec_of(f: &Fixture) -> Codec {
    let raw = f.raw.as_ref().map(|r| RawLayout::new(&r.dtype, r.shape.clone()).unwrap());
    Codec::parse(&f.codec, raw).unwrap()
}

/// Fixture expectations are stored little-endian.
fn expected_native(f: &Fixture, dtype: DType) -> Vec<u8> {
    let mut bytes = read(&f.expect);
    swap_if_needed(&mut bytes, dtype, ByteOrder::Little);
    bytes
}

/// (max abs difference, mean abs difference) of two uint8 images.
fn diff_u8(a: &[u8], b: &[u8]) -> (u8, f64) {
    let max = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).max().unwrap_or(0);
    let sum: u64 = a.iter().zip(b).map(|(x, y)| u64::from(x.abs_diff(*y))).sum();
    (max, sum as f64 / a.len().max(1) as f64)
}

fn compare(f: &Fixture, info: &ArrayInfo, got: &[u8], want: &[u8]) {
    match &f.tolerance {
        None => assert!(got == want, "{}: decoded bytes differ from the reference", f.file),
        Some(tol) => {
            assert_eq!(info.dtype, DType::U8);
            let (max, mean) = diff_u8(got, want);
            eprintln!("{}: max abs diff {max}, mean abs diff {mean:.4} vs Pillow (libjpeg-turbo)", f.file);
            assert!(max <= tol.max && mean <= tol.mean, "{}: max {max} mean {mean} beyond {tol:?}", f.file);
        }
    }
}

#[test]
fn fixtures_decode_like_the_reference_tools() {
    let all = fixtures();
    assert!(all.len() > 60, "manifest lists {} fixtures", all.len());
    let mut scratch = Vec::new();
    let mut buf = AlignedBuf::new();
    for f in &all {
        let codec = codec_of(f);
        let value = read(&f.file);
        let (dtype, _) = parse_dtype(&f.dtype).unwrap();
        let want_info = ArrayInfo { dtype, shape: f.shape.clone() };
        let info = codec.probe(&value).unwrap_or_else(|e| panic!("{}: probe: {e}", f.file));
        assert_eq!(info, want_info, "{}: probe", f.file);
        let want = expected_native(f, dtype);
        assert_eq!(want.len(), info.bytes(), "{}: expectation size", f.file);

        // Straight into a destination of exactly the right size (a slot row).
        let mut dst = vec![0xAAu8; info.bytes()];
        codec.decode_into(&value, &info, &mut dst, &mut scratch).unwrap_or_else(|e| panic!("{}: {e}", f.file));
        compare(f, &info, &dst, &want);

        // Into a reusable buffer.
        let got = codec
            .decode(&value, &mut buf, &mut scratch, u64::MAX)
            .unwrap_or_else(|e| panic!("{}: decode: {e}", f.file));
        assert_eq!(got, info, "{}", f.file);
        assert_eq!(buf.as_slice().as_ptr().addr() % BUF_ALIGN, 0);
        compare(f, &info, buf.as_slice(), &want);
        let mut vec = vec![1u8; 3];
        assert_eq!(codec.decode(&value, &mut vec, &mut scratch, u64::MAX).unwrap(), info);
        compare(f, &info, &vec, &want);
    }
}

#[test]
fn every_png_color_type_and_depth_is_covered() {
    let names: Vec<String> = fixtures().into_iter().map(|f| f.file).filter(|f| f.ends_with(".png")).collect();
    for want in [
        "gray1",
        "gray2",
        "gray4",
        "gray8",
        "gray16",
        "gray_alpha8",
        "gray_alpha16",
        "rgb8",
        "rgb16",
        "rgba8",
        "rgba16",
        "palette4",
        "palette8",
        "palette_trns",
        "gray_trns",
        "rgb_trns",
        "rgb8_interlaced",
        "rgb16_interlaced",
    ] {
        assert!(names.iter().any(|n| n.ends_with(&format!("/{want}.png"))), "no fixture {want}");
    }
}

#[test]
fn parse_names() {
    assert_eq!(
        "png".parse::<Codec>().unwrap(),
        Codec { wrap: Wrap::None, format: Format::Png, convert: Default::default() }
    );
    assert_eq!(
        "lz4+npy".parse::<Codec>().unwrap(),
        Codec { wrap: Wrap::Lz4, format: Format::Npy, convert: Default::default() }
    );
    assert_eq!(
        "ZSTD+JPG".parse::<Codec>().unwrap(),
        Codec { wrap: Wrap::Zstd, format: Format::Jpeg, convert: Default::default() }
    );
    assert_eq!("zstd+png".parse::<Codec>().unwrap().to_string(), "zstd+png");
    assert!(matches!("gzip+png".parse::<Codec>(), Err(CodecError::UnknownCodec(_))));
    assert!(matches!("webp".parse::<Codec>(), Err(CodecError::UnknownCodec(_))));
    assert!(matches!("raw".parse::<Codec>(), Err(CodecError::RawLayout(_))));
    let layout = RawLayout::new("float32", vec![2, 3]).unwrap();
    assert!(matches!(Codec::parse("png", Some(layout.clone())), Err(CodecError::RawLayout(_))));
    let raw = Codec::parse("lz4+raw", Some(layout)).unwrap();
    assert_eq!(raw.to_string(), "lz4+raw");
    assert_eq!(parse_dtype(">u2").unwrap(), (DType::U16, ByteOrder::Big));
    assert_eq!(parse_dtype("|b1").unwrap(), (DType::Bool, ByteOrder::NATIVE));
    assert!(matches!(parse_dtype("complex64"), Err(CodecError::Dtype(_))));
}

#[test]
fn sniff_names_formats() {
    assert_eq!(sniff(&read("png/rgb8.png")), "png");
    assert_eq!(sniff(&read("jpeg/gray_progressive.jpg")), "jpeg");
    assert_eq!(sniff(&read("npy/f4_le_c.npy")), "npy");
    assert_eq!(sniff(&read("wrap/npy.lz4")), "lz4");
    assert_eq!(sniff(&read("wrap/npy.zst")), "zstd");
    assert_eq!(sniff(b"hello"), "unknown");
    assert_eq!(sniff(b""), "unknown");
}

#[test]
fn shape_mismatch_is_caught_before_writing() {
    let mut scratch = Vec::new();
    for (file, codec) in [("png/rgb8.png", "png"), ("jpeg/rgb_baseline420.jpg", "jpeg"), ("npy/f4_le_c.npy", "npy")] {
        let codec: Codec = codec.parse().unwrap();
        let value = read(file);
        let info = codec.probe(&value).unwrap();
        let mut wrong = info.clone();
        wrong.shape.reverse();
        let mut dst = vec![0x55u8; wrong.bytes()];
        let err = codec.decode_into(&value, &wrong, &mut dst, &mut scratch).unwrap_err();
        assert!(matches!(err, CodecError::Mismatch { .. }), "{file}: {err}");
        assert!(dst.iter().all(|&b| b == 0x55), "{file}: wrote before checking");
    }
}

#[test]
fn corrupt_values_are_errors_not_panics() {
    let mut scratch = Vec::new();
    let mut buf = AlignedBuf::new();
    for (file, codec) in [
        ("png/rgb8.png", "png"),
        ("png/palette4.png", "png"),
        ("jpeg/rgb_baseline420.jpg", "jpeg"),
        ("jpeg/rgb_progressive.jpg", "jpeg"),
        ("npy/i2_be_f.npy", "npy"),
        ("wrap/npy.lz4", "lz4+npy"),
        ("wrap/npy.lz4block", "lz4+npy"),
        ("wrap/npy.zst", "zstd+npy"),
        ("wrap/png.zst", "zstd+png"),
    ] {
        let codec: Codec = codec.parse().unwrap();
        let value = read(file);
        // Truncations at several points, and flipped bytes in the middle. lz4_flex
        // takes a frame cut inside its 4-byte end mark as ended: the data is whole.
        let last = if codec.wrap == Wrap::Lz4 { value.len() - 5 } else { value.len() - 1 };
        for cut in [0, 1, 7, 20, value.len() / 2, last] {
            let short = &value[..cut];
            if let Ok(info) = codec.probe(short) {
                let mut dst = vec![0u8; info.bytes()];
                let result = codec.decode_into(short, &info, &mut dst, &mut scratch);
                assert!(result.is_err(), "{file} cut at {cut} decoded");
            }
        }
        let mut flipped = value.clone();
        let mid = flipped.len() / 2;
        for b in &mut flipped[mid..mid + 8] {
            *b ^= 0x5A;
        }
        // Flipped bytes may still decode (JPEG has no checksum); they must not panic.
        let _ = codec.decode(&flipped, &mut buf, &mut scratch, u64::MAX);
    }
}

#[test]
fn flipped_png_bytes_fail_the_checksums() {
    let mut value = read("png/rgb8.png");
    let mid = value.len() / 2;
    value[mid] ^= 0x01;
    let codec: Codec = "png".parse().unwrap();
    assert!(codec.decode(&value, &mut AlignedBuf::new(), &mut Vec::new(), u64::MAX).is_err());
}

#[test]
fn raw_size_must_match() {
    let layout = RawLayout::new("<u2", vec![8, 12, 3]).unwrap();
    let mut scratch = Vec::new();
    let info = ArrayInfo { dtype: DType::U16, shape: vec![8, 12, 3] };
    let mut dst = vec![0u8; info.bytes()];
    let raw = Codec::parse("raw", Some(layout.clone())).unwrap();
    let value = read("wrap/raw.bin");
    assert!(raw.decode_into(&value[..value.len() - 2], &info, &mut dst, &mut scratch).is_err());
    let zstd = Codec::parse("zstd+raw", Some(RawLayout::new("<u2", vec![8, 12, 2]).unwrap())).unwrap();
    let info2 = ArrayInfo { dtype: DType::U16, shape: vec![8, 12, 2] };
    let mut dst2 = vec![0u8; info2.bytes()];
    let err = zstd.decode_into(&read("wrap/raw.zst"), &info2, &mut dst2, &mut scratch).unwrap_err();
    assert!(matches!(err, CodecError::Decompress { wrap: "zstd", .. }), "{err}");
    let lz4 = Codec::parse("lz4+raw", Some(RawLayout::new("<u2", vec![8, 12, 2]).unwrap())).unwrap();
    for file in ["wrap/raw.lz4", "wrap/raw.lz4block"] {
        let err = lz4.decode_into(&read(file), &info2, &mut dst2, &mut scratch).unwrap_err();
        assert!(matches!(err, CodecError::Decompress { wrap: "lz4", .. }), "{file}: {err}");
    }
}

#[test]
fn lz4_without_frame_or_plausible_prefix_is_rejected() {
    let codec: Codec = "lz4+npy".parse().unwrap();
    let err = codec.probe(&[0xFF, 0xFF, 0xFF, 0x7F, 1, 2, 3]).unwrap_err();
    assert!(err.to_string().contains("neither an LZ4 frame"), "{err}");
}

#[test]
fn aligned_buf_stays_aligned_as_it_grows() {
    let mut buf = AlignedBuf::new();
    for len in [0, 1, 3, 17, 1000, 5, 100_000] {
        let s = buf.resize(len);
        assert_eq!(s.len(), len);
        assert_eq!(s.as_ptr().addr() % BUF_ALIGN, 0);
    }
}

/// A PNG that is only a signature and an IHDR declaring `width × height` RGB8.
fn png_header_only(width: u32, height: u32) -> Vec<u8> {
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    v.extend_from_slice(&13u32.to_be_bytes());
    v.extend_from_slice(b"IHDR");
    v.extend_from_slice(&width.to_be_bytes());
    v.extend_from_slice(&height.to_be_bytes());
    v.extend_from_slice(&[8, 2, 0, 0, 0, 0, 0, 0, 0]);
    v
}

#[test]
fn image_sizes_from_the_header_are_checked_before_decoding() {
    let codec: Codec = "png".parse().unwrap();
    let value = png_header_only(1 << 20, 1 << 20);
    let mut buf = AlignedBuf::new();
    let err = codec.decode(&value, &mut buf, &mut Vec::new(), 1 << 30).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, CodecError::TooLarge { bytes: Some(3298534883328), .. }), "{msg}");
    assert!(msg.contains("[limits] max_sample_bytes") && msg.contains("3298534883328"), "{msg}");
    assert_eq!(buf.len(), 0, "nothing was allocated");
    // Within the limit, the same header goes on to decoding (and fails there: no pixel data).
    let small = png_header_only(4, 4);
    let err = codec.decode(&small, &mut buf, &mut Vec::new(), 1 << 30).unwrap_err();
    assert!(!matches!(err, CodecError::TooLarge { .. }), "{err}");
}

#[test]
fn npy_header_claiming_more_than_its_body_fails_before_allocating() {
    let header = "{'descr': '<f8', 'fortran_order': False, 'shape': (1048576, 1048576), }";
    let mut value = b"\x93NUMPY\x01\x00".to_vec();
    let padded = format!("{header:<118}\n");
    value.extend_from_slice(&(padded.len() as u16).to_le_bytes());
    value.extend_from_slice(padded.as_bytes());
    value.extend_from_slice(&[0u8; 64]);
    let codec: Codec = "npy".parse().unwrap();
    let mut out = Vec::new();
    let err = codec.decode(&value, &mut out, &mut Vec::new(), 1 << 30).unwrap_err();
    assert!(matches!(err, CodecError::TooLarge { .. }), "{err}");
    // No limit at all: the body length is checked before the 8 TiB buffer would be made.
    let err = codec.decode(&value, &mut out, &mut Vec::new(), u64::MAX).unwrap_err();
    assert!(err.to_string().contains("body has 64 bytes"), "{err}");
    assert!(out.capacity() < 1 << 20);
}

#[test]
fn array_sizes_saturate_instead_of_wrapping() {
    let info = ArrayInfo { dtype: DType::F64, shape: vec![1 << 31, 1 << 31, 4] };
    assert_eq!(info.checked_bytes(), None);
    assert_eq!(info.bytes(), usize::MAX);
    assert!(matches!(info.check_size(u64::MAX), Err(CodecError::TooLarge { bytes: None, .. })));
}

#[test]
fn jpeg_region_decode_equals_cropping_the_full_decode() {
    for file in
        ["jpeg/rgb_baseline420.jpg", "jpeg/rgb_baseline422.jpg", "jpeg/rgb_progressive.jpg", "jpeg/gray_baseline.jpg"]
    {
        let value = read(file);
        for denom in image::JPEG_SCALES {
            let full = image::probe_jpeg_scaled(&value, denom).unwrap();
            let (h, w, c) = (full.shape[0] as u32, full.shape[1] as u32, full.shape[2] as usize);
            let mut whole = vec![0u8; full.bytes()];
            image::decode_jpeg_region(&value, denom, &full, None, &mut whole).unwrap();
            assert_eq!((h, w), (41u32.div_ceil(denom), 57u32.div_ceil(denom)), "{file} 1/{denom}");
            for (top, left, rh, rw) in
                [(0, 0, h, w), (1, 3, h - 1, w - 3), (h / 3, w / 2, h - h / 3, 1), (0, w - 2, 1, 2)]
            {
                let region = image::Region { top, left, height: rh, width: rw };
                let mut got = vec![0u8; rh as usize * rw as usize * c];
                let info = image::decode_jpeg_region(&value, denom, &full, Some(region), &mut got).unwrap();
                assert_eq!(info.shape, vec![u64::from(rh), u64::from(rw), c as u64]);
                let want: Vec<u8> = (top..top + rh)
                    .flat_map(|y| {
                        let at = (y as usize * w as usize + left as usize) * c;
                        whole[at..at + rw as usize * c].iter().copied()
                    })
                    .collect();
                assert!(got == want, "{file} 1/{denom} region {region:?} differs from the full decode");
            }
            let outside = image::Region { top: h, left: 0, height: 1, width: 1 };
            assert!(image::decode_jpeg_region(&value, denom, &full, Some(outside), &mut [0u8; 3][..c]).is_err());
        }
    }
}

#[test]
fn cropped_decode_then_the_rest_of_the_chain_equals_the_whole_chain() {
    use crate::transform::{ArrayRef, Chain, SampleKey, Scratch, Step};
    let codec = Codec::parse("jpeg", None).unwrap();
    let normalize = Step::Normalize { mean: vec![0.45], std: vec![0.226] };
    let chains = [
        // The ImageNet pipeline (image engine).
        vec![Step::RandomCrop { height: 24, width: 32 }, Step::RandomHFlip, normalize.clone(), Step::ToChw],
        // BasicSR's augmentations after a centre crop (n-dimensional engine).
        vec![Step::CenterCrop { height: 30, width: 30 }, Step::RandomVFlip, Step::RandomRot90, Step::RandomHFlip],
        vec![Step::RandomCrop { height: 7, width: 9 }, Step::Cast { dtype: DType::F32 }],
        vec![Step::RandomCrop { height: 41, width: 57 }],
        vec![Step::RandomCrop { height: 1, width: 1 }, Step::RandomHFlip],
    ];
    let mut scratch = Vec::new();
    let mut transform = Scratch::new();
    for file in
        ["jpeg/rgb_baseline420.jpg", "jpeg/rgb_baseline422.jpg", "jpeg/rgb_progressive.jpg", "jpeg/gray_baseline.jpg"]
    {
        let value = read(file);
        for steps in &chains {
            let chain = Chain::new("image", steps.clone(), None).unwrap();
            let rest = chain.after_leading_crop().expect("the chain starts with an unpaired crop");
            let mut windows = std::collections::HashSet::new();
            for index in 0..40 {
                let key = SampleKey { seed: 7, epoch: 2, index };
                let mut whole = Vec::new();
                let info = codec.decode(&value, &mut whole, &mut scratch, u64::MAX).unwrap();
                let known: Vec<Option<u64>> = info.shape.iter().map(|&d| Some(d)).collect();
                let (dtype, shape) = chain.output(info.dtype, &known).unwrap();
                let bytes = shape.iter().map(|d| d.unwrap()).product::<u64>() as usize * dtype.size();
                let mut want = vec![0u8; bytes];
                let input = ArrayRef { bytes: &whole, dtype: info.dtype, shape: &info.shape };
                chain.apply(input, key, None, &mut transform, &mut want).unwrap();

                let mut part = Vec::new();
                let crop = |h, w| chain.leading_crop(h, w, key).map(|c| (c.top, c.left, c.height, c.width));
                let (full, window) = codec.decode_cropped(&value, &mut part, &mut scratch, u64::MAX, crop).unwrap();
                assert_eq!(full, info);
                let drawn = chain.leading_crop(info.shape[0], info.shape[1], key).unwrap();
                windows.insert(drawn);
                // Windows up to half the image decode alone; larger ones whole.
                let small = 2 * drawn.height * drawn.width <= info.shape[0] * info.shape[1];
                assert_eq!(window.is_some(), small, "{file} {steps:?}: window {window:?} of {:?}", info.shape);
                let (shape, applied) = match &window {
                    Some(window) => (window.clone(), rest),
                    None => (info.shape.clone(), &chain),
                };
                assert_eq!(part.len() as u64, shape.iter().product::<u64>());
                let mut got = vec![0u8; bytes];
                let input = ArrayRef { bytes: &part, dtype: full.dtype, shape: &shape };
                applied.apply(input, key, None, &mut transform, &mut got).unwrap();
                assert!(got == want, "{file} {steps:?} sample {index}: the cropped decode's result differs");
            }
            let random = matches!(steps[0], Step::RandomCrop { height, .. } if height < 41);
            assert_eq!(windows.len() > 1, random, "{file} {steps:?}: windows {windows:?}");
        }
    }
    // A crop larger than the image picks no window: the whole image decodes
    // (and the chain reports the misfit).
    let chain = Chain::new("image", vec![Step::RandomCrop { height: 42, width: 8 }], None).unwrap();
    let key = SampleKey { seed: 0, epoch: 0, index: 0 };
    let crop = |h, w| chain.leading_crop(h, w, key).map(|c| (c.top, c.left, c.height, c.width));
    let (full, window) =
        codec.decode_cropped(&read("jpeg/rgb_baseline420.jpg"), &mut Vec::new(), &mut scratch, u64::MAX, crop).unwrap();
    assert_eq!((full.shape[0], window), (41, None));
    // Paired chains draw through their leader: no cropped decode.
    let paired = crate::transform::Pair { with: "lr".into(), scale: 2 };
    let chain = Chain::new("hr", vec![Step::RandomCrop { height: 8, width: 8 }], Some(paired)).unwrap();
    assert!(chain.after_leading_crop().is_none() && chain.leading_crop(41, 57, key).is_none());
}

/// The decoders that run inside the daemon on client bytes, libjpeg-turbo
/// and zstd's C library among them (docs/ARCHITECTURE.md), over thousands of
/// mutated values: random bytes set, runs zeroed or saturated, truncations,
/// header fields made huge. Every case is an error or a decode within the
/// size limit; none panics or crashes the test process (a fault in the C
/// code would). Deterministic (a fixed xorshift), bounded in time.
#[test]
fn mutated_values_never_crash_the_decoders() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut scratch = Vec::new();
    let mut buf = AlignedBuf::new();
    let limit = 64 << 20;
    let (mut cases, mut decoded) = (0u32, 0u32);
    for (file, codec) in [
        ("jpeg/rgb_baseline420.jpg", "jpeg"),
        ("jpeg/rgb_progressive.jpg", "jpeg"),
        ("jpeg/gray_progressive.jpg", "jpeg"),
        ("png/rgb8.png", "png"),
        ("png/palette4.png", "png"),
        ("wrap/png.zst", "zstd+png"),
        ("wrap/npy.zst", "zstd+npy"),
        ("npy/f4_le_c.npy", "npy"),
    ] {
        let codec: Codec = codec.parse().unwrap();
        let value = read(file);
        for _ in 0..400 {
            let mut v = value.clone();
            match next() % 4 {
                0 => {
                    for _ in 0..1 + next() % 8 {
                        let at = (next() as usize) % v.len();
                        v[at] = next() as u8;
                    }
                }
                1 => {
                    let at = (next() as usize) % v.len();
                    let fill = if next() % 2 == 0 { 0 } else { 0xff };
                    let end = (at + 1 + (next() as usize) % 16).min(v.len());
                    v[at..end].fill(fill);
                }
                2 => v.truncate((next() as usize) % v.len()),
                _ => {
                    // A 16-bit big-endian field near the start (JPEG/PNG sizes) made huge.
                    let at = (next() as usize) % v.len().min(256);
                    if at + 2 <= v.len() {
                        v[at..at + 2].copy_from_slice(&[0xff, 0xf0]);
                    }
                }
            }
            cases += 1;
            if let Ok(info) = codec.decode(&v, &mut buf, &mut scratch, limit) {
                assert!(info.bytes() as u64 <= limit, "{file}: decoded {} bytes", info.bytes());
                decoded += 1;
            }
        }
    }
    assert_eq!(cases, 3200);
    eprintln!("{cases} mutated values, {decoded} still decoded, the rest refused; no crash");
}

//! Single-threaded decode time per image, for choosing the image decoders:
//! JPEG with libjpeg-turbo (what stoker ships, `stoker_decode::libjpeg`)
//! against zune-jpeg, and PNG with the `png` crate (what stoker ships) against
//! zune-png. Reads every `*.jpg` / `*.png` in the directory given (written
//! by `benches/decoders.py`, which runs this and reports the table).
//!
//!     cargo run --release -p stoker-decode --example decode_bench -- DIR [ROUNDS]
//!
//! Prints one line per (decoder, file group): median and mean µs per image
//! over ROUNDS (default 20) passes over the group's files.

use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::time::Instant;

use stoker_decode::libjpeg;
use zune_core::bit_depth::ByteEndian;
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

fn files(dir: &Path, prefix: &str, ext: &str) -> Vec<Vec<u8>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("readable directory")
        .map(|e| e.expect("entry").path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with(prefix) && name.ends_with(ext)
        })
        .collect();
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).expect("readable file")).collect()
}

fn libjpeg_turbo(value: &[u8], out: &mut Vec<u8>) {
    let (w, h, c) = libjpeg::header(value, 1).expect("header");
    out.resize((w * h * c) as usize, 0);
    libjpeg::decode(value, 1, w, (0, 0, w, h), c, out).expect("decode");
}

fn zune_jpeg(value: &[u8], out: &mut Vec<u8>) {
    let options = DecoderOptions::default().jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut d = zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(value), options);
    d.decode_headers().expect("header");
    let (w, h) = d.dimensions().expect("dimensions");
    out.resize(w * h * 3, 0);
    d.decode_into(out).expect("decode");
}

fn zune_png(value: &[u8], out: &mut Vec<u8>) {
    let options = DecoderOptions::default()
        .set_byte_endian(ByteEndian::LE)
        .png_set_confirm_crc(true)
        .inflate_set_confirm_adler(true);
    let mut d = zune_png::PngDecoder::new_with_options(ZCursor::new(value), options);
    d.decode_headers().expect("header");
    let n = d.output_buffer_size().expect("size");
    out.resize(n, 0);
    d.decode_into(out).expect("decode");
}

fn png_crate(value: &[u8], out: &mut Vec<u8>) {
    let mut d = png::Decoder::new(Cursor::new(value));
    d.set_transformations(png::Transformations::EXPAND);
    d.ignore_checksums(false); // as zune_png above: CRCs and Adler-32 checked
    let mut r = d.read_info().expect("header");
    let n = r.output_buffer_size().expect("size");
    out.resize(n, 0);
    let info = r.next_frame(out).expect("decode");
    r.finish().expect("through IEND"); // as stoker does
    if info.bit_depth == png::BitDepth::Sixteen {
        // stoker delivers native-endian uint16; the crate gives big-endian.
        for pair in out[..info.buffer_size()].chunks_exact_mut(2) {
            pair.swap(0, 1);
        }
    }
}

type Decoder = fn(&[u8], &mut Vec<u8>);

fn measure(name: &str, group: &str, images: &[Vec<u8>], rounds: usize, decode: Decoder) {
    let mut out = Vec::new();
    for v in images {
        decode(v, &mut out); // warm-up, and every file must decode
    }
    let mut times = Vec::with_capacity(images.len() * rounds);
    for _ in 0..rounds {
        for v in images {
            let t = Instant::now();
            decode(v, &mut out);
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!("{group}\t{name}\t{median:.1}\t{mean:.1}\t{}", images.len());
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("usage: decode_bench DIR [ROUNDS]"));
    let rounds: usize = args.next().map_or(20, |r| r.parse().expect("ROUNDS is a number"));
    println!("group\tdecoder\tmedian_us\tmean_us\tfiles");
    let jpegs = files(&dir, "jpeg_", ".jpg");
    measure("libjpeg-turbo", "jpeg", &jpegs, rounds, libjpeg_turbo);
    measure("zune-jpeg", "jpeg", &jpegs, rounds, zune_jpeg);
    for group in ["png_rgb8", "png_rgb16", "png_palette"] {
        let pngs = files(&dir, group, ".png");
        measure("zune-png", group, &pngs, rounds, zune_png);
        measure("png", group, &pngs, rounds, png_crate);
    }
}

//! Whole-pipeline tests: chunks written by libhdf5 through h5py and
//! hdf5plugin (`testdata/make.py`), and round trips through [`decode_chunk`]
//! with the crates' encoders and the forward transforms in the unit tests.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::blosc::tests::encode as blosc_encode;
use super::checksum::fletcher32;
use super::codec::tests::hdf5_lz4_encode;
use super::shuffle::BitshuffleCompression;
use super::shuffle::tests::{bitshuffle_encode, shuffle};
use super::*;

fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/filter/testdata")
}

struct Fixture {
    name: String,
    pipeline: Vec<FilterSpec>,
    filter_mask: u32,
    element_size: usize,
    chunk_bytes: usize,
    stored: Vec<u8>,
    expected: Vec<u8>,
}

fn fixtures() -> Vec<Fixture> {
    let dir = testdata();
    let text = std::fs::read_to_string(dir.join("cases.json")).expect("testdata/cases.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("cases.json parses");
    let read = |name: &serde_json::Value| std::fs::read(dir.join(name.as_str().unwrap())).unwrap();
    let cases: Vec<Fixture> = json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Fixture {
            name: c["name"].as_str().unwrap().to_string(),
            pipeline: c["pipeline"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| FilterSpec {
                    id: f["id"].as_u64().unwrap() as u32,
                    flags: f["flags"].as_u64().unwrap() as u32,
                    client_data: f["client_data"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_u64().unwrap() as u32)
                        .collect(),
                    name: f["name"].as_str().unwrap().to_string(),
                })
                .collect(),
            filter_mask: c["filter_mask"].as_u64().unwrap() as u32,
            element_size: c["element_size"].as_u64().unwrap() as usize,
            chunk_bytes: c["chunk_bytes"].as_u64().unwrap() as usize,
            stored: read(&c["stored"]),
            expected: read(&c["expected"]),
        })
        .collect();
    assert!(cases.len() >= 30, "only {} fixtures", cases.len());
    cases
}

#[test]
fn decodes_chunks_written_by_libhdf5() {
    let mut out = Vec::new();
    for f in fixtures() {
        assert_eq!(unsupported_reason(&f.pipeline), None, "{}", f.name);
        decode_chunk(&f.pipeline, f.filter_mask, &f.stored, f.element_size, f.chunk_bytes, &mut out)
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        assert_eq!(out.len(), f.expected.len(), "{}", f.name);
        assert!(out == f.expected, "{}: decoded bytes differ", f.name);
    }
}

#[test]
fn fixtures_cover_every_filter() {
    let all = fixtures();
    for id in
        [id::DEFLATE, id::SHUFFLE, id::FLETCHER32, id::LZF, id::BLOSC, id::LZ4, id::BITSHUFFLE, id::ZSTD, id::BLOSC2]
    {
        assert!(all.iter().any(|f| f.pipeline.iter().any(|p| p.id == id)), "no fixture for filter {id}");
    }
    // Blosc frames of every inner codec, and chunks libhdf5 stored unfiltered.
    let blosc_formats: Vec<u8> = all
        .iter()
        .filter(|f| f.pipeline.iter().any(|p| p.id == id::BLOSC) && f.filter_mask == 0)
        .map(|f| f.stored[2] >> 5)
        .collect();
    for format in [0, 1, 3, 4] {
        assert!(blosc_formats.contains(&format), "no blosc fixture with compressor format {format}");
    }
    assert!(all.iter().any(|f| f.filter_mask != 0));
}

#[test]
fn damaged_fixtures_fail_cleanly() {
    let mut out = Vec::new();
    for f in fixtures() {
        let decode = |stored: &[u8], out: &mut Vec<u8>| {
            decode_chunk(&f.pipeline, f.filter_mask, stored, f.element_size, f.chunk_bytes, out)
        };
        // Every cut of a filtered chunk is an error.
        let filtered = f.pipeline.iter().enumerate().any(|(i, _)| f.filter_mask & (1 << i) == 0);
        let step = (f.stored.len() / 40).max(1);
        for cut in (0..f.stored.len()).step_by(step) {
            let result = decode(&f.stored[..cut], &mut out);
            if filtered || cut != f.chunk_bytes {
                assert!(result.is_err(), "{}: cut at {cut} of {} decoded", f.name, f.stored.len());
                assert!(out.is_empty());
            }
        }
        // Flipped bytes never panic; with a trailing checksum they always fail.
        let checked = f.pipeline.last().is_some_and(|p| p.id == id::FLETCHER32)
            && f.filter_mask & (1 << (f.pipeline.len() - 1)) == 0;
        for i in (0..f.stored.len()).step_by(step) {
            let mut bad = f.stored.clone();
            bad[i] ^= 0x10;
            let result = decode(&bad, &mut out);
            if checked {
                assert!(result.is_err(), "{}: flipped byte {i} decoded", f.name);
            }
        }
    }
}

#[test]
fn flipped_byte_under_fletcher32_is_a_checksum_error() {
    let f = fixtures().into_iter().find(|f| f.name == "gzip_shuffle_fletcher_i16").unwrap();
    let mut bad = f.stored.clone();
    bad[10] ^= 1;
    let err = decode_chunk(&f.pipeline, 0, &bad, 2, f.chunk_bytes, &mut Vec::new()).unwrap_err();
    assert!(matches!(err, FilterError::Checksum { .. }), "{err}");
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
}

fn data(n: usize) -> Vec<u8> {
    (0..n).map(|i| ((i as f64 / 40.0).sin() * 100.0) as i8 as u8 ^ (i % 3) as u8).collect()
}

fn zlib(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(4));
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

fn with_fletcher(mut data: Vec<u8>) -> Vec<u8> {
    let sum = fletcher32(&data);
    data.extend_from_slice(&sum.to_le_bytes());
    data
}

fn spec(id: u32, cd: &[u32]) -> FilterSpec {
    FilterSpec::new(id, cd)
}

#[track_caller]
fn check(pipeline: &[FilterSpec], mask: u32, stored: &[u8], element_size: usize, expected: &[u8]) {
    assert_eq!(unsupported_reason(pipeline), None);
    // A dirty buffer with spare capacity: it is cleared and reused.
    let mut out = vec![0x55; 3];
    decode_chunk(pipeline, mask, stored, element_size, expected.len(), &mut out).unwrap();
    assert!(out == expected, "decoded bytes differ");
    let mut decoder = Decoder::new();
    decoder.decode(pipeline, mask, stored, element_size, expected.len(), &mut out).unwrap();
    assert!(out == expected, "decoded bytes differ (explicit decoder)");
}

#[test]
fn single_filters_round_trip() {
    let raw = data(4000);
    check(&[spec(id::DEFLATE, &[6])], 0, &zlib(&raw), 4, &raw);
    check(&[spec(id::SHUFFLE, &[4])], 0, &shuffle(&raw, 4), 4, &raw);
    check(&[spec(id::FLETCHER32, &[])], 0, &with_fletcher(raw.clone()), 4, &raw);
    check(&[spec(id::LZ4, &[])], 0, &hdf5_lz4_encode(&raw, 1 << 30), 4, &raw);
    check(&[spec(id::LZ4, &[1000])], 0, &hdf5_lz4_encode(&raw, 1000), 4, &raw);
    check(&[spec(id::ZSTD, &[3])], 0, &::zstd::bulk::compress(&raw, 3).unwrap(), 4, &raw);
    for (cd4, compression) in
        [(0, BitshuffleCompression::None), (2, BitshuffleCompression::Lz4), (3, BitshuffleCompression::Zstd)]
    {
        let encoded = bitshuffle_encode(&raw, 4, 0, compression);
        check(&[spec(id::BITSHUFFLE, &[0, 4, 4, 0, cd4])], 0, &encoded, 4, &raw);
    }
    check(&[spec(id::BLOSC, &[2, 2, 4, 4000, 5, 1, 1])], 0, &blosc_encode(&raw, 4, 1024, 1, 1), 4, &raw);
    // No filters at all.
    check(&[], 0, &raw, 4, &raw);
}

#[test]
fn multi_filter_pipelines() {
    let raw = data(6000);
    let shuffle_deflate = [spec(id::SHUFFLE, &[2]), spec(id::DEFLATE, &[4])];
    check(&shuffle_deflate, 0, &zlib(&shuffle(&raw, 2)), 2, &raw);

    let with_checksum = [spec(id::SHUFFLE, &[2]), spec(id::DEFLATE, &[4]), spec(id::FLETCHER32, &[])];
    let stored = with_fletcher(zlib(&shuffle(&raw, 2)));
    check(&with_checksum, 0, &stored, 2, &raw);

    // fletcher32 first: deflate decodes to the chunk plus its checksum.
    let checksum_first = [spec(id::FLETCHER32, &[]), spec(id::DEFLATE, &[4])];
    check(&checksum_first, 0, &zlib(&with_fletcher(raw.clone())), 2, &raw);

    // Checksums and shuffles on both sides of the compressor.
    let stacked = [
        spec(id::FLETCHER32, &[]),
        spec(id::SHUFFLE, &[8]),
        spec(id::FLETCHER32, &[]),
        spec(id::ZSTD, &[]),
        spec(id::SHUFFLE, &[4]),
        spec(id::FLETCHER32, &[]),
    ];
    let s = with_fletcher(shuffle(&with_fletcher(raw.clone()), 8));
    let stored = with_fletcher(shuffle(&::zstd::bulk::compress(&s, 1).unwrap(), 4));
    check(&stacked, 0, &stored, 2, &raw);

    // Two compressors: the inner one's size is unknown, so that is left to
    // libhdf5, unless this chunk skipped one of them.
    let two = [spec(id::ZSTD, &[]), spec(id::LZ4, &[])];
    assert!(unsupported_reason(&two).unwrap().contains("more than one compressing filter"));
    let stored = hdf5_lz4_encode(&::zstd::bulk::compress(&raw, 1).unwrap(), 1 << 30);
    let err = decode_chunk(&two, 0, &stored, 2, raw.len(), &mut Vec::new()).unwrap_err();
    assert!(err.is_unsupported(), "{err}");
    check_mask_only(&two, 0b01, &hdf5_lz4_encode(&raw, 1 << 30), &raw);

    // Bitshuffle behind a byte shuffle, compressing itself or before deflate.
    let pipeline = [spec(id::SHUFFLE, &[4]), spec(id::BITSHUFFLE, &[0, 4, 1, 64, 2])];
    let stored = bitshuffle_encode(&shuffle(&raw, 4), 1, 64, BitshuffleCompression::Lz4);
    check(&pipeline, 0, &stored, 4, &raw);
    let pipeline = [spec(id::SHUFFLE, &[4]), spec(id::BITSHUFFLE, &[0, 4, 1, 64]), spec(id::DEFLATE, &[])];
    let stored = zlib(&bitshuffle_encode(&shuffle(&raw, 4), 1, 64, BitshuffleCompression::None));
    check(&pipeline, 0, &stored, 4, &raw);
}

#[test]
fn filter_mask_skips_filters() {
    let raw = data(3000);
    let pipeline = [spec(id::SHUFFLE, &[4]), spec(id::DEFLATE, &[4])];
    check(&pipeline, 0b00, &zlib(&shuffle(&raw, 4)), 4, &raw);
    check(&pipeline, 0b10, &shuffle(&raw, 4), 4, &raw);
    check(&pipeline, 0b01, &zlib(&raw), 4, &raw);
    check(&pipeline, 0b11, &raw, 4, &raw);
    // Bits past the pipeline are ignored; a skipped unknown filter is fine.
    check(&pipeline, 0b1100, &zlib(&shuffle(&raw, 4)), 4, &raw);
    let with_unknown = [spec(id::SHUFFLE, &[4]), spec(40_000, &[])];
    check_mask_only(&with_unknown, 0b10, &shuffle(&raw, 4), &raw);
    // A skipped checksum is not checked.
    let checksum = [spec(id::DEFLATE, &[]), spec(id::FLETCHER32, &[])];
    check(&checksum, 0b10, &zlib(&raw), 4, &raw);
}

/// Like `check`, for pipelines that `unsupported_reason` rejects as a whole
/// but whose unsupported filters this chunk skipped.
fn check_mask_only(pipeline: &[FilterSpec], mask: u32, stored: &[u8], expected: &[u8]) {
    let mut out = Vec::new();
    decode_chunk(pipeline, mask, stored, 4, expected.len(), &mut out).unwrap();
    assert!(out == expected);
}

#[test]
fn odd_tiny_and_empty_chunks() {
    // Not a multiple of element size * 8, with a partial trailing element.
    for len in [1usize, 3, 5, 13, 4011] {
        let raw = data(len);
        check(&[spec(id::SHUFFLE, &[4]), spec(id::DEFLATE, &[])], 0, &zlib(&shuffle(&raw, 4)), 4, &raw);
        check(&[spec(id::FLETCHER32, &[])], 0, &with_fletcher(raw.clone()), 1, &raw);
        check(&[spec(id::LZ4, &[7])], 0, &hdf5_lz4_encode(&raw, 7), 1, &raw);
    }
    for n in [1usize, 7, 9, 1003] {
        let raw = data(n * 4);
        let encoded = bitshuffle_encode(&raw, 4, 0, BitshuffleCompression::Lz4);
        check(&[spec(id::BITSHUFFLE, &[0, 4, 4, 0, 2])], 0, &encoded, 4, &raw);
    }
    // Shuffle without client data uses the dataset's element size.
    let raw = data(999);
    check(&[spec(id::SHUFFLE, &[])], 0, &shuffle(&raw, 3), 3, &raw);

    // Empty chunks.
    check(&[], 0, &[], 4, &[]);
    check(&[spec(id::FLETCHER32, &[])], 0, &[0, 0, 0, 0], 4, &[]);
    check(&[spec(id::SHUFFLE, &[4])], 0, &[], 4, &[]);
    check(&[spec(id::LZ4, &[])], 0, &hdf5_lz4_encode(&[], 0), 4, &[]);
}

#[test]
fn errors_name_the_failure_and_leave_out_empty() {
    let raw = data(5000);
    let pipeline = [spec(id::SHUFFLE, &[2]), spec(id::DEFLATE, &[]), spec(id::FLETCHER32, &[])];
    let stored = with_fletcher(zlib(&shuffle(&raw, 2)));
    let mut out = Vec::with_capacity(10_000);

    let mut flipped = stored.clone();
    flipped[20] ^= 0x40;
    let err = decode_chunk(&pipeline, 0, &flipped, 2, raw.len(), &mut out).unwrap_err();
    let FilterError::Checksum { stored: s, computed: c } = err else { panic!("{err}") };
    assert_ne!(s, c);
    assert!(out.is_empty() && out.capacity() >= 10_000);

    // Truncated under the checksum: the checksum catches it first.
    assert!(decode_chunk(&pipeline, 0, &stored[..stored.len() - 9], 2, raw.len(), &mut out).is_err());
    // Without the checksum, the zlib stream itself is short.
    let plain = [spec(id::SHUFFLE, &[2]), spec(id::DEFLATE, &[])];
    let z = zlib(&shuffle(&raw, 2));
    let err = decode_chunk(&plain, 0, &z[..z.len() / 2], 2, raw.len(), &mut out).unwrap_err();
    assert!(matches!(err, FilterError::Truncated { filter: "deflate", .. }), "{err}");
    assert!(err.to_string().starts_with("deflate: input truncated"), "{err}");

    // The chunk decodes to another size than the metadata says.
    let err = decode_chunk(&plain, 0, &z, 2, raw.len() + 2, &mut out).unwrap_err();
    assert!(
        matches!(err, FilterError::SizeMismatch { expected, actual, .. } if expected == raw.len() + 2 && actual == raw.len() as u64),
        "{err}"
    );
    let err = decode_chunk(&plain, 0, &z, 2, raw.len() - 2, &mut out).unwrap_err();
    assert!(matches!(err, FilterError::TooLong { .. }), "{err}");
    let err = decode_chunk(&[], 0, &raw, 2, raw.len() - 1, &mut out).unwrap_err();
    assert!(matches!(err, FilterError::SizeMismatch { .. }), "{err}");
    // An LZ4 header claiming an absurd size is refused before allocating.
    let mut lz4 = hdf5_lz4_encode(&raw, 1 << 30);
    lz4[..8].copy_from_slice(&(1u64 << 60).to_be_bytes());
    let err = decode_chunk(&[spec(id::LZ4, &[])], 0, &lz4, 1, raw.len(), &mut out).unwrap_err();
    assert!(matches!(err, FilterError::SizeMismatch { actual, .. } if actual == 1 << 60), "{err}");
    assert!(out.is_empty());
}

#[test]
fn unsupported_pipelines_are_reported() {
    let reason = |p: &[FilterSpec]| unsupported_reason(p);
    assert_eq!(reason(&[]), None);
    assert_eq!(reason(&[spec(id::SHUFFLE, &[4]), spec(id::DEFLATE, &[6]), spec(id::FLETCHER32, &[])]), None);
    for id in [id::SZIP, id::NBIT, id::SCALEOFFSET, 32_017, 307] {
        let r = reason(&[spec(id::SHUFFLE, &[4]), spec(id, &[])]).unwrap_or_else(|| panic!("filter {id}"));
        assert!(r.contains("not supported"), "{r}");
    }
    let named = FilterSpec { id: 32_013, flags: 1, client_data: vec![], name: "zfp".into() };
    assert!(reason(&[named]).unwrap().starts_with("zfp: "));
    assert!(reason(&[spec(id::BLOSC, &[2, 2, 4, 4096, 5, 1, 3])]).unwrap().contains("snappy"));
    assert_eq!(reason(&[spec(id::BLOSC, &[2, 2, 4, 4096, 5, 1, 0])]), None);
    assert!(reason(&[spec(id::BITSHUFFLE, &[0, 4, 4, 0, 7])]).is_some());
    assert!(reason(&[spec(id::BITSHUFFLE, &[0, 4])]).is_some());

    // Decoding such a pipeline says so, as an error the caller can fall back on.
    let err = decode_chunk(&[spec(id::SZIP, &[])], 0, &[1, 2, 3], 1, 3, &mut Vec::new()).unwrap_err();
    assert!(err.is_unsupported(), "{err}");
}

#[test]
fn random_bytes_never_panic() {
    let pipelines = [
        vec![spec(id::DEFLATE, &[])],
        vec![spec(id::SHUFFLE, &[4])],
        vec![spec(id::FLETCHER32, &[])],
        vec![spec(id::LZF, &[])],
        vec![spec(id::LZ4, &[])],
        vec![spec(id::ZSTD, &[])],
        vec![spec(id::BITSHUFFLE, &[0, 4, 4, 0, 0])],
        vec![spec(id::BITSHUFFLE, &[0, 4, 4, 0, 2])],
        vec![spec(id::BITSHUFFLE, &[0, 4, 2, 16, 3])],
        vec![spec(id::BLOSC, &[])],
        vec![spec(id::BLOSC2, &[])],
    ];
    let mut x = 0x9e37_79b9u32;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let mut out = Vec::new();
    for round in 0..3000 {
        let len = (next() % 300) as usize;
        let mut stored: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        let chunk_bytes = [0usize, 1, 8, 64, 100, 256, 1000][round % 7];
        // Plausible headers get the decoders past their first checks.
        let pipeline = &pipelines[round % pipelines.len()];
        match pipeline[0].id {
            id::LZ4 if stored.len() >= 12 => {
                stored[..8].copy_from_slice(&(chunk_bytes as u64).to_be_bytes());
                stored[8..12].copy_from_slice(&(next() % 300).to_be_bytes());
            }
            id::BITSHUFFLE if stored.len() >= 12 => {
                stored[..8].copy_from_slice(&(chunk_bytes as u64).to_be_bytes());
                stored[8..12].copy_from_slice(&(8 * (next() % 40)).to_be_bytes());
            }
            id::BLOSC if stored.len() >= 16 => {
                stored[0] = 2;
                stored[4..8].copy_from_slice(&(chunk_bytes as u32).to_le_bytes());
                stored[8..12].copy_from_slice(&(1 + next() % 300).to_le_bytes());
                stored[12..16].copy_from_slice(&(len as u32).to_le_bytes());
            }
            _ => {}
        }
        let _ = decode_chunk(pipeline, 0, &stored, 4, chunk_bytes, &mut out);
    }
}

/// Decode throughput on a few MB of mildly compressible f32 data, in 1 MiB
/// chunks. Run with
/// `cargo test -p stoker-daemon --release --lib filter::tests::throughput -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
fn throughput() {
    use std::time::Instant;
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 8;
    // Integer-valued floats, like digitised sensor data: compressible after
    // a shuffle, hardly before one.
    let raw: Vec<u8> = (0..CHUNK / 4)
        .flat_map(|i| {
            let x = i as f32;
            ((x / 300.0).sin() * 1000.0 + (x * 0.37).fract() * 8.0).round().to_le_bytes()
        })
        .collect();
    let cases: Vec<(&str, Vec<FilterSpec>, Vec<u8>)> = vec![
        ("deflate", vec![spec(id::DEFLATE, &[])], zlib(&raw)),
        ("shuffle 2-byte (no compression)", vec![spec(id::SHUFFLE, &[2])], shuffle(&raw, 2)),
        ("shuffle 4-byte (no compression)", vec![spec(id::SHUFFLE, &[4])], shuffle(&raw, 4)),
        ("shuffle 8-byte (no compression)", vec![spec(id::SHUFFLE, &[8])], shuffle(&raw, 8)),
        ("shuffle+deflate", vec![spec(id::SHUFFLE, &[4]), spec(id::DEFLATE, &[])], zlib(&shuffle(&raw, 4))),
        (
            "shuffle+deflate+fletcher32",
            vec![spec(id::SHUFFLE, &[4]), spec(id::DEFLATE, &[]), spec(id::FLETCHER32, &[])],
            with_fletcher(zlib(&shuffle(&raw, 4))),
        ),
        ("lz4", vec![spec(id::LZ4, &[])], hdf5_lz4_encode(&raw, 1 << 30)),
        ("shuffle+lz4", vec![spec(id::SHUFFLE, &[4]), spec(id::LZ4, &[])], hdf5_lz4_encode(&shuffle(&raw, 4), 1 << 30)),
        ("zstd", vec![spec(id::ZSTD, &[])], ::zstd::bulk::compress(&raw, 3).unwrap()),
        (
            "bitshuffle+lz4",
            vec![spec(id::BITSHUFFLE, &[0, 4, 4, 0, 2])],
            bitshuffle_encode(&raw, 4, 0, BitshuffleCompression::Lz4),
        ),
        (
            "bitshuffle (no compression)",
            vec![spec(id::BITSHUFFLE, &[0, 4, 4, 0, 0])],
            bitshuffle_encode(&raw, 4, 0, BitshuffleCompression::None),
        ),
        (
            "bitshuffle+zstd",
            vec![spec(id::BITSHUFFLE, &[0, 4, 4, 0, 3])],
            bitshuffle_encode(&raw, 4, 0, BitshuffleCompression::Zstd),
        ),
        (
            "blosc lz4+shuffle",
            vec![spec(id::BLOSC, &[2, 2, 4, CHUNK as u32, 5, 1, 1])],
            blosc_encode(&raw, 4, 1 << 18, 1, 1),
        ),
        (
            "blosc zstd+bitshuffle",
            vec![spec(id::BLOSC, &[2, 2, 4, CHUNK as u32, 5, 2, 5])],
            blosc_encode(&raw, 4, 1 << 18, 4, 4),
        ),
        ("shuffle only", vec![spec(id::SHUFFLE, &[4])], shuffle(&raw, 4)),
        ("fletcher32 only", vec![spec(id::FLETCHER32, &[])], with_fletcher(raw.clone())),
    ];
    let mut out = Vec::new();
    println!("{:28} {:>8} {:>10}", "pipeline", "ratio", "MB/s out");
    for (name, pipeline, stored) in cases {
        decode_chunk(&pipeline, 0, &stored, 4, raw.len(), &mut out).unwrap();
        assert!(out == raw, "{name}");
        let start = Instant::now();
        // Eight 1 MiB chunks, decoded one after another on this thread.
        for _ in 0..CHUNKS {
            decode_chunk(&pipeline, 0, &stored, 4, raw.len(), &mut out).unwrap();
        }
        let secs = start.elapsed().as_secs_f64();
        let ratio = raw.len() as f64 / stored.len() as f64;
        println!("{name:28} {ratio:8.2} {:10.0}", (CHUNKS * CHUNK) as f64 / secs / 1e6);
    }
}

/// Blosc2 frames from hdf5plugin with random bytes overwritten (sizes,
/// offsets, metalayer dimensions, block starts, stream sizes): every result
/// is a value or an error, never a panic, and nothing is allocated past the
/// chunk's own bounds (a hostile size would abort the test binary).
#[test]
fn mutated_blosc2_frames_never_panic() {
    let frames: Vec<Fixture> = fixtures()
        .into_iter()
        .filter(|f| f.pipeline.iter().any(|p| p.id == id::BLOSC2) && f.filter_mask == 0)
        .collect();
    assert!(frames.len() >= 5, "blosc2 fixtures: {}", frames.len());
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::new();
    let mut errors = 0;
    for f in &frames {
        for _ in 0..1500 {
            let mut bad = f.stored.clone();
            for _ in 0..1 + next() % 4 {
                // Mostly the frame header and the first chunk's header and block starts.
                let at =
                    if next() % 4 == 0 { next() as usize % bad.len() } else { next() as usize % bad.len().min(256) };
                bad[at] = match next() % 4 {
                    0 => 0xff,
                    1 => 0x7f,
                    2 => 0,
                    _ => next() as u8,
                };
            }
            let result = decode_chunk(&f.pipeline, 0, &bad, f.element_size, f.chunk_bytes, &mut out);
            match result {
                Ok(()) => assert_eq!(out.len(), f.chunk_bytes),
                Err(_) => errors += 1,
            }
        }
    }
    assert!(errors > 0);
}

#[test]
fn blosc2_fixtures_decode_in_rust() {
    let mut out = Vec::new();
    let mut b2nd = 0;
    for f in fixtures().into_iter().filter(|f| f.pipeline.iter().any(|p| p.id == id::BLOSC2) && f.filter_mask == 0) {
        assert_eq!(unsupported_reason(&f.pipeline), None, "{}", f.name);
        decode_chunk(&f.pipeline, 0, &f.stored, f.element_size, f.chunk_bytes, &mut out)
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        assert!(out == f.expected, "{}: differs from libhdf5's", f.name);
        b2nd += usize::from(f.stored.windows(4).any(|w| w == b"b2nd"));
    }
    assert!(b2nd >= 3, "b2nd frames among the fixtures: {b2nd}");
}

/// Blosc2 decode speed on one stored chunk (`STOKER_BLOSC2_CHUNK`, a file
/// holding a chunk of `STOKER_BLOSC2_BYTES` decoded bytes, e.g. from h5py's
/// `read_direct_chunk`). Run with
/// `cargo test -p stoker-daemon --release --lib filter::tests::blosc2_speed -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark; needs STOKER_BLOSC2_CHUNK"]
fn blosc2_speed() {
    let stored = std::fs::read(std::env::var("STOKER_BLOSC2_CHUNK").unwrap()).unwrap();
    let bytes: usize = std::env::var("STOKER_BLOSC2_BYTES").unwrap().parse().unwrap();
    let pipeline = [spec(id::BLOSC2, &[])];
    let mut out = Vec::new();
    let t = std::time::Instant::now();
    let rounds = 200;
    for _ in 0..rounds {
        decode_chunk(&pipeline, 0, &stored, 4, bytes, &mut out).unwrap();
    }
    let s = t.elapsed().as_secs_f64();
    println!("blosc2: {:.0} MB/s ({:.2} ms per chunk)", (bytes * rounds) as f64 / s / 1e6, s / rounds as f64 * 1e3);
}

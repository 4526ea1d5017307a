//! LMDB source tests: environments written by heed here, and by Python's
//! `lmdb` package (`testdata/make_lmdb.py`, run with `$STOKER_PYTHON`, else
//! the repository's `.venv/bin/python` (made by `scripts/setup.sh`), else `python3`). The Python tests skip
//! with a note when that interpreter lacks numpy/Pillow/lmdb/zstandard,
//! unless `STOKER_REQUIRE_PYTHON=1`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use heed::types::Bytes;
use heed::{CommitOrAbort, Database, EnvFlags, EnvOpenOptions};
use stoker_proto::DType;

use super::*;
use stoker_decode::codec::RawLayout;
use stoker_decode::transform::Filter;

/// Bytes of one fixed-shape sample of `f`.
fn bytes_of(f: &FieldSpec) -> usize {
    f.shape.iter().product::<u64>() as usize * f.dtype.size()
}

fn sample(index: u64) -> SampleRef {
    SampleRef { index, seed: 5, epoch: 2 }
}

fn raw_codec(shape: &[u64]) -> Codec {
    Codec::parse("raw", Some(RawLayout::new("uint8", shape.to_vec()).unwrap())).unwrap()
}

fn field(name: &str, env: &Path, codec: Codec) -> LmdbField {
    LmdbField { name: name.into(), env: env.to_owned(), codec, transforms: vec![], pair: None, max_sample_bytes: None }
}

/// Writes an environment with heed (a directory, or one file when `subdir` is false).
fn heed_env(path: &Path, subdir: bool, entries: &[(&[u8], Vec<u8>)]) {
    let mut options = EnvOpenOptions::new();
    options.map_size(16 << 20);
    if subdir {
        std::fs::create_dir_all(path).unwrap();
    } else {
        // SAFETY: NO_SUB_DIR only changes where the files go.
        unsafe {
            options.flags(EnvFlags::NO_SUB_DIR);
        }
    }
    // SAFETY: a fresh environment in a test's own directory, used by this thread only.
    let env = unsafe { options.open(path) }.unwrap();
    let wtxn = env.write_txn().unwrap();
    let db: Database<Bytes, Bytes> = env
        .create_databases_and_commit(wtxn, |creator, wtxn| -> heed::Result<_> {
            Ok(CommitOrAbort::<_, ()>::Commit(creator.create_database::<Bytes, Bytes>(wtxn, None)?))
        })
        .unwrap()
        .unwrap_commit();
    let mut wtxn = env.write_txn().unwrap();
    for (key, value) in entries {
        db.put(&mut wtxn, key, value).unwrap();
    }
    wtxn.commit().unwrap();
}

fn read_fixed(source: &LmdbSource, index: u64) -> Result<Vec<Vec<u8>>, SourceError> {
    let mut rows: Vec<Vec<u8>> = source.fields().iter().map(|f| vec![0u8; bytes_of(f)]).collect();
    let mut out: Vec<LmdbOut<'_>> = rows
        .iter_mut()
        .enumerate()
        .map(|(i, r)| if source.is_fixed(i) { LmdbOut::Fixed(&mut r[..]) } else { LmdbOut::Skip })
        .collect();
    source.read_into(sample(index), &mut out)?;
    Ok(rows)
}

#[test]
fn heed_env_keys_in_order_with_filters() {
    let dir = tempfile::tempdir().unwrap();
    let env = dir.path().join("raw.lmdb");
    let mut entries: Vec<(&[u8], Vec<u8>)> = vec![(b"__len__", b"3".to_vec()), (b"length", b"3".to_vec())];
    let keys: [&[u8]; 3] = [b"k2", b"k0", b"k1"];
    for (i, k) in keys.iter().enumerate() {
        entries.push((k, vec![i as u8; 6]));
    }
    heed_env(&env, true, &entries);
    let spec = LmdbSpec::new(vec![field("x", &env, raw_codec(&[2, 3]))]);
    let source = LmdbSource::open(&spec).unwrap();
    assert_eq!(source.len(), 3);
    assert_eq!(source.fields()[0].shape, vec![2, 3]);
    assert_eq!(source.fields()[0].dtype, DType::U8);
    // Bytewise key order: k0, k1, k2 (written as k2, k0, k1 with values 0, 1, 2).
    assert_eq!([source.key(0), source.key(1), source.key(2)], [b"k0", b"k1", b"k2"]);
    assert_eq!(read_fixed(&source, 0).unwrap()[0], vec![1u8; 6]);
    assert_eq!(read_fixed(&source, 2).unwrap()[0], vec![0u8; 6]);

    let with = |filter: KeyFilter| LmdbSource::open(&LmdbSpec { filter, ..spec.clone() }).map(|s| s.len());
    assert_eq!(with(KeyFilter::Prefix("k".into())).unwrap(), 3);
    assert_eq!(with(KeyFilter::Include("^k[01]$".into())).unwrap(), 2);
    assert_eq!(with(KeyFilter::Exclude("^__".into())).unwrap(), 4, "length stays");
    assert!(matches!(with(KeyFilter::Include("(".into())), Err(SourceError::LmdbOpen { .. })));
    assert!(matches!(with(KeyFilter::Prefix("zz".into())), Err(SourceError::LmdbEmpty { .. })));
    // Every key: the metadata values are 1 byte, not 6, so raw reads of them fail.
    let all = LmdbSource::open(&LmdbSpec { filter: KeyFilter::All, ..spec.clone() }).unwrap();
    assert_eq!(all.len(), 5);
    let err = read_fixed(&all, 0).unwrap_err().to_string();
    assert!(err.contains("__len__") && err.contains("raw") && err.contains("raw.lmdb"), "{err}");
}

#[test]
fn single_file_env_and_sharing() {
    let dir = tempfile::tempdir().unwrap();
    let env = dir.path().join("one.mdb");
    heed_env(&env, false, &[(b"a", vec![7; 4]), (b"b", vec![8; 4])]);
    let spec = LmdbSpec::new(vec![field("x", &env, raw_codec(&[4]))]);
    let first = LmdbSource::open(&spec).unwrap();
    let second = LmdbSource::open(&spec).unwrap();
    assert!(Arc::ptr_eq(&first.envs[0], &second.envs[0]), "one open environment per process");
    assert_eq!(read_fixed(&second, 1).unwrap()[0], vec![8; 4]);
    drop((first, second));
    // Closed with its last user, and opened afresh.
    let again = LmdbSource::open(&spec).unwrap();
    assert_eq!(read_fixed(&again, 0).unwrap()[0], vec![7; 4]);
}

#[test]
fn open_errors_name_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.lmdb");
    let err = LmdbSource::open(&LmdbSpec::new(vec![field("x", &missing, raw_codec(&[1]))])).unwrap_err();
    assert!(matches!(err, SourceError::LmdbOpen { .. }) && err.to_string().contains("nope.lmdb"), "{err}");
    let empty_dir = dir.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    let err = LmdbSource::open(&LmdbSpec::new(vec![field("x", &empty_dir, raw_codec(&[1]))])).unwrap_err();
    assert!(err.to_string().contains("without data.mdb"), "{err}");
    let junk = dir.path().join("junk.mdb");
    std::fs::write(&junk, vec![0u8; 100]).unwrap();
    let err = LmdbSource::open(&LmdbSpec::new(vec![field("x", &junk, raw_codec(&[1]))])).unwrap_err();
    assert!(matches!(err, SourceError::LmdbOpen { .. }), "{err}");
    let env = dir.path().join("ok.lmdb");
    heed_env(&env, true, &[(b"a", vec![1])]);
    let mut spec = LmdbSpec::new(vec![field("x", &env, raw_codec(&[1]))]);
    spec.allowed_roots = Some(vec![PathBuf::from("/nonexistent-root")]);
    assert!(matches!(
        LmdbSource::open(&spec),
        Err(SourceError::Access(crate::fsaccess::AccessError::NotAllowed { .. }))
    ));
    let twice = LmdbSpec::new(vec![field("x", &env, raw_codec(&[1])), field("x", &env, raw_codec(&[1]))]);
    assert!(matches!(LmdbSource::open(&twice), Err(SourceError::LmdbField { .. })));
}

#[test]
fn joined_envs_need_the_same_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.lmdb"), dir.path().join("b.lmdb"));
    heed_env(&a, true, &[(b"k0", vec![1; 2]), (b"k1", vec![2; 2]), (b"k2", vec![3; 2])]);
    heed_env(&b, true, &[(b"k0", vec![10; 3]), (b"k2", vec![30; 3])]);
    let spec = LmdbSpec::new(vec![field("a", &a, raw_codec(&[2])), field("b", &b, raw_codec(&[3]))]);
    let err = LmdbSource::open(&spec).unwrap_err();
    match &err {
        SourceError::LmdbMissingKey { env, key, missing, total, field } => {
            assert_eq!((env, key.as_str(), *missing, *total, field.as_str()), (&b, "k1", 1, 3, "b"));
        }
        other => panic!("{other}"),
    }
    // Listed from b, every key is in a.
    let spec = LmdbSpec::new(vec![field("b", &b, raw_codec(&[3])), field("a", &a, raw_codec(&[2]))]);
    let source = LmdbSource::open(&spec).unwrap();
    assert_eq!(read_fixed(&source, 1).unwrap(), vec![vec![30; 3], vec![3; 2]]);
}

#[test]
fn on_error_fail_and_skip() {
    let dir = tempfile::tempdir().unwrap();
    let env = dir.path().join("bad.lmdb");
    heed_env(&env, true, &[(b"a", vec![0; 4]), (b"b", vec![1; 3]), (b"c", vec![2; 4]), (b"d", vec![3; 5])]);
    let mut spec = LmdbSpec::new(vec![field("x", &env, raw_codec(&[4]))]);
    let fail = LmdbSource::open(&spec).unwrap();
    let err = read_fixed(&fail, 1).unwrap_err();
    match &err {
        SourceError::LmdbRead(read) => {
            assert_eq!((read.key.as_str(), read.codec.as_str(), read.index, read.field.as_str()), ("b", "raw", 1, "x"));
            assert_eq!(read.env, env);
        }
        other => panic!("{other}"),
    }
    spec.on_error = OnError::Skip;
    let skip = LmdbSource::open(&spec).unwrap();
    assert_eq!(read_fixed(&skip, 1).unwrap()[0], vec![2; 4], "b is bad: c stands in");
    assert_eq!(read_fixed(&skip, 3).unwrap()[0], vec![0; 4], "d is bad: wraps to a");
    assert_eq!(read_fixed(&skip, 1).unwrap()[0], vec![2; 4], "deterministic");
    assert_eq!(skip.skipped(), 3);
    let mut rows = [vec![0u8; 4]];
    let mut outs: Vec<LmdbOut<'_>> = rows.iter_mut().map(|r| LmdbOut::Fixed(&mut r[..])).collect();
    assert_eq!(skip.read_into(sample(1), &mut outs).unwrap(), 2, "reports the index read");
}

#[test]
fn skip_gives_up_when_everything_is_bad() {
    let dir = tempfile::tempdir().unwrap();
    let env = dir.path().join("allbad.lmdb");
    heed_env(&env, true, &[(b"a", vec![0; 3]), (b"b", vec![1; 3])]);
    let mut spec = LmdbSpec::new(vec![field("x", &env, raw_codec(&[4]))]);
    spec.on_error = OnError::Skip;
    let source = LmdbSource::open(&spec).unwrap();
    let err = read_fixed(&source, 0).unwrap_err();
    assert!(err.to_string().contains("the next 1 samples failed too"), "{err}");
}

#[test]
fn key_files_plain_and_basicsr() {
    assert_eq!(basicsr_key("0001_s001.png (480,480,3) 1"), Some("0001_s001"));
    assert_eq!(basicsr_key("baboon.png (120, 125, 3) 1"), Some("baboon"));
    assert_eq!(basicsr_key("plain key"), None);
    assert_eq!(basicsr_key("a.b.png (1,2) 0"), Some("a"), "BasicSR's split('.')[0]");
    let dir = tempfile::tempdir().unwrap();
    let env = dir.path().join("kf.lmdb");
    heed_env(&env, true, &[(b"x.1", vec![1]), (b"x.2", vec![2]), (b"y", vec![3])]);
    let keys = dir.path().join("keys.txt");
    std::fs::write(&keys, "y\n\nx.1\r\n").unwrap();
    let mut spec = LmdbSpec::new(vec![field("v", &env, raw_codec(&[1]))]);
    spec.key_file = Some(keys.clone());
    let source = LmdbSource::open(&spec).unwrap();
    assert_eq!(source.len(), 2);
    assert_eq!((read_fixed(&source, 0).unwrap()[0][0], read_fixed(&source, 1).unwrap()[0][0]), (3, 1));
    std::fs::write(&keys, "y\nnot-there\n").unwrap();
    assert!(matches!(LmdbSource::open(&spec), Err(SourceError::LmdbMissingKey { .. })));
    spec.key_file = Some(dir.path().join("absent.txt"));
    assert!(matches!(LmdbSource::open(&spec), Err(SourceError::LmdbKeyFile { .. })));
}

// ---- environments written by Python's lmdb package ----

/// The directory of environments made by make_lmdb.py, or `None` (skip) without a suitable Python.
fn python_envs() -> Option<&'static Path> {
    static DIR: OnceLock<Option<tempfile::TempDir>> = OnceLock::new();
    DIR.get_or_init(|| {
        let python = std::env::var_os("STOKER_PYTHON").map(PathBuf::from).unwrap_or_else(|| {
            let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
            if venv.exists() { venv } else { PathBuf::from("python3") }
        });
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/source/testdata/make_lmdb.py");
        let dir = tempfile::tempdir().unwrap();
        let result = Command::new(&python).arg(&script).arg(dir.path()).output();
        match result {
            Ok(out) if out.status.success() => Some(dir),
            other => {
                let why = match other {
                    Ok(out) => String::from_utf8_lossy(&out.stderr).into_owned(),
                    Err(e) => e.to_string(),
                };
                assert!(
                    std::env::var_os("STOKER_REQUIRE_PYTHON").is_none(),
                    "{} cannot write the LMDB fixtures: {why}",
                    python.display()
                );
                eprintln!("skipping Python-written LMDB tests: {} failed: {why}", python.display());
                None
            }
        }
    })
    .as_ref()
    .map(|d| d.path())
}

fn png() -> Codec {
    "png".parse().unwrap()
}

/// Pixel (y, x, c) of make_lmdb.py's image for key number i.
fn lr_pixel(i: usize, y: usize, x: usize, c: usize) -> u8 {
    ((7 * i + 3 * y + 5 * x + 40 * c) % 256) as u8
}

fn lr_image(i: usize, h: usize, w: usize) -> Vec<u8> {
    let mut v = Vec::new();
    for y in 0..h {
        for x in 0..w {
            for c in 0..3 {
                v.push(lr_pixel(i, y, x, c));
            }
        }
    }
    v
}

#[test]
fn python_envs_subdir_and_single_file() {
    let Some(dir) = python_envs() else { return };
    for env in ["single.lmdb", "single_file.mdb"] {
        let env = dir.join(env);
        let source = LmdbSource::open(&LmdbSpec::new(vec![field("img", &env, png())])).unwrap();
        assert_eq!(source.len(), 12, "{}: __len__, __keys__ and length are skipped", env.display());
        assert_eq!(source.fields()[0].shape, vec![6, 8, 3]);
        assert_eq!(source.key(3), b"img_003");
        assert_eq!(read_fixed(&source, 3).unwrap()[0], lr_image(3, 6, 8));
        // Every key: the first (bytewise) is __keys__, a pickle, not a PNG.
        let all = LmdbSpec { filter: KeyFilter::All, ..LmdbSpec::new(vec![field("img", &env, png())]) };
        let err = LmdbSource::open(&all).unwrap_err().to_string();
        assert!(err.contains("__keys__") && err.contains("png") && err.contains(&env.display().to_string()), "{err}");
        let skip = LmdbSource::open(&LmdbSpec { on_error: OnError::Skip, ..all }).unwrap();
        assert_eq!(skip.len(), 15);
        assert_eq!(read_fixed(&skip, 0).unwrap()[0], lr_image(0, 6, 8), "__keys__, __len__ skipped: img_000");
        assert_eq!(skip.skipped(), 2);
    }
}

#[test]
fn python_paired_lr_hr_with_basicsr_meta_info() {
    let Some(dir) = python_envs() else { return };
    let (lr, hr) = (dir.join("lr.lmdb"), dir.join("hr.lmdb"));
    let mut spec = LmdbSpec::new(vec![field("lr", &lr, png()), field("hr", &hr, png())]);
    spec.key_file = Some(hr.join("meta_info.txt"));
    let source = LmdbSource::open(&spec).unwrap();
    assert_eq!(source.len(), 12);
    assert_eq!(source.key(0), b"img_011", "meta_info.txt order (written descending)");
    let rows = read_fixed(&source, 0).unwrap();
    assert_eq!(rows[0], lr_image(11, 6, 8));
    assert_eq!(source.fields()[1].shape, vec![24, 32, 3]);

    // Paired random crops and flips, then CHW float: HR is LR blown up 4× exactly.
    spec.fields[0].transforms =
        vec![Step::RandomCrop { height: 3, width: 4 }, Step::RandomHFlip, Step::ToF32 { scale: 1.0 }, Step::ToChw];
    spec.fields[1].transforms =
        vec![Step::RandomCrop { height: 12, width: 16 }, Step::RandomHFlip, Step::ToF32 { scale: 1.0 }, Step::ToChw];
    spec.fields[1].pair = Some(Pair { with: "lr".into(), scale: 4 });
    let source = LmdbSource::open(&spec).unwrap();
    assert_eq!(source.fields()[0].shape, vec![3, 3, 4]);
    assert_eq!(source.fields()[1].shape, vec![3, 12, 16]);
    assert_eq!(source.fields()[1].dtype, DType::F32);
    let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    let mut distinct = HashSet::new();
    for index in 0..source.len() {
        for epoch in 0..4 {
            let mut rows: Vec<Vec<u8>> = source.fields().iter().map(|f| vec![0u8; bytes_of(f)]).collect();
            let mut out: Vec<LmdbOut<'_>> = rows.iter_mut().map(|r| LmdbOut::Fixed(&mut r[..])).collect();
            source.read_into(SampleRef { index, seed: 9, epoch }, &mut out).unwrap();
            let (lr, hr) = (f32s(&rows[0]), f32s(&rows[1]));
            for c in 0..3 {
                for y in 0..12 {
                    for x in 0..16 {
                        assert_eq!(hr[(c * 12 + y) * 16 + x], lr[(c * 3 + y / 4) * 4 + x / 4]);
                    }
                }
            }
            distinct.insert(rows[0].clone());
        }
    }
    assert!(distinct.len() > 24, "crops vary with index and epoch");

    // Pairing sizes that do not scale are refused at open.
    spec.fields[1].transforms = vec![Step::RandomCrop { height: 12, width: 12 }, Step::RandomHFlip];
    let err = LmdbSource::open(&spec).unwrap_err().to_string();
    assert!(err.contains("\"hr\"") && err.contains("scale 4"), "{err}");
}

#[test]
fn python_missing_key_in_a_joined_env() {
    let Some(dir) = python_envs() else { return };
    let spec =
        LmdbSpec::new(vec![field("hr", &dir.join("hr.lmdb"), png()), field("lr", &dir.join("lr_missing.lmdb"), png())]);
    let err = LmdbSource::open(&spec).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, SourceError::LmdbMissingKey { .. }), "{text}");
    assert!(text.contains("img_004") && text.contains("lr_missing.lmdb") && text.contains("\"lr\""), "{text}");
}

#[test]
fn python_corrupt_value_fail_and_skip() {
    let Some(dir) = python_envs() else { return };
    let npy: Codec = "npy".parse().unwrap();
    let env = dir.join("corrupt.lmdb");
    let mut spec = LmdbSpec::new(vec![field("x", &env, npy)]);
    // Probing all six keys sees e's (2, 3): the first dimension varies.
    assert_eq!(LmdbSource::open(&spec).unwrap().shapes(), vec![vec![None, Some(3)]]);
    // Probing two, the field is fixed at (3, 3) and e fails at read time.
    spec.probe = 2;
    let source = LmdbSource::open(&spec).unwrap();
    assert_eq!(source.fields()[0].shape, vec![3, 3]);
    let value = |rows: Vec<Vec<u8>>| f32::from_ne_bytes(rows[0][..4].try_into().unwrap());
    assert_eq!(value(read_fixed(&source, 1).unwrap()), 1.0);
    let err = read_fixed(&source, 2).unwrap_err().to_string();
    assert!(err.contains("key \"c\"") && err.contains("codec npy") && err.contains("corrupt.lmdb"), "{err}");
    let err = read_fixed(&source, 4).unwrap_err().to_string();
    assert!(err.contains("laid out as float32 [3, 3]"), "{err}");
    spec.on_error = OnError::Skip;
    let source = LmdbSource::open(&spec).unwrap();
    let values: Vec<f32> = (0..6).map(|i| value(read_fixed(&source, i).unwrap())).collect();
    assert_eq!(values, vec![0.0, 1.0, 3.0, 3.0, 5.0, 5.0]);
    assert_eq!(source.skipped(), 2);
}

#[test]
fn python_variable_shapes() {
    let Some(dir) = python_envs() else { return };
    let env = dir.join("variable.lmdb");
    let source = LmdbSource::open(&LmdbSpec::new(vec![field("v", &env, png())])).unwrap();
    assert_eq!(source.shapes(), vec![vec![None, None, Some(3)]]);
    assert_eq!(source.fields()[0].shape, vec![0, 0, 3]);
    assert_eq!(bytes_of(&source.fields()[0]), 0);
    assert!(!source.is_fixed(0));
    read_fixed(&source, 0).unwrap(); // the variable field is left out
    for i in 0..5usize {
        let (mut bytes, mut shape) = (Vec::new(), Vec::new());
        let mut out = [LmdbOut::Variable { bytes: &mut bytes, shape: &mut shape }];
        source.read_into(sample(i as u64), &mut out).unwrap();
        assert_eq!(shape, vec![5 + i as u64, 7 + 2 * i as u64, 3]);
        assert_eq!(bytes, lr_image(i, 5 + i, 7 + 2 * i));
        // Ragged delivery: straight into a slot row of the field's reserved size.
        let room = source.fields()[0].max_sample_bytes.expect("variable fields are ragged") as usize;
        assert!(room >= 1 << 20);
        let (mut row, mut row_shape) = (vec![0u8; room], [0u64; 3]);
        let mut out = [LmdbOut::Ragged { data: &mut row, shape: &mut row_shape }];
        source.read_into(sample(i as u64), &mut out).unwrap();
        assert_eq!(row_shape.to_vec(), shape);
        assert_eq!(&row[..bytes.len()], &bytes[..]);
        // Too little room: the stream is told how much the value needs (it
        // produces the batch again in a bigger slot).
        let mut tiny = [LmdbOut::Ragged { data: &mut row[..10], shape: &mut row_shape }];
        match source.read_into(sample(i as u64), &mut tiny).unwrap_err() {
            SourceError::Oversize { field: 0, bytes: need, message } => {
                assert_eq!(need as usize, bytes.len());
                assert!(message.contains("v0") || message.contains(&format!("v{i}")), "{message}");
            }
            other => panic!("expected Oversize, got {other}"),
        }
    }
    // A crop makes it fixed again; variable reads also go through transforms.
    let mut cropped = field("v", &env, png());
    cropped.transforms = vec![Step::CenterCrop { height: 4, width: 6 }];
    let source = LmdbSource::open(&LmdbSpec::new(vec![cropped.clone()])).unwrap();
    assert_eq!(source.fields()[0].shape, vec![4, 6, 3]);
    let row = &read_fixed(&source, 2).unwrap()[0];
    // Image 2 is 7 × 11: the crop starts at ((7-4)/2, (11-6)/2) = (1, 2).
    assert_eq!(row[..3], [lr_pixel(2, 1, 2, 0), lr_pixel(2, 1, 2, 1), lr_pixel(2, 1, 2, 2)]);
    cropped.transforms = vec![Step::Resize { height: 4, width: 4, filter: Filter::Nearest }, Step::ToChw];
    let source = LmdbSource::open(&LmdbSpec::new(vec![cropped])).unwrap();
    assert_eq!(source.fields()[0].shape, vec![3, 4, 4]);
    read_fixed(&source, 4).unwrap();
}

#[test]
fn python_zstd_npy_and_parallel_reads() {
    let Some(dir) = python_envs() else { return };
    let codec: Codec = "zstd+npy".parse().unwrap();
    let source = Arc::new(LmdbSource::open(&LmdbSpec::new(vec![field("z", &dir.join("zstd.lmdb"), codec)])).unwrap());
    assert_eq!(source.fields()[0].dtype, DType::F32);
    let want: Vec<Vec<u8>> = (0..4).map(|i| read_fixed(&source, i).unwrap().remove(0)).collect();
    for (i, row) in want.iter().enumerate() {
        assert!(row.chunks_exact(4).all(|c| f32::from_ne_bytes(c.try_into().unwrap()) == i as f32 / 2.0));
    }
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let source = source.clone();
            let want = want.clone();
            std::thread::spawn(move || {
                for k in 0..200u64 {
                    let i = (k * 7 + t) % 4;
                    assert_eq!(read_fixed(&source, i).unwrap()[0], want[i as usize]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

//! The registry over real HDF5 files (written here with the `hdf5` crate,
//! closed before the registry opens them): reuse while files are unchanged,
//! a fresh source once one changes, idle sources closed beyond the bound,
//! and the generation fingerprint pinned to its historical values.

use std::path::Path;

use stoker_data::cache::{Caches, Policy};

use super::*;
use crate::config::Config;

/// Writes `x` shaped `[rows, 4]` of u8 (row `i` holds `i + offset`).
fn write_h5(path: &Path, rows: usize, offset: u8) {
    let data: Vec<u8> = (0..rows * 4).map(|i| (i / 4) as u8 + offset).collect();
    let file = ::hdf5::File::create(path).unwrap();
    file.new_dataset::<u8>().shape([rows, 4]).create("x").unwrap().write_raw(&data).unwrap();
}

/// A registry over a config with datasets `d0..d{n}` reading `dir/*.h5`,
/// each naming its field differently (distinct datasets over one file).
fn registry(dir: &Path, n: usize) -> Datasets {
    let mut text = String::new();
    for i in 0..n {
        text.push_str(&format!(
            "[datasets.d{i}]\nformat = \"hdf5\"\nfiles = \"{}/*.h5\"\nfields = {{ x{i} = \"x\" }}\n",
            dir.display()
        ));
    }
    let settings = Config::parse(&text, Path::new("test.toml")).unwrap().check().unwrap();
    Datasets::new(settings, Caches::new(1 << 20, 1 << 20, Policy::Belady))
}

fn open(datasets: &Datasets, name: &str) -> Opened {
    datasets.open(&DatasetRef::Named(name.into()), &Peer::daemon()).unwrap()
}

#[test]
fn an_unchanged_dataset_is_reused_and_a_changed_one_opened_afresh() {
    let dir = tempfile::tempdir().unwrap();
    write_h5(&dir.path().join("a.h5"), 8, 0);
    let datasets = registry(dir.path(), 1);
    let first = open(&datasets, "d0");
    let again = open(&datasets, "d0");
    assert!(Arc::ptr_eq(&first.source, &again.source), "the open source is shared");
    assert_eq!(first.generation, again.generation);
    assert_eq!(first.fingerprint, again.fingerprint);
    assert_eq!((first.generation.files, first.generation.samples), (1, 8));

    // Replaced by a file with more rows (written aside, renamed over: the
    // open source still holds the old one): another identity, source and generation.
    write_h5(&dir.path().join("new.tmp"), 12, 100);
    std::fs::rename(dir.path().join("new.tmp"), dir.path().join("a.h5")).unwrap();
    let changed = open(&datasets, "d0");
    assert!(!Arc::ptr_eq(&first.source, &changed.source), "a changed file is opened anew");
    assert_ne!(first.generation.fingerprint, changed.generation.fingerprint);
    assert_ne!(first.fingerprint, changed.fingerprint, "the caches must not mix the two");
    assert_eq!(changed.generation.samples, 12);
    // The stream holding the old source keeps it; the registry holds the new one once.
    assert_eq!(datasets.status().len(), 1);
}

#[test]
fn distinct_descriptions_of_one_file_are_distinct_datasets() {
    let dir = tempfile::tempdir().unwrap();
    write_h5(&dir.path().join("a.h5"), 4, 0);
    let datasets = registry(dir.path(), 2);
    let (a, b) = (open(&datasets, "d0"), open(&datasets, "d1"));
    assert!(!Arc::ptr_eq(&a.source, &b.source));
    assert_ne!(a.fingerprint, b.fingerprint, "field names are part of the identity");
    // Same files, same generation: the file list is what a generation names.
    assert_eq!(a.generation, b.generation);
}

#[test]
fn idle_sources_beyond_the_bound_are_closed_least_recently_used_first() {
    let dir = tempfile::tempdir().unwrap();
    write_h5(&dir.path().join("a.h5"), 4, 0);
    let n = KEEP_IDLE + 3;
    let datasets = registry(dir.path(), n);
    // Held by a "stream": never closed while in use.
    let held = open(&datasets, "d0");
    for i in 1..n {
        drop(open(&datasets, &format!("d{i}")));
    }
    // Each open evicts beyond KEEP_IDLE idle ones, counted while the new
    // one is still held by its opener: the held one, the last one and
    // KEEP_IDLE idle ones remain.
    let open_now: Vec<String> = datasets.status().into_iter().map(|(s, _)| s.dataset).collect();
    assert_eq!(open_now.len(), KEEP_IDLE + 2, "{open_now:?}");
    assert!(open_now.contains(&"d0".to_string()), "the held dataset stays: {open_now:?}");
    assert!(!open_now.contains(&"d1".to_string()), "d1 was idle longest: {open_now:?}");
    assert!(open_now.contains(&format!("d{}", n - 1)), "the newest stays: {open_now:?}");
    drop(held);
}

#[test]
fn generation_fingerprints_keep_their_historical_values() {
    // Loader state saved by earlier versions compares against these: the
    // same files and keys must give the same values forever.
    let ids = [
        FileId { dev: 1, ino: 2, size: 3, mtime_ns: 4, ctime_ns: 9, btime_ns: 11 },
        FileId { dev: 5, ino: 6, size: 7, mtime_ns: -8, ctime_ns: 10, btime_ns: 12 },
    ];
    let paths = [Path::new("/data/a.h5"), Path::new("/data/b.h5")];
    assert_eq!(files_fingerprint(paths.into_iter(), &ids).finish(), 0xd00c_3904_2736_c92d);
    let keys: [&[u8]; 2] = [b"0001", b"0002"];
    assert_eq!(keys_fingerprint(keys.into_iter()).finish(), 0xfa56_286b_e544_89b4);
}

//! `stoker inspect` of an LMDB environment: key count, key shapes and what
//! the first values look like, without opening a dataset.

use std::collections::BTreeMap;
use std::path::Path;

use crate::source::SourceError;
use stoker_decode::codec::{ArrayInfo, Codec};

use super::*;

/// What `stoker inspect` reports about one environment.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EnvScan {
    /// Entries in the main database.
    pub entries: u64,
    /// Keys that look like metadata (`__len__`, `length`, …), skipped by default.
    pub metadata_keys: Vec<String>,
    /// Key shapes (digits as `#`, letters as `a`) and how many keys have each.
    pub key_patterns: Vec<(String, u64)>,
    /// First and last sample keys.
    pub first_keys: Vec<String>,
    /// Value formats among the values probed: `png`, `jpeg`, `npy`, `lz4+npy`, …, `unknown`.
    pub formats: Vec<(String, u64)>,
    /// Decoded dtype and shape among the values probed, with counts.
    pub shapes: Vec<(String, u64)>,
    /// Values probed (the first ones in key order).
    pub probed: u64,
    /// Each probed key with its decoded shape (for pairing environments by image size).
    #[serde(skip)]
    pub probed_shapes: Vec<(Vec<u8>, Vec<u64>)>,
}

/// Scans an environment for `stoker inspect`: counts keys, sniffs the
/// format of the first `probe` sample values and probes their shapes.
pub fn scan(path: &Path, probe: usize) -> Result<EnvScan, SourceError> {
    let env = SharedEnv::open(path, None)?;
    let err = |e: GuardError| SourceError::LmdbOpen { env: path.to_owned(), message: e.to_string() };
    let txn = env.env.txn().map_err(err)?;
    let mut cursor = txn.cursor().map_err(err)?;
    let mut value = Vec::new();
    let mut scan = EnvScan::default();
    let mut patterns: BTreeMap<String, u64> = BTreeMap::new();
    let mut formats: BTreeMap<String, u64> = BTreeMap::new();
    let mut shapes: BTreeMap<String, u64> = BTreeMap::new();
    let mut last = None;
    loop {
        let want_value = (scan.probed as usize) < probe;
        let Some((key, value_at)) = cursor.next_entry(want_value).map_err(err)? else { break };
        scan.entries += 1;
        if is_metadata_key(key) {
            scan.metadata_keys.push(show_key(key));
            continue;
        }
        let pattern: String = String::from_utf8_lossy(key)
            .chars()
            .map(|c| {
                if c.is_ascii_digit() {
                    '#'
                } else if c.is_alphabetic() {
                    'a'
                } else {
                    c
                }
            })
            .collect();
        *patterns.entry(pattern).or_default() += 1;
        if scan.first_keys.len() < 3 {
            scan.first_keys.push(show_key(key));
        } else {
            last = Some(show_key(key));
        }
        if let Some(value_at) = value_at {
            scan.probed += 1;
            value.clear();
            value.resize(value_at.len(), 0);
            txn.copy(value_at, &mut value).map_err(err)?;
            let (format, info) = sniff_value(&value);
            *formats.entry(format).or_default() += 1;
            if let Some(info) = info {
                *shapes.entry(info.to_string()).or_default() += 1;
                scan.probed_shapes.push((key.to_vec(), info.shape));
            }
        }
    }
    scan.first_keys.extend(last);
    let by_count = |m: BTreeMap<String, u64>| {
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(8);
        v
    };
    scan.key_patterns = by_count(patterns);
    scan.formats = by_count(formats);
    scan.shapes = by_count(shapes);
    Ok(scan)
}

/// The codec name a value seems to need, and its decoded layout when a codec probes it.
pub(super) fn sniff_value(value: &[u8]) -> (String, Option<ArrayInfo>) {
    let outer = stoker_decode::codec::sniff(value);
    let candidates: Vec<String> = match outer {
        "lz4" | "zstd" => ["npy", "png", "jpeg"].iter().map(|inner| format!("{outer}+{inner}")).collect(),
        "unknown" => return ("unknown".into(), None),
        format => vec![format.to_string()],
    };
    for name in &candidates {
        if let Ok(info) = Codec::parse(name, None).and_then(|codec| codec.probe(value)) {
            return (name.clone(), Some(info));
        }
    }
    (format!("{outer}+?"), None)
}

//! `stoker inspect PATH`: what is in an HDF5 file (datasets, layouts,
//! filters, and how stoker would read each: fast path or libhdf5, and why) or
//! an LMDB environment (entries, key patterns, value formats and sizes), with
//! a suggested dataset config.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use hdf5::datatype::ByteOrder;
use hdf5::{LinkType, LocationType};

use crate::source::hdf5::classify;
use crate::source::hdf5::field::library::{FactsError, field_facts};
use crate::source::hdf5::field::{NotOwn, open_own_dataset};

/// One dataset of the file, as inspected.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DatasetReport {
    /// HDF5 path.
    pub path: String,
    /// Dataset shape.
    pub shape: Vec<u64>,
    /// dtype served, or what the file holds when it cannot be served.
    pub dtype: String,
    /// Whether stoker can serve it.
    pub servable: bool,
    /// Byte order in the file.
    pub byte_order: String,
    /// Storage layout.
    pub layout: String,
    /// Chunk shape, when chunked.
    pub chunks: Option<Vec<u64>>,
    /// Filter names, in pipeline order.
    pub filters: Vec<String>,
    /// How stoker reads it.
    pub read_path: String,
}

/// Why a file or environment could not be inspected.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// The file does not open as HDF5.
    #[error("cannot open {} as HDF5: {error}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// libhdf5's error.
        error: hdf5::Error,
    },
    /// libhdf5 failed while walking the file.
    #[error(transparent)]
    Hdf5(#[from] hdf5::Error),
    /// Groups nested deeper than any real layout (a crafted file).
    #[error("group {prefix:?} is nested more than {MAX_GROUP_DEPTH} deep")]
    TooDeep {
        /// The group's path.
        prefix: String,
    },
    /// An LMDB environment that does not scan.
    #[error(transparent)]
    Lmdb(#[from] crate::source::SourceError),
}

/// Inspects every dataset of the file at `path`.
pub fn inspect(path: &Path) -> Result<Vec<DatasetReport>, InspectError> {
    let file = hdf5::File::open(path).map_err(|error| InspectError::Open { path: path.to_owned(), error })?;
    let mut out = Vec::new();
    let mut seen = Vec::new();
    visit(&file, "", &mut seen, &mut out)?;
    Ok(out)
}

/// Deepest group nesting `inspect` walks (a file's own layout is a few deep).
const MAX_GROUP_DEPTH: usize = 64;

/// Reports the datasets beneath `group`, each group once: hard links can
/// make cycles (a group linking to its parent), which recursed until the
/// stack overflowed, and repeated links could multiply the walk.
fn visit(
    group: &hdf5::Group,
    prefix: &str,
    seen: &mut Vec<(u64, hdf5::LocationToken)>,
    out: &mut Vec<DatasetReport>,
) -> Result<(), InspectError> {
    let info = group.loc_info()?;
    if seen.contains(&(info.fileno, info.token)) {
        return Ok(());
    }
    seen.push((info.fileno, info.token));
    if prefix.split('/').count() > MAX_GROUP_DEPTH {
        return Err(InspectError::TooDeep { prefix: prefix.to_string() });
    }
    // External links are not followed (the daemon would refuse them too).
    let mut links = BTreeMap::new();
    group.iter_visit_default(|name, info| {
        links.insert(name.to_owned(), info.link_type);
        Ok(())
    })?;
    for (name, link) in links {
        let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}/{name}") };
        if link == LinkType::External {
            out.push(not_own(path, &NotOwn::ExternalLink("another file".into())));
            continue;
        }
        match group.loc_type_by_name(&name) {
            Ok(LocationType::Group) => visit(&group.group(&name)?, &path, seen, out)?,
            Ok(LocationType::Dataset) => out.push(match open_own_dataset(group, &name) {
                Ok(dataset) => report(dataset, path),
                Err(NotOwn::Missing) => report(group.dataset(&name)?, path),
                // A soft link through an external one lands here too.
                Err(why) => not_own(path, &why),
            }),
            _ => {}
        }
    }
    Ok(())
}

/// A dataset whose values live in other files: not servable, and why.
fn not_own(path: String, why: &NotOwn) -> DatasetReport {
    DatasetReport {
        path,
        shape: Vec::new(),
        dtype: "-".into(),
        servable: false,
        byte_order: "-".into(),
        layout: match why {
            NotOwn::Virtual(_) => "virtual",
            NotOwn::ExternalStorage(_) => "external storage",
            NotOwn::ExternalLink(_) | NotOwn::Missing => "external link",
        }
        .into(),
        chunks: None,
        filters: Vec::new(),
        read_path: format!("not servable: {}", why.explain().unwrap_or_default()),
    }
}

fn report(dataset: hdf5::Dataset, path: String) -> DatasetReport {
    let shape: Vec<u64> = dataset.shape().iter().map(|&d| d as u64).collect();
    let layout = format!("{:?}", dataset.layout()).to_lowercase();
    let chunks = dataset.chunk().map(|c| c.iter().map(|&d| d as u64).collect());
    let filters = crate::source::hdf5::field_filters(&dataset)
        .iter()
        .map(|(name, id, decoder)| match decoder {
            Some(decoder) => format!("{name} ({id}): decoded by {decoder}"),
            None => format!("{name} ({id}): NOT decodable here (pip install hdf5plugin; set HDF5_PLUGIN_PATH)"),
        })
        .collect();
    let Ok(file_type) = dataset.dtype() else {
        return DatasetReport {
            path,
            shape,
            dtype: "unreadable type".into(),
            servable: false,
            byte_order: "-".into(),
            layout,
            chunks,
            filters,
            read_path: "-".into(),
        };
    };
    let byte_order = match file_type.byte_order() {
        ByteOrder::LittleEndian => "little",
        ByteOrder::BigEndian => "big",
        _ => "-",
    }
    .to_string();
    let (dtype, servable, read_path) = match classify(&file_type) {
        Ok((dtype, _)) if !shape.is_empty() => {
            let read_path = match field_facts(&dataset, true) {
                Ok((facts, _)) => facts.layout.describe(),
                Err(FactsError::Dtype(found) | FactsError::Other(found)) => format!("cannot read: {found}"),
            };
            (dtype.to_string(), true, read_path)
        }
        Ok((dtype, _)) => (dtype.to_string(), false, "scalar: no axis to index samples by".to_string()),
        Err(found) => (found.to_string(), false, "not servable: stoker serves numeric datasets".to_string()),
    };
    DatasetReport { path, shape, dtype, servable, byte_order, layout, chunks, filters, read_path }
}

/// Whether `path` is an LMDB environment (a directory holding `data.mdb`, or an `.mdb`/`.lmdb` file).
pub fn is_lmdb(path: &Path) -> bool {
    path.join("data.mdb").is_file() || (path.is_file() && path.extension().is_some_and(|e| e == "mdb" || e == "lmdb"))
}

/// One LMDB environment, as inspected.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LmdbReport {
    /// The environment, as an absolute path.
    pub env: PathBuf,
    /// What is in it.
    #[serde(flatten)]
    pub scan: crate::source::lmdb::EnvScan,
    /// Whether it was found beside the one asked about (an LR/HR partner).
    pub found_beside: bool,
}

/// Scans LMDB environments given together (the first `probe` sample values
/// of each are decoded far enough to learn their shapes). One environment
/// whose name says `HR` or `LR` is scanned with its partner from the same
/// directory (`DIV2K_train_HR_sub.lmdb` and `DIV2K_train_LR_bicubic_X4_sub.lmdb`).
pub fn inspect_lmdb(paths: &[PathBuf], probe: usize) -> Result<Vec<LmdbReport>, InspectError> {
    let mut envs: Vec<(PathBuf, bool)> = paths.iter().map(|p| (absolute(p), false)).collect();
    if let [(only, _)] = envs.as_slice()
        && let Some(partner) = partners(only).into_iter().next()
    {
        envs.push((partner, true));
    }
    envs.into_iter()
        .map(|(env, found_beside)| Ok(LmdbReport { scan: crate::source::lmdb::scan(&env, probe)?, env, found_beside }))
        .collect()
}

/// `path` as an absolute path (symlinks resolved where it exists).
fn absolute(path: &Path) -> PathBuf {
    path.canonicalize().or_else(|_| std::path::absolute(path)).unwrap_or_else(|_| path.to_owned())
}

/// The lowercase alphanumeric words of a file name (`DIV2K_train_HR_sub.lmdb` → div2k, train, hr, sub, lmdb).
fn words(name: &Path) -> Vec<String> {
    let name = name.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    name.split(|c: char| !c.is_ascii_alphanumeric()).filter(|w| !w.is_empty()).map(str::to_string).collect()
}

/// LMDB environments beside `env` that are its LR/HR partner: the other
/// resolution's name has every word of this one's, with `hr` and `lr`
/// swapped, plus words of its own (`bicubic`, `x4`). Sorted by name.
fn partners(env: &Path) -> Vec<PathBuf> {
    let mine = words(env);
    let swap = |w: &String| match w.as_str() {
        "hr" => "lr".to_string(),
        "lr" => "hr".to_string(),
        _ => w.clone(),
    };
    let is_hr = mine.iter().any(|w| w == "hr");
    if !is_hr && !mine.iter().any(|w| w == "lr") {
        return Vec::new();
    }
    let Some(Ok(dir)) = env.parent().map(std::fs::read_dir) else { return Vec::new() };
    let mut found: Vec<PathBuf> = dir
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p != env && is_lmdb(p))
        .filter(|p| {
            let theirs = words(p);
            if is_hr {
                mine.iter().map(swap).all(|w| theirs.contains(&w))
            } else {
                theirs.iter().any(|w| w == "hr") && theirs.iter().map(swap).all(|w| mine.contains(&w))
            }
        })
        .collect();
    found.sort();
    found
}

/// A TOML string holding `s`.
fn quote(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// `s` as a TOML bare key: letters, digits and `_` (anything else becomes `_`).
fn bare_key(s: &str, fallback: &str) -> String {
    let key: String = s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
    if key.is_empty() { fallback.to_string() } else { key }
}

/// The name stem of a dataset at `path` (`DIV2K_train_HR_sub.lmdb` → `DIV2K_train_HR_sub`).
fn stem(path: &Path) -> String {
    bare_key(&path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(), "data")
}

/// How two environments pair: the low-resolution one, the high-resolution
/// one, and the size ratio every probed key agrees on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pairing {
    lr: usize,
    hr: usize,
    scale: u64,
}

/// The LR/HR pairing among `envs`: two environments whose values under the
/// same keys are images of the same channels whose height and width differ
/// by one integer factor ≥ 2.
fn pairing(envs: &[LmdbReport]) -> Option<Pairing> {
    let ratio = |small: &[u64], big: &[u64]| -> Option<u64> {
        let ([sh, sw, rest_s @ ..], [bh, bw, rest_b @ ..]) = (small, big) else { return None };
        let scale = bh.checked_div(*sh)?;
        (scale >= 2 && *bh == scale * sh && *bw == scale.checked_mul(*sw)? && rest_s == rest_b).then_some(scale)
    };
    for (a, ea) in envs.iter().enumerate() {
        for (b, eb) in envs.iter().enumerate() {
            let mut scale = None;
            let mut agree = true;
            for (key, small) in &ea.scan.probed_shapes {
                let Some((_, big)) = eb.scan.probed_shapes.iter().find(|(k, _)| k == key) else { continue };
                match (ratio(small, big), scale) {
                    (Some(r), None) => scale = Some(r),
                    (Some(r), Some(s)) if r == s => {}
                    _ => agree = false,
                }
            }
            if let (true, Some(scale)) = (agree, scale)
                && a != b
            {
                return Some(Pairing { lr: a, hr: b, scale });
            }
        }
    }
    None
}

/// A BasicSR `meta_info.txt` beside (inside the directory of) `env`, and the keys it lists.
fn meta_info(env: &Path) -> Option<(PathBuf, usize)> {
    let dir = if env.is_dir() { env } else { env.parent()? };
    let path = dir.join("meta_info.txt");
    // Read a bounded prefix: only the line count is reported.
    let file = std::fs::File::open(&path).ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(file, 64 << 20), &mut text).ok()?;
    Some((path, text.lines().filter(|l| !l.trim().is_empty()).count()))
}

/// The human-readable LMDB report, with a suggested `[datasets.NAME]` table
/// (one field per environment; an LR/HR pair as `lr` and `hr`).
pub fn format_lmdb_report(envs: &[LmdbReport]) -> String {
    let mut out = String::new();
    for r in envs {
        write_lmdb_scan(&mut out, r);
    }
    let Some(first) = envs.first() else { return out };
    let pair = pairing(envs);
    let names = lmdb_field_names(envs, pair);
    // The leader first: a pair's LR, then the rest in the order given.
    let mut order: Vec<usize> = (0..envs.len()).collect();
    if let Some(p) = pair {
        order.retain(|&i| i != p.lr);
        order.insert(0, p.lr);
    }
    let dataset = match pair {
        Some(p) => stem(&envs[p.hr].env),
        None => stem(&first.env),
    };
    write_lmdb_dataset(&mut out, envs, pair, &order, &dataset);
    for &i in &order {
        write_lmdb_field(&mut out, envs, pair, i, &names, &dataset);
    }
    out
}

/// The report's lines on one environment: what its scan found.
fn write_lmdb_scan(out: &mut String, r: &LmdbReport) {
    let scan = &r.scan;
    let beside = if r.found_beside { ", found beside the one given" } else { "" };
    let _ = writeln!(out, "{} (LMDB{beside})", r.env.display());
    let _ = writeln!(out, "  entries        {}", scan.entries);
    if !scan.metadata_keys.is_empty() {
        let _ = writeln!(out, "  metadata keys  {} (skipped by default)", scan.metadata_keys.join(", "));
    }
    let list = |v: &[(String, u64)]| v.iter().map(|(k, n)| format!("{k} ×{n}")).collect::<Vec<_>>().join(", ");
    let _ = writeln!(out, "  key patterns   {}", list(&scan.key_patterns));
    let _ = writeln!(out, "  keys           {}", scan.first_keys.join(", "));
    let _ = writeln!(out, "  formats        {} (first {} values)", list(&scan.formats), scan.probed);
    let _ = writeln!(out, "  decoded        {}", list(&scan.shapes));
}

/// The suggested field name of each environment: lr and hr for a pair, else
/// its stem ("x" when alone), numbered where names repeat.
fn lmdb_field_names(envs: &[LmdbReport], pair: Option<Pairing>) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for (i, r) in envs.iter().enumerate() {
        let base = match pair {
            Some(p) if p.lr == i => "lr".to_string(),
            Some(p) if p.hr == i => "hr".to_string(),
            _ if envs.len() == 1 => "x".to_string(),
            _ => stem(&r.env).to_lowercase(),
        };
        let mut name = base.clone();
        let mut n = 2;
        while names.contains(&name) {
            name = format!("{base}_{n}");
            n += 1;
        }
        names.push(name);
    }
    names
}

/// The suggested config's `[datasets.NAME]` table: the key file (BasicSR's
/// meta_info.txt) and notes on the pairing.
fn write_lmdb_dataset(out: &mut String, envs: &[LmdbReport], pair: Option<Pairing>, order: &[usize], dataset: &str) {
    // BasicSR writes meta_info.txt into each environment; the HR one's lists the pairs.
    let key_file =
        pair.and_then(|p| meta_info(&envs[p.hr].env)).or_else(|| order.iter().find_map(|&i| meta_info(&envs[i].env)));
    let _ = writeln!(out, "\nsuggested config:\n");
    let _ = writeln!(out, "[datasets.{dataset}]\nformat = \"lmdb\"");
    if let Some((path, keys)) = &key_file {
        let _ = writeln!(
            out,
            "key_file = {}   # BasicSR meta_info.txt: {keys} samples, in its order",
            quote(&path.display().to_string())
        );
    }
    if envs.iter().any(|r| r.found_beside) {
        let _ = writeln!(out, "# the LR/HR partner was found beside the environment given; check it is the right one");
    }
    if let Some(p) = pair {
        let others: Vec<String> = partners(&envs[p.lr].env)
            .iter()
            .filter(|o| **o != envs[p.hr].env)
            .map(|o| o.display().to_string())
            .collect();
        let _ = writeln!(out, "# LR/HR pair: every probed key's HR image is {}× its LR image", p.scale);
        if !others.is_empty() {
            let _ = writeln!(out, "# other HR environments beside the LR one: {}", others.join(", "));
        }
    }
}

/// The suggested config's `[[datasets.NAME.fields]]` entry for environment
/// `i`, with the transforms a pair or differing shapes call for.
fn write_lmdb_field(
    out: &mut String,
    envs: &[LmdbReport],
    pair: Option<Pairing>,
    i: usize,
    names: &[String],
    dataset: &str,
) {
    let r = &envs[i];
    let codec = r.scan.formats.first().map_or("raw", |(f, _)| f.as_str());
    let _ = writeln!(
        out,
        "\n[[datasets.{dataset}.fields]]\nname = {}\nenv = {}\ncodec = {}",
        quote(&names[i]),
        quote(&r.env.display().to_string()),
        quote(codec)
    );
    if let Some(p) = pair.filter(|p| p.hr == i) {
        let _ = writeln!(out, "pair = {{ with = {}, scale = {} }}", quote(&names[p.lr]), p.scale);
    }
    if let Some(p) = pair {
        let crop = if p.hr == i { 32 * p.scale } else { 32 };
        let _ = writeln!(
            out,
            "# transforms = [{{ random_crop = {{ height = {crop}, width = {crop} }} }}, \"hflip\"]   \
             # paired crops: the HR crop is {}× the LR crop",
            p.scale
        );
    } else if r.scan.shapes.len() > 1 {
        let _ = writeln!(
            out,
            "# values differ in shape: without a transform that fixes it the field arrives as a list of arrays;\n\
             # e.g. transforms = [{{ random_crop = {{ height = 224, width = 224 }} }}, \"hflip\", {{ to_f32 = {{ scale = 0.00392156862745098 }} }}, \"chw\"]"
        );
    }
    if codec.contains('?') || codec == "unknown" {
        let _ = writeln!(
            out,
            "# format not recognised: use codec = \"raw\" with dtype and shape if values are plain arrays"
        );
    }
}

/// Where samples run along time: the length of axis 1 shared by the
/// time-varying fields of `group`, when the file says it is a time series
/// (The Well's `t0_fields`/`t1_fields`/`t2_fields` groups, or a 1-D dataset
/// named `time` as long as axis 1 of some field).
fn time_axis(all: &[DatasetReport], group: &[&DatasetReport], well: bool) -> Option<u64> {
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for r in group.iter().filter(|r| r.shape.len() >= 3) {
        *counts.entry(r.shape[1]).or_default() += 1;
    }
    let times: Vec<u64> = all
        .iter()
        .filter(|r| r.shape.len() == 1 && r.path.rsplit('/').next().is_some_and(|n| n == "time" || n == "t"))
        .map(|r| r.shape[0])
        .collect();
    // A length a `time` dataset names wins; else the commonest (longest on a tie) in a Well file.
    let named = counts.keys().copied().filter(|len| times.contains(len)).max_by_key(|len| (counts[len], *len));
    let commonest = counts.iter().max_by_key(|(len, n)| (**n, **len)).map(|(len, _)| *len);
    named.or(if well { commonest } else { None })
}

/// The glob a suggested config names for `file`: its siblings sharing its
/// name up to a trailing number (`train-000.h5` → `train-*.h5`, so that
/// `val-000.h5` beside it does not join training), every file with its
/// extension in a directory named for a split (`train/`, `valid/`, `test/`:
/// The Well's layout), else the file alone; and a comment line saying how many files of the
/// directory it matches and which files with the same extension it leaves out.
fn sibling_glob(file: &Path) -> (String, String) {
    let dir_text = file.parent().map_or("/".into(), |d| d.display().to_string());
    let dir = glob::Pattern::escape(&dir_text);
    let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let ext = file.extension().map(|e| e.to_string_lossy().into_owned());
    let stem = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let prefix = stem.trim_end_matches(|c: char| c.is_ascii_digit());
    // A directory named for a split (The Well's train/valid/test) holds that split only.
    let split_dir = file.parent().and_then(Path::file_name).is_some_and(|d| {
        ["train", "training", "valid", "val", "validation", "test", "testing"].contains(&&*d.to_string_lossy())
    });
    let pattern = match &ext {
        Some(ext) if split_dir => format!("*.{}", glob::Pattern::escape(ext)),
        Some(ext) if prefix.len() < stem.len() && !prefix.is_empty() => {
            format!("{}*.{}", glob::Pattern::escape(prefix), glob::Pattern::escape(ext))
        }
        _ => glob::Pattern::escape(&name),
    };
    let files = format!("{}/{pattern}", dir.trim_end_matches('/'));
    let matcher = glob::Pattern::new(&pattern).ok();
    let mut matched = 0usize;
    let mut left: Vec<String> = Vec::new();
    if let Ok(entries) = std::fs::read_dir(file.parent().unwrap_or(Path::new("/"))) {
        for entry in entries.flatten().take(100_000) {
            let n = entry.file_name().to_string_lossy().into_owned();
            let same_ext = Path::new(&n).extension().map(|e| e.to_string_lossy().into_owned()) == ext;
            if matcher.as_ref().is_some_and(|m| m.matches(&n)) {
                matched += 1;
            } else if same_ext && ext.is_some() {
                left.push(n);
            }
        }
    }
    left.sort();
    let mut note = format!("# matches {matched} file{} in {dir_text}", if matched == 1 { "" } else { "s" });
    if !left.is_empty() {
        let shown: Vec<&str> = left.iter().take(8).map(String::as_str).collect();
        let more =
            if left.len() > shown.len() { format!(" and {} more", left.len() - shown.len()) } else { String::new() };
        note.push_str(&format!("; leaves out {}{more} (widen `files` to serve them too)", shown.join(", ")));
    }
    (files, note)
}

/// The human-readable report, with a suggested `[datasets.NAME]` table.
pub fn format_report(file: &Path, reports: &[DatasetReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", file.display());
    let _ = writeln!(
        out,
        "  {:<28} {:<18} {:<8} {:<6} {:<10} {:<14} {:<22} read path",
        "dataset", "shape", "dtype", "order", "layout", "chunks", "filters"
    );
    for r in reports {
        let chunks = r.chunks.as_ref().map_or("-".to_string(), |c| format!("{c:?}"));
        let filters = if r.filters.is_empty() { "-".to_string() } else { r.filters.join(",") };
        let _ = writeln!(
            out,
            "  {:<28} {:<18} {:<8} {:<6} {:<10} {:<14} {:<22} {}",
            r.path,
            format!("{:?}", r.shape),
            r.dtype,
            r.byte_order,
            r.layout,
            chunks,
            filters,
            r.read_path
        );
    }
    // The Well keeps its fields in t0_fields/t1_fields/t2_fields; dimensions,
    // boundary_conditions and scalars describe them and are not samples.
    let is_well_field =
        |r: &DatasetReport| ["t0_fields/", "t1_fields/", "t2_fields/"].iter().any(|g| r.path.starts_with(g));
    let well = reports.iter().any(is_well_field);
    // Suggest the servable datasets sharing a first-axis length: the length
    // most datasets with more than one axis share (1-D datasets are often
    // coordinates), then the most datasets, then the longest.
    let mut by_len: BTreeMap<u64, Vec<&DatasetReport>> = BTreeMap::new();
    for r in reports.iter().filter(|r| r.servable && (!well || is_well_field(r))) {
        by_len.entry(r.shape[0]).or_default().push(r);
    }
    let Some((&len, group)) =
        by_len.iter().max_by_key(|(len, g)| (g.iter().filter(|r| r.shape.len() >= 2).count(), g.len(), **len))
    else {
        let _ = writeln!(out, "\nno numeric datasets: nothing stoker can serve");
        return out;
    };
    let file = absolute(file);
    let stem = stem(&file);
    let (files, siblings) = sibling_glob(&file);
    let mut names: Vec<String> = Vec::new();
    let mut fields = Vec::new();
    for r in group {
        let base = bare_key(r.path.rsplit('/').next().unwrap_or(&r.path), "x");
        let mut name = base.clone();
        let mut n = 2;
        while names.contains(&name) {
            name = format!("{base}_{n}");
            n += 1;
        }
        fields.push(format!("{name} = {}", quote(&r.path)));
        names.push(name);
    }
    let time = time_axis(reports, group, well);
    // Fields without the time axis (or whose axis 1 is not it) are delivered whole per item.
    let per_item: Vec<&String> = match time {
        Some(t) => {
            names.iter().zip(group).filter(|(_, r)| r.shape.len() < 2 || r.shape[1] != t).map(|(n, _)| n).collect()
        }
        None => Vec::new(),
    };
    let windowed = time.filter(|_| per_item.len() < group.len());
    if well && let Some(t) = windowed {
        well_suggestion(&mut out, reports, group, len, t, &stem, &format!("{}\n{siblings}", quote(&files)));
        return out;
    }
    let _ = writeln!(out, "\nsuggested config ({} datasets with {len} items along axis 0):\n", group.len());
    let _ = writeln!(out, "[datasets.{stem}]");
    let _ = writeln!(out, "format = \"hdf5\"");
    let _ = writeln!(out, "files = {}", quote(&files));
    let _ = writeln!(out, "{siblings}");
    let _ = writeln!(out, "fields = {{ {} }}", fields.join(", "));
    if let Some(t) = windowed {
        let _ =
            writeln!(out, "# a time series of {t} steps along axis 1: each sample is a window of consecutive steps");
        let _ = writeln!(out, "window = {{ size = {}, stride = 1 }}", t.min(4));
        if !per_item.is_empty() {
            let list: Vec<String> = per_item.iter().map(|n| quote(n)).collect();
            let _ = writeln!(out, "# fields without the time axis, delivered whole with every window");
            let _ = writeln!(out, "per_item = [{}]", list.join(", "));
        }
    } else if group.iter().any(|r| r.shape.len() >= 3) {
        let _ = writeln!(
            out,
            "# time series ([item, time, ...]): samples can be windows along axis 1, e.g.\n\
             # window = {{ size = 4, stride = 1 }}\n# per_item = [\"...\"]   # fields without a time axis"
        );
    }
    out
}

/// The suggested table for a file in The Well's layout, as `WellDataset`
/// reads it: each time-varying field named twice, its first steps in
/// `input` and the rest in `output` (`n_steps_input` up to 4, one output
/// step); trajectory-wide fields without the time axis in `per_item`; fields
/// without the trajectory axis (`sample_varying = False`: the `t*_fields`
/// datasets not `items` long, the numeric `scalars`) in `constant`, or in
/// `time_only` when they are `time` steps long (`dimensions/time`, the
/// time-varying scalars).
fn well_suggestion(
    out: &mut String,
    reports: &[DatasetReport],
    group: &[&DatasetReport],
    items: u64,
    time: u64,
    stem: &str,
    files: &str,
) {
    let n_in = time.saturating_sub(1).clamp(1, 4);
    let mut names: Vec<String> = Vec::new();
    let mut unique = |path: &str| {
        let base = bare_key(path.rsplit('/').next().unwrap_or(path), "x");
        let mut name = base.clone();
        let mut n = 2;
        while names.iter().any(|m| *m == name || *m == format!("{name}_in") || *m == format!("{name}_out")) {
            name = format!("{base}_{n}");
            n += 1;
        }
        names.push(name.clone());
        name
    };
    let (mut fields, mut input, mut output, mut per_item, mut constant, mut time_only) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in group {
        let name = unique(&r.path);
        if r.shape.len() >= 2 && r.shape[1] == time {
            for (suffix, list) in [("_in", &mut input), ("_out", &mut output)] {
                fields.push(format!("{name}{suffix} = {}", quote(&r.path)));
                list.push(quote(&format!("{name}{suffix}")));
            }
        } else {
            fields.push(format!("{name} = {}", quote(&r.path)));
            per_item.push(quote(&name));
        }
    }
    let in_group = |r: &DatasetReport| group.iter().any(|g| g.path == r.path);
    let numeric = |r: &DatasetReport| r.servable || r.read_path.starts_with("scalar");
    for r in reports.iter().filter(|r| numeric(r) && !in_group(r)) {
        let field = ["t0_fields/", "t1_fields/", "t2_fields/"].iter().any(|g| r.path.starts_with(g));
        let scalar = r.path.starts_with("scalars/");
        let is_time = r.shape.len() == 1 && r.shape[0] == time && r.path.rsplit('/').next() == Some("time");
        if (scalar || is_time) && r.shape.first() == Some(&time) {
            let name = unique(&r.path);
            fields.push(format!("{name} = {}", quote(&r.path)));
            time_only.push(quote(&name));
        } else if field || (scalar && r.shape.is_empty()) {
            let name = unique(&r.path);
            fields.push(format!("{name} = {}", quote(&r.path)));
            constant.push(quote(&name));
        }
    }
    let _ = writeln!(
        out,
        "\nsuggested config (The Well's layout: {items} trajectories of {time} steps; WellDataset(n_steps_input={n_in}, \
         n_steps_output=1)):\n"
    );
    let _ = writeln!(out, "[datasets.{stem}]");
    let _ = writeln!(out, "format = \"hdf5\"");
    // `files` comes quoted, with the comment on the files it leaves out.
    let _ = writeln!(out, "files = {files}");
    let _ = writeln!(out, "fields = {{ {} }}", fields.join(", "));
    let _ = writeln!(
        out,
        "# windows of n_steps_input + n_steps_output steps; add dt_stride = k, or min_dt_stride/max_dt_stride"
    );
    let _ = writeln!(out, "window = {{ n_steps_input = {n_in}, n_steps_output = 1 }}");
    let _ = writeln!(out, "input = [{}]", input.join(", "));
    let _ = writeln!(out, "output = [{}]", output.join(", "));
    if !per_item.is_empty() {
        let _ = writeln!(out, "# per trajectory, no time axis (sample_varying = True, time_varying = False)");
        let _ = writeln!(out, "per_item = [{}]", per_item.join(", "));
    }
    if !constant.is_empty() {
        let _ = writeln!(out, "# no trajectory axis (sample_varying = False): the whole dataset with every sample");
        let _ = writeln!(out, "constant = [{}]", constant.join(", "));
    }
    if !time_only.is_empty() {
        let _ = writeln!(out, "# time steps without a trajectory axis: each window's steps of them");
        let _ = writeln!(out, "time_only = [{}]", time_only.join(", "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("data.mdb"), b"").unwrap();
        path
    }

    #[test]
    fn lr_and_hr_environments_find_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let hr = env(dir.path(), "DIV2K_train_HR_sub.lmdb");
        let x4 = env(dir.path(), "DIV2K_train_LR_bicubic_X4_sub.lmdb");
        let x2 = env(dir.path(), "DIV2K_train_LR_bicubic_X2_sub.lmdb");
        env(dir.path(), "DIV2K_valid_LR_bicubic_X4_sub.lmdb");
        env(dir.path(), "labels.lmdb");
        assert_eq!(partners(&hr), [x2.clone(), x4.clone()]);
        assert_eq!(partners(&x4), std::slice::from_ref(&hr));
        assert!(partners(&dir.path().join("labels.lmdb")).is_empty());
    }

    fn report(shapes: &[(&str, &[u64])]) -> LmdbReport {
        let scan = crate::source::lmdb::EnvScan {
            probed_shapes: shapes.iter().map(|(k, s)| (k.as_bytes().to_vec(), s.to_vec())).collect(),
            ..Default::default()
        };
        LmdbReport { env: PathBuf::from("/e"), scan, found_beside: false }
    }

    #[test]
    fn pairing_needs_one_integer_scale_for_every_shared_key() {
        let lr = report(&[("a", &[6, 7, 3]), ("b", &[8, 9, 3])]);
        let hr = report(&[("a", &[24, 28, 3]), ("b", &[32, 36, 3])]);
        assert_eq!(pairing(&[hr.clone(), lr.clone()]), Some(Pairing { lr: 1, hr: 0, scale: 4 }));
        let mixed = report(&[("a", &[24, 28, 3]), ("b", &[16, 18, 3])]);
        assert_eq!(pairing(&[lr.clone(), mixed]), None, "4× for one key, 2× for another");
        let gray = report(&[("a", &[24, 28, 1]), ("b", &[32, 36, 1])]);
        assert_eq!(pairing(&[lr.clone(), gray]), None, "channels differ");
        let same = report(&[("a", &[6, 7, 3])]);
        assert_eq!(pairing(&[lr, same]), None, "same size is no pair");
    }

    fn dataset(path: &str, shape: &[u64]) -> DatasetReport {
        DatasetReport {
            path: path.into(),
            shape: shape.to_vec(),
            dtype: "float32".into(),
            servable: true,
            byte_order: "little".into(),
            layout: "contiguous".into(),
            chunks: None,
            filters: Vec::new(),
            read_path: "fast path".into(),
        }
    }

    #[test]
    fn the_well_suggests_a_window_and_its_constants_per_item() {
        let reports = [
            dataset("dimensions/time", &[20]),
            dataset("dimensions/x", &[4]),
            dataset("boundary_conditions/x/mask", &[4]),
            dataset("t0_fields/density", &[4, 20, 16, 16]),
            dataset("t0_fields/mask", &[4, 16, 16]),
            dataset("t1_fields/velocity", &[4, 20, 16, 16, 2]),
        ];
        let out = format_report(Path::new("/data/well/train/a.hdf5"), &reports);
        let table = out.split_once("suggested config").unwrap().1.split_once('\n').unwrap().1;
        let parsed: toml::Table = toml::from_str(table).unwrap();
        let ds = &parsed["datasets"]["a"];
        assert_eq!(ds["files"].as_str(), Some("/data/well/train/*.hdf5"));
        // density and velocity twice (input and output), mask, and dimensions/time.
        assert_eq!(ds["fields"].as_table().unwrap().len(), 6, "{table}");
        assert_eq!(ds["per_item"].as_array().unwrap(), &[toml::Value::from("mask")]);
        assert_eq!(ds["window"]["n_steps_input"].as_integer(), Some(4));
    }

    #[test]
    fn the_well_suggests_the_split_constants_and_time_only_fields() {
        let mut scalar = dataset("scalars/Reynolds", &[]);
        (scalar.servable, scalar.read_path) = (false, "scalar: no axis to index samples by".into());
        let reports = [
            dataset("boundary_conditions/x/mask", &[16]),
            dataset("dimensions/time", &[20]),
            dataset("dimensions/x", &[16]),
            scalar,
            dataset("scalars/time_varying_scalar", &[20]),
            dataset("t0_fields/constant_field", &[4, 16, 16]),
            dataset("t0_fields/density", &[4, 20, 16, 16]),
            dataset("t0_fields/mask", &[16, 16]),
            dataset("t1_fields/velocity", &[4, 20, 16, 16, 2]),
        ];
        let out = format_report(Path::new("/data/well/train/a.hdf5"), &reports);
        let table = out.split_once("suggested config").unwrap().1.split_once('\n').unwrap().1;
        assert!(out.contains("WellDataset(n_steps_input=4, n_steps_output=1)"), "{out}");
        let parsed: toml::Table = toml::from_str(table).unwrap();
        let ds = &parsed["datasets"]["a"];
        let list = |key: &str| -> Vec<&str> {
            ds.get(key).map_or(vec![], |v| v.as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect())
        };
        assert_eq!(ds["window"]["n_steps_input"].as_integer(), Some(4), "{table}");
        assert_eq!(ds["window"]["n_steps_output"].as_integer(), Some(1), "{table}");
        assert_eq!(list("input"), ["density_in", "velocity_in"], "{table}");
        assert_eq!(list("output"), ["density_out", "velocity_out"], "{table}");
        assert_eq!(list("per_item"), ["constant_field"], "{table}");
        assert_eq!(list("constant"), ["Reynolds", "mask"], "{table}");
        assert_eq!(list("time_only"), ["time", "time_varying_scalar"], "{table}");
        let fields = ds["fields"].as_table().unwrap();
        assert_eq!(fields["velocity_out"].as_str(), Some("t1_fields/velocity"));
        assert_eq!(fields["time"].as_str(), Some("dimensions/time"));
        assert!(
            !fields.contains_key("x") && !fields.contains_key("mask_2"),
            "coordinates and BC masks left out: {table}"
        );
        // The suggestion is a valid dataset table.
        let mut ds = ds.as_table().unwrap().clone();
        assert_eq!(ds.remove("format").and_then(|f| f.as_str().map(String::from)).as_deref(), Some("hdf5"));
        let config: stoker_proto::Hdf5Dataset = ds.try_into().unwrap_or_else(|e| panic!("{e}: {table}"));
        assert_eq!(config.time_only.len(), 2);
    }

    #[test]
    fn images_and_labels_get_no_window() {
        let reports = [dataset("images", &[100, 32, 32]), dataset("labels", &[100])];
        let out = format_report(Path::new("/d/[x]/a.h5"), &reports);
        let table = out.split_once("suggested config").unwrap().1.split_once('\n').unwrap().1;
        let parsed: toml::Table = toml::from_str(table).unwrap();
        let ds = &parsed["datasets"]["a"];
        assert!(ds.get("window").is_none(), "{table}");
        assert_eq!(ds["files"].as_str(), Some("/d/[[]x[]]/a.h5"), "glob characters in the directory are escaped");
    }

    #[test]
    fn the_suggested_glob_matches_shards_of_the_same_name_only() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["train-000.h5", "train-001.h5", "val-000.h5", "test-000.h5", "notes.txt"] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        let (files, note) = sibling_glob(&dir.path().join("train-000.h5"));
        assert_eq!(files, format!("{}/train-*.h5", glob::Pattern::escape(&dir.path().display().to_string())));
        assert!(note.contains("matches 2 files") && note.contains("leaves out test-000.h5, val-000.h5"), "{note}");
        let (files, note) = sibling_glob(&dir.path().join("notes.txt"));
        assert!(files.ends_with("/notes.txt") && note.contains("matches 1 file in"), "{files} {note}");
    }
}

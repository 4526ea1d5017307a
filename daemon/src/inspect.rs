//! `stoker inspect PATH`: what is in an HDF5 file (datasets, layouts,
//! filters, and how stoker would read each: fast path or libhdf5, and why) or
//! an LMDB environment (entries, key patterns, value formats and sizes), with
//! a suggested dataset config.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use hdf5::LocationType;
use hdf5::datatype::ByteOrder;

use crate::cache::ChunkCache;
use crate::source::hdf5::classify;
use crate::source::hdf5::field::FieldReader;

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

/// Inspects every dataset of the file at `path`.
pub fn inspect(path: &Path) -> anyhow::Result<Vec<DatasetReport>> {
    let file = hdf5::File::open(path).map_err(|e| anyhow::anyhow!("cannot open {} as HDF5: {e}", path.display()))?;
    let cache = ChunkCache::new(0);
    let mut out = Vec::new();
    visit(&file, "", &cache, &mut out)?;
    Ok(out)
}

fn visit(group: &hdf5::Group, prefix: &str, cache: &ChunkCache, out: &mut Vec<DatasetReport>) -> anyhow::Result<()> {
    let mut names = group.member_names()?;
    names.sort();
    for name in names {
        let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}/{name}") };
        match group.loc_type_by_name(&name) {
            Ok(LocationType::Group) => visit(&group.group(&name)?, &path, cache, out)?,
            Ok(LocationType::Dataset) => out.push(report(group.dataset(&name)?, path, cache)),
            _ => {}
        }
    }
    Ok(())
}

fn report(dataset: hdf5::Dataset, path: String, cache: &ChunkCache) -> DatasetReport {
    let shape: Vec<u64> = dataset.shape().iter().map(|&d| d as u64).collect();
    let layout = format!("{:?}", dataset.layout()).to_lowercase();
    let chunks = dataset.chunk().map(|c| c.iter().map(|&d| d as u64).collect());
    let filters = dataset.filters().iter().map(|f| format!("{f:?}")).collect();
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
        Ok((dtype, descriptor)) if !shape.is_empty() => {
            let read_path = match hdf5::Datatype::from_descriptor(&descriptor)
                .map_err(|e| e.to_string())
                .and_then(|mem| FieldReader::new(dataset, dtype, &file_type, mem, cache.new_id(), true))
            {
                Ok(reader) => reader.layout.describe(),
                Err(e) => format!("cannot read: {e}"),
            };
            (dtype.to_string(), true, read_path)
        }
        Ok((dtype, _)) => (dtype.to_string(), false, "scalar: no axis to index samples by".to_string()),
        Err(found) => (found, false, "not servable: stoker serves numeric datasets".to_string()),
    };
    DatasetReport { path, shape, dtype, servable, byte_order, layout, chunks, filters, read_path }
}

/// Whether `path` is an LMDB environment (a directory holding `data.mdb`, or an `.mdb`/`.lmdb` file).
pub fn is_lmdb(path: &Path) -> bool {
    path.join("data.mdb").is_file() || (path.is_file() && path.extension().is_some_and(|e| e == "mdb" || e == "lmdb"))
}

/// Scans an LMDB environment (the first `probe` sample values are decoded far enough to learn their shape).
pub fn inspect_lmdb(path: &Path, probe: usize) -> anyhow::Result<crate::source::lmdb::EnvScan> {
    Ok(crate::source::lmdb::scan(path, probe)?)
}

/// The human-readable LMDB report, with a suggested `[datasets.NAME]` table.
pub fn format_lmdb_report(path: &Path, scan: &crate::source::lmdb::EnvScan) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{} (LMDB)", path.display());
    let _ = writeln!(out, "  entries        {}", scan.entries);
    if !scan.metadata_keys.is_empty() {
        let _ = writeln!(out, "  metadata keys  {} (skipped by default)", scan.metadata_keys.join(", "));
    }
    let list = |v: &[(String, u64)]| v.iter().map(|(k, n)| format!("{k} ×{n}")).collect::<Vec<_>>().join(", ");
    let _ = writeln!(out, "  key patterns   {}", list(&scan.key_patterns));
    let _ = writeln!(out, "  keys           {}", scan.first_keys.join(", "));
    let _ = writeln!(out, "  formats        {} (first {} values)", list(&scan.formats), scan.probed);
    let _ = writeln!(out, "  decoded        {}", list(&scan.shapes));
    let codec = scan.formats.first().map_or("raw", |(f, _)| f.as_str());
    let stem =
        path.file_stem().map_or("data".into(), |s| s.to_string_lossy().replace(|c: char| !c.is_alphanumeric(), "_"));
    let _ = writeln!(out, "\nsuggested config:\n");
    let _ = writeln!(out, "[datasets.{stem}]\nformat = \"lmdb\"");
    let _ = writeln!(
        out,
        "\n[[datasets.{stem}.fields]]\nname = \"x\"\nenv = {:?}\ncodec = {codec:?}",
        path.display().to_string()
    );
    if scan.shapes.len() > 1 {
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
    out
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
    // Suggest the servable datasets sharing the most common first-axis length.
    let mut by_len: BTreeMap<u64, Vec<&DatasetReport>> = BTreeMap::new();
    for r in reports.iter().filter(|r| r.servable) {
        by_len.entry(r.shape[0]).or_default().push(r);
    }
    let Some((&len, group)) = by_len.iter().max_by_key(|(len, g)| (g.len(), **len)) else {
        let _ = writeln!(out, "\nno numeric datasets: nothing stoker can serve");
        return out;
    };
    let stem =
        file.file_stem().map_or("data".into(), |s| s.to_string_lossy().replace(|c: char| !c.is_alphanumeric(), "_"));
    let dir = file.parent().map_or(".".into(), |d| d.display().to_string());
    let mut names: Vec<String> = Vec::new();
    let mut fields = Vec::new();
    for r in group {
        let base: String =
            r.path.rsplit('/').next().unwrap_or(&r.path).replace(|c: char| !c.is_alphanumeric() && c != '_', "_");
        let mut name = base.clone();
        let mut n = 2;
        while names.contains(&name) {
            name = format!("{base}_{n}");
            n += 1;
        }
        fields.push(format!("{name} = {:?}", r.path));
        names.push(name);
    }
    let _ = writeln!(out, "\nsuggested config ({} datasets with {len} items along axis 0):\n", group.len());
    let _ = writeln!(out, "[datasets.{stem}]");
    let _ = writeln!(out, "format = \"hdf5\"");
    let _ = writeln!(out, "files = \"{dir}/*.h5\"");
    let _ = writeln!(out, "fields = {{ {} }}", fields.join(", "));
    if group.iter().any(|r| r.shape.len() >= 3) {
        let _ = writeln!(
            out,
            "# time series ([item, time, ...]): samples can be windows along axis 1, e.g.\n\
             # window = {{ size = 4, stride = 1 }}\n# per_item = [\"...\"]   # fields without a time axis"
        );
    }
    out
}

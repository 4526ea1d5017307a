//! `stoker validate --files`: every named dataset opened as the daemon would
//! open it for a client (files by handle, read-only; LMDB environments mapped
//! without the lock file), through the same source opens and transform
//! checks as [`super::Datasets`], serving nothing.

use std::path::Path;
use std::sync::Arc;

use stoker_data::fsaccess::{self, Want};
use stoker_data::source::SourceError;
use stoker_data::source::hdf5::{self, Hdf5Source, Hdf5Spec, OpenFiles};
use stoker_data::source::lmdb::LmdbSource;
use stoker_proto::{Hdf5Dataset, LmdbDataset};

use crate::config::{Config, DatasetConfig, Problem};

/// Opens every named dataset of `config` as the daemon would when a client asks for
/// it (its files by handle, read-only; LMDB environments mapped without
/// the lock file), serving nothing: globs that match no file, files or
/// environments that do not open, missing fields and keys become
/// problems, one per dataset, plus one per LMDB environment or key file
/// that is missing. Used by `stoker validate`; the daemon opens datasets
/// on demand.
pub fn check_files(config: &Config) -> Vec<Problem> {
    check_files_summarised(config).0
}

/// [`check_files`], with a line per dataset that opened: its files and samples.
pub fn check_files_summarised(config: &Config) -> (Vec<Problem>, Vec<(String, String)>) {
    let mut problems = Vec::new();
    let mut summaries = Vec::new();
    for (name, ds) in &config.datasets {
        let mut summary = None;
        let problem = match ds {
            DatasetConfig::Hdf5(ds) => check_hdf5(config, ds, &mut summary),
            DatasetConfig::Lmdb(ds) => {
                let missing = check_lmdb_paths(ds);
                if missing.is_empty() {
                    check_lmdb(config, ds, &mut summary)
                } else {
                    for (at, message) in missing {
                        let at: Vec<&str> =
                            ["datasets", name].into_iter().chain(at.iter().map(String::as_str)).collect();
                        problems.push(Problem::new(&at, format!("[datasets.{name}] {message}")));
                    }
                    None
                }
            }
        };
        if let Some((at, message)) = problem {
            let at: Vec<&str> = ["datasets", name].into_iter().chain(at.iter().map(String::as_str)).collect();
            problems.push(Problem::new(&at, format!("[datasets.{name}] {message}")));
        } else if let Some(summary) = summary {
            summaries.push((name.clone(), summary));
        }
    }
    (problems, summaries)
}

/// Opens an HDF5 dataset's files and fields; the problem and the key it is about.
fn check_hdf5(config: &Config, ds: &Hdf5Dataset, summary: &mut Option<String>) -> Option<(Vec<String>, String)> {
    let mut spec = Hdf5Spec::from_dataset(ds, config.hdf5.fast_path);
    spec.max_chunk_bytes = config.limits.max_sample_bytes;
    let mut chains = match stoker_data::source::transformed::field_chains(&ds.field_transforms()) {
        Ok(chains) => chains,
        Err(e) => return Some((vec!["transforms".to_string()], e.to_string())),
    };
    let opened = hdf5::check_files(&spec, None).and_then(|files| {
        let cache = stoker_data::cache::CacheCtx::disabled();
        let limit = OpenFiles::new(config.limits.max_open_files);
        let n_files = files.len();
        let source =
            Hdf5Source::open(&spec, files, cache, limit, Arc::new(hdf5::LocalOpener), fsaccess::Rights::Daemon)?;
        *summary = Some(format!(
            "hdf5, {n_files} file{}, {} samples ({})",
            if n_files == 1 { "" } else { "s" },
            stoker_data::source::Source::len(&source),
            spec.files
        ));
        if chains.is_empty() {
            return Ok(());
        }
        super::load_stats(chains.iter_mut().flat_map(|c| c.steps.iter_mut()), None)?;
        let source: std::sync::Arc<dyn stoker_data::source::Source> = std::sync::Arc::new(source);
        stoker_data::source::transformed::Transformed::new(source, &chains, &spec.files, config.limits.max_sample_bytes)
            .map(drop)
    });
    let e = opened.err()?;
    let at = match &e {
        SourceError::MissingField { field, .. }
        | SourceError::Dtype { field, .. }
        | SourceError::Inconsistent { field, .. } => vec!["fields".to_string(), field.clone()],
        SourceError::Spec { .. } => Vec::new(),
        _ => vec!["files".to_string()],
    };
    Some((at, e.to_string()))
}

/// Opens an LMDB dataset (environments, keys, probed values); the problem and the key it is about.
fn check_lmdb(config: &Config, ds: &LmdbDataset, summary: &mut Option<String>) -> Option<(Vec<String>, String)> {
    let mut spec = match super::lmdb_spec(ds, None) {
        Ok(spec) => spec,
        Err(e) => return Some((Vec::new(), e.message)),
    };
    spec.max_value_bytes = config.limits.max_sample_bytes;
    if let Err(e) = super::load_stats(spec.fields.iter_mut().flat_map(|f| f.transforms.iter_mut()), None) {
        return Some((Vec::new(), e.to_string()));
    }
    let e = match LmdbSource::open(&spec) {
        Ok(source) => {
            let envs: std::collections::BTreeSet<&str> = ds.fields.iter().map(|f| f.env.as_str()).collect();
            *summary = Some(format!(
                "lmdb, {} environment{}, {} samples",
                envs.len(),
                if envs.len() == 1 { "" } else { "s" },
                stoker_data::source::Source::len(&source)
            ));
            return None;
        }
        Err(e) => e,
    };
    let field_at = |i: usize| vec!["fields".to_string(), i.to_string()];
    let at = match &e {
        SourceError::LmdbKeyFile { .. } => vec!["key_file".to_string()],
        SourceError::LmdbField { field, .. } => {
            ds.fields.iter().position(|f| &f.name == field).map_or_else(Vec::new, field_at)
        }
        SourceError::LmdbOpen { env, .. } | SourceError::LmdbEmpty { env, .. } => {
            match ds.fields.iter().position(|f| Path::new(&f.env) == env) {
                Some(i) => [field_at(i), vec!["env".to_string()]].concat(),
                None => Vec::new(),
            }
        }
        _ => Vec::new(),
    };
    Some((at, e.to_string()))
}

/// Every environment and key file of an LMDB dataset that cannot be opened
/// (missing, unreadable, a directory without `data.mdb`), with the key naming it.
fn check_lmdb_paths(ds: &stoker_proto::LmdbDataset) -> Vec<(Vec<String>, String)> {
    let mut missing = Vec::new();
    for (i, f) in ds.fields.iter().enumerate() {
        let opened = fsaccess::open(Path::new(&f.env), None, Want::FileOrDir)
            .and_then(|env| if env.is_dir { fsaccess::open_in(&env, "data.mdb").map(drop) } else { Ok(()) });
        if let Err(e) = opened {
            missing.push((
                vec!["fields".to_string(), i.to_string(), "env".to_string()],
                format!("field {:?}: LMDB environment: {e}", f.name),
            ));
        }
    }
    if let Some(path) = &ds.key_file
        && let Err(e) = fsaccess::open(Path::new(path), None, Want::File)
    {
        missing.push((vec!["key_file".to_string()], format!("key_file: {e}")));
    }
    missing
}

//! `stoker inspect FILE...`: prints the reports `stoker_data::inspect` makes
//! of HDF5 files (each on its own) or LMDB environments (together, as one
//! dataset), as text or JSON.

use std::path::PathBuf;
use std::process::ExitCode;

use stoker_data::inspect;

/// `stoker inspect FILE... [--probe N] [--json]`: LMDB environments when
/// every file is one, else HDF5 files (a mix is refused).
pub(super) fn run(files: &[PathBuf], probe: usize, json: bool) -> anyhow::Result<ExitCode> {
    if files.iter().all(|f| inspect::is_lmdb(f)) { lmdb(files, probe, json) } else { hdf5(files, json) }
}

/// LMDB environments that make one dataset together.
fn lmdb(files: &[PathBuf], probe: usize, json: bool) -> anyhow::Result<ExitCode> {
    let envs = inspect::inspect_lmdb(files, probe)?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&envs)?);
    } else {
        out!("{}", inspect::format_lmdb_report(&envs));
    }
    Ok(ExitCode::SUCCESS)
}

/// HDF5 files, each described on its own (JSON: one file's report as is,
/// several as a list of `{file, datasets}`).
fn hdf5(files: &[PathBuf], json: bool) -> anyhow::Result<ExitCode> {
    if let Some(env) = files.iter().find(|f| inspect::is_lmdb(f)) {
        anyhow::bail!(
            "{} is an LMDB environment and the others are not: inspect HDF5 files and LMDB environments \
             separately",
            env.display()
        );
    }
    let mut all = Vec::with_capacity(files.len());
    for f in files {
        all.push((f, inspect::inspect(f)?));
    }
    if json {
        match all.as_slice() {
            [(_, reports)] => outln!("{}", serde_json::to_string_pretty(reports)?),
            _ => {
                let by_file: Vec<_> = all
                    .iter()
                    .map(|(f, r)| serde_json::json!({ "file": f.display().to_string(), "datasets": r }))
                    .collect();
                outln!("{}", serde_json::to_string_pretty(&by_file)?);
            }
        }
    } else {
        for (i, (f, reports)) in all.iter().enumerate() {
            if i > 0 {
                outln!();
            }
            out!("{}", inspect::format_report(f, reports));
        }
    }
    Ok(ExitCode::SUCCESS)
}

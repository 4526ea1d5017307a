//! `stoker datasets`: the datasets named in the running daemon's config, one
//! line each, or as JSON.

use std::process::ExitCode;

use super::connect::Target;

/// `stoker datasets [--json]`.
pub(super) fn run(target: &Target, json: bool) -> anyhow::Result<ExitCode> {
    let list = target.connect()?.datasets()?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&list)?);
    } else if list.is_empty() {
        outln!("no named datasets (add [datasets.NAME] tables to the daemon's config)");
    } else {
        for ds in list {
            let fields: Vec<String> = ds.fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
            outln!("{:<20} {:<6} {}  {}", ds.name, ds.format, ds.files, fields.join(" "));
        }
    }
    Ok(ExitCode::SUCCESS)
}

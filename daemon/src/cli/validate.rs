//! `stoker validate FILE`: prints what the daemon would run with, or every
//! problem in the config (and its datasets' files) with its line; the checks
//! themselves are `Config::check` and `dataset::check`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;

use crate::config::Config;

/// `stoker validate FILE`: parses the config (a TOML error stops there: it
/// has one line), then reports every problem in its values and (unless
/// `open_files` is false) in the named datasets' files, each with its line,
/// and exits 1 when there are any.
pub(super) fn run(file: &Path, open_files: bool) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(file).with_context(|| format!("cannot read config {}", file.display()))?;
    let config = match Config::parse(&text, file) {
        Ok(config) => config,
        Err(e) => {
            // Every problem of every table, not just the first one serde met.
            let found = parse_problems(&text);
            if found.is_empty() {
                return Err(e.into());
            }
            report(file, found.iter().map(|(line, message)| (*line, message.as_str())).collect());
            return Ok(ExitCode::FAILURE);
        }
    };
    let (files, summaries) =
        if open_files { crate::dataset::check::check_files_summarised(&config) } else { (Vec::new(), Vec::new()) };
    let (settings, mut problems) = match config.check() {
        Ok(settings) => (Some(settings), Vec::new()),
        Err(problems) => (None, problems),
    };
    // A dataset whose values are wrong is reported for those, not again for its files.
    let named =
        |p: &crate::config::Problem| p.at.first().is_some_and(|t| t == "datasets").then(|| p.at.get(1).cloned());
    let wrong: Vec<_> = problems.iter().filter_map(named).collect();
    problems.extend(files.into_iter().filter(|f| !named(f).is_some_and(|name| wrong.contains(&name))));
    if !problems.is_empty() {
        report(file, problems.iter().map(|p| (p.line(&text), p.message.as_str())).collect());
        return Ok(ExitCode::FAILURE);
    }
    let Some(settings) = settings else { return Ok(ExitCode::FAILURE) };
    outln!("{} is valid", file.display());
    outln!("  socket          {}", settings.socket.display());
    outln!("  worker threads  {}", settings.worker_threads);
    outln!("  ring depth      {}", settings.ring_depth);
    outln!("  allowed roots   {:?}", settings.allowed_roots);
    outln!("  memory budget   {} bytes ({})", settings.limits.max_memory_bytes, settings.memory_source);
    outln!(
        "  caches          chunks {} bytes, samples {} bytes",
        settings.chunk_cache_bytes,
        settings.sample_cache_bytes
    );
    outln!("  datasets        {:?}", settings.datasets.keys().collect::<Vec<_>>());
    for (name, summary) in &summaries {
        outln!("    {name}: {summary}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints `problems` of `file` to stderr, one per line with its line number,
/// in the file's order (problems without a line, defaults, last).
fn report(file: &Path, mut problems: Vec<(Option<usize>, &str)>) {
    problems.sort_by_key(|(line, _)| line.unwrap_or(usize::MAX));
    let n = problems.len();
    eprintln!("{}: {n} {}", file.display(), if n == 1 { "error" } else { "errors" });
    for (line, message) in problems {
        match line {
            Some(line) => eprintln!("  {}:{line}: {message}", file.display()),
            None => eprintln!("  {}: {message}", file.display()),
        }
    }
}

/// Every problem of a config that does not deserialize, each with its line
/// where it can be found: a syntax error stops there (one line); otherwise
/// each section and each `[datasets.NAME]` table is read on its own, so one
/// bad table does not hide the next, and a key that is not known is named
/// with the known key it is closest to.
fn parse_problems(text: &str) -> Vec<(Option<usize>, String)> {
    use crate::config::{
        CacheConfig, DatasetConfig, Hdf5Config, LimitsConfig, MetricsConfig, RingConfig, ServerConfig, WorkersConfig,
    };
    use serde::de::DeserializeOwned;
    let table: toml::Table = match toml::from_str(text) {
        Ok(t) => t,
        Err(e) => return vec![(e.span().map(|s| line_of(text, s.start)), e.message().to_string())],
    };
    fn check<T: DeserializeOwned>(value: &toml::Value) -> Result<(), toml::de::Error> {
        T::deserialize(value.clone()).map(drop)
    }
    let header = |name: &str| {
        let want = format!("[{name}]");
        text.lines().position(|l| l.trim() == want).map(|i| i + 1)
    };
    let mut problems = Vec::new();
    for (section, value) in &table {
        let result = match section.as_str() {
            "server" => check::<ServerConfig>(value),
            "workers" => check::<WorkersConfig>(value),
            "ring" => check::<RingConfig>(value),
            "limits" => check::<LimitsConfig>(value),
            "cache" => check::<CacheConfig>(value),
            "hdf5" => check::<Hdf5Config>(value),
            "metrics" => check::<MetricsConfig>(value),
            "datasets" => {
                for (name, ds) in value.as_table().into_iter().flatten() {
                    if let Err(e) = check::<DatasetConfig>(ds) {
                        let message = e.message().to_string();
                        let known: Vec<String> = ds.as_table().map(|t| t.keys().cloned().collect()).unwrap_or_default();
                        let message = explain(&message, &known);
                        let start = header(&format!("datasets.{name}"));
                        let line = key_line(text, &message).or_else(|| variant_line(text, &message, start)).or(start);
                        problems.push((line, format!("[datasets.{name}] {message}")));
                    }
                }
                Ok(())
            }
            other => {
                let message = format!(
                    "unknown section [{other}] (the sections are server, workers, ring, limits, cache, hdf5, \
                     metrics, datasets)"
                );
                problems.push((header(other), message));
                Ok(())
            }
        };
        if let Err(e) = result {
            let message = e.message().to_string();
            let known: Vec<String> = value.as_table().map(|t| t.keys().cloned().collect()).unwrap_or_default();
            let message = explain(&message, &known);
            problems.push((key_line(text, &message).or_else(|| header(section)), format!("[{section}] {message}")));
        }
    }
    problems
}

/// The first line from `start` on naming the unknown variant (a misspelt
/// transform step) a message names.
fn variant_line(text: &str, message: &str, start: Option<usize>) -> Option<usize> {
    let name = message.split("unknown variant `").nth(1)?.split('`').next()?;
    let from = start.unwrap_or(1);
    text.lines().enumerate().skip(from.saturating_sub(1)).find(|(_, l)| l.contains(name)).map(|(i, _)| i + 1)
}

/// The 1-based line of byte `at` of `text`.
fn line_of(text: &str, at: usize) -> usize {
    text[..at.min(text.len())].bytes().filter(|&b| b == b'\n').count() + 1
}

/// The line of the key an "unknown field `x`" message names.
fn key_line(text: &str, message: &str) -> Option<usize> {
    let key = message.split("unknown field `").nth(1)?.split('`').next()?;
    text.lines()
        .position(|l| l.trim_start().strip_prefix(key).is_some_and(|r| r.trim_start().starts_with('=')))
        .map(|i| i + 1)
}

/// serde's message, with a "did you mean" for a misspelt key: an unknown key
/// close to a known one, or a missing required key (`format`) close to a
/// key the table has.
fn explain(message: &str, keys: &[String]) -> String {
    let quoted = |s: &str| s.split('`').skip(1).step_by(2).map(str::to_string).collect::<Vec<_>>();
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let unknown = rest.split('`').next().unwrap_or_default();
        let expected = quoted(rest.split_once(", expected").map_or("", |(_, e)| e));
        if let Some(best) = closest(unknown, &expected) {
            return format!("{message}; did you mean `{best}`?");
        }
    }
    if let Some(rest) = message.strip_prefix("missing field `") {
        let missing = rest.split('`').next().unwrap_or_default();
        if let Some(typo) = closest(missing, keys) {
            return format!("{message}; the table has `{typo}`: did you mean `{missing}`?");
        }
    }
    message.to_string()
}

/// The candidate within edit distance 2 of `word` (the nearest), if any.
fn closest(word: &str, candidates: &[String]) -> Option<String> {
    candidates
        .iter()
        .filter(|c| c.as_str() != word)
        .map(|c| (edit_distance(word, c), c))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c.clone())
}

/// Levenshtein distance, for short keys.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bad_table_is_reported_with_a_did_you_mean() {
        let text = "[ring]\ndepht = 4\n\n[datasets.a]\nformt = \"hdf5\"\nfiles = \"/x\"\n\n[datasets.b]\nformat = \"hdf5\"\nfiles = \"/y\"\nfields = { x = \"x\" }\ntransforms.x = [{ random_crap = 4 }]\n";
        let problems = parse_problems(text);
        assert_eq!(problems.len(), 3, "{problems:?}");
        let text_of = |needle: &str| problems.iter().find(|(_, m)| m.contains(needle)).cloned();
        let (line, m) = text_of("depht").unwrap();
        assert_eq!(line, Some(2));
        assert!(m.contains("did you mean `depth`"), "{m}");
        let (line, m) = text_of("formt").unwrap();
        assert_eq!(line, Some(4));
        assert!(m.contains("did you mean `format`"), "{m}");
        let (line, m) = text_of("random_crap").unwrap();
        assert_eq!(line, Some(12));
        assert!(m.starts_with("[datasets.b]"), "{m}");
        assert_eq!(parse_problems("[ring\n").len(), 1);
    }
}

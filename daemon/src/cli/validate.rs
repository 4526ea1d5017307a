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
    let config = Config::parse(&text, file)?;
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
        let mut lines: Vec<(Option<usize>, &str)> =
            problems.iter().map(|p| (p.line(&text), p.message.as_str())).collect();
        // In the file's order; problems without a line (defaults) last.
        lines.sort_by_key(|(line, _)| line.unwrap_or(usize::MAX));
        let n = lines.len();
        eprintln!("{}: {n} {}", file.display(), if n == 1 { "error" } else { "errors" });
        for (line, message) in lines {
            match line {
                Some(line) => eprintln!("  {}:{line}: {message}", file.display()),
                None => eprintln!("  {}: {message}", file.display()),
            }
        }
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

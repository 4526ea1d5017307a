//! How `stoker serve` logs: the `--log-level` filter (checked for typos that
//! would silence the log) and the `--log-format` subscriber written to stderr.

use anyhow::Context;

/// How `stoker serve` writes its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(in crate::cli) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, fields under `fields`.
    Json,
}

/// Installs the log subscriber: `filter` (else `$STOKER_LOG`, else
/// `$RUST_LOG`, else `info`) in `RUST_LOG` syntax, written to stderr as text
/// or JSON. Under systemd (`$JOURNAL_STREAM` or `$INVOCATION_ID` set) text
/// lines carry neither timestamps nor colours: the journal stamps each line itself.
pub(super) fn init_logging(filter: Option<String>, format: LogFormat) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let directives = filter
        .or_else(|| std::env::var("STOKER_LOG").ok())
        .or_else(|| std::env::var("RUST_LOG").ok())
        .filter(|d| !d.trim().is_empty())
        .unwrap_or_else(|| "info".into());
    let filter = parse_log_filter(&directives)?;
    let journald = std::env::var_os("JOURNAL_STREAM").is_some() || std::env::var_os("INVOCATION_ID").is_some();
    let log = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Json => log.json().init(),
        LogFormat::Text if journald => log.without_time().with_ansi(false).init(),
        LogFormat::Text => log.with_ansi(std::io::stderr().is_terminal()).init(),
    }
    Ok(())
}

/// A `RUST_LOG`-style filter. A bare word is a level, or a target of ours
/// (`stoker_daemon`): anything else is a typo that would silence the log.
fn parse_log_filter(directives: &str) -> anyhow::Result<tracing_subscriber::EnvFilter> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let hint = "give a level (error, warn, info, debug, trace) or directives such as \
                `info,stoker_daemon::server=debug`";
    for d in directives.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let bare = !d.contains(['=', '[', ':']);
        if bare && !LEVELS.contains(&d.to_ascii_lowercase().as_str()) && !d.starts_with("stoker") {
            anyhow::bail!("invalid log filter {directives:?}: {d:?} is not a level; {hint}");
        }
    }
    tracing_subscriber::EnvFilter::builder()
        .parse(directives)
        .with_context(|| format!("invalid log filter {directives:?}; {hint}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_filters_take_levels_and_directives_and_refuse_typos() {
        for ok in ["info", "WARN", "warn,stoker_daemon::server=debug", "stoker_daemon=trace", "off"] {
            assert!(parse_log_filter(ok).is_ok(), "{ok}");
        }
        for bad in ["infoo", "verbose", "info,stoker_daemon=loud"] {
            let err = format!("{:#}", parse_log_filter(bad).unwrap_err());
            assert!(err.contains("invalid log filter") && err.contains(bad), "{err}");
        }
    }
}

//! Text formatting the human-readable reports share: aligned tables, byte
//! and duration units, and names shortened to fit a column; and writing to
//! stdout ([`stdout`], behind the `out!`/`outln!` macros).

/// Writes `args` (and a newline) to stdout. A reader that has gone (a closed
/// pipe: `stoker status | head -1`) ends the program at once with status 0,
/// as a Unix tool dying of SIGPIPE would, minus the noise; any other write
/// error ends it with status 1 and a line on stderr.
pub(crate) fn stdout(args: std::fmt::Arguments<'_>, newline: bool) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = out.write_fmt(args).and_then(|()| if newline { out.write_all(b"\n") } else { Ok(()) });
    if let Err(e) = written.and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("stoker: cannot write to stdout: {e}");
        std::process::exit(1);
    }
}

/// Writes an indented table: each column as wide as its widest cell; a header
/// starting with `<` marks a left-aligned column (numbers align right). Nothing
/// when there are no rows.
pub(super) fn table(out: &mut String, headers: &[&str], rows: impl Iterator<Item = Vec<String>>) {
    let rows: Vec<Vec<String>> = rows.collect();
    if rows.is_empty() {
        return;
    }
    let cols: Vec<(&str, bool)> =
        headers.iter().map(|h| h.strip_prefix('<').map_or((*h, false), |h| (h, true))).collect();
    let widths: Vec<usize> = cols
        .iter()
        .enumerate()
        .map(|(i, (h, _))| {
            rows.iter().filter_map(|r| r.get(i)).map(|c| c.chars().count()).chain([h.len()]).max().unwrap_or(0)
        })
        .collect();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for ((cell, (_, left)), width) in cells.zip(&cols).zip(&widths) {
            let pad = " ".repeat(width.saturating_sub(cell.chars().count()));
            text.push_str("  ");
            if *left {
                text.push_str(cell);
                text.push_str(&pad);
            } else {
                text.push_str(&pad);
                text.push_str(cell);
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut cols.iter().map(|(h, _)| *h));
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
}

/// Bytes in decimal units (`1.2 MB`).
pub(super) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}

/// `text` cut to its last `width - 1` characters behind an ellipsis when longer than `width`.
pub(super) fn shorten(text: &str, width: usize) -> String {
    let chars = text.chars().count();
    if chars <= width {
        return text.to_string();
    }
    let tail: String = text.chars().skip(chars - (width - 1)).collect();
    format!("…{tail}")
}

/// Seconds as `12.3s`, `4m05s` or `2h07m`.
pub(super) fn human_duration(secs: f64) -> String {
    let s = secs as u64;
    match s {
        0..60 => format!("{secs:.1}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_shown_in_decimal_units() {
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1_234_567), "1.2 MB");
    }

    #[test]
    fn shorten_cuts_at_characters_not_bytes() {
        assert_eq!(shorten("short", 24), "short");
        let long = "/données/températures/été/ß/日本語のデータ/ファイル.h5";
        let cut = shorten(long, 24);
        assert_eq!(cut.chars().count(), 24);
        assert!(cut.starts_with('…') && long.ends_with(&cut['…'.len_utf8()..]), "{cut}");
    }
}

//! Matching a dataset's glob, bounded: a user's pattern walks the file system
//! with the daemon's threads, so the walk starts below the literal prefix
//! (checked against `allowed_roots` before anything is listed), never follows
//! a symlink into a directory under `**` (two self-links made it loop
//! forever), and stops at bounds on depth, entries, matches and time, or
//! when the client that asked has left ([`crate::cancel`]).

use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use glob::Pattern;

/// Deepest directory a `**` descends into below where it starts.
const MAX_DEPTH: usize = 64;
/// Most directory entries one expansion looks at.
const MAX_ENTRIES: u64 = 2_000_000;
/// Most files one glob may match.
pub(super) const MAX_MATCHES: usize = 1_000_000;
/// Longest one expansion may take.
const DEADLINE: Duration = Duration::from_secs(60);

/// Why a glob could not be matched (the caller names the pattern).
#[derive(Debug, thiserror::Error)]
pub(super) enum GlobError {
    /// A component does not parse.
    #[error("{0}")]
    Pattern(#[from] glob::PatternError),
    /// The pattern is not an absolute path.
    #[error("the pattern must be an absolute path")]
    Relative,
    /// The client left while the walk ran.
    #[error("the client left while it was being matched")]
    Cancelled,
    /// A bound was reached.
    #[error(
        "matching it looked at more than {what} (directories under `**` are not followed through symlinks); \
         narrow the pattern"
    )]
    Bound {
        /// Which bound, in words.
        what: String,
    },
}

/// One component of a pattern.
enum Part {
    /// A name without wildcards.
    Literal(String),
    /// A component with wildcards.
    Wild(Pattern),
    /// `**`: zero or more directories.
    Any,
}

/// The literal directory a pattern starts in and the components after it.
pub(super) fn split(pattern: &str) -> Result<(PathBuf, Vec<String>), GlobError> {
    let path = Path::new(pattern);
    if !path.is_absolute() {
        return Err(GlobError::Relative);
    }
    let wild = |s: &str| s.contains(['*', '?', '[']);
    let mut base = PathBuf::new();
    let mut rest = Vec::new();
    for c in path.components() {
        let text = c.as_os_str().to_string_lossy().into_owned();
        match c {
            Component::RootDir | Component::Prefix(_) => base.push(c.as_os_str()),
            _ if rest.is_empty() && !wild(&text) => base.push(&text),
            _ => rest.push(text),
        }
    }
    Ok((base, rest))
}

/// Walk state shared by the recursion: the bounds.
struct Walk {
    entries: u64,
    started: Instant,
    found: Vec<PathBuf>,
}

impl Walk {
    fn visit(&mut self) -> Result<(), GlobError> {
        self.entries += 1;
        if self.entries > MAX_ENTRIES {
            return Err(GlobError::Bound { what: format!("{MAX_ENTRIES} directory entries") });
        }
        if self.entries.is_multiple_of(64) && crate::cancel::cancelled() {
            return Err(GlobError::Cancelled);
        }
        if self.entries.is_multiple_of(1024) && self.started.elapsed() > DEADLINE {
            return Err(GlobError::Bound { what: format!("{} s of directory listing", DEADLINE.as_secs()) });
        }
        Ok(())
    }

    fn matched(&mut self, path: PathBuf) -> Result<(), GlobError> {
        if self.found.len() >= MAX_MATCHES {
            return Err(GlobError::Bound { what: format!("{MAX_MATCHES} matching files") });
        }
        self.found.push(path);
        Ok(())
    }

    /// Matches `parts` below directory `dir`; `depth` counts `**` descents.
    fn walk(&mut self, dir: &Path, parts: &[Part], depth: usize) -> Result<(), GlobError> {
        let Some((first, rest)) = parts.split_first() else { return Ok(()) };
        match first {
            Part::Literal(name) => {
                let path = dir.join(name);
                self.visit()?;
                if rest.is_empty() {
                    if path.symlink_metadata().is_ok() {
                        self.matched(path)?;
                    }
                } else if path.is_dir() {
                    self.walk(&path, rest, depth)?;
                }
            }
            Part::Wild(pattern) => {
                for (name, path, is_dir) in self.list(dir, false)? {
                    if pattern.matches(&name) {
                        if rest.is_empty() {
                            self.matched(path)?;
                        } else if is_dir {
                            self.walk(&path, rest, depth)?;
                        }
                    }
                }
            }
            Part::Any => {
                // Zero directories here, then one more level at a time.
                self.walk(dir, rest, depth)?;
                if depth >= MAX_DEPTH {
                    return Err(GlobError::Bound { what: format!("{MAX_DEPTH} levels of `**`") });
                }
                for (_, path, is_dir) in self.list(dir, true)? {
                    if is_dir {
                        self.walk(&path, parts, depth + 1)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// `dir`'s entries (name, path, whether a directory to descend into),
    /// sorted; under `**` a symlink is never a directory to descend into.
    fn list(&mut self, dir: &Path, no_links: bool) -> Result<Vec<(String, PathBuf, bool)>, GlobError> {
        // An unreadable directory matches nothing, as with the glob crate.
        let Ok(entries) = std::fs::read_dir(dir) else { return Ok(Vec::new()) };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            self.visit()?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            let is_dir = match entry.file_type() {
                Ok(t) if t.is_symlink() => !no_links && path.is_dir(),
                Ok(t) => t.is_dir(),
                Err(_) => false,
            };
            out.push((name, path, is_dir));
        }
        out.sort();
        Ok(out)
    }
}

/// The paths matching the components `rest` below `base` (see [`split`]),
/// sorted, within the bounds.
pub(super) fn matches(base: &Path, rest: &[String]) -> Result<Vec<PathBuf>, GlobError> {
    let parts = rest
        .iter()
        .map(|c| match c.as_str() {
            "**" => Ok(Part::Any),
            c if c.contains(['*', '?', '[']) => Ok(Part::Wild(Pattern::new(c)?)),
            c => Ok(Part::Literal(c.to_string())),
        })
        .collect::<Result<Vec<_>, GlobError>>()?;
    let mut walk = Walk { entries: 0, started: Instant::now(), found: Vec::new() };
    if parts.is_empty() {
        walk.matched(base.to_owned())?;
    } else {
        walk.walk(base, &parts, 0)?;
    }
    let mut found = walk.found;
    found.sort();
    found.dedup();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"x").unwrap();
    }

    fn glob(pattern: &str) -> Result<Vec<PathBuf>, GlobError> {
        let (base, rest) = split(pattern)?;
        matches(&base, &rest)
    }

    #[test]
    fn matches_as_the_glob_crate_does_on_plain_trees() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for f in ["a/p0.h5", "a/p1.h5", "a/x.txt", "b/c/p2.h5", "[x]/q.h5", ".hidden/p3.h5"] {
            touch(&d.join(f));
        }
        for pattern in ["a/*.h5", "**/*.h5", "*/p?.h5", "a/p[01].h5", "[[]x[]]/*.h5", "a/p0.h5", "**/c/*.h5", "none/*"]
        {
            let full = format!("{}/{pattern}", d.display());
            let ours = glob(&full).unwrap();
            let theirs: Vec<PathBuf> = glob::glob(&full).unwrap().map(Result::unwrap).collect();
            assert_eq!(ours, theirs, "{pattern}");
        }
    }

    #[test]
    fn symlink_loops_under_double_star_end_and_other_bounds_hold() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        touch(&d.join("loop/x.h5"));
        std::os::unix::fs::symlink(d.join("loop"), d.join("loop/self")).unwrap();
        std::os::unix::fs::symlink(d.join("loop"), d.join("loop/again")).unwrap();
        // Two self-links: the glob crate recursed through them without end.
        let found = glob(&format!("{}/loop/**/x.h5", d.display())).unwrap();
        assert_eq!(found, [d.join("loop/x.h5")]);
        // A symlink is still a directory one explicit level deep.
        assert_eq!(glob(&format!("{}/loop/self/x.h5", d.display())).unwrap(), [d.join("loop/self/x.h5")]);
        assert!(matches!(glob("relative/*.h5"), Err(GlobError::Relative)));
        let deep = d.join((0..70).map(|i| format!("d{i}")).collect::<Vec<_>>().join("/"));
        touch(&deep.join("x.h5"));
        assert!(matches!(glob(&format!("{}/**/x.h5", d.display())), Err(GlobError::Bound { .. })));
    }
}

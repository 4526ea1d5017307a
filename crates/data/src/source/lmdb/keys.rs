//! Sample keys: filters, key files (plain or BasicSR `meta_info.txt`), how
//! keys are shown in messages, and read errors naming environment, key and field.

use std::fmt;
use std::path::Path;

use crate::source::{LmdbReadError, SourceError};

/// A read error naming the environment, key, field and codec involved.
pub(super) fn read_error(
    env: &Path,
    key: &[u8],
    field: &str,
    codec: &dyn fmt::Display,
    index: u64,
    message: String,
) -> SourceError {
    SourceError::LmdbRead(Box::new(LmdbReadError {
        env: env.to_owned(),
        key: show_key(key),
        field: field.to_string(),
        codec: codec.to_string(),
        index,
        message,
    }))
}

/// A predicate on keys.
pub(super) type KeyTest = Box<dyn Fn(&[u8]) -> bool>;

/// Whether `key` looks like metadata a dataset writer added beside the samples.
pub(super) fn is_metadata_key(key: &[u8]) -> bool {
    (key.len() > 4 && key.starts_with(b"__") && key.ends_with(b"__")) || key == b"length" || key == b"keys"
}

/// Reads a key file: one key per line, or BasicSR `meta_info.txt` lines.
pub(super) fn read_key_file(path: &Path, opened: Option<&std::fs::File>) -> Result<Keys, SourceError> {
    let err = |e: std::io::Error| SourceError::LmdbKeyFile { path: path.to_owned(), message: e.to_string() };
    // Opened here when not beforehand: a regular file only (a FIFO would block).
    let own = match opened {
        Some(_) => None,
        None => Some(
            crate::fsaccess::open(path, None, crate::fsaccess::Want::File)
                .map_err(|e| SourceError::LmdbKeyFile { path: path.to_owned(), message: e.to_string() })?
                .file,
        ),
    };
    let mut text = String::new();
    if let Some(mut file) = opened.or(own.as_ref()) {
        std::io::Read::read_to_string(&mut file, &mut text).map_err(err)?;
    }
    let mut keys = Keys::default();
    for line in text.lines() {
        let line = line.trim();
        if !line.is_empty() {
            keys.push(basicsr_key(line).unwrap_or(line).as_bytes());
        }
    }
    Ok(keys)
}

/// The key of a BasicSR `meta_info.txt` line `NAME.EXT (h,w,c) LEVEL`: NAME
/// up to its first dot, as BasicSR's `line.split('.')[0]`. `None` for other lines.
pub(super) fn basicsr_key(line: &str) -> Option<&str> {
    let (name, rest) = line.split_once(char::is_whitespace)?;
    let inside = rest.trim_start().strip_prefix('(')?.split_once(')')?.0;
    let dims_ok = inside.split(',').map(str::trim).filter(|d| !d.is_empty()).all(|d| d.parse::<u64>().is_ok());
    (dims_ok && !inside.trim().is_empty()).then(|| name.split('.').next().unwrap_or(name))
}

/// A key for messages: as text when it is UTF-8, escaped otherwise.
pub(super) fn show_key(key: &[u8]) -> String {
    match std::str::from_utf8(key) {
        Ok(text) => text.to_string(),
        Err(_) => key.escape_ascii().to_string(),
    }
}

/// Keys packed into one allocation (a million keys cost their bytes plus 8 each).
#[derive(Debug, Default)]
pub(super) struct Keys {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Keys {
    pub(super) fn push(&mut self, key: &[u8]) {
        self.bytes.extend_from_slice(key);
        self.ends.push(self.bytes.len());
    }

    pub(super) fn len(&self) -> usize {
        self.ends.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub(super) fn get(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.bytes[start..self.ends[i]]
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.len()).map(|i| self.get(i))
    }
}

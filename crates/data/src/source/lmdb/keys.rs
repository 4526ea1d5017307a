//! Sample keys: filters, key files (plain or BasicSR `meta_info.txt`), how
//! keys are shown in messages, and read errors naming environment, key and field.

use std::fmt;
use std::io::{BufRead, Read};
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
    let refuse = |message: String| SourceError::LmdbKeyFile { path: path.to_owned(), message };
    // Opened here when not beforehand: a regular file only (a FIFO would block).
    let own = match opened {
        Some(_) => None,
        None => Some(
            crate::fsaccess::open(path, None, crate::fsaccess::Want::File).map_err(|e| refuse(e.to_string()))?.file,
        ),
    };
    let Some(file) = opened.or(own.as_ref()) else { return Ok(Keys::default()) };
    // A user's file: its size is checked before anything is read (a sparse
    // file of gigabytes costs its owner nothing), and it is read a bounded
    // line at a time, so memory stays within the keys it really lists.
    let size = file.metadata().map_err(|e| refuse(e.to_string()))?.len();
    if size > MAX_KEY_FILE_BYTES {
        return Err(refuse(format!(
            "is {size} bytes, more than a key file may be ({MAX_KEY_FILE_BYTES} bytes: one key per line); is it \
             the right file?"
        )));
    }
    let mut reader = std::io::BufReader::new(file).take(size);
    let mut keys = Keys::default();
    let mut line = Vec::new();
    for number in 1u64.. {
        line.clear();
        let read = (&mut reader).take(MAX_KEY_LINE_BYTES + 1).read_until(b'\n', &mut line);
        if read.map_err(|e| refuse(e.to_string()))? == 0 {
            break;
        }
        if line.len() as u64 > MAX_KEY_LINE_BYTES {
            return Err(refuse(format!(
                "line {number} is longer than {MAX_KEY_LINE_BYTES} bytes (one key per line, or BasicSR \
                 meta_info lines)"
            )));
        }
        let text =
            std::str::from_utf8(&line).map_err(|e| refuse(format!("line {number} is not UTF-8 text ({e})")))?.trim();
        if text.is_empty() {
            continue;
        }
        let key = basicsr_key(text).unwrap_or(text).as_bytes();
        if key.len() > MAX_KEY_BYTES {
            return Err(refuse(format!(
                "line {number}: key {} is {} bytes, more than LMDB's {MAX_KEY_BYTES}-byte limit, so no environment \
                 holds it",
                show_key(key),
                key.len()
            )));
        }
        if keys.len() as u64 >= MAX_KEY_FILE_KEYS {
            return Err(refuse(format!("lists more than {MAX_KEY_FILE_KEYS} keys")));
        }
        keys.push(key);
    }
    Ok(keys)
}

/// Largest key file read (bytes): a key per line of ImageNet-sized datasets
/// is tens of MB.
pub(super) const MAX_KEY_FILE_BYTES: u64 = 256 << 20;
/// Largest line of a key file (a key, or a BasicSR `meta_info.txt` line).
const MAX_KEY_LINE_BYTES: u64 = 4096;
/// Largest key LMDB stores (`mdb_env_get_maxkeysize` of the default build).
pub(super) const MAX_KEY_BYTES: usize = 511;
/// Most keys a key file may list (each costs its bytes plus 8).
const MAX_KEY_FILE_KEYS: u64 = 32 << 20;
/// Longest key shown in a message (longer ones are cut, with its length).
const SHOWN_KEY_BYTES: usize = 100;

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
    let (shown, cut) = match key.len() > SHOWN_KEY_BYTES {
        true => (&key[..SHOWN_KEY_BYTES], true),
        false => (key, false),
    };
    let text = match std::str::from_utf8(shown) {
        Ok(text) => text.to_string(),
        // A cut may split a UTF-8 character: show what decodes, escaped.
        Err(_) => shown.escape_ascii().to_string(),
    };
    if cut { format!("{text}… ({} bytes)", key.len()) } else { text }
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

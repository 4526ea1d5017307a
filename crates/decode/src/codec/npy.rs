//! `.npy` values as `np.save` writes them (format versions 1, 2 and 3).
//!
//! A small parser rather than the `npyz` crate: `npyz` decodes into typed
//! vectors or element iterators, while the daemon needs the header alone (to
//! learn shapes) and the body copied straight into slot memory, with one pass
//! for Fortran order or a foreign byte order.

use std::io::Read;

use stoker_proto::DType;

use super::{ArrayInfo, ByteOrder, CodecError, parse_dtype, read_exact_all, swap_if_needed};

/// First six bytes of every `.npy` value.
pub(super) const MAGIC: &[u8] = b"\x93NUMPY";
/// Longest header accepted (numpy itself caps v1 headers at 64 KiB).
const MAX_HEADER: usize = 1 << 20;

fn bad(message: impl Into<String>) -> CodecError {
    CodecError::malformed("npy", message)
}

/// What an `.npy` header says about the array that follows.
#[derive(Debug)]
pub(super) struct Header {
    /// Dtype and shape as delivered (C order, native byte order).
    pub(super) info: ArrayInfo,
    /// Byte order of the stored elements.
    order: ByteOrder,
    /// The body is in Fortran (column-major) order.
    fortran: bool,
}

impl Header {
    /// Parses the header at the start of `value`; returns it and the body.
    pub(super) fn parse(value: &[u8]) -> Result<(Header, &[u8]), CodecError> {
        let (prefix_len, header_len) = prefix(value)?;
        let end = prefix_len + header_len;
        let text = value.get(prefix_len..end).ok_or_else(|| bad("value ends inside the header"))?;
        Ok((Header::from_text(text)?, &value[end..]))
    }

    /// Reads the header from `reader`, leaving it at the body.
    pub(super) fn read(reader: &mut dyn Read) -> Result<Header, CodecError> {
        let mut fixed = [0u8; 12];
        reader.read_exact(&mut fixed[..10]).map_err(|e| bad(format!("cannot read the header: {e}")))?;
        if fixed[6] >= 2 {
            reader.read_exact(&mut fixed[10..12]).map_err(|e| bad(format!("cannot read the header: {e}")))?;
        }
        let (_, header_len) = prefix(&fixed)?;
        let mut text = vec![0u8; header_len];
        reader.read_exact(&mut text).map_err(|e| bad(format!("value ends inside the header: {e}")))?;
        Header::from_text(&text)
    }

    fn from_text(text: &[u8]) -> Result<Header, CodecError> {
        // v1/v2 headers are latin-1, v3 UTF-8; every byte that matters is ASCII.
        let text = String::from_utf8_lossy(text);
        let descr = dict_value(&text, "descr")?;
        let descr = quoted(descr).ok_or_else(|| {
            CodecError::Dtype(format!("{} (structured dtypes are not served)", descr.split('\n').next().unwrap_or("")))
        })?;
        let (dtype, order) = parse_dtype(descr)?;
        let fortran = match dict_value(&text, "fortran_order")? {
            v if v.starts_with("True") => true,
            v if v.starts_with("False") => false,
            v => return Err(bad(format!("fortran_order is neither True nor False: {v:.20}"))),
        };
        let shape = dict_value(&text, "shape")?;
        let inner = shape
            .strip_prefix('(')
            .and_then(|s| s.split_once(')'))
            .map(|(inner, _)| inner)
            .ok_or_else(|| bad(format!("shape is not a tuple: {shape:.40}")))?;
        let shape = inner
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.trim_end_matches('L').parse::<u64>().map_err(|_| bad(format!("bad dimension {s:?} in shape"))))
            .collect::<Result<Vec<u64>, _>>()?;
        let elements = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        if elements.and_then(|n| n.checked_mul(dtype.size() as u64)).is_none_or(|b| b > isize::MAX as u64) {
            return Err(bad(format!("shape {shape:?} is too large")));
        }
        Ok(Header { info: ArrayInfo { dtype, shape }, order, fortran })
    }

    /// Fails unless `body` holds exactly `bytes` (the array's size).
    pub(super) fn check_body_len(&self, body: &[u8], bytes: usize) -> Result<(), CodecError> {
        if body.len() != bytes {
            return Err(bad(format!(
                "body has {} bytes but {} needs {bytes} (truncated or trailing data)",
                body.len(),
                self.info
            )));
        }
        Ok(())
    }

    /// Copies the body (all of it, nothing after) into `dst` in C order, native-endian.
    pub(super) fn copy_body(&self, body: &[u8], dst: &mut [u8]) -> Result<(), CodecError> {
        self.check_body_len(body, dst.len())?;
        if self.needs_transpose() {
            fortran_to_c(body, dst, &self.info.shape, self.info.dtype.size());
        } else {
            dst.copy_from_slice(body);
        }
        self.finish(dst)
    }

    /// Reads the body from `reader` into `dst`; `scratch` holds Fortran-ordered bodies.
    pub(super) fn read_body(
        &self,
        reader: &mut dyn Read,
        dst: &mut [u8],
        scratch: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        if self.needs_transpose() {
            scratch.clear();
            scratch.resize(dst.len(), 0);
            read_exact_all(reader, scratch, "npy body").map_err(|e| bad(e.to_string()))?;
            fortran_to_c(scratch, dst, &self.info.shape, self.info.dtype.size());
        } else {
            read_exact_all(reader, dst, "npy body").map_err(|e| bad(e.to_string()))?;
        }
        self.finish(dst)
    }

    fn needs_transpose(&self) -> bool {
        self.fortran && self.info.shape.iter().filter(|&&d| d > 1).count() > 1
    }

    fn finish(&self, dst: &mut [u8]) -> Result<(), CodecError> {
        swap_if_needed(dst, self.info.dtype, self.order);
        if self.info.dtype == DType::Bool
            && let Some(v) = dst.iter().find(|&&b| b > 1)
        {
            return Err(bad(format!("bool array holds the byte {v}")));
        }
        Ok(())
    }
}

/// Length of the fixed prefix and of the header text, from the first bytes.
fn prefix(value: &[u8]) -> Result<(usize, usize), CodecError> {
    if !value.starts_with(MAGIC) {
        return Err(bad("missing the \\x93NUMPY magic"));
    }
    let (prefix_len, header_len) = match value.get(6) {
        Some(1) => (10, value.get(8..10).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)),
        Some(2 | 3) => (12, value.get(8..12).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)),
        Some(v) => return Err(bad(format!("format version {v} is not supported (1, 2 and 3 are)"))),
        None => return Err(bad("value ends inside the magic")),
    };
    let header_len = header_len.ok_or_else(|| bad("value ends inside the header length"))?;
    if header_len > MAX_HEADER {
        return Err(bad(format!("header claims {header_len} bytes")));
    }
    Ok((prefix_len, header_len))
}

/// The text after `'key':` in the header dict, leading spaces trimmed.
fn dict_value<'t>(text: &'t str, key: &str) -> Result<&'t str, CodecError> {
    for quote in ['\'', '"'] {
        let needle = format!("{quote}{key}{quote}");
        if let Some(at) = text.find(&needle) {
            let rest = text[at + needle.len()..].trim_start();
            if let Some(rest) = rest.strip_prefix(':') {
                return Ok(rest.trim_start());
            }
        }
    }
    Err(bad(format!("header has no {key:?} entry")))
}

/// The contents of a leading quoted string.
fn quoted(s: &str) -> Option<&str> {
    let quote = s.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    let rest = &s[1..];
    rest.find(quote).map(|end| &rest[..end])
}

/// Rewrites a column-major array as row-major (element size `esize`).
fn fortran_to_c(src: &[u8], dst: &mut [u8], shape: &[u64], esize: usize) {
    let n = shape.len();
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    // Element strides of the Fortran source, per axis of the C-ordered output.
    let mut stride = vec![1usize; n];
    for k in 1..n {
        stride[k] = stride[k - 1] * dims[k - 1];
    }
    let last = n - 1;
    let mut index = vec![0usize; n];
    let mut base = 0usize; // source element offset of index[..last], index[last] = 0
    let mut out = dst.chunks_exact_mut(esize);
    loop {
        for i in 0..dims[last] {
            let at = (base + i * stride[last]) * esize;
            out.next().expect("dst holds every element").copy_from_slice(&src[at..at + esize]);
        }
        // Advance the odometer over every axis but the last.
        let mut k = last;
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            index[k] += 1;
            base += stride[k];
            if index[k] < dims[k] {
                break;
            }
            base -= index[k] * stride[k];
            index[k] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fortran_transpose_3d() {
        // shape (2, 3, 4): Fortran element (i, j, k) is at i + 2j + 6k.
        let shape = [2u64, 3, 4];
        let src: Vec<u8> = (0..24).collect();
        let mut dst = vec![0u8; 24];
        fortran_to_c(&src, &mut dst, &shape, 1);
        for i in 0..2 {
            for j in 0..3 {
                for k in 0..4 {
                    assert_eq!(dst[i * 12 + j * 4 + k] as usize, i + 2 * j + 6 * k);
                }
            }
        }
    }

    fn v1(header: &str, body: &[u8]) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.extend_from_slice(&[1, 0]);
        v.extend_from_slice(&(header.len() as u16).to_le_bytes());
        v.extend_from_slice(header.as_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn header_forms() {
        let value = v1("{'descr': '>i2', 'fortran_order': True, 'shape': (3L, 2), }    \n", b"\x00\x01");
        let (h, body) = Header::parse(&value).unwrap();
        assert_eq!(h.info, ArrayInfo { dtype: DType::I16, shape: vec![3, 2] });
        assert_eq!(h.order, ByteOrder::Big);
        assert!(h.fortran);
        assert_eq!(body, b"\x00\x01");
        let (h, _) = Header::parse(&v1("{\"descr\": \"<f8\", \"fortran_order\": False, \"shape\": ()}", b"")).unwrap();
        assert_eq!(h.info, ArrayInfo { dtype: DType::F64, shape: vec![] });
        let structured = v1("{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (), }", b"");
        assert!(matches!(Header::parse(&structured), Err(CodecError::Dtype(_))));
        assert!(matches!(
            Header::parse(&v1("{'descr': '<c8', 'fortran_order': False, 'shape': (1,)}", b"")),
            Err(CodecError::Dtype(_))
        ));
        assert!(matches!(Header::parse(b"\x93NUMPY\x01\x00\xff"), Err(CodecError::Malformed { .. })));
        assert!(matches!(
            Header::parse(&v1("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", b"")[..20]),
            Err(CodecError::Malformed { .. })
        ));
    }
}

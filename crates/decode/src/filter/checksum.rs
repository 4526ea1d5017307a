//! HDF5's Fletcher-32 (`H5_checksum_fletcher32`) and the fletcher32 filter's
//! trailing-checksum check.

use super::{FilterError, truncated};

/// Bytes the fletcher32 filter appends to a chunk.
pub(crate) const FLETCHER_LEN: usize = 4;

/// HDF5's Fletcher-32: sums of big-endian 16-bit words, both sums starting at
/// zero, an odd trailing byte taken as the high byte of a last word.
pub(crate) fn fletcher32(data: &[u8]) -> u32 {
    // libhdf5 folds the sums every 360 words; wrapping adds keep its u32
    // arithmetic exactly, should a sum ever pass 2^32.
    const WORDS: usize = 360;
    let (mut sum1, mut sum2) = (0u32, 0u32);
    let mut blocks = data.chunks_exact(2 * WORDS);
    for block in blocks.by_ref() {
        for word in block.chunks_exact(2) {
            sum1 = sum1.wrapping_add(u32::from(word[0]) << 8 | u32::from(word[1]));
            sum2 = sum2.wrapping_add(sum1);
        }
        sum1 = (sum1 & 0xffff) + (sum1 >> 16);
        sum2 = (sum2 & 0xffff) + (sum2 >> 16);
    }
    let rest = blocks.remainder();
    let mut words = rest.chunks_exact(2);
    if words.len() > 0 {
        for word in words.by_ref() {
            sum1 = sum1.wrapping_add(u32::from(word[0]) << 8 | u32::from(word[1]));
            sum2 = sum2.wrapping_add(sum1);
        }
        sum1 = (sum1 & 0xffff) + (sum1 >> 16);
        sum2 = (sum2 & 0xffff) + (sum2 >> 16);
    }
    if let [last] = words.remainder() {
        sum1 = sum1.wrapping_add(u32::from(*last) << 8);
        sum2 = sum2.wrapping_add(sum1);
        sum1 = (sum1 & 0xffff) + (sum1 >> 16);
        sum2 = (sum2 & 0xffff) + (sum2 >> 16);
    }
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
    (sum2 << 16) | sum1
}

/// Checks the checksum in the last four bytes of `data` and returns the
/// length of the data in front of it.
///
/// The filter stores the checksum little-endian (`UINT32ENCODE`). Like
/// libhdf5 it also accepts the value with each byte pair swapped, which is
/// what versions before 1.6.3 wrote on little-endian machines.
pub(crate) fn verify_fletcher32(data: &[u8]) -> Result<usize, FilterError> {
    let Some(len) = data.len().checked_sub(FLETCHER_LEN) else {
        return Err(truncated("fletcher32", format!("{} bytes, shorter than the checksum", data.len())));
    };
    let (payload, tail) = data.split_at(len);
    let stored = u32::from_le_bytes(tail.try_into().expect("split at len - 4"));
    let computed = fletcher32(payload);
    let b = computed.to_le_bytes();
    let reversed = u32::from_le_bytes([b[1], b[0], b[3], b[2]]);
    if stored != computed && stored != reversed {
        return Err(FilterError::Checksum { stored, computed });
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A direct transcription of the definition, one word at a time with a
    /// modulo after every step.
    fn reference(data: &[u8]) -> u32 {
        let (mut s1, mut s2) = (0u64, 0u64);
        for pair in data.chunks(2) {
            let word = u64::from(pair[0]) << 8 | pair.get(1).map_or(0, |&b| u64::from(b));
            s1 = (s1 + word) % 65535;
            s2 = (s2 + s1) % 65535;
        }
        // HDF5's end-around-carry folding leaves 0xffff where a modulo gives
        // 0; both are the same residue.
        ((s2 as u32) << 16) | s1 as u32
    }

    fn residues(x: u32) -> (u32, u32) {
        ((x >> 16) % 65535, (x & 0xffff) % 65535)
    }

    #[test]
    fn matches_the_definition() {
        let mut data = Vec::new();
        let mut x = 7u32;
        for len in [0usize, 1, 2, 3, 719, 720, 721, 722, 1441, 5000] {
            data.clear();
            data.extend((0..len).map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                (x >> 16) as u8
            }));
            assert_eq!(residues(fletcher32(&data)), residues(reference(&data)), "len {len}");
        }
        // All 0xff bytes exercise the carry folding hardest.
        let ff = vec![0xff; 3001];
        assert_eq!(residues(fletcher32(&ff)), residues(reference(&ff)));
    }

    #[test]
    fn known_values() {
        // "abcde": words 0x6162, 0x6364 and a trailing 0x6500.
        let s1 = 0x6162 + 0x6364 + 0x6500;
        let s2 = 0x6162 + (0x6162 + 0x6364) + s1;
        let fold = |v: u32| {
            let v = (v & 0xffff) + (v >> 16);
            (v & 0xffff) + (v >> 16)
        };
        assert_eq!(fletcher32(b"abcde"), fold(s2) << 16 | fold(s1));
        assert_eq!(fletcher32(b""), 0);
    }

    #[test]
    fn verify_accepts_stored_and_pre_1_6_3_order() {
        let payload = b"some chunk bytes!".to_vec();
        let sum = fletcher32(&payload);
        let mut data = payload.clone();
        data.extend_from_slice(&sum.to_le_bytes());
        assert_eq!(verify_fletcher32(&data), Ok(payload.len()));

        let b = sum.to_le_bytes();
        let mut old = payload.clone();
        old.extend_from_slice(&[b[1], b[0], b[3], b[2]]);
        assert_eq!(verify_fletcher32(&old), Ok(payload.len()));

        let mut bad = data.clone();
        bad[3] ^= 1;
        assert!(matches!(verify_fletcher32(&bad), Err(FilterError::Checksum { .. })));
        assert!(matches!(verify_fletcher32(&data[..3]), Err(FilterError::Truncated { .. })));
        // Four bytes: an empty payload whose checksum is zero.
        assert_eq!(verify_fletcher32(&[0, 0, 0, 0]), Ok(0));
    }
}

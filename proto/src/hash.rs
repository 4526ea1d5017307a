//! The stable hashes whose values outlive a process: FNV-1a (a dataset
//! generation's fingerprint, which `state_dict` compares across daemon
//! restarts and versions; the group a field's random draws are keyed by) and
//! splitmix64 (the `(seed, epoch, index)` randomness of transforms and of the
//! sampler's keys). std's hasher is seeded per process; these are fixed, and
//! their golden values are pinned by the tests below. The sampler calls
//! [`mix64`] several times per sample from another crate, hence `#[inline]`.

/// FNV-1a's offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a's 64-bit prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
/// splitmix64's increment (the golden ratio, 2^64 / φ).
pub const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// 64-bit FNV-1a over bytes written in pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Fnv1a {
        Fnv1a(FNV_OFFSET)
    }
}

impl Fnv1a {
    /// Adds `bytes`.
    #[inline]
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
    }

    /// The hash of everything written.
    pub fn finish(self) -> u64 {
        self.0
    }
}

/// 64-bit FNV-1a of `bytes`.
#[inline]
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a::default();
    h.write(bytes);
    h.finish()
}

/// splitmix64's output function: a bijective 64-bit mix.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The word splitmix64 yields from state `x` (the state advanced by [`GOLDEN`], mixed).
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    mix64(x.wrapping_add(GOLDEN))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_reference_vectors() {
        // From the FNV reference test suite (64-bit FNV-1a).
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
        let mut pieces = Fnv1a::default();
        pieces.write(b"foo");
        pieces.write(b"bar");
        assert_eq!(pieces.finish(), fnv1a(b"foobar"));
    }

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // Vigna's splitmix64 seeded with 0 yields these first.
        let mut state = 0u64;
        let mut next = || {
            let word = splitmix64(state);
            state = state.wrapping_add(GOLDEN);
            word
        };
        assert_eq!(next(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(next(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(next(), 0x06c4_5d18_8009_454f);
    }
}

//! Which sample goes where: `DistributedSampler` semantics without
//! materializing the index list.
//!
//! The epoch's order is a keyed bijection of `0..n` (a Feistel network with
//! cycle walking, keyed by seed and epoch), so position `k` costs O(1) time and
//! memory for any `n`, and every rank on every node computes the same order
//! with no coordination. The order is padded by wrapping around to a multiple
//! of `world_size` (or truncated with `drop_last`), and rank `r` takes
//! positions `r, r + world, r + 2·world, …`, batched in order.

/// A keyed pseudo-random permutation of `0..n`.
#[derive(Debug, Clone)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; 4],
}

impl Permutation {
    /// The permutation of `0..n` for `(seed, epoch)`.
    pub fn new(n: u64, seed: u64, epoch: u64) -> Permutation {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let mut state = seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17);
        let keys = std::array::from_fn(|_| splitmix64(&mut state));
        Permutation { n, half_bits, keys }
    }

    /// Image of `x` (`x < n`).
    pub fn apply(&self, x: u64) -> u64 {
        debug_assert!(x < self.n);
        let mut y = x;
        // Cycle walking: the network permutes 0..4^half_bits ⊇ 0..n, so
        // re-applying until the value lands in range stays a bijection of 0..n.
        // The domain is under 4n, so this takes fewer than 4 rounds on average.
        loop {
            y = self.feistel(y);
            if y < self.n {
                return y;
            }
        }
    }

    /// Preimage of `y` (`y < n`): the `x` with `apply(x) == y`.
    pub fn invert(&self, y: u64) -> u64 {
        debug_assert!(y < self.n);
        let mut x = y;
        // Walks the same cycle backwards: the first value in range is the preimage.
        loop {
            x = self.feistel_inverse(x);
            if x < self.n {
                return x;
            }
        }
    }

    fn feistel_inverse(&self, y: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (y >> self.half_bits, y & mask);
        for key in self.keys.iter().rev() {
            let mixed = mix64(left ^ key) & mask;
            (left, right) = (right ^ mixed, left);
        }
        (left << self.half_bits) | right
    }

    fn feistel(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (x >> self.half_bits, x & mask);
        for key in self.keys {
            let mixed = mix64(right ^ key) & mask;
            (left, right) = (right, left ^ mixed);
        }
        (left << self.half_bits) | right
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    mix64(*state)
}

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One rank's view of the dataset's epochs.
#[derive(Debug, Clone)]
pub struct Sampler {
    n: u64,
    rank: u64,
    world: u64,
    batch_size: u64,
    shuffle: bool,
    seed: u64,
    per_rank: u64,
    batches: u64,
}

impl Sampler {
    /// A sampler over `n ≥ 1` samples; `rank < world`, `batch_size ≥ 1`.
    pub fn new(n: u64, rank: u64, world: u64, batch_size: u64, shuffle: bool, seed: u64, drop_last: bool) -> Sampler {
        assert!(n > 0 && world > 0 && rank < world && batch_size > 0, "checked by the caller");
        let per_rank = if drop_last { n / world } else { n.div_ceil(world) };
        let batches = if drop_last { per_rank / batch_size } else { per_rank.div_ceil(batch_size) };
        Sampler { n, rank, world, batch_size, shuffle, seed, per_rank, batches }
    }

    /// The seed the permutation (and per-sample randomness) derives from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Samples this rank sees per epoch.
    pub fn per_rank(&self) -> u64 {
        self.per_rank
    }

    /// Batches per epoch for this rank (the same on every rank).
    pub fn batches_per_epoch(&self) -> u64 {
        self.batches
    }

    /// Rows in batch `step` (the last one may be partial without `drop_last`).
    pub fn rows(&self, step: u64) -> u64 {
        self.batch_size.min(self.per_rank - step * self.batch_size)
    }

    /// The epoch's permutation, or `None` without shuffling.
    pub fn permutation(&self, epoch: u64) -> Option<Permutation> {
        self.shuffle.then(|| Permutation::new(self.n, self.seed, epoch))
    }

    /// Where dataset index `index` falls in this rank's order of `epoch`:
    /// its position among the rank's samples (`step · batch_size + row`), or
    /// `None` when another rank reads it (or `drop_last` cut it). O(1): the
    /// permutation is inverted, not searched. Wrap-around padding (a sample
    /// read twice) reports the first read only.
    pub fn local_position(&self, perm: Option<&Permutation>, index: u64) -> Option<u64> {
        if index >= self.n {
            return None;
        }
        let position = match perm {
            Some(p) => p.invert(index),
            None => index,
        };
        let local = position / self.world;
        (position % self.world == self.rank && local < self.per_rank).then_some(local)
    }

    /// Samples per batch.
    pub fn batch_size(&self) -> u64 {
        self.batch_size
    }

    /// Number of samples in the dataset.
    pub fn samples(&self) -> u64 {
        self.n
    }

    /// Dataset index of row `row` of batch `step`.
    pub fn index(&self, perm: Option<&Permutation>, step: u64, row: u64) -> u64 {
        let position = self.rank + (step * self.batch_size + row) * self.world;
        // Positions past n are DistributedSampler's wrap-around padding.
        let wrapped = position % self.n;
        match perm {
            Some(p) => p.apply(wrapped),
            None => wrapped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_bijection_for_awkward_sizes() {
        for n in [1u64, 2, 3, 5, 16, 17, 100, 1023, 1025, 4097] {
            let p = Permutation::new(n, 42, 3);
            let mut seen = vec![false; n as usize];
            for x in 0..n {
                let y = p.apply(x) as usize;
                assert!(!seen[y], "n={n}: {y} hit twice");
                seen[y] = true;
            }
        }
    }

    #[test]
    fn invert_undoes_apply_and_local_position_finds_each_read() {
        for n in [1u64, 2, 3, 17, 1000, 4097] {
            let p = Permutation::new(n, 9, 2);
            for x in 0..n {
                assert_eq!(p.invert(p.apply(x)), x, "n={n}");
            }
        }
        let (n, world) = (103u64, 4u64);
        for rank in 0..world {
            for shuffle in [false, true] {
                let s = Sampler::new(n, rank, world, 8, shuffle, 7, true);
                let perm = s.permutation(3);
                for step in 0..s.batches_per_epoch() {
                    for row in 0..s.rows(step) {
                        let index = s.index(perm.as_ref(), step, row);
                        assert_eq!(s.local_position(perm.as_ref(), index), Some(step * 8 + row));
                    }
                }
                let mine = (0..n).filter(|&i| s.local_position(perm.as_ref(), i).is_some()).count() as u64;
                assert_eq!(mine, s.per_rank());
            }
        }
    }

    #[test]
    fn epochs_and_seeds_give_different_orders() {
        let order = |seed, epoch| (0..1000).map(|x| Permutation::new(1000, seed, epoch).apply(x)).collect::<Vec<_>>();
        assert_eq!(order(1, 0), order(1, 0));
        assert_ne!(order(1, 0), order(1, 1));
        assert_ne!(order(1, 0), order(2, 0));
        let fixed = order(1, 0).iter().enumerate().filter(|(i, v)| *i as u64 == **v).count();
        assert!(fixed < 20, "{fixed} fixed points: too close to the identity");
    }

    #[test]
    fn ranks_cover_everything_once_plus_padding() {
        let (n, world) = (103u64, 4u64);
        let mut counts = vec![0u32; n as usize];
        let mut batch_counts = Vec::new();
        for rank in 0..world {
            let s = Sampler::new(n, rank, world, 8, true, 7, false);
            let perm = s.permutation(5);
            batch_counts.push(s.batches_per_epoch());
            for step in 0..s.batches_per_epoch() {
                for row in 0..s.rows(step) {
                    counts[s.index(perm.as_ref(), step, row) as usize] += 1;
                }
            }
        }
        assert!(batch_counts.iter().all(|&b| b == batch_counts[0]));
        let total: u32 = counts.iter().sum();
        assert_eq!(u64::from(total), n.div_ceil(world) * world);
        assert!(counts.iter().all(|&c| c == 1 || c == 2));
        assert_eq!(counts.iter().filter(|&&c| c == 2).count() as u64, n.div_ceil(world) * world - n);
    }

    #[test]
    fn drop_last_truncates_and_identity_without_shuffle() {
        let s = Sampler::new(10, 1, 3, 2, false, 0, true);
        assert_eq!(s.per_rank(), 3);
        assert_eq!(s.batches_per_epoch(), 1);
        assert_eq!([s.index(None, 0, 0), s.index(None, 0, 1)], [1, 4]);
    }
}

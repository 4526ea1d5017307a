//! Which sample goes where: `DistributedSampler` semantics without
//! materializing the index list.
//!
//! The epoch's order is a keyed bijection of `0..n` (a Feistel network with
//! cycle walking, keyed by seed and epoch), so position `k` costs O(1) time and
//! memory for any `n`, and every rank on every node computes the same order
//! with no coordination. The order is padded by wrapping around to a multiple
//! of `world_size` (or truncated with `drop_last`), and rank `r` takes
//! positions `r, r + world, r + 2·world, …`, batched in order.
//!
//! Besides the exact shuffle, [`BlockOrder`] is the opt-in locality order
//! (`shuffle = "block"`): blocks of consecutive indices are permuted, then
//! samples are permuted within windows of consecutive (permuted) blocks, so a
//! run of positions touches few regions of the files. Also O(1) each way.

use stoker_proto::hash::mix64;

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

/// The next word of splitmix64 at `state`, advancing it.
fn splitmix64(state: &mut u64) -> u64 {
    let word = stoker_proto::hash::splitmix64(*state);
    *state = state.wrapping_add(stoker_proto::hash::GOLDEN);
    word
}

/// How an epoch's positions map to dataset indices before the rank split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shuffle {
    /// Position `k` reads index `k`.
    Off,
    /// A uniformly keyed permutation of all indices ([`Permutation`]).
    Exact,
    /// The locality order ([`BlockOrder`]).
    Block {
        /// Consecutive indices per block (≥ 1).
        block_size: u64,
        /// Consecutive permuted blocks whose samples are mixed together (≥ 1).
        window: u64,
    },
}

/// Largest `block_size` accepted for [`Shuffle::Block`].
pub const MAX_BLOCK_SIZE: u64 = 1 << 32;
/// Largest `window` accepted for [`Shuffle::Block`].
pub const MAX_BLOCK_WINDOW: u64 = 1 << 32;
/// Largest dataset the block order serves (its arithmetic then cannot overflow).
pub const MAX_BLOCK_SAMPLES: u64 = 1 << 62;

impl From<bool> for Shuffle {
    fn from(shuffle: bool) -> Shuffle {
        if shuffle { Shuffle::Exact } else { Shuffle::Off }
    }
}

/// Why a client's [`Shuffle`] cannot order a dataset; each names the
/// offending argument and its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShuffleError {
    /// `block_size` is outside `1..=MAX_BLOCK_SIZE`.
    #[error("block_size {0} is outside 1..={MAX_BLOCK_SIZE} (shuffle=\"block\")")]
    BlockSize(u64),
    /// `block_window` is outside `1..=MAX_BLOCK_WINDOW`.
    #[error("block_window {0} is outside 1..={MAX_BLOCK_WINDOW} (shuffle=\"block\")")]
    Window(u64),
    /// The dataset has more samples (this many) than the block order serves.
    #[error("the dataset has {0} samples, more than shuffle=\"block\" serves ({MAX_BLOCK_SAMPLES}); use shuffle=True")]
    TooManySamples(u64),
}

impl Shuffle {
    /// Checks a client's request for a dataset of `n` samples.
    pub fn check(self, n: u64) -> Result<(), ShuffleError> {
        let Shuffle::Block { block_size, window } = self else { return Ok(()) };
        if !(1..=MAX_BLOCK_SIZE).contains(&block_size) {
            return Err(ShuffleError::BlockSize(block_size));
        }
        if !(1..=MAX_BLOCK_WINDOW).contains(&window) {
            return Err(ShuffleError::Window(window));
        }
        if n > MAX_BLOCK_SAMPLES {
            return Err(ShuffleError::TooManySamples(n));
        }
        Ok(())
    }
}

/// The locality order of `0..n` for one epoch: FFCV's `QUASI_RANDOM` and
/// MosaicML Streaming's `py1e` in spirit, as an O(1) bijection.
///
/// Indices are cut into blocks of `block_size` consecutive indices (the last
/// block may be short); the blocks are permuted by a keyed [`Permutation`] of
/// `(seed, epoch)`. The permuted blocks are grouped into windows of `window`
/// consecutive blocks, and the samples of each window are permuted among
/// themselves by a [`Permutation`] keyed by `(seed, epoch, window index)`.
/// Positions `w·window·block_size ..` therefore read only the `window` blocks
/// of window `w`.
///
/// Position arithmetic runs in a "virtual" space where every block is full
/// (`blocks · block_size` positions); the short block's missing tail is a
/// hole at virtual `hole..hole + short` that real positions skip.
#[derive(Debug, Clone)]
pub struct BlockOrder {
    block: u64,
    /// `window · block_size` (window clamped to the block count): virtual positions per window.
    span: u64,
    /// `blocks · block_size`: the virtual space.
    virtual_len: u64,
    /// Virtual position where the short block's missing tail starts.
    hole: u64,
    /// Positions missing from the short block (`0..block_size`).
    short: u64,
    blocks: Permutation,
    window_seed: u64,
    epoch: u64,
}

const BLOCK_SALT: u64 = 0x6a09_e667_f3bc_c908;
const WINDOW_SALT: u64 = 0xbb67_ae85_84ca_a73b;

impl BlockOrder {
    /// The order of `0..n` for `(seed, epoch)`; `n ≥ 1`, `block_size ≥ 1`,
    /// `window ≥ 1` and `n ≤ MAX_BLOCK_SAMPLES` (see [`Shuffle::check`]).
    pub fn new(n: u64, block_size: u64, window: u64, seed: u64, epoch: u64) -> BlockOrder {
        assert!(n > 0 && block_size > 0 && window > 0, "checked by the caller");
        // A block longer than the dataset is the whole dataset; a window wider
        // than the block count is all of them. Then every product below is
        // below 2n, which MAX_BLOCK_SAMPLES keeps far from overflow.
        let block = block_size.min(n);
        let count = n.div_ceil(block);
        let virtual_len = count * block;
        let short = virtual_len - n;
        let span = window.min(count) * block;
        let blocks = Permutation::new(count, seed ^ BLOCK_SALT, epoch);
        // The last block (id count - 1) is the short one; where it lands.
        let hole = blocks.invert(count - 1) * block + (block - short);
        let window_seed = mix64(seed ^ WINDOW_SALT);
        BlockOrder { block, span, virtual_len, hole, short, blocks, window_seed, epoch }
    }

    fn to_virtual(&self, real: u64) -> u64 {
        if real < self.hole { real } else { real + self.short }
    }

    /// Real position of a virtual position outside the hole (block boundaries included).
    fn to_real(&self, virt: u64) -> u64 {
        if virt < self.hole { virt } else { virt - self.short }
    }

    /// Window `w`'s first real position and its permutation.
    fn window(&self, w: u64) -> (u64, Permutation) {
        let start = self.to_real(w * self.span);
        let end = self.to_real(((w + 1) * self.span).min(self.virtual_len));
        let seed = self.window_seed ^ mix64(w.wrapping_add(WINDOW_SALT));
        (start, Permutation::new(end - start, seed, self.epoch))
    }

    /// Dataset index at position `k` (`k < n`).
    pub fn apply(&self, k: u64) -> u64 {
        let w = self.to_virtual(k) / self.span;
        let (start, within) = self.window(w);
        let virt = self.to_virtual(start + within.apply(k - start));
        self.blocks.apply(virt / self.block) * self.block + virt % self.block
    }

    /// Position of dataset index `index` (`index < n`): the `k` with `apply(k) == index`.
    pub fn invert(&self, index: u64) -> u64 {
        let virt = self.blocks.invert(index / self.block) * self.block + index % self.block;
        let (start, within) = self.window(virt / self.span);
        start + within.invert(self.to_real(virt) - start)
    }
}

/// One epoch's order, as [`Sampler::permutation`] gives it.
#[derive(Debug, Clone)]
pub enum Order {
    /// [`Shuffle::Exact`].
    Exact(Permutation),
    /// [`Shuffle::Block`].
    Block(BlockOrder),
}

impl Order {
    /// Dataset index at position `k` (`k < n`).
    pub fn apply(&self, k: u64) -> u64 {
        match self {
            Order::Exact(p) => p.apply(k),
            Order::Block(b) => b.apply(k),
        }
    }

    /// Position of dataset index `index` (`index < n`).
    pub fn invert(&self, index: u64) -> u64 {
        match self {
            Order::Exact(p) => p.invert(index),
            Order::Block(b) => b.invert(index),
        }
    }
}

/// One rank's view of the dataset's epochs.
#[derive(Debug, Clone)]
pub struct Sampler {
    n: u64,
    rank: u64,
    world: u64,
    batch_size: u64,
    shuffle: Shuffle,
    seed: u64,
    per_rank: u64,
    batches: u64,
}

impl Sampler {
    /// A sampler over `n ≥ 1` samples; `rank < world`, `batch_size ≥ 1`;
    /// `shuffle` a `bool` or a [`Shuffle`] that passed [`Shuffle::check`].
    pub fn new(
        n: u64,
        rank: u64,
        world: u64,
        batch_size: u64,
        shuffle: impl Into<Shuffle>,
        seed: u64,
        drop_last: bool,
    ) -> Sampler {
        assert!(n > 0 && world > 0 && rank < world && batch_size > 0, "checked by the caller");
        let shuffle = shuffle.into();
        debug_assert!(shuffle.check(n).is_ok(), "checked by the caller");
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

    /// How positions map to indices.
    pub fn shuffle(&self) -> Shuffle {
        self.shuffle
    }

    /// The epoch's order, or `None` without shuffling.
    pub fn permutation(&self, epoch: u64) -> Option<Order> {
        match self.shuffle {
            Shuffle::Off => None,
            Shuffle::Exact => Some(Order::Exact(Permutation::new(self.n, self.seed, epoch))),
            Shuffle::Block { block_size, window } => {
                Some(Order::Block(BlockOrder::new(self.n, block_size, window, self.seed, epoch)))
            }
        }
    }

    /// Where dataset index `index` falls in this rank's order of `epoch`:
    /// its position among the rank's samples (`step · batch_size + row`), or
    /// `None` when another rank reads it (or `drop_last` cut it). O(1): the
    /// permutation is inverted, not searched. Wrap-around padding (a sample
    /// read twice) reports the first read only.
    pub fn local_position(&self, perm: Option<&Order>, index: u64) -> Option<u64> {
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
    // Called per row by the daemon's fill loop, across the crate boundary.
    #[inline]
    pub fn index(&self, perm: Option<&Order>, step: u64, row: u64) -> u64 {
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

    fn block_order(n: u64, block: u64, window: u64, seed: u64, epoch: u64) -> Vec<u64> {
        let b = BlockOrder::new(n, block, window, seed, epoch);
        (0..n).map(|k| b.apply(k)).collect()
    }

    #[test]
    fn block_order_is_a_bijection_with_its_inverse_for_every_small_shape() {
        for n in 1u64..=70 {
            for block in [1u64, 2, 3, 5, 7, 16, 69, 70, 100] {
                for window in [1u64, 2, 3, 8, 1000] {
                    for seed in [0u64, 11] {
                        let b = BlockOrder::new(n, block, window, seed, 4);
                        let mut seen = vec![false; n as usize];
                        for k in 0..n {
                            let i = b.apply(k);
                            assert!(i < n, "n={n} block={block} window={window}: {i} out of range");
                            assert!(!seen[i as usize], "n={n} block={block} window={window}: {i} hit twice");
                            seen[i as usize] = true;
                            assert_eq!(b.invert(i), k, "n={n} block={block} window={window} k={k}");
                        }
                    }
                }
            }
        }
        for (n, block, window) in [(100_003u64, 64, 4), (65_536, 256, 16), (99_999, 1000, 1), (12_345, 7, 100_000)] {
            let b = BlockOrder::new(n, block, window, 3, 9);
            let mut seen = vec![false; n as usize];
            for k in 0..n {
                let i = b.apply(k);
                assert!(!std::mem::replace(&mut seen[i as usize], true), "n={n}: {i} hit twice");
                assert_eq!(b.invert(i), k);
            }
        }
    }

    #[test]
    fn block_order_is_deterministic_and_differs_by_epoch_and_seed() {
        let order = |seed, epoch| block_order(10_000, 64, 4, seed, epoch);
        assert_eq!(order(1, 0), order(1, 0));
        assert_ne!(order(1, 0), order(1, 1));
        assert_ne!(order(1, 0), order(2, 0));
        // Blocks move: the first window's blocks differ between epochs.
        let first_blocks = |epoch| {
            let mut b: Vec<u64> = order(1, epoch)[..256].iter().map(|i| i / 64).collect();
            b.sort_unstable();
            b.dedup();
            b
        };
        assert_ne!(first_blocks(0), first_blocks(1));
        // Samples move within a window: not the blocks' own order.
        let o = order(1, 0);
        let in_block_order = o.windows(2).filter(|p| p[1] == p[0] + 1).count();
        assert!(in_block_order < 500, "{in_block_order} consecutive pairs: windows are not shuffled");
    }

    #[test]
    fn block_order_reads_one_window_of_blocks_at_a_time() {
        for (n, block, window) in [(10_000u64, 64, 4), (10_001, 64, 4), (1_000, 10, 1), (777, 5, 3), (50, 64, 2)] {
            let o = block_order(n, block, window, 5, 2);
            let count = n.div_ceil(block.min(n));
            // Cut the order greedily into runs touching at most `window`
            // blocks each: exactly one run per window of blocks.
            let mut runs = 0;
            let mut current = std::collections::HashSet::new();
            for &i in &o {
                if !current.contains(&(i / block)) && current.len() as u64 == window {
                    current.clear();
                }
                if current.is_empty() {
                    runs += 1;
                }
                current.insert(i / block);
            }
            assert_eq!(runs, count.div_ceil(window), "n={n} block={block} window={window}");
            // So any `window · block_size` consecutive positions touch at most
            // two windows' blocks (three around the short block's window).
            let span = (block * window) as usize;
            let bound = if n % block == 0 { 2 * window } else { 3 * window };
            for start in (0..o.len()).step_by(17) {
                let mut blocks: Vec<u64> = o[start..(start + span).min(o.len())].iter().map(|i| i / block).collect();
                blocks.sort_unstable();
                blocks.dedup();
                assert!(blocks.len() as u64 <= bound, "n={n} at {start}: {} blocks", blocks.len());
            }
        }
        // Without a short block, every aligned window is exactly `window` whole blocks.
        let o = block_order(64 * 40, 64, 4, 1, 0);
        for run in o.chunks(256) {
            let mut blocks: Vec<u64> = run.iter().map(|i| i / 64).collect();
            blocks.sort_unstable();
            blocks.dedup();
            assert_eq!(blocks.len(), 4);
        }
    }

    #[test]
    fn block_order_keeps_distributed_sampler_exactness_across_ranks() {
        let shuffle = Shuffle::Block { block_size: 10, window: 3 };
        for (n, world, drop_last) in [(103u64, 4u64, false), (103, 4, true), (1, 3, false), (64, 8, false)] {
            let mut counts = vec![0u32; n as usize];
            let mut batches = Vec::new();
            for rank in 0..world {
                let s = Sampler::new(n, rank, world, 8, shuffle, 7, drop_last);
                let perm = s.permutation(5);
                assert!(matches!(perm, Some(Order::Block(_))));
                batches.push(s.batches_per_epoch());
                for step in 0..s.batches_per_epoch() {
                    for row in 0..s.rows(step) {
                        let index = s.index(perm.as_ref(), step, row);
                        counts[index as usize] += 1;
                        // Wrap-around padding reports the first read, on whichever rank.
                        if rank + (step * 8 + row) * world < n {
                            assert_eq!(s.local_position(perm.as_ref(), index), Some(step * 8 + row));
                        }
                    }
                }
            }
            assert!(batches.iter().all(|&b| b == batches[0]));
            let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
            if drop_last {
                assert_eq!(total, batches[0] * 8 * world);
                assert!(counts.iter().all(|&c| c <= 1));
            } else {
                assert_eq!(total, n.div_ceil(world) * world);
                assert!(counts.iter().all(|&c| c >= 1), "n={n}: {counts:?}");
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn block_order_inverts_at_any_size(
            n in 1u64..(1 << 40),
            block in 1u64..5000,
            window in 1u64..64,
            seed: u64,
            epoch in 0u64..1000,
            at: u64,
        ) {
            let b = BlockOrder::new(n, block, window, seed, epoch);
            let k = at % n;
            let i = b.apply(k);
            proptest::prop_assert!(i < n);
            proptest::prop_assert_eq!(b.invert(i), k);
            proptest::prop_assert_eq!(b.apply(b.invert(k)), k);
        }
    }

    #[test]
    fn block_arguments_are_checked() {
        let refused = |block_size, window, n| Shuffle::Block { block_size, window }.check(n).unwrap_err();
        assert_eq!(refused(0, 1, 10), ShuffleError::BlockSize(0));
        assert!(refused(0, 1, 10).to_string().starts_with("block_size 0 is outside 1..=4294967296"));
        assert_eq!(refused(1, 0, 10), ShuffleError::Window(0));
        assert!(refused(1, 0, 10).to_string().starts_with("block_window 0 is outside 1..="));
        assert_eq!(refused(MAX_BLOCK_SIZE + 1, 1, 10), ShuffleError::BlockSize(MAX_BLOCK_SIZE + 1));
        assert_eq!(refused(1, MAX_BLOCK_WINDOW + 1, 10), ShuffleError::Window(MAX_BLOCK_WINDOW + 1));
        assert_eq!(refused(8, 2, MAX_BLOCK_SAMPLES + 1), ShuffleError::TooManySamples(MAX_BLOCK_SAMPLES + 1));
        assert!(
            Shuffle::Block { block_size: MAX_BLOCK_SIZE, window: MAX_BLOCK_WINDOW }.check(MAX_BLOCK_SAMPLES).is_ok()
        );
        // The largest arguments on the largest dataset: no overflow.
        let b = BlockOrder::new(MAX_BLOCK_SAMPLES, MAX_BLOCK_SIZE, MAX_BLOCK_WINDOW, 1, 1);
        for k in [0, 1, MAX_BLOCK_SAMPLES / 2, MAX_BLOCK_SAMPLES - 1] {
            assert_eq!(b.invert(b.apply(k)), k);
        }
    }

    #[test]
    fn drop_last_truncates_and_identity_without_shuffle() {
        let s = Sampler::new(10, 1, 3, 2, false, 0, true);
        assert_eq!(s.per_rank(), 3);
        assert_eq!(s.batches_per_epoch(), 1);
        assert_eq!([s.index(None, 0, 0), s.index(None, 0, 1)], [1, 4]);
    }
}

//! A fast hasher for the simulator's integer-keyed maps and sets (block hashes and ids):
//! SipHash, the standard library's default, was a tenth of a replay. Keys are folded in with a
//! 64×64→128-bit multiply whose halves are xored (foldhash's and wyhash's mix), which spreads
//! structured keys (counters, ids in the high bits) over the low bits hash tables index with
//! and the high bits they tag with. Fixed seed: the maps are looked up, never iterated, so no
//! figure depends on it.

use std::hash::{BuildHasher, Hasher};

const SEED: u64 = 0x243F_6A88_85A3_08D3;
const MUL: u64 = 0x9E37_79B9_7F4A_7C15;

#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = a as u128 * b as u128;
    (p as u64) ^ ((p >> 64) as u64)
}

/// The hasher (see the module).
#[derive(Debug, Clone, Copy)]
pub struct FoldHasher(u64);

impl Hasher for FoldHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = fold(self.0 ^ x, MUL);
    }

    #[inline]
    fn write_u128(&mut self, x: u128) {
        self.write_u64(x as u64);
        self.write_u64((x >> 64) as u64);
    }

    #[inline]
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        fold(self.0, SEED ^ MUL)
    }
}

/// Builds [`FoldHasher`]s.
#[derive(Debug, Clone, Copy, Default)]
pub struct FoldState;

impl BuildHasher for FoldState {
    type Hasher = FoldHasher;

    #[inline]
    fn build_hasher(&self) -> FoldHasher {
        FoldHasher(SEED)
    }
}

/// A `HashMap` with [`FoldState`].
pub type HashMap<K, V> = std::collections::HashMap<K, V, FoldState>;
/// A `HashSet` with [`FoldState`].
pub type HashSet<K> = std::collections::HashSet<K, FoldState>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structured_keys_spread_over_low_and_high_bits() {
        // Keys as the engine makes them: a tag in the top byte, a small index, a counter.
        let hash = |k: u128| FoldState.hash_one(k);
        let mut low = HashSet::default();
        let mut high = HashSet::default();
        for i in 0..4096u128 {
            let h = hash((1 << 120) | ((i % 4) << 64) | (i / 4));
            low.insert(h & 0xFFF);
            high.insert(h >> 57);
        }
        assert!(low.len() > 2400, "{} distinct low 12 bits", low.len());
        assert_eq!(high.len(), 128, "every 7-bit tag");
        assert_ne!(hash(1), hash(1 << 64));
        assert_eq!(hash(7), hash(7));
    }
}

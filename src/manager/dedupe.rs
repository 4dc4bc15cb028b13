//! The duplicate-key filter of `prepare_store`: a key listed twice in one call is stored once.

use super::{Manager, NO_ID, key_at};

impl Manager {
    /// Drops repeated keys from `scratch_new` (keeping the first). A filter of at least 64 bits
    /// per key, indexed by hash, passes most keys at once; a key whose bit is already set is
    /// compared with the keys kept before it. After many such clashes (repeated keys en masse),
    /// the rest is sorted by hash instead, so the cost stays `O(n log n)`.
    pub(super) fn dedupe_new(&mut self, keys: &[u8]) {
        let n = self.scratch_new.len();
        if n < 2 {
            return;
        }
        let words = n.next_power_of_two().max(64);
        let shift = 64 - (words * 64).trailing_zeros();
        self.scratch_filter.clear();
        self.scratch_filter.resize(words, 0);
        let kl = self.cfg.key_len;
        let (filter, new, hashes) = (
            &mut self.scratch_filter[..],
            &mut self.scratch_new[..],
            &self.scratch_hash[..],
        );
        let (mut kept, mut clashes) = (0, 0);
        for j in 0..n {
            let i = new[j];
            let h = hashes[i as usize];
            let bit = (h >> shift) as usize;
            let (word, mask) = (bit / 64, 1u64 << (bit % 64));
            if filter[word] & mask != 0 {
                clashes += 1;
                if clashes > 64 {
                    new.copy_within(j.., kept);
                    self.scratch_new.truncate(kept + n - j);
                    return self.dedupe_sorted(keys);
                }
                let key = key_at(keys, kl, i);
                if new[..kept]
                    .iter()
                    .any(|&k| hashes[k as usize] == h && key_at(keys, kl, k) == key)
                {
                    continue;
                }
            }
            filter[word] |= mask;
            new[kept] = i;
            kept += 1;
        }
        self.scratch_new.truncate(kept);
    }

    /// Drops repeated keys from `scratch_new` (keeping the first) by sorting (hash, position)
    /// pairs and comparing only keys with equal hashes.
    fn dedupe_sorted(&mut self, keys: &[u8]) {
        let n = self.scratch_new.len();
        self.scratch_pairs.clear();
        self.scratch_pairs.extend(
            self.scratch_new
                .iter()
                .enumerate()
                .map(|(j, &i)| (self.scratch_hash[i as usize], j as u32)),
        );
        self.scratch_pairs.sort_unstable();
        let kl = self.cfg.key_len;
        let mut repeats = false;
        let mut run = 0;
        for k in 1..n {
            let (h, j) = self.scratch_pairs[k];
            if h != self.scratch_pairs[run].0 {
                run = k;
                continue;
            }
            // Earlier positions of this hash come first in the run.
            let key = key_at(keys, kl, self.scratch_new[j as usize]);
            if self.scratch_pairs[run..k]
                .iter()
                .any(|&(_, e)| e != NO_ID && key_at(keys, kl, self.scratch_new[e as usize]) == key)
            {
                self.scratch_pairs[k].1 = NO_ID;
                self.scratch_new[j as usize] = NO_ID;
                repeats = true;
            }
        }
        if repeats {
            self.scratch_new.retain(|&i| i != NO_ID);
        }
    }
}

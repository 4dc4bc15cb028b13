//! The per-request access records of vLLM 0.33 semantics (vLLM 0.33 `_RequestCacheAccess`):
//! which keys a request observed, in first-observation order, with their positions, which it
//! inserted, which it reused, which it reported as store misses, and the LRU request rank it
//! took. Records are pooled: a finished request's buffers serve the next one.

use super::keys::{KeyTable, append_key, key_eq};
use super::{NO_ID, RequestId};
use crate::error::{Result, invalid};
use hashbrown::HashTable;

/// The position of a key given none.
pub(super) const NO_POS: u64 = u64::MAX;

/// Flags of a recorded key.
pub(super) const INSERTED: u8 = 1;
/// A ready key the request loaded or re-offered, not inserted by it before.
pub(super) const REUSED: u8 = 2;
/// Reported to the policy's `on_store_miss` for this request.
pub(super) const STORE_MISS: u8 = 4;

/// What a record holds of one key besides its bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    pub hash: u64,
    /// [`NO_POS`]: none.
    pub position: u64,
    /// The manager id the key had when last seen (a hint: the commit takes a slot whose key is
    /// still this one without a lookup, and looks up the others).
    pub id: u32,
    /// The key's group: its last four bytes, big-endian (the commit orders by group first).
    pub group: u32,
    /// [`INSERTED`], [`REUSED`], [`STORE_MISS`].
    pub flags: u8,
    /// The record's store offer ([`Record::begin_offer`]) that last made the key a candidate;
    /// 0: none.
    pub offer: u32,
}

/// Bits of a record's filter of key hashes.
const FILTER_BITS: usize = 1024;

/// Keys past the hash index that a find compares one by one; with more, it extends the index.
const SCAN_MAX: usize = 64;

/// One request's record. Its keys are indices `0..len()` in first-observation order.
///
/// A find tries first the key after the last one found (a request observes its keys again in
/// the order it recorded them: the store after a load of its prefix, the chunks offered again
/// after a match), then a filter of the recorded hashes, then the hash index over the first
/// `indexed` keys and the keys after them one by one, extending the index first when those
/// are more than [`SCAN_MAX`]: a request that never meets a key twice out of order (most
/// requests) never builds it.
#[derive(Debug)]
pub(super) struct Record {
    /// Bumped each time the pool entry is handed out; half of the [`RequestId`].
    serial: u32,
    active: bool,
    /// The manager's cache generation the record belongs to; a record of an older one is
    /// stale (a reset came between) and starts again empty at its next use.
    pub generation: u64,
    /// The keys, back to back.
    keys: Vec<u8>,
    pub entries: Vec<Entry>,
    /// Keys without a position.
    pub unpositioned: usize,
    /// Whether every key was recorded with a position above the one before (so positions are
    /// distinct).
    pub ascending: bool,
    index: HashTable<u32>,
    indexed: usize,
    /// The key after the last one found (the first guess of a find).
    cursor: usize,
    /// One bit per recorded key's hash (bit `hash % FILTER_BITS`).
    filter: [u64; FILTER_BITS / 64],
    /// The policy's request rank (0.33 LRU: an anchor id), [`NO_ID`] until taken.
    pub rank: u32,
    /// The last store offer's number (entries' [`Entry::offer`]).
    offers: u32,
}

impl Default for Record {
    fn default() -> Self {
        Self {
            serial: 0,
            active: false,
            generation: 0,
            keys: Vec::new(),
            entries: Vec::new(),
            unpositioned: 0,
            ascending: true,
            index: HashTable::new(),
            indexed: 0,
            cursor: 0,
            filter: [0; FILTER_BITS / 64],
            rank: NO_ID,
            offers: 0,
        }
    }
}

/// The filter word and bit of `hash`.
#[inline]
fn filter_bit(hash: u64) -> (usize, u64) {
    let b = hash as usize % FILTER_BITS;
    (b / 64, 1 << (b % 64))
}

/// The group of `key`: its last four bytes, big-endian.
#[inline]
fn group_of(key: &[u8]) -> u32 {
    match key.last_chunk::<4>() {
        Some(g) => u32::from_be_bytes(*g),
        None => key.iter().fold(0u32, |acc, &b| acc << 8 | u32::from(b)),
    }
}

impl Record {
    /// Recorded keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The `i`-th recorded key.
    pub fn key(&self, i: usize, key_len: usize) -> &[u8] {
        &self.keys[i * key_len..(i + 1) * key_len]
    }

    /// The index of `key` (hash `hash`), if recorded.
    #[inline(always)]
    pub fn find(&mut self, hash: u64, key: &[u8]) -> Option<u32> {
        let c = self.cursor;
        if let Some(e) = self.entries.get(c)
            && e.hash == hash
            && key_eq(self.key(c, key.len()), key)
        {
            self.cursor = c + 1;
            return Some(c as u32);
        }
        let (w, bit) = filter_bit(hash);
        if self.filter[w] & bit == 0 {
            return None;
        }
        self.find_past_filter(hash, key)
    }

    /// [`Self::find`] past the guess and the filter: through the index and the keys after it.
    #[inline(never)]
    fn find_past_filter(&mut self, hash: u64, key: &[u8]) -> Option<u32> {
        let kl = key.len();
        let entries = &self.entries;
        if entries.len() - self.indexed > SCAN_MAX {
            for i in self.indexed..entries.len() {
                self.index
                    .insert_unique(entries[i].hash, i as u32, |&j| entries[j as usize].hash);
            }
            self.indexed = entries.len();
        }
        let keys = &self.keys;
        let key_of = |i: usize| &keys[i * kl..(i + 1) * kl];
        let found = self
            .index
            .find(hash, |&i| key_eq(key_of(i as usize), key))
            .map(|&i| i as usize)
            .or_else(|| {
                (self.indexed..entries.len())
                    .find(|&i| entries[i].hash == hash && key_eq(key_of(i), key))
            })?;
        self.cursor = found + 1;
        Some(found as u32)
    }

    /// Records `key` (not recorded yet, manager id `id`) with `position`; returns its index.
    #[inline(always)]
    fn push(&mut self, hash: u64, key: &[u8], id: u32, position: u64) -> u32 {
        let i = self.entries.len() as u32;
        let above = self.entries.last().is_none_or(|e| e.position < position);
        self.ascending &= position != NO_POS && above;
        append_key(&mut self.keys, key);
        self.entries.push(Entry {
            hash,
            position,
            id,
            group: group_of(key),
            flags: 0,
            offer: 0,
        });
        if position == NO_POS {
            self.unpositioned += 1;
        }
        let (w, bit) = filter_bit(hash);
        self.filter[w] |= bit;
        i
    }

    /// Records an observation of `key` (hash `hash`, manager id `id`) at `position`; `seen` is
    /// its index if it is recorded ([`Self::find`]). A recorded key keeps its first position
    /// (or takes this one if it had none) and takes `id`; a new key is pushed. Returns the
    /// key's index and whether it is new.
    #[inline(always)]
    pub fn observe(
        &mut self,
        seen: Option<u32>,
        hash: u64,
        key: &[u8],
        id: u32,
        position: u64,
    ) -> (u32, bool) {
        let Some(i) = seen else {
            return (self.push(hash, key, id, position), true);
        };
        let e = &mut self.entries[i as usize];
        if e.position == NO_POS && position != NO_POS {
            e.position = position;
            self.unpositioned -= 1;
        }
        e.id = id;
        (i, false)
    }

    /// Starts a store offer: returns its number, distinct from every [`Entry::offer`] of the
    /// record.
    pub fn begin_offer(&mut self) -> u32 {
        self.offers = self.offers.wrapping_add(1);
        if self.offers == 0 {
            self.entries.iter_mut().for_each(|e| e.offer = 0);
            self.offers = 1;
        }
        self.offers
    }

    /// Empties the record (keeping its buffers) for `generation`.
    fn reset(&mut self, generation: u64) {
        self.generation = generation;
        self.keys.clear();
        if !self.entries.is_empty() {
            self.filter = [0; FILTER_BITS / 64];
        }
        self.entries.clear();
        self.unpositioned = 0;
        self.ascending = true;
        self.index.clear();
        self.indexed = 0;
        self.cursor = 0;
        self.rank = NO_ID;
        self.offers = 0;
    }
}

/// The records of the active requests, pooled.
#[derive(Debug, Default)]
pub(super) struct Records {
    records: Vec<Record>,
    free: Vec<u32>,
    active: usize,
}

impl Records {
    /// A new, empty record of `generation`.
    pub fn begin(&mut self, generation: u64) -> RequestId {
        let i = self.free.pop().unwrap_or_else(|| {
            self.records.push(Record::default());
            self.records.len() as u32 - 1
        });
        let r = &mut self.records[i as usize];
        r.serial = r.serial.wrapping_add(1);
        r.active = true;
        r.reset(generation);
        self.active += 1;
        RequestId(u64::from(r.serial) << 32 | u64::from(i))
    }

    /// The pool index of active request `id`, or an error naming `request`.
    pub fn index(&self, id: RequestId) -> Result<usize> {
        let i = (id.0 & u64::from(u32::MAX)) as usize;
        match self.records.get(i) {
            Some(r) if r.active && u64::from(r.serial) == id.0 >> 32 => Ok(i),
            _ => Err(invalid!(
                "request: {:#x} is not an active request (never begun, or finished)",
                id.0
            )),
        }
    }

    /// Record `i`, emptied first if it is stale (of a generation before `generation`).
    pub fn current(&mut self, i: usize, generation: u64) -> &mut Record {
        let r = &mut self.records[i];
        if r.generation != generation {
            r.reset(generation);
        }
        r
    }

    /// Record `i` as it is.
    pub fn get(&self, i: usize) -> &Record {
        &self.records[i]
    }

    /// Ends request `i`; its record returns to the pool.
    pub fn end(&mut self, i: usize) {
        self.records[i].active = false;
        self.free.push(i as u32);
        self.active -= 1;
    }

    /// Active requests.
    pub fn num_active(&self) -> usize {
        self.active
    }

    /// Checks each active record's buffers, filter and index against its keys (invariant
    /// checks).
    pub fn check(&self, key_len: usize, table: &KeyTable) -> std::result::Result<(), String> {
        for (i, r) in self.records.iter().enumerate().filter(|(_, r)| r.active) {
            let n = r.len();
            if r.keys.len() != n * key_len
                || r.indexed > n
                || r.cursor > n
                || r.index.len() != r.indexed
                || r.entries.iter().filter(|e| e.position == NO_POS).count() != r.unpositioned
            {
                return Err(format!("request record {i}: inconsistent lengths"));
            }
            for (j, e) in r.entries.iter().enumerate() {
                let key = r.key(j, key_len);
                let (w, bit) = filter_bit(e.hash);
                if table.hash(key) != e.hash || e.group != group_of(key) || r.filter[w] & bit == 0 {
                    return Err(format!("request record {i}: key {j} is not filtered"));
                }
                let found = r
                    .index
                    .find(e.hash, |&x| key_eq(r.key(x as usize, key_len), key));
                if (found == Some(&(j as u32))) != (j < r.indexed) {
                    return Err(format!("request record {i}: key {j} is not indexed"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> [u8; 8] {
        i.to_be_bytes()
    }

    /// A spread-out hash, as the key table's would be.
    fn hash(i: u64) -> u64 {
        i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    #[test]
    fn finds_every_recorded_key_whether_the_filter_is_sparse_or_saturated() {
        for n in [1u64, 20, 3000] {
            let mut r = Record::default();
            for i in 0..n {
                let seen = r.find(hash(i), &key(i));
                assert_eq!(seen, None, "{i} of {n} is new");
                assert_eq!(
                    r.observe(seen, hash(i), &key(i), i as u32, i),
                    (i as u32, true)
                );
                // A find now and then builds the index over what was pushed so far.
                if i % 7 == 0 {
                    assert_eq!(r.find(hash(i), &key(i)), Some(i as u32));
                }
            }
            for i in 0..n {
                assert_eq!(r.find(hash(i), &key(i)), Some(i as u32), "{i} of {n}");
            }
            // Absent keys: their hash bits may be set (saturated filter), the index answers.
            for i in n..n + 500 {
                assert_eq!(r.find(hash(i), &key(i)), None);
            }
            // Same hash, other key: the bytes decide.
            assert_eq!(r.find(hash(0), &key(u64::MAX)), None);
            // Few keys are compared one by one, more are indexed.
            let unindexed = n as usize - r.indexed;
            assert!(unindexed <= SCAN_MAX, "{unindexed} of {n} keys not indexed");
            assert_eq!(r.indexed == 0, n as usize <= SCAN_MAX, "{n} keys");
        }
    }

    /// Keys observed again in recorded order are found at the guess; out of order, or a key
    /// whose hash is the guess's, the filter and the scan answer, and the guess follows.
    #[test]
    fn a_find_guesses_the_key_after_the_last_one_found() {
        let mut r = Record::default();
        for i in 0..10 {
            r.observe(None, hash(i), &key(i), i as u32, i);
        }
        for i in 0..10 {
            assert_eq!(r.find(hash(i), &key(i)), Some(i as u32));
            assert_eq!(r.cursor, i as usize + 1);
        }
        assert_eq!(r.find(hash(3), &key(3)), Some(3));
        assert_eq!(r.cursor, 4);
        // The guess's hash with other bytes is not the guess.
        assert_eq!(r.find(hash(4), &key(u64::MAX)), None);
        assert_eq!(r.find(hash(4), &key(4)), Some(4));
        // A key not recorded, past the end: nothing found, nothing indexed.
        assert_eq!(r.find(hash(10), &key(10)), None);
        assert_eq!(r.find(hash(5), &key(5)), Some(5));
        assert_eq!((r.indexed, r.cursor), (0, 6));
    }

    #[test]
    fn a_repeated_observation_keeps_the_first_position_and_takes_the_new_id() {
        let mut r = Record::default();
        r.observe(None, hash(1), &key(1), 5, NO_POS);
        assert_eq!(r.unpositioned, 1);
        let seen = r.find(hash(1), &key(1));
        assert_eq!(r.observe(seen, hash(1), &key(1), 6, 32), (0, false));
        assert_eq!((r.entries[0].position, r.entries[0].id), (32, 6));
        assert_eq!(r.unpositioned, 0);
        let seen = r.find(hash(1), &key(1));
        r.observe(seen, hash(1), &key(1), 7, 48);
        assert_eq!(
            (r.entries[0].position, r.entries[0].id, r.len()),
            (32, 7, 1)
        );
        // The group is the key's last four bytes.
        assert_eq!(r.entries[0].group, 1);
        r.reset(1);
        assert_eq!((r.len(), r.indexed, r.find(hash(1), &key(1))), (0, 0, None));
    }
}

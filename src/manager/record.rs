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

/// Words (of 64 bits) of a record's filter of key hashes at first; the filter grows fourfold
/// whenever its keys exceed one in [`FILTER_BITS_PER_KEY`] bits, so that a key not recorded
/// passes it rarely whatever the record's length.
const FILTER_MIN_WORDS: usize = 64;
const FILTER_BITS_PER_KEY: usize = 16;

/// Records of at most this many keys clear their filter word by word at a reset.
const FILTER_CLEAR_KEYS: usize = 32;

/// Keys past the hash index that a find compares one by one; with more, it extends the index.
const SCAN_MAX: usize = 1024;

/// One request's record. Its keys are indices `0..len()` in first-observation order.
///
/// A find tries first the key after the last one found (a request observes its keys again in
/// the order it recorded them: the store after a load of its prefix, the chunks offered again
/// after a match), then a filter of the recorded hashes, then the hash index over the first
/// `indexed` keys and the keys after them one by one, extending the index first when those
/// are more than [`SCAN_MAX`]: a request that never meets a key twice out of order (most
/// requests) never builds it.
#[derive(Debug)]
#[repr(C, align(64))]
pub(super) struct Record {
    // Laid out for a request's calls: its first cache line holds what a call to the record
    // reads first and what a commit reads, then come the other buffers' headers, the filter last.
    /// Bumped each time the pool entry is handed out; half of the [`RequestId`].
    serial: u32,
    /// The policy's request rank (0.33 LRU: an anchor id), [`NO_ID`] until taken.
    pub rank: u32,
    /// The last store offer's number.
    offers: u32,
    /// Keys without a position.
    pub unpositioned: u32,
    active: bool,
    /// Whether every key was recorded with a position above the one before (so positions are
    /// distinct).
    pub ascending: bool,
    /// Whether a bit of the filter may belong to no recorded key ([`Self::leave_out`]).
    loose: bool,
    /// The filter's words: [`FILTER_MIN_WORDS`] while it is `filter`, more once it is
    /// `big_filter` (kept in the first line: every [`Self::claim`] asks, and a record whose
    /// filter has not grown reads nothing of `big_filter`).
    words: u32,
    /// The manager's cache generation the record belongs to; a record of an older one is
    /// stale (a reset came between) and starts again empty at its next use.
    pub generation: u64,
    /// The keys `inserted.start..inserted.end` are those the record's last store inserted,
    /// in its order, and the policy's order version was `inserted_version` right after it
    /// (an empty range: the last store inserted others, or none).
    pub inserted: std::ops::Range<u32>,
    /// What the record holds of each key (its hash first); then their bytes, back to back.
    pub entries: Vec<Entry>,
    keys: Vec<u8>,
    /// The key after the last one found (the first guess of a find).
    cursor: usize,
    indexed: usize,
    big_filter: Vec<u64>,
    pub inserted_version: u64,
    index: HashTable<u32>,
    /// One bit per recorded key's hash (bit `hash % bits`), and per key [`Self::claim`]ed:
    /// `filter` while [`Self::words`] is [`FILTER_MIN_WORDS`], else `big_filter` (a power of
    /// two words).
    filter: [u64; FILTER_MIN_WORDS],
}

// A record's first cache line holds what a commit reads (see the layout of [`Record`]).
const _: () =
    assert!(std::mem::offset_of!(Record, entries) + std::mem::size_of::<Vec<Entry>>() <= 64);

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
            filter: [0; FILTER_MIN_WORDS],
            big_filter: Vec::new(),
            loose: false,
            words: FILTER_MIN_WORDS as u32,
            rank: NO_ID,
            offers: 0,
            inserted: 0..0,
            inserted_version: 0,
        }
    }
}

/// The keys of a call, as a record appends a run of them: the call's `keys` (`key_len` bytes
/// each) with their hashes, manager ids and positions (empty: none).
#[derive(Debug, Clone, Copy)]
pub(super) struct Run<'k> {
    pub keys: &'k [u8],
    pub key_len: usize,
    pub hashes: &'k [u64],
    pub ids: &'k [u32],
    pub positions: &'k [u64],
}

/// What a record holds of one key besides its bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    /// The key's hash (the key table's).
    pub hash: u64,
    /// Its position ([`NO_POS`]: none).
    pub position: u64,
    /// The manager id the key had when last seen (a hint: the commit takes a slot whose key is
    /// still this one without a lookup, and looks up the others).
    pub id: u32,
    /// [`INSERTED`], [`REUSED`], [`STORE_MISS`].
    pub flags: u8,
    /// The record's store offer ([`Record::begin_offer`]) that last made the key a candidate;
    /// 0: none.
    pub offer: u32,
}

/// Where [`Record::append_with_ids`] takes the keys' ids from.
#[derive(Clone, Copy)]
enum Ids<'a> {
    /// The run's `ids`, by input index.
    OfRun,
    /// One per appended key, in order.
    Given(&'a [u32]),
}

/// The filter word and bit of `hash`.
#[inline]
fn filter_bit(hash: u64, words: usize) -> (usize, u64) {
    let b = hash as usize & (words * 64 - 1);
    (b / 64, 1 << (b % 64))
}

/// The first `i` with `entries[i].hash == hash` and `is_key(i)`: eight hashes compared at a
/// time.
#[inline]
fn scan(entries: &[Entry], hash: u64, is_key: impl Fn(usize) -> bool) -> Option<usize> {
    for (c, chunk) in entries.chunks(8).enumerate() {
        if chunk.iter().fold(false, |any, e| any | (e.hash == hash)) {
            let mut at = (c * 8..).zip(chunk).filter(|&(_, e)| e.hash == hash);
            if let Some((i, _)) = at.find(|&(i, _)| is_key(i)) {
                return Some(i);
            }
        }
    }
    None
}

/// The group of `key`: its last four bytes, big-endian.
#[inline]
pub(super) fn group_of(key: &[u8]) -> u32 {
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
        let (w, bit) = filter_bit(hash, self.words as usize);
        if *self.filter_word(w) & bit == 0 {
            return None;
        }
        self.find_past_filter(hash, key)
    }

    /// Sets the filter bit of `hash`; true if it was clear: then no recorded key, and no key
    /// claimed before, has this hash (a caller recording keys in runs tells a new key by it).
    #[inline(always)]
    pub fn claim(&mut self, hash: u64) -> bool {
        let (w, bit) = filter_bit(hash, self.words as usize);
        let f = self.filter_word(w);
        let clear = *f & bit == 0;
        *f |= bit;
        clear
    }

    /// A key [`Self::claim`]ed is not going to be recorded.
    pub fn leave_out(&mut self) {
        self.loose = true;
    }

    /// Whether the filter is `big_filter`.
    #[inline(always)]
    fn is_big(&self) -> bool {
        self.words as usize != FILTER_MIN_WORDS
    }

    /// The filter's words (invariant checks).
    fn filter_words(&self) -> &[u64] {
        match self.is_big() {
            false => &self.filter,
            true => &self.big_filter,
        }
    }

    /// Word `w` of the filter; `big_filter`'s through a call, so that a record whose filter
    /// has not grown loads none of its fields.
    #[inline(always)]
    fn filter_word(&mut self, w: usize) -> &mut u64 {
        match self.is_big() {
            false => &mut self.filter[w],
            true => self.big_filter_word(w),
        }
    }

    #[inline(never)]
    fn big_filter_word(&mut self, w: usize) -> &mut u64 {
        &mut self.big_filter[w]
    }

    /// [`Self::find`] past the guess and the filter: through the index and the keys after it.
    #[inline(never)]
    fn find_past_filter(&mut self, hash: u64, key: &[u8]) -> Option<u32> {
        let kl = key.len();
        let (n, entries) = (self.len(), &self.entries);
        if n - self.indexed > SCAN_MAX {
            for (i, e) in entries.iter().enumerate().skip(self.indexed) {
                self.index
                    .insert_unique(e.hash, i as u32, |&j| entries[j as usize].hash);
            }
            self.indexed = n;
        }
        let keys = &self.keys;
        let key_of = |i: usize| &keys[i * kl..(i + 1) * kl];
        let found = match self.index.find(hash, |&i| key_eq(key_of(i as usize), key)) {
            Some(&i) => i as usize,
            None => scan(&entries[self.indexed..n], hash, |i| {
                key_eq(key_of(self.indexed + i), key)
            })
            .map(|i| self.indexed + i)?,
        };
        self.cursor = found + 1;
        Some(found as u32)
    }

    /// Records `key` (not recorded yet, manager id `id`) with `position`; returns its index.
    #[inline(always)]
    fn push(&mut self, hash: u64, key: &[u8], id: u32, position: u64) -> u32 {
        let i = self.len() as u32;
        let above = self.entries.last().is_none_or(|e| e.position < position);
        self.ascending &= position != NO_POS && above;
        append_key(&mut self.keys, key);
        self.entries.push(Entry {
            hash,
            position,
            id,
            flags: 0,
            offer: 0,
        });
        if position == NO_POS {
            self.unpositioned += 1;
        }
        let (w, bit) = filter_bit(hash, self.words as usize);
        *self.filter_word(w) |= bit;
        self.fit_filter();
        i
    }

    /// Grows the filter when the keys exceed one in [`FILTER_BITS_PER_KEY`] of its bits, with
    /// the bits of every recorded key (and none of the keys claimed and not recorded).
    #[inline(always)]
    fn fit_filter(&mut self) {
        if self.len() * FILTER_BITS_PER_KEY > self.words as usize * 64 {
            self.grow_filter();
        }
    }

    #[cold]
    #[inline(never)]
    fn grow_filter(&mut self) {
        let mut words = self.words as usize;
        while self.len() * FILTER_BITS_PER_KEY > words * 64 {
            words *= 4;
        }
        self.big_filter.clear();
        self.big_filter.resize(words, 0);
        for e in &self.entries {
            let (w, bit) = filter_bit(e.hash, words);
            self.big_filter[w] |= bit;
        }
        self.words = u32::try_from(words).expect("a record's filter has fewer than 2^32 words");
        self.loose = false;
    }

    /// Records the keys `indices` (ascending) of `run` (each [`Self::claim`]ed, none recorded
    /// yet, none twice) in order, each with `flags` and store offer `offer`; returns the index
    /// of the first.
    pub fn append(&mut self, run: Run<'_>, indices: &[u32], flags: u8, offer: u32) -> u32 {
        self.append_with_ids(run, indices, flags, offer, Ids::OfRun)
    }

    /// [`Self::append`] of keys a store has just inserted: the `j`-th key of `indices` is
    /// recorded with `slots[j]` as its id.
    pub fn append_inserted(
        &mut self,
        run: Run<'_>,
        indices: &[u32],
        slots: &[u32],
        flags: u8,
        offer: u32,
    ) -> u32 {
        debug_assert_eq!(indices.len(), slots.len());
        self.append_with_ids(run, indices, flags, offer, Ids::Given(slots))
    }

    /// [`Self::append`] with the keys' ids from `ids`.
    #[inline(always)]
    fn append_with_ids(
        &mut self,
        run: Run<'_>,
        indices: &[u32],
        flags: u8,
        offer: u32,
        ids: Ids<'_>,
    ) -> u32 {
        let (base, m) = (self.len(), indices.len());
        let (Some(&a), Some(&b)) = (indices.first(), indices.last()) else {
            return base as u32;
        };
        let (kl, before) = (run.key_len, self.entries.last().map(|e| e.position));
        let position = |i: usize| run.positions.get(i).copied().unwrap_or(NO_POS);
        if b - a + 1 == m as u32 && m > 4 {
            // A longer contiguous run of the call's keys (the usual case): one copy of their
            // bytes and one pass writing their entries; a short run is copied key by key
            // (cheaper than calls to copy).
            let r = a as usize..b as usize + 1;
            self.keys
                .extend_from_slice(&run.keys[r.start * kl..r.end * kl]);
            let ids = match ids {
                Ids::OfRun => &run.ids[r.clone()],
                Ids::Given(ids) => &ids[..m],
            };
            let hashes = run.hashes[r.clone()].iter().zip(ids);
            let entry = |(&hash, &id), position| Entry {
                hash,
                position,
                id,
                flags,
                offer,
            };
            match run.positions.get(r) {
                Some(p) => self
                    .entries
                    .extend(hashes.zip(p).map(|(h, &p)| entry(h, p))),
                None => self.entries.extend(hashes.map(|h| entry(h, NO_POS))),
            }
        } else {
            for (j, &i) in indices.iter().enumerate() {
                let i = i as usize;
                append_key(&mut self.keys, &run.keys[i * kl..(i + 1) * kl]);
                let id = match ids {
                    Ids::OfRun => run.ids[i],
                    Ids::Given(ids) => ids[j],
                };
                self.entries.push(Entry {
                    hash: run.hashes[i],
                    position: position(i),
                    id,
                    flags,
                    offer,
                });
            }
        }
        // Positions are given for every key of a run or for none.
        if run.positions.is_empty() {
            self.unpositioned += m as u32;
            self.ascending = false;
        } else if self.ascending {
            let new = &self.entries[base..];
            self.ascending = before.is_none_or(|p| p < new[0].position)
                && new.is_sorted_by(|x, y| x.position < y.position);
        }
        self.fit_filter();
        base as u32
    }

    /// [`Self::append`] of the keys `pending[*done..]`, then `*done = pending.len()`; returns
    /// the index of the first and whether there was any.
    #[inline(always)]
    pub fn append_pending(
        &mut self,
        run: Run<'_>,
        pending: &[u32],
        done: &mut usize,
        flags: u8,
        offer: u32,
    ) -> (u32, bool) {
        let from = std::mem::replace(done, pending.len());
        if from == pending.len() {
            return (self.len() as u32, false);
        }
        (self.append(run, &pending[from..], flags, offer), true)
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

    /// Notes that a store inserted the keys `indices` (in its order) and left the policy's
    /// order at `version`: kept when they are the record's last keys, in order.
    pub fn note_inserted(&mut self, indices: &[u32], version: u64) {
        let n = self.len() as u32;
        self.inserted = match (indices.first(), indices.last()) {
            (Some(&a), Some(&b))
                if b + 1 == n
                    && (b - a) as usize + 1 == indices.len()
                    && indices.is_sorted_by(|x, y| x < y) =>
            {
                a..n
            }
            _ => 0..0,
        };
        self.inserted_version = version;
    }

    /// The keys of [`Self::note_inserted`] if they are still the record's last and none of
    /// them was reused since.
    pub fn inserted_tail(&self) -> Option<std::ops::Range<u32>> {
        let r = self.inserted.clone();
        let fresh = |e: &Entry| e.flags & (INSERTED | REUSED) == INSERTED;
        (!r.is_empty() && r.end as usize == self.len())
            .then_some(r)
            .filter(|r| self.entries[r.start as usize..].iter().all(fresh))
    }

    /// Starts a store offer: returns its number, distinct from every [`Self::offer_of`] of the
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
        if self.is_big() {
            self.words = FILTER_MIN_WORDS as u32;
            self.big_filter.clear();
            self.filter = [0; FILTER_MIN_WORDS];
        } else if self.loose || self.len() > FILTER_CLEAR_KEYS {
            self.filter = [0; FILTER_MIN_WORDS];
        } else {
            for e in &self.entries {
                self.filter[filter_bit(e.hash, FILTER_MIN_WORDS).0] = 0;
            }
        }
        self.loose = false;
        self.keys.clear();
        self.entries.clear();
        self.unpositioned = 0;
        self.ascending = true;
        self.index.clear();
        self.indexed = 0;
        self.cursor = 0;
        self.rank = NO_ID;
        self.offers = 0;
        self.inserted = 0..0;
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
        let i = self.index_of(id);
        match self.records.get(i) {
            Some(r) if r.active && u64::from(r.serial) == id.0 >> 32 => Ok(i),
            _ => Err(invalid!(
                "request: {:#x} is not an active request (never begun, or finished)",
                id.0
            )),
        }
    }

    /// The pool index of `id`, an active request (not checked).
    #[inline]
    pub fn index_of(&self, id: RequestId) -> usize {
        (id.0 & u64::from(u32::MAX)) as usize
    }

    /// Record `i`, emptied first if it is stale (of a generation before `generation`).
    #[inline]
    pub fn current(&mut self, i: usize, generation: u64) -> &mut Record {
        let r = &mut self.records[i];
        if r.generation != generation {
            r.reset(generation);
        }
        r
    }

    /// Record `i` as it is, current (see [`Self::current`]).
    #[inline]
    pub fn get_mut(&mut self, i: usize) -> &mut Record {
        &mut self.records[i]
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
            let positions = || r.entries.iter().map(|e| e.position);
            if r.keys.len() != n * key_len
                || r.entries.len() != n
                || r.is_big() == r.big_filter.is_empty()
                || r.words as usize != r.filter_words().len()
                || r.indexed > n
                || r.cursor > n
                || r.index.len() != r.indexed
                || positions().filter(|&p| p == NO_POS).count() != r.unpositioned as usize
                || r.ascending && !(r.unpositioned == 0 && positions().is_sorted_by(|a, b| a < b))
            {
                return Err(format!("request record {i}: inconsistent lengths"));
            }
            for (j, &Entry { hash: h, .. }) in r.entries.iter().enumerate() {
                let key = r.key(j, key_len);
                let f = r.filter_words();
                let (w, bit) = filter_bit(h, f.len());
                if table.hash(key) != h || f[w] & bit == 0 {
                    return Err(format!("request record {i}: key {j} is not filtered"));
                }
                let found = r
                    .index
                    .find(h, |&x| key_eq(r.key(x as usize, key_len), key));
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

    /// A filter that grew serves the record's next request only as long as it is needed: the
    /// reset goes back to the inline filter, which then answers alone.
    #[test]
    fn a_reset_after_the_filter_grew_starts_again_with_the_inline_filter() {
        let mut r = Record::default();
        let n = (FILTER_MIN_WORDS * 64 / FILTER_BITS_PER_KEY) as u64 + 1;
        for i in 0..n {
            assert!(r.claim(hash(i)), "{i} is claimed first");
            r.observe(None, hash(i), &key(i), i as u32, i);
        }
        assert!(r.is_big() && r.words as usize == r.big_filter.len());
        assert!(
            (0..n).all(|i| !r.claim(hash(i))),
            "every recorded key is claimed"
        );
        r.reset(1);
        assert!(!r.is_big() && r.big_filter.is_empty() && r.len() == 0);
        assert_eq!(r.find(hash(0), &key(0)), None);
        for i in [5u64, 9] {
            assert!(r.claim(hash(n + i)) && !r.claim(hash(n + i)));
            r.observe(None, hash(n + i), &key(n + i), 0, i);
        }
        assert_eq!(r.find(hash(n + 9), &key(n + 9)), Some(1));
        assert_eq!(r.find(hash(n + 5), &key(n + 5)), Some(0));
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
        assert_eq!(group_of(r.key(0, 8)), 1);
        r.reset(1);
        assert_eq!((r.len(), r.indexed, r.find(hash(1), &key(1))), (0, 0, None));
    }
}

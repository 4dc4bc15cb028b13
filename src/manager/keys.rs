//! Fixed-width byte keys mapped to dense `u32` ids. Each id's record (the key's hash, then its
//! bytes) lies in one arena indexed by id, so a lookup touches one record line, and removal and
//! growth never rehash. No allocation per key once the arena has grown to its working size.

use crate::error::{Error, Result};
use foldhash::quality::RandomState;
use hashbrown::HashTable;
use std::hash::{BuildHasher, Hasher};

/// A map from keys of `key_len` bytes to ids; the caller chooses the ids.
#[derive(Clone)]
pub(crate) struct KeyTable {
    key_len: usize,
    /// Bytes per record: the 8-byte hash, the key, padding to a multiple of 8.
    stride: usize,
    arena: Vec<u8>,
    table: HashTable<u32>,
    hasher: RandomState,
    /// Bumped by every change of the key → id mapping (for callers that cache lookups).
    version: u64,
    /// The table's memory as of the last insert, for [`Self::prefetch`]: the address where
    /// hashbrown's buckets end and its control bytes begin, and the bucket mask (0, 0: unknown).
    layout: (usize, usize),
}

/// Key equality with fixed-size loads for the common widths (no `memcmp` call).
#[inline(always)]
pub(crate) fn key_eq(a: &[u8], b: &[u8]) -> bool {
    #[inline(always)]
    fn words<const N: usize>(a: &[u8], b: &[u8]) -> bool {
        let (a, b): (&[u8; N], &[u8; N]) = (a.try_into().unwrap(), b.try_into().unwrap());
        a == b
    }
    match a.len() {
        8 if b.len() == 8 => words::<8>(a, b),
        16 if b.len() == 16 => words::<16>(a, b),
        32 if b.len() == 32 => words::<32>(a, b),
        _ => a == b,
    }
}

/// Copies a key with fixed-size moves for the common widths (no `memcpy` call).
#[inline(always)]
pub(crate) fn copy_key(dst: &mut [u8], src: &[u8]) {
    #[inline(always)]
    fn words<const N: usize>(dst: &mut [u8], src: &[u8]) {
        let s: &[u8; N] = src.try_into().unwrap();
        let d: &mut [u8; N] = dst.try_into().unwrap();
        *d = *s;
    }
    match (dst.len(), src.len()) {
        (8, 8) => words::<8>(dst, src),
        (16, 16) => words::<16>(dst, src),
        (32, 32) => words::<32>(dst, src),
        _ => dst.copy_from_slice(src),
    }
}

/// Appends a key to `buf` with fixed-size moves for the common widths (no `memcpy` call).
#[inline(always)]
pub(crate) fn append_key(buf: &mut Vec<u8>, key: &[u8]) {
    #[inline(always)]
    fn words<const N: usize>(buf: &mut Vec<u8>, key: &[u8]) {
        let k: &[u8; N] = key.try_into().unwrap();
        buf.extend_from_slice(k);
    }
    match key.len() {
        8 => words::<8>(buf, key),
        16 => words::<16>(buf, key),
        32 => words::<32>(buf, key),
        _ => buf.extend_from_slice(key),
    }
}

/// Tables with fewer buckets (with their records, about a megabyte) stay in the CPU caches:
/// no prefetching.
const PREFETCH_MIN_BUCKETS: usize = 1 << 16;

/// Bytes per hashbrown bucket (a `u32` id).
const BUCKET: usize = size_of::<u32>();

/// A hint to load the cache line holding `addr`.
#[inline(always)]
fn prefetch_line(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch only hints the cache; it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::without_provenance(addr)) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

/// The index room reserved for `keys` keys: 5/2 of them, so that the table stays at most two
/// fifths full. The tier's index churns (an evicting store inserts one key and removes
/// another), and in sparse groups a removal leaves an empty bucket rather than a tombstone that
/// lengthens later probes.
fn index_room(keys: usize) -> usize {
    keys.saturating_mul(5) / 2
}

#[inline(always)]
fn record_key(arena: &[u8], stride: usize, key_len: usize, id: u32) -> &[u8] {
    let at = id as usize * stride + 8;
    &arena[at..at + key_len]
}

#[inline(always)]
fn record_hash(arena: &[u8], stride: usize, id: u32) -> u64 {
    let at = id as usize * stride;
    u64::from_ne_bytes(arena[at..at + 8].try_into().unwrap())
}

impl KeyTable {
    /// A table for ids below `capacity` (the arena grows beyond it on demand). Fails with
    /// [`Error::OutOfMemory`] when the memory cannot be reserved.
    pub fn new(key_len: usize, capacity: usize) -> Result<Self> {
        Self::with_hasher(key_len, capacity, RandomState::default())
    }

    /// Reserves room for `extra` more entries, with ids up to `capacity + extra`, without
    /// touching the arena (it is used as they come); the index gets the headroom of
    /// [`Self::new`] for all ids, so it never grows. Fails with [`Error::OutOfMemory`].
    pub fn reserve_more(&mut self, extra: usize) -> Result<()> {
        let oom = || Error::OutOfMemory(format!("key table room for {extra} more keys"));
        let bytes = extra.checked_mul(self.stride).ok_or_else(oom)?;
        self.arena.try_reserve_exact(bytes).map_err(|_| oom())?;
        let keys = self.arena.capacity() / self.stride;
        let (arena, stride) = (&self.arena, self.stride);
        let more = index_room(keys).saturating_sub(self.table.len());
        self.table
            .try_reserve(more, |&i| record_hash(arena, stride, i))
            .map_err(|_| oom())
    }

    /// A table hashing like `self`, so one hash serves both.
    pub fn sibling(&self, capacity: usize) -> Result<Self> {
        Self::with_hasher(self.key_len, capacity, self.hasher.clone())
    }

    fn with_hasher(key_len: usize, capacity: usize, hasher: RandomState) -> Result<Self> {
        let oom = |what: &str| {
            Error::OutOfMemory(format!("{what} for {capacity} keys of {key_len} bytes"))
        };
        let stride = (8 + key_len).next_multiple_of(8);
        let mut arena = Vec::new();
        let bytes = stride
            .checked_mul(capacity)
            .ok_or_else(|| oom("key arena"))?;
        arena
            .try_reserve_exact(bytes)
            .map_err(|_| oom("key arena"))?;
        arena.resize(bytes, 0);
        let mut table = HashTable::new();
        table
            .try_reserve(index_room(capacity), |_: &u32| 0)
            .map_err(|_| oom("key table"))?;
        Ok(Self {
            key_len,
            stride,
            arena,
            table,
            hasher,
            layout: (0, 0),
            version: 0,
        })
    }

    /// Hash of a key: its bytes only (keys have one fixed width, so no length prefix); 8-byte
    /// keys as one word.
    #[inline]
    pub fn hash(&self, key: &[u8]) -> u64 {
        let mut h = self.hasher.build_hasher();
        match <[u8; 8]>::try_from(key) {
            Ok(word) => h.write_u64(u64::from_ne_bytes(word)),
            Err(_) => h.write(key),
        }
        h.finish()
    }

    /// The bytes of the key stored under `id`.
    #[inline]
    pub fn key(&self, id: u32) -> &[u8] {
        record_key(&self.arena, self.stride, self.key_len, id)
    }

    /// The hash of the key stored under `id`.
    #[inline]
    pub fn stored_hash(&self, id: u32) -> u64 {
        record_hash(&self.arena, self.stride, id)
    }

    #[inline]
    pub fn find_hashed(&self, hash: u64, key: &[u8]) -> Option<u32> {
        let (arena, stride, kl) = (&self.arena, self.stride, self.key_len);
        self.table
            .find(hash, |&id| key_eq(record_key(arena, stride, kl, id), key))
            .copied()
    }

    /// Finds each key of `keys` (back to back, with their `hashes`) in order and appends
    /// `id_of(its id)` (`None`: absent) to `ids`. On large tables the index lines of all keys
    /// are prefetched first, so that their misses overlap.
    #[inline]
    pub fn find_all_hashed(
        &self,
        keys: &[u8],
        hashes: &[u64],
        ids: &mut Vec<u32>,
        id_of: impl Fn(Option<u32>) -> u32,
    ) {
        let (arena, stride, kl) = (&self.arena, self.stride, self.key_len);
        if self.layout.1 >= PREFETCH_MIN_BUCKETS {
            hashes.iter().for_each(|&h| self.prefetch(h, false));
        }
        // This closure type is find_all_hashed's own, which keeps hashbrown's probe inlined
        // here (shared with other callers, it would stay a call).
        let found = keys.chunks_exact(kl).zip(hashes).map(|(key, &h)| {
            let id = self
                .table
                .find(h, |&id| key_eq(record_key(arena, stride, kl, id), key));
            id_of(id.copied())
        });
        ids.extend(found);
    }

    /// The record of `id`, growing the arena if needed.
    fn record_mut(&mut self, id: u32) -> &mut [u8] {
        let at = id as usize * self.stride;
        if self.arena.len() < at + self.stride {
            // Doubling, but within the reserved capacity when that suffices (no copy).
            let want = (at + self.stride).max(self.arena.len() * 2);
            let fit = self.arena.capacity().max(at + self.stride);
            self.arena.resize(want.min(fit), 0);
        }
        &mut self.arena[at..at + self.stride]
    }

    /// Bumps the version for a change of the key → id mapping made outside the table (a
    /// caller that maps ids further, like ARC's ghosts).
    pub fn note_change(&mut self) {
        self.version += 1;
    }

    /// Stores `key` (which must be absent) under `id`.
    #[inline(always)]
    pub fn insert_hashed(&mut self, hash: u64, id: u32, key: &[u8]) {
        self.version += 1;
        let (stride, kl) = (self.stride, self.key_len);
        let record = self.record_mut(id);
        record[..8].copy_from_slice(&hash.to_ne_bytes());
        copy_key(&mut record[8..8 + kl], key);
        let arena = &self.arena;
        let entry = self
            .table
            .insert_unique(hash, id, |&i| record_hash(arena, stride, i));
        // The table's memory moves only when it grows (to more buckets).
        let buckets = entry.into_table().num_buckets();
        if buckets != self.layout.1 + 1 && buckets > PREFETCH_MIN_BUCKETS {
            self.note_layout(hash, id);
        }
    }

    /// Records where the table's memory is (for [`Self::prefetch`]), from the entry of `id`.
    #[cold]
    fn note_layout(&mut self, hash: u64, id: u32) {
        let i = self
            .table
            .find_bucket_index(hash, |&x| x == id)
            .expect("just inserted");
        let at = (self.table.get_bucket(i).expect("full") as *const u32).addr() + (i + 1) * BUCKET;
        self.layout = (at, self.table.num_buckets() - 1);
    }

    /// Starts loading the index lines that a lookup of `hash` reads first (its control group),
    /// so that the misses of many keys overlap; with `buckets`, also the buckets beside it, which
    /// a hit or an insert reads or writes. Relies on hashbrown's layout (bucket `i` just below
    /// the control bytes, at `i + 1` buckets from their start; probing starts at `hash & mask`);
    /// if that ever changes, only speed suffers: a prefetch never faults. Small tables (in the
    /// CPU caches anyway) are not prefetched.
    #[inline]
    pub fn prefetch(&self, hash: u64, buckets: bool) {
        let (end, mask) = self.layout;
        if !self.prefetches() {
            return;
        }
        let pos = hash as usize & mask;
        prefetch_line(end.wrapping_add(pos));
        if buckets {
            prefetch_line(end.wrapping_sub((pos + 16) * BUCKET));
            prefetch_line(end.wrapping_sub(pos * BUCKET + 1));
        }
    }

    /// Whether [`Self::prefetch`] does anything: false for small tables (a caller can skip
    /// hashing for it).
    #[inline]
    pub fn prefetches(&self) -> bool {
        self.layout.1 >= PREFETCH_MIN_BUCKETS
    }

    /// Starts loading what removing the entries of `ids` reads (their records, then their index
    /// lines), all ids' misses overlapping. Small tables are not prefetched.
    pub fn prefetch_entries(&self, ids: impl Iterator<Item = u32> + Clone) {
        if self.layout.1 < PREFETCH_MIN_BUCKETS {
            return;
        }
        let base = self.arena.as_ptr().addr();
        for id in ids.clone() {
            prefetch_line(base + id as usize * self.stride);
        }
        for id in ids {
            self.prefetch(self.stored_hash(id), true);
        }
    }

    /// Removes the entry of `id`; returns whether it was present.
    #[inline]
    pub fn remove_id(&mut self, id: u32) -> bool {
        self.version += 1;
        match self.table.find_entry(self.stored_hash(id), |&i| i == id) {
            Ok(e) => {
                e.remove();
                true
            }
            Err(_) => false,
        }
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn clear(&mut self) {
        self.version += 1;
        self.table.clear();
    }

    /// Changes whenever the key → id mapping may have changed.
    #[inline]
    pub fn version(&self) -> u64 {
        self.version
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Structured keys (counters in big-endian bytes, like trace ids) spread over the index as
    /// random keys would: the low hash bits the index uses take about 1 - 1/e of the
    /// possible values over as many keys as buckets, whatever the process's random seed.
    #[test]
    fn structured_keys_spread_like_random_ones() {
        for _ in 0..8 {
            let t = KeyTable::new(8, 1).unwrap();
            let n = 1usize << 14;
            let mut seen = vec![false; n];
            for id in 0..n as u64 {
                seen[t.hash(&id.to_be_bytes()) as usize & (n - 1)] = true;
            }
            let distinct = seen.iter().filter(|&&b| b).count();
            assert!(distinct * 100 > n * 60, "{distinct} distinct of {n}");
        }
    }

    /// `reserve_more` reserves index room with the same headroom as `new`: filling every id
    /// never grows (rehashes) the table.
    #[test]
    fn reserved_ids_fit_without_growth() {
        let mut t = KeyTable::new(8, 1000).unwrap();
        t.reserve_more(2000).unwrap();
        let buckets = t.table.num_buckets();
        assert!(t.table.capacity() >= index_room(3000));
        for id in 0..3000u32 {
            let key = u64::from(id).to_le_bytes();
            t.insert_hashed(t.hash(&key), id, &key);
        }
        assert_eq!(t.table.num_buckets(), buckets);
    }

    /// The layout `prefetch` assumes holds for the hashbrown in use: bucket `i` lies `i + 1`
    /// buckets below the recorded address, and probing starts in the group at `hash & mask`.
    #[test]
    fn prefetch_layout_matches_hashbrown() {
        // Large enough to be prefetched (small tables are not).
        let mut t = KeyTable::new(8, 70_000).unwrap();
        for id in 0..1000u32 {
            let key = u64::from(id).to_le_bytes();
            t.insert_hashed(t.hash(&key), id, &key);
        }
        let (end, mask) = t.layout;
        assert_eq!(mask + 1, t.table.num_buckets());
        for id in (0..1000u32).step_by(37) {
            let key = u64::from(id).to_le_bytes();
            let h = t.hash(&key);
            let i = t.table.find_bucket_index(h, |&x| x == id).unwrap();
            let at = (t.table.get_bucket(i).unwrap() as *const u32).addr();
            assert_eq!(at, end - (i + 1) * BUCKET);
            // Probing is triangular from `h & mask`: at this load, within a few groups.
            assert!(
                (i.wrapping_sub(h as usize & mask) & mask) < 16 * 8,
                "bucket {i}"
            );
        }
    }
}

//! Fixed-width byte keys mapped to dense `u32` ids. Each id's record (the key's hash, then its
//! bytes) lies in one arena indexed by id, so a lookup touches one record line, and removal and
//! growth never rehash. No allocation per key once the arena has grown to its working size.

use crate::error::{Error, Result};
use hashbrown::{DefaultHashBuilder, HashTable};
use std::hash::{BuildHasher, Hasher};

/// A map from keys of `key_len` bytes to ids; the caller chooses the ids.
#[derive(Clone)]
pub(crate) struct KeyTable {
    key_len: usize,
    /// Bytes per record: the 8-byte hash, the key, padding to a multiple of 8.
    stride: usize,
    arena: Vec<u8>,
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
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
        Self::with_hasher(key_len, capacity, DefaultHashBuilder::default())
    }

    /// A table hashing like `self`, so one hash serves both.
    pub fn sibling(&self, capacity: usize) -> Result<Self> {
        Self::with_hasher(self.key_len, capacity, self.hasher.clone())
    }

    fn with_hasher(key_len: usize, capacity: usize, hasher: DefaultHashBuilder) -> Result<Self> {
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
            .try_reserve(capacity, |_: &u32| 0)
            .map_err(|_| oom("key table"))?;
        Ok(Self {
            key_len,
            stride,
            arena,
            table,
            hasher,
        })
    }

    /// Hash of a key: its bytes only (keys have one fixed width, so no length prefix).
    #[inline]
    pub fn hash(&self, key: &[u8]) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write(key);
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
    pub fn find(&self, key: &[u8]) -> Option<u32> {
        self.find_hashed(self.hash(key), key)
    }

    #[inline]
    pub fn find_hashed(&self, hash: u64, key: &[u8]) -> Option<u32> {
        let (arena, stride, kl) = (&self.arena, self.stride, self.key_len);
        self.table
            .find(hash, |&id| key_eq(record_key(arena, stride, kl, id), key))
            .copied()
    }

    /// Stores `key` (which must be absent) under `id`.
    pub fn insert_hashed(&mut self, hash: u64, id: u32, key: &[u8]) {
        let (stride, kl) = (self.stride, self.key_len);
        let at = id as usize * stride;
        if self.arena.len() < at + stride {
            self.arena
                .resize((at + stride).max(self.arena.len() * 2), 0);
        }
        let record = &mut self.arena[at..at + stride];
        record[..8].copy_from_slice(&hash.to_ne_bytes());
        copy_key(&mut record[8..8 + kl], key);
        let arena = &self.arena;
        self.table
            .insert_unique(hash, id, |&i| record_hash(arena, stride, i));
    }

    /// Removes the entry of `id`; returns whether it was present.
    pub fn remove_id(&mut self, id: u32) -> bool {
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
        self.table.clear();
    }
}

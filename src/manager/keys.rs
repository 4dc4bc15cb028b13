//! Fixed-width byte keys mapped to dense `u32` ids, with the key bytes stored in one arena
//! indexed by id. No allocation per key once the arena has grown to its working size.

use hashbrown::{DefaultHashBuilder, HashTable};
use std::hash::BuildHasher;

/// A map from keys of `key_len` bytes to ids; the caller chooses the ids.
#[derive(Clone)]
pub(crate) struct KeyTable {
    key_len: usize,
    arena: Vec<u8>,
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
}

impl KeyTable {
    /// A table whose ids start below `capacity` (the arena grows beyond it on demand).
    pub fn new(key_len: usize, capacity: usize) -> Self {
        Self::with_hasher(key_len, capacity, DefaultHashBuilder::default())
    }

    /// A table hashing like `self`, so one hash serves both.
    pub fn sibling(&self, capacity: usize) -> Self {
        Self::with_hasher(self.key_len, capacity, self.hasher.clone())
    }

    fn with_hasher(key_len: usize, capacity: usize, hasher: DefaultHashBuilder) -> Self {
        Self {
            key_len,
            arena: vec![0; key_len * capacity],
            table: HashTable::with_capacity(capacity),
            hasher,
        }
    }

    #[inline]
    pub fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The bytes of the key stored under `id`.
    #[inline]
    pub fn key(&self, id: u32) -> &[u8] {
        let at = id as usize * self.key_len;
        &self.arena[at..at + self.key_len]
    }

    #[inline]
    pub fn find(&self, key: &[u8]) -> Option<u32> {
        self.find_hashed(self.hash(key), key)
    }

    #[inline]
    pub fn find_hashed(&self, hash: u64, key: &[u8]) -> Option<u32> {
        let (arena, kl) = (&self.arena, self.key_len);
        self.table
            .find(hash, |&id| {
                &arena[id as usize * kl..id as usize * kl + kl] == key
            })
            .copied()
    }

    /// Stores `key` (which must be absent) under `id`.
    pub fn insert_hashed(&mut self, hash: u64, id: u32, key: &[u8]) {
        let at = id as usize * self.key_len;
        if self.arena.len() < at + self.key_len {
            self.arena
                .resize((at + self.key_len).max(self.arena.len() * 2), 0);
        }
        self.arena[at..at + self.key_len].copy_from_slice(key);
        let (arena, kl, hasher) = (&self.arena, self.key_len, &self.hasher);
        self.table.insert_unique(hash, id, |&i| {
            hasher.hash_one(&arena[i as usize * kl..i as usize * kl + kl])
        });
    }

    /// Removes the entry of `id`; returns whether it was present.
    pub fn remove_id(&mut self, id: u32) -> bool {
        let hash = self.hash(self.key(id));
        match self.table.find_entry(hash, |&i| i == id) {
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

//! The per-request access records of vLLM 0.33 semantics (vLLM 0.33 `_RequestCacheAccess`):
//! which keys a request observed, in first-observation order, with their positions, which it
//! inserted, which it reused, which it reported as store misses, and the LRU request rank it
//! took. Records are pooled: a finished request's buffers serve the next one.

use super::keys::{KeyTable, key_eq};
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

/// One request's record. Its keys are indices `0..len()` in first-observation order.
#[derive(Debug, Default)]
pub(super) struct Record {
    /// Bumped each time the pool entry is handed out; half of the [`RequestId`].
    serial: u32,
    active: bool,
    /// The manager's cache generation the record belongs to; a record of an older one is
    /// stale (a reset came between) and starts again empty at its next use.
    pub generation: u64,
    /// The keys, back to back, their hashes, positions ([`NO_POS`]: none) and flags.
    pub keys: Vec<u8>,
    pub hashes: Vec<u64>,
    /// The manager id each key had when last seen (a hint: the commit takes a slot whose key
    /// is still this one without a lookup, and looks up the others).
    pub ids: Vec<u32>,
    pub positions: Vec<u64>,
    pub flags: Vec<u8>,
    /// Keys without a position.
    pub unpositioned: usize,
    index: HashTable<u32>,
    /// The policy's request rank (0.33 LRU: an anchor id), [`NO_ID`] until taken.
    pub rank: u32,
}

impl Record {
    /// Recorded keys.
    pub fn len(&self) -> usize {
        self.flags.len()
    }

    /// The `i`-th recorded key.
    pub fn key(&self, i: usize, key_len: usize) -> &[u8] {
        &self.keys[i * key_len..(i + 1) * key_len]
    }

    /// The index of `key` (hash `hash`), if recorded.
    #[inline]
    pub fn find(&self, hash: u64, key: &[u8]) -> Option<u32> {
        if self.flags.is_empty() {
            return None;
        }
        let kl = key.len();
        self.index
            .find(hash, |&i| key_eq(self.key(i as usize, kl), key))
            .copied()
    }

    /// Records `key` (not recorded yet, manager id `id`) with `position`; returns its index.
    #[inline]
    fn push(&mut self, hash: u64, key: &[u8], id: u32, position: u64) -> u32 {
        let i = self.flags.len() as u32;
        self.keys.extend_from_slice(key);
        self.hashes.push(hash);
        self.ids.push(id);
        self.positions.push(position);
        self.flags.push(0);
        if position == NO_POS {
            self.unpositioned += 1;
        }
        let hashes = &self.hashes;
        self.index.insert_unique(hash, i, |&j| hashes[j as usize]);
        i
    }

    /// Records an observation of `key` (hash `hash`, manager id `id`) at `position`; `seen` is
    /// its index if it is recorded ([`Self::find`]). A recorded key keeps its first position
    /// (or takes this one if it had none) and takes `id`; a new key is pushed. Returns the
    /// key's index and whether it is new.
    #[inline]
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
        let p = &mut self.positions[i as usize];
        if *p == NO_POS && position != NO_POS {
            *p = position;
            self.unpositioned -= 1;
        }
        self.ids[i as usize] = id;
        (i, false)
    }

    /// Empties the record (keeping its buffers) for `generation`.
    fn reset(&mut self, generation: u64) {
        self.generation = generation;
        self.keys.clear();
        self.hashes.clear();
        self.ids.clear();
        self.positions.clear();
        self.flags.clear();
        self.unpositioned = 0;
        self.index.clear();
        self.rank = NO_ID;
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

    /// Checks each active record's index against its keys (invariant checks).
    pub fn check(&self, key_len: usize, table: &KeyTable) -> std::result::Result<(), String> {
        for (i, r) in self.records.iter().enumerate().filter(|(_, r)| r.active) {
            let n = r.len();
            if r.keys.len() != n * key_len
                || r.hashes.len() != n
                || r.ids.len() != n
                || r.positions.len() != n
                || r.index.len() != n
                || r.positions.iter().filter(|&&p| p == NO_POS).count() != r.unpositioned
            {
                return Err(format!("request record {i}: inconsistent lengths"));
            }
            for j in 0..n {
                let key = r.key(j, key_len);
                if table.hash(key) != r.hashes[j] || r.find(r.hashes[j], key) != Some(j as u32) {
                    return Err(format!("request record {i}: key {j} is not indexed"));
                }
            }
        }
        Ok(())
    }
}

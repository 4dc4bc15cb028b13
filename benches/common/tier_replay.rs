//! Tier replay for the manager benchmark and `tests/replay.rs` (included by `#[path]`): drives
//! the offload tier alone with the block sequence of a request trace (Mooncake format, one JSON
//! object a line with `hash_ids`), through the Rust API or the C ABI.
//!
//! Per request: prefix lookup of its keys, touch, prepare/complete load of the hits, then
//! prepare/complete store of all its blocks (already stored ones are filtered by the tier).
//! A failing call panics: these are a benchmark's and a test's helpers.

#![allow(dead_code)]

use kvoffload::ffi::{self, kvo_policy, kvo_semantics, kvo_status};
use kvoffload::manager::{
    Manager, ManagerConfig, ManagerStats, Policy, RequestId, Semantics, StorePlan,
};
use kvoffload::{Error, Result};
use std::path::{Path, PathBuf};

/// One request of a trace.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct TraceRequest {
    /// Arrival time in milliseconds.
    #[serde(default)]
    pub timestamp: u64,
    /// Prompt tokens.
    #[serde(default)]
    pub input_length: u64,
    /// Generated tokens.
    #[serde(default)]
    pub output_length: u64,
    /// Prefix-chained block hashes of the prompt.
    pub hash_ids: Vec<u64>,
}

/// The folder of the request traces: `$KVO_TRACES` when set (a machine without the checkout's
/// neighbours, such as the GPU machine of `scripts/gpu-check.sh`), else `../shared/traces` beside
/// the repository. The traces are not part of the repository.
pub fn traces_dir() -> PathBuf {
    match std::env::var_os("KVO_TRACES") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces"),
    }
}

/// Reads a JSON-lines trace.
pub fn load_trace(path: &Path) -> std::result::Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))
        })
        .collect()
}

/// The trace's requests as flat key buffers: each hash id as a big-endian `u64`, zero-padded on
/// the left to `key_len` bytes (`key_len >= 8`).
pub fn trace_keys(trace: &[TraceRequest], key_len: usize) -> Vec<Vec<u8>> {
    assert!(key_len >= 8, "key_len {key_len} < 8");
    trace
        .iter()
        .map(|r| {
            let mut flat = vec![0u8; r.hash_ids.len() * key_len];
            for (chunk, id) in flat.chunks_exact_mut(key_len).zip(&r.hash_ids) {
                chunk[key_len - 8..].copy_from_slice(&id.to_be_bytes());
            }
            flat
        })
        .collect()
}

/// What a replay observed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayOutcome {
    /// Requests replayed.
    pub requests: u64,
    /// Blocks over all requests.
    pub blocks: u64,
    /// Blocks loaded from the tier (prefix hits).
    pub hit_blocks: u64,
    /// Blocks stored.
    pub stored_blocks: u64,
    /// Requests whose store found no room.
    pub no_room: u64,
}

/// The tier operations a replay needs: the Rust API or the C ABI behind one interface.
pub trait Tier {
    /// Maximal ready prefix of `keys`.
    fn lookup_prefix(&mut self, keys: &[u8]) -> usize;
    /// Touch `keys`.
    fn touch(&mut self, keys: &[u8]);
    /// Maximal ready prefix of `keys`, then touch them all.
    fn lookup_prefix_touch(&mut self, keys: &[u8]) -> usize {
        let hits = self.lookup_prefix(keys);
        self.touch(keys);
        hits
    }
    /// Pin and release `keys` (a load that completes at once), with their `positions` in the
    /// current request (0.33; empty in 0.24).
    fn load(&mut self, keys: &[u8], positions: &[u64]);
    /// Store `keys` (with `positions`, as for `load`) and complete the stores at once; returns
    /// the stored count or `None` on "no room".
    fn store(&mut self, keys: &[u8], positions: &[u64]) -> Option<usize>;
    /// The semantics of the tier.
    fn semantics(&self) -> Semantics;
    /// Begins a request (0.33): the following loads and stores are its own.
    fn begin(&mut self) {}
    /// Finishes the current request (0.33): its recency is committed.
    fn finish(&mut self) {}
}

/// Replays `requests` (flat key buffers) through `tier`: per request, in 0.24 semantics the
/// prefix lookup and touch, the load of the hit, the store of all keys; in 0.33 semantics the
/// request begins, its keys carry positions (block `i` at `i + 1`), nothing is touched, and it
/// finishes after its store.
pub fn replay(tier: &mut impl Tier, requests: &[Vec<u8>], key_len: usize) -> ReplayOutcome {
    let v033 = tier.semantics() == Semantics::Vllm033;
    let mut out = ReplayOutcome::default();
    // Block `i`'s position is `i + 1` in every request: the positions of the longest one,
    // sliced (empty in 0.24 semantics).
    let longest = requests.iter().map(|k| k.len() / key_len).max();
    let all_positions: Vec<u64> = if v033 {
        (1..=longest.unwrap_or(0) as u64).collect()
    } else {
        Vec::new()
    };
    for keys in requests {
        let n = keys.len() / key_len;
        let positions = all_positions.get(..n).unwrap_or(&[]);
        let hits = if v033 {
            tier.begin();
            tier.lookup_prefix(keys)
        } else {
            tier.lookup_prefix_touch(keys)
        };
        if hits > 0 {
            tier.load(
                &keys[..hits * key_len],
                positions.get(..hits).unwrap_or(&[]),
            );
        }
        match tier.store(keys, positions) {
            Some(n) => out.stored_blocks += n as u64,
            None => out.no_room += 1,
        }
        if v033 {
            tier.finish();
        }
        out.requests += 1;
        out.blocks += n as u64;
        out.hit_blocks += hits as u64;
    }
    out
}

/// The keys of `keys` at `indices` (ascending): a slice of `keys` when they are contiguous (the
/// usual case: all but a prefix of hits), else gathered into `buf`.
fn stored_keys<'a>(keys: &'a [u8], kl: usize, indices: &[u32], buf: &'a mut Vec<u8>) -> &'a [u8] {
    match (indices.first(), indices.last()) {
        (Some(&a), Some(&b)) if (b - a) as usize + 1 == indices.len() => {
            &keys[a as usize * kl..(b as usize + 1) * kl]
        }
        _ => {
            buf.clear();
            for &i in indices {
                buf.extend_from_slice(&keys[i as usize * kl..(i as usize + 1) * kl]);
            }
            buf
        }
    }
}

/// The Rust API as a [`Tier`], with reusable scratch buffers.
pub struct RustTier {
    /// The manager driven.
    pub manager: Manager,
    plan: StorePlan,
    slots: Vec<u32>,
    done: Vec<u8>,
    request: Option<RequestId>,
}

impl RustTier {
    /// A tier over a new manager.
    pub fn new(cfg: ManagerConfig) -> Result<Self> {
        Ok(Self {
            manager: Manager::new(cfg)?,
            plan: StorePlan::default(),
            slots: Vec::new(),
            done: Vec::new(),
            request: None,
        })
    }
}

impl Tier for RustTier {
    fn lookup_prefix(&mut self, keys: &[u8]) -> usize {
        self.manager
            .lookup_prefix(keys)
            .expect("lookup_prefix")
            .hits
    }

    fn touch(&mut self, keys: &[u8]) {
        self.manager.touch(keys).expect("touch");
    }

    fn lookup_prefix_touch(&mut self, keys: &[u8]) -> usize {
        let n = keys.len() / self.manager.key_len();
        let p = self.manager.lookup_prefix_touch(keys, 0..n);
        p.expect("lookup_prefix_touch").hits
    }

    fn load(&mut self, keys: &[u8], positions: &[u64]) {
        self.slots.resize(keys.len() / self.manager.key_len(), 0);
        match self.request {
            Some(r) => self
                .manager
                .prepare_load_for(r, keys, positions, &mut self.slots),
            None => self.manager.prepare_load(keys, &mut self.slots),
        }
        .expect("prepare_load");
        self.manager.complete_load(keys).expect("complete_load");
    }

    fn semantics(&self) -> Semantics {
        self.manager.config().semantics
    }

    fn begin(&mut self) {
        self.request = Some(self.manager.begin_request());
    }

    fn finish(&mut self) {
        let r = self.request.take().expect("a request begun");
        self.manager.finish_request(r).expect("finish_request");
    }

    fn store(&mut self, keys: &[u8], positions: &[u64]) -> Option<usize> {
        let kl = self.manager.key_len();
        let r = match self.request {
            Some(r) => self
                .manager
                .prepare_store_for(r, keys, positions, &mut self.plan),
            None => self.manager.prepare_store(keys, &mut self.plan),
        };
        match r {
            Ok(c) => {
                let done = stored_keys(keys, kl, &self.plan.indices, &mut self.done);
                self.manager
                    .complete_store_at(done, &self.plan.slots, true)
                    .expect("complete_store");
                Some(c.stored)
            }
            Err(Error::NoRoom(_)) => None,
            Err(e) => panic!("prepare_store: {e}"),
        }
    }
}

/// The C ABI as a [`Tier`]: the same calls a C or Python host makes.
pub struct FfiTier {
    handle: *mut ffi::kvo_manager,
    key_len: usize,
    idx: Vec<u32>,
    slots: Vec<u32>,
    evicted: Vec<u8>,
    done: Vec<u8>,
    semantics: Semantics,
    request: Option<u64>,
}

/// `positions` for C: NULL when empty.
fn positions_ptr(positions: &[u64]) -> *const u64 {
    if positions.is_empty() {
        std::ptr::null()
    } else {
        positions.as_ptr()
    }
}

impl FfiTier {
    /// A tier over a new C handle, configured with every field of `cfg`.
    pub fn new(cfg: &ManagerConfig) -> Self {
        let c = ffi::kvo_manager_config {
            struct_size: size_of::<ffi::kvo_manager_config>(),
            key_len: cfg.key_len.try_into().expect("key_len fits the C field"),
            policy: match cfg.policy {
                Policy::Lru => kvo_policy::Lru,
                Policy::Arc => kvo_policy::Arc,
            } as u32,
            num_slots: cfg.num_slots as u64,
            store_threshold: cfg.store_threshold,
            enable_events: cfg.enable_events.into(),
            max_tracker_size: cfg.max_tracker_size as u64,
            semantics: match cfg.semantics {
                Semantics::Vllm024 => kvo_semantics::VLLM_0_24,
                Semantics::Vllm033 => kvo_semantics::VLLM_0_33,
            } as u32,
        };
        let mut handle = std::ptr::null_mut();
        // SAFETY: a valid config and out-pointer; the handle is freed in Drop.
        assert_eq!(
            unsafe { ffi::kvo_manager_new(&c, &mut handle) },
            kvo_status::Ok
        );
        Self {
            handle,
            key_len: cfg.key_len,
            idx: vec![],
            slots: vec![],
            evicted: vec![],
            done: vec![],
            semantics: cfg.semantics,
            request: None,
        }
    }

    /// The tier's stats through the C ABI.
    pub fn stats(&self) -> ffi::kvo_manager_stats {
        let mut s = ffi::kvo_manager_stats {
            struct_size: size_of::<ffi::kvo_manager_stats>(),
            ..Default::default()
        };
        // SAFETY: live handle, valid out-pointer.
        assert_eq!(
            unsafe { ffi::kvo_manager_get_stats(self.handle, &mut s) },
            kvo_status::Ok
        );
        s
    }
}

impl Drop for FfiTier {
    fn drop(&mut self) {
        // SAFETY: the handle came from kvo_manager_new and is freed once.
        unsafe { ffi::kvo_manager_free(self.handle) }
    }
}

impl Tier for FfiTier {
    fn lookup_prefix(&mut self, keys: &[u8]) -> usize {
        let n = keys.len() / self.key_len;
        let (mut hits, mut retry) = (0usize, 0u32);
        // SAFETY: live handle; `keys` holds n keys; valid out-pointers.
        let st = unsafe {
            ffi::kvo_manager_lookup_prefix(self.handle, keys.as_ptr(), n, &mut hits, &mut retry)
        };
        assert_eq!(st, kvo_status::Ok);
        hits
    }

    fn touch(&mut self, keys: &[u8]) {
        // SAFETY: as above.
        let st = unsafe {
            ffi::kvo_manager_touch(self.handle, keys.as_ptr(), keys.len() / self.key_len)
        };
        assert_eq!(st, kvo_status::Ok);
    }

    fn semantics(&self) -> Semantics {
        self.semantics
    }

    fn begin(&mut self) {
        let mut r = 0;
        // SAFETY: live handle, valid out-pointer.
        let st = unsafe { ffi::kvo_manager_begin_request(self.handle, &mut r) };
        assert_eq!(st, kvo_status::Ok);
        self.request = Some(r);
    }

    fn finish(&mut self) {
        let r = self.request.take().expect("a request begun");
        // SAFETY: live handle.
        let st = unsafe { ffi::kvo_manager_finish_request(self.handle, r) };
        assert_eq!(st, kvo_status::Ok);
    }

    fn load(&mut self, keys: &[u8], positions: &[u64]) {
        let n = keys.len() / self.key_len;
        self.slots.resize(n, 0);
        // SAFETY: as above; `slots` holds n entries, `positions` n or none.
        unsafe {
            let st = match self.request {
                Some(r) => ffi::kvo_manager_prepare_load_for(
                    self.handle,
                    r,
                    keys.as_ptr(),
                    positions_ptr(positions),
                    n,
                    self.slots.as_mut_ptr(),
                    n,
                ),
                None => ffi::kvo_manager_prepare_load(
                    self.handle,
                    keys.as_ptr(),
                    n,
                    self.slots.as_mut_ptr(),
                    n,
                ),
            };
            assert_eq!(st, kvo_status::Ok);
            assert_eq!(
                ffi::kvo_manager_complete_load(self.handle, keys.as_ptr(), n),
                kvo_status::Ok
            );
        }
    }

    fn store(&mut self, keys: &[u8], positions: &[u64]) -> Option<usize> {
        let (kl, n) = (self.key_len, keys.len() / self.key_len);
        self.idx.resize(n, 0);
        self.slots.resize(n, 0);
        self.evicted.resize(n * kl, 0);
        let (mut ns, mut ne) = (0usize, 0usize);
        // SAFETY: as above; every output holds n entries, `positions` n or none.
        let st = unsafe {
            match self.request {
                Some(r) => ffi::kvo_manager_prepare_store_for(
                    self.handle,
                    r,
                    keys.as_ptr(),
                    positions_ptr(positions),
                    n,
                    self.idx.as_mut_ptr(),
                    self.slots.as_mut_ptr(),
                    self.evicted.as_mut_ptr(),
                    n,
                    &mut ns,
                    &mut ne,
                ),
                None => ffi::kvo_manager_prepare_store(
                    self.handle,
                    keys.as_ptr(),
                    n,
                    self.idx.as_mut_ptr(),
                    self.slots.as_mut_ptr(),
                    self.evicted.as_mut_ptr(),
                    n,
                    &mut ns,
                    &mut ne,
                ),
            }
        };
        match st {
            kvo_status::Ok => {}
            kvo_status::NoRoom => return None,
            s => panic!("prepare_store: {s:?}"),
        }
        let done = stored_keys(keys, kl, &self.idx[..ns], &mut self.done);
        // SAFETY: as above; `done` holds ns keys and `slots` ns slots.
        let st = unsafe {
            ffi::kvo_manager_complete_store_at(
                self.handle,
                done.as_ptr(),
                self.slots.as_ptr(),
                ns,
                1,
            )
        };
        assert_eq!(st, kvo_status::Ok);
        Some(ns)
    }
}

/// Manager stats after a replay through the Rust API (for reports).
pub fn replay_rust(
    cfg: ManagerConfig,
    requests: &[Vec<u8>],
) -> Result<(ReplayOutcome, ManagerStats)> {
    let kl = cfg.key_len;
    let mut tier = RustTier::new(cfg)?;
    let out = replay(&mut tier, requests, kl);
    Ok((out, tier.manager.stats()))
}

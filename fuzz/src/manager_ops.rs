//! Manager operation sequences through the C functions (`kvo_manager_*`), against a model of
//! every key's state. After every call: the manager's own recount, the stats gauges against the
//! model (slot accounting; nothing pinned without a load the harness made), a failed call
//! changed nothing, `prepare_store` never evicted a key it names nor a pinned or in-flight one,
//! and the events match what the calls did.

use crate::{fail_message, status_name};
use arbitrary::Arbitrary;
use kvoffload::ffi::*;
use std::collections::HashMap;
use std::ptr::{NonNull, null, null_mut};

/// A fuzz input: a configuration and the calls.
#[derive(Arbitrary, Debug)]
pub struct Input {
    key_len: u8,
    policy: u8,
    num_slots: u8,
    store_threshold: u8,
    events: bool,
    tracker: u8,
    short_config: bool,
    ops: Vec<Op>,
}

/// Keys are small indices (`u8 % KEYS`) spread over `key_len` bytes, so calls share keys.
const KEYS: u8 = 24;

#[derive(Arbitrary, Debug)]
enum Op {
    Lookup(u8),
    LookupPrefix(Vec<u8>),
    PrepareLoad {
        keys: Vec<u8>,
        short: bool,
    },
    Touch(Vec<u8>),
    CompleteLoad(Vec<u8>),
    PrepareStore {
        keys: Vec<u8>,
        short: bool,
    },
    CompleteStore {
        keys: Vec<u8>,
        success: bool,
    },
    CompleteStoreAt {
        keys: Vec<u8>,
        slots: Vec<u32>,
        success: bool,
    },
    /// Completes one store batch the harness prepared (the realistic path), with its slots.
    CompleteBatch {
        pick: u8,
        success: bool,
        hints: bool,
    },
    /// Pins ready keys (the realistic path), later released by `ReleaseLoad`.
    LoadReady {
        pick: Vec<u8>,
    },
    ReleaseLoad {
        pick: u8,
    },
    TakeEvents {
        events_cap: u8,
        keys_cap: u8,
    },
    Stats {
        struct_size: u8,
    },
    Reset,
    /// A call with arbitrary lengths: NULL buffers, lengths that overflow, a NULL handle.
    Raw {
        func: u8,
        n: u64,
        null_handle: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    InFlight(u32),
    Ready { slot: u32, pins: u32 },
}

struct Model {
    kl: usize,
    num_slots: usize,
    lru: bool,
    threshold: bool,
    events_on: bool,
    keys: HashMap<Vec<u8>, State>,
    /// Expected buffered events: (removed, keys).
    events: Vec<(bool, Vec<u8>)>,
    /// Store batches prepared and not completed: (keys, slots).
    batches: Vec<(Vec<u8>, Vec<u32>)>,
    /// Loads pinned by `LoadReady` and not released.
    loads: Vec<Vec<u8>>,
}

impl Model {
    fn key(&self, i: u8) -> Vec<u8> {
        let i = i % KEYS;
        let mut k = vec![0u8; self.kl];
        k[0] = i;
        if self.kl > 1 {
            k[self.kl - 1] = i.wrapping_mul(37) ^ 0x5a;
        }
        k
    }

    fn keys_of(&self, idx: &[u8]) -> Vec<u8> {
        idx.iter().flat_map(|&i| self.key(i)).collect()
    }

    fn gauges(&self) -> (u64, u64, u64, u64) {
        let (mut in_flight, mut evictable, mut pinned) = (0, 0, 0);
        for s in self.keys.values() {
            match s {
                State::InFlight(_) => in_flight += 1,
                State::Ready { pins: 0, .. } => evictable += 1,
                State::Ready { .. } => pinned += 1,
            }
        }
        (self.keys.len() as u64, in_flight, evictable, pinned)
    }

    fn slot_in_use(&self, slot: u32) -> bool {
        self.keys.values().any(|s| match *s {
            State::InFlight(x) | State::Ready { slot: x, .. } => x == slot,
        })
    }

    fn push_event(&mut self, removed: bool, keys: Vec<u8>) {
        if self.events_on && !keys.is_empty() {
            self.events.push((removed, keys));
        }
    }

    /// Applies a completed store of `keys` (those in flight end; the rest are ignored).
    fn complete_store(&mut self, keys: &[u8], success: bool) {
        let mut stored = Vec::new();
        for k in keys.chunks_exact(self.kl) {
            if let Some(&State::InFlight(slot)) = self.keys.get(k) {
                if success {
                    self.keys.insert(k.to_vec(), State::Ready { slot, pins: 0 });
                    stored.extend_from_slice(k);
                } else {
                    self.keys.remove(k);
                }
            }
        }
        if success {
            self.push_event(false, stored);
        }
    }
}

struct Handle(*mut kvo_manager);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: a live handle from kvo_manager_new, freed once.
        unsafe { kvo_manager_free(self.0) }
    }
}

fn stats(m: *mut kvo_manager) -> kvo_manager_stats {
    let mut s = kvo_manager_stats {
        struct_size: size_of::<kvo_manager_stats>(),
        ..Default::default()
    };
    // SAFETY: live handle, writable struct of its declared size.
    let st = unsafe { kvo_manager_get_stats(m, &mut s) };
    assert_eq!(st, kvo_status::Ok, "get_stats: {}", fail_message());
    s
}

fn gauges_of(s: &kvo_manager_stats) -> (u64, u64, u64, u64) {
    (s.used, s.stores_in_flight, s.evictable, s.pinned)
}

/// Runs one input; panics when the library breaks a promise.
pub fn run(input: &Input) {
    let mut cfg = kvo_manager_config {
        struct_size: 0,
        key_len: 0,
        policy: 0,
        num_slots: 0,
        store_threshold: 0,
        enable_events: 0,
        max_tracker_size: 0,
        semantics: 0,
    };
    // SAFETY: writable config.
    assert_eq!(
        unsafe { kvo_manager_config_default(&mut cfg) },
        kvo_status::Ok
    );
    cfg.key_len = match input.key_len {
        0 => 0,
        k @ 1..=239 => 1 + k as u32 % 8,
        k => k as u32,
    };
    cfg.policy = (input.policy % 3) as u32;
    cfg.num_slots = (input.num_slots % 17) as u64;
    cfg.store_threshold = (input.store_threshold % 4) as u32;
    cfg.enable_events = input.events as u32;
    cfg.max_tracker_size = (input.tracker % 8) as u64;
    if input.short_config {
        cfg.struct_size -= 1;
    }
    let valid = (1..=64).contains(&cfg.key_len)
        && cfg.policy < 2
        && !input.short_config
        && (cfg.store_threshold < 2 || cfg.max_tracker_size > 0);
    let mut raw = null_mut();
    // SAFETY: valid config and out-pointer.
    let st = unsafe { kvo_manager_new(&cfg, &mut raw) };
    if !valid {
        assert_eq!(st, kvo_status::InvalidArgument, "config {cfg:?} accepted");
        assert!(raw.is_null(), "out written on failure");
        assert!(!fail_message().is_empty());
        return;
    }
    assert_eq!(st, kvo_status::Ok, "config {cfg:?}: {}", fail_message());
    let h = Handle(raw);
    let m = h.0;
    let mut model = Model {
        kl: cfg.key_len as usize,
        num_slots: cfg.num_slots as usize,
        lru: cfg.policy == 0,
        threshold: cfg.store_threshold >= 2,
        events_on: input.events,
        keys: HashMap::new(),
        events: Vec::new(),
        batches: Vec::new(),
        loads: Vec::new(),
    };
    for (step, op) in input.ops.iter().enumerate() {
        let before = gauges_of(&stats(m));
        let st = apply(m, &mut model, op);
        let message = fail_message();
        let after = stats(m);
        if st != kvo_status::Ok {
            assert!(
                !message.is_empty(),
                "op {step} {op:?}: {st:?} without a message"
            );
            assert_eq!(
                before,
                gauges_of(&after),
                "op {step} {op:?} failed and changed state"
            );
        }
        check(m, &model, &after, step, op);
    }
}

fn check(m: *mut kvo_manager, model: &Model, s: &kvo_manager_stats, step: usize, op: &Op) {
    // SAFETY: live handle.
    let st = unsafe { kvo_manager_check_invariants(m) };
    assert_eq!(
        st,
        kvo_status::Ok,
        "after op {step} {op:?}: {}",
        fail_message()
    );
    assert_eq!(s.capacity, model.num_slots as u64);
    assert!(s.used <= s.capacity, "{s:?}");
    assert_eq!(s.ready + s.stores_in_flight, s.used, "{s:?}");
    assert_eq!(s.evictable + s.pinned, s.ready, "{s:?}");
    assert_eq!(
        gauges_of(s),
        model.gauges(),
        "after op {step} {op:?}: (used, in flight, evictable, pinned) differ from the model"
    );
}

fn apply(m: *mut kvo_manager, model: &mut Model, op: &Op) -> kvo_status {
    let kl = model.kl;
    match op {
        Op::Lookup(i) => {
            let key = model.key(*i);
            let mut r = 99u32;
            // SAFETY: key of key_len bytes, writable result.
            let st = unsafe { kvo_manager_lookup(m, key.as_ptr(), &mut r) };
            assert_eq!(st, kvo_status::Ok);
            let want = match model.keys.get(&key) {
                None => kvo_lookup::Miss,
                Some(State::InFlight(_)) => kvo_lookup::Retry,
                Some(State::Ready { .. }) => kvo_lookup::Hit,
            };
            assert_eq!(r, want as u32, "lookup of {key:?}");
            st
        }
        Op::LookupPrefix(idx) => {
            let keys = model.keys_of(idx);
            let (mut hits, mut retry) = (usize::MAX, 9u32);
            // SAFETY: keys of n * key_len bytes.
            let st = unsafe {
                kvo_manager_lookup_prefix(m, keys.as_ptr(), idx.len(), &mut hits, &mut retry)
            };
            assert_eq!(st, kvo_status::Ok);
            let mut want = (0, false);
            for k in keys.chunks_exact(kl) {
                match model.keys.get(k) {
                    None => break,
                    Some(s) => {
                        want.0 += 1;
                        want.1 |= matches!(s, State::InFlight(_));
                    }
                }
            }
            assert_eq!((hits, retry != 0), want, "lookup_prefix {idx:?}");
            st
        }
        Op::PrepareLoad { keys: idx, short } => {
            let keys = model.keys_of(idx);
            prepare_load(m, model, &keys, *short)
        }
        Op::LoadReady { pick } => {
            let ready: Vec<Vec<u8>> = {
                let mut r: Vec<_> = model
                    .keys
                    .iter()
                    .filter(|(_, s)| matches!(s, State::Ready { .. }))
                    .map(|(k, _)| k.clone())
                    .collect();
                r.sort();
                r
            };
            if ready.is_empty() {
                return kvo_status::Ok;
            }
            let keys: Vec<u8> = pick
                .iter()
                .flat_map(|&p| ready[p as usize % ready.len()].clone())
                .collect();
            let st = prepare_load(m, model, &keys, false);
            assert_eq!(st, kvo_status::Ok, "load of ready keys: {}", fail_message());
            model.loads.push(keys);
            st
        }
        Op::ReleaseLoad { pick } => {
            if model.loads.is_empty() {
                return kvo_status::Ok;
            }
            let keys = model.loads.remove(*pick as usize % model.loads.len());
            let st = complete_load(m, model, &keys);
            assert_eq!(st, kvo_status::Ok, "release of a load: {}", fail_message());
            st
        }
        Op::Touch(idx) => {
            let keys = model.keys_of(idx);
            // SAFETY: keys of n * key_len bytes.
            let st = unsafe { kvo_manager_touch(m, keys.as_ptr(), idx.len()) };
            assert_eq!(st, kvo_status::Ok);
            st
        }
        Op::CompleteLoad(idx) => {
            let keys = model.keys_of(idx);
            let st = complete_load(m, model, &keys);
            if st == kvo_status::Ok {
                // Pins the harness's own loads held may be gone now: forget loads no longer
                // covered (their release would now fail, which the model predicts anyway).
                model.loads.clear();
            }
            st
        }
        Op::PrepareStore { keys: idx, short } => {
            let keys = model.keys_of(idx);
            prepare_store(m, model, &keys, *short)
        }
        Op::CompleteStore { keys: idx, success } => {
            let keys = model.keys_of(idx);
            // SAFETY: keys of n * key_len bytes.
            let st =
                unsafe { kvo_manager_complete_store(m, keys.as_ptr(), idx.len(), *success as u32) };
            assert_eq!(st, kvo_status::Ok, "{}", fail_message());
            model.complete_store(&keys, *success);
            st
        }
        Op::CompleteStoreAt {
            keys: idx,
            slots,
            success,
        } => {
            let keys = model.keys_of(idx);
            let n = idx.len();
            let slots: Vec<u32> = slots
                .iter()
                .map(|&s| if s >= 0x8000_0000 { s } else { s % 20 })
                .collect();
            // SAFETY: keys of n * key_len bytes, n slots when n > 0 (or a NULL / short
            // buffer rejected before reading: only `slots.len() == n` passes a pointer).
            let st = unsafe {
                let sp = if slots.len() >= n {
                    slots.as_ptr()
                } else {
                    null()
                };
                kvo_manager_complete_store_at(m, keys.as_ptr(), sp, n, *success as u32)
            };
            let ok = n == 0
                || (slots.len() >= n && slots[..n].iter().all(|&s| (s as usize) < model.num_slots));
            if ok {
                assert_eq!(st, kvo_status::Ok, "{}", fail_message());
                model.complete_store(&keys, *success);
            } else {
                assert_ne!(
                    st,
                    kvo_status::Ok,
                    "complete_store_at with bad slots accepted"
                );
            }
            st
        }
        Op::CompleteBatch {
            pick,
            success,
            hints,
        } => {
            if model.batches.is_empty() {
                return kvo_status::Ok;
            }
            let (keys, slots) = model.batches.remove(*pick as usize % model.batches.len());
            let n = slots.len();
            // SAFETY: keys and slots of n entries.
            let st = unsafe {
                if *hints {
                    kvo_manager_complete_store_at(
                        m,
                        keys.as_ptr(),
                        slots.as_ptr(),
                        n,
                        *success as u32,
                    )
                } else {
                    kvo_manager_complete_store(m, keys.as_ptr(), n, *success as u32)
                }
            };
            assert_eq!(st, kvo_status::Ok, "{}", fail_message());
            model.complete_store(&keys, *success);
            st
        }
        Op::TakeEvents {
            events_cap,
            keys_cap,
        } => take_events(m, model, *events_cap as usize % 12, *keys_cap as usize % 40),
        Op::Stats { struct_size } => {
            let full = size_of::<kvo_manager_stats>();
            let size = *struct_size as usize % (full + 1);
            let mut buf = vec![0xeeu8; full + 8];
            buf[..8].copy_from_slice(&size.to_ne_bytes());
            // SAFETY: the buffer holds more than `size` bytes; the call writes at most that.
            let st =
                unsafe { kvo_manager_get_stats(m, buf.as_mut_ptr() as *mut kvo_manager_stats) };
            if size < 8 {
                assert_eq!(st, kvo_status::InvalidArgument);
            } else {
                assert_eq!(st, kvo_status::Ok);
                assert!(
                    buf[size..].iter().all(|&b| b == 0xee),
                    "wrote past struct_size"
                );
                assert_eq!(usize::from_ne_bytes(buf[..8].try_into().unwrap()), size);
            }
            st
        }
        Op::Reset => {
            // SAFETY: live handle.
            let st = unsafe { kvo_manager_reset(m) };
            assert_eq!(st, kvo_status::Ok);
            model.keys.clear();
            model.batches.clear();
            model.loads.clear();
            st
        }
        Op::Raw {
            func,
            n,
            null_handle,
        } => raw_call(m, model, *func, *n, *null_handle),
    }
}

fn prepare_load(m: *mut kvo_manager, model: &mut Model, keys: &[u8], short: bool) -> kvo_status {
    let kl = model.kl;
    let n = keys.len() / kl;
    let cap = if short && n > 0 { n - 1 } else { n };
    let mut slots = vec![u32::MAX; n + 1];
    // SAFETY: keys of n * key_len bytes, slots of cap entries.
    let st = unsafe { kvo_manager_prepare_load(m, keys.as_ptr(), n, slots.as_mut_ptr(), cap) };
    let mut want = kvo_status::Ok;
    if cap < n {
        want = kvo_status::BufferTooSmall;
    } else {
        for k in keys.chunks_exact(kl) {
            match model.keys.get(k) {
                None => {
                    want = kvo_status::NotFound;
                    break;
                }
                Some(State::InFlight(_)) => {
                    want = kvo_status::InvalidState;
                    break;
                }
                _ => {}
            }
        }
    }
    assert_eq!(st, want, "prepare_load: {}", fail_message());
    if st != kvo_status::Ok {
        assert!(
            slots.iter().all(|&s| s == u32::MAX),
            "out_slots written on failure"
        );
        return st;
    }
    for (k, &got) in keys.chunks_exact(kl).zip(&slots) {
        match model.keys.get_mut(k) {
            Some(State::Ready { slot, pins }) => {
                assert_eq!(got, *slot, "prepare_load gave another slot");
                *pins += 1;
            }
            s => unreachable!("{s:?}"),
        }
    }
    st
}

fn complete_load(m: *mut kvo_manager, model: &mut Model, keys: &[u8]) -> kvo_status {
    let kl = model.kl;
    // SAFETY: keys of n * key_len bytes.
    let st = unsafe { kvo_manager_complete_load(m, keys.as_ptr(), keys.len() / kl) };
    let mut want = kvo_status::Ok;
    let mut left: HashMap<&[u8], u32> = HashMap::new();
    for k in keys.chunks_exact(kl) {
        match model.keys.get(k) {
            None => {
                want = kvo_status::NotFound;
                break;
            }
            Some(State::InFlight(_)) => {
                want = kvo_status::InvalidState;
                break;
            }
            Some(State::Ready { pins, .. }) => {
                let l = left.entry(k).or_insert(*pins);
                if *l == 0 {
                    want = kvo_status::InvalidState;
                    break;
                }
                *l -= 1;
            }
        }
    }
    assert_eq!(st, want, "complete_load: {}", fail_message());
    if st == kvo_status::Ok {
        for k in keys.chunks_exact(kl) {
            if let Some(State::Ready { pins, .. }) = model.keys.get_mut(k) {
                *pins -= 1;
            }
        }
    }
    st
}

fn prepare_store(m: *mut kvo_manager, model: &mut Model, keys: &[u8], short: bool) -> kvo_status {
    let kl = model.kl;
    let n = keys.len() / kl;
    let cap = if short && n > 0 { n - 1 } else { n };
    let (mut idx, mut slots, mut evicted) =
        (vec![u32::MAX; n], vec![u32::MAX; n], vec![0u8; n * kl]);
    let (mut n_store, mut n_evicted) = (usize::MAX, usize::MAX);
    // SAFETY: keys of n * key_len bytes; outputs of cap entries (evicted: cap * key_len bytes).
    let st = unsafe {
        kvo_manager_prepare_store(
            m,
            keys.as_ptr(),
            n,
            idx.as_mut_ptr(),
            slots.as_mut_ptr(),
            evicted.as_mut_ptr(),
            cap,
            &mut n_store,
            &mut n_evicted,
        )
    };
    if cap < n {
        assert_eq!(st, kvo_status::BufferTooSmall);
        assert_eq!(n_store, n);
        return st;
    }
    // The keys not stored, each at its first occurrence.
    let mut absent: Vec<u32> = Vec::new();
    let mut seen: Vec<&[u8]> = Vec::new();
    for (i, k) in keys.chunks_exact(kl).enumerate() {
        if !model.keys.contains_key(k) && !seen.contains(&k) {
            seen.push(k);
            absent.push(i as u32);
        }
    }
    let named = |k: &[u8]| keys.chunks_exact(kl).any(|x| x == k);
    let free = model.num_slots - model.keys.len();
    let evictable_unnamed = model
        .keys
        .iter()
        .filter(|(k, s)| matches!(s, State::Ready { pins: 0, .. }) && !named(k))
        .count();
    if st == kvo_status::NoRoom {
        assert!(
            n_store == usize::MAX && n_evicted == usize::MAX,
            "outputs written on NO_ROOM"
        );
        if model.lru && !model.threshold {
            assert!(
                absent.len() > free + evictable_unnamed,
                "LRU answered NO_ROOM: {} to store, {free} free, {evictable_unnamed} evictable",
                absent.len()
            );
        }
        return st;
    }
    assert_eq!(st, kvo_status::Ok, "prepare_store: {}", fail_message());
    let stored = &idx[..n_store];
    if model.threshold {
        assert!(
            stored.iter().all(|i| absent.contains(i)),
            "stored {stored:?} of {absent:?}"
        );
        assert!(stored.windows(2).all(|w| w[0] < w[1]));
    } else {
        assert_eq!(stored, &absent[..], "keys chosen to store");
    }
    if model.lru && !model.threshold {
        assert!(
            absent.len() <= free + evictable_unnamed,
            "LRU stored beyond its room"
        );
    }
    assert_eq!(
        n_evicted,
        n_store.saturating_sub(free),
        "evicted more or fewer than needed"
    );
    let mut removed = Vec::new();
    for k in evicted[..n_evicted * kl].chunks_exact(kl) {
        assert!(!named(k), "prepare_store evicted {k:?}, a key it names");
        match model.keys.remove(k) {
            Some(State::Ready { pins: 0, .. }) => {}
            s => panic!("prepare_store evicted {k:?} in state {s:?}"),
        }
        removed.extend_from_slice(k);
    }
    model.push_event(true, removed);
    let new_slots = &slots[..n_store];
    let mut batch = (Vec::new(), Vec::new());
    for (j, (&i, &slot)) in stored.iter().zip(new_slots).enumerate() {
        assert!((slot as usize) < model.num_slots, "slot {slot}");
        assert!(!model.slot_in_use(slot), "slot {slot} given while in use");
        assert!(!new_slots[..j].contains(&slot), "slot {slot} given twice");
        let k = &keys[i as usize * kl..(i as usize + 1) * kl];
        model.keys.insert(k.to_vec(), State::InFlight(slot));
        batch.0.extend_from_slice(k);
        batch.1.push(slot);
    }
    if !batch.1.is_empty() {
        model.batches.push(batch);
    }
    st
}

fn take_events(m: *mut kvo_manager, model: &mut Model, ecap: usize, kcap: usize) -> kvo_status {
    let kl = model.kl;
    let mut evs = vec![kvo_event::default(); ecap];
    let mut keys = vec![0u8; kcap * kl];
    let (mut ne, mut nk) = (usize::MAX, usize::MAX);
    // SAFETY: outputs of the declared capacities.
    let st = unsafe {
        kvo_manager_take_events(
            m,
            evs.as_mut_ptr(),
            ecap,
            keys.as_mut_ptr(),
            kcap,
            &mut ne,
            &mut nk,
        )
    };
    let want_n = model.events.len();
    let want_k: usize = model.events.iter().map(|e| e.1.len() / kl).sum();
    assert_eq!(
        (ne, nk),
        (want_n, want_k),
        "event counts ({})",
        status_name(st)
    );
    if ecap < want_n || kcap < want_k {
        assert_eq!(st, kvo_status::BufferTooSmall);
        return st;
    }
    assert_eq!(st, kvo_status::Ok);
    let mut first = 0;
    for (e, want) in evs.iter().zip(&model.events) {
        let n = want.1.len() / kl;
        assert_eq!(
            (e.first_key, e.n_keys, e.removed != 0),
            (first as u64, n as u64, want.0)
        );
        assert_eq!(
            &keys[first * kl..(first + n) * kl],
            &want.1[..],
            "event keys"
        );
        first += n;
    }
    model.events.clear();
    st
}

/// A call with a NULL handle, or NULL buffers and arbitrary lengths, or lengths whose byte
/// count overflows: it must fail with the documented status, reading nothing.
fn raw_call(m: *mut kvo_manager, model: &Model, func: u8, n: u64, null_handle: bool) -> kvo_status {
    let kl = model.kl;
    let n = n as usize;
    let h = if null_handle { null_mut() } else { m };
    // Overflowing lengths may come with a non-NULL pointer: they are refused before reading.
    let overflows = n.checked_mul(kl).is_none();
    let p: *const u8 = if overflows && func & 0x80 != 0 {
        NonNull::<u8>::dangling().as_ptr()
    } else {
        null()
    };
    let (mut a, mut b, mut r) = (0usize, 0usize, 0u32);
    // SAFETY: every pointer is NULL or dangling with a length that overflows; the library
    // must refuse both without reading.
    let st = unsafe {
        match func % 8 {
            0 => kvo_manager_lookup_prefix(h, p, n, &mut a, &mut r),
            1 => kvo_manager_prepare_load(h, p, n, null_mut(), n),
            2 => kvo_manager_touch(h, p, n),
            3 => kvo_manager_complete_load(h, p, n),
            4 => kvo_manager_prepare_store(
                h,
                p,
                n,
                null_mut(),
                null_mut(),
                null_mut(),
                n,
                &mut a,
                &mut b,
            ),
            5 => kvo_manager_complete_store(h, p, n, 1),
            6 => kvo_manager_complete_store_at(h, p, null(), n, 0),
            _ => kvo_manager_lookup(h, null(), &mut r),
        }
    };
    if null_handle {
        assert_eq!(st, kvo_status::NullArgument, "NULL handle");
    } else if func % 8 == 7 {
        // lookup takes exactly one key.
        assert_eq!(st, kvo_status::NullArgument);
    } else if n == 0 {
        // Empty calls are fine and change nothing.
        assert_eq!(st, kvo_status::Ok, "empty call {func}: {}", fail_message());
    } else if overflows {
        assert_eq!(
            st,
            kvo_status::InvalidArgument,
            "n_keys {n} overflows: {}",
            fail_message()
        );
    } else {
        assert_eq!(st, kvo_status::NullArgument, "NULL keys with n_keys {n}");
    }
    st
}

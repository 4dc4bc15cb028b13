//! Helpers of the `kvo-replay` tests: running the binary, reading its JSON, and plain
//! prefix-cache models written independently of the simulator, with the same definitions: a
//! request's hit is its leading full blocks in the cache, worth `min(hits × block_tokens,
//! input_length − 1)` tokens (one prompt token is always computed).

#![allow(dead_code)]

use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `kvo-replay` with `args`.
pub fn kvo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvo-replay"))
        .args(args)
        .output()
        .expect("kvo-replay starts")
}

/// Runs `kvo-replay --json` with `args`; panics with its stderr unless it succeeds.
pub fn kvo_json(args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = kvo(&all);
    assert!(
        out.status.success(),
        "kvo-replay {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints JSON")
}

/// A fresh file path in the test's temporary directory.
pub fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvo-replay-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// One trace request: input tokens and block ids.
pub struct Req {
    pub input: u64,
    pub blocks: Vec<u64>,
}

/// Reads a Mooncake trace.
pub fn read_trace(path: &Path) -> Vec<Req> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut reqs: Vec<(u64, Req)> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let blocks = v["hash_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            (
                v["timestamp"].as_u64().unwrap(),
                Req {
                    input: v["input_length"].as_u64().unwrap(),
                    blocks,
                },
            )
        })
        .collect();
    reqs.sort_by_key(|r| r.0);
    reqs.into_iter().map(|r| r.1).collect()
}

fn full(r: &Req, bt: u64) -> &[u64] {
    &r.blocks[..(r.input / bt) as usize]
}

fn hit_tokens(hits: usize, bt: u64, input: u64) -> u64 {
    (hits as u64 * bt).min(input - 1)
}

/// Hit tokens with unlimited capacity: the leading full blocks seen before.
pub fn unlimited_hits(reqs: &[Req], bt: u64) -> u64 {
    let mut seen = HashSet::new();
    let mut total = 0;
    for r in reqs {
        let f = full(r, bt);
        total += hit_tokens(
            f.iter().take_while(|b| seen.contains(*b)).count(),
            bt,
            r.input,
        );
        seen.extend(f.iter().copied());
    }
    total
}

/// Hit tokens of a plain LRU prefix cache of `capacity` blocks, one request at a time, in the
/// order of vLLM's offloading connector:
/// 1. lookup: the request's cached blocks become the most recently used, its first block the
///    most recent of them (vLLM touches blocks in reverse);
/// 2. the hit blocks are loaded; their release makes them the most recent, in prompt order;
/// 3. the blocks after the hit are stored: the missing ones are inserted in order, evicting the
///    least recently used blocks other than those after the hit (a hit block may go); when too
///    few can be evicted, none is inserted; a store that inserts any touches the request's
///    cached blocks again as in 1 (after its evictions, before its blocks are inserted).
pub fn lru_hits(reqs: &[Req], bt: u64, capacity: usize) -> u64 {
    let mut lru = Lru::default();
    let mut total = 0;
    for r in reqs {
        let f = full(r, bt);
        let hits = f.iter().take_while(|b| lru.has(**b)).count();
        total += hit_tokens(hits, bt, r.input);
        lru.touch_reversed(f);
        for &b in &f[..hits] {
            lru.use_now(b);
        }
        let named = &f[hits..];
        let mut missing: Vec<u64> = Vec::new();
        for &b in named {
            if !lru.has(b) && !missing.contains(&b) {
                missing.push(b);
            }
        }
        if missing.is_empty() {
            continue;
        }
        let over = (lru.len() + missing.len()).saturating_sub(capacity);
        let Some(victims) = lru.oldest_except(over, named) else {
            continue;
        };
        for v in victims {
            lru.remove(v);
        }
        lru.touch_reversed(f);
        for b in missing {
            lru.use_now(b);
        }
    }
    total
}

/// Blocks ordered by last use.
#[derive(Default)]
struct Lru {
    stamp_of: HashMap<u64, u64>,
    by_stamp: std::collections::BTreeMap<u64, u64>,
    clock: u64,
}

impl Lru {
    fn has(&self, b: u64) -> bool {
        self.stamp_of.contains_key(&b)
    }
    fn len(&self) -> usize {
        self.stamp_of.len()
    }
    /// Makes `b` the most recently used (inserting it).
    fn use_now(&mut self, b: u64) {
        if let Some(s) = self.stamp_of.get(&b) {
            self.by_stamp.remove(s);
        }
        self.clock += 1;
        self.stamp_of.insert(b, self.clock);
        self.by_stamp.insert(self.clock, b);
    }
    /// Uses the cached blocks of `keys`, last first.
    fn touch_reversed(&mut self, keys: &[u64]) {
        for &b in keys.iter().rev() {
            if self.has(b) {
                self.use_now(b);
            }
        }
    }
    /// The `n` least recently used blocks not in `except`, or None if there are fewer.
    fn oldest_except(&self, n: usize, except: &[u64]) -> Option<Vec<u64>> {
        let v: Vec<u64> = self
            .by_stamp
            .values()
            .filter(|k| !except.contains(k))
            .take(n)
            .copied()
            .collect();
        (v.len() == n).then_some(v)
    }
    fn remove(&mut self, b: u64) {
        if let Some(s) = self.stamp_of.remove(&b) {
            self.by_stamp.remove(&s);
        }
    }
}

/// Prompt tokens of a trace.
pub fn prompt_tokens(reqs: &[Req]) -> u64 {
    reqs.iter().map(|r| r.input).sum()
}

/// The curve of `policy` in a `--sweep --json` report.
pub fn curve<'a>(report: &'a Value, policy: &str) -> &'a Vec<Value> {
    report["sweep"]["curves"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["policy"] == policy)
        .unwrap_or_else(|| panic!("no {policy} curve"))["hit_pct"]
        .as_array()
        .unwrap()
}

/// Checks a `--sweep` report against the models: the LRU curve equals the plain LRU cache at
/// every capacity, the unlimited hit rate equals the leading blocks seen before, and every
/// policy reaches it at the last capacity (room for every distinct block).
pub fn check_sweep(report: &Value, reqs: &[Req], bt: u64) {
    let prompt = prompt_tokens(reqs) as f64;
    let pct = |t: u64| 100.0 * t as f64 / prompt;
    let caps: Vec<u64> = report["sweep"]["capacities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap())
        .collect();
    let unlimited = pct(unlimited_hits(reqs, bt));
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(close(
        report["sweep"]["unlimited_hit_pct"].as_f64().unwrap(),
        unlimited
    ));
    let lru = curve(report, "lru");
    for (i, &c) in caps.iter().enumerate() {
        let model = pct(lru_hits(reqs, bt, c as usize));
        assert!(
            close(lru[i].as_f64().unwrap(), model),
            "LRU at {c} blocks: {} vs the model's {model}",
            lru[i]
        );
    }
    for p in ["lru", "arc", "min"] {
        let last = curve(report, p).last().unwrap().as_f64().unwrap();
        assert!(
            close(last, unlimited),
            "{p} at every block: {last} vs {unlimited}"
        );
    }
}

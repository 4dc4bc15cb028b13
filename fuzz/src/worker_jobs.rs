//! Worker job specifications on host memory (the host backend): arbitrary block ids, slot ids,
//! group sizes and first-block offsets, alone, as step plans with flush sets, and swaps; polls,
//! waits and shutdown. Every byte of the KV tensors and host buffers is modelled; after waits the
//! memory is compared with the model, and every completion is checked (success exactly for the
//! jobs that fit the registration, bytes copied, order per direction, error text for failures).

use crate::step_decode::{Plan, PlanJob, write_plan};
use arbitrary::Arbitrary;
use kvoffload::Error;
use kvoffload::plan::{Direction, Step};
use kvoffload::transfer::{BackendKind, Completion, JobBlocks, KvTensor, Worker, WorkerConfig};
use std::collections::BTreeMap;
use std::time::Duration;

/// A fuzz input: the registration and the calls.
#[derive(Arbitrary, Debug)]
pub struct Input {
    factor: u8,
    slots: u8,
    threads: u8,
    tensors: Vec<TensorSpec>,
    borrowed_host: bool,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
struct TensorSpec {
    blocks: u8,
    page_words: u8,
    gap_words: u8,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Fill {
        tensor: u8,
        block: u8,
        seed: u8,
    },
    Submit {
        id: u8,
        job: JobSpec,
    },
    Step {
        jobs: Vec<(u8, JobSpec)>,
        flush: Vec<u8>,
    },
    Poll {
        max: u8,
    },
    Wait {
        ids: Vec<u8>,
        unknown: bool,
    },
    Swap {
        src_t: u8,
        dst_t: u8,
        src: Vec<u8>,
        dst: Vec<u8>,
        job: Option<u8>,
    },
    Check,
    /// Submits the stores held from the last plan.
    SubmitStores,
    Shutdown,
}

#[derive(Arbitrary, Debug, Clone)]
struct JobSpec {
    store: bool,
    src: Vec<u8>,
    dst: Vec<u8>,
    block_index: u8,
}

/// One byte region `[start, end)` in one memory (0..T: tensors, T..2T: host buffers).
type Region = (usize, usize, usize);

#[derive(Debug, Clone)]
struct Pending {
    /// Expected success and bytes.
    ok: bool,
    bytes: u64,
    dir_store: bool,
    /// Still possibly copying (not waited for).
    running: bool,
    reads: Vec<Region>,
    writes: Vec<Region>,
    /// Submitted after a refusal-free plan: its order among valid jobs of its direction.
    seq: u64,
}

struct Mem {
    /// Real memory, 8-byte words.
    words: Vec<Vec<u64>>,
    /// The model: each byte's expected value, or None where it cannot be known.
    model: Vec<Vec<Option<u8>>>,
}

impl Mem {
    fn bytes(&self, m: usize) -> &[u8] {
        let w = &self.words[m];
        // SAFETY: plain u64 memory viewed as bytes.
        unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u8, w.len() * 8) }
    }

    fn bytes_mut(&mut self, m: usize) -> &mut [u8] {
        let w = &mut self.words[m];
        // SAFETY: plain u64 memory viewed as bytes.
        unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, w.len() * 8) }
    }
}

struct Layout {
    tensors: Vec<KvTensor>,
    factor: u32,
    slots: u32,
    /// Host buffers are the harness's (borrowed) or the worker's (read through host_buffer).
    borrowed: bool,
}

impl Layout {
    fn t(&self) -> usize {
        self.tensors.len()
    }

    /// The copies of a job as (src region, dst region) pairs, or None when the library must
    /// refuse it (counts that do not fit, ids outside the registration).
    fn plan(
        &self,
        kind: Direction,
        src: &[u32],
        dst: &[u32],
        block_index: u32,
    ) -> Option<Vec<(Region, Region)>> {
        let (kv, slots) = match kind {
            Direction::Store => (src, dst),
            Direction::Load => (dst, src),
        };
        let f = self.factor as usize;
        let skip = block_index as usize % f;
        if slots.len() != (kv.len() + skip).div_ceil(f) {
            return None;
        }
        let nb = self.tensors.iter().map(|t| t.num_blocks).min().unwrap_or(0);
        if kv.iter().any(|&b| b >= nb) || slots.iter().any(|&s| s >= self.slots) {
            return None;
        }
        let mut out = Vec::new();
        for (ti, t) in self.tensors.iter().enumerate() {
            let page = t.page_size as usize;
            for (i, &b) in kv.iter().enumerate() {
                let k = skip + i;
                let kv_at = b as usize * t.block_stride as usize;
                let host_at = (slots[k / f] as usize * f + k % f) * page;
                let kv_r = (ti, kv_at, kv_at + page);
                let host_r = (self.t() + ti, host_at, host_at + page);
                out.push(match kind {
                    Direction::Store => (kv_r, host_r),
                    Direction::Load => (host_r, kv_r),
                });
            }
        }
        Some(out)
    }
}

fn overlap(a: &Region, b: &Region) -> bool {
    a.0 == b.0 && a.1 < b.2 && b.1 < a.2
}

/// Applies copies to the model in order; a byte written twice by the same job is unknown.
fn apply_model(mem: &mut Mem, copies: &[(Region, Region)]) {
    let mut staged: Vec<(Region, Vec<Option<u8>>)> = Vec::new();
    for &(s, d) in copies {
        staged.push((d, mem.model[s.0][s.1..s.2].to_vec()));
    }
    for (i, (d, v)) in staged.iter().enumerate() {
        let twice = staged
            .iter()
            .enumerate()
            .any(|(j, (e, _))| j != i && overlap(d, e));
        for (k, b) in v.iter().enumerate() {
            mem.model[d.0][d.1 + k] = if twice { None } else { *b };
        }
    }
}

fn mark_unknown(mem: &mut Mem, regions: &[Region]) {
    for r in regions {
        mem.model[r.0][r.1..r.2].fill(None);
    }
}

struct Harness {
    w: Worker,
    lay: Layout,
    mem: Mem,
    pending: BTreeMap<u64, Pending>,
    seq: u64,
    shut_down: bool,
    /// Last sequence number polled per direction (store, load).
    last_seq: [u64; 2],
    /// The stores of the last plan: the worker holds them until the next plan, a wait naming
    /// one, `submit_stores` or shutdown; their place in the store queue is known then.
    held: Vec<u64>,
}

impl Harness {
    fn host_ptr(&self, t: usize) -> *mut u8 {
        if self.lay.borrowed {
            self.mem.words[self.lay.t() + t].as_ptr() as *mut u8
        } else {
            self.w.host_buffer(t).expect("tensor").0
        }
    }

    /// Bytes of memory `m` as the library sees them.
    fn real(&self, m: usize) -> Vec<u8> {
        let t = self.lay.t();
        if m < t || self.lay.borrowed {
            return self.mem.bytes(m).to_vec();
        }
        let len = self.mem.model[m].len();
        let p = self.host_ptr(m - t);
        // SAFETY: the worker's host buffer of at least `len` bytes; no job is running.
        unsafe { std::slice::from_raw_parts(p, len) }.to_vec()
    }

    /// The held stores enter the store queue now (in plan order).
    fn release_held(&mut self) {
        for id in std::mem::take(&mut self.held) {
            let p = self.pending.get_mut(&id).expect("held store pending");
            if p.ok {
                self.seq += 1;
                p.seq = self.seq;
            }
        }
    }

    fn wait_ids(&mut self, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        if ids.iter().any(|id| self.held.contains(id)) {
            self.release_held();
        }
        self.w
            .wait(ids, Duration::from_secs(60))
            .expect("wait for submitted jobs");
        for id in ids {
            self.pending.get_mut(id).expect("pending").running = false;
        }
    }

    fn wait_all(&mut self) {
        let ids: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.running)
            .map(|(&i, _)| i)
            .collect();
        self.wait_ids(&ids);
    }

    /// Waits for the running jobs whose regions conflict with `reads` / `writes`.
    fn wait_conflicts(&mut self, reads: &[Region], writes: &[Region]) {
        let ids: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| {
                p.running
                    && (p
                        .writes
                        .iter()
                        .any(|a| reads.iter().chain(writes).any(|b| overlap(a, b)))
                        || p.reads.iter().any(|a| writes.iter().any(|b| overlap(a, b))))
            })
            .map(|(&i, _)| i)
            .collect();
        self.wait_ids(&ids);
    }

    fn ids(&self, spec: &JobSpec) -> (Direction, Vec<u32>, Vec<u32>, u32) {
        let nb = self
            .lay
            .tensors
            .iter()
            .map(|t| t.num_blocks)
            .min()
            .unwrap_or(0);
        let block = |b: &u8| *b as u32 % (nb + 2);
        let slot = |s: &u8| *s as u32 % (self.lay.slots + 2);
        let kind = if spec.store {
            Direction::Store
        } else {
            Direction::Load
        };
        let (src, dst) = if spec.store {
            (
                spec.src.iter().map(block).collect(),
                spec.dst.iter().map(slot).collect(),
            )
        } else {
            (
                spec.src.iter().map(slot).collect(),
                spec.dst.iter().map(block).collect(),
            )
        };
        (kind, src, dst, spec.block_index as u32 % 8)
    }

    fn record(&mut self, id: u64, kind: Direction, copies: Option<Vec<(Region, Region)>>) {
        let ok = copies.is_some();
        let copies = copies.unwrap_or_default();
        let bytes = copies.iter().map(|c| (c.0.2 - c.0.1) as u64).sum();
        let seq = if ok {
            self.seq += 1;
            self.seq
        } else {
            0
        };
        self.pending.insert(
            id,
            Pending {
                ok,
                bytes,
                dir_store: kind == Direction::Store,
                running: ok,
                reads: copies.iter().map(|c| c.0).collect(),
                writes: copies.iter().map(|c| c.1).collect(),
                seq,
            },
        );
    }

    fn check_completion(&mut self, c: &Completion) {
        let p = self
            .pending
            .remove(&c.job_id)
            .unwrap_or_else(|| panic!("poll reported job {}, not pending", c.job_id));
        assert_eq!(c.success, p.ok, "job {} success: {:?}", c.job_id, c.error);
        if p.ok {
            assert_eq!(c.bytes, p.bytes, "job {} bytes", c.job_id);
            let d = p.dir_store as usize;
            assert!(
                p.seq > self.last_seq[d],
                "job {} completed out of submission order",
                c.job_id
            );
            self.last_seq[d] = p.seq;
        } else {
            assert!(
                c.error.as_ref().is_some_and(|e| !e.is_empty()),
                "failed job {} has no error text",
                c.job_id
            );
        }
    }

    fn compare(&mut self) {
        if !self.shut_down {
            self.w.submit_stores().expect("submit_stores");
            self.release_held();
        }
        self.wait_all();
        for m in 0..self.mem.model.len() {
            let real = self.real(m);
            for (i, (r, want)) in real.iter().zip(&self.mem.model[m]).enumerate() {
                if let Some(w) = want {
                    assert_eq!(r, w, "memory {m} byte {i} differs from the model");
                }
            }
        }
    }
}

/// Runs one input; panics when the library breaks a promise.
pub fn run(input: &Input) {
    let factor = 1 + input.factor as u32 % 3;
    let slots = 1 + input.slots as u32 % 6;
    let specs: Vec<&TensorSpec> = input.tensors.iter().take(3).collect();
    if specs.is_empty() {
        return;
    }
    let mut words: Vec<Vec<u64>> = Vec::new();
    let mut tensors = Vec::new();
    for s in &specs {
        let nb = 1 + s.blocks as u32 % 8;
        let page = 1 + s.page_words as u64 % 4;
        let stride = page + s.gap_words as u64 % 3;
        let n = (nb as u64 * stride) as usize;
        let w: Vec<u64> = (0..n as u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        tensors.push((nb, page * 8, stride * 8));
        words.push(w);
    }
    for &(_, page, _) in &tensors {
        let n = (slots as u64 * factor as u64 * page / 8) as usize;
        words.push((0..n as u64).map(|i| !i).collect());
    }
    let kv: Vec<KvTensor> = tensors
        .iter()
        .zip(&words)
        .map(|(&(nb, page, stride), w)| KvTensor {
            base: w.as_ptr() as u64,
            num_blocks: nb,
            block_stride: stride,
            page_size: page,
            on_device: false,
        })
        .collect();
    let t = kv.len();
    let host: Vec<(*mut u8, usize)> = words[t..]
        .iter_mut()
        .map(|w| (w.as_mut_ptr() as *mut u8, w.len() * 8))
        .collect();
    let cfg = WorkerConfig {
        block_size_factor: factor,
        num_host_slots: slots,
        threads: 1 + input.threads as usize % 3,
        backend: BackendKind::Host,
    };
    let w = Worker::new(cfg, &kv, input.borrowed_host.then_some(&host[..]))
        .expect("a valid registration");
    let mut mem = Mem {
        model: Vec::new(),
        words,
    };
    for m in 0..2 * t {
        let known = m < t || input.borrowed_host;
        let v: Vec<Option<u8>> = if known {
            mem.bytes(m).iter().map(|&b| Some(b)).collect()
        } else {
            vec![None; mem.words[m].len() * 8]
        };
        mem.model.push(v);
    }
    let mut h = Harness {
        w,
        lay: Layout {
            tensors: kv,
            factor,
            slots,
            borrowed: input.borrowed_host,
        },
        mem,
        pending: BTreeMap::new(),
        seq: 0,
        shut_down: false,
        last_seq: [0, 0],
        held: Vec::new(),
    };
    for op in &input.ops {
        apply(&mut h, op);
    }
    h.compare();
    let mut out = Vec::new();
    h.w.poll(&mut out, usize::MAX).expect("poll");
    for c in &out {
        h.check_completion(c);
    }
    assert!(
        h.pending.is_empty(),
        "jobs never reported: {:?}",
        h.pending.keys()
    );
}

fn apply(h: &mut Harness, op: &Op) {
    match op {
        Op::Fill {
            tensor,
            block,
            seed,
        } => {
            let ti = *tensor as usize % h.lay.t();
            let tt = h.lay.tensors[ti];
            let b = *block as u32 % tt.num_blocks;
            let at = (b as u64 * tt.block_stride) as usize;
            let r = (ti, at, at + tt.page_size as usize);
            h.wait_conflicts(&[], &[r]);
            for k in r.1..r.2 {
                let v = (k as u8).wrapping_mul(31) ^ seed;
                h.mem.bytes_mut(ti)[k] = v;
                h.mem.model[ti][k] = Some(v);
            }
        }
        Op::Submit { id, job } => {
            let id = *id as u64 % 24;
            let (kind, src, dst, bi) = h.ids(job);
            let copies = h.lay.plan(kind, &src, &dst, bi);
            let in_use = h.pending.contains_key(&id);
            if let Some(c) = &copies {
                let reads: Vec<Region> = c.iter().map(|x| x.0).collect();
                let writes: Vec<Region> = c.iter().map(|x| x.1).collect();
                h.wait_conflicts(&reads, &writes);
            }
            let blocks = JobBlocks {
                kind,
                src: &src,
                dst: &dst,
                block_index: bi,
            };
            let r = h.w.submit(id, &blocks, 0);
            if in_use || h.shut_down {
                assert!(
                    matches!(r, Err(Error::InvalidState(_))),
                    "submit of job {id}: {r:?}"
                );
                return;
            }
            r.expect("submit of a new job id");
            if let Some(c) = &copies {
                apply_model(&mut h.mem, c);
            }
            h.record(id, kind, copies);
        }
        Op::Step { jobs, flush } => step(h, jobs, flush),
        Op::Poll { max } => {
            let mut out = Vec::new();
            h.w.poll(&mut out, *max as usize % 6).expect("poll");
            assert!(out.len() <= *max as usize % 6);
            for c in &out {
                h.check_completion(c);
            }
        }
        Op::Wait { ids, unknown } => {
            let known: Vec<u64> = h.pending.keys().copied().collect();
            let mut list: Vec<u64> = if known.is_empty() {
                Vec::new()
            } else {
                ids.iter()
                    .map(|&i| known[i as usize % known.len()])
                    .collect()
            };
            if *unknown {
                list.push(1000);
            } else if list.iter().any(|id| h.held.contains(id)) {
                h.release_held();
            }
            let r = h.w.wait(&list, Duration::from_secs(60));
            if *unknown {
                assert!(
                    matches!(r, Err(Error::NotFound(_))),
                    "wait for an unknown id: {r:?}"
                );
            } else {
                r.expect("wait for pending jobs");
                for id in list {
                    h.pending.get_mut(&id).expect("pending").running = false;
                }
            }
        }
        Op::Swap {
            src_t,
            dst_t,
            src,
            dst,
            job,
        } => swap(h, *src_t, *dst_t, src, dst, *job),
        Op::Check => h.compare(),
        Op::SubmitStores => {
            let r = h.w.submit_stores();
            assert_eq!(r.is_ok(), !h.shut_down, "submit_stores: {r:?}");
            if r.is_ok() {
                h.release_held();
            }
        }
        Op::Shutdown => {
            h.release_held();
            h.w.shutdown().expect("shutdown");
            h.shut_down = true;
            for p in h.pending.values_mut() {
                p.running = false;
            }
        }
    }
}

fn step(h: &mut Harness, jobs: &[(u8, JobSpec)], flush: &[u8]) {
    let known: Vec<u64> = h.pending.keys().copied().collect();
    let mut plan = Plan {
        factor: h.lay.factor,
        jobs: Vec::new(),
        flush: Vec::new(),
    };
    let mut specs = Vec::new();
    // Loads first, as the scheduler plans them.
    let mut ordered: Vec<&(u8, JobSpec)> = jobs.iter().filter(|j| !j.1.store).collect();
    ordered.extend(jobs.iter().filter(|j| j.1.store));
    for (id, spec) in ordered.into_iter().take(6) {
        let id = *id as u64 % 24;
        let (kind, src, dst, bi) = h.ids(spec);
        plan.jobs.push(PlanJob {
            id,
            store: kind == Direction::Store,
            request_id: 1,
            block_index: bi,
            src: src.clone(),
            dst: dst.clone(),
        });
        specs.push((id, kind, h.lay.plan(kind, &src, &dst, bi)));
    }
    for &f in flush {
        if !known.is_empty() {
            plan.flush.push(known[f as usize % known.len()]);
        }
    }
    // Running jobs the plan's copies conflict with go into its flush set.
    let (mut reads, mut writes) = (Vec::new(), Vec::new());
    for (_, _, c) in &specs {
        for x in c.iter().flatten() {
            reads.push(x.0);
            writes.push(x.1);
        }
    }
    for (&id, p) in &h.pending {
        let conflict = p
            .writes
            .iter()
            .any(|a| reads.iter().chain(&writes).any(|b| overlap(a, b)))
            || p.reads.iter().any(|a| writes.iter().any(|b| overlap(a, b)));
        if p.running && conflict {
            plan.flush.push(id);
        }
    }
    plan.flush.sort_unstable();
    plan.flush.dedup();
    let mut step = Step::new();
    step.decode(&write_plan(&plan))
        .expect("a written plan decodes");
    let dup = specs
        .iter()
        .enumerate()
        .any(|(i, a)| specs[..i].iter().any(|b| b.0 == a.0));
    let in_use = specs.iter().any(|s| h.pending.contains_key(&s.0));
    let r = h.w.submit_step(&step, 0);
    if h.shut_down || dup || in_use {
        assert!(
            r.is_err(),
            "a plan with reused job ids or after shutdown was taken"
        );
        return;
    }
    r.expect("submit_step");
    // The previous plan's stores were submitted first.
    h.release_held();
    for id in &plan.flush {
        if let Some(p) = h.pending.get_mut(id) {
            p.running = false;
        }
    }
    // Loads and stores of one plan run on different queues: where they conflict with each
    // other the result is unordered, so their destinations become unknown.
    let mut unknown = Vec::new();
    for (i, a) in specs.iter().enumerate() {
        for b in &specs[..i] {
            if a.1 == b.1 {
                continue;
            }
            let (Some(ca), Some(cb)) = (&a.2, &b.2) else {
                continue;
            };
            let hit = ca.iter().any(|x| {
                cb.iter()
                    .any(|y| overlap(&x.1, &y.0) || overlap(&x.0, &y.1) || overlap(&x.1, &y.1))
            });
            if hit {
                unknown.extend(ca.iter().map(|x| x.1));
                unknown.extend(cb.iter().map(|y| y.1));
            }
        }
    }
    for (id, kind, copies) in specs {
        if let Some(c) = &copies {
            apply_model(&mut h.mem, c);
        }
        h.record(id, kind, copies);
        if kind == Direction::Store {
            let p = h.pending.get_mut(&id).expect("recorded");
            p.seq = 0;
            h.held.push(id);
        }
    }
    mark_unknown(&mut h.mem, &unknown);
}

fn swap(h: &mut Harness, src_t: u8, dst_t: u8, src: &[u8], dst: &[u8], job: Option<u8>) {
    let t = h.lay.t();
    let (st, dt) = (src_t as usize % (t + 1), dst_t as usize % (t + 1));
    let pick = |ti: usize, b: &u8| {
        let nb = h.lay.tensors.get(ti).map_or(4, |x| x.num_blocks);
        *b as u32 % (nb + 1)
    };
    let sb: Vec<u32> = src.iter().take(6).map(|b| pick(st, b)).collect();
    let db: Vec<u32> = dst.iter().take(6).map(|b| pick(dt, b)).collect();
    let valid = st < t
        && dt < t
        && sb.len() == db.len()
        && h.lay.tensors[st].page_size == h.lay.tensors[dt].page_size
        && sb.iter().all(|&b| b < h.lay.tensors[st].num_blocks)
        && db.iter().all(|&b| b < h.lay.tensors[dt].num_blocks)
        && !(st == dt && sb.iter().any(|b| db.contains(b)));
    let job = job.map(|j| j as u64 % 24 + 100);
    h.wait_all();
    let r = h.w.swap_blocks(st, dt, &sb, &db, job);
    let in_use = job.is_some_and(|j| h.pending.contains_key(&j));
    if !valid || h.shut_down || in_use {
        assert!(
            r.is_err(),
            "swap accepted: valid {valid}, shut down {}, id in use {in_use}",
            h.shut_down
        );
        return;
    }
    r.expect("swap_blocks");
    let copies: Vec<(Region, Region)> = sb
        .iter()
        .zip(&db)
        .map(|(&a, &b)| {
            let (s, d) = (h.lay.tensors[st], h.lay.tensors[dt]);
            let sa = (a as u64 * s.block_stride) as usize;
            let da = (b as u64 * d.block_stride) as usize;
            (
                (st, sa, sa + s.page_size as usize),
                (dt, da, da + d.page_size as usize),
            )
        })
        .collect();
    apply_model(&mut h.mem, &copies);
    if let Some(id) = job {
        // Queued swaps are reported by poll like jobs (into KV tensors in host memory: the
        // store queue).
        h.seq += 1;
        h.pending.insert(
            id,
            Pending {
                ok: true,
                bytes: copies.iter().map(|c| (c.0.2 - c.0.1) as u64).sum(),
                dir_store: true,
                running: true,
                reads: copies.iter().map(|c| c.0).collect(),
                writes: copies.iter().map(|c| c.1).collect(),
                seq: h.seq,
            },
        );
    }
}

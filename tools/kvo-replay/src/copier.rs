//! `--copy`: the library's worker executes every job of the simulated engine on real memory. The
//! "GPU" KV cache is one tensor in host memory; each block the engine computes is filled with a
//! pattern derived from its block hash, and each block a load brings back is checked against the
//! pattern of the hash it should hold, so a load of the wrong slot or a store of a reused block
//! shows up as a mismatch.

use anyhow::{Context, Result, bail};
use kvoffload::plan::{Direction, Step};
use kvoffload::transfer::{Completion, KvTensor, Worker, WorkerConfig};
use serde::Serialize;
use std::alloc::Layout;
use std::collections::HashMap;
use std::time::Duration;

/// Bytes moved and time taken in one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Traffic {
    /// Jobs completed.
    pub jobs: u64,
    /// Bytes the worker copied.
    pub bytes: u64,
    /// Seconds its copies took.
    pub seconds: f64,
    /// `bytes / seconds` in GB/s (10^9 bytes).
    pub gb_per_s: f64,
}

impl Traffic {
    fn add(&mut self, c: &Completion) {
        self.jobs += 1;
        self.bytes += c.bytes;
        self.seconds += c.seconds;
        self.gb_per_s = if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        };
    }
}

/// The KV memory: page-aligned, owned, freed after the worker (field order in [`Copier`]).
struct KvMemory {
    ptr: *mut u8,
    layout: Layout,
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `Copier::new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// The worker and its memory.
pub struct Copier {
    /// Declared first: dropped (its copies finished) before the memory it reads.
    worker: Worker,
    kv: KvMemory,
    page: usize,
    num_blocks: u32,
    /// Completions polled but not yet due.
    done: HashMap<u64, Completion>,
    polled: Vec<Completion>,
    /// Loads (host → KV) and stores (KV → host).
    pub loads: Traffic,
    pub stores: Traffic,
    /// Blocks checked after a load.
    pub verified_blocks: u64,
}

/// The 8-byte word `i` of the pattern of `hash`.
#[inline]
fn word(hash: u128, i: usize) -> u64 {
    let h = (hash as u64) ^ ((hash >> 64) as u64).rotate_left(17);
    h ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Copier {
    /// A worker over `num_blocks` KV blocks of `page` bytes and a host tier of `num_slots`
    /// slots of `factor` blocks.
    pub fn new(num_blocks: u32, page: u64, num_slots: u32, factor: u32) -> Result<Self> {
        let page_usize = usize::try_from(page).context("--kv-bytes-per-token: block too large")?;
        if !page.is_multiple_of(8) {
            bail!(
                "--copy: a block of {page} bytes is not a multiple of 8 (set --kv-bytes-per-token)"
            );
        }
        let len = page_usize
            .checked_mul(num_blocks as usize)
            .context("--copy: the KV cache size overflows")?;
        let layout = Layout::from_size_align(len, 4096).context("--copy: KV cache layout")?;
        // SAFETY: non-zero size (num_blocks >= 1 and page >= 8 are checked by the options).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            bail!("--copy: cannot allocate the {len}-byte KV cache");
        }
        let kv = KvMemory { ptr, layout };
        let tensor = KvTensor {
            base: ptr as u64,
            num_blocks,
            block_stride: page,
            page_size: page,
            on_device: false,
        };
        let worker = Worker::new(
            WorkerConfig {
                block_size_factor: factor,
                num_host_slots: num_slots,
                ..Default::default()
            },
            &[tensor],
            None,
        )
        .context("--copy: the worker")?;
        Ok(Self {
            worker,
            kv,
            page: page_usize,
            num_blocks,
            done: HashMap::new(),
            polled: Vec::new(),
            loads: Traffic::default(),
            stores: Traffic::default(),
            verified_blocks: 0,
        })
    }

    fn block_words(&mut self, b: u32) -> &mut [u64] {
        assert!(b < self.num_blocks, "block {b} outside the KV cache");
        // SAFETY: block `b` lies inside the allocation (checked above), is 8-byte aligned (page
        // is a multiple of 8 and the base page-aligned), and no copy of the worker touches it
        // now: the engine fills a block only after the flush set of the step that allocated it
        // finished, and checks one only after the load writing it completed.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.kv.ptr.add(b as usize * self.page).cast::<u64>(),
                self.page / 8,
            )
        }
    }

    /// The forward pass computed block `b`: it now holds the KV of `hash`.
    pub fn fill(&mut self, b: u32, hash: u128) {
        for (i, w) in self.block_words(b).iter_mut().enumerate() {
            *w = word(hash, i);
        }
    }

    /// True when block `b` holds the KV of `hash`.
    pub fn check(&mut self, b: u32, hash: u128) -> bool {
        self.verified_blocks += 1;
        self.block_words(b)
            .iter()
            .enumerate()
            .all(|(i, &w)| w == word(hash, i))
    }

    /// Waits for `ids` (a step's flush set) before the forward pass may write their blocks.
    pub fn flush(&mut self, ids: &[u64]) -> Result<()> {
        self.poll()?;
        let open: Vec<u64> = ids
            .iter()
            .copied()
            .filter(|i| !self.done.contains_key(i))
            .collect();
        if !open.is_empty() {
            self.worker
                .wait(&open, Duration::from_secs(60))
                .context("--copy: waiting for the flush set")?;
        }
        Ok(())
    }

    /// Queues the step's jobs.
    pub fn submit(&mut self, step: &Step) -> Result<()> {
        self.worker
            .submit_step(step, 0)
            .context("--copy: submit_step")
    }

    fn poll(&mut self) -> Result<()> {
        self.polled.clear();
        self.worker.poll(&mut self.polled, usize::MAX)?;
        for c in self.polled.drain(..) {
            self.done.insert(c.job_id, c);
        }
        Ok(())
    }

    /// Waits for job `id` and returns whether it succeeded (a failed job is an error: nothing
    /// in the simulation makes one fail).
    pub fn complete(&mut self, id: u64, kind: Direction) -> Result<()> {
        if !self.done.contains_key(&id) {
            self.flush(&[id])?;
            self.poll()?;
        }
        let c = self
            .done
            .remove(&id)
            .with_context(|| format!("--copy: job {id} finished but was not reported"))?;
        if !c.success {
            bail!("--copy: job {id} failed: {}", c.error.unwrap_or_default());
        }
        match kind {
            Direction::Load => self.loads.add(&c),
            Direction::Store => self.stores.add(&c),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_per_hash_and_word() {
        assert_ne!(word(1, 0), word(2, 0));
        assert_ne!(word(1, 0), word(1, 1));
        assert_ne!(word(1 << 64, 0), word(1, 0));
        let mut c = Copier::new(2, 64, 4, 1).unwrap();
        c.fill(1, 7);
        assert!(c.check(1, 7));
        assert!(!c.check(1, 8));
        assert!(!c.check(0, 7));
    }
}

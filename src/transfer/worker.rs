//! The worker: a KV layout, host tier buffers and a copy backend; takes jobs (alone or as a whole
//! step plan), reports completions by polling, and waits for listed jobs (the flush before a
//! forward pass).
//!
//! The worker is shared by reference between threads (`&self` everywhere). Its bookkeeping sits
//! behind one lock that is held only for bookkeeping and for handing work to the backend: a
//! thread waiting for jobs (`wait`, the flush of `submit_step`, a synchronous `swap_blocks`,
//! `shutdown`) drops the lock while it blocks and takes it again to look for completions, so
//! other threads keep polling, submitting and reading on the same worker.

use super::backend::{Backend, Completion, CopyDesc, Progress};
use super::copy_plan::{JobBlocks, plan_job, push_merged};
use super::host::HostBackend;
use super::layout::{self, HostBuffer, KvTensor};
use super::stats::WorkerStats;
use crate::error::{Error, Result, invalid};
use crate::plan::{Direction, Step};
use hashbrown::{HashMap, HashSet};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Which copy engine a worker uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// memcpy on host threads (tensors in host memory).
    Host,
    /// The CUDA driver, on this device ordinal.
    Cuda(i32),
}

/// Worker configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerConfig {
    /// GPU blocks per host slot (as the scheduler's).
    pub block_size_factor: u32,
    /// Host slots (as the scheduler's).
    pub num_host_slots: u32,
    /// Threads the host backend may use for one large job, and that pre-fault a host tier
    /// before it is page-locked (>= 1).
    pub threads: usize,
    /// Copy engine.
    pub backend: BackendKind,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            block_size_factor: 1,
            num_host_slots: 0,
            threads: 4,
            backend: BackendKind::Host,
        }
    }
}

/// Where a job id is, from submission until `poll` hands its completion out.
#[derive(Debug)]
enum Job {
    /// Taken by a `submit_step` that is waiting for its flush set.
    Reserved,
    /// A store of the last plan, held until its forward pass has been issued (see
    /// [`Worker::submit_step`]).
    Deferred,
    /// Queued in the backend.
    Running,
    /// Finished; its completion waits in `ready`.
    Done,
    /// A synchronous swap queued in the backend (never handed out by `poll`).
    Swap,
    /// A synchronous swap finished, waiting for its caller to take the completion.
    SwapDone(Completion),
}

/// The bookkeeping behind the worker's lock.
struct State {
    backend: Box<dyn Backend>,
    /// Jobs submitted (or reserved) and not yet handed out by `poll`.
    jobs: HashMap<u64, Job>,
    /// Completions to hand out, oldest first.
    ready: VecDeque<Completion>,
    scratch: Vec<Completion>,
    scratch_ids: HashSet<u64>,
    descs: Vec<CopyDesc>,
    /// The last plan's stores, not yet submitted: they read the KV that plan's forward pass
    /// writes (vLLM 0.24 likewise submits step N's stores at step N + 1).
    deferred: Step,
    /// The compute stream given with the deferred stores.
    deferred_stream: u64,
    /// The direction of every job queued in the backend and not yet handed out.
    directions: HashMap<u64, Direction>,
    /// Counters of the jobs handed out (and of synchronous swaps).
    stats: WorkerStats,
    shut_down: bool,
}

impl State {
    fn check_open(&self) -> Result<()> {
        if self.shut_down {
            return Err(Error::InvalidState("worker is shut down".into()));
        }
        Ok(())
    }

    fn check_new_id(&self, job_id: u64) -> Result<()> {
        self.check_open()?;
        if self.jobs.contains_key(&job_id) {
            return Err(Error::InvalidState(format!(
                "job_id: {job_id} is already submitted"
            )));
        }
        Ok(())
    }

    /// True while `job_id` is reserved or copying.
    fn pending(&self, job_id: u64) -> bool {
        matches!(
            self.jobs.get(&job_id),
            Some(Job::Reserved | Job::Deferred | Job::Running | Job::Swap)
        )
    }

    /// Moves the backend's finished jobs into `ready` (a synchronous swap's to its entry).
    fn collect(&mut self) -> Result<()> {
        self.scratch.clear();
        self.backend.poll(&mut self.scratch)?;
        for c in self.scratch.drain(..) {
            match self.jobs.get_mut(&c.job_id) {
                Some(j @ Job::Swap) => *j = Job::SwapDone(c),
                Some(j) => {
                    *j = Job::Done;
                    self.ready.push_back(c);
                }
                None => self.ready.push_back(c),
            }
        }
        Ok(())
    }
}

/// Executes load and store jobs between registered KV tensors and host tier buffers.
pub struct Worker {
    cfg: WorkerConfig,
    kv: Vec<KvTensor>,
    /// Declared before `host`: fields drop in order, so copies finish before buffers are freed.
    state: Mutex<State>,
    /// Wakes waiting threads when the backend finishes a job (`None`: they poll).
    progress: Option<Arc<Progress>>,
    host: Vec<HostBuffer>,
}

impl Worker {
    /// A worker over `tensors` (the server's KV cache, canonical layout). Host tier buffers are
    /// allocated (page-aligned, zero-filled lazily by the kernel; with CUDA pre-faulted on
    /// `cfg.threads` threads and page-locked), or taken from `host_buffers` (one
    /// `(pointer, length)` per tensor, kept valid by the caller until the worker is dropped).
    /// Every size is checked before any memory is touched; on failure everything allocated or
    /// page-locked so far is released.
    pub fn new(
        cfg: WorkerConfig,
        tensors: &[KvTensor],
        host_buffers: Option<&[(*mut u8, usize)]>,
    ) -> Result<Self> {
        if cfg.block_size_factor == 0 {
            return Err(invalid!("block_size_factor: 0"));
        }
        if cfg.num_host_slots == 0 {
            return Err(invalid!("num_host_slots: 0"));
        }
        layout::validate(tensors)?;
        match host_buffers {
            Some(bufs) => {
                if bufs.len() != tensors.len() {
                    return Err(invalid!(
                        "host_buffers: {} buffers for {} tensors",
                        bufs.len(),
                        tensors.len()
                    ));
                }
                layout::validate_host_buffers(bufs, tensors)?;
            }
            None => layout::check_tier_fits(tensors, cfg.num_host_slots, cfg.block_size_factor)?,
        }
        // Caller buffers are checked before anything is created.
        let borrowed: Option<Vec<HostBuffer>> = host_buffers
            .map(|mem| {
                mem.iter()
                    .zip(tensors)
                    .enumerate()
                    .map(|(i, (&(p, len), t))| {
                        HostBuffer::borrowed(
                            p,
                            len,
                            cfg.num_host_slots,
                            t.page_size,
                            cfg.block_size_factor,
                        )
                        .map_err(|e| invalid!("host_buffers[{i}]: {e}"))
                    })
                    .collect()
            })
            .transpose()?;
        if cfg.backend == BackendKind::Host
            && let Some(i) = tensors.iter().position(|t| t.on_device)
        {
            return Err(invalid!(
                "tensors[{i}]: device memory needs the CUDA backend"
            ));
        }
        let backend: Box<dyn Backend> = match cfg.backend {
            BackendKind::Host => Box::new(HostBackend::new(cfg.threads)?),
            BackendKind::Cuda(device) => Box::new(super::cuda::CudaBackend::new(device)?),
        };
        Self::with_backend(cfg, tensors, borrowed, backend)
    }

    /// [`Worker::new`] after the checks, on `backend` (tests use their own).
    pub(crate) fn with_backend(
        cfg: WorkerConfig,
        tensors: &[KvTensor],
        borrowed: Option<Vec<HostBuffer>>,
        backend: Box<dyn Backend>,
    ) -> Result<Self> {
        let progress = backend.progress();
        let state = State {
            backend,
            jobs: HashMap::new(),
            ready: VecDeque::new(),
            scratch: Vec::new(),
            scratch_ids: HashSet::new(),
            descs: Vec::new(),
            deferred: Step::new(),
            deferred_stream: 0,
            directions: HashMap::new(),
            stats: WorkerStats::default(),
            shut_down: false,
        };
        // From here on `Drop` unregisters and frees whatever was set up.
        let mut w = Self {
            cfg,
            kv: tensors.to_vec(),
            state: Mutex::new(state),
            progress,
            host: Vec::with_capacity(tensors.len()),
        };
        let pin = matches!(cfg.backend, BackendKind::Cuda(_));
        let mut borrowed = borrowed.map(Vec::into_iter);
        for t in tensors {
            let buf = match borrowed.as_mut().and_then(Iterator::next) {
                Some(b) => b,
                None => {
                    let b = HostBuffer::allocate(
                        cfg.num_host_slots,
                        t.page_size,
                        cfg.block_size_factor,
                    )?;
                    if pin {
                        // Page-locking faults every page in; doing it first, in parallel, is
                        // faster than the driver's single thread.
                        b.prefault(cfg.threads);
                    }
                    b
                }
            };
            let (p, len) = buf.raw();
            let st = w.state.get_mut().unwrap_or_else(|e| e.into_inner());
            // Pushed only once registered: `Drop` unregisters exactly the buffers in `host`.
            st.backend.register_host(p, len)?;
            w.host.push(buf);
        }
        Ok(w)
    }

    /// The configuration.
    pub fn config(&self) -> &WorkerConfig {
        &self.cfg
    }

    /// The host tier buffer of tensor `t`: (address, length).
    pub fn host_buffer(&self, t: usize) -> Result<(*mut u8, usize)> {
        self.host
            .get(t)
            .map(|h| h.raw())
            .ok_or_else(|| invalid!("tensor: {t} of {}", self.host.len()))
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::Internal("worker: unusable after an earlier panic".into()))
    }

    /// Plans and queues job `job_id` (reserved or new): a job that cannot be planned or queued
    /// completes as failed at the next poll.
    fn queue(&self, st: &mut State, job_id: u64, job: &JobBlocks<'_>, compute_stream: u64) {
        st.directions.insert(job_id, job.kind);
        st.descs.clear();
        let planned = plan_job(
            job,
            &self.kv,
            &self.host,
            self.cfg.block_size_factor,
            self.cfg.num_host_slots,
            &mut st.descs,
        );
        let submitted = planned.and_then(|_| {
            st.backend
                .submit(job_id, job.kind, &st.descs, compute_stream)
        });
        match submitted {
            Ok(()) => {
                st.jobs.insert(job_id, Job::Running);
            }
            Err(e) => {
                st.jobs.insert(job_id, Job::Done);
                st.ready.push_back(Completion {
                    job_id,
                    success: false,
                    bytes: 0,
                    seconds: 0.0,
                    error: Some(e.to_string()),
                });
            }
        }
    }

    /// Queues the stores deferred from the last plan.
    fn submit_deferred(&self, st: &mut State) {
        let deferred = std::mem::take(&mut st.deferred);
        for j in deferred.jobs() {
            let blocks = JobBlocks {
                kind: j.kind,
                src: deferred.src(j),
                dst: deferred.dst(j),
                block_index: j.block_index,
            };
            self.queue(st, j.id, &blocks, st.deferred_stream);
        }
        st.deferred = deferred;
        st.deferred.clear(self.cfg.block_size_factor);
    }

    /// Submits the stores deferred from the last plan (see [`Self::submit_step`]) now: call it
    /// once that plan's forward pass has been issued, when no further plan follows soon (the
    /// last step, an idle engine). With CUDA they start after the work queued on the compute
    /// stream given with the plan. Fails only after shutdown (then nothing is submitted).
    pub fn submit_stores(&self) -> Result<()> {
        let mut st = self.lock()?;
        st.check_open()?;
        self.submit_deferred(&mut st);
        Ok(())
    }

    /// Submits one job. Block ids outside the registration or counts that do not fit the group
    /// make the job complete as failed (with the reason) at the next poll; a backend error
    /// (CUDA) likewise. Fails only for a job id in use or after shutdown.
    /// `compute_stream` (CUDA stream handle, 0 for none): stores start after its queued work.
    pub fn submit(&self, job_id: u64, job: &JobBlocks<'_>, compute_stream: u64) -> Result<()> {
        let mut st = self.lock()?;
        st.check_new_id(job_id)?;
        self.queue(&mut st, job_id, job, compute_stream);
        Ok(())
    }

    /// Executes a step plan, to be called before the plan's forward pass: submits the stores
    /// deferred from the previous plan (whose forward pass has been issued by now), waits for the
    /// plan's flush set (jobs of earlier steps that must finish before this step's copies and
    /// forward pass; ids already finished and handed out are skipped), submits the plan's loads,
    /// and defers its stores: they read the KV this step's forward pass writes, so they are
    /// submitted with the next plan, by [`Self::submit_stores`], by a [`Self::wait`] naming one
    /// of them, or by [`Self::shutdown`]. `compute_stream` (CUDA) is the stream the forward pass
    /// runs on. The plan's job ids are taken (in use) before the wait. Fails, submitting nothing
    /// of the plan, if a job id is in use or repeated, the plan's factor differs from the
    /// worker's, or the worker is (or, during the wait, was) shut down.
    pub fn submit_step(&self, step: &Step, compute_stream: u64) -> Result<()> {
        {
            let mut guard = self.lock()?;
            let st = &mut *guard;
            st.check_open()?;
            if step.block_size_factor != self.cfg.block_size_factor && !step.jobs().is_empty() {
                return Err(invalid!(
                    "step: block_size_factor {} but the worker's is {}",
                    step.block_size_factor,
                    self.cfg.block_size_factor
                ));
            }
            st.scratch_ids.clear();
            for j in step.jobs() {
                st.check_new_id(j.id)?;
                if !st.scratch_ids.insert(j.id) {
                    return Err(Error::InvalidState(format!(
                        "step: job id {} appears twice",
                        j.id
                    )));
                }
            }
            for j in step.jobs() {
                st.jobs.insert(j.id, Job::Reserved);
            }
            self.submit_deferred(st);
        }
        let flushed = self.wait_for(step.flush(), Duration::MAX);
        let mut st = self.lock()?;
        if let Err(e) = flushed.and_then(|()| st.check_open()) {
            for j in step.jobs() {
                st.jobs.remove(&j.id);
            }
            return Err(e);
        }
        for j in step.jobs() {
            if j.kind == Direction::Store {
                st.deferred.push_from(step, j);
                st.jobs.insert(j.id, Job::Deferred);
                continue;
            }
            let blocks = JobBlocks {
                kind: j.kind,
                src: step.src(j),
                dst: step.dst(j),
                block_index: j.block_index,
            };
            self.queue(&mut st, j.id, &blocks, compute_stream);
        }
        st.deferred_stream = compute_stream;
        Ok(())
    }

    /// The copy descriptors of `job` (appended to `out`) and its bytes, as `submit` plans them.
    pub fn plan(&self, job: &JobBlocks<'_>, out: &mut Vec<CopyDesc>) -> Result<u64> {
        plan_job(
            job,
            &self.kv,
            &self.host,
            self.cfg.block_size_factor,
            self.cfg.num_host_slots,
            out,
        )
    }

    /// Appends up to `max` finished jobs to `out`, oldest first: per direction in submission
    /// order, except that a job refused at submission (bad block ids, a driver error) is reported
    /// at the next poll, ahead of jobs still copying. A failed job's completion carries its
    /// message. Jobs not handed out stay for the next call (and their ids stay in use).
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<()> {
        let mut guard = self.lock()?;
        let st = &mut *guard;
        st.collect()?;
        let n = max.min(st.ready.len());
        for c in st.ready.drain(..n) {
            st.jobs.remove(&c.job_id);
            if let Some(dir) = st.directions.remove(&c.job_id) {
                st.stats.direction(dir).record(&c);
            }
            out.push(c);
        }
        Ok(())
    }

    /// Blocks until every listed job has finished (the flush before a forward pass), without
    /// keeping other threads from using the worker; naming a deferred store submits the deferred
    /// stores first. Fails with [`Error::NotFound`] for an id
    /// never submitted or already reported by `poll`, with [`Error::Timeout`] when `timeout`
    /// passes first. A job that another thread's `poll` hands out meanwhile counts as finished.
    pub fn wait(&self, job_ids: &[u64], timeout: Duration) -> Result<()> {
        {
            let mut st = self.lock()?;
            let known = |id: &u64| {
                matches!(
                    st.jobs.get(id),
                    Some(Job::Reserved | Job::Deferred | Job::Running | Job::Done)
                )
            };
            if let Some((i, id)) = job_ids.iter().enumerate().find(|(_, id)| !known(id)) {
                return Err(Error::NotFound(format!(
                    "job_ids[{i}]: {id} is not in flight"
                )));
            }
            if job_ids
                .iter()
                .any(|id| matches!(st.jobs.get(id), Some(Job::Deferred)))
            {
                self.submit_deferred(&mut st);
            }
        }
        self.wait_for(job_ids, timeout)
    }

    /// Blocks until none of `job_ids` is reserved or copying, taking the lock only to collect
    /// completions between sleeps.
    fn wait_for(&self, job_ids: &[u64], timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let mut rounds: u32 = 0;
        loop {
            // Read before collecting: a job finishing after the collection changes the count.
            let seen = self.progress.as_ref().map(|p| p.count());
            {
                let mut st = self.lock()?;
                if job_ids.iter().any(|&id| st.pending(id)) {
                    st.collect()?;
                }
                if !job_ids.iter().any(|&id| st.pending(id)) {
                    return Ok(());
                }
            }
            let waited = started.elapsed();
            if waited >= timeout {
                return Err(Error::Timeout(format!(
                    "jobs still copying after {waited:?} (timeout {timeout:?})"
                )));
            }
            // Bounded naps: reserved jobs (a step waiting for its flush) finish without a signal.
            let nap = (timeout - waited).min(Duration::from_millis(10));
            match (&self.progress, seen) {
                (Some(p), Some(seen)) => p.wait_past(seen, nap),
                _ => {
                    rounds = rounds.saturating_add(1);
                    if rounds < 64 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(nap.min(Duration::from_micros(50)));
                    }
                }
            }
        }
    }

    /// Copies block `src_blocks[i]` of tensor `src_tensor` to block `dst_blocks[i]` of tensor
    /// `dst_tensor` (a `swap_blocks` equivalent). With `job_id` the copy is queued as a job and
    /// reported by `poll`; without, it runs now and returns when done. Either way it is queued
    /// behind the jobs already submitted in its direction (a destination in device memory: the
    /// loads; in host memory: the stores), so a synchronous swap also waits for those; the wait
    /// does not keep other threads from using the worker.
    pub fn swap_blocks(
        &self,
        src_tensor: usize,
        dst_tensor: usize,
        src_blocks: &[u32],
        dst_blocks: &[u32],
        job_id: Option<u64>,
    ) -> Result<()> {
        let (Some(s), Some(d)) = (self.kv.get(src_tensor), self.kv.get(dst_tensor)) else {
            return Err(invalid!(
                "src_tensor {src_tensor} / dst_tensor {dst_tensor}: {} registered",
                self.kv.len()
            ));
        };
        if src_blocks.len() != dst_blocks.len() {
            return Err(invalid!(
                "dst_blocks: {} ids for {} sources",
                dst_blocks.len(),
                src_blocks.len()
            ));
        }
        if s.page_size != d.page_size {
            return Err(invalid!(
                "dst_tensor: page {} bytes, source page {}",
                d.page_size,
                s.page_size
            ));
        }
        if let Some(b) = src_blocks.iter().find(|&&b| b >= s.num_blocks) {
            return Err(invalid!("src_blocks: {b} outside {} blocks", s.num_blocks));
        }
        if let Some(b) = dst_blocks.iter().find(|&&b| b >= d.num_blocks) {
            return Err(invalid!("dst_blocks: {b} outside {} blocks", d.num_blocks));
        }
        // The copies of one job have no order (like a CUDA batch): a block may not be read and
        // written by the same swap.
        if src_tensor == dst_tensor
            && let Some(b) = src_blocks.iter().find(|b| dst_blocks.contains(b))
        {
            return Err(invalid!(
                "dst_blocks: block {b} is also a source of this swap"
            ));
        }
        let dir = if d.on_device {
            Direction::Load
        } else {
            Direction::Store
        };
        let id = {
            let mut guard = self.lock()?;
            let st = &mut *guard;
            // A synchronous swap takes the highest id not in use; it is never handed out.
            let id = job_id.unwrap_or_else(|| {
                (0..=u64::MAX)
                    .rev()
                    .find(|i| !st.jobs.contains_key(i))
                    .unwrap_or(0)
            });
            st.check_new_id(id)?;
            st.descs.clear();
            for (&a, &b) in src_blocks.iter().zip(dst_blocks) {
                push_merged(
                    &mut st.descs,
                    CopyDesc {
                        src: s.block(a),
                        dst: d.block(b),
                        size: s.page_size,
                    },
                );
            }
            st.backend.submit(id, dir, &st.descs, 0)?;
            st.directions.insert(id, dir);
            let job = if job_id.is_some() {
                Job::Running
            } else {
                Job::Swap
            };
            st.jobs.insert(id, job);
            id
        };
        if job_id.is_some() {
            return Ok(());
        }
        let waited = self.wait_for(&[id], Duration::MAX);
        let mut st = self.lock()?;
        waited?;
        let done = match st.jobs.remove(&id) {
            Some(Job::SwapDone(c)) => c,
            other => {
                return Err(Error::Internal(format!(
                    "swap {id} finished but was not reported ({other:?})"
                )));
            }
        };
        st.directions.remove(&id);
        st.stats.direction(dir).record(&done);
        if !done.success {
            return Err(Error::Cuda(done.error.unwrap_or_default()));
        }
        Ok(())
    }

    /// The counters of the jobs handed out so far (and of synchronous swaps), and the jobs in
    /// flight now: submitted (held stores included) and not yet handed out by `poll`.
    pub fn stats(&self) -> Result<WorkerStats> {
        let st = self.lock()?;
        let in_flight = st
            .jobs
            .values()
            .filter(|j| !matches!(j, Job::Swap | Job::SwapDone(_)))
            .count();
        Ok(WorkerStats {
            jobs_in_flight: in_flight as u64,
            ..st.stats
        })
    }

    /// Submits the deferred stores, refuses new submissions from now on, then waits for every
    /// job in flight (without keeping other threads from polling). Completions stay pollable.
    pub fn shutdown(&self) -> Result<()> {
        let ids: Vec<u64> = {
            let mut st = self.lock()?;
            if !st.shut_down {
                self.submit_deferred(&mut st);
            }
            st.shut_down = true;
            st.jobs
                .iter()
                .filter(|(_, j)| matches!(j, Job::Running | Job::Swap))
                .map(|(&id, _)| id)
                .collect()
        };
        self.wait_for(&ids, Duration::MAX)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let ids: Vec<u64> = st.jobs.keys().copied().collect();
        let _ = st.backend.wait(&ids, Duration::MAX);
        for h in &self.host {
            let _ = st.backend.unregister_host(h.raw().0);
        }
    }
}

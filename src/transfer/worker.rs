//! The worker: a KV layout, host tier buffers and a copy backend; takes jobs (alone or as a whole
//! step plan), reports completions by polling, and waits for listed jobs (the flush before a
//! forward pass).

use super::backend::{Backend, Completion, CopyDesc};
use super::copy_plan::{JobBlocks, plan_job, push_merged};
use super::host::HostBackend;
use super::layout::{self, HostBuffer, KvTensor};
use crate::error::{Error, Result, invalid};
use crate::plan::{Direction, Step};
use hashbrown::HashSet;
use std::collections::VecDeque;
use std::time::Duration;

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
    /// Threads the host backend may use for one large job (>= 1).
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

/// Executes load and store jobs between registered KV tensors and host tier buffers.
pub struct Worker {
    cfg: WorkerConfig,
    kv: Vec<KvTensor>,
    /// Declared before `host`: fields drop in order, so copies finish before buffers are freed.
    backend: Box<dyn Backend>,
    host: Vec<HostBuffer>,
    /// Jobs submitted and not yet reported by `poll`.
    known: HashSet<u64>,
    /// Completions to report at the next poll (failed submissions, swaps' neighbours).
    ready: VecDeque<Completion>,
    scratch: Vec<Completion>,
    scratch_ids: HashSet<u64>,
    descs: Vec<CopyDesc>,
    shut_down: bool,
}

impl Worker {
    /// A worker over `tensors` (the server's KV cache, canonical layout). Host tier buffers are
    /// allocated (page-aligned; page-locked with CUDA), or taken from `host_buffers` (one
    /// `(pointer, length)` per tensor, kept valid by the caller until the worker is dropped).
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
        if let Some(bufs) = host_buffers {
            layout::validate_host_buffers(bufs, tensors)?;
        }
        let mut backend: Box<dyn Backend> = match cfg.backend {
            BackendKind::Host => {
                if let Some(i) = tensors.iter().position(|t| t.on_device) {
                    return Err(invalid!(
                        "tensors[{i}]: device memory needs the CUDA backend"
                    ));
                }
                Box::new(HostBackend::new(cfg.threads)?)
            }
            BackendKind::Cuda(device) => Box::new(super::cuda::CudaBackend::new(device)?),
        };
        let mut host = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            let buf = match host_buffers {
                None => {
                    HostBuffer::allocate(cfg.num_host_slots, t.page_size, cfg.block_size_factor)?
                }
                Some(mem) => {
                    let &(p, len) = mem.get(i).ok_or_else(|| {
                        invalid!(
                            "host_buffers: {} buffers for {} tensors",
                            mem.len(),
                            tensors.len()
                        )
                    })?;
                    HostBuffer::borrowed(
                        p,
                        len,
                        cfg.num_host_slots,
                        t.page_size,
                        cfg.block_size_factor,
                    )
                    .map_err(|e| invalid!("host_buffers[{i}]: {e}"))?
                }
            };
            let (p, len) = buf.raw();
            backend.register_host(p, len)?;
            host.push(buf);
        }
        Ok(Self {
            cfg,
            kv: tensors.to_vec(),
            host,
            backend,
            known: HashSet::new(),
            ready: VecDeque::new(),
            scratch: Vec::new(),
            scratch_ids: HashSet::new(),
            descs: Vec::new(),
            shut_down: false,
        })
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

    fn check_new_id(&self, job_id: u64) -> Result<()> {
        if self.shut_down {
            return Err(Error::InvalidState("worker is shut down".into()));
        }
        if self.known.contains(&job_id) {
            return Err(Error::InvalidState(format!(
                "job_id: {job_id} is already submitted"
            )));
        }
        Ok(())
    }

    /// Submits one job. Block ids outside the registration or counts that do not fit the group
    /// make the job complete as failed (with the reason) at the next poll; a backend error
    /// (CUDA) likewise. Fails only for a job id already in flight or after shutdown.
    /// `compute_stream` (CUDA stream handle, 0 for none): stores start after its queued work.
    pub fn submit(&mut self, job_id: u64, job: &JobBlocks<'_>, compute_stream: u64) -> Result<()> {
        self.check_new_id(job_id)?;
        self.descs.clear();
        let planned = plan_job(
            job,
            &self.kv,
            &self.host,
            self.cfg.block_size_factor,
            self.cfg.num_host_slots,
            &mut self.descs,
        );
        self.known.insert(job_id);
        let submitted = planned.and_then(|bytes| {
            self.backend
                .submit(job_id, job.kind, &self.descs, compute_stream)
                .map(|_| bytes)
        });
        if let Err(e) = submitted {
            self.ready.push_back(Completion {
                job_id,
                success: false,
                bytes: 0,
                seconds: 0.0,
                error: Some(e.to_string()),
            });
        }
        Ok(())
    }

    /// Executes a step plan: first waits for the plan's flush set (jobs of earlier steps that must
    /// finish before this step's copies and forward pass; ids already finished and handed out are
    /// skipped), then submits every job (loads first, in plan order). Fails, submitting nothing,
    /// if a job id is in use or repeated, the plan's factor differs from the worker's, or after
    /// shutdown.
    pub fn submit_step(&mut self, step: &Step, compute_stream: u64) -> Result<()> {
        if self.shut_down {
            return Err(Error::InvalidState("worker is shut down".into()));
        }
        if step.block_size_factor != self.cfg.block_size_factor && !step.jobs().is_empty() {
            return Err(invalid!(
                "step: block_size_factor {} but the worker's is {}",
                step.block_size_factor,
                self.cfg.block_size_factor
            ));
        }
        self.scratch_ids.clear();
        for j in step.jobs() {
            self.check_new_id(j.id)?;
            if !self.scratch_ids.insert(j.id) {
                return Err(Error::InvalidState(format!(
                    "step: job id {} appears twice",
                    j.id
                )));
            }
        }
        self.backend.wait(step.flush(), Duration::MAX)?;
        for j in step.jobs() {
            let blocks = JobBlocks {
                kind: j.kind,
                src: step.src(j),
                dst: step.dst(j),
                block_index: j.block_index,
            };
            self.submit(j.id, &blocks, compute_stream)?;
        }
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
    /// at the next poll, ahead of jobs still copying. Jobs not handed out stay for the next call
    /// (and their ids stay in use).
    pub fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> Result<()> {
        self.collect()?;
        let n = max.min(self.ready.len());
        for c in self.ready.drain(..n) {
            self.known.remove(&c.job_id);
            out.push(c);
        }
        Ok(())
    }

    /// Moves the backend's finished jobs into `ready`.
    fn collect(&mut self) -> Result<()> {
        self.scratch.clear();
        self.backend.poll(&mut self.scratch)?;
        self.ready.extend(self.scratch.drain(..));
        Ok(())
    }

    /// Blocks until every listed job has finished (the flush before a forward pass). Fails with
    /// [`Error::NotFound`] for an id never submitted or already reported by `poll`, with
    /// [`Error::Timeout`] when `timeout` passes first.
    pub fn wait(&mut self, job_ids: &[u64], timeout: Duration) -> Result<()> {
        if let Some((i, id)) = job_ids
            .iter()
            .enumerate()
            .find(|(_, id)| !self.known.contains(*id))
        {
            return Err(Error::NotFound(format!(
                "job_ids[{i}]: {id} is not in flight"
            )));
        }
        self.backend.wait(job_ids, timeout)
    }

    /// Copies block `src_blocks[i]` of tensor `src_tensor` to block `dst_blocks[i]` of tensor
    /// `dst_tensor` (a `swap_blocks` equivalent). With `job_id` the copy is queued as a job and
    /// reported by `poll`; without, it runs now and returns when done.
    pub fn swap_blocks(
        &mut self,
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
        // A synchronous swap takes the highest id not in use; it is never handed out.
        let id = job_id.unwrap_or_else(|| {
            (0..=u64::MAX)
                .rev()
                .find(|i| !self.known.contains(i))
                .unwrap_or(0)
        });
        self.check_new_id(id)?;
        self.descs.clear();
        for (&a, &b) in src_blocks.iter().zip(dst_blocks) {
            push_merged(
                &mut self.descs,
                CopyDesc {
                    src: s.block(a),
                    dst: d.block(b),
                    size: s.page_size,
                },
            );
        }
        let dir = if d.on_device {
            Direction::Load
        } else {
            Direction::Store
        };
        self.backend.submit(id, dir, &self.descs, 0)?;
        self.known.insert(id);
        if job_id.is_none() {
            self.backend.wait(&[id], Duration::MAX)?;
            self.collect()?;
            let at = self.ready.iter().position(|c| c.job_id == id);
            let done = at.and_then(|at| self.ready.remove(at)).ok_or_else(|| {
                Error::Internal(format!("swap {id} finished but was not reported"))
            })?;
            self.known.remove(&id);
            if !done.success {
                return Err(Error::Cuda(done.error.unwrap_or_default()));
            }
        }
        Ok(())
    }

    /// Finishes every job in flight, then refuses new submissions. Completions stay pollable.
    pub fn shutdown(&mut self) -> Result<()> {
        let ids: Vec<u64> = self.known.iter().copied().collect();
        self.backend.wait(&ids, Duration::MAX)?;
        self.shut_down = true;
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let ids: Vec<u64> = self.known.iter().copied().collect();
        let _ = self.backend.wait(&ids, Duration::MAX);
        for h in &self.host {
            let _ = self.backend.unregister_host(h.raw().0);
        }
    }
}

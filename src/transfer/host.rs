//! Host backend: executes copy descriptors with `memcpy` on worker threads, one FIFO lane per
//! direction; a large job is split across several threads.

use super::backend::{Backend, Completion, CopyDesc, Progress};
use crate::error::{Error, Result};
use crate::plan::Direction;
use hashbrown::HashSet;
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most threads one large job is split across.
pub const MAX_THREADS: usize = 64;

/// Jobs of at least this many bytes are split across the configured threads.
pub const SPLIT_BYTES: u64 = 4 << 20;

struct Task {
    job_id: u64,
    descs: Vec<CopyDesc>,
}

#[derive(Default)]
struct LaneState {
    in_flight: HashSet<u64>,
    done: VecDeque<Completion>,
    /// Descriptor vectors returned for reuse (no allocation per job once warm).
    spare: Vec<Vec<CopyDesc>>,
}

struct Shared {
    state: Mutex<LaneState>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, LaneState> {
        // A copy never panics while holding the lock; recover the data if one did.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Lane {
    tx: Option<Sender<Task>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// The host backend: memcpy on a thread per direction, `threads` threads for large jobs.
pub struct HostBackend {
    lanes: [Lane; 2],
    progress: Arc<Progress>,
}

impl HostBackend {
    /// A backend whose jobs of at least [`SPLIT_BYTES`] use up to `threads` threads (1 to
    /// [`MAX_THREADS`]; other values are clamped).
    pub fn new(threads: usize) -> Result<Self> {
        let threads = threads.clamp(1, MAX_THREADS);
        let progress = Arc::new(Progress::default());
        let lane = |name: &str| -> Result<Lane> {
            let shared = Arc::new(Shared {
                state: Mutex::new(LaneState::default()),
                cv: Condvar::new(),
            });
            let (tx, rx) = channel();
            let (s, p) = (shared.clone(), progress.clone());
            let thread = std::thread::Builder::new()
                .name(format!("kvo-{name}"))
                .spawn(move || run_lane(rx, s, &p, threads))
                .map_err(|e| Error::Io(format!("spawning the {name} copy thread: {e}")))?;
            Ok(Lane {
                tx: Some(tx),
                shared,
                thread: Some(thread),
            })
        };
        Ok(Self {
            lanes: [lane("load")?, lane("store")?],
            progress,
        })
    }

    fn lane(&self, dir: Direction) -> &Lane {
        &self.lanes[(dir == Direction::Store) as usize]
    }
}

fn run_lane(rx: Receiver<Task>, shared: Arc<Shared>, progress: &Progress, threads: usize) {
    while let Ok(task) = rx.recv() {
        let start = Instant::now();
        let bytes: u64 = task.descs.iter().map(|d| d.size).sum();
        if threads > 1 && bytes >= SPLIT_BYTES {
            copy_split(&task.descs, bytes, threads);
        } else {
            copy_all(&task.descs);
        }
        let seconds = start.elapsed().as_secs_f64();
        let mut st = shared.lock();
        st.in_flight.remove(&task.job_id);
        st.done.push_back(Completion {
            job_id: task.job_id,
            success: true,
            bytes,
            seconds,
            error: None,
        });
        let mut descs = task.descs;
        descs.clear();
        st.spare.push(descs);
        drop(st);
        shared.cv.notify_all();
        progress.bump();
    }
}

fn copy_all(descs: &[CopyDesc]) {
    for d in descs {
        // SAFETY: the worker only builds descriptors inside registered tensors and its host
        // buffers, which the caller keeps valid; `copy` allows overlap (same-tensor swaps).
        unsafe { std::ptr::copy(d.src as *const u8, d.dst as *mut u8, d.size as usize) }
    }
}

/// Splits the bytes of `descs` into `threads` nearly equal parts (cutting descriptors where
/// needed) and copies them in parallel.
fn copy_split(descs: &[CopyDesc], bytes: u64, threads: usize) {
    let per = bytes.div_ceil(threads as u64);
    let mut parts: Vec<Vec<CopyDesc>> = vec![Vec::new(); threads];
    let (mut part, mut room) = (0, per);
    for d in descs {
        let mut d = *d;
        while d.size > 0 {
            let take = d.size.min(room);
            parts[part].push(CopyDesc {
                src: d.src,
                dst: d.dst,
                size: take,
            });
            d = CopyDesc {
                src: d.src + take,
                dst: d.dst + take,
                size: d.size - take,
            };
            room -= take;
            if room == 0 && part + 1 < threads {
                part += 1;
                room = per;
            }
        }
    }
    std::thread::scope(|s| {
        let (first, rest) = parts.split_first().expect("threads >= 1");
        for p in rest {
            s.spawn(move || copy_all(p));
        }
        copy_all(first);
    });
}

impl Backend for HostBackend {
    fn progress(&self) -> Option<Arc<Progress>> {
        Some(self.progress.clone())
    }

    fn register_host(&mut self, _ptr: *mut u8, _len: usize) -> Result<()> {
        Ok(())
    }

    fn unregister_host(&mut self, _ptr: *mut u8) -> Result<()> {
        Ok(())
    }

    fn submit(
        &mut self,
        job_id: u64,
        dir: Direction,
        descs: &[CopyDesc],
        _compute_stream: u64,
    ) -> Result<()> {
        let lane = self.lane(dir);
        let mut st = lane.shared.lock();
        let mut v = st.spare.pop().unwrap_or_default();
        v.extend_from_slice(descs);
        st.in_flight.insert(job_id);
        drop(st);
        let tx = lane
            .tx
            .as_ref()
            .ok_or_else(|| Error::InvalidState("worker is shut down".into()))?;
        tx.send(Task { job_id, descs: v }).map_err(|_| {
            lane.shared.lock().in_flight.remove(&job_id);
            Error::Internal("host copy thread is gone".into())
        })
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        for lane in &self.lanes {
            out.extend(lane.shared.lock().done.drain(..));
        }
        Ok(())
    }

    fn wait(&mut self, job_ids: &[u64], timeout: Duration) -> Result<()> {
        let deadline = Instant::now().checked_add(timeout);
        for lane in &self.lanes {
            let mut st = lane.shared.lock();
            while job_ids.iter().any(|id| st.in_flight.contains(id)) {
                let left = deadline.map_or(Duration::from_secs(3600), |d| {
                    d.saturating_duration_since(Instant::now())
                });
                if left.is_zero() {
                    return Err(Error::Timeout(format!(
                        "jobs still copying after {timeout:?}"
                    )));
                }
                st = lane
                    .shared
                    .cv
                    .wait_timeout(st, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        Ok(())
    }
}

impl Drop for HostBackend {
    fn drop(&mut self) {
        for lane in &mut self.lanes {
            lane.tx.take();
            if let Some(t) = lane.thread.take() {
                let _ = t.join();
            }
        }
    }
}

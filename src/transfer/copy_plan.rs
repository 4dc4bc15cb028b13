//! Copy plans: the (src, dst, size) descriptors of one job, as vLLM 0.24
//! `SingleDirectionOffloadingHandler.transfer_async` builds them (`docs/design.md` §7), with runs
//! of blocks that are contiguous on both sides merged into one descriptor.

use super::backend::CopyDesc;
use super::layout::{HostBuffer, KvTensor};
use crate::error::{Result, invalid};
use crate::plan::Direction;

/// A job to plan: block ids on both sides, in the scheduler's step format.
#[derive(Debug, Clone, Copy)]
pub struct JobBlocks<'a> {
    /// Load (host → KV) or store (KV → host).
    pub kind: Direction,
    /// Source ids: host slots for a load, KV blocks for a store.
    pub src: &'a [u32],
    /// Destination ids: KV blocks for a load, host slots for a store.
    pub dst: &'a [u32],
    /// Logical index of the first KV block; `% factor` sub-blocks of the first slot are skipped.
    pub block_index: u32,
}

/// Appends the descriptors of `job` to `out` and returns the bytes it copies. Fails, appending
/// nothing, when the id counts do not match the group or an id is outside the registration.
pub fn plan_job(
    job: &JobBlocks<'_>,
    kv: &[KvTensor],
    host: &[HostBuffer],
    factor: u32,
    num_slots: u32,
    out: &mut Vec<CopyDesc>,
) -> Result<u64> {
    let (kv_ids, slots) = match job.kind {
        Direction::Store => (job.src, job.dst),
        Direction::Load => (job.dst, job.src),
    };
    let n = kv_ids.len();
    let skip = (job.block_index % factor) as usize;
    let need_slots = (n + skip).div_ceil(factor as usize);
    if slots.len() != need_slots {
        return Err(invalid!(
            "job: {} host slots for {n} blocks starting at sub-block {skip}, {need_slots} expected",
            slots.len()
        ));
    }
    let num_blocks = kv.iter().map(|t| t.num_blocks).min().unwrap_or(0);
    if let Some(b) = kv_ids.iter().find(|&&b| b >= num_blocks) {
        return Err(invalid!(
            "job: block id {b} outside the {num_blocks} registered blocks"
        ));
    }
    if let Some(s) = slots.iter().find(|&&s| s >= num_slots) {
        return Err(invalid!("job: host slot {s} outside the {num_slots} slots"));
    }
    let mut bytes = 0;
    for (t, h) in kv.iter().zip(host) {
        for (i, &b) in kv_ids.iter().enumerate() {
            let k = skip + i;
            let slot_addr = h.sub_block(slots[k / factor as usize], (k % factor as usize) as u32);
            let (src, dst) = match job.kind {
                Direction::Store => (t.block(b), slot_addr),
                Direction::Load => (slot_addr, t.block(b)),
            };
            push_merged(
                out,
                CopyDesc {
                    src,
                    dst,
                    size: t.page_size,
                },
            );
        }
        bytes += n as u64 * t.page_size;
    }
    Ok(bytes)
}

/// Appends `d`, extending the last descriptor instead when `d` continues it on both sides.
#[inline]
pub fn push_merged(out: &mut Vec<CopyDesc>, d: CopyDesc) {
    if let Some(last) = out.last_mut()
        && last.src + last.size == d.src
        && last.dst + last.size == d.dst
    {
        last.size += d.size;
        return;
    }
    out.push(d);
}

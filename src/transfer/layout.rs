//! The registered KV tensors and the host tier buffers: where each block and each host slot
//! lives in memory.

use crate::error::{Error, Result, invalid};

/// One canonical KV tensor registered by the server: `num_blocks` pages of `page_size` bytes,
/// `block_stride` bytes apart, from address `base` (on the device or in host memory). The
/// memory stays the server's; it must stay valid until the worker is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvTensor {
    /// Address of block 0.
    pub base: u64,
    /// Blocks in the tensor.
    pub num_blocks: u32,
    /// Bytes from one block to the next (>= `page_size`).
    pub block_stride: u64,
    /// Bytes copied per block.
    pub page_size: u64,
    /// Device memory (CUDA) rather than host memory.
    pub on_device: bool,
}

/// Alignment required of tensor bases and strides.
pub const ALIGN: u64 = 8;

impl KvTensor {
    /// Address of block `b`.
    #[inline]
    pub fn block(&self, b: u32) -> u64 {
        self.base + b as u64 * self.block_stride
    }

    /// One past the last byte of the tensor (`None` on overflow).
    pub(crate) fn end(&self) -> Option<u64> {
        (self.num_blocks as u64 - 1)
            .checked_mul(self.block_stride)
            .and_then(|o| o.checked_add(self.page_size))
            .and_then(|o| o.checked_add(self.base))
    }
}

/// Checks a registration: non-empty, sizes positive, strides and bases aligned, no two tensors
/// overlapping.
pub fn validate(tensors: &[KvTensor]) -> Result<()> {
    if tensors.is_empty() {
        return Err(invalid!("tensors: none registered"));
    }
    for (i, t) in tensors.iter().enumerate() {
        if t.base == 0 {
            return Err(invalid!("tensors[{i}].base: NULL"));
        }
        if t.page_size == 0 {
            return Err(invalid!("tensors[{i}].page_size: 0"));
        }
        if t.num_blocks == 0 {
            return Err(invalid!("tensors[{i}].num_blocks: 0"));
        }
        if t.block_stride < t.page_size {
            return Err(invalid!(
                "tensors[{i}].block_stride: {} < page_size {}",
                t.block_stride,
                t.page_size
            ));
        }
        if t.base % ALIGN != 0 || t.block_stride % ALIGN != 0 {
            return Err(invalid!(
                "tensors[{i}]: base {:#x} and block_stride {} must be multiples of {ALIGN}",
                t.base,
                t.block_stride
            ));
        }
        t.end()
            .ok_or_else(|| invalid!("tensors[{i}]: extent overflows the address space"))?;
        if let Some((j, at)) = tensors[..i]
            .iter()
            .enumerate()
            .find_map(|(j, o)| pages_overlap(t, o).map(|at| (j, at)))
        {
            return Err(invalid!(
                "tensors[{i}] overlaps tensors[{j}]: both copy the byte at {at:#x}"
            ));
        }
    }
    Ok(())
}

/// The first byte of `[start, end)` that a page of `t` occupies, if any (`t` checked by
/// [`validate`]).
fn range_hits_pages(t: &KvTensor, start: u64, end: u64) -> Option<u64> {
    let t_end = t.end()?;
    let (lo, hi) = (start.max(t.base), end.min(t_end));
    if lo >= hi {
        return None;
    }
    // The page holding or following `lo`: pages are disjoint and ordered (stride >= page).
    let b = (lo - t.base) / t.block_stride;
    let page = t.base + b * t.block_stride;
    if lo < page + t.page_size {
        return Some(lo);
    }
    (b + 1 < t.num_blocks as u64)
        .then(|| page + t.block_stride)
        .filter(|&next| next < hi)
}

/// A byte that a page of `a` and a page of `b` both occupy, if any: tensors whose extents
/// interleave (per-layer views into one allocation) overlap only where their pages do.
fn pages_overlap(a: &KvTensor, b: &KvTensor) -> Option<u64> {
    let (a_end, b_end) = (a.end()?, b.end()?);
    if a.base >= b_end || b.base >= a_end {
        return None;
    }
    if a.block_stride == b.block_stride {
        // Page i of `a` starts at a.base + i*s, page j of `b` at b.base + j*s: only the two
        // pages of `b` nearest a page of `a` (offset r and s - r) can meet it, for every i.
        let s = a.block_stride;
        let (lo, hi) = if a.base <= b.base { (a, b) } else { (b, a) };
        let d = hi.base - lo.base;
        let (q, r) = (d / s, d % s);
        // `hi`'s page 0 starts r bytes into `lo`'s page q.
        if r < lo.page_size && q < lo.num_blocks as u64 {
            return Some(hi.base);
        }
        // `hi`'s page 0 reaches into `lo`'s page q + 1.
        if r + hi.page_size > s && q + 1 < lo.num_blocks as u64 {
            return Some(lo.base + (q + 1) * s);
        }
        return None;
    }
    // Different strides: walk the pages of the tensor with fewer blocks inside the other's
    // extent.
    let (few, many) = if a.num_blocks <= b.num_blocks {
        (a, b)
    } else {
        (b, a)
    };
    let many_end = many.end()?;
    (0..few.num_blocks as u64)
        .map(|i| few.base + i * few.block_stride)
        .skip_while(|&p| p + few.page_size <= many.base)
        .take_while(|&p| p < many_end)
        .find_map(|p| range_hits_pages(many, p, p + few.page_size))
}

/// Checks that caller host buffers (`(address, length)` per tensor) overlap neither each other
/// nor a registered tensor in host memory.
pub fn validate_host_buffers(buffers: &[(*mut u8, usize)], tensors: &[KvTensor]) -> Result<()> {
    let range = |&(p, len): &(*mut u8, usize)| (p as u64, (p as u64).saturating_add(len as u64));
    for (i, b) in buffers.iter().enumerate() {
        let (start, end) = range(b);
        if let Some(j) = buffers[..i]
            .iter()
            .map(range)
            .position(|(s, e)| start < e && s < end)
        {
            return Err(invalid!("host_buffers[{i}] overlaps host_buffers[{j}]"));
        }
        let hit = tensors.iter().enumerate().find_map(|(j, t)| {
            (!t.on_device)
                .then(|| range_hits_pages(t, start, end))
                .flatten()
                .map(|at| (j, at))
        });
        if let Some((j, at)) = hit {
            return Err(invalid!(
                "host_buffers[{i}] overlaps tensors[{j}]: both hold the byte at {at:#x}"
            ));
        }
    }
    Ok(())
}

/// One host tier buffer: `num_slots` slots of `slot_size` bytes, owned or the caller's.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    /// Bytes per slot (`page_size * block_size_factor` of its tensor).
    pub slot_size: u64,
    /// Bytes per sub-block (the tensor's page).
    pub page_size: u64,
    /// Mapped by [`HostBuffer::allocate`] (unmapped on drop), else the caller's.
    owned: bool,
}

// SAFETY: the buffer is plain memory; the worker's jobs decide who writes which bytes.
unsafe impl Send for HostBuffer {}
// SAFETY: the struct itself is immutable after creation; the memory is accessed only through
// copies the worker plans.
unsafe impl Sync for HostBuffer {}

/// Bytes per slot and in all (`num_slots * page_size * factor`), or an error when they overflow.
fn tier_size(num_slots: u32, page_size: u64, factor: u32) -> Result<(u64, usize)> {
    let slot_size = page_size.checked_mul(factor as u64);
    let len = slot_size
        .and_then(|s| s.checked_mul(num_slots as u64))
        .and_then(|l| usize::try_from(l).ok())
        .filter(|&l| l > 0 && l <= isize::MAX as usize);
    match (slot_size, len) {
        (Some(s), Some(l)) => Ok((s, l)),
        _ => Err(invalid!(
            "num_host_slots: {num_slots} slots of {factor} pages of {page_size} bytes overflow the address space"
        )),
    }
}

/// Bytes of physical memory, if the system says.
fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf only reads system constants.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let (pages, page) = (u64::try_from(pages).ok()?, u64::try_from(page).ok()?);
    pages.checked_mul(page)
}

/// Checks, before anything is allocated, that the host tiers of `tensors` (`num_slots` slots of
/// `factor` pages each) fit the address space and the machine's physical memory.
pub fn check_tier_fits(tensors: &[KvTensor], num_slots: u32, factor: u32) -> Result<()> {
    let mut total: u64 = 0;
    for (i, t) in tensors.iter().enumerate() {
        let (_, len) =
            tier_size(num_slots, t.page_size, factor).map_err(|e| invalid!("tensors[{i}]: {e}"))?;
        total = total.saturating_add(len as u64);
    }
    if let Some(ram) = physical_memory()
        && total > ram
    {
        return Err(Error::OutOfMemory(format!(
            "host tiers of {total} bytes ({} tensors of {num_slots} slots) exceed the machine's {ram} bytes of memory",
            tensors.len()
        )));
    }
    Ok(())
}

/// Bytes one thread pre-faults at a time.
const PREFAULT_PIECE: usize = 64 << 20;

impl HostBuffer {
    /// A page-aligned buffer of `num_slots * page_size * factor` bytes, mapped anonymously: the
    /// kernel zero-fills each page when it is first touched, so nothing is touched here.
    pub fn allocate(num_slots: u32, page_size: u64, factor: u32) -> Result<Self> {
        let (slot_size, len) = tier_size(num_slots, page_size, factor)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::OutOfMemory(format!(
                "host tier buffer of {len} bytes: mmap failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
            slot_size,
            page_size,
            owned: true,
        })
    }

    /// Touches every page of an owned buffer (writing a zero, which it holds already) on up to
    /// `threads` threads, so that page-locking finds the pages resident. Touches exactly the
    /// buffer's bytes; caller buffers are left alone.
    pub fn prefault(&self, threads: usize) {
        if !self.owned {
            return;
        }
        let page = HOST_ALIGN;
        let pieces = self.len.div_ceil(PREFAULT_PIECE);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let base = self.ptr as usize;
        let len = self.len;
        let work = || {
            loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if k >= pieces {
                    break;
                }
                let (from, to) = (k * PREFAULT_PIECE, ((k + 1) * PREFAULT_PIECE).min(len));
                for off in (from..to).step_by(page) {
                    // SAFETY: inside the mapping, which nobody else uses yet; the byte is zero.
                    unsafe { std::ptr::write_volatile((base + off) as *mut u8, 0) };
                }
            }
        };
        std::thread::scope(|s| {
            for _ in 1..threads.clamp(1, 64).min(pieces) {
                s.spawn(work);
            }
            work();
        });
    }

    /// The caller's memory: `len` bytes at `ptr`, at least `num_slots * page_size * factor`.
    pub fn borrowed(
        ptr: *mut u8,
        len: usize,
        num_slots: u32,
        page_size: u64,
        factor: u32,
    ) -> Result<Self> {
        let (slot_size, need) = tier_size(num_slots, page_size, factor)?;
        if ptr.is_null() {
            return Err(Error::InvalidArgument("host buffer: NULL".into()));
        }
        if len < need {
            return Err(invalid!("host buffer: {len} bytes, {need} needed"));
        }
        Ok(Self {
            ptr,
            len,
            slot_size,
            page_size,
            owned: false,
        })
    }

    /// Address of sub-block `j` of slot `s`.
    #[inline]
    pub fn sub_block(&self, s: u32, j: u32) -> u64 {
        self.ptr as u64 + s as u64 * self.slot_size + j as u64 * self.page_size
    }

    /// Start and length.
    pub fn raw(&self) -> (*mut u8, usize) {
        (self.ptr, self.len)
    }
}

/// Host page size the tier is touched by.
const HOST_ALIGN: usize = 4096;

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: mapped by `allocate` with this length, unmapped once.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

//! The registered KV tensors and the host tier buffers: where each block and each host slot
//! lives in memory.

use crate::error::{Error, Result, invalid};
use std::alloc::Layout;

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
        let end = t
            .end()
            .ok_or_else(|| invalid!("tensors[{i}]: extent overflows the address space"))?;
        for (j, o) in tensors[..i].iter().enumerate() {
            let o_end = o.end().expect("checked");
            if t.base < o_end && o.base < end {
                return Err(invalid!("tensors[{i}] overlaps tensors[{j}]"));
            }
        }
    }
    Ok(())
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
        let hit = tensors
            .iter()
            .position(|t| !t.on_device && start < t.end().unwrap_or(u64::MAX) && t.base < end);
        if let Some(j) = hit {
            return Err(invalid!("host_buffers[{i}] overlaps tensors[{j}]"));
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
    owned: Option<Layout>,
}

// SAFETY: the buffer is plain memory; the worker serializes access to it.
unsafe impl Send for HostBuffer {}

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

/// Host page size used to align owned buffers.
const HOST_ALIGN: usize = 4096;

impl HostBuffer {
    /// A zeroed, page-aligned buffer of `num_slots * page_size * factor` bytes.
    pub fn allocate(num_slots: u32, page_size: u64, factor: u32) -> Result<Self> {
        let (slot_size, len) = tier_size(num_slots, page_size, factor)?;
        let layout =
            Layout::from_size_align(len, HOST_ALIGN).map_err(|e| invalid!("host buffer: {e}"))?;
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::OutOfMemory(format!(
                "host tier buffer of {len} bytes"
            )));
        }
        Ok(Self {
            ptr,
            len,
            slot_size,
            page_size,
            owned: Some(layout),
        })
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
            owned: None,
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

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Some(layout) = self.owned {
            // SAFETY: allocated by `allocate` with this layout.
            unsafe { std::alloc::dealloc(self.ptr, layout) }
        }
    }
}

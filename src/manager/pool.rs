//! Slot allocation: fresh slots in increasing order first, then freed slots, last freed first.

/// The host slots of the tier.
#[derive(Debug, Clone)]
pub(crate) struct SlotPool {
    num_slots: u32,
    /// High-water mark: slots `< allocated` have been handed out at least once.
    allocated: u32,
    free: Vec<u32>,
}

impl SlotPool {
    pub fn new(num_slots: u32) -> Self {
        Self {
            num_slots,
            allocated: 0,
            free: Vec::new(),
        }
    }

    /// Slots that can be allocated without eviction.
    pub fn num_free(&self) -> usize {
        self.free.len() + (self.num_slots - self.allocated) as usize
    }

    /// Slots holding a key (ready, pinned or in flight).
    pub fn num_used(&self) -> usize {
        self.num_slots as usize - self.num_free()
    }

    /// One slot; the caller has checked `num_free() > 0`.
    #[inline]
    pub fn alloc(&mut self) -> u32 {
        if self.allocated < self.num_slots {
            self.allocated += 1;
            self.allocated - 1
        } else {
            self.free.pop().expect("alloc called with no free slot")
        }
    }

    #[inline]
    pub fn release(&mut self, slot: u32) {
        self.free.push(slot);
    }

    pub fn reset(&mut self) {
        self.allocated = 0;
        self.free.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_first_then_lifo() {
        let mut p = SlotPool::new(4);
        assert_eq!((p.alloc(), p.alloc()), (0, 1));
        p.release(0);
        p.release(1);
        assert_eq!(p.num_free(), 4);
        assert_eq!((p.alloc(), p.alloc(), p.alloc(), p.alloc()), (2, 3, 1, 0));
        assert_eq!(p.num_free(), 0);
        assert_eq!(p.num_used(), 4);
        p.reset();
        assert_eq!(p.alloc(), 0);
    }
}

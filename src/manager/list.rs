//! Intrusive doubly linked lists over dense `u32` ids: O(1) push, unlink and move, no allocation.

/// The "no entry" id.
pub(crate) const NIL: u32 = u32::MAX;

/// One list's ends and length; the links live in a shared [`Links`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct List {
    pub head: u32,
    pub tail: u32,
    pub len: usize,
}

impl Default for List {
    fn default() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

/// `prev`/`next` of every id. An id belongs to at most one list at a time; the owner tracks which.
#[derive(Debug, Clone, Default)]
pub(crate) struct Links {
    prev: Vec<u32>,
    next: Vec<u32>,
}

impl Links {
    pub fn with_len(n: usize) -> crate::Result<Self> {
        Ok(Self {
            prev: super::filled(n, NIL, "list links")?,
            next: super::filled(n, NIL, "list links")?,
        })
    }

    /// Makes room for ids `< n`.
    pub fn grow_to(&mut self, n: usize) {
        if self.prev.len() < n {
            self.prev.resize(n, NIL);
            self.next.resize(n, NIL);
        }
    }

    #[inline]
    pub fn next(&self, id: u32) -> u32 {
        self.next[id as usize]
    }

    /// Appends `id` (not in any list) at the tail (most recently used end).
    #[inline]
    pub fn push_back(&mut self, list: &mut List, id: u32) {
        let i = id as usize;
        self.prev[i] = list.tail;
        self.next[i] = NIL;
        if list.tail == NIL {
            list.head = id;
        } else {
            self.next[list.tail as usize] = id;
        }
        list.tail = id;
        list.len += 1;
    }

    /// Removes `id`, which must be in `list`.
    #[inline]
    pub fn unlink(&mut self, list: &mut List, id: u32) {
        let i = id as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            list.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            list.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        list.len -= 1;
    }

    /// Moves `id`, which must be in `list`, to the tail.
    #[inline]
    pub fn move_to_back(&mut self, list: &mut List, id: u32) {
        if list.tail != id {
            self.unlink(list, id);
            self.push_back(list, id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(links: &Links, list: &List) -> Vec<u32> {
        let mut out = vec![];
        let mut c = list.head;
        while c != NIL {
            out.push(c);
            c = links.next(c);
        }
        assert_eq!(out.len(), list.len);
        out
    }

    #[test]
    fn push_unlink_move() {
        let mut links = Links::with_len(5).unwrap();
        let mut l = List::default();
        for i in 0..5 {
            links.push_back(&mut l, i);
        }
        links.unlink(&mut l, 0);
        links.unlink(&mut l, 4);
        links.unlink(&mut l, 2);
        assert_eq!(collect(&links, &l), vec![1, 3]);
        links.move_to_back(&mut l, 1);
        assert_eq!(collect(&links, &l), vec![3, 1]);
        links.push_back(&mut l, 0);
        assert_eq!(collect(&links, &l), vec![3, 1, 0]);
        assert_eq!(l.tail, 0);
    }
}

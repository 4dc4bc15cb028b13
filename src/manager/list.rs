//! Intrusive doubly linked lists over dense `u32` ids: O(1) push, unlink and move, no allocation.

use super::NO_ID;

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
            head: NO_ID,
            tail: NO_ID,
            len: 0,
        }
    }
}

/// The `prev` of an id that is in no list.
const OFF: u32 = u32::MAX - 1;

/// One id's links.
#[derive(Debug, Clone, Copy)]
struct Node {
    prev: u32,
    next: u32,
}

/// `[prev, next]` of every id, and the owner's payload `T` per id in a vector of its own (a
/// walk along a list reads only the links, eight bytes per id). An id belongs to at most one
/// list at a time; the owner tracks which.
#[derive(Debug, Clone, Default)]
pub(crate) struct Links<T = ()> {
    nodes: Vec<Node>,
    data: Vec<T>,
}

impl<T: Copy + Default> Links<T> {
    /// Room for ids `< n`, each in no list.
    pub fn with_capacity(n: usize) -> crate::Result<Self> {
        Ok(Self {
            nodes: super::filled(n, Self::unlinked(), "list links")?,
            data: super::filled(n, T::default(), "list data")?,
        })
    }

    /// A node in no list, with default data.
    fn unlinked() -> Node {
        Node {
            prev: OFF,
            next: NO_ID,
        }
    }

    /// Makes room for ids `< n` (with default data).
    pub fn grow_to(&mut self, n: usize) {
        if self.nodes.len() < n {
            self.nodes.resize(n, Self::unlinked());
            self.data.resize(n, T::default());
        }
    }

    /// The number of ids there is room for.
    pub fn capacity(&self) -> usize {
        self.nodes.len()
    }

    /// The data of `id`.
    #[inline]
    pub fn data(&self, id: u32) -> &T {
        &self.data[id as usize]
    }

    #[inline]
    pub fn data_mut(&mut self, id: u32) -> &mut T {
        &mut self.data[id as usize]
    }

    #[inline]
    pub fn next(&self, id: u32) -> u32 {
        self.nodes[id as usize].next
    }

    /// The id before `id` in its list ([`NO_ID`] for the head).
    #[inline]
    pub fn prev(&self, id: u32) -> u32 {
        self.nodes[id as usize].prev
    }

    /// Whether `id` is in a list.
    #[inline]
    pub fn is_linked(&self, id: u32) -> bool {
        self.nodes[id as usize].prev != OFF
    }

    /// Appends `id` (not in any list) at the tail (most recently used end).
    #[inline]
    pub fn push_back(&mut self, list: &mut List, id: u32) {
        let node = &mut self.nodes[id as usize];
        (node.prev, node.next) = (list.tail, NO_ID);
        if list.tail == NO_ID {
            list.head = id;
        } else {
            self.nodes[list.tail as usize].next = id;
        }
        list.tail = id;
        list.len += 1;
    }

    /// Removes `id`, which must be in `list`.
    #[inline]
    pub fn unlink(&mut self, list: &mut List, id: u32) {
        let node = &mut self.nodes[id as usize];
        let (p, n) = (node.prev, node.next);
        (node.prev, node.next) = (OFF, NO_ID);
        if p == NO_ID {
            list.head = n;
        } else {
            self.nodes[p as usize].next = n;
        }
        if n == NO_ID {
            list.tail = p;
        } else {
            self.nodes[n as usize].prev = p;
        }
        list.len -= 1;
    }

    /// Reverses the order of the last `n` ids of `list` (`n` at most its length); returns the
    /// id that was `n`-th from the back and is now the tail (`NO_ID` if `n` is 0).
    pub fn reverse_tail(&mut self, list: &mut List, n: usize) -> u32 {
        debug_assert!(n <= list.len, "{n} of {} ids", list.len);
        let last = list.tail;
        if n < 2 {
            return if n == 1 { last } else { NO_ID };
        }
        let (mut c, mut first) = (last, NO_ID);
        for _ in 0..n {
            let node = &mut self.nodes[c as usize];
            first = c;
            c = node.prev;
            (node.prev, node.next) = (node.next, node.prev);
        }
        // `c` is the id before the run; the run's ends take their places.
        self.nodes[last as usize].prev = c;
        if c == NO_ID {
            list.head = last;
        } else {
            self.nodes[c as usize].next = last;
        }
        self.nodes[first as usize].next = NO_ID;
        list.tail = first;
        first
    }

    /// Moves the run of ids from `first` to `last` (consecutive in `list`, `first` not after
    /// `last`) to the tail, in their order.
    pub fn move_run_to_back(&mut self, list: &mut List, first: u32, last: u32) {
        let (p, n) = (self.prev(first), self.next(last));
        if n == NO_ID {
            return;
        }
        if p == NO_ID {
            list.head = n;
        } else {
            self.nodes[p as usize].next = n;
        }
        self.nodes[n as usize].prev = p;
        self.nodes[list.tail as usize].next = first;
        self.nodes[first as usize].prev = list.tail;
        self.nodes[last as usize].next = NO_ID;
        list.tail = last;
    }

    /// Takes the first `n` ids of `list` out of it, `rest` being the id after them; the caller
    /// walked them and resets each with [`Self::reset`].
    #[inline]
    pub fn detach_front(&mut self, list: &mut List, n: usize, rest: u32) {
        list.head = rest;
        if rest == NO_ID {
            list.tail = NO_ID;
        } else {
            self.nodes[rest as usize].prev = NO_ID;
        }
        list.len -= n;
    }

    /// Puts `id` in no list, with default data.
    #[inline]
    pub fn reset(&mut self, id: u32) {
        self.nodes[id as usize] = Self::unlinked();
        self.data[id as usize] = T::default();
    }

    /// Takes every id of `list` out of it.
    pub fn clear(&mut self, list: &mut List) {
        let mut c = list.head;
        while c != NO_ID {
            let node = &mut self.nodes[c as usize];
            c = node.next;
            (node.prev, node.next) = (OFF, NO_ID);
        }
        *list = List::default();
    }

    /// Moves `id`, which must be in `list`, to the tail.
    #[inline]
    pub fn move_to_back(&mut self, list: &mut List, id: u32) {
        if list.tail != id {
            self.unlink(list, id);
            self.push_back(list, id);
        }
    }

    /// Inserts `id` (not in any list) just before `at`, which is in `list`.
    #[inline]
    pub fn insert_before(&mut self, list: &mut List, at: u32, id: u32) {
        let p = self.nodes[at as usize].prev;
        let node = &mut self.nodes[id as usize];
        (node.prev, node.next) = (p, at);
        self.nodes[at as usize].prev = id;
        if p == NO_ID {
            list.head = id;
        } else {
            self.nodes[p as usize].next = id;
        }
        list.len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect<T: Copy + Default>(links: &Links<T>, list: &List) -> Vec<u32> {
        let mut out = vec![];
        let mut c = list.head;
        while c != NO_ID {
            out.push(c);
            c = links.next(c);
        }
        assert_eq!(out.len(), list.len);
        out
    }

    #[test]
    fn push_unlink_move() {
        let mut links = Links::<()>::with_capacity(5).unwrap();
        let mut l = List::default();
        for i in 0..5 {
            links.push_back(&mut l, i);
        }
        links.unlink(&mut l, 0);
        links.unlink(&mut l, 4);
        links.unlink(&mut l, 2);
        assert_eq!(collect(&links, &l), vec![1, 3]);
        assert!(!links.is_linked(2) && links.is_linked(1));
        links.move_to_back(&mut l, 1);
        assert_eq!(collect(&links, &l), vec![3, 1]);
        links.push_back(&mut l, 0);
        assert_eq!(collect(&links, &l), vec![3, 1, 0]);
        assert_eq!(l.tail, 0);
        links.insert_before(&mut l, 3, 2);
        links.insert_before(&mut l, 0, 4);
        assert_eq!(collect(&links, &l), vec![2, 3, 1, 4, 0]);
        links.unlink(&mut l, 2);
        links.unlink(&mut l, 4);
        assert_eq!(collect(&links, &l), vec![3, 1, 0]);
        links.clear(&mut l);
        assert!((0..5).all(|i| !links.is_linked(i)));
        assert_eq!(collect(&links, &l), Vec::<u32>::new());
    }

    #[test]
    fn move_run_to_back_keeps_the_order() {
        let mut links: Links = Links::with_capacity(6).unwrap();
        let mut list = List::default();
        for id in 0..6 {
            links.push_back(&mut list, id);
        }
        links.move_run_to_back(&mut list, 1, 3);
        assert_eq!(collect(&links, &list), [0, 4, 5, 1, 2, 3]);
        links.move_run_to_back(&mut list, 0, 4);
        assert_eq!(collect(&links, &list), [5, 1, 2, 3, 0, 4]);
        // A run already at the back stays.
        links.move_run_to_back(&mut list, 0, 4);
        assert_eq!(collect(&links, &list), [5, 1, 2, 3, 0, 4]);
        assert_eq!((list.len, links.prev(5)), (6, NO_ID));
    }

    #[test]
    fn reverse_tail_reverses_the_last_ids_only() {
        for (n, want) in [
            (0, [0, 1, 2, 3, 4]),
            (1, [0, 1, 2, 3, 4]),
            (2, [0, 1, 2, 4, 3]),
            (3, [0, 1, 4, 3, 2]),
            (5, [4, 3, 2, 1, 0]),
        ] {
            let mut links: Links = Links::with_capacity(5).unwrap();
            let mut list = List::default();
            for id in 0..5 {
                links.push_back(&mut list, id);
            }
            let first = links.reverse_tail(&mut list, n);
            assert_eq!(collect(&links, &list), want, "{n}");
            assert_eq!(first, if n == 0 { NO_ID } else { 5 - n as u32 }, "{n}");
            // Walking back gives the same order.
            let mut back = vec![];
            let mut c = list.tail;
            while c != NO_ID {
                back.push(c);
                c = links.prev(c);
            }
            back.reverse();
            assert_eq!(back, want, "{n} backwards");
            assert_eq!((list.head, list.tail, list.len), (want[0], want[4], 5));
        }
    }

    #[test]
    fn detach_front_keeps_the_rest_linked() {
        let mut links = Links::<u8>::with_capacity(4).unwrap();
        let mut l = List::default();
        for i in [2, 0, 3, 1] {
            links.push_back(&mut l, i);
        }
        *links.data_mut(2) = 7;
        for i in [2, 0] {
            links.reset(i);
        }
        links.detach_front(&mut l, 2, 3);
        assert_eq!(collect(&links, &l), vec![3, 1]);
        assert_eq!((l.head, l.tail, l.len), (3, 1, 2));
        assert!(!links.is_linked(2) && !links.is_linked(0) && links.is_linked(3));
        assert_eq!(*links.data(2), 0);
        // Unlinking the new head works from its cleared `prev`.
        links.unlink(&mut l, 3);
        assert_eq!(collect(&links, &l), vec![1]);
        // Detaching everything empties the list.
        links.reset(1);
        links.detach_front(&mut l, 1, NO_ID);
        assert_eq!((l.head, l.tail, l.len), (NO_ID, NO_ID, 0));
        links.push_back(&mut l, 0);
        assert_eq!(collect(&links, &l), vec![0]);
    }
}

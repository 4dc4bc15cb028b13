//! Tier events: keys that became ready (stored) and keys evicted (removed), one record per call.

/// Buffered events, drained with [`super::Manager::take_events`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventLog {
    key_len: usize,
    /// (removed, end offset of the record's keys in `keys`).
    records: Vec<(bool, usize)>,
    keys: Vec<u8>,
}

/// One event: `keys` is a flat buffer of whole keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event<'a> {
    /// True for evicted keys, false for keys that became ready.
    pub removed: bool,
    /// The keys, `key_len` bytes each.
    pub keys: &'a [u8],
}

impl EventLog {
    pub(crate) fn new(key_len: usize) -> Self {
        Self {
            key_len,
            ..Self::default()
        }
    }

    /// Appends one key to the record being built by `push_key` calls; `end_record` closes it.
    pub(crate) fn push_key(&mut self, key: &[u8]) {
        self.keys.extend_from_slice(key);
    }

    pub(crate) fn end_record(&mut self, removed: bool) {
        let start = self.records.last().map_or(0, |r| r.1);
        if self.keys.len() > start {
            self.records.push((removed, self.keys.len()));
        }
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True when there is no event.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Number of keys over all events.
    pub fn num_keys(&self) -> usize {
        self.keys.len().checked_div(self.key_len).unwrap_or(0)
    }

    /// The events, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = Event<'_>> {
        let mut start = 0;
        self.records.iter().map(move |&(removed, end)| {
            let keys = &self.keys[start..end];
            start = end;
            Event { removed, keys }
        })
    }

    /// All keys of all events, back to back, oldest first.
    pub fn all_keys(&self) -> &[u8] {
        &self.keys
    }
}

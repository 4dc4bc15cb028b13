//! Tier events: keys that became ready (stored) and keys evicted (removed), one record per call.
//!
//! The buffer is bounded: when the events hold more than [`EventLog::max_keys`] keys, the oldest
//! events are dropped (and counted) until they fit; the newest event is always kept whole.

/// Keys a manager's event buffer holds at most: `4 * num_slots`, and at least this many.
pub const MIN_EVENT_KEYS: usize = 1 << 16;

/// Buffered events, drained with [`super::Manager::take_events`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventLog {
    key_len: usize,
    max_keys: usize,
    /// (kind, end offset of the record's keys in `keys`); records before `first` are dropped.
    records: Vec<(Kind, usize)>,
    first: usize,
    /// Keys of all records; bytes before `start` belong to dropped records.
    keys: Vec<u8>,
    start: usize,
    dropped: u64,
}

/// What an event says of its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Kind {
    #[default]
    Stored,
    Removed,
    RemovedMetadataOnly,
}

/// One event: `keys` is a flat buffer of whole keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event<'a> {
    /// True for evicted keys (and keys whose store failed), false for keys that became ready.
    pub removed: bool,
    /// A removal of keys whose store failed (vLLM 0.33 semantics): they never became
    /// readable, so only an index of announced keys has anything to drop.
    pub metadata_only: bool,
    /// The keys, `key_len` bytes each.
    pub keys: &'a [u8],
}

impl EventLog {
    /// An empty log of `key_len`-byte keys holding at most `max_keys` keys (see the module).
    pub(crate) fn new(key_len: usize, max_keys: usize) -> Self {
        Self {
            key_len,
            max_keys,
            ..Self::default()
        }
    }

    /// Appends one key to the record being built by `push_key` calls; `end_record` closes it.
    pub(crate) fn push_key(&mut self, key: &[u8]) {
        super::keys::append_key(&mut self.keys, key);
    }

    /// Closes the record of the keys pushed since the last one (none: no record), as a
    /// removal or a store.
    pub(crate) fn end_record(&mut self, removed: bool) {
        self.end(if removed { Kind::Removed } else { Kind::Stored });
    }

    /// Closes the record as a metadata-only removal (keys whose store failed).
    pub(crate) fn end_record_metadata_only(&mut self) {
        self.end(Kind::RemovedMetadataOnly);
    }

    fn end(&mut self, kind: Kind) {
        let start = self.records.last().map_or(0, |r| r.1);
        if self.keys.len() > start {
            self.records.push((kind, self.keys.len()));
            self.bound();
        }
    }

    /// Whether a metadata-only removal is buffered.
    pub(crate) fn has_metadata_only(&self) -> bool {
        self.records[self.first..]
            .iter()
            .any(|r| r.0 == Kind::RemovedMetadataOnly)
    }

    /// The log with the keys of metadata-only removals for which `present` holds dropped (and
    /// such removals left with no key dropped whole); other events unchanged.
    pub(crate) fn without_present(&self, mut present: impl FnMut(&[u8]) -> bool) -> Self {
        let mut out = Self::new(self.key_len, self.max_keys);
        out.dropped = self.dropped;
        for e in self.iter() {
            for key in e.keys.chunks_exact(self.key_len) {
                if !(e.metadata_only && present(key)) {
                    out.keys.extend_from_slice(key);
                }
            }
            let kind = match (e.removed, e.metadata_only) {
                (_, true) => Kind::RemovedMetadataOnly,
                (true, false) => Kind::Removed,
                (false, false) => Kind::Stored,
            };
            let start = out.records.last().map_or(0, |r| r.1);
            if out.keys.len() > start {
                out.records.push((kind, out.keys.len()));
            }
        }
        out
    }

    /// Drops the oldest records while more than `max_keys` keys are held (never the newest),
    /// and reclaims their memory once they are half of the buffer.
    fn bound(&mut self) {
        let max_bytes = self.max_keys.saturating_mul(self.key_len);
        while self.keys.len() - self.start > max_bytes && self.first + 1 < self.records.len() {
            self.start = self.records[self.first].1;
            self.first += 1;
            self.dropped += 1;
        }
        if self.start > 0 && self.start >= self.keys.len() / 2 {
            self.keys.drain(..self.start);
            self.records.drain(..self.first);
            for r in &mut self.records {
                r.1 -= self.start;
            }
            (self.first, self.start) = (0, 0);
        }
    }

    /// Keys the log holds at most (the newest event excepted).
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// Events dropped (oldest first) to stay within [`EventLog::max_keys`].
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.records.len() - self.first
    }

    /// True when there is no event.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of keys over all events.
    pub fn num_keys(&self) -> usize {
        self.all_keys().len().checked_div(self.key_len).unwrap_or(0)
    }

    /// The events, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = Event<'_>> {
        let mut start = self.start;
        self.records[self.first..].iter().map(move |&(kind, end)| {
            let keys = &self.keys[start..end];
            start = end;
            Event {
                removed: kind != Kind::Stored,
                metadata_only: kind == Kind::RemovedMetadataOnly,
                keys,
            }
        })
    }

    /// All keys of all events, back to back, oldest first.
    pub fn all_keys(&self) -> &[u8] {
        let end = self.records.last().map_or(self.start, |r| r.1);
        &self.keys[self.start..end]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_events_are_dropped_beyond_the_bound() {
        let mut log = EventLog::new(2, 10);
        for i in 0..1000u16 {
            // Events of 1, 2 or 3 keys.
            for k in 0..=i % 3 {
                log.push_key(&(i * 4 + k).to_be_bytes());
            }
            log.end_record(i % 2 == 0);
            assert!(log.num_keys() <= 10, "{i}: {} keys", log.num_keys());
            // Memory stays bounded too: dropped records are reclaimed.
            assert!(
                log.keys.len() <= 2 * 2 * 10 + 6,
                "{i}: {} bytes",
                log.keys.len()
            );
        }
        let kept: Vec<(bool, Vec<u8>)> = log.iter().map(|e| (e.removed, e.keys.to_vec())).collect();
        // The newest events, intact, in order.
        let last = kept.last().unwrap();
        assert_eq!(last.0, 999 % 2 == 0);
        // 999 % 3 == 0: one key.
        assert_eq!(last.1, 3996u16.to_be_bytes());
        assert_eq!(log.len() as u64 + log.dropped(), 1000);
        assert_eq!(log.all_keys().len(), log.num_keys() * 2);
        assert_eq!(
            log.all_keys(),
            kept.iter().flat_map(|k| k.1.clone()).collect::<Vec<u8>>()
        );
    }

    #[test]
    fn one_event_larger_than_the_bound_is_kept_whole() {
        let mut log = EventLog::new(1, 4);
        log.push_key(&[1]);
        log.end_record(false);
        for k in 0..9u8 {
            log.push_key(&[k]);
        }
        log.end_record(true);
        assert_eq!(log.len(), 1);
        assert_eq!(log.dropped(), 1);
        assert_eq!(log.all_keys(), (0..9).collect::<Vec<u8>>());
    }
}

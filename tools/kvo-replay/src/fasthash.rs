//! The hasher of the simulator's integer-keyed maps and sets (block hashes and ids): foldhash's
//! quality variant, as the library's key table uses, instead of the standard library's SipHash.
//! Its final mix spreads structured keys (a tag in the high bits, counters) over the low bits
//! hash tables index with. Fixed seed: the maps are looked up, never iterated, so no figure
//! depends on it, and a run is the same from one process to the next.

/// Builds the hashers of [`HashMap`] and [`HashSet`].
pub type FoldState = foldhash::quality::FixedState;

/// A `HashMap` with [`FoldState`].
pub type HashMap<K, V> = std::collections::HashMap<K, V, FoldState>;
/// A `HashSet` with [`FoldState`].
pub type HashSet<K> = std::collections::HashSet<K, FoldState>;

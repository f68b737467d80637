//! Random parts of the ids the server makes (response ids, stored items' ids): unpredictable enough that one
//! client cannot guess another's stored response, with no dependency for it.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// 64 random bits: SipHash keyed by the process's random state, over a counter and the time.
pub fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// `prefix_` and 32 random hex digits.
pub fn random_id(prefix: &str) -> String {
    format!("{prefix}_{:016x}{:016x}", random_u64(), random_u64())
}

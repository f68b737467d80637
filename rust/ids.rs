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

/// Whether a request id is the one an abort names: the id itself, or one of its sequences (`/generate` names a
/// batch's prompts `RID_0`, `RID_1`, ... and a prompt's `n` samples `RID_0`, ... after it, so `RID_1_0` too; SGLang's
/// abort reaches a rid's sequences through the same prefix).
pub fn aborts(rid: &str, request_id: &str) -> bool {
    let digits = |j: &str| !j.is_empty() && j.bytes().all(|b| b.is_ascii_digit());
    match request_id.strip_prefix(rid) {
        Some("") => true,
        Some(rest) => rest.strip_prefix('_').is_some_and(|r| r.split('_').all(digits)),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_abort_names_its_id_and_its_samples_only() {
        assert!(super::aborts("r", "r"));
        assert!(super::aborts("r", "r_0") && super::aborts("r", "r_17") && super::aborts("r", "r_1_0"));
        assert!(!super::aborts("r", "r1") && !super::aborts("r", "r_") && !super::aborts("r", "r_x"));
        assert!(!super::aborts("r", "r_1_") && !super::aborts("r", "r__1") && !super::aborts("r", "r_1_x"));
        assert!(!super::aborts("r_1", "r"));
    }
}

//! Who a request belongs to, for the shares of stored state and of the lanes that work runs later on (issue 39):
//! each API key is an owner of its own; with no key, every client is the one anonymous owner.
//!
//! An owner is named by a digest of its key, never the key: the name is stored with what the owner keeps and may
//! show in logs. `http::auth` puts the owner of a keyed request into its extensions; `Owner` as an extractor reads
//! it back, and falls back to the anonymous owner on routes without a key.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use sha2::{Digest, Sha256};
use std::convert::Infallible;
use std::sync::Arc;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner(Arc<str>);

impl Owner {
    /// The one owner of a server without API keys.
    pub fn anonymous() -> Self {
        Owner(Arc::from(""))
    }

    /// The owner of an API key: `k-` and the first 16 hex digits of its SHA-256.
    pub fn for_key(key: &str) -> Self {
        let digest = Sha256::digest(key.as_bytes());
        let mut name = String::with_capacity(18);
        name.push_str("k-");
        for b in &digest[..8] {
            name.push_str(&format!("{b:02x}"));
        }
        Owner(Arc::from(name))
    }

    /// A name read back from the store.
    pub fn from_stored(name: &str) -> Self {
        Owner(Arc::from(name))
    }

    /// The name kept in the store: empty for the anonymous owner.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn is_anonymous(&self) -> bool {
        self.0.is_empty()
    }
}

/// How many owners the configured keys (one a line) make: at least 1, the anonymous owner of a server without keys.
pub fn count(keys: Option<&str>) -> u64 {
    let keys = keys.unwrap_or_default().lines().map(str::trim).filter(|k| !k.is_empty());
    keys.collect::<std::collections::HashSet<_>>().len().max(1) as u64
}

impl Default for Owner {
    fn default() -> Self {
        Owner::anonymous()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Owner {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Infallible> {
        Ok(parts.extensions.get::<Owner>().cloned().unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::Owner;

    #[test]
    fn keys_name_owners_by_digest() {
        let a = Owner::for_key("secret-a");
        assert_eq!(a, Owner::for_key("secret-a"));
        assert_ne!(a, Owner::for_key("secret-b"));
        assert_eq!(a.as_str().len(), 18);
        assert!(!a.as_str().contains("secret"));
        assert!(Owner::anonymous().is_anonymous() && !a.is_anonymous());
        assert_eq!(Owner::from_stored(a.as_str()), a);
    }
}

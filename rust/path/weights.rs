//! The weights the ranks serve: their version (SGLang's `weight_version`), read by `/get_weight_version`, the
//! worker info and `/generate`'s `meta_info` (`path::weight_version`), set by `/update_weight_version` and by a
//! weight reload; and the checkpoint directory they were loaded from, which a reload compares a new one with and
//! rolls back to (`path::reload`).

use std::path::{Path, PathBuf};
use std::sync::RwLock;

pub struct Weights {
    version: RwLock<String>,
    checkpoint: RwLock<Option<PathBuf>>,
    /// Held for the whole of a reload: one at a time.
    pub(super) reloading: tokio::sync::Mutex<()>,
}

/// SGLang's default `--weight-version`.
pub const DEFAULT_VERSION: &str = "default";

impl Default for Weights {
    fn default() -> Self {
        Weights::new(None)
    }
}

impl Weights {
    /// `checkpoint`: the local directory the ranks loaded (None: the bundled tokenizer alone, nothing to reload).
    pub fn new(checkpoint: Option<PathBuf>) -> Self {
        Weights {
            version: RwLock::new(DEFAULT_VERSION.to_string()),
            checkpoint: RwLock::new(checkpoint),
            reloading: Default::default(),
        }
    }

    pub fn version(&self) -> String {
        self.version.read().unwrap().clone()
    }

    pub fn set_version(&self, version: String) {
        *self.version.write().unwrap() = version;
    }

    /// Whether a reload is running (it holds `reloading` from its checks to its resume).
    pub fn is_reloading(&self) -> bool {
        self.reloading.try_lock().is_err()
    }

    pub fn checkpoint(&self) -> Option<PathBuf> {
        self.checkpoint.read().unwrap().clone()
    }

    pub(super) fn set_checkpoint(&self, dir: &Path) {
        *self.checkpoint.write().unwrap() = Some(dir.to_path_buf());
    }
}

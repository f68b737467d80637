//! The version of the weights the ranks serve (SGLang's `weight_version`): one place, read by
//! `/get_weight_version`, the worker info, and `/generate`'s `meta_info` (`path::weight_version`); set by
//! `/update_weight_version` (and by a weight reload).

use std::sync::RwLock;

pub struct Weights {
    version: RwLock<String>,
}

/// SGLang's default `--weight-version`.
pub const DEFAULT_VERSION: &str = "default";

impl Default for Weights {
    fn default() -> Self {
        Weights { version: RwLock::new(DEFAULT_VERSION.to_string()) }
    }
}

impl Weights {
    pub fn version(&self) -> String {
        self.version.read().unwrap().clone()
    }

    pub fn set_version(&self, version: String) {
        *self.version.write().unwrap() = version;
    }
}

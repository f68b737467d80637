//! A weight reload (`/update_weights_from_disk`): the ranks load another checkpoint in place while the listener,
//! the store, the queue and the connections stay up.
//!
//! 1. The new checkpoint is checked against the served one (same tokenizer, same architecture) before anything
//!    stops: the codec, the prompts already encoded and the clients' token IDs stay valid across the switch.
//! 2. Pause: new requests wait at the admission gate (no 429, no 503, /health stays 200). The running ones finish
//!    (or are aborted), so no answer is a mix of two checkpoints.
//! 3. Every rank gets a RELOAD record on its own request ring and loads the checkpoint in its own process; the
//!    process does not exit, so neither the supervisor nor the watchdog (which counts only ranks with work) sees
//!    anything. A rank reports the outcome in `AUX_RELOADS`. An engine that fails to load keeps what it served.
//! 4. If any rank failed while others loaded it, every rank goes back to the old checkpoint; then resume.

use super::AppState;
use super::control::{self, PauseMode};
use crate::error::ApiError;
use crate::ring::records::RELOAD;
use crate::ring::status::{AUX_RELOADS, RELOAD_OK};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How often the reload looks at the requests in flight and at the ranks' reload words.
const POLL: Duration = Duration::from_millis(10);
/// How long a rank may take to load a checkpoint before the reload gives up on it (and rolls back).
const LOAD_TIMEOUT: Duration = Duration::from_secs(1800);

/// SGLang's answer: `{success, message, num_paused_requests}`.
pub struct Outcome {
    pub success: bool,
    pub message: String,
    pub num_paused_requests: usize,
}

/// Reload the weights from `dir`; `version` names them (default: the directory's name). A checkpoint that cannot
/// be served in place of this one is refused (400) with nothing paused.
pub async fn reload(st: &AppState, dir: &Path, version: Option<String>, abort_all: bool) -> Result<Outcome, ApiError> {
    let _one = st.weights.reloading.lock().await;
    let Some(old) = st.weights.checkpoint() else {
        return Err(ApiError::bad_request(
            "This server was started without a checkpoint directory (MODEL): there are no weights to replace.",
        ));
    };
    check(&old, dir).await?;
    let dir = tokio::fs::canonicalize(dir).await.unwrap_or_else(|_| dir.to_path_buf());
    let held = control::pause(st, if abort_all { PauseMode::Abort } else { PauseMode::Wait }).await;
    while st.admission.in_flight() > 0 || st.dispatcher.ranks.iter().any(|r| r.in_flight() > 0) {
        tokio::time::sleep(POLL).await;
    }
    let all: Vec<usize> = (0..st.dispatcher.ranks.len()).collect();
    let outcome = match load(st, &all, &dir).await {
        Ok(()) => {
            st.weights.set_checkpoint(&dir);
            let version = version.unwrap_or_else(|| derived_version(&dir));
            st.weights.set_version(version.clone());
            tracing::info!(checkpoint = %dir.display(), version, "weights reloaded");
            let message = format!("Loaded {} (weight version {version}).", dir.display());
            Outcome { success: true, message, num_paused_requests: held }
        }
        Err((loaded, why)) => {
            tracing::error!(checkpoint = %dir.display(), "weight reload failed: {why}; rolling back");
            // Every rank goes back, not only those that loaded it: ranks that reload together (DeepInfer's, each
            // a collective) must all take the record; one that kept the old checkpoint loads it again.
            let back_to = if loaded.is_empty() { vec![] } else { all };
            let back = match load(st, &back_to, &old).await {
                Ok(()) if loaded.is_empty() => format!("no rank loaded it: every rank still serves {}", old.display()),
                Ok(()) => format!("rolled back to {}", old.display()),
                Err((_, e)) => format!("and the rollback to {} failed too: {e}", old.display()),
            };
            Outcome { success: false, message: format!("{why}; {back}."), num_paused_requests: held }
        }
    };
    control::resume_now(st);
    Ok(outcome)
}

/// The version a reload without `weight_version` gives: the checkpoint directory's name.
fn derived_version(dir: &Path) -> String {
    dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// Have `ranks` load `dir`, all at once; the ranks that loaded it and why not, if any did not.
async fn load(st: &AppState, ranks: &[usize], dir: &Path) -> Result<(), (Vec<usize>, String)> {
    let path = dir.to_string_lossy().into_owned();
    let mut waiting = Vec::new();
    for &i in ranks {
        let link = &st.dispatcher.ranks[i];
        let done = link.output.aux(AUX_RELOADS) >> 32;
        if link.requests.send(RELOAD, path.as_bytes().to_vec()).is_err() {
            return Err((vec![], format!("Engine rank {i} is not running")));
        }
        waiting.push((i, done));
    }
    let deadline = Instant::now() + LOAD_TIMEOUT;
    let (mut loaded, mut failed) = (Vec::new(), Vec::new());
    for (i, done) in waiting {
        let link = &st.dispatcher.ranks[i];
        loop {
            let word = link.output.aux(AUX_RELOADS);
            if word >> 32 > done {
                if word & 0xffff_ffff == RELOAD_OK {
                    loaded.push(i)
                } else {
                    failed.push(i)
                }
                break;
            }
            if !link.is_alive() || Instant::now() > deadline {
                failed.push(i);
                break;
            }
            tokio::time::sleep(POLL).await;
        }
    }
    match failed.as_slice() {
        [] => Ok(()),
        f => Err((loaded, format!("Engine rank(s) {f:?} could not load {path} (the rank's log says why)"))),
    }
}

/// Refuse (400) a checkpoint the ranks cannot load in place of `old`: not a directory, another tokenizer, another
/// architecture (`model_type`, `architectures` in config.json).
async fn check(old: &Path, new: &Path) -> Result<(), ApiError> {
    let refuse = |why: String| ApiError::bad_param("model_path", why);
    if !tokio::fs::metadata(new).await.is_ok_and(|m| m.is_dir()) {
        return Err(refuse(format!("'model_path' {} is not a checkpoint directory on this server", new.display())));
    }
    let tokenizer = |d: &Path| d.join("tokenizer.json");
    let (a, b) = (tokio::fs::read(tokenizer(old)).await.ok(), tokio::fs::read(tokenizer(new)).await.ok());
    match b {
        None => return Err(refuse(format!("{} has no tokenizer.json", new.display()))),
        Some(b) if a.as_deref() != Some(&b[..]) => {
            return Err(refuse(format!(
                "{}'s tokenizer differs from the one served: a reload cannot change the tokenizer",
                new.display()
            )));
        }
        Some(_) => {}
    }
    let (a, b) = (architecture(old).await, architecture(new).await);
    match b {
        Err(why) => Err(refuse(format!("{}: {why}", new.display()))),
        Ok(b) if a.as_ref().ok() != Some(&b) => Err(refuse(format!(
            "{} is a {} checkpoint, the served one a {}: a reload cannot change the architecture",
            new.display(),
            b.0,
            a.map_or_else(|e| e, |a| a.0)
        ))),
        Ok(_) => Ok(()),
    }
}

/// config.json's `model_type` and `architectures` (empty without the file).
async fn architecture(dir: &Path) -> Result<(String, Value), String> {
    let path: PathBuf = dir.join("config.json");
    let Ok(text) = tokio::fs::read(&path).await else { return Ok(Default::default()) };
    let config: Value = serde_json::from_slice(&text).map_err(|e| format!("config.json is not JSON: {e}"))?;
    let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or("").to_string();
    Ok((model_type, config.get("architectures").cloned().unwrap_or(Value::Null)))
}

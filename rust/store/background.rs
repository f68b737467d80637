//! Background responses' claims in the store, as the runs and the chain wait see them (issue 40): which claim a
//! write names (`Claim`), what a renewal and a takeover read back, whether a stored Response still runs, and the
//! wait of a request that continues one still running.

use crate::error::ApiError;
use std::time::Duration;

/// Which claim a write names: its holder's (owner, generation), or any claim whose lease ran out before `now`
/// (its replica is dead, or released it).
#[derive(Clone, Copy, Debug)]
pub enum Claim<'a> {
    Held { owner: &'a str, generation: i64 },
    Lapsed { now: i64 },
}

/// One claim renewed: its id and generation, whether a cancel was asked of it, and whether its Response is gone
/// (deleted: the run stops).
#[derive(Debug, sqlx::FromRow)]
pub struct Renewed {
    pub id: String,
    pub claim_gen: i64,
    pub cancel_asked: bool,
    pub deleted: bool,
}

/// A run taken over: its id, request, generation now, and whether a cancel was asked of the replica before.
#[derive(Debug, sqlx::FromRow)]
pub struct TakenOver {
    pub id: String,
    pub body: String,
    pub claim_gen: i64,
    pub cancel_asked: bool,
}

/// Whether a stored Response has yet to end (its own `status`, not a `status` its metadata may hold).
pub fn is_running(response: &str) -> bool {
    let status = serde_json::from_str::<serde_json::Value>(response).ok().and_then(|r| r.get("status").cloned());
    matches!(status.as_ref().and_then(serde_json::Value::as_str), Some("queued" | "in_progress"))
}

/// Longest a request that continues a background response still running waits for it to end.
pub const CHAIN_WAIT: Duration = Duration::from_secs(60);

impl super::Store {
    /// Run `task` on the store's runtime (from a thread that has none: the rank's, as a request finishes).
    pub fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.runtime.spawn(task);
    }

    /// Wait (at most `within`: `CHAIN_WAIT`) until the background response `id`, read as still running, has ended,
    /// for a request that continues it: its output is then the chain's. A 409 `response_in_progress` past the wait.
    pub async fn until_ended(&self, id: &str, within: Duration) -> Result<(), ApiError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            // Ended here: seen at once (its worker rings `run_ended` once its final state is written); elsewhere,
            // read again shortly.
            let _ = tokio::time::timeout(Duration::from_millis(100), self.run_ended.notified()).await;
            match self.db.get_response(id).await.map_err(super::failed)? {
                Some(row) if is_running(&row.response) => {}
                _ => return Ok(()), // ended (or deleted: the chain's own read says so)
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ApiError::ResponseInProgress(id.to_string()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_chain_waits_for_a_running_response_then_is_a_409_past_the_wait() {
        use crate::store::{Db, Store, StoredResponse, retention::Retention};
        let db = Db::open("memory").await.unwrap();
        let mut row = StoredResponse {
            id: "resp_1".into(),
            created_at: 1,
            model: "m".into(),
            previous_response_id: None,
            context: String::new(),
            input_items: "[]".into(),
            response: r#"{"status":"in_progress","metadata":{"status":"completed"}}"#.into(),
            owned_by: String::new(),
        };
        db.put_responses(None, &[&row]).await.unwrap();
        let retention = Retention::new(None, Default::default());
        let store = Store::new(db, None, retention, 15, tokio::runtime::Handle::current());
        let err = store.until_ended("resp_1", Duration::from_millis(300)).await.unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::CONFLICT);
        let envelope: serde_json::Value = serde_json::from_str(&err.envelope()).unwrap();
        assert_eq!(envelope["error"]["code"], "response_in_progress");
        assert_eq!(envelope["error"]["param"], "previous_response_id");
        row.response = r#"{"status":"completed"}"#.into();
        let db = store.db.clone();
        let ends = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            db.put_responses(None, &[&row]).await.unwrap();
        });
        store.until_ended("resp_1", Duration::from_secs(5)).await.unwrap();
        ends.await.unwrap();
    }
}

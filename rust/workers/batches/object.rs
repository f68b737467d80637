//! The Batch object (OpenAI's Batch API, typed: `Batch`, its status machine in `status.rs`) and the input file's
//! lines: what a batch is asked to run, checked before it runs (the lines it writes are `result.rs`'s).

pub use super::status::BatchStatus;
use crate::doors::Door;
use crate::json_bounds::{self, JsonBounds};
use crate::limits::{MAX_BATCH_LINES, MAX_MESSAGE_BATCH_LINES};
use crate::store::{StoreError, StoredBatch};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// What a batch may serve: the doors OpenAI's Batch API names.
pub const ENDPOINTS: &[&str] = &["/v1/chat/completions", "/v1/completions", "/v1/responses"];
/// Anthropic's Message Batches run on the same lane, with this endpoint (`http/message_batches.rs`).
pub const MESSAGES: &str = "/v1/messages";
/// A batch is given this long to finish (`completion_window`, OpenAI's only one), then it expires.
pub const WINDOW_S: i64 = 86_400;

/// A batch as the store keeps it, and (`shown`) as clients read it: OpenAI's Batch object, with the server's own
/// `_output_expires_after`. Its members are declared in name order, the order serde_json's maps write keys in, so a
/// row kept before this type existed loads and re-serializes to the same text, and clients read the same bytes. A
/// member still unset (a time not reached, a file not written) is left out, as it always was.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    /// What the batch asked of its results files' expiry (`output_expires_after.seconds`), kept for its runner.
    /// OpenAI's Batch object has no such member: a key with `_` is the server's own, and `shown` leaves it out.
    #[serde(rename = "_output_expires_after", default, skip_serializing_if = "Option::is_none")]
    pub output_expires_after: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelled_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelling_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<i64>,
    /// Always `24h`, OpenAI's only window.
    pub completion_window: String,
    pub created_at: i64,
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_file_id: Option<String>,
    /// Why it failed: the input lines at fault, or its results file that did not fit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errors: Option<BatchErrors>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expired_at: Option<i64>,
    pub expires_at: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finalizing_at: Option<i64>,
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_progress_at: Option<i64>,
    pub input_file_id: String,
    #[serde(default)]
    pub metadata: Map<String, Value>,
    /// Always `batch`.
    pub object: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_file_id: Option<String>,
    pub request_counts: RequestCounts,
    /// Moved only by `set_status` (`status.rs`), which stamps its time.
    pub status: BatchStatus,
}

/// A batch's lines: all of them, and those that ended each way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestCounts {
    pub completed: i64,
    pub failed: i64,
    pub total: i64,
}

/// A batch's `errors`: OpenAI's list object (members in name order, as for `Batch`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchErrors {
    pub data: Vec<LineError>,
    /// Always `list`.
    pub object: String,
}

/// One input line at fault (`line` counted from 1), or the batch's own fault at line 1.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineError {
    pub code: String,
    pub line: usize,
    pub message: String,
    /// Always null: OpenAI names no parameter for a line.
    pub param: Option<String>,
}

impl Batch {
    /// A new batch, `validating`, its window running from `now`.
    pub fn new(id: &str, endpoint: &str, input_file_id: &str, metadata: Map<String, Value>, now: i64) -> Batch {
        Batch {
            id: id.into(),
            object: "batch".into(),
            endpoint: endpoint.into(),
            input_file_id: input_file_id.into(),
            completion_window: "24h".into(),
            status: BatchStatus::Validating,
            created_at: now,
            expires_at: now + WINDOW_S,
            request_counts: RequestCounts::default(),
            metadata,
            output_expires_after: None,
            output_file_id: None,
            error_file_id: None,
            errors: None,
            in_progress_at: None,
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            expired_at: None,
            cancelling_at: None,
            cancelled_at: None,
        }
    }

    /// Request counts as the Batch object has them.
    pub fn set_counts(&mut self, total: i64, completed: i64, failed: i64) {
        self.request_counts = RequestCounts { total, completed, failed };
    }

    /// The Batch object as clients read it: without the server's own members.
    pub fn shown(&self) -> Batch {
        Batch { output_expires_after: None, ..self.clone() }
    }

    /// The text the store keeps.
    pub fn to_text(&self) -> String {
        // Strings, numbers and string-keyed maps only: serializing it cannot fail.
        serde_json::to_string(self).expect("a Batch serializes")
    }
}

impl BatchErrors {
    /// The list of the lines that did not check out: (line counted from 0, code, message).
    pub fn of(found: &[(usize, &'static str, String)]) -> BatchErrors {
        let data = found
            .iter()
            .map(|(line, code, message)| LineError {
                code: code.to_string(),
                line: line + 1,
                message: message.clone(),
                param: None,
            })
            .collect();
        BatchErrors { data, object: "list".into() }
    }
}

/// An input line to run: its number (counted from 0, blank lines not counted), its `custom_id` and its body.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    pub no: i64,
    pub custom_id: String,
    pub body: Value,
}

/// The door of an endpoint.
pub fn door(endpoint: &str) -> Option<Door> {
    let served = ENDPOINTS.contains(&endpoint) || endpoint == MESSAGES;
    Door::ALL.into_iter().find(|d| d.path() == endpoint && served)
}

/// Most lines a batch on `endpoint` runs: a Message Batch's were refused past OpenAI's 50,000 (every request of
/// one with 50,001 errored), though Anthropic allows 100,000.
pub fn lines_max(endpoint: &str) -> usize {
    if endpoint == MESSAGES { MAX_MESSAGE_BATCH_LINES } else { MAX_BATCH_LINES }
}

/// One input line, checked: (custom_id, body), or why not (OpenAI's line errors: a code and a message). Its JSON
/// is held to the bounds of a request body before it is parsed.
pub fn parse_line(text: &str, endpoint: &str, bounds: JsonBounds) -> Result<(String, Value), (&'static str, String)> {
    if let Err(e) = json_bounds::check(text.as_bytes(), bounds) {
        return Err(("line_too_large", e.refusal().to_string()));
    }
    let v: Value = serde_json::from_str(text).map_err(|e| ("invalid_json_line", format!("not JSON: {e}")))?;
    let Some(obj) = v.as_object() else { return Err(("invalid_json_line", "a line must be a JSON object".into())) };
    let custom_id = match obj.get("custom_id") {
        Some(Value::String(id)) if !id.is_empty() && id.len() <= 512 => id.clone(),
        _ => return Err(("missing_required_parameter", "'custom_id' must be a non-empty string".into())),
    };
    if obj.get("method").and_then(Value::as_str) != Some("POST") {
        return Err(("invalid_method", "'method' must be POST".into()));
    }
    if obj.get("url").and_then(Value::as_str) != Some(endpoint) {
        return Err(("mismatched_url", format!("'url' must be the batch's endpoint, {endpoint}")));
    }
    let Some(Value::Object(body)) = obj.get("body") else {
        return Err(("missing_required_parameter", "'body' must be a JSON object".into()));
    };
    Ok((custom_id, Value::Object(body.clone())))
}

/// A Batch as the store keeps it: a row of its own (`store::StoredBatch`), whose status column the claims and
/// cancels are checked against.
impl StoredBatch {
    /// The row of a new batch: its status and creation time are the batch's.
    pub fn new(batch: &Batch, trace_context: Option<String>, owned_by: &str) -> StoredBatch {
        StoredBatch {
            id: batch.id.clone(),
            created_at: batch.created_at,
            status: batch.status,
            batch: batch.to_text(),
            trace_context,
            owned_by: owned_by.to_string(),
        }
    }

    /// The Batch object this row keeps, with the row's status: the column every claim and cancel is checked
    /// against (the two are always written together). A row that does not read as one is the store's error.
    pub fn load(&self) -> Result<Batch, StoreError> {
        let undecodable = |e: serde_json::Error| StoreError::Db(sqlx::Error::Decode(Box::new(e)));
        let mut batch: Batch = serde_json::from_str(&self.batch).map_err(undecodable)?;
        batch.status = self.status;
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const B: JsonBounds = JsonBounds { elements: 100, depth: 8 };

    #[test]
    fn a_line_names_its_id_method_url_and_body() {
        let ok = r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m"}}"#;
        assert_eq!(parse_line(ok, "/v1/chat/completions", B).unwrap().0, "a");
        assert_eq!(parse_line(ok, "/v1/responses", B).unwrap_err().0, "mismatched_url");
        assert_eq!(parse_line("{", "/v1/responses", B).unwrap_err().0, "invalid_json_line");
        let no_id = r#"{"method":"POST","url":"/v1/responses","body":{}}"#;
        assert_eq!(parse_line(no_id, "/v1/responses", B).unwrap_err().0, "missing_required_parameter");
        let wide = format!(
            r#"{{"custom_id":"a","method":"POST","url":"/v1/responses","body":{{"x":[{}0]}}}}"#,
            "0,".repeat(100)
        );
        assert_eq!(parse_line(&wide, "/v1/responses", B).unwrap_err().0, "line_too_large");
        assert!(door("/v1/embeddings").is_none() && door("/v1/completions").is_some() && door(MESSAGES).is_some());
    }

    /// Rows as the store kept them before `Batch` (a `serde_json::Value`, keys in name order): a batch ended with its
    /// files and private expiry, one failed on its lines, and a Message Batch cancelled at once.
    const OLD_ROWS: [&str; 3] = [
        r#"{"_output_expires_after":3600,"completed_at":1700000300,"completion_window":"24h","created_at":1700000000,"endpoint":"/v1/chat/completions","error_file_id":"file-err","expires_at":1700086400,"finalizing_at":1700000250,"id":"batch_abc","in_progress_at":1700000010,"input_file_id":"file-in","metadata":{"k":"v"},"object":"batch","output_file_id":"file-out","request_counts":{"completed":2,"failed":1,"total":3},"status":"completed"}"#,
        r#"{"completion_window":"24h","created_at":1,"endpoint":"/v1/responses","errors":{"data":[{"code":"invalid_json_line","line":2,"message":"not JSON: x","param":null}],"object":"list"},"expires_at":86401,"failed_at":2,"id":"batch_x","input_file_id":"file-x","metadata":{},"object":"batch","request_counts":{"completed":0,"failed":0,"total":0},"status":"failed"}"#,
        r#"{"cancelled_at":9,"cancelling_at":5,"completion_window":"24h","created_at":4,"endpoint":"/v1/messages","expires_at":86404,"id":"msgbatch_1","input_file_id":"file-m","metadata":{},"object":"batch","request_counts":{"completed":0,"failed":0,"total":2},"status":"cancelled"}"#,
    ];

    #[test]
    fn an_old_row_loads_and_is_written_and_shown_as_before() {
        for row in OLD_ROWS {
            let batch: Batch = serde_json::from_str(row).unwrap();
            assert_eq!(batch.to_text(), row, "re-serialized");
            // Shown as the code before showed it: the Value without its `_` keys (nor nulls: there are none).
            let mut was: Map<String, Value> = serde_json::from_str(row).unwrap();
            was.retain(|k, v| !k.starts_with('_') && !v.is_null());
            assert_eq!(serde_json::to_string(&batch.shown()).unwrap(), Value::Object(was).to_string(), "shown");
        }
        let b: Batch = serde_json::from_str(OLD_ROWS[0]).unwrap();
        assert_eq!(
            (b.status, b.output_expires_after, b.request_counts.failed),
            (BatchStatus::Completed, Some(3600), 1)
        );
    }

    #[test]
    fn a_new_batch_is_written_as_before() {
        let mut b = Batch::new("batch_1", "/v1/responses", "file-1", Map::new(), 10);
        b.set_counts(3, 0, 0);
        b.set_status(BatchStatus::InProgress, 11).unwrap();
        b.errors = Some(BatchErrors::of(&[(0, "empty_file", "no lines".into())]));
        // What `new_batch`, `set_counts`, `set_status` and `errors` built as a Value.
        let was = json!({
            "id": "batch_1", "object": "batch", "endpoint": "/v1/responses", "input_file_id": "file-1",
            "completion_window": "24h", "status": "in_progress", "created_at": 10, "expires_at": 10 + WINDOW_S,
            "request_counts": {"total": 3, "completed": 0, "failed": 0}, "metadata": {}, "in_progress_at": 11,
            "errors": {"object": "list", "data": [{"code": "empty_file", "message": "no lines", "line": 1, "param": null}]},
        });
        assert_eq!(b.to_text(), was.to_string());
    }
}

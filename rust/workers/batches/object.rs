//! The Batch object (OpenAI's Batch API) and the input file's lines: what a batch is asked to run, checked before
//! it runs, and the output and error lines it writes, keyed by `custom_id`.

use crate::doors::Door;
use crate::json_bounds::{self, JsonBounds};
use crate::limits::{MAX_BATCH_LINES, MAX_MESSAGE_BATCH_LINES};
use serde_json::{Map, Value, json};

/// What a batch may serve: the doors OpenAI's Batch API names.
pub const ENDPOINTS: &[&str] = &["/v1/chat/completions", "/v1/completions", "/v1/responses"];
/// Anthropic's Message Batches run on the same lane, with this endpoint (`http/message_batches.rs`).
pub const MESSAGES: &str = "/v1/messages";
/// A batch is given this long to finish (`completion_window`, OpenAI's only one), then it expires.
pub const WINDOW_S: i64 = 86_400;

/// What the batch asked of its results files' expiry (`output_expires_after.seconds`), kept with the batch for its
/// runner. OpenAI's Batch object has no such member: a key with `_` is the server's own, and `shown` leaves it out.
pub const OUTPUT_EXPIRES_AFTER: &str = "_output_expires_after";

/// A new Batch object, `validating`.
pub fn new_batch(id: &str, endpoint: &str, input_file_id: &str, metadata: Value, now: i64) -> Value {
    json!({
        "id": id, "object": "batch", "endpoint": endpoint, "input_file_id": input_file_id,
        "completion_window": "24h", "status": "validating", "created_at": now, "expires_at": now + WINDOW_S,
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
    })
}

/// Move the batch to `status`, stamping its `<status>_at` time (`in_progress_at`, `completed_at`, ...).
pub fn set_status(batch: &mut Value, status: &str, now: i64) {
    batch["status"] = json!(status);
    batch[format!("{status}_at")] = json!(now);
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

/// A line's output (or error) line: the response's status and body, keyed by `custom_id`.
pub fn result_line(custom_id: &str, request_id: &str, status: u16, body: &[u8]) -> String {
    let body: Value = serde_json::from_slice(body).unwrap_or_else(|_| json!(String::from_utf8_lossy(body)));
    let line = json!({
        "id": crate::ids::random_id("batch_req"), "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body}, "error": null,
    });
    line.to_string()
}

/// A batch's `errors` list from the lines that did not check out.
pub fn errors(found: &[(usize, &'static str, String)]) -> Value {
    let data: Vec<Value> = found
        .iter()
        .map(|(line, code, message)| json!({"code": code, "message": message, "line": line + 1, "param": null}))
        .collect();
    json!({"object": "list", "data": data})
}

/// Request counts as the Batch object has them.
pub fn set_counts(batch: &mut Value, total: i64, completed: i64, failed: i64) {
    batch["request_counts"] = json!({"total": total, "completed": completed, "failed": failed});
}

/// The Batch object as clients read it: without the fields still unset.
pub fn shown(batch: &Value) -> Value {
    match batch {
        Value::Object(o) => Value::Object(
            o.iter()
                .filter(|(k, v)| !v.is_null() && !k.starts_with('_'))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<Map<_, _>>(),
        ),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

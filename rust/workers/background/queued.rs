//! The Response of a background request just queued (`super::run`): what the request asked for, echoed as
//! OpenAI's schema declares it, with no output and no usage yet.

use crate::store::items;
use serde_json::{Value, json};

/// The request's `text` as a Response echoes it: its format with only the keys OpenAI's schema declares for its
/// type (a client's extra key is not part of the Response), and `verbosity` when given.
fn echoed_text(text: Option<&Value>) -> Value {
    let format = text.and_then(|t| t.get("format")).filter(|f| f.is_object());
    let kind = format.and_then(|f| f.get("type")).and_then(Value::as_str).unwrap_or("text");
    let declared: &[&str] = match kind {
        "json_schema" => &["type", "name", "schema", "description", "strict"],
        _ => &["type"],
    };
    let mut echoed = serde_json::Map::new();
    echoed.insert("type".into(), json!(kind));
    if let Some(format) = format.and_then(Value::as_object) {
        for (key, value) in format.iter().filter(|(k, v)| declared.contains(&k.as_str()) && !v.is_null()) {
            echoed.insert(key.clone(), value.clone());
        }
    }
    let mut out = json!({"format": echoed});
    if let Some(v) = text.and_then(|t| t.get("verbosity")).filter(|v| v.is_string()) {
        out["verbosity"] = v.clone();
    }
    out
}

/// The Response of a request just queued: what the request asked for, no output and no usage yet.
pub(super) fn queued_response(body: &Value, id: &str) -> Value {
    let get = |key: &str, default: Value| body.get(key).filter(|v| !v.is_null()).cloned().unwrap_or(default);
    let reasoning = body.get("reasoning").cloned().unwrap_or(json!({}));
    let mut queued = json!({
        "id": id,
        "object": "response",
        "created_at": items::now(),
        "status": "queued",
        "background": true,
        "completed_at": null,
        "error": null,
        "incomplete_details": null,
        "instructions": get("instructions", Value::Null),
        "max_output_tokens": get("max_output_tokens", Value::Null),
        "max_tool_calls": get("max_tool_calls", Value::Null),
        "metadata": get("metadata", json!({})),
        "model": get("model", Value::Null),
        "output": [],
        "parallel_tool_calls": get("parallel_tool_calls", json!(true)),
        "previous_response_id": get("previous_response_id", Value::Null),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "service_tier": "default",
        "temperature": get("temperature", json!(1.0)),
        "text": echoed_text(body.get("text")),
        "tool_choice": get("tool_choice", json!("auto")),
        "tools": get("tools", json!([])),
        "top_logprobs": get("top_logprobs", json!(0)),
        "top_p": get("top_p", json!(1.0)),
        "truncation": "disabled",
    });
    match body.get("conversation") {
        Some(Value::String(conv)) => queued["conversation"] = json!({"id": conv}),
        Some(conv @ Value::Object(_)) => queued["conversation"] = conv.clone(),
        _ => {}
    }
    queued
}

#[cfg(test)]
mod tests {
    use super::echoed_text;
    use serde_json::json;

    #[test]
    fn a_queued_response_echoes_only_the_declared_format_keys() {
        let sent = json!({"format": {"type": "json_schema", "name": "x", "schema": {}, "junk": 1, "description": null},
                          "verbosity": "low", "other": 2});
        let want = json!({"format": {"type": "json_schema", "name": "x", "schema": {}}, "verbosity": "low"});
        assert_eq!(echoed_text(Some(&sent)), want);
        assert_eq!(
            echoed_text(Some(&json!({"format": {"type": "text", "junk": 1}}))),
            json!({"format": {"type": "text"}})
        );
        assert_eq!(echoed_text(None), json!({"format": {"type": "text"}}));
    }
}

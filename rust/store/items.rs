//! Items as the store keeps them (a response's input, a conversation's history): each has an id, a message's text
//! is the list of parts OpenAI lists it as, and a string input is one user message.

use super::StoredResponse;
use serde_json::{Map, Value, json};

/// Item types a client may add to a conversation: what a Responses request takes as input.
const ITEM_TYPES: &[&str] =
    &["message", "function_call", "function_call_output", "reasoning", "custom_tool_call", "custom_tool_call_output"];

/// A request's own input as items, each with an id (a string input is one user message).
pub fn own_items(input: Option<&Value>) -> Vec<Value> {
    let mut items = match input {
        Some(Value::String(text)) => {
            vec![json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})]
        }
        Some(Value::Array(items)) => items.clone(),
        _ => Vec::new(),
    };
    items.iter_mut().filter_map(Value::as_object_mut).for_each(normalize);
    items
}

/// Items a client adds to a conversation, checked: `Err((index, why))` for the first one that is not an item.
pub fn client_items(items: &[Value]) -> Result<Vec<Value>, (usize, String)> {
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let Some(obj) = item.as_object() else { return Err((i, "an item must be an object".into())) };
        let default = if obj.contains_key("role") { "message" } else { "" };
        let kind = obj.get("type").and_then(Value::as_str).unwrap_or(default);
        if !ITEM_TYPES.contains(&kind) {
            return Err((i, format!("items of type '{kind}' are not supported")));
        }
        if kind == "message" && !matches!(obj.get("content"), Some(Value::String(_) | Value::Array(_))) {
            return Err((i, "a message needs 'content', a string or a list of parts".into()));
        }
        let mut obj = obj.clone();
        normalize(&mut obj);
        out.push(Value::Object(obj));
    }
    Ok(out)
}

/// The fields kept of each item type the prompt reads: what deepseek-recipe converts, and what OpenAI's items list
/// shows. Anything else a client sends (unknown keys, a reasoning item's `summary` and `encrypted_content`, which
/// the prompt never holds) is not stored, nor copied along a chain. Other types are kept whole.
const KEPT: &[(&str, &[&str])] = &[
    ("message", &["type", "id", "role", "content", "status", "phase"]),
    ("reasoning", &["type", "id", "content", "status"]),
    ("function_call", &["type", "id", "call_id", "name", "namespace", "arguments", "status"]),
    ("function_call_output", &["type", "id", "call_id", "output", "status"]),
    ("custom_tool_call", &["type", "id", "call_id", "name", "namespace", "input", "status"]),
    ("custom_tool_call_output", &["type", "id", "call_id", "output", "status"]),
];
/// A message's content parts' fields (text, images, files, and what an assistant's text carries).
const PART_KEPT: &[&str] = &[
    "type",
    "text",
    "image_url",
    "file_id",
    "file_url",
    "file_data",
    "filename",
    "detail",
    "annotations",
    "logprobs",
    "refusal",
];

/// Drop what the prompt does not read (`KEPT`); a reasoning item keeps an empty `summary`, as OpenAI's schema has one.
fn keep_only_the_prompts(obj: &mut Map<String, Value>) {
    let kind = obj.get("type").and_then(Value::as_str).unwrap_or_default().to_string();
    let Some((_, kept)) = KEPT.iter().find(|(k, _)| *k == kind) else { return };
    obj.retain(|k, _| kept.contains(&k.as_str()));
    if kind == "reasoning" {
        obj.insert("summary".into(), json!([]));
    }
    if let Some(Value::Array(parts)) = obj.get_mut("content") {
        for part in parts.iter_mut().filter_map(Value::as_object_mut) {
            part.retain(|k, _| PART_KEPT.contains(&k.as_str()));
        }
    }
}

/// The first item (its index, and its size) whose stored JSON is larger than `max` bytes.
pub fn too_large(items: &[Value], max: u64) -> Option<(usize, usize)> {
    items.iter().map(|i| i.to_string().len()).enumerate().find(|(_, n)| *n as u64 > max)
}

fn normalize(obj: &mut Map<String, Value>) {
    obj.entry("type").or_insert_with(|| json!("message"));
    keep_only_the_prompts(obj);
    // A message's text as the list of parts OpenAI lists it as (`input_text`; `output_text` for what the assistant
    // said).
    if let Some(Value::String(text)) = obj.get("content") {
        let kind =
            if obj.get("role").and_then(Value::as_str) == Some("assistant") { "output_text" } else { "input_text" };
        let part = json!([{"type": kind, "text": text}]);
        obj.insert("content".into(), part);
    }
    if !obj.contains_key("id") {
        obj.insert("id".into(), json!(item_id(obj)));
    }
    // A stored message is a finished one (OpenAI's items list them with a status).
    if obj.get("type").and_then(Value::as_str) == Some("message") {
        obj.entry("status").or_insert_with(|| json!("completed"));
    }
}

fn item_id(item: &Map<String, Value>) -> String {
    let prefix = match item.get("type").and_then(Value::as_str) {
        Some("function_call") => "fc",
        Some("function_call_output") => "fco",
        Some("reasoning") => "rs",
        Some("custom_tool_call") => "ctc",
        Some("custom_tool_call_output") => "ctco",
        _ => "msg",
    };
    crate::ids::random_id(prefix)
}

/// An item's id and JSON text, as a conversation's rows keep them.
pub fn row(item: &Value) -> (String, String) {
    (item.get("id").and_then(Value::as_str).unwrap_or_default().to_string(), item.to_string())
}

/// The items a continuation of a chain starts from: `chain` is its responses, oldest first, the first either the
/// chain's start or a row that keeps a copy of what came before it (`context`); then each one's own input and
/// output.
pub fn chain_items(chain: &[StoredResponse]) -> Option<Vec<Value>> {
    let mut items: Vec<Value> = Vec::new();
    for r in chain {
        if r.context != super::CHAINED {
            items = serde_json::from_str(&r.context).ok()?;
        }
        items.extend(serde_json::from_str::<Vec<Value>>(&r.input_items).ok()?);
        items.extend(output_items(&serde_json::from_str(&r.response).ok()?));
    }
    Some(items)
}

/// A Response's output items.
pub fn output_items(response: &Value) -> Vec<Value> {
    response.get("output").and_then(Value::as_array).cloned().unwrap_or_default()
}

/// Seconds since the Unix epoch.
pub fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_becomes_items_with_ids() {
        let items = own_items(Some(&json!("hi")));
        assert_eq!(items[0]["content"][0], json!({"type": "input_text", "text": "hi"}));
        assert!(items[0]["id"].as_str().unwrap().starts_with("msg_"));
        let kept = own_items(Some(&json!([{"role": "user", "content": "a", "id": "msg_x"}])));
        assert_eq!(kept[0]["id"], "msg_x");
        assert_eq!(kept[0]["content"], json!([{"type": "input_text", "text": "a"}]));
        assert_eq!(kept[0]["type"], "message");
    }

    #[test]
    fn what_the_prompt_drops_is_not_kept() {
        let items = own_items(Some(&json!([
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "long"}], "encrypted_content": "x",
             "content": [{"type": "reasoning_text", "text": "kept"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "hi", "junk": 1}], "extra": "x"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "pad": "x"},
        ])));
        assert_eq!(items[0]["summary"], json!([]));
        assert!(items[0].get("encrypted_content").is_none());
        assert_eq!(items[0]["content"][0]["text"], "kept");
        assert_eq!(items[1]["content"], json!([{"type": "input_text", "text": "hi"}]));
        assert!(items[1].get("extra").is_none() && items[2].get("pad").is_none());
        assert_eq!(items[2]["arguments"], "{}");
        assert_eq!(too_large(&items, 10_000), None);
        assert_eq!(too_large(&items, 50).map(|(i, _)| i), Some(0));
    }

    #[test]
    fn a_client_adds_only_items() {
        let ok = client_items(&[json!({"role": "assistant", "content": "x"}), json!({"type": "function_call"})]);
        let ok = ok.unwrap();
        assert_eq!(ok[0]["content"][0]["type"], "output_text");
        assert!(ok[1]["id"].as_str().unwrap().starts_with("fc_"));
        assert_eq!(client_items(&[json!({"role": "user", "content": "a"}), json!(3)]).unwrap_err().0, 1);
        assert_eq!(client_items(&[json!({"type": "web_search_call"})]).unwrap_err().0, 0);
        assert_eq!(client_items(&[json!({"role": "user"})]).unwrap_err().0, 0);
    }
}

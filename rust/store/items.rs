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

fn normalize(obj: &mut Map<String, Value>) {
    obj.entry("type").or_insert_with(|| json!("message"));
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

/// The items a continuation of `r` starts from: its chain's, its own input's, and its output.
pub fn chain_items(r: &StoredResponse) -> Option<Vec<Value>> {
    let mut items: Vec<Value> = serde_json::from_str(&r.context).ok()?;
    items.extend(serde_json::from_str::<Vec<Value>>(&r.input_items).ok()?);
    items.extend(output_items(&serde_json::from_str(&r.response).ok()?));
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

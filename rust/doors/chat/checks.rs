//! The shapes of a chat body's parts, checked so that a malformed one gets a 400 naming its field: messages and
//! their content parts, tools, `response_format`, and the thinking switch of `chat_template_kwargs`.

use crate::error::ApiError;
pub use crate::limits::MAX_MESSAGES;
use serde_json::{Map, Value};

/// Chat's tools: function tools only, each a `function` with a name (deepseek-recipe's own errors would not name
/// the field).
pub fn check_tools(tools: &Value) -> Result<(), ApiError> {
    let Some(tools) = tools.as_array() else {
        return Err(ApiError::bad_param("tools", "Invalid 'tools': expected an array of tools."));
    };
    for (i, tool) in tools.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            let param = format!("tools[{i}].type");
            return Err(ApiError::bad_param(&param, format!("Invalid '{param}': only function tools are supported.")));
        }
        if !tool.get("function").and_then(|f| f.get("name")).is_some_and(Value::is_string) {
            let param = format!("tools[{i}].function.name");
            return Err(ApiError::bad_param(&param, format!("Invalid '{param}': a function tool needs a name.")));
        }
    }
    Ok(())
}

/// The shape of one message, so that a malformed one gets a 400 naming `messages[i].<field>`.
pub fn check_message(i: usize, m: &Map<String, Value>) -> Result<(), ApiError> {
    let bad = |field: &str, what: &str| {
        let param = format!("messages[{i}].{field}");
        Err(ApiError::bad_param(&param, format!("Invalid '{param}': {what}.")))
    };
    let role = m.get("role").and_then(Value::as_str);
    if role == Some("function") {
        return bad("role", "the deprecated 'function' role is not supported; send tool results as 'tool' messages");
    }
    if !matches!(role, Some("system" | "user" | "assistant" | "tool" | "latest_reminder")) {
        return bad("role", "expected one of system, developer, user, assistant, tool");
    }
    if !matches!(m.get("function_call"), None | Some(Value::Null)) {
        return bad("function_call", "the deprecated 'function_call' is not supported; use 'tool_calls'");
    }
    let has_calls = m.get("tool_calls").is_some_and(|c| !c.is_null());
    match m.get("content") {
        Some(Value::String(_) | Value::Array(_)) => {}
        None | Some(Value::Null) if role == Some("assistant") && has_calls => {}
        None | Some(Value::Null) if role == Some("assistant") => {
            return bad("content", "an assistant message needs 'content' or 'tool_calls'");
        }
        None => return bad("content", "this message needs a content"),
        Some(_) => return bad("content", "expected a string or an array of content parts"),
    }
    if let Some(Value::Array(parts)) = m.get("content") {
        for (j, part) in parts.iter().enumerate() {
            let Some(part) = part.as_object() else {
                return bad(&format!("content[{j}]"), "expected a content part object");
            };
            if part.get("type").and_then(Value::as_str) == Some("text")
                && !part.get("text").is_some_and(Value::is_string)
            {
                return bad(&format!("content[{j}].text"), "a text part needs a string 'text'");
            }
        }
    }
    for key in ["name", "reasoning_content"] {
        if !matches!(m.get(key), None | Some(Value::Null | Value::String(_))) {
            return bad(key, "expected a string");
        }
    }
    if role == Some("tool") && !m.get("tool_call_id").is_some_and(Value::is_string) {
        return bad("tool_call_id", "a tool message needs a string 'tool_call_id'");
    }
    match m.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            for (j, call) in calls.iter().enumerate() {
                if call.get("type").and_then(Value::as_str) != Some("function") {
                    return bad(&format!("tool_calls[{j}].type"), "only function tool calls are supported");
                }
            }
        }
        Some(_) => return bad("tool_calls", "expected an array"),
    }
    Ok(())
}

/// Reject content the service cannot take (audio, files): text and image parts only.
pub fn check_content(i: usize, msg: &Map<String, Value>) -> Result<(), ApiError> {
    let Some(Value::Array(parts)) = msg.get("content") else {
        return Ok(());
    };
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "text" && kind != "image_url" {
            let param = format!("messages[{i}].content[{j}].type");
            let what = if kind.is_empty() { "a content part without a type".to_string() } else { format!("'{kind}'") };
            return Err(ApiError::bad_param(
                &param,
                format!(
                    "Only text and image_url content parts are supported; {what} is not (audio and files are not)."
                ),
            ));
        }
    }
    Ok(())
}

/// An assistant turn's `refusal` parts are what it said: text to the model.
pub fn refusals_as_text(msg: &mut Map<String, Value>) {
    let Some(Value::Array(parts)) = msg.get_mut("content") else { return };
    for part in parts.iter_mut() {
        if part.get("type").and_then(Value::as_str) == Some("refusal")
            && let Some(text) = part.get("refusal").filter(|r| r.is_string()).cloned()
        {
            *part = serde_json::json!({"type": "text", "text": text});
        }
    }
}

/// Chat's `response_format`: text, json_object, json_schema (with a schema) or deepseek-recipe's regex. The
/// schema itself is checked by deepseek-recipe and compiled by the codec (python/deepinfer_server/grammar.py).
pub fn check_response_format(rf: &Value) -> Result<(), ApiError> {
    let bad = |param: &str, what: &str| Err(ApiError::bad_param(param, format!("Invalid '{param}': {what}.")));
    match rf.get("type").and_then(Value::as_str) {
        Some("text" | "json_object") => Ok(()),
        Some("json_schema") => match rf.get("json_schema") {
            Some(Value::Object(js)) => match js.get("schema") {
                Some(Value::Object(_) | Value::Bool(_)) => Ok(()),
                None | Some(Value::Null) => bad("response_format.json_schema.schema", "a JSON schema is required"),
                Some(_) => bad("response_format.json_schema.schema", "expected a JSON schema object"),
            },
            _ => bad("response_format.json_schema", "expected an object with 'name' and 'schema'"),
        },
        Some("regex") if rf.get("regex").is_some_and(Value::is_string) => Ok(()),
        Some("regex") => bad("response_format.regex", "expected a regular expression string"),
        _ => bad("response_format.type", "expected \"text\", \"json_object\", \"json_schema\" or \"regex\""),
    }
}

/// The thinking switch clients written for vLLM or Qwen send, and gateways (smg) write into rewritten bodies:
/// `chat_template_kwargs: {"thinking": bool}` or `{"enable_thinking": bool}`, turned into the top-level
/// `thinking` deepseek-recipe reads. A top-level `thinking` wins; `thinking` wins over `enable_thinking`.
pub fn thinking_from_template_kwargs(obj: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(Value::Object(kwargs)) = obj.get("chat_template_kwargs") else { return Ok(()) };
    let Some((key, value)) =
        ["thinking", "enable_thinking"].iter().find_map(|k| kwargs.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)))
    else {
        return Ok(());
    };
    let Some(on) = value.as_bool() else {
        let param = format!("chat_template_kwargs.{key}");
        return Err(ApiError::bad_param(&param, format!("'{param}' must be a boolean")));
    };
    if matches!(obj.get("thinking"), None | Some(Value::Null)) {
        let kind = if on { "enabled" } else { "disabled" };
        obj.insert("thinking".into(), serde_json::json!({"type": kind}));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_tools_are_function_tools() {
        let param = |t: Value| {
            let env: Value = serde_json::from_str(&check_tools(&t).unwrap_err().envelope()).unwrap();
            env["error"]["param"].as_str().unwrap().to_string()
        };
        assert_eq!(param(json!([{"type": "custom", "custom": {"name": "x"}}])), "tools[0].type");
        assert_eq!(param(json!([{"type": "function", "function": {}}])), "tools[0].function.name");
        check_tools(&json!([{"type": "function", "function": {"name": "f"}}])).unwrap();
    }

    #[test]
    fn malformed_messages_name_the_field() {
        let param = |m: Value| {
            let e = check_message(0, m.as_object().unwrap()).unwrap_err();
            let env: Value = serde_json::from_str(&e.envelope()).unwrap();
            env["error"]["param"].as_str().unwrap().to_string()
        };
        assert_eq!(param(json!({"role": "bogus", "content": "x"})), "messages[0].role");
        assert_eq!(param(json!({"role": "user"})), "messages[0].content");
        assert_eq!(param(json!({"role": "user", "content": 5})), "messages[0].content");
        assert_eq!(param(json!({"role": "user", "content": [{"type": "text"}]})), "messages[0].content[0].text");
        assert_eq!(param(json!({"role": "user", "content": "x", "name": 5})), "messages[0].name");
        assert_eq!(param(json!({"role": "tool", "content": "x"})), "messages[0].tool_call_id");
        assert_eq!(param(json!({"role": "assistant", "content": "x", "tool_calls": 5})), "messages[0].tool_calls");
        let custom = json!({"role": "assistant", "tool_calls": [{"type": "custom", "custom": {}}]});
        assert_eq!(param(custom), "messages[0].tool_calls[0].type");
        assert_eq!(param(json!({"role": "function", "name": "f", "content": "x"})), "messages[0].role");
        assert_eq!(param(json!({"role": "assistant", "content": null})), "messages[0].content");
        let old = json!({"role": "assistant", "content": null, "function_call": {"name": "f", "arguments": "{}"}});
        assert_eq!(param(old), "messages[0].function_call");
        check_message(0, json!({"role": "assistant", "content": null, "tool_calls": []}).as_object().unwrap()).unwrap();
    }
}

//! Tool choices: the one check every door with tools makes (a forced choice needs tools, and a named one must name
//! one of them; deepseek-recipe's own error would name another field, and Anthropic's any/tool it turns into
//! auto). How a door spells its choice and its tools is its `Tools` arm, in its module.

use super::fields::brief;
use crate::error::ApiError;
use serde_json::{Map, Value};

/// A tool choice that forces a call, for the codec to constrain: any of the tools (`name` None) or one by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForcedTool {
    pub name: Option<String>,
    /// More than one call in the block (OpenAI's `parallel_tool_calls`, Anthropic's `disable_parallel_tool_use`).
    pub parallel: bool,
}

/// How a door spells its tool choice and its tools.
pub trait Tools {
    /// The choice a non-null `tool_choice` makes: None for auto or none, or what is wrong with it.
    /// `parallel_calls` is OpenAI's `parallel_tool_calls`.
    fn choice(choice: &Value, parallel_calls: bool) -> Result<Option<ForcedTool>, String>;
    /// A tool's name, as this door spells its tools.
    fn tool_name(tool: &Value) -> Option<&str>;
}

/// The door's `tool_choice`: None for auto, none or absent.
pub fn tool_choice<D: Tools>(obj: &Map<String, Value>) -> Result<Option<ForcedTool>, ApiError> {
    let bad = |what: String| Err(ApiError::bad_param("tool_choice", format!("Invalid 'tool_choice': {what}")));
    let choice = match obj.get("tool_choice") {
        None | Some(Value::Null) => return Ok(None),
        Some(c) => c,
    };
    let parallel_calls = !matches!(obj.get("parallel_tool_calls"), Some(Value::Bool(false)));
    let forced = match D::choice(choice, parallel_calls) {
        Ok(Some(forced)) => forced,
        Ok(None) => return Ok(None),
        Err(what) => return bad(what),
    };
    let tools: Vec<&str> = match obj.get("tools") {
        Some(Value::Array(tools)) => tools.iter().filter_map(D::tool_name).collect(),
        _ => Vec::new(),
    };
    if tools.is_empty() {
        return bad("forcing a tool call needs 'tools'.".into());
    }
    if let Some(n) = &forced.name
        && !tools.contains(&n.as_str())
    {
        return bad(format!("no tool named '{n}' is in 'tools'."));
    }
    Ok(Some(forced))
}

/// OpenAI's string choices (Chat, Responses): `"auto"`, `"none"`, `"required"`.
pub fn openai_mode(mode: &str, parallel: bool) -> Result<Option<ForcedTool>, String> {
    match mode {
        "auto" | "none" => Ok(None),
        "required" => Ok(Some(ForcedTool { name: None, parallel })),
        other => Err(format!("expected \"auto\", \"none\", \"required\" or a function, got \"{other}\".")),
    }
}

/// A choice of a shape the door does not take.
pub fn unsupported(choice: &Value) -> String {
    format!("unsupported choice {}.", brief(choice))
}

/// `v["name"]`, a string.
pub fn name(v: &Value) -> Option<&str> {
    v.get("name").and_then(Value::as_str)
}

#[cfg(test)]
mod tests {
    use super::super::{chat::Chat, messages::Messages, responses::Responses};
    use super::*;
    use serde_json::json;

    #[test]
    fn forced_tool_choices() {
        let chat = json!({"tools": [{"type": "function", "function": {"name": "f"}}]});
        let with = |base: &Value, choice: Value| {
            let mut o = base.as_object().unwrap().clone();
            o.insert("tool_choice".into(), choice);
            o
        };
        let param = |r: Result<Option<ForcedTool>, ApiError>| {
            let env: Value = serde_json::from_str(&r.unwrap_err().envelope()).unwrap();
            env["error"]["param"].as_str().unwrap().to_string()
        };
        assert_eq!(tool_choice::<Chat>(&with(&chat, json!("auto"))).unwrap(), None);
        let any = Some(ForcedTool { name: None, parallel: true });
        assert_eq!(tool_choice::<Chat>(&with(&chat, json!("required"))).unwrap(), any);
        let named = json!({"type": "function", "function": {"name": "f"}});
        let f = Some(ForcedTool { name: Some("f".into()), parallel: true });
        assert_eq!(tool_choice::<Chat>(&with(&chat, named)).unwrap(), f);
        let unknown = json!({"type": "function", "function": {"name": "zz"}});
        assert_eq!(param(tool_choice::<Chat>(&with(&chat, unknown))), "tool_choice");
        assert_eq!(param(tool_choice::<Chat>(&with(&json!({}), json!("required")))), "tool_choice");
        assert_eq!(param(tool_choice::<Chat>(&with(&chat, json!("sometimes")))), "tool_choice");
        let msgs = json!({"tools": [{"name": "f", "input_schema": {"type": "object"}}]});
        let one = json!({"type": "tool", "name": "f", "disable_parallel_tool_use": true});
        let got = tool_choice::<Messages>(&with(&msgs, one)).unwrap();
        assert_eq!(got, Some(ForcedTool { name: Some("f".into()), parallel: false }));
        assert_eq!(param(tool_choice::<Messages>(&with(&msgs, json!({"type": "tool", "name": "g"})))), "tool_choice");
        let resp = json!({"tools": [{"type": "function", "name": "f"}], "parallel_tool_calls": false});
        let got = tool_choice::<Responses>(&with(&resp, json!({"type": "function", "name": "f"}))).unwrap();
        assert_eq!(got, Some(ForcedTool { name: Some("f".into()), parallel: false }));
    }
}

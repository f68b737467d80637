//! Request checks of the Anthropic Messages and OpenAI Responses doors, done in Rust before any Python runs: the
//! JSON shape, the model, what the front end itself needs (stream, top_k), and what the server cannot do, refused
//! in words. deepseek-recipe converts and validates the rest, as it does for chat (`request.rs`).

use super::fields::integer;
use super::request::{GenerateRequest, body_and_model, opt_bool};
use crate::error::ApiError;
use serde_json::{Map, Value};

fn generate(obj: &Map<String, Value>, model: String, top_k: i32, body: &Value) -> Result<GenerateRequest, ApiError> {
    Ok(GenerateRequest {
        model,
        stream: opt_bool(obj, "stream", "stream")?,
        include_usage: false,
        continuous_usage: false,
        ignore_eos: false,
        top_k,
        seed: None,
        body: serde_json::to_vec(body).map_err(|_| ApiError::Internal)?,
    })
}

fn set(obj: &Map<String, Value>, key: &str) -> bool {
    !matches!(obj.get(key), None | Some(Value::Null))
}

/// `POST /v1/messages`.
pub fn messages(raw: &[u8], served: &[String]) -> Result<GenerateRequest, ApiError> {
    let (v, model) = body_and_model(raw, served)?;
    let obj = v.as_object().ok_or(ApiError::Internal)?;
    // deepseek-recipe ignores top_k; the rank takes it. Anthropic's 0 means no top-k filtering.
    let top_k = match obj.get("top_k") {
        None | Some(Value::Null) => -1,
        Some(k) => match integer(k) {
            Some(0) => -1,
            Some(k) if (1..=i32::MAX as i64).contains(&k) => k as i32,
            _ => return Err(ApiError::bad_param("top_k", "'top_k' must be a non-negative integer.")),
        },
    };
    // deepseek-recipe turns a forced tool choice into "auto"; the engine constraint for it is not wired yet.
    if let Some(kind) = obj.get("tool_choice").and_then(|c| c.get("type")).and_then(Value::as_str)
        && matches!(kind, "any" | "tool")
    {
        return Err(ApiError::bad_param(
            "tool_choice",
            format!("tool_choice \"{kind}\" is not supported yet; use \"auto\" or \"none\"."),
        ));
    }
    if !matches!(obj.get("metadata"), None | Some(Value::Null | Value::Object(_))) {
        return Err(ApiError::bad_param("metadata", "'metadata' must be an object."));
    }
    generate(obj, model, top_k, &v)
}

/// Responses tools the server can run: function tools (and deepseek-recipe's `apply_patch` custom tool).
const CLIENT_TOOLS: &[&str] = &["function", "custom"];

/// `POST /v1/responses`.
pub fn responses(raw: &[u8], served: &[String]) -> Result<GenerateRequest, ApiError> {
    let (v, model) = body_and_model(raw, served)?;
    let obj = v.as_object().ok_or(ApiError::Internal)?;
    // There is no response store: deepseek-recipe would drop these silently, and the client would think them kept.
    for key in ["previous_response_id", "conversation"] {
        if set(obj, key) {
            return Err(ApiError::bad_param(
                key,
                format!("'{key}' is not supported: the server keeps no responses; send the whole input instead."),
            ));
        }
    }
    for key in ["store", "background"] {
        if obj.get(key) == Some(&Value::Bool(true)) {
            return Err(ApiError::bad_param(
                key,
                format!("'{key}: true' is not supported: the server keeps no responses."),
            ));
        }
    }
    if let Some(Value::Array(tools)) = obj.get("tools") {
        for (i, tool) in tools.iter().enumerate() {
            let kind = tool.get("type").and_then(Value::as_str).unwrap_or("");
            if !CLIENT_TOOLS.contains(&kind) {
                let param = format!("tools[{i}].type");
                return Err(ApiError::bad_param(
                    &param,
                    format!(
                        "Hosted tool '{kind}' is not supported: only function tools run here (the client runs them)."
                    ),
                ));
            }
        }
    }
    if obj.get("top_logprobs").and_then(integer).is_some_and(|n| n > 0) {
        return Err(ApiError::bad_param("top_logprobs", "logprobs are not supported yet."));
    }
    if let Some(kind) =
        obj.get("text").and_then(|t| t.get("format")).and_then(|f| f.get("type")).and_then(Value::as_str)
        && kind != "text"
    {
        return Err(ApiError::bad_param(
            "text.format",
            format!("Structured output ('{kind}') is not supported yet; only \"text\" is."),
        ));
    }
    generate(obj, model, -1, &v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names() -> Vec<String> {
        vec!["m".into()]
    }

    fn param(f: fn(&[u8], &[String]) -> Result<GenerateRequest, ApiError>, body: Value) -> String {
        let e = f(body.to_string().as_bytes(), &names()).unwrap_err();
        let env: Value = serde_json::from_str(&e.envelope()).unwrap();
        env["error"]["param"].as_str().unwrap_or("").to_string()
    }

    #[test]
    fn messages_checks() {
        let base = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
        let ok = messages(base.to_string().as_bytes(), &names()).unwrap();
        assert!(!ok.stream && ok.top_k == -1);
        let mut b = base.clone();
        b["top_k"] = json!(5.0);
        b["stream"] = json!(true);
        let r = messages(b.to_string().as_bytes(), &names()).unwrap();
        assert!(r.stream && r.top_k == 5);
        for (extra, field) in [
            (json!({"tool_choice": {"type": "any"}}), "tool_choice"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"metadata": 5}), "metadata"),
            (json!({"stream": "x"}), "stream"),
        ] {
            let mut b = base.clone();
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            assert_eq!(param(messages, b), field);
        }
        let e = messages(json!({"model": "x", "messages": []}).to_string().as_bytes(), &names()).unwrap_err();
        assert_eq!(e.status(), 404);
    }

    #[test]
    fn responses_refuse_what_no_server_state_can_do() {
        let base = json!({"model": "m", "input": "hi"});
        assert!(responses(base.to_string().as_bytes(), &names()).is_ok());
        for (extra, field) in [
            (json!({"previous_response_id": "resp_1"}), "previous_response_id"),
            (json!({"store": true}), "store"),
            (json!({"background": true}), "background"),
            (json!({"tools": [{"type": "web_search"}]}), "tools[0].type"),
            (json!({"tools": [{"type": "function", "name": "f"}, {"type": "file_search"}]}), "tools[1].type"),
            (json!({"top_logprobs": 3}), "top_logprobs"),
            (json!({"text": {"format": {"type": "json_object"}}}), "text.format"),
        ] {
            let mut b = base.clone();
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            assert_eq!(param(responses, b), field);
        }
        let mut b = base.clone();
        b["store"] = json!(false);
        assert!(responses(b.to_string().as_bytes(), &names()).is_ok());
    }
}

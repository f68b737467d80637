//! Request checks of the Anthropic Messages and OpenAI Responses doors, done in Rust before any Python runs: the
//! JSON shape, the model, what the front end itself needs (stream, top_k), and what the server cannot do, refused
//! in words. deepseek-recipe converts and validates the rest, as it does for chat (`request.rs`).

use super::fields::{self, integer};
use super::request::{GenerateRequest, body_and_model, images_of, opt_bool};
use crate::error::ApiError;
use crate::protocol::Protocol;
use serde_json::{Map, Value};

fn generate(
    (raw, protocol): (&[u8], Protocol),
    mut body: Value,
    model: String,
    top_k: i32,
    forced_tool: Option<fields::ForcedTool>,
) -> Result<GenerateRequest, ApiError> {
    let images = images_of(protocol, raw, &body);
    let obj = body.as_object_mut().ok_or(ApiError::Internal)?;
    let priority = fields::take_priority(obj)?;
    Ok(GenerateRequest {
        model,
        stream: opt_bool(obj, "stream", "stream")?,
        include_usage: false,
        continuous_usage: false,
        // vLLM's extension, on every door: benchmark clients need outputs of an exact length.
        ignore_eos: opt_bool(obj, "ignore_eos", "ignore_eos")?,
        top_k,
        seed: None,
        forced_tool,
        priority,
        images,
        body: serde_json::to_vec(&body).map_err(|_| ApiError::Internal)?,
    })
}

fn set(obj: &Map<String, Value>, key: &str) -> bool {
    !matches!(obj.get(key), None | Some(Value::Null))
}

/// Integer fields as integers: JSON Schema counts `1.0` as one, deepseek-recipe would not.
fn integers(obj: &mut Map<String, Value>, keys: &[&str]) {
    for key in keys {
        if let Some(i) = obj.get(*key).filter(|v| v.is_f64()).and_then(integer) {
            obj.insert((*key).into(), Value::from(i));
        }
    }
}

/// `POST /v1/messages`.
pub fn messages(raw: &[u8], served: &[String]) -> Result<GenerateRequest, ApiError> {
    let (mut v, model) = body_and_model(raw, served)?;
    integers(v.as_object_mut().ok_or(ApiError::Internal)?, &["max_tokens", "top_k"]);
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
    // deepseek-recipe turns "any" (and, with thinking on, "tool") into "auto": the codec constrains them itself.
    let forced_tool = fields::tool_choice(obj, fields::ToolDoor::Messages)?;
    if !matches!(obj.get("metadata"), None | Some(Value::Null | Value::Object(_))) {
        return Err(ApiError::bad_param("metadata", "'metadata' must be an object."));
    }
    let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
    client_tools(obj)?;
    output_format(obj)?;
    // Anthropic's API thinks only when asked: a request that says nothing gets no thinking block (the quickstart
    // reads `content[0].text`). A served name that pins thinking on still turns it on (`generate::pin_thinking`).
    if matches!(obj.get("thinking"), None | Some(Value::Null)) {
        obj.insert("thinking".into(), serde_json::json!({"type": "disabled"}));
    }
    generate((raw, Protocol::Messages), v, model, top_k, forced_tool)
}

/// Messages tools: a client tool is one without a `type` or with `"type": "custom"` (as litellm writes them); any
/// other type is one of Anthropic's server tools (`web_search_*`, `bash_*`, `text_editor_*`, `code_execution_*`,
/// ...), which this server does not run, refused by name. Custom ones go on to deepseek-recipe without the type.
fn client_tools(obj: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(Value::Array(tools)) = obj.get_mut("tools") else { return Ok(()) };
    let mut server = Vec::new();
    for (i, tool) in tools.iter_mut().enumerate() {
        let Some(t) = tool.as_object_mut() else { continue }; // deepseek-recipe refuses it with its own words
        match t.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(kind)) if kind == "custom" => {
                t.remove("type");
            }
            Some(kind) => server.push(format!("tools[{i}] ({})", crate::error::clip(&kind.to_string(), 64))),
        }
    }
    if server.is_empty() {
        return Ok(());
    }
    let param =
        if server.len() == 1 { server[0].split(' ').next().unwrap_or("tools").to_string() } else { "tools".into() };
    Err(ApiError::bad_param(
        &param,
        format!(
            "Server tools are not supported by this server: {}. Client tools (no 'type', or 'type': 'custom') are.",
            server.join(", ")
        ),
    ))
}

/// Anthropic's structured outputs: `output_config.format` (or the older beta `output_format`) with `type`
/// `json_schema` and a `schema`, left in the body for the codec (which enforces it as chat's `json_schema` in strict
/// mode, after Anthropic's schema limits). Only one of the two may be given.
fn output_format(obj: &mut Map<String, Value>) -> Result<(), ApiError> {
    let config = match obj.get("output_config") {
        None | Some(Value::Null) => None,
        Some(Value::Object(c)) => c.get("format").filter(|f| !f.is_null()).map(|f| ("output_config.format", f)),
        Some(_) => return Err(ApiError::bad_param("output_config", "'output_config' must be an object.")),
    };
    let beta = obj.get("output_format").filter(|f| !f.is_null()).map(|f| ("output_format", f));
    let (param, format) = match (config, beta) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_param(
                "output_format",
                "Give 'output_config.format' or the deprecated 'output_format', not both.",
            ));
        }
        (Some(f), None) | (None, Some(f)) => f,
        (None, None) => return Ok(()),
    };
    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
        let message = format!("Invalid '{param}.type': only \"json_schema\" is supported.");
        return Err(ApiError::bad_param(&format!("{param}.type"), message));
    }
    if !format.get("schema").is_some_and(Value::is_object) {
        return Err(ApiError::bad_param(&format!("{param}.schema"), format!("'{param}' needs a JSON schema object.")));
    }
    Ok(())
}

/// Responses tools the server can run: function tools (and deepseek-recipe's `apply_patch` custom tool).
const CLIENT_TOOLS: &[&str] = &["function", "custom"];

/// Input items deepseek-recipe converts; anything else (hosted tools' calls, references to stored items) is not
/// served.
const INPUT_ITEMS: &[&str] = &[
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "custom_tool_call",
    "custom_tool_call_output",
    "tool_search_call",
    "tool_search_output",
];
/// Items that answer or make a tool call: they need the call's id.
const CALL_ITEMS: &[&str] = &[
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "tool_search_call",
    "tool_search_output",
];

/// Check the input items; an assistant turn's `refusal` parts are what it said: its text.
fn check_input(input: &mut Value) -> Result<(), ApiError> {
    let Value::Array(items) = input else { return Ok(()) };
    if items.is_empty() {
        return Err(ApiError::bad_param("input", "'input' must not be an empty array."));
    }
    for (i, item) in items.iter_mut().enumerate() {
        // An item with neither a type nor a role is a reference to a stored item.
        let default = if item.get("role").is_some() { "message" } else { "item_reference" };
        let kind = item.get("type").and_then(Value::as_str).unwrap_or(default).to_string();
        let kind = kind.as_str();
        if !INPUT_ITEMS.contains(&kind) {
            let param = format!("input[{i}].type");
            return Err(ApiError::bad_param(&param, format!("Input items of type '{kind}' are not supported.")));
        }
        if CALL_ITEMS.contains(&kind) && !item.get("call_id").is_some_and(Value::is_string) {
            let param = format!("input[{i}].call_id");
            return Err(ApiError::bad_param(&param, format!("A '{kind}' input item needs a string 'call_id'.")));
        }
        if let Some(Value::Array(parts)) = item.get_mut("content") {
            for part in parts.iter_mut() {
                if part.get("type").and_then(Value::as_str) == Some("refusal")
                    && let Some(text) = part.get("refusal").filter(|r| r.is_string()).cloned()
                {
                    *part = serde_json::json!({"type": "output_text", "text": text});
                }
            }
        }
    }
    Ok(())
}

/// `POST /v1/responses`.
pub fn responses(raw: &[u8], served: &[String]) -> Result<GenerateRequest, ApiError> {
    let (mut v, model) = body_and_model(raw, served)?;
    let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
    integers(obj, &["max_output_tokens", "top_logprobs", "max_tool_calls"]);
    fields::check(obj)?; // the sampling and bookkeeping fields it shares with chat
    let top_k = if fields::take_greedy_top_p(obj) { 1 } else { -1 };
    if let Some(input) = obj.get_mut("input") {
        check_input(input)?;
    }
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
    if set(obj, "prompt") {
        return Err(ApiError::bad_param("prompt", "Stored prompt templates are not supported; send 'input'."));
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
            if kind == "custom" && tool.get("name").and_then(Value::as_str) != Some("apply_patch") {
                let param = format!("tools[{i}].type");
                return Err(ApiError::bad_param(
                    &param,
                    "Custom tools are not supported, but for 'apply_patch'; send function tools.",
                ));
            }
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
    let forced_tool = fields::tool_choice(obj, fields::ToolDoor::Responses)?;
    fields::top_logprobs(obj, "top_logprobs")?;
    if let Some(format) = obj.get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null()) {
        match format.get("type").and_then(Value::as_str) {
            Some("text" | "json_object") => {}
            Some("json_schema") if matches!(format.get("schema"), Some(Value::Object(_) | Value::Bool(_))) => {}
            Some("json_schema") => {
                return Err(ApiError::bad_param(
                    "text.format.schema",
                    "Invalid 'text.format.schema': a JSON schema is required.",
                ));
            }
            _ => {
                return Err(ApiError::bad_param(
                    "text.format.type",
                    "Invalid 'text.format.type': expected \"text\", \"json_object\" or \"json_schema\".",
                ));
            }
        }
    }
    generate((raw, Protocol::Responses), v, model, top_k, forced_tool)
}

/// `POST /v1/completions`: a raw prompt (a string, a list of one, or token IDs), optionally with a `suffix` for
/// fill-in-the-middle. The codec encodes it as plain text; the checks here are the request's shape.
pub fn completions(raw: &[u8], served: &[String]) -> Result<GenerateRequest, ApiError> {
    let (mut v, model) = body_and_model(raw, served)?;
    let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
    fields::check(obj)?; // sampling and bookkeeping fields, as in chat
    let seed = fields::take_seed(obj)?;
    let priority = fields::take_priority(obj)?;
    let prompt = match obj.get("prompt") {
        // OpenAI's default prompt is its end-of-text token: generation from the start of a document.
        None | Some(Value::Null) => Value::String(String::new()),
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => a[0].clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_array() => token_ids(&a[0])?,
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => token_ids(&v["prompt"])?,
        Some(Value::Array(a)) if a.len() > 1 => {
            return Err(ApiError::bad_param("prompt", "Only one prompt per request is supported (a batch is not)."));
        }
        _ => {
            return Err(ApiError::bad_param(
                "prompt",
                "'prompt' must be a string, a list of one string, or a list of token IDs.",
            ));
        }
    };
    let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
    obj.insert("prompt".into(), prompt);
    if !matches!(obj.get("suffix"), None | Some(Value::Null | Value::String(_))) {
        return Err(ApiError::bad_param("suffix", "'suffix' must be a string."));
    }
    // One completion per request; best_of 0 (which the schema allows) asks for no more than that.
    for (key, least) in [("n", 1), ("best_of", 0)] {
        if obj.get(key).filter(|n| !n.is_null()).is_some_and(|n| !integer(n).is_some_and(|n| (least..=1).contains(&n)))
        {
            return Err(ApiError::bad_param(key, format!("Only {key} = 1 is supported.")));
        }
    }
    if let Some(n) = fields::top_logprobs(obj, "logprobs")? {
        obj.insert("logprobs".into(), Value::from(n));
    }
    // 0 is OpenAI's scoring idiom (with `echo` and `logprobs`): the prompt alone, nothing generated.
    let max_tokens = match obj.get("max_tokens").map(integer) {
        Some(Some(0)) => Some(0),
        _ => super::request::opt_u64(obj, "max_tokens")?,
    };
    obj.insert("max_tokens".into(), Value::from(max_tokens.unwrap_or(16))); // OpenAI's default for completions
    if obj.get("echo") == Some(&Value::Bool(true)) && obj.get("suffix").is_some_and(Value::is_string) {
        return Err(ApiError::bad_param("echo", "'echo' cannot be combined with 'suffix'."));
    }
    let mut top_k = match obj.get("top_k") {
        None | Some(Value::Null) => -1,
        Some(k) => match integer(k) {
            Some(k) if k == -1 || (1..=i32::MAX as i64).contains(&k) => k as i32,
            _ => return Err(ApiError::bad_param("top_k", "'top_k' must be -1 or a positive integer.")),
        },
    };
    if fields::take_greedy_top_p(obj) {
        top_k = 1;
    }
    let (mut include_usage, mut continuous_usage) = (false, false);
    let stream = opt_bool(obj, "stream", "stream")?;
    // The prompt's logprobs: OpenAI's `echo` with `logprobs` (scoring, as lm-eval asks), or vLLM's extension.
    let echo_logprobs =
        obj.get("echo") == Some(&Value::Bool(true)) && obj.get("logprobs").is_some_and(|v| !v.is_null());
    if fields::prompt_logprobs(obj, stream)?.is_some() || echo_logprobs {
        fields::check_scoring_sampling(obj, Some(max_tokens.unwrap_or(16)), top_k)?;
    }
    if let Some(Value::Object(so)) = obj.get("stream_options") {
        include_usage = opt_bool(so, "include_usage", "stream_options.include_usage")?;
        continuous_usage = opt_bool(so, "continuous_usage_stats", "stream_options.continuous_usage_stats")?;
    }
    let ignore_eos = opt_bool(obj, "ignore_eos", "ignore_eos")?;
    Ok(GenerateRequest {
        model,
        stream,
        include_usage: include_usage && stream,
        continuous_usage,
        ignore_eos,
        top_k,
        seed,
        forced_tool: None,
        priority,
        images: Vec::new(), // a raw prompt has no image parts
        body: serde_json::to_vec(&v).map_err(|_| ApiError::Internal)?,
    })
}

fn token_ids(v: &Value) -> Result<Value, ApiError> {
    let ids = v
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| ApiError::bad_param("prompt", "A token-ID prompt must be a non-empty list of integers."))?;
    for id in ids {
        if !integer(id).is_some_and(|i| (0..=u32::MAX as i64).contains(&i)) {
            return Err(ApiError::bad_param("prompt", "Token IDs must be non-negative integers."));
        }
    }
    Ok(Value::Array(ids.iter().map(|i| Value::from(integer(i).unwrap_or(0))).collect()))
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
            (json!({"tool_choice": {"type": "any"}}), "tool_choice"), // no tools
            (
                json!({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}}),
                "tool_choice",
            ),
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
    fn completions_prompts_and_refusals() {
        let ok = |b: Value| {
            let r = completions(b.to_string().as_bytes(), &names()).unwrap();
            serde_json::from_slice::<Value>(&r.body).unwrap()
        };
        assert_eq!(ok(json!({"model": "m", "prompt": "hi"}))["prompt"], "hi");
        assert_eq!(ok(json!({"model": "m", "prompt": ["hi"]}))["prompt"], "hi");
        assert_eq!(ok(json!({"model": "m", "prompt": [1, 2.0]}))["prompt"], json!([1, 2]));
        assert_eq!(ok(json!({"model": "m", "prompt": [[5]]}))["prompt"], json!([5]));
        assert_eq!(ok(json!({"model": "m", "prompt": "x"}))["max_tokens"], 16);
        assert_eq!(ok(json!({"model": "m"}))["prompt"], "");
        for (b, field) in [
            (json!({"model": "m", "prompt": 5}), "prompt"),
            (json!({"model": "m", "prompt": ["a", "b"]}), "prompt"),
            (json!({"model": "m", "prompt": [-1]}), "prompt"),
            (json!({"model": "m", "prompt": "x", "n": 2}), "n"),
            (json!({"model": "m", "prompt": "x", "logprobs": 21}), "logprobs"),
            (json!({"model": "m", "prompt": "x", "suffix": 5}), "suffix"),
            (json!({"model": "m", "prompt": "x", "suffix": "y", "echo": true}), "echo"),
            (json!({"model": "m", "prompt": "x", "temperature": 9}), "temperature"),
            (json!({"model": "m", "prompt": "x", "max_tokens": -1}), "max_tokens"),
            // Scoring the prompt at another temperature than the model's while generating: refused.
            (json!({"model": "m", "prompt": "x", "echo": true, "logprobs": 1, "temperature": 0}), "temperature"),
            (json!({"model": "m", "prompt": "x", "prompt_logprobs": 0, "top_k": 5, "max_tokens": 9}), "top_k"),
            (json!({"model": "m", "prompt": "x", "prompt_logprobs": 0, "top_p": 0}), "top_p"),
            (json!({"model": "m", "prompt": "x", "prompt_logprobs": 21}), "prompt_logprobs"),
            (json!({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": true}), "prompt_logprobs"),
        ] {
            assert_eq!(param(completions, b), field);
        }
    }

    #[test]
    fn completions_score_prompts() {
        let ok = |b: Value| {
            let r = completions(b.to_string().as_bytes(), &names()).unwrap();
            (serde_json::from_slice::<Value>(&r.body).unwrap(), r.top_k)
        };
        // lm-eval's request: echo, logprobs, temperature 0 and one token (or none).
        for max_tokens in [0, 1] {
            let b = json!({"model": "m", "prompt": [1, 2], "echo": true, "logprobs": 1, "temperature": 0,
                "max_tokens": max_tokens});
            assert_eq!(ok(b).0["max_tokens"], max_tokens);
        }
        let (body, _) = ok(json!({"model": "m", "prompt": "x", "prompt_logprobs": true}));
        assert_eq!(body["prompt_logprobs"], 0);
        let (body, _) = ok(json!({"model": "m", "prompt": "x", "prompt_logprobs": false}));
        assert!(body.get("prompt_logprobs").is_none());
        let (body, _) = ok(json!({"model": "m", "prompt": "x", "max_tokens": 0}));
        assert_eq!(body["max_tokens"], 0);
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
            (json!({"top_logprobs": 21}), "top_logprobs"),
            (json!({"tools": [{"type": "custom", "name": "sql"}]}), "tools[0].type"),
            (json!({"text": {"format": {"type": "json_schema", "name": "x"}}}), "text.format.schema"),
            (json!({"text": {"format": {"type": "grammar"}}}), "text.format.type"),
            (json!({"input": []}), "input"),
            (json!({"input": [{"type": "web_search_call", "id": "x"}]}), "input[0].type"),
            (
                json!({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output"}]}),
                "input[1].call_id",
            ),
            (json!({"temperature": 3}), "temperature"),
            (json!({"input": [{"id": "msg_1"}]}), "input[0].type"),
            (json!({"tool_choice": "required"}), "tool_choice"), // no tools
            (
                json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}),
                "tool_choice",
            ),
            (json!({"prompt": {"id": "pmpt_1"}}), "prompt"),
            (json!({"tool_choice": {"type": "computer"}}), "tool_choice"),
        ] {
            let mut b = base.clone();
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            assert_eq!(param(responses, b), field);
        }
        let mut b = base.clone();
        b["store"] = json!(false);
        b["top_p"] = json!(0);
        b["max_output_tokens"] = json!(5.0);
        let r = responses(b.to_string().as_bytes(), &names()).unwrap();
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((r.top_k, body.get("top_p"), &body["max_output_tokens"]), (1, None, &json!(5)));
    }
}

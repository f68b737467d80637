//! Types and ranges of the Chat Completions fields, checked before the codec so that every 400 names its field
//! (`param`) in words, never in the JSON parser's ("expected u64"). The table follows OpenAI's published schema
//! (`CreateChatCompletionRequest`); fields the server accepts and ignores are still checked, so "ignored" keeps
//! meaning "well-formed". Integer fields take integral floats (`1.0`, `1e3`), which JSON Schema counts as integers,
//! and are rewritten as integers for the codec.

use crate::error::ApiError;
use serde_json::{Map, Value};

/// What one top-level field must be (null is always allowed: it means "not set").
enum Kind {
    Bool,
    Str,
    /// A string from a fixed list.
    OneOf(&'static [&'static str]),
    /// A number in a range; `open_min` excludes the lower bound.
    Num {
        min: f64,
        max: f64,
        open_min: bool,
    },
    /// Any JSON object (its content is not served, only its shape matters).
    Object,
    /// An object whose values are strings (OpenAI's `metadata`).
    StrMap,
    /// An array of strings.
    StrList,
    /// Token ID → integer bias in [-100, 100] (OpenAI's `logit_bias`).
    LogitBias,
    /// A string, or a list of at most this many strings (`stop`).
    StrOrList(usize),
}

use Kind::*;

/// deepseek-recipe's limit on stop strings.
pub const MAX_STOP: usize = 16;

const FIELDS: &[(&str, Kind)] = &[
    ("temperature", Num { min: 0.0, max: 2.0, open_min: false }),
    ("top_p", Num { min: 0.0, max: 1.0, open_min: false }), // 0 is greedy: request.rs maps it to top_k 1
    ("presence_penalty", Num { min: -2.0, max: 2.0, open_min: false }),
    ("frequency_penalty", Num { min: -2.0, max: 2.0, open_min: false }),
    ("repetition_penalty", Num { min: 0.0, max: f64::MAX, open_min: true }),
    ("min_p", Num { min: 0.0, max: 1.0, open_min: false }),
    ("stop", StrOrList(MAX_STOP)),
    ("logit_bias", LogitBias),
    ("user", Str),
    ("safety_identifier", Str),
    ("prompt_cache_key", Str),
    ("prompt_cache_retention", OneOf(&["in_memory", "24h"])),
    ("metadata", StrMap),
    ("store", Bool),
    ("parallel_tool_calls", Bool),
    ("service_tier", OneOf(&["auto", "default", "flex", "scale", "priority"])),
    ("verbosity", OneOf(&["low", "medium", "high"])),
    ("reasoning_effort", OneOf(&["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"])),
    ("modalities", StrList),
    ("prediction", Object),
    ("thinking", Object),
    ("chat_template_kwargs", Object),
];

/// Fields whose whole feature is not served: refused in words rather than dropped in silence.
const NOT_SERVED: &[(&str, &str)] = &[
    ("audio", "Audio output is not supported."),
    ("web_search_options", "Web search is not supported."),
    ("functions", "The deprecated 'functions' are not supported; send them as 'tools'."),
    ("function_call", "The deprecated 'function_call' is not supported; use 'tool_choice'."),
];

/// Check every field in the tables.
pub fn check(obj: &mut Map<String, Value>) -> Result<(), ApiError> {
    for (name, kind) in FIELDS {
        match obj.get(*name) {
            None | Some(Value::Null) => {}
            Some(v) => check_kind(name, kind, v)?,
        }
    }
    for (name, why) in NOT_SERVED {
        if !matches!(obj.get(*name), None | Some(Value::Null)) {
            return Err(ApiError::bad_param(name, *why));
        }
    }
    if let Some(Value::Array(m)) = obj.get("modalities")
        && m.iter().any(|x| x != "text")
    {
        return Err(ApiError::bad_param("modalities", "Only the \"text\" modality is supported."));
    }
    if let Some(Value::Object(t)) = obj.get("thinking") {
        match t.get("type").and_then(Value::as_str) {
            Some("enabled" | "disabled" | "adaptive") => {}
            _ => {
                return Err(ApiError::bad_param(
                    "thinking.type",
                    "'thinking.type' must be \"enabled\", \"disabled\" or \"adaptive\".",
                ));
            }
        }
    }
    Ok(())
}

/// A tool choice that forces a call, for the codec to constrain: any of the tools (`name` None) or one by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForcedTool {
    pub name: Option<String>,
    /// More than one call in the block (OpenAI's `parallel_tool_calls`, Anthropic's `disable_parallel_tool_use`).
    pub parallel: bool,
}

/// How each door spells its tool choice and its tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolDoor {
    /// `"required"`, `{"type": "function", "function": {"name"}}`; tools `[{"function": {"name"}}]`.
    Chat,
    /// `"required"`, `{"type": "function", "name"}`; tools `[{"type": "function", "name"}]`.
    Responses,
    /// `{"type": "any" | "tool", "name", "disable_parallel_tool_use"}`; tools `[{"name"}]`.
    Messages,
}

/// The door's `tool_choice`: None for auto, none or absent; a forced choice needs tools, and a named one must name
/// one of them (deepseek-recipe's own error would name another field, and Anthropic's any/tool it turns into auto).
pub fn tool_choice(obj: &Map<String, Value>, door: ToolDoor) -> Result<Option<ForcedTool>, ApiError> {
    let bad = |what: String| Err(ApiError::bad_param("tool_choice", format!("Invalid 'tool_choice': {what}")));
    let choice = match obj.get("tool_choice") {
        None | Some(Value::Null) => return Ok(None),
        Some(c) => c,
    };
    let parallel_calls = !matches!(obj.get("parallel_tool_calls"), Some(Value::Bool(false)));
    let name = |v: &Value| v.get("name").and_then(Value::as_str).map(str::to_string);
    let forced = match (door, choice) {
        (ToolDoor::Chat | ToolDoor::Responses, Value::String(c)) => match c.as_str() {
            "auto" | "none" => return Ok(None),
            "required" => ForcedTool { name: None, parallel: parallel_calls },
            other => return bad(format!("expected \"auto\", \"none\", \"required\" or a function, got \"{other}\".")),
        },
        (ToolDoor::Chat, Value::Object(c)) if c.get("type").and_then(Value::as_str) == Some("function") => {
            match c.get("function").and_then(name) {
                Some(n) => ForcedTool { name: Some(n), parallel: parallel_calls },
                None => return bad("a function choice needs 'function.name'.".into()),
            }
        }
        (ToolDoor::Responses, Value::Object(c)) if c.get("type").and_then(Value::as_str) == Some("function") => {
            match name(choice) {
                Some(n) => ForcedTool { name: Some(n), parallel: parallel_calls },
                None => return bad("a function choice needs a 'name'.".into()),
            }
        }
        (ToolDoor::Messages, Value::Object(c)) => {
            let parallel = !matches!(c.get("disable_parallel_tool_use"), Some(Value::Bool(true)));
            match c.get("type").and_then(Value::as_str) {
                Some("auto" | "none") => return Ok(None),
                Some("any") => ForcedTool { name: None, parallel },
                Some("tool") => match name(choice) {
                    Some(n) => ForcedTool { name: Some(n), parallel },
                    None => return bad("a \"tool\" choice needs a 'name'.".into()),
                },
                _ => return bad("expected type \"auto\", \"any\", \"tool\" or \"none\".".into()),
            }
        }
        _ => return bad(format!("unsupported choice {}.", brief(choice))),
    };
    let tools: Vec<String> = match obj.get("tools") {
        Some(Value::Array(tools)) => tools
            .iter()
            .filter_map(|t| match door {
                ToolDoor::Chat => t.get("function").and_then(name),
                ToolDoor::Responses | ToolDoor::Messages => name(t),
            })
            .collect(),
        _ => Vec::new(),
    };
    if tools.is_empty() {
        return bad("forcing a tool call needs 'tools'.".into());
    }
    if let Some(n) = &forced.name
        && !tools.contains(n)
    {
        return bad(format!("no tool named '{n}' is in 'tools'."));
    }
    Ok(Some(forced))
}

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

fn check_kind(name: &str, kind: &Kind, v: &Value) -> Result<(), ApiError> {
    let bad =
        |what: &str| Err(ApiError::bad_param(name, format!("Invalid '{name}': expected {what}, got {}.", brief(v))));
    match kind {
        Bool if !v.is_boolean() => bad("a boolean"),
        Str if !v.is_string() => bad("a string"),
        OneOf(options) => match v.as_str() {
            Some(s) if options.contains(&s) => Ok(()),
            _ => bad(&format!("one of {}", options.join(", "))),
        },
        Num { min, max, open_min } => match v.as_f64() {
            Some(x) if (x > *min || (!open_min && x == *min)) && x <= *max => Ok(()),
            Some(_) => bad(&range(*min, *max, *open_min)),
            None => bad("a number"),
        },
        Object if !v.is_object() => bad("an object"),
        StrMap => match v.as_object() {
            Some(m) if m.values().all(Value::is_string) => Ok(()),
            _ => bad("an object of strings"),
        },
        StrList => match v.as_array() {
            Some(a) if a.iter().all(Value::is_string) => Ok(()),
            _ => bad("an array of strings"),
        },
        LogitBias => match v.as_object() {
            Some(m) => {
                for (token, bias) in m {
                    if token.parse::<u32>().is_err() {
                        return bad("token IDs as keys");
                    }
                    if !integer(bias).is_some_and(|b| (-100..=100).contains(&b)) {
                        return bad("integer biases in [-100, 100]");
                    }
                }
                Ok(())
            }
            None => bad("an object mapping token IDs to biases"),
        },
        StrOrList(most) => match v {
            Value::String(_) => Ok(()),
            Value::Array(a) if a.len() > *most => bad(&format!("at most {most} strings")),
            Value::Array(a) if a.iter().all(Value::is_string) => Ok(()),
            _ => bad("a string or an array of strings"),
        },
        _ => Ok(()),
    }
}

fn range(min: f64, max: f64, open_min: bool) -> String {
    let open = if open_min { "(" } else { "[" };
    if max == f64::MAX { format!("a number > {min}") } else { format!("a number in {open}{min}, {max}]") }
}

/// Most logprob alternatives per token a request may ask for (OpenAI's limit, and deepseek-recipe's).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// An optional count of logprob alternatives (`top_logprobs`, Completions' integer `logprobs`): [0, 20].
pub fn top_logprobs(obj: &Map<String, Value>, key: &str) -> Result<Option<u32>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match integer(v) {
            Some(n) if (0..=MAX_TOP_LOGPROBS).contains(&n) => Ok(Some(n as u32)),
            _ => Err(ApiError::bad_param(
                key,
                format!("Invalid '{key}': expected an integer in [0, {MAX_TOP_LOGPROBS}], got {}.", brief(v)),
            )),
        },
    }
}

/// vLLM's `prompt_logprobs` (Chat and Completions): the prompt tokens' logprobs in the response, normalized to the
/// number of alternatives asked for (`true` is 0: the token's own). Not in a stream, as in vLLM.
pub fn prompt_logprobs(obj: &mut Map<String, Value>, stream: bool) -> Result<Option<u32>, ApiError> {
    let n = match obj.get("prompt_logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(0),
        Some(_) => top_logprobs(obj, "prompt_logprobs")?,
    };
    match n {
        None => {
            obj.remove("prompt_logprobs");
        }
        Some(_) if stream => {
            return Err(ApiError::bad_param(
                "prompt_logprobs",
                "'prompt_logprobs' is not available with \"stream\": true (as in vLLM).",
            ));
        }
        Some(n) => {
            obj.insert("prompt_logprobs".into(), Value::from(n));
        }
    }
    Ok(n)
}

/// A request that asks for its prompt's logprobs gets the model's own distribution (temperature 1, no top-p or
/// top-k), as OpenAI and vLLM report it. DeepInfer computes them with the request's sampling parameters, which
/// also sample its completion: so a request that scores its prompt and generates more than one token must leave
/// them at their defaults. Scoring requests (`max_tokens` 0 or 1, as lm-eval sends them) may set anything; their
/// one token is then sampled at temperature 1.
pub fn check_scoring_sampling(obj: &Map<String, Value>, max_tokens: Option<u64>, top_k: i32) -> Result<(), ApiError> {
    if max_tokens.is_some_and(|n| n <= 1) {
        return Ok(());
    }
    let set = |key: &str| obj.get(key).and_then(Value::as_f64).is_some_and(|v| v != 1.0);
    let field = if set("temperature") {
        "temperature"
    } else if set("top_p") || (top_k == 1 && !obj.contains_key("top_k")) {
        "top_p"
    } else if top_k != -1 {
        "top_k"
    } else {
        return Ok(());
    };
    Err(ApiError::bad_param(
        field,
        format!(
            "The prompt's logprobs are the model's own distribution (temperature 1, no top-p or top-k), and the \
             engine samples the completion with the same parameters: with them, leave '{field}' at its default, \
             or set 'max_tokens' to 0 or 1."
        ),
    ))
}

/// `top_p` 0 keeps only the most likely token; OpenAI allows it and deepseek-recipe wants (0, 1], so it becomes
/// top_k 1. So does a top_p too small for the engine's f32, which would round to 0. True if it was.
pub fn take_greedy_top_p(obj: &mut Map<String, Value>) -> bool {
    let greedy = obj.get("top_p").and_then(Value::as_f64).is_some_and(|p| p < f32::MIN_POSITIVE as f64);
    if greedy {
        obj.remove("top_p");
    }
    greedy
}

/// A short rendering of a client's value for an error message (never the whole of a huge value).
pub fn brief(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() <= 40 { s } else { format!("{}…", s.chars().take(40).collect::<String>()) }
}

/// An integer value: a JSON integer, or a float with no fractional part that fits an i64.
pub fn integer(v: &Value) -> Option<i64> {
    if let Some(i) = v.as_i64() {
        return Some(i);
    }
    let f = v.as_f64()?;
    // 2^63 is exactly representable; every integral float below it (and at or above -2^63) fits an i64.
    (f.fract() == 0.0 && (-9.223_372_036_854_776e18..9.223_372_036_854_776e18).contains(&f)).then_some(f as i64)
}

/// Take `seed` out of the body: any signed 64-bit integer, as OpenAI's schema allows. The engine takes an unsigned
/// 64-bit seed, and a negative one maps as PyTorch's `manual_seed` maps it for vLLM: `0xffff_ffff_ffff_ffff + seed`.
/// deepseek-recipe would refuse seeds past 2^63, so the seed goes to the rank from here, not through the codec.
pub fn take_seed(obj: &mut Map<String, Value>) -> Result<Option<u64>, ApiError> {
    let Some(v) = obj.remove("seed").filter(|v| !v.is_null()) else { return Ok(None) };
    let v = &v;
    match integer(v) {
        Some(s) if s >= 0 => Ok(Some(s as u64)),
        Some(s) => Ok(Some(u64::MAX - s.unsigned_abs())),
        None => Err(ApiError::bad_param(
            "seed",
            format!("Invalid 'seed': expected an integer in [-2^63, 2^63 - 1], got {}.", brief(v)),
        )),
    }
}

/// Take `priority` out of the body (vLLM's extension, on every door): lower values are admitted first from the
/// wait queue. Any 64-bit integer; 0 when absent.
pub fn take_priority(obj: &mut Map<String, Value>) -> Result<i64, ApiError> {
    match obj.remove("priority") {
        None | Some(Value::Null) => Ok(0),
        Some(v) => integer(&v).ok_or_else(|| {
            ApiError::bad_param("priority", format!("Invalid 'priority': expected an integer, got {}.", brief(&v)))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(v: Value) -> Result<Map<String, Value>, ApiError> {
        let mut obj = v.as_object().unwrap().clone();
        check(&mut obj).map(|()| obj)
    }

    fn param(v: Value) -> String {
        let e = run(v.clone()).expect_err(&v.to_string());
        assert_eq!(e.status(), 400);
        let env: Value = serde_json::from_str(&e.envelope()).unwrap();
        let msg = env["error"]["message"].as_str().unwrap().to_string();
        assert!(!msg.contains("u64") && !msg.contains("f32"), "{msg}");
        env["error"]["param"].as_str().unwrap().to_string()
    }

    #[test]
    fn seeds_map_like_pytorch() {
        let seed = |v: Value| {
            let mut obj = json!({"seed": v}).as_object().unwrap().clone();
            let s = take_seed(&mut obj);
            assert!(obj.is_empty(), "seed leaves the body");
            s.map_err(|e| serde_json::from_str::<Value>(&e.envelope()).unwrap()["error"]["param"].clone())
        };
        assert_eq!(seed(json!(-1)), Ok(Some(u64::MAX - 1)));
        assert_eq!(seed(json!(i64::MIN)), Ok(Some(u64::MAX - (1u64 << 63))));
        assert_eq!(seed(json!(1e3)), Ok(Some(1000)));
        assert_eq!(seed(json!(7)), Ok(Some(7)));
        assert_eq!(seed(json!(null)), Ok(None));
        for bad in [json!(1.5), json!(18446744073709551615u64), json!("1")] {
            assert_eq!(seed(bad), Err(json!("seed")));
        }
    }

    #[test]
    fn ranges_and_types_name_the_field() {
        for (body, field) in [
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"temperature": "1"}), "temperature"),
            (json!({"top_p": -0.1}), "top_p"),
            (json!({"presence_penalty": -3}), "presence_penalty"),
            (json!({"frequency_penalty": true}), "frequency_penalty"),
            (json!({"stop": 5}), "stop"),
            (json!({"stop": vec!["a"; MAX_STOP + 1]}), "stop"),
            (json!({"logit_bias": 2.4e135}), "logit_bias"),
            (json!({"logit_bias": {"x": 1}}), "logit_bias"),
            (json!({"logit_bias": {"5": 101}}), "logit_bias"),
            (json!({"user": 5}), "user"),
            (json!({"metadata": {"a": 1}}), "metadata"),
            (json!({"store": "yes"}), "store"),
            (json!({"service_tier": "fast"}), "service_tier"),
            (json!({"reasoning_effort": 5}), "reasoning_effort"),
            (json!({"thinking": {"type": "x"}}), "thinking.type"),
            (json!({"modalities": ["audio"]}), "modalities"),
            (json!({"functions": [{"name": "f"}]}), "functions"),
        ] {
            assert_eq!(param(body), field);
        }
    }

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
        assert_eq!(tool_choice(&with(&chat, json!("auto")), ToolDoor::Chat).unwrap(), None);
        let any = Some(ForcedTool { name: None, parallel: true });
        assert_eq!(tool_choice(&with(&chat, json!("required")), ToolDoor::Chat).unwrap(), any);
        let named = json!({"type": "function", "function": {"name": "f"}});
        let f = Some(ForcedTool { name: Some("f".into()), parallel: true });
        assert_eq!(tool_choice(&with(&chat, named), ToolDoor::Chat).unwrap(), f);
        let unknown = json!({"type": "function", "function": {"name": "zz"}});
        assert_eq!(param(tool_choice(&with(&chat, unknown), ToolDoor::Chat)), "tool_choice");
        assert_eq!(param(tool_choice(&with(&json!({}), json!("required")), ToolDoor::Chat)), "tool_choice");
        assert_eq!(param(tool_choice(&with(&chat, json!("sometimes")), ToolDoor::Chat)), "tool_choice");
        let msgs = json!({"tools": [{"name": "f", "input_schema": {"type": "object"}}]});
        let one = json!({"type": "tool", "name": "f", "disable_parallel_tool_use": true});
        let got = tool_choice(&with(&msgs, one), ToolDoor::Messages).unwrap();
        assert_eq!(got, Some(ForcedTool { name: Some("f".into()), parallel: false }));
        assert_eq!(
            param(tool_choice(&with(&msgs, json!({"type": "tool", "name": "g"})), ToolDoor::Messages)),
            "tool_choice"
        );
        let resp = json!({"tools": [{"type": "function", "name": "f"}], "parallel_tool_calls": false});
        let got = tool_choice(&with(&resp, json!({"type": "function", "name": "f"})), ToolDoor::Responses).unwrap();
        assert_eq!(got, Some(ForcedTool { name: Some("f".into()), parallel: false }));
    }

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
    fn well_formed_values_pass() {
        run(json!({
            "temperature": 0, "top_p": 1.0, "presence_penalty": -2, "stop": ["a"], "logit_bias": {"5": -100.0},
            "user": "u", "metadata": {"k": "v"}, "store": false, "service_tier": "auto", "modalities": ["text"],
            "reasoning_effort": "max", "thinking": {"type": "disabled"}, "seed": null, "audio": null,
        }))
        .unwrap();
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

    #[test]
    fn integral_floats_are_integers() {
        assert_eq!(integer(&json!(1.0)), Some(1));
        assert_eq!(integer(&json!(1e3)), Some(1000));
        assert_eq!(integer(&json!(-0.0)), Some(0));
        assert_eq!(integer(&json!(1.5)), None);
        assert_eq!(integer(&json!(9.3e18)), None);
        assert_eq!(integer(&json!("1")), None);
    }
}

//! The sampling and bookkeeping fields the OpenAI doors share (Chat, Completions, Responses): their types and
//! ranges, checked before the codec so that every 400 names its field (`param`) in words, never in the JSON
//! parser's ("expected u64"). The table follows OpenAI's published schema (`CreateChatCompletionRequest`); fields
//! the server accepts and ignores are still checked, so "ignored" keeps meaning "well-formed".

use super::{brief, integer};
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

use crate::limits::MAX_STOP_SEQUENCES;
use Kind::*;

const FIELDS: &[(&str, Kind)] = &[
    ("temperature", Num { min: 0.0, max: 2.0, open_min: false }),
    ("top_p", Num { min: 0.0, max: 1.0, open_min: false }), // 0 is greedy: `take_greedy_top_p` makes it top_k 1
    ("presence_penalty", Num { min: -2.0, max: 2.0, open_min: false }),
    ("frequency_penalty", Num { min: -2.0, max: 2.0, open_min: false }),
    ("repetition_penalty", Num { min: 0.0, max: f64::MAX, open_min: true }),
    ("min_p", Num { min: 0.0, max: 1.0, open_min: false }),
    ("stop", StrOrList(MAX_STOP_SEQUENCES)),
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

/// Check every field in the tables (Messages, whose fields are Anthropic's, leaves them to deepseek-recipe).
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
    fn ranges_and_types_name_the_field() {
        for (body, field) in [
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"temperature": "1"}), "temperature"),
            (json!({"top_p": -0.1}), "top_p"),
            (json!({"presence_penalty": -3}), "presence_penalty"),
            (json!({"frequency_penalty": true}), "frequency_penalty"),
            (json!({"stop": 5}), "stop"),
            (json!({"stop": vec!["a"; MAX_STOP_SEQUENCES + 1]}), "stop"),
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
    fn well_formed_values_pass() {
        run(json!({
            "temperature": 0, "top_p": 1.0, "presence_penalty": -2, "stop": ["a"], "logit_bias": {"5": -100.0},
            "user": "u", "metadata": {"k": "v"}, "store": false, "service_tier": "auto", "modalities": ["text"],
            "reasoning_effort": "max", "thinking": {"type": "disabled"}, "seed": null, "audio": null,
        }))
        .unwrap();
    }
}

//! One `/generate` sequence's checks (after `batch::split`): its `sampling_params` and the top-level fields, as
//! SGLang's `GenerateReqInput` and `SamplingParams` name them. What the engine can honour is checked and
//! normalized for the codec; a field it cannot honour (min-p, penalties, LoRA, images, hidden states, ...) is a
//! 400 naming it, never silently ignored: a rollout that asked for it would otherwise be off-policy.

use super::super::fields::{MAX_TOP_LOGPROBS, brief, integer};
use crate::error::ApiError;
use crate::limits::{MAX_OUTPUT_TOKENS, MAX_STOP_SEQUENCES};
use serde_json::{Map, Value};

/// What the front end takes from a sequence's sampling parameters.
pub struct Sampling {
    pub top_k: i32,
    pub seed: Option<u64>,
    pub ignore_eos: bool,
}

/// SGLang's default `max_new_tokens`.
const DEFAULT_NEW_TOKENS: u64 = 128;

/// Sampling parameters the engine has no control for, accepted at their defaults only.
const AT_DEFAULT: [(&str, f64); 5] = [
    ("min_p", 0.0),
    ("frequency_penalty", 0.0),
    ("presence_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("min_new_tokens", 0.0),
];

/// Top-level fields that change nothing here: routing hints and bookkeeping (a gateway's, a client's logging).
const IGNORED: [&str; 8] = [
    "log_metrics",
    "routed_dp_rank",
    "data_parallel_rank",
    "custom_labels",
    "no_logs",
    "conversation_id",
    "routing_key",
    "model",
];

/// Top-level fields the server serves (beside `text`/`input_ids` and `sampling_params`).
const SERVED: [&str; 10] = [
    "rid",
    "index",
    "stream",
    "priority",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "return_prompt_token_ids",
    "received_time",
];

/// Check one sequence's body in place: refuse what the engine cannot do, normalize what the codec reads.
pub fn check(obj: &mut Map<String, Value>) -> Result<Sampling, ApiError> {
    for (key, value) in obj.iter() {
        let known = matches!(key.as_str(), "text" | "input_ids" | "sampling_params" | "weight_version");
        if known || SERVED.contains(&key.as_str()) || IGNORED.contains(&key.as_str()) || !set(value) {
            continue;
        }
        return Err(ApiError::bad_param(key, format!("'{key}' is not supported by this server.")));
    }
    for key in ["return_logprob", "return_text_in_logprobs", "return_prompt_token_ids"] {
        boolean(obj, key, key)?;
    }
    let top = count(obj, "top_logprobs_num", "top_logprobs_num", 0, MAX_TOP_LOGPROBS)?.unwrap_or(0);
    obj.insert("top_logprobs_num".into(), Value::from(top));
    let start = match obj.get("logprob_start_len") {
        None | Some(Value::Null) => -1,
        Some(v) => integer(v).filter(|&s| s >= -1).ok_or_else(|| {
            ApiError::bad_param(
                "logprob_start_len",
                format!("'logprob_start_len' must be -1 or more, got {}.", brief(v)),
            )
        })?,
    };
    obj.insert("logprob_start_len".into(), Value::from(start));
    let prompt_logprobs = obj.get("return_logprob") == Some(&Value::Bool(true)) && start >= 0;
    let Some(Value::Object(sp)) = obj.get_mut("sampling_params") else { return Err(ApiError::Internal) };
    let sampling = check_sampling(sp)?;
    if prompt_logprobs {
        scoring(sp, sampling.top_k)?;
    }
    Ok(sampling)
}

/// The prompt's logprobs (`logprob_start_len` >= 0) are the model's own distribution, which the engine computes
/// with the sampling parameters that also sample the output (README, "Prompt logprobs"): with them, more than one
/// new token must be sampled at the defaults.
fn scoring(sp: &Map<String, Value>, top_k: i32) -> Result<(), ApiError> {
    if sp.get("max_new_tokens").and_then(Value::as_u64).is_some_and(|n| n <= 1) {
        return Ok(());
    }
    let off = |key: &str| sp.get(key).and_then(Value::as_f64).is_some_and(|v| v != 1.0);
    let field = match () {
        _ if off("temperature") || (top_k == 1 && !sp.contains_key("top_k")) => "temperature",
        _ if off("top_p") => "top_p",
        _ if top_k != -1 => "top_k",
        _ => return Ok(()),
    };
    Err(ApiError::bad_param(
        &format!("sampling_params.{field}"),
        format!(
            "The prompt's logprobs (logprob_start_len >= 0) are the model's own distribution, and the engine samples \
             the output with the same parameters: with them, leave '{field}' at its default, or set \
             'max_new_tokens' to 0 or 1."
        ),
    ))
}

fn check_sampling(sp: &mut Map<String, Value>) -> Result<Sampling, ApiError> {
    const KNOWN: [&str; 13] = [
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "json_schema",
        "regex",
        "sampling_seed",
    ];
    for (key, value) in sp.iter() {
        let param = format!("sampling_params.{key}");
        if let Some((_, default)) = AT_DEFAULT.iter().find(|(k, _)| k == key) {
            if value.is_null() || value.as_f64() == Some(*default) {
                continue;
            }
            return Err(ApiError::bad_param(
                &param,
                format!("'{key}' is not supported by the engine (only {default})."),
            ));
        }
        if !KNOWN.contains(&key.as_str()) && set(value) {
            return Err(ApiError::bad_param(&param, format!("'{key}' is not supported by this server.")));
        }
    }
    let max_new = count(sp, "max_new_tokens", "sampling_params.max_new_tokens", 0, MAX_OUTPUT_TOKENS as i64)?;
    sp.insert("max_new_tokens".into(), Value::from(max_new.unwrap_or(DEFAULT_NEW_TOKENS as i64)));
    let temperature = number(sp, "temperature", 0.0, 2.0)?;
    let top_p = number(sp, "top_p", 0.0, 1.0)?;
    let mut top_k = match sp.get("top_k") {
        None | Some(Value::Null) => -1,
        Some(v) => match integer(v) {
            Some(k) if k == -1 || (1..=i32::MAX as i64).contains(&k) => k as i32,
            _ => {
                return Err(ApiError::bad_param(
                    "sampling_params.top_k",
                    format!("'top_k' must be -1 (off) or a positive integer, got {}.", brief(v)),
                ));
            }
        },
    };
    // Greedy, as SGLang makes temperature 0 and a top_p too small for the engine: the most likely token.
    if temperature == Some(0.0) || top_p.is_some_and(|p| p < f32::MIN_POSITIVE as f64) {
        top_k = 1;
        sp.remove("top_p");
    }
    for key in ["ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"] {
        boolean(sp, key, &format!("sampling_params.{key}"))?;
    }
    if sp.get("spaces_between_special_tokens") == Some(&Value::Bool(false)) {
        return Err(ApiError::bad_param(
            "sampling_params.spaces_between_special_tokens",
            "'spaces_between_special_tokens': false is not supported (DeepSeek's tokenizer puts no spaces there).",
        ));
    }
    let stop = stops(sp.get("stop"))?;
    sp.insert("stop".into(), Value::from(stop));
    let ids = stop_token_ids(sp.get("stop_token_ids"))?;
    sp.insert("stop_token_ids".into(), Value::from(ids));
    grammar(sp)?;
    let seed = match sp.get("sampling_seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(integer(v).filter(|&s| s >= 0).ok_or_else(|| {
            ApiError::bad_param("sampling_params.sampling_seed", "'sampling_seed' must be a non-negative integer.")
        })? as u64),
    };
    let ignore_eos = sp.get("ignore_eos") == Some(&Value::Bool(true));
    Ok(Sampling { top_k, seed, ignore_eos })
}

/// Whether a value asks for something: not null, false, 0, "" or empty.
fn set(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

fn boolean(obj: &Map<String, Value>, key: &str, param: &str) -> Result<(), ApiError> {
    match obj.get(key) {
        None | Some(Value::Null | Value::Bool(_)) => Ok(()),
        Some(v) => Err(ApiError::bad_param(param, format!("'{key}' must be a boolean, got {}.", brief(v)))),
    }
}

/// An optional integer in [least, most], rewritten as an integer.
fn count(obj: &mut Map<String, Value>, key: &str, param: &str, least: i64, most: i64) -> Result<Option<i64>, ApiError> {
    let n = match obj.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => integer(v).filter(|n| (least..=most).contains(n)).ok_or_else(|| {
            ApiError::bad_param(param, format!("'{key}' must be an integer in [{least}, {most}], got {}.", brief(v)))
        })?,
    };
    obj.insert(key.into(), Value::from(n));
    Ok(Some(n))
}

/// An optional number in [least, most].
fn number(sp: &Map<String, Value>, key: &str, least: f64, most: f64) -> Result<Option<f64>, ApiError> {
    match sp.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (least..=most).contains(&x) => Ok(Some(x)),
            _ => Err(ApiError::bad_param(
                &format!("sampling_params.{key}"),
                format!("'{key}' must be a number in [{least}, {most}], got {}.", brief(v)),
            )),
        },
    }
}

/// `stop`: a string or a list of them, as a list.
fn stops(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    const PARAM: &str = "sampling_params.stop";
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::bad_param(PARAM, "'stop' must be a string or a list of strings."))?,
        Some(_) => return Err(ApiError::bad_param(PARAM, "'stop' must be a string or a list of strings.")),
    };
    if list.len() > MAX_STOP_SEQUENCES || list.iter().any(String::is_empty) {
        return Err(ApiError::bad_param(
            PARAM,
            format!("'stop' takes at most {MAX_STOP_SEQUENCES} strings, none of them empty."),
        ));
    }
    Ok(list)
}

/// `stop_token_ids`: token IDs that end the output, as many as stop strings may be.
fn stop_token_ids(v: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    const PARAM: &str = "sampling_params.stop_token_ids";
    let refuse = || {
        ApiError::bad_param(
            PARAM,
            format!("'stop_token_ids' must be a list of at most {MAX_STOP_SEQUENCES} token IDs."),
        )
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) if a.len() <= MAX_STOP_SEQUENCES => a
            .iter()
            .map(|i| integer(i).filter(|i| (0..=u32::MAX as i64).contains(i)).map(|i| i as u32))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(refuse),
        Some(_) => Err(refuse()),
    }
}

/// `json_schema` (a JSON string, as SGLang takes it, or the schema itself) or `regex`: at most one; the schema
/// normalized to its JSON text.
fn grammar(sp: &mut Map<String, Value>) -> Result<(), ApiError> {
    let schema = match sp.get("json_schema") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(serde_json::from_str::<Value>(s).map_err(|e| {
            ApiError::bad_param("sampling_params.json_schema", format!("'json_schema' is not valid JSON: {e}"))
        })?),
        Some(v @ Value::Object(_)) => Some(v.clone()),
        Some(_) => {
            return Err(ApiError::bad_param("sampling_params.json_schema", "'json_schema' must be a JSON string."));
        }
    };
    let regex = match sp.get("regex") {
        None | Some(Value::Null) => false,
        Some(Value::String(_)) => true,
        Some(_) => return Err(ApiError::bad_param("sampling_params.regex", "'regex' must be a string.")),
    };
    if schema.is_some() && regex {
        return Err(ApiError::bad_param("sampling_params.regex", "Only one of 'json_schema' and 'regex' may be set."));
    }
    match schema {
        Some(s) if s.is_object() || s.is_boolean() => {
            sp.insert("json_schema".into(), Value::String(s.to_string()));
        }
        Some(_) => return Err(ApiError::bad_param("sampling_params.json_schema", "'json_schema' must be an object.")),
        None => {
            sp.remove("json_schema");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(mut body: Value) -> String {
        let e = check(body.as_object_mut().unwrap()).err().unwrap();
        let env: Value = serde_json::from_str(&e.envelope()).unwrap();
        env["error"]["param"].as_str().unwrap_or("").to_string()
    }

    #[test]
    fn defaults_and_greedy() {
        let mut b = json!({"text": "x", "sampling_params": {"temperature": 0, "top_p": 0.5, "stop": "a"}});
        let s = check(b.as_object_mut().unwrap()).unwrap();
        assert_eq!(s.top_k, 1);
        assert_eq!(b["sampling_params"]["max_new_tokens"], 128);
        assert_eq!(b["sampling_params"]["stop"], json!(["a"]));
        assert_eq!(b["logprob_start_len"], -1);
        let mut b = json!({"text": "x", "sampling_params": {"json_schema": {"type": "object"}, "min_p": 0.0}});
        check(b.as_object_mut().unwrap()).unwrap();
        assert_eq!(b["sampling_params"]["json_schema"], r#"{"type":"object"}"#);
    }

    #[test]
    fn what_the_engine_cannot_honour_is_refused_by_name() {
        for (body, field) in [
            (json!({"text": "x", "sampling_params": {"min_p": 0.1}}), "sampling_params.min_p"),
            (json!({"text": "x", "sampling_params": {"frequency_penalty": 1}}), "sampling_params.frequency_penalty"),
            (json!({"text": "x", "sampling_params": {"ebnf": "root ::= \"a\""}}), "sampling_params.ebnf"),
            (json!({"text": "x", "sampling_params": {"top_k": 0}}), "sampling_params.top_k"),
            (json!({"text": "x", "sampling_params": {"temperature": -1}}), "sampling_params.temperature"),
            (json!({"text": "x", "sampling_params": {"max_new_tokens": -1}}), "sampling_params.max_new_tokens"),
            (json!({"text": "x", "sampling_params": {"stop": [""]}}), "sampling_params.stop"),
            (json!({"text": "x", "sampling_params": {"stop_token_ids": [-3]}}), "sampling_params.stop_token_ids"),
            (
                json!({"text": "x", "sampling_params": {"json_schema": "{", "regex": "a"}}),
                "sampling_params.json_schema",
            ),
            (json!({"text": "x", "sampling_params": {"json_schema": "{}", "regex": "a"}}), "sampling_params.regex"),
            (json!({"text": "x", "sampling_params": {}, "lora_path": "a"}), "lora_path"),
            (json!({"text": "x", "sampling_params": {}, "image_data": ["u"]}), "image_data"),
            (json!({"text": "x", "sampling_params": {}, "top_logprobs_num": 21}), "top_logprobs_num"),
            (json!({"text": "x", "sampling_params": {}, "logprob_start_len": -2}), "logprob_start_len"),
            (json!({"text": "x", "sampling_params": {}, "return_logprob": "yes"}), "return_logprob"),
            (
                json!({"text": "x", "sampling_params": {"temperature": 0.5}, "return_logprob": true,
                    "logprob_start_len": 0}),
                "sampling_params.temperature",
            ),
        ] {
            assert_eq!(param(body.clone()), field, "{body}");
        }
        // Off is no request: accepted.
        let mut b = json!({"text": "x", "sampling_params": {"ebnf": null}, "return_hidden_states": false});
        assert!(check(b.as_object_mut().unwrap()).is_ok());
    }
}

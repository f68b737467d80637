//! Field helpers every door shares: the body's JSON and its model, integers as JSON Schema counts them, booleans, token
//! limits, seeds, priorities, logprob counts and the sampling a prompt-scoring request may set; the table of the
//! OpenAI doors' sampling and bookkeeping fields is `table`. Each refusal names its field (`param`). Integer fields
//! take integral floats (`1.0`, `1e3`), which JSON Schema counts as integers, and are rewritten as integers for
//! the codec.

mod table;

use crate::error::ApiError;
use crate::limits::MAX_OUTPUT_TOKENS;
pub use crate::limits::MAX_TOP_LOGPROBS;
use serde_json::{Map, Value};

pub use table::check;

/// The body as JSON: what a door's parse starts from (a batch line comes parsed already).
pub fn json_body(raw: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(raw).map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))
}

/// A body's `model`, which must be a served name, once the body is a JSON object: what every door checks first.
pub fn model_of(v: &Value, served: &[String]) -> Result<String, ApiError> {
    let obj = v.as_object().ok_or_else(|| ApiError::bad_request("The request body must be a JSON object."))?;
    let model = match obj.get("model") {
        Some(Value::String(m)) => m.clone(),
        None | Some(Value::Null) => {
            return Err(ApiError::bad_param("model", "'model' is required."));
        }
        Some(_) => return Err(ApiError::bad_param("model", "'model' must be a string.")),
    };
    if !served.contains(&model) {
        return Err(ApiError::ModelNotFound(model));
    }
    Ok(model)
}

/// An optional boolean (absent or null: false), refused in words naming `param`.
pub fn opt_bool(obj: &Map<String, Value>, key: &str, param: &str) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_param(param, format!("'{param}' must be a boolean"))),
    }
}

/// vLLM's token-ID switches (Chat and Completions): `return_token_ids` and `return_tokens_as_token_ids`, each a
/// boolean; the codec reads them from the body.
pub fn token_id_switches(obj: &Map<String, Value>) -> Result<(), ApiError> {
    for key in ["return_token_ids", "return_tokens_as_token_ids"] {
        opt_bool(obj, key, key)?;
    }
    Ok(())
}

/// An optional token count (`max_tokens` and its kin): an integer in [1, `MAX_OUTPUT_TOKENS`].
pub fn opt_u64(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match integer(v) {
            Some(n) if (1..=MAX_OUTPUT_TOKENS as i64).contains(&n) => Ok(Some(n as u64)),
            _ => Err(ApiError::bad_param(
                key,
                format!("Invalid '{key}': expected an integer in [1, {MAX_OUTPUT_TOKENS}], got {}.", brief(v)),
            )),
        },
    }
}

/// Whether `key` is set to something other than null.
pub fn set(obj: &Map<String, Value>, key: &str) -> bool {
    !matches!(obj.get(key), None | Some(Value::Null))
}

/// Integer fields as integers: JSON Schema counts `1.0` as one, deepseek-recipe would not.
pub fn integers(obj: &mut Map<String, Value>, keys: &[&str]) {
    for key in keys {
        if let Some(i) = obj.get(*key).filter(|v| v.is_f64()).and_then(integer) {
            obj.insert((*key).into(), Value::from(i));
        }
    }
}

/// The elements of the array `v[key]`, numbered; none when it is not an array.
pub fn items<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = (usize, &'a Value)> {
    v.get(key).and_then(Value::as_array).into_iter().flatten().enumerate()
}

/// `v["type"]`, a string, or "".
pub fn kind(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("")
}

/// The `thinking` switch Chat and Messages share, set to a pinned mode: off is `disabled`; on keeps the body's own
/// enabled or adaptive setting, else `enabled`.
pub fn pin_thinking(obj: &mut Map<String, Value>, on: bool) {
    let thinking = if on {
        match obj.get("thinking") {
            Some(t) if t.get("type").and_then(Value::as_str).is_some_and(|k| k != "disabled") => t.clone(),
            _ => serde_json::json!({"type": "enabled"}),
        }
    } else {
        serde_json::json!({"type": "disabled"})
    };
    obj.insert("thinking".into(), thinking);
}

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
    fn integral_floats_are_integers() {
        assert_eq!(integer(&json!(1.0)), Some(1));
        assert_eq!(integer(&json!(1e3)), Some(1000));
        assert_eq!(integer(&json!(-0.0)), Some(0));
        assert_eq!(integer(&json!(1.5)), None);
        assert_eq!(integer(&json!(9.3e18)), None);
        assert_eq!(integer(&json!("1")), None);
    }
}

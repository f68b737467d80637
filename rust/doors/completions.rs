//! OpenAI (legacy) Completions, `POST /v1/completions`: a raw prompt (a string, a list of one, or token IDs),
//! optionally with a `suffix` for fill-in-the-middle. The codec encodes it as plain text; the checks here are the
//! request's shape. No images, no tools, no thinking switch.

use super::fields::{self, integer, model_of, opt_bool, opt_u64};
use super::{Body, GenerateRequest, PinThinking, Served, Spec, Split, sse};
use crate::error::ApiError;
use crate::media::ImageRef;
use bytes::BytesMut;
use serde_json::Value;

pub struct Completions;

impl Spec for Completions {
    const PATH: &'static str = "/v1/completions";
    const NAME: &'static str = "completions";
    const CODE: u8 = 1;
    const ID_PREFIX: &'static str = "cmpl-";
    const DONE: &'static [u8] = sse::DONE;
    const KEEP_ALIVE: &'static [u8] = sse::KEEP_ALIVE;
    /// A raw prompt has no thinking switch.
    const PIN_THINKING: Option<PinThinking> = None;
    const FANS_OUT: bool = true;

    fn split(body: Value, request_id: &str, raw_len: usize, bounds: (usize, usize)) -> Result<Split, ApiError> {
        super::choices::split(body, request_id, raw_len, bounds)
    }

    fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
        parse(body, served)
    }

    /// A raw prompt has no image parts.
    fn image_refs(_body: &Value) -> Vec<ImageRef> {
        Vec::new()
    }

    fn envelope(err: &ApiError) -> String {
        err.envelope()
    }

    fn error_tail(err: &ApiError, buf: &mut BytesMut) {
        sse::openai_error_tail(err, buf);
    }
}

fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
    let mut v = body.json; // a raw prompt has no image parts
    let model = model_of(&v, served.names)?;
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
    // One completion per request: n > 1 is split into n requests before this (`super::choices`), except where
    // nothing splits it (a batch line); best_of 0 (which the schema allows) asks for no more than one.
    for (key, least) in [("n", 1), ("best_of", 0)] {
        if obj.get(key).filter(|n| !n.is_null()).is_some_and(|n| !integer(n).is_some_and(|n| (least..=1).contains(&n)))
        {
            return Err(ApiError::bad_param(key, format!("Only {key} = 1 is supported here.")));
        }
    }
    if let Some(n) = fields::top_logprobs(obj, "logprobs")? {
        obj.insert("logprobs".into(), Value::from(n));
    }
    fields::token_id_switches(obj)?;
    // 0 is OpenAI's scoring idiom (with `echo` and `logprobs`): the prompt alone, nothing generated.
    let max_tokens = match obj.get("max_tokens").map(integer) {
        Some(Some(0)) => Some(0),
        _ => opt_u64(obj, "max_tokens")?,
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
        keeping: None,
        owner: Default::default(),
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

    fn param(body: Value) -> String {
        let e = Completions::parse(Body::read(body.to_string().as_bytes()).unwrap(), names().as_slice().into())
            .unwrap_err();
        let env: Value = serde_json::from_str(&e.envelope()).unwrap();
        env["error"]["param"].as_str().unwrap_or("").to_string()
    }

    #[test]
    fn completions_prompts_and_refusals() {
        let ok = |b: Value| {
            let r =
                Completions::parse(Body::read(b.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap();
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
            (json!({"model": "m", "prompt": "x", "return_token_ids": "true"}), "return_token_ids"),
            (json!({"model": "m", "prompt": "x", "return_tokens_as_token_ids": 0}), "return_tokens_as_token_ids"),
            // Scoring the prompt at another temperature than the model's while generating: refused.
            (json!({"model": "m", "prompt": "x", "echo": true, "logprobs": 1, "temperature": 0}), "temperature"),
            (json!({"model": "m", "prompt": "x", "prompt_logprobs": 0, "top_k": 5, "max_tokens": 9}), "top_k"),
            (json!({"model": "m", "prompt": "x", "prompt_logprobs": 0, "top_p": 0}), "top_p"),
            (json!({"model": "m", "prompt": "x", "prompt_logprobs": 21}), "prompt_logprobs"),
            (json!({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": true}), "prompt_logprobs"),
        ] {
            assert_eq!(param(b), field);
        }
    }

    #[test]
    fn completions_score_prompts() {
        let ok = |b: Value| {
            let r =
                Completions::parse(Body::read(b.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap();
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
}

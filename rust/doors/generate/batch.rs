//! `/generate`'s batches: one body holds one prompt or a list of them, and `sampling_params.n` samples each. The
//! body is split into one request per sequence, each its own call down the request path with its own slot, in
//! SGLang's order (`GenerateReqInput`'s normalization and `TokenizerManager`'s batch handling): prompt by prompt,
//! each prompt's n samples together, so prompt i's sample j is answer `i * n + j`.

use super::super::fields::{brief, integer};
use crate::error::ApiError;
use serde_json::{Map, Value};

/// The fields that may hold one value per prompt in a batch (SGLang refuses a list of them with n > 1).
const PER_PROMPT: [&str; 3] = ["return_logprob", "logprob_start_len", "top_logprobs_num"];

/// A body split into its sequences.
pub struct Split {
    /// One body per sequence, each a single request (`text` a string or `input_ids` a list of integers, and
    /// `sampling_params` an object), with its `rid` and, in a batch, its `index`.
    pub bodies: Vec<Value>,
    /// Each sequence's id on the request path (`path::Call::request_id`): its `rid`.
    pub rids: Vec<String>,
    /// One prompt without a list and n = 1: the answer is one object, not a list.
    pub single: bool,
    pub stream: bool,
    /// The sequences are the choices of one OpenAI response (`n`, `super::choices`): their answers make one
    /// response, choice i from sequence i; else `/generate`'s list.
    pub choices: bool,
}

/// Split a `/generate` body. `request_id`: the HTTP request's id, the rid of a body that names none;
/// `bounds`: most sequences one body may ask for, and most bytes they may hold together (`--max-generate-fanout`,
/// `--max-generate-fanout-bytes`), both checked before any sequence is built.
pub fn split(body: Value, request_id: &str, bounds: (usize, usize)) -> Result<Split, ApiError> {
    let Value::Object(mut obj) = body else {
        return Err(ApiError::bad_request("The request body must be a JSON object."));
    };
    let (key, prompts, batched) = prompts(&mut obj)?;
    let k = prompts.len();
    let sp = obj.remove("sampling_params");
    let n = samples(&sp)?;
    bounded(&obj, (key, &prompts), &sp, n, bounds)?;
    let params = sampling_lists(sp, k, batched)?;
    let fanout = k * n; // bounded above
    let rids = prompt_rids(obj.remove("rid"), request_id, k, batched)?;
    let per_prompt: Vec<(&str, Option<Vec<Value>>)> =
        PER_PROMPT.iter().map(|&f| Ok((f, listed(&mut obj, f, k, batched, n)?))).collect::<Result<_, ApiError>>()?;
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(ApiError::bad_param("stream", format!("'stream' must be a boolean, got {}.", brief(v)))),
    };
    let single = !batched && n == 1;
    let (mut bodies, mut seq_rids) = (Vec::with_capacity(fanout), Vec::with_capacity(fanout));
    for (i, (prompt, mut sp)) in prompts.into_iter().zip(params).enumerate() {
        sp.remove("n");
        for j in 0..n {
            let mut one = obj.clone();
            one.insert(key.into(), prompt.clone());
            one.insert("sampling_params".into(), Value::Object(sp.clone()));
            for (field, values) in &per_prompt {
                if let Some(values) = values {
                    one.insert((*field).into(), values[i].clone());
                }
            }
            // Each sequence is its own request: one sample of n gets its own id, the prompt's with its number.
            let rid = if n == 1 { rids[i].clone() } else { format!("{}_{j}", rids[i]) };
            one.insert("rid".into(), Value::String(rid.clone()));
            if !single {
                one.insert("index".into(), Value::from(i * n + j));
            } else {
                one.remove("index");
            }
            bodies.push(Value::Object(one));
            seq_rids.push(rid);
        }
    }
    Ok(Split { bodies, rids: seq_rids, single, stream, choices: false })
}

/// The prompts, as `text` or `input_ids` (one of them), and whether the body gave a list of them.
fn prompts(obj: &mut Map<String, Value>) -> Result<(&'static str, Vec<Value>, bool), ApiError> {
    let present = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
    let (text, ids) = (present(obj.get("text")), present(obj.get("input_ids")));
    if text == ids {
        return Err(ApiError::bad_param("text", "Either 'text' or 'input_ids' should be provided (one of them)."));
    }
    let key = if text { "text" } else { "input_ids" };
    let value = obj.remove(key).unwrap_or(Value::Null);
    let flat_ids = |v: &Value| v.as_array().is_some_and(|a| a.first().is_some_and(|x| !x.is_array()));
    match (key, value) {
        ("text", s @ Value::String(_)) => Ok((key, vec![s], false)),
        ("text", Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => Ok((key, a, true)),
        ("input_ids", v) if flat_ids(&v) => Ok((key, vec![token_ids(&v, key)?], false)),
        ("input_ids", Value::Array(a)) if !a.is_empty() => {
            let ids = a.iter().enumerate().map(|(i, p)| token_ids(p, &format!("input_ids[{i}]")));
            Ok((key, ids.collect::<Result<_, _>>()?, true))
        }
        ("text", _) => {
            Err(ApiError::bad_param("text", "'text' must be a string or a non-empty list of strings (a batch)."))
        }
        _ => Err(ApiError::bad_param(
            "input_ids",
            "'input_ids' must be a non-empty list of token IDs, or a non-empty list of such lists (a batch).",
        )),
    }
}

/// A non-empty list of token IDs, as integers.
fn token_ids(v: &Value, param: &str) -> Result<Value, ApiError> {
    let ids = v
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| ApiError::bad_param(param, format!("'{param}' must be a non-empty list of token IDs.")))?;
    let out = ids.iter().map(|i| integer(i).filter(|i| (0..=u32::MAX as i64).contains(i)).map(Value::from));
    let out: Option<Vec<Value>> = out.collect();
    out.map(Value::Array)
        .ok_or_else(|| ApiError::bad_param(param, format!("'{param}' must hold non-negative integer token IDs.")))
}

/// One `sampling_params` object per prompt: the body's object for each, or its list (one per prompt).
fn sampling_lists(sp: Option<Value>, k: usize, batched: bool) -> Result<Vec<Map<String, Value>>, ApiError> {
    const PARAM: &str = "sampling_params";
    match sp {
        None | Some(Value::Null) => Ok(vec![Map::new(); k]),
        Some(Value::Object(o)) => Ok(vec![o; k]),
        Some(Value::Array(a)) if batched && a.len() == k && a.iter().all(Value::is_object) => {
            Ok(a.into_iter().filter_map(|v| if let Value::Object(o) = v { Some(o) } else { None }).collect())
        }
        Some(Value::Array(_)) if batched => Err(ApiError::bad_param(
            PARAM,
            format!("A list of 'sampling_params' must hold one object per prompt ({k})."),
        )),
        Some(_) => Err(ApiError::bad_param(PARAM, "'sampling_params' must be an object.")),
    }
}

/// `n`, the same for every prompt (SGLang's rule): samples of each.
fn samples(sp: &Option<Value>) -> Result<usize, ApiError> {
    let n_of = |sp: &Value| match sp.get("n") {
        None | Some(Value::Null) => Ok(1),
        Some(v) => integer(v).filter(|&n| n >= 1).map(|n| n as usize).ok_or_else(|| {
            ApiError::bad_param("sampling_params.n", format!("'n' must be a positive integer, got {}.", brief(v)))
        }),
    };
    let list = match sp {
        Some(Value::Array(a)) => a.as_slice(),
        Some(one) => std::slice::from_ref(one),
        None => return Ok(1),
    };
    let n = list.first().map_or(Ok(1), n_of)?;
    for one in list.iter().skip(1) {
        if n_of(one)? != n {
            return Err(ApiError::bad_param("sampling_params.n", "'n' must be the same for every prompt of a batch."));
        }
    }
    Ok(n)
}

/// The fan-out's bounds: its sequences, and the bytes they hold together (each sequence's prompt, sampling
/// parameters and the rest of the body, once per sequence), decided before any of them is built.
fn bounded(
    rest: &Map<String, Value>,
    (key, prompts): (&str, &[Value]),
    sp: &Option<Value>,
    n: usize,
    (max_fanout, max_bytes): (usize, usize),
) -> Result<(), ApiError> {
    let k = prompts.len();
    let fanout = k.saturating_mul(n);
    if fanout > max_fanout {
        return Err(ApiError::bad_param(
            "sampling_params.n",
            format!(
                "This request asks for {fanout} sequences ({k} prompts x n = {n}); the most one request may ask for \
                 is {max_fanout} (--max-generate-fanout)."
            ),
        ));
    }
    let params = match sp {
        Some(Value::Array(a)) => a.iter().map(json_len).sum(),
        Some(one) => json_len(one).saturating_mul(k),
        None => 0,
    };
    let prompts: usize = prompts.iter().map(json_len).sum();
    let rest = json_len(&Value::Object(rest.clone()));
    let bytes = rest.saturating_mul(k).saturating_add(params).saturating_add(prompts).saturating_mul(n);
    if bytes > max_bytes {
        return Err(ApiError::bad_param(
            key,
            format!(
                "This request's {fanout} sequences would hold {bytes} bytes together (each prompt and its sampling \
                 parameters once per sample); the most is {max_bytes} (--max-generate-fanout-bytes)."
            ),
        ));
    }
    Ok(())
}

/// A value's length as JSON, counted without building the text.
fn json_len(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = serde_json::to_writer(&mut count, v);
    count.0
}

/// Each prompt's rid: the body's (a string, or in a batch a list of one per prompt, or a string that becomes
/// `rid_i`, as SGLang names them), or the HTTP request's id in its place.
fn prompt_rids(rid: Option<Value>, request_id: &str, k: usize, batched: bool) -> Result<Vec<String>, ApiError> {
    let base = match rid {
        None | Some(Value::Null) => request_id.to_string(),
        Some(Value::String(s)) => checked_rid(s, "rid")?,
        Some(Value::Array(a)) if batched && a.len() == k => {
            let rids: Vec<String> = a
                .into_iter()
                .enumerate()
                .map(|(i, r)| match r {
                    Value::String(s) => checked_rid(s, &format!("rid[{i}]")),
                    _ => Err(ApiError::bad_param(&format!("rid[{i}]"), "Each 'rid' must be a string.")),
                })
                .collect::<Result<_, _>>()?;
            let mut seen = std::collections::HashSet::new();
            if let Some(dup) = rids.iter().find(|r| !seen.insert(r.as_str())) {
                return Err(ApiError::bad_param("rid", format!("Duplicate request IDs in the request: '{dup}'.")));
            }
            return Ok(rids);
        }
        Some(Value::Array(_)) if batched => {
            return Err(ApiError::bad_param("rid", format!("A list of 'rid' must hold one string per prompt ({k}).")));
        }
        Some(_) => return Err(ApiError::bad_param("rid", "'rid' must be a string.")),
    };
    Ok(if batched { (0..k).map(|i| format!("{base}_{i}")).collect() } else { vec![base] })
}

/// A client's request id: what the server's logs and `/abort_request` take, printable ASCII (as `X-Request-Id`).
fn checked_rid(s: String, param: &str) -> Result<String, ApiError> {
    if s.is_empty() || s.len() > 120 || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::bad_param(param, "'rid' must be 1 to 120 printable ASCII characters, without spaces."));
    }
    Ok(s)
}

/// A per-prompt field given as a list in a batch: one value per prompt (None when it is one value for all).
fn listed(
    obj: &mut Map<String, Value>,
    field: &str,
    k: usize,
    batched: bool,
    n: usize,
) -> Result<Option<Vec<Value>>, ApiError> {
    match obj.get(field) {
        Some(Value::Array(a)) if batched && a.len() == k && n == 1 => {
            let a = a.clone();
            obj.remove(field);
            Ok(Some(a))
        }
        Some(Value::Array(_)) if batched && n > 1 => {
            Err(ApiError::bad_param(field, format!("A list of '{field}' cannot be used with n > 1 (as in SGLang).")))
        }
        Some(Value::Array(_)) => Err(ApiError::bad_param(field, format!("'{field}' must be one value per prompt."))),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ok(body: Value) -> Split {
        split(body, "req-1", (64, 1 << 20)).unwrap()
    }

    fn param(body: Value) -> String {
        let e = split(body, "req-1", (64, 1 << 20)).err().unwrap();
        let env: Value = serde_json::from_str(&e.envelope()).unwrap();
        env["error"]["param"].as_str().unwrap_or("").to_string()
    }

    #[test]
    fn a_single_prompt_is_one_sequence_under_its_rid() {
        let s = ok(json!({"text": "hi", "rid": "r"}));
        assert!(s.single && s.bodies.len() == 1 && s.rids == ["r"]);
        assert!(s.bodies[0].get("index").is_none());
        let s = ok(json!({"input_ids": [1, 2.0]}));
        assert_eq!(s.bodies[0]["input_ids"], json!([1, 2]));
        assert_eq!(s.rids, ["req-1"]); // the HTTP request's id when the body names none
    }

    #[test]
    fn batches_and_samples_go_prompt_by_prompt() {
        let s = ok(json!({"text": ["a", "b"], "sampling_params": {"n": 3, "temperature": 0.5}, "rid": "x"}));
        assert!(!s.single);
        let got: Vec<(String, u64, String)> = s
            .bodies
            .iter()
            .map(|b| {
                (b["text"].as_str().unwrap().into(), b["index"].as_u64().unwrap(), b["rid"].as_str().unwrap().into())
            })
            .collect();
        assert_eq!(got[0], ("a".into(), 0, "x_0_0".into()));
        assert_eq!(got[2], ("a".into(), 2, "x_0_2".into()));
        assert_eq!(got[3], ("b".into(), 3, "x_1_0".into()));
        assert!(
            s.bodies
                .iter()
                .all(|b| b["sampling_params"].get("n").is_none() && b["sampling_params"]["temperature"] == 0.5)
        );
        // n > 1 on one prompt answers a list, as SGLang does
        assert!(!ok(json!({"text": "a", "sampling_params": {"n": 2}})).single);
        let s = ok(json!({"input_ids": [[1], [2]], "rid": ["p", "q"], "return_logprob": [true, false]}));
        assert_eq!(s.rids, ["p", "q"]);
        assert_eq!(s.bodies[1]["return_logprob"], false);
        let s = ok(json!({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}));
        assert_eq!(s.bodies[1]["sampling_params"]["max_new_tokens"], 2);
    }

    #[test]
    fn malformed_batches_are_refused_naming_the_field() {
        for (body, field) in [
            (json!({}), "text"),
            (json!({"text": "a", "input_ids": [1]}), "text"),
            (json!({"text": []}), "text"),
            (json!({"text": 5}), "text"),
            (json!({"input_ids": [[1], []]}), "input_ids[1]"),
            (json!({"input_ids": [-1]}), "input_ids"),
            (json!({"text": "a", "sampling_params": {"n": 0}}), "sampling_params.n"),
            (json!({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}), "sampling_params.n"),
            (json!({"text": ["a", "b"], "sampling_params": [{}]}), "sampling_params"),
            (json!({"text": "a", "sampling_params": [{}]}), "sampling_params"),
            (json!({"text": ["a", "b"], "rid": ["x"]}), "rid"),
            (json!({"text": ["a", "b"], "rid": ["x", "x"]}), "rid"),
            (json!({"text": "a", "rid": "has space"}), "rid"),
            (
                json!({"text": ["a", "b"], "return_logprob": [true, true], "sampling_params": {"n": 2}}),
                "return_logprob",
            ),
            (json!({"text": "a", "stream": "yes"}), "stream"),
        ] {
            assert_eq!(param(body.clone()), field, "{body}");
        }
    }

    #[test]
    fn the_fanout_is_bounded() {
        let eight = vec!["a"; 8];
        assert_eq!(ok(json!({"text": eight, "sampling_params": {"n": 8}})).bodies.len(), 64);
        assert_eq!(param(json!({"text": eight, "sampling_params": {"n": 9}})), "sampling_params.n");
        assert_eq!(param(json!({"text": "a", "sampling_params": {"n": 1e18}})), "sampling_params.n");
        // The bytes the sequences hold together: a long prompt sampled many times is refused before it is copied.
        let long = "x".repeat(40_000);
        assert_eq!(ok(json!({"text": long, "sampling_params": {"n": 16}})).bodies.len(), 16);
        assert_eq!(param(json!({"text": long, "sampling_params": {"n": 32}})), "text");
        let ids = vec![7; 300_000];
        assert_eq!(param(json!({"input_ids": [ids], "sampling_params": {"n": 2}})), "input_ids");
    }
}

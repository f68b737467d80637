//! OpenAI's `n` on Chat Completions and Completions: n choices of one prompt, each sampled as a request of its own
//! on the path (its own slot), as vLLM samples them. `split` makes the n bodies; `http::fanout` runs them and
//! `http::choices` makes one response of their answers, choice i from sequence i.

use super::Split;
use super::fields::{brief, integer};
use crate::error::ApiError;
use crate::limits::MAX_CHOICES;
use serde_json::Value;

/// The bodies of a request's choices. `raw_len`: the body's size, which each choice copies; `bounds`: most
/// sequences and most bytes one request may fan out to (`--max-generate-fanout`, `--max-generate-fanout-bytes`),
/// checked before any copy is made.
pub fn split(mut json: Value, request_id: &str, raw_len: usize, bounds: (usize, usize)) -> Result<Split, ApiError> {
    let stream = json.get("stream") == Some(&Value::Bool(true));
    let n = match json.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) => match integer(v) {
            Some(n) if n >= 1 => usize::try_from(n).unwrap_or(usize::MAX),
            _ => {
                return Err(ApiError::bad_param(
                    "n",
                    format!("'n' must be an integer of at least 1, got {}.", brief(v)),
                ));
            }
        },
    };
    if n == 1 {
        return Ok(Split {
            bodies: vec![json],
            rids: vec![request_id.to_string()],
            single: true,
            stream,
            choices: true,
        });
    }
    let most = MAX_CHOICES.min(bounds.0);
    if n > most {
        return Err(ApiError::bad_param("n", format!("'n' must be at most {most}, got {n}.")));
    }
    if raw_len.saturating_mul(n) > bounds.1 {
        return Err(ApiError::bad_param(
            "n",
            format!("{n} copies of this {raw_len}-byte body pass the server's bound of {} bytes.", bounds.1),
        ));
    }
    let obj = json.as_object_mut().ok_or_else(|| ApiError::bad_request("The request body must be a JSON object."))?;
    obj.insert("n".into(), Value::from(1));
    // vLLM's: choice j of a seeded request samples with the seed plus j, so the choices differ and each is
    // reproducible. A seed the door would refuse stays as it is, for the door to refuse.
    let seed = obj.get("seed").and_then(integer);
    let (mut bodies, mut rids) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for j in 0..n {
        let mut one = obj.clone();
        if let Some(s) = seed.and_then(|s| s.checked_add(j as i64)) {
            one.insert("seed".into(), Value::from(s));
        }
        bodies.push(Value::Object(one));
        rids.push(format!("{request_id}_{j}"));
    }
    Ok(Split { bodies, rids, single: false, stream, choices: true })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const BOUNDS: (usize, usize) = (4096, 64 << 20);

    #[test]
    fn n_bodies_with_their_seeds_and_rids() {
        let s = split(json!({"prompt": "x", "n": 3, "seed": 7, "stream": true}), "req", 30, BOUNDS).unwrap();
        assert!(s.stream && s.choices && !s.single);
        assert_eq!(s.rids, ["req_0", "req_1", "req_2"]);
        let seeds: Vec<_> = s.bodies.iter().map(|b| (b["seed"].as_i64(), b["n"].as_i64())).collect();
        assert_eq!(seeds, [(Some(7), Some(1)), (Some(8), Some(1)), (Some(9), Some(1))]);
        let one = split(json!({"prompt": "x"}), "req", 13, BOUNDS).unwrap();
        assert!(one.single && one.rids == ["req"] && one.bodies[0] == json!({"prompt": "x"}));
    }

    #[test]
    fn bad_and_excessive_n_are_refused_naming_it() {
        for (body, len) in [
            (json!({"n": 0}), 8),
            (json!({"n": "2"}), 8),
            (json!({"n": 1.5}), 8),
            (json!({"n": MAX_CHOICES + 1}), 8),
            (json!({"n": 4}), 20 << 20),
        ] {
            let Err(e) = split(body.clone(), "r", len, BOUNDS) else { panic!("{body} accepted") };
            assert!(e.to_string().contains("'n'") || e.to_string().contains("copies"), "{body}: {e}");
        }
        assert!(split(json!({"n": 5}), "r", 8, (4, 1 << 20)).is_err()); // --max-generate-fanout
    }
}

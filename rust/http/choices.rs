//! One OpenAI response from the answers of its n choices (`doors::choices`), each sampled as a request of its own:
//! choice i is sequence i's one choice, renumbered, under one response id, as vLLM answers `n`.
//! - JSON: the first answer's envelope with every answer's choice; usage counts the prompt once and every choice's
//!   tokens (vLLM's sum).
//! - A stream: every sequence's chunks as they come, each renumbered and under the one id; each sequence's usage
//!   chunk is held back, and one with the sum goes out after the last sequence ends, then one `data: [DONE]`.
//!
//! Only requests with n > 1 come here; their chunks are parsed to be renumbered (a cost n = 1 never pays).

use crate::doors::sse;
use crate::path::{Answer, Events, Gathered, Unary};
use axum::body::Bytes;
use bytes::BytesMut;
use futures_util::StreamExt;
use serde_json::{Map, Value};
use std::sync::{Arc, Mutex};

/// The one response of `answers`, all JSON or all streams (one request's), choice i from `answers[i]`.
pub fn merge(answers: Vec<Answer>, id: String) -> Answer {
    let Gathered { streams, jsons, guard } = Gathered::of(answers);
    if streams.is_empty() {
        return Answer::Unary(Unary { json: merge_json(&jsons, &id), guard });
    }
    Answer::Stream(merge_streams(streams, id))
}

/// The responses' choices in one response: the first's envelope, its id `id`, usage summed.
fn merge_json(jsons: &[Bytes], id: &str) -> Bytes {
    let mut parsed = jsons.iter().map(|j| serde_json::from_slice::<Value>(j).unwrap_or(Value::Null));
    let Some(Value::Object(mut first)) = parsed.next() else {
        return jsons.first().cloned().unwrap_or_default(); // not a response: an error body, as it came
    };
    let mut choices = take_choices(&mut first, 0);
    let mut usage = first.remove("usage");
    for (i, answer) in parsed.enumerate() {
        let Value::Object(mut answer) = answer else { continue };
        choices.extend(take_choices(&mut answer, i + 1));
        add_usage(&mut usage, answer.get("usage"));
    }
    first.insert("id".into(), Value::from(id));
    first.insert("choices".into(), Value::Array(choices));
    if let Some(usage) = usage {
        first.insert("usage".into(), usage);
    }
    Bytes::from(serde_json::to_vec(&first).unwrap_or_default())
}

/// An answer's choices, numbered `index`.
fn take_choices(answer: &mut Map<String, Value>, index: usize) -> Vec<Value> {
    let Some(Value::Array(mut choices)) = answer.remove("choices") else { return Vec::new() };
    for choice in &mut choices {
        if let Some(c) = choice.as_object_mut() {
            c.insert("index".into(), Value::from(index));
        }
    }
    choices
}

/// Add another choice's usage: its completion tokens (and their details) count, its prompt does not again.
fn add_usage(sum: &mut Option<Value>, other: Option<&Value>) {
    let (Some(Value::Object(sum)), Some(Value::Object(other))) = (sum.as_mut(), other) else { return };
    let tokens = other.get("completion_tokens").and_then(Value::as_u64).unwrap_or(0);
    for key in ["completion_tokens", "total_tokens"] {
        if let Some(v) = sum.get(key).and_then(Value::as_u64) {
            sum.insert(key.into(), Value::from(v + tokens));
        }
    }
    let details = |m: &Map<String, Value>| m.get("completion_tokens_details").and_then(Value::as_object).cloned();
    if let (Some(mut mine), Some(theirs)) = (details(sum), details(other)) {
        for (key, v) in theirs {
            if let (Some(a), Some(b)) = (mine.get(&key).and_then(Value::as_u64), v.as_u64()) {
                mine.insert(key, Value::from(a + b));
            }
        }
        sum.insert("completion_tokens_details".into(), Value::Object(mine));
    }
}

/// What the sequences' streams hold back for the end: the first usage chunk, its usage the sum so far.
type HeldUsage = Arc<Mutex<Option<Map<String, Value>>>>;

/// The sequences' events as they come, renumbered, then the summed usage chunk (if they sent any) and `[DONE]`.
fn merge_streams(streams: Vec<Events>, id: String) -> Events {
    let id: Arc<str> = id.into();
    let held: HeldUsage = Arc::default();
    let renumbered: Vec<Events> =
        streams.into_iter().enumerate().map(|(i, events)| renumber(events, i, id.clone(), held.clone())).collect();
    let end = futures_util::stream::once(async move {
        let mut tail = BytesMut::new();
        if let Some(chunk) = held.lock().unwrap_or_else(|e| e.into_inner()).take() {
            frame(&mut tail, &Value::Object(chunk));
        }
        tail.extend_from_slice(sse::DONE);
        Ok(tail.freeze())
    });
    Box::pin(futures_util::stream::select_all(renumbered).chain(end))
}

/// Sequence `index`'s events: its chunks' choices numbered `index` and under `id`; its `[DONE]` dropped and its
/// usage chunk added to `held`. Events are cut at their blank line, wherever the stream's items end.
fn renumber(events: Events, index: usize, id: Arc<str>, held: HeldUsage) -> Events {
    let mut carry = BytesMut::new();
    Box::pin(
        events
            .map(move |item| {
                let bytes = item?;
                carry.extend_from_slice(&bytes);
                let mut out = BytesMut::with_capacity(carry.len() + 16);
                while let Some(end) = memchr::memmem::find(&carry, b"\n\n") {
                    let event = carry.split_to(end + 2);
                    rewrite(&event, index, &id, &held, &mut out);
                }
                Ok(out.freeze())
            })
            // An item that held no whole event, or only what is dropped, sends nothing: an empty chunk is not sent
            // as one (HTTP/1.1 would read it as the body's end).
            .filter(|item| std::future::ready(!matches!(item, Ok(b) if b.is_empty()))),
    )
}

/// One event, rewritten into `out` (or held back, or dropped).
fn rewrite(event: &[u8], index: usize, id: &str, held: &HeldUsage, out: &mut BytesMut) {
    let Some(data) = event.strip_prefix(b"data: ") else {
        out.extend_from_slice(event); // a comment (keep-alive) or another event type
        return;
    };
    let chunk = serde_json::from_slice::<Value>(data).ok();
    let Some(Value::Object(mut chunk)) = chunk.filter(|c| c.get("choices").is_some()) else {
        if !event.starts_with(sse::DONE) {
            out.extend_from_slice(event); // not a chunk: an error event, as it came
        }
        return;
    };
    chunk.insert("id".into(), Value::from(id));
    let usage_only = chunk.get("choices").and_then(Value::as_array).is_some_and(Vec::is_empty);
    if usage_only && chunk.get("usage").is_some_and(Value::is_object) {
        let mut held = held.lock().unwrap_or_else(|e| e.into_inner());
        match held.as_mut() {
            None => *held = Some(chunk),
            Some(first) => {
                let mut sum = first.remove("usage");
                add_usage(&mut sum, chunk.get("usage"));
                first.insert("usage".into(), sum.unwrap_or(Value::Null));
            }
        }
        return;
    }
    let choices = take_choices(&mut chunk, index);
    chunk.insert("choices".into(), Value::Array(choices));
    frame(out, &Value::Object(chunk));
}

fn frame(out: &mut BytesMut, chunk: &Value) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&serde_json::to_vec(chunk).unwrap_or_default());
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Bytes {
        Bytes::from(serde_json::to_vec(&v).unwrap())
    }

    #[test]
    fn json_choices_renumbered_and_usage_summed() {
        let one = |text: &str, n: u64| {
            body(json!({"id": format!("cmpl-{text}"), "object": "text_completion", "choices": [
                {"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n,
                          "completion_tokens_details": {"reasoning_tokens": n / 2}}}))
        };
        let got: Value = serde_json::from_slice(&merge_json(&[one("a", 4), one("b", 6)], "cmpl-x")).unwrap();
        assert_eq!(got["id"], "cmpl-x");
        assert_eq!(
            got["choices"],
            json!([{"index": 0, "text": "a", "finish_reason": "stop"},
                                          {"index": 1, "text": "b", "finish_reason": "stop"}])
        );
        assert_eq!(
            got["usage"],
            json!({"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15,
                                        "completion_tokens_details": {"reasoning_tokens": 5}})
        );
    }

    #[test]
    fn stream_events_renumbered_usage_held_and_one_done() {
        let held = HeldUsage::default();
        let mut out = BytesMut::new();
        let chunk = json!({"id": "c-1", "choices": [{"index": 0, "delta": {"content": "hi"}}]});
        let usage = json!({"id": "c-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                                  "total_tokens": 5}});
        for (i, event) in [chunk.clone(), usage.clone()].iter().enumerate() {
            let framed = format!("data: {event}\n\n");
            rewrite(framed.as_bytes(), 2, "c-x", &held, &mut out);
            rewrite(framed.as_bytes(), 1 - i.min(1), "c-x", &held, &mut out);
        }
        rewrite(b": keep-alive\n\n", 0, "c-x", &held, &mut out);
        rewrite(b"data: {\"error\":{\"message\":\"x\"}}\n\n", 0, "c-x", &held, &mut out);
        rewrite(sse::DONE, 0, "c-x", &held, &mut out);
        let text = String::from_utf8(out.to_vec()).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 4, "{text}"); // two content chunks, the keep-alive and the error as it came
        assert_eq!(events[3], "data: {\"error\":{\"message\":\"x\"}}");
        let first: Value = serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!((first["id"].as_str(), first["choices"][0]["index"].as_u64()), (Some("c-x"), Some(2)));
        let total = held.lock().unwrap().clone().unwrap();
        assert_eq!(total["usage"], json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}));
    }
}

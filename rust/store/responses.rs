//! Stored responses on the request path:
//! - before the codec, a request that names `previous_response_id` gets the chain's items put before its input
//!   (`continue_from`); the chain's instructions are not carried over, as OpenAI documents;
//! - as a stored response finishes, its Response is cut from its last bytes as text (never parsed) and handed to
//!   one writer task, which writes what has gathered in one transaction: a few hundred responses a second cost
//!   a few commits, not one each. The client may name a response the moment it has its last bytes, so the id is
//!   marked as being written first, and a request that names it waits for the write (`load`).

use super::{Store, StoreError, StoredResponse};
use crate::error::ApiError;
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Longest a request waits for the response it names to be written.
const WRITE_WAIT: Duration = Duration::from_secs(10);
/// How often responses past their time are removed.
const EXPIRE_EVERY: Duration = Duration::from_secs(600);
/// Responses waiting for the writer: past this (a store that stalls) new ones are dropped, with a log line.
const WRITE_QUEUE: usize = 8192;
/// Most responses one transaction writes.
const WRITE_BATCH: usize = 256;

pub struct Responses {
    store: Arc<dyn Store>,
    /// Ids being written: their writes' "done" flags.
    writing: Mutex<HashMap<String, watch::Receiver<bool>>>,
    writer: mpsc::Sender<Write>,
    runtime: tokio::runtime::Handle,
}

/// A response on its way to the store.
struct Write {
    id: String,
    keep: Keep,
    response: Vec<u8>,
    done: watch::Sender<bool>,
}

/// What a stored request (or one that continues a chain) leaves for its response.
pub struct Keep {
    /// Whether to store the response (a request may continue a chain and ask not to be stored itself).
    pub store: bool,
    pub previous: Option<String>,
    /// The items before the request's own input (the chain's).
    context: Vec<Value>,
    /// The request's body as the client sent it: its own input items are read from it as the record is written.
    body: Vec<u8>,
}

impl Responses {
    pub fn new(store: Box<dyn Store>, runtime: tokio::runtime::Handle) -> Arc<Self> {
        let store: Arc<dyn Store> = Arc::from(store);
        let (writer, queue) = mpsc::channel(WRITE_QUEUE);
        let me = Arc::new(Responses { store, writing: Mutex::new(HashMap::new()), writer, runtime });
        me.runtime.spawn(write_all(Arc::downgrade(&me), me.store.clone(), queue));
        me
    }

    /// Remove responses older than `ttl`, now and every few minutes from now on (OpenAI keeps them 30 days):
    /// what clients store is bounded by time, not left to grow the disk forever.
    pub fn expire_every(self: &Arc<Self>, ttl: Duration) {
        let me = self.clone();
        self.runtime.spawn(async move {
            let mut tick = tokio::time::interval(EXPIRE_EVERY);
            loop {
                tick.tick().await;
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                let before = now.saturating_sub(ttl).as_secs() as i64;
                match me.store.expire_responses(before).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(removed = n, "stored responses past --response-store-ttl removed"),
                    Err(e) => tracing::warn!("could not remove expired responses: {e}"),
                }
            }
        });
    }

    /// A stored response, waiting for it if it is being written.
    pub async fn load(&self, id: &str) -> Result<Option<StoredResponse>, ApiError> {
        let writing = self.writing.lock().unwrap().get(id).cloned();
        if let Some(mut done) = writing {
            let _ = tokio::time::timeout(WRITE_WAIT, done.wait_for(|d| *d)).await;
        }
        self.store.get_response(id).await.map_err(failed)
    }

    pub async fn delete(&self, id: &str) -> Result<bool, ApiError> {
        self.load(id).await?; // a response being written is deleted once it is there
        self.store.delete_response(id).await.map_err(failed)
    }

    /// The body of a Responses request with the chain of `previous` put before its input, and what its own
    /// record will keep. A request that continues nothing is not parsed here.
    pub async fn continue_from(
        &self,
        body: Vec<u8>,
        previous: Option<String>,
        store: bool,
    ) -> Result<(Vec<u8>, Keep), ApiError> {
        let Some(prev) = previous else {
            return Ok((body.clone(), Keep { store, previous: None, context: Vec::new(), body }));
        };
        let param = Some("previous_response_id");
        let not_found = || ApiError::NotFound { what: "Previous response", id: prev.clone(), param };
        let stored = self.load(&prev).await?.ok_or_else(not_found)?;
        let context = chain_items(&stored).ok_or(ApiError::Internal)?;
        let mut v: Value = serde_json::from_slice(&body).map_err(|_| ApiError::Internal)?;
        let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
        obj.remove("previous_response_id");
        let mut input = context.clone();
        input.extend(own_items(obj.get("input")));
        obj.insert("input".into(), Value::Array(input));
        let spliced = serde_json::to_vec(&v).map_err(|_| ApiError::Internal)?;
        Ok((spliced, Keep { store, previous: Some(prev), context, body }))
    }

    /// Record a finished response from its last bytes (a whole body, or a stream's final events). Called on the
    /// rank_io thread before the bytes go to the client: it marks the id as being written and leaves the rest
    /// (parsing, writing) to a task.
    pub fn record(&self, id: String, keep: Keep, last: &[u8], stream: bool) {
        let Some(response) = response_text(last, stream) else {
            tracing::warn!(response_id = %id, "a stored response's last bytes held no Response");
            return;
        };
        let (done, wait) = watch::channel(false);
        self.writing.lock().unwrap().insert(id.clone(), wait);
        let write = Write { id, keep, response: response.to_vec(), done };
        if let Err(e) = self.writer.try_send(write) {
            let w = e.into_inner();
            tracing::error!(response_id = %w.id, "the state store is {WRITE_QUEUE} responses behind: not stored");
            self.writing.lock().unwrap().remove(&w.id);
        }
    }
}

/// The writer: what has gathered since its last transaction, in one.
async fn write_all(responses: std::sync::Weak<Responses>, store: Arc<dyn Store>, mut queue: mpsc::Receiver<Write>) {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    while queue.recv_many(&mut batch, WRITE_BATCH).await > 0 {
        let records: Vec<StoredResponse> = batch.iter_mut().filter_map(to_record).collect();
        if let Err(e) = store.put_responses(&records).await {
            tracing::error!(responses = records.len(), "could not store responses: {e}");
        }
        let Some(me) = responses.upgrade() else { return };
        let mut writing = me.writing.lock().unwrap();
        for w in batch.drain(..) {
            writing.remove(&w.id);
            let _ = w.done.send(true);
        }
    }
}

/// The Response in a finished request's last bytes, as text: a non-stream's whole body, or the `response` of a
/// stream's final lifecycle event (`{"type":…,"response":{…},"sequence_number":N}`).
fn response_text(last: &[u8], stream: bool) -> Option<&[u8]> {
    if !stream {
        return Some(last).filter(|b| b.first() == Some(&b'{'));
    }
    const ENDS: [&[u8]; 3] = [
        b"event: response.completed\ndata: ",
        b"event: response.incomplete\ndata: ",
        b"event: response.failed\ndata: ",
    ];
    let (at, len) = ENDS.iter().find_map(|e| memchr::memmem::rfind(last, e).map(|at| (at, e.len())))?;
    let data = &last[at + len..];
    let data = &data[..memchr::memchr(b'\n', data).unwrap_or(data.len())];
    let start = memchr::memmem::find(data, br#""response":{"#)? + br#""response":"#.len();
    let end = memchr::memmem::rfind(data, br#","sequence_number":"#).unwrap_or(data.len() - 1);
    Some(&data[start..end]).filter(|r| r.last() == Some(&b'}'))
}

/// A Response's text with the `previous_response_id` it continues (deepseek-recipe writes null: it knows no
/// chains). Only the whole-Response events and bodies hold the field.
pub fn echo_previous(text: &[u8], previous: &str) -> Vec<u8> {
    const NULL: &[u8] = br#""previous_response_id":null"#;
    let with = serde_json::to_vec(&json!({"previous_response_id": previous})).unwrap_or_default();
    let with = &with[1..with.len() - 1]; // `"previous_response_id":"…"`
    let mut out = Vec::with_capacity(text.len() + 64);
    let mut at = 0;
    for found in memchr::memmem::find_iter(text, NULL) {
        out.extend_from_slice(&text[at..found]);
        out.extend_from_slice(with);
        at = found + NULL.len();
    }
    out.extend_from_slice(&text[at..]);
    out
}

fn to_record(w: &mut Write) -> Option<StoredResponse> {
    let keep = &mut w.keep;
    let sent: Value = serde_json::from_slice(&keep.body).ok()?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Some(StoredResponse {
        id: w.id.clone(),
        created_at: now.as_secs() as i64,
        model: sent.get("model").and_then(Value::as_str).unwrap_or_default().to_string(),
        previous_response_id: keep.previous.take(),
        context: Value::Array(std::mem::take(&mut keep.context)).to_string(),
        input_items: Value::Array(own_items(sent.get("input"))).to_string(),
        response: String::from_utf8(std::mem::take(&mut w.response)).ok()?,
    })
}

fn failed(e: StoreError) -> ApiError {
    tracing::error!("{e}");
    ApiError::Store
}

/// A request's own input as items, each with an id (a string input is one user message).
fn own_items(input: Option<&Value>) -> Vec<Value> {
    let mut items = match input {
        Some(Value::String(text)) => {
            vec![json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})]
        }
        Some(Value::Array(items)) => items.clone(),
        _ => Vec::new(),
    };
    for item in &mut items {
        if let Some(obj) = item.as_object_mut() {
            obj.entry("type").or_insert_with(|| json!("message"));
            // A message's text as the list of parts OpenAI lists it as (`input_text`; `output_text` for what the
            // assistant said).
            if let Some(Value::String(text)) = obj.get("content") {
                let kind = if obj.get("role").and_then(Value::as_str) == Some("assistant") {
                    "output_text"
                } else {
                    "input_text"
                };
                let part = json!([{"type": kind, "text": text}]);
                obj.insert("content".into(), part);
            }
            if !obj.contains_key("id") {
                obj.insert("id".into(), json!(item_id(obj)));
            }
        }
    }
    items
}

fn item_id(item: &Map<String, Value>) -> String {
    let prefix = match item.get("type").and_then(Value::as_str) {
        Some("function_call") => "fc",
        Some("function_call_output") => "fco",
        Some("reasoning") => "rs",
        _ => "msg",
    };
    crate::ids::random_id(prefix)
}

/// The items a continuation of `r` starts from: its chain's, its own input's, and its output.
fn chain_items(r: &StoredResponse) -> Option<Vec<Value>> {
    let mut items: Vec<Value> = serde_json::from_str(&r.context).ok()?;
    items.extend(serde_json::from_str::<Vec<Value>>(&r.input_items).ok()?);
    let response: Value = serde_json::from_str(&r.response).ok()?;
    if let Some(Value::Array(output)) = response.get("output") {
        items.extend(output.iter().cloned());
    }
    Some(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streams_response_is_its_final_events() {
        let last = b"event: response.output_text.done\ndata: {\"x\":1}\n\n\
            event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\
            \"o\":{\"a\":1}},\"sequence_number\":9}\n\n";
        assert_eq!(response_text(last, true), Some(&br#"{"id":"resp_1","o":{"a":1}}"#[..]));
        let no_seq = b"event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"id\":\"r\"}}\n\n";
        assert_eq!(response_text(no_seq, true), Some(&br#"{"id":"r"}"#[..]));
        assert_eq!(response_text(br#"{"id":"resp_2"}"#, false), Some(&br#"{"id":"resp_2"}"#[..]));
        assert_eq!(response_text(b"event: response.output_text.delta\ndata: {}\n\n", true), None);
    }

    #[test]
    fn a_continued_response_names_what_it_continues() {
        let text = br#"{"id":"resp_2","previous_response_id":null,"x":{"previous_response_id":null}}"#;
        let want = br#"{"id":"resp_2","previous_response_id":"resp_1","x":{"previous_response_id":"resp_1"}}"#;
        assert_eq!(echo_previous(text, "resp_1"), want.to_vec());
        assert_eq!(echo_previous(b"{}", "r"), b"{}".to_vec());
    }

    #[test]
    fn input_becomes_items_with_ids() {
        let items = own_items(Some(&json!("hi")));
        assert_eq!(items[0]["content"][0], json!({"type": "input_text", "text": "hi"}));
        assert!(items[0]["id"].as_str().unwrap().starts_with("msg_"));
        let kept = own_items(Some(&json!([{"role": "user", "content": "a", "id": "msg_x"}])));
        assert_eq!(kept[0]["id"], "msg_x");
        assert_eq!(kept[0]["content"], json!([{"type": "input_text", "text": "a"}]));
        assert_eq!(kept[0]["type"], "message");
    }
}

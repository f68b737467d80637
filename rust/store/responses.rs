//! Stored responses and conversations on the request path:
//! - before the codec, a request that names `previous_response_id` gets the chain's items put before its input,
//!   and one that names a `conversation` gets its items (`continue_from`); the chain's instructions are not
//!   carried over, as OpenAI documents;
//! - as a stored response (or one in a conversation) finishes, its Response is cut from its last bytes as text
//!   (never parsed there) and handed to one writer task, which writes what has gathered in one transaction per
//!   batch: a few hundred responses a second cost a few commits, not one each, and appends the input and output
//!   items to the conversation. The client may name the response (or continue the conversation) the moment it has
//!   its last bytes, so the ids are marked as being written first, and a request that names one waits for the
//!   write (`Store::settled`).

use super::items::{self, chain_items, output_items, own_items};
use super::{BUSY, CHAINED, Db, Store, StoredResponse, UNREACHABLE, WRITE_WAIT, Written, failed};
use crate::error::ApiError;
use crate::owner::Owner;
use crate::stream::Deliver;
use bytes::Bytes;
use serde_json::{Value, json};
use std::sync::{Arc, Weak};
use tokio::sync::{mpsc, watch};

/// Responses waiting for the writer: past this (a store that stalls) new ones are dropped, with a log line.
pub(super) const WRITE_QUEUE: usize = 8192;
/// Most responses one transaction writes.
const WRITE_BATCH: usize = 256;

/// A response on its way to the store.
pub(super) struct Write {
    id: String,
    keep: Keep,
    response: Vec<u8>,
    done: watch::Sender<Written>,
    wait: watch::Receiver<Written>,
}

/// What a stored request (or one that continues a chain or a conversation) leaves for its response.
pub struct Keep {
    /// Whether to store the response (a request may continue a chain and ask not to be stored itself).
    pub store: bool,
    pub previous: Option<String>,
    /// The conversation the request continues: its input and output are added to it.
    pub conversation: Option<String>,
    /// Whose the response (and the conversation's new items) will be.
    pub owner: Owner,
    /// The request's body as the client sent it: its own input items are read from it as the record is written.
    body: Vec<u8>,
}

impl Keep {
    /// Whether the finished response is written anywhere.
    pub fn writes(&self) -> bool {
        self.store || self.conversation.is_some()
    }
}

impl Store {
    /// `owner`'s stored response, waiting for it if it is being written (another owner's is not found).
    pub async fn load(&self, id: &str, owner: &Owner) -> Result<Option<StoredResponse>, ApiError> {
        self.settled(id).await;
        let r = self.db.get_response(id).await.map_err(failed)?;
        Ok(r.filter(|r| r.owned_by == owner.as_str()))
    }

    /// A stored response whoever owns it: for the server's own work on it (a background response's end).
    pub async fn load_any(&self, id: &str) -> Result<Option<StoredResponse>, ApiError> {
        self.settled(id).await;
        self.db.get_response(id).await.map_err(failed)
    }

    pub async fn delete(&self, id: &str, owner: &Owner) -> Result<bool, ApiError> {
        self.settled(id).await; // a response being written is deleted once it is there
        self.db.delete_response(id, owner.as_str()).await.map_err(failed)
    }

    /// The items a continuation of `owner`'s response `prev` starts from: its chain's, walked through
    /// `previous_response_id`. A chain larger than `--state-store-max-chain-bytes` is a 400 naming the parameter,
    /// from its rows' sizes alone (its text is never read then); one whose earlier response is gone, a 400.
    async fn chain_context(&self, prev: &str, owner: &Owner) -> Result<Vec<Value>, ApiError> {
        // OpenAI's 400 previous_response_not_found, which Codex-style clients key on.
        let not_found = |id: &str| ApiError::PreviousResponseNotFound(id.to_string());
        let first = self.load(prev, owner).await?.ok_or_else(|| not_found(prev))?;
        // A background response still running: its output is the chain's, so wait for its end (bounded).
        if super::background::is_running(&first.response) {
            self.until_ended(prev, super::background::CHAIN_WAIT).await?;
        }
        let links = self.db.chain_sizes(prev).await.map_err(failed)?;
        let bytes: i64 = links.iter().map(|l| l.bytes).sum();
        if bytes as u64 > self.retention.chain_max {
            return Err(too_long("previous_response_id", prev, bytes, self.retention.chain_max));
        }
        if let Some(last) = links.last()
            && !last.copied
            && let Some(gone) = &last.previous_response_id
        {
            let msg = format!(
                "Response '{gone}', earlier in the chain of '{prev}', is no longer stored: the chain cannot be \
                 continued."
            );
            return Err(ApiError::bad_param("previous_response_id", msg));
        }
        let ids: Vec<String> = links.iter().rev().map(|l| l.id.clone()).collect();
        let chain = self.db.get_responses(&ids).await.map_err(failed)?;
        if chain.len() != ids.len() {
            return Err(not_found(prev)); // deleted as it was read
        }
        chain_items(&chain).ok_or(ApiError::Internal)
    }

    /// The body of a Responses request with the chain of `previous`, or the items of `conversation`, put before
    /// its input, and what its own record will keep. A request that will store something is refused first if its
    /// owner is past its share (a 429) or one of its input items past `--state-store-max-item-bytes` (a 400). A
    /// request that continues nothing is parsed here only if it could hold such an item.
    pub async fn continue_from(
        &self,
        body: Vec<u8>,
        previous: Option<String>,
        conversation: Option<String>,
        store: bool,
        owner: Owner,
    ) -> Result<(Vec<u8>, Keep), ApiError> {
        let writes = store || conversation.is_some();
        if writes {
            self.room_for(&owner).await?;
        }
        let item_max = self.retention.item_max;
        let continues = previous.is_some() || conversation.is_some();
        if !continues && (!writes || body.len() as u64 <= item_max) {
            return Ok((body.clone(), Keep { store, previous, conversation, owner, body }));
        }
        let mut v: Value = serde_json::from_slice(&body).map_err(|_| ApiError::Internal)?;
        let own = own_items(v.get("input"));
        if writes && let Some((i, n)) = items::too_large(&own, item_max) {
            let msg = format!("This input item holds {n} bytes; the most an item stored here may hold is {item_max}.");
            return Err(ApiError::bad_param(&format!("input[{i}]"), msg));
        }
        if !continues {
            return Ok((body.clone(), Keep { store, previous, conversation, owner, body }));
        }
        let context = match (&previous, &conversation) {
            (Some(prev), _) => self.chain_context(prev, &owner).await?,
            (_, Some(conv)) => self.conversation_context(conv, &owner).await?,
            (None, None) => unreachable!("continues"),
        };
        let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
        obj.remove("previous_response_id");
        obj.remove("conversation");
        let mut input = context;
        input.extend(own);
        obj.insert("input".into(), Value::Array(input));
        let spliced = serde_json::to_vec(&v).map_err(|_| ApiError::Internal)?;
        Ok((spliced, Keep { store, previous, conversation, owner, body }))
    }

    /// Record a finished response from its last bytes (a whole body, or a stream's final events), then `deliver`
    /// them: the client has its `response.completed` (or its body) only once the response is committed, so a
    /// crash of the server a moment later loses nothing the client was told is done. A store that cannot commit
    /// (it failed, or did not answer within `WRITE_WAIT`) gets the client a 503 `store_unavailable` instead, in
    /// its door's envelope (a stream's error event): never an answer for a response that was not kept. Called on
    /// the rank_io thread: it marks the ids as being written and leaves the rest (parsing, writing, sending) to
    /// tasks.
    pub fn record_then(&self, id: String, keep: Keep, last: Bytes, stream: bool, deliver: Deliver) {
        let Some(response) = response_text(&last, stream) else {
            tracing::warn!(response_id = %id, "a stored response's last bytes held no Response");
            return deliver(Ok(last));
        };
        let mut written = self.record(id.clone(), keep, response);
        self.runtime.spawn(async move {
            let outcome = match tokio::time::timeout(WRITE_WAIT, written.wait_for(Option::is_some)).await {
                Ok(Ok(done)) => done.unwrap_or(Err(None)),
                Ok(Err(_)) => Err(None), // the writer is gone (the server stops)
                Err(_) => Err(Some(UNREACHABLE)),
            };
            match outcome {
                Ok(()) => deliver(Ok(last)),
                Err(why) => {
                    tracing::warn!(response_id = %id, "a stored response was not kept: its client gets an error");
                    deliver(Err(why.map_or(ApiError::Store, ApiError::StoreUnavailable)))
                }
            }
        });
    }

    /// Hand a finished response to the writer; its outcome, once written.
    fn record(&self, id: String, keep: Keep, response: &[u8]) -> watch::Receiver<Written> {
        let (done, wait) = watch::channel(None);
        {
            let mut writing = self.writing.lock().unwrap();
            writing.insert(id.clone(), wait.clone());
            if let Some(conv) = &keep.conversation {
                writing.insert(conv.clone(), wait.clone());
            }
        }
        let write = Write { id, keep, response: response.to_vec(), done, wait: wait.clone() };
        if let Err(e) = self.writer.try_send(write) {
            let w = e.into_inner();
            tracing::error!(response_id = %w.id, "the state store is {WRITE_QUEUE} responses behind: not stored");
            self.finished(&w, Err(Some(BUSY)));
        }
        wait
    }

    /// The write is committed (or failed): requests waiting for its ids go on.
    fn finished(&self, w: &Write, outcome: Result<(), Option<&'static str>>) {
        let mut writing = self.writing.lock().unwrap();
        for key in std::iter::once(&w.id).chain(&w.keep.conversation) {
            // A later write to the same conversation has its own flag: leave it.
            if writing.get(key).is_some_and(|r| r.same_channel(&w.wait)) {
                writing.remove(key);
            }
        }
        let _ = w.done.send(Some(outcome));
    }
}

/// The writer: what has gathered since its last transaction, in one; then each conversation's new items. Each
/// write's outcome goes to those waiting for it (its client's answer among them), committed or not.
pub(super) async fn write_all(store: Weak<Store>, db: Arc<Db>, mut queue: mpsc::Receiver<Write>) {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    let mut held = None;
    while queue.recv_many(&mut batch, WRITE_BATCH).await > 0 {
        // A write whose record cannot be made (its request's body is not JSON) fails as the server's fault.
        let mut outcomes: Vec<Result<(), Option<&'static str>>> = vec![Err(None); batch.len()];
        let records: Vec<(usize, Record)> =
            batch.iter_mut().enumerate().filter_map(|(i, w)| Some((i, to_record(w)?))).collect();
        let stored: Vec<&StoredResponse> = records.iter().filter_map(|(_, r)| r.response.as_ref()).collect();
        let mut grew: Vec<(&Owner, usize)> = Vec::new();
        if held.is_none() {
            held = db.hold().await.unwrap_or_else(|e| {
                tracing::warn!("the store's writer has no connection of its own: {e}");
                None
            });
        }
        let mut put = db.put_responses(held.as_mut(), &stored).await;
        if let (Err(e), Some(_)) = (&put, &held) {
            // The held connection may be what failed (a PostgreSQL restarted, a network cut, a SQLite connection
            // left in a bad state by a full disk): once more through the pool, which checks the connection it
            // gives; the next batch holds a new one.
            tracing::warn!("the store's writer lost its connection ({e}): writing through the pool");
            if let Some(broken) = held.take() {
                broken.discard();
            }
            put = db.put_responses(None, &stored).await;
        }
        let put = put.map_err(|e| {
            tracing::error!(responses = stored.len(), "could not store responses: {e}");
            e.unavailable()
        });
        for (i, r) in &records {
            outcomes[*i] = if r.response.is_some() { put } else { Ok(()) };
            if let (Ok(()), Some(row)) = (put, &r.response) {
                grew.push((&r.owner, row.context.len() + row.input_items.len() + row.response.len()));
            }
        }
        // A conversation gains a response's items only once the response (if stored) is.
        for (i, r) in &records {
            let Some((conv, rows)) = &r.conversation else { continue };
            if outcomes[*i].is_err() {
                continue;
            }
            match db.append_items(conv, rows, items::now()).await {
                Ok(true) => grew.push((&r.owner, rows.iter().map(|(_, item)| item.len()).sum::<usize>())),
                Ok(false) => tracing::info!(conversation = %conv, "a response's conversation was deleted meanwhile"),
                Err(e) => {
                    tracing::error!(conversation = %conv, "could not add a response's items: {e}");
                    outcomes[*i] = Err(e.unavailable());
                }
            }
        }
        let Some(me) = store.upgrade() else { return };
        for (owner, bytes) in grew {
            me.retention.grew(owner, bytes);
        }
        for (w, outcome) in batch.drain(..).zip(outcomes) {
            me.finished(&w, outcome);
        }
    }
}

/// What one finished response writes: its row, and the items its conversation gains, and whose they are.
struct Record {
    owner: Owner,
    response: Option<StoredResponse>,
    conversation: Option<(String, Vec<(String, String)>)>,
}

fn to_record(w: &mut Write) -> Option<Record> {
    let keep = &mut w.keep;
    let sent: Value = serde_json::from_slice(&keep.body).ok()?;
    let own = own_items(sent.get("input"));
    let text = String::from_utf8(std::mem::take(&mut w.response)).ok()?;
    let conversation = keep.conversation.clone().map(|conv| {
        let out = serde_json::from_str(&text).map(|r| output_items(&r)).unwrap_or_default();
        (conv, own.iter().chain(&out).map(items::row).collect())
    });
    let response = keep.store.then(|| StoredResponse {
        id: w.id.clone(),
        created_at: items::now(),
        model: sent.get("model").and_then(Value::as_str).unwrap_or_default().to_string(),
        previous_response_id: keep.previous.clone(),
        // Its own items only: the chain before it is its previous responses' (never a copy of them in each).
        context: CHAINED.to_string(),
        input_items: Value::Array(own).to_string(),
        response: text,
        owned_by: keep.owner.as_str().to_string(),
    });
    Some(Record { owner: keep.owner.clone(), response, conversation })
}

/// A chain or conversation too large to continue: a 400 naming the parameter, at once.
pub(super) fn too_long(param: &str, id: &str, bytes: i64, max: u64) -> ApiError {
    let msg = format!(
        "'{id}' holds {bytes} bytes of stored items, more than the {max} a request may continue from here: start a \
         new one with the input you need."
    );
    ApiError::bad_param(param, msg)
}

/// The Response in a finished request's last bytes, as text: a non-stream's whole body, or the `response` of a
/// stream's final lifecycle event (`{"type":…,"response":{…},"sequence_number":N}`).
pub(crate) fn response_text(last: &[u8], stream: bool) -> Option<&[u8]> {
    if !stream {
        return Some(last).filter(|b| b.first() == Some(&b'{'));
    }
    const ENDS: [&[u8]; 3] = [
        b"event: response.completed\ndata: ",
        b"event: response.incomplete\ndata: ",
        b"event: response.failed\ndata: ",
    ];
    let (at, len) = ENDS.iter().find_map(|e| memchr::memmem::rfind(last, e).map(|at| (at, e.len())))?;
    event_response(&last[at + len..])
}

/// The Response an event's data holds (`{"type":…,"response":{…},"sequence_number":N}`), as text.
pub fn event_response(data: &[u8]) -> Option<&[u8]> {
    let data = &data[..memchr::memchr(b'\n', data).unwrap_or(data.len())];
    let start = memchr::memmem::find(data, br#""response":{"#)? + br#""response":"#.len();
    let end = memchr::memmem::rfind(data, br#","sequence_number":"#).unwrap_or(data.len() - 1);
    Some(&data[start..end]).filter(|r| r.last() == Some(&b'}'))
}

/// What a Response says that deepseek-recipe cannot know (it writes a null `previous_response_id`, no
/// conversation, and `"background":false`): the chain or conversation it continues, and that it runs in the
/// background. Only the whole-Response events and bodies hold these fields.
#[derive(Clone, Default)]
pub struct Echo {
    pub previous: Option<String>,
    pub conversation: Option<String>,
    pub background: bool,
}

impl Echo {
    pub fn needed(&self) -> bool {
        self.previous.is_some() || self.conversation.is_some() || self.background
    }

    pub fn apply(&self, text: &[u8]) -> Vec<u8> {
        let with = serde_json::to_vec(&json!({"previous_response_id": self.previous})).unwrap_or_default();
        let mut with = with[1..with.len() - 1].to_vec(); // `"previous_response_id":…`
        if let Some(conv) = &self.conversation {
            with.extend_from_slice(format!(",\"conversation\":{}", json!({"id": conv})).as_bytes());
        }
        let out = replace_all(text, br#""previous_response_id":null"#, &with);
        if self.background { replace_all(&out, br#""background":false"#, br#""background":true"#) } else { out }
    }
}

fn replace_all(text: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + 64);
    let mut at = 0;
    for found in memchr::memmem::find_iter(text, from) {
        out.extend_from_slice(&text[at..found]);
        out.extend_from_slice(to);
        at = found + from.len();
    }
    out.extend_from_slice(&text[at..]);
    out
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
        let previous = Echo { previous: Some("resp_1".into()), ..Echo::default() };
        assert_eq!(previous.apply(text), want.to_vec());
        assert_eq!(previous.apply(b"{}"), b"{}".to_vec());
        let want = br#"{"id":"resp_2","previous_response_id":null,"conversation":{"id":"conv_1"},"x":{"previous_response_id":null,"conversation":{"id":"conv_1"}}}"#;
        let conversation = Echo { conversation: Some("conv_1".into()), ..Echo::default() };
        assert_eq!(conversation.apply(text), want.to_vec());
        let background = Echo { background: true, ..Echo::default() };
        assert_eq!(background.apply(br#"{"background":false,"b":1}"#), br#"{"background":true,"b":1}"#.to_vec());
    }
}

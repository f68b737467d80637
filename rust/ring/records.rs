//! The record contract between the server and the engine ranks: the ONE
//! definition used by Rust and (through `py`) by the Python ranks.
//!
//! Everything is little-endian with 8-byte-friendly field order. Request
//! ring kinds: `SUBMIT`, `ABORT`, `SHUTDOWN`, `RELOAD`; output ring kind: `TOKENS`.
//!
//! ```text
//! SUBMIT:  request_id u64 | max_tokens u32 | flags u32 | temperature f32 | top_p f32
//!          | top_k i32 | top_logprobs u32 | seed u64 | n_prompt u32 | pad u32 | n_prompt x u32
//!          | [FLAG_CONSTRAINT: schema_type u32 | bound_token u32 | n_trigger u32 | schema_len u32
//!             | n_trigger x u32 | utf-8 schema]
//!          | [FLAG_IMAGES: extra_tokens u32 | n_images u32 | path_len u32 | n_images x (width u32 | height u32
//!             | bytes u32) | utf-8 path]
//! ABORT:   request_id u64
//! SHUTDOWN: (empty)
//! RELOAD:  utf-8 checkpoint directory (the rank loads it in place; `status::AUX_RELOADS` says how it went)
//! TOKENS:  n_entries u32 | pad u32 | entries...
//!   entry: request_id u64 | finish u32 | n_tokens u32 | n_tokens x u32
//!          | [logprobs: n_tokens x f32 | n_tokens x top x (token u32 | logprob f32)]
//!          | [PROMPT_LOGPROBS: n_prompt u32 | n_prompt x f32]
//!          | [finish == FINISH_ERROR: reason_len u32 | utf-8 reason] | pad to 8
//! TIMING:  n_entries u32 | pad u32 | published_us u64
//!          | n_entries x (request_id u64 | taken_us u64 | scheduled_us u64)
//! ```
//!
//! An entry's `finish` word holds the finish code in its low 16 bits and, for a request that asked for logprobs,
//! `top + 1` in its high 16 bits (`top` alternatives per token follow each token's own logprob). A request
//! without logprobs has 0 there and pays no byte for them; nor does a request without a constraint. Bit 15 of the
//! low half (`PROMPT_LOGPROBS`) marks an entry that carries the prompt's logprobs: a SUBMIT with
//! `FLAG_PROMPT_LOGPROBS` gets them once, with its first token, one per prompt token after the first.
//!
//! A TIMING record goes just before the TOKENS record that carries the first tokens of its requests: when the
//! rank took each from its ring, when the engine step that carries its prefill began, and when the rank published
//! (CLOCK_MONOTONIC, microseconds). It is sent once per request, never per token.
//!
//! Images never travel in the ring: a SUBMIT names the file holding them (in the server's media directory) and
//! each one's size; the rank reads the file once and unlinks it.
//!
//! Encoders write straight into the ring mapping (`Ring::try_push_with`);
//! decoders never panic on malformed input and never assume alignment.

use std::time::Duration;

use super::layout::align8;
use super::{Ring, RingError};

pub const SUBMIT: u32 = 1;
pub const ABORT: u32 = 2;
pub const SHUTDOWN: u32 = 3;
pub const RELOAD: u32 = 4;
pub const TOKENS: u32 = 16;
pub const TIMING: u32 = 17;

pub const FINISH_NONE: u32 = 0;
pub const FINISH_STOP: u32 = 1;
pub const FINISH_LENGTH: u32 = 2;
pub const FINISH_ABORT: u32 = 3;
pub const FINISH_ERROR: u32 = 4;

pub const FLAG_IGNORE_EOS: u32 = 1 << 0;
pub const FLAG_HAS_SEED: u32 = 1 << 1;
/// The request wants each token's logprob (and `top_logprobs` alternatives).
pub const FLAG_LOGPROBS: u32 = 1 << 2;
/// A grammar constrains the output: the constraint trailer follows the prompt.
pub const FLAG_CONSTRAINT: u32 = 1 << 3;
/// The prompt has images: the image trailer follows (after the constraint's, if any).
pub const FLAG_IMAGES: u32 = 1 << 4;
/// The request wants the logprob of each prompt token (DeepInfer's `prompt_logprobs`), with its first token.
pub const FLAG_PROMPT_LOGPROBS: u32 = 1 << 5;
/// In a TOKENS entry's finish word: the prompt's logprobs follow the tokens' own.
const PROMPT_LOGPROBS: u32 = 1 << 15;

/// `schema_type` of a constraint, as DeepInfer's `so_args` names them.
pub const SCHEMA_JSON: u32 = 1;
pub const SCHEMA_REGEX: u32 = 2;
pub const SCHEMA_EBNF: u32 = 3;
/// Most alternatives per token an entry may carry (DeepInfer's own limit).
pub const MAX_TOP_LOGPROBS: u32 = 1000;
/// `bound_token` when the constraint has none.
const NO_BOUND: u32 = u32::MAX;
/// Fixed part of the constraint trailer.
const CONSTRAINT_HEADER: usize = 16;

/// Fixed part of a SUBMIT payload.
pub const SUBMIT_HEADER: usize = 48;
/// Fixed part of a TOKENS payload / of one entry.
pub const TOKENS_HEADER: usize = 8;
pub const ENTRY_HEADER: usize = 16;
/// Fixed part of a TIMING payload / one entry.
pub const TIMING_HEADER: usize = 16;
pub const TIMING_ENTRY: usize = 24;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record truncated")]
    Truncated,
    #[error("{0} unexpected trailing bytes in record")]
    TrailingBytes(usize),
    #[error("unknown record kind {0}")]
    UnknownKind(u32),
    #[error("unknown finish code {0}")]
    BadFinish(u32),
    #[error("error reason or schema is not valid utf-8")]
    BadUtf8,
    #[error("too many logprob alternatives ({0})")]
    BadTop(u32),
}

/// A little-endian `u32` array borrowed from a record (any alignment).
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct U32s<'a>(&'a [u8]);

impl<'a> U32s<'a> {
    pub fn len(&self) -> usize {
        self.0.len() / 4
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn iter(&self) -> impl ExactSizeIterator<Item = u32> + 'a {
        self.0.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    }
    pub fn to_vec(&self) -> Vec<u32> {
        self.iter().collect()
    }
    /// The raw little-endian bytes.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.0
    }
}

impl std::fmt::Debug for U32s<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A generation request. `P` is `&[u32]`/`Vec<u32>` when encoding and
/// [`U32s`] when decoded from the ring.
#[derive(Debug, Clone, PartialEq)]
pub struct Submit<P> {
    pub request_id: u64,
    pub prompt: P,
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub seed: Option<u64>,
    pub ignore_eos: bool,
    /// Logprobs wanted: `Some(top)` with `top` alternatives per token (0 for the sampled token's alone).
    pub logprobs: Option<u32>,
    /// The prompt tokens' logprobs wanted too (the token's own, no alternatives: what DeepInfer computes).
    pub prompt_logprobs: bool,
    /// A grammar the output must follow.
    pub constraint: Option<Constraint>,
    /// The prompt's images (one placeholder token each in `prompt`).
    pub images: Option<ImageSet>,
}

/// A request's images, as the SUBMIT record names them: the file that holds their encoded bytes back to back,
/// `(width, height, bytes)` of each in placeholder order, and the prompt tokens they take beyond their placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSet {
    pub path: String,
    pub extra_tokens: u32,
    pub sizes: Vec<[u32; 3]>,
}

impl ImageSet {
    /// Remove the images' file: for a request no rank will read it for (it went nowhere).
    pub fn discard(&self) {
        let _ = std::fs::remove_file(&self.path);
    }

    fn encoded_len(&self) -> usize {
        12 + 12 * self.sizes.len() + self.path.len()
    }
}

/// A structured-output constraint, as DeepInfer's `so_args` carries it: `schema_type` (`SCHEMA_*`), the schema
/// text (JSON schema, regex or EBNF), the tokens after which it starts (`</think>` in thinking mode; empty: from
/// the first token), and the token that ends it (`bound_token_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Constraint {
    pub schema_type: u32,
    pub schema: String,
    pub triggers: Vec<u32>,
    pub bound: Option<u32>,
}

impl Constraint {
    fn encoded_len(&self) -> usize {
        CONSTRAINT_HEADER + 4 * self.triggers.len() + self.schema.len()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Abort {
    pub request_id: u64,
}

/// A decoded request-ring record.
#[derive(Debug, Clone, PartialEq)]
pub enum Request<'a> {
    Submit(Submit<U32s<'a>>),
    Abort(Abort),
    Shutdown,
    Reload(&'a str),
}

/// One entry of a TOKENS batch. `reason` is only encoded for `FINISH_ERROR`.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEntry<'a, T> {
    pub request_id: u64,
    pub finish: u32,
    pub tokens: T,
    pub reason: Option<&'a str>,
    pub logprobs: Option<Logprobs<'a>>,
    /// The prompt's logprobs (f32 little-endian, one per prompt token after the first), on a first token.
    pub prompt_logprobs: Option<&'a [u8]>,
}

/// The logprobs of an entry's tokens, as the record holds them (little-endian, any alignment): one f32 per
/// token, then `top` (token u32, logprob f32) pairs per token, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Logprobs<'a> {
    pub top: u32,
    pub values: &'a [u8],
    pub alternatives: &'a [u8],
}

/// The logprobs of a run of tokens merged across records, whose counts of alternatives may differ per token:
/// one f32 per token in `values`, `counts[i]` (token u32, logprob f32) pairs for token `i` in `alternatives`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LogprobsRun<'a> {
    pub values: &'a [u8],
    pub alternatives: &'a [u8],
    pub counts: &'a [u16],
}

impl Logprobs<'_> {
    fn encoded_len(&self) -> usize {
        self.values.len() + self.alternatives.len()
    }
}

// ------------------------------------------------------------------ writing

/// Sequential little-endian writer over a pre-sized buffer.
struct Writer<'b> {
    buf: &'b mut [u8],
    off: usize,
}

impl Writer<'_> {
    fn bytes(&mut self, b: &[u8]) {
        self.buf[self.off..self.off + b.len()].copy_from_slice(b);
        self.off += b.len();
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn u32s(&mut self, v: &[u32]) {
        let dst = &mut self.buf[self.off..self.off + 4 * v.len()];
        for (d, x) in dst.chunks_exact_mut(4).zip(v) {
            d.copy_from_slice(&x.to_le_bytes());
        }
        self.off += 4 * v.len();
    }
    fn pad8(&mut self) {
        let end = align8(self.off);
        self.buf[self.off..end].fill(0);
        self.off = end;
    }
}

impl<P: AsRef<[u32]>> Submit<P> {
    pub fn encoded_len(&self) -> usize {
        SUBMIT_HEADER
            + 4 * self.prompt.as_ref().len()
            + self.constraint.as_ref().map_or(0, Constraint::encoded_len)
            + self.images.as_ref().map_or(0, ImageSet::encoded_len)
    }

    /// Writes the payload into `buf` (exactly `encoded_len()` bytes).
    pub fn write(&self, buf: &mut [u8]) {
        let prompt = self.prompt.as_ref();
        let flag = |on: bool, f: u32| if on { f } else { 0 };
        let flags = flag(self.ignore_eos, FLAG_IGNORE_EOS)
            | flag(self.seed.is_some(), FLAG_HAS_SEED)
            | flag(self.logprobs.is_some(), FLAG_LOGPROBS)
            | flag(self.constraint.is_some(), FLAG_CONSTRAINT)
            | flag(self.images.is_some(), FLAG_IMAGES)
            | flag(self.prompt_logprobs, FLAG_PROMPT_LOGPROBS);
        let mut w = Writer { buf, off: 0 };
        w.u64(self.request_id);
        w.u32(self.max_tokens);
        w.u32(flags);
        w.bytes(&self.temperature.to_le_bytes());
        w.bytes(&self.top_p.to_le_bytes());
        w.bytes(&self.top_k.to_le_bytes());
        w.u32(self.logprobs.unwrap_or(0));
        w.u64(self.seed.unwrap_or(0));
        w.u32(prompt.len() as u32);
        w.u32(0);
        w.u32s(prompt);
        if let Some(c) = &self.constraint {
            w.u32(c.schema_type);
            w.u32(c.bound.unwrap_or(NO_BOUND));
            w.u32(c.triggers.len() as u32);
            w.u32(c.schema.len() as u32);
            w.u32s(&c.triggers);
            w.bytes(c.schema.as_bytes());
        }
        if let Some(im) = &self.images {
            w.u32(im.extra_tokens);
            w.u32(im.sizes.len() as u32);
            w.u32(im.path.len() as u32);
            for size in &im.sizes {
                w.u32s(size);
            }
            w.bytes(im.path.as_bytes());
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![0; self.encoded_len()];
        self.write(&mut v);
        v
    }
}

impl Abort {
    pub fn encode(&self) -> [u8; 8] {
        self.request_id.to_le_bytes()
    }
}

fn entry_len<T: AsRef<[u32]>>(e: &TokenEntry<'_, T>) -> usize {
    let reason = match (e.finish, e.reason) {
        (FINISH_ERROR, r) => 4 + r.map_or(0, str::len),
        _ => 0,
    };
    let prompt = e.prompt_logprobs.map_or(0, |p| 4 + p.len());
    align8(
        ENTRY_HEADER
            + 4 * e.tokens.as_ref().len()
            + e.logprobs.as_ref().map_or(0, Logprobs::encoded_len)
            + prompt
            + reason,
    )
}

/// Payload size of a TOKENS record holding `entries`.
pub fn tokens_encoded_len<T: AsRef<[u32]>>(entries: &[TokenEntry<'_, T>]) -> usize {
    TOKENS_HEADER + entries.iter().map(entry_len).sum::<usize>()
}

/// Writes a TOKENS payload into `buf` (exactly `tokens_encoded_len` bytes).
pub fn write_tokens<T: AsRef<[u32]>>(entries: &[TokenEntry<'_, T>], buf: &mut [u8]) {
    let mut w = Writer { buf, off: 0 };
    w.u32(entries.len() as u32);
    w.u32(0);
    for e in entries {
        let tokens = e.tokens.as_ref();
        w.u64(e.request_id);
        let prompt = if e.prompt_logprobs.is_some() { PROMPT_LOGPROBS } else { 0 };
        w.u32(e.finish | prompt | e.logprobs.as_ref().map_or(0, |l| (l.top + 1) << 16));
        w.u32(tokens.len() as u32);
        w.u32s(tokens);
        if let Some(l) = &e.logprobs {
            w.bytes(l.values);
            w.bytes(l.alternatives);
        }
        if let Some(p) = e.prompt_logprobs {
            w.u32((p.len() / 4) as u32);
            w.bytes(p);
        }
        if e.finish == FINISH_ERROR {
            let r = e.reason.unwrap_or("");
            w.u32(r.len() as u32);
            w.bytes(r.as_bytes());
        }
        w.pad8();
    }
}

pub fn encode_tokens<T: AsRef<[u32]>>(entries: &[TokenEntry<'_, T>]) -> Vec<u8> {
    let mut v = vec![0; tokens_encoded_len(entries)];
    write_tokens(entries, &mut v);
    v
}

/// Pushes a SUBMIT straight into the ring (blocking while full, up to `timeout`).
pub fn push_submit<P: AsRef<[u32]>>(ring: &Ring, s: &Submit<P>, timeout: Option<Duration>) -> Result<(), RingError> {
    ring.push_blocking_with(SUBMIT, s.encoded_len(), timeout, |b| s.write(b))
}

pub fn push_abort(ring: &Ring, a: Abort, timeout: Option<Duration>) -> Result<(), RingError> {
    ring.push_blocking(ABORT, &[&a.encode()], timeout)
}

pub fn push_shutdown(ring: &Ring, timeout: Option<Duration>) -> Result<(), RingError> {
    ring.push_blocking(SHUTDOWN, &[], timeout)
}

/// Pushes one TOKENS record (blocking while full, up to `timeout`).
pub fn push_tokens<T: AsRef<[u32]>>(
    ring: &Ring,
    entries: &[TokenEntry<'_, T>],
    timeout: Option<Duration>,
) -> Result<(), RingError> {
    let len = tokens_encoded_len(entries);
    ring.push_blocking_with(TOKENS, len, timeout, |b| write_tokens(entries, b))
}

/// A rank's times for one request's first token (CLOCK_MONOTONIC, µs): see the TIMING record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankStamps {
    pub request_id: u64,
    pub taken_us: u64,
    pub scheduled_us: u64,
    pub published_us: u64,
}

/// Payload size of a TIMING record of `n` requests.
pub fn timing_encoded_len(n: usize) -> usize {
    TIMING_HEADER + n * TIMING_ENTRY
}

/// Writes a TIMING payload of (request_id, taken_us, scheduled_us) entries published at `published_us`.
pub fn write_timing(published_us: u64, entries: &[(u64, u64, u64)], buf: &mut [u8]) {
    let mut w = Writer { buf, off: 0 };
    w.u32(entries.len() as u32);
    w.u32(0);
    w.u64(published_us);
    for &(id, taken, scheduled) in entries {
        w.u64(id);
        w.u64(taken);
        w.u64(scheduled);
    }
}

// ------------------------------------------------------------------ reading

/// Bounds-checked little-endian reader; every read may fail, none panics.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], RecordError> {
        if n > self.buf.len() {
            return Err(RecordError::Truncated);
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], RecordError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, RecordError> {
        self.arr().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, RecordError> {
        self.arr().map(u64::from_le_bytes)
    }
    fn u32s(&mut self, n: u32) -> Result<U32s<'a>, RecordError> {
        let bytes = (n as usize).checked_mul(4).ok_or(RecordError::Truncated)?;
        self.take(bytes).map(U32s)
    }
    fn finish(&self) -> Result<(), RecordError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(RecordError::TrailingBytes(n)),
        }
    }
}

/// Decodes a request-ring record.
pub fn decode_request(kind: u32, payload: &[u8]) -> Result<Request<'_>, RecordError> {
    let mut r = Reader { buf: payload };
    let req = match kind {
        SUBMIT => {
            let request_id = r.u64()?;
            let max_tokens = r.u32()?;
            let flags = r.u32()?;
            let temperature = f32::from_le_bytes(r.arr()?);
            let top_p = f32::from_le_bytes(r.arr()?);
            let top_k = i32::from_le_bytes(r.arr()?);
            let top_logprobs = r.u32()?;
            let seed = r.u64()?;
            let n_prompt = r.u32()?;
            let _pad = r.u32()?;
            let prompt = r.u32s(n_prompt)?;
            let constraint = if flags & FLAG_CONSTRAINT != 0 {
                let schema_type = r.u32()?;
                let bound = r.u32()?;
                let n_trigger = r.u32()?;
                let schema_len = r.u32()?;
                let triggers = r.u32s(n_trigger)?.to_vec();
                let schema = std::str::from_utf8(r.take(schema_len as usize)?).map_err(|_| RecordError::BadUtf8)?;
                Some(Constraint {
                    schema_type,
                    schema: schema.to_owned(),
                    triggers,
                    bound: (bound != NO_BOUND).then_some(bound),
                })
            } else {
                None
            };
            let images = if flags & FLAG_IMAGES != 0 {
                let extra_tokens = r.u32()?;
                let n = r.u32()?;
                let path_len = r.u32()?;
                let sizes = r.u32s(n.checked_mul(3).ok_or(RecordError::Truncated)?)?.to_vec();
                let path = std::str::from_utf8(r.take(path_len as usize)?).map_err(|_| RecordError::BadUtf8)?;
                let sizes = sizes.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect();
                Some(ImageSet { path: path.to_owned(), extra_tokens, sizes })
            } else {
                None
            };
            Request::Submit(Submit {
                request_id,
                prompt,
                max_tokens,
                temperature,
                top_p,
                top_k,
                seed: (flags & FLAG_HAS_SEED != 0).then_some(seed),
                ignore_eos: flags & FLAG_IGNORE_EOS != 0,
                logprobs: (flags & FLAG_LOGPROBS != 0).then_some(top_logprobs),
                prompt_logprobs: flags & FLAG_PROMPT_LOGPROBS != 0,
                constraint,
                images,
            })
        }
        ABORT => Request::Abort(Abort { request_id: r.u64()? }),
        SHUTDOWN => Request::Shutdown,
        RELOAD => Request::Reload(std::str::from_utf8(r.take(payload.len())?).map_err(|_| RecordError::BadUtf8)?),
        k => return Err(RecordError::UnknownKind(k)),
    };
    r.finish()?;
    Ok(req)
}

/// Starts decoding a TOKENS payload; entries are validated as iterated.
pub fn decode_tokens(payload: &[u8]) -> Result<TokenBatch<'_>, RecordError> {
    let mut r = Reader { buf: payload };
    let n = r.u32()?;
    let _pad = r.u32()?;
    // Every entry takes at least ENTRY_HEADER bytes: reject absurd counts early.
    if n as usize > r.buf.len() / ENTRY_HEADER {
        return Err(RecordError::Truncated);
    }
    Ok(TokenBatch { r, left: n })
}

/// Decodes a TIMING payload.
pub fn decode_timing(payload: &[u8]) -> Result<Vec<RankStamps>, RecordError> {
    let mut r = Reader { buf: payload };
    let n = r.u32()? as usize;
    let _pad = r.u32()?;
    let published_us = r.u64()?;
    if n > r.buf.len() / TIMING_ENTRY {
        return Err(RecordError::Truncated);
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (request_id, taken_us, scheduled_us) = (r.u64()?, r.u64()?, r.u64()?);
        out.push(RankStamps { request_id, taken_us, scheduled_us, published_us });
    }
    r.finish()?;
    Ok(out)
}

/// Iterator over the entries of one TOKENS record. Yields at most one error,
/// then stops.
pub struct TokenBatch<'a> {
    r: Reader<'a>,
    left: u32,
}

impl<'a> TokenBatch<'a> {
    /// Entries not yet yielded.
    pub fn remaining(&self) -> usize {
        self.left as usize
    }

    fn entry(&mut self) -> Result<TokenEntry<'a, U32s<'a>>, RecordError> {
        let start = self.r.buf.len();
        let request_id = self.r.u64()?;
        let word = self.r.u32()?;
        let (finish, top) = (word & 0xffff & !PROMPT_LOGPROBS, word >> 16);
        let n = self.r.u32()?;
        let tokens = self.r.u32s(n)?;
        let logprobs = match top {
            0 => None,
            t if t - 1 > MAX_TOP_LOGPROBS => return Err(RecordError::BadTop(t - 1)),
            t => {
                let values = self.r.take(4 * n as usize)?;
                let alternatives = self.r.take(8 * n as usize * (t as usize - 1))?;
                Some(Logprobs { top: t - 1, values, alternatives })
            }
        };
        let prompt_logprobs = match word & PROMPT_LOGPROBS {
            0 => None,
            _ => {
                let n = self.r.u32()?;
                Some(self.r.take((n as usize).checked_mul(4).ok_or(RecordError::Truncated)?)?)
            }
        };
        let reason = match finish {
            FINISH_NONE..FINISH_ERROR => None,
            FINISH_ERROR => {
                let len = self.r.u32()?;
                let bytes = self.r.take(len as usize)?;
                Some(std::str::from_utf8(bytes).map_err(|_| RecordError::BadUtf8)?)
            }
            f => return Err(RecordError::BadFinish(f)),
        };
        let used = start - self.r.buf.len();
        self.r.take(align8(used) - used)?;
        Ok(TokenEntry { request_id, finish, tokens, reason, logprobs, prompt_logprobs })
    }
}

impl<'a> Iterator for TokenBatch<'a> {
    type Item = Result<TokenEntry<'a, U32s<'a>>, RecordError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            // Report trailing garbage once, then stay exhausted.
            let trailing = self.r.finish().err();
            self.r.buf = &[];
            return trailing.map(Err);
        }
        match self.entry() {
            Ok(e) => {
                self.left -= 1;
                Some(Ok(e))
            }
            Err(e) => {
                self.left = 0;
                self.r.buf = &[];
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    #[test]
    fn submit_round_trip() {
        for (seed, ignore_eos, prompt) in
            [(Some(42u64), true, vec![1u32, 2, 3, u32::MAX]), (None, false, vec![]), (Some(0), false, vec![7])]
        {
            let s = Submit {
                request_id: 0xdead_beef_0123,
                prompt: prompt.as_slice(),
                max_tokens: 512,
                temperature: 0.7,
                top_p: 0.95,
                top_k: -1,
                seed,
                ignore_eos,
                logprobs: None,
                prompt_logprobs: false,
                constraint: None,
                images: None,
            };
            let bytes = s.encode();
            assert_eq!(bytes.len(), SUBMIT_HEADER + 4 * prompt.len());
            let Request::Submit(d) = decode_request(SUBMIT, &bytes).unwrap() else {
                panic!("not a submit");
            };
            assert_eq!(d.prompt.to_vec(), prompt);
            assert_eq!(
                (d.request_id, d.max_tokens, d.temperature, d.top_p, d.top_k),
                (s.request_id, s.max_tokens, s.temperature, s.top_p, s.top_k)
            );
            assert_eq!((d.seed, d.ignore_eos), (seed, ignore_eos));
        }
    }

    #[test]
    fn submit_with_logprobs_constraint_and_images_round_trip() {
        let prompt = [5u32, 6];
        let constraint = Constraint {
            schema_type: SCHEMA_JSON,
            schema: r#"{"type":"object"} ü"#.into(),
            triggers: vec![128_822],
            bound: Some(1),
        };
        let images = ImageSet {
            path: "/dev/shm/x/chatcmpl-1ü".into(),
            extra_tokens: 650,
            sizes: vec![[1036, 1036, 2006], [8, 9, 10]],
        };
        for (logprobs, constraint, images) in [
            (Some(5), Some(constraint.clone()), None),
            (Some(0), None, Some(images.clone())),
            (None, Some(constraint), Some(images)),
        ] {
            let s = Submit {
                request_id: 7,
                prompt: &prompt[..],
                max_tokens: 9,
                temperature: 1.0,
                top_p: 1.0,
                top_k: -1,
                seed: None,
                ignore_eos: false,
                logprobs,
                prompt_logprobs: false,
                constraint: constraint.clone(),
                images: images.clone(),
            };
            let bytes = s.encode();
            let Request::Submit(d) = decode_request(SUBMIT, &bytes).unwrap() else { panic!("not a submit") };
            assert_eq!((d.prompt.to_vec(), d.logprobs, d.constraint), (prompt.to_vec(), logprobs, constraint));
            assert_eq!(d.images, images);
            for cut in 0..bytes.len() {
                assert!(decode_request(SUBMIT, &bytes[..cut]).is_err(), "cut {cut}");
            }
        }
    }

    #[test]
    fn tokens_with_logprobs_round_trip() {
        let tokens = [10u32, 11];
        let values: Vec<u8> = [-0.5f32, -1.25].iter().flat_map(|x| x.to_le_bytes()).collect();
        let alternatives: Vec<u8> = [(10u32, -0.5f32), (3, -2.0), (11, -1.25), (4, -1.5)]
            .iter()
            .flat_map(|(t, l)| t.to_le_bytes().into_iter().chain(l.to_le_bytes()))
            .collect();
        let lp = Logprobs { top: 2, values: &values, alternatives: &alternatives };
        let entries = [
            TokenEntry {
                request_id: 1,
                finish: FINISH_LENGTH,
                tokens: &tokens[..],
                reason: None,
                logprobs: Some(lp),
                prompt_logprobs: None,
            },
            TokenEntry {
                request_id: 2,
                finish: FINISH_NONE,
                tokens: &tokens[..1],
                reason: None,
                logprobs: None,
                prompt_logprobs: None,
            },
        ];
        let bytes = encode_tokens(&entries);
        let got: Vec<_> = decode_tokens(&bytes).unwrap().map(Result::unwrap).collect();
        assert_eq!((got[0].finish, got[0].logprobs), (FINISH_LENGTH, Some(lp)));
        assert_eq!((got[1].finish, got[1].logprobs, got[1].tokens.to_vec()), (FINISH_NONE, None, vec![10]));
        // Without logprobs an entry is exactly as large as before they existed.
        assert_eq!(encode_tokens(&entries[1..]).len(), TOKENS_HEADER + align8(ENTRY_HEADER + 4));
        let mut bad = bytes.clone();
        bad[16..20].copy_from_slice(&(FINISH_NONE | (MAX_TOP_LOGPROBS + 2) << 16).to_le_bytes());
        assert!(matches!(decode_tokens(&bad).unwrap().next(), Some(Err(RecordError::BadTop(_)))));
    }

    #[test]
    fn prompt_logprobs_round_trip() {
        let values: Vec<u8> = [-1.5f32, -0.25, -7.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let entries = [
            TokenEntry {
                request_id: 3,
                finish: FINISH_LENGTH,
                tokens: &[9u32][..],
                reason: None,
                logprobs: Some(Logprobs { top: 0, values: &(-0.5f32).to_le_bytes(), alternatives: &[] }),
                prompt_logprobs: Some(&values),
            },
            TokenEntry {
                request_id: 4,
                finish: FINISH_ERROR,
                tokens: &[][..],
                reason: Some("x"),
                logprobs: None,
                prompt_logprobs: Some(&[]),
            },
        ];
        let bytes = encode_tokens(&entries);
        let got: Vec<_> = decode_tokens(&bytes).unwrap().map(Result::unwrap).collect();
        assert_eq!((got[0].finish, got[0].prompt_logprobs), (FINISH_LENGTH, Some(&values[..])));
        assert_eq!(got[0].logprobs.unwrap().values, &(-0.5f32).to_le_bytes());
        assert_eq!((got[1].finish, got[1].reason, got[1].prompt_logprobs), (FINISH_ERROR, Some("x"), Some(&[][..])));
        let s = Submit {
            request_id: 1,
            prompt: &[1u32, 2][..],
            max_tokens: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            seed: None,
            ignore_eos: false,
            logprobs: Some(1),
            prompt_logprobs: true,
            constraint: None,
            images: None,
        };
        match decode_request(SUBMIT, &s.encode()).unwrap() {
            Request::Submit(d) => assert!(d.prompt_logprobs && d.logprobs == Some(1)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn abort_shutdown_round_trip() {
        let a = Abort { request_id: 99 };
        assert_eq!(decode_request(ABORT, &a.encode()), Ok(Request::Abort(a)));
        assert_eq!(decode_request(SHUTDOWN, &[]), Ok(Request::Shutdown));
        assert_eq!(decode_request(RELOAD, b"/ckpt/v2"), Ok(Request::Reload("/ckpt/v2")));
        assert_eq!(decode_request(RELOAD, &[0xff]), Err(RecordError::BadUtf8));
        assert_eq!(decode_request(SHUTDOWN, &[0]), Err(RecordError::TrailingBytes(1)));
        assert_eq!(decode_request(ABORT, &[0; 4]), Err(RecordError::Truncated));
        assert_eq!(decode_request(77, &[]), Err(RecordError::UnknownKind(77)));
    }

    #[test]
    fn tokens_round_trip() {
        let t1 = [1u32, 2, 3];
        let t2: [u32; 0] = [];
        let entries = [
            TokenEntry {
                request_id: 1,
                finish: FINISH_NONE,
                tokens: &t1[..],
                reason: None,
                logprobs: None,
                prompt_logprobs: None,
            },
            TokenEntry {
                request_id: 2,
                finish: FINISH_STOP,
                tokens: &t2[..],
                reason: None,
                logprobs: None,
                prompt_logprobs: None,
            },
            TokenEntry {
                request_id: 3,
                finish: FINISH_ERROR,
                tokens: &t1[..1],
                reason: Some("boom ü"),
                logprobs: None,
                prompt_logprobs: None,
            },
            TokenEntry {
                request_id: 4,
                finish: FINISH_ERROR,
                tokens: &t2[..],
                reason: None,
                logprobs: None,
                prompt_logprobs: None,
            },
            // A reason on a non-error entry is not encoded.
            TokenEntry {
                request_id: 5,
                finish: FINISH_LENGTH,
                tokens: &t1[..2],
                reason: Some("x"),
                logprobs: None,
                prompt_logprobs: None,
            },
        ];
        let bytes = encode_tokens(&entries);
        assert_eq!(bytes.len() % 8, 0);
        let got: Vec<_> = decode_tokens(&bytes)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.request_id, e.finish, e.tokens.to_vec(), e.reason.map(str::to_owned))
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (1, FINISH_NONE, vec![1, 2, 3], None),
                (2, FINISH_STOP, vec![], None),
                (3, FINISH_ERROR, vec![1], Some("boom ü".to_owned())),
                (4, FINISH_ERROR, vec![], Some(String::new())),
                (5, FINISH_LENGTH, vec![1, 2], None),
            ]
        );
        // Empty batch.
        let empty: [TokenEntry<'_, &[u32]>; 0] = [];
        assert_eq!(decode_tokens(&encode_tokens(&empty)).unwrap().count(), 0);
    }

    #[test]
    fn malformed_tokens_are_errors() {
        let t = [5u32; 3];
        let e = [TokenEntry {
            request_id: 1,
            finish: FINISH_NONE,
            tokens: &t[..],
            reason: None,
            logprobs: None,
            prompt_logprobs: None,
        }];
        let bytes = encode_tokens(&e);
        for cut in 0..bytes.len() {
            let r = decode_tokens(&bytes[..cut]).map(|b| b.collect::<Result<Vec<_>, _>>());
            assert!(matches!(r, Err(_) | Ok(Err(_))), "cut {cut}");
        }
        let mut trailing = bytes.clone();
        trailing.extend_from_slice(&[0; 8]);
        let r: Result<Vec<_>, _> = decode_tokens(&trailing).unwrap().collect();
        assert_eq!(r, Err(RecordError::TrailingBytes(8)));
        let mut bad = bytes.clone();
        bad[16..20].copy_from_slice(&9u32.to_le_bytes());
        let r: Result<Vec<_>, _> = decode_tokens(&bad).unwrap().collect();
        assert_eq!(r, Err(RecordError::BadFinish(9)));
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut s = 0x1234_5678_9abc_def1u64;
        let mut buf = Vec::new();
        for _ in 0..200_000 {
            let len = (xorshift(&mut s) % 96) as usize;
            buf.clear();
            for _ in 0..len {
                let b = xorshift(&mut s) as u8;
                // Bias towards small numbers so length fields are often plausible.
                buf.push(if b & 0x80 != 0 { b & 0x7 } else { b });
            }
            let kind = (xorshift(&mut s) % 5) as u32;
            let _ = decode_request(kind, &buf);
            if let Ok(batch) = decode_tokens(&buf) {
                for e in batch.flatten() {
                    let _ = e.tokens.to_vec();
                }
            }
        }
    }

    #[test]
    fn timing_round_trips_and_rejects_bad_lengths() {
        let entries = [(7, 100, 250), (9, 101, 260)];
        let mut buf = vec![0; timing_encoded_len(entries.len())];
        write_timing(300, &entries, &mut buf);
        let got = decode_timing(&buf).unwrap();
        assert_eq!(
            got,
            vec![
                RankStamps { request_id: 7, taken_us: 100, scheduled_us: 250, published_us: 300 },
                RankStamps { request_id: 9, taken_us: 101, scheduled_us: 260, published_us: 300 },
            ]
        );
        assert_eq!(decode_timing(&buf[..buf.len() - 1]), Err(RecordError::Truncated));
        let mut long = buf.clone();
        long.extend_from_slice(&[0; 8]);
        assert_eq!(decode_timing(&long), Err(RecordError::TrailingBytes(8)));
        let mut huge = buf;
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_timing(&huge), Err(RecordError::Truncated));
    }
}

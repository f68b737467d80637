//! A Responses `Response` object as OpenAI's published schema has it, mended as text: deepseek-recipe writes
//! members the schema does not declare (`store`, `moderation` ...) and nulls where the schema has none (`user`,
//! `usage` ...). The Responses door's lifecycle events (`response.created`, `response.in_progress`,
//! `response.completed` ...) carry the whole Response, its output text included, so a JSON round trip of each in
//! Python was most of a Responses request's cost beyond chat's; this cuts the members out of the library's own
//! text in one pass. python/deepinfer_server/event_output.py (`_mend`) has the same rules on parsed JSON, and
//! takes over where this declines (a function call's `arguments`, which may end in a partial DSML tag).

use pyo3::prelude::*;

/// Members of the Response removed whatever their value.
const UNDECLARED: &[&[u8]] = &[b"content_filters", b"frequency_penalty", b"moderation", b"presence_penalty", b"store"];
/// Members of the Response removed when null.
const NOT_NULL: &[&[u8]] = &[b"user", b"safety_identifier", b"prompt_cache_key", b"usage"];

/// `json` (a Responses stream event that holds a Response under `response` when `nested`, else a Response) with
/// the members cut, or None: it has a function call's `arguments` (left to the Python path), or is not JSON.
#[pyfunction]
pub fn mend_response(json: &str, nested: bool) -> Option<String> {
    let mut scan = Scan { b: json.as_bytes(), cuts: Vec::new(), path: Vec::new(), target: usize::from(nested) };
    let end = scan.value(scan.ws(0))?;
    if scan.ws(end) != scan.b.len() {
        return None;
    }
    if scan.cuts.is_empty() {
        return Some(json.to_owned());
    }
    let mut out = String::with_capacity(json.len());
    let mut at = 0;
    for (from, to) in scan.cuts {
        out.push_str(&json[at..from]); // cuts are at ASCII bytes (quotes, commas, literals): char boundaries
        at = to;
    }
    out.push_str(&json[at..]);
    Some(out)
}

struct Scan<'a> {
    b: &'a [u8],
    /// Byte ranges to leave out, in order and disjoint.
    cuts: Vec<(usize, usize)>,
    /// The keys down to the current value (None for an array element).
    path: Vec<Option<&'a [u8]>>,
    /// How deep the Response is: 1 inside an event's `response`, 0 at the top.
    target: usize,
}

impl<'a> Scan<'a> {
    fn ws(&self, mut i: usize) -> usize {
        while i < self.b.len() && matches!(self.b[i], b' ' | b'\t' | b'\n' | b'\r') {
            i += 1;
        }
        i
    }

    /// The end of the value that starts at `i`.
    fn value(&mut self, i: usize) -> Option<usize> {
        match *self.b.get(i)? {
            b'{' => self.object(i),
            b'[' => self.array(i),
            b'"' => self.string(i),
            _ => {
                let n = self.b[i..].iter().position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t'));
                let end = i + n.unwrap_or(self.b.len() - i);
                (end > i).then_some(end)
            }
        }
    }

    fn string(&self, i: usize) -> Option<usize> {
        let mut j = i + 1;
        loop {
            match *self.b.get(j)? {
                b'"' => return Some(j + 1),
                b'\\' => j += 2,
                _ => j += 1,
            }
        }
    }

    fn array(&mut self, i: usize) -> Option<usize> {
        let mut j = self.ws(i + 1);
        if *self.b.get(j)? == b']' {
            return Some(j + 1);
        }
        self.path.push(None);
        loop {
            let end = self.value(j)?;
            j = self.ws(end);
            match *self.b.get(j)? {
                b',' => j = self.ws(j + 1),
                b']' => break,
                _ => return None,
            }
        }
        self.path.pop();
        Some(j + 1)
    }

    fn object(&mut self, i: usize) -> Option<usize> {
        let mut j = self.ws(i + 1);
        if *self.b.get(j)? == b'}' {
            return Some(j + 1);
        }
        let mut kept = false; // a member of this object was kept before the current one
        let mut comma = 0; // where the comma before the current member is
        loop {
            let start = j;
            if *self.b.get(j)? != b'"' {
                return None;
            }
            let key_end = self.string(j)?;
            let key = &self.b[j + 1..key_end - 1];
            j = self.ws(key_end);
            if *self.b.get(j)? != b':' {
                return None;
            }
            let value_start = self.ws(j + 1);
            if key == b"arguments" {
                return None;
            }
            self.path.push(Some(key));
            let value_end = self.value(value_start)?;
            let cut = self.cut(&self.b[value_start..value_end]);
            self.path.pop();
            j = self.ws(value_end);
            let next = *self.b.get(j)?;
            if cut {
                // Take the comma before it if a kept member precedes it, else the one after it (if any): the cuts
                // stay disjoint and the commas that remain separate the members that remain.
                match (kept, next) {
                    (true, _) => self.cuts.push((comma, value_end)),
                    (false, b',') => self.cuts.push((start, self.ws(j + 1))),
                    (false, _) => self.cuts.push((start, value_end)),
                }
            } else {
                kept = true;
            }
            match next {
                b',' => {
                    comma = j;
                    j = self.ws(j + 1);
                }
                b'}' => return Some(j + 1),
                _ => return None,
            }
        }
    }

    /// Whether the member just entered (its key last in `path`) is left out, given its value's text.
    fn cut(&self, value: &[u8]) -> bool {
        let t = self.target;
        let p = &self.path;
        if p.len() < t + 1 || (t == 1 && p[0] != Some(b"response".as_slice())) {
            return false;
        }
        let Some(key) = p[t] else { return false };
        let rest = &p[t + 1..];
        match rest {
            [] => UNDECLARED.contains(&key) || (value == b"null" && NOT_NULL.contains(&key)),
            // echoed from a json_schema format; OpenAI's schema has it a string when present
            [Some(b"format"), Some(b"description")] => key == b"text" && value == b"null",
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_the_responses_members_only() {
        let event = r#"{"type":"response.created","response":{"id":"r","content_filters":null,"error":null,"frequency_penalty":0.0,"instructions":"\"store\":false,","output":[{"type":"message","content":[{"text":"a\"b","usage":null}]}],"store":false,"text":{"format":{"type":"json_schema","description":null,"schema":{"user":null}}},"tools":[{"description":null}],"usage":null,"user":null,"metadata":{"store":"x","user":null}},"sequence_number":0}"#;
        let want = r#"{"type":"response.created","response":{"id":"r","error":null,"instructions":"\"store\":false,","output":[{"type":"message","content":[{"text":"a\"b","usage":null}]}],"text":{"format":{"type":"json_schema","schema":{"user":null}}},"tools":[{"description":null}],"metadata":{"store":"x","user":null}},"sequence_number":0}"#;
        assert_eq!(mend_response(event, true).as_deref(), Some(want));
        assert_eq!(
            mend_response(r#"{"user":"u","usage":{"a":1}}"#, false).as_deref(),
            Some(r#"{"user":"u","usage":{"a":1}}"#)
        );
    }

    #[test]
    fn commas_stay_right_wherever_the_cuts_are() {
        for (from, to) in [
            (r#"{"store":1,"a":2}"#, r#"{"a":2}"#),
            (r#"{"a":2,"store":1}"#, r#"{"a":2}"#),
            (r#"{"store":1,"user":null}"#, r#"{}"#),
            (r#"{"store":1,"a":2,"user":null,"moderation":{"x":[1]}}"#, r#"{"a":2}"#),
            (r#"{"a":2,"store":1,"b":3,"user":null}"#, r#"{"a":2,"b":3}"#),
            (r#"{ "a" : 2 , "store" : [ ] }"#, r#"{ "a" : 2  }"#),
        ] {
            assert_eq!(mend_response(from, false).as_deref(), Some(to), "{from}");
        }
    }

    #[test]
    fn declines_function_call_arguments_and_bad_json() {
        assert_eq!(mend_response(r#"{"output":[{"arguments":"{\"a\":1}</"}]}"#, false), None);
        for bad in [r#"{"a":1"#, r#"{"a" 1}"#, r#"{"a":1}x"#, r#"["#, ""] {
            assert_eq!(mend_response(bad, false), None, "{bad}");
        }
    }
}

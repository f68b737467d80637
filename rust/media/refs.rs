//! Where each door's request body carries images. Shapes are only read here: a malformed part is left for the
//! codec (deepseek-recipe) to refuse with its own message.

use crate::protocol::Protocol;
use serde_json::Value;

/// One image of a request, in request order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// The field holding it, e.g. `messages[0].content[1].image_url.url`.
    pub param: String,
    pub source: Source,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A URL to fetch or refuse (http, https, file, or a scheme the fetcher refuses).
    Url(String),
    /// Bytes inside the request (a data: URL, an Anthropic base64 block): their approximate decoded size. The
    /// payload is not copied.
    Inline { bytes: usize },
}

impl ImageRef {
    /// The URL to fetch, `None` for an inline image.
    pub fn url(&self) -> Option<&str> {
        match &self.source {
            Source::Url(u) => Some(u),
            Source::Inline { .. } => None,
        }
    }
}

/// Decoded size of base64 text: 3 bytes per 4 characters, less the `=` padding (whitespace, which decoders
/// skip, is counted: an upper bound, never under).
fn base64_len(text: &str) -> usize {
    let data = text.trim_end_matches('=');
    data.len() / 4 * 3 + (data.len() % 4 * 3) / 4
}

/// A data: URL is inline (base64: decoded size; otherwise its percent-encoded length, an upper bound);
/// anything else is a URL.
fn source_of(url: &str) -> Source {
    let is_data = url.get(..5).is_some_and(|s| s.eq_ignore_ascii_case("data:"));
    if !is_data {
        return Source::Url(url.to_string());
    }
    let bytes = match url.split_once(',') {
        Some((head, data)) if head.to_ascii_lowercase().ends_with(";base64") => base64_len(data),
        Some((_, data)) => data.len(),
        None => url.len(),
    };
    Source::Inline { bytes }
}

fn items<'a>(v: &'a Value, key: &str) -> impl Iterator<Item = (usize, &'a Value)> {
    v.get(key).and_then(Value::as_array).into_iter().flatten().enumerate()
}

fn kind(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("")
}

/// Every image in `body`, data URLs included, in request order.
pub fn image_refs(protocol: Protocol, body: &Value) -> Vec<ImageRef> {
    let mut out = Vec::new();
    match protocol {
        Protocol::Chat => {
            for (i, msg) in items(body, "messages") {
                for (j, part) in items(msg, "content").filter(|(_, p)| kind(p) == "image_url") {
                    // `{"url", "detail"}`, or leniently the URL itself.
                    let (url, field) = match part.get("image_url") {
                        Some(Value::String(u)) => (Some(u.as_str()), "image_url"),
                        Some(obj) => (obj.get("url").and_then(Value::as_str), "image_url.url"),
                        None => (None, ""),
                    };
                    if let Some(url) = url {
                        out.push(ImageRef {
                            param: format!("messages[{i}].content[{j}].{field}"),
                            source: source_of(url),
                        });
                    }
                }
            }
        }
        Protocol::Messages => {
            for (i, msg) in items(body, "messages") {
                for (j, block) in items(msg, "content") {
                    let at = format!("messages[{i}].content[{j}]");
                    match kind(block) {
                        "image" => anthropic_image(&mut out, &at, block),
                        "tool_result" => {
                            for (k, inner) in items(block, "content").filter(|(_, b)| kind(b) == "image") {
                                anthropic_image(&mut out, &format!("{at}.content[{k}]"), inner);
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        Protocol::Responses => {
            // Message items' `content`, and a function call's `output` given as a list of parts.
            for (i, item) in items(body, "input") {
                for key in ["content", "output"] {
                    for (j, part) in items(item, key).filter(|(_, p)| kind(p) == "input_image") {
                        // `file_id` images name an uploaded file: not this fetcher's.
                        if let Some(url) = part.get("image_url").and_then(Value::as_str) {
                            out.push(ImageRef {
                                param: format!("input[{i}].{key}[{j}].image_url"),
                                source: source_of(url),
                            });
                        }
                    }
                }
            }
        }
        Protocol::Completions => {}
    }
    out
}

/// An Anthropic `image` block at `at`: `source` `{type: "url", url}` or `{type: "base64", media_type, data}`.
fn anthropic_image(out: &mut Vec<ImageRef>, at: &str, block: &Value) {
    let Some(source) = block.get("source") else { return };
    let field = |key: &str| source.get(key).and_then(Value::as_str);
    match (kind(source), field("url"), field("data")) {
        ("url", Some(url), _) => out.push(ImageRef { param: format!("{at}.source.url"), source: source_of(url) }),
        ("base64", _, Some(data)) => out
            .push(ImageRef { param: format!("{at}.source.data"), source: Source::Inline { bytes: base64_len(data) } }),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn url(param: &str, u: &str) -> ImageRef {
        ImageRef { param: param.into(), source: Source::Url(u.into()) }
    }

    fn inline(param: &str, bytes: usize) -> ImageRef {
        ImageRef { param: param.into(), source: Source::Inline { bytes } }
    }

    #[test]
    fn chat_parts() {
        let body = json!({"messages": [
            {"role": "system", "content": "hi"},
            {"role": "user", "content": [
                {"type": "text", "text": "what"},
                {"type": "image_url", "image_url": {"url": "https://a.example/x.png", "detail": "low"}},
                {"type": "image_url", "image_url": "http://b.example/y.jpg"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAABBBB"}},
                {"type": "image_url", "image_url": {"url": "DATA:text/plain,hello%20x"}},
                {"type": "image_url", "image_url": {"detail": "auto"}},
                {"type": "input_audio"},
            ]},
        ]});
        assert_eq!(
            image_refs(Protocol::Chat, &body),
            [
                url("messages[1].content[1].image_url.url", "https://a.example/x.png"),
                url("messages[1].content[2].image_url", "http://b.example/y.jpg"),
                inline("messages[1].content[3].image_url.url", 6),
                inline("messages[1].content[4].image_url.url", 9),
            ]
        );
        assert!(image_refs(Protocol::Completions, &json!({"prompt": "image"})).is_empty());
        assert!(image_refs(Protocol::Chat, &json!({"messages": "x"})).is_empty());
    }

    #[test]
    fn messages_blocks_and_tool_results() {
        let body = json!({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://a.example/x.png"}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}},
            {"type": "image", "source": {"type": "file", "file_id": "file_1"}},
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "text", "text": "see"},
                {"type": "image", "source": {"type": "url", "url": "http://c.example/z.png"}},
            ]},
            {"type": "tool_result", "tool_use_id": "u", "content": "plain"},
        ]}]});
        assert_eq!(
            image_refs(Protocol::Messages, &body),
            [
                url("messages[0].content[0].source.url", "https://a.example/x.png"),
                inline("messages[0].content[1].source.data", 3),
                url("messages[0].content[3].content[1].source.url", "http://c.example/z.png"),
            ]
        );
    }

    #[test]
    fn responses_input_images() {
        let body = json!({"input": [
            {"role": "user", "content": [
                {"type": "input_text", "text": "what"},
                {"type": "input_image", "image_url": "https://a.example/x.png", "detail": "high"},
                {"type": "input_image", "file_id": "file_1"},
                {"type": "input_image", "image_url": "data:image/jpeg;base64,QUJDRA=="},
            ]},
            {"type": "function_call_output", "call_id": "c", "output": [
                {"type": "input_image", "image_url": "https://b.example/y.png"},
            ]},
            {"type": "function_call_output", "call_id": "d", "output": "text"},
        ]});
        assert_eq!(
            image_refs(Protocol::Responses, &body),
            [
                url("input[0].content[1].image_url", "https://a.example/x.png"),
                inline("input[0].content[3].image_url", 4),
                url("input[1].output[0].image_url", "https://b.example/y.png"),
            ]
        );
        assert!(image_refs(Protocol::Responses, &json!({"input": "an image"})).is_empty());
    }
}

//! A request's images as its door finds them (each door's walk is in its module, `crate::doors`): the field that
//! holds each, and whether it is a URL to fetch or bytes inside the request.

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
    /// The image a URL at `param` names (a data: URL is inline).
    pub fn from_url(param: String, url: &str) -> Self {
        ImageRef { param, source: source_of(url) }
    }

    /// Base64 bytes inside the request (an Anthropic base64 block) at `param`.
    pub fn base64(param: String, data: &str) -> Self {
        ImageRef { param, source: Source::Inline { bytes: base64_len(data) } }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_urls_are_inline_and_sized() {
        let at = |u: &str| ImageRef::from_url("p".into(), u).source;
        assert_eq!(at("https://a.example/x.png"), Source::Url("https://a.example/x.png".into()));
        assert_eq!(at("data:image/png;base64,AAAABBBB"), Source::Inline { bytes: 6 });
        assert_eq!(at("DATA:text/plain,hello%20x"), Source::Inline { bytes: 9 });
        assert_eq!(ImageRef::base64("p".into(), "QUJDRA==").source, Source::Inline { bytes: 4 });
    }
}

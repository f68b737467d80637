//! How much JSON a body may make once parsed: at most so many values (`--max-json-elements`) nested at most so deep
//! (`--max-json-depth`), unknown keys included, decided in one streaming pass over the bytes before anything is
//! built from them.
//!
//! Why: a body within `--max-request-body-bytes` can still be 8 million two-byte values (`[0,0,...]`), which
//! serde_json materialises as 8 million 32-byte `Value`s and the codec again as Python objects: a 15.6 MiB body
//! cost 400 MB and seconds of CPU, for a key no door even reads. The pass builds nothing (strings are borrowed or
//! unescaped into the parser's one scratch buffer) and stops at the first value past the bound; a plain request
//! pays a few microseconds. A body that is not JSON passes here: its door's own parse says why, in its own words.

use crate::error::ApiError;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::cell::Cell;
use std::fmt;

/// Most elements (values, at any depth) and deepest nesting one JSON document may have.
#[derive(Debug, Clone, Copy)]
pub struct JsonBounds {
    pub elements: usize,
    pub depth: usize,
}

/// Which bound a document passed.
#[derive(Debug, PartialEq, Eq)]
pub enum Exceeded {
    Elements(usize),
    Depth(usize),
}

impl Exceeded {
    /// A request body past a bound: 413 for too many values (the body is too large, in values rather than bytes:
    /// the same refusal a longer body gets), 400 for too deep (a shape no client sends, as serde_json's own
    /// limit of 128 levels already is).
    pub fn refusal(&self) -> ApiError {
        match self {
            Exceeded::Elements(n) => ApiError::TooManyJsonElements(*n),
            Exceeded::Depth(n) => {
                ApiError::bad_request(format!("The request body's JSON is nested deeper than {n} levels."))
            }
        }
    }
}

/// Whether `raw` stays within `bounds`; a syntax error is not this check's to report (Ok).
pub fn check(raw: &[u8], bounds: JsonBounds) -> Result<(), Exceeded> {
    let walk = Walk { left: &Cell::new(bounds.elements), hit: &Cell::new(None), depth: 0, bounds };
    let mut de = serde_json::Deserializer::from_slice(raw);
    match walk.deserialize(&mut de) {
        Ok(()) => Ok(()),
        Err(_) => walk.hit.take().map_or(Ok(()), Err),
    }
}

/// One value and what is under it, counted against what is left.
#[derive(Clone, Copy)]
struct Walk<'a> {
    left: &'a Cell<usize>,
    hit: &'a Cell<Option<Exceeded>>,
    depth: usize,
    bounds: JsonBounds,
}

impl<'a> Walk<'a> {
    fn fail<E: serde::de::Error>(&self, why: Exceeded) -> E {
        self.hit.set(Some(why));
        E::custom("past a bound")
    }

    /// The walk one level down, or the depth refusal.
    fn enter<E: serde::de::Error>(self) -> Result<Walk<'a>, E> {
        if self.depth >= self.bounds.depth {
            return Err(self.fail(Exceeded::Depth(self.bounds.depth)));
        }
        Ok(Walk { depth: self.depth + 1, ..self })
    }
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        match self.left.get().checked_sub(1) {
            Some(left) => self.left.set(left),
            None => return Err(self.fail(Exceeded::Elements(self.bounds.elements))),
        }
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let inner = self.enter()?;
        while seq.next_element_seed(inner)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let inner = self.enter()?;
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(inner)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: JsonBounds = JsonBounds { elements: 10, depth: 3 };

    #[test]
    fn values_and_depth_are_counted_unknown_keys_included() {
        assert_eq!(check(br#"{"a": [1, 2, {"b": "c"}], "x": null}"#, B), Ok(())); // 7 values, depth 3
        assert_eq!(check(br#"{"junk": [0,0,0,0,0,0,0,0,0,0]}"#, B), Err(Exceeded::Elements(10)));
        assert_eq!(check(br#"[[[[1]]]]"#, B), Err(Exceeded::Depth(3)));
        assert_eq!(check(br#"[[["deep enough"]]]"#, B), Ok(()));
    }

    #[test]
    fn what_is_not_json_is_left_to_the_door() {
        assert_eq!(check(b"{\"a\": [1, 2", B), Ok(()));
        assert_eq!(check(b"not json", B), Ok(()));
        assert_eq!(check(b"\"an \\u00e9scaped string\"", B), Ok(()));
    }
}

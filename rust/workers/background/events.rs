//! A background run's kept stream (`workers::background::runs`): its whole SSE events, the latest `window` bytes of them.

use bytes::Bytes;
use std::collections::VecDeque;

/// What a kept event costs beside its text, counted with it: its slot in the queue and its allocation's own.
pub(super) const EVENT_COST: usize = 64;

/// Whole SSE events in order, each with its `sequence_number`: the latest `window` bytes of them (each counted with
/// `EVENT_COST`).
#[derive(Default)]
pub(super) struct Events {
    pub(super) kept: VecDeque<(u64, Bytes)>,
    /// How many went before the first kept.
    pub(super) dropped: usize,
    pub(super) bytes: usize,
    pub(super) window: usize,
    /// The latest whole-Response event (`response.created` or `.in_progress`), kept whatever the window drops.
    pub(super) latest: Option<Bytes>,
}

impl Events {
    pub(super) fn push(&mut self, seq: u64, event: Bytes) {
        if event.starts_with(b"event: response.in_progress\n") || event.starts_with(b"event: response.created\n") {
            self.latest = Some(event.clone());
        }
        self.bytes += event.len() + EVENT_COST;
        self.kept.push_back((seq, event));
        while self.bytes > self.window && self.kept.len() > 1 {
            let (_, gone) = self.kept.pop_front().expect("more than one");
            self.bytes -= gone.len() + EVENT_COST;
            self.dropped += 1;
        }
    }
}

/// An event's `"sequence_number":N`.
pub(super) fn sequence_number(event: &[u8]) -> Option<u64> {
    const KEY: &[u8] = br#""sequence_number":"#;
    let at = memchr::memmem::rfind(event, KEY)? + KEY.len();
    let digits = event[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&event[at..at + digits]).ok()?.parse().ok()
}

//! On-disk / in-memory layout of the ring header.
//!
//! The header sits at offset 0 of the mapping and the data area starts at
//! [`HEADER_SIZE`]. Fields written by different sides live on separate
//! 64-byte cache lines so the producer and consumer do not false-share.
//! Every field is an atomic: the peer process may touch the header at any
//! time, so plain loads/stores would be data races.

use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicU32, AtomicU64};

/// "DIRING01" little-endian; written last at creation so a half-initialised
/// file is never accepted by `Ring::open`.
pub const MAGIC: u64 = u64::from_le_bytes(*b"DIRING01");
/// Bumped on any incompatible change of the header or record format.
pub const VERSION: u32 = 2;
/// Data area offset; one page so the data area is page aligned.
pub const HEADER_SIZE: usize = 4096;
/// Smallest allowed capacity (bytes of the data area).
pub const MIN_CAPACITY: u64 = 4096;
/// Largest allowed capacity; keeps every size computation far from overflow.
pub const MAX_CAPACITY: u64 = 1 << 40;
/// Number of application status words in the header.
pub const AUX_WORDS: usize = 16;

/// Size of a record header: `len: u32, kind: u32`.
pub const RECORD_HEADER: usize = 8;
/// Records are padded to this alignment.
pub const RECORD_ALIGN: usize = 8;
/// Reserved kind of filler records written before a wrap-around.
pub const KIND_PAD: u32 = u32::MAX;

/// Pads `n` up to the next multiple of [`RECORD_ALIGN`] (saturating on overflow).
pub const fn align8(n: usize) -> usize {
    match n.checked_add(RECORD_ALIGN - 1) {
        Some(v) => v & !(RECORD_ALIGN - 1),
        None => usize::MAX & !(RECORD_ALIGN - 1),
    }
}

/// One cache line: keeps a contended field away from its neighbours.
#[repr(C, align(64))]
pub struct Line<T>(pub T);

/// An eventcount: `seq` is the futex word, `waiting` counts sleepers so the
/// other side only pays for a syscall when somebody is actually asleep.
#[repr(C)]
pub struct Signal {
    pub seq: AtomicU32,
    pub waiting: AtomicU32,
}

#[repr(C)]
pub struct Header {
    /// Read-mostly line: identity, geometry and the closed flag.
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub header_size: AtomicU32,
    pub capacity: AtomicU64,
    pub closed: AtomicU32,
    /// Total bytes published (producer-owned).
    pub head: Line<AtomicU64>,
    /// Total bytes consumed (consumer-owned).
    pub tail: Line<AtomicU64>,
    /// "Data available": waited on by the consumer.
    pub data: Line<Signal>,
    /// "Space available": waited on by the producer.
    pub space: Line<Signal>,
    /// Application status words (rank state, heartbeat, ...); not interpreted here.
    pub aux: Line<[AtomicU64; AUX_WORDS]>,
}

// The layout is shared between processes (and possibly builds): pin it down.
const _: () = {
    assert!(size_of::<Header>() <= HEADER_SIZE);
    assert!(size_of::<Header>() == 5 * 64 + AUX_WORDS * 8);
    assert!(offset_of!(Header, magic) == 0);
    assert!(offset_of!(Header, version) == 8);
    assert!(offset_of!(Header, header_size) == 12);
    assert!(offset_of!(Header, capacity) == 16);
    assert!(offset_of!(Header, closed) == 24);
    assert!(offset_of!(Header, head) == 64);
    assert!(offset_of!(Header, tail) == 128);
    assert!(offset_of!(Header, data) == 192);
    assert!(offset_of!(Header, space) == 256);
    assert!(offset_of!(Header, aux) == 320);
    assert!(HEADER_SIZE.is_multiple_of(RECORD_ALIGN));
};

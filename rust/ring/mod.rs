//! Shared-memory SPSC rings between the HTTP server and the engine ranks.
//!
//! Each engine rank has two rings, both files in `/dev/shm` mapped
//! `MAP_SHARED` by the server and the rank process:
//! - a request ring (server -> rank): `SUBMIT`, `ABORT`, `SHUTDOWN` records;
//! - an output ring (rank -> server): `TOKENS` records (batches of entries).
//!
//! Layers: [`layout`] (header format), [`futex`] (sleep/wake across
//! processes), [`shm`] ([`Ring`]: records of bytes), [`records`] (the one
//! definition of the record contract), [`sender`] (never-blocking
//! multi-threaded producer for the async server), [`doorbell`] (wakes an
//! idle lockstep group) and [`py`] (bindings used by the Python ranks and
//! tests).

pub mod doorbell;
pub mod futex;
pub mod layout;
pub mod lockstep;
pub mod page;
pub mod py;
pub mod records;
pub mod sender;
pub mod shm;
pub mod status;

pub use doorbell::Doorbell;
pub use records::RecordError;
pub use sender::Sender;
pub use shm::Ring;

/// Errors of ring operations.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RingError {
    #[error("ring is closed")]
    Closed,
    #[error("record of {len} payload bytes exceeds the ring limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("timed out waiting for ring space")]
    Timeout,
    #[error("record kind u32::MAX is reserved for padding")]
    ReservedKind,
    #[error("ring corrupted: {0}")]
    Corrupt(&'static str),
}

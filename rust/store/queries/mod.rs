//! The store's SQL, one module per kind of record; each adds its methods to `Db`.

mod background;
pub mod batches;
pub mod conversations;
mod files;
mod responses;

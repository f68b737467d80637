//! Work that runs without a client waiting on it, below HTTP: batches (`/v1/batches`, Anthropic's message
//! batches) and background responses. Each asks the request path (`crate::path`) for its answers and uses them
//! directly; its routes live in `crate::http`. Each holds a claim in the store while it runs, so one replica runs
//! it, another takes it over if that one dies, and a drain hands it over.

pub mod background;
pub mod batches;

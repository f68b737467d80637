//! DeepInfer-server's native core: the HTTP front end and the shared-memory rings.
//!
//! Request path: http → door → path (admission → codec → dispatch) → ring → rank → ring → rank_io → stream →
//! SSE; `workers` (batches, background responses) ask `path` for answers without HTTP; `trace` turns what a
//! request noted on the way into OpenTelemetry spans when it ends.

pub mod admission;
pub mod client_io;
pub mod codec;
pub mod config;
pub mod console;
pub mod dispatch;
pub mod doors;
pub mod edge;
pub mod error;
pub mod fatal;
pub mod http;
pub mod ids;
pub mod json_bounds;
pub mod limits;
pub mod media;
pub mod mend;
pub mod metrics;
pub mod owner;
pub mod path;
pub mod pulse;
pub mod py_record;
pub mod rank_io;
pub mod ring;
pub mod server;
pub mod store;
pub mod stream;
pub mod supervisor;
pub mod timing;
pub mod trace;
pub mod ttft;
pub mod watchdog;
pub mod workers;

use pyo3::prelude::*;

/// The front end's buffers are allocated on one thread (rank output) and freed on another (HTTP writes);
/// glibc malloc handles that producer/consumer pattern poorly (its arenas lock and consolidate), mimalloc well.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The Python extension module `deepinfer_server._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    ring::py::register(m)?;
    codec::seam::register(m)?;
    limits::register(m)?;
    timing::register(m)?;
    m.add_class::<limits::Limits>()?;
    m.add_class::<config::ServerConfig>()?;
    m.add_class::<config::CorsConfig>()?;
    m.add_class::<config::StateConfig>()?;
    m.add_class::<config::MediaConfig>()?;
    m.add_class::<config::EngineConfig>()?;
    m.add_class::<edge::EdgeConfig>()?;
    m.add_class::<edge::tls::TlsFiles>()?;
    m.add_function(wrap_pyfunction!(server::serve, m)?)?;
    m.add_function(wrap_pyfunction!(mend::mend_response, m)?)?;
    m.add_function(wrap_pyfunction!(edge::tls::check_tls, m)?)?;
    Ok(())
}

//! A panic in any thread of the server ends the process (issue 39): a dead output thread or codec thread behind a
//! live socket would leave /health at 200 and every later request waiting for ever.
//!
//! The hook marks the server fatal at once (so /health and every door answer 503 from then on), and hands the rest
//! to a thread of its own: end every request in flight with a 503 (an error event on a stream), stop the ranks'
//! process groups, wait `--exit-on-rank-failure` so a gateway's health check and the clients see the 503s, then
//! exit with status 70 (EX_SOFTWARE). The exit does not depend on that cleanup finishing: a second timer ends the
//! process even if a lock the panicking thread poisoned makes the cleanup panic or block.
//!
//! Fail points (`DEEPINFER_SERVER_FAIL_POINT`, read once) let the tests cause a panic where one could happen in
//! production: `rank-out` in a rank's output thread as it delivers tokens, `http` in a door's handler.

use crate::dispatch::Dispatcher;
use crate::supervisor::{fail_rank, kill_rank_groups};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Exit status after a panic: EX_SOFTWARE, an internal error.
pub const EXIT_PANIC: i32 = 70;
/// How long past the grace the process may take to exit whatever the cleanup does.
const HARD_STOP_AFTER_GRACE: Duration = Duration::from_secs(5);

static FATAL: AtomicBool = AtomicBool::new(false);
static SERVER: OnceLock<Server> = OnceLock::new();

/// What the cleanup needs: the ranks to fail and stop, and how long to let the 503s be seen.
struct Server {
    dispatcher: Arc<Dispatcher>,
    pids: Vec<i32>,
    grace: Duration,
}

/// True once any thread has panicked: the server is going down.
pub fn is_fatal() -> bool {
    FATAL.load(Ordering::Acquire)
}

/// Install the hook for this process. The panic's message becomes one log line like the rest (in JSON with
/// `--log-format json`); the default hook's raw lines only when logging is off.
pub fn install(dispatcher: Arc<Dispatcher>, pids: Vec<i32>, grace: Duration) {
    let _ = SERVER.set(Server { dispatcher, pids, grace });
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        tracing::error!(target: "panic", "a server thread panicked: {info}; exiting with status {EXIT_PANIC}");
        if !tracing::enabled!(target: "panic", tracing::Level::ERROR) {
            default(info);
        }
        if FATAL.swap(true, Ordering::AcqRel) {
            return; // already going down (the cleanup itself may panic on a poisoned lock)
        }
        let spawned = std::thread::Builder::new().name("fatal".into()).spawn(go_down);
        if spawned.is_err() {
            exit_now();
        }
    }));
}

/// The cleanup, then the exit; a timer of its own makes sure of the exit.
fn go_down() {
    let grace = SERVER.get().map_or(Duration::ZERO, |s| s.grace);
    let _ = std::thread::Builder::new().name("fatal-timer".into()).spawn(move || {
        std::thread::sleep(grace + HARD_STOP_AFTER_GRACE);
        exit_now();
    });
    if let Some(server) = SERVER.get() {
        // A poisoned lock may make the cleanup panic too; the process goes down whatever it left.
        let cleanup = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for rank in 0..server.dispatcher.ranks.len() {
                fail_rank(&server.dispatcher, rank, "The server hit an internal error and is restarting.", "panic");
            }
            kill_rank_groups(&server.pids);
        }));
        if cleanup.is_err() {
            tracing::error!("cleanup after the panic failed; exiting without it");
        }
    }
    std::thread::sleep(grace);
    exit_now();
}

fn exit_now() -> ! {
    let _ = std::io::stderr().flush();
    // _exit: no atexit handlers or Python finalisation, which could wait on the very thread that died.
    unsafe { libc::_exit(EXIT_PANIC) }
}

/// Whether the test fail point `name` is set for this process.
pub fn fail_point(name: &str) -> bool {
    static POINT: OnceLock<Option<String>> = OnceLock::new();
    POINT.get_or_init(|| std::env::var("DEEPINFER_SERVER_FAIL_POINT").ok()).as_deref() == Some(name)
}

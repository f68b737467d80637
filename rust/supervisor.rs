//! Watches the rank processes through pidfds (poll, no polling loop): a rank that exits while the server runs
//! turns /health to 503, fails its in-flight requests, and makes the server exit non-zero soon after, so
//! GPUStack or Kubernetes restarts it.

use crate::dispatch::Dispatcher;
use crate::error::ApiError;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::thread::{self, JoinHandle};

pub struct Supervisor {
    wake: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; we own the returned fd.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd(0, EFD_CLOEXEC) returns a new fd or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Supervisor {
    /// Watch `pids` (rank i has pid `pids[i]`); `on_failure(rank)` runs once per dead rank.
    pub fn start(
        dispatcher: Arc<Dispatcher>,
        pids: &[i32],
        on_failure: impl Fn(usize) + Send + 'static,
    ) -> io::Result<Self> {
        let pidfds = pids.iter().map(|&p| pidfd_open(p)).collect::<io::Result<Vec<_>>>()?;
        let wake = eventfd()?;
        let wake_raw = wake.as_raw_fd();
        let thread = thread::Builder::new().name("supervisor".into()).spawn(move || {
            let mut alive: Vec<bool> = vec![true; pidfds.len()];
            loop {
                let mut fds: Vec<libc::pollfd> = vec![libc::pollfd { fd: wake_raw, events: libc::POLLIN, revents: 0 }];
                fds.extend(pidfds.iter().map(|f| libc::pollfd { fd: f.as_raw_fd(), events: libc::POLLIN, revents: 0 }));
                // SAFETY: `fds` is a valid, writable array of `fds.len()` pollfd structs.
                let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
                if n < 0 {
                    if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    tracing::error!("supervisor poll failed: {}", io::Error::last_os_error());
                    return;
                }
                if fds[0].revents != 0 {
                    return; // server shutting down: rank exits are expected from here on
                }
                for (rank, pfd) in fds[1..].iter().enumerate() {
                    if pfd.revents != 0 && alive[rank] {
                        alive[rank] = false;
                        rank_failed(&dispatcher, rank);
                        on_failure(rank);
                    }
                }
                if !alive.iter().any(|a| *a) {
                    return;
                }
            }
        })?;
        Ok(Supervisor { wake, thread: Some(thread) })
    }

    /// Stop watching (normal shutdown: the ranks are about to exit).
    pub fn stop(&mut self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a valid u64 to our own eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Fail everything on a dead rank and wake its reader so it exits.
pub fn rank_failed(dispatcher: &Dispatcher, rank: usize) {
    let link = &dispatcher.ranks[rank];
    link.mark_dead();
    tracing::error!(rank, in_flight = link.in_flight(), "engine rank process exited; failing its requests");
    fail_in_flight(dispatcher, rank, &format!("Engine rank {rank} failed while running the request."));
    link.output.close();
}

/// End every request still on `rank` with a 503 (an error event + `[DONE]` for streams).
pub fn fail_in_flight(dispatcher: &Dispatcher, rank: usize, why: &str) {
    for entry in dispatcher.ranks[rank].take_all() {
        entry.log_end(503, "unavailable");
        entry.outlet.fail(ApiError::Unavailable(why.to_string()));
    }
}

/// Make the calling thread nicer (a higher nice value) so other threads win the CPU when it is contended.
pub fn lower_thread_priority(nice: i32) {
    // SAFETY: gettid has no preconditions; setpriority on our own thread id only changes its nice value.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
    if rc != 0 {
        tracing::debug!("cannot lower thread priority: {}", io::Error::last_os_error());
    }
}

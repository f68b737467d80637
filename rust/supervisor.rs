//! Watches the rank processes through pidfds (poll, no polling loop): a rank that exits while the server runs
//! turns /health to 503, fails its in-flight requests, and makes the server exit non-zero soon after, so
//! GPUStack or Kubernetes restarts it.

use crate::dispatch::Dispatcher;
use crate::error::ApiError;
use rustix::event::{EventfdFlags, PollFd, PollFlags, eventfd, poll};
use rustix::process::{Pid, PidfdFlags, pidfd_open};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::thread::{self, JoinHandle};

pub struct Supervisor {
    wake: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl Supervisor {
    /// Watch `pids` (rank i has pid `pids[i]`); `on_failure(rank)` runs once per dead rank.
    pub fn start(
        dispatcher: Arc<Dispatcher>,
        pids: &[i32],
        on_failure: impl Fn(usize) + Send + 'static,
    ) -> io::Result<Self> {
        let pidfds = pids
            .iter()
            .map(|&p| {
                let pid = Pid::from_raw(p).ok_or_else(|| io::Error::other(format!("bad rank pid {p}")))?;
                Ok(pidfd_open(pid, PidfdFlags::empty())?)
            })
            .collect::<io::Result<Vec<_>>>()?;
        let pids = pids.to_vec();
        let wake = Arc::new(eventfd(0, EventfdFlags::CLOEXEC)?);
        let stop = wake.clone();
        let thread = thread::Builder::new().name("supervisor".into()).spawn(move || {
            let mut alive: Vec<bool> = vec![true; pidfds.len()];
            loop {
                let mut fds = vec![PollFd::new(&*stop, PollFlags::IN)];
                fds.extend(pidfds.iter().map(|f| PollFd::new(f, PollFlags::IN)));
                match poll(&mut fds, None) {
                    Ok(_) => {}
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => {
                        tracing::error!("supervisor poll failed: {e}");
                        return;
                    }
                }
                if !fds[0].revents().is_empty() {
                    return; // server shutting down: rank exits are expected from here on
                }
                let exited: Vec<usize> = fds[1..]
                    .iter()
                    .enumerate()
                    .filter(|(rank, pfd)| !pfd.revents().is_empty() && alive[*rank])
                    .map(|(rank, _)| rank)
                    .collect();
                drop(fds);
                for rank in exited {
                    alive[rank] = false;
                    // Its CP workers and VE worker may live on (some are not tied to it by a death signal).
                    kill_rank_groups(&pids[rank..=rank]);
                    rank_failed(&dispatcher, rank);
                    on_failure(rank);
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
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
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
    if link.is_alive() {
        tracing::error!(rank, in_flight = link.in_flight(), "engine rank process exited; failing its requests");
    }
    fail_rank(dispatcher, rank, &format!("Engine rank {rank} failed while running the request."), "rank_failure");
}

/// Take `rank` out of service: no new requests, its in-flight ones end with `why` (counted as aborted with
/// `label`), its reader exits.
pub fn fail_rank(dispatcher: &Dispatcher, rank: usize, why: &str, label: &str) {
    let link = &dispatcher.ranks[rank];
    link.mark_dead();
    fail_in_flight(dispatcher, rank, why, label);
    link.output.close();
}

/// SIGKILL each rank's process group: the rank and every descendant that stayed in it (CP workers, the VE
/// worker), stopped ones included. The launcher makes every rank a group leader; its pid cannot be reused
/// before the launcher reaps it, which it does only after the server returns.
pub fn kill_rank_groups(pids: &[i32]) {
    use rustix::process::{Signal, kill_process, kill_process_group};
    for &p in pids {
        let Some(pid) = Pid::from_raw(p) else { continue };
        if kill_process_group(pid, Signal::KILL).is_err() {
            let _ = kill_process(pid, Signal::KILL); // not a group leader (an older launcher): the rank alone
        }
    }
}

/// End every request still on `rank` with a 503 (an error event + `[DONE]` for streams), counted in
/// `deepinfer_aborted_requests_total{reason=label}`.
pub fn fail_in_flight(dispatcher: &Dispatcher, rank: usize, why: &str, label: &str) {
    let entries = dispatcher.ranks[rank].take_all();
    dispatcher.count_lost(entries.len());
    if !entries.is_empty() {
        dispatcher.metrics.aborted.with_label_values(&[label]).inc_by(entries.len() as u64);
    }
    for entry in entries {
        entry.fail(ApiError::Unavailable(why.to_string()));
    }
}

/// Make the calling thread nicer (a higher nice value) so other threads win the CPU when it is contended.
pub fn lower_thread_priority(nice: i32) {
    if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), nice) {
        tracing::debug!("cannot lower thread priority: {e}");
    }
}

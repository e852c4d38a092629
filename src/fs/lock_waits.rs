//! Blocking lock requests (`F_SETLKW`, `flock` without `LOCK_NB`) wait on a bounded pool
//! of waiter threads, not on a thread each: a program with 200 waiters costs 200 queue
//! entries and `THREADS` threads.
//!
//! A waiter does not block in the source's `F_OFD_SETLKW` (a thread per waiter again, and
//! a full pool of blocked waits could keep a free lock from the request that would end
//! them): the pool tries its non-blocking `F_OFD_SETLK`, oldest waiter first, when a lock
//! of the same file is released through this mount (`kick`), and otherwise again after a
//! backoff from `FIRST_RETRY` to `LAST_RETRY` (for holders elsewhere on the source). OFD
//! locks have no deadlock detection, so nothing is lost there.
//!
//! More than `MAX_WAITING` waiters at once are refused with `ENOLCK` (POSIX's "system lock
//! table full"), never `EAGAIN`: a blocking lock must not fail because others wait. fuser
//! 0.18 answers FUSE_INTERRUPT itself (ENOSYS, after which the kernel waits on for a reply
//! even for a killed caller), so a waiter whose thread has a fatal signal pending (killed,
//! or interrupted by a signal it does not handle) is answered `EINTR` at its next try,
//! which ends its wait and frees its entry. At unmount `stop` drops every waiter.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use fuser::Errno;

use super::{CachingFs, Result};
use crate::threads::Threads;

/// Waiter threads: tries are non-blocking, so a few suffice.
const THREADS: usize = 4;
/// Waiters queued at most; far more than the pool, as no blocking lock should fail.
const MAX_WAITING: usize = 4096;
/// A waiter's retry interval, doubling from the first to the last.
const FIRST_RETRY: Duration = Duration::from_millis(1);
const LAST_RETRY: Duration = Duration::from_millis(200);

/// How a waiter is answered (its FUSE reply).
pub type Answer = Box<dyn FnOnce(Result<()>) + Send>;

/// One blocking lock request: what `CachingFs::setlk` takes, and who asked.
pub struct LockRequest {
    pub id: u64,
    pub fh: u64,
    pub owner: u64,
    pub start: u64,
    pub end: u64,
    pub typ: i32,
    /// The requesting thread (the FUSE request's pid is its thread id).
    pub tid: u32,
}

struct Waiter {
    req: LockRequest,
    /// Arrival order: the oldest due waiter is tried first.
    seq: u64,
    due: Instant,
    backoff: Duration,
    answer: Answer,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Waiter>,
    next_seq: u64,
    started: bool,
    stopped: bool,
}

/// The waiters and the pool's threads.
pub(super) struct LockWaits {
    queue: Mutex<Queue>,
    cv: Condvar,
    threads: Threads,
}

impl Default for LockWaits {
    fn default() -> Self {
        LockWaits {
            queue: Mutex::default(),
            cv: Condvar::new(),
            threads: Threads::new("lock waiters"),
        }
    }
}

impl LockWaits {
    /// Makes the waiters of inode `id` due now: one of its locks was released.
    pub(super) fn kick(&self, id: u64) {
        let mut q = self.queue.lock().unwrap();
        let now = Instant::now();
        let mut any = false;
        for w in q.waiting.iter_mut().filter(|w| w.req.id == id) {
            w.due = now;
            w.backoff = FIRST_RETRY;
            any = true;
        }
        if any {
            self.cv.notify_all();
        }
    }

    /// Waiters queued now.
    pub fn len(&self) -> usize {
        self.queue.lock().unwrap().waiting.len()
    }

    /// The oldest due waiter, taken out of the queue; `None` once stopped.
    fn next_due(&self) -> Option<Waiter> {
        let mut q = self.queue.lock().unwrap();
        loop {
            if q.stopped {
                return None;
            }
            let now = Instant::now();
            let due = (q.waiting.iter().enumerate())
                .filter(|(_, w)| w.due <= now)
                .min_by_key(|(_, w)| w.seq)
                .map(|(i, _)| i);
            if let Some(i) = due {
                return q.waiting.remove(i);
            }
            q = match q.waiting.iter().map(|w| w.due).min() {
                Some(t) => self.cv.wait_timeout(q, t - now).unwrap().0,
                None => self.cv.wait(q).unwrap(),
            };
        }
    }

    /// Puts a waiter that must wait on back in line, due after its backoff.
    fn again(&self, mut w: Waiter) {
        w.due = Instant::now() + w.backoff;
        w.backoff = (w.backoff * 2).min(LAST_RETRY);
        let mut q = self.queue.lock().unwrap();
        if q.stopped {
            // Unmounted: the connection is gone; a reply would only fail, loudly.
            std::mem::forget(w.answer);
            return;
        }
        q.waiting.push_back(w);
    }

    /// Stops the pool at unmount (the kernel will read no reply): its waiters are dropped
    /// unanswered and its threads joined until `deadline`.
    pub(super) fn stop(&self, deadline: Instant) {
        let dropped = {
            let mut q = self.queue.lock().unwrap();
            q.stopped = true;
            self.cv.notify_all();
            std::mem::take(&mut q.waiting)
        };
        if !dropped.is_empty() {
            tracing::info!("unmounted with {} lock waits pending", dropped.len());
        }
        for w in dropped {
            // A reply to a gone connection only fails, and fuser logs each failure.
            std::mem::forget(w.answer);
        }
        self.threads.stop_and_join(deadline);
    }
}

impl CachingFs {
    /// A blocking lock: granted at once if it can be, else queued for the waiter pool,
    /// which answers `answer` when it is granted or fails.
    pub fn setlk_wait(self: &Arc<Self>, req: LockRequest, answer: Answer) {
        match self.setlk(
            req.id, req.fh, req.owner, req.start, req.end, req.typ, false,
        ) {
            Err(Errno::EAGAIN) => {}
            r => return answer(r),
        }
        let lw = &self.lock_waits;
        let mut q = lw.queue.lock().unwrap();
        if q.stopped {
            drop(q);
            return answer(Err(Errno::EINTR));
        }
        if q.waiting.len() >= MAX_WAITING {
            drop(q);
            tracing::warn!("{MAX_WAITING} lock waits pending: refusing another (ENOLCK)");
            return answer(Err(Errno::ENOLCK));
        }
        if !q.started {
            q.started = true;
            for i in 0..THREADS {
                let weak = Arc::downgrade(self);
                if let Err(e) = lw.threads.spawn(format!("lock-wait-{i}"), |_| waiter(weak)) {
                    tracing::error!("cannot start a lock waiter thread: {e}");
                }
            }
        }
        let seq = q.next_seq;
        q.next_seq += 1;
        q.waiting.push_back(Waiter {
            req,
            seq,
            due: Instant::now() + FIRST_RETRY,
            backoff: FIRST_RETRY * 2,
            answer,
        });
        lw.cv.notify_one();
    }

    /// Stops the lock waiter pool (unmount).
    pub fn stop_lock_waits(&self, deadline: Instant) {
        self.lock_waits.stop(deadline);
    }

    /// Blocking lock requests waiting in the pool.
    pub fn lock_waits_pending(&self) -> usize {
        self.lock_waits.len()
    }
}

/// A waiter thread: tries due waiters until the pool stops.
fn waiter(fs: Weak<CachingFs>) {
    loop {
        let Some(fs) = fs.upgrade() else { return };
        let Some(w) = fs.lock_waits.next_due() else {
            return;
        };
        if fatal_signal_pending(w.req.tid) {
            (w.answer)(Err(Errno::EINTR));
            continue;
        }
        let r = &w.req;
        match fs.setlk(r.id, r.fh, r.owner, r.start, r.end, r.typ, false) {
            Err(Errno::EAGAIN) => fs.lock_waits.again(w),
            r => (w.answer)(r),
        }
    }
}

/// Whether thread `tid` is dying: a fatal signal puts SIGKILL in each thread's pending
/// set (`/proc/TID/status`, `SigPnd`). A thread that is gone counts as dying.
fn fatal_signal_pending(tid: u32) -> bool {
    if tid == 0 {
        return false; // the kernel's own request, or a caller outside our pid namespace
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else {
        return true;
    };
    let pending = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    let kill = 1u64 << (libc::SIGKILL - 1);
    (pending("SigPnd:") | pending("ShdPnd:")) & kill != 0
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_live_thread_has_no_fatal_signal_pending_and_a_gone_one_counts_as_dying() {
        let me = rustix::thread::gettid().as_raw_nonzero().get() as u32;
        assert!(!super::fatal_signal_pending(me));
        assert!(super::fatal_signal_pending(u32::MAX >> 1));
    }
}

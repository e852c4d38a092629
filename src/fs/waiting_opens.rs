//! Opens that wait for other requests run off the request threads.
//!
//! A writer's open waits for the releases of the file's passthrough readers (the kernel
//! takes no other open while they last, `open.rs`). Those releases are requests too, and
//! over io_uring the kernel hands each request to a ring entry that one thread owns: a
//! release given to an entry of the very thread that waits for it is read only after the
//! wait has run out, and the writer got `ETXTBSY` after 500 ms. That happened under load,
//! for a write right after a read of the same file (in 3,000 rounds of a read-then-write
//! loop with two more writers beside: 13 opens over 100 ms and an `ETXTBSY`; none over
//! `/dev/fuse`).
//! So the request thread opens without waiting (`CachingFs::open_at_once`), and an open
//! that would have waited is opened again on this pool: its thread may wait, and the
//! request threads go on reading what the kernel sends, the awaited release among it.
//!
//! A `chmod` that sets set-ID bits waits the same way for the releases of the file's
//! writers to the source (`fs/source_writes.rs`).
//!
//! The pool is small: an open waits only until the readers' releases arrive (at most
//! `PASSTHROUGH_RELEASE_WAIT`). More than `MAX_QUEUED` opens queued at once, or an open
//! after unmount, wait on their request thread as before.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use fuser::BackingId;

use super::{CachingFs, Opened, Result};
use crate::threads::Threads;

const THREADS: usize = 2;
const MAX_QUEUED: usize = 1024;

/// An open to run, with its reply.
pub type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    started: bool,
    stopped: bool,
}

pub(super) struct WaitingOpens {
    queue: Mutex<Queue>,
    cv: Condvar,
    threads: Threads,
}

impl Default for WaitingOpens {
    fn default() -> Self {
        WaitingOpens {
            queue: Mutex::default(),
            cv: Condvar::new(),
            threads: Threads::new("waiting opens"),
        }
    }
}

impl WaitingOpens {
    fn next(&self) -> Option<Job> {
        let mut q = self.queue.lock().unwrap();
        loop {
            if q.stopped {
                return None;
            }
            if let Some(job) = q.jobs.pop_front() {
                return Some(job);
            }
            q = self.cv.wait(q).unwrap();
        }
    }

    /// Stops the pool at unmount: queued opens are dropped unanswered (the kernel reads
    /// no reply any more) and the threads joined until `deadline`.
    pub(super) fn stop(&self, deadline: Instant) {
        let dropped = {
            let mut q = self.queue.lock().unwrap();
            q.stopped = true;
            self.cv.notify_all();
            std::mem::take(&mut q.jobs)
        };
        for job in dropped {
            // Its reply to a gone connection would only fail, and fuser logs each failure.
            std::mem::forget(job);
        }
        self.threads.stop_and_join(deadline);
    }
}

fn worker(fs: Weak<CachingFs>) {
    loop {
        let Some(fs) = fs.upgrade() else { return };
        let Some(job) = fs.waiting_opens.next() else {
            return;
        };
        drop(fs);
        job();
    }
}

impl CachingFs {
    /// `open` without waiting for the releases of the file's passthrough readers: a
    /// writer that would wait for them fails with `ETXTBSY` at once, to be opened again
    /// with `open` where waiting holds up no request.
    pub fn open_at_once(
        &self,
        id: u64,
        flags: i32,
        pid: u32,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<Opened> {
        self.open_waiting(id, flags, pid, make_backing, Duration::ZERO)
    }

    /// Runs `job` (an open and its reply) on the pool; on the caller's thread when the
    /// pool is stopped or full.
    pub fn open_off_request_thread(self: &Arc<Self>, job: Job) {
        let wo = &self.waiting_opens;
        let mut q = wo.queue.lock().unwrap();
        if q.stopped || q.jobs.len() >= MAX_QUEUED {
            drop(q);
            return job();
        }
        if !q.started {
            let mut started = 0;
            for i in 0..THREADS {
                let weak = Arc::downgrade(self);
                match wo.threads.spawn(format!("open-wait-{i}"), |_| worker(weak)) {
                    Ok(()) => started += 1,
                    Err(e) => tracing::error!("cannot start a waiting-open thread: {e}"),
                }
            }
            q.started = started > 0;
            if !q.started {
                drop(q);
                return job();
            }
        }
        q.jobs.push_back(job);
        wo.cv.notify_one();
    }

    /// Stops the pool of waiting opens (at unmount).
    pub fn stop_waiting_opens(&self, deadline: Instant) {
        self.waiting_opens.stop(deadline);
    }
}

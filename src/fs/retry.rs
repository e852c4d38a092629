//! The kernel's retry of an open that answered `ESTALE`. FUSE looks a name up and opens
//! its node in two requests; when the open finds that the name leads to another file by
//! now, it answers `ESTALE`, and the kernel looks the name up again and opens once more,
//! in the same system call (`do_filp_open`), then gives up. A mark per thread tells the
//! daemon which lookup and which open are that retry. The retry's lookup keeps an `O_PATH`
//! descriptor of the file it found: if the name is replaced yet again before the retry's
//! open arrives, that open gets this file through it (a version the name held during the
//! system call, as a native open racing the rename could), instead of a second `ESTALE`
//! that would reach the caller.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long after an open answered ESTALE its thread's next open counts as the kernel's
/// retry of it: the retry follows at once, but a loaded machine may delay it. Bounds a
/// mark the kernel did not follow with a retry.
const RETRY_WITHIN: Duration = Duration::from_secs(1);

/// How recent a retry's lookup must be for its open to read the file it kept. The open
/// follows its lookup at once; an older pin may stand for a lookup of another system call
/// (the retry's open never came: the kernel refused it before asking), whose version is
/// not the file's at an instant of this open. Past it the open answers as without a pin.
const PIN_WITHIN: Duration = Duration::from_millis(100);

/// The file a retry's lookup found for node `node`, and when it looked.
pub(crate) struct Pinned {
    pub node: u64,
    pub fd: OwnedFd,
    pub at: Instant,
}

/// An open that answered ESTALE, and what its retry's lookup pinned.
struct Told {
    at: Instant,
    pinned: Option<Pinned>,
}

/// The marks, by thread id (a FUSE request's `pid`).
#[derive(Default)]
pub(crate) struct Retries {
    told: Mutex<HashMap<u32, Told>>,
    /// Whether any mark may be set: every lookup asks, and almost always none is.
    any: AtomicBool,
}

/// What an open learns of the open it retries.
pub(crate) struct Retry {
    /// When the first try answered ESTALE.
    pub first: Instant,
    /// The file the retry's lookup found for the node being opened, if it kept one.
    pub pinned: Option<Pinned>,
}

impl Retries {
    /// An open by thread `pid` answered ESTALE: its next open is the kernel's retry.
    pub fn told(&self, pid: u32) {
        let told = Told {
            at: Instant::now(),
            pinned: None,
        };
        let mut marks = self.told.lock().unwrap();
        marks.insert(pid, told);
        self.any.store(true, Ordering::Release);
    }

    /// Whether a lookup by `pid` is one of the kernel's retry (it looks every name of the
    /// path up again; the last one is what the open reaches).
    pub fn retrying(&self, pid: u32) -> bool {
        if !self.any.load(Ordering::Acquire) {
            return false;
        }
        let told = self.told.lock().unwrap();
        told.get(&pid)
            .is_some_and(|t| t.at.elapsed() < RETRY_WITHIN)
    }

    /// A lookup by `pid` failed: a path walk ends at its first failed lookup, so a retry
    /// under way sends no open.
    pub fn ended(&self, pid: u32) {
        if self.any.load(Ordering::Acquire) {
            self.remove(pid);
        }
    }

    /// The retry's lookup by `pid` found node `node`'s file at `fd`, looking at `at`.
    pub fn pin(&self, pid: u32, node: u64, fd: OwnedFd, at: Instant) {
        if let Some(t) = self.told.lock().unwrap().get_mut(&pid) {
            t.pinned = Some(Pinned { node, fd, at });
        }
    }

    /// Taken by every open of `pid`, so that no mark outlives the retry it stands for:
    /// when this thread's previous open answered ESTALE moments ago, this open is its
    /// retry. Marks the kernel never followed are dropped as they age.
    pub fn take(&self, pid: u32) -> Option<Retry> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        self.remove(pid).map(|t| Retry {
            first: t.at,
            pinned: t.pinned.filter(|p| p.at.elapsed() < PIN_WITHIN),
        })
    }

    /// Takes `pid`'s mark, dropping marks the kernel never followed as they age.
    fn remove(&self, pid: u32) -> Option<Told> {
        let mut told = self.told.lock().unwrap();
        told.retain(|_, t| t.at.elapsed() < RETRY_WITHIN);
        let t = told.remove(&pid);
        if told.is_empty() {
            // Set and cleared under the lock, so that a mark is never hidden.
            self.any.store(false, Ordering::Release);
        }
        t
    }
}

//! One request's accounting in the adapter: counted and timed in a tracing span that
//! names it, and a failure counted by errno and logged at the level its errno deserves.

use fuser::{Errno, Request};

use super::FuseAdapter;
use crate::stats::{Op, OpTimer, Stats, errno_name};

/// One request being answered: counted and timed (`OpTimer`), inside a tracing span that
/// names it, so that whatever the core logs meanwhile says which request it served.
pub(super) struct Call<'a> {
    timer: OpTimer<'a>,
    _span: tracing::span::EnteredSpan,
}

impl Call<'_> {
    /// `e`, counted (`errors{op,errno}`) and logged at its errno's level.
    pub(super) fn fail(&self, e: Errno) -> Errno {
        self.timer.failed(e.code());
        log_failure(self.timer.op(), e);
        e
    }
}

/// Logs a failed request at the level its errno deserves: the answers a file system
/// gives in its normal course (no such name, not empty, would block...) at trace; a
/// source that cannot be reached at debug (the health module logs the switch to offline
/// once); anything else, an I/O error above all, as a warning.
fn log_failure(op: Op, e: Errno) {
    use libc::*;
    let errno = e.code();
    match errno {
        ENOENT | EEXIST | ENOTEMPTY | ENOTDIR | EISDIR | ENODATA | ERANGE | EAGAIN | ENOSYS
        | EOPNOTSUPP | ESTALE | EACCES | EPERM | EINVAL | EXDEV | ENAMETOOLONG | ELOOP
        | ETXTBSY | EINTR | EDEADLK | EBUSY | EMLINK | EFBIG | ENOSPC | EROFS | EDQUOT | EBADF
        | ENOTTY => {
            tracing::trace!(op = op.name(), errno = errno_name(errno), "request failed")
        }
        ENOTCONN | ETIMEDOUT | EHOSTDOWN | EHOSTUNREACH => {
            tracing::debug!(op = op.name(), errno = errno_name(errno), "request failed")
        }
        _ => tracing::warn!(op = op.name(), errno = errno_name(errno), "request failed"),
    }
}

/// Counts and logs a failure of an `op` request answered off its handler's thread.
pub(super) fn failed_elsewhere(stats: &Stats, op: Op, e: Errno) -> Errno {
    stats.failed(op, e.code());
    log_failure(op, e);
    e
}

impl FuseAdapter {
    /// Starts answering request `req` of type `op`.
    pub(super) fn call(&self, op: Op, req: &Request) -> Call<'_> {
        if fuser::serving_over_io_uring() {
            Stats::add(&self.fs.stats.cache.ring_requests, 1);
        }
        Call {
            timer: self.fs.stats.start(op),
            _span: tracing::debug_span!("request", op = op.name(), unique = req.unique().0)
                .entered(),
        }
    }
}

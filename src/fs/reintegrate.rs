//! Changes made while disconnected, with `--offline-writes=log`: Coda's disconnected
//! operation and reintegration.
//!
//! Offline, a change is applied to the cache's view of the tree (the saved listings of
//! `fs/offline.rs` and the cache files) and appended to the durable operation log
//! (`oplog.rs`) before it is acknowledged; file contents are logged when the file is
//! closed or synced (Coda's store-on-close). When the source answers again the log is
//! replayed to it in order, before the mount goes online.
//!
//! Every logged change carries the source version it was made to (`Base`). A change whose
//! path no longer holds that version on the source is a conflict, and is never resolved by
//! overwriting either side: a file's content goes to `NAME.hoardfs-conflict-…` beside the
//! source's version, a deletion or rename of a file changed on the source is not done, and
//! each conflict is reported in `<cache>/conflicts.log` and counted in `hoardfs stats`.
//! Replay records its position after every change, and each change recognises that it was
//! already done, so a crash during replay loses and repeats nothing.
//!
//! Supported offline: create, write, truncate, chmod and utimens of regular files, mkdir,
//! unlink, rmdir and rename of files. Renaming a directory answers `EXDEV` (so `mv` copies),
//! the rest (`symlink`, `link`, `mknod`, owners, extended attributes) `EROFS`.

use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::time::SystemTime;

use fuser::Errno;

use super::{CachingFs, Result};
use crate::cache::listing::ListedEntry;
use crate::config::OfflineWrites;
use crate::oplog::{Base, Entry, Ident, Op, OpLog};
use crate::source::Stat;

mod apply;
mod attrs;
mod contents;
mod names;
mod replay;

pub(super) fn now_ts() -> (i64, u32) {
    let d = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos())
}

fn now_secs() -> u64 {
    now_ts().0 as u64
}

/// Inode numbers for objects made offline: high, so they never meet a source's.
fn synthetic_ino() -> u64 {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let _ = NEXT.compare_exchange(0, (now_ts().0 as u64) << 20, Relaxed, Relaxed);
    (1 << 63) | (NEXT.fetch_add(1, Relaxed) & ((1 << 62) - 1))
}

fn err(e: io::Error) -> Errno {
    super::errno(e)
}

fn os_errno(e: &io::Error) -> Option<i32> {
    e.raw_os_error()
}

/// `YYYYmmdd-HHMMSS` (UTC) of `secs`.
fn stamp(secs: u64) -> String {
    i64::try_from(secs)
        .ok()
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0))
        .unwrap_or_default()
        .format("%Y%m%d-%H%M%S")
        .to_string()
}

/// `dir/NAME.hoardfs-conflict-STAMP-SEQ` for `path`.
fn conflict_path(path: &Path, e: &Entry) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!("{name}.hoardfs-conflict-{}-{}", stamp(e.at), e.seq))
}

fn parent_of(p: &Path) -> PathBuf {
    p.parent().unwrap_or(Path::new("")).to_path_buf()
}

impl CachingFs {
    pub(super) fn logging_offline(&self) -> bool {
        self.cfg.offline_writes == OfflineWrites::Log
    }

    /// Whether a change is made offline: `Ok(false)` online, `Ok(true)` offline with the
    /// log on, `EROFS` offline without it.
    pub(super) fn offline_change(&self) -> Result<bool> {
        if self.online() {
            return Ok(false);
        }
        self.source.health.offline_requests.fetch_add(1, Relaxed);
        if self.logging_offline() {
            Ok(true)
        } else {
            Err(Errno::EROFS)
        }
    }

    /// Appends the change `make` builds (given the log, for `base_for`), durably.
    fn log_op(&self, make: impl FnOnce(&OpLog) -> Op) -> Result<()> {
        let mut log = self.oplog.lock().unwrap();
        let op = make(&log);
        log.append(op, now_secs()).map_err(|e| {
            tracing::warn!("cannot append to the offline log: {e}");
            Errno::EIO
        })?;
        self.note_pending(&log);
        Ok(())
    }

    fn base_of(&self, st: &Stat) -> Base {
        Base::Source(Ident::from(self.identity(st)))
    }

    /// A new object's attributes, made offline in directory `dir`.
    fn synthetic(&self, dir: &Stat, mode: u32, uid: u32, gid: u32) -> Stat {
        let now = now_ts();
        let gid = if dir.mode & libc::S_ISGID != 0 {
            dir.gid
        } else {
            gid
        };
        Stat {
            dev: dir.dev,
            ino: synthetic_ino(),
            mode,
            nlink: if mode & libc::S_IFMT == libc::S_IFDIR {
                2
            } else {
                1
            },
            uid,
            gid,
            rdev: 0,
            size: 0,
            blocks: 0,
            blksize: 4096,
            atime: now,
            mtime: now,
            ctime: now,
            btime: (0, 0),
        }
    }

    /// Names an object made offline in the saved listing of `dir`.
    fn add_listed(&self, dir: &Path, name: &OsStr, stat: Stat) -> Result<()> {
        self.edit_listing(dir, |l| {
            l.entries.push(ListedEntry {
                name: name.to_os_string(),
                stat,
                link: None,
            });
            Ok(())
        })
    }

    fn lookup_offline(&self, path: &Path) -> Result<Option<Stat>> {
        match self.offline_stat(path) {
            Ok(st) => Ok(Some(st)),
            Err(e) if e == Errno::ENOENT => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_are_utc() {
        assert_eq!(stamp(0), "19700101-000000");
        assert_eq!(stamp(784_111_777), "19941106-084937");
    }
}

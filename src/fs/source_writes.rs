//! Source writes (`--source-writes`): a writer's open is answered with FUSE passthrough to
//! the source file, so the kernel writes the source itself instead of sending each write
//! to the daemon, which would copy every byte twice more (into the source's pages and the
//! cache file's) and cost a crossing per request (`docs/performance.md`, "Session 30").
//!
//! The daemon sees none of those writes. So from the first such open the cache entry
//! vouches for nothing (its claims are dropped, durably, and fills in flight end unused:
//! `FileFetch::invalidate`), and the source's changes meanwhile are the mount's own
//! (`FileState::written`). Every other open of the file while a writer is open takes the
//! same backing (the kernel gives all passthrough opens of one node one backing file), so
//! readers beside a writer read the source and see each write at once. When the last such
//! writer closes, the entry takes the version the writes left, empty, and what the source
//! holds in its page cache of it (all that was just written, unless memory ran short) is
//! copied into the cache by one fetch worker, as behind a source read
//! (`fs/source_reads.rs`, `fill_behind`); the rest is fetched by a later read.
//!
//! Only where the source has no source timeout (local sources): a passthrough write to a
//! hung source waits in the kernel, where no timeout of the daemon reaches it. Not for
//! set-user-ID or set-group-ID files: the kernel writes the backing file with the
//! daemon's credentials, so a write by a user without `CAP_FSETID` would not clear those
//! bits as a write must; for the same reason a `chmod` that sets them while such a writer
//! is open fails with `ETXTBSY` (after waiting, off the request thread, for releases on
//! their way: `wait_for_source_writers`). A write through a handle opened before (served by the
//! daemon) keeps the usual path: the kernel takes no passthrough open beside it.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuser::BackingId;

use super::open::PASSTHROUGH_RELEASE_WAIT;
use super::{CachingFs, FileState, Handle};
use crate::health::SourceFile;
use crate::source::SourceReader;
use crate::stats::Stats;

/// The mode bits a write must clear (for a writer without `CAP_FSETID`).
const SET_ID: u32 = libc::S_ISUID | libc::S_ISGID;

impl CachingFs {
    /// Whether source writes are on and possible now.
    pub(super) fn source_writes(&self) -> bool {
        self.cfg.source_writes
            && self.passthrough_enabled()
            && !self.kernel_opens()
            && self.caps().in_place_writes
            && self.source.health.timeout().is_none()
    }

    /// Whether a writer opening `state` joins the writers already writing the source by
    /// passthrough (then it need not wait for passthrough handles to close).
    pub(super) fn joins_source_writers(&self, state: &FileState) -> bool {
        self.source_writes() && self.writers_backing(state).is_some()
    }

    /// Whether a writer's open of `state`, a file of mode `mode`, may write the source by
    /// passthrough: nobody has the file open through the daemon (the kernel takes no
    /// passthrough open beside such handles), and it joins the node's live backing if
    /// that is the source's, open for writing (`joins_source_writers`), or there is none.
    /// Then not a small file the cache holds whole, unless the open makes its content anew
    /// (`new_content`: a create, `O_TRUNC`): a write through the daemon keeps it whole (an
    /// append needs no sync), where a writer to the source would drop it durably and leave
    /// it to be filled again (Postmark's appends took twice as long). Its source
    /// descriptor is opened for reading too then.
    pub(super) fn may_write_source(&self, state: &FileState, mode: u32, new_content: bool) -> bool {
        let kept_whole =
            state.complete() && state.record().identity.size <= self.cfg.whole_file_threshold;
        let alone = state.backing.upgrade().is_none() && (new_content || !kept_whole);
        self.source_writes()
            && mode & SET_ID == 0
            && state.daemon_opens() == 0
            && (self.joins_source_writers(state) || alone)
    }

    /// The backing of a writer's open that `may_write_source` allowed, whose source
    /// descriptor `source` is open for reading and writing: the node's live one, else one
    /// made of `source`. Counted; `None`: the daemon serves the open.
    pub(super) fn source_write_backing(
        &self,
        state: &mut FileState,
        source: &File,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Option<Arc<BackingId>> {
        let backing = match self.writers_backing(state) {
            Some(live) => live,
            None if state.backing.upgrade().is_some() => return None,
            None => match make_backing(source) {
                Ok(b) => {
                    let b = Arc::new(b);
                    state.backing = Arc::downgrade(&b);
                    state.backing_is_source = true;
                    state.backing_writable = true;
                    b
                }
                Err(e) => {
                    tracing::debug!(
                        "no passthrough to the source file ({e}); writes go through the daemon"
                    );
                    return None;
                }
            },
        };
        if state.source_writers() == 0 {
            // From here the kernel changes the source unseen: nothing the cache holds is
            // vouched for (durably so, crash rule 1), and no fill in flight may land.
            state.fetch.invalidate();
            if state.record().present_count() > 0 {
                state.drop_cached();
            }
            state.mark_written(&self.env());
        }
        Stats::add(&self.stats.cache.source_write_opens, 1);
        Some(backing)
    }

    /// The last writer to the source by passthrough, `h`, was released: the entry takes the
    /// version the writes left, empty, and what the source holds of it in memory is
    /// copied into the cache (`fill_behind`).
    pub(super) fn source_writes_done(&self, h: &Handle, state: &mut FileState) {
        let src = h.source.as_ref();
        let after = src.and_then(|f| self.source.fstat(f.as_fd()).ok());
        let path = self.own_path(&h.inode);
        let (Some(src), Some(after), Some(path)) = (src, after, path) else {
            // Where the file went, or what it holds, is not known: nothing is kept.
            state.drop_cached();
            return;
        };
        let identity = self.recorded_identity(&after);
        state.reset_as(&self.env(), identity, false, Some(&path));
        // The fill reads the file the writers wrote (a duplicate of this handle's
        // descriptor), whose version `after` is.
        state.fetch_src = (self.fetcher).open_source(|| Ok(SourceReader::File(src.try_clone()?)));
        self.fill_behind(&h.inode, state);
    }

    /// Opens the source file for a writer's open with `flags`: for reading too where it
    /// may write the source by passthrough (`source_write`), given up if the source
    /// refuses that.
    pub(super) fn open_source_for(
        &self,
        path: &Path,
        flags: i32,
        source_write: &mut bool,
    ) -> io::Result<SourceFile> {
        if *source_write {
            match self
                .source
                .open_file(path, flags & !libc::O_ACCMODE | libc::O_RDWR)
            {
                Err(e) if e.raw_os_error() == Some(libc::EACCES) => *source_write = false,
                r => return r,
            }
        }
        self.source.open_file(path, flags)
    }

    /// Waits (up to `PASSTHROUGH_RELEASE_WAIT`) until node `id` has no writer to the source
    /// by passthrough: a `close` returns before its release reaches the daemon.
    pub fn wait_for_source_writers(&self, id: u64) {
        let Ok(inode) = self.inode(id) else {
            return;
        };
        let writing = || {
            inode
                .file()
                .as_ref()
                .is_some_and(|s| s.source_writers() > 0)
        };
        let until = Instant::now() + PASSTHROUGH_RELEASE_WAIT;
        while writing() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Before a `chmod` of node `inode` to `mode`: set-ID bits are refused while writers
    /// write the source by passthrough (see the module's comment).
    pub(super) fn check_set_id_beside_source_writers(
        &self,
        inode: &super::Inode,
        mode: u32,
    ) -> super::Result<()> {
        let writing = inode
            .file()
            .as_ref()
            .is_some_and(|s| s.source_writers() > 0);
        if writing && mode & SET_ID != 0 {
            return Err(fuser::Errno::ETXTBSY);
        }
        Ok(())
    }
}

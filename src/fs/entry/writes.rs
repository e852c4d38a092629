//! The cache entry's copies of changes made through the mount: a write, a truncation or an
//! fallocate that went through to the source is made to the data file too, or nothing of
//! the file stays claimed; offline, a whole-file change of the cached copy.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use super::{Env, FileState, counted};
use crate::cache::SourceIdentity;
use crate::cache::record::chunk_count;
use crate::stats::Stats;

impl FileState {
    /// A write of `data` at `offset` went through to the source, which is now `after`: the
    /// same bytes go into the data file and the chunks the write covers wholly are claimed
    /// (claims become durable at the next checkpoint; the record is dirty meanwhile,
    /// `mark_written`). A cache error, a full cache, or a source size that shows someone
    /// else's change meanwhile leave nothing of the file cached but an empty entry of the
    /// source's size.
    pub(in crate::fs) fn wrote_through(
        &mut self,
        env: &Env,
        offset: u64,
        data: &[u8],
        after: SourceIdentity,
    ) {
        if let Some(files) = &self.files {
            let end = offset + data.len() as u64;
            let old_size = self.record.identity.size;
            // A full cache stops caching this file rather than grow past its limit.
            let admitted = env.usage.may_grow(data.len() as u64);
            let r = (|| -> io::Result<()> {
                if !admitted {
                    return Err(io::Error::from_raw_os_error(libc::ENOSPC));
                }
                // Counted by what the data file grew on disk: an overwrite adds nothing.
                // (`pwrite` extends the file itself, past a hole if the write starts
                // beyond its end.)
                counted(env.usage, &files.data, || {
                    files.data.write_all_at(data, offset)
                })
            })();
            if r.is_err() || after.size != old_size.max(end) {
                if r.is_err() && admitted {
                    Stats::add(&env.stats.cache_errors, 1);
                }
                self.emptied(after.size);
            } else {
                self.record.resize(end.max(old_size));
                // Chunks wholly covered by the write now hold the source's bytes.
                let cs = self.record.chunk_size;
                let first_full = offset.div_ceil(cs);
                let last_full = if end == after.size {
                    chunk_count(end, cs)
                } else {
                    end / cs
                };
                for c in first_full..last_full {
                    self.record.set_present(c, true);
                }
            }
            self.noted();
        }
        self.follow_own_change(after);
    }

    /// The source file was truncated to `size` by the mount and is now `after` (`None`: its
    /// state after the call is unknown): the data file is cut the same way, or nothing of
    /// it is kept.
    pub(in crate::fs) fn truncated(&mut self, env: &Env, size: u64, after: Option<SourceIdentity>) {
        let Some(after) = after else {
            self.drop_cached();
            return;
        };
        let cut = (self.files.as_ref())
            .map(|f| counted(env.usage, &f.data, || f.data.set_len(size)))
            .transpose()
            .is_ok();
        self.noted();
        // (While writers write the source unseen, nothing is claimed: `fs/source_writes.rs`.)
        if cut && after.size == size && self.source_writers() == 0 {
            self.record.resize(size);
            self.follow_own_change(after);
        } else {
            self.drop_cached();
        }
    }

    /// An `fallocate(mode, offset, length)` was sent to the source (`applied`: it
    /// succeeded), which is now `after` (`None`: unknown). The data file gets the same
    /// where that keeps its bytes at the source's offsets; otherwise (collapse, insert, an
    /// error) nothing of it is kept but an empty entry of the source's size.
    pub(in crate::fs) fn fallocated(
        &mut self,
        applied: bool,
        mode: i32,
        offset: u64,
        length: u64,
        after: Option<SourceIdentity>,
    ) {
        let Some(after) = after else {
            self.drop_cached();
            self.noted();
            return;
        };
        let shifts = libc::FALLOC_FL_COLLAPSE_RANGE | libc::FALLOC_FL_INSERT_RANGE;
        let same_on_cache = applied
            && mode & shifts == 0
            && self.source_writers() == 0
            && self.files.as_ref().is_some_and(|f| {
                // SAFETY: a plain syscall on a descriptor the entry owns.
                unsafe {
                    libc::fallocate(f.data.as_raw_fd(), mode, offset as i64, length as i64) == 0
                }
            });
        if same_on_cache {
            self.record.resize(after.size);
        } else {
            self.emptied(after.size);
        }
        self.follow_own_change(after);
        self.noted();
    }

    /// Keeps nothing of the file but an empty entry of `size` bytes (the record durably
    /// empty first, `drop_cached`).
    fn emptied(&mut self, size: u64) {
        self.drop_cached();
        if let Some(f) = &self.files {
            let _ = f.data.set_len(0).and_then(|_| f.data.set_len(size));
        }
        self.record.resize(size);
        for c in 0..self.record.nchunks() {
            self.record.set_present(c, false);
        }
    }

    /// Offline (`--offline-writes=log`): `change(data, size)` edits the data file of a
    /// file cached whole and returns its new size; the record is marked dirty (durably)
    /// first, stays whole, and takes the new size and `now` as its times.
    pub(in crate::fs) fn modify_whole(
        &mut self,
        env: &Env,
        now: (i64, u32),
        change: impl FnOnce(&File, u64) -> io::Result<u64>,
    ) -> io::Result<()> {
        self.fetch.invalidate();
        self.mark_written(env);
        let files = (self.files.as_ref()).ok_or(io::Error::from_raw_os_error(libc::EIO))?;
        let size = change(&files.data, self.record.identity.size);
        self.fetch.note_written(&files.data);
        let size = size?;
        self.record.resize(size);
        for c in 0..self.record.nchunks() {
            self.record.set_present(c, true);
        }
        self.record.identity.size = size;
        self.record.identity.mtime = now;
        self.record.identity.ctime = now;
        Ok(())
    }
}

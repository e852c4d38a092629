//! Open regular files after the open: writes through to the source (and fallocate), flush,
//! fsync and release, and lseek's holes.

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;

use fuser::Errno;

use super::{CachingFs, OpenKind, Result, Writes, errno, set_id_bits};
use crate::coherence::Notice;
use crate::stats::Stats;

impl CachingFs {
    /// Writes `data` through to the source at `offset`, then to the cache file. With
    /// `kill_suidgid` (the writer lacks `CAP_FSETID`; the kernel leaves this to us under
    /// `FUSE_HANDLE_KILLPRIV_V2`) a set-user-ID bit, and a set-group-ID bit with group
    /// execute, are cleared as a local write would clear them: the daemon writes as root,
    /// for whom the source's kernel keeps them.
    pub fn write(&self, fh: u64, offset: u64, data: &[u8], kill_suidgid: bool) -> Result<u32> {
        let h = self.handle(fh)?;
        if h.writes_to_cache() {
            return self.offline_write(&h, offset, data);
        }
        self.changes_allowed()?;
        let src = h
            .source
            .as_ref()
            .filter(|_| h.writable)
            .ok_or(Errno::EBADF)?;
        let mut guard = h.inode.file();
        let state = guard.as_mut().ok_or(Errno::EBADF)?;
        // Fetches in flight read the source before this write: none may land after it.
        state.fetch.invalidate();
        state.mark_write(&self.env(), offset, data.len() as u64);
        let own = self.own_write(&h.inode);
        let written = self.source.write_all_at(src.as_fd(), data, offset);
        if let Err(e) = written {
            // Part of the range may have reached the source: forget what we knew of it.
            state.drop_cached();
            return Err(errno(e));
        }
        Stats::add(&self.stats.cache.bytes_written, data.len() as u64);
        let mut after = self.source.fstat(src.as_fd()).map_err(errno)?;
        own.done(&after);
        let privs = set_id_bits(after.mode);
        if kill_suidgid && privs != 0 {
            let mode = after.mode & 0o7777 & !privs;
            self.source
                .with_fd(src.as_fd(), move |f| {
                    use std::os::unix::fs::PermissionsExt;
                    f.set_permissions(std::fs::Permissions::from_mode(mode))
                })
                .map_err(errno)?;
            after = self.source.fstat(src.as_fd()).map_err(errno)?;
            own.done(&after);
        }
        state.wrote_through(&self.env(), offset, data, self.recorded_identity(&after));
        h.inode.kernel_wrote_to(offset + data.len() as u64);
        Ok(data.len() as u32)
    }

    pub fn flush(&self, id: u64, fh: u64, lock_owner: u64) -> Result<()> {
        // close() drops the caller's POSIX locks on this file, as on a local file system.
        self.drop_locks(id, lock_owner);
        // Written offline: the content goes to the offline log on close (Coda's store).
        if let Ok(h) = self.handle(fh)
            && h.writes_to_cache()
            && let Some(state) = h.inode.file().as_mut()
        {
            if h.writes == Writes::Uploaded {
                return self.object_store(&h.inode, state);
            }
            return self.offline_store(&h.inode, state);
        }
        Ok(())
    }

    pub fn fsync(&self, fh: u64, datasync: bool) -> Result<()> {
        let h = self.handle(fh)?;
        // The source's sync first, without the file's lock: what was written before this
        // call is on the source when it returns; the checkpoint then records it.
        if let Some(src) = h.source.as_ref() {
            self.source
                .with_fd(src.as_fd(), move |f| {
                    if datasync {
                        f.sync_data()
                    } else {
                        f.sync_all()
                    }
                })
                .map_err(errno)?;
        }
        let mut guard = h.inode.file();
        if let Some(state) = guard.as_mut() {
            if h.writes == Writes::Logged {
                return self.offline_store(&h.inode, state);
            }
            if h.writes == Writes::Uploaded {
                return self.object_store(&h.inode, state);
            }
            state.checkpoint(&self.env());
        }
        Ok(())
    }

    pub fn release(&self, fh: u64) -> Result<()> {
        let Some(h) = self.handles.lock().unwrap().remove(&fh) else {
            return Err(Errno::EBADF);
        };
        // No FLUSH came for it: the locks taken through it go with its last close.
        if let Some(owners) = &h.noflush {
            let owners = std::mem::take(&mut *owners.lock().unwrap());
            for owner in owners {
                self.drop_locks(h.inode.id, owner);
            }
        }
        let mut guard = h.inode.file();
        if h.writes == Writes::Logged {
            if let Some(state) = guard.as_mut()
                && let Err(e) = self.offline_store(&h.inode, state)
            {
                tracing::warn!("cannot log a file written offline at release: {e:?}");
            }
            self.offline_writers.fetch_sub(1, Ordering::Relaxed);
        }
        if h.writes == Writes::Uploaded
            && let Some(state) = guard.as_mut()
            && let Err(e) = self.object_store(&h.inode, state)
        {
            tracing::warn!("cannot upload a written file at release: {e:?}");
        }
        if let Some(state) = guard.as_mut() {
            state.closed(h.open_kind());
            // A reader of the source leaves the cache to be filled from what it read; the
            // last writer to it, with what the writes left (`fs/source_writes.rs`).
            let source_writes = state.source_writers() > 0;
            if h.open_kind() == OpenKind::SourceWriter && !source_writes {
                self.source_writes_done(&h, state);
            } else if h.passthrough.is_some()
                && state.backing_is_source
                && self.source_reads()
                && !source_writes
            {
                self.fill_behind(&h.inode, state);
            }
            // A private mapping of a handle opened beside a direct writer fills the
            // kernel's pages, which the writes then bypassed: none is kept by later opens.
            if h.direct && state.direct_readers_done() {
                h.inode.content_changed();
            }
        }
        // Unloaded now, or by the last fetch still in flight for it (`fs/fetch.rs`).
        self.unload_if_idle(&h.inode, &mut guard);
        drop(guard);
        if h.writes_through_page_cache() && h.inode.page_cache_writer_closed() {
            h.inode.content_changed();
            self.coherence.notify(Notice::Inode(h.inode.id));
        }
        // The source descriptor is closed through the source guard, outside the file's
        // lock (a request still in flight on the handle closes it when done instead).
        drop(h);
        Ok(())
    }

    pub fn fallocate(&self, fh: u64, offset: u64, length: u64, mode: i32) -> Result<()> {
        let h = self.handle(fh)?;
        if h.writes_to_cache() {
            return self.offline_fallocate(&h, offset, length, mode);
        }
        self.changes_allowed()?;
        let src = h.source.as_ref().ok_or(Errno::EBADF)?;
        let mut guard = h.inode.file();
        if let Some(state) = guard.as_mut() {
            state.fetch.invalidate();
            state.mark_written(&self.env());
        }
        let own = self.own_write(&h.inode);
        // Under the source guard: a hung source holds this file's lock no longer than the
        // source timeout.
        let res = self.source.with_fd(src.as_fd(), move |f| {
            let r = unsafe {
                libc::fallocate(
                    std::os::fd::AsRawFd::as_raw_fd(f),
                    mode,
                    offset as i64,
                    length as i64,
                )
            };
            if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        });
        let after = self.source.fstat(src.as_fd()).ok();
        if let Some(after) = &after {
            own.done(after);
        }
        if let Some(state) = guard.as_mut() {
            let after = after.map(|a| self.recorded_identity(&a));
            state.fallocated(res.is_ok(), mode, offset, length, after);
        }
        res.map_err(errno)
    }

    /// SEEK_DATA / SEEK_HOLE answered by the source, which knows its holes.
    pub fn lseek(&self, fh: u64, offset: i64, whence: i32) -> Result<i64> {
        let h = self.handle(fh)?;
        if !self.caps().seek_data {
            // The kernel then seeks by itself (no holes to report): `fuse_lseek`.
            return Err(Errno::ENOSYS);
        }
        let owned;
        let src = match &h.source {
            Some(s) => s,
            None => {
                owned = self
                    .source
                    .open_file(&h.inode.path().ok_or(Errno::ENOENT)?, libc::O_RDONLY)
                    .map_err(errno)?;
                &owned
            }
        };
        self.source
            .with_fd(src.as_fd(), move |f| {
                let r = unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(f), offset, whence) };
                if r < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(r)
            })
            .map_err(errno)
    }
}

//! Offline changes to file contents: opening for writing, writes, `fallocate`, storing a
//! file's content in the log on close or sync, and `create`.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use fuser::{Errno, FileAttr};

use super::{err, now_secs, now_ts};
use crate::fs::{CachingFs, Handle, Inode, OpenKind, Opened, Result, cache_failed, child};
use crate::oplog::{Base, Op, bytes};

impl CachingFs {
    /// Opens `inode` for writing while offline: only a file the cache holds whole (or one
    /// truncated to nothing) can be written.
    pub(in crate::fs) fn offline_open_write(
        &self,
        inode: &Arc<Inode>,
        path: &Path,
        flags: i32,
    ) -> Result<Opened> {
        if !self.logging_offline() {
            return Err(Errno::EROFS);
        }
        let st = self.offline_stat(path)?;
        if !st.is_file() {
            return Err(Errno::EISDIR);
        }
        let mut guard = inode.file();
        if guard.is_none() {
            *guard = Some(Box::new(self.offline_state(inode, path)));
        }
        let state = guard.as_mut().unwrap();
        let truncate = flags & libc::O_TRUNC != 0;
        if !state.complete() && !truncate {
            self.release_if_unused(inode, &mut guard);
            return Err(Errno::EIO);
        }
        if state.offline_base.is_none() {
            let base = self.base_of(&st);
            state.offline_base = Some(self.oplog.lock().unwrap().base_for(path, base));
        }
        if truncate
            && let Err(e) = self.offline_modify(state, Some(path), |f, _| f.set_len(0).map(|_| 0))
        {
            self.release_if_unused(inode, &mut guard);
            return Err(e);
        }
        state.opened(OpenKind::Daemon {
            writes_source: false,
        });
        drop(guard);
        Ok(self.logged_handle(inode))
    }

    fn logged_handle(&self, inode: &Arc<Inode>) -> Opened {
        self.offline_writers.fetch_add(1, Relaxed);
        self.cache_write_handle(inode, crate::fs::Writes::Logged)
    }

    /// Changes the cache file of an offline-written file: `f(data, size)` returns the new
    /// size. The record is marked dirty (durably) first and stays whole. `path` is needed
    /// only when nothing is cached yet; `None` is a file unlinked while open, whose open
    /// cache file takes the writes (as the source file would on a POSIX source).
    pub(in crate::fs) fn offline_modify(
        &self,
        state: &mut crate::fs::FileState,
        path: Option<&Path>,
        f: impl FnOnce(&File, u64) -> io::Result<u64>,
    ) -> Result<()> {
        if state.files().is_none() {
            // Nothing cached: only allowed when the result is empty (a truncation).
            let path = path.ok_or(Errno::EIO)?;
            let files = self.cache.open_files(path).map_err(cache_failed)?;
            state.attach_empty(files, false).map_err(cache_failed)?;
        }
        state.modify_whole(&self.env(), now_ts(), f).map_err(err)
    }

    pub(in crate::fs) fn offline_write(&self, h: &Handle, offset: u64, data: &[u8]) -> Result<u32> {
        if !h.writes_to_cache() {
            // Opened while online: its writes would have gone to the source.
            return Err(Errno::EROFS);
        }
        let path = h.inode.path();
        if !self.usage.may_grow(data.len() as u64) {
            return Err(Errno::ENOSPC);
        }
        let mut guard = h.inode.file();
        let state = guard.as_mut().ok_or(Errno::EBADF)?;
        self.offline_modify(state, path.as_deref(), |f, size| {
            // Counted by what the file grew on disk: an overwrite adds nothing.
            crate::fs::entry::counted(&self.usage, f, || f.write_all_at(data, offset))?;
            Ok(size.max(offset + data.len() as u64))
        })?;
        Ok(data.len() as u32)
    }

    /// `fallocate` of an offline-written file, on its cache file; the modes that shift
    /// data (collapse, insert) are not offered offline.
    pub(in crate::fs) fn offline_fallocate(
        &self,
        h: &Handle,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> Result<()> {
        if mode & (libc::FALLOC_FL_COLLAPSE_RANGE | libc::FALLOC_FL_INSERT_RANGE) != 0 {
            return Err(Errno::EOPNOTSUPP);
        }
        let path = h.inode.path();
        let mut guard = h.inode.file();
        let state = guard.as_mut().ok_or(Errno::EBADF)?;
        self.offline_modify(state, path.as_deref(), |f, size| {
            if unsafe { libc::fallocate(f.as_raw_fd(), mode, offset as i64, length as i64) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(if mode & libc::FALLOC_FL_KEEP_SIZE != 0 {
                size
            } else {
                size.max(offset + length)
            })
        })
    }

    /// Logs the content of an offline-written file (on close and fsync), then makes its
    /// cache record clean again.
    pub(in crate::fs) fn offline_store(
        &self,
        inode: &Inode,
        state: &mut crate::fs::FileState,
    ) -> Result<()> {
        if !state.written() {
            return Ok(());
        }
        let Some(path) = inode.path() else {
            return Ok(()); // unlinked while open: nothing to store
        };
        let files = state.files().ok_or(Errno::EIO)?;
        files.data.sync_data().map_err(err)?;
        let st = self.offline_stat(&path)?;
        let fallback = state.offline_base.unwrap_or(Base::Chained);
        {
            let mut log = self.oplog.lock().unwrap();
            let base = log.base_for(&path, fallback);
            log.stash(&files.data).map_err(|e| {
                tracing::warn!("cannot copy {path:?} into the offline log: {e}");
                Errno::EIO
            })?;
            log.append(
                Op::Store {
                    path: bytes(&path),
                    base,
                    mode: st.mode & 0o7777,
                    owner: Some((st.uid, st.gid)),
                },
                now_secs(),
            )
            .map_err(|e| {
                tracing::warn!(?path, "cannot append to the offline log: {e}");
                Errno::EIO
            })?;
            self.note_pending(&log);
        }
        state.offline_base = Some(Base::Chained);
        state.checkpoint(&self.env());
        Ok(())
    }

    pub(in crate::fs) fn offline_create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        uid: u32,
        gid: u32,
    ) -> Result<(FileAttr, Opened)> {
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        let edits = self.offline_edits.lock().unwrap();
        let dir_st = self.offline_stat(&dir)?;
        if let Some(st) = self.lookup_offline(&path)? {
            drop(edits);
            if flags & libc::O_EXCL != 0 {
                return Err(Errno::EEXIST);
            }
            let inode = self.inodes.lookup(parent, &path, &st);
            let opened = self.offline_open_write(&inode, &path, flags)?;
            return Ok((self.offline_getattr(&inode)?, opened));
        }
        let st = self.synthetic(&dir_st, libc::S_IFREG | (mode & 0o7777), uid, gid);
        // The cache file first: the listing never names a file the cache lacks.
        let _ = self.uncache(&path);
        let files = self.cache.open_files(&path).map_err(cache_failed)?;
        let mut state = self.empty_state(self.identity(&st));
        state.attach_empty(files, true).map_err(cache_failed)?;
        state.offline_base = Some(self.oplog.lock().unwrap().base_for(&path, Base::Absent));
        self.add_listed(&dir, name, st)?;
        drop(edits);
        // A new file is stored on close even if nothing is written to it.
        state.mark_written(&self.env());
        state.opened(OpenKind::Daemon {
            writes_source: false,
        });
        let inode = self.inodes.lookup(parent, &path, &st);
        *inode.file() = Some(Box::new(state));
        self.loaded.lock().unwrap().insert(inode.id, inode.clone());
        let opened = self.logged_handle(&inode);
        Ok((self.attr_told(&inode, &st), opened))
    }
}

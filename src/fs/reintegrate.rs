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

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::SystemTime;

use fuser::{Errno, FileAttr};

use super::Inode;
use super::{CachingFs, Handle, Opened, Result, attr_of, child};
use crate::cache::listing::{DirListing, ListedEntry};
use crate::cache::store::write_record;
use crate::config::OfflineWrites;
use crate::fetch::FileFetch;
use crate::oplog::{Base, Entry, Ident, Op, OpLog, Produced, bytes};
use crate::source::{SetAttr, Stat, TimeSpec};

/// Bytes per source call when replay copies a file (each call is under the timeout).
const COPY_PIECE: usize = 1 << 20;

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

    // ------------------------------------------------------------ file contents

    /// Opens `inode` for writing while offline: only a file the cache holds whole (or one
    /// truncated to nothing) can be written.
    pub(super) fn offline_open_write(
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
            *guard = Some(self.offline_state(inode, path));
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
        state.daemon_opens += 1;
        drop(guard);
        Ok(self.logged_handle(inode))
    }

    fn logged_handle(&self, inode: &Arc<Inode>) -> Opened {
        self.offline_writers.fetch_add(1, Relaxed);
        self.cache_write_handle(inode, super::Writes::Logged)
    }

    /// Changes the cache file of an offline-written file: `f(data, size)` returns the new
    /// size. The record is marked dirty (durably) first and stays whole. `path` is needed
    /// only when nothing is cached yet; `None` is a file unlinked while open, whose open
    /// cache file takes the writes (as the source file would on a POSIX source).
    pub(super) fn offline_modify(
        &self,
        state: &mut super::FileState,
        path: Option<&Path>,
        f: impl FnOnce(&File, u64) -> io::Result<u64>,
    ) -> Result<()> {
        if state.files.is_none() {
            // Nothing cached: only allowed when the result is empty (a truncation).
            let path = path.ok_or(Errno::EIO)?;
            let files = self.cache.open_files(path).map_err(|_| Errno::EIO)?;
            files.data.set_len(0).map_err(|_| Errno::EIO)?;
            state.record.resize(0);
            state.fetch = Arc::new(FileFetch::new(files.data.try_clone().ok()));
            state.files = Some(files);
        }
        state.fetch.invalidate();
        state.mark_written(&self.env());
        let files = state.files.as_ref().ok_or(Errno::EIO)?;
        let size = f(&files.data, state.record.identity.size);
        state.fetch.note_written(&files.data);
        let size = size.map_err(err)?;
        state.record.resize(size);
        for c in 0..state.record.nchunks() {
            state.record.set_present(c, true);
        }
        let now = now_ts();
        state.record.identity.size = size;
        state.record.identity.mtime = now;
        state.record.identity.ctime = now;
        Ok(())
    }

    pub(super) fn offline_write(&self, h: &Handle, offset: u64, data: &[u8]) -> Result<u32> {
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
            super::entry::counted(&self.usage, f, || f.write_all_at(data, offset))?;
            Ok(size.max(offset + data.len() as u64))
        })?;
        Ok(data.len() as u32)
    }

    /// `fallocate` of an offline-written file, on its cache file; the modes that shift
    /// data (collapse, insert) are not offered offline.
    pub(super) fn offline_fallocate(
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
    pub(super) fn offline_store(&self, inode: &Inode, state: &mut super::FileState) -> Result<()> {
        if !state.written {
            return Ok(());
        }
        let Some(path) = inode.path() else {
            return Ok(()); // unlinked while open: nothing to store
        };
        let files = state.files.as_ref().ok_or(Errno::EIO)?;
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
            .map_err(|_| Errno::EIO)?;
            self.note_pending(&log);
        }
        state.offline_base = Some(Base::Chained);
        state.checkpoint(&self.env());
        Ok(())
    }

    pub(super) fn offline_create(
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
        let files = self.cache.open_files(&path).map_err(|_| Errno::EIO)?;
        let mut state = self.empty_state(self.identity(&st));
        files.data.set_len(0).map_err(|_| Errno::EIO)?;
        write_record(&files, &state.record, true).map_err(|_| Errno::EIO)?;
        state.fetch = Arc::new(FileFetch::new(files.data.try_clone().ok()));
        state.files = Some(files);
        state.offline_base = Some(self.oplog.lock().unwrap().base_for(&path, Base::Absent));
        self.add_listed(&dir, name, st)?;
        drop(edits);
        // A new file is stored on close even if nothing is written to it.
        state.mark_written(&self.env());
        state.daemon_opens = 1;
        let inode = self.inodes.lookup(parent, &path, &st);
        *inode.file() = Some(state);
        self.loaded.lock().unwrap().insert(inode.id, inode.clone());
        let opened = self.logged_handle(&inode);
        Ok((attr_of(inode.id, &st), opened))
    }

    // ------------------------------------------------------------ attributes

    pub(super) fn offline_setattr(&self, inode: &Arc<Inode>, attr: &SetAttr) -> Result<FileAttr> {
        if attr.uid.is_some() || attr.gid.is_some() {
            return Err(Errno::EROFS);
        }
        let path = inode.path().ok_or(Errno::ENOENT)?;
        if let Some(size) = attr.size {
            let st = self.offline_stat(&path)?;
            if !st.is_file() {
                return Err(if st.is_dir() {
                    Errno::EISDIR
                } else {
                    Errno::EINVAL
                });
            }
            self.offline_truncate(inode, &path, size)?;
        }
        if attr.mode.is_none() && attr.atime.is_none() && attr.mtime.is_none() {
            return self.offline_getattr(inode);
        }
        let _edits = self.offline_edits.lock().unwrap();
        let st = self.offline_stat(&path)?;
        if st.file_type() == libc::S_IFLNK {
            return Err(Errno::EROFS);
        }
        let now = now_ts();
        let at = |t: Option<TimeSpec>| {
            t.map(|t| match t {
                TimeSpec::Now => now,
                TimeSpec::At(s, n) => (s, n),
            })
        };
        let (atime, mtime) = (at(attr.atime), at(attr.mtime));
        let mode = attr.mode.map(|m| m & 0o7777);
        let base = (!st.is_dir()).then(|| self.base_of(&st));
        self.log_op(|log| Op::SetAttr {
            path: bytes(&path),
            base: base.map(|b| log.base_for(&path, b)),
            mode,
            atime,
            mtime,
        })?;
        let name = path.file_name().map(OsStr::to_os_string);
        let edit = |s: &mut Stat| {
            if let Some(m) = mode {
                s.mode = (s.mode & libc::S_IFMT) | m;
            }
            s.atime = atime.unwrap_or(s.atime);
            s.mtime = mtime.unwrap_or(s.mtime);
            s.ctime = now;
        };
        let r = match &name {
            Some(name) => self.edit_listing(&parent_of(&path), |l| {
                if let Some(e) = l.entries.iter_mut().find(|e| &e.name == name) {
                    edit(&mut e.stat);
                }
                Ok(())
            }),
            None => self.edit_listing(&path, |l| {
                edit(&mut l.dir);
                Ok(())
            }),
        };
        if let Err(e) = r {
            tracing::warn!(
                ?path,
                "offline change logged, but the listing kept the old attributes: {e:?}"
            );
        }
        if let (true, Some(mtime)) = (st.is_file(), mtime) {
            // The record's times overlay the listing's: keep them in step.
            let mut guard = inode.file();
            match guard.as_mut() {
                Some(state) => {
                    state.record.identity.mtime = mtime;
                    state.record.identity.ctime = now;
                    if !state.written {
                        state.persist_record(&self.env(), true);
                    }
                }
                None => {
                    if let Some(files) = self.cache.open_existing(&path)
                        && let Ok(Some(Ok(mut rec))) = crate::cache::store::read_record(&files)
                    {
                        rec.identity.mtime = mtime;
                        rec.identity.ctime = now;
                        let _ = write_record(&files, &rec, true);
                    }
                }
            }
        }
        self.offline_getattr(inode)
    }

    /// Truncation offline: through the open state if there is one (stored on close),
    /// else stored at once.
    fn offline_truncate(&self, inode: &Arc<Inode>, path: &Path, size: u64) -> Result<()> {
        let mut guard = inode.file();
        let opened_here = guard.is_none();
        if opened_here {
            *guard = Some(self.offline_state(inode, path));
        }
        let state = guard.as_mut().unwrap();
        let r = (|| {
            if !state.complete() && size > 0 {
                return Err(Errno::EIO);
            }
            if state.offline_base.is_none() {
                let base = self.base_of(&self.offline_stat(path)?);
                state.offline_base = Some(self.oplog.lock().unwrap().base_for(path, base));
            }
            self.offline_modify(state, Some(path), |f, _| f.set_len(size).map(|_| size))?;
            if state.daemon_opens == 0 {
                self.offline_store(inode, state)?;
            }
            Ok(())
        })();
        if opened_here {
            self.release_if_unused(inode, &mut guard);
        }
        r
    }

    // ------------------------------------------------------------ names

    pub(super) fn offline_mkdir(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        let _edits = self.offline_edits.lock().unwrap();
        let dir_st = self.offline_stat(&dir)?;
        if self.lookup_offline(&path)?.is_some() {
            return Err(Errno::EEXIST);
        }
        let st = self.synthetic(&dir_st, libc::S_IFDIR | (mode & 0o7777), uid, gid);
        self.log_op(|_| Op::Mkdir {
            path: bytes(&path),
            mode: mode & 0o7777,
            owner: Some((st.uid, st.gid)),
        })?;
        let listing = DirListing {
            path: path.clone(),
            dir: st,
            entries: Vec::new(),
        };
        let _ = self.uncache(&path);
        if let Err(e) = self.cache.save_listing(&listing) {
            tracing::warn!(
                ?path,
                "cannot save the listing of a directory made offline: {e}"
            );
        }
        self.add_listed(&dir, name, st)?;
        let inode = self.inodes.lookup(parent, &path, &st);
        Ok(attr_of(inode.id, &st))
    }

    pub(super) fn offline_unlink(&self, parent: u64, name: &OsStr) -> Result<()> {
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        let _edits = self.offline_edits.lock().unwrap();
        let st = self.offline_stat(&path)?;
        if st.is_dir() {
            return Err(Errno::EISDIR);
        }
        let base = self.base_of(&st);
        self.log_op(|log| Op::Unlink {
            path: bytes(&path),
            base: log.base_for(&path, base),
        })?;
        self.forget_name(&path, &st);
        Ok(())
    }

    /// `path` (with attributes `st`) is gone from the offline view.
    fn forget_name(&self, path: &Path, st: &Stat) {
        let name = path.file_name().unwrap_or_default().to_os_string();
        if let Err(e) = self.edit_listing(&parent_of(path), |l| {
            l.entries.retain(|e| e.name != name);
            Ok(())
        }) {
            tracing::warn!(
                ?path,
                "offline change logged, but the listing still names it: {e:?}"
            );
        }
        if let Some(inode) = self.inodes.find(path, st) {
            inode.remove_name(path);
            self.inodes.unlinked(&inode);
        }
        if let Err(e) = self.uncache(path) {
            tracing::warn!(?path, "cannot drop cache entry: {e}");
        }
    }

    pub(super) fn offline_rmdir(&self, parent: u64, name: &OsStr) -> Result<()> {
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        let _edits = self.offline_edits.lock().unwrap();
        let st = self.offline_stat(&path)?;
        if !st.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        if !self
            .listing_for(&path, Some(&st))?
            .listing
            .entries
            .is_empty()
        {
            return Err(Errno::ENOTEMPTY);
        }
        self.log_op(|_| Op::Rmdir { path: bytes(&path) })?;
        self.forget_name(&path, &st);
        self.listing_changed(&path);
        Ok(())
    }

    pub(super) fn offline_rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> Result<()> {
        if flags & libc::RENAME_EXCHANGE != 0 || flags & libc::RENAME_WHITEOUT != 0 {
            return Err(Errno::EINVAL);
        }
        let from = child(&self.path_of(parent)?, name)?;
        let to = child(&self.path_of(newparent)?, newname)?;
        let _whole = self.renames.read().unwrap();
        let _edits = self.offline_edits.lock().unwrap();
        let from_st = self.offline_stat(&from)?;
        if from_st.is_dir() {
            // Moving a subtree offline is not logged: mv falls back to copy and delete.
            return Err(Errno::EXDEV);
        }
        let to_st = self.lookup_offline(&to)?;
        if let Some(t) = &to_st {
            if flags & libc::RENAME_NOREPLACE != 0 {
                return Err(Errno::EEXIST);
            }
            if t.is_dir() {
                return Err(Errno::EISDIR);
            }
            if (t.dev, t.ino) == (from_st.dev, from_st.ino) {
                return Ok(()); // the same file
            }
        }
        // The listing needs the destination directory's listing too.
        self.listing_for(&parent_of(&to), None)?;
        let (base_from, base_to) = (
            self.base_of(&from_st),
            to_st.map_or(Base::Absent, |t| self.base_of(&t)),
        );
        self.log_op(|log| Op::Rename {
            from: bytes(&from),
            to: bytes(&to),
            base_from: log.base_for(&from, base_from),
            base_to: log.base_for(&to, base_to),
        })?;
        // The entry as listed (the record's newer size and times overlay it).
        let listed = self
            .listing_for(&parent_of(&from), None)?
            .find(name)
            .cloned()
            .ok_or(Errno::ENOENT)?;
        let r = self
            .edit_listing(&parent_of(&from), |l| {
                l.entries.retain(|e| e.name != name);
                Ok(())
            })
            .and_then(|_| {
                self.edit_listing(&parent_of(&to), |l| {
                    l.entries.retain(|e| e.name != newname);
                    l.entries.push(ListedEntry {
                        name: newname.to_os_string(),
                        ..listed
                    });
                    Ok(())
                })
            });
        if let Err(e) = r {
            tracing::warn!(
                ?from,
                ?to,
                "offline rename logged, but the listings lag: {e:?}"
            );
        }
        if let Some(t) = &to_st
            && let Some(inode) = self.inodes.find(&to, t)
        {
            inode.remove_name(&to);
            self.inodes.unlinked(&inode);
        }
        self.inodes.renamed(&from, &to, false, parent, newparent);
        self.cache.rename(&from, &to, 0);
        self.cache_renamed(&[&to]);
        Ok(())
    }

    // ------------------------------------------------------------ reintegration

    /// The source answers: replays the offline log (if any) and goes online. Refused while
    /// files written offline are still open.
    pub fn reconnect(&self, manual: bool) -> std::result::Result<(), String> {
        let mut log = self.oplog.lock().unwrap();
        if log.is_empty() {
            drop(log);
            self.source.health.go_online(manual);
            return Ok(());
        }
        let writers = self.offline_writers.load(Relaxed);
        if writers > 0 {
            return Err(format!(
                "{writers} file(s) written offline are still open: the offline changes are \
                 replayed once they are closed"
            ));
        }
        let dirs = self.replay(&mut log)?;
        drop(log);
        self.source.health.go_online(manual);
        // The listings edited offline are replaced by the source's own.
        for dir in dirs {
            self.listing_changed(&dir);
            if let Ok(entries) = self.source.read_dir(&dir) {
                self.save_listing(&dir, &entries);
            }
        }
        Ok(())
    }

    /// Replays every pending entry in order; returns the directories it changed.
    fn replay(&self, log: &mut OpLog) -> std::result::Result<BTreeSet<PathBuf>, String> {
        let mut produced = log.produced_map();
        let mut dirs = BTreeSet::new();
        tracing::info!(
            "replaying {} offline change(s) to the source",
            log.pending().len()
        );
        while let Some(e) = log.pending().first().cloned() {
            if let Some(p) = superseded(log.pending()) {
                // Coda's log optimisation: only the last of a run of stores is sent; the
                // first one's base is checked then.
                if let Op::Store { base, .. } = &e.op
                    && *base != Base::Chained
                {
                    produced.insert(p, Produced::Carried(*base));
                }
                self.record_replayed(log, e.seq, &produced)?;
                continue;
            }
            match self.replay_one(&e, log, &mut produced) {
                Ok(()) => failpoint_after_replay(),
                Err(err) if crate::source::may_mean_unreachable(&err) => {
                    return Err(format!("replay of offline change {} stopped: {err}", e.seq));
                }
                Err(err) => {
                    if let Op::Store { path, .. } = &e.op {
                        let kept = self.keep_aside(&e, log);
                        self.report(
                            &e,
                            &format!(
                                "could not be written to {:?} ({err}); the content is kept at {}",
                                crate::oplog::path(path),
                                kept
                            ),
                        );
                    } else {
                        self.report(&e, &format!("could not be applied: {err}"));
                    }
                    for p in e.op.paths() {
                        produced.insert(p, Produced::Conflicted);
                    }
                }
            }
            for p in e.op.paths() {
                if matches!(e.op, Op::Mkdir { .. }) {
                    dirs.insert(p.clone());
                }
                dirs.insert(parent_of(&p));
            }
            self.record_replayed(log, e.seq, &produced)?;
        }
        Ok(dirs)
    }

    /// Entry `seq` is done: its progress is durable and counted.
    fn record_replayed(
        &self,
        log: &mut OpLog,
        seq: u64,
        produced: &HashMap<PathBuf, Produced>,
    ) -> std::result::Result<(), String> {
        log.applied(seq, produced)
            .map_err(|err| format!("cannot record replay progress: {err}"))?;
        self.source.health.log_replayed.fetch_add(1, Relaxed);
        self.note_pending(log);
        Ok(())
    }

    /// Publishes how many logged changes wait (`hoardfs stats`, metrics).
    fn note_pending(&self, log: &OpLog) {
        self.source
            .health
            .log_pending
            .store(log.pending().len() as u64, Relaxed);
    }

    /// Copies a Store's content that fits nowhere in the source into the cache's
    /// `lost+found/`; returns where.
    fn keep_aside(&self, e: &Entry, log: &OpLog) -> String {
        let name = e.op.paths()[0]
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let name = format!("{}-{name}", e.seq);
        let r = (|| -> io::Result<()> {
            let dir = self.cache.private_dir("lost+found")?;
            let mut from = log.open_container(e.seq)?;
            let mut to = crate::cache::store::private_file(
                &dir,
                Path::new(&name),
                rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::TRUNC,
                true,
            )?;
            io::copy(&mut from, &mut to)?;
            to.sync_all()
        })();
        match r {
            Ok(()) => self
                .cache
                .root()
                .join("lost+found")
                .join(name)
                .display()
                .to_string(),
            Err(err) => format!("(nowhere: {err})"),
        }
    }

    /// Reports a conflict or failed change: the log, `<cache>/conflicts.log`, the counter.
    fn report(&self, e: &Entry, what: &str) {
        let paths: Vec<String> =
            e.op.paths()
                .iter()
                .map(|p| p.display().to_string())
                .collect();
        let line = format!(
            "{} offline change {} made {} to {}: {what}\n",
            stamp(now_secs()),
            e.seq,
            stamp(e.at),
            paths.join(" -> ")
        );
        tracing::warn!("{}", line.trim_end());
        self.source.health.conflicts.fetch_add(1, Relaxed);
        let r = crate::cache::store::private_file(
            self.cache.top(),
            Path::new("conflicts.log"),
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::APPEND,
            true,
        )
        .and_then(|mut f| f.write_all(line.as_bytes()).and_then(|_| f.sync_data()));
        if let Err(err) = r {
            tracing::warn!("cannot write conflicts.log: {err}");
        }
    }

    fn current(&self, p: &Path) -> io::Result<Option<Stat>> {
        let p = p.to_path_buf();
        self.source.call_anyway(move |r| match r.stat(&p) {
            Ok(st) => Ok(Some(st)),
            Err(e) if matches!(os_errno(&e), Some(libc::ENOENT | libc::ENOTDIR)) => Ok(None),
            Err(e) => Err(e),
        })
    }

    fn ident(&self, st: Option<&Stat>) -> Option<Ident> {
        st.map(|s| Ident::from(self.identity(s)))
    }

    /// Whether the source's `cur` at `p` is the version a change with `base` was made to.
    fn base_holds(
        &self,
        base: Base,
        cur: Option<&Stat>,
        p: &Path,
        produced: &HashMap<PathBuf, Produced>,
    ) -> bool {
        let now = self.ident(cur);
        match base {
            Base::Source(id) => now == Some(id),
            Base::Absent => now.is_none(),
            Base::Chained => match produced.get(p) {
                Some(Produced::Left(x)) => *x == now,
                Some(Produced::Carried(b)) if *b != Base::Chained => {
                    self.base_holds(*b, cur, p, produced)
                }
                _ => false,
            },
        }
    }

    fn replay_one(
        &self,
        e: &Entry,
        log: &mut OpLog,
        produced: &mut HashMap<PathBuf, Produced>,
    ) -> io::Result<()> {
        match &e.op {
            Op::Store {
                path,
                base,
                mode,
                owner,
            } => {
                let p = crate::oplog::path(path);
                let container = log.open_container(e.seq)?;
                let cur = self.current(&p)?;
                if self.base_holds(*base, cur.as_ref(), &p, produced) {
                    let owner = cur.as_ref().map(|s| (s.uid, s.gid)).or(*owner);
                    match self.upload(&p, e.seq, &container, *mode, owner, cur.is_some()) {
                        Ok(()) => {
                            let after = self.current(&p)?;
                            produced.insert(p.clone(), Produced::Left(self.ident(after.as_ref())));
                            self.settle_cache(&p, &container, after.as_ref());
                            return Ok(());
                        }
                        Err(err) if os_errno(&err) != Some(libc::EEXIST) => return Err(err),
                        Err(_) => {} // made on the source meanwhile: a conflict
                    }
                } else if cur.as_ref().is_some_and(|s| s.is_file())
                    && self.same_content(&p, &container)?
                {
                    // Done before a crash (or the source has this very content).
                    produced.insert(p.clone(), Produced::Left(self.ident(cur.as_ref())));
                    return Ok(());
                }
                let aside = conflict_path(&p, e);
                let done =
                    self.current(&aside)?.is_some() && self.same_content(&aside, &container)?;
                if !done {
                    self.upload(&aside, e.seq, &container, *mode, *owner, false)?;
                }
                self.report(
                    e,
                    &format!(
                        "conflict: the source's {} is not the version changed offline; the \
                         source's is kept, this mount's is at {}",
                        p.display(),
                        aside.display()
                    ),
                );
                produced.insert(p.clone(), Produced::Conflicted);
                let _ = self.uncache(&p);
                Ok(())
            }
            Op::Unlink { path, base } => {
                let p = crate::oplog::path(path);
                let cur = self.current(&p)?;
                if cur.is_none() {
                    produced.insert(p, Produced::Left(None));
                } else if self.base_holds(*base, cur.as_ref(), &p, produced) {
                    let q = p.clone();
                    self.source.call_anyway(move |r| r.unlink(&q))?;
                    produced.insert(p, Produced::Left(None));
                } else {
                    self.report(
                        e,
                        "conflict: deleted offline, but changed on the source meanwhile; \
                         the source's version is kept",
                    );
                    produced.insert(p, Produced::Conflicted);
                }
                Ok(())
            }
            Op::Mkdir { path, mode, owner } => {
                let p = crate::oplog::path(path);
                match self.current(&p)? {
                    Some(st) if st.is_dir() => {}
                    Some(_) => {
                        self.report(
                            e,
                            "conflict: a non-directory of that name exists on the source",
                        );
                        produced.insert(p, Produced::Conflicted);
                        return Ok(());
                    }
                    None => {
                        let (q, mode, owner) = (p.clone(), *mode, *owner);
                        let root = rustix::process::geteuid().is_root();
                        self.source.call_anyway(move |r| {
                            r.mkdir(&q, mode)?;
                            match owner {
                                Some((uid, gid)) if root => r.chown_new(&q, uid, Some(gid)),
                                _ => Ok(()),
                            }
                        })?;
                    }
                }
                let after = self.current(&p)?;
                produced.insert(p, Produced::Left(self.ident(after.as_ref())));
                Ok(())
            }
            Op::Rmdir { path } => {
                let p = crate::oplog::path(path);
                let q = p.clone();
                match self.source.call_anyway(move |r| r.rmdir(&q)) {
                    Ok(()) => {}
                    Err(err) if os_errno(&err) == Some(libc::ENOENT) => {}
                    Err(err) if matches!(os_errno(&err), Some(libc::ENOTEMPTY | libc::EEXIST)) => {
                        self.report(
                            e,
                            "conflict: removed offline, but the source has new entries in it; kept",
                        );
                        produced.insert(p, Produced::Conflicted);
                        return Ok(());
                    }
                    Err(err) => return Err(err),
                }
                produced.insert(p, Produced::Left(None));
                Ok(())
            }
            Op::Rename {
                from,
                to,
                base_from,
                base_to,
            } => {
                let (f, t) = (crate::oplog::path(from), crate::oplog::path(to));
                let cur_from = self.current(&f)?;
                let cur_to = self.current(&t)?;
                if cur_from.is_none() {
                    if log.progress().in_flight == Some(e.seq) && cur_to.is_some() {
                        // Renamed before a crash.
                        produced.insert(f, Produced::Left(None));
                        produced.insert(t, Produced::Left(self.ident(cur_to.as_ref())));
                    } else {
                        self.report(e, "conflict: renamed offline, but gone from the source");
                        produced.insert(f, Produced::Conflicted);
                        produced.insert(t, Produced::Conflicted);
                    }
                    return Ok(());
                }
                if !self.base_holds(*base_from, cur_from.as_ref(), &f, produced) {
                    self.report(
                        e,
                        "conflict: renamed offline, but changed on the source meanwhile; not \
                         renamed, and later offline changes to the new name go to conflict copies",
                    );
                    produced.insert(f, Produced::Conflicted);
                    produced.insert(t, Produced::Conflicted);
                    return Ok(());
                }
                let to_holds = self.base_holds(*base_to, cur_to.as_ref(), &t, produced);
                let dest = if to_holds {
                    t.clone()
                } else {
                    conflict_path(&t, e)
                };
                log.begin(e.seq)?;
                let flags = if to_holds && cur_to.is_some() {
                    0
                } else {
                    libc::RENAME_NOREPLACE
                };
                let (q, d) = (f.clone(), dest.clone());
                self.source.call_anyway(move |r| rename(r, &q, &d, flags))?;
                produced.insert(f, Produced::Left(None));
                if to_holds {
                    let after = self.current(&t)?;
                    produced.insert(t, Produced::Left(self.ident(after.as_ref())));
                } else {
                    self.report(
                        e,
                        &format!(
                            "conflict: the rename's target changed on the source meanwhile; \
                             the source's is kept, the renamed file is at {}",
                            dest.display()
                        ),
                    );
                    produced.insert(t, Produced::Conflicted);
                }
                Ok(())
            }
            Op::SetAttr {
                path,
                base,
                mode,
                atime,
                mtime,
            } => {
                let p = crate::oplog::path(path);
                let cur = self.current(&p)?;
                let holds = match base {
                    None => cur.is_some(),
                    Some(b) => self.base_holds(*b, cur.as_ref(), &p, produced),
                };
                let already = log.progress().in_flight == Some(e.seq)
                    && cur.as_ref().is_some_and(|s| {
                        mode.is_none_or(|m| s.mode & 0o7777 == m)
                            && mtime.is_none_or(|t| s.mtime == t)
                    });
                if already {
                    // Applied before a crash.
                    if base.is_some() {
                        produced.insert(p, Produced::Left(self.ident(cur.as_ref())));
                    }
                    return Ok(());
                }
                if !holds {
                    self.report(
                        e,
                        "conflict: the mode or times set offline were not applied: the source's \
                         object changed or is gone",
                    );
                    if base.is_some() {
                        produced.insert(p, Produced::Conflicted);
                    }
                    return Ok(());
                }
                let set = SetAttr {
                    mode: *mode,
                    atime: atime.map(|(s, n)| TimeSpec::At(s, n)),
                    mtime: mtime.map(|(s, n)| TimeSpec::At(s, n)),
                    ..Default::default()
                };
                let q = p.clone();
                log.begin(e.seq)?;
                self.source
                    .call_anyway(move |r| r.set_attr(Some(&q), None, &set))?;
                if base.is_some() {
                    let after = self.current(&p)?;
                    produced.insert(p, Produced::Left(self.ident(after.as_ref())));
                }
                Ok(())
            }
        }
    }

    /// Writes `container` to the source as `p`: into a temporary file beside it, synced,
    /// given `mode` and `owner`, then renamed over `p` (`replace`) or to the free name `p`.
    fn upload(
        &self,
        p: &Path,
        seq: u64,
        container: &File,
        mode: u32,
        owner: Option<(u32, u32)>,
        replace: bool,
    ) -> io::Result<()> {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        let tmp = p.with_file_name(format!(".{name}.hoardfs-replay-{seq}"));
        let q = tmp.clone();
        let out = self.source.call_anyway(move |r| {
            match r.unlink(&q) {
                Err(e) if os_errno(&e) != Some(libc::ENOENT) => return Err(e),
                _ => {}
            }
            r.create_file(&q, libc::O_WRONLY | libc::O_EXCL, 0o600)
        })?;
        let out = Arc::new(out);
        let src = container;
        let mut off = 0u64;
        loop {
            let mut buf = vec![0u8; COPY_PIECE];
            let n = crate::source::read_full(src, &mut buf, off)?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
            let o = out.clone();
            self.source
                .call_anyway(move |_| o.write_all_at(&buf, off))?;
            off += n as u64;
        }
        let root = rustix::process::geteuid().is_root();
        let o = out.clone();
        self.source.call_anyway(move |_| {
            o.sync_all()?;
            if let Some((uid, gid)) = owner.filter(|_| root) {
                rustix::fs::fchown(
                    &*o,
                    Some(rustix::fs::Uid::from_raw(uid)),
                    Some(rustix::fs::Gid::from_raw(gid)),
                )?;
            }
            // After chown, which clears set-id bits.
            if unsafe { libc::fchmod(o.as_raw_fd(), mode & 0o7777) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })?;
        let (q, d) = (tmp.clone(), p.to_path_buf());
        let flags = if replace { 0 } else { libc::RENAME_NOREPLACE };
        let r = self.source.call_anyway(move |r| rename(r, &q, &d, flags));
        if r.is_err() {
            let q = tmp.clone();
            let _ = self.source.call_anyway(move |r| r.unlink(&q));
        }
        r
    }

    /// Whether the source file `p` holds exactly the bytes of `container`.
    fn same_content(&self, p: &Path, container: &File) -> io::Result<bool> {
        let mine = container;
        let q = p.to_path_buf();
        let theirs = match self
            .source
            .call_anyway(move |r| r.open_file(&q, libc::O_RDONLY))
        {
            Ok(f) => Arc::new(f),
            Err(e) if matches!(os_errno(&e), Some(libc::ENOENT | libc::ENOTDIR)) => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        if theirs.metadata()?.len() != mine.metadata()?.len() {
            return Ok(false);
        }
        let mut off = 0u64;
        loop {
            let mut a = vec![0u8; COPY_PIECE];
            let n = crate::source::read_full(mine, &mut a, off)?;
            if n == 0 {
                return Ok(true);
            }
            a.truncate(n);
            let t = theirs.clone();
            let b = self.source.call_anyway(move |_| {
                let mut b = vec![0u8; n];
                let got = crate::source::read_full(&t, &mut b, off)?;
                b.truncate(got);
                Ok(b)
            })?;
            if a != b {
                return Ok(false);
            }
            off += n as u64;
        }
    }

    /// After a Store reached the source: the cache keeps the file if it holds exactly
    /// what was sent (its record then vouches for the source's new version), else drops
    /// it. Files open through the mount are revalidated when the mount goes online.
    fn settle_cache(&self, p: &Path, container: &File, after: Option<&Stat>) {
        let Some(after) = after else { return };
        let open = self
            .loaded
            .lock()
            .unwrap()
            .values()
            .any(|i| i.path().as_deref() == Some(p));
        if open {
            return;
        }
        let Some(files) = self.cache.open_existing(p) else {
            return;
        };
        let same = (|| -> io::Result<bool> {
            let sent = container;
            let len = sent.metadata()?.len();
            if len != after.size || files.data.metadata()?.len() != len {
                return Ok(false);
            }
            // Piece by piece: a file can be larger than memory.
            let (mut a, mut b) = (vec![0u8; COPY_PIECE], vec![0u8; COPY_PIECE]);
            let mut off = 0;
            while off < len {
                let n = crate::source::read_full(sent, &mut a, off)?;
                if n == 0
                    || crate::source::read_full(&files.data, &mut b[..n], off)? != n
                    || a[..n] != b[..n]
                {
                    return Ok(false);
                }
                off += n as u64;
            }
            Ok(true)
        })();
        match (same, crate::cache::store::read_record(&files)) {
            (Ok(true), Ok(Some(Ok(mut rec)))) if !rec.dirty => {
                rec.identity = self.recorded_identity(after);
                if write_record(&files, &rec, true).is_err() {
                    let _ = self.uncache(p);
                }
            }
            _ => {
                let _ = self.uncache(p);
            }
        }
    }
}

/// The path of `pending[0]` if it is a Store that a later Store of the same path replaces
/// with nothing else touching that path in between.
fn superseded(pending: &[Entry]) -> Option<PathBuf> {
    let Op::Store { path, .. } = &pending.first()?.op else {
        return None;
    };
    let p = crate::oplog::path(path);
    let next = pending[1..].iter().find(|e| e.op.paths().contains(&p))?;
    matches!(&next.op, Op::Store { path: q, base: Base::Chained, .. } if *q == *path).then_some(p)
}

/// Test failpoint: with `HOARDFS_FAILPOINT_REPLAY_ABORT=N`, the daemon aborts right after
/// the N-th change it replays has reached the source and before that is recorded: the
/// worst instant for a crash (tests/offline.rs).
fn failpoint_after_replay() {
    use std::sync::atomic::AtomicU64;
    static DONE: AtomicU64 = AtomicU64::new(0);
    let Some(n) = std::env::var("HOARDFS_FAILPOINT_REPLAY_ABORT")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    else {
        return;
    };
    if DONE.fetch_add(1, Relaxed) + 1 == n {
        tracing::error!("failpoint: aborting after replayed change {n}");
        std::process::abort();
    }
}

/// `rename`, where `RENAME_NOREPLACE` also works on sources without `renameat2` flags
/// (FUSE sources such as sshfs and bindfs answer `EINVAL`): there a hard link stands in
/// (it never replaces), or, where links are not supported either, a check just before.
fn rename(r: &crate::source::BeneathRoot, from: &Path, to: &Path, flags: u32) -> io::Result<()> {
    match r.rename(from, to, flags) {
        Err(e) if flags == libc::RENAME_NOREPLACE && os_errno(&e) == Some(libc::EINVAL) => {
            match r.link(from, to) {
                Ok(()) => r.unlink(from),
                Err(e) if os_errno(&e) == Some(libc::EEXIST) => Err(e),
                Err(_) => match r.stat(to) {
                    Ok(_) => Err(io::Error::from_raw_os_error(libc::EEXIST)),
                    Err(_) => r.rename(from, to, 0),
                },
            }
        }
        r => r,
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

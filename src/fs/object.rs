//! Writing to an object-store source (`object_tree.rs`): an object cannot be changed in
//! place, so a file opened for writing is made whole in the cache first (read-modify-
//! upload), written there like an offline write (`reintegrate::offline_modify`), and
//! uploaded whole on flush (close), fsync and release; the call returns when the store
//! has it. Names and attributes go to the store at once, as for a directory source.
//!
//! Not done: offline changes to an object store (`offline_writes=log` is refused at
//! start), hard links and symlinks (`EPERM`), directory rename (`EXDEV`).

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{Errno, FileAttr, FopenFlags};

use super::Inode;
use super::state::Look;
use super::{
    CachingFs, FileState, Handle, OpenKind, Opened, Result, Writes, cache_failed, child, errno,
};
use crate::fetch::HandleFetch;
use crate::source::{SetAttr, Stat, TimeSpec};

fn time_of((s, ns): (i64, u32)) -> SystemTime {
    if s >= 0 {
        UNIX_EPOCH + Duration::new(s as u64, ns)
    } else {
        UNIX_EPOCH - Duration::from_secs(s.unsigned_abs()) + Duration::from_nanos(ns.into())
    }
}

impl CachingFs {
    /// Makes an open state ready for an upload handle: the file whole in the cache (or
    /// emptied, with `O_TRUNC`).
    pub(super) fn object_prepare_write(
        &self,
        state: &mut FileState,
        path: &Path,
        flags: i32,
    ) -> Result<()> {
        if flags & libc::O_TRUNC != 0 {
            if state.record().identity.size > 0 || state.files().is_none() {
                self.offline_modify(state, Some(path), |f, _| f.set_len(0).map(|_| 0))?;
            }
            return Ok(());
        }
        if !state.complete() {
            if state.fetch_src.is_none() {
                state.fetch_src = self
                    .fetcher
                    .open_source(|| self.open_fetch_reader(path, &state.record().identity));
            }
            self.fetch_all(state);
        }
        if !state.complete() {
            // Without the whole object in the cache an upload would lose its other bytes.
            return Err(Errno::EIO);
        }
        Ok(())
    }

    /// A handle whose writes go to the cache file (`writes`: logged offline, or uploaded on
    /// close). Shared with `reintegrate::logged_handle`.
    pub(super) fn cache_write_handle(&self, inode: &Arc<Inode>, writes: Writes) -> Opened {
        let fh = self.new_fh();
        inode.hand_out();
        // (Its writes go to the cache file, through the kernel's page cache.)
        inode.page_cache_writer_opened();
        inode.wait_for_page_invalidation();
        self.handles.lock().unwrap().insert(
            fh,
            Arc::new(Handle {
                inode: inode.clone(),
                source: None,
                writable: true,
                passthrough: None,
                direct: false,
                fetch: HandleFetch::default(),
                writes,
                noflush: None,
            }),
        );
        Opened {
            fh,
            flags: FopenFlags::empty(),
            backing: None,
        }
    }

    /// Uploads a file written through the mount, if it was, and makes the cache record
    /// name the new object (clean again).
    pub(super) fn object_store(&self, inode: &Inode, state: &mut FileState) -> Result<()> {
        if !state.written() {
            return Ok(());
        }
        let Some(path) = inode.path() else {
            return Ok(()); // unlinked while open: nothing to upload
        };
        let files = state.files().ok_or(Errno::EIO)?;
        let keep = self.source.stat(&path).ok();
        let mtime = time_of(state.record().identity.mtime);
        let after = self
            .source
            .upload(&path, &files.data, keep, mtime)
            .map_err(|e| {
                tracing::warn!(?path, "upload failed: {e}");
                errno(e)
            })?;
        Stats::add(&self.stats.cache.uploads, 1);
        Stats::add(&self.stats.cache.bytes_uploaded, after.size);
        state.own_version(self.identity(&after));
        state.checkpoint(&self.env());
        // Under the file's lock, with the pending mark cleared: see `pending_attr`.
        self.uploads_done.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    pub(super) fn object_create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        uid: u32,
        gid: u32,
    ) -> Result<(FileAttr, Opened)> {
        self.changes_allowed()?;
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        match self.source.stat(&path) {
            Ok(_) if flags & libc::O_EXCL != 0 => return Err(Errno::EEXIST),
            Ok(st) => {
                let inode = self.inodes.lookup(parent, &path, &st);
                let opened = self.object_open_write(&inode, &path, &st, flags)?;
                return Ok((self.getattr(inode.id, Some(opened.fh))?, opened));
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(errno(e)),
        }
        // The empty object at once, so that the name exists for everyone (and a
        // following stat finds it) before the first close uploads the content.
        let _ = self.uncache(&path);
        let files = self.cache.open_files(&path).map_err(cache_failed)?;
        let owner = self.new_owner(&dir, uid, gid)?;
        let keep = Stat {
            mode: mode & 0o7777,
            uid: owner.0,
            gid: owner.1,
            ..self.source.stat(&dir).map_err(errno)?
        };
        let st = self
            .source
            .upload(&path, &files.data, Some(keep), SystemTime::now())
            .map_err(errno)?;
        self.listing_changed(&dir);
        let inode = self.inodes.lookup(parent, &path, &st);
        let mut state = self.empty_state(self.identity(&st));
        state.attach_empty(files, true).map_err(cache_failed)?;
        state.opened(OpenKind::Daemon {
            writes_source: false,
        });
        {
            let mut guard = inode.file();
            if let Some(old) = guard.as_mut() {
                // Open under an earlier object of this name: that one is gone.
                old.opened(OpenKind::Daemon {
                    writes_source: false,
                });
                self.reset(old, &st, Some(&path));
            } else {
                *guard = Some(Box::new(state));
                self.loaded.lock().unwrap().insert(inode.id, inode.clone());
            }
        }
        Ok((
            self.attr_told(&inode, &st),
            self.cache_write_handle(&inode, Writes::Uploaded),
        ))
    }

    /// Opens an existing object for writing: `open_online` has loaded its state.
    pub(super) fn object_open_write(
        &self,
        inode: &Arc<Inode>,
        path: &Path,
        st: &Stat,
        flags: i32,
    ) -> Result<Opened> {
        if !st.is_file() {
            return Err(Errno::EISDIR);
        }
        let mut guard = inode.file();
        if guard.is_none() {
            let (state, _) = self.load_state(inode, path, &mut { *st }, Look::Source);
            *guard = Some(Box::new(state));
        }
        let state = guard.as_mut().unwrap();
        if let Err(e) = self.object_prepare_write(state, path, flags) {
            self.release_if_unused(inode, &mut guard);
            return Err(e);
        }
        state.opened(OpenKind::Daemon {
            writes_source: false,
        });
        drop(guard);
        Ok(self.cache_write_handle(inode, Writes::Uploaded))
    }

    /// The owner of a new object: the caller, with the directory's group where the
    /// directory is setgid. Only root may give objects away; others own what they make.
    fn new_owner(&self, dir: &Path, uid: u32, gid: u32) -> Result<(u32, u32)> {
        if !rustix::process::geteuid().is_root() {
            let me = (
                rustix::process::geteuid().as_raw(),
                rustix::process::getegid().as_raw(),
            );
            return Ok(me);
        }
        let dst = self.source.stat(dir).map_err(errno)?;
        Ok((
            uid,
            if dst.mode & libc::S_ISGID != 0 {
                dst.gid
            } else {
                gid
            },
        ))
    }

    pub(super) fn object_mkdir(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        self.changes_allowed()?;
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        let owner = self.new_owner(&dir, uid, gid)?;
        let st = self.source.mkdir_owned(&path, mode, owner).map_err(errno)?;
        self.listing_changed(&dir);
        let inode = self.inodes.lookup(parent, &path, &st);
        Ok(self.attr_told(&inode, &st))
    }

    /// setattr on an object store: a size change goes through the cache file and is
    /// uploaded at once (or at the close of an open writer); mode, owner and mtime become
    /// metadata.
    pub(super) fn object_setattr(&self, inode: &Arc<Inode>, attr: SetAttr) -> Result<FileAttr> {
        self.changes_allowed()?;
        let path = inode.path().ok_or(Errno::ENOENT)?;
        let before = self.source.stat(&path).map_err(errno)?;
        self.listing_changed(path.parent().unwrap_or(Path::new("")));
        if let Some(size) = attr.size {
            if !before.is_file() {
                return Err(if before.is_dir() {
                    Errno::EISDIR
                } else {
                    Errno::EINVAL
                });
            }
            self.object_truncate(inode, &path, &before, size)?;
        }
        let meta = SetAttr {
            size: None,
            atime: None,
            ..attr
        };
        let seen = self.uploads_seen();
        let mut after = if meta.mode.is_some()
            || meta.uid.is_some()
            || meta.gid.is_some()
            || meta.mtime.is_some()
        {
            self.source.rewrite_attr(&path, &meta).map_err(errno)?
        } else {
            self.source.stat(&path).map_err(errno)?
        };
        if after.is_file() {
            let mut guard = inode.file();
            if let Some(state) = guard.as_mut() {
                if state.written() {
                    // Uploaded at close: its times are the record's until then.
                    if let Some(t) = attr.mtime {
                        let mtime = match t {
                            TimeSpec::Now => super::reintegrate::now_ts(),
                            TimeSpec::At(s, ns) => (s, ns),
                        };
                        state.set_times(mtime, None);
                    }
                } else {
                    state.own_version(self.identity(&after));
                    state.persist_record(&self.env(), false);
                }
            } else {
                drop(guard);
                self.own_change(&path, &before, &after, attr.mtime.is_some());
            }
        }
        self.pending_attr(inode.id, seen, &mut after);
        Ok(self.attr_told(inode, &after))
    }

    fn object_truncate(&self, inode: &Arc<Inode>, path: &Path, st: &Stat, size: u64) -> Result<()> {
        let mut guard = inode.file();
        let opened_here = guard.is_none();
        if opened_here {
            let (state, _) = self.load_state(inode, path, &mut { *st }, Look::Source);
            *guard = Some(Box::new(state));
        }
        let state = guard.as_mut().unwrap();
        let r = (|| {
            let flags = if size == 0 { libc::O_TRUNC } else { 0 };
            self.object_prepare_write(state, path, flags)?;
            self.offline_modify(state, Some(path), |f, _| f.set_len(size).map(|_| size))?;
            self.object_store(inode, state)
        })();
        if opened_here {
            self.release_if_unused(inode, &mut guard);
        }
        r
    }

    /// The count of finished uploads, taken before a stat of the source that
    /// `pending_attr` completes.
    pub(super) fn uploads_seen(&self) -> u64 {
        self.uploads_done.load(Ordering::Acquire)
    }

    /// A file with writes not yet uploaded: the mount shows the cache's size and mtime,
    /// not the store's older object. `st` was taken from the source after `seen`
    /// (`uploads_seen`); if an upload finished since, it may be the older object while
    /// the pending mark is already gone, so the file is stat'ed again.
    pub(super) fn pending_attr(&self, id: u64, mut seen: u64, st: &mut Stat) {
        if self.caps().in_place_writes || !st.is_file() {
            return;
        }
        let Ok(inode) = self.inode(id) else { return };
        // Bounded: each pass needs another upload to finish during its stat.
        for _ in 0..8 {
            if let Some(state) = inode.file().as_ref().filter(|s| s.written()) {
                st.size = state.record().identity.size;
                st.blocks = st.size.div_ceil(512);
                st.mtime = state.record().identity.mtime;
                return;
            }
            let now = self.uploads_seen();
            if now == seen {
                return;
            }
            seen = now;
            match inode.path().map(|path| self.source.stat(&path)) {
                Some(Ok(again)) if again.is_file() => *st = again,
                _ => return,
            }
        }
    }
}

use crate::stats::Stats;

//! Attributes of nodes and of the file system: getattr (from an open handle, or its own
//! descriptor, when the name is gone), setattr and truncation, statfs and extended
//! attributes; and the cache record's identity following the mount's own changes to them.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use fuser::{Errno, FileAttr};

use super::{CachingFs, Inode, Result, entry, errno};

use crate::coherence::Notice;
use crate::source::SourceReader;
use crate::source::{SetAttr, Stat};

impl CachingFs {
    /// Attributes of `inode`: from an open handle when there is one (the name may be gone),
    /// otherwise from its path.
    pub fn getattr(&self, id: u64, fh: Option<u64>) -> Result<FileAttr> {
        if !self.online() {
            return self.offline_getattr(&*self.inode(id)?);
        }
        match self.getattr_online(id, fh) {
            // The source failed and the mount went offline meanwhile: the cache answers.
            Err(_) if !self.online() => self.offline_getattr(&*self.inode(id)?),
            r => r,
        }
    }

    fn getattr_online(&self, id: u64, fh: Option<u64>) -> Result<FileAttr> {
        let mut st = self.getattr_source(id, fh)?;
        let inode = self.inode(id)?;
        if inode.is_retired()
            && let Some(state) = inode.file().as_ref()
        {
            // Handles that kept an old version see its size and times, as they read it.
            let kept = &state.record().identity;
            st.size = kept.size;
            st.blocks = kept.size.div_ceil(512);
            st.mtime = kept.mtime;
            st.ctime = kept.ctime;
        }
        Ok(self.attr_told(&inode, &st))
    }

    fn getattr_source(&self, id: u64, fh: Option<u64>) -> Result<Stat> {
        if let Some(h) = fh.and_then(|fh| self.handle(fh).ok())
            && let Some(src) = &h.source
        {
            return self.source.fstat(src.as_fd()).map_err(errno);
        }
        let inode = self.inode(id)?;
        let seen = self.uploads_seen();
        // The watcher answers for the file while its callback stands.
        if let Some(cb) = inode.callback()
            && self.coherence.callback_holds(&cb, id, inode.parent())
        {
            let mut st = cb.stat;
            self.pending_attr(id, seen, &mut st);
            return Ok(st);
        }
        let mut elsewhere = false;
        let stat = match inode.path() {
            Some(path) => self.source.stat(&path).and_then(|st| {
                if self.stable_ino && !inode.is_same_file(&st) {
                    // The name leads to another object now (replaced behind the mount):
                    // its attributes are not this node's (a reader of this node's file
                    // would have its reads cut at the other file's size).
                    elsewhere = true;
                    return Err(io::Error::from_raw_os_error(libc::ENOENT));
                }
                Ok(st)
            }),
            None => Err(io::Error::from_raw_os_error(libc::ENOENT)),
        };
        match stat {
            Ok(mut st) => {
                self.pending_attr(id, seen, &mut st);
                Ok(st)
            }
            // The node's name leads elsewhere: the kernel's dentry is stale (dropped now).
            // The node's own file answers while it is open (fstat of its handles, which
            // carries no handle in FUSE); otherwise ESTALE, and the kernel looks the name
            // up again.
            Err(_) if elsewhere => {
                if let Some(path) = inode.path()
                    && let Some(name) = path.file_name()
                {
                    let notice = Notice::Entry(inode.parent(), name.to_os_string());
                    self.coherence.notify(notice);
                }
                let mut st = self.fstat_own(&inode).ok_or(Errno::ESTALE)?;
                self.pending_attr(id, seen, &mut st);
                Ok(st)
            }
            // fstat of an open file whose name is gone: answer from an open descriptor.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                let st = (self.fstat_own(&inode))
                    .or_else(|| inode.file().as_ref().and_then(|s| s.unlinked));
                // Nothing open: the kernel's dentry is stale (the name was renamed or
                // removed behind the mount). ESTALE makes the kernel look the name up again
                // and retry (a stat, or the permission check of an open), which then finds
                // what the name is now, or ENOENT.
                let mut st = st.ok_or_else(|| {
                    tracing::debug!(id, path = ?inode.path(), "getattr of a node whose name is gone");
                    Errno::ESTALE
                })?;
                self.pending_attr(id, seen, &mut st);
                Ok(st)
            }
            Err(e) => Err(errno(e)),
        }
    }

    /// `fstat` of the source object behind an open inode, if one is open; the descriptor
    /// duplicated for it is closed through the source guard (a fetch descriptor's close
    /// may wait for the source).
    fn fstat_own(&self, inode: &Arc<Inode>) -> Option<Stat> {
        let fd = self.open_source_fd(inode)?;
        let st = self.source.fstat(fd.as_fd()).ok();
        self.source.close(fd);
        st
    }

    /// A descriptor of the source object behind an open inode, if one is open.
    fn open_source_fd(&self, inode: &Arc<Inode>) -> Option<OwnedFd> {
        if inode.file_type == libc::S_IFDIR {
            let dirs = self.dirs.lock().unwrap();
            let list = dirs.values().find(|l| l.dir_id == inode.id)?;
            return crate::source::dup_file(list.fd.as_ref()?.as_fd())
                .ok()
                .map(OwnedFd::from);
        }
        let guard = inode.file();
        let state = guard.as_ref()?;
        let fd = state.path_fd.as_ref().map(|f| f.as_fd()).or(state
            .fetch_src
            .as_ref()
            .and_then(|f| match &f.reader {
                SourceReader::File(file) => Some(file.as_fd()),
                SourceReader::Object { .. } => None,
            }))?;
        crate::source::dup_file(fd).ok().map(OwnedFd::from)
    }

    /// `kill_suidgid`: a truncation by this caller clears the file's set-ID bits (it lacks
    /// CAP_FSETID; `FUSE_HANDLE_KILLPRIV_V2` leaves that to us). Object stores keep none.
    pub fn setattr(
        &self,
        id: u64,
        fh: Option<u64>,
        mut attr: SetAttr,
        kill_suidgid: bool,
    ) -> Result<FileAttr> {
        let inode = self.inode(id)?;
        if let Some(mode) = attr.mode {
            self.check_set_id_beside_source_writers(&inode, mode)?;
        }
        let kill =
            kill_suidgid && attr.size.is_some() && attr.mode.is_none() && self.caps().clears_set_id;
        if self.offline_change()? {
            if kill {
                attr.mode = cleared_set_id(u32::from(self.getattr(id, fh)?.perm));
            }
            return self.offline_setattr(&inode, &attr);
        }
        if !self.caps().in_place_writes {
            return self.object_setattr(&inode, attr);
        }
        let path = inode.path();
        let handle = fh.and_then(|fh| self.handle(fh).ok());
        // The caller's open file when it gave one: its name may be gone.
        let src_fd = handle.as_ref().and_then(|h| h.source.as_deref());
        // Else the file's own descriptor: its name is not resolved three times over (tar's
        // chown, chmod and utimens after each file it writes, issue 22).
        let own_fd = src_fd.is_none().then(|| self.own_fd(&inode)).flatten();
        let object_fd = src_fd
            .map(|f| f.as_fd())
            .or(own_fd.as_deref().map(|f| f.as_fd()));
        let stat_now = || match (object_fd, &path) {
            (Some(f), _) => self.source.fstat(f),
            (None, Some(p)) => self.source.stat(p),
            (None, None) => Err(io::Error::from_raw_os_error(libc::ENOENT)),
        };
        let before = stat_now().map_err(errno)?;
        if let Some(p) = &path {
            self.listing_changed(p.parent().unwrap_or(Path::new("")));
        }
        if kill {
            attr.mode = cleared_set_id(before.mode & 0o7777);
        }
        if let Some(size) = attr.size {
            if !before.is_file() {
                return Err(if before.is_dir() {
                    Errno::EISDIR
                } else {
                    Errno::EINVAL
                });
            }
            return self.truncate(&inode, path.as_deref(), src_fd, size, attr);
        }
        let _changing = inode.own_change();
        let own = self.own_write(&inode);
        self.source
            .set_attr(path.as_deref(), object_fd, &attr)
            .map_err(errno)?;
        let after = stat_now().map_err(errno)?;
        own.done(&after);
        if let (true, Some(path)) = (after.is_file(), &path) {
            self.own_change(path, &before, &after, attr.mtime.is_some());
        }
        Ok(self.attr_told(&inode, &after))
    }

    /// The `O_PATH` descriptor of node `inode`'s file while its state is loaded (a regular
    /// file after its create or open; checked to be the node's file then). A request about
    /// the node reaches that file through it: never another file that took its name
    /// behind the mount, and without resolving the name beneath the root. Not where
    /// inode numbers are unstable, since the node is then known by its name alone.
    fn own_fd(&self, inode: &Inode) -> Option<Arc<OwnedFd>> {
        if !self.stable_ino {
            return None;
        }
        inode.file().as_ref().and_then(|s| s.path_fd.clone())
    }

    /// The cache renamed the data files now at `paths` (a rename moves a file's ctime):
    /// their loaded states take the new identities as hoardfs's own (`FileFetch::own`).
    pub(super) fn cache_renamed(&self, paths: &[&Path]) {
        let renamed: Vec<Arc<Inode>> = (self.loaded.lock().unwrap().values())
            .filter(|i| {
                i.names
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|n| paths.contains(&n.as_path()))
            })
            .cloned()
            .collect();
        for inode in renamed {
            if let Some(state) = inode.file().as_ref() {
                state.noted();
            }
        }
    }

    /// A change made through the mount that moved ctime/mtime but not the data (chmod,
    /// utimens, rename, link): the cached data stays valid, so its identity follows.
    /// `mtime_set`: the change set the mtime itself (utimens). Anything else that moved the
    /// size or the mtime between `before` and `after` was a write meanwhile (by a handle
    /// of another node of the file), whose bytes the cache does not hold: then the record
    /// is left to be found stale.
    pub(super) fn own_change(&self, path: &Path, before: &Stat, after: &Stat, mtime_set: bool) {
        // (Where files are not written in place, an object store, a metadata change is a
        // copy, which moves the mtime; data changes are this mount's own uploads.)
        let data_kept = |after: &Stat| {
            before.size == after.size
                && (mtime_set || before.mtime == after.mtime || !self.caps().in_place_writes)
        };
        let inode = self.find_inode(path, after);
        if let Some(inode) = &inode {
            let mut guard = inode.file();
            if let Some(state) = guard.as_mut() {
                // `after` was taken before the lock: a write through this node since then
                // is newer than it. Under the lock the file is looked at again (its own
                // descriptor: cheap, under the source guard).
                let now = (state.path_fd.as_ref())
                    .and_then(|fd| self.source.fstat(fd.as_fd()).ok())
                    .filter(|now| (now.dev, now.ino) == (after.dev, after.ino))
                    .unwrap_or(*after);
                if (data_kept(&now) && state.record().identity.same_version(&self.identity(before)))
                    || state.written()
                {
                    state.own_version(self.recorded_identity(&now));
                    // A record that waits for its checkpoint or group commit is written
                    // by it, with this identity: persisting it now would sync the data
                    // file on this request's path (tar's chmod, chown and utimens right
                    // after each close).
                    if !state.written() && !state.needs_checkpoint() {
                        state.persist_record(&self.env(), false);
                    }
                }
                return;
            }
        }
        // Not open: update the record on disk if it matched the old version.
        let Some(files) = self.cache.open_existing(path) else {
            return;
        };
        let _ = entry::closed::restamp(&files, false, |rec| {
            let same =
                !rec.dirty && rec.identity.same_version(&self.identity(before)) && data_kept(after);
            if same {
                rec.identity = self.recorded_identity(after);
            }
            same
        });
    }

    fn truncate(
        &self,
        inode: &Arc<Inode>,
        path: Option<&Path>,
        fd: Option<&File>,
        size: u64,
        attr: SetAttr,
    ) -> Result<FileAttr> {
        let mut guard = inode.file();
        if let Some(state) = guard.as_mut() {
            state.fetch.invalidate();
            state.mark_written(&self.env());
        }
        let own = self.own_write(inode);
        let r = self.source.set_attr(path, fd.map(|f| f.as_fd()), &attr);
        let after = match (fd, path) {
            (Some(f), _) => self.source.fstat(f.as_fd()),
            (None, Some(path)) => self.source.stat(path),
            (None, None) => Err(io::Error::from_raw_os_error(libc::ENOENT)),
        };
        if let Ok(after) = &after {
            own.done(after);
        }
        match guard.as_mut() {
            Some(state) => {
                let after = after.as_ref().ok().filter(|_| r.is_ok());
                state.truncated(&self.env(), size, after.map(|a| self.recorded_identity(a)));
            }
            None => {
                if let Some(Err(e)) = path.map(|p| self.uncache(p)) {
                    tracing::warn!(?path, "cannot drop cache entry: {e}");
                }
            }
        }
        r.map_err(errno)?;
        Ok(self.attr_told(inode, &after.map_err(errno)?))
    }

    pub fn statfs(&self) -> Result<libc::statvfs> {
        if !self.online() {
            return self.offline_statfs();
        }
        self.source.statvfs().map_err(errno)
    }

    // ---------------------------------------------------------------- xattrs

    pub fn getxattr(&self, id: u64, name: &OsStr, size: u32) -> Result<Vec<u8>> {
        if !self.online() {
            return Err(Errno::ENODATA); // extended attributes are not kept offline
        }
        // The kernel asks for `security.capability` before writes to a file (twice per
        // file in an untar): a loaded file answers through its own descriptor.
        if let Some(fd) = self.own_fd(&*self.inode(id)?) {
            let name = name.to_os_string();
            return (self.source)
                .with_fd(fd.as_fd(), move |f| {
                    crate::source::getxattr_of(f.as_fd(), &name, size as usize)
                })
                .map_err(errno);
        }
        let path = self.path_of(id)?;
        self.source
            .getxattr(&path, name, size as usize)
            .map_err(errno)
    }

    pub fn listxattr(&self, id: u64, size: u32) -> Result<Vec<u8>> {
        if !self.online() {
            return Ok(Vec::new());
        }
        let path = self.path_of(id)?;
        self.source.listxattr(&path, size as usize).map_err(errno)
    }

    pub fn setxattr(&self, id: u64, name: &OsStr, value: &[u8], flags: i32) -> Result<()> {
        self.changes_allowed()?;
        let path = self.path_of(id)?;
        let before = self.source.stat(&path).ok();
        self.source
            .setxattr(&path, name, value, flags)
            .map_err(errno)?;
        if let (Some(b), Ok(a)) = (before.filter(|b| b.is_file()), self.source.stat(&path)) {
            self.own_change(&path, &b, &a, false);
        }
        Ok(())
    }

    pub fn removexattr(&self, id: u64, name: &OsStr) -> Result<()> {
        self.changes_allowed()?;
        let path = self.path_of(id)?;
        let before = self.source.stat(&path).ok();
        self.source.removexattr(&path, name).map_err(errno)?;
        if let (Some(b), Ok(a)) = (before.filter(|b| b.is_file()), self.source.stat(&path)) {
            self.own_change(&path, &b, &a, false);
        }
        Ok(())
    }
}

/// The permission bits `mode` with its set-ID bits cleared, if it has any to clear.
fn cleared_set_id(mode: u32) -> Option<u32> {
    let bits = super::set_id_bits(mode);
    (bits != 0).then_some(mode & !bits)
}

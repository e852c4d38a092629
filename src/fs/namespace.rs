//! Names: lookup, forget and readlink, and the changes of the namespace (mknod, mkdir,
//! symlink, unlink, rmdir, rename, link), made on the source first, then followed by the
//! inode table, the saved listings and the cache.

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;

use fuser::{Errno, FileAttr};

use super::{CachingFs, FileState, Inode, Result, child, errno};
use crate::source::{SetAttr, Stat};
use crate::stats::Stats;
use crate::sync::MutexGuard;

impl CachingFs {
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<FileAttr> {
        if !self.online() {
            return self.offline_lookup(parent, name);
        }
        match self.lookup_online(parent, name) {
            Err(_) if !self.online() => self.offline_lookup(parent, name),
            r => r,
        }
    }

    fn lookup_online(&self, parent: u64, name: &OsStr) -> Result<FileAttr> {
        let dir = self.inode(parent)?;
        let dir_path = dir.path().ok_or(Errno::ENOENT)?;
        // Watch first: a change between our stat and the watch would go unseen.
        self.coherence
            .watch_dir(parent, || self.source.dir(&dir_path).ok());
        let path = child(&dir_path, name)?;
        let seen = self.uploads_seen();
        let mut st = match self.called_back(parent, &path) {
            Some(st) => st,
            None => self.source.stat(&path).map_err(errno)?,
        };
        let inode = self.inodes.lookup(parent, &path, &st);
        self.pending_attr(inode.id, seen, &mut st);
        Ok(self.attr_told(&inode, &st))
    }

    /// The attributes of the file that `path` in directory `parent` names, if the file's
    /// callback stands: the watcher answers for its name and attributes, as it does for a
    /// `getattr` (`getattr_source`). So a lookup after the kernel dropped its dentries
    /// (memory pressure, `drop_caches`: a warm `git status`) asks the source nothing. A
    /// change of the name behind the mount is an event in `parent`, which breaks the
    /// callbacks of the files it names; one through the mount moves the name in the table.
    fn called_back(&self, parent: u64, path: &Path) -> Option<Stat> {
        // Where no callback can stand (nothing watched, `close_to_open`), the table is
        // not searched at all.
        self.coherence.callback_mark(parent)?;
        let inode = self.inodes.named(path)?;
        if inode.parent() != parent || inode.is_retired() {
            return None;
        }
        let cb = inode.callback()?;
        let holds = self.coherence.callback_holds(&cb, inode.id, parent);
        if holds {
            Stats::add(&self.coherence.counters.callback_names, 1);
        }
        holds.then_some(cb.stat)
    }

    pub fn forget(&self, id: u64, n: u64) {
        self.inodes.forget(id, n);
        self.forget_kept_handle(id);
    }

    /// Sets a new object's owner to the caller's, following the setgid-directory rule.
    /// `opened`: the new object's open descriptor, changed instead of its name.
    pub(super) fn own_new(
        &self,
        path: &Path,
        parent: &Path,
        uid: u32,
        gid: u32,
        opened: Option<BorrowedFd<'_>>,
    ) -> Result<()> {
        if !rustix::process::geteuid().is_root() {
            return Ok(());
        }
        let pst = self.source.stat(parent).map_err(errno)?;
        let gid = if pst.mode & libc::S_ISGID != 0 {
            None
        } else {
            Some(gid)
        };
        match opened {
            Some(fd) => {
                let owner = SetAttr {
                    uid: Some(uid),
                    gid,
                    ..Default::default()
                };
                self.source.set_attr(None, Some(fd), &owner).map_err(errno)
            }
            None => self.source.chown_new(path, uid, gid).map_err(errno),
        }
    }

    /// The new object's entry and attributes; `known`: its attributes, if the caller has
    /// them.
    pub(super) fn entry_after_create(
        &self,
        parent: u64,
        path: &Path,
        known: Option<Stat>,
    ) -> Result<(FileAttr, Stat)> {
        self.listing_changed(path.parent().unwrap_or(Path::new("")));
        let st = match known {
            Some(st) => st,
            None => self.source.stat(path).map_err(errno)?,
        };
        let inode = self.inodes.lookup(parent, path, &st);
        Ok((self.attr_told(&inode, &st), st))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn mknod(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        self.changes_allowed()?;
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        self.source.mknod(&path, mode, rdev as u64).map_err(errno)?;
        Ok(self
            .finish_create(parent, &path, &dir, mode, uid, gid, None)?
            .0)
    }

    /// Gives a new object to the caller; `chown` by root clears set-id bits, so they are
    /// put back afterwards. `opened`: the new file's open descriptor (a regular file's
    /// create), owned and looked at through it rather than its name. Returns its entry
    /// and the attributes it was made from.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish_create(
        &self,
        parent: u64,
        path: &Path,
        dir: &Path,
        mode: u32,
        uid: u32,
        gid: u32,
        opened: Option<&File>,
    ) -> Result<(FileAttr, Stat)> {
        if let Err(e) = self.own_new(path, dir, uid, gid, opened.map(|f| f.as_fd())) {
            let _ = self.source.unlink(path);
            return Err(e);
        }
        if mode & (libc::S_ISUID | libc::S_ISGID) != 0 && mode & libc::S_IFMT != libc::S_IFLNK {
            let set = SetAttr {
                mode: Some(mode & 0o7777),
                ..Default::default()
            };
            self.source
                .set_attr(Some(path), None, &set)
                .map_err(errno)?;
        }
        let known = (opened.map(|f| self.source.fstat(f.as_fd())))
            .transpose()
            .map_err(errno)?;
        self.entry_after_create(parent, path, known)
    }

    pub fn mkdir(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        if self.offline_change()? {
            return self.offline_mkdir(parent, name, mode, uid, gid);
        }
        if !self.caps().in_place_writes {
            return self.object_mkdir(parent, name, mode, uid, gid);
        }
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        self.source.mkdir(&path, mode).map_err(errno)?;
        if let Err(e) = self.own_new(&path, &dir, uid, gid, None) {
            let _ = self.source.rmdir(&path);
            return Err(e);
        }
        Ok(self.entry_after_create(parent, &path, None)?.0)
    }

    pub fn symlink(
        &self,
        parent: u64,
        name: &OsStr,
        target: &Path,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        self.changes_allowed()?;
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        self.source.symlink(target, &path).map_err(errno)?;
        if let Err(e) = self.own_new(&path, &dir, uid, gid, None) {
            let _ = self.source.unlink(&path);
            return Err(e);
        }
        Ok(self.entry_after_create(parent, &path, None)?.0)
    }

    pub fn readlink(&self, id: u64) -> Result<Vec<u8>> {
        if !self.online() {
            return self.offline_readlink(&*self.inode(id)?);
        }
        match self.source.readlink(&self.path_of(id)?) {
            Err(_) if !self.online() => self.offline_readlink(&*self.inode(id)?),
            r => r.map_err(errno),
        }
    }

    pub fn unlink(&self, parent: u64, name: &OsStr) -> Result<()> {
        if self.offline_change()? {
            return self.offline_unlink(parent, name);
        }
        let path = child(&self.path_of(parent)?, name)?;
        let before = self.source.stat(&path).map_err(errno)?;
        let inode = self.find_inode(&path, &before);
        if let Some(inode) = &inode {
            self.keep_open_while_known(inode);
        }
        let uploads_held = self.hold_uploads(inode.as_deref());
        self.source.unlink(&path).map_err(errno)?;
        if let Some(inode) = &inode {
            inode.remove_name(&path);
        }
        drop(uploads_held);
        self.listing_changed(path.parent().unwrap_or(Path::new("")));
        if let Some(inode) = inode
            && before.nlink <= 1
        {
            self.inodes.unlinked(&inode);
            if let Some(state) = inode.file().as_mut() {
                state.unlinked = Some(Stat { nlink: 0, ..before });
            }
        }
        self.uncache_later(&path);
        Ok(())
    }

    pub(super) fn find_inode(&self, path: &Path, st: &Stat) -> Option<Arc<Inode>> {
        self.inodes.find(path, st)
    }

    /// On an object store an open writer uploads under the file's current name (flush,
    /// fsync, release; a `fork` elsewhere can send a flush at any time). Holding its state
    /// across a delete or rename and the change of its name keeps such an upload from
    /// landing under the old name after the store's change, which would bring it back.
    fn hold_uploads<'a>(
        &self,
        inode: Option<&'a Inode>,
    ) -> Option<MutexGuard<'a, Option<Box<FileState>>>> {
        inode
            .filter(|_| !self.caps().in_place_writes)
            .map(|i| i.file())
    }

    pub fn rmdir(&self, parent: u64, name: &OsStr) -> Result<()> {
        if self.offline_change()? {
            return self.offline_rmdir(parent, name);
        }
        let path = child(&self.path_of(parent)?, name)?;
        let before = self.source.stat(&path).ok();
        self.source.rmdir(&path).map_err(errno)?;
        self.listing_changed(path.parent().unwrap_or(Path::new("")));
        self.listing_changed(&path);
        if let Some(inode) = before.and_then(|st| self.inodes.find(&path, &st)) {
            inode.remove_name(&path);
        }
        self.uncache_later(&path);
        Ok(())
    }

    pub fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> Result<()> {
        if self.offline_change()? {
            return self.offline_rename(parent, name, newparent, newname, flags);
        }
        let _whole = self.renames.read().unwrap();
        let from = child(&self.path_of(parent)?, name)?;
        let to = child(&self.path_of(newparent)?, newname)?;
        let before = self.source.stat(&from).ok();
        // The renamed file's ctime moves: opens meanwhile must not call that a change.
        let _changing = (before.as_ref())
            .filter(|b| b.is_file())
            .and_then(|b| self.find_inode(&from, b))
            .map(|i| i.own_change());
        let inode = (before.as_ref())
            .filter(|_| !self.caps().in_place_writes)
            .and_then(|b| self.find_inode(&from, b));
        if self.kernel_opens() && flags & libc::RENAME_EXCHANGE == 0 {
            // The file renamed over may be open.
            if let Some(target) = (self.source.stat(&to).ok())
                .filter(|st| st.is_file())
                .and_then(|st| self.find_inode(&to, &st))
            {
                self.keep_open_while_known(&target);
            }
        }
        let uploads_held = self.hold_uploads(inode.as_deref());
        self.source.rename(&from, &to, flags).map_err(errno)?;
        let exchange = flags & libc::RENAME_EXCHANGE != 0;
        self.inodes.renamed(&from, &to, exchange, parent, newparent);
        drop(uploads_held);
        for dir in [&from, &to] {
            self.listing_changed(dir.parent().unwrap_or(Path::new("")));
            self.listing_changed(dir);
        }
        self.cache.rename(&from, &to, flags);
        if exchange {
            self.cache_renamed(&[&from, &to]);
        } else {
            self.cache_renamed(&[&to]);
        }
        // rename changes the file's ctime: keep its cache record matching (our own change).
        if let Some(before) = before.filter(|b| b.is_file())
            && let Ok(after) = self.source.stat(&to)
        {
            self.own_change(&to, &before, &after, false);
        }
        Ok(())
    }

    pub fn link(&self, id: u64, newparent: u64, newname: &OsStr) -> Result<FileAttr> {
        self.changes_allowed()?;
        let from = self.path_of(id)?;
        let to = child(&self.path_of(newparent)?, newname)?;
        let before = self.source.stat(&from).map_err(errno)?;
        let _changing = self.inode(id)?.own_change();
        self.source.link(&from, &to).map_err(errno)?;
        self.listing_changed(from.parent().unwrap_or(Path::new("")));
        self.listing_changed(to.parent().unwrap_or(Path::new("")));
        let st = self.source.stat(&to).map_err(errno)?;
        if before.is_file() {
            self.own_change(&from, &before, &st, false);
        }
        let inode = self.inodes.lookup(newparent, &to, &st);
        // Keep using the old name while it exists: the cache entry lives under it.
        inode.set_path(&from);
        inode.set_path(&to);
        inode.set_path(&from);
        Ok(self.attr_told(&inode, &st))
    }
}

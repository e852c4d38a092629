//! Open directories: the listing a handle serves, read from the source at opendir (and
//! saved for offline use), read again after a change of the namespace, and the attributes
//! of its entries for readdirplus.

use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use fuser::{Errno, FileAttr, FileType, FopenFlags};

use super::{
    CachingFs, DirList, Inode, ListEntry, Listing, Result, attr_of, child, errno, kind_of,
};
use crate::source::DirEntry;

/// A directory's names as read, and the directory open `O_PATH` (none on an object store).
type ReadListing = (Arc<[DirEntry]>, Option<Arc<OwnedFd>>);

impl CachingFs {
    pub fn opendir(&self, id: u64) -> Result<u64> {
        let list = self.list_dir(id)?;
        let fh = self.new_fh();
        self.dirs.lock().unwrap().insert(fh, Arc::new(list));
        Ok(fh)
    }

    /// Directory `id`'s listing, from the source or, offline, the saved one.
    pub(super) fn list_dir(&self, id: u64) -> Result<DirList> {
        let inode = self.inode(id)?;
        // As in `open`: the kernel looks the name up again.
        let path = inode.path().ok_or(Errno::ESTALE)?;
        if !self.online() {
            return self.offline_dir_list(id, &path);
        }
        match self.list_dir_online(id, &path) {
            Err(_) if !self.online() => self.offline_dir_list(id, &path),
            r => r,
        }
    }

    /// Reads directory `id` at `path` from the source for an open directory handle, or
    /// takes the listing it holds under callback while that stands (nothing of its names
    /// changed since, on the source or through the mount).
    fn list_dir_online(&self, id: u64, path: &Path) -> Result<DirList> {
        let generation = self.namespace_generation();
        let path = path.to_path_buf();
        let inode = self.inode(id)?;
        let breaks = inode.callback_breaks();
        let held = inode
            .listing()
            .filter(|cb| self.coherence.listing_holds(cb, id));
        let (entries, fd) = match held {
            Some(cb) => (cb.entries, cb.fd),
            None => self.read_listing(&inode, &path)?,
        };
        let mut list = Vec::with_capacity(entries.len() + 2);
        list.push(ListEntry {
            ino: id,
            kind: FileType::Directory,
            name: ".".into(),
        });
        list.push(ListEntry {
            ino: id,
            kind: FileType::Directory,
            name: "..".into(),
        });
        for e in entries.iter() {
            list.push(ListEntry {
                ino: e.ino,
                kind: if e.file_type == 0 {
                    FileType::RegularFile
                } else {
                    kind_of(e.file_type)
                },
                name: e.name.clone(),
            });
        }
        // The order its files will be read in by a walk (`fetch::DirPrefetch`).
        if self.fetcher.tun.dir_prefetch.load(Ordering::Relaxed) > 0 {
            if let Some(at) = self.cache.warm_last_cold() {
                self.fetcher.dirs.cold_found_at(at);
            }
            let files = list.iter().filter(|e| e.kind == FileType::RegularFile);
            let warm = self
                .fetcher
                .dirs
                .listed(&path, files.map(|e| e.name.clone()));
            self.warm_ahead(warm);
        }
        Ok(DirList {
            dir_id: id,
            path,
            fd,
            entries: list,
            generation,
            breaks,
        })
    }

    /// Reads directory `inode` at `path` from the source (and saves the listing for
    /// offline use). Where the watcher covers the directory, the listing is held under
    /// callback for the opendirs after it.
    fn read_listing(&self, inode: &Inode, path: &Path) -> Result<ReadListing> {
        let id = inode.id;
        // Kept for fstat of the open directory once its name is gone.
        let fd = if !self.caps().descriptors {
            None
        } else {
            let fd = self
                .source
                .openat(
                    path,
                    rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
                    0,
                )
                .map_err(errno)?;
            self.coherence.watch_dir(id, || {
                crate::source::dup_file(fd.as_fd()).ok().map(OwnedFd::from)
            });
            Some(Arc::new(fd))
        };
        // Taken once the directory is watched and before its read: a change of a name
        // after this either shows in the read or breaks the listing (an event, handled in
        // `changes.rs`; a change through the mount, `listing_changed`).
        let mark = self.coherence.callback_mark(id);
        let breaks = inode.callback_breaks();
        let at = Instant::now();
        let entries: Arc<[DirEntry]> = self.source.read_dir(path).map_err(errno)?.into();
        self.save_listing(path, &entries);
        if let Some(mark) = mark
            && let Some(cb) = self
                .coherence
                .listing_callback(mark, entries.clone(), fd.clone(), at)
        {
            inode.grant_listing(cb, breaks);
        }
        Ok((entries, fd))
    }

    /// Attributes for a readdirplus batch. Each entry returned with `Some` counts as one
    /// kernel lookup of it (the caller must `forget` entries it could not send); `.` and
    /// `..` do not count, as the kernel does not link them.
    pub fn readdirplus_attrs(
        &self,
        list: &DirList,
        from: usize,
        max: usize,
    ) -> Vec<Option<FileAttr>> {
        if !self.online() {
            return self.offline_readdirplus_attrs(list, from, max);
        }
        let batch: Vec<&ListEntry> = list.entries.iter().skip(from).take(max).collect();
        let names: Vec<&OsStr> = batch.iter().map(|e| e.name.as_os_str()).collect();
        let Ok(stats) = self.source.stat_children(&list.path, &names) else {
            return vec![None; batch.len()];
        };
        batch
            .iter()
            .zip(stats)
            .map(|(e, st)| {
                let st = st.ok()?;
                if e.name == "." || e.name == ".." {
                    return Some(attr_of(list.dir_id, &st));
                }
                let path = child(&list.path, &e.name).ok()?;
                let inode = self.inodes.lookup(list.dir_id, &path, &st);
                Some(self.attr_told(&inode, &st))
            })
            .collect()
    }

    /// The listing an open directory handle serves from `offset`. A listing that begins
    /// (offset 0) after a change of the namespace through the mount, or one the watcher
    /// reported, is read again: the kernel caches what a handle serves from offset 0 as the
    /// directory's listing for its current version, which includes that change, so a
    /// handle opened before the change must not serve its older listing then.
    pub fn dir_entries(&self, fh: u64, offset: u64) -> Result<Arc<DirList>> {
        let list = self
            .dirs
            .lock()
            .unwrap()
            .get(&fh)
            .cloned()
            .ok_or(Errno::EBADF)?;
        if offset != 0 || list.generation == self.namespace_generation() || !self.online() {
            return Ok(list);
        }
        match self.list_dir_online(list.dir_id, &list.path) {
            Ok(fresh) => {
                let fresh = Arc::new(fresh);
                self.dirs.lock().unwrap().insert(fh, fresh.clone());
                Ok(fresh)
            }
            Err(_) => Ok(list),
        }
    }

    /// What a READDIR of directory `id` at `offset` serves: from handle `fh`'s listing,
    /// or with handle 0 (a kernel open) from the listing the offset names.
    pub fn listing(&self, id: u64, fh: u64, offset: u64) -> Result<Listing> {
        if fh == 0 {
            return self.kernel_listing(id, offset);
        }
        let list = self.dir_entries(fh, offset)?;
        if offset > 0 && offset as usize >= list.entries.len() {
            self.listing_ends(&list);
        }
        Ok(Listing {
            list,
            start: offset as usize,
            cookie: 0,
        })
    }

    /// A handle's listing ends (this READDIR returns nothing): on a directory whose
    /// listing the kernel caches, it then marks the entries this handle added to its
    /// cache as the whole listing, of the version it noted when the cache was begun. It
    /// notes that version again whenever a reader finds the cache empty (`readdir.c`,
    /// `fuse_readdir_cached`), and adds any reader's entries that come at the cache's end,
    /// so a listing read before a change whose entries arrived after another reader began
    /// the cache anew after that change would stand as the changed directory's. If the
    /// directory changed since this listing was read, the kernel's cached listing is
    /// dropped before the reply, and the next reader reads it anew.
    fn listing_ends(&self, list: &DirList) {
        let changed = self
            .inodes
            .get(list.dir_id)
            .is_some_and(|dir| dir.callback_breaks() != list.breaks);
        if changed
            && self
                .dir_open_flags(list.dir_id)
                .contains(FopenFlags::FOPEN_CACHE_DIR)
        {
            self.coherence.drop_kernel_listing(list.dir_id);
        }
    }

    pub fn releasedir(&self, fh: u64) {
        self.dirs.lock().unwrap().remove(&fh);
    }
}

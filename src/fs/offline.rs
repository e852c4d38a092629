//! Disconnected operation: what the mount answers while the source is offline
//! (`health.rs`), and the directory listings taken while online that make it possible.
//!
//! Offline, names and attributes come from the saved listings (`cache/listing.rs`), data
//! from cache files whose records are whole and clean, symlink targets from the listings.
//! Nothing offline ever discards cached data. What the cache does not hold fails at once:
//! `EIO` for names in directories never listed and for data never fetched, `ENOENT` for
//! names a complete listing does not have, `EROFS` for every change unless `--offline-writes=log` (`fs/reintegrate.rs`).

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use fuser::{Errno, FileAttr, FileType};

use super::Inode;
use super::{CachingFs, DirList, FileState, ListEntry, Result, attr_of, child, kind_of};
use crate::cache::listing::{DirListing, ListedEntry};
use crate::cache::store::read_record;
use crate::source::Stat;

/// A saved listing is taken again after this long even if the directory looks unchanged:
/// its entries' attributes change without touching the directory.
const LISTING_MAX_AGE: Duration = Duration::from_secs(60);

/// Which directories have a current saved listing (so opendir need not rewrite it), and
/// the listings decoded for offline use: a walk asks for the same directory once per
/// entry, and decoding a big listing each time would make offline lookups crawl.
#[derive(Default)]
pub struct Listed {
    taken: HashMap<PathBuf, (Stat, Instant)>,
    loaded: HashMap<PathBuf, Arc<Indexed>>,
    /// Directories changed through the mount whose saved listings are to be taken again
    /// (`relist_changed`); until then the old listing still answers offline.
    changed: HashSet<PathBuf>,
    /// Counts changes of the namespace through the mount and those the watcher reports
    /// (`CachingFs::dir_entries`).
    generation: u64,
    /// Counts listings saved or dropped: a listing decoded from its file while one was
    /// saved is not kept in `loaded`, as it may be the older one (`loaded_listing`).
    saves: u64,
}

/// How often the listings of directories changed through the mount are taken again: a
/// burst of changes in one directory (an untar) costs one listing, not one per change.
pub const RELIST_EVERY: Duration = Duration::from_millis(500);

/// Decoded listings kept in memory at most.
const LOADED_MAX: usize = 256;

/// A decoded listing with its names indexed.
pub struct Indexed {
    pub listing: DirListing,
    by_name: HashMap<std::ffi::OsString, usize>,
}

impl Indexed {
    fn new(listing: DirListing) -> Indexed {
        let by_name = listing
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        Indexed { listing, by_name }
    }

    pub fn find(&self, name: &OsStr) -> Option<&ListedEntry> {
        self.by_name.get(name).map(|i| &self.listing.entries[*i])
    }
}

impl CachingFs {
    pub fn online(&self) -> bool {
        self.source.health.online()
    }

    /// Refuses changes while offline.
    pub(super) fn changes_allowed(&self) -> Result<()> {
        if self.online() {
            return Ok(());
        }
        self.source.health.offline_requests.fetch_add(1, Relaxed);
        Err(Errno::EROFS)
    }

    fn offline_request(&self) {
        self.source.health.offline_requests.fetch_add(1, Relaxed);
    }

    // ------------------------------------------------------------ taking listings online

    /// Saves the listing of directory `path` (entries read by the caller) with every
    /// entry's attributes, unless a current one is saved already. Whether a listing of
    /// these entries is saved now: not if the source or the cache failed (the mount went
    /// offline meanwhile, a disk error), and the caller may try again.
    pub(super) fn save_listing(&self, path: &Path, entries: &[crate::source::DirEntry]) -> bool {
        let Ok(dir) = self.source.stat(path) else {
            return false;
        };
        {
            let listed = self.listed.lock().unwrap();
            if let Some((st, at)) = listed.taken.get(path)
                && st.mtime == dir.mtime
                && st.ctime == dir.ctime
                && at.elapsed() < LISTING_MAX_AGE
            {
                return true;
            }
        }
        let names: Vec<&OsStr> = entries.iter().map(|e| e.name.as_os_str()).collect();
        let Ok(stats) = self.source.stat_children(path, &names) else {
            return false;
        };
        let mut listed = Vec::with_capacity(entries.len());
        for (e, st) in entries.iter().zip(stats) {
            // An entry that vanished between readdir and stat is simply not listed; one
            // we cannot stat for another reason makes the listing incomplete: none.
            let st = match st {
                Ok(st) => st,
                Err(err) if err.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(_) => return false,
            };
            let link = if st.file_type() == libc::S_IFLNK {
                let Ok(p) = child(path, &e.name) else {
                    return false;
                };
                match self.source.readlink(&p) {
                    Ok(l) => Some(l),
                    Err(_) => return false,
                }
            } else {
                None
            };
            listed.push(ListedEntry {
                name: e.name.clone(),
                stat: st,
                link,
            });
        }
        let listing = DirListing {
            path: path.to_path_buf(),
            dir,
            entries: listed,
        };
        // Offline changes edit the saved listings (`--offline-writes=log`, under
        // `offline_edits`): a listing read online and saved after the switch offline
        // would undo those made since. Taken again once back online.
        let _edits = self.offline_edits.lock().unwrap();
        if !self.online() {
            return false;
        }
        // Taken again as saved before (by an earlier daemon, or past `LISTING_MAX_AGE`):
        // the file on disk stays as it is. Reading it costs one small read; writing it a
        // new file, its rename over the old one and the old one's freeing.
        let saved = if self.cache.load_listing(path).as_ref() == Some(&listing) {
            Ok(())
        } else {
            self.cache.save_listing(&listing)
        };
        match saved {
            Ok(()) => {
                let mut listed = self.listed.lock().unwrap();
                listed.loaded.remove(path);
                listed.saves += 1;
                // Changed through the mount meanwhile, perhaps after the caller read
                // `entries`: this listing may lack that change, so it is not current, and
                // the `relist` thread takes it again.
                if !listed.changed.contains(path) {
                    listed
                        .taken
                        .insert(path.to_path_buf(), (dir, Instant::now()));
                }
                true
            }
            Err(e) => {
                tracing::debug!(?path, "cannot save listing: {e}");
                false
            }
        }
    }

    /// Makes sure `dir` and its ancestors have saved listings, so that a file cached in
    /// it can be reached offline. Each directory is listed once per daemon at most.
    pub(super) fn ensure_listed(&self, dir: &Path) {
        let mut d = Some(dir);
        while let Some(p) = d {
            let known = {
                let listed = self.listed.lock().unwrap();
                // A changed directory is listed again shortly (`relist_changed`).
                listed.taken.contains_key(p) || listed.changed.contains(p)
            };
            if !known {
                if self.cache.load_listing(p).is_none()
                    && let Ok(entries) = self.source.read_dir(p)
                {
                    self.save_listing(p, &entries);
                } else if let Ok(st) = self.source.stat(p) {
                    // Saved by an earlier daemon: good until the directory changes.
                    self.listed
                        .lock()
                        .unwrap()
                        .taken
                        .insert(p.to_path_buf(), (st, Instant::now()));
                }
            }
            d = if p.as_os_str().is_empty() {
                None
            } else {
                Some(p.parent().unwrap_or(Path::new("")))
            };
        }
    }

    /// The directory `dir` changed through the mount: the listing it holds in memory is
    /// dropped, and its saved listing is out of date and is taken again shortly. Until
    /// then that keeps answering offline as last seen (dropping it would make the
    /// directory and every cached file in it `EIO` offline).
    pub(super) fn listing_changed(&self, dir: &Path) {
        // Its listing held under callback goes, and none read before now is held.
        let named = std::collections::HashSet::from([dir.to_path_buf()]);
        for (_, inode) in self.inodes.holders_of(&named) {
            inode.break_callback();
        }
        let mut listed = self.listed.lock().unwrap();
        listed.taken.remove(dir);
        listed.loaded.remove(dir);
        listed.changed.insert(dir.to_path_buf());
        listed.generation += 1;
    }

    /// See `Listed::generation`.
    pub(super) fn namespace_generation(&self) -> u64 {
        self.listed.lock().unwrap().generation
    }

    /// The watcher saw directories change: listings begun from now on are read again.
    pub(super) fn namespace_changed_behind(&self) {
        self.listed.lock().unwrap().generation += 1;
    }

    /// Takes again the listings of the directories changed through the mount (while
    /// online); a directory that is gone loses its listing.
    pub fn relist_changed(&self) {
        if !self.online() {
            return;
        }
        let changed: Vec<PathBuf> = self.listed.lock().unwrap().changed.drain().collect();
        for dir in changed {
            let saved = match self.source.read_dir(&dir) {
                Ok(entries) => self.save_listing(&dir, &entries),
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => {
                    // Gone from the source. As for a save: online only, or an offline
                    // edit made since (a directory made again offline) would be undone.
                    let _edits = self.offline_edits.lock().unwrap();
                    if self.online() {
                        self.cache.drop_listing(&dir);
                        let mut listed = self.listed.lock().unwrap();
                        listed.loaded.remove(&dir);
                        listed.saves += 1;
                        continue;
                    }
                    false
                }
                Err(_) => false,
            };
            if !saved {
                // The source failed, or the mount went offline midway: try again next
                // time, or once back online (dropped from `changed`, the directory would
                // keep its old listing for good).
                self.listed.lock().unwrap().changed.insert(dir);
            } else if let Some(parent) = dir.parent() {
                // Its ancestors may never have been listed (a file created by its path in
                // a tree nobody listed or read): they are now, as an open's are, or
                // nothing in it could be reached offline.
                self.ensure_listed(parent);
            }
        }
    }

    /// Changes the saved listing of `dir` (an offline change, `fs/reintegrate.rs`): `EIO`
    /// if there is none.
    pub(super) fn edit_listing<T>(
        &self,
        dir: &Path,
        f: impl FnOnce(&mut DirListing) -> Result<T>,
    ) -> Result<T> {
        let mut listing = self.listing_for(dir, None)?.listing.clone();
        let r = f(&mut listing)?;
        self.cache.save_listing(&listing).map_err(|e| {
            tracing::warn!(?dir, "cannot save a listing changed offline: {e}");
            Errno::EIO
        })?;
        let mut listed = self.listed.lock().unwrap();
        listed.taken.remove(dir);
        listed.saves += 1;
        listed
            .loaded
            .insert(dir.to_path_buf(), Arc::new(Indexed::new(listing)));
        Ok(r)
    }

    /// The saved listing of `dir`, decoded once and kept while offline lookups use it.
    fn loaded_listing(&self, dir: &Path) -> Option<Arc<Indexed>> {
        let saves = {
            let listed = self.listed.lock().unwrap();
            if let Some(l) = listed.loaded.get(dir) {
                return Some(l.clone());
            }
            listed.saves
        };
        let l = Arc::new(Indexed::new(self.cache.load_listing(dir)?));
        let mut listed = self.listed.lock().unwrap();
        // A listing saved meanwhile (the relisting of a directory begun online, finishing
        // after the switch offline) may be newer than the file read here: this one
        // answers once, and the next call reads the file again.
        if listed.saves != saves {
            return Some(l);
        }
        if listed.loaded.len() >= LOADED_MAX {
            // Any one: directories are walked one after another.
            if let Some(k) = listed.loaded.keys().next().cloned() {
                listed.loaded.remove(&k);
            }
        }
        listed.loaded.insert(dir.to_path_buf(), l.clone());
        Some(l)
    }

    // ------------------------------------------------------------ answering offline

    /// The saved listing of `dir` if it belongs to the directory `st` (a listing left
    /// from an older directory of the same name is never used).
    pub(super) fn listing_for(&self, dir: &Path, st: Option<&Stat>) -> Result<Arc<Indexed>> {
        let l = self.loaded_listing(dir).ok_or(Errno::EIO)?;
        if let Some(st) = st
            && (l.listing.dir.dev, l.listing.dir.ino) != (st.dev, st.ino)
        {
            return Err(Errno::EIO);
        }
        Ok(l)
    }

    /// The last known attributes of `path` (a directory's own come from its listing).
    pub(super) fn offline_stat(&self, path: &Path) -> Result<Stat> {
        if path.as_os_str().is_empty() {
            return Ok(self.listing_for(path, None)?.listing.dir);
        }
        let parent = path.parent().unwrap_or(Path::new(""));
        let name = path.file_name().ok_or(Errno::EIO)?;
        let pl = self.listing_for(parent, None)?;
        let mut st = pl.find(name).ok_or(Errno::ENOENT)?.stat;
        if st.is_file() {
            self.overlay_record(path, &mut st);
        }
        Ok(st)
    }

    /// A cached file's size and times as its (newer) clean record knows them.
    fn overlay_record(&self, path: &Path, st: &mut Stat) {
        if let Some(files) = self.cache.open_existing(path)
            && let Ok(Some(Ok(rec))) = read_record(&files)
            && !rec.dirty
            && (rec.identity.ino == 0 || rec.identity.ino == st.ino)
        {
            st.size = rec.identity.size;
            st.mtime = rec.identity.mtime;
            st.ctime = rec.identity.ctime;
        }
    }

    pub(super) fn offline_lookup(&self, parent: u64, name: &OsStr) -> Result<FileAttr> {
        self.offline_request();
        let dir = self.inode(parent)?;
        let dir_path = dir.path().ok_or(Errno::ENOENT)?;
        let path = child(&dir_path, name)?;
        let st = self.offline_stat(&path)?;
        let inode = self.inodes.lookup(parent, &path, &st);
        Ok(self.attr_told(&inode, &st))
    }

    pub(super) fn offline_getattr(&self, inode: &Inode) -> Result<FileAttr> {
        self.offline_request();
        if let Some(state) = inode.file().as_ref() {
            // Open: what its state knows is newest.
            let path = inode.path().ok_or(Errno::EIO)?;
            let mut st = match (self.offline_stat(&path), state.loaded_stat) {
                (Ok(st), _) => st,
                (Err(_), Some(st)) => st,
                (Err(e), None) => return Err(e),
            };
            st.size = state.record().identity.size;
            st.mtime = state.record().identity.mtime;
            st.ctime = state.record().identity.ctime;
            return Ok(self.attr_told(inode, &st));
        }
        let path = inode.path().ok_or(Errno::ENOENT)?;
        Ok(self.attr_told(inode, &self.offline_stat(&path)?))
    }

    pub(super) fn offline_readlink(&self, inode: &Inode) -> Result<Vec<u8>> {
        self.offline_request();
        let path = inode.path().ok_or(Errno::ENOENT)?;
        let parent = path.parent().unwrap_or(Path::new(""));
        let name = path.file_name().ok_or(Errno::EINVAL)?;
        let l = self.listing_for(parent, None)?;
        let e = l.find(name).ok_or(Errno::ENOENT)?;
        e.link.clone().ok_or(Errno::EINVAL)
    }

    /// The listing an offline opendir serves; `fd` is an `O_PATH` descriptor of the
    /// directory's cache copy (for fstat of an open directory).
    pub(super) fn offline_dir_list(&self, id: u64, path: &Path) -> Result<DirList> {
        self.offline_request();
        let own = self.offline_stat(path).inspect_err(|e| {
            tracing::debug!(?path, "offline: no attributes for the directory: {e:?}")
        })?;
        let l = self.listing_for(path, Some(&own)).inspect_err(|e| {
            tracing::debug!(?path, "offline: no listing of the directory: {e:?}")
        })?;
        let mut entries = Vec::with_capacity(l.listing.entries.len() + 2);
        for name in [".", ".."] {
            entries.push(ListEntry {
                ino: id,
                kind: FileType::Directory,
                name: name.into(),
            });
        }
        for e in &l.listing.entries {
            entries.push(ListEntry {
                ino: e.stat.ino,
                kind: kind_of(e.stat.mode),
                name: e.name.clone(),
            });
        }
        Ok(DirList {
            dir_id: id,
            path: path.to_path_buf(),
            fd: None,
            entries,
            generation: self.namespace_generation(),
            breaks: self.inodes.get(id).map_or(0, |i| i.callback_breaks()),
        })
    }

    /// Attributes for an offline readdirplus batch, from the listing.
    pub(super) fn offline_readdirplus_attrs(
        &self,
        list: &DirList,
        from: usize,
        max: usize,
    ) -> Vec<Option<FileAttr>> {
        let listing = self.loaded_listing(&list.path);
        list.entries
            .iter()
            .skip(from)
            .take(max)
            .map(|e| {
                if e.name == "." || e.name == ".." {
                    let st = self.offline_stat(&list.path).ok()?;
                    return Some(attr_of(list.dir_id, &st));
                }
                let mut st = listing.as_ref()?.find(&e.name)?.stat;
                let path = child(&list.path, &e.name).ok()?;
                if st.is_file() {
                    self.overlay_record(&path, &mut st);
                }
                let inode = self.inodes.lookup(list.dir_id, &path, &st);
                Some(self.attr_told(&inode, &st))
            })
            .collect()
    }

    /// The cache state of a file opened offline: its record as saved, never reset (a
    /// record that is not clean and whole for some chunks just makes those reads fail).
    pub(super) fn offline_state(&self, inode: &Arc<Inode>, path: &Path) -> FileState {
        let st = self.offline_stat(path).ok();
        let identity = st.map(|st| self.identity(&st)).unwrap_or_default();
        let mut state = self.empty_state(identity);
        self.loaded.lock().unwrap().insert(inode.id, inode.clone());
        if let Some(files) = self.cache.open_existing(path)
            && let Ok(Some(Ok(rec))) = read_record(&files)
            && !rec.dirty
            && files
                .data
                .metadata()
                .is_ok_and(|m| m.len() == rec.identity.size)
        {
            state.attach(files, Some(rec));
        }
        state
    }

    pub(super) fn offline_statfs(&self) -> Result<libc::statvfs> {
        self.offline_request();
        let fd = self.cache.data_dir().root_fd();
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatvfs(std::os::fd::AsRawFd::as_raw_fd(&fd.as_fd()), &mut st) } != 0 {
            return Err(Errno::EIO);
        }
        Ok(st)
    }
}

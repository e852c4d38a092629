//! Acting on changes made to the source behind the mount (`coherence.rs` finds them).
//!
//! Every handler reconciles with the source *as it is now* rather than replaying the event:
//! the mount's own operations raise the same events, often after it has moved on, and an
//! event may describe a state that no longer exists. Re-reading the source makes handling
//! idempotent and keeps it safe to act on our own changes.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::Inode;
use super::{CachingFs, child};
use crate::coherence::{Batch, Notice};
use crate::source::Stat;
use crate::threads::Threads;

impl CachingFs {
    /// Handles one batch of watcher events.
    pub fn source_changed(&self, batch: Batch) {
        tracing::trace!(
            names = batch.names.len(),
            dirs = batch.dirs.len(),
            "watcher batch"
        );
        if batch.overflow {
            tracing::warn!("source watcher lost events");
            self.invalidate_everything();
        }
        for dir in &batch.dirs {
            self.coherence.notify(Notice::Inode(*dir));
        }
        // A directory whose names changed, or that changed itself, holds its listing no
        // longer (`coherence::ListingCallback`). Before anything else: the handling of a
        // batch ends (and the watcher turns `quiet`) only after this.
        let named = batch.names.iter().filter(|nc| nc.change.namespace);
        for dir in batch.dirs.iter().chain(named.map(|nc| &nc.dir)) {
            if let Some(inode) = self.inodes.get(*dir) {
                inode.break_callback();
            }
        }
        // Files watched themselves for their callbacks, changed by whatever name (a hard
        // link made or written elsewhere): the kernel's attributes go too.
        for &id in &batch.files {
            if let Some(inode) = self.inodes.get(id) {
                self.break_callback(&inode);
                self.coherence.notify(Notice::Inode(id));
            }
        }
        // Our own renames are either done or not begun while we look (`renames`).
        let _no_rename = self.renames.write().unwrap();
        let path_of_dir = |id: u64| self.inodes.get(id).and_then(|d| d.path());
        let mut paths: HashMap<PathBuf, usize> = HashMap::new();
        let mut to_paths: HashMap<usize, PathBuf> = HashMap::new();
        for (i, nc) in batch.names.iter().enumerate() {
            if let Some(p) = path_of_dir(nc.dir).and_then(|d| child(&d, &nc.name).ok()) {
                paths.insert(p, i);
            }
            if let Some((dir, name)) = &nc.moved_to
                && let Some(p) = path_of_dir(*dir).and_then(|d| child(&d, name).ok())
            {
                to_paths.insert(i, p);
            }
        }
        let wanted: HashSet<PathBuf> = paths.keys().cloned().collect();
        let mut holders: HashMap<PathBuf, Vec<Arc<Inode>>> = HashMap::new();
        for (p, inode) in self.inodes.holders_of(&wanted) {
            holders.entry(p).or_default().push(inode);
        }
        let mut dirs_changed = HashSet::new();
        for (path, i) in &paths {
            let nc = &batch.names[*i];
            let now = self.source.stat(path);
            tracing::trace!(?path, change = ?nc.change, exists = now.is_ok(), "source changed");
            if let Err(e) = &now
                && crate::source::may_mean_unreachable(e)
            {
                // No answer (offline, a timeout, a dead server): nothing is known of this
                // name, and it must not be taken for gone. Reconnection revalidates
                // everything.
                continue;
            }
            let held = holders.get(path).map(Vec::as_slice).unwrap_or(&[]);
            for inode in held {
                self.break_callback(inode);
            }
            // A rename behind the mount: the object's names (and, for a directory, those of
            // everything below it) and its cached data follow it. Our own renames have
            // already moved the names, so nothing holds the old one any more.
            if let (Some(to), Err(_)) = (to_paths.get(i), &now)
                && let Some(moved) = held.first()
                && let Ok(st_to) = self.source.stat(to)
                && (st_to.dev, st_to.ino) == moved.key
            {
                let to_dir = batch.names[*i].moved_to.as_ref().map_or(0, |m| m.0);
                self.inodes.renamed(path, to, false, nc.dir, to_dir);
                self.cache.rename(path, to, 0);
                self.cache_renamed(&[to]);
            }
            // Do the names we gave the kernel still say what the source says? Then the
            // event was our own change and the kernel needs no notice: notices take the
            // directory's lock in the kernel, which a request in flight may hold.
            let names_agree = match &now {
                Ok(st) => held
                    .iter()
                    .any(|i| i.is_same_file(st) && st.file_type() == i.file_type),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => held.is_empty(),
                Err(_) => false,
            };
            for inode in held {
                let same = now
                    .as_ref()
                    .is_ok_and(|st| inode.is_same_file(st) && st.file_type() == inode.file_type);
                if !same {
                    inode.remove_name(path);
                }
            }
            if nc.change.namespace && !names_agree {
                self.coherence
                    .notify(Notice::Entry(nc.dir, nc.name.clone()));
                dirs_changed.insert(nc.dir);
            }
            match now {
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    // Gone from the source: so is its cached copy (an open file keeps its
                    // cache files through its descriptors). Queued, as the mount's own
                    // unlinks are: most such events are theirs, already queued. This
                    // finding may be old when the removal is done: asked again then.
                    self.uncache_later_while_gone(path);
                }
                Err(_) => {}
                Ok(st) => {
                    if let Some(inode) = self.inodes.find(path, &st) {
                        self.break_callback(&inode);
                        let changed = self.revalidate_open(&inode, &st, nc.change.data);
                        // An open file whose cache still matches was changed by us.
                        let c = nc.change;
                        if changed != Some(false) && (c.data || c.attrib || c.namespace) {
                            self.coherence.notify(Notice::Inode(inode.id));
                        }
                    }
                }
            }
        }
        if !dirs_changed.is_empty() {
            self.namespace_changed_behind();
        }
        for dir in dirs_changed {
            self.coherence.notify(Notice::Inode(dir));
        }
    }

    /// An event on `inode`'s file or name: its callback, if any, stands no longer.
    fn break_callback(&self, inode: &Inode) {
        if inode.break_callback() {
            let c = &self.coherence.counters;
            c.callbacks_broken.fetch_add(1, Relaxed);
        }
    }

    /// After lost events: the kernel drops everything it holds, open files revalidate.
    pub(super) fn invalidate_everything(&self) {
        tracing::info!("invalidating everything the kernel holds");
        for inode in self.inodes.referenced() {
            self.coherence.notify(Notice::Inode(inode.id));
            if let Some(name) = inode.path().as_deref().and_then(|p| p.file_name()) {
                self.coherence
                    .notify(Notice::Entry(inode.parent(), name.to_os_string()));
            }
            if let Some(st) = self.stat_open(&inode) {
                self.revalidate_open(&inode, &st, true);
            }
        }
    }

    /// `fstat` of the source behind an open file; `None` if it is not open or the source
    /// does not answer. The descriptor is duplicated under the file's lock and asked
    /// outside it, under the source guard: a hung source must not hold the lock that
    /// every cached read of the file needs.
    fn stat_open(&self, inode: &Inode) -> Option<Stat> {
        let fd = {
            let guard = inode.file();
            crate::source::dup_file(guard.as_ref()?.path_fd.as_ref()?.as_fd()).ok()?
        };
        self.source.fstat(fd.as_fd()).ok()
    }

    /// Compares an open file's cache with the source version `st` and, if the source
    /// changed behind the mount, acts on it: handles open on the whole old version keep it
    /// and the name moves to a new node (`keep_version`); otherwise the cached data is
    /// dropped. `data_event`: a watcher saw the data written; without it, a new ctime with
    /// the same size and mtime is a metadata change (rename, chmod) and the cached data
    /// stays. `None`: the file is not open; `Some(changed)` otherwise.
    fn revalidate_open(&self, inode: &Arc<Inode>, st: &Stat, data_event: bool) -> Option<bool> {
        let mut st = *st;
        let mut guard = inode.file();
        // `st` was taken before the lock, and a write through the mount may have been
        // recorded since: a file that moved on is looked at again (outside the lock).
        for _ in 0..3 {
            let state = guard.as_ref()?;
            if state.written() || state.record().identity.same_version(&self.identity(&st)) {
                break;
            }
            drop(guard);
            let again = self.stat_open(inode);
            guard = inode.file();
            match again {
                Some(again) if self.identity(&again) != self.identity(&st) => st = again,
                _ => break,
            }
        }
        let st = &st;
        let state = guard.as_mut()?;
        let now = self.identity(st);
        if inode.is_retired()
            || inode.is_changing()
            || state.written()
            || state.record().identity == now
            || !self.coherence.tunables.stale_check.load(Relaxed)
            || !inode.is_same_file(st)
            // Checked by content last: it reads the source.
            || inode
                .path()
                .is_some_and(|p| self.settle_racy(&p, state, st))
        {
            return Some(false);
        }
        self.coherence
            .counters
            .changes_detected
            .fetch_add(1, Relaxed);
        let old = state.record().identity;
        // A file no name leads to any more (renamed over, unlinked) had its ctime moved by
        // that, not its data.
        let data_event = data_event && st.nlink > 0;
        if !data_event && old.size == now.size && old.mtime == now.mtime {
            state.own_version(self.recorded_identity(st));
            // (A record waiting for its checkpoint or commit is written by it.)
            if !state.needs_checkpoint() {
                state.persist_record(&self.env(), false);
            }
            return Some(true);
        }
        if !self.keep_version(inode, state, st) {
            let path = self.own_path(inode);
            self.stale(state, st, path.as_deref());
            inode.content_changed();
        }
        Some(true)
    }

    /// Revalidates open files whose leases expired, and renews the leases of those still
    /// open; a directory's listing kept by the kernel (`kernel_listing`) is dropped.
    pub fn leases_expired(&self, ids: Vec<u64>) {
        for id in ids {
            let Some(inode) = self.inodes.get(id) else {
                continue;
            };
            if inode.file_type == libc::S_IFDIR {
                self.coherence.counters.leases_expired.fetch_add(1, Relaxed);
                self.coherence.notify(Notice::Inode(id));
                continue;
            }
            let Some(st) = self.stat_open(&inode) else {
                continue; // closed: the lease ends with the last handle
            };
            self.coherence.counters.leases_expired.fetch_add(1, Relaxed);
            if self.revalidate_open(&inode, &st, true) == Some(true) {
                self.coherence.notify(Notice::Inode(id));
            }
            if inode.file().is_some() {
                self.grant_lease(id);
            }
        }
    }

    /// A validation lease for open file `id` where no watcher reports its changes.
    pub(super) fn grant_lease(&self, id: u64) {
        let parent = self.inodes.get(id).map_or(0, |i| i.parent());
        if self.coherence.watched(parent) {
            return;
        }
        let ttl = self.coherence.tunables.attr(false);
        self.coherence
            .leases
            .grant(id, ttl, &self.coherence.counters);
    }
}

/// How often the pages of files served while racy are looked at (`drop_racy_pages`).
const RACY_PAGES_EVERY: Duration = Duration::from_millis(100);

/// How long the coherence threads wait before they look at their stop signal again.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Starts the threads that feed `source_changed` (watcher) and `leases_expired`, and the
/// relisting of changed offline listings, in the returned group.
pub fn spawn_coherence_threads(fs: &Arc<CachingFs>) -> std::io::Result<Threads> {
    let threads = Threads::new("coherence");
    let weak: Weak<CachingFs> = Arc::downgrade(fs);
    threads.spawn("relist", move |stop| {
        while stop.sleep(super::offline::RELIST_EVERY) {
            let Some(fs) = weak.upgrade() else { return };
            fs.relist_changed();
        }
    })?;
    if fs.kernel_opens() {
        let weak: Weak<CachingFs> = Arc::downgrade(fs);
        threads.spawn("racy-pages", move |stop| {
            while stop.sleep(RACY_PAGES_EVERY) {
                let Some(fs) = weak.upgrade() else { return };
                fs.drop_racy_pages();
            }
        })?;
    }
    if fs.coherence.watcher.is_some() {
        let weak: Weak<CachingFs> = Arc::downgrade(fs);
        threads.spawn("watcher", move |stop| {
            while !stop.is_set() {
                let batch = {
                    let Some(fs) = weak.upgrade() else { return };
                    let w = fs.coherence.watcher.as_ref().unwrap();
                    let events = w.wait_readable(STOP_POLL).and_then(|ready| {
                        ready
                            .then(|| {
                                // Until it is handled, no callback answers (`quiet`).
                                w.begin_batch();
                                w.next_batch(&fs.coherence.counters)
                            })
                            .transpose()
                    });
                    match events {
                        Ok(Some(b)) => b,
                        Ok(None) => continue,
                        Err(e) => {
                            tracing::error!("source watcher failed: {e}");
                            fs.coherence.tunables.watch.store(false, Relaxed);
                            return;
                        }
                    }
                };
                let Some(fs) = weak.upgrade() else { return };
                if fs.coherence.tunables.watch.load(Relaxed) {
                    fs.source_changed(batch);
                }
                fs.coherence.watcher.as_ref().unwrap().batch_handled();
            }
        })?;
    }
    let weak: Weak<CachingFs> = Arc::downgrade(fs);
    threads.spawn("leases", move |stop| {
        while !stop.is_set() {
            let Some(fs) = weak.upgrade() else { return };
            let expired = fs.coherence.leases.wait_expired(STOP_POLL);
            if !expired.is_empty() {
                fs.leases_expired(expired);
            }
        }
    })?;
    Ok(threads)
}

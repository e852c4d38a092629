//! Removing cache entries, now (`remove_entry`, `remove_tree`) or later.
//!
//! Cache entries of names removed through the mount are removed off the request's path.
//! An unlink through the mount removes the source's name before it returns; the cache's
//! record and data file of that name (two more inodes to look up and unlink) can follow
//! a moment later (issue 22: `rm -rf` spent 40 % of its time there).
//!
//! The rule that keeps this invisible: the store settles a path before any operation on
//! it (`Removals::settle`). A removal still queued for that path or an ancestor of it
//! (and, for an operation on a whole subtree, a descendant) is done right there, under the
//! queue's lock, before the operation goes on. So once a removal is asked for, nothing
//! reads the entry it removes, and an entry made after it is never removed by it.
//!
//! A crash loses the queue: the entries stay, as they do when a crash falls between the
//! source's unlink and the cache's today. They name files the source no longer has, and a
//! file made later under such a name never matches their record.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use rustix::fs::{Mode, OFlags};

use super::reaper::Reaper;
use super::store::{Removed, Trees};
use crate::source::{BeneathRoot, cvt, fstat};

/// Removals waiting beyond this many are done by the caller itself.
const BACKLOG: usize = 4096;

/// What is told what a removal removed (the cleaner's usage).
pub type Report = Box<dyn FnOnce(Removed) + Send>;

/// Asked when a removal is done, for one asked on a finding that may be old by then (the
/// watcher saw the source's name gone, and a file may have been made under it since):
/// is it still due? Asked again at that moment, in the order `settle` keeps, so that an
/// entry made after the name came back is never removed by it.
pub type StillDue = Box<dyn Fn() -> bool + Send>;

/// A queued removal: what to tell, and (for a conditional one) when it is still due.
struct Queued {
    report: Report,
    still_due: Option<StillDue>,
}

impl Queued {
    fn run(self, shared: &Shared, path: &Path) {
        if self.still_due.as_ref().is_none_or(|due| due()) {
            (self.report)((shared.remove_now)(path));
        }
    }
}

/// Removes one entry (a file's record and data, or a directory's subtree) now.
type RemoveNow = Box<dyn Fn(&Path) -> Removed + Send + Sync>;

pub struct Removals {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Removals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Removals")
            .field("pending", &self.shared.pending.load(Ordering::SeqCst))
            .finish()
    }
}

struct Shared {
    queue: Mutex<Queue>,
    /// A removal finished, or one was queued (the worker waits on it too).
    changed: Condvar,
    /// Queued plus in flight: lets `settle` return without the lock when nothing waits.
    pending: AtomicUsize,
    remove_now: RemoveNow,
}

#[derive(Default)]
struct Queue {
    /// Paths in the order asked; a path no longer in `queued` was settled already.
    order: VecDeque<PathBuf>,
    /// Ordered by component, so that a path's descendants follow it in one run.
    queued: BTreeMap<PathBuf, Queued>,
    /// The path the worker is removing now, without the lock.
    in_flight: Option<PathBuf>,
    stop: bool,
}

/// Which queued removals an operation on a path must wait for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The path itself and its ancestors: an operation on one entry.
    Entry,
    /// Also everything beneath the path: an operation that moves or removes a subtree.
    Subtree,
}

fn concerns(queued: &Path, rel: &Path, scope: Scope) -> bool {
    rel.starts_with(queued) || (scope == Scope::Subtree && queued.starts_with(rel))
}

impl Removals {
    /// Removals without a worker: each is done by its caller. For a store opened before
    /// the daemon forks, whose threads would not survive the fork (`CacheStore::start_workers`).
    pub fn inline(remove_now: RemoveNow) -> Removals {
        Removals {
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue::default()),
                changed: Condvar::new(),
                pending: AtomicUsize::new(0),
                remove_now,
            }),
            worker: None,
        }
    }

    /// Starts the worker. Without a thread (it could not start) every removal is done by
    /// its caller.
    pub fn start(remove_now: RemoveNow) -> Removals {
        let mut removals = Removals::inline(remove_now);
        let for_worker = removals.shared.clone();
        removals.worker = std::thread::Builder::new()
            .name("cache-removals".into())
            .spawn(move || work(&for_worker))
            .ok();
        removals
    }

    /// Removes the entry of `rel` soon; `report` is told what it held.
    pub fn remove_later(&self, rel: &Path, report: Report) {
        self.queue(rel, report, None);
    }

    /// Removes the entry of `rel` soon if, when that is done, `still_due` says it still is;
    /// `report` is told what it held, if it was removed.
    pub fn remove_later_if(&self, rel: &Path, still_due: StillDue, report: Report) {
        self.queue(rel, report, Some(still_due));
    }

    fn queue(&self, rel: &Path, report: Report, still_due: Option<StillDue>) {
        let shared = &*self.shared;
        let mut q = shared.queue.lock().unwrap();
        if let Some(queued) = q.queued.get_mut(rel) {
            // Still queued: nothing was made there since, and that removal will do; it
            // stays conditional only if both are.
            if still_due.is_none() {
                queued.still_due = None;
            }
            return;
        }
        let removal = Queued { report, still_due };
        if self.worker.is_none() || q.queued.len() >= BACKLOG {
            // Done now: removals queued for its ancestors or descendants remove the same
            // or more, and nothing there is made meanwhile (no one settles it). A
            // conditional one under the lock, as the worker's is done while settling
            // waits: whoever makes an entry there must come after its answer.
            if removal.still_due.is_none() {
                drop(q);
            }
            removal.run(shared, rel);
            return;
        }
        shared.pending.fetch_add(1, Ordering::SeqCst);
        q.order.push_back(rel.to_path_buf());
        q.queued.insert(rel.to_path_buf(), removal);
        shared.changed.notify_all();
    }

    /// Does now, before returning, every queued removal an operation on `rel` depends on.
    pub fn settle(&self, rel: &Path, scope: Scope) {
        let shared = &*self.shared;
        if shared.pending.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut q = shared.queue.lock().unwrap();
        while q
            .in_flight
            .as_deref()
            .is_some_and(|p| concerns(p, rel, scope))
        {
            q = shared.changed.wait(q).unwrap();
        }
        let due: Vec<PathBuf> = match scope {
            Scope::Entry => (rel.ancestors())
                .filter(|a| q.queued.contains_key(*a))
                .map(Path::to_path_buf)
                .collect(),
            Scope::Subtree => (rel.ancestors().skip(1))
                .filter(|a| q.queued.contains_key(*a))
                .map(Path::to_path_buf)
                .chain(
                    (q.queued
                        .range::<Path, _>((Bound::Included(rel), Bound::Unbounded)))
                    .map(|(p, _)| p)
                    .take_while(|p| p.starts_with(rel))
                    .cloned(),
                )
                .collect(),
        };
        // Under the lock: whoever settles the same path next waits for these.
        for path in due {
            remove_queued(shared, &mut q, &path);
        }
    }

    /// Does every queued removal now.
    pub fn settle_all(&self) {
        self.settle(Path::new(""), Scope::Subtree);
    }
}

fn remove_queued(shared: &Shared, q: &mut MutexGuard<'_, Queue>, path: &Path) {
    if let Some(removal) = q.queued.remove(path) {
        removal.run(shared, path);
        shared.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

fn work(shared: &Shared) {
    super::reaper::background_priority();
    let mut q = shared.queue.lock().unwrap();
    loop {
        let Some(path) = q.order.pop_front() else {
            if q.stop {
                return;
            }
            q = shared.changed.wait(q).unwrap();
            continue;
        };
        let Some(removal) = q.queued.remove(&path) else {
            continue; // settled by an operation on it
        };
        q.in_flight = Some(path.clone());
        drop(q);
        removal.run(shared, &path);
        q = shared.queue.lock().unwrap();
        q.in_flight = None;
        shared.pending.fetch_sub(1, Ordering::SeqCst);
        shared.changed.notify_all();
    }
}

impl Drop for Removals {
    /// Finishes the queue: the store's lock on the cache directory must not be let go
    /// while removals in it are still to come.
    fn drop(&mut self) {
        self.shared.queue.lock().unwrap().stop = true;
        self.shared.changed.notify_all();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

// How an entry is removed, now.

/// What the queue of removals calls to remove an entry.
pub(super) fn remove_now(
    meta: &Arc<BeneathRoot>,
    data: &Arc<BeneathRoot>,
    reaper: &Reaper,
) -> Box<dyn Fn(&Path) -> Removed + Send + Sync> {
    let trees = Trees {
        meta: meta.clone(),
        data: data.clone(),
    };
    let reaper = reaper.clone();
    Box::new(move |rel: &Path| {
        remove_entry(&trees, &reaper, rel).unwrap_or_else(|e| {
            tracing::warn!(?rel, "cannot drop cache entry: {e}");
            Removed::default()
        })
    })
}

/// `CacheStore::remove_entry`, for the store and its removals' worker.
pub(super) fn remove_entry(trees: &Trees, reaper: &Reaper, rel: &Path) -> io::Result<Removed> {
    let mut removed = Removed::default();
    for (tree, is_meta) in [(&trees.meta, true), (&trees.data, false)] {
        let (dir, name) = match tree.parent(rel) {
            Ok(x) => x,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => {
                continue;
            }
            Err(e) => return Err(e),
        };
        let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let held = match rustix::fs::openat(&dir, name.as_c_str(), flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => continue,
            Err(e) => return Err(io::Error::from_raw_os_error(e.raw_os_error())),
        };
        let st = fstat(held.as_fd())?;
        remove_at(&dir, &name)?;
        if is_meta {
            removed.record = st.mode & libc::S_IFMT == libc::S_IFREG;
        } else {
            removed.data_bytes = st.blocks * 512;
        }
        if st.mode & libc::S_IFMT == libc::S_IFREG && st.nlink <= 1 {
            reaper.close_later(held);
        }
    }
    Ok(removed)
}

/// Removes `rel` beneath `tree`, recursively for directories, never following symlinks.
/// A missing entry is not an error.
pub fn remove_tree(tree: &BeneathRoot, rel: &Path) -> io::Result<()> {
    let (dir, name) = match tree.parent(rel) {
        Ok(x) => x,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => return Ok(()),
        Err(e) => return Err(e),
    };
    remove_at(&dir, &name)
}

fn remove_at(dir: &OwnedFd, name: &CString) -> io::Result<()> {
    let r = unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) };
    if r == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENOENT) => Ok(()),
        Some(libc::EISDIR) => {
            let fd = unsafe {
                libc::openat(
                    dir.as_raw_fd(),
                    name.as_ptr(),
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                )
            };
            let sub = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(cvt(fd)?) };
            let names: Vec<CString> = {
                let mut d = rustix::fs::Dir::read_from(sub.as_fd())
                    .map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))?;
                let mut v = Vec::new();
                while let Some(ent) = d.read() {
                    let ent = ent.map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))?;
                    let n = ent.file_name();
                    if n.to_bytes() != b"." && n.to_bytes() != b".." {
                        v.push(n.to_owned());
                    }
                }
                v
            };
            for n in &names {
                remove_at(&sub, n)?;
            }
            cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) })?;
            Ok(())
        }
        _ => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::time::Duration;

    /// A removal that takes a while and records what it removed, in order.
    fn slow_log() -> (Arc<Mutex<Vec<PathBuf>>>, RemoveNow) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        let remove = Box::new(move |p: &Path| {
            std::thread::sleep(Duration::from_millis(2));
            l.lock().unwrap().push(p.to_path_buf());
            Removed::default()
        });
        (log, remove)
    }

    #[test]
    fn queued_removals_are_done_by_the_worker_and_reported() {
        let (log, remove) = slow_log();
        let r = Removals::start(remove);
        let reported = Arc::new(AtomicU64::new(0));
        for i in 0..20 {
            let n = reported.clone();
            r.remove_later(
                Path::new(&format!("d/f{i}")),
                Box::new(move |_| {
                    n.fetch_add(1, Ordering::SeqCst);
                }),
            );
        }
        drop(r); // finishes the queue
        assert_eq!(reported.load(Ordering::SeqCst), 20);
        assert_eq!(log.lock().unwrap().len(), 20);
    }

    #[test]
    fn settling_a_path_removes_what_is_queued_for_it_and_its_ancestors_first() {
        let (log, remove) = slow_log();
        let r = Removals::start(remove);
        // Many before them, so that the worker has not reached them yet.
        for i in 0..200 {
            r.remove_later(Path::new(&format!("x/{i}")), Box::new(|_| {}));
        }
        r.remove_later(Path::new("a/b"), Box::new(|_| {}));
        r.remove_later(Path::new("a"), Box::new(|_| {}));
        r.remove_later(Path::new("c/d/e"), Box::new(|_| {}));
        r.settle(Path::new("a/b"), Scope::Entry);
        let done = log.lock().unwrap().clone();
        assert!(done.contains(&PathBuf::from("a/b")));
        assert!(done.contains(&PathBuf::from("a")));
        assert!(!done.contains(&PathBuf::from("c/d/e")), "not its concern");
        r.settle(Path::new("c"), Scope::Entry);
        assert!(!log.lock().unwrap().contains(&PathBuf::from("c/d/e")));
        r.settle(Path::new("c"), Scope::Subtree);
        assert!(log.lock().unwrap().contains(&PathBuf::from("c/d/e")));
        r.settle_all();
        assert_eq!(log.lock().unwrap().len(), 203);
    }

    /// A queue whose removals remove files beneath a temporary directory.
    fn files_removed_for_real() -> (tempfile::TempDir, Removals) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let r = Removals::start(Box::new(move |p: &Path| {
            let _ = std::fs::remove_file(root.join(p));
            Removed::default()
        }));
        (dir, r)
    }

    /// The race the rule is for: an entry made right after a removal of its name was asked
    /// for (unlink then create) must survive that removal, however the worker is timed.
    #[test]
    fn an_entry_made_after_a_removal_was_asked_is_never_removed_by_it() {
        let (dir, r) = files_removed_for_real();
        let root = dir.path().to_path_buf();
        let writer = |r: &Removals, name: &str, rounds: u32| {
            let path = Path::new(name);
            for i in 0..rounds {
                r.settle(path, Scope::Entry);
                std::fs::write(root.join(path), i.to_string()).unwrap();
                r.remove_later(path, Box::new(|_| {}));
                r.settle(path, Scope::Entry);
                assert!(
                    !root.join(path).exists(),
                    "the old entry is seen after its removal"
                );
                std::fs::write(root.join(path), format!("new {i}")).unwrap();
                // Whatever the worker does now, the new entry stays.
                std::thread::yield_now();
                r.settle(path, Scope::Entry);
                assert_eq!(
                    std::fs::read_to_string(root.join(path)).unwrap(),
                    format!("new {i}"),
                    "round {i}"
                );
                r.remove_later(path, Box::new(|_| {}));
            }
        };
        std::thread::scope(|s| {
            for t in 0..4 {
                let r = &r;
                s.spawn(move || writer(r, &format!("f{t}"), 2000));
            }
        });
        r.settle_all();
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
    }

    /// The watcher's removals are asked on a finding (the source's name gone) that may be
    /// old by the time they are done: an entry made after the name came back (the mount's
    /// create makes the source's file first, then its cache entry) must survive them,
    /// however the worker and the settling are timed.
    #[test]
    fn a_removal_on_an_old_finding_never_removes_an_entry_made_since() {
        use std::sync::atomic::AtomicBool;
        let (dir, r) = files_removed_for_real();
        let root = dir.path().to_path_buf();
        let writer = |r: &Removals, name: &str, rounds: u32| {
            let path = Path::new(name);
            let in_source = Arc::new(AtomicBool::new(false));
            for i in 0..rounds {
                // Created through the mount: the source's file, then the cache entry.
                in_source.store(true, Ordering::SeqCst);
                r.settle(path, Scope::Entry);
                std::fs::write(root.join(path), format!("new {i}")).unwrap();
                // The watcher's removal, from the unlink of the round before.
                let s = in_source.clone();
                r.remove_later_if(
                    path,
                    Box::new(move || !s.load(Ordering::SeqCst)),
                    Box::new(|_| {}),
                );
                std::thread::yield_now();
                r.settle(path, Scope::Entry);
                assert_eq!(
                    std::fs::read_to_string(root.join(path)).ok(),
                    Some(format!("new {i}")),
                    "round {i}: the entry made since is gone"
                );
                // Unlinked through the mount: the source's name, then the entry, later.
                in_source.store(false, Ordering::SeqCst);
                r.remove_later(path, Box::new(|_| {}));
                // A conditional removal beside it changes nothing: the name is gone.
                let s = in_source.clone();
                r.remove_later_if(
                    path,
                    Box::new(move || !s.load(Ordering::SeqCst)),
                    Box::new(|_| {}),
                );
            }
        };
        std::thread::scope(|s| {
            for t in 0..4 {
                let r = &r;
                s.spawn(move || writer(r, &format!("f{t}"), 2000));
            }
        });
        r.settle_all();
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
    }
}

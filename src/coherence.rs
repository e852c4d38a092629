//! Coherence with a source that changes behind the mount.
//!
//! The kernel keeps names, attributes, directory listings and page cache for as long as
//! hoardfs lets it (the Coda MiniCache). Long TTLs are only safe if the daemon learns of
//! changes and revokes those copies; this module is how it learns:
//!
//! - [`Watcher`]: for sources on a local file system, one inotify watch per directory the
//!   kernel knows entries of. Events are batched and handed to
//!   `CachingFs::source_changed` (in `fs/changes.rs`), which reconciles the inode table and
//!   the cache with the source as it is now and sends [`Notice`]s to the kernel.
//! - [`Leases`]: where no events arrive (network and FUSE sources), every open file gets a
//!   validation lease of one attribute TTL, kept in a list ordered by expiry and expired
//!   actively (the Faster AFS callback list): an expired lease revalidates the file against
//!   the source instead of each call testing it. Opens always validate (close-to-open).
//! - [`Callback`]: where the watcher covers a file (its directory and the file itself are
//!   watched), a look at the source stands until an event breaks it (the AFS callback):
//!   opens and `getattr`s of the file ask the source nothing while the watcher has no
//!   event unhandled (`Watcher::quiet`), so an open still gets a version that was the
//!   file's at some instant of the open.
//! - [`Tunables`]: TTLs, stale checking and the watcher switch, changeable at run time.

use std::collections::{BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use rustix::fs::inotify::{self, ReadFlags, WatchFlags};
use serde::{Deserialize, Serialize};

use crate::config::{Config, UNWATCHED_TTL, WATCHED_TTL, WatchMode};

/// Something the kernel must forget, sent through the FUSE notification channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// Attributes and cached data (page cache; for a directory, its cached listing).
    Inode(u64),
    /// The name `name` in directory `parent` (a positive or negative dentry).
    Entry(u64, OsString),
}

/// What changed about a name in a watched directory, from the event masks of one batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// The name appeared, disappeared or now names another object.
    pub namespace: bool,
    /// The object's data changed (written, truncated).
    pub data: bool,
    /// Its attributes changed (mode, owner, times, link count, xattrs).
    pub attrib: bool,
}

/// One name's change in a batch; `moved_to` pairs a rename's two halves.
#[derive(Debug)]
pub struct NameChange {
    pub dir: u64,
    pub name: OsString,
    pub change: Change,
    pub moved_to: Option<(u64, OsString)>,
}

/// Counters shown by `hoardfs stats`.
#[derive(Debug, Default)]
pub struct Counters {
    pub watcher_events: AtomicU64,
    pub watcher_overflows: AtomicU64,
    pub watch_failures: AtomicU64,
    pub inval_inode: AtomicU64,
    pub inval_entry: AtomicU64,
    pub leases_granted: AtomicU64,
    pub leases_expired: AtomicU64,
    pub changes_detected: AtomicU64,
    pub callbacks_granted: AtomicU64,
    pub callbacks_broken: AtomicU64,
    /// Opens and `getattr`s answered by a callback, without asking the source.
    pub callback_hits: AtomicU64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct CoherenceSnapshot {
    /// The watcher is running (a local source, watch not off).
    pub watching: bool,
    pub watched_dirs: u64,
    /// inotify events received.
    pub watcher_events: u64,
    /// Times the event queue overflowed (everything known was invalidated).
    pub watcher_overflows: u64,
    /// Directories that could not be watched (they get the short TTLs).
    pub watch_failures: u64,
    /// Kernel notifications sent: inode (attributes, data, listings) and entry (names).
    pub inval_inode: u64,
    pub inval_entry: u64,
    pub leases_active: u64,
    pub leases_granted: u64,
    pub leases_expired: u64,
    /// Source changes made behind the mount that invalidated something.
    pub changes_detected: u64,
    /// Files the watcher covers (`Callback`s): granted, broken by an event, and opens or
    /// `getattr`s they answered without asking the source; files watched themselves.
    pub callbacks_granted: u64,
    pub callbacks_broken: u64,
    pub callback_hits: u64,
    pub watched_files: u64,
    /// Kernel TTLs in ms; `None`: automatic (long where watched, short elsewhere).
    pub entry_ttl_ms: Option<u64>,
    pub attr_ttl_ms: Option<u64>,
    pub negative_ttl_ms: Option<u64>,
    pub stale_check: bool,
    pub close_to_open: bool,
}

/// Run-time switches (`hoardfs set`).
#[derive(Debug)]
pub struct Tunables {
    /// TTLs in ms; `AUTO` means chosen by whether the directory is watched.
    entry_ms: AtomicU64,
    attr_ms: AtomicU64,
    negative_ms: AtomicU64,
    pub stale_check: AtomicBool,
    /// Watch events are acted on and watched directories get long TTLs.
    pub watch: AtomicBool,
    /// Every open asks the source (close-to-open), callbacks or not.
    pub close_to_open: AtomicBool,
}

const AUTO: u64 = u64::MAX;

fn ms(d: Option<Duration>) -> u64 {
    d.map_or(AUTO, |d| d.as_millis().min(AUTO as u128 - 1) as u64)
}

impl Tunables {
    pub fn new(cfg: &Config) -> Tunables {
        Tunables {
            entry_ms: AtomicU64::new(ms(cfg.entry_ttl)),
            attr_ms: AtomicU64::new(ms(cfg.attr_ttl)),
            negative_ms: AtomicU64::new(ms(cfg.negative_ttl)),
            stale_check: AtomicBool::new(cfg.stale_check),
            watch: AtomicBool::new(cfg.watch != WatchMode::Off),
            close_to_open: AtomicBool::new(cfg.close_to_open),
        }
    }

    fn pick(v: &AtomicU64, watched: bool) -> Duration {
        match v.load(Relaxed) {
            AUTO if watched => WATCHED_TTL,
            AUTO => UNWATCHED_TTL,
            ms => Duration::from_millis(ms),
        }
    }

    pub fn entry(&self, watched: bool) -> Duration {
        Self::pick(&self.entry_ms, watched)
    }
    pub fn attr(&self, watched: bool) -> Duration {
        Self::pick(&self.attr_ms, watched)
    }
    pub fn negative(&self, watched: bool) -> Duration {
        Self::pick(&self.negative_ms, watched)
    }

    /// Kernel TTLs of a live mount (`hoardfs set`); `None`: chosen per directory, by
    /// whether it is watched.
    pub fn set_entry(&self, t: Option<Duration>) {
        self.entry_ms.store(ms(t), Relaxed);
    }
    pub fn set_attr(&self, t: Option<Duration>) {
        self.attr_ms.store(ms(t), Relaxed);
    }
    pub fn set_negative(&self, t: Option<Duration>) {
        self.negative_ms.store(ms(t), Relaxed);
    }

    fn fill(&self, s: &mut CoherenceSnapshot) {
        let opt = |v: &AtomicU64| Some(v.load(Relaxed)).filter(|&v| v != AUTO);
        s.entry_ttl_ms = opt(&self.entry_ms);
        s.attr_ttl_ms = opt(&self.attr_ms);
        s.negative_ttl_ms = opt(&self.negative_ms);
        s.stale_check = self.stale_check.load(Relaxed);
        s.close_to_open = self.close_to_open.load(Relaxed);
    }
}

/// Everything coherence-related a mount holds.
pub struct Coherence {
    pub tunables: Tunables,
    pub counters: Counters,
    pub watcher: Option<Watcher>,
    pub leases: Leases,
    notify: Box<dyn Fn(Notice) + Send + Sync>,
}

impl Coherence {
    /// Starts the watcher if `cfg.watch` asks for it and the source allows it.
    /// `local`: the source is on a local file system (not `source::is_remote`).
    pub fn new(cfg: &Config, local: bool) -> Coherence {
        let watcher = match cfg.watch {
            WatchMode::Off => None,
            WatchMode::Auto if !local => {
                tracing::info!("source is a network or FUSE file system: no watcher, leases");
                None
            }
            _ => match Watcher::new() {
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!("cannot start the source watcher ({e}); short TTLs");
                    None
                }
            },
        };
        Coherence {
            tunables: Tunables::new(cfg),
            counters: Counters::default(),
            watcher,
            leases: Leases::default(),
            notify: Box::new(|_| {}),
        }
    }

    pub fn set_notifier(&mut self, f: impl Fn(Notice) + Send + Sync + 'static) {
        self.notify = Box::new(f);
    }

    /// Asks the kernel to drop what `n` names (from any thread: it only queues).
    pub fn notify(&self, n: Notice) {
        let c = match n {
            Notice::Inode(_) => &self.counters.inval_inode,
            Notice::Entry(..) => &self.counters.inval_entry,
        };
        c.fetch_add(1, Relaxed);
        (self.notify)(n);
    }

    /// Whether changes in directory `dir` are reported (so its entries may live long).
    pub fn watched(&self, dir: u64) -> bool {
        self.tunables.watch.load(Relaxed)
            && self.watcher.as_ref().is_some_and(|w| w.is_watched(dir))
    }

    /// Makes sure directory `dir` (open as `fd`) is watched; call before stat'ing what is
    /// in it, so that no change between the stat and the watch goes unseen.
    pub fn watch_dir(&self, dir: u64, fd: impl FnOnce() -> Option<OwnedFd>) {
        if let Some(w) = &self.watcher
            && !w.is_watched(dir)
            && let Some(fd) = fd()
            && !w.add(dir, fd.as_fd())
        {
            self.counters.watch_failures.fetch_add(1, Relaxed);
        }
    }

    /// Where a callback for a file in directory `dir` must start (`Callback::new`): `None`
    /// if the watcher does not cover the directory, or opens must ask the source anyway.
    pub fn callback_mark(&self, dir: u64) -> Option<CallbackMark> {
        let w = self.watcher.as_ref()?;
        if !self.tunables.watch.load(Relaxed)
            || self.tunables.close_to_open.load(Relaxed)
            || !self.tunables.stale_check.load(Relaxed)
        {
            return None;
        }
        Some(CallbackMark {
            dir_watch: w.watch_of(dir)?,
            epoch: w.epoch(),
        })
    }

    /// Whether `cb` still stands for a file now in directory `dir`: nothing broke it
    /// (the caller holds it), its watches are the ones it was granted under, and the
    /// watcher has no event that it has not handled yet, so that every change to the file
    /// completed before this call has broken it. Counted as a hit.
    pub fn callback_holds(&self, cb: &Callback, id: u64, dir: u64) -> bool {
        let Some(w) = &self.watcher else {
            return false;
        };
        let holds = self.callback_mark(dir).is_some_and(|m| m == cb.mark)
            && w.file_watch(id) == Some(cb.file_wd)
            && cb.at.elapsed() < self.tunables.attr(true)
            && w.quiet();
        if holds {
            self.counters.callback_hits.fetch_add(1, Relaxed);
        }
        holds
    }

    /// A callback for the file open as `fd` (`O_PATH`), node `id`, whose look at the
    /// source `st` was taken after `mark`: the file itself is watched too (so that a write
    /// through a hard link elsewhere, or a new link, breaks it), and only a file with one
    /// link gets one. `None` where that cannot be had.
    pub fn callback(
        &self,
        mark: CallbackMark,
        id: u64,
        fd: &OwnedFd,
        st: &crate::source::Stat,
    ) -> Option<Callback> {
        let w = self.watcher.as_ref()?;
        if st.nlink != 1 || !st.is_file() || w.epoch() != mark.epoch {
            return None;
        }
        let file_wd = w.watch_file(id, fd.as_fd())?;
        let fd = Arc::new(fd.try_clone().ok()?);
        self.counters.callbacks_granted.fetch_add(1, Relaxed);
        Some(Callback {
            stat: *st,
            fd,
            mark,
            file_wd,
            at: Instant::now(),
        })
    }

    pub fn snapshot(&self) -> CoherenceSnapshot {
        let c = &self.counters;
        let mut s = CoherenceSnapshot {
            watching: self.watcher.is_some() && self.tunables.watch.load(Relaxed),
            watched_dirs: self.watcher.as_ref().map_or(0, |w| w.len() as u64),
            watcher_events: c.watcher_events.load(Relaxed),
            watcher_overflows: c.watcher_overflows.load(Relaxed),
            watch_failures: c.watch_failures.load(Relaxed),
            inval_inode: c.inval_inode.load(Relaxed),
            inval_entry: c.inval_entry.load(Relaxed),
            leases_active: self.leases.len() as u64,
            leases_granted: c.leases_granted.load(Relaxed),
            leases_expired: c.leases_expired.load(Relaxed),
            changes_detected: c.changes_detected.load(Relaxed),
            callbacks_granted: c.callbacks_granted.load(Relaxed),
            callbacks_broken: c.callbacks_broken.load(Relaxed),
            callback_hits: c.callback_hits.load(Relaxed),
            watched_files: self.watcher.as_ref().map_or(0, |w| w.files() as u64),
            ..Default::default()
        };
        self.tunables.fill(&mut s);
        s
    }
}

// --------------------------------------------------------------------------- callbacks

/// The watches a callback was granted under: its directory's watch and the watcher's
/// epoch then. A callback holds only while both are the same (`Coherence::callback_holds`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallbackMark {
    dir_watch: u64,
    epoch: u64,
}

/// A look at a source file that stands until the watcher breaks it (an event on the file
/// or its name) or a watch it relies on goes: Faster AFS's callback, with the watcher as
/// the server's promise. Kept by the inode table's entry of the file.
#[derive(Clone, Debug)]
pub struct Callback {
    /// The file's attributes at the look.
    pub stat: crate::source::Stat,
    /// An `O_PATH` descriptor of the file (what an open keeps, so that `fstat` of an open
    /// file whose name is gone still answers).
    pub fd: Arc<OwnedFd>,
    mark: CallbackMark,
    /// The watch on the file itself (`Watcher::watch_file`).
    file_wd: i32,
    /// When it was granted: it lapses after the watched attribute TTL even without an
    /// event (what inotify does not report: writes through shared mappings).
    at: Instant,
}

// ---------------------------------------------------------------------------- watcher

#[derive(Default)]
struct WatchMaps {
    dir_of: HashMap<i32, u64>,
    /// A directory's watch and the number it was added as (`Watcher::added`): a watch
    /// dropped and added again is another watch, which missed what came between.
    wd_of: HashMap<u64, (i32, u64)>,
    /// Watches on files that hold callbacks, by watch and by node id.
    file_of: HashMap<i32, u64>,
    file_wd: HashMap<u64, i32>,
}

/// At most this many files are watched themselves (each pins a source inode in the
/// kernel); files beyond get no callback, and their opens ask the source.
const MAX_FILE_WATCHES: usize = 65_536;

/// inotify watches on the source's directories, keyed by the directory's node id.
pub struct Watcher {
    fd: OwnedFd,
    /// Read on every lookup, getattr and opendir (is this directory watched?), written
    /// only when a watch is added or dropped.
    maps: RwLock<WatchMaps>,
    /// Watches added so far: each directory watch's number.
    added: AtomicU64,
    /// Bumped when events may have been lost (an overflow): every callback lapses.
    epoch: AtomicU64,
    /// Batches begun and batches handled (`begin_batch`, `batch_handled`): while they
    /// differ, events taken from the queue are not acted on yet.
    begun: AtomicU64,
    handled: AtomicU64,
}

/// What breaks a file's callback when it happens to the file itself, by whatever name:
/// data and attribute changes (link counts included), and its removal.
const FILE_WATCH_MASK: WatchFlags = WatchFlags::MODIFY
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::CLOSE_WRITE)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF);

const WATCH_MASK: WatchFlags = WatchFlags::CREATE
    .union(WatchFlags::DELETE)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::MODIFY)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::CLOSE_WRITE)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF)
    .union(WatchFlags::ONLYDIR)
    .union(WatchFlags::EXCL_UNLINK);

/// How long a batch keeps collecting events once the first arrived: a writer's stream of
/// MODIFY events becomes one revalidation, and the delay stays far below a second.
const BATCH_WINDOW: Duration = Duration::from_millis(30);
const BATCH_MAX_EVENTS: usize = 50_000;

impl Watcher {
    fn new() -> std::io::Result<Watcher> {
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC)?;
        Ok(Watcher {
            fd,
            maps: RwLock::default(),
            added: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            begun: AtomicU64::new(0),
            handled: AtomicU64::new(0),
        })
    }

    pub fn is_watched(&self, dir: u64) -> bool {
        self.maps.read().unwrap().wd_of.contains_key(&dir)
    }

    /// The number directory `dir`'s watch was added as, if it is watched.
    fn watch_of(&self, dir: u64) -> Option<u64> {
        self.maps.read().unwrap().wd_of.get(&dir).map(|w| w.1)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(SeqCst)
    }

    /// Files watched themselves.
    pub fn files(&self) -> usize {
        self.maps.read().unwrap().file_wd.len()
    }

    /// The watcher thread is about to take events from the queue.
    pub fn begin_batch(&self) {
        self.begun.fetch_add(1, SeqCst);
    }

    /// The watcher thread has acted on every event it took.
    pub fn batch_handled(&self) {
        self.handled.store(self.begun.load(SeqCst), SeqCst);
    }

    /// No event waits: none in the queue, none taken and not yet acted on. A change to a
    /// watched file queues its event before the call that made it returns, so when this
    /// holds, every change completed before the call has been acted on.
    pub fn quiet(&self) -> bool {
        let begun = self.begun.load(SeqCst);
        if self.handled.load(SeqCst) != begun {
            return false;
        }
        // Unknown counts as busy.
        let queued = rustix::io::ioctl_fionread(&self.fd).unwrap_or(1);
        queued == 0 && self.begun.load(SeqCst) == begun
    }

    /// The watch on file `id` itself, if it has one.
    fn file_watch(&self, id: u64) -> Option<i32> {
        self.maps.read().unwrap().file_wd.get(&id).copied()
    }

    /// Watches file `id` (open as `fd`) itself: its changes through any name, and changes
    /// of its link count, are then reported (`Batch::files`). The watch, or `None`.
    fn watch_file(&self, id: u64, fd: BorrowedFd<'_>) -> Option<i32> {
        {
            let m = self.maps.read().unwrap();
            if let Some(&wd) = m.file_wd.get(&id) {
                return Some(wd);
            }
            if m.file_wd.len() >= MAX_FILE_WATCHES {
                return None;
            }
        }
        let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
        match inotify::add_watch(&self.fd, link.as_str(), FILE_WATCH_MASK) {
            Ok(wd) => {
                let mut m = self.maps.write().unwrap();
                if let Some(old) = m.file_of.insert(wd, id)
                    && old != id
                {
                    m.file_wd.remove(&old);
                }
                m.file_wd.insert(id, wd);
                Some(wd)
            }
            Err(e) => {
                tracing::debug!("cannot watch file {id}: {e}");
                None
            }
        }
    }

    pub fn len(&self) -> usize {
        self.maps.read().unwrap().wd_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Watches the directory open as `fd` (an `O_PATH` descriptor resolved beneath the
    /// source root): through its `/proc/self/fd` link, so the watch lands on exactly that
    /// directory whatever its path now resolves to.
    fn add(&self, dir: u64, fd: BorrowedFd<'_>) -> bool {
        let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
        match inotify::add_watch(&self.fd, link.as_str(), WATCH_MASK) {
            Ok(wd) => {
                let mut m = self.maps.write().unwrap();
                if let Some(old) = m.dir_of.insert(wd, dir)
                    && old != dir
                {
                    // The same directory under a new node id (the old one was freed).
                    m.wd_of.remove(&old);
                }
                let number = self.added.fetch_add(1, SeqCst) + 1;
                m.wd_of.insert(dir, (wd, number));
                true
            }
            Err(e) => {
                tracing::debug!("cannot watch directory {dir}: {e}");
                false
            }
        }
    }

    /// Stops watching directories and files the inode table no longer has.
    pub fn prune(&self, alive: impl Fn(u64) -> bool) {
        let mut m = self.maps.write().unwrap();
        let dead: Vec<(u64, i32)> = m
            .wd_of
            .iter()
            .filter(|(dir, _)| !alive(**dir))
            .map(|(d, w)| (*d, w.0))
            .collect();
        for (dir, wd) in dead {
            m.wd_of.remove(&dir);
            if m.dir_of.get(&wd) == Some(&dir) {
                m.dir_of.remove(&wd);
                let _ = inotify::remove_watch(&self.fd, wd);
            }
        }
        let dead: Vec<(u64, i32)> = m
            .file_wd
            .iter()
            .filter(|(id, _)| !alive(**id))
            .map(|(id, wd)| (*id, *wd))
            .collect();
        for (id, wd) in dead {
            m.file_wd.remove(&id);
            if m.file_of.get(&wd) == Some(&id) {
                m.file_of.remove(&wd);
                let _ = inotify::remove_watch(&self.fd, wd);
            }
        }
    }

    /// Waits at most `timeout` for events; whether some came.
    pub fn wait_readable(&self, timeout: Duration) -> std::io::Result<bool> {
        let mut pfd = [rustix::event::PollFd::new(
            &self.fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: timeout.subsec_nanos() as i64,
        };
        match rustix::event::poll(&mut pfd, Some(&ts)) {
            Ok(n) => Ok(n > 0),
            Err(rustix::io::Errno::INTR) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Blocks for the next batch of events: the changed names (deduplicated, renames
    /// paired), directories changed themselves, and whether the queue overflowed.
    pub fn next_batch(&self, counters: &Counters) -> std::io::Result<Batch> {
        let mut buf = vec![std::mem::MaybeUninit::<u8>::uninit(); 64 << 10];
        let mut batch = Batch::default();
        let mut index: HashMap<(u64, OsString), usize> = HashMap::new();
        let mut moved_from: HashMap<u32, usize> = HashMap::new();
        let deadline_after_first = |first: Option<Instant>| first.map(|t| t + BATCH_WINDOW);
        let mut first: Option<Instant> = None;
        loop {
            if let Some(deadline) = deadline_after_first(first) {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || batch.names.len() >= BATCH_MAX_EVENTS {
                    return Ok(batch);
                }
                let mut pfd = [rustix::event::PollFd::new(
                    &self.fd,
                    rustix::event::PollFlags::IN,
                )];
                let ts = rustix::event::Timespec {
                    tv_sec: left.as_secs() as i64,
                    tv_nsec: left.subsec_nanos() as i64,
                };
                match rustix::event::poll(&mut pfd, Some(&ts)) {
                    Ok(0) => return Ok(batch),
                    Ok(_) => {}
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            let mut reader = inotify::Reader::new(&self.fd, &mut buf);
            loop {
                let ev = match reader.next() {
                    Ok(ev) => ev,
                    Err(rustix::io::Errno::INTR) => break,
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(e) => return Err(e.into()),
                };
                first.get_or_insert_with(Instant::now);
                counters.watcher_events.fetch_add(1, Relaxed);
                let mask = ev.events();
                if mask.contains(ReadFlags::QUEUE_OVERFLOW) {
                    counters.watcher_overflows.fetch_add(1, Relaxed);
                    self.epoch.fetch_add(1, SeqCst);
                    batch.overflow = true;
                } else {
                    let wd = ev.wd();
                    let (dir, file) = {
                        let mut m = self.maps.write().unwrap();
                        let dir = m.dir_of.get(&wd).copied();
                        let file = m.file_of.get(&wd).copied();
                        if mask.contains(ReadFlags::IGNORED) {
                            if let Some(d) = dir {
                                m.dir_of.remove(&wd);
                                if m.wd_of.get(&d).map(|w| w.0) == Some(wd) {
                                    m.wd_of.remove(&d);
                                }
                            }
                            if let Some(id) = file {
                                m.file_of.remove(&wd);
                                if m.file_wd.get(&id) == Some(&wd) {
                                    m.file_wd.remove(&id);
                                }
                            }
                        }
                        (dir, file)
                    };
                    if let Some(id) = file
                        && !batch.files.contains(&id)
                    {
                        batch.files.push(id);
                    }
                    if let Some(dir) = dir {
                        match ev.file_name() {
                            None => {
                                if !batch.dirs.contains(&dir) {
                                    batch.dirs.push(dir);
                                }
                            }
                            Some(name) => {
                                let name = OsStr::from_bytes(name.to_bytes()).to_owned();
                                let change = Change {
                                    namespace: mask.intersects(
                                        ReadFlags::CREATE
                                            | ReadFlags::DELETE
                                            | ReadFlags::MOVED_FROM
                                            | ReadFlags::MOVED_TO,
                                    ),
                                    data: mask
                                        .intersects(ReadFlags::MODIFY | ReadFlags::CLOSE_WRITE),
                                    attrib: mask.contains(ReadFlags::ATTRIB),
                                };
                                let key = (dir, name.clone());
                                let i = *index.entry(key).or_insert_with(|| {
                                    batch.names.push(NameChange {
                                        dir,
                                        name: name.clone(),
                                        change: Change::default(),
                                        moved_to: None,
                                    });
                                    batch.names.len() - 1
                                });
                                let c = &mut batch.names[i].change;
                                c.namespace |= change.namespace;
                                c.data |= change.data;
                                c.attrib |= change.attrib;
                                if mask.contains(ReadFlags::MOVED_FROM) {
                                    moved_from.insert(ev.cookie(), i);
                                } else if mask.contains(ReadFlags::MOVED_TO)
                                    && let Some(&from) = moved_from.get(&ev.cookie())
                                {
                                    batch.names[from].moved_to = Some((dir, name));
                                }
                            }
                        }
                    }
                }
                if reader.is_buffer_empty() {
                    break;
                }
            }
            if first.is_none() {
                // Interrupted before any event: wait again.
                continue;
            }
        }
    }
}

/// One batch of watcher events.
#[derive(Debug, Default)]
pub struct Batch {
    pub names: Vec<NameChange>,
    /// Directories whose own attributes changed, or that were deleted or moved.
    pub dirs: Vec<u64>,
    /// Files watched themselves (they hold callbacks) that changed, by any name.
    pub files: Vec<u64>,
    pub overflow: bool,
}

// ---------------------------------------------------------------------------- leases

/// Validation leases of open files on sources that raise no events, ordered by expiry.
#[derive(Default)]
pub struct Leases {
    list: Mutex<BTreeSet<(Instant, u64)>>,
    /// Node id → its lease's expiry, so that a file holds one lease however often it is
    /// opened.
    expiry: Mutex<HashMap<u64, Instant>>,
    wake: Condvar,
}

impl Leases {
    /// Grants `id` a lease until `now + ttl` unless it holds one already.
    pub fn grant(&self, id: u64, ttl: Duration, counters: &Counters) {
        let mut expiry = self.expiry.lock().unwrap();
        if expiry.contains_key(&id) {
            return;
        }
        let at = Instant::now() + ttl.max(Duration::from_millis(100));
        expiry.insert(id, at);
        let mut list = self.list.lock().unwrap();
        let earliest = list.first().is_none_or(|(t, _)| at < *t);
        list.insert((at, id));
        counters.leases_granted.fetch_add(1, Relaxed);
        if earliest {
            self.wake.notify_one();
        }
    }

    pub fn len(&self) -> usize {
        self.expiry.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Blocks until at least one lease has expired (or `max_wait` passed) and returns the
    /// expired ones, removed from the list.
    pub fn wait_expired(&self, max_wait: Duration) -> Vec<u64> {
        let mut list = self.list.lock().unwrap();
        let give_up = Instant::now() + max_wait;
        loop {
            let now = Instant::now();
            if list.first().is_some_and(|(t, _)| *t <= now) {
                break;
            }
            if now >= give_up {
                return Vec::new();
            }
            let until = list.first().map_or(give_up, |(t, _)| (*t).min(give_up));
            list = self
                .wake
                .wait_timeout(list, until.saturating_duration_since(now))
                .unwrap()
                .0;
        }
        let now = Instant::now();
        let mut expired = Vec::new();
        while let Some(&(t, id)) = list.first() {
            if t > now {
                break;
            }
            list.pop_first();
            expired.push(id);
        }
        drop(list);
        let mut expiry = self.expiry.lock().unwrap();
        for id in &expired {
            expiry.remove(id);
        }
        expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_expire_in_order_and_once_per_file() {
        let l = Leases::default();
        let c = Counters::default();
        l.grant(2, Duration::from_millis(200), &c);
        l.grant(1, Duration::from_millis(100), &c);
        l.grant(1, Duration::from_millis(100), &c); // already held: no second lease
        assert_eq!(l.len(), 2);
        assert_eq!(c.leases_granted.load(Relaxed), 2);
        let t = Instant::now();
        assert_eq!(l.wait_expired(Duration::from_secs(5)), vec![1]);
        assert!(t.elapsed() >= Duration::from_millis(90));
        assert_eq!(l.wait_expired(Duration::from_secs(5)), vec![2]);
        assert!(l.wait_expired(Duration::from_millis(10)).is_empty());
        assert!(l.is_empty());
    }

    #[test]
    fn ttls_are_long_only_where_watched_unless_set() {
        let t = Tunables {
            entry_ms: AtomicU64::new(AUTO),
            attr_ms: AtomicU64::new(AUTO),
            negative_ms: AtomicU64::new(AUTO),
            stale_check: AtomicBool::new(true),
            watch: AtomicBool::new(true),
            close_to_open: AtomicBool::new(false),
        };
        assert_eq!(t.entry(true), WATCHED_TTL);
        assert_eq!(t.entry(false), UNWATCHED_TTL);
        t.set_attr(Some(Duration::from_millis(2500)));
        assert_eq!(t.attr(true), Duration::from_millis(2500));
        assert_eq!(t.attr(false), Duration::from_millis(2500));
        t.set_attr(None);
        assert_eq!(t.attr(false), UNWATCHED_TTL);
    }

    #[test]
    fn watcher_reports_names_and_pairs_renames() {
        let dir = tempfile::tempdir().unwrap();
        let w = Watcher::new().unwrap();
        let fd = rustix::fs::open(
            dir.path(),
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        assert!(w.add(7, fd.as_fd()));
        assert!(w.is_watched(7));
        std::fs::write(dir.path().join("a"), b"x").unwrap();
        std::fs::rename(dir.path().join("a"), dir.path().join("b")).unwrap();
        let c = Counters::default();
        let b = w.next_batch(&c).unwrap();
        let a = b.names.iter().find(|n| n.name == "a").unwrap();
        assert!(a.change.namespace && a.change.data);
        assert_eq!(a.moved_to, Some((7, OsString::from("b"))));
        assert!(b.names.iter().any(|n| n.name == "b" && n.change.namespace));
        w.prune(|_| false);
        assert!(w.is_empty());
    }
}

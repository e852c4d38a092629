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
//!   the source instead of each call testing it. Opens validate (close-to-open), unless
//!   `--open-lease` is set: then a look at a file stands for that long ([`OpenLease`]).
//! - [`Callback`]: where the watcher covers a file (its directory and the file itself are
//!   watched), a look at the source stands until an event breaks it (the AFS callback):
//!   opens and `getattr`s of the file ask the source nothing while the watcher has no
//!   event unhandled (`Watcher::quiet`), so an open still gets a version that was the
//!   file's at some instant of the open.
//! - [`Tunables`]: TTLs, stale checking and the watcher switch, changeable at run time.

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsString;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::{Config, UNWATCHED_TTL, WATCHED_TTL, WatchMode};
use crate::descriptors::{DescriptorSlot, HeldDescriptors, share_of_limit};
use crate::kernel_notify::AttrDropper;

mod watcher;
pub use watcher::{Batch, Watcher};

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
    /// Opens that made the kernel drop a node's attributes before their reply
    /// (`drop_kernel_attrs`).
    pub attr_drops: AtomicU64,
    /// Listings that made the kernel drop the directory's cached listing before their
    /// last reply (`drop_kernel_listing`).
    pub listing_drops: AtomicU64,
    pub leases_granted: AtomicU64,
    pub leases_expired: AtomicU64,
    pub changes_detected: AtomicU64,
    pub callbacks_granted: AtomicU64,
    pub callbacks_broken: AtomicU64,
    /// Opens, `getattr`s and lookups answered by a callback, without asking the source.
    pub callback_hits: AtomicU64,
    /// Of those, lookups (a name and its attributes).
    pub callback_names: AtomicU64,
    /// Opendirs answered by a directory's listing held under callback (`ListingCallback`).
    pub listing_hits: AtomicU64,
    /// Looks at unwatched files that stand for `--open-lease` (`OpenLease`), and opens
    /// they answered without asking the source.
    pub open_leases_granted: AtomicU64,
    pub open_lease_hits: AtomicU64,
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
    /// Opens served by the daemon that first made the kernel drop a file's attributes: the
    /// size it held was not the size of the version they serve (`kernel_notify::AttrDropper`).
    pub attr_drops: u64,
    /// Listings that ended after their directory changed, so made the kernel drop the
    /// directory's cached listing before their last reply (`drop_kernel_listing`).
    pub listing_drops: u64,
    pub leases_active: u64,
    pub leases_granted: u64,
    pub leases_expired: u64,
    /// Source changes made behind the mount that invalidated something.
    pub changes_detected: u64,
    /// Files the watcher covers (`Callback`s): granted, broken by an event, and opens,
    /// `getattr`s and lookups they answered without asking the source
    /// (`callback_names`: the lookups); files watched themselves.
    pub callbacks_granted: u64,
    pub callbacks_broken: u64,
    pub callback_hits: u64,
    pub callback_names: u64,
    /// Opendirs that read nothing from the source: the directory's listing, taken while
    /// its watch stood, had no event since (`ListingCallback`).
    pub listing_hits: u64,
    /// Looks at files where nothing is watched that stood for `--open-lease`
    /// (`OpenLease`), and opens they answered without asking the source.
    pub open_leases_granted: u64,
    pub open_lease_hits: u64,
    pub watched_files: u64,
    /// Kernel TTLs in ms; `None`: automatic (long where watched, short elsewhere).
    pub entry_ttl_ms: Option<u64>,
    pub attr_ttl_ms: Option<u64>,
    pub negative_ttl_ms: Option<u64>,
    pub stale_check: bool,
    pub close_to_open: bool,
    pub open_lease_ms: u64,
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
    /// How long a look at a file where nothing is watched answers opens (`OpenLease`).
    open_lease_ms: AtomicU64,
}

const AUTO: u64 = u64::MAX;

/// Held listings keep a directory descriptor each, within this share (1/N) of the
/// open-files limit; files' callbacks have a quarter (`watcher::max_file_watches`).
const LISTING_FDS_SHARE: usize = 8;

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
            open_lease_ms: AtomicU64::new(ms(Some(cfg.open_lease))),
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
    pub fn set_open_lease(&self, t: Duration) {
        self.open_lease_ms.store(ms(Some(t)), Relaxed);
    }

    fn fill(&self, s: &mut CoherenceSnapshot) {
        let opt = |v: &AtomicU64| Some(v.load(Relaxed)).filter(|&v| v != AUTO);
        s.entry_ttl_ms = opt(&self.entry_ms);
        s.attr_ttl_ms = opt(&self.attr_ms);
        s.negative_ttl_ms = opt(&self.negative_ms);
        s.stale_check = self.stale_check.load(Relaxed);
        s.close_to_open = self.close_to_open.load(Relaxed);
        s.open_lease_ms = self.open_lease_ms.load(Relaxed);
    }
}

/// Everything coherence-related a mount holds.
pub struct Coherence {
    pub tunables: Tunables,
    pub counters: Counters,
    pub watcher: Option<Watcher>,
    pub leases: Leases,
    notify: Box<dyn Fn(Notice) + Send + Sync>,
    /// Set once the mount exists (`set_attr_dropper`); none in-process.
    attr_dropper: OnceLock<AttrDropper>,
    /// Held listings' directory descriptors: at most an eighth of the open-files limit.
    listing_fds: Arc<HeldDescriptors>,
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
            attr_dropper: OnceLock::new(),
            listing_fds: HeldDescriptors::new(share_of_limit(LISTING_FDS_SHARE)),
        }
    }

    /// The mount's way to drop a node's attributes from a request's own thread.
    pub fn set_attr_dropper(&self, d: AttrDropper) {
        let _ = self.attr_dropper.set(d);
    }

    /// Makes the kernel drop node `id`'s attributes before this thread goes on (a request
    /// may call it before its reply: it waits for no lock, `AttrDropper`). Fails only if
    /// the connection is gone, which the reply will find too.
    pub fn drop_kernel_attrs(&self, id: u64) {
        if let Some(d) = self.attr_dropper.get() {
            self.counters.attr_drops.fetch_add(1, Relaxed);
            if let Err(e) = d.drop_attrs(id) {
                tracing::debug!("dropping the kernel's attributes of {id}: {e}");
            }
        }
    }

    /// Makes the kernel drop directory `id`'s cached listing before this thread goes on
    /// (`AttrDropper::drop_listing`: a request may call it before its reply).
    pub fn drop_kernel_listing(&self, id: u64) {
        if let Some(d) = self.attr_dropper.get() {
            self.counters.listing_drops.fetch_add(1, Relaxed);
            if let Err(e) = d.drop_listing(id) {
                tracing::debug!("dropping the kernel's listing of {id}: {e}");
            }
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
        let holds = w.file_watch(id) == Some(cb.file_wd) && self.look_stands(cb.mark, cb.at, dir);
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
        fd: &Arc<OwnedFd>,
        st: &crate::source::Stat,
    ) -> Option<Callback> {
        let w = self.watcher.as_ref()?;
        if st.nlink != 1 || !st.is_file() || w.epoch() != mark.epoch {
            return None;
        }
        let file_wd = w.watch_file(id, fd.as_fd())?;
        let fd = fd.clone();
        self.counters.callbacks_granted.fetch_add(1, Relaxed);
        Some(Callback {
            stat: *st,
            fd,
            mark,
            file_wd,
            at: Instant::now(),
        })
    }

    /// What every callback needs to stand (a file's, `dir` its directory; a listing's,
    /// `dir` the directory itself): the watches it was granted under (`mark`), an age
    /// under the watched TTL from `at`, and no event the watcher has not handled yet.
    fn look_stands(&self, mark: CallbackMark, at: Instant, dir: u64) -> bool {
        self.watcher.as_ref().is_some_and(|w| {
            self.callback_mark(dir).is_some_and(|m| m == mark)
                && at.elapsed() < self.tunables.attr(true)
                && w.quiet()
        })
    }

    /// A directory's listing `entries`, read after `mark` (`callback_mark` of the
    /// directory itself: its own watch reports the changes of its names); `at`: just
    /// before the read. `None` when its descriptor `fd` would take more than the
    /// listings' share of the open-files limit (`crate::descriptors`): that directory's
    /// next opendir reads the source again.
    pub fn listing_callback(
        &self,
        mark: CallbackMark,
        entries: Arc<[crate::source::DirEntry]>,
        fd: Option<Arc<OwnedFd>>,
        at: Instant,
    ) -> Option<ListingCallback> {
        let slot = match &fd {
            Some(_) => Some(Arc::new(self.listing_fds.take()?)),
            None => None,
        };
        Some(ListingCallback {
            entries,
            fd,
            mark,
            at,
            _slot: slot,
        })
    }

    /// Whether directory `dir`'s held listing `cb` still stands for the source now: its
    /// watch is the one it was read under, no event waits (a change of a name completed
    /// before this call has broken it), and it is younger than the watched TTL. Counted.
    pub fn listing_holds(&self, cb: &ListingCallback, dir: u64) -> bool {
        let holds = self.look_stands(cb.mark, cb.at, dir);
        if holds {
            self.counters.listing_hits.fetch_add(1, Relaxed);
        }
        holds
    }

    /// How long a look at a file in directory `dir` may answer later opens for reading
    /// in place of their own (`OpenLease`): `None` where the watcher's callbacks answer
    /// instead, or where opens must ask the source (no lease set, `close_to_open`, stale
    /// checks off).
    pub fn open_lease_term(&self, dir: u64) -> Option<Duration> {
        let t = &self.tunables;
        let ms = t.open_lease_ms.load(Relaxed);
        (ms > 0
            && !self.watched(dir)
            && !t.close_to_open.load(Relaxed)
            && t.stale_check.load(Relaxed))
        .then(|| Duration::from_millis(ms))
    }

    /// A lease on the look `st`, taken at `at`, of a file in directory `dir`: `None` where
    /// none is given (see `open_lease_term`; and only to a file with one link, so that no
    /// write through another name of it can go unseen by its node).
    pub fn open_lease(&self, dir: u64, st: &crate::source::Stat, at: Instant) -> Option<OpenLease> {
        self.open_lease_term(dir)?;
        if st.nlink != 1 || !st.is_file() {
            return None;
        }
        self.counters.open_leases_granted.fetch_add(1, Relaxed);
        Some(OpenLease { stat: *st, at })
    }

    /// Whether `lease`, of a file in directory `dir`, still answers an open: younger than
    /// `--open-lease` (as set now), with leases still given there. Counted as a hit.
    pub fn open_lease_holds(&self, lease: &OpenLease, dir: u64) -> bool {
        let holds = self
            .open_lease_term(dir)
            .is_some_and(|term| lease.at.elapsed() < term);
        if holds {
            self.counters.open_lease_hits.fetch_add(1, Relaxed);
        }
        holds
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
            attr_drops: c.attr_drops.load(Relaxed),
            listing_drops: c.listing_drops.load(Relaxed),
            leases_active: self.leases.len() as u64,
            leases_granted: c.leases_granted.load(Relaxed),
            leases_expired: c.leases_expired.load(Relaxed),
            changes_detected: c.changes_detected.load(Relaxed),
            callbacks_granted: c.callbacks_granted.load(Relaxed),
            callbacks_broken: c.callbacks_broken.load(Relaxed),
            callback_hits: c.callback_hits.load(Relaxed),
            callback_names: c.callback_names.load(Relaxed),
            listing_hits: c.listing_hits.load(Relaxed),
            open_leases_granted: c.open_leases_granted.load(Relaxed),
            open_lease_hits: c.open_lease_hits.load(Relaxed),
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

/// A directory's listing that stands until the watcher breaks it (a name in it created,
/// removed or renamed, or a change of the directory itself: `fs/changes.rs`), a watch it
/// relies on goes, or the watched TTL passes, like a file's `Callback`. While it stands an
/// opendir reads nothing from the source: hot walks and `git status` open every directory,
/// and the kernel mostly answers their reads from its own cache of the listing. Held by
/// the directory's entry in the inode table. The mount's own changes of names end it too
/// (`fs/offline.rs`, `listing_changed`).
#[derive(Clone, Debug)]
pub struct ListingCallback {
    /// The names in the directory, as `read_dir` gave them.
    pub entries: Arc<[crate::source::DirEntry]>,
    /// The directory open `O_PATH` when it was read (what an open directory handle keeps).
    pub fd: Option<Arc<OwnedFd>>,
    mark: CallbackMark,
    at: Instant,
    /// `fd`'s place in the listings' descriptor budget, shared by the clones.
    _slot: Option<Arc<DescriptorSlot>>,
}

/// A look at a file where nothing reports changes (a network, FUSE or object-store
/// source), which answers opens for reading for `--open-lease` from when it was taken:
/// the AFS callback with a time bound in place of the server's promise, as NFS's
/// attribute cache is. Granted only to a file whose cached copy was whole and of the
/// version looked at. An own change of the file does not end it: an open answered by a
/// lease whose look disagrees with the cache's record looks at the source again, as for
/// a stat that raced a write (`fs/open.rs`), and drops the lease. Held by the file's
/// entry in the inode table; keeps no descriptor (a lease per file of a large tree).
#[derive(Clone, Debug)]
pub struct OpenLease {
    /// The file's attributes at the look.
    pub stat: crate::source::Stat,
    /// Just before the look: the version it shows was the file's then.
    pub at: Instant,
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
            open_lease_ms: AtomicU64::new(0),
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

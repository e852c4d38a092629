//! The daemon's inode table: kernel node ids to source objects, sized by demand.
//!
//! Node ids are our own monotonic counter, never the source's inode number (an inode number
//! reused by the source must never reach the kernel as a node it already knows, see go-fuse
//! #372), and never reused: a freed id is gone for good, so a stale id can only miss
//! (`ESTALE`), never reach another file. Generations therefore stay 0.
//!
//! Entries follow the kernel's lookup counts exactly: `lookup`, `create`, `mkdir`, `mknod`,
//! `symlink` and `link` add one, `forget` subtracts. An entry the kernel references (count
//! above zero) is never freed. Hard links share one entry through the `(dev, ino)` index.
//! Each entry keeps the paths of the names it is known by (the last used first) and the node
//! id of the directory its first name was reached through; renames through the mount
//! rewrite the paths of the renamed subtree, unlinks drop a name.
//!
//! The table grows and shrinks like the dynamic vnodes of DEC OSF/1 (John, 1995):
//! - An entry whose count reaches zero goes to the tail of an LRU free list, keeping its
//!   id, key and names. A lookup of the same `(dev, ino)` revives it with the same node id
//!   (a reuse). It stays at least `min_age` (the paper's vnode-age) unless the table is over
//!   its soft maximum, and the newest `free_min` entries (minimum-free-vnodes) stay until
//!   `max_age`.
//! - Excess free entries are freed from the head in batches, under one lock: on `forget` once
//!   the excess reaches [`BATCH`], and on the periodic [`InodeTable::maintain`] (for age).
//!   The paper's marker measured how fast the free list cycles; here each entry carries the
//!   time it was freed, so the head's age is that measure, read in O(1): a young head means
//!   demand is high and nothing is freed.
//! - When the kernel references more entries than `max_inodes`, [`InodeTable::maintain`]
//!   names the least recently looked-up ones so that the caller can ask the kernel to drop
//!   their dentries (FUSE `notify_inval_entry`); their `forget`s then shrink the table.
//! - Nothing outside the table holds a node id it could dereference after a free: handles
//!   own an `Arc<Inode<F>>` (and the kernel holds a count for every open file), and everything
//!   else goes through [`InodeTable::get`], which answers `None` for a freed id.
//!
//! The free list and the recency list are queues with lazy deletion: each entry carries a
//! stamp, a queue item whose stamp no longer matches is skipped, and a queue is compacted
//! when more than half of it is stale, so every operation is O(1) amortised.
//!
//! `F` is what the file system keeps per open regular file (`fs::FileState`, the cache
//! entry); the table only holds it, under each node's mutex, and never looks inside.
//!
//! Lock order: the module header of `fs.rs` (the table before the name index before
//! `Inode::names` before `Inode::former`; `Inode::file` comes before the table, which only
//! ever `try_lock`s it).

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::coherence::{Callback, ListingCallback, OpenLease};
use crate::source::Stat;
use crate::stats::InodeSnapshot;
use crate::sync::{Mutex, MutexGuard};

mod free;
#[cfg(test)]
mod model_check;

pub const ROOT_ID: u64 = 1;

/// Free entries beyond the limits are freed once this many have accumulated, so that the
/// lock is taken for a batch rather than for every forget.
pub const BATCH: usize = 128;
/// At most this many entries are freed, or named for invalidation, per call, to bound how
/// long the table lock is held.
const MAX_PER_CALL: usize = 16 * 1024;

/// The table's tunables; all can be changed on a live mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InodeLimits {
    /// Soft maximum of entries: above it free entries are freed regardless of age, and
    /// cold referenced entries are handed to the kernel for invalidation.
    pub max_inodes: usize,
    /// Free entries kept for reuse regardless of `min_age` (up to `max_age`).
    pub free_min: usize,
    /// A free entry younger than this is not freed while the table is under its maximum.
    pub min_age: Duration,
    /// A free entry older than this is freed even if fewer than `free_min` are free.
    pub max_age: Duration,
    /// Off: entries are never freed and the kernel is never asked to drop entries (the
    /// allocate-only table, for comparison).
    pub freeing: bool,
}

impl InodeLimits {
    pub fn new(max_inodes: usize) -> InodeLimits {
        let max_inodes = max_inodes.max(1);
        InodeLimits {
            max_inodes,
            // A sixteenth of the maximum: enough to keep a working set across a burst of
            // forgets (the kernel forgets in LRU batches), small beside the maximum.
            free_min: (max_inodes / 16).clamp(1, 64 * 1024),
            // A re-lookup after a forget usually follows within seconds (the kernel evicts
            // under memory pressure, then a program stats the file again).
            min_age: Duration::from_secs(10),
            // So that the table shrinks back within a minute of the kernel dropping its
            // caches.
            max_age: Duration::from_secs(30),
            freeing: true,
        }
    }
}

/// How long a page-cache writer's open waits for a page invalidation under way (it waits
/// for reads in flight, which other request threads answer).
const PAGE_INVALIDATION_WAIT: Duration = Duration::from_millis(100);

#[derive(Debug)]
pub struct Inode<F> {
    /// Immutable identity.
    pub id: u64,
    /// `S_IF*` type bits; a name whose type changes gets a new inode.
    pub file_type: u32,
    pub key: (u64, u64),
    /// Node id of the directory the first of `names` was last reached through (for
    /// `notify_inval_entry`; best effort after `link` and after unlinks of other links).
    parent: AtomicU64,
    /// Paths (relative to the source root) of the names this inode is known by, the one
    /// last used first. More than one only for hard links.
    pub names: Mutex<Vec<PathBuf>>,
    /// Cache state of a regular file while it is open through the mount.
    pub file: Mutex<Option<F>>,
    /// Names taken from this inode while its cache state may be loaded (cleared when it
    /// unloads): its data file may still be the cache entry of such a name, so the
    /// cleaner keeps away from it (a file replaced behind the mount while open).
    pub former: Mutex<Vec<PathBuf>>,
    /// The source changed behind the mount while this file was open: its open handles keep
    /// the version they opened, and the file's names lead to a new entry (a new kernel
    /// node) for everything else. Lookups never return a retired entry, and opens of it
    /// answer `ESTALE`, so that the kernel looks the name up again.
    retired: AtomicBool,
    /// The birth time of the file this entry stands for, `(0, 0)` until known: tells it
    /// from a later file given the same inode number (`reused_by`).
    btime: Mutex<(i64, u32)>,
    /// Changes through the mount under way that move the file's ctime but not its data
    /// (rename, link, chmod, utimens): until each records the new identity, an open or a
    /// watcher event that sees it must not take it for a change behind the mount.
    changing: AtomicU32,
    /// The table's index of names (`NameIndex`).
    index: Arc<NameIndex>,
    /// Bumped whenever the daemon moves the file's cached content to a new version
    /// (`content_changed`); `pages_dropped`: the highest such count the kernel is known
    /// to have dropped its page cache for (a `notify_inval_inode` sent after it returned).
    /// While they differ, no open lets the kernel keep its pages: a notice on its way
    /// must not leave a window in which an open keeps pages of the old version.
    content: AtomicU64,
    pages_dropped: AtomicU64,
    /// The size the last reply with this node's attributes gave the kernel
    /// (`told_kernel_size`), with `TOLD_CHANGED` set unless the reply before it gave the
    /// same: the kernel cuts cached reads at the size it holds, which is one of these.
    told_size: AtomicU64,
    /// A hash of the size and times the last reply with this node's attributes gave the
    /// kernel (`told_kernel_version`; 0: none yet). Kernel opens (`fs/kernel_opens.rs`)
    /// drop the kernel's pages of a file whose version moved otherwise than by the mount's
    /// own writes.
    told_version: AtomicU64,
    /// A request through a kernel open (`fs/kernel_opens.rs`) was served: the kernel may
    /// hold pages of the file that no open of ours decided on.
    served_kernel_open: AtomicBool,
    /// A handle of the node was given to the kernel (or a request through a kernel open
    /// served): until then it holds no pages of the file, of any version.
    handed_out: AtomicBool,
    /// A handle that reads through the kernel's page cache was given to the kernel: pages
    /// of the file, and mappings of them that outlive the handle, may live on, and a write
    /// that bypassed them could leave some old (`fs/open.rs`, `opens_direct`).
    page_cache_readers: AtomicBool,
    /// Handles open for writing through the kernel's page cache: the kernel copies each
    /// write into its pages, then sends it, and pages dropped in between (a notice's
    /// invalidation, or an open without `FOPEN_KEEP_CACHE`) would be read back old from
    /// the cache before the write arrives here. While any is open, page invalidations
    /// are held back until the last closes (`begin_page_invalidation`).
    page_cache_writers: AtomicU32,
    /// A page invalidation was held back for the page-cache writers.
    pages_held_back: AtomicBool,
    /// The invalidation thread is deciding on or sending a page invalidation.
    invalidating_pages: AtomicBool,
    /// A look at the source that stands until the watcher breaks it (a file's
    /// `coherence::Callback`, a directory's `ListingCallback`) or for a time (a file's
    /// `OpenLease`, where nothing is watched), and the breaks so far: a
    /// look taken before a break is never installed after it (`grant_callback`).
    /// Boxed, as most entries never hold one (an entry's size is the table's memory).
    callback: Mutex<Option<Box<Held>>>,
    breaks: AtomicU64,
}

/// In `Inode::told_size`: the last reply told another size than the one before it.
const TOLD_CHANGED: u64 = 1 << 63;

/// What an entry's callback slot holds: a file's look at the source (under callback or
/// lease), or a directory's listing.
#[derive(Clone, Debug)]
enum Held {
    File(Callback),
    Listing(ListingCallback),
    Lease(OpenLease),
}

/// Node ids by name, so that a batch of watcher events finds the entries known by its
/// names without a pass over the whole table (`InodeTable::holders_of`). A superset:
/// every name an entry takes is added, and a reader checks each id against the entry's
/// names then; ids of freed entries are dropped when read, and the index is rebuilt
/// when stale ids outnumber the live ones (`InodeTable::maintain`).
type NameIndex = Mutex<HashMap<PathBuf, Vec<u64>>>;

fn index_name(index: &NameIndex, path: &Path, id: u64) {
    let mut index = index.lock().unwrap();
    match index.get_mut(path) {
        Some(ids) if ids.contains(&id) => {}
        Some(ids) => ids.push(id),
        None => {
            index.insert(path.to_path_buf(), vec![id]);
        }
    }
}

/// An own change of an inode under way (`Inode::changing`), ended on drop.
pub struct OwnChange<F>(Arc<Inode<F>>);

impl<F> Drop for OwnChange<F> {
    fn drop(&mut self) {
        self.0.changing.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<F> Inode<F> {
    fn new(
        id: u64,
        file_type: u32,
        key: (u64, u64),
        parent: u64,
        path: &Path,
        index: &Arc<NameIndex>,
    ) -> Inode<F> {
        index_name(index, path, id);
        Inode {
            id,
            file_type,
            key,
            parent: AtomicU64::new(parent),
            names: Mutex::new(vec![path.to_path_buf()]),
            file: Mutex::new(None),
            former: Mutex::new(Vec::new()),
            retired: AtomicBool::new(false),
            btime: Mutex::new((0, 0)),
            changing: AtomicU32::new(0),
            index: index.clone(),
            content: AtomicU64::new(0),
            pages_dropped: AtomicU64::new(0),
            told_size: AtomicU64::new(u64::MAX),
            told_version: AtomicU64::new(0),
            served_kernel_open: AtomicBool::new(false),
            handed_out: AtomicBool::new(false),
            page_cache_readers: AtomicBool::new(false),
            page_cache_writers: AtomicU32::new(0),
            pages_held_back: AtomicBool::new(false),
            invalidating_pages: AtomicBool::new(false),
            callback: Mutex::new(None),
            breaks: AtomicU64::new(0),
        }
    }

    /// The callback the file holds, if any (whether it still stands is the watcher's to
    /// say: `Coherence::callback_holds`).
    pub fn callback(&self) -> Option<Callback> {
        match self.callback.lock().unwrap().as_deref() {
            Some(Held::File(cb)) => Some(cb.clone()),
            _ => None,
        }
    }

    /// The listing the directory holds, if any (`Coherence::listing_holds` says whether
    /// it still stands).
    pub fn listing(&self) -> Option<ListingCallback> {
        match self.callback.lock().unwrap().as_deref() {
            Some(Held::Listing(cb)) => Some(cb.clone()),
            _ => None,
        }
    }

    /// The open lease the file holds, if any (`Coherence::open_lease_holds` says whether
    /// it still stands).
    pub fn open_lease(&self) -> Option<OpenLease> {
        match self.callback.lock().unwrap().as_deref() {
            Some(Held::Lease(l)) => Some(l.clone()),
            _ => None,
        }
    }

    /// The breaks so far: taken before a look at the source that may become a callback.
    pub fn callback_breaks(&self) -> u64 {
        self.breaks.load(Ordering::SeqCst)
    }

    /// Installs `cb`, made from a look at the source taken when the breaks were `breaks`;
    /// refused (false) if one came since: the look may predate the change that broke it.
    pub fn grant_callback(&self, cb: Callback, breaks: u64) -> bool {
        self.hold(Held::File(cb), breaks)
    }

    /// Installs directory listing `cb`, read when the breaks were `breaks`; refused
    /// (false) if one came since.
    pub fn grant_listing(&self, cb: ListingCallback, breaks: u64) -> bool {
        self.hold(Held::Listing(cb), breaks)
    }

    /// Installs open lease `lease`, on a look taken when the breaks were `breaks`; refused
    /// (false) if one came since.
    pub fn grant_open_lease(&self, lease: OpenLease, breaks: u64) -> bool {
        self.hold(Held::Lease(lease), breaks)
    }

    fn hold(&self, held: Held, breaks: u64) -> bool {
        let mut slot = self.callback.lock().unwrap();
        if self.breaks.load(Ordering::SeqCst) != breaks {
            return false;
        }
        *slot = Some(Box::new(held));
        true
    }

    /// The watcher saw the file or its name change (a directory: one of its names): the
    /// callback or listing (if any) is gone, and no look taken before now becomes one.
    /// Whether a file's callback was.
    pub fn break_callback(&self) -> bool {
        let mut slot = self.callback.lock().unwrap();
        self.breaks.fetch_add(1, Ordering::SeqCst);
        matches!(slot.take().as_deref(), Some(Held::File(_)))
    }

    /// The file's cached content moved to a new version: the kernel's pages of it are
    /// old until a `notify_inval_inode` sent from now on has returned.
    pub fn content_changed(&self) {
        self.content.fetch_add(1, Ordering::AcqRel);
    }

    /// The count to pass to `pages_dropped` once an invalidation begun now returns.
    pub fn content_version(&self) -> u64 {
        self.content.load(Ordering::Acquire)
    }

    /// The kernel dropped its pages of every version up to `version`.
    pub fn pages_dropped(&self, version: u64) {
        self.pages_dropped.fetch_max(version, Ordering::AcqRel);
    }

    /// A request through a kernel open was served.
    pub fn served_kernel_open(&self) {
        self.handed_out.store(true, Ordering::SeqCst);
        self.served_kernel_open.store(true, Ordering::Release);
    }

    /// A handle of the node is about to be given to the kernel.
    pub fn hand_out(&self) {
        self.handed_out.store(true, Ordering::SeqCst);
    }

    /// A reply is about to give the kernel attributes of this node with size `size`.
    pub fn told_kernel_size(&self, size: u64) {
        let _ = (self.told_size).fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
            // (The first: the kernel held none before it.)
            Some(if old & !TOLD_CHANGED == size || old == u64::MAX {
                size
            } else {
                size | TOLD_CHANGED
            })
        });
    }

    /// A reply is about to give the kernel attributes of this node whose size and times
    /// hash to `version` (never 0). `true`: an earlier reply gave another.
    pub fn told_kernel_version(&self, version: u64) -> bool {
        let old = self.told_version.swap(version, Ordering::AcqRel);
        old != 0 && old != version
    }

    /// A write through the mount ended at `end`: the kernel extends the size it holds to
    /// there itself when the write returns (`fuse_write_update_attr`), so a size it surely
    /// held becomes `end` (one it may not hold stays uncertain).
    pub fn kernel_wrote_to(&self, end: u64) {
        let _ = (self.told_size).fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
            (old & TOLD_CHANGED == 0 && old < end).then_some(end)
        });
    }

    /// Whether the kernel holds `size` as the node's size: the last two replies that gave
    /// it attributes gave that size. Replies are applied by the requesting thread after
    /// they are written, in any order (and one sent before another was applied is
    /// dropped), so the kernel may hold the one before the last for a while; older ones
    /// only if two of their replies were still in flight. `false` until a reply told any.
    pub fn kernel_holds_size(&self, size: u64) -> bool {
        self.told_size.load(Ordering::Acquire) == size
    }

    /// Whether a handle of the node was ever given to the kernel (`hand_out`): if not, the
    /// kernel holds no pages of the file to drop.
    pub fn handed_out(&self) -> bool {
        self.handed_out.load(Ordering::SeqCst)
    }

    /// A handle that reads through the kernel's page cache is about to be handed out.
    pub fn hand_out_page_cache_reader(&self) {
        self.page_cache_readers.store(true, Ordering::SeqCst);
    }

    /// Whether a handle reading through the kernel's page cache was ever handed out.
    pub fn had_page_cache_readers(&self) -> bool {
        self.page_cache_readers.load(Ordering::SeqCst)
    }

    /// A handle that writes through the kernel's page cache is about to be handed out
    /// (counted under the file's lock, so that an open deciding after it knows of it);
    /// then `wait_for_page_invalidation`, without that lock.
    pub fn page_cache_writer_opened(&self) {
        self.page_cache_writers.fetch_add(1, Ordering::SeqCst);
    }

    /// Waits (briefly, bounded) for a page invalidation under way, which began before it
    /// could see a writer just counted: the writer's copies then come after it.
    pub fn wait_for_page_invalidation(&self) {
        let until = Instant::now() + PAGE_INVALIDATION_WAIT;
        while self.invalidating_pages.load(Ordering::SeqCst) && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// A handle that wrote through the kernel's page cache was released. `true`: it was
    /// the last, and a page invalidation was held back meanwhile (send it now).
    pub fn page_cache_writer_closed(&self) -> bool {
        self.page_cache_writers.fetch_sub(1, Ordering::SeqCst) == 1
            && self.pages_held_back.swap(false, Ordering::SeqCst)
    }

    /// Whether page-cache writers are open: pages must not be dropped now, so an open
    /// keeps them (its notice, if any, is held back by the invalidation thread).
    pub fn has_page_cache_writers(&self) -> bool {
        self.page_cache_writers.load(Ordering::SeqCst) > 0
    }

    /// For the invalidation thread, before it drops the node's pages: `false` if it must
    /// not now (page-cache writers are open; the last to close sends it again), and drop
    /// the attributes only. After `true`, call `end_page_invalidation` once sent.
    pub fn begin_page_invalidation(&self) -> bool {
        self.invalidating_pages.store(true, Ordering::SeqCst);
        if self.page_cache_writers.load(Ordering::SeqCst) == 0 {
            return true;
        }
        self.pages_held_back.store(true, Ordering::SeqCst);
        // The last writer may have closed (and found nothing held back) in between.
        if self.page_cache_writers.load(Ordering::SeqCst) == 0 {
            self.pages_held_back.store(false, Ordering::SeqCst);
            return true;
        }
        self.invalidating_pages.store(false, Ordering::SeqCst);
        false
    }

    /// The page invalidation begun by `begin_page_invalidation` was sent.
    pub fn end_page_invalidation(&self) {
        self.invalidating_pages.store(false, Ordering::SeqCst);
    }

    /// Whether the kernel may hold pages of this file that no open of ours gave it leave
    /// to keep: with kernel opens, only those a served request gave it.
    pub fn kernel_open_pages(&self) -> bool {
        self.served_kernel_open.load(Ordering::Acquire)
    }

    /// Whether the kernel's pages, if any, are of the current version.
    pub fn kernel_pages_current(&self) -> bool {
        self.pages_dropped.load(Ordering::Acquire) >= self.content.load(Ordering::Acquire)
    }

    /// Marks an own change of this file under way until the result is dropped.
    pub fn own_change(self: &Arc<Self>) -> OwnChange<F> {
        self.changing.fetch_add(1, Ordering::AcqRel);
        OwnChange(self.clone())
    }

    /// Whether an own change is under way (`changing`).
    pub fn is_changing(&self) -> bool {
        self.changing.load(Ordering::Acquire) > 0
    }

    /// See `retired`: from now on this entry serves only the handles already open.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Whether `st` is this entry's file: its `(dev, ino)`, and not a later file given the
    /// same number (sources reuse freed numbers at once; ext4 gives a file replaced by
    /// rename its number back for the next version): where both birth times are known,
    /// they differ for such a file.
    pub fn is_same_file(&self, st: &Stat) -> bool {
        if (st.dev, st.ino) != self.key {
            return false;
        }
        let known = *self.btime.lock().unwrap();
        known == (0, 0) || st.btime == (0, 0) || known == st.btime
    }

    /// Whether `st`, found at `path` with this entry's `(dev, ino)`, is another file that
    /// was given the same inode number after this one's was freed (sources reuse freed
    /// numbers at once): a file with one link, which this entry knows by other names only,
    /// and whose cache state is not loaded (a loaded state holds its file open, so that
    /// number cannot have been freed: that would be a rename). Taking such an entry for
    /// the new file would leave its old names leading to the new file's node, so that an
    /// open through an old name served another file's bytes.
    fn reused_by(&self, path: &Path, st: &Stat) -> bool {
        {
            // Where both birth times are known they settle it, whatever the names.
            let mut known = self.btime.lock().unwrap();
            if st.btime != (0, 0) {
                if *known != (0, 0) {
                    return *known != st.btime;
                }
                *known = st.btime;
            }
        }
        if st.nlink != 1 || st.is_dir() {
            return false;
        }
        {
            let names = self.names.lock().unwrap();
            if names.is_empty() || names.iter().any(|n| n == path) {
                return false;
            }
        }
        matches!(self.file.try_lock(), Ok(g) if g.is_none())
    }

    /// The path of the name last used to reach this inode; `None` once every name it was
    /// known by is gone (an open file that was unlinked or renamed over): such an inode is
    /// reached only through its open descriptors, never through a path that now names
    /// something else.
    pub fn path(&self) -> Option<PathBuf> {
        self.names.lock().unwrap().first().cloned()
    }

    /// Makes `path` the name used from now on.
    pub fn set_path(&self, path: &Path) {
        let known = {
            let mut names = self.names.lock().unwrap();
            if names.first().is_some_and(|n| n == path) {
                return;
            }
            let known = names.iter().any(|n| n == path);
            names.retain(|n| n != path);
            names.insert(0, path.to_path_buf());
            known
        };
        // Not under `names`: the index's lock comes before any entry's names.
        if !known {
            index_name(&self.index, path, self.id);
        }
    }

    /// `path` no longer names this inode; another known name (a hard link) takes over.
    /// The name is remembered in `former` until the cache state unloads.
    pub fn remove_name(&self, path: &Path) {
        let mut names = self.names.lock().unwrap();
        if names.iter().any(|n| n == path) {
            names.retain(|n| n != path);
            self.former.lock().unwrap().push(path.to_path_buf());
        }
    }

    pub fn parent(&self) -> u64 {
        self.parent.load(Ordering::Relaxed)
    }

    pub fn file(&self) -> MutexGuard<'_, Option<F>> {
        self.file.lock().unwrap()
    }
}

#[derive(Debug)]
struct Entry<F> {
    inode: Arc<Inode<F>>,
    /// The kernel's lookup count; zero means the entry is on the free list.
    count: u64,
    /// Matches the entry's one valid item in `free_q` (count zero) or `recent` (count above
    /// zero); other items for this id are stale.
    stamp: u64,
    /// When the count reached zero, in ms since the table was made.
    freed_at: u64,
}

#[derive(Debug, Default)]
struct Counters {
    allocations: u64,
    frees: u64,
    reuses: u64,
    lookups: u64,
    misses_after_free: u64,
    invalidations: u64,
    peak: u64,
    /// `frees` when memory was last handed back to the system.
    frees_at_trim: u64,
    /// `frees` at the previous `maintain`.
    frees_at_maintain: u64,
}

#[derive(Debug)]
struct Inner<F> {
    by_id: HashMap<u64, Entry<F>>,
    by_key: HashMap<(u64, u64), u64>,
    next_id: u64,
    next_stamp: u64,
    /// Entries with a count of zero, oldest first.
    free_q: VecDeque<(u64, u64)>,
    free_len: usize,
    /// Entries with a count above zero, least recently looked up first.
    recent: VecDeque<(u64, u64)>,
    /// Keys of recently freed entries, oldest first, and the stamp of their last free.
    ghost_q: VecDeque<((u64, u64), u64)>,
    ghosts: HashMap<(u64, u64), u64>,
    limits: InodeLimits,
    n: Counters,
    index: Arc<NameIndex>,
}

#[derive(Debug)]
pub struct InodeTable<F> {
    inner: Mutex<Inner<F>>,
    epoch: Instant,
    /// Added to the clock; only tests move it.
    skew_ms: AtomicU64,
}

impl<F> Inner<F> {
    /// The entries known by `path` now (the name index lists every entry that had it;
    /// their own names say which still have it).
    fn holders(&self, path: &Path) -> Vec<Arc<Inode<F>>> {
        let Some(ids) = self.index.lock().unwrap().get(path).cloned() else {
            return Vec::new();
        };
        ids.iter()
            .filter_map(|id| self.by_id.get(id))
            .filter(|e| e.inode.names.lock().unwrap().iter().any(|p| p == path))
            .map(|e| e.inode.clone())
            .collect()
    }

    /// A new entry for the object `st` at `path` in `parent`, with the next node id (not
    /// yet in the table).
    fn new_inode(&mut self, parent: u64, path: &Path, st: &Stat) -> Arc<Inode<F>> {
        let id = self.next_id;
        self.next_id += 1;
        let key = (st.dev, st.ino);
        let inode = Arc::new(Inode::new(
            id,
            st.file_type(),
            key,
            parent,
            path,
            &self.index,
        ));
        *inode.btime.lock().unwrap() = st.btime;
        inode
    }
}

impl<F> InodeTable<F> {
    pub fn new(root: &Stat, limits: InodeLimits) -> InodeTable<F> {
        let mut inner = Inner {
            by_id: HashMap::new(),
            by_key: HashMap::new(),
            next_id: ROOT_ID + 1,
            next_stamp: 0,
            free_q: VecDeque::new(),
            free_len: 0,
            recent: VecDeque::new(),
            ghost_q: VecDeque::new(),
            ghosts: HashMap::new(),
            limits,
            n: Counters::default(),
            index: Arc::default(),
        };
        let key = (root.dev, root.ino);
        let inode = Arc::new(Inode::new(
            ROOT_ID,
            libc::S_IFDIR,
            key,
            ROOT_ID,
            Path::new(""),
            &inner.index,
        ));
        // The root is never forgotten: its count starts at one and is never released. It
        // is kept out of the recency queue, so it is never offered for invalidation.
        inner.by_id.insert(
            ROOT_ID,
            Entry {
                inode,
                count: 1,
                stamp: 0,
                freed_at: 0,
            },
        );
        inner.by_key.insert(key, ROOT_ID);
        inner.n.allocations = 1;
        inner.n.peak = 1;
        InodeTable {
            inner: Mutex::new(inner),
            epoch: Instant::now(),
            skew_ms: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + self.skew_ms.load(Ordering::Relaxed)
    }

    /// Moves the table's clock forward (tests).
    pub fn advance(&self, by: Duration) {
        self.skew_ms
            .fetch_add(by.as_millis() as u64, Ordering::Relaxed);
    }

    /// The entry of node id `id`, if the table still has it (referenced or on the free list).
    pub fn get(&self, id: u64) -> Option<Arc<Inode<F>>> {
        self.inner
            .lock()
            .unwrap()
            .by_id
            .get(&id)
            .map(|e| e.inode.clone())
    }

    /// Whether the table still holds `inode`. An entry returned unreferenced
    /// (`entry_unreferenced`) may be freed before its caller locks its `file`; once the
    /// caller holds that lock and this answers true, the entry stays while a state is
    /// loaded (the table frees no entry whose `file` is locked or loaded).
    pub fn holds(&self, inode: &Arc<Inode<F>>) -> bool {
        let inner = self.inner.lock().unwrap();
        (inner.by_id.get(&inode.id)).is_some_and(|e| Arc::ptr_eq(&e.inode, inode))
    }

    /// Entries in the table, referenced and free.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn limits(&self) -> InodeLimits {
        self.inner.lock().unwrap().limits.clone()
    }

    pub fn set_limits(&self, limits: InodeLimits) {
        self.inner.lock().unwrap().limits = limits;
    }

    /// Records one kernel reference to the object `st` reached at `path` in directory
    /// `parent`, returning its entry: the existing one for a known `(dev, ino)` of the same
    /// type (revived from the free list if the kernel had forgotten it), else a new one.
    pub fn lookup(&self, parent: u64, path: &Path, st: &Stat) -> Arc<Inode<F>> {
        let now = self.now();
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        inner.n.lookups += 1;
        let key = (st.dev, st.ino);
        if let Some(&id) = inner.by_key.get(&key)
            && let Some(e) = inner.by_id.get_mut(&id)
            && e.inode.file_type == st.file_type()
            && !e.inode.is_retired()
            && !e.inode.reused_by(path, st)
        {
            let inode = e.inode.clone();
            e.count += 1;
            if e.count == 1 {
                inner.free_len -= 1;
                inner.n.reuses += 1;
            }
            if id != ROOT_ID {
                inner.touch(id);
            }
            inode.set_path(path);
            inode.parent.store(parent, Ordering::Relaxed);
            return inode;
        }
        if inner.trim_due() {
            inner.trim(now, BATCH);
        }
        if inner.ghosts.remove(&key).is_some() {
            inner.n.misses_after_free += 1;
        }
        let inode = inner.new_inode(parent, path, st);
        let id = inode.id;
        inner.by_id.insert(
            id,
            Entry {
                inode: inode.clone(),
                count: 1,
                stamp: 0,
                freed_at: 0,
            },
        );
        inner.by_key.insert(key, id);
        inner.touch(id);
        inner.n.allocations += 1;
        inner.n.peak = inner.n.peak.max(inner.by_id.len() as u64);
        inode
    }

    /// The entry for the object `st` at `path` in `parent` without taking a kernel
    /// reference: the existing one (as `find`), or a new one put straight on the free list,
    /// freed like a forgotten entry unless the kernel looks it up. For the directory
    /// prefetch, which fetches files the kernel has not looked up yet.
    pub fn entry_unreferenced(&self, parent: u64, path: &Path, st: &Stat) -> Arc<Inode<F>> {
        let now = self.now();
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        let key = (st.dev, st.ino);
        if let Some(&id) = inner.by_key.get(&key)
            && let Some(e) = inner.by_id.get(&id)
            && e.inode.file_type == st.file_type()
            && !e.inode.is_retired()
            && !e.inode.reused_by(path, st)
        {
            e.inode.set_path(path);
            return e.inode.clone();
        }
        let inode = inner.new_inode(parent, path, st);
        let id = inode.id;
        inner.by_id.insert(
            id,
            Entry {
                inode: inode.clone(),
                count: 0,
                stamp: 0,
                freed_at: 0,
            },
        );
        inner.by_key.insert(key, id);
        inner.release(id, now);
        inner.n.allocations += 1;
        inner.n.peak = inner.n.peak.max(inner.by_id.len() as u64);
        inode
    }

    /// The entry for the object `st` (at `path`, which becomes its first name), without
    /// taking a reference; `None` if the table has none.
    pub fn find(&self, path: &Path, st: &Stat) -> Option<Arc<Inode<F>>> {
        let inner = self.inner.lock().unwrap();
        let id = inner.by_key.get(&(st.dev, st.ino))?;
        let inode = &inner.by_id.get(id)?.inode;
        if inode.file_type != st.file_type() || inode.is_retired() || inode.reused_by(path, st) {
            return None;
        }
        inode.set_path(path);
        Some(inode.clone())
    }

    /// The kernel dropped `n` references.
    pub fn forget(&self, id: u64, n: u64) {
        if id == ROOT_ID {
            return;
        }
        let now = self.now();
        let mut inner = self.inner.lock().unwrap();
        let Some(e) = inner.by_id.get_mut(&id) else {
            return;
        };
        if e.count == 0 {
            return;
        }
        e.count = e.count.saturating_sub(n);
        if e.count == 0 {
            inner.release(id, now);
            if inner.trim_due() {
                inner.trim(now, MAX_PER_CALL);
            }
        }
    }

    /// The last name of `inode` is gone from the source: a new object that gets the same
    /// source inode number must not be taken for it.
    pub fn unlinked(&self, inode: &Inode<F>) {
        let mut inner = self.inner.lock().unwrap();
        if inner.by_key.get(&inode.key) == Some(&inode.id) {
            inner.by_key.remove(&inode.key);
        }
        // Unreachable now; if the kernel has forgotten it too, it is of no further use.
        if inner.by_id.get(&inode.id).is_some_and(|e| e.count == 0) {
            inner.remove(inode.id);
        }
    }

    /// Rewrites the paths of every entry at or below `from` to lie below `to`; with
    /// `exchange`, the two subtrees swap. `from_parent` and `to_parent` are the node ids of
    /// the directories of `from` and `to`.
    pub fn renamed(
        &self,
        from: &Path,
        to: &Path,
        exchange: bool,
        from_parent: u64,
        to_parent: u64,
    ) {
        let inner = self.inner.lock().unwrap();
        let mut moved = Vec::new();
        for e in inner.by_id.values() {
            let mut names = e.inode.names.lock().unwrap();
            if !exchange {
                // Whatever `to` named before is replaced: that inode loses the name.
                names.retain(|p| !p.starts_with(to) || p.starts_with(from));
            }
            for p in names.iter_mut() {
                if let Ok(rest) = p.strip_prefix(from) {
                    *p = join(to, rest);
                } else if exchange && let Ok(rest) = p.strip_prefix(to) {
                    *p = join(from, rest);
                } else {
                    continue;
                }
                moved.push((p.clone(), e.inode.id));
            }
            if names.first().map(PathBuf::as_path) == Some(to) {
                e.inode.parent.store(to_parent, Ordering::Relaxed);
            } else if exchange && names.first().map(PathBuf::as_path) == Some(from) {
                e.inode.parent.store(from_parent, Ordering::Relaxed);
            }
        }
        for (p, id) in moved {
            index_name(&inner.index, &p, id);
        }
    }

    /// Entries known by any of `paths`, each with that name (for a batch of watcher
    /// events), found through the name index.
    pub fn holders_of(&self, paths: &HashSet<PathBuf>) -> Vec<(PathBuf, Arc<Inode<F>>)> {
        if paths.is_empty() {
            return Vec::new();
        }
        let inner = self.inner.lock().unwrap();
        let mut out = Vec::new();
        for p in paths {
            for inode in inner.holders(p) {
                out.push((p.clone(), inode));
            }
        }
        out
    }

    /// The one entry known by `path`, if exactly one is (found through the name index).
    pub fn named(&self, path: &Path) -> Option<Arc<Inode<F>>> {
        let mut holders = self.inner.lock().unwrap().holders(path);
        (holders.len() == 1).then(|| holders.remove(0))
    }

    /// Whether the kernel references node `id` (it may have it open).
    pub fn is_referenced(&self, id: u64) -> bool {
        let inner = self.inner.lock().unwrap();
        inner.by_id.get(&id).is_some_and(|e| e.count > 0)
    }

    /// Every entry the kernel references.
    pub fn referenced(&self) -> Vec<Arc<Inode<F>>> {
        let inner = self.inner.lock().unwrap();
        inner
            .by_id
            .values()
            .filter(|e| e.count > 0)
            .map(|e| e.inode.clone())
            .collect()
    }

    pub fn snapshot(&self) -> InodeSnapshot {
        let inner = self.inner.lock().unwrap();
        let l = &inner.limits;
        InodeSnapshot {
            entries: inner.by_id.len() as u64,
            referenced: inner.referenced() as u64,
            free: inner.free_len as u64,
            peak: inner.n.peak,
            allocations: inner.n.allocations,
            frees: inner.n.frees,
            reuses: inner.n.reuses,
            lookups: inner.n.lookups,
            misses_after_free: inner.n.misses_after_free,
            invalidations: inner.n.invalidations,
            max_inodes: l.max_inodes as u64,
            free_min: l.free_min as u64,
            min_age_ms: l.min_age.as_millis() as u64,
            max_age_ms: l.max_age.as_millis() as u64,
            freeing: l.freeing,
        }
    }
}

fn join(base: &Path, rest: &Path) -> PathBuf {
    if rest.as_os_str().is_empty() {
        base.to_path_buf()
    } else {
        base.join(rest)
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;

    use super::*;

    /// A stat of object `ino` of type `mode` (also for `model_check.rs`).
    pub(super) fn st(ino: u64, mode: u32) -> Stat {
        Stat {
            dev: 1,
            ino,
            mode,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            blocks: 0,
            blksize: 4096,
            atime: (0, 0),
            mtime: (0, 0),
            ctime: (0, 0),
            btime: (0, 0),
        }
    }

    pub(super) fn file(ino: u64) -> Stat {
        st(ino, libc::S_IFREG)
    }

    fn table(max: usize, free_min: usize) -> InodeTable<()> {
        let mut l = InodeLimits::new(max);
        l.free_min = free_min;
        InodeTable::new(&st(2, libc::S_IFDIR), l)
    }

    fn p(s: &str) -> Option<PathBuf> {
        Some(PathBuf::from(s))
    }

    /// Page invalidations wait for the writers through the page cache: held back while
    /// any is open, sent again by the last to close, and an invalidation under way is
    /// waited for by a writer that opens meanwhile.
    #[test]
    fn page_invalidations_are_held_back_while_page_cache_writers_are_open() {
        let t = table(100, 0);
        let f = t.lookup(1, Path::new("f"), &file(10));
        assert!(f.begin_page_invalidation(), "no writer: the pages go");
        f.end_page_invalidation();
        f.page_cache_writer_opened();
        f.page_cache_writer_opened();
        assert!(f.has_page_cache_writers());
        assert!(!f.begin_page_invalidation(), "held back");
        assert!(!f.page_cache_writer_closed(), "another writer is open");
        assert!(f.page_cache_writer_closed(), "the last sends it");
        f.page_cache_writer_opened();
        assert!(
            !f.page_cache_writer_closed(),
            "nothing held back: nothing to send"
        );
        // A writer opening while an invalidation is under way waits for its end (and not
        // for the whole bound).
        assert!(f.begin_page_invalidation());
        let (g, (tx, rx)) = (f.clone(), std::sync::mpsc::channel());
        let waiter = std::thread::spawn(move || {
            g.page_cache_writer_opened();
            tx.send(()).unwrap();
            let t0 = Instant::now();
            g.wait_for_page_invalidation();
            t0.elapsed()
        });
        rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(10));
        f.end_page_invalidation();
        assert!(waiter.join().unwrap() < PAGE_INVALIDATION_WAIT);
        assert!(!f.begin_page_invalidation(), "the writer is counted");
    }

    /// What the kernel may hold as a file's size: the first reply's size; after a reply
    /// with another size, not known (either may be applied) until two replies agree; a
    /// write through the mount extends a known size, never an unknown one.
    #[test]
    fn the_size_the_kernel_holds_is_known_only_when_the_last_two_replies_agree() {
        let t = table(100, 0);
        let f = t.lookup(1, Path::new("f"), &file(10));
        assert!(!f.kernel_holds_size(0), "nothing told yet");
        f.told_kernel_size(100);
        assert!(f.kernel_holds_size(100));
        f.kernel_wrote_to(50);
        assert!(
            f.kernel_holds_size(100),
            "a write inside the file moves nothing"
        );
        f.kernel_wrote_to(150);
        assert!(f.kernel_holds_size(150));
        f.told_kernel_size(80);
        assert!(!f.kernel_holds_size(80) && !f.kernel_holds_size(150));
        f.kernel_wrote_to(200);
        assert!(
            !f.kernel_holds_size(200),
            "either size may have been extended"
        );
        f.told_kernel_size(80);
        assert!(f.kernel_holds_size(80));
    }

    #[test]
    fn a_version_told_moves_only_from_another_told_before_it() {
        let t = table(100, 0);
        let f = t.lookup(1, Path::new("f"), &file(10));
        assert!(
            !f.told_kernel_version(7),
            "nothing told before: nothing moved"
        );
        assert!(!f.told_kernel_version(7));
        assert!(f.told_kernel_version(8));
        assert!(!f.told_kernel_version(8));
    }

    /// `holders_of` finds through the name index exactly the entries that hold each name,
    /// after lookups, hard links, renames of subtrees, removed names, frees and a rebuild
    /// of the index, as a pass over the whole table would.
    #[test]
    fn holders_of_agrees_with_a_pass_over_the_table() {
        let t = table(100_000, 0);
        let by_scan = |t: &InodeTable<()>, want: &HashSet<PathBuf>| {
            let inner = t.inner.lock().unwrap();
            let mut v: Vec<(PathBuf, u64)> = Vec::new();
            for e in inner.by_id.values() {
                for n in e.inode.names.lock().unwrap().iter() {
                    if want.contains(n) {
                        v.push((n.clone(), e.inode.id));
                    }
                }
            }
            v.sort();
            v
        };
        let by_index = |t: &InodeTable<()>, want: &HashSet<PathBuf>| {
            let mut v: Vec<(PathBuf, u64)> = t
                .holders_of(want)
                .into_iter()
                .map(|(p, i)| (p, i.id))
                .collect();
            v.sort();
            v
        };
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let name = |d: u64, f: u64| PathBuf::from(format!("d{d}/f{f}"));
        for round in 0..3000 {
            let (d, f, ino) = (next() % 4, next() % 8, 10 + next() % 40);
            match next() % 6 {
                0 | 1 => {
                    t.lookup(ROOT_ID, &name(d, f), &st(ino, libc::S_IFREG));
                }
                2 => {
                    if let Some(i) = t.find(&name(d, f), &st(ino, libc::S_IFREG)) {
                        i.remove_name(&name(d, f));
                    }
                }
                3 => t.renamed(
                    &PathBuf::from(format!("d{d}")),
                    &PathBuf::from(format!("d{}", next() % 4)),
                    next() % 2 == 0,
                    ROOT_ID,
                    ROOT_ID,
                ),
                4 => {
                    let id = t.inner.lock().unwrap().by_id.keys().copied().max().unwrap();
                    t.forget(id, u64::MAX);
                    t.maintain();
                }
                _ => t.inner.lock().unwrap().rebuild_index(0),
            }
            let want: HashSet<PathBuf> = (0..4)
                .flat_map(|d| (0..8).map(move |f| name(d, f)))
                .collect();
            assert_eq!(by_index(&t, &want), by_scan(&t, &want), "round {round}");
        }
    }

    #[test]
    fn follows_lookup_counts_and_shares_hard_links() {
        let t = table(1000, 0);
        let linked = Stat {
            nlink: 2,
            ..file(10)
        };
        let a = t.lookup(ROOT_ID, Path::new("a"), &linked);
        let b = t.lookup(ROOT_ID, Path::new("b"), &linked);
        assert_eq!(a.id, b.id, "hard links share one entry");
        assert_eq!(a.path(), p("b"));
        a.remove_name(Path::new("b"));
        assert_eq!(a.path(), p("a"), "the other link takes over");
        a.remove_name(Path::new("a"));
        assert_eq!(
            a.path(),
            None,
            "no name left: reached only through open files"
        );
        t.forget(a.id, 1);
        assert_eq!(t.snapshot().referenced, 2);
        t.forget(a.id, 1);
        let s = t.snapshot();
        assert_eq!(
            (s.referenced, s.free),
            (1, 1),
            "forgotten: on the free list"
        );
        // A reused inode number of another type is a new object.
        let c = t.lookup(ROOT_ID, Path::new("c"), &file(11));
        let d = t.lookup(ROOT_ID, Path::new("c"), &st(11, libc::S_IFDIR));
        assert_ne!(c.id, d.id);
        assert!(d.id > c.id, "ids are never reused");
    }

    #[test]
    fn an_unreferenced_entry_waits_on_the_free_list_for_the_kernels_lookup() {
        let t = table(1000, 10);
        let r0 = t.snapshot().referenced;
        let a = t.entry_unreferenced(ROOT_ID, Path::new("a"), &file(10));
        let s = t.snapshot();
        assert_eq!((s.free, s.referenced), (1, r0));
        // The kernel's lookup of the same object finds it: same node id, same state.
        let b = t.lookup(ROOT_ID, Path::new("a"), &file(10));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(t.snapshot().referenced, r0 + 1);
        // An entry that exists is returned as it is, its count untouched.
        let c = t.entry_unreferenced(ROOT_ID, Path::new("a"), &file(10));
        assert!(Arc::ptr_eq(&a, &c));
        assert_eq!(t.snapshot().referenced, r0 + 1);
    }

    #[test]
    fn a_quick_relookup_revives_the_same_node_id() {
        let t = table(1000, 10);
        let a = t.lookup(ROOT_ID, Path::new("a"), &file(10));
        t.forget(a.id, 1);
        assert!(t.get(a.id).is_some(), "kept on the free list");
        let again = t.lookup(ROOT_ID, Path::new("a"), &file(10));
        assert_eq!(again.id, a.id);
        assert!(Arc::ptr_eq(&again, &a));
        assert_eq!(again.path(), p("a"));
        let s = t.snapshot();
        assert_eq!(
            (s.reuses, s.allocations, s.free, s.referenced),
            (1, 2, 0, 2)
        );
        // Its count starts again from one.
        t.forget(a.id, 1);
        assert_eq!(t.snapshot().free, 1);
    }

    #[test]
    fn a_reused_inode_number_under_another_name_is_another_file() {
        let t = table(1000, 10);
        let a = t.lookup(ROOT_ID, Path::new("a"), &file(10));
        // The source freed inode 10 and gave it to a new file "b": a new entry, so that the
        // kernel's node for "a" never leads to "b"'s bytes.
        let b = t.lookup(ROOT_ID, Path::new("b"), &file(10));
        assert_ne!(a.id, b.id);
        assert_eq!((a.path(), b.path()), (p("a"), p("b")));
        assert!(Arc::ptr_eq(&t.find(Path::new("b"), &file(10)).unwrap(), &b));
        assert!(t.find(Path::new("c"), &file(10)).is_none());
        // A file open through the mount holds its inode number: another name for it is the
        // same file (renamed behind the mount).
        let open = file(20);
        let o = t.lookup(ROOT_ID, Path::new("o"), &open);
        // (A state being loaded or used counts as loaded.)
        let busy = o.file();
        let moved = t.lookup(ROOT_ID, Path::new("moved"), &open);
        drop(busy);
        assert!(Arc::ptr_eq(&o, &moved));
    }

    #[test]
    fn birth_times_tell_a_reused_inode_number_under_the_same_name() {
        let t = table(1000, 10);
        let born = |ino, b| Stat {
            btime: (b, 0),
            ..file(ino)
        };
        let a = t.lookup(ROOT_ID, Path::new("f"), &born(10, 100));
        // The same file renamed (same birth time): the same entry, even under a new name.
        let moved = t.lookup(ROOT_ID, Path::new("g"), &born(10, 100));
        assert!(Arc::ptr_eq(&a, &moved));
        // Inode 10 freed and given to a new file under the old name: another entry.
        let next = t.lookup(ROOT_ID, Path::new("g"), &born(10, 200));
        assert_ne!(a.id, next.id);
        assert!(Arc::ptr_eq(
            &t.find(Path::new("g"), &born(10, 200)).unwrap(),
            &next
        ));
        assert!(t.find(Path::new("g"), &born(10, 100)).is_none());
    }

    #[test]
    fn excess_free_entries_are_freed_in_batches_oldest_first() {
        let t = table(1_000_000, 10);
        let ids: Vec<u64> = (0..500)
            .map(|i| {
                t.lookup(ROOT_ID, &PathBuf::from(format!("f{i}")), &file(100 + i))
                    .id
            })
            .collect();
        for &id in &ids {
            t.forget(id, 1);
        }
        // Everything is younger than min_age: all kept.
        assert_eq!(t.snapshot().free, 500);
        assert_eq!(t.snapshot().frees, 0);
        t.advance(Duration::from_secs(11));
        // One more forget past the batch threshold frees the excess down to free_min.
        let x = t.lookup(ROOT_ID, Path::new("x"), &file(99));
        t.forget(x.id, 1);
        let s = t.snapshot();
        assert_eq!(s.free, 10, "{s:?}");
        assert_eq!(s.frees, 491);
        // The oldest went first; the newest forgotten are the ones kept.
        assert!(t.get(ids[0]).is_none());
        assert!(t.get(x.id).is_some());
        assert!(t.get(ids[499]).is_some());
        // Past max_age the periodic pass frees the rest.
        t.advance(Duration::from_secs(31));
        assert!(t.maintain().is_empty());
        let s = t.snapshot();
        assert_eq!((s.entries, s.free, s.referenced), (1, 0, 1));
        assert!(s.peak >= 501);
    }

    #[test]
    fn freed_ids_are_never_reused_and_misses_are_counted() {
        let t = table(1_000_000, 0);
        let a = t.lookup(ROOT_ID, Path::new("a"), &file(10));
        t.forget(a.id, 1);
        t.advance(Duration::from_secs(31));
        t.maintain();
        assert!(t.get(a.id).is_none(), "a freed id answers nothing (ESTALE)");
        let b = t.lookup(ROOT_ID, Path::new("a"), &file(10));
        assert!(b.id > a.id, "a new id, never the old one");
        let s = t.snapshot();
        assert_eq!((s.frees, s.misses_after_free, s.reuses), (1, 1, 0));
    }

    #[test]
    fn referenced_entries_are_never_freed_even_far_over_the_maximum() {
        let t = table(10, 0);
        let held: Vec<Arc<Inode<()>>> = (0..1000)
            .map(|i| t.lookup(ROOT_ID, &PathBuf::from(format!("f{i}")), &file(100 + i)))
            .collect();
        t.advance(Duration::from_secs(100));
        t.maintain();
        for i in &held {
            assert!(t.get(i.id).is_some());
        }
        // Over the maximum, free entries go at once, whatever their age.
        for i in &held[..500] {
            t.forget(i.id, 1);
        }
        t.maintain();
        let s = t.snapshot();
        assert_eq!((s.referenced, s.free), (501, 0), "{s:?}");
    }

    #[test]
    fn over_the_maximum_the_coldest_entries_are_named_for_invalidation() {
        let t = table(100, 0);
        let dir = t.lookup(ROOT_ID, Path::new("d"), &st(5, libc::S_IFDIR));
        for i in 0..200 {
            t.lookup(dir.id, &PathBuf::from(format!("d/f{i}")), &file(100 + i));
        }
        // d is looked up again: now the most recent.
        t.lookup(ROOT_ID, Path::new("d"), &st(5, libc::S_IFDIR));
        let names = t.maintain();
        // 201 referenced (plus the root) down to 15/16 of 100.
        assert_eq!(names.len(), 202 - 94);
        assert_eq!(names[0], (dir.id, OsString::from("f0")), "coldest first");
        assert!(names.iter().all(|(parent, _)| *parent == dir.id));
        assert_eq!(t.snapshot().invalidations, names.len() as u64);
        // Asked entries go to the back: the next pass names the others first.
        let again = t.maintain();
        assert_eq!(again[0], (dir.id, OsString::from("f108")));
        // Freeing off: an allocate-only table, nothing is asked.
        t.set_limits(InodeLimits {
            freeing: false,
            ..t.limits()
        });
        assert!(t.maintain().is_empty());
    }

    #[test]
    fn rename_moves_subtrees_and_parents() {
        let t = table(1000, 10);
        let d = t.lookup(ROOT_ID, Path::new("d"), &st(9, libc::S_IFDIR));
        let x = t.lookup(d.id, Path::new("d/x"), &file(10));
        let dd = t.lookup(ROOT_ID, Path::new("dd"), &file(11));
        let e = t.lookup(ROOT_ID, Path::new("e"), &st(12, libc::S_IFDIR));
        t.forget(x.id, 1); // free entries follow renames too
        t.renamed(Path::new("d"), Path::new("e/f"), false, ROOT_ID, e.id);
        assert_eq!(x.path(), p("e/f/x"));
        assert_eq!(d.path(), p("e/f"));
        assert_eq!(d.parent(), e.id);
        assert_eq!(x.parent(), d.id, "children keep their directory");
        assert_eq!(dd.path(), p("dd"), "prefix match is by component");
        t.renamed(Path::new("e/f/x"), Path::new("dd"), true, d.id, ROOT_ID);
        assert_eq!(x.path(), p("dd"));
        assert_eq!(x.parent(), ROOT_ID);
        assert_eq!(dd.path(), p("e/f/x"));
        assert_eq!(dd.parent(), d.id);
        assert_eq!(t.lookup(ROOT_ID, Path::new("dd"), &file(10)).id, x.id);
    }

    /// `named` finds the entry a name leads to now: it follows renames, and a name that
    /// two entries claim (a hard link's second name is the other entry's too, should
    /// both know it) is answered by neither.
    #[test]
    fn named_finds_the_one_entry_a_name_leads_to() {
        let t = table(1000, 10);
        assert!(t.named(Path::new("a")).is_none());
        let a = t.lookup(ROOT_ID, Path::new("a"), &file(10));
        assert_eq!(t.named(Path::new("a")).unwrap().id, a.id);
        t.renamed(Path::new("a"), Path::new("b"), false, ROOT_ID, ROOT_ID);
        assert!(t.named(Path::new("a")).is_none(), "renamed away");
        assert_eq!(t.named(Path::new("b")).unwrap().id, a.id);
        let c = t.lookup(ROOT_ID, Path::new("c"), &file(11));
        t.lookup(ROOT_ID, Path::new("b"), &file(11));
        assert_eq!(c.path(), p("c"), "the first name stays the node's path");
        assert!(t.named(Path::new("b")).is_none(), "two entries claim b");
        assert_eq!(t.named(Path::new("c")).unwrap().id, c.id);
    }

    #[test]
    fn find_takes_no_reference_and_unlinked_free_entries_go() {
        let t = table(1000, 10);
        assert!(t.find(Path::new("a"), &file(10)).is_none());
        assert_eq!(t.snapshot().allocations, 1, "find allocates nothing");
        let a = t.lookup(ROOT_ID, Path::new("a"), &file(10));
        let found = t.find(Path::new("a"), &file(10)).unwrap();
        assert_eq!(found.id, a.id);
        assert_eq!(t.snapshot().referenced, 2);
        t.forget(a.id, 1);
        t.unlinked(&a);
        assert!(t.get(a.id).is_none());
        let b = t.lookup(ROOT_ID, Path::new("b"), &file(10));
        assert_ne!(b.id, a.id, "a new object with the same inode number");
    }

    #[test]
    fn queues_stay_bounded_under_churn() {
        let t = table(50, 5);
        let mut held = Vec::new();
        for round in 0..200u64 {
            for i in 0..100 {
                let ino = 100 + (round * 37 + i) % 300;
                held.push(
                    t.lookup(ROOT_ID, &PathBuf::from(format!("f{ino}")), &file(ino))
                        .id,
                );
            }
            for id in held.drain(..) {
                t.forget(id, 1);
            }
            t.advance(Duration::from_secs(1));
            t.maintain();
        }
        let inner = t.inner.lock().unwrap();
        assert!(inner.recent.len() <= 2 * inner.referenced() + 1024 + 1);
        assert!(inner.free_q.len() <= 2 * inner.free_len + 1024 + 1);
        assert_eq!(inner.referenced(), 1);
        assert!(inner.by_id.len() <= 51, "{}", inner.by_id.len());
    }

    #[test]
    fn concurrent_lookups_and_forgets_keep_counts_exact() {
        let t = Arc::new(table(8, 2));
        let threads: Vec<_> = (0..8)
            .map(|n| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for i in 0..5000u64 {
                        let ino = 100 + (i * 7 + n) % 40;
                        let a = t.lookup(ROOT_ID, &PathBuf::from(format!("f{ino}")), &file(ino));
                        assert_eq!(a.key, (1, ino));
                        // While referenced, the id stays valid and means the same object.
                        let got = t.get(a.id).expect("a referenced entry is never freed");
                        assert!(Arc::ptr_eq(&got, &a));
                        if i % 100 == 0 {
                            t.maintain();
                        }
                        t.forget(a.id, 1);
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        let s = t.snapshot();
        assert_eq!(s.referenced, 1, "{s:?}");
        assert_eq!(s.allocations, s.frees + s.entries, "{s:?}");
        assert_eq!(s.lookups, 40_000);
    }
}

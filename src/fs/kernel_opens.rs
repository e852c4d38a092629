//! Kernel opens (`--kernel-opens`): the daemon answers OPEN and CREATE with `ENOSYS`, and
//! the kernel opens files itself from then on. It keeps a file's pages between opens
//! (`FOPEN_KEEP_CACHE` is its default then) and sends no FLUSH or RELEASE, so a warm
//! read of a cached file costs no request at all. Changes behind the mount reach the
//! kernel's pages only by the watcher's notices (`fs/changes.rs`) and, where nothing
//! watches, by a notice once the attribute TTL has run out and a reply shows a new
//! version (`kernel_version_told`): no open looks at the source. The kernel copies a
//! write into its pages before it sends it, so the mount's own writes drop no pages
//! (`OwnWrite`).
//!
//! Requests on such files carry no handle (fh 0). Each is served through a handle opened
//! for it alone and released after it, so it sees what an open would: the cache state
//! validated against the source (or held by a callback), fetched as needed.
//!
//! A file whose last name the mount removes while the kernel still knows it may be open:
//! a handle is opened on it before the removal and kept until the kernel forgets the
//! node, so descriptors open on it read and write on, as on a local disk.
//!
//! Directories are opened by the kernel too (OPENDIR answered `ENOSYS`), which then keeps
//! their listings (`FOPEN_CACHE_DIR`) and asks again from offset 0 once a notice, a change
//! through the mount or a new mtime (which it checks itself) makes them stale. A
//! listing read in several requests continues in the listing it began in: its offsets
//! carry the listing's number (`KernelListings`). `--kernel-dir-opens` does this for
//! directories alone, and files are opened through the daemon as usual.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use fuser::{BackingId, Errno};

use super::open::PASSTHROUGH_RELEASE_WAIT;
use super::{CachingFs, DirList, Inode, Listing, Result};
use crate::coherence::Notice;
use crate::source::Stat;

/// Listings kept for directories the kernel reads in several requests.
const LISTINGS_KEPT: usize = 64;

/// The state `--kernel-opens` needs for files.
#[derive(Default)]
pub(super) struct KernelOpens {
    /// Handles kept for removed files, by node, until the kernel forgets them.
    kept: Mutex<HashMap<u64, u64>>,
    /// Nodes served while their version was racy (`CachingFs::fetched_identity`: a write
    /// may still have been copying its bytes), and when that window ends. No open comes
    /// to compare them then, and the kernel would keep what those reads got for good (the
    /// write moved the mtime before its bytes, so no attribute the kernel sees changes
    /// afterwards): once the window has passed, their pages are dropped, and the next
    /// read's open compares the cached bytes with the source's (`drop_racy_pages`).
    racy: Mutex<HashMap<u64, Instant>>,
    /// Files written through the mount, by node, until the kernel forgets them: the
    /// versions their writes left, newest last (`OwnWrite`).
    own: OwnVersions,
}

/// The versions files' own writes left, newest last, by node.
type OwnVersions = Mutex<HashMap<u64, VecDeque<Version>>>;

/// A file's version as its attributes show it: its size and times.
type Version = (u64, (i64, u32), (i64, u32));

fn version(st: &Stat) -> Version {
    (st.size, st.mtime, st.ctime)
}

/// How many of a file's latest own versions are remembered: a look at the source that
/// took one of them is compared with them a moment later, after more writes perhaps.
const OWN_VERSIONS_KEPT: usize = 16;

/// An own write of a file opened by the kernel (data, size or times), under way until
/// dropped: an own change of its node (`Inode::own_change`), and `done` records the
/// version it left. The kernel copies a write into its pages before it sends it, and
/// they are right from then on. Dropping them for the source's change that the write
/// makes would be wrong, not only wasted: between the copy and the write's arrival here,
/// a reader would fetch the bytes before it and the kernel keep those
/// (`tests/direct_writes.rs`). So the mount's own versions, and a change while an own one
/// is under way, drop no pages (`pages_follow_own_writes`).
pub(super) struct OwnWrite<'a> {
    own: Option<(&'a OwnVersions, OwnChange)>,
    id: u64,
}

type OwnChange = crate::inode::OwnChange<Box<super::FileState>>;

impl OwnWrite<'_> {
    /// The write (or a step of it) left the source at `after`.
    pub fn done(&self, after: &Stat) {
        let Some((own, _)) = &self.own else { return };
        let mut own = own.lock().unwrap();
        let versions = own.entry(self.id).or_default();
        if versions.len() == OWN_VERSIONS_KEPT {
            versions.pop_front();
        }
        versions.push_back(version(after));
    }
}

impl KernelOpens {
    /// Whether node `inode` is at an own version: an own change is under way, or the
    /// source shows (`now`, when given) a version its writes left. `None`: the mount never
    /// wrote it.
    fn at_own_version(&self, inode: &Inode, now: Option<&Version>) -> Option<bool> {
        let own = self.own.lock().unwrap();
        let versions = own.get(&inode.id)?;
        Some(inode.is_changing() || now.is_some_and(|v| versions.contains(v)))
    }
}

/// The state directories opened by the kernel need (`--kernel-opens`,
/// `--kernel-dir-opens`).
#[derive(Default)]
pub(super) struct KernelListings {
    /// Listings begun lately (offset 0), newest first, by number.
    listings: Mutex<VecDeque<(u64, Arc<DirList>)>>,
    next_listing: AtomicU64,
}

/// Handles opened for one request pass no file to the kernel.
fn no_backing(_: &File) -> io::Result<BackingId> {
    Err(io::Error::from_raw_os_error(libc::ENOTSUP))
}

impl CachingFs {
    pub fn kernel_opens(&self) -> bool {
        self.kernel_opens.is_some()
    }

    /// Whether the kernel opens directories itself (with `kernel_opens`, or alone).
    pub fn kernel_dir_opens(&self) -> bool {
        self.kernel_listings.is_some()
    }

    /// Runs `op` on handle `fh` of node `id`; for handle 0 (a kernel open), on one opened
    /// with `flags` for this request (`with_request_handle`).
    pub fn on_handle<T>(
        &self,
        id: u64,
        fh: u64,
        flags: i32,
        op: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        if fh != 0 {
            return op(fh);
        }
        self.with_request_handle(id, flags, op)
    }

    /// As `on_handle`, for a request that may write but comes on files opened read-only
    /// too (fsync, fallocate): handle 0 gets one open for writing if the file allows it.
    pub fn on_handle_rw<T>(&self, id: u64, fh: u64, op: impl Fn(u64) -> Result<T>) -> Result<T> {
        if fh != 0 {
            return op(fh);
        }
        match self.with_request_handle(id, libc::O_WRONLY, &op) {
            Err(e) if e == Errno::EACCES || e == Errno::EROFS || e == Errno::EPERM => {
                self.with_request_handle(id, libc::O_RDONLY, &op)
            }
            r => r,
        }
    }

    /// Runs `op` with a handle for a request on node `id` that came with none, opened with
    /// `flags` (an access mode and the caller's sync flags): the handle kept for a removed
    /// file, or one opened for this request and released after it.
    fn with_request_handle<T>(
        &self,
        id: u64,
        flags: i32,
        op: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        let ko = self.kernel_opens.as_ref().ok_or(Errno::EBADF)?;
        let kept_fh = ko.kept.lock().unwrap().get(&id).copied();
        if let Some(fh) = kept_fh {
            return op(fh);
        }
        let keep = libc::O_ACCMODE | libc::O_SYNC | libc::O_DSYNC;
        let open = || {
            let wait = PASSTHROUGH_RELEASE_WAIT;
            self.open_node(id, flags & keep, None, &no_backing, wait)
        };
        // Once more after `ESTALE` (the look raced a change, `open_node`), as the kernel
        // retries an open; a read would fail with it for good.
        let opened = match open() {
            Err(e) if e == Errno::ESTALE => open(),
            r => r,
        }?;
        let r = op(opened.fh);
        if let Ok(inode) = self.inode(id) {
            inode.served_kernel_open();
            let racy = inode
                .file()
                .as_ref()
                .is_some_and(|s| s.record().identity.racy);
            if racy {
                let ends = Instant::now() + self.racy_window();
                ko.racy.lock().unwrap().insert(id, ends);
            }
        }
        if let Err(e) = self.release(opened.fh) {
            tracing::debug!(id, "release of a request's handle: {e:?}");
        }
        r
    }

    /// Drops the kernel's pages of the nodes served while racy whose window has passed
    /// (`KernelOpens::racy`); the coherence threads call it a few times a second.
    pub fn drop_racy_pages(&self) {
        let Some(ko) = &self.kernel_opens else {
            return;
        };
        let now = Instant::now();
        let due: Vec<u64> = (ko.racy.lock().unwrap())
            .extract_if(|_, ends| *ends <= now)
            .map(|(id, _)| id)
            .collect();
        for id in due {
            self.coherence.notify(Notice::Inode(id));
        }
    }

    /// Marks a write of `inode` through the mount (data, size or times) under way until
    /// the result is dropped; with kernel opens only.
    pub(super) fn own_write(&self, inode: &Arc<Inode>) -> OwnWrite<'_> {
        let own = (self.kernel_opens.as_ref()).map(|ko| (&ko.own, inode.own_change()));
        OwnWrite { own, id: inode.id }
    }

    /// For the invalidation thread, before it drops the kernel's pages of `inode`: `true`
    /// if the source is at a version the mount's own writes left (or one is under way),
    /// and nothing else moved the file's content since the kernel's pages were last
    /// dropped. Its attributes go then, not its pages (`OwnWrite`). A change behind the
    /// mount that lands within a write of ours is taken for ours, as elsewhere
    /// (`FileState::written`).
    pub fn pages_follow_own_writes(&self, inode: &Inode) -> bool {
        let Some(ko) = &self.kernel_opens else {
            return false;
        };
        if inode.file_type != libc::S_IFREG || !inode.kernel_pages_current() {
            return false;
        }
        // Never written through the mount, or an own change under way: no look at the source.
        match ko.at_own_version(inode, None) {
            None => return false,
            Some(true) => return true,
            Some(false) => {}
        }
        let Some(st) = inode.path().and_then(|p| self.source.stat(&p).ok()) else {
            return false;
        };
        ko.at_own_version(inode, Some(&version(&st))) == Some(true)
    }

    /// A reply is about to give the kernel `st` as `inode`'s attributes. The kernel is not
    /// asked to drop a file's pages when it sees a new mtime (`FUSE_AUTO_INVAL_DATA`: it
    /// would drop them between a write's copy and its arrival too); instead a version that
    /// moved since the last reply, and not by the mount's own writes, has them dropped by
    /// a notice (checked again by `pages_follow_own_writes`). Where nothing watches the
    /// source, that is how a change behind the mount reaches the kernel's pages, once the
    /// attribute TTL has run out.
    pub(super) fn kernel_version_told(&self, inode: &Inode, st: &Stat) {
        let Some(ko) = &self.kernel_opens else {
            return;
        };
        if inode.file_type != libc::S_IFREG {
            return;
        }
        let v = version(st);
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(&v, &mut h);
        let hash = std::hash::Hasher::finish(&h).max(1);
        if !inode.told_kernel_version(hash) {
            return;
        }
        if ko.at_own_version(inode, Some(&v)) != Some(true) {
            self.coherence.notify(Notice::Inode(inode.id));
        }
    }

    /// Before the mount removes a name of `inode` (unlink, rename over it): if the kernel
    /// knows the node, a handle is kept open on it until the kernel forgets it.
    pub(super) fn keep_open_while_known(&self, inode: &Arc<Inode>) {
        let Some(ko) = &self.kernel_opens else {
            return;
        };
        let kept = &ko.kept;
        if inode.file_type != libc::S_IFREG
            || !self.inodes.is_referenced(inode.id)
            || kept.lock().unwrap().contains_key(&inode.id)
        {
            return;
        }
        let opened = self
            .open_node(
                inode.id,
                libc::O_RDWR,
                None,
                &no_backing,
                PASSTHROUGH_RELEASE_WAIT,
            )
            .or_else(|_| {
                self.open_node(
                    inode.id,
                    libc::O_RDONLY,
                    None,
                    &no_backing,
                    PASSTHROUGH_RELEASE_WAIT,
                )
            });
        match opened {
            Ok(o) => {
                let earlier = kept.lock().unwrap().insert(inode.id, o.fh);
                // Another removal kept one meanwhile: one is enough.
                if let Some(fh) = earlier {
                    let _ = self.release(fh);
                }
            }
            Err(e) => tracing::debug!(id = inode.id, "cannot keep a removed file open: {e:?}"),
        }
    }

    /// The kernel dropped references to node `id`: when none is left, so go the handle
    /// kept for it and its own versions.
    pub(super) fn forget_kept_handle(&self, id: u64) {
        let Some(ko) = &self.kernel_opens else {
            return;
        };
        // The kept map first: most forgotten nodes have no kept handle, and the table's
        // lock is the busier one.
        let known =
            ko.kept.lock().unwrap().contains_key(&id) || ko.own.lock().unwrap().contains_key(&id);
        if !known || self.inodes.is_referenced(id) {
            return;
        }
        ko.own.lock().unwrap().remove(&id);
        let fh = ko.kept.lock().unwrap().remove(&id);
        if let Some(fh) = fh {
            let _ = self.release(fh);
        }
    }

    /// A listing served to a kernel-opened directory ends (this READDIR returns nothing):
    /// the kernel keeps every such listing, and would keep this one as the directory's
    /// even if the directory changed while it was read (another reader began the cache
    /// anew after the change, and this one's last entries came at its end:
    /// `CachingFs::listing_ends`), so a listing older than a change of a name is dropped
    /// from the kernel before the reply.
    fn kernel_listing_ends(&self, list: &DirList) {
        let changed = self
            .inodes
            .get(list.dir_id)
            .is_some_and(|dir| dir.callback_breaks() != list.breaks);
        if changed {
            self.coherence.drop_kernel_listing(list.dir_id);
        }
    }

    /// What a READDIR with no handle serves: a new listing at offset 0; further on, the
    /// rest of the listing the offset names. (A listing no longer kept, after
    /// `LISTINGS_KEPT` others began meanwhile, is read anew and served from the same
    /// index.)
    pub(super) fn kernel_listing(&self, id: u64, offset: u64) -> Result<Listing> {
        let ko = self.kernel_listings.as_ref().ok_or(Errno::EBADF)?;
        let (number, start) = (offset >> 32, (offset & 0xffff_ffff) as usize);
        if offset != 0 {
            let listings = ko.listings.lock().unwrap();
            if let Some((_, list)) = listings
                .iter()
                .find(|(n, l)| *n == number && l.dir_id == id)
            {
                let list = list.clone();
                drop(listings);
                if start >= list.entries.len() {
                    self.kernel_listing_ends(&list);
                }
                return Ok(Listing {
                    list,
                    start,
                    cookie: number << 32,
                });
            }
        }
        let list = Arc::new(self.list_dir(id)?);
        if !self.coherence.watched(id) {
            // No event will drop the listing the kernel keeps now. The kernel drops it by
            // itself when an open finds the directory's mtime changed once its attributes
            // expired (it checks permissions, and so refreshes them); not where a change
            // left the mtime as it was (whole-second timestamps, object stores). A notice
            // drops it once the attribute TTL of unwatched directories has passed
            // (`leases_expired`).
            let ttl = self.coherence.tunables.attr(false);
            self.coherence
                .leases
                .grant(id, ttl, &self.coherence.counters);
        }
        // Nonzero, and below 2^31 so that offsets stay positive as the kernel's `loff_t`.
        let number = ko.next_listing.fetch_add(1, Ordering::Relaxed) % ((1 << 31) - 1) + 1;
        let mut listings = ko.listings.lock().unwrap();
        listings.push_front((number, list.clone()));
        listings.truncate(LISTINGS_KEPT);
        Ok(Listing {
            list,
            start,
            cookie: number << 32,
        })
    }
}

//! Opening regular files: the open pipeline, which validates the cache state against the
//! source, handles the kernel's ESTALE retry and retired nodes, and decides between
//! passthrough and the daemon (`finish_open`). Creation is `fs/create.rs`.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fuser::{BackingId, Errno, FopenFlags};

use super::state::Look;
use super::{CachingFs, FileState, Handle, Inode, OpenKind, Opened, Result, Writes, errno};
use crate::cache::store::first_page_resident;
use crate::coherence::{Notice, OpenLease};
use crate::fetch::HandleFetch;
use crate::fetch_pool::Found;
use crate::health::SourceFile;
use crate::source::Stat;
use crate::stats::Stats;

/// How often an open looks at a file again whose record is older than the source while
/// an own change may be under way (a millisecond apart while one is).
const OWN_CHANGE_TRIES: u32 = 50;

/// How long after an open answered ESTALE its thread's next open counts as the kernel's
/// retry of it (`CachingFs::open`): the retry follows at once, but a loaded machine may
/// delay it. Bounds a mark the kernel did not follow with a retry.
const ESTALE_RETRY: Duration = Duration::from_secs(1);

/// How long a writer waits for passthrough readers whose release is still on its way.
pub(super) const PASSTHROUGH_RELEASE_WAIT: Duration = Duration::from_millis(500);

impl CachingFs {
    /// Flags for opening the source: the caller's access mode and sync flags. Offsets come
    /// from the kernel, so O_APPEND is not passed; O_TRUNC arrives as a setattr.
    pub(super) fn source_flags(flags: i32) -> i32 {
        flags & (libc::O_ACCMODE | libc::O_SYNC | libc::O_DSYNC)
    }

    /// Opens a regular file for process `pid`. `make_backing` registers a cache file for
    /// passthrough.
    pub fn open(
        &self,
        id: u64,
        flags: i32,
        pid: u32,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<Opened> {
        self.open_waiting(id, flags, pid, make_backing, PASSTHROUGH_RELEASE_WAIT)
    }

    /// `open`; a writer waits at most `release_wait` for passthrough readers' releases.
    pub(super) fn open_waiting(
        &self,
        id: u64,
        flags: i32,
        pid: u32,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
        release_wait: Duration,
    ) -> Result<Opened> {
        // The kernel retries an open that failed with ESTALE once, at once, after looking
        // the name up again (`do_filp_open`), and the thread waits in that one syscall
        // meanwhile: when this thread's previous open answered ESTALE moments ago, this is
        // its retry. Every open takes the mark, so none outlives the retry it stands for.
        let first_estale = {
            let mut told = self.estale_told.lock().unwrap();
            told.retain(|_, at| at.elapsed() < ESTALE_RETRY);
            told.remove(&pid)
        };
        let r = self.open_node(id, flags, first_estale, make_backing, release_wait);
        // An open not waited for comes again, and is still the kernel's retry then.
        let mark = match (&r, first_estale) {
            (Err(e), None) if *e == Errno::ESTALE => Some(Instant::now()),
            (Err(e), Some(at)) if *e == Errno::ETXTBSY && release_wait.is_zero() => Some(at),
            _ => None,
        };
        if let Some(at) = mark {
            self.estale_told.lock().unwrap().insert(pid, at);
        }
        r
    }

    /// `open`; `first_estale`: when this thread's previous open, of which this one is the
    /// kernel's retry, answered ESTALE; `release_wait`: how long a writer waits for the
    /// releases of the file's passthrough readers before it fails with `ETXTBSY`.
    pub(super) fn open_node(
        &self,
        id: u64,
        flags: i32,
        first_estale: Option<Instant>,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
        release_wait: Duration,
    ) -> Result<Opened> {
        let inode = self.inode(id)?;
        if inode.is_retired() {
            return self.open_retired(&inode, flags, first_estale, make_backing);
        }
        // No name leads here any more (unlinked, or another file took the name): the
        // kernel's dentry is stale, and on ESTALE it looks the name up again.
        let path = inode.path().ok_or(Errno::ESTALE)?;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let offline = || {
            if writable || flags & libc::O_TRUNC != 0 {
                return self.offline_open_write(&inode, &path, flags);
            }
            let mut guard = inode.file();
            if guard.is_none() {
                *guard = Some(Box::new(self.offline_state(&inode, &path)));
            }
            self.finish_open(
                &inode,
                guard,
                (libc::O_RDONLY, false),
                None,
                true,
                make_backing,
            )
        };
        if !self.online() {
            return offline();
        }
        match self.open_online(
            &inode,
            &path,
            flags,
            first_estale,
            make_backing,
            release_wait,
        ) {
            Err(_) if !self.online() => offline(),
            r => r,
        }
    }

    /// An open of a retired node: an old version, kept for the handles open on it. The
    /// kernel looks the name up again on ESTALE and retries the open once, which then
    /// reaches the new entry. When the retry finds a retired node again (the file was
    /// replaced again meanwhile), failing would make an open of a name that always existed
    /// fail; it gets the version this node holds instead, whole, if an open saw that
    /// version current after this open's first try began: it was then the file's at an
    /// instant of this open. Retirement itself says nothing of when the source changed
    /// (without a watcher a change is found only by the next open), so a version last seen
    /// before the first try is never served, nor is a node reached with no lookup, as
    /// through `/proc/self/fd`.
    fn open_retired(
        &self,
        inode: &Arc<Inode>,
        flags: i32,
        first_estale: Option<Instant>,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<Opened> {
        let guard = inode.file();
        let during = match (first_estale, guard.as_ref().and_then(|s| s.confirmed)) {
            (Some(first), Some(confirmed)) => confirmed >= first,
            _ => false,
        };
        let whole = guard
            .as_ref()
            .is_some_and(|s| s.complete() && s.files().is_some());
        if !during
            || !whole
            || flags & libc::O_ACCMODE != libc::O_RDONLY
            || flags & libc::O_TRUNC != 0
        {
            return Err(Errno::ESTALE);
        }
        Stats::add(&self.stats.cache.retired_opens, 1);
        self.finish_open(
            inode,
            guard,
            (libc::O_RDONLY, false),
            None,
            true,
            make_backing,
        )
    }

    /// `path` no longer leads to `inode`'s file: the node stops answering to it, and the
    /// kernel forgets its entry for it.
    fn drop_stale_name(&self, inode: &Inode, path: &Path) {
        let parent = inode.parent();
        inode.remove_name(path);
        if let Some(name) = path.file_name() {
            self.coherence
                .notify(Notice::Entry(parent, name.to_os_string()));
        }
    }

    fn open_online(
        &self,
        inode: &Arc<Inode>,
        path: &Path,
        flags: i32,
        first_estale: Option<Instant>,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
        release_wait: Duration,
    ) -> Result<Opened> {
        let (inode, path) = (inode.clone(), path.to_path_buf());
        let id = inode.id;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        self.ensure_listed(path.parent().unwrap_or(Path::new("")));
        // A reader of a file the watcher covers asks the source nothing while its callback
        // stands (`coherence::Callback`); any other open looks, and may leave a callback.
        let dir = inode.parent();
        let reading = !writable && flags & libc::O_TRUNC == 0;
        let reader = reading && self.caps().descriptors;
        let mark = self.coherence.callback_mark(dir).filter(|_| reader);
        // Where nothing is watched, a recent look may stand instead (`--open-lease`; with
        // it off, nothing here touches the entry's slot).
        let lease_reader =
            reading && mark.is_none() && self.coherence.open_lease_term(dir).is_some();
        let breaks = inode.callback_breaks();
        // Just before the look at the source: the version it shows was current then. A
        // callback that holds now stands for the source now (no event waits).
        let mut looked_at = Instant::now();
        let called_back = mark
            .and_then(|_| inode.callback())
            .filter(|cb| self.coherence.callback_holds(cb, id, dir))
            .map(|cb| (cb.fd, cb.stat));
        let leased = lease_reader
            .then(|| inode.open_lease())
            .flatten()
            .filter(|l| self.coherence.open_lease_holds(l, dir));
        let looked = if let Some((fd, st)) = called_back {
            Ok((Some(fd), st))
        } else if let Some(lease) = &leased {
            looked_at = lease.at;
            Ok((None, lease.stat))
        } else if !self.caps().descriptors {
            self.source.stat(&path).map(|st| (None, st))
        } else {
            // One descriptor, shared by the callback and the state (`state.path_fd`).
            let looked = self
                .source
                .open_path_and_stat(&path)
                .map(|(fd, st)| (Arc::new(fd), st));
            if let (Some(mark), Ok((fd, st))) = (mark, &looked)
                && inode.is_same_file(st)
                && let Some(cb) = self.coherence.callback(mark, id, fd, st)
            {
                inode.grant_callback(cb, breaks);
            }
            looked.map(|(fd, st)| (Some(fd), st))
        };
        let (path_fd, st) = match looked {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                // The name this node knows the file by is gone, while the kernel reached
                // the node by a name it still holds: a listing read just before a rename
                // behind the mount can name the node last by the name renamed away. On
                // ESTALE the kernel looks its name up again, which names the node rightly
                // (or answers ENOENT if the file is gone).
                self.drop_stale_name(&inode, &path);
                return Err(Errno::ESTALE);
            }
            r => r.map_err(errno)?,
        };
        if self.stable_ino && !inode.is_same_file(&st) {
            // Another file has the name now (renamed over it behind the mount, and no
            // watcher told the kernel yet). This node stays with the file it was looked up
            // as, whose open handles keep reading it; the kernel looks the name up again on
            // ESTALE and opens the node of the file the name leads to now.
            self.drop_stale_name(&inode, &path);
            return Err(Errno::ESTALE);
        }
        if !st.is_file() {
            return Err(Errno::EINVAL);
        }
        let mut st = st;
        let mut guard = inode.file();
        // The stat was taken before the lock: a change made through the mount meanwhile
        // (another handle's write, recorded under the lock) makes the record newer than
        // it. Only a source that holds still while looked at again has really changed.
        // An own change that moves only the ctime (a rename) is waited for, briefly.
        let look_again = || match &path_fd {
            Some(fd) => self.source.fstat(fd.as_fd()),
            None => self.source.stat(&path),
        };
        let mut tries = 0;
        // (A file not open is looked at again by `load_state`, on a mismatch only.)
        while let Some(state) = guard.as_ref() {
            let differs = self.stale_check()
                && !state.written()
                && !state.record().identity.same_version(&self.identity(&st));
            tries += 1;
            if !differs || tries > OWN_CHANGE_TRIES {
                break;
            }
            let changing = inode.is_changing();
            drop(guard);
            if changing {
                std::thread::sleep(Duration::from_millis(1));
            }
            let before_again = Instant::now();
            let again = look_again().map_err(errno)?;
            looked_at = before_again;
            guard = inode.file();
            if !changing && self.identity(&again) == self.identity(&st) {
                break;
            }
            st = again;
        }
        // Retired since `open_node` looked (by another open, a lease's or the watcher's
        // revalidation, while this one asked the source): the node holds an old version
        // for its handles, and the name's cache entry is another node's now. Loading it
        // here would put a second cache state over that node's files; answered as any
        // open of a retired node is. (Nodes are retired under this lock.)
        if inode.is_retired() {
            drop(guard);
            return self.open_retired(&inode, flags, first_estale, make_backing);
        }
        let mut keep_cache = true;
        // No handle of the node was ever given to the kernel: it holds no pages of the
        // file to drop, of any version, and its attributes came from a look at the source
        // (a lookup's), as current as the watcher or the attribute TTL keeps them. So no
        // notice: one per first open cost the invalidation thread's work in a cold pass
        // and a `getattr` per file in the pass after it.
        let fresh = !inode.handed_out();
        let seen = self.identity(&st);
        // Loaded but closed (waiting for its group commit, or for fetches), with cache files
        // no name leads to any more (removed or replaced in the cache directory): they are
        // not the path's entry, and going on with them would leave the entry unrepaired.
        // Loaded afresh from the path, as if it had been unloaded before.
        if guard
            .as_ref()
            .is_some_and(|s| s.is_closed() && s.files_unlinked())
        {
            self.unload(&inode, &mut guard);
        }
        match guard.as_mut() {
            None => {
                let look = if leased.is_some() {
                    Look::Leased
                } else {
                    Look::Source
                };
                let (mut state, reset) = self.load_state(&inode, &path, &mut st, look);
                state.path_fd = path_fd;
                keep_cache = !reset;
                if reset {
                    inode.content_changed();
                }
                *guard = Some(Box::new(state));
            }
            Some(state) => {
                // Loaded by the directory prefetch, which keeps no `O_PATH` descriptor.
                if state.path_fd.is_none() {
                    state.path_fd = path_fd;
                }
                // Loaded but closed (waiting for its group commit, or for fetches): as at
                // a load, the data file is first checked to be as hoardfs left it.
                if state.is_closed() && !state.data_is_ours() {
                    state.discard_foreign_data(&self.env());
                    inode.content_changed();
                    keep_cache = false;
                }
                // A lease vouches for its version for its length, racy or not: the
                // bytes of a racy one are compared when an open looks again.
                let id = self.identity(&st);
                let leased_version = leased.is_some() && state.record().identity.same_version(&id);
                if self.stale_check()
                    && !state.written()
                    && state.record().identity != id
                    && !leased_version
                    && !self.settle_racy(&path, state, &st)
                {
                    // Changed behind the mount while open, before the watcher or a lease
                    // acted on it.
                    let c = &self.coherence.counters;
                    c.changes_detected.fetch_add(1, Ordering::Relaxed);
                    if self.keep_version(&inode, state, &st) {
                        // The handles open on this node keep their version; the kernel
                        // retries the open on the name's new node.
                        return Err(Errno::ESTALE);
                    }
                    self.stale(state, &st, Some(&path));
                    inode.content_changed();
                    keep_cache = false;
                }
            }
        }
        // The state's version was the file's at `looked_at` (unless `load_state` looked
        // again and found another).
        if let Some(state) = guard.as_mut()
            && self.identity(&st) == seen
            && state.record().identity.same_version(&seen)
        {
            state.confirmed = Some(looked_at);
        }
        // Also after a reset at load: the kernel may hold pages from an earlier open, and
        // only a returned notice lets later opens keep pages again (`kernel_pages_current`).
        // With kernel opens, pages come only from requests served: a file's first fill
        // leaves the kernel nothing to drop (and dropping would throw away the pages the
        // request that loads it is reading).
        // A reset by another loader (the directory prefetch) leaves them old too.
        if fresh {
            inode.pages_dropped(inode.content_version());
            keep_cache = true;
        }
        if !inode.kernel_pages_current() {
            keep_cache = false;
        }
        if !keep_cache && (!self.kernel_opens() || inode.kernel_open_pages()) {
            self.coherence.notify(Notice::Inode(id));
        }
        let was_complete = guard.as_ref().unwrap().complete() && keep_cache;
        if flags & libc::O_ACCMODE == libc::O_RDONLY {
            // The next files of its directory, ahead of a reader going through them: fetched
            // after a miss; after a hit whose data is on disk only, their entries read in.
            let found = match guard.as_ref().unwrap().files() {
                _ if !was_complete => Found::Miss,
                Some(f) if !first_page_resident(&f.data) => Found::ColdHit,
                _ => Found::Hit,
            };
            self.dir_prefetch_open(&inode, &path, found);
        }

        if writable && !self.joins_source_writers(guard.as_ref().unwrap()) {
            // The kernel refuses a non-passthrough open while passthrough opens exist, and
            // passthrough writes would bypass the source. Wait for releases in flight.
            let deadline = Instant::now() + release_wait;
            while guard.as_ref().unwrap().passthrough_opens() > 0 {
                if Instant::now() >= deadline {
                    self.release_if_unused(&inode, &mut guard);
                    return Err(Errno::ETXTBSY);
                }
                drop(guard);
                std::thread::sleep(Duration::from_millis(2));
                guard = inode.file();
                if inode.is_retired() {
                    // As above: the name's entry is another node's now.
                    drop(guard);
                    return self.open_retired(&inode, flags, first_estale, make_backing);
                }
                if guard.is_none() {
                    let (state, _) = self.load_state(&inode, &path, &mut st, Look::Source);
                    *guard = Some(Box::new(state));
                }
            }
        }
        let state = guard.as_mut().unwrap();
        if writable && !self.caps().in_place_writes {
            if let Err(e) = self.object_prepare_write(state, &path, flags) {
                self.release_if_unused(&inode, &mut guard);
                return Err(e);
            }
            state.opened(OpenKind::Daemon {
                writes_source: false,
            });
            drop(guard);
            return Ok(self.cache_write_handle(&inode, Writes::Uploaded));
        }

        if !state.complete() && state.fetch_src.is_none() {
            state.fetch_src = self
                .fetcher
                .open_source(|| self.open_fetch_reader(&path, &state.record().identity));
        }
        // A reader of a partially cached file reads through the fetch descriptor: one open
        // on the source, not two (each is a round trip on a network source).
        let new_content = flags & libc::O_TRUNC != 0;
        let mut source_write = writable && self.may_write_source(state, st.mode, new_content);
        let source = if writable || (!state.complete() && state.fetch_src.is_none()) {
            let opened = self.open_source_for(&path, Self::source_flags(flags), &mut source_write);
            // A reader's bytes must all be of the version this open validated: a name that
            // leads to another version by now (renamed over, rewritten since the stat)
            // makes the kernel retry the open. (Not by the mount's own writes, `written`.)
            let own_changes = state.written();
            let opened = opened.and_then(|f| {
                let raced = !writable
                    && !own_changes
                    && self.stale_check()
                    && self.identity(&self.source.fstat(f.as_fd())?) != self.identity(&st);
                if raced {
                    // A callback's look, older than the source now (a write behind the
                    // mount whose event is still to come): the retry looks afresh.
                    inode.break_callback();
                    return Err(io::Error::from_raw_os_error(libc::ESTALE));
                }
                Ok(f)
            });
            match opened {
                Ok(f) => Some(f),
                Err(e) => {
                    self.release_if_unused(&inode, &mut guard);
                    return Err(errno(e));
                }
            }
        } else {
            None
        };
        // Small files are fetched whole on first open (xCachefs' threshold; `fs/fetch.rs`),
        // so that this open can already be a passthrough one. While passthrough opens exist
        // the kernel takes only another passthrough open: fetched under the mutex then.
        let readable = flags & libc::O_ACCMODE != libc::O_WRONLY;
        // (Not beside writers to the source by passthrough: nothing is claimed meanwhile.)
        if readable
            && state.files().is_some()
            && state.source_writers() == 0
            && !state.record().is_complete()
            && state.record().identity.size <= self.cfg.whole_file_threshold
        {
            if state.passthrough_opens() > 0 {
                self.fetch_all(state);
            } else if let Some(whole) = self.start_whole_fetch(&inode, state) {
                // Fetched by the workers and by this open, without the state mutex: other
                // openers join the same flights, readers of other handles proceed. The
                // state stays loaded meanwhile (`opening`).
                state.begin_opening();
                drop(guard);
                self.finish_whole_fetch(&inode, &whole);
                guard = inode.file();
                guard.as_mut().unwrap().end_opening();
            }
        }
        if was_complete {
            Stats::add(&self.stats.cache.open_hits, 1);
        } else {
            Stats::add(&self.stats.cache.open_misses, 1);
        }

        if lease_reader {
            self.settle_open_lease(
                &inode,
                guard.as_ref().unwrap(),
                leased,
                &st,
                looked_at,
                breaks,
            );
        }
        // A new version's notice may still be on its way to the kernel: until it has
        // been delivered, the kernel's pages may be of the old version. But pages dropped
        // while another handle writes through them could be read back old before its
        // write arrives here: then they are dropped when the last such writer closes (a
        // notice is held back till then, `Inode::begin_page_invalidation`).
        let keep_cache =
            (keep_cache && inode.kernel_pages_current()) || inode.has_page_cache_writers();
        let how = (flags, source_write);
        self.finish_open(&inode, guard, how, source, keep_cache, make_backing)
    }

    /// Counts an open the daemon serves among `state`'s (under the file's lock) and returns
    /// whether it bypasses the kernel's page cache (`opens_direct`); one that does not is
    /// counted on the node as a reader or a writer through that cache (a writer must then
    /// `wait_for_page_invalidation`, without the lock). With kernel opens none is direct:
    /// the kernel opens files without telling the daemon, which could not know of the
    /// handles opened beside a direct writer.
    pub(super) fn count_daemon_open(
        &self,
        inode: &Inode,
        state: &mut FileState,
        flags: i32,
    ) -> bool {
        let writes_source = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let direct =
            !self.kernel_opens() && opens_direct(state, inode.had_page_cache_readers(), flags);
        if direct {
            state.opened(OpenKind::Direct { writes_source });
            if flags & libc::O_ACCMODE != libc::O_WRONLY {
                state.direct_reader_opened();
            }
            Stats::add(&self.stats.cache.direct_opens, 1);
            return true;
        }
        state.opened(OpenKind::Daemon { writes_source });
        if flags & libc::O_ACCMODE != libc::O_WRONLY {
            inode.hand_out_page_cache_reader();
        }
        if writes_source {
            inode.page_cache_writer_opened();
        }
        false
    }

    /// After an open for reading where nothing is watched: a look (`st`, taken at
    /// `looked_at`) that found the cached copy whole and of the version it shows answers
    /// later opens for `--open-lease` (`coherence::OpenLease`). A lease that answered this
    /// open but no longer agrees with the cache (the file changed through the mount since,
    /// so the open looked again) is dropped: the next open looks and takes a new one.
    fn settle_open_lease(
        &self,
        inode: &Inode,
        state: &FileState,
        used: Option<OpenLease>,
        st: &Stat,
        looked_at: Instant,
        breaks: u64,
    ) {
        let seen = self.identity(st);
        // (Where the source renumbers inodes, a node's key is the number of its first look.)
        let same_file = !self.stable_ino || inode.is_same_file(st);
        // A racy record (fetched or compared while a write may have been copying) is
        // leased too: what it holds is what the source returned, and the lease bounds how
        // long that is served, as it bounds an old version's.
        let current = state.complete() && state.record().identity.same_version(&seen) && same_file;
        match used {
            Some(lease) if !current || self.identity(&lease.stat) != seen => {
                inode.break_callback();
            }
            Some(_) => {}
            None if current => {
                if let Some(lease) = self.coherence.open_lease(inode.parent(), st, looked_at) {
                    inode.grant_open_lease(lease, breaks);
                }
            }
            None => {}
        }
    }

    /// Answers an open whose cache state is loaded: passthrough when the file is whole in
    /// the cache and nobody has it open through the daemon, else served by the daemon.
    fn finish_open(
        &self,
        inode: &Arc<Inode>,
        mut guard: crate::sync::MutexGuard<'_, Option<Box<FileState>>>,
        (flags, source_write): (i32, bool),
        source: Option<SourceFile>,
        keep_cache: bool,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<Opened> {
        let id = inode.id;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let state = guard.as_mut().unwrap();
        let backing = match source.as_deref() {
            Some(f) if source_write => self.source_write_backing(state, f, make_backing),
            _ if writable => None,
            _ => self.passthrough_backing(state, make_backing),
        };
        let mut direct = false;
        let mut fopen = if backing.is_some() {
            state.opened(if writable {
                OpenKind::SourceWriter
            } else {
                OpenKind::Passthrough
            });
            FopenFlags::FOPEN_PASSTHROUGH
        } else {
            direct = self.count_daemon_open(inode, state, flags);
            if direct {
                FopenFlags::FOPEN_DIRECT_IO
            } else if keep_cache {
                FopenFlags::FOPEN_KEEP_CACHE
            } else {
                FopenFlags::empty()
            }
        };
        let size = state.record().identity.size;
        // Under the file's lock, so that an open deciding after this one knows of it.
        inode.hand_out();
        drop(guard);
        if writable && !direct {
            inode.wait_for_page_invalidation();
        }
        // The kernel cuts reads through its page cache at the size it holds (it asks again
        // only once that is dropped or expired): if that may be another version's (the
        // file replaced or resized behind the mount since the kernel was last told), it
        // is dropped before this reply, or this handle's reads would end there. Passthrough
        // reads go by the cache file's own size.
        if backing.is_none() && !inode.kernel_holds_size(size) {
            self.coherence.drop_kernel_attrs(id);
        }
        // A reader has nothing to flush; its close matters only for locks (`fs/locks.rs`).
        let noflush = !writable && self.no_lock_holders(id);
        if noflush {
            fopen |= FopenFlags::FOPEN_NOFLUSH;
        }
        let fh = self.new_fh();
        self.handles.lock().unwrap().insert(
            fh,
            Arc::new(Handle {
                inode: inode.clone(),
                source,
                writable,
                passthrough: backing.clone(),
                direct,
                fetch: HandleFetch::default(),
                writes: Writes::Through,
                noflush: noflush.then(Default::default),
            }),
        );
        self.grant_lease(id);
        Ok(Opened {
            fh,
            flags: fopen,
            backing,
        })
    }

    /// Drops a state that no handle uses (after a failed open).
    pub(super) fn release_if_unused(&self, inode: &Inode, guard: &mut Option<Box<FileState>>) {
        self.unload_if_idle(inode, guard);
    }
}

/// Whether an open the daemon serves bypasses the kernel's page cache (`FOPEN_DIRECT_IO`),
/// decided before it is counted among `state`'s opens. A write-only handle alone on its
/// file does, if no handle reading through that cache was ever given out for the node:
/// its writes then reach the daemon from the caller's own pages, where through the page
/// cache every byte was copied into a kernel page first (a third copy beside the source's
/// and the cache file's; `docs/performance.md`, "Session 26"). The kernel drops the cached
/// pages of each range before it sends the write, but a page filled between that drop and
/// the write's arrival keeps the old bytes after the write returned: so every handle
/// opened while such a writer is open is direct too, and a node whose pages someone may
/// still map (mappings outlive their handles; `page_cache_readers`:
/// `Inode::had_page_cache_readers`) gets no direct writer.
fn opens_direct(state: &FileState, page_cache_readers: bool, flags: i32) -> bool {
    if flags & libc::O_ACCMODE == libc::O_WRONLY {
        state.daemon_opens() + state.passthrough_opens() == 0 && !page_cache_readers
    } else {
        state.direct_opens() > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{CacheRecord, SourceIdentity};

    fn state() -> FileState {
        let identity = SourceIdentity {
            ino: 7,
            size: 10,
            mtime: (1, 0),
            ctime: (1, 0),
            racy: false,
        };
        FileState::new(CacheRecord::empty(identity, 1 << 20))
    }

    #[test]
    fn a_write_only_open_alone_is_direct_and_so_is_every_open_beside_it() {
        let mut s = state();
        let (rd, wr, rdwr) = (libc::O_RDONLY, libc::O_WRONLY, libc::O_RDWR);
        assert!(!opens_direct(&s, false, rd) && !opens_direct(&s, false, rdwr));
        assert!(opens_direct(&s, false, wr));
        s.opened(OpenKind::Direct {
            writes_source: true,
        });
        assert!(
            opens_direct(&s, false, rd)
                && opens_direct(&s, false, rdwr)
                && !opens_direct(&s, false, wr)
        );
        s.opened(OpenKind::Direct {
            writes_source: false,
        });
        s.direct_reader_opened();
        assert_eq!((s.daemon_opens(), s.writers(), s.direct_opens()), (2, 1, 2));
        s.closed(OpenKind::Direct {
            writes_source: true,
        });
        assert!(!s.direct_readers_done(), "a direct handle is still open");
        // The reader beside it is still direct: so is the next open, writers included.
        assert!(opens_direct(&s, false, rd) && !opens_direct(&s, false, wr));
        s.closed(OpenKind::Direct {
            writes_source: false,
        });
        assert!(s.is_closed() && s.direct_opens() == 0);
        // The reader's pages are old now, once.
        assert!(s.direct_readers_done() && !s.direct_readers_done());
        // A writer beside a reader that uses the page cache, or a passthrough one: not.
        for kind in [
            OpenKind::Daemon {
                writes_source: false,
            },
            OpenKind::Passthrough,
        ] {
            s.opened(kind);
            assert!(!opens_direct(&s, false, wr) && !opens_direct(&s, false, rd));
            s.closed(kind);
        }
        // Nor a writer alone on a node whose pages someone may still map.
        assert!(!opens_direct(&s, true, wr));
    }
}

//! The cache entry of one regular file while it is loaded: its record, its data file and
//! the crash rules that tie them together (ARCHITECTURE.md, "Identity and the cache
//! record"). Every change of the record or the data file's version goes through these
//! methods: reset for a new version, mark written, checkpoint, persist, drop, discard
//! what someone else wrote.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Instant;

use fuser::BackingId;

use crate::cache::record::DataIdentity;
use crate::cache::store::{CacheFiles, write_record};
use crate::cache::{CacheRecord, CacheStore, SourceIdentity};
use crate::cleaner::Usage;
use crate::fetch::{FileFetch, SourceFd};
use crate::source::{Stat, fstat};
use crate::stats::{CacheCounters, Stats};

/// What the entry's rules need of the file system around it.
pub(super) struct Env<'a> {
    pub cache: &'a CacheStore,
    pub usage: &'a Usage,
    pub stats: &'a CacheCounters,
    pub chunk_size: u64,
}

/// Cache state of one regular file while it is open through the mount. The fields are
/// still visible to the rest of `fs` (counts of opens, the fetch state); the record and
/// the data file change only through the methods below.
#[derive(Debug)]
pub struct FileState {
    /// The cache files; `None` when the cache cannot be used for this file (I/O errors),
    /// in which case every read goes to the source.
    pub(super) files: Option<CacheFiles>,
    pub(super) record: CacheRecord,
    /// A read-only descriptor of the source file, for fetching; opened while the file is
    /// not fully cached, so that fetches work even after the name is unlinked. Counted
    /// against `fetch_fds`; fetches in flight hold it too.
    pub(super) fetch_src: Option<Arc<SourceFd>>,
    /// In-flight chunks and the generation of the cached content (`crate::fetch`).
    pub(super) fetch: Arc<FileFetch>,
    /// An `O_PATH` descriptor of the source file (cheap: no open on the server), so that
    /// `fstat` of an open file whose name is gone still answers.
    pub(super) path_fd: Option<OwnedFd>,
    pub(super) daemon_opens: u32,
    pub(super) passthrough_opens: u32,
    /// Handles open for writing to the source (counted in `daemon_opens` too). While any
    /// is open the node cannot keep an old version apart (`keep_version`): their writes
    /// reach the source file that the name's new node would serve.
    pub(super) writers: u32,
    /// Opens waiting for a whole-file fetch (not counted in the opens yet).
    pub(super) opening: u32,
    pub(super) backing: Weak<BackingId>,
    /// Chunks fetched since the record was last made durable.
    pub(super) unsynced: u32,
    /// A write went to the source since the last checkpoint (the on-disk record is dirty).
    pub(super) written: bool,
    /// Offline (`--offline-writes=log`): the source version the file's offline changes
    /// are made to, set when it is first opened for writing offline.
    pub(super) offline_base: Option<crate::oplog::Base>,
    /// The file's attributes when its last name was unlinked while it was open: an
    /// object store keeps nothing to `fstat` (a POSIX source has `path_fd`).
    pub(super) unlinked: Option<Stat>,
    /// When an open last saw the source hold this state's version (just before its look
    /// at the source): an instant at which the version was current. An open retried by
    /// the kernel may take a retired node's version only if this is after its first try
    /// (`CachingFs::open_retired`).
    pub(super) confirmed: Option<Instant>,
}

impl FileState {
    pub(super) fn complete(&self) -> bool {
        self.files.is_some() && self.record.is_complete()
    }

    /// Empties the entry for a new source version, `identity` (`CachingFs::reset`).
    /// `durable`: the empty record is synced before the data file changes
    /// (needed whenever an older record could claim chunks of the data file). A data file
    /// that holds bytes is never truncated or rewritten: someone may still read it (the
    /// kernel's passthrough backing, a mapping, an open file keeping its version), so the
    /// new version gets a new data file, renamed over the old one (`replace_data`).
    /// `path`: the cache entry's name; `None` for a file whose names are gone, whose data
    /// file nobody can reach any more (it is then emptied in place).
    pub(super) fn reset_as(
        &mut self,
        env: &Env,
        identity: SourceIdentity,
        durable: bool,
        path: Option<&Path>,
    ) {
        self.fetch.invalidate();
        self.record = CacheRecord::empty(identity, env.chunk_size);
        self.unsynced = 0;
        self.written = false;
        if path.is_some() {
            // The fetch descriptor may be of another file than the new version (one renamed
            // over the name): the next fetch opens the source anew for the new identity.
            self.fetch_src = None;
        }
        let Some(files) = &mut self.files else {
            return;
        };
        let r = fresh_data(env, files, &self.record, durable, path, false);
        match r {
            Ok(true) => {
                // Flights and hints of the old data file end with it.
                self.fetch.kill();
                self.fetch = Arc::new(FileFetch::new(files.data.try_clone().ok()));
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!("cannot reset cache file: {e}");
                Stats::add(&env.stats.cache_errors, 1);
                self.files = None;
                return;
            }
        }
        self.noted();
    }

    /// Stops using the cache for this open file (after a failed cache write or an
    /// inconsistent source): the record is made empty so nothing stale is ever served.
    pub(super) fn drop_cached(&mut self) {
        self.fetch.invalidate();
        let identity = self.record.identity;
        self.record = CacheRecord::empty(identity, self.record.chunk_size);
        if let Some(files) = &self.files
            && write_record(files, &self.record, true).is_err()
        {
            self.files = None;
        }
        self.unsynced = 0;
    }

    /// Before the first write of an open session: the on-disk record says "dirty", durably,
    /// so that a crash between the source write and the cache write cannot leave a record
    /// that claims the old bytes are current.
    pub(super) fn mark_written(&mut self, env: &Env) {
        if self.written {
            return;
        }
        self.written = true;
        self.record.dirty = true;
        // A record that claims no chunk cannot pair old bytes with the file after a crash,
        // nor can any record on disk: one claims more than this only if written since the
        // last checkpoint, and a loss of claims (reset, drop, truncation) is written durably
        // or follows a durable mark. So a new file's first write waits for no sync.
        let durable = self.record.present_count() > 0;
        if let Some(files) = &self.files
            && let Err(e) = write_record(files, &self.record, durable)
        {
            tracing::warn!("cannot mark cache record dirty: {e}");
            Stats::add(&env.stats.cache_errors, 1);
            self.files = None;
        }
    }

    /// hoardfs has just changed the state's data file (see `FileFetch::own`).
    pub(super) fn noted(&self) {
        if let Some(files) = &self.files {
            self.fetch.note_written(&files.data);
        }
    }

    /// Whether the data file is as hoardfs itself last left it (`FileFetch::own`); true
    /// where that is not known. A record may only vouch for data hoardfs wrote: call this
    /// before stamping a record that claims chunks.
    pub(super) fn data_is_ours(&self) -> bool {
        let Some(files) = &self.files else {
            return true;
        };
        let ff = &self.fetch;
        let now = ff.quiet(|| fstat(files.data.as_fd()));
        match (ff.own(), now) {
            // A data file no name leads to any more (unlinked or replaced, by us or not) is
            // never loaded again, whatever its record says.
            // A ctime earlier than the one noted is not someone else's later change: this
            // kernel's ctimes of one file need not be in order (a coarse-grained update can
            // stamp an earlier time than a fine-grained one our note read), which concurrent
            // piece writes showed.
            (Some(own), Ok(st)) => {
                let now = DataIdentity::of(&st);
                st.nlink == 0 || (own.ino == now.ino && now.ctime <= own.ctime)
            }
            _ => true,
        }
    }

    /// The data file was changed behind hoardfs's back while the file was loaded (edited
    /// in the cache directory): nothing of it is vouched for any more. The record is
    /// emptied (durably), so every chunk is fetched again; nothing is stamped as valid.
    pub(super) fn discard_foreign_data(&mut self, env: &Env) {
        let now = self
            .files
            .as_ref()
            .and_then(|f| fstat(f.data.as_fd()).ok())
            .map(|st| DataIdentity::of(&st));
        tracing::warn!(
            own = ?self.fetch.own(),
            ?now,
            "a cache data file was changed behind hoardfs's back; refetching it"
        );
        Stats::add(&env.stats.corrupt_records, 1);
        self.fetch.invalidate();
        self.record = CacheRecord::empty(self.record.identity, self.record.chunk_size);
        self.unsynced = 0;
        self.written = false;
        if let Some(files) = &self.files {
            match write_record(files, &self.record, true) {
                // The empty record vouches for nothing; from here the file is hoardfs's.
                Ok(()) => self.fetch.set_own(
                    fstat(files.data.as_fd())
                        .ok()
                        .map(|st| DataIdentity::of(&st)),
                ),
                Err(_) => self.files = None,
            }
        }
    }

    /// Makes fetched chunks and written data durable and the record match them.
    pub(super) fn checkpoint(&mut self, env: &Env) {
        if self.unsynced == 0 && !self.written {
            return;
        }
        if !self.data_is_ours() {
            self.discard_foreign_data(env);
            return;
        }
        let Some(files) = &self.files else {
            self.unsynced = 0;
            return;
        };
        // The data first, then a record that claims it. The record need not be synced: a
        // crash that loses it leaves the one before, which is dirty (`mark_written`) or
        // claims only chunks synced before; the cache loses this fill, and knows it.
        let r = files.data.sync_data().and_then(|_| {
            self.record.dirty = false;
            write_record(files, &self.record, false)
        });
        match r {
            Ok(()) => {
                Stats::add(&env.stats.checkpoints, 1);
                self.unsynced = 0;
                self.written = false;
                self.noted();
            }
            Err(e) => {
                tracing::warn!("cache checkpoint failed: {e}");
                Stats::add(&env.stats.cache_errors, 1);
                self.record.dirty = true;
                self.files = None;
            }
        }
    }

    /// Rewrites the record (its identity, last use), stamped with the data file as it is:
    /// first checked to be as hoardfs left it, or the record would vouch for someone
    /// else's bytes.
    pub(super) fn persist_record(&mut self, env: &Env, durable: bool) {
        if !self.data_is_ours() {
            self.discard_foreign_data(env);
            return;
        }
        if let Some(files) = &self.files
            && write_record(files, &self.record, durable).is_err()
        {
            Stats::add(&env.stats.cache_errors, 1);
            self.files = None;
        }
    }
}

/// Makes `files` hold the empty record `rec` and a data file of its size with nothing
/// in it: a new data file at `path` if the old one holds bytes (or with `replace`).
/// Returns whether the data file was replaced. Crash rules: the empty record is written (durably with `durable`)
/// before anything happens to the data, and the new data file is vouched for only by a
/// record written after it is in place.
pub(super) fn fresh_data(
    env: &Env,
    files: &mut CacheFiles,
    rec: &CacheRecord,
    durable: bool,
    path: Option<&Path>,
    replace: bool,
) -> io::Result<bool> {
    write_record(files, rec, durable)?;
    let size = rec.identity.size;
    let held = replace || files.data.metadata()?.len() > 0;
    match path {
        Some(path) if held => {
            // The old file's blocks go when its last holder closes it; the new one
            // starts as a hole.
            let old = fstat(files.data.as_fd()).map_or(0, |st| st.blocks * 512);
            files.data = env.cache.replace_data(path, size)?;
            env.usage.adjust(old, 0);
            write_record(files, rec, false)?;
            Ok(true)
        }
        _ => {
            counted(env.usage, &files.data, || {
                files.data.set_len(0)?;
                files.data.set_len(size)
            })?;
            Ok(false)
        }
    }
}

/// Runs `op` on the data file `f` and counts what it changed in the file's disk usage
/// (`Usage::adjust`): rewrites add nothing, truncations free.
pub(super) fn counted<T>(
    usage: &Usage,
    f: &File,
    op: impl FnOnce() -> io::Result<T>,
) -> io::Result<T> {
    let blocks = || fstat(f.as_fd()).map(|st| st.blocks * 512);
    let before = blocks();
    let r = op();
    if let (Ok(b), Ok(a)) = (before, blocks()) {
        usage.adjust(b, a);
    }
    r
}

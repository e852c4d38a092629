//! The cache entry of one regular file while it is loaded: its record, its data file and
//! the crash rules that tie them together (ARCHITECTURE.md, "Identity and the cache
//! record"). Every change of the record or the data file's version goes through these
//! methods: reset for a new version, mark written, checkpoint, persist, drop, discard
//! what someone else wrote.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Instant;

use fuser::BackingId;

use crate::cache::store::{CacheFiles, write_record, write_record_unless_same};
use crate::cache::{CacheRecord, CacheStore, SourceIdentity};
use crate::cleaner::Usage;
use crate::fetch::{FileFetch, SourceFd};
use crate::source::{Stat, fstat};
use crate::stats::{CacheCounters, Stats};

pub(super) mod closed;
mod foreign;
mod writes;

/// What the entry's rules need of the file system around it.
pub(super) struct Env<'a> {
    pub cache: &'a CacheStore,
    pub usage: &'a Usage,
    pub stats: &'a CacheCounters,
    pub chunk_size: u64,
}

/// How a handle uses its file, for the open counts (`FileState::opened`, `closed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OpenKind {
    /// The kernel reads the data file itself (FUSE passthrough).
    Passthrough,
    /// Served by the daemon; `writes_source`: open for writing through to the source (a
    /// writer, which keeps the node from holding an old version apart).
    Daemon { writes_source: bool },
    /// Served by the daemon with the kernel's page cache bypassed (`FOPEN_DIRECT_IO`,
    /// `fs/open.rs`, `opens_direct`); counted among the daemon's opens too.
    Direct { writes_source: bool },
    /// The kernel writes (and reads) the source file itself (`fs/source_writes.rs`);
    /// counted among the passthrough opens too.
    SourceWriter,
}

/// What a checkpoint or a group commit of a record came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stamped {
    /// The record was written clean: it claims what is on disk.
    Clean,
    /// Nothing was written: nothing to commit, changed since the ticket, no cache files,
    /// or the write failed (then the cache files are dropped).
    Not,
    /// The data file was edited behind hoardfs's back: its bytes were discarded (nothing
    /// of them is claimed), and pages served from it must go too.
    Discarded,
}

/// Cache state of one regular file while it is open through the mount. The record, the
/// cache files, the written mark and the open counts are private: the record and the data
/// file change only through the methods below, which keep the crash rules, and the counts
/// through `opened` and `closed`. The descriptors and the fetch state are the open path's,
/// visible to the rest of `fs`.
#[derive(Debug)]
pub struct FileState {
    /// The cache files; `None` when the cache cannot be used for this file (I/O errors),
    /// in which case every read goes to the source.
    files: Option<CacheFiles>,
    record: CacheRecord,
    /// A read-only descriptor of the source file, for fetching; opened while the file is
    /// not fully cached, so that fetches work even after the name is unlinked. Counted
    /// against `fetch_fds`; fetches in flight hold it too.
    pub(super) fetch_src: Option<Arc<SourceFd>>,
    /// In-flight chunks and the generation of the cached content (`crate::fetch`).
    pub(super) fetch: Arc<FileFetch>,
    /// An `O_PATH` descriptor of the source file (cheap: no open on the server), so that
    /// `fstat` of an open file whose name is gone still answers, and metadata changes
    /// reach the file without resolving its name (`setattr`).
    pub(super) path_fd: Option<Arc<OwnedFd>>,
    daemon_opens: u32,
    passthrough_opens: u32,
    /// Handles open for writing to the source (counted in `daemon_opens` too). While any
    /// is open the node cannot keep an old version apart (`keep_version`): their writes
    /// reach the source file that the name's new node would serve.
    writers: u32,
    /// Handles opened with the kernel's page cache bypassed (counted in `daemon_opens`
    /// too): while any is open, every other open of the file bypasses it as well.
    direct: u32,
    /// A handle able to read (and so to map the file) was among the direct ones since
    /// none was open: a private mapping of it fills kernel pages the direct writes bypass.
    direct_readers: bool,
    /// Opens waiting for a whole-file fetch (not counted in the opens yet).
    opening: u32,
    pub(super) backing: Weak<BackingId>,
    /// `backing` is the source file's, not the cache file's (`fs/source_reads.rs`).
    pub(super) backing_is_source: bool,
    /// `backing` is the source file's, open for writing too (`fs/source_writes.rs`).
    pub(super) backing_writable: bool,
    /// Handles writing to the source by passthrough (`OpenKind::SourceWriter`).
    source_writers: u32,
    /// Chunks fetched since the record was last made durable.
    unsynced: u32,
    /// A write went to the source since the last checkpoint (the on-disk record is dirty).
    written: bool,
    /// The dirty mark is on disk durably (`mark_dirty`): until then only changes of bytes
    /// no record claims were made.
    durably_dirty: bool,
    /// Fills or writes handed to the group commit (`fs/commit.rs`): the record on disk is
    /// dirty or claims less than `record`, until a sync of the cache covers the data and
    /// the record is written after it (`commit_synced`).
    uncommitted: bool,
    /// Counts every change of the record or the data file, so that a commit can tell that
    /// nothing changed between its sync and its record.
    changes: u64,
    /// Offline (`--offline-writes=log`): the source version the file's offline changes
    /// are made to, set when it is first opened for writing offline.
    pub(super) offline_base: Option<crate::oplog::Base>,
    /// The file's attributes when its last name was unlinked while it was open: an
    /// object store keeps nothing to `fstat` (a POSIX source has `path_fd`).
    pub(super) unlinked: Option<Stat>,
    /// The source's attributes when the state was loaded: what an offline `getattr` of
    /// the open file answers (with the record's size and times) when no saved listing
    /// knows the file yet (created through the mount since its directory was listed).
    pub(super) loaded_stat: Option<Stat>,
    /// When an open last saw the source hold this state's version (just before its look
    /// at the source): an instant at which the version was current. An open retried by
    /// the kernel may take a retired node's version only if this is after its first try
    /// (`CachingFs::open_retired`).
    pub(super) confirmed: Option<Instant>,
}

impl FileState {
    /// A state with `record` and nothing else: no cache files, no descriptors, no opens.
    pub(super) fn new(record: CacheRecord) -> FileState {
        FileState {
            files: None,
            record,
            fetch_src: None,
            fetch: Arc::new(FileFetch::new(None)),
            path_fd: None,
            daemon_opens: 0,
            passthrough_opens: 0,
            writers: 0,
            direct: 0,
            direct_readers: false,
            opening: 0,
            backing: Weak::new(),
            backing_is_source: false,
            backing_writable: false,
            source_writers: 0,
            unsynced: 0,
            written: false,
            durably_dirty: false,
            uncommitted: false,
            changes: 0,
            offline_base: None,
            unlinked: None,
            loaded_stat: None,
            confirmed: None,
        }
    }

    /// The record as loaded and kept since: the version cached, its chunks, its use.
    pub(super) fn record(&self) -> &CacheRecord {
        &self.record
    }

    /// The cache files; `None` when the cache is not used for this file.
    pub(super) fn files(&self) -> Option<&CacheFiles> {
        self.files.as_ref()
    }

    /// A write went to the source since the last checkpoint: the record on disk is dirty,
    /// and the source's changes meanwhile are the mount's own. So while writers write to
    /// the source by passthrough, whose writes the daemon does not see.
    pub(super) fn written(&self) -> bool {
        self.written || self.source_writers > 0
    }

    /// Takes the cache files of the entry: with `valid`, the record read from them, which
    /// vouches for their data as it is on disk; without, the caller resets the entry
    /// (`reset_as`) before anything is served.
    pub(super) fn attach(&mut self, files: CacheFiles, valid: Option<CacheRecord>) {
        self.fetch = Arc::new(FileFetch::new(files.data.try_clone().ok()));
        self.files = Some(files);
        if let Some(rec) = valid {
            // As the record found it: what the record vouches for.
            self.fetch.set_own(Some(rec.data));
            self.record = rec;
        }
    }

    /// Takes `files` as a new, empty cache entry: a file created through the mount (or,
    /// offline, one that nothing was cached of, about to be written whole). The data file
    /// is emptied and the empty record written (durably with `durable`) before anything
    /// else can read them.
    pub(super) fn attach_empty(&mut self, files: CacheFiles, durable: bool) -> io::Result<()> {
        files.data.set_len(0)?;
        self.record.resize(0);
        write_record(&files, &self.record, durable)?;
        self.attach(files, None);
        self.noted();
        Ok(())
    }

    /// The file is in use now: its last use (for the cleaner's LRU) goes into the record
    /// with its next write.
    pub(super) fn used_now(&mut self) {
        self.record.last_used = super::now_millis();
    }

    /// Chunk `c` was read at `minute` (the cleaner evicts chunks by their last read).
    pub(super) fn chunk_read(&mut self, c: u64, minute: u32) {
        self.record.touch(c, minute);
    }

    /// A handle of `kind` opened the file.
    pub(super) fn opened(&mut self, kind: OpenKind) {
        match kind {
            OpenKind::Passthrough => self.passthrough_opens += 1,
            OpenKind::SourceWriter => {
                self.passthrough_opens += 1;
                self.source_writers += 1;
            }
            OpenKind::Daemon { writes_source } => {
                self.daemon_opens += 1;
                self.writers += u32::from(writes_source);
            }
            OpenKind::Direct { writes_source } => {
                self.daemon_opens += 1;
                self.writers += u32::from(writes_source);
                self.direct += 1;
            }
        }
    }

    /// A handle of `kind` was released.
    pub(super) fn closed(&mut self, kind: OpenKind) {
        match kind {
            OpenKind::Passthrough => self.passthrough_opens -= 1,
            OpenKind::SourceWriter => {
                self.passthrough_opens -= 1;
                self.source_writers -= 1;
            }
            OpenKind::Daemon { writes_source } => {
                self.daemon_opens -= 1;
                self.writers -= u32::from(writes_source);
            }
            OpenKind::Direct { writes_source } => {
                self.daemon_opens -= 1;
                self.writers -= u32::from(writes_source);
                self.direct -= 1;
            }
        }
    }

    /// Handles the kernel serves by passthrough.
    pub(super) fn passthrough_opens(&self) -> u32 {
        self.passthrough_opens
    }

    /// Handles the daemon serves, writers included.
    pub(super) fn daemon_opens(&self) -> u32 {
        self.daemon_opens
    }

    /// Handles open for writing through to the source.
    pub(super) fn writers(&self) -> u32 {
        self.writers
    }

    /// Handles writing to the source by passthrough.
    pub(super) fn source_writers(&self) -> u32 {
        self.source_writers
    }

    /// Handles open with the kernel's page cache bypassed.
    pub(super) fn direct_opens(&self) -> u32 {
        self.direct
    }

    /// A direct handle able to read was opened.
    pub(super) fn direct_reader_opened(&mut self) {
        self.direct_readers = true;
    }

    /// After a direct handle closed: whether it was the last, and a handle able to read
    /// was among them (answered once): pages a private mapping filled may be old.
    pub(super) fn direct_readers_done(&mut self) -> bool {
        self.direct == 0 && std::mem::take(&mut self.direct_readers)
    }

    /// An open waits for a whole-file fetch (the state must stay loaded meanwhile), until
    /// `end_opening`.
    pub(super) fn begin_opening(&mut self) {
        self.opening += 1;
    }

    pub(super) fn end_opening(&mut self) {
        self.opening -= 1;
    }

    /// Opens waiting for a whole-file fetch.
    pub(super) fn opening(&self) -> u32 {
        self.opening
    }

    /// Nobody has the file open through the mount, nor waits to (the state may still be
    /// loaded for fetches in flight or its group commit).
    pub(super) fn is_closed(&self) -> bool {
        self.daemon_opens + self.passthrough_opens + self.opening == 0
    }

    /// Chunks filled since the record last claimed what is on disk.
    pub(super) fn unsynced_fills(&self) -> u32 {
        self.unsynced
    }

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
        self.nothing_to_commit();
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
        self.uncommitted = false;
        self.changes += 1;
    }

    /// Before a change of the data file that may touch any byte it holds (truncation,
    /// fallocate, an offline rewrite): the on-disk record says "dirty", durably when it
    /// claims chunks, so that a crash between the source's change and the cache's cannot
    /// leave a record that claims the old bytes are current.
    pub(super) fn mark_written(&mut self, env: &Env) {
        let claims = self.record.present_count() > 0;
        self.mark_dirty(env, claims);
    }

    /// Before a write of `len` bytes at `offset`: as `mark_written`, but durably only if
    /// the write overlaps bytes the record claims. A write past every claimed byte (an
    /// append) changes nothing a record on disk vouches for: after a crash the claimed
    /// bytes are still the version's, whatever reached the disk beyond them.
    pub(super) fn mark_write(&mut self, env: &Env, offset: u64, len: u64) {
        let claims = self.claims_any(offset, offset.saturating_add(len));
        self.mark_dirty(env, claims);
    }

    /// Whether the record claims any byte of `[start, end)`: a present chunk there, below
    /// the version's size (the last chunk's tail past it is nobody's).
    fn claims_any(&self, start: u64, end: u64) -> bool {
        let rec = &self.record;
        let end = end.min(rec.identity.size);
        if start >= end || rec.present_count() == 0 {
            return false;
        }
        let cs = rec.chunk_size;
        (start / cs..end.div_ceil(cs)).any(|c| rec.is_present(c))
    }

    /// The record on disk becomes dirty before the session's first change, and durably so
    /// before the first change that touches claimed bytes. A record that claims none of
    /// the changed bytes cannot pair old bytes with the file after a crash, nor can any
    /// record on disk: one claims more than this only if written since the last
    /// checkpoint, and a loss of claims (reset, drop, truncation) is written durably or
    /// follows a durable mark. So a new file's writes, and appends, wait for no sync.
    fn mark_dirty(&mut self, env: &Env, durable: bool) {
        self.changes += 1;
        if self.written && (self.durably_dirty || !durable) {
            return;
        }
        self.written = true;
        self.record.dirty = true;
        if let Some(files) = &self.files {
            match write_record(files, &self.record, durable) {
                Ok(_) => self.durably_dirty |= durable,
                Err(e) => {
                    tracing::warn!("cannot mark cache record dirty: {e}");
                    Stats::add(&env.stats.cache_errors, 1);
                    self.files = None;
                }
            }
        }
    }

    /// hoardfs has just changed the state's data file (see `FileFetch::own`).
    pub(super) fn noted(&self) {
        if let Some(files) = &self.files {
            self.fetch.note_written(&files.data);
        }
    }

    /// Writes `bytes`, chunk `c` of the version cached as read from the source, into the
    /// data file, and claims it (`filled`).
    pub(super) fn fill(&mut self, env: &Env, c: u64, bytes: &[u8]) -> io::Result<()> {
        let files = (self.files.as_ref()).ok_or(io::Error::from_raw_os_error(libc::EIO))?;
        let w = files.data.write_all_at(bytes, c * self.record.chunk_size);
        self.fetch.note_written(&files.data);
        w?;
        env.usage.add(bytes.len() as u64);
        self.filled(c);
        Ok(())
    }

    /// Keeps this state's data file for its open handles while the cache entry on disk
    /// passes to a new version (`CachingFs::keep_version`): from here on the state's
    /// record is written to a scratch file nobody reads, and the entry at `new_entry`'s
    /// path gets its empty record and a new data file (if that fails, the entry is
    /// dropped, record first, so that nothing ever writes to the file the handles read).
    /// An error means nothing changed.
    pub(super) fn keep_apart(
        &mut self,
        env: &Env,
        new_entry: Option<(&Path, &CacheRecord)>,
    ) -> io::Result<()> {
        let files = (self.files.as_mut()).ok_or(io::Error::from_raw_os_error(libc::EIO))?;
        let scratch = crate::cache::store::scratch_file()?;
        let meta = files.replace_meta(scratch);
        if let Some((path, rec)) = new_entry {
            let moved = files.data.try_clone().and_then(|data| {
                let mut entry = CacheFiles::new(data, meta);
                fresh_data(env, &mut entry, rec, true, Some(path), true)
            });
            if let Err(e) = moved {
                tracing::warn!(?path, "cannot cache the new version apart: {e}");
                Stats::add(&env.stats.cache_errors, 1);
                if let Err(e) = env.cache.remove(path) {
                    tracing::warn!(?path, "cannot drop cache entry: {e}");
                }
            }
        }
        // Replaced by our rename: the old file's ctime moved with its link count.
        self.noted();
        Ok(())
    }

    /// Chunk `c` now holds the source's bytes in the data file (fetched): the record
    /// claims it, durably only after a checkpoint or a commit.
    pub(super) fn filled(&mut self, c: u64) {
        self.record.set_present(c, true);
        self.unsynced += 1;
        self.changes += 1;
    }

    /// The source holds `identity` now, by a change the mount made whose effect on the
    /// bytes the entry already has (or that changed none: attributes, times, an upload of
    /// the data file itself). The record says so with its next write.
    pub(super) fn own_version(&mut self, identity: SourceIdentity) {
        // Only a version of the size the record has: another size comes from a write whose
        // cache copy is still to come (another handle's, waiting for this lock), and that
        // write resizes the record with the chunks it fills. Taking the size here would
        // leave the presence bitmap shorter than the chunks it must cover (the stress
        // test found it as a panic). Kept as it is, the record matches no stat until then.
        if identity.size != self.record.identity.size {
            return;
        }
        self.follow_own_change(identity);
    }

    /// The source is `after` now by a change the mount made. A racy record stays racy: the
    /// bytes it kept from before may have been fetched while a write behind the mount was
    /// still copying (`CachingFs::fetched_identity`), and are still to be compared.
    pub(super) fn follow_own_change(&mut self, after: SourceIdentity) {
        let racy = after.racy || self.record.identity.racy;
        self.record.identity = SourceIdentity { racy, ..after };
    }

    /// The file's times as the mount set them where the source keeps them only later (an
    /// object store uploads at close; offline, the log replays them).
    pub(super) fn set_times(&mut self, mtime: (i64, u32), ctime: Option<(i64, u32)>) {
        self.record.identity.mtime = mtime;
        if let Some(ctime) = ctime {
            self.record.identity.ctime = ctime;
        }
    }

    /// Whether the record on disk may claim less than `record`, or be dirty.
    pub(super) fn needs_checkpoint(&self) -> bool {
        self.unsynced > 0 || self.written || self.uncommitted
    }

    /// Hands what needs a checkpoint to the group commit instead (the caller has queued
    /// the file there). The state's writes are over: no handle may be open for writing,
    /// as `written` also tells coherence that the source's changes are the mount's own.
    pub(super) fn defer_checkpoint(&mut self) {
        debug_assert!(self.writers == 0 || !self.written);
        self.uncommitted |= self.unsynced > 0 || self.written;
        self.unsynced = 0;
        self.written = false;
        self.durably_dirty = false;
    }

    /// The group commit's mark, taken before its sync of the cache: `None` if nothing
    /// waits for it.
    pub(super) fn commit_ticket(&self) -> Option<u64> {
        self.uncommitted.then_some(self.changes)
    }

    /// After a sync of the whole cache that began after `commit_ticket` returned `ticket`:
    /// if nothing changed since, every byte the record claims is on disk, and a clean
    /// record may say so (crash rule 1, as in `checkpoint`).
    pub(super) fn commit_synced(&mut self, env: &Env, ticket: u64) -> Stamped {
        if !self.uncommitted || self.changes != ticket || self.unsynced > 0 || self.written {
            return Stamped::Not;
        }
        self.clean_record(env)
    }

    /// Makes fetched chunks and written data durable and the record match them.
    pub(super) fn checkpoint(&mut self, env: &Env) -> Stamped {
        if !self.needs_checkpoint() {
            return Stamped::Not;
        }
        let synced = match &self.files {
            Some(files) => files.data.sync_data(),
            None => Ok(()),
        };
        match synced {
            Ok(()) => self.clean_record(env),
            Err(e) => {
                self.checkpoint_failed(env, e);
                Stamped::Not
            }
        }
    }

    /// Writes the record clean, claiming what it claims, once the data is on disk. The
    /// record need not be synced: a crash that loses it leaves the one before, which is
    /// dirty (`mark_written`) or claims only chunks synced before; the cache loses this
    /// fill, and knows it.
    fn clean_record(&mut self, env: &Env) -> Stamped {
        if !self.data_is_ours() {
            self.discard_foreign_data(env);
            return Stamped::Discarded;
        }
        let Some(files) = &self.files else {
            // (`written` stays: an object store's upload at close still looks at it.)
            self.unsynced = 0;
            self.uncommitted = false;
            return Stamped::Not;
        };
        self.record.dirty = false;
        match write_record(files, &self.record, false) {
            Ok(_) => {
                Stats::add(&env.stats.checkpoints, 1);
                self.nothing_to_commit();
                self.noted();
                Stamped::Clean
            }
            Err(e) => {
                self.checkpoint_failed(env, e);
                Stamped::Not
            }
        }
    }

    fn checkpoint_failed(&mut self, env: &Env, e: io::Error) {
        tracing::warn!("cache checkpoint failed: {e}");
        Stats::add(&env.stats.cache_errors, 1);
        self.record.dirty = true;
        self.files = None;
    }

    fn nothing_to_commit(&mut self) {
        self.unsynced = 0;
        self.written = false;
        self.durably_dirty = false;
        self.uncommitted = false;
        self.changes += 1;
    }

    /// At the file's last close: as `persist_record`, not durably, but not for a last use
    /// alone that the record on disk has within `LAST_USED_GRAIN_MS`. Returns false if it
    /// left the record as it was.
    pub(super) fn persist_use(&mut self, env: &Env) -> bool {
        if self.needs_checkpoint() || !self.data_is_ours() {
            self.persist_record(env, false);
            return true;
        }
        match self
            .files
            .as_ref()
            .map(|f| write_record_unless_same(f, &self.record))
        {
            Some(Ok(wrote)) => wrote,
            Some(Err(_)) => {
                Stats::add(&env.stats.cache_errors, 1);
                self.files = None;
                true
            }
            None => true,
        }
    }

    /// Rewrites the record (its identity, last use), stamped with the data file as it is:
    /// first checked to be as hoardfs left it, or the record would vouch for someone
    /// else's bytes.
    pub(super) fn persist_record(&mut self, env: &Env, durable: bool) {
        if self.needs_checkpoint() {
            // The record claims data not yet on disk: it may be written only after a sync.
            self.checkpoint(env);
            if !durable || self.needs_checkpoint() {
                return;
            }
        }
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
/// in it: a new data file at `path` if the old one holds bytes or had a record (or with
/// `replace`). Returns whether the data file was replaced. `durable`: the entry had a
/// record (a first one need not be durable). Crash rules: the empty record is written
/// (durably with `durable`) before anything happens to the data, and the new data file is
/// vouched for only by a record written after it is in place.
pub(super) fn fresh_data(
    env: &Env,
    files: &mut CacheFiles,
    rec: &CacheRecord,
    durable: bool,
    path: Option<&Path>,
    replace: bool,
) -> io::Result<bool> {
    let len = write_record(files, rec, durable)?.size;
    let size = rec.identity.size;
    // Only a new entry's data file is nobody's. One a record named may be held by an old
    // node's state even when empty (an empty version of a file replaced behind the mount,
    // still open): resized in place, it changed under that state, which took it for a
    // change behind hoardfs's back.
    let held = replace || len > 0 || durable;
    match path {
        // A new or empty entry of an empty file (every file created through the mount):
        // nothing to cut or size.
        _ if !held && size == 0 => Ok(false),
        // An empty data file (every new entry) grows as a hole: nothing to cut, and no
        // block allocated, so nothing to count.
        _ if !held => {
            files.data.set_len(size)?;
            Ok(false)
        }
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

#[cfg(test)]
mod tests {
    //! The commit rules against a real cache directory: a record claims chunks only after
    //! a sync that began after they were written.
    use super::*;
    use crate::cache::store::read_record_unchecked;
    use std::os::unix::fs::FileExt;

    struct Fixture {
        _dir: tempfile::TempDir,
        cache: CacheStore,
        usage: Usage,
        stats: CacheCounters,
    }

    const CHUNK: u64 = 4096;

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            let cache = CacheStore::open(dir.path()).unwrap();
            Fixture {
                _dir: dir,
                cache,
                usage: Usage::default(),
                stats: CacheCounters::default(),
            }
        }

        fn env(&self) -> Env<'_> {
            Env {
                cache: &self.cache,
                usage: &self.usage,
                stats: &self.stats,
                chunk_size: CHUNK,
            }
        }

        /// A loaded state of a two-chunk file with nothing cached, its empty record on disk.
        fn state(&self, name: &str) -> FileState {
            let identity = SourceIdentity {
                ino: 7,
                size: 2 * CHUNK,
                mtime: (1, 0),
                ctime: (1, 0),
                racy: false,
            };
            let mut files = self.cache.open_files(Path::new(name)).unwrap();
            let record = CacheRecord::empty(identity, CHUNK);
            fresh_data(&self.env(), &mut files, &record, true, None, false).unwrap();
            let data = files.data.try_clone().unwrap();
            let mut state = FileState::new(record);
            state.fetch = Arc::new(FileFetch::new(Some(data)));
            state.files = Some(files);
            state.noted();
            state
        }
    }

    /// What the record on disk claims.
    fn on_disk(state: &FileState) -> (bool, u64) {
        let meta = &state.files.as_ref().unwrap().meta;
        let rec = read_record_unchecked(meta).unwrap().unwrap().unwrap();
        (rec.dirty, rec.present_count())
    }

    /// The group commit's sync of the data file.
    fn sync(state: &FileState) {
        state.files.as_ref().unwrap().data.sync_data().unwrap();
    }

    fn fill(state: &mut FileState, c: u64) {
        let files = state.files.as_ref().unwrap();
        files
            .data
            .write_all_at(&vec![c as u8 + 1; CHUNK as usize], c * CHUNK)
            .unwrap();
        state.filled(c);
        state.noted();
    }

    #[test]
    fn a_commit_claims_what_was_filled_before_its_ticket() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        s.defer_checkpoint();
        assert!(s.needs_checkpoint());
        assert_eq!(on_disk(&s), (false, 0), "nothing claimed before the commit");
        let ticket = s.commit_ticket().expect("waits for a commit");
        sync(&s);
        assert_eq!(s.commit_synced(&env, ticket), Stamped::Clean);
        assert_eq!(on_disk(&s), (false, 1));
        assert!(!s.needs_checkpoint());
        assert_eq!(s.commit_ticket(), None);
    }

    #[test]
    fn a_change_after_the_ticket_stops_the_commit() {
        let f = Fixture::new();
        let env = f.env();
        // A chunk filled between the ticket and the sync's end.
        let mut s = f.state("filled");
        fill(&mut s, 0);
        s.defer_checkpoint();
        let ticket = s.commit_ticket().unwrap();
        fill(&mut s, 1);
        sync(&s);
        assert_ne!(s.commit_synced(&env, ticket), Stamped::Clean);
        assert_eq!(on_disk(&s), (false, 0));
        // A write through the mount: the record on disk is dirty, and stays so.
        let mut s = f.state("written");
        fill(&mut s, 0);
        s.checkpoint(&env);
        assert_eq!(on_disk(&s), (false, 1));
        fill(&mut s, 1);
        s.defer_checkpoint();
        let ticket = s.commit_ticket().unwrap();
        s.mark_written(&env);
        // (A dirty record is discarded at load, whatever it claims.)
        assert!(on_disk(&s).0, "marked dirty");
        assert_ne!(s.commit_synced(&env, ticket), Stamped::Clean);
        assert!(on_disk(&s).0, "still dirty");
        // A later checkpoint settles both.
        s.checkpoint(&env);
        assert_eq!(on_disk(&s), (false, 2));
        assert!(!s.needs_checkpoint());
    }

    #[test]
    fn only_a_write_over_claimed_bytes_waits_for_a_durable_dirty_mark() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        s.checkpoint(&env);
        assert_eq!(on_disk(&s), (false, 1));
        // An append, then a write into the chunk nobody claims: dirty, not synced.
        s.mark_write(&env, 2 * CHUNK, 10);
        assert_eq!(on_disk(&s), (true, 1), "marked dirty");
        assert!(!s.durably_dirty);
        s.mark_write(&env, CHUNK, CHUNK);
        assert!(!s.durably_dirty);
        // The last claimed byte: synced before the write.
        s.mark_write(&env, CHUNK - 1, 1);
        assert!(s.durably_dirty);
        assert!(on_disk(&s).0);
        s.checkpoint(&env);
        assert_eq!(on_disk(&s), (false, 1));
        assert!(!s.durably_dirty, "a checkpoint ends the session's mark");
        // A truncation may cut claimed bytes: synced at once.
        s.mark_written(&env);
        assert!(s.durably_dirty);
        // Nothing claimed: no write waits.
        let mut s = f.state("empty");
        s.mark_write(&env, 0, 2 * CHUNK);
        s.mark_written(&env);
        assert!(!s.durably_dirty);
        assert_eq!(on_disk(&s), (true, 0));
    }

    /// The stress test's panic: a setattr's own version taken while another handle's
    /// write (source done, cache copy waiting for the lock) had grown the file left the
    /// record's identity bigger than its bitmap.
    #[test]
    fn an_own_version_of_another_size_is_left_to_the_write_that_makes_it() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        s.checkpoint(&env);
        let before = s.record().identity;
        s.own_version(SourceIdentity {
            size: before.size + 10 * CHUNK,
            mtime: (before.mtime.0 + 1, 0),
            ..before
        });
        assert_eq!(s.record().identity, before, "kept as it was");
        // Whatever asks about the chunks then stays within the bitmap.
        assert!(s.claims_any(0, 20 * CHUNK));
        let same_size = SourceIdentity {
            mtime: (before.mtime.0 + 1, 0),
            ..before
        };
        s.own_version(same_size);
        assert_eq!(
            s.record().identity,
            same_size,
            "a stamp of the same size is taken"
        );
    }

    #[test]
    fn a_record_rewritten_while_a_commit_waits_claims_nothing_unsynced() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        s.defer_checkpoint();
        // A rewrite of the record (a new identity, a last use) while the fill waits: it
        // takes a checkpoint first, never writes the claim alone.
        s.record.last_used = 42;
        s.persist_record(&env, false);
        assert_eq!(on_disk(&s), (false, 1));
        assert!(!s.needs_checkpoint());
        let synced = f
            .stats
            .checkpoints
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(synced, 1);
    }

    #[test]
    fn a_data_file_edited_while_a_commit_waits_is_not_claimed() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        fill(&mut s, 1);
        s.defer_checkpoint();
        let ticket = s.commit_ticket().unwrap();
        // ctime ticks are coarse: the edit must land in a later one.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let files = s.files.as_ref().unwrap();
        files.data.write_all_at(b"MORE", 2 * CHUNK).unwrap();
        sync(&s);
        assert!(!s.data_is_ours());
        let meta = s.files.as_ref().unwrap().meta.try_clone().unwrap();
        // As the group commit does (`commit_batch`): discarded, never claimed.
        s.discard_foreign_data(&env);
        assert_ne!(s.commit_synced(&env, ticket), Stamped::Clean);
        let rec = read_record_unchecked(&meta).unwrap().unwrap().unwrap();
        assert_eq!((rec.dirty, rec.present_count()), (false, 0));
        assert!(
            s.files.is_none(),
            "a data file of the wrong length is not used again (never resized in place)"
        );
    }

    #[test]
    fn a_data_file_the_kernel_reads_for_passthrough_is_never_refetched_into() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        fill(&mut s, 1);
        s.checkpoint(&env);
        s.passthrough_opens = 1;
        // An edit of the right length, in a later ctime tick.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let files = s.files.as_ref().unwrap();
        files.data.write_all_at(b"EDIT", 0).unwrap();
        assert!(!s.data_is_ours());
        let meta = files.meta.try_clone().unwrap();
        s.discard_foreign_data(&env);
        let rec = read_record_unchecked(&meta).unwrap().unwrap().unwrap();
        assert_eq!(rec.present_count(), 0, "nothing of it is claimed");
        assert!(
            s.files.is_none(),
            "with passthrough readers the data file is left to them, never fetched into"
        );
        // Without passthrough readers the same data file is refetched into.
        let mut s = f.state("b");
        fill(&mut s, 0);
        s.checkpoint(&env);
        std::thread::sleep(std::time::Duration::from_millis(20));
        s.files
            .as_ref()
            .unwrap()
            .data
            .write_all_at(b"EDIT", 0)
            .unwrap();
        s.discard_foreign_data(&env);
        assert!(s.files.is_some());
        assert!(s.data_is_ours(), "from here the file is hoardfs's");
    }

    /// The identity of the two-chunk file of `Fixture::state` at another size.
    fn sized(state: &FileState, size: u64) -> SourceIdentity {
        SourceIdentity {
            size,
            ..state.record.identity
        }
    }

    #[test]
    fn a_write_through_claims_the_chunks_it_covers_wholly_and_only_after_a_checkpoint() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        s.mark_written(&env);
        // The whole of chunk 0 and the start of chunk 1.
        let data = vec![7u8; CHUNK as usize + 10];
        s.wrote_through(&env, 0, &data, sized(&s, 2 * CHUNK));
        assert!(s.record.is_present(0) && !s.record.is_present(1));
        let mut back = vec![0u8; data.len()];
        s.files
            .as_ref()
            .unwrap()
            .data
            .read_exact_at(&mut back, 0)
            .unwrap();
        assert_eq!(back, data);
        assert_eq!(on_disk(&s), (true, 0), "dirty on disk until the checkpoint");
        s.checkpoint(&env);
        assert_eq!(on_disk(&s), (false, 1));
        // A write past the end that the source's size confirms: the last chunk, partial,
        // holds every byte of the file there is.
        s.mark_written(&env);
        s.wrote_through(&env, 2 * CHUNK, b"tail", sized(&s, 2 * CHUNK + 4));
        assert!(s.record.is_present(2), "the new last chunk");
        assert_eq!(s.record.identity.size, 2 * CHUNK + 4);
    }

    #[test]
    fn a_write_whose_source_size_shows_another_change_keeps_nothing() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        fill(&mut s, 1);
        s.checkpoint(&env);
        s.mark_written(&env);
        // Someone else extended the file meanwhile: the source is longer than this write
        // explains, and the bytes between are nobody's known.
        s.wrote_through(&env, 0, b"x", sized(&s, 5 * CHUNK));
        assert_eq!(s.record.present_count(), 0);
        assert_eq!(
            on_disk(&s),
            (false, 0),
            "the empty record went to disk first"
        );
        assert_eq!(s.record.identity.size, 5 * CHUNK);
        let len = s.files.as_ref().unwrap().data.metadata().unwrap().len();
        assert_eq!(len, 5 * CHUNK, "a data file of the source's size");
    }

    #[test]
    fn a_truncation_cuts_the_data_file_or_keeps_nothing() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        fill(&mut s, 1);
        s.checkpoint(&env);
        s.mark_written(&env);
        s.truncated(&env, CHUNK, Some(sized(&s, CHUNK)));
        assert_eq!((s.record.nchunks(), s.record.present_count()), (1, 1));
        let len = s.files.as_ref().unwrap().data.metadata().unwrap().len();
        assert_eq!(len, CHUNK);
        s.checkpoint(&env);
        assert_eq!(on_disk(&s), (false, 1));
        // The source did not end up at the size asked for: nothing is kept.
        s.mark_written(&env);
        s.truncated(&env, 10, Some(sized(&s, 20)));
        assert_eq!(s.record.present_count(), 0);
        assert_eq!(on_disk(&s), (false, 0));
    }

    #[test]
    fn an_fallocate_that_shifts_bytes_keeps_nothing() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        fill(&mut s, 1);
        s.checkpoint(&env);
        s.mark_written(&env);
        // Preallocation past the end keeps every byte where it was.
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        s.fallocated(true, keep, 0, 4 * CHUNK, Some(sized(&s, 2 * CHUNK)));
        assert_eq!(s.record.present_count(), 2);
        // A collapse moves the source's bytes: the cache keeps none.
        let collapse = libc::FALLOC_FL_COLLAPSE_RANGE;
        s.fallocated(true, collapse, 0, CHUNK, Some(sized(&s, CHUNK)));
        assert_eq!(
            (s.record.identity.size, s.record.present_count()),
            (CHUNK, 0)
        );
        assert_eq!(on_disk(&s), (false, 0));
    }

    #[test]
    fn a_new_entry_is_empty_on_disk_before_it_is_used() {
        let f = Fixture::new();
        let env = f.env();
        let files = f.cache.open_files(Path::new("new")).unwrap();
        files.data.write_all_at(b"left over", 0).unwrap();
        let mut s = FileState::new(CacheRecord::empty(SourceIdentity::default(), CHUNK));
        s.attach_empty(files, true).unwrap();
        assert_eq!(s.files.as_ref().unwrap().data.metadata().unwrap().len(), 0);
        assert_eq!(on_disk(&s), (false, 0));
        assert!(s.complete(), "an empty file is whole");
        assert!(s.data_is_ours());
        s.mark_written(&env);
        assert!(on_disk(&s).0);
    }

    #[test]
    fn a_closed_entry_is_restamped_only_as_its_change_says() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        s.checkpoint(&env);
        let files = f.cache.open_existing(Path::new("a")).unwrap();
        let declined = closed::restamp(&files, false, |rec| {
            rec.identity.mtime = (99, 0);
            false
        });
        assert!(!declined.unwrap());
        let read = |files: &CacheFiles| {
            crate::cache::store::read_record(files)
                .unwrap()
                .unwrap()
                .unwrap()
        };
        assert_eq!(
            read(&files).identity.mtime,
            (1, 0),
            "a declined change writes nothing"
        );
        let done = closed::restamp(&files, true, |rec| {
            rec.identity.mtime = (99, 0);
            true
        });
        assert!(done.unwrap());
        let rec = read(&files);
        assert_eq!((rec.identity.mtime, rec.present_count()), ((99, 0), 1));
    }

    #[test]
    fn an_evicted_chunk_is_no_longer_claimed_and_the_rest_still_is() {
        let f = Fixture::new();
        let env = f.env();
        let mut s = f.state("a");
        fill(&mut s, 0);
        fill(&mut s, 1);
        s.checkpoint(&env);
        drop(s);
        let freed = closed::evict_chunks(&f.cache, Path::new("a"), &[0]);
        assert_eq!(freed, CHUNK);
        let files = f.cache.open_existing(Path::new("a")).unwrap();
        // Whole and checked against its data file (punching moved the data's ctime).
        let rec = crate::cache::store::read_record(&files)
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(!rec.is_present(0) && rec.is_present(1));
        let mut chunk = vec![1u8; CHUNK as usize];
        files.data.read_exact_at(&mut chunk, 0).unwrap();
        assert!(chunk.iter().all(|&b| b == 0), "punched out");
        files.data.read_exact_at(&mut chunk, CHUNK).unwrap();
        assert!(chunk.iter().all(|&b| b == 2), "chunk 1 kept");
        // The last claimed chunk takes the entry with it.
        assert_eq!(closed::evict_chunks(&f.cache, Path::new("a"), &[1]), CHUNK);
        assert!(f.cache.open_existing(Path::new("a")).is_none());
    }
}

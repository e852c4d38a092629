//! A regular file's cache state (`FileState`, `entry.rs`) as the file system handles it:
//! loaded from its record and checked against the source, reset for a new version or kept
//! for the handles open on the old one, unloaded; and chunks fetched under its mutex.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{CachingFs, FileState, Inode};
use crate::cache::store::read_record;
use crate::cache::{CacheRecord, SourceIdentity};
use crate::coherence::Notice;
use crate::source::Stat;
use crate::stats::Stats;

/// What the stat given to `CachingFs::load_state` stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Look {
    /// The file was just created by the mount: any old cache entry under its name is
    /// dropped.
    Created,
    /// A look at the source.
    Source,
    /// The version an open lease vouches for (`--open-lease`): a racy record of it is
    /// served as it is for the lease's length; an open that looks again compares it.
    Leased,
}

impl CachingFs {
    /// Drops the cache state of a file nobody has open any more.
    pub(super) fn unload(&self, inode: &Inode, guard: &mut Option<Box<FileState>>) {
        if let Some(state) = guard.as_ref() {
            state.fetch.kill();
        }
        *guard = None;
        inode.former.lock().unwrap().clear();
        self.loaded.lock().unwrap().remove(&inode.id);
    }

    /// A state with nothing cached and no descriptors.
    pub(super) fn empty_state(&self, identity: SourceIdentity) -> FileState {
        FileState::new(CacheRecord::empty(identity, self.cfg.chunk_size))
    }

    /// Loads the cache state of `path` from its record, checking it against `st` (what
    /// `look` says it is). Returns the state and whether cached data was discarded.
    pub(super) fn load_state(
        &self,
        inode: &Arc<Inode>,
        path: &Path,
        st: &mut Stat,
        look: Look,
    ) -> (FileState, bool) {
        {
            // An eviction under way ends first; later ones skip the file, loaded from now
            // on. Not held further: the source calls below must not hold up every other
            // file's load behind a waiting eviction.
            let _no_eviction = self.evict_lock.read().unwrap();
            self.loaded.lock().unwrap().insert(inode.id, inode.clone());
        }
        let mut identity = self.identity(st);
        let mut state = self.empty_state(identity);
        let files = match self.cache.open_files(path) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(?path, "cache unusable for this file: {e}");
                Stats::add(&self.stats.cache.cache_errors, 1);
                return (state, true);
            }
        };
        let data_len = files.data.metadata().map(|m| m.len()).ok();
        let mut valid = None;
        // Without a record nothing of this file can be served after a crash, so its first
        // empty record need not be durable (one fsync less per newly cached file).
        let mut had_record = true;
        match read_record(&files) {
            Ok(Some(Ok(mut rec))) if look != Look::Created => {
                // `st` was taken before the caller's lock: a writer that closed since then
                // left a record of a newer version. Looked at again (only on a mismatch).
                if !rec.dirty
                    && !rec.identity.same_version(&identity)
                    && let Ok(now) = self.source.stat(path)
                    && (now.dev, now.ino) == (st.dev, st.ino)
                {
                    *st = now;
                    identity = self.identity(st);
                }
                let matches = !rec.dirty
                    && data_len == Some(rec.identity.size)
                    && (rec.identity == identity
                        || (look == Look::Leased && rec.identity.same_version(&identity))
                        || !self.stale_check()
                        || self.racy_record_still_holds(path, None, &files, &mut rec, st));
                if matches {
                    valid = Some(rec);
                } else {
                    Stats::add(&self.stats.cache.stale_invalidations, 1);
                }
            }
            Ok(Some(Err(crate::cache::record::RecordError::OtherDataFile))) => {
                // The entry is being refilled by another open of an older or newer version
                // (a file replaced behind the mount), not damaged: discarded quietly.
                tracing::debug!(?path, "cache record of another data file");
                Stats::add(&self.stats.cache.stale_invalidations, 1);
            }
            Ok(Some(Err(crate::cache::record::RecordError::DataChanged)))
                if crate::cache::store::read_record_unchecked(&files.meta).is_ok_and(|r| {
                    matches!(r, Some(Ok(r))
                        if r.present_count() == 0 || !r.identity.same_version(&identity))
                }) =>
            {
                // A record that claims nothing, or one of another version than this file's
                // (a file replaced behind the mount, whose old node still fetches into the
                // entry's data file until this load gives the entry a new one): the data
                // file is being fetched into, not damaged, and the record is stale anyway.
                tracing::debug!(?path, "cache record of a data file being filled");
                Stats::add(&self.stats.cache.stale_invalidations, 1);
            }
            Ok(Some(Err(e))) => {
                tracing::warn!(?path, "discarding cache record: {e}");
                Stats::add(&self.stats.cache.corrupt_records, 1);
            }
            Ok(None) => {
                had_record = false;
                self.usage.file_added();
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(?path, "cannot read cache record: {e}");
                Stats::add(&self.stats.cache.cache_errors, 1);
            }
        }
        let reset = valid.is_none();
        state.attach(files, valid);
        if reset {
            // A file just created included: with no record before it, no crash can pair
            // its data file with a record that claims bytes (a later write marks the
            // record dirty durably, `mark_written`).
            state.reset_as(
                &self.env(),
                self.fetched_identity(st),
                had_record,
                Some(path),
            );
        }
        state.used_now();
        state.loaded_stat = Some(*st);
        (state, reset)
    }

    /// The source changed behind the mount while the file was open (and its handles
    /// cannot keep their version, `keep_version`): the cache follows the new version.
    pub(super) fn stale(&self, state: &mut FileState, st: &Stat, path: Option<&Path>) {
        Stats::add(&self.stats.cache.stale_invalidations, 1);
        self.reset(state, st, path);
    }

    /// Empties the cache of a file for a new source version. The record is rewritten
    /// first (durably), so no crash can pair old bytes with the new version.
    pub(super) fn reset(&self, state: &mut FileState, st: &Stat, path: Option<&Path>) {
        state.reset_as(&self.env(), self.fetched_identity(st), true, path);
    }

    /// The name of `inode` if it still leads to the inode's own source file: its cache entry
    /// is this file's. A name that leads to another file now (replaced behind the mount)
    /// has that file's cache entry, which this inode must not touch.
    pub(super) fn own_path(&self, inode: &Inode) -> Option<PathBuf> {
        let path = inode.path()?;
        let st = self.source.stat(&path).ok()?;
        (inode.is_same_file(&st) || !self.stable_ino).then_some(path)
    }

    /// The source changed behind the mount while `inode` is open with its whole old version
    /// in the cache: the open handles keep that version (the session semantics of AFS and
    /// Coda), and the name gets a new entry for everything else. On disk the cache entry
    /// passes to the new version (an empty record and a new data file), while this state
    /// keeps the old data file through its descriptor and writes its record where nobody
    /// reads it. The inode is retired: lookups make a new one (a new kernel node, whose
    /// opens may use passthrough to the new data file: the kernel allows one backing file
    /// per node), and the kernel is asked to drop the name. Returns false, changing nothing,
    /// where the handles cannot keep their version (it is not whole in the cache, or writes
    /// through the mount are under way); the caller then resets the cache in place.
    pub(super) fn keep_version(
        &self,
        inode: &Arc<Inode>,
        state: &mut FileState,
        st: &Stat,
    ) -> bool {
        let opens = state.daemon_opens() + state.passthrough_opens();
        if opens == 0
            || state.writers() > 0
            || !state.complete()
            || state.written()
            || state.record().dirty
            || state.offline_base.is_some()
        {
            return false;
        }
        let path = self.own_path(inode);
        let new_version = CacheRecord::empty(self.fetched_identity(st), self.cfg.chunk_size);
        let new_entry = path.as_deref().map(|p| (p, &new_version));
        if let Err(e) = state.keep_apart(&self.env(), new_entry) {
            tracing::warn!("cannot keep an old version apart: {e}");
            return false;
        }
        inode.retire();
        Stats::add(&self.stats.cache.versions_kept, 1);
        if let Some(name) = path.as_deref().and_then(Path::file_name) {
            self.coherence
                .notify(Notice::Entry(inode.parent(), name.to_os_string()));
        }
        true
    }

    /// Fetches chunk `c` from the source into the cache file.
    fn fetch_chunk(&self, state: &mut FileState, c: u64) -> io::Result<()> {
        let cs = state.record().chunk_size;
        let size = state.record().identity.size;
        let off = c * cs;
        let len = cs.min(size - off) as usize;
        if !self.usage.may_grow(len as u64) {
            // The cache is full until the cleaner catches up: serve from the source.
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let src = state
            .fetch_src
            .as_ref()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))?;
        let buf = self.source.read_at(&src.reader, len, off)?;
        let n = buf.len();
        Stats::add(&self.stats.cache.bytes_from_source, n as u64);
        if n < len {
            // The source is shorter than the version we cache: it changed under us.
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        state.fill(&self.env(), c, &buf)?;
        Stats::add(&self.stats.cache.chunks_fetched, 1);
        if state.unsynced_fills() >= self.cfg.checkpoint_chunks || state.record().is_complete() {
            state.checkpoint(&self.env());
        }
        Ok(())
    }

    pub(super) fn fetch_all(&self, state: &mut FileState) {
        for c in 0..state.record().nchunks() {
            if state.files().is_none() {
                return;
            }
            if !state.record().is_present(c)
                && let Err(e) = self.fetch_chunk(state, c)
            {
                tracing::debug!("whole-file fetch stopped: {e}");
                return;
            }
        }
    }
}

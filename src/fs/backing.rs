//! Which file backs a reader's passthrough open: the cache file of a file cached whole,
//! or, with `--source-reads`, the source file of a large one not cached yet
//! (`fs/source_reads.rs`). The kernel gives all passthrough opens of one node one backing
//! file (`fuse_inode_uncached_io_start` refuses another with `EBUSY`): an open takes the
//! node's live backing when there is one, whichever file it is.

use std::fs::File;
use std::io;
use std::sync::Arc;

use fuser::BackingId;

use super::{CachingFs, FileState};
use crate::source::SourceReader;
use crate::stats::Stats;

impl CachingFs {
    /// The backing of a reader's open of `state`, counted, or `None`: the daemon serves it.
    /// `make_backing` registers a file with the kernel.
    pub(super) fn passthrough_backing(
        &self,
        state: &mut FileState,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Option<Arc<BackingId>> {
        let b = self
            .writers_backing(state)
            .or_else(|| self.cache_backing(state, make_backing))
            .or_else(|| self.source_backing(state, make_backing))?;
        let c = &self.stats.cache;
        let counter = if state.backing_is_source {
            &c.source_read_opens
        } else {
            &c.passthrough_opens
        };
        Stats::add(counter, 1);
        Some(b)
    }

    /// The node's live backing while writers write the source by passthrough
    /// (`fs/source_writes.rs`): a reader beside them reads the source, as the kernel gives
    /// all passthrough opens of a node one backing.
    pub(super) fn writers_backing(&self, state: &FileState) -> Option<Arc<BackingId>> {
        state
            .backing_writable
            .then(|| state.backing.upgrade())
            .flatten()
    }

    /// Passthrough to the cache file when the file is whole in the cache and nobody has it
    /// open through the daemon (the kernel takes no passthrough open beside such handles).
    fn cache_backing(
        &self,
        state: &mut FileState,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Option<Arc<BackingId>> {
        if !state.complete() || state.daemon_opens() > 0 || !self.passthrough_enabled() {
            return None;
        }
        if let Some(live) = state.backing.upgrade() {
            return Some(live);
        }
        match make_backing(&state.files()?.data) {
            Ok(b) => Some(live_backing(state, b, false)),
            Err(e) => {
                tracing::warn!("passthrough unavailable ({e}); reads go through the daemon");
                self.disable_passthrough();
                None
            }
        }
    }

    /// Passthrough to the source file (`--source-reads`): the node's live backing if it is
    /// the source's, else one made of the fetch descriptor (the source file, checked at its
    /// open to be the version `state` caches). `None` where the file is small (fetched
    /// whole at open, `fs/fetch/whole.rs`) or whole in the cache, the daemon serves handles
    /// of it, or its live backing is the cache file.
    fn source_backing(
        &self,
        state: &mut FileState,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Option<Arc<BackingId>> {
        if !self.source_reads()
            || state.complete()
            || state.daemon_opens() > 0
            || state.record().identity.size <= self.cfg.whole_file_threshold
        {
            return None;
        }
        if let Some(live) = state.backing.upgrade() {
            return state.backing_is_source.then_some(live);
        }
        let src = state.fetch_src.clone()?;
        let SourceReader::File(file) = &src.reader else {
            return None;
        };
        match make_backing(file) {
            Ok(b) => Some(live_backing(state, b, true)),
            Err(e) => {
                tracing::debug!(
                    "no passthrough to the source file ({e}); reads go through the daemon"
                );
                None
            }
        }
    }
}

/// `b`, now the node's live backing (of the source file, or of the cache file).
fn live_backing(state: &mut FileState, b: BackingId, of_source: bool) -> Arc<BackingId> {
    let b = Arc::new(b);
    state.backing = Arc::downgrade(&b);
    state.backing_is_source = of_source;
    state.backing_writable = false;
    b
}

//! Source reads (`--source-reads`): a large file not yet cached is read by the kernel
//! straight from the source file, by FUSE passthrough to it, instead of through the
//! daemon, which would copy each byte three more times (into its buffer, into the cache
//! file, into the reply; `docs/performance.md`, "Session 28"). A cold sequential read then
//! runs at the source's speed.
//!
//! The daemon sees none of those reads, so the cache is filled after them: when such a
//! handle closes, the chunks still absent are copied from what the source holds in its page
//! cache (a chunk only if `cachestat(2)` finds every page of it there, `source::resident`,
//! when it is queued and again when it is read), in order, by one fetch worker
//! (`fs/fetch/behind.rs`). What the
//! reader read (and the kernel read ahead for it) is there, and nothing is read from the
//! source's disk a second time; a chunk not wholly in memory stays absent, fetched by a
//! later read that needs it. Fills go through the fetch engine's flights, so their checks
//! and durability are those of any fill (crash rule 1, epochs, the group commit).
//!
//! Only where the source has no source timeout (local sources): a passthrough read of a
//! hung source waits in the kernel, where no timeout of the daemon reaches it. The kernel
//! gives all passthrough opens of one node one backing file (`fuse_inode_uncached_io_start`
//! refuses another with `EBUSY`), so while a source read is open, every reader of the node
//! reads the source, even once the cache is whole.

use std::sync::Arc;

use super::{CachingFs, FileState, Inode};
use crate::fetch::{End, Flight};
use crate::fetch_pool::BehindJob;
use crate::source::{SourceReader, cached_pages, resident};
use crate::stats::Stats;

/// Chunks one close queues at most (64 GiB of 1 MiB chunks): each waits as a flight.
const MAX_BEHIND: usize = 65_536;

impl CachingFs {
    /// Whether source reads are on and possible now.
    pub(super) fn source_reads(&self) -> bool {
        self.cfg.source_reads
            && self.passthrough_enabled()
            && !self.kernel_opens()
            && self.source.health.timeout().is_none()
    }

    /// A handle that read the source closed: the chunks still absent that the source holds
    /// wholly in memory now are queued to be copied from there (see the module's comment);
    /// the others are left. The flights keep the state loaded until the job has gone
    /// through them.
    pub(super) fn fill_behind(&self, inode: &Arc<Inode>, state: &mut FileState) {
        if state.complete() || state.files().is_none() {
            return;
        }
        let Some(src) = state.fetch_src.clone() else {
            return;
        };
        let SourceReader::File(file) = &src.reader else {
            return;
        };
        let ff = state.fetch.clone();
        let epoch = ff.epoch();
        let cs = state.record().chunk_size;
        let size = state.record().identity.size;
        // Nothing of the file in memory (pages gone, or a read stopped at once): no chunk
        // to look at one by one.
        let some_resident = cached_pages(file, 0, size).is_some_and(|n| n > 0);
        let mut flights = Vec::new();
        let mut left = 0;
        {
            let mut in_flight = ff.flights.lock().unwrap();
            for c in 0..state.record().nchunks() {
                if state.record().is_present(c) || in_flight.contains_key(&c) {
                    continue;
                }
                let len = cs.min(size - c * cs);
                // (One `cachestat` a chunk, a few microseconds: no I/O under the lock.)
                if !some_resident || flights.len() >= MAX_BEHIND || !resident(file, c * cs, len) {
                    left += 1;
                    continue;
                }
                if !self.usage.may_grow(len) {
                    break;
                }
                let f = Arc::new(
                    Flight::new(c, epoch, c * cs, len, false)
                        .with_piece(self.piece_size(cs))
                        .reserving(&self.usage)
                        .resident_only(),
                );
                in_flight.insert(c, f.clone());
                flights.push(f);
            }
        }
        Stats::add(&self.stats.cache.chunks_left_behind, left);
        if flights.is_empty() {
            return;
        }
        let job = BehindJob {
            inode: inode.clone(),
            ff,
            flights,
            src,
        };
        if let Err(job) = self.fetcher.try_queue_behind(job) {
            // No worker, or no room in the in-flight budget: nothing is filled now, and
            // no flight may be left that nobody works on.
            for f in &job.flights {
                job.ff.remove(f);
                f.finish(End::Aborted);
            }
        }
    }
}

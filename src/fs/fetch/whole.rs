//! The whole-file fetch on first open of a small file: its flights queued for the workers,
//! then helped and waited for by the opener.

use std::sync::Arc;

use super::Ctx;
use crate::fetch::{FileFetch, Flight, SourceFd};
use crate::fetch_pool::Job;
use crate::fs::{CachingFs, FileState, Inode};
use crate::stats::Stats;

/// The flights of a whole-file fetch an open waits for.
pub(in crate::fs) struct WholeFetch {
    ff: Arc<FileFetch>,
    src: Arc<SourceFd>,
    flights: Vec<Arc<Flight>>,
}

impl CachingFs {
    /// Small files are fetched whole on first open (xCachefs' threshold): every absent
    /// chunk gets a flight (or joins the one in progress, so the file is fetched once however
    /// many open it at once), queued for the workers; the opener then helps and waits
    /// (`finish_whole_fetch`) without the state mutex.
    pub(in crate::fs) fn start_whole_fetch(
        &self,
        inode: &Arc<Inode>,
        state: &mut FileState,
    ) -> Option<WholeFetch> {
        let src = state.fetch_src.clone()?;
        state.files()?;
        let ff = state.fetch.clone();
        let epoch = ff.epoch();
        let cs = state.record().chunk_size;
        let size = state.record().identity.size;
        let mut flights = ff.flights.lock().unwrap();
        let mut started = false;
        let mut all = Vec::new();
        for c in 0..state.record().nchunks() {
            if state.record().is_present(c) {
                continue;
            }
            if let Some(f) = flights.get(&c) {
                all.push(f.clone());
                continue;
            }
            let len = cs.min(size - c * cs);
            if !self.usage.may_grow(len) {
                break;
            }
            let f = Arc::new(
                Flight::new(c, epoch, c * cs, len, false)
                    .with_piece(self.piece_size(cs))
                    .reserving(&self.usage),
            );
            flights.insert(c, f.clone());
            all.push(f.clone());
            started = true;
            let job = Job {
                inode: inode.clone(),
                ff: ff.clone(),
                flight: f,
                src: src.clone(),
            };
            // No worker or no budget: the opener fetches it.
            let _ = self.fetcher.try_queue(job, false);
        }
        if started {
            Stats::add(&self.stats.cache.whole_file_fetches, 1);
        }
        drop(flights);
        (!all.is_empty()).then_some(WholeFetch {
            ff,
            src,
            flights: all,
        })
    }

    /// Fetches what nobody fetches yet of a whole-file fetch, then waits for the rest.
    pub(in crate::fs) fn finish_whole_fetch(&self, inode: &Arc<Inode>, whole: &WholeFetch) {
        let ctx = Ctx {
            inode,
            ff: &whole.ff,
            src: &whole.src,
        };
        let mut waited = false;
        for wait in [false, true] {
            for f in &whole.flights {
                self.work(&ctx, f, 0..f.npieces(), wait, &mut waited);
            }
        }
    }
}

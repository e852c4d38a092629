//! What the cleaner (`cleaner.rs`) may evict and how: whole cache entries, or some chunks of
//! a file, never of a file that is open or changed offline and not yet replayed.

use std::path::Path;

use super::CachingFs;
use crate::cleaner::EvictTarget;

impl EvictTarget for CachingFs {
    fn settle(&self) {
        self.commit_now();
    }

    fn evict(&self, rel: &Path, chunks: Option<&[u64]>) -> u64 {
        let _exclusive = self.evict_lock.write().unwrap();
        // Open by name, or by a name it had while open (an open file whose name was taken
        // by a new file behind the mount: its data file may still be the entry's, and its
        // handles read it; punched chunks would read as zeros).
        let open = self.loaded.lock().unwrap().values().any(|i| {
            i.names.lock().unwrap().iter().any(|n| n == rel)
                || i.former.lock().unwrap().iter().any(|n| n == rel)
        });
        if open {
            return 0;
        }
        // Changed offline and not yet replayed: the offline view needs it (the log has
        // its content anyway). While a replay holds the log, nothing is evicted.
        if self.oplog.try_lock().map_or(true, |log| log.touches(rel)) {
            return 0;
        }
        if let Some(chunks) = chunks {
            return super::entry::closed::evict_chunks(&self.cache, rel, chunks);
        }
        let bytes = self.cache.data_bytes(rel);
        // The record goes first: without it the data is never served.
        match self.cache.remove(rel) {
            Ok(()) => bytes,
            Err(e) => {
                tracing::warn!(?rel, "cannot evict: {e}");
                0
            }
        }
    }

    fn cache_fs_free(&self) -> u64 {
        self.cache.fs_free().unwrap_or(u64::MAX)
    }
}

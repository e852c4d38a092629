//! What the cleaner (`cleaner.rs`) may evict and how: whole cache entries, or some chunks of
//! a file, never of a file that is open or changed offline and not yet replayed.

use std::path::Path;

use super::CachingFs;
use crate::cache::store::{read_record, write_record};
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
            return self.evict_chunks(rel, chunks);
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

impl CachingFs {
    /// Drops some chunks of a file nobody has open (caller holds `evict_lock` for writing):
    /// the record stops claiming them (durably) before their bytes are punched out.
    fn evict_chunks(&self, rel: &Path, chunks: &[u64]) -> u64 {
        let Some(files) = self.cache.open_existing(rel) else {
            return 0;
        };
        let Ok(Some(Ok(mut rec))) = read_record(&files) else {
            return 0;
        };
        let mut freed = 0;
        for &c in chunks {
            if !rec.is_present(c) {
                continue;
            }
            rec.set_present(c, false);
            freed += rec.chunk_size.min(rec.identity.size - c * rec.chunk_size);
        }
        if freed == 0 {
            return 0;
        }
        if rec.present_count() == 0 {
            // Nothing left: drop the entry entirely.
            let bytes = self.cache.data_bytes(rel);
            return self.cache.remove(rel).map(|_| bytes).unwrap_or(0);
        }
        if write_record(&files, &rec, true).is_err() {
            return 0;
        }
        for &c in chunks {
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            let off = (c * rec.chunk_size) as i64;
            // Without hole punching the bytes stay until the file is evicted or refetched;
            // the record no longer claims them either way.
            unsafe {
                libc::fallocate(
                    std::os::fd::AsRawFd::as_raw_fd(&files.data),
                    punch,
                    off,
                    rec.chunk_size as i64,
                )
            };
        }
        // Punching moved the data file's ctime: vouch for the punched file (a crash before
        // this only loses the file's cache, since the record no longer matches its data).
        let _ = write_record(&files, &rec, false);
        freed
    }
}

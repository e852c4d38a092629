//! The crash rules for cache entries that no open file has loaded: records rewritten in
//! place by a change the mount made (a new identity of the same bytes, new times) and
//! chunks evicted by the cleaner.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::cache::CacheRecord;
use crate::cache::store::{CacheFiles, CacheStore, read_record, write_record};

/// Rewrites the record of an entry that no open file has loaded: `change` edits it as
/// read (whole and checked, `read_record`) and says whether to write it (synced with
/// `durable`). The data file is not looked at: what `change` does must keep the record's
/// claims about it true. `Ok(false)`: no such record, or `change` declined.
pub(in crate::fs) fn restamp(
    files: &CacheFiles,
    durable: bool,
    change: impl FnOnce(&mut CacheRecord) -> bool,
) -> io::Result<bool> {
    let Ok(Some(Ok(mut rec))) = read_record(files) else {
        return Ok(false);
    };
    if !change(&mut rec) {
        return Ok(false);
    }
    write_record(files, &rec, durable)?;
    Ok(true)
}

/// Drops `chunks` of the entry at `rel`, which no open file has loaded (the caller keeps
/// loads out meanwhile): the record stops claiming them, durably, before their bytes are
/// punched out. Returns the bytes freed.
pub(in crate::fs) fn evict_chunks(cache: &CacheStore, rel: &Path, chunks: &[u64]) -> u64 {
    let Some(files) = cache.open_existing(rel) else {
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
        let bytes = cache.data_bytes(rel);
        return cache.remove(rel).map(|_| bytes).unwrap_or(0);
    }
    if write_record(&files, &rec, true).is_err() {
        return 0;
    }
    for &c in chunks {
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        let off = (c * rec.chunk_size) as i64;
        // Without hole punching the bytes stay until the file is evicted or refetched;
        // the record no longer claims them either way.
        // SAFETY: a plain syscall on a descriptor `files` owns.
        unsafe { libc::fallocate(files.data.as_raw_fd(), punch, off, rec.chunk_size as i64) };
    }
    // Punching moved the data file's ctime: vouch for the punched file (a crash before
    // this only loses the file's cache, since the record no longer matches its data).
    let _ = write_record(&files, &rec, false);
    freed
}

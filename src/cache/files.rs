//! The two open files of one cache entry (data and record) and the record's reads and
//! writes through them: checked against the data file on read, stamped with the data
//! file's identity on write, and not rewritten for a recent last use alone.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;

use super::record::{CacheRecord, DataIdentity};
use crate::source::{Stat, cvt, fstat};

/// The two open files of one cached source file.
#[derive(Debug)]
pub struct CacheFiles {
    pub data: File,
    pub meta: File,
    /// What this process last read from `meta` or wrote there.
    on_disk: Mutex<OnDisk>,
}

/// A record file as this process last read or wrote it through these files; `None` where
/// unknown (a write that failed leaves the file as nobody knows).
///
/// Its length is not remembered: another `CacheFiles` may write the same record file
/// meanwhile (two states of one path while a file replaced behind the mount is found,
/// the cleaner's edit of a closed entry), and a length remembered from before such a write
/// left its longer tail behind a shorter record (a checksum mismatch at the next read).
#[derive(Debug, Default)]
struct OnDisk {
    /// The record (`write_record_unless_same`).
    rec: Option<CacheRecord>,
}

impl CacheFiles {
    pub fn new(data: File, meta: File) -> CacheFiles {
        CacheFiles {
            data,
            meta,
            on_disk: Mutex::default(),
        }
    }

    /// Puts `meta` in place of the record file and returns the old one.
    pub fn replace_meta(&mut self, meta: File) -> File {
        *self.on_disk.get_mut().unwrap() = OnDisk::default();
        std::mem::replace(&mut self.meta, meta)
    }
}

/// How much older than a file's last use the one in its record on disk may be before the
/// file's last close rewrites the record for it alone: the cleaner's order needs no finer
/// time, and a file opened again and again (a header in a build) would otherwise rewrite
/// its record at each close, and so would every file of a read-only pass over a cache.
pub const LAST_USED_GRAIN_MS: u64 = 60_000;

/// Reads and checks a record. `Ok(None)` for an empty file (new entry); an error for a
/// record that is torn, corrupt or of another format, or whose data file is no longer the
/// one it was written for (edited, replaced or truncated behind hoardfs's back): the caller
/// discards the cache entry.
pub fn read_record(
    files: &CacheFiles,
) -> io::Result<Option<Result<CacheRecord, super::record::RecordError>>> {
    let rec = read_record_bytes(&files.meta)?;
    *files.on_disk.lock().unwrap() = OnDisk {
        rec: rec.as_ref().and_then(|r| r.as_ref().ok()).cloned(),
    };
    // A dirty record is discarded anyway (and its data file was being written).
    if let Some(Ok(r)) = rec.as_ref().filter(|r| matches!(r, Ok(r) if !r.dirty)) {
        let now = DataIdentity::of(&fstat(files.data.as_fd())?);
        if now.ino != r.data.ino {
            return Ok(Some(Err(super::record::RecordError::OtherDataFile)));
        }
        if now != r.data {
            return Ok(Some(Err(super::record::RecordError::DataChanged)));
        }
    }
    Ok(rec)
}

/// Reads and decodes a record without looking at its data file.
pub fn read_record_unchecked(
    meta: &File,
) -> io::Result<Option<Result<CacheRecord, super::record::RecordError>>> {
    read_record_bytes(meta)
}

type ReadRecord = Option<Result<CacheRecord, super::record::RecordError>>;

/// The record in `meta`, read by offset from its start: no seek, and no `statx` for a size
/// hint as `read_to_end` takes (records fit one page unless a file has many chunks). A
/// read of a regular file that returns less than asked has met its end: no second read
/// to hear so (one system call less on every load).
fn read_record_bytes(meta: &File) -> io::Result<ReadRecord> {
    let mut buf = vec![0; 4096];
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(len * 2, 0);
        }
        match meta.read_at(&mut buf[len..], len as u64) {
            Ok(0) => break,
            Ok(n) if len + n < buf.len() => {
                len += n;
                break;
            }
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if len == 0 {
        return Ok(None);
    }
    Ok(Some(CacheRecord::decode(&buf[..len])))
}

/// Overwrites the record in place; with `durable` it is on disk when this returns. A torn
/// in-place write is caught by the record's checksum. The record is stamped with the data
/// file's current identity: call it after every change hoardfs makes to the data file that
/// the record should vouch for. Returns the data file's attributes as stamped.
pub fn write_record(files: &CacheFiles, rec: &CacheRecord, durable: bool) -> io::Result<Stat> {
    let data = fstat(files.data.as_fd())?;
    if data.nlink == 0 {
        // The data file was replaced (a new version renamed over it, `replace_data`) or
        // removed: the entry is not this record's any more, and another state may own it.
        return Ok(data);
    }
    let mut rec = rec.clone();
    rec.data = DataIdentity::of(&data);
    let bytes = rec.encode();
    let new_len = bytes.len() as u64;
    let meta = &files.meta;
    let mut on_disk = files.on_disk.lock().unwrap();
    // Unknown while written: a failed write leaves the file as nobody knows.
    *on_disk = OnDisk::default();
    meta.write_all_at(&bytes, 0)?;
    // Cut only a longer record's tail: a truncation to the same length is no cheaper
    // than a stat on ext4 (and this runs at every write of a record).
    if fstat(meta.as_fd())?.size > new_len {
        meta.set_len(new_len)?;
    }
    if durable {
        meta.sync_data()?;
    }
    *on_disk = OnDisk { rec: Some(rec) };
    Ok(data)
}

/// `write_record` (not durable), unless the record on disk, as this process last read or
/// wrote it through `files`, is `rec` but for a last use less than `LAST_USED_GRAIN_MS`
/// older, and still vouches for the data file as it is. Returns whether it wrote.
pub fn write_record_unless_same(files: &CacheFiles, rec: &CacheRecord) -> io::Result<bool> {
    let data = DataIdentity::of(&fstat(files.data.as_fd())?);
    let same = files.on_disk.lock().unwrap().rec.as_ref().is_some_and(|d| {
        d.data == data
            && rec.last_used.saturating_sub(d.last_used) < LAST_USED_GRAIN_MS
            && CacheRecord {
                last_used: d.last_used,
                data,
                ..rec.clone()
            } == *d
    });
    if same {
        return Ok(false);
    }
    write_record(files, rec, false)?;
    Ok(true)
}

/// Whether the first page of `file` is in memory, so that a read of it would not wait for
/// the disk: a one-byte `preadv2` with `RWF_NOWAIT`, which fails (`EAGAIN`) rather than
/// wait. An empty file counts as in memory; a file system that cannot tell, as not. A miss
/// starts the file's read-ahead (as any read that misses does), which is what its callers
/// want next anyway.
pub fn first_page_resident(file: impl std::os::fd::AsFd) -> bool {
    let mut byte = [0u8; 1];
    let mut bufs = [std::io::IoSliceMut::new(&mut byte)];
    rustix::io::preadv2(file, &mut bufs, 0, rustix::io::ReadWriteFlags::NOWAIT).is_ok()
}

/// A file that belongs to no path: the record file of a cache state that no longer owns its
/// entry (an open file that keeps an old version), so that whatever that state writes to
/// its record vouches for nothing on disk.
pub fn scratch_file() -> io::Result<File> {
    let fd = unsafe { libc::memfd_create(c"hoardfs-retired".as_ptr(), libc::MFD_CLOEXEC) };
    let fd = cvt(fd)?;
    Ok(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

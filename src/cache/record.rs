//! The persistent record kept beside each cached file: which source version the cached bytes
//! belong to, which chunks are present, and when the file was last used.
//!
//! Format (little endian), versioned and self-checking so that a torn or foreign record is
//! detected and the file's cache discarded, never served:
//!
//! ```text
//! magic "HOARDREC" | format u32 | flags u32 | ino u64 | size u64
//! | mtime_s i64 | mtime_ns u32 | ctime_s i64 | ctime_ns u32
//! | chunk_size u64 | last_used_ms u64 | data_ino u64 | data_ctime_s i64 | data_ctime_ns u32
//! | nchunks u64 | bitmap ((nchunks+7)/8 bytes)
//! | chunk_used (nchunks x u32: minutes since the epoch of each chunk's last read) | crc32 u32
//! ```
//! The crc covers every byte before it.
//!
//! `data_*` is the identity of the cache's own data file when the record was written
//! (format 3): an edit of the data file behind hoardfs's back moves its ctime, which no
//! user can set, so the record no longer vouches for it (`store::read_record`).

use crate::source::Stat;

const MAGIC: &[u8; 8] = b"HOARDREC";
/// Bump whenever the layout changes; the golden-bytes test below forces it.
pub const FORMAT: u32 = 3;
const HEADER_LEN: usize = 8 + 4 + 4 + 8 + 8 + 8 + 4 + 8 + 4 + 8 + 8 + 8 + 4 + 8 + 8;

/// Set while writes are under way: the record's identity must not be trusted.
const FLAG_DIRTY: u32 = 1;
/// The identity was taken within the source's timestamp granularity of the file's mtime
/// (`SourceIdentity::racy`).
const FLAG_RACY: u32 = 2;

/// What identifies one version of a source file: if any of it changes, the cache is stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SourceIdentity {
    pub ino: u64,
    pub size: u64,
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    /// Taken so soon after the file's mtime that a rewrite within the same timestamp tick
    /// (same size, same mtime and ctime where the source's clock is coarse) would look
    /// the same: git's "racily clean". A racy identity never equals one made from a stat
    /// (`of` is never racy), so the version is checked again at the next open, when the
    /// tick is over. Stored as a record flag.
    pub racy: bool,
}

impl SourceIdentity {
    pub fn of(st: &Stat) -> SourceIdentity {
        SourceIdentity {
            ino: st.ino,
            size: st.size,
            mtime: st.mtime,
            ctime: st.ctime,
            racy: false,
        }
    }

    /// Whether `self` and `other` name the same version, racy or not (a racy identity is
    /// only less trusted, not another version: a fetch into its cache reads that version).
    pub fn same_version(&self, other: &SourceIdentity) -> bool {
        SourceIdentity {
            racy: false,
            ..*self
        } == SourceIdentity {
            racy: false,
            ..*other
        }
    }

    /// `self`, racy if it was taken (at `now`, seconds and nanoseconds since the epoch)
    /// less than `window` after the file's last change (the later of its mtime and
    /// ctime), or before it (a clock ahead of ours).
    pub fn checked_at(mut self, now: (i64, u32), window: std::time::Duration) -> Self {
        let ns = |(s, n): (i64, u32)| i128::from(s) * 1_000_000_000 + i128::from(n);
        let changed = ns(self.mtime).max(ns(self.ctime));
        self.racy = ns(now) - changed < window.as_nanos() as i128;
        self
    }
}

/// The cache data file's own inode and ctime when its record was last written. Anything
/// that changes the file's bytes or replaces it moves one of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DataIdentity {
    pub ino: u64,
    pub ctime: (i64, u32),
}

impl DataIdentity {
    pub fn of(st: &Stat) -> DataIdentity {
        DataIdentity {
            ino: st.ino,
            ctime: st.ctime,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheRecord {
    pub identity: SourceIdentity,
    /// Writes through the mount are in progress or were cut short: identity is not valid.
    pub dirty: bool,
    pub chunk_size: u64,
    /// Milliseconds since the epoch of the last open or close through the mount.
    pub last_used: u64,
    /// The data file as it was when this record was written (set by `store::write_record`).
    pub data: DataIdentity,
    /// One bit per chunk of `identity.size`.
    pub present: Vec<u8>,
    /// Per chunk, the minute (since the epoch) it was last read through the daemon: the
    /// cleaner evicts the least recently used chunks of large files.
    pub chunk_used: Vec<u32>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("record too short")]
    Short,
    #[error("not a hoardfs record")]
    BadMagic,
    #[error("record format {0}, expected {FORMAT}")]
    Format(u32),
    #[error("record checksum mismatch")]
    Checksum,
    #[error("record is inconsistent")]
    Inconsistent,
    #[error("cache data file changed behind the record")]
    DataChanged,
    /// The record was written for another data file than the one under its name now (a
    /// new version put in place by another open, `CacheStore::replace_data`).
    #[error("cache record written for another data file")]
    OtherDataFile,
}

pub fn chunk_count(size: u64, chunk_size: u64) -> u64 {
    size.div_ceil(chunk_size)
}

impl CacheRecord {
    /// An empty record for `identity`: nothing cached yet.
    pub fn empty(identity: SourceIdentity, chunk_size: u64) -> CacheRecord {
        let n = chunk_count(identity.size, chunk_size);
        CacheRecord {
            identity,
            dirty: false,
            chunk_size,
            last_used: 0,
            data: DataIdentity::default(),
            present: vec![0; n.div_ceil(8) as usize],
            chunk_used: vec![0; n as usize],
        }
    }

    pub fn nchunks(&self) -> u64 {
        chunk_count(self.identity.size, self.chunk_size)
    }

    pub fn is_present(&self, chunk: u64) -> bool {
        chunk < self.nchunks() && self.present[(chunk / 8) as usize] & (1 << (chunk % 8)) != 0
    }

    pub fn set_present(&mut self, chunk: u64, on: bool) {
        if chunk >= self.nchunks() {
            return;
        }
        let (byte, bit) = ((chunk / 8) as usize, 1u8 << (chunk % 8));
        if on {
            self.present[byte] |= bit;
        } else {
            self.present[byte] &= !bit;
        }
    }

    /// Notes a read of `chunk` at `minute`.
    pub fn touch(&mut self, chunk: u64, minute: u32) {
        if let Some(t) = self.chunk_used.get_mut(chunk as usize) {
            *t = minute;
        }
    }

    pub fn present_count(&self) -> u64 {
        (0..self.nchunks()).filter(|&c| self.is_present(c)).count() as u64
    }

    pub fn is_complete(&self) -> bool {
        (0..self.nchunks()).all(|c| self.is_present(c))
    }

    /// Changes the size. Chunks that lie wholly beyond the old end are marked `present`
    /// because the cache file was resized the same way as the source (zeros on both sides);
    /// the chunk holding the old end keeps its state.
    pub fn resize(&mut self, new_size: u64) {
        let old_n = self.nchunks();
        let old_size = self.identity.size;
        self.identity.size = new_size;
        let n = self.nchunks();
        self.present.resize(n.div_ceil(8) as usize, 0);
        self.chunk_used.resize(n as usize, 0);
        // Clear bits past the new end so the trailing byte stays canonical.
        for c in n..(self.present.len() as u64 * 8) {
            let (byte, bit) = ((c / 8) as usize, 1u8 << (c % 8));
            self.present[byte] &= !bit;
        }
        if new_size > old_size {
            let first_new = old_size.div_ceil(self.chunk_size).max(old_n.min(n));
            for c in first_new..n {
                self.set_present(c, true);
            }
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_LEN + self.present.len() + 4);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&FORMAT.to_le_bytes());
        let flags = if self.dirty { FLAG_DIRTY } else { 0 }
            | if self.identity.racy { FLAG_RACY } else { 0 };
        b.extend_from_slice(&flags.to_le_bytes());
        b.extend_from_slice(&self.identity.ino.to_le_bytes());
        b.extend_from_slice(&self.identity.size.to_le_bytes());
        b.extend_from_slice(&self.identity.mtime.0.to_le_bytes());
        b.extend_from_slice(&self.identity.mtime.1.to_le_bytes());
        b.extend_from_slice(&self.identity.ctime.0.to_le_bytes());
        b.extend_from_slice(&self.identity.ctime.1.to_le_bytes());
        b.extend_from_slice(&self.chunk_size.to_le_bytes());
        b.extend_from_slice(&self.last_used.to_le_bytes());
        b.extend_from_slice(&self.data.ino.to_le_bytes());
        b.extend_from_slice(&self.data.ctime.0.to_le_bytes());
        b.extend_from_slice(&self.data.ctime.1.to_le_bytes());
        b.extend_from_slice(&self.nchunks().to_le_bytes());
        b.extend_from_slice(&self.present);
        for t in &self.chunk_used {
            b.extend_from_slice(&t.to_le_bytes());
        }
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<CacheRecord, RecordError> {
        if b.len() < HEADER_LEN + 4 {
            return Err(RecordError::Short);
        }
        if &b[..8] != MAGIC {
            return Err(RecordError::BadMagic);
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let format = u32_at(8);
        if format != FORMAT {
            return Err(RecordError::Format(format));
        }
        let body_len = b.len() - 4;
        let crc = u32_at(body_len);
        if crc32fast::hash(&b[..body_len]) != crc {
            return Err(RecordError::Checksum);
        }
        let flags = u32_at(12);
        let identity = SourceIdentity {
            ino: u64_at(16),
            size: u64_at(24),
            mtime: (u64_at(32) as i64, u32_at(40)),
            ctime: (u64_at(44) as i64, u32_at(52)),
            racy: flags & FLAG_RACY != 0,
        };
        let chunk_size = u64_at(56);
        let last_used = u64_at(64);
        let data = DataIdentity {
            ino: u64_at(72),
            ctime: (u64_at(80) as i64, u32_at(88)),
        };
        let nchunks = u64_at(92);
        // Checked arithmetic: a crafted record with a valid checksum must not overflow.
        let bitmap_len = nchunks.div_ceil(8);
        let expected_body = nchunks
            .checked_mul(4)
            .and_then(|u| u.checked_add(bitmap_len));
        if chunk_size == 0
            || nchunks != chunk_count(identity.size, chunk_size)
            || expected_body != Some((body_len - HEADER_LEN) as u64)
        {
            return Err(RecordError::Inconsistent);
        }
        let bitmap_len = bitmap_len as usize;
        let used_at = HEADER_LEN + bitmap_len;
        // Only canonical encodings are accepted: no unknown flags, no bits past the last chunk.
        let spare_bits = (bitmap_len as u64 * 8 - nchunks) as u32;
        if flags & !(FLAG_DIRTY | FLAG_RACY) != 0
            || (spare_bits > 0 && b[used_at - 1] >> (8 - spare_bits) != 0)
        {
            return Err(RecordError::Inconsistent);
        }
        let chunk_used = (0..nchunks as usize)
            .map(|i| u32_at(used_at + 4 * i))
            .collect();
        Ok(CacheRecord {
            identity,
            dirty: flags & FLAG_DIRTY != 0,
            chunk_size,
            last_used,
            data,
            present: b[HEADER_LEN..used_at].to_vec(),
            chunk_used,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ident(size: u64) -> SourceIdentity {
        SourceIdentity {
            ino: 42,
            size,
            mtime: (1_700_000_000, 123),
            ctime: (1_700_000_001, 456),
            racy: false,
        }
    }

    /// The encoding of the record below, byte for byte.
    const GOLDEN: &str = "484f41524452454303000000000000002a000000000000000a0000000000000000f15365000000007b00000001f1536500000000c801000004000000000000000700000000000000090000000000000002f153650000000015030000030000000000000002000000000000000000000000a724a647";

    #[test]
    fn golden_bytes_force_a_format_bump() {
        let mut r = CacheRecord::empty(ident(10), 4);
        r.set_present(1, true);
        r.last_used = 7;
        r.data = DataIdentity {
            ino: 9,
            ctime: (1_700_000_002, 789),
        };
        let bytes = r.encode();
        // If this changes, bump FORMAT: old records must not be misread.
        assert_eq!(bytes.len(), HEADER_LEN + 1 + 3 * 4 + 4);
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, GOLDEN, "format changed: bump FORMAT and update GOLDEN");
    }

    #[test]
    fn corruption_is_detected() {
        let mut r = CacheRecord::empty(ident(100), 8);
        r.set_present(3, true);
        let bytes = r.encode();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(
                CacheRecord::decode(&bad).is_err(),
                "flip at {i} not detected"
            );
        }
        for len in 0..bytes.len() {
            assert!(CacheRecord::decode(&bytes[..len]).is_err());
        }
    }

    #[test]
    fn resize_marks_new_chunks_present_and_keeps_the_boundary_chunk() {
        let mut r = CacheRecord::empty(ident(10), 4); // chunks 0..3, last partial
        r.resize(20); // chunk 2 held the old end; 3 and 4 are new
        assert!(!r.is_present(2));
        assert!(r.is_present(3) && r.is_present(4));
        r.resize(5);
        assert_eq!(r.nchunks(), 2);
        assert!(!r.is_present(1));
        r.resize(0);
        assert!(r.is_complete());
    }

    proptest! {
        #[test]
        fn roundtrip(size in 0u64..1_000_000, cs in 1u64..70_000, bits in proptest::collection::vec(any::<bool>(), 0..64), dirty: bool) {
            let mut r = CacheRecord::empty(ident(size), cs);
            for (i, b) in bits.iter().enumerate() { r.set_present(i as u64, *b); r.touch(i as u64, i as u32 * 7); }
            r.dirty = dirty;
            prop_assert_eq!(CacheRecord::decode(&r.encode()).unwrap(), r);
        }
    }
}

#[cfg(test)]
mod racy_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_identity_within_the_granularity_of_its_mtime_is_racy_and_kept_so() {
        let id = SourceIdentity {
            size: 4,
            mtime: (100, 500_000_000),
            ..Default::default()
        };
        let second = Duration::from_secs(1);
        assert!(id.checked_at((101, 0), second).racy);
        assert!(
            id.checked_at((100, 400_000_000), second).racy,
            "a clock ahead"
        );
        assert!(!id.checked_at((101, 500_000_000), second).racy);
        assert!(!id.checked_at((100, 600_000_000), Duration::ZERO).racy);
        // A racy identity never matches a stat's, and survives the record's round trip.
        let racy = id.checked_at((101, 0), second);
        assert_ne!(racy, id);
        let rec = CacheRecord::empty(racy, 4);
        let back = CacheRecord::decode(&rec.encode()).unwrap();
        assert!(back.identity.racy);
        assert_eq!(back.identity, racy);
        // Still the same version: a fetch into its cache reads it.
        assert!(racy.same_version(&id) && id.same_version(&racy));
        assert!(!racy.same_version(&SourceIdentity { size: 5, ..id }));
    }

    #[test]
    fn a_ctime_later_than_the_mtime_is_the_change_that_counts() {
        // `touch -r` after a rewrite: the mtime put back, the ctime of the rewrite.
        let id = SourceIdentity {
            size: 4,
            mtime: (50, 0),
            ctime: (100, 500_000_000),
            ..Default::default()
        };
        let second = Duration::from_secs(1);
        assert!(id.checked_at((101, 0), second).racy);
        assert!(!id.checked_at((101, 600_000_000), second).racy);
    }
}

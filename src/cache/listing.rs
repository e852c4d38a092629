//! Directory listings kept for disconnected operation (Coda's hoarded directories,
//! xCachefs' mirrored tree): every entry of a directory as the source last showed it, with
//! its attributes and, for symlinks, the target. A directory is listed offline only from a
//! complete listing; there is no partial one.
//!
//! Stored as `CACHE_DIR/dirs/<hash of the path>`, not beside the data: any name can be a
//! source name, so nothing inside the mirrored trees can be reserved for it. The file
//! carries its path (checked on load), the directory's own attributes (an entry whose
//! object is not this directory never uses it) and a CRC; anything that does not decode is
//! ignored, as if no listing had been taken.
//!
//! ```text
//! "HOARDDIR" u32 version, u32 path len, path, stat (dir), u32 count,
//! count × (u32 name len, name, stat, u32 link len + 1 or 0, link), u32 CRC-32 of all before
//! ```
//! All integers little endian; a stat is 13 fields (dev ino mode nlink uid gid rdev size
//! blocks blksize atime mtime ctime, times as i64 seconds + u32 ns).

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::source::Stat;

const MAGIC: &[u8; 8] = b"HOARDDIR";
const VERSION: u32 = 1;
/// Upper bounds that keep a corrupt length from allocating without limit.
const MAX_NAME: usize = 255;
const MAX_LINK: usize = 4096;
const MAX_PATH: usize = 1 << 16;
/// Bytes of an encoded stat, and of the smallest entry (one-byte name, no link).
const STAT_BYTES: usize = 8 * 6 + 4 * 4 + 3 * 12;
const MIN_ENTRY: usize = 4 + 1 + STAT_BYTES + 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedEntry {
    pub name: OsString,
    pub stat: Stat,
    /// The target, for symlinks.
    pub link: Option<Vec<u8>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirListing {
    /// Relative path of the directory inside the source.
    pub path: PathBuf,
    pub dir: Stat,
    pub entries: Vec<ListedEntry>,
}

impl DirListing {
    pub fn find(&self, name: &OsStr) -> Option<&ListedEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.entries.len() * 140);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        put_bytes(&mut b, self.path.as_os_str().as_bytes());
        put_stat(&mut b, &self.dir);
        b.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            put_bytes(&mut b, e.name.as_bytes());
            put_stat(&mut b, &e.stat);
            match &e.link {
                Some(l) => {
                    b.extend_from_slice(&(l.len() as u32 + 1).to_le_bytes());
                    b.extend_from_slice(l);
                }
                None => b.extend_from_slice(&0u32.to_le_bytes()),
            }
        }
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a listing; `None` for anything torn, corrupt or of another version.
    pub fn decode(bytes: &[u8]) -> Option<DirListing> {
        let (body, crc) = bytes.split_at_checked(bytes.len().checked_sub(4)?)?;
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().ok()?) {
            return None;
        }
        let mut r = Reader(body);
        if r.take(8)? != MAGIC || r.u32()? != VERSION {
            return None;
        }
        let path = PathBuf::from(OsStr::from_bytes(r.bytes(MAX_PATH)?));
        let dir = r.stat()?;
        let count = r.u32()? as usize;
        // Each entry takes at least MIN_ENTRY bytes: a count beyond that is corrupt.
        if count > r.0.len() / MIN_ENTRY {
            return None;
        }
        let mut entries = Vec::with_capacity(count);
        for _ in 0..count {
            let name = OsStr::from_bytes(r.bytes(MAX_NAME)?).to_owned();
            if name.is_empty() || name.as_bytes().contains(&b'/') {
                return None;
            }
            let stat = r.stat()?;
            let link = match r.u32()? as usize {
                0 => None,
                n if n - 1 <= MAX_LINK => Some(r.take(n - 1)?.to_vec()),
                _ => return None,
            };
            entries.push(ListedEntry { name, stat, link });
        }
        if !r.0.is_empty() {
            return None;
        }
        Some(DirListing { path, dir, entries })
    }
}

/// The file name under `CACHE_DIR/dirs/` for the listing of `rel`: FNV-1a (64 bits) of
/// the path; the path stored inside tells collisions apart.
pub fn file_name(rel: &Path) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in rel.as_os_str().as_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn put_bytes(b: &mut Vec<u8>, s: &[u8]) {
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s);
}

fn put_stat(b: &mut Vec<u8>, st: &Stat) {
    for v in [st.dev, st.ino] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&st.mode.to_le_bytes());
    b.extend_from_slice(&st.nlink.to_le_bytes());
    b.extend_from_slice(&st.uid.to_le_bytes());
    b.extend_from_slice(&st.gid.to_le_bytes());
    for v in [st.rdev, st.size, st.blocks] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&st.blksize.to_le_bytes());
    for (s, ns) in [st.atime, st.mtime, st.ctime] {
        b.extend_from_slice(&s.to_le_bytes());
        b.extend_from_slice(&ns.to_le_bytes());
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn i64(&mut self) -> Option<i64> {
        Some(i64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn bytes(&mut self, max: usize) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        if n > max {
            return None;
        }
        self.take(n)
    }
    fn time(&mut self) -> Option<(i64, u32)> {
        let s = self.i64()?;
        let ns = self.u32()?;
        (ns < 1_000_000_000).then_some((s, ns))
    }
    fn stat(&mut self) -> Option<Stat> {
        Some(Stat {
            dev: self.u64()?,
            ino: self.u64()?,
            mode: self.u32()?,
            nlink: self.u64()?,
            uid: self.u32()?,
            gid: self.u32()?,
            rdev: self.u64()?,
            size: self.u64()?,
            blocks: self.u64()?,
            blksize: self.u32()?,
            atime: self.time()?,
            mtime: self.time()?,
            ctime: self.time()?,
            btime: (0, 0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stat(ino: u64, mode: u32) -> Stat {
        Stat {
            dev: 7,
            ino,
            mode,
            nlink: 1,
            uid: 1000,
            gid: 100,
            rdev: 0,
            size: ino * 10,
            blocks: 8,
            blksize: 4096,
            atime: (1, 2),
            mtime: (3, 4),
            ctime: (5, 999_999_999),
            btime: (0, 0),
        }
    }

    fn sample() -> DirListing {
        DirListing {
            path: PathBuf::from("a/b"),
            dir: stat(2, libc::S_IFDIR | 0o755),
            entries: vec![
                ListedEntry {
                    name: "f".into(),
                    stat: stat(3, libc::S_IFREG | 0o644),
                    link: None,
                },
                ListedEntry {
                    name: OsStr::from_bytes(b"l\n\xff").to_owned(),
                    stat: stat(4, libc::S_IFLNK | 0o777),
                    link: Some(b"../target".to_vec()),
                },
            ],
        }
    }

    #[test]
    fn round_trip_and_lookup() {
        let mut one = sample();
        one.entries.truncate(1);
        assert_eq!(DirListing::decode(&one.encode()), Some(one.clone()));
        let mut b = Vec::new();
        put_stat(&mut b, &one.dir);
        assert_eq!(b.len(), STAT_BYTES);
        let l = sample();
        let back = DirListing::decode(&l.encode()).unwrap();
        assert_eq!(back, l);
        assert_eq!(
            back.find(OsStr::from_bytes(b"l\n\xff"))
                .unwrap()
                .link
                .as_deref(),
            Some(&b"../target"[..])
        );
        assert!(back.find(OsStr::new("nope")).is_none());
    }

    #[test]
    fn names_of_listing_files_differ_by_path() {
        assert_ne!(file_name(Path::new("a/b")), file_name(Path::new("a/c")));
        assert_eq!(file_name(Path::new("")).len(), 16);
    }

    proptest! {
        /// Whatever the bytes, decoding never panics; a truncated or bit-flipped listing
        /// never decodes.
        #[test]
        fn corrupt_listings_are_rejected(garbage in proptest::collection::vec(any::<u8>(), 0..400),
                                         cut in 0usize..200, flip in 0usize..2000, bit in 0u8..8) {
            let _ = DirListing::decode(&garbage);
            let good = sample().encode();
            let cut = cut.min(good.len() - 1);
            prop_assert!(DirListing::decode(&good[..cut]).is_none());
            let mut bad = good.clone();
            let i = flip % bad.len();
            bad[i] ^= 1 << bit;
            prop_assert!(DirListing::decode(&bad).is_none());
        }
    }
}

//! The durable log of changes made while disconnected (`--offline-writes=log`), Coda's
//! client modify log: appended to while offline, replayed to the source in order when it
//! is back (`fs/reintegrate.rs`).
//!
//! On disk, in `<cache>/oplog/`:
//! - `log`: one line per operation, `<crc32 hex> <json>\n`, appended and synced before the
//!   operation is acknowledged. A torn last line (a crash while appending) fails its CRC
//!   and is dropped: that operation was never acknowledged.
//! - `data/<seq>`: the content a `Store` writes, copied out of the cache file when the file
//!   is closed (or synced), so that later changes to the cache file, a rename, or the
//!   cleaner cannot change what that operation sends.
//! - `progress`: the replay's position and what it has made of each path so far, replaced
//!   atomically after every replayed operation, so that a crash during replay resumes at
//!   the operation it interrupted (each operation detects that it was already done).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, BufRead, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use rustix::fs::OFlags;

use serde::{Deserialize, Serialize};

use crate::cache::record::SourceIdentity;
use crate::cache::store::{
    is_ours, private_dir, private_file, read_small_file, remove_tree, replace_file,
};
use crate::source::BeneathRoot;

/// What the source should hold at a path before an operation is applied to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Base {
    /// The version the cache had validated when the change was made offline.
    Source(Ident),
    /// Nothing: the name was free (the object was made offline).
    Absent,
    /// Whatever this log's earlier operation on the same path left there.
    Chained,
}

/// A source version as the log compares it (`SourceIdentity`, serialisable).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ident {
    pub ino: u64,
    pub size: u64,
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
}

impl From<SourceIdentity> for Ident {
    fn from(i: SourceIdentity) -> Ident {
        Ident {
            ino: i.ino,
            size: i.size,
            mtime: i.mtime,
            ctime: i.ctime,
        }
    }
}

/// One change made offline. Paths are relative to the source root, kept as bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// The file's whole content becomes `data/<seq>` of this entry, with this mode; a
    /// file made anew gets `owner` (uid, gid).
    Store {
        path: Vec<u8>,
        base: Base,
        mode: u32,
        owner: Option<(u32, u32)>,
    },
    Mkdir {
        path: Vec<u8>,
        mode: u32,
        owner: Option<(u32, u32)>,
    },
    Unlink {
        path: Vec<u8>,
        base: Base,
    },
    Rmdir {
        path: Vec<u8>,
    },
    /// A file rename; `base_to` is what `to` was when it was replaced (`Absent` if free).
    Rename {
        from: Vec<u8>,
        to: Vec<u8>,
        base_from: Base,
        base_to: Base,
    },
    /// `base` `None`: a directory, whose own changes are never a conflict.
    SetAttr {
        path: Vec<u8>,
        base: Option<Base>,
        mode: Option<u32>,
        atime: Option<(i64, u32)>,
        mtime: Option<(i64, u32)>,
    },
}

impl Op {
    /// The paths whose state this operation depends on or changes.
    pub fn paths(&self) -> Vec<PathBuf> {
        let p = |b: &Vec<u8>| PathBuf::from(std::ffi::OsString::from_vec(b.clone()));
        match self {
            Op::Store { path, .. }
            | Op::Mkdir { path, .. }
            | Op::Unlink { path, .. }
            | Op::Rmdir { path }
            | Op::SetAttr { path, .. } => vec![p(path)],
            Op::Rename { from, to, .. } => vec![p(from), p(to)],
        }
    }
}

pub fn bytes(p: &Path) -> Vec<u8> {
    p.as_os_str().as_bytes().to_vec()
}

pub fn path(b: &[u8]) -> PathBuf {
    PathBuf::from(std::ffi::OsStr::from_bytes(b))
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub seq: u64,
    /// Seconds since the epoch when the change was made.
    pub at: u64,
    pub op: Op,
}

/// What replay has made of a path: the identity it left there (`None`: it removed it),
/// that the path is in conflict, so later changes to it go to conflict copies, or the base
/// a skipped Store hands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Produced {
    Left(Option<Ident>),
    Conflicted,
    /// A Store skipped because a later one replaces it: the base it would have been
    /// checked against, for that later one.
    Carried(Base),
}

/// The replay's durable position.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// Every entry with `seq <= applied` is done.
    pub applied: u64,
    /// An entry whose effect on the source may have happened (set before a rename).
    pub in_flight: Option<u64>,
    pub produced: Vec<(Vec<u8>, Produced)>,
}

pub struct OpLog {
    /// `CACHE_DIR/oplog`, reached beneath the cache root; everything in it beneath it.
    dir: BeneathRoot,
    /// `oplog/data`: the containers.
    data: BeneathRoot,
    log: File,
    entries: Vec<Entry>,
    next_seq: u64,
    progress: Progress,
    /// Paths some pending entry changed: a later change to them is `Base::Chained`.
    touched: HashSet<PathBuf>,
}

fn sync_dir(dir: &BeneathRoot) -> io::Result<()> {
    rustix::fs::fsync(dir.root_fd()).map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))
}

fn encode(e: &Entry) -> String {
    let json = serde_json::to_string(e).expect("log entries serialise");
    format!("{:08x} {json}\n", crc32fast::hash(json.as_bytes()))
}

fn decode(line: &str) -> Option<Entry> {
    let (crc, json) = line.split_once(' ')?;
    if u32::from_str_radix(crc, 16).ok()? != crc32fast::hash(json.as_bytes()) {
        return None;
    }
    serde_json::from_str(json).ok()
}

impl OpLog {
    /// Opens (or creates) the log in `dir` (the `oplog` directory, opened beneath the
    /// cache root), dropping a torn last line. A log, progress file or container that is
    /// not a regular file of hoardfs's (a link planted there) is an error, never followed:
    /// it may stand for changes not yet replayed.
    pub fn open(dir: BeneathRoot) -> io::Result<OpLog> {
        // Owner-only, like the rest of the cache: it holds file contents.
        let data = private_dir(&dir, Path::new("data"), false)?;
        let mut log = private_file(&dir, Path::new("log"), OFlags::RDWR | OFlags::APPEND, false)?;
        let mut entries = Vec::new();
        let mut good_len = 0u64;
        {
            io::Seek::seek(&mut log, io::SeekFrom::Start(0))?;
            let mut r = io::BufReader::new(&log);
            let mut line = String::new();
            loop {
                line.clear();
                match r.read_line(&mut line) {
                    Ok(0) => break,
                    Ok(n) if line.ends_with('\n') => match decode(line.trim_end()) {
                        Some(e) => {
                            entries.push(e);
                            good_len += n as u64;
                        }
                        None => break,
                    },
                    _ => break,
                }
            }
        }
        if log.metadata()?.len() != good_len {
            tracing::warn!("offline log: dropping a torn last entry");
            log.set_len(good_len)?;
            log.sync_all()?;
        }
        let progress = match read_small_file(&dir, Path::new("progress")) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: {e}", dir.root_path().join("progress").display()),
                )
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Progress::default(),
            Err(e) => return Err(e),
        };
        let next_seq = entries
            .last()
            .map_or(progress.applied, |e: &Entry| e.seq)
            .max(progress.applied)
            + 1;
        let mut log = OpLog {
            dir,
            data,
            log,
            entries,
            next_seq,
            progress,
            touched: HashSet::new(),
        };
        log.entries.retain(|e| e.seq > log.progress.applied);
        for e in &log.entries {
            log.touched.extend(e.op.paths());
        }
        // Containers whose entry was never written (a crash between copy and append).
        let live: HashSet<String> = log.entries.iter().map(|e| e.seq.to_string()).collect();
        if let Ok(rd) = rustix::fs::Dir::read_from(log.data.root_fd()) {
            for f in rd.flatten() {
                let name = f.file_name().to_string_lossy().to_string();
                if name != "." && name != ".." && !live.contains(&name) {
                    let _ = remove_tree(&log.data, Path::new(&name));
                }
            }
        }
        if log.entries.is_empty() && log.progress.applied > 0 {
            log.clear()?;
        }
        Ok(log)
    }

    /// Entries not yet replayed, oldest first.
    pub fn pending(&self) -> &[Entry] {
        &self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The base a new change to `p` records: `Chained` if a pending change touched it.
    pub fn base_for(&self, p: &Path, fallback: Base) -> Base {
        if self.touched.contains(p) {
            Base::Chained
        } else {
            fallback
        }
    }

    /// Whether a pending entry changed `p`.
    pub fn touches(&self, p: &Path) -> bool {
        self.touched.contains(p)
    }

    /// The sequence number the next entry will get (its container's name).
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The name of entry `seq`'s container in `oplog/data`.
    fn container(seq: u64) -> PathBuf {
        PathBuf::from(seq.to_string())
    }

    /// Opens the content of entry `seq` for reading: only a regular file of hoardfs's with
    /// one link (a link planted there would send another file's bytes to the source).
    pub fn open_container(&self, seq: u64) -> io::Result<File> {
        let fd = self
            .data
            .openat(&Self::container(seq), OFlags::RDONLY | OFlags::NONBLOCK, 0)?;
        if !is_ours(&crate::source::fstat(std::os::fd::AsFd::as_fd(&fd))?, false) {
            return Err(io::Error::other(format!(
                "{}: not a file of hoardfs's",
                self.data.root_path().join(seq.to_string()).display()
            )));
        }
        Ok(File::from(fd))
    }

    /// Copies `content` into the container of the next entry, durably.
    pub fn stash(&self, content: &File) -> io::Result<()> {
        let dest = Self::container(self.next_seq);
        let mut out = private_file(&self.data, &dest, OFlags::WRONLY | OFlags::TRUNC, true)?;
        let mut src = content.try_clone()?;
        io::Seek::seek(&mut src, io::SeekFrom::Start(0))?;
        io::copy(&mut src, &mut out)?;
        out.sync_all()?;
        sync_dir(&self.data)
    }

    /// Appends `op` durably; returns its sequence number.
    pub fn append(&mut self, op: Op, at: u64) -> io::Result<u64> {
        let e = Entry {
            seq: self.next_seq,
            at,
            op,
        };
        let line = encode(&e);
        let before = self.log.metadata()?.len();
        if let Err(err) = self
            .log
            .write_all(line.as_bytes())
            .and_then(|_| self.log.sync_data())
        {
            let _ = self.log.set_len(before);
            return Err(err);
        }
        self.next_seq += 1;
        self.touched.extend(e.op.paths());
        self.entries.push(e);
        Ok(self.next_seq - 1)
    }

    /// Records that `seq` (the oldest pending entry) is done, with what replay made of
    /// the paths so far.
    pub fn applied(&mut self, seq: u64, produced: &HashMap<PathBuf, Produced>) -> io::Result<()> {
        let mut progress = Progress {
            applied: seq,
            in_flight: None,
            produced: produced.iter().map(|(p, v)| (bytes(p), *v)).collect(),
        };
        progress.produced.sort_by(|a, b| a.0.cmp(&b.0));
        self.save_progress(progress)?;
        self.entries.retain(|e| e.seq > seq);
        let _ = self.data.unlink(&Self::container(seq));
        if self.entries.is_empty() {
            self.clear()?;
        }
        Ok(())
    }

    /// Records durably that entry `seq` is about to change the source.
    pub fn begin(&mut self, seq: u64) -> io::Result<()> {
        let mut progress = self.progress.clone();
        progress.in_flight = Some(seq);
        self.save_progress(progress)
    }

    fn save_progress(&mut self, progress: Progress) -> io::Result<()> {
        let bytes = serde_json::to_vec(&progress).expect("progress serialises");
        replace_file(&self.dir, Path::new("progress"), &bytes)?;
        self.progress = progress;
        Ok(())
    }

    /// Empties a fully replayed log. The progress file goes last: a crash in between
    /// leaves a log whose entries are all marked done.
    fn clear(&mut self) -> io::Result<()> {
        self.log.set_len(0)?;
        self.log.sync_all()?;
        let _ = self.dir.unlink(Path::new("progress"));
        sync_dir(&self.dir)?;
        self.progress = Progress {
            applied: self.next_seq - 1,
            ..Progress::default()
        };
        self.touched.clear();
        Ok(())
    }

    /// Produced states as a map (replay's working copy).
    pub fn produced_map(&self) -> HashMap<PathBuf, Produced> {
        self.progress
            .produced
            .iter()
            .map(|(p, v)| (path(p), *v))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::{self, OpenOptions};

    fn dir(d: &Path) -> BeneathRoot {
        let fd = rustix::fs::open(
            d,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        BeneathRoot::from_fd(fd, d.to_path_buf())
    }

    fn container(d: &Path, seq: u64) -> PathBuf {
        d.join("data").join(seq.to_string())
    }

    fn store(p: &str) -> Op {
        Op::Store {
            path: p.as_bytes().to_vec(),
            base: Base::Absent,
            mode: 0o644,
            owner: None,
        }
    }

    #[test]
    fn entries_survive_reopen_and_a_torn_tail_is_dropped() {
        let d = tempfile::tempdir().unwrap();
        let mut log = OpLog::open(dir(d.path())).unwrap();
        assert!(log.is_empty());
        log.append(store("a"), 1).unwrap();
        log.append(
            Op::Mkdir {
                path: b"d".to_vec(),
                mode: 0o755,
                owner: Some((1, 2)),
            },
            2,
        )
        .unwrap();
        assert_eq!(log.base_for(Path::new("a"), Base::Absent), Base::Chained);
        assert_eq!(log.base_for(Path::new("b"), Base::Absent), Base::Absent);
        drop(log);
        // A crash while appending a third entry.
        let mut f = OpenOptions::new()
            .append(true)
            .open(d.path().join("log"))
            .unwrap();
        f.write_all(b"0000abcd {\"seq\":3,\"at\"").unwrap();
        let mut log = OpLog::open(dir(d.path())).unwrap();
        assert_eq!(log.pending().len(), 2);
        assert_eq!(log.pending()[0].op, store("a"));
        assert_eq!(log.next_seq(), 3);
        assert_eq!(log.append(store("c"), 3).unwrap(), 3);
        assert_eq!(OpLog::open(dir(d.path())).unwrap().pending().len(), 3);
    }

    #[test]
    fn a_corrupt_line_ends_the_log() {
        let d = tempfile::tempdir().unwrap();
        let mut log = OpLog::open(dir(d.path())).unwrap();
        log.append(store("a"), 1).unwrap();
        log.append(store("b"), 1).unwrap();
        drop(log);
        let text = fs::read_to_string(d.path().join("log")).unwrap();
        fs::write(d.path().join("log"), text.replace("[98]", "[99]")).unwrap();
        assert_eq!(OpLog::open(dir(d.path())).unwrap().pending().len(), 1);
    }

    #[test]
    fn progress_resumes_and_a_finished_log_is_emptied() {
        let d = tempfile::tempdir().unwrap();
        let mut log = OpLog::open(dir(d.path())).unwrap();
        let content = tempfile::tempfile().unwrap();
        (&content).write_all(b"hello").unwrap();
        log.stash(&content).unwrap();
        let s1 = log.append(store("a"), 1).unwrap();
        assert_eq!(fs::read(container(d.path(), s1)).unwrap(), b"hello");
        log.stash(&content).unwrap();
        let s2 = log.append(store("b"), 1).unwrap();
        // An orphan container: copied, but its entry never appended.
        fs::write(container(d.path(), s2 + 1), b"orphan").unwrap();
        let mut produced = HashMap::new();
        produced.insert(PathBuf::from("a"), Produced::Conflicted);
        log.applied(s1, &produced).unwrap();
        drop(log);
        let mut log = OpLog::open(dir(d.path())).unwrap();
        assert!(!container(d.path(), s2 + 1).exists());
        assert!(!container(d.path(), s1).exists());
        assert_eq!(log.pending().len(), 1);
        assert_eq!(log.produced_map(), produced);
        log.applied(s2, &produced).unwrap();
        assert!(log.is_empty());
        assert_eq!(fs::metadata(d.path().join("log")).unwrap().len(), 0);
        let log = OpLog::open(dir(d.path())).unwrap();
        assert!(log.is_empty());
        assert_eq!(log.base_for(Path::new("a"), Base::Absent), Base::Absent);
    }
}

//! The operations of the model tests and what they are checked with, shared by the mounted
//! model test (`tests/model.rs`) and the in-process one (`tests/model_inproc.rs`): the `Op`
//! type and its proptest strategies, the start tree, the plain-directory side that applies
//! operations with system calls, outcomes, tree snapshots and the cache check.
//!
//! Included by path (`#[path = "common/model_ops.rs"] mod model_ops;`) next to `mod common;`.
#![allow(dead_code)]

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use hoardfs::cache::CacheRecord;
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, RngSeed};

pub const CHUNK: u64 = 64 << 10;
pub const THRESHOLD: u64 = 128 << 10;
pub const SLOTS: usize = 3;

pub const FILE_PATHS: &[&str] = &[
    "f", "g", "h", "i", "a/f", "a/g", "b/f", "b/h", "a/b/f", "a/b/g",
];
pub const DIR_PATHS: &[&str] = &["a", "b", "c", "a/b", "b/c"];

/// What a model test did, printed at its end to show the checks were not vacuous.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    /// Operations whose results agreed: a value, or the same errno.
    pub ops_ok: u64,
    pub ops_err: u64,
    /// Left out under passthrough (a writer joining a passthrough reader).
    pub skipped: u64,
    pub remounts: u64,
    /// Cache records checked against the source (clean, matching the source's identity).
    pub records: u64,
    /// Present chunks compared with the source.
    pub chunks: u64,
}

thread_local! {
    /// Per test (each test runs on its own thread), to show that the checks were not vacuous.
    static COUNTS: Cell<Counts> = Cell::new(Counts::default());
}

/// This thread's counts so far.
pub fn counts() -> Counts {
    COUNTS.with(|c| c.get())
}

pub fn count(f: impl FnOnce(&mut Counts)) {
    COUNTS.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v);
    });
}

// ------------------------------------------------------------------------------ operations

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Ro,
    Rw,
    RwAppend,
}

/// `len` deterministic pseudo-random bytes (printed short, rebuilt on use).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Data {
    pub len: usize,
    pub seed: u64,
}

impl fmt::Debug for Data {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Data {{ len: {}, seed: {} }}", self.len, self.seed)
    }
}

impl Data {
    /// The bytes: one xorshift step per 8 bytes (`common::pattern`'s step per byte made a
    /// debug build of the in-process model test spend a third of its time here). The last
    /// ones are kept: both sides of the model ask for the same data one after the other.
    pub fn bytes(&self) -> Vec<u8> {
        thread_local! {
            static LAST: std::cell::RefCell<Option<(Data, Vec<u8>)>> =
                const { std::cell::RefCell::new(None) };
        }
        LAST.with(|last| {
            let mut last = last.borrow_mut();
            if let Some((d, b)) = last.as_ref()
                && d == self
            {
                return b.clone();
            }
            let mut x = self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut words = vec![0u64; self.len.div_ceil(8)];
            for w in words.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *w = x.to_le();
            }
            // SAFETY: `words` holds at least `len` initialized bytes.
            let b = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), self.len) }
                .to_vec();
            *last = Some((*self, b.clone()));
            b
        })
    }
}

/// A path operand. `P` is a fixed name of the small name space; `F`, `D` and `E` pick, at
/// the time the operation runs, the k-th (modulo their number) existing regular file,
/// directory or entry of the reference tree, so that most operations hit something that
/// exists. Failure messages show operations with every operand resolved to a `P`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Pth {
    P(&'static str),
    F(u8),
    D(u8),
    E(u8),
}

impl fmt::Debug for Pth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pth::P(p) => write!(f, "P({p:?})"),
            Pth::F(k) => write!(f, "F({k})"),
            Pth::D(k) => write!(f, "D({k})"),
            Pth::E(k) => write!(f, "E({k})"),
        }
    }
}

pub use Pth::P;

impl Pth {
    pub fn get(self) -> &'static str {
        match self {
            P(p) => p,
            _ => panic!("unresolved path operand {self:?}"),
        }
    }
}

#[derive(Clone, Debug)]
pub enum Op {
    /// `open(O_CREAT|O_WRONLY|O_TRUNC [|O_EXCL], mode)` then close.
    CreateFile {
        path: Pth,
        mode: u32,
        excl: bool,
    },
    /// open for writing (no create), `pwrite`, close.
    WriteAt {
        path: Pth,
        off: u64,
        data: Data,
    },
    /// `truncate(2)` by path.
    Truncate {
        path: Pth,
        len: u64,
    },
    Rename {
        from: Pth,
        to: Pth,
    },
    /// `renameat2` with `RENAME_NOREPLACE` or `RENAME_EXCHANGE`.
    Rename2 {
        from: Pth,
        to: Pth,
        exchange: bool,
    },
    /// `link(2)`.
    Link {
        from: Pth,
        to: Pth,
    },
    /// `chmod(2)`.
    Chmod {
        path: Pth,
        mode: u32,
    },
    Unlink(Pth),
    Mkdir(Pth),
    Rmdir(Pth),
    /// open read-only, `pread` up to `len`, close.
    ReadAt {
        path: Pth,
        off: u64,
        len: usize,
    },
    /// `std::fs::read`.
    ReadWhole(Pth),
    /// `lstat`: type, and size and permission bits of files.
    Stat(Pth),
    /// `ls -l`: a directory's entries, sorted, each with the type readdir gives and its lstat.
    ListDir(Pth),
    /// Close every pooled handle, then open each again by the path and mode it was opened with.
    Reopen,
    /// Close the pool, unmount (source must equal the reference, cache must agree with the
    /// source), mount again (mount must equal the reference), reopen the pool.
    Remount,
    /// Open `path` into handle slot `slot` (closing what the slot held).
    Open {
        slot: usize,
        path: Pth,
        mode: Mode,
    },
    /// Handle operations use their slot or, if it is empty, the next open one (failure
    /// messages show the slot actually used).
    WriteHandle {
        slot: usize,
        off: u64,
        data: Data,
    },
    ReadHandle {
        slot: usize,
        off: u64,
        len: usize,
    },
    /// `ftruncate`.
    TruncateHandle {
        slot: usize,
        len: u64,
    },
    /// `fstat`: type, size, permission bits.
    StatHandle(usize),
    FsyncHandle(usize),
}

/// What exists in the reference tree, for resolving `F`, `D` and `E`.
pub struct Existing {
    pub files: Vec<String>,
    pub dirs: Vec<String>,
    pub all: Vec<String>,
}

impl Existing {
    pub fn scan(root: &Path) -> Existing {
        fn walk(root: &Path, rel: &str, e: &mut Existing) {
            let dir = if rel.is_empty() {
                root.to_path_buf()
            } else {
                root.join(rel)
            };
            let Ok(rd) = std::fs::read_dir(&dir) else {
                return;
            };
            let mut names: Vec<String> = rd
                .flatten()
                .map(|d| d.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            for n in names {
                let r = if rel.is_empty() {
                    n
                } else {
                    format!("{rel}/{n}")
                };
                let Ok(m) = std::fs::symlink_metadata(root.join(&r)) else {
                    continue;
                };
                e.all.push(r.clone());
                if m.is_dir() {
                    e.dirs.push(r.clone());
                    walk(root, &r, e);
                } else if m.is_file() {
                    e.files.push(r);
                }
            }
        }
        let mut e = Existing {
            files: vec![],
            dirs: vec![],
            all: vec![],
        };
        walk(root, "", &mut e);
        e
    }

    pub fn resolve(&self, p: Pth) -> Pth {
        let pick = |v: &Vec<String>, k: u8, dflt: &'static str| -> &'static str {
            if v.is_empty() {
                dflt
            } else {
                intern(&v[k as usize % v.len()])
            }
        };
        P(match p {
            P(p) => p,
            Pth::F(k) => pick(&self.files, k, "f"),
            Pth::D(k) => pick(&self.dirs, k, "c"),
            Pth::E(k) => pick(&self.all, k, "f"),
        })
    }
}

/// A `'static` copy of a path (names outside the fixed lists arise from directory renames).
pub fn intern(s: &str) -> &'static str {
    if let Some(p) = FILE_PATHS.iter().chain(DIR_PATHS).find(|p| **p == s) {
        return p;
    }
    Box::leak(s.to_owned().into_boxed_str())
}

impl Op {
    /// This operation with its handle slot moved to the first open one from it, in slot
    /// order (`is_open`), so that handle operations mostly act on an open handle.
    pub fn at_open_slot(self, is_open: impl Fn(usize) -> bool) -> Op {
        let to = |slot: usize| {
            (0..SLOTS)
                .map(|k| (slot + k) % SLOTS)
                .find(|&k| is_open(k))
                .unwrap_or(slot)
        };
        match self {
            Op::WriteHandle { slot, off, data } => Op::WriteHandle {
                slot: to(slot),
                off,
                data,
            },
            Op::ReadHandle { slot, off, len } => Op::ReadHandle {
                slot: to(slot),
                off,
                len,
            },
            Op::TruncateHandle { slot, len } => Op::TruncateHandle {
                slot: to(slot),
                len,
            },
            Op::StatHandle(slot) => Op::StatHandle(to(slot)),
            Op::FsyncHandle(slot) => Op::FsyncHandle(to(slot)),
            op => op,
        }
    }

    /// The operation with every operand resolved in the tree at `root`, which is scanned
    /// only if an operand picks from it.
    pub fn resolve_at(&self, root: &Path) -> Op {
        let picks = std::cell::Cell::new(false);
        self.map_paths(|p| {
            picks.set(picks.get() || !matches!(p, P(_)));
            p
        });
        if picks.get() {
            self.resolve(&Existing::scan(root))
        } else {
            self.clone()
        }
    }

    pub fn resolve(&self, e: &Existing) -> Op {
        self.map_paths(|p| e.resolve(p))
    }

    fn map_paths(&self, r: impl Fn(Pth) -> Pth) -> Op {
        match self.clone() {
            Op::CreateFile { path, mode, excl } => Op::CreateFile {
                path: r(path),
                mode,
                excl,
            },
            Op::WriteAt { path, off, data } => Op::WriteAt {
                path: r(path),
                off,
                data,
            },
            Op::Truncate { path, len } => Op::Truncate { path: r(path), len },
            Op::Rename { from, to } => Op::Rename {
                from: r(from),
                to: r(to),
            },
            Op::Rename2 { from, to, exchange } => Op::Rename2 {
                from: r(from),
                to: r(to),
                exchange,
            },
            Op::Link { from, to } => Op::Link {
                from: r(from),
                to: r(to),
            },
            Op::Chmod { path, mode } => Op::Chmod {
                path: r(path),
                mode,
            },
            Op::Unlink(p) => Op::Unlink(r(p)),
            Op::Mkdir(p) => Op::Mkdir(r(p)),
            Op::Rmdir(p) => Op::Rmdir(r(p)),
            Op::ReadAt { path, off, len } => Op::ReadAt {
                path: r(path),
                off,
                len,
            },
            Op::ReadWhole(p) => Op::ReadWhole(r(p)),
            Op::Stat(p) => Op::Stat(r(p)),
            Op::ListDir(p) => Op::ListDir(r(p)),
            Op::Open { slot, path, mode } => Op::Open {
                slot,
                path: r(path),
                mode,
            },
            op => op,
        }
    }
}

/// What the source holds before the mount is first used: the directories `a`, `b`, `a/b`,
/// and for each of `FILE_PATHS` maybe a file (data, permission bits).
#[derive(Clone, Debug)]
pub struct Init {
    pub files: Vec<Option<(Data, u32)>>,
}

pub fn init() -> impl Strategy<Value = Init> {
    let len = prop_oneof![
        1 => Just(0usize),
        3 => 1usize..5000,
        2 => 5000usize..(THRESHOLD as usize + 1),
        2 => (THRESHOLD as usize + 1)..(10 * CHUNK as usize),
    ];
    let file = (
        len,
        any::<u64>(),
        prop::sample::select(vec![0o644u32, 0o600, 0o755]),
    )
        .prop_map(|(len, seed, mode)| (Data { len, seed }, mode));
    prop::collection::vec(prop::option::weighted(0.6, file), FILE_PATHS.len())
        .prop_map(|files| Init { files })
}

impl Init {
    /// Just the directories.
    pub fn dirs_only() -> Init {
        Init {
            files: vec![None; FILE_PATHS.len()],
        }
    }

    /// The directories and these files.
    pub fn with(files: &[(&str, usize, u64)]) -> Init {
        let mut i = Init::dirs_only();
        for &(path, len, seed) in files {
            let k = FILE_PATHS
                .iter()
                .position(|p| *p == path)
                .expect("a FILE_PATHS name");
            i.files[k] = Some((Data { len, seed }, 0o644));
        }
        i
    }

    /// Writes the tree under each of `roots`.
    pub fn write(&self, roots: &[&Path]) {
        for root in roots {
            for d in ["a", "b", "a/b"] {
                std::fs::create_dir(root.join(d)).unwrap();
            }
        }
        for (path, f) in FILE_PATHS.iter().zip(&self.files) {
            if let Some((data, mode)) = f {
                let bytes = data.bytes();
                for root in roots {
                    let p = root.join(path);
                    std::fs::write(&p, &bytes).unwrap();
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode)).unwrap();
                }
            }
        }
    }
}

pub fn fixed(paths: &'static [&'static str]) -> impl Strategy<Value = Pth> {
    prop::sample::select(paths).prop_map(P)
}

/// Operand of file operations: mostly an existing file, sometimes any name (absent files,
/// directories).
pub fn file_path() -> impl Strategy<Value = Pth> {
    prop_oneof![
        6 => any::<u8>().prop_map(Pth::F),
        3 => fixed(FILE_PATHS),
        1 => fixed(DIR_PATHS),
    ]
}

pub fn mkdir_path() -> impl Strategy<Value = Pth> {
    prop_oneof![6 => fixed(DIR_PATHS), 1 => fixed(FILE_PATHS)]
}

pub fn rmdir_path() -> impl Strategy<Value = Pth> {
    prop_oneof![4 => any::<u8>().prop_map(Pth::D), 2 => fixed(DIR_PATHS), 1 => fixed(FILE_PATHS)]
}

pub fn any_path() -> impl Strategy<Value = Pth> {
    prop_oneof![
        3 => any::<u8>().prop_map(Pth::E),
        2 => fixed(FILE_PATHS),
        1 => fixed(DIR_PATHS),
    ]
}

/// Offsets and lengths: small, around chunk and threshold boundaries, or up to 3 MiB.
pub fn offset() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..8192,
        3 => prop::sample::select(vec![
            CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 5, THRESHOLD, THRESHOLD + 1,
            3 * CHUNK + 100, 5 * CHUNK,
        ]),
        2 => 0u64..(3 << 20),
    ]
}

pub fn trunc_len() -> impl Strategy<Value = u64> {
    prop_oneof![2 => Just(0u64), 5 => offset()]
}

pub fn data() -> impl Strategy<Value = Data> {
    let len = prop_oneof![
        5 => 1usize..300,
        3 => 300usize..20_000,
        1 => 60_000usize..150_000,
    ];
    (len, any::<u64>()).prop_map(|(len, seed)| Data { len, seed })
}

pub fn read_len() -> impl Strategy<Value = usize> {
    prop_oneof![3 => 1usize..5000, 1 => 5000usize..200_000]
}

pub fn slot() -> impl Strategy<Value = usize> {
    0..SLOTS
}

pub fn op() -> impl Strategy<Value = Op> {
    let mode = prop_oneof![3 => Just(Mode::Rw), 2 => Just(Mode::Ro), 1 => Just(Mode::RwAppend)];
    prop_oneof![
        3 => (file_path(), prop::sample::select(vec![0o644u32, 0o600, 0o755, 0o640]), any::<bool>())
            .prop_map(|(path, mode, excl)| Op::CreateFile { path, mode, excl }),
        5 => (file_path(), offset(), data()).prop_map(|(path, off, data)| Op::WriteAt { path, off, data }),
        2 => (file_path(), trunc_len()).prop_map(|(path, len)| Op::Truncate { path, len }),
        3 => (any_path(), any_path()).prop_map(|(from, to)| Op::Rename { from, to }),
        1 => (any_path(), any_path(), any::<bool>())
            .prop_map(|(from, to, exchange)| Op::Rename2 { from, to, exchange }),
        1 => (file_path(), any_path()).prop_map(|(from, to)| Op::Link { from, to }),
        1 => (any_path(), prop::sample::select(vec![0o644u32, 0o600, 0o755, 0o444]))
            .prop_map(|(path, mode)| Op::Chmod { path, mode }),
        2 => file_path().prop_map(Op::Unlink),
        2 => mkdir_path().prop_map(Op::Mkdir),
        1 => rmdir_path().prop_map(Op::Rmdir),
        3 => (file_path(), offset(), read_len()).prop_map(|(path, off, len)| Op::ReadAt { path, off, len }),
        2 => file_path().prop_map(Op::ReadWhole),
        2 => any_path().prop_map(Op::Stat),
        1 => prop_oneof![2 => any::<u8>().prop_map(Pth::D), 1 => fixed(DIR_PATHS)].prop_map(Op::ListDir),
        1 => Just(Op::Reopen),
        1 => Just(Op::Remount),
        4 => (slot(), file_path(), mode).prop_map(|(slot, path, mode)| Op::Open { slot, path, mode }),
        5 => (slot(), offset(), data()).prop_map(|(slot, off, data)| Op::WriteHandle { slot, off, data }),
        4 => (slot(), offset(), read_len()).prop_map(|(slot, off, len)| Op::ReadHandle { slot, off, len }),
        2 => (slot(), trunc_len()).prop_map(|(slot, len)| Op::TruncateHandle { slot, len }),
        2 => slot().prop_map(Op::StatHandle),
        1 => slot().prop_map(Op::FsyncHandle),
    ]
}

// ------------------------------------------------------------------------------ outcomes

#[derive(PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// A write's byte count, or nothing-to-do for an empty slot.
    Count(u64),
    Bytes(Vec<u8>),
    Meta {
        kind: char,
        size: Option<u64>,
        perm: Option<u32>,
    },
    /// A listing: name, the type readdir reports, and the entry's lstat (`Meta` or `Err`).
    Listing(Vec<(String, char, Outcome)>),
    /// errno (-1 when the error carried none).
    Err(i32),
}

pub fn digest(b: &[u8]) -> u32 {
    crc32fast::hash(b)
}

impl fmt::Debug for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Done => write!(f, "Ok"),
            Outcome::Count(n) => write!(f, "Ok({n})"),
            Outcome::Bytes(b) => write!(f, "Bytes(len {}, crc {:08x})", b.len(), digest(b)),
            Outcome::Meta { kind, size, perm } => {
                write!(
                    f,
                    "Meta({kind}, size {size:?}, perm {:?})",
                    perm.map(|p| format!("{p:o}"))
                )
            }
            Outcome::Listing(l) => f.debug_list().entries(l).finish(),
            Outcome::Err(e) => write!(f, "Err({})", errno_name(*e)),
        }
    }
}

pub fn kind_char(ft: std::fs::FileType) -> char {
    if ft.is_file() {
        'f'
    } else if ft.is_dir() {
        'd'
    } else {
        '?'
    }
}

pub fn list_dir(dir: &Path) -> io::Result<Vec<(String, char, Outcome)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let m = outcome(std::fs::symlink_metadata(e.path()), |m| meta_of(&m));
        out.push((
            e.file_name().to_string_lossy().into_owned(),
            kind_char(e.file_type()?),
            m,
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

pub fn errno_name(e: i32) -> String {
    let name = match e {
        libc::ENOENT => "ENOENT",
        libc::EEXIST => "EEXIST",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::EBADF => "EBADF",
        libc::EIO => "EIO",
        libc::ESTALE => "ESTALE",
        libc::ETXTBSY => "ETXTBSY",
        libc::EBUSY => "EBUSY",
        libc::EPERM => "EPERM",
        libc::EACCES => "EACCES",
        _ => "",
    };
    format!("{e} {name}")
}

pub fn outcome<T>(r: io::Result<T>, f: impl FnOnce(T) -> Outcome) -> Outcome {
    match r {
        Ok(v) => f(v),
        Err(e) => Outcome::Err(e.raw_os_error().unwrap_or(-1)),
    }
}

pub fn meta_of(m: &std::fs::Metadata) -> Outcome {
    let ft = m.file_type();
    let kind = kind_char(ft);
    // Directory sizes are the source's, not comparable with the reference's.
    let size = ft.is_file().then_some(m.len());
    let perm = Some(m.permissions().mode() & 0o7777);
    Outcome::Meta { kind, size, perm }
}

/// `pread` until `len` bytes or end of file.
pub fn read_upto(f: &File, off: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut done = 0;
    while done < len {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(done);
    Ok(buf)
}

pub fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

pub fn cvt(r: libc::c_int) -> io::Result<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

pub fn open_mode(p: &Path, mode: Mode) -> io::Result<File> {
    match mode {
        Mode::Ro => File::open(p),
        Mode::Rw => OpenOptions::new().read(true).write(true).open(p),
        Mode::RwAppend => OpenOptions::new().read(true).append(true).open(p),
    }
}

// ------------------------------------------------------------------------------ one side

/// One of the two worlds: a root directory and the handles held open in it.
pub struct Side {
    pub root: PathBuf,
    pub slots: Vec<Option<File>>,
}

impl Side {
    pub fn new(root: PathBuf) -> Side {
        Side {
            root,
            slots: (0..SLOTS).map(|_| None).collect(),
        }
    }

    pub fn p(&self, rel: Pth) -> PathBuf {
        self.root.join(rel.get())
    }

    pub fn close_all(&mut self) {
        for s in &mut self.slots {
            *s = None;
        }
    }

    pub fn open_slot(&mut self, slot: usize, path: &str, mode: Mode) -> Outcome {
        self.slots[slot] = None;
        let r = open_mode(&self.root.join(path), mode);
        outcome(r, |f| {
            self.slots[slot] = Some(f);
            Outcome::Done
        })
    }

    /// Runs `f` on the handle in `slot`; an empty slot is a no-op.
    pub fn with_slot(&self, slot: usize, f: impl FnOnce(&File) -> Outcome) -> Outcome {
        match &self.slots[slot] {
            Some(h) => f(h),
            None => Outcome::Count(u64::MAX),
        }
    }

    /// Applies every operation but Reopen and Remount.
    pub fn apply(&mut self, op: &Op) -> Outcome {
        match *op {
            Op::CreateFile { path, mode, excl } => {
                let mut o = OpenOptions::new();
                o.write(true).mode(mode);
                if excl {
                    o.create_new(true);
                } else {
                    o.create(true).truncate(true);
                }
                outcome(o.open(self.p(path)), |_| Outcome::Done)
            }
            Op::WriteAt { path, off, data } => {
                let r = OpenOptions::new()
                    .write(true)
                    .open(self.p(path))
                    .and_then(|f| f.write_all_at(&data.bytes(), off));
                outcome(r, |_| Outcome::Done)
            }
            Op::Truncate { path, len } => {
                let r =
                    unsafe { libc::truncate(cpath(&self.p(path)).as_ptr(), len as libc::off_t) };
                outcome(cvt(r), |_| Outcome::Done)
            }
            Op::Rename { from, to } => {
                outcome(std::fs::rename(self.p(from), self.p(to)), |_| Outcome::Done)
            }
            Op::Rename2 { from, to, exchange } => {
                let (a, b) = (cpath(&self.p(from)), cpath(&self.p(to)));
                let flags = if exchange {
                    libc::RENAME_EXCHANGE
                } else {
                    libc::RENAME_NOREPLACE
                };
                let r = unsafe {
                    libc::renameat2(
                        libc::AT_FDCWD,
                        a.as_ptr(),
                        libc::AT_FDCWD,
                        b.as_ptr(),
                        flags,
                    )
                };
                outcome(cvt(r), |_| Outcome::Done)
            }
            Op::Link { from, to } => outcome(std::fs::hard_link(self.p(from), self.p(to)), |_| {
                Outcome::Done
            }),
            Op::Chmod { path, mode } => outcome(
                std::fs::set_permissions(self.p(path), std::fs::Permissions::from_mode(mode)),
                |_| Outcome::Done,
            ),
            Op::Unlink(path) => outcome(std::fs::remove_file(self.p(path)), |_| Outcome::Done),
            Op::Mkdir(path) => outcome(std::fs::create_dir(self.p(path)), |_| Outcome::Done),
            Op::Rmdir(path) => outcome(std::fs::remove_dir(self.p(path)), |_| Outcome::Done),
            Op::ReadAt { path, off, len } => {
                let r = File::open(self.p(path)).and_then(|f| read_upto(&f, off, len));
                outcome(r, Outcome::Bytes)
            }
            Op::ReadWhole(path) => outcome(std::fs::read(self.p(path)), Outcome::Bytes),
            Op::Stat(path) => outcome(std::fs::symlink_metadata(self.p(path)), |m| meta_of(&m)),
            Op::ListDir(path) => outcome(list_dir(&self.p(path)), Outcome::Listing),
            Op::Open { slot, path, mode } => self.open_slot(slot, path.get(), mode),
            Op::WriteHandle { slot, off, data } => self.with_slot(slot, |f| {
                let b = data.bytes();
                outcome(f.write_all_at(&b, off), |_| Outcome::Count(b.len() as u64))
            }),
            Op::ReadHandle { slot, off, len } => {
                self.with_slot(slot, |f| outcome(read_upto(f, off, len), Outcome::Bytes))
            }
            Op::TruncateHandle { slot, len } => {
                self.with_slot(slot, |f| outcome(f.set_len(len), |_| Outcome::Done))
            }
            Op::StatHandle(slot) => {
                self.with_slot(slot, |f| outcome(f.metadata(), |m| meta_of(&m)))
            }
            Op::FsyncHandle(slot) => {
                self.with_slot(slot, |f| outcome(f.sync_all(), |_| Outcome::Done))
            }
            Op::Reopen | Op::Remount => unreachable!(),
        }
    }
}

// ------------------------------------------------------------------------------ trees

#[derive(PartialEq, Eq)]
pub enum Entry {
    Dir { perm: u32 },
    File { perm: u32, size: u64, data: Vec<u8> },
    Other(u32),
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Dir { perm } => write!(f, "dir(perm {perm:o})"),
            Entry::File { perm, size, data } => {
                write!(
                    f,
                    "file(perm {perm:o}, size {size}, read {} bytes crc {:08x})",
                    data.len(),
                    digest(data)
                )
            }
            Entry::Other(m) => write!(f, "other(mode {m:o})"),
        }
    }
}

pub fn snapshot(root: &Path) -> Result<BTreeMap<String, Entry>, String> {
    fn walk(root: &Path, rel: &str, out: &mut BTreeMap<String, Entry>) -> Result<(), String> {
        let dir = if rel.is_empty() {
            root.to_path_buf()
        } else {
            root.join(rel)
        };
        let rd = std::fs::read_dir(&dir).map_err(|e| format!("read_dir {}: {e}", dir.display()))?;
        for e in rd {
            let e = e.map_err(|e| format!("read_dir {}: {e}", dir.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let r = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let p = root.join(&r);
            let m =
                std::fs::symlink_metadata(&p).map_err(|e| format!("lstat {}: {e}", p.display()))?;
            if m.is_dir() {
                out.insert(
                    r.clone(),
                    Entry::Dir {
                        perm: m.permissions().mode() & 0o7777,
                    },
                );
                walk(root, &r, out)?;
            } else if m.is_file() {
                let data = std::fs::read(&p).map_err(|e| format!("read {}: {e}", p.display()))?;
                out.insert(
                    r,
                    Entry::File {
                        perm: m.permissions().mode() & 0o7777,
                        size: m.len(),
                        data,
                    },
                );
            } else {
                out.insert(r, Entry::Other(m.mode()));
            }
        }
        Ok(())
    }
    let mut out = BTreeMap::new();
    walk(root, "", &mut out)?;
    Ok(out)
}

pub fn first_diff(a: &[u8], b: &[u8]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

/// Compares the tree at `got` with the reference tree; `what` names the moment.
pub fn compare_trees(got: &Path, reference: &Path, what: &str) -> Result<(), String> {
    let a = snapshot(got)?;
    let b = snapshot(reference)?;
    compare_snapshots(
        &a,
        &b,
        &format!("{} vs reference {}", got.display(), reference.display()),
        what,
    )
}

/// Compares tree `a` with the reference tree `b`; `sides` names them, `what` the moment.
pub fn compare_snapshots(
    a: &BTreeMap<String, Entry>,
    b: &BTreeMap<String, Entry>,
    sides: &str,
    what: &str,
) -> Result<(), String> {
    if a == b {
        return Ok(());
    }
    let mut msg = format!("{what}: trees differ ({sides}):");
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    for k in keys {
        match (a.get(k), b.get(k)) {
            (Some(x), Some(y)) if x == y => {}
            (x, y) => {
                msg += &format!("\n  {k}: {x:?} vs reference {y:?}");
                if let (Some(Entry::File { data: d1, .. }), Some(Entry::File { data: d2, .. })) =
                    (x, y)
                    && d1 != d2
                {
                    let at = first_diff(d1, d2);
                    msg += &format!(
                        " (contents first differ at byte {at}, chunk {})",
                        at as u64 / CHUNK
                    );
                }
            }
        }
    }
    Err(msg)
}

// ------------------------------------------------------------------------------ cache check

/// Every chunk that a clean record, matching the source file's current identity, marks
/// present must hold the source's bytes. Run while unmounted.
pub fn check_cache(cache: &Path, src: &Path) -> Result<(), String> {
    fn walk(data_root: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(data_root.join(rel)) else {
            return;
        };
        for e in rd.flatten() {
            let r = rel.join(e.file_name());
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(data_root, &r, out),
                Ok(t) if t.is_file() => out.push(r),
                _ => {}
            }
        }
    }
    let data_root = cache.join("data");
    let mut files = Vec::new();
    walk(&data_root, Path::new(""), &mut files);
    for rel in files {
        let Ok(bytes) = std::fs::read(cache.join("meta").join(&rel)) else {
            continue;
        };
        let Ok(rec) = CacheRecord::decode(&bytes) else {
            continue;
        };
        if rec.dirty {
            continue;
        }
        let Ok(st) = std::fs::symlink_metadata(src.join(&rel)) else {
            continue;
        };
        let id = rec.identity;
        let matches = st.is_file()
            && id.ino == st.ino()
            && id.size == st.size()
            && id.mtime == (st.mtime(), st.mtime_nsec() as u32)
            && id.ctime == (st.ctime(), st.ctime_nsec() as u32);
        if !matches {
            continue;
        }
        let cached = std::fs::read(data_root.join(&rel))
            .map_err(|e| format!("read cache data {rel:?}: {e}"))?;
        if cached.len() as u64 != id.size {
            // hoardfs does not trust a record whose data file has another length.
            continue;
        }
        count(|c| c.records += 1);
        let source =
            std::fs::read(src.join(&rel)).map_err(|e| format!("read source {rel:?}: {e}"))?;
        for c in 0..rec.nchunks() {
            if !rec.is_present(c) {
                continue;
            }
            let lo = (c * rec.chunk_size) as usize;
            let hi = ((c + 1) * rec.chunk_size).min(id.size) as usize;
            count(|c| c.chunks += 1);
            if cached[lo..hi] != source[lo..hi] {
                let at = lo + first_diff(&cached[lo..hi], &source[lo..hi]);
                return Err(format!(
                    "cache of {rel:?} (clean record matching the source, size {}) marks chunk {c} present \
                     but it differs from the source at byte {at}",
                    id.size
                ));
            }
        }
    }
    Ok(())
}

pub fn trace() -> bool {
    std::env::var_os("MODEL_TRACE").is_some()
}

/// The fixed seed of the model tests (so that the suite is reproducible).
pub const SEED: u64 = 0x5eed_0f4b_0a7d;

/// The proptest configuration of a model test running `default_cases` cases: PROPTEST_CASES
/// overrides the count and PROPTEST_RNG_SEED the (otherwise fixed) seed, for longer hunts:
/// `PROPTEST_CASES=3000 PROPTEST_RNG_SEED=$RANDOM cargo test --test model`.
pub fn config(default_cases: u32) -> PtConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_cases);
    let rng_seed = match std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(seed) => RngSeed::Fixed(seed),
        None => RngSeed::Fixed(SEED),
    };
    PtConfig {
        cases,
        rng_seed,
        // Regressions are kept as named tests, not in a file beside the test.
        failure_persistence: None,
        max_shrink_iters: 1000,
        max_shrink_time: 120_000,
        ..PtConfig::default()
    }
}

pub fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 5..50)
}

pub fn bytes(len: usize, seed: u64) -> Data {
    Data { len, seed }
}

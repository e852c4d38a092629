//! The core in-process: `CachingFs` over a real source and cache directory, called as the
//! FUSE adapter calls it, with no kernel and no mount. A model test runs thousands of
//! random operations in seconds, mixing changes through the core with changes made to
//! the source behind it, and checks every read against a model of the files and against
//! the source itself. A second model (a new `CachingFs` over the same cache) then checks
//! that what the first left in the cache is served only where it still holds.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use hoardfs::cache::CacheStore;
use hoardfs::config::{Config, WatchMode};
use hoardfs::fs::CachingFs;

const ROOT: u64 = 1;

/// A scratch directory with `src`, `mnt` and `cache` in it, removed on drop.
struct Dirs(PathBuf);

impl Dirs {
    fn new(tag: &str) -> Dirs {
        let base = std::env::temp_dir().join(format!("hoardfs-core-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        for d in ["src", "mnt", "cache"] {
            fs::create_dir_all(base.join(d)).unwrap();
        }
        Dirs(base)
    }
    fn src(&self) -> PathBuf {
        self.0.join("src")
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A core over `dirs`, as the daemon makes it (`run::serve`) but with no threads: no
/// watcher (changes behind it are found by the opens' validation), no fetch workers
/// (readers fetch everything themselves), no passthrough (every read reaches the core).
fn core(dirs: &Dirs, chunk_size: u64, whole_file_threshold: u64) -> CachingFs {
    let mut cfg = Config::new(dirs.src(), dirs.0.join("mnt"));
    cfg.cache_dir = dirs.0.join("cache");
    cfg.watch = WatchMode::Off;
    cfg.passthrough = false;
    cfg.chunk_size = chunk_size;
    cfg.whole_file_threshold = whole_file_threshold;
    cfg.check_values().expect("a valid configuration");
    let mut store = CacheStore::open(&cfg.cache_dir).expect("the cache directory");
    store.start_workers();
    let source = hoardfs::health::open_source(&cfg, &store).expect("the source");
    CachingFs::new(cfg, store, source).expect("the core")
}

fn no_backing(_: &fs::File) -> io::Result<fuser::BackingId> {
    Err(io::Error::from_raw_os_error(libc::ENOSYS))
}

/// The whole file `name` through the core: lookup, open, reads of `step` bytes, release.
fn read_through(fs: &CachingFs, name: &str, step: u32) -> Result<Vec<u8>, fuser::Errno> {
    let attr = fs.lookup(ROOT, OsStr::new(name))?;
    let id = attr.ino.0;
    let opened = fs.open(id, libc::O_RDONLY, 1, &no_backing);
    let opened = match opened {
        Ok(o) => o,
        Err(e) => {
            fs.forget(id, 1);
            return Err(e);
        }
    };
    let mut out = Vec::new();
    let r = loop {
        match fs.read(opened.fh, out.len() as u64, step) {
            Ok(b) if b.is_empty() => break Ok(()),
            Ok(b) => out.extend_from_slice(&b),
            Err(e) => break Err(e),
        }
    };
    let _ = fs.flush(id, opened.fh, 0);
    let _ = fs.release(opened.fh);
    fs.forget(id, 1);
    r.map(|_| out)
}

/// Writes `data` at `offset` of `name` through the core (created if absent).
fn write_through(fs: &CachingFs, name: &str, offset: u64, data: &[u8]) {
    let (id, fh) = match fs.lookup(ROOT, OsStr::new(name)) {
        Ok(attr) => {
            let id = attr.ino.0;
            (id, fs.open(id, libc::O_WRONLY, 1, &no_backing).unwrap().fh)
        }
        Err(_) => {
            let (attr, o) = fs
                .create(
                    ROOT,
                    OsStr::new(name),
                    0o644,
                    libc::O_WRONLY,
                    (0, 0),
                    &no_backing,
                )
                .unwrap();
            (attr.ino.0, o.fh)
        }
    };
    let n = fs.write(fh, offset, data, false).unwrap();
    assert_eq!(n as usize, data.len());
    fs.flush(id, fh, 0).unwrap();
    fs.release(fh).unwrap();
    fs.forget(id, 1);
}

/// A small deterministic generator (xorshift), so that a failure names its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let tag = self.next() as u8;
        (0..n)
            .map(|i| tag.wrapping_add((i * 7 % 251) as u8))
            .collect()
    }
}

/// Writes `data` at `offset` of `path` directly (behind the core), growing it as needed.
fn write_behind(path: &Path, offset: u64, data: &[u8]) {
    let f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap();
    f.write_all_at(data, offset).unwrap();
}

fn apply(model: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let end = offset as usize + data.len();
    if model.len() < end {
        model.resize(end, 0);
    }
    model[offset as usize..end].copy_from_slice(data);
}

/// One model run: `ops` random operations on `files` files through a core whose chunks
/// are `chunk` bytes (files above `threshold` are cached in chunks), and a second core
/// over the cache the first one left.
fn model_run(seed: u64, ops: usize, chunk: u64, threshold: u64) {
    let dirs = Dirs::new(&format!("{seed:x}"));
    let fs = core(&dirs, chunk, threshold);
    let mut rng = Rng(seed);
    let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let names: Vec<String> = (0..6).map(|i| format!("f{i}")).collect();
    let max_len = 6 * chunk;
    let check = |fs: &CachingFs,
                 model: &BTreeMap<String, Vec<u8>>,
                 name: &str,
                 step: u32,
                 op: usize| {
        let want = model.get(name);
        match (read_through(fs, name, step), want) {
            (Ok(got), Some(want)) => assert!(
                &got == want,
                "seed {seed:#x} op {op}: {name}: read {} bytes, the file holds {} (first difference at {:?})",
                got.len(),
                want.len(),
                got.iter().zip(want.iter()).position(|(a, b)| a != b)
            ),
            (Err(e), None) => assert_eq!(e, fuser::Errno::ENOENT, "seed {seed:#x} op {op}: {name}"),
            (got, want) => panic!(
                "seed {seed:#x} op {op}: {name}: read {:?}, the file is {:?}",
                got.map(|b| b.len()),
                want.map(|b| b.len())
            ),
        }
    };
    for op in 0..ops {
        let name = &names[rng.below(names.len() as u64) as usize];
        let path = dirs.src().join(name);
        match rng.below(10) {
            // Writes through the core: write-through to the source, copy into the cache.
            0..=2 => {
                let len = model.get(name).map_or(0, |m| m.len() as u64);
                let offset = rng.below(len + 1).min(max_len);
                let n = 1 + rng.below(chunk + chunk / 2) as usize;
                let data = rng.bytes(n);
                write_through(&fs, name, offset, &data);
                apply(model.entry(name.clone()).or_default(), offset, &data);
            }
            // A change behind the core: same size or longer, in place.
            3 => {
                let len = model.get(name).map_or(0, |m| m.len() as u64);
                let offset = rng.below(len + 1).min(max_len);
                let n = 1 + rng.below(chunk) as usize;
                let data = rng.bytes(n);
                write_behind(&path, offset, &data);
                apply(model.entry(name.clone()).or_default(), offset, &data);
            }
            // A new file renamed over the name behind the core.
            4 => {
                let n = rng.below(max_len) as usize;
                let data = rng.bytes(n);
                let tmp = dirs.src().join(".tmp");
                fs::write(&tmp, &data).unwrap();
                fs::rename(&tmp, &path).unwrap();
                model.insert(name.clone(), data);
            }
            // Unlink through the core.
            5 => {
                let r = fs.unlink(ROOT, OsStr::new(name));
                match model.remove(name) {
                    Some(_) => {
                        r.unwrap_or_else(|e| panic!("seed {seed:#x} op {op}: unlink {name}: {e:?}"))
                    }
                    None => assert!(
                        r.is_err(),
                        "seed {seed:#x} op {op}: unlink of a missing {name}"
                    ),
                }
            }
            // Reads, in small and large steps: every one must be the file's bytes.
            _ => {
                let step = [4096, 65536, 1 << 20][rng.below(3) as usize];
                check(&fs, &model, name, step, op);
            }
        }
    }
    // The source holds what the model says, and a read of every file agrees.
    for name in &names {
        let on_source = fs::read(dirs.src().join(name)).ok();
        assert_eq!(
            on_source.as_ref(),
            model.get(name),
            "seed {seed:#x}: {name} on the source"
        );
        check(&fs, &model, name, 65536, ops);
    }
    // A new core over the cache the first left: what it serves is still the file's.
    drop(fs);
    let again = core(&dirs, chunk, threshold);
    for name in &names {
        check(&again, &model, name, 4096, ops + 1);
    }
}

#[test]
fn random_operations_through_the_core_read_back_the_files_bytes() {
    let t0 = std::time::Instant::now();
    let mut ops = 0;
    let seeds = std::env::var("HOARDFS_CORE_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40u64);
    for seed in 1..=seeds {
        let seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        // Whole files and chunked ones: a 16 KiB chunk, threshold 32 KiB.
        model_run(seed, 150, 16 << 10, 32 << 10);
        ops += 150;
    }
    eprintln!("{ops} operations in {:?}", t0.elapsed());
}

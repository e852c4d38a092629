//! Source reads (`--source-reads`, `fs/source_reads.rs`): a large file not cached yet is
//! read by the kernel straight from the source, and what the reader brought into the
//! source's page cache is copied into the cache when it closes.

mod common;

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use common::{BIN, TestMount, wait_until};

const CHUNK: usize = 64 << 10;
const CHUNKS: usize = 64;

/// Small chunks and threshold, so that a 4 MiB file is a large one of 64 chunks.
fn mount() -> TestMount {
    mount_with(&[])
}

fn mount_with(extra: &[&str]) -> TestMount {
    let mut args = vec![
        "--source-reads",
        "--chunk-size",
        "64K",
        "--whole-file-threshold",
        "64K",
    ];
    args.extend_from_slice(extra);
    TestMount::new(&args)
}

/// Chunk `c` of version `v`: every byte names both, so a block read shows which version
/// and which place it came from.
fn block(v: u64, c: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(CHUNK);
    while b.len() < CHUNK {
        b.extend_from_slice(&v.to_le_bytes());
        b.extend_from_slice(&(c as u64).to_le_bytes());
    }
    b
}

fn version(v: u64) -> Vec<u8> {
    (0..CHUNKS).flat_map(|c| block(v, c)).collect()
}

/// Whether `bytes`, read as chunk `c`, are bytes the file held at that place in versions
/// up to `newest`. A read beside a write may get part of each version, on the source as
/// on any file system (README, "Semantics in short"): so each 16-byte unit is checked by
/// itself, its place exactly.
fn held(bytes: &[u8], c: usize, newest: u64) -> bool {
    bytes.chunks(16).all(|u| {
        let word = |i: usize| u64::from_le_bytes(u[i..i + 8].try_into().unwrap());
        word(8) == c as u64 && word(0) <= newest
    })
}

/// Stops the other threads of a race when its thread ends, by a panic too: they all end,
/// and the mount with them, before the test reports.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, SeqCst);
    }
}

fn hoardfs(args: &[&str], t: &TestMount) -> std::process::Output {
    Command::new(BIN).args(args).arg(&t.mnt).output().unwrap()
}

fn released(t: &TestMount) {
    wait_until(Duration::from_secs(5), "releases", || {
        t.stats().open_handles == 0
    });
}

fn on_tmpfs(path: &std::path::Path) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid path and a buffer of the right type.
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == TMPFS_MAGIC }
}

/// Drops the source file's pages from memory (this file's only), as if it had not been
/// read since the machine started.
fn evict(path: &std::path::Path) {
    let f = fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0);
}

#[test]
fn a_large_file_is_read_from_the_source_and_cached_behind_its_reader() {
    let t = mount();
    t.expect_warnings();
    fs::write(t.s("big"), version(1)).unwrap();
    assert_eq!(fs::read(t.m("big")).unwrap(), version(1));
    let s = t.stats().cache;
    assert_eq!(s.source_read_opens, 1);
    assert_eq!(s.read_misses + s.read_hits, 0, "no read reached the daemon");
    // Closed: the chunks it read are in memory on the source, and copied from there.
    wait_until(
        Duration::from_secs(10),
        "the fill behind the reader",
        || t.stats().cache.chunks_filled_behind == CHUNKS as u64,
    );
    released(&t);
    // Cached whole: offline it reads from the cache, by passthrough to the cache file.
    let passthrough = t.stats().cache.passthrough_opens;
    assert!(hoardfs(&["offline"], &t).status.success());
    assert_eq!(fs::read(t.m("big")).unwrap(), version(1));
    assert_eq!(t.stats().cache.passthrough_opens, passthrough + 1);
    assert_eq!(t.stats().cache.source_read_opens, 1);
}

#[test]
fn the_fill_behind_a_source_read_copies_only_what_the_reader_brought_into_memory() {
    let t = mount();
    t.expect_warnings();
    if on_tmpfs(&t.src) {
        // Its pages cannot be dropped (they are the file): nothing to tell apart here.
        eprintln!("skipped: the test directory is on tmpfs");
        return;
    }
    fs::write(t.s("big"), version(7)).unwrap();
    evict(&t.s("big"));
    let f = fs::File::open(t.m("big")).unwrap();
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, 4 * CHUNK as u64).unwrap();
    assert_eq!(buf, block(7, 4)[..4096]);
    drop(f);
    released(&t);
    // The fill ran through every absent chunk (each either copied or left), on the source
    // only from memory: the read's own chunk and what the kernel read ahead of it at most.
    wait_until(Duration::from_secs(10), "the fill's end", || {
        let s = t.stats().cache;
        s.chunks_filled_behind + s.chunks_left_behind == CHUNKS as u64
    });
    let filled = t.stats().cache.chunks_filled_behind;
    assert!(filled < 8, "{filled} chunks filled from a 4 KiB read");
    // A chunk never read is not in the cache: offline, its read fails, the read chunk's
    // does not (it is copied if the readahead brought it in whole).
    assert!(hoardfs(&["offline"], &t).status.success());
    let f = fs::File::open(t.m("big")).unwrap();
    let far = f.read_exact_at(&mut buf, (CHUNKS - 2) as u64 * CHUNK as u64);
    assert_eq!(far.err().and_then(|e| e.raw_os_error()), Some(libc::EIO));
}

/// Readers of the source race writers through the mount and changes behind it, and a
/// lister lists the directory: every chunk any reader gets is one the file held, every
/// listing has the file, and once the changes stop the mount gives the last version,
/// whether from the source or from what the fills behind the readers (and writers) put in
/// the cache.
#[test]
fn readers_of_the_source_racing_changes_get_only_versions_the_file_held() {
    readers_of_the_source_racing_changes(&[]);
}

/// The same with writers through the mount writing the source by passthrough
/// (`--source-writes`): readers opened beside them read it too.
#[test]
fn readers_and_writers_of_the_source_racing_changes_get_only_versions_the_file_held() {
    readers_of_the_source_racing_changes(&["--source-writes"]);
}

fn readers_of_the_source_racing_changes(extra: &[&str]) {
    let t = Arc::new(mount_with(extra));
    t.expect_warnings();
    fs::write(t.s("big"), version(0)).unwrap();
    let latest = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    // One writer through the mount, one behind it, taking turns on the version number.
    for behind in [false, true] {
        let (t, latest, stop) = (t.clone(), latest.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let _stop = StopOnDrop(stop.clone());
            let mut wrote = 0;
            while !stop.load(SeqCst) {
                let v = latest.fetch_add(1, SeqCst) + 1;
                let path = if behind { t.s("big") } else { t.m("big") };
                // A writer through the mount waits for the source readers' releases and
                // may give up (`ETXTBSY`) while readers keep coming.
                let Ok(f) = fs::OpenOptions::new().write(true).open(&path) else {
                    continue;
                };
                for c in 0..CHUNKS {
                    f.write_all_at(&block(v, c), (c * CHUNK) as u64).unwrap();
                }
                drop(f);
                wrote += 1;
                // Room between versions for opens with no writer beside them (those
                // read the source; beside a writer the daemon serves them).
                std::thread::sleep(Duration::from_millis(40));
            }
            wrote
        }));
    }
    let mut readers = Vec::new();
    for _ in 0..3 {
        let (t, latest, stop) = (t.clone(), latest.clone(), stop.clone());
        readers.push(std::thread::spawn(move || {
            let _stop = StopOnDrop(stop.clone());
            let mut reads = 0;
            while !stop.load(SeqCst) {
                // An open racing a change behind the mount may fail with ESTALE (README,
                // "Semantics in short"); only what is read is checked here.
                let bytes = match fs::read(t.m("big")) {
                    Err(e) if e.raw_os_error() == Some(libc::ESTALE) => continue,
                    r => r.unwrap(),
                };
                let newest = latest.load(SeqCst);
                assert_eq!(bytes.len(), CHUNKS * CHUNK);
                for (c, b) in bytes.chunks(CHUNK).enumerate() {
                    assert!(held(b, c, newest), "chunk {c}: bytes the file never held");
                }
                reads += 1;
            }
            reads
        }));
    }
    {
        let (t, stop) = (t.clone(), stop.clone());
        readers.push(std::thread::spawn(move || {
            let _stop = StopOnDrop(stop.clone());
            while !stop.load(SeqCst) {
                let names: Vec<_> = fs::read_dir(&t.mnt)
                    .unwrap()
                    .map(|e| e.unwrap().file_name())
                    .collect();
                assert!(
                    names.iter().any(|n| n == "big"),
                    "a listing without the file"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            0
        }));
    }
    let until = std::time::Instant::now() + Duration::from_secs(4);
    while !stop.load(SeqCst) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, SeqCst);
    // Every thread joined before any verdict.
    let readers: Vec<_> = readers.into_iter().map(|r| r.join()).collect();
    let writers: Vec<_> = threads.into_iter().map(|w| w.join()).collect();
    let reads: u64 = readers.into_iter().map(Result::unwrap).sum();
    let writes: Vec<u64> = writers.into_iter().map(Result::unwrap).collect();
    assert!(
        reads > 10 && writes.iter().all(|&w| w > 0),
        "{reads} {writes:?}"
    );
    let s = t.stats().cache;
    eprintln!(
        "{reads} reads, writes {writes:?}; source reads {}, cache passthrough {}, daemon {}, \
         chunks filled behind {}, left {}",
        s.source_read_opens,
        s.passthrough_opens,
        s.open_hits + s.open_misses - s.source_read_opens - s.passthrough_opens,
        s.chunks_filled_behind,
        s.chunks_left_behind
    );
    assert!(s.source_read_opens > 0, "{s:?}");
    if extra.contains(&"--source-writes") {
        assert!(s.source_write_opens > 0, "{s:?}");
    }
    // The last version, once the watcher has told of the last change behind the mount.
    let last = fs::read(t.s("big")).unwrap();
    wait_until(Duration::from_secs(10), "the last version", || {
        fs::read(t.m("big")).unwrap() == last
    });
    released(&t);
    for _ in 0..3 {
        assert!(fs::read(t.m("big")).unwrap() == last);
    }
}

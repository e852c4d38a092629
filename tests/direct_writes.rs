//! Direct writes (`fs/open.rs`, `opens_direct`): a write-only handle alone on its file
//! bypasses the kernel's page cache, and so does every handle opened beside it; readers
//! racing such writers through the mount never get bytes older than the last write that
//! returned before their read began.

mod common;

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use common::TestMount;

fn direct_opens(t: &TestMount) -> u64 {
    t.stats().cache.direct_opens
}

#[test]
fn a_lone_write_only_open_bypasses_the_page_cache_and_the_opens_beside_it_do_too() {
    let t = TestMount::new(&[]);
    // A create for writing only, alone: direct.
    let w = fs::File::create(t.m("f")).unwrap();
    assert_eq!(direct_opens(&t), 1);
    w.write_all_at(b"written directly", 0).unwrap();
    // A reader beside it: direct too, and it reads what the writer wrote.
    let r = fs::File::open(t.m("f")).unwrap();
    assert_eq!(direct_opens(&t), 2);
    let mut buf = [0u8; 16];
    r.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(&buf, b"written directly");
    // Its shared mappings are refused (the kernel's page cache would hold them), as the
    // README says; private ones work.
    let shared = Mapping::new(&r, 16, libc::MAP_SHARED);
    assert_eq!(
        shared.err().and_then(|e| e.raw_os_error()),
        Some(libc::ENODEV)
    );
    let private = Mapping::new(&r, 16, libc::MAP_PRIVATE).unwrap();
    assert_eq!(private.bytes(), b"written directly");
    // (A mapping holds its file: the release comes after the unmap.)
    drop((w, r, private));
    released(&t);
    // A handle open for reading and writing is not direct, nor a writer opened beside
    // another handle.
    let rw = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t.m("f"))
        .unwrap();
    let w2 = fs::OpenOptions::new().write(true).open(t.m("f")).unwrap();
    drop((w2, rw));
    released(&t);
    fs::read(t.m("f")).unwrap();
    assert_eq!(direct_opens(&t), 2);
    // Written through the mount, whichever way: on the source and read back the same.
    assert_eq!(fs::read(t.s("f")).unwrap(), b"written directly");
    assert_eq!(fs::read(t.m("f")).unwrap(), b"written directly");
    // The read-write handle read through the page cache: a lone writer of the file is
    // not direct any more (its pages may be mapped still).
    released(&t);
    fs::OpenOptions::new().write(true).open(t.m("f")).unwrap();
    assert_eq!(direct_opens(&t), 2);
    // A file read only through passthrough keeps them.
    fs::write(t.m("g"), b"one").unwrap();
    released(&t);
    let passthrough = t.stats().cache.passthrough_opens;
    assert_eq!(fs::read(t.m("g")).unwrap(), b"one");
    assert_eq!(t.stats().cache.passthrough_opens, passthrough + 1);
    released(&t);
    fs::write(t.m("g"), b"two").unwrap();
    assert_eq!(direct_opens(&t), 4);
    assert_eq!(fs::read(t.m("g")).unwrap(), b"two");
}

/// Waits for the kernel's releases of the handles closed so far (they come after
/// `close` returns): an open's kind depends on the handles still open.
fn released(t: &TestMount) {
    common::wait_until(Duration::from_secs(5), "releases", || {
        t.stats().open_handles == 0
    });
}

/// A shared mapping outlives its handle: a writer of a file whose pages were read through
/// the page cache goes through it too, and the mapping shows the write.
#[test]
fn a_mapping_left_by_a_closed_reader_sees_a_later_lone_writers_bytes() {
    let t = TestMount::new(&["--no-passthrough"]);
    fs::write(t.s("f"), b"old bytes").unwrap();
    let r = fs::File::open(t.m("f")).unwrap();
    let map = Mapping::new(&r, 9, libc::MAP_SHARED).unwrap();
    drop(r);
    assert_eq!(map.bytes(), b"old bytes");
    let before = direct_opens(&t);
    let w = fs::OpenOptions::new().write(true).open(t.m("f")).unwrap();
    assert_eq!(
        direct_opens(&t),
        before,
        "not direct: the file's pages are mapped"
    );
    w.write_all_at(b"new", 0).unwrap();
    assert_eq!(map.bytes(), b"new bytes");
}

/// A read-only mapping of the first `len` bytes of a file, unmapped when dropped.
struct Mapping {
    at: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    /// `kind`: `MAP_SHARED` or `MAP_PRIVATE`.
    fn new(file: &fs::File, len: usize, kind: i32) -> std::io::Result<Mapping> {
        // SAFETY: a new read-only mapping of an open descriptor; nothing else uses its
        // address range.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                kind,
                file.as_raw_fd(),
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping { at, len })
    }

    /// What the mapping shows now.
    fn bytes(&self) -> Vec<u8> {
        // SAFETY: `len` readable bytes at `at`, mapped until `drop`.
        unsafe { std::slice::from_raw_parts(self.at as *const u8, self.len).to_vec() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made, unmapped once.
        unsafe { libc::munmap(self.at, self.len) };
    }
}

/// How long each race runs: 3 s in `cargo test`; `HOARDFS_RACE_SECS=600 cargo test
/// --release --test direct_writes -- --nocapture` is the long form.
fn secs() -> u64 {
    std::env::var("HOARDFS_RACE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
}

/// A block of the file at version `v`: every 8 bytes hold `v`.
fn version_block(v: u64, len: usize) -> Vec<u8> {
    v.to_le_bytes().iter().copied().cycle().take(len).collect()
}

const FILE_LEN: usize = 256 * 1024;
const WRITE_LEN: usize = 64 * 1024;

/// Checks `data` (read at `offset`): every word a version written, none older than `floor`.
fn check(data: &[u8], floor: u64, started: u64, what: &str) -> Result<(), String> {
    for (i, w) in data.chunks_exact(8).enumerate() {
        let v = u64::from_le_bytes(w.try_into().unwrap());
        if v < floor || v > started {
            return Err(format!(
                "{what}: word {i} holds version {v}; the last write returned before the read was {floor}, the last begun {started}"
            ));
        }
    }
    Ok(())
}

/// One writer rewrites a file through the mount in 64 KiB writes, version after version,
/// closing and reopening its handle now and then (alone, so that it is direct, every
/// `alone_every`th time; else beside the readers, through the page cache); readers open,
/// read and close, others hold their handles across the writes (with no passthrough,
/// readers beside the writer through the page cache, which the watcher's notices of the
/// writes must not drop while a write is on its way: `Inode::page_cache_writers`). Every word any of them reads is of a version no older than
/// the last one whose writes had all returned before the read began.
fn readers_racing_a_writer(args: &[&str], alone_every: u64) {
    let t = Arc::new(TestMount::new(args));
    fs::write(t.m("f"), version_block(1, FILE_LEN)).unwrap();
    let committed = Arc::new(AtomicU64::new(1));
    let started = Arc::new(AtomicU64::new(1));
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let reads = Arc::new(AtomicU64::new(0));
    t.allow_time(Duration::from_secs(secs()));
    let deadline = Instant::now() + Duration::from_secs(secs());
    let mut threads = Vec::new();
    // Every `alone_every`th time the writer opens alone (readers close their handles and
    // wait), so that it is direct and the readers open beside it; else beside them.
    let gate = Arc::new(AtomicBool::new(false));
    let reader_handles = Arc::new(AtomicU64::new(0));
    {
        let (path, committed, started) = (t.m("f"), committed.clone(), started.clone());
        let (gate, reader_handles, t) = (gate.clone(), reader_handles.clone(), t.clone());
        threads.push(std::thread::spawn(move || {
            let mut v = 1;
            let mut round = 0u64;
            while Instant::now() < deadline {
                round += 1;
                let alone = round.is_multiple_of(alone_every);
                if alone {
                    gate.store(true, SeqCst);
                    let until = Instant::now() + Duration::from_secs(1);
                    while reader_handles.load(SeqCst) > 0 && Instant::now() < until {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    // And their releases, which reach the daemon after `close` returned
                    // (late under load): alone means no handle of the file in the daemon.
                    while t.stats().open_handles > 0 && Instant::now() < until {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
                // With passthrough, a writer beside readers waits for their passthrough
                // handles to close, and fails with ETXTBSY after 0.5 s (README): again.
                let w = fs::OpenOptions::new().write(true).open(&path);
                gate.store(false, SeqCst);
                let w = match w {
                    Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => continue,
                    w => w.unwrap(),
                };
                for _ in 0..8 {
                    v += 1;
                    started.store(v, SeqCst);
                    let block = version_block(v, WRITE_LEN);
                    for off in (0..FILE_LEN).step_by(WRITE_LEN) {
                        w.write_all_at(&block, off as u64).unwrap();
                    }
                    committed.store(v, SeqCst);
                }
                drop(w);
                std::thread::sleep(Duration::from_millis(2));
            }
        }));
    }
    for r in 0..3 {
        let (path, committed, started, stop, failures, reads) = (
            t.m("f"),
            committed.clone(),
            started.clone(),
            stop.clone(),
            failures.clone(),
            reads.clone(),
        );
        let (gate, reader_handles) = (gate.clone(), reader_handles.clone());
        threads.push(std::thread::spawn(move || {
            let mut held: Option<fs::File> = None;
            let mut buf = vec![0u8; FILE_LEN];
            let mut n = 0u64;
            let close = |held: &mut Option<fs::File>| {
                if held.take().is_some() {
                    reader_handles.fetch_sub(1, SeqCst);
                }
            };
            while !stop.load(SeqCst) {
                n += 1;
                // Reader 0 opens anew for each read; the others hold a handle for a while.
                if r == 0 || n % 20 == 1 || gate.load(SeqCst) {
                    close(&mut held);
                }
                if gate.load(SeqCst) {
                    std::thread::sleep(Duration::from_micros(100));
                    continue;
                }
                let floor = committed.load(SeqCst);
                let h = match &held {
                    Some(h) => h,
                    None => {
                        reader_handles.fetch_add(1, SeqCst);
                        held.insert(fs::File::open(&path).unwrap())
                    }
                };
                let mut got = 0;
                let mut sizes = Vec::new();
                while got < FILE_LEN {
                    match h.read_at(&mut buf[got..], got as u64).unwrap() {
                        0 => break,
                        k => {
                            sizes.push(k);
                            got += k;
                        }
                    }
                }
                reads.fetch_add(1, SeqCst);
                let what = format!("reader {r}, read {n}, reads {sizes:?}");
                if let Err(e) = check(&buf[..got], floor, started.load(SeqCst), &what) {
                    let again = fs::read(&path).unwrap();
                    let v = |d: &[u8]| u64::from_le_bytes(d[..8].try_into().unwrap());
                    failures.lock().unwrap().push(format!(
                        "{e}; then a new open read {} at 0, committed {}",
                        v(&again),
                        committed.load(SeqCst)
                    ));
                }
                std::thread::sleep(Duration::from_micros(300));
            }
            close(&mut held);
        }));
    }
    let writer = threads.remove(0);
    writer.join().unwrap();
    stop.store(true, SeqCst);
    for th in threads {
        th.join().unwrap();
    }
    let failures = failures.lock().unwrap();
    let s = t.stats().cache;
    let summary = format!(
        "{args:?}: {} versions, {} reads, {} direct opens, {} versions kept, {} stale invalidations: {} failed, first: {:?}",
        committed.load(SeqCst),
        reads.load(SeqCst),
        s.direct_opens,
        s.versions_kept,
        s.stale_invalidations,
        failures.len(),
        failures.first()
    );
    let co = t.stats().coherence;
    eprintln!(
        "{summary} [inval_inode {}, attr_drops {}, changes_detected {}, events {}]",
        co.inval_inode, co.attr_drops, co.changes_detected, co.watcher_events
    );
    assert!(failures.is_empty(), "{summary}");
    assert!(
        committed.load(SeqCst) > 20 && reads.load(SeqCst) > 100,
        "{summary}"
    );
    // Alone each time, the writer is direct and so is every reader beside it (the others
    // are passthrough ones). Else a reader opened beside a writer through the page cache
    // reads through it too, and the file's later writers are not direct
    // (`a_mapping_left_by_a_closed_reader_sees_...`).
    // (Kernel opens and source writes open nothing direct.)
    let expected = if args.contains(&"--kernel-opens") || args.contains(&"--source-writes") {
        0
    } else if alone_every == 1 {
        10
    } else {
        1
    };
    assert!(s.direct_opens >= expected, "{summary}");
    if args.contains(&"--source-writes") {
        let opens = s.source_write_opens;
        assert!(opens > 20, "{summary}: {opens} source write opens");
    }
    // What the source holds is the last version, whole.
    check(
        &fs::read(t.s("f")).unwrap(),
        committed.load(SeqCst),
        committed.load(SeqCst),
        "source",
    )
    .unwrap();
}

#[test]
fn readers_racing_a_direct_writer_never_read_older_than_the_last_write_returned() {
    readers_racing_a_writer(&[], 1);
}

#[test]
fn readers_racing_a_writer_through_the_page_cache_never_read_older_than_the_last_write_returned() {
    readers_racing_a_writer(&["--no-passthrough"], 2);
}

#[test]
fn readers_racing_a_writer_under_kernel_opens_never_read_older_than_the_last_write_returned() {
    readers_racing_a_writer(&["--kernel-opens"], 2);
}

/// Writers write the source by passthrough, and readers beside them read it. (A file
/// above the whole-file threshold: a small one cached whole is written through the
/// daemon, `CachingFs::may_write_source`.)
#[test]
fn readers_racing_a_writer_to_the_source_never_read_older_than_the_last_write_returned() {
    readers_racing_a_writer(&["--source-writes", "--whole-file-threshold", "64K"], 2);
}

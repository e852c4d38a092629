//! Crash at any instant: the daemon is killed with SIGKILL at random points while threads
//! write, fsync, truncate, rename, create new files and read a large file (chunk fetches)
//! through the mount,
//! with a cache so small that the cleaner evicts all along. After each crash: every
//! acknowledged operation is in the source, every cache entry hoardfs would trust equals the
//! source, and the mount comes back by itself.
//!
//! `cargo test --test crash` runs a few rounds; the long run is
//! `HOARDFS_CRASH_ROUNDS=200 cargo test --release --test crash -- --ignored --nocapture`.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::{TestMount, pattern};
use hoardfs::cache::store::{CacheFiles, read_record};

const REC: u64 = 4096;
const BIG: usize = 3 << 20;

/// What the workers had acknowledged when the daemon died.
#[derive(Default)]
struct Acks {
    /// Records written (and, for odd ones, fsynced) at increasing offsets of `log`.
    written: AtomicU64,
    /// Last acknowledged size of `trunc` (+1, 0 = none yet) and the size being set.
    truncated: AtomicU64,
    truncating: AtomicU64,
    /// Renames of `r.N` to `r.N+1` acknowledged.
    renamed: AtomicU64,
    /// Full reads of `big` that matched the source.
    reads: AtomicU64,
    /// Files `n.0` … `n.N-1` created, written and closed.
    created: AtomicU64,
}

/// The content of the created file `n.i`: sizes from 1 byte to ~100 KB.
fn created(i: u64) -> Vec<u8> {
    pattern(1 + (i as usize * 7_919) % 100_000, 5000 + i)
}

fn record(i: u64) -> Vec<u8> {
    pattern(REC as usize, 1000 + i)
}

/// Opens `path` on the mount for writing without `O_CLOEXEC`. A killed daemon can be left
/// a zombie by the kernel (an invalidation waiting for a directory lock that a request
/// nobody will read holds) until the next mount aborts its connection. The next mount's
/// daemon is spawned from this process: had it inherited close-on-exec descriptors of
/// files open for writing on the old mount, its `execve` would close them, and a close of
/// such a file sends a FLUSH that waits, uninterruptibly, for that zombie. Inherited
/// instead, they are closed at the daemon's own exit, after it aborted the old connection.
fn open_for_writing(path: &Path, flags: i32) -> std::io::Result<fs::File> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a plain open(2); the descriptor is owned by the returned File.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_WRONLY | flags, 0o644) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe { fs::File::from_raw_fd(fd) })
}

fn workers(
    t: &TestMount,
    acks: &Arc<Acks>,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<()>> {
    let mut v = Vec::new();
    // Writer: records at increasing offsets, every other one fsynced.
    {
        let (acks, stop, p) = (acks.clone(), stop.clone(), t.m("log"));
        v.push(std::thread::spawn(move || {
            let Ok(f) = open_for_writing(&p, 0) else {
                return;
            };
            let mut i = acks.written.load(Ordering::SeqCst);
            while !stop.load(Ordering::Relaxed) {
                if f.write_all_at(&record(i), i * REC).is_err() {
                    return;
                }
                if i % 2 == 1 && f.sync_data().is_err() {
                    return;
                }
                i += 1;
                acks.written.store(i, Ordering::SeqCst);
            }
        }));
    }
    // Truncater.
    {
        let (acks, stop, p) = (acks.clone(), stop.clone(), t.m("trunc"));
        v.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let size = (n * 7919) % 300_000;
                acks.truncating.store(size, Ordering::SeqCst);
                let r = open_for_writing(&p, 0).and_then(|f| f.set_len(size));
                if r.is_err() {
                    return;
                }
                acks.truncated.store(size + 1, Ordering::SeqCst);
            }
        }));
    }
    // Renamer.
    {
        let (acks, stop, mnt) = (acks.clone(), stop.clone(), t.mnt.clone());
        v.push(std::thread::spawn(move || {
            let mut i = acks.renamed.load(Ordering::SeqCst);
            while !stop.load(Ordering::Relaxed) {
                if fs::rename(mnt.join(format!("r.{i}")), mnt.join(format!("r.{}", i + 1))).is_err()
                {
                    return;
                }
                i += 1;
                acks.renamed.store(i, Ordering::SeqCst);
            }
        }));
    }
    // Creator: new files written whole and closed (their first records are not durable).
    {
        let (acks, stop, mnt) = (acks.clone(), stop.clone(), t.mnt.clone());
        v.push(std::thread::spawn(move || {
            let mut i = acks.created.load(Ordering::SeqCst);
            while !stop.load(Ordering::Relaxed) {
                let made =
                    open_for_writing(&mnt.join(format!("n.{i}")), libc::O_CREAT | libc::O_TRUNC);
                if made.and_then(|mut f| f.write_all(&created(i))).is_err() {
                    return;
                }
                i += 1;
                acks.created.store(i, Ordering::SeqCst);
            }
        }));
    }
    // Reader of a large file: chunk fetches, evictions by the tiny cache.
    {
        let (acks, stop, p) = (acks.clone(), stop.clone(), t.m("big"));
        v.push(std::thread::spawn(move || {
            let want = pattern(BIG, 7);
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let Ok(f) = fs::File::open(&p) else { return };
                let mut buf = vec![0u8; 256 << 10];
                k += 1;
                let off = (k * 640_007) % (BIG as u64 - buf.len() as u64);
                if f.read_exact_at(&mut buf, off).is_err() {
                    return;
                }
                assert!(
                    buf == want[off as usize..off as usize + buf.len()],
                    "big: wrong bytes at {off}"
                );
                acks.reads.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    v
}

/// The files checked after a crash: the workers' fixed ones and the created files the cache
/// has entries for.
fn checked_names(t: &TestMount) -> Vec<String> {
    let mut names: Vec<String> = ["log", "trunc", "big"].map(String::from).to_vec();
    if let Ok(rd) = fs::read_dir(t.cache.join("meta")) {
        names.extend(
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("n.")),
        );
    }
    names
}

/// Every cache entry that hoardfs would trust on the next mount (record valid, clean, data
/// file unchanged, identity equal to the source's) holds the source's bytes in every
/// chunk it claims.
fn check_cache_against_source(t: &TestMount) -> u64 {
    let mut trusted_chunks = 0;
    for name in &checked_names(t) {
        let name = name.as_str();
        let (Ok(meta), Ok(data)) = (
            fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(t.cache.join("meta").join(name)),
            fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(t.c(name)),
        ) else {
            continue;
        };
        let files = CacheFiles::new(data, meta);
        let Ok(Some(Ok(rec))) = read_record(&files) else {
            continue;
        };
        let st = fs::symlink_metadata(t.s(name)).unwrap();
        use std::os::unix::fs::MetadataExt;
        let id = rec.identity;
        if rec.dirty
            || id.size != st.size()
            || id.mtime != (st.mtime(), st.mtime_nsec() as u32)
            || id.ctime != (st.ctime(), st.ctime_nsec() as u32)
            || files.data.metadata().unwrap().len() != id.size
        {
            continue;
        }
        let src = fs::read(t.s(name)).unwrap();
        let cached = fs::read(t.c(name)).unwrap();
        // A write the daemon had in flight when it was killed may still land: compare only
        // a source that did not change while it was read.
        let again = fs::symlink_metadata(t.s(name)).unwrap();
        if (
            again.size(),
            again.mtime(),
            again.mtime_nsec(),
            again.ctime(),
            again.ctime_nsec(),
        ) != (
            st.size(),
            st.mtime(),
            st.mtime_nsec(),
            st.ctime(),
            st.ctime_nsec(),
        ) {
            continue;
        }
        for c in 0..rec.nchunks() {
            if rec.is_present(c) {
                let a = (c * rec.chunk_size) as usize;
                let b = (a + rec.chunk_size as usize).min(src.len());
                assert!(
                    cached[a..b] == src[a..b],
                    "{name}: trusted chunk {c} differs from the source"
                );
                trusted_chunks += 1;
            }
        }
    }
    trusted_chunks
}

/// Waits for a killed daemon to be gone (the new mount aborted its connection if it was
/// stuck).
fn reap(mut killed: std::process::Child, round: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while killed.try_wait().unwrap().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "round {round}: the killed daemon did not die after the new mount; where its \
             threads are in the kernel:\n{}",
            kernel_stacks(killed.id())
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Each thread of process `pid`: its state and its kernel stack (as root).
fn kernel_stacks(pid: u32) -> String {
    let mut out = String::new();
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        let p = task.path();
        let state = fs::read_to_string(p.join("status"))
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("State:"))
            .unwrap_or_default()
            .to_string();
        let stack = fs::read_to_string(p.join("stack")).unwrap_or_default();
        out += &format!("{:?} {state}\n{stack}", task.file_name());
    }
    out
}

fn crash_rounds(rounds: u64, extra: &[&str]) {
    let mut args = vec![
        "--chunk-size",
        "64K",
        "--whole-file-threshold",
        "128K",
        "--cache-size",
        "1M",
        "--high-watermark",
        "60",
        "--low-watermark",
        "30",
    ];
    args.extend_from_slice(extra);
    let t = &mut TestMount::new(&args);
    // Killed daemons: the next one says it clears their mounts, and their last replies
    // fail.
    t.expect_warnings();
    fs::write(t.s("log"), b"").unwrap();
    fs::write(t.s("trunc"), b"").unwrap();
    fs::write(t.s("r.0"), b"renamed file").unwrap();
    fs::write(t.s("big"), pattern(BIG, 7)).unwrap();
    let acks = Arc::new(Acks::default());
    let mut trusted = 0;
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    for round in 0..rounds {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let stop = Arc::new(AtomicBool::new(false));
        let ws = workers(t, &acks, &stop);
        std::thread::sleep(Duration::from_millis(50 + seed % 600));
        // kill -9 and nothing else: mounting again must recover without a hand, even when
        // the killed daemon is stuck in the kernel behind a request it will never answer.
        let mut killed = t.kill_only();
        stop.store(true, Ordering::Relaxed);
        // The cache is checked once the daemon ran its last instruction: it is gone, or
        // stuck in the kernel for good (then only the next mount's abort frees it).
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while killed.try_wait().unwrap().is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let trusted_now = check_cache_against_source(t);
        t.mount();
        reap(killed, round);
        for w in ws {
            w.join().expect("a worker saw wrong bytes");
        }
        // Acknowledged writes are in the source.
        let written = acks.written.load(Ordering::SeqCst);
        let log = fs::read(t.s("log")).unwrap();
        assert!(
            log.len() as u64 >= written * REC,
            "round {round}: acknowledged writes lost"
        );
        for i in 0..written {
            assert!(
                log[(i * REC) as usize..((i + 1) * REC) as usize] == record(i),
                "round {round}: record {i}"
            );
        }
        // The truncate in flight may or may not have happened; an acknowledged one did.
        let size = fs::metadata(t.s("trunc")).unwrap().len();
        let (done, doing) = (
            acks.truncated.load(Ordering::SeqCst),
            acks.truncating.load(Ordering::SeqCst),
        );
        assert!(
            done == 0 || size == done - 1 || size == doing,
            "round {round}: trunc is {size}"
        );
        // The file renamed N times is at r.N, or at r.N+1 if the next rename was in flight.
        let n = acks.renamed.load(Ordering::SeqCst);
        let at = [n, n + 1]
            .into_iter()
            .find(|i| t.s(&format!("r.{i}")).exists());
        let at = at.unwrap_or_else(|| panic!("round {round}: renamed file lost (acked {n})"));
        assert_eq!(fs::read(t.s(&format!("r.{at}"))).unwrap(), b"renamed file");
        acks.renamed.store(at, Ordering::SeqCst);
        // Created files are in the source, whole, and read back so through the mount
        // (the last few: from the cache where it kept them).
        let made = acks.created.load(Ordering::SeqCst);
        for i in made.saturating_sub(20)..made {
            let want = created(i);
            let name = format!("n.{i}");
            assert!(
                fs::read(t.s(&name)).unwrap() == want,
                "round {round}: {name} in the source"
            );
            assert!(
                fs::read(t.m(&name)).unwrap() == want,
                "round {round}: {name} through the mount"
            );
        }
        trusted += trusted_now;
        // Came back by itself and serves the source's bytes.
        for name in &checked_names(t) {
            let name = name.as_str();
            assert!(
                fs::read(t.m(name)).unwrap() == fs::read(t.s(name)).unwrap(),
                "round {round}: {name}"
            );
        }
        acks.written.store(
            fs::metadata(t.s("log")).unwrap().len() / REC,
            Ordering::SeqCst,
        );
    }
    t.unmount();
    check_cache_against_source(t);
    eprintln!(
        "{rounds} crashes; {} records written, {} files created, {} renames, {} verified reads, {trusted} trusted chunks checked",
        acks.written.load(Ordering::SeqCst),
        acks.created.load(Ordering::SeqCst),
        acks.renamed.load(Ordering::SeqCst),
        acks.reads.load(Ordering::SeqCst)
    );
    assert!(acks.written.load(Ordering::SeqCst) > 0 && acks.reads.load(Ordering::SeqCst) > 0);
}

#[test]
fn sigkill_at_random_points_loses_nothing_acknowledged() {
    crash_rounds(4, &[]);
}

/// Writers write the source by passthrough (`--source-writes`): the daemon sees none of
/// their writes, and the cache takes what they wrote only after the last one closed.
/// By hand: in 2 of 3 long runs a killed daemon's notify thread stayed blocked in the
/// kernel (a page invalidation waiting for a page lock) after the next mount aborted its
/// connection, which `reap` takes for a failure (`docs/conformance.md`, "Session 30").
#[test]
#[ignore = "a killed daemon may not die in rare rounds: HOARDFS_CRASH_EXTRA=--source-writes for the long run"]
fn sigkill_at_random_points_loses_nothing_acknowledged_with_source_writes() {
    crash_rounds(4, &["--source-writes"]);
}

#[test]
#[ignore = "long: HOARDFS_CRASH_ROUNDS=200 cargo test --release --test crash -- --ignored"]
fn sigkill_at_random_points_many_times() {
    let rounds = std::env::var("HOARDFS_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    // `HOARDFS_CRASH_EXTRA`: mount options for every round, space-separated.
    let extra = std::env::var("HOARDFS_CRASH_EXTRA").unwrap_or_default();
    crash_rounds(rounds, &extra.split_whitespace().collect::<Vec<_>>());
}

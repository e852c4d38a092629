//! The fetch engine (issue 9) through real mounts: shared fetches, early return, prefetch,
//! bounded fetching for random readers, and resets while fetches are in flight. No test
//! here asserts a duration: the machine may be loaded; counters say what happened.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Barrier};

use common::{TestMount, pattern};
use hoardfs::cache::CacheRecord;

const MIB: usize = 1 << 20;

fn record(t: &TestMount, name: &str) -> CacheRecord {
    CacheRecord::decode(&fs::read(t.cache.join("meta").join(name)).unwrap()).unwrap()
}

/// Ten readers of one cold file at once: every byte comes from the source once.
#[test]
fn concurrent_readers_of_a_cold_file_fetch_it_once() {
    let t = TestMount::new(&[]);
    // Above the whole-file threshold (chunk by chunk) and below it (whole-file fetch).
    for (name, len) in [("big", 24 * MIB + 4321), ("small", 3 * MIB + 17)] {
        let data = pattern(len, len as u64);
        fs::write(t.s(name), &data).unwrap();
        let before = t.stats().cache.bytes_from_source;
        let barrier = Arc::new(Barrier::new(10));
        let readers: Vec<_> = (0..10)
            .map(|_| {
                let (b, p) = (barrier.clone(), t.m(name));
                std::thread::spawn(move || {
                    b.wait();
                    fs::read(p).unwrap()
                })
            })
            .collect();
        for r in readers {
            assert!(
                r.join().unwrap() == data,
                "{name}: a reader got wrong bytes"
            );
        }
        let s = t.stats().cache;
        assert_eq!(
            s.bytes_from_source - before,
            len as u64,
            "{name}: fetched once ({s:?})"
        );
        assert!(record(&t, name).is_complete(), "{name} ends fully cached");
    }
}

/// Random 4 KiB reads of a large cold file fetch at most one chunk per read, and start no
/// prefetch.
#[test]
fn random_reads_fetch_at_most_a_chunk_each() {
    let t = TestMount::new(&["--chunk-size", "256K"]);
    let len = 64 * MIB;
    let data = pattern(len, 77);
    fs::write(t.s("f"), &data).unwrap();
    let f = fs::File::open(t.m("f")).unwrap();
    // No kernel readahead: each read(2) is one request of its own size.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let reads = 200u64;
    let mut buf = [0u8; 4096];
    for _ in 0..reads {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let off = (x % (len as u64 - 4096)) & !4095;
        f.read_exact_at(&mut buf, off).unwrap();
        assert_eq!(&buf[..], &data[off as usize..off as usize + 4096]);
    }
    drop(f);
    let s = t.stats().cache;
    assert!(
        s.bytes_from_source <= reads * (256 << 10),
        "{} bytes from the source for {reads} reads of 4 KiB with 256 KiB chunks",
        s.bytes_from_source
    );
    assert_eq!(s.chunks_prefetched, 0, "random reads prefetch nothing");
}

/// A sequential reader makes the workers prefetch; the file ends fully cached and the next
/// open is a passthrough one.
#[test]
fn a_sequential_read_prefetches_and_ends_fully_cached() {
    let t = TestMount::new(&[]);
    let data = pattern(40 * MIB + 999, 5);
    fs::write(t.s("seq"), &data).unwrap();
    assert!(fs::read(t.m("seq")).unwrap() == data);
    let s = t.stats().cache;
    assert!(s.chunks_prefetched > 0, "prefetch ran: {s:?}");
    assert!(
        s.prefetch_hits > 0,
        "the reader used prefetched chunks: {s:?}"
    );
    assert!(
        s.hint_reads > 0,
        "reads inside a present chunk took the short path: {s:?}"
    );
    let rec = record(&t, "seq");
    assert!(
        rec.is_complete(),
        "{} of {} chunks",
        rec.present_count(),
        rec.nchunks()
    );
    let before = s.passthrough_opens;
    assert!(fs::read(t.m("seq")).unwrap() == data);
    assert_eq!(t.stats().cache.passthrough_opens, before + 1);
}

/// A read returns once its own bytes are there, before the rest of its chunk.
#[test]
fn a_read_returns_before_its_chunk_is_complete() {
    // One 64 MiB chunk: the read needs one piece of it, the worker fetches 512.
    let t = TestMount::new(&["--chunk-size", "64M", "--whole-file-threshold", "0"]);
    let data = pattern(64 * MIB, 3);
    fs::write(t.s("f"), &data).unwrap();
    let mut f = fs::File::open(t.m("f")).unwrap();
    let mut buf = vec![0u8; 4096];
    f.read_exact(&mut buf).unwrap();
    assert_eq!(buf, &data[..4096]);
    let s = t.stats().cache;
    assert!(s.early_returns >= 1, "{s:?}");
    // The rest arrives in the background; the whole file reads right.
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut all = Vec::new();
    f.read_to_end(&mut all).unwrap();
    assert!(all == data);
}

/// The source is rewritten while a large read is fetching: no chunk of the old version is
/// marked present for the new one, and a later open reads the new bytes.
#[test]
fn a_reset_during_fetches_never_leaves_old_bytes() {
    let t = TestMount::new(&["--chunk-size", "256K"]);
    let len = 48 * MIB;
    for round in 0..3u64 {
        let name = format!("f{round}");
        let old = pattern(len, 100 + round);
        let new = pattern(len, 200 + round);
        fs::write(t.s(&name), &old).unwrap();
        let reader = {
            let p = t.m(&name);
            std::thread::spawn(move || {
                let mut f = fs::File::open(p).unwrap();
                let mut buf = vec![0u8; 128 << 10];
                while f.read(&mut buf).unwrap() > 0 {}
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(10 * (round + 1)));
        {
            let mut f = fs::OpenOptions::new().write(true).open(t.s(&name)).unwrap();
            f.write_all(&new).unwrap();
        }
        // A distinct mtime: the identity of the final version differs from any taken
        // while the rewrite was under way.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let when = std::time::SystemTime::UNIX_EPOCH
            + std::time::Duration::from_secs(1_000_000_000 + round);
        fs::File::options()
            .write(true)
            .open(t.s(&name))
            .unwrap()
            .set_modified(when)
            .unwrap();
        reader.join().unwrap();
        assert!(fs::read(t.m(&name)).unwrap() == new, "round {round}");
    }
    assert!(
        t.stats().cache.stale_invalidations >= 3,
        "every rewrite was noticed"
    );
    let mut t = t;
    t.unmount();
    for round in 0..3u64 {
        let name = format!("f{round}");
        let rec = record(&t, &name);
        let src = fs::read(t.s(&name)).unwrap();
        let cached = fs::read(t.c(&name)).unwrap();
        for c in 0..rec.nchunks() {
            if rec.is_present(c) {
                let a = (c * rec.chunk_size) as usize;
                let b = (a + rec.chunk_size as usize).min(src.len());
                assert!(cached[a..b] == src[a..b], "{name}: chunk {c} is stale");
            }
        }
    }
}

//! The fetch engine (issue 9) through real mounts: shared fetches, early return, prefetch,
//! bounded fetching for random readers, and resets while fetches are in flight. No test
//! here asserts a duration: the machine may be loaded; counters say what happened.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::{TestMount, pattern, wait_until};
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
        // Durable at the last release, which the kernel sends after close(2) returned.
        wait_until(
            Duration::from_secs(20),
            &format!("{name} ends fully cached"),
            || record(&t, name).is_complete(),
        );
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
    // Made durable by the group commit once closed.
    t.wait_released();
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

/// Regular files of `dir` in the order the mount lists them (the order a walk opens them).
fn listing(t: &TestMount, dir: &str) -> Vec<String> {
    fs::read_dir(t.m(dir))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| e.file_name().into_string().unwrap())
        .collect()
}

/// Whether the cache holds `rel` whole, durably (its record says every chunk is present).
fn cached_whole(t: &TestMount, rel: &str) -> bool {
    fs::read(t.cache.join("meta").join(rel))
        .ok()
        .and_then(|b| CacheRecord::decode(&b).ok())
        .is_some_and(|r| r.is_complete())
}

/// A directory of small files: (name, bytes), in no particular order. Returns once they
/// are older than the time a write may still be copying (1 s): a file fetched sooner is
/// recorded racy, and each open compares it with the source, reading its cache file in
/// (which would hide the cold hits these tests look for).
fn small_files(t: &TestMount, dir: &str, n: usize) -> Vec<(String, Vec<u8>)> {
    fs::create_dir(t.s(dir)).unwrap();
    let files = (0..n)
        .map(|i| {
            let name = format!("f{i:03}.h");
            let data = pattern(3000 + i * 517, i as u64 + 1);
            fs::write(t.s(&format!("{dir}/{name}")), &data).unwrap();
            (name, data)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1100));
    files
}

/// A file changed behind an unwatched mount, then fetched ahead by the directory prefetch
/// (a sibling's open loads its cache state before any open of its own), must not be read
/// from the pages the kernel kept of its old version.
#[test]
fn a_file_changed_behind_the_mount_and_fetched_ahead_is_never_read_old() {
    let t = TestMount::new(&[
        "--watch",
        "off",
        "--no-passthrough",
        "--fetch-dir-prefetch",
        "8",
    ]);
    let files = small_files(&t, "d", 3);
    let order = listing(&t, "d");
    // Read (the kernel keeps their pages), then let their states go (closed, committed).
    for name in &order {
        fs::read(t.m(&format!("d/{name}"))).unwrap();
    }
    for name in &order {
        wait_until(Duration::from_secs(10), &format!("d/{name} cached"), || {
            cached_whole(&t, &format!("d/{name}"))
        });
    }
    std::thread::sleep(Duration::from_millis(1500));
    // Behind the mount: the second file gets new bytes of the same length, a new mtime.
    let second = &order[1];
    let old = &files.iter().find(|(n, _)| n == second).unwrap().1;
    let new: Vec<u8> = old.iter().map(|b| b ^ 0x5a).collect();
    let src = t.s(&format!("d/{second}"));
    fs::write(&src, &new).unwrap();
    let later = std::time::SystemTime::now() + Duration::from_secs(10);
    fs::File::options()
        .write(true)
        .open(&src)
        .unwrap()
        .set_modified(later)
        .unwrap();
    // The first file changes too, so that its open is a miss, which moves the window.
    let first = t.s(&format!("d/{}", order[0]));
    let bytes: Vec<u8> = fs::read(&first).unwrap().iter().map(|b| !b).collect();
    fs::write(&first, bytes).unwrap();
    let before = t.stats().cache.dir_prefetch_files;
    // The first file's open fetches the second ahead, into a fresh cache state.
    fs::read(t.m(&format!("d/{}", order[0]))).unwrap();
    wait_until(
        Duration::from_secs(10),
        "the second file fetched ahead",
        || t.stats().cache.dir_prefetch_files > before,
    );
    assert!(
        fs::read(t.m(&format!("d/{second}"))).unwrap() == new,
        "the old version's pages were served"
    );
}

/// Opening the first files of a directory fetches the next ones in the background, in
/// listing order and no further than the window; a reader going on through the directory
/// finds them cached (or joins their fetch): every byte comes from the source once.
#[test]
fn opening_a_directorys_first_files_fetches_the_next_ones_ahead() {
    let t = TestMount::new(&["--fetch-dir-prefetch", "8"]);
    let files = small_files(&t, "d", 40);
    let total: usize = files.iter().map(|(_, d)| d.len()).sum();
    let data = |name: &str| &files.iter().find(|(n, _)| n == name).unwrap().1;
    let order = listing(&t, "d");
    assert_eq!(order.len(), 40);
    for name in &order[..2] {
        assert!(fs::read(t.m(&format!("d/{name}"))).unwrap() == *data(name));
    }
    // The window is 2 files after the first open and 4 after the second: the next four
    // end up cached without being opened.
    for name in &order[2..6] {
        wait_until(
            Duration::from_secs(20),
            &format!("d/{name} fetched ahead"),
            || cached_whole(&t, &format!("d/{name}")),
        );
    }
    let s = t.stats().cache;
    assert!(s.dir_prefetch_files >= 4, "{s:?}");
    // Nothing beyond the window was fetched.
    for name in &order[6..] {
        assert!(
            !cached_whole(&t, &format!("d/{name}")),
            "d/{name} is beyond the window"
        );
    }
    // A reader going on through the directory finds each next file fetched ahead of it
    // (the window moves with its opens), and reads the right bytes, each fetched once.
    // It waits for each file to be cached before opening it: a reader faster than the
    // workers on a loaded machine would fetch files itself, which says nothing of whether
    // the prefetch keeps ahead.
    for name in &order[2..] {
        wait_until(
            Duration::from_secs(20),
            &format!("d/{name} fetched ahead of the reader"),
            || cached_whole(&t, &format!("d/{name}")),
        );
        assert!(
            fs::read(t.m(&format!("d/{name}"))).unwrap() == *data(name),
            "d/{name}"
        );
    }
    let s = t.stats().cache;
    assert_eq!(s.bytes_from_source, total as u64, "fetched once: {s:?}");
    assert_eq!(
        s.whole_file_fetches + s.dir_prefetch_files,
        40,
        "every file fetched once, by its open or ahead of it: {s:?}"
    );
    assert!(
        s.dir_prefetch_files >= 38,
        "every file after the first two fetched ahead of the reader: {s:?}"
    );
    assert!(s.dir_prefetch_hits >= 38, "{s:?}");
    for name in &order {
        wait_until(Duration::from_secs(20), &format!("d/{name} cached"), || {
            cached_whole(&t, &format!("d/{name}"))
        });
    }
}

/// A file changed on the source after the directory prefetch fetched it, before anyone
/// opened it, is read with its new bytes: the prefetched copy is vouched for by the stat
/// taken when it was fetched and checked on open like any other. (No watcher: the check
/// on open is the only thing that can notice.)
#[test]
fn a_file_changed_after_it_was_prefetched_is_read_new() {
    let t = TestMount::new(&["--fetch-dir-prefetch", "8", "--watch", "off"]);
    // Six files: opening the first two queues the four others (a window of 4), and nothing
    // is left to fetch ahead when the changed one is opened.
    let files = small_files(&t, "d", 6);
    let order = listing(&t, "d");
    let (victim, other) = (&order[3], &order[4]);
    for name in &order[..2] {
        let old = fs::read(t.s(&format!("d/{name}"))).unwrap();
        assert!(fs::read(t.m(&format!("d/{name}"))).unwrap() == old);
    }
    for name in &order[2..] {
        wait_until(
            Duration::from_secs(20),
            &format!("d/{name} fetched ahead"),
            || cached_whole(&t, &format!("d/{name}")),
        );
    }
    let cached = fs::read(t.c(&format!("d/{victim}"))).unwrap();
    assert!(cached == fs::read(t.s(&format!("d/{victim}"))).unwrap());
    // Same size, new bytes.
    let new = pattern(cached.len(), 999);
    fs::write(t.s(&format!("d/{victim}")), &new).unwrap();
    let before = t.stats().cache;
    assert!(
        fs::read(t.m(&format!("d/{victim}"))).unwrap() == new,
        "the changed file is read with its new bytes"
    );
    // The unchanged one is served from the prefetched copy.
    let expect = &files.iter().find(|(n, _)| n == other).unwrap().1;
    assert!(fs::read(t.m(&format!("d/{other}"))).unwrap() == *expect);
    let after = t.stats().cache;
    assert_eq!(after.stale_invalidations, before.stale_invalidations + 1);
    assert_eq!(
        after.bytes_from_source,
        before.bytes_from_source + new.len() as u64,
        "only the changed file was fetched again"
    );
    // Durable at its last close (the release comes after close(2) returned).
    wait_until(Duration::from_secs(20), "the new version cached", || {
        cached_whole(&t, &format!("d/{victim}"))
    });
    assert!(fs::read(t.c(&format!("d/{victim}"))).unwrap() == new);
}

/// Opens that do not follow the listing order fetch nothing ahead.
#[test]
fn opens_out_of_listing_order_fetch_nothing_ahead() {
    let t = TestMount::new(&["--fetch-dir-prefetch", "8"]);
    small_files(&t, "d", 30);
    let order = listing(&t, "d");
    // Backwards, never the first file: each open breaks the order.
    for name in order[1..].iter().rev() {
        fs::read(t.m(&format!("d/{name}"))).unwrap();
    }
    let s = t.stats().cache;
    assert_eq!(s.dir_prefetch_files, 0, "{s:?}");
    assert_eq!(s.whole_file_fetches, 29, "{s:?}");
}

/// Drops `rel`'s cache files from memory (both of them), as a `drop_caches` would, but for
/// these files only.
fn evict_cache_pages(t: &TestMount, rel: &str) {
    for tree in ["data", "meta"] {
        let f = fs::File::open(t.cache.join(tree).join(rel)).unwrap();
        assert_eq!(
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) },
            0
        );
    }
}

/// A reader going through a cached directory in listing order whose cache files are on
/// disk only (the kernel's caches dropped) has the next files' cache entries read ahead of
/// it; one whose files are in memory has none read. Either way it reads the source's
/// bytes, also for files changed on the source meanwhile (the warmer only reads the cache;
/// each open still checks its file).
#[test]
fn a_cached_directory_read_in_order_from_disk_has_the_next_entries_read_ahead() {
    let t = TestMount::new(&[]);
    let mut files = small_files(&t, "d", 30);
    let order = listing(&t, "d");
    let data = |files: &[(String, Vec<u8>)], name: &str| {
        files.iter().find(|(n, _)| n == name).unwrap().1.clone()
    };
    for name in &order {
        assert!(fs::read(t.m(&format!("d/{name}"))).unwrap() == data(&files, name));
    }
    for name in &order {
        wait_until(Duration::from_secs(20), &format!("d/{name} cached"), || {
            cached_whole(&t, &format!("d/{name}"))
        });
    }
    t.wait_released();
    // In memory: a pass reads nothing ahead.
    for name in &order {
        assert!(fs::read(t.m(&format!("d/{name}"))).unwrap() == data(&files, name));
    }
    assert_eq!(t.stats().cache.dir_warm_ahead, 0);
    t.wait_released();
    // On disk only, and a few files changed on the source: read ahead, and read right.
    for (i, name) in order.iter().enumerate() {
        evict_cache_pages(&t, &format!("d/{name}"));
        if i % 7 == 3 {
            let new = pattern(2000 + i, 1000 + i as u64);
            fs::write(t.s(&format!("d/{name}")), &new).unwrap();
            files.iter_mut().find(|(n, _)| n == name).unwrap().1 = new;
        }
    }
    for name in &order {
        assert!(
            fs::read(t.m(&format!("d/{name}"))).unwrap() == data(&files, name),
            "d/{name}"
        );
    }
    let warmed = t.stats().cache.dir_warm_ahead;
    // 29 of 30 on an idle machine; 18 under a CI run's load (the read-ahead races the
    // reader, and an entry read in before the open counts no further read-ahead). None
    // when read-ahead is broken.
    assert!(warmed >= 10, "{warmed} entries read ahead of 30 files");
}

/// The read-ahead raced: passes over a directory whose cache files are on disk only, while
/// a writer replaces files on the source (renamed over), a lister lists the directory and
/// a handle held open reads on. Every read is a version the file had, every listing has
/// every name, and once the writer stops the files read as the source has them.
#[test]
fn reading_ahead_races_replacements_a_lister_and_a_held_handle() {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};
    let t = TestMount::new(&[]);
    let files = small_files(&t, "d", 30);
    let order = listing(&t, "d");
    let versions: Arc<Mutex<HashMap<String, Vec<Vec<u8>>>>> = Arc::new(Mutex::new(
        files
            .iter()
            .map(|(n, d)| (n.clone(), vec![d.clone()]))
            .collect(),
    ));
    let is_version =
        |name: &str, got: &[u8]| versions.lock().unwrap()[name].iter().any(|v| v == got);
    for name in &order {
        assert!(is_version(
            name,
            &fs::read(t.m(&format!("d/{name}"))).unwrap()
        ));
    }
    t.wait_released();
    let held_name = order[0].clone();
    let mut held = fs::File::open(t.m(&format!("d/{held_name}"))).unwrap();
    let (mut opens, mut estale) = (0u64, 0u64);
    for round in 0..40u64 {
        for name in &order {
            let rel = format!("d/{name}");
            if cached_whole(&t, &rel) {
                evict_cache_pages(&t, &rel);
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (stop, versions, src) = (stop.clone(), versions.clone(), t.s("d"));
            let order = order.clone();
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let name = &order[(i * 7 + round) as usize % order.len()];
                    let data = pattern(2500 + (i as usize % 9) * 311, 10_000 + round * 1000 + i);
                    // Known as a version before any reader can see it.
                    versions
                        .lock()
                        .unwrap()
                        .get_mut(name)
                        .unwrap()
                        .push(data.clone());
                    let tmp = src.join(format!(".tmp{i}"));
                    fs::write(&tmp, &data).unwrap();
                    fs::rename(&tmp, src.join(name)).unwrap();
                    i += 1;
                    std::thread::sleep(Duration::from_millis(3));
                }
            })
        };
        let lister = {
            let (stop, dir, n) = (stop.clone(), t.m("d"), order.len());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let names: Vec<String> = fs::read_dir(&dir)
                        .unwrap()
                        .map(|e| e.unwrap().file_name().into_string().unwrap())
                        .filter(|n| !n.starts_with(".tmp"))
                        .collect();
                    assert_eq!(names.len(), n, "a listing misses a name: {names:?}");
                }
            })
        };
        // Checked after the threads stop, so that a failure here is reported as itself
        // and not as the lister's error once the mount is gone.
        let mut checked = || -> Result<(), String> {
            for name in &order {
                opens += 1;
                let got = match fs::read(t.m(&format!("d/{name}"))) {
                    // The file was replaced again while the kernel retried the open (the
                    // README's "Semantics in short"): counted, and bounded below.
                    Err(e) if e.raw_os_error() == Some(libc::ESTALE) => {
                        estale += 1;
                        continue;
                    }
                    r => r.map_err(|e| format!("round {round}: d/{name}: {e}"))?,
                };
                if !is_version(name, &got) {
                    return Err(format!("round {round}: d/{name} read bytes it never held"));
                }
                let mut buf = Vec::new();
                let held_err = |e: std::io::Error| format!("round {round}: the held handle: {e}");
                held.seek(SeekFrom::Start(0)).map_err(held_err)?;
                held.read_to_end(&mut buf).map_err(held_err)?;
                if !is_version(&held_name, &buf) {
                    return Err(format!(
                        "round {round}: the held handle read bytes it never held"
                    ));
                }
            }
            Ok(())
        };
        let checked = checked();
        stop.store(true, Ordering::SeqCst);
        writer.join().unwrap();
        lister.join().unwrap();
        checked.unwrap();
    }
    drop(held);
    // The hunt sees such opens at well under 0.1 %; a bound that only a regression crosses.
    assert!(
        estale * 50 <= opens,
        "{estale} of {opens} opens failed with ESTALE"
    );
    assert!(t.stats().cache.dir_warm_ahead > 0, "nothing was read ahead");
    for name in &order {
        let rel = format!("d/{name}");
        wait_until(
            Duration::from_secs(10),
            &format!("{rel} as the source has it"),
            || fs::read(t.m(&rel)).unwrap() == fs::read(t.s(&rel)).unwrap(),
        );
    }
}

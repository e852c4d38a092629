//! The cleaner through a real mount: the cache stays within its limit, eviction follows
//! last use, pins hold across cleans and remounts.

mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{BIN, TestMount, pattern, wait_until};

const CHUNK: u64 = 64 << 10;

/// Bytes the cache's data tree really occupies.
fn cache_disk_usage(t: &TestMount) -> u64 {
    fn walk(p: &Path) -> u64 {
        let mut n = 0;
        // The cleaner may remove entries while we walk.
        let Ok(rd) = fs::read_dir(p) else { return 0 };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            n += if m.is_dir() {
                walk(&e.path())
            } else {
                m.blocks() * 512
            };
        }
        n
    }
    walk(&t.cache.join("data"))
}

fn hoardfs(args: &[&str]) {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "hoardfs {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn cached(t: &TestMount, name: &str) -> bool {
    t.cache.join("meta").join(name).exists()
}

#[test]
fn the_cache_stays_under_its_limit_and_a_clean_reaches_the_low_watermark() {
    let t = TestMount::new(&[
        "--cache-size",
        "2M",
        "--chunk-size",
        "64K",
        "--whole-file-threshold",
        "128K",
    ]);
    let s = t.stats().cleaner;
    let (high, low) = (s.high_watermark_bytes, s.low_watermark_bytes);
    assert_eq!(s.limit_bytes, 2 << 20);
    for i in 0..40 {
        let data = pattern(192 << 10, i);
        fs::write(t.s(&format!("f{i}")), &data).unwrap();
        assert_eq!(
            fs::read(t.m(&format!("f{i}"))).unwrap(),
            data,
            "data is right even when the cache is full"
        );
        let used = cache_disk_usage(&t);
        assert!(
            used <= high + CHUNK,
            "cache at {used} bytes, above high watermark {high} + one chunk"
        );
    }
    let s = t.stats().cleaner;
    assert!(s.evicted_files + s.evicted_chunks > 0, "{s:?}");
    hoardfs(&["clean", t.mnt.to_str().unwrap()]);
    let used = cache_disk_usage(&t);
    assert!(used <= low, "after a clean: {used} > low watermark {low}");
    // Every file still reads right, cached or not.
    for i in 0..40 {
        assert_eq!(
            fs::read(t.m(&format!("f{i}"))).unwrap(),
            pattern(192 << 10, i)
        );
    }
}

#[test]
fn eviction_follows_last_use() {
    let t = TestMount::new(&[
        "--cache-size",
        "1M",
        "--chunk-size",
        "64K",
        "--whole-file-threshold",
        "256K",
    ]);
    for name in ["a", "b", "c", "d", "e"] {
        fs::write(t.s(name), pattern(200 << 10, name.as_bytes()[0] as u64)).unwrap();
    }
    // Use a, b, c, d in that order, then touch a again: b is now the least recently used.
    for name in ["a", "b", "c", "d", "a"] {
        fs::read(t.m(name)).unwrap();
        // The last use reaches the record with the release, which the kernel sends after
        // close(2) returns: wait for it, or a loaded machine can reorder the uses.
        t.wait_released();
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_until(Duration::from_secs(10), "records of a..d", || {
        ["a", "b", "c", "d"].iter().all(|n| cached(&t, n))
    });
    // A clean down to ~600K must drop b (the LRU), then c.
    hoardfs(&["clean", t.mnt.to_str().unwrap(), "--to", "500K"]);
    assert!(
        !cached(&t, "b") && !cached(&t, "c"),
        "LRU files evicted first"
    );
    assert!(
        cached(&t, "a") && cached(&t, "d"),
        "recently used files kept"
    );
    // Reading e through a full cache kicks the cleaner by itself.
    fs::read(t.m("e")).unwrap();
    assert_eq!(fs::read(t.m("e")).unwrap(), pattern(200 << 10, b'e' as u64));
}

#[test]
fn pinned_files_survive_cleans_and_remounts() {
    let t = &mut TestMount::new(&["--cache-size", "4M"]);
    fs::create_dir(t.s("keep")).unwrap();
    fs::write(t.s("keep/x"), b"precious").unwrap();
    fs::write(t.s("other"), b"ordinary").unwrap();
    fs::read(t.m("keep/x")).unwrap();
    fs::read(t.m("other")).unwrap();
    wait_until(Duration::from_secs(10), "records", || {
        cached(t, "keep/x") && cached(t, "other")
    });
    // FUSE releases are asynchronous, and an open file is never evicted.
    wait_until(Duration::from_secs(10), "release", || {
        t.stats().open_handles == 0
    });
    hoardfs(&["pin", t.m("keep").to_str().unwrap()]);
    hoardfs(&["clean", t.mnt.to_str().unwrap(), "--to", "0"]);
    assert!(cached(t, "keep/x"), "pinned subtree kept");
    assert!(!cached(t, "other"));
    assert!(t.stats().cleaner.pinned_bytes > 0);
    t.remount();
    hoardfs(&["clean", t.mnt.to_str().unwrap(), "--to", "0"]);
    assert!(cached(t, "keep/x"), "pins persist across remounts");
    assert_eq!(fs::read(t.m("keep/x")).unwrap(), b"precious");
    assert_eq!(t.stats().cache.bytes_from_source, 0);
    hoardfs(&["unpin", t.m("keep").to_str().unwrap()]);
    hoardfs(&["clean", t.mnt.to_str().unwrap(), "--to", "0"]);
    assert!(!cached(t, "keep/x"));
    // Pinning outside a mount is a clear error.
    let out = Command::new(BIN).args(["pin", "/tmp"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not inside a hoardfs mount"));
}

#[test]
fn open_files_are_not_evicted() {
    let t = TestMount::new(&[
        "--cache-size",
        "4M",
        "--chunk-size",
        "64K",
        "--whole-file-threshold",
        "64K",
    ]);
    let data = pattern(300 << 10, 7);
    fs::write(t.s("big"), &data).unwrap();
    let f = fs::File::open(t.m("big")).unwrap();
    let mut buf = vec![0u8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, 0).unwrap();
    hoardfs(&["clean", t.mnt.to_str().unwrap(), "--to", "0"]);
    assert!(cached(&t, "big"), "an open file keeps its cache");
    let mut all = vec![0u8; data.len()];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut all, 0).unwrap();
    assert_eq!(all, data);
    drop(f);
    wait_until(Duration::from_secs(10), "release", || {
        t.stats().open_handles == 0
    });
    hoardfs(&["clean", t.mnt.to_str().unwrap(), "--to", "0"]);
    assert!(!cached(&t, "big"));
}

#[test]
fn large_files_lose_chunks_not_everything() {
    let t = TestMount::new(&[
        "--cache-size",
        "8M",
        "--chunk-size",
        "64K",
        "--whole-file-threshold",
        "128K",
    ]);
    let data = pattern(640 << 10, 21);
    fs::write(t.s("big"), &data).unwrap();
    let f = fs::File::open(t.m("big")).unwrap();
    let mut buf = vec![0u8; data.len()];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, 0).unwrap();
    drop(f);
    wait_until(Duration::from_secs(10), "release", || {
        t.stats().open_handles == 0
    });
    let before = cache_disk_usage(&t);
    hoardfs(&["clean", t.mnt.to_str().unwrap(), "--to", "300K"]);
    let after = cache_disk_usage(&t);
    assert!(after <= 300 << 10 && after < before, "{before} -> {after}");
    let rec =
        hoardfs::cache::CacheRecord::decode(&fs::read(t.cache.join("meta/big")).unwrap()).unwrap();
    let present = rec.present_count();
    assert!(
        present > 0 && present < rec.nchunks(),
        "partially cached: {present}/{}",
        rec.nchunks()
    );
    assert!(t.stats().cleaner.evicted_chunks > 0);
    let from_source = t.stats().cache.bytes_from_source;
    // Make the kernel ask the daemon again rather than answer from its page cache (of this
    // file only: no drop_caches, which would touch the whole machine).
    let f = fs::File::open(t.m("big")).unwrap();
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    drop(f);
    assert_eq!(fs::read(t.m("big")).unwrap(), data);
    let refetched = t.stats().cache.bytes_from_source - from_source;
    assert_eq!(
        refetched,
        (rec.nchunks() - present) * CHUNK,
        "only the evicted chunks come back"
    );
}

/// Records in the cache (cached files).
fn records(t: &TestMount) -> u64 {
    fn walk(p: &Path) -> u64 {
        let Ok(rd) = fs::read_dir(p) else { return 0 };
        rd.flatten()
            .map(|e| match e.file_type() {
                Ok(ft) if ft.is_dir() => walk(&e.path()),
                Ok(ft) if ft.is_file() => 1,
                _ => 0,
            })
            .sum()
    }
    walk(&t.cache.join("meta"))
}

/// `hoardfs stats` against the cache on disk: bytes within 10 % (and one chunk), files
/// exact.
fn assert_usage_true(t: &TestMount, when: &str) {
    let s = t.stats();
    let du = cache_disk_usage(t);
    let diff = s.cache_bytes.abs_diff(du);
    assert!(
        diff <= du / 10 + CHUNK,
        "{when}: stats say {} bytes, the cache holds {du}",
        s.cache_bytes
    );
    assert_eq!(s.cache_files, records(t), "{when}: file count");
}

#[test]
fn the_usage_figure_follows_rewrites_truncations_and_evictions() {
    use std::os::unix::fs::FileExt;
    let t = TestMount::new(&["--cache-size", "1G", "--chunk-size", "64K"]);
    for i in 0..20 {
        fs::write(t.s(&format!("small{i}")), pattern(8 << 10, i)).unwrap();
        fs::read(t.m(&format!("small{i}"))).unwrap();
    }
    let big = pattern(1 << 20, 99);
    fs::write(t.s("big"), &big).unwrap();
    assert_eq!(fs::read(t.m("big")).unwrap(), big);
    wait_until(Duration::from_secs(10), "records", || records(&t) == 21);
    assert_usage_true(&t, "after caching 21 files");
    // One 4 KiB block rewritten 3000 times: the cache does not grow.
    let f = fs::OpenOptions::new().write(true).open(t.m("big")).unwrap();
    for i in 0..3000u64 {
        f.write_all_at(&pattern(4096, i), 0).unwrap();
    }
    assert_usage_true(&t, "after 3000 rewrites");
    // Truncated through the open file: the cache shrinks.
    f.set_len(4096).unwrap();
    drop(f);
    assert_usage_true(&t, "after a truncation");
    fs::remove_file(t.m("small0")).unwrap();
    fs::File::create(t.m("small1")).unwrap();
    wait_until(Duration::from_secs(10), "release", || {
        t.stats().open_handles == 0
    });
    assert_usage_true(&t, "after an unlink and a truncating open");
    // A clean down to almost nothing: the counts follow.
    hoardfs(&["clean", t.mnt.to_str().unwrap(), "--to", "20K"]);
    assert!(records(&t) < 10, "most files evicted");
    assert_usage_true(&t, "after a clean");
    for i in 2..20 {
        fs::read(t.m(&format!("small{i}"))).unwrap();
    }
    wait_until(Duration::from_secs(10), "records", || records(&t) == 20);
    assert_usage_true(&t, "after caching again");
}

/// A tmpfs mounted over a directory for the test's life (lazily unmounted at the end).
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        fs::create_dir_all(at).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700")])
            .arg("tmpfs")
            .arg(at)
            .status()
            .unwrap();
        assert!(st.success(), "mount tmpfs");
        Tmpfs(at.to_path_buf())
    }

    fn free(&self) -> u64 {
        let st = rustix::fs::statvfs(&self.0).unwrap();
        st.f_bavail * st.f_frsize
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn min_free_holds_when_the_cache_size_is_larger_than_its_file_system() {
    if !rustix::process::geteuid().is_root() {
        return;
    }
    const MIN_FREE: u64 = 2 << 20;
    let mut t = TestMount::unmounted_at(
        "mnt",
        &[
            "--cache-size",
            "1G",
            "--min-free",
            "2M",
            "--chunk-size",
            "64K",
            "--whole-file-threshold",
            "128K",
        ],
    );
    // The cache's file system holds 8 MiB; the cache may hold 1 GiB.
    let tmpfs = Tmpfs::mount(&t.cache, "8m");
    t.mount();
    let n = 30;
    for i in 0..n {
        fs::write(t.s(&format!("f{i}")), pattern(512 << 10, i)).unwrap();
    }
    for i in 0..n {
        assert_eq!(
            fs::read(t.m(&format!("f{i}"))).unwrap(),
            pattern(512 << 10, i),
            "f{i} reads right"
        );
        // A few chunks in flight may go below the floor before the cleaner runs; the
        // file system never fills.
        let free = tmpfs.free();
        assert!(
            free + (1 << 20) >= MIN_FREE,
            "after f{i}: {free} bytes free, min_free is {MIN_FREE}"
        );
    }
    let s = t.stats();
    assert_eq!(s.cache.cache_errors, 0, "the cache never ran out of space");
    assert!(
        s.cleaner.evicted_files + s.cleaner.evicted_chunks > 0,
        "the cleaner made room: {:?}",
        s.cleaner
    );
    // Space comes back without a restart: min_free holds once the cleaner has run.
    wait_until(Duration::from_secs(10), "min_free", || {
        tmpfs.free() >= MIN_FREE
    });
    // And caching goes on: the last file read is cached (at least in part).
    assert!(cached(&t, &format!("f{}", n - 1)));
    t.unmount();
    drop(tmpfs);
}

/// A file read again within a minute of its last use does not have its record rewritten
/// for that alone (a read-only pass over a warm cache writes nothing), yet counts as used
/// last (`eviction_follows_last_use`); one changed behind the mount does get a new record.
#[test]
fn a_file_used_again_soon_keeps_its_record_as_it_was() {
    let t = TestMount::new(&[]);
    fs::write(t.s("f"), pattern(5000, 1)).unwrap();
    fs::read(t.m("f")).unwrap();
    t.wait_released();
    let meta = t.cache.join("meta").join("f");
    let before = (
        fs::read(&meta).unwrap(),
        fs::metadata(&meta).unwrap().modified().unwrap(),
    );
    std::thread::sleep(Duration::from_millis(20));
    for _ in 0..3 {
        assert_eq!(fs::read(t.m("f")).unwrap(), pattern(5000, 1));
        t.wait_released();
    }
    let after = (
        fs::read(&meta).unwrap(),
        fs::metadata(&meta).unwrap().modified().unwrap(),
    );
    assert!(after == before, "the record was rewritten");
    fs::write(t.s("f"), pattern(6000, 2)).unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), pattern(6000, 2));
    t.wait_released();
    assert!(
        fs::read(&meta).unwrap() != before.0,
        "a new version's record"
    );
}

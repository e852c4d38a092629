//! The inode table through a real mount: it follows the kernel's forgets, stays near its
//! soft maximum during a tree walk (the kernel is asked to drop cold entries), shrinks back
//! once the kernel drops its caches, and open files keep working while their entries are
//! forgotten and looked up again under a tiny limit.

mod common;

use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{BIN, TestMount, pattern};
use hoardfs::stats::InodeSnapshot;

/// Held by each test: `drop_caches` is global, and one test's drop would make the kernel
/// forget the other's entries behind its back (the walk then needs no invalidations).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn drop_caches() {
    // Needs root; the tests that call it skip themselves otherwise.
    fs::write("/proc/sys/vm/drop_caches", "2").expect("drop_caches");
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

fn table(t: &TestMount) -> InodeSnapshot {
    t.stats().inode_table
}

/// Waits until `ok` holds for the table, or fails with the last snapshot.
fn wait_for(t: &TestMount, what: &str, ok: impl Fn(&InodeSnapshot) -> bool) -> InodeSnapshot {
    common::wait_for_value(Duration::from_secs(15), what, || table(t), ok)
}

fn set(t: &TestMount, kv: &str) {
    let st = Command::new(BIN)
        .args(["set", t.mnt.to_str().unwrap(), kv])
        .status()
        .unwrap();
    assert!(st.success(), "hoardfs set {kv}");
}

/// `files` files in directories of 500.
fn make_tree(root: &Path, files: usize) {
    for i in 0..files {
        let dir = root.join(format!("d{:03}", i / 500));
        if i % 500 == 0 {
            fs::create_dir_all(&dir).unwrap();
        }
        fs::write(dir.join(format!("f{i}")), i.to_string()).unwrap();
    }
}

fn walk(dir: &Path, seen: &mut u64) {
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let md = fs::symlink_metadata(e.path()).unwrap();
        *seen += 1;
        if md.is_dir() {
            walk(&e.path(), seen);
        }
    }
}

#[test]
fn a_tree_walk_stays_near_the_maximum_and_the_table_shrinks_back() {
    let _alone = one_at_a_time();
    if !is_root() {
        eprintln!("skipped: drop_caches needs root");
        return;
    }
    const FILES: usize = 20_000;
    const MAX: u64 = 2_000;
    let t = TestMount::new(&["--max-inodes", &MAX.to_string(), "--entry-ttl", "60"]);
    make_tree(&t.src, FILES);
    let mut seen = 0;
    walk(&t.mnt, &mut seen);
    assert_eq!(seen, (FILES + FILES / 500) as u64);

    let s = table(&t);
    eprintln!("after the walk: {s:?}");
    assert!(
        s.peak < FILES as u64,
        "the soft maximum held the table down: {s:?}"
    );
    assert!(
        s.invalidations > 0,
        "the kernel was asked to drop entries: {s:?}"
    );
    assert!(s.allocations >= FILES as u64);
    // The kernel drops what it was asked to; the table settles under the maximum.
    wait_for(&t, "referenced entries back under the maximum", |s| {
        s.referenced <= MAX
    });

    // A quick second walk revives forgotten entries from the free list, same node ids.
    set(&t, "inode_min_age=60");
    set(&t, "inode_free_min=100000");
    set(&t, "max_inodes=100000");
    let before: Vec<u64> = (0..50)
        .map(|i| fs::metadata(t.m(&format!("d000/f{i}"))).unwrap().ino())
        .collect();
    drop_caches();
    wait_for(&t, "the kernel forgets after drop_caches", |s| {
        s.referenced <= 1
    });
    let reuses = table(&t).reuses;
    let after: Vec<u64> = (0..50)
        .map(|i| fs::metadata(t.m(&format!("d000/f{i}"))).unwrap().ino())
        .collect();
    assert_eq!(
        before, after,
        "revived entries keep their node ids (st_ino)"
    );
    assert!(table(&t).reuses >= reuses + 50);

    // Aged free entries are freed: the table shrinks back to the root.
    set(&t, "inode_max_age=1");
    drop_caches();
    let s = wait_for(&t, "the table shrinks back", |s| s.entries <= 1);
    assert_eq!(s.referenced, 1);
    assert_eq!(s.allocations, s.frees + s.entries, "{s:?}");
    // Freed ids are gone: a new lookup gets a new, larger number.
    let ino = fs::metadata(t.m("d000/f0")).unwrap().ino();
    assert!(ino > *after.iter().max().unwrap());
}

#[test]
fn open_files_survive_forgets_under_a_tiny_limit() {
    let _alone = one_at_a_time();
    const FILES: usize = 120;
    let t = Arc::new(TestMount::new(&[
        "--max-inodes",
        "16",
        "--no-passthrough",
        "--chunk-size",
        "64K",
        "--whole-file-threshold",
        "128K",
        "--entry-ttl",
        "0.05",
        "--attr-ttl",
        "0.05",
    ]));
    fs::create_dir(t.s("a")).unwrap();
    let size = |i: usize| 1000 + (i % 7) * 50_000; // up to 300 K: whole and chunked
    for i in 0..FILES {
        fs::write(t.s(&format!("a/f{i}")), pattern(size(i), i as u64)).unwrap();
    }
    // Short ages so that entries are freed (not only forgotten) while files are in use.
    set(&t, "inode_min_age=0");
    set(&t, "inode_max_age=0.2");
    set(&t, "inode_free_min=4");

    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..8)
        .map(|n| {
            let (t, stop, reads) = (t.clone(), stop.clone(), reads.clone());
            std::thread::spawn(move || {
                let mut x = n as usize * 7919 + 1;
                let mut next = || {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 33) % FILES
                };
                // Handles opened before their entries are forgotten, read afterwards.
                let mut held: Vec<(usize, fs::File)> = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let i = next();
                    let f = fs::File::open(t.m(&format!("a/f{i}")))
                        .unwrap_or_else(|e| panic!("open a/f{i}: {e}"));
                    held.push((i, f));
                    let j = next();
                    let md = fs::metadata(t.m(&format!("a/f{j}"))).unwrap();
                    assert_eq!(md.len(), size(j) as u64);
                    if held.len() > 6 {
                        let (i, mut f) = held.remove(0);
                        let mut buf = Vec::new();
                        f.read_to_end(&mut buf)
                            .unwrap_or_else(|e| panic!("read of open a/f{i}: {e}"));
                        assert!(buf == pattern(size(i), i as u64), "wrong data in a/f{i}");
                        let md = f.metadata().expect("fstat of an open file");
                        assert_eq!(md.len(), size(i) as u64);
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let end = Instant::now() + Duration::from_secs(4);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(200));
        if is_root() {
            drop_caches();
        }
    }
    stop.store(true, Ordering::Relaxed);
    for th in threads {
        th.join().unwrap();
    }
    assert!(reads.load(Ordering::Relaxed) > 100);
    let s = table(&t);
    eprintln!(
        "after the run ({} reads): {s:?}",
        reads.load(Ordering::Relaxed)
    );
    assert!(
        s.frees > 0,
        "entries were freed while files were in use: {s:?}"
    );
    assert!(s.invalidations > 0, "{s:?}");
    assert_eq!(s.allocations, s.frees + s.entries, "{s:?}");
}

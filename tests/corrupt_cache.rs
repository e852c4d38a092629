//! The cache directory damaged behind hoardfs's back, while unmounted and while mounted:
//! records corrupted, truncated or deleted; data files edited in place (same length),
//! truncated, extended, deleted or replaced by symlinks. The mount serves the source's
//! bytes every time, never the damaged ones, and repairs the entry.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use common::{TestMount, pattern};

const SMALL: usize = 10_000;
const BIG: usize = 300_000; // chunked: above the 64 KiB threshold

/// The ways of damaging one cached file; each gets its own file.
const DAMAGE: &[&str] = &[
    "data-edited-in-place",
    "data-edited-keeping-times",
    "data-truncated",
    "data-extended",
    "data-deleted",
    "data-replaced-by-symlink",
    "data-replaced-by-directory",
    "record-bit-flipped",
    "record-truncated",
    "record-emptied",
    "record-deleted",
    "record-garbage",
    "record-from-other-file",
];

fn damage(t: &TestMount, how: &str, name: &str) {
    let data = t.c(name);
    let meta = t.cache.join("meta").join(name);
    match how {
        "data-edited-in-place" => {
            let f = fs::OpenOptions::new().write(true).open(&data).unwrap();
            f.write_all_at(b"EVIL", 100).unwrap();
        }
        "data-edited-keeping-times" => {
            // mtime (and atime) put back as they were: only ctime tells.
            let before = fs::metadata(&data).unwrap();
            let f = fs::OpenOptions::new().write(true).open(&data).unwrap();
            f.write_all_at(b"EVIL", 5).unwrap();
            f.set_times(
                fs::FileTimes::new()
                    .set_modified(before.modified().unwrap())
                    .set_accessed(before.accessed().unwrap()),
            )
            .unwrap();
        }
        "data-truncated" => {
            let f = fs::OpenOptions::new().write(true).open(&data).unwrap();
            f.set_len(f.metadata().unwrap().len() / 2).unwrap();
        }
        "data-extended" => {
            let f = fs::OpenOptions::new().append(true).open(&data).unwrap();
            f.write_all_at(b"MORE", f.metadata().unwrap().len())
                .unwrap();
        }
        "data-deleted" => fs::remove_file(&data).unwrap(),
        "data-replaced-by-symlink" => {
            let evil = t.base().join("evil");
            fs::write(&evil, vec![b'E'; BIG]).unwrap();
            fs::remove_file(&data).unwrap();
            std::os::unix::fs::symlink(&evil, &data).unwrap();
        }
        "data-replaced-by-directory" => {
            fs::remove_file(&data).unwrap();
            fs::create_dir(&data).unwrap();
            fs::write(data.join("x"), b"E").unwrap();
        }
        "record-bit-flipped" => {
            let mut r = fs::read(&meta).unwrap();
            r[30] ^= 0x10;
            fs::write(&meta, r).unwrap();
        }
        "record-truncated" => {
            let r = fs::read(&meta).unwrap();
            fs::write(&meta, &r[..r.len() - 3]).unwrap();
            // And the data edited, so that serving the cache would show.
            let f = fs::OpenOptions::new().write(true).open(&data).unwrap();
            f.write_all_at(b"EVIL", 0).unwrap();
        }
        "record-emptied" => {
            fs::write(&meta, b"").unwrap();
            let f = fs::OpenOptions::new().write(true).open(&data).unwrap();
            f.write_all_at(b"EVIL", 0).unwrap();
        }
        "record-deleted" => {
            fs::remove_file(&meta).unwrap();
            let f = fs::OpenOptions::new().write(true).open(&data).unwrap();
            f.write_all_at(b"EVIL", 0).unwrap();
        }
        "record-garbage" => fs::write(&meta, pattern(300, 77)).unwrap(),
        "record-from-other-file" => {
            // A valid record of another cached file of the same size, with its data.
            let other = format!("{name}.twin");
            fs::copy(t.cache.join("meta").join(&other), &meta).unwrap();
            fs::copy(t.c(&other), &data).unwrap();
        }
        _ => unreachable!("{how}"),
    }
}

/// Fills the source with one small and one big file per kind of damage (plus the twins the
/// record swap needs) and reads them all through the mount, so that all are cached whole.
fn setup(t: &TestMount) {
    for (i, how) in DAMAGE.iter().enumerate() {
        for (kind, len) in [("small", SMALL), ("big", BIG)] {
            let name = format!("{kind}-{how}");
            fs::write(t.s(&name), pattern(len, i as u64 * 2 + len as u64)).unwrap();
            fs::write(t.s(&format!("{name}.twin")), pattern(len, 999)).unwrap();
        }
    }
    for e in fs::read_dir(&t.mnt).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        let got = fs::read(&p).unwrap();
        assert!(got == fs::read(t.s(&name)).unwrap(), "{name}");
        assert!(
            fs::read(t.c(&name)).unwrap() == got,
            "{name} not cached whole"
        );
    }
    // Damage after our own writes' ctime tick.
    std::thread::sleep(Duration::from_millis(20));
}

fn check_all(t: &TestMount) {
    for how in DAMAGE {
        for kind in ["small", "big"] {
            let name = format!("{kind}-{how}");
            let want = fs::read(t.s(&name)).unwrap();
            // Twice: the second open is a passthrough hit on the repaired entry.
            for round in 0..2 {
                let got = fs::read(t.m(&name)).unwrap();
                assert!(got == want, "{name} (round {round}): served damaged bytes");
            }
            // Part of a big file read at an offset (a daemon read of chunks).
            let f = fs::File::open(t.m(&name)).unwrap();
            let mut buf = vec![0u8; 1000];
            f.read_exact_at(&mut buf, (want.len() / 2) as u64).unwrap();
            assert!(buf == want[want.len() / 2..want.len() / 2 + 1000], "{name}");
            // The entry is repaired: the cache file is a plain file holding the source.
            let meta = fs::symlink_metadata(t.c(&name))
                .unwrap_or_else(|e| panic!("{name}: no cache entry after reads ({e})"));
            assert!(meta.is_file(), "{name}: cache entry not repaired");
            assert!(
                fs::read(t.c(&name)).unwrap() == want,
                "{name}: cache differs"
            );
        }
    }
}

#[test]
fn a_cache_damaged_while_unmounted_is_never_served() {
    let t = &mut TestMount::new(&["--whole-file-threshold", "64K", "--chunk-size", "64K"]);
    // Damaged on purpose: the daemon says what it discards.
    t.expect_warnings();
    setup(t);
    t.unmount();
    for how in DAMAGE {
        damage(t, how, &format!("small-{how}"));
        damage(t, how, &format!("big-{how}"));
    }
    t.mount();
    check_all(t);
    // Every damaged entry was refused (counted), not only those whose length changed.
    let c = t.stats().cache;
    assert!(
        c.corrupt_records + c.stale_invalidations >= 2 * DAMAGE.len() as u64 - 8,
        "{c:?}"
    );
}

#[test]
fn a_cache_damaged_while_mounted_is_never_served() {
    let t = &mut TestMount::new(&["--whole-file-threshold", "64K", "--chunk-size", "64K"]);
    // Damaged on purpose: the daemon says what it discards.
    t.expect_warnings();
    setup(t);
    for how in DAMAGE {
        damage(t, how, &format!("small-{how}"));
        damage(t, how, &format!("big-{how}"));
    }
    check_all(t);
    t.unmount();
    // And after a remount, the repaired entries are hits that equal the source.
    t.mount();
    check_all(t);
}

#[test]
fn a_partially_cached_file_with_an_edited_chunk_is_refetched() {
    let t = &mut TestMount::new(&["--whole-file-threshold", "4K", "--chunk-size", "4K"]);
    // Damaged on purpose: the daemon says what it discards.
    t.expect_warnings();
    let want = pattern(100_000, 5);
    fs::write(t.s("f"), &want).unwrap();
    let f = fs::File::open(t.m("f")).unwrap();
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, 8192).unwrap();
    // Drop the kernel's pages of the file, so that the next read reaches the daemon.
    use std::os::fd::AsRawFd;
    assert_eq!(
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) },
        0
    );
    drop(f);
    // The edit is made to a file no longer open (the release reaches the daemon after
    // close(2) returns).
    t.wait_released();
    let data = fs::OpenOptions::new().write(true).open(t.c("f")).unwrap();
    data.write_all_at(b"EVIL", 8192).unwrap();
    drop(data);
    let f = fs::File::open(t.m("f")).unwrap();
    f.read_exact_at(&mut buf, 8192).unwrap();
    assert!(buf == want[8192..8192 + 4096], "served the edited chunk");
    assert!(fs::read(t.m("f")).unwrap() == want);
    assert!(Path::new(&t.c("f")).is_file());
}

/// Bytes edited in a cache data file while the file is open through the mount (issue 20,
/// case 6): the last close must not stamp them into the record (a record vouches only for
/// data hoardfs wrote), so they are never served, neither on the next open nor after a
/// remount. A small file (passthrough) and a chunked one, whole in the cache.
#[test]
fn a_data_file_edited_while_open_is_not_vouched_for_at_close() {
    let t = &mut TestMount::new(&["--whole-file-threshold", "64K", "--chunk-size", "64K"]);
    // Damaged on purpose: the daemon says what it discards.
    t.expect_warnings();
    let files = [("small", SMALL), ("big", BIG)];
    for (name, len) in files {
        fs::write(t.s(name), pattern(len, len as u64)).unwrap();
        assert!(fs::read(t.m(name)).unwrap() == fs::read(t.s(name)).unwrap());
    }
    for (name, _) in files {
        let open = fs::File::open(t.m(name)).unwrap();
        // Past the ctime tick of our own writes.
        std::thread::sleep(Duration::from_millis(20));
        let data = fs::OpenOptions::new().write(true).open(t.c(name)).unwrap();
        data.write_all_at(b"EVIL", 100).unwrap();
        drop(data);
        drop(open);
    }
    // The releases reach the daemon after close(2) returns.
    t.wait_released();
    for round in 0..2 {
        for (name, _) in files {
            let want = fs::read(t.s(name)).unwrap();
            let got = fs::read(t.m(name)).unwrap();
            assert!(got == want, "{name} (round {round}): served edited bytes");
        }
        t.remount();
    }
}

/// A data file or record removed from the cache directory (or a data file replaced there)
/// just after its file was closed, while the closed file's state is still loaded for its
/// group commit: the next open serves the source's bytes and fills a new entry at the
/// path, rather than going on with the old files, which no name leads to any more.
#[test]
fn a_data_file_removed_while_its_fills_await_their_commit_is_filled_again() {
    let t = &mut TestMount::new(&["--whole-file-threshold", "64K", "--chunk-size", "64K"]);
    // Damaged on purpose: the daemon may say what it discards.
    t.expect_warnings();
    for round in 0..20 {
        for (kind, len) in [("small", SMALL), ("big", BIG)] {
            let name = format!("{kind}-{round}");
            let want = pattern(len, round as u64);
            fs::write(t.s(&name), &want).unwrap();
            assert!(fs::read(t.m(&name)).unwrap() == want);
            // The release reaches the daemon after close(2) returns; the group commit
            // waits 50 ms for more files, so the state is still loaded when it has.
            while t.stats().open_handles > 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            if round % 3 == 0 {
                fs::remove_file(t.c(&name)).unwrap();
            } else if round % 3 == 1 {
                // The record goes: the entry is remade whole, not left without one.
                fs::remove_file(t.cache.join("meta").join(&name)).unwrap();
            } else {
                let evil = t.base().join("evil");
                fs::write(&evil, vec![b'E'; len]).unwrap();
                fs::rename(&evil, t.c(&name)).unwrap();
            }
            assert!(
                fs::read(t.m(&name)).unwrap() == want,
                "{name}: served other bytes"
            );
            t.wait_released();
            let cached = fs::read(t.c(&name))
                .unwrap_or_else(|e| panic!("{name}: no data file after the read ({e})"));
            assert!(cached == want, "{name}: the data file is not the source's");
            assert!(
                t.cache.join("meta").join(&name).is_file(),
                "{name}: no record after the read"
            );
        }
    }
}

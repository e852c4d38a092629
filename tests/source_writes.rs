//! Source writes (`--source-writes`, `fs/source_writes.rs`): writers write the source file
//! by passthrough, readers beside them read it too, and what was written is copied into
//! the cache when the last writer closes.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::process::Command;
use std::time::Duration;

use common::{BIN, TestMount, pattern, wait_until, write_in_place};

fn mount() -> TestMount {
    TestMount::new(&[
        "--source-writes",
        "--chunk-size",
        "64K",
        "--whole-file-threshold",
        "64K",
    ])
}

fn writes(t: &TestMount) -> u64 {
    t.stats().requests.get("write").copied().unwrap_or(0)
}

fn offline(t: &TestMount) {
    let out = Command::new(BIN)
        .args(["offline"])
        .arg(&t.mnt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// A new file and a rewrite of one cached whole: no write reaches the daemon, the source
/// has every byte when the writes return, and after the close the cache holds the new
/// version (read offline), nothing of the old one.
#[test]
fn writers_write_the_source_and_the_cache_takes_the_new_version_at_close() {
    let t = mount();
    // The source goes away at the end (offline): reads then say so in the log.
    t.expect_warnings();
    let new = pattern(300 << 10, 1);
    fs::write(t.m("new"), &new).unwrap();
    assert_eq!(fs::read(t.s("new")).unwrap(), new);
    // Cached whole first, by a read, then rewritten in its middle.
    let old = pattern(256 << 10, 2);
    fs::write(t.s("old"), &old).unwrap();
    assert_eq!(fs::read(t.m("old")).unwrap(), old);
    let mid = pattern(100 << 10, 3);
    {
        let f = fs::OpenOptions::new().write(true).open(t.m("old")).unwrap();
        f.write_all_at(&mid, 70 << 10).unwrap();
    }
    let mut expect = old.clone();
    expect[70 << 10..170 << 10].copy_from_slice(&mid);
    assert_eq!(fs::read(t.s("old")).unwrap(), expect);
    let s = t.stats().cache;
    assert_eq!(s.source_write_opens, 2, "{s:?}");
    assert_eq!(writes(&t), 0, "a write reached the daemon");
    t.wait_released();
    wait_until(
        Duration::from_secs(10),
        "the fills behind the writers",
        || t.stats().cache.chunks_filled_behind >= 5 + 4,
    );
    // Offline, names are found in the directory's saved listing: listed once before.
    assert_eq!(fs::read_dir(&t.mnt).unwrap().count(), 2);
    offline(&t);
    assert_eq!(fs::read(t.m("new")).unwrap(), new);
    assert_eq!(fs::read(t.m("old")).unwrap(), expect);
}

/// A reader opened beside a writer reads the source: it sees each write as soon as the
/// write returned, at every size the file passes through.
#[test]
fn readers_beside_a_writer_see_each_write_at_once() {
    let t = mount();
    let mut w = fs::File::create(t.m("f")).unwrap();
    let r = fs::File::open(t.m("f")).unwrap();
    let mut all = Vec::new();
    for i in 0..200u64 {
        let block = pattern(1000 + i as usize * 37, i);
        w.write_all(&block).unwrap();
        all.extend_from_slice(&block);
        let mut got = vec![0u8; all.len()];
        r.read_exact_at(&mut got, 0).unwrap();
        assert!(got == all, "write {i}: the reader got other bytes");
    }
    drop((w, r));
    let s = t.stats().cache;
    assert_eq!(s.source_write_opens, 1, "{s:?}");
    assert_eq!(
        s.source_read_opens, 1,
        "the reader joins the writer's backing: {s:?}"
    );
    assert_eq!(writes(&t), 0);
}

/// The kernel writes the source with the daemon's credentials, which would keep the
/// set-user-ID and set-group-ID bits a write must clear: such files are written through
/// the daemon, and a `chmod` that sets them while a writer writes the source fails.
#[test]
fn set_id_files_are_not_written_by_passthrough() {
    let t = mount();
    fs::write(t.s("suid"), b"x").unwrap();
    fs::set_permissions(t.s("suid"), fs::Permissions::from_mode(0o4755)).unwrap();
    {
        let f = fs::OpenOptions::new()
            .write(true)
            .open(t.m("suid"))
            .unwrap();
        f.write_all_at(b"y", 0).unwrap();
    }
    assert_eq!(t.stats().cache.source_write_opens, 0);
    assert!(writes(&t) > 0);
    let f = fs::File::create(t.m("plain")).unwrap();
    assert_eq!(t.stats().cache.source_write_opens, 1);
    let e = fs::set_permissions(t.m("plain"), fs::Permissions::from_mode(0o2755)).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ETXTBSY));
    // Right after the close, its release perhaps still on its way: waited for.
    drop(f);
    fs::set_permissions(t.m("plain"), fs::Permissions::from_mode(0o2755)).unwrap();
}

/// A writer to the source holds no page invalidation back when it closes (it wrote no
/// page of the kernel's): afterwards, readers served by the daemon through the page cache
/// get each change behind the mount as by default.
#[test]
fn after_a_writer_to_the_source_changes_behind_the_mount_reach_page_cache_readers() {
    let t = mount();
    let len = 256 << 10;
    fs::write(t.m("f"), pattern(len, 1)).unwrap();
    assert_eq!(t.stats().cache.source_write_opens, 1);
    t.wait_released();
    for v in 2..5u64 {
        // Behind the mount: the cache entry is reset, and the large file, no longer whole
        // in the cache, is read through the daemon and the kernel's page cache.
        let new = pattern(len, v);
        write_in_place(&t.s("f"), 0, &new);
        wait_until(Duration::from_secs(5), "a change behind the mount", || {
            fs::read(t.m("f")).unwrap() == new
        });
    }
    assert!(
        t.stats().cache.read_misses > 0,
        "no read went through the daemon"
    );
}

/// A writer opening while a reader still holds the writers' backing joins it, also once
/// the file is whole in the cache again after the last writer's close (the kernel would
/// refuse any other open beside that reader).
#[test]
fn a_writer_joins_a_reader_left_on_the_source_after_the_last_writer_closed() {
    let t = mount();
    let w = fs::File::create(t.m("f")).unwrap();
    w.write_all_at(b"first", 0).unwrap();
    let r = fs::File::open(t.m("f")).unwrap();
    drop(w);
    wait_until(Duration::from_secs(5), "the fill after the writer", || {
        t.stats().cache.chunks_filled_behind >= 1
    });
    let w = fs::OpenOptions::new().write(true).open(t.m("f")).unwrap();
    w.write_all_at(b"other", 0).unwrap();
    let mut buf = [0u8; 5];
    r.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(&buf, b"other");
    assert_eq!(t.stats().cache.source_write_opens, 2);
}

//! The two ways the kernel's requests reach the daemon (README, "FUSE over io_uring"):
//! io_uring where the kernel allows it (`fuse.enable_uring`), `/dev/fuse` otherwise or with
//! `--fuse-ring off`. Both must serve the same bytes under concurrent writers and readers,
//! with replies sized at the transport's limit (1 MiB writes and reads) and replies given
//! from other threads (blocking locks).

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use common::TestMount;

fn kernel_allows_the_ring() -> bool {
    fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .is_ok_and(|v| matches!(v.trim(), "Y" | "1"))
}

/// Deterministic bytes for file `i`, version `v`.
fn content(i: usize, v: usize, len: usize) -> Vec<u8> {
    common::pattern(len, ((i as u64) << 32) | v as u64)
}

/// Eight threads, each writing its own files (sizes around the 1 MiB request limit),
/// reading them back through fresh opens, renaming and removing them, while two more take
/// and drop a blocking lock on one shared file.
fn concurrent_work(m: &TestMount) {
    const THREADS: usize = 8;
    const ROUNDS: usize = 12;
    let sizes = [
        0usize,
        1,
        4095,
        4096,
        65_537,
        (1 << 20) - 1,
        1 << 20,
        (1 << 20) + 4097,
    ];
    fs::write(m.s("shared"), b"lock").unwrap();
    let locked = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|scope| {
        for t in 0..2 {
            let (path, locked) = (m.m("shared"), locked.clone());
            scope.spawn(move || {
                for _ in 0..20 {
                    let f = fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(&path)
                        .unwrap();
                    let mut l: libc::flock = unsafe { std::mem::zeroed() };
                    l.l_type = libc::F_WRLCK as i16;
                    l.l_whence = libc::SEEK_SET as i16;
                    // SAFETY: a valid descriptor and lock description.
                    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLKW, &l) };
                    assert_eq!(r, 0, "locker {t}: {}", std::io::Error::last_os_error());
                    assert_eq!(
                        locked.fetch_add(1, SeqCst),
                        0,
                        "two holders of a write lock"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    locked.fetch_sub(1, SeqCst);
                    l.l_type = libc::F_UNLCK as i16;
                    // SAFETY: as above.
                    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &l) };
                    assert_eq!(r, 0);
                }
            });
        }
        for t in 0..THREADS {
            let m = &m;
            scope.spawn(move || {
                for v in 0..ROUNDS {
                    let len = sizes[(t + v) % sizes.len()];
                    let want = content(t, v, len);
                    let name = format!("t{t}");
                    let mut f = fs::File::create(m.m(&name)).unwrap();
                    f.write_all(&want).unwrap();
                    drop(f);
                    let mut got = Vec::new();
                    fs::File::open(m.m(&name))
                        .unwrap()
                        .read_to_end(&mut got)
                        .unwrap();
                    assert!(
                        got == want,
                        "thread {t} round {v}: {len} bytes read back wrong"
                    );
                    assert_eq!(fs::read(m.s(&name)).unwrap(), want, "the source differs");
                    // A read of a middle range, through a handle of its own.
                    if len > 8192 {
                        let mut f = fs::File::open(m.m(&name)).unwrap();
                        f.seek(SeekFrom::Start(4097)).unwrap();
                        let mut part = vec![0; 4096];
                        f.read_exact(&mut part).unwrap();
                        assert!(
                            part == want[4097..4097 + 4096],
                            "thread {t} round {v}: range"
                        );
                    }
                    let moved = format!("t{t}.old");
                    fs::rename(m.m(&name), m.m(&moved)).unwrap();
                    assert_eq!(fs::metadata(m.m(&moved)).unwrap().len(), len as u64);
                    fs::remove_file(m.m(&moved)).unwrap();
                }
            });
        }
    });
    let mut names: Vec<_> = fs::read_dir(m.m(""))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["shared"]);
}

#[test]
fn requests_come_over_io_uring_where_the_kernel_allows_it_and_both_transports_serve_the_same_bytes()
{
    let allowed = kernel_allows_the_ring();
    for (args, ring) in [(&[][..], allowed), (&["--fuse-ring", "off"][..], false)] {
        let m = TestMount::new(args);
        concurrent_work(&m);
        let s = m.stats();
        let total: u64 = s
            .requests
            .iter()
            .filter(|(op, _)| op.as_str() != "forget")
            .map(|(_, n)| n)
            .sum();
        let over_ring = s.cache.ring_requests;
        if ring {
            // Forgets and the requests made before the ring was ready come over /dev/fuse.
            assert!(
                over_ring * 10 >= total * 9,
                "{args:?}: {over_ring} of {total} requests came over io_uring"
            );
        } else {
            assert_eq!(over_ring, 0, "{args:?}: requests came over io_uring");
        }
    }
}

/// A writer's open waits for the passthrough readers of its file to be released (the
/// kernel takes no other open beside them). Over io_uring that release may be handed to
/// the very thread the open waits on, which then read it only after the wait had run out
/// (`ETXTBSY` after 500 ms): such opens are answered from other threads
/// (`fs/waiting_opens.rs`). Three threads write and read back a few shared files, so that
/// writers keep meeting readers just closed; no open may fail.
#[test]
fn writers_opened_as_readers_of_their_file_close_never_fail() {
    for args in [&[][..], &["--fuse-ring", "off"][..]] {
        let m = TestMount::new(args);
        let busy = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for t in 0..3 {
                let (m, busy) = (&m, &busy);
                scope.spawn(move || {
                    for i in 0..1500 {
                        let path = m.m(&format!("f{}", (i + t) % 8));
                        let bytes = content(t, i, 100);
                        for r in [fs::write(&path, &bytes), fs::read(&path).map(drop)] {
                            match r {
                                Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                                    busy.fetch_add(1, SeqCst);
                                }
                                r => r.unwrap(),
                            }
                        }
                    }
                });
            }
        });
        assert_eq!(busy.load(SeqCst), 0, "{args:?}: opens failed with ETXTBSY");
    }
}

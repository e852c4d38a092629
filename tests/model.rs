//! Model-based test: random sequences of file system operations are applied both to a hoardfs
//! mount and to a plain reference directory on the same local file system (ext4 here); every
//! result (value or errno) must agree, and so must the whole trees (names, types, sizes,
//! contents, file modes) at the end of each sequence and around every remount. After every
//! unmount the persistent cache is checked against the source: a clean record whose identity
//! matches the source file must never mark a chunk present that differs from the source.
//!
//! The name space is tiny so that operations collide (rename over open files, unlink of
//! open files, directories where files were, ...), and a small pool of open handles is kept
//! across operations on both sides, since that is where caching file systems go wrong.
//! Mounts use `--chunk-size 64K --whole-file-threshold 128K` so that small data exercises
//! both the whole-file and the chunked paths; each case also draws zero kernel TTLs or the
//! default ones, and the two model tests differ in FUSE passthrough.
//!
//! The source starts with a random tree (written before anything is looked up through the
//! mount). Path operands mostly name an entry that exists at that moment in the reference
//! tree, so that most operations do something; a failure prints the operations with their
//! operands resolved, ready to paste into a regression test at the end of this file.
//!
//! `MODEL_TRACE=1` prints every operation and its result; `PROPTEST_CASES` and
//! `PROPTEST_RNG_SEED` change the number of cases and the (fixed by default) seed.

mod common;
#[path = "common/model_ops.rs"]
mod model_ops;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::TestMount;
use model_ops::*;
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};

// ------------------------------------------------------------------------------ the harness

struct Harness {
    // Handles are declared (and so dropped) before the mount, so that a failing case can
    // still unmount cleanly.
    mnt: Side,
    reference: Side,
    /// What each slot was opened as, for Reopen and Remount.
    slot_info: Vec<Option<(&'static str, Mode)>>,
    /// The mount uses FUSE passthrough for reads of fully cached files.
    passthrough: bool,
    /// The operations run so far, operands resolved (for failure messages).
    done: Vec<Op>,
    m: TestMount,
}

impl Harness {
    fn new(init: &Init, v: Variant) -> Harness {
        let mut args = vec!["--chunk-size", "64K", "--whole-file-threshold", "128K"];
        if !v.passthrough {
            args.push("--no-passthrough");
        }
        if v.ttl0 {
            args.extend(["--attr-ttl", "0", "--entry-ttl", "0", "--negative-ttl", "0"]);
        }
        if v.tiny_cache {
            args.extend(["--cache-size", "256K"]);
        }
        let m = TestMount::new(&args);
        let ref_root = m.src.parent().unwrap().join("ref");
        std::fs::create_dir(&ref_root).unwrap();
        // Nothing has been looked up through the mount yet: filling the source now is the
        // same as mounting over an existing tree.
        init.write(&[&m.src, &ref_root]);
        Harness {
            mnt: Side::new(m.mnt.clone()),
            reference: Side::new(ref_root),
            slot_info: vec![None; SLOTS],
            passthrough: v.passthrough,
            done: Vec::new(),
            m,
        }
    }

    fn close_all(&mut self) {
        self.mnt.close_all();
        self.reference.close_all();
    }

    fn fail(&self, msg: String) -> String {
        let mut s = format!("{msg}\noperations run (operands resolved):");
        for (i, op) in self.done.iter().enumerate() {
            s += &format!("\n  #{i} {op:?},");
        }
        s
    }

    /// Opens every slot again by its path and mode; writers first, so that with passthrough
    /// the readers of a file being written are not passthrough opens.
    fn reopen_all(&mut self) -> Result<(), String> {
        let mut order: Vec<usize> = (0..SLOTS).collect();
        order.sort_by_key(|&k| matches!(self.slot_info[k], Some((_, Mode::Ro))));
        for slot in order {
            if let Some((path, mode)) = self.slot_info[slot] {
                let a = self.mnt.open_slot(slot, path, mode);
                let b = self.reference.open_slot(slot, path, mode);
                if a != b {
                    return Err(self.fail(format!(
                        "reopening slot {slot} ({path:?}, {mode:?}): mount {a:?} vs reference {b:?}"
                    )));
                }
                if self.mnt.slots[slot].is_none() {
                    self.slot_info[slot] = None;
                }
            }
        }
        Ok(())
    }

    /// `TestMount::unmount`, but when the daemon does not exit its threads' stacks are
    /// reported instead of a bare timeout.
    fn unmount(&mut self) -> Result<(), String> {
        let pid = self.m.pid();
        let st = Command::new("umount").arg(&self.m.mnt).status().unwrap();
        if !st.success() {
            return Err(self.fail("umount failed".into()));
        }
        // A mount namespace created while the mount existed (`ip netns exec`, `unshare -m`,
        // a sandbox) holds a copy of it, which keeps the FUSE connection, and so the daemon,
        // alive after our umount until that namespace goes away: wait such copies out.
        let start = Instant::now();
        // The daemon must exit within 10 s of the umount, or of the last copy going away.
        let mut last_copy = start;
        let mut noted = false;
        while process_running(pid) {
            let now = Instant::now();
            if now - start > Duration::from_secs(10) {
                let copies = mount_copies(&self.m.mnt);
                if !copies.is_empty() {
                    last_copy = now;
                    if !noted {
                        eprintln!(
                            "note: the daemon outlives its umount while other mount namespaces \
                             hold copies of the mount ({}); waiting for them to go away",
                            copies.join(", ")
                        );
                        noted = true;
                    }
                }
                if now - last_copy > Duration::from_secs(10)
                    || now - start > Duration::from_secs(300)
                {
                    let msg = self.fail(format!(
                        "the daemon (pid {pid}) is still running {} s after a successful umount; \
                         copies of the mount in other mount namespaces: {copies:?}; its threads:\n{}",
                        (now - start).as_secs(),
                        thread_stacks(pid)
                    ));
                    // Shrinking may not hit the hang again: show this one now.
                    eprintln!("{msg}");
                    return Err(msg);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.m.wait_exit(true);
        Ok(())
    }

    /// Unmounted: the source must equal the reference and the cache agree with the source.
    fn check_unmounted(&self, what: &str) -> Result<(), String> {
        compare_trees(
            &self.m.src,
            &self.reference.root,
            &format!("{what}, source after unmount"),
        )
        .and_then(|_| check_cache(&self.m.cache, &self.m.src).map_err(|e| format!("{what}: {e}")))
        .map_err(|e| self.fail(e))
    }

    /// With passthrough, a file open for reading through passthrough cannot be opened for
    /// writing (documented: ETXTBSY). Such opens are left out: does `op` open for writing a
    /// file that a pooled read-only handle (other than the slot `op` reopens) holds?
    fn blocked_by_passthrough_reader(&self, op: &Op) -> bool {
        let (path, except) = match *op {
            Op::Open {
                slot,
                path,
                mode: Mode::Rw | Mode::RwAppend,
            } => (path, Some(slot)),
            Op::WriteAt { path, .. } => (path, None),
            Op::CreateFile {
                path, excl: false, ..
            } => (path, None),
            _ => return false,
        };
        let Ok(st) = std::fs::metadata(self.reference.p(path)) else {
            return false;
        };
        (0..SLOTS).any(|k| {
            Some(k) != except
                && matches!(self.slot_info[k], Some((_, Mode::Ro)))
                && self.reference.slots[k]
                    .as_ref()
                    .is_some_and(|f| f.metadata().is_ok_and(|m| m.ino() == st.ino()))
        })
    }

    /// A handle operation on an empty slot goes to the next open slot instead (both sides
    /// hold the same slots open), so that fewer operations are no-ops.
    fn step(&mut self, op: &Op) -> Result<(), String> {
        let op = op.resolve_at(&self.reference.root);
        if self.passthrough && self.blocked_by_passthrough_reader(&op) {
            count(|c| c.skipped += 1);
            return Ok(());
        }
        let op = op.at_open_slot(|k| self.mnt.slots[k].is_some());
        self.done.push(op.clone());
        match op {
            Op::Reopen => {
                self.close_all();
                self.reopen_all()
            }
            Op::Remount => {
                self.close_all();
                count(|c| c.remounts += 1);
                self.unmount()?;
                self.check_unmounted("Remount")?;
                self.m.mount();
                compare_trees(
                    &self.m.mnt,
                    &self.reference.root,
                    "Remount, mount after mounting again",
                )
                .map_err(|e| self.fail(e))?;
                self.reopen_all()
            }
            _ => {
                if let Op::Open { slot, path, mode } = op {
                    self.slot_info[slot] = Some((path.get(), mode));
                }
                let a = self.mnt.apply(&op);
                let b = self.reference.apply(&op);
                if trace() {
                    eprintln!("TRACE {op:?} -> {a:?}");
                }
                if a != b {
                    return Err(
                        self.fail(format!("last operation: mount {a:?} vs reference {b:?}"))
                    );
                }
                match a {
                    Outcome::Err(_) | Outcome::Count(u64::MAX) => count(|c| c.ops_err += 1),
                    _ => count(|c| c.ops_ok += 1),
                }
                if let Op::Open { slot, .. } = op
                    && self.mnt.slots[slot].is_none()
                {
                    self.slot_info[slot] = None;
                }
                Ok(())
            }
        }
    }

    fn finish(&mut self) -> Result<(), String> {
        self.close_all();
        compare_trees(&self.m.mnt, &self.reference.root, "end of sequence, mount")
            .map_err(|e| self.fail(e))?;
        self.unmount()?;
        self.check_unmounted("end of sequence")
    }
}

/// Whether `pid` exists and is not a zombie.
fn process_running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The processes in other mount namespaces that still have a copy of the mount at `mnt`
/// (`ip netns exec`, `unshare -m`, sandboxes started while the mount existed).
fn mount_copies(mnt: &Path) -> Vec<String> {
    let ours = std::fs::read_link("/proc/self/ns/mnt").ok();
    let want = mnt.to_string_lossy().into_owned();
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let p = e.path();
        let Ok(ns) = std::fs::read_link(p.join("ns/mnt")) else {
            continue;
        };
        if Some(&ns) == ours.as_ref() || !seen.insert(ns.clone()) {
            continue;
        }
        let info = std::fs::read_to_string(p.join("mountinfo")).unwrap_or_default();
        if info
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
        {
            let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
            out.push(format!(
                "pid {} ({}) in {}",
                e.file_name().to_string_lossy(),
                comm.trim(),
                ns.display()
            ));
        }
    }
    out
}

/// The stacks of a hung daemon's threads: gdb's backtraces if gdb is installed, otherwise
/// each thread's kernel wait channel.
fn thread_stacks(pid: u32) -> String {
    let gdb = Command::new("gdb")
        .args([
            "-p",
            &pid.to_string(),
            "-batch",
            "-ex",
            "thread apply all bt",
        ])
        .stdin(Stdio::null())
        .output();
    if let Ok(out) = gdb {
        let text = String::from_utf8_lossy(&out.stdout);
        let keep: Vec<&str> = text
            .lines()
            .filter(|l| {
                l.starts_with("Thread ")
                    || l.contains("hoardfs::")
                    || l.contains("fuser::")
                    || l.contains(" in std::")
            })
            .collect();
        if !keep.is_empty() {
            return keep.join("\n");
        }
    }
    let mut out = String::new();
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in rd.flatten() {
            let p = t.path();
            let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
            let wchan = std::fs::read_to_string(p.join("wchan")).unwrap_or_default();
            let stack = std::fs::read_to_string(p.join("stack")).unwrap_or_default();
            out += &format!(
                "thread {} {}: wchan {wchan}\n{stack}\n",
                t.file_name().to_string_lossy(),
                comm.trim()
            );
        }
    }
    out
}

/// Mount configuration of a case.
#[derive(Clone, Copy, Debug)]
struct Variant {
    passthrough: bool,
    /// Attribute, entry and negative TTLs of zero: every stat and lookup reaches the daemon.
    ttl0: bool,
    /// A cache so small that the cleaner runs all the time.
    tiny_cache: bool,
}

/// The tests of this file run one at a time: a `fork` for a child process (the daemon,
/// `umount`) copies the descriptors another test holds open in its mount, which can make
/// that test's unmount fail with EBUSY.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(init: &Init, ops: &[Op], v: Variant) -> Result<(), String> {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut h = Harness::new(init, v);
    for op in ops {
        h.step(op)?;
    }
    h.finish()
}

/// Cases per model test; about 0.15 s each in a debug build. PROPTEST_CASES overrides the
/// count and PROPTEST_RNG_SEED the (otherwise fixed, so that the suite is reproducible) seed,
/// for longer hunts: `PROPTEST_CASES=3000 PROPTEST_RNG_SEED=$RANDOM cargo test --test model`.
/// Cases per model test; about 0.15 s each in a debug build (`config` for the variables that
/// change it).
const CASES: u32 = 128;

/// Runs the model for random cases in one mount configuration (`ttl0` is drawn per case).
fn model(name: &str, passthrough: bool, tiny_cache: bool) {
    let mut runner = TestRunner::new(config(CASES));
    let r = runner.run(&(init(), ops(), any::<bool>()), |(init, ops, ttl0)| {
        run(
            &init,
            &ops,
            Variant {
                passthrough,
                ttl0,
                tiny_cache,
            },
        )
        .map_err(TestCaseError::fail)
    });
    let c = counts();
    eprintln!(
        "{name}: {} operations agreed on a result and {} on an error, {} left out, {} remounts; \
         cache check: {} clean records matching the source, {} present chunks equal to it",
        c.ops_ok, c.ops_err, c.skipped, c.remounts, c.records, c.chunks
    );
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// Reads served by the daemon: the mount must behave exactly like the local file system.
#[test]
fn model_without_passthrough() {
    model("model_without_passthrough", false, false);
}

/// Passthrough reads of fully cached files, minus the documented restriction (no writer may
/// open a file held open by a passthrough reader).
#[test]
fn model_with_passthrough() {
    model("model_with_passthrough", true, false);
}

/// The same with a 256 KiB cache: the cleaner evicts files and chunks between operations.
#[test]
fn model_with_a_tiny_cache() {
    model("model_with_a_tiny_cache", true, true);
}

// ------------------------------------------------------------------------------ regressions
//
// Shrunk sequences found by the model tests, run in every mount configuration.

const ALL: [Variant; 4] = [
    Variant {
        passthrough: true,
        ttl0: false,
        tiny_cache: false,
    },
    Variant {
        passthrough: false,
        ttl0: false,
        tiny_cache: false,
    },
    Variant {
        passthrough: true,
        ttl0: true,
        tiny_cache: false,
    },
    Variant {
        passthrough: false,
        ttl0: true,
        tiny_cache: false,
    },
];

fn regression(init: Init, ops: &[Op], variants: &[Variant]) {
    let failures: Vec<String> = variants
        .iter()
        .filter_map(|&v| run(&init, ops, v).err().map(|e| format!("{v:?}: {e}")))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `ln f g; mv h g`: the inode of f keeps "g" as its path (the name it was last looked up
/// by), so writes through f land in the file that was h.
#[test]
fn write_through_a_hard_link_whose_other_name_was_renamed_over() {
    use Op::*;
    regression(
        Init::with(&[("f", 100, 1), ("h", 50, 2)]),
        &[
            Link {
                from: P("f"),
                to: P("g"),
            },
            Rename {
                from: P("h"),
                to: P("g"),
            },
            WriteAt {
                path: P("f"),
                off: 0,
                data: bytes(10, 3),
            },
            ReadWhole(P("g")),
            ReadWhole(P("f")),
        ],
        &ALL[..2],
    );
}

/// Same cause, seen as a mode: after `chmod 755 f; ln f g; mv h g`, `stat f` shows h's mode.
#[test]
fn stat_through_a_hard_link_whose_other_name_was_renamed_over() {
    use Op::*;
    regression(
        Init::with(&[("f", 0, 1), ("h", 0, 2)]),
        &[
            Chmod {
                path: P("f"),
                mode: 0o755,
            },
            Link {
                from: P("f"),
                to: P("g"),
            },
            Rename {
                from: P("h"),
                to: P("g"),
            },
            Stat(P("f")),
        ],
        &ALL[..2],
    );
}

/// fstat of an open file whose name another file was renamed over answers with the
/// attributes of that other file (getattr goes by path).
#[test]
fn fstat_of_an_open_file_renamed_over() {
    use Op::*;
    regression(
        Init::with(&[("f", 100, 1), ("g", 0, 2)]),
        &[
            Open {
                slot: 0,
                path: P("f"),
                mode: Mode::Rw,
            },
            Rename {
                from: P("g"),
                to: P("f"),
            },
            StatHandle(0),
        ],
        &ALL,
    );
}

/// The same, seen through read(): once the kernel asks for the size of the open file (its
/// attributes expired; immediately with a zero TTL), it gets the replacing file's size and
/// reads through the open handle come back short.
#[test]
fn read_of_an_open_cached_file_renamed_over() {
    use Op::*;
    regression(
        Init::with(&[("f", 100_000, 1), ("g", 10, 2)]),
        &[
            ReadWhole(P("f")),
            Open {
                slot: 0,
                path: P("f"),
                mode: Mode::Ro,
            },
            Rename {
                from: P("g"),
                to: P("f"),
            },
            ReadHandle {
                slot: 0,
                off: 200_000,
                len: 10,
            },
            ReadHandle {
                slot: 0,
                off: 0,
                len: 1000,
            },
        ],
        &[Variant {
            passthrough: false,
            ttl0: true,
            tiny_cache: false,
        }],
    );
}

/// fstat of an open directory after rmdir: ENOENT instead of the directory's attributes.
#[test]
fn fstat_of_an_open_removed_directory() {
    use Op::*;
    regression(
        Init::dirs_only(),
        &[
            Mkdir(P("c")),
            Open {
                slot: 0,
                path: P("c"),
                mode: Mode::Ro,
            },
            Rmdir(P("c")),
            StatHandle(0),
        ],
        &ALL,
    );
}

/// ftruncate of an open, unlinked file once its directory is gone: the source's set_attr
/// opens the parent directory by path even when it has the file's descriptor.
#[test]
fn ftruncate_of_an_open_file_whose_directory_was_removed() {
    use Op::*;
    regression(
        Init::with(&[("a/b/g", 1000, 1)]),
        &[
            Open {
                slot: 0,
                path: P("a/b/g"),
                mode: Mode::Rw,
            },
            Unlink(P("a/b/g")),
            Rmdir(P("a/b")),
            TruncateHandle { slot: 0, len: 10 },
            StatHandle(0),
        ],
        &ALL,
    );
}

/// fstat of an open, unlinked, fully cached (here: empty) file opened read-only, which holds
/// no source descriptor (fixed in 512792e).
#[test]
fn fstat_of_an_open_unlinked_file() {
    use Op::*;
    regression(
        Init::with(&[("a/f", 0, 1)]),
        &[
            Open {
                slot: 0,
                path: P("a/f"),
                mode: Mode::Ro,
            },
            Unlink(P("a/f")),
            StatHandle(0),
        ],
        &ALL,
    );
}

/// A read past the kernel's idea of the end of an open, unlinked file makes the kernel ask
/// for its size; that failed with ENOENT (fixed in 512792e).
#[test]
fn read_past_the_end_of_an_open_unlinked_file() {
    use Op::*;
    regression(
        Init::with(&[("b/f", 0, 1)]),
        &[
            Open {
                slot: 2,
                path: P("b/f"),
                mode: Mode::Ro,
            },
            WriteAt {
                path: P("b/f"),
                off: 131_067,
                data: bytes(218, 4),
            },
            Unlink(P("b/f")),
            ReadHandle {
                slot: 2,
                off: 1_586_152,
                len: 336,
            },
            ReadHandle {
                slot: 2,
                off: 131_000,
                len: 1000,
            },
        ],
        &ALL,
    );
}

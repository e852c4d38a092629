//! The table's hard interleavings under the shuttle model checker (`crate::sync`): each
//! test runs a few threads over one table thousands of times, in schedules shuttle picks
//! at every lock, and checks what must hold in all of them.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use shuttle::sync::Mutex as ModelMutex;
use shuttle::thread;

use super::tests::{file, st};
use super::{InodeLimits, InodeTable, ROOT_ID};

const ITERATIONS: usize = 3000;

/// A table that frees a forgotten entry at the first chance: no minimum age, no free
/// entries kept, and a soft maximum of `max` entries.
fn eager_table<F>(max: usize) -> Arc<InodeTable<F>> {
    let limits = InodeLimits {
        max_inodes: max,
        free_min: 0,
        min_age: Duration::ZERO,
        max_age: Duration::ZERO,
        freeing: true,
    };
    Arc::new(InodeTable::new(&st(2, libc::S_IFDIR), limits))
}

/// Lookups (the kernel's `lookup`/`create`) of one file race its `forget`s and the periodic
/// freeing: a looked-up entry is never freed while the kernel references it, the id a lookup
/// returns always leads to that entry, two references held at once are to one entry, and
/// in the end every count is back to zero and every entry was freed exactly once.
#[test]
fn lookup_and_create_race_forget_and_freeing() {
    shuttle::check_random(
        || {
            let t = eager_table::<()>(1_000);
            // The kernel's view: the node id it holds references to and how many. Counted
            // up after a lookup returns and down before its forget is sent, so it never
            // counts more than the table does.
            let kernel: Arc<ModelMutex<(u64, u64)>> = Arc::default();
            let mut threads = Vec::new();
            for _ in 0..2 {
                let (t, kernel) = (t.clone(), kernel.clone());
                threads.push(thread::spawn(move || {
                    for _ in 0..2 {
                        let a = t.lookup(ROOT_ID, Path::new("a"), &file(10));
                        {
                            let mut k = kernel.lock().unwrap();
                            if k.1 > 0 {
                                assert_eq!(k.0, a.id, "two nodes for one file, both referenced");
                            }
                            *k = (a.id, k.1 + 1);
                        }
                        let got = t.get(a.id).expect("a referenced entry was freed");
                        assert!(Arc::ptr_eq(&got, &a), "the id leads to another entry");
                        kernel.lock().unwrap().1 -= 1;
                        t.forget(a.id, 1);
                    }
                }));
            }
            let freer = t.clone();
            threads.push(thread::spawn(move || {
                for _ in 0..3 {
                    freer.maintain();
                }
            }));
            for th in threads {
                th.join().unwrap();
            }
            t.maintain();
            let s = t.snapshot();
            assert_eq!((s.referenced, s.free, s.entries), (1, 0, 1), "{s:?}");
            assert_eq!(s.allocations, s.frees + s.entries, "{s:?}");
        },
        ITERATIONS,
    );
}

/// A rename of a subtree through the mount races the watcher's resolution of names to
/// entries (`holders_of`) and lookups under the new names: the watcher sees the subtree
/// wholly at its old names or wholly at its new ones, never a mix, and once `renamed` has
/// returned no entry is found under an old name.
#[test]
fn subtree_rename_races_the_watchers_name_resolution() {
    shuttle::check_random(
        || {
            let t = eager_table::<()>(1_000);
            let dir = |ino| st(ino, libc::S_IFDIR);
            let d = t.lookup(ROOT_ID, Path::new("d"), &dir(20));
            let sub = t.lookup(d.id, Path::new("d/s"), &dir(21));
            let x = t.lookup(d.id, Path::new("d/x"), &file(22));
            t.lookup(sub.id, Path::new("d/s/y"), &file(23));
            let old: HashSet<PathBuf> = ["d/x", "d/s/y"].iter().map(PathBuf::from).collect();
            let new: HashSet<PathBuf> = ["e/x", "e/s/y"].iter().map(PathBuf::from).collect();
            let done = Arc::new(ModelMutex::new(false));

            let (t1, done1) = (t.clone(), done.clone());
            let renamer = thread::spawn(move || {
                t1.renamed(Path::new("d"), Path::new("e"), false, ROOT_ID, ROOT_ID);
                *done1.lock().unwrap() = true;
            });
            let (t2, done2) = (t.clone(), done.clone());
            let (old2, new2) = (old.clone(), new.clone());
            let watcher = thread::spawn(move || {
                for _ in 0..2 {
                    let renamed_before = *done2.lock().unwrap();
                    let both: HashSet<PathBuf> = old2.union(&new2).cloned().collect();
                    let seen: HashSet<PathBuf> =
                        t2.holders_of(&both).into_iter().map(|(p, _)| p).collect();
                    assert!(
                        seen == old2 || seen == new2,
                        "half a renamed subtree: {seen:?}"
                    );
                    if renamed_before {
                        assert_eq!(seen, new2, "an old name still leads to an entry");
                    }
                }
            });
            // The kernel's lookup of a new name once the rename made it, racing the
            // watcher: the entry it had under the old name.
            let (t3, done3, x) = (t.clone(), done.clone(), x.clone());
            let looker = thread::spawn(move || {
                if *done3.lock().unwrap() {
                    let again = t3.lookup(ROOT_ID, Path::new("e/x"), &file(22));
                    assert!(Arc::ptr_eq(&again, &x));
                    t3.forget(again.id, 1);
                }
            });
            for th in [renamer, watcher, looker] {
                th.join().unwrap();
            }
            let seen: HashSet<PathBuf> = t.holders_of(&new).into_iter().map(|(p, _)| p).collect();
            assert_eq!(seen, new);
            assert!(t.holders_of(&old).is_empty());
            assert_eq!(d.path().as_deref(), Some(Path::new("e")));
        },
        ITERATIONS,
    );
}

/// The directory prefetch takes an unreferenced entry (on the free list) and loads its
/// cache state, while the periodic pass frees free entries (the table over its soft
/// maximum frees them at once) and the kernel looks the same file up. A state is only ever
/// loaded into an entry the table still holds: freed, a later lookup would make a second
/// entry and load a second state over the same cache files. The loader does as
/// `fs/fetch/jobs.rs` does: lock the entry's `file`, then check that the table still holds
/// it (`InodeTable::holds`); the table frees only entries whose `file` is unlocked and empty.
#[test]
fn prefetch_loads_a_state_while_the_table_frees_and_the_kernel_looks_up() {
    shuttle::check_random(
        || {
            let t = eager_table::<u32>(1);
            let (t1, t2, t3) = (t.clone(), t.clone(), t.clone());
            let prefetch = thread::spawn(move || {
                let i = t1.entry_unreferenced(ROOT_ID, Path::new("f"), &file(30));
                let mut guard = i.file();
                if guard.is_none() && t1.holds(&i) {
                    *guard = Some(1);
                    drop(guard);
                    // Loaded: the entry stays as long as the state does.
                    let again = t1
                        .get(i.id)
                        .expect("an entry with a loaded state was freed");
                    assert!(Arc::ptr_eq(&again, &i));
                }
            });
            let freer = thread::spawn(move || {
                t2.maintain();
            });
            let kernel = thread::spawn(move || {
                let i = t3.lookup(ROOT_ID, Path::new("f"), &file(30));
                let loaded = i.file().is_some();
                t3.forget(i.id, 1);
                (i, loaded)
            });
            prefetch.join().unwrap();
            freer.join().unwrap();
            let (looked_up, _) = kernel.join().unwrap();
            // Every state loaded is in the entry a lookup now finds.
            let now = t.lookup(ROOT_ID, Path::new("f"), &file(30));
            let loaded: Vec<_> = [&looked_up, &now]
                .into_iter()
                .filter(|i| i.file().is_some())
                .collect();
            for i in loaded {
                assert!(
                    Arc::ptr_eq(i, &now),
                    "a state loaded in an entry the table lost"
                );
            }
        },
        ITERATIONS,
    );
}

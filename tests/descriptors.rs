//! The daemon's descriptors under a low open-files limit: between requests it holds some
//! for what it caches (files' callbacks, directories' listings, fills waiting for their
//! group commit), each kind within its share of the limit (`src/descriptors.rs`), so that
//! a walk over a tree much larger than the limit reads every byte, cold and hot, and no
//! request fails for want of a descriptor (`EMFILE`). With no such bound, a hard limit of
//! 512 failed the first walk's opens after about 90 of these directories.

mod common;

use std::fs;
use std::path::Path;

use common::TestMount;

/// The daemon's open-files limit, soft and hard: raising the soft one to the hard one at
/// start, as the daemon does, gives nothing here.
const LIMIT: u64 = 512;
const DIRS: usize = 400;
const FILES: usize = 4;

fn contents(d: usize, f: usize) -> Vec<u8> {
    let len = 100 + d * 7 + f;
    (0..len).map(|i| (i * 31 + d * 7 + f) as u8).collect()
}

/// Reads every file below `mnt` as a walk does (a directory's listing, then its files in
/// order) and checks its bytes.
fn walk_and_check(mnt: &Path, pass: &str) {
    let mut dirs: Vec<_> = fs::read_dir(mnt)
        .unwrap_or_else(|e| panic!("{pass}: listing the mount: {e}"))
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    assert_eq!(dirs.len(), DIRS, "{pass}: directories listed");
    for (d, dir) in dirs.iter().enumerate() {
        let mut names: Vec<_> = fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{pass}: listing {}: {e}", dir.display()))
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names.len(), FILES, "{pass}: files in {}", dir.display());
        for (f, name) in names.iter().enumerate() {
            let path = dir.join(name);
            let got = fs::read(&path)
                .unwrap_or_else(|e| panic!("{pass}: reading {}: {e}", path.display()));
            assert!(
                got == contents(d, f),
                "{pass}: wrong bytes in {}",
                path.display()
            );
        }
    }
}

#[test]
fn a_tree_much_larger_than_the_open_files_limit_reads_whole_cold_and_hot() {
    let mut t = TestMount::unmounted_at("mnt", &[]);
    for d in 0..DIRS {
        let dir = t.src.join(format!("d{d:03}"));
        fs::create_dir(&dir).unwrap();
        for f in 0..FILES {
            fs::write(dir.join(format!("f{f}")), contents(d, f)).unwrap();
        }
    }
    t.open_files_limit = Some(LIMIT);
    t.mount();
    let limits = fs::read_to_string(format!("/proc/{}/limits", t.pid())).unwrap();
    assert!(
        limits
            .lines()
            .any(|l| l.starts_with("Max open files") && l.contains(&format!(" {LIMIT} "))),
        "the daemon runs under the limit:\n{limits}"
    );
    walk_and_check(&t.mnt, "cold");
    walk_and_check(&t.mnt, "hot");
    // Callbacks a quarter, listings an eighth, the commit queue an eighth at most, and the
    // daemon's own few dozen: what is left serves requests.
    let held = fs::read_dir(format!("/proc/{}/fd", t.pid()))
        .unwrap()
        .count();
    assert!(
        held < LIMIT as usize * 3 / 4,
        "{held} descriptors held after the walks"
    );
}

//! Fuzzing of every on-disk format hoardfs reads back (proptest, so it runs in `cargo test`
//! on stable): the per-file record (`cache/record.rs`), the cache's `FORMAT` file
//! (`cache/store.rs`) and the pins file (`cleaner.rs`). Arbitrary bytes and damaged valid
//! encodings must never panic; they are rejected (records, FORMAT) or their bad lines
//! dropped (pins). Longer runs: `PROPTEST_CASES=200000 cargo test --test fuzz_formats`.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use hoardfs::cache::record::{DataIdentity, chunk_count};
use hoardfs::cache::{CacheRecord, CacheStore, SourceIdentity};
use hoardfs::cleaner::Pins;
use proptest::prelude::*;

/// Records of every shape: tiny and huge chunk sizes, empty files, any bits.
fn record() -> impl Strategy<Value = CacheRecord> {
    (
        prop_oneof![0u64..300, 0u64..300_000],
        prop_oneof![64u64..200, Just(4096u64), 1u64..100_000],
        any::<(u64, i64, u32, i64, u32, bool, u64, u64, i64, u32)>(),
        any::<u64>(),
    )
        .prop_map(
            |(size, cs, (ino, ms, mns, cs_, cns, dirty, lu, dino, dcs, dcns), seed)| {
                let mut r = CacheRecord::empty(
                    SourceIdentity {
                        ino,
                        size,
                        mtime: (ms, mns),
                        ctime: (cs_, cns),
                        racy: false,
                    },
                    cs,
                );
                r.dirty = dirty;
                r.last_used = lu;
                r.data = DataIdentity {
                    ino: dino,
                    ctime: (dcs, dcns),
                };
                let mut x = seed | 1;
                for c in 0..r.nchunks().min(4096) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    r.set_present(c, x & 1 == 1);
                    r.touch(c, (x >> 8) as u32);
                }
                r
            },
        )
}

/// Recomputes the trailing CRC, so that mutations reach the checks behind it.
fn re_crc(b: &mut [u8]) {
    if b.len() >= 4 {
        let body = b.len() - 4;
        let crc = crc32fast::hash(&b[..body]);
        b[body..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Whatever `decode` accepts is a self-consistent record that every accessor can use.
fn check_accepted(bytes: &[u8], r: &CacheRecord) {
    assert_eq!(r.nchunks(), chunk_count(r.identity.size, r.chunk_size));
    assert_eq!(r.present.len() as u64, r.nchunks().div_ceil(8));
    assert_eq!(r.chunk_used.len() as u64, r.nchunks());
    let _ = (r.is_complete(), r.present_count(), r.is_present(u64::MAX));
    // Accepted bytes are exactly the record's own encoding: nothing ignored or reinterpreted.
    assert_eq!(r.encode(), bytes);
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Extend(Vec<u8>),
    Splice(usize, Vec<u8>),
    SetU64(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        any::<usize>().prop_map(Mutation::Truncate),
        proptest::collection::vec(any::<u8>(), 1..32).prop_map(Mutation::Extend),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 0..32)
        )
            .prop_map(|(i, v)| Mutation::Splice(i, v)),
        // Header fields (sizes, counts) set to extremes, with a valid checksum.
        (
            prop_oneof![Just(24usize), Just(56), Just(92), 0usize..120],
            prop_oneof![
                Just(0u64),
                Just(1),
                Just(u64::MAX),
                Just(u64::MAX / 4 + 1),
                any::<u64>()
            ]
        )
            .prop_map(|(i, v)| Mutation::SetU64(i, v)),
    ]
}

fn apply(b: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::Flip(i, x) if !b.is_empty() => {
            let n = b.len();
            b[i % n] ^= x
        }
        Mutation::Flip(..) => {}
        Mutation::Truncate(n) => {
            let keep = n % (b.len() + 1);
            b.truncate(keep)
        }
        Mutation::Extend(v) => b.extend_from_slice(v),
        Mutation::Splice(i, v) => {
            let at = i % (b.len() + 1);
            let end = (at + v.len()).min(b.len());
            b.splice(at..end, v.iter().copied());
        }
        Mutation::SetU64(i, v) => {
            if i + 8 <= b.len() {
                b[*i..i + 8].copy_from_slice(&v.to_le_bytes())
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(2000)
    ))]

    #[test]
    fn record_decode_never_panics_on_arbitrary_bytes(
        b in proptest::collection::vec(any::<u8>(), 0..400),
        with_magic: bool,
        fix_crc: bool,
    ) {
        let mut b = b;
        if with_magic && b.len() >= 12 {
            b[..8].copy_from_slice(b"HOARDREC");
            b[8..12].copy_from_slice(&hoardfs::cache::record::FORMAT.to_le_bytes());
        }
        if fix_crc {
            re_crc(&mut b);
        }
        if let Ok(r) = CacheRecord::decode(&b) {
            check_accepted(&b, &r);
        }
    }

    #[test]
    fn damaged_records_are_rejected(
        r in record(),
        muts in proptest::collection::vec(mutation(), 1..4),
        fix_crc: bool,
    ) {
        let good = r.encode();
        prop_assert_eq!(CacheRecord::decode(&good), Ok(r.clone()));
        let mut b = good.clone();
        for m in &muts {
            apply(&mut b, m);
        }
        if fix_crc {
            re_crc(&mut b);
        }
        match CacheRecord::decode(&b) {
            Ok(back) => {
                check_accepted(&b, &back);
                // Without a recomputed CRC only the untouched bytes may pass.
                if !fix_crc {
                    prop_assert_eq!(&b, &good);
                }
            }
            Err(_) => prop_assert_ne!(&b, &good),
        }
    }

    #[test]
    fn every_truncation_of_a_record_is_rejected(r in record()) {
        let good = r.encode();
        // Every cut of the header and the first bytes after it, then a sample of the rest.
        let lens = (0..good.len().min(200)).chain((200..good.len()).step_by(97));
        for len in lens {
            prop_assert!(CacheRecord::decode(&good[..len]).is_err(), "length {}", len);
        }
    }

    #[test]
    fn format_check_accepts_only_the_exact_line(b in proptest::collection::vec(any::<u8>(), 0..64)) {
        let ok = hoardfs::cache::store::check_format(&b).is_ok();
        prop_assert_eq!(ok, b == b"hoardfs cache 1\n");
    }

    #[test]
    fn pins_parse_keeps_only_relative_paths(b in proptest::collection::vec(
        prop_oneof![Just(b'\n'), Just(b'/'), Just(b'.'), Just(0u8), any::<u8>()], 0..200)
    ) {
        for p in Pins::parse(&b) {
            prop_assert!(!p.as_os_str().is_empty());
            prop_assert!(hoardfs::source::check_relative(&p).is_ok(), "{:?}", p);
            prop_assert!(!p.as_os_str().as_bytes().contains(&b'\n'));
        }
    }

    #[test]
    fn pins_survive_a_round_trip(names in proptest::collection::btree_set(
        proptest::collection::vec(
            proptest::collection::vec(any::<u8>().prop_filter("name byte", |b| *b != b'/' && *b != 0 && *b != b'\n'), 1..12)
                .prop_filter("not . or ..", |n| n != b"." && n != b".."),
            1..4),
        0..8)
    ) {
        let set: std::collections::BTreeSet<PathBuf> = names
            .iter()
            .map(|comps| comps.iter().map(|c| std::ffi::OsStr::from_bytes(c)).collect())
            .collect();
        let bytes = Pins::serialize(set.iter());
        prop_assert_eq!(Pins::parse(&bytes), set);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A damaged FORMAT or pins file in a real cache directory: a clear refusal for FORMAT,
    /// dropped lines for pins, never a panic.
    #[test]
    fn damaged_files_in_a_cache_directory(format in proptest::collection::vec(any::<u8>(), 0..40),
                                          pins in proptest::collection::vec(any::<u8>(), 0..200)) {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("FORMAT"), &format).unwrap();
        std::fs::write(d.path().join("pins"), &pins).unwrap();
        match CacheStore::open(d.path()) {
            Ok(_) => prop_assert_eq!(&format[..], b"hoardfs cache 1\n"),
            Err(e) => prop_assert!(e.to_string().contains("unknown format"), "{}", e),
        }
        let root = hoardfs::source::BeneathRoot::open(d.path()).unwrap();
        let p = Pins::load(std::sync::Arc::new(root)).unwrap();
        prop_assert!(!p.is_pinned(Path::new("")) || p.list().iter().all(|x| !x.as_os_str().is_empty()));
    }
}

#[test]
fn a_record_of_the_previous_format_is_rejected() {
    let r = CacheRecord::empty(SourceIdentity::default(), 4096);
    let mut b = r.encode();
    b[8..12].copy_from_slice(&2u32.to_le_bytes());
    re_crc(&mut b);
    assert_eq!(
        CacheRecord::decode(&b),
        Err(hoardfs::cache::record::RecordError::Format(2))
    );
}

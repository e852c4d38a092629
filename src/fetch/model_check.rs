//! Flights, the gate and the epoch under the shuttle model checker (`crate::sync`): readers
//! fetching one chunk race a write through the mount and a truncation, in the schedules
//! shuttle picks at every lock, wait and wake-up.
//!
//! The readers and the writers follow the file system's steps (`fs/fetch.rs`'s `read_once`,
//! `work`, `fetch_piece` and `flight_complete`; `fs/write.rs`'s `write`; `fs/attr.rs`'s
//! truncation) over the real `FileFetch` and `Flight`; the cache record's presence bit and
//! the bytes are versions: the cache file's piece holds the source version it was copied
//! from, and the source's version moves with each write.

use std::fs::File;
use std::sync::Arc;

use shuttle::sync::Mutex as ModelMutex;
use shuttle::thread;

use super::{End, FileFetch, Flight, PIECE, Step};

const ITERATIONS: usize = 3000;

/// What `Inode::file` guards, reduced to one chunk of two pieces.
struct State {
    fetch: Arc<FileFetch>,
    present: bool,
}

struct File1 {
    /// `Inode::file`.
    state: ModelMutex<State>,
    /// The source file's version.
    source: ModelMutex<u64>,
    /// The source version each piece of the cache data file was copied from.
    cache: ModelMutex<[u64; 2]>,
}

/// How one read ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Read {
    /// The chunk was present when the read looked.
    Hit,
    /// The read waited for the flight to bring its bytes.
    Ready,
    Ended(End),
}

impl File1 {
    fn new() -> File1 {
        // Writes go to the model's `cache`; the descriptor only has to exist.
        let data = File::open("/dev/null").unwrap();
        File1 {
            state: ModelMutex::new(State {
                fetch: Arc::new(FileFetch::new(Some(data))),
                present: false,
            }),
            source: ModelMutex::new(0),
            cache: ModelMutex::new([u64::MAX; 2]),
        }
    }

    /// A read of the whole chunk: joins the flight in the file's in-flight table or starts
    /// one, fetches the pieces nobody claimed, then waits for the others. Returns the
    /// flight it used.
    fn read(&self) -> (Read, Option<Arc<Flight>>) {
        let (ff, f) = {
            let st = self.state.lock().unwrap();
            if st.present {
                return (Read::Hit, None);
            }
            let ff = st.fetch.clone();
            let epoch = ff.epoch();
            let mut flights = ff.flights.lock().unwrap();
            let f = flights
                .entry(0)
                .or_insert_with(|| Arc::new(Flight::new(0, epoch, 0, 2 * PIECE, false)))
                .clone();
            drop(flights);
            (ff, f)
        };
        let mut got = self.work(&ff, &f, false);
        if got.is_none() {
            got = self.work(&ff, &f, true);
        }
        let got = got.unwrap();
        if got == Read::Ready {
            // The bytes read under the gate at the flight's generation are the source's.
            let same = ff.with_data(f.epoch, |_| {
                let s = *self.source.lock().unwrap();
                *self.cache.lock().unwrap() == [s, s]
            });
            assert_ne!(same, Some(false), "a read served bytes of an older version");
        }
        (got, Some(f))
    }

    /// `CachingFs::work`: `None` while others still fetch (only without waiting).
    fn work(&self, ff: &Arc<FileFetch>, f: &Arc<Flight>, wait: bool) -> Option<Read> {
        let mut waited = false;
        loop {
            match f.next(0..2, wait, &mut waited)? {
                Step::Ready => return Some(Read::Ready),
                Step::Ended(e) => return Some(Read::Ended(e)),
                Step::Fetch(i) => {
                    // The source read, then the cache write under the gate.
                    let v = *self.source.lock().unwrap();
                    let written = ff.write_data(f.epoch, |_| {
                        self.cache.lock().unwrap()[i] = v;
                        Ok(())
                    });
                    if written.is_none() {
                        f.finish(End::Aborted);
                        return Some(Read::Ended(End::Aborted));
                    }
                    if f.piece_written(i) {
                        self.complete(ff, f);
                    }
                }
            }
        }
    }

    /// `CachingFs::flight_complete`: marks the chunk present only at the flight's
    /// generation.
    fn complete(&self, ff: &Arc<FileFetch>, f: &Arc<Flight>) {
        let mut st = self.state.lock().unwrap();
        let mut end = End::Aborted;
        if Arc::ptr_eq(&st.fetch, ff) && ff.epoch() == f.epoch {
            st.present = true;
            end = End::Complete;
        }
        ff.remove(f);
        f.finish(end);
    }

    /// A write through the mount covering the chunk: under the state's mutex, fetches in
    /// flight are aborted, the source is written, then the cache file, and the chunk holds
    /// the source's bytes.
    fn write(&self) {
        let mut st = self.state.lock().unwrap();
        st.fetch.invalidate();
        let v = {
            let mut s = self.source.lock().unwrap();
            *s += 1;
            *s
        };
        *self.cache.lock().unwrap() = [v, v];
        st.present = true;
    }

    /// A truncation (to the same length, with other bytes): the chunk is no longer cached.
    fn truncate(&self) {
        let mut st = self.state.lock().unwrap();
        st.fetch.invalidate();
        *self.source.lock().unwrap() += 1;
        st.present = false;
    }

    /// A chunk marked present holds the source's current bytes.
    fn check(&self) {
        let st = self.state.lock().unwrap();
        let s = *self.source.lock().unwrap();
        if st.present {
            assert_eq!(
                *self.cache.lock().unwrap(),
                [s, s],
                "the chunk is marked present with bytes of an older version"
            );
        }
    }
}

/// Two readers of one missing chunk share its flight (each fetches a piece, then waits for
/// the other's) while a write and a truncation move the file to new versions: no fetch
/// that began before a write leaves the chunk marked present with the older bytes, a read
/// never serves them, and readers of one flight all see how it ended.
#[test]
fn fetches_race_writes_and_truncation() {
    shuttle::check_random(
        || {
            let m = Arc::new(File1::new());
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    let m = m.clone();
                    thread::spawn(move || m.read())
                })
                .collect();
            let mw = m.clone();
            let writer = thread::spawn(move || {
                mw.write();
                mw.check();
                mw.truncate();
            });
            let outcomes: Vec<_> = readers.into_iter().map(|r| r.join().unwrap()).collect();
            writer.join().unwrap();
            m.check();
            for (got, f) in &outcomes {
                let Some(f) = f else { continue };
                // Everyone who waited on a flight saw how it ended.
                match f.end() {
                    End::Complete => assert_eq!(*got, Read::Ready),
                    end => assert_eq!(*got, Read::Ended(end)),
                }
            }
            if let [(a, Some(fa)), (b, Some(fb))] = &outcomes[..]
                && Arc::ptr_eq(fa, fb)
            {
                assert_eq!(a, b, "readers of one flight saw different ends");
            }
            // Nothing is left in flight.
            assert!(!m.state.lock().unwrap().fetch.busy());
        },
        ITERATIONS,
    );
}

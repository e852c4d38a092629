//! Reads through the daemon and the fetches behind them: the read path, the whole-file
//! fetch on open, and the fetch workers. The mechanism (flights, pieces, the queue,
//! sequential detection, the hint) is `crate::fetch`; this file ties it to the cache record
//! and its crash rules: a chunk is marked present only after all its bytes were written to
//! the cache file, under the file's state mutex, and only if the file's generation is the
//! one the fetch started with.

use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use fuser::Errno;

use super::Inode;
use super::{CachingFs, FileState, Handle, Result, errno, now_millis};
use crate::fetch::{End, FileFetch, Flight, SourceFd, Step};
use crate::fetch_pool::Job;
use crate::source::SourceReader;
use crate::source::read_full;
use crate::stats::Stats;

mod behind;
mod jobs;
mod whole;

pub use jobs::spawn_fetch_workers;

/// What a fetch of some pieces needs besides the flight.
struct Ctx<'a> {
    inode: &'a Arc<Inode>,
    ff: &'a Arc<FileFetch>,
    src: &'a Arc<SourceFd>,
}

/// How copying a piece from the source to the cache file went.
enum Copied {
    Bytes(usize),
    SourceFailed(std::io::Error),
    CacheFailed(std::io::Error),
    /// The file's cached content changed meanwhile.
    Aborted,
    /// A flight that copies only what is in memory met a page that is not.
    NotResident,
}

/// How a wait for a range of a flight ended.
enum Got {
    Ready,
    /// Some of the range is still being fetched by others (only without waiting).
    Pending,
    Failed,
    Aborted,
}

impl CachingFs {
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>> {
        let h = self.handle(fh)?;
        if size == 0 {
            return Ok(Vec::new());
        }
        // The short path: inside the chunk this handle last found present.
        if let Some(Ok(buf)) = h
            .fetch
            .hint_read(offset, offset.saturating_add(size as u64))
        {
            let c = &self.stats.cache;
            Stats::add(&c.read_hits, 1);
            Stats::add(&c.hint_reads, 1);
            Stats::add(&c.bytes_from_cache, buf.len() as u64);
            return Ok(buf);
        }
        // Each pass that finds the file's generation changed under it starts over.
        for _ in 0..16 {
            if let Some(buf) = self.read_once(&h, offset, size)? {
                return Ok(buf);
            }
        }
        self.read_source(&h, offset, size)
    }

    /// One attempt at a read: `None` if the cached content changed meanwhile.
    fn read_once(&self, h: &Handle, offset: u64, size: u32) -> Result<Option<Vec<u8>>> {
        let mut guard = h.inode.file();
        let state = guard.as_mut().ok_or(Errno::EBADF)?;
        let file_size = state.record().identity.size;
        if offset >= file_size {
            return Ok(Some(Vec::new()));
        }
        let end = file_size.min(offset + size as u64);
        if state.files().is_none() || state.fetch.data.is_none() {
            drop(guard);
            return self.read_source(h, offset, size).map(Some);
        }
        let cs = state.record().chunk_size;
        let ff = state.fetch.clone();
        let epoch = ff.epoch();
        let (first, last) = (offset / cs, (end - 1) / cs);
        // The fetch descriptor is closed once a file is complete; a reset since needs it.
        if state.fetch_src.is_none() && (first..=last).any(|c| !state.record().is_present(c)) {
            state.fetch_src = h.inode.path().and_then(|p| {
                let id = &state.record().identity;
                self.fetcher.open_source(|| self.open_fetch_reader(&p, id))
            });
        }
        let chunk_len = |c: u64| cs.min(file_size - c * cs);
        let mut flights = ff.flights.lock().unwrap();
        // Missing chunks nobody fetches yet need a descriptor and room in the cache;
        // without them the read goes to the source (and flights this read started are
        // dropped: nothing is left half started).
        let minute = (now_millis() / 60_000) as u32;
        let mut need: Vec<(Arc<Flight>, bool)> = Vec::new();
        let mut present_at_plan = true;
        let mut startable = true;
        for c in first..=last {
            state.chunk_read(c, minute);
            if state.record().is_present(c) {
                if ff.take_prefetched(c) {
                    Stats::add(&self.stats.cache.prefetch_hits, 1);
                }
                continue;
            }
            present_at_plan = false;
            if let Some(f) = flights.get(&c) {
                need.push((f.clone(), false));
                continue;
            }
            if state.fetch_src.is_none() || !self.usage.may_grow(chunk_len(c)) {
                startable = false;
                break;
            }
            let f = Flight::new(c, epoch, c * cs, chunk_len(c), false)
                .with_piece(self.piece_size(cs))
                .reserving(&self.usage);
            let f = Arc::new(f);
            flights.insert(c, f.clone());
            need.push((f, true));
        }
        if !startable {
            for (f, mine) in need {
                if mine {
                    flights.remove(&f.chunk);
                    f.finish(End::Aborted);
                }
            }
            drop(flights);
            drop(guard);
            return self.read_source(h, offset, size).map(Some);
        }
        // Prefetch: the next chunks of a sequential reader, in the background.
        if let Some(src) = state.fetch_src.clone() {
            let window = self.fetcher.tun.window.load(Relaxed);
            for c in h.fetch.observe(offset, end, cs, window) {
                if c >= state.record().nchunks() {
                    break;
                }
                if state.record().is_present(c) || flights.contains_key(&c) {
                    continue;
                }
                if !self.usage.may_grow(chunk_len(c)) {
                    break;
                }
                let f = Flight::new(c, epoch, c * cs, chunk_len(c), true)
                    .with_piece(self.piece_size(cs))
                    .reserving(&self.usage);
                let f = Arc::new(f);
                flights.insert(c, f.clone());
                let job = Job {
                    inode: h.inode.clone(),
                    ff: ff.clone(),
                    flight: f,
                    src: src.clone(),
                };
                if let Err(job) = self.fetcher.try_queue(job, false) {
                    flights.remove(&c);
                    drop(job);
                    break;
                }
            }
        }
        let src = state.fetch_src.clone();
        drop(flights);
        drop(guard);

        let mut got = Got::Ready;
        let mut waited = false;
        if !need.is_empty() {
            // Present chunks need no descriptor, and a flight this read started came with
            // one. One it joined may have come with another opener's while this state has
            // none (closed by a reset since, and none could be opened for the version now
            // cached: the file kept changing behind the mount): read as when no flight can
            // start (this used to answer EIO).
            let Some(src) = src else {
                drop(need);
                return self.read_source(h, offset, size).map(Some);
            };
            let ctx = Ctx {
                inode: &h.inode,
                ff: &ff,
                src: &src,
            };
            // Our own pieces first, then the rest of the chunks we started goes to a
            // worker (or, when none is free within the budget, we fetch it ourselves).
            for (k, (f, mine)) in need.iter().enumerate() {
                got = self.work(&ctx, f, f.pieces_of(offset, end), false, &mut waited);
                if matches!(got, Got::Failed | Got::Aborted) {
                    // Flights we started and nobody works on must not linger.
                    for (f, mine) in &need[k + 1..] {
                        if *mine {
                            ff.remove(f);
                            f.finish(End::Aborted);
                        }
                    }
                    break;
                }
                if *mine && !f.is_done() {
                    let job = Job {
                        inode: h.inode.clone(),
                        ff: ff.clone(),
                        flight: f.clone(),
                        src: src.clone(),
                    };
                    if self.fetcher.try_queue(job, true).is_err() {
                        got = self.work(&ctx, f, 0..f.npieces(), false, &mut waited);
                    }
                }
            }
            if !matches!(got, Got::Failed | Got::Aborted) {
                for (f, _) in &need {
                    got = self.work(&ctx, f, f.pieces_of(offset, end), true, &mut waited);
                    if !matches!(got, Got::Ready) {
                        break;
                    }
                }
            }
        }
        match got {
            Got::Ready => {}
            Got::Aborted => return Ok(None),
            Got::Failed | Got::Pending => return self.read_source(h, offset, size).map(Some),
        }
        let early = need.iter().any(|(f, _)| f.end() != End::Complete);
        let mut buf = vec![0u8; (end - offset) as usize];
        let r = ff.with_data(epoch, |data| read_full(data, &mut buf, offset));
        match r {
            None => return Ok(None),
            Some(Ok(n)) if n == buf.len() => {}
            Some(_) => {
                Stats::add(&self.stats.cache.cache_errors, 1);
                if let Some(state) = h.inode.file().as_mut()
                    && Arc::ptr_eq(&state.fetch, &ff)
                {
                    state.drop_cached();
                }
                return self.read_source(h, offset, size).map(Some);
            }
        }
        let c = &self.stats.cache;
        Stats::add(
            if need.is_empty() {
                &c.read_hits
            } else {
                &c.read_misses
            },
            1,
        );
        Stats::add(&c.bytes_from_cache, buf.len() as u64);
        if early {
            Stats::add(&c.early_returns, 1);
        }
        if waited {
            Stats::add(&c.fetch_waits, 1);
        }
        // The hint: the chunk this read lay in, if it is known present.
        if first == last && (present_at_plan || !early) {
            let range = first * cs..(first * cs + chunk_len(first));
            h.fetch.set_hint(&ff, epoch, range, cs);
        }
        Ok(Some(buf))
    }

    /// The uncached path: straight from the source.
    /// Bytes fetched per source read: `PIECE`, or the whole chunk where each read is a
    /// request of its own (an object store's GET).
    pub(in crate::fs) fn piece_size(&self, chunk_size: u64) -> u64 {
        if self.caps().reads_by_request {
            chunk_size
        } else {
            crate::fetch::PIECE
        }
    }

    fn read_source(&self, h: &Handle, offset: u64, size: u32) -> Result<Vec<u8>> {
        Stats::add(&self.stats.cache.read_misses, 1);
        // Guarded: a hung source times out and the mount goes offline (`health.rs`).
        let buf = match h.source.as_ref() {
            Some(f) => self.source.with_fd(f.as_fd(), move |f| {
                let mut buf = vec![0u8; size as usize];
                let n = read_full(f, &mut buf, offset)?;
                buf.truncate(n);
                Ok(buf)
            }),
            None => {
                let fetch_src = h.inode.file().as_ref().and_then(|s| s.fetch_src.clone());
                match fetch_src {
                    Some(src) => self.source.read_at(&src.reader, size as usize, offset),
                    None => self.read_own_file(h, offset, size),
                }
            }
        }
        .map_err(errno)?;
        Stats::add(&self.stats.cache.bytes_from_source, buf.len() as u64);
        Ok(buf)
    }

    /// A read with no descriptor to read through: none could be opened for the cached
    /// version (the file's identity kept moving while it was rewritten behind the mount,
    /// `open_fetch_reader`). The file itself is read, uncached, as a reader of a local
    /// file being written would see it: through the open's `O_PATH` descriptor of it,
    /// whatever name leads to it now (by name, a file renamed over since had no way left
    /// to be read: `EIO`); never another file that took its name.
    fn read_own_file(&self, h: &Handle, offset: u64, size: u32) -> std::io::Result<Vec<u8>> {
        let eio = || std::io::Error::from_raw_os_error(libc::EIO);
        if !self.caps().descriptors {
            return Err(eio());
        }
        let path_fd = (h.inode.file().as_ref()).and_then(|s| s.path_fd.clone());
        let f = match path_fd {
            Some(fd) => self.source.reopen(fd.as_fd(), libc::O_RDONLY)?,
            None => {
                let f =
                    (self.source).open_file(&h.inode.path().ok_or_else(eio)?, libc::O_RDONLY)?;
                let st = self.source.fstat(f.as_fd())?;
                if self.stable_ino && !h.inode.is_same_file(&st) {
                    return Err(eio());
                }
                f
            }
        };
        self.source.with_fd(f.as_fd(), move |f| {
            let mut buf = vec![0u8; size as usize];
            let n = read_full(f, &mut buf, offset)?;
            buf.truncate(n);
            Ok(buf)
        })
    }

    /// Fetches the unclaimed pieces of `range` of `f`; with `wait`, then waits for the
    /// pieces others are fetching.
    fn work(
        &self,
        ctx: &Ctx<'_>,
        f: &Arc<Flight>,
        range: std::ops::Range<usize>,
        wait: bool,
        waited: &mut bool,
    ) -> Got {
        loop {
            match f.next(range.clone(), wait, waited) {
                None => return Got::Pending,
                Some(Step::Ready) => return Got::Ready,
                Some(Step::Ended(End::Aborted)) => return Got::Aborted,
                Some(Step::Ended(_)) => return Got::Failed,
                Some(Step::Fetch(i)) => {
                    if let Err(e) = self.fetch_piece(ctx, f, i) {
                        return e;
                    }
                }
            }
        }
    }

    /// Reads piece `i` of `f` from the source and writes it to the cache file; the writer
    /// of the last piece marks the chunk present.
    fn fetch_piece(
        &self,
        ctx: &Ctx<'_>,
        f: &Arc<Flight>,
        i: usize,
    ) -> std::result::Result<(), Got> {
        let r = f.piece(i);
        let len = (r.end - r.start) as usize;
        let copied = match &ctx.src.reader {
            SourceReader::File(_) => self.copy_file_piece(ctx, f, r.start, len),
            SourceReader::Object { .. } => self.stream_object_piece(ctx, f, r.start, len),
        };
        let n = match copied {
            Copied::Bytes(n) => n,
            Copied::SourceFailed(e) => {
                tracing::debug!(
                    "fetch of chunk {} failed: {e}; reading the source directly",
                    f.chunk
                );
                return Err(self.flight_failed(ctx, f));
            }
            Copied::CacheFailed(e) => {
                tracing::warn!("cache write failed: {e}");
                Stats::add(&self.stats.cache.cache_errors, 1);
                return Err(self.flight_failed(ctx, f));
            }
            Copied::Aborted => {
                f.finish(End::Aborted);
                return Err(Got::Aborted);
            }
            Copied::NotResident => {
                // Not fetched, and not wanted from the disk: the chunk stays absent.
                self.drop_flight(ctx, f, End::Aborted);
                return Err(Got::Aborted);
            }
        };
        Stats::add(&self.stats.cache.bytes_from_source, n as u64);
        if n < len {
            // The source is shorter than the version we cache: it changed under us.
            tracing::debug!("source shorter than cached version at chunk {}", f.chunk);
            return Err(self.flight_failed(ctx, f));
        }
        if f.piece_written(i) {
            self.flight_complete(ctx, f);
        }
        Ok(())
    }

    /// A piece from a source file: one read, then one write to the cache file.
    fn copy_file_piece(&self, ctx: &Ctx<'_>, f: &Arc<Flight>, start: u64, len: usize) -> Copied {
        let read = if f.resident_only {
            match self.source.read_resident_at(&ctx.src.reader, len, start) {
                Ok(None) => return Copied::NotResident,
                r => r.map(Option::unwrap_or_default),
            }
        } else {
            self.source.read_at(&ctx.src.reader, len, start)
        };
        let buf = match read {
            Ok(b) => b,
            Err(e) => return Copied::SourceFailed(e),
        };
        let written = |d: &std::fs::File| {
            d.write_all_at(&buf, start)?;
            // Under the gate: an invalidation cannot slip between the write and this.
            f.committed(buf.len() as u64);
            Ok::<(), std::io::Error>(())
        };
        match ctx.ff.write_data(f.epoch, written) {
            None => Copied::Aborted,
            Some(Err(e)) => Copied::CacheFailed(e),
            Some(Ok(())) => Copied::Bytes(buf.len()),
        }
    }

    /// A piece of an object: the GET's body is written to the cache file as it arrives
    /// (no buffer of the piece: a piece is a whole chunk there).
    fn stream_object_piece(
        &self,
        ctx: &Ctx<'_>,
        f: &Arc<Flight>,
        start: u64,
        len: usize,
    ) -> Copied {
        // Why the sink stopped the GET, if it did: not a source error.
        let stopped: Arc<std::sync::Mutex<Option<Copied>>> = Arc::default();
        let (ff, flight, why) = (ctx.ff.clone(), f.clone(), stopped.clone());
        let sink = move |off: u64, bytes: &[u8]| {
            let written = |d: &std::fs::File| {
                d.write_all_at(bytes, off)?;
                // Under the gate, as for a file's piece.
                flight.committed(bytes.len() as u64);
                Ok::<(), std::io::Error>(())
            };
            let stop = match ff.write_data(flight.epoch, written) {
                Some(Ok(())) => return Ok(()),
                None => Copied::Aborted,
                Some(Err(e)) => Copied::CacheFailed(e),
            };
            *why.lock().unwrap() = Some(stop);
            Err(std::io::Error::from_raw_os_error(libc::ECANCELED))
        };
        let r = self
            .source
            .read_object_into(&ctx.src.reader, len, start, sink);
        if let Some(stop) = stopped.lock().unwrap().take() {
            return stop;
        }
        match r {
            Ok(n) => Copied::Bytes(n as usize),
            Err(e) => Copied::SourceFailed(e),
        }
    }

    fn flight_failed(&self, ctx: &Ctx<'_>, f: &Arc<Flight>) -> Got {
        self.drop_flight(ctx, f, End::Failed(libc::EIO));
        Got::Failed
    }

    /// Ends a flight that filled nothing: its waiters get `end`, the chunk stays absent.
    fn drop_flight(&self, ctx: &Ctx<'_>, f: &Arc<Flight>, end: End) {
        let mut guard = ctx.inode.file();
        ctx.ff.remove(f);
        f.finish(end);
        self.unload_if_idle(ctx.inode, &mut guard);
    }

    /// Every piece is in the cache file: the chunk becomes present (crash rule 1: on disk
    /// only at the next checkpoint, after fdatasync).
    fn flight_complete(&self, ctx: &Ctx<'_>, f: &Arc<Flight>) {
        // Start the chunk's writeback now, outside the state mutex: the checkpoint's
        // fdatasync, which runs under it, then finds little left to write instead of
        // stalling readers and workers while `checkpoint_chunks` chunks reach the disk.
        ctx.ff.with_data(f.epoch, |d| {
            use std::os::fd::AsRawFd;
            // SAFETY: a plain syscall on an open descriptor; failure only loses the hint.
            unsafe {
                libc::sync_file_range(
                    d.as_raw_fd(),
                    f.off as i64,
                    f.len as i64,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
        });
        let mut guard = ctx.inode.file();
        let mut end = End::Aborted;
        // Nothing is claimed while writers write the source unseen (`fs/source_writes.rs`).
        if let Some(state) = guard.as_mut()
            && Arc::ptr_eq(&state.fetch, ctx.ff)
            && ctx.ff.epoch() == f.epoch
            && state.files().is_some()
            && state.source_writers() == 0
        {
            end = End::Complete;
            state.filled(f.chunk);
            let c = &self.stats.cache;
            Stats::add(&c.chunks_fetched, 1);
            if f.prefetch {
                Stats::add(&c.chunks_prefetched, 1);
                ctx.ff.note_prefetched(f.chunk);
            }
            // A file completed while an open waits for its whole-file fetch is made
            // durable at its last close (FUSE sends that release after close(2) has
            // returned), not on the open's path.
            let complete = state.record().is_complete();
            if state.unsynced_fills() >= self.cfg.checkpoint_chunks {
                state.checkpoint(&self.env());
            } else if complete && state.opening() == 0 {
                // A file fetched whole (a prefetch, or its last chunk read): the group
                // commit makes it durable, unless written through the mount meanwhile.
                if state.written() {
                    state.checkpoint(&self.env());
                } else {
                    self.checkpoint_soon(ctx.inode.id, state);
                }
            }
            if state.record().is_complete() {
                // Nothing left to fetch: give the descriptor back (jobs still holding it
                // close it when they end).
                state.fetch_src = None;
            }
        }
        ctx.ff.remove(f);
        f.finish(end);
        self.unload_if_idle(ctx.inode, &mut guard);
    }

    /// Drops the cache state of a file nobody has open and nothing fetches for.
    pub(super) fn unload_if_idle(&self, inode: &Inode, guard: &mut Option<Box<FileState>>) {
        let Some(state) = guard.as_mut() else {
            return;
        };
        if !state.is_closed() {
            return;
        }
        // Durable now, even if fetches still in flight keep the state loaded a little
        // longer (the last of them unloads it).
        state.used_now();
        if !state.needs_checkpoint() {
            if !state.persist_use(&self.env())
                && let Some(path) = inode.path()
            {
                // The cleaner orders by it all the same.
                self.usage.used(&path, state.record().last_used);
            }
        } else if self.checkpoint_soon(inode.id, state) {
            // The state stays loaded until its commit, which unloads it.
            return;
        }
        if !state.fetch.busy() {
            self.unload(inode, guard);
        }
    }
}

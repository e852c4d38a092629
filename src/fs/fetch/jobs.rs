//! The fetch workers and their jobs: a chunk's flight, and the directory prefetch's
//! whole-file fetches of the files an open is expected to be followed by.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};

use super::{Ctx, Got};
use crate::fetch::{End, Flight};
use crate::fetch_pool::{FileJob, Found, Job, Task};
use crate::fs::state::Look;
use crate::fs::{CachingFs, Inode};
use crate::stats::Stats;
use crate::threads::Threads;

impl CachingFs {
    /// A read-only open of `path` (node `inode`) in a listed directory, which `found` the
    /// file so in the cache: follows the directory's cursor and, while the order holds,
    /// queues whole-file fetches of the next files after a miss, or has their cache
    /// entries read ahead after cold hits (`crate::fetch_pool::DirPrefetch`).
    pub(in crate::fs) fn dir_prefetch_open(&self, inode: &Inode, path: &Path, found: Found) {
        let max = self.fetcher.tun.dir_prefetch.load(Relaxed);
        if max == 0 {
            return;
        }
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return;
        };
        let mut opened = self.fetcher.dirs.opened(dir, name, found, max);
        let c = &self.stats.cache;
        if opened.hit {
            Stats::add(&c.dir_prefetch_hits, 1);
        }
        self.warm_ahead(std::mem::take(&mut opened.warm));
        let Some((cursor, generation)) = opened.cursor else {
            return;
        };
        // A guess until the worker stats the file: one chunk, or the threshold if smaller.
        let guess = self
            .cfg
            .chunk_size
            .min(self.cfg.whole_file_threshold)
            .max(1);
        for (pos, path) in opened.ahead {
            let job = FileJob {
                dir_id: inode.parent(),
                path,
                pos,
                cursor: cursor.clone(),
                generation,
                len: AtomicU64::new(guess),
            };
            if !self.fetcher.try_queue_file(job) {
                // No budget left: the rest is not queued either.
                Stats::add(&c.dir_prefetch_dropped, 1);
                break;
            }
        }
    }

    /// Has the cache entries of `paths` read into memory ahead of their opens, counted.
    pub(in crate::fs) fn warm_ahead(&self, paths: Vec<std::path::PathBuf>) {
        if !paths.is_empty() {
            Stats::add(&self.stats.cache.dir_warm_ahead, paths.len() as u64);
            self.cache.warm_ahead(paths);
        }
    }

    /// A file of the directory prefetch: fetched whole through its own cache state, as an
    /// open would, so that an open meanwhile joins the same flights and an open after finds
    /// a record vouched for by the stat taken here (and compares it with the source, as
    /// for any cached file). Skipped when it is not wanted any more, is loaded already
    /// (open, or fetched by someone), is cached, is no small regular file, or a bound
    /// (in-flight bytes, source descriptors, the cache's high watermark) says no.
    fn run_file_job(&self, job: &FileJob) {
        let c = &self.stats.cache;
        let dropped = || Stats::add(&c.dir_prefetch_dropped, 1);
        if !job.wanted() || !self.online() {
            return dropped();
        }
        let Ok(mut st) = self.source.stat(&job.path) else {
            return dropped();
        };
        if !st.is_file() || st.size == 0 || st.size > self.cfg.whole_file_threshold {
            return;
        }
        if !self.fetcher.resize(job, st.size) || !self.usage.may_grow(st.size) {
            return dropped();
        }
        let inode = self.inodes.entry_unreferenced(job.dir_id, &job.path, &st);
        let mut guard = inode.file();
        // Freed from the free list before we locked it: a state loaded now would sit in an
        // entry no lookup finds, beside the one a lookup makes (`InodeTable::holds`).
        if guard.is_some() || !job.wanted() || !self.inodes.holds(&inode) {
            return;
        }
        let (state, reset) = self.load_state(&inode, &job.path, &mut st, Look::Source);
        if reset {
            // As at an open's load: pages the kernel kept from an earlier open may be of
            // the version the cache just dropped, and the next open must not keep them.
            inode.content_changed();
        }
        let state = guard.insert(Box::new(state));
        if state.files().is_none() || state.record().is_complete() {
            return self.unload_if_idle(&inode, &mut guard);
        }
        state.fetch_src = self
            .fetcher
            .open_source(|| self.open_fetch_reader(&job.path, &state.record().identity));
        let Some(src) = state.fetch_src.clone() else {
            dropped();
            return self.unload_if_idle(&inode, &mut guard);
        };
        let ff = state.fetch.clone();
        let epoch = ff.epoch();
        let cs = state.record().chunk_size;
        let size = state.record().identity.size;
        let mut all = Vec::new();
        {
            let mut flights = ff.flights.lock().unwrap();
            for ch in 0..state.record().nchunks() {
                if state.record().is_present(ch) || flights.contains_key(&ch) {
                    continue;
                }
                let len = cs.min(size - ch * cs);
                let f = Arc::new(
                    Flight::new(ch, epoch, ch * cs, len, false)
                        .with_piece(self.piece_size(cs))
                        .reserving(&self.usage),
                );
                flights.insert(ch, f.clone());
                all.push(f);
            }
        }
        if all.is_empty() {
            return self.unload_if_idle(&inode, &mut guard);
        }
        Stats::add(&c.dir_prefetch_files, 1);
        if let Some(dir) = job.path.parent() {
            self.fetcher.dirs.started(dir, &job.cursor, job.pos);
        }
        drop(guard);
        // The flights keep the state loaded; the last to complete makes the record durable
        // and unloads it (`flight_complete`). An opener arriving meanwhile helps and waits.
        let ctx = Ctx {
            inode: &inode,
            ff: &ff,
            src: &src,
        };
        let mut waited = false;
        for (k, f) in all.iter().enumerate() {
            if matches!(
                self.work(&ctx, f, 0..f.npieces(), false, &mut waited),
                Got::Failed | Got::Aborted
            ) {
                // Flights started here that nobody works on must not linger.
                let mut guard = inode.file();
                for f in &all[k + 1..] {
                    ff.remove(f);
                    f.finish(End::Aborted);
                }
                self.unload_if_idle(&inode, &mut guard);
                break;
            }
        }
    }

    fn run_job(&self, job: &Job<Inode>) {
        let ctx = Ctx {
            inode: &job.inode,
            ff: &job.ff,
            src: &job.src,
        };
        let mut waited = false;
        self.work(
            &ctx,
            &job.flight,
            0..job.flight.npieces(),
            false,
            &mut waited,
        );
    }
}

/// Starts the fetch workers (`--fetch-workers`), in the returned group; stopping it
/// closes the queue, and each worker ends after its job in progress.
pub fn spawn_fetch_workers(fs: &Arc<CachingFs>) -> std::io::Result<Threads> {
    // The recorded kind, not a fresh look at the path: an `s3://` source has none, and an
    // unreachable one at an offline start may hang.
    let n = fs
        .cfg
        .fetch_workers
        .unwrap_or_else(|| crate::config::default_fetch_workers(fs.source.is_remote()));
    let threads = Threads::new("fetch workers");
    let weak: Weak<CachingFs> = Arc::downgrade(fs);
    threads.on_stop(move || {
        if let Some(fs) = weak.upgrade() {
            fs.fetcher.close();
        }
    });
    for i in 0..n {
        let weak: Weak<CachingFs> = Arc::downgrade(fs);
        fs.fetcher.workers.fetch_add(1, Relaxed);
        threads.spawn(format!("fetch-{i}"), move |_| {
            loop {
                let Some(fs) = weak.upgrade() else { return };
                // Blocks while holding a strong reference, until a job comes or the
                // queue closes.
                let Some(task) = fs.fetcher.pop() else { return };
                match &task {
                    Task::Chunk(job) => fs.run_job(job),
                    Task::File(job) => fs.run_file_job(job),
                    Task::Behind(job) => fs.run_behind_job(job),
                }
                let len = task.bytes();
                drop(task);
                fs.fetcher.job_done(len);
            }
        })?;
    }
    Ok(threads)
}

//! Group commit of cache fills and writes (issue 22): a file closed with fills or writes not
//! yet on disk is not synced on the release's path. Its state stays loaded and is queued
//! here; one thread takes what was queued within `GATHER`, syncs those data files together
//! (writeback of all started, then each `fdatasync`ed: about one journal commit for the
//! batch) and then writes each file's record clean, as a checkpoint would (crash rule 1:
//! the data on disk before a record claims it). Until then the record on disk is dirty or
//! claims less, so a crash loses the recent fills and knows it; acknowledged writes are on
//! the source before they return and are not this module's business.
//!
//! A commit writes a record only if nothing changed in the file since the commit took its
//! ticket, before the sync (`FileState::commit_ticket`); a file changed meanwhile is queued
//! again by its next close. Locks: the queue's mutex is taken alone; a batch takes each
//! file's `Inode::file` in turn, never two at once, and syncs with none held.

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::entry::Stamped;
use super::{CachingFs, FileState};
use crate::coherence::Notice;
use crate::stats::Stats;

/// How long the first file of a batch waits for others: what a crash may lose at most
/// beyond the sync itself, and how long a closed file's state stays loaded.
const GATHER: Duration = Duration::from_millis(50);
/// A batch this large is committed at once.
const BATCH: usize = 256;
/// Beyond this many queued files a close checkpoints synchronously (each queued file keeps
/// its state, and so its descriptors, loaded)...
const MAX_QUEUED: usize = 1024;
/// ...and beyond this share (1/N) of the open-files limit: a queued state holds up to four
/// descriptors (data file, record, the fetch's and the source's `O_PATH`), so an eighth of
/// the limit at most (`crate::descriptors`).
const QUEUED_FDS_SHARE: usize = 32;

/// How many files may wait for the group commit at once.
fn max_queued() -> usize {
    MAX_QUEUED.min(crate::descriptors::share_of_limit(QUEUED_FDS_SHARE))
}

pub(super) struct GroupCommit {
    queue: Mutex<Queue>,
    /// `max_queued` when the file system was made.
    max_queued: usize,
    wake: Condvar,
    /// Set while the committing thread runs: without it, closes checkpoint themselves (an
    /// in-process core, or after unmount).
    running: AtomicBool,
    /// Held across a batch, so that `flush` returns only after the batch in progress too.
    batch: Mutex<()>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Default)]
struct Queue {
    ids: Vec<u64>,
    queued: HashSet<u64>,
    since: Option<Instant>,
    stop: bool,
}

impl Default for GroupCommit {
    fn default() -> GroupCommit {
        GroupCommit {
            queue: Mutex::default(),
            max_queued: max_queued(),
            wake: Condvar::new(),
            running: AtomicBool::new(false),
            batch: Mutex::default(),
            thread: Mutex::default(),
        }
    }
}

impl GroupCommit {
    /// Queues inode `id` (its state loaded, with `FileState::defer_checkpoint` to follow).
    /// False if the caller must checkpoint itself.
    pub(super) fn queue(&self, id: u64) -> bool {
        if !self.running.load(Relaxed) {
            return false;
        }
        let mut q = self.queue.lock().unwrap();
        if q.stop {
            return false;
        }
        if q.queued.contains(&id) {
            return true;
        }
        if q.ids.len() >= self.max_queued {
            return false;
        }
        q.ids.push(id);
        q.queued.insert(id);
        q.since.get_or_insert_with(Instant::now);
        if q.ids.len() == 1 || q.ids.len() >= BATCH {
            self.wake.notify_one();
        }
        true
    }

    /// The next batch: waits for a first file, then up to `GATHER` for others. `None`
    /// once stopped.
    fn next_batch(&self) -> Option<Vec<u64>> {
        let mut q = self.queue.lock().unwrap();
        loop {
            if q.stop {
                return None;
            }
            match q.since {
                None => q = self.wake.wait(q).unwrap(),
                Some(since) => {
                    let left = GATHER.saturating_sub(since.elapsed());
                    if left.is_zero() || q.ids.len() >= BATCH {
                        return Some(take(&mut q));
                    }
                    q = self.wake.wait_timeout(q, left).unwrap().0;
                }
            }
        }
    }
}

fn take(q: &mut Queue) -> Vec<u64> {
    q.queued.clear();
    q.since = None;
    std::mem::take(&mut q.ids)
}

impl CachingFs {
    /// Commits `ids`: tickets under each file's lock, one sync of the cache, then each
    /// record under its lock again; a closed file with nothing left to commit is unloaded.
    fn commit_batch(&self, ids: Vec<u64>) {
        let loaded: Vec<_> = {
            let loaded = self.loaded.lock().unwrap();
            ids.iter()
                .filter_map(|id| loaded.get(id).cloned())
                .collect()
        };
        // Each file's ticket and a descriptor of its data file, under its lock.
        let tickets: Vec<_> = loaded
            .into_iter()
            .filter_map(|inode| {
                let guard = inode.file();
                let state = guard.as_ref()?;
                let waiting = state.commit_ticket().and_then(|t| {
                    let data = state.files()?.data.try_clone().ok()?;
                    Some((t, data))
                });
                drop(guard);
                Some((inode, waiting))
            })
            .collect();
        // The batch's data files, with no lock held: writeback of all of them started
        // first, then each waited for. On a journalling file system (ext4, xfs) the first
        // `fdatasync`'s journal commit carries the others' allocations, so the rest find
        // theirs done: about one commit per batch rather than one per file (without a
        // journal each is its own flush). Only the cache's own files
        // (a `syncfs` would also write out whatever else the file system holds dirty,
        // the source's files among them when they share a disk).
        for (_, waiting) in &tickets {
            if let Some((_, data)) = waiting {
                // SAFETY: a plain syscall on an open descriptor; failure only loses the hint.
                unsafe {
                    libc::sync_file_range(data.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE)
                };
            }
        }
        let tickets: Vec<_> = tickets
            .into_iter()
            .map(|(inode, waiting)| {
                let synced = waiting.and_then(|(ticket, data)| match data.sync_data() {
                    Ok(()) => Some(ticket),
                    Err(e) => {
                        // Nothing of it is claimed: its record stays dirty or short.
                        tracing::warn!("cannot sync a cache file: {e}");
                        Stats::add(&self.stats.cache.cache_errors, 1);
                        None
                    }
                });
                (inode, synced)
            })
            .collect();
        Stats::add(&self.stats.cache.group_commits, 1);
        let env = self.env();
        for (inode, ticket) in tickets {
            let mut guard = inode.file();
            let Some(state) = guard.as_mut() else {
                continue;
            };
            if let Some(ticket) = ticket
                && state.commit_synced(&env, ticket) == Stamped::Discarded
            {
                // Edited in the cache directory since the close: nothing of it is
                // claimed, and the kernel's pages go too, so that the next open
                // refetches (as a load would have found it).
                inode.content_changed();
                self.coherence.notify(Notice::Inode(inode.id));
            }
            if state.is_closed() && !state.needs_checkpoint() && !state.fetch.busy() {
                self.unload(&inode, &mut guard);
            }
        }
    }

    /// The checkpoint of inode `id`'s state, by the group commit when it runs (synced with
    /// others shortly; the state stays loaded until then), else now. Returns whether it was
    /// handed to the group commit.
    pub(super) fn checkpoint_soon(&self, id: u64, state: &mut FileState) -> bool {
        if self.commits.queue(id) {
            state.defer_checkpoint();
            true
        } else {
            state.checkpoint(&self.env());
            false
        }
    }

    /// Commits everything queued now, in the caller's thread: before a cleaner's pass,
    /// which cannot evict a file whose state is loaded.
    pub(super) fn commit_now(&self) {
        let gc = &self.commits;
        let _batch = gc.batch.lock().unwrap();
        let ids = take(&mut gc.queue.lock().unwrap());
        self.commit_batch(ids);
    }

    /// Commits everything queued, in the caller's thread, and stops queueing: at unmount,
    /// so that a clean stop leaves clean records.
    pub fn stop_commits(&self) {
        let gc = &self.commits;
        let ids = {
            let mut q = gc.queue.lock().unwrap();
            q.stop = true;
            gc.wake.notify_all();
            take(&mut q)
        };
        gc.running.store(false, Relaxed);
        if let Some(t) = gc.thread.lock().unwrap().take() {
            let _ = t.join();
        }
        let _batch = gc.batch.lock().unwrap();
        self.commit_batch(ids);
    }
}

/// Starts the committing thread. It holds the file system only while committing a batch,
/// and ends at `stop_commits` or when the file system is dropped.
pub fn spawn_committer(fs: &Arc<CachingFs>) -> std::io::Result<()> {
    let weak: Weak<CachingFs> = Arc::downgrade(fs);
    let gc = &fs.commits;
    gc.running.store(true, Relaxed);
    let thread = std::thread::Builder::new()
        .name("commit".into())
        .spawn(move || {
            loop {
                let Some(fs) = weak.upgrade() else { return };
                let gc = &fs.commits;
                let Some(ids) = gc.next_batch() else { return };
                let _batch = gc.batch.lock().unwrap();
                fs.commit_batch(ids);
            }
        })?;
    *gc.thread.lock().unwrap() = Some(thread);
    Ok(())
}

//! The inotify watcher: watches on the source's directories (changed names) and on files
//! that hold callbacks (changes by any name), read in batches by the coherence thread.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::time::{Duration, Instant};

use rustix::fs::inotify::{self, ReadFlags, WatchFlags};

use super::{Change, Counters, NameChange};

#[derive(Default)]
struct WatchMaps {
    dir_of: HashMap<i32, u64>,
    /// A directory's watch and the number it was added as (`Watcher::added`): a watch
    /// dropped and added again is another watch, which missed what came between.
    wd_of: HashMap<u64, (i32, u64)>,
    /// Watches on files that hold callbacks, by watch and by node id.
    file_of: HashMap<i32, u64>,
    file_wd: HashMap<u64, i32>,
}

/// At most this many files are watched themselves (each pins a source inode in the
/// kernel, and its callback keeps an `O_PATH` descriptor), and no more than a quarter of
/// the descriptors the process may open; files beyond get no callback, and their opens ask
/// the source.
const MAX_FILE_WATCHES: usize = 65_536;

fn max_file_watches() -> usize {
    MAX_FILE_WATCHES.min(crate::descriptors::share_of_limit(4))
}

/// inotify watches on the source's directories, keyed by the directory's node id.
pub struct Watcher {
    fd: OwnedFd,
    /// Read on every lookup, getattr and opendir (is this directory watched?), written
    /// only when a watch is added or dropped.
    maps: RwLock<WatchMaps>,
    /// Watches added so far: each directory watch's number.
    added: AtomicU64,
    /// How many files may be watched themselves (`max_file_watches`, at start).
    max_files: usize,
    /// Bumped when events may have been lost (an overflow): every callback lapses.
    epoch: AtomicU64,
    /// Batches begun and batches handled (`begin_batch`, `batch_handled`): while they
    /// differ, events taken from the queue are not acted on yet.
    begun: AtomicU64,
    handled: AtomicU64,
}

/// What breaks a file's callback when it happens to the file itself, by whatever name:
/// data and attribute changes (link counts included), and its removal.
const FILE_WATCH_MASK: WatchFlags = WatchFlags::MODIFY
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::CLOSE_WRITE)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF);

const WATCH_MASK: WatchFlags = WatchFlags::CREATE
    .union(WatchFlags::DELETE)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::MODIFY)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::CLOSE_WRITE)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF)
    .union(WatchFlags::ONLYDIR)
    .union(WatchFlags::EXCL_UNLINK);

/// How long a batch keeps collecting events once the first arrived: a writer's stream of
/// MODIFY events becomes one revalidation, and the delay stays far below a second.
const BATCH_WINDOW: Duration = Duration::from_millis(30);
const BATCH_MAX_EVENTS: usize = 50_000;
/// How often a batch's window takes what has queued (far from filling the kernel's queue,
/// `max_queued_events`, 16,384 by default).
const BATCH_STEP: Duration = Duration::from_millis(10);

impl Watcher {
    pub(super) fn new() -> std::io::Result<Watcher> {
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC)?;
        Ok(Watcher {
            fd,
            maps: RwLock::default(),
            added: AtomicU64::new(0),
            max_files: max_file_watches(),
            epoch: AtomicU64::new(0),
            begun: AtomicU64::new(0),
            handled: AtomicU64::new(0),
        })
    }

    pub fn is_watched(&self, dir: u64) -> bool {
        self.maps.read().unwrap().wd_of.contains_key(&dir)
    }

    /// The number directory `dir`'s watch was added as, if it is watched.
    pub(super) fn watch_of(&self, dir: u64) -> Option<u64> {
        self.maps.read().unwrap().wd_of.get(&dir).map(|w| w.1)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(SeqCst)
    }

    /// Files watched themselves.
    pub fn files(&self) -> usize {
        self.maps.read().unwrap().file_wd.len()
    }

    /// The watcher thread is about to take events from the queue.
    pub fn begin_batch(&self) {
        self.begun.fetch_add(1, SeqCst);
    }

    /// The watcher thread has acted on every event it took.
    pub fn batch_handled(&self) {
        self.handled.store(self.begun.load(SeqCst), SeqCst);
    }

    /// No event waits: none in the queue, none taken and not yet acted on. A change to a
    /// watched file queues its event before the call that made it returns, so when this
    /// holds, every change completed before the call has been acted on.
    pub fn quiet(&self) -> bool {
        let begun = self.begun.load(SeqCst);
        if self.handled.load(SeqCst) != begun {
            return false;
        }
        // Unknown counts as busy.
        let queued = rustix::io::ioctl_fionread(&self.fd).unwrap_or(1);
        queued == 0 && self.begun.load(SeqCst) == begun
    }

    /// The watch on file `id` itself, if it has one.
    pub(super) fn file_watch(&self, id: u64) -> Option<i32> {
        self.maps.read().unwrap().file_wd.get(&id).copied()
    }

    /// Watches file `id` (open as `fd`) itself: its changes through any name, and changes
    /// of its link count, are then reported (`Batch::files`). The watch, or `None`.
    pub(super) fn watch_file(&self, id: u64, fd: BorrowedFd<'_>) -> Option<i32> {
        {
            let m = self.maps.read().unwrap();
            if let Some(&wd) = m.file_wd.get(&id) {
                return Some(wd);
            }
            if m.file_wd.len() >= self.max_files {
                return None;
            }
        }
        match self.add_watch(fd, FILE_WATCH_MASK) {
            Ok(wd) => {
                let mut m = self.maps.write().unwrap();
                if let Some(old) = m.file_of.insert(wd, id)
                    && old != id
                {
                    m.file_wd.remove(&old);
                }
                m.file_wd.insert(id, wd);
                Some(wd)
            }
            Err(e) => {
                tracing::debug!("cannot watch file {id}: {e}");
                None
            }
        }
    }

    pub fn len(&self) -> usize {
        self.maps.read().unwrap().wd_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An inotify watch with `mask` on the object open as `fd`, through its
    /// `/proc/self/fd` link: it lands on exactly that object, whatever its path now
    /// resolves to.
    fn add_watch(&self, fd: BorrowedFd<'_>, mask: WatchFlags) -> rustix::io::Result<i32> {
        let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
        inotify::add_watch(&self.fd, link.as_str(), mask)
    }

    /// Watches the directory open as `fd` (an `O_PATH` descriptor resolved beneath the
    /// source root): through its `/proc/self/fd` link, so the watch lands on exactly that
    /// directory whatever its path now resolves to.
    pub(super) fn add(&self, dir: u64, fd: BorrowedFd<'_>) -> bool {
        match self.add_watch(fd, WATCH_MASK) {
            Ok(wd) => {
                let mut m = self.maps.write().unwrap();
                if let Some(old) = m.dir_of.insert(wd, dir)
                    && old != dir
                {
                    // The same directory under a new node id (the old one was freed).
                    m.wd_of.remove(&old);
                }
                let number = self.added.fetch_add(1, SeqCst) + 1;
                m.wd_of.insert(dir, (wd, number));
                true
            }
            Err(e) => {
                tracing::debug!("cannot watch directory {dir}: {e}");
                false
            }
        }
    }

    /// Stops watching directories and files the inode table no longer has.
    pub fn prune(&self, alive: impl Fn(u64) -> bool) {
        let mut m = self.maps.write().unwrap();
        let dead: Vec<(u64, i32)> = m
            .wd_of
            .iter()
            .filter(|(dir, _)| !alive(**dir))
            .map(|(d, w)| (*d, w.0))
            .collect();
        for (dir, wd) in dead {
            m.wd_of.remove(&dir);
            if m.dir_of.get(&wd) == Some(&dir) {
                m.dir_of.remove(&wd);
                let _ = inotify::remove_watch(&self.fd, wd);
            }
        }
        let dead: Vec<(u64, i32)> = m
            .file_wd
            .iter()
            .filter(|(id, _)| !alive(**id))
            .map(|(id, wd)| (*id, *wd))
            .collect();
        for (id, wd) in dead {
            m.file_wd.remove(&id);
            if m.file_of.get(&wd) == Some(&id) {
                m.file_of.remove(&wd);
                let _ = inotify::remove_watch(&self.fd, wd);
            }
        }
    }

    /// Waits at most `timeout` for events; whether some came.
    pub fn wait_readable(&self, timeout: Duration) -> std::io::Result<bool> {
        let mut pfd = [rustix::event::PollFd::new(
            &self.fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: timeout.subsec_nanos() as i64,
        };
        match rustix::event::poll(&mut pfd, Some(&ts)) {
            Ok(n) => Ok(n > 0),
            Err(rustix::io::Errno::INTR) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Blocks for the next batch of events: the changed names (deduplicated, renames
    /// paired), directories changed themselves, and whether the queue overflowed.
    pub fn next_batch(&self, counters: &Counters) -> std::io::Result<Batch> {
        let mut buf = vec![std::mem::MaybeUninit::<u8>::uninit(); 64 << 10];
        let mut batch = Batch::default();
        let mut index: HashMap<(u64, OsString), usize> = HashMap::new();
        let mut moved_from: HashMap<u32, usize> = HashMap::new();
        let deadline_after_first = |first: Option<Instant>| first.map(|t| t + BATCH_WINDOW);
        let mut first: Option<Instant> = None;
        loop {
            if let Some(deadline) = deadline_after_first(first) {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || batch.names.len() >= BATCH_MAX_EVENTS {
                    return Ok(batch);
                }
                // The window is slept in steps rather than woken for each event: a writer
                // through the mount raises about ten events per file, and a wake-up and
                // a read for each took a tenth of the daemon's CPU in an untar (issue 22).
                std::thread::sleep(left.min(BATCH_STEP));
                if !self.wait_readable(Duration::ZERO)? {
                    continue;
                }
            }
            let mut reader = inotify::Reader::new(&self.fd, &mut buf);
            loop {
                let ev = match reader.next() {
                    Ok(ev) => ev,
                    Err(rustix::io::Errno::INTR) => break,
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(e) => return Err(e.into()),
                };
                first.get_or_insert_with(Instant::now);
                counters.watcher_events.fetch_add(1, Relaxed);
                let mask = ev.events();
                if mask.contains(ReadFlags::QUEUE_OVERFLOW) {
                    counters.watcher_overflows.fetch_add(1, Relaxed);
                    self.epoch.fetch_add(1, SeqCst);
                    batch.overflow = true;
                } else {
                    let wd = ev.wd();
                    let (dir, file) = {
                        let mut m = self.maps.write().unwrap();
                        let dir = m.dir_of.get(&wd).copied();
                        let file = m.file_of.get(&wd).copied();
                        if mask.contains(ReadFlags::IGNORED) {
                            if let Some(d) = dir {
                                m.dir_of.remove(&wd);
                                if m.wd_of.get(&d).map(|w| w.0) == Some(wd) {
                                    m.wd_of.remove(&d);
                                }
                            }
                            if let Some(id) = file {
                                m.file_of.remove(&wd);
                                if m.file_wd.get(&id) == Some(&wd) {
                                    m.file_wd.remove(&id);
                                }
                            }
                        }
                        (dir, file)
                    };
                    if let Some(id) = file
                        && !batch.files.contains(&id)
                    {
                        batch.files.push(id);
                    }
                    if let Some(dir) = dir {
                        match ev.file_name() {
                            None => {
                                if !batch.dirs.contains(&dir) {
                                    batch.dirs.push(dir);
                                }
                            }
                            Some(name) => {
                                let name = OsStr::from_bytes(name.to_bytes()).to_owned();
                                let change = Change {
                                    namespace: mask.intersects(
                                        ReadFlags::CREATE
                                            | ReadFlags::DELETE
                                            | ReadFlags::MOVED_FROM
                                            | ReadFlags::MOVED_TO,
                                    ),
                                    data: mask
                                        .intersects(ReadFlags::MODIFY | ReadFlags::CLOSE_WRITE),
                                    attrib: mask.contains(ReadFlags::ATTRIB),
                                };
                                let key = (dir, name.clone());
                                let i = *index.entry(key).or_insert_with(|| {
                                    batch.names.push(NameChange {
                                        dir,
                                        name: name.clone(),
                                        change: Change::default(),
                                        moved_to: None,
                                    });
                                    batch.names.len() - 1
                                });
                                let c = &mut batch.names[i].change;
                                c.namespace |= change.namespace;
                                c.data |= change.data;
                                c.attrib |= change.attrib;
                                if mask.contains(ReadFlags::MOVED_FROM) {
                                    moved_from.insert(ev.cookie(), i);
                                } else if mask.contains(ReadFlags::MOVED_TO)
                                    && let Some(&from) = moved_from.get(&ev.cookie())
                                {
                                    batch.names[from].moved_to = Some((dir, name));
                                }
                            }
                        }
                    }
                }
                if reader.is_buffer_empty() {
                    break;
                }
            }
            if first.is_none() {
                // Interrupted before any event: wait again.
                continue;
            }
        }
    }
}

/// One batch of watcher events.
#[derive(Debug, Default)]
pub struct Batch {
    pub names: Vec<NameChange>,
    /// Directories whose own attributes changed, or that were deleted or moved.
    pub dirs: Vec<u64>,
    /// Files watched themselves (they hold callbacks) that changed, by any name.
    pub files: Vec<u64>,
    pub overflow: bool,
}

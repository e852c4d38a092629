//! Frees the inodes of removed cache files off the request path. An unlinked file's
//! blocks are freed when its last reference goes, and with `-o discard` the freeing waits
//! for the device's discards: so whoever removes a cache entry holds a descriptor of each
//! file across the unlink and hands it here, and this thread's close does the freeing
//! (issue 22: two inodes freed on every unlink's path, one for the record and one for the
//! data).

use std::os::fd::OwnedFd;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};

/// Descriptors waiting beyond this many are closed by the caller itself.
const BACKLOG: usize = 4096;

#[derive(Clone, Debug)]
pub struct Reaper {
    tx: Option<SyncSender<OwnedFd>>,
}

impl Reaper {
    /// A reaper without a thread: descriptors are closed at once. For a store opened
    /// before the daemon forks (`CacheStore::start_workers`).
    pub fn inline() -> Reaper {
        Reaper { tx: None }
    }

    /// Starts the closing thread; it ends when the reaper is dropped. Without a thread
    /// (it could not start) descriptors are closed at once.
    pub fn start() -> Reaper {
        let (tx, rx) = sync_channel::<OwnedFd>(BACKLOG);
        let started = std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || {
                background_priority();
                rx.into_iter().for_each(drop)
            });
        Reaper {
            tx: started.is_ok().then_some(tx),
        }
    }

    /// Closes `fd`, the last reference to an unlinked cache file, soon.
    pub fn close_later(&self, fd: OwnedFd) {
        if let Some(tx) = &self.tx {
            match tx.try_send(fd) {
                Ok(()) => {}
                Err(TrySendError::Full(fd) | TrySendError::Disconnected(fd)) => drop(fd),
            }
        }
    }
}

/// Lowers the calling thread's priority to nice 19. The cache's housekeeping (freeing
/// removed files, removing entries) then takes the CPU left over by the requests, which
/// wait on it: `rm -rf` of 10,664 files took 0.3-0.6 s (about 10 %) less in five of five
/// pairs of runs on this 2-CPU machine. Its queues are bounded, and callers do the work
/// themselves past the bound, so it cannot fall behind without limit.
pub(super) fn background_priority() {
    let me = rustix::thread::gettid();
    if let Err(e) = rustix::process::setpriority_process(Some(me), 19) {
        tracing::debug!("cannot lower a housekeeping thread's priority: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::time::{Duration, Instant};

    #[test]
    fn an_unlinked_file_is_freed_by_the_reaper() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![1u8; 1 << 20]).unwrap();
        let fd: OwnedFd = std::fs::File::open(&path).unwrap().into();
        let ino = std::fs::metadata(&path).unwrap().ino();
        std::fs::remove_file(&path).unwrap();
        // Still held: the inode lives on, with its link count at 0.
        let held = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
        assert_eq!(std::fs::metadata(&held).unwrap().ino(), ino);
        let reaper = Reaper::start();
        reaper.close_later(fd);
        let start = Instant::now();
        while std::fs::metadata(&held).is_ok_and(|m| m.ino() == ino) {
            assert!(start.elapsed() < Duration::from_secs(10), "never closed");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

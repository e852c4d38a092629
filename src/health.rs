//! Source health: timeouts on source calls and the switch between connected and
//! disconnected operation (Coda's disconnected mode, xCachefs' DISCONNECTED ioctl).
//!
//! Every call to the source goes through [`GuardedSource`]. With a timeout configured, the
//! call runs on a small pool of source workers and the request waits at most that long: a
//! hung source (a stopped SSHFS server) then costs a stuck worker, never a stuck FUSE
//! request thread, and requests the cache can serve keep being served. A timeout, or an
//! error meaning "unreachable" confirmed by a probe of the source root, switches the mount
//! offline; a background probe switches it back when the source answers again. While
//! offline no call reaches the source: `fs.rs` serves what the cache holds and answers the
//! rest promptly (`EIO` for data and names it does not have, `EROFS` for changes).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::cache::source_info::SourceInfo;
use crate::source::{Capabilities, SourceTree};
use crate::threads::Threads;

mod calls;
mod open;

pub use open::{DEFAULT_REMOTE_TIMEOUT, OpenedSource, open_source, timeout_for};

/// Source workers when calls run with a timeout: as many hung calls as this can be
/// outstanding before new calls time out in the queue.
const WORKERS: usize = 16;
/// How often the probe checks an offline source (and an online one, for vanished mounts).
const PROBE_OFFLINE: Duration = Duration::from_secs(1);
const PROBE_ONLINE: Duration = Duration::from_secs(5);

/// The errno of calls refused because the mount is offline.
pub const OFFLINE: i32 = libc::EIO;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct HealthSnapshot {
    pub online: bool,
    /// Offline by `hoardfs offline` (the probe does not switch it back).
    pub manual: bool,
    /// Why and since when (seconds since the epoch) the mount is offline.
    pub reason: String,
    pub since: u64,
    /// Source call timeout in ms; 0: none (calls run on the request thread).
    pub timeout_ms: u64,
    pub went_offline: u64,
    pub went_online: u64,
    pub timeouts: u64,
    /// Source calls now running past their timeout.
    pub stuck_calls: u64,
    pub probes: u64,
    /// Requests answered from the cache, or refused, because the mount was offline.
    pub offline_requests: u64,
    /// Changes made offline and not yet replayed to the source (`--offline-writes=log`).
    pub log_pending: u64,
    /// Offline changes replayed to the source, and conflicts met doing it (both versions
    /// kept; see `<cache>/conflicts.log`).
    pub log_replayed: u64,
    pub conflicts: u64,
}

#[derive(Default)]
struct State {
    manual: bool,
    reason: String,
    since: Option<SystemTime>,
}

/// What runs after every switch, with the new state.
type SwitchHook = Box<dyn Fn(bool) + Send + Sync>;
/// What switches the mount online when the source answers (replaying offline changes
/// first); the argument says whether by hand.
type Reconnector = Box<dyn Fn(bool) -> Result<(), ReconnectError> + Send + Sync>;

/// Why the mount stays offline although the source answers (`hoardfs set online on` tells
/// it; the probe logs it and tries again).
#[derive(Debug, thiserror::Error)]
pub enum ReconnectError {
    #[error(
        "{0} file(s) written offline are still open: the offline changes are replayed once \
         they are closed"
    )]
    WritersOpen(u64),
    /// The source failed as if unreachable again: the rest of the log waits.
    #[error("replay of offline change {seq} stopped: {source}")]
    ReplayStopped {
        seq: u64,
        #[source]
        source: io::Error,
    },
    #[error("cannot record replay progress: {0}")]
    Progress(#[source] io::Error),
}

/// The mount's connection state.
pub struct Health {
    offline: AtomicBool,
    state: Mutex<State>,
    timeout_ms: AtomicU64,
    went_offline: AtomicU64,
    went_online: AtomicU64,
    timeouts: AtomicU64,
    stuck: AtomicUsize,
    probes: AtomicU64,
    pub offline_requests: AtomicU64,
    pub log_pending: AtomicU64,
    pub log_replayed: AtomicU64,
    pub conflicts: AtomicU64,
    /// Called with the new state after every switch (from the switching thread).
    on_switch: Mutex<Option<SwitchHook>>,
    reconnector: Mutex<Option<Arc<Reconnector>>>,
}

impl Health {
    pub fn new(timeout: Option<Duration>, start_offline: bool) -> Health {
        let h = Health {
            offline: AtomicBool::new(false),
            state: Mutex::default(),
            timeout_ms: AtomicU64::new(timeout.map_or(0, |t| t.as_millis().max(1) as u64)),
            went_offline: AtomicU64::new(0),
            went_online: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            stuck: AtomicUsize::new(0),
            probes: AtomicU64::new(0),
            offline_requests: AtomicU64::new(0),
            log_pending: AtomicU64::new(0),
            log_replayed: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
            on_switch: Mutex::new(None),
            reconnector: Mutex::new(None),
        };
        if start_offline {
            h.go_offline("started offline", true);
        }
        h
    }

    pub fn set_on_switch(&self, f: impl Fn(bool) + Send + Sync + 'static) {
        *self.on_switch.lock().unwrap() = Some(Box::new(f));
    }

    pub fn set_reconnector(
        &self,
        f: impl Fn(bool) -> Result<(), ReconnectError> + Send + Sync + 'static,
    ) {
        *self.reconnector.lock().unwrap() = Some(Arc::new(Box::new(f)));
    }

    /// The source answers: go (or stay) online through the reconnector, which replays
    /// offline changes first. The probe (`manual` false) does not undo a manual switch.
    pub fn reconnect(&self, manual: bool) -> Result<(), ReconnectError> {
        if !manual && self.state.lock().unwrap().manual {
            return Ok(());
        }
        let hook = self.reconnector.lock().unwrap().clone();
        match hook {
            Some(f) => f(manual),
            None => {
                self.go_online(manual);
                Ok(())
            }
        }
    }

    pub fn online(&self) -> bool {
        !self.offline.load(Relaxed)
    }

    pub fn timeout(&self) -> Option<Duration> {
        match self.timeout_ms.load(Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    pub fn set_timeout(&self, t: Option<Duration>) {
        self.timeout_ms
            .store(t.map_or(0, |t| t.as_millis().max(1) as u64), Relaxed);
    }

    /// Switches offline; `manual` pins the state until `go_online(true)`.
    pub fn go_offline(&self, reason: &str, manual: bool) {
        let mut st = self.state.lock().unwrap();
        st.manual |= manual;
        if self.offline.swap(true, Relaxed) {
            return;
        }
        st.reason = reason.to_string();
        st.since = Some(SystemTime::now());
        drop(st);
        self.went_offline.fetch_add(1, Relaxed);
        tracing::warn!("source offline: {reason}; serving what the cache holds");
        self.switched(false);
    }

    /// Switches online. The probe (`manual` false) does not undo a manual switch.
    pub fn go_online(&self, manual: bool) {
        let mut st = self.state.lock().unwrap();
        if st.manual && !manual {
            return;
        }
        st.manual = false;
        if !self.offline.swap(false, Relaxed) {
            return;
        }
        st.reason.clear();
        st.since = None;
        drop(st);
        self.went_online.fetch_add(1, Relaxed);
        tracing::info!("source online again");
        self.switched(true);
    }

    fn switched(&self, online: bool) {
        if let Some(f) = self.on_switch.lock().unwrap().as_ref() {
            f(online);
        }
    }

    pub fn snapshot(&self) -> HealthSnapshot {
        let st = self.state.lock().unwrap();
        HealthSnapshot {
            online: self.online(),
            manual: st.manual,
            reason: st.reason.clone(),
            since: st
                .since
                .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs()),
            timeout_ms: self.timeout_ms.load(Relaxed),
            went_offline: self.went_offline.load(Relaxed),
            went_online: self.went_online.load(Relaxed),
            timeouts: self.timeouts.load(Relaxed),
            stuck_calls: self.stuck.load(Relaxed) as u64,
            probes: self.probes.load(Relaxed),
            offline_requests: self.offline_requests.load(Relaxed),
            log_pending: self.log_pending.load(Relaxed),
            log_replayed: self.log_replayed.load(Relaxed),
            conflicts: self.conflicts.load(Relaxed),
        }
    }

    /// How long until the next probe.
    fn probe_interval(&self) -> Duration {
        if self.online() {
            PROBE_ONLINE
        } else {
            PROBE_OFFLINE
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// Set on source workers: a descriptor let go of there is closed in place (the worker
    /// is the guarded place; queueing the close for another worker and waiting for it
    /// could only wait for the pool).
    static ON_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The source, reached only through calls that honour the mount's health: refused while
/// offline, bounded by the timeout when one is set. Whatever its kind, every call takes
/// one path (`call`): the kind's own answers, including its errnos for what it cannot do,
/// come from its `SourceTree`.
pub struct GuardedSource {
    /// A trait object rather than an enum of the two kinds: the core never needs to know
    /// which it has (it asks `capabilities`), and a build without the `s3` feature simply
    /// has no object-store implementation.
    tree: Arc<dyn SourceTree>,
    caps: Capabilities,
    /// A network or FUSE file system, or an object store.
    remote: bool,
    pub health: Arc<Health>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    /// The source workers, started with the first timed call.
    workers: Threads,
}

impl GuardedSource {
    /// The source `tree`, described by `info`.
    pub fn new(tree: Arc<dyn SourceTree>, health: Arc<Health>, info: &SourceInfo) -> GuardedSource {
        GuardedSource {
            caps: tree.capabilities(),
            tree,
            remote: info.remote,
            health,
            jobs: Mutex::new(None),
            workers: Threads::new("source workers"),
        }
    }

    /// What the source can do (`source::Capabilities`), which the core asks instead of
    /// its kind.
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// Whether the source is reached over a network or FUSE (object stores too): calls
    /// mostly wait for round trips.
    pub fn is_remote(&self) -> bool {
        self.remote
    }

    fn submit(&self, job: Job) {
        let mut jobs = self.jobs.lock().unwrap();
        if self.workers.stop_signal().is_set() {
            return; // stopped: the caller's wait ends as for a lost call
        }
        let tx = jobs.get_or_insert_with(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            for i in 0..WORKERS {
                let rx = rx.clone();
                let _ = self.workers.spawn(format!("source-{i}"), move |_| {
                    ON_WORKER.set(true);
                    loop {
                        let job = match rx.lock().unwrap().recv() {
                            Ok(j) => j,
                            Err(_) => return,
                        };
                        job();
                    }
                });
            }
            tx
        });
        let _ = tx.send(job);
    }

    /// Stops the source workers at shutdown: the queue closes, the calls running end
    /// until `deadline`; workers stuck in a hung call are left behind.
    pub fn stop_workers(&self, deadline: std::time::Instant) {
        let jobs = self.jobs.lock().unwrap().take();
        self.workers.stop();
        drop(jobs);
        self.workers.stop_and_join(deadline);
    }

    /// Runs `f` against the source: inline without a timeout, else on a source worker,
    /// waiting at most the timeout. A call that times out before it started never runs.
    pub fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn SourceTree) -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        if !self.health.online() {
            self.health.offline_requests.fetch_add(1, Relaxed);
            // The call may own source descriptors: they close on a worker, not here.
            self.close_later(f);
            return Err(io::Error::from_raw_os_error(OFFLINE));
        }
        let r = self.call_anyway(f);
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }

    /// A call failed: if the error may mean the source is gone, ask the source itself at
    /// once, so that this very request can already be answered from the cache.
    fn failed(&self, e: &io::Error) {
        if crate::source::may_mean_unreachable(e)
            && self.health.online()
            && let Err(why) = self.probe()
        {
            self.health
                .go_offline(&format!("{e}; source probe: {why}"), false);
        }
    }

    /// Closes a source descriptor (or drops anything that owns some). A close on a network
    /// or FUSE source may wait for the server (FUSE sends FLUSH and releases locks, NFS
    /// writes back), so with a timeout it runs on a source worker and is timed like any
    /// call (one that takes too long switches the mount offline); offline it is not waited
    /// for at all. The close itself always happens, when the source lets it.
    pub fn close(&self, file: impl Send + 'static) {
        if self.health.timeout().is_none() || ON_WORKER.get() {
            drop(file);
        } else if !self.health.online() {
            self.close_later(file);
        } else {
            let _ = self.timed(move || {
                drop(file);
                Ok(())
            });
        }
    }

    /// Closes `file` on a source worker without waiting for it (inline without a timeout):
    /// for descriptors with nothing to write back, let go of under a file's lock.
    pub fn close_later(&self, file: impl Send + 'static) {
        if self.health.timeout().is_none() || ON_WORKER.get() {
            drop(file);
        } else {
            self.submit(Box::new(move || drop(file)));
        }
    }

    /// Like `call`, even while offline (the probe, replaying offline changes).
    pub fn call_anyway<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn SourceTree) -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        let tree = self.tree.clone();
        self.timed(move || f(&*tree))
    }

    /// Runs `f` under the timeout (on a source worker), or inline without one.
    fn timed<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        let Some(timeout) = self.health.timeout() else {
            return f();
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let abandoned = Arc::new(AtomicBool::new(false));
        let (health, gone) = (self.health.clone(), abandoned.clone());
        self.submit(Box::new(move || {
            if gone.load(Relaxed) {
                return; // timed out in the queue: never started, never will
            }
            let r = f();
            if gone.load(Relaxed) {
                health.stuck.fetch_sub(1, Relaxed);
            }
            let _ = tx.send(r);
        }));
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(_) => {
                if !abandoned.swap(true, Relaxed) {
                    self.health.stuck.fetch_add(1, Relaxed);
                }
                self.health.timeouts.fetch_add(1, Relaxed);
                self.health
                    .go_offline(&format!("a source call took over {timeout:?}"), false);
                Err(io::Error::from_raw_os_error(libc::ETIMEDOUT))
            }
        }
    }

    /// Checks that the source answers (`SourceTree::probe`), under the timeout.
    fn probe(&self) -> io::Result<()> {
        self.health.probes.fetch_add(1, Relaxed);
        self.call_anyway(|t| t.probe())
    }
}

/// A source descriptor that is closed through the guard when dropped
/// ([`GuardedSource::close`]): a close may wait for the source, so it never runs on the
/// thread that lets go of the descriptor, which may be a request thread holding a lock.
pub struct SourceFile {
    file: Option<std::fs::File>,
    source: Arc<GuardedSource>,
}

impl SourceFile {
    pub fn new(source: Arc<GuardedSource>, file: std::fs::File) -> SourceFile {
        SourceFile {
            file: Some(file),
            source,
        }
    }
}

impl std::ops::Deref for SourceFile {
    type Target = std::fs::File;

    fn deref(&self) -> &std::fs::File {
        self.file.as_ref().expect("open until dropped")
    }
}

impl std::fmt::Debug for SourceFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SourceFile").field(&self.file).finish()
    }
}

impl Drop for SourceFile {
    fn drop(&mut self) {
        if let Some(file) = self.file.take() {
            self.source.close(file);
        }
    }
}

/// Starts the probe thread, in the returned group: offline mounts come back when the
/// source answers; online ones go offline when it does not (or its path now leads
/// elsewhere).
pub fn spawn_probe(src: Arc<GuardedSource>) -> io::Result<Threads> {
    let threads = Threads::new("source probe");
    threads.spawn("source-probe", move |stop| {
        while stop.sleep(src.health.probe_interval()) {
            match src.probe() {
                Ok(()) => {
                    if let Err(e) = src.health.reconnect(false) {
                        tracing::debug!("staying offline: {e}");
                    }
                }
                Err(e) => {
                    if src.health.online() {
                        src.health
                            .go_offline(&format!("source probe failed: {e}"), false);
                    }
                }
            }
        }
    })?;
    Ok(threads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{BeneathRoot, PosixTree};
    use std::path::Path;
    use std::sync::Condvar;

    #[test]
    fn manual_offline_sticks_until_manual_online() {
        let h = Health::new(None, false);
        assert!(h.online());
        h.go_offline("test", true);
        h.go_online(false);
        assert!(!h.online(), "the probe must not undo a manual switch");
        h.go_online(true);
        assert!(h.online());
        let s = h.snapshot();
        assert_eq!((s.went_offline, s.went_online), (1, 1));
    }

    #[test]
    fn a_hung_call_times_out_and_switches_offline() {
        let (_dir, h, src) = guarded(Duration::from_millis(50));
        let release = Arc::new((Mutex::new(false), Condvar::new()));
        let r2 = release.clone();
        let err = src
            .call(move |_| {
                let (m, cv) = &*r2;
                let mut go = m.lock().unwrap();
                while !*go {
                    go = cv.wait(go).unwrap();
                }
                Ok(())
            })
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ETIMEDOUT));
        assert!(!h.online());
        assert_eq!(h.snapshot().stuck_calls, 1);
        // Offline: refused at once, without touching the source.
        let e = src.call(|r| r.stat(Path::new(""))).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(OFFLINE));
        let (m, cv) = &*release;
        *m.lock().unwrap() = true;
        cv.notify_all();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(h.snapshot().stuck_calls, 0);
        h.go_online(false);
        assert!(src.call(|r| r.stat(Path::new(""))).is_ok());
    }

    fn guarded(timeout: Duration) -> (tempfile::TempDir, Arc<Health>, GuardedSource) {
        let dir = tempfile::tempdir().unwrap();
        let h = Arc::new(Health::new(Some(timeout), false));
        let root = BeneathRoot::open(dir.path()).unwrap();
        let info = SourceInfo::of(root.root_fd()).unwrap();
        let tree = PosixTree::new(
            Some(root),
            dir.path(),
            (info.root_dev, info.root_ino),
            info.fs_type,
            info.remote,
        );
        let src = GuardedSource::new(Arc::new(tree), h.clone(), &info);
        (dir, h, src)
    }

    /// Sends the name of the thread it is dropped on, as a source descriptor would be
    /// closed there.
    struct DroppedOn(mpsc::Sender<Option<String>>);

    impl Drop for DroppedOn {
        fn drop(&mut self) {
            let _ = (self.0).send(std::thread::current().name().map(String::from));
        }
    }

    #[test]
    fn what_a_refused_call_owns_is_let_go_of_on_a_worker() {
        let (_dir, h, src) = guarded(Duration::from_secs(5));
        h.go_offline("test", true);
        let (tx, rx) = mpsc::channel();
        let owned = DroppedOn(tx);
        let err = src
            .call(move |_| {
                let _ = &owned;
                Ok(())
            })
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(OFFLINE));
        let on = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(
            on.as_deref().is_some_and(|n| n.starts_with("source-")),
            "{on:?}"
        );
    }

    #[test]
    fn a_close_the_source_does_not_answer_switches_offline() {
        let (_dir, h, src) = guarded(Duration::from_millis(50));
        let release = Arc::new((Mutex::new(false), Condvar::new()));
        struct HungClose(Arc<(Mutex<bool>, Condvar)>);
        impl Drop for HungClose {
            fn drop(&mut self) {
                let (m, cv) = &*self.0;
                let mut go = m.lock().unwrap();
                while !*go {
                    go = cv.wait(go).unwrap();
                }
            }
        }
        src.close(HungClose(release.clone()));
        assert!(!h.online());
        assert_eq!(h.snapshot().timeouts, 1);
        // Offline, a close is not waited for at all.
        let (tx, rx) = mpsc::channel();
        let (src, again) = (Arc::new(src), release.clone());
        std::thread::spawn(move || {
            src.close(HungClose(again));
            let _ = tx.send(());
        });
        let returned = rx.recv_timeout(Duration::from_secs(10)).is_ok();
        let (m, cv) = &*release;
        *m.lock().unwrap() = true;
        cv.notify_all();
        assert!(returned, "an offline close waited for the source");
    }
}

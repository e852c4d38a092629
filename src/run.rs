//! Wiring: validates the configuration, daemonizes, mounts, and serves until unmounted.
//!
//! Shutdown. Every long-lived thread belongs to a [`Threads`] group of the component that
//! started it. Once the session ends (unmounted, or the connection aborted), the groups
//! stop in this order, each joined until a shared deadline (`STOP_WITHIN` after the
//! session's end; a later step gets at least `STEP_AT_LEAST`), so that the daemon exits
//! within about 1.5 s of an unmount even with threads stuck in a hung source:
//!
//! 1. requests: the lock waiter pool (its waiters' connection is gone), the control
//!    socket (no more `hoardfs` commands), the metrics endpoint;
//! 2. background work: signals, invalidation and sd-status (this module), the watcher,
//!    leases and relisting, the cleaner, the source probe;
//! 3. the fetch workers: the queue closes, each ends after its job in progress, so that
//!    what they fetched is in the commit that follows;
//! 4. the group commit drains: closed files' fills and writes on disk, records clean;
//! 5. the source workers: last, as every step above may still call the source.
//!
//! A thread not done by then is detached with a warning naming it, and the process exits
//! without it: a hung source call ends with the process. A commit cut short leaves the
//! records as a crash would (crash rules: they claim no more than is on disk).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::Context;
use fuser::{MountOption, Session, SessionACL};

use crate::cache::CacheStore;
use crate::coherence::Notice;
use crate::config::Config;
use crate::fs::CachingFs;
use crate::fuse_adapter::FuseAdapter;
use crate::threads::Threads;

/// How often the inode table frees aged entries and checks its soft maximum.
const TABLE_TICK: Duration = Duration::from_millis(200);
/// How long after the session's end the shutdown's joins may take in all (see the module
/// header), and the least each step gets however long those before it took.
const STOP_WITHIN: Duration = Duration::from_millis(1200);
const STEP_AT_LEAST: Duration = Duration::from_millis(100);

/// Mounts and serves. Without `foreground`, returns in the parent once the mount is ready
/// (exit status tells whether it is), while a detached child serves it.
pub fn mount(cfg: Config) -> anyhow::Result<()> {
    take_over_mountpoint(&cfg.mountpoint)?;
    let cfg = cfg.validate()?;
    // Everything that can fail for a bad invocation fails here, on the user's terminal.
    let store = CacheStore::open(&cfg.cache_dir)?;
    // Modes from the kernel are already masked by the caller's umask.
    rustix::process::umask(rustix::fs::Mode::empty());
    // Descriptors: open files' cache and source files, and callbacks' `O_PATH` ones
    // (`coherence::Callback`, capped by what this limit allows).
    raise_open_files_limit();

    let mut ready = if cfg.foreground {
        None
    } else {
        Some(daemonize()?)
    };
    // Its threads start in the process that serves: they would not survive the fork.
    let mut store = store;
    store.start_workers();
    let result = serve(cfg.clone(), store, &mut ready);
    if let (Err(e), Some(ready)) = (&result, ready) {
        let _ = write!(std::fs::File::from(ready), "{e:#}");
    }
    result
}

/// Raises the soft limit of open descriptors to the hard one, as file servers do: the
/// default soft limit (1,024) would otherwise cap how many files the mount serves at once.
fn raise_open_files_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::debug!("cannot raise the open files limit: {e}");
        }
    }
}

/// One hoardfs mount per mount point: a mount point that holds one whose daemon answers is
/// refused; one whose daemon is dead or hung (killed -9 while stuck in the kernel, stopped)
/// is cleared (its FUSE connection aborted, the mount detached) so that mounting again
/// needs no hand.
fn take_over_mountpoint(mountpoint: &std::path::Path) -> anyhow::Result<()> {
    match clear_dead_mount(mountpoint)? {
        MountPoint::Answers { mountpoint, source } => anyhow::bail!(
            "{} is already a hoardfs mount (of {source}) and its daemon answers: unmount it first",
            mountpoint.display(),
        ),
        MountPoint::Free | MountPoint::Cleared => Ok(()),
    }
}

/// What `clear_dead_mount` found at a mount point.
#[derive(Debug, PartialEq, Eq)]
pub enum MountPoint {
    /// No hoardfs mount there.
    Free,
    /// A hoardfs mount whose daemon answers its control socket: left as it is.
    Answers {
        mountpoint: std::path::PathBuf,
        source: String,
    },
    /// A hoardfs mount whose daemon was dead or hung: its connection aborted, detached.
    Cleared,
}

/// Clears the hoardfs mount at `mountpoint` if its daemon is dead or hung (what a new mount
/// there does first, and `hoardfs abort` after a systemd stop). Read from mountinfo, never
/// by a stat through the old mount (it would hang or fail with ENOTCONN).
pub fn clear_dead_mount(mountpoint: &std::path::Path) -> anyhow::Result<MountPoint> {
    let Ok(abs) = crate::mounts::lexical_absolute(mountpoint) else {
        return Ok(MountPoint::Free);
    };
    let Some(old) = crate::mounts::mount_at(&abs) else {
        return Ok(MountPoint::Free);
    };
    match crate::control::probe(&old, Duration::from_secs(2)) {
        crate::control::Liveness::Answers(_) => Ok(MountPoint::Answers {
            mountpoint: abs,
            source: old.source,
        }),
        state => {
            tracing::warn!(
                mountpoint = %abs.display(),
                connection = old.connection,
                "the hoardfs mount there does not answer ({state:?}): aborting its FUSE \
                 connection and detaching it"
            );
            crate::mounts::clear(&old)?;
            Ok(MountPoint::Cleared)
        }
    }
}

/// Forks; the parent waits for the child's word on a pipe and exits with it.
fn daemonize() -> anyhow::Result<OwnedFd> {
    let (rd, wr) = rustix::pipe::pipe().context("pipe")?;
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()).context("fork"),
        0 => {
            drop(rd);
            let _ = rustix::process::setsid();
            Ok(wr)
        }
        _ => {
            drop(wr);
            let mut msg = String::new();
            let _ = std::fs::File::from(rd).read_to_string(&mut msg);
            if msg == "ready" {
                std::process::exit(0);
            }
            if msg.is_empty() {
                msg = "the mount process died before the mount was ready".into();
            }
            eprintln!("hoardfs: {msg}");
            std::process::exit(1);
        }
    }
}

/// `ready` is taken (written and closed) once the mount answers; the parent waits for EOF.
fn serve(cfg: Config, store: CacheStore, ready: &mut Option<OwnedFd>) -> anyhow::Result<()> {
    let metrics = cfg.metrics_addr.map(crate::metrics::bind).transpose()?;
    // `None` ends the invalidation thread's wait at shutdown.
    let (inval_tx, inval_rx) = mpsc::channel::<Option<Notice>>();
    let inval_wake = inval_tx.clone();
    let inval_tx = Mutex::new(inval_tx);
    let source = crate::health::open_source(&cfg, &store)?;
    let mut fs = CachingFs::new(cfg.clone(), store, source)?;
    fs.set_notifier(move |n| {
        let _ = inval_tx.lock().unwrap().send(Some(n));
    });
    let fs = Arc::new(fs);

    let acl = if cfg.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    let mut fuse_cfg = fuser::Config::default();
    fuse_cfg.acl = acl;
    fuse_cfg.n_threads = Some(cfg.threads);
    fuse_cfg.clone_fd = true;
    fuse_cfg.io_uring_threads = cfg.fuse_ring.then_some(cfg.threads);
    let adapter = FuseAdapter { fs: fs.clone() };
    let (session, unmount): (Session<FuseAdapter>, Box<dyn FnMut() + Send>) =
        if rustix::process::geteuid().is_root() {
            // As root we mount ourselves, so that the type reads "fuse.hoardfs" (fuser's
            // own mount call always says "fuse"), as mount(8), fstab and xfstests expect.
            let fd = mount_as_root(&cfg)?;
            let session = Session::from_fd(adapter, fd, acl, fuse_cfg).with_context(|| {
                format!("FUSE handshake on {} failed", cfg.mountpoint.display())
            })?;
            let mp = cfg.mountpoint.clone();
            let unmount = move || {
                if let Err(e) = rustix::mount::unmount(&mp, rustix::mount::UnmountFlags::DETACH) {
                    tracing::warn!("unmount failed: {e}");
                }
            };
            (session, Box::new(unmount))
        } else {
            let mut options = vec![
                MountOption::FSName(cfg.source.display().to_string()),
                MountOption::Subtype("hoardfs".into()),
                MountOption::DefaultPermissions,
            ];
            if cfg.read_only {
                options.push(MountOption::RO);
            }
            fuse_cfg.mount_options = options;
            let mut session = Session::new(adapter, &cfg.mountpoint, &fuse_cfg)
                .with_context(|| format!("cannot mount on {}", cfg.mountpoint.display()))?;
            let mut unmounter = session.unmount_callable();
            let unmount = move || {
                if let Err(e) = unmounter.unmount() {
                    tracing::warn!("unmount failed: {e}");
                }
            };
            (session, Box::new(unmount))
        };

    // Where the kernel's requests come from (README, "FUSE over io_uring").
    let transport = if session.uses_io_uring() {
        "io_uring"
    } else {
        "/dev/fuse"
    };

    // Kernel invalidations run on their own thread: a notification sent from a request
    // handler can deadlock against the kernel waiting for that very request. The same
    // thread runs the inode table's periodic work (freeing aged entries; over the soft
    // maximum, asking the kernel to drop cold dentries so that it forgets their inodes).
    // From here on the mount exists: any failure before serving must take it down again,
    // or a dead mount (ENOTCONN) would be left behind.
    let unmount = Arc::new(Mutex::new(unmount));
    let mut unmount_on_error = UnmountOnError(Some(unmount.clone()));

    let daemon = Threads::new("daemon");
    daemon.on_stop(move || drop(inval_wake.send(None)));
    // On a descriptor table of its own (`kernel_notify.rs`): a `kill -9` must not leave
    // the daemon stuck in an invalidation that waits for a request it will never answer.
    let notifier = crate::kernel_notify::KernelNotifier::start(std::os::fd::AsFd::as_fd(&session))
        .context("cannot start the kernel notification thread")?;
    // Opens drop a node's attributes themselves, before their reply (`AttrDropper`).
    let dropper = crate::kernel_notify::AttrDropper::new(std::os::fd::AsFd::as_fd(&session))
        .context("cannot clone the FUSE device")?;
    fs.coherence.set_attr_dropper(dropper);
    let table_fs = Arc::downgrade(&fs);
    daemon.spawn("invalidate", move |stop| {
        let mut next_tick = Instant::now();
        while !stop.is_set() {
            match inval_rx.recv_timeout(next_tick.saturating_duration_since(Instant::now())) {
                Ok(Some(Notice::Inode(id))) => {
                    let fs = table_fs.upgrade();
                    let inode = fs.as_ref().and_then(|fs| fs.inodes.get(id));
                    let version = inode.as_ref().map(|i| i.content_version());
                    // Not the pages while writes through them may be under way: the last
                    // such writer's release sends this again (`Inode::page_cache_writers`).
                    // Nor pages that hold the mount's own writes, under kernel opens
                    // (`pages_follow_own_writes`).
                    let own_pages = (fs.as_ref().zip(inode.as_ref()))
                        .is_some_and(|(fs, i)| fs.pages_follow_own_writes(i));
                    drop(fs);
                    let pages =
                        !own_pages && inode.as_ref().is_none_or(|i| i.begin_page_invalidation());
                    let sent = if pages {
                        notifier.inval_inode(id)
                    } else {
                        notifier.inval_attrs(id)
                    };
                    if let Some(i) = inode.as_ref().filter(|_| pages) {
                        i.end_page_invalidation();
                    }
                    match sent {
                        // (ENOENT: the kernel has no such node, so no pages of it.)
                        Err(e) if e.raw_os_error() != Some(libc::ENOENT) => {
                            tracing::debug!("inval_inode({id}): {e}");
                        }
                        _ => {
                            if let (Some(inode), Some(v), true) = (inode, version, pages) {
                                inode.pages_dropped(v);
                            }
                        }
                    }
                }
                Ok(Some(Notice::Entry(parent, name))) => {
                    tracing::trace!("inval_entry({parent}, {name:?})");
                    if let Err(e) = notifier.inval_entry(parent, &name) {
                        tracing::debug!("inval_entry({parent}, {name:?}): {e}");
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            if Instant::now() < next_tick {
                continue;
            }
            next_tick = Instant::now() + TABLE_TICK;
            let Some(fs) = table_fs.upgrade() else { return };
            if let Some(w) = &fs.coherence.watcher {
                w.prune(|id| fs.inodes.get(id).is_some());
            }
            for (parent, name) in fs.inodes.maintain() {
                if let Err(e) = notifier.inval_entry(parent, &name) {
                    tracing::debug!("inval_entry({parent}, {name:?}): {e}");
                }
            }
        }
    })?;

    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGTERM])?;
    let signals_handle = signals.handle();
    daemon.on_stop(move || signals_handle.close());
    daemon.spawn("signals", move |_| {
        if let Some(sig) = signals.forever().next() {
            tracing::info!("signal {sig}: unmounting");
            crate::sd_notify::notify("STOPPING=1");
            (unmount.lock().unwrap())();
        }
    })?;

    fs.usage.chunked_above.store(
        cfg.whole_file_threshold,
        std::sync::atomic::Ordering::Relaxed,
    );
    fs.usage.set_limits(Some(CachingFs::initial_limits(&cfg)?));
    let cleaner = crate::cleaner::spawn(
        fs.cache.trees(),
        fs.pins.clone(),
        fs.usage.clone(),
        fs.clone(),
        std::time::Duration::from_secs(300),
    )?;
    fs.watch_root();
    let probe = fs.spawn_health_probe()?;
    let coherence = crate::fs::spawn_coherence_threads(&fs)?;
    let fetch_workers = crate::fs::spawn_fetch_workers(&fs)?;
    crate::fs::spawn_committer(&fs)?;
    let socket = crate::control::serve(&cfg.mountpoint, fs.clone())?;
    let metrics = match metrics {
        Some(listener) => Some(crate::metrics::serve(listener, fs.clone())?.1),
        None => None,
    };

    if let Some(ready) = ready.take() {
        redirect_stdio(fs.cache.open_log()?)?;
        std::fs::File::from(ready).write_all(b"ready")?;
    }
    tracing::info!(source = %cfg.source.display(), mountpoint = %cfg.mountpoint.display(), cache = %cfg.cache_dir.display(), transport, "mounted");
    notify_systemd(&fs, &daemon)?;
    unmount_on_error.0 = None;
    let r = session.run();
    crate::sd_notify::notify("STOPPING=1");
    let ended = Instant::now();
    let deadline = || (ended + STOP_WITHIN).max(Instant::now() + STEP_AT_LEAST);
    let done = |step: &str| tracing::debug!(step, since_end = ?ended.elapsed(), "stopped");
    // 1. Requests.
    fs.stop_lock_waits(deadline());
    fs.stop_waiting_opens(deadline());
    socket.stop(deadline());
    if let Some(m) = &metrics {
        m.stop_and_join(deadline());
    }
    done("requests");
    // 2. Background work: all told first, so that their ends overlap.
    let background = [&daemon, &coherence, &cleaner, &probe];
    background.iter().for_each(|t| t.stop());
    let step = deadline();
    for t in background {
        t.stop_and_join(step);
    }
    done("background");
    // 3. Fetch workers.
    fetch_workers.stop_and_join(deadline());
    done("fetch workers");
    // 4. Closed files' fills and writes still waiting for the group commit: on disk now,
    // so that the cache after a clean stop has clean records; on a thread, so that a
    // commit stuck behind a stuck fetch cannot hold the exit.
    let drain = Threads::new("commit drain");
    let commit_fs = fs.clone();
    drain.spawn("commit-drain", move |_| commit_fs.stop_commits())?;
    drain.stop_and_join(deadline());
    done("group commit");
    // 5. Source workers.
    fs.stop_source_workers(deadline());
    done("source workers");
    r.context("FUSE session failed")?;
    tracing::info!("unmounted");
    Ok(())
}

/// Unmounts on drop unless disarmed: the error paths between mounting and serving.
struct UnmountOnError(Option<SharedUnmount>);

/// The unmount action, shared by the signal thread and the start-up error path.
type SharedUnmount = Arc<Mutex<Box<dyn FnMut() + Send>>>;

impl Drop for UnmountOnError {
    fn drop(&mut self) {
        if let Some(u) = self.0.take() {
            tracing::warn!("setting up the mount failed: unmounting");
            (u.lock().unwrap())();
        }
    }
}

/// Tells a service manager (`Type=notify`) that the mount answers, and keeps its status
/// line current. MAINPID names the process serving the mount, which is not the one systemd
/// started when we daemonized (that needs `NotifyAccess=all`; the unit runs `-f`).
fn notify_systemd(fs: &Arc<CachingFs>, daemon: &Threads) -> anyhow::Result<()> {
    if !crate::sd_notify::enabled() {
        return Ok(());
    }
    let status = crate::sd_notify::status_line(&fs.snapshot());
    crate::sd_notify::notify(&format!(
        "READY=1\nMAINPID={}\nSTATUS={status}",
        std::process::id()
    ));
    let fs = Arc::downgrade(fs);
    daemon.spawn("sd-status", move |stop| {
        while stop.sleep(crate::sd_notify::STATUS_INTERVAL) {
            let Some(fs) = fs.upgrade() else { return };
            let status = crate::sd_notify::status_line(&fs.snapshot());
            crate::sd_notify::notify(&format!("STATUS={status}"));
        }
    })?;
    Ok(())
}

/// Opens /dev/fuse and mounts it as `fuse.hoardfs` with the source as the device name.
fn mount_as_root(cfg: &Config) -> anyhow::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    use rustix::mount::MountFlags;
    let fd = rustix::fs::open("/dev/fuse", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
        .context("cannot open /dev/fuse (is the fuse module loaded?)")?;
    let root_mode = rustix::fs::stat(&cfg.mountpoint)?.st_mode & libc::S_IFMT;
    let mut data = format!(
        "fd={},rootmode={:o},user_id=0,group_id=0,default_permissions",
        fd.as_raw_fd(),
        root_mode
    );
    if cfg.allow_other {
        data.push_str(",allow_other");
    }
    let mut flags = MountFlags::NOSUID | MountFlags::NODEV;
    if cfg.read_only {
        flags |= MountFlags::RDONLY;
    }
    rustix::mount::mount(
        cfg.source.as_os_str(),
        &cfg.mountpoint,
        "fuse.hoardfs",
        flags,
        Some(std::ffi::CString::new(data)?.as_c_str()),
    )
    .with_context(|| format!("cannot mount on {}", cfg.mountpoint.display()))?;
    Ok(fd)
}

/// A daemon's output goes to `CACHE_DIR/hoardfs.log` (`log`, see `CacheStore::open_log`).
fn redirect_stdio(log: std::fs::File) -> anyhow::Result<()> {
    let null = std::fs::File::open("/dev/null")?;
    unsafe {
        libc::dup2(null.as_raw_fd(), 0);
        libc::dup2(log.as_raw_fd(), 1);
        libc::dup2(log.as_raw_fd(), 2);
    }
    Ok(())
}

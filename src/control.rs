//! The control socket: how `hoardfs stats MOUNTPOINT` and `hoardfs set MOUNTPOINT KEY=VALUE`
//! reach a running daemon. One Unix socket per mount in the runtime directory, named by a hash of
//! the mount point (socket paths are limited to 108 bytes). Requests are one line of text,
//! answers one line of JSON; the daemon serves them on its own thread.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::health::ReconnectError;
use crate::mounts::HoardfsMount;
use crate::options::Live;
use crate::stats::Snapshot;
use crate::threads::Threads;

/// The socket directory of this process's user: root's is shared by root's mounts,
/// readable by all (anyone may read counters) and writable by root alone; a user's is in
/// their runtime directory.
pub fn runtime_dir() -> PathBuf {
    let euid = rustix::process::geteuid().as_raw();
    if euid == 0 {
        PathBuf::from("/run/hoardfs")
    } else if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        PathBuf::from(d).join("hoardfs")
    } else {
        PathBuf::from(format!("/tmp/hoardfs-{euid}"))
    }
}

/// Where the daemon of a mount owned by `owner` keeps its socket, as seen by this process.
fn runtime_dirs_of(owner: u32) -> Vec<PathBuf> {
    if owner == rustix::process::geteuid().as_raw() {
        vec![runtime_dir()]
    } else if owner == 0 {
        vec![PathBuf::from("/run/hoardfs")]
    } else {
        vec![
            PathBuf::from(format!("/run/user/{owner}/hoardfs")),
            PathBuf::from(format!("/tmp/hoardfs-{owner}")),
        ]
    }
}

/// The socket's name: a 64-bit FNV-1a hash of the mount point and its length (socket paths
/// are limited to 108 bytes). A daemon refuses to take over a name another daemon answers
/// on, and `stats` checks the mount point in the answer.
fn socket_name(mountpoint: &Path) -> String {
    let bytes = mountpoint.as_os_str().as_encoded_bytes();
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016x}-{}.sock", bytes.len())
}

/// The socket path of this process's own mount at `mountpoint`.
pub fn socket_path(mountpoint: &Path) -> PathBuf {
    runtime_dir().join(socket_name(mountpoint))
}

/// Creates the socket directory, or checks the one there: a directory (not a link) owned by
/// us and writable by no one else, so that no other user can remove or replace a socket in
/// it. Ours with a looser mode (earlier versions made `/run/hoardfs` 0777) is tightened.
fn prepare_runtime_dir(dir: &Path) -> anyhow::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let euid = rustix::process::geteuid();
    let mode = Mode::from_raw_mode(if euid.is_root() { 0o755 } else { 0o700 });
    match rustix::fs::mkdir(dir, mode) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(e).with_context(|| format!("cannot create {}", dir.display())),
    }
    let fd = rustix::fs::open(
        dir,
        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("{}: not a directory of ours (a link?)", dir.display()))?;
    let st = rustix::fs::fstat(&fd)?;
    if st.st_uid != euid.as_raw() {
        bail!(
            "{} belongs to uid {}, not to this daemon's uid {}: remove it, or set \
             XDG_RUNTIME_DIR to a directory of your own",
            dir.display(),
            st.st_uid,
            euid.as_raw()
        );
    }
    if st.st_mode & 0o7777 != mode.as_raw_mode() {
        rustix::fs::fchmod(&fd, mode).with_context(|| format!("cannot chmod {}", dir.display()))?;
    }
    Ok(())
}

/// Who is on the other end of a control connection.
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    pub uid: u32,
}

/// Why a control request was refused or failed; the client (`hoardfs set`, `hoardfs pin`,
/// ...) prints its text.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(
        "permission denied: only root or the mount's owner (uid {owner}) may {verb}; uid {uid} \
         may read counters (stats)"
    )]
    PermissionDenied { verb: String, owner: u32, uid: u32 },
    #[error("unknown request {0:?}")]
    UnknownRequest(String),
    #[error("usage: set KEY VALUE")]
    SetUsage,
    #[error("clean: invalid size {0:?}")]
    CleanSize(String),
    /// A setting or value refused, in the words of its parser (the option table, the log
    /// filter) or of the mount.
    #[error("{0}")]
    Invalid(String),
    /// A cache limit set before the mount computed its limits.
    #[error("the cache has no limits yet")]
    NoCacheLimits,
    /// `auto` for a cache limit, whose default could not be computed.
    #[error("cannot compute the default: {0}")]
    NoDefault(#[source] anyhow::Error),
    /// `online on`, while the mount cannot go online yet.
    #[error(transparent)]
    Reconnect(#[from] ReconnectError),
    #[error("{}: not a path inside the mount", .0.display())]
    NotInMount(PathBuf),
    /// A pin of a path the source cannot stat (missing, or the source failing).
    #[error("{}: {source}", path.display())]
    Stat {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot save pins: {0}")]
    SavePins(#[source] std::io::Error),
}

/// What the daemon does for control requests.
pub trait Handler: Send + Sync + 'static {
    fn stats(&self) -> Snapshot;
    /// `set KEY VALUE`: change a setting (parsed by the option table; never `Live::Log`,
    /// which the control socket applies to the process).
    fn set(&self, setting: Live) -> Result<(), ControlError>;
    /// `clean [BYTES]`: evict now; answers the bytes freed.
    fn clean(&self, to: Option<u64>) -> u64;
    /// `pin REL` / `unpin REL` (REL relative to the mount point, may hold spaces).
    fn pin(&self, rel: &Path, on: bool) -> Result<(), ControlError>;
}

/// Answers one request. Counters are for anyone who can reach the socket; every request
/// that changes the mount or names a path in it is for root and the mount's owner alone
/// (a name test such as `pin secret/x` would otherwise tell other users what a 0700
/// directory holds).
fn answer(handler: &dyn Handler, line: &str, peer: Peer, owner: u32) -> String {
    let ok = |r: Result<(), ControlError>| match r {
        Ok(()) => serde_json::json!({ "ok": true }).to_string(),
        Err(e) => serde_json::json!({ "error": e.to_string() }).to_string(),
    };
    let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
    if verb != "stats" && peer.uid != 0 && peer.uid != owner {
        return ok(Err(ControlError::PermissionDenied {
            verb: verb.to_string(),
            owner,
            uid: peer.uid,
        }));
    }
    match verb {
        "stats" => serde_json::to_string(&handler.stats()).unwrap_or_default(),
        "set" => {
            let mut words = rest.split_whitespace();
            ok(match (words.next(), words.next(), words.next()) {
                (Some(k), Some(v), None) => match crate::options::parse_live(k, v) {
                    // The log filter belongs to the process, not to the file system.
                    Ok(Live::Log(spec)) => crate::logging::set_filter(
                        spec.as_deref().unwrap_or(&crate::logging::initial_filter()),
                    )
                    .map_err(ControlError::Invalid),
                    Ok(setting) => handler.set(setting),
                    Err(e) => Err(ControlError::Invalid(e)),
                },
                _ => Err(ControlError::SetUsage),
            })
        }
        "clean" => match rest.trim() {
            "" => serde_json::json!({ "freed": handler.clean(None) }).to_string(),
            n => match n.parse::<u64>() {
                Ok(n) => serde_json::json!({ "freed": handler.clean(Some(n)) }).to_string(),
                Err(_) => ok(Err(ControlError::CleanSize(n.to_string()))),
            },
        },
        "pin" | "unpin" if !rest.is_empty() => ok(handler.pin(Path::new(rest), verb == "pin")),
        _ => ok(Err(ControlError::UnknownRequest(line.to_string()))),
    }
}

/// The uid on the other end of a Unix socket (`SO_PEERCRED`, set by the kernel at connect).
fn peer_uid(conn: &UnixStream) -> std::io::Result<u32> {
    Ok(rustix::net::sockopt::socket_peercred(conn.as_fd())?
        .uid
        .as_raw())
}

/// What is behind a control socket.
#[derive(Debug, PartialEq, Eq)]
pub enum Liveness {
    /// A daemon answered `stats`, for this mount point.
    Answers(String),
    /// Something accepted the connection but did not answer in time: a hung daemon, or one
    /// killed while stuck in the kernel (its socket outlives its threads).
    Silent,
    /// Nothing listens (no socket, or a dead daemon's).
    Absent,
}

fn probe_socket(path: &Path, wait: Duration) -> Liveness {
    let Ok(mut conn) = UnixStream::connect(path) else {
        return Liveness::Absent;
    };
    let _ = conn.set_read_timeout(Some(wait));
    let _ = conn.set_write_timeout(Some(wait));
    if writeln!(conn, "stats").is_err() {
        return Liveness::Silent;
    }
    let mut line = String::new();
    match BufReader::new(&conn).read_line(&mut line) {
        Ok(n) if n > 0 => Liveness::Answers(
            serde_json::from_str::<Snapshot>(&line)
                .map(|s| s.mountpoint)
                .unwrap_or_default(),
        ),
        _ => Liveness::Silent,
    }
}

/// Whether the daemon of `mount` answers within `wait`.
pub fn probe(mount: &HoardfsMount, wait: Duration) -> Liveness {
    let name = socket_name(&mount.mountpoint);
    for dir in runtime_dirs_of(mount.owner) {
        match probe_socket(&dir.join(&name), wait) {
            Liveness::Absent => continue,
            l => return l,
        }
    }
    Liveness::Absent
}

/// Removes the sockets of daemons that died without removing them (kill -9, OOM): a
/// socket nobody listens on refuses connections (`ECONNREFUSED`), and a name is bound and
/// listened on in one step, so such a socket never comes back to life.
fn remove_dead_sockets(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().is_some_and(|x| x == "sock")
            && e.file_type()
                .is_ok_and(|t| std::os::unix::fs::FileTypeExt::is_socket(&t))
            && UnixStream::connect(&path)
                .is_err_and(|err| err.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            tracing::debug!(path = %path.display(), "removing a dead daemon's control socket");
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// A bound control socket's path, removed when the daemon is done, if it is still ours: a
/// daemon that was stopped and taken over may run on after the new daemon bound the same name.
pub struct BoundSocket {
    path: PathBuf,
    inode: (u64, u64),
    /// The thread answering on it.
    threads: Threads,
}

impl BoundSocket {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops answering (the request in progress, if any, is answered first, until
    /// `deadline`) and removes the socket.
    pub fn stop(self, deadline: std::time::Instant) {
        self.threads.stop_and_join(deadline);
        if let Ok(st) = rustix::fs::lstat(&self.path)
            && (st.st_dev, st.st_ino) == self.inode
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the control socket of the mount at `mountpoint` (made by this process) and serves
/// control requests on a thread of its own until `BoundSocket::stop`.
pub fn serve(
    mountpoint: &Path,
    handler: std::sync::Arc<dyn Handler>,
) -> anyhow::Result<BoundSocket> {
    let dir = runtime_dir();
    prepare_runtime_dir(&dir)?;
    // Daemons starting at once take turns here: one that found a socket not yet listening
    // (bound, about to listen) would take it for a dead daemon's and remove it, and the
    // other's chmod then failed (seen with tests starting mounts in parallel). Held until
    // our socket listens with its mode set; a flock on the directory itself, released
    // when `turn` is dropped.
    let turn = rustix::fs::open(
        &dir,
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .with_context(|| format!("cannot open {}", dir.display()))?;
    rustix::fs::flock(&turn, rustix::fs::FlockOperation::LockExclusive)
        .with_context(|| format!("cannot lock {}", dir.display()))?;
    remove_dead_sockets(&dir);
    let path = dir.join(socket_name(mountpoint));
    // A socket another daemon answers on is its, not ours to replace; a silent one is a
    // dead or hung daemon's whose mount is gone (the mount point was cleared before we
    // mounted).
    if let Liveness::Answers(other) = probe_socket(&path, Duration::from_secs(2)) {
        bail!(
            "cannot bind {}: the hoardfs daemon of {other} answers on it",
            path.display()
        );
    }
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).with_context(|| format!("cannot bind {}", path.display()))?;
    // Anyone may connect to root's sockets to read counters (requests are checked by the
    // peer's credentials); a user's socket is theirs alone. Set explicitly: the daemon runs
    // with umask 0.
    let mode = if rustix::process::geteuid().is_root() {
        0o666
    } else {
        0o600
    };
    rustix::fs::chmod(&path, rustix::fs::Mode::from_raw_mode(mode))
        .with_context(|| format!("cannot chmod {}", path.display()))?;
    let st = rustix::fs::lstat(&path)?;
    drop(turn);
    let threads = Threads::new("control");
    // A connection of our own ends the thread's wait in accept.
    let wake = path.clone();
    threads.on_stop(move || drop(UnixStream::connect(wake)));
    let owner = rustix::process::geteuid().as_raw();
    threads.spawn("control", move |stop| {
        for conn in listener.incoming() {
            if stop.is_set() {
                return;
            }
            let Ok(conn) = conn else { continue };
            let Ok(uid) = peer_uid(&conn) else { continue };
            let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
            let mut line = String::new();
            let mut reader = BufReader::new(&conn);
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let reply = answer(
                handler.as_ref(),
                line.trim_end_matches('\n'),
                Peer { uid },
                owner,
            );
            let mut w = &conn;
            let _ = writeln!(w, "{reply}");
        }
    })?;
    Ok(BoundSocket {
        path,
        inode: (st.st_dev, st.st_ino),
        threads,
    })
}

/// Connects to the daemon of `mount`, checking that the socket is served by root or by the
/// mount's owner (anyone else's server there would be an impostor).
fn connect(mount: &HoardfsMount) -> anyhow::Result<(PathBuf, UnixStream)> {
    let name = socket_name(&mount.mountpoint);
    let mut last_err = None;
    for dir in runtime_dirs_of(mount.owner) {
        let path = dir.join(&name);
        match UnixStream::connect(&path) {
            Ok(conn) => {
                let uid = peer_uid(&conn)?;
                if uid != 0 && uid != mount.owner {
                    bail!(
                        "control socket {} is served by uid {uid}, not by root or the \
                         mount's owner (uid {}): refusing to talk to it",
                        path.display(),
                        mount.owner
                    );
                }
                return Ok((path, conn));
            }
            Err(e) => last_err = Some((path, e)),
        }
    }
    let (path, e) = last_err.expect("at least one runtime directory");
    Err(e).with_context(|| {
        format!(
            "{} is not a running hoardfs mount (no control socket at {})",
            mount.mountpoint.display(),
            path.display()
        )
    })
}

/// Sends one request line to the daemon of the hoardfs mount holding `path`; returns the
/// mount, the socket path and the answer line.
fn request(path: &Path, req: &str) -> anyhow::Result<(HoardfsMount, PathBuf, String)> {
    let (mount, _) = crate::mounts::mount_of(path)?;
    let (socket, mut conn) = connect(&mount)?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    writeln!(conn, "{req}")?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    Ok((mount, socket, line))
}

/// Changes a tunable of the running mount (`hoardfs set`).
pub fn request_set(mountpoint: &Path, key: &str, value: &str) -> anyhow::Result<()> {
    if key.is_empty() || value.is_empty() || key.contains(char::is_whitespace) {
        bail!("invalid setting {key:?}={value:?}");
    }
    if value.contains(char::is_whitespace) {
        bail!("{key}: value {value:?} must not contain spaces");
    }
    // Checked here too, so that a wrong key or value is told before any connection.
    crate::options::parse_live(key, value).map_err(anyhow::Error::msg)?;
    let (_, _, line) = request(mountpoint, &format!("set {key} {value}"))?;
    let v: serde_json::Value = serde_json::from_str(&line).context("bad answer from the daemon")?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        bail!("{e}");
    }
    Ok(())
}

fn check_answer(line: &str) -> anyhow::Result<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(line).context("bad answer from the daemon")?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        bail!("{e}");
    }
    Ok(v)
}

/// Runs a clean on the mount now; returns the bytes freed.
pub fn request_clean(mountpoint: &Path, to: Option<u64>) -> anyhow::Result<u64> {
    let req = match to {
        Some(n) => format!("clean {n}"),
        None => "clean".into(),
    };
    let (_, _, line) = request(mountpoint, &req)?;
    Ok(check_answer(&line)?["freed"].as_u64().unwrap_or(0))
}

/// Pins (or unpins) a path inside a mount.
pub fn request_pin(path: &Path, on: bool) -> anyhow::Result<()> {
    let (_, rel) = crate::mounts::mount_of(path)?;
    if rel.as_os_str().is_empty() {
        bail!("pin files or directories inside the mount, not the mount point itself");
    }
    let verb = if on { "pin" } else { "unpin" };
    let (_, _, line) = request(path, &format!("{verb} {}", rel.display()))?;
    check_answer(&line).map(|_| ())
}

/// Asks the daemon of the hoardfs mount holding `path` for its counters.
pub fn request_stats(path: &Path) -> anyhow::Result<Snapshot> {
    let (mount, socket, line) = request(path, "stats")?;
    let snap: Snapshot = serde_json::from_str(&line).context("bad answer from the daemon")?;
    if Path::new(&snap.mountpoint) != mount.mountpoint {
        bail!(
            "control socket {} belongs to {}, not {}",
            socket.display(),
            snap.mountpoint,
            mount.mountpoint.display()
        );
    }
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    struct Fixed;
    impl Handler for Fixed {
        fn stats(&self) -> Snapshot {
            Snapshot::default()
        }
        fn set(&self, _: Live) -> Result<(), ControlError> {
            Ok(())
        }
        fn clean(&self, _: Option<u64>) -> u64 {
            7
        }
        fn pin(&self, _: &Path, _: bool) -> Result<(), ControlError> {
            Ok(())
        }
    }

    #[test]
    fn only_root_and_the_owner_may_change_or_name_things() {
        let owner = 1000;
        for uid in [0, owner] {
            for req in [
                "set stale_check off",
                "clean 0",
                "pin a/b",
                "set online off",
            ] {
                let a = answer(&Fixed, req, Peer { uid }, owner);
                assert!(!a.contains("error"), "uid {uid} {req}: {a}");
            }
        }
        for req in [
            "set stale_check off",
            "set log trace",
            "set online off",
            "clean 0",
            "clean",
            "pin secret/x",
            "unpin secret/x",
        ] {
            let a = answer(&Fixed, req, Peer { uid: 65534 }, owner);
            assert!(a.contains("permission denied"), "{req}: {a}");
        }
        let a = answer(&Fixed, "stats", Peer { uid: 65534 }, owner);
        assert!(a.contains("mountpoint"), "{a}");
    }

    /// Refuses everything, as a mount that cannot.
    struct Refusing;
    impl Handler for Refusing {
        fn stats(&self) -> Snapshot {
            Snapshot::default()
        }
        fn set(&self, _: Live) -> Result<(), ControlError> {
            Err(ReconnectError::WritersOpen(2).into())
        }
        fn clean(&self, _: Option<u64>) -> u64 {
            0
        }
        fn pin(&self, rel: &Path, _: bool) -> Result<(), ControlError> {
            Err(ControlError::Stat {
                path: rel.into(),
                source: std::io::Error::from_raw_os_error(libc::ENOENT),
            })
        }
    }

    #[test]
    fn refusals_read_as_the_user_sees_them() {
        let error = |req: &str, uid: u32| {
            let a: serde_json::Value =
                serde_json::from_str(&answer(&Refusing, req, Peer { uid }, 0)).unwrap();
            a["error"].as_str().unwrap_or_default().to_string()
        };
        assert_eq!(
            error("pin a/b", 7),
            "permission denied: only root or the mount's owner (uid 0) may pin; uid 7 may read \
             counters (stats)"
        );
        assert_eq!(error("set online", 0), "usage: set KEY VALUE");
        assert_eq!(error("clean 1x", 0), "clean: invalid size \"1x\"");
        assert_eq!(error("frob it", 0), "unknown request \"frob it\"");
        assert_eq!(
            error("set online on", 0),
            "2 file(s) written offline are still open: the offline changes are replayed once \
             they are closed"
        );
        assert_eq!(
            error("pin a b/c", 0),
            "a b/c: No such file or directory (os error 2)"
        );
        assert!(error("set stale_check maybe", 0).contains("stale_check"));
        let texts = [
            (
                ControlError::NotInMount("../x".into()),
                "../x: not a path inside the mount",
            ),
            (ControlError::NoCacheLimits, "the cache has no limits yet"),
            (
                ControlError::NoDefault(anyhow::anyhow!("statvfs failed")),
                "cannot compute the default: statvfs failed",
            ),
            (
                ControlError::SavePins(std::io::Error::from_raw_os_error(libc::ENOSPC)),
                "cannot save pins: No space left on device (os error 28)",
            ),
            (
                ReconnectError::ReplayStopped {
                    seq: 4,
                    source: std::io::Error::from_raw_os_error(libc::ENOTCONN),
                }
                .into(),
                "replay of offline change 4 stopped: Transport endpoint is not connected (os \
                 error 107)",
            ),
            (
                ReconnectError::Progress(std::io::Error::from_raw_os_error(libc::EIO)).into(),
                "cannot record replay progress: Input/output error (os error 5)",
            ),
        ];
        for (e, text) in texts {
            assert_eq!(e.to_string(), text);
        }
    }

    #[test]
    fn the_runtime_directory_is_ours_and_tight() {
        if !rustix::process::geteuid().is_root() {
            return; // needs chown to stage another user's directory
        }
        let t = tempfile::tempdir().unwrap();
        // Created with the right mode, whatever the umask.
        let fresh = t.path().join("fresh");
        prepare_runtime_dir(&fresh).unwrap();
        assert_eq!(fs_mode(&fresh), 0o755);
        // Ours but loose (as earlier versions left /run/hoardfs): tightened.
        std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(0o777)).unwrap();
        prepare_runtime_dir(&fresh).unwrap();
        assert_eq!(fs_mode(&fresh), 0o755);
        // Another user's: refused, and left as it was.
        let theirs = t.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let e = prepare_runtime_dir(&theirs).unwrap_err().to_string();
        assert!(e.contains("belongs to uid 65534"), "{e}");
        assert_eq!(fs_mode(&theirs), 0o777);
        // A link to a directory of ours: refused, never followed.
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        assert!(prepare_runtime_dir(&link).is_err());
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    }

    fn fs_mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn socket_names_differ_by_mount_point() {
        let a = socket_name(Path::new("/mnt/a"));
        assert_ne!(a, socket_name(Path::new("/mnt/b")));
        assert_eq!(a, socket_name(Path::new("/mnt/a")));
        assert!(runtime_dir().join(&a).as_os_str().len() < 100);
    }
}

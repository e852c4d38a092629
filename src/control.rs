//! The control socket: how `hoardfs stats MOUNTPOINT` and `hoardfs set MOUNTPOINT KEY=VALUE`
//! reach a running daemon. One Unix socket per mount in the runtime directory, named by a hash of
//! the mount point (socket paths are limited to 108 bytes). Requests are one line of text,
//! answers one line of JSON; the daemon serves them on its own thread.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::stats::Snapshot;

pub fn runtime_dir() -> PathBuf {
    if rustix::process::geteuid().is_root() {
        PathBuf::from("/run/hoardfs")
    } else if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        PathBuf::from(d).join("hoardfs")
    } else {
        PathBuf::from(format!(
            "/tmp/hoardfs-{}",
            rustix::process::geteuid().as_raw()
        ))
    }
}

pub fn socket_path(mountpoint: &Path) -> PathBuf {
    let bytes = mountpoint.as_os_str().as_encoded_bytes();
    runtime_dir().join(format!(
        "{:08x}-{}.sock",
        crc32fast::hash(bytes),
        bytes.len()
    ))
}

/// Serves control requests until the process exits: `stats`, and `set KEY VALUE` (handed
/// to `set`, which answers an error message or nothing).
pub fn serve(
    mountpoint: &Path,
    snapshot: impl Fn() -> Snapshot + Send + 'static,
    set: impl Fn(&str, &str) -> Result<(), String> + Send + 'static,
) -> anyhow::Result<PathBuf> {
    let path = socket_path(mountpoint);
    std::fs::create_dir_all(path.parent().unwrap())?;
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).with_context(|| format!("cannot bind {}", path.display()))?;
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                let mut line = String::new();
                let mut reader = BufReader::new(&conn);
                if reader.read_line(&mut line).is_err() {
                    continue;
                }
                let answer = match line.trim() {
                    "stats" => serde_json::to_string(&snapshot()).unwrap_or_default(),
                    other if other.starts_with("set ") => {
                        let mut words = other.split_whitespace().skip(1);
                        let r = match (words.next(), words.next(), words.next()) {
                            (Some(k), Some(v), None) => set(k, v),
                            _ => Err("usage: set KEY VALUE".into()),
                        };
                        match r {
                            Ok(()) => serde_json::json!({ "ok": true }).to_string(),
                            Err(e) => serde_json::json!({ "error": e }).to_string(),
                        }
                    }
                    other => serde_json::json!({ "error": format!("unknown request {other:?}") })
                        .to_string(),
                };
                let mut w = &conn;
                let _ = writeln!(w, "{answer}");
            }
        })?;
    Ok(path)
}

/// Sends one request line to the daemon of `mountpoint`; returns the canonical mount
/// point, the socket path and the answer line.
fn request(mountpoint: &Path, req: &str) -> anyhow::Result<(PathBuf, PathBuf, String)> {
    let mp = std::fs::canonicalize(mountpoint)
        .with_context(|| format!("{}: no such mount point", mountpoint.display()))?;
    let path = socket_path(&mp);
    let mut conn = UnixStream::connect(&path).with_context(|| {
        format!(
            "{} is not a running hoardfs mount (no control socket at {})",
            mp.display(),
            path.display()
        )
    })?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    writeln!(conn, "{req}")?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    Ok((mp, path, line))
}

/// Changes a tunable of the running mount (`hoardfs set`).
pub fn request_set(mountpoint: &Path, key: &str, value: &str) -> anyhow::Result<()> {
    if key.is_empty() || value.is_empty() || key.contains(char::is_whitespace) {
        bail!("invalid setting {key:?}={value:?}");
    }
    if value.contains(char::is_whitespace) {
        bail!("{key}: value {value:?} must not contain spaces");
    }
    let (_, _, line) = request(mountpoint, &format!("set {key} {value}"))?;
    let v: serde_json::Value = serde_json::from_str(&line).context("bad answer from the daemon")?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        bail!("{e}");
    }
    Ok(())
}

/// Asks the daemon of `mountpoint` for its counters.
pub fn request_stats(mountpoint: &Path) -> anyhow::Result<Snapshot> {
    let (mp, path, line) = request(mountpoint, "stats")?;
    let snap: Snapshot = serde_json::from_str(&line).context("bad answer from the daemon")?;
    if Path::new(&snap.mountpoint) != mp {
        bail!(
            "control socket {} belongs to {}, not {}",
            path.display(),
            snap.mountpoint,
            mp.display()
        );
    }
    Ok(snap)
}

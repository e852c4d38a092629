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

/// What the daemon does for control requests.
pub trait Handler: Send + Sync + 'static {
    fn stats(&self) -> Snapshot;
    /// `set KEY VALUE`: change a tunable.
    fn set(&self, key: &str, value: &str) -> Result<(), String>;
    /// `clean [BYTES]`: evict now; answers the bytes freed.
    fn clean(&self, to: Option<u64>) -> u64;
    /// `pin REL` / `unpin REL` (REL relative to the mount point, may hold spaces).
    fn pin(&self, rel: &Path, on: bool) -> Result<(), String>;
}

fn answer(handler: &dyn Handler, line: &str) -> String {
    let ok = |r: Result<(), String>| match r {
        Ok(()) => serde_json::json!({ "ok": true }).to_string(),
        Err(e) => serde_json::json!({ "error": e }).to_string(),
    };
    let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
    match verb {
        "stats" => serde_json::to_string(&handler.stats()).unwrap_or_default(),
        "set" => {
            let mut words = rest.split_whitespace();
            ok(match (words.next(), words.next(), words.next()) {
                // The log filter belongs to the process, not to the file system.
                (Some("log"), Some(v), None) => crate::logging::set_filter(v),
                (Some(k), Some(v), None) => handler.set(k, v),
                _ => Err("usage: set KEY VALUE".into()),
            })
        }
        "clean" => match rest.trim() {
            "" => serde_json::json!({ "freed": handler.clean(None) }).to_string(),
            n => match n.parse::<u64>() {
                Ok(n) => serde_json::json!({ "freed": handler.clean(Some(n)) }).to_string(),
                Err(_) => ok(Err(format!("clean: invalid size {n:?}"))),
            },
        },
        "pin" | "unpin" if !rest.is_empty() => ok(handler.pin(Path::new(rest), verb == "pin")),
        _ => ok(Err(format!("unknown request {line:?}"))),
    }
}

/// Serves control requests until the process exits.
pub fn serve(mountpoint: &Path, handler: std::sync::Arc<dyn Handler>) -> anyhow::Result<PathBuf> {
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
                let reply = answer(handler.as_ref(), line.trim_end_matches('\n'));
                let mut w = &conn;
                let _ = writeln!(w, "{reply}");
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

/// The hoardfs mount point holding `path` (the longest `fuse.hoardfs` mount above it).
pub fn mount_of(path: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let abs = std::fs::canonicalize(path).with_context(|| format!("{}", path.display()))?;
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mp = info
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            (f.get(sep + 1) == Some(&"fuse.hoardfs")).then(|| PathBuf::from(unescape(f[4])))
        })
        .filter(|mp| abs.starts_with(mp))
        .max_by_key(|mp| mp.as_os_str().len())
        .ok_or_else(|| anyhow::anyhow!("{} is not inside a hoardfs mount", abs.display()))?;
    let rel = abs.strip_prefix(&mp)?.to_path_buf();
    Ok((mp, rel))
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push(u8::from_str_radix(&s[i + 1..i + 4], 8).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Pins (or unpins) a path inside a mount.
pub fn request_pin(path: &Path, on: bool) -> anyhow::Result<()> {
    let (mp, rel) = mount_of(path)?;
    if rel.as_os_str().is_empty() {
        bail!("pin files or directories inside the mount, not the mount point itself");
    }
    let verb = if on { "pin" } else { "unpin" };
    let (_, _, line) = request(&mp, &format!("{verb} {}", rel.display()))?;
    check_answer(&line).map(|_| ())
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

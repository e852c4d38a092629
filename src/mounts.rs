//! The system's view of hoardfs mounts, read from `/proc/self/mountinfo` (never by a stat
//! through the mount, which would hang on a hung daemon): which mount holds a path, who owns
//! it, and how to clear one whose daemon is dead or hung (fusectl's `abort`).

use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};

/// One `fuse.hoardfs` line of mountinfo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HoardfsMount {
    pub mountpoint: PathBuf,
    /// The device's minor number: the FUSE connection's number in fusectl.
    pub connection: u32,
    /// The `user_id=` the mount was made with: the daemon's owner.
    pub owner: u32,
    /// The source as the mount names it (mountinfo's "source" field).
    pub source: String,
}

/// Every hoardfs mount visible to this process, in mount order (a later one at the same
/// mount point is on top of an earlier one).
pub fn hoardfs_mounts() -> Vec<HoardfsMount> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|info| parse_mountinfo(&info))
        .unwrap_or_default()
}

fn parse_mountinfo(info: &str) -> Vec<HoardfsMount> {
    info.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            if f.get(sep + 1) != Some(&"fuse.hoardfs") {
                return None;
            }
            let connection = f.get(2)?.split(':').nth(1)?.parse().ok()?;
            let owner = f
                .get(sep + 3)?
                .split(',')
                .find_map(|o| o.strip_prefix("user_id=")?.parse().ok())?;
            Some(HoardfsMount {
                mountpoint: PathBuf::from(unescape(f.get(4)?)),
                connection,
                owner,
                source: unescape(f.get(sep + 2)?),
            })
        })
        .collect()
}

/// The topmost hoardfs mount exactly at `mountpoint` (absolute, lexically normal).
pub fn mount_at(mountpoint: &Path) -> Option<HoardfsMount> {
    hoardfs_mounts()
        .into_iter()
        .rev()
        .find(|m| m.mountpoint == mountpoint)
}

/// The hoardfs mount holding `path` (the longest mount point above it) and the path
/// relative to that mount point.
pub fn mount_of(path: &Path) -> anyhow::Result<(HoardfsMount, PathBuf)> {
    let abs = std::fs::canonicalize(path).with_context(|| format!("{}", path.display()))?;
    let m = hoardfs_mounts()
        .into_iter()
        .rev()
        .filter(|m| abs.starts_with(&m.mountpoint))
        .max_by_key(|m| m.mountpoint.as_os_str().len())
        .ok_or_else(|| anyhow::anyhow!("{} is not inside a hoardfs mount", abs.display()))?;
    let rel = abs.strip_prefix(&m.mountpoint)?.to_path_buf();
    Ok((m, rel))
}

/// `path` made absolute and normal without touching the file system (no stat, which a dead
/// mount answers with ENOTCONN and a hung one never answers).
pub fn lexical_absolute(path: &Path) -> std::io::Result<PathBuf> {
    let joined = std::env::current_dir()?.join(path);
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    Ok(out)
}

/// Aborts the FUSE connection of a mount whose daemon is dead or hung (its requests then
/// fail with ENOTCONN and a daemon stuck in the kernel can finish dying), then detaches the
/// mount. fusectl's files belong to the mount's owner, so an owner may do this unprivileged.
pub fn clear(mount: &HoardfsMount) -> anyhow::Result<()> {
    let conns = Path::new("/sys/fs/fuse/connections");
    let abort = conns.join(mount.connection.to_string()).join("abort");
    if !abort.exists() && rustix::process::geteuid().is_root() {
        // fusectl is not mounted everywhere (containers, minimal systems).
        let _ = rustix::mount::mount(
            "fusectl",
            conns,
            "fusectl",
            rustix::mount::MountFlags::empty(),
            None,
        );
    }
    match std::fs::write(&abort, "1") {
        Ok(()) => {}
        // The connection is already gone: only the mount is left.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot abort via {}", abort.display())),
    }
    let detached = if rustix::process::geteuid().is_root() {
        rustix::mount::unmount(&mount.mountpoint, rustix::mount::UnmountFlags::DETACH)
            .map_err(anyhow::Error::from)
    } else {
        let st = std::process::Command::new("fusermount3")
            .arg("-u")
            .arg("-z")
            .arg(&mount.mountpoint)
            .status()
            .context("fusermount3")?;
        if st.success() {
            Ok(())
        } else {
            Err(anyhow::anyhow!("fusermount3 -u -z failed: {st}"))
        }
    };
    detached.with_context(|| format!("cannot detach {}", mount.mountpoint.display()))?;
    // The detach is immediate for new lookups; wait until mountinfo agrees, briefly.
    for _ in 0..100 {
        if !hoardfs_mounts().contains(mount) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    bail!(
        "{} is still mounted after detaching it",
        mount.mountpoint.display()
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hoardfs_lines_only_with_their_owner_and_connection() {
        let info = "\
36 25 0:32 / /mnt/a\\040b rw,nosuid,nodev - fuse.hoardfs /srv/x rw,user_id=0,group_id=0,default_permissions
37 25 0:33 / /mnt/c rw - fuse.sshfs host: rw,user_id=1000,group_id=1000
38 25 0:34 / /home/u/m rw,nosuid,nodev - fuse.hoardfs /home/u/src rw,user_id=1000,group_id=1000
";
        let m = parse_mountinfo(info);
        assert_eq!(
            m,
            vec![
                HoardfsMount {
                    mountpoint: "/mnt/a b".into(),
                    connection: 32,
                    owner: 0,
                    source: "/srv/x".into()
                },
                HoardfsMount {
                    mountpoint: "/home/u/m".into(),
                    connection: 34,
                    owner: 1000,
                    source: "/home/u/src".into()
                }
            ]
        );
    }

    #[test]
    fn lexical_absolute_never_stats() {
        let p = lexical_absolute(Path::new("/no/such/../dir/./x")).unwrap();
        assert_eq!(p, Path::new("/no/dir/x"));
    }
}

//! `hoardfs warm`: hoarding (Coda) — fetch files or whole trees into the cache ahead of
//! time, so that they are there when the source is not.
//!
//! It works through the mount like any reader: listing every directory (which saves the
//! listings disconnected operation needs) and reading every regular file to its end
//! (which fetches it). Several files are read at once; progress (files, bytes, rate, ETA)
//! goes to a progress bar on a terminal and to a plain line every few seconds otherwise.
//! It never pushes the cache past its high watermark: files that would are skipped and
//! counted.

use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

/// One file to read.
struct Item {
    path: PathBuf,
    size: u64,
}

/// What a warm run did.
#[derive(Debug, Default)]
pub struct Outcome {
    pub files: u64,
    pub bytes: u64,
    pub dirs: u64,
    pub skipped_full: u64,
    pub failed: Vec<(PathBuf, String)>,
}

/// The cache's room left below its high watermark, re-asked every so often.
struct Budget {
    mountpoint: PathBuf,
    left: Mutex<(u64, Instant)>,
}

impl Budget {
    fn new(mountpoint: &Path) -> anyhow::Result<Budget> {
        let b = Budget {
            mountpoint: mountpoint.to_path_buf(),
            left: Mutex::new((0, Instant::now())),
        };
        b.refresh()?;
        Ok(b)
    }

    fn refresh(&self) -> anyhow::Result<()> {
        let s = crate::control::request_stats(&self.mountpoint)?;
        let room = s
            .cleaner
            .high_watermark_bytes
            .saturating_sub(s.cleaner.used_bytes);
        *self.left.lock().unwrap() = (room, Instant::now());
        Ok(())
    }

    /// Takes `size` bytes of room, or says there is none.
    fn take(&self, size: u64) -> bool {
        let stale = self.left.lock().unwrap().1.elapsed() > Duration::from_secs(2);
        if stale {
            let _ = self.refresh();
        }
        let mut left = self.left.lock().unwrap();
        if size > left.0 {
            return false;
        }
        left.0 -= size;
        true
    }
}

/// Lists `root` recursively (through the mount), collecting regular files.
fn walk(root: &Path, items: &mut Vec<Item>, out: &mut Outcome) {
    let meta = match std::fs::symlink_metadata(root) {
        Ok(m) => m,
        Err(e) => {
            out.failed.push((root.to_path_buf(), e.to_string()));
            return;
        }
    };
    if meta.is_file() {
        items.push(Item {
            path: root.to_path_buf(),
            size: meta.len(),
        });
        return;
    }
    if !meta.is_dir() {
        return;
    }
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        out.dirs += 1;
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) => {
                out.failed.push((dir, e.to_string()));
                continue;
            }
        };
        for e in rd {
            let Ok(e) = e else { continue };
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                let size = e.metadata().map(|m| m.len()).unwrap_or(0);
                items.push(Item {
                    path: e.path(),
                    size,
                });
            }
        }
    }
}

fn read_to_end(path: &Path, buf: &mut [u8], done: &AtomicU64) -> std::io::Result<()> {
    let mut f = std::fs::File::open(path)?;
    loop {
        let n = f.read(buf)?;
        if n == 0 {
            return Ok(());
        }
        done.fetch_add(n as u64, Relaxed);
    }
}

fn human(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// Warms `paths` (inside hoardfs mounts) with `jobs` readers; pins them first with `pin`.
pub fn warm(paths: &[PathBuf], pin: bool, jobs: usize) -> anyhow::Result<()> {
    let out = warm_quiet(paths, pin, jobs, std::io::stderr().is_terminal())?;
    eprintln!(
        "warmed {} files ({}) in {} directories{}",
        out.files,
        human(out.bytes as f64),
        out.dirs,
        if out.skipped_full > 0 {
            format!(
                "; {} files skipped: the cache would pass its high watermark",
                out.skipped_full
            )
        } else {
            String::new()
        }
    );
    for (p, e) in out.failed.iter().take(10) {
        eprintln!("  failed: {}: {e}", p.display());
    }
    if !out.failed.is_empty() {
        anyhow::bail!("{} paths could not be warmed", out.failed.len());
    }
    Ok(())
}

/// The work of `warm`, with the progress display on a terminal only.
pub fn warm_quiet(paths: &[PathBuf], pin: bool, jobs: usize, bar: bool) -> anyhow::Result<Outcome> {
    let mut out = Outcome::default();
    let mut items = Vec::new();
    let mut mountpoint = None;
    for p in paths {
        let (mp, _) = crate::mounts::mount_of(p)?;
        let mp = mp.mountpoint;
        if pin {
            crate::control::request_pin(p, true)
                .with_context(|| format!("cannot pin {}", p.display()))?;
        }
        mountpoint.get_or_insert(mp);
        walk(p, &mut items, &mut out);
    }
    let Some(mountpoint) = mountpoint else {
        return Ok(out);
    };
    let budget = Budget::new(&mountpoint)?;
    let total_bytes: u64 = items.iter().map(|i| i.size).sum();
    let total_files = items.len() as u64;

    let progress = if bar {
        let pb = ProgressBar::new(total_bytes);
        pb.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
            )
            .unwrap(),
        );
        pb
    } else {
        ProgressBar::hidden()
    };

    let next = AtomicUsize::new(0);
    let bytes_done = AtomicU64::new(0);
    let files_done = AtomicU64::new(0);
    let skipped = AtomicU64::new(0);
    let failed = Mutex::new(Vec::new());
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| {
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    let Some(item) = items.get(i) else { return };
                    if !budget.take(item.size) {
                        skipped.fetch_add(1, Relaxed);
                        continue;
                    }
                    if let Err(e) = read_to_end(&item.path, &mut buf, &bytes_done) {
                        failed
                            .lock()
                            .unwrap()
                            .push((item.path.clone(), e.to_string()));
                    }
                    files_done.fetch_add(1, Relaxed);
                }
            });
        }
        // Progress from this thread until the readers are done.
        let mut last_line = Instant::now();
        loop {
            let files = files_done.load(Relaxed) + skipped.load(Relaxed);
            let bytes = bytes_done.load(Relaxed);
            progress.set_position(bytes);
            progress.set_message(format!("{files}/{total_files} files"));
            if !bar && last_line.elapsed() >= Duration::from_secs(2) {
                last_line = Instant::now();
                let secs = start.elapsed().as_secs_f64().max(0.001);
                let rate = bytes as f64 / secs;
                let eta = if rate > 0.0 {
                    format!("{:.0}s", total_bytes.saturating_sub(bytes) as f64 / rate)
                } else {
                    "?".into()
                };
                eprintln!(
                    "warm: {files}/{total_files} files, {}/{}, {}/s, ETA {eta}",
                    human(bytes as f64),
                    human(total_bytes as f64),
                    human(rate)
                );
            }
            if files >= total_files {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    progress.finish_and_clear();
    out.files = files_done.load(Relaxed);
    out.bytes = bytes_done.load(Relaxed);
    out.skipped_full = skipped.load(Relaxed);
    out.failed.extend(failed.into_inner().unwrap());
    Ok(out)
}

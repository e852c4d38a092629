//! The benchmark suite's smoke runs (issue 3): `bench/run --quick` runs every workload over
//! every source (local, throttled loop disk, SSHFS in a network namespace) and every peer
//! (bindfs, rclone) at tiny sizes, once, and must finish with a report; `bench/run --s3
//! --quick` does the same for an S3 bucket (versitygw; hoardfs, rclone, s3fs). Its numbers are
//! not checked: timing belongs to the full suite, not to tests.
//!
//! Needs root and the packages `.ci/run` installs; `HOARDFS_SKIP_BENCH_SMOKE=1` skips it
//! on a developer's machine (it takes a few minutes and a release build).

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

/// One bench run at a time: each drops the page cache and tears down its work directory.
static ONE_RUN: Mutex<()> = Mutex::new(());

/// Runs `bench/run ARGS` with its work directory at `work` and returns its report, or
/// `None` when skipped. Fails if the run fails, writes no report, or leaves a mount.
fn quick_report(args: &[&str], work: &str) -> Option<String> {
    if std::env::var_os("HOARDFS_SKIP_BENCH_SMOKE").is_some() {
        eprintln!("bench smoke run skipped (HOARDFS_SKIP_BENCH_SMOKE)");
        return None;
    }
    let _one = ONE_RUN.lock().unwrap_or_else(|e| e.into_inner());
    let results = tempfile::tempdir().unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(repo.join("bench/run"))
        .args(args)
        .env("HOARDFS_BENCH_RESULTS", results.path())
        .env("HOARDFS_BENCH_WORK", work)
        .output()
        .expect("bench/run");
    let log =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench/run {args:?} failed:\n{log}");
    let report = std::fs::read_dir(results.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "md"))
        .unwrap_or_else(|| panic!("no report written:\n{log}"));
    // Nothing left mounted or set up.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&format!("{work}/")),
        "left mounted:\n{mounts}"
    );
    Some(std::fs::read_to_string(&report).unwrap())
}

#[test]
fn bench_quick_runs_every_workload_and_reports() {
    let Some(text) = quick_report(&["--quick"], "/var/tmp/hoardfs-bench-smoke") else {
        return;
    };
    for heading in [
        "## W1:", "## W2:", "## W3:", "## W4:", "## W5:", "## W6:", "## W7:", "## W8:",
    ] {
        assert!(
            text.contains(heading),
            "{heading} missing from the report:\n{text}"
        );
    }
    assert!(!text.contains("## Failures in this run"), "{text}");
}

/// `bench/run --s3 --quick`: the object-store benchmark on versitygw, every system.
#[test]
fn bench_s3_quick_runs_every_system_and_reports() {
    let work = "/var/tmp/hoardfs-bench-smoke-s3";
    let Some(text) = quick_report(&["--s3", "--quick"], work) else {
        return;
    };
    for row in [
        "| download to a file, 1 stream |",
        "| hoardfs | cold |",
        "| hoardfs | warm |",
        "| rclone | cold |",
        "| s3fs | cold |",
        "## grep:",
    ] {
        assert!(text.contains(row), "{row} missing from the report:\n{text}");
    }
    // Two seq rows and one grep row per system.
    for system in ["hoardfs", "rclone", "s3fs"] {
        let rows = text.matches(&format!("| {system} |")).count();
        assert_eq!(rows, 3, "{system}: {rows} rows in the report:\n{text}");
    }
    assert!(!text.contains("## Failed"), "{text}");
}

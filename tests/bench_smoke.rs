//! The benchmark suite's smoke runs (issue 3): `bench/run --quick` runs every workload over
//! every source (local, throttled loop disk, SSHFS in a network namespace) and every peer
//! (bindfs, rclone) at tiny sizes, once, and must finish with a report; `bench/run --s3
//! --quick` does the same for an S3 bucket (versitygw; hoardfs, rclone, s3fs). Its numbers are
//! not checked: timing belongs to the full suite, not to tests.
//!
//! Not part of `cargo test`: `bench/run` installs packages (apt), builds a release binary,
//! drops the page cache and takes several minutes. `.ci/run` runs it as its own step, as
//! `cargo test --test bench_smoke -- --ignored` (root, with a timeout). Its scratch goes to
//! a work directory under a temporary one in /var/tmp, which `bench/run` removes.

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

/// One bench run at a time: each drops the page cache and tears down its work directory.
static ONE_RUN: Mutex<()> = Mutex::new(());

/// Runs `bench/run ARGS` with a new work directory and returns its report. Fails if the
/// run fails, writes no report, leaves a mount or leaves its work directory.
fn quick_report(args: &[&str]) -> String {
    let _one = ONE_RUN.lock().unwrap_or_else(|e| e.into_inner());
    let results = tempfile::tempdir().unwrap();
    // On disk (as the benchmark wants), not tmpfs; bench/run makes `work` and removes it.
    let scratch = tempfile::Builder::new()
        .prefix("hoardfs-bench-smoke")
        .tempdir_in("/var/tmp")
        .unwrap();
    let work = scratch.path().join("work");
    let work = work.to_str().unwrap();
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
    if mounts.contains(&format!("{work}/")) {
        // Never let the TempDir's removal walk into a mount.
        let kept = scratch.keep();
        panic!("left mounted under {}:\n{mounts}", kept.display());
    }
    assert!(
        !Path::new(work).exists(),
        "bench/run left its work directory {work}"
    );
    std::fs::read_to_string(&report).unwrap()
}

#[test]
#[ignore = "installs packages and takes minutes: .ci/run runs it (--ignored)"]
fn bench_quick_runs_every_workload_and_reports() {
    let text = quick_report(&["--quick"]);
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
#[cfg(feature = "s3")]
#[test]
#[ignore = "installs packages and takes minutes: .ci/run runs it (--ignored)"]
fn bench_s3_quick_runs_every_system_and_reports() {
    let text = quick_report(&["--s3", "--quick"]);
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

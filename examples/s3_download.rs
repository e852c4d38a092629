//! The benchmark's baseline for an object-store source: download one object with the client
//! hoardfs itself uses (`ObjectSource::read_range`, i.e. `object_store`), in ranged GETs of
//! `--part` bytes, `--parallel` at a time, into `--out FILE` (each part written at its
//! offset, as a download does) or discarding them. Prints one JSON line.
//!
//! ```sh
//! cargo run --release --example s3_download -- --endpoint http://127.0.0.1:9000 \
//!     s3://bench/big.bin --parallel 4 --part 8388608
//! ```
//! Credentials come from the usual `AWS_*` variables or profile files.

use hoardfs::object_source::{ObjectSource, ObjectUrl, S3Options};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut endpoint, mut url, mut parallel, mut part) = (None, None, 4u64, 8u64 << 20);
    let mut out = None;
    while let Some(a) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{a} needs a value"))
        };
        match a.as_str() {
            "--endpoint" => endpoint = Some(value()?),
            "--parallel" => parallel = value()?.parse()?,
            "--part" => part = value()?.parse()?,
            "--out" => out = Some(value()?),
            _ if a.starts_with("s3://") => url = Some(a),
            _ => anyhow::bail!("unknown argument {a:?}"),
        }
    }
    let url = url.ok_or_else(|| {
        anyhow::anyhow!(
            "usage: s3_download [--endpoint URL] [--parallel N] [--part BYTES] s3://BUCKET/KEY"
        )
    })?;
    let full = ObjectUrl::parse(&url).map_err(anyhow::Error::msg)?;
    // The key is the URL's prefix; the store is opened at the bucket's root.
    let key = full.prefix.trim_end_matches('/').to_string();
    let bucket = ObjectUrl::parse(&format!("s3://{}", full.bucket)).map_err(anyhow::Error::msg)?;
    let opts = S3Options {
        allow_http: endpoint
            .as_deref()
            .is_some_and(|e| e.starts_with("http://")),
        endpoint,
        ..Default::default()
    };
    let store = ObjectSource::open(&bucket, opts)?;
    let size = store.stat(Path::new(&key))?.size;
    let out = match out {
        Some(p) => Some(std::fs::File::create(p)?),
        None => None,
    };
    let next = AtomicU64::new(0);
    let got = AtomicU64::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..parallel.max(1))
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    loop {
                        let off = next.fetch_add(1, Relaxed) * part;
                        if off >= size {
                            return Ok(());
                        }
                        let b = store.read_range(Path::new(&key), off, part, None)?;
                        if let Some(f) = &out {
                            std::os::unix::fs::FileExt::write_all_at(f, &b, off)?;
                        }
                        got.fetch_add(b.len() as u64, Relaxed);
                    }
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().unwrap())
    })?;
    let secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(
        got.load(Relaxed) == size,
        "read {} of {size} bytes",
        got.load(Relaxed)
    );
    println!(
        "{{\"bytes\": {size}, \"seconds\": {secs:.4}, \"mib_per_s\": {:.1}, \"parallel\": {parallel}, \"part\": {part}, \"to_file\": {}}}",
        size as f64 / (1u64 << 20) as f64 / secs,
        out.is_some()
    );
    Ok(())
}

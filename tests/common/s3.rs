//! A real S3 server on loopback for tests: versitygw with its posix backend.
//!
//! The binary: `$HOARDFS_VERSITYGW`, else `$HOME/go/bin/versitygw`; `.ci/run` builds it
//! (`go install github.com/versity/versitygw/cmd/versitygw@v1.8.0`). The tests never do.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const VERSITYGW_VERSION: &str = "v1.8.0";
pub const ACCESS_KEY: &str = "hoardfs-test-access";
pub const SECRET_KEY: &str = "hoardfs-test-secret-key";

/// Options of a client of the test server at `endpoint`, with its keys and short timeouts.
pub fn client_options(endpoint: &str) -> hoardfs::object_source::S3Options {
    hoardfs::object_source::S3Options {
        endpoint: Some(endpoint.to_string()),
        region: Some("us-east-1".into()),
        allow_http: true,
        credentials: Some(hoardfs::object_source::Credentials {
            access_key_id: ACCESS_KEY.into(),
            secret_access_key: SECRET_KEY.into(),
            session_token: None,
        }),
        call_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// The versitygw binary: `$HOARDFS_VERSITYGW`, else `~/go/bin/versitygw`. The test suite
/// installs nothing (README, "Tests"), so a missing binary fails the test with what to do.
pub fn versitygw_binary() -> PathBuf {
    let bin = match std::env::var_os("HOARDFS_VERSITYGW") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME")).join("go/bin/versitygw"),
    };
    assert!(
        bin.is_file(),
        "no versitygw at {}: the S3 tests need it. Build it once with Go >= 1.25 \
         (`go install github.com/versity/versitygw/cmd/versitygw@{VERSITYGW_VERSION}`, \
         which .ci/run does) or set HOARDFS_VERSITYGW to a versitygw binary",
        bin.display()
    );
    bin
}

/// A versitygw process serving a temporary directory; killed on drop.
pub struct Versity {
    pub dir: tempfile::TempDir,
    pub addr: SocketAddr,
    pub endpoint: String,
    child: Option<Child>,
}

fn free_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

impl Versity {
    /// Starts a server with `buckets`: the posix backend serves each directory of its root
    /// as a bucket, so they are made as directories (no CreateBucket needed).
    pub fn start(buckets: &[&str]) -> Versity {
        let dir = tempfile::Builder::new()
            .prefix("hoardfs-s3")
            .tempdir()
            .unwrap();
        let root = dir.path().join("gw");
        for b in buckets {
            std::fs::create_dir_all(root.join(b)).unwrap();
        }
        let addr = free_port();
        let mut v = Versity {
            dir,
            addr,
            endpoint: format!("http://{addr}"),
            child: None,
        };
        v.spawn();
        v
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("versitygw.log")).unwrap();
        let child = Command::new(versitygw_binary())
            .args(["--port", &self.addr.to_string(), "--access", ACCESS_KEY])
            .args(["--secret", SECRET_KEY, "--quiet", "posix"])
            .arg(self.dir.path().join("gw"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start versitygw");
        self.child = Some(child);
        // It starts in about 0.1 s; answer-or-fail within 20 s even on a loaded machine.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !answers_http(self.addr) {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("versitygw exited ({st}): {}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "versitygw did not listen: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("versitygw.log")).unwrap_or_default()
    }

    /// The backend directory of a bucket (objects are files below it).
    pub fn bucket_dir(&self, bucket: &str) -> PathBuf {
        self.dir.path().join("gw").join(bucket)
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and directory.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

/// Whether something at `addr` answers an HTTP request (any status: an anonymous request
/// gets 403), which a listening socket alone does not prove.
fn answers_http(addr: SocketAddr) -> bool {
    let Ok(mut c) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
    let mut reply = [0u8; 12];
    c.write_all(b"GET / HTTP/1.0\r\n\r\n").is_ok()
        && c.read_exact(&mut reply).is_ok()
        && reply.starts_with(b"HTTP/1.")
}

impl Drop for Versity {
    fn drop(&mut self) {
        self.stop();
    }
}

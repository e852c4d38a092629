//! Building the source from the configuration, outside the core: the source argument's
//! `SourceSpec` decides the kind (`PosixTree` or `ObjectTree`), whose root is opened and
//! checked against what the cache recorded of it; a source unreachable at start is used
//! offline when the cache holds an earlier mount of it. `run.rs` hands the result to
//! `CachingFs::new`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::{GuardedSource, Health};
use crate::cache::CacheStore;
use crate::cache::source_info::SourceInfo;
use crate::config::{Config, SourceSpec};
use crate::source::{BeneathRoot, Capabilities, PosixTree, Stat, fstat};

/// Source call timeout where none is configured and the source is a network or FUSE file
/// system: long enough for a slow server, short enough that a dead one is noticed.
pub const DEFAULT_REMOTE_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest wait for the source's root at start: a dead network mount can hang any call
/// on its path.
const SOURCE_OPEN_WAIT: Duration = Duration::from_secs(10);

/// The guarded source, what it is (`SourceInfo`, also saved in the cache) and its root's
/// stat (the recorded one when it could not be reached).
pub struct OpenedSource {
    pub source: Arc<GuardedSource>,
    pub info: SourceInfo,
    pub root_stat: Stat,
}

/// The health timeout for `configured` (`--source-timeout`; zero: none): by default
/// `DEFAULT_REMOTE_TIMEOUT` on a remote source, none where calls time themselves.
pub fn timeout_for(
    configured: Option<Duration>,
    caps: Capabilities,
    remote: bool,
) -> Option<Duration> {
    match configured {
        None if !caps.own_timeouts && remote => Some(DEFAULT_REMOTE_TIMEOUT),
        t => t.filter(|t| !t.is_zero()),
    }
}

/// Opens the source `cfg` names, with the cache `cache` (which records what it was).
pub fn open_source(cfg: &Config, cache: &CacheStore) -> anyhow::Result<OpenedSource> {
    let recorded = SourceInfo::load(cache.top());
    match cfg.source_spec() {
        #[cfg(feature = "s3")]
        SourceSpec::Object(url) => {
            let (tree, info, unreachable) = open_object_tree(cfg, &url, cache, recorded.as_ref())?;
            let tree: Arc<dyn crate::source::SourceTree> = Arc::new(tree);
            Ok(guarded(cfg, tree, info, unreachable, info.root_stat()))
        }
        SourceSpec::Dir(path) => {
            let (root, info, unreachable) = match open_root(&path, recorded.as_ref()) {
                Ok((root, info)) => {
                    if let Err(e) = info.save(cache.top()) {
                        tracing::warn!("cannot record the source's kind in the cache: {e}");
                    }
                    (Some(root), info, None)
                }
                // Disconnected operation from the start: the cache of an earlier mount.
                Err(why) => match recorded {
                    Some(rec) => (None, rec, Some(why)),
                    None => anyhow::bail!("cannot use the source {}: {why}", path.display()),
                },
            };
            let root_stat = match &root {
                Some(r) => fstat(r.root_fd())?,
                None => info.root_stat(),
            };
            let root_id = (info.root_dev, info.root_ino);
            let tree = PosixTree::new(root, &path, root_id, info.fs_type, info.remote);
            Ok(guarded(cfg, Arc::new(tree), info, unreachable, root_stat))
        }
    }
}

/// `tree` behind the guard, offline from the start when it was `unreachable`.
fn guarded(
    cfg: &Config,
    tree: Arc<dyn crate::source::SourceTree>,
    info: SourceInfo,
    unreachable: Option<String>,
    root_stat: Stat,
) -> OpenedSource {
    let timeout = timeout_for(cfg.source_timeout, tree.capabilities(), info.remote);
    let health = Arc::new(Health::new(timeout, cfg.start_offline));
    if let Some(why) = &unreachable {
        health.go_offline(&format!("the source is unavailable at start: {why}"), false);
    }
    OpenedSource {
        source: Arc::new(GuardedSource::new(tree, health, &info)),
        info,
        root_stat,
    }
}

/// Opens the source's root (waiting at most `SOURCE_OPEN_WAIT`) and checks it against what
/// the cache recorded of it; the error says why it cannot be used.
fn open_root(
    path: &Path,
    recorded: Option<&SourceInfo>,
) -> std::result::Result<(BeneathRoot, SourceInfo), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    // Not owned: one that outlives its wait is stuck in a hung source and stays detached.
    std::thread::Builder::new()
        .name("source-open".into())
        .spawn(move || {
            let r = BeneathRoot::open(&p).and_then(|root| {
                let info = SourceInfo::of(root.root_fd())?;
                Ok((root, info))
            });
            let _ = tx.send(r);
        })
        .map_err(|e| e.to_string())?;
    let (root, info) = match rx.recv_timeout(SOURCE_OPEN_WAIT) {
        Ok(Ok(opened)) => opened,
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err(format!("no answer within {SOURCE_OPEN_WAIT:?}")),
    };
    if let Some(why) = recorded.and_then(|r| r.mismatch(&info)) {
        return Err(why);
    }
    Ok((root, info))
}

/// Opens an object-store source and checks that it answers (a stat of its root); one that
/// does not is used offline when the cache holds an earlier mount of it.
#[cfg(feature = "s3")]
fn open_object_tree(
    cfg: &Config,
    url: &crate::object_source::ObjectUrl,
    cache: &CacheStore,
    recorded: Option<&SourceInfo>,
) -> anyhow::Result<(crate::object_tree::ObjectTree, SourceInfo, Option<String>)> {
    let name = cfg.source.display();
    let opts = crate::object_source::S3Options {
        endpoint: cfg.s3.endpoint.clone(),
        region: cfg.s3.region.clone(),
        virtual_hosted: cfg.s3.virtual_hosted,
        allow_http: cfg
            .s3
            .endpoint
            .as_deref()
            .is_some_and(|e| e.starts_with("http://")),
        ..Default::default()
    };
    let store = crate::object_source::ObjectSource::open(url, opts)
        .map_err(|e| anyhow::anyhow!("cannot use the source {name}: {e}"))?;
    let tree = crate::object_tree::ObjectTree::new(store);
    let object_recorded =
        recorded.filter(|r| r.fs_type == crate::cache::source_info::OBJECT_STORE_TYPE);
    if recorded.is_some() && object_recorded.is_none() {
        anyhow::bail!(
            "the cache directory {} was filled from a directory source, not {name}",
            cache.root().display()
        );
    }
    match tree.check_root() {
        Ok(root) => {
            let info = SourceInfo::object(&root);
            if let Err(e) = info.save(cache.top()) {
                tracing::warn!("cannot record the source's kind in the cache: {e}");
            }
            Ok((tree, info, None))
        }
        Err(e) if crate::source::may_mean_unreachable(&e) && object_recorded.is_some() => {
            Ok((tree, *object_recorded.unwrap(), Some(e.to_string())))
        }
        Err(e) => anyhow::bail!("cannot use the source {name}: {e}"),
    }
}

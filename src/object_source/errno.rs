//! The errno of an `object_store` error or of an HTTP answer, after the retries.

use std::io;

use object_store::client::{HttpError, HttpErrorKind};

/// The HTTP status an `object_store` error carries. Its retry error type is not public, so
/// the status is read from the message it always formats ("status code: 503 ...").
fn http_status(e: &(dyn std::error::Error + 'static)) -> Option<u16> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if let Some(i) = text.find("status code: ") {
            let digits = text.get(i + 13..i + 16)?;
            return digits.parse().ok();
        }
        cur = err.source();
    }
    None
}

fn http_kind(e: &(dyn std::error::Error + 'static)) -> Option<HttpErrorKind> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<HttpError>() {
            return Some(h.kind());
        }
        cur = err.source();
    }
    None
}

pub(super) fn errno_of_kind(k: HttpErrorKind) -> i32 {
    match k {
        // Refused, no route, DNS, TLS handshake: the store is unreachable.
        HttpErrorKind::Connect => libc::ENOTCONN,
        HttpErrorKind::Timeout => libc::ETIMEDOUT,
        HttpErrorKind::Request | HttpErrorKind::Interrupted => libc::ECONNRESET,
        _ => libc::EIO,
    }
}

pub(super) fn errno_of_status(status: u16, body: &str) -> i32 {
    match status {
        400 if body.contains("InvalidArgument") || body.contains("KeyTooLong") => libc::EINVAL,
        401 | 403 => libc::EACCES,
        404 => libc::ENOENT,
        405 | 501 => libc::EOPNOTSUPP,
        409 => libc::EEXIST,
        // The object changed under an If-Match.
        412 => libc::ESTALE,
        // SlowDown is a 503; 429 from others. Already retried with backoff by then.
        429 | 503 => libc::EAGAIN,
        504 => libc::ETIMEDOUT,
        _ if body.contains("SlowDown") => libc::EAGAIN,
        _ => libc::EIO,
    }
}

/// The errno for an `object_store` error, after its own bounded retries.
pub fn errno_of(e: &object_store::Error) -> i32 {
    use object_store::Error as E;
    match e {
        E::NotFound { .. } => libc::ENOENT,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => libc::EACCES,
        E::Precondition { .. } | E::NotModified { .. } => libc::ESTALE,
        E::AlreadyExists { .. } => libc::EEXIST,
        E::InvalidPath { .. } | E::UnknownConfigurationKey { .. } => libc::EINVAL,
        E::NotSupported { .. } | E::NotImplemented { .. } => libc::EOPNOTSUPP,
        E::Generic { source, .. } => {
            if let Some(k) = http_kind(source.as_ref()) {
                return errno_of_kind(k);
            }
            match http_status(source.as_ref()) {
                Some(s) => errno_of_status(s, &source.to_string()),
                None if source.to_string().contains("SlowDown") => libc::EAGAIN,
                None => libc::EIO,
            }
        }
        _ => libc::EIO,
    }
}

pub(super) fn store_err(e: object_store::Error, op: &str, key: &str) -> io::Error {
    let errno = errno_of(&e);
    tracing::debug!(op, key, errno, "object store: {e}");
    io::Error::from_raw_os_error(errno)
}

pub(super) fn errno(n: i32) -> io::Error {
    io::Error::from_raw_os_error(n)
}

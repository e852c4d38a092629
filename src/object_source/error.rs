//! The error of an object-store request, with the HTTP status of its answer as a field, and
//! the one table from it to an errno (for `object_store`'s answers and the raw requests').

use std::io;

use object_store::client::{HttpError, HttpErrorKind};

/// A failed request to the object store, after the retries. The layers above see its errno
/// alone (`io::Error::from(ObjectError)`); the rest is logged there.
#[derive(Debug, thiserror::Error)]
#[error("object store: {op} {key:?}{}: {cause}", .status.map(|s| format!(" (HTTP {s})")).unwrap_or_default())]
pub struct ObjectError {
    /// What was asked ("get", "put part", "head marker", ...).
    pub op: &'static str,
    pub key: String,
    /// The HTTP status of the answer; `None` when no answer came, or `object_store` does not
    /// tell it.
    pub status: Option<u16>,
    #[source]
    cause: Cause,
}

#[derive(Debug, thiserror::Error)]
enum Cause {
    #[error(transparent)]
    Store(object_store::Error),
    /// A non-2xx answer to a raw signed request (`marker.rs`); its status is the error's.
    #[error("{}", if body.is_empty() { "no body" } else { body.as_str() })]
    Answer { body: String },
    /// A raw signed request that got no answer (refused, timed out, cut off).
    #[error(transparent)]
    Transport(HttpError),
}

impl ObjectError {
    /// From an error of `object_store`'s own calls.
    pub fn store(op: &'static str, key: &str, e: object_store::Error) -> ObjectError {
        ObjectError {
            op,
            key: key.to_string(),
            status: status_in_text(&e),
            cause: Cause::Store(e),
        }
    }

    /// From a non-2xx answer to a raw request (HEAD answers have no body).
    pub(super) fn answer(
        op: &'static str,
        key: &str,
        status: http::StatusCode,
        body: String,
    ) -> ObjectError {
        ObjectError {
            op,
            key: key.to_string(),
            status: Some(status.as_u16()),
            cause: Cause::Answer { body },
        }
    }

    /// From a raw request that got no answer.
    pub(super) fn transport(op: &'static str, key: &str, e: HttpError) -> ObjectError {
        ObjectError {
            op,
            key: key.to_string(),
            status: None,
            cause: Cause::Transport(e),
        }
    }

    /// Whether a ranged GET was refused for starting at or past the end of the object: a
    /// 416, or an answer `object_store` reports without its status that names S3's code.
    pub(super) fn range_not_satisfiable(&self) -> bool {
        self.status == Some(416)
            || matches!(&self.cause, Cause::Store(e @ object_store::Error::Generic { .. })
                if e.to_string().contains("InvalidRange"))
    }

    /// The errno the file system answers for it.
    pub fn errno(&self) -> i32 {
        match &self.cause {
            Cause::Store(e) => errno_of_store(e, self.status),
            Cause::Answer { body } => errno_of_status(self.status, body),
            Cause::Transport(e) => errno_of_kind(e.kind()),
        }
    }
}

impl From<ObjectError> for io::Error {
    /// The errno alone, as the `SourceTree` layer above reads it (`raw_os_error`); what the
    /// store said is logged here, not dropped unseen.
    fn from(e: ObjectError) -> io::Error {
        let errno = e.errno();
        tracing::debug!(op = e.op, key = e.key, status = e.status, errno, "{e}");
        io::Error::from_raw_os_error(errno)
    }
}

/// The HTTP status behind an `object_store` error. The crate's retry error, which holds it
/// (`RetryError::status`), is in a private module and cannot be downcast to, so the status
/// is read from the message it formats ("... status code: 503 Service Unavailable: ...").
/// An error answer whose message is "Server returned error response: BODY" has none.
fn status_in_text(e: &(dyn std::error::Error + 'static)) -> Option<u16> {
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

// The errno table: by `object_store`'s error kind, by transport failure, by HTTP status.

/// The errno for an `object_store` error (`ObjectError::errno` of one made from it).
pub fn errno_of(e: &object_store::Error) -> i32 {
    errno_of_store(e, status_in_text(e))
}

fn errno_of_store(e: &object_store::Error, status: Option<u16>) -> i32 {
    use object_store::Error as E;
    match e {
        E::NotFound { .. } => libc::ENOENT,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => libc::EACCES,
        E::Precondition { .. } | E::NotModified { .. } => libc::ESTALE,
        E::AlreadyExists { .. } => libc::EEXIST,
        E::InvalidPath { .. } | E::UnknownConfigurationKey { .. } => libc::EINVAL,
        E::NotSupported { .. } | E::NotImplemented { .. } => libc::EOPNOTSUPP,
        E::Generic { source, .. } => match http_kind(source.as_ref()) {
            Some(k) => errno_of_kind(k),
            None => errno_of_status(status, &source.to_string()),
        },
        _ => libc::EIO,
    }
}

fn errno_of_kind(k: HttpErrorKind) -> i32 {
    match k {
        // Refused, no route, DNS, TLS handshake: the store is unreachable.
        HttpErrorKind::Connect => libc::ENOTCONN,
        HttpErrorKind::Timeout => libc::ETIMEDOUT,
        HttpErrorKind::Request | HttpErrorKind::Interrupted => libc::ECONNRESET,
        _ => libc::EIO,
    }
}

/// By the status of the answer, if known, and its body (or the message that quotes it).
fn errno_of_status(status: Option<u16>, body: &str) -> i32 {
    match status {
        Some(400) if body.contains("InvalidArgument") || body.contains("KeyTooLong") => {
            libc::EINVAL
        }
        Some(401 | 403) => libc::EACCES,
        Some(404) => libc::ENOENT,
        Some(405 | 501) => libc::EOPNOTSUPP,
        Some(409) => libc::EEXIST,
        // The object changed under an If-Match.
        Some(412) => libc::ESTALE,
        // SlowDown is a 503; 429 from others. Already retried with backoff by then.
        Some(429 | 503) => libc::EAGAIN,
        Some(504) => libc::ETIMEDOUT,
        _ if body.contains("SlowDown") => libc::EAGAIN,
        _ => libc::EIO,
    }
}

/// An errno of hoardfs's own (a key it cannot make, a rename it will not do).
pub(super) fn errno(n: i32) -> io::Error {
    io::Error::from_raw_os_error(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error as `object_store` makes it from an answer: its retry error's message.
    fn answered(status: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: format!(
                "Error performing GET http://x/b/k in 1s - Server returned non-2xx status \
                 code: {status}"
            )
            .into(),
        }
    }

    /// An error of the store with `source` as its text, and no status in it.
    fn generic(source: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: source.into(),
        }
    }

    #[test]
    fn the_status_is_a_field_however_the_answer_came() {
        let e = ObjectError::store("get", "k", answered("503 Service Unavailable: "));
        assert_eq!((e.status, e.errno()), (Some(503), libc::EAGAIN));
        // A kind object_store chose by the status keeps the status too.
        let e = ObjectError::store(
            "head",
            "k",
            object_store::Error::NotFound {
                path: "k".into(),
                source: "Server returned non-2xx status code: 404 Not Found: ".into(),
            },
        );
        assert_eq!((e.status, e.errno()), (Some(404), libc::ENOENT));
        // object_store's error answers without a status, and errors with no answer.
        let e = ObjectError::store(
            "get",
            "k",
            generic("Server returned error response: <Code>InternalError</Code>"),
        );
        assert_eq!((e.status, e.errno()), (None, libc::EIO));
        let no_answer = HttpError::new(HttpErrorKind::Connect, io::Error::other("refused"));
        let e = ObjectError::store(
            "list",
            "k",
            object_store::Error::Generic {
                store: "S3",
                source: Box::new(no_answer),
            },
        );
        assert_eq!((e.status, e.errno()), (None, libc::ENOTCONN));
        // The raw requests' answers, and their failures to get one.
        let e = ObjectError::answer("put marker", "d/", http::StatusCode::FORBIDDEN, "".into());
        assert_eq!((e.status, e.errno()), (Some(403), libc::EACCES));
        let timed_out = HttpError::new(HttpErrorKind::Timeout, io::Error::other("slow"));
        let e = ObjectError::transport("head marker", "d/", timed_out);
        assert_eq!((e.status, e.errno()), (None, libc::ETIMEDOUT));
        let text = e.to_string();
        assert!(
            text.contains("head marker") && text.contains("\"d/\""),
            "{text}"
        );
    }

    #[test]
    fn raw_answers_map_like_object_stores() {
        let raw = |status: u16, body: &str| {
            let status = http::StatusCode::from_u16(status).unwrap();
            ObjectError::answer("put marker", "d/", status, body.into()).errno()
        };
        for (status, body, errno) in [
            (400, "<Code>InvalidArgument</Code>", libc::EINVAL),
            (400, "<Code>KeyTooLong</Code>", libc::EINVAL),
            (400, "<Code>BadDigest</Code>", libc::EIO),
            (401, "", libc::EACCES),
            (403, "", libc::EACCES),
            (404, "", libc::ENOENT),
            (405, "", libc::EOPNOTSUPP),
            (501, "", libc::EOPNOTSUPP),
            (409, "", libc::EEXIST),
            (412, "", libc::ESTALE),
            (429, "", libc::EAGAIN),
            (503, "<Code>SlowDown</Code>", libc::EAGAIN),
            (500, "<Code>SlowDown</Code>", libc::EAGAIN),
            (504, "", libc::ETIMEDOUT),
            (500, "", libc::EIO),
        ] {
            assert_eq!(raw(status, body), errno, "{status} {body}");
            let text = format!("{} {body}", http::StatusCode::from_u16(status).unwrap());
            let store = ObjectError::store("get", "k", answered(&text));
            assert_eq!(store.status, Some(status));
            if !matches!(status, 401 | 403 | 404 | 409 | 412) {
                // (those object_store gives kinds of their own, tested with errno_of)
                assert_eq!(store.errno(), errno, "object_store's {status} {body}");
            }
        }
    }

    #[test]
    fn a_range_past_the_end_is_told_apart() {
        let e = ObjectError::store("get", "k", answered("416 Range Not Satisfiable: "));
        assert!(e.range_not_satisfiable());
        let e = ObjectError::store(
            "get",
            "k",
            generic("Server returned error response: <Code>InvalidRange</Code>"),
        );
        assert!(e.range_not_satisfiable());
        // A key that reads like the code is not an answer.
        let e = ObjectError::store(
            "get",
            "InvalidRange",
            answered("500 Internal Server Error: "),
        );
        assert!(!e.range_not_satisfiable());
    }

    #[test]
    fn the_conversion_keeps_the_errno() {
        let e = ObjectError::answer("head marker", "d/", http::StatusCode::NOT_FOUND, "".into());
        assert_eq!(io::Error::from(e).raw_os_error(), Some(libc::ENOENT));
    }
}

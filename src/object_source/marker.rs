//! Requests `object_store` cannot express (keys ending in `/`, metadata rewritten in place):
//! signed with its `AwsAuthorizer` and sent through its HTTP client, with retries; marker objects.

use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderName, HeaderValue, Method, StatusCode};
use object_store::aws::AwsAuthorizer;
use object_store::client::{HttpErrorKind, HttpRequestBody};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

use super::error::{ObjectError, errno};
use super::meta::{meta_from, meta_pairs};
use super::{ObjKind, ObjMeta, ObjStat, ObjectSource};

/// Everything but unreserved characters and `/`, as `object_store` encodes paths (the
/// signature covers the encoded path, so both must agree).
pub(super) const PATH_ENCODE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'/');

impl ObjectSource {
    pub(super) fn put_marker(&self, key: &str, meta: &ObjMeta) -> io::Result<()> {
        let pairs = meta_pairs(meta, ObjKind::Dir);
        let owned: Vec<(String, String)> = pairs
            .into_iter()
            .map(|(k, v)| (format!("x-amz-meta-{k}"), v))
            .collect();
        let headers = owned.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        self.raw_request("put marker", Method::PUT, &format!("{key}/"), headers)
            .map(|_| ())
    }

    pub(super) fn marker_head(&self, key: &str) -> io::Result<ObjStat> {
        let h = self.raw_request("head marker", Method::HEAD, &format!("{key}/"), Vec::new())?;
        let get = |k: &str| {
            h.get(format!("x-amz-meta-{k}").as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let meta = meta_from(get);
        let last_modified = h
            .get(http::header::LAST_MODIFIED)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_http_date)
            .unwrap_or(UNIX_EPOCH);
        Ok(ObjStat::dir(meta, last_modified, true))
    }

    /// One signed request for `key` (which may end in '/'), with object_store's signer and
    /// HTTP client, retried like object_store's own on 5xx, 429 and connection errors.
    /// Returns the response headers; `op` names the request in errors.
    pub(super) fn raw_request(
        &self,
        op: &'static str,
        method: Method,
        key: &str,
        headers: Vec<(&str, String)>,
    ) -> io::Result<http::HeaderMap> {
        let url = format!(
            "{}/{}",
            self.bucket_endpoint,
            utf8_percent_encode(key, PATH_ENCODE)
        );
        let mut hv = Vec::new();
        for (k, v) in headers {
            let name = HeaderName::from_bytes(k.as_bytes()).map_err(|_| errno(libc::EINVAL))?;
            let value = HeaderValue::from_str(&v).map_err(|_| errno(libc::EINVAL))?;
            hv.push((name, value));
        }
        self.block(async {
            let mut attempt = 0;
            let mut backoff = Duration::from_millis(100);
            loop {
                let cred = self
                    .store
                    .credentials()
                    .get_credential()
                    .await
                    .map_err(|e| ObjectError::store("credentials", key, e))?;
                let mut req = http::Request::builder()
                    .method(method.clone())
                    .uri(&url)
                    .body(HttpRequestBody::from(Vec::new()))
                    .map_err(|_| errno(libc::EINVAL))?;
                for (k, v) in &hv {
                    req.headers_mut().insert(k.clone(), v.clone());
                }
                req.headers_mut()
                    .insert(http::header::CONTENT_LENGTH, HeaderValue::from_static("0"));
                AwsAuthorizer::new(&cred, "s3", &self.region)
                    .try_authorize(&mut req, None)
                    .map_err(|e| ObjectError::store("sign", key, e))?;
                let failed = match self.http.execute(req).await {
                    Ok(resp) => {
                        let status = resp.status();
                        if status.is_success() {
                            return Ok(resp.headers().clone());
                        }
                        let body = match method {
                            Method::HEAD => String::new(),
                            _ => resp
                                .into_body()
                                .bytes()
                                .await
                                .map(|b| String::from_utf8_lossy(&b).into_owned())
                                .unwrap_or_default(),
                        };
                        // A copy whose answer is 200 with an error body is not seen here
                        // (copies of markers never happen; a self-copy's errors are 4xx).
                        let retry =
                            status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
                        let failed = ObjectError::answer(op, key, status, body);
                        if !retry || attempt >= self.opts.max_retries {
                            return Err(failed.into());
                        }
                        failed
                    }
                    Err(e) => {
                        let retry =
                            matches!(e.kind(), HttpErrorKind::Connect | HttpErrorKind::Request)
                                || (method == Method::HEAD && e.kind() == HttpErrorKind::Timeout);
                        let failed = ObjectError::transport(op, key, e);
                        if !retry || attempt >= self.opts.max_retries {
                            return Err(failed.into());
                        }
                        failed
                    }
                };
                tracing::debug!(attempt, "{failed}; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                attempt += 1;
            }
        })
    }
}

/// RFC 7231 IMF-fixdate, as S3 sends Last-Modified ("Sun, 06 Nov 1994 08:49:37 GMT"): the
/// RFC 2822 form with the zone written `GMT`.
pub(super) fn parse_http_date(s: &str) -> Option<SystemTime> {
    if !s.trim_end().ends_with(" GMT") {
        return None;
    }
    chrono::DateTime::parse_from_rfc2822(s)
        .ok()
        .map(SystemTime::from)
}

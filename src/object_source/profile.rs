//! Credentials, region and endpoint from the environment and the AWS profile files,
//! resolved the way the AWS CLI does.

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;

use super::Credentials;

/// Sections of an AWS INI file (`[default]`, `[profile NAME]`, `[NAME]`) to lower-case keys
/// and values. Nested blocks (`s3 =` followed by indented lines) become `s3.key`.
pub fn parse_ini(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut out: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut section: Option<String> = None;
    let mut nested: Option<String> = None;
    for raw in text.lines() {
        let indented = raw.starts_with([' ', '\t']);
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
            out.entry(name.clone()).or_default();
            section = Some(name);
            nested = None;
            continue;
        }
        let (Some(sec), Some((k, v))) = (&section, line.split_once('=')) else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_string());
        let map = out.entry(sec.clone()).or_default();
        match (&nested, indented) {
            (Some(parent), true) => {
                map.insert(format!("{parent}.{k}"), v);
            }
            _ if v.is_empty() => nested = Some(k),
            _ => {
                nested = None;
                map.insert(k, v);
            }
        }
    }
    out
}

/// What the environment and profile files say, resolved the way the AWS CLI does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResolvedConfig {
    pub credentials: Option<Credentials>,
    pub region: Option<String>,
    pub endpoint: Option<String>,
}

/// `env` is the process environment in production (a map in tests). Credentials: the
/// `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` pair, else the profile (`profile`, else
/// `AWS_PROFILE`, else `default`) from `AWS_SHARED_CREDENTIALS_FILE` (~/.aws/credentials,
/// `[NAME]`) then `AWS_CONFIG_FILE` (~/.aws/config, `[profile NAME]`, `[default]`). A profile
/// named explicitly that neither file has is an error; no `default` means None (object_store's
/// chain then tries web identity, ECS and instance metadata). Without keys in the environment,
/// a profile that gets its credentials another way (`UNSUPPORTED_PROFILE_KEYS`) is an error.
pub fn resolve_config(
    profile: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ResolvedConfig, String> {
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty());
    let home = nonempty("HOME").map(PathBuf::from);
    let file = |var: &str, default: &str| -> Option<PathBuf> {
        nonempty(var)
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(default)))
    };
    let read = |p: Option<PathBuf>| -> Result<HashMap<String, HashMap<String, String>>, String> {
        match p {
            None => Ok(HashMap::new()),
            Some(p) => match std::fs::read_to_string(&p) {
                Ok(t) => Ok(parse_ini(&t)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(HashMap::new()),
                Err(e) => Err(format!("{}: {e}", p.display())),
            },
        }
    };
    let creds_file = read(file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"))?;
    let config_file = read(file("AWS_CONFIG_FILE", ".aws/config"))?;

    let explicit = profile
        .map(str::to_string)
        .or_else(|| nonempty("AWS_PROFILE"));
    let name = explicit.clone().unwrap_or_else(|| "default".to_string());
    let from_creds = creds_file.get(&name);
    let from_config = config_file.get(&format!("profile {name}")).or_else(|| {
        (name == "default")
            .then(|| config_file.get("default"))
            .flatten()
    });
    if explicit.is_some() && from_creds.is_none() && from_config.is_none() {
        return Err(format!(
            "AWS profile {name:?} is in neither the credentials nor the config file"
        ));
    }
    let get = |k: &str| -> Option<String> {
        from_creds
            .and_then(|m| m.get(k))
            .or_else(|| from_config.and_then(|m| m.get(k)))
            .filter(|v| !v.is_empty())
            .cloned()
    };

    let credentials = match (
        nonempty("AWS_ACCESS_KEY_ID"),
        nonempty("AWS_SECRET_ACCESS_KEY"),
    ) {
        (Some(id), Some(secret)) => Some(Credentials {
            access_key_id: id,
            secret_access_key: secret,
            session_token: nonempty("AWS_SESSION_TOKEN"),
        }),
        _ if let Some(why) = unusable_profile(&name, from_creds, from_config) => {
            return Err(why);
        }
        _ => match (get("aws_access_key_id"), get("aws_secret_access_key")) {
            (Some(id), Some(secret)) => Some(Credentials {
                access_key_id: id,
                secret_access_key: secret,
                session_token: get("aws_session_token"),
            }),
            _ => None,
        },
    };
    Ok(ResolvedConfig {
        credentials,
        region: nonempty("AWS_REGION")
            .or_else(|| nonempty("AWS_DEFAULT_REGION"))
            .or_else(|| get("region")),
        // AWS_ENDPOINT is object_store's own name for it.
        endpoint: nonempty("AWS_ENDPOINT_URL_S3")
            .or_else(|| nonempty("AWS_ENDPOINT_URL"))
            .or_else(|| nonempty("AWS_ENDPOINT"))
            .or_else(|| get("s3.endpoint_url"))
            .or_else(|| get("endpoint_url")),
    })
}

/// Profile keys that name a credential source hoardfs does not implement: it reads only
/// static keys from the profile files. The AWS CLI prefers each of these to the profile's
/// static keys, except `credential_process`, which comes after the keys of the credentials
/// file (botocore's chain: environment, assume role, web identity, SSO, credentials file,
/// process, config file).
const UNSUPPORTED_PROFILE_KEYS: [(&str, &str); 9] = [
    // First: its profile names a `role_arn` too.
    ("web_identity_token_file", "web identity"),
    ("role_arn", "an assumed role"),
    ("source_profile", "an assumed role"),
    ("credential_source", "an assumed role"),
    ("sso_session", "IAM Identity Center (SSO)"),
    ("sso_start_url", "IAM Identity Center (SSO)"),
    ("sso_account_id", "IAM Identity Center (SSO)"),
    ("sso_role_name", "IAM Identity Center (SSO)"),
    ("credential_process", "an external process"),
];

/// Why the profile `name` cannot give hoardfs its credentials, when the AWS CLI would take
/// them from a source hoardfs does not implement (`UNSUPPORTED_PROFILE_KEYS`): a mount
/// that silently used other keys, or none, would fail later and obscurely.
fn unusable_profile(
    name: &str,
    from_creds: Option<&HashMap<String, String>>,
    from_config: Option<&HashMap<String, String>>,
) -> Option<String> {
    let has = |m: Option<&HashMap<String, String>>, k: &str| {
        m.and_then(|m| m.get(k)).is_some_and(|v| !v.is_empty())
    };
    let static_in_creds =
        has(from_creds, "aws_access_key_id") && has(from_creds, "aws_secret_access_key");
    let (key, what) = UNSUPPORTED_PROFILE_KEYS.into_iter().find(|(k, _)| {
        (has(from_creds, k) || has(from_config, k))
            && !(*k == "credential_process" && static_in_creds)
    })?;
    let instead = if key == "web_identity_token_file" {
        "set AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN in hoardfs's environment instead \
         (read and refreshed by the S3 client)"
            .to_string()
    } else {
        format!(
            "give hoardfs static keys instead: a profile with aws_access_key_id and \
             aws_secret_access_key (chosen with AWS_PROFILE), or AWS_ACCESS_KEY_ID, \
             AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN in its environment, e.g. from \
             `aws configure export-credentials --profile {name} --format env` (temporary \
             keys expire, and the mount's requests fail then)"
        )
    };
    Some(format!(
        "AWS profile {name:?} gets its credentials from {what} ({key}), which hoardfs \
         cannot use; {instead}"
    ))
}

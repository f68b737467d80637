//! Where an image may be fetched from: the address, scheme and domain policy, pure and checked on every hop.
//!
//! An image URL is a request to make the server connect somewhere, so by default only public unicast addresses
//! are reachable. The operator widens that with `--allow-private-media-urls` (loopback, private, link-local) or,
//! precisely, `--allowed-media-networks`; cloud-metadata and reserved addresses yield only to the latter.

use super::addr::{Class, classify, embedded_v4};
use ipnet::IpNet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use url::Url;

/// Why a URL or address is refused: the error code and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub code: &'static str,
    pub message: String,
}

impl Refusal {
    fn new(code: &'static str, message: impl Into<String>) -> Self {
        Refusal { code, message: message.into() }
    }
}

/// A `--allowed-media-domains` entry: a host, or `*.suffix` for every subdomain of suffix.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Domain {
    Exact(String),
    Subdomains(String),
}

fn normalize_host(host: &str) -> String {
    host.trim().trim_end_matches('.').trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase()
}

fn parse_domain(entry: &str) -> Result<Domain, String> {
    let host = normalize_host(entry);
    let bad =
        host.is_empty() || host.contains(['/', '@', ' ']) || (host.contains(':') && host.parse::<IpAddr>().is_err());
    if bad {
        return Err(format!("--allowed-media-domains: '{entry}' is not a host name (no scheme, port or path)"));
    }
    Ok(match host.strip_prefix("*.") {
        Some(suffix) if !suffix.is_empty() && !suffix.contains('*') => Domain::Subdomains(suffix.to_string()),
        _ if host.contains('*') => {
            return Err(format!("--allowed-media-domains: '{entry}': only a leading '*.' is a pattern"));
        }
        _ => Domain::Exact(host),
    })
}

/// The whole policy, built once at start-up.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub allow_private: bool,
    networks: Vec<IpNet>,
    domains: Vec<Domain>,
    /// The canonical `--allowed-local-media-path`; `None` refuses `file://`.
    pub local_root: Option<PathBuf>,
}

impl Policy {
    pub fn new(
        allow_private: bool,
        networks: &[String],
        domains: &[String],
        local_root: Option<&str>,
    ) -> Result<Self, String> {
        let networks = split(networks)
            .map(|n| {
                n.parse::<IpNet>().map(|net| net.trunc()).or_else(|_| n.parse::<IpAddr>().map(IpNet::from)).map_err(
                    |_| format!("--allowed-media-networks: '{n}' is not a CIDR such as 10.0.0.0/8 or fd00::/8"),
                )
            })
            .collect::<Result<_, _>>()?;
        let domains = split(domains).map(parse_domain).collect::<Result<_, _>>()?;
        let local_root = local_root
            .map(|dir| {
                let root = std::fs::canonicalize(dir)
                    .map_err(|e| format!("--allowed-local-media-path: cannot open '{dir}': {e}"))?;
                root.is_dir().then_some(root).ok_or(format!("--allowed-local-media-path: '{dir}' is not a directory"))
            })
            .transpose()?;
        Ok(Policy { allow_private, networks, domains, local_root })
    }

    /// The allowed networks that hold a cloud-metadata address (worth a start-up warning).
    pub fn networks_with_metadata(&self) -> impl Iterator<Item = &IpNet> {
        let metadata = [IpAddr::from([169, 254, 169, 254]), IpAddr::from([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254])];
        self.networks.iter().filter(move |n| metadata.iter().any(|m| n.contains(m)))
    }

    fn in_networks(&self, ip: IpAddr) -> bool {
        let v4 = match ip {
            IpAddr::V6(v6) => embedded_v4(v6).map(IpAddr::V4),
            IpAddr::V4(_) => None,
        };
        self.networks.iter().any(|n| n.contains(&ip) || v4.is_some_and(|v4| n.contains(&v4)))
    }

    /// May the server connect to `ip`? The refusal's message names the class, for IP literals only (for a name
    /// the caller says less: the resolved address is the server's knowledge, not the client's).
    pub fn check_ip(&self, ip: IpAddr) -> Result<(), Refusal> {
        if self.in_networks(ip) {
            return Ok(());
        }
        let why = match classify(ip) {
            Class::Public => return Ok(()),
            Class::Private(_) if self.allow_private => return Ok(()),
            Class::Private(what) => format!(
                "{what} addresses are refused unless the server is started with --allow-private-media-urls or \
                 --allowed-media-networks"
            ),
            Class::Metadata => "cloud-metadata addresses are refused unless in --allowed-media-networks".to_string(),
            Class::Reserved(what) => format!("{what} addresses are refused unless in --allowed-media-networks"),
        };
        Err(Refusal::new("image_url_refused", format!("The image URL's address {ip} is refused: {why}.")))
    }

    /// Is `host` (a URL's host, as the url crate spells it) on the domain allowlist? An empty list allows all.
    pub fn domain_allowed(&self, host: &str) -> bool {
        let host = normalize_host(host);
        self.domains.is_empty()
            || self.domains.iter().any(|d| match d {
                Domain::Exact(h) => *h == host,
                Domain::Subdomains(s) => host.strip_suffix(s.as_str()).is_some_and(|rest| rest.ends_with('.')),
            })
    }

    /// An http(s) URL, the first one or a redirect hop: scheme, domain allowlist, and an IP-literal host (which
    /// no DNS resolver sees, so the resolver's filter cannot catch it).
    pub fn check_url(&self, url: &Url) -> Result<(), Refusal> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(scheme_refusal(url.scheme()));
        }
        let Some(host) = url.host() else {
            return Err(Refusal::new("image_url_invalid", "The image URL has no host."));
        };
        if !self.domain_allowed(&host.to_string()) {
            return Err(Refusal::new(
                "image_url_refused",
                format!("The image host '{host}' is not in the server's --allowed-media-domains."),
            ));
        }
        match host {
            url::Host::Ipv4(ip) => self.check_ip(IpAddr::V4(ip)),
            url::Host::Ipv6(ip) => self.check_ip(IpAddr::V6(ip)),
            url::Host::Domain(_) => Ok(()),
        }
    }
}

pub fn scheme_refusal(scheme: &str) -> Refusal {
    let (code, why) = match scheme {
        "file" => (
            "image_url_refused",
            "file:// URLs are refused unless the server is started with --allowed-local-media-path",
        ),
        _ => ("image_scheme_unsupported", "only http, https and data image URLs are supported"),
    };
    Refusal::new(code, format!("The image URL's scheme '{scheme}' is refused: {why}."))
}

/// Is the canonical `path` (symlinks resolved) inside the canonical `root`? Components compare, so `/a/bc` is
/// not inside `/a/b`.
pub fn within_root(root: &Path, path: &Path) -> bool {
    path.starts_with(root) && path != root
}

/// The path a `file://` URL names, if it lies under `root` as written (no `..`, which a decoded `%2f` could
/// still bring in). Symlinks are the reader's to check, on the canonical path.
pub fn local_path(root: &Path, url: &Url) -> Result<PathBuf, Refusal> {
    let outside =
        || Refusal::new("image_url_refused", "The image file is outside the server's --allowed-local-media-path.");
    let path = url.to_file_path().map_err(|()| outside())?;
    let climbs = path.components().any(|c| c == std::path::Component::ParentDir);
    if climbs || !within_root(root, &path) { Err(outside()) } else { Ok(path) }
}

/// Entries given either as separate words or comma separated.
fn split(items: &[String]) -> impl Iterator<Item = &str> {
    items.iter().flat_map(|s| s.split(',')).map(str::trim).filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn policy(private: bool, networks: &[&str], domains: &[&str]) -> Policy {
        let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        Policy::new(private, &own(networks), &own(domains), None).unwrap()
    }

    #[test]
    fn policy_widening() {
        let strict = policy(false, &[], &[]);
        let private = policy(true, &[], &[]);
        let nets = policy(false, &["127.0.0.2/32", "10.0.0.0/8", "169.254.169.254", "fd00::/8"], &[]);
        for (addr, s, p, n) in [
            ("8.8.8.8", true, true, true),
            ("127.0.0.1", false, true, false),
            ("127.0.0.2", false, true, true),
            ("::ffff:127.0.0.2", false, true, true),
            ("10.9.9.9", false, true, true),
            ("192.168.0.1", false, true, false),
            ("fe80::1", false, true, false),
            ("fd01::1", false, true, true),
            ("169.254.169.254", false, false, true),
            ("::ffff:169.254.169.254", false, false, true),
            ("100.100.100.200", false, false, false),
            ("fd00:ec2::254", false, false, true),
            ("0.0.0.0", false, false, false),
            ("::", false, false, false),
            ("224.0.0.1", false, false, false),
        ] {
            assert_eq!(strict.check_ip(ip(addr)).is_ok(), s, "strict {addr}");
            assert_eq!(private.check_ip(ip(addr)).is_ok(), p, "private {addr}");
            assert_eq!(nets.check_ip(ip(addr)).is_ok(), n, "networks {addr}");
        }
        let e = strict.check_ip(ip("127.0.0.1")).unwrap_err();
        assert!(e.message.contains("loopback") && e.message.contains("--allow-private-media-urls"), "{e}");
        assert_eq!(e.code, "image_url_refused");
        assert_eq!(nets.networks_with_metadata().count(), 2, "169.254.169.254/32 and fd00::/8");
    }

    #[test]
    fn ip_literals_in_every_spelling_are_checked() {
        let strict = policy(false, &[], &[]);
        for url in [
            "http://127.0.0.1/a.png",
            "http://2130706433/",
            "http://0x7f.1/",
            "http://0177.0.0.1/",
            "http://127.1/",
            "http://127.0.0.1./",
            "http://0/",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:7f00:1]/",
            "http://[0:0:0:0:0:ffff:a9fe:a9fe]/latest/meta-data/",
            "http://169.254.169.254/latest/meta-data/",
            "https://[fd00:ec2::254]/",
            "http://[fe80::1%25eth0]/",
        ] {
            let Ok(u) = Url::parse(url) else { continue }; // a zone id does not parse: never fetched either
            let e = strict.check_url(&u).expect_err(url);
            assert_eq!(e.code, "image_url_refused", "{url}");
        }
        for url in ["https://example.com/a.png", "http://8.8.8.8/", "http://[2606:4700::1111]/"] {
            strict.check_url(&Url::parse(url).unwrap()).expect(url);
        }
    }

    #[test]
    fn schemes() {
        let strict = policy(false, &[], &[]);
        for (url, code) in [
            ("ftp://example.com/a.png", "image_scheme_unsupported"),
            ("gopher://example.com/", "image_scheme_unsupported"),
            ("file:///etc/passwd", "image_url_refused"),
            ("data:image/png;base64,AAAA", "image_scheme_unsupported"),
        ] {
            assert_eq!(strict.check_url(&Url::parse(url).unwrap()).unwrap_err().code, code, "{url}");
        }
    }

    #[test]
    fn domain_allowlist() {
        let p = policy(false, &[], &["Images.Example.com", "*.cdn.example.org,upload.wikimedia.org", "127.0.0.2"]);
        for (host, ok) in [
            ("images.example.com", true),
            ("IMAGES.EXAMPLE.COM", true),
            ("images.example.com.", true),
            ("example.com", false),
            ("evil-images.example.com", false),
            ("images.example.com.evil.net", false),
            ("a.cdn.example.org", true),
            ("a.b.cdn.example.org", true),
            ("cdn.example.org", false),
            ("xcdn.example.org", false),
            ("upload.wikimedia.org", true),
            ("127.0.0.2", true),
        ] {
            assert_eq!(p.domain_allowed(host), ok, "{host}");
        }
        // Every hop is checked the same way: a redirect to another host is refused.
        assert!(p.check_url(&Url::parse("https://images.example.com/x").unwrap()).is_ok());
        let e = p.check_url(&Url::parse("https://other.example.com/x").unwrap()).unwrap_err();
        assert!(e.message.contains("--allowed-media-domains"), "{e}");
        // An allowed domain does not lift the address check.
        assert!(p.check_url(&Url::parse("http://127.0.0.2/x").unwrap()).is_err());
        assert!(policy(false, &[], &[]).domain_allowed("anything.example"));
    }

    #[test]
    fn bad_options_are_start_up_errors() {
        let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(Policy::new(false, &own(&["10.0.0.0/33"]), &[], None).unwrap_err().contains("10.0.0.0/33"));
        assert!(Policy::new(false, &own(&["example.com"]), &[], None).is_err());
        for bad in ["https://example.com", "example.com/x", "a.*.example.com", "*", "example.com:8080"] {
            assert!(Policy::new(false, &[], &own(&[bad]), None).is_err(), "{bad}");
        }
        assert!(Policy::new(false, &[], &[], Some("/nonexistent/dir")).is_err());
        let file = tempfile::NamedTempFile::new().unwrap();
        assert!(Policy::new(false, &[], &[], Some(file.path().to_str().unwrap())).is_err());
        // Host bits are dropped: 10.1.2.3/8 is 10.0.0.0/8.
        let p = Policy::new(false, &own(&["10.1.2.3/8"]), &[], None).unwrap();
        assert!(p.check_ip(ip("10.200.0.1")).is_ok());
    }

    #[test]
    fn root_containment_compares_components() {
        let root = Path::new("/srv/images");
        assert!(within_root(root, Path::new("/srv/images/a.png")));
        assert!(within_root(root, Path::new("/srv/images/sub/a.png")));
        assert!(!within_root(root, Path::new("/srv/images")));
        assert!(!within_root(root, Path::new("/srv/images2/a.png")));
        assert!(!within_root(root, Path::new("/etc/passwd")));
        let path = |u: &str| local_path(root, &Url::parse(u).unwrap());
        assert_eq!(path("file:///srv/images/a/b.png"), Ok(PathBuf::from("/srv/images/a/b.png")));
        assert_eq!(path("file://localhost/srv/images/a.png"), Ok(PathBuf::from("/srv/images/a.png")));
        for escape in [
            "file:///srv/images/../x",
            "file:///srv/images/%2e%2e/x",
            "file:///srv/images/..%2fx",
            "file:///srv/images",
            "file:///srv/images2/a.png",
            "file://other-host/srv/images/a.png",
        ] {
            assert_eq!(path(escape).unwrap_err().code, "image_url_refused", "{escape}");
        }
    }
}

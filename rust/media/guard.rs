//! Where an image may be fetched from: the address, scheme and domain policy, pure and checked on every hop.
//!
//! An image URL is a request to make the server connect somewhere, so by default only public unicast addresses
//! are reachable. The operator widens that with `--allow-private-media-urls` (loopback, private, link-local) or,
//! precisely, `--allowed-media-networks`; cloud-metadata and reserved addresses yield only to the latter.

use ipnet::IpNet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use url::Url;

/// What an address is, for the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Public,
    /// Not public but a real destination (loopback, RFC 1918, CGNAT, link-local, unique local).
    Private(&'static str),
    /// A cloud provider's instance metadata or host service: credentials live there.
    Metadata,
    /// Never a place to fetch from (unspecified, multicast, documentation, reserved ...).
    Reserved(&'static str),
}

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

fn in4(ip: Ipv4Addr, net: [u8; 4], prefix: u32) -> bool {
    let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
    u32::from(ip) & mask == u32::from(Ipv4Addr::from(net)) & mask
}

fn in6(ip: Ipv6Addr, net: [u16; 8], prefix: u32) -> bool {
    let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
    u128::from(ip) & mask == u128::from(Ipv6Addr::from(net)) & mask
}

/// IPv4 special ranges (IANA's special-purpose registry), first match wins: metadata before the range holding it.
const V4: &[([u8; 4], u32, Class)] = &[
    ([0, 0, 0, 0], 32, Class::Reserved("unspecified")), // Linux connects 0.0.0.0 to the local host
    ([0, 0, 0, 0], 8, Class::Reserved("this-network")),
    ([10, 0, 0, 0], 8, Class::Private("private")),
    ([100, 100, 100, 200], 32, Class::Metadata), // Alibaba Cloud
    ([100, 64, 0, 0], 10, Class::Private("shared (CGNAT)")),
    ([127, 0, 0, 0], 8, Class::Private("loopback")),
    ([169, 254, 169, 0], 24, Class::Metadata), // AWS, GCP, Azure, OCI, DigitalOcean, OpenStack (.254) and AWS DNS/NTP
    ([169, 254, 170, 0], 24, Class::Metadata), // AWS ECS task metadata (.2, .23)
    ([169, 254, 0, 23], 32, Class::Metadata),  // Tencent Cloud
    ([169, 254, 0, 0], 16, Class::Private("link-local")),
    ([172, 16, 0, 0], 12, Class::Private("private")),
    ([192, 0, 0, 192], 32, Class::Metadata), // Oracle Cloud (legacy)
    ([192, 0, 0, 0], 24, Class::Reserved("IETF protocol assignment")),
    ([192, 0, 2, 0], 24, Class::Reserved("documentation")),
    ([192, 88, 99, 0], 24, Class::Reserved("6to4 relay anycast")),
    ([192, 168, 0, 0], 16, Class::Private("private")),
    ([198, 18, 0, 0], 15, Class::Reserved("benchmarking")),
    ([198, 51, 100, 0], 24, Class::Reserved("documentation")),
    ([203, 0, 113, 0], 24, Class::Reserved("documentation")),
    ([168, 63, 129, 16], 32, Class::Metadata), // Azure WireServer: a public address every Azure VM reaches
    ([224, 0, 0, 0], 4, Class::Reserved("multicast")),
    ([255, 255, 255, 255], 32, Class::Reserved("broadcast")),
    ([240, 0, 0, 0], 4, Class::Reserved("reserved")),
];

pub fn classify_v4(ip: Ipv4Addr) -> Class {
    V4.iter().find(|(net, prefix, _)| in4(ip, *net, *prefix)).map_or(Class::Public, |(_, _, c)| *c)
}

/// The IPv4 address an IPv6 address stands for, where the packet really goes there: IPv4-mapped (the socket
/// connects over IPv4), NAT64's well-known prefix (the translator does) and 6to4 (the relay does).
pub fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let bits = u128::from(ip);
    if in6(ip, [0, 0, 0, 0, 0, 0xffff, 0, 0], 96) || in6(ip, [0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96) {
        return Some(Ipv4Addr::from(bits as u32));
    }
    in6(ip, [0x2002, 0, 0, 0, 0, 0, 0, 0], 16).then(|| Ipv4Addr::from((bits >> 80) as u32))
}

/// IPv6 special ranges, first match wins; what remains of 2000::/3 is public, the rest of the space reserved.
const V6: &[([u16; 8], u32, Class)] = &[
    ([0, 0, 0, 0, 0, 0, 0, 0], 128, Class::Reserved("unspecified")),
    ([0, 0, 0, 0, 0, 0, 0, 1], 128, Class::Private("loopback")),
    ([0, 0, 0, 0, 0, 0, 0, 0], 96, Class::Reserved("IPv4-compatible (deprecated)")),
    ([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48, Class::Private("local-use NAT64")),
    ([0x100, 0, 0, 0, 0, 0, 0, 0], 64, Class::Reserved("discard")),
    ([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32, Class::Reserved("documentation")),
    ([0x2001, 0, 0, 0, 0, 0, 0, 0], 23, Class::Reserved("IETF protocol assignment (Teredo, benchmarking ...)")),
    ([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20, Class::Reserved("documentation")),
    ([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0], 32, Class::Metadata), // AWS instance services (metadata fd00:ec2::254)
    ([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7, Class::Private("unique local")),
    ([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10, Class::Private("link-local")),
    ([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10, Class::Private("site-local (deprecated)")),
    ([0xff00, 0, 0, 0, 0, 0, 0, 0], 8, Class::Reserved("multicast")),
];

pub fn classify(ip: IpAddr) -> Class {
    let ip = match ip {
        IpAddr::V4(v4) => return classify_v4(v4),
        IpAddr::V6(v6) => v6,
    };
    if let Some(v4) = embedded_v4(ip) {
        return classify_v4(v4);
    }
    if let Some((_, _, c)) = V6.iter().find(|(net, prefix, _)| in6(ip, *net, *prefix)) {
        return *c;
    }
    if in6(ip, [0x2000, 0, 0, 0, 0, 0, 0, 0], 3) { Class::Public } else { Class::Reserved("not global unicast") }
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
    fn every_address_class() {
        let cases = [
            ("8.8.8.8", Class::Public),
            ("1.1.1.1", Class::Public),
            ("100.63.255.255", Class::Public),
            ("100.128.0.0", Class::Public),
            ("172.32.0.1", Class::Public),
            ("0.0.0.0", Class::Reserved("unspecified")),
            ("0.1.2.3", Class::Reserved("this-network")),
            ("10.1.2.3", Class::Private("private")),
            ("172.16.0.1", Class::Private("private")),
            ("172.31.255.255", Class::Private("private")),
            ("192.168.1.1", Class::Private("private")),
            ("100.64.0.1", Class::Private("shared (CGNAT)")),
            ("100.127.255.255", Class::Private("shared (CGNAT)")),
            ("127.0.0.1", Class::Private("loopback")),
            ("127.255.255.254", Class::Private("loopback")),
            ("169.254.1.1", Class::Private("link-local")),
            ("169.254.169.254", Class::Metadata),
            ("169.254.170.2", Class::Metadata),
            ("100.100.100.200", Class::Metadata),
            ("168.63.129.16", Class::Metadata),
            ("192.0.0.192", Class::Metadata),
            ("192.0.0.8", Class::Reserved("IETF protocol assignment")),
            ("192.0.2.1", Class::Reserved("documentation")),
            ("198.51.100.1", Class::Reserved("documentation")),
            ("203.0.113.1", Class::Reserved("documentation")),
            ("198.18.0.1", Class::Reserved("benchmarking")),
            ("224.0.0.1", Class::Reserved("multicast")),
            ("239.255.255.250", Class::Reserved("multicast")),
            ("240.0.0.1", Class::Reserved("reserved")),
            ("255.255.255.255", Class::Reserved("broadcast")),
            ("2606:4700::1111", Class::Public),
            ("2a00:1450:4001::1", Class::Public),
            ("::", Class::Reserved("unspecified")),
            ("::1", Class::Private("loopback")),
            ("fc00::1", Class::Private("unique local")),
            ("fd12:3456::1", Class::Private("unique local")),
            ("fd00:ec2::254", Class::Metadata),
            ("fe80::1", Class::Private("link-local")),
            ("fec0::1", Class::Private("site-local (deprecated)")),
            ("ff02::1", Class::Reserved("multicast")),
            ("2001:db8::1", Class::Reserved("documentation")),
            ("3fff::1", Class::Reserved("documentation")),
            ("2001::1", Class::Reserved("IETF protocol assignment (Teredo, benchmarking ...)")),
            ("100::1", Class::Reserved("discard")),
            ("4000::1", Class::Reserved("not global unicast")),
            // IPv4-mapped, NAT64 and 6to4 stand for their IPv4 address.
            ("::ffff:127.0.0.1", Class::Private("loopback")),
            ("::ffff:8.8.8.8", Class::Public),
            ("::ffff:169.254.169.254", Class::Metadata),
            ("64:ff9b::7f00:1", Class::Private("loopback")),
            ("64:ff9b::a9fe:a9fe", Class::Metadata),
            ("64:ff9b::808:808", Class::Public),
            ("64:ff9b:1::1", Class::Private("local-use NAT64")),
            ("2002:7f00:1::1", Class::Private("loopback")),
            ("2002:808:808::1", Class::Public),
            ("::127.0.0.1", Class::Reserved("IPv4-compatible (deprecated)")),
        ];
        for (addr, want) in cases {
            assert_eq!(classify(ip(addr)), want, "{addr}");
        }
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

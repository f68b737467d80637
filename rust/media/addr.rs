//! What an address is: the special-purpose ranges (IANA's registries) the fetch policy (`guard`) decides on, and the
//! IPv4 address an IPv6 one stands for where the packet really goes there.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
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
}

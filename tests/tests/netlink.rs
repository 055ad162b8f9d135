//! The agent's netlink dumps in a namespace built for them: links with their
//! kind and bridge master, IPv4 and IPv6 addresses per link, routes with
//! their prefix and output interface, and link notifications.

use std::net::IpAddr;

use dataplane_agent::os::interfaces::{ChangeWatch, RouteType, addresses, links, route_to, routes};
use dataplane_tests::{netns::NetNs, unique_prefix};

#[test]
fn links_addresses_routes_and_notifications_come_from_netlink() {
    dataplane_tests::require_privileges();
    let ns = NetNs::new(&format!("{}-nl", unique_prefix()));
    ns.ip_batch(
        "link add br0 type bridge\n\
         link add veth0 type veth peer name veth1\n\
         link set veth0 master br0\n\
         link set br0 up\nlink set veth0 up\nlink set veth1 up\n\
         addr add 10.244.1.1/24 dev br0\n\
         addr add fd00:1::1/64 dev br0 nodad\n\
         route add 10.244.7.0/24 dev veth1\n",
    );
    let (links, addrs, routes) = ns.run(|| (links().unwrap(), addresses().unwrap(), routes().unwrap()));
    let link = |name: &str| {
        links
            .iter()
            .find(|l| l.name == name)
            .unwrap_or_else(|| panic!("{name} in {links:?}"))
    };
    let (br0, veth0, veth1) = (link("br0"), link("veth0"), link("veth1"));
    assert_eq!(br0.kind.as_deref(), Some("bridge"));
    assert_eq!(veth1.kind.as_deref(), Some("veth"));
    assert_eq!(veth0.master, Some(br0.index), "bridge port");
    assert_eq!(veth1.master, None);
    assert!(br0.up && veth1.up);
    for (ip, len) in [("10.244.1.1", 24), ("fd00:1::1", 64)] {
        let ip: IpAddr = ip.parse().unwrap();
        assert!(
            addrs
                .iter()
                .any(|a| a.link == br0.index && a.addr == ip && a.prefix_len == len),
            "{ip}/{len} on br0 in {addrs:?}"
        );
    }
    let to_pods = routes
        .iter()
        .find(|r| r.destination == "10.244.7.0".parse::<IpAddr>().unwrap() && r.prefix_len == 24)
        .unwrap_or_else(|| panic!("10.244.7.0/24 in {routes:?}"));
    assert_eq!(
        (to_pods.oif, to_pods.table, to_pods.kind),
        (Some(veth1.index), 254, RouteType::Unicast)
    );
    assert!(
        routes
            .iter()
            .any(|r| r.destination == "fd00:1::".parse::<IpAddr>().unwrap() && r.oif == Some(br0.index)),
        "the IPv6 prefix route in {routes:?}"
    );

    // The kernel's own lookup: a /24 through veth1, nothing beyond.
    let (to_pod, nowhere) = ns.run(|| {
        (
            route_to("10.244.7.9".parse().unwrap()).unwrap(),
            route_to("203.0.113.1".parse().unwrap()).unwrap(),
        )
    });
    assert_eq!(to_pod.and_then(|r| r.oif), Some(veth1.index));
    assert_eq!(nowhere, None, "no default route in the namespace");

    // A link appears, an address and a route are added: the watch says so
    // each time (the kernel queues the notification before `ip` returns),
    // then has nothing more to say.
    let watch = ns.run(ChangeWatch::open).expect("netlink watch");
    assert!(!watch.changed());
    ns.ip_batch("link add late0 type veth peer name late1\n");
    assert!(watch.changed(), "no notification for a new link");
    assert!(!watch.changed());
    ns.ip_batch("addr add 10.244.9.1/32 dev veth1\n");
    assert!(watch.changed(), "no notification for a new address");
    assert!(!watch.changed());
    ns.ip_batch("route add 10.244.8.5/32 dev veth1\n");
    assert!(watch.changed(), "no notification for a new route");
    assert!(!watch.changed());
}

//! LoadBalancer objects for the fake API server (pools, Services of a
//! class, their EndpointSlices) and readers of what the allocator wrote.

use serde_json::{Value, json};

pub use dataplane_agent::lb::{
    CONDITION_TYPE, DEFAULT_CLASS as CLASS, IPS_ANNOTATION, SHARING_KEY_ANNOTATION,
};

/// A LoadBalancerIPPool; blocks are `CIDR` or `START-STOP`.
pub fn pool(name: &str, blocks: &[&str]) -> Value {
    let blocks: Vec<Value> = blocks
        .iter()
        .map(|b| match b.split_once('-') {
            Some((start, stop)) if !b.contains('/') => json!({"start": start, "stop": stop}),
            _ => json!({"cidr": b}),
        })
        .collect();
    json!({
        "apiVersion": "dataplane.example.com/v1alpha1",
        "kind": "LoadBalancerIPPool",
        "metadata": {"name": name},
        "spec": {"blocks": blocks},
    })
}

/// A Service of type LoadBalancer in `namespace/name` (`class` `None`: no
/// `loadBalancerClass`) with TCP `ports`, selecting `app: <name>`.
pub fn service(key: &str, class: Option<&str>, ports: &[i32]) -> Value {
    let (ns, name) = key.split_once('/').expect("namespace/name");
    let ports: Vec<Value> = ports
        .iter()
        .map(|p| json!({"name": format!("p{p}"), "port": p, "protocol": "TCP", "targetPort": 8080}))
        .collect();
    let mut spec = json!({
        "type": "LoadBalancer",
        "ports": ports,
        "selector": {"app": name},
        "ipFamilies": ["IPv4"],
        "ipFamilyPolicy": "SingleStack",
        "externalTrafficPolicy": "Cluster",
    });
    if let Some(c) = class {
        spec["loadBalancerClass"] = json!(c);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    })
}

/// `svc` with an annotation set.
pub fn annotated(mut svc: Value, key: &str, value: &str) -> Value {
    svc["metadata"]["annotations"][key] = json!(value);
    svc
}

/// The addresses of `status.loadBalancer.ingress`.
pub fn ingress(obj: &Value) -> Vec<String> {
    obj["status"]["loadBalancer"]["ingress"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["ip"].as_str().map(str::to_owned))
        .collect()
}

/// The allocator's condition: (status, reason, message).
pub fn condition(obj: &Value) -> Option<(String, String, String)> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == CONDITION_TYPE)
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or("").to_owned();
            (s("status"), s("reason"), s("message"))
        })
}

/// An EndpointSlice of the Service `namespace/name` with TCP port `port`
/// named `p<service port>`: endpoints (address, node, ready), all of one
/// family (the slice's addressType).
pub fn endpoint_slice(
    key: &str,
    service_port: i32,
    port: i32,
    endpoints: &[(std::net::IpAddr, &str, bool)],
) -> Value {
    let family = if endpoints.first().is_some_and(|(ip, _, _)| ip.is_ipv6()) {
        "IPv6"
    } else {
        "IPv4"
    };
    let (ns, name) = key.split_once('/').expect("namespace/name");
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|(ip, node, ready)| {
            json!({"addresses": [ip.to_string()], "nodeName": node,
                "conditions": {"ready": ready, "serving": ready, "terminating": false}})
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-{}", family.to_lowercase()), "namespace": ns,
            "labels": {"kubernetes.io/service-name": name}},
        "addressType": family,
        "ports": [{"name": format!("p{service_port}"), "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    })
}

/// One echo request with short timeouts (for polling during a failover):
/// (server name, the source address it saw).
pub fn quick_request(
    ns: &crate::netns::NetNs,
    dst: impl Into<std::net::SocketAddr>,
    timeout: std::time::Duration,
) -> std::io::Result<(String, std::net::IpAddr)> {
    use std::io::{BufRead as _, Write as _};
    let dst = dst.into();
    let stream = ns.run(|| std::net::TcpStream::connect_timeout(&dst, timeout))?;
    stream.set_read_timeout(Some(timeout))?;
    (&stream).write_all(b"x\n")?;
    let mut line = String::new();
    std::io::BufReader::new(&stream).read_line(&mut line)?;
    let mut parts = line.split(' ');
    let server = parts.next().unwrap_or_default().to_owned();
    let peer: std::net::SocketAddr = parts
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("malformed echo reply {line:?}")))?;
    Ok((server, peer.ip()))
}

/// The MAC address of `device` in `ns`.
pub fn mac_of(ns: &crate::netns::NetNs, device: &str) -> String {
    let out = ns
        .command("ip")
        .args(["-j", "link", "show", "dev", device])
        .output()
        .expect("ip link");
    let links: Value = serde_json::from_slice(&out.stdout).expect("ip -j link");
    links[0]["address"].as_str().expect("a MAC address").to_owned()
}

/// The link-layer address `ns` has for `ip` in its neighbour table, if any
/// (incomplete and failed entries have none).
pub fn neighbour(ns: &crate::netns::NetNs, ip: &str) -> Option<String> {
    let out = ns
        .command("ip")
        .args(["-j", "neigh", "show", ip])
        .output()
        .expect("ip neigh");
    let entries: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    entries
        .as_array()?
        .iter()
        .find_map(|e| e["lladdr"].as_str().map(str::to_owned))
}

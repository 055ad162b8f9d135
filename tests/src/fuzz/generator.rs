//! The frames: well-formed seeds about the model's Services and the flows
//! the run opened (built with the harness's [`Frame`] and ICMP builders),
//! then now and then mutated (see `mutate`). The order of the random draws
//! is the frames' identity: a seed reproduces a run.

use std::net::{IpAddr, SocketAddr};

use super::{
    cluster::{DSR_NODE_PORT, Fam, SNAT_PORTS, fam},
    model::Model,
    mutate::mutate,
    rng::Rng,
};
use crate::packet::{Ext, Frame, SCTP, TCP, UDP, encapsulate, icmp_error, icmp6_echo_request, icmp6_error};

/// A frame: mostly mutations of well-formed frames about the model's
/// Services and the flows the run opened.
pub(super) fn frame(rng: &mut Rng, model: &Model) -> Vec<u8> {
    let mut f = seed(rng, model);
    if rng.chance(60) {
        for _ in 0..=rng.below(3) {
            mutate(rng, &mut f);
        }
    }
    // BPF_PROG_TEST_RUN takes frames of an Ethernet header at least.
    if f.len() < 14 {
        f.resize(14, 0);
    }
    f
}

fn random_client(rng: &mut Rng, fm: &Fam) -> SocketAddr {
    SocketAddr::new(*rng.pick(&fm.clients), 1024 + rng.below(64_000) as u16)
}

fn seed(rng: &mut Rng, model: &Model) -> Vec<u8> {
    let fm = fam(rng.chance(50));
    let targets = &model.targets[usize::from(fm.v6)];
    let clients = &model.recent[usize::from(fm.v6)];
    let snat_port = |rng: &mut Rng| SNAT_PORTS.0 + rng.below(31_744) as u16;
    let flags = [0x02, 0x10, 0x11, 0x04, 0x18, 0x12, 0x01, 0x14];
    let kind = rng.below(10);
    let mut fr = match kind {
        // To a frontend (new or established flows); now and then to an
        // unallocated address of the service CIDR, or a port the frontend's
        // address does not serve.
        0..=3 => {
            let (mut addr, mut port, proto) = *rng.pick(targets);
            match rng.below(20) {
                0 => addr = fm.unallocated,
                1 => port = rng.below(65_536) as u16,
                _ => {}
            }
            let src = if !clients.is_empty() && rng.chance(50) {
                *rng.pick(clients)
            } else {
                random_client(rng, &fm)
            };
            let mut f = Frame::tcp(src, SocketAddr::new(addr, port), *rng.pick(&flags));
            f.proto = proto;
            f
        }
        // A reply to a masqueraded flow (to the node, a SNAT port), or from a
        // backend towards a client (egress): half of them to flows the run
        // opened.
        4 | 5 => {
            let flows = &model.flows[usize::from(fm.v6)];
            let snat = &model.snat[usize::from(fm.v6)];
            let (src, dst, proto) = if kind == 4 && !snat.is_empty() && rng.chance(50) {
                let (at, backend, proto) = *rng.pick(snat);
                (backend, at, proto)
            } else if kind == 5 && !flows.is_empty() && rng.chance(50) {
                let f = *rng.pick(flows);
                (f.backend, f.client, f.proto)
            } else {
                let backends = [
                    (fm.remote_pod, 8080, TCP),
                    (fm.local_pod, 8080, TCP),
                    (fm.remote_pod, 5353, UDP),
                    (fm.remote_pod, 9090, SCTP),
                ];
                let (ip, port, proto) = *rng.pick(&backends);
                let dst = if kind == 4 || clients.is_empty() {
                    SocketAddr::new(fm.node, snat_port(rng))
                } else {
                    *rng.pick(clients)
                };
                (SocketAddr::new(ip, port), dst, proto)
            };
            let mut f = Frame::tcp(src, dst, *rng.pick(&flags));
            f.proto = proto;
            f
        }
        // Forward packets after DNAT (egress).
        6 => {
            let flows = &model.flows[usize::from(fm.v6)];
            if !flows.is_empty() && rng.chance(50) {
                let f = *rng.pick(flows);
                let mut fr = Frame::tcp(f.client, f.backend, 0x10);
                fr.proto = f.proto;
                fr
            } else {
                let src = if clients.is_empty() {
                    random_client(rng, &fm)
                } else {
                    *rng.pick(clients)
                };
                Frame::tcp(src, SocketAddr::new(fm.remote_pod, 8080), 0x10)
            }
        }
        // ICMP errors about flows; now and then an encapsulated packet
        // (DSR's) to the local backend of the DSR frontend, or elsewhere.
        7 if rng.chance(40) => return encapsulated_seed(rng, &fm),
        7 => return icmp_seed(rng, &fm, model),
        // Anything else: not ours; ICMPv6 echo requests to frontends (no
        // errors: never translated) among them.
        8 if fm.v6 && rng.chance(20) => {
            let (IpAddr::V6(src), (IpAddr::V6(dst), _, _)) =
                (random_client(rng, &fm).ip(), *rng.pick(targets))
            else {
                unreachable!("IPv6 clients and frontends");
            };
            return icmp6_echo_request(src, dst);
        }
        8 => Frame::udp(random_client(rng, &fm), SocketAddr::new(fm.elsewhere, 53)),
        _ => {
            let mut f = vec![0u8; 14 + rng.below(80) as usize];
            for b in &mut f {
                *b = rng.next_u64() as u8;
            }
            if fm.v6 {
                // An IPv6 ethertype, and now and then the version too.
                f[12..14].copy_from_slice(&[0x86, 0xdd]);
                if f.len() > 14 && rng.chance(50) {
                    f[14] = 0x60 | (f[14] & 0x0f);
                }
            }
            return f;
        }
    };
    if fr.proto == UDP {
        fr.tcp_flags = 0;
        // Invalid in IPv6: the datapath may pass it, never make it valid.
        fr.udp_zero_checksum = rng.chance(if fm.v6 { 5 } else { 10 });
    }
    if rng.chance(10) {
        fr.vlans = (0..=rng.below(2)).map(|_| rng.below(4096) as u16).collect();
    }
    if fm.v6 {
        if rng.chance(20) {
            fr.ext = random_ext(rng);
        }
    } else if rng.chance(10) {
        fr.ip_options = vec![1; 4 * (1 + rng.below(3) as usize)];
    }
    fr.payload = (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect();
    fr.build()
}

/// An IPIP (IPv6-in-IPv6) packet from another node: inside, a client's
/// packet to the DSR Service's NodePort (on some node's address) or to
/// another port; outside, to the DSR backend or another address.
fn encapsulated_seed(rng: &mut Rng, fm: &Fam) -> Vec<u8> {
    let node = if rng.chance(70) { fm.node } else { fm.router };
    let port = if rng.chance(80) {
        DSR_NODE_PORT
    } else {
        30000 + rng.below(100) as u16
    };
    let mut inner = Frame::tcp(
        random_client(rng, fm),
        SocketAddr::new(node, port),
        *rng.pick(&[0x02u8, 0x10, 0x11, 0x18]),
    );
    inner.payload = (0..rng.below(32)).map(|_| rng.next_u64() as u8).collect();
    let inner = inner.build();
    let to = if rng.chance(80) {
        fm.local_pod
    } else {
        fm.remote_pod
    };
    encapsulate(&inner, fm.router, to)
}

/// An IPv6 extension header chain: mostly short ones of options and
/// routing headers (translated after them), fragment and authentication
/// headers (never translated), now and then longer than the datapath
/// follows (4).
fn random_ext(rng: &mut Rng) -> Vec<Ext> {
    let n = if rng.chance(10) {
        4 + rng.below(2)
    } else {
        1 + rng.below(3)
    };
    (0..n)
        .map(|_| match rng.below(8) {
            0 | 1 => Ext::Options {
                kind: 0,
                units: rng.below(3) as u8,
            },
            2 | 3 => Ext::Options {
                kind: 60,
                units: rng.below(2) as u8,
            },
            4 | 5 => Ext::Routing,
            6 => {
                let any = rng.below(8192) as u16;
                Ext::Fragment {
                    offset: *rng.pick(&[0, 185, any]),
                    more: rng.chance(50),
                }
            }
            _ => Ext::Auth,
        })
        .collect()
}

/// An ICMP error (IPv4: types 3, 11, 12; IPv6: 1 to 4) about a flow: a
/// packet from a client to a frontend, a reply from a frontend to a client,
/// or a masqueraded one from the node to a backend; and about flows the run
/// opened, each way and on each side of the node.
fn icmp_seed(rng: &mut Rng, fm: &Fam, model: &Model) -> Vec<u8> {
    let family = usize::from(fm.v6);
    let (targets, clients) = (&model.targets[family], &model.recent[family]);
    let (flows, snat) = (&model.flows[family], &model.snat[family]);
    let client = if clients.is_empty() {
        random_client(rng, fm)
    } else {
        *rng.pick(clients)
    };
    let (addr, port, _) = *rng.pick(targets);
    let frontend = SocketAddr::new(addr, port);
    let with = |mut f: Frame, proto| {
        f.proto = proto;
        f
    };
    let mut quoted = match rng.below(8) {
        0 => Frame::tcp(client, frontend, 0x10),
        1 => Frame::tcp(frontend, client, 0x10),
        2 => Frame::udp(
            SocketAddr::new(fm.node, SNAT_PORTS.0 + rng.below(31_744) as u16),
            SocketAddr::new(fm.remote_pod, 5353),
        ),
        // A forward packet after DNAT, a reply as the client saw it, a
        // reply after un-SNAT.
        3..=5 if !flows.is_empty() => {
            let f = *rng.pick(flows);
            match rng.below(3) {
                0 => with(Frame::tcp(f.client, f.backend, 0x10), f.proto),
                1 => with(Frame::tcp(f.frontend, f.client, 0x10), f.proto),
                _ => with(Frame::tcp(f.backend, f.client, 0x10), f.proto),
            }
        }
        // A masqueraded packet, and its reply.
        _ if !snat.is_empty() => {
            let (at, backend, proto) = *rng.pick(snat);
            if rng.chance(50) {
                with(Frame::tcp(at, backend, 0x10), proto)
            } else {
                with(Frame::tcp(backend, at, 0x10), proto)
            }
        }
        _ => Frame::tcp(client, frontend, 0x10),
    };
    let dst = *rng.pick(&[fm.node, client.ip(), fm.remote_pod]);
    let (IpAddr::V6(router), IpAddr::V6(dst)) = (fm.router, dst) else {
        let (IpAddr::V4(router), IpAddr::V4(dst)) = (fm.router, dst) else {
            unreachable!("one family");
        };
        return icmp_error(
            router,
            dst,
            *rng.pick(&[3u8, 11, 12]),
            rng.below(5) as u8,
            1400,
            &quoted.build(),
        );
    };
    // A quote with extension headers (left alone), and quotes of the header
    // and 8 bytes only, as well as whole packets.
    if rng.chance(10) {
        quoted.ext = random_ext(rng);
    }
    let quoted = quoted.build();
    let about = if rng.chance(30) {
        &quoted[..quoted.len().min(14 + 48)]
    } else {
        &quoted[..]
    };
    let f = icmp6_error(
        router,
        dst,
        *rng.pick(&[1u8, 2, 3, 4]),
        rng.below(5) as u8,
        1280 + rng.below(220) as u32,
        about,
    );
    if rng.chance(10) { with_hop_by_hop(f) } else { f }
}

/// An IPv6 frame (no VLAN tags) with an 8-byte hop-by-hop options header
/// put in front of its chain (no checksum covers it).
fn with_hop_by_hop(f: Vec<u8>) -> Vec<u8> {
    let (l3, hbh) = (14, 14 + 40);
    let mut g = f[..hbh].to_vec();
    g.extend_from_slice(&Ext::Options { kind: 0, units: 0 }.bytes(f[l3 + 6]));
    g.extend_from_slice(&f[hbh..]);
    g[l3 + 6] = 0;
    let payload = u16::from_be_bytes([f[l3 + 4], f[l3 + 5]]) + 8;
    g[l3 + 4..l3 + 6].copy_from_slice(&payload.to_be_bytes());
    g
}

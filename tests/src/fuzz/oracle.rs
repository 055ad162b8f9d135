//! The oracle: whether what a program did with a frame is what the model
//! allows (see the module doc of `fuzz` for the rules), counting outcomes
//! into the run's [`Report`].

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use dataplane_common::names;

use super::{
    Report,
    cluster::{SNAT_PORTS, is_service_cidr, snat_ip},
    model::{Flow, Model},
    programs::{Program, Side, drop_of, verdicts},
    view::{View, be16, view},
};
use crate::packet::{SCTP, TCP, UDP, internet_checksum};

pub(super) fn check(
    model: &mut Model,
    p: Program,
    input: &[u8],
    iv: Option<&View>,
    // The program's verdict, and whether it counted a tuple clash.
    (verdict, clash): (u32, bool),
    out: &[u8],
    r: &mut Report,
) -> Result<(), String> {
    let (pass, drop, back) = verdicts(p);
    // An encapsulated packet (DSR's) taken apart at an external device's
    // ingress: judged as its inner packet would be, which must have been
    // translated (a DSR frontend to its local backend).
    // (A drop of one is its inner flow's tuple clash, counted.)
    if p.side == Side::Ingress
        && p.name != names::TC_POD_INGRESS
        && verdict == drop_of(p)
        && iv.and_then(|v| decapsulated(input, v)).is_some()
    {
        if clash {
            r.clashes += 1;
            return Ok(());
        }
        return Err("dropped an encapsulated packet (no tuple clash counted)".into());
    }
    if p.side == Side::Ingress
        && p.name != names::TC_POD_INGRESS
        && verdict == pass
        && let Some(inner) = iv.and_then(|v| decapsulated(input, v))
        && out.len() == inner.len()
        && out != &inner[..]
    {
        r.decapsulated += 1;
        let inner_view = view(&inner);
        // A DSR NodePort reached on any node's address is the frontend.
        model.decapsulating = true;
        let judged = check(model, p, &inner, inner_view.as_ref(), (verdict, clash), out, r);
        model.decapsulating = false;
        return judged;
    }
    let v6 = iv.is_some_and(|v| v.v6);
    let must = p.side == Side::Ingress && iv.is_some_and(|v| model.must_translate(v));
    if must {
        r.must_translate += 1;
        r.must_translate6 += u64::from(v6);
    }
    if verdict == drop {
        r.dropped += 1;
        r.dropped6 += u64::from(v6);
        let iv = iv
            .filter(|v| v.parsed && v.ports.is_some())
            .ok_or("dropped a frame that is no TCP, UDP or SCTP packet the datapath parses")?;
        if !model.service_addresses.contains(&iv.dst) && !is_service_cidr(iv.dst) {
            return Err(format!("dropped a frame to {}, not a Service address", iv.dst));
        }
        // Nor for want of resources: the LRU conntrack (4096 entries) never
        // holds more than a few of a backend's 31,744 SNAT ports, of which
        // a new flow tries 33. A clash is the one reason (see `clashes`).
        if must && clash {
            r.clashes += 1;
            return Ok(());
        }
        if must {
            return Err(format!(
                "dropped a frame to {}, a frontend with backends",
                SocketAddr::new(iv.dst, iv.ports.unwrap_or_default().1)
            ));
        }
        return Ok(());
    }
    if verdict == back && p.side == Side::Ingress {
        r.rejected += 1;
        r.rejected6 += u64::from(v6);
        return check_reject(model, input, iv, out, must);
    }
    if verdict != pass {
        return Err(format!("verdict {verdict}"));
    }
    if out == input {
        r.untouched += 1;
        r.untouched6 += u64::from(v6);
        if must && let Some(iv) = iv {
            let (_, dport) = iv.ports.unwrap_or_default();
            return Err(format!(
                "a frame to a frontend passed untouched ({} -> {})",
                SocketAddr::new(iv.src, iv.ports.unwrap_or_default().0),
                SocketAddr::new(iv.dst, dport)
            ));
        }
        return Ok(());
    }
    r.translated += 1;
    r.translated6 += u64::from(v6);
    let iv = iv.ok_or("changed a frame that is not IP")?;
    if !iv.parsed {
        return Err("changed a frame the datapath does not parse (a fragment, IPsec, malformed)".into());
    }
    let ov = view(out)
        .filter(|v| v.parsed)
        .ok_or("the changed frame does not parse")?;
    if out.len() != input.len() || out[..iv.l3] != input[..iv.l3] {
        return Err("length or L2 header changed".into());
    }
    if let Some(i) = (iv.end..input.len()).find(|&i| input[i] != out[i]) {
        return Err(format!(
            "byte {i} changed beyond the IP packet (which ends at {})",
            iv.end
        ));
    }
    if ov.ip_check_ok != iv.ip_check_ok {
        return Err("IP header checksum validity changed".into());
    }
    if iv.udp_zero != ov.udp_zero {
        return Err("a zero UDP checksum was not kept zero (or became zero)".into());
    }
    if iv.l4_valid() != ov.l4_valid() {
        return Err(format!(
            "L4 checksum validity changed: {:?} -> {:?}",
            iv.l4_residual, ov.l4_residual
        ));
    }
    if (iv.proto, iv.l4, iv.end) != (ov.proto, ov.l4, ov.end) {
        return Err("protocol, header length or packet length changed".into());
    }
    if iv.proto == iv.icmp() {
        r.icmp_translated += 1;
        r.icmp_translated6 += u64::from(v6);
        return check_icmp(model, p, input, out, iv, &ov);
    }
    let (isp, idp) = iv.ports.ok_or("a frame without ports changed")?;
    let (osp, odp) = ov.ports.ok_or("ports vanished")?;
    // Only the hook's side of the tuple, and the checksums, may differ
    // (IPv6: no header checksum; hop limit, flow label, payload length and
    // extension headers stay).
    let (l3, l4) = (iv.l3, iv.l4);
    let (check_at, check_len) = match iv.proto {
        TCP => (l4 + 16, 2),
        SCTP => (l4 + 8, 4),
        _ => (l4 + 6, 2),
    };
    let (src_at, dst_at, alen) = if v6 {
        (l3 + 8, l3 + 24, 16)
    } else {
        (l3 + 12, l3 + 16, 4)
    };
    let side_fields: [(usize, usize); 2] = match p.side {
        Side::Ingress => [(dst_at, alen), (l4 + 2, 2)],
        Side::Egress => [(src_at, alen), (l4, 2)],
    };
    let allowed = |i: usize| {
        i < iv.end
            && (side_fields.iter().any(|(at, n)| i >= *at && i < at + n)
                || (!v6 && (l3 + 10..l3 + 12).contains(&i))
                || (check_at..check_at + check_len).contains(&i))
    };
    if let Some(i) = (0..input.len()).find(|&i| input[i] != out[i] && !allowed(i)) {
        return Err(format!("byte {i} changed outside the {:?} fields", p.side));
    }
    let in_snat_range = |port: u16| (SNAT_PORTS.0..=SNAT_PORTS.1).contains(&port);
    match p.side {
        Side::Ingress => {
            let (from, to) = ((iv.dst, idp, iv.proto), SocketAddr::new(ov.dst, odp));
            if osp != isp || ov.src != iv.src {
                return Err("ingress changed the source".into());
            }
            let frontend = model.frontends.get(&from).or_else(|| {
                // Taken apart by DSR's backend-node half: a NodePort on
                // another node's address.
                model
                    .decapsulating
                    .then(|| model.frontends.get(&(snat_ip(v6), idp, iv.proto)))
                    .flatten()
            });
            if let Some(fe) = frontend
                && fe.backends.contains(&to)
            {
                model.opened(Flow {
                    client: SocketAddr::new(iv.src, isp),
                    frontend: SocketAddr::new(iv.dst, idp),
                    backend: to,
                    proto: iv.proto,
                });
                return Ok(());
            }
            // A reply to a masqueraded flow, from its backend, to its client
            // (the SNAT port may be a NodePort's number too: the REP_IN
            // entry, keyed by the backend, decides).
            let from_backend = (SocketAddr::new(iv.src, isp), to, iv.proto);
            if iv.dst == snat_ip(v6) && in_snat_range(idp) && model.backend_client.contains_key(&from_backend)
            {
                return Ok(());
            }
            if frontend.is_some() {
                return Err(format!(
                    "{} translated to {to}, not one of its backends",
                    SocketAddr::new(iv.dst, idp)
                ));
            }
            if iv.dst == snat_ip(v6) && in_snat_range(idp) {
                return Err(format!(
                    "un-SNAT of {} to {to}: no flow the run opened from that client to that backend",
                    SocketAddr::new(iv.src, isp)
                ));
            }
            Err(format!(
                "{} is no frontend and no SNAT port, yet translated to {to}",
                SocketAddr::new(iv.dst, idp)
            ))
        }
        Side::Egress => {
            if odp != idp || ov.dst != iv.dst {
                return Err("egress changed the destination".into());
            }
            let (from, to, new) = (
                SocketAddr::new(iv.src, isp),
                SocketAddr::new(iv.dst, idp),
                SocketAddr::new(ov.src, osp),
            );
            // The frontend restored on a flow's reply (backend to client),
            // or SNAT of its forward packet (client to backend; NodePorts
            // lie in the SNAT port range too).
            if model
                .backend_client
                .get(&(from, to, iv.proto))
                .is_some_and(|f| f.contains(&new))
            {
                return Ok(());
            }
            if ov.src == snat_ip(v6) && in_snat_range(osp) {
                if !model.backend_client.contains_key(&(to, from, iv.proto)) {
                    return Err(format!(
                        "{from} -> {to} masqueraded to {new}: no flow the run opened"
                    ));
                }
                model.masqueraded(new, to, iv.proto);
                return Ok(());
            }
            Err(format!(
                "{from} -> {to}: source rewritten to {new}, neither the SNAT address nor the frontend of a flow of theirs"
            ))
        }
    }
}

/// The inner packet of an encapsulated one (IPIP, IPv6-in-IPv6: the outer
/// header removed, the L2 header kept), if `iv` is one.
fn decapsulated(f: &[u8], iv: &View) -> Option<Vec<u8>> {
    let olen = if iv.v6 { 40 } else { 20 };
    let encap = if iv.v6 { 41 } else { 4 };
    // Bytes after the IP packet (a frame's padding) stay where they were.
    (iv.proto == encap && iv.l4 == iv.l3 + olen && iv.end <= f.len())
        .then(|| [&f[..iv.l3], &f[iv.l4..]].concat())
}

fn check_reject(
    model: &Model,
    input: &[u8],
    iv: Option<&View>,
    out: &[u8],
    must: bool,
) -> Result<(), String> {
    let iv = iv
        .filter(|v| v.parsed && v.ports.is_some())
        .ok_or("rejected a frame that is no TCP, UDP or SCTP packet the datapath parses")?;
    if !model.service_addresses.contains(&iv.dst) {
        return Err(format!("rejected a frame to {}, not a Service address", iv.dst));
    }
    if must {
        return Err("rejected a frame to a frontend with backends".into());
    }
    let ov = view(out)
        .filter(|v| v.parsed)
        .ok_or("the reject does not parse")?;
    // IP header, ICMP header (8), quote (the frame's IP header and 8 bytes).
    let (hlen, quote, icmp_type, code) = if iv.v6 { (40, 48, 1, 4) } else { (20, 28, 3, 3) };
    if ov.v6 != iv.v6 || ov.proto != iv.icmp() || ov.l4 != ov.l3 + hlen {
        return Err("not an ICMP message of the frame's family".into());
    }
    if !ov.ip_check_ok || ov.l4_valid() != Some(true) {
        return Err("the reject's checksums are wrong".into());
    }
    let l4 = ov.l4;
    if out[l4] != icmp_type || out[l4 + 1] != code {
        return Err("not an ICMP port-unreachable".into());
    }
    if (ov.src, ov.dst) != (iv.dst, iv.src) {
        return Err("not from the address tried to the sender".into());
    }
    if out.get(l4 + 8..l4 + 8 + quote) != input.get(iv.l3..iv.l3 + quote) {
        return Err("does not quote the frame's IP header and 8 bytes".into());
    }
    if ov.end != out.len() || out.len() != l4 + 8 + quote {
        return Err("the reject's length is wrong".into());
    }
    if out[..6] != input[6..12] || out[6..12] != input[..6] {
        return Err("MAC addresses not swapped".into());
    }
    if out[12..ov.l3] != input[12..iv.l3] {
        return Err("the reject's VLAN tags or ethertype differ from the frame's".into());
    }
    Ok(())
}

fn check_icmp(
    model: &Model,
    p: Program,
    input: &[u8],
    out: &[u8],
    iv: &View,
    ov: &View,
) -> Result<(), String> {
    // Ingress leaves the outer source alone; egress may set it (checked
    // below, once the quote is known).
    if ov.src != iv.src && p.side == Side::Ingress {
        return Err("an ICMP error's outer source changed at ingress".into());
    }
    let (l3, l4, v6) = (iv.l3, iv.l4, iv.v6);
    let errors: &[u8] = if v6 { &[1, 2, 3, 4] } else { &[3, 11, 12] };
    if !errors.contains(&input[l4]) {
        return Err(format!("ICMP type {} translated: not an error", input[l4]));
    }
    // The quoted IP header at l4 + 8. Outer destination, ICMP checksum, and
    // in the quote: addresses, ports, the UDP or TCP checksum (IPv4: the
    // outer and quoted header checksums too), all within the IP packet.
    let q = l4 + 8;
    // The quote the datapath translates: IPv4 without options, IPv6 with
    // the L4 header right after it; TCP, UDP or SCTP.
    let (qproto, qlen) = if v6 {
        (input.get(q + 6).copied(), 40)
    } else {
        (input.get(q + 9).copied(), 20)
    };
    let version_ok = input
        .get(q)
        .is_some_and(|b| if v6 { b >> 4 == 6 } else { *b == 0x45 });
    let Some(qproto @ (TCP | UDP | SCTP)) = qproto.filter(|_| version_ok && out.len() >= q + qlen + 4) else {
        return Err("translated an ICMP error whose quote is no TCP, UDP or SCTP packet".into());
    };
    // The quoted L4 checksum: UDP's (8 bytes in), TCP's (16; most errors
    // quote it); SCTP's CRC32c is left alone.
    let (qaddr, ql4) = (if v6 { q + 8 } else { q + 12 }, q + qlen);
    let qcheck = match qproto {
        UDP => ql4 + 6..ql4 + 8,
        TCP => ql4 + 16..ql4 + 18,
        _ => 0..0,
    };
    let allowed = |i: usize| {
        i < iv.end
            && ((qaddr..ql4 + 4).contains(&i)
                || qcheck.contains(&i)
                || (l4 + 2..l4 + 4).contains(&i)
                || if v6 {
                    (l3 + 8..l3 + 40).contains(&i)
                } else {
                    (l3 + 12..l3 + 20).contains(&i)
                        || (l3 + 10..l3 + 12).contains(&i)
                        || (q + 10..q + 12).contains(&i)
                })
    };
    if let Some(i) = (0..input.len()).find(|&i| input[i] != out[i] && !allowed(i)) {
        return Err(format!(
            "byte {i} of an ICMP error changed outside its translated fields"
        ));
    }
    if !v6 {
        let inner_ok = |f: &[u8]| internet_checksum(&[&f[q..q + 20]]) == 0;
        if inner_ok(input) != inner_ok(out) {
            return Err("the quoted IP header's checksum validity changed".into());
        }
    }
    // The quote now is a packet of a flow the run opened as its sender sent
    // it: client to frontend, backend to client, backend to the SNAT
    // address; the outer destination, if it changed, that sender.
    let addr = |f: &[u8], at: usize| -> IpAddr {
        if v6 {
            Ipv6Addr::from(<[u8; 16]>::try_from(&f[at..at + 16]).unwrap()).into()
        } else {
            Ipv4Addr::new(f[at], f[at + 1], f[at + 2], f[at + 3]).into()
        }
    };
    let (qs, qd) = if v6 {
        (addr(out, q + 8), addr(out, q + 24))
    } else {
        (addr(out, q + 12), addr(out, q + 16))
    };
    let (qs, qd) = (
        SocketAddr::new(qs, be16(out, ql4)),
        SocketAddr::new(qd, be16(out, ql4 + 2)),
    );
    let flow = model.client_frontend.contains(&(qs, qd, qproto))
        || model.backend_client.contains_key(&(qs, qd, qproto))
        || (qd.ip() == snat_ip(v6)
            && (SNAT_PORTS.0..=SNAT_PORTS.1).contains(&qd.port())
            && model.backend_ips.contains(&qs.ip()));
    if !flow {
        return Err(format!(
            "quote rewritten to {qs} -> {qd}, no packet of a flow the run opened ({:?})",
            p.side
        ));
    }
    if ov.dst != iv.dst && ov.dst != qs.ip() {
        return Err(format!(
            "ICMP error sent to {}, not to the quoted packet's sender {}",
            ov.dst,
            qs.ip()
        ));
    }
    // Egress (POSTROUTING's half of netfilter's translation): an error to
    // the quoted packet's sender leaves from the address it sent to.
    if ov.src != iv.src && (ov.src != qd.ip() || ov.dst != qs.ip()) {
        return Err(format!(
            "an ICMP error's outer source set to {}, not the quoted destination {} of its sender {}",
            ov.src,
            qd.ip(),
            qs.ip()
        ));
    }
    Ok(())
}

//! First proof of the chain: the embedded object loads, its XDP entry point
//! attaches to a node's external device in the sandbox, counts real packets in
//! its per-CPU map and passes them; and the same program runs under
//! BPF_PROG_TEST_RUN.

use std::net::SocketAddrV4;

use aya::programs::{TestRun as _, TestRunOptions};
use dataplane_agent::dataplane::{Datapath, XdpMode};
use dataplane_common::stats::{Event, Hook};
use dataplane_tests::{
    cluster::{Cluster, EXTERNAL_DEVICE, NODE_IPS},
    echo::{EchoServer, UdpClient},
};

const XDP_PASS: u32 = 2;

#[test]
fn xdp_on_node_external_device_counts_and_passes_real_traffic() {
    let cluster = Cluster::new();
    let node = &cluster.nodes[0];
    let server = EchoServer::udp(node.ns(), "node1", SocketAddrV4::new(NODE_IPS[0], 7000));
    let client = UdpClient::connect(&cluster.client.ns, server.addr).unwrap();
    // Resolve ARP before counting, so the window below holds our datagrams.
    client.request("warm-up").expect("client -> node1 before attach");

    let mut datapath = Datapath::load().expect("load datapath");
    node.ns()
        .run(|| datapath.attach_external(EXTERNAL_DEVICE, XdpMode::Native))
        .expect("attach XDP to node1 eth0");
    let before = datapath.maps().received(Hook::XdpIngress).unwrap();

    const N: u64 = 40;
    let payload = "x".repeat(100);
    for i in 0..N {
        let reply = client
            .request(&payload)
            .unwrap_or_else(|e| panic!("request {i} through XDP: {e}"));
        assert_eq!(reply.server, "node1", "XDP passed the packet on to the stack");
    }

    let rx = datapath.maps().received(Hook::XdpIngress).unwrap();
    let pass = datapath
        .maps()
        .hook_counter(Hook::XdpIngress, Event::Pass)
        .unwrap();
    let (packets, bytes) = (rx.packets - before.packets, rx.bytes - before.bytes);
    // Our N datagrams, plus possibly a few ARP probes the kernel sends on its own.
    assert!(
        (N..=N + 4).contains(&packets),
        "node1 eth0 saw {packets} frames, expected {N} requests"
    );
    let frame = 14 + 20 + 8 + payload.len() as u64;
    assert!(bytes >= N * frame, "{bytes} bytes < {N} x {frame}");
    // Not configured yet: XDP (ingress) and TC (egress) pass every frame.
    assert_eq!(pass, rx, "every frame was passed");
    let tc = datapath.maps().received(Hook::TcEgress).unwrap();
    assert!(tc.packets >= N, "TC egress saw the {N} replies");

    // Counting stops when the program is gone (detached on drop).
    drop(datapath);
    client
        .request("after detach")
        .expect("traffic still flows after detach");
}

/// A minimal Ethernet + IPv4 + UDP frame (checksums are irrelevant here).
fn udp_frame(payload_len: usize) -> Vec<u8> {
    let mut f = vec![0u8; 14 + 20 + 8 + payload_len];
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    f[14] = 0x45;
    f[16..18].copy_from_slice(&((20 + 8 + payload_len) as u16).to_be_bytes());
    f[22] = 64;
    f[23] = 17;
    f[26..30].copy_from_slice(&[198, 18, 0, 100]);
    f[30..34].copy_from_slice(&[198, 18, 0, 11]);
    f[34..36].copy_from_slice(&40000u16.to_be_bytes());
    f[36..38].copy_from_slice(&7000u16.to_be_bytes());
    f[38..40].copy_from_slice(&((8 + payload_len) as u16).to_be_bytes());
    f
}

#[test]
fn prog_test_run_passes_the_frame_unchanged_and_counts_it() {
    dataplane_tests::require_privileges();
    let datapath = Datapath::load().expect("load datapath");
    let input = udp_frame(64);
    let mut output = vec![0u8; input.len() + 256];
    let result = datapath
        .xdp()
        .unwrap()
        .test_run(TestRunOptions {
            data_in: Some(&input),
            data_out: Some(&mut output),
            repeat: 1,
            ..Default::default()
        })
        .expect("BPF_PROG_TEST_RUN");
    assert_eq!(result.return_value, XDP_PASS);
    assert_eq!(
        &output[..result.data_size_out as usize],
        &input[..],
        "frame untouched"
    );

    let rx = datapath.maps().received(Hook::XdpIngress).unwrap();
    assert_eq!((rx.packets, rx.bytes), (1, input.len() as u64));
    assert_eq!(
        datapath
            .maps()
            .hook_counter(Hook::XdpIngress, Event::Pass)
            .unwrap(),
        rx
    );
}

//! The harness itself: topology, echo servers, cleanup.

use std::net::SocketAddrV4;

use dataplane_tests::{
    bpffs::is_mounted,
    cgroup::MountPoint,
    cluster::{Cluster, NODE_IPS},
    echo::{EchoServer, tcp_request, udp_request},
};

#[test]
fn pods_reach_each_other_across_nodes_and_servers_see_real_sources() {
    let mut cluster = Cluster::new();
    let a = cluster.add_pod(0, "a");
    let b = cluster.add_pod(1, "b");
    let (pa, pb) = (&cluster.pods[a], &cluster.pods[b]);
    let tcp = EchoServer::tcp(&pb.ns, "b", SocketAddrV4::new(pb.ip, 8080));
    let udp = EchoServer::udp(&pb.ns, "b", SocketAddrV4::new(pb.ip, 5353));

    let reply = tcp_request(&pa.ns, tcp.addr, "hello").expect("pod a -> pod b over TCP");
    assert_eq!(reply.server, "b");
    assert_eq!(reply.peer.ip(), pa.ip, "no NAT between pods: b sees a's address");
    assert_eq!(reply.payload, "hello");

    let reply = udp_request(&pa.ns, udp.addr, "ping").expect("pod a -> pod b over UDP");
    assert_eq!((reply.server.as_str(), reply.peer.ip()), ("b", pa.ip.into()));
}

#[test]
fn client_reaches_nodes_on_the_lan_but_not_pods() {
    let mut cluster = Cluster::new();
    let p = cluster.add_pod(0, "p");
    let node = &cluster.nodes[0];
    let server = EchoServer::tcp(node.ns(), "node1", SocketAddrV4::new(NODE_IPS[0], 9000));
    let reply = tcp_request(&cluster.client.ns, server.addr, "x").expect("client -> node1");
    assert_eq!(reply.peer.ip(), cluster.client.ip);

    // The client has no route to pod CIDRs: only Services expose pods.
    let pod = &cluster.pods[p];
    let _pod_server = EchoServer::tcp(&pod.ns, "p", SocketAddrV4::new(pod.ip, 8080));
    let err = tcp_request(&cluster.client.ns, SocketAddrV4::new(pod.ip, 8080), "x")
        .expect_err("client must not reach a pod directly");
    assert_eq!(err.kind(), std::io::ErrorKind::NetworkUnreachable, "{err}");
}

#[test]
fn dropping_the_cluster_removes_every_namespace_and_pin_dir() {
    let (prefix, bpffs) = {
        let mut cluster = Cluster::new();
        cluster.add_pod(0, "a");
        cluster.add_pod(1, "b");
        let ns_count = std::fs::read_dir("/run/netns")
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(cluster.prefix()))
            .count();
        assert_eq!(ns_count, 6, "switch, client, 2 nodes, 2 pods");
        assert!(cluster.bpffs.path().is_dir());
        (cluster.prefix().to_owned(), cluster.bpffs.path().to_owned())
    };
    let left: Vec<_> = std::fs::read_dir("/run/netns")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    assert!(!bpffs.exists(), "bpffs dir left behind: {}", bpffs.display());
}

#[test]
fn cleanup_also_happens_when_a_test_panics() {
    let prefix = std::sync::Mutex::new(String::new());
    let result = std::panic::catch_unwind(|| {
        let cluster = Cluster::new();
        *prefix.lock().unwrap() = cluster.prefix().to_owned();
        panic!("simulated test failure");
    });
    assert!(result.is_err());
    let prefix = prefix.into_inner().unwrap();
    assert!(!prefix.is_empty());
    let left = std::fs::read_dir("/run/netns")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .count();
    assert_eq!(left, 0, "namespaces left behind after a panic");
}

/// A run killed with SIGKILL leaves its bpffs mount (`dpt-<pid>-bpffs`) and
/// pins behind; the next run's sweep unmounts and removes them.
#[test]
fn a_killed_runs_bpffs_mount_is_swept_by_the_next_run() {
    dataplane_tests::require_privileges();
    // The pid of a process that has exited and been reaped.
    let mut child = std::process::Command::new("true").spawn().expect("run true");
    child.wait().expect("wait for true");
    let stale = MountPoint::new(&format!("dpt-{}", child.id()), "bpffs");
    let out = std::process::Command::new("mount")
        .args(["-t", "bpf", "bpf"])
        .arg(stale.path())
        .output()
        .expect("run mount");
    assert!(
        out.status.success(),
        "mount bpffs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::create_dir(stale.path().join("dpt-pins")).expect("a pin directory in it");
    assert!(is_mounted(stale.path(), "bpf"));
    dataplane_tests::sweep_orphans();
    assert!(
        !is_mounted(stale.path(), "bpf"),
        "{} is still mounted after the sweep",
        stale.path().display()
    );
    assert!(
        !stale.path().exists(),
        "{} is still there",
        stale.path().display()
    );
}

/// `NetNs::run` hands closures to long-lived threads inside the namespace
/// (not a thread per call): one thread serves a caller's successive calls,
/// callers on several threads still run at once, a nested call gets a
/// thread of its own, panics reach the caller, and the threads are gone
/// once the namespace is dropped.
#[test]
fn netns_run_reuses_threads_inside_the_namespace_and_stops_them_on_drop() {
    use std::{
        collections::BTreeSet,
        os::unix::fs::MetadataExt as _,
        sync::atomic::{AtomicUsize, Ordering},
        time::{Duration, Instant},
    };

    use dataplane_tests::netns::NetNs;

    dataplane_tests::require_privileges();
    let ns = NetNs::new(&format!("{}-run", dataplane_tests::unique_prefix()));
    let path = ns.path();
    let ns_inode = std::fs::metadata(&path).unwrap().ino();
    // SAFETY: plain syscall.
    let tid = || unsafe { libc::gettid() };
    let inside = || std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino() == ns_inode;

    assert!(ns.run(inside), "run's thread is inside the namespace");
    assert!(!inside(), "the caller's thread is not");
    let tids: BTreeSet<i32> = (0..1000).map(|_| ns.run(tid)).collect();
    assert_eq!(tids.len(), 1, "1000 calls from one thread, one worker: {tids:?}");

    // Two callers at once: each closure waits for the other to start.
    let started = AtomicUsize::new(0);
    let met = || {
        started.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(5);
        while started.load(Ordering::SeqCst) < 2 {
            if Instant::now() > deadline {
                return None;
            }
            std::thread::yield_now();
        }
        Some(tid())
    };
    let parallel: Vec<Option<i32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2).map(|_| s.spawn(|| ns.run(met))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        parallel.iter().all(Option::is_some) && parallel[0] != parallel[1],
        "concurrent callers ran at once, on two workers: {parallel:?}"
    );

    let (outer, nested) = ns.run(|| (tid(), ns.run(tid)));
    assert_ne!(outer, nested, "a nested call runs on another worker");

    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ns.run(|| panic!("boom"))))
        .expect_err("the closure's panic reaches the caller");
    assert_eq!(panic.downcast_ref::<&str>(), Some(&"boom"));
    assert!(ns.run(inside), "run works after a panic");

    let workers: BTreeSet<i32> = tids.into_iter().chain(parallel.into_iter().flatten()).collect();
    drop(ns);
    assert!(!path.exists(), "{} deleted", path.display());
    for t in workers {
        assert!(
            !std::path::Path::new(&format!("/proc/self/task/{t}")).exists(),
            "worker thread {t} still runs after the namespace was dropped"
        );
    }
}

/// An echo server holds many connections at once (tasks on its one
/// thread, answering in any order) and closes them when dropped.
#[test]
fn an_echo_server_serves_concurrent_connections_and_closes_them_on_drop() {
    use dataplane_tests::echo::TcpClient;

    let mut cluster = Cluster::new();
    let a = cluster.add_pod(0, "a");
    let b = cluster.add_pod(1, "b");
    let (pa, pb) = (&cluster.pods[a], &cluster.pods[b]);
    let server = EchoServer::tcp(&pb.ns, "b", SocketAddrV4::new(pb.ip, 8080));
    let mut clients: Vec<TcpClient> = (0..50)
        .map(|i| TcpClient::connect(&pa.ns, server.addr).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    for (i, c) in clients.iter_mut().enumerate().rev() {
        let reply = c.request(&format!("r{i}")).expect("an answer");
        assert_eq!(
            (reply.server.as_str(), reply.peer, reply.payload),
            ("b", c.local_addr(), format!("r{i}"))
        );
    }
    drop(server);
    let err = clients[0]
        .request("after")
        .expect_err("the server closed its connections");
    assert!(
        matches!(
            err.kind(),
            std::io::ErrorKind::UnexpectedEof
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
        ),
        "{err}"
    );
}

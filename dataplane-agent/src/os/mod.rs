//! What the agent asks of the node's operating system that is not the
//! datapath: its interfaces, addresses and routes (rtnetlink), which of them
//! face pods (`pod_discovery`), a device's driver (ethtool), and where
//! cgroup v2 is mounted. Used by the
//! daemon, the load-balancer announcer and the preflight alike, below all of
//! them.

pub mod cgroup_mount;
pub mod device;
pub mod interfaces;
pub mod pod_discovery;

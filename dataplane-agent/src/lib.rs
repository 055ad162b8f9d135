//! The node agent of the dataplane.
//!
//! - [`agent`]: the `run` daemon: sources, sync loop, health and metrics.
//! - [`cli`]: the command line (the binary is `cli::main`).
//! - [`dataplane`]: loads the embedded kernel object, attaches its programs,
//!   and programs its maps through a typed API ([`dataplane::LbMaps`]).
//! - [`k8s`]: Services, EndpointSlices and the Node → Service port models,
//!   with kube-proxy's rules; the object store and the manifests source.
//! - [`lb`]: bare-metal LoadBalancers: address pools and allocation, L2
//!   (ARP/NDP) announcements with Lease-based election.
//! - [`net`]: small address types (CIDRs, protocols).
//! - [`preflight`]: `check`, what on a node blocks or disturbs the agent.
//! - [`state`]: the service table with kube-proxy's semantics, pure: desired
//!   state and the diff into ordered map operations.
pub mod agent;
pub mod cli;
pub mod dataplane;
pub mod k8s;
pub mod lb;
pub mod net;
pub mod os;
pub mod preflight;
pub mod prom;
pub mod state;

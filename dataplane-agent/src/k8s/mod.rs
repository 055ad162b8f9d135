//! Kubernetes objects in, the service table's inputs out.
//!
//! - [`model`]: Services + EndpointSlices + the Node → [`crate::state::inputs::ServicePort`]s,
//!   with kube-proxy's rules for which objects count, endpoint conditions,
//!   duplicates, topology, named ports, LoadBalancer ipMode.
//! - [`store`]: the objects as the sources deliver them, and the service ids.
//! - [`manifests`]: a source reading multi-document YAML files.
//! - [`service_cidrs`]: the service CIDRs in force (flags and ServiceCIDR
//!   objects).
//! - [`client`]: the API client the watchers share.
pub mod client;
pub mod manifests;
pub mod model;
pub mod service_cidrs;
pub mod store;

//! The service table: what the datapath should hold, computed without IO.
//!
//! - [`table`]: the vocabulary (frontends, backends, backend sets, Service
//!   port names) that `dataplane/` converts to the kernel ABI.
//! - [`inputs`]: a Service port as kube-proxy sees it (already split per IP
//!   family and port, endpoints resolved) and the node's view.
//! - [`desired`]: the pure function from a Service port to what it adds to
//!   the table, with kube-proxy's semantics, and the whole table at once.
//! - [`incremental`]: the table kept up to date port by port, with the
//!   owner of every frontend and the claims on every backend; [`stored`]:
//!   how it keeps each port's part, compactly.
//! - [`diff`]: turns the desired table and what the maps hold into ordered
//!   map operations (backends, slots, frontends; removals in reverse).
//! - [`ids`]: service and backend ids from free lists.
//! - [`backend_map`]: the map by backend key both of them keep (a million
//!   entries at scale: IPv4 keys packed).
//! - [`maglev`]: a backend set's Maglev table; [`derived`]: what the
//!   frontends written imply beyond their own entries (Maglev tables, the
//!   backend node's DSR entries).
pub mod backend_map;
pub mod derived;
pub mod desired;
pub mod diff;
#[cfg(test)]
pub mod fake;
pub mod ids;
pub mod incremental;
pub mod inputs;
pub mod maglev;
pub mod stored;
pub mod table;

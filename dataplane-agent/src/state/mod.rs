//! The service table: what the datapath should hold, computed without IO.
//!
//! - [`model`]: a Service port as kube-proxy sees it (already split per IP
//!   family and port, endpoints resolved) and the node's view.
//! - [`desired`]: the pure function from models to frontends and backend
//!   sets, with kube-proxy's semantics.
//! - [`diff`]: turns the current and the desired table into ordered map
//!   operations (backends, slots, frontends; removals in reverse), with
//!   backend ids from a free list.
pub mod desired;
pub mod diff;
pub mod model;

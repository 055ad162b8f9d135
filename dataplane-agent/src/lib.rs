//! The node agent of the dataplane.
//!
//! - [`dataplane`]: loads the embedded kernel object, attaches its programs,
//!   and programs its maps through a typed API ([`dataplane::LbMaps`]).
//! - [`net`]: small address types (CIDRs, protocols).
pub mod dataplane;
pub mod net;

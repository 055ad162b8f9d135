//! The node agent of the dataplane.
//!
//! - [`dataplane`]: loads the embedded kernel object, attaches its programs,
//!   reads and writes its maps.
pub mod dataplane;

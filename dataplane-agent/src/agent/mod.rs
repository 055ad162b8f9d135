//! `dataplane-agent run`: the daemon. Sources feed the object store; a sync
//! turns the store into the service table and programs the maps; health and
//! metrics servers report on it.
pub mod config;
pub mod health;
pub mod http;
pub mod interfaces;
pub mod kube_source;
pub mod metrics;
pub mod run;
pub mod sync;

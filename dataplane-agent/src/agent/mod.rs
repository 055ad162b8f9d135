//! `dataplane-agent run`: the daemon. Sources feed the object store; the
//! control loop syncs what changed into the service table and the maps;
//! health and metrics servers report on it.
pub mod config;
pub mod control;
pub mod counters;
pub mod ct_gc;
pub mod health;
pub mod http;
pub mod metrics;
pub mod pod_interfaces;
pub mod run;
pub mod source;
pub mod sync;

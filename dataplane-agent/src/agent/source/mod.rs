//! Where the store's objects come from, event by event: the Kubernetes API
//! (`kube`: watch events) or manifest files (`files`: inotify). Both turn
//! what they see into the store's objects off the control loop's thread and
//! send it an [`Event`]; the loop hands each to the [`Feed`] it started,
//! which applies it to the store.

use k8s_openapi::api::core::v1::ObjectReference;

pub mod files;
pub mod kube;

use crate::k8s::store::Store;
use files::{ManifestFeed, ManifestUpdate};
use kube::{Change, KubeSource, WarningEvent};

/// What wakes the loop.
pub enum Event {
    /// A change from the Kubernetes API.
    Kube(Change),
    /// Manifest files changed (parsed on the watcher's thread).
    Manifests(ManifestUpdate),
    /// A network interface, address or route changed.
    Links,
    /// SIGTERM or SIGINT.
    Stop,
}

/// The source the agent runs with.
pub enum Feed {
    Kube(KubeSource),
    Manifests(Box<ManifestFeed>),
}

impl Feed {
    /// Applies one event to the store.
    pub fn handle(&mut self, event: Event, store: &mut Store, node_name: &str) {
        match (self, event) {
            (Feed::Kube(_), Event::Kube(change)) => KubeSource::apply(change, store, node_name),
            (Feed::Manifests(m), Event::Manifests(update)) => m.apply_update(store, update),
            _ => {}
        }
    }

    /// A periodic look at the source for what events may have missed (the
    /// manifests watcher rescans every file; its result comes as an event).
    pub fn resync(&self) {
        if let Feed::Manifests(m) = self {
            m.request_rescan();
        }
    }

    /// A Warning event on a Service (API source only; logs cover the rest).
    pub fn warn(&self, store: &Store, object: &str, reason: &str, note: &str) {
        let Feed::Kube(source) = self else { return };
        let (ns, name) = object.split_once('/').unwrap_or(("default", object));
        source.warn(WarningEvent {
            reference: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Service".into()),
                namespace: Some(ns.into()),
                name: Some(name.into()),
                uid: store.service_uid(ns, name),
                ..Default::default()
            },
            reason: reason.into(),
            note: note.into(),
        });
    }
}

/// The object keys a change names, for logs.
pub fn describe(change: &Change) -> &'static str {
    match change {
        Change::Services(_) => "services",
        Change::Slices(_) => "endpointslices",
        Change::Node(_) => "node",
        Change::ServiceCidrs(_) => "servicecidrs",
    }
}

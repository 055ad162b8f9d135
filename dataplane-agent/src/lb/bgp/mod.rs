//! BGP announcements through BIRD 2 running beside the agent (a sidecar in
//! the DaemonSet; docs/loadbalancer.md, "BGP"): the agent decides what this
//! node announces ([`plan`]), renders BIRD's configuration and applies it
//! over BIRD's control socket ([`bird`]), and reads the sessions back into
//! metrics, `/healthz` and `dataplane-agent inspect bgp`.
//!
//! Level-triggered like the L2 announcer: every change of the watched
//! objects (Services, EndpointSlices, this Node, `BGPPeer`s,
//! `BGPAdvertisement`s) plans everything again; the file is rewritten and
//! BIRD reconfigured only when the text changes (or the last attempt
//! failed). A speaker that is missing or crashed is retried every poll; the
//! agent's other functions do not wait on it. Stopping withdraws every
//! announcement (sessions stay up) and waits, bounded, for BIRD to report
//! nothing exported: the datapath keeps serving meanwhile (make before
//! break).

pub mod bird;
pub mod plan;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tracing::{info, warn};

use super::{cache::Shared, request::ClassFilter};

/// Where the agent and BIRD meet (a volume both containers mount).
pub const DEFAULT_CONFIG: &str = "/run/dataplane/bird/bird.conf";
pub const DEFAULT_SOCKET: &str = "/run/dataplane/bird/bird.ctl";
/// How often the sessions are read back (and a failed apply retried).
const POLL: Duration = Duration::from_secs(2);
/// Longest wait for BIRD's answer to one command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for the withdrawal at shutdown.
const WITHDRAW_WAIT: Duration = Duration::from_secs(3);

/// The speaker's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BgpConfig {
    /// The configuration file BIRD reads (`bird -c`).
    pub config_path: PathBuf,
    /// BIRD's control socket (`bird -s`).
    pub socket: PathBuf,
}

impl Default for BgpConfig {
    fn default() -> Self {
        Self {
            config_path: DEFAULT_CONFIG.into(),
            socket: DEFAULT_SOCKET.into(),
        }
    }
}

/// What the speaker last saw, for metrics, `/healthz` and logs.
#[derive(Clone, Debug, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// BIRD answered the last poll.
    pub speaker_up: bool,
    /// Why it did not, or why it refused the last configuration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speaker_error: Option<String>,
    pub sessions: Vec<bird::Session>,
    /// Prefixes this node announces (to at least one peer).
    pub announced: u64,
    /// Peers this node sessions with.
    pub peers: u64,
    #[serde(skip)]
    pub reconfigurations: u64,
    #[serde(skip)]
    pub reconfiguration_failures: u64,
    /// BGPPeer/BGPAdvertisement objects left out: "Kind/name" → why.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub invalid: BTreeMap<String, String>,
}

pub type SharedStatus = Arc<Mutex<Status>>;

pub struct Speaker {
    identity: String,
    classes: ClassFilter,
    cfg: BgpConfig,
    shared: Shared,
    status: SharedStatus,
    recorder: Recorder,
    /// The text BIRD was last configured with successfully.
    applied: Option<String>,
    /// The text on disk.
    written: Option<String>,
    last_plan: Option<plan::Plan>,
    /// Problems already logged and recorded (each once).
    reported: BTreeMap<String, String>,
}

impl Speaker {
    pub fn new(
        client: Client,
        identity: &str,
        classes: ClassFilter,
        cfg: BgpConfig,
        shared: Shared,
        status: SharedStatus,
    ) -> Self {
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: "dataplane-bgp".into(),
                instance: Some(identity.to_owned()),
            },
        );
        // What an earlier run left: unchanged text is not applied again, so
        // a restarting agent does not disturb the sessions. Without one, a
        // configuration with no peers at once, so that BIRD can start
        // before the objects are listed.
        let written = std::fs::read_to_string(&cfg.config_path).ok().or_else(|| {
            let text = bird::render(&plan::Plan::default(), identity, false);
            match bird::write_config(&cfg.config_path, &text) {
                Ok(()) => Some(text),
                Err(e) => {
                    warn!(path = %cfg.config_path.display(), error = %e, "cannot write BIRD's configuration");
                    None
                }
            }
        });
        Self {
            identity: identity.to_owned(),
            classes,
            cfg,
            shared,
            status,
            recorder,
            applied: None,
            written,
            last_plan: None,
            reported: BTreeMap::new(),
        }
    }

    /// Runs until `stop` fires, then withdraws.
    pub async fn run(
        mut self,
        mut changes: tokio::sync::watch::Receiver<u64>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            self.round().await;
            tokio::select! {
                _ = stop.changed() => break,
                r = changes.changed() => if r.is_err() { break },
                _ = tokio::time::sleep(POLL) => {}
            }
        }
        self.withdraw().await;
    }

    fn plan(&self) -> Option<plan::Plan> {
        let w = self.shared.lock().expect("lb cache");
        if !(w.services.synced
            && w.slices.synced
            && w.nodes.synced
            && w.bgp_peers.synced
            && w.bgp_advertisements.synced
            && w.pools.synced)
        {
            return None;
        }
        Some(plan::plan(&plan::Inputs {
            node_name: &self.identity,
            node: w.nodes.objects.values().next(),
            classes: &self.classes,
            services: w.services.objects.values().collect(),
            slices: w.slices.objects.values().collect(),
            peers: w.bgp_peers.objects.values().collect(),
            advertisements: w.bgp_advertisements.objects.values().collect(),
            pools: w.pools.objects.values().collect(),
        }))
    }

    async fn round(&mut self) {
        if let Some(plan) = self.plan() {
            self.report_problems(&plan).await;
            let text = bird::render(&plan, &self.identity, false);
            {
                let mut s = self.status.lock().expect("bgp status");
                s.announced = plan.routes.len() as u64;
                s.peers = plan.peers.len() as u64;
            }
            if self.last_plan.as_ref() != Some(&plan) {
                info!(
                    peers = plan.peers.len(),
                    prefixes = plan.routes.len(),
                    invalid = plan.problems.len(),
                    "BGP announcements planned"
                );
                self.last_plan = Some(plan);
            }
            self.apply(text).await;
        }
        self.poll().await;
    }

    /// Writes `text` if it changed and has BIRD read it, unless BIRD
    /// already runs it.
    async fn apply(&mut self, text: String) {
        if self.written.as_deref() != Some(&text) {
            if let Err(e) = bird::write_config(&self.cfg.config_path, &text) {
                warn!(path = %self.cfg.config_path.display(), error = %e, "cannot write BIRD's configuration");
                self.status.lock().expect("bgp status").speaker_error =
                    Some(format!("cannot write the configuration: {e}"));
                return;
            }
            self.written = Some(text.clone());
        }
        if self.applied.as_deref() == Some(&text) {
            return;
        }
        let result = async {
            let mut c = bird::Control::connect(&self.cfg.socket, COMMAND_TIMEOUT).await?;
            c.configure().await
        }
        .await;
        let mut s = self.status.lock().expect("bgp status");
        match result {
            Ok(()) => {
                s.reconfigurations += 1;
                s.speaker_error = None;
                drop(s);
                info!(path = %self.cfg.config_path.display(), "BIRD reconfigured");
                self.applied = Some(text);
            }
            Err(e) => {
                s.reconfiguration_failures += 1;
                let first = s.speaker_error.as_deref() != Some(&e.to_string());
                s.speaker_error = Some(e.to_string());
                drop(s);
                if first {
                    warn!(error = %e, "cannot apply the BGP configuration; retrying every {}s", POLL.as_secs());
                }
            }
        }
    }

    /// Reads the sessions back.
    async fn poll(&mut self) {
        let result = async {
            let mut c = bird::Control::connect(&self.cfg.socket, COMMAND_TIMEOUT).await?;
            c.sessions().await
        }
        .await;
        let mut s = self.status.lock().expect("bgp status");
        match result {
            Ok(sessions) => {
                if !s.speaker_up {
                    info!(socket = %self.cfg.socket.display(), "BGP speaker reachable");
                }
                for new in &sessions {
                    let was = s
                        .sessions
                        .iter()
                        .find(|o| o.protocol == new.protocol)
                        .map(|o| o.up());
                    if was != Some(new.up()) && (was.is_some() || new.up()) {
                        if new.up() {
                            info!(peer = %new.peer, neighbor = %new.neighbor, "BGP session established");
                        } else {
                            warn!(peer = %new.peer, neighbor = %new.neighbor, state = %new.state, error = %new.error, "BGP session down");
                        }
                    }
                }
                s.speaker_up = true;
                s.sessions = sessions;
            }
            Err(e) => {
                if s.speaker_up || s.speaker_error.is_none() {
                    warn!(error = %e, "BGP speaker unreachable: nothing is announced from this node until it answers");
                }
                s.speaker_up = false;
                s.speaker_error = Some(e.to_string());
                s.sessions.clear();
                // Whatever BIRD runs when it comes back (it reads the file
                // itself) is applied again to be sure.
                self.applied = None;
            }
        }
    }

    async fn report_problems(&mut self, plan: &plan::Plan) {
        let now: BTreeMap<String, String> = plan
            .problems
            .iter()
            .map(|p| (format!("{}/{}", p.kind, p.name), p.message.clone()))
            .collect();
        for p in &plan.problems {
            let key = format!("{}/{}", p.kind, p.name);
            if self.reported.get(&key) == Some(&p.message) {
                continue;
            }
            warn!(kind = p.kind, name = %p.name, problem = %p.message, "BGP object left out");
            let reference = ObjectReference {
                api_version: Some(format!("{}/{}", super::crd::GROUP, super::crd::VERSION)),
                kind: Some(p.kind.to_owned()),
                name: Some(p.name.clone()),
                ..Default::default()
            };
            let ev = Event {
                type_: EventType::Warning,
                reason: "InvalidSpec".into(),
                note: Some(p.message.clone()),
                action: "AnnounceBGP".into(),
                secondary: None,
            };
            if let Err(e) = self.recorder.publish(&ev, &reference).await {
                warn!(error = %e, "cannot publish event");
            }
        }
        self.status.lock().expect("bgp status").invalid = now.clone();
        self.reported = now;
    }

    /// Stops announcing (sessions stay up, so routers withdraw at once) and
    /// waits until BIRD exports nothing, at most [`WITHDRAW_WAIT`].
    async fn withdraw(&mut self) {
        let Some(plan) = self.last_plan.clone() else {
            return;
        };
        if plan.routes.is_empty() {
            return;
        }
        let text = bird::render(&plan, &self.identity, true);
        if let Err(e) = bird::write_config(&self.cfg.config_path, &text) {
            warn!(error = %e, "cannot write BIRD's configuration to withdraw");
            return;
        }
        let deadline = Instant::now() + WITHDRAW_WAIT;
        let result = async {
            let mut c = bird::Control::connect(&self.cfg.socket, COMMAND_TIMEOUT).await?;
            c.configure().await?;
            loop {
                let sessions = c.sessions().await?;
                if sessions.iter().all(|s| s.exported == 0) || Instant::now() >= deadline {
                    return Ok::<_, bird::BirdError>(sessions.iter().map(|s| s.exported).sum::<u64>());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        .await;
        match result {
            Ok(0) => info!(prefixes = plan.routes.len(), "BGP announcements withdrawn"),
            Ok(left) => warn!(left, "BGP withdrawal not confirmed in time"),
            Err(e) => warn!(error = %e, "cannot withdraw the BGP announcements"),
        }
    }
}

//! Where the store's objects come from, event by event: the Kubernetes API
//! (watch events from [`KubeSource`]) or manifest files (inotify names the
//! file that was written, renamed into place or removed; only that file is
//! looked at, with [`ManifestSource`]'s rules: a file renamed into place is
//! applied at once, one written in place once it has been stable for
//! [`manifests::SETTLE`]).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    ffi::CString,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    sync::mpsc::Sender,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::ObjectReference;
use tracing::{info, warn};

use super::metrics::SharedMetrics;
use super::{
    control::Event,
    kube_source::{Change, KubeSource, WarningEvent},
};
use crate::k8s::{
    manifests::{self, Look, ManifestSource, Objects},
    model::{ServiceInfo, SliceInfo, proxied},
    store::{ObjectKey, Store},
};

/// The keys of what a manifest file holds in the store.
#[derive(Clone, Debug, Default)]
struct LoadedFile {
    services: Vec<ObjectKey>,
    slices: Vec<ObjectKey>,
    has_node: bool,
}

/// The manifests source, event-driven: inotify names the files that changed,
/// [`ManifestSource`] decides which versions are used (stable, valid; the
/// last good set of a broken file stays), and only those files' objects are
/// applied to the store.
pub struct ManifestFeed {
    source: ManifestSource,
    node_name: String,
    metrics: SharedMetrics,
    /// What each file put in the store (once the first set is out).
    files: BTreeMap<PathBuf, LoadedFile>,
    /// Files handed out before the first set was complete.
    initial: BTreeMap<PathBuf, Objects>,
    loaded: bool,
}

/// Changes inotify reported.
#[derive(Debug)]
pub enum FileChange {
    /// These files changed (or appeared, or went): `(file, whole)`, whole
    /// when it was renamed into place (complete, applied without settling).
    Files(Vec<(PathBuf, bool)>),
    /// Anything may have changed (first load, queue overflow, a watched
    /// directory that appeared): look at every file.
    Rescan,
}

pub enum Feed {
    Kube(KubeSource),
    Manifests(Box<ManifestFeed>),
}

impl Feed {
    /// Applies one event to the store.
    pub fn handle(&mut self, event: Event, store: &mut Store, node_name: &str) {
        match (self, event) {
            (Feed::Kube(_), Event::Kube(change)) => KubeSource::apply(change, store, node_name),
            (Feed::Manifests(m), Event::Manifests(change)) => m.reload(store, change),
            _ => {}
        }
    }

    /// When the source next needs a look without an event (a manifest
    /// file settling).
    pub fn deadline(&self) -> Option<Instant> {
        match self {
            Feed::Manifests(m) => m.deadline(),
            Feed::Kube(_) => None,
        }
    }

    /// The look [`Feed::deadline`] asked for.
    pub fn poll_due(&mut self, store: &mut Store) {
        if let Feed::Manifests(m) = self {
            m.reload(store, FileChange::Files(Vec::new()));
        }
    }

    /// A periodic look at the source for what events may have missed.
    pub fn resync(&mut self, store: &mut Store) {
        if let Feed::Manifests(m) = self {
            m.reload(store, FileChange::Rescan);
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

impl ManifestFeed {
    /// Watches `paths` (files or directories of `.yaml`/`.yml`/`.json`
    /// files) and sends their changes to `events`, the first load included.
    pub fn start(
        paths: Vec<PathBuf>,
        node_name: &str,
        metrics: SharedMetrics,
        events: Sender<Event>,
    ) -> std::io::Result<Self> {
        let watcher = Inotify::new(&paths)?;
        let _ = events.send(Event::Manifests(FileChange::Rescan));
        std::thread::Builder::new()
            .name("manifests-watch".into())
            .spawn(move || watcher.run(&events))?;
        Ok(Self {
            source: ManifestSource::new(paths),
            node_name: node_name.to_owned(),
            metrics,
            files: BTreeMap::new(),
            initial: BTreeMap::new(),
            loaded: false,
        })
    }

    /// When a changed file is next due for a look (it is settling).
    pub fn deadline(&self) -> Option<Instant> {
        self.source.next_deadline()
    }

    /// Looks at the files `change` names (and the settling ones) and applies
    /// the objects of every file whose set in force changed.
    pub fn reload(&mut self, store: &mut Store, change: FileChange) {
        let look = match &change {
            FileChange::Rescan => Look::All,
            FileChange::Files(files) => Look::Files(files),
        };
        let changes = self.source.poll_files(Instant::now(), look);
        {
            let mut m = self.metrics.lock().expect("metrics");
            for p in &changes.problems {
                warn!(origin = %p.origin, reason = %p.reason, "manifest not applied: {}", p.message);
                *m.skipped_objects.entry(p.reason.as_str()).or_default() += 1;
            }
            m.manifest_files_refused = self.source.refused_files() as u64;
        }
        if !self.loaded {
            for (file, objects) in changes.files {
                match objects {
                    Some(o) => self.initial.insert(file, o),
                    None => self.initial.remove(&file),
                };
            }
            if changes.started {
                self.first_load(store);
            }
            return;
        }
        for (file, objects) in changes.files {
            self.apply(store, file, objects);
        }
    }

    /// The first complete set is the initial list.
    fn first_load(&mut self, store: &mut Store) {
        let mut services = Vec::new();
        let mut slices = Vec::new();
        for (file, objects) in std::mem::take(&mut self.initial) {
            let (loaded, svcs, sls) = self.parse(store, objects);
            services.extend(svcs);
            slices.extend(sls);
            self.files.insert(file, loaded);
        }
        if !self.files.values().any(|f| f.has_node) {
            store.set_node(None);
        }
        store.replace_service_infos(services);
        store.replace_slice_infos(slices);
        self.loaded = true;
        info!(
            files = self.files.len(),
            services = store.service_count(),
            "manifests loaded"
        );
    }

    /// The proxied objects of a file (this node's Node goes to the store).
    fn parse(&self, store: &mut Store, objects: Objects) -> (LoadedFile, Vec<ServiceInfo>, Vec<SliceInfo>) {
        let services: Vec<ServiceInfo> = objects
            .services
            .iter()
            .filter(|s| proxied(s.metadata.labels.as_ref()))
            .map(ServiceInfo::parse)
            .collect();
        let slices: Vec<SliceInfo> = objects
            .slices
            .iter()
            .filter(|s| proxied(s.metadata.labels.as_ref()))
            .map(SliceInfo::parse)
            .collect();
        let mut loaded = LoadedFile {
            services: services.iter().map(|s| s.key.clone()).collect(),
            slices: slices.iter().map(|s| s.key.clone()).collect(),
            has_node: false,
        };
        if let Some(node) = objects
            .nodes
            .into_iter()
            .find(|n| n.metadata.name.as_deref() == Some(self.node_name.as_str()))
        {
            loaded.has_node = true;
            store.set_node(Some(node));
        }
        (loaded, services, slices)
    }

    /// One file's new objects (`None`: the file went) into the store.
    fn apply(&mut self, store: &mut Store, file: PathBuf, objects: Option<Objects>) {
        let old = self.files.remove(&file).unwrap_or_default();
        let Some(objects) = objects else {
            // Gone: so is what it held (unless another file holds it too).
            if old.has_node {
                store.set_node(None);
            }
            self.forget(store, &old);
            return;
        };
        let (loaded, services, slices) = self.parse(store, objects);
        if old.has_node && !loaded.has_node {
            store.set_node(None);
        }
        let kept_services: HashSet<&ObjectKey> = loaded.services.iter().collect();
        let kept_slices: HashSet<&ObjectKey> = loaded.slices.iter().collect();
        let gone = LoadedFile {
            services: old
                .services
                .into_iter()
                .filter(|k| !kept_services.contains(k))
                .collect(),
            slices: old
                .slices
                .into_iter()
                .filter(|k| !kept_slices.contains(k))
                .collect(),
            has_node: false,
        };
        self.files.insert(file, loaded);
        self.forget(store, &gone);
        services.into_iter().for_each(|s| store.upsert_service_info(s));
        slices.into_iter().for_each(|s| store.upsert_slice_info(s));
    }

    /// Removes what `file` held, unless another file holds it too.
    fn forget(&self, store: &mut Store, file: &LoadedFile) {
        for k in &file.services {
            if !self.files.values().any(|f| f.services.contains(k)) {
                store.remove_service(k);
            }
        }
        for k in &file.slices {
            if !self.files.values().any(|f| f.slices.contains(k)) {
                store.remove_slice(k);
            }
        }
    }
}

/// An inotify instance watching the manifests' directories.
struct Inotify {
    fd: i32,
    /// Directories to watch, and the file names that matter in each (`None`:
    /// every file).
    wanted: Vec<(PathBuf, Option<std::ffi::OsString>)>,
    /// Watch descriptor → directory.
    watches: HashMap<i32, PathBuf>,
}

const MASK: u32 = libc::IN_CLOSE_WRITE
    | libc::IN_MOVED_TO
    | libc::IN_MOVED_FROM
    | libc::IN_DELETE
    | libc::IN_CREATE
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF;

impl Inotify {
    fn new(paths: &[PathBuf]) -> std::io::Result<Self> {
        // SAFETY: plain syscall; the fd is ours and closed on drop.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let wanted = paths
            .iter()
            .map(|p| {
                if p.is_dir() {
                    (p.clone(), None)
                } else {
                    let dir = p
                        .parent()
                        .filter(|d| !d.as_os_str().is_empty())
                        .unwrap_or(Path::new("."));
                    (dir.to_owned(), p.file_name().map(|n| n.to_owned()))
                }
            })
            .collect();
        let mut w = Self {
            fd,
            wanted,
            watches: HashMap::new(),
        };
        w.add_missing();
        Ok(w)
    }

    /// Adds the watches that are not there yet (a directory that did not
    /// exist); true if any was added.
    fn add_missing(&mut self) -> bool {
        let mut added = false;
        for (dir, _) in &self.wanted {
            if self.watches.values().any(|d| d == dir) {
                continue;
            }
            let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else {
                continue;
            };
            // SAFETY: a valid NUL-terminated path and our inotify fd.
            let wd = unsafe { libc::inotify_add_watch(self.fd, c.as_ptr(), MASK) };
            if wd >= 0 {
                self.watches.insert(wd, dir.clone());
                added = true;
            }
        }
        added
    }

    /// A file named on the command line, or a manifest file (by its name:
    /// not hidden, `.yaml`/`.yml`/`.json`) in a directory named there.
    fn wants(&self, dir: &Path, name: &std::ffi::OsStr) -> bool {
        self.wanted.iter().any(|(d, n)| {
            d == dir
                && match n {
                    Some(n) => n == name,
                    None => manifests::is_manifest_name(Path::new(name)),
                }
        })
    }

    /// Reads events forever and sends them on (until the receiver is gone).
    fn run(mut self, events: &Sender<Event>) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let all = self.watches.len() == self.wanted.len();
            // Missing directories are retried every second.
            let mut pfd = libc::pollfd {
                fd: self.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&mut pfd, 1, if all { -1 } else { 1000 }) };
            if ready == 0 {
                if self.add_missing() && events.send(Event::Manifests(FileChange::Rescan)).is_err() {
                    return;
                }
                continue;
            }
            // SAFETY: reading into our own buffer.
            let n = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
            let mut files = Vec::new();
            let mut rescan = false;
            let mut at = 0;
            let header = std::mem::size_of::<libc::inotify_event>();
            while at + header <= n as usize {
                // SAFETY: the kernel wrote whole events; read_unaligned copes
                // with the buffer's alignment.
                let ev: libc::inotify_event = unsafe {
                    buf.as_ptr()
                        .add(at)
                        .cast::<libc::inotify_event>()
                        .read_unaligned()
                };
                let name_bytes = &buf[at + header..at + header + ev.len as usize];
                let name =
                    std::ffi::OsStr::from_bytes(name_bytes.split(|b| *b == 0).next().unwrap_or_default());
                at += header + ev.len as usize;
                if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                    rescan = true;
                    continue;
                }
                if ev.mask & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF | libc::IN_IGNORED) != 0 {
                    // The directory itself went: watch it again when it is back.
                    self.watches.remove(&ev.wd);
                    rescan = true;
                    continue;
                }
                let Some(dir) = self.watches.get(&ev.wd) else {
                    continue;
                };
                if ev.mask & libc::IN_ISDIR == 0 && self.wants(dir, name) {
                    // Renamed into place: whole, no need to let it settle.
                    files.push((dir.join(name), ev.mask & libc::IN_MOVED_TO != 0));
                }
            }
            let change = if rescan {
                Some(FileChange::Rescan)
            } else if !files.is_empty() {
                files.sort();
                files.dedup();
                Some(FileChange::Files(files))
            } else {
                None
            };
            if let Some(c) = change
                && events.send(Event::Manifests(c)).is_err()
            {
                return;
            }
        }
    }
}

impl Drop for Inotify {
    fn drop(&mut self) {
        // SAFETY: our own fd.
        unsafe { libc::close(self.fd) };
    }
}

/// The object keys a change names, for logs.
pub fn describe(change: &Change) -> &'static str {
    match change {
        Change::Services(_) => "services",
        Change::Slices(_) => "endpointslices",
        Change::Node(_) => "node",
    }
}

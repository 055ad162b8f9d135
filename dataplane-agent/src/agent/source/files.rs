//! The manifest files source: inotify names the file that was written,
//! renamed into place or removed; only that file is looked at, with
//! [`ManifestSource`]'s rules: a file renamed into place is applied at once,
//! one written in place once it has been stable for [`manifests::SETTLE`].
//!
//! Manifest files are read and parsed on their watcher's thread, never on
//! the control loop's: the watcher owns the [`ManifestSource`], looks at the
//! files inotify names (and at the settling ones when they are due, and at
//! every file when the loop asks for a rescan), turns their objects into the
//! store's and sends the loop only the result ([`ManifestUpdate`]). A large
//! file takes the watcher a while; the loop goes on syncing, answering
//! health checks and stopping on a signal meanwhile.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    ffi::CString,
    fs::File,
    io::{Read as _, Write as _},
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
    sync::mpsc::Sender,
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node;
use tracing::{info, warn};

use super::Event;
use crate::agent::metrics::SharedMetrics;
use crate::k8s::{
    manifests::{self, Look, ManifestSource, Objects, Problem},
    model::{ServiceInfo, SliceInfo, proxied},
    service_cidrs::ServiceCidrInfo,
    store::{ObjectKey, Store},
};

/// The keys of what a manifest file holds in the store.
#[derive(Clone, Debug, Default)]
struct LoadedFile {
    services: Vec<ObjectKey>,
    slices: Vec<ObjectKey>,
    has_node: bool,
    /// Its ServiceCIDRs (a few; kept whole: the set in force is their
    /// union over every file).
    service_cidrs: Vec<ServiceCidrInfo>,
}

impl LoadedFile {
    fn of(objects: &FileObjects) -> Self {
        Self {
            services: objects.services.iter().map(|s| s.key.clone()).collect(),
            slices: objects.slices.iter().map(|s| s.key.clone()).collect(),
            has_node: objects.node.is_some(),
            service_cidrs: objects.service_cidrs.clone(),
        }
    }
}

/// The proxied objects of one manifest file, ready for the store (parsed
/// on the watcher's thread).
#[derive(Debug, Default)]
struct FileObjects {
    services: Vec<ServiceInfo>,
    slices: Vec<SliceInfo>,
    /// This node's Node, if the file holds it.
    node: Option<Node>,
    service_cidrs: Vec<ServiceCidrInfo>,
}

impl FileObjects {
    fn of(objects: Objects, node_name: &str) -> Self {
        // Each object is dropped once converted: the file's objects are not
        // held twice.
        Self {
            services: objects
                .services
                .into_iter()
                .filter(|s| proxied(s.metadata.labels.as_ref()))
                .map(|s| ServiceInfo::parse(&s))
                .collect(),
            slices: objects
                .slices
                .into_iter()
                .filter(|s| proxied(s.metadata.labels.as_ref()))
                .map(|s| SliceInfo::parse(&s))
                .collect(),
            node: objects
                .nodes
                .into_iter()
                .find(|n| n.metadata.name.as_deref() == Some(node_name)),
            service_cidrs: objects.service_cidrs.iter().map(ServiceCidrInfo::parse).collect(),
        }
    }
}

/// What one look at the manifest files found, already parsed: the watcher
/// sends it to the loop, which only applies it to the store.
#[derive(Debug)]
pub struct ManifestUpdate {
    /// Problems with versions of files seen for the first time.
    problems: Vec<Problem>,
    /// Files whose current content is not in use (their last good set is).
    refused_files: usize,
    /// Files whose objects in force changed (`None`: the file went).
    files: Vec<(PathBuf, Option<FileObjects>)>,
    /// This look completed the first set (see
    /// [`manifests::FileChanges::started`]).
    started: bool,
}

/// The manifests source, event-driven: inotify names the files that changed,
/// [`ManifestSource`] (on the watcher's thread) decides which versions are
/// used (stable, valid; the last good set of a broken file stays), and only
/// those files' objects are applied to the store, here on the loop.
pub struct ManifestFeed {
    metrics: SharedMetrics,
    /// What each file put in the store (once the first set is out).
    files: BTreeMap<PathBuf, LoadedFile>,
    /// Files handed out before the first set was complete.
    initial: BTreeMap<PathBuf, FileObjects>,
    loaded: bool,
    /// An eventfd: written to ask the watcher for a rescan.
    rescan: File,
}

/// Changes inotify reported.
#[derive(Debug)]
enum FileChange {
    /// These files changed (or appeared, or went): `(file, whole)`, whole
    /// when it was renamed into place (complete, applied without settling).
    Files(Vec<(PathBuf, bool)>),
    /// Anything may have changed (queue overflow, a watched directory that
    /// appeared or went): look at every file.
    Rescan,
}

impl ManifestFeed {
    /// Watches `paths` (files or directories of `.yaml`/`.yml`/`.json`
    /// files) on a thread of its own, which reads and parses them and sends
    /// what changed to `events`, the first load included.
    pub fn start(
        paths: Vec<PathBuf>,
        node_name: &str,
        metrics: SharedMetrics,
        events: Sender<Event>,
    ) -> std::io::Result<Self> {
        // SAFETY: plain syscall; the fd is owned by the File from here on.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd that nothing else owns.
        let rescan = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let watcher = Watcher {
            inotify: Inotify::new(&paths)?,
            source: ManifestSource::new(paths),
            node_name: node_name.to_owned(),
            rescan: rescan.try_clone()?,
            refused_files: 0,
            events,
        };
        std::thread::Builder::new()
            .name("manifests-watch".into())
            .spawn(move || watcher.run())?;
        Ok(Self {
            metrics,
            files: BTreeMap::new(),
            initial: BTreeMap::new(),
            loaded: false,
            rescan,
        })
    }

    /// Asks the watcher to look at every file.
    pub(super) fn request_rescan(&self) {
        // Adds 1 to the eventfd's counter (it cannot overflow in practice;
        // a full counter already asks for a rescan).
        let _ = (&self.rescan).write(&1u64.to_ne_bytes());
    }

    /// Applies the objects of every file whose set in force changed (the
    /// first complete set as the initial list).
    pub fn apply_update(&mut self, store: &mut Store, update: ManifestUpdate) {
        {
            let mut m = self.metrics.lock().expect("metrics");
            for p in &update.problems {
                warn!(origin = %p.origin, reason = %p.reason, "manifest not applied: {}", p.message);
                *m.skipped_objects.entry(p.reason.as_str()).or_default() += 1;
            }
            m.manifest_files_refused = update.refused_files as u64;
        }
        if !self.loaded {
            for (file, objects) in update.files {
                match objects {
                    Some(o) => self.initial.insert(file, o),
                    None => self.initial.remove(&file),
                };
            }
            if update.started {
                self.first_load(store);
            }
            return;
        }
        for (file, objects) in update.files {
            self.apply(store, file, objects);
        }
        self.replace_service_cidrs(store);
    }

    /// The ServiceCIDRs of every file (the store notes whether they
    /// changed).
    fn replace_service_cidrs(&self, store: &mut Store) {
        store
            .service_cidrs_mut()
            .replace(self.files.values().flat_map(|f| f.service_cidrs.iter().cloned()));
    }

    /// The first complete set is the initial list.
    fn first_load(&mut self, store: &mut Store) {
        let mut services = Vec::new();
        let mut slices = Vec::new();
        for (file, objects) in std::mem::take(&mut self.initial) {
            self.files.insert(file, LoadedFile::of(&objects));
            if let Some(node) = objects.node {
                store.set_node(Some(node));
            }
            services.extend(objects.services);
            slices.extend(objects.slices);
        }
        if !self.files.values().any(|f| f.has_node) {
            store.set_node(None);
        }
        store.replace_service_infos(services);
        store.replace_slice_infos(slices);
        self.replace_service_cidrs(store);
        self.loaded = true;
        info!(
            files = self.files.len(),
            services = store.service_count(),
            "manifests loaded"
        );
    }

    /// One file's new objects (`None`: the file went) into the store.
    fn apply(&mut self, store: &mut Store, file: PathBuf, objects: Option<FileObjects>) {
        let old = self.files.remove(&file).unwrap_or_default();
        let Some(objects) = objects else {
            // Gone: so is what it held (unless another file holds it too).
            if old.has_node {
                store.set_node(None);
            }
            self.forget(store, &old);
            return;
        };
        let loaded = LoadedFile::of(&objects);
        match objects.node {
            Some(node) => store.set_node(Some(node)),
            None if old.has_node => store.set_node(None),
            None => {}
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
            service_cidrs: Vec::new(),
        };
        self.files.insert(file, loaded);
        self.forget(store, &gone);
        objects
            .services
            .into_iter()
            .for_each(|s| store.upsert_service_info(s));
        objects
            .slices
            .into_iter()
            .for_each(|s| store.upsert_slice_info(s));
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

/// The manifests watcher's thread: it waits for inotify events, a settling
/// file's deadline or a rescan request, looks at the files with the
/// [`ManifestSource`] and sends the loop what changed, parsed.
struct Watcher {
    inotify: Inotify,
    source: ManifestSource,
    node_name: String,
    /// The eventfd [`ManifestFeed::request_rescan`] writes to.
    rescan: File,
    /// The refused-file count last sent.
    refused_files: usize,
    events: Sender<Event>,
}

impl Watcher {
    /// Looks and sends until the loop is gone.
    fn run(mut self) {
        let mut buf = vec![0u8; 64 * 1024];
        // The first load.
        if !self.look(Look::All) {
            return;
        }
        loop {
            let now = Instant::now();
            let mut timeout = self
                .source
                .next_deadline()
                .map(|d| d.saturating_duration_since(now));
            if !self.inotify.all_watched() {
                // Missing directories are retried every second.
                timeout = Some(timeout.map_or(Duration::from_secs(1), |t| t.min(Duration::from_secs(1))));
            }
            // Rounded up: a wake-up before the deadline would find nothing due.
            let ms = timeout.map_or(-1, |t| {
                t.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32
            });
            let mut pfds = [
                libc::pollfd {
                    fd: self.inotify.fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.rescan.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds.
            let ready = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
            if ready < 0 {
                if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                    std::thread::sleep(Duration::from_secs(1));
                }
                continue;
            }
            let mut rescan = false;
            if pfds[1].revents & libc::POLLIN != 0 {
                // Reading resets the counter: requests made so far are served
                // by this look.
                let _ = (&self.rescan).read(&mut [0u8; 8]);
                rescan = true;
            }
            let mut files = Vec::new();
            if pfds[0].revents & libc::POLLIN != 0 {
                match self.inotify.read(&mut buf) {
                    Some(FileChange::Rescan) => rescan = true,
                    Some(FileChange::Files(f)) => files = f,
                    None => {}
                }
            }
            if !self.inotify.all_watched() && self.inotify.add_missing() {
                rescan = true;
            }
            let due = self.source.next_deadline().is_some_and(|d| Instant::now() >= d);
            let look = if rescan {
                Look::All
            } else if !files.is_empty() || due {
                Look::Files(&files)
            } else {
                continue;
            };
            if !self.look(look) {
                return;
            }
        }
    }

    /// Looks at the files `look` names (and the settling ones), parses the
    /// changed ones and sends the result; false once the loop is gone.
    fn look(&mut self, look: Look<'_>) -> bool {
        let changes = self.source.poll_files(Instant::now(), look);
        let refused_files = self.source.refused_files();
        if changes.files.is_empty()
            && changes.problems.is_empty()
            && !changes.started
            && refused_files == self.refused_files
        {
            return true;
        }
        self.refused_files = refused_files;
        let files = changes
            .files
            .into_iter()
            .map(|(file, objects)| (file, objects.map(|o| FileObjects::of(o, &self.node_name))))
            .collect();
        let update = ManifestUpdate {
            problems: changes.problems,
            refused_files,
            files,
            started: changes.started,
        };
        self.events.send(Event::Manifests(update)).is_ok()
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

    /// Every wanted directory is watched.
    fn all_watched(&self) -> bool {
        self.watches.len() == self.wanted.len()
    }

    /// Reads the queued events (the fd is readable) and says what changed.
    fn read(&mut self, buf: &mut [u8]) -> Option<FileChange> {
        // SAFETY: reading into our own buffer.
        let n = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                std::thread::sleep(Duration::from_secs(1));
            }
            return None;
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
            let name = std::ffi::OsStr::from_bytes(name_bytes.split(|b| *b == 0).next().unwrap_or_default());
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
        if rescan {
            Some(FileChange::Rescan)
        } else if !files.is_empty() {
            files.sort();
            files.dedup();
            Some(FileChange::Files(files))
        } else {
            None
        }
    }
}

impl Drop for Inotify {
    fn drop(&mut self) {
        // SAFETY: our own fd.
        unsafe { libc::close(self.fd) };
    }
}

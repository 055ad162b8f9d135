//! The static source: Services, EndpointSlices and optionally the Node from
//! YAML or JSON files (multi-document), reloaded when they change. Lets the
//! agent run without a cluster (demo, tests, benchmarks).
//!
//! A file is applied whole or not at all. Parsing is bounded (serde-saphyr
//! with budgets that follow the input's size; files above
//! [`MAX_FILE_BYTES`] are refused), and a file whose current content cannot
//! be used (a syntax error, an object that does not deserialize, a file that
//! suddenly became empty) keeps its last good set of objects in force. A
//! changed file is read again after [`SETTLE`] and used only when both reads
//! agree byte for byte, so a file caught in the middle of a non-atomic write
//! is not applied half-written (writers should still write a temporary file
//! and rename it over the old one). A watcher that saw a file renamed into
//! place knows it whole and skips the wait ([`Look::Files`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    hash::{Hash as _, Hasher as _},
    io::Read as _,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime},
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use serde_saphyr::Spanned;

use super::service_cidrs::ServiceCidrInfo;

/// Files larger than this are refused (the last good set stays).
pub const MAX_FILE_BYTES: u64 = 256 << 20;
/// A changed file is applied once two reads this far apart return the same
/// bytes.
pub const SETTLE: Duration = Duration::from_millis(100);

/// Why something in the manifests was not applied: the `reason` label of
/// `dataplane_skipped_objects_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SkipReason {
    /// Not YAML (or not UTF-8): the whole file is not used.
    Syntax,
    /// A document that is not a valid object of its kind (or has no kind or
    /// name): the whole file is not used.
    InvalidObject,
    /// An object of a kind the agent does not use: that object is skipped.
    UnsupportedKind,
    /// A file that had objects became empty: its last objects stay.
    EmptyFile,
    /// A file or directory that cannot be read or listed.
    Unreadable,
    /// A file above [`MAX_FILE_BYTES`].
    TooLarge,
}

impl SkipReason {
    pub const ALL: [Self; 6] = [
        Self::Syntax,
        Self::InvalidObject,
        Self::UnsupportedKind,
        Self::EmptyFile,
        Self::Unreadable,
        Self::TooLarge,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Syntax => "syntax",
            Self::InvalidObject => "invalid_object",
            Self::UnsupportedKind => "unsupported_kind",
            Self::EmptyFile => "empty_file",
            Self::Unreadable => "unreadable",
            Self::TooLarge => "too_large",
        }
    }
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Something in the manifests that was not applied, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// `file:line` (`file` alone when no line applies).
    pub origin: String,
    pub reason: SkipReason,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.origin, self.message)
    }
}

impl Problem {
    fn new(origin: impl Into<String>, reason: SkipReason, message: impl Into<String>) -> Self {
        Self {
            origin: origin.into(),
            reason,
            message: message.into(),
        }
    }
}

/// The objects of one load, and what was skipped without rejecting a file.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
    /// `networking.k8s.io/v1` ServiceCIDRs: their CIDRs are service CIDRs
    /// too, with `--service-cidr`'s.
    pub service_cidrs: Vec<ServiceCIDR>,
    pub problems: Vec<Problem>,
}

impl Objects {
    /// Replaces everything in `store` with these objects (the Node only if
    /// one is named `node_name`).
    pub fn replace_store(self, store: &mut super::store::Store, node_name: &str) {
        store.replace_services(self.services);
        store.replace_slices(self.slices);
        store.set_node(
            self.nodes
                .into_iter()
                .find(|n| n.metadata.name.as_deref() == Some(node_name)),
        );
        store
            .service_cidrs_mut()
            .replace(self.service_cidrs.iter().map(ServiceCidrInfo::parse));
    }

    fn len(&self) -> usize {
        self.services.len() + self.slices.len() + self.nodes.len() + self.service_cidrs.len()
    }

    fn extend(&mut self, other: &Objects) {
        self.services.extend(other.services.iter().cloned());
        self.slices.extend(other.slices.iter().cloned());
        self.nodes.extend(other.nodes.iter().cloned());
        self.service_cidrs.extend(other.service_cidrs.iter().cloned());
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("cannot read manifests at {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(Problem),
}

/// The files a manifests path stands for: the file itself, or the
/// `.yaml`/`.yml`/`.json` files of a directory (not recursive, hidden files
/// such as editors' and writers' temporary files ignored), sorted.
pub fn files(path: &Path) -> Result<Vec<PathBuf>, ManifestError> {
    let read_err = |source| ManifestError::Read {
        path: path.to_owned(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    if meta.is_file() {
        return Ok(vec![path.to_owned()]);
    }
    let mut out: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(read_err)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| is_manifest_name(p) && p.is_file())
        .collect();
    out.sort();
    Ok(out)
}

/// Whether a file in a manifests directory is read: a `.yaml`, `.yml` or
/// `.json` name that is not hidden.
pub fn is_manifest_name(file: &Path) -> bool {
    let hidden = file
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    !hidden
        && file
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
}

/// Loads every object under `paths`, all or nothing: the first file that
/// cannot be used is an error (for `trace --manifests`). Objects of kinds
/// the agent does not use are reported in [`Objects::problems`].
pub fn load(paths: &[PathBuf]) -> Result<Objects, ManifestError> {
    let mut objects = Objects::default();
    for path in paths {
        for file in files(path)? {
            let text = read_file(&file).map_err(ManifestError::Invalid)?;
            let parsed = parse(&text, &file.display().to_string()).map_err(ManifestError::Invalid)?;
            objects.extend(&parsed);
            objects.problems.extend(parsed.problems);
        }
    }
    Ok(objects)
}

/// Parses `text` (multi-document YAML; JSON is YAML) into `objects`; a text
/// that cannot be used adds one problem and no object.
pub fn load_text(text: &str, origin: &str, objects: &mut Objects) {
    match parse(text, origin) {
        Ok(parsed) => {
            objects.extend(&parsed);
            objects.problems.extend(parsed.problems);
        }
        Err(p) => objects.problems.push(p),
    }
}

/// Reads a manifests file: at most [`MAX_FILE_BYTES`], UTF-8.
fn read_file(file: &Path) -> Result<String, Problem> {
    let origin = file.display().to_string();
    let unreadable =
        |e: std::io::Error| Problem::new(&origin, SkipReason::Unreadable, format!("cannot read: {e}"));
    let mut bytes = Vec::new();
    std::fs::File::open(file)
        .and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(unreadable)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(Problem::new(
            &origin,
            SkipReason::TooLarge,
            format!("larger than {} MiB", MAX_FILE_BYTES >> 20),
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        Problem::new(
            &origin,
            SkipReason::Syntax,
            format!("not UTF-8 (byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

/// The parser's limits for an input of `len` bytes: serde-saphyr's
/// defaults (which bound alias bombs: a small file whose aliases expand to
/// millions of nodes is refused), raised for large inputs. Every document,
/// node and event takes at least a byte of input, so a large file gets
/// limits that follow its size (plus the same headroom for aliases): no
/// valid file is refused and the work stays linear in it. Aliases and
/// anchors keep serde-saphyr's own counts, nesting its depth limit.
fn parse_options(len: usize) -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_documents = budget.max_documents.max(len + 16);
    budget.max_nodes = budget.max_nodes.max(2 * len + 16);
    budget.max_events = budget.max_events.max(4 * len + 64);
    budget.max_total_scalar_bytes = budget.max_total_scalar_bytes.max(2 * len + 16);
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.with_snippet = false;
    options
}

/// Every object of a file, or the problem that makes the file unusable.
pub fn parse(text: &str, file: &str) -> Result<Objects, Problem> {
    let documents: Vec<Spanned<serde_json::Value>> =
        serde_saphyr::from_multiple_with_options(text, parse_options(text.len())).map_err(|e| {
            let mut message = e.to_string();
            let origin = match e.location() {
                Some(at) => {
                    let suffix = format!(" at line {}, column {}", at.line(), at.column());
                    if let Some(stripped) = message.strip_suffix(&suffix) {
                        message = stripped.to_owned();
                    }
                    format!("{file}:{}:{}", at.line(), at.column())
                }
                None => file.to_owned(),
            };
            Problem::new(origin, SkipReason::Syntax, message)
        })?;
    let mut objects = Objects::default();
    for doc in documents {
        add_value(doc.value, &format!("{file}:{}", doc.defined.line()), &mut objects)?;
    }
    Ok(objects)
}

fn add_value(value: serde_json::Value, origin: &str, objects: &mut Objects) -> Result<(), Problem> {
    let invalid = |message: String| Problem::new(origin, SkipReason::InvalidObject, message);
    let Some(kind) = value.get("kind").and_then(|k| k.as_str()).map(str::to_owned) else {
        return Err(invalid("a document without a `kind`".into()));
    };
    let name = value
        .pointer("/metadata/name")
        .and_then(|n| n.as_str())
        .unwrap_or("")
        .to_owned();
    let needs_name = matches!(
        kind.as_str(),
        "Service" | "EndpointSlice" | "Node" | "ServiceCIDR"
    );
    if needs_name && name.is_empty() {
        return Err(invalid(format!("a {kind} without metadata.name")));
    }
    let what = |e: serde_json::Error| invalid(format!("invalid {kind} {name:?}: {e}"));
    match kind.as_str() {
        "List" | "ServiceList" | "EndpointSliceList" | "NodeList" | "ServiceCIDRList" => {
            let Some(serde_json::Value::Array(items)) = value.get("items").cloned() else {
                return Err(invalid(format!("a {kind} without `items`")));
            };
            for item in items {
                add_value(item, origin, objects)?;
            }
        }
        "Service" => objects
            .services
            .push(serde_json::from_value(value).map_err(what)?),
        "EndpointSlice" => objects.slices.push(serde_json::from_value(value).map_err(what)?),
        "Node" => objects.nodes.push(serde_json::from_value(value).map_err(what)?),
        "ServiceCIDR" => objects
            .service_cidrs
            .push(serde_json::from_value(value).map_err(what)?),
        other => objects.problems.push(Problem::new(
            origin,
            SkipReason::UnsupportedKind,
            format!("kind {other:?} ({name}) is not used by the agent; skipped"),
        )),
    }
    Ok(())
}

/// What a file looked like on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Fingerprint {
    Present {
        len: u64,
        modified: Option<SystemTime>,
        inode: (u64, u64),
    },
    Absent,
}

fn fingerprint(file: &Path) -> Result<Fingerprint, std::io::Error> {
    match std::fs::metadata(file) {
        Ok(m) => Ok(Fingerprint::Present {
            len: m.len(),
            modified: m.modified().ok(),
            inode: (m.dev(), m.ino()),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Fingerprint::Absent),
        Err(e) => Err(e),
    }
}

#[derive(Debug, Default)]
struct FileState {
    /// The version last decided on (applied or refused).
    handled: Option<Fingerprint>,
    /// A new version seen but not yet stable: (fingerprint, content hash,
    /// first seen).
    pending: Option<(Fingerprint, u64, Instant)>,
    /// How many objects the version in force has (`None`: nothing from
    /// this file is in force). The objects themselves go to the caller.
    good: Option<usize>,
    /// The file's current content is not in use (its last good set is).
    refused: bool,
}

/// What one poll of the manifests found.
#[derive(Debug, Default)]
pub struct Update {
    /// Problems with versions of files seen for the first time (each is
    /// reported once).
    pub problems: Vec<Problem>,
    /// Every object now in force, when that changed.
    pub objects: Option<Objects>,
    /// Services and EndpointSlices added, changed or removed since the last
    /// applied set (as kube-proxy counts watch events).
    pub service_changes: u64,
    pub endpoint_changes: u64,
}

/// Which files a poll looks at (the pending ones are always looked at).
#[derive(Clone, Copy, Debug)]
pub enum Look<'a> {
    /// Every file the paths stand for now, and every file known.
    All,
    /// These files only, as a watcher reported them: `(file, whole)`. A
    /// whole file was renamed into place, so its content is complete and
    /// applied at once; the others settle for [`SETTLE`] first. The caller
    /// only names manifest files (see [`is_manifest_name`]).
    Files(&'a [(PathBuf, bool)]),
}

/// What one poll found, file by file.
#[derive(Debug, Default)]
pub struct FileChanges {
    /// Problems with versions of files seen for the first time (each is
    /// reported once).
    pub problems: Vec<Problem>,
    /// Files whose objects in force changed, with their new objects (`None`:
    /// the file went, and its objects with it).
    pub files: Vec<(PathBuf, Option<Objects>)>,
    /// This poll completed the first set: every file has settled, and the
    /// files handed out so far (this poll's included) are the initial list.
    pub started: bool,
}

/// The manifests source of `dataplane-agent run`: polls the paths, applies
/// each file's stable, valid versions and keeps the last good set of a file
/// whose current content cannot be used.
#[derive(Debug)]
pub struct ManifestSource {
    paths: Vec<PathBuf>,
    files: BTreeMap<PathBuf, FileState>,
    listing_errors: BTreeSet<PathBuf>,
    /// The last [`Look::All`] listed every path.
    listed_all: bool,
    /// What [`ManifestSource::poll`] hands out whole: the objects in force,
    /// by file (unused by [`ManifestSource::poll_files`]' callers, who keep
    /// what they need).
    whole: BTreeMap<PathBuf, Objects>,
    applied: ObjectVersions,
    /// A first set (possibly empty) has been handed out: the store counts
    /// as listed from then on.
    started: bool,
}

impl ManifestSource {
    pub fn new(paths: Vec<PathBuf>) -> Self {
        Self {
            paths,
            files: BTreeMap::new(),
            listing_errors: BTreeSet::new(),
            listed_all: false,
            whole: BTreeMap::new(),
            applied: ObjectVersions::default(),
            started: false,
        }
    }

    /// Files whose current content is not in use (their last good set is).
    pub fn refused_files(&self) -> usize {
        self.files.values().filter(|f| f.refused).count()
    }

    /// When a pending file is next due for a look (`None`: none pending).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.files
            .values()
            .filter_map(|f| f.pending.as_ref().map(|(_, _, since)| *since + SETTLE))
            .min()
    }

    /// Looks at every file; applies the versions that have been stable for
    /// [`SETTLE`] and hands out every object in force when that changed.
    pub fn poll(&mut self, now: Instant) -> Update {
        let changes = self.poll_files(now, Look::All);
        let mut update = Update {
            problems: changes.problems,
            ..Default::default()
        };
        if !changes.started && changes.files.is_empty() {
            return update;
        }
        for (file, objects) in changes.files {
            match objects {
                Some(o) => self.whole.insert(file, o),
                None => self.whole.remove(&file),
            };
        }
        let mut objects = Objects::default();
        for good in self.whole.values() {
            objects.extend(good);
        }
        let versions = ObjectVersions::of(&objects);
        (update.service_changes, update.endpoint_changes) = versions.changes_since(&self.applied);
        self.applied = versions;
        update.objects = Some(objects);
        update
    }

    /// Looks at the files `look` names and the pending ones; hands out the
    /// objects of each file whose set in force changed (an incremental
    /// caller keeps what it needs of them; nothing stays here).
    pub fn poll_files(&mut self, now: Instant, look: Look<'_>) -> FileChanges {
        let mut changes = FileChanges::default();
        let mut candidates: BTreeMap<PathBuf, bool> = self
            .files
            .iter()
            .filter(|(_, f)| f.pending.is_some())
            .map(|(p, _)| (p.clone(), false))
            .collect();
        match look {
            Look::All => {
                let mut listed_all = true;
                for path in &self.paths {
                    match files(path) {
                        Ok(list) => {
                            self.listing_errors.remove(path);
                            candidates.extend(list.into_iter().map(|f| (f, false)));
                        }
                        Err(e) => {
                            listed_all = false;
                            if self.listing_errors.insert(path.clone()) {
                                changes.problems.push(Problem::new(
                                    path.display().to_string(),
                                    SkipReason::Unreadable,
                                    format!("{e}; keeping the objects read from it so far"),
                                ));
                            }
                        }
                    }
                }
                if listed_all {
                    // Files that went away: their removal is applied once
                    // stable too.
                    candidates.extend(self.files.keys().map(|f| (f.clone(), false)));
                }
                self.listed_all = listed_all;
            }
            Look::Files(files) => {
                for (file, whole) in files {
                    *candidates.entry(file.clone()).or_default() |= *whole;
                }
            }
        }
        for (file, whole) in candidates {
            let settle = if whole { Duration::ZERO } else { SETTLE };
            if let Some(objects) = self.poll_file(&file, now, settle, &mut changes.problems) {
                changes.files.push((file, objects));
            }
        }
        self.files
            .retain(|_, f| f.good.is_some() || f.pending.is_some() || f.refused);
        // The first set goes out once every file has settled, even when it
        // is empty (an empty directory, or only files that cannot be used).
        if !self.started && self.listed_all && self.files.values().all(|f| f.pending.is_none()) {
            self.started = true;
            changes.started = true;
        }
        changes
    }

    /// `Some` when the set of objects in force changed: the file's new
    /// objects, or `None` when it went. A version is used once two reads
    /// `settle` apart agree.
    fn poll_file(
        &mut self,
        file: &Path,
        now: Instant,
        settle: Duration,
        problems: &mut Vec<Problem>,
    ) -> Option<Option<Objects>> {
        let origin = file.display().to_string();
        let state = self.files.entry(file.to_owned()).or_default();
        let fp = match fingerprint(file) {
            Ok(fp) => fp,
            Err(e) => {
                if !state.refused {
                    state.refused = true;
                    problems.push(Problem::new(&origin, SkipReason::Unreadable, format!("{e}")));
                }
                return None;
            }
        };
        if state.handled.as_ref() == Some(&fp) || (fp == Fingerprint::Absent && state.handled.is_none()) {
            state.pending = None;
            return None;
        }
        let content = match fp {
            Fingerprint::Absent => Ok(String::new()),
            Fingerprint::Present { .. } => read_file(file),
        };
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        match &content {
            Ok(text) => text.hash(&mut hasher),
            Err(p) => p.message.hash(&mut hasher),
        }
        let hash = hasher.finish();
        let since = match &state.pending {
            Some((pfp, phash, since)) if *pfp == fp && *phash == hash => *since,
            _ => {
                state.pending = Some((fp.clone(), hash, now));
                now
            }
        };
        if now.duration_since(since) < settle {
            return None;
        }
        state.pending = None;
        state.handled = Some(fp.clone());
        let keeping = |state: &FileState| match state.good {
            Some(good) => format!("keeping the {good} objects of its last good version"),
            None => "nothing from it is used".to_owned(),
        };
        if fp == Fingerprint::Absent {
            state.refused = false;
            return state.good.take().map(|_| None);
        }
        let parsed = content.and_then(|text| {
            if text.trim().is_empty() && state.good.is_some_and(|g| g > 0) {
                return Err(Problem::new(
                    &origin,
                    SkipReason::EmptyFile,
                    "the file became empty (a truncation or an unfinished write?); delete the file, or leave a comment in it, to remove its objects",
                ));
            }
            parse(&text, &origin)
        });
        match parsed {
            Ok(objects) => {
                problems.extend(objects.problems.iter().cloned());
                state.refused = false;
                state.good = Some(objects.len());
                Some(Some(objects))
            }
            Err(mut p) => {
                p.message = format!("{}; {}", p.message, keeping(state));
                problems.push(p);
                state.refused = true;
                None
            }
        }
    }
}

/// (namespace/name → content) of Services and EndpointSlices, to count
/// changes between loads as kube-proxy counts watch events.
#[derive(Debug, Default)]
struct ObjectVersions {
    services: BTreeMap<String, String>,
    slices: BTreeMap<String, String>,
}

impl ObjectVersions {
    fn of(objects: &Objects) -> Self {
        let key = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
            format!(
                "{}/{}",
                m.namespace.as_deref().unwrap_or("default"),
                m.name.as_deref().unwrap_or("")
            )
        };
        Self {
            services: objects
                .services
                .iter()
                .map(|s| (key(&s.metadata), serde_json::to_string(s).unwrap_or_default()))
                .collect(),
            slices: objects
                .slices
                .iter()
                .map(|s| (key(&s.metadata), serde_json::to_string(s).unwrap_or_default()))
                .collect(),
        }
    }

    fn changes_since(&self, old: &Self) -> (u64, u64) {
        let diff = |a: &BTreeMap<String, String>, b: &BTreeMap<String, String>| {
            let changed = a.iter().filter(|(k, v)| b.get(*k) != Some(v)).count();
            let removed = b.keys().filter(|k| !a.contains_key(*k)).count();
            (changed + removed) as u64
        };
        (
            diff(&self.services, &old.services),
            diff(&self.slices, &old.slices),
        )
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `case` (a test in this module) in a child process with an
    /// address-space limit and a deadline: a parser that loops or grows
    /// without bound fails the test instead of hanging the machine.
    fn bounded(case: &str) -> String {
        use std::os::unix::process::CommandExt as _;
        const CHILD: &str = "DATAPLANE_BOUNDED_CHILD";
        const MEMORY: libc::rlim_t = 1 << 30;
        if std::env::var_os(CHILD).is_some() {
            unreachable!("the child runs the case itself");
        }
        let mut cmd = std::process::Command::new(std::env::current_exe().expect("test binary"));
        cmd.args(["--exact", case, "--nocapture", "--test-threads", "1"])
            .env(CHILD, "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between
        // fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                let limit = libc::rlimit {
                    rlim_cur: MEMORY,
                    rlim_max: MEMORY,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawn the bounded child");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                let out = child.wait_with_output().expect("output");
                let text =
                    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
                assert!(
                    status.success(),
                    "{case} failed within 1 GiB / 20 s ({status}):\n{text}"
                );
                return text;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{case} did not finish within 20 s (endless parse?)");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    fn in_child() -> bool {
        std::env::var_os("DATAPLANE_BOUNDED_CHILD").is_some()
    }

    #[test]
    fn a_syntax_error_is_reported_in_bounded_time_and_memory() {
        if !in_child() {
            bounded("k8s::manifests::tests::a_syntax_error_is_reported_in_bounded_time_and_memory");
            return;
        }
        for text in [
            "a: [",
            "kind: Service\nmetadata: {name: x\n---\nkind: Service\n",
            "- [\n- ]]\n",
        ] {
            let mut objects = Objects::default();
            load_text(text, "broken.yaml", &mut objects);
            assert!(!objects.problems.is_empty(), "{text:?}: no problem reported");
            assert!(
                objects.problems.len() < 10,
                "{text:?}: {} problems",
                objects.problems.len()
            );
        }
    }

    #[test]
    fn alias_bombs_and_deep_nesting_are_refused_in_bounded_time_and_memory() {
        if !in_child() {
            bounded(
                "k8s::manifests::tests::alias_bombs_and_deep_nesting_are_refused_in_bounded_time_and_memory",
            );
            return;
        }
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..12 {
            let prev = (b'a' + i - 1) as char;
            let name = (b'a' + i) as char;
            bomb.push_str(&format!("{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"));
        }
        let deep = "[".repeat(100_000);
        for text in [bomb, deep] {
            let err = parse(&text, "bomb.yaml").expect_err("refused");
            assert_eq!(err.reason, SkipReason::Syntax, "{err}");
        }
    }

    /// Anchors and aliases are plain YAML: a small file that reuses a node
    /// several times (its expansion larger than the file) is accepted.
    #[test]
    fn anchors_and_aliases_in_a_valid_file_are_accepted() {
        let mut text = String::from(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  \
             labels: {kubernetes.io/service-name: web}\naddressType: IPv4\nports: [{name: http, port: 8080}]\n\
             endpoints:\n- addresses: [10.244.0.1]\n  conditions: &c {ready: true, serving: true, terminating: false}\n",
        );
        for i in 2..40 {
            text.push_str(&format!("- addresses: [10.244.0.{i}]\n  conditions: *c\n"));
        }
        let o = parse(&text, "alias.yaml").unwrap_or_else(|p| panic!("refused: {p}"));
        assert_eq!(o.slices.len(), 1);
        assert!(o.problems.is_empty(), "{:?}", o.problems);
    }

    const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{name: http, port: 80}]\n";

    #[test]
    fn a_syntax_error_names_the_file_line_and_column() {
        let text = format!("{WEB}---\nkind: Service\nmetadata: {{name: b\nspec: x\n");
        let p = parse(&text, "web.yaml").expect_err("syntax error");
        assert_eq!(p.reason, SkipReason::Syntax);
        assert!(p.origin.starts_with("web.yaml:"), "{p}");
        let line: u32 = p.origin.split(':').nth(1).unwrap().parse().unwrap();
        assert!((8..=10).contains(&line), "{p}");
    }

    #[test]
    fn an_invalid_object_refuses_the_file_and_says_which_object_and_line() {
        let text = format!(
            "{WEB}---\n{}",
            WEB.replace("name: web", "name: bad")
                .replace("port: 80", "port: eighty")
        );
        let p = parse(&text, "web.yaml").expect_err("port: eighty");
        assert_eq!(p.reason, SkipReason::InvalidObject);
        assert_eq!(p.origin, "web.yaml:8", "{p}");
        assert!(
            p.message.contains("\"bad\"") && p.message.contains("eighty"),
            "{p}"
        );
        for (doc, why) in [
            ("metadata: {name: x}\n", "without a `kind`"),
            (
                "kind: Service\nmetadata: {namespace: x}\n",
                "without metadata.name",
            ),
        ] {
            let p = parse(doc, "f.yaml").expect_err(why);
            assert!(p.message.contains(why), "{p}");
        }
    }

    #[test]
    fn service_cidrs_are_read_and_reach_the_store() {
        let text = format!(
            "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: extra}}\nspec: {{cidrs: [10.100.0.0/24, 'fd00:100::/112']}}\n---\n{WEB}"
        );
        let o = parse(&text, "f.yaml").expect("valid");
        assert!(o.problems.is_empty(), "{:?}", o.problems);
        assert_eq!((o.services.len(), o.service_cidrs.len()), (1, 1));
        let mut store = super::super::store::Store::default();
        o.replace_store(&mut store, "node1");
        assert!(store.service_cidrs_mut().take_changed());
        let cidrs: Vec<String> = store.service_cidrs().cidrs().map(|c| c.to_string()).collect();
        assert_eq!(cidrs, ["10.100.0.0/24", "fd00:100::/112"]);
        let p = parse("kind: ServiceCIDR\nspec: {cidrs: [10.0.0.0/8]}\n", "f.yaml").expect_err("no name");
        assert!(p.message.contains("without metadata.name"), "{p}");
    }

    #[test]
    fn unused_kinds_are_skipped_with_a_problem_and_the_rest_is_kept() {
        let text = format!("kind: ConfigMap\nmetadata: {{name: c}}\n---\n{WEB}---\n# only a comment\n");
        let o = parse(&text, "f.yaml").expect("valid");
        assert_eq!(o.services.len(), 1);
        assert_eq!(o.problems.len(), 1);
        assert_eq!(o.problems[0].reason, SkipReason::UnsupportedKind);
        assert_eq!(o.problems[0].origin, "f.yaml:1");
    }

    /// A scratch directory for source tests, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Self {
            let p = std::env::temp_dir().join(format!("dataplane-manifests-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }

        fn write(&self, name: &str, text: &str) {
            std::fs::write(self.0.join(name), text).unwrap();
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Polls twice, `SETTLE` apart (the clock is passed in, not slept).
    fn settle(src: &mut ManifestSource, t: &mut Instant) -> Update {
        let first = src.poll(*t);
        assert!(first.objects.is_none(), "applied before it was stable");
        *t += SETTLE;
        src.poll(*t)
    }

    fn names(o: &Objects) -> Vec<String> {
        o.services
            .iter()
            .map(|s| s.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    #[test]
    fn the_source_keeps_the_last_good_set_of_a_file_that_breaks_or_empties_until_it_is_deleted() {
        let dir = Dir::new("last-good");
        let mut t = Instant::now();
        let mut src = ManifestSource::new(vec![dir.0.clone()]);
        dir.write("web.yaml", WEB);
        dir.write("other.yaml", &WEB.replace("name: web", "name: other"));
        let u = settle(&mut src, &mut t);
        assert_eq!(names(u.objects.as_ref().expect("applied")), ["other", "web"]);
        assert_eq!(u.service_changes, 2);

        // A syntax error: reported once, with the line; the last good set stays.
        dir.write("web.yaml", &format!("{WEB}---\na: [\n"));
        let u = settle(&mut src, &mut t);
        assert!(u.objects.is_none());
        assert_eq!(u.problems.len(), 1, "{:?}", u.problems);
        assert_eq!(u.problems[0].reason, SkipReason::Syntax);
        assert!(
            u.problems[0].message.contains("keeping the 1 objects"),
            "{}",
            u.problems[0]
        );
        assert_eq!(src.refused_files(), 1);
        t += SETTLE;
        assert!(src.poll(t).problems.is_empty(), "reported once per version");

        // Fixed: applied again.
        dir.write("web.yaml", &WEB.replace("10.96.0.10", "10.96.0.11"));
        let u = settle(&mut src, &mut t);
        assert_eq!(names(u.objects.as_ref().expect("applied")), ["other", "web"]);
        assert_eq!((u.service_changes, src.refused_files()), (1, 0));

        // Truncated to nothing: suspicious, the objects stay.
        dir.write("web.yaml", "");
        let u = settle(&mut src, &mut t);
        assert!(u.objects.is_none());
        assert_eq!(u.problems[0].reason, SkipReason::EmptyFile);

        // Deleted: its objects go.
        std::fs::remove_file(dir.0.join("web.yaml")).unwrap();
        let u = settle(&mut src, &mut t);
        assert_eq!(names(u.objects.as_ref().expect("applied")), ["other"]);
        assert_eq!(u.service_changes, 1);
    }

    #[test]
    fn a_file_caught_in_the_middle_of_a_write_is_applied_only_once_stable() {
        let dir = Dir::new("partial");
        let mut t = Instant::now();
        let mut src = ManifestSource::new(vec![dir.0.clone()]);
        let two = format!("{WEB}---\n{}", WEB.replace("name: web", "name: second"));
        // Half written: a valid prefix (one of two documents).
        dir.write("web.yaml", WEB);
        assert!(src.poll(t).objects.is_none());
        t += SETTLE;
        // The rest arrives before the second look: nothing applied yet.
        dir.write("web.yaml", &two);
        assert!(src.poll(t).objects.is_none(), "a changing file is not applied");
        t += SETTLE;
        let u = src.poll(t);
        assert_eq!(names(u.objects.as_ref().expect("applied")), ["web", "second"]);
        // An empty directory is a (empty) set of its own at once.
        let empty = Dir::new("empty-dir");
        let mut none = ManifestSource::new(vec![empty.0.clone()]);
        let u = none.poll(t);
        assert!(u.objects.is_some_and(|o| o.len() == 0) && u.problems.is_empty());
        assert!(none.poll(t).objects.is_none(), "handed out once");
        // A file that starts empty applies nothing, without a complaint.
        dir.write("empty.yaml", "");
        let u = settle(&mut src, &mut t);
        assert!(u.problems.is_empty(), "{:?}", u.problems);
    }

    #[test]
    fn a_watcher_hands_out_only_the_files_that_changed_and_renamed_files_at_once() {
        let dir = Dir::new("files");
        let mut t = Instant::now();
        let mut src = ManifestSource::new(vec![dir.0.clone()]);
        dir.write("web.yaml", WEB);
        dir.write("other.yaml", &WEB.replace("name: web", "name: other"));
        assert!(src.poll_files(t, Look::All).files.is_empty(), "settling");
        assert_eq!(src.next_deadline(), Some(t + SETTLE));
        t += SETTLE;
        let c = src.poll_files(t, Look::Files(&[]));
        assert!(c.started, "the first set is complete");
        assert_eq!(c.files.len(), 2);
        assert_eq!(src.next_deadline(), None);

        // Renamed into place: whole, applied at the first look; only that
        // file is handed out.
        let web = dir.0.join("web.yaml");
        dir.write("web.yaml", &WEB.replace("10.96.0.10", "10.96.0.11"));
        let c = src.poll_files(t, Look::Files(&[(web.clone(), true)]));
        assert!(!c.started);
        assert_eq!(c.files.len(), 1);
        assert_eq!(c.files[0].0, web);
        assert_eq!(names(c.files[0].1.as_ref().expect("new objects")), ["web"]);

        // Written in place: it settles first, then goes out without being
        // named again.
        dir.write("web.yaml", &WEB.replace("10.96.0.10", "10.96.0.12"));
        assert!(
            src.poll_files(t, Look::Files(&[(web.clone(), false)]))
                .files
                .is_empty()
        );
        t += SETTLE;
        let c = src.poll_files(t, Look::Files(&[]));
        assert_eq!(c.files.len(), 1);

        // A broken version keeps the last good set: nothing handed out.
        dir.write("web.yaml", "a: [\n");
        let c = src.poll_files(t, Look::Files(&[(web.clone(), true)]));
        assert!(c.files.is_empty());
        assert_eq!(c.problems[0].reason, SkipReason::Syntax);

        // Removed: handed out as gone once the removal settled.
        std::fs::remove_file(&web).unwrap();
        assert!(
            src.poll_files(t, Look::Files(&[(web.clone(), false)]))
                .files
                .is_empty()
        );
        t += SETTLE;
        let c = src.poll_files(t, Look::Files(&[]));
        assert_eq!(c.files.len(), 1);
        assert!(c.files[0].1.is_none());
    }
}

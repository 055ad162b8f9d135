//! The static source: Services, EndpointSlices and optionally the Node from
//! YAML or JSON files (multi-document), reloaded when they change. Lets the
//! agent run without a cluster (demo, tests, benchmarks).

use std::{
    path::{Path, PathBuf},
    time::SystemTime,
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde::Deserialize as _;

/// The objects of one load, and what could not be read.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
    /// `file: problem`, one per document or file that was skipped.
    pub problems: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("cannot read manifests at {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The files a manifests path stands for: the file itself, or the
/// `.yaml`/`.yml`/`.json` files of a directory (not recursive), sorted.
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
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// What identifies the current content of the paths: reload when it changes.
pub fn fingerprint(paths: &[PathBuf]) -> Vec<(PathBuf, Option<SystemTime>, u64)> {
    let mut out = Vec::new();
    for p in paths {
        for f in files(p).unwrap_or_default() {
            let meta = std::fs::metadata(&f).ok();
            out.push((
                f,
                meta.as_ref().and_then(|m| m.modified().ok()),
                meta.map_or(0, |m| m.len()),
            ));
        }
    }
    out
}

/// Loads every object under `paths`. A document that does not parse, or
/// of a kind the agent does not use, is reported and skipped; the rest
/// loads.
pub fn load(paths: &[PathBuf]) -> Result<Objects, ManifestError> {
    let mut objects = Objects::default();
    for path in paths {
        for file in files(path)? {
            let text = std::fs::read_to_string(&file).map_err(|source| ManifestError::Read {
                path: file.clone(),
                source,
            })?;
            load_text(&text, &file.display().to_string(), &mut objects);
        }
    }
    Ok(objects)
}

/// Parses multi-document YAML (JSON is YAML) into `objects`.
pub fn load_text(text: &str, origin: &str, objects: &mut Objects) {
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = match serde_yaml::Value::deserialize(doc) {
            Ok(serde_yaml::Value::Null) => continue,
            Ok(v) => v,
            Err(e) => {
                objects
                    .problems
                    .push(format!("{origin}: document {}: {e}", i + 1));
                continue;
            }
        };
        add_value(value, &format!("{origin}: document {}", i + 1), objects);
    }
}

fn add_value(value: serde_yaml::Value, origin: &str, objects: &mut Objects) {
    let kind = value
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_owned();
    let parsed = match kind.as_str() {
        "List" | "ServiceList" | "EndpointSliceList" | "NodeList" => {
            if let Some(serde_yaml::Value::Sequence(items)) = value.get("items").cloned() {
                for item in items {
                    add_value(item, origin, objects);
                }
            }
            Ok(())
        }
        "Service" => serde_yaml::from_value(value).map(|s| objects.services.push(s)),
        "EndpointSlice" => serde_yaml::from_value(value).map(|s| objects.slices.push(s)),
        "Node" => serde_yaml::from_value(value).map(|n| objects.nodes.push(n)),
        other => {
            objects.problems.push(format!(
                "{origin}: kind {other:?} is not used by the agent; skipped"
            ));
            Ok(())
        }
    };
    if let Err(e) = parsed {
        objects.problems.push(format!("{origin}: invalid {kind}: {e}"));
    }
}

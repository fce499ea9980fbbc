//! The request path's metric handles, looked up once per label set.
//!
//! `metrics::counter!(NAME, "tenant" => tenant.to_string(), ...)` builds a key (label strings
//! allocated, the whole key hashed) and looks it up in the recorder's registry on every call;
//! a relayed request records about ten series that way. Here each (name, labels) gets its
//! handle from the recorder once and is found again by a hash of the borrowed label values,
//! with no allocation. Handles are only cached once kvgate's recorder is installed (a handle
//! taken before would be a no-op one forever), and at most [`MAX_CACHED`] of each kind (the
//! label values come from the configuration, so this is never reached in practice; beyond
//! it, series are looked up as before).

use std::hash::{Hash, Hasher};
use std::sync::LazyLock;

use metrics::{Counter, Histogram, Key, Label, Level, Metadata};
use parking_lot::RwLock;
use rustc_hash::{FxHashMap, FxHasher};

/// Most handles cached per kind.
pub const MAX_CACHED: usize = 4096;

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

type Labels<'a> = [(&'static str, &'a str)];

struct Cache<H> {
    map: RwLock<Entries<H>>,
}

struct Entries<H> {
    /// By hash of name and labels; each entry checked against its key (collisions). The
    /// labels are the configuration's tenant and model names, not a client's input, so a
    /// fast unkeyed hash (Fx) is enough.
    by_hash: FxHashMap<u64, Vec<(Key, H)>>,
    /// Handles in `by_hash`, so the bound is checked without walking the map.
    len: usize,
}

impl<H: Clone> Cache<H> {
    fn new() -> Cache<H> {
        Cache {
            map: RwLock::new(Entries {
                by_hash: FxHashMap::default(),
                len: 0,
            }),
        }
    }

    fn get(&self, name: &'static str, labels: &Labels<'_>, register: fn(&Key) -> H) -> H {
        if !super::recorder_installed() {
            return register(&key(name, labels));
        }
        let hash = hash(name, labels);
        if let Some(entries) = self.map.read().by_hash.get(&hash)
            && let Some((_, handle)) = entries.iter().find(|(key, _)| same(key, name, labels))
        {
            return handle.clone();
        }
        let key = key(name, labels);
        let handle = register(&key);
        let mut guard = self.map.write();
        let map = &mut *guard;
        if map.len < MAX_CACHED {
            let entries = map.by_hash.entry(hash).or_default();
            if !entries.iter().any(|(cached, _)| *cached == key) {
                entries.push((key, handle.clone()));
                map.len += 1;
            }
        }
        handle
    }
}

fn hash(name: &str, labels: &Labels<'_>) -> u64 {
    let mut hasher = FxHasher::default();
    name.hash(&mut hasher);
    for (label, value) in labels {
        label.hash(&mut hasher);
        value.hash(&mut hasher);
    }
    hasher.finish()
}

fn key(name: &'static str, labels: &Labels<'_>) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(label, value)| Label::new(*label, (*value).to_owned()))
        .collect();
    Key::from_parts(name, labels)
}

fn same(key: &Key, name: &str, labels: &Labels<'_>) -> bool {
    key.name() == name
        && key.labels().len() == labels.len()
        && key
            .labels()
            .zip(labels)
            .all(|(label, (k, v))| label.key() == *k && label.value() == *v)
}

static COUNTERS: LazyLock<Cache<Counter>> = LazyLock::new(Cache::new);
static HISTOGRAMS: LazyLock<Cache<Histogram>> = LazyLock::new(Cache::new);

/// The counter `name{labels}` of the installed recorder.
pub fn counter(name: &'static str, labels: &Labels<'_>) -> Counter {
    COUNTERS.get(name, labels, |key| {
        metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA))
    })
}

/// The histogram `name{labels}` of the installed recorder.
pub fn histogram(name: &'static str, labels: &Labels<'_>) -> Histogram {
    HISTOGRAMS.get(name, labels, |key| {
        metrics::with_recorder(|recorder| recorder.register_histogram(key, &METADATA))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_only_their_own_name_and_labels() {
        let labels: &Labels<'_> = &[("tenant", "a"), ("model", "m")];
        let key = key("kvgate_x", labels);
        assert!(same(&key, "kvgate_x", labels));
        assert!(!same(&key, "kvgate_y", labels));
        assert!(!same(&key, "kvgate_x", &[("tenant", "a"), ("model", "n")]));
        assert!(!same(&key, "kvgate_x", &[("tenant", "a")]));
        assert!(!same(&key, "kvgate_x", &[("model", "m"), ("tenant", "a")]));
        assert_eq!(hash("kvgate_x", labels), hash("kvgate_x", labels));
    }
}

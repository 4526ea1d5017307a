//! The one description of an HDF5 dataset: a `[datasets.NAME]` table of
//! `format = "hdf5"` in the daemon's config (TOML), an ad-hoc dataset on the
//! wire (bincode) and `stoker.hdf5(...)` in Python (a dict, through JSON) all
//! deserialize into [`Hdf5Dataset`], and [`Hdf5Dataset::problems`] is its one
//! check, so the three entry points accept and refuse the same things.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{FieldTransforms, Hdf5Sampling, PairDef, Rescan, TransformDef};

/// An HDF5 dataset: files matching a glob (taken in sorted order), each field
/// an HDF5 dataset path inside every file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hdf5Dataset {
    /// Absolute glob of the files; matches are taken in sorted order.
    pub files: String,
    /// Field name → HDF5 dataset path inside each file, in delivery order.
    pub fields: FieldPaths,
    /// Samples are windows along axis 1 (time): `{ size = 4, stride = 1 }`.
    #[serde(default)]
    pub window: Option<WindowDef>,
    /// With a window, fields delivered whole per item (`field[item]`), e.g. per-trajectory constants.
    #[serde(default)]
    pub per_item: Vec<String>,
    /// With a split window, the fields that take its first `n_steps_input` steps.
    #[serde(default)]
    pub input: Vec<String>,
    /// With a split window, the fields that take its last `n_steps_output` steps.
    #[serde(default)]
    pub output: Vec<String>,
    /// Fields without the item axis (The Well's `sample_varying = False`
    /// constants), delivered whole with every sample of their file.
    #[serde(default)]
    pub constant: Vec<String>,
    /// Windowed fields without the item axis, `[time, ...]` (The Well's
    /// `dimensions/time`): each sample gets its window's steps of them.
    #[serde(default)]
    pub time_only: Vec<String>,
    /// Field name → transform steps run in the daemon (the steps of an LMDB
    /// field's `transforms`), in any form Python takes (`{ random_crop = 48 }`).
    #[serde(default, deserialize_with = "crate::steps::field_steps_any_form")]
    pub transforms: BTreeMap<String, Vec<TransformDef>>,
    /// Field name → `{ with = "other", scale = 1 }`: draw random crops and flips with field `other`.
    #[serde(default)]
    pub pair: BTreeMap<String, PairDef>,
    /// Field name → the two axes of its sample that spatial steps act on (default: see docs/python.md).
    #[serde(default)]
    pub spatial_axes: BTreeMap<String, [i64; 2]>,
    /// `"epoch"`: match the glob again at each new epoch (files added join,
    /// removed ones leave); `"never"` (default): once, when a stream opens.
    #[serde(default)]
    pub rescan: Rescan,
}

/// Field name → HDF5 path pairs in the order given: a TOML table or a Python
/// dict keeps its order, where a `BTreeMap` would sort it. Serialized as a map.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct FieldPaths(pub Vec<(String, String)>);

impl FieldPaths {
    /// The HDF5 path of field `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, p)| p.as_str())
    }

    /// Whether field `name` is declared.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Number of fields.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no field is declared.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for FieldPaths {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (name, path) in &self.0 {
            map.serialize_entry(name, path)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for FieldPaths {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Pairs;
        impl<'de> Visitor<'de> for Pairs {
            type Value = FieldPaths;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a table of field name = \"HDF5 path\"")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<FieldPaths, A::Error> {
                let mut pairs: Vec<(String, String)> = Vec::new();
                // A set, not a scan of `pairs`: a request may hold a million names.
                let mut seen = HashSet::new();
                while let Some((name, path)) = map.next_entry::<String, String>()? {
                    if !seen.insert(name.clone()) {
                        return Err(serde::de::Error::custom(format!("field {name:?} is given twice")));
                    }
                    // Bounded by the message (or file) the entries come from.
                    pairs.push((name, path));
                }
                Ok(FieldPaths(pairs))
            }
        }
        deserializer.deserialize_map(Pairs)
    }
}

/// A dataset's `window = { size, stride }`, or The Well's
/// `{ n_steps_input, n_steps_output, dt_stride | min_dt_stride, max_dt_stride }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowDef {
    /// Steps per sample (or give `n_steps_input` and `n_steps_output`).
    #[serde(default)]
    pub size: Option<u64>,
    /// Steps between the starts of consecutive samples.
    #[serde(default = "one")]
    pub stride: u64,
    /// Steps of each window delivered to the `input` fields (The Well's `n_steps_input`).
    #[serde(default)]
    pub n_steps_input: Option<u64>,
    /// Steps after those delivered to the `output` fields (The Well's `n_steps_output`).
    #[serde(default)]
    pub n_steps_output: Option<u64>,
    /// Fixed spacing of the steps inside a window (default 1: consecutive).
    #[serde(default)]
    pub dt_stride: Option<u64>,
    /// Smallest spacing when each sample draws its own (The Well's `min_dt_stride`).
    #[serde(default)]
    pub min_dt_stride: Option<u64>,
    /// Largest spacing when each sample draws its own (The Well's `max_dt_stride`).
    #[serde(default)]
    pub max_dt_stride: Option<u64>,
}

fn one() -> u64 {
    1
}

impl Default for WindowDef {
    /// No window size yet, stride 1, consecutive steps.
    fn default() -> Self {
        WindowDef {
            size: None,
            stride: 1,
            n_steps_input: None,
            n_steps_output: None,
            dt_stride: None,
            min_dt_stride: None,
            max_dt_stride: None,
        }
    }
}

impl WindowDef {
    /// Steps per window: `size`, else `n_steps_input + n_steps_output`
    /// (saturating; [`WindowDef::problem`] refuses an overflow).
    pub fn size(&self) -> u64 {
        let split = self.n_steps_input.unwrap_or(0).saturating_add(self.n_steps_output.unwrap_or(0));
        self.size.unwrap_or(split)
    }

    /// `(min_dt_stride, max_dt_stride)`: `dt_stride` for both, else the range
    /// (each defaulting to the other, then 1).
    pub fn dt_strides(&self) -> (u64, u64) {
        match (self.dt_stride, self.min_dt_stride, self.max_dt_stride) {
            (Some(dt), ..) => (dt, dt),
            (None, min, max) => {
                let min = min.unwrap_or(1);
                (min, max.unwrap_or(min))
            }
        }
    }

    /// What is wrong with the window, if anything (the one window check).
    pub fn problem(&self) -> Option<String> {
        let split = (self.n_steps_input, self.n_steps_output);
        if self.size.is_some() && split != (None, None) {
            return Some("give either size or n_steps_input and n_steps_output, not both".into());
        }
        if self.size.is_none() && (split.0.is_none() || split.1.is_none()) {
            return Some(
                "needs size = N, or n_steps_input and n_steps_output (e.g. { n_steps_input = 4, n_steps_output = 1 })"
                    .into(),
            );
        }
        if let (Some(a), Some(b)) = split
            && a.checked_add(b).is_none()
        {
            return Some(format!("n_steps_input {a} + n_steps_output {b} overflows 64 bits"));
        }
        let size = self.size();
        if size == 0 || self.stride == 0 {
            return Some(format!("size = {size} and stride = {} must both be at least 1", self.stride));
        }
        if self.dt_stride.is_some() && (self.min_dt_stride.is_some() || self.max_dt_stride.is_some()) {
            return Some("give either dt_stride or min_dt_stride/max_dt_stride, not both".into());
        }
        let (min, max) = self.dt_strides();
        if min == 0 || max < min {
            return Some(format!(
                "step spacing min_dt_stride = {min}, max_dt_stride = {max}: both at least 1, max at least min"
            ));
        }
        None
    }
}

/// One problem of an [`Hdf5Dataset`]: the key it is about and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hdf5Problem {
    /// The dataset key involved (`"window"`, `"per_item"`, `"fields"`, …).
    pub key: &'static str,
    /// What is wrong and what to do, without the dataset's name.
    pub message: String,
}

impl Hdf5Dataset {
    /// Files `files`, fields `(name, HDF5 path)` in delivery order, nothing else.
    pub fn new(files: impl Into<String>, fields: impl IntoIterator<Item = (String, String)>) -> Hdf5Dataset {
        Hdf5Dataset { files: files.into(), fields: FieldPaths(fields.into_iter().collect()), ..Default::default() }
    }

    /// Every problem of the description that needs no file to find: the one
    /// check shared by the config, the wire and Python. Empty when valid.
    pub fn problems(&self) -> Vec<Hdf5Problem> {
        let mut out = Vec::new();
        // Looked up once per listed name: a request may list a million.
        let fields: HashSet<&str> = self.fields.0.iter().map(|(n, _)| n.as_str()).collect();
        let mut problem = |key: &'static str, message: String| out.push(Hdf5Problem { key, message });
        if !self.files.starts_with('/') {
            problem("files", format!("files = {:?} must be an absolute path or glob", self.files));
        }
        if let Some(message) = self.window.and_then(|w| w.problem()) {
            problem("window", format!("window {message}"));
        }
        for (key, names) in [
            ("input", &self.input),
            ("output", &self.output),
            ("constant", &self.constant),
            ("time_only", &self.time_only),
        ] {
            if let Some(unknown) = names.iter().find(|f| !fields.contains(f.as_str())) {
                problem(key, format!("{key} names {unknown:?}, which is not in fields"));
            }
        }
        if let Some(unknown) = self.per_item.iter().find(|f| !fields.contains(f.as_str())) {
            problem("per_item", format!("per_item names {unknown:?}, which is not in fields"));
        } else if !self.per_item.is_empty() && self.window.is_none() {
            problem(
                "per_item",
                "per_item is set but there is no window; without a window every field is per item \
                 (add window = { size = 4, stride = 1 } or remove per_item)"
                    .into(),
            );
        }
        if (!self.input.is_empty() || !self.output.is_empty() || !self.time_only.is_empty()) && self.window.is_none() {
            problem("window", "input, output and time_only fields take a window's steps; give a window".into());
        }
        let mut seen = HashSet::new();
        if let Some((dup, _)) = self.fields.0.iter().find(|(n, _)| !seen.insert(n.as_str())) {
            // Deserializing refuses these already; a description built in code is checked here.
            problem("fields", format!("field {dup:?} is given twice"));
        }
        if self.fields.is_empty() {
            problem(
                "fields",
                "fields is empty; map at least one field name to an HDF5 path, e.g. fields = { x = \"data\" }".into(),
            );
        }
        for (key, names) in [
            ("transforms", self.transforms.keys().collect::<Vec<_>>()),
            ("pair", self.pair.keys().collect()),
            ("spatial_axes", self.spatial_axes.keys().collect()),
        ] {
            let unknown: Vec<&String> = names.into_iter().filter(|f| !fields.contains(f.as_str())).collect();
            if !unknown.is_empty() {
                problem(key, format!("{key} names unknown fields {unknown:?}, which are not in fields"));
            }
        }
        out
    }

    /// The sampling beyond a plain window (The Well's split, step spacing,
    /// constant and time-only fields) this description asks for.
    pub fn sampling(&self) -> Hdf5Sampling {
        let (min_dt_stride, max_dt_stride) = self.window.map_or((1, 1), |w| w.dt_strides());
        Hdf5Sampling {
            n_steps_input: self.window.and_then(|w| w.n_steps_input),
            min_dt_stride,
            max_dt_stride,
            input: self.input.clone(),
            output: self.output.clone(),
            constant: self.constant.clone(),
            time_only: self.time_only.clone(),
        }
    }

    /// The `transforms`, `pair` and `spatial_axes` tables, one entry per
    /// field they name, in field name order.
    pub fn field_transforms(&self) -> Vec<FieldTransforms> {
        let mut names: Vec<&String> =
            self.transforms.keys().chain(self.pair.keys()).chain(self.spatial_axes.keys()).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|name| FieldTransforms {
                field: name.clone(),
                steps: self.transforms.get(name).cloned().unwrap_or_default(),
                pair: self.pair.get(name).cloned(),
                spatial_axes: self.spatial_axes.get(name).copied(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_named_twice_is_refused_however_the_description_is_made() {
        let json = r#"{"files": "/d/*.h5", "fields": {"x": "a", "x": "b"}}"#;
        let err = serde_json::from_str::<Hdf5Dataset>(json).unwrap_err().to_string();
        assert!(err.contains("\"x\" is given twice"), "{err}");
        let built = Hdf5Dataset::new("/d/*.h5", [("x".into(), "a".into()), ("x".into(), "b".into())]);
        let problems = built.problems();
        assert!(problems.iter().any(|p| p.key == "fields" && p.message.contains("given twice")), "{problems:?}");
    }

    #[test]
    fn every_list_naming_an_unknown_field_is_a_problem_and_a_good_one_has_none() {
        let mut ds = Hdf5Dataset::new("/d/*.h5", [("x".into(), "a".into())]);
        assert_eq!(ds.problems(), []);
        ds.window = Some(WindowDef { size: Some(2), ..Default::default() });
        ds.per_item = vec!["y".into()];
        ds.time_only = vec!["z".into()];
        let keys: Vec<&str> = ds.problems().iter().map(|p| p.key).collect();
        assert_eq!(keys, ["time_only", "per_item"]);
        ds.files = "relative/*.h5".into();
        assert_eq!(ds.problems()[0].key, "files");
    }
}

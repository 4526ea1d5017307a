//! Which part of each field a sample reads: the roles of fields (per item,
//! window steps, constant), the window geometry and The Well's step spacing,
//! and the messages that say what to change when a window does not fit.

use std::collections::{HashMap, HashSet};

use crate::source::{SampleRef, SourceError};

use super::*;

/// What a field delivers for one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// `field[item]`: every field without a window, `per_item` ones with one.
    Item,
    /// Steps `from .. from + count` of the sample's window (all of it, or
    /// its input or output part): `field[item, t0 + k·dt]` for each, or
    /// `field[t0 + k·dt]` for a `time_only` field (no item axis).
    Steps { from: u64, count: u64, item_axis: bool },
    /// The whole dataset, the same for every sample of the file.
    Constant,
}

impl Role {
    /// Whether the field's axis 0 is the item axis samples are indexed by.
    pub(super) fn has_item_axis(self) -> bool {
        !matches!(self, Role::Constant | Role::Steps { item_axis: false, .. })
    }
}

/// A window's index math, checked at open against the values a user gave
/// (any `u64`): nothing here can overflow once [`Geometry::new`] accepted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// Steps per window.
    pub(super) size: u64,
    /// Steps between the starts of consecutive windows.
    pub(super) stride: u64,
    /// Spacing of the steps inside a window, `dt_min..=dt_max`.
    pub(super) dt_min: u64,
    pub(super) dt_max: u64,
    /// Steps one window spans at `dt_min`: `(size - 1)·dt_min + 1`.
    pub(super) span: u64,
}

impl Geometry {
    /// Checks a window; the message names the value that is wrong.
    pub(crate) fn new(window: Window, dt_min: u64, dt_max: u64) -> Result<Geometry, SourceError> {
        let Window { size, stride } = window;
        if size == 0 || stride == 0 {
            return Err(SourceError::Spec {
                pattern: String::new(),
                message: format!("window size {size} and stride {stride} must both be at least 1"),
            });
        }
        if dt_min == 0 || dt_max < dt_min {
            return Err(SourceError::Spec {
                pattern: String::new(),
                message: format!(
                    "min_dt_stride {dt_min} and max_dt_stride {dt_max}: the step spacing must be at least 1, \
                     and max_dt_stride at least min_dt_stride"
                ),
            });
        }
        let span = (size - 1).checked_mul(dt_min).and_then(|s| s.checked_add(1)).ok_or_else(|| {
            SourceError::Limit(format!(
                "a window of {size} steps {dt_min} apart spans more than 2^64 steps; lower the window size or \
                 min_dt_stride"
            ))
        })?;
        Ok(Geometry { size, stride, dt_min, dt_max, span })
    }

    /// Windows per item of `steps` steps (0 when one window does not fit).
    pub(crate) fn windows(&self, steps: u64) -> u64 {
        match steps.checked_sub(self.span) {
            Some(room) => room / self.stride + 1,
            None => 0,
        }
    }

    /// The first step of window `w` (`w < windows(steps)`, so within `steps`).
    pub(crate) fn start(&self, w: u64) -> u64 {
        w.saturating_mul(self.stride)
    }

    /// The step spacing of the window starting at `t0` in an item of `steps`
    /// steps: `dt_min`, or with a range a draw from `word` between `dt_min`
    /// and the largest spacing whose window still ends within the item
    /// (capped at `dt_max`), as The Well's `WellDataset` draws it.
    pub(crate) fn dt(&self, t0: u64, steps: u64, word: u64) -> u64 {
        if self.dt_max == self.dt_min || self.size < 2 {
            return self.dt_min;
        }
        let fits = steps.saturating_sub(t0).saturating_sub(1) / (self.size - 1);
        let top = fits.min(self.dt_max);
        if top <= self.dt_min {
            return self.dt_min;
        }
        // top - dt_min + 1 ≤ u64::MAX since dt_min ≥ 1.
        let choices = top - self.dt_min + 1;
        self.dt_min + ((u128::from(word) * u128::from(choices)) >> 64) as u64
    }
}

/// The random word a sample's step spacing is drawn from, keyed by (seed, epoch, index).
pub(super) fn dt_word(sample: SampleRef) -> u64 {
    pub(super) fn mix(x: u64) -> u64 {
        let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    // A constant of its own keeps these draws apart from the transforms'.
    [sample.epoch, sample.index, 0x6474_5f73_7472_6964].into_iter().fold(mix(sample.seed), |h, v| mix(h ^ v))
}

/// Each field's role and the checked window, from the spec; refuses
/// contradictions (names that are not fields, fields with two roles, a split
/// without a window) with a message saying what to change.
pub(super) fn roles(spec: &Hdf5Spec) -> Result<(Vec<Role>, Option<Geometry>), SourceError> {
    let s = &spec.sampling;
    let geometry = match spec.window {
        Some(w) => Some(Geometry::new(w, s.min_dt_stride, s.max_dt_stride)?),
        None if (s.min_dt_stride, s.max_dt_stride) != (1, 1) => {
            return Err(spec_error(format!(
                "min_dt_stride {} / max_dt_stride {} space the steps of a window, but there is no window; add one",
                s.min_dt_stride, s.max_dt_stride
            )));
        }
        None => None,
    };
    check_role_lists(spec)?;
    let (size, n_in) = window_split(spec, geometry)?;
    let roles = assign_roles(spec, geometry.is_some(), size, n_in);
    if geometry.is_some() && !roles.iter().any(|r| matches!(r, Role::Steps { .. })) {
        return Err(spec_error(
            "a window needs at least one field that is not per_item or constant (the windowed fields)".into(),
        ));
    }
    if !roles.iter().any(|r| r.has_item_axis()) {
        return Err(spec_error(
            "every field is constant or time_only; at least one field needs the item axis that samples are \
             indexed by"
                .into(),
        ));
    }
    Ok((roles, geometry))
}

/// A contradiction in the dataset's description (the caller adds the dataset).
fn spec_error(message: String) -> SourceError {
    SourceError::Spec { pattern: String::new(), message }
}

/// Checks the role lists (per_item, constant, input, output, time_only):
/// each names fields, no field is in two (time_only goes with input or
/// output only), and without a window only constant may name any.
fn check_role_lists(spec: &Hdf5Spec) -> Result<(), SourceError> {
    let s = &spec.sampling;
    let lists: [(&str, &[String]); 4] =
        [("per_item", &spec.per_item), ("constant", &s.constant), ("input", &s.input), ("output", &s.output)];
    // Sets, not scans: a request may list a million names (the frame bounds the total).
    let fields: HashSet<&str> = spec.fields.iter().map(|(n, _)| n.as_str()).collect();
    let mut role_of: HashMap<&str, &str> = HashMap::new();
    for (list, names) in lists {
        for name in names {
            if !fields.contains(name.as_str()) {
                return Err(spec_error(format!("{list} names {name:?}, which is not one of the fields")));
            }
            if let Some(other) = role_of.insert(name, list).filter(|other| *other != list) {
                return Err(spec_error(format!("field {name:?} is in both {other} and {list}; a field has one role")));
            }
        }
    }
    for name in &s.time_only {
        if !fields.contains(name.as_str()) {
            return Err(spec_error(format!("time_only names {name:?}, which is not one of the fields")));
        }
        if let Some(other) = role_of.get(name.as_str()).filter(|r| matches!(**r, "per_item" | "constant")) {
            return Err(spec_error(format!(
                "field {name:?} is in both {other} and time_only; a time_only field takes the window's steps \
                 (it may also be in input or output)"
            )));
        }
        if spec.window.is_none() {
            return Err(spec_error(format!(
                "time_only names {name:?} but there is no window; time_only fields take a window's steps"
            )));
        }
    }
    if spec.window.is_none()
        && let Some((list, name)) =
            lists.iter().filter(|(l, _)| *l != "constant").find_map(|(l, n)| n.first().map(|n| (l, n)))
    {
        let why = if *list == "per_item" {
            "without a window every field is per item"
        } else {
            "input and output fields take parts of a window"
        };
        return Err(spec_error(format!("{list} names {name:?} but there is no window; {why}")));
    }
    Ok(())
}

/// The window's size and its input part (`n_steps_input`, 0 without a
/// split); refuses a split that does not fit the window, a split without a
/// window, input or output fields without a split, a split no field takes,
/// and input or output fields that would get no steps.
fn window_split(spec: &Hdf5Spec, geometry: Option<Geometry>) -> Result<(u64, u64), SourceError> {
    let s = &spec.sampling;
    let (size, n_in) = match (geometry, s.n_steps_input) {
        (Some(g), Some(n_in)) if n_in > g.size => {
            return Err(spec_error(format!(
                "n_steps_input {n_in} is more than the window's {} steps (n_steps_input + n_steps_output)",
                g.size
            )));
        }
        (Some(g), Some(n_in)) => (g.size, n_in),
        (None, Some(n_in)) => {
            return Err(spec_error(format!("n_steps_input {n_in} splits a window, but there is no window")));
        }
        (g, None) => {
            if let Some(name) = s.input.first().or(s.output.first()) {
                return Err(spec_error(format!(
                    "field {name:?} is an input or output field, but the window has no split; give \
                     n_steps_input and n_steps_output instead of size"
                )));
            }
            (g.map_or(0, |g| g.size), 0)
        }
    };
    if s.n_steps_input.is_some() && s.input.is_empty() && s.output.is_empty() {
        return Err(spec_error(
            "the window is split (n_steps_input, n_steps_output) but no field is listed in input or output; \
             list the fields that take the first n_steps_input steps in input and those that take the rest in \
             output"
                .into(),
        ));
    }
    let n_out = size - n_in;
    for (list, steps, key) in [("input", n_in, "n_steps_input"), ("output", n_out, "n_steps_output")] {
        let names = if list == "input" { &s.input } else { &s.output };
        if let Some(name) = names.first().filter(|_| steps == 0) {
            return Err(spec_error(format!("{list} field {name:?} would get no steps: {key} is 0")));
        }
    }
    Ok((size, n_in))
}

/// The names of a role list, for lookups by field.
fn name_set(names: &[String]) -> HashSet<&str> {
    names.iter().map(String::as_str).collect()
}

/// Each field's role, from the checked lists and split: constant, per item
/// (every field without a window), or steps of the window of `size` steps
/// (the first `n_in` for input fields, the rest for output fields).
fn assign_roles(spec: &Hdf5Spec, windowed: bool, size: u64, n_in: u64) -> Vec<Role> {
    let s = &spec.sampling;
    let n_out = size - n_in;
    let (constant, per_item, time_only) = (name_set(&s.constant), name_set(&spec.per_item), name_set(&s.time_only));
    let (input, output) = (name_set(&s.input), name_set(&s.output));
    spec.fields
        .iter()
        .map(|(n, _)| {
            let n = n.as_str();
            if constant.contains(n) {
                Role::Constant
            } else if !windowed || per_item.contains(n) {
                Role::Item
            } else {
                let item_axis = !time_only.contains(n);
                if input.contains(n) {
                    Role::Steps { from: 0, count: n_in, item_axis }
                } else if output.contains(n) {
                    Role::Steps { from: n_in, count: n_out, item_axis }
                } else {
                    Role::Steps { from: 0, count: size, item_axis }
                }
            }
        })
        .collect()
}

/// Why no window of `g` fits in `time` steps: the window's size (and
/// split), its spacing and span, and what to change.
pub(super) fn window_too_long(g: &Geometry, time: u64, n_steps_input: Option<u64>) -> String {
    let split = match n_steps_input {
        Some(n_in) => format!(" (n_steps_input {n_in} + n_steps_output {})", g.size - n_in),
        None => String::new(),
    };
    let spacing = if g.dt_min == 1 { "consecutive".to_string() } else { format!("{} apart (min_dt_stride)", g.dt_min) };
    format!(
        "has {time} time steps (axis 1), fewer than one window spans: {} steps{split}, {spacing}, span {} steps \
         (window stride {}); no sample fits. Shorten the window or lower the step spacing, or leave this file out",
        g.size, g.span, g.stride
    )
}

//! Normalisation statistics files: The Well's `stats.yaml` (`mean:` and
//! `std:` maps from field name to a number, or a nested list for vector and
//! tensor fields), or the same in JSON, which is YAML too.

use saphyr::{LoadableYamlNode, Yaml};
use saphyr_parser::{Event, Parser};

use super::Step;

/// Most bytes a statistics file may have (The Well's are a few KiB).
pub const MAX_STATS_BYTES: u64 = 16 << 20;

/// Deepest nesting of maps and lists a statistics file may have (The
/// Well's: 3, `mean:` → field → a list of lists for a tensor field).
const MAX_DEPTH: usize = 16;

/// Why a statistics file gives no `normalize` step; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    /// The text is not YAML (or JSON).
    #[error("{path} is not YAML: {error}")]
    NotYaml {
        /// The file.
        path: String,
        /// The YAML parser's error.
        error: saphyr::ScanError,
    },
    /// The file holds no document.
    #[error("{path} is empty")]
    Empty {
        /// The file.
        path: String,
    },
    /// The file nests maps and lists deeper than a statistics file does (checked before a tree is built).
    #[error(
        "{path} nests maps and lists more than {MAX_DEPTH} deep (line {line}); a statistics file holds mean and \
         std maps of numbers or lists"
    )]
    TooDeep {
        /// The file.
        path: String,
        /// Where the nesting passed the limit.
        line: usize,
    },
    /// The document has no `mean:` or `std:` map.
    #[error("{path} has no {which:?} map (expected The Well's layout: mean: {{field: value}}, std: {{...}})")]
    NoMap {
        /// The file.
        path: String,
        /// `mean` or `std`.
        which: &'static str,
    },
    /// The map has no entry for the key.
    #[error("{path}: {which} has no entry {key:?} (it has {known:?}); give the entry with \"key\"")]
    NoEntry {
        /// The file.
        path: String,
        /// `mean` or `std`.
        which: &'static str,
        /// The entry asked for.
        key: String,
        /// The entries the map has.
        known: Vec<String>,
    },
    /// The entry is not a number or rectangular nested lists of numbers.
    #[error("{path}: {which}.{key}: {problem}")]
    Values {
        /// The file.
        path: String,
        /// `mean` or `std`.
        which: &'static str,
        /// The entry.
        key: String,
        /// What is wrong with its values.
        problem: ValuesProblem,
    },
    /// The mean and std entries have different shapes.
    #[error("{path}: mean.{key} has shape {mean:?} but std.{key} has {std:?}")]
    ShapeMismatch {
        /// The file.
        path: String,
        /// The entry.
        key: String,
        /// The shape of the means.
        mean: Vec<u64>,
        /// The shape of the standard deviations.
        std: Vec<u64>,
    },
}

/// What is wrong with an entry's values (see [`StatsError::Values`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValuesProblem {
    /// Lists at one depth differ in length.
    #[error("nested lists are not rectangular")]
    NotRectangular,
    /// Lists nested more than 8 deep.
    #[error("nested more than 8 deep")]
    TooDeep,
    /// One depth holds both numbers and lists.
    #[error("mixes numbers and lists at one depth")]
    Mixed,
    /// A leaf is not a number (the node as the parser shows it).
    #[error("{0} is not a number")]
    NotANumber(String),
}

/// The `normalize` step for entry `key` of the statistics file `text`
/// (`path` names it in errors): one value normalizes every element, a list
/// the last axis, a nested list the trailing axes of its shape. Standard
/// deviations below `min_std` are raised to it (`WellDataset`'s clip).
pub fn normalize_step(text: &str, path: &str, key: &str, min_std: f32) -> Result<Step, StatsError> {
    check_depth(text, path)?;
    let docs = Yaml::load_from_str(text).map_err(|error| StatsError::NotYaml { path: path.to_string(), error })?;
    let Some(doc) = docs.first() else { return Err(StatsError::Empty { path: path.to_string() }) };
    let entry = |which: &'static str| -> Result<(Vec<f32>, Vec<u64>), StatsError> {
        let map = doc.as_mapping_get(which).ok_or_else(|| StatsError::NoMap { path: path.to_string(), which })?;
        let value = map.as_mapping_get(key).ok_or_else(|| {
            let known: Vec<String> = map
                .as_mapping()
                .map(|m| m.keys().filter_map(|k| k.as_str().map(str::to_string)).collect())
                .unwrap_or_default();
            StatsError::NoEntry { path: path.to_string(), which, key: key.to_string(), known }
        })?;
        let mut values = Vec::new();
        let mut dims = Vec::new();
        flatten(value, 0, &mut values, &mut dims).map_err(|problem| StatsError::Values {
            path: path.to_string(),
            which,
            key: key.to_string(),
            problem,
        })?;
        Ok((values, dims))
    };
    let (mean, mean_dims) = entry("mean")?;
    let (mut std, std_dims) = entry("std")?;
    for s in &mut std {
        *s = s.max(min_std);
    }
    if mean_dims != std_dims {
        return Err(StatsError::ShapeMismatch {
            path: path.to_string(),
            key: key.to_string(),
            mean: mean_dims,
            std: std_dims,
        });
    }
    Ok(match mean_dims.len() {
        0 | 1 => Step::Normalize { mean, std },
        _ => Step::NormalizeTrailing { mean, std, dims: mean_dims },
    })
}

/// Refuses a file nested deeper than [`MAX_DEPTH`], before a tree is built:
/// saphyr limits flow nesting (`[[[…`) but not block nesting (indented
/// maps), and builds and drops its tree recursively, so a few thousand
/// indented levels overflowed the thread's stack and aborted the daemon.
/// The event parser runs in constant stack.
fn check_depth(text: &str, path: &str) -> Result<(), StatsError> {
    let mut depth = 0usize;
    for event in Parser::new_from_str(text) {
        let (event, span) = event.map_err(|error| StatsError::NotYaml { path: path.to_string(), error })?;
        match event {
            Event::SequenceStart(..) | Event::MappingStart(..) => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(StatsError::TooDeep { path: path.to_string(), line: span.start.line() });
                }
            }
            Event::SequenceEnd | Event::MappingEnd => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// Appends the numbers of `node` (a number or rectangular nested lists) to
/// `values`, recording the list lengths per depth in `dims`.
fn flatten(node: &Yaml<'_>, depth: usize, values: &mut Vec<f32>, dims: &mut Vec<u64>) -> Result<(), ValuesProblem> {
    if let Some(items) = node.as_sequence() {
        match dims.get(depth) {
            None if dims.len() == depth => dims.push(items.len() as u64),
            Some(&n) if n == items.len() as u64 => {}
            _ => return Err(ValuesProblem::NotRectangular),
        }
        if depth > 8 {
            return Err(ValuesProblem::TooDeep);
        }
        return items.iter().try_for_each(|item| flatten(item, depth + 1, values, dims));
    }
    if dims.len() != depth {
        return Err(ValuesProblem::Mixed);
    }
    let number = node
        .as_floating_point()
        .or_else(|| node.as_integer().map(|i| i as f64))
        .ok_or_else(|| ValuesProblem::NotANumber(format!("{node:?}")))?;
    values.push(number as f32);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const WELL: &str = "\
mean:
  density: 1.0000E+00
  velocity:
  - 1.0000E-01
  - -2.0000E-01
  stress:
  - - 1.0
    - 2.0
  - - 3.0
    - 4.0
std:
  density: 2.0000E+00
  velocity:
  - 5.0000E-01
  - 2.5000E-01
  stress:
  - - 1.0
    - 1.0
  - - 2.0
    - 2
";

    #[test]
    fn small_standard_deviations_are_raised_to_the_floor() {
        let text = "mean: {a: [1, 2]}\nstd: {a: [0.000001, 3]}";
        assert_eq!(
            normalize_step(text, "s", "a", 1e-4).unwrap(),
            Step::Normalize { mean: vec![1.0, 2.0], std: vec![1e-4, 3.0] }
        );
    }

    #[test]
    fn reads_the_wells_layout() {
        assert_eq!(
            normalize_step(WELL, "s", "density", 0.0).unwrap(),
            Step::Normalize { mean: vec![1.0], std: vec![2.0] }
        );
        assert_eq!(
            normalize_step(WELL, "s", "velocity", 0.0).unwrap(),
            Step::Normalize { mean: vec![0.1, -0.2], std: vec![0.5, 0.25] }
        );
        assert_eq!(
            normalize_step(WELL, "s", "stress", 0.0).unwrap(),
            Step::NormalizeTrailing { mean: vec![1.0, 2.0, 3.0, 4.0], std: vec![1.0, 1.0, 2.0, 2.0], dims: vec![2, 2] }
        );
    }

    #[test]
    fn names_what_is_missing() {
        let err = normalize_step(WELL, "/d/stats.yaml", "pressure", 0.0).unwrap_err().to_string();
        assert!(err.contains("/d/stats.yaml") && err.contains("pressure") && err.contains("velocity"), "{err}");
        assert!(normalize_step("mean: {a: 1}", "s", "a", 0.0).unwrap_err().to_string().contains("\"std\""));
        assert!(matches!(
            normalize_step("mean: {a: [[1, 2], [3]]}\nstd: {a: 1}", "s", "a", 0.0),
            Err(StatsError::Values { problem: ValuesProblem::NotRectangular, .. })
        ));
        assert!(
            normalize_step("mean: {a: x}\nstd: {a: 1}", "s", "a", 0.0)
                .unwrap_err()
                .to_string()
                .contains("not a number")
        );
    }

    /// Deep block nesting overflowed the stack (an abort, not an error)
    /// while saphyr built or dropped the tree; flow nesting and alias
    /// bombs are refused too. Run on a thread with a worker's 2 MiB stack.
    #[test]
    fn hostile_nesting_is_refused_without_recursion() {
        let block: String =
            "mean:\n".to_string() + &(1..20_000).map(|i| format!("{}a:\n", " ".repeat(i))).collect::<String>();
        let flow = format!("mean:\n  x: {}{}\nstd:\n  x: 1\n", "[".repeat(100_000), "]".repeat(100_000));
        let bomb = "a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n\
                    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nmean: {x: *e}\nstd: {x: *e}\n";
        let errors = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                [block, flow, bomb.to_string()]
                    .map(|t| normalize_step(&t, "/s.yaml", "x", 0.0).unwrap_err().to_string())
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(errors[0].contains("more than 16 deep"), "{}", errors[0]);
        assert!(errors[1].contains("/s.yaml"), "{}", errors[1]);
        assert!(errors[2].contains("/s.yaml"), "{}", errors[2]);
        // Tensor fields a few lists deep still load.
        let tensor = "mean: {x: [[[1, 2]], [[3, 4]]]}\nstd: {x: [[[1, 1]], [[2, 2]]]}\n";
        assert!(matches!(normalize_step(tensor, "s", "x", 0.0), Ok(Step::NormalizeTrailing { .. })));
    }
}

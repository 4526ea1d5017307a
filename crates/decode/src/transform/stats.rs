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

/// The `normalize` step for entry `key` of the statistics file `text`
/// (`path` names it in errors): one value normalizes every element, a list
/// the last axis, a nested list the trailing axes of its shape.
pub fn normalize_step(text: &str, path: &str, key: &str) -> Result<Step, String> {
    check_depth(text, path)?;
    let docs = Yaml::load_from_str(text).map_err(|e| format!("{path} is not YAML: {e}"))?;
    let Some(doc) = docs.first() else { return Err(format!("{path} is empty")) };
    let entry = |which: &str| -> Result<(Vec<f32>, Vec<u64>), String> {
        let map = doc.as_mapping_get(which).ok_or_else(|| {
            format!("{path} has no {which:?} map (expected The Well's layout: mean: {{field: value}}, std: {{...}})")
        })?;
        let value = map.as_mapping_get(key).ok_or_else(|| {
            let known: Vec<String> = map
                .as_mapping()
                .map(|m| m.keys().filter_map(|k| k.as_str().map(str::to_string)).collect())
                .unwrap_or_default();
            format!("{path}: {which} has no entry {key:?} (it has {known:?}); give the entry with \"key\"")
        })?;
        let mut values = Vec::new();
        let mut dims = Vec::new();
        flatten(value, 0, &mut values, &mut dims).map_err(|e| format!("{path}: {which}.{key}: {e}"))?;
        Ok((values, dims))
    };
    let (mean, mean_dims) = entry("mean")?;
    let (std, std_dims) = entry("std")?;
    if mean_dims != std_dims {
        return Err(format!("{path}: mean.{key} has shape {mean_dims:?} but std.{key} has {std_dims:?}"));
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
fn check_depth(text: &str, path: &str) -> Result<(), String> {
    let mut depth = 0usize;
    for event in Parser::new_from_str(text) {
        let (event, span) = event.map_err(|e| format!("{path} is not YAML: {e}"))?;
        match event {
            Event::SequenceStart(..) | Event::MappingStart(..) => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(format!(
                        "{path} nests maps and lists more than {MAX_DEPTH} deep (line {}); a statistics file holds \
                         mean and std maps of numbers or lists",
                        span.start.line()
                    ));
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
fn flatten(node: &Yaml<'_>, depth: usize, values: &mut Vec<f32>, dims: &mut Vec<u64>) -> Result<(), String> {
    if let Some(items) = node.as_sequence() {
        match dims.get(depth) {
            None if dims.len() == depth => dims.push(items.len() as u64),
            Some(&n) if n == items.len() as u64 => {}
            _ => return Err("nested lists are not rectangular".into()),
        }
        if depth > 8 {
            return Err("nested more than 8 deep".into());
        }
        return items.iter().try_for_each(|item| flatten(item, depth + 1, values, dims));
    }
    if dims.len() != depth {
        return Err("mixes numbers and lists at one depth".into());
    }
    let number = node
        .as_floating_point()
        .or_else(|| node.as_integer().map(|i| i as f64))
        .ok_or_else(|| format!("{node:?} is not a number"))?;
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
    fn reads_the_wells_layout() {
        assert_eq!(normalize_step(WELL, "s", "density").unwrap(), Step::Normalize { mean: vec![1.0], std: vec![2.0] });
        assert_eq!(
            normalize_step(WELL, "s", "velocity").unwrap(),
            Step::Normalize { mean: vec![0.1, -0.2], std: vec![0.5, 0.25] }
        );
        assert_eq!(
            normalize_step(WELL, "s", "stress").unwrap(),
            Step::NormalizeTrailing { mean: vec![1.0, 2.0, 3.0, 4.0], std: vec![1.0, 1.0, 2.0, 2.0], dims: vec![2, 2] }
        );
    }

    #[test]
    fn names_what_is_missing() {
        let err = normalize_step(WELL, "/d/stats.yaml", "pressure").unwrap_err();
        assert!(err.contains("/d/stats.yaml") && err.contains("pressure") && err.contains("velocity"), "{err}");
        assert!(normalize_step("mean: {a: 1}", "s", "a").unwrap_err().contains("\"std\""));
        assert!(normalize_step("mean: {a: [[1, 2], [3]]}\nstd: {a: 1}", "s", "a").unwrap_err().contains("rectangular"));
        assert!(normalize_step("mean: {a: x}\nstd: {a: 1}", "s", "a").unwrap_err().contains("not a number"));
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
            .spawn(move || [block, flow, bomb.to_string()].map(|t| normalize_step(&t, "/s.yaml", "x").unwrap_err()))
            .unwrap()
            .join()
            .unwrap();
        assert!(errors[0].contains("more than 16 deep"), "{}", errors[0]);
        assert!(errors[1].contains("/s.yaml"), "{}", errors[1]);
        assert!(errors[2].contains("/s.yaml"), "{}", errors[2]);
        // Tensor fields a few lists deep still load.
        let tensor = "mean: {x: [[[1, 2]], [[3, 4]]]}\nstd: {x: [[[1, 1]], [[2, 2]]]}\n";
        assert!(matches!(normalize_step(tensor, "s", "x"), Ok(Step::NormalizeTrailing { .. })));
    }
}

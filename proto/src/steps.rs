//! The short forms clients may write transform steps in, expanded into
//! [`TransformDef`] (whose serde form is the one definition of the step set:
//! the daemon, the wire, the config and the Python package all go through it).

use serde_json::{Map, Value, json};

use crate::TransformDef;

/// Parses one step from JSON, accepting [`TransformDef`]'s own form and the
/// short forms: `"to_f32"`; `{"random_crop": 48}` or `{"random_crop": [h, w]}`
/// (also `center_crop`, `resize`); `{"to_f32": 0.0039}`; `{"cast": "float32"}`;
/// `{"permute": [2, 0, 1]}`; `{"downsample": 2}`. The error names the step.
pub fn step_from_json(step: &Value) -> Result<TransformDef, String> {
    let expanded = match step {
        Value::String(name) if name == "to_f32" => json!({ "to_f32": {} }),
        Value::Object(map) if map.len() == 1 => {
            let (name, arg) = map.iter().next().expect("one entry");
            let arg = match (name.as_str(), arg) {
                ("center_crop" | "random_crop" | "resize", Value::Number(n)) => json!({ "height": n, "width": n }),
                ("center_crop" | "random_crop" | "resize", Value::Array(hw)) if hw.len() == 2 => {
                    json!({ "height": hw[0], "width": hw[1] })
                }
                ("to_f32", Value::Number(n)) => json!({ "scale": n }),
                ("to_f32", Value::Null) => json!({}),
                ("cast", Value::String(dtype)) => json!({ "dtype": dtype }),
                ("permute", Value::Array(axes)) => json!({ "axes": axes }),
                ("downsample", Value::Number(n)) => json!({ "factor": n }),
                _ => arg.clone(),
            };
            let mut map = Map::new();
            map.insert(name.clone(), arg);
            Value::Object(map)
        }
        other => other.clone(),
    };
    serde_json::from_value(expanded).map_err(|e| {
        let e = e.to_string();
        if e.contains("expected one of") {
            format!("transform {step}: {e}")
        } else {
            format!("transform {step}: {e} (the steps are {})", step_names().join(", "))
        }
    })
}

/// A list of steps in any of the forms [`step_from_json`] takes, from a
/// human-readable format (the config's TOML, JSON); the wire's bincode keeps
/// [`TransformDef`]'s own encoding. For `#[serde(deserialize_with)]`: the
/// config and Python then speak one transform language.
pub fn steps_any_form<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<TransformDef>, D::Error> {
    use serde::Deserialize;
    if !deserializer.is_human_readable() {
        return Vec::<TransformDef>::deserialize(deserializer);
    }
    let items = Vec::<Value>::deserialize(deserializer)?;
    items.iter().map(|step| step_from_json(step).map_err(serde::de::Error::custom)).collect()
}

/// [`steps_any_form`] for a map of field name → steps.
pub fn field_steps_any_form<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<std::collections::BTreeMap<String, Vec<TransformDef>>, D::Error> {
    use serde::Deserialize;
    if !deserializer.is_human_readable() {
        return std::collections::BTreeMap::<String, Vec<TransformDef>>::deserialize(deserializer);
    }
    let fields = std::collections::BTreeMap::<String, Vec<Value>>::deserialize(deserializer)?;
    fields
        .into_iter()
        .map(|(field, steps)| {
            let parsed = steps.iter().map(step_from_json).collect::<Result<Vec<_>, _>>();
            parsed
                .map(|steps| (field.clone(), steps))
                .map_err(|e| serde::de::Error::custom(format!("field {field:?}: {e}")))
        })
        .collect()
}

/// The step names, as serde spells [`TransformDef`]'s variants.
pub fn step_names() -> Vec<String> {
    // serde lists every variant in its "unknown variant" message: ask it, rather than keep a copy.
    let err = serde_json::from_value::<TransformDef>(json!("\u{0}")).expect_err("no step has that name");
    let text = err.to_string();
    let list = text.split("expected one of ").nth(1).unwrap_or_default();
    list.split(", ")
        .map(|v| v.trim_matches(|c: char| c == '`' || c.is_whitespace()).to_string())
        .filter(|v| !v.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_forms_expand() {
        let parse = |v: Value| step_from_json(&v).unwrap();
        assert_eq!(parse(json!("hflip")), TransformDef::Hflip);
        assert_eq!(parse(json!("rot90")), TransformDef::Rot90);
        assert_eq!(parse(json!("to_f32")), TransformDef::ToF32 { scale: None });
        assert_eq!(parse(json!({"random_crop": 48})), TransformDef::RandomCrop { height: 48, width: 48 });
        assert_eq!(parse(json!({"center_crop": [4, 6]})), TransformDef::CenterCrop { height: 4, width: 6 });
        assert_eq!(parse(json!({"cast": "float32"})), TransformDef::Cast { dtype: "float32".into() });
        assert_eq!(parse(json!({"permute": [2, 0, 1]})), TransformDef::Permute { axes: vec![2, 0, 1] });
        assert_eq!(parse(json!({"downsample": 2})), TransformDef::Downsample { factor: 2, mode: None });
        let stats = parse(json!({"normalize": {"stats": "/s.yaml", "key": "v"}}));
        assert_eq!(
            stats,
            TransformDef::Normalize {
                mean: vec![],
                std: vec![],
                stats: Some("/s.yaml".into()),
                key: Some("v".into()),
                min_std: None,
            }
        );
    }

    #[test]
    fn normalize_takes_one_number_or_a_list_and_the_wire_keeps_the_list() {
        let parse = |v: Value| step_from_json(&v);
        let norm = |mean: Vec<f32>, std: Vec<f32>| TransformDef::Normalize {
            mean,
            std,
            stats: None,
            key: None,
            min_std: None,
        };
        assert_eq!(parse(json!({"normalize": {"mean": 0.5, "std": 2}})).unwrap(), norm(vec![0.5], vec![2.0]));
        let list = parse(json!({"normalize": {"mean": [1, 2.5, 3], "std": [0.5, 1, 2]}})).unwrap();
        assert_eq!(list, norm(vec![1.0, 2.5, 3.0], vec![0.5, 1.0, 2.0]));
        let err = parse(json!({"normalize": {"mean": "zero", "std": 1}})).unwrap_err();
        assert!(err.contains("a number or a list of numbers"), "{err}");
        // bincode is not human-readable: the list goes as a list, both ways.
        let frame = crate::encode_frame(&list).unwrap();
        let back: TransformDef = crate::decode_body(&frame[crate::FRAME_HEADER_BYTES..]).unwrap();
        assert_eq!(back, list);
    }

    #[test]
    fn unknown_steps_are_named() {
        let err = step_from_json(&json!("twirl")).unwrap_err();
        assert!(err.contains("twirl") && err.contains("rot90"), "{err}");
        assert!(step_names().iter().any(|n| n == "downsample"), "{:?}", step_names());
    }
}

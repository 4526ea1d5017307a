//! Opening an LMDB dataset: environments, key selection, the check that every
//! environment holds every key, and the probe of each field's layout.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use stoker_proto::DType;

use crate::source::{FieldSpec, SourceError};
use stoker_decode::codec::ArrayInfo;
use stoker_decode::transform::{Chain, TransformError};

use super::*;

impl LmdbSource {
    /// Opens the environments of `spec` (each once per process), selects the
    /// keys, checks every environment holds them, and probes the field layouts.
    pub fn open(spec: &LmdbSpec) -> Result<LmdbSource, SourceError> {
        LmdbSource::open_checked(spec, &CheckedLmdb::default())
    }

    /// [`LmdbSource::open`] over files already opened by handle: each
    /// environment must still be the file `checked` identified, and the key
    /// file is read from its handle.
    pub fn open_checked(spec: &LmdbSpec, checked: &CheckedLmdb) -> Result<LmdbSource, SourceError> {
        let first = check_fields(spec)?;
        let (envs, env_of) = open_envs(spec, checked)?;
        let keys = sample_keys(spec, checked, &envs, &env_of, first)?;
        let (chains, leaders) = chains(spec)?;

        // Layouts from the first keys.
        let probe = spec.probe.max(1).min(keys.len());
        let mut plans = Vec::with_capacity(spec.fields.len());
        for (i, (field, chain)) in spec.fields.iter().zip(chains).enumerate() {
            let env = &envs[env_of[i]];
            let (dtype, decoded_shape, largest) =
                probe_field(env, field, &keys, probe, spec.on_error, spec.max_value_bytes)?;
            let decoded =
                decoded_shape.iter().copied().collect::<Option<Vec<u64>>>().map(|shape| ArrayInfo { dtype, shape });
            let decoded_dtype = dtype;
            let (dtype, shape) = if chain.is_empty() {
                (dtype, decoded_shape)
            } else {
                delivered(field, &chain, dtype, &decoded_shape)?
            };
            plans.push(FieldPlan {
                name: field.name.clone(),
                env: env_of[i],
                codec: field.codec.clone(),
                chain: (!chain.is_empty()).then_some(chain),
                leader: leaders[i],
                has_followers: leaders.contains(&Some(i)),
                decoded,
                max_sample_bytes: field
                    .max_sample_bytes
                    .unwrap_or_else(|| ragged_room(decoded_dtype, dtype, largest, spec.max_value_bytes)),
                dtype,
                shape,
            });
        }
        let fields = field_specs(spec, &plans);
        for plan in plans.iter().filter(|p| p.fixed_shape().is_none()) {
            tracing::info!(field = %plan.name, shape = ?plan.shape, "LMDB field has a variable shape");
        }
        Ok(LmdbSource {
            keys,
            fields,
            plans,
            envs,
            on_error: spec.on_error,
            probe,
            max_value_bytes: spec.max_value_bytes,
            skipped: AtomicU64::new(0),
            logged: Mutex::new(HashSet::new()),
            workers: Mutex::new(Vec::new()),
            cache: None,
        })
    }
}

/// An error about how `field` is declared.
fn field_error(field: &LmdbField, message: String) -> SourceError {
    SourceError::LmdbField {
        env: field.env.clone(),
        field: field.name.clone(),
        codec: field.codec.to_string(),
        message,
    }
}

/// Checks the fields' declarations before anything is opened: at least
/// one, no name twice, every path beneath the allowed roots. The first field.
fn check_fields(spec: &LmdbSpec) -> Result<&LmdbField, SourceError> {
    let first = spec.fields.first().ok_or_else(|| SourceError::LmdbField {
        env: PathBuf::new(),
        field: String::new(),
        codec: String::new(),
        message: "an LMDB dataset needs at least one field".into(),
    })?;
    let mut seen = HashSet::new();
    for field in &spec.fields {
        if !seen.insert(field.name.as_str()) {
            return Err(field_error(field, "the field name appears twice".into()));
        }
    }
    if let Some(roots) = &spec.allowed_roots {
        let paths = spec.fields.iter().map(|f| &f.env).chain(spec.key_file.as_ref());
        for path in paths {
            let real = path.canonicalize().unwrap_or_else(|_| path.clone());
            if !roots.iter().any(|root| real.starts_with(root)) {
                let refused = crate::fsaccess::AccessError::NotAllowed { path: path.clone(), roots: roots.clone() };
                return Err(SourceError::Access(refused));
            }
        }
    }
    Ok(first)
}

/// The fields' environments, each opened once even when several fields read
/// it (and checked to be the data file `checked` identified), and per field
/// the index of its environment.
fn open_envs(spec: &LmdbSpec, checked: &CheckedLmdb) -> Result<(Vec<Arc<SharedEnv>>, Vec<usize>), SourceError> {
    let mut envs: Vec<Arc<SharedEnv>> = Vec::new();
    let mut env_of = Vec::with_capacity(spec.fields.len());
    for field in &spec.fields {
        let data = checked.data.iter().find(|(p, _)| *p == field.env).map(|(_, f)| f);
        let env = SharedEnv::open(&field.env, data)?;
        let (dev, ino, _) = env.env.file_id().map_err(|e| SourceError::LmdbOpen {
            env: field.env.clone(),
            message: format!("cannot check its data file: {e}"),
        })?;
        checked.check_env(&field.env, dev, ino)?;
        let at = envs.iter().position(|e| Arc::ptr_eq(e, &env)).unwrap_or_else(|| {
            envs.push(env);
            envs.len() - 1
        });
        env_of.push(at);
    }
    Ok((envs, env_of))
}

/// The sample keys: the key file's, or the first field's environment's
/// after the filter; refuses none, and keys missing from any other
/// environment a field reads.
fn sample_keys(
    spec: &LmdbSpec,
    checked: &CheckedLmdb,
    envs: &[Arc<SharedEnv>],
    env_of: &[usize],
    first: &LmdbField,
) -> Result<Keys, SourceError> {
    let primary = &envs[env_of[0]];
    let keys = match &spec.key_file {
        Some(path) => read_key_file(path, checked.key_file.as_ref())?,
        None => primary.keys(&spec.filter)?,
    };
    if keys.is_empty() {
        let detail = match (&spec.key_file, &spec.filter) {
            (Some(path), _) => format!("(key file {} lists none)", path.display()),
            (None, filter) => format!("after filter {filter:?}"),
        };
        return Err(SourceError::LmdbEmpty { env: first.env.clone(), detail });
    }
    for (field, &env) in spec.fields.iter().zip(env_of) {
        let listed_here = env == env_of[0] && spec.key_file.is_none();
        if !listed_here {
            envs[env].check_has(&keys, &field.name)?;
        }
    }
    Ok(keys)
}

/// Each field's transform chain (limited to the largest value allowed),
/// and the index of the field it pairs with, checked against that field's chain.
fn chains(spec: &LmdbSpec) -> Result<(Vec<Chain>, Vec<Option<usize>>), SourceError> {
    let mut chains = Vec::with_capacity(spec.fields.len());
    for field in &spec.fields {
        let chain = Chain::new(&field.name, field.transforms.clone(), field.pair.clone())
            .map_err(|e| field_error(field, e.to_string()))?
            .with_limit(spec.max_value_bytes);
        chains.push(chain);
    }
    let mut leaders = Vec::with_capacity(spec.fields.len());
    for (field, chain) in spec.fields.iter().zip(&chains) {
        let leader = match chain.pair() {
            None => None,
            Some(pair) => {
                let Some(at) = spec.fields.iter().position(|f| f.name == pair.with) else {
                    return Err(field_error(field, format!("pairs with {:?}, which is not a field", pair.with)));
                };
                chain.check_pair(&chains[at]).map_err(|e| field_error(field, e.to_string()))?;
                Some(at)
            }
        };
        leaders.push(leader);
    }
    Ok((chains, leaders))
}

/// The dtype and shape `chain` delivers for `field`'s values of `dtype` and
/// `shape`; a chain that makes them larger than the limit is a limit error.
fn delivered(
    field: &LmdbField,
    chain: &Chain,
    dtype: DType,
    shape: &[Option<u64>],
) -> Result<(DType, Vec<Option<u64>>), SourceError> {
    chain.output(dtype, shape).map_err(|e| match e {
        // A transform that makes values too large is a limit, not a malformed field.
        TransformError::TooLarge { .. } => {
            SourceError::Limit(format!("LMDB environment {} (codec {}): {e}", field.env.display(), field.codec))
        }
        e => field_error(field, e.to_string()),
    })
}

/// Room per row of a ragged field whose declaration gives none: twice the
/// largest probed value (`largest` bytes, decoded as `decoded`), widened as
/// a cast to `delivered` widens every value; at least 1 MiB, never more
/// than a value may take at all (`max_value_bytes`).
fn ragged_room(decoded: DType, delivered: DType, largest: u64, max_value_bytes: u64) -> u64 {
    let widen = (delivered.size() as u64).div_ceil(decoded.size() as u64).max(1);
    largest.saturating_mul(2).saturating_mul(widen).max(1 << 20).min(max_value_bytes)
}

/// The fields as the client receives them, from their plans.
fn field_specs(spec: &LmdbSpec, plans: &[FieldPlan]) -> Vec<FieldSpec> {
    plans
        .iter()
        .zip(&spec.fields)
        .map(|(plan, field)| FieldSpec {
            name: plan.name.clone(),
            origin: format!("{} ({})", field.env.display(), field.codec),
            dtype: plan.dtype,
            shape: plan.shape.iter().map(|d| d.unwrap_or(0)).collect(),
            max_sample_bytes: plan.fixed_shape().is_none().then_some(plan.max_sample_bytes),
        })
        .collect()
}

/// Dtype and per-dimension shape (`None` where values differ) of a field, from its first `probe` keys.
pub(super) fn probe_field(
    env: &SharedEnv,
    field: &LmdbField,
    keys: &Keys,
    probe: usize,
    on_error: OnError,
    max_bytes: u64,
) -> Result<(DType, Vec<Option<u64>>, u64), SourceError> {
    let field_err = |message: String| SourceError::LmdbField {
        env: field.env.clone(),
        field: field.name.clone(),
        codec: field.codec.to_string(),
        message,
    };
    let txn = env.env.txn().map_err(|e| field_err(e.to_string()))?;
    let mut value = Vec::new();
    let mut merged: Option<(DType, Vec<Option<u64>>, String)> = None;
    let mut largest = 0u64;
    for index in 0..probe {
        let key = keys.get(index);
        let read_err = |message: String| read_error(&field.env, key, &field.name, &field.codec, index as u64, message);
        let probed = txn
            .read(key, &mut value)
            .map_err(|e| read_err(e.to_string()))
            .and_then(|found| if found { Ok(()) } else { Err(read_err("the key is missing".into())) })
            .and_then(|()| field.codec.probe(&value).map_err(|e| read_err(e.to_string())))
            .and_then(|info| match info.check_size(max_bytes) {
                Ok(_) => Ok(info),
                Err(e) => Err(read_err(e.to_string())),
            });
        let info = match (probed, on_error) {
            (Ok(info), _) => info,
            (Err(e), OnError::Fail) => return Err(e),
            // A truncated or corrupt file is not a bad value to skip.
            (Err(e), OnError::Skip) if env.env.poisoned().is_some() => return Err(e),
            (Err(e), OnError::Skip) => {
                tracing::warn!(error = %e, "LMDB probe: skipping a bad value");
                continue;
            }
        };
        largest = largest.max(info.checked_bytes().unwrap_or(u64::MAX));
        match &mut merged {
            None => merged = Some((info.dtype, info.shape.iter().map(|&d| Some(d)).collect(), show_key(key))),
            Some((dtype, shape, first_key)) => {
                if *dtype != info.dtype || shape.len() != info.shape.len() {
                    return Err(field_err(format!(
                        "key {first_key:?} holds {dtype} with {} dimensions but key {:?} holds {info}; a field's \
                         values must share dtype and number of dimensions",
                        shape.len(),
                        show_key(key)
                    )));
                }
                for (d, &e) in shape.iter_mut().zip(&info.shape) {
                    if *d != Some(e) {
                        *d = None;
                    }
                }
            }
        }
    }
    let (dtype, shape, _) =
        merged.ok_or_else(|| field_err(format!("none of the first {probe} values could be decoded")))?;
    Ok((dtype, shape, largest))
}

/// Why a value does not go into its ragged row.
pub(super) enum Misfit {
    /// Wrong dtype or number of dimensions, or beyond `[limits] max_sample_bytes`.
    Bad(String),
    /// Larger than the row's room: this many bytes.
    Larger(u64, String),
}

impl Misfit {
    /// The source error for field `field`; `err` adds the file, key and field.
    pub(super) fn into_error(self, field: usize, err: &dyn Fn(String) -> SourceError) -> SourceError {
        match self {
            Misfit::Bad(message) => err(message),
            Misfit::Larger(bytes, message) => SourceError::Oversize { field, bytes, message: err(message).to_string() },
        }
    }
}

/// Bytes of a `shape` array of `dtype`, if it fits in a ragged row of `room`
/// bytes and has the field's dtype and number of dimensions (`plan`).
pub(super) fn fits(plan: &FieldPlan, shape: &[u64], dtype: DType, room: usize, limit: u64) -> Result<usize, Misfit> {
    if dtype != plan.dtype || shape.len() != plan.shape.len() {
        let laid_out: Vec<String> = plan.shape.iter().map(|d| d.map_or("*".into(), |d| d.to_string())).collect();
        return Err(Misfit::Bad(format!(
            "the value is {dtype} {shape:?} but this variable-shape field was laid out as {} [{}] from the first \
             keys; a field's values must share dtype and number of dimensions",
            plan.dtype,
            laid_out.join(", ")
        )));
    }
    let n = shape.iter().try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d));
    match n.and_then(|n| usize::try_from(n).ok()) {
        Some(n) if n <= room => Ok(n),
        Some(n) if n as u64 <= limit => Err(Misfit::Larger(
            n as u64,
            format!(
                "the value is {dtype} {shape:?} ({n} bytes), more than the {room} bytes reserved per sample of this \
                 variable-shape field"
            ),
        )),
        _ => Err(Misfit::Bad(format!(
            "the value is {dtype} {shape:?} ({}), more than [limits] max_sample_bytes = {limit}",
            n.map_or_else(|| "more than 2^64 bytes".to_string(), |n| format!("{n} bytes"))
        ))),
    }
}

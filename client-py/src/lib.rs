//! `stoker._native`: the Python binding of `stoker-client`.
//!
//! A batch arrives as a dict of writable numpy arrays that point straight
//! into the stream's copy-on-write shared-memory mapping (a write makes this
//! process's own copy of the page; the daemon and other clients never see it). Every array's base object is the
//! batch's `Lease`; when the last array (and the lease) is garbage-collected,
//! the slot goes back to the daemon. Waiting for a batch releases the GIL and
//! wakes every 50 ms to let Ctrl-C through. This module is the one place that
//! maps client errors to Python exception classes.

use std::ffi::c_int;

use numpy::npyffi::{self, NPY_TYPES, PY_ARRAY_API, npy_intp};
use pyo3::import_exception;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use stoker_client::proto::{BlockShuffle, DType, DatasetRef, ErrorKind, OpenStream};
use stoker_client::{Batch, Client, ClientError, Stream};

// The classes live in Python (`stoker/_errors.py`): each subclasses both
// `StokerError` and the builtin it behaves like (`Timeout` is a `TimeoutError`),
// which pyo3's single-base `create_exception!` cannot express. pyo3 imports
// each class once and caches its type object.
import_exception!(stoker._errors, StokerError);
import_exception!(stoker._errors, DaemonUnavailable);
import_exception!(stoker._errors, DatasetError);
import_exception!(stoker._errors, ProtocolError);
import_exception!(stoker._errors, LimitError);
import_exception!(stoker._errors, AccessDenied);
import_exception!(stoker._errors, Timeout);

/// The single mapping from client errors to Python exceptions.
fn to_py(py: Python<'_>, err: ClientError) -> PyErr {
    match err {
        ClientError::Unavailable { .. } | ClientError::Disconnected(_) => DaemonUnavailable::new_err(err.to_string()),
        ClientError::SocketDenied { .. } => AccessDenied::new_err(err.to_string()),
        ClientError::Daemon { kind, message } => match kind {
            ErrorKind::Dataset | ErrorKind::NotFound => DatasetError::new_err(message),
            ErrorKind::Limit | ErrorKind::RingExhausted => LimitError::new_err(message),
            ErrorKind::PermissionDenied => AccessDenied::new_err(message),
            ErrorKind::ShuttingDown => DaemonUnavailable::new_err(message),
            ErrorKind::Version | ErrorKind::Protocol | ErrorKind::Internal => ProtocolError::new_err(message),
        },
        ClientError::Interrupted => {
            PyErr::take(py).unwrap_or_else(|| pyo3::exceptions::PyKeyboardInterrupt::new_err(()))
        }
        ClientError::Forked { .. } | ClientError::Protocol(_) | ClientError::Io(_) => {
            ProtocolError::new_err(err.to_string())
        }
    }
}

/// Holds one batch's slot; the base object of every array of the batch.
#[pyclass(frozen, module = "stoker._native")]
struct Lease {
    batch: Batch,
}

#[pymethods]
impl Lease {
    /// Epoch of the batch.
    #[getter]
    fn epoch(&self) -> u64 {
        self.batch.epoch()
    }
    /// Position of the batch in its epoch.
    #[getter]
    fn step(&self) -> u64 {
        self.batch.step()
    }
    /// Samples in the batch.
    #[getter]
    fn rows(&self) -> u64 {
        self.batch.rows()
    }
    /// Ring slot the batch occupies.
    #[getter]
    fn slot(&self) -> u32 {
        self.batch.slot()
    }
}

/// A stream of batches (use `stoker.Loader`, which wraps this).
#[pyclass(frozen, module = "stoker._native")]
struct NativeStream {
    stream: Stream,
    /// Interned field names, in layout order.
    names: Vec<Py<PyString>>,
}

/// numpy's type number for `dtype`: the one numpy table here. Names and
/// sizes come from `DType` (`numpy_name`, `type_code`, `size` in stoker-proto);
/// these are the C types of those sizes on the platforms stoker runs on.
fn typenum(dtype: DType) -> c_int {
    let t = match dtype {
        DType::Bool => NPY_TYPES::NPY_BOOL,
        DType::U8 => NPY_TYPES::NPY_UBYTE,
        DType::U16 => NPY_TYPES::NPY_USHORT,
        DType::U32 => NPY_TYPES::NPY_UINT,
        DType::U64 => NPY_TYPES::NPY_ULONGLONG,
        DType::I8 => NPY_TYPES::NPY_BYTE,
        DType::I16 => NPY_TYPES::NPY_SHORT,
        DType::I32 => NPY_TYPES::NPY_INT,
        DType::I64 => NPY_TYPES::NPY_LONGLONG,
        DType::F16 => NPY_TYPES::NPY_HALF,
        DType::F32 => NPY_TYPES::NPY_FLOAT,
        DType::F64 => NPY_TYPES::NPY_DOUBLE,
    };
    t as c_int
}

/// Extracts `("name", NAME)`, `("hdf5", JSON)` (JSON of `stoker_proto::Hdf5Dataset`, built by
/// `stoker.hdf5`) or `("lmdb", JSON)` (JSON of `stoker_proto::LmdbDataset`, built by `stoker.lmdb`).
fn dataset_ref(spec: &Bound<'_, PyTuple>) -> PyResult<DatasetRef> {
    let kind: String = spec.get_item(0)?.extract()?;
    match kind.as_str() {
        "name" => Ok(DatasetRef::Named(spec.get_item(1)?.extract()?)),
        "hdf5" => {
            let json: String = spec.get_item(1)?.extract()?;
            Ok(DatasetRef::Hdf5(Box::new(hdf5_dataset(&json)?)))
        }
        "lmdb" => {
            let json: String = spec.get_item(1)?.extract()?;
            let def = serde_json::from_str(&json)
                .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("invalid LMDB dataset spec: {e}")))?;
            Ok(DatasetRef::Lmdb(def))
        }
        other => Err(pyo3::exceptions::PyValueError::new_err(format!("unknown dataset kind {other:?}"))),
    }
}

#[pymethods]
impl NativeStream {
    /// Connects to the daemon at `socket` and opens a stream.
    /// `block`: `(block_size, window)` for the locality order (with `shuffle`).
    #[new]
    #[pyo3(signature = (socket, dataset, batch_size, shuffle, seed, drop_last, rank, world_size, epoch, step, timeout=None, block=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        socket: std::path::PathBuf,
        dataset: &Bound<'_, PyTuple>,
        batch_size: u64,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
        rank: u64,
        world_size: u64,
        epoch: u64,
        step: u64,
        timeout: Option<f64>,
        block: Option<(u64, u64)>,
    ) -> PyResult<NativeStream> {
        let open = OpenStream {
            dataset: dataset_ref(dataset)?,
            batch_size,
            shuffle,
            seed,
            drop_last,
            rank,
            world_size,
            epoch,
            step,
            block: block.map(|(block_size, window)| BlockShuffle { block_size, window }),
        };
        let stream = wait(py, timeout, |interrupted| {
            Client::connect_interruptible(&socket, interrupted)?.open_stream_interruptible(open, interrupted)
        })?;
        let names = stream.info().layout.fields.iter().map(|f| PyString::intern(py, &f.name).unbind()).collect();
        Ok(NativeStream { stream, names })
    }

    /// Dict with `stream`, `samples_per_rank`, `batches_per_epoch`, `depth`,
    /// `fields`, `rescan`, and the dataset generation (`generation`, a
    /// 64-bit fingerprint; `files`; `samples`), the counts of the epoch the
    /// stream was last moved to.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = self.stream.info();
        let generation = self.stream.generation();
        let d = PyDict::new(py);
        d.set_item("stream", info.stream)?;
        d.set_item("samples_per_rank", self.stream.num_samples())?;
        d.set_item("batches_per_epoch", self.stream.batches_per_epoch())?;
        d.set_item("depth", info.depth)?;
        d.set_item("rescan", info.rescan)?;
        d.set_item("generation", generation.fingerprint)?;
        d.set_item("files", generation.files)?;
        d.set_item("samples", generation.samples)?;
        let fields = PyList::empty(py);
        for f in &info.layout.fields {
            fields.append((f.name.as_str(), f.dtype.numpy_name(), f.shape.clone()))?;
        }
        d.set_item("fields", fields)?;
        Ok(d)
    }

    /// `(address, length)` of the copy-on-write shared-memory mapping.
    fn mapping_range(&self) -> (usize, usize) {
        self.stream.mapping_range()
    }

    /// `(address, length)` of a shared read-only view of the same ring
    /// (mapped on first call): what the GPU upload registers.
    fn shared_range(&self) -> PyResult<(usize, usize)> {
        self.stream.shared_range().map_err(pyo3::exceptions::PyOSError::new_err)
    }

    /// Repositions the stream at (`epoch`, `step`).
    #[pyo3(signature = (epoch, step, timeout=None))]
    fn set_epoch(&self, py: Python<'_>, epoch: u64, step: u64, timeout: Option<f64>) -> PyResult<()> {
        wait(py, timeout, |interrupted| self.stream.set_epoch_interruptible(epoch, step, interrupted))
    }

    /// `(epoch, step)` of the next batch the stream will deliver (past every
    /// batch delivered or failed, including ones whose wait timed out).
    fn position(&self) -> (u64, u64) {
        self.stream.position()
    }

    /// The next batch as a dict of writable (copy-on-write) arrays, or `None` at the end of the epoch.
    #[pyo3(signature = (timeout=None))]
    fn next<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(batch) = wait(py, timeout, |interrupted| self.stream.next_interruptible(interrupted))? else {
            return Ok(None);
        };
        // (dtype, [(shape, pointer)]): one entry for a fixed field, one per row for a ragged one.
        let mut views = Vec::new();
        for f in batch.fields() {
            let parts = if f.is_ragged() {
                (0..batch.rows())
                    .map(|i| f.row(i).map(|(shape, bytes)| (shape, bytes.as_ptr())))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| to_py(py, e))?
            } else {
                vec![(f.shape(), f.bytes().as_ptr())]
            };
            views.push((f.dtype(), f.is_ragged(), parts));
        }
        let lease = Bound::new(py, Lease { batch })?;
        let out = PyDict::new(py);
        for ((dtype, ragged, parts), name) in views.into_iter().zip(&self.names) {
            if ragged {
                let list = PyList::empty(py);
                for (shape, ptr) in parts {
                    list.append(slot_array(py, &lease, dtype, &shape, ptr)?)?;
                }
                out.set_item(name.bind(py), list)?;
            } else {
                let (shape, ptr) = &parts[0];
                out.set_item(name.bind(py), slot_array(py, &lease, dtype, shape, *ptr)?)?;
            }
        }
        Ok(Some(out))
    }

    /// Closes the stream.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.stream.close()).map_err(|e| to_py(py, e))
    }
}

/// Runs a blocking client call without the GIL, letting Python signal
/// handlers run every poll interval; a handler's exception (KeyboardInterrupt)
/// ends the wait and is raised.
fn wait<T: Send>(
    py: Python<'_>,
    timeout: Option<f64>,
    call: impl Send + FnOnce(&mut dyn FnMut() -> bool) -> Result<T, ClientError>,
) -> PyResult<T> {
    let mut raised: Option<PyErr> = None;
    let deadline = timeout.map(|t| std::time::Instant::now() + std::time::Duration::from_secs_f64(t.max(0.0)));
    let mut timed_out = false;
    let got = py.detach(|| {
        call(&mut || {
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                timed_out = true;
                return true;
            }
            Python::attach(|py| match py.check_signals() {
                Ok(()) => false,
                Err(e) => {
                    raised = Some(e);
                    true
                }
            })
        })
    });
    match got {
        Ok(v) => Ok(v),
        Err(ClientError::Interrupted) if timed_out => Err(Timeout::new_err(format!(
            "the stoker daemon did not answer within {:.1} s (see `stoker status` and the daemon's log; \
             is it stopped or overloaded?)",
            timeout.unwrap_or_default()
        ))),
        Err(ClientError::Interrupted) => {
            Err(raised.unwrap_or_else(|| pyo3::exceptions::PyKeyboardInterrupt::new_err(())))
        }
        Err(e) => Err(to_py(py, e)),
    }
}

/// A writable C-contiguous array over `ptr` whose base object is `lease`.
fn slot_array<'py>(
    py: Python<'py>,
    lease: &Bound<'py, Lease>,
    dtype: DType,
    shape: &[u64],
    ptr: *const u8,
) -> PyResult<Bound<'py, PyAny>> {
    let mut dims: Vec<npy_intp> = shape.iter().map(|&d| d as npy_intp).collect();
    // SAFETY: `ptr` points at `prod(shape) * dtype.size()` bytes of the
    // stream's mapping (FieldView::bytes), 64-byte aligned by the layout. The
    // mapping lives as long as the lease (the Batch holds an Arc of it), and the
    // lease becomes the array's base below, so the memory outlives the array.
    // The mapping is private and writable (copy-on-write), so the array is
    // NPY_ARRAY_WRITEABLE: a write copies the page for this process only, and
    // the lease drops those copies before the slot goes back to the daemon.
    // `PyArray_DescrFromType`
    // returns a new reference that `PyArray_NewFromDescr` steals;
    // `PyArray_SetBaseObject` steals the lease reference we pass it.
    unsafe {
        let descr = PY_ARRAY_API.PyArray_DescrFromType(py, typenum(dtype));
        let array = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
            descr,
            dims.len() as c_int,
            dims.as_mut_ptr(),
            std::ptr::null_mut(),
            ptr.cast_mut().cast(),
            npyffi::NPY_ARRAY_C_CONTIGUOUS | npyffi::NPY_ARRAY_ALIGNED | npyffi::NPY_ARRAY_WRITEABLE,
            std::ptr::null_mut(),
        );
        let array = Bound::from_owned_ptr_or_err(py, array)?;
        let base = lease.clone().into_any().into_ptr();
        if PY_ARRAY_API.PyArray_SetBaseObject(py, array.as_ptr().cast(), base) < 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(array)
    }
}

/// Checks and expands transform steps: takes a JSON list of steps in any
/// accepted form and returns the JSON list in the daemon's form, or raises
/// `ValueError` naming the bad step. The step set is `stoker_proto::TransformDef`.
#[pyfunction]
fn parse_steps(steps: &str) -> PyResult<String> {
    let value: serde_json::Value = serde_json::from_str(steps)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("transforms are not JSON: {e}")))?;
    let serde_json::Value::Array(items) = value else {
        return Err(pyo3::exceptions::PyValueError::new_err("transforms must be a list of steps"));
    };
    let parsed = items
        .iter()
        .map(stoker_client::proto::step_from_json)
        .collect::<Result<Vec<_>, _>>()
        .map_err(pyo3::exceptions::PyValueError::new_err)?;
    serde_json::to_string(&parsed).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}

/// Parses and checks an HDF5 dataset description (JSON of
/// `stoker_proto::Hdf5Dataset`, the one shape the config and the wire take),
/// raising `ValueError` with its first problem.
fn hdf5_dataset(json: &str) -> PyResult<stoker_client::proto::Hdf5Dataset> {
    let ds: stoker_client::proto::Hdf5Dataset = serde_json::from_str(json)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("invalid HDF5 dataset: {e}")))?;
    match ds.problems().into_iter().next() {
        Some(p) => Err(pyo3::exceptions::PyValueError::new_err(p.message)),
        None => Ok(ds),
    }
}

/// Checks an HDF5 dataset description as `stoker.hdf5` builds it: returns
/// the JSON in canonical form, or raises `ValueError` with the problem (the
/// same check the daemon's config and its ad-hoc opens run).
#[pyfunction]
fn check_hdf5(json: &str) -> PyResult<String> {
    let ds = hdf5_dataset(json)?;
    serde_json::to_string(&ds).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<NativeStream>()?;
    m.add_class::<Lease>()?;
    m.add("StokerError", py.get_type::<StokerError>())?;
    m.add("DaemonUnavailable", py.get_type::<DaemonUnavailable>())?;
    m.add("DatasetError", py.get_type::<DatasetError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("LimitError", py.get_type::<LimitError>())?;
    m.add("AccessDenied", py.get_type::<AccessDenied>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("DEFAULT_SOCKET", stoker_client::proto::DEFAULT_SOCKET)?;
    m.add("SOCKET_ENV", stoker_client::proto::SOCKET_ENV)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(parse_steps, m)?)?;
    m.add_function(wrap_pyfunction!(check_hdf5, m)?)?;
    m.add("TRANSFORM_STEPS", stoker_client::proto::step_names())?;
    m.add("PROTOCOL_VERSION", stoker_client::proto::PROTOCOL_VERSION)?;
    Ok(())
}

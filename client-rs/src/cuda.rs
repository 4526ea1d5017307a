//! Host→GPU upload of batches straight from the ring (feature `cuda`).
//!
//! An [`Uploader`] registers each ring segment once with the CUDA driver
//! (`cuMemHostRegister`, read-only), copies a batch's fields to device memory
//! on its own stream, records an event, and keeps the batch's lease (its
//! slot) until that event has completed. Where the device cannot register
//! memory read-only, batches go through a small pinned staging ring instead
//! (one host copy). The driver is loaded at run time (cudarc's
//! `dynamic-loading`), so this builds without a CUDA toolkit and fails with
//! [`CudaError::NoDriver`] where `libcuda` is absent. This module holds every
//! CUDA `unsafe` block of the client.
//!
//! What is registered: not the ring's `MAP_PRIVATE` mapping that batches are
//! read through, but a second, shared read-only view of the same memfd
//! ([`Mapping::shared_view`]), and copies read the field's bytes at the same
//! offset there. Pinning any range of a private (copy-on-write) mapping,
//! even read-only, makes the kernel break copy-on-write first: every page
//! becomes this process's private copy of what the slot held at
//! registration, and the GPU would read those copies for ever after, never
//! the daemon's later batches (found on an H100: every batch from the
//! ring's depth on was stale). A pin of a shared read-only mapping holds the
//! memfd's own pages, which the daemon fills for every batch.

use std::collections::VecDeque;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, DriverError, PinnedHostSlice};
use stoker_proto::{DType, FieldLayout};

use crate::mapping::Mapping;
use crate::{Batch, ClientError};

/// What can go wrong uploading batches to a GPU.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The NVIDIA driver library cannot be loaded.
    #[error(
        "stoker's GPU upload needs the NVIDIA driver library (libcuda.so.1), which this process cannot load: \
         run on a node with an NVIDIA GPU and driver, or put the driver's directory on LD_LIBRARY_PATH"
    )]
    NoDriver,
    /// A driver call failed.
    #[error("CUDA {call} failed: {source}")]
    Driver {
        /// The driver function or step.
        call: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// Taking the batch from the stream failed.
    #[error(transparent)]
    Client(#[from] ClientError),
}

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { call, source }
}

/// How batches reach the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadMode {
    /// Copies straight from the ring, registered read-only with the driver.
    Registered,
    /// One host copy into a pinned staging buffer, then the device copy.
    Staging,
}

/// Completion of queued device work (a CUDA event; a fake one in tests).
pub(crate) trait Completion {
    /// Whether the work is done (never blocks).
    fn is_complete(&self) -> bool;
    /// Blocks until the work is done.
    fn wait(&self) -> Result<(), CudaError>;
}

impl Completion for CudaEvent {
    fn is_complete(&self) -> bool {
        // An error (a failed copy) also ends the wait: the data will not come.
        self.try_is_complete().unwrap_or(true)
    }
    fn wait(&self) -> Result<(), CudaError> {
        self.synchronize().map_err(driver("cuEventSynchronize"))
    }
}

/// Keeps `hold` (a batch's lease) alive until `done` completes: the slot goes
/// back to the daemon only after the device has read it. Dropping an
/// unfinished one waits for the copy.
#[derive(Debug)]
pub(crate) struct HeldUntil<C: Completion, H> {
    done: C,
    hold: Option<H>,
}

impl<C: Completion, H> HeldUntil<C, H> {
    pub(crate) fn new(done: C, hold: H) -> Self {
        HeldUntil { done, hold: Some(hold) }
    }

    /// Releases `hold` if the work completed; whether it is released.
    pub(crate) fn poll(&mut self) -> bool {
        if self.hold.is_some() && self.done.is_complete() {
            self.hold = None;
        }
        self.hold.is_none()
    }

    /// Waits for the work, then releases `hold`.
    pub(crate) fn finish(&mut self) -> Result<(), CudaError> {
        if self.hold.is_some() {
            let waited = self.done.wait();
            self.hold = None;
            waited?;
        }
        Ok(())
    }

    pub(crate) fn completion(&self) -> &C {
        &self.done
    }
}

impl<C: Completion, H> Drop for HeldUntil<C, H> {
    fn drop(&mut self) {
        if self.hold.is_some() {
            // An error means the context is broken (a device fault): no copy
            // can still be reading the slot, so releasing it is safe too.
            let _ = self.done.wait();
        }
        self.hold = None;
    }
}

/// One ring segment registered with the driver; unregistered on drop,
/// before the mapping it holds can be unmapped (the `Arc` drops after
/// `Drop::drop` has run).
#[derive(Debug)]
struct Registration {
    ptr: usize,
    mapping: Arc<Mapping>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: `ptr` is the start of a range this uploader registered with
        // cuMemHostRegister and has not unregistered; the mapping is still
        // alive (held by `self.mapping`), and the uploader synchronized its
        // stream first, so no copy reads the range any more.
        let _ = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
    }
}

/// A pinned staging buffer and the upload that last read it.
#[derive(Debug)]
struct Staging {
    buf: PinnedHostSlice<u8>,
    last: Option<CudaEvent>,
}

/// One field of a batch in device memory.
#[derive(Debug)]
pub struct DeviceField {
    /// The field's layout (name, dtype, per-sample shape).
    pub layout: FieldLayout,
    /// The field's bytes on the device, as in the slot (C order, native
    /// endian; a ragged field: every row's region, `sample_bytes` apart).
    pub data: CudaSlice<u8>,
    /// A ragged field's row shapes (empty for a fixed one).
    pub row_shapes: Vec<Vec<u64>>,
}

impl DeviceField {
    /// Field name.
    pub fn name(&self) -> &str {
        &self.layout.name
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }
}

/// A batch uploaded (or being uploaded) to the device. Its slot stays leased
/// until the copies completed; work on the uploader's stream, or on a stream
/// that waited on [`DeviceBatch::event`], sees the data.
#[derive(Debug)]
pub struct DeviceBatch {
    /// Device copies of the fields, in layout order.
    pub fields: Vec<DeviceField>,
    epoch: u64,
    step: u64,
    rows: u64,
    pending: HeldUntil<CudaEvent, Option<Batch>>,
}

impl DeviceBatch {
    /// Epoch of the batch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    /// Position in its epoch.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// Rows (samples).
    pub fn rows(&self) -> u64 {
        self.rows
    }
    /// The named field.
    pub fn field(&self, name: &str) -> Option<&DeviceField> {
        self.fields.iter().find(|f| f.layout.name == name)
    }
    /// The event recorded after the copies: make another stream wait on it
    /// (`CudaStream::wait`) before it reads the fields.
    pub fn event(&self) -> &CudaEvent {
        self.pending.completion()
    }
    /// Whether the copies completed; once they have, the slot is released.
    pub fn is_uploaded(&mut self) -> bool {
        self.pending.poll()
    }
    /// Blocks until the copies completed, then releases the slot.
    pub fn wait(&mut self) -> Result<(), CudaError> {
        self.pending.finish()
    }
}

/// Uploads batches to one device on a dedicated stream.
#[derive(Debug)]
pub struct Uploader {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    mode: UploadMode,
    read_only_supported: bool,
    registered: Vec<Registration>,
    staging: VecDeque<Staging>,
}

/// Staging buffers kept (one being filled while the other is read).
const STAGING_BUFFERS: usize = 2;

impl Uploader {
    /// An uploader to device `ordinal`, registering ring segments when the
    /// device supports read-only registration ([`UploadMode::Registered`]),
    /// else staging.
    pub fn new(ordinal: usize) -> Result<Uploader, CudaError> {
        Uploader::with_mode(ordinal, UploadMode::Registered)
    }

    /// Like [`Uploader::new`], asking for `mode` (`Staging` forces the
    /// staging path, e.g. to compare both).
    pub fn with_mode(ordinal: usize, mode: UploadMode) -> Result<Uploader, CudaError> {
        // SAFETY: only tries to dlopen libcuda; no CUDA call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("cuInit / cuDevicePrimaryCtxRetain"))?;
        let read_only_supported = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)
            .map_err(driver("cuDeviceGetAttribute"))?
            == 1;
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let mode = if read_only_supported { mode } else { UploadMode::Staging };
        Ok(Uploader { ctx, stream, mode, read_only_supported, registered: Vec::new(), staging: VecDeque::new() })
    }

    /// The path batches take now (`Registered` falls back to `Staging` when
    /// a registration fails).
    pub fn mode(&self) -> UploadMode {
        self.mode
    }

    /// Whether the device can register host memory read-only.
    pub fn read_only_supported(&self) -> bool {
        self.read_only_supported
    }

    /// The uploader's stream (copies run there).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Queues `batch`'s fields for upload and returns at once; the batch's
    /// slot is released once the copies completed (see [`DeviceBatch`]).
    pub fn upload(&mut self, batch: Batch) -> Result<DeviceBatch, CudaError> {
        self.ctx.bind_to_thread().map_err(driver("cuCtxSetCurrent"))?;
        self.sweep()?;
        let in_ring = batch.lease.slot < batch.lease.shared.depth;
        // Extra segments are unmapped when their lease drops: they are never
        // registered (registration would have to end before that), only staged.
        let view =
            if in_ring && self.mode == UploadMode::Registered { self.register(&batch.lease.mapping)? } else { None };
        let registered = view.is_some();
        let mut fields = Vec::with_capacity(batch.layout().fields.len());
        let mut staged: Option<Staging> = None;
        if !registered {
            let need = batch.fields().map(|f| f.bytes().len()).sum::<usize>();
            let mut stage = self.staging_buffer(need)?;
            let host = stage.buf.as_mut_slice().map_err(driver("cuEventSynchronize (staging)"))?;
            let mut at = 0;
            for f in batch.fields() {
                host[at..at + f.bytes().len()].copy_from_slice(f.bytes());
                at += f.bytes().len();
            }
            staged = Some(stage);
        }
        let mut at = 0;
        for f in batch.fields() {
            let len = f.bytes().len();
            // SAFETY: the memory is written by the copy below before anyone
            // can read it through the stream (stream order) or the event.
            let mut data = unsafe { self.stream.alloc::<u8>(len.max(1)) }.map_err(driver("cuMemAlloc"))?;
            let src: &[u8] = match &staged {
                // SAFETY: `at..at + len` lies inside the staging buffer (sized
                // to the sum of the field lengths above); the buffer stays
                // alive and unwritten until the event recorded below
                // completed (`staging_buffer` waits on it before reuse).
                Some(s) => unsafe {
                    std::slice::from_raw_parts(s.buf.as_ptr().map_err(driver("staging"))?.add(at), len)
                },
                // The same bytes in the registered shared view (see `register`).
                None => {
                    let (private, shared) = view.expect("registered when not staged");
                    let offset = f.bytes().as_ptr() as usize - private;
                    // SAFETY: the field lies inside its slot, inside the private
                    // mapping that starts at `private`; the view maps the same
                    // file at the same offsets with the same length, and the
                    // registration keeps it mapped.
                    unsafe { std::slice::from_raw_parts((shared + offset) as *const u8, len) }
                }
            };
            if len > 0 {
                let (dst, _record) = data.device_ptr_mut(&self.stream);
                // SAFETY: `dst` is a fresh allocation of at least `len` bytes
                // on this stream. `src` stays valid and unchanged until the
                // copy completed: either the staging buffer (see above) or
                // the slot, registered read-only and leased by `batch`, which
                // the returned DeviceBatch keeps until the event recorded
                // after this copy completed; nobody writes a registered slot
                // (Rust views are read-only).
                unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
                    .map_err(driver("cuMemcpyHtoDAsync"))?;
            }
            let row_shapes = if f.is_ragged() {
                (0..batch.rows).map(|i| f.row(i).map(|(shape, _)| shape)).collect::<Result<Vec<_>, _>>()?
            } else {
                Vec::new()
            };
            fields.push(DeviceField { layout: batch_field(&batch, f.name()), data, row_shapes });
            at += len;
        }
        let event = self.stream.record_event(None).map_err(driver("cuEventRecord"))?;
        let (epoch, step, rows) = (batch.epoch, batch.step, batch.rows);
        let hold = match staged {
            Some(mut s) => {
                // Staged: the slot is free as soon as its bytes are in the buffer.
                s.last = Some(self.stream.record_event(None).map_err(driver("cuEventRecord"))?);
                self.staging.push_back(s);
                drop(batch);
                None
            }
            None => Some(batch),
        };
        Ok(DeviceBatch { fields, epoch, step, rows, pending: HeldUntil::new(event, hold) })
    }

    /// Registers the shared read-only view of `mapping` once (see
    /// [`Mapping::shared_view`]) and returns `(private start, view start)`;
    /// `None` (and staging from now on) when it cannot be mapped or the
    /// driver refuses.
    fn register(&mut self, mapping: &Arc<Mapping>) -> Result<Option<(usize, usize)>, CudaError> {
        if let Some(r) = self.registered.iter().find(|r| Arc::ptr_eq(&r.mapping, mapping)) {
            return Ok(Some((mapping.range().0, r.ptr)));
        }
        let Ok((ptr, len)) = mapping.shared_view() else {
            self.mode = UploadMode::Staging;
            return Ok(None);
        };
        // SAFETY: `[ptr, ptr + len)` is the whole shared read-only view, kept
        // alive by the Registration below (which holds the mapping) until it
        // unregisters. READ_ONLY: the device only reads it; the view is
        // shared, so the pin holds the memfd's own pages, which the daemon
        // writes for every batch (see the module docs).
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                ptr as *mut std::ffi::c_void,
                len,
                sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            self.mode = UploadMode::Staging;
            return Ok(None);
        }
        self.registered.push(Registration { ptr, mapping: mapping.clone() });
        Ok(Some((mapping.range().0, ptr)))
    }

    /// Unregisters segments no stream or batch uses any more (only the
    /// registration holds them), so they can be unmapped.
    fn sweep(&mut self) -> Result<(), CudaError> {
        if self.registered.iter().any(|r| Arc::strong_count(&r.mapping) == 1) {
            self.stream.synchronize().map_err(driver("cuStreamSynchronize"))?;
            self.registered.retain(|r| Arc::strong_count(&r.mapping) > 1);
        }
        Ok(())
    }

    /// A staging buffer of at least `need` bytes whose last upload completed.
    fn staging_buffer(&mut self, need: usize) -> Result<Staging, CudaError> {
        if self.staging.len() >= STAGING_BUFFERS
            && let Some(s) = self.staging.pop_front()
        {
            if let Some(last) = &s.last {
                last.wait()?;
            }
            if s.buf.len() >= need {
                return Ok(Staging { buf: s.buf, last: None });
            }
        }
        // SAFETY: the buffer is written (copy_from_slice) before it is read.
        let buf =
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(need.max(1), 0) }.map_err(driver("cuMemHostAlloc"))?;
        Ok(Staging { buf, last: None })
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        // No copy may read a registered range once it is unregistered, and
        // cuMemHostUnregister needs the context current on this thread.
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        self.registered.clear();
    }
}

fn batch_field(batch: &Batch, name: &str) -> FieldLayout {
    batch.layout().fields.iter().find(|f| f.name == name).cloned().expect("field of this batch's own layout")
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    /// An event the test completes by hand.
    struct FakeEvent(Rc<Cell<bool>>);
    impl Completion for FakeEvent {
        fn is_complete(&self) -> bool {
            self.0.get()
        }
        fn wait(&self) -> Result<(), CudaError> {
            // The "device" finishes when waited on.
            self.0.set(true);
            Ok(())
        }
    }

    /// Counts its drops (stands for a lease: a drop releases the slot).
    struct Slot(Rc<Cell<u32>>);
    impl Drop for Slot {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }

    #[test]
    fn the_slot_is_kept_until_the_event_completed() {
        let done = Rc::new(Cell::new(false));
        let released = Rc::new(Cell::new(0));
        let mut held = HeldUntil::new(FakeEvent(done.clone()), Slot(released.clone()));
        assert!(!held.poll());
        assert!(!held.poll());
        assert_eq!(released.get(), 0, "released before the copy completed");
        done.set(true);
        assert!(held.poll());
        assert_eq!(released.get(), 1);
        assert!(held.poll());
        drop(held);
        assert_eq!(released.get(), 1, "released twice");
    }

    #[test]
    fn dropping_an_unfinished_upload_waits_before_releasing() {
        let done = Rc::new(Cell::new(false));
        let released = Rc::new(Cell::new(0));
        let held = HeldUntil::new(FakeEvent(done.clone()), Slot(released.clone()));
        drop(held);
        assert!(done.get(), "the drop did not wait for the event");
        assert_eq!(released.get(), 1);
    }

    #[test]
    fn finish_waits_then_releases_once() {
        let done = Rc::new(Cell::new(false));
        let released = Rc::new(Cell::new(0));
        let mut held = HeldUntil::new(FakeEvent(done.clone()), Slot(released.clone()));
        held.finish().expect("fake wait");
        assert!(done.get());
        assert_eq!(released.get(), 1);
        held.finish().expect("second finish is a no-op");
        drop(held);
        assert_eq!(released.get(), 1);
    }

    #[test]
    fn without_a_driver_the_error_says_what_to_do() {
        // SAFETY: only tries to dlopen libcuda.
        if unsafe { sys::is_culib_present() } {
            eprintln!("skipped: libcuda is present here, so the no-driver error cannot be provoked");
            return;
        }
        let err = Uploader::new(0).expect_err("no driver here");
        assert!(matches!(err, CudaError::NoDriver));
        assert!(err.to_string().contains("libcuda.so.1"), "{err}");
    }
}

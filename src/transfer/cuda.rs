//! CUDA backend: block copies with the CUDA driver API, loaded at run time.
//!
//! The driver library (`libcuda.so`) is opened by `cudarc` (feature `dynamic-loading`) the first
//! time it is needed. `cudarc`'s `sys::cu*` wrappers panic when the library or a symbol is
//! missing, and their `CUresult` return type is a Rust enum (an unknown code from a newer driver
//! would be undefined behaviour), so this module resolves the entry points it uses itself, through
//! `sys::culib()` after `sys::is_culib_present()`, into a table of function pointers that return
//! the raw `CUresult` integer. A missing library, a missing symbol, a failing `cuInit` or no device
//! all become [`Error::CudaUnavailable`]; nothing here panics on a machine without a GPU.
//! `cudarc` still provides the handle types and the struct layouts (`CUmemcpyAttributes`).
//!
//! Copies (as vLLM 0.24 `SingleDirectionOffloadingHandler` and `swap_blocks_batch`;
//! `docs/design.md` §8):
//! - one non-blocking stream per direction; stream order runs the jobs of one direction strictly
//!   in submission order, and the two directions overlap;
//! - a store (`Direction::Store`) given a compute stream first makes its stream wait for an
//!   event recorded on the compute stream, so it reads only KV the forward pass already wrote;
//! - each job is `record(start); copies; record(end)`, with timing events taken from a pool;
//! - the copies are one `cuMemcpyBatchAsync` (CUDA 12.8 signature, one attribute for all copies:
//!   source access order ANY for host→KV, STREAM for KV→host) when the driver reports version
//!   12.8 or newer and exports the symbol, otherwise a loop of `cuMemcpyAsync`; when a batch call
//!   fails but the loop then copies the same job, the backend keeps to the loop;
//! - `poll` pops each direction's FIFO while the head's end event is complete.
//!
//! Every call makes the backend's (primary) context current on the calling thread and restores the
//! thread's previous context afterwards, so the methods may be called from any thread and do not
//! disturb a host that uses another context.

use super::backend::{Backend, Completion, CopyDesc};
use crate::error::{Error, Result};
use crate::plan::Direction;
use cudarc::driver::sys;
use std::collections::VecDeque;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A raw `CUresult`.
type CuResult = c_uint;
const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_NOT_READY: CuResult = sys::CUresult::CUDA_ERROR_NOT_READY as CuResult;
const HOST_MEMORY_ALREADY_REGISTERED: CuResult =
    sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED as CuResult;

/// Most bytes page-locked by one `cuMemHostRegister` call (vLLM pins in pieces of at most
/// 64 GiB: drivers refuse single registrations of several hundred GiB).
pub const PIN_CHUNK_BYTES: usize = 64 << 30;

/// The oldest driver (`cuDriverGetVersion`) with `cuMemcpyBatchAsync`.
const BATCH_MIN_DRIVER_VERSION: c_int = 12080;

const STREAM_NON_BLOCKING: c_uint = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
const EVENT_TIMING: c_uint = sys::CUevent_flags::CU_EVENT_DEFAULT as c_uint;
const EVENT_NO_TIMING: c_uint = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
const HOST_REGISTER_PORTABLE: c_uint = sys::CU_MEMHOSTREGISTER_PORTABLE;

type FnInit = unsafe extern "C" fn(c_uint) -> CuResult;
type FnOutInt = unsafe extern "C" fn(*mut c_int) -> CuResult;
type FnDeviceGet = unsafe extern "C" fn(*mut sys::CUdevice, c_int) -> CuResult;
type FnCtxRetain = unsafe extern "C" fn(*mut sys::CUcontext, sys::CUdevice) -> CuResult;
type FnCtxRelease = unsafe extern "C" fn(sys::CUdevice) -> CuResult;
type FnCtxSet = unsafe extern "C" fn(sys::CUcontext) -> CuResult;
type FnCtxGet = unsafe extern "C" fn(*mut sys::CUcontext) -> CuResult;
type FnStreamCreate = unsafe extern "C" fn(*mut sys::CUstream, c_uint) -> CuResult;
type FnStream = unsafe extern "C" fn(sys::CUstream) -> CuResult;
type FnStreamWaitEvent = unsafe extern "C" fn(sys::CUstream, sys::CUevent, c_uint) -> CuResult;
type FnEventCreate = unsafe extern "C" fn(*mut sys::CUevent, c_uint) -> CuResult;
type FnEvent = unsafe extern "C" fn(sys::CUevent) -> CuResult;
type FnEventRecord = unsafe extern "C" fn(sys::CUevent, sys::CUstream) -> CuResult;
type FnElapsed = unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> CuResult;
type FnMemcpyAsync =
    unsafe extern "C" fn(sys::CUdeviceptr, sys::CUdeviceptr, usize, sys::CUstream) -> CuResult;
type FnHostRegister = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult;
type FnHostUnregister = unsafe extern "C" fn(*mut c_void) -> CuResult;
type FnErrorName = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;
/// `cuMemcpyBatchAsync` as of CUDA 12.8 (with `failIdx`).
type FnBatchV1 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> CuResult;
/// `cuMemcpyBatchAsync_v2` (CUDA 13: no `failIdx`).
type FnBatchV2 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> CuResult;

#[derive(Clone, Copy)]
enum BatchFn {
    V1(FnBatchV1),
    V2(FnBatchV2),
}

/// The driver entry points this backend uses, resolved once per process.
struct Api {
    init: FnInit,
    driver_get_version: FnOutInt,
    device_get_count: FnOutInt,
    device_get: FnDeviceGet,
    primary_ctx_retain: FnCtxRetain,
    primary_ctx_release: FnCtxRelease,
    ctx_set_current: FnCtxSet,
    ctx_get_current: FnCtxGet,
    stream_create: FnStreamCreate,
    stream_destroy: FnStream,
    stream_synchronize: FnStream,
    stream_wait_event: FnStreamWaitEvent,
    event_create: FnEventCreate,
    event_destroy: FnEvent,
    event_record: FnEventRecord,
    event_query: FnEvent,
    event_elapsed_time: FnElapsed,
    memcpy_async: FnMemcpyAsync,
    host_register: FnHostRegister,
    host_unregister: FnHostUnregister,
    /// Optional: error names fall back to the number.
    get_error_name: Option<FnErrorName>,
    /// Optional: CUDA 12.8+ drivers.
    batch: Option<BatchFn>,
}

/// Looks `name` (NUL-terminated) up in the driver library. `T` must be the symbol's function
/// pointer type.
///
/// # Safety
/// The driver library must be present (`sys::is_culib_present()` returned true), and `T` must
/// match the C prototype of the symbol.
unsafe fn symbol<T: Copy>(name: &[u8]) -> Option<T> {
    // SAFETY: the caller checked that the library loads, so `culib` does not panic; the library is
    // held in a static for the life of the process, so the symbol stays valid.
    let lib = unsafe { sys::culib() };
    // SAFETY: the caller guarantees `T` is the symbol's type; libloading checks the size.
    unsafe { lib.get::<T>(name) }.ok().map(|s| *s)
}

impl Api {
    fn load() -> Result<Api, String> {
        // SAFETY: dlopens the driver library (running its initialisers), which is what loading
        // the CUDA driver means; nothing else is executed.
        if !unsafe { sys::is_culib_present() } {
            return Err(format!(
                "no CUDA driver library found (tried {})",
                cudarc::get_lib_name_candidates("cuda").join(", ")
            ));
        }
        macro_rules! required {
            ($name:literal) => {
                // SAFETY: the library is present (checked above) and the field's type is the
                // symbol's prototype from cuda.h.
                match unsafe { symbol(concat!($name, "\0").as_bytes()) } {
                    Some(f) => f,
                    None => {
                        return Err(format!("the CUDA driver library does not export {}", $name));
                    }
                }
            };
        }
        macro_rules! optional {
            ($name:literal) => {
                // SAFETY: as for `required!`.
                unsafe { symbol(concat!($name, "\0").as_bytes()) }
            };
        }
        let batch = match optional!("cuMemcpyBatchAsync") {
            Some(f) => Some(BatchFn::V1(f)),
            None => optional!("cuMemcpyBatchAsync_v2").map(BatchFn::V2),
        };
        let event_elapsed_time = match optional!("cuEventElapsedTime_v2") {
            Some(f) => f,
            None => required!("cuEventElapsedTime"),
        };
        Ok(Api {
            init: required!("cuInit"),
            driver_get_version: required!("cuDriverGetVersion"),
            device_get_count: required!("cuDeviceGetCount"),
            device_get: required!("cuDeviceGet"),
            primary_ctx_retain: required!("cuDevicePrimaryCtxRetain"),
            primary_ctx_release: required!("cuDevicePrimaryCtxRelease_v2"),
            ctx_set_current: required!("cuCtxSetCurrent"),
            ctx_get_current: required!("cuCtxGetCurrent"),
            stream_create: required!("cuStreamCreate"),
            stream_destroy: required!("cuStreamDestroy_v2"),
            stream_synchronize: required!("cuStreamSynchronize"),
            stream_wait_event: required!("cuStreamWaitEvent"),
            event_create: required!("cuEventCreate"),
            event_destroy: required!("cuEventDestroy_v2"),
            event_record: required!("cuEventRecord"),
            event_query: required!("cuEventQuery"),
            event_elapsed_time,
            memcpy_async: required!("cuMemcpyAsync"),
            host_register: required!("cuMemHostRegister_v2"),
            host_unregister: required!("cuMemHostUnregister"),
            get_error_name: optional!("cuGetErrorName"),
            batch,
        })
    }

    /// `"CUDA_ERROR_INVALID_VALUE (1)"`.
    fn describe(&self, code: CuResult) -> String {
        let mut name: *const c_char = std::ptr::null();
        if let Some(f) = self.get_error_name {
            // SAFETY: cuGetErrorName writes a pointer to a static string, or fails.
            let rc = unsafe { f(code, &mut name) };
            if rc != CUDA_SUCCESS {
                name = std::ptr::null();
            }
        }
        if name.is_null() {
            return format!("unknown CUDA error ({code})");
        }
        // SAFETY: the driver returned a NUL-terminated string that lives as long as the library.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        format!("{name} ({code})")
    }

    /// `Error::Cuda("<call> failed: CUDA_ERROR_... (n)<context>")`.
    fn error(&self, call: &str, code: CuResult, context: &str) -> Error {
        Error::Cuda(format!("{call} failed: {}{context}", self.describe(code)))
    }

    fn check(&self, call: &str, code: CuResult) -> Result<()> {
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, code, ""))
        }
    }

    /// `cuInit(0)` and the number of devices.
    fn init(&self) -> Result<c_int> {
        // SAFETY: plain driver call.
        let rc = unsafe { (self.init)(0) };
        if rc != CUDA_SUCCESS {
            return Err(Error::CudaUnavailable(format!(
                "cuInit failed: {}",
                self.describe(rc)
            )));
        }
        let mut count: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (self.device_get_count)(&mut count) };
        if rc != CUDA_SUCCESS {
            return Err(Error::CudaUnavailable(format!(
                "cuDeviceGetCount failed: {}",
                self.describe(rc)
            )));
        }
        if count <= 0 {
            return Err(Error::CudaUnavailable("no CUDA device".into()));
        }
        Ok(count)
    }
}

/// The driver table, or why there is none.
fn api() -> Result<&'static Api> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    // `culib` panics only if the library vanished between the presence check and the load; keep
    // even that from unwinding into the caller.
    API.get_or_init(|| {
        std::panic::catch_unwind(Api::load)
            .unwrap_or_else(|_| Err("loading the CUDA driver library panicked".into()))
    })
    .as_ref()
    .map_err(|msg| Error::CudaUnavailable(msg.clone()))
}

/// True when a CUDA driver with every entry point this backend needs is installed, `cuInit`
/// succeeds and there is at least one device. Never panics; computed once per process.
pub fn cuda_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| api().and_then(|api| api.init()).is_ok())
}

/// The driver's version (`cuDriverGetVersion`, e.g. 12080 for 12.8), or `None` without a driver.
pub fn cuda_driver_version() -> Option<i32> {
    let api = api().ok()?;
    let mut v: c_int = 0;
    // SAFETY: writes one int; needs no cuInit.
    let rc = unsafe { (api.driver_get_version)(&mut v) };
    (rc == CUDA_SUCCESS).then_some(v)
}

/// Makes a context current on this thread for its lifetime and restores the previous one after.
struct CurrentCtx {
    api: &'static Api,
    previous: Option<sys::CUcontext>,
}

impl CurrentCtx {
    fn enter(api: &'static Api, ctx: sys::CUcontext) -> Result<CurrentCtx> {
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle.
        let rc = unsafe { (api.ctx_get_current)(&mut previous) };
        api.check("cuCtxGetCurrent", rc)?;
        if previous == ctx {
            return Ok(CurrentCtx {
                api,
                previous: None,
            });
        }
        // SAFETY: `ctx` is the primary context this backend retained.
        let rc = unsafe { (api.ctx_set_current)(ctx) };
        api.check("cuCtxSetCurrent", rc)?;
        Ok(CurrentCtx {
            api,
            previous: Some(previous),
        })
    }
}

impl Drop for CurrentCtx {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: restores the handle that was current before (possibly null, which unbinds).
            let _ = unsafe { (self.api.ctx_set_current)(previous) };
        }
    }
}

/// A queued job.
struct InFlight {
    job_id: u64,
    start: sys::CUevent,
    end: sys::CUevent,
    bytes: u64,
}

fn index(dir: Direction) -> usize {
    match dir {
        Direction::Load => 0,
        Direction::Store => 1,
    }
}

const DIRECTIONS: [Direction; 2] = [Direction::Load, Direction::Store];

/// Copies with the CUDA driver on one device: one stream and one FIFO of jobs per direction.
///
/// Created by [`CudaBackend::new`]; see the module documentation for the ordering rules.
pub struct CudaBackend {
    api: &'static Api,
    device: sys::CUdevice,
    /// The device's primary context; null until retained.
    ctx: sys::CUcontext,
    driver_version: i32,
    /// Indexed by [`index`]; null until created.
    streams: [sys::CUstream; 2],
    /// Recorded on the compute stream before a store (no timing).
    compute_done: sys::CUevent,
    fifos: [VecDeque<InFlight>; 2],
    /// Timing events to reuse.
    event_pool: Vec<sys::CUevent>,
    /// Use `cuMemcpyBatchAsync` (only when the driver has it).
    use_batch: bool,
    /// Host ranges registered through this backend and not unregistered yet: (start, the
    /// pieces this backend page-locked).
    registered: Vec<(usize, Vec<usize>)>,
    /// Most bytes page-locked by one `cuMemHostRegister` call.
    pin_chunk: usize,
    scratch_src: Vec<sys::CUdeviceptr>,
    scratch_dst: Vec<sys::CUdeviceptr>,
    scratch_size: Vec<usize>,
}

// SAFETY: the raw handles (context, streams, events) are plain driver handles that any thread may
// use once the context is current, and every method makes it current on the calling thread. The
// backend is only used through `&mut self` (it is not `Sync`), so no two threads use it at once.
unsafe impl Send for CudaBackend {}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.device)
            .field("driver_version", &self.driver_version)
            .field("batch_copy", &self.use_batch)
            .field("loads_in_flight", &self.fifos[0].len())
            .field("stores_in_flight", &self.fifos[1].len())
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Opens device `device`: initialises the driver, retains the device's primary context (the
    /// one the CUDA runtime and PyTorch use), and creates one non-blocking stream per direction.
    ///
    /// Errors: [`Error::CudaUnavailable`] without a usable driver or device,
    /// [`Error::InvalidArgument`] for a device number out of range, [`Error::Cuda`] when a driver
    /// call fails.
    pub fn new(device: i32) -> Result<CudaBackend> {
        let api = api()?;
        let count = api.init()?;
        if device < 0 || device >= count {
            return Err(crate::error::invalid!(
                "CUDA device {device} out of range: {count} device(s)"
            ));
        }
        let mut driver_version: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (api.driver_get_version)(&mut driver_version) };
        api.check("cuDriverGetVersion", rc)?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes one device handle.
        let rc = unsafe { (api.device_get)(&mut dev, device) };
        api.check("cuDeviceGet", rc)?;

        // From here on `Drop` releases whatever was created.
        let mut backend = CudaBackend {
            api,
            device: dev,
            ctx: std::ptr::null_mut(),
            driver_version,
            streams: [std::ptr::null_mut(); 2],
            compute_done: std::ptr::null_mut(),
            fifos: [VecDeque::new(), VecDeque::new()],
            event_pool: Vec::new(),
            use_batch: api.batch.is_some() && driver_version >= BATCH_MIN_DRIVER_VERSION,
            registered: Vec::new(),
            pin_chunk: PIN_CHUNK_BYTES,
            scratch_src: Vec::new(),
            scratch_dst: Vec::new(),
            scratch_size: Vec::new(),
        };
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle; `dev` came from cuDeviceGet.
        let rc = unsafe { (api.primary_ctx_retain)(&mut ctx, dev) };
        api.check("cuDevicePrimaryCtxRetain", rc)?;
        backend.ctx = ctx;

        let current = CurrentCtx::enter(api, ctx)?;
        for i in 0..2 {
            let mut stream: sys::CUstream = std::ptr::null_mut();
            // SAFETY: writes one stream handle; the context is current.
            let rc = unsafe { (api.stream_create)(&mut stream, STREAM_NON_BLOCKING) };
            api.check("cuStreamCreate", rc)?;
            backend.streams[i] = stream;
        }
        backend.compute_done = backend.create_event(EVENT_NO_TIMING)?;
        drop(current);
        Ok(backend)
    }

    /// The driver's version (`cuDriverGetVersion`, e.g. 12080 for 12.8).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Whether the driver offers `cuMemcpyBatchAsync` (version 12.8 or newer and the symbol).
    pub fn batch_copy_available(&self) -> bool {
        self.api.batch.is_some() && self.driver_version >= BATCH_MIN_DRIVER_VERSION
    }

    /// Whether jobs use one `cuMemcpyBatchAsync` (true) or a loop of `cuMemcpyAsync` (false).
    pub fn uses_batch_copy(&self) -> bool {
        self.use_batch
    }

    /// Chooses the batched copy (where available) or the per-descriptor loop, for comparisons and
    /// as a workaround. Returns what is used from now on.
    pub fn set_batch_copy(&mut self, on: bool) -> bool {
        self.use_batch = on && self.batch_copy_available();
        self.use_batch
    }

    /// Most bytes one `cuMemHostRegister` call page-locks ([`PIN_CHUNK_BYTES`] unless changed).
    pub fn pin_chunk(&self) -> usize {
        self.pin_chunk
    }

    /// Sets the most bytes one `cuMemHostRegister` call page-locks (rounded up to 4096, at
    /// least 4096); for drivers with a lower ceiling, and for tests.
    pub fn set_pin_chunk(&mut self, bytes: usize) {
        self.pin_chunk = bytes.max(1).next_multiple_of(4096);
    }

    /// Number of jobs queued and not yet reported by [`Backend::poll`] in direction `dir`.
    pub fn in_flight(&self, dir: Direction) -> usize {
        self.fifos[index(dir)].len()
    }

    fn enter(&self) -> Result<CurrentCtx> {
        CurrentCtx::enter(self.api, self.ctx)
    }

    fn create_event(&self, flags: c_uint) -> Result<sys::CUevent> {
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; the caller made the context current.
        let rc = unsafe { (self.api.event_create)(&mut event, flags) };
        self.api.check("cuEventCreate", rc)?;
        Ok(event)
    }

    /// A timing event from the pool, or a new one.
    fn take_event(&mut self) -> Result<sys::CUevent> {
        match self.event_pool.pop() {
            Some(e) => Ok(e),
            None => self.create_event(EVENT_TIMING),
        }
    }

    fn destroy_event(&self, event: sys::CUevent) {
        if !event.is_null() {
            // SAFETY: `event` was created by this backend and is destroyed once.
            let _ = unsafe { (self.api.event_destroy)(event) };
        }
    }

    fn record(&self, event: sys::CUevent, stream: sys::CUstream) -> Result<()> {
        // SAFETY: `event` is this backend's; `stream` is ours or the host's compute stream.
        let rc = unsafe { (self.api.event_record)(event, stream) };
        self.api.check("cuEventRecord", rc)
    }

    /// Queues the job's work on `stream`. On error the caller synchronizes the stream.
    fn enqueue(
        &mut self,
        dir: Direction,
        descs: &[CopyDesc],
        compute_stream: u64,
        start: sys::CUevent,
        end: sys::CUevent,
    ) -> Result<()> {
        let api = self.api;
        let stream = self.streams[index(dir)];
        if dir == Direction::Store && compute_stream != 0 {
            let compute: sys::CUstream =
                std::ptr::with_exposed_provenance_mut(compute_stream as usize);
            self.record(self.compute_done, compute)?;
            // SAFETY: both handles are valid; a later re-record of the event does not affect this
            // wait (it captures the event's state now).
            let rc = unsafe { (api.stream_wait_event)(stream, self.compute_done, 0) };
            api.check("cuStreamWaitEvent", rc)?;
        }
        self.record(start, stream)?;
        self.scratch_src.clear();
        self.scratch_dst.clear();
        self.scratch_size.clear();
        for d in descs.iter().filter(|d| d.size > 0) {
            self.scratch_src.push(d.src);
            self.scratch_dst.push(d.dst);
            // Fits: the caller checked every size against usize.
            self.scratch_size.push(d.size as usize);
        }
        let n = self.scratch_size.len();
        if n > 0 {
            match api.batch.filter(|_| self.use_batch) {
                Some(batch) => {
                    if let Err(batch_err) = self.copy_batch(batch, dir, stream) {
                        // The batch call is the newest path and the least tried: when the plain
                        // copies of the same job work, use them from now on; when they fail too,
                        // the job is bad and both errors are reported.
                        match self.copy_loop(stream) {
                            Ok(()) => self.use_batch = false,
                            Err(loop_err) => {
                                return Err(Error::Cuda(format!(
                                    "{batch_err}; the cuMemcpyAsync loop failed as well: {loop_err}"
                                )));
                            }
                        }
                    }
                }
                None => self.copy_loop(stream)?,
            }
        }
        self.record(end, stream)
    }

    /// One `cuMemcpyAsync` per descriptor of the scratch arrays.
    fn copy_loop(&self, stream: sys::CUstream) -> Result<()> {
        let n = self.scratch_size.len();
        for i in 0..n {
            let (src, dst, size) = (
                self.scratch_src[i],
                self.scratch_dst[i],
                self.scratch_size[i],
            );
            // SAFETY: the driver validates the addresses (device, registered or pageable host
            // memory, per unified addressing) and fails otherwise.
            let rc = unsafe { (self.api.memcpy_async)(dst, src, size, stream) };
            if rc != CUDA_SUCCESS {
                return Err(self.api.error(
                    "cuMemcpyAsync",
                    rc,
                    &format!(" at copy {i} of {n} (src {src:#x}, dst {dst:#x}, {size} bytes)"),
                ));
            }
        }
        Ok(())
    }

    /// One `cuMemcpyBatchAsync` over the scratch arrays.
    fn copy_batch(&mut self, batch: BatchFn, dir: Direction, stream: sys::CUstream) -> Result<()> {
        let n = self.scratch_size.len();
        let host = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        };
        let device = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.device,
        };
        let (order, src_hint, dst_hint) = match dir {
            // The host tier's source is never written while a load reads it: any order.
            Direction::Load => (
                sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
                host,
                device,
            ),
            // The KV source is written by stream-ordered work: respect stream order.
            Direction::Store => (
                sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                device,
                host,
            ),
        };
        let mut attrs = sys::CUmemcpyAttributes {
            srcAccessOrder: order,
            srcLocHint: src_hint,
            dstLocHint: dst_hint,
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_DEFAULT as c_uint,
        };
        let mut attrs_idx: usize = 0;
        let mut fail_idx: usize = usize::MAX;
        let (dsts, srcs, sizes) = (
            self.scratch_dst.as_mut_ptr(),
            self.scratch_src.as_mut_ptr(),
            self.scratch_size.as_mut_ptr(),
        );
        let (rc, call) = match batch {
            // SAFETY: three arrays of `n` elements, one attribute applying from copy 0, a valid
            // non-default stream; the driver reads the arrays during the call only.
            BatchFn::V1(f) => (
                unsafe {
                    f(
                        dsts,
                        srcs,
                        sizes,
                        n,
                        &mut attrs,
                        &mut attrs_idx,
                        1,
                        &mut fail_idx,
                        stream,
                    )
                },
                "cuMemcpyBatchAsync",
            ),
            // SAFETY: as above.
            BatchFn::V2(f) => (
                unsafe { f(dsts, srcs, sizes, n, &mut attrs, &mut attrs_idx, 1, stream) },
                "cuMemcpyBatchAsync_v2",
            ),
        };
        if rc == CUDA_SUCCESS {
            return Ok(());
        }
        let context = match (
            self.scratch_src.get(fail_idx),
            self.scratch_dst.get(fail_idx),
            self.scratch_size.get(fail_idx),
        ) {
            (Some(src), Some(dst), Some(size)) => {
                format!(" at copy {fail_idx} of {n} (src {src:#x}, dst {dst:#x}, {size} bytes)")
            }
            _ => format!(" ({n} copies)"),
        };
        Err(self.api.error(call, rc, &context))
    }

    /// Whether `event` has completed: `Ok(true)`, `Ok(false)` (not ready), or the driver's error.
    fn query(&self, event: sys::CUevent) -> Result<bool> {
        // SAFETY: `event` is this backend's.
        let rc = unsafe { (self.api.event_query)(event) };
        match rc {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            _ => Err(self.api.error("cuEventQuery", rc, "")),
        }
    }

    /// Seconds between two completed events, 0 if the driver cannot say.
    fn elapsed(&self, start: sys::CUevent, end: sys::CUevent) -> f64 {
        let mut ms: f32 = 0.0;
        // SAFETY: both events are this backend's, recorded on the same stream, and complete.
        let rc = unsafe { (self.api.event_elapsed_time)(&mut ms, start, end) };
        if rc == CUDA_SUCCESS && ms.is_finite() && ms >= 0.0 {
            f64::from(ms) * 1e-3
        } else {
            0.0
        }
    }
}

impl Backend for CudaBackend {
    /// Page-locks the range in pieces of at most [`CudaBackend::pin_chunk`] bytes (drivers
    /// refuse very large single registrations); if a piece fails, the pieces locked before it
    /// are unlocked again and nothing stays registered.
    fn register_host(&mut self, ptr: *mut u8, len: usize) -> Result<()> {
        if ptr.is_null() {
            return Err(crate::error::invalid!(
                "register_host: ptr is null (len {len})"
            ));
        }
        if len == 0 {
            return Err(crate::error::invalid!(
                "register_host: len is 0 (ptr {ptr:p})"
            ));
        }
        let _current = self.enter()?;
        let mut pieces = Vec::with_capacity(len.div_ceil(self.pin_chunk));
        for off in (0..len).step_by(self.pin_chunk) {
            let (p, n) = (ptr.wrapping_add(off), self.pin_chunk.min(len - off));
            // SAFETY: the caller owns `len` bytes at `ptr`; the driver page-locks this piece of
            // them (or fails).
            let rc = unsafe { (self.api.host_register)(p.cast(), n, HOST_REGISTER_PORTABLE) };
            if rc == HOST_MEMORY_ALREADY_REGISTERED {
                // The caller's memory is pinned already (e.g. cudaHostAlloc): usable as is, and
                // not ours to unregister.
                continue;
            }
            if rc != CUDA_SUCCESS {
                for &q in &pieces {
                    // SAFETY: registered just above by this call.
                    let _ = unsafe { (self.api.host_unregister)(q as *mut c_void) };
                }
                return Err(self.api.error(
                    "cuMemHostRegister",
                    rc,
                    &format!(
                        " (ptr {ptr:p}, {len} bytes: piece at offset {off} of {n} bytes; {} pieces before it unregistered)",
                        pieces.len()
                    ),
                ));
            }
            pieces.push(p as usize);
        }
        if !pieces.is_empty() {
            self.registered.push((ptr as usize, pieces));
        }
        Ok(())
    }

    fn unregister_host(&mut self, ptr: *mut u8) -> Result<()> {
        if ptr.is_null() {
            return Err(crate::error::invalid!("unregister_host: ptr is null"));
        }
        let _current = self.enter()?;
        // Whatever the driver answers, the range must not be unregistered again at drop.
        let pieces = match self.registered.iter().position(|r| r.0 == ptr as usize) {
            Some(i) => self.registered.swap_remove(i).1,
            None => vec![ptr as usize],
        };
        let mut result = Ok(());
        for p in pieces {
            // SAFETY: the driver looks the address up in its registrations and fails if unknown.
            let rc = unsafe { (self.api.host_unregister)(p as *mut c_void) };
            if rc != CUDA_SUCCESS && result.is_ok() {
                result = Err(self.api.error(
                    "cuMemHostUnregister",
                    rc,
                    &format!(" (ptr {:p})", p as *mut u8),
                ));
            }
        }
        result
    }

    /// Queues the job on its direction's stream. On error nothing is queued, the job will not
    /// complete, and copies already issued for it have finished (the stream is synchronized).
    fn submit(
        &mut self,
        job_id: u64,
        dir: Direction,
        descs: &[CopyDesc],
        compute_stream: u64,
    ) -> Result<()> {
        let mut bytes: u64 = 0;
        for (i, d) in descs.iter().enumerate() {
            if usize::try_from(d.size).is_err() {
                return Err(crate::error::invalid!(
                    "job {job_id}: descs[{i}].size {} does not fit in memory",
                    d.size
                ));
            }
            bytes = bytes.checked_add(d.size).ok_or_else(|| {
                crate::error::invalid!("job {job_id}: the descriptor sizes overflow 64 bits")
            })?;
        }
        let _current = self.enter()?;
        let start = self.take_event()?;
        let end = match self.take_event() {
            Ok(e) => e,
            Err(e) => {
                self.event_pool.push(start);
                return Err(e);
            }
        };
        match self.enqueue(dir, descs, compute_stream, start, end) {
            Ok(()) => {
                self.fifos[index(dir)].push_back(InFlight {
                    job_id,
                    start,
                    end,
                    bytes,
                });
                Ok(())
            }
            Err(e) => {
                // Copies issued before the failure may still run: let them finish so that nothing
                // writes into memory the caller reuses after this failed job.
                // SAFETY: the stream is this backend's.
                let _ = unsafe { (self.api.stream_synchronize)(self.streams[index(dir)]) };
                self.event_pool.push(start);
                self.event_pool.push(end);
                Err(e)
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        if self.fifos.iter().all(VecDeque::is_empty) {
            return Ok(());
        }
        let _current = self.enter()?;
        for dir in DIRECTIONS {
            let d = index(dir);
            while let Some(head) = self.fifos[d].front() {
                let state = self.query(head.end);
                if matches!(state, Ok(false)) {
                    break;
                }
                let Some(job) = self.fifos[d].pop_front() else {
                    break;
                };
                match state {
                    Ok(_) => {
                        out.push(Completion {
                            job_id: job.job_id,
                            success: true,
                            bytes: job.bytes,
                            seconds: self.elapsed(job.start, job.end),
                            error: None,
                        });
                        self.event_pool.push(job.start);
                        self.event_pool.push(job.end);
                    }
                    Err(e) => {
                        out.push(Completion {
                            job_id: job.job_id,
                            success: false,
                            bytes: job.bytes,
                            seconds: 0.0,
                            error: Some(e.to_string()),
                        });
                        // The events' state is unknown: do not reuse them.
                        self.destroy_event(job.start);
                        self.destroy_event(job.end);
                    }
                }
            }
        }
        Ok(())
    }

    fn wait(&mut self, job_ids: &[u64], timeout: Duration) -> Result<()> {
        // Stream order: a direction's last listed job finishing implies the earlier ones did.
        let mut targets: Vec<(u64, sys::CUevent)> = self
            .fifos
            .iter()
            .filter_map(|fifo| fifo.iter().rev().find(|j| job_ids.contains(&j.job_id)))
            .map(|j| (j.job_id, j.end))
            .collect();
        if targets.is_empty() {
            return Ok(());
        }
        let _current = self.enter()?;
        let started = Instant::now();
        let mut rounds: u32 = 0;
        loop {
            // Finished or failed (poll reports the failure): no longer waited for.
            targets.retain(|&(_, end)| matches!(self.query(end), Ok(false)));
            if targets.is_empty() {
                return Ok(());
            }
            let waited = started.elapsed();
            if waited >= timeout {
                let ids: Vec<u64> = targets.iter().map(|t| t.0).collect();
                return Err(Error::Timeout(format!(
                    "wait: jobs {ids:?} (and the jobs queued before them) still running after {waited:?} (timeout {timeout:?})"
                )));
            }
            rounds = rounds.saturating_add(1);
            if rounds < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep((timeout - waited).min(Duration::from_micros(50)));
            }
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.ctx.is_null() {
            return;
        }
        let api = self.api;
        let current = CurrentCtx::enter(api, self.ctx);
        if current.is_ok() {
            for &stream in &self.streams {
                if !stream.is_null() {
                    // SAFETY: the stream is this backend's; waits for its queued copies.
                    let _ = unsafe { (api.stream_synchronize)(stream) };
                }
            }
            for (_, pieces) in std::mem::take(&mut self.registered) {
                for ptr in pieces {
                    // SAFETY: registered by this backend and not unregistered since.
                    let _ = unsafe { (api.host_unregister)(ptr as *mut c_void) };
                }
            }
            let mut events = std::mem::take(&mut self.event_pool);
            for fifo in &mut self.fifos {
                for job in fifo.drain(..) {
                    events.push(job.start);
                    events.push(job.end);
                }
            }
            events.push(std::mem::replace(
                &mut self.compute_done,
                std::ptr::null_mut(),
            ));
            for event in events {
                self.destroy_event(event);
            }
            for stream in &mut self.streams {
                if !stream.is_null() {
                    // SAFETY: the stream is this backend's, idle, and destroyed once.
                    let _ = unsafe { (api.stream_destroy)(*stream) };
                    *stream = std::ptr::null_mut();
                }
            }
        }
        drop(current);
        // SAFETY: balances the retain in `new`.
        let _ = unsafe { (api.primary_ctx_release)(self.device) };
        self.ctx = std::ptr::null_mut();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<CudaBackend>();
    }

    #[test]
    fn no_panic_whatever_the_machine() {
        // Without a driver both answer "unavailable"; with one, they agree.
        let available = cuda_available();
        match CudaBackend::new(0) {
            Ok(_) => assert!(available),
            Err(Error::CudaUnavailable(_)) => assert!(!available),
            Err(e) => panic!("unexpected error: {e}"),
        }
        assert!(matches!(
            CudaBackend::new(-1),
            Err(Error::CudaUnavailable(_) | Error::InvalidArgument(_))
        ));
    }
}

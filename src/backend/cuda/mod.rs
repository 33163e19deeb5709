//! The `cuda` device (feature `cuda`): a [`Runtime`] of the GPU host layer
//! on the NVIDIA driver. The kernel sources of `src/backend/kernels/` are
//! compiled at run time by NVRTC for the GPU's own architecture (so the
//! PTX loads on the driver present), GEMMs go to cuBLAS in the column-major
//! convention CLBlast is tested with, and everything is queued in order on
//! one stream; memory is allocated and freed in stream order.
//!
//! The driver, NVRTC and cuBLAS are opened at run time (cudarc's
//! `dynamic-loading`), found on the loader's path, under CUDA's install
//! folders or in pip's `nvidia-*-cu12` wheels (`libs`). cudarc panics on a
//! library it cannot open, so every entry checks the libraries first and
//! errors naming what to install.

mod libs;
mod lt;

use crate::backend::gpu::{
    converted, kernel_names, out_of_range, program_source, u32_arg, Arg, DeviceMem, Gemm, GpuError,
    Operand, Runtime, View, Waiter, BLOCK,
};
use crate::backend::Elem;
use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasOperation_t, cudaDataType,
};
use cudarc::driver::{result as drv, CudaContext, CudaFunction, CudaStream, DriverError};
use cudarc::driver::{sys::CUdeviceptr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use std::collections::HashMap;
use std::ffi::{c_int, c_longlong, c_void};
use std::sync::{Arc, Mutex};

/// The cuda backend.
pub type Cuda = crate::backend::gpu::Gpu<CudaRuntime>;

/// A failed driver call, in words, for `map_err`.
fn failed(what: &'static str) -> impl Fn(DriverError) -> GpuError {
    move |e| GpuError(format!("CUDA {what} failed: {e}"))
}

type Result<T> = std::result::Result<T, GpuError>;

/// Errors unless the driver library opens.
fn check_driver() -> Result<()> {
    libs::preload();
    // SAFETY: only tries to dlopen the library; calls nothing in it.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError(
            "no CUDA driver (libcuda.so.1) found: install the NVIDIA driver".into(),
        ))
    }
}

/// Errors unless library `name` opens (`present`: cudarc's
/// `is_culib_present`, which only tries to dlopen it): else says how to
/// install it (or its `pip` wheel), and where CUDA 13's copy would serve.
fn check_present(present: unsafe fn() -> bool, name: &str, wheel: &str) -> Result<()> {
    // SAFETY: as in `check_driver`.
    if unsafe { present() } {
        return Ok(());
    }
    let (version, install, hint) = match name {
        "nccl" => (2, "NCCL", String::new()),
        _ => (
            12,
            "the CUDA toolkit",
            libs::cuda13_hint(&libs::search_dirs(), name),
        ),
    };
    Err(GpuError(format!(
        "lib{name}.so.{version} not found: install {install}, or `pip install \
         nvidia-{wheel}-cu12` (in the active environment, or put its nvidia/{}/lib on \
         LD_LIBRARY_PATH){hint}",
        wheel.replace('-', "_")
    )))
}

/// Errors unless the driver, NVRTC and cuBLAS libraries all open.
fn check_libraries() -> Result<()> {
    use cudarc::{cublas, cublaslt, nvrtc};
    check_driver()?;
    check_present(nvrtc::sys::is_culib_present, "nvrtc", "cuda-nvrtc")?;
    check_present(cublas::sys::is_culib_present, "cublas", "cublas")?;
    check_present(cublaslt::sys::is_culib_present, "cublasLt", "cublas")
}

/// The CUDA libraries' files this process loaded, having opened every one
/// it can (the driver, NVRTC, cuBLAS, NCCL): what `distgpt devices` prints,
/// so a machine's log says which copies ran.
pub fn loaded_libraries() -> Vec<std::path::PathBuf> {
    // The checks' `is_culib_present` opens a library and closes it again, so
    // each one found is opened as the backend opens it for work (cudarc's
    // `culib`, which keeps it); which was not found is said where it matters.
    // SAFETY: each `culib` runs only after its library was found (it panics
    // where none is); opening runs only the libraries' initialisers.
    if check_libraries().is_ok() {
        unsafe {
            cudarc::nvrtc::sys::culib();
            cudarc::cublas::sys::culib();
        }
    }
    if check_nccl().is_ok() {
        unsafe {
            cudarc::nccl::sys::culib();
        }
    }
    libs::loaded()
}

/// How many GPUs the driver reports (no context is made).
fn device_count() -> Result<usize> {
    check_driver()?;
    let count = CudaContext::device_count().map_err(failed("cuDeviceGetCount"))?;
    Ok(count.max(0) as usize)
}

/// Errors unless the driver and NCCL libraries open (for `comm::nccl`).
pub(crate) fn check_nccl() -> Result<()> {
    check_driver()?;
    check_present(cudarc::nccl::sys::is_culib_present, "nccl", "nccl")
}

/// Opens GPU `index` and says its name, compute capability and the driver's
/// free/total memory.
fn describe(index: usize) -> Result<String> {
    let ctx = CudaContext::new(index).map_err(failed("cuDevicePrimaryCtxRetain"))?;
    let name = ctx.name().map_err(failed("cuDeviceGetName"))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(failed("cuDeviceGetAttribute"))?;
    let (free, total) = ctx.mem_get_info().map_err(failed("cuMemGetInfo"))?;
    Ok(format!(
        "{name} (sm_{major}{minor}, {} of {} MiB free)",
        free >> 20,
        total >> 20
    ))
}

/// Errors unless every library the backend needs is found and GPU `index`
/// exists; names the GPUs there are when it does not.
fn check_gpu(index: usize) -> Result<()> {
    check_libraries()?;
    // Only the GPU asked for gets a context: in exclusive-process mode
    // another rank may hold the others.
    if index >= device_count()? {
        return Err(out_of_range("CUDA", index, &CudaRuntime::list()?));
    }
    Ok(())
}

/// `len` elements of device memory, allocated and freed in the order of the
/// runtime's stream (so a free waits for the kernels queued before it).
pub struct Mem<T: Elem> {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    _elem: std::marker::PhantomData<T>,
}

impl<T: Elem> DeviceMem for Mem<T> {
    fn handle(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl<T: Elem> Drop for Mem<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // A failure here has nowhere to go; the next call on the stream reports it.
        if self.stream.context().bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `malloc_async` on this stream and is freed once.
            let _ = unsafe { drv::free_async(self.ptr, self.stream.cu_stream()) };
        }
    }
}

/// Host memory page-locked by `pin`, unlocked on drop.
struct Registered {
    ptr: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        // A failure here has nowhere to go: the memory is freed next either way.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered once by `pin`, unregistered once.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut c_void) };
        }
    }
}

/// The cuBLAS handle; calls on it are serialised.
struct Blas(cublasHandle_t);

// SAFETY: the handle is only used under the runtime's mutex.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle`, destroyed once.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// An NVIDIA GPU with the model's kernels built for it.
pub struct CudaRuntime {
    // Fields drop in order: functions and the handle before the stream and context.
    kernels: HashMap<String, CudaFunction>,
    blas: Mutex<Blas>,
    /// GEMMs with a bias, unless `DISTGPT_CUBLASLT=0`: `Runtime::adds_bias`.
    lt: Option<Mutex<lt::Lt>>,
    /// The bf16 copies of a GEMM's two operands under `--precision bf16`,
    /// kept for the next GEMM (`to_bf16`).
    bf16_scratch: Mutex<[Option<Mem<u32>>; 3]>,
    stream: Arc<CudaStream>,
    /// Where `read_start` copies, beside `stream`.
    copier: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    name: String,
    /// Compute capability 8.0 on (bf16 mma.sync), unless `flash_allowed`
    /// says no: `Runtime::tensor_cores`.
    mma: bool,
}

/// cuBLAS's operation for a stored matrix used as is or transposed.
fn blas_op(transpose: bool) -> cublasOperation_t {
    if transpose {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// A size as cuBLAS's int.
fn blas_int(what: &str, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| GpuError(format!("GEMM {what} = {n} exceeds cuBLAS's int")))
}

impl CudaRuntime {
    /// `g` as one strided-batched GEMM (cublasGemmStridedBatchedEx), fp32
    /// accumulation and output (bf16 output where `g.c_bf16`). Under
    /// `g.bf16` on the tensor cores: an operand stored in bf16 as it is,
    /// an fp32 one rounded to bf16 on the way (the `to_bf16` kernel); else in fp32
    /// (no TF32: cuBLAS's default math mode).
    ///
    /// # Safety
    /// As `Runtime::sgemm`.
    unsafe fn gemm_ex(&self, g: Gemm) -> Result<()> {
        let [a_span, b_span] = g.spans()?;
        // Held until the GEMM is queued: another thread's GEMM would
        // rewrite the operands before this one reads them.
        let mut scratch = self.bf16_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (f32_, bf16) = (cudaDataType::CUDA_R_32F, cudaDataType::CUDA_R_16BF);
        // `view`'s first n elements rounded to bf16, two per 32-bit word (so
        // the same leading dimension), into scratch `slot`: the copy's address
        let mut round = |view: View, n: usize, slot: usize| -> Result<CUdeviceptr> {
            // SAFETY: `Gemm::spans` checked an operand's n elements lie in its
            // view, `Queue::gemm` the bias's m.
            let held = scratch[slot].take();
            let copy = unsafe { converted(self, "to_bf16", (view, n), n.div_ceil(2), held)? };
            Ok(scratch[slot].insert(copy).ptr)
        };
        let mut operand = |op: Operand, span, slot| match Self::operand_addr(op, g.bf16) {
            Some(ptr) => Ok(ptr),
            None => round(op.view, span, slot),
        };
        let (a, b) = (operand(g.a, a_span, 0)?, operand(g.b, b_span, 1)?);
        let kind = if g.bf16 { bf16 } else { f32_ };
        let (c, c_kind) = (Self::c_addr(&g), if g.c_bf16 { bf16 } else { f32_ });
        if let Some(bias) = g.bias {
            // a bf16 output's epilogue takes a bf16 bias: rounded here
            let bias = match g.c_bf16 {
                true => round(bias, g.m, 2)?,
                false => Self::addr::<f32>(bias),
            };
            // SAFETY: as above; `Queue::gemm` checked the bias's m floats
            // and the residual's m x n.
            return unsafe { self.gemm_lt(&g, Self::lt_addrs(&g, [a, b]), bias) };
        }
        let (alpha, beta) = (1.0f32, g.beta);
        let stride = |what: &str, n: usize| {
            c_longlong::try_from(n)
                .map_err(|_| GpuError(format!("GEMM {what} = {n} exceeds cuBLAS's range")))
        };
        self.bind()?;
        let handle = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: `a` and `b` hold the operands (rounded copies with the
        // same leading dimensions and strides under bf16), `c` the fp32
        // outputs the caller checked; alpha and beta are host scalars read
        // during the call; the buffers are rewritten or freed only in
        // stream order after it.
        unsafe {
            blas::gemm_strided_batched_ex(
                handle.0,
                blas_op(g.a.transpose),
                blas_op(g.b.transpose),
                blas_int("m", g.m)?,
                blas_int("n", g.n)?,
                blas_int("k", g.k)?,
                (&alpha as *const f32).cast(),
                a as *const c_void,
                kind,
                blas_int("lda", g.a.ld)?,
                stride("a's stride", g.batch.a)?,
                b as *const c_void,
                kind,
                blas_int("ldb", g.b.ld)?,
                stride("b's stride", g.batch.b)?,
                (&beta as *const f32).cast(),
                c as *mut c_void,
                c_kind,
                blas_int("ldc", g.ldc)?,
                stride("c's stride", g.batch.c)?,
                blas_int("batch", g.batch.count)?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| {
            GpuError(format!(
                "cublasGemmStridedBatchedEx {} (m={}, n={}, k={}, batch {}) failed: {e}",
                if g.bf16 { "bf16" } else { "fp32" },
                g.m,
                g.n,
                g.k,
                g.batch.count
            ))
        })
    }

    /// `g` with its bias in cuBLASLt's epilogue, from the operands' and
    /// the output's addresses `at` (a, b rounded to bf16 under `g.bf16`;
    /// C, what the products go onto with beta 1, and D, the output).
    ///
    /// # Safety
    /// As `gemm_ex`; `g` passed `adds_bias`.
    unsafe fn gemm_lt(&self, g: &Gemm, at: [CUdeviceptr; 4], bias: CUdeviceptr) -> Result<()> {
        let Some(lt) = &self.lt else {
            return Err(GpuError(
                "a GEMM's bias reached cuBLAS with cuBLASLt off".into(),
            ));
        };
        let mut lt = lt.lock().unwrap_or_else(|e| e.into_inner());
        if lt.workspace.is_none() {
            lt.workspace = Some(self.alloc::<u32>(lt::WORKSPACE_BYTES / 4)?);
        }
        let key = Self::plan_key(g)?;
        let held = at.map(lt::alignment);
        if held.iter().zip(key.align).any(|(&h, a)| h < a) {
            return Err(GpuError(format!(
                "a GEMM's a, b, c and d lie {held:?}-byte aligned, less than its cuBLASLt plan \
                 ({:?}) was made for (DISTGPT_CUBLASLT=0 adds its bias in a pass instead)",
                key.align
            )));
        }
        let [a, b, c, d] = at;
        let beta = match g.residual {
            Some(_) => 1.0,
            None => g.beta,
        };
        self.bind()?;
        let stream = self.stream.cu_stream() as _;
        // SAFETY: the caller's promises; the key's alignments are the addresses'.
        unsafe { lt.matmul(key, lt::Addresses { a, b, c, d, bias }, beta, stream) }
    }

    /// `g`'s plan for cuBLASLt, the same for `adds_bias`, which asks for it,
    /// and `gemm_lt`, which runs it: the alignments of a, b, c and d, where
    /// an operand rounded to bf16 lies at the start of a scratch allocation
    /// (address 0 stands for it: 256-byte aligned, as CUDA's allocations are).
    fn plan_key(g: &Gemm) -> Result<lt::PlanKey> {
        let ab = [g.a, g.b].map(|op| Self::operand_addr(op, g.bf16).unwrap_or(0));
        let at = Self::lt_addrs(g, ab);
        let ld = |what, n: usize| {
            i64::try_from(n).map_err(|_| GpuError(format!("GEMM {what} = {n} exceeds cuBLASLt's")))
        };
        Ok(lt::PlanKey {
            m: g.m as u64,
            n: g.n as u64,
            k: g.k as u64,
            transpose: [g.a.transpose, g.b.transpose],
            ld: [ld("lda", g.a.ld)?, ld("ldb", g.b.ld)?, ld("ldc", g.ldc)?],
            bf16: g.bf16,
            c_bf16: g.c_bf16,
            align: at.map(lt::alignment),
        })
    }

    /// An operand's address as the GEMM reads it, or None where it is
    /// rounded to bf16 first (into scratch: a whole allocation, 256-byte
    /// aligned).
    fn operand_addr(op: Operand, bf16: bool) -> Option<CUdeviceptr> {
        match (op.bf16, bf16) {
            (true, _) => Some(Self::addr::<u16>(op.view)),
            (false, true) => None,
            (false, false) => Some(Self::addr::<f32>(op.view)),
        }
    }

    /// The output's address, in its type.
    fn c_addr(g: &Gemm) -> CUdeviceptr {
        match g.c_bf16 {
            true => Self::addr::<u16>(g.c),
            false => Self::addr::<f32>(g.c),
        }
    }

    /// cuBLASLt's a, b, C (what the products go onto: the residual where
    /// there is one, else the output) and D (the output), from a and b.
    fn lt_addrs(g: &Gemm, [a, b]: [CUdeviceptr; 2]) -> [CUdeviceptr; 4] {
        let d = Self::c_addr(g);
        [a, b, g.residual.map_or(d, Self::addr::<f32>), d]
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(failed("cuCtxSetCurrent"))
    }

    /// The device address of element 0 of `v`, for `T`.
    fn addr<T>(v: View) -> CUdeviceptr {
        v.mem + (v.off * size_of::<T>()) as u64
    }
}

/// Whether to build the CUDA-only fast paths (`DISTGPT_CUDA_FAST=1`):
/// reductions through warp shuffles, with no OpenCL twin. Off by default:
/// the portable path is the one the OpenCL tests check.
fn fast_paths() -> bool {
    std::env::var("DISTGPT_CUDA_FAST").as_deref() == Ok("1")
}

/// Whether bf16 attention may take the tensor cores' kernels (flash.cu):
/// yes unless `DISTGPT_ATTENTION=gemm` asks for the batched GEMMs every
/// GPU can run (to compare the two, or to step around flash.cu).
fn flash_allowed() -> Result<bool> {
    switch(
        "DISTGPT_ATTENTION",
        ["flash", "gemm"],
        "the GPU's attention is \"flash\" (the default) or \"gemm\"",
    )
}

/// Whether the environment's switch `var` is on: unset or `on` yes, `off`
/// no, any other value an error followed by `choices` (what each means).
fn switch(var: &str, [on, off]: [&str; 2], choices: &str) -> Result<bool> {
    match std::env::var(var).as_deref() {
        Err(_) => Ok(true),
        Ok(v) if v == on => Ok(true),
        Ok(v) if v == off => Ok(false),
        Ok(other) => Err(GpuError(format!("{var}={other:?}: {choices}"))),
    }
}

/// The PTX of every kernel for compute capability `major.minor`, with the
/// CUDA-only fast paths when `fast`.
fn compile(major: i32, minor: i32, fast: bool) -> Result<cudarc::nvrtc::Ptx> {
    let mut options = vec![format!("--gpu-architecture=compute_{major}{minor}")];
    if fast {
        options.push("-DDISTGPT_CUDA_FAST".into());
    }
    let opts = CompileOptions {
        options,
        ..Default::default()
    };
    compile_ptx_with_opts(program_source(), opts).map_err(|e| {
        GpuError(format!(
            "NVRTC could not compile the kernels for sm_{major}{minor}: {e}"
        ))
    })
}

impl Runtime for CudaRuntime {
    type Mem<T: Elem> = Mem<T>;
    const KIND: &'static str = "cuda";
    const ADDRESSED: bool = true;

    /// Without making a context on each GPU.
    fn count() -> Result<usize> {
        device_count()
    }

    /// One line per GPU: name, compute capability, free/total memory.
    fn list() -> Result<Vec<String>> {
        (0..device_count()?).map(describe).collect()
    }

    fn open(index: usize) -> Result<Self> {
        let flash = flash_allowed()?;
        check_gpu(index)?;
        let mut name = describe(index)?;
        if fast_paths() {
            name.push_str(", CUDA fast paths");
        }
        if !flash {
            name.push_str(", attention as GEMMs");
        }
        let with_lt = lt::wanted()?;
        if !with_lt {
            name.push_str(", biases in a pass");
        }
        let ctx = CudaContext::new(index).map_err(failed("cuDevicePrimaryCtxRetain"))?;
        if !ctx.has_async_alloc() {
            return Err(GpuError(format!(
                "{name} has no stream-ordered allocator (cuMemAllocAsync): \
                 the cuda backend needs CUDA 11.2+ and a driver that supports it"
            )));
        }
        let (major, minor) = ctx
            .compute_capability()
            .map_err(failed("cuDeviceGetAttribute"))?;
        let module = ctx
            .load_module(compile(major, minor, fast_paths())?)
            .map_err(|e| match failed("cuModuleLoadData")(e) {
                GpuError(m) if m.contains("UNSUPPORTED_PTX_VERSION") => GpuError(format!(
                    "{m}: the driver is older than the NVRTC that compiled the kernels; update the driver, or put its CUDA version's NVRTC first"
                )),
                other => other,
            })?;
        let mut kernels = HashMap::new();
        for k in kernel_names(program_source()) {
            let f = module
                .load_function(k)
                .map_err(failed("cuModuleGetFunction"))?;
            kernels.insert(k.to_string(), f);
        }
        let stream = ctx.new_stream().map_err(failed("cuStreamCreate"))?;
        let copier = stream.fork().map_err(failed("cuStreamCreate"))?;
        let handle =
            blas::create_handle().map_err(|e| GpuError(format!("cublasCreate failed: {e}")))?;
        let blas = Blas(handle);
        // SAFETY: both handles are live; cuBLAS queues on our stream from now on.
        unsafe { blas::set_stream(blas.0, stream.cu_stream() as _) }
            .map_err(|e| GpuError(format!("cublasSetStream failed: {e}")))?;
        let lt = match with_lt {
            true => Some(Mutex::new(lt::Lt::new()?)),
            false => None,
        };
        Ok(CudaRuntime {
            kernels,
            blas: Mutex::new(blas),
            lt,
            bf16_scratch: Mutex::new([None, None, None]),
            stream,
            copier,
            ctx,
            name,
            mma: major >= 8 && flash,
        })
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn tensor_cores(&self) -> bool {
        self.mma
    }

    fn alloc<T: Elem>(&self, len: usize) -> Result<Mem<T>> {
        self.bind()?;
        let bytes = len * size_of::<T>();
        let mut mem = Mem {
            ptr: 0,
            len,
            stream: self.stream.clone(),
            _elem: std::marker::PhantomData,
        };
        if bytes == 0 {
            return Ok(mem);
        }
        let s = self.stream.cu_stream();
        // SAFETY: a fresh allocation on our stream, zeroed before any use.
        mem.ptr = unsafe { drv::malloc_async(s, bytes) }.map_err(|e| {
            let (free, total) = self.ctx.mem_get_info().unwrap_or((0, 0));
            GpuError(format!(
                "allocating {bytes} bytes failed ({e}); the driver reports {} of {} MiB free",
                free >> 20,
                total >> 20
            ))
        })?;
        // SAFETY: the whole allocation just made.
        unsafe { drv::memset_d8_async(mem.ptr, 0, bytes, s) }.map_err(failed("cuMemsetD8Async"))?;
        Ok(mem)
    }

    unsafe fn write<T: Elem>(&self, dst: View, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the view was checked against its buffer and `src` has its
        // length; the stream is synchronised before `src` can go away.
        unsafe { drv::memcpy_htod_async(Self::addr::<T>(dst), src, self.stream.cu_stream()) }
            .map_err(failed("cuMemcpyHtoDAsync"))?;
        self.stream
            .synchronize()
            .map_err(failed("cuStreamSynchronize"))
    }

    unsafe fn read<T: Elem>(&self, src: View, dst: &mut [T]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: as in `write`.
        unsafe { drv::memcpy_dtoh_async(dst, Self::addr::<T>(src), self.stream.cu_stream()) }
            .map_err(failed("cuMemcpyDtoHAsync"))?;
        self.stream
            .synchronize()
            .map_err(failed("cuStreamSynchronize"))
    }

    unsafe fn read_start(&self, src: View, dst: &mut [f32]) -> Result<Waiter> {
        if dst.is_empty() {
            return Ok(Box::new(|| Ok(())));
        }
        self.bind()?;
        self.copier
            .join(&self.stream)
            .map_err(failed("cuStreamWaitEvent"))?;
        // SAFETY: the view as in `read`; `dst` is pinned and outlives the
        // copy per the caller's contract, and the waiter holds its event.
        unsafe { drv::memcpy_dtoh_async(dst, Self::addr::<f32>(src), self.copier.cu_stream()) }
            .map_err(failed("cuMemcpyDtoHAsync"))?;
        let done = match self.copier.record_event(None) {
            Ok(done) => done,
            Err(e) => {
                // the copy is queued: it must land before `dst` is given back
                let _ = self.copier.synchronize();
                return Err(failed("cuEventRecord")(e));
            }
        };
        Ok(Box::new(move || {
            done.synchronize().map_err(failed("cuEventSynchronize"))
        }))
    }

    unsafe fn pin(&self, host: &mut [f32]) -> Result<Option<Box<dyn Send + Sync>>> {
        if host.is_empty() {
            return Ok(None);
        }
        self.bind()?;
        let ptr = host.as_mut_ptr().cast::<c_void>();
        // SAFETY: `host` is live host memory, unregistered by `Registered`
        // before the caller frees it.
        unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr, size_of_val(host), 0) }
            .result()
            .map_err(failed("cuMemHostRegister"))?;
        Ok(Some(Box::new(Registered {
            ptr: ptr as usize,
            ctx: self.ctx.clone(),
        })))
    }

    fn finish(&self) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(failed("cuStreamSynchronize"))
    }

    unsafe fn launch(&self, name: &str, groups: usize, args: &[Arg]) -> Result<()> {
        let f = self
            .kernels
            .get(name)
            .ok_or_else(|| GpuError(format!("no kernel {name} in the program")))?;
        // Values first, so the pointers the builder keeps stay valid until launch.
        let mut words = Vec::with_capacity(args.len() + 4);
        for a in args {
            match *a {
                Arg::View(v) => {
                    words.push(Word::Ptr(v.mem));
                    words.push(Word::U32(u32_arg("view offset", v.off)?));
                }
                Arg::U32(x) => words.push(Word::U32(x)),
                Arg::F32(x) => words.push(Word::F32(x)),
            }
        }
        let mut b = self.stream.launch_builder(f);
        for w in &words {
            match w {
                Word::Ptr(p) => b.arg(p),
                Word::U32(x) => b.arg(x),
                Word::F32(x) => b.arg(x),
            };
        }
        let grid = u32::try_from(groups)
            .map_err(|_| GpuError(format!("{name}: {groups} workgroups exceed the grid")))?;
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (BLOCK as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's parameters in kernels/*.cu
        // (a pointer and an unsigned offset per view, unsigned, float), and
        // every view was checked against the sizes the kernel touches.
        unsafe { b.launch(cfg) }
            .map(drop)
            .map_err(|e| GpuError(format!("launching {name} failed: {e}")))
    }

    fn memory_info(&self) -> Option<(u64, u64)> {
        self.bind().ok()?;
        let (free, total) = self.ctx.mem_get_info().ok()?;
        Some((free as u64, total as u64))
    }

    /// A single product whose fp32 bias is 16-byte aligned (a bf16
    /// output's is rounded into an aligned scratch), where cuBLASLt is on
    /// and has an algorithm for the GEMM as `gemm_ex` will pass it (its
    /// plan made here the first time, or where it has none, said once and
    /// left to the bias pass).
    fn adds_bias(&self, g: &Gemm) -> bool {
        let aligned = g
            .bias
            .is_some_and(|b| g.c_bf16 || Self::addr::<f32>(b) % 16 == 0);
        let Some(lt) = self.lt.as_ref().filter(|_| aligned && g.batch.count == 1) else {
            return false;
        };
        let Ok(key) = Self::plan_key(g) else {
            return false;
        };
        let mut lt = lt.lock().unwrap_or_else(|e| e.into_inner());
        self.bind().is_ok() && lt.takes(key)
    }

    unsafe fn sgemm(&self, g: Gemm) -> Result<()> {
        // SAFETY: as this function's.
        unsafe { self.gemm_ex(g) }
    }
}

/// One kernel parameter's value, owned until the launch.
enum Word {
    Ptr(CUdeviceptr),
    U32(u32),
    F32(f32),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compile `open` does, for an H100 (sm_90), without a GPU: needs
    /// only NVRTC, found as `open` finds it (CI points VIRTUAL_ENV at the
    /// venv holding the PyPI wheel and sets DISTGPT_REQUIRE_NVRTC=1;
    /// elsewhere a missing NVRTC skips).
    #[test]
    fn nvrtc_compiles_every_kernel_for_the_gpu_at_run_time() {
        libs::preload();
        // SAFETY: only tries to dlopen the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert_ne!(
                std::env::var("DISTGPT_REQUIRE_NVRTC").as_deref(),
                Ok("1"),
                "DISTGPT_REQUIRE_NVRTC=1 but libnvrtc.so.12 is nowhere: not on the loader's path, in CUDA_HOME or in a pip wheel"
            );
            eprintln!("skipping: no libnvrtc.so.12");
            return;
        }
        let mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32";
        let mut shuffles = Vec::new();
        for fast in [false, true] {
            let ptx = compile(9, 0, fast).unwrap().to_src();
            assert!(
                ptx.contains(".target sm_90"),
                "{}",
                &ptx[..ptx.len().min(400)]
            );
            for k in kernel_names(program_source()) {
                assert!(
                    ptx.contains(&format!(".entry {k}(")),
                    "no entry {k} in the PTX"
                );
            }
            assert!(ptx.contains(mma), "flash.cu's tensor-core products");
            shuffles.push(ptx.matches("shfl.sync").count());
        }
        // The switch reaches the source: the fast path's reductions add
        // shuffles to flash.cu's quad reductions.
        assert!(shuffles[1] > shuffles[0], "shuffles {shuffles:?}");
        // Before sm_80 (no bf16 mma) the program still builds, without it;
        // the runtime runs attention there as GEMMs (`tensor_cores`).
        let turing = compile(7, 5, false).unwrap().to_src();
        assert!(turing.contains(".target sm_75") && !turing.contains(mma));
        let err = compile(1, 0, false).unwrap_err().to_string();
        assert!(
            err.contains("NVRTC could not compile the kernels for sm_10"),
            "{err}"
        );
    }

    /// `adds_bias` asks for the plan `gemm_lt` runs: an operand rounded to
    /// bf16 keys as its scratch's 256 bytes, whatever its fp32 view's
    /// address; one stored in bf16, and C and D, as their own addresses.
    #[test]
    fn a_gemms_plan_keys_a_rounded_operand_by_its_scratch() {
        let view = |mem, off| View {
            mem,
            off,
            len: 1 << 20,
        };
        let operand = |view, bf16| Operand {
            view,
            transpose: false,
            ld: 64,
            bf16,
        };
        let gemm = |a_bf16, bf16| Gemm {
            residual: Some(view(0x8000, 4)),
            ..Gemm::new(
                [64; 3],
                [
                    operand(view(0x1000, 1), a_bf16),
                    operand(view(0x2000, 3), false),
                ],
                view(0x4000, 2),
                64,
                bf16,
            )
        };
        // a stored in bf16 at 0x1002, b rounded, C the residual at 0x8010,
        // D the output at 0x4008
        let key = CudaRuntime::plan_key(&gemm(true, true)).unwrap();
        assert_eq!(key.align, [2, 256, 16, 8]);
        // in fp32 nothing is rounded: b reads its own view at 0x200c
        let key = CudaRuntime::plan_key(&gemm(false, false)).unwrap();
        assert_eq!(key.align, [4, 4, 16, 8]);
    }
}

//! The host side every GPU-style device shares: buffers addressed through
//! element views, kernel launches on one in-order queue (an OpenCL command
//! queue, a CUDA stream), column-major SGEMM, and the [`Backend`] over them
//! ([`Gpu`]). A device is a [`Runtime`]: `opencl` (OpenCL C through the
//! ICD loader, CLBlast) and, behind the `cuda` feature, `cuda` (NVRTC,
//! cuBLAS). Both build the same kernel sources (`src/backend/kernels/`,
//! one dialect), so what PoCL tests here is what a GPU runs.
//!
//! [`Backend`]: crate::backend::Backend

mod attention;
mod backend;
mod kernels;
#[cfg(test)]
mod tests;

pub use backend::{Gpu, PackedGpu};
pub use kernels::program_source;
pub(crate) use kernels::{
    act_code, groups, operand, stored_operand, stored_view, u32s, weight_operand, ActivationPass,
};

use crate::backend::Elem;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Threads per workgroup of every kernel: the prelude's `BLOCK`.
pub const BLOCK: usize = 256;

/// What went wrong, in words: the missing library or device, the failed
/// call, or the kernel build log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GpuError(pub String);

/// A range of a device buffer, in elements: what every kernel takes, so a
/// caller can pass one tensor of a flat parameter buffer. `mem` is the
/// runtime's handle of the whole buffer (a `cl_mem`, a CUDA device
/// pointer); offsets need no alignment.
#[derive(Clone, Copy, Debug)]
pub struct View {
    pub mem: u64,
    pub off: usize,
    pub len: usize,
}

impl View {
    /// The view from its element `start` on.
    pub fn tail(self, start: usize) -> View {
        self.part(start..self.len)
    }

    /// Elements `range` of the view.
    pub fn part(self, range: std::ops::Range<usize>) -> View {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "elements {range:?} of a view of {}",
            self.len
        );
        View {
            off: self.off + range.start,
            len: range.end - range.start,
            ..self
        }
    }
}

impl crate::backend::ops::Extent for View {
    fn extent(&self) -> usize {
        self.len
    }
}

/// Raw views of a runtime's buffers: the operands `Queue`'s kernels take.
pub struct Raw;

impl crate::backend::ops::Operands for Raw {
    type In<T: Elem> = View;
    type Out<T: Elem> = View;
}

/// A device buffer of some runtime, seen as views.
pub trait DeviceMem {
    /// The runtime's handle of the whole buffer.
    fn handle(&self) -> u64;
    /// Elements it holds.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole buffer.
    fn view(&self) -> View {
        let (mem, len) = (self.handle(), self.len());
        View { mem, off: 0, len }
    }

    /// Elements `range` of the buffer; panics when it does not fit, as slicing does.
    fn view_range(&self, range: Range<usize>) -> View {
        self.view().part(range)
    }
}

/// One kernel argument. A `View` is passed as two arguments, the buffer and
/// its element offset, the convention of every kernel in `kernels/`.
#[derive(Clone, Copy)]
pub enum Arg {
    View(View),
    U32(u32),
    F32(f32),
}

/// One matrix operand, column-major: `transpose` says whether the op uses
/// the stored matrix transposed; `ld` is its leading dimension; `bf16`
/// whether its elements are stored as bfloat16 (read as they are).
#[derive(Clone, Copy)]
pub struct Operand {
    pub view: View,
    pub transpose: bool,
    pub ld: usize,
    pub bf16: bool,
}

/// c (m x n) = op(a) (m x k) @ op(b) (k x n) + beta * c [+ bias], column-major, as
/// CLBlast and cuBLAS take it. Sizes are non-zero when a runtime sees it.
#[derive(Clone, Copy)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Operand,
    pub b: Operand,
    pub beta: f32,
    pub c: View,
    pub ldc: usize,
    /// m fp32 values added to every column of `c` (a row-major output's
    /// bias, one a feature; rounded to bf16 first where `c_bf16`, as a bf16
    /// epilogue takes it) in a single product: by the GEMM's epilogue
    /// where [`Runtime::adds_bias`] says so, else by a pass over `c`
    /// before it (`Queue::gemm`). A runtime sees it only in the first case.
    pub bias: Option<View>,
    /// m x n fp32 values (ld m, one product) the products go onto in place
    /// of `c`'s own (beta 1, c only written): cuBLASLt's C apart from its D,
    /// where [`Runtime::adds_bias`] says so, else a copy into `c` first
    /// (`Queue::gemm`). A runtime sees it only in the first case.
    pub residual: Option<View>,
    /// `c` is stored as bfloat16: each sum rounded as it is stored (beta 0,
    /// or 1 onto the bias's pass).
    pub c_bf16: bool,
    /// The products take `a` and `b` rounded to bfloat16 (ties to even, as
    /// `round_bf16`), accumulated in fp32: cuBLAS rounds them into bf16
    /// copies for its tensor cores, OpenCL into fp32 copies for SGEMM. An
    /// operand or output stored in bf16 needs it.
    pub bf16: bool,
    pub batch: Batch,
}

/// `count` products of one shape, the i-th reading `a` and `b` and writing
/// `c` from element i x their stride on (strided-batched GEMM).
#[derive(Clone, Copy)]
pub struct Batch {
    pub count: usize,
    pub a: usize,
    pub b: usize,
    pub c: usize,
}

impl Batch {
    /// A single product.
    pub const ONE: Batch = Batch::of(1, [0, 0, 0]);

    /// `count` products, the i-th's a, b and c `strides` on from the first's.
    pub const fn of(count: usize, [a, b, c]: [usize; 3]) -> Batch {
        Batch { count, a, b, c }
    }
}

impl Gemm {
    /// One product into an fp32 `c` (ld `ldc`) = op(a) (m x k) @ op(b) (k x
    /// n), `[m, n, k]`, with beta 0, no bias and no residual: what the
    /// other fields change is written as `Gemm { beta: 1.0, ..Gemm::new(..) }`.
    pub fn new(
        [m, n, k]: [usize; 3],
        [a, b]: [Operand; 2],
        c: View,
        ldc: usize,
        bf16: bool,
    ) -> Self {
        Gemm {
            m,
            n,
            k,
            a,
            b,
            beta: 0.0,
            c,
            ldc,
            bias: None,
            residual: None,
            c_bf16: false,
            bf16,
            batch: Batch::ONE,
        }
    }

    /// The elements `c` spans in its view, from element 0 to the last one
    /// the products write.
    pub fn c_span(&self) -> usize {
        (self.batch.count - 1) * self.batch.c + self.ldc * (self.n - 1) + self.m
    }

    /// The elements `a` and `b` span in their views, from element 0 to the
    /// last one the products read (what a bf16 GEMM rounds), each checked
    /// against its view.
    pub fn spans(&self) -> Result<[usize; 2], GpuError> {
        let batches = self.batch.count - 1;
        let span = |what: &str, op: Operand, rows: usize, cols: usize, stride: usize| {
            let n = batches * stride
                + match op.transpose {
                    false => op.ld * (cols - 1) + rows,
                    true => op.ld * (rows - 1) + cols,
                };
            match n <= op.view.len {
                true => Ok(n),
                false => Err(GpuError(format!(
                    "GEMM operand {what}: view of {} elements, the product reads {n}",
                    op.view.len
                ))),
            }
        };
        Ok([
            span("a", self.a, self.m, self.k, self.batch.a)?,
            span("b", self.b, self.k, self.n, self.batch.b)?,
        ])
    }
}

/// What waits for a copy [`Runtime::read_start`] queued.
pub type Waiter = Box<dyn FnOnce() -> Result<(), GpuError> + Send>;

/// A device the kernels run on: memory, transfers, launches and SGEMM, all
/// in order on one queue. Launches and GEMMs are queued; `finish` waits.
///
/// The transfers, launches and GEMMs are `unsafe`: they touch device memory
/// through views and sizes they cannot check against what a kernel reads.
/// `Queue`'s wrappers check every size first.
pub trait Runtime: Send + Sync + Sized + 'static {
    /// `len` elements of device memory, released on drop, and only after
    /// the work queued before the drop has finished with it.
    type Mem<T: Elem>: DeviceMem + Send + Sync;

    /// "opencl" or "cuda": the `--device` name.
    const KIND: &'static str;
    /// Whether a buffer's handle is its device address (CUDA), so views
    /// can go to a device-native collective as pointers.
    const ADDRESSED: bool = false;

    /// Whether the device runs bf16 attention on its tensor cores, the
    /// fused kernels of `kernels/flash.cu` (mma.sync: compute capability
    /// 8.0 on); the others run it as GEMMs.
    fn tensor_cores(&self) -> bool {
        false
    }

    /// Names of this runtime's devices, in the order `open` counts them.
    fn list() -> Result<Vec<String>, GpuError>;
    /// How many devices `open` counts.
    fn count() -> Result<usize, GpuError> {
        Ok(Self::list()?.len())
    }
    /// The device of rank `rank` when ranks take one device each from
    /// `base` on, wrapping around the devices there are (NCCL's rule, for
    /// thread ranks and for a process's local rank alike).
    fn device_of(base: usize, rank: usize) -> Result<usize, GpuError> {
        Ok((base + rank) % Self::count()?.max(1))
    }
    /// Opens device `index` and builds the kernels for it.
    fn open(index: usize) -> Result<Self, GpuError>;
    /// The device's name.
    fn name(&self) -> String;
    /// A zero-filled buffer of `len` elements.
    fn alloc<T: Elem>(&self, len: usize) -> Result<Self::Mem<T>, GpuError>;
    /// dst = src, blocking.
    ///
    /// # Safety
    /// `dst` is a view of a live buffer of this runtime holding `T`s, and
    /// `src.len() == dst.len`.
    unsafe fn write<T: Elem>(&self, dst: View, src: &[T]) -> Result<(), GpuError>;
    /// dst = src, blocking.
    ///
    /// # Safety
    /// As `write`, with `dst.len() == src.len`.
    unsafe fn read<T: Elem>(&self, src: View, dst: &mut [T]) -> Result<(), GpuError>;
    /// Waits until everything queued has finished.
    fn finish(&self) -> Result<(), GpuError>;
    /// Queues dst = src on a copy queue (an OpenCL command queue, a CUDA
    /// stream) of its own, behind everything queued on the compute queue
    /// so far, so that what is queued after it computes while it copies;
    /// the returned waiter returns once it has landed.
    ///
    /// # Safety
    /// As `read`; and until the waiter has run, `dst` stays allocated and
    /// untouched (in memory `pin` pinned where the runtime pins), and
    /// `src`'s buffer stays allocated and unwritten: a buffer freed or
    /// written in the compute queue's order is not ordered after this copy.
    unsafe fn read_start(&self, src: View, dst: &mut [f32]) -> Result<Waiter, GpuError>;
    /// Page-locks `host` for `read_start` where the runtime needs that for
    /// a copy that does not block the host (CUDA); returns what unlocks it
    /// when dropped, or None where nothing is needed.
    ///
    /// # Safety
    /// `host` stays allocated until the returned guard is dropped.
    unsafe fn pin(&self, _host: &mut [f32]) -> Result<Option<Box<dyn Send + Sync>>, GpuError> {
        Ok(None)
    }

    /// Queues kernel `name` on `groups` workgroups of BLOCK threads.
    ///
    /// # Safety
    /// `args` have the types of the kernel's parameters, and every view
    /// (of a live buffer of this runtime) holds all the elements the kernel
    /// touches at those sizes.
    unsafe fn launch(&self, name: &str, groups: usize, args: &[Arg]) -> Result<(), GpuError>;
    /// Whether `sgemm` adds `g`'s bias itself, in the GEMM's epilogue
    /// (cuBLASLt's), and takes its residual as the GEMM's C; else the
    /// queue copies the residual into `c` and adds the bias to it first.
    fn adds_bias(&self, _g: &Gemm) -> bool {
        false
    }
    /// Queues `g`.
    ///
    /// # Safety
    /// Every operand is a view of a live buffer of this runtime holding the
    /// matrix its sizes and leading dimension describe.
    unsafe fn sgemm(&self, g: Gemm) -> Result<(), GpuError>;
    /// The driver's free and total bytes of the device, where it says.
    fn memory_info(&self) -> Option<(u64, u64)> {
        None
    }
}

/// A device's in-order queue with the model's kernels: the runtime plus the
/// kernel wrappers of `kernels.rs` and `attention.rs`, which check shapes
/// and launch, and the launches of the [`Kernel`](crate::backend::ops::Kernel)s
/// in `ops/`, run after their check. Public only as the type
/// `Kernel::gpu` names: no one outside the crate can open one.
pub struct Queue<R: Runtime> {
    rt: R,
    /// Kernels' scratch buffers ([`Queue::with_scratch`]), kept between calls.
    scratch: Mutex<Vec<R::Mem<f32>>>,
    /// Buffers allocated through [`Queue::alloc`] so far.
    allocations: AtomicU64,
}

impl<R: Runtime> Queue<R> {
    /// Opens device `index` of runtime `R`. Only the crate opens one (a
    /// [`Gpu`] holds it): its methods take raw views, which code outside
    /// could make point anywhere.
    pub(crate) fn open(index: usize) -> Result<Self, GpuError> {
        Ok(Queue {
            rt: R::open(index)?,
            scratch: Mutex::default(),
            allocations: AtomicU64::new(0),
        })
    }

    /// Runs `f` over `N` scratch views of `lens` elements: the start of the
    /// queue's kept buffers, grown (never shrunk) when short, so a step
    /// allocates none after its first. Held while `f` queues its work; a
    /// buffer replaced later is freed after the work queued before. In the
    /// unit tests each buffer holds [`SCRATCH_GUARD`] sentinels past its
    /// view, checked after `f`: a length asked too short fails there.
    pub(crate) fn with_scratch<const N: usize>(
        &self,
        lens: [usize; N],
        f: impl FnOnce([View; N]) -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        let mut kept = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        for (i, &len) in lens.iter().enumerate() {
            let need = (len + SCRATCH_GUARD).max(1);
            match kept.get(i) {
                Some(mem) if mem.len() >= need => {}
                Some(_) => kept[i] = self.alloc(need)?,
                None => kept.push(self.alloc(need)?),
            }
        }
        #[cfg(test)]
        self.scratch_guards(&kept, &lens, false)?;
        f(std::array::from_fn(|i| kept[i].view_range(0..lens[i])))?;
        #[cfg(test)]
        self.scratch_guards(&kept, &lens, true)?;
        Ok(())
    }

    pub fn name(&self) -> String {
        self.rt.name()
    }

    /// [`Runtime::tensor_cores`].
    pub(crate) fn tensor_cores(&self) -> bool {
        self.rt.tensor_cores()
    }

    pub fn alloc<T: Elem>(&self, len: usize) -> Result<R::Mem<T>, GpuError> {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        self.rt.alloc(len)
    }

    /// Buffers allocated through [`Queue::alloc`] so far: the model's,
    /// the kernels' scratch and temporaries (not those a runtime keeps for
    /// itself, such as a GEMM's rounded operands).
    pub fn allocations(&self) -> u64 {
        self.allocations.load(Ordering::Relaxed)
    }

    pub fn write<T: Elem>(&self, dst: View, src: &[T]) -> Result<(), GpuError> {
        check_len("write", dst, src.len())?;
        // SAFETY: views come only from `DeviceMem::view_range` (checked
        // against their buffer); the lengths were just checked.
        unsafe { self.rt.write(dst, src) }
    }

    pub fn read<T: Elem>(&self, src: View, dst: &mut [T]) -> Result<(), GpuError> {
        check_len("read", src, dst.len())?;
        // SAFETY: as in `write`.
        unsafe { self.rt.read(src, dst) }
    }

    pub fn finish(&self) -> Result<(), GpuError> {
        self.rt.finish()
    }

    /// Starts dst = src on the copy queue (see [`Runtime::read_start`]).
    ///
    /// # Safety
    /// As [`Runtime::read_start`]'s, for `dst`.
    pub unsafe fn read_start(&self, src: View, dst: &mut [f32]) -> Result<Waiter, GpuError> {
        check_len("read", src, dst.len())?;
        // SAFETY: the view as in `write`; `dst` per this function's contract.
        unsafe { self.rt.read_start(src, dst) }
    }

    pub(crate) fn launch(&self, name: &str, groups: usize, args: &[Arg]) -> Result<(), GpuError> {
        if groups == 0 {
            return Ok(());
        }
        // SAFETY: every wrapper in kernels.rs and attention.rs checks its
        // views against the sizes it passes (`need`), every `Kernel`'s
        // launch runs after its check (`Checked`), and each passes the
        // kernel's parameter types, in order.
        unsafe { self.rt.launch(name, groups, args) }
    }
}

/// Sentinels past each scratch view in the unit tests ([`Queue::with_scratch`]).
#[cfg(test)]
const SCRATCH_GUARD: usize = 64;
#[cfg(not(test))]
const SCRATCH_GUARD: usize = 0;

/// `kind`'s device `index` is not among `names` (the devices there are).
pub fn out_of_range(kind: &str, index: usize, names: &[String]) -> GpuError {
    let found: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, n)| format!("{i}: {n}"))
        .collect();
    GpuError(format!(
        "{kind} device {index} out of range; found {}: {}",
        names.len(),
        found.join("; ")
    ))
}

/// A count or offset as the `unsigned` the kernels take.
pub fn u32_arg(what: &str, n: usize) -> Result<u32, GpuError> {
    u32::try_from(n)
        .map_err(|_| GpuError(format!("{what} = {n} exceeds the kernels' 32-bit limit")))
}

/// `kernel(dst, src, n)` over `src`'s first `n` elements into `scratch`
/// where it holds `len` elements, else into a new buffer that takes its
/// place (a smaller one is freed in stream order, after the kernels queued
/// before it): a GEMM operand's copy (cuBLAS's bf16, OpenCL's fp32), so
/// GEMMs of one shape neither allocate nor clear.
///
/// # Safety
/// `src` is a view of a live buffer of `rt` with `n` elements (`Gemm::spans`),
/// and `len` `T`s hold the kernel's `n` results.
pub(crate) unsafe fn converted<R: Runtime, T: Elem>(
    rt: &R,
    kernel: &str,
    (src, n): (View, usize),
    len: usize,
    scratch: Option<R::Mem<T>>,
) -> Result<R::Mem<T>, GpuError> {
    let mem = match scratch {
        Some(mem) if mem.len() >= len => mem,
        _ => rt.alloc::<T>(len)?,
    };
    let args = [
        Arg::View(mem.view()),
        Arg::View(src.part(0..n)),
        u32s("n", n)?,
    ];
    // SAFETY: per this function's contract.
    unsafe { rt.launch(kernel, n.div_ceil(BLOCK), &args)? };
    Ok(mem)
}

/// Errors unless a transfer of `n` elements fits `view` exactly.
fn check_len(what: &str, view: View, n: usize) -> Result<(), GpuError> {
    if view.len != n {
        return Err(GpuError(format!(
            "{what}: host slice of {n} elements for a view of {}",
            view.len
        )));
    }
    Ok(())
}

/// The kernels' names, in source order: every `KERNEL void name(`.
pub fn kernel_names(source: &str) -> Vec<&str> {
    source
        .split("KERNEL void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(str::trim)
        .collect()
}

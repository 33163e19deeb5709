//! The OpenCL device: context, an in-order queue for the kernels and one
//! for copies that run beside them, the kernel program built from
//! `src/backend/kernels`, and buffers addressed through element views.
//! libOpenCL is opened at run time, so a machine without it still builds.

use super::clblast::Clblast;
use crate::backend::gpu::{
    converted, kernel_names, out_of_range, program_source, u32_arg, Arg, DeviceMem, Gemm, GpuError,
    Operand, Runtime, View, Waiter, BLOCK,
};
use crate::backend::Elem;
use opencl3::command_queue::{enqueue_read_buffer, enqueue_write_buffer, CommandQueue};
use opencl3::context::Context;
use opencl3::device::{Device as ClDevice, CL_DEVICE_TYPE_ALL};
use opencl3::error_codes::{
    ClError as RawError, CL_DEVICE_NOT_FOUND, CL_PLATFORM_NOT_FOUND_KHR, DLOPEN_RUNTIME_LOAD_FAILED,
};
use opencl3::event::Event;
use opencl3::kernel::Kernel;
use opencl3::memory::{Buffer, ClMem, CL_MEM_READ_WRITE};
use opencl3::platform::get_platforms;
use opencl3::program::Program;
use opencl3::types::{cl_device_id, cl_mem, CL_BLOCKING, CL_NON_BLOCKING};
use std::collections::HashMap;
use std::ptr;
use std::sync::Mutex;

const NO_RUNTIME: &str = "no OpenCL runtime (libOpenCL.so.1 not found): install \
    ocl-icd-libopencl1 and a driver, e.g. pocl-opencl-icd for the CPU or your GPU vendor's";

/// The context of a failed OpenCL call, for `map_err`.
pub(super) fn failed(what: &'static str) -> impl Fn(RawError) -> GpuError {
    move |e| GpuError(format!("OpenCL {what} failed: {e}"))
}

/// `len` elements of device memory, released on drop (OpenCL keeps it
/// until the commands queued on it have finished).
pub struct Mem<T: Elem> {
    buf: Buffer<T>,
    len: usize,
}

impl<T: Elem> DeviceMem for Mem<T> {
    fn handle(&self) -> u64 {
        self.buf.get() as u64
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// An OpenCL device ready to run the model's kernels.
pub struct ClRuntime {
    // Fields drop in order: kernels before their program, the queue before its context.
    kernels: Mutex<HashMap<String, Kernel>>,
    _program: Program,
    blas: Clblast,
    /// A bf16 GEMM's two operands as floats and its float output where it
    /// is stored in bf16 (`sgemm`), kept for the next one.
    bf16_scratch: Mutex<[Option<Mem<f32>>; 3]>,
    queue: CommandQueue,
    /// Where `read_start` copies, beside `queue`.
    copier: CommandQueue,
    _context: Context,
    name: String,
}

/// Every device of every platform, in order, with its "platform: device" name.
fn all_devices() -> Result<Vec<(cl_device_id, String)>, GpuError> {
    let platforms = match get_platforms() {
        // The ICD loader's answer when no driver is installed: no devices.
        Err(e) if e.0 == CL_PLATFORM_NOT_FOUND_KHR => Vec::new(),
        Err(e) if e.0 == DLOPEN_RUNTIME_LOAD_FAILED => return Err(GpuError(NO_RUNTIME.into())),
        r => r.map_err(failed("clGetPlatformIDs"))?,
    };
    let mut found = Vec::new();
    for p in platforms {
        let pname = p.name().map_err(failed("clGetPlatformInfo"))?;
        let ids = match p.get_devices(CL_DEVICE_TYPE_ALL) {
            Err(e) if e.0 == CL_DEVICE_NOT_FOUND => Vec::new(),
            r => r.map_err(failed("clGetDeviceIDs"))?,
        };
        for id in ids {
            let dname = ClDevice::new(id)
                .name()
                .map_err(failed("clGetDeviceInfo"))?;
            found.push((id, format!("{}: {}", pname.trim(), dname.trim())));
        }
    }
    Ok(found)
}

impl Runtime for ClRuntime {
    type Mem<T: Elem> = Mem<T>;
    const KIND: &'static str = "opencl";

    /// Every device of every platform, as "platform: device".
    fn list() -> Result<Vec<String>, GpuError> {
        Ok(all_devices()?.into_iter().map(|(_, n)| n).collect())
    }

    /// Opens device `index` (counted across all platforms), builds the kernels
    /// and loads CLBlast.
    fn open(index: usize) -> Result<ClRuntime, GpuError> {
        let devices = all_devices()?;
        if devices.is_empty() {
            return Err(GpuError(
                "OpenCL runtime found but it lists no devices: install a driver, e.g. \
                 pocl-opencl-icd for the CPU or your GPU vendor's"
                    .into(),
            ));
        }
        let Some((id, name)) = devices.get(index).cloned() else {
            let names: Vec<String> = devices.iter().map(|(_, n)| n.clone()).collect();
            return Err(out_of_range("OpenCL", index, &names));
        };
        let blas = Clblast::load()?;
        let context =
            Context::from_device(&ClDevice::new(id)).map_err(failed("clCreateContext"))?;
        let queue =
            CommandQueue::create_default(&context, 0).map_err(failed("clCreateCommandQueue"))?;
        let copier =
            CommandQueue::create_default(&context, 0).map_err(failed("clCreateCommandQueue"))?;
        let program = Program::create_and_build_from_source(&context, program_source(), "")
            .map_err(|log| GpuError(format!("building the kernels for {name} failed: {log}")))?;
        let mut kernels = HashMap::new();
        for kname in kernel_names(program_source()) {
            let k = Kernel::create(&program, kname).map_err(failed("clCreateKernel"))?;
            kernels.insert(kname.to_string(), k);
        }
        Ok(ClRuntime {
            kernels: Mutex::new(kernels),
            _program: program,
            blas,
            bf16_scratch: Mutex::new([None, None, None]),
            queue,
            copier,
            _context: context,
            name,
        })
    }

    /// "platform: device".
    fn name(&self) -> String {
        self.name.clone()
    }

    fn alloc<T: Elem>(&self, len: usize) -> Result<Mem<T>, GpuError> {
        // OpenCL has no empty buffers; an empty Mem holds one unused element.
        // SAFETY: no host pointer is passed.
        let mut buf = unsafe {
            Buffer::<T>::create(
                &self._context,
                CL_MEM_READ_WRITE,
                len.max(1),
                ptr::null_mut(),
            )
        }
        .map_err(|e| GpuError(format!("allocating {len} elements failed: {e}")))?;
        let bytes = len.max(1) * size_of::<T>();
        // SAFETY: the fill covers exactly the buffer just created.
        unsafe {
            self.queue
                .enqueue_fill_buffer(&mut buf, &[T::default()], 0, bytes, &[])
                .map_err(failed("clEnqueueFillBuffer"))?;
        }
        Ok(Mem { buf, len })
    }

    unsafe fn write<T: Elem>(&self, dst: View, src: &[T]) -> Result<(), GpuError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: blocking, so `src` outlives the transfer; the range was
        // checked against the view, which `Mem::view_range` checked.
        unsafe {
            enqueue_write_buffer(
                self.queue.get(),
                dst.mem as cl_mem,
                CL_BLOCKING,
                dst.off * size_of::<T>(),
                size_of_val(src),
                src.as_ptr().cast(),
                0,
                ptr::null(),
            )
        }
        .map(release_event)
        .map_err(|e| failed("clEnqueueWriteBuffer")(RawError(e)))
    }

    unsafe fn read<T: Elem>(&self, src: View, dst: &mut [T]) -> Result<(), GpuError> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `write`.
        unsafe { read_on(&self.queue, src, dst, None) }.map(drop)
    }

    unsafe fn read_start(&self, src: View, dst: &mut [f32]) -> Result<Waiter, GpuError> {
        if dst.is_empty() {
            return Ok(Box::new(|| Ok(())));
        }
        // SAFETY: a marker touches no memory.
        let after = unsafe { self.queue.enqueue_marker_with_wait_list(&[]) }
            .map_err(failed("clEnqueueMarkerWithWaitList"))?;
        self.queue.flush().map_err(failed("clFlush"))?;
        // SAFETY: the range as in `read`; `dst` outlives the copy per the
        // caller's contract, and the waiter holds the copy's event.
        let done = unsafe { read_on(&self.copier, src, dst, Some(&after)) }?;
        if let Err(e) = self.copier.flush() {
            // the read is queued: it must land before `dst` is given back
            let _ = done.wait();
            return Err(failed("clFlush")(e));
        }
        Ok(Box::new(move || {
            done.wait().map_err(failed("clWaitForEvents"))
        }))
    }

    fn finish(&self) -> Result<(), GpuError> {
        self.queue.finish().map_err(failed("clFinish"))
    }

    unsafe fn launch(&self, name: &str, groups: usize, args: &[Arg]) -> Result<(), GpuError> {
        // Setting arguments mutates the shared kernel object: one launch at a time.
        let kernels = self.kernels.lock().unwrap_or_else(|p| p.into_inner());
        let k = kernels
            .get(name)
            .ok_or_else(|| GpuError(format!("no kernel {name} in the program")))?;
        let mut i = 0;
        // SAFETY: each argument has the type of the kernel's parameter at that
        // index (cl_mem + unsigned for a view, unsigned, float), per kernels/*.cu.
        unsafe {
            for a in args {
                match a {
                    Arg::View(v) => {
                        k.set_arg(i, &(v.mem as cl_mem))
                            .map_err(failed("clSetKernelArg"))?;
                        i += 1;
                        k.set_arg(i, &u32_arg("view offset", v.off)?)
                            .map_err(failed("clSetKernelArg"))?;
                    }
                    Arg::U32(x) => k.set_arg(i, x).map_err(failed("clSetKernelArg"))?,
                    Arg::F32(x) => k.set_arg(i, x).map_err(failed("clSetKernelArg"))?,
                }
                i += 1;
            }
            let global = [groups * BLOCK];
            let local = [BLOCK];
            self.queue
                .enqueue_nd_range_kernel(
                    k.get(),
                    1,
                    ptr::null(),
                    global.as_ptr(),
                    local.as_ptr(),
                    &[],
                )
                .map_err(|e| GpuError(format!("launching {name} failed: {e}")))?;
        }
        Ok(())
    }

    unsafe fn sgemm(&self, g: Gemm) -> Result<(), GpuError> {
        if !g.bf16 {
            return self.blas.sgemm(self.queue.get(), g);
        }
        // CLBlast has no bf16 GEMM: its SGEMM over the operands rounded to
        // bf16 (or widened, where stored in bf16) and kept as floats makes
        // the products cuBLAS's bf16 GEMM makes; a bf16 output is rounded
        // from a float one. Held until the GEMM is queued, as the copies
        // are shared.
        let mut scratch = self.bf16_scratch.lock().unwrap_or_else(|p| p.into_inner());
        let [a_span, b_span] = g.spans()?;
        // as floats: rounded to bf16 (`round_bf16`) from floats, widened
        // (`from_bf16`) from bf16
        let floats = |view: View, bf16: bool, n: usize, scratch: Option<Mem<f32>>| {
            let kernel = if bf16 { "from_bf16" } else { "round_bf16" };
            // SAFETY: `view` holds the n elements a product reads or writes
            // (`Gemm::spans`, `g.c_span`, the callers' checks).
            unsafe { converted(self, kernel, (view, n), n, scratch) }
        };
        let a = floats(g.a.view, g.a.bf16, a_span, scratch[0].take())?;
        let b = floats(g.b.view, g.b.bf16, b_span, scratch[1].take())?;
        let c_span = g.c_span();
        // a bf16 output widened first, so that what the products skip
        // (between a batch's blocks, past m in each column) is written back as it was
        let c = match g.c_bf16 {
            true => Some(floats(g.c, true, c_span, scratch[2].take())?),
            false => None,
        };
        let float = |mem: &Mem<f32>, op: Operand| Operand {
            view: mem.view(),
            bf16: false,
            ..op
        };
        self.blas.sgemm(
            self.queue.get(),
            Gemm {
                a: float(&a, g.a),
                b: float(&b, g.b),
                c: c.as_ref().map_or(g.c, |c| c.view()),
                c_bf16: false,
                ..g
            },
        )?;
        if let Some(c) = &c {
            let args = [
                Arg::View(g.c),
                Arg::View(c.view()),
                Arg::U32(u32_arg("n", c_span)?),
            ];
            // SAFETY: `c` holds the product's c_span floats, `g.c` as many
            // bf16 values (the caller's check).
            unsafe { self.launch("to_bf16", c_span.div_ceil(BLOCK), &args)? };
        }
        // a GEMM without a bf16 output keeps the one before's output scratch
        let c = c.or(scratch[2].take());
        *scratch = [Some(a), Some(b), c];
        Ok(())
    }
}

/// Queues dst = src on `queue`: blocking, or without blocking after
/// `after` (an event of any queue of the context).
///
/// # Safety
/// The range fits `src`'s buffer; `dst` stays allocated and untouched until
/// the returned event completes (at once when blocking).
unsafe fn read_on<T: Elem>(
    queue: &CommandQueue,
    src: View,
    dst: &mut [T],
    after: Option<&Event>,
) -> Result<Event, GpuError> {
    let after = after.map(Event::get);
    let (blocking, waits) = match &after {
        None => (CL_BLOCKING, &[][..]),
        Some(e) => (CL_NON_BLOCKING, std::slice::from_ref(e)),
    };
    // SAFETY: per this function's contract.
    unsafe {
        enqueue_read_buffer(
            queue.get(),
            src.mem as cl_mem,
            blocking,
            src.off * size_of::<T>(),
            size_of_val(dst),
            dst.as_mut_ptr().cast(),
            waits.len() as u32,
            if waits.is_empty() {
                ptr::null()
            } else {
                waits.as_ptr()
            },
        )
    }
    .map(Event::new)
    .map_err(|e| failed("clEnqueueReadBuffer")(RawError(e)))
}

fn release_event(e: opencl3::types::cl_event) {
    drop(Event::new(e));
}

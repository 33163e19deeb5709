//! The OpenCL device: context, one in-order queue, the kernel program built
//! from `src/backend/kernels`, and buffers addressed through element views.
//! libOpenCL is opened at run time, so a machine without it still builds.

use super::clblast::Clblast;
use super::kernels::program_source;
use super::ClError;
use opencl3::command_queue::{enqueue_read_buffer, enqueue_write_buffer, CommandQueue};
use opencl3::context::Context;
use opencl3::device::{Device as ClDevice, CL_DEVICE_TYPE_ALL};
use opencl3::error_codes::{
    ClError as RawError, CL_DEVICE_NOT_FOUND, CL_PLATFORM_NOT_FOUND_KHR, DLOPEN_RUNTIME_LOAD_FAILED,
};
use opencl3::kernel::Kernel;
use opencl3::memory::{Buffer, ClMem, CL_MEM_READ_WRITE};
use opencl3::platform::get_platforms;
use opencl3::program::Program;
use opencl3::types::{cl_device_id, cl_mem, CL_BLOCKING};
use std::collections::HashMap;
use std::ops::Range;
use std::ptr;
use std::sync::Mutex;

/// Threads per workgroup of every kernel: the prelude's `BLOCK`.
pub const BLOCK: usize = 256;

const NO_RUNTIME: &str = "no OpenCL runtime (libOpenCL.so.1 not found): install \
    ocl-icd-libopencl1 and a driver, e.g. pocl-opencl-icd for the CPU or your GPU vendor's";

/// The context of a failed OpenCL call, for `map_err`.
pub(super) fn failed(what: &'static str) -> impl Fn(RawError) -> ClError {
    move |e| ClError(format!("OpenCL {what} failed: {e}"))
}

/// The element types a buffer may hold: the backend's.
pub use crate::backend::Elem as Element;

/// `len` elements of device memory, released on drop.
pub struct Mem<T: Element> {
    buf: Buffer<T>,
    len: usize,
}

/// A range of a buffer, in elements: what every kernel takes, so a caller
/// can pass one tensor of a flat parameter buffer. Offsets need no alignment.
#[derive(Clone, Copy, Debug)]
pub struct View {
    pub mem: cl_mem,
    pub off: usize,
    pub len: usize,
}

impl<T: Element> Mem<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole buffer.
    pub fn view(&self) -> View {
        self.view_range(0..self.len)
    }

    /// Elements `range` of the buffer; panics when it does not fit, as slicing does.
    pub fn view_range(&self, range: Range<usize>) -> View {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "view {range:?} of a buffer of {} elements",
            self.len
        );
        View {
            mem: self.buf.get(),
            off: range.start,
            len: range.end - range.start,
        }
    }
}

/// One kernel argument. A `View` is passed as two arguments, the buffer and
/// its element offset, the convention of every kernel in `kernels/`.
#[derive(Clone, Copy)]
pub(super) enum Arg {
    View(View),
    U32(u32),
    F32(f32),
}

/// A count or offset as the `unsigned` the kernels take.
pub(super) fn u32_arg(what: &str, n: usize) -> Result<u32, ClError> {
    u32::try_from(n).map_err(|_| ClError(format!("{what} = {n} exceeds the kernels' 32-bit limit")))
}

/// An OpenCL device ready to run the model's kernels.
pub struct Device {
    // Fields drop in order: kernels before their program, the queue before its context.
    kernels: Mutex<HashMap<String, Kernel>>,
    _program: Program,
    blas: Clblast,
    queue: CommandQueue,
    _context: Context,
    name: String,
}

/// Every device of every platform, in order, with its "platform: device" name.
fn all_devices() -> Result<Vec<(cl_device_id, String)>, ClError> {
    let platforms = match get_platforms() {
        // The ICD loader's answer when no driver is installed: no devices.
        Err(e) if e.0 == CL_PLATFORM_NOT_FOUND_KHR => Vec::new(),
        Err(e) if e.0 == DLOPEN_RUNTIME_LOAD_FAILED => return Err(ClError(NO_RUNTIME.into())),
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

impl Device {
    /// Names of all devices, in the order `open` counts them.
    pub fn list() -> Result<Vec<String>, ClError> {
        Ok(all_devices()?.into_iter().map(|(_, n)| n).collect())
    }

    /// Opens device `index` (counted across all platforms), builds the kernels
    /// and loads CLBlast.
    pub fn open(index: usize) -> Result<Device, ClError> {
        let devices = all_devices()?;
        if devices.is_empty() {
            return Err(ClError(
                "OpenCL runtime found but it lists no devices: install a driver, e.g. \
                 pocl-opencl-icd for the CPU or your GPU vendor's"
                    .into(),
            ));
        }
        let Some((id, name)) = devices.get(index).cloned() else {
            let names: Vec<String> = devices
                .iter()
                .enumerate()
                .map(|(i, (_, n))| format!("{i}: {n}"))
                .collect();
            return Err(ClError(format!(
                "OpenCL device {index} out of range; found {}: {}",
                devices.len(),
                names.join("; ")
            )));
        };
        let blas = Clblast::load()?;
        let context =
            Context::from_device(&ClDevice::new(id)).map_err(failed("clCreateContext"))?;
        let queue =
            CommandQueue::create_default(&context, 0).map_err(failed("clCreateCommandQueue"))?;
        let program = Program::create_and_build_from_source(&context, &program_source(), "")
            .map_err(|log| ClError(format!("building the kernels for {name} failed: {log}")))?;
        let mut kernels = HashMap::new();
        for kname in program.kernel_names().split(';').filter(|k| !k.is_empty()) {
            let k = Kernel::create(&program, kname).map_err(failed("clCreateKernel"))?;
            kernels.insert(kname.to_string(), k);
        }
        Ok(Device {
            kernels: Mutex::new(kernels),
            _program: program,
            blas,
            queue,
            _context: context,
            name,
        })
    }

    /// "platform: device".
    pub fn name(&self) -> String {
        self.name.clone()
    }

    pub(super) fn blas(&self) -> &Clblast {
        &self.blas
    }

    pub(super) fn queue(&self) -> &CommandQueue {
        &self.queue
    }

    /// A zero-filled buffer of `len` elements.
    pub fn alloc<T: Element>(&self, len: usize) -> Result<Mem<T>, ClError> {
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
        .map_err(|e| ClError(format!("allocating {len} elements failed: {e}")))?;
        let bytes = len.max(1) * size_of::<T>();
        // SAFETY: the fill covers exactly the buffer just created.
        unsafe {
            self.queue
                .enqueue_fill_buffer(&mut buf, &[T::default()], 0, bytes, &[])
                .map_err(failed("clEnqueueFillBuffer"))?;
        }
        Ok(Mem { buf, len })
    }

    /// dst = src (blocking); `src.len()` must equal `dst.len`.
    pub fn write<T: Element>(&self, dst: View, src: &[T]) -> Result<(), ClError> {
        check_len("write", dst, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: blocking, so `src` outlives the transfer; the range was
        // checked against the view, which `Mem::view_range` checked.
        unsafe {
            enqueue_write_buffer(
                self.queue.get(),
                dst.mem,
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

    /// dst = src (blocking); `dst.len()` must equal `src.len`.
    pub fn read<T: Element>(&self, src: View, dst: &mut [T]) -> Result<(), ClError> {
        check_len("read", src, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: as in `write`.
        unsafe {
            enqueue_read_buffer(
                self.queue.get(),
                src.mem,
                CL_BLOCKING,
                src.off * size_of::<T>(),
                size_of_val(dst),
                dst.as_mut_ptr().cast(),
                0,
                ptr::null(),
            )
        }
        .map(release_event)
        .map_err(|e| failed("clEnqueueReadBuffer")(RawError(e)))
    }

    /// Waits until every queued command has finished.
    pub fn finish(&self) -> Result<(), ClError> {
        self.queue.finish().map_err(failed("clFinish"))
    }

    /// Runs kernel `name` on `groups` workgroups of BLOCK threads.
    pub(super) fn launch(&self, name: &str, groups: usize, args: &[Arg]) -> Result<(), ClError> {
        if groups == 0 {
            return Ok(());
        }
        // Setting arguments mutates the shared kernel object: one launch at a time.
        let kernels = self.kernels.lock().unwrap_or_else(|p| p.into_inner());
        let k = kernels
            .get(name)
            .ok_or_else(|| ClError(format!("no kernel {name} in the program")))?;
        let mut i = 0;
        // SAFETY: each argument has the type of the kernel's parameter at that
        // index (cl_mem + unsigned for a view, unsigned, float), per kernels/*.cu.
        unsafe {
            for a in args {
                match a {
                    Arg::View(v) => {
                        k.set_arg(i, &v.mem).map_err(failed("clSetKernelArg"))?;
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
                .map_err(|e| ClError(format!("launching {name} failed: {e}")))?;
        }
        Ok(())
    }
}

/// Errors unless a transfer of `n` elements fits `view` exactly.
fn check_len(what: &str, view: View, n: usize) -> Result<(), ClError> {
    if view.len != n {
        return Err(ClError(format!(
            "{what}: host slice of {n} elements for a view of {}",
            view.len
        )));
    }
    Ok(())
}

fn release_event(e: opencl3::types::cl_event) {
    drop(opencl3::event::Event::new(e));
}

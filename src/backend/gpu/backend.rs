//! `Gpu<R>`: the [`Backend`](crate::backend::Backend) over a [`Queue`] of runtime `R` (`OpenCl`,
//! `Cuda`). Every handle made
//! from one `open` shares the device, its queue and its first error; each
//! keeps memory counters of its own. Kernels are queued without a result and
//! a failure is kept until the next transfer or `synchronize`, as on a GPU.

use super::{DeviceMem, GpuError, Queue, Raw, Runtime, View};
use crate::backend::cpu::round_to_bf16;
use crate::backend::memory::{Buf, Category, Dst, MemoryStats, Pending, Pinned, RawView, Src};
use crate::backend::ops::{checked, Kernel, Lower, On};
use crate::backend::profile;
use crate::backend::{
    AttentionDecode, Bf16, Decode, Device, Elem, Kernels, MatmulDecode, MatmulForward, MatmulShape,
    WeightFormat, WeightLayout,
};
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex};

pub struct Gpu<R: Runtime> {
    dev: Arc<Queue<R>>,
    /// The device's index, as `open` took it.
    index: usize,
    /// The first failure of a queued kernel, reported by the next transfer or sync.
    failure: Arc<Mutex<Option<String>>>,
    memory: Arc<MemoryStats>,
}

/// A decode weight: W (k x n) kept in its layout, in f32 (values rounded
/// to bf16 when asked, so results match the CPU's bf16 panels).
pub struct PackedGpu<R: Runtime> {
    w: Buf<Gpu<R>>,
    layout: WeightLayout,
}

fn view(raw: RawView) -> View {
    View {
        mem: raw.handle as u64,
        off: raw.off,
        len: raw.len,
    }
}

fn device_error(e: GpuError) -> Error {
    Error::Device(e.0)
}

// Not derived: that would ask `R: Clone`.
impl<R: Runtime> Clone for Gpu<R> {
    fn clone(&self) -> Self {
        Gpu {
            dev: self.dev.clone(),
            index: self.index,
            failure: self.failure.clone(),
            memory: self.memory.clone(),
        }
    }
}

impl<R: Runtime> Gpu<R> {
    /// Opens device `index` (as `distgpt devices` lists them).
    pub fn open(index: usize) -> Result<Self> {
        Ok(Gpu {
            dev: Arc::new(Queue::open(index).map_err(device_error)?),
            index,
            failure: Arc::default(),
            memory: Arc::default(),
        })
    }

    /// Runs a kernel launch unless an earlier one failed; keeps its failure.
    fn queue(&self, launch: impl FnOnce(&Queue<R>) -> Result<(), GpuError>) {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if failure.is_none() {
            if let Err(e) = launch(&self.dev) {
                *failure = Some(e.0);
            }
        }
    }

    /// [`Gpu::queue`] for a kernel the profile counts: while it is on, the
    /// queue is finished before and after the launch (a failure to finish
    /// is kept as a launch's is).
    fn kernel(
        &self,
        name: &'static str,
        flops: f64,
        launch: impl FnOnce(&Queue<R>) -> Result<(), GpuError>,
    ) {
        let finish = || self.queue(|d| d.finish());
        profile::PROCESS.timed(name, flops, finish, || self.queue(launch))
    }

    /// [`Gpu::kernel`] for one of [`Queue::pointwise`]'s kernels.
    fn pointwise(&self, name: &'static str, dst: RawView, src: RawView) {
        self.kernel(name, 0.0, |d| d.pointwise(name, view(dst), view(src)))
    }

    /// The kept failure, if any, as an error (and cleared).
    fn check(&self) -> Result<()> {
        match self
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            Some(e) => Err(Error::Device(e)),
            None => Ok(()),
        }
    }
}

/// Lowers a backend's views to the raw views the queue's kernels take.
struct ToRaw;

impl<'a, R: Runtime> Lower<On<'a, Gpu<R>>, Raw> for ToRaw {
    fn input<T: Elem>(&self, x: Src<'a, Gpu<R>, T>) -> View {
        view(x.raw())
    }
    fn output<T: Elem>(&self, x: Dst<'a, Gpu<R>, T>) -> View {
        view(x.raw())
    }
}

impl<R: Runtime> Device for Gpu<R> {
    type Mem<T: Elem> = R::Mem<T>;

    fn handle<T: Elem>(mem: &R::Mem<T>) -> usize {
        mem.handle() as usize
    }
    fn handle_mut<T: Elem>(mem: &mut R::Mem<T>) -> usize {
        mem.handle() as usize
    }
    fn name(&self) -> String {
        format!("{} ({})", R::KIND, self.dev.name())
    }
    fn clone_fresh(&self) -> Self {
        Gpu {
            memory: Arc::default(),
            ..self.clone()
        }
    }
    fn for_rank(&self, own_device: Option<usize>) -> Result<Self> {
        match own_device {
            None => Ok(self.clone_fresh()),
            // Thread ranks of an NCCL group: one device each, as the
            // group's communicator was made.
            Some(rank) => Gpu::open(R::device_of(self.index, rank).map_err(device_error)?),
        }
    }
    fn memory(&self) -> &Arc<MemoryStats> {
        &self.memory
    }
    fn alloc_typed<T: Elem>(&self, len: usize, category: Category) -> Result<Buf<Self, T>> {
        let mem = self.dev.alloc::<T>(len).map_err(|e| {
            Error::Device(format!(
                "allocating {len} elements for {}: {e}",
                category.name()
            ))
        })?;
        Ok(Buf::new(mem, len, category, self.memory.clone()))
    }
    fn upload<T: Elem>(&self, dst: Dst<'_, Self, T>, src: &[T]) -> Result<()> {
        self.check()?;
        self.dev.write(view(dst.raw()), src).map_err(device_error)
    }
    fn download<T: Elem>(&self, src: Src<'_, Self, T>, dst: &mut [T]) -> Result<()> {
        self.check()?;
        self.dev.read(view(src.raw()), dst).map_err(device_error)
    }
    unsafe fn download_start(&self, src: Src<'_, Self>, dst: &mut [f32]) -> Result<Pending> {
        self.check()?;
        // SAFETY: the caller keeps `dst` (pinned) until the Pending is waited or dropped.
        let wait = unsafe { self.dev.read_start(view(src.raw()), dst) }.map_err(device_error)?;
        Ok(Pending::new(move || wait().map_err(device_error)))
    }
    unsafe fn pin(&self, host: &mut [f32]) -> Result<Pinned> {
        // SAFETY: the caller keeps `host` until the Pinned is dropped.
        match unsafe { self.dev.rt.pin(host) }.map_err(device_error)? {
            Some(release) => Ok(Pinned::new(release)),
            None => Ok(Pinned::unneeded()),
        }
    }
    fn host<'a, T: Elem>(&self, _: Src<'a, Self, T>) -> Option<&'a [T]> {
        None
    }
    fn host_mut<'a, T: Elem>(&self, _: Dst<'a, Self, T>) -> Option<&'a mut [T]> {
        None
    }
    fn device_memory(&self) -> Option<(u64, u64)> {
        self.dev.rt.memory_info()
    }
    fn allocations(&self) -> Option<u64> {
        Some(self.dev.allocations())
    }
    fn device_address(&self, view: RawView, elem_size: usize) -> Option<u64> {
        R::ADDRESSED.then(|| view.handle as u64 + (view.off * elem_size) as u64)
    }
    fn synchronize(&self) -> Result<()> {
        self.check()?;
        self.dev.finish().map_err(device_error)
    }
    fn ranks_share_device(&self) -> bool {
        // Thread ranks all use the one device this backend opened.
        true
    }
}

/// Every kernel queued with its operands lowered to raw views; a failure is
/// kept for the next transfer or `synchronize`.
impl<R: Runtime> Kernels for Gpu<R> {
    fn run<'a, K: Kernel<On<'a, Self>>>(&self, op: K) -> Result<()> {
        let checked = checked(&op)?;
        self.kernel(K::NAME, op.flops(), |d| op.gpu(d, &ToRaw, checked));
        Ok(())
    }
    fn fill(&self, dst: Dst<'_, Self>, value: f32) {
        self.kernel("fill", 0.0, |d| d.fill(view(dst.raw()), value))
    }
    fn add_inplace(&self, dst: Dst<'_, Self>, src: Src<'_, Self>) {
        self.pointwise("add_inplace", dst.raw(), src.raw())
    }
    fn copy(&self, dst: Dst<'_, Self>, src: Src<'_, Self>) {
        self.pointwise("copy", dst.raw(), src.raw())
    }
    fn round_bf16(&self, x: Dst<'_, Self>) {
        self.pointwise("round_bf16", x.raw(), x.raw())
    }
    fn to_bf16(&self, dst: Dst<'_, Self, Bf16>, src: Src<'_, Self>) {
        self.pointwise("to_bf16", dst.raw(), src.raw())
    }
    fn sum(&self, x: Src<'_, Self>) -> Result<f64> {
        self.check()?;
        let finish = || self.queue(|d| d.finish());
        profile::PROCESS
            .timed("sum", 0.0, finish, || self.dev.sum(view(x.raw())))
            .map_err(device_error)
    }
    fn sum_squares(&self, xs: &[Src<'_, Self>]) -> Result<Vec<f64>> {
        self.check()?;
        let finish = || self.queue(|d| d.finish());
        let xs: Vec<_> = xs.iter().map(|x| view(x.raw())).collect();
        profile::PROCESS
            .timed("sum_squares", 0.0, finish, || self.dev.sum_squares(&xs))
            .map_err(device_error)
    }
}

impl<R: Runtime> Decode for Gpu<R> {
    type Packed = PackedGpu<R>;

    fn pack_decode_weight(
        &self,
        w: Src<'_, Self>,
        layout: WeightLayout,
        k: usize,
        n: usize,
        format: WeightFormat,
    ) -> Result<PackedGpu<R>> {
        let mut packed = self.alloc(k * n, Category::Params)?;
        match format {
            WeightFormat::F32 => self.copy(packed.d(), w.first(k * n)),
            WeightFormat::Bf16 => {
                let rounded: Vec<f32> = self
                    .to_host(w.first(k * n))?
                    .into_iter()
                    .map(round_to_bf16)
                    .collect();
                self.upload(packed.d(), &rounded)?;
            }
            WeightFormat::Int8 => {
                return Err(Error::Input(format!(
                "int8 weights run on the CPU only (--device cpu); on {} use --weights f32 or bf16",
                R::KIND
            )))
            }
        }
        Ok(PackedGpu { w: packed, layout })
    }
    fn matmul_decode(&self, op: MatmulDecode<'_, On<'_, Self>, PackedGpu<R>>) {
        let MatmulDecode {
            out,
            inp,
            w,
            bias,
            dims,
            accumulate,
        } = op;
        let queued = self.run(MatmulForward {
            out: out.into(),
            inp: inp.into(),
            w: w.w.s().into(),
            bias,
            residual: None,
            shape: MatmulShape::new(dims, w.layout),
            accumulate,
        });
        if let Err(e) = queued {
            // kept for the next transfer or sync, as a launch's failure is
            self.queue(|_| Err(GpuError(e.to_string())));
        }
    }
    fn attention_decode(&self, op: AttentionDecode<On<'_, Self>>) {
        self.queue(|d| d.attention_decode(op.lower(&ToRaw)))
    }
}

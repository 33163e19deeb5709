//! `Gpu<R>`: the [`Backend`] over a [`Device`] of runtime `R` (`OpenCl`,
//! `Cuda`). Every handle made
//! from one `open` shares the device, its queue and its first error; each
//! keeps memory counters of its own. Kernels are queued without a result and
//! a failure is kept until the next transfer or `synchronize`, as on a GPU.

use super::{Device, DeviceMem, GpuError, Runtime, View};
use crate::backend::cpu::round_to_bf16;
use crate::backend::memory::{Buf, Category, Dst, MemoryStats, RawView, Src};
use crate::backend::{
    Activation, AdamWStep, AttnShape, Backend, DecodeShape, Elem, WeightFormat, WeightLayout,
};
use crate::comm::Comm;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub struct Gpu<R: Runtime> {
    dev: Arc<Device<R>>,
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
            dev: Arc::new(Device::open(index).map_err(device_error)?),
            index,
            failure: Arc::default(),
            memory: Arc::default(),
        })
    }

    /// Runs a kernel launch unless an earlier one failed; keeps its failure.
    fn queue(&self, launch: impl FnOnce(&Device<R>) -> Result<(), GpuError>) {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if failure.is_none() {
            if let Err(e) = launch(&self.dev) {
                *failure = Some(e.0);
            }
        }
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

impl<R: Runtime> Gpu<R> {
    /// `matmul_forward`, and its bf16 twin when `bf16` (`Gemm::bf16`).
    #[allow(clippy::too_many_arguments)]
    fn matmul_forward_as(
        &self,
        bf16: bool,
        out: Dst<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        bias: Option<Src<'_, Self>>,
        layout: WeightLayout,
        (rows, k, n): (usize, usize, usize),
        accumulate: bool,
    ) {
        self.queue(|d| {
            d.matmul_forward(
                view(out.raw()),
                view(inp.raw()),
                view(w.raw()),
                bias.map(|b| view(b.raw())),
                layout,
                rows,
                k,
                n,
                accumulate,
                bf16,
            )
        })
    }

    /// `matmul_backward`, and its bf16 twin when `bf16`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_as(
        &self,
        bf16: bool,
        (dinp, dw, dbias): (Dst<'_, Self>, Dst<'_, Self>, Option<Dst<'_, Self>>),
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        layout: WeightLayout,
        (rows, k, n): (usize, usize, usize),
    ) {
        self.queue(|d| {
            d.matmul_backward(
                view(dinp.raw()),
                view(dw.raw()),
                dbias.map(|b| view(b.raw())),
                view(dout.raw()),
                view(inp.raw()),
                view(w.raw()),
                layout,
                rows,
                k,
                n,
                bf16,
            )
        })
    }
}

impl<R: Runtime> Backend for Gpu<R> {
    type Mem<T: Elem> = R::Mem<T>;
    type Packed = PackedGpu<R>;

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
            dev: self.dev.clone(),
            index: self.index,
            failure: self.failure.clone(),
            memory: Arc::default(),
        }
    }
    fn for_rank(&self, world: &dyn Comm) -> Result<Self> {
        if world.device_native().is_none() || world.shared_threads().is_none() {
            return Ok(self.clone_fresh());
        }
        // Thread ranks of an NCCL group: one device each, as the group's
        // communicator was made.
        Gpu::open(R::device_of(self.index, world.rank()).map_err(device_error)?)
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
    fn host<'a, T: Elem>(&self, _: Src<'a, Self, T>) -> Option<&'a [T]> {
        None
    }
    fn host_mut<'a, T: Elem>(&self, _: Dst<'a, Self, T>) -> Option<&'a mut [T]> {
        None
    }
    fn device_memory(&self) -> Option<(u64, u64)> {
        self.dev.rt.memory_info()
    }
    fn device_address(&self, view: RawView, elem_size: usize) -> Option<u64> {
        R::ADDRESSED.then(|| view.handle as u64 + (view.off * elem_size) as u64)
    }
    fn synchronize(&self) -> Result<()> {
        self.check()?;
        self.dev.finish().map_err(device_error)
    }
    fn encoder_forward(
        &self,
        out: Dst<'_, Self>,
        tokens: Src<'_, Self, u32>,
        wte: Src<'_, Self>,
        wpe: Src<'_, Self>,
        t: usize,
        c: usize,
    ) {
        self.queue(|d| {
            d.encoder_forward(
                view(out.raw()),
                view(tokens.raw()),
                view(wte.raw()),
                view(wpe.raw()),
                t,
                c,
            )
        })
    }
    fn encoder_backward(
        &self,
        dwte: Dst<'_, Self>,
        dwpe: Dst<'_, Self>,
        dout: Src<'_, Self>,
        _tokens: Src<'_, Self, u32>,
        host_tokens: &[u32],
        t: usize,
        c: usize,
    ) {
        self.queue(|d| {
            d.encoder_backward(
                view(dwte.raw()),
                view(dwpe.raw()),
                view(dout.raw()),
                host_tokens,
                t,
                c,
            )
        })
    }
    fn layernorm_forward(
        &self,
        out: Dst<'_, Self>,
        mean: Dst<'_, Self>,
        rstd: Dst<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        b: Src<'_, Self>,
        c: usize,
        eps: f32,
    ) {
        let rows = mean.len();
        self.queue(|d| {
            d.layernorm_forward(
                view(out.raw()),
                view(mean.raw()),
                view(rstd.raw()),
                view(inp.raw()),
                view(w.raw()),
                view(b.raw()),
                rows,
                (c, eps),
            )
        })
    }
    fn layernorm_backward(
        &self,
        dinp: Dst<'_, Self>,
        dw: Dst<'_, Self>,
        db: Dst<'_, Self>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        mean: Src<'_, Self>,
        rstd: Src<'_, Self>,
        c: usize,
    ) {
        let rows = mean.len();
        self.queue(|d| {
            d.layernorm_backward(
                view(dinp.raw()),
                view(dw.raw()),
                view(db.raw()),
                view(dout.raw()),
                view(inp.raw()),
                view(w.raw()),
                view(mean.raw()),
                view(rstd.raw()),
                rows,
                c,
            )
        })
    }
    fn matmul_forward(
        &self,
        out: Dst<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        bias: Option<Src<'_, Self>>,
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) {
        self.matmul_forward_as(false, out, inp, w, bias, layout, (rows, k, n), accumulate)
    }
    fn matmul_forward_bf16(
        &self,
        out: Dst<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        bias: Option<Src<'_, Self>>,
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) {
        self.matmul_forward_as(true, out, inp, w, bias, layout, (rows, k, n), accumulate)
    }
    fn matmul_backward(
        &self,
        dinp: Dst<'_, Self>,
        dw: Dst<'_, Self>,
        dbias: Option<Dst<'_, Self>>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
    ) {
        self.matmul_backward_as(false, (dinp, dw, dbias), dout, inp, w, layout, (rows, k, n))
    }
    fn matmul_backward_bf16(
        &self,
        dinp: Dst<'_, Self>,
        dw: Dst<'_, Self>,
        dbias: Option<Dst<'_, Self>>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        w: Src<'_, Self>,
        layout: WeightLayout,
        rows: usize,
        k: usize,
        n: usize,
    ) {
        self.matmul_backward_as(true, (dinp, dw, dbias), dout, inp, w, layout, (rows, k, n))
    }
    fn matmul_backward_input(
        &self,
        dinp: Dst<'_, Self>,
        dout: Src<'_, Self>,
        _inp: Src<'_, Self>,
        w: Src<'_, Self>,
        layout: WeightLayout,
        dims: (usize, usize, usize),
    ) -> Result<()> {
        let (dinp, dout, w) = (view(dinp.raw()), view(dout.raw()), view(w.raw()));
        self.queue(|d| d.matmul_backward_input(dinp, dout, w, layout, dims, false));
        Ok(())
    }
    fn matmul_backward_weight(
        &self,
        dw: Dst<'_, Self>,
        dbias: Option<Dst<'_, Self>>,
        dout: Src<'_, Self>,
        inp: Src<'_, Self>,
        _w: Src<'_, Self>,
        layout: WeightLayout,
        dims: (usize, usize, usize),
    ) -> Result<()> {
        let (dw, dbias) = (view(dw.raw()), dbias.map(|b| view(b.raw())));
        let (dout, inp) = (view(dout.raw()), view(inp.raw()));
        self.queue(|d| d.matmul_backward_weight(dw, dbias, dout, inp, layout, dims, false));
        Ok(())
    }
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
    fn matmul_decode(
        &self,
        out: Dst<'_, Self>,
        inp: Src<'_, Self>,
        packed: &PackedGpu<R>,
        bias: Option<Src<'_, Self>>,
        rows: usize,
        k: usize,
        n: usize,
        accumulate: bool,
    ) {
        self.matmul_forward(
            out,
            inp,
            packed.w.s(),
            bias,
            packed.layout,
            rows,
            k,
            n,
            accumulate,
        )
    }
    fn attention_forward(
        &self,
        out: Dst<'_, Self>,
        lse: Dst<'_, Self>,
        qkv: Src<'_, Self>,
        shape: AttnShape,
    ) {
        self.queue(|d| {
            d.attention_forward(
                view(out.raw()),
                view(lse.raw()),
                view(qkv.raw()),
                None,
                shape,
            )
        })
    }
    fn attention_padded_forward(
        &self,
        out: Dst<'_, Self>,
        lse: Dst<'_, Self>,
        qkv: Src<'_, Self>,
        lens: Src<'_, Self, u32>,
        shape: AttnShape,
    ) {
        self.queue(|d| {
            let lens = Some(view(lens.raw()));
            d.attention_forward(
                view(out.raw()),
                view(lse.raw()),
                view(qkv.raw()),
                lens,
                shape,
            )
        })
    }
    #[allow(clippy::too_many_arguments)]
    fn attention_padded_backward(
        &self,
        dqkv: Dst<'_, Self>,
        dout: Src<'_, Self>,
        qkv: Src<'_, Self>,
        out: Src<'_, Self>,
        lse: Src<'_, Self>,
        lens: Src<'_, Self, u32>,
        shape: AttnShape,
    ) {
        self.queue(|d| {
            d.attention_backward(
                view(dqkv.raw()),
                view(dout.raw()),
                view(qkv.raw()),
                view(out.raw()),
                view(lse.raw()),
                Some(view(lens.raw())),
                shape,
            )
        })
    }
    fn attention_backward(
        &self,
        dqkv: Dst<'_, Self>,
        dout: Src<'_, Self>,
        qkv: Src<'_, Self>,
        out: Src<'_, Self>,
        lse: Src<'_, Self>,
        shape: AttnShape,
    ) {
        self.queue(|d| {
            d.attention_backward(
                view(dqkv.raw()),
                view(dout.raw()),
                view(qkv.raw()),
                view(out.raw()),
                view(lse.raw()),
                None,
                shape,
            )
        })
    }
    fn attention_decode(
        &self,
        out: Dst<'_, Self>,
        qkv: Src<'_, Self>,
        kcache: Src<'_, Self>,
        vcache: Src<'_, Self>,
        shape: DecodeShape,
    ) {
        self.queue(|d| {
            d.attention_decode(
                view(out.raw()),
                view(qkv.raw()),
                view(kcache.raw()),
                view(vcache.raw()),
                shape,
            )
        })
    }
    fn activation_forward(&self, out: Dst<'_, Self>, inp: Src<'_, Self>, act: Activation) {
        self.queue(|d| d.activation_forward(view(out.raw()), view(inp.raw()), act))
    }
    fn activation_backward_inplace(&self, dx: Dst<'_, Self>, inp: Src<'_, Self>, act: Activation) {
        self.queue(|d| d.activation_backward_inplace(view(dx.raw()), view(inp.raw()), act))
    }
    fn fill(&self, dst: Dst<'_, Self>, value: f32) {
        self.queue(|d| d.fill(view(dst.raw()), value))
    }
    fn add_inplace(&self, dst: Dst<'_, Self>, src: Src<'_, Self>) {
        self.queue(|d| d.add_inplace(view(dst.raw()), view(src.raw())))
    }
    fn copy(&self, dst: Dst<'_, Self>, src: Src<'_, Self>) {
        self.queue(|d| d.copy(view(dst.raw()), view(src.raw())))
    }
    fn round_bf16(&self, x: Dst<'_, Self>) {
        self.queue(|d| d.round_bf16(view(x.raw())))
    }
    fn crossentropy_forward(
        &self,
        losses: Dst<'_, Self>,
        logits: Src<'_, Self>,
        targets: Src<'_, Self, u32>,
        v: usize,
        vp: usize,
    ) {
        self.queue(|d| {
            d.crossentropy_forward(
                view(losses.raw()),
                view(logits.raw()),
                view(targets.raw()),
                v,
                vp,
            )
        })
    }
    fn crossentropy_backward_inplace(
        &self,
        logits: Dst<'_, Self>,
        targets: Src<'_, Self, u32>,
        v: usize,
        vp: usize,
        dloss: f32,
    ) {
        self.queue(|d| {
            d.crossentropy_backward_inplace(view(logits.raw()), view(targets.raw()), v, vp, dloss)
        })
    }
    fn adamw(
        &self,
        param: Dst<'_, Self>,
        grad: Src<'_, Self>,
        m: Dst<'_, Self>,
        v: Dst<'_, Self>,
        step: AdamWStep,
        weight_decay: f32,
    ) {
        self.queue(|d| {
            d.adamw(
                view(param.raw()),
                view(grad.raw()),
                view(m.raw()),
                view(v.raw()),
                step,
                weight_decay,
            )
        })
    }
    fn measure_peak_flops(&self) -> f64 {
        // A GPT-2-small MLP product: (rows x 768) @ (768 x 3072).
        let (rows, k, n) = (256, 768, 3072);
        let bufs = (
            self.clone_fresh().alloc(rows * n, Category::Other),
            self.clone_fresh().alloc(rows * k, Category::Other),
            self.clone_fresh().alloc(k * n, Category::Other),
        );
        let (Ok(mut out), Ok(inp), Ok(w)) = bufs else {
            return f64::NAN;
        };
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t0 = Instant::now();
            self.matmul_forward(
                out.d(),
                inp.s(),
                w.s(),
                None,
                WeightLayout::InOut,
                rows,
                k,
                n,
                false,
            );
            if self.synchronize().is_err() {
                return f64::NAN;
            }
            best = best.min(t0.elapsed().as_secs_f64());
        }
        2.0 * (rows * k * n) as f64 / best
    }
    fn ranks_share_device(&self) -> bool {
        // Thread ranks all use the one device this backend opened.
        true
    }
    fn sum(&self, x: Src<'_, Self>) -> Result<f64> {
        self.check()?;
        self.dev.sum(view(x.raw())).map_err(device_error)
    }
    fn sum_squares(&self, x: Src<'_, Self>) -> Result<f64> {
        self.check()?;
        self.dev.sum_squares(view(x.raw())).map_err(device_error)
    }
}

//! ZeRO-Offload: what a rank updates, kept in host memory while it trains
//! on a device. The AdamW moments and an fp32 master copy of the
//! parameters the rank owns (its shard, or a replicated stage's whole
//! buffer) live here with a staging copy of the reduced gradient; an
//! update copies the gradient device -> host, runs the CPU backend's AdamW
//! on the thread pool and copies the parameters host -> device. Under
//! `--offload params` the master copy is fsdp's only parameter shard and
//! the device gathers each unit from it.
//!
//! The state is cut into chunks (`CHUNK` floats each: master, gradient and
//! moments of their own), so that with overlap a mover thread copies chunk
//! i + 1's gradient down and chunk i - 1's parameters up while the pool
//! updates chunk i. Each chunk's arithmetic is the same either way.
//!
//! With overlap the gradient starts down earlier still: as soon as a part
//! of it is final, `download_early` queues its copy on the device's copy
//! queue (a second OpenCL queue, a second CUDA stream, into pinned memory).
//! Under zero2 and fsdp (after a piece's last reduce-scatter of the step)
//! and on a replicated stage with no other replica (after a piece's last
//! micro-batch) that is inside the backward, so the copy crosses the link
//! while the backward computes the pieces before it; under zero1 and on
//! replicas that all-reduce, it is after the step's collectives. The
//! update waits for those copies and downloads only what none covered.

use crate::backend::cpu::Cpu;
use crate::backend::{Backend, Buf, Category, Device, Dst, Pending, Pinned, Src};
use crate::error::Result;
use crate::model::{AdamW, AdamWConfig, ParamLayout, Segment};
use std::ops::Range;
use std::sync::mpsc;

/// Floats a chunk holds: 4 MiB, large enough that a copy runs at the
/// link's speed and small enough that the first and last copies (not
/// overlapped) are a small part of a large model's update.
pub const CHUNK: usize = 1 << 20;

/// One chunk of the owned buffer: its master parameters, gradient staging
/// and moments, with the segments of the update rebased onto it.
struct HostChunk {
    /// Where it lies in the owned buffer.
    range: Range<usize>,
    segs: Vec<Segment>,
    // Fields drop in order: the copies into `grads` land, then it is
    // unpinned, then freed.
    /// Copies into `grads` under way (`download_early`), by the range of
    /// the chunk each fills.
    early: Vec<(Range<usize>, Pending)>,
    /// `grads` pinned for those copies where the device needs it.
    _pinned: Pinned,
    grads: Buf<Cpu>,
    master: Buf<Cpu>,
    opt: AdamW<Cpu>,
}

/// A rank's offloaded optimizer state (see the module comment).
pub struct HostState {
    cpu: Cpu,
    chunks: Vec<HostChunk>,
    overlap: bool,
}

/// The host memory behind a CPU buffer.
fn host<'a>(cpu: &Cpu, b: &'a mut Buf<Cpu>) -> &'a mut [f32] {
    cpu.host_mut(b.d()).expect("cpu memory is host memory")
}

impl HostState {
    /// Host state for an owned buffer of `len` floats that the update's
    /// `segments` map onto the layout, in chunks of `chunk` floats; counted
    /// on `cpu`, its gradient staging pinned for `be` when `overlap`.
    pub fn new<B: Backend>(
        be: &B,
        cpu: &Cpu,
        len: usize,
        chunk: usize,
        segments: &[Segment],
        adamw: AdamWConfig,
        overlap: bool,
    ) -> Result<Self> {
        let mut chunks = Vec::new();
        let mut pin = overlap;
        for a in (0..len).step_by(chunk.max(1)) {
            let range = a..(a + chunk).min(len);
            let segs = segments
                .iter()
                .filter_map(|s| {
                    let (lo, hi) = (s.local.max(range.start), (s.local + s.len).min(range.end));
                    (lo < hi).then(|| Segment {
                        global: s.global + lo - s.local,
                        local: lo - range.start,
                        len: hi - lo,
                    })
                })
                .collect();
            let mut grads = cpu.alloc(range.len(), Category::Grads)?;
            // SAFETY: the chunk keeps `grads` until after `_pinned` drops.
            let pinned = match pin.then(|| unsafe { be.pin(host(cpu, &mut grads)) }) {
                Some(Ok(p)) => p,
                Some(Err(e)) => {
                    // still correct, only the copies block the host
                    crate::errln!(
                        "offload: host memory could not be pinned ({e}); the gradient's \
                         copies during the backward will wait for the device"
                    );
                    pin = false;
                    Pinned::unneeded()
                }
                None => Pinned::unneeded(),
            };
            chunks.push(HostChunk {
                early: Vec::new(),
                _pinned: pinned,
                grads,
                master: cpu.alloc(range.len(), Category::Params)?,
                opt: AdamW::new(cpu, range.len(), adamw)?,
                segs,
                range,
            });
        }
        Ok(HostState {
            cpu: cpu.clone(),
            chunks,
            overlap,
        })
    }

    /// The owned parameters, whole (`part` in the owned buffer's order).
    pub fn load_params(&mut self, part: &[f32]) {
        for ch in &mut self.chunks {
            host(&self.cpu, &mut ch.master).copy_from_slice(&part[ch.range.clone()]);
        }
    }

    pub fn load_moments(&mut self, m: &[f32], v: &[f32]) {
        for ch in &mut self.chunks {
            host(&self.cpu, &mut ch.opt.m).copy_from_slice(&m[ch.range.clone()]);
            host(&self.cpu, &mut ch.opt.v).copy_from_slice(&v[ch.range.clone()]);
        }
    }

    /// The master parameters, whole.
    pub fn params(&self) -> Vec<f32> {
        self.gather(|ch| &ch.master)
    }

    /// The moments, whole.
    pub fn moments(&self) -> [Vec<f32>; 2] {
        [self.gather(|ch| &ch.opt.m), self.gather(|ch| &ch.opt.v)]
    }

    fn gather(&self, of: impl Fn(&HostChunk) -> &Buf<Cpu>) -> Vec<f32> {
        let mut out = Vec::new();
        for ch in &self.chunks {
            out.extend_from_slice(self.cpu.host(of(ch).s()).expect("host memory"));
        }
        out
    }

    pub fn set_step(&mut self, step: u32) {
        self.chunks.iter_mut().for_each(|ch| ch.opt.step = step);
    }

    /// Copies the master parameters `range` (of the owned buffer) to `dst`
    /// on the device (fsdp under `--offload params`, before a gather).
    pub fn upload<B: Backend>(
        &self,
        be: &B,
        range: Range<usize>,
        mut dst: Dst<'_, B>,
    ) -> Result<()> {
        for ch in &self.chunks {
            let (lo, hi) = (range.start.max(ch.range.start), range.end.min(ch.range.end));
            if lo < hi {
                let src = self.cpu.host(ch.master.s()).expect("host memory");
                let at = lo - range.start..hi - range.start;
                be.upload(
                    dst.rb().slice(at),
                    &src[lo - ch.range.start..hi - ch.range.start],
                )?;
            }
        }
        Ok(())
    }

    /// With overlap: starts copying the owned buffer's reduced gradient
    /// `range`, final from now on in this step, from `src` (those elements
    /// on the device) into the chunks it covers, on the device's copy
    /// queue; the update waits for it. Without overlap the update copies
    /// everything itself.
    pub fn download_early<B: Backend>(
        &mut self,
        be: &B,
        range: Range<usize>,
        src: Src<'_, B>,
    ) -> Result<()> {
        if !self.overlap {
            return Ok(());
        }
        for ch in &mut self.chunks {
            let (lo, hi) = (range.start.max(ch.range.start), range.end.min(ch.range.end));
            if lo >= hi {
                continue;
            }
            let local = lo - ch.range.start..hi - ch.range.start;
            let dst = &mut host(&self.cpu, &mut ch.grads)[local.clone()];
            // SAFETY: `dst` lies in `ch.grads`, pinned for `be`; nothing
            // reads or writes it until the update waits this copy, and the
            // chunk drops its copies before `grads`.
            let copy =
                unsafe { be.download_start(src.slice(lo - range.start..hi - range.start), dst)? };
            ch.early.push((local, copy));
        }
        Ok(())
    }

    /// Waits out and forgets copies `download_early` started (a step that
    /// failed before its update left them).
    pub fn forget_early(&mut self) {
        self.chunks.iter_mut().for_each(|ch| ch.early.clear());
    }

    /// One AdamW update: the reduced gradient `grads` (the owned buffer's,
    /// on the device) down, where `download_early` did not already start
    /// it, the update on the host, the parameters up into `out` (none
    /// under `--offload params`, where the device holds no copy).
    /// Overlapped chunk by chunk unless `--offload-serial`.
    pub fn update<B: Backend>(
        &mut self,
        be: &B,
        grads: Src<'_, B>,
        out: Option<Dst<'_, B>>,
        lay: &ParamLayout,
        lr: f32,
        clip: f32,
    ) -> Result<()> {
        let HostState {
            cpu,
            chunks,
            overlap,
        } = self;
        let cpu = &*cpu;
        let down = |ch: &mut HostChunk| -> Result<()> {
            let mut covered = Vec::new();
            for (r, copy) in std::mem::take(&mut ch.early) {
                copy.wait()?;
                covered.push(r);
            }
            covered.sort_by_key(|r| r.start);
            let (base, len) = (ch.range.start, ch.range.len());
            let g = host(cpu, &mut ch.grads);
            let mut at = 0;
            for r in covered.into_iter().chain(std::iter::once(len..len)) {
                if at < r.start {
                    be.download(grads.slice(base + at..base + r.start), &mut g[at..r.start])?;
                }
                at = at.max(r.end);
            }
            Ok(())
        };
        let apply = |ch: &mut HostChunk| {
            ch.opt
                .update(cpu, ch.master.d(), ch.grads.s(), lay, &ch.segs, lr, clip)
        };
        let up = |ch: &HostChunk, out: &mut Option<Dst<'_, B>>| match out {
            Some(o) => {
                let src = cpu.host(ch.master.s()).expect("host memory");
                be.upload(o.rb().slice(ch.range.clone()), src)
            }
            None => Ok(()),
        };
        let mut out = out;
        if !*overlap {
            for ch in chunks.iter_mut() {
                down(ch)?;
                apply(ch)?;
                up(ch, &mut out)?;
            }
            return Ok(());
        }
        // the mover copies down chunk by chunk, and up each chunk the pool
        // has updated, while the pool updates the next
        std::thread::scope(|s| {
            let (to_pool, from_mover) = mpsc::sync_channel::<&mut HostChunk>(1);
            let (to_mover, from_pool) = mpsc::channel::<&mut HostChunk>();
            let mover = s.spawn(move || -> Result<()> {
                for ch in chunks.iter_mut() {
                    down(ch)?;
                    if to_pool.send(ch).is_err() {
                        break;
                    }
                    while let Ok(done) = from_pool.try_recv() {
                        up(done, &mut out)?;
                    }
                }
                drop(to_pool);
                for done in from_pool {
                    up(done, &mut out)?;
                }
                Ok(())
            });
            for ch in from_mover {
                apply(ch)?;
                if to_mover.send(ch).is_err() {
                    break;
                }
            }
            drop(to_mover);
            mover.join().expect("the offload mover does not panic")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::family::Family;
    use crate::model::GptConfig;
    use crate::rng::Rng;

    fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.normal() as f32 * 0.1).collect()
    }

    /// Chunked, overlapped or not, the host update is the device's AdamW
    /// bit for bit: over a replicated buffer and over a shard whose two
    /// runs lie apart in the layout, for several steps, with the
    /// parameters copied back where asked. With overlap, ranges started
    /// early (across chunk edges, at the buffer's end) are taken from those
    /// copies and only the rest from the gradient the update is handed
    /// (NaN where the early copies cover it).
    #[test]
    fn the_chunked_host_update_is_adamw_bit_for_bit() {
        let lay = GptConfig::preset("tiny").unwrap().layout(1);
        let total = lay.total();
        let half = total / 2;
        let shard = [
            Segment {
                global: 7,
                local: 0,
                len: 3001,
            },
            Segment {
                global: total - (half - 3001),
                local: 3001,
                len: half - 3001,
            },
        ];
        let cases: [(&[Segment], usize); 2] = [(&Segment::whole(total), total), (&shard, half)];
        for (segs, len) in cases {
            let mut rng = Rng::new(3);
            let p0 = random(&mut rng, len);
            let grads: Vec<Vec<f32>> = (0..3).map(|_| random(&mut rng, len)).collect();
            let cpu = Cpu::new();
            // the reference: AdamW on one buffer
            let mut opt = AdamW::new(&cpu, len, AdamWConfig::default()).unwrap();
            let mut p = cpu.alloc(len, Category::Params).unwrap();
            cpu.upload(p.d(), &p0).unwrap();
            let mut g = cpu.alloc(len, Category::Grads).unwrap();
            for gs in &grads {
                cpu.upload(g.d(), gs).unwrap();
                opt.update(&cpu, p.d(), g.s(), &lay, segs, 1e-2, 0.5)
                    .unwrap();
            }
            let want = cpu.to_host(p.s()).unwrap();
            for (chunk, overlap) in [(1000, true), (1000, false), (len, true), (777, true)] {
                let what = format!("{len} floats in chunks of {chunk}, overlap {overlap}");
                let mut h = HostState::new(
                    &cpu,
                    &cpu,
                    len,
                    chunk,
                    segs,
                    AdamWConfig::default(),
                    overlap,
                )
                .unwrap();
                h.load_params(&p0);
                // "the device": its gradient and its copy of the parameters
                let mut dev = cpu.alloc(len, Category::Params).unwrap();
                let early = [300..1700, 2500..2600, len - 50..len];
                let mut rest = cpu.alloc(len, Category::Grads).unwrap();
                for gs in &grads {
                    cpu.upload(g.d(), gs).unwrap();
                    let mut poisoned = gs.clone();
                    if overlap {
                        for r in &early {
                            h.download_early(&cpu, r.clone(), g.slice(r.clone()))
                                .unwrap();
                            poisoned[r.clone()].fill(f32::NAN);
                        }
                    }
                    cpu.upload(rest.d(), &poisoned).unwrap();
                    h.update(&cpu, rest.s(), Some(dev.d()), &lay, 1e-2, 0.5)
                        .unwrap();
                }
                assert!(h.params() == want, "{what}: master parameters");
                assert!(cpu.to_host(dev.s()).unwrap() == want, "{what}: device copy");
                let [m, v] = h.moments();
                assert!(m == cpu.to_host(opt.m.s()).unwrap(), "{what}: m");
                assert!(v == cpu.to_host(opt.v.s()).unwrap(), "{what}: v");
            }
        }
    }
}

//! An analytic cost model of a training step: per-rank memory by category
//! and step time (compute at a calibrated efficiency + alpha-beta collective
//! costs + the memory-bound optimizer update) for every strategy and
//! dp x tp mesh, on this CPU or on a datasheet device.
//!
//! Memory follows what distgpt allocates (the same buffers `parallel`
//! builds), priced at the chosen precision, so a prediction for this machine
//! can be checked against `bench` and one for a GPU against the ZeRO paper.

pub mod calibrate;

use crate::model::{ModelConfig, ParamLayout, Span, SpanRun};
use crate::parallel::{
    self, pipeline, Offload, ParallelConfig, Pipeline, Schedule, Sharing, StrategyKind,
};
use serde::Serialize;
use std::ops::Range;

/// Bytes per element of each kind of state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// What distgpt trains in: fp32 params, grads, AdamW m and v (K = 8).
    Fp32,
    /// The ZeRO paper's mixed precision: 16-bit params and grads, fp32
    /// master copy + m + v (K = 12), 16-bit activations.
    Mixed,
}

crate::display_as_flag!(Precision);

impl Precision {
    fn params_bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 4.0,
            Precision::Mixed => 2.0,
        }
    }

    fn grads_bytes(self) -> f64 {
        self.params_bytes()
    }

    /// Optimizer state per parameter (K in the ZeRO paper).
    fn optimizer_bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 8.0,
            Precision::Mixed => 12.0,
        }
    }

    /// Under offload, the host's fp32 master copy per parameter beyond the
    /// optimizer's K: fp32 trains on the master itself (the host's is a
    /// copy), mixed precision counts it in K already.
    fn host_master_bytes(self) -> f64 {
        match self {
            Precision::Fp32 => 4.0,
            Precision::Mixed => 0.0,
        }
    }

    /// Bytes an activation element takes.
    pub fn activation_bytes(self) -> f64 {
        self.params_bytes()
    }

    /// Bytes the AdamW update reads and writes per parameter it owns.
    fn update_traffic_bytes(self) -> f64 {
        // read p, g, m, v (+ master) and write p, m, v (+ master)
        2.0 * self.params_bytes() + self.grads_bytes() + 2.0 * self.optimizer_bytes()
    }
}

/// What one rank computes on.
#[derive(Clone, Debug, Serialize)]
pub struct Device {
    pub name: String,
    /// Peak matmul FLOP/s at the plan's precision, per device.
    pub peak_flops: f64,
    /// Fraction of the peak a training step achieves (model FLOPs).
    pub efficiency: f64,
    pub memory_bytes: f64,
    pub memory_bandwidth: f64,
    /// Thread ranks on one CPU share its peak, bandwidth and memory; a GPU
    /// rank has its device to itself.
    pub shared_by_ranks: bool,
}

impl Device {
    /// Datasheet figures (SXM, dense: no 2:4 sparsity): `fp32` uses the
    /// TF32 tensor cores, `mixed` BF16. The efficiency is the caller's to
    /// state. Sources: NVIDIA's A100 (80 GB SXM), H100 (SXM5), H200 (SXM)
    /// datasheets; B200 from the HGX B200 (1,000 W) datasheet and DGX
    /// B200's 1,440 GB and 64 TB/s over its 8 GPUs.
    pub fn datasheet(name: &str, precision: Precision, efficiency: f64) -> Option<Device> {
        let (fp32, bf16, memory, bw) = match name {
            "a100" => (156e12, 312e12, 80e9, 2.039e12),
            "h100" => (494.7e12, 989.4e12, 80e9, 3.35e12),
            "h200" => (494.7e12, 989.4e12, 141e9, 4.8e12),
            "b200" => (1100e12, 2250e12, 180e9, 8e12),
            _ => return None,
        };
        Some(Device {
            name: name.to_uppercase(),
            peak_flops: match precision {
                Precision::Fp32 => fp32,
                Precision::Mixed => bf16,
            },
            efficiency,
            memory_bytes: memory,
            memory_bandwidth: bw,
            shared_by_ranks: false,
        })
    }
}

/// Links between ranks: alpha (latency, s) and beta (1 / bandwidth, bytes/s per rank).
#[derive(Clone, Debug, Serialize)]
pub struct Network {
    pub ranks_per_node: usize,
    pub intra_bandwidth: f64,
    pub intra_latency_s: f64,
    pub inter_bandwidth: f64,
    pub inter_latency_s: f64,
    /// Under offload: a rank's link to host memory (PCIe), bytes/s each way.
    pub pcie_bandwidth: f64,
    /// Under offload: the host memory bandwidth a rank's AdamW update gets.
    pub host_bandwidth: f64,
    /// Under offload: a node's host memory, which its ranks' host copies
    /// share (infinite where unknown).
    pub host_memory_bytes: f64,
}

impl Network {
    /// NVLink within a node of 8 (each way: half the datasheet's
    /// bidirectional 600, 900, 900 and 1,800 GB/s) and one InfiniBand NIC
    /// per GPU across nodes (200 Gb/s for A100's DGX, 400 Gb/s ConnectX-7
    /// for H100's, H200's and B200's); PCIe 4.0 (A100) or 5.0 x16 to the
    /// host at about 80% of its peak, and a two-socket host's memory
    /// bandwidth and 2 TB (a DGX's) shared by 8 ranks.
    pub fn datasheet(device: &str) -> Option<Network> {
        let (nvlink, ib, pcie) = match device {
            "a100" => (300e9, 25e9, 25e9),
            "h100" | "h200" => (450e9, 50e9, 50e9),
            "b200" => (900e9, 50e9, 50e9),
            _ => return None,
        };
        Some(Network {
            ranks_per_node: 8,
            intra_bandwidth: nvlink,
            intra_latency_s: 5e-6,
            inter_bandwidth: ib,
            inter_latency_s: 10e-6,
            pcie_bandwidth: pcie,
            host_bandwidth: 50e9,
            host_memory_bytes: 2e12,
        })
    }

    /// The host bytes a node holds where each rank holds `per_rank`.
    fn host_bytes_per_node(&self, per_rank: f64, world: usize) -> f64 {
        per_rank * world.min(self.ranks_per_node) as f64
    }

    /// The link a ring over `n` ranks placed `stride` apart runs on, in a
    /// world of `world` ranks filling nodes in order. The groups of a kind
    /// tile the ranks in blocks of `n * stride` (`Grid::rank`'s order), so
    /// every one stays inside a node where the world does or a node holds
    /// whole blocks; otherwise some block straddles two nodes, and its ring
    /// (which the others wait for) crosses the network.
    fn link(&self, n: usize, stride: usize, world: usize) -> Link {
        let (block, node) = (n * stride, self.ranks_per_node);
        let (bandwidth, latency_s) = if world <= node || node % block == 0 {
            (self.intra_bandwidth, self.intra_latency_s)
        } else {
            (self.inter_bandwidth, self.inter_latency_s)
        };
        Link {
            bandwidth,
            latency_s,
        }
    }
}

/// One link of a ring: bytes/s per rank (1 / beta) and seconds a hop (alpha).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    pub bandwidth: f64,
    pub latency_s: f64,
}

/// A ring collective's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// 2(N-1)/N of the buffer per rank, 2(N-1) latency hops.
    AllReduce,
    /// (N-1)/N of the buffer per rank, N-1 hops (all-gather and reduce-scatter).
    Gather,
}

/// Seconds of one ring collective over `n` ranks moving `bytes` (the whole
/// buffer), issued as `calls` equal pieces.
pub fn collective_s(kind: Collective, n: usize, bytes: f64, calls: usize, link: Link) -> f64 {
    if n <= 1 || bytes == 0.0 {
        return 0.0;
    }
    let hops = match kind {
        Collective::AllReduce => 2.0,
        Collective::Gather => 1.0,
    } * (n - 1) as f64;
    hops / n as f64 * bytes / link.bandwidth + hops * link.latency_s * calls as f64
}

/// The training step being planned.
#[derive(Clone, Debug, Serialize)]
pub struct Workload {
    pub model: ModelConfig,
    /// Global batch in sequences per micro-step.
    pub batch: usize,
    pub seq_len: usize,
    pub grad_accum: usize,
    /// On a CPU, the threads its thread ranks share (None for a GPU): a
    /// rank with two or more and without stages or tensor parallelism runs
    /// its batch in parts, a gradient scratch for each part past the first
    /// (`Threads::batch_parts`).
    pub cpu_threads: Option<usize>,
}

/// Per-rank bytes by category, as `bench` reports them.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct MemoryPlan {
    pub params: f64,
    pub grads: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub other: f64,
    /// fsdp's gathered whole units, counted in `params` as `bench` counts them.
    pub gathered: f64,
    /// Under offload, host memory: the fp32 master parameters, the
    /// gradient's staging copy and the moments (none without offload).
    pub host: HostMemory,
}

/// A rank's host bytes under offload, by category.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct HostMemory {
    pub params: f64,
    pub grads: f64,
    pub optimizer: f64,
}

impl HostMemory {
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }
}

impl MemoryPlan {
    pub fn model_states(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }

    /// Model states that persist between steps: what the ZeRO paper counts.
    pub fn persistent_states(&self) -> f64 {
        self.model_states() - self.gathered
    }

    pub fn total(&self) -> f64 {
        self.model_states() + self.activations + self.other
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct TimePlan {
    pub compute_s: f64,
    /// Of `compute_s`, the time a pipeline's mean rank idles in the bubble.
    pub bubble_s: f64,
    /// Of `compute_s`, what the busiest pipeline rank's excess over the
    /// mean rank's work adds (the head's stage, where it is heavier).
    pub uneven_s: f64,
    pub comm_s: f64,
    /// The AdamW update: on the device, or under offload on the host with
    /// the copies to and from it (overlapped: the longer of the two, the
    /// gradient's download less what the backward hides).
    pub optimizer_s: f64,
    /// Bytes each rank sends and receives per step.
    pub comm_bytes: f64,
    /// Bytes each rank copies between device and host per step (offload).
    pub pcie_bytes: f64,
}

impl TimePlan {
    pub fn step_s(&self) -> f64 {
        self.compute_s + self.comm_s + self.optimizer_s
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub parallel: ParallelConfig,
    pub memory: MemoryPlan,
    pub time: TimePlan,
    pub tokens_per_s: f64,
    /// Fits in the device memory (the machine's, shared, for thread ranks)
    /// and, under offload, its host copies in the node's host memory.
    pub fits: bool,
}

/// One rank's bytes by category for `par` (assumed valid), as `parallel`
/// allocates them: under a pipeline, the fullest stage's.
pub fn memory_plan(w: &Workload, par: ParallelConfig, precision: Precision) -> MemoryPlan {
    let par = par.resolved();
    let layout = w.model.layout(par.tp);
    let stages = par.pipeline.partition(&layout);
    fullest_stage(w, par, precision, &layout, &stages)
}

/// The [`stage_memory`] of the stage that needs the most.
fn fullest_stage(
    w: &Workload,
    par: ParallelConfig,
    precision: Precision,
    layout: &ParamLayout,
    stages: &[Range<usize>],
) -> MemoryPlan {
    let live = pipeline::in_flight(par.pipeline, w.grad_accum);
    (0..par.pipeline.stages.max(1))
        .map(|s| stage_memory(w, par, precision, layout, stages, s, &live[s]))
        .max_by(|a, b| a.total().total_cmp(&b.total()))
        .expect("at least one stage")
}

/// The bytes of a rank of pipeline stage `s`: its units' parameters,
/// gradients and moments (with a tied tensor's unit copied), shared over
/// the stage's replicas as its strategy shares them, and the activations
/// of the micro-batches its schedule keeps in flight, each sized for the
/// stage's units as the engine allocates them.
pub fn stage_memory_plan(
    w: &Workload,
    par: ParallelConfig,
    precision: Precision,
    s: usize,
) -> MemoryPlan {
    let par = par.resolved();
    let layout = w.model.layout(par.tp);
    let stages = par.pipeline.partition(&layout);
    let live = pipeline::in_flight(par.pipeline, w.grad_accum);
    stage_memory(w, par, precision, &layout, &stages, s, &live[s])
}

/// [`stage_memory_plan`] for a resolved layout whose units, stages and
/// micro-batches in flight (`live`, a count for each of stage `s`'s
/// chunks) are worked out already, once for all its stages.
fn stage_memory(
    w: &Workload,
    par: ParallelConfig,
    precision: Precision,
    layout: &ParamLayout,
    stages: &[Range<usize>],
    s: usize,
    live: &[usize],
) -> MemoryPlan {
    let pipe = par.pipeline;
    let m = &w.model;
    let rows = (w.batch / par.dp(), w.seq_len);
    // each chunk's state, scratch and activation sets, summed; the update's
    // shard scratch is the largest chunk's (the rank's chunks share it)
    let (mut z, mut transient) = (parallel::StageSizes::default(), 0);
    let mut acts = 0.0;
    for (c, &live) in live.iter().enumerate() {
        let vs = c * pipe.stages + s;
        let zc = parallel::stage_sizes(layout, stages, vs, par.dp());
        z += zc;
        transient = transient.max(zc.shard);
        let run = SpanRun {
            span: Span::of_units(stages[vs].clone(), m.n_layer()),
            recompute: par.recompute,
            split: pipe.schedule == Schedule::ZbH1,
            in_flight: live,
            precision: par.precision,
        };
        acts += m.activation_elems(par.tp, rows.0, rows.1, &run) as f64;
    }
    let (pb, gb) = (precision.params_bytes(), precision.grads_bytes());
    let ob = precision.optimizer_bytes();
    let (len, shard) = (z.len as f64, z.shard as f64);
    let mut mem = MemoryPlan {
        activations: acts * precision.activation_bytes(),
        ..MemoryPlan::default()
    };
    // as `parallel::stage` allocates: a padded piece's gradient scratch, the
    // reduce-scatter's output, and zero1/zero2's update scratch (a shard)
    let scratch = gb * (z.max_padded + z.max_shard) as f64;
    // the weights' bf16 copy beside the fp32 buffers the units read
    let (sharing, copy) = (par.strategy.sharing(), bf16_copy(&par, precision, &z));
    match sharing {
        Sharing::Replicated => {
            (mem.params, mem.grads, mem.optimizer) = (pb * len + copy, gb * len, ob * len);
        }
        Sharing::Zero1 => {
            // the gradient reduced into this rank's slice of the whole one,
            // copied out with the parameters' slice for the update
            (mem.params, mem.grads, mem.optimizer) = (pb * len + copy, gb * len, ob * shard);
            mem.other = scratch + (pb + gb) * transient as f64;
        }
        Sharing::Zero2 => {
            (mem.params, mem.grads, mem.optimizer) = (pb * len + copy, gb * shard, ob * shard);
            mem.other = scratch + gb * z.head_padded as f64 + pb * transient as f64;
        }
        Sharing::Fsdp => {
            mem.gathered = pb * z.gathered as f64 + copy;
            (mem.params, mem.grads, mem.optimizer) =
                (pb * shard + mem.gathered, gb * shard, ob * shard);
            mem.other = scratch + gb * z.head_padded as f64;
        }
    }
    // a batch in parts: each part past the first sums a unit's gradient
    // (its tied tensor's included) into scratch of the widest unit's size
    let parts = w.cpu_threads.map_or(1, |threads| {
        let rank_threads = crate::parallel::launch::rank_threads(threads, par.world_size);
        par.batch_parts(m, rows.0, rows.1, |rows, t, params| {
            crate::backend::threads::pool_batch_parts(rank_threads, rows, t, params)
        })
    });
    mem.grads += gb * ((parts - 1) * layout.widest_unit_grad()) as f64;
    if !par.offload.is_none() {
        // the moments move to the host beside an fp32 master copy of what
        // the rank updates (in the optimizer's K under mixed precision) and
        // a staging copy of its reduced gradient
        let owned = if sharing.sharded() { shard } else { len };
        mem.host = HostMemory {
            params: precision.host_master_bytes() * owned,
            grads: 4.0 * owned,
            optimizer: mem.optimizer,
        };
        mem.optimizer = 0.0;
        if par.offload == Offload::Params {
            // fsdp's shard is the host's master copy: the device gathers from it
            mem.params = mem.gathered;
        }
    }
    mem
}

/// Bytes of the weights' bf16 copy a stage of sizes `z` keeps under
/// `--precision bf16` (beside distgpt's fp32 states): one beside each fp32
/// buffer the units read, the whole stage's or fsdp's gather buffers.
fn bf16_copy(par: &ParallelConfig, precision: Precision, z: &parallel::StageSizes) -> f64 {
    let read = match par.strategy.sharing() {
        Sharing::Fsdp => z.gathered,
        _ => z.len,
    };
    let kept = par.precision == crate::model::Precision::Bf16 && precision == Precision::Fp32;
    if kept {
        2.0 * read as f64
    } else {
        0.0
    }
}

/// What a rank's update moves: the parameters it owns, in `precision`,
/// and the micro-batches a step (each gathers again under `--offload
/// params`).
struct Update {
    owned: f64,
    precision: Precision,
    micro_batches: f64,
}

/// The update's seconds outside the step's compute (`compute_s`), and the
/// bytes it moves over PCIe, on the device or offloaded as `par` says;
/// `share` ranks share the device's bandwidth.
fn update_cost(
    par: &ParallelConfig,
    u: Update,
    device: &Device,
    net: &Network,
    share: f64,
    compute_s: f64,
) -> (f64, f64) {
    let pb = u.precision.params_bytes();
    match par.offload {
        Offload::None => (
            u.owned * u.precision.update_traffic_bytes() / (device.memory_bandwidth / share),
            0.0,
        ),
        offload => {
            // the gradient down and the parameters up, or under --offload
            // params the shard up for each of fsdp's gathers (a forward
            // and a backward per micro-batch), outside the update
            let down = u.owned * u.precision.grads_bytes();
            let (up, gathers) = match offload {
                Offload::Params => (0.0, u.micro_batches * 2.0 * u.owned * pb),
                _ => (u.owned * pb, 0.0),
            };
            // overlapped, the gradient starts down during the backward
            // (two thirds of the compute) where it is final there: zero2
            // and fsdp after each reduce-scatter, one replica's after its
            // last micro-batch; only what outlasts the backward is left
            // for the update. zero1 and an all-reduced replica's cross
            // after the step's collectives, beside the update.
            let early =
                !par.offload_serial && par.strategy.sharing().grads_final_in_backward(par.dp());
            let down_s = down / net.pcie_bandwidth;
            let down_left = match early {
                true => (down_s - compute_s * 2.0 / 3.0).max(0.0),
                false => down_s,
            };
            let copies = down_left + up / net.pcie_bandwidth;
            let update = u.owned * u.precision.update_traffic_bytes() / net.host_bandwidth;
            let overlapped = match par.offload_serial {
                true => copies + update,
                false => copies.max(update),
            };
            (
                overlapped + gathers / net.pcie_bandwidth,
                down + up + gathers,
            )
        }
    }
}

/// Predicts one rank's memory and step time for `par` (assumed valid):
/// the fullest stage's bytes, and a step as its compute (stretched by the
/// pipeline's bubble), the busiest rank's communication and the update.
pub fn predict(
    w: &Workload,
    par: ParallelConfig,
    device: &Device,
    net: &Network,
    precision: Precision,
) -> Prediction {
    let par = par.resolved();
    let layout = w.model.layout(par.tp);
    let stages = par.pipeline.partition(&layout);
    let mem = fullest_stage(w, par, precision, &layout, &stages);
    // ranks on one device (a CPU's thread ranks) share its peak, its
    // bandwidth and its memory
    let share = if device.shared_by_ranks {
        par.world_size as f64
    } else {
        1.0
    };
    let (compute_s, bubble_s, uneven_s) = compute_s(w, &par, device, share, &stages);
    let sizes = rank_sizes(&par, &layout, &stages);
    let comm = CommCost::new(w, &par, net, precision, &layout, &stages).busiest_rank(&sizes);
    // the update of the rank that owns the most
    let largest = sizes
        .iter()
        .max_by_key(|z| z.len)
        .copied()
        .unwrap_or_default();
    let owned = if par.strategy.sharing().sharded() {
        largest.shard as f64
    } else {
        largest.len as f64
    };
    let (optimizer_s, pcie_bytes) = update_cost(
        &par,
        Update {
            owned,
            precision,
            micro_batches: w.grad_accum as f64,
        },
        device,
        net,
        share,
        compute_s,
    );
    let time = TimePlan {
        compute_s,
        bubble_s,
        uneven_s,
        comm_s: comm.s,
        optimizer_s,
        comm_bytes: comm.bytes,
        pcie_bytes,
    };
    let tokens_per_s = w.batch as f64 * w.seq_len as f64 * w.grad_accum as f64 / time.step_s();
    let host = net.host_bytes_per_node(mem.host.total(), par.world_size);
    Prediction {
        parallel: par,
        fits: mem.total() * share <= device.memory_bytes && host <= net.host_memory_bytes,
        memory: mem,
        time,
        tokens_per_s,
    }
}

/// Seconds of a rank's compute a step on a device whose peak `share`
/// ranks share: the blocks split over tp, the head not, stretched by the
/// pipeline's bubble; a pipeline's ranks as the partition loads them
/// (`stages`: the units of each virtual stage), the busiest setting the
/// pace. With the seconds of it the mean rank idles in the bubble, and
/// those the busiest rank's excess over the mean adds.
fn compute_s(
    w: &Workload,
    par: &ParallelConfig,
    device: &Device,
    share: f64,
    stages: &[Range<usize>],
) -> (f64, f64, f64) {
    let m = &w.model;
    let pipe = par.pipeline;
    let rows = (w.batch / par.dp() * w.seq_len) as f64;
    let head = m.unsplit_flops_per_token(w.seq_len);
    let blocks = m.flops_per_token(w.seq_len) - head;
    // --recompute runs each block's forward again, and a head's that
    // keeps its logits in chunks, all but the last chunk's
    let (blocks_again, head_again) = match par.recompute {
        true => (
            blocks / 3.0,
            head / 3.0 * m.recomputed_unsplit_share(rows as usize),
        ),
        false => (0.0, 0.0),
    };
    let a_block = (blocks + blocks_again) / par.tp as f64 / m.n_layer() as f64;
    let head = head + head_again;
    // a pipeline rank's work a token: its chunks' blocks, and the head on
    // the rank of the last (units: the embeddings, the blocks, the head)
    let last = stages.last().map_or(0, |r| r.end - 1);
    let ranks: Vec<f64> = (0..pipe.stages)
        .map(|s| {
            rank_units(stages, pipe.stages, s)
                .map(|u| match u {
                    0 => 0.0,
                    u if u == last => head,
                    _ => a_block,
                })
                .sum()
        })
        .collect();
    let most = ranks.iter().copied().fold(0.0, f64::max);
    let mean = ranks.iter().sum::<f64>() / pipe.stages as f64;
    // the mean rank's m micro-batches idle in the bubble, (m + p - 1)
    // slots where the ranks are alike (a v-th of the p - 1 interleaved,
    // zb-h1's weight halves filling some); the busiest rank's excess over
    // the mean lengthens each slot after the first micro-batch's: gpipe's
    // and 1f1b's step is then all the ranks' work and m - 1 of the busiest
    let micro = w.grad_accum as f64;
    let slots = micro / (1.0 - pipe.bubble(w.grad_accum));
    let flops = rows * (slots * mean + (micro - 1.0) * (most - mean));
    let rate = device.peak_flops / share * device.efficiency;
    (
        flops / rate,
        rows * (slots - micro) * mean / rate,
        rows * (micro - 1.0) * (most - mean) / rate,
    )
}

/// Pipeline rank `s`'s units (of `pp` ranks): its chunks', virtual stages
/// s, s + pp, ...
fn rank_units(stages: &[Range<usize>], pp: usize, s: usize) -> impl Iterator<Item = usize> + '_ {
    stages.iter().skip(s).step_by(pp).flat_map(Clone::clone)
}

/// Each pipeline rank's state sizes: a rank reduces and updates its own
/// chunks' units.
fn rank_sizes(
    par: &ParallelConfig,
    layout: &ParamLayout,
    stages: &[Range<usize>],
) -> Vec<parallel::StageSizes> {
    let (pp, v) = (par.pipeline.stages, par.pipeline.virtual_stages);
    (0..pp)
        .map(|s| {
            let mut z = parallel::StageSizes::default();
            for c in 0..v {
                z += parallel::stage_sizes(layout, stages, c * pp + s, par.dp());
            }
            z
        })
        .collect()
}

/// Seconds and bytes a rank communicates a step.
#[derive(Clone, Copy, Debug, Default)]
struct Traffic {
    s: f64,
    bytes: f64,
}

impl std::ops::AddAssign for Traffic {
    fn add_assign(&mut self, other: Traffic) {
        self.s += other.s;
        self.bytes += other.bytes;
    }
}

/// A step's communication as the stages issue it, each group's ring
/// placed as the grid lays its ranks out.
struct CommCost<'a> {
    w: &'a Workload,
    par: &'a ParallelConfig,
    net: &'a Network,
    precision: Precision,
    layout: &'a ParamLayout,
    stages: &'a [Range<usize>],
    strides: parallel::grid::Coords,
    /// Under fsdp, each stage's schedule (its gathers follow it).
    tasks: Vec<Vec<pipeline::Task>>,
    /// The elements of the unit a tied tensor lives in (GPT-2's and
    /// BERT's word embedding, read again by the head).
    tied_len: f64,
    /// Bytes of a micro-batch's (rows, C) activation stream.
    stream: f64,
}

impl<'a> CommCost<'a> {
    fn new(
        w: &'a Workload,
        par: &'a ParallelConfig,
        net: &'a Network,
        precision: Precision,
        layout: &'a ParamLayout,
        stages: &'a [Range<usize>],
    ) -> Self {
        let rows = (w.batch / par.dp() * w.seq_len) as f64;
        let tied_len = layout
            .units
            .iter()
            .find_map(|u| u.tied.as_ref())
            .map_or(0, |t| layout.units[t.unit].range.len()) as f64;
        CommCost {
            w,
            par,
            net,
            precision,
            layout,
            stages,
            strides: parallel::Grid::of(par).strides(),
            tasks: match par.strategy.sharing() {
                Sharing::Fsdp => parallel::pipeline::ranks_tasks(par.pipeline, w.grad_accum),
                _ => Vec::new(),
            },
            tied_len,
            stream: rows * w.model.n_embd() as f64 * precision.activation_bytes(),
        }
    }

    /// The busiest rank's traffic (each of its seconds and bytes the
    /// largest of any stage's): its replicas' collectives, its sends to
    /// the stages beside it, and the blocks' tensor-parallel all-reduces.
    fn busiest_rank(&self, sizes: &[parallel::StageSizes]) -> Traffic {
        let pp = self.par.pipeline.stages;
        (0..pp)
            .map(|s| {
                let mut t = self.data_parallel(s, &sizes[s]);
                if pp > 1 {
                    t += self.pipeline(s);
                }
                // (nothing at tp 1: a group of one)
                t += self.tensor_parallel(s);
                t
            })
            .fold(Traffic::default(), |a, b| Traffic {
                s: f64::max(a.s, b.s),
                bytes: f64::max(a.bytes, b.bytes),
            })
    }

    /// Stage `s`'s collectives over its `dp` replicas, for its state `z`.
    fn data_parallel(&self, s: usize, z: &parallel::StageSizes) -> Traffic {
        let (w, par) = (self.w, self.par);
        let (pipe, dp) = (par.pipeline, par.dp());
        let (pb, gb) = (self.precision.params_bytes(), self.precision.grads_bytes());
        let acc = w.grad_accum as f64;
        // a replicated stage all-reduces its gradient in one call a chunk; a
        // sharded one reduces and gathers unit by unit
        let sharing = par.strategy.sharing();
        let calls = if sharing.sharded() {
            self.layout.units.len().div_ceil(pipe.stages)
        } else {
            pipe.virtual_stages
        };
        let link = self.net.link(dp, self.strides.dp, self.par.world_size);
        let ar =
            |bytes: f64, calls: usize| collective_s(Collective::AllReduce, dp, bytes, calls, link);
        let ga =
            |bytes: f64, calls: usize| collective_s(Collective::Gather, dp, bytes, calls, link);
        let dpf = (dp as f64 - 1.0) / dp as f64;
        // without a pipeline one rank holds the tied unit and the head, and
        // the head's backward reduces it with its share under zero2 and
        // fsdp, a second time each micro-batch
        let tied_again = if pipe.stages == 1 {
            gb * self.tied_len
        } else {
            0.0
        };
        let g_bytes = gb * z.len as f64;
        let p_bytes = pb * z.len as f64;
        let (s, bytes) = match sharing {
            Sharing::Replicated => (ar(g_bytes, calls), 2.0 * dpf * g_bytes),
            Sharing::Zero1 => (
                ga(g_bytes, calls) + ga(p_bytes, calls),
                dpf * (g_bytes + p_bytes),
            ),
            Sharing::Zero2 => (
                acc * ga(g_bytes + tied_again, calls + 1) + ga(p_bytes, calls),
                dpf * (acc * (g_bytes + tied_again) + p_bytes),
            ),
            Sharing::Fsdp => {
                let elems =
                    parallel::fsdp_gathered(self.layout, self.stages, pipe, s, dp, &self.tasks[s]);
                let gathered = pb * elems as f64;
                (
                    ga(gathered, 2 * calls * w.grad_accum)
                        + acc * ga(g_bytes + tied_again, calls + 1),
                    dpf * (gathered + acc * (g_bytes + tied_again)),
                )
            }
        };
        Traffic { s, bytes }
    }

    /// Stage `s`'s sends across its stage boundaries: each micro-batch's
    /// activation forward and gradient backward, once per chunk when
    /// interleaved: a rank sends both ways from each chunk but the first
    /// stage's (backward) and the last's (forward). The ranks holding
    /// those two also sum the tied unit's gradient (each its shard of it
    /// where the gradient is sharded).
    fn pipeline(&self, s: usize) -> Traffic {
        let par = self.par;
        let (pp, v, dp) = (par.pipeline.stages, par.pipeline.virtual_stages, par.dp());
        let acc = self.w.grad_accum as f64;
        let gb = self.precision.grads_bytes();
        let link = self.net.link(pp, self.strides.stage, par.world_size);
        let p2p =
            |chunks: usize| acc * chunks as f64 * (self.stream / link.bandwidth + link.latency_s);
        let shards = if par.strategy.sharing().sharded() {
            dp as f64
        } else {
            1.0
        };
        let tie = gb * self.tied_len / shards;
        // the first and the last stage: two ends of one pipeline's block
        let tie_link = link;
        let (s, bytes) = match s == 0 || s == pp - 1 {
            true => (
                p2p(2 * v - 1) + collective_s(Collective::AllReduce, 2, tie, 1, tie_link),
                acc * (2 * v - 1) as f64 * self.stream + tie,
            ),
            false => (p2p(2 * v), acc * (2 * v) as f64 * self.stream),
        };
        Traffic { s, bytes }
    }

    /// Megatron's f/g: two all-reduces of the (rows, C) stream per layer
    /// forward, two backward, two more when the forward is recomputed, for
    /// the blocks of pipeline rank `s`'s chunks (the partition's: a stage
    /// beside the head's holds fewer); a classifier's last block makes some
    /// on one row a sequence.
    fn tensor_parallel(&self, s: usize) -> Traffic {
        let (w, par, m) = (self.w, self.par, &self.w.model);
        let (tp, acc, stream) = (par.tp, w.grad_accum as f64, self.stream);
        let per_layer = if par.recompute { 6 } else { 4 };
        // units: the embeddings, the blocks, the head
        let (pp, head) = (par.pipeline.stages, self.layout.units.len() - 1);
        let units = || rank_units(self.stages, pp, s);
        let n = per_layer * units().filter(|&u| u != 0 && u != head).count();
        // the last block lies with the head (every chunk holds a block)
        let last_block = units().any(|u| u == head);
        let one_row = match last_block {
            true => m.last_block_one_row_reduces(par.recompute) as f64,
            false => 0.0,
        };
        let bytes = n as f64 * stream - one_row * stream * (1.0 - 1.0 / w.seq_len as f64);
        let link = self.net.link(tp, self.strides.tp, par.world_size);
        Traffic {
            s: acc * collective_s(Collective::AllReduce, tp, bytes, n, link),
            bytes: acc * 2.0 * (tp as f64 - 1.0) / tp as f64 * bytes,
        }
    }
}

/// The divisors of `n`, ascending: 2,520's 48, 131,072's 18.
fn divisors(n: usize) -> Vec<usize> {
    let small: Vec<usize> = (1..)
        .take_while(|d| d * d <= n)
        .filter(|d| n.is_multiple_of(*d))
        .collect();
    let large = small.iter().rev().map(|d| n / d).filter(|&q| q * q != n);
    small.iter().copied().chain(large).collect()
}

/// Every layout distgpt knows on `world` ranks, valid or not: single
/// (world 1); ddp, zero1, zero2, fsdp and tp over the whole world; then
/// every grid of tp and pp degrees that divide the world: each data-parallel
/// strategy over the remaining replicas (at least two), or tp alone, or a
/// pipeline alone; each pipeline as 1f1b, interleaved with two chunks a
/// rank and zb-h1.
fn candidates(world: usize, recompute: bool) -> Vec<ParallelConfig> {
    use StrategyKind::*;
    let with = |strategy, tp, pipeline| ParallelConfig {
        strategy,
        world_size: world,
        tp,
        recompute,
        pipeline,
        ..ParallelConfig::single()
    };
    let mk =
        |strategy, tp, stages| with(strategy, tp, Pipeline::new(stages, Default::default(), 1));
    if world == 1 {
        return vec![mk(Single, 1, 1)];
    }
    let mut out: Vec<ParallelConfig> = [Ddp, Zero1, Zero2, Fsdp].map(|s| mk(s, 1, 1)).to_vec();
    out.push(mk(Tp, world, 1));
    for pp in divisors(world) {
        for tp in divisors(world / pp) {
            let dp = world / (pp * tp);
            match dp {
                1 if tp == 1 => out.push(mk(Ddp, 1, pp)),
                1 if (tp, pp) != (world, 1) => out.push(mk(Tp, tp, pp)),
                1 => {}
                _ if (tp, pp) == (1, 1) => {}
                _ => out.extend([Ddp, Zero1, Zero2, Fsdp].map(|s| mk(s, tp, pp))),
            }
        }
    }
    let others: Vec<ParallelConfig> = out
        .iter()
        .filter(|p| p.pipeline.stages > 1)
        .flat_map(|p| {
            [(Schedule::Interleaved, 2), (Schedule::ZbH1, 1)].map(|(schedule, v)| ParallelConfig {
                pipeline: Pipeline::new(p.pipeline.stages, schedule, v),
                ..*p
            })
        })
        .collect();
    out.extend(others);
    out
}

/// `par` with each offload that applies to it: the optimizer, and under
/// fsdp the parameter shards too.
pub fn offloaded(par: &ParallelConfig) -> Vec<ParallelConfig> {
    let mut out = vec![ParallelConfig {
        offload: Offload::Optimizer,
        ..*par
    }];
    if par.strategy == StrategyKind::Fsdp {
        out.push(ParallelConfig {
            offload: Offload::Params,
            ..*par
        });
    }
    out
}

/// Every valid layout on `world` ranks (see [`omitted`] for the others).
pub fn layouts(w: &Workload, world: usize, recompute: bool) -> Vec<ParallelConfig> {
    let mut out = candidates(world, recompute);
    out.retain(|p| valid(w, p).is_ok());
    out
}

/// Whether a layout can run the workload: its degrees, and its pipeline's
/// micro-batches.
fn valid(w: &Workload, p: &ParallelConfig) -> crate::error::Result<()> {
    p.validate(&w.model, w.batch)?;
    p.pipeline.check_micro_batches(w.grad_accum)
}

/// Layouts left out of [`layouts`] for one reason.
#[derive(Clone, Debug, Serialize)]
pub struct Omitted {
    /// What kind of reason, in a few words: "tp does not divide the heads".
    pub kind: &'static str,
    pub reason: String,
    pub layouts: Vec<String>,
}

impl std::fmt::Display for Omitted {
    /// "tp x2, ddp x4 (tp 2) omitted: 25 heads are not divisible by 2".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} omitted: {}", self.layouts.join(", "), self.reason)
    }
}

/// The layouts on `world` ranks left out of [`layouts`], by reason.
pub fn omitted(w: &Workload, world: usize) -> Vec<Omitted> {
    let (m, batch) = (&w.model, w.batch);
    let mut by_reason: Vec<Omitted> = Vec::new();
    for p in candidates(world, false) {
        if valid(w, &p).is_ok() {
            continue;
        }
        let (kind, reason) = if !m.n_head().is_multiple_of(p.tp) {
            (
                "tp does not divide the heads",
                format!("{} heads are not divisible by {}", m.n_head(), p.tp),
            )
        } else if p.pipeline.stages > m.n_layer() {
            (
                "more stages than blocks",
                format!(
                    "{} blocks cannot fill {} stages",
                    m.n_layer(),
                    p.pipeline.stages
                ),
            )
        } else if p.pipeline.stages * p.pipeline.virtual_stages > m.n_layer() {
            (
                "more chunks than blocks",
                format!(
                    "{} blocks cannot fill {} chunks",
                    m.n_layer(),
                    p.pipeline.stages * p.pipeline.virtual_stages
                ),
            )
        } else if !batch.is_multiple_of(p.dp()) {
            (
                "dp does not divide the batch",
                format!(
                    "the batch of {batch} is not divisible by the data-parallel size {}",
                    p.dp()
                ),
            )
        } else {
            let why = match valid(w, &p) {
                Err(crate::error::Error::Config(why)) => why,
                other => other.err().map(|e| e.to_string()).unwrap_or_default(),
            };
            let kind = if p.pipeline.check_micro_batches(w.grad_accum).is_err() {
                "interleaving needs a multiple of pp micro-batches"
            } else if p.pipeline.schedule == Schedule::ZbH1 && !m.splits_backward() {
                "the engine cannot split its backward for zb-h1"
            } else {
                "other"
            };
            (kind, why)
        };
        let name = p.layout_name();
        match by_reason.iter_mut().find(|o| o.reason == reason) {
            Some(o) => o.layouts.push(name),
            None => by_reason.push(Omitted {
                kind,
                reason,
                layouts: vec![name],
            }),
        }
    }
    by_reason
}

/// Every layout priced on one world size.
#[derive(Clone, Debug, Serialize)]
pub struct WorldPlan {
    pub world_size: usize,
    /// The fraction of the device's peak a step was priced at.
    pub efficiency: f64,
    /// Every valid layout, on the device alone.
    pub predictions: Vec<Prediction>,
    /// Each of them with the optimizer (and fsdp's shards) offloaded to the
    /// host: priced for devices with a host of their own (not thread ranks).
    pub offloaded: Vec<Prediction>,
    pub omitted: Vec<Omitted>,
}

/// Prices every layout of `world` ranks (with recomputation too, if asked).
pub fn plan_world(
    w: &Workload,
    world: usize,
    device: &Device,
    net: &Network,
    precision: Precision,
    recompute: bool,
) -> WorldPlan {
    use rayon::prelude::*;
    // each layout priced on its own, on every thread
    let price = |pars: Vec<ParallelConfig>| -> Vec<Prediction> {
        pars.into_par_iter()
            .map(|par| predict(w, par, device, net, precision))
            .collect()
    };
    let recomputes = [false, true].into_iter().filter(|&rc| recompute || !rc);
    let predictions = price(recomputes.flat_map(|rc| layouts(w, world, rc)).collect());
    let offloaded = match device.shared_by_ranks {
        true => Vec::new(),
        false => price(
            predictions
                .iter()
                .flat_map(|p| offloaded(&p.parallel))
                .collect(),
        ),
    };
    WorldPlan {
        world_size: world,
        efficiency: device.efficiency,
        predictions,
        offloaded,
        omitted: omitted(w, world),
    }
}

crate::named_enum! {
    /// The layouts a person compares: data parallelism alone (ddp, ZeRO,
    /// fsdp), with tensor parallelism, with a pipeline, with both, and any of
    /// them with offload.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
    #[serde(rename_all = "kebab-case")]
    pub enum LayoutFamily {
        DataParallel = "ddp / zero / fsdp",
        TensorParallel = "+ tensor parallel",
        Pipeline = "+ pipeline",
        TensorAndPipeline = "+ tp + pipeline",
        Offload = "+ offload",
    }
    /// As `plan` prints it.
    fn name
}

impl LayoutFamily {
    pub fn of(p: &ParallelConfig) -> LayoutFamily {
        let r = p.resolved();
        match (r.offload.is_none(), r.tp > 1, r.pipeline.stages > 1) {
            (false, _, _) => LayoutFamily::Offload,
            (true, false, false) => LayoutFamily::DataParallel,
            (true, true, false) => LayoutFamily::TensorParallel,
            (true, false, true) => LayoutFamily::Pipeline,
            (true, true, true) => LayoutFamily::TensorAndPipeline,
        }
    }
}

/// A family's best layout and why it is not the recommendation.
#[derive(Clone, Debug, Serialize)]
pub struct FamilyBest {
    pub family: LayoutFamily,
    /// The fastest that fits, or where none does the one nearest to fitting.
    pub best: Prediction,
    /// "recommended", or what loses it the recommendation: the memory it
    /// needs, or the part of its step (bubble, communication, compute,
    /// optimizer) that makes it slower.
    pub why: String,
}

impl WorldPlan {
    /// The fastest layout that fits, offloaded or not.
    pub fn recommended(&self) -> Option<&Prediction> {
        recommend(self.predictions.iter().chain(&self.offloaded))
    }

    /// Each family's best layout, in [`LayoutFamily::ALL`]'s order (those
    /// with no valid layout left out).
    pub fn families(&self, w: &Workload, device: &Device, net: &Network) -> Vec<FamilyBest> {
        let rec = self.recommended();
        let all = || self.predictions.iter().chain(&self.offloaded);
        LayoutFamily::ALL
            .into_iter()
            .filter_map(|family| {
                let members = || all().filter(|p| LayoutFamily::of(&p.parallel) == family);
                let best = members()
                    .filter(|p| p.fits)
                    .min_by(|a, b| a.time.step_s().total_cmp(&b.time.step_s()))
                    .or_else(|| {
                        members().min_by(|a, b| a.memory.total().total_cmp(&b.memory.total()))
                    })?;
                let why = match rec {
                    Some(r) if std::ptr::eq(r, best) => "recommended".to_string(),
                    _ => why_not(w, device, net, best, rec),
                };
                Some(FamilyBest {
                    family,
                    best: best.clone(),
                    why,
                })
            })
            .collect()
    }
}

/// Bytes in GB, or MB below one GB.
pub fn bytes(b: f64) -> String {
    match b {
        b if b >= 1e9 => format!("{:.1} GB", b / 1e9),
        b => format!("{:.1} MB", b / 1e6),
    }
}

/// Why `p` is not the recommendation `rec`: the memory it lacks, or the
/// part of its step that grows most against `rec`'s.
fn why_not(
    w: &Workload,
    device: &Device,
    net: &Network,
    p: &Prediction,
    rec: Option<&Prediction>,
) -> String {
    let gb = |b: f64| b / 1e9;
    let host = net.host_bytes_per_node(p.memory.host.total(), p.parallel.world_size);
    if host > net.host_memory_bytes {
        return format!(
            "its host copies do not fit: {:.0} GB a node of {:.0} GB",
            gb(host),
            gb(net.host_memory_bytes)
        );
    }
    if !p.fits {
        return match device.shared_by_ranks {
            true => format!(
                "does not fit: {} ranks share {:.0} GB",
                p.parallel.world_size,
                gb(device.memory_bytes)
            ),
            false => format!("does not fit in {:.0} GB", gb(device.memory_bytes)),
        };
    }
    let Some(r) = rec else {
        return String::new();
    };
    let (a, b) = (&p.time, &r.time);
    let slower = 100.0 * (a.step_s() / b.step_s() - 1.0);
    let parts = [
        ("compute", a.compute_s - b.compute_s),
        ("comm", a.comm_s - b.comm_s),
        ("optimizer", a.optimizer_s - b.optimizer_s),
    ];
    let (part, _) = parts
        .into_iter()
        .max_by(|x, y| x.1.total_cmp(&y.1))
        .expect("three parts");
    let pipe = p.parallel.resolved().pipeline;
    // the compute beyond the recommendation's that is neither bubble nor
    // uneven stages (recomputation, an unsplit head)
    let rest = a.compute_s - a.bubble_s - a.uneven_s - b.compute_s;
    let reason = match part {
        // of the compute a pipeline adds, the larger: the bubble, or the
        // busiest stage's excess (GPT-2's LM head on the last stage at 256
        // micro-batches, whose bubble is 0%), unless the rest is larger still
        "compute" if pipe.stages > 1 && a.bubble_s >= a.uneven_s.max(rest) => format!(
            "the pipeline's bubble: {:.0}% of the step idle",
            100.0 * pipe.bubble(w.grad_accum)
        ),
        "compute" if pipe.stages > 1 && a.uneven_s >= rest => {
            "its busiest stage: the stages' compute is uneven".to_string()
        }
        "compute" if p.parallel.recompute && !r.parallel.recompute => {
            "recomputing the forward: a third more compute".to_string()
        }
        "compute" => "more compute a rank".to_string(),
        "comm" => format!(
            "communication: {} a rank a step, {}",
            bytes(a.comm_bytes),
            match a.comm_s {
                t if t >= 1.0 => format!("{t:.1} s"),
                t if t >= 1e-3 => format!("{:.0} ms", t * 1e3),
                t => format!("{:.0} us", t * 1e6),
            }
        ),
        _ if !p.parallel.offload.is_none() => format!(
            "the host's update and {} a step over PCIe",
            bytes(a.pcie_bytes)
        ),
        _ => "the optimizer's update".to_string(),
    };
    match slower {
        s if s < 10.0 => format!("{s:.1}% slower: {reason}"),
        s => format!("{s:.0}% slower: {reason}"),
    }
}

/// Step time against memory a rank for every layout of `wp` that fits, a
/// series a family and the recommendation marked:
/// `dir/plan-world-N.png` and `.svg` (nothing where nothing fits).
pub fn plot(
    dir: &std::path::Path,
    w: &Workload,
    wp: &WorldPlan,
) -> crate::error::Result<Vec<std::path::PathBuf>> {
    let Some(fig) = figure_of(w, wp) else {
        return Ok(Vec::new());
    };
    std::fs::create_dir_all(dir).map_err(|e| crate::error::Error::io(dir, e))?;
    crate::figure::write(dir, &fig)
}

/// [`plot`]'s figure: a series a family of the layouts that fit (GB a
/// rank, step time in seconds where a step takes ten or more, else
/// milliseconds), the recommendation last; none where nothing fits.
fn figure_of(w: &Workload, wp: &WorldPlan) -> Option<crate::figure::Figure> {
    use crate::figure::{Figure, Series};
    let r = wp.recommended()?;
    let slowest = (wp.predictions.iter().chain(&wp.offloaded))
        .filter(|p| p.fits)
        .map(|p| p.time.step_s())
        .fold(0.0, f64::max);
    let (unit, scale) = if slowest >= 10.0 {
        ("s", 1.0)
    } else {
        ("ms", 1e3)
    };
    let point = |p: &Prediction| (p.memory.total() / 1e9, p.time.step_s() * scale);
    let mut series: Vec<Series> = LayoutFamily::ALL
        .into_iter()
        .filter_map(|family| {
            let points: Vec<(f64, f64)> = (wp.predictions.iter().chain(&wp.offloaded))
                .filter(|p| p.fits && LayoutFamily::of(&p.parallel) == family)
                .map(point)
                .collect();
            (!points.is_empty()).then(|| Series::new(family.name(), points))
        })
        .collect();
    let label = format!("recommended: {}", r.parallel.layout_name());
    series.push(Series::new(label, vec![point(r)]));
    Some(Figure {
        stem: format!("plan-world-{}", wp.world_size),
        title: format!(
            "{:.3}B parameters on {} ranks: the layouts that fit",
            w.model.num_params() as f64 / 1e9,
            wp.world_size
        ),
        x_label: "memory a rank (GB)".into(),
        y_label: format!("step time ({unit})"),
        series,
        markers: true,
        y_from_zero: false,
        scatter: true,
    })
}

/// The fastest prediction that fits, if any.
pub fn recommend<'a>(
    predictions: impl IntoIterator<Item = &'a Prediction>,
) -> Option<&'a Prediction> {
    predictions
        .into_iter()
        .filter(|p| p.fits)
        .min_by(|a, b| a.time.step_s().total_cmp(&b.time.step_s()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    fn zero_paper_model() -> GptConfig {
        // 36 x 4096 with GPT-2's vocabulary: 7.46B parameters.
        GptConfig {
            n_layer: 36,
            n_head: 32,
            n_embd: 4096,
            block_size: 1024,
            vocab_size: 50257,
            blocks: Vec::new(),
        }
    }

    fn h100() -> (Device, Network) {
        (
            Device::datasheet("h100", Precision::Mixed, 0.4).unwrap(),
            Network::datasheet("h100").unwrap(),
        )
    }

    #[test]
    fn zero_paper_model_states_at_64_ranks() {
        let w = Workload {
            model: zero_paper_model().into(),
            batch: 64,
            seq_len: 1024,
            grad_accum: 1,
            cpu_threads: None,
        };
        let (d, n) = h100();
        let gb = |s| {
            let par = ParallelConfig {
                strategy: s,
                world_size: 64,
                ..ParallelConfig::single()
            };
            predict(&w, par, &d, &n, Precision::Mixed)
                .memory
                .persistent_states()
                / 1e9
        };
        // ZeRO (Rajbhandari et al. 2020), Figure 1: 120, 31.4, 16.6, 1.9 GB.
        for (s, want) in [
            (StrategyKind::Ddp, 120.0),
            (StrategyKind::Zero1, 31.4),
            (StrategyKind::Zero2, 16.6),
            (StrategyKind::Fsdp, 1.9),
        ] {
            let got = gb(s);
            assert!(
                (got - want).abs() / want < 0.05,
                "{s:?}: {got:.2} GB vs the paper's {want} GB"
            );
        }
    }

    /// Overlapped, offload's gradient download hides in the backward where
    /// the gradient is final there (single, zero2, fsdp) and crosses at the
    /// step's end elsewhere (zero1, ddp over replicas); only the part
    /// outlasting the backward (two thirds of the compute) stays in the
    /// update; serial, every copy and the update add up.
    #[test]
    fn offload_hides_the_gradient_download_in_the_backward_where_it_is_final() {
        let w = Workload {
            model: ModelConfig::preset("gpt2").unwrap(),
            batch: 16,
            seq_len: 1024,
            grad_accum: 1,
            cpu_threads: None,
        };
        let d = Device::datasheet("h100", Precision::Fp32, 0.4).unwrap();
        // a host update too fast to matter: the copies decide
        let net = |pcie| Network {
            pcie_bandwidth: pcie,
            host_bandwidth: 1e18,
            ..Network::datasheet("h100").unwrap()
        };
        let plan = |strategy, world_size, serial, pcie| {
            let par = ParallelConfig {
                strategy,
                world_size,
                offload: Offload::Optimizer,
                offload_serial: serial,
                ..ParallelConfig::single()
            };
            predict(&w, par, &d, &net(pcie), Precision::Fp32).time
        };
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1e-12);
        for (strategy, world, early) in [
            (StrategyKind::Single, 1, true),
            (StrategyKind::Zero2, 2, true),
            (StrategyKind::Fsdp, 2, true),
            (StrategyKind::Zero1, 2, false),
            (StrategyKind::Ddp, 2, false),
        ] {
            // fp32: the gradient down and the parameters up are the same bytes
            for pcie in [1e12, 1e9] {
                let t = plan(strategy, world, false, pcie);
                let half = t.pcie_bytes / 2.0 / pcie;
                let backward = t.compute_s * 2.0 / 3.0;
                let want = match early {
                    true => half + (half - backward).max(0.0),
                    false => 2.0 * half,
                };
                assert!(
                    close(t.optimizer_s, want),
                    "{strategy:?} x{world} at {pcie:e} B/s: update {} s, want {want} s",
                    t.optimizer_s
                );
                let serial = plan(strategy, world, true, pcie);
                assert!(serial.optimizer_s >= 2.0 * half, "{strategy:?}: serial");
            }
        }
    }

    /// A group's ring stays inside a node only where every group of its
    /// kind does: tp 3 over 24 ranks on nodes of 8 puts ranks 6, 7 and 8 in
    /// one group across two nodes (priced on NVLink, it was recommended at
    /// 32.9 ms where its ring over InfiniBand makes it 62.5).
    #[test]
    fn a_group_that_straddles_two_nodes_is_priced_on_the_network() {
        let (_, net) = h100();
        let ib = |n, stride, world| net.link(n, stride, world).bandwidth == net.inter_bandwidth;
        assert!(ib(3, 1, 24), "tp 3: ranks 6..9 straddle");
        assert!(!ib(4, 1, 24), "tp 4: a node holds two whole groups");
        assert!(!ib(3, 1, 6), "one node holds the world");
        assert!(ib(3, 2, 24), "3 stages over tp 2: blocks of 6");
        assert!(!ib(2, 4, 16), "blocks of 8");
        assert!(ib(4, 4, 16), "blocks of 16 span two nodes");
        assert!(!ib(8, 1, 16), "a pipeline of 8 in each node of 8");
    }

    /// The tied embedding's pair, stages 0 and 7 of one pipeline on one
    /// node, sums over NVLink whatever the node's size (nodes of 8 priced
    /// it on InfiniBand, as a ring of 2 ranks 14 apart: 3.3 ms of
    /// communication where nodes of 16 gave 0.5).
    #[test]
    fn the_tied_embeddings_pair_is_priced_on_its_pipelines_link() {
        let (d, net) = h100();
        let w = Workload {
            model: ModelConfig::preset("gpt2").unwrap(),
            batch: 16,
            seq_len: 1024,
            grad_accum: 1,
            cpu_threads: None,
        };
        let par = ParallelConfig {
            world_size: 8,
            pipeline: Pipeline::new(8, Schedule::OneFOneB, 1),
            ..ParallelConfig::single()
        };
        let comm = |ranks_per_node| {
            let net = Network {
                ranks_per_node,
                ..net
            };
            predict(&w, par, &d, &net, Precision::Mixed).time.comm_s
        };
        assert_eq!(comm(8), comm(16));
    }

    /// Offloaded copies live in the node's host memory, which its ranks
    /// share: 206B parameters' fp32 master, gradient and moments over fsdp
    /// x8 are 16 bytes x 206B / 8 a rank (412 GB), 3.3 TB on a node of 2 TB
    /// (recommended before, as if the host had no end).
    #[test]
    fn offloaded_copies_must_fit_the_nodes_host_memory() {
        let w = Workload {
            model: GptConfig {
                n_layer: 256,
                n_head: 64,
                n_embd: 8192,
                block_size: 2048,
                ..zero_paper_model()
            }
            .into(),
            batch: 8,
            seq_len: 2048,
            grad_accum: 1,
            cpu_threads: None,
        };
        let (d, net) = h100();
        let par = ParallelConfig {
            strategy: StrategyKind::Fsdp,
            world_size: 8,
            recompute: true,
            offload: Offload::Params,
            ..ParallelConfig::single()
        };
        let p = predict(&w, par, &d, &net, Precision::Mixed);
        let per_rank = p.memory.host.total();
        let by_hand = 16.0 * w.model.num_params() as f64 / 8.0;
        assert!(
            (per_rank / by_hand - 1.0).abs() < 1e-3,
            "{per_rank} against {by_hand}"
        );
        assert!(
            p.memory.total() <= d.memory_bytes,
            "the device holds its share"
        );
        assert!(!p.fits, "3.3 TB of host copies on a node of 2 TB");
        let why = why_not(&w, &d, &net, &p, None);
        assert!(
            why.contains("its host copies do not fit: 3306 GB a node of 2000 GB"),
            "{why}"
        );
        let roomy = Network {
            host_memory_bytes: 4e12,
            ..net
        };
        assert!(predict(&w, par, &d, &roomy, Precision::Mixed).fits);
    }

    /// A pipeline slower for its busiest stage says so, not that its
    /// bubble is to blame: GPT-2's LM head (232M of its 855M FLOPs a
    /// token) lies on the last of 2 stages, and at 256 micro-batches
    /// zb-h1's bubble is 0% ("9.8% slower: the pipeline's bubble: 0%").
    #[test]
    fn a_pipeline_slowed_by_its_busiest_stage_is_not_said_to_idle() {
        let w = Workload {
            model: ModelConfig::preset("gpt2").unwrap(),
            batch: 16,
            seq_len: 1024,
            grad_accum: 256,
            cpu_threads: None,
        };
        let (d, n) = h100();
        let wp = plan_world(&w, 8, &d, &n, Precision::Mixed, false);
        let pipe = wp
            .families(&w, &d, &n)
            .into_iter()
            .find(|f| f.family == LayoutFamily::Pipeline);
        let f = pipe.expect("a pipeline family");
        let t = &f.best.time;
        assert!(
            t.bubble_s < 0.01 * t.compute_s && t.uneven_s > 10.0 * t.bubble_s,
            "{t:?}"
        );
        assert!(
            f.why
                .ends_with("its busiest stage: the stages' compute is uneven"),
            "{}",
            f.why
        );
    }

    #[test]
    fn ring_costs_follow_the_alpha_beta_formulas() {
        let link = Link {
            bandwidth: 1e9,
            latency_s: 1e-5,
        };
        let ar = collective_s(Collective::AllReduce, 4, 4e9, 1, link);
        assert!((ar - (1.5 * 4.0 + 6.0 * 1e-5)).abs() < 1e-9, "{ar}");
        let ag = collective_s(Collective::Gather, 4, 4e9, 2, link);
        assert!((ag - (0.75 * 4.0 + 2.0 * 3.0 * 1e-5)).abs() < 1e-9, "{ag}");
        assert_eq!(collective_s(Collective::AllReduce, 1, 4e9, 1, link), 0.0);
    }

    #[test]
    fn sharding_shrinks_memory_and_recompute_shrinks_activations() {
        let w = Workload {
            model: ModelConfig::preset("gpt2-xl").unwrap(),
            batch: 32,
            seq_len: 1024,
            grad_accum: 1,
            cpu_threads: None,
        };
        let (d, n) = h100();
        let p = |strategy, recompute| {
            let par = ParallelConfig {
                strategy,
                world_size: 32,
                recompute,
                ..ParallelConfig::single()
            };
            predict(&w, par, &d, &n, Precision::Mixed).memory
        };
        let order = [
            StrategyKind::Ddp,
            StrategyKind::Zero1,
            StrategyKind::Zero2,
            StrategyKind::Fsdp,
        ]
        .map(|s| p(s, false).model_states());
        assert!(order.windows(2).all(|x| x[0] > x[1]), "{order:?}");
        assert!(
            p(StrategyKind::Ddp, true).activations < p(StrategyKind::Ddp, false).activations / 5.0
        );
    }

    /// `--recompute` costs a forward of the blocks, and of GPT-2's head
    /// where its logits run in chunks: over 16 x 1024 rows all but the
    /// last of 13 chunks of 1,334 rows; none on 1 x 256 rows, one chunk;
    /// none for BERT's masked-LM head, which is never recomputed.
    #[test]
    fn recompute_costs_the_blocks_forward_and_the_heads_chunks() {
        let (d, n) = h100();
        for (model, batch, seq_len, share) in [
            ("gpt2", 16, 1024, 12.0 / 13.0),
            ("gpt2", 1, 256, 0.0),
            ("bert-minilm-mlm", 32, 128, 0.0),
        ] {
            let m = ModelConfig::preset(model).unwrap();
            let (head, all) = (
                m.unsplit_flops_per_token(seq_len),
                m.flops_per_token(seq_len),
            );
            let w = Workload {
                model: m,
                batch,
                seq_len,
                grad_accum: 1,
                cpu_threads: None,
            };
            let compute = |recompute| {
                let par = ParallelConfig {
                    recompute,
                    ..ParallelConfig::single()
                };
                predict(&w, par, &d, &n, Precision::Mixed).time.compute_s
            };
            let want = (all + (all - head) / 3.0 + head / 3.0 * share) / all;
            let got = compute(true) / compute(false);
            assert!(
                (got - want).abs() < 1e-12,
                "{model} {batch} x {seq_len}: {got} vs {want}"
            );
        }
    }

    /// A workload of `m` with a global batch of `batch`, 4 micro-batches.
    fn work(m: &ModelConfig, batch: usize) -> Workload {
        Workload {
            model: m.clone(),
            batch,
            seq_len: 1024,
            grad_accum: 4,
            cpu_threads: None,
        }
    }

    #[test]
    fn layouts_respect_heads_and_batch() {
        let m = ModelConfig::preset("gpt2").unwrap(); // 12 heads
        let names: Vec<String> = layouts(&work(&m, 16), 8, false)
            .iter()
            .map(|p| p.layout_name())
            .collect();
        assert!(names.contains(&"ddp x8 (tp 2)".to_string()), "{names:?}");
        assert!(names.contains(&"ddp x8 (tp 4)".to_string()), "{names:?}");
        assert!(
            !layouts(&work(&m, 16), 8, false)
                .iter()
                .any(|p| p.resolved().tp == 8),
            "12 heads do not split 8 ways: {names:?}"
        );
        assert_eq!(layouts(&work(&m, 16), 1, false).len(), 1);
    }

    #[test]
    fn divisors_are_every_factor_once_in_order() {
        assert_eq!(divisors(1), [1]);
        assert_eq!(divisors(12), [1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(36), [1, 2, 3, 4, 6, 9, 12, 18, 36]);
        assert_eq!(divisors(2520).len(), 48);
        assert_eq!(divisors(1 << 17).len(), 18);
    }

    #[test]
    fn a_world_of_twelve_lays_out_every_grid_whose_degrees_divide_it() {
        // Counted by hand. 12's divisors: 1, 2, 3, 4, 6, 12.
        // - over the whole world: ddp, zero1, zero2, fsdp and tp x12: 5;
        // - a pipeline alone, pp 12: 1;
        // - tp with a pipeline, pp x tp = 12, both above 1: (2, 6), (3, 4),
        //   (4, 3), (6, 2): 4;
        // - the four data-parallel strategies over each grid with pp x tp
        //   in {2, 3, 4, 6}: 2 + 2 + 3 + 4 = 11 grids, 44 layouts;
        // - every pipeline among them (1 + 4 + 4 x 7 = 33) again
        //   interleaved and as zb-h1: 66.
        let all = candidates(12, false);
        assert_eq!(all.len(), 5 + 1 + 4 + 44 + 66);
        let has = |strategy, tp, pp| {
            all.iter().any(|p| {
                let r = p.resolved();
                (p.strategy, r.tp, r.pipeline.stages) == (strategy, tp, pp)
            })
        };
        assert!(has(StrategyKind::Zero1, 3, 2), "dp 2 x tp 3 x pp 2");
        assert!(has(StrategyKind::Fsdp, 1, 3), "dp 4 x pp 3");
        assert!(has(StrategyKind::Tp, 3, 4), "tp 3 x pp 4");
        assert!(has(StrategyKind::Ddp, 6, 1), "dp 2 x tp 6");
        // 12 heads and 12 blocks: every grid runs GPT-2 on a batch of 12 in
        // 12 micro-batches, but for the 24 chunks interleaving pp 12 asks
        let gpt2 = Workload {
            grad_accum: 12,
            ..work(&ModelConfig::preset("gpt2").unwrap(), 12)
        };
        assert_eq!(layouts(&gpt2, 12, false).len(), all.len() - 1);
    }

    #[test]
    fn a_530b_model_on_315_nodes_of_8_gets_a_layout_with_35_stages() {
        // Megatron-Turing NLG's shape: 105 blocks 20,480 wide, 128 heads,
        // on 2,520 A100s laid out as dp 9 x tp 8 x pp 35
        let mt_nlg = GptConfig {
            n_layer: 105,
            n_head: 128,
            n_embd: 20480,
            block_size: 2048,
            vocab_size: 50257,
            blocks: Vec::new(),
        };
        // a sequence a replica each micro-step, 2,304 a step
        let w = Workload {
            model: ModelConfig::from(mt_nlg),
            batch: 9,
            seq_len: 2048,
            grad_accum: 256,
            cpu_threads: None,
        };
        let device = Device::datasheet("a100", Precision::Mixed, 0.4).unwrap();
        let net = Network::datasheet("a100").unwrap();
        let wp = plan_world(&w, 2520, &device, &net, Precision::Mixed, true);
        let priced = wp.predictions.iter().find(|p| {
            let r = p.parallel.resolved();
            (r.dp(), r.tp, r.pipeline.stages) == (9, 8, 35)
        });
        assert!(priced.is_some(), "dp 9 x tp 8 x pp 35 is not priced");
        assert!(wp.recommended().is_some(), "no layout recommended");
    }

    /// Megatron's GPT 1T (Narayanan et al. 2021) on 3,072 80-GB GPUs as
    /// dp 6 x tp 8 x pp 64, 1F1B, one sequence a micro-batch, recomputed:
    /// the first stage holds 64 micro-batches, each keeping its blocks'
    /// inputs in 16 bits (Korthikanti et al. 2022: 2 bytes a token and
    /// channel a block, 13.4 GB for 2 blocks), and fits.
    #[test]
    fn gpt_1t_recomputed_keeps_only_its_blocks_inputs_and_fits_in_80_gb() {
        let gpt_1t = GptConfig {
            n_layer: 128,
            n_head: 160,
            n_embd: 25600,
            block_size: 2048,
            vocab_size: 50257,
            blocks: Vec::new(),
        };
        let w = Workload {
            model: ModelConfig::from(gpt_1t),
            batch: 6,
            seq_len: 2048,
            grad_accum: 512,
            cpu_threads: None,
        };
        let par = ParallelConfig {
            strategy: StrategyKind::Zero1,
            world_size: 3072,
            tp: 8,
            recompute: true,
            pipeline: Pipeline::new(64, Schedule::OneFOneB, 1),
            ..ParallelConfig::single()
        };
        let (blocks, c) = (2.0, 25600.0);
        let by_hand = 64.0 * blocks * 2048.0 * c * 2.0;
        let mem = memory_plan(&w, par, Precision::Mixed);
        assert!(
            (by_hand..by_hand * 1.1).contains(&mem.activations),
            "{} of activations, {} by hand",
            bytes(mem.activations),
            bytes(by_hand)
        );
        assert!(mem.total() < 80e9, "{}", bytes(mem.total()));
    }

    /// The fastest fitting layout for `w` on `world` A100s, with and without recomputation.
    fn recommended_on_a100s(w: &Workload, world: usize) -> ParallelConfig {
        let device = Device::datasheet("a100", Precision::Mixed, 0.4).unwrap();
        let net = Network::datasheet("a100").unwrap();
        let preds: Vec<Prediction> = [false, true]
            .into_iter()
            .flat_map(|rc| layouts(w, world, rc))
            .map(|par| predict(w, par, &device, &net, Precision::Mixed))
            .collect();
        recommend(&preds).expect("a layout fits").parallel
    }

    #[test]
    fn pipelines_are_recommended_where_they_win_and_not_elsewhere() {
        // ~44B parameters on 4 nodes of 8 A100s (25 GB/s between nodes):
        // sharding it over 32 ranks sends its weights across nodes every
        // micro-batch; 2 stages send only activations
        let big = GptConfig {
            n_layer: 96,
            n_head: 48,
            n_embd: 6144,
            block_size: 1024,
            vocab_size: 50257,
            blocks: Vec::new(),
        };
        let w = Workload {
            model: ModelConfig::from(big),
            batch: 32,
            seq_len: 1024,
            grad_accum: 32,
            cpu_threads: None,
        };
        let best = recommended_on_a100s(&w, 32);
        assert!(best.pipeline.stages > 1, "{}", best.layout_name());
        // GPT-2 124M fits whole on a rank: a pipeline would only add its bubble
        let small = Workload {
            model: ModelConfig::preset("gpt2").unwrap(),
            batch: 64,
            seq_len: 1024,
            grad_accum: 4,
            cpu_threads: None,
        };
        let best = recommended_on_a100s(&small, 8);
        assert_eq!(best.pipeline.stages, 1, "{}", best.layout_name());
    }

    #[test]
    fn the_grid_lists_every_strategy_with_pipelines_and_tensor_parallelism() {
        let m = ModelConfig::preset("gpt2").unwrap();
        let names: Vec<String> = layouts(&work(&m, 16), 8, false)
            .iter()
            .map(|p| p.layout_name())
            .collect();
        for want in [
            "fsdp x8 (tp 2)",
            "zero2 x8 (tp 2) (pp 2 1f1b)",
            "zero1 x8 (pp 4 1f1b)",
            "ddp x8 (pp 2 1f1b)",
            "tp x8 (pp 2 1f1b)",
            "pp x8 (1f1b)",
            "fsdp x8 (tp 2) (pp 2 interleaved v2)",
            "tp x8 (pp 4 interleaved v2)",
        ] {
            assert!(names.contains(&want.to_string()), "{want}: {names:?}");
        }
        // alone, fsdp over tp 1, 2, 4; with pp 2 over tp 1, 2; with pp 4;
        // each pipeline also interleaved and zb-h1
        assert_eq!(
            names.iter().filter(|n| n.starts_with("fsdp")).count(),
            3 + 3 * 3,
            "{names:?}"
        );
        assert!(names.contains(&"pp x8 (zb-h1)".to_string()), "{names:?}");
        // BERT cannot split its backward: zb-h1 is left out, in words
        let bert = ModelConfig::from(crate::model::bert::BertConfig::preset("bert-tiny").unwrap());
        let said = omitted(&work(&bert, 16), 2);
        assert!(
            said.iter().any(|l| l.starts_with(
                "pp x2 (zb-h1) omitted: the zb-h1 schedule splits each backward in two"
            )),
            "{said:?}"
        );
        // and its kind, which plan's summary lists, says so (it said "other").
        // mutant-equivalent: src/plan/mod.rs: replace && with || in omitted
        // (no layout plan generates tells them apart: a sweep of gpt2, tiny,
        // bert-tiny and bert-minilm over worlds 1-16, batches 1-32 and
        // 1-8 micro-batches left no layout to that branch but the zb-h1
        // ones of BERT, which cannot split its backward: no GPT-2 zb-h1
        // layout fails past the earlier checks, and no BERT layout but a
        // zb-h1 one does)
        let kinds: Vec<&str> = super::omitted(&work(&bert, 16), 2)
            .iter()
            .map(|o| o.kind)
            .collect();
        assert!(
            kinds.contains(&"the engine cannot split its backward for zb-h1"),
            "{kinds:?}"
        );
        assert!(!kinds.contains(&"other"), "{kinds:?}");
        // twelve blocks cannot go round eight ranks twice
        assert!(omitted(&work(&m, 16), 8)
            .iter()
            .any(|l| l
                .starts_with("pp x8 (interleaved v2) omitted: 12 blocks cannot fill 16 chunks")));
        let tiny = ModelConfig::preset("tiny").unwrap();
        assert!(omitted(&work(&tiny, 16), 8)
            .iter()
            .any(|l| l.contains("cannot fill 8 stages")));
    }

    /// [`super::omitted`]'s lines, as `plan --all` prints them.
    fn omitted(w: &Workload, world: usize) -> Vec<String> {
        super::omitted(w, world)
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn omitted_names_the_layouts_and_the_reason() {
        let mut gpt = GptConfig::preset("gpt2").unwrap();
        gpt.n_head = 25;
        let m = ModelConfig::from(gpt);
        assert_eq!(
            omitted(&work(&m, 16), 2),
            ["tp x2 omitted: 25 heads are not divisible by 2"]
        );
        let four = omitted(&work(&m, 6), 4);
        assert!(
            four.contains(&"tp x4 omitted: 25 heads are not divisible by 4".to_string()),
            "{four:?}"
        );
        assert!(
            four.iter()
                .any(|l| l.starts_with("ddp x4, zero1 x4") && l.contains("data-parallel size 4")),
            "{four:?}"
        );
        assert!(omitted(&work(&ModelConfig::preset("gpt2").unwrap(), 16), 4).is_empty());
    }

    #[test]
    fn each_familys_best_is_its_fastest_that_fits_and_says_what_it_loses_by() {
        let w = Workload {
            model: zero_paper_model().into(),
            batch: 64,
            seq_len: 1024,
            grad_accum: 4,
            cpu_threads: None,
        };
        let (d, n) = h100();
        for world in [8, 64] {
            let wp = plan_world(&w, world, &d, &n, Precision::Mixed, true);
            let rec = wp.recommended().expect("a 7.5B model fits on 8 H100s");
            let all: Vec<&Prediction> = wp.predictions.iter().chain(&wp.offloaded).collect();
            let fastest = |ps: &mut dyn Iterator<Item = &&Prediction>| {
                ps.filter(|p| p.fits)
                    .map(|p| p.time.step_s())
                    .fold(f64::INFINITY, f64::min)
            };
            assert_eq!(rec.time.step_s(), fastest(&mut all.iter()));
            let families = wp.families(&w, &d, &n);
            assert_eq!(families.len(), 5);
            for f in &families {
                let members = || {
                    all.iter()
                        .filter(|p| LayoutFamily::of(&p.parallel) == f.family)
                };
                assert_eq!(LayoutFamily::of(&f.best.parallel), f.family);
                let (p, r) = (&f.best.time, &rec.time);
                match f.best.fits {
                    true => assert_eq!(p.step_s(), fastest(&mut members())),
                    false => {
                        assert!(members().all(|q| !q.fits));
                        assert_eq!(f.why, "does not fit in 80 GB");
                        continue;
                    }
                }
                if f.why == "recommended" {
                    assert_eq!(p.step_s(), r.step_s());
                    continue;
                }
                let slower = 100.0 * (p.step_s() / r.step_s() - 1.0);
                let prefix = match slower < 10.0 {
                    true => format!("{slower:.1}% slower: "),
                    false => format!("{slower:.0}% slower: "),
                };
                assert!(f.why.starts_with(&prefix), "{} vs {prefix}", f.why);
                // the reason names the part of the step that grew most
                let grew = [
                    p.compute_s - r.compute_s,
                    p.comm_s - r.comm_s,
                    p.optimizer_s - r.optimizer_s,
                ];
                let most = grew.iter().cloned().fold(f64::MIN, f64::max);
                let part = grew.iter().position(|&g| g == most).unwrap();
                let pipe = f.best.parallel.resolved().pipeline;
                let said = &f.why[prefix.len()..];
                let bubble = format!(
                    "the pipeline's bubble: {:.0}% of the step idle",
                    100.0 * pipe.bubble(4)
                );
                match part {
                    // the bubble where it is the larger of what a pipeline
                    // adds (the recomputation may outweigh both)
                    0 if pipe.stages > 1 && p.bubble_s >= p.uneven_s => {
                        assert!(said == bubble || said.contains("recomputing"), "{said}")
                    }
                    0 => assert!(said.contains("compute") && said != bubble, "{said}"),
                    1 => assert!(said.starts_with("communication: "), "{said}"),
                    _ => assert!(said.contains("update"), "{said}"),
                }
            }
        }
    }

    #[test]
    fn the_figure_holds_every_layout_that_fits_where_it_stands() {
        // steps of well under ten seconds: the figure in milliseconds
        let w = Workload {
            model: zero_paper_model().into(),
            batch: 8,
            seq_len: 256,
            grad_accum: 1,
            cpu_threads: None,
        };
        let (d, n) = h100();
        let wp = plan_world(&w, 8, &d, &n, Precision::Mixed, true);
        let fig = figure_of(&w, &wp).expect("a layout fits");
        let fits: Vec<&Prediction> = (wp.predictions.iter().chain(&wp.offloaded))
            .filter(|p| p.fits)
            .collect();
        // seconds where some step takes ten or more, else milliseconds
        let slowest = fits.iter().map(|p| p.time.step_s()).fold(0.0, f64::max);
        let (unit, scale) = match slowest >= 10.0 {
            true => ("s", 1.0),
            false => ("ms", 1e3),
        };
        assert_eq!(fig.y_label, format!("step time ({unit})"));
        assert_eq!(unit, "ms");
        let (last, families) = fig.series.split_last().unwrap();
        let points: usize = families.iter().map(|s| s.points.len()).sum();
        assert_eq!(points, fits.len());
        for p in &fits {
            let at = (p.memory.total() / 1e9, p.time.step_s() * scale);
            let label = LayoutFamily::of(&p.parallel).name();
            let series = families.iter().find(|s| s.label == label).unwrap();
            assert!(series.points.contains(&at), "{label}: {at:?}");
        }
        let r = wp.recommended().unwrap();
        assert_eq!(
            last.label,
            format!("recommended: {}", r.parallel.layout_name())
        );
        assert_eq!(
            last.points,
            [(r.memory.total() / 1e9, r.time.step_s() * scale)]
        );
    }
}

//! `distgpt plan`: per-rank memory and step time of every strategy and mesh
//! for a model, world size, device and network, from the analytic cost model
//! in `distgpt::plan`, with the fastest layout that fits.

use super::{micro_batches, non_negative_rate, positive, positive_rate, ModelArgs};
use anyhow::{bail, Result};
use clap::Args;
use distgpt::plan::calibrate::{calibrate_cpu, Machine};
use distgpt::plan::{self, Device, Network, Precision, Prediction, Workload};

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DeviceKind {
    /// This machine, measured by a calibration run (thread ranks share it).
    Cpu,
    /// NVIDIA A100 SXM 80 GB (datasheet), NVLink 300 GB/s, 8 per node, 25 GB/s InfiniBand.
    A100,
    /// NVIDIA H100 SXM 80 GB (datasheet), NVLink 450 GB/s, 8 per node, 50 GB/s InfiniBand.
    H100,
    /// Your own: --peak-tflops, --memory-gb, --memory-bandwidth-gbs and the network flags.
    Custom,
}

#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Vocabulary size (default: the preset's; 65 for the char presets).
    #[arg(long, help_heading = "Plan")]
    vocab_size: Option<usize>,
    /// World sizes to plan, comma-separated (1 to 4096).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8",
        help_heading = "Plan"
    )]
    world_size: Vec<usize>,
    /// Global batch: sequences per micro-step, split across the data-parallel ranks.
    #[arg(long, default_value_t = 16, help_heading = "Plan")]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long, help_heading = "Plan")]
    seq_len: Option<usize>,
    /// Micro-batches per optimizer step.
    #[arg(long, value_parser = micro_batches(), default_value_t = 1, help_heading = "Plan")]
    grad_accum: usize,
    /// What each rank computes on.
    #[arg(long, value_enum, default_value = "cpu", help_heading = "Plan")]
    device: DeviceKind,
    /// fp32: what distgpt trains in (16 bytes/param of model state);
    /// mixed: 16-bit params/grads/activations + fp32 master and moments (ZeRO's K = 12).
    #[arg(long, value_enum, default_value = "fp32", help_heading = "Plan")]
    precision: Precision,
    /// Fraction of the peak a step reaches (default: measured for cpu, 0.4 for GPUs).
    #[arg(long, help_heading = "Plan")]
    efficiency: Option<f64>,
    /// Custom device: peak TFLOP/s per device at the chosen precision.
    #[arg(long, value_parser = positive_rate, help_heading = "Plan")]
    peak_tflops: Option<f64>,
    /// Custom device: memory per device in GB (default cpu: 24).
    #[arg(long, value_parser = positive_rate, help_heading = "Plan")]
    memory_gb: Option<f64>,
    /// Custom device: memory bandwidth in GB/s.
    #[arg(long, value_parser = positive_rate, help_heading = "Plan")]
    memory_bandwidth_gbs: Option<f64>,
    /// Ranks per node (custom network).
    #[arg(long, value_parser = positive(), help_heading = "Plan")]
    ranks_per_node: Option<usize>,
    /// Per-rank bandwidth within a node, GB/s.
    #[arg(long, value_parser = positive_rate, help_heading = "Plan")]
    intra_gbs: Option<f64>,
    /// Per-rank bandwidth across nodes, GB/s.
    #[arg(long, value_parser = positive_rate, help_heading = "Plan")]
    inter_gbs: Option<f64>,
    /// Per-message latency within a node, microseconds (the alpha of alpha + beta).
    #[arg(long, value_parser = non_negative_rate, help_heading = "Plan")]
    intra_latency_us: Option<f64>,
    /// Per-message latency across nodes, microseconds.
    #[arg(long, value_parser = non_negative_rate, help_heading = "Plan")]
    inter_latency_us: Option<f64>,
    /// A rank's link to host memory under offload (PCIe), GB/s each way
    /// (default a100: 25, h100: 50, custom: 25).
    #[arg(long, help_heading = "Plan")]
    pcie_gbs: Option<f64>,
    /// Host memory bandwidth a rank's AdamW update gets under offload, GB/s
    /// (default 50).
    #[arg(long, help_heading = "Plan")]
    host_gbs: Option<f64>,
    /// Also plan every layout with activation recomputation.
    #[arg(long, help_heading = "Plan")]
    recompute: bool,
    /// Print JSON instead of tables.
    #[arg(long, help_heading = "Plan")]
    json: bool,
}

fn need(v: Option<f64>, flag: &str) -> Result<f64> {
    match v {
        Some(x) if x > 0.0 && x.is_finite() => Ok(x),
        Some(x) => bail!("{flag} must be a positive number, got {x}"),
        None => bail!("--device custom needs {flag}"),
    }
}

/// The device and network the flags describe. For this CPU, also the
/// measured machine: its step efficiency is calibrated per world size.
fn target(a: &PlanArgs, threads: usize) -> Result<(Device, Network, Option<Machine>)> {
    let eff = a.efficiency;
    if let Some(e) = eff {
        if !(e > 0.0 && e <= 1.0) {
            bail!("--efficiency must be in (0, 1], got {e}");
        }
    }
    let mut machine = None;
    let (mut device, mut net) = match a.device {
        DeviceKind::Cpu => {
            distgpt::errln!(
                "measuring this CPU (matmul peak, AdamW bandwidth, thread-rank all-reduce)..."
            );
            let m = Machine::measure(threads)?;
            distgpt::errln!(
                "  peak {:.0} GFLOP/s, AdamW {:.1} GB/s, all-reduce {:.1} GB/s + {:.1} us",
                m.peak_flops / 1e9,
                m.memory_bandwidth / 1e9,
                m.comm_bandwidth / 1e9,
                m.comm_latency_s * 1e6
            );
            let parts = (
                Device {
                    name: "this CPU".into(),
                    peak_flops: m.peak_flops,
                    efficiency: eff.unwrap_or(1.0),
                    memory_bytes: a.memory_gb.unwrap_or(24.0) * 1e9,
                    memory_bandwidth: m.memory_bandwidth,
                    shared_by_ranks: true,
                },
                m.network(),
            );
            machine = Some(m);
            parts
        }
        DeviceKind::A100 | DeviceKind::H100 => {
            let name = if a.device == DeviceKind::A100 {
                "a100"
            } else {
                "h100"
            };
            (
                Device::datasheet(name, a.precision, eff.unwrap_or(0.4)).expect("known datasheet"),
                Network::datasheet(name).expect("known datasheet"),
            )
        }
        DeviceKind::Custom => (
            Device {
                name: "custom".into(),
                peak_flops: need(a.peak_tflops, "--peak-tflops")? * 1e12,
                efficiency: eff.unwrap_or(0.4),
                memory_bytes: need(a.memory_gb, "--memory-gb")? * 1e9,
                memory_bandwidth: need(a.memory_bandwidth_gbs, "--memory-bandwidth-gbs")? * 1e9,
                shared_by_ranks: false,
            },
            Network {
                ranks_per_node: a.ranks_per_node.unwrap_or(8),
                intra_bandwidth: need(a.intra_gbs, "--intra-gbs")? * 1e9,
                intra_latency_s: a.intra_latency_us.unwrap_or(5.0) * 1e-6,
                inter_bandwidth: need(a.inter_gbs, "--inter-gbs")? * 1e9,
                inter_latency_s: a.inter_latency_us.unwrap_or(10.0) * 1e-6,
                pcie_bandwidth: 25e9,
                host_bandwidth: 50e9,
            },
        ),
    };
    // Explicit flags override a preset's figures.
    if let Some(e) = eff {
        device.efficiency = e;
    }
    if a.device != DeviceKind::Custom {
        if let Some(x) = a.memory_gb {
            device.memory_bytes = x * 1e9;
        }
        if let Some(x) = a.ranks_per_node {
            net.ranks_per_node = x;
        }
        if let Some(x) = a.intra_gbs {
            net.intra_bandwidth = x * 1e9;
        }
        if let Some(x) = a.inter_gbs {
            net.inter_bandwidth = x * 1e9;
        }
        if let Some(x) = a.intra_latency_us {
            net.intra_latency_s = x * 1e-6;
        }
        if let Some(x) = a.inter_latency_us {
            net.inter_latency_s = x * 1e-6;
        }
    }
    if a.device == DeviceKind::Cpu && (a.pcie_gbs.is_some() || a.host_gbs.is_some()) {
        bail!("--pcie-gbs and --host-gbs price offload from a device's memory; --device cpu trains in host memory already");
    }
    if a.device != DeviceKind::Cpu {
        if let Some(x) = a.pcie_gbs {
            net.pcie_bandwidth = need(Some(x), "--pcie-gbs")? * 1e9;
        }
        if let Some(x) = a.host_gbs {
            net.host_bandwidth = need(Some(x), "--host-gbs")? * 1e9;
        }
    }
    Ok((device, net, machine))
}

pub fn run(a: PlanArgs, threads: usize) -> Result<()> {
    let model = a.model.resolve_family(a.vocab_size)?;
    let block_size = model.block_size();
    let seq_len = a.seq_len.unwrap_or(block_size);
    if seq_len == 0 || seq_len > block_size {
        bail!("--seq-len {seq_len} must be between 1 and the model's block size {block_size}");
    }
    if a.batch_size == 0 || a.grad_accum == 0 {
        bail!("--batch-size and --grad-accum must be at least 1");
    }
    if let Some(&w) = a.world_size.iter().find(|&&w| w == 0 || w > 4096) {
        bail!("world size {w} is outside 1..=4096");
    }
    let w = Workload {
        model,
        batch: a.batch_size,
        seq_len,
        grad_accum: a.grad_accum,
        cpu_threads: (a.device == DeviceKind::Cpu).then_some(threads),
    };
    let (mut device, net, machine) = target(&a, threads)?;
    let mut all = Vec::new();
    for &world in &a.world_size {
        if let (Some(m), None) = (&machine, a.efficiency) {
            let cal = calibrate_cpu(m, &w.model, w.batch, w.seq_len, world)?;
            let (m, b, t) = &cal.measured;
            distgpt::errln!(
                "  {}: step efficiency {:.0}% (one rank of {world} at {b} x {t} tokens, {} params)",
                distgpt::metrics::count(world, "rank"),
                100.0 * cal.efficiency,
                m.num_params()
            );
            device.efficiency = cal.efficiency;
        }
        let mut preds: Vec<Prediction> = Vec::new();
        for rc in if a.recompute {
            vec![false, true]
        } else {
            vec![false]
        } {
            for par in plan::layouts(&w, world, rc) {
                preds.push(plan::predict(&w, par, &device, &net, a.precision));
            }
        }
        if preds.is_empty() {
            distgpt::errln!(
                "world size {world}: no layout fits the batch of {} (it must divide by the data-parallel size)",
                w.batch
            );
        }
        // where nothing fits on the device, the fastest layout that does with offload
        let offload: Vec<Prediction> = match plan::recommend(&preds) {
            None if !device.shared_by_ranks => preds
                .iter()
                .flat_map(|p| plan::offloaded(&p.parallel))
                .map(|par| plan::predict(&w, par, &device, &net, a.precision))
                .filter(|p| p.fits)
                .collect(),
            _ => Vec::new(),
        };
        let offload = plan::recommend(&offload).cloned();
        all.push((
            world,
            device.efficiency,
            preds,
            plan::omitted(&w, world),
            offload,
        ));
    }
    if a.json {
        let j = serde_json::json!({
            "workload": w, "device": device, "network": net, "precision": a.precision,
            "plans": all.iter().map(|(world, eff, p, omitted, offload)| serde_json::json!({
                "world_size": world, "efficiency": eff, "predictions": p, "omitted": omitted,
                "recommended": plan::recommend(p).map(|r| plan::layout_name(&r.parallel)),
                "fits_with_offload": offload,
            })).collect::<Vec<_>>(),
        });
        distgpt::outln!("{j}");
        return Ok(());
    }
    distgpt::outln!(
        "{} ({} params, {} layers x {} wide), global batch {} x {} tokens x {} accum, {} on {} ({} peak, {:.0} GB)",
        a.model.model_name(),
        match w.model.num_params() as f64 {
            n if n >= 1e9 => format!("{:.3}B", n / 1e9),
            n => format!("{:.1}M", n / 1e6),
        },
        w.model.n_layer(),
        w.model.n_embd(),
        w.batch,
        w.seq_len,
        w.grad_accum,
        a.precision,
        device.name,
        if device.peak_flops >= 1e12 {
            format!("{:.0} TFLOP/s", device.peak_flops / 1e12)
        } else {
            format!("{:.0} GFLOP/s", device.peak_flops / 1e9)
        },
        device.memory_bytes / 1e9
    );
    let largest = all
        .iter()
        .flat_map(|(_, _, p, _, _)| p.iter().map(|x| x.memory.total()))
        .fold(0.0, f64::max);
    let (unit, scale) = if largest >= 1e9 {
        ("GB", 1e9)
    } else {
        ("MB", 1e6)
    };
    distgpt::outln!("{}", network_line(&net));
    distgpt::outln!("memory in {unit} (decimal) per rank; states = params + grads + optimizer kept between steps (fsdp's gathered units are in params and total)");
    for (world, eff, preds, omitted, offload) in &all {
        distgpt::outln!();
        distgpt::outln!(
            "{:<38} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>12}  fits",
            format!("world {world} (eff {:.0}%)", 100.0 * eff),
            "params",
            "grads",
            "optim",
            "states",
            "activ",
            "total",
            "compute ms",
            "comm ms",
            "optim ms",
            "step ms",
            "tokens/s"
        );
        for p in preds {
            let (m, t) = (&p.memory, &p.time);
            distgpt::outln!(
                "{:<38} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>12.0}  {}",
                plan::layout_name(&p.parallel),
                m.params / scale,
                m.grads / scale,
                m.optimizer / scale,
                m.persistent_states() / scale,
                m.activations / scale,
                m.total() / scale,
                t.compute_s * 1e3,
                t.comm_s * 1e3,
                t.optimizer_s * 1e3,
                t.step_s() * 1e3,
                p.tokens_per_s,
                if p.fits { "yes" } else { "NO" }
            );
        }
        match plan::recommend(preds) {
            Some(r) => distgpt::outln!(
                "recommended on {world}: {} ({:.1} ms/step, {:.3} {unit} per rank)",
                plan::layout_name(&r.parallel),
                r.time.step_s() * 1e3,
                r.memory.total() / scale
            ),
            None if !preds.is_empty() => distgpt::outln!(
                "on {world}: nothing fits in {:.0} GB; try more ranks, --recompute{} or a smaller batch",
                device.memory_bytes / 1e9,
                if device.shared_by_ranks { "" } else { ", --offload" }
            ),
            None => {}
        }
        if let Some(p) = offload {
            distgpt::outln!(
                "with offload on {world}: {} fits: {:.3} {unit} on the device and {:.3} {unit} on the host per rank, \
                 {:.1} ms/step ({:.1} ms of it the host's update and {:.0} MB a step over PCIe at {:.0} GB/s)",
                plan::layout_name(&p.parallel),
                p.memory.total() / scale,
                p.memory.host.total() / scale,
                p.time.step_s() * 1e3,
                p.time.optimizer_s * 1e3,
                p.time.pcie_bytes / 1e6,
                net.pcie_bandwidth / 1e9
            );
        }
        for note in omitted {
            distgpt::outln!("note: {note}");
        }
    }
    Ok(())
}

/// The network assumptions behind the comm times, in one line.
fn network_line(net: &Network) -> String {
    let link = |bw: f64, lat: f64| {
        format!(
            "{:.1} GB/s per rank + {:.1} us per message",
            bw / 1e9,
            lat * 1e6
        )
    };
    // calibration on this machine puts every rank on one node
    if net.ranks_per_node == usize::MAX {
        return format!(
            "network: every rank on one node, {}",
            link(net.intra_bandwidth, net.intra_latency_s)
        );
    }
    format!(
        "network: {} ranks per node; within a node {}; across nodes {}",
        net.ranks_per_node,
        link(net.intra_bandwidth, net.intra_latency_s),
        link(net.inter_bandwidth, net.inter_latency_s)
    )
}

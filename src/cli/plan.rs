//! `distgpt plan`: per-rank memory and step time of every strategy and mesh
//! for a model, world size, device and network, from the analytic cost model
//! in `distgpt::plan`, with the fastest layout that fits.

use super::{
    count, micro_batches, non_negative, non_negative_rate, positive, positive_rate, ModelArgs,
};
use anyhow::{bail, Result};
use clap::Args;
use distgpt::plan::calibrate::{calibrate_cpu, run_efficiency, Machine};
use distgpt::plan::{self, bytes, Device, Network, Precision, Prediction, Workload, WorldPlan};
use std::path::PathBuf;

/// The largest world `plan` prices: 2^17 ranks, past the largest clusters
/// trained on.
const MAX_WORLD: usize = 1 << 17;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DeviceKind {
    /// This machine, measured by a calibration run (thread ranks share it).
    Cpu,
    /// NVIDIA A100 SXM 80 GB: 156 TFLOP/s TF32, 312 bf16 (dense), 2.0 TB/s;
    /// NVLink 300 GB/s each way, 8 per node, 25 GB/s InfiniBand (NVIDIA A100 datasheet).
    A100,
    /// NVIDIA H100 SXM5 80 GB: 495 TFLOP/s TF32, 989 bf16 (dense), 3.35 TB/s;
    /// NVLink 450 GB/s each way, 8 per node, 50 GB/s InfiniBand (NVIDIA H100 datasheet).
    H100,
    /// NVIDIA H200 SXM 141 GB: 495 TFLOP/s TF32, 989 bf16 (dense), 4.8 TB/s;
    /// NVLink 450 GB/s each way, 8 per node, 50 GB/s InfiniBand (NVIDIA H200 datasheet).
    H200,
    /// NVIDIA B200 (HGX, 1,000 W) 180 GB: 1,100 TFLOP/s TF32, 2,250 bf16 (dense), 8 TB/s;
    /// NVLink 900 GB/s each way, 8 per node, 50 GB/s InfiniBand (NVIDIA HGX and DGX B200 datasheets).
    B200,
    /// Your own: --peak-tflops, --memory-gb, --memory-bandwidth-gbs and the network flags.
    Custom,
}

/// The most layers `plan` takes: five times the deepest model it is
/// tested on (204 blocks).
const MAX_LAYERS: usize = 1024;

#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Vocabulary size (default: the preset's; 65 for the char presets).
    #[arg(long, value_parser = non_negative(), help_heading = "Plan")]
    vocab_size: Option<usize>,
    /// World sizes to plan, comma-separated (1 to 131072).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = count(1, MAX_WORLD as i64),
        default_value = "1,2,4,8",
        help_heading = "Plan"
    )]
    world_size: Vec<usize>,
    /// Global batch: sequences per micro-step, split across the data-parallel ranks.
    #[arg(long, value_parser = positive(), default_value_t = 16, help_heading = "Plan")]
    batch_size: usize,
    /// Tokens per sequence (default: the model's block size).
    #[arg(long, value_parser = non_negative(), help_heading = "Plan")]
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
    #[arg(long, help_heading = "Plan", conflicts_with = "efficiency_from")]
    efficiency: Option<f64>,
    /// Take the efficiency a training run measured: the median MFU of the
    /// steps RUN logged (a `train --device cuda` run of scripts/gpu_check.sh).
    #[arg(long, value_name = "RUN", help_heading = "Plan")]
    efficiency_from: Option<PathBuf>,
    /// Peak TFLOP/s per device at the chosen precision: a custom device's,
    /// or in place of a GPU's datasheet figure (not with --device cpu,
    /// which measures its own).
    #[arg(long, value_parser = positive_rate, help_heading = "Plan")]
    peak_tflops: Option<f64>,
    /// Memory per device in GB: a custom device's, or in place of a named
    /// device's (default cpu: 24).
    #[arg(long, value_parser = positive_rate, help_heading = "Plan")]
    memory_gb: Option<f64>,
    /// Memory bandwidth in GB/s: a custom device's, or in place of a GPU's
    /// datasheet figure (not with --device cpu, which measures its own).
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
    /// (default a100: 25, h100, h200 and b200: 50, custom: 25).
    #[arg(long, help_heading = "Plan")]
    pcie_gbs: Option<f64>,
    /// Host memory bandwidth a rank's AdamW update gets under offload, GB/s
    /// (default 50).
    #[arg(long, help_heading = "Plan")]
    host_gbs: Option<f64>,
    /// A node's host memory in GB, which its ranks' offloaded copies share
    /// (default a100, h100, h200, b200: 2000, a DGX's; custom: unchecked).
    #[arg(long, value_parser = positive_rate, help_heading = "Plan")]
    host_memory_gb: Option<f64>,
    /// Also plan every layout with activation recomputation.
    #[arg(long, help_heading = "Plan")]
    recompute: bool,
    /// List every layout priced (by default each family's best: data
    /// parallel, + tp, + pp, + both, + offload).
    #[arg(long, help_heading = "Plan")]
    all: bool,
    /// Print JSON instead of tables.
    #[arg(long, help_heading = "Plan")]
    json: bool,
    /// Draw step time against memory per rank for every layout that fits,
    /// the recommendation marked: DIR/plan-world-N.png and .svg.
    #[arg(long, value_name = "DIR", help_heading = "Plan")]
    plot: Option<PathBuf>,
    /// Draw into --plot's folder even when it already holds files.
    #[arg(long, requires = "plot", help_heading = "Plan")]
    overwrite: bool,
}

fn need(v: Option<f64>, flag: &str) -> Result<f64> {
    match v {
        Some(x) if x > 0.0 && x.is_finite() => Ok(x),
        Some(x) => bail!("{flag} must be a positive number, got {x}"),
        None => bail!("--device custom needs {flag}"),
    }
}

/// The step efficiency the flags ask for (None: the CPU's measured, or a
/// datasheet's assumed), and where it comes from, in words.
fn efficiency(a: &PlanArgs) -> Result<(Option<f64>, String)> {
    let (eff, source) = match (&a.efficiency_from, a.efficiency) {
        (Some(run), _) => {
            let m = run_efficiency(run)?;
            let source = format!(
                "the median MFU of {} of {} (trained on {}, against {})",
                distgpt::metrics::count(m.steps, "step"),
                run.display(),
                m.device,
                flops(m.peak_flops)
            );
            (Some(m.efficiency), source)
        }
        (None, Some(e)) => (Some(e), "--efficiency".to_string()),
        (None, None) if a.device == DeviceKind::Cpu => {
            (None, "measured on this CPU for each world size".to_string())
        }
        (None, None) => (
            None,
            "assumed (--efficiency-from RUN takes what a run measured)".to_string(),
        ),
    };
    if let Some(e) = eff {
        if !(e > 0.0 && e <= 1.0) {
            bail!("--efficiency must be in (0, 1], got {e}");
        }
    }
    Ok((eff, source))
}

/// The device and network the flags describe, and where the step's
/// efficiency comes from, in words. For this CPU, also the measured
/// machine: its step efficiency is calibrated per world size.
fn target(a: &PlanArgs, threads: usize) -> Result<(Device, Network, Option<Machine>, String)> {
    let (eff, source) = efficiency(a)?;
    if a.device == DeviceKind::Cpu && (a.peak_tflops.is_some() || a.memory_bandwidth_gbs.is_some())
    {
        bail!("--peak-tflops and --memory-bandwidth-gbs state a custom device's or a GPU's figures; --device cpu measures this CPU's, and prices its steps from them");
    }
    check_figures(a)?;
    let mut machine = None;
    let (mut device, mut net) = match a.device {
        DeviceKind::Cpu => {
            distgpt::errln!(
                "measuring this CPU (matmul peak, AdamW bandwidth, thread-rank all-reduce)..."
            );
            let m = Machine::measure(threads)?;
            distgpt::errln!(
                "  best matmul {:.0} GFLOP/s (steps are priced from it, not from the hardware's peak), AdamW {:.1} GB/s, all-reduce {:.1} GB/s + {:.1} us",
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
        DeviceKind::A100 | DeviceKind::H100 | DeviceKind::H200 | DeviceKind::B200 => {
            let name = super::config::name(a.device);
            (
                Device::datasheet(&name, a.precision, eff.unwrap_or(0.4)).expect("known datasheet"),
                Network::datasheet(&name).expect("known datasheet"),
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
                host_memory_bytes: f64::INFINITY,
            },
        ),
    };
    overrides(a, eff, &mut device, &mut net)?;
    Ok((device, net, machine, source))
}

/// Each stated figure in plan's units, a number from one a second (or
/// byte) up: 1e308 TFLOP/s was infinite FLOP/s and 0 us a step (the signs
/// and NaNs are refused with each flag's own words).
fn check_figures(a: &PlanArgs) -> Result<()> {
    for (given, unit, flag, what) in [
        (a.peak_tflops, 1e12, "--peak-tflops", "FLOP/s"),
        (a.memory_gb, 1e9, "--memory-gb", "bytes"),
        (
            a.memory_bandwidth_gbs,
            1e9,
            "--memory-bandwidth-gbs",
            "bytes/s",
        ),
        (a.intra_gbs, 1e9, "--intra-gbs", "bytes/s"),
        (a.inter_gbs, 1e9, "--inter-gbs", "bytes/s"),
        (a.pcie_gbs, 1e9, "--pcie-gbs", "bytes/s"),
        (a.host_gbs, 1e9, "--host-gbs", "bytes/s"),
        (a.host_memory_gb, 1e9, "--host-memory-gb", "bytes"),
    ] {
        let Some(x) = given.filter(|x| *x > 0.0 && x.is_finite()) else {
            continue;
        };
        if !(x * unit >= 1.0 && (x * unit).is_finite()) {
            bail!(
                "{flag} {x:e} is {:e} {what}: plan takes 1 to {:e}",
                x * unit,
                f64::MAX
            );
        }
    }
    Ok(())
}

/// Explicit flags override a preset's figures.
fn overrides(a: &PlanArgs, eff: Option<f64>, device: &mut Device, net: &mut Network) -> Result<()> {
    if let Some(e) = eff {
        device.efficiency = e;
    }
    if a.device != DeviceKind::Custom {
        if let Some(x) = a.ranks_per_node {
            net.ranks_per_node = x;
        }
        for (given, figure, unit) in [
            (a.peak_tflops, &mut device.peak_flops, 1e12),
            (a.memory_gb, &mut device.memory_bytes, 1e9),
            (a.memory_bandwidth_gbs, &mut device.memory_bandwidth, 1e9),
            (a.intra_gbs, &mut net.intra_bandwidth, 1e9),
            (a.inter_gbs, &mut net.inter_bandwidth, 1e9),
            (a.intra_latency_us, &mut net.intra_latency_s, 1e-6),
            (a.inter_latency_us, &mut net.inter_latency_s, 1e-6),
        ] {
            if let Some(x) = given {
                *figure = x * unit;
            }
        }
    }
    if a.device == DeviceKind::Cpu
        && (a.pcie_gbs.is_some() || a.host_gbs.is_some() || a.host_memory_gb.is_some())
    {
        bail!("--pcie-gbs, --host-gbs and --host-memory-gb price offload from a device's memory; --device cpu trains in host memory already");
    }
    if a.device != DeviceKind::Cpu {
        if let Some(x) = a.pcie_gbs {
            net.pcie_bandwidth = need(Some(x), "--pcie-gbs")? * 1e9;
        }
        if let Some(x) = a.host_gbs {
            net.host_bandwidth = need(Some(x), "--host-gbs")? * 1e9;
        }
        if let Some(x) = a.host_memory_gb {
            net.host_memory_bytes = x * 1e9;
        }
    }
    Ok(())
}

pub fn run(a: PlanArgs, threads: usize) -> Result<()> {
    let worlds = &a.world_size;
    if let Some((_, w)) = worlds
        .iter()
        .enumerate()
        .find(|(i, w)| worlds[..*i].contains(w))
    {
        bail!("--world-size names {w} twice: each world is planned once");
    }
    let model = a.model.family_shape(a.vocab_size)?;
    if model.n_layer() > MAX_LAYERS {
        bail!(
            "{} layers: plan takes at most {MAX_LAYERS} (the deepest models it is tested on have 204, and a plan's time and memory grow with the layers: 100,000 take minutes and gigabytes)",
            model.n_layer()
        );
    }
    let block_size = model.block_size();
    let seq_len = a.seq_len.unwrap_or(block_size);
    if seq_len == 0 || seq_len > block_size {
        bail!("--seq-len {seq_len} must be between 1 and the model's block size {block_size}");
    }
    // a micro-batch's activations are counted in bytes as training counts
    // them (64-bit): a bound on them, every layer's widest rows, keeps far
    // below 2^63 (--batch-size 88,262,514,902 overflowed the count)
    let rows = a.batch_size as f64 * seq_len as f64;
    let widths = (model.n_layer() as f64 * 34.0 + 8.0) * model.n_embd() as f64
        + 2.0 * model.vocab_size() as f64;
    if rows * a.grad_accum as f64 > 2f64.powi(40) || rows * widths * 8.0 > 2f64.powi(62) {
        bail!(
            "--batch-size {} x --seq-len {seq_len} x --grad-accum {}: plan prices steps of at most 2^40 tokens whose micro-batch activations a 64-bit byte count holds (these would be about {:.1e} bytes)",
            a.batch_size,
            a.grad_accum,
            rows * widths * 4.0
        );
    }
    if let Some(dir) = &a.plot {
        super::claim_out(dir, "--plot", "a folder of figures", a.overwrite)?;
    }
    let w = Workload {
        model,
        batch: a.batch_size,
        seq_len,
        grad_accum: a.grad_accum,
        cpu_threads: (a.device == DeviceKind::Cpu).then_some(threads),
    };
    let (mut device, net, machine, source) = target(&a, threads)?;
    if !a.json {
        let peak_is = match machine {
            Some(_) => "best matmul",
            None => "peak",
        };
        distgpt::outln!("{}", workload_line(&a, &w, &device, peak_is));
        distgpt::outln!("{}", network_line(&net));
        distgpt::outln!("{}", activation_line(&a));
        match machine {
            Some(_) if !efficiency_given(&a) => distgpt::outln!("efficiency: {source}"),
            _ => distgpt::outln!(
                "efficiency: {:.1}% of the {peak_is}, {source}",
                100.0 * device.efficiency
            ),
        }
    }
    let (mut plans, mut devices) = (Vec::new(), Vec::new());
    for &world in &a.world_size {
        if let (Some(m), false) = (&machine, efficiency_given(&a)) {
            let cal = calibrate_cpu(m, &w.model, w.batch, w.seq_len, world)?;
            let (m, b, t) = &cal.measured;
            distgpt::errln!(
                "  {}: step efficiency {:.0}% (one rank of {world} at {b} x {t} tokens, {} params)",
                distgpt::metrics::count(world, "rank"),
                100.0 * cal.efficiency,
                m.num_params()
            );
            (device.efficiency, device.peak_flops) = (cal.efficiency, cal.peak_flops);
        }
        let wp = plan::plan_world(&w, world, &device, &net, a.precision, a.recompute);
        if !a.json {
            // each world as it is priced
            print_world(&a, &w, &device, &net, &wp);
        }
        if let Some(dir) = &a.plot {
            for path in plan::plot(dir, &w, &wp)? {
                distgpt::errln!("wrote {}", path.display());
            }
        }
        plans.push(wp);
        devices.push(device.clone());
    }
    if a.json {
        distgpt::outln!("{}", plans_json(&w, &devices, &net, a.precision, &plans));
    }
    Ok(())
}

/// The plans as `--json` prints them, each with the device it was priced
/// on (`--device cpu` calibrates each world's; "device" is the last's).
fn plans_json(
    w: &Workload,
    devices: &[Device],
    net: &Network,
    precision: Precision,
    plans: &[WorldPlan],
) -> serde_json::Value {
    serde_json::json!({
        "workload": w, "device": devices.last(), "network": net, "precision": precision,
        "plans": plans.iter().zip(devices).map(|(p, device)| serde_json::json!({
            "world_size": p.world_size, "efficiency": p.efficiency, "device": device,
            "predictions": p.predictions, "offloaded": p.offloaded,
            "omitted": p.omitted.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "recommended": p.recommended().map(|r| r.parallel.layout_name()),
            "families": p.families(w, device, net).iter().map(|f| serde_json::json!({
                "family": f.family, "layout": f.best.parallel.layout_name(),
                "prediction": f.best, "why": f.why,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// Whether the flags set the efficiency (else this CPU's is measured).
fn efficiency_given(a: &PlanArgs) -> bool {
    a.efficiency.is_some() || a.efficiency_from.is_some()
}

/// The header: the model, the step and the device (`peak_is`: what its
/// FLOP/s are, a datasheet's peak or a measured best matmul).
fn workload_line(a: &PlanArgs, w: &Workload, device: &Device, peak_is: &str) -> String {
    format!(
        "{} ({} params, {} layers x {} wide), global batch {} x {} tokens x {} accum, {} on {} ({} {peak_is}, {:.0} GB)",
        a.model.model_name(),
        params(w.model.num_params() as f64),
        w.model.n_layer(),
        w.model.n_embd(),
        w.batch,
        w.seq_len,
        w.grad_accum,
        a.precision,
        device.name,
        flops(device.peak_flops),
        device.memory_bytes / 1e9
    )
}

/// 31,616 as 31.6k, 124.4M, 7.463B, 1.007T.
fn params(n: f64) -> String {
    match n {
        n if n >= 1e12 => format!("{:.3}T", n / 1e12),
        n if n >= 1e9 => format!("{:.3}B", n / 1e9),
        n if n >= 1e6 => format!("{:.1}M", n / 1e6),
        n => format!("{:.1}k", n / 1e3),
    }
}

/// 40%, or 0.2% below one percent.
fn percent(x: f64) -> String {
    match 100.0 * x {
        p if p >= 1.0 => format!("{p:.0}%"),
        p => format!("{p:.1}%"),
    }
}

/// 989 TFLOP/s, or 82 GFLOP/s below one TFLOP/s.
fn flops(f: f64) -> String {
    match f {
        f if f >= 1e12 => format!("{:.0} TFLOP/s", f / 1e12),
        f => format!("{:.0} GFLOP/s", f / 1e9),
    }
}

/// 45.2 us, 850.2 ms, 31.25 s, 1388 s.
fn seconds(s: f64) -> String {
    match s {
        s if s >= 100.0 => format!("{s:.0} s"),
        s if s >= 1.0 => format!("{s:.2} s"),
        s if s >= 1e-3 => format!("{:.1} ms", s * 1e3),
        s => format!("{:.1} us", s * 1e6),
    }
}

/// 1.2M, 34.5k, 950.
fn rate(x: f64) -> String {
    match x {
        x if x >= 1e6 => format!("{:.2}M", x / 1e6),
        x if x >= 1e4 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// One world's answer: the recommendation, each family's best and why it
/// loses (or with --all every layout), and what was left out.
fn print_world(a: &PlanArgs, w: &Workload, device: &Device, net: &Network, wp: &WorldPlan) {
    let world = wp.world_size;
    distgpt::outln!();
    let priced = wp.predictions.len() + wp.offloaded.len();
    let head = format!(
        "world {world}: {} priced at {} of the peak",
        distgpt::metrics::count(priced, "layout"),
        percent(wp.efficiency)
    );
    match wp.recommended() {
        Some(r) => distgpt::outln!(
            "{head}; recommended: {} ({} a step, {} tokens/s, {} a rank)",
            r.parallel.layout_name(),
            seconds(r.time.step_s()),
            rate(r.tokens_per_s),
            bytes(r.memory.total())
        ),
        None if priced > 0 => distgpt::outln!(
            "{head}; nothing fits in {:.0} GB{}: try more ranks{} or a smaller batch",
            device.memory_bytes / 1e9,
            // an offloaded layout the device holds lacks the node's host memory
            match (
                device.shared_by_ranks,
                wp.offloaded
                    .iter()
                    .any(|p| p.memory.total() <= device.memory_bytes)
            ) {
                (true, _) => String::new(),
                (false, true) => format!(
                    ", even with offload (its host copies exceed a node's {:.0} GB)",
                    net.host_memory_bytes / 1e9
                ),
                (false, false) => ", even with offload".into(),
            },
            // what the user has not tried yet
            if a.recompute { "" } else { ", --recompute" }
        ),
        None => distgpt::outln!(
            "{head}: no layout fits the batch of {} (it must divide by the data-parallel size)",
            w.batch
        ),
    }
    if a.all {
        print_every_layout(wp);
    } else if priced > 0 {
        let rows: Vec<Vec<String>> = wp
            .families(w, device, net)
            .iter()
            .map(|f| {
                let p = &f.best;
                vec![
                    f.family.name().to_string(),
                    p.parallel.layout_name(),
                    bytes(p.memory.total()),
                    seconds(p.time.step_s()),
                    rate(p.tokens_per_s),
                    format!(" {}", f.why),
                ]
            })
            .collect();
        let header = [
            "family",
            "its best layout",
            "a rank",
            "a step",
            "tokens/s",
            "",
        ];
        // names left, figures right, the reason last as it is, a space further
        for line in distgpt::metrics::table(&header, &rows, &[0, 1, 5]) {
            distgpt::outln!("  {line}");
        }
    }
    if a.all {
        for note in &wp.omitted {
            distgpt::outln!("note: {note}");
        }
    } else if !wp.omitted.is_empty() {
        let n: usize = wp.omitted.iter().map(|o| o.layouts.len()).sum();
        let mut kinds: Vec<&str> = Vec::new();
        for o in &wp.omitted {
            if !kinds.contains(&o.kind) {
                kinds.push(o.kind);
            }
        }
        distgpt::outln!(
            "  {} left out ({}); --all lists every layout and why",
            distgpt::metrics::count(n, "layout"),
            kinds.join("; ")
        );
    }
}

/// Every layout priced, a row each, in the order priced.
fn print_every_layout(wp: &WorldPlan) {
    let all: Vec<&Prediction> = wp.predictions.iter().chain(&wp.offloaded).collect();
    let largest = all.iter().map(|p| p.memory.total()).fold(0.0, f64::max);
    let (unit, scale) = if largest >= 1e9 {
        ("GB", 1e9)
    } else {
        ("MB", 1e6)
    };
    distgpt::outln!("memory in {unit} (decimal) per rank; states = params + grads + optimizer kept between steps (fsdp's gathered units are in params and total); other = scratch (sharded strategies' gradient pieces and shard copies, a batch in parts' gradient sums); total = params + grads + optim + activ + other; host = offloaded to host memory");
    distgpt::outln!(
        "{:<44} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>12}  fits",
        "layout",
        "params",
        "grads",
        "optim",
        "states",
        "activ",
        "other",
        "total",
        "host",
        "compute ms",
        "comm ms",
        "optim ms",
        "step ms",
        "tokens/s"
    );
    for p in all {
        let (m, t) = (&p.memory, &p.time);
        distgpt::outln!(
            "{:<44} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>12.0}  {}",
            p.parallel.layout_name(),
            m.params / scale,
            m.grads / scale,
            m.optimizer / scale,
            m.persistent_states() / scale,
            m.activations / scale,
            m.other / scale,
            m.total() / scale,
            m.host.total() / scale,
            t.compute_s * 1e3,
            t.comm_s * 1e3,
            t.optimizer_s * 1e3,
            t.step_s() * 1e3,
            p.tokens_per_s,
            if p.fits { "yes" } else { "NO" }
        );
    }
}

/// The network assumptions behind the comm times, in one line.
/// The rule activations are priced by: their element size, the sets a
/// pipeline stage holds, and what a recomputed block keeps.
fn activation_line(a: &PlanArgs) -> String {
    let rule = match a.recompute {
        true => {
            "priced as they are and recomputed, where a micro-batch keeps only its blocks' \
                 inputs and a stage one block's working set"
        }
        false => "every block's kept for the backward (--recompute keeps only the blocks' inputs)",
    };
    format!(
        "activations: {} bytes an element, a set for each micro-batch a stage holds \
         (1f1b: p - s on stage s of p; gpipe: all); {rule}",
        a.precision.activation_bytes()
    )
}

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
    let host = match net.host_memory_bytes.is_finite() {
        true => format!(
            "; {:.0} GB of host memory a node",
            net.host_memory_bytes / 1e9
        ),
        false => String::new(),
    };
    format!(
        "network: {} ranks per node; within a node {}; across nodes {}{host}",
        net.ranks_per_node,
        link(net.intra_bandwidth, net.intra_latency_s),
        link(net.inter_bandwidth, net.inter_latency_s)
    )
}

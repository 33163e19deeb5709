//! The peaks MFU is stated against: the best matmul's FLOP/s (on the CPU,
//! the fastest of the libraries there are, `backend::cpu::blas`) and the
//! hardware's (cores x FMA units x lanes x 2 x clock), measured once per
//! device and thread count, then kept in `peak.json` in distgpt's cache
//! directory with the matmul library chosen, so every run on a machine
//! divides by the same numbers and runs its products on the same library (a
//! probe at each start drifted 49-173 GFLOP/s with the machine's load).
//! `--peak-tflops` states another; `distgpt devices --measure` measures
//! again (on a quiet machine). A debug build's figures are kept apart from
//! a release build's: its own code, the hardware loop and every product
//! compiled into it, runs unoptimized, so it reads far lower (a debug
//! `devices --measure` kept 72 GFLOP/s for a 200 GFLOP/s machine, and the
//! release runs that adopted it reported MFU above 100%).

use crate::backend::cpu::blas::MatmulLib;
use crate::backend::cpu::blas::{self, MatmulChoice, Timing};
use crate::backend::cpu::hardware::{has_amx, HardwarePeak};
use crate::backend::{memory_is_host, Backend, Category, MatmulForward, MatmulShape, WeightLayout};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The cache file's name in the cache directory.
pub const PEAK_FILE: &str = "peak.json";

/// The version of the measurement an entry holds: an entry of an older one
/// is measured over. 1: the hardware peak's loops are the fastest of many
/// short trials, so a load on the machine no longer lowers it; the
/// attention class is timed on the key tiles attention now runs. 2: entries
/// say which kind of build measured them ([`Entry::debug_build`]); an older
/// one may be a debug build's. 3: where the CPU multiplies bf16, each
/// library's bf16 product is timed and may be chosen for `--precision
/// bf16`'s products. 4: the built-in's attention blocks run on distgpt's
/// tile kernel where the CPU has one. 5: the hardware peak keeps the clock
/// its FMA loop ran at ([`HardwarePeak::fma_clock_ghz`]). 6: the hardware
/// peak counts physical cores (an SMT host's was twice its cores').
const PROBE: u32 = 6;

/// Whether this build is a debug build (its own code unoptimized), whose
/// measurements are kept apart from a release build's.
const DEBUG_BUILD: bool = cfg!(debug_assertions);

/// One measured peak.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// The backend's name (the CPU, or the OpenCL device).
    pub device: String,
    /// The host's CPU model (a cache directory may be shared between machines).
    pub host: String,
    pub threads: usize,
    /// The best matmul's FLOP/s.
    pub flops: f64,
    /// Seconds since the Unix epoch of the measurement.
    pub measured_unix: u64,
    /// The CPU's hardware peak (absent for other devices, or a cache
    /// written before it was measured).
    #[serde(default)]
    pub hardware: Option<HardwarePeak>,
    /// The CPU's matmul library per class of product.
    #[serde(default)]
    pub matmul: Option<MatmulChoice>,
    /// Every CPU matmul library's speed.
    #[serde(default)]
    pub timings: Vec<Timing>,
    /// The measurement's version (`PROBE`; 0 before it was kept).
    #[serde(default)]
    pub probe: u32,
    /// Measured by a debug build: read only by debug builds.
    #[serde(default)]
    pub debug_build: bool,
    /// The CPUs the measuring threads could run on (as many as the
    /// threads, or fewer where the affinity or quota allows fewer): a peak
    /// of 2 cores is not read under `taskset -c 0`.
    #[serde(default)]
    pub cpus: usize,
}

/// A peak and where it came from, for the run's header line.
#[derive(Clone, Debug, PartialEq)]
pub struct Peak {
    /// The best matmul's FLOP/s.
    pub flops: f64,
    pub source: String,
    pub hardware: Option<HardwarePeak>,
    pub matmul: Option<MatmulChoice>,
    pub timings: Vec<Timing>,
}

impl Peak {
    fn new(probe: PeakProbe, source: String) -> Peak {
        Peak {
            flops: probe.flops,
            source,
            hardware: probe.hardware,
            matmul: probe.matmul,
            timings: probe.timings,
        }
    }

    /// What the matmul peak is of: "best matmul, OpenBLAS" on the CPU.
    pub fn matmul_name(&self) -> String {
        let best = |m: &MatmulChoice| format!("best matmul, {}", m.describe());
        self.matmul.as_ref().map_or("matmul".into(), best)
    }

    /// The hardware peak MFU is stated against: with `bf16` (`--precision
    /// bf16`) whose layer products run in bf16 arithmetic, the cores' bf16
    /// peak (AMX's where the CPU has it and the product is a library's,
    /// which may use it; distgpt's own kernel is AVX512-BF16's), else their
    /// FMA units'.
    pub fn hardware_peak(&self, bf16: bool) -> Option<HardwarePeak> {
        self.hardware_peak_on(bf16, has_amx())
    }

    /// [`Peak::hardware_peak`] on a CPU with AMX-BF16 tiles or not.
    fn hardware_peak_on(&self, bf16: bool, amx: bool) -> Option<HardwarePeak> {
        let hw = self.hardware.as_ref()?;
        Some(match self.matmul.and_then(|m| m.bf16).filter(|_| bf16) {
            Some(lib) => hw.bf16(lib != MatmulLib::Gemm && amx),
            None => hw.clone(),
        })
    }

    /// The matmul peak a run's MFU is stated against, and what it is of:
    /// with `bf16` (`--precision bf16`) whose layer products run in bf16
    /// arithmetic, that product's measured speed; else [`Peak::flops`].
    pub fn matmul_peak(&self, bf16: bool) -> (f64, String) {
        let on_bf16 = self.matmul.and_then(|m| m.bf16).filter(|_| bf16);
        let timed = on_bf16.and_then(|lib| {
            let t = self.timings.iter().find(|t| t.lib == lib)?;
            Some((t.bf16_flops?, lib))
        });
        match timed {
            Some((flops, lib)) => (flops, format!("best bf16 matmul, {}", lib.bf16_name())),
            None => (self.flops, self.matmul_name()),
        }
    }
}

/// What a device's peak probe found: the best matmul's FLOP/s (MFU's
/// denominator), and on the CPU the hardware peak and the library each
/// class of product runs on, with every library's timings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeakProbe {
    pub flops: f64,
    pub hardware: Option<HardwarePeak>,
    pub matmul: Option<MatmulChoice>,
    pub timings: Vec<Timing>,
}

/// Measures `be`'s peak now, with no cache: on the host's CPU (a backend
/// whose buffers are host memory) its matmul libraries timed on
/// GPT-2-shaped products, the one the layers run on giving the matmul peak,
/// and the hardware peak above the fastest of them; on another device the
/// best of three GPT-2-small MLP products through its own matmul kernel.
pub fn measure<B: Backend>(be: &B) -> PeakProbe {
    if !memory_is_host(be).unwrap_or(false) {
        return PeakProbe {
            flops: matmul_flops(be),
            ..PeakProbe::default()
        };
    }
    let (matmul, timings) = blas::measure(3);
    let flops = layers_flops(&timings, matmul).unwrap_or(0.0);
    let fastest = timings
        .iter()
        .map(|t| t.large_flops.max(t.small_flops))
        .fold(0.0, f64::max);
    PeakProbe {
        flops,
        hardware: crate::backend::cpu::hardware::measure_above(fastest),
        matmul: Some(matmul),
        timings,
    }
}

/// The speed of the library `choice` runs the layers on, where it was
/// timed (the crate may keep them against one up to 5% faster).
fn layers_flops(timings: &[Timing], choice: MatmulChoice) -> Option<f64> {
    let t = timings.iter().find(|t| t.lib == choice.large)?;
    Some(t.large_flops)
}

/// Best of three GPT-2-small MLP products' FLOP/s on `be`'s own matmul
/// kernel (NaN when one fails).
fn matmul_flops<B: Backend>(be: &B) -> f64 {
    // A GPT-2-small MLP product: (rows x 768) @ (768 x 3072).
    let (rows, k, n) = (256, 768, 3072);
    let bufs = (
        be.clone_fresh().alloc(rows * n, Category::Other),
        be.clone_fresh().alloc(rows * k, Category::Other),
        be.clone_fresh().alloc(k * n, Category::Other),
    );
    let (Ok(mut out), Ok(inp), Ok(w)) = bufs else {
        return f64::NAN;
    };
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        let ran = be.run(MatmulForward {
            out: out.d().into(),
            inp: inp.s().into(),
            w: w.s().into(),
            bias: None,
            residual: None,
            shape: MatmulShape::new((rows, k, n), WeightLayout::InOut),
            accumulate: false,
        });
        if ran.and_then(|()| be.synchronize()).is_err() {
            return f64::NAN;
        }
        best = best.min(t0.elapsed().as_secs_f64());
    }
    2.0 * (rows * k * n) as f64 / best
}

/// distgpt's cache directory: `$DISTGPT_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/distgpt`, else `~/.cache/distgpt`.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    var("DISTGPT_CACHE_DIR").map(PathBuf::from).or_else(|| {
        var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|d| d.join("distgpt"))
    })
}

/// The file's entries as JSON values, each read on its own (an array of
/// them; anything else is no entry).
fn read_values(file: &Path) -> Vec<serde_json::Value> {
    // a pipe there would block the read (Ctrl-C cannot end it): no entry
    crate::store::read_text(file)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// The entries this version reads (another version's, or another
/// machine's, that it cannot are left in the file, unread).
fn read(file: &Path) -> Vec<Entry> {
    (read_values(file).into_iter())
        .filter_map(|v| serde_json::from_value(v).ok())
        .collect()
}

/// Adds or replaces `entry`, keeping every other entry as it was (one it
/// cannot read too), under a lock on `peak.json.lock` (two runs storing at
/// once each kept the other's out) and writing the file whole, then
/// renaming it, so a run never reads half a file.
fn store(file: &Path, entry: Entry) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let lock = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(file.with_extension("json.lock"))?;
    lock.lock()?;
    let mut all = read_values(file);
    all.retain(|v| serde_json::from_value::<Entry>(v.clone()).map_or(true, |e| !e.same_as(&entry)));
    all.push(serde_json::to_value(&entry).map_err(std::io::Error::other)?);
    let text = serde_json::to_string_pretty(&all).map_err(std::io::Error::other)?;
    // a full disk keeps no half-written copy
    crate::store::write_atomic(file, text.as_bytes()).map_err(std::io::Error::other)
}

/// The CPUs `threads` threads of this process may run on (its affinity
/// and quota may allow fewer): what a CPU peak counts.
fn cpus(threads: usize) -> usize {
    threads.min(std::thread::available_parallelism().map_or(1, |n| n.get()))
}

impl Entry {
    /// Whether its figures can be used: a positive matmul rate and, where
    /// it has one, a hardware peak that holds together (an entry edited or
    /// damaged by hand is measured again, not stated as a peak).
    fn trusted(&self) -> bool {
        self.flops.is_finite()
            && self.flops > 0.0
            && self
                .hardware
                .as_ref()
                .is_none_or(HardwarePeak::holds_together)
    }

    /// Whether `other` is a measurement of the same thing.
    fn same_as(&self, other: &Entry) -> bool {
        self.key() == other.key()
    }

    fn key(&self) -> (&str, &str, usize, bool, usize) {
        (
            &self.device,
            &self.host,
            self.threads,
            self.debug_build,
            self.cpus,
        )
    }
}

/// The CPU model from /proc/cpuinfo ("unknown" elsewhere).
fn host() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The peak of `device` at `threads` threads kept in `file` by this kind of
/// build, and whether this version of the probe (or a later one) measured it.
fn lookup(file: &Path, device: &str, host: &str, threads: usize) -> Option<(Peak, bool)> {
    let key = (device, host, threads, DEBUG_BUILD, cpus(threads));
    let e = read(file)
        .into_iter()
        .find(|e| e.key() == key && e.trusted())?;
    let current = e.probe >= PROBE;
    let source = format!(
        "measured {}{}{} and kept in {}",
        super::date(e.measured_unix),
        if DEBUG_BUILD { " by a debug build" } else { "" },
        if current {
            ""
        } else {
            " by an older probe (`distgpt devices --measure` renews it)"
        },
        file.display()
    );
    let peak = Peak {
        flops: e.flops,
        source,
        hardware: e.hardware,
        matmul: e.matmul,
        timings: e.timings,
    };
    Some((peak, current))
}

/// The peak of `device` at `threads` threads from `file` (unless `fresh`),
/// or `measure`d and stored there.
pub fn lookup_or_measure(
    file: Option<&Path>,
    device: &str,
    threads: usize,
    fresh: bool,
    measure: impl FnOnce() -> PeakProbe,
) -> Peak {
    let host = host();
    if let Some(p) = file
        .filter(|_| !fresh)
        .and_then(|f| lookup(f, device, &host, threads))
        .filter(|(_, current)| *current)
    {
        return p.0;
    }
    // said, not silent: it takes seconds and is kept for every later run
    crate::errln!(
        "measuring the peak of {device} and timing its matmul libraries, once: kept for \
         later runs ({}), `distgpt devices --measure` redoes it",
        file.map_or("not kept: no cache directory".into(), |f| f
            .display()
            .to_string())
    );
    let probe = measure();
    let flops = probe.flops;
    let source = match file {
        Some(f) if flops.is_finite() && flops > 0.0 => {
            let entry = Entry {
                device: device.to_string(),
                host,
                threads,
                flops,
                measured_unix: super::unix_now(),
                hardware: probe.hardware.clone(),
                matmul: probe.matmul,
                timings: probe.timings.clone(),
                probe: PROBE,
                debug_build: DEBUG_BUILD,
                cpus: cpus(threads),
            };
            let kind = if DEBUG_BUILD { " for debug builds" } else { "" };
            match store(f, entry) {
                Ok(()) => format!("measured now, kept{kind} in {}", f.display()),
                Err(e) => format!("measured now; not kept ({}: {e})", f.display()),
            }
        }
        _ => "measured now".to_string(),
    };
    Peak::new(probe, source)
}

/// Runs the CPU's products on the library `peak` chose, if it chose one,
/// and names in it what runs: the pins (`DISTGPT_MATMUL`,
/// `DISTGPT_MATMUL_BF16`), or a choice made before (a resume's), over the
/// kept one, with the layers' library's timed speed, so that the peaks a
/// run is stated against are of the products it runs.
fn adopt(mut peak: Option<Peak>) -> Option<Peak> {
    let p = peak.as_mut()?;
    if let Some(kept) = p.matmul {
        blas::set_choice(kept);
        let runs = blas::choice();
        p.flops = layers_flops(&p.timings, runs).unwrap_or(p.flops);
        p.matmul = Some(runs);
    }
    peak
}

/// The cached peak of `be` with this thread pool's threads, if measured
/// before (by any version of the probe: what is kept, never measured
/// here); its matmul library runs the CPU's products from now on.
pub fn cached<B: Backend>(be: &B) -> Option<Peak> {
    let file = cache_dir()?.join(PEAK_FILE);
    let kept = lookup(&file, &be.name(), &host(), rayon::current_num_threads());
    adopt(kept.map(|(peak, _)| peak))
}

/// The peak of `be` with this thread pool's threads, from the cache or
/// (`fresh`, or not cached yet) measured and cached; its matmul library
/// runs the CPU's products from now on.
pub fn of<B: Backend>(be: &B, fresh: bool) -> Peak {
    let file = cache_dir().map(|d| d.join(PEAK_FILE));
    let peak = lookup_or_measure(
        file.as_deref(),
        &be.name(),
        rayon::current_num_threads(),
        fresh,
        || measure(be),
    );
    adopt(Some(peak)).expect("a peak")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// The CPU's probe times every library it can open and keeps, as the
    /// matmul peak, the timed speed of the one it chose for the layers.
    #[test]
    fn the_cpus_probe_keeps_the_speed_of_the_library_it_chose() {
        let p = measure(&crate::backend::cpu::Cpu::new());
        let chosen = p.matmul.expect("the CPU's probe chooses a library");
        assert!(p.timings.iter().any(|t| t.lib == MatmulLib::Gemm), "{p:?}");
        assert_eq!(Some(p.flops), layers_flops(&p.timings, chosen), "{p:?}");
        assert!(p.flops > 0.0, "{p:?}");
    }

    /// A run's matmul peak is the timed speed of the library its layers
    /// run on (the large products'), none where that library was not timed.
    #[test]
    fn the_layers_speed_is_their_librarys_large_products() {
        use crate::backend::cpu::blas::MatmulLib;
        let timing = |lib, large_flops| Timing {
            lib,
            large_flops,
            small_flops: 7.0,
            bf16_flops: None,
        };
        let timings = [
            timing(MatmulLib::Gemm, 300.0),
            timing(MatmulLib::Blis, 400.0),
        ];
        let on = |large| MatmulChoice {
            large,
            ..MatmulChoice::BUILT_IN
        };
        assert_eq!(layers_flops(&timings, on(MatmulLib::Blis)), Some(400.0));
        assert_eq!(layers_flops(&timings, on(MatmulLib::Gemm)), Some(300.0));
        assert_eq!(layers_flops(&timings, on(MatmulLib::Mkl)), None);
    }

    #[test]
    fn a_bf16_run_on_a_bf16_product_is_stated_against_that_products_speed() {
        use crate::backend::cpu::blas::{MatmulLib, Timing};
        let timing = |lib, bf16_flops| Timing {
            lib,
            large_flops: 400.0,
            small_flops: 300.0,
            bf16_flops,
        };
        let peak = |bf16| Peak {
            flops: 400.0,
            source: String::new(),
            hardware: None,
            matmul: Some(MatmulChoice {
                bf16,
                ..MatmulChoice::BUILT_IN
            }),
            timings: vec![
                timing(MatmulLib::Gemm, Some(700.0)),
                timing(MatmulLib::Mkl, Some(500.0)),
            ],
        };
        let on_kernel = peak(Some(MatmulLib::Gemm));
        let (flops, name) = on_kernel.matmul_peak(true);
        assert_eq!(flops, 700.0);
        assert!(name.contains("AVX512-BF16 kernel"), "{name}");
        assert_eq!(peak(Some(MatmulLib::Mkl)).matmul_peak(true).0, 500.0);
        // fp32 runs, and bf16 runs whose products stay in fp32: the
        // library chosen, named
        let (flops, name) = on_kernel.matmul_peak(false);
        assert_eq!(flops, 400.0);
        let chosen = MatmulChoice {
            bf16: Some(MatmulLib::Gemm),
            ..MatmulChoice::BUILT_IN
        };
        assert_eq!(name, format!("best matmul, {}", chosen.describe()));
        assert_eq!(peak(None).matmul_peak(true).0, 400.0);
        let unmeasured = Peak {
            matmul: None,
            ..peak(None)
        };
        assert_eq!(unmeasured.matmul_peak(false).1, "matmul");
    }

    /// A bf16 run whose products run in bf16 is stated against the cores'
    /// bf16 peak (AMX's only for a library's product on a CPU with AMX);
    /// fp32 runs, and bf16 runs whose products stay in fp32, against the
    /// FMA units'.
    #[test]
    fn a_bf16_run_on_a_bf16_product_is_stated_against_the_bf16_hardware() {
        let hw = HardwarePeak {
            flops: 2.0 * 16.0 * 2.0 * 3.0e9,
            cores: 2,
            fma_units: 1,
            lanes: 16,
            isa: "AVX-512".into(),
            clock_ghz: 3.0,
            fma_clock_ghz: Some(3.0),
        };
        let peak = |bf16| Peak {
            flops: 100e9,
            source: String::new(),
            hardware: Some(hw.clone()),
            matmul: Some(MatmulChoice {
                bf16,
                ..MatmulChoice::BUILT_IN
            }),
            timings: Vec::new(),
        };
        for amx in [false, true] {
            let kernel = peak(Some(MatmulLib::Gemm));
            assert_eq!(kernel.hardware_peak_on(false, amx), Some(hw.clone()));
            assert_eq!(kernel.hardware_peak_on(true, amx), Some(hw.bf16(false)));
            assert_eq!(peak(None).hardware_peak_on(true, amx), Some(hw.clone()));
            let mkl = peak(Some(MatmulLib::Mkl)).hardware_peak_on(true, amx);
            assert_eq!(mkl, Some(hw.bf16(amx)), "amx {amx}");
        }
        let unmeasured = Peak {
            hardware: None,
            ..peak(None)
        };
        assert_eq!(unmeasured.hardware_peak(true), None);
        let here = peak(Some(MatmulLib::Mkl)).hardware_peak(true);
        assert_eq!(here, Some(hw.bf16(has_amx())));
    }

    #[test]
    fn a_devices_probe_is_its_products_flops_over_the_best_of_three() {
        // measured through the CPU's kernel: the best of three runs is at
        // most their mean, so its FLOP/s is at least the product's FLOPs
        // over a third of the time all three took (and finite)
        let be = crate::backend::cpu::Cpu::new();
        let t0 = Instant::now();
        let flops = matmul_flops(&be);
        let all_three = t0.elapsed().as_secs_f64();
        let product = 2.0 * (256 * 768 * 3072) as f64;
        assert!(flops.is_finite(), "{flops}");
        assert!(
            flops >= product / (all_three / 3.0),
            "{flops} FLOP/s over {all_three} s"
        );
    }

    /// A kept entry whose figures do not hold together (a hardware peak of
    /// -1 FLOP/s, or 1e308 or half of what its terms make, 64 GFLOP/s; terms
    /// of no cores making 0; a matmul rate of 0) is not read: it is measured
    /// again, where it was stated as the peak (MFU -9.3e11%). What the probe
    /// measures here holds together.
    #[test]
    fn a_kept_peak_whose_figures_do_not_hold_together_is_not_read() {
        let root = crate::testdir::TestDir::new("peak-trust");
        let file = root.path().join(PEAK_FILE);
        let entry = |flops: f64, hardware_flops: f64, cores: usize| {
            let hardware = HardwarePeak {
                flops: hardware_flops,
                cores,
                fma_units: 2,
                lanes: 8,
                isa: "AVX2".into(),
                clock_ghz: 1.0,
                fma_clock_ghz: Some(1.0),
            };
            let entry = format!(
                r#"[{{"device":"cpu A","host":"{}","threads":2,"flops":{flops:e},"measured_unix":0,"probe":{PROBE},"debug_build":{},"cpus":{},"hardware":{}}}]"#,
                host(),
                DEBUG_BUILD,
                cpus(2),
                serde_json::to_string(&hardware).unwrap()
            );
            std::fs::write(&file, entry).unwrap();
            lookup(&file, "cpu A", &host(), 2).map(|(p, _)| p.flops)
        };
        assert_eq!(entry(5.0, 64e9, 2), Some(5.0));
        for (flops, hardware, cores) in [
            (5.0, -1.0, 2),
            (5.0, 1e308, 2),
            (5.0, 32e9, 2),
            (5.0, 0.0, 2),
            (5.0, 0.0, 0),
            (0.0, 64e9, 2),
        ] {
            let read = entry(flops, hardware, cores);
            assert_eq!(read, None, "{flops} {hardware} {cores}");
        }
        if let Some(hw) = crate::backend::cpu::hardware::measure() {
            for peak in [hw.clone(), hw.bf16(false), hw.bf16(true)] {
                assert!(peak.holds_together(), "{peak:?}");
            }
        }
    }

    #[test]
    fn a_peak_is_measured_once_per_device_and_thread_count() {
        let root = crate::testdir::TestDir::new("peak");
        // a folder the cache must make
        let dir = root.path().join("cache");
        let file = dir.join(PEAK_FILE);
        let calls = Cell::new(0);
        let probe = |v: f64| {
            let calls = &calls;
            move || {
                calls.set(calls.get() + 1);
                PeakProbe {
                    flops: v + calls.get() as f64,
                    matmul: Some(MatmulChoice::BUILT_IN),
                    ..PeakProbe::default()
                }
            }
        };
        let first = lookup_or_measure(Some(&file), "cpu A", 2, false, probe(100.0));
        assert_eq!(first.flops, 101.0);
        assert!(first.source.starts_with("measured now, kept"));
        let again = lookup_or_measure(Some(&file), "cpu A", 2, false, probe(500.0));
        assert_eq!(again.flops, 101.0, "read back, not measured");
        assert_eq!(
            again.matmul,
            Some(MatmulChoice::BUILT_IN),
            "with its library"
        );
        assert!(again.source.starts_with("measured 20"), "{}", again.source);
        assert_eq!(calls.get(), 1);
        let other = lookup_or_measure(Some(&file), "cpu A", 1, false, probe(10.0));
        assert_eq!(other.flops, 12.0, "another thread count is another peak");
        assert_eq!(read(&file).len(), 2);
        std::fs::write(&file, "{ not json").unwrap();
        let fresh = lookup_or_measure(Some(&file), "cpu A", 2, false, probe(7.0));
        assert_eq!(fresh.flops, 10.0, "a corrupt cache is measured over");
        assert_eq!(read(&file).len(), 1);
        let asked = lookup_or_measure(Some(&file), "cpu A", 2, true, probe(0.0));
        assert_eq!(asked.flops, 4.0, "measured again when asked");
        assert_eq!(read(&file)[0].flops, 4.0);
        // a cache written before the hardware peak and library were kept
        std::fs::write(
            &file,
            r#"[{"device":"cpu A","host":"h","threads":2,"flops":5.0,"measured_unix":0}]"#,
        )
        .unwrap();
        let old = read(&file);
        assert_eq!(
            (old.len(), old[0].matmul, old[0].hardware.is_none()),
            (1, None, true)
        );
        // an entry an older measurement wrote is measured over
        std::fs::write(
            &file,
            format!(
                r#"[{{"device":"cpu A","host":"{}","threads":2,"flops":5.0,"measured_unix":0,"debug_build":{},"cpus":{}}}]"#,
                host(),
                DEBUG_BUILD,
                cpus(2)
            ),
        )
        .unwrap();
        let (stale, current) = lookup(&file, "cpu A", &host(), 2).unwrap();
        assert!(
            !current && stale.source.contains("older probe"),
            "{}",
            stale.source
        );
        let before = calls.get();
        let newer = lookup_or_measure(Some(&file), "cpu A", 2, false, probe(20.0));
        assert_eq!(
            (calls.get(), newer.flops),
            (before + 1, 20.0 + calls.get() as f64)
        );
        assert_eq!(read(&file)[0].probe, PROBE);
        // the other kind of build's entry (a debug build's for a release
        // build, and the reverse) is neither read nor replaced
        let other_build = format!(
            r#"[{{"device":"cpu A","host":"{}","threads":2,"flops":5.0,"measured_unix":0,"probe":{PROBE},"debug_build":{},"cpus":{}}}]"#,
            host(),
            !DEBUG_BUILD,
            cpus(2)
        );
        std::fs::write(&file, other_build).unwrap();
        let before = calls.get();
        let own = lookup_or_measure(Some(&file), "cpu A", 2, false, probe(30.0));
        assert_eq!(
            (calls.get(), own.flops),
            (before + 1, 30.0 + calls.get() as f64)
        );
        let kept = read(&file);
        assert_eq!(kept.len(), 2, "both kinds kept");
        assert!(kept
            .iter()
            .any(|e| e.debug_build != DEBUG_BUILD && e.flops == 5.0));
        let again = lookup_or_measure(Some(&file), "cpu A", 2, false, probe(40.0));
        assert_eq!(
            again.flops, own.flops,
            "this build's own entry is read back"
        );
        let nowhere = lookup_or_measure(None, "cpu A", 2, false, probe(1.0));
        assert_eq!(nowhere.source, "measured now");
        // an entry this version cannot read (another machine's, a later
        // version's library) stays in the file, unread; one measured with
        // other CPUs to run on (another affinity or quota) is not read
        let foreign = format!(
            r#"[{{"device":"cpu A","host":"{}","threads":2,"flops":5.0,"measured_unix":0,"probe":{PROBE},"debug_build":{},"cpus":{},"matmul":{{"large":"cublas"}}}},
               {{"device":"cpu A","host":"{}","threads":2,"flops":6.0,"measured_unix":0,"probe":{PROBE},"debug_build":{},"cpus":{}}}]"#,
            host(),
            DEBUG_BUILD,
            cpus(2),
            host(),
            DEBUG_BUILD,
            cpus(2) + 64
        );
        std::fs::write(&file, foreign).unwrap();
        let before = calls.get();
        let ours = lookup_or_measure(Some(&file), "cpu A", 2, false, probe(50.0));
        assert_eq!(
            (calls.get(), ours.flops),
            (before + 1, 50.0 + calls.get() as f64)
        );
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(
            text.contains("cublas"),
            "the unreadable entry was dropped: {text}"
        );
        assert_eq!(read_values(&file).len(), 3, "{text}");
    }
}

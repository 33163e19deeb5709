//! Per-kernel timing (`distgpt bench --profile`): while it is on, every
//! [`Kernels`](super::Kernels) call of this process adds its wall time, a
//! call and the model FLOPs it stands for to its operation's counters. A
//! device that queues its kernels (the GPU backends) finishes the queue
//! before and after each one while it is on, so each kernel's time is its
//! own. Off (the default), a kernel pays one relaxed load.
//!
//! The counters are the process's: thread ranks and a rank's batch parts
//! (`model::parts`) add into the same ones, each from its own thread. Time
//! is shared out as it passes: each moment goes in equal parts to the
//! kernels running then, so the operations' times add up to the process's
//! wall time in kernels, not to its thread time.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

/// A profile's counters; the process's are one static, [`PROCESS`].
pub struct Counters {
    on: AtomicBool,
    state: Mutex<State>,
}

struct State {
    /// Every kernel counted since the process began, in the order first
    /// seen ([`Counters::start`] zeroes them).
    totals: Vec<OpTotal>,
    /// The kernels running now (their places in `totals`), and since when
    /// the time was last shared out.
    running: Vec<usize>,
    since: Option<Instant>,
    /// When counting started, and how long it ran once stopped.
    opened: Option<Instant>,
    window: f64,
}

impl State {
    /// Shares the time since the last change among the kernels running.
    fn share(&mut self, now: Instant) {
        if let Some(since) = self.since.filter(|_| !self.running.is_empty()) {
            let each = (now - since).as_secs_f64() / self.running.len() as f64;
            for &i in &self.running {
                self.totals[i].seconds += each;
            }
        }
        self.since = Some(now);
    }

    /// Where kernel `name` is counted, a new place the first time.
    fn place(&mut self, name: &'static str) -> usize {
        if let Some(i) = self.totals.iter().position(|t| t.name == name) {
            return i;
        }
        self.totals.push(OpTotal {
            name,
            calls: 0,
            seconds: 0.0,
            flops: 0.0,
        });
        self.totals.len() - 1
    }
}

impl Counters {
    pub const fn new() -> Self {
        Counters {
            on: AtomicBool::new(false),
            state: Mutex::new(State {
                totals: Vec::new(),
                running: Vec::new(),
                since: None,
                opened: None,
                window: 0.0,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Zeroes the counters and starts counting.
    pub fn start(&self) {
        let mut s = self.state();
        for t in &mut s.totals {
            (t.calls, t.seconds, t.flops) = (0, 0.0, 0.0);
        }
        (s.opened, s.window) = (Some(Instant::now()), 0.0);
        self.on.store(true, Relaxed);
    }

    /// Stops counting; what was counted stays for [`Counters::snapshot`].
    pub fn stop(&self) {
        self.on.store(false, Relaxed);
        let mut s = self.state();
        s.window = s.opened.map_or(0.0, |t| t.elapsed().as_secs_f64());
    }

    /// Seconds from [`Counters::start`] to [`Counters::stop`]: the wall
    /// time every counted kernel ran within.
    pub fn window(&self) -> f64 {
        self.state().window
    }

    /// Runs kernel `name` (`flops` model FLOPs) through `run`, counted
    /// while on; `finish` waits for the device's queued work, and is called
    /// before and after `run` only then.
    pub fn timed<R>(
        &self,
        name: &'static str,
        flops: f64,
        finish: impl Fn(),
        run: impl FnOnce() -> R,
    ) -> R {
        if !self.on.load(Relaxed) {
            return run();
        }
        finish();
        let i = {
            let mut s = self.state();
            s.share(Instant::now());
            let i = s.place(name);
            s.running.push(i);
            i
        };
        let out = run();
        finish();
        let mut s = self.state();
        s.share(Instant::now());
        if let Some(at) = s.running.iter().position(|&r| r == i) {
            s.running.swap_remove(at);
        }
        s.totals[i].calls += 1;
        s.totals[i].flops += flops;
        out
    }

    /// The kernels that ran since [`Counters::start`], most time first.
    pub fn snapshot(&self) -> Vec<OpTotal> {
        let s = self.state();
        let mut out: Vec<OpTotal> = s.totals.iter().filter(|t| t.calls > 0).copied().collect();
        out.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        out
    }
}

impl Default for Counters {
    fn default() -> Self {
        Self::new()
    }
}

/// The process's counters: every kernel call of every rank in it. Start
/// them where no kernel runs (between two barriers of every rank that
/// shares the process).
pub static PROCESS: Counters = Counters::new();

/// One kernel's totals since [`Counters::start`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpTotal {
    /// A [`Kernel`](super::Kernel)'s own name, or a
    /// [`Kernels`](super::Kernels) method's.
    pub name: &'static str,
    pub calls: u64,
    /// Wall seconds: each moment of its calls shared with the kernels
    /// running beside it.
    pub seconds: f64,
    /// Model FLOPs, counted as MFU counts them (attention's full T x T
    /// scores, causal or not); zero for the kernels MFU does not count.
    pub flops: f64,
}

/// Model FLOPs of a matmul of `shape` computing `products` of its
/// rows x k x n products (1 forward; 0 to 2 for a backward's halves).
pub fn matmul_flops(shape: super::MatmulShape, products: usize) -> f64 {
    2.0 * (shape.rows * shape.k * shape.n * products) as f64
}

/// Model FLOPs of attention over `shape`: Q K^T and A V, each 2 B T^2 C,
/// forward once, backward twice.
pub fn attention_flops(shape: super::AttnShape, backward: bool) -> f64 {
    let passes = if backward { 2.0 } else { 1.0 };
    passes * 4.0 * (shape.b * shape.t * shape.t * shape.c) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_a_kernel_only_while_on_and_waits_around_it() {
        let p = Counters::new();
        let finished = std::cell::Cell::new(0);
        let tick = || finished.set(finished.get() + 1);
        p.timed("sum", 5.0, tick, || ());
        assert_eq!(finished.get(), 0, "no waiting while off");
        assert!(p.snapshot().is_empty(), "nothing counted while off");
        p.start();
        let got = p.timed("sum_squares", 1e6, tick, || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            7
        });
        p.timed("sum_squares", 2e6, tick, || ());
        p.timed("fill", 0.0, tick, || ());
        p.stop();
        p.timed("fill", 0.0, tick, || ());
        assert_eq!(got, 7);
        assert_eq!(
            finished.get(),
            6,
            "the queue finished before and after each"
        );
        let s = p.snapshot();
        assert_eq!(s.len(), 2, "{s:?}");
        assert_eq!((s[0].name, s[0].calls, s[0].flops), ("sum_squares", 2, 3e6));
        assert!(s[0].seconds >= 0.02 && s[0].seconds < 5.0, "{s:?}");
        assert_eq!((s[1].name, s[1].calls), ("fill", 1));
        p.start();
        assert!(p.snapshot().is_empty(), "start zeroes");
    }

    #[test]
    fn kernels_side_by_side_share_their_wall_time() {
        let p = Counters::new();
        p.start();
        let nap = |ms| move || std::thread::sleep(std::time::Duration::from_millis(ms));
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for (op, ms) in [("fill", 300), ("copy", 100)] {
                let p = &p;
                s.spawn(move || p.timed(op, 0.0, || (), nap(ms)));
            }
        });
        let wall = t0.elapsed().as_secs_f64();
        p.stop();
        let s = p.snapshot();
        assert_eq!(
            (s[0].name, s[0].calls, s[1].name, s[1].calls),
            ("fill", 1, "copy", 1)
        );
        // their times add up to the wall time they ran in (not to 0.4 s):
        // the copy's 0.1 s shared with the fill, then the fill's alone
        let total = s[0].seconds + s[1].seconds;
        assert!(total >= 0.3 && total <= wall, "{s:?} in {wall} s");
        assert!(p.window() >= wall, "{} s", p.window());
        assert!(s[0].seconds > 2.5 * s[1].seconds, "{s:?}");
    }

    #[test]
    fn flops_follow_the_mfu_count() {
        use crate::backend::{AttnShape, MatmulShape, WeightLayout};
        let m = MatmulShape::new((4, 8, 16), WeightLayout::InOut);
        assert_eq!(matmul_flops(m, 1), 1024.0);
        assert_eq!(matmul_flops(m, 2), 2048.0);
        let s = AttnShape::new((2, 8, 16, 2), false);
        assert_eq!(attention_flops(s, false), 8192.0);
        assert_eq!(attention_flops(s, true), 16384.0);
    }
}

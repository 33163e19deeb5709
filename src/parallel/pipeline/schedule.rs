//! Pipeline schedules and programs, pure functions of the pipeline's shape:
//! GPipe (every micro-batch forward, then every backward: m in flight),
//! 1F1B (after p - s - 1 warm-up forwards stage s alternates one forward
//! and one backward: at most p - s in flight), interleaved 1F1B
//! (Megatron's: each rank holds v chunks of blocks, chunk c of rank s being
//! virtual stage c p + s, so micro-batches go round the ranks v times and
//! the warm-up and drain shrink v-fold) and zb-h1 (zero-bubble: each
//! backward split into its input half and its weight half, the weight
//! halves put off into the slots 1F1B idles). A rank's program is its list
//! of tasks (a pass of a micro-batch through a chunk) with the sends and
//! receives between them, in one order all ranks share; `programs` checks,
//! before a step runs, that every pair of ranks agrees on the order of its
//! messages and that the exchanges cannot deadlock even when sends wait
//! for their receives. Also here: how the units split into stages
//! (`partition`), how many micro-batches a stage keeps in flight, and the
//! bubble, by formula and as measured from a step's spans.

use crate::error::{Error, Result};
use crate::model::ParamLayout;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// How micro-batches flow through the stages.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
pub enum Schedule {
    /// All forwards, then all backwards (GPipe): every micro-batch in flight.
    #[value(name = "gpipe")]
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward (PipeDream-flush, Megatron's default).
    #[default]
    #[value(name = "1f1b")]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over v chunks of blocks per rank (Megatron's interleaved
    /// schedule, --virtual-stages v): a v-th of the bubble for more messages.
    #[value(name = "interleaved")]
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero-bubble ZB-H1: each backward split into its input half and its
    /// weight half, the weight halves put off into the slots 1F1B idles
    /// (GPT-2, fp32, no recomputation).
    #[value(name = "zb-h1")]
    #[serde(rename = "zb-h1")]
    ZbH1,
}

crate::display_as_flag!(Schedule);

/// Pipeline stages and their schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pipeline {
    pub stages: usize,
    pub schedule: Schedule,
    /// Chunks of blocks per rank (the interleaved schedule's v; 1 otherwise).
    #[serde(default = "one")]
    pub virtual_stages: usize,
}

fn one() -> usize {
    1
}

impl Default for Pipeline {
    fn default() -> Self {
        Pipeline {
            stages: 1,
            schedule: Schedule::default(),
            virtual_stages: 1,
        }
    }
}

impl std::fmt::Display for Pipeline {
    /// The schedule, with its chunks per rank when interleaved ("interleaved v2").
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.schedule {
            Schedule::Interleaved => write!(f, "interleaved v{}", self.virtual_stages),
            s => write!(f, "{s}"),
        }
    }
}

impl Pipeline {
    /// Stages over p ranks with this schedule, interleaved with `v` chunks a rank.
    pub fn new(stages: usize, schedule: Schedule, v: usize) -> Self {
        let virtual_stages = if schedule == Schedule::Interleaved {
            v
        } else {
            1
        };
        Pipeline {
            stages,
            schedule,
            virtual_stages,
        }
    }

    /// Refuses a schedule that cannot run `m` micro-batches on these stages.
    pub fn check_micro_batches(&self, m: usize) -> Result<()> {
        let (p, v) = (self.stages, self.virtual_stages);
        if self.schedule == Schedule::Interleaved && !m.is_multiple_of(p) {
            return Err(Error::Config(format!(
                "the interleaved schedule sends micro-batches through the {p} stages in groups of {p}: \
                 make --grad-accum a multiple of {p} (it is {m})"
            )));
        }
        if m == 0 || v == 0 {
            return Err(Error::Config(
                "a pipeline needs a micro-batch and a chunk".into(),
            ));
        }
        Ok(())
    }

    /// Every virtual stage's units (chunk c of rank s is virtual stage c p + s).
    pub fn partition(&self, layout: &ParamLayout) -> Vec<Range<usize>> {
        partition(layout, self.stages * self.virtual_stages)
    }

    /// The idle fraction of a step by the schedule's formula for m
    /// micro-batches: (p - 1) slots of m + p - 1 (GPipe and 1F1B alike;
    /// 1F1B keeps fewer activations, not fewer idle slots), a v-th of the
    /// warm-up and drain when interleaved: (p - 1) / (v m + p - 1); zb-h1
    /// idles (p - 1)(F + B - W) where 1F1B idles (p - 1)(F + B + W), with
    /// the forward F, input half B and weight half W taken equal:
    /// (p - 1) / (3 m + p - 1) for m >= p. Fewer micro-batches than
    /// stages leave zb-h1 slots no weight half fills: there the ideal
    /// machine's run says (p 4, m 1: 6 idle slots of 9, not 3 of 6).
    pub fn bubble(&self, m: usize) -> f64 {
        let (p, v) = (self.stages, self.virtual_stages);
        match self.schedule {
            Schedule::ZbH1 if m < p => ideal_bubble(*self, m),
            Schedule::ZbH1 => zb_h1_bubble(p, m, [1.0; 3]),
            _ => (p - 1) as f64 / (v * m + p - 1) as f64,
        }
    }

    /// The formula's bubble for a step whose passes took these spans:
    /// zb-h1's with their mean forward, input-half and weight-half times
    /// (the others' formulas need no times).
    pub fn expected_bubble(&self, m: usize, timelines: &[Vec<Span>]) -> f64 {
        if self.schedule != Schedule::ZbH1 || m < self.stages {
            return self.bubble(m);
        }
        let mean = |pass: Pass| {
            let d: Vec<f64> = (timelines.iter().flatten())
                .filter(|s| s.pass == pass)
                .map(|s| s.end - s.start)
                .collect();
            d.iter().sum::<f64>() / d.len().max(1) as f64
        };
        let times = [Pass::Forward, Pass::Backward, Pass::Weight].map(mean);
        zb_h1_bubble(self.stages, m, times)
    }

    /// How [`Pipeline::expected_bubble`] reckons the bubble of `m`
    /// micro-batches, in words.
    pub fn bubble_formula(&self, m: usize) -> String {
        match (self.schedule, self.virtual_stages) {
            (Schedule::ZbH1, _) if m < self.stages => {
                "the idle slots of equal passes (no formula below m = p)"
                    .to_string()
            }
            (Schedule::ZbH1, _) => {
                "(p - 1)(F + B - W) / (m (F + B + W) + (p - 1)(F + B - W)) with the measured mean F, B, W"
                    .to_string()
            }
            (_, 1) => "(p - 1) / (m + p - 1)".to_string(),
            (_, v) => format!("(p - 1) / ({v} m + p - 1)"),
        }
    }
}

/// zb-h1's idle fraction over p stages and m >= p micro-batches whose
/// forward, input half and weight half take [F, B, W]: each stage idles
/// (p - 1)(F + B - W) of m (F + B + W) + (p - 1)(F + B - W).
pub fn zb_h1_bubble(p: usize, m: usize, [f, b, w]: [f64; 3]) -> f64 {
    let idle = (p - 1) as f64 * (f + b - w);
    idle / (m as f64 * (f + b + w) + idle)
}

/// What a task runs of a micro-batch through a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    Forward,
    /// The backward; under zb-h1 only its input half.
    Backward,
    /// zb-h1's weight half of a backward.
    Weight,
}

/// One pass of a micro-batch through one of a rank's chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Task {
    pub pass: Pass,
    pub chunk: usize,
    pub micro_batch: usize,
}

/// Every rank's tasks, in order, for m micro-batches.
pub fn ranks_tasks(pipe: Pipeline, m: usize) -> Vec<Vec<Task>> {
    match pipe.schedule {
        Schedule::ZbH1 => zb_h1(pipe.stages, m),
        _ => (0..pipe.stages).map(|s| tasks(pipe, s, m)).collect(),
    }
}

/// Rank s's tasks, in order, for m micro-batches.
pub fn tasks(pipe: Pipeline, s: usize, m: usize) -> Vec<Task> {
    let (p, v) = (pipe.stages, pipe.virtual_stages);
    if pipe.schedule == Schedule::ZbH1 {
        return zb_h1(p, m).swap_remove(s);
    }
    let total = m * v;
    // the k-th forward: micro-batches in groups of p through chunk 0, then
    // the same group through chunk 1, ...; backwards through the chunks in reverse
    let forward = |k: usize| Task {
        pass: Pass::Forward,
        chunk: (k % (p * v)) / p,
        micro_batch: (k / (p * v)) * p + k % p,
    };
    let backward = |k: usize| Task {
        pass: Pass::Backward,
        chunk: v - 1 - forward(k).chunk,
        ..forward(k)
    };
    let warmup = match pipe.schedule {
        Schedule::GPipe => total,
        Schedule::OneFOneB | Schedule::ZbH1 => p - s - 1,
        Schedule::Interleaved => 2 * (p - s - 1) + (v - 1) * p,
    }
    .min(total);
    let mut out: Vec<Task> = (0..warmup).map(forward).collect();
    for i in 0..total - warmup {
        out.push(forward(warmup + i));
        out.push(backward(i));
    }
    out.extend((total - warmup..total).map(backward));
    out
}

/// Every stage's zb-h1 tasks in ZB-H1's order (Qi et al. 2023): for x =
/// 0, 1, ..., m + p - 2, stage s runs the forward of micro-batch x, the
/// input half of x - (p - 1 - s) and the weight half of x - (p - 1), those
/// that exist. Its forwards and input halves are 1F1B's (a warm-up of
/// p - s - 1), and the weight half comes s micro-batches after the input
/// half, filling the slots where 1F1B idles: a stage holds at most p
/// micro-batches' activations (1F1B's peak; a micro-batch keeps them until
/// its weight half) and idles p - 1 slots of equal passes for m >= p,
/// where 1F1B idles 3(p - 1). (It ran what it could, putting off up to
/// p - 1 weight halves on every stage: 2p - 1 micro-batches held on the
/// first, for no shorter step.)
fn zb_h1(p: usize, m: usize) -> Vec<Vec<Task>> {
    let stage = |s: usize| -> Vec<Task> {
        let passes = |x: usize| {
            [
                (Pass::Forward, Some(x)),
                (Pass::Backward, x.checked_sub(p - 1 - s)),
                (Pass::Weight, x.checked_sub(p - 1)),
            ]
        };
        (0..m + p - 1)
            .flat_map(passes)
            .filter_map(|(pass, k)| k.filter(|&k| k < m).map(|k| (pass, k)))
            .map(|(pass, micro_batch)| Task {
                pass,
                chunk: 0,
                micro_batch,
            })
            .collect()
    };
    (0..p).map(stage).collect()
}

/// An activation into virtual stage `into`, or a gradient into it from the
/// next, for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Message {
    /// The virtual stage that receives it.
    pub into: usize,
    pub gradient: bool,
    pub micro_batch: usize,
}

/// One send, one receive, or both at once (a send-receive), each with its
/// partner rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Exchange {
    pub send: Option<(usize, Message)>,
    pub recv: Option<(usize, Message)>,
}

/// A step of a rank's program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Run(Task),
    Swap(Exchange),
}

/// A rank's program: its tasks in order, with the messages it sends and
/// receives between them.
#[derive(Clone, Debug)]
pub struct Program {
    pub steps: Vec<Step>,
}

impl Program {
    pub fn tasks(&self) -> impl Iterator<Item = Task> + '_ {
        self.steps.iter().filter_map(|s| match s {
            Step::Run(t) => Some(*t),
            Step::Swap(_) => None,
        })
    }
}

/// The virtual stage a task of rank s runs on.
fn stage_of(t: &Task, s: usize, p: usize) -> usize {
    t.chunk * p + s
}

/// The message a task of rank s receives before it runs (`makes` false:
/// its sender and the message) or sends when it is done (its receiver and
/// the message): a forward's input comes from the virtual stage below and
/// its output goes up, a backward's gradients the other way.
pub(super) fn link(t: &Task, s: usize, pipe: Pipeline, makes: bool) -> Option<(usize, Message)> {
    let (p, last) = (pipe.stages, pipe.stages * pipe.virtual_stages - 1);
    let vs = stage_of(t, s, p);
    let other = match (t.pass, makes) {
        (Pass::Forward, false) | (Pass::Backward, true) if vs > 0 => vs - 1,
        (Pass::Forward, true) | (Pass::Backward, false) if vs < last => vs + 1,
        _ => return None,
    };
    let m = Message {
        into: if makes { other } else { vs },
        gradient: t.pass == Pass::Backward,
        micro_batch: t.micro_batch,
    };
    Some((other % p, m))
}

/// Every rank's tasks run on an ideal machine (a chunk's forward takes 1,
/// its backward 2 — or 1 and its weight half 1 under zb-h1 — messages are
/// free, a rank waits only for its inputs): each task with its start and end.
pub fn ideal_run(pipe: Pipeline, m: usize) -> Vec<Vec<(Task, u64, u64)>> {
    let p = pipe.stages;
    let progs = ranks_tasks(pipe, m);
    let (mut at, mut clock) = (vec![0; p], vec![0u64; p]);
    // when each message was made
    let mut made: std::collections::HashMap<Message, u64> = Default::default();
    let mut out = vec![Vec::new(); p];
    while (0..p).any(|s| at[s] < progs[s].len()) {
        let mut moved = false;
        for s in 0..p {
            while let Some(t) = progs[s].get(at[s]) {
                let ready = match link(t, s, pipe, false) {
                    None => 0,
                    Some((_, msg)) => match made.get(&msg) {
                        Some(&at) => at,
                        None => break,
                    },
                };
                let start = clock[s].max(ready);
                clock[s] = start + cost(pipe, t.pass);
                if let Some((_, msg)) = link(t, s, pipe, true) {
                    made.insert(msg, clock[s]);
                }
                out[s].push((*t, start, clock[s]));
                at[s] += 1;
                moved = true;
            }
        }
        assert!(
            moved,
            "{pipe}: the tasks of {m} micro-batches wait on each other"
        );
    }
    out
}

/// The idle share of the ideal machine's run of m micro-batches (zb-h1's,
/// kept once run: `plan` asks for each of its layouts).
fn ideal_bubble(pipe: Pipeline, m: usize) -> f64 {
    type Known = std::collections::BTreeMap<(Schedule, usize, usize, usize), f64>;
    static KNOWN: std::sync::Mutex<Known> = std::sync::Mutex::new(Known::new());
    let key = (pipe.schedule, pipe.stages, pipe.virtual_stages, m);
    let known = KNOWN.lock().ok().and_then(|k| k.get(&key).copied());
    known.unwrap_or_else(|| {
        let runs = ideal_run(pipe, m);
        let end = runs.iter().flatten().map(|&(_, _, e)| e).max().unwrap_or(0);
        let busy: u64 = runs.iter().flatten().map(|&(_, s, e)| e - s).sum();
        let idle = 1.0 - busy as f64 / (pipe.stages as u64 * end.max(1)) as f64;
        if let Ok(mut k) = KNOWN.lock() {
            k.insert(key, idle);
        }
        idle
    })
}

/// A pass's length on the ideal machine.
fn cost(pipe: Pipeline, pass: Pass) -> u64 {
    match (pass, pipe.schedule) {
        (Pass::Backward, Schedule::ZbH1) => 1,
        (Pass::Backward, _) => 2,
        (Pass::Forward | Pass::Weight, _) => 1,
    }
}

/// Every rank's program for m micro-batches. Each rank sends and receives
/// in one order that all ranks share — by when the message is made on the
/// ideal machine (`ideal_run`), then by message — receiving a message as
/// soon as it is made there, sending it as soon as its task is done, so a
/// send waiting for its receive cannot deadlock the pipeline (the earliest
/// message not yet passed always has both ends waiting on it). A send
/// followed by a receive is one send-receive. Checked before it is
/// returned (`check_programs`).
pub fn programs(pipe: Pipeline, m: usize) -> Result<Vec<Program>> {
    pipe.check_micro_batches(m)?;
    let p = pipe.stages;
    let runs = ideal_run(pipe, m);
    let made: Vec<(Message, u64)> = runs
        .iter()
        .enumerate()
        .flat_map(|(s, run)| {
            run.iter()
                .filter_map(move |(t, _, end)| link(t, s, pipe, true).map(|(_, msg)| (msg, *end)))
        })
        .collect();
    let when = |msg: &Message| made.iter().find(|(x, _)| x == msg).expect("made").1;
    let progs: Vec<Program> = runs
        .iter()
        .enumerate()
        .map(|(s, run)| {
            // (key, send?, partner, message), in the shared order
            let mut comms: Vec<((u64, Message), bool, usize, Message)> = Vec::new();
            for (t, _, end) in run {
                if let Some((to, msg)) = link(t, s, pipe, true) {
                    comms.push(((*end, msg), true, to, msg));
                }
                if let Some((from, msg)) = link(t, s, pipe, false) {
                    comms.push(((when(&msg), msg), false, from, msg));
                }
            }
            comms.sort_by_key(|c| c.0);
            let mut steps = Vec::new();
            let mut next = comms.into_iter().peekable();
            for (t, start, _) in run {
                while let Some(c) = next.next_if(|c| c.0 .0 <= *start) {
                    push_comm(&mut steps, c.1, c.2, c.3);
                }
                steps.push(Step::Run(*t));
            }
            for c in next {
                push_comm(&mut steps, c.1, c.2, c.3);
            }
            Program { steps }
        })
        .collect();
    check_programs(pipe, m, &progs).map_err(|why| {
        Error::Config(format!(
            "the {pipe} schedule over {p} stages cannot run {m} micro-batches: {why}"
        ))
    })?;
    Ok(progs)
}

/// Appends a send or a receive, joining a receive to the send just before it.
fn push_comm(steps: &mut Vec<Step>, send: bool, partner: usize, msg: Message) {
    if !send {
        if let Some(Step::Swap(e)) = steps.last_mut() {
            if e.recv.is_none() {
                e.recv = Some((partner, msg));
                return;
            }
        }
    }
    let mut e = Exchange::default();
    *(if send { &mut e.send } else { &mut e.recv }) = Some((partner, msg));
    steps.push(Step::Swap(e));
}

/// Checks that every rank runs its tasks once each with each input received
/// first and each output sent after, that every pair sends and receives the
/// same messages in the same order (a pair's messages are matched first in,
/// first out, so a swap would silently feed a micro-batch another's
/// activations), and that the programs finish when every send waits for
/// its receive to be posted.
fn check_programs(pipe: Pipeline, m: usize, progs: &[Program]) -> std::result::Result<(), String> {
    let p = progs.len();
    for (s, prog) in progs.iter().enumerate() {
        let (mut got, mut sent) = (Vec::new(), Vec::new());
        for step in &prog.steps {
            match step {
                Step::Swap(e) => {
                    sent.extend(e.send.map(|x| x.1));
                    got.extend(e.recv.map(|x| x.1));
                }
                Step::Run(t) => {
                    if let Some((_, msg)) = link(t, s, pipe, false) {
                        if !got.contains(&msg) {
                            return Err(format!("rank {s} runs {t:?} before receiving {msg:?}"));
                        }
                    }
                    if let Some((_, msg)) = link(t, s, pipe, true) {
                        if sent.contains(&msg) {
                            return Err(format!("rank {s} sends {msg:?} before making it"));
                        }
                    }
                }
            }
        }
        if prog.tasks().collect::<Vec<_>>() != tasks(pipe, s, m) {
            return Err(format!("rank {s} does not run its schedule's tasks"));
        }
    }
    let swaps = |r: usize| {
        progs[r].steps.iter().filter_map(|s| match s {
            Step::Swap(e) => Some(*e),
            Step::Run(_) => None,
        })
    };
    for a in 0..p {
        for b in 0..p {
            let sent: Vec<Message> = swaps(a)
                .filter_map(|e| e.send.filter(|s| s.0 == b).map(|s| s.1))
                .collect();
            let got: Vec<Message> = swaps(b)
                .filter_map(|e| e.recv.filter(|r| r.0 == a).map(|r| r.1))
                .collect();
            if sent != got {
                return Err(format!(
                    "rank {a} sends rank {b} {sent:?} but rank {b} receives {got:?}"
                ));
            }
        }
    }
    // each rank waits at its exchange number at[r]; a half is done once its
    // partner stands at the exchange holding the other half
    let xs: Vec<Vec<Exchange>> = (0..p).map(|r| swaps(r).collect()).collect();
    let mut at = vec![0usize; p];
    let mut done = vec![[false; 2]; p];
    let here = |at: &[usize], r: usize| xs[r].get(at[r]).copied().unwrap_or_default();
    while (0..p).any(|r| at[r] < xs[r].len()) {
        for (r, d) in done.iter_mut().enumerate() {
            let e = here(&at, r);
            if let Some((to, msg)) = e.send {
                d[0] |= here(&at, to).recv == Some((r, msg));
            }
            if let Some((from, msg)) = e.recv {
                d[1] |= here(&at, from).send == Some((r, msg));
            }
        }
        let moving: Vec<usize> = (0..p)
            .filter(|&r| at[r] < xs[r].len())
            .filter(|&r| {
                let e = here(&at, r);
                (e.send.is_none() || done[r][0]) && (e.recv.is_none() || done[r][1])
            })
            .collect();
        if moving.is_empty() {
            let stuck: Vec<String> = (0..p)
                .filter(|&r| at[r] < xs[r].len())
                .map(|r| format!("rank {r} at {:?}", here(&at, r)))
                .collect();
            return Err(format!("the exchanges deadlock: {}", stuck.join("; ")));
        }
        for r in moving {
            at[r] += 1;
            done[r] = [false; 2];
        }
    }
    Ok(())
}

/// Splits units 0..n (embeddings, blocks, head) into `p` contiguous stages
/// of at least one block each, minimising the largest stage's cost (each
/// unit's matmul parameters, a tied tensor read counted with its reader, the
/// embeddings' lookup free). Returns each stage's unit range.
pub fn partition(layout: &ParamLayout, p: usize) -> Vec<Range<usize>> {
    let n = layout.units.len();
    let cost: Vec<u64> = layout
        .units
        .iter()
        .map(|unit| (unit.range.len() + unit.tied.as_ref().map_or(0, |t| t.range.len())) as u64)
        .collect();
    // blocks are units 1..n-1; the head's cost goes with the last stage
    let cuts = split_blocks(&cost[1..n - 1], cost[n - 1], p);
    (0..p)
        .map(|k| {
            let lo = if k == 0 { 0 } else { 1 + cuts[k] };
            let hi = if k + 1 == p { n } else { 1 + cuts[k + 1] };
            lo..hi
        })
        .collect()
}

/// The cuts `0 = c_0 < c_1 < ... < c_p = blocks.len()` that give stage k
/// blocks `c_k..c_(k+1)` (the last also `tail`) with the least largest
/// stage cost; of equal splits, each cut as early as it can be.
///
/// A dynamic programme over (stages, blocks): `best[k][j]` is the least
/// largest cost of stages 0..=k over the first j blocks, nondecreasing in j.
/// Stage k's last cut i trades `best[k-1][i]` (rising in i) against the cost
/// of blocks i..j (falling, every block costing something), so the best i
/// is one of the two either side of where they cross, found by bisection:
/// O(p n log n) where trying every i was O(p n^3) with the sums taken afresh
/// (minutes for a 140-block model over every pipeline `plan` prices). The
/// costs are whole numbers summed exactly, so ties break as they would.
fn split_blocks(blocks: &[u64], tail: u64, p: usize) -> Vec<usize> {
    let n = blocks.len();
    let mut prefix = vec![0u64; n + 1];
    for (i, c) in blocks.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    let extra = |k: usize| if k + 1 == p { tail } else { 0 };
    let mut best = vec![vec![u64::MAX; n + 1]; p];
    let mut from = vec![vec![0usize; n + 1]; p];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = sum(0, j) + extra(0);
    }
    for k in 1..p {
        let (done, rest) = best.split_at_mut(k);
        let prev = &done[k - 1];
        for j in k + 1..=n {
            let cost = |i: usize| prev[i].max(sum(i, j) + extra(k));
            // the first i in k..j where the stages before outweigh this one
            let (mut lo, mut hi) = (k, j);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if prev[mid] >= sum(mid, j) + extra(k) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            let mut at = (u64::MAX, 0);
            for i in [lo.saturating_sub(1).max(k), lo.min(j - 1)] {
                if cost(i) < at.0 {
                    at = (cost(i), i);
                }
            }
            (rest[0][j], from[k][j]) = at;
        }
    }
    let mut cuts = vec![n; p + 1];
    cuts[0] = 0;
    for k in (1..p).rev() {
        cuts[k] = from[k][cuts[k + 1]];
    }
    cuts
}

/// Peak micro-batches each rank's chunks hold activations for at once
/// (its engine keeps that many sets: spares are reused, not freed): rank
/// s's chunk c is `in_flight(pipe, m)[s][c]`.
///
/// Past the warm-up every schedule but GPipe retires a micro-batch for each
/// it starts, so the peak of `m` micro-batches is that of the first `4p`
/// (a whole number of the interleaved schedule's groups of p): the cost of
/// a plan does not grow with `--grad-accum`.
pub fn in_flight(pipe: Pipeline, m: usize) -> Vec<Vec<usize>> {
    let (p, v) = (pipe.stages, pipe.virtual_stages);
    let steady = 4 * p;
    match pipe.schedule {
        Schedule::GPipe => vec![vec![m; v]; p],
        _ if m > steady && m.is_multiple_of(p) => simulated_in_flight(pipe, steady),
        _ if m > steady => simulated_in_flight(pipe, steady + m % p),
        _ => simulated_in_flight(pipe, m),
    }
}

/// [`in_flight`] by counting through each rank's tasks.
fn simulated_in_flight(pipe: Pipeline, m: usize) -> Vec<Vec<usize>> {
    // activations are held until the backward, under zb-h1 its weight half
    let zb = pipe.schedule == Schedule::ZbH1;
    let peak = |program: Vec<Task>| {
        let mut live = vec![0usize; pipe.virtual_stages];
        let mut peak = live.clone();
        for t in program {
            match t.pass {
                Pass::Forward => {
                    live[t.chunk] += 1;
                    peak[t.chunk] = peak[t.chunk].max(live[t.chunk]);
                }
                Pass::Backward if zb => {}
                Pass::Backward | Pass::Weight => live[t.chunk] -= 1,
            }
        }
        peak
    };
    ranks_tasks(pipe, m).into_iter().map(peak).collect()
}

/// A pass a stage ran, in seconds from its step's start (a strategy's
/// `timeline`: from the UNIX epoch, every rank's on one clock, which
/// [`on_one_clock`] brings back to the step's).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Span {
    pub pass: Pass,
    pub chunk: usize,
    pub micro_batch: usize,
    pub start: f64,
    pub end: f64,
}

/// Seconds since the UNIX epoch: the clock every rank of one machine
/// shares (each rank's own clock began with its own step, and a rank that
/// began late drew the next stage's forward before its input; ranks on
/// other machines agree as far as their clocks do).
pub fn wall_clock_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Every rank's timeline from the earliest span's start.
pub fn on_one_clock(mut timelines: Vec<Vec<Span>>) -> Vec<Vec<Span>> {
    let t0 = timelines
        .iter()
        .flatten()
        .map(|s| s.start)
        .fold(f64::INFINITY, f64::min);
    for s in timelines.iter_mut().flatten() {
        (s.start, s.end) = (s.start - t0, s.end - t0);
    }
    timelines
}

/// The idle fraction of a step's programs, measured: one minus the mean
/// busy time of every rank's spans over the span from the earliest start to
/// the latest end.
pub fn measured_bubble(timelines: &[Vec<Span>]) -> Option<f64> {
    let spans = || timelines.iter().flatten();
    let start = spans().map(|s| s.start).min_by(f64::total_cmp)?;
    let end = spans().map(|s| s.end).max_by(f64::total_cmp)?;
    let busy: f64 = spans().map(|s| s.end - s.start).sum::<f64>() / timelines.len() as f64;
    Some(1.0 - busy / (end - start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    /// The pipelines the schedule tests run: (p, m, v) for each schedule.
    fn cases() -> Vec<Pipeline> {
        let mut out = Vec::new();
        for p in 1..=4 {
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                out.push(Pipeline::new(p, schedule, 1));
            }
            for v in 2..=3 {
                out.push(Pipeline::new(p.max(2), Schedule::Interleaved, v));
            }
            out.push(Pipeline::new(p.max(2), Schedule::ZbH1, 1));
        }
        out
    }

    fn micro_batches(pipe: Pipeline) -> Vec<usize> {
        let p = pipe.stages;
        match pipe.schedule {
            Schedule::Interleaved => vec![p, 2 * p, 3 * p],
            // the formula holds from m = p on (fewer leave slots no weight
            // half fills, and `bubble` runs the ideal machine: see below)
            Schedule::ZbH1 => vec![p, p + 1, 2 * p + 1, 8],
            _ => vec![1, 2, p, 2 * p + 1, 8],
        }
    }

    #[test]
    fn every_task_runs_once_after_the_one_before_it_and_1f1b_keeps_at_most_p_minus_s_in_flight() {
        for pipe in cases() {
            let (p, v) = (pipe.stages, pipe.virtual_stages);
            for m in micro_batches(pipe) {
                for s in 0..p {
                    let tasks = tasks(pipe, s, m);
                    let mut seen = std::collections::HashSet::new();
                    let (mut live, mut peak) = (0usize, 0usize);
                    let zb = pipe.schedule == Schedule::ZbH1;
                    for t in &tasks {
                        assert!(t.chunk < v && t.micro_batch < m, "{pipe} s{s} m{m}: {t:?}");
                        assert!(seen.insert(*t), "{pipe} s{s} m{m}: {t:?} twice");
                        let before = match t.pass {
                            Pass::Forward => None,
                            Pass::Backward => Some(Pass::Forward),
                            Pass::Weight => Some(Pass::Backward),
                        };
                        if let Some(pass) = before {
                            let b = Task { pass, ..*t };
                            assert!(seen.contains(&b), "{pipe} s{s} m{m}: {t:?} before {b:?}");
                        }
                        match t.pass {
                            Pass::Forward => live += 1,
                            Pass::Backward if zb => {}
                            Pass::Backward | Pass::Weight => live -= 1,
                        }
                        peak = peak.max(live);
                    }
                    let per_micro_batch = if zb { 3 } else { 2 };
                    assert_eq!(tasks.len(), per_micro_batch * m * v, "{pipe} s{s} m{m}");
                    let per_chunk = in_flight(pipe, m).swap_remove(s);
                    match pipe.schedule {
                        Schedule::GPipe => assert_eq!(per_chunk, vec![m]),
                        Schedule::OneFOneB => assert_eq!(per_chunk, vec![(p - s).min(m)]),
                        // ZB-H1's (Qi et al. 2023): p on every stage, 1F1B's
                        // peak (p - s to the input half, s weight halves put off)
                        Schedule::ZbH1 => {
                            assert!(per_chunk[0] <= p.min(m), "{pipe} s{s} m{m}: {per_chunk:?}")
                        }
                        // Megatron's bound: the warm-up's forwards and one more
                        Schedule::Interleaved => {
                            let warmup = (2 * (p - s - 1) + (v - 1) * p).min(m * v);
                            assert_eq!(peak, (warmup + 1).min(m * v), "{pipe} s{s} m{m}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn on_an_ideal_machine_every_schedule_idles_as_its_bubble_formula_says() {
        for pipe in cases() {
            for m in micro_batches(pipe) {
                let spans: Vec<Vec<Span>> = ideal_run(pipe, m)
                    .into_iter()
                    .map(|run| {
                        run.into_iter()
                            .map(|(t, start, end)| Span {
                                pass: t.pass,
                                chunk: t.chunk,
                                micro_batch: t.micro_batch,
                                start: start as f64,
                                end: end as f64,
                            })
                            .collect()
                    })
                    .collect();
                let got = measured_bubble(&spans).unwrap();
                let want = pipe.bubble(m);
                assert!(
                    (got - want).abs() < 1e-9,
                    "{pipe} p{} m{m}: {got} idle vs formula {want}",
                    pipe.stages
                );
            }
        }
    }

    /// zb-h1 with one micro-batch: its forward through the p stages, the
    /// input halves back, then the first stage's weight half, 2p + 1 slots
    /// of which each stage works 3 (counted by hand; the formula, which
    /// holds from m = p, says (p - 1) / (p + 2)).
    #[test]
    fn zb_h1_with_fewer_micro_batches_than_stages_idles_as_its_slots_say() {
        for (p, idle) in [(4, 6.0 / 9.0), (8, 14.0 / 17.0)] {
            let pipe = Pipeline::new(p, Schedule::ZbH1, 1);
            let got = pipe.bubble(1);
            assert!((got - idle).abs() < 1e-12, "p {p}: {got}, by hand {idle}");
            // what bench and compare print beside the measured bubble (they
            // printed the m >= p formula's (p - 1) / (p + 2))
            let expected = pipe.expected_bubble(1, &[]);
            assert!(
                (expected - idle).abs() < 1e-12,
                "p {p}: {expected}, by hand {idle}"
            );
        }
    }

    /// The positions of a program's steps that send.
    fn sends(prog: &Program) -> Vec<usize> {
        (0..prog.steps.len())
            .filter(|&j| matches!(prog.steps[j], Step::Swap(Exchange { send: Some(_), .. })))
            .collect()
    }

    #[test]
    fn every_program_passes_its_checks_and_a_swapped_or_deadlocking_one_fails() {
        for pipe in cases() {
            for m in micro_batches(pipe) {
                programs(pipe, m).unwrap_or_else(|e| panic!("{e}"));
            }
        }
        let pipe = Pipeline::new(2, Schedule::Interleaved, 2);
        let progs = programs(pipe, 4).unwrap();
        // rank 0 sends two messages to rank 1 the other way round
        let mut swapped = progs.clone();
        let at = sends(&swapped[0]);
        let (Step::Swap(a), Step::Swap(b)) = (swapped[0].steps[at[0]], swapped[0].steps[at[1]])
        else {
            panic!("rank 0's sends are swaps")
        };
        swapped[0].steps[at[0]] = Step::Swap(Exchange { send: b.send, ..a });
        swapped[0].steps[at[1]] = Step::Swap(Exchange { send: a.send, ..b });
        let err = check_programs(pipe, 4, &swapped).unwrap_err();
        assert!(err.contains("rank 0 sends"), "{err}");
        // GPipe, 2 stages, 2 micro-batches: rank 0 waits for the first
        // gradient before sending the second activation, which rank 1
        // needs before it can make that gradient
        let gpipe = Pipeline::new(2, Schedule::GPipe, 1);
        let mut stuck = programs(gpipe, 2).unwrap();
        let at = sends(&stuck[0])[1];
        let Step::Swap(e) = stuck[0].steps[at] else {
            panic!("rank 0's second send is a swap")
        };
        assert!(
            e.recv.is_some(),
            "the send is joined to the gradient's receive"
        );
        stuck[0].steps[at] = Step::Swap(Exchange { send: None, ..e });
        let send = Step::Swap(Exchange { recv: None, ..e });
        stuck[0].steps.insert(at + 1, send);
        let err = check_programs(gpipe, 2, &stuck).unwrap_err();
        assert!(err.contains("deadlock"), "{err}");
        // interleaving needs micro-batches in groups of p
        let err = programs(Pipeline::new(2, Schedule::Interleaved, 2), 3).unwrap_err();
        assert!(err.to_string().contains("multiple of 2"), "{err}");
    }

    #[test]
    fn stages_are_contiguous_hold_a_block_each_and_balance_the_head() {
        let cfg = GptConfig {
            n_layer: 6,
            n_head: 2,
            n_embd: 32,
            block_size: 16,
            vocab_size: 1024,
            blocks: Vec::new(),
        };
        let lay = ParamLayout::new(&cfg);
        let n = lay.units.len();
        for p in 1..=6 {
            let stages = partition(&lay, p);
            assert_eq!(stages.len(), p);
            assert_eq!(stages[0].start, 0);
            assert_eq!(stages[p - 1].end, n);
            for k in 1..p {
                assert_eq!(stages[k].start, stages[k - 1].end);
            }
            // every stage has a block
            assert!(stages
                .iter()
                .all(|r| r.clone().any(|u| u >= 1 && u < n - 1)));
        }
        // the head reads a 1024 x 32 embedding (more than two blocks' work):
        // at 2 stages the last takes fewer blocks
        let two = partition(&lay, 2);
        assert!(two[1].len() - 1 < two[0].len() - 1, "{two:?}");
    }

    #[test]
    fn the_peak_in_flight_stops_growing_after_the_warm_up() {
        for p in 1..=8 {
            let mut pipes = vec![
                Pipeline::new(p, Schedule::GPipe, 1),
                Pipeline::new(p, Schedule::OneFOneB, 1),
            ];
            if p > 1 {
                pipes.push(Pipeline::new(p, Schedule::ZbH1, 1));
                pipes.extend((2..=3).map(|v| Pipeline::new(p, Schedule::Interleaved, v)));
            }
            for pipe in pipes {
                for m in 1..=9 * p + 3 {
                    if pipe.check_micro_batches(m).is_err() {
                        continue;
                    }
                    assert_eq!(
                        in_flight(pipe, m),
                        simulated_in_flight(pipe, m),
                        "{pipe} m{m}"
                    );
                }
            }
        }
    }

    /// The least largest stage by trying every last cut (the programme
    /// `split_blocks` shortens), the earliest cut of equal ones.
    fn split_every_way(blocks: &[u64], tail: u64, p: usize) -> Vec<usize> {
        let n = blocks.len();
        let sum = |a: usize, b: usize| blocks[a..b].iter().sum::<u64>();
        let extra = |k: usize| if k + 1 == p { tail } else { 0 };
        let mut best = vec![vec![u64::MAX; n + 1]; p];
        let mut from = vec![vec![0usize; n + 1]; p];
        for (j, b) in best[0].iter_mut().enumerate().skip(1) {
            *b = sum(0, j) + extra(0);
        }
        for k in 1..p {
            for j in k + 1..=n {
                for i in k..j {
                    let c = best[k - 1][i].max(sum(i, j) + extra(k));
                    if c < best[k][j] {
                        (best[k][j], from[k][j]) = (c, i);
                    }
                }
            }
        }
        let mut cuts = vec![n; p + 1];
        cuts[0] = 0;
        for k in (1..p).rev() {
            cuts[k] = from[k][cuts[k + 1]];
        }
        cuts
    }

    #[test]
    fn the_bisected_split_is_the_split_every_cut_tried_gives() {
        let mut rng = crate::rng::Rng::new(5);
        for case in 0..400 {
            let n = 1 + rng.below(24);
            // uniform blocks (ties everywhere), a few wide ones, or any
            let blocks: Vec<u64> = (0..n)
                .map(|_| match case % 3 {
                    0 => 7,
                    1 => [3, 3, 3, 40][rng.below(4)],
                    _ => 1 + rng.below(50) as u64,
                })
                .collect();
            let tail = [0, 5, 100][rng.below(3)];
            for p in 1..=n {
                assert_eq!(
                    split_blocks(&blocks, tail, p),
                    split_every_way(&blocks, tail, p),
                    "{blocks:?} + {tail} over {p}"
                );
            }
        }
    }
}

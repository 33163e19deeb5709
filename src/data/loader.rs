//! Token splits and the deterministic batch loader.
//!
//! A split is cut into non-overlapping windows of T+1 tokens (input and
//! shifted target). Each epoch visits every window once, in an order
//! shuffled from (seed, epoch); the tail that does not fill a batch is dropped.

use super::shard::Shard;
use crate::error::{Error, Result};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};

/// One contiguous run of tokens.
pub enum Part {
    Memory(Vec<u16>),
    Mapped(Shard),
}

impl Part {
    fn len(&self) -> usize {
        match self {
            Part::Memory(v) => v.len(),
            Part::Mapped(s) => s.len(),
        }
    }

    fn get(&self, i: usize) -> u32 {
        match self {
            Part::Memory(v) => v[i] as u32,
            Part::Mapped(s) => s.get(i),
        }
    }
}

/// Whole windows of `t` tokens and their targets in `p`: a window's last
/// target is the token after it, so the part's last token starts none.
fn part_windows(p: &Part, t: usize) -> usize {
    p.len().saturating_sub(1) / t
}

/// The train or validation tokens.
pub struct Split {
    pub parts: Vec<Part>,
}

impl Split {
    pub fn len(&self) -> usize {
        self.parts.iter().map(Part::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many training windows of `t` tokens (and the next one each
    /// predicts) the loader cuts from the split: whole windows of each part.
    pub fn windows(&self, t: usize) -> usize {
        self.parts.iter().map(|p| part_windows(p, t)).sum()
    }

    /// `n` consecutive tokens from a place drawn by `rng`, every start
    /// that fits within a part equally likely; None where no part holds `n`.
    pub fn random_run(&self, n: usize, rng: &mut Rng) -> Option<Vec<u32>> {
        let starts = |p: &Part| (p.len() + 1).saturating_sub(n);
        let fits: usize = self.parts.iter().map(starts).sum();
        if fits == 0 {
            return None;
        }
        let mut k = rng.below(fits);
        self.parts.iter().find_map(|p| match k < starts(p) {
            true => Some((k..k + n).map(|i| p.get(i)).collect()),
            false => {
                k -= starts(p);
                None
            }
        })
    }

    /// Every token, part after part.
    pub fn tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.parts
            .iter()
            .flat_map(|p| (0..p.len()).map(move |i| p.get(i)))
    }

    /// The first `n` tokens (all of them when there are fewer), in memory.
    pub fn head(&self, n: usize) -> Split {
        let tokens = self.tokens().map(|t| t as u16).take(n).collect();
        Split {
            parts: vec![Part::Memory(tokens)],
        }
    }
}

/// Where a loader is: enough to resume it exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderPosition {
    pub epoch: u64,
    /// Batches already taken in this epoch.
    pub batch: usize,
}

pub struct DataLoader<'a> {
    split: &'a Split,
    b: usize,
    t: usize,
    seed: u64,
    shuffle: bool,
    /// (part, offset) of every window.
    windows: Vec<(u32, usize)>,
    order: Vec<u32>,
    pub position: LoaderPosition,
}

/// A batch of B sequences of T tokens: inputs (B*T) and targets, either
/// one per token (B*T, a language model's) or one per sequence (B, a
/// classifier's labels). A target of [`IGNORE`] adds no loss (a token
/// that was not masked for MLM). Encoders also take token types (B*T,
/// empty: all 0) and each sequence's length before its padding (B, empty:
/// no padding). BERT's pretraining adds a second target per sequence
/// beside the per-token ones: whether its second segment follows the first
/// (`seq_targets`, B; empty elsewhere).
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub types: Vec<u32>,
    pub lens: Vec<u32>,
    pub seq_targets: Vec<u32>,
}

/// What a batch's mean losses divide by: its targets and its
/// per-sequence targets that are not [`IGNORE`] (a data-parallel rank's
/// share of a global batch's, [`LossTerms::per_rank`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossTerms {
    pub targets: f32,
    pub seq_targets: f32,
}

impl LossTerms {
    /// Terms of `n` targets and no per-sequence ones.
    pub fn of(n: usize) -> Self {
        LossTerms {
            targets: n as f32,
            seq_targets: 0.0,
        }
    }

    /// One of `n` ranks' share: each divides by the global count over n
    /// and the ranks' gradients are averaged.
    pub fn per_rank(self, n: usize) -> Self {
        LossTerms {
            targets: self.targets / n as f32,
            seq_targets: self.seq_targets / n as f32,
        }
    }
}

/// Several batches' terms: what the batch of all their rows divides by.
impl std::iter::Sum for LossTerms {
    fn sum<I: Iterator<Item = LossTerms>>(terms: I) -> Self {
        terms.fold(LossTerms::default(), |a, t| LossTerms {
            targets: a.targets + t.targets,
            seq_targets: a.seq_targets + t.seq_targets,
        })
    }
}

/// The target id that adds no loss (PyTorch's `ignore_index`).
pub const IGNORE: u32 = u32::MAX;

impl Batch {
    /// A language-model batch: inputs and next-token targets.
    pub fn lm(inputs: Vec<u32>, targets: Vec<u32>) -> Self {
        Batch {
            inputs,
            targets,
            ..Batch::default()
        }
    }

    /// The loss terms of the batch: targets that are not [`IGNORE`].
    pub fn loss_terms(&self) -> LossTerms {
        let count = |v: &[u32]| v.iter().filter(|&&x| x != IGNORE).count() as f32;
        LossTerms {
            targets: count(&self.targets),
            seq_targets: count(&self.seq_targets),
        }
    }

    /// Sequences `rows` of a batch of `b`.
    pub fn rows(&self, b: usize, rows: std::ops::Range<usize>) -> Batch {
        let part = |v: &[u32]| -> Vec<u32> {
            if v.is_empty() {
                return Vec::new();
            }
            let per = v.len() / b;
            v[rows.start * per..rows.end * per].to_vec()
        };
        Batch {
            inputs: part(&self.inputs),
            targets: part(&self.targets),
            types: part(&self.types),
            lens: part(&self.lens),
            seq_targets: part(&self.seq_targets),
        }
    }
}

impl<'a> DataLoader<'a> {
    pub fn new(
        split: &'a Split,
        what: &str,
        b: usize,
        t: usize,
        seed: u64,
        shuffle: bool,
    ) -> Result<Self> {
        let windows: Vec<(u32, usize)> = split
            .parts
            .iter()
            .enumerate()
            .flat_map(|(pi, p)| (0..part_windows(p, t)).map(move |w| (pi as u32, w * t)))
            .collect();
        if windows.len() < b {
            return Err(Error::Input(format!(
                "the {what} split has {} tokens: {} windows of {t}+1, fewer than one batch of {b}; \
                 use a smaller batch or sequence length, or more data",
                split.len(),
                windows.len()
            )));
        }
        let mut loader = DataLoader {
            split,
            b,
            t,
            seed,
            shuffle,
            order: (0..windows.len() as u32).collect(),
            windows,
            position: LoaderPosition::default(),
        };
        loader.shuffle_epoch();
        Ok(loader)
    }

    fn shuffle_epoch(&mut self) {
        self.order = (0..self.windows.len() as u32).collect();
        if self.shuffle {
            let mut rng =
                Rng::new(self.seed ^ self.position.epoch.wrapping_mul(0xA24B_AED4_963E_E407));
            rng.shuffle(&mut self.order);
        }
    }

    pub fn batches_per_epoch(&self) -> usize {
        self.windows.len() / self.b
    }

    /// Moves to a saved position (same data, batch shape and seed).
    pub fn seek(&mut self, position: LoaderPosition) {
        self.position = position;
        self.shuffle_epoch();
    }

    pub fn next_batch(&mut self) -> Batch {
        if self.position.batch >= self.batches_per_epoch() {
            self.position = LoaderPosition {
                epoch: self.position.epoch + 1,
                batch: 0,
            };
            self.shuffle_epoch();
        }
        let (b, t) = (self.b, self.t);
        let mut inputs = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        let first = self.position.batch * b;
        for &w in &self.order[first..first + b] {
            let (pi, off) = self.windows[w as usize];
            let part = &self.split.parts[pi as usize];
            inputs.extend((off..off + t).map(|i| part.get(i)));
            targets.extend((off + 1..off + t + 1).map(|i| part.get(i)));
        }
        self.position.batch += 1;
        Batch::lm(inputs, targets)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Test aid: each epoch's order (of `n` windows or examples) is a
    /// permutation, and no two epochs share one.
    pub(crate) fn assert_epochs_permute(orders: &[Vec<usize>], n: usize) {
        for (e, order) in orders.iter().enumerate() {
            let mut sorted = order.clone();
            sorted.sort();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "epoch {e}");
        }
        for a in 0..orders.len() {
            for b in a + 1..orders.len() {
                assert_ne!(orders[a], orders[b], "epochs {a} and {b} in one order");
            }
        }
    }

    fn split(n: usize) -> Split {
        Split {
            parts: vec![Part::Memory((0..n as u16).collect())],
        }
    }

    /// A run of n tokens starts at any of a part's L - n + 1 places: parts
    /// of 3 and 5 tokens hold 1 + 3 runs of 3 (0 1 2; 10 11 12, 11 12 13
    /// and 12 13 14, which ends at its part's last token), each drawn a
    /// quarter of the time; a part of exactly n tokens is one run, not none.
    #[test]
    fn a_run_starts_at_every_place_it_fits_the_last_included() {
        let split = Split {
            parts: vec![
                Part::Memory(vec![0, 1, 2]),
                Part::Memory(vec![10, 11, 12, 13, 14]),
            ],
        };
        let mut rng = Rng::new(7);
        let n = 40_000;
        let mut counts = std::collections::BTreeMap::new();
        for _ in 0..n {
            let run = split.random_run(3, &mut rng).expect("runs of 3 fit");
            *counts.entry(run).or_insert(0usize) += 1;
        }
        let runs: Vec<&Vec<u32>> = counts.keys().collect();
        assert_eq!(
            runs,
            [
                vec![0, 1, 2],
                vec![10, 11, 12],
                vec![11, 12, 13],
                vec![12, 13, 14]
            ]
            .iter()
            .collect::<Vec<_>>(),
            "{counts:?}"
        );
        // a quarter each: 10,000 +- 433 (5 sd)
        for (run, &c) in &counts {
            assert!((c as f64 - 10_000.0).abs() <= 433.0, "{run:?}: {c} of {n}");
        }
        let whole = Split {
            parts: vec![Part::Memory(vec![4, 5])],
        };
        assert_eq!(whole.random_run(2, &mut rng), Some(vec![4, 5]));
        assert_eq!(whole.random_run(3, &mut rng), None);
    }

    /// A split's windows are its parts' whole windows, as the loader cuts
    /// them: parts of 3, 5 and 9 tokens hold 1 + 2 + 4 windows of 2 (and
    /// their targets), not the 8 of their 17 tokens end to end.
    #[test]
    fn a_splits_windows_are_its_parts_whole_windows_as_the_loader_cuts_them() {
        let split = Split {
            parts: [3u16, 5, 9].map(|n| Part::Memory((0..n).collect())).into(),
        };
        assert_eq!(split.windows(2), 7);
        let loader = DataLoader::new(&split, "train", 1, 2, 0, false).unwrap();
        assert_eq!(loader.batches_per_epoch(), 7);
        assert_eq!(split.windows(9), 0);
    }

    /// Each epoch's windows (by their first token / T), batch by batch.
    fn epoch_orders(loader: &mut DataLoader, epochs: usize) -> Vec<Vec<usize>> {
        let t = loader.t;
        (0..epochs)
            .map(|_| {
                (0..loader.batches_per_epoch())
                    .flat_map(|_| {
                        loader
                            .next_batch()
                            .inputs
                            .chunks(t)
                            .map(|w| w[0] as usize / t)
                            .collect::<Vec<_>>()
                    })
                    .collect()
            })
            .collect()
    }

    /// Every epoch visits each window once, and a shuffled loader visits
    /// them in another order each epoch (the epoch is part of the seed).
    #[test]
    fn each_epoch_is_a_permutation_in_an_order_of_its_own() {
        let s = split(241);
        assert!(!s.is_empty() && split(0).is_empty());
        let mut shuffled = DataLoader::new(&s, "train", 3, 10, 9, true).unwrap();
        assert_epochs_permute(&epoch_orders(&mut shuffled, 4), 24);
        let mut plain = DataLoader::new(&s, "val", 3, 10, 9, false).unwrap();
        for order in epoch_orders(&mut plain, 2) {
            assert_eq!(order, (0..24).collect::<Vec<_>>());
        }
    }

    #[test]
    fn batches_are_deterministic_shifted_and_cover_an_epoch() {
        let s = split(101);
        let mut a = DataLoader::new(&s, "train", 2, 10, 5, true).unwrap();
        let mut b = DataLoader::new(&s, "train", 2, 10, 5, true).unwrap();
        assert_eq!(a.batches_per_epoch(), 5);
        let mut starts = Vec::new();
        for _ in 0..5 {
            let x = a.next_batch();
            assert_eq!(x.inputs, b.next_batch().inputs);
            for row in 0..2 {
                let inp = &x.inputs[row * 10..row * 10 + 10];
                let tgt = &x.targets[row * 10..row * 10 + 10];
                assert!(inp.iter().zip(tgt).all(|(i, t)| t == &(i + 1)));
                starts.push(inp[0]);
            }
        }
        starts.sort();
        assert_eq!(starts, vec![0, 10, 20, 30, 40, 50, 60, 70, 80, 90]);
        let next_epoch = a.next_batch();
        assert_eq!(a.position, LoaderPosition { epoch: 1, batch: 1 });
        let mut c = DataLoader::new(&s, "train", 2, 10, 5, true).unwrap();
        c.seek(LoaderPosition { epoch: 1, batch: 0 });
        assert_eq!(c.next_batch().inputs, next_epoch.inputs);
    }

    #[test]
    fn too_small_split_is_refused_with_sizes() {
        let s = split(15);
        let err = DataLoader::new(&s, "val", 2, 10, 0, false)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("val split has 15 tokens"), "{err}");
    }
}

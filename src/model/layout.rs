//! The flat parameter layout shared by params, grads and both AdamW
//! moments, as a model family declares it: units (the embeddings, each
//! block, the head), each a contiguous run of named tensors with their
//! shapes, tensor-parallel splits and weight-decay flags, and the tensors a
//! unit reads from an earlier one (a tied embedding). Strategies, the
//! training state and `plan` work from this description and never name a
//! family.

use std::ops::Range;

use super::tp::TpSplit;

/// One named tensor inside the flat buffer.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub offset: usize,
    /// Shape on this rank (a tensor-parallel part where `split` says so).
    pub shape: Vec<usize>,
    /// Shape of the whole tensor.
    pub full_shape: Vec<usize>,
    pub split: TpSplit,
    /// AdamW decays 2-D tensors only (matmul weights and embeddings).
    pub decay: bool,
}

impl TensorSpec {
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.shape.iter().product::<usize>()
    }
}

/// A unit: one forward and one backward call, a contiguous run of tensors.
#[derive(Clone, Debug)]
pub struct Unit {
    /// "embeddings", "block 3", "head".
    pub name: String,
    /// Its range of the layout.
    pub range: Range<usize>,
    /// Its tensors (indices into `ParamLayout::tensors`).
    pub tensors: Range<usize>,
    /// A tensor of an earlier unit this unit also reads and whose gradient
    /// it accumulates (a tied embedding), as a layout range.
    pub tied: Option<Tied>,
}

/// Where a unit's tied tensor lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tied {
    /// The unit that owns the tensor.
    pub unit: usize,
    /// The tensor's range of the layout (inside that unit's range).
    pub range: Range<usize>,
}

/// A model's parameters: its tensors in buffer order, grouped into units.
#[derive(Clone, Debug, Default)]
pub struct ParamLayout {
    pub tensors: Vec<TensorSpec>,
    pub units: Vec<Unit>,
}

impl ParamLayout {
    /// Declares a layout for one of `tp` tensor-parallel ranks.
    pub fn builder(tp: usize) -> LayoutBuilder {
        LayoutBuilder {
            tp,
            layout: ParamLayout::default(),
            offset: 0,
        }
    }

    pub fn total(&self) -> usize {
        self.tensors.last().map_or(0, |t| t.range().end)
    }

    /// Unit u's range of the layout.
    pub fn unit(&self, u: usize) -> Range<usize> {
        self.units[u].range.clone()
    }

    /// Tensor i of unit u, as a range inside the unit's slice.
    pub fn in_unit(&self, u: usize, i: usize) -> Range<usize> {
        let unit = &self.units[u];
        let r = self.tensors[unit.tensors.start + i].range();
        r.start - unit.range.start..r.end - unit.range.start
    }

    /// Tensor i of unit u, as a range of the layout.
    pub fn unit_tensor(&self, u: usize, i: usize) -> Range<usize> {
        self.tensors[self.units[u].tensors.start + i].range()
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorSpec> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A whole model's initialisation (this layout for one rank): in
    /// layout order, every 2-D tensor drawn N(0, `std(name)`) from one
    /// generator seeded `seed`, the 1-D weights (LayerNorms') one, the
    /// biases zero; then the rows of the first tensor (the word
    /// embeddings) past `vocab`, a padded vocabulary's, zero.
    pub fn init(&self, seed: u64, vocab: usize, std: impl Fn(&str) -> f64) -> Vec<f32> {
        let mut p = vec![0.0f32; self.total()];
        let mut rng = crate::rng::Rng::new(seed);
        for t in &self.tensors {
            let p = &mut p[t.range()];
            match t.shape.len() {
                2 => p
                    .iter_mut()
                    .for_each(|x| *x = (rng.normal() * std(&t.name)) as f32),
                _ if t.name.ends_with(".weight") => p.fill(1.0),
                _ => {}
            }
        }
        let word = &self.tensors[0];
        p[word.offset + vocab * word.shape[1]..word.range().end].fill(0.0);
        p
    }

    /// The most gradient one unit's backward writes: its own slice and its
    /// tied tensor's.
    pub fn widest_unit_grad(&self) -> usize {
        let unit = |u: &Unit| u.range.len() + u.tied.as_ref().map_or(0, |t| t.range.len());
        self.units.iter().map(unit).max().unwrap_or(0)
    }

    /// Block l (unit l + 1) as one contiguous slice: an FSDP unit, a DDP bucket.
    pub fn block(&self, l: usize) -> Range<usize> {
        self.unit(1 + l)
    }

    /// The head (the last unit).
    pub fn head(&self) -> Range<usize> {
        self.unit(self.units.len() - 1)
    }
}

/// Builds a [`ParamLayout`] unit by unit, tensor by tensor.
pub struct LayoutBuilder {
    tp: usize,
    layout: ParamLayout,
    offset: usize,
}

impl LayoutBuilder {
    /// Starts the next unit.
    pub fn unit(&mut self, name: impl Into<String>) -> &mut Self {
        let (at, n) = (self.offset, self.layout.tensors.len());
        self.layout.units.push(Unit {
            name: name.into(),
            range: at..at,
            tensors: n..n,
            tied: None,
        });
        self
    }

    /// Adds a tensor of whole shape `full_shape` to the current unit; this
    /// rank holds the part `split` gives it. 2-D tensors are decayed.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        full_shape: &[usize],
        split: TpSplit,
    ) -> &mut Self {
        let mut shape = full_shape.to_vec();
        match split {
            TpSplit::Replicated => {}
            TpSplit::Cols { .. } => *shape.last_mut().expect("non-scalar") /= self.tp,
            TpSplit::Rows => shape[0] /= self.tp,
        }
        let len: usize = shape.iter().product();
        self.layout.tensors.push(TensorSpec {
            name: name.into(),
            offset: self.offset,
            decay: full_shape.len() == 2,
            shape,
            full_shape: full_shape.to_vec(),
            split,
        });
        self.offset += len;
        let unit = self
            .layout
            .units
            .last_mut()
            .expect("unit() before tensor()");
        unit.range.end = self.offset;
        unit.tensors.end = self.layout.tensors.len();
        self
    }

    /// The current unit also reads the earlier tensor `name` (and
    /// accumulates its gradient).
    pub fn tie(&mut self, name: &str) -> &mut Self {
        let range = self
            .layout
            .tensor(name)
            .expect("tie to a declared tensor")
            .range();
        let unit = self
            .layout
            .units
            .iter()
            .position(|u| u.range.contains(&range.start))
            .expect("a declared tensor is in a unit");
        self.layout
            .units
            .last_mut()
            .expect("unit() before tie()")
            .tied = Some(Tied { unit, range });
        self
    }

    pub fn build(&mut self) -> ParamLayout {
        std::mem::take(&mut self.layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_draws_the_matrices_and_sets_layernorm_weights_biases_and_padded_rows() {
        let layout = ParamLayout::builder(1)
            .unit("embeddings")
            .tensor("wte.weight", &[8, 4], TpSplit::Replicated)
            .unit("block")
            .tensor("ln.weight", &[4], TpSplit::Replicated)
            .tensor("ln.bias", &[4], TpSplit::Replicated)
            .tensor("proj.weight", &[4, 4], TpSplit::Replicated)
            .build();
        let std = |name: &str| if name == "proj.weight" { 10.0 } else { 0.02 };
        // a vocabulary of 6 padded to 8 rows
        let p = layout.init(5, 6, std);
        let of = |name: &str| {
            let t = layout.tensors.iter().find(|t| t.name == name).unwrap();
            &p[t.range()]
        };
        // one generator, in layout order: the word rows, then the projection
        let mut rng = crate::rng::Rng::new(5);
        let mut draw = |n: usize, std: f64| -> Vec<f32> {
            (0..n).map(|_| (rng.normal() * std) as f32).collect()
        };
        let words = draw(32, 0.02);
        assert_eq!(&of("wte.weight")[..24], &words[..24]);
        assert_eq!(&of("wte.weight")[24..], &[0.0; 8]);
        assert_eq!(of("ln.weight"), &[1.0; 4]);
        assert_eq!(of("ln.bias"), &[0.0; 4]);
        assert_eq!(of("proj.weight"), &draw(16, 10.0)[..]);
    }

    #[test]
    fn tp_shards_cover_each_tensor_exactly_once() {
        let declare = |tp| {
            ParamLayout::builder(tp)
                .unit("a")
                .tensor("w", &[4, 6], TpSplit::Cols { groups: 3 })
                .tensor("b", &[6], TpSplit::Cols { groups: 3 })
                .unit("b")
                .tensor("proj", &[6, 4], TpSplit::Rows)
                .tensor("n", &[4], TpSplit::Replicated)
                .tie("w")
                .build()
        };
        let (full, tp) = (declare(1), 2);
        assert_eq!(
            full.units[1].tied,
            Some(Tied {
                unit: 0,
                range: 0..24
            })
        );
        assert_eq!((full.unit(1), full.in_unit(1, 1)), (30..58, 24..28));
        for spec in &full.tensors {
            let data: Vec<f32> = (0..spec.range().len()).map(|i| i as f32).collect();
            let mut back = vec![-1.0; data.len()];
            for r in 0..tp {
                let part = spec.split.shard(&data, &spec.full_shape, tp, r);
                let local = declare(tp);
                let lspec = local.tensor(&spec.name).unwrap();
                assert_eq!(part.len(), lspec.range().len(), "{}", spec.name);
                let mut at = 0;
                for (full_at, len) in spec.split.runs(&spec.full_shape, tp, r) {
                    back[full_at..full_at + len].copy_from_slice(&part[at..at + len]);
                    at += len;
                }
            }
            assert_eq!(back, data, "{}", spec.name);
        }
        // rank 1's q columns of a (C, 3C) qkv weight start at C/2 in the first row.
        let qkv = TpSplit::Cols { groups: 3 };
        let w: Vec<f32> = (0..2 * 12).map(|i| i as f32).collect();
        assert_eq!(qkv.shard(&w, &[2, 12], 2, 1)[..2], [2.0, 3.0]);
    }
}

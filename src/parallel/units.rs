//! Units of sharding: the units a model family declares (its embeddings,
//! each block, its head), contiguous slices of the layout. Each unit is
//! padded to a multiple of the data-parallel size and rank r owns slice r
//! of every unit; padding is zeros, never dropped.

use crate::backend::{Backend, Dst, Src};
use crate::model::{ParamLayout, Segment};
use std::ops::Range;

#[derive(Clone, Debug)]
pub struct Units {
    /// Layout range of each unit, in the model's order.
    pub ranges: Vec<Range<usize>>,
    /// Shard length of each unit (unit length / n, rounded up).
    pub shard_len: Vec<usize>,
    /// Offset of each unit's shard inside a rank's shard buffer.
    pub shard_at: Vec<usize>,
    pub n: usize,
}

impl Units {
    pub fn new(layout: &ParamLayout, n: usize) -> Self {
        Units::from_ranges(layout.units.iter().map(|u| u.range.clone()).collect(), n)
    }

    /// Contiguous runs of a buffer (in order), each padded and sliced as a unit.
    pub fn from_ranges(ranges: Vec<Range<usize>>, n: usize) -> Self {
        let shard_len: Vec<usize> = ranges.iter().map(|r| r.len().div_ceil(n)).collect();
        let shard_at = shard_len
            .iter()
            .scan(0, |at, &s| {
                let here = *at;
                *at += s;
                Some(here)
            })
            .collect();
        Units {
            ranges,
            shard_len,
            shard_at,
            n,
        }
    }

    /// Floats in one rank's shard buffer.
    pub fn shard_total(&self) -> usize {
        self.shard_len.iter().sum()
    }

    /// Largest padded unit (a gathered buffer's size).
    pub fn max_padded(&self) -> usize {
        self.shard_len.iter().map(|s| s * self.n).max().unwrap_or(0)
    }

    /// Unit u padded to a multiple of the group size.
    pub fn padded(&self, u: usize) -> usize {
        self.shard_len[u] * self.n
    }

    /// Unit u's slice of rank r's shard buffer.
    pub fn shard_of(&self, u: usize) -> Range<usize> {
        self.shard_at[u]..self.shard_at[u] + self.shard_len[u]
    }

    /// Rank r's slice of unit u: (offset in the unit, length; short or
    /// empty where it falls in the padding).
    pub fn mine(&self, u: usize, r: usize) -> (usize, usize) {
        let (s, len) = (self.shard_len[u], self.ranges[u].len());
        let start = (r * s).min(len);
        (start, s.min(len - start))
    }

    /// Where rank r's shard elements sit in the layout (padding excluded).
    pub fn segments(&self, r: usize) -> Vec<Segment> {
        (0..self.ranges.len())
            .filter_map(|u| {
                let (start, len) = self.mine(u, r);
                (len > 0).then_some(Segment {
                    global: self.ranges[u].start + start,
                    local: self.shard_at[u],
                    len,
                })
            })
            .collect()
    }

    /// Copies rank r's shard of every unit out of a whole-layout buffer (on the device).
    pub fn shard_from<B: Backend>(&self, be: &B, full: Src<'_, B>, r: usize, mut out: Dst<'_, B>) {
        be.fill(out.rb(), 0.0);
        for seg in self.segments(r) {
            be.copy(
                out.rb().slice(seg.local..seg.local + seg.len),
                full.slice(seg.global..seg.global + seg.len),
            );
        }
    }

    /// Rank r's shard of every unit of a whole-layout host buffer.
    pub fn shard_of_host(&self, full: &[f32], r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.shard_total()];
        for seg in self.segments(r) {
            out[seg.local..seg.local + seg.len]
                .copy_from_slice(&full[seg.global..seg.global + seg.len]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    #[test]
    fn shards_of_all_ranks_tile_every_unit_with_padding() {
        let cfg = GptConfig::preset("tiny").unwrap();
        let layout = ParamLayout::new(&cfg);
        let u = Units::new(&layout, 3);
        let mut covered = vec![0u8; layout.total()];
        for r in 0..3 {
            for s in u.segments(r) {
                covered[s.global..s.global + s.len]
                    .iter_mut()
                    .for_each(|c| *c += 1);
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
        assert!(u.shard_total() * 3 >= layout.total());
    }
}

//! The process grid: world = dp x pp x tp. Consecutive ranks form a
//! tensor-parallel group, then come the stages of a pipeline, then the
//! data-parallel replicas: rank = (dp_i * pp + stage) * tp + tp_i. Every
//! group a strategy uses is split from the world here.

use super::ParallelConfig;
use crate::comm::Comm;
use crate::error::Result;

/// The degrees of a (validated) layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

/// A rank's place on the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coords {
    pub dp: usize,
    pub stage: usize,
    pub tp: usize,
}

/// The groups of one rank.
pub struct Groups {
    /// The replicas of this rank's (stage, tp) position.
    pub dp: Box<dyn Comm>,
    /// The stages at this rank's (dp, tp) position (stage s is rank s).
    pub pp: Box<dyn Comm>,
    /// The tensor-parallel group, if tp > 1.
    pub tp: Option<Box<dyn Comm>>,
}

impl Grid {
    pub fn of(par: &ParallelConfig) -> Self {
        let r = par.resolved();
        let (tp, pp) = (r.tp.max(1), r.pipeline.stages.max(1));
        Grid {
            dp: (r.world_size / (tp * pp)).max(1),
            pp,
            tp,
        }
    }

    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            dp: rank / (self.tp * self.pp),
            stage: (rank / self.tp) % self.pp,
            tp: rank % self.tp,
        }
    }

    /// The rank at `c`: `coords`' inverse.
    pub fn rank(&self, c: Coords) -> usize {
        (c.dp * self.pp + c.stage) * self.tp + c.tp
    }

    /// How many ranks apart the neighbours of each group sit: data-parallel
    /// replicas, pipeline stages, tensor-parallel ranks (what decides whether
    /// a group's ring stays inside a node).
    pub fn strides(&self) -> Coords {
        let unit = |dp, stage, tp| self.rank(Coords { dp, stage, tp });
        Coords {
            dp: unit(1, 0, 0),
            stage: unit(0, 1, 0),
            tp: unit(0, 0, 1),
        }
    }

    /// Splits this rank's groups from the world (collective over it).
    pub fn groups(&self, world: &dyn Comm) -> Result<Groups> {
        let c = self.coords(world.rank());
        let dp = world.split(c.stage * self.tp + c.tp, c.dp)?;
        let tp = match self.tp {
            1 => None,
            _ => Some(world.split(world.rank() / self.tp, c.tp)?),
        };
        let pp = world.split(c.dp * self.tp + c.tp, c.stage)?;
        Ok(Groups { dp, pp, tp })
    }

    /// The group of the stages `ends` at this rank's (dp, tp) position,
    /// ordered by stage; ranks on other stages get a group of their own
    /// (collective over the world).
    pub fn stages_group(&self, world: &dyn Comm, ends: &[usize]) -> Result<Box<dyn Comm>> {
        let c = self.coords(world.rank());
        let color = match ends.contains(&c.stage) {
            true => c.dp * self.tp + c.tp,
            false => world.size() + world.rank(),
        };
        world.split(color, c.stage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_put_tp_fastest_then_stages_then_replicas() {
        let g = Grid {
            dp: 2,
            pp: 3,
            tp: 2,
        };
        let mut seen = Vec::new();
        for rank in 0..12 {
            let c = g.coords(rank);
            assert_eq!(g.rank(c), rank);
            assert!(c.dp < 2 && c.stage < 3 && c.tp < 2);
            seen.push((c.dp, c.stage, c.tp));
        }
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 12, "every place once");
        assert_eq!(
            g.coords(7),
            Coords {
                dp: 1,
                stage: 0,
                tp: 1
            }
        );
        let s = g.strides();
        assert_eq!((s.dp, s.stage, s.tp), (6, 2, 1));
    }
}

//! Where an engine's activation buffers come from: the backend, or only a
//! tally of their elements by category. `plan` reads a model's activation
//! memory through the tally, so it runs the very code that allocates the
//! buffers (no second copy of the size formulas) without allocating them.

use crate::backend::{Backend, Buf, Category, Elem};
use crate::error::Result;
use std::cell::Cell;

pub struct ActAlloc<'a, B: Backend> {
    be: &'a B,
    /// Elements asked for as (activations, other); none when allocating.
    tally: Option<Cell<(usize, usize)>>,
}

impl<'a, B: Backend> ActAlloc<'a, B> {
    /// Allocates on `be`.
    pub fn on(be: &'a B) -> Self {
        ActAlloc { be, tally: None }
    }

    /// Counts the elements asked for; the buffers handed out are empty.
    pub fn tally(be: &'a B) -> Self {
        ActAlloc {
            be,
            tally: Some(Cell::new((0, 0))),
        }
    }

    pub fn typed<T: Elem>(&self, len: usize, category: Category) -> Result<Buf<B, T>> {
        match &self.tally {
            None => self.be.alloc_typed(len, category),
            Some(t) => {
                let (acts, other) = t.get();
                t.set(match category {
                    Category::Activations => (acts + len, other),
                    _ => (acts, other + len),
                });
                self.be.alloc_typed(0, category)
            }
        }
    }

    /// An f32 activation buffer.
    pub fn acts(&self, len: usize) -> Result<Buf<B>> {
        self.typed(len, Category::Activations)
    }

    /// Whether `--precision bf16` copies its matmul operands into rounded
    /// scratch: not where the backend's matmuls round them as they
    /// multiply (`Kernels::MATMUL_ROUNDS_BF16`: the CPU). A tally counts
    /// the copies, as a GPU allocates them; `plan` leaves them out for a
    /// CPU.
    pub fn bf16_copies(&self) -> bool {
        self.tally.is_some() || !B::MATMUL_ROUNDS_BF16
    }

    /// Elements counted so far as (activations, other).
    pub fn counted(&self) -> (usize, usize) {
        self.tally.as_ref().map_or((0, 0), Cell::get)
    }
}

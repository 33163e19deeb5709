//! Where an engine's activation buffers come from: the backend, or only a
//! tally of their elements. `plan` reads a model's activation
//! memory through the tally, so it runs the very code that allocates the
//! buffers (no second copy of the size formulas) without allocating them.

use super::Precision;
use crate::backend::{Backend, Buf, Category, Elem, Stored, StoredBuf};
use crate::error::Result;
use std::cell::Cell;

pub struct ActAlloc<'a, B: Backend> {
    be: &'a B,
    /// 4-byte words asked for (an f32 or u32 element each, a bf16 one
    /// half); none when allocating.
    tally: Option<Cell<usize>>,
}

impl<'a, B: Backend> ActAlloc<'a, B> {
    /// Allocates on `be`.
    pub fn on(be: &'a B) -> Self {
        ActAlloc { be, tally: None }
    }

    /// Counts the 4-byte words asked for; the buffers handed out are empty.
    pub fn tally(be: &'a B) -> Self {
        ActAlloc {
            be,
            tally: Some(Cell::new(0)),
        }
    }

    /// An activation buffer of `T`s.
    pub fn typed<T: Elem>(&self, len: usize) -> Result<Buf<B, T>> {
        let len = match &self.tally {
            None => len,
            Some(t) => {
                t.set(t.get() + (len * std::mem::size_of::<T>()).div_ceil(4));
                0
            }
        };
        self.be.alloc_typed(len, Category::Activations)
    }

    /// An f32 activation buffer.
    pub fn acts(&self, len: usize) -> Result<Buf<B>> {
        self.typed(len)
    }

    /// An activation buffer only products read, held as `precision`
    /// holds such tensors: fp32, or bf16 (as autocast holds a bf16
    /// product's input).
    pub fn stored(&self, precision: Precision, len: usize) -> Result<StoredBuf<B>> {
        Ok(match precision {
            Precision::Fp32 => Stored::F32(self.typed(len)?),
            Precision::Bf16 => Stored::Bf16(self.typed(len)?),
        })
    }

    /// 4-byte words counted so far.
    pub fn counted(&self) -> usize {
        self.tally.as_ref().map_or(0, Cell::get)
    }
}

/// Piece `i` of a buffer cut in pieces of `n`, its first `m` elements (a
/// slot's part of an activation sized for the widest block).
pub fn part(i: usize, n: usize, m: usize) -> std::ops::Range<usize> {
    i * n..i * n + m
}

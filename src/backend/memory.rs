//! Byte accounting by category: distgpt's `max_memory_allocated`.
//!
//! Every buffer a backend hands out is tagged with a [`Category`]; the stats
//! track current and peak bytes per category and the peak of the total.

use serde::Serialize;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What a buffer holds, for the per-category memory report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Category {
    Params,
    Grads,
    Optimizer,
    Activations,
    Other,
}

impl Category {
    pub const ALL: [Category; 5] = [
        Category::Params,
        Category::Grads,
        Category::Optimizer,
        Category::Activations,
        Category::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::Params => "params",
            Category::Grads => "grads",
            Category::Optimizer => "optimizer",
            Category::Activations => "activations",
            Category::Other => "other",
        }
    }
}

/// Live counters shared by a backend and every buffer it allocated.
#[derive(Default, Debug)]
pub struct MemoryStats {
    current_bytes: [AtomicU64; 5],
    peak_bytes: [AtomicU64; 5],
    total_bytes: AtomicU64,
    peak_total_bytes: AtomicU64,
}

/// A snapshot of [`MemoryStats`], in bytes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MemoryReport {
    pub current_bytes: CategoryBytes,
    pub peak_bytes: CategoryBytes,
    pub peak_total_bytes: u64,
}

/// Bytes per category.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CategoryBytes {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub other: u64,
}

impl MemoryReport {
    /// Peak bytes as [params, grads, optimizer, activations, other, total].
    pub fn peak_row(&self) -> [u64; 6] {
        let p = &self.peak_bytes;
        [
            p.params,
            p.grads,
            p.optimizer,
            p.activations,
            p.other,
            self.peak_total_bytes,
        ]
    }
}

impl CategoryBytes {
    fn from_counters(c: &[AtomicU64; 5]) -> Self {
        let g = |i: usize| c[i].load(Ordering::Relaxed);
        CategoryBytes {
            params: g(0),
            grads: g(1),
            optimizer: g(2),
            activations: g(3),
            other: g(4),
        }
    }

    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.activations + self.other
    }
}

impl MemoryStats {
    fn add(&self, cat: Category, bytes: u64) {
        let i = cat as usize;
        let now = self.current_bytes[i].fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_bytes[i].fetch_max(now, Ordering::Relaxed);
        let total = self.total_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_total_bytes.fetch_max(total, Ordering::Relaxed);
    }

    fn sub(&self, cat: Category, bytes: u64) {
        self.current_bytes[cat as usize].fetch_sub(bytes, Ordering::Relaxed);
        self.total_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub fn report(&self) -> MemoryReport {
        MemoryReport {
            current_bytes: CategoryBytes::from_counters(&self.current_bytes),
            peak_bytes: CategoryBytes::from_counters(&self.peak_bytes),
            peak_total_bytes: self.peak_total_bytes.load(Ordering::Relaxed),
        }
    }
}

/// A host buffer (f32 unless said otherwise) whose bytes are counted in a
/// [`MemoryStats`] while it lives.
pub struct Buf<T = f32> {
    data: Vec<T>,
    category: Category,
    stats: Arc<MemoryStats>,
}

impl<T: Copy + Default> Buf<T> {
    pub fn zeros(len: usize, category: Category, stats: Arc<MemoryStats>) -> Self {
        stats.add(category, (len * std::mem::size_of::<T>()) as u64);
        Buf {
            data: vec![T::default(); len],
            category,
            stats,
        }
    }
}

impl<T> Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}

impl<T> Drop for Buf<T> {
    fn drop(&mut self) {
        self.stats
            .sub(self.category, std::mem::size_of_val(&*self.data) as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_survives_free_and_categories_are_separate() {
        let stats = Arc::new(MemoryStats::default());
        let a = Buf::<f32>::zeros(100, Category::Params, stats.clone());
        {
            let _b = Buf::<f32>::zeros(50, Category::Activations, stats.clone());
            assert_eq!(stats.report().current_bytes.total(), 600);
        }
        let r = stats.report();
        assert_eq!(r.current_bytes.params, 400);
        assert_eq!(r.current_bytes.activations, 0);
        assert_eq!(r.peak_bytes.activations, 200);
        assert_eq!(r.peak_total_bytes, 600);
        drop(a);
        assert_eq!(stats.report().current_bytes.total(), 0);
        let half = Buf::<u16>::zeros(10, Category::Params, stats.clone());
        assert_eq!(stats.report().current_bytes.params, 20);
        drop(half);
        assert_eq!(stats.report().current_bytes.total(), 0);
    }
}

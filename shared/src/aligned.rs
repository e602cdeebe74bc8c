//! A growable f32 buffer whose first element sits on a 64-byte boundary.
//!
//! The KV cache lives in these. Attention reads it eight floats at a time, and an entry is a
//! multiple of 32 bytes, so on an aligned base no 32-byte load straddles a cache line. A
//! `Vec<f32>` gives no such promise: a large one from the system allocator starts 16 bytes past a
//! page, and every other load of an entry then touches two lines (3-56% of the scores kernel's
//! rate in a model of its loop: docs/benchmarks.md, attention's kernels).

use std::ops::{Deref, DerefMut};

/// One cache line of f32, the unit the storage grows by.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([f32; 16]);

const _: () = assert!(std::mem::size_of::<Line>() == 64 && std::mem::align_of::<Line>() == 64);

/// `Vec<f32>`'s growing API over 64-byte aligned storage: it derefs to the `len` floats pushed so
/// far. Floats past `len` in the last line are padding and never visible.
#[derive(Clone, Default)]
pub struct AlignedVec {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedVec {
    pub const fn new() -> Self {
        Self {
            lines: Vec::new(),
            len: 0,
        }
    }

    /// Room for `additional` more floats without reallocating, and no more than that.
    pub fn reserve_exact(&mut self, additional: usize) {
        let need = (self.len + additional).div_ceil(16);
        self.lines
            .reserve_exact(need.saturating_sub(self.lines.len()));
    }

    /// Floats it holds without reallocating.
    pub fn capacity(&self) -> usize {
        16 * self.lines.capacity()
    }

    pub fn extend_from_slice(&mut self, xs: &[f32]) {
        let at = self.len;
        self.grow_to(at + xs.len());
        self[at..].copy_from_slice(xs);
    }

    /// Keeps the first `len` floats (no-op when it holds fewer).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.lines.truncate(len.div_ceil(16));
        }
    }

    /// `len` floats; the new ones are whatever the lines held (zero, or floats truncated away),
    /// for the caller to overwrite.
    fn grow_to(&mut self, len: usize) {
        let lines = len.div_ceil(16);
        if lines > self.lines.len() {
            self.lines.resize(lines, Line::default());
        }
        self.len = len;
    }
}

impl Deref for AlignedVec {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: `Line` is `repr(C)` over `[f32; 16]`, so `lines` is `16 * lines.len()`
        // contiguous, initialized f32s, and `len <= 16 * lines.len()` (kept by every method).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for AlignedVec {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, through a unique borrow.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

impl<'a> IntoIterator for &'a AlignedVec {
    type Item = &'a f32;
    type IntoIter = std::slice::Iter<'a, f32>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl Extend<f32> for AlignedVec {
    fn extend<I: IntoIterator<Item = f32>>(&mut self, iter: I) {
        let iter = iter.into_iter();
        self.reserve_exact(iter.size_hint().0);
        // a line at a time: a KV log restores gigabytes through here
        let mut line = [0.0f32; 16];
        let mut n = 0;
        for x in iter {
            line[n] = x;
            n += 1;
            if n == line.len() {
                self.extend_from_slice(&line);
                n = 0;
            }
        }
        self.extend_from_slice(&line[..n]);
    }
}

impl From<&[f32]> for AlignedVec {
    fn from(xs: &[f32]) -> Self {
        let mut v = Self::new();
        v.reserve_exact(xs.len());
        v.extend_from_slice(xs);
        v
    }
}

impl PartialEq for AlignedVec {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for AlignedVec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::AlignedVec;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Extend(Vec<f32>),
        Push(Vec<f32>),
        Truncate(usize),
        Reserve(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let xs = || prop::collection::vec(-1e3f32..1e3, 0..40);
        prop_oneof![
            xs().prop_map(Op::Extend),
            xs().prop_map(Op::Push),
            (0usize..100).prop_map(Op::Truncate),
            (0usize..100).prop_map(Op::Reserve),
        ]
    }

    proptest! {
        /// Any sequence of operations leaves the same floats as a `Vec<f32>`, on an aligned base.
        #[test]
        fn behaves_as_a_vec_on_an_aligned_base(ops in prop::collection::vec(op(), 0..30)) {
            let (mut a, mut v) = (AlignedVec::new(), Vec::<f32>::new());
            for o in ops {
                match o {
                    Op::Extend(xs) => {
                        a.extend_from_slice(&xs);
                        v.extend_from_slice(&xs);
                    }
                    Op::Push(xs) => {
                        a.extend(xs.iter().copied());
                        v.extend(xs.iter().copied());
                    }
                    Op::Truncate(n) => {
                        a.truncate(n);
                        v.truncate(n);
                    }
                    Op::Reserve(n) => {
                        a.reserve_exact(n);
                        prop_assert!(a.capacity() >= a.len() + n);
                    }
                }
                prop_assert_eq!(&a[..], &v[..]);
                prop_assert_eq!(a.as_ptr() as usize % 64, 0);
                prop_assert_eq!(a.clone(), AlignedVec::from(&v[..]));
            }
        }
    }

    #[test]
    fn reserved_room_is_not_reallocated() {
        let mut a = AlignedVec::new();
        a.reserve_exact(100);
        let p = a.as_ptr();
        for _ in 0..10 {
            a.extend_from_slice(&[1.0; 10]);
        }
        assert_eq!(a.as_ptr(), p);
        assert_eq!(a.len(), 100);
    }
}

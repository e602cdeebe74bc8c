//! Disk reads built for large sequential records: `O_DIRECT` into 4 KiB-aligned buffers, so expert
//! records bypass the page cache (the store's RAM cache is the only cache, and its budget is the
//! process's real footprint), with a buffered fallback where the filesystem refuses `O_DIRECT`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Alignment `O_DIRECT` needs for buffer address, offset and length on common devices.
pub const DIRECT_ALIGN: usize = 4096;
// An expert record (whole container pages) is read with O_DIRECT into buffers of this alignment.
const _: () = assert!(charm_shared::container::RECORD_ALIGN.is_multiple_of(DIRECT_ALIGN));

/// A zeroed buffer aligned to [`DIRECT_ALIGN`], its length a multiple of it: an anonymous
/// memory mapping, so the kernel supplies zeroed pages without a user-space memset, and large
/// buffers are offered transparent huge pages (fewer page faults and TLB misses when the
/// weights read into it are multiplied).
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// The mapping this buffer is a part of ([`AlignedBuf::populated_many`]), unmapped when
    /// its last part is dropped; `None`: the buffer is its own mapping.
    chunk: Option<std::sync::Arc<Chunk>>,
}

/// A mapping shared by several buffers, each a disjoint range of it.
#[derive(Debug)]
struct Chunk {
    /// (held for its `Drop`, which unmaps it)
    _mapping: AlignedBuf,
}

// SAFETY: the mapping (or, for a part of a chunk, its range) is uniquely owned; `&AlignedBuf`
// only gives out `&[u8]`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `len` bytes (rounded up to the alignment, at least one block).
    pub fn new(len: usize) -> Self {
        Self::map(len, false, Pages::Huge)
    }

    /// [`Self::new`] with every page faulted in now, so first use does not stall on page
    /// faults.
    pub fn populated(len: usize) -> Self {
        Self::map(len, true, Pages::Huge)
    }

    /// [`Self::new`] with the page size chosen: [`Pages::Small`] asks the kernel for 4 KiB
    /// pages only, to measure what huge pages are worth on a machine (`charm iobench
    /// --small-pages`, `charm doctor --deep`).
    pub fn with_pages(len: usize, pages: Pages) -> Self {
        Self::map(len, false, pages)
    }

    fn map(len: usize, populate: bool, pages: Pages) -> Self {
        const HUGE: usize = 2 << 20;
        let len = len.max(1).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        // Large buffers start on a 2 MiB boundary (the mapping is over-allocated and trimmed) so
        // all of it can be backed by huge pages: a record read into them is a few large device
        // requests instead of one per 4 KiB page run (on a VM `charm iobench` read 2.1-2.3x
        // faster than into 4 KiB pages, see docs/single-box.md).
        let huge = len >= HUGE && pages == Pages::Huge;
        let map_len = if huge { len + HUGE } else { len };
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            std::alloc::handle_alloc_error(
                std::alloc::Layout::from_size_align(len, DIRECT_ALIGN).expect("valid layout"),
            );
        }
        let base = p as usize;
        let start = if huge {
            base.next_multiple_of(HUGE)
        } else {
            base
        };
        if huge {
            // SAFETY: the unmapped head and tail lie inside the mapping just made, outside
            // `[start, start + len)`; both are page-aligned (or empty).
            unsafe {
                if start > base {
                    libc::munmap(p, start - base);
                }
                let end = start + len;
                if base + map_len > end {
                    libc::munmap(end as *mut libc::c_void, base + map_len - end);
                }
                // advice on the mapping kept; failure is harmless
                libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        } else if pages == Pages::Small {
            // SAFETY: advice on the mapping just made; failure is harmless.
            unsafe { libc::madvise(p, len, libc::MADV_NOHUGEPAGE) };
        }
        if populate {
            // Fault every page in now (after the huge-page advice, so they can be huge pages).
            for off in (0..len).step_by(DIRECT_ALIGN) {
                // SAFETY: inside the mapping, which is writable and owned here.
                unsafe { std::ptr::write_volatile((start + off) as *mut u8, 0) };
            }
        }
        let ptr = std::ptr::NonNull::new(start as *mut u8).expect("mmap returned a mapping");
        Self {
            ptr,
            len,
            chunk: None,
        }
    }

    /// `count` buffers of [`Self::populated`]'s kind, `len` bytes each (rounded up to the
    /// alignment), carved from one mapping so that buffers smaller than a huge page are backed by
    /// huge pages too: an expert of a small model read into a buffer of its own would sit on
    /// 4 KiB pages, whose TLB misses slow the stream of its weights. The mapping is unmapped
    /// with the last buffer.
    pub fn populated_many(count: usize, len: usize) -> Vec<Self> {
        let len = len.max(1).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        if count == 0 {
            return Vec::new();
        }
        let whole = Self::populated(count * len);
        let base = whole.ptr.as_ptr();
        let chunk = std::sync::Arc::new(Chunk { _mapping: whole });
        (0..count)
            .map(|i| Self {
                // SAFETY: `i * len + len <= count * len`, inside the chunk's mapping.
                ptr: std::ptr::NonNull::new(unsafe { base.add(i * len) }).expect("non-null"),
                len,
                chunk: Some(chunk.clone()),
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` bytes (zero-filled or read) owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Page size asked for a buffer's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pages {
    /// 2 MiB transparent huge pages where the buffer is large enough and the kernel allows
    /// (what the store uses).
    Huge,
    /// 4 KiB pages only.
    Small,
}

/// The kernel's transparent huge page mode (`always`, `madvise` or `never`), `None` where it
/// cannot be read (not Linux, no THP support).
pub fn transparent_huge_pages() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    thp_mode(&s)
}

/// The bracketed mode of a `transparent_hugepage/enabled` file, e.g. `always [madvise] never`.
fn thp_mode(s: &str) -> Option<String> {
    let a = s.find('[')?;
    let b = a + s[a..].find(']')?;
    Some(s[a + 1..b].to_string()).filter(|m| !m.is_empty())
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.chunk.is_none() {
            // SAFETY: unmaps exactly the mapping made in `map`.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

/// A file opened for record reads, `O_DIRECT` when the filesystem allows it.
#[derive(Debug)]
pub struct RecordFile {
    pub path: PathBuf,
    file: File,
    /// Whether reads bypass the page cache.
    pub direct: bool,
    /// Why `O_DIRECT` is not used, when it is not.
    pub fallback_reason: Option<String>,
}

impl RecordFile {
    /// Opens `path`; `want_direct` asks for `O_DIRECT`. A filesystem that refuses it (tmpfs,
    /// some FUSE and network filesystems) gets a buffered file and `fallback_reason` says why.
    pub fn open(path: &Path, want_direct: bool) -> std::io::Result<Self> {
        let reason;
        if want_direct {
            match OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
            {
                Ok(file) => {
                    // Some filesystems accept the flag at open and refuse the first read.
                    let mut probe = AlignedBuf::new(DIRECT_ALIGN);
                    match file.read_at(probe.as_mut_slice(), 0) {
                        Ok(_) => {
                            return Ok(Self {
                                path: path.to_path_buf(),
                                file,
                                direct: true,
                                fallback_reason: None,
                            })
                        }
                        Err(e) => reason = Some(format!("O_DIRECT read refused: {e}")),
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    reason = Some("the filesystem does not support O_DIRECT".into())
                }
                Err(e) => return Err(e),
            }
        } else {
            reason = Some("O_DIRECT not requested".into());
        }
        Ok(Self {
            path: path.to_path_buf(),
            file: File::open(path)?,
            direct: false,
            fallback_reason: reason,
        })
    }

    /// Fills `buf[..len]` from `offset` (`offset` and `buf` aligned; `len` rounded up to the
    /// alignment for `O_DIRECT`, so the buffer must hold the rounded length).
    pub fn read_exact_at(
        &self,
        buf: &mut AlignedBuf,
        offset: u64,
        len: usize,
    ) -> std::io::Result<()> {
        let n = if self.direct {
            len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN
        } else {
            len
        };
        if n > buf.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "read larger than the buffer",
            ));
        }
        self.file
            .read_exact_at(&mut buf.as_mut_slice()[..n], offset)
    }

    /// File length in bytes.
    pub fn file_len(&self) -> std::io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}

/// Result of [`random_reads`].
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ReadBench {
    pub reads: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub block_bytes: usize,
    pub threads: usize,
    pub direct: bool,
    /// Page size of the buffers read into.
    pub pages: Pages,
}

impl ReadBench {
    pub fn bytes_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// Reads random aligned `block`-byte blocks from `files` (each `(file, length)`) with `threads`
/// threads until `max_bytes` are read or `max_seconds` pass; blocks start at multiples of
/// `block` rounded up to the alignment, as expert records do. Each thread reads into one buffer
/// of page size `pages`.
pub fn random_reads(
    files: &[(&RecordFile, u64)],
    block: usize,
    threads: usize,
    (max_bytes, max_seconds): (u64, f64),
    seed: u64,
    pages: Pages,
) -> std::io::Result<ReadBench> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let stride = (block.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN) as u64;
    let slots: Vec<(usize, u64)> = files
        .iter()
        .enumerate()
        .flat_map(|(i, (_, len))| (0..len / stride).map(move |k| (i, k * stride)))
        .collect();
    if slots.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the files are smaller than one block",
        ));
    }
    let bytes = AtomicU64::new(0);
    let reads = AtomicU64::new(0);
    let t0 = std::time::Instant::now();
    let threads = threads.max(1);
    let result: std::io::Result<()> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let (bytes, reads, slots) = (&bytes, &reads, &slots);
                sc.spawn(move || -> std::io::Result<()> {
                    let mut buf = AlignedBuf::with_pages(block, pages);
                    let mut s = seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    loop {
                        if bytes.load(Ordering::Relaxed) >= max_bytes
                            || t0.elapsed().as_secs_f64() >= max_seconds
                        {
                            return Ok(());
                        }
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        let (fi, off) = slots[(s % slots.len() as u64) as usize];
                        files[fi].0.read_exact_at(&mut buf, off, block)?;
                        bytes.fetch_add(block as u64, Ordering::Relaxed);
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        hs.into_iter()
            .try_for_each(|h| h.join().expect("reader thread panicked"))
    });
    result?;
    Ok(ReadBench {
        reads: reads.into_inner(),
        bytes: bytes.into_inner(),
        seconds: t0.elapsed().as_secs_f64(),
        block_bytes: block,
        threads,
        direct: files.iter().all(|(f, _)| f.direct),
        pages,
    })
}

/// Free bytes on the filesystem holding `path` (available to unprivileged users), if the system
/// says.
pub fn free_bytes(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` a buffer of the size statvfs writes.
    let r = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if r != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    // (the field types differ between platforms)
    #[allow(clippy::unnecessary_cast)]
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        for (len, how) in [
            (1, 0),
            (5000, 1),
            (3 << 20, 0),
            (4 << 20, 1),
            (3 << 20, 2),
            (7, 2),
        ] {
            let mut b = match how {
                0 => AlignedBuf::new(len),
                1 => AlignedBuf::populated(len),
                _ => AlignedBuf::with_pages(len, Pages::Small),
            };
            assert_eq!(b.len(), len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN);
            let align = if b.len() >= 2 << 20 && how != 2 {
                2 << 20
            } else {
                DIRECT_ALIGN
            };
            assert_eq!(b.as_slice().as_ptr() as usize % align, 0, "{len}");
            assert!(b.as_slice().iter().all(|&v| v == 0));
            let n = b.len();
            b.as_mut_slice()[n - 1] = 7;
            b.as_mut_slice()[0] = 9;
            assert_eq!((b.as_slice()[0], b.as_slice()[n - 1]), (9, 7));
        }
    }

    #[test]
    fn buffers_carved_from_one_mapping_are_disjoint_and_outlive_each_other() {
        assert!(AlignedBuf::populated_many(0, 4096).is_empty());
        let mut bufs = AlignedBuf::populated_many(5, 700_000);
        let len = 700_000usize.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let base = bufs[0].as_slice().as_ptr() as usize;
        // one huge-page-aligned mapping, the parts back to back
        assert_eq!(base % (2 << 20), 0);
        for (i, b) in bufs.iter_mut().enumerate() {
            assert_eq!(b.len(), len);
            assert_eq!(b.as_slice().as_ptr() as usize, base + i * len);
            assert!(b.as_slice().iter().all(|&v| v == 0));
            b.as_mut_slice().fill(i as u8 + 1);
        }
        // dropping some parts leaves the others mapped and unchanged
        let kept: Vec<AlignedBuf> = bufs.into_iter().skip(3).collect();
        for (i, b) in kept.iter().enumerate() {
            assert!(b.as_slice().iter().all(|&v| v == i as u8 + 4));
        }
    }

    #[test]
    fn reads_the_transparent_huge_page_mode() {
        assert_eq!(
            thp_mode("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(
            thp_mode("[always] madvise never").as_deref(),
            Some("always")
        );
        assert_eq!(thp_mode("always madvise [never]").as_deref(), Some("never"));
        assert_eq!(thp_mode("always madvise never"), None);
        assert_eq!(thp_mode("[]"), None);
        assert_eq!(thp_mode("x [y"), None);
        // this machine's answer, when it has one, is one of the three
        if let Some(m) = transparent_huge_pages() {
            assert!(["always", "madvise", "never"].contains(&m.as_str()), "{m}");
        }
    }

    #[test]
    fn reads_records_direct_or_buffered() {
        let dir = std::env::temp_dir().join(format!("charm-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f.bin");
        let data: Vec<u8> = (0..3 * DIRECT_ALIGN).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        for want in [true, false] {
            let f = RecordFile::open(&p, want).unwrap();
            assert_eq!(f.fallback_reason.is_none(), f.direct);
            let mut b = AlignedBuf::new(2 * DIRECT_ALIGN);
            assert_eq!(b.as_slice().as_ptr() as usize % DIRECT_ALIGN, 0);
            f.read_exact_at(&mut b, DIRECT_ALIGN as u64, 2 * DIRECT_ALIGN)
                .unwrap();
            assert_eq!(b.as_slice(), &data[DIRECT_ALIGN..]);
            // past the end is an error, not a short read
            assert!(f
                .read_exact_at(&mut b, 2 * DIRECT_ALIGN as u64, 2 * DIRECT_ALIGN)
                .is_err());
            let len = f.file_len().unwrap();
            for pages in [Pages::Huge, Pages::Small] {
                let r = random_reads(&[(&f, len)], DIRECT_ALIGN, 2, (64 * 1024, 10.0), 3, pages)
                    .unwrap();
                assert!(r.reads >= 16 && r.bytes == r.reads * DIRECT_ALIGN as u64);
                assert_eq!(r.pages, pages);
            }
            assert!(random_reads(&[(&f, 100)], DIRECT_ALIGN, 1, (1, 1.0), 3, Pages::Huge).is_err());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

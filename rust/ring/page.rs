//! `SharedPage<T>`: one page of a file (in `/dev/shm`) that several processes map, holding a `#[repr(C)]` struct
//! of atomics whose first field is a magic word. The lockstep barrier and the doorbell live in one each.

use std::fs::OpenOptions;
use std::io;
use std::marker::PhantomData;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;

const PAGE: u64 = 4096;

/// The state a shared page holds.
///
/// # Safety
/// Implementors must be `#[repr(C)]`, at most one page long, made only of atomics (valid for any bit pattern,
/// safe to share across processes), and start with the magic word (`magic: AtomicU64`), which `SharedPage` owns.
pub unsafe trait PageState {
    const MAGIC: u64;
    /// What the file is, for errors ("not a doorbell file").
    const NAME: &'static str;
}

pub struct SharedPage<T> {
    map: MmapRaw,
    state: PhantomData<T>,
}

// SAFETY: `T` is only atomics (`PageState`), inside a mapping that lives as long as `self`.
unsafe impl<T: PageState> Send for SharedPage<T> {}
// SAFETY: as above; every access goes through atomics.
unsafe impl<T: PageState> Sync for SharedPage<T> {}

impl<T: PageState> SharedPage<T> {
    /// Create the file (never reusing one) and run `init` on the zeroed state before the magic word makes it valid.
    pub fn create(path: impl AsRef<Path>, init: impl FnOnce(&T)) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        file.set_len(PAGE)?;
        let page = Self::map(&file)?;
        init(page.get());
        page.magic().store(T::MAGIC, Ordering::Release);
        Ok(page)
    }

    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("{what} {} file", T::NAME));
        if file.metadata()?.len() < PAGE {
            return Err(invalid("short"));
        }
        let page = Self::map(&file)?;
        if page.magic().load(Ordering::Acquire) != T::MAGIC {
            return Err(invalid("not a"));
        }
        Ok(page)
    }

    fn map(file: &std::fs::File) -> io::Result<Self> {
        Ok(SharedPage { map: memmap2::MmapOptions::new().populate().map_raw(file)?, state: PhantomData })
    }

    fn magic(&self) -> &AtomicU64 {
        // SAFETY: `PageState` puts an `AtomicU64` at offset 0 of the page-aligned mapping, which outlives `self`.
        unsafe { &*(self.map.as_ptr() as *const AtomicU64) }
    }

    pub fn get(&self) -> &T {
        const { assert!(std::mem::size_of::<T>() as u64 <= PAGE) };
        // SAFETY: the mapping is page aligned, one page long (checked above), lives as long as `self`, and `T` is
        // only atomics (`PageState`).
        unsafe { &*(self.map.as_ptr() as *const T) }
    }
}

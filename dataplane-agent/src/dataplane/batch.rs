//! Batched map operations (`BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_UPDATE_BATCH`,
//! `BPF_MAP_DELETE_BATCH`, Linux 5.6) through the raw `bpf(2)` syscall:
//! aya 0.14 has no API for them; and the per-key walk and delete of
//! untyped maps, for the map types without batches.
//!
//! One syscall moves thousands of entries, so reading a million-entry map or
//! programming 100k Services costs a few hundred syscalls instead of
//! millions. Hash, LRU hash, array and per-CPU array maps support them;
//! LPM tries do not (their callers stay per key).
//!
//! The wrappers only build the `bpf_attr` for these commands and hand the
//! kernel buffers sized from the key and value types; every unsafe block
//! says what makes it sound.

use std::{
    io,
    mem::size_of,
    os::fd::{AsRawFd as _, BorrowedFd},
};

use aya::Pod;

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// Entries per syscall: large enough that the syscall cost vanishes, small
/// enough that buffers stay in the cache.
pub const CHUNK: usize = 4096;

/// The `batch` member of `union bpf_attr` (include/uapi/linux/bpf.h). The
/// kernel zero-fills the rest of the union when the size passed is smaller.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Runs one batch command; returns the kernel's `count` (elements done) with
/// the error, if any.
fn batch(cmd: libc::c_long, attr: &mut BatchAttr) -> (u32, io::Result<()>) {
    // SAFETY: `attr` is a valid, initialised `bpf_attr` prefix of the size
    // passed; the pointers in it reference live buffers of `count` elements
    // of the map's key and value sizes (the callers guarantee it), which
    // outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut BatchAttr, size_of::<BatchAttr>()) };
    let result = if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    };
    (attr.count, result)
}

/// The bytes of a slice of `Pod` values.
fn bytes_of<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: `T: Pod` has no padding that matters to the kernel and any
    // byte is a valid u8; the slice covers exactly the values' memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Entries from which an update is split over several threads: the
/// kernel's per-entry work (hashing, a bucket lock, a preallocated element
/// from this CPU's free list, copies) is most of a large write, and hash
/// maps take concurrent writers on different buckets.
pub const PARALLEL_MIN: usize = 16 * CHUNK;

/// Threads a large update is split over (asked once: the answer reads
/// cgroup files, which costs more than a small update).
fn writers() -> usize {
    static WRITERS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *WRITERS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(4)))
}

/// Writes (creates or replaces) the entries given as packed key and value
/// bytes (`key_size` and `value_size` bytes each); returns how many. On
/// failure returns a prefix of the entries known written (in order) with
/// the error; with several writers, entries beyond it may be written too
/// (callers re-read the maps after any failed write). Large updates are
/// split over up to 4 threads ([`PARALLEL_MIN`]).
/// (Batched updates take no `BPF_NOEXIST`: only `BPF_F_LOCK` is allowed.)
pub fn update_raw(
    fd: BorrowedFd<'_>,
    key_size: usize,
    value_size: usize,
    keys: &[u8],
    values: &[u8],
) -> Result<usize, (usize, io::Error)> {
    let count = keys.len().checked_div(key_size).unwrap_or(0);
    assert_eq!(values.len(), count * value_size, "one value per key");
    if count < PARALLEL_MIN || writers() < 2 {
        return update_serial(fd, key_size, value_size, keys, values);
    }
    let threads = writers();
    let per = count.div_ceil(threads);
    let results: Vec<Result<usize, (usize, io::Error)>> = std::thread::scope(|scope| {
        let parts: Vec<_> = (0..count)
            .step_by(per)
            .map(|start| {
                let end = (start + per).min(count);
                let (k, v) = (
                    &keys[start * key_size..end * key_size],
                    &values[start * value_size..end * value_size],
                );
                scope.spawn(move || update_serial(fd, key_size, value_size, k, v))
            })
            .collect();
        parts
            .into_iter()
            .map(|p| p.join().expect("a batch writer panicked"))
            .collect()
    });
    // The prefix known written: whole parts up to the first that failed,
    // and what that one wrote.
    let mut written = 0;
    for r in results {
        match r {
            Ok(n) => written += n,
            Err((n, e)) => return Err((written + n, e)),
        }
    }
    Ok(written)
}

/// [`update_raw`] on the calling thread, in order.
fn update_serial(
    fd: BorrowedFd<'_>,
    key_size: usize,
    value_size: usize,
    keys: &[u8],
    values: &[u8],
) -> Result<usize, (usize, io::Error)> {
    let count = keys.len().checked_div(key_size).unwrap_or(0);
    let (mut start, mut written) = (0, 0);
    while start < count {
        let n = (count - start).min(CHUNK);
        let mut attr = BatchAttr {
            keys: keys[start * key_size..].as_ptr() as u64,
            values: values[start * value_size..].as_ptr() as u64,
            count: n as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        let (done, result) = batch(BPF_MAP_UPDATE_BATCH, &mut attr);
        let done = (done as usize).min(n);
        written += done;
        if let Err(e) = result {
            return Err((start + done, e));
        }
        start += n;
    }
    Ok(written)
}

/// Writes `entries` (`BPF_ANY`); on failure returns how many were written
/// (in order) with the error.
pub fn update<K: Pod, V: Pod>(fd: BorrowedFd<'_>, entries: &[(K, V)]) -> Result<(), (usize, io::Error)> {
    let keys: Vec<K> = entries.iter().map(|(k, _)| *k).collect();
    let values: Vec<V> = entries.iter().map(|(_, v)| *v).collect();
    update_pairs(fd, &keys, &values)
}

/// As [`update`], keys and values in two slices of the same length.
pub fn update_pairs<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), (usize, io::Error)> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    update_raw(
        fd,
        size_of::<K>(),
        size_of::<V>(),
        bytes_of(keys),
        bytes_of(values),
    )
    .map(drop)
}

/// Deletes `keys`; keys that are not in the map are skipped. On failure
/// returns how many keys were handled (in order) with the error.
pub fn delete<K: Pod>(fd: BorrowedFd<'_>, keys: &[K]) -> Result<(), (usize, io::Error)> {
    delete_raw(fd, size_of::<K>(), bytes_of(keys))
}

/// As [`delete`], the keys given as packed bytes (`key_size` bytes each).
pub fn delete_raw(fd: BorrowedFd<'_>, key_size: usize, keys: &[u8]) -> Result<(), (usize, io::Error)> {
    let total = keys.len().checked_div(key_size).unwrap_or(0);
    let mut start = 0;
    while start < total {
        let end = total.min(start + CHUNK);
        let chunk = &keys[start * key_size..end * key_size];
        let mut attr = BatchAttr {
            keys: chunk.as_ptr() as u64,
            count: (end - start) as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        let (count, result) = batch(BPF_MAP_DELETE_BATCH, &mut attr);
        let count = (count as usize).min(end - start);
        match result {
            Ok(()) => start = end,
            // The batch stops at a missing key: skip it and go on.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => start += count + 1,
            Err(e) => return Err((start + count, e)),
        }
    }
    Ok(())
}

/// The `key`/`value`/`next_key` members of `union bpf_attr` for the
/// single-element commands.
#[repr(C)]
#[derive(Default)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    /// `value` or `next_key`.
    value: u64,
    flags: u64,
}

const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

fn elem(cmd: libc::c_long, attr: &mut ElemAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid, initialised `bpf_attr` prefix of the size
    // passed; its pointers reference live buffers of the map's key size
    // (the callers guarantee it), which outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut ElemAttr, size_of::<ElemAttr>()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Every key of a map, one `BPF_MAP_GET_NEXT_KEY` per key, packed
/// (`key_size` bytes each): for the map types without batched lookups
/// (LPM tries, device maps).
pub fn keys_raw(fd: BorrowedFd<'_>, key_size: usize) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut next = vec![0u8; key_size];
    let mut prev: Option<Vec<u8>> = None;
    loop {
        let mut attr = ElemAttr {
            map_fd: fd.as_raw_fd() as u32,
            key: prev.as_ref().map_or(0, |k| k.as_ptr() as u64),
            value: next.as_mut_ptr() as u64,
            ..Default::default()
        };
        match elem(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
            Err(e) => return Err(e),
        }
        out.extend_from_slice(&next);
        prev = Some(next.clone());
    }
}

/// Deletes `keys` (packed, `key_size` bytes each) one syscall per key;
/// missing keys are skipped.
pub fn delete_each_raw(fd: BorrowedFd<'_>, key_size: usize, keys: &[u8]) -> io::Result<()> {
    for key in keys.chunks_exact(key_size) {
        let mut attr = ElemAttr {
            map_fd: fd.as_raw_fd() as u32,
            key: key.as_ptr() as u64,
            ..Default::default()
        };
        match elem(BPF_MAP_DELETE_ELEM, &mut attr) {
            Err(e) if e.raw_os_error() != Some(libc::ENOENT) => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// Calls `each` with every entry of the map, `CHUNK` entries per syscall.
/// Per-CPU maps need [`for_each_per_cpu`].
pub fn for_each<K: Pod, V: Pod>(fd: BorrowedFd<'_>, mut each: impl FnMut(&K, &V)) -> io::Result<()> {
    for_each_raw(fd, size_of::<K>(), size_of::<V>(), |k, v| {
        // SAFETY: `k` and `v` are one key and one value as the kernel wrote
        // them (`size_of::<K>()` and `size_of::<V>()` bytes); `K, V: Pod`
        // are valid for any bytes; read_unaligned copes with alignment.
        let (k, v) = unsafe {
            (
                k.as_ptr().cast::<K>().read_unaligned(),
                v.as_ptr().cast::<V>().read_unaligned(),
            )
        };
        each(&k, &v);
    })
}

/// As [`for_each`] for a per-CPU map: `each` gets the values of every CPU
/// (`ncpus` = the kernel's possible CPUs, as aya's `nr_cpus()`).
pub fn for_each_per_cpu<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    ncpus: usize,
    mut each: impl FnMut(&K, &[V]),
) -> io::Result<()> {
    // The kernel lays per-CPU values out 8-byte aligned, one per CPU.
    let stride = size_of::<V>().div_ceil(8) * 8;
    let mut per_cpu = Vec::with_capacity(ncpus);
    for_each_raw(fd, size_of::<K>(), stride * ncpus, |k, v| {
        per_cpu.clear();
        for cpu in 0..ncpus {
            // SAFETY: `v` holds `ncpus` values `stride` bytes apart; `V: Pod`;
            // read_unaligned copes with alignment.
            per_cpu.push(unsafe { v.as_ptr().add(cpu * stride).cast::<V>().read_unaligned() });
        }
        // SAFETY: as in `for_each`.
        let k = unsafe { k.as_ptr().cast::<K>().read_unaligned() };
        each(&k, &per_cpu);
    })
}

/// The number of entries of a hash map.
pub fn count<K: Pod, V: Pod>(fd: BorrowedFd<'_>) -> io::Result<usize> {
    let mut n = 0;
    for_each_raw(fd, size_of::<K>(), size_of::<V>(), |_, _| n += 1)?;
    Ok(n)
}

/// Calls `each` with the bytes of every key and value (`value_size`: the
/// bytes of one element's value, all CPUs for a per-CPU map).
pub fn for_each_raw(
    fd: BorrowedFd<'_>,
    key_size: usize,
    value_size: usize,
    mut each: impl FnMut(&[u8], &[u8]),
) -> io::Result<()> {
    let mut keys = vec![0u8; CHUNK * key_size];
    let mut values = vec![0u8; CHUNK * value_size];
    // The batch token is opaque to user space; the kernel writes at most a
    // key's worth (hash maps: a bucket index, arrays: an index).
    let token_len = key_size.max(8).div_ceil(8);
    let mut tokens = [vec![0u64; token_len], vec![0u64; token_len]];
    let mut first = true;
    loop {
        let [in_token, out_token] = &mut tokens;
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { in_token.as_ptr() as u64 },
            out_batch: out_token.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        let (count, result) = batch(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let count = (count as usize).min(CHUNK);
        let done = match result {
            Ok(()) => false,
            // ENOENT: the end of the map (the last chunk may still hold entries).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(e) => return Err(e),
        };
        for i in 0..count {
            each(
                &keys[i * key_size..(i + 1) * key_size],
                &values[i * value_size..(i + 1) * value_size],
            );
        }
        if done || count == 0 {
            return Ok(());
        }
        first = false;
        tokens.swap(0, 1);
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd as _, FromRawFd as _, OwnedFd};

    use super::*;

    /// A fresh preallocated hash map of u32 → u64 (needs CAP_BPF: the unit
    /// tests run as root in CI).
    fn hash_map(max_entries: u32) -> OwnedFd {
        #[repr(C)]
        #[derive(Default)]
        struct CreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
            _rest: [u32; 11],
        }
        let attr = CreateAttr {
            map_type: 1, // BPF_MAP_TYPE_HASH
            key_size: 4,
            value_size: 8,
            max_entries,
            ..Default::default()
        };
        // SAFETY: BPF_MAP_CREATE (0) with a valid, zero-padded attribute of
        // the size passed.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, 0, &raw const attr, size_of::<CreateAttr>()) };
        assert!(fd >= 0, "create a BPF hash map: {}", io::Error::last_os_error());
        // SAFETY: a fresh descriptor nobody else owns.
        unsafe { OwnedFd::from_raw_fd(fd as i32) }
    }

    fn entries(n: u32) -> (Vec<u32>, Vec<u64>) {
        ((0..n).collect(), (0..n).map(|k| u64::from(k) * 3 + 1).collect())
    }

    fn contents(fd: BorrowedFd<'_>) -> std::collections::BTreeMap<u32, u64> {
        let mut m = std::collections::BTreeMap::new();
        for_each(fd, |k: &u32, v: &u64| {
            m.insert(*k, *v);
        })
        .unwrap();
        m
    }

    #[test]
    fn a_large_update_split_over_threads_writes_every_entry() {
        let n = (PARALLEL_MIN * 2 + 17) as u32;
        let map = hash_map(n);
        let (keys, values) = entries(n);
        update_pairs(map.as_fd(), &keys, &values).expect("write");
        let got = contents(map.as_fd());
        assert_eq!(got.len(), n as usize);
        assert!(got.iter().all(|(k, v)| *v == u64::from(*k) * 3 + 1));
    }

    #[test]
    fn a_large_update_that_does_not_fit_reports_a_prefix_known_written() {
        let n = (PARALLEL_MIN * 2) as u32;
        let capacity = n - 1000;
        let map = hash_map(capacity);
        let (keys, values) = entries(n);
        let (written, e) = update_pairs(map.as_fd(), &keys, &values).expect_err("more entries than room");
        assert_eq!(e.raw_os_error(), Some(libc::E2BIG), "{e}");
        let got = contents(map.as_fd());
        assert!(
            written < n as usize && got.len() <= capacity as usize,
            "{written}, {}",
            got.len()
        );
        assert!(
            (0..written as u32).all(|k| got.get(&k) == Some(&(u64::from(k) * 3 + 1))),
            "the first {written} entries are in the map"
        );
    }
}

//! Zeroing without `memset`. This toolchain lowers the zeroing of any
//! aggregate (`Default`, `[0; N]`, `mem::zeroed`) to a call of `memset`,
//! linked in as a BPF subprogram: a call per use, and on CPUs whose kernel
//! returns through a thunk (AMD's SRSO "safe RET", retbleed) a mispredicted
//! return. Hot structures avoid byte arrays; the few aggregates that must
//! start zeroed go through [`zeroed`].

use core::mem::{MaybeUninit, align_of, size_of};

/// Zeroes `m` with 4-byte volatile stores (the compiler cannot merge them
/// back into a `memset`) and returns it initialised.
///
/// # Safety
/// All zeroes must be a valid `T` (plain data: integers, booleans, arrays
/// and unions of those).
#[inline(always)]
pub unsafe fn zeroed<T>(m: &mut MaybeUninit<T>) -> &mut T {
    const { assert!(size_of::<T>().is_multiple_of(4) && align_of::<T>() >= 4) };
    let words = m.as_mut_ptr() as *mut u32;
    let mut i = 0;
    while i < size_of::<T>() / 4 {
        // SAFETY: within `m`, 4-aligned (checked above).
        unsafe { words.add(i).write_volatile(0) };
        i += 1;
    }
    // SAFETY: every byte is written; the caller vouches that zeroes are a `T`.
    unsafe { m.assume_init_mut() }
}

/// Zeroes `t` in place, as [`zeroed`] does.
///
/// # Safety
/// All zeroes must be a valid `T` (as for [`zeroed`]).
#[inline(always)]
pub unsafe fn clear<T>(t: &mut T) {
    // SAFETY: `t` is a valid, initialised `T`: seen as `MaybeUninit`, it
    // is overwritten with zeroes, which the caller vouches are a `T`.
    unsafe { zeroed(&mut *(t as *mut T as *mut MaybeUninit<T>)) };
}

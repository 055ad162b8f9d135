//! Loads and stores of header fields at any address in packet memory, as
//! single instructions.
//!
//! Header fields are not aligned in general (an IPv4 address sits at offset
//! 26 of an Ethernet frame), and LLVM's BPF backend lowers every access it
//! cannot prove aligned (`read_unaligned`) to byte loads and shifts: an
//! IPv6 address took 16 loads, 15 shifts and 15 ors. The kernel accepts
//! misaligned *packet* accesses where the CPU handles them
//! (`CONFIG_HAVE_EFFICIENT_UNALIGNED_ACCESS`: x86-64 and arm64, the
//! architectures we ship for), so these helpers emit the one load or store
//! the field needs. LLVM's `allows-misaligned-mem-access` feature would do
//! the same for every access, but also for the stack and the program
//! context, where the verifier demands alignment; the helpers confine it
//! to packet memory.
//!
//! Only for pointers into packet data (checked against its end first).

use core::{arch::asm, mem::size_of};

/// Reads a `T` of 1, 2, 4, 8 or 16 bytes (others byte by byte).
///
/// # Safety
/// `p` points to `size_of::<T>()` readable bytes of packet data, and any bit
/// pattern of that size is a valid `T`.
#[inline(always)]
pub unsafe fn read<T: Copy>(p: *const T) -> T {
    let a = p as usize;
    // SAFETY (every arm): the caller's bounds; sizes match `T`'s exactly.
    unsafe {
        match size_of::<T>() {
            2 => {
                let v: u64;
                asm!("{v} = *(u16 *)({a} + 0)", v = lateout(reg) v, a = in(reg) a,
                    options(nostack, readonly, preserves_flags));
                core::mem::transmute_copy(&(v as u16))
            }
            4 => {
                let v: u64;
                asm!("{v} = *(u32 *)({a} + 0)", v = lateout(reg) v, a = in(reg) a,
                    options(nostack, readonly, preserves_flags));
                core::mem::transmute_copy(&(v as u32))
            }
            8 => {
                let v: u64;
                asm!("{v} = *(u64 *)({a} + 0)", v = lateout(reg) v, a = in(reg) a,
                    options(nostack, readonly, preserves_flags));
                core::mem::transmute_copy(&v)
            }
            16 => {
                let (lo, hi): (u64, u64);
                asm!("{lo} = *(u64 *)({a} + 0)", "{hi} = *(u64 *)({a} + 8)",
                    lo = out(reg) lo, hi = lateout(reg) hi, a = in(reg) a,
                    options(nostack, readonly, preserves_flags));
                core::mem::transmute_copy(&[lo, hi])
            }
            _ => p.read_unaligned(),
        }
    }
}

/// Writes a `T` of 1, 2, 4, 8 or 16 bytes (others byte by byte).
///
/// # Safety
/// `p` points to `size_of::<T>()` writable bytes of packet data.
#[inline(always)]
pub unsafe fn write<T: Copy>(p: *mut T, value: T) {
    let a = p as usize;
    // SAFETY (every arm): the caller's bounds; sizes match `T`'s exactly.
    unsafe {
        match size_of::<T>() {
            2 => {
                let v = core::mem::transmute_copy::<T, u16>(&value) as u64;
                asm!("*(u16 *)({a} + 0) = {v}", v = in(reg) v, a = in(reg) a,
                    options(nostack, preserves_flags));
            }
            4 => {
                let v = core::mem::transmute_copy::<T, u32>(&value) as u64;
                asm!("*(u32 *)({a} + 0) = {v}", v = in(reg) v, a = in(reg) a,
                    options(nostack, preserves_flags));
            }
            8 => {
                let v = core::mem::transmute_copy::<T, u64>(&value);
                asm!("*(u64 *)({a} + 0) = {v}", v = in(reg) v, a = in(reg) a,
                    options(nostack, preserves_flags));
            }
            16 => {
                let [lo, hi] = core::mem::transmute_copy::<T, [u64; 2]>(&value);
                asm!("*(u64 *)({a} + 0) = {lo}", "*(u64 *)({a} + 8) = {hi}",
                    lo = in(reg) lo, hi = in(reg) hi, a = in(reg) a,
                    options(nostack, preserves_flags));
            }
            _ => p.write_unaligned(value),
        }
    }
}

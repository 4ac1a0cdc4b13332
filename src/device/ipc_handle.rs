//! `IpcHandle`: a device block exported for another process, and its byte form.
//!
//! Owns the handle's layout only. A handle is of one of two kinds, told apart by the tag's
//! last byte: a block of a whole segment (the driver's opaque `cuIpcGetMemHandle` handle of
//! the segment and the block's offset inside it), or a block of an expandable range (the
//! file descriptors, in the exporting process, of the memory handles the block touches,
//! each with its size, the granule, an export id, and the block's offset inside the first
//! handle's memory). Both carry the block's length, its device and the exporting process's
//! id. [`IpcHandle::to_bytes`] / [`IpcHandle::from_bytes`] (and the hex forms, for a command
//! line) carry it across a process boundary; bytes that are not a handle are
//! [`Error::InvalidIpcHandle`], never a panic, and a handle lists at most
//! [`MAX_MAPPED_HANDLES`] file descriptors.

use std::fmt;
use std::str::FromStr;

use crate::actors::Error;

/// Bytes of the driver's handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// The most memory handles (file descriptors) one handle of an expandable range lists.
pub const MAX_MAPPED_HANDLES: usize = 1 << 16;

/// What the byte form of a segment's block starts with: a tag and its kind.
const MAGIC: &[u8; 6] = b"PPIPC\x01";
/// What the byte form of a block of an expandable range starts with.
const MAGIC_MAPPED: &[u8; 6] = b"PPIPC\x02";
/// Bytes of a segment's form: magic, device (u32), pid (u32), offset (u64), len (u64),
/// handle.
const ENCODED_BYTES: usize = MAGIC.len() + 4 + 4 + 8 + 8 + IPC_HANDLE_BYTES;
/// Bytes of the fixed part of the mapped form: magic, device (u32), pid (u32), offset
/// (u64), len (u64), export id (u64), granule (u64), handle count (u32); then per handle
/// its file descriptor (i32) and size (u64).
const MAPPED_HEADER_BYTES: usize = MAGIC_MAPPED.len() + 4 + 4 + 8 + 8 + 8 + 8 + 4;
/// Bytes per memory handle of the mapped form.
const MAPPED_ENTRY_BYTES: usize = 4 + 8;
/// The largest granule a handle may name (the smallest is 4 KiB).
const MAX_GRANULE: u64 = 1 << 40;

/// One memory handle of an exported block of an expandable range: its file descriptor in
/// the exporting process and the bytes of memory behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MappedHandle {
    /// The file descriptor number in the exporting process.
    pub fd: i32,
    /// Bytes of the memory (whole granules).
    pub size: u64,
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum Kind {
    /// A block of a whole segment: the driver's handle of the segment.
    Segment([u8; IPC_HANDLE_BYTES]),
    /// A block of an expandable range: the memory handles it touches.
    Mapped {
        /// Unique per export in the exporting process.
        export: u64,
        granule: u64,
        handles: Vec<MappedHandle>,
    },
}

/// What an opened handle shares with other handles: blocks with the same source share one
/// open (one segment, or the memory handles of one export).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    Segment([u8; IPC_HANDLE_BYTES]),
    Mapped { pid: u32, export: u64 },
}

/// A device block exported for another process ([`DeviceAllocator::ipc_handle`]); open it
/// there with [`DeviceAllocator::open_ipc`]. Either a block of a whole segment, or (the
/// default layout) a block of an expandable range, which names the file descriptors of its
/// memory in the exporting process.
///
/// [`DeviceAllocator::ipc_handle`]: crate::DeviceAllocator::ipc_handle
/// [`DeviceAllocator::open_ipc`]: crate::DeviceAllocator::open_ipc
///
/// ```
/// use pinpool::IpcHandle;
///
/// let h = IpcHandle::new([7; 64], 4096, 1 << 20, 1);
/// let sent = h.to_hex(); // e.g. on a child's command line
/// let got: IpcHandle = sent.parse()?;
/// assert_eq!(got, h);
/// assert_eq!((got.offset(), got.len(), got.device()), (4096, 1 << 20, 1));
/// assert_eq!(got.segment_handle(), Some(&[7; 64]));
/// assert!(got.mapped_handles().is_empty());
/// assert!(matches!(
///     IpcHandle::from_bytes(b"not a handle"),
///     Err(pinpool::Error::InvalidIpcHandle { .. })
/// ));
/// # Ok::<(), pinpool::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IpcHandle {
    kind: Kind,
    offset: u64,
    len: u64,
    device: u32,
    pid: u32,
}

fn bad(reason: impl Into<String>) -> Error {
    Error::InvalidIpcHandle {
        reason: reason.into(),
    }
}

/// Reads fixed-size fields off the front of a byte slice; `None` past its end.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_at_checked(N)?;
        self.0 = rest;
        head.try_into().ok()
    }

    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }

    fn i32(&mut self) -> Option<i32> {
        self.take().map(i32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

impl IpcHandle {
    /// A handle for `len` bytes at `offset` of the segment the driver's `handle` names, on
    /// `device`, exported by this process.
    pub fn new(handle: [u8; IPC_HANDLE_BYTES], offset: u64, len: u64, device: usize) -> Self {
        Self {
            kind: Kind::Segment(handle),
            offset,
            len,
            device: device as u32,
            pid: std::process::id(),
        }
    }

    /// A handle for `len` bytes at `offset` of the memory of `handles` (contiguous, in
    /// order, each whole granules of `granule`), on `device`, exported by this process as
    /// export `export`. [`Error::InvalidIpcHandle`] where the pieces do not fit together.
    pub(crate) fn new_mapped(
        export: u64,
        granule: u64,
        handles: Vec<MappedHandle>,
        offset: u64,
        len: u64,
        device: usize,
    ) -> Result<Self, Error> {
        let h = Self {
            kind: Kind::Mapped {
                export,
                granule,
                handles,
            },
            offset,
            len,
            device: u32::try_from(device).map_err(|_| bad("device ordinal out of range"))?,
            pid: std::process::id(),
        };
        h.check()?;
        Ok(h)
    }

    /// Checks what the sender's word alone says about a handle.
    fn check(&self) -> Result<(), Error> {
        if self.len == 0 {
            return Err(bad("it describes an empty block"));
        }
        let end = self
            .offset
            .checked_add(self.len)
            .ok_or_else(|| bad("its offset and length overflow"))?;
        let Kind::Mapped {
            granule, handles, ..
        } = &self.kind
        else {
            return Ok(());
        };
        if !granule.is_power_of_two() || !(4096..=MAX_GRANULE).contains(granule) {
            return Err(bad(format!("a granule of {granule} bytes")));
        }
        if handles.is_empty() || handles.len() > MAX_MAPPED_HANDLES {
            return Err(bad(format!(
                "{} memory handles (1 to {MAX_MAPPED_HANDLES})",
                handles.len()
            )));
        }
        let mut total = 0u64;
        for h in handles {
            if h.fd < 0 || h.size == 0 || h.size % granule != 0 {
                return Err(bad(format!(
                    "a memory handle (descriptor {}) of {} bytes, not whole granules of {granule}",
                    h.fd, h.size
                )));
            }
            total = total
                .checked_add(h.size)
                .filter(|&t| usize::try_from(t).is_ok())
                .ok_or_else(|| bad("its memory handles' sizes overflow"))?;
        }
        if self.offset >= handles[0].size || end > total {
            return Err(bad(format!(
                "a block of {} bytes at offset {} does not lie inside its {total} bytes of \
                 memory handles (starting in the first)",
                self.len, self.offset
            )));
        }
        Ok(())
    }

    /// The driver's handle of the block's segment: equal for blocks of one segment. `None`
    /// for a block of an expandable range.
    pub fn segment_handle(&self) -> Option<&[u8; IPC_HANDLE_BYTES]> {
        match &self.kind {
            Kind::Segment(h) => Some(h),
            Kind::Mapped { .. } => None,
        }
    }

    /// For a block of an expandable range, its memory handles (file descriptors in the
    /// exporting process, and sizes), in address order; empty for a block of a segment.
    pub fn mapped_handles(&self) -> &[MappedHandle] {
        match &self.kind {
            Kind::Segment(_) => &[],
            Kind::Mapped { handles, .. } => handles,
        }
    }

    /// For a block of an expandable range, the granule its memory handles' sizes are
    /// multiples of.
    pub(crate) fn granule(&self) -> Option<u64> {
        match &self.kind {
            Kind::Segment(_) => None,
            Kind::Mapped { granule, .. } => Some(*granule),
        }
    }

    /// What this handle's open is shared with: blocks of one segment, or one export.
    pub(crate) fn source(&self) -> Source {
        match &self.kind {
            Kind::Segment(h) => Source::Segment(*h),
            Kind::Mapped { export, .. } => Source::Mapped {
                pid: self.pid,
                export: *export,
            },
        }
    }

    /// Where the block starts inside its segment (for a block of an expandable range:
    /// inside the first memory handle's memory).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes of the block (the length of the buffer that was exported).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the block has no bytes (never for a handle the allocator made).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory is on (its ordinal in the exporting process).
    pub fn device(&self) -> usize {
        self.device as usize
    }

    /// The id of the process that exported it (for a block of an expandable range, the
    /// process whose file descriptors are duplicated at the open).
    pub fn exporter_pid(&self) -> u32 {
        self.pid
    }

    /// The byte form (little-endian numbers; fixed length for a block of a segment).
    pub fn to_bytes(&self) -> Vec<u8> {
        let common = |out: &mut Vec<u8>| {
            out.extend_from_slice(&self.device.to_le_bytes());
            out.extend_from_slice(&self.pid.to_le_bytes());
            out.extend_from_slice(&self.offset.to_le_bytes());
            out.extend_from_slice(&self.len.to_le_bytes());
        };
        match &self.kind {
            Kind::Segment(handle) => {
                let mut out = Vec::with_capacity(ENCODED_BYTES);
                out.extend_from_slice(MAGIC);
                common(&mut out);
                out.extend_from_slice(handle);
                out
            }
            Kind::Mapped {
                export,
                granule,
                handles,
            } => {
                let mut out =
                    Vec::with_capacity(MAPPED_HEADER_BYTES + handles.len() * MAPPED_ENTRY_BYTES);
                out.extend_from_slice(MAGIC_MAPPED);
                common(&mut out);
                out.extend_from_slice(&export.to_le_bytes());
                out.extend_from_slice(&granule.to_le_bytes());
                // At most MAX_MAPPED_HANDLES (checked when made).
                out.extend_from_slice(&(handles.len() as u32).to_le_bytes());
                for h in handles {
                    out.extend_from_slice(&h.fd.to_le_bytes());
                    out.extend_from_slice(&h.size.to_le_bytes());
                }
                out
            }
        }
    }

    /// Reads the byte form ([`Error::InvalidIpcHandle`] for anything else).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        let too_short = || bad(format!("{} bytes are too few for a handle", bytes.len()));
        let mut r = Reader(bytes);
        let magic: [u8; 6] = r.take().ok_or_else(too_short)?;
        let mapped = match &magic {
            m if m == MAGIC => false,
            m if m == MAGIC_MAPPED => true,
            _ => return Err(bad("it does not start with a pinpool handle's tag")),
        };
        let (device, pid, offset, len) =
            (|| Some((r.u32()?, r.u32()?, r.u64()?, r.u64()?)))().ok_or_else(too_short)?;
        let kind = if mapped {
            let (export, granule, count) =
                (|| Some((r.u64()?, r.u64()?, r.u32()?)))().ok_or_else(too_short)?;
            let count = count as usize;
            if count == 0 || count > MAX_MAPPED_HANDLES {
                return Err(bad(format!(
                    "{count} memory handles (1 to {MAX_MAPPED_HANDLES})"
                )));
            }
            if r.0.len() != count * MAPPED_ENTRY_BYTES {
                return Err(bad(format!(
                    "{} bytes where a handle of {count} memory handles has {}",
                    bytes.len(),
                    MAPPED_HEADER_BYTES + count * MAPPED_ENTRY_BYTES
                )));
            }
            let handles = (0..count)
                .map(|_| {
                    Some(MappedHandle {
                        fd: r.i32()?,
                        size: r.u64()?,
                    })
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(too_short)?;
            Kind::Mapped {
                export,
                granule,
                handles,
            }
        } else {
            if bytes.len() != ENCODED_BYTES {
                return Err(bad(format!(
                    "{} bytes where a handle has {ENCODED_BYTES}",
                    bytes.len()
                )));
            }
            Kind::Segment(r.take().ok_or_else(too_short)?)
        };
        let h = Self {
            kind,
            offset,
            len,
            device,
            pid,
        };
        h.check()?;
        Ok(h)
    }

    /// The byte form in lowercase hex.
    pub fn to_hex(&self) -> String {
        self.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Reads the hex form ([`Error::InvalidIpcHandle`] for anything else).
    pub fn from_hex(text: &str) -> Result<Self, Error> {
        let text = text.trim();
        if text.len() % 2 != 0 || !text.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(Error::InvalidIpcHandle {
                reason: "not an even number of hex digits".into(),
            });
        }
        let bytes: Vec<u8> = (0..text.len())
            .step_by(2)
            .filter_map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
            .collect();
        Self::from_bytes(&bytes)
    }
}

impl FromStr for IpcHandle {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Self::from_hex(s)
    }
}

impl fmt::Display for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcHandle")
            .field("device", &self.device)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("pid", &self.pid)
            .field("granule", &self.granule())
            .field("mapped_handles", &self.mapped_handles())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;

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
mod tests {
    use super::*;

    fn mapped() -> IpcHandle {
        let g = 2u64 << 20;
        let handles = vec![
            MappedHandle { fd: 17, size: g },
            MappedHandle {
                fd: 18,
                size: 3 * g,
            },
        ];
        IpcHandle::new_mapped(42, g, handles, g - 4096, 8192 + g, 1).unwrap()
    }

    #[test]
    fn the_byte_and_hex_forms_give_back_the_same_handle() {
        let mut raw = [0u8; IPC_HANDLE_BYTES];
        raw.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let h = IpcHandle::new(raw, 3 << 20, 512, 3);
        assert_eq!(IpcHandle::from_bytes(&h.to_bytes()), Ok(h.clone()));
        assert_eq!(IpcHandle::from_hex(&h.to_hex()), Ok(h.clone()));
        assert_eq!(h.to_string().parse::<IpcHandle>(), Ok(h.clone()));
        assert_eq!(h.exporter_pid(), std::process::id());
        assert_eq!(
            h.to_bytes().len(),
            ENCODED_BYTES,
            "the segment form is unchanged"
        );
    }

    #[test]
    fn a_handle_of_an_expandable_range_round_trips_with_its_descriptors() {
        let h = mapped();
        assert_eq!(h.segment_handle(), None);
        assert_eq!(h.granule(), Some(2 << 20));
        assert_eq!(
            h.mapped_handles().iter().map(|m| m.fd).collect::<Vec<_>>(),
            [17, 18]
        );
        let bytes = h.to_bytes();
        assert_eq!(bytes.len(), MAPPED_HEADER_BYTES + 2 * MAPPED_ENTRY_BYTES);
        assert_eq!(IpcHandle::from_bytes(&bytes), Ok(h.clone()));
        assert_eq!(h.to_string().parse::<IpcHandle>(), Ok(h.clone()));
        assert_eq!(
            h.source(),
            Source::Mapped {
                pid: std::process::id(),
                export: 42
            }
        );
        assert_ne!(
            h.source(),
            IpcHandle::new([0; 64], 0, 1, 1).source(),
            "the two kinds never share an open"
        );
        assert!(format!("{h:?}").contains("mapped_handles"));
    }

    #[test]
    fn bytes_that_are_not_a_handle_are_a_typed_error() {
        let good = IpcHandle::new([1; IPC_HANDLE_BYTES], 0, 64, 0).to_bytes();
        let invalid = |b: &[u8]| {
            matches!(
                IpcHandle::from_bytes(b),
                Err(Error::InvalidIpcHandle { .. })
            )
        };
        assert!(invalid(&[]));
        assert!(invalid(&good[..good.len() - 1]));
        let mut tag = good.clone();
        tag[0] ^= 0xff;
        assert!(invalid(&tag));
        let mut kind = good.clone();
        kind[5] = 3;
        assert!(invalid(&kind));
        let mut empty = good.clone();
        empty[22..30].fill(0); // len
        assert!(invalid(&empty));
        let mut overflow = good.clone();
        overflow[14..22].fill(0xff); // offset
        assert!(invalid(&overflow));
        for text in ["", "zz", "abc", "ééé", &"00".repeat(ENCODED_BYTES)] {
            assert!(
                matches!(
                    IpcHandle::from_hex(text),
                    Err(Error::InvalidIpcHandle { .. })
                ),
                "{text:?}"
            );
        }
    }

    #[test]
    fn a_mapped_handle_that_does_not_fit_together_is_a_typed_error() {
        let good = mapped().to_bytes();
        let invalid = |b: &[u8]| {
            matches!(
                IpcHandle::from_bytes(b),
                Err(Error::InvalidIpcHandle { .. })
            )
        };
        // Offsets of the fields after the magic (6): device 6, pid 10, offset 14, len 22,
        // export 30, granule 38, count 46, entries from 50 (fd, then size).
        let with = |at: usize, value: &[u8]| {
            let mut b = good.clone();
            b[at..at + value.len()].copy_from_slice(value);
            b
        };
        // Every truncation, and a byte too many.
        for n in 0..good.len() {
            assert!(invalid(&good[..n]), "{n} bytes");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert!(invalid(&longer));
        // Counts that do not match the bytes, or past the bound.
        for count in [0u32, 1, 3, MAX_MAPPED_HANDLES as u32 + 1, u32::MAX] {
            assert!(invalid(&with(46, &count.to_le_bytes())), "count {count}");
        }
        // Granules that are not powers of two, too small or too large.
        for granule in [0u64, 3 << 20, 512, 1 << 41, u64::MAX] {
            assert!(invalid(&with(38, &granule.to_le_bytes())), "{granule}");
        }
        // A negative descriptor, a size of no or partial granules, sizes that overflow.
        assert!(invalid(&with(50, &(-1i32).to_le_bytes())));
        assert!(invalid(&with(54, &0u64.to_le_bytes())));
        assert!(invalid(&with(54, &((2u64 << 20) + 1).to_le_bytes())));
        let mut both = with(54, &(1u64 << 63).to_le_bytes());
        both[66..74].copy_from_slice(&(1u64 << 63).to_le_bytes());
        assert!(invalid(&both));
        // A block that starts past the first handle or ends past the last.
        assert!(invalid(&with(14, &(2u64 << 20).to_le_bytes())));
        assert!(invalid(&with(22, &(4u64 << 21).to_le_bytes())));
        assert!(invalid(&with(22, &0u64.to_le_bytes())));
        // A count that claims more entries than a slice can hold is refused before any
        // allocation.
        let mut huge = good[..MAPPED_HEADER_BYTES].to_vec();
        huge[46..50].copy_from_slice(&(MAX_MAPPED_HANDLES as u32).to_le_bytes());
        assert!(invalid(&huge));
        // The constructor checks the same.
        assert!(IpcHandle::new_mapped(1, 2 << 20, vec![], 0, 1, 0).is_err());
        let one = vec![MappedHandle {
            fd: 3,
            size: 2 << 20,
        }];
        assert!(IpcHandle::new_mapped(1, 2 << 20, one.clone(), 0, 2 << 20, 0).is_ok());
        assert!(IpcHandle::new_mapped(1, 2 << 20, one, 1, 2 << 20, 0).is_err());
    }

    #[test]
    fn arbitrary_bytes_after_either_tag_never_panic() {
        // A small deterministic generator: every length up to a few entries, many fillings.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        };
        for len in 0..(MAPPED_HEADER_BYTES + 4 * MAPPED_ENTRY_BYTES) {
            for magic in [MAGIC, MAGIC_MAPPED] {
                for _ in 0..16 {
                    let mut b: Vec<u8> = (0..len).map(|_| next()).collect();
                    let n = magic.len().min(len);
                    b[..n].copy_from_slice(&magic[..n]);
                    if let Ok(h) = IpcHandle::from_bytes(&b) {
                        assert_eq!(IpcHandle::from_bytes(&h.to_bytes()), Ok(h));
                    }
                }
            }
        }
    }
}

//! `IpcHandle`: a device block exported for another process, and its byte form.
//!
//! Owns the handle's layout only: the driver's opaque handle of the block's segment, the
//! block's offset inside that segment, its length, its device, and the exporting process's
//! id (for messages). [`IpcHandle::to_bytes`] / [`IpcHandle::from_bytes`] (and the hex forms,
//! for a command line) carry it across a process boundary; bytes that are not a handle are
//! [`Error::InvalidIpcHandle`], never a panic.

use std::fmt;
use std::str::FromStr;

use pinpool_actors::Error;

/// Bytes of the driver's handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// What the byte form starts with: a tag and its version.
const MAGIC: &[u8; 6] = b"PPIPC\x01";
/// Bytes of the byte form: magic, device (u32), pid (u32), offset (u64), len (u64), handle.
const ENCODED_BYTES: usize = MAGIC.len() + 4 + 4 + 8 + 8 + IPC_HANDLE_BYTES;

/// A device block exported for another process ([`DeviceAllocator::ipc_handle`]); open it
/// there with [`DeviceAllocator::open_ipc`].
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
/// assert!(matches!(
///     IpcHandle::from_bytes(b"not a handle"),
///     Err(pinpool::Error::InvalidIpcHandle { .. })
/// ));
/// # Ok::<(), pinpool::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle {
    handle: [u8; IPC_HANDLE_BYTES],
    offset: u64,
    len: u64,
    device: u32,
    pid: u32,
}

impl IpcHandle {
    /// A handle for `len` bytes at `offset` of the segment the driver's `handle` names, on
    /// `device`, exported by this process.
    pub fn new(handle: [u8; IPC_HANDLE_BYTES], offset: u64, len: u64, device: usize) -> Self {
        Self {
            handle,
            offset,
            len,
            device: device as u32,
            pid: std::process::id(),
        }
    }

    /// The driver's handle of the block's segment: equal for blocks of one segment.
    pub fn segment_handle(&self) -> &[u8; IPC_HANDLE_BYTES] {
        &self.handle
    }

    /// Where the block starts inside its segment.
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

    /// The id of the process that exported it.
    pub fn exporter_pid(&self) -> u32 {
        self.pid
    }

    /// The byte form (fixed length, little-endian numbers).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_BYTES);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.device.to_le_bytes());
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.handle);
        out
    }

    /// Reads the byte form ([`Error::InvalidIpcHandle`] for anything else).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        let bad = |reason: String| Error::InvalidIpcHandle { reason };
        if bytes.len() != ENCODED_BYTES {
            return Err(bad(format!(
                "{} bytes where a handle has {ENCODED_BYTES}",
                bytes.len()
            )));
        }
        let (magic, rest) = bytes.split_at(MAGIC.len());
        if magic != MAGIC {
            return Err(bad("it does not start with a pinpool handle's tag".into()));
        }
        let (device, rest) = rest.split_at(4);
        let (pid, rest) = rest.split_at(4);
        let (offset, rest) = rest.split_at(8);
        let (len, handle) = rest.split_at(8);
        // The lengths were checked above: each conversion takes a slice of its exact size.
        let u32_of = |b: &[u8]| u32::from_le_bytes(b.try_into().unwrap_or_default());
        let u64_of = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
        let h = Self {
            handle: handle.try_into().unwrap_or([0; IPC_HANDLE_BYTES]),
            offset: u64_of(offset),
            len: u64_of(len),
            device: u32_of(device),
            pid: u32_of(pid),
        };
        if h.len == 0 {
            return Err(bad("it describes an empty block".into()));
        }
        if h.offset.checked_add(h.len).is_none() {
            return Err(bad("its offset and length overflow".into()));
        }
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
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_and_hex_forms_give_back_the_same_handle() {
        let mut raw = [0u8; IPC_HANDLE_BYTES];
        raw.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let h = IpcHandle::new(raw, 3 << 20, 512, 3);
        assert_eq!(IpcHandle::from_bytes(&h.to_bytes()), Ok(h));
        assert_eq!(IpcHandle::from_hex(&h.to_hex()), Ok(h));
        assert_eq!(h.to_string().parse::<IpcHandle>(), Ok(h));
        assert_eq!(h.exporter_pid(), std::process::id());
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
}

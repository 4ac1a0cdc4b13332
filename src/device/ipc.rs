//! Inter-process device memory: [`DeviceAllocator::ipc_handle`] exports a block,
//! [`DeviceAllocator::open_ipc`] opens one another process exported, as [`IpcMemory`].
//!
//! Owns the registry of opened segments: one thread (the registry actor, started on the
//! first open) holds, for each segment handle, its address here and how many `IpcMemory`
//! values use it. The driver can open a handle only once per process, so two handles of
//! blocks in one segment share one `cuIpcOpenMemHandle`; the segment is closed
//! (`cuIpcCloseMemHandle`) when the last of them drops. Opens and closes reach the actor in
//! order through one channel, so a close and a later open of the same segment never race.
//!
//! What can be exported: blocks of whole segments (`cuMemAlloc`, the layout of
//! `expandable_segments:false`) by the driver's segment handle, and blocks of an expandable
//! range (the default layout, memory created with `cuMemCreate`) by the memory handles they
//! touch, each exported as a POSIX file descriptor (PyTorch's `ExpandableSegment::share`):
//! the handle carries this process's id and the descriptor numbers, and the importer
//! duplicates them with `pidfd_open` + `pidfd_getfd` (Linux 5.6 or later, and ptrace-like
//! access to the exporter, which the same user normally has), imports them, and maps them
//! into a fresh address range (closed, unmapped and given back with the last `IpcMemory` of
//! that export). The descriptors stay open in the exporting process for as long as the
//! exported buffer lives (a second export of the buffer gives the same handle); the memory
//! itself must stay the exporter's until the importer is done, as for segments. Where the
//! driver cannot create exportable memory (no file-descriptor handle type), a block of an
//! expandable range is [`Error::NotSupported`], whose reason names the setting to change.
//! The simulated runtime has no inter-process memory: every export and open there is
//! [`Error::NotSupported`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::actors::blocking;
use crate::actors::{Error, Origin, RuntimeError};

use super::allocator::DeviceAllocator;
use super::buffer::DeviceBuffer;
use super::ipc_handle::{IpcHandle, Source};
use super::runtime::DeviceRuntime;

/// The driver calls the registry makes (a runtime's `ipc_open` / `ipc_close`, or
/// `ipc_open_mapped` / `ipc_close_mapped` for a block of an expandable range).
pub(crate) trait IpcDriver: Send + Sync + 'static {
    /// Opens what `handle` names: its address here and its size.
    fn open(&self, handle: &IpcHandle) -> Result<(u64, usize), Error>;
    /// Closes what `open` opened for `handle` at `base`, once nothing uses it.
    fn close(&self, handle: &IpcHandle, base: u64) -> Result<(), Error>;
}

impl<R: DeviceRuntime> IpcDriver for R {
    fn open(&self, handle: &IpcHandle) -> Result<(u64, usize), Error> {
        match handle.segment_handle() {
            Some(segment) => self.ipc_open(handle.device(), segment),
            None => self.ipc_open_mapped(handle.device(), handle),
        }
    }

    fn close(&self, handle: &IpcHandle, base: u64) -> Result<(), Error> {
        // SAFETY: the registry closes what it opened, once, after its last user, with the
        // handle it opened it with.
        unsafe {
            match handle.segment_handle() {
                Some(_) => self.ipc_close(handle.device(), base),
                None => self.ipc_close_mapped(handle.device(), base, handle),
            }
        }
    }
}

/// What one open serves: a device and a segment, or a device and one export's memory
/// handles.
type Key = (usize, Source);

/// An open: its address here, its size, its users, and the handle it was opened with.
struct Opened {
    base: u64,
    size: usize,
    users: usize,
    handle: IpcHandle,
}

enum Msg {
    /// Open the segment (or count one more user); reply with its address here and size.
    Open {
        key: Key,
        handle: IpcHandle,
        reply: flume::Sender<Result<(u64, usize), Error>>,
    },
    /// One user fewer; close the segment when none is left.
    Close { key: Key },
}

/// The handle on the registry actor.
pub(crate) struct IpcRegistry {
    tx: flume::Sender<Msg>,
    open: Arc<AtomicUsize>,
}

impl IpcRegistry {
    /// Starts the registry's thread; it ends once the registry and every `IpcMemory` are
    /// gone (then nothing is open any more).
    pub(crate) fn start(driver: Arc<dyn IpcDriver>) -> Result<Self, Error> {
        let (tx, rx) = flume::unbounded();
        let open = Arc::new(AtomicUsize::new(0));
        let count = open.clone();
        std::thread::Builder::new()
            .name("pinpool-ipc".into())
            .spawn(move || run(driver, rx, count))
            .map_err(|e| {
                Error::Runtime(RuntimeError::new(
                    "open_ipc",
                    format!("the IPC registry thread did not start: {e}"),
                ))
            })?;
        Ok(Self { tx, open })
    }

    /// Segments open now.
    pub(crate) fn open_segments(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Opens `handle`'s block (blocks the thread for the driver call).
    pub(crate) fn open(&self, handle: &IpcHandle) -> Result<IpcMemory, Error> {
        let key = (handle.device(), handle.source());
        let (reply, answer) = flume::bounded(1);
        let gone = || {
            Error::Runtime(RuntimeError::new(
                "open_ipc",
                "the IPC registry has stopped",
            ))
        };
        let open = Msg::Open {
            key,
            handle: handle.clone(),
            reply,
        };
        self.tx.send(open).map_err(|_| gone())?;
        let (base, size) = answer.recv().map_err(|_| gone())??;
        // The block must lie inside the segment: the handle's offset and length are the
        // sender's word only.
        let inside = handle
            .offset()
            .checked_add(handle.len())
            .filter(|&end| end <= size as u64)
            .and_then(|_| base.checked_add(handle.offset()));
        let Some(ptr) = inside else {
            let _ = self.tx.send(Msg::Close { key });
            return Err(Error::InvalidIpcHandle {
                reason: format!(
                    "a block of {} bytes at offset {} does not lie inside its segment of {size} \
                     bytes",
                    handle.len(),
                    handle.offset()
                ),
            });
        };
        Ok(IpcMemory {
            ptr,
            len: handle.len() as usize,
            device: handle.device(),
            key,
            tx: self.tx.clone(),
        })
    }
}

/// The registry actor's loop.
fn run(driver: Arc<dyn IpcDriver>, rx: flume::Receiver<Msg>, count: Arc<AtomicUsize>) {
    let mut open: HashMap<Key, Opened> = HashMap::new();
    for msg in rx.iter() {
        match msg {
            Msg::Open { key, handle, reply } => {
                let base = match open.get_mut(&key) {
                    Some(o) => {
                        o.users += 1;
                        Ok((o.base, o.size))
                    }
                    None => driver.open(&handle).inspect(|&(base, size)| {
                        let users = 1;
                        open.insert(
                            key,
                            Opened {
                                base,
                                size,
                                users,
                                handle,
                            },
                        );
                        count.fetch_add(1, Ordering::SeqCst);
                    }),
                };
                let opened = base.is_ok();
                if reply.send(base).is_err() && opened {
                    // The caller is gone: no `IpcMemory` was made for this open.
                    release(&*driver, &mut open, key, &count);
                }
            }
            Msg::Close { key } => release(&*driver, &mut open, key, &count),
        }
    }
}

/// One user of `key` fewer: closes the segment with its last.
fn release(driver: &dyn IpcDriver, open: &mut HashMap<Key, Opened>, key: Key, count: &AtomicUsize) {
    let Some(o) = open.get_mut(&key) else {
        return;
    };
    o.users -= 1;
    if o.users > 0 {
        return;
    }
    let Some(o) = open.remove(&key) else {
        return;
    };
    count.fetch_sub(1, Ordering::SeqCst);
    if let Err(e) = driver.close(&o.handle, o.base) {
        tracing::warn!(device = key.0, base = o.base, error = %e, "closing IPC memory failed");
    }
}

/// Ids of exports of blocks of expandable ranges in this process: with the pid, what tells
/// an importer that two handles name the same file descriptors.
static NEXT_EXPORT: AtomicU64 = AtomicU64::new(1);

/// Device memory of another process, opened in this one ([`DeviceAllocator::open_ipc`]).
/// Dropping it closes the segment once no other `IpcMemory` of it is left. The exporting
/// process keeps the memory alive: it must hold its buffer until this process is done.
pub struct IpcMemory {
    ptr: u64,
    len: usize,
    device: usize,
    key: Key,
    tx: flume::Sender<Msg>,
}

impl IpcMemory {
    /// The block's device address in this process.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes of the block.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block has no bytes (never: empty buffers are not exported).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory is on (the ordinal the exporting process used).
    pub fn device(&self) -> usize {
        self.device
    }
}

impl Drop for IpcMemory {
    fn drop(&mut self) {
        // The registry lives while any sender does: this one keeps it.
        let _ = self.tx.send(Msg::Close { key: self.key });
    }
}

impl std::fmt::Debug for IpcMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMemory")
            .field("device", &self.device)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<R: DeviceRuntime> DeviceAllocator<R> {
    /// Exports `buf` for another process (PyTorch's `shareIpcHandle`): the driver's handle
    /// of its segment, its offset in the segment, its length and device; or, for a block of
    /// an expandable range (the default layout), the file descriptors of its memory
    /// handles in this process, kept open while `buf` lives (exporting it again gives the
    /// same handle). Keep `buf` alive (and order your own work on it) while the other
    /// process uses the memory; for a block of an expandable range, also until the other
    /// process has opened it.
    ///
    /// [`Error::NotSupported`] for an empty buffer, for a block of an expandable range
    /// where the driver cannot export memory as file descriptors (build the allocator with
    /// `expandable_segments:false`), and on a runtime without inter-process memory (the
    /// simulation).
    pub fn ipc_handle(&self, buf: &DeviceBuffer<R>) -> Result<IpcHandle, Error> {
        const OP: &str = "ipc_handle";
        self.engine(buf.device())?;
        match buf.origin() {
            None => Err(Error::NotSupported {
                operation: OP,
                reason: "an empty buffer holds no memory".into(),
            }),
            Some(Origin::DeviceMapped) => {
                if let Some(done) = buf.exported_handle() {
                    return Ok(done.clone());
                }
                let (ptr, len, device) = (buf.device_ptr(), buf.len(), buf.device());
                let export =
                    blocking::stall(|| self.runtime().ipc_export_mapped(device, ptr, len))?;
                let handle = IpcHandle::new_mapped(
                    NEXT_EXPORT.fetch_add(1, Ordering::Relaxed),
                    export.granule,
                    export.handles,
                    export.offset,
                    len as u64,
                    device,
                )?;
                Ok(buf.keep_export(handle, export.keep_open))
            }
            Some(_) => {
                let ptr = buf.device_ptr();
                let export = blocking::stall(|| self.runtime().ipc_export(buf.device(), ptr))?;
                Ok(IpcHandle::new(
                    export.handle,
                    ptr - export.base,
                    buf.len() as u64,
                    buf.device(),
                ))
            }
        }
    }

    /// Opens a block another process exported (PyTorch's `getIpcDevPtr`): blocks of one
    /// segment share one open of it, closed when the last [`IpcMemory`] drops. Blocks the
    /// calling thread for the driver call (no tokio runtime needed; on a multi-thread
    /// runtime's worker, inside `block_in_place`). [`Error::InvalidIpcHandle`] also for a
    /// handle whose block does not lie inside the segment it names.
    ///
    /// [`Error::NoSuchDevice`] for a device this process does not have,
    /// [`Error::InvalidIpcHandle`] for a handle the driver refuses (its process has exited,
    /// or it is this process's own segment) and, for a block of an expandable range, where
    /// the exporting process has exited, dropped the buffer, or denies access to its file
    /// descriptors; [`Error::NotSupported`] on the simulation, and on a kernel without
    /// `pidfd_getfd`. A failed open leaves nothing open.
    pub fn open_ipc(&self, handle: &IpcHandle) -> Result<IpcMemory, Error> {
        self.engine(handle.device())?;
        let registry = match self.inner().ipc.get() {
            Some(r) => r,
            None => {
                // Kept only once its thread runs; two first opens at once start two, and the
                // one not kept ends with its sender.
                let started = IpcRegistry::start(self.runtime().clone())?;
                let _ = self.inner().ipc.set(started);
                self.inner().ipc.get().ok_or(Error::Shutdown)?
            }
        };
        // Waits for the registry's thread and the driver, never for a tokio task.
        blocking::stall(|| registry.open(handle))
    }

    /// Segments of other processes open in this one now.
    pub fn ipc_open_segments(&self) -> usize {
        self.inner().ipc.get().map_or(0, IpcRegistry::open_segments)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// The size of every segment the counting driver opens.
    const SEGMENT: usize = 2 << 20;

    /// A driver that counts its calls and opens each segment at a made-up address.
    #[derive(Default)]
    struct Counting {
        opens: AtomicU64,
        closes: AtomicU64,
    }

    impl IpcDriver for Counting {
        fn open(&self, handle: &IpcHandle) -> Result<(u64, usize), Error> {
            let Some(handle) = handle.segment_handle() else {
                self.opens.fetch_add(1, Ordering::SeqCst);
                return Ok((0x9000_0000, 8 << 20));
            };
            if handle[0] == 0xff {
                return Err(Error::InvalidIpcHandle {
                    reason: "refused".into(),
                });
            }
            self.opens.fetch_add(1, Ordering::SeqCst);
            Ok((0x7000_0000 + ((handle[0] as u64) << 24), SEGMENT))
        }

        fn close(&self, _handle: &IpcHandle, _base: u64) -> Result<(), Error> {
            self.closes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    fn wait_until(cond: impl Fn() -> bool) {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !cond() && std::time::Instant::now() < end {
            std::thread::yield_now();
        }
        assert!(cond());
    }

    #[test]
    fn blocks_of_one_segment_share_one_open_closed_with_the_last_user() {
        let driver = Arc::new(Counting::default());
        let registry = IpcRegistry::start(driver.clone()).unwrap();
        let a = registry.open(&IpcHandle::new([1; 64], 0, 512, 0)).unwrap();
        let b = registry
            .open(&IpcHandle::new([1; 64], 4096, 1024, 0))
            .unwrap();
        let other = registry.open(&IpcHandle::new([2; 64], 0, 512, 0)).unwrap();
        assert_eq!(driver.opens.load(Ordering::SeqCst), 2);
        assert_eq!(registry.open_segments(), 2);
        assert_eq!(b.device_ptr(), a.device_ptr() + 4096);
        assert_eq!((b.len(), b.device()), (1024, 0));
        drop(a);
        drop(other);
        wait_until(|| driver.closes.load(Ordering::SeqCst) == 1);
        assert_eq!(
            registry.open_segments(),
            1,
            "b still uses the first segment"
        );
        drop(b);
        wait_until(|| driver.closes.load(Ordering::SeqCst) == 2);
        assert_eq!(registry.open_segments(), 0);
        // Opened again after its close: a fresh open.
        let again = registry.open(&IpcHandle::new([1; 64], 0, 512, 0)).unwrap();
        assert_eq!(driver.opens.load(Ordering::SeqCst), 3);
        drop(again);
    }

    #[test]
    fn handles_of_one_export_of_mapped_memory_share_one_open() {
        use crate::device::MappedHandle;
        let driver = Arc::new(Counting::default());
        let registry = IpcRegistry::start(driver.clone()).unwrap();
        let g = 2u64 << 20;
        let fds = vec![
            MappedHandle { fd: 5, size: g },
            MappedHandle { fd: 6, size: 3 * g },
        ];
        let h = IpcHandle::new_mapped(7, g, fds.clone(), 4096, g, 0).unwrap();
        let a = registry.open(&h).unwrap();
        let b = registry.open(&h.clone()).unwrap();
        assert_eq!(a.device_ptr(), 0x9000_0000 + 4096);
        assert_eq!(b.device_ptr(), a.device_ptr());
        let other = IpcHandle::new_mapped(8, g, fds, 0, g, 0).unwrap();
        let c = registry.open(&other).unwrap();
        assert_eq!(
            driver.opens.load(Ordering::SeqCst),
            2,
            "one open per export"
        );
        drop((a, b, c));
        wait_until(|| driver.closes.load(Ordering::SeqCst) == 2);
        assert_eq!(registry.open_segments(), 0);
    }

    #[test]
    fn the_same_segment_on_another_device_is_another_open() {
        let driver = Arc::new(Counting::default());
        let registry = IpcRegistry::start(driver.clone()).unwrap();
        let a = registry.open(&IpcHandle::new([1; 64], 0, 512, 0)).unwrap();
        let b = registry.open(&IpcHandle::new([1; 64], 0, 512, 1)).unwrap();
        assert_eq!(driver.opens.load(Ordering::SeqCst), 2);
        drop((a, b));
        wait_until(|| driver.closes.load(Ordering::SeqCst) == 2);
    }

    #[test]
    fn a_refused_open_is_a_typed_error_and_leaves_nothing_open() {
        let driver = Arc::new(Counting::default());
        let registry = IpcRegistry::start(driver.clone()).unwrap();
        let err = registry
            .open(&IpcHandle::new([0xff; 64], 0, 512, 0))
            .unwrap_err();
        assert!(matches!(err, Error::InvalidIpcHandle { .. }), "{err:?}");
        assert_eq!(registry.open_segments(), 0);
        assert_eq!(driver.closes.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_handle_whose_block_passes_its_segment_is_refused_and_closes_what_it_opened() {
        let driver = Arc::new(Counting::default());
        let registry = IpcRegistry::start(driver.clone()).unwrap();
        let seg = SEGMENT as u64;
        for (offset, len) in [(seg - 512, 1024), (seg, 1), (u64::MAX - 1, 1)] {
            let err = registry
                .open(&IpcHandle::new([3; 64], offset, len, 0))
                .unwrap_err();
            assert!(matches!(err, Error::InvalidIpcHandle { .. }), "{err:?}");
        }
        wait_until(|| registry.open_segments() == 0);
        assert_eq!(
            driver.opens.load(Ordering::SeqCst),
            driver.closes.load(Ordering::SeqCst)
        );
        let last = registry
            .open(&IpcHandle::new([3; 64], seg - 512, 512, 0))
            .unwrap();
        assert_eq!(
            last.len(),
            512,
            "a block that ends at the segment's end is fine"
        );
    }
}

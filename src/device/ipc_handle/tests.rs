//! Tests of `IpcHandle`: both byte forms round trip, and bytes that are not a handle are a
//! typed error, never a panic.

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

//! Unit tests of the carver: the rules its module header lists, one test each.

use super::*;

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

#[test]
fn carving_splits_a_segment_and_keeps_the_rest_free() {
    let mut c = Carver::new();
    let seg = c.add_segment(2 * MIB, ());
    let p = c.carve(100 * KIB).unwrap();
    assert_eq!(
        p,
        Piece {
            seg,
            offset: 0,
            len: 100 * KIB
        }
    );
    let q = c.carve(100 * KIB).unwrap();
    assert_eq!(q.offset, 100 * KIB);
    assert_eq!(c.free_bytes(), 2 * MIB - 200 * KIB);
    assert_eq!(c.lent_pieces(), 2);
}

#[test]
fn released_neighbours_coalesce_into_the_whole_segment() {
    let mut c = Carver::new();
    c.add_segment(MIB, ());
    let a = c.carve(300 * KIB).unwrap();
    let b = c.carve(300 * KIB).unwrap();
    let d = c.carve(300 * KIB).unwrap();
    assert_eq!(c.release(a), Ok(false));
    assert_eq!(c.release(d), Ok(false));
    assert_eq!(c.free_ranges(), 2);
    assert_eq!(c.release(b), Ok(true));
    assert_eq!(c.free_ranges(), 1);
    assert_eq!(c.largest_free(), MIB);
    // The coalesced range serves a request larger than any single piece was.
    assert_eq!(c.carve(MIB).unwrap().len, MIB);
}

#[test]
fn a_tight_placement_takes_only_a_range_the_piece_nearly_fills() {
    let mut c = Carver::new();
    let big = c.add_segment(8 * MIB, ());
    let held = c.carve(MIB).unwrap();
    let p = c.carve(2 * MIB).unwrap();
    let _tail = c.carve(5 * MIB).unwrap();
    // The 2 MiB piece comes back between lent neighbours: a range of exactly its size.
    assert_eq!(c.release(p), Ok(false));
    let again = c.place_tight(2 * MIB, 2 * MIB + MIB / 4).unwrap();
    assert_eq!((again.seg, again.offset), (big, MIB));
    // A range much larger than the request is left alone, open or wholly free.
    assert_eq!(c.release(again), Ok(false));
    assert_eq!(c.release(held), Ok(false));
    assert_eq!(c.place_tight(MIB, MIB + MIB / 8), None);
    let whole = c.add_segment(4 * MIB, ());
    assert_eq!(c.place_tight(MIB, MIB + MIB / 8), None);
    // A segment the piece nearly fills does.
    let exact = c.add_segment(MIB, ());
    let q = c.place_tight(MIB - 64 * KIB, MIB).unwrap();
    assert_eq!(q.seg, exact);
    assert_ne!(q.seg, whole);
}

#[test]
fn an_exact_range_is_cut_only_while_it_is_wholly_free() {
    let mut c = Carver::new();
    let seg = c.add_segment(8 * MIB, ());
    let p = c.take_exact(seg, 2 * MIB, MIB).unwrap();
    assert_eq!((p.seg, p.offset, p.len), (seg, 2 * MIB, MIB));
    // Head and tail stay free, in an open segment.
    let ranges: Vec<_> = c.free_ranges_by_segment().map(|(_, r)| r).collect();
    assert_eq!(ranges, vec![vec![(0, 2 * MIB), (3 * MIB, 5 * MIB)]]);
    assert_eq!(c.free_bytes(), 7 * MIB);
    // Overlapping a lent piece, past the segment, unknown or unaligned: refused.
    assert_eq!(c.take_exact(seg, 2 * MIB + 512, 512), None);
    assert_eq!(c.take_exact(seg, MIB, 2 * MIB), None);
    assert_eq!(c.take_exact(seg, 7 * MIB, 2 * MIB), None);
    assert_eq!(c.take_exact(SegId(99), 0, MIB), None);
    assert_eq!(c.take_exact(seg, 0, 100), None);
    // A range at the start of a free range; then both come back and coalesce whole.
    let q = c.take_exact(seg, 3 * MIB, MIB).unwrap();
    assert_eq!(q.offset, 3 * MIB);
    assert_eq!(c.release(p), Ok(false));
    assert_eq!(c.release(q), Ok(true));
    assert_eq!(c.free_ranges(), 1);
    assert_eq!(c.carve(8 * MIB).unwrap().len, 8 * MIB);
}

#[test]
fn a_ranked_placement_takes_the_lowest_ranked_end_of_any_free_range() {
    let mut c = Carver::new();
    let s = c.add_segment(16 * KIB, ());
    let a = c.carve(4 * KIB).unwrap();
    let b = c.carve(4 * KIB).unwrap();
    c.release(a).unwrap();
    // Free: [0, 4K) and [8K, 16K). Rank by offset, highest first: the end of the tail.
    let p = c
        .place_ranked(s, 2 * KIB, 0, |at, _| Some(usize::MAX - at))
        .unwrap();
    assert_eq!((p.offset, p.len), (14 * KIB, 2 * KIB));
    // Only places the rank accepts: none here, and nothing is cut.
    let free = c.free_bytes();
    assert!(c.place_ranked(s, 2 * KIB, 0, |_, _| None::<u8>).is_none());
    assert_eq!(c.free_bytes(), free);
    // Too large for every range.
    assert!(c.place_ranked(s, 8 * KIB, 0, |at, _| Some(at)).is_none());
    // The rest of a split range stays free and coalesces again.
    c.release(p).unwrap();
    c.release(b).unwrap();
    assert_eq!(c.free_bytes(), 16 * KIB);
    assert_eq!(c.free_ranges(), 1);
}

#[test]
fn a_piece_never_spans_two_segments() {
    let mut c = Carver::new();
    let s1 = c.add_segment(MIB, ());
    let s2 = c.add_segment(MIB, ());
    // Two adjacent-in-id free segments of 1 MiB each cannot serve 1.5 MiB.
    assert_eq!(c.carve(MIB + MIB / 2), None);
    let p = c.carve(MIB).unwrap();
    let q = c.carve(MIB).unwrap();
    assert_ne!(p.seg, q.seg);
    assert!([s1, s2].contains(&p.seg) && [s1, s2].contains(&q.seg));
    assert!(p.offset + p.len <= MIB && q.offset + q.len <= MIB);
    // Freed, they stay two ranges: coalescing never crosses segments.
    c.release(p).unwrap();
    c.release(q).unwrap();
    assert_eq!(c.free_ranges(), 2);
    assert_eq!(c.carve(MIB + 512), None);
}

#[test]
fn a_piece_is_never_smaller_than_the_request() {
    // PyTorch once handed a 150 MB block to a 200 MB request from a mixed bucket.
    let mut c = Carver::new();
    c.add_segment(150 * MIB, ());
    assert_eq!(c.carve(200 * MIB), None);
    c.add_segment(250 * MIB, ());
    let p = c.carve(200 * MIB).unwrap();
    assert!(p.len >= 200 * MIB);
    // Odd sizes round up to the alignment, never down.
    let q = c.carve(1000).unwrap();
    assert!(q.len >= 1000);
    assert_eq!(q.len % ALIGN, 0);
}

#[test]
fn best_fit_picks_the_smallest_range_that_holds_the_request() {
    let mut c = Carver::new();
    let big = c.add_segment(10 * MIB, ());
    let small = c.add_segment(MIB, ());
    let p = c.carve(MIB).unwrap();
    assert_eq!(p.seg, small);
    let q = c.carve(MIB).unwrap();
    assert_eq!(q.seg, big);
}

#[test]
fn waste_beyond_the_request_stays_below_the_bound() {
    let max_waste = ALIGN;
    let mut c = Carver::new();
    c.add_segment(64 * KIB + 512, ());
    c.add_segment(MIB, ());
    for want in [512, 1000, 4 * KIB, 63 * KIB, 64 * KIB, 100 * KIB] {
        let p = c.carve(want).unwrap();
        assert!(p.len >= want);
        assert!(p.len - want < max_waste, "{} for {}", p.len, want);
    }
}

#[test]
fn a_segment_that_lends_a_piece_is_cut_before_a_wholly_free_one() {
    let mut c = Carver::new();
    let open = c.add_segment(4 * MIB, ());
    let idle = c.add_segment(MIB, ());
    let first = c.carve(3 * MIB).unwrap();
    assert_eq!(first.seg, open);
    // The wholly free 1 MiB segment fits better, but the open one's 1 MiB rest is used.
    let p = c.carve(512 * KIB).unwrap();
    assert_eq!(p.seg, open);
    let q = c.carve(512 * KIB).unwrap();
    assert_eq!(q.seg, open);
    // The open segment is full now: the wholly free one serves the next request.
    assert_eq!(c.carve(512 * KIB).unwrap().seg, idle);
}

#[test]
fn a_wholly_free_segment_is_split_only_when_the_caller_allows_its_size() {
    let mut c = Carver::new();
    let big = c.add_segment(64 * MIB, ());
    let mut asked = None;
    assert_eq!(
        c.place(4 * MIB, |size| {
            asked = Some(size);
            false
        }),
        None
    );
    assert_eq!(asked, Some(64 * MIB), "asked about the smallest that fits");
    assert_eq!(c.free_bytes(), 64 * MIB, "a refusal changes nothing");
    let p = c.place(4 * MIB, |_| true).unwrap();
    assert_eq!((p.seg, p.len), (big, 4 * MIB));
    // Its rest is in an open segment now: no permission needed.
    assert!(c.place(4 * MIB, |_| false).is_some());
}

#[test]
fn wholly_free_segments_are_listed_least_recently_used_first() {
    let mut c = Carver::new();
    let a = c.add_segment(MIB, ());
    let b = c.add_segment(2 * MIB, ());
    let pb = c.carve(2 * MIB).unwrap();
    let pa = c.carve(MIB).unwrap();
    c.release(pa).unwrap();
    c.release(pb).unwrap();
    assert_eq!(c.free_segments_lru(), vec![(b, 2 * MIB), (a, MIB)]);
    let again = c.carve(2 * MIB).unwrap();
    c.release(again).unwrap();
    assert_eq!(c.free_segments_lru(), vec![(a, MIB), (b, 2 * MIB)]);
}

#[test]
fn releasing_a_range_twice_or_a_foreign_range_is_refused() {
    let mut c = Carver::new();
    let seg = c.add_segment(MIB, ());
    let p = c.carve(4 * KIB).unwrap();
    let _q = c.carve(4 * KIB).unwrap();
    assert_eq!(c.release(p), Ok(false));
    assert_eq!(c.release(p), Err(CarveError::NotLent));
    let outside = Piece {
        seg,
        offset: MIB,
        len: 512,
    };
    assert_eq!(c.release(outside), Err(CarveError::NotLent));
    let unknown = Piece {
        seg: SegId(99),
        offset: 0,
        len: 512,
    };
    assert_eq!(c.release(unknown), Err(CarveError::UnknownSegment));
    assert_eq!(c.lent_pieces(), 1);
}

#[test]
fn only_wholly_free_segments_are_removed() {
    let mut c = Carver::new();
    c.add_segment(MIB, 'a');
    c.add_segment(2 * MIB, 'b');
    let p = c.carve(2 * MIB).unwrap();
    let gone = c.remove_free_segments(|_| false);
    assert_eq!(gone, vec![('a', MIB)]);
    assert_eq!(c.reserved(), 2 * MIB);
    assert!(c.remove_segment(p.seg).is_none());
    c.release(p).unwrap();
    assert_eq!(c.remove_segment(p.seg), Some(('b', 2 * MIB)));
    assert_eq!((c.reserved(), c.free_bytes(), c.segments()), (0, 0, 0));
}

#[test]
fn free_and_lent_bytes_always_add_up_to_the_segments() {
    // A small deterministic random walk over carve and release.
    let mut c = Carver::new();
    c.add_segment(4 * MIB, ());
    c.add_segment(3 * MIB, ());
    let mut lent: Vec<Piece> = Vec::new();
    let mut released: Vec<Piece> = Vec::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..4000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x % 3 == 0 && !lent.is_empty() {
            let p = lent.swap_remove((x as usize / 3) % lent.len());
            c.release(p).unwrap();
            released.push(p);
        } else if x % 3 == 1 && !released.is_empty() {
            // A range released earlier, taken again exactly: only if no lent piece
            // overlaps it.
            let r = released.swap_remove((x as usize / 3) % released.len());
            let overlaps = lent.iter().any(|p| {
                p.seg == r.seg && p.offset < r.offset + r.len && r.offset < p.offset + p.len
            });
            match c.take_exact(r.seg, r.offset, r.len) {
                Some(p) => {
                    assert!(!overlaps, "{p:?} overlaps a lent piece");
                    assert_eq!(p, r);
                    lent.push(p);
                }
                None => assert!(overlaps, "{r:?} was free but not taken"),
            }
        } else {
            let want = 512 + (x as usize >> 8) % (300 * KIB);
            if let Some(p) = c.carve(want) {
                assert!(p.len >= want && p.len - want < ALIGN);
                lent.push(p);
            }
        }
        let lent_bytes: usize = lent.iter().map(|p| p.len).sum();
        assert_eq!(lent_bytes + c.free_bytes(), c.reserved());
    }
    for p in lent.drain(..) {
        c.release(p).unwrap();
    }
    assert_eq!(c.free_ranges(), 2);
}

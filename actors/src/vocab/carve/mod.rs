//! Carving: which byte ranges of a pool's segments (host allocations) are free, and how a
//! request is cut out of them. A pure data structure, no memory and no actors: offsets only.
//!
//! Owns, per segment, its free ranges, and across segments two indexes for best fit: the free
//! ranges of segments that lend at least one piece ("open" segments), and the segments that
//! are wholly free. A request is cut from the best-fitting range of an open segment first,
//! and only then from the smallest wholly free segment that holds it, if the caller allows
//! that segment to be split (a small block cut out of a large free segment can pin it long
//! after the large requests it was made for come back). It keeps these rules, which the pool
//! relies on:
//! - a piece lies inside one segment, never across two (a copy from pinned memory must lie
//!   in one pinned range);
//! - a piece is never smaller than the request (sizes are rounded up to [`ALIGN`] first);
//! - a piece is the request rounded up to [`ALIGN`], no larger: a larger free range is split
//!   and its remainder stays free, so the waste per piece is below [`ALIGN`];
//! - freed neighbours within a segment coalesce into one free range, so a segment whose
//!   pieces have all come back is one free range again and can be given back whole;
//! - a range is either free or lent, never both: a double release is refused.

use std::collections::{BTreeMap, BTreeSet};

pub(crate) mod fits;

/// Offsets and sizes of pieces are multiples of this (bytes).
pub(crate) const ALIGN: usize = 512;

/// Identity of a segment within one carver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct SegId(pub(crate) u64);

/// A range cut out of a segment and lent out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) seg: SegId,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

/// Why a release was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CarveError {
    /// No such segment.
    UnknownSegment,
    /// The range is not inside its segment, or overlaps a free range.
    NotLent,
}

struct Segment<T> {
    size: usize,
    /// Free ranges: offset -> length. Never two adjacent ones (they coalesce).
    free: BTreeMap<usize, usize>,
    /// Pieces lent out.
    lent: usize,
    /// When a piece was last cut out of it (the carver's clock).
    last_used: u64,
    payload: T,
}

/// The free ranges of a set of segments, each carrying a payload `T` (the pinned memory).
pub(crate) struct Carver<T> {
    segments: BTreeMap<SegId, Segment<T>>,
    /// Free ranges of segments that lend a piece, as (length, segment, offset): best fit is
    /// the first at or above a size.
    open: BTreeSet<(usize, SegId, usize)>,
    /// Wholly free segments (one free range each, at offset 0), as (size, segment).
    idle: BTreeSet<(usize, SegId)>,
    /// Counts the pieces cut, to tell which segment was used least recently.
    clock: u64,
    next: u64,
    free_bytes: usize,
    reserved: usize,
    lent_pieces: usize,
}

/// Rounds `size` up to [`ALIGN`] (`None` on overflow).
pub(crate) fn align_up(size: usize) -> Option<usize> {
    size.checked_add(ALIGN - 1).map(|s| s & !(ALIGN - 1))
}

impl<T> Default for Carver<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Carver<T> {
    /// An empty carver.
    pub(crate) fn new() -> Self {
        Self {
            segments: BTreeMap::new(),
            open: BTreeSet::new(),
            idle: BTreeSet::new(),
            clock: 0,
            next: 0,
            free_bytes: 0,
            reserved: 0,
            lent_pieces: 0,
        }
    }

    /// Adds a wholly free segment of `size` bytes (rounded down to [`ALIGN`]).
    #[cfg(test)]
    pub(crate) fn add_segment(&mut self, size: usize, payload: T) -> SegId {
        self.add_segment_with(size, |_| payload)
    }

    /// Adds a wholly free segment of `size` bytes (rounded down to [`ALIGN`]) whose payload
    /// is made from its id.
    pub(crate) fn add_segment_with(
        &mut self,
        size: usize,
        payload: impl FnOnce(SegId) -> T,
    ) -> SegId {
        let size = size & !(ALIGN - 1);
        let id = SegId(self.next);
        let payload = payload(id);
        self.next += 1;
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
            self.idle.insert((size, id));
        }
        self.segments.insert(
            id,
            Segment {
                size,
                free,
                lent: 0,
                last_used: self.clock,
                payload,
            },
        );
        self.free_bytes += size;
        self.reserved += size;
        id
    }

    /// Cuts a piece of at least `size` bytes out of the smallest free range that holds it,
    /// or `None` when no free range does.
    #[cfg(test)]
    pub(crate) fn carve(&mut self, size: usize) -> Option<Piece> {
        self.place(size, |_| true)
    }

    /// Cuts a piece of at least `size` bytes: out of the smallest free range of an open
    /// segment that holds it, else out of the smallest wholly free segment that holds it if
    /// `split_ok(segment size)` allows; `None` otherwise.
    pub(crate) fn place(
        &mut self,
        size: usize,
        split_ok: impl FnOnce(usize) -> bool,
    ) -> Option<Piece> {
        let want = align_up(size.max(1))?;
        if let Some(&(len, seg, offset)) = self.open.range((want, SegId(0), 0)..).next() {
            self.open.remove(&(len, seg, offset));
            return self.cut(seg, offset, len, want);
        }
        let &(len, seg) = self.idle.range((want, SegId(0))..).next()?;
        if !split_ok(len) {
            return None;
        }
        self.idle.remove(&(len, seg));
        self.cut(seg, 0, len, want)
    }

    /// Cuts a piece of at least `size` bytes out of the smallest free range, of any segment,
    /// that is no longer than `max_len`; `None` when there is none.
    pub(crate) fn place_tight(&mut self, size: usize, max_len: usize) -> Option<Piece> {
        let want = align_up(size.max(1))?;
        let open = self
            .open
            .range((want, SegId(0), 0)..)
            .next()
            .copied()
            .filter(|&(len, _, _)| len <= max_len);
        let idle = self
            .idle
            .range((want, SegId(0))..)
            .next()
            .copied()
            .filter(|&(len, _)| len <= max_len);
        match (open, idle) {
            (Some((len, seg, offset)), idle) if idle.map_or(true, |(l, _)| len <= l) => {
                self.open.remove(&(len, seg, offset));
                self.cut(seg, offset, len, want)
            }
            (_, Some((len, seg))) => {
                self.idle.remove(&(len, seg));
                self.cut(seg, 0, len, want)
            }
            _ => None,
        }
    }

    /// Cuts a piece of at least `size` bytes out of a free range of `seg`, at the start or
    /// at the end of the range, or (with a `boundary` above [`ALIGN`]) starting or ending at
    /// the first or last multiple of `boundary` inside it: of all such places, the one that
    /// `rank(offset, range length)` ranks lowest; places it ranks `None` are not taken.
    /// `None` when no place is ranked. Looks at every free range of the segment.
    pub(crate) fn place_ranked<K: Ord>(
        &mut self,
        seg: SegId,
        size: usize,
        boundary: usize,
        mut rank: impl FnMut(usize, usize) -> Option<K>,
    ) -> Option<Piece> {
        let want = align_up(size.max(1))?;
        let s = self.segments.get(&seg)?;
        let mut best: Option<(K, usize)> = None;
        for (&o, &l) in s.free.range(..) {
            if l < want {
                continue;
            }
            let end = o + l;
            let mut places = [o, end - want, o, o];
            let mut n = if l == want { 1 } else { 2 };
            if boundary > ALIGN && l > want {
                let first = o.next_multiple_of(boundary);
                if first + want <= end && first != o {
                    places[n] = first;
                    n += 1;
                }
                let last_end = end / boundary * boundary;
                if last_end >= o + want && last_end != end {
                    places[n] = last_end - want;
                    n += 1;
                }
            }
            for &at in &places[..n] {
                if let Some(k) = rank(at, l) {
                    if best.as_ref().map_or(true, |(b, _)| k < *b) {
                        best = Some((k, at));
                    }
                }
            }
        }
        let (_, at) = best?;
        self.take_exact(seg, at, want)
    }

    /// Cuts exactly the range (`offset`, `len`) of `seg` out of the free range that holds
    /// it, if one does (the rest of that range stays free); `None` otherwise.
    pub(crate) fn take_exact(&mut self, seg: SegId, offset: usize, len: usize) -> Option<Piece> {
        let s = self.segments.get_mut(&seg)?;
        let (&o, &l) = s.free.range(..=offset).next_back()?;
        if len == 0 || len % ALIGN != 0 || o + l < offset.checked_add(len)? {
            return None;
        }
        if s.lent == 0 {
            self.idle.remove(&(l, seg));
        } else {
            self.open.remove(&(l, seg, o));
        }
        if offset > o {
            // The head stays free, in a segment that is open once the piece is cut; the
            // piece is cut from the start of the rest.
            s.free.insert(o, offset - o);
            s.free.insert(offset, o + l - offset);
            self.open.insert((offset - o, seg, o));
        }
        self.cut(seg, offset, o + l - offset, len)
    }

    /// Lends `want` bytes at the start of the free range (`offset`, `len`) of `seg`, already
    /// taken out of the indexes; the rest stays free.
    fn cut(&mut self, seg: SegId, offset: usize, len: usize, want: usize) -> Option<Piece> {
        let s = self.segments.get_mut(&seg)?;
        s.free.remove(&offset);
        let rest = len - want;
        if rest > 0 {
            s.free.insert(offset + want, rest);
            self.open.insert((rest, seg, offset + want));
        }
        s.lent += 1;
        self.clock += 1;
        s.last_used = self.clock;
        self.free_bytes -= want;
        self.lent_pieces += 1;
        Some(Piece {
            seg,
            offset,
            len: want,
        })
    }

    /// A lent piece of `seg` was split in two by whoever held it: one more piece is lent (the
    /// two come back one by one). `false` for an unknown segment or one that lends nothing.
    pub(crate) fn split_lent(&mut self, seg: SegId) -> bool {
        match self.segments.get_mut(&seg) {
            Some(s) if s.lent > 0 => {
                s.lent += 1;
                self.lent_pieces += 1;
                true
            }
            _ => false,
        }
    }

    /// Takes back a lent piece and merges it with free neighbours. Returns whether its
    /// segment is now wholly free.
    pub(crate) fn release(&mut self, piece: Piece) -> Result<bool, CarveError> {
        let s = self
            .segments
            .get_mut(&piece.seg)
            .ok_or(CarveError::UnknownSegment)?;
        let end = piece
            .offset
            .checked_add(piece.len)
            .ok_or(CarveError::NotLent)?;
        if piece.len == 0 || end > s.size || s.lent == 0 {
            return Err(CarveError::NotLent);
        }
        let before = s
            .free
            .range(..=piece.offset)
            .next_back()
            .map(|(&o, &l)| (o, l));
        let after = s.free.range(piece.offset..).next().map(|(&o, &l)| (o, l));
        if before.is_some_and(|(o, l)| o + l > piece.offset) || after.is_some_and(|(o, _)| o < end)
        {
            return Err(CarveError::NotLent);
        }
        let (mut start, mut len) = (piece.offset, piece.len);
        if let Some((o, l)) = before.filter(|(o, l)| o + l == piece.offset) {
            s.free.remove(&o);
            self.open.remove(&(l, piece.seg, o));
            start = o;
            len += l;
        }
        if let Some((o, l)) = after.filter(|(o, _)| *o == end) {
            s.free.remove(&o);
            self.open.remove(&(l, piece.seg, o));
            len += l;
        }
        s.free.insert(start, len);
        s.lent -= 1;
        if s.lent == 0 {
            // Wholly free: its one range is the whole segment.
            self.idle.insert((len, piece.seg));
        } else {
            self.open.insert((len, piece.seg, start));
        }
        self.free_bytes += piece.len;
        self.lent_pieces -= 1;
        Ok(s.lent == 0)
    }

    /// Removes every wholly free segment that `keep` does not want kept, returning payloads
    /// and sizes.
    pub(crate) fn remove_free_segments(
        &mut self,
        mut keep: impl FnMut(usize) -> bool,
    ) -> Vec<(T, usize)> {
        let ids: Vec<SegId> = self
            .segments
            .iter()
            .filter(|(_, s)| s.lent == 0 && !keep(s.size))
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| self.remove_segment(id))
            .collect()
    }

    /// The wholly free segments with their sizes, least recently used first.
    pub(crate) fn free_segments_lru(&self) -> Vec<(SegId, usize)> {
        let mut v: Vec<(u64, SegId, usize)> = self
            .idle
            .iter()
            .filter_map(|&(size, id)| Some((self.segments.get(&id)?.last_used, id, size)))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, id, size)| (id, size)).collect()
    }

    /// Removes one wholly free segment (`None` if it has pieces lent or does not exist).
    pub(crate) fn remove_segment(&mut self, id: SegId) -> Option<(T, usize)> {
        if self.segments.get(&id)?.lent != 0 {
            return None;
        }
        let s = self.segments.remove(&id)?;
        self.idle.remove(&(s.size, id));
        self.free_bytes -= s.size;
        self.reserved -= s.size;
        Some((s.payload, s.size))
    }

    /// The free ranges of `seg` that overlap or touch `[lo, hi)`, as (offset, length), in
    /// offset order, into `out` (cleared first).
    pub(crate) fn free_touching(
        &self,
        seg: SegId,
        lo: usize,
        hi: usize,
        out: &mut Vec<(usize, usize)>,
    ) {
        out.clear();
        let Some(s) = self.segments.get(&seg) else {
            return;
        };
        let start = s.free.range(..=lo).next_back().map_or(lo, |(&o, _)| o);
        out.extend(
            s.free
                .range(start..=hi)
                .filter(|&(&o, &l)| o + l >= lo)
                .map(|(&o, &l)| (o, l)),
        );
    }

    /// Every segment's payload with its free ranges (offset, length) in offset order.
    pub(crate) fn free_ranges_by_segment(&self) -> impl Iterator<Item = (&T, Vec<(usize, usize)>)> {
        self.segments
            .values()
            .map(|s| (&s.payload, s.free.iter().map(|(&o, &l)| (o, l)).collect()))
    }

    /// Every segment with its payload.
    pub(crate) fn segments_with(&self) -> impl Iterator<Item = (SegId, &T)> {
        self.segments.iter().map(|(&id, s)| (id, &s.payload))
    }

    /// The payload of a segment.
    pub(crate) fn payload(&self, id: SegId) -> Option<&T> {
        self.segments.get(&id).map(|s| &s.payload)
    }

    /// Bytes in free ranges.
    pub(crate) fn free_bytes(&self) -> usize {
        self.free_bytes
    }

    /// Number of free ranges.
    pub(crate) fn free_ranges(&self) -> usize {
        self.open.len() + self.idle.len()
    }

    /// Bytes of all segments.
    #[cfg(test)]
    pub(crate) fn reserved(&self) -> usize {
        self.reserved
    }

    /// Pieces lent out.
    pub(crate) fn lent_pieces(&self) -> usize {
        self.lent_pieces
    }

    /// Number of segments.
    #[cfg(test)]
    pub(crate) fn segments(&self) -> usize {
        self.segments.len()
    }

    /// The largest free range (0 when none).
    #[cfg(test)]
    pub(crate) fn largest_free(&self) -> usize {
        let open = self.open.iter().next_back().map_or(0, |r| r.0);
        let idle = self.idle.iter().next_back().map_or(0, |r| r.0);
        open.max(idle)
    }
}

#[cfg(test)]
mod tests;

//! MiniMalloc's CSV format: a header `id,lower,upper,size`, then one buffer a row, live over
//! `[lower, upper)`. Ids must be dense in `0..rows`, in any order.
//!
//! The rows become events ordered by time (frees before allocations at equal times, then by
//! id), so that the [`Trace`] built from them has the file's overlaps and no others.

use std::io::{BufReader, Read};

use super::build::{Builder, IdRule};
use super::text::{id_field, number, Lines};
use super::{Trace, TraceError, TraceErrorKind, TraceEvent};

const HEADER: [&str; 4] = ["id", "lower", "upper", "size"];

struct Row {
    line: usize,
    id: usize,
    lower: u64,
    upper: u64,
    size: u64,
}

/// Reads a MiniMalloc CSV from `reader`; `origin` names it in errors.
pub(crate) fn read(reader: impl Read, origin: &str) -> Result<Trace, TraceError> {
    let mut lines = Lines::new(BufReader::new(reader), origin);
    let mut header_seen = false;
    let mut rows = Vec::new();
    while let Some((number, line)) = lines.next_line()? {
        let fail = |kind| TraceError::invalid(origin, number, kind);
        let line = line.trim();
        if !header_seen {
            if !line.split(',').map(str::trim).eq(HEADER) {
                return Err(fail(TraceErrorKind::BadHeader {
                    found: line.to_owned(),
                }));
            }
            header_seen = true;
            continue;
        }
        if line.is_empty() {
            continue;
        }
        rows.push(parse_row(line, number).map_err(fail)?);
    }
    if !header_seen {
        let kind = TraceErrorKind::BadHeader {
            found: String::new(),
        };
        return Err(TraceError::invalid(origin, lines.number, kind));
    }
    build(rows, origin)
}

fn parse_row(line: &str, line_no: usize) -> Result<Row, TraceErrorKind> {
    let mut fields = line.split(',').map(str::trim);
    let row = Row {
        line: line_no,
        id: id_field(fields.next(), "id")?,
        lower: number(fields.next(), "lower")?,
        upper: number(fields.next(), "upper")?,
        size: number(fields.next(), "size")?,
    };
    if let Some(extra) = fields.next() {
        return Err(TraceErrorKind::ExtraField {
            text: extra.to_owned(),
        });
    }
    if row.upper <= row.lower {
        return Err(TraceErrorKind::EmptyLifetime {
            lower: row.lower,
            upper: row.upper,
        });
    }
    Ok(row)
}

fn build(rows: Vec<Row>, origin: &str) -> Result<Trace, TraceError> {
    let count = rows.len();
    // Check ids in file order, so the error names the first offending line.
    let mut seen = vec![false; count];
    for row in &rows {
        let fail = |kind| TraceError::invalid(origin, row.line, kind);
        match seen.get_mut(row.id) {
            None => return Err(fail(TraceErrorKind::IdOutOfRange { id: row.id, count })),
            Some(true) => return Err(fail(TraceErrorKind::DuplicateId { id: row.id })),
            Some(slot) => *slot = true,
        }
    }
    // (time, 0 = free / 1 = alloc, row index)
    let mut order: Vec<(u64, u8, usize)> = Vec::with_capacity(2 * count);
    for (index, row) in rows.iter().enumerate() {
        order.push((row.lower, 1, index));
        order.push((row.upper, 0, index));
    }
    order.sort_unstable_by_key(|&(time, kind, index)| (time, kind, rows[index].id));
    let mut builder = Builder::new(IdRule::DenseBelow(count));
    for (_, kind, index) in order {
        let row = &rows[index];
        let event = if kind == 1 {
            TraceEvent::Alloc {
                id: row.id,
                bytes: row.size,
                stream: 0,
            }
        } else {
            TraceEvent::Free { id: row.id }
        };
        builder
            .push(event)
            .map_err(|kind| TraceError::invalid(origin, row.line, kind))?;
    }
    Ok(builder.finish())
}

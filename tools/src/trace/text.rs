//! The text trace format, gzip-compressed or plain:
//!
//! ```text
//! # comment
//! a <id> <bytes> <stream>    allocation number <id> (dense, in order) of <bytes> on <stream>
//! f <id>                     allocation <id> is freed
//! ```
//!
//! Blank lines are ignored. Compression is detected from the gzip magic bytes.

use std::io::{BufRead, BufReader, Read};

use flate2::read::MultiGzDecoder;

use super::build::{Builder, IdRule};
use super::{Trace, TraceError, TraceErrorKind, TraceEvent};

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The longest line the readers take, without its newline. Real lines are a few dozen
/// bytes; the limit keeps a line without end (say, a small gzip stream that inflates to
/// one endless line) from taking memory without bound.
pub(crate) const MAX_LINE: usize = 4096;

/// The lines of a trace file, numbered from 1: each at most [`MAX_LINE`] bytes before its
/// newline, and UTF-8, or an error naming its line.
pub(super) struct Lines<'a, R> {
    reader: R,
    buf: Vec<u8>,
    /// The number of the line last read (at the end, one past the last line).
    pub(super) number: usize,
    origin: &'a str,
}

impl<'a, R: BufRead> Lines<'a, R> {
    pub(super) fn new(reader: R, origin: &'a str) -> Self {
        Self {
            reader,
            buf: Vec::new(),
            number: 0,
            origin,
        }
    }

    /// The next line, with its newline if any, and its number; `None` at the end of the
    /// file.
    pub(super) fn next_line(&mut self) -> Result<Option<(usize, &str)>, TraceError> {
        self.buf.clear();
        self.number += 1;
        let (origin, line) = (self.origin, self.number);
        let read = (&mut self.reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut self.buf)
            .map_err(|source| TraceError::Read {
                origin: origin.to_owned(),
                line,
                source,
            })?;
        if self.buf.len() > MAX_LINE && self.buf.last() != Some(&b'\n') {
            let kind = TraceErrorKind::LineTooLong { limit: MAX_LINE };
            return Err(TraceError::invalid(origin, line, kind));
        }
        if read == 0 {
            return Ok(None);
        }
        std::str::from_utf8(&self.buf)
            .map(|text| Some((line, text)))
            .map_err(|_| TraceError::invalid(origin, line, TraceErrorKind::NotUtf8))
    }
}

/// Reads a text trace from `reader` (gzip or plain); `origin` names it in errors.
pub(crate) fn read(reader: impl Read, origin: &str) -> Result<Trace, TraceError> {
    let mut reader = BufReader::new(reader);
    let head = reader.fill_buf().map_err(|source| TraceError::Read {
        origin: origin.to_owned(),
        line: 1,
        source,
    })?;
    if head.starts_with(&GZIP_MAGIC) {
        read_lines(BufReader::new(MultiGzDecoder::new(reader)), origin)
    } else {
        read_lines(reader, origin)
    }
}

fn read_lines(reader: impl BufRead, origin: &str) -> Result<Trace, TraceError> {
    let mut builder = Builder::new(IdRule::InOrder);
    let mut lines = Lines::new(reader, origin);
    while let Some((number, line)) = lines.next_line()? {
        let fail = |kind| TraceError::invalid(origin, number, kind);
        if let Some(event) = parse_line(line).map_err(fail)? {
            builder.push(event).map_err(fail)?;
        }
    }
    Ok(builder.finish())
}

/// Parses one line; `None` for blank lines and comments.
fn parse_line(line: &str) -> Result<Option<TraceEvent>, TraceErrorKind> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let mut fields = line.split_ascii_whitespace();
    let tag = fields.next().unwrap_or_default();
    let event = match tag {
        "a" => TraceEvent::Alloc {
            id: id_field(fields.next(), "id")?,
            bytes: number(fields.next(), "bytes")?,
            stream: number(fields.next(), "stream")?,
        },
        "f" => TraceEvent::Free {
            id: id_field(fields.next(), "id")?,
        },
        other => {
            return Err(TraceErrorKind::UnknownTag {
                tag: other.to_owned(),
            })
        }
    };
    match fields.next() {
        Some(extra) => Err(TraceErrorKind::ExtraField {
            text: extra.to_owned(),
        }),
        None => Ok(Some(event)),
    }
}

pub(super) fn number(text: Option<&str>, field: &'static str) -> Result<u64, TraceErrorKind> {
    let text = text.ok_or(TraceErrorKind::MissingField { field })?;
    // `u64::from_str` accepts a leading `+`; the formats do not.
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad_number(text, field));
    }
    text.parse().map_err(|_| bad_number(text, field))
}

pub(super) fn id_field(text: Option<&str>, field: &'static str) -> Result<usize, TraceErrorKind> {
    let value = number(text, field)?;
    usize::try_from(value).map_err(|_| bad_number(text.unwrap_or_default(), field))
}

fn bad_number(text: &str, field: &'static str) -> TraceErrorKind {
    TraceErrorKind::BadNumber {
        field,
        text: text.to_owned(),
    }
}

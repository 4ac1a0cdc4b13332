//! A small writer of Python pickles: the values a memory snapshot is made of (None, bools,
//! integers of any size up to 128 bits, floats, strings, lists, tuples and dicts in insertion
//! order), written with protocol 2.
//!
//! Owns the byte encoding only. It emits just the opcodes that Python's `pickle` and the
//! unpickler of PyTorch's memory visualizer (`MemoryViz.js`) both read: `PROTO 2`, `NONE`,
//! `NEWTRUE`/`NEWFALSE`, `BININT1`/`BININT2`/`BININT`/`LONG1`, `BINFLOAT`, `BINUNICODE`,
//! `EMPTY_LIST`/`EMPTY_DICT`/`EMPTY_TUPLE` with `MARK` and `APPENDS`/`SETITEMS`/`TUPLE`,
//! `TUPLE1..3`, `STOP`. No memo: every value is written in full. Lists and dicts are written
//! in batches of 1000 items, as Python does, so that a reader spreading a batch onto a stack
//! never gets a huge one.

/// A value to pickle.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i128),
    /// No snapshot field is a float yet (PyTorch's `garbage_collection_threshold` is one).
    #[allow(dead_code)]
    Float(f64),
    Str(String),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    /// Key-value pairs, written in this order.
    Dict(Vec<(Value, Value)>),
}

impl Value {
    /// A dict with string keys.
    pub(crate) fn dict<const N: usize>(items: [(&str, Value); N]) -> Value {
        Value::Dict(
            items
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect(),
        )
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_owned())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s)
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

macro_rules! int_from {
    ($($t:ty),*) => {$(
        impl From<$t> for Value {
            fn from(i: $t) -> Self {
                Value::Int(i as i128)
            }
        }
    )*};
}
int_from!(i32, i64, u32, u64, usize);

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const EMPTY_LIST: u8 = b']';
const EMPTY_DICT: u8 = b'}';
const EMPTY_TUPLE: u8 = b')';
const MARK: u8 = b'(';
const APPENDS: u8 = b'e';
const SETITEMS: u8 = b'u';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;

/// Items per `APPENDS` or `SETITEMS` batch.
const BATCH: usize = 1000;

/// `value` as a complete pickle (protocol 2).
pub(crate) fn to_bytes(value: &Value) -> Vec<u8> {
    let mut out = vec![PROTO, 2];
    write(&mut out, value);
    out.push(STOP);
    out
}

fn write(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::None => out.push(NONE),
        Value::Bool(true) => out.push(NEWTRUE),
        Value::Bool(false) => out.push(NEWFALSE),
        Value::Int(i) => write_int(out, *i),
        Value::Float(f) => {
            out.push(BINFLOAT);
            out.extend_from_slice(&f.to_be_bytes());
        }
        Value::Str(s) => {
            out.push(BINUNICODE);
            // A snapshot's strings are far below 4 GiB; a longer one is cut at a char boundary.
            let mut end = s.len().min(u32::MAX as usize);
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            out.extend_from_slice(&(end as u32).to_le_bytes());
            out.extend_from_slice(&s.as_bytes()[..end]);
        }
        Value::List(items) => {
            out.push(EMPTY_LIST);
            for batch in items.chunks(BATCH) {
                out.push(MARK);
                batch.iter().for_each(|v| write(out, v));
                out.push(APPENDS);
            }
        }
        Value::Dict(items) => {
            out.push(EMPTY_DICT);
            for batch in items.chunks(BATCH) {
                out.push(MARK);
                for (k, v) in batch {
                    write(out, k);
                    write(out, v);
                }
                out.push(SETITEMS);
            }
        }
        Value::Tuple(items) => match items.len() {
            0 => out.push(EMPTY_TUPLE),
            n @ 1..=3 => {
                items.iter().for_each(|v| write(out, v));
                out.push([TUPLE1, TUPLE2, TUPLE3][n - 1]);
            }
            _ => {
                out.push(MARK);
                items.iter().for_each(|v| write(out, v));
                out.push(TUPLE);
            }
        },
    }
}

fn write_int(out: &mut Vec<u8>, i: i128) {
    if (0..=0xff).contains(&i) {
        out.extend_from_slice(&[BININT1, i as u8]);
    } else if (0..=0xffff).contains(&i) {
        out.push(BININT2);
        out.extend_from_slice(&(i as u16).to_le_bytes());
    } else if i32::try_from(i).is_ok() {
        out.push(BININT);
        out.extend_from_slice(&(i as i32).to_le_bytes());
    } else {
        // Two's complement, little-endian, in the fewest bytes that keep the sign.
        let bytes = i.to_le_bytes();
        let mut n = bytes.len();
        while n > 1 {
            let top = bytes[n - 1];
            let sign_of_next = bytes[n - 2] & 0x80;
            if (top == 0 && sign_of_next == 0) || (top == 0xff && sign_of_next != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        out.extend_from_slice(&[LONG1, n as u8]);
        out.extend_from_slice(&bytes[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(i: i128) -> Vec<u8> {
        let mut out = Vec::new();
        write_int(&mut out, i);
        out
    }

    #[test]
    fn integers_take_the_smallest_opcode_that_holds_them() {
        assert_eq!(int(7), [BININT1, 7]);
        assert_eq!(int(0x1234), [BININT2, 0x34, 0x12]);
        assert_eq!(int(-1), [BININT, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(int(1 << 31), [LONG1, 5, 0, 0, 0, 0x80, 0]);
        assert_eq!(
            int(-(1 << 31) - 1),
            [LONG1, 5, 0xff, 0xff, 0xff, 0x7f, 0xff]
        );
        let top = int(u64::MAX as i128);
        assert_eq!(
            top,
            [LONG1, 9, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0]
        );
        assert_eq!(int(0x7f00_0000_0000), [LONG1, 6, 0, 0, 0, 0, 0, 0x7f]);
    }

    #[test]
    fn containers_are_written_with_marks_and_batches() {
        let v = Value::dict([
            ("a", Value::List(vec![Value::None, true.into()])),
            ("t", Value::Tuple(vec![0u32.into(), 1u32.into()])),
        ]);
        let bytes = to_bytes(&v);
        let want = [
            &[PROTO, 2, EMPTY_DICT, MARK][..],
            &[
                BINUNICODE, 1, 0, 0, 0, b'a', EMPTY_LIST, MARK, NONE, NEWTRUE, APPENDS,
            ],
            &[BINUNICODE, 1, 0, 0, 0, b't', BININT1, 0, BININT1, 1, TUPLE2],
            &[SETITEMS, STOP],
        ]
        .concat();
        assert_eq!(bytes, want);
        let long = to_bytes(&Value::List(vec![Value::None; 2500]));
        assert_eq!(long.iter().filter(|&&b| b == APPENDS).count(), 3);
        let f = to_bytes(&Value::Float(0.5));
        assert_eq!(f, [PROTO, 2, BINFLOAT, 0x3f, 0xe0, 0, 0, 0, 0, 0, 0, STOP]);
    }
}

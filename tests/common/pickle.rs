//! A minimal pickle reader for tests: the opcodes of protocols 2 to 4 that the unpickler of
//! PyTorch's memory visualizer (`MemoryViz.js`) reads, so that a test fails on any opcode
//! that reader would refuse. Written apart from the crate's writer, so that a test checks
//! the bytes, not the writer against itself.
use std::fmt;

/// A value read back.
#[derive(Debug, Clone, PartialEq)]
pub enum Py {
    /// Python's `None`.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// An int, of any width the opcodes carry.
    Int(i128),
    /// A float.
    Float(f64),
    /// A str (a pickled unicode string).
    Str(String),
    /// A list.
    List(Vec<Py>),
    /// A tuple.
    Tuple(Vec<Py>),
    /// A dict, its items in the order they were set.
    Dict(Vec<(Py, Py)>),
}

impl Py {
    /// The value under string key `key` of a dict; panics (the test fails) otherwise.
    pub fn get(&self, key: &str) -> &Py {
        self.try_get(key)
            .unwrap_or_else(|| panic!("no key {key:?} in {self}"))
    }

    /// The value under `key`, if this is a dict that has it.
    pub fn try_get(&self, key: &str) -> Option<&Py> {
        match self {
            Py::Dict(items) => items
                .iter()
                .find(|(k, _)| matches!(k, Py::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string keys of a dict, in order.
    pub fn keys(&self) -> Vec<&str> {
        match self {
            Py::Dict(items) => items
                .iter()
                .map(|(k, _)| match k {
                    Py::Str(s) => s.as_str(),
                    other => panic!("a key that is not a string: {other}"),
                })
                .collect(),
            other => panic!("not a dict: {other}"),
        }
    }

    /// The value of an int; panics (the test fails) otherwise.
    pub fn int(&self) -> i128 {
        match self {
            Py::Int(i) => *i,
            other => panic!("not an int: {other}"),
        }
    }

    /// The text of a str; panics (the test fails) otherwise.
    pub fn str(&self) -> &str {
        match self {
            Py::Str(s) => s,
            other => panic!("not a str: {other}"),
        }
    }

    /// The value of a bool; panics (the test fails) otherwise.
    pub fn bool(&self) -> bool {
        match self {
            Py::Bool(b) => *b,
            other => panic!("not a bool: {other}"),
        }
    }

    /// The items of a list or a tuple.
    pub fn items(&self) -> &[Py] {
        match self {
            Py::List(v) | Py::Tuple(v) => v,
            other => panic!("not a list: {other}"),
        }
    }
}

impl fmt::Display for Py {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = format!("{self:?}");
        let cut: String = s.chars().take(200).collect();
        f.write_str(&cut)
    }
}

/// Reads one pickle; `Err` names the first opcode or byte it cannot read.
pub fn read(bytes: &[u8]) -> Result<Py, String> {
    let mut stack: Vec<Py> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: std::collections::HashMap<u32, Py> = Default::default();
    let mut at = 0usize;
    let take = |at: &mut usize, n: usize| -> Result<&[u8], String> {
        let s = bytes
            .get(*at..*at + n)
            .ok_or_else(|| format!("truncated at byte {}", *at))?;
        *at += n;
        Ok(s)
    };
    let u32_at = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let pop_mark = |stack: &mut Vec<Py>, marks: &mut Vec<usize>| -> Result<Vec<Py>, String> {
        let m = marks.pop().ok_or("no mark")?;
        Ok(stack.split_off(m))
    };
    loop {
        let op = take(&mut at, 1)?[0];
        match op {
            0x80 => {
                let v = take(&mut at, 1)?[0];
                if !(2..=4).contains(&v) {
                    return Err(format!("protocol {v}: MemoryViz.js reads 2 to 4"));
                }
            }
            0x95 => {
                take(&mut at, 8)?;
            }
            b'.' => return stack.pop().ok_or_else(|| "empty stack at STOP".into()),
            b'N' => stack.push(Py::None),
            0x88 => stack.push(Py::Bool(true)),
            0x89 => stack.push(Py::Bool(false)),
            b'K' => stack.push(Py::Int(take(&mut at, 1)?[0] as i128)),
            b'M' => {
                let b = take(&mut at, 2)?;
                stack.push(Py::Int(u16::from_le_bytes([b[0], b[1]]) as i128));
            }
            b'J' => stack.push(Py::Int(u32_at(take(&mut at, 4)?) as i32 as i128)),
            0x8a => {
                let n = take(&mut at, 1)?[0] as usize;
                let b = take(&mut at, n)?;
                if n > 16 {
                    return Err(format!("LONG1 of {n} bytes"));
                }
                let mut full = [if b.last().is_some_and(|x| x & 0x80 != 0) {
                    0xff
                } else {
                    0
                }; 16];
                full[..n].copy_from_slice(b);
                stack.push(Py::Int(i128::from_le_bytes(full)));
            }
            b'G' => {
                let b = take(&mut at, 8)?;
                stack.push(Py::Float(f64::from_be_bytes(b.try_into().unwrap())));
            }
            b'X' => {
                let n = u32_at(take(&mut at, 4)?) as usize;
                let s = std::str::from_utf8(take(&mut at, n)?).map_err(|e| e.to_string())?;
                stack.push(Py::Str(s.to_owned()));
            }
            0x8c => {
                let n = take(&mut at, 1)?[0] as usize;
                let s = std::str::from_utf8(take(&mut at, n)?).map_err(|e| e.to_string())?;
                stack.push(Py::Str(s.to_owned()));
            }
            b']' => stack.push(Py::List(Vec::new())),
            b'}' => stack.push(Py::Dict(Vec::new())),
            b')' => stack.push(Py::Tuple(Vec::new())),
            b'(' => marks.push(stack.len()),
            b'a' => {
                let v = stack.pop().ok_or("APPEND on an empty stack")?;
                match stack.last_mut() {
                    Some(Py::List(l)) => l.push(v),
                    _ => return Err("APPEND to a non-list".into()),
                }
            }
            b'e' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                match stack.last_mut() {
                    Some(Py::List(l)) => l.extend(items),
                    _ => return Err("APPENDS to a non-list".into()),
                }
            }
            b'u' | b's' => {
                let items = if op == b'u' {
                    pop_mark(&mut stack, &mut marks)?
                } else {
                    let v = stack.pop().ok_or("SETITEM on an empty stack")?;
                    let k = stack.pop().ok_or("SETITEM on an empty stack")?;
                    vec![k, v]
                };
                if items.len() % 2 != 0 {
                    return Err("SETITEMS with an odd number of items".into());
                }
                let Some(Py::Dict(d)) = stack.last_mut() else {
                    return Err("SETITEMS to a non-dict".into());
                };
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
            }
            b't' => {
                let items = pop_mark(&mut stack, &mut marks)?;
                stack.push(Py::Tuple(items));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if stack.len() < n {
                    return Err("TUPLEn on a short stack".into());
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(Py::Tuple(items));
            }
            0x94 => {
                let n = memo.len() as u32;
                memo.insert(n, stack.last().ok_or("MEMOIZE on an empty stack")?.clone());
            }
            b'q' => {
                let i = take(&mut at, 1)?[0] as u32;
                memo.insert(i, stack.last().ok_or("BINPUT on an empty stack")?.clone());
            }
            b'h' => {
                let i = take(&mut at, 1)?[0] as u32;
                stack.push(memo.get(&i).ok_or("BINGET of nothing")?.clone());
            }
            other => {
                return Err(format!(
                    "opcode {other:#04x} at byte {}: MemoryViz.js does not read it",
                    at - 1
                ))
            }
        }
    }
}

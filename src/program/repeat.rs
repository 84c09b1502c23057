//! `"for"` blocks: steps written once with a rank variable and expanded for every value of it
//! when the world is known (a pipeline's stage s receives from s − 1 and sends to s + 1, in any
//! world).
//!
//! ```text
//! {"for": "s", "from": 0, "to": "last", "steps": [
//!    {"collective": "recv", "src": "s-1", "shape": [2], "out": "h{s-1}", "ranks": ["s"], "if": "s > 0"},
//!    ...]}
//! ```
//!
//! The rules are on [`Block`].

use std::collections::HashMap;

use serde_json::Value;

use super::{Program, Step, StepKind};
use crate::error::{Error, ProgramError, Result};

/// Most steps plus block repetitions a program's blocks may expand to.
pub const MAX_EXPANDED_STEPS: usize = 100_000;

/// A `"for"` block as written; its steps are expanded once the world is known
/// ([`Program::plan`](super::Program::plan)).
///
/// - `"from"` and `"to"` (inclusive) are integer expressions; the block's steps are repeated for
///   each value in order (none when `to < from`). Blocks nest.
/// - In a step of the block, a string where a number goes (`ranks`, `group`, `dst`, `src`,
///   `root`, `perm`, `shape`, splits, `dim`, `start`, `len`) is an integer expression, and
///   `{expr}` inside a string (`in`, `out`) is replaced by its value: `"h{s-1}"` is `h2` when
///   `s` is 3.
/// - `"if"`: a condition; the step (or a nested block) is left out for the values where it is
///   false.
/// - Expressions (at most 256 bytes, values up to 2^40): integers, the block variables, `world`,
///   `last` (= world − 1), `+`, `-`, `*`, parentheses; conditions compare two expressions (`<`,
///   `<=`, `>`, `>=`, `==`, `!=`) and join comparisons with `&&` and `||` (`&&` first; no
///   parentheses around comparisons).
/// - Expanding is bounded: at most [`MAX_EXPANDED_STEPS`] step visits and block repetitions, and
///   [`MAX_EXPANDED_BYTES`] of step JSON, where every copy of a step counts its size and every
///   visit of a nested block counts the nested block's size as written (it is read once).
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// The variable's name.
    pub var: String,
    /// First value (an integer expression).
    pub from: Value,
    /// Last value, inclusive (an integer expression).
    pub to: Value,
    /// The steps, as JSON, with expressions in them.
    pub steps: Vec<Value>,
}

/// Keys whose values are numbers (or lists of numbers) in a step: a string there is an
/// expression. The test `numeric_keys_are_the_integer_fields_of_a_step` holds this list against
/// every kind of step (each local op and collective, read by serde): a field added to one and
/// not the other fails it.
const NUMERIC_KEYS: [&str; 12] = [
    "ranks",
    "group",
    "dst",
    "src",
    "root",
    "perm",
    "shape",
    "in_splits",
    "out_splits",
    "dim",
    "start",
    "len",
];

/// What is wrong with a `"for"` block or an expression in one; the checker says where it is
/// ([`crate::error::ProgramError::Block`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BlockError {
    /// The block as written: a missing or unknown field, a bad variable name.
    #[error("{0}")]
    Form(String),
    /// An expression or condition that cannot be evaluated.
    #[error("in `{expr}`: {detail}")]
    Expr {
        /// The expression as written.
        expr: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A name whose `{expr}` parts cannot be filled in.
    #[error("`{name}`: {detail}")]
    Name {
        /// The name as written.
        name: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A number too large, or not an integer.
    #[error("{0} is not an integer of at most 2^40 in size")]
    NotInteger(String),
    /// A value where a number or an expression goes.
    #[error("{0} is neither an integer nor an expression")]
    NotNumber(String),
    /// A rank, size or index below 0.
    #[error("`{expr}` is {value}, below 0")]
    Negative {
        /// The expression as written.
        expr: String,
        /// Its value.
        value: i64,
    },
    /// The expansion grows beyond its budget.
    #[error(
        "the program grows beyond {MAX_EXPANDED_STEPS} steps and block repetitions (or {} MiB of steps) once its blocks are expanded",
        MAX_EXPANDED_BYTES >> 20
    )]
    TooLarge,
}

impl From<&str> for BlockError {
    fn from(s: &str) -> Self {
        BlockError::Form(s.to_string())
    }
}

impl From<String> for BlockError {
    fn from(s: String) -> Self {
        BlockError::Form(s)
    }
}

/// Keys whose strings are names, where `{expr}` is replaced.
const NAME_KEYS: [&str; 2] = ["in", "out"];

impl Block {
    /// Parse a block from a step's JSON object (which has `"for"`).
    pub(super) fn from_map(
        mut map: serde_json::Map<String, Value>,
    ) -> std::result::Result<Block, BlockError> {
        let var = match map.remove("for") {
            Some(Value::String(v)) => v,
            _ => return Err("\"for\" names the block's variable, a string".into()),
        };
        if !is_ident(&var) || var == "world" || var == "last" {
            return Err(BlockError::Form(format!(
                "\"for\": `{var}` is not a variable name (letters, digits, _; not world or last)"
            )));
        }
        let from = map
            .remove("from")
            .ok_or_else(|| format!("the \"for\" block over `{var}` needs \"from\""))?;
        let to = map
            .remove("to")
            .ok_or_else(|| format!("the \"for\" block over `{var}` needs \"to\" (inclusive)"))?;
        let steps = match map.remove("steps") {
            Some(Value::Array(a)) => a,
            _ => {
                return Err(BlockError::Form(format!(
                    "the \"for\" block over `{var}` needs \"steps\", a list of steps"
                )));
            }
        };
        if let Some(k) = map.keys().next() {
            return Err(BlockError::Form(format!(
                "unknown field `{k}` in the \"for\" block over `{var}` (it takes for, from, to, steps)"
            )));
        }
        Ok(Block {
            var,
            from,
            to,
            steps,
        })
    }

    /// The block as JSON (as written).
    pub(super) fn to_value(&self) -> Value {
        serde_json::json!({
            "for": self.var,
            "from": self.from,
            "to": self.to,
            "steps": self.steps,
        })
    }
}

/// Bytes of step JSON a program's blocks may expand to (each repetition of a step counts its own
/// size), so a large step repeated many times cannot exhaust memory.
pub const MAX_EXPANDED_BYTES: usize = 64 << 20;

/// What expanding a program's blocks may cost: step visits (emitted or left out by `"if"`,
/// nested blocks included) and bytes of emitted step JSON.
struct Budget {
    visits: usize,
    bytes: usize,
}

impl Budget {
    fn charge(&mut self, visits: usize, bytes: usize) -> std::result::Result<(), BlockError> {
        if visits > self.visits || bytes > self.bytes {
            return Err(BlockError::TooLarge);
        }
        self.visits -= visits;
        self.bytes -= bytes;
        Ok(())
    }
}

/// The program with every `"for"` block replaced by its steps for `world` ranks, and for each
/// step of the result where it came from (`step 3`, or `step 0 (for s), its step 2 with s = 1`),
/// for messages about it.
pub(super) fn expand(p: &Program, world: usize) -> Result<(Program, Vec<String>)> {
    let origins_plain = || (0..p.steps.len()).map(|i| format!("step {i}")).collect();
    if !p.steps.iter().any(|s| matches!(s.kind, StepKind::For(_))) {
        return Ok((p.clone(), origins_plain()));
    }
    let mut env = HashMap::new();
    env.insert("world".to_string(), world as i64);
    env.insert("last".to_string(), world as i64 - 1);
    let mut out = Vec::new();
    let mut budget = Budget {
        visits: MAX_EXPANDED_STEPS,
        bytes: MAX_EXPANDED_BYTES,
    };
    for (si, s) in p.steps.iter().enumerate() {
        match &s.kind {
            StepKind::For(b) => expand_block(
                &Tree::read(b.clone()),
                &env,
                &format!("step {si}"),
                &mut out,
                &mut budget,
            )?,
            _ => out.push((s.clone(), format!("step {si}"))),
        }
    }
    let (steps, origins) = out.into_iter().unzip();
    Ok((Program { steps, ..p.clone() }, origins))
}

/// A block's steps read once, however many times an enclosing block visits it: each step's size
/// as written and nested blocks parsed, so that a visit costs what it emits, not a copy and a
/// re-serialisation of everything under it (an outer loop of 50,000 over a block carrying 4 MiB
/// of steps is refused at once, not copied 50,000 times).
struct Tree {
    var: String,
    from: Value,
    to: Value,
    items: Vec<Item>,
}

/// One step of a [`Tree`].
enum Item {
    /// A step as written, its size in bytes of JSON (charged on every copy made of it).
    Step {
        map: serde_json::Map<String, Value>,
        size: usize,
    },
    /// A nested block, its condition, and its size as written (charged on every visit).
    Nested {
        tree: Tree,
        cond: Option<Value>,
        size: usize,
    },
    /// Not a step: an error on its first visit, where the message can say which value.
    Bad(BlockError),
}

impl Tree {
    /// Read `block` and every block nested in it, once.
    fn read(block: Block) -> Tree {
        Tree {
            var: block.var,
            from: block.from,
            to: block.to,
            items: block.steps.into_iter().map(Item::read).collect(),
        }
    }
}

impl Item {
    fn read(item: Value) -> Item {
        let size = serde_json::to_string(&item).map_or(0, |t| t.len());
        let Value::Object(mut map) = item else {
            return Item::Bad("a step is a JSON object".into());
        };
        if !map.contains_key("for") {
            return Item::Step { map, size };
        }
        let cond = map.remove("if");
        match Block::from_map(map) {
            Ok(b) => Item::Nested {
                tree: Tree::read(b),
                cond,
                size,
            },
            Err(e) => Item::Bad(e),
        }
    }
}

/// Whether `cond` (a step's `"if"`, if any) holds for `env`.
fn holds(
    cond: Option<&Value>,
    env: &HashMap<String, i64>,
) -> std::result::Result<bool, BlockError> {
    match cond {
        None => Ok(true),
        Some(Value::String(c)) => Parser::new(c, env).condition_all(),
        Some(_) => Err("\"if\" is a condition written as a string".into()),
    }
}

fn expand_block(
    b: &Tree,
    env: &HashMap<String, i64>,
    at: &str,
    out: &mut Vec<(Step, String)>,
    budget: &mut Budget,
) -> Result<()> {
    let here = format!("{at} (for {})", b.var);
    let block = |at: &str, detail: &dyn std::fmt::Display| -> Error {
        ProgramError::Block {
            at: at.to_string(),
            detail: detail.to_string(),
        }
        .into()
    };
    let bound = |v: &Value, what: &str| -> Result<i64> {
        number(v, env).map_err(|e| block(&here, &format!("\"{what}\": {e}")))
    };
    let (from, to) = (bound(&b.from, "from")?, bound(&b.to, "to")?);
    if env.contains_key(&b.var) {
        return Err(block(
            &here,
            &format!("`{}` is already a variable of an enclosing block", b.var),
        ));
    }
    let mut env = env.clone();
    for v in from..=to {
        env.insert(b.var.clone(), v);
        budget.charge(1, 0).map_err(|e| block(&here, &e))?;
        for (k, item) in b.items.iter().enumerate() {
            let at = format!("{here}, its step {k} with {} = {v}", b.var);
            let fail = |e: BlockError| block(&at, &e);
            budget.charge(1, 0).map_err(fail)?;
            let (map, size) = match item {
                Item::Bad(e) => return Err(fail(e.clone())),
                Item::Nested { tree, cond, size } => {
                    // Charged its size whether or not it runs: what a visit would copy.
                    budget.charge(0, *size).map_err(fail)?;
                    if holds(cond.as_ref(), &env).map_err(fail)? {
                        expand_block(tree, &env, &at, out, budget)?;
                    }
                    continue;
                }
                Item::Step { map, size } => (map, *size),
            };
            if !holds(map.get("if"), &env).map_err(fail)? {
                continue;
            }
            budget.charge(0, size).map_err(fail)?;
            let mut map = map.clone();
            map.remove("if");
            for (key, value) in map.iter_mut() {
                if NUMERIC_KEYS.contains(&key.as_str()) {
                    numbers_in(value, &env).map_err(|e| block(&at, &format!("\"{key}\": {e}")))?;
                } else if NAME_KEYS.contains(&key.as_str()) {
                    names_in(value, &env).map_err(|e| block(&at, &format!("\"{key}\": {e}")))?;
                }
            }
            let step: Step =
                serde_json::from_value(Value::Object(map)).map_err(|e| block(&at, &e))?;
            out.push((step, at));
        }
    }
    Ok(())
}

/// An integer from a number or an expression string.
fn number(v: &Value, env: &HashMap<String, i64>) -> std::result::Result<i64, BlockError> {
    match v {
        Value::Number(n) => n
            .as_i64()
            .filter(|v| v.unsigned_abs() <= MAX_VALUE as u64)
            .ok_or_else(|| BlockError::NotInteger(n.to_string())),
        Value::String(s) => Parser::new(s, env).expr_all(),
        other => Err(BlockError::NotNumber(other.to_string())),
    }
}

/// Replace every expression string in a numeric field (nested lists too) by its value; values
/// used as ranks, sizes or indices must not be negative.
fn numbers_in(v: &mut Value, env: &HashMap<String, i64>) -> std::result::Result<(), BlockError> {
    match v {
        Value::String(s) => {
            let n = Parser::new(s, env).expr_all()?;
            if n < 0 {
                return Err(BlockError::Negative {
                    expr: s.clone(),
                    value: n,
                });
            }
            *v = Value::from(n);
        }
        Value::Array(a) => {
            for x in a {
                numbers_in(x, env)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Replace `{expr}` in every name (a string or a list of strings) by its value.
fn names_in(v: &mut Value, env: &HashMap<String, i64>) -> std::result::Result<(), BlockError> {
    match v {
        Value::String(s) => *s = substitute(s, env)?,
        Value::Array(a) => {
            for x in a {
                names_in(x, env)?;
            }
        }
        _ => {}
    }
    Ok(())
}

fn substitute(s: &str, env: &HashMap<String, i64>) -> std::result::Result<String, BlockError> {
    let name = |detail: String| BlockError::Name {
        name: s.to_string(),
        detail,
    };
    let mut out = String::new();
    let mut rest = s;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..]
            .find('}')
            .ok_or_else(|| name("a `{` without its `}`".into()))?;
        let inner = &rest[open + 1..open + close];
        let n = Parser::new(inner, env)
            .expr_all()
            .map_err(|e| name(e.to_string()))?;
        out.push_str(&n.to_string());
        rest = &rest[open + close + 1..];
    }
    if rest.contains('}') {
        return Err(name("a `}` without its `{`".into()));
    }
    out.push_str(rest);
    Ok(out)
}

fn is_ident(s: &str) -> bool {
    let mut c = s.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
}

/// Largest magnitude of a value in an expression (and of an integer `from` / `to`).
const MAX_VALUE: i64 = 1 << 40;

/// Longest expression (bytes): expressions index ranks, so they are short; this also bounds the
/// parser's nesting.
const MAX_EXPR_LEN: usize = 256;

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Num(i64),
    Ident(String),
    Sym(&'static str),
}

impl std::fmt::Display for Tok {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tok::Num(n) => write!(f, "`{n}`"),
            Tok::Ident(s) => write!(f, "`{s}`"),
            Tok::Sym(s) => write!(f, "`{s}`"),
        }
    }
}

/// A small recursive-descent parser of integer expressions and conditions.
struct Parser<'a> {
    text: &'a str,
    toks: Vec<Tok>,
    pos: usize,
    env: &'a HashMap<String, i64>,
    error: Option<String>,
}

const SYMBOLS: [&str; 13] = [
    "<=", ">=", "==", "!=", "&&", "||", "<", ">", "+", "-", "*", "(", ")",
];

impl<'a> Parser<'a> {
    fn new(text: &'a str, env: &'a HashMap<String, i64>) -> Parser<'a> {
        let mut toks = Vec::new();
        let mut error = None;
        if text.len() > MAX_EXPR_LEN {
            error = Some(format!("longer than {MAX_EXPR_LEN} bytes"));
        }
        let b = if error.is_some() {
            &[][..]
        } else {
            text.as_bytes()
        };
        let mut i = 0;
        while i < b.len() {
            let c = b[i] as char;
            if c.is_ascii_whitespace() {
                i += 1;
            } else if c.is_ascii_digit() {
                let start = i;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
                match text[start..i].parse::<i64>() {
                    Ok(n) if n <= MAX_VALUE => toks.push(Tok::Num(n)),
                    _ => {
                        error = Some(format!("`{}` is too large", &text[start..i]));
                        break;
                    }
                }
            } else if c.is_ascii_alphabetic() || c == '_' {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                toks.push(Tok::Ident(text[start..i].to_string()));
            } else if let Some(sym) = SYMBOLS.iter().find(|s| text[i..].starts_with(**s)) {
                toks.push(Tok::Sym(sym));
                i += sym.len();
            } else {
                let ch = text[i..].chars().next().unwrap_or(c);
                error = Some(format!("unexpected `{ch}`"));
                break;
            }
        }
        Parser {
            text,
            toks,
            pos: 0,
            env,
            error,
        }
    }

    fn fail<T>(&self, why: impl std::fmt::Display) -> std::result::Result<T, BlockError> {
        Err(BlockError::Expr {
            expr: self.text.to_string(),
            detail: why.to_string(),
        })
    }

    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }

    fn eat(&mut self, sym: &'static str) -> bool {
        if self.peek() == Some(&Tok::Sym(sym)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn finish<T>(&self, v: T) -> std::result::Result<T, BlockError> {
        match self.peek() {
            None => Ok(v),
            Some(t) => self.fail(format!("unexpected {t} after the end")),
        }
    }

    /// The whole text as an integer expression.
    fn expr_all(mut self) -> std::result::Result<i64, BlockError> {
        if let Some(e) = &self.error {
            return self.fail(e);
        }
        let v = self.expr()?;
        self.finish(v)
    }

    /// The whole text as a condition.
    fn condition_all(mut self) -> std::result::Result<bool, BlockError> {
        if let Some(e) = &self.error {
            return self.fail(e);
        }
        let v = self.or()?;
        self.finish(v)
    }

    fn or(&mut self) -> std::result::Result<bool, BlockError> {
        let mut v = self.and()?;
        while self.eat("||") {
            let r = self.and()?;
            v = v || r;
        }
        Ok(v)
    }

    fn and(&mut self) -> std::result::Result<bool, BlockError> {
        let mut v = self.compare()?;
        while self.eat("&&") {
            let r = self.compare()?;
            v = v && r;
        }
        Ok(v)
    }

    fn compare(&mut self) -> std::result::Result<bool, BlockError> {
        let a = self.expr()?;
        for op in ["<=", ">=", "==", "!=", "<", ">"] {
            if self.eat(op) {
                let b = self.expr()?;
                return Ok(match op {
                    "<=" => a <= b,
                    ">=" => a >= b,
                    "==" => a == b,
                    "!=" => a != b,
                    "<" => a < b,
                    _ => a > b,
                });
            }
        }
        self.fail(
            "a condition compares two expressions (<, <=, >, >=, ==, !=), joined by && and || \
             (no parentheses around comparisons)",
        )
    }

    fn expr(&mut self) -> std::result::Result<i64, BlockError> {
        let mut v = self.term()?;
        loop {
            if self.eat("+") {
                let t = self.term()?;
                v = self.checked(v.checked_add(t))?;
            } else if self.eat("-") {
                let t = self.term()?;
                v = self.checked(v.checked_sub(t))?;
            } else {
                return Ok(v);
            }
        }
    }

    fn term(&mut self) -> std::result::Result<i64, BlockError> {
        let mut v = self.factor()?;
        while self.eat("*") {
            let f = self.factor()?;
            v = self.checked(v.checked_mul(f))?;
        }
        Ok(v)
    }

    fn checked(&self, v: Option<i64>) -> std::result::Result<i64, BlockError> {
        match v {
            Some(v) if v.unsigned_abs() <= MAX_VALUE as u64 => Ok(v),
            _ => self.fail("the value is too large"),
        }
    }

    fn factor(&mut self) -> std::result::Result<i64, BlockError> {
        let mut negate = false;
        while self.eat("-") {
            negate = !negate;
        }
        let v = self.atom()?;
        Ok(if negate { -v } else { v })
    }

    fn atom(&mut self) -> std::result::Result<i64, BlockError> {
        if self.eat("(") {
            let v = self.expr()?;
            if !self.eat(")") {
                return self.fail(
                    "a `(` without its `)` (parentheses group numbers; conditions take no \
                     parentheses around comparisons)",
                );
            }
            return Ok(v);
        }
        match self.peek().cloned() {
            Some(Tok::Num(n)) => {
                self.pos += 1;
                Ok(n)
            }
            Some(Tok::Ident(name)) => {
                self.pos += 1;
                match self.env.get(&name) {
                    Some(v) => Ok(*v),
                    None => {
                        let mut known: Vec<&String> = self.env.keys().collect();
                        known.sort();
                        self.fail(format!("unknown variable `{name}` (known: {known:?})"))
                    }
                }
            }
            Some(t) => self.fail(format!("expected a number or a variable, got {t}")),
            None => self.fail("expected a number or a variable at the end"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The variant names serde knows for an internally tagged enum (`tag` its tag field), read
    /// from the error it gives for a variant it does not know.
    fn variants<T: serde::de::DeserializeOwned>(tag: &str) -> Vec<String> {
        let e = serde_json::from_value::<T>(serde_json::json!({ tag: "?" }))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        let list = e.split("expected one of").nth(1).unwrap_or_default();
        list.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    }

    /// Whether a JSON value is an integer or a (nested) non-empty list of integers.
    fn integral(v: &Value) -> bool {
        match v {
            Value::Number(n) => n.is_u64(),
            Value::Array(a) => !a.is_empty() && a.iter().all(integral),
            _ => false,
        }
    }

    /// Every local op and every collective as a step with every field given (numbers > 0), read
    /// as a [`Step`] and written back: the keys whose values are integers are exactly
    /// [`NUMERIC_KEYS`]. A new op or collective needs its sample here (the test says which), and
    /// a new integer field of one fails until it is a numeric key.
    #[test]
    fn numeric_keys_are_the_integer_fields_of_a_step() {
        let ops: HashMap<&str, Value> = [
            ("scale", serde_json::json!({"by": 0.5})),
            ("reshape", serde_json::json!({"shape": [2, 3]})),
            ("slice", serde_json::json!({"dim": 1, "start": 1, "len": 2})),
            ("concat", serde_json::json!({"dim": 1})),
        ]
        .into_iter()
        .collect();
        let collectives: HashMap<&str, Value> = [
            ("broadcast", serde_json::json!({"root": 1})),
            ("reduce", serde_json::json!({"root": 1, "op": "max"})),
            ("gather", serde_json::json!({"root": 1})),
            ("scatter", serde_json::json!({"root": 1})),
            ("all_reduce", serde_json::json!({"op": "max"})),
            ("reduce_scatter", serde_json::json!({"op": "max"})),
            ("permute", serde_json::json!({"perm": [[0, 1], [1, 2]]})),
            ("send", serde_json::json!({"dst": 1})),
            ("recv", serde_json::json!({"src": 1, "shape": [2]})),
            (
                "all_to_all_single",
                serde_json::json!({"in_splits": [1, 2], "out_splits": [2, 1]}),
            ),
        ]
        .into_iter()
        .collect();
        let common = serde_json::json!({"in": ["a"], "out": "b", "ranks": [1], "group": [1, 2]});
        let mut found = std::collections::BTreeSet::new();
        let kinds = [
            ("op", &ops, variants::<super::super::LocalOp>("op")),
            (
                "collective",
                &collectives,
                variants::<crate::collective::Spec>("collective"),
            ),
        ];
        for (tag, samples, names) in kinds {
            assert!(names.len() > 5, "serde lists the {tag} names: {names:?}");
            for name in names {
                let mut step = common.clone();
                step[tag] = Value::from(name.clone());
                if let Some(Value::Object(fields)) = samples.get(name.as_str()) {
                    for (k, v) in fields {
                        step[k.as_str()] = v.clone();
                    }
                }
                let parsed: Step = serde_json::from_value(step.clone())
                    .unwrap_or_else(|e| panic!("{tag} {name}: give it a sample here: {e}"));
                let written = serde_json::to_value(&parsed).expect("a step serializes");
                for (k, v) in written.as_object().expect("an object") {
                    if integral(v) {
                        found.insert(k.clone());
                    }
                }
            }
        }
        let want: std::collections::BTreeSet<String> =
            NUMERIC_KEYS.iter().map(|k| k.to_string()).collect();
        assert_eq!(found, want);
    }

    fn env() -> HashMap<String, i64> {
        HashMap::from([
            ("s".to_string(), 3),
            ("world".to_string(), 5),
            ("last".to_string(), 4),
        ])
    }

    #[test]
    fn expressions_and_conditions_by_hand() {
        let e = env();
        let x = |t: &str| Parser::new(t, &e).expr_all();
        assert_eq!(x("s-1"), Ok(2));
        assert_eq!(x(" 2 * (s + 1) - last "), Ok(4));
        assert_eq!(x("-s + world"), Ok(2));
        assert_eq!(x("7"), Ok(7));
        let c = |t: &str| Parser::new(t, &e).condition_all();
        assert_eq!(c("s > 0"), Ok(true));
        assert_eq!(c("s == last"), Ok(false));
        assert_eq!(c("s < last && s != 2"), Ok(true));
        assert_eq!(c("s == 0 || s == 3"), Ok(true));
        assert_eq!(c("s >= world"), Ok(false));
        for bad in ["s +", "t", "s )", "(s", "s $ 1", "", "99999999999999999999"] {
            assert!(x(bad).is_err(), "{bad}");
        }
        assert!(c("s").is_err());
        assert_eq!(substitute("h{s-1}.{last}", &e), Ok("h2.4".to_string()));
        assert!(substitute("h{s", &e).is_err());
        assert!(substitute("h}s", &e).is_err());
    }
}

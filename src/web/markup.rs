//! Markup as the page's views write it: elements, attributes and text, escaped as they are
//! written, so that a view reads as its structure rather than as `format!` strings of `\"` and
//! escapes. The page keeps building its DOM by hand (a measured comparison with Leptos found its
//! views no shorter and harder to unit-test, at over twice the `.wasm` per view:
//! `docs/layout.md`); this is the small helper those views share. Plain Rust, on every target:
//! a view is a function from data to [`Markup`], tested with `cargo test`.
//!
//! ```
//! use distgrad::web::markup::Markup;
//! let mut m = Markup::new();
//! m.with("tr", &[("class", "me")], |m| {
//!     m.el("th", &[("scope", "row")], "0 (you)");
//!     m.with("td", &[], |m| { m.el("code", &[], "[1, <2>]"); });
//! });
//! assert_eq!(
//!     m.into_string(),
//!     r#"<tr class="me"><th scope="row">0 (you)</th><td><code>[1, &lt;2&gt;]</code></td></tr>"#
//! );
//! ```

use std::fmt::Write as _;

/// Markup being written (HTML or SVG).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Markup {
    out: String,
}

impl Markup {
    /// Nothing written yet.
    pub fn new() -> Markup {
        Markup::default()
    }

    fn open_tag(&mut self, tag: &str, attrs: &[(&str, &str)]) {
        self.out.push('<');
        self.out.push_str(tag);
        for (k, v) in attrs {
            let _ = write!(self.out, " {k}=\"{}\"", escape(v));
        }
    }

    /// `<tag a="v">text</tag>`, the text and the attribute values escaped.
    pub fn el(&mut self, tag: &str, attrs: &[(&str, &str)], text: &str) -> &mut Markup {
        self.with(tag, attrs, |m| {
            m.text(text);
        })
    }

    /// `<tag a="v">`, then what `children` writes, then `</tag>`.
    pub fn with(
        &mut self,
        tag: &str,
        attrs: &[(&str, &str)],
        children: impl FnOnce(&mut Markup),
    ) -> &mut Markup {
        self.open_tag(tag, attrs);
        self.out.push('>');
        children(self);
        let _ = write!(self.out, "</{tag}>");
        self
    }

    /// `<tag a="v"/>`: an element without children (SVG's `line`, `circle`, ...).
    pub fn empty(&mut self, tag: &str, attrs: &[(&str, &str)]) -> &mut Markup {
        self.open_tag(tag, attrs);
        self.out.push_str("/>");
        self
    }

    /// Text, escaped.
    pub fn text(&mut self, text: &str) -> &mut Markup {
        self.out.push_str(&escape(text));
        self
    }

    /// Markup written elsewhere.
    pub fn markup(&mut self, m: &Markup) -> &mut Markup {
        self.out.push_str(&m.out);
        self
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.out.is_empty()
    }

    /// The markup as text (for `innerHTML`).
    pub fn into_string(self) -> String {
        self.out
    }
}

/// `s` with `&`, `<`, `>` and `"` escaped: safe as text and inside a double-quoted attribute.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A table of text cells: a header row (`scope="col"`) and rows whose first cell is their header
/// (`scope="row"`); each row may carry a class. The cells are written by [`Markup::text`], in a
/// `<code>` where `code` says so.
#[derive(Debug, Clone, Default)]
pub struct Table {
    /// The `class` of the `<table>`.
    pub class: String,
    /// The header row.
    pub head: Vec<String>,
    /// The rows: a class (or none), the row's header, its cells.
    pub rows: Vec<(Option<String>, String, Vec<String>)>,
    /// Whether the cells are code (values).
    pub code: bool,
}

impl Table {
    /// The table's markup.
    pub fn markup(&self) -> Markup {
        let mut m = Markup::new();
        m.with("table", &[("class", &self.class)], |m| {
            m.with("thead", &[], |m| {
                m.with("tr", &[], |m| {
                    for h in &self.head {
                        m.el("th", &[("scope", "col")], h);
                    }
                });
            });
            m.with("tbody", &[], |m| {
                for (class, header, cells) in &self.rows {
                    let attrs: Vec<(&str, &str)> =
                        class.as_deref().map(|c| ("class", c)).into_iter().collect();
                    m.with("tr", &attrs, |m| {
                        m.el("th", &[("scope", "row")], header);
                        for c in cells {
                            m.with("td", &[], |m| match self.code {
                                true => {
                                    m.el("code", &[], c);
                                }
                                false => {
                                    m.text(c);
                                }
                            });
                        }
                    });
                }
            });
        });
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_attributes_are_escaped_once() {
        let mut m = Markup::new();
        m.el("p", &[("title", "a \"b\" & <c>")], "x < y && y > \"z\"");
        assert_eq!(
            m.into_string(),
            r#"<p title="a &quot;b&quot; &amp; &lt;c&gt;">x &lt; y &amp;&amp; y &gt; &quot;z&quot;</p>"#
        );
    }

    #[test]
    fn nesting_empty_elements_and_pieces() {
        let mut inner = Markup::new();
        inner.empty("circle", &[("r", "3")]);
        let mut m = Markup::new();
        m.with("svg", &[("viewBox", "0 0 10 10")], |m| {
            m.markup(&inner);
            m.el("text", &[], "rank 0");
        });
        assert_eq!(
            m.into_string(),
            r#"<svg viewBox="0 0 10 10"><circle r="3"/><text>rank 0</text></svg>"#
        );
        assert!(Markup::new().is_empty());
    }

    #[test]
    fn a_table_of_values() {
        let t = Table {
            class: "values".into(),
            head: vec!["rank".into(), "x".into()],
            rows: vec![
                (None, "0".into(), vec!["[1, 2]".into()]),
                (Some("me".into()), "1 (you)".into(), vec!["<3>".into()]),
            ],
            code: true,
        };
        assert_eq!(
            t.markup().into_string(),
            concat!(
                r#"<table class="values"><thead><tr><th scope="col">rank</th><th scope="col">x</th></tr></thead>"#,
                r#"<tbody><tr><th scope="row">0</th><td><code>[1, 2]</code></td></tr>"#,
                r#"<tr class="me"><th scope="row">1 (you)</th><td><code>&lt;3&gt;</code></td></tr></tbody></table>"#
            )
        );
    }
}

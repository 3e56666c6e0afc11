//! Text that came from outside kvprobe (a peer's hello, a foreign report, a parser error
//! quoting either), made safe to print on an operator's terminal or in a log. Depends on
//! nothing, so every module that prints such text escapes it the same way.

use std::borrow::Cow;
use std::fmt::Write;

/// `s` with every character that could move the cursor, start a terminal control sequence or
/// reorder what is displayed replaced by a visible escape, so that foreign text stays on one
/// line and cannot forge lines, clear the screen or set a window title:
/// - `\n`, `\r`, `\t` become those two-character escapes;
/// - every other control character (Unicode category Cc: C0 `U+0000..=U+001F` including ESC,
///   DEL `U+007F`, C1 `U+0080..=U+009F` including CSI and OSC) becomes `\u{XX}`;
/// - the line and paragraph separators `U+2028`/`U+2029` and the bidirectional controls
///   (`U+061C`, `U+200E`, `U+200F`, `U+202A..=U+202E`, `U+2066..=U+2069`, as listed by
///   Unicode TR 9 "Explicit Directional Formatting Characters" and CVE-2021-42574) become
///   `\u{XXXX}`.
///
/// Everything else, backslashes included, passes through unchanged, so ordinary text (paths,
/// host names, messages) reads as it was written. The result is for reading, not for parsing
/// back. Borrows `s` when there is nothing to escape.
pub fn escape_control(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if needs_escape(c) => {
                // Writing to a String cannot fail.
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// True for the characters [`escape_control`] replaces: control characters (C0, DEL, C1) and
/// the bidirectional and line-separator controls that reorder or break what a terminal shows.
pub fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061C}'
                | '\u{200E}'
                | '\u{200F}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{202A}'..='\u{202E}'
                | '\u{2066}'..='\u{2069}'
        )
}

#[cfg(test)]
mod tests {
    use super::escape_control;

    #[test]
    fn plain_text_is_borrowed_unchanged() {
        let s = r"kvprobe 0.1.0 on node-7 (C:\path, ünïcödé)";
        assert!(matches!(escape_control(s), std::borrow::Cow::Borrowed(_)));
        assert_eq!(escape_control(s), s);
    }

    #[test]
    fn controls_become_visible_escapes() {
        let s = "9.9\nkvprobe serve: run 0 from 10.9.9.9\x1b]0;PWNED\x07\r\t\u{7f}\u{9b}2J\u{202e}x";
        assert_eq!(
            escape_control(s),
            "9.9\\nkvprobe serve: run 0 from 10.9.9.9\\u{1b}]0;PWNED\\u{7}\\r\\t\\u{7f}\\u{9b}2J\\u{202e}x"
        );
    }
}

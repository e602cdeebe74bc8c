//! The reasoning split: a chat answer's `<think>` part taken apart from its content as the text
//! streams in.

/// Splits a chat answer into its reasoning and its content: text before `</think>` is
/// reasoning when the turn opened thinking (or the answer opens it with `<think>`), the rest is
/// content (one newline after the closing tag dropped). Tags split across pieces are held
/// until they are whole.
#[derive(Debug)]
pub struct Reasoning {
    /// Inside the reasoning part.
    inside: bool,
    /// Nothing has been emitted yet (the answer may still open with `<think>`).
    fresh: bool,
    /// Text held back: it may be the start of a tag.
    held: String,
    /// A newline right after `</think>` is still to be dropped.
    after_close: bool,
}

impl Reasoning {
    const OPEN: &'static str = "<think>";
    const CLOSE: &'static str = "</think>";

    pub fn new(thinking: bool) -> Self {
        Self {
            inside: thinking,
            fresh: true,
            held: String::new(),
            after_close: false,
        }
    }

    /// (reasoning, content) of the next piece of text.
    pub fn push(&mut self, text: &str) -> (String, String) {
        let (mut r, mut c) = (String::new(), String::new());
        self.held.push_str(text);
        loop {
            if self.fresh && !self.inside {
                let t = self.held.trim_start();
                if t.starts_with(Self::OPEN) {
                    let at = self.held.find(Self::OPEN).unwrap_or(0) + Self::OPEN.len();
                    self.held.drain(..at);
                    self.inside = true;
                } else if Self::OPEN.starts_with(t) && !t.is_empty() {
                    return (r, c); // maybe the opening tag: wait
                }
            }
            if self.inside {
                if let Some(i) = self.held.find(Self::CLOSE) {
                    r.push_str(&self.held[..i]);
                    self.held.drain(..i + Self::CLOSE.len());
                    self.inside = false;
                    self.after_close = true;
                    self.fresh = false;
                    continue;
                }
            }
            if self.after_close && !self.held.is_empty() {
                if self.held.starts_with('\n') {
                    self.held.remove(0);
                }
                self.after_close = false;
            }
            // keep back what could begin the closing tag
            let keep = if self.inside {
                (1..Self::CLOSE.len())
                    .rev()
                    .find(|&k| self.held.ends_with(&Self::CLOSE[..k]))
                    .unwrap_or(0)
            } else {
                0
            };
            let mut cut = self.held.len() - keep;
            while !self.held.is_char_boundary(cut) {
                cut -= 1;
            }
            let out: String = self.held.drain(..cut).collect();
            if !out.is_empty() {
                self.fresh = false;
            }
            if self.inside {
                r += &out;
            } else {
                c += &out;
            }
            return (r, c);
        }
    }

    /// Whatever is still held, at the end of the answer.
    pub fn end(&mut self) -> (String, String) {
        let rest = std::mem::take(&mut self.held);
        if self.inside {
            (rest, String::new())
        } else {
            (String::new(), rest)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Reasoning;

    fn split(thinking: bool, pieces: &[&str]) -> (String, String) {
        let mut s = Reasoning::new(thinking);
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let (a, b) = s.push(p);
            r += &a;
            c += &b;
        }
        let (a, b) = s.end();
        (r + &a, c + &b)
    }

    #[test]
    fn reasoning_is_split_from_content_whatever_the_pieces() {
        let whole = "Let me think.</think>\nThe answer is 4.";
        let want = ("Let me think.".to_string(), "The answer is 4.".to_string());
        assert_eq!(split(true, &[whole]), want);
        // every split point, including inside the tag and inside a multi-byte character
        let text = "Héllo, let me see.</think>\nAnswer: é";
        for i in 0..text.len() {
            if !text.is_char_boundary(i) {
                continue;
            }
            let got = split(true, &[&text[..i], &text[i..]]);
            assert_eq!(
                got,
                ("Héllo, let me see.".into(), "Answer: é".into()),
                "split at {i}"
            );
        }
        // the answer opens thinking itself
        assert_eq!(
            split(false, &["<thi", "nk>why</think>so"]),
            ("why".into(), "so".into())
        );
        // no thinking: all content, tags or not
        assert_eq!(
            split(false, &["plain </think> text"]),
            (String::new(), "plain </think> text".into())
        );
        // thinking never closed: all reasoning
        assert_eq!(
            split(true, &["still ", "thinking"]),
            ("still thinking".into(), String::new())
        );
    }
}

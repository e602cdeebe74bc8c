//! Text in and out: the model directory's `tokenizer.json` through the `tokenizers` crate.

use std::path::Path;

/// A model's tokenizer.
#[derive(Debug)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
}

/// The tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TokenizerError(String);

impl TextTokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn load(dir: &Path) -> Result<Self, TokenizerError> {
        let p = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&p)
            .map_err(|e| TokenizerError(format!("{}: {e}", p.display())))?;
        Ok(Self { inner })
    }

    /// Text to ids (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    /// Tokens in the vocabulary (special ones included).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Refuses an id outside the vocabulary.
    pub fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        let v = self.vocab_size();
        match ids.iter().find(|&&t| t as usize >= v) {
            Some(t) => Err(TokenizerError(format!(
                "token id {t} is outside the vocabulary of {v}"
            ))),
            None => Ok(()),
        }
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Ids to text (special tokens kept visible).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError(e.to_string()))
    }
}

/// Text of a sequence decoded as its tokens arrive: each step decodes only the last few tokens
/// (the `tokenizers` crate's stream decoder), and gives text only once its characters are whole.
pub struct TextStream<'t>(
    tokenizers::DecodeStream<
        't,
        tokenizers::ModelWrapper,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    >,
);

impl std::fmt::Debug for TextStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TextStream")
    }
}

impl TextStream<'_> {
    /// The text token `id` completes (empty while a character is still partial).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        Ok(self
            .0
            .step(id)
            .map_err(|e| TokenizerError(e.to_string()))?
            .unwrap_or_default())
    }
}

impl TextTokenizer {
    /// A stream decoder over this tokenizer (special tokens kept visible, as [`Self::decode`]).
    pub fn stream(&self) -> TextStream<'_> {
        TextStream(self.inner.decode_stream(false))
    }
}

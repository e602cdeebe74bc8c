//! From logits to text: the generation loop, sampling, the tokenizer, chat templates, and what
//! is taken out of an answer (the reasoning part, tool calls).

pub mod generate;
pub mod grammar;
pub mod reasoning;
pub mod sampling;
pub mod speculative;
pub mod template;
pub mod tokenizer;
pub mod tool_calls;

#!/usr/bin/env python3
"""Converts the yardstick checkpoint of ../shared/bench (which has no tokenizer files) to GGUF with
llama.cpp's converter, giving it a placeholder byte-level vocabulary of the model's size: llama-bench
feeds token ids, so only the vocabulary's size matters.

usage: python benches/gguf_placeholder_vocab.py LLAMA_CPP_DIR HF_DIR --outfile OUT.gguf --outtype bf16
(needs torch, numpy and safetensors; LLAMA_CPP_DIR is a llama.cpp source tree with
convert_hf_to_gguf.py, conversion/ and gguf-py/)
"""
import runpy
import sys

llama = sys.argv[1]
sys.path.insert(0, f"{llama}/gguf-py")
sys.path.insert(0, llama)
import gguf  # noqa: E402
from conversion.glm import GlmMoeDsaModel  # noqa: E402


def byte_tokens():
    """GPT-2's byte-to-unicode table (so that byte lookups such as the newline token resolve)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def set_vocab(self):
    n = self.hparams["vocab_size"]
    toks = ["<bos>", "<eos>"] + byte_tokens()
    toks += [f"<t{i}>" for i in range(len(toks), n)]
    types = [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (n - 2)
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(['! "'])  # the loader wants a merges list; one entry is enough
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)


GlmMoeDsaModel.set_vocab = set_vocab
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(f"{llama}/convert_hf_to_gguf.py", run_name="__main__")

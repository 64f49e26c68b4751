"""The reference model of DESIGN.md section 6 in PyTorch, with nanoGPT's parameter names
(transformer.h.{i}.attn.c_attn.weight, ...), so rtp's safetensors load into it by name.
Shared by gen-gpt-fixture.py, check-export.py, bench/torch-parallel.py and
bench/torch-gpu.py (which runs it on a GPU: every tensor it makes is on its input's device)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-5


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape
        hd = d // self.n_head
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(B, T, self.n_head, hd).transpose(1, 2) for t in (q, k, v))  # [B,H,T,hd]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~causal, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=LN_EPS)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln_2 = nn.LayerNorm(d, eps=LN_EPS)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, d_model, n_layer, n_head, tie_embeddings=False):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d_model),
            wpe=nn.Embedding(seq_len, d_model),
            h=nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(d_model, eps=LN_EPS),
        ))
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        if tie_embeddings:  # GPT-2's: the head is the token embedding
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx):
        """Logits [B, T, V] for tokens idx [B, T]."""
        pos = torch.arange(idx.shape[1], device=idx.device)  # where idx is: on a GPU too
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def loss(logits, targets):
    """Mean cross-entropy of next-byte prediction over all positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

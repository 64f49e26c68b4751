#!/usr/bin/python3
"""PyTorch reference for rtp's GPT model (DESIGN.md section 6): writes
tests/fixtures/gpt-tiny.safetensors, the exact answers the C engine is tested against.

Regenerate with:  /usr/bin/python3 scripts/gen-gpt-fixture.py [--out PATH]
(Debian's python3 with python3-torch; the fixture is deterministic for a given torch
version, and needs no package beyond torch: safetensors is written by hand.)

Model: GPT-2 style, nanoGPT parameter names, no dropout. Embeddings wte [V,d] + wpe [T,d];
n_layer blocks x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)); LayerNorm eps 1e-5;
attn.c_attn Linear(d,3d) -> q,k,v in that order, causal softmax with scale
1/sqrt(d/n_head); attn.c_proj Linear(d,d); mlp.c_fc Linear(d,4d), GELU (tanh
approximation), mlp.c_proj Linear(4d,d); ln_f; untied lm_head Linear(d,V) without bias;
loss = mean cross-entropy over all B*T positions.

Tiny config: V=256 T=16 d=32 n_layer=2 n_head=4, batch B=3. torch.manual_seed(1234);
c_attn weights ~ N(0, 0.25) (peaked attention); other Linear/Embedding weights and all
Linear biases ~ N(0, 0.02); LayerNorm weight 1 + 0.1*N,
bias 0.1*N (so every bias and norm gradient is non-trivial). Tokens: a random byte
sequence [B,T+1], idx = seq[:, :-1], targets = seq[:, 1:].

Everything is computed in float64 from parameters that are exactly float32 values, then
stored as float32, so each reference is the correctly rounded exact answer.

Contents (safetensors shapes; rtp's ne is the reverse):
  <param name>            initial parameters, float32, PyTorch shape
  input.idx, input.targets  int32 [B,T]
  ref.logits [B,T,V], ref.loss [1]
  grad.<param name>       d loss / d param at the initial parameters
  ref.adam_losses [5]     loss before each of 5 Adam steps on the same batch
                          (torch.optim.Adam lr 1e-3, betas (0.9,0.95), eps 1e-8, no decay)
  adam.<param name>       parameters after those 5 steps
and the config as string __metadata__.
"""
import argparse
import json
import math
import os
import struct
import sys

import torch

from gpt_torch import GPT, LN_EPS, loss as mean_loss

CONFIG = dict(vocab=256, seq_len=16, d_model=32, n_layer=2, n_head=4, batch=3)
SEED = 1234
ADAM = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
ADAM_STEPS = 5

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "tests", "fixtures", "gpt-tiny.safetensors")


def init_params(model):
    """Deterministic init in named_parameters order, rounded to float32 values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                if name.endswith(".weight"):
                    v = 1.0 + 0.1 * torch.randn(p.shape, dtype=torch.float64)
                else:
                    v = 0.1 * torch.randn(p.shape, dtype=torch.float64)
            elif name.endswith("attn.c_attn.weight"):
                # Large enough that attention is far from uniform, so the test sees it.
                v = 0.25 * torch.randn(p.shape, dtype=torch.float64)
            else:  # Linear / Embedding weights and Linear biases
                v = 0.02 * torch.randn(p.shape, dtype=torch.float64)
            p.copy_(v.float().double())


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, torch tensor of float32 or int32), in file order."""
    dtypes = {torch.float32: "F32", torch.int32: "I32"}
    header = {"__metadata__": metadata}
    chunks, off = [], 0
    for name, t in tensors:
        assert name not in header, name
        t = t.detach().contiguous().cpu()
        raw = t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - (8 + len(h)) % 8) % 8)  # data section 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)
    os.replace(tmp, path)
    return 8 + len(h) + off


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()

    torch.manual_seed(SEED)
    c = CONFIG
    model = GPT(c["vocab"], c["seq_len"], c["d_model"], c["n_layer"], c["n_head"]).double()
    init_params(model)
    seq = torch.randint(0, c["vocab"], (c["batch"], c["seq_len"] + 1))
    idx, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    names = [n for n, _ in model.named_parameters()]
    params0 = {n: p.detach().clone() for n, p in model.named_parameters()}

    logits = model(idx)
    loss = mean_loss(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    opt = torch.optim.Adam(model.parameters(), lr=ADAM["lr"], betas=ADAM["betas"],
                           eps=ADAM["eps"], weight_decay=0.0)
    adam_losses = []
    for _ in range(ADAM_STEPS):
        opt.zero_grad(set_to_none=True)
        l = mean_loss(model(idx), targets)
        adam_losses.append(l.item())
        l.backward()
        opt.step()
    assert adam_losses[0] == loss.item()
    params5 = {n: p.detach().clone() for n, p in model.named_parameters()}

    tensors = [(n, params0[n].float()) for n in names]
    tensors += [("input.idx", idx.int()), ("input.targets", targets.int())]
    tensors += [("ref.logits", logits.detach().float()),
                ("ref.loss", loss.detach().reshape(1).float())]
    tensors += [("grad." + n, grads[n].float()) for n in names]
    tensors += [("ref.adam_losses", torch.tensor(adam_losses, dtype=torch.float32))]
    tensors += [("adam." + n, params5[n].float()) for n in names]

    metadata = {k: str(v) for k, v in c.items()}
    metadata.update({
        "ln_eps": repr(LN_EPS), "gelu": "tanh", "seed": str(SEED),
        "init": "c_attn.weight N(0,0.25); other weights, biases N(0,0.02); ln weight 1+0.1N, bias 0.1N",
        "adam_lr": repr(ADAM["lr"]), "adam_beta1": repr(ADAM["betas"][0]),
        "adam_beta2": repr(ADAM["betas"][1]), "adam_eps": repr(ADAM["eps"]),
        "adam_weight_decay": "0", "adam_steps": str(ADAM_STEPS),
        "compute": "float64", "torch": torch.__version__,
        "generator": "scripts/gen-gpt-fixture.py",
    })
    out = os.path.normpath(args.out)
    size = write_safetensors(out, tensors, metadata)

    n_params = sum(p.numel() for p in params0.values())
    print(f"wrote {out}: {size} bytes, {len(tensors)} tensors, {n_params} parameters")
    print("config: " + " ".join(f"{k}={v}" for k, v in c.items()))
    print(f"loss {loss.item():.10f} (ln(256) = {math.log(256):.10f})")
    print("adam losses: " + " ".join(f"{l:.10f}" for l in adam_losses))
    width = max(len(n) for n, _ in tensors)
    for n, t in tensors:
        print(f"  {n:<{width}}  {str(t.dtype).replace('torch.', ''):<7} "
              f"{list(t.shape)}  |x|max {t.abs().max().item():.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Hugging Face GPT-2 models for train-gpt's tests (transformers' GPT2LMHeadModel), offline.

    PYTHON scripts/hf-gpt2.py make DIR [--n-layer 2 --n-embd 64 --n-head 4 --n-positions 64
        --vocab 300 --seed 0 --std 0.1] [--untied] [--no-config] [--data DATA [--logits OUT]]
    PYTHON scripts/hf-gpt2.py loss DIR DATA [--seq-len T] [--logits OUT]

make: a randomly initialised model (weights N(0, std), LayerNorm weights near 1, so that
its logits are far from uniform) saved with save_pretrained as DIR/model.safetensors and
DIR/config.json (--no-config removes the config, as a file copied alone would be); with
--data, then what loss prints for the saved model (one start of transformers, not two).
loss: the model in DIR (from_pretrained) on DATA's bytes as tokens, in float64: the mean
next-token loss over the windows DATA[i*T .. i*T+T] (T+1 bytes each, every i that fits),
as train-gpt --eval-only computes it; printed as {"loss": x, "windows": n}. --logits
writes the windows' logits as raw little-endian float32 [n, T, vocab].
Nothing is downloaded (HF_HUB_OFFLINE). Exit status: 0, 1 error, 77 transformers missing.
"""
import argparse
import json
import struct
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
try:
    import torch
    import transformers
except ImportError:
    print("SKIP: this python has no torch and transformers (pip install transformers)")
    sys.exit(77)


def make(a):
    torch.manual_seed(a.seed)
    cfg = transformers.GPT2Config(vocab_size=a.vocab, n_positions=a.n_positions,
                                  n_embd=a.n_embd, n_layer=a.n_layer, n_head=a.n_head,
                                  tie_word_embeddings=not a.untied, bos_token_id=a.vocab - 1,
                                  eos_token_id=a.vocab - 1)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, a.std)
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(1.0)
    model.save_pretrained(a.dir, safe_serialization=True)
    if a.data:
        loss(a)
    if a.no_config:
        os.remove(os.path.join(a.dir, "config.json"))


def windows(path, T, uint16):
    data = open(path, "rb").read()
    if uint16:  # nanoGPT's token files: little-endian uint16, nothing else
        data = struct.unpack(f"<{len(data) // 2}H", data)
    n = (len(data) - 1) // T
    seq = torch.tensor([list(data[i * T:i * T + T + 1]) for i in range(n)], dtype=torch.long)
    return seq[:, :-1], seq[:, 1:]


def loss(a):
    model = transformers.GPT2LMHeadModel.from_pretrained(a.dir).double().eval()
    T = a.seq_len or model.config.n_positions
    idx, targets = windows(a.data, T, a.uint16)
    with torch.no_grad():
        logits = model(idx).logits
        mean = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))
    if a.logits:
        logits.float().numpy().astype("<f4").tofile(a.logits)
    print(json.dumps({"loss": mean.item(), "windows": idx.shape[0]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    for flag, default in (("--n-layer", 2), ("--n-embd", 64), ("--n-head", 4),
                          ("--n-positions", 64), ("--vocab", 300), ("--seed", 0)):
        m.add_argument(flag, type=int, default=default)
    m.add_argument("--std", type=float, default=0.1)
    m.add_argument("--untied", action="store_true")
    m.add_argument("--no-config", action="store_true")
    m.add_argument("--data")
    m.add_argument("--logits")
    m.add_argument("--uint16", action="store_true", help="DATA holds uint16 tokens, not bytes")
    m.set_defaults(seq_len=None)
    l = sub.add_parser("loss")
    l.add_argument("dir")
    l.add_argument("data")
    l.add_argument("--seq-len", type=int)
    l.add_argument("--logits")
    l.add_argument("--uint16", action="store_true", help="DATA holds uint16 tokens, not bytes")
    a = ap.parse_args()
    make(a) if a.cmd == "make" else loss(a)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Checks that a model exported by train-gpt loads by name into the equivalent PyTorch module
(DESIGN.md section 6, nanoGPT's names) and gives train-gpt's loss.

    /usr/bin/python3 scripts/check-export.py MODEL.safetensors DATA [--train-gpt BIN]

Prints the mean next-byte loss over the windows DATA[i*T .. i*T+T] (T+1 bytes each, every
i that fits), computed in float64 from the exported float32 weights. With --train-gpt it
also runs `BIN --init MODEL --eval-only --data DATA` and fails unless both agree within
1e-4 relative. Needs only torch (Debian: python3-torch); the safetensors file is read by
hand. Exit status: 0 agree, 1 disagree or error, 77 torch is missing.
"""
import argparse
import json
import math
import struct
import subprocess
import sys

try:
    import torch
    from gpt_torch import GPT, loss as mean_loss
except ImportError:
    print("SKIP: this python has no torch (apt install python3-torch)")
    sys.exit(77)


def read_safetensors(path):
    """(tensors by name, metadata): 8-byte LE header length, JSON header, raw LE data."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = blob[8 + n:]
    dtypes = {"F32": torch.float32, "I32": torch.int32}
    tensors = {}
    for name, h in header.items():
        lo, hi = h["data_offsets"]
        t = torch.frombuffer(bytearray(data[lo:hi]), dtype=dtypes[h["dtype"]])
        tensors[name] = t.reshape(h["shape"])
    return tensors, meta


def windows(path, T):
    data = open(path, "rb").read()
    n = (len(data) - 1) // T
    seq = torch.tensor([list(data[i * T:i * T + T + 1]) for i in range(n)], dtype=torch.long)
    return seq[:, :-1], seq[:, 1:]


def torch_loss(model_path, data_path):
    tensors, meta = read_safetensors(model_path)
    cfg = {k: int(meta[k]) for k in ("vocab", "seq_len", "d_model", "n_layer", "n_head")}
    model = GPT(**cfg).double()
    model.load_state_dict({k: v.double() for k, v in tensors.items()}, strict=True)
    idx, targets = windows(data_path, cfg["seq_len"])
    with torch.no_grad():
        logits = model(idx)
        loss = mean_loss(logits, targets)
    return loss.item(), idx.shape[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--train-gpt", help="the train-gpt binary to compare with")
    args = ap.parse_args()
    loss, n = torch_loss(args.model, args.data)
    print(f"pytorch: eval_loss {loss:.9g} over {n} windows")
    if not args.train_gpt:
        return 0
    out = subprocess.run([args.train_gpt, "--init", args.model, "--eval-only", "--data",
                          args.data], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"train-gpt failed ({out.returncode}): {out.stderr}")
        return 1
    got = json.loads(out.stdout)
    print(f"train-gpt: eval_loss {got['eval_loss']:.9g} over {got['windows']} windows")
    rel = abs(got["eval_loss"] - loss) / abs(loss)
    ok = got["windows"] == n and rel <= 1e-4
    print(f"relative difference {rel:.2e}: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

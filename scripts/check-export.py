#!/usr/bin/python3
"""Checks that a model exported by train-gpt loads by name into the equivalent PyTorch module
(DESIGN.md section 6, nanoGPT's names) and gives train-gpt's loss.

    /usr/bin/python3 scripts/check-export.py MODEL.safetensors DATA [--train-gpt BIN]
        [--sample N --prompt TEXT] [--vocab V]

Prints the mean next-byte loss over the windows DATA[i*T .. i*T+T] (T+1 bytes each, every
i that fits), computed in float64 from the exported float32 weights. With --train-gpt it
also runs `BIN --init MODEL --eval-only --data DATA` and fails unless both agree within
1e-4 relative; with --sample, also `BIN --init MODEL --steps 0 --sample N --prompt TEXT`
(greedy, through its KV cache), and fails unless each byte it wrote is the greedy pick of
the whole context's forward here (or within 1e-4 of it: a near tie), the context being
train-gpt's: a suffix of the text, the last T/2 bytes once it would pass T. Needs only
torch (Debian: python3-torch); the safetensors file is read by hand. Exit status: 0 agree,
1 disagree or error, 77 torch is missing.

With --vocab V, DATA is a token file (docs/data.md): llm.c's .bin when it starts with
llm.c's magic, else nanoGPT's plain uint16; train-gpt gets --vocab V, and a token model's
--prompt and sample are token ids ("1 2 3").
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


def model_from(tensors, meta):
    """The GPT of an export, in float64; a tied one (--tie-embeddings) has no lm_head.weight."""
    cfg = {k: int(meta[k]) for k in ("vocab", "seq_len", "d_model", "n_layer", "n_head")}
    tied = meta.get("tie_embeddings") == "1"
    model = GPT(**cfg, tie_embeddings=tied).double()
    state = {k: v.double() for k, v in tensors.items()}
    if tied:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state, strict=True)
    return model, cfg


def read_tokens(path, vocab):
    """The tokens of DATA: its bytes, or with vocab those of llm.c's .bin (a header of 256
    int32: magic, version, count; uint16 tokens for GPT-2, uint32 for Llama 3) or uint16."""
    data = open(path, "rb").read()
    if not vocab:
        return list(data)
    magic = struct.unpack("<i", data[:4])[0] if len(data) >= 4 else 0
    if magic in (20240520, 20240801):
        width = 2 if magic == 20240520 else 4
        count = struct.unpack("<i", data[8:12])[0]
        return list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", data[1024:]))
    return list(struct.unpack(f"<{len(data) // 2}H", data))


def windows(path, T, vocab=None):
    data = read_tokens(path, vocab)
    n = (len(data) - 1) // T
    seq = torch.tensor([list(data[i * T:i * T + T + 1]) for i in range(n)], dtype=torch.long)
    return seq[:, :-1], seq[:, 1:]


def torch_loss(model_path, data_path, vocab):
    tensors, meta = read_safetensors(model_path)
    model, cfg = model_from(tensors, meta)
    idx, targets = windows(data_path, cfg["seq_len"], vocab)
    with torch.no_grad():
        logits = model(idx)
        loss = mean_loss(logits, targets)
    return loss.item(), idx.shape[0]


def sample_text(out):
    """The bytes of train-gpt's sample section (\\xNN escapes undone, marks dropped)."""
    body = out.split(" ---\n", 1)[1].rsplit("\n---\n", 1)[0]
    lines = [l[:-8] if l.endswith("   right") or l.endswith("   wrong") else l
             for l in body.split("\n")]
    text, raw, i = bytearray(), "\n".join(lines), 0
    while i < len(raw):
        if raw.startswith("\\x", i):
            text.append(int(raw[i + 2:i + 4], 16))
            i += 4
        else:
            text.append(ord(raw[i]))
            i += 1
    return bytes(text)


def sample_ids(out):
    """A token model's sample: the ids train-gpt printed, the prompt's first."""
    body = out.split(" ---\n", 1)[1].rsplit("\n---\n", 1)[0]
    return [int(t) for t in body.split()]


def check_sample(model_path, train_gpt, n, prompt):
    tensors, meta = read_safetensors(model_path)
    model, cfg = model_from(tensors, meta)
    out = subprocess.run([train_gpt, "--init", model_path, "--steps", "0", "--sample", str(n),
                          "--prompt", prompt], capture_output=True, text=True, encoding="latin-1")
    if out.returncode != 0:
        print(f"train-gpt failed ({out.returncode}): {out.stderr}")
        return 1
    tokens = cfg["vocab"] != 256
    text = sample_ids(out.stdout) if tokens else sample_text(out.stdout)
    given = [int(t) for t in prompt.split()] if tokens else prompt.encode()
    T, start, plen = cfg["seq_len"], 0, len(given)
    if len(text) != plen + n or text[:plen] != given:
        print(f"train-gpt's sample is not the prompt and {n} bytes: {text!r}")
        return 1
    for length in range(plen, plen + n):
        if length - 1 - start >= T:
            start = length - T // 2
        ctx = torch.tensor([list(text[start:length])], dtype=torch.long)
        with torch.no_grad():
            logits = model(ctx)[0, -1]
        got, best = logits[text[length]].item(), logits.max().item()
        if got < best - 1e-4 * max(1.0, abs(best)):
            print(f"byte {length}: train-gpt wrote {text[length]}, the greedy pick is "
                  f"{int(logits.argmax())} ({got} < {best})")
            return 1
    print(f"sample: {n} {'tokens' if tokens else 'bytes'} after {prompt!r}, each the greedy "
          "pick of its context: OK")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--train-gpt", help="the train-gpt binary to compare with")
    ap.add_argument("--sample", type=int, help="also check a greedy sample of N bytes")
    ap.add_argument("--prompt", default="12+34=", help="the sample's prompt")
    ap.add_argument("--vocab", type=int, help="DATA is a token file of this vocabulary")
    args = ap.parse_args()
    if args.sample and args.train_gpt:
        if check_sample(args.model, args.train_gpt, args.sample, args.prompt):
            return 1
    loss, n = torch_loss(args.model, args.data, args.vocab)
    print(f"pytorch: eval_loss {loss:.9g} over {n} windows")
    if not args.train_gpt:
        return 0
    vocab = ["--vocab", str(args.vocab)] if args.vocab else []
    out = subprocess.run([args.train_gpt, "--init", args.model, "--eval-only", "--data",
                          args.data] + vocab, capture_output=True, text=True)
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

#!/usr/bin/env python3
"""PyTorch's side of bench-gpu: the same reference model (scripts/gpt_torch.py, the unfused
attention that rtp computes on CUDA), shapes, batch, AdamW and precision, one whole training
step (forward, backward, gradient clipping, AdamW) timed by the wall clock after a device
synchronize, eager and under torch.compile. Prints one JSON line per mode with bench-gpu's
fields (impl "torch-eager" / "torch-compile"); a mode that fails (no torch.compile in this
torch, a compiler error) prints a line with "error" instead of timings.

    python3 bench/torch-gpu.py [--device cuda|cpu] [--config medium|gpt2|tiny] [--bf16]
                               [--batch B] [--n-layer L] [--d-model D] [--n-head H]
                               [--seq-len T] [--vocab V] [--steps S] [--warmup W]
                               [--modes eager,compile] [--compile-scope model|blocks]
                               [--peak-tflops P] [--device-name NAME] [--threads N]

--compile-scope model (the default) compiles the forward and the loss as one function, as
nanoGPT does: a cold compile of the 12-layer GPT-2 takes tens of seconds. blocks compiles
each transformer block instead (PyTorch's "regional compilation"): the blocks share one
code, compiled once, so a cold start is several times shorter; the embeddings, final
LayerNorm, head and loss then run eagerly. The first warm-up step's time is "compile_s".

f32 is PyTorch's default math with TF32 off (as cuBLAS's default f32 GEMM in rtp); --bf16
is torch.autocast(bfloat16) over the forward and the loss: bf16 products with f32 weights,
gradients and Adam states, as rtp's compute_type bf16 (autocast also keeps the products'
outputs in bf16, which rtp does not). Memory: torch.cuda.max_memory_allocated (null on the
CPU). Exits 77 without torch.
"""
import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
sys.path.insert(0, HERE)
from bench_stats import interval  # noqa: E402

try:
    import torch
    from gpt_torch import GPT, loss as mean_loss
except ImportError:
    print("torch-gpu.py: torch is not installed, nothing to compare", file=sys.stderr)
    sys.exit(77)

# bench-gpu.c's find_config: train-gpt's medium and tiny, GPT-2 124M (tied, vocab padded to
# 50,304 as nanoGPT and llm.c pad 50,257).
CONFIGS = {
    "medium": dict(vocab=256, seq_len=256, d_model=768, n_layer=12, n_head=12, tied=False,
                   batch=32),
    "gpt2": dict(vocab=50304, seq_len=1024, d_model=768, n_layer=12, n_head=12, tied=True,
                 batch=8),
    "tiny": dict(vocab=256, seq_len=32, d_model=64, n_layer=2, n_head=4, tied=False, batch=2),
}


def peak_tflops(name, bf16):
    """bench-gpu.c's table: dense peaks of the SXM H100 and H200 (NVIDIA's datasheets), bf16
    989 and f32 67 TFLOP/s; none for other parts."""
    if not name or "PCIe" in name or "NVL" in name:
        return None
    if "H100" in name or "H200" in name:
        return 989.0 if bf16 else 67.0
    return None


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def n_params(c):
    """gpt_n_params: every parameter once (a tied head is wte)."""
    d, V, T = c["d_model"], c["vocab"], c["seq_len"]
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return V * d + T * d + c["n_layer"] * block + 2 * d + (0 if c["tied"] else V * d)


def step_flops(c, batch):
    """gpt_step_flops (PaLM / llm.c): 6 N tokens + 6 x 2 x L x T x d x tokens (attention)."""
    tokens = c["seq_len"] * batch
    return 6.0 * n_params(c) * tokens + 12.0 * c["n_layer"] * c["seq_len"] * c["d_model"] * tokens


def build(c, device):
    """The model with GPT-2's initialisation (as gpt_init_weights: N(0, 0.02), residual
    projections N(0, 0.02 / sqrt(2L)), biases 0, LayerNorm 1) and nanoGPT's AdamW: decay 0.1
    on matrices and embeddings, none on biases and LayerNorm (rtp's RTP_FLAG_NO_DECAY)."""
    torch.manual_seed(1)
    model = GPT(c["vocab"], c["seq_len"], c["d_model"], c["n_layer"], c["n_head"],
                tie_embeddings=c["tied"]).to(device)
    resid = 0.02 / math.sqrt(2 * c["n_layer"])
    for name, p in model.named_parameters():
        with torch.no_grad():
            if "ln_" in name:
                p.fill_(0.0 if name.endswith(".bias") else 1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, resid if "c_proj" in name else 0.02)
    params = list(model.parameters())  # a tied weight once
    assert sum(p.numel() for p in params) == n_params(c)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kind = "default"
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    if device == "cuda":  # one kernel for all parameters, as nanoGPT uses it
        try:
            opt = torch.optim.AdamW(groups, fused=True, **kw)
            return model, opt, "fused"
        except (TypeError, RuntimeError):
            pass
    return model, torch.optim.AdamW(groups, **kw), kind


def tf32_off():
    """f32 products as cuBLAS's default in rtp: no TF32. That is PyTorch's default too (since
    1.12); only TORCH_ALLOW_TF32_CUBLAS_OVERRIDE turns it on, and it is turned off again
    through the same (legacy) flag: writing the newer fp32_precision API instead makes some
    2.9+ versions' inductor fail on reading the legacy one ("mix of the legacy and new
    APIs"). The model has no convolutions, so cuDNN's flag does not matter. Read once, before
    anything compiles (inductor may set the newer API itself, after which reading the legacy
    flag raises): whether TF32 is on, None if torch will not say."""
    try:
        if torch.backends.cuda.matmul.allow_tf32:
            torch.backends.cuda.matmul.allow_tf32 = False
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        return None


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run(args, c, mode, idx, tgt):
    """One mode's line: warm-up steps (the first compiles), then the timed ones."""
    device = args.device
    model, opt, adam = build(c, device)
    fwd = lambda i, t: mean_loss(model(i), t)  # noqa: E731
    compile_s = None
    if mode == "compile":
        if not hasattr(torch, "compile"):
            raise RuntimeError(f"torch {torch.__version__} has no torch.compile")
        if args.compile_scope == "model":
            fwd = torch.compile(fwd)
        else:  # the blocks are one code: compiled once, reused by the other L - 1
            for block in model.transformer.h:
                block.compile()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=args.bf16)

    def step():
        with amp:
            loss = fwd(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = [], []
    for s in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        dt = time.perf_counter() - t0
        if s == 0:
            compile_s = dt if mode == "compile" else None
        if s >= args.warmup:
            times.append(dt)
        if s == 0 or s == args.warmup + args.steps - 1:
            losses.append(loss.item())
    peak_mem = torch.cuda.max_memory_allocated() if device == "cuda" else None
    reserved = torch.cuda.max_memory_reserved() if device == "cuda" else None
    return times, losses, peak_mem, reserved, compile_s, adam


def line(args, c, mode, result=None, error=None):
    name = args.device_name or (torch.cuda.get_device_name(0) if args.device == "cuda"
                                else cpu_name())
    out = {"bench": "gpu_step", "impl": f"torch-{mode}", "device": args.device,
           "backend": f"torch {torch.__version__}", "device_name": name, "config": args.config,
           "precision": "bf16" if args.bf16 else "f32", "batch": args.batch,
           "seq_len": c["seq_len"], "d_model": c["d_model"], "n_layer": c["n_layer"],
           "n_head": c["n_head"], "vocab": c["vocab"], "tied": c["tied"],
           "params": n_params(c), "warmup": args.warmup, "steps": args.steps}
    if error is not None:
        out["error"] = error[:400]
        return out
    times, losses, peak_mem, reserved, compile_s, adam = result
    med = sorted(times)[len(times) // 2] if len(times) % 2 else \
        0.5 * sum(sorted(times)[len(times) // 2 - 1:len(times) // 2 + 1])
    lo, hi = interval(times)
    flops = step_flops(c, args.batch)
    peak = args.peak_tflops or (peak_tflops(name, args.bf16) if args.device == "cuda" else None)
    out.update({"ms_median": round(med * 1e3, 3), "ms_ci95": [round(lo * 1e3, 3), round(hi * 1e3, 3)],
                "ms_min": round(min(times) * 1e3, 3),
                "tokens_per_s": round(c["seq_len"] * args.batch / med, 1),
                "flops_per_step": int(flops), "tflops": float(f"{flops / med * 1e-12:.4g}"),
                "peak_tflops": peak,
                "mfu": float(f"{flops / med / (peak * 1e12):.4g}") if peak else None,
                "peak_mem_bytes": peak_mem, "device_reserved_bytes": reserved,
                "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
                "compile_s": None if compile_s is None else round(compile_s, 2), "adamw": adam,
                "tf32": args.tf32,
                "compile_scope": args.compile_scope if mode == "compile" else None})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--config", choices=list(CONFIGS), default="medium")
    for flag in ("batch", "n_layer", "d_model", "n_head", "seq_len", "vocab"):
        ap.add_argument("--" + flag.replace("_", "-"), dest=flag, type=int)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--compile-scope", choices=["model", "blocks"], default="model")
    ap.add_argument("--peak-tflops", type=float)
    ap.add_argument("--device-name")
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    c = dict(CONFIGS[args.config])
    for k in ("n_layer", "d_model", "n_head", "seq_len", "vocab"):
        if getattr(args, k) is not None:
            c[k] = getattr(args, k)
    args.batch = args.batch or c["batch"]
    modes = args.modes.split(",")
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or c["d_model"] % c["n_head"] or \
            any(m not in ("eager", "compile") for m in modes):
        ap.error("--steps >= 1, --warmup >= 0, n_head dividing d_model, modes eager,compile")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("torch-gpu.py: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    args.tf32 = tf32_off()
    g = torch.Generator().manual_seed(42)
    shape = (args.batch, c["seq_len"])
    idx = torch.randint(0, c["vocab"], shape, generator=g).to(args.device)
    tgt = torch.randint(0, c["vocab"], shape, generator=g).to(args.device)
    rc = 0
    for mode in modes:
        try:
            out = line(args, c, mode, run(args, c, mode, idx, tgt))
        except Exception as e:  # a mode that cannot run says why; the others still run
            out = line(args, c, mode, error=f"{type(e).__name__}: {e}")
            rc = rc or (mode == "eager")
        print(json.dumps(out), flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rc


if __name__ == "__main__":
    sys.exit(main())

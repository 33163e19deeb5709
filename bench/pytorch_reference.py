#!/usr/bin/env python3
"""The same GPT-2 training step in PyTorch eager, side by side with `distgpt bench`.

Builds the model of a distgpt preset as a plain nn.Module (tied embedding, pre-LN
blocks, tanh GELU, fused-scaled-softmax attention via F.scaled_dot_product_attention,
AdamW with the same decay groups), trains on random tokens with the given batch
and thread count, and prints tokens/s and MFU. With --strategy ddp or fsdp and
--world-size N it runs N processes over gloo (DistributedDataParallel, or FSDP2's
fully_shard per block), splitting the global batch and the threads among them.
With --distgpt PATH it runs `PATH bench` with the same arguments first and prints
both and their ratio. With --device cuda both run on the GPU (distgpt's cuda
backend, PyTorch's CUDA); --torch-variants picks PyTorch's rows (eager,
compile = torch.compile, and either in bf16 autocast) and --peak-tflops the
peak MFU is stated against. --distgpt-precision fp32,bf16 runs distgpt in
each (`bench --precision`); --repeat N makes every figure a median of N
runs: N distgpt processes, N windows of --steps timed steps of each
PyTorch row (after one warm-up: torch.compile compiles once). A distgpt
run that fails is named, PyTorch's rows still come, and the exit status
is 1.

    python bench/pytorch_reference.py --model shakespeare-char --batch-size 16 \
        --threads 2 --distgpt target/release/distgpt
    python bench/pytorch_reference.py --model shakespeare-char --batch-size 16 \
        --threads 2 --strategy fsdp --world-size 2 --distgpt target/release/distgpt
    python bench/pytorch_reference.py --device cuda --model gpt2 --batch-size 8 \
        --peak-tflops 989 --torch-variants eager,eager-bf16,compile-bf16 \
        --distgpt-precision fp32,bf16 --repeat 3 --distgpt target/release/distgpt
"""
import argparse
import json
import math
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from runs import distgpt_rows, line, median_row, ratio_lines

PRESETS = {  # layers, heads, width, block, vocab (as distgpt's presets)
    "gpt2": (12, 12, 768, 1024, 50257),
    "gpt2-medium": (24, 16, 1024, 1024, 50257),
    "shakespeare-char": (6, 6, 384, 256, 65),
    "shakespeare-char-small": (4, 4, 128, 128, 65),
    "tiny": (2, 2, 32, 64, 65),
}


class Block(nn.Module):
    def __init__(self, c, nh):
        super().__init__()
        self.nh = nh
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.nh, c // self.nh).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block, vocab):
        super().__init__()
        self.vocab = vocab
        vp = (vocab + 63) // 64 * 64
        self.wte = nn.Embedding(vp, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        logits = logits[..., : self.vocab]
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


def flops_per_token(model, cfg, t):
    n_layer, _, c, block, _ = cfg
    n = sum(p.numel() for p in model.parameters()) - block * c
    return 6 * n + 12 * n_layer * t * c


def run_torch(args, rank=0, world=1, variant="eager"):
    torch.set_num_threads(max(1, args.threads // world))
    torch.manual_seed(0)
    cfg = PRESETS[args.model]
    dev = torch.device(args.device)
    model = GPT(*cfg).to(dev)
    t = args.seq_len or cfg[3]
    bf16 = variant.endswith("-bf16")
    if variant.startswith("compile"):
        model = torch.compile(model)
    if args.strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for blk in model.h:
            fully_shard(blk)
        fully_shard(model)
    local_b = args.batch_size // world
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = []
    for i in range(args.warmup + args.steps * args.repeat):
        x = torch.randint(0, cfg[4], (local_b, t), device=dev)
        y = torch.randint(0, cfg[4], (local_b, t), device=dev)
        if world > 1:
            torch.distributed.barrier()
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    # --repeat's windows of --steps steps, each one run
    means = [sum(w) / len(w) for w in (times[i:i + args.steps] for i in range(0, len(times), args.steps))]
    if world > 1:
        m = torch.tensor(means)
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)
        means = m.tolist()
    name = f"pytorch {torch.__version__} {variant}" + (f" {args.strategy} x{world}" if world > 1 else "")
    fpt = flops_per_token(GPT(*cfg), cfg, t)
    return median_row([{"impl": name, "ms_per_step": mean * 1e3, "tokens_per_s": args.batch_size * t / mean,
                        "flops_per_token": fpt} for mean in means])


def _linear_from_conv1d(model):
    """GPT-2's Conv1D layers as nn.Linear (weight transposed), so that
    quantize_dynamic, which only knows nn.Linear, reaches them."""
    from transformers.pytorch_utils import Conv1D
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                nx, nf = child.weight.shape
                lin = torch.nn.Linear(nx, nf)
                lin.weight.data = child.weight.data.t().contiguous()
                lin.bias.data = child.bias.data.clone()
                setattr(module, child_name, lin)
    return model


def run_torch_generate(args, dtype=torch.float32, int8=False):
    """Greedy generation with transformers' GPT2LMHeadModel and its KV cache
    (eager); `int8`: every linear layer through torch's quantize_dynamic
    (int8 weights, activations quantized per call)."""
    import os
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n_layer, n_head, n_embd, block, vocab = PRESETS[args.model]
    cfg = GPT2Config(vocab_size=vocab, n_positions=block, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     activation_function="gelu_new", attn_implementation="eager",
                     bos_token_id=0, eos_token_id=None, pad_token_id=0)
    model = GPT2LMHeadModel(cfg).eval().to(dtype)
    if int8:
        model = torch.ao.quantization.quantize_dynamic(
            _linear_from_conv1d(model), {torch.nn.Linear}, dtype=torch.qint8)
    prompts = torch.tensor([[r % vocab] for r in range(args.batch_size)])
    best = float("inf")
    with torch.no_grad():
        for _ in range(args.warmup + max(args.steps, 1)):
            t0 = time.perf_counter()
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.generate,
                                 min_new_tokens=args.generate, do_sample=False, use_cache=True)
            best = min(best, time.perf_counter() - t0)
    assert out.shape[1] == 1 + args.generate
    name = "quantize_dynamic int8" if int8 else str(dtype).removeprefix("torch.")
    return {"impl": f"pytorch {torch.__version__} eager {name} (transformers generate, KV cache)",
            "seconds": best, "tokens_per_s": args.batch_size * args.generate / best}


def _rank_main(rank, args, port, out):
    import os
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=args.world_size)
    r = run_torch(args, rank, args.world_size)
    if rank == 0:
        out.put(r)
    torch.distributed.destroy_process_group()


def run_torch_distributed(args):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_rank_main, args=(args, port, out), nprocs=args.world_size, start_method="spawn")
    return out.get()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="shakespeare-char", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--strategy", default="single", choices=["single", "ddp", "fsdp"])
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--distgpt", help="path of the distgpt binary to run side by side")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both train")
    ap.add_argument("--torch-variants", default="eager",
                    help="PyTorch rows, comma-separated: eager, compile, eager-bf16, compile-bf16")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="peak MFU is stated against (default: distgpt's measured CPU peak)")
    ap.add_argument("--generate", type=int, default=0,
                    help="measure greedy KV-cache generation of this many tokens per row instead of training")
    ap.add_argument("--weights", default="f32", choices=["f32", "bf16", "int8"], help="distgpt's decoding weights")
    ap.add_argument("--torch-int8", action="store_true",
                    help="also run PyTorch's generation with quantize_dynamic int8 linear layers")
    ap.add_argument("--torch-bf16", action="store_true",
                    help="also run PyTorch's generation in bfloat16 (slow on CPUs without bf16 instructions)")
    ap.add_argument("--distgpt-precision", default="fp32",
                    help="distgpt's rows, comma-separated `bench --precision`s: fp32, bf16")
    ap.add_argument("--repeat", type=int, default=1,
                    help="each training figure the median of this many runs")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat is 1 or more")
    if args.generate:
        rows = []
        if args.distgpt:
            cmd = [args.distgpt, "--threads", str(args.threads), "bench", "--model", args.model,
                   "--batch-size", str(args.batch_size), "--generate", str(args.generate),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--weights", args.weights, "--json"]
            row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            row["impl"] = f"distgpt {row['weights']} weights"
            rows.append(row)
        rows.append(run_torch_generate(args))
        if args.torch_bf16:
            rows.append(run_torch_generate(args, torch.bfloat16))
        if args.torch_int8:
            rows.append(run_torch_generate(args, int8=True))
        for r in rows:
            print(f"{r['impl']:<68} {args.model} batch {args.batch_size} x {args.generate} new tokens,"
                  f" {args.threads} threads: {r['tokens_per_s']:.1f} tokens/s")
        if args.distgpt:
            for r in rows[1:]:
                print(f"ratio distgpt {args.weights} / {r['impl'].split(' (')[0]}:"
                      f" {rows[0]['tokens_per_s'] / r['tokens_per_s']:.2f}x")
        return 0
    rows = []
    peak = None
    failures = []
    if args.distgpt:
        cmd = [args.distgpt, "--threads", str(args.threads), "bench", "--model", args.model,
               "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               "--warmup", str(args.warmup),
               "--strategy", args.strategy, "--world-size", str(args.world_size),
               "--device", args.device]
        if args.seq_len:
            cmd += ["--seq-len", str(args.seq_len)]
        if args.peak_tflops:
            cmd += ["--peak-tflops", str(args.peak_tflops)]
        precisions = [p.strip() for p in args.distgpt_precision.split(",") if p.strip()]
        rows, failures = distgpt_rows(cmd, precisions, args.repeat)
        # PyTorch's rows still come: they are the baseline to mend against
        for f in failures:
            print(f, flush=True)
        if rows:
            peak = rows[0]["peak_gflops"] * 1e9
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
    if args.device == "cuda" and args.world_size > 1:
        ap.error("--device cuda runs one GPU here; several ranks are distgpt's `--comm nccl` under mpirun")
    variants = [v.strip() for v in args.torch_variants.split(",") if v.strip()]
    for v in variants:
        if v not in ("eager", "compile", "eager-bf16", "compile-bf16"):
            ap.error(f"unknown --torch-variants entry {v!r}")
    def show(r):  # each row as soon as it is measured: a slow compile loses none
        where = f"{args.threads} threads" if args.device == "cpu" else args.device
        shape = f"{args.model} {args.batch_size}x{args.seq_len or PRESETS[args.model][3]}"
        print(line(r, shape, where, peak), flush=True)
    for r in rows:
        show(r)
    ours = len(rows)
    if args.world_size > 1:
        rows.append(run_torch_distributed(args))
        show(rows[-1])
    else:
        for v in variants:
            rows.append(run_torch(args, variant=v))
            show(rows[-1])
    if ours:
        source = (f"stated peak {args.peak_tflops:g} TFLOP/s" if args.peak_tflops
                  else f"peak {peak / 1e9:.0f} GFLOP/s: distgpt's best matmul here")
        for r in ratio_lines(rows[:ours], rows[ours:], source):
            print(r)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

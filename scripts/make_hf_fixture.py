#!/usr/bin/env python3
"""Builds the Hugging Face parity fixture in tests/fixtures/hf_tiny/ (run by hand,
never by CI; needs `pip install torch transformers safetensors`).

A small random GPT2LMHeadModel (vocabulary 100, so the padded-vocabulary path is
exercised) with perturbed biases and layernorms is saved with save_pretrained;
beside it, reference.safetensors holds input tokens, targets, logits, the mean
cross-entropy loss, every parameter's gradient ("grad.<name>") and the
parameters after three torch.optim.AdamW steps on those gradients
("adamw.<name>"), with decay on 2-D tensors only.
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf_tiny")
B, T = 2, 16
LR, BETAS, EPS, WD, STEPS = 1e-2, (0.9, 0.95), 1e-8, 0.1, 3


def main() -> int:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     activation_function="gelu_new", layer_norm_epsilon=1e-5,
                     attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    os.makedirs(OUT, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)

    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    logits = model(tokens).logits
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    loss.backward()

    ref = {
        "tokens": tokens.to(torch.int32).contiguous(),
        "targets": targets.to(torch.int32).contiguous(),
        "logits": logits.detach().contiguous(),
        "loss": loss.detach().reshape(1),
    }
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("lm_head")]
    for n, p in named:
        ref[f"grad.{n}"] = p.grad.detach().clone().contiguous()

    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, foreach=False)
    grads = {n: p.grad.detach().clone() for n, p in named}
    for _ in range(STEPS):
        for n, p in named:
            p.grad = grads[n].clone()
        opt.step()
    for n, p in named:
        ref[f"adamw.{n}"] = p.detach().clone().contiguous()
    save_file(ref, os.path.join(OUT, "reference.safetensors"))
    print(f"wrote {OUT}: loss {loss.item():.6f}, {len(named)} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())

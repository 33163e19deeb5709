#!/usr/bin/env python3
"""Builds the reference-run fixtures (run by hand, never by CI; needs
`pip install torch transformers safetensors tensorboard`).

For each training task distgpt has (GPT-2 `lm`, BERT `mlm`, BERT
`pretrain`, BERT `classify`), a few optimizer steps trained in PyTorch / `transformers` the
way distgpt's run driver is specified to train them, written under
tests/fixtures/reference_runs/<task>/:

  init/        the starting weights, a Hugging Face folder distgpt's run
               takes as `init_from` (a classifier's and pretraining's also
               hold vocab.txt)
  final/       the weights after the last step, a Hugging Face folder
  data         the text (lm, mlm, pretrain) or the labelled set (classify: data/)
  run.json     the hyper-parameters both sides train with
  reference.safetensors
               per step: the learning rate, the loss (of the batch of
               all the step's micro-batches' rows), the gradient norm before
               clipping, the epochs the data has advanced; every micro-batch's inputs, targets (-100: no
               loss) and, for a classifier, its rows' lengths before
               [PAD] (for pretraining, its token types and next-sentence
               labels); the validation loss after the last step (and a
               classifier's validation and test loss, examples right of
               all, and F1; pretraining's next-sentence ones)

lm_bf16/ and mlm_bf16/ are the lm and mlm runs under `--precision bf16`:
no init/ (each starts from its fp32 run's) and no final/ (their test says
why); their reference.safetensors adds `grad.<name>`, the first step's
gradient before clipping.

Nothing here calls distgpt. What distgpt must do is restated from its
specification, independently of its code: the SplitMix64 generator every
order and mask is drawn from (src/rng.rs), the loader's windows and
per-epoch shuffles (data/loader.rs: seed ^ epoch * 0xA24BAED4963EE407),
BERT's masking (15% of positions predicted; of those 80% [MASK], 10% a
random character, 10% unchanged; each step's masks from the seed, the step
and the batch's place in the epoch; [CLS] and [SEP] never masked),
pretraining's sentence pairs (each window cut at a drawn token, its second
segment half the time drawn from elsewhere in the split), the classifier's epochs (examples
shuffled by seed + epoch, [CLS] pieces [SEP] padded with [PAD], the last
short batch filled with ignored [CLS] [SEP] rows), warmup then cosine decay,
AdamW decaying 2-D tensors only, clipping the global norm. A bug distgpt
shares across every layout (a lost padding length, a wrong masking split, an
epoch left out of a shuffle's seed) trains other numbers than these.

With --only llmc: tests/fixtures/llmc/golden_val_000000.bin, a token shard
as llm.c's dev/data/data_common.py write_datafile writes one (a header of
256 little-endian int32: magic 20240520, version 1, the token count; then
the tokens as uint16), which distgpt's writer must reproduce byte for byte.

With --only tensorboard: tests/fixtures/tensorboard/golden.tfevents, events
written by tensorboard's own RecordWriter and protos (a file version, a
scalar event, a text event, a session start, fixed wall times), which
distgpt's writer must reproduce byte for byte.
"""
import argparse
import json
import math
import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"
import numpy as np
import torch
from safetensors.torch import save_file
from transformers import (BertConfig, BertForMaskedLM, BertForPreTraining, BertForSequenceClassification,
                          BertTokenizer, GPT2Config, GPT2LMHeadModel)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(FIXTURES, "reference_runs")
M64 = (1 << 64) - 1
IGNORE = -100
VAL_FRACTION = 0.1
MASKED_PERCENT = 15

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


class Rng:
    """SplitMix64, as src/rng.rs specifies it."""

    def __init__(self, seed):
        self.state = (seed ^ 0x9E3779B97F4A7C15) & M64

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def uniform(self):
        return (self.next_u64() >> 11) / float(1 << 53)

    def below(self, n):
        return int(self.uniform() * n) % max(n, 1)

    def shuffle(self, items):
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]


def lr_at(h, step):
    """Linear warmup, then cosine decay to min_lr over the run's steps, in f32."""
    f = np.float32
    if step < h["warmup"]:
        return f(h["lr"]) * f(step + 1) / f(h["warmup"])
    span = max(h["steps"] - h["warmup"], 1)
    progress = min(f(step - h["warmup"]) / f(span), f(1.0))
    cosine = f(0.5) * (f(1.0) + np.cos(f(math.pi) * f(progress), dtype=np.float32))
    return f(h["min_lr"]) + cosine * (f(h["lr"]) - f(h["min_lr"]))


class Windows:
    """The language-model loader: windows of T+1 tokens at multiples of T,
    each epoch in an order shuffled from (seed, epoch), whole batches only."""

    def __init__(self, tokens, b, t, seed, shuffle):
        self.tokens, self.b, self.t, self.seed, self.shuffle = tokens, b, t, seed, shuffle
        self.n = (len(tokens) - 1) // t
        assert self.n >= b
        self.epoch, self.batch = 0, 0
        self.reorder()

    def reorder(self):
        self.order = list(range(self.n))
        if self.shuffle:
            Rng(self.seed ^ ((self.epoch * 0xA24BAED4963EE407) & M64)).shuffle(self.order)

    def epochs(self):
        return self.epoch + self.batch / (self.n // self.b)

    def next(self):
        if self.batch >= self.n // self.b:
            self.epoch, self.batch = self.epoch + 1, 0
            self.reorder()
        rows = self.order[self.batch * self.b:(self.batch + 1) * self.b]
        self.batch += 1
        t = self.t
        x = [self.tokens[w * t:w * t + t] for w in rows]
        y = [self.tokens[w * t + 1:w * t + t + 1] for w in rows]
        return torch.tensor(x), torch.tensor(y)


def mask_tokens(x, mask_id, chars, rng, fixed=()):
    """BERT's masking: 15% predicted; 80% [MASK], 10% random, 10% kept.
    Tokens in `fixed` ([CLS], [SEP]) are never picked; where no position
    was picked, one drawn among the open ones is (a batch has a loss)."""
    inputs, targets = x.clone(), torch.full_like(x, IGNORE)
    flat_in, flat_t = inputs.view(-1), targets.view(-1)
    tokens = x.view(-1).tolist()

    def pick(i):
        flat_t[i] = tokens[i]
        r = rng.below(10)
        if r < 8:
            flat_in[i] = mask_id
        elif r == 8:
            flat_in[i] = rng.below(chars)

    open_ = [i for i, tok in enumerate(tokens) if tok not in fixed]
    picked = 0
    for i in open_:
        if rng.below(100) < MASKED_PERCENT:
            pick(i)
            picked += 1
    if picked == 0 and open_:
        pick(open_[rng.below(len(open_))])
    return inputs, targets


def char_data(kind, length):
    """The first `length` characters of the embedded Shakespeare, written as
    the fixture's text.txt: its sorted character vocabulary and its train
    and validation tokens (the last tenth)."""
    out = fresh(kind)
    with open(os.path.join(ROOT, "data", "shakespeare.txt"), encoding="utf-8") as f:
        text = f.read()[:length]
    with open(os.path.join(out, "text.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    tokens = [index[c] for c in text]
    n_val = int(len(tokens) * VAL_FRACTION)
    return out, chars, tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


def optimizer(model, h):
    params = [p for _, p in model.named_parameters()]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": h["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"])


def train(model, h, next_micro, loss_of, epoch, weighed=None):
    """The run: per step, the loss of the batch of all its micro-batches'
    rows (each micro-batch's mean loss weighed by its share of the step's
    targets, as transformers weighs them by `num_items_in_batch`: a
    micro-batch with fewer targets, a masked LM's fewer masks or a
    classifier's short last batch, weighs less), gradients of it, the
    global norm before clipping, then AdamW; `epoch()` is where the data
    stands after a step (whole epochs plus the share of this one's batches
    taken). `weighed(batch, micro)`, where given, is a micro-batch's part
    of the step's loss itself (pretraining's two heads, each weighed by its
    own targets)."""
    opt = optimizer(model, h)
    record = {"lr": [], "loss": [], "grad_norm": [], "epoch": []}
    batches = []
    for step in range(h["steps"]):
        lr = float(lr_at(h, step))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        micro = [next_micro(step) for _ in range(h["grad_accum"])]
        counts = [int((b["targets"] != IGNORE).sum()) for b in micro]
        loss = 0.0
        for batch, n in zip(micro, counts):
            batches.append(batch)
            if weighed is not None:
                part = weighed(batch, micro)
                part.backward()
                loss += part.item()
                continue
            share = n / sum(counts)
            mean = loss_of(batch)
            (mean * share).backward()
            loss += mean.item() * share
        record["loss"].append(loss)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), h["grad_clip"])
        opt.step()
        record["lr"].append(lr)
        record["grad_norm"].append(norm.item())
        record["epoch"].append(epoch())
        print(f"  step {step + 1}: lr {lr:.6g} loss {record['loss'][-1]:.6f} grad norm {norm.item():.6f}")
    return record, batches


def tensors(record, batches):
    out = {k: torch.tensor(v, dtype=torch.float32) for k, v in record.items()}
    for i, batch in enumerate(batches):
        for name, value in batch.items():
            out[f"batch.{i}.{name}"] = value.to(torch.int32).contiguous()
    return out


def save(kind, model, h, ref, init_dir_files=()):
    out = os.path.join(OUT, kind)
    model.save_pretrained(os.path.join(out, "final"), safe_serialization=True)
    for f in init_dir_files:
        shutil.copy(os.path.join(out, "init", f), os.path.join(out, "final", f))
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(h, f, indent=2)
        f.write("\n")
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))


def fresh(kind):
    out = os.path.join(OUT, kind)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    return out


def perturb(model, seed):
    """Biases and LayerNorms off their initial 0 and 1, so a layout that
    drops one moves the numbers."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))


def bert_folder(init, model_class, vocab, seed, perturb_seed, **config):
    """A small BERT of `model_class` (2 blocks of 32, 4 heads, no dropout)
    with `vocab` written beside it as vocab.txt, saved into `init`; its
    weights drawn from `seed`, biases and LayerNorms perturbed by
    `perturb_seed`. The model and the vocabulary's path."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager",
                     **config)
    model = model_class(cfg).float()
    perturb(model, perturb_seed)
    model.save_pretrained(init, safe_serialization=True)
    path = os.path.join(init, "vocab.txt")
    with open(path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    return model, path


HYPER = {"lr": 3e-3, "min_lr": 3e-4, "warmup": 2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
         "weight_decay": 0.1, "grad_clip": 1.0, "seed": 7, "eval_batches": 2}


def lm():
    """GPT-2 on characters: 10 steps of 2 micro-batches of 4 x 16, into a
    second epoch; the validation split holds two batches, so its loss is a
    mean over batches."""
    out, chars, train_tokens, val_tokens = char_data("lm", 1300)
    h = dict(HYPER, task="lm", data="text", batch_size=4, seq_len=16, grad_accum=2, steps=10)
    torch.manual_seed(11)
    cfg = GPT2Config(vocab_size=len(chars), n_positions=h["seq_len"], n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1, bos_token_id=0, eos_token_id=0,
                     attn_implementation="eager")
    # the character vocabulary, where distgpt reads a GPT-2 folder's tokenizer
    cfg.distgpt_tokenizer = {"kind": "char", "chars": "".join(chars)}
    model = GPT2LMHeadModel(cfg).float()
    perturb(model, 12)
    model.save_pretrained(os.path.join(out, "init"), safe_serialization=True)
    loader = Windows(train_tokens, h["batch_size"], h["seq_len"], h["seed"], True)
    assert loader.n // h["batch_size"] < h["steps"] * h["grad_accum"], "into a second epoch"

    def micro(_step):
        x, y = loader.next()
        return {"inputs": x, "targets": y}

    def loss_of(b):
        logits = model(input_ids=b["inputs"]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["targets"].reshape(-1))

    record, batches = train(model, h, micro, loss_of, loader.epochs)
    val = Windows(val_tokens, h["batch_size"], h["seq_len"], h["seed"], False)
    with torch.no_grad():
        n = min(h["eval_batches"], val.n // h["batch_size"])
        assert n == 2, "the validation loss is a mean over two batches"
        losses = [loss_of(dict(zip(("inputs", "targets"), val.next()))).item() for _ in range(n)]
    ref = tensors(record, batches)
    ref["val_loss"] = torch.tensor([sum(losses) / n])
    ref["val_examples"] = torch.tensor([n * h["batch_size"]], dtype=torch.int32)
    save("lm", model, h, ref)
    print(f"lm: val loss {ref['val_loss'].item():.6f} -> {out}")


def bf16(x):
    """x rounded to bfloat16 (to nearest, ties to even), held in fp32."""
    return x.to(torch.bfloat16).float()


class Stored(torch.autograd.Function):
    """An activation held in bf16: its value rounded; its gradient, where
    `grad` is set, held in bf16 too (rounded as the kernel that makes it
    stores it)."""

    @staticmethod
    def forward(ctx, x, grad):
        ctx.grad = grad
        return bf16(x)

    @staticmethod
    def backward(ctx, g):
        return (bf16(g) if ctx.grad else g), None


class Product(torch.autograd.Function):
    """A bf16 matmul x @ w: both operands rounded to bf16 and the products
    summed in fp32; its backward's two products take the output gradient
    rounded too (dx = r(dy) r(w)^T, dw = r(x)^T r(dy))."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return bf16(x) @ bf16(w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = bf16(dy)
        dw = bf16(x).reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])
        return dy @ bf16(w).T, dw


class Attention(torch.autograd.Function):
    """Attention of (B, NH, T, HD) q, k, v under bf16 (GPT-2's causal,
    BERT's over every position): the scores of q and k rounded, summed in
    fp32 and scaled; the softmax in fp32, its normalized probabilities
    rounded for the product with v. Backward: dP of dO and v rounded, dS =
    P (dP - rowsum(dO O)) scale in fp32 from the output as it is held
    (GPT-2's in bf16, BERT's in fp32) and dO as it comes (fp32), then
    rounded, as P is, for dV = r(P)^T r(dO), dQ = r(dS) r(K), dK = r(dS)^T
    r(Q)."""

    @staticmethod
    def scores(q, k, causal):
        t, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
        s = (bf16(q) @ bf16(k).transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return s

    @staticmethod
    def forward(ctx, q, k, v, causal, out_held):
        s = Attention.scores(q, k, causal)
        m = s.amax(-1, keepdim=True)
        lse = m + torch.exp(s - m).sum(-1, keepdim=True).log()
        out = bf16(torch.softmax(s, dim=-1)) @ bf16(v)
        ctx.causal = causal
        ctx.save_for_backward(q, k, v, lse, bf16(out) if out_held else out)
        return out

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, lse, out = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        # the backward's probabilities from the forward's log-sum-exp, as
        # FlashAttention's backward makes them
        p = torch.exp(Attention.scores(q, k, ctx.causal) - lse)
        dp = bf16(d_o) @ bf16(v).transpose(-1, -2)
        d = (d_o * out).sum(-1, keepdim=True)
        ds = bf16(p * (dp - d) * scale)
        dv = bf16(p).transpose(-1, -2) @ bf16(d_o)
        return ds @ bf16(k), ds.transpose(-1, -2) @ bf16(q), dv, None, None


class GradHeld(torch.autograd.Function):
    """A value held as it is whose gradient is held in bf16 (BERT's
    logits: their gradient rounded where it lies)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return bf16(g)


def gpt2_bf16_logits(model, idx):
    """GPT-2's forward under distgpt's `--precision bf16`, as
    docs/backends.md specifies it: every matmul's operands rounded to bf16
    (the weights through their bf16 copy) and summed in fp32; held in
    bf16, each rounded as it is stored: the LayerNorms' outputs, q|k|v
    (its product's sums plus its bias rounded to bf16, as a bf16 linear
    adds it, the whole rounded once; its gradient held in bf16 too, from
    which the bias's gradient is summed), the attention's output, the fc
    product before its bias (GELU adds it in fp32 and widens the product
    for its backward), GELU's output and the logits (their gradient
    written in their place rounded). The residual stream,
    LayerNorm statistics, softmax and loss stay fp32."""
    tr, (b, t) = model.transformer, idx.shape
    c = tr.wte.weight.shape[1]
    nh = model.config.n_head
    x = tr.wte.weight[idx] + tr.wpe.weight[:t]
    for blk in tr.h:
        a = Stored.apply(blk.ln_1(x), False)
        bias = Stored.apply(blk.attn.c_attn.bias, False)
        qkv = Stored.apply(Product.apply(a, blk.attn.c_attn.weight) + bias, True)
        q, k, v = (z.view(b, t, nh, c // nh).transpose(1, 2) for z in qkv.split(c, dim=2))
        y = Attention.apply(q, k, v, True, True).transpose(1, 2).reshape(b, t, c)
        y = Stored.apply(y, False)
        x = x + Product.apply(y, blk.attn.c_proj.weight) + blk.attn.c_proj.bias
        m = Stored.apply(blk.ln_2(x), False)
        fc = Stored.apply(Product.apply(m, blk.mlp.c_fc.weight), False)
        g = Stored.apply(torch.nn.functional.gelu(fc + blk.mlp.c_fc.bias, approximate="tanh"), False)
        x = x + Product.apply(g, blk.mlp.c_proj.weight) + blk.mlp.c_proj.bias
    f = Stored.apply(tr.ln_f(x), False)
    return Stored.apply(Product.apply(f, tr.wte.weight.T), True)


def bert_bf16_logits(model, ids):
    """A BERT masked LM's forward under `--precision bf16` (docs/backends.md):
    every matmul's operands rounded to bf16 and summed in fp32; held in
    bf16 as GPT-2's are, q|k|v (its bias rounded, the whole rounded once;
    its gradient held in bf16), the intermediate product before its bias
    and GELU's output; the rest fp32 (the embeddings, the attention's
    output, the LayerNorms, the head's transform and its logits, whose
    gradient is held in bf16, the decoder bias's summed from it)."""
    bert, (b, t) = model.bert, ids.shape
    c = bert.embeddings.word_embeddings.weight.shape[1]
    nh = model.config.num_attention_heads
    e = bert.embeddings
    x = e.LayerNorm(e.word_embeddings.weight[ids] + e.position_embeddings.weight[:t]
                    + e.token_type_embeddings.weight[0])
    for layer in bert.encoder.layer:
        att = layer.attention.self
        w = torch.cat([att.query.weight, att.key.weight, att.value.weight]).T
        bias = Stored.apply(torch.cat([att.query.bias, att.key.bias, att.value.bias]), False)
        qkv = Stored.apply(Product.apply(x, w) + bias, True)
        q, k, v = (z.view(b, t, nh, c // nh).transpose(1, 2) for z in qkv.split(c, dim=2))
        y = Attention.apply(q, k, v, False, False).transpose(1, 2).reshape(b, t, c)
        out = layer.attention.output
        h1 = out.LayerNorm(x + Product.apply(y, out.dense.weight.T) + out.dense.bias)
        inter = layer.intermediate.dense
        f = Stored.apply(Product.apply(h1, inter.weight.T), False)
        g = Stored.apply(torch.nn.functional.gelu(f + inter.bias), False)
        o = layer.output
        x = o.LayerNorm(h1 + Product.apply(g, o.dense.weight.T) + o.dense.bias)
    head = model.cls.predictions
    tr = head.transform
    t3 = tr.LayerNorm(torch.nn.functional.gelu(Product.apply(x, tr.dense.weight.T) + tr.dense.bias))
    return GradHeld.apply(Product.apply(t3, e.word_embeddings.weight.T) + head.bias)


def run_text(kind):
    """An earlier run's text (`kind`/text.txt): its sorted characters and
    its train and validation tokens, as `char_data` cut them."""
    with open(os.path.join(OUT, kind, "text.txt"), encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    tokens = [index[c] for c in text]
    n_val = int(len(tokens) * VAL_FRACTION)
    return chars, tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


def bf16_run(kind, src, model, loss_of, stream, val_batches):
    """The `src` run (its starting weights, text and hyper-parameters)
    under `--precision bf16`, into `kind`: fp32 master weights and AdamW,
    the forward and backward as `loss_of` rounds them; beside the run,
    its first step's gradient, tensor by tensor (`grad.<name>`, before
    clipping). No final weights: from the second step on, master weights
    a few ulps apart round to bf16 copies a bf16 step apart, which moves
    the losses by about 1e-4 (chaos, not a defect), so the test holds the
    first step tight and the rest to that envelope. `stream()` gives a
    fresh loader and its micro-batches; `val_batches()` the evaluation's."""
    with open(os.path.join(OUT, src, "run.json")) as f:
        h = dict(json.load(f), precision="bf16", init=src)
    out = fresh(kind)
    # the first step's gradient: its micro-batches' mean losses, each
    # weighed by its share of the step's targets
    _, micro = stream(h)
    micros = [micro(0) for _ in range(h["grad_accum"])]
    counts = [int((b["targets"] != IGNORE).sum()) for b in micros]
    for b, n in zip(micros, counts):
        (loss_of(b) * (n / sum(counts))).backward()
    grads = {f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loader, micro = stream(h)
    record, batches = train(model, h, micro, loss_of, loader.epochs)
    with torch.no_grad():
        losses = [loss_of(b).item() for b in val_batches(h)]
    ref = dict(tensors(record, batches), **grads)
    ref["val_loss"] = torch.tensor([sum(losses) / len(losses)])
    ref["val_examples"] = torch.tensor([len(losses) * h["batch_size"]], dtype=torch.int32)
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(h, f, indent=2)
        f.write("\n")
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    print(f"{kind}: val loss {ref['val_loss'].item():.6f} -> {out}")


def eval_batches(h, val):
    """The evaluation's windows of `val`: at most `eval_batches` batches."""
    return min(h["eval_batches"], val.n // h["batch_size"])


def lm_bf16():
    """The lm run under `--precision bf16` (`gpt2_bf16_logits`). Run after lm()."""
    _, train_tokens, val_tokens = run_text("lm")
    model = GPT2LMHeadModel.from_pretrained(os.path.join(OUT, "lm", "init")).float()

    def loss_of(b):
        logits = gpt2_bf16_logits(model, b["inputs"])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["targets"].reshape(-1))

    def stream(h):
        loader = Windows(train_tokens, h["batch_size"], h["seq_len"], h["seed"], True)
        return loader, lambda _step: dict(zip(("inputs", "targets"), loader.next()))

    def val_batches(h):
        val = Windows(val_tokens, h["batch_size"], h["seq_len"], h["seed"], False)
        return [dict(zip(("inputs", "targets"), val.next())) for _ in range(eval_batches(h, val))]

    bf16_run("lm_bf16", "lm", model, loss_of, stream, val_batches)


def mlm_micro(h, loader, mask_id, chars):
    """The masked LM's micro-batches from `loader`: each masked from the
    seed, the step and the loader's place before it takes the batch."""

    def micro(step):
        key = (((step + 1) * 0x9E3779B97F4A7C15) & M64) ^ ((loader.batch << 40) & M64)
        rng = Rng(h["seed"] ^ key)
        x, _ = loader.next()
        inputs, targets = mask_tokens(x, mask_id, chars, rng)
        return {"inputs": inputs, "targets": targets}

    return micro


def mlm_val(h, val_tokens, mask_id, chars):
    """The masked LM's evaluation batches: the validation windows in order,
    masked from seed ^ 0x5EED."""
    val = Windows(val_tokens, h["batch_size"], h["seq_len"], h["seed"], False)
    rng = Rng(h["seed"] ^ 0x5EED)
    out = []
    for _ in range(eval_batches(h, val)):
        inputs, targets = mask_tokens(val.next()[0], mask_id, chars, rng)
        out.append({"inputs": inputs, "targets": targets})
    return out


def mlm_bf16():
    """The mlm run under `--precision bf16` (`bert_bf16_logits`). Run after mlm()."""
    chars, train_tokens, val_tokens = run_text("mlm")
    mask_id = len(chars)
    model = BertForMaskedLM.from_pretrained(os.path.join(OUT, "mlm", "init")).float()

    def loss_of(b):
        logits = bert_bf16_logits(model, b["inputs"])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["targets"].reshape(-1).long())

    def stream(h):
        loader = Windows(train_tokens, h["batch_size"], h["seq_len"], h["seed"], True)
        return loader, mlm_micro(h, loader, mask_id, len(chars))

    bf16_run("mlm_bf16", "mlm", model, loss_of, stream, lambda h: mlm_val(h, val_tokens, mask_id, len(chars)))


def mlm():
    """A BERT masked LM on characters: 10 steps of 2 micro-batches of 4 x
    16, masks per micro-batch (so the two hold different numbers of
    targets, and weigh by them), into a second epoch."""
    out, chars, train_tokens, val_tokens = char_data("mlm", 650)
    mask_id = len(chars)
    h = dict(HYPER, task="mlm", data="text", batch_size=4, seq_len=16, grad_accum=2, steps=10)
    torch.manual_seed(21)
    cfg = BertConfig(vocab_size=len(chars) + 1, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=h["seq_len"], type_vocab_size=2,
                     hidden_act="gelu", layer_norm_eps=1e-12, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, initializer_range=0.1, attn_implementation="eager",
                     # characters have no [PAD]: id 0 is a character, whose
                     # embedding learns like any other's
                     pad_token_id=None)
    model = BertForMaskedLM(cfg).float()
    perturb(model, 22)
    model.save_pretrained(os.path.join(out, "init"), safe_serialization=True)
    loader = Windows(train_tokens, h["batch_size"], h["seq_len"], h["seed"], True)
    assert loader.n // h["batch_size"] < h["steps"] * h["grad_accum"], "the masks cross an epoch"

    micro = mlm_micro(h, loader, mask_id, len(chars))

    def loss_of(b):
        return model(input_ids=b["inputs"], labels=b["targets"].long()).loss

    record, batches = train(model, h, micro, loss_of, loader.epochs)
    counts = [int((b["targets"] != IGNORE).sum()) for b in batches]
    pairs = list(zip(counts[::2], counts[1::2]))
    assert any(a != b for a, b in pairs), "every step's micro-batches hold as many targets"
    print(f"  targets of each step's micro-batches: {pairs}")
    kept = sum(int(((b["inputs"] == b["targets"]) & (b["targets"] != IGNORE)).sum()) for b in batches)
    shown = sum(int((b["inputs"] == mask_id).sum()) for b in batches)
    print(f"  masked positions: {shown} [MASK], {kept} kept as they were")
    with torch.no_grad():
        losses = [loss_of(b).item() for b in mlm_val(h, val_tokens, mask_id, len(chars))]
    n = len(losses)
    ref = tensors(record, batches)
    ref["val_loss"] = torch.tensor([sum(losses) / n])
    ref["val_examples"] = torch.tensor([n * h["batch_size"]], dtype=torch.int32)
    save("mlm", model, h, ref)
    print(f"mlm: val loss {ref['val_loss'].item():.6f} -> {out}")


PRE_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "!", "?", "the", "a", "my", "thy", "and",
             "of", "to", "in", "is", "was", "not", "o", "king", "queen", "lord", "ship", "sea", "storm", "wind",
             "night", "day", "crown", "sword", "heart", "dream", "sail", "walk", "sing", "play", "cry", "sleep",
             "love", "fair", "dark", "cold", "##s", "##ed", "##ing"]
PRE_NOUNS = ["king", "queen", "lord", "ship", "sea", "storm", "wind", "night", "day", "crown", "sword", "heart",
             "dream"]
PRE_VERBS = ["sail", "walk", "sing", "play", "cry", "sleep", "love"]
PRE_SMALL = ["the", "a", "my", "thy", "and", "of", "to", "in", "is", "was", "not", "o", "fair", "dark", "cold"]


def pretrain_text(tok, rng, at_least):
    """Lines of words in PRE_VOCAB (some of two pieces: "sails", "walked",
    "singing"; some [UNK]: "zephyr"), until they are `at_least` tokens."""
    lines, count = [], 0
    while count < at_least:
        words = []
        for _ in range(4 + rng.below(6)):
            r = rng.below(10)
            if r < 4:
                words.append(PRE_SMALL[rng.below(len(PRE_SMALL))])
            elif r < 7:
                words.append(PRE_NOUNS[rng.below(len(PRE_NOUNS))] + ["", "s"][rng.below(2)])
            elif r < 9:
                words.append(PRE_VERBS[rng.below(len(PRE_VERBS))] + ["", "s", "ed", "ing"][rng.below(4)])
            else:
                words.append("zephyr")
            if rng.below(8) == 0:
                words[-1] += ","
        line = " ".join(words).capitalize() + ".!?"[rng.below(3)]
        lines.append(line)
        count += len(tok.tokenize(line))
    return "\n".join(lines) + "\n"


def pretrain():
    """BERT's pretraining (BertForPreTraining: masked LM and next-sentence
    prediction) on WordPiece tokens of a text, from a folder with its
    vocab.txt: 10 steps of 2 micro-batches of 4 x 16, into a second epoch.
    Each window of 16 tokens is cut at a drawn token into [CLS] A [SEP] B
    [SEP] (types 0 to A's [SEP], 1 after), B the tokens that follow A
    (label 0) or, half the time, as many from a place drawn in the split
    (label 1); then every token but [CLS] and [SEP] is open to masking.
    A step's loss: each micro-batch's masked-token mean weighed by its share
    of the step's masks, plus its next-sentence mean weighed by its share
    of the step's pairs."""
    out = fresh("pretrain")
    init = os.path.join(out, "init")
    h = dict(HYPER, task="pretrain", data="text", batch_size=4, seq_len=16, grad_accum=2, steps=10)
    model, vocab = bert_folder(init, BertForPreTraining, PRE_VOCAB, 41, 42,
                               max_position_embeddings=h["seq_len"], initializer_range=0.1)
    tok = BertTokenizer(vocab, do_lower_case=True)
    text = pretrain_text(tok, Rng(43), 1300)
    with open(os.path.join(out, "text.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    tokens = tok.convert_tokens_to_ids(tok.tokenize(text))
    assert tok.unk_token_id in tokens and any(t >= PRE_VOCAB.index("##s") for t in tokens)
    n_val = int(len(tokens) * VAL_FRACTION)
    train_tokens, val_tokens = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    cls, sep, mask_id, v = tok.cls_token_id, tok.sep_token_id, tok.mask_token_id, len(PRE_VOCAB)
    b, t = h["batch_size"], h["seq_len"]
    body = t - 3

    def random_run(split, n, rng):
        """n tokens from a place drawn in the split (data/loader.rs's Split::random_run)."""
        k = rng.below(len(split) + 1 - n)
        return split[k:k + n]

    def examples(x, split, rng):
        """The windows x (b, t) cut into pairs, then masked."""
        inputs, types, labels = [], [], []
        for w in x.tolist():
            k = 1 + rng.below(body - 1)
            if rng.below(2) == 0:
                second, label = w[k:body], 0
            else:
                second, label = random_run(split, body - k, rng), 1
            inputs.append([cls] + w[:k] + [sep] + second + [sep])
            types.append([0] * (k + 2) + [1] * (body - k + 1))
            labels.append(label)
        masked, targets = mask_tokens(torch.tensor(inputs), mask_id, v, rng, fixed=(cls, sep))
        return {"inputs": masked, "targets": targets, "types": torch.tensor(types),
                "seq_targets": torch.tensor(labels)}

    loader = Windows(train_tokens, b, t, h["seed"], True)
    assert loader.n // b < h["steps"] * h["grad_accum"], "the pairs cross an epoch"

    def micro(step):
        key = (((step + 1) * 0x9E3779B97F4A7C15) & M64) ^ ((loader.batch << 40) & M64)
        rng = Rng(h["seed"] ^ key)
        return examples(loader.next()[0], train_tokens, rng)

    def heads(bt):
        """The batch's masked-token and next-sentence mean losses, and the
        next-sentence logits."""
        res = model(input_ids=bt["inputs"], token_type_ids=bt["types"])
        f = torch.nn.functional
        mlm_loss = f.cross_entropy(res.prediction_logits.reshape(-1, v), bt["targets"].reshape(-1).long(),
                                   ignore_index=IGNORE)
        return mlm_loss, f.cross_entropy(res.seq_relationship_logits, bt["seq_targets"].long()), \
            res.seq_relationship_logits

    def masks(bt):
        return int((bt["targets"] != IGNORE).sum())

    def weighed(bt, micro_batches):
        mlm_loss, nsp_loss, _ = heads(bt)
        return mlm_loss * (masks(bt) / sum(masks(x) for x in micro_batches)) + \
            nsp_loss * (len(bt["seq_targets"]) / sum(len(x["seq_targets"]) for x in micro_batches))

    record, batches = train(model, h, micro, None, loader.epochs, weighed)
    counts = [masks(x) for x in batches]
    assert any(a != c for a, c in zip(counts[::2], counts[1::2])), "every step's micro-batches hold as many masks"
    labels = torch.cat([x["seq_targets"] for x in batches])
    print(f"  masks of each step's micro-batches: {list(zip(counts[::2], counts[1::2]))}; "
          f"{int(labels.sum())} of {len(labels)} pairs unrelated")
    val = Windows(val_tokens, b, t, h["seed"], False)
    rng = Rng(h["seed"] ^ 0x5EED)
    with torch.no_grad():
        n = min(h["eval_batches"], val.n // b)
        assert n == 2, "the validation loss is a mean over two batches"
        losses, pairs = [], []
        for _ in range(n):
            bt = examples(val.next()[0], val_tokens, rng)
            mlm_loss, nsp_loss, logits = heads(bt)
            losses.append(mlm_loss.item() + nsp_loss.item())
            pairs += list(zip(logits.argmax(-1).tolist(), bt["seq_targets"].tolist()))
    ref = tensors(record, batches)
    ref["val_loss"] = torch.tensor([sum(losses) / n])
    ref["val_examples"] = torch.tensor([n * b], dtype=torch.int32)
    right = sum(p == y for p, y in pairs)
    tp = sum(p == 1 and y == 1 for p, y in pairs)
    fp = sum(p == 1 and y == 0 for p, y in pairs)
    fn = sum(p == 0 and y == 1 for p, y in pairs)
    ref["val_right"] = torch.tensor([right, len(pairs)], dtype=torch.int32)
    ref["val_f1"] = torch.tensor([0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)])
    save("pretrain", model, h, ref, ["vocab.txt"])
    print(f"pretrain: val loss {ref['val_loss'].item():.6f}, next sentence {right} of {len(pairs)} right, "
          f"F1 {ref['val_f1'].item():.4f} -> {out}")


CLS_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "!", ",", ".", ":", "?", "a", "at", "cafe",
             "call", "cheap", "click", "for", "free", "here", "lunch", "me", "meeting", "money", "noon",
             "notes", "now", "offer", "pill", "##s", "re", "see", "the", "thanks", "today", "tomorrow",
             "un", "##subscribe", "win", "you", "your", "prize", "agenda", "minutes", "deal", "buy"]
CLS_TRAIN = [(1, "WIN free money now!!!"), (0, "Re: meeting at noon"),
             (0, "See you at the Caf\u00e9 for lunch, thanks for the notes today!"), (0, "Call me"),
             (1, "Click here to unsubscribe: cheap pills."), (1, "Free prize! Click now"),
             (0, "Agenda for tomorrow's meeting, see the minutes"), (1, "Cheap deal: buy pills here, win"),
             (0, "Thanks, lunch at the cafe?"), (1, "Your offer: free money, cheap pills, a prize for you now!")]
CLS_VAL = [(0, "Meeting notes for today"), (1, "Win a free deal now"), (0, "See you at noon"),
           (1, "Buy cheap, click here!"), (0, "Thanks for lunch")]
CLS_TEST = [(1, "Free money, click"), (0, "The agenda for the meeting"), (1, "Cheap pills: your prize"),
            (0, "Call me tomorrow at the cafe"), (0, "Notes: see the minutes"), (1, "Win now!!")]


def classify():
    """A BERT classifier fine-tuned on a labelled set: 6 steps of 4 x 12,
    two epochs of 3 batches, the last of each padded with ignored rows."""
    out = fresh("classify")
    init, data = os.path.join(out, "init"), os.path.join(out, "data")
    os.makedirs(data)
    h = dict(HYPER, task="classify", data="data", batch_size=4, seq_len=12, grad_accum=1, steps=6, lr=1e-3,
             min_lr=1e-4)
    model, vocab = bert_folder(init, BertForSequenceClassification, CLS_VOCAB, 31, 32,
                               max_position_embeddings=16, num_labels=2, initializer_range=0.2)
    with open(os.path.join(data, "labels.json"), "w") as f:
        json.dump(["ham", "spam"], f)
    for name, examples in {"train": CLS_TRAIN, "val": CLS_VAL, "test": CLS_TEST}.items():
        with open(os.path.join(data, f"{name}.jsonl"), "w") as f:
            for label, text in examples:
                f.write(json.dumps({"label": label, "text": text}, ensure_ascii=False) + "\n")
    tok = BertTokenizer(vocab, do_lower_case=True)
    b, t = h["batch_size"], h["seq_len"]

    def batches(examples, seed):
        order = list(range(len(examples)))
        if seed is not None:
            Rng(seed).shuffle(order)
        out = []
        for at in range(0, len(order), b):
            rows = [examples[i] for i in order[at:at + b]]
            enc = tok([text for _, text in rows], padding="max_length", truncation=True, max_length=t,
                      return_tensors="pt")
            ids, mask = enc["input_ids"], enc["attention_mask"]
            labels = torch.tensor([label for label, _ in rows])
            fill = b - len(rows)
            filler = torch.full((fill, t), tok.pad_token_id)
            filler[:, 0], filler[:, 1] = tok.cls_token_id, tok.sep_token_id
            out.append({"inputs": torch.cat([ids, filler]),
                        "lens": torch.cat([mask.sum(1), torch.full((fill,), 2)]),
                        "targets": torch.cat([labels, torch.full((fill,), IGNORE)])})
        return out

    per_epoch = -(-len(CLS_TRAIN) // b)
    assert len(CLS_TRAIN) % b != 0 and h["steps"] == 2 * per_epoch
    epochs = [batches(CLS_TRAIN, h["seed"] + e) for e in range(2)]
    assert not all(torch.equal(x["inputs"], y["inputs"]) for x, y in zip(*epochs)), "epochs in one order"

    def micro(step):
        return epochs[step // per_epoch][step % per_epoch]

    def attention(bt):
        return (torch.arange(t)[None, :] < bt["lens"][:, None]).long()

    def loss_of(bt):
        return model(input_ids=bt["inputs"], attention_mask=attention(bt), labels=bt["targets"].long()).loss

    taken = [0]

    def epoch():
        taken[0] += h["grad_accum"]
        whole = (taken[0] - 1) // per_epoch
        return whole + (taken[0] - whole * per_epoch) / per_epoch

    record, used = train(model, h, micro, loss_of, epoch)
    ref = tensors(record, used)
    with torch.no_grad():
        for split, examples in (("val", CLS_VAL), ("test", CLS_TEST)):
            pairs, loss_sum, terms = [], 0.0, 0
            for bt in batches(examples, None):
                res = model(input_ids=bt["inputs"], attention_mask=attention(bt), labels=bt["targets"].long())
                n = int((bt["targets"] != IGNORE).sum())
                loss_sum, terms = loss_sum + res.loss.item() * n, terms + n
                for row, target in zip(res.logits.argmax(-1).tolist(), bt["targets"].tolist()):
                    if target != IGNORE:
                        pairs.append((row, target))
            tp = sum(p == 1 and y == 1 for p, y in pairs)
            fp = sum(p == 1 and y == 0 for p, y in pairs)
            fn = sum(p == 0 and y == 1 for p, y in pairs)
            ref[f"{split}_loss"] = torch.tensor([loss_sum / terms])
            right = sum(p == y for p, y in pairs)
            ref[f"{split}_right"] = torch.tensor([right, len(pairs)], dtype=torch.int32)
            ref[f"{split}_f1"] = torch.tensor([0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)])
            print(f"  {split}: loss {loss_sum / terms:.6f}, {right} of {len(pairs)} right, F1 {ref[f'{split}_f1'].item():.4f}")
    save("classify", model, h, ref, ["vocab.txt"])
    print(f"classify -> {out}")


SOLILOQUY = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
             "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles")


def tensorboard_golden():
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    out = os.path.join(FIXTURES, "tensorboard")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "golden.tfevents")
    events = [event_pb2.Event(wall_time=1700000000.25, file_version="brain.Event:2")]
    scalars = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="train/loss", simple_value=2.5),
                                         summary_pb2.Summary.Value(tag="train/lr", simple_value=1e-3)])
    events.append(event_pb2.Event(wall_time=1700000001.5, step=3, summary=scalars))
    text = summary_pb2.Summary.Value(
        tag="sample", metadata=summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text")),
        tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[SOLILOQUY.encode()]))
    # a step and lengths past 127: varints of more than one byte
    events.append(event_pb2.Event(wall_time=1700000002.75, step=70000, summary=summary_pb2.Summary(value=[text])))
    events.append(event_pb2.Event(wall_time=1700000003.0, step=4,
                                  session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    with open(path, "wb") as f:
        w = RecordWriter(f)
        for ev in events:
            w.write(ev.SerializeToString())
        w.flush()
    print(f"tensorboard: {len(events)} events, {os.path.getsize(path)} bytes -> {path}")


def llmc_golden():
    out = os.path.join(FIXTURES, "llmc")
    os.makedirs(out, exist_ok=True)
    tokens = [(i * 7919) % 50257 for i in range(300)] + [0, 50256, 65535]
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    path = os.path.join(out, "golden_val_000000.bin")
    with open(path, "wb") as f:
        f.write(header.astype("<i4").tobytes())
        f.write(np.array(tokens, dtype="<u2").tobytes())
    print(f"llmc: {len(tokens)} tokens, {os.path.getsize(path)} bytes -> {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["lm", "lm_bf16", "mlm", "mlm_bf16", "pretrain", "classify", "llmc",
                                      "tensorboard"])
    a = p.parse_args()
    for name, make in (("lm", lm), ("lm_bf16", lm_bf16), ("mlm", mlm), ("mlm_bf16", mlm_bf16),
                       ("pretrain", pretrain), ("classify", classify), ("llmc", llmc_golden),
                       ("tensorboard", tensorboard_golden)):
        if a.only in (None, name):
            make()


if __name__ == "__main__":
    main()

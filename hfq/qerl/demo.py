"""The offline QeRL demo (what `hfq grpo` trains with no `--model`): its base model, a tiny Qwen2 with hfq's
character tokenizer briefly pre-trained on the bundled arithmetic word problems so it is right part of the time,
and its verdict, the rewards on held-out problems before vs after GRPO with their noise."""
from __future__ import annotations

DEMO_ARCH = dict(hidden=96, layers=3, heads=4, kv_heads=2, intermediate=192)
DEMO_PRETRAIN_STEPS = 100
DEMO_VERSION = "v1"  # bump when the recipe changes: it names the cache folder


def _pretrain_batch(tok, rows):
    import torch

    ps = [tok(r["prompt"]).input_ids for r in rows]
    cs = [tok(r["completion"]).input_ids + [tok.eos_token_id] for r in rows]
    T = max(len(p) + len(c) for p, c in zip(ps, cs))
    ids = torch.full((len(rows), T), tok.pad_token_id)
    lab = torch.full((len(rows), T), -100)
    att = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (p, c) in enumerate(zip(ps, cs)):
        x = p + c
        ids[b, :len(x)] = torch.tensor(x)
        att[b, :len(x)] = 1
        lab[b, len(p):len(x)] = torch.tensor(c)
    return ids, att, lab


def build_demo_base(cache_dir=None, steps: int = DEMO_PRETRAIN_STEPS, seed: int = 0, log=print) -> str:
    """The demo's base model (fp32 safetensors + tokenizer), deterministic for (steps, seed); built once and
    cached under `cache_dir` (default $HFQ_CACHE or ~/.cache/hfq)."""
    from pathlib import Path

    import torch
    from tqdm.auto import tqdm

    from hfq.models import cache_dir as default_cache_dir
    from hfq.tiny import char_tokenizer, tiny_model

    from .data import make_dataset

    out = Path(cache_dir or default_cache_dir()) / f"qerl_demo_base_{DEMO_VERSION}" / f"s{steps}_seed{seed}"
    if (out / "model.safetensors").exists() and (out / "DONE").exists():
        return str(out)
    log(f"[hfq grpo] building the demo base model in {out} ({steps} pre-training steps, one time)")
    tok = char_tokenizer()
    model = tiny_model("qwen2", seed=seed, **DEMO_ARCH).train()
    data = make_dataset(4000, seed=seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in tqdm(range(steps), desc="pre-train"):
        idx = torch.randint(0, len(data), (32,), generator=g).tolist()
        ids, att, lab = _pretrain_batch(tok, [data[i] for i in idx])
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    (out / "DONE").write_text("ok\n")
    return str(out)


def heldout_scores(model, tok, rows, samples: int = 2, max_new_tokens: int = 48, seed: int = 0,
                   batch: int = 100) -> dict[str, list[float]]:
    """The demo's two rewards on held-out `rows` (prompt + answer), each row's mean over `samples` answers
    sampled as in training (temperature 1): {"accuracy": [...], "format": [...], "reward": their sum}. Same seed before and after
    training, so the comparison is paired."""
    import torch

    from .rewards import accuracy_reward, format_reward

    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    out = {"accuracy": [], "format": []}
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        enc = tok([r["prompt"] for r in part], return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            gen = model.generate(**enc.to(next(model.parameters()).device), max_new_tokens=max_new_tokens,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=samples,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(gen[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        answers = [r["answer"] for r in part for _ in range(samples)]
        for key, score in (("accuracy", accuracy_reward(texts, answer=answers)), ("format", format_reward(texts))):
            out[key] += [sum(score[j:j + samples]) / samples for j in range(0, len(score), samples)]
    model.train(was_training)
    out["reward"] = [a + f for a, f in zip(out["accuracy"], out["format"])]
    return out


def two_se(xs: list[float]) -> float:
    """Two standard errors of the mean of `xs`."""
    n = len(xs)
    m = sum(xs) / n
    return 2 * (sum((x - m) ** 2 for x in xs) / max(n - 1, 1) / n) ** 0.5


def verdict(before: list[float], after: list[float]) -> tuple[float, float, str]:
    """Paired change in held-out accuracy, its noise (two standard errors of the mean paired difference) and a
    one-word reading: "improved" / "got worse" only when the change exceeds that noise."""
    n = len(before)
    if n != len(after) or n < 2:
        raise ValueError(f"verdict: needs two equal-length score lists of >= 2 prompts, got {n} and {len(after)}")
    d = [a - b for a, b in zip(after, before)]
    mean, noise = sum(d) / n, two_se(d)
    word = "improved" if mean > noise else "got worse" if mean < -noise else "no change beyond noise"
    return mean, noise, word

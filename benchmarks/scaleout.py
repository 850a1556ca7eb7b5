"""Scaling table (issue 30): tokens/s and peak memory per GPU of qerl / eco / qft / quest on 1 and 2 GPUs, under
DDP and FSDP2, one process per GPU through `accelerate launch` with the configs in examples/accelerate.

The driver launches one job per row, each under a time cap, and merges the json part its rank 0 writes into
`benchmarks/results/scaleout.{json,md}`. World-1 jobs run two at a time, each on its own GPU; world-2 jobs one at
a time. Every job builds its random-init model layer by layer (meta device, one BF16 layer materialised, converted
to the method's format), warms up (Triton autotuning, optimizer states, CUDA graphs) and then times `--rounds`
windows of steps; tokens/s is the median over windows, the spread their min-max.

  python benchmarks/scaleout.py                                  # the whole table, one device call on 2 GPUs
  python benchmarks/scaleout.py --only qft,eco --budget-s 300    # some methods
  python benchmarks/scaleout.py --append --jobs qerl:ddp:1:qwen2.5-32b,qerl:ddp:2:qwen2.5-32b   # a second call
  python benchmarks/scaleout.py --tiny --out /tmp/so             # CPU: tiny shapes, gloo, 2 processes
On CPU accelerate runs DDP but not FSDP, so --tiny starts FSDP2 jobs with torchrun; the sharding is the same
`fully_shard` per decoder layer and the root that fsdp2.yaml's TRANSFORMER_BASED_WRAP applies.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from _harness import add_args, ratio, run_facts, spread, write  # noqa: E402

CONFIGS = os.path.join(ROOT, "examples", "accelerate")
SHAPES = {  # Qwen2.5 shapes (random init); the tiny ones stand in for them on CPU
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    "tiny-big": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256),
}
TINY = {"qwen2.5-7b": "tiny", "qwen2.5-32b": "tiny-big"}
# (method, strategy, world, shape, batch; None: --batch / --qerl-batch): the world-1 rows (one process, no wrapper)
# are each method's one-GPU baseline, for FSDP2 as well (FSDP2 on one GPU shards nothing)
JOBS = [(m, "ddp", w, "qwen2.5-7b", None) for w in (1, 2) for m in ("qerl", "eco", "qft", "quest")] + \
       [(m, "fsdp2", 2, "qwen2.5-7b", None) for m in ("eco", "qft")] + [("qft", "fsdp2", 2, "qwen2.5-32b", None)]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GIB = 2 ** 30


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ----------------------------------------------------------------------------------------------- worker: model
def qwen_config(shape: str, layers: int | None):
    from transformers import Qwen2Config

    dims = dict(SHAPES[shape])
    if layers:
        dims["num_hidden_layers"] = layers
    return Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, **dims)


def _init_(mod, gen):
    with torch.no_grad():
        for n, p in mod.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.zero_()


def convert_layer(method: str, layer) -> None:
    """A decoder layer's linears in the method's format: NVFP4 (qerl), FP8 QParams (eco), INT8 dense+sparse QParams
    with INT8 gradients (qft); QuEST converts the whole model afterwards (finish_model)."""
    if method == "qerl":
        from hfq.nvfp4 import NVFP4Linear

        for parent in (layer.self_attn, layer.mlp):
            for n in LORA_TARGETS:
                if hasattr(parent, n):
                    setattr(parent, n, NVFP4Linear.from_linear(getattr(parent, n)))
    elif method in ("eco", "qft"):
        from hfq.qft import QFTConfig, convert_linears_

        convert_linears_(layer, QFTConfig(weight_format="fp8_e4m3_row") if method == "eco" else
                         QFTConfig(gradient_bits=8))


def finish_model(method: str, model, dtype):
    """What needs the whole model: QuEST's conversion, QFT's layer names and DDP-ignore list, QeRL's LoRA."""
    if method == "quest":
        from hfq.quest import QuESTConfig, quantize_model

        return quantize_model(model, QuESTConfig(weight_bits=4, activation_bits=4))
    if method == "qft":
        from hfq.qft import QFTLinear, ddp_ignore_int8_grad_weights_

        for n, m in model.named_modules():
            if isinstance(m, QFTLinear):
                m.qft_name = n
        ddp_ignore_int8_grad_weights_(model)
    if method == "qerl":
        from peft import LoraConfig

        from hfq.nvfp4 import get_peft_model, mark_ddp_ignore
        from qerl_step import add_fused_lm_head

        if add_fused_lm_head is not None:  # as GRPOTrainer does, before PEFT wraps the model
            add_fused_lm_head(model, temperature=1.0)
        model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                                 task_type="CAUSAL_LM"))
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(dtype)
        mark_ddp_ignore(model)
    return model


def build(method: str, shape: str, layers: int | None, dev, dtype):
    """The random-init model on `dev`, built from the meta device one decoder layer at a time (the BF16 model never
    exists whole beside its converted copy). Returns (model, parameter count of the BF16 model)."""
    from transformers import AutoModelForCausalLM

    cfg = qwen_config(shape, layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator(device=dev).manual_seed(0)
    for mod in (model.model.embed_tokens, model.model.norm, model.lm_head):
        mod.to_empty(device=dev)
        _init_(mod, gen)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg, device=dev)
    t0, n = time.perf_counter(), len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.to_empty(device=dev)
        _init_(layer, gen)
        convert_layer(method, layer)
        if (i + 1) % 16 == 0 or i + 1 == n:
            log(f"built {i + 1}/{n} layers in {time.perf_counter() - t0:.0f} s")
    model = finish_model(method, model, dtype)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return model, n_params


def shard_(model) -> None:
    """FSDP2 as examples/accelerate/fsdp2.yaml applies it: `fully_shard` on every decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if type(m).__name__.endswith("DecoderLayer"):
            fully_shard(m)
    fully_shard(model)


def make_optimizer(method: str, model, cuda: bool):

    params = [p for p in model.parameters() if p.requires_grad]
    if method == "eco":  # bf16 states: fp32 ones (8 B/param) would not leave room for a 7B's gradients on 80 GB
        from hfq.eco import ECOAdamW
        return ECOAdamW(params, lr=1e-5, weight_decay=0.0, state_dtype=torch.bfloat16, seed=3)
    if method == "qft":
        from hfq.qft import QLion
        return QLion(params, lr=1e-5, seed=3)
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=cuda)


# ----------------------------------------------------------------------------------------------- worker: steps
class Dist:
    """The process group of a job. DDP: accelerate's Accelerator (as Trainer uses it), which wraps the model in
    DistributedDataParallel. FSDP2: the process group from the launcher's environment and `shard_`."""

    def __init__(self, strategy: str):
        self.strategy, self.acc = strategy, None
        cuda = torch.cuda.is_available()
        if strategy == "ddp":
            from accelerate import Accelerator, DistributedDataParallelKwargs

            self.acc = Accelerator(cpu=not cuda,
                                   kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
            self.device, self.rank, self.world = self.acc.device, self.acc.process_index, self.acc.num_processes
        else:
            for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                         ("MASTER_PORT", str(_free_port()))):
                os.environ.setdefault(k, v)
            local = int(os.environ["LOCAL_RANK"])
            self.device = torch.device("cuda", local) if cuda else torch.device("cpu")
            if cuda:
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if cuda else "gloo", device_id=self.device if cuda else None)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def wrap(self, model):
        """DDP: accelerate's prepare (with one process: the model as it is, the one-GPU baseline; accelerate would
        wrap it on CPU). FSDP2: `shard_`."""
        if self.strategy == "ddp":
            return self.acc.prepare(model) if self.world > 1 else model
        shard_(model)
        return model

    def backward(self, loss):
        self.acc.backward(loss) if self.acc is not None else loss.backward()

    def no_sync(self, model, last: bool):
        """Gradient accumulation: DDP all-reduces on the last micro-batch only (accelerate's `no_sync`)."""
        if self.acc is not None and not last:
            return self.acc.no_sync(model)
        return contextlib.nullcontext()

    def max(self, x: float) -> float:
        if not (dist.is_available() and dist.is_initialized()) or self.world == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def close(self):
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def train_step_fn(model, opt, d: Dist, a, vocab):
    """One optimizer step on `a.batch` sequences of `a.seq` tokens per rank; returns the tokens it trained per rank."""

    g = torch.Generator().manual_seed(1000 + d.rank)
    ids = torch.randint(3, vocab, (a.batch, a.seq), generator=g).to(d.device)

    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        d.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return a.batch * a.seq

    return step


def qerl_step_fn(model, inner, opt, d: Dist, a, vocab):
    """One GRPO step as benchmarks/qerl_step.py times it: AQN on, rollout of `a.batch` x `a.new` tokens by hfq's
    engine on this rank's own prompts, rewards, old log-probs, then the update in micro-batches of one sequence
    (DDP all-reduces the LoRA gradients once, on the last). Returns the completion tokens generated per rank."""

    from hfq.qerl.aqn import AQNSchedule, AdaptiveQuantizationNoise
    from hfq.qerl.rewards import accuracy_reward, format_reward
    from hfq.rollout import RolloutEngine
    from qerl_step import per_token_logps

    aqn, sigma = AdaptiveQuantizationNoise(inner, seed=0), AQNSchedule().stage_sigma(1)
    engine = RolloutEngine(inner, max_batch=a.batch, max_seq_len=a.prompt + a.new)
    engine.warmup(a.batch, a.prompt, a.new, temperature=1.0)
    ids = torch.randint(3, vocab, (a.batch, a.prompt), generator=torch.Generator().manual_seed(d.rank)).to(d.device)
    it = [0]

    def step():
        inner.eval()
        with aqn.noisy(it[0], sigma):
            comp = engine.generate(ids, max_new_tokens=a.new, temperature=1.0, eos_token_ids=[],
                                   seed=it[0] * d.world + d.rank).completion_ids.to(d.device)
        it[0] += 1
        texts = ["<think>" + " ".join(map(str, r[:8].tolist())) + "</think><answer>1</answer>" for r in comp.cpu()]
        rewards = torch.tensor([x + y for x, y in zip(accuracy_reward(texts, answer=["1"] * a.batch),
                                                      format_reward(texts))], device=d.device)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        full = torch.cat([ids, comp], 1)
        with torch.no_grad():
            old = torch.cat([per_token_logps(inner, full[i:i + 1], a.new) for i in range(a.batch)])
        inner.train()
        for i in range(a.batch):
            with d.no_sync(model, last=i == a.batch - 1):
                r = torch.exp(per_token_logps(model, full[i:i + 1], a.new) - old[i:i + 1])
                d.backward(-(torch.minimum(r * adv[i], r.clamp(0.8, 1.28) * adv[i])).mean() / a.batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return a.batch * a.new

    return step


def worker(a) -> None:
    """One row: build, wrap, warm up, time `a.rounds` windows of `a.steps` steps; rank 0 writes the part."""

    open(os.path.join(a.parts, f"{a.job}.pid.{os.getpid()}"), "w").close()  # torchrun's workers: own sessions
    d = Dist(a.strategy)
    cuda = d.device.type == "cuda"
    # FSDP2 wants one dtype per sharded module, and ECO / QFT weights are bf16 QParams
    dtype = torch.bfloat16 if cuda or (a.strategy == "fsdp2" and a.method in ("eco", "qft")) else torch.float32
    part = dict(method=a.method, strategy=a.strategy, world=d.world, model=a.model + (f" ({a.layers} layers)"
                                                                                      if a.layers else ""),
                batch=a.batch)
    try:
        if a.method == "qerl" and a.strategy != "ddp":
            raise ValueError("qerl runs under DDP only (QeRLGRPOTrainer refuses FSDP/FSDP2)")
        with torch.device(d.device):
            model, n_params = build(a.method, a.model, a.layers, d.device, dtype)
        part.update(params_b=round(n_params / 1e9, 3), params=n_params)
        if cuda:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        inner = model
        model = d.wrap(model)
        part["wrapper"] = type(model).__name__
        opt = make_optimizer(a.method, model, cuda)
        vocab = inner.config.vocab_size
        step = (qerl_step_fn(model, inner, opt, d, a, vocab) if a.method == "qerl" else
                train_step_fn(model, opt, d, a, vocab))
        for _ in range(a.warmup):
            step()
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        log(f"{a.job}: {a.warmup} warm-up steps done")
        if cuda:  # build and warm-up (the 32B's unsharded layers, autotuning) apart from the timed steps
            part["build_warmup_peak_gb"] = round(d.max(torch.cuda.max_memory_allocated() / GIB), 2)
            torch.cuda.reset_peak_memory_stats()
        times, tokens = [], 0
        for _ in range(a.rounds):
            d.max(0.0)  # every rank starts the window together
            sync()
            t0 = time.perf_counter()
            tokens = sum(step() for _ in range(a.steps)) * d.world
            sync()
            times.append(d.max(time.perf_counter() - t0))
        s = spread([t / tokens for t in times])
        tps = sorted(tokens / t for t in times)
        part.update(tokens_per_s=round(1 / s["median"], 1), tokens_per_s_min=round(tps[0], 1),
                    tokens_per_s_max=round(tps[-1], 1), spread=round(s["spread"], 3),
                    step_s=round(s["median"] * tokens / a.steps, 3), windows=a.rounds, steps_per_window=a.steps,
                    tokens_per_step=tokens // a.steps, s_per_token=s, status="ok")
        if a.profile:
            profile_step(step, d, os.path.join(a.parts, f"{a.job}.profile.txt"))
        if cuda:
            part["peak_gb_per_gpu"] = round(d.max(torch.cuda.max_memory_allocated() / GIB), 2)
            part["peak_reserved_gb_per_gpu"] = round(d.max(torch.cuda.max_memory_reserved() / GIB), 2)
            if a.strategy == "ddp":  # every rank holds the whole model: the size one GPU's memory would hold
                total = torch.cuda.get_device_properties(d.device).total_memory / GIB
                part["ddp_fits_up_to_b"] = round(n_params / 1e9 * total / part["peak_reserved_gb_per_gpu"], 1)
    except Exception as e:  # noqa: BLE001 - the row says why; the driver goes on with the next job
        traceback.print_exc()
        part.update(status=f"failed: {type(e).__name__}: {str(e)[:400]}")
        # every failing rank leaves its reason and leaves at once (the others may never reach a collective)
        _dump(part, os.path.join(a.parts, f"{a.job}.json" if d.rank == 0 else f"{a.job}.rank{d.rank}.json"))
        sys.stdout.flush()
        os._exit(1)
    if d.rank == 0:
        _dump(part, os.path.join(a.parts, f"{a.job}.json"))
    d.close()


def profile_step(step, d, path):
    """One step under torch.profiler, then one under cProfile; rank 0 writes the ops by device time and by host
    time, and the Python functions by own host time (where a host-bound step spends it)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    py = cProfile.Profile()
    py.enable()
    step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    py.disable()
    if d.rank == 0:
        prof.export_chrome_trace(path.replace(".txt", ".trace.json"))
        ka = prof.key_averages()
        with open(path, "w") as f:
            if torch.cuda.is_available():
                f.write(ka.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70) + "\n")
            f.write(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70) + "\n")
            text = io.StringIO()
            pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(40)
            pstats.Stats(py, stream=text).sort_stats("cumtime").print_stats(60)
            f.write(text.getvalue())


def _dump(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


# ----------------------------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_job(spec: str):
    """method:strategy:world[:shape][@batch], e.g. quest:fsdp2:2, qft:fsdp2:2:qwen2.5-32b or qft:ddp:2@4."""
    spec, _, b = spec.partition("@")
    f = spec.split(":")
    if len(f) not in (3, 4) or f[0] not in ("qerl", "eco", "qft", "quest") or f[1] not in ("ddp", "fsdp2") \
            or f[2] not in ("1", "2") or (len(f) == 4 and f[3] not in TINY) or (b and not b.isdigit()):
        raise SystemExit(f"--jobs: {spec!r} is not method:strategy:world[:shape][@batch] with method in "
                         f"qerl/eco/qft/quest, strategy ddp/fsdp2, world 1/2, shape in {sorted(TINY)}, batch a "
                         "positive integer")
    return f[0], f[1], int(f[2]), f[3] if len(f) == 4 else "qwen2.5-7b", int(b) if b else None


def job_id(method, strategy, world, shape, batch) -> str:
    return f"{method}_{strategy}_w{world}_{shape}_b{batch}"


def _batch(method: str, a) -> int:
    """The default sequences per rank per optimizer step (qerl: prompts per rank per GRPO step)."""
    return a.qerl_batch if method == "qerl" else a.batch


def command(job, a, cuda: bool) -> list[str]:
    """`accelerate launch` with the job's config; FSDP2 on CPU through torchrun (accelerate runs FSDP on GPUs only)."""
    method, strategy, world, shape, batch = job
    model = TINY[shape] if a.tiny else shape
    args = [os.path.abspath(__file__), "--worker", "--job", job_id(*job), "--method", method, "--strategy", strategy,
            "--model", model, "--parts", a.parts, "--rounds", str(a.rounds),
            "--warmup", str(a.qerl_warmup_steps if method == "qerl" else a.warmup_steps),
            "--steps", str(a.qerl_steps if method == "qerl" else 1 if "32b" in shape else a.train_steps), "--batch",
            str(batch), "--seq", str(a.seq), "--prompt", str(a.prompt),
            "--new", str(a.new)] + (["--layers", str(a.layers)] if a.layers else []) \
        + (["--profile"] if a.profile else [])
    port = str(_free_port())
    if strategy == "fsdp2" and not cuda:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", port]\
            + args
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            os.path.join(CONFIGS, f"{strategy}.yaml"), "--num_processes", str(world), "--main_process_port", port] + args


def collect(job, rc, log_path, a) -> dict:
    """The job's row: rank 0's part, else a failing rank's, else the exit status and the log's last lines."""
    jid = job_id(*job)
    for name in [f"{jid}.json"] + sorted(f for f in os.listdir(a.parts) if f.startswith(f"{jid}.rank")):
        p = os.path.join(a.parts, name)
        if os.path.exists(p):
            with open(p) as f:
                return json.load(f)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-600:].replace("\n", " | ")
    why = "stopped at its cap or the budget's end" if rc is None else f"exit {rc}"
    return dict(method=job[0], strategy=job[1], world=job[2], model=TINY[job[3]] if a.tiny else job[3],
                batch=job[4], status=f"failed: {why}: {tail}")


def stop(p, job, a) -> None:
    """End a job: SIGTERM to the launcher's process group (torchrun passes it on), SIGKILL after 10 s, then SIGKILL
    to every worker that wrote its pid (torchrun starts workers in sessions of their own)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        try:
            p.wait(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue
    for f in os.listdir(a.parts):
        if f.startswith(job_id(*job) + ".pid."):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(f.rsplit(".", 1)[1]), signal.SIGKILL)


def run_jobs(jobs, a, cuda: bool, gpus: int) -> list[dict]:
    """World-1 jobs `gpus` at a time (one GPU each), then the others one at a time; each stopped after its cap or at
    the end of the budget, whichever comes first (its row then says so)."""
    rows, t_start = {}, time.time()
    slots = [str(i) for i in range(gpus)] if cuda and gpus > 1 else [None]
    queue = [j for j in jobs if j[2] == 1] + [j for j in jobs if j[2] > 1]
    running = []  # (job, Popen, slot, start, log path, log file)
    while queue or running:
        for r in list(running):
            job, p, slot, t0, lp, lf = r
            cap = a.job_cap_32b_s if "32b" in job[3] else a.job_cap_s
            done = [f for f in os.listdir(a.parts) if f.startswith(job_id(*job) + ".") and f.endswith(".json")]
            if done and p.poll() is None:  # a rank wrote its part (done or failed): the others get 10 s to finish
                cap = min(cap, os.path.getmtime(os.path.join(a.parts, done[0])) - t0 + 10)
            cap = min(cap, t_start + a.budget_s - t0)  # the driver's budget ends every job with it
            if p.poll() is None and time.time() - t0 < cap:
                continue
            rc = p.poll()
            if rc is None:
                stop(p, job, a)
            lf.close()
            rows[job] = collect(job, rc, lp, a)
            log(job_id(*job), f"{time.time() - t0:.0f}s", rows[job].get("status"), rows[job].get("tokens_per_s"))
            running.remove(r)
        free = [s for s in slots if s not in {r[2] for r in running}]
        if queue and time.time() - t_start > a.budget_s - 30:
            job = queue.pop(0)
            rows[job] = dict(method=job[0], strategy=job[1], world=job[2], model=job[3], batch=job[4],
                             status=f"skipped: the driver's budget ({a.budget_s:.0f} s) was (nearly) spent")
            continue
        if queue and (not running if queue[0][2] > 1 else free):
            job = queue.pop(0)
            slot = free[0] if job[2] == 1 else None
            env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false",
                       PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
            if slot is not None:
                env["CUDA_VISIBLE_DEVICES"] = slot
            if not cuda:
                env.update(OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
            for f in os.listdir(a.parts):  # an earlier run's parts of this job
                if f.startswith(job_id(*job) + "."):
                    os.remove(os.path.join(a.parts, f))
            lp = os.path.join(a.parts, f"{job_id(*job)}.log")
            lf = open(lp, "w")
            p = subprocess.Popen(command(job, a, cuda), env=env, stdout=lf, stderr=subprocess.STDOUT,
                                 start_new_session=True, cwd=ROOT)
            running.append((job, p, slot, time.time(), lp, lf))
            log("started", job_id(*job), f"gpu {slot}" if slot is not None else "")
            continue
        time.sleep(0.5)
    return [rows[j] for j in jobs]


def _call(facts: dict) -> str:
    """A row's `call`: the date and commit of the device call that measured it."""
    return " ".join(str(x) for x in (facts.get("date"), facts.get("commit")) if x)


def _call_date(r) -> str:
    return (r.get("call") or "")[:20]  # the "YYYY-MM-DD HH:MM UTC" part of `_call`


def add_scaling(rows) -> None:
    """x_world1: a world-2 row's tokens/s over the world-1 row of its method, model, batch and card measured in the same
    device call (same strategy if measured, else DDP's, which is one process without a wrapper), with the range the
    windows allow; rows without such a baseline get none (hosts of one card type differ by up to 1.5x)."""
    ok = {(r["method"], r["strategy"], r["world"], r["model"], r.get("batch"), r.get("card"), _call_date(r)): r
          for r in rows if r.get("status") == "ok"}
    for r in rows:
        for k in ("x_world1", "x_world1_range", "x_world1_of"):
            r.pop(k, None)
        if r.get("status") != "ok" or r["world"] == 1:
            continue
        c, when, b = r.get("card"), _call_date(r), r.get("batch")
        base = (ok.get((r["method"], r["strategy"], 1, r["model"], b, c, when))
                or ok.get((r["method"], "ddp", 1, r["model"], b, c, when)))
        if base:
            q = ratio(base["s_per_token"], r["s_per_token"])
            r.update(x_world1=round(q["ratio"], 3), x_world1_range=f"{q['ratio_min']:.2f}-{q['ratio_max']:.2f}",
                     x_world1_of=f"{base['strategy']} w1")


DRIVER_SETTINGS = ("tiny", "rounds", "warmup_steps", "qerl_warmup_steps", "train_steps", "qerl_steps", "batch", "seq", "qerl_batch",
                   "prompt", "new", "layers", "budget_s", "job_cap_s", "job_cap_32b_s")
COLUMNS = ["method", "strategy", "world", "model", "batch", "params_b", "tokens_per_s", "spread", "tokens_per_s_min",
           "tokens_per_s_max", "x_world1", "x_world1_range", "peak_gb_per_gpu", "ddp_fits_up_to_b", "step_s", "card",
           "call", "status"]


def notes(a, gpus: int) -> str:
    return "\n".join([
        "card: the GPU each row ran on; call: the device call (date, commit) that measured it; x_world1 compares rows "
        "of one call only.",
        f"tokens_per_s: all ranks together; eco / qft / quest: tokens trained (batch sequences of {a.seq} tokens per "
        f"rank per optimizer step, in one forward); qerl: completion tokens generated per GRPO step (batch prompts "
        f"of {a.prompt} tokens x {a.new} new per rank, AQN on, hfq RolloutEngine; the step also scores and trains "
        "them in micro-batches of one sequence). Median over windows, spread = (max - min) / median over the windows.",
        f"Each row: its own `accelerate launch` ({'NCCL' if gpus else 'gloo, CPU; FSDP2 rows under torchrun'}), "
        f"{a.warmup_steps} untimed warm-up steps (qerl: {a.qerl_warmup_steps}, after the rollout engine's CUDA "
        "graph capture; autotuning, optimizer states), then "
        f"{a.rounds} timed windows of {a.train_steps} steps (qerl: {a.qerl_steps})"
        + ("; gradient checkpointing on; world-1 rows ran side by side, one per GPU." if gpus else "."),
        "Optimizers: eco ECOAdamW (FP8 row weights, bf16 states, SR), qft QLion (INT8 dense+sparse weights, INT8 "
        "gradients and momentum), quest QuEST W4A4 + AdamW (master weights in the model dtype: bf16 on GPU), qerl AdamW on LoRA r=32.",
        "x_world1: tokens/s over the world-1 row of the same method, model and batch (range: worst to best window "
        "pairing). peak_gb_per_gpu: max over ranks of torch.cuda.max_memory_allocated in the timed windows (GiB; "
        "peak_reserved_gb_per_gpu and build_warmup_peak_gb in the json).",
        "ddp_fits_up_to_b: under DDP every rank holds the whole model, so the parameter count (B) whose run would "
        "fill one GPU, extrapolated linearly from the row's reserved peak (embeddings, KV cache and activations do "
        "not scale exactly with it: a guide, measure the size itself with --jobs ...:qwen2.5-32b --append).",
        "qerl under DDP: every rank holds the whole NVFP4 policy and rolls out its own prompts; FSDP2 is refused "
        "by QeRLGRPOTrainer.",
    ])


def merge(name: str, rows: list, out: str | None) -> tuple[list, list]:
    """The earlier call's rows (from <out or benchmarks/results>/<name>.json) with this call's replacing those of
    the same method, strategy, world, model, batch and card; each earlier row keeps the facts of its call (rows
    from before the batch column: the batch of that call's settings)."""
    from _harness import RESULTS

    path = os.path.join(out or RESULTS, f"{name}.json")
    if not os.path.exists(path):
        path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        raise SystemExit(f"--append: no earlier {name}.json in {out or RESULTS} or {RESULTS}")
    with open(path) as f:
        old = json.load(f)
    key = lambda r: (r["method"], r["strategy"], r["world"], r["model"], r.get("batch"), r.get("card"))  # noqa: E731
    new = {key(r) for r in rows}
    was = old.get("settings", {})
    old_rows = [dict(r, call=r.get("call", _call(old["facts"])), card=r.get("card", old["facts"].get("card")),
                     batch=r.get("batch", was.get("qerl_batch" if r["method"] == "qerl" else "batch")))
                for r in old["rows"]]
    kept = [r for r in old_rows if key(r) not in new]
    return kept + rows, old.get("earlier_calls", []) + [old["facts"]]


def driver(a) -> None:
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    a.out = a.out or os.environ.get("OUT")
    a.parts = os.path.abspath(a.parts or os.path.join(a.out or "/tmp", "scaleout_parts"))
    os.makedirs(a.parts, exist_ok=True)
    only = set(a.only.split(",")) if a.only else None
    jobs = [parse_job(j) for j in a.jobs.split(",")] if a.jobs else JOBS
    jobs = [j[:4] + (j[4] or _batch(j[0], a),) for j in jobs]
    jobs = [j for j in jobs if (only is None or j[0] in only) and (a.with_32b or "32b" not in j[3])
            and (cuda and gpus >= j[2] or not cuda)]
    log(f"{len(jobs)} jobs on {'%d GPUs' % gpus if cuda else 'CPU'}; parts in {a.parts}")
    rows = run_jobs(jobs, a, cuda, gpus)
    name, facts = "scaleout" + ("_tiny" if a.tiny else ""), run_facts()
    extra = dict(settings={k: v for k, v in vars(a).items() if k in DRIVER_SETTINGS})
    for r in rows:
        r["card"] = facts.get("card")
        r["call"] = _call(facts)
    if a.append:
        rows, extra["earlier_calls"] = merge(name, rows, a.out)
    add_scaling(rows)
    write(name, rows, COLUMNS, notes(a, gpus) + ("\nRows from earlier device calls: see earlier_calls in the json."
                                                  if a.append else ""), out_dir=a.out, facts=facts, extra=extra,
          title="Scaling: tokens/s and peak memory per GPU, 1 and 2 GPUs, DDP and FSDP2")
    for r in rows:
        log({k: r.get(k) for k in COLUMNS})


def main():
    ap = add_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--tiny", action="store_true", help="CPU: tiny shapes and lengths, 2 gloo processes")
    ap.add_argument("--only", default=None, help="comma-separated methods (qerl,eco,qft,quest)")
    ap.add_argument("--append", action="store_true", help="merge the rows into the existing scaleout.json (a second "
                    "device call: rows of the same method, strategy, world, model, batch and card are replaced)")
    ap.add_argument("--jobs", default=None, help="rows instead of the table's, e.g. quest:fsdp2:2,"
                    "qft:fsdp2:2:qwen2.5-32b,qft:ddp:2@4 (@: sequences per rank per step; default --batch)")
    ap.add_argument("--no-32b", dest="with_32b", action="store_false", help="leave out the 32B FSDP2 row")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole run's limit (default 520 s, --tiny 1800): "
                    "no job starts in its last 30 s, running ones are stopped at its end")
    ap.add_argument("--job-cap-s", type=float, default=None, help="a 7B job is stopped after this many seconds "
                    "(default 180, --tiny 240)")
    ap.add_argument("--job-cap-32b-s", type=float, default=None, help="the same for a 32B job (default 240)")
    ap.add_argument("--parts", default=None, help="where jobs write their parts and logs (default OUT/scaleout_parts)")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=2,
                    help="optimizer steps per timed window (eco/qft/quest; 32B rows: 1)")
    ap.add_argument("--qerl-steps", type=int, default=1, help="GRPO steps per timed window")
    ap.add_argument("--qerl-warmup-steps", type=int, default=1,
                    help="untimed GRPO steps (the rollout engine's CUDA graphs are captured before them)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per optimizer step (eco/qft/quest)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--qerl-batch", type=int, default=8, help="prompts per rank per GRPO step")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256, help="completion tokens per prompt (qerl)")
    ap.add_argument("--layers", type=int, default=None, help="override every shape's decoder layer count")
    ap.add_argument("--profile", action="store_true", help="after the timed windows, one more step under "
                    "torch.profiler; rank 0 writes the top kernels and host ops to PARTS/<job>.profile.txt")
    # worker side (set by the driver)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny and not a.worker:
        a.seq, a.prompt, a.new, a.qerl_batch, a.batch = 32, 8, 8, 2, 2
    for k, gpu, cpu in (("budget_s", 520, 1800), ("job_cap_s", 180, 240), ("job_cap_32b_s", 240, 240)):
        if getattr(a, k) is None:
            setattr(a, k, cpu if a.tiny else gpu)
    if a.worker:
        return worker(a)
    return driver(a)


if __name__ == "__main__":
    main()

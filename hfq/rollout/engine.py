"""RolloutEngine: batched generation with a static KV cache and CUDA-graphed decode steps.

One engine per policy model. `generate` left-pads ragged prompts, prefills them in one batch,
then replays a captured decode step (one graph per batch bucket x KV-length bucket x sampler
flags) until every row hit EOS / a stop string or `max_new_tokens`. Graphs read the model's
parameters where they live, so in-place updates (optimizer steps on LoRA, AQN noise on norms)
are seen by the next replay; if a parameter is *replaced* (new storage, `.to(dtype)`), the
engine notices and re-captures. On CUDA a decode step uses the fused Triton kernels of `hfq_kernels.rollout`
(norms, RoPE + KV write, split-KV attention, SiLU*mul, temperature sampling), grouped LoRA kernels
(`hfq_kernels.lora`) and, for plain BF16/FP16 linears, a skinny GEMM where it timed faster than cuBLAS
(`hfq_kernels.skinny_gemm`).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import torch

from hfq_kernels._triton import on_device_of, pdl_launches
from .decoder import DecodeFusions, DecoderAdapter
from .sampling import SamplerFlags, row_keys, sample

MAX_EOS_IDS = 16  # the stop ids a decode step compares each token with (a fixed-size device tensor)
GRAPH_MODES = ("auto", "cuda_graph", "eager")


@dataclass
class RolloutOutput:
    """completion_ids [n, T] (pad after the end), lengths [n] (EOS included), logprobs [n, T] or None."""

    completion_ids: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor | None = None

    def completion_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.completion_ids.cpu(), self.lengths.tolist())]

    def logprob_lists(self) -> list[list[float]] | None:
        if self.logprobs is None:
            return None
        return [row[:n].tolist() for row, n in zip(self.logprobs.cpu(), self.lengths.tolist())]


def _default_buckets(max_batch: int) -> tuple[int, ...]:
    b, out = 1, []
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


def _check_engine_args(max_batch, max_seq_len, graph_mode, batch_buckets, kv_block, gpu_memory_utilization,
                       kv_cache_gb, check_every, fused_kernels) -> tuple[int, ...]:
    """RolloutEngine's argument checks (each error names its argument); returns the sorted batch buckets."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch: must be a positive int, got {max_batch!r}")
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"max_seq_len: must be an int >= 2, got {max_seq_len!r}")
    if graph_mode not in GRAPH_MODES:
        raise ValueError(f"graph_mode: {graph_mode!r} not in {GRAPH_MODES}")
    if kv_block < 16 or kv_block % 16:
        raise ValueError(f"kv_block: must be a multiple of 16, got {kv_block}")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    if kv_cache_gb is not None and kv_cache_gb <= 0:
        raise ValueError(f"kv_cache_gb: must be > 0, got {kv_cache_gb}")
    if check_every < 1:
        raise ValueError(f"check_every: must be >= 1, got {check_every}")
    buckets = tuple(sorted(set(batch_buckets or _default_buckets(max_batch))))
    if buckets[0] < 1 or buckets[-1] != max_batch:
        raise ValueError(f"batch_buckets: must be positive and end with max_batch={max_batch}, got {buckets}")
    if fused_kernels not in ("auto", True, False):
        raise ValueError(f"fused_kernels: must be 'auto', True or False, got {fused_kernels!r}")
    return buckets


_RETRY = object()  # _capture's answer after an out-of-memory: no graph for this call, try again on the next


def _address(p: torch.Tensor):
    """A parameter's storage as a captured graph sees it: a tensor subclass (e.g. a quantized weight) by each inner
    tensor's address and size, since an optimizer may give those new storage (QFT's outlier lists) in place."""
    t = p.data if isinstance(p, torch.nn.Parameter) else p
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return t.data_ptr()
    return tuple((getattr(t, name).data_ptr(), getattr(t, name).numel()) for name in flatten(t)[0])


class RolloutEngine:
    """Generation engine for Hugging Face causal LMs (Qwen2/Qwen3/Llama/Mistral).

    Args:
        model: a transformers causal LM, optionally PEFT-wrapped (LoRA stays unmerged) or quantized.
        max_batch: most rows per `generate` call (the KV cache is sized for it).
        max_seq_len: most prompt + completion tokens per row.
        graph_mode: "cuda_graph" (capture decode steps), "eager", or "auto" (graphs on CUDA).
        batch_buckets: batch sizes to capture; a call runs in the smallest bucket >= its rows.
        kv_block: KV-length bucket granularity: a step attends to ceil(len / kv_block) * kv_block columns.
        gpu_memory_utilization: fraction of the GPU's memory that model + KV cache may use (vLLM-like).
        kv_cache_gb: alternatively, an absolute KV-cache budget in GiB.
        check_every: decode steps between host checks for "all rows finished" / stop strings.
        fused_kernels: "auto" (on CUDA when Triton is there), True or False: decode with the Triton kernels
            of `hfq_kernels.rollout` (add+RMSNorm, RoPE+KV write, split-KV attention, SiLU*mul) and one
            accumulating GEMM per unmerged LoRA, instead of the model's own norm / RoPE / MLP code.
            True on CPU needs TRITON_INTERPRET=1 (tests).
        skinny_gemm: with the fused kernels on CUDA, run plain BF16/FP16 linears of decode steps through
            `hfq_kernels.skinny_gemm` where a one-time timing per shape found it faster than cuBLAS.
        fusions: the fused decode step's optional fusions (`DecodeFusions`; default: all on, as measured).
    """

    def __init__(self, model, max_batch: int = 32, max_seq_len: int = 2304, graph_mode: str = "auto",
                 batch_buckets: tuple[int, ...] | None = None, kv_block: int = 256,
                 gpu_memory_utilization: float | None = None, kv_cache_gb: float | None = None,
                 check_every: int = 32, pad_token_id: int | None = None, fused_kernels: bool | str = "auto",
                 skinny_gemm: bool = True, fusions: DecodeFusions | None = None):
        buckets = _check_engine_args(max_batch, max_seq_len, graph_mode, batch_buckets, kv_block,
                                     gpu_memory_utilization, kv_cache_gb, check_every, fused_kernels)
        self.model = model
        self.adapter = DecoderAdapter(model, max_seq_len, fused_kernels=fused_kernels, skinny_gemm=skinny_gemm,
                                      fusions=fusions)
        self.device = self.adapter.device
        self.dtype = self.adapter.dtype
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.kv_block = kv_block
        self.buckets = buckets
        self.check_every = check_every
        self.use_graphs = graph_mode == "cuda_graph" or (graph_mode == "auto" and self.device.type == "cuda")
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"graph_mode: 'cuda_graph' needs the model on CUDA, it is on {self.device}")
        cfg = self.adapter.config
        if pad_token_id is None:
            pad_token_id = getattr(cfg, "pad_token_id", None)
            if pad_token_id is None:
                eos = getattr(cfg, "eos_token_id", None)
                pad_token_id = (eos[0] if isinstance(eos, (list, tuple)) else eos) or 0
        self.pad_token_id = int(pad_token_id)

        # KV cache: columns padded to a multiple of 64 so mask rows stay aligned for fused attention
        self.cache_len = int(math.ceil(max_seq_len / 64) * 64)
        a = self.adapter
        elt = torch.empty((), dtype=self.dtype).element_size()
        kv_bytes = 2 * len(a.layers) * max_batch * a.n_kv * self.cache_len * a.head_dim * elt
        self.kv_bytes = kv_bytes
        self._check_memory(kv_bytes, gpu_memory_utilization, kv_cache_gb)
        shape = (max_batch, a.n_kv, self.cache_len, a.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in a.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in a.layers]

        dev, B, S = self.device, max_batch, self.cache_len
        self.mask = torch.full((B, S), float("-inf"), dtype=self.dtype, device=dev)
        self.tokens = torch.full((B,), self.pad_token_id, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.done = torch.ones(B, dtype=torch.bool, device=dev)
        self.out_tokens = torch.full((B, S), self.pad_token_id, dtype=torch.long, device=dev)
        self.out_logprobs = torch.zeros((B, S), dtype=torch.float32, device=dev)
        self.temperature = torch.ones((B, 1), dtype=torch.float32, device=dev)
        self.top_k = torch.zeros((B, 1), dtype=torch.long, device=dev)
        self.top_p = torch.ones((B, 1), dtype=torch.float32, device=dev)
        self.min_p = torch.zeros((B, 1), dtype=torch.float32, device=dev)
        self.keys = torch.zeros((B, 2), dtype=torch.long, device=dev)
        self.eos = torch.full((MAX_EOS_IDS,), -1, dtype=torch.long, device=dev)
        self.vocab_ids = torch.arange(a.vocab_size, dtype=torch.long, device=dev)
        self._graphs: dict = {}
        self._oom_warned = False
        self._pool = None
        self._fingerprint = None

    # ---------------------------------------------------------------- memory
    def _check_memory(self, kv_bytes, util, kv_gb):
        per_row = kv_bytes / self.max_batch / self.cache_len  # bytes per (row, token)
        if kv_gb is not None:
            budget, what = kv_gb * 2**30, f"kv_cache_gb={kv_gb}"
        elif util is not None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_elsewhere = total - free
            budget, what = util * total - used_elsewhere, f"gpu_memory_utilization={util}"
        else:
            return
        if kv_bytes > budget:
            fit = max(int(budget // per_row), 0)
            raise ValueError(
                f"KV cache does not fit: max_batch={self.max_batch} x max_seq_len={self.max_seq_len} needs "
                f"{kv_bytes / 2**30:.2f} GiB but {what} leaves {max(budget, 0) / 2**30:.2f} GiB; at most "
                f"{fit} tokens in total fit (e.g. max_batch={max(fit // self.max_seq_len, 0)} at this "
                f"max_seq_len): lower max_batch or max_seq_len, or raise the budget")

    # ---------------------------------------------------------------- graphs
    def _model_fingerprint(self):
        """What a captured decode step depends on beyond its inputs: every parameter's and buffer's address, the
        buffers' versions (in-place writes), and each LoRA layer's adapter state (active adapters, disabled, merged,
        scales, train/eval), which PEFT and transformers change without moving a tensor (disable_adapter(),
        set_adapter, rescale_adapter_scale)."""
        m = self.model
        ptrs = tuple(_address(p) for p in m.parameters()) + tuple(b.data_ptr() for b in m.buffers())
        # buffers (e.g. NVFP4 codes) written in place: layers may keep copies derived from them, captured by address
        vers = tuple(b._version for b in m.buffers())
        lora = []
        for mod in m.modules():
            if hasattr(mod, "lora_A") and hasattr(mod, "scaling"):
                active = getattr(mod, "active_adapters", ())
                lora.append((tuple(active() if callable(active) else active),
                             bool(getattr(mod, "disable_adapters", False)), bool(getattr(mod, "merged", False)),
                             tuple(sorted((k, repr(v)) for k, v in mod.scaling.items())), mod.training))
        return ptrs, vers, tuple(lora)

    def invalidate(self):
        """Drop captured graphs (the next call re-captures). Needed only after changes the engine cannot see:
        tensors written through `.data` in place of new ones, a module swapped for another at the same addresses."""
        self._drop_graphs()

    def _drop_graphs(self):
        """Forget the graphs and their memory pool: the next capture starts a new pool (the allocator releases a
        graph's pool when the last graph captured into it is gone, so the old handle must not be used again)."""
        self._graphs.clear()
        self._pool = None

    def _kv_bucket(self, n_cols: int) -> int:
        return min(int(math.ceil(n_cols / self.kv_block) * self.kv_block), self.cache_len)

    def _decode_body(self, b: int, kv_len: int, flags: SamplerFlags):
        a = self.adapter
        mask = self.mask[:b]
        mask.index_fill_(1, self.col, 0.0)
        h = a.decode(self.tokens[:b], self.pos[:b], self.col, mask[:, :kv_len], self.k_cache, self.v_cache, b, kv_len)
        tok, lp = sample(a.logits(h), flags, self.temperature[:b], self.top_k[:b], self.top_p[:b], self.min_p[:b],
                         self.keys[:b], self.step, self.vocab_ids, fused=a.fused)
        self._commit(tok, lp, b)
        self.pos[:b] += 1
        self.col += 1

    def _commit(self, tok, lp, b):
        done = self.done[:b]
        tok = torch.where(done, self.pad_token_id, tok)
        self.out_tokens[:b].index_copy_(1, self.step, tok[:, None])
        if lp is not None:
            self.out_logprobs[:b].index_copy_(1, self.step, torch.where(done, 0.0, lp)[:, None])
        done |= (tok[:, None] == self.eos[None, :]).any(-1)
        self.tokens[:b].copy_(tok)
        self.step += 1

    def _pdl(self):
        """pdl_launches() for the decode step's warm-up and capture; none with fusions.pdl off, or once a warm-up of
        this capture has forked LoRA shrinks onto the side stream."""
        if self.adapter.forked or not self.adapter.fusions.pdl:
            return contextlib.nullcontext()
        return pdl_launches()

    def _capture(self, key):
        b, kv_len, flags = key
        if not self.use_graphs:
            return None
        try:
            # warm-ups execute the step: point it at column 0 / step 0 (generate resets state afterwards)
            self.col.zero_()
            self.step.zero_()
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            # decode kernels launch with programmatic dependent launch (sm_90+) in the warm-up and the graph, unless
            # the step forks LoRA shrinks onto a side stream (see DecodeFusions.lora_stream)
            self.adapter.forked = False
            for _ in range(2):  # warm-up: Triton autotuning, cuBLAS handles, lazy inits
                with torch.cuda.stream(s), self._pdl():
                    self._decode_body(b, kv_len, flags)
            torch.cuda.current_stream(self.device).wait_stream(s)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, stream=s), self._pdl():  # s: on this engine's device
                self._decode_body(b, kv_len, flags)
            g.replay()  # the first replay uploads the graph; keep that out of generate (it resets the state)
            return g
        except Exception as e:  # noqa: BLE001 - a module that cannot be captured still generates eagerly
            if isinstance(e, torch.OutOfMemoryError):  # a tight moment, not an uncapturable step: retried next call
                torch.cuda.synchronize(self.device)
                if not any(g is not None for g in self._graphs.values()):
                    self._pool = None  # the failed graph was the pool's last: a released handle is not reused
                torch.cuda.empty_cache()
                if not self._oom_warned:
                    self._oom_warned = True
                    warnings.warn(f"hfq.rollout: out of memory while capturing a decode graph ({e}); this call "
                                  "decodes eagerly, a later one captures again", stacklevel=3)
                return _RETRY
            if self.adapter.fused:  # first drop the fused kernels, keep the graphs
                warnings.warn(f"hfq.rollout: fused decode kernels failed ({type(e).__name__}: {e}); using the "
                              "model's own modules", stacklevel=3)
                torch.cuda.synchronize(self.device)
                self.adapter.drop_fused()
                self._drop_graphs()
                return self._capture(key)
            warnings.warn(f"hfq.rollout: CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly",
                          stacklevel=3)
            self.use_graphs = False
            torch.cuda.synchronize(self.device)
            return None

    def _ensure_graphs(self, b, first_col, last_col, flags):
        if not self.use_graphs:
            return
        fp = self._model_fingerprint()
        if fp != self._fingerprint:
            self._drop_graphs()
            self._fingerprint = fp
        kv = self._kv_bucket(first_col + 1)
        while True:
            key = (b, kv, flags)
            if key not in self._graphs:
                g = self._capture(key)
                if g is _RETRY:
                    return
                self._graphs[key] = g
                if not self.use_graphs:
                    return
            if kv >= self._kv_bucket(last_col + 1):
                break
            kv = self._kv_bucket(kv + 1)

    # ---------------------------------------------------------------- API
    @staticmethod
    def _left_pad(input_ids, attention_mask, pad):
        if isinstance(input_ids, (list, tuple)):
            if not input_ids or not all(isinstance(r, (list, tuple)) and len(r) > 0 for r in input_ids):
                raise ValueError("input_ids: a list of prompts must hold non-empty lists of token ids")
            n = max(len(r) for r in input_ids)
            ids = torch.full((len(input_ids), n), pad, dtype=torch.long)
            mask = torch.zeros((len(input_ids), n), dtype=torch.long)
            for i, r in enumerate(input_ids):
                ids[i, n - len(r):] = torch.tensor(r, dtype=torch.long)
                mask[i, n - len(r):] = 1
            return ids, mask
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected a [batch, len] tensor or a list of lists, got "
                             f"{getattr(input_ids, 'shape', type(input_ids))}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} != input_ids "
                             f"{tuple(input_ids.shape)}")
        m = attention_mask.to(torch.long).cpu()
        if (m.sum(1) == 0).any():
            raise ValueError("attention_mask: every row needs at least one prompt token")
        if (m[:, 1:] < m[:, :-1]).any():  # not left padded: re-pad (right padding or holes)
            rows = [r[mm.bool()].tolist() for r, mm in zip(input_ids.cpu(), m)]
            return RolloutEngine._left_pad(rows, None, pad)
        return input_ids.long(), m

    @on_device_of(lambda self, *a, **k: self.device)  # the model may sit on a GPU that is not the current one
    @torch.no_grad()
    def warmup(self, batch: int, prompt_len: int, max_new_tokens: int, temperature: float | None = 1.0,
               top_p: float | None = 1.0, top_k: int | None = 0, min_p: float | None = None,
               return_logprobs: bool = False) -> int:
        """Capture the decode graphs a `generate` call of this shape and sampling setup will replay, so the
        call itself captures nothing. Returns the number of graphs held."""
        b = next((x for x in self.buckets if x >= batch), None)
        if b is None:
            raise ValueError(f"batch: {batch} exceeds max_batch={self.max_batch}")
        if prompt_len + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt_len + max_new_tokens = {prompt_len + max_new_tokens} exceeds "
                             f"max_seq_len={self.max_seq_len}")
        greedy = temperature is None or temperature == 0
        flags = SamplerFlags(greedy=greedy, top_k=bool(top_k) and not greedy,
                             top_p=top_p is not None and top_p < 1 and not greedy,
                             min_p=bool(min_p) and not greedy, logprobs=return_logprobs)
        was_training = self.model.training
        self.model.eval()
        try:
            if max_new_tokens > 1:
                self._ensure_graphs(b, prompt_len, prompt_len + max_new_tokens - 2, flags)
        finally:
            self.model.train(was_training)
        return len(self._graphs)

    @on_device_of(lambda self, *a, **k: self.device)  # the model may sit on a GPU that is not the current one
    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 256, temperature: float | None = 1.0,
                 top_p: float | None = 1.0, top_k: int | None = 0, min_p: float | None = None,
                 eos_token_ids=None, seed: int | None = None, return_logprobs: bool = False,
                 stop_strings: list[str] | None = None, tokenizer=None) -> RolloutOutput:
        """Generate completions for left-padded (or ragged list) prompts.

        temperature 0 / None means greedy. eos_token_ids: int, list, or None for the model's own; [] disables
        EOS. seed: int for reproducible sampling (None draws one from torch's CPU RNG). stop_strings need
        `tokenizer`; a row stops after the token that completes a stop string (checked on the host every
        `check_every` steps; later tokens are dropped)."""
        ids, amask = self._left_pad(input_ids, attention_mask, self.pad_token_id)
        n, plen = ids.shape
        if n > self.max_batch:
            raise ValueError(f"input_ids: batch {n} exceeds max_batch={self.max_batch} (the captured buckets "
                             f"{self.buckets}); split the batch or build the engine with a larger max_batch")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be a positive int, got {max_new_tokens!r}")
        if plen + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt length {plen} + max_new_tokens {max_new_tokens} = {plen + max_new_tokens} "
                             f"exceeds max_seq_len={self.max_seq_len} (the KV cache); nothing is truncated")
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings: a tokenizer is needed to match stop strings")
        greedy = temperature is None or temperature == 0
        if not greedy and temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        if top_k is not None and top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = off), got {top_k}")
        if min_p is not None and not 0 <= min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {min_p}")
        if eos_token_ids is None:
            gc = getattr(self.adapter.model, "generation_config", None)
            eos_token_ids = getattr(gc, "eos_token_id", None) or getattr(self.adapter.config, "eos_token_id", None)
        eos = [] if eos_token_ids is None else ([eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids))
        if len(eos) > self.eos.numel():
            raise ValueError(f"eos_token_ids: at most {self.eos.numel()} ids, got {len(eos)}")
        flags = SamplerFlags(greedy=greedy, top_k=bool(top_k) and not greedy,
                             top_p=top_p is not None and top_p < 1 and not greedy,
                             min_p=bool(min_p) and not greedy, logprobs=return_logprobs)
        b = next(x for x in self.buckets if x >= n)
        dev = self.device

        was_training = self.model.training
        self.model.eval()
        try:
            if max_new_tokens > 1:
                self._ensure_graphs(b, plen, plen + max_new_tokens - 2, flags)
            # reset state (capture warm-ups ran on it)
            self.mask.fill_(float("-inf"))
            self.mask[:n, :plen].masked_fill_(amask.to(dev).bool(), 0.0)
            self.done.fill_(True)
            self.done[:n] = False
            self.out_tokens.fill_(self.pad_token_id)
            self.out_logprobs.zero_()
            self.eos.fill_(-1)
            if eos:
                self.eos[:len(eos)] = torch.tensor(eos, dtype=torch.long)
            self.temperature.fill_(1.0 if greedy else float(temperature))
            self.top_k.fill_(int(top_k or 0))
            self.top_p.fill_(float(top_p if top_p is not None else 1.0))
            self.min_p.fill_(float(min_p or 0.0))
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,)).item())
            rows = torch.arange(self.max_batch, dtype=torch.long)
            self.keys.copy_(row_keys(torch.full_like(rows, int(seed) & (2**62 - 1)) ^ (rows * 0x9E3779B1)))
            self.step.zero_()
            self.col.fill_(plen)
            self.tokens.fill_(self.pad_token_id)
            self.pos.zero_()

            self._prefill(ids.to(dev), amask.to(dev), n, flags)
            self._decode_loop(n, b, plen, max_new_tokens, flags, stop_strings, tokenizer)
        finally:
            self.model.train(was_training)
        return self._collect(n, max_new_tokens, return_logprobs)

    def _prefill(self, ids, amask, n, flags):
        a = self.adapter
        plen = ids.shape[1]
        pos = (amask.cumsum(1) - 1).clamp(min=0)
        # bound the attention scores a (possibly unfused) prefill materialises: rows * heads * P * P floats
        chunk = max(1, min(n, (2**30) // max(1, a.n_heads * plen * plen * 4)))
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            h = a.prefill(ids[r0:r1], pos[r0:r1], amask[r0:r1].bool(), self.k_cache, self.v_cache, slice(r0, r1))
            self.pos[r0:r1] = pos[r0:r1, -1] + 1
            logits = a.logits(h)
            tok, lp = sample(logits, flags, self.temperature[r0:r1], self.top_k[r0:r1], self.top_p[r0:r1],
                             self.min_p[r0:r1], self.keys[r0:r1], self.step, self.vocab_ids)
            self.out_tokens[r0:r1, 0] = tok
            if lp is not None:
                self.out_logprobs[r0:r1, 0] = lp
            self.tokens[r0:r1] = tok
            self.done[r0:r1] |= (tok[:, None] == self.eos[None, :]).any(-1)
        self.step.fill_(1)

    def _decode_loop(self, n, b, plen, max_new, flags, stop_strings, tokenizer):
        self._stop_len = {}
        last_checked = 0
        for s in range(1, max_new):
            col = plen + s - 1
            key = (b, self._kv_bucket(col + 1), flags)
            g = self._graphs.get(key) if self.use_graphs else None
            if g is not None:
                g.replay()
            else:
                self._decode_body(b, key[1], flags)
            if s % self.check_every == 0 or s == max_new - 1:
                if stop_strings:
                    self._check_stop_strings(n, s + 1, last_checked, stop_strings, tokenizer)
                    last_checked = s + 1
                if bool(self.done[:n].all()):
                    break
        if stop_strings and max_new == 1:
            self._check_stop_strings(n, 1, 0, stop_strings, tokenizer)

    def _check_stop_strings(self, n, upto, since, stop_strings, tokenizer):
        toks = self.out_tokens[:n, :upto].cpu()
        done = self.done[:n].cpu()
        eos = set(self.eos[self.eos >= 0].tolist())
        for i in range(n):
            if i in self._stop_len:
                continue
            row = toks[i].tolist()
            end = upto
            if done[i]:  # finished by EOS: only look before it
                end = next((j + 1 for j, t in enumerate(row) if t in eos), upto)
            text = tokenizer.decode(row[:end])
            if not any(s in text for s in stop_strings):
                continue
            for t in range(max(0, since - 8), end):
                if any(s in tokenizer.decode(row[:t + 1]) for s in stop_strings):
                    self._stop_len[i] = t + 1
                    self.done[i] = True
                    break

    def _collect(self, n, max_new, want_lp):
        toks = self.out_tokens[:n, :max_new].clone()
        is_eos = (toks[:, :, None] == self.eos[None, None, :]).any(-1)
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, max_new)
        for i, ln in getattr(self, "_stop_len", {}).items():
            first[i] = min(int(first[i]), ln)
        cols = torch.arange(max_new, device=toks.device)[None, :]
        keep = cols < first[:, None]
        toks = torch.where(keep, toks, self.pad_token_id)
        width = int(first.max())
        lp = torch.where(keep, self.out_logprobs[:n, :max_new], 0.0)[:, :width] if want_lp else None
        return RolloutOutput(completion_ids=toks[:, :width], lengths=first, logprobs=lp)

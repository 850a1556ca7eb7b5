"""INVESTIGATION, on no route (see the commit message). Hopper (sm_90) W4A16 products on the g4 layout for many rows: the decode feeds warpgroup MMAs directly.

forward  y[M, N] = x[M, K] @ W^T:  computed as y^T = W x^T, so the weight is the MMA's A operand. Each warp decodes
         its 16-row tile of a 64-wide K chunk in registers (the g4 layout puts every code where the MMA wants it,
         see nvfp4_gluon) and x's [BM, 64] tiles come by TMA into a ring of shared-memory stages (B, K-major).
grad     gx[M, K] = g[M, N] @ W:  computed as gx^T = W^T g^T. The weight is A again but transposed, which the
         register layout cannot express: the decoded [64 n, 64 k] tile goes through shared memory (double buffered)
         and the MMA reads it MN-major. g's [BM, 64] tiles come by TMA.
Both keep one MMA in flight while the next chunk is decoded and its words loaded, and scale the fp32 accumulator
by 2^14 / global_recip at the end (the decoded values are e2m1 * scale * 2^-14, exact in bf16).
"""
from __future__ import annotations

import torch

from hfq_kernels._triton import HAS_TRITON, INTERPRET, LRU, cdiv
from hfq_kernels.nvfp4_quant import recip

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from hfq_kernels.nvfp4_gluon import HAS_GLUON, _g4_decode_a

    HAS_WGMMA = HAS_GLUON and HAS_TRITON
except Exception:  # pragma: no cover - older triton
    HAS_WGMMA = False

if HAS_WGMMA:
    @gluon.jit
    def _wg_weight_chunk(ws, ss, st, RT: gl.constexpr, BN: gl.constexpr, L4: gl.constexpr, a_l: gl.constexpr):
        """Stage st's words [RT, 128] and scale bytes [RT, 64] (one K chunk of RT row tiles) -> decoded A [BN, 64]."""
        LW: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
        LB: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [gl.num_warps(), 1], [1, 0])
        w = ws.index(st).load(LW)
        sb = gl.convert_layout(gl.reshape(ss.index(st).load(LB), [RT, 32, 2]), gl.SliceLayout(3, L4),
                               assert_trivial=True)
        return _g4_decode_a(w, sb, RT, BN, L4, a_l)

    @gluon.jit
    def _wg_issue(x_desc, w_desc, s_desc, xs, ws, ss, bars, chunk, KC, off_m, row0, pred):
        """TMA loads of K chunk `chunk` (x tile, the row tiles' words and scale bytes) into its stage."""
        st = chunk % xs.shape[0]
        bar = bars.index(st)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes,
                        pred=pred)
        tma.async_copy_global_to_shared(x_desc, [off_m, chunk * 64], bar, xs.index(st), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [row0, chunk * 128], bar, ws.index(st), pred=pred)
        tma.async_copy_global_to_shared(s_desc, [row0, chunk * 64], bar, ss.index(st), pred=pred)

    @gluon.jit
    def _wg_linear_step(x_desc, w_desc, s_desc, xs, ws, ss, bars, it, KC, off_m, row0, cur, prev, acc,
                        RT: gl.constexpr, BN: gl.constexpr, L4: gl.constexpr, a_l: gl.constexpr):
        """Chunk `it`: issue its MMA (A = cur); once chunk it-1's MMA (A = prev) is done, refill that chunk's stage
        and decode chunk it+1 (returned) while this one runs."""
        S: gl.constexpr = xs.shape[0]
        acc = warpgroup_mma(cur, xs.index(it % S).permute((1, 0)), acc, is_async=True)
        acc, prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, prev))
        pk = it - 1 + S
        _wg_issue(x_desc, w_desc, s_desc, xs, ws, ss, bars, pk, KC, off_m, row0, (it >= 1) & (pk < KC))
        nx = it + 1
        mbarrier.wait(bars.index(nx % S), (nx // S) & 1, pred=nx < KC)
        return acc, _wg_weight_chunk(ws, ss, nx % S, RT, BN, L4, a_l)

    @gluon.jit
    def _wg_linear_kernel(x_desc, w_desc, s_desc, recip_ptr, b_ptr, y_ptr, M, N, KC, stride_ym,
                          HAS_BIAS: gl.constexpr, STAGES: gl.constexpr):
        """Program (pid_m, pid_n): y[pid_m*BM +BM, pid_n*BN +BN], BN = 16 weight rows per warp. x comes with its
        columns in the decode's order within each 64-chunk (kappa_order)."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        W: gl.constexpr = gl.num_warps()
        BN: gl.constexpr = W * 16
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                      instr_shape=[16, BM, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [1, 32, 1, 1], [W, 1, 1, 1], [3, 2, 1, 0])
        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        off_m = pid_m * BM
        row0 = pid_n * W
        xs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, 64], x_desc.layout)
        ws = gl.allocate_shared_memory(w_desc.dtype, [STAGES, W, 128], w_desc.layout)
        ss = gl.allocate_shared_memory(s_desc.dtype, [STAGES, W, 64], s_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            _wg_issue(x_desc, w_desc, s_desc, xs, ws, ss, bars, i, KC, off_m, row0, i < KC)
        mbarrier.wait(bars.index(0), 0)
        a = _wg_weight_chunk(ws, ss, 0, W, BN, L4, a_l)
        b = a
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        # two A register sets in turn: the next chunk is decoded into the one whose MMA has finished (no branch
        # inside the loop: a merge of the accumulator there would be copies while an MMA runs)
        for it in range(0, KC - 1, 2):
            acc, b = _wg_linear_step(x_desc, w_desc, s_desc, xs, ws, ss, bars, it, KC, off_m, row0, a, b, acc,
                                     W, BN, L4, a_l)
            acc, a = _wg_linear_step(x_desc, w_desc, s_desc, xs, ws, ss, bars, it + 1, KC, off_m, row0, b, a, acc,
                                     W, BN, L4, a_l)
        if KC % 2 == 1:
            acc, b = _wg_linear_step(x_desc, w_desc, s_desc, xs, ws, ss, bars, KC - 1, KC, off_m, row0, a, b, acc,
                                     W, BN, L4, a_l)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        acc = acc * (16384.0 / gl.load(recip_ptr))
        if HAS_BIAS:
            acc += gl.expand_dims(gl.load(b_ptr + rn, mask=rn < N, other=0.0).to(gl.float32), 1)
        OL: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, W], [0, 1])
        out = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), OL)
        on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, OL))
        om = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, OL))
        mask = gl.expand_dims(on < N, 1) & gl.expand_dims(om < M, 0)
        gl.store(y_ptr + gl.expand_dims(om.to(gl.int64) * stride_ym, 0) + gl.expand_dims(on, 1), out, mask=mask)

    @gluon.jit
    def _wg_grad_kernel(g_desc, w_desc, s_desc, recip_ptr, out_ptr, M, K, KC, steps, sps,
                        STAGES: gl.constexpr, PARTIAL: gl.constexpr):
        """Program (pid_m, kc, pid_s): out[pid_m*BM +BM, kc*64 +64] summed over n steps [pid_s*sps, +sps) of 64
        weight rows (4 warps: one 16-row tile each); PARTIAL: fp32 partials [split, M, K]."""
        BM: gl.constexpr = g_desc.block_type.shape[0]
        gl.static_assert(gl.num_warps() == 4, "one warpgroup: 64 weight rows per step")
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        d_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [1, 32, 1, 1], [4, 1, 1, 1], [3, 2, 1, 0])
        AS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        pid_m = gl.program_id(0)
        kc = gl.program_id(1)
        j0 = gl.program_id(2) * sps
        nst = gl.minimum(sps, steps - j0)
        off_m = pid_m * BM
        gs = gl.allocate_shared_memory(g_desc.dtype, [STAGES, BM, 64], g_desc.layout)
        ws = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 4, 128], w_desc.layout)
        ss = gl.allocate_shared_memory(s_desc.dtype, [STAGES, 4, 64], s_desc.layout)
        a_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], AS)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            _wg_grad_issue(g_desc, w_desc, s_desc, gs, ws, ss, bars, i, nst, off_m, j0, kc, i < nst)
        mbarrier.wait(bars.index(0), 0)
        a_s.index(0).store(_wg_weight_chunk(ws, ss, 0, 4, 64, L4, d_l))
        fence_async_shared()
        gl.thread_barrier()
        acc = gl.zeros([64, BM], gl.float32, layout=mma)
        for it in range(nst):
            st = it % STAGES
            acc = warpgroup_mma(a_s.index(it % 2).permute((1, 0)), gs.index(st).permute((1, 0)), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            pk = it - 1 + STAGES  # MMA it-1 is done: refill its stage
            _wg_grad_issue(g_desc, w_desc, s_desc, gs, ws, ss, bars, pk, nst, off_m, j0, kc,
                           (it >= 1) & (pk < nst))
            nx = it + 1
            mbarrier.wait(bars.index(nx % STAGES), (nx // STAGES) & 1, pred=nx < nst)
            a_s.index(nx % 2).store(_wg_weight_chunk(ws, ss, nx % STAGES, 4, 64, L4, d_l))
            fence_async_shared()
            gl.thread_barrier()
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        acc = acc * (16384.0 / gl.load(recip_ptr))
        OL: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
        out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), OL)
        kap = gl.arange(0, 64, layout=gl.SliceLayout(1, OL))  # the decode's column order -> k
        ok = kc * 64 + 16 * ((kap // 2) % 4) + 8 * ((kap // 8) % 2) + 2 * (kap // 16) + kap % 2
        om = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, OL))
        mask = gl.expand_dims(ok < K, 1) & gl.expand_dims(om < M, 0)
        row = om.to(gl.int64)
        if PARTIAL:
            row += gl.program_id(2) * M
        gl.store(out_ptr + gl.expand_dims(row * K, 0) + gl.expand_dims(ok, 1), out, mask=mask)

    @gluon.jit
    def _wg_grad_issue(g_desc, w_desc, s_desc, gs, ws, ss, bars, step, nst, off_m, j0, kc, pred):
        """TMA loads of n step `step` (g tile, the 4 row tiles' words and scale bytes of chunk kc)."""
        st = step % gs.shape[0]
        bar = bars.index(st)
        mbarrier.expect(bar, g_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes,
                        pred=pred)
        tma.async_copy_global_to_shared(g_desc, [off_m, (j0 + step) * 64], bar, gs.index(st), pred=pred)
        tma.async_copy_global_to_shared(w_desc, [(j0 + step) * 4, kc * 128], bar, ws.index(st), pred=pred)
        tma.async_copy_global_to_shared(s_desc, [(j0 + step) * 4, kc * 64], bar, ss.index(st), pred=pred)


_SM90: dict = {}


def supported(x2: torch.Tensor) -> bool:
    """Whether these kernels take x2 [M, K]: bf16 on an sm_90 GPU, rows 16-byte aligned for TMA."""
    if not (HAS_WGMMA and not INTERPRET and x2.is_cuda and x2.dtype == torch.bfloat16):
        return False
    idx = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    ok = _SM90.get(idx)
    if ok is None:
        ok = _SM90[idx] = torch.cuda.get_device_capability(idx) == (9, 0)
    return ok and x2.shape[1] % 64 == 0 and x2.stride(1) == 1 and (x2.stride(0) * 2) % 16 == 0 and x2.data_ptr() % 16 == 0


def _desc(t: torch.Tensor, rows: int, cols: int, swizzle: int = 0):
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=t.element_size() * 8, rank=2)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, cols], layout)


def _weight_descs(wr, sr, n: int, k: int, rows: int):
    """TMA descriptors of the g4 words [NT, KC*128] and scale bytes [NT, KC*64], boxes of `rows` row tiles."""
    nt, kc = cdiv(n, 16), cdiv(k, 64)
    return _desc(wr.view(nt, kc * 128), rows, 128), _desc(sr.view(nt, kc * 64), rows, 64)


def kappa_order(x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] with each 64-column chunk in the decode's order kappa = 16 i + 8 wsub + 2 c + h for
    k = 16 c + 8 wsub + 2 i + h (see nvfp4_gluon), as the forward's B operand needs it."""
    m, k = x2.shape
    return x2.view(m, k // 64, 4, 2, 4, 2).permute(0, 1, 4, 3, 2, 5).reshape(m, k)


def linear(x2, wr, sr, global_scale, bias, n: int, k: int, bm: int = 128, warps: int = 4, stages: int = 4):
    """y [M, n] = x2 @ W^T (+ bias) for a g4 weight, x2 bf16 [M, k] (see supported)."""
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    grid = (cdiv(m, bm), cdiv(cdiv(n, 16), warps))
    w_desc, s_desc = _weight_descs(wr, sr, n, k, warps)
    _wg_linear_kernel[grid](_desc(kappa_order(x2), bm, 64, 128), w_desc, s_desc, recip(global_scale),
                            bias if bias is not None else y, y, m, n, cdiv(k, 64), y.stride(0),
                            HAS_BIAS=bias is not None, STAGES=stages, num_warps=warps)
    return y


def grad_input(g2, wr, sr, global_scale, n: int, k: int, bm: int = 128, stages: int = 4, split: int = 1):
    """gx [M, k] = g2 @ W for a g4 weight, g2 bf16 [M, n] (see supported); split > 1 sums fp32 partials."""
    m = g2.shape[0]
    steps = cdiv(n, 64)
    sps = cdiv(steps, split)
    split = cdiv(steps, sps)
    if split > 1:
        out = torch.empty((split, m, k), dtype=torch.float32, device=g2.device)
    else:
        out = torch.empty((m, k), dtype=g2.dtype, device=g2.device)
    grid = (cdiv(m, bm), cdiv(k, 64), split)
    w_desc, s_desc = _weight_descs(wr, sr, n, k, 4)
    _wg_grad_kernel[grid](_desc(g2, bm, 64, 128), w_desc, s_desc, recip(global_scale), out, m, k, cdiv(k, 64),
                          steps, sps, STAGES=stages, PARTIAL=split > 1, num_warps=4)
    return out.sum(0).to(g2.dtype) if split > 1 else out

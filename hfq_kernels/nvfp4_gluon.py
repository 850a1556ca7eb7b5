"""The "g4" NVFP4 weight layout: the Gluon (explicit layouts) W4A16 decode kernel for bf16 activations, M <= 64,
that reads it, its Triton dequantize, and the conversions from/to compressed-tensors' canonical layout.

g4 layout (`repack` from canonical, `unrepack` back; NVFP4Linear keeps it on GPUs that run the kernel,
`repacked` caches it for callers holding canonical tensors; state_dict/save keep the canonical layout):
  rows in tiles of 16 (n = 16 rt + 8 hrow + g), K in chunks of 64 (k = 64 kc + 16 c + 8 wsub + 2 i + h), both
  zero-padded. MMA lane (g, c) = 4 g + c owns rows g and g+8 of scale block c in every chunk: its 16 bytes are
  words r = 2 hrow + wsub at int32 index ((rt*KC + kc)*32 + lane)*4 + r, one 16-byte load per thread.
  In word r, the code of (i, h) has its 3 magnitude bits at 6+16h-SM[i] .. 8+16h-SM[i] and its sign at
  15+16h-SS[i], with (SM, SS) = (0,0), (3,3), (-3,1), (6,2): so (w << SM[i]) & 0x01C001C0 | (w << SS[i]) & 0x80008000
  is a pair of bf16 = e2m1 * 2^-126 (exact, 11 integer ops per 8 codes), which times the scale is the MMA's A
  register for k-slab i directly (no layout conversion, no shared memory).
  Scales: one byte per (row, block) at ((rt*KC + kc)*32 + lane)*2 + hrow, encoding bf16(scale * 2^112) as
  (exponent - 230) << 3 | mantissa, so bf16x2(s, s) = byte * 0x00100010 + 0x73007300 (one IMAD). E4M3's
  non-zero scales use bytes 0..143; scale 0 is byte 208 (ZERO_SCALE_BYTE), which that IMAD turns into bf16 -0.0:
  the block's codes are kept as they are and still decode to zero. W = A * 2^14 / global_recip; x stays bf16
  (the B operand, two 16-byte loads).

This "g4" layout is what NVFP4Linear keeps on a GPU that runs the kernel (no canonical copy beside it): besides
the Gluon decode kernel, `dequantize_g4` (Triton, also under the interpreter) serves prefill, training forward
and grad-input, and `unrepack` gives the canonical compressed-tensors tensors back for save/export. The round
trip canonical -> g4 -> canonical is bit-exact except for a scale of -0.0 (written back as +0.0; values equal).
"""
from __future__ import annotations

import weakref

import torch

from hfq_kernels._settings import SETTINGS
from hfq_kernels._triton import (HAS_TRITON, INTERPRET, LRU, SPLIT_SCRATCH, BoundLaunch, cdiv, e2m1_to_f32, shift,
                                 f16_bits_to_f32, f32_to_bf16_rne, pdl_bound, tl, triton)
from hfq_kernels.nvfp4_quant import recip

_G4_SM = (0, 3, -3, 6)
_G4_SS = (0, 3, 1, 2)
ZERO_SCALE_BYTE = 208  # (bf16 bits 0x8000 - 0x7300) >> 4: decodes to -0.0
FEW_ROWS = 64  # rows up to which the decode kernels run (the Gluon kernel's largest BM); above: dequantize + cuBLAS


def _shifted(dst: str, src: str, a: int) -> str:
    """PTX: dst = src shifted left by a (right by -a)."""
    return f"shl.b32 {dst}, {src}, {a};" if a >= 0 else f"shr.u32 {dst}, {src}, {-a};"


def g4_asm(halves: bool = False) -> str:
    """Inline PTX: a g4 word -> for k-slab i, (w << SM[i]) & magnitudes | (w << SS[i]) & signs as a bf16 pair,
    times the bf16x2 scale pair (an fma adding -0, i.e. a multiply; exact, see the module doc). Word $4 and
    scale $5 give registers $0..$3; `halves`: word $8 and scale $9 give the eight bf16 values $0..$7 (2i + h)."""
    w, sc = ("$8", "$9") if halves else ("$4", "$5")
    lines = ["{", ".reg .b32 " + ", ".join(f"m{i}, s{i}" for i in range(4)) + ", NZ;", "mov.b32 NZ, 0x80008000;"]
    for i, (sm, ss) in enumerate(zip(_G4_SM, _G4_SS)):
        if sm == ss == 0:
            lines.append(f"and.b32 m{i}, {w}, 0x81C081C0;")
        elif sm == ss:
            lines += [_shifted(f"m{i}", w, sm), f"and.b32 m{i}, m{i}, 0x81C081C0;"]
        else:
            lines += [_shifted(f"m{i}", w, sm), _shifted(f"s{i}", w, ss), f"and.b32 m{i}, m{i}, 0x01C001C0;",
                      f"and.b32 s{i}, s{i}, 0x80008000;", f"or.b32 m{i}, m{i}, s{i};"]
        if halves:
            lines += [f"fma.rn.bf16x2 m{i}, m{i}, {sc}, NZ;", f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, m{i};"]
        else:
            lines.append(f"fma.rn.bf16x2 ${i}, m{i}, {sc}, NZ;")
    return "\n".join(lines + ["}"])


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAS_GLUON = HAS_TRITON
except Exception:  # pragma: no cover - older triton
    HAS_GLUON = False

if HAS_GLUON:
    _G4_ASM = gl.constexpr(g4_asm())

    @gluon.constexpr_function
    def _g4_x_layout(BM, W):
        """x chunk [BM, 4, 16]: 16 contiguous k per thread (registers), lanes (c, g), rows g + 8t in registers."""
        BM, W = int(BM), int(W)
        return gl.DistributedLinearLayout(
            reg_bases=([[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8]]
                       + [[8 << t, 0, 0] for t in range(BM.bit_length() - 4)]),
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[0, 0, 0]] * (W.bit_length() - 1), block_bases=[], shape=[BM, 4, 16])

    @gluon.jit
    def _pdl_enter():
        """pdl_enter for Gluon: wait for the kernels before this one, then let the next one launch."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _g4_operands(w, s, xt, RT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, L4: gl.constexpr,
                     a_l: gl.constexpr, b_l: gl.constexpr):
        """One 64-wide K chunk: weight words w + scale bytes s -> the MMA's A operand [BN, 64] (decoded in
        registers), x chunk xt -> its B operand [64, BM]."""
        w4 = gl.convert_layout(gl.reshape(w, [RT, 32, 2, 2]), L4, assert_trivial=True)
        s2 = s.to(gl.int32) * 0x00100010 + 0x73007300
        s4 = gl.broadcast(gl.expand_dims(s2, 3), w4)[0]
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_G4_ASM, "=r,=r,=r,=r,r,r", [w4, s4],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                   is_pure=True, pack=1)
        o = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [RT, 32, hrow, wsub, i%2, i//2]
        lo = o.to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (o >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        v = gl.join(lo, hi)  # [..., h]
        v = gl.reshape(v, [RT, 8, 4, 2, 2, 2, 2, 2])  # rt, g, c, hrow, wsub, i0, i1, h
        v = gl.permute(v, [0, 3, 1, 6, 5, 4, 2, 7])  # rt, hrow, g, i1, i0, wsub, c, h
        a = gl.convert_layout(gl.reshape(v, [BN, 64]), a_l, assert_trivial=True)
        xb = gl.permute(gl.reshape(xt, [BM, 4, 2, 4, 2]), [3, 2, 1, 4, 0])  # i, wsub, c, h, m
        b = gl.convert_layout(gl.reshape(xb, [64, BM]), b_l, assert_trivial=True)
        return a, b

    @gluon.jit
    def _g4_lane_offsets(pid_n, kc0, KC, NT, RT: gl.constexpr, E: gl.constexpr, L: gl.constexpr):
        """[RT, 32, E] offsets ((rt*KC + kc0)*32 + lane)*E + e into a repacked array with E entries per lane and
        chunk, for this program's row tiles rt (clamped to NT - 1), in layout L."""
        rt = gl.arange(0, RT, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        ln = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        e = gl.arange(0, E, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        rtg = gl.minimum(pid_n * RT + rt, NT - 1)
        return (gl.expand_dims(gl.expand_dims(rtg * (KC * (32 * E)), 1), 2)
                + gl.expand_dims(gl.expand_dims(ln * E, 0), 2)
                + gl.expand_dims(gl.expand_dims(e, 0), 1)) + kc0 * (32 * E)

    @gluon.jit
    def _g4_kernel(x_ptr, wr_ptr, sr_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, KC, NT, stride_xm, stride_ym, cps,
                   BM: gl.constexpr, R: gl.constexpr, HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr,
                   PREFETCH: gl.constexpr, PDL: gl.constexpr = False):
        _g4_tile(x_ptr, wr_ptr, sr_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, KC, NT, stride_xm, stride_ym, cps,
                 gl.program_id(0), gl.program_id(1), gl.program_id(2), BM, R, HAS_BIAS, PARTIAL, PREFETCH, PDL)

    @gluon.jit
    def _g4_serial_kernel(x_ptr, wr_ptr, sr_ptr, recip_ptr, b_ptr, p_ptr, y_ptr, cnt_ptr, M, N, K, KC, NT,
                          stride_xm, stride_ym, cps, BM: gl.constexpr, R: gl.constexpr, HAS_BIAS: gl.constexpr,
                          PREFETCH: gl.constexpr, PDL: gl.constexpr = False):
        """_g4_kernel with split-K in one launch: each program writes its fp32 partial [split, M, N] (p_ptr); the
        last of a tile's splits to finish (counted in cnt_ptr) sums them in split order, adds the bias, writes
        y and resets the counter (what _g4_kernel + nvfp4_matmul's split-K reduce compute, bit for bit)."""
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        _g4_tile(x_ptr, wr_ptr, sr_ptr, recip_ptr, b_ptr, p_ptr, M, N, K, KC, NT, stride_xm, N, cps,
                 pid_n, pid_m, gl.program_id(2), BM, R, False, True, PREFETCH, PDL)
        W: gl.constexpr = gl.num_warps()
        BN: gl.constexpr = R * W * 16
        gl.thread_barrier()  # every thread's partial is written before the arrival is counted
        tile = pid_n * gl.num_programs(1) + pid_m
        split = gl.num_programs(2)
        if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == split - 1:
            L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, W], [1, 0])
            mo = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, L))
            rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, L))
            mask = gl.expand_dims(mo < M, 1) & gl.expand_dims(rn < N, 0)
            off = gl.expand_dims(mo.to(gl.int64) * N, 1) + gl.expand_dims(rn, 0)
            tot = gl.zeros([BM, BN], gl.float32, layout=L)
            for s in range(split):
                tot += gl.load(p_ptr + s * M * N + off, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += gl.expand_dims(gl.load(b_ptr + rn, mask=rn < N, other=0.0).to(gl.float32), 0)
            gl.store(y_ptr + gl.expand_dims(mo.to(gl.int64) * stride_ym, 1) + gl.expand_dims(rn, 0),
                     tot.to(y_ptr.dtype.element_ty), mask=mask)
            gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _g4_group_kernel(x_ptr, wr0, sr0, rc0, b0, y0, wr1, sr1, rc1, b1, y1, wr2, sr2, rc2, b2, y2,
                         M, K, KC, N0, N1, N2, T0, T1, stride_xm, cps, BM: gl.constexpr, R: gl.constexpr,
                         HAS_BIAS: gl.constexpr, PARTIAL: gl.constexpr, PREFETCH: gl.constexpr, G: gl.constexpr,
                         PDL: gl.constexpr = False):
        """_g4_kernel for 2-3 weights sharing x (q/k/v, gate/up) in one launch: programs [0, T0) along axis 0 take
        weight 0's row tiles, [T0, T0 + T1) weight 1's, the rest weight 2's; each writes its own output (row stride
        N_g) or partials [split, M, N_g]."""
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        if pid_n < T0:
            _g4_tile(x_ptr, wr0, sr0, rc0, b0, y0, M, N0, K, KC, (N0 + 15) // 16, stride_xm, N0, cps,
                     pid_n, pid_m, pid_k, BM, R, HAS_BIAS, PARTIAL, PREFETCH, PDL)
        elif G == 2 or pid_n < T0 + T1:
            _g4_tile(x_ptr, wr1, sr1, rc1, b1, y1, M, N1, K, KC, (N1 + 15) // 16, stride_xm, N1, cps,
                     pid_n - T0, pid_m, pid_k, BM, R, HAS_BIAS, PARTIAL, PREFETCH, PDL)
        else:
            _g4_tile(x_ptr, wr2, sr2, rc2, b2, y2, M, N2, K, KC, (N2 + 15) // 16, stride_xm, N2, cps,
                     pid_n - T0 - T1, pid_m, pid_k, BM, R, HAS_BIAS, PARTIAL, PREFETCH, PDL)

    @gluon.jit
    def _g4_tile(x_ptr, wr_ptr, sr_ptr, recip_ptr, b_ptr, y_ptr, M, N, K, KC, NT, stride_xm, stride_ym, cps,
                 pid_n, pid_m, pid_k, BM: gl.constexpr, R: gl.constexpr, HAS_BIAS: gl.constexpr,
                 PARTIAL: gl.constexpr, PREFETCH: gl.constexpr, PDL: gl.constexpr):
        """One program of _g4_kernel: output rows [pid_n * BN, +BN) x columns [pid_m * BM, +BM), K chunks
        [pid_k * cps, +cps). With PDL the first weight chunk is loaded before waiting for the kernels before."""
        W: gl.constexpr = gl.num_warps()
        RT: gl.constexpr = R * W
        BN: gl.constexpr = RT * 16
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [W, 1, 1], [2, 1, 0])
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2], [1, 32, 1, 1], [W, 1, 1, 1], [3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(3, L4)
        kc0 = pid_k * cps
        nch = gl.minimum(cps, KC - kc0)
        woff = _g4_lane_offsets(pid_n, kc0, KC, NT, RT, 4, L3)  # words r = 2 hrow + wsub
        soff = _g4_lane_offsets(pid_n, kc0, KC, NT, RT, 2, LS)  # scale bytes of rows hrow
        # x chunk [BM, 4 (c), 16 (j)]: thread (g, c) reads x[g (+8), 16c .. 16c+15] (two 16-byte loads);
        # j = 8 wsub + 2 i + h is regrouped into the B operand's kappa = 16 i + 8 wsub + 2 c + h.
        XL: gl.constexpr = _g4_x_layout(BM, W)
        xm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, XL)))
        xc = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, XL)))
        xj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, XL)))
        xm3 = gl.expand_dims(gl.expand_dims(xm, 1), 2)
        xc3 = gl.expand_dims(gl.expand_dims(xc * 16, 0), 2)
        xptr = x_ptr + xm3.to(gl.int64) * stride_xm + xc3 + gl.expand_dims(gl.expand_dims(xj, 0), 1)
        xmok = xm3 < M
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        k0 = kc0 * 64
        w = gl.load(wr_ptr + woff)
        s = gl.load(sr_ptr + soff)
        if PDL:
            _pdl_enter()
        xt = gl.load(xptr + k0, mask=xmok & (k0 + xc3 < K), other=0.0)
        for it in range(nch):
            if PREFETCH:
                nx = gl.minimum(it + 1, nch - 1)
                wn = gl.load(wr_ptr + woff + nx * 128)
                sn = gl.load(sr_ptr + soff + nx * 64)
                kn = k0 + nx * 64
                xn = gl.load(xptr + kn, mask=xmok & (kn + xc3 < K), other=0.0)
            else:
                kcur = k0 + it * 64
                w = gl.load(wr_ptr + woff + it * 128)
                s = gl.load(sr_ptr + soff + it * 64)
                xt = gl.load(xptr + kcur, mask=xmok & (kcur + xc3 < K), other=0.0)
            a, b = _g4_operands(w, s, xt, RT, BN, BM, L4, a_l, b_l)
            acc = mma_v2(a, b, acc)
            if PREFETCH:
                w = wn
                s = sn
                xt = xn
        rn = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        mo = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        ymask = gl.expand_dims(rn < N, 1) & gl.expand_dims(mo < M, 0)
        acc = acc * (16384.0 / gl.load(recip_ptr))
        if PARTIAL:
            gl.store(y_ptr + (pid_k * M + gl.expand_dims(mo, 0)).to(gl.int64) * N + gl.expand_dims(rn, 1), acc,
                     mask=ymask)
        else:
            if HAS_BIAS:
                acc += gl.expand_dims(gl.load(b_ptr + rn, mask=rn < N, other=0.0).to(gl.float32), 1)
            gl.store(y_ptr + gl.expand_dims(mo.to(gl.int64) * stride_ym, 0) + gl.expand_dims(rn, 1),
                     acc.to(y_ptr.dtype.element_ty), mask=ymask)


_CHUNK_ROWS = 1024  # rows converted at once: bounds the conversion's int64 temporaries (~30 B per weight element)


def repack(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical (packed u8[N, K/2], scale e4m3[N, K/16]) -> the kernel's (words i32, scale bytes u8), as the
    module doc lays them out (converted _CHUNK_ROWS rows at a time)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if n <= _CHUNK_ROWS:
        return _repack_rows(packed, scale)
    kc = cdiv(k, 64)
    nw, ns = g4_numel(n, k)
    words = torch.empty(nw, dtype=torch.int32, device=packed.device)
    sbytes = torch.empty(ns, dtype=torch.uint8, device=packed.device)
    for r in range(0, n, _CHUNK_ROWS):
        w, sb = _repack_rows(packed[r:r + _CHUNK_ROWS], scale[r:r + _CHUNK_ROWS])
        t = r // 16
        words[t * kc * 128:t * kc * 128 + w.numel()] = w
        sbytes[t * kc * 64:t * kc * 64 + sb.numel()] = sb
    return words, sbytes


def _repack_rows(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = packed.shape[0], packed.shape[1] * 2
    nt, kc = cdiv(n, 16), cdiv(k, 64)
    dev = packed.device
    codes = torch.zeros((nt * 16, kc * 64), dtype=torch.int32, device=dev)
    p = packed.to(torch.int32)
    codes[:n, 0:k:2] = p & 15
    codes[:n, 1:k:2] = p >> 4
    sv = scale.float()
    bl = torch.zeros((nt * 16, kc * 4), dtype=torch.float32, device=dev)
    bl[:n, :k // 16] = sv
    zero = bl == 0
    bits = (bl * 2.0 ** 112).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    sb = torch.where(zero, torch.full_like(bits, ZERO_SCALE_BYTE), (((bits >> 7) - 230) << 3) | ((bits >> 4) & 7))
    if bool(((sb < 0) | ((sb > 143) & ~zero)).any()) or bool(((bits & 15) != 0).any()):
        raise ValueError("nvfp4 gluon repack: scale outside the E4M3 range (negative, NaN or not E4M3)")
    c = codes.view(nt, 2, 8, kc, 4, 2, 4, 2).to(torch.int64)  # rt, hrow, g, kc, c, wsub, i, h
    word = torch.zeros((nt, 2, 8, kc, 4, 2), dtype=torch.int64, device=dev)
    for i in range(4):
        for h in range(2):
            ci = c[..., i, h]
            word |= (ci & 7) << (6 + 16 * h - _G4_SM[i])
            word |= (ci >> 3) << (15 + 16 * h - _G4_SS[i])
    word = word.permute(0, 3, 2, 4, 1, 5).reshape(-1)  # rt, kc, g, c, hrow, wsub
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    sr = sb.view(nt, 2, 8, kc, 4).permute(0, 3, 2, 4, 1).reshape(-1).to(torch.uint8)  # rt, kc, g, c, hrow
    return word.contiguous(), sr.contiguous()


def unrepack(wr: torch.Tensor, sr: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The g4 layout (wr, sr) of an [n, k] weight -> canonical (packed u8[n, k/2], scale e4m3[n, k/16]);
    the inverse of `repack` (pure torch, any device)."""
    check_g4(wr, sr, n, k)
    if n <= _CHUNK_ROWS:
        return _unrepack_rows(wr, sr, n, k)
    kc = cdiv(k, 64)
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=wr.device)
    scale = torch.empty((n, k // 16), dtype=torch.float8_e4m3fn, device=wr.device)
    for r in range(0, n, _CHUNK_ROWS):
        m, t = min(_CHUNK_ROWS, n - r), r // 16
        nw, ns = g4_numel(m, k)
        packed[r:r + m], scale[r:r + m] = _unrepack_rows(wr[t * kc * 128:t * kc * 128 + nw],
                                                         sr[t * kc * 64:t * kc * 64 + ns], m, k)
    return packed, scale


def _unrepack_rows(wr, sr, n: int, k: int):
    nt, kc = cdiv(n, 16), cdiv(k, 64)
    w = (wr.to(torch.int64) & 0xFFFFFFFF).view(nt, kc, 8, 4, 2, 2).permute(0, 4, 2, 1, 3, 5)  # rt,hrow,g,kc,c,wsub
    codes = torch.empty((nt, 2, 8, kc, 4, 2, 4, 2), dtype=torch.uint8, device=wr.device)
    for i in range(4):
        for h in range(2):
            mag = (w >> (6 + 16 * h - _G4_SM[i])) & 7
            sign = (w >> (15 + 16 * h - _G4_SS[i])) & 1
            codes[..., i, h] = (mag | (sign << 3)).to(torch.uint8)
    codes = codes.view(nt * 16, kc * 64)[:n, :k]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    sb = sr.view(nt, kc, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(nt * 16, kc * 4)[:n, :k // 16].to(torch.int32)
    val = (((sb << 4) + (230 << 7)).to(torch.int16).view(torch.bfloat16).float() * 2.0 ** -112)
    val = torch.where(sb == ZERO_SCALE_BYTE, torch.zeros_like(val), val)
    return packed, val.to(torch.float8_e4m3fn).contiguous()


def g4_numel(n: int, k: int) -> tuple[int, int]:
    """(int32 words, scale bytes) of the g4 layout of an [n, k] weight (rows padded to 16, K to 64)."""
    nt, kc = cdiv(n, 16), cdiv(k, 64)
    return nt * kc * 128, nt * kc * 64


def check_g4(wr: torch.Tensor, sr: torch.Tensor, n: int, k: int, name: str = "nvfp4") -> None:
    """Raise ValueError unless (wr, sr) are the g4 layout's tensors of an [n, k] weight."""
    if k % 16 or n <= 0 or k <= 0:
        raise ValueError(f"{name}: g4 layout needs in_features a positive multiple of 16, got [{n}, {k}]")
    nw, ns = g4_numel(n, k)
    if wr.dtype != torch.int32 or wr.shape != (nw,) or sr.dtype != torch.uint8 or sr.shape != (ns,):
        raise ValueError(f"{name}: g4 layout of [{n}, {k}] needs int32 words [{nw}] and uint8 scales [{ns}], got "
                         f"{wr.dtype} {tuple(wr.shape)} and {sr.dtype} {tuple(sr.shape)}")


def dequantize_g4_ref(wr, sr, global_scale, n: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Torch reference: the [n, k] weight in `dtype`, equal bit for bit to fp4.nvfp4_dequantize of the canonical
    tensors (the canonical form's e2m1(code) * (scale / global_recip))."""
    from hfq_kernels.reference import fp4

    packed, scale = unrepack(wr, sr, n, k)
    return fp4.nvfp4_dequantize(packed, scale, global_scale, dtype)


@triton.jit
def _g4_value(word, eff16, I: tl.constexpr, H: tl.constexpr):
    """Code (i=I, h=H) of each word (column 2I + H of its 8-column group) times the block's scale: the code's
    magnitude and sign bits moved straight to their places in an fp16 (the value * 2^-14, exact), times
    eff16 = scale * 2^14 (so the product is e2m1 * scale rounded once, as e2m1_to_f32(code) * scale)."""
    sm: tl.constexpr = 0 if I == 0 else (3 if I == 1 else (-3 if I == 2 else 6))
    ss: tl.constexpr = 0 if I == 0 else (3 if I == 1 else (1 if I == 2 else 2))
    return f16_bits_to_f32((shift(word, 16 * H - sm - 3) & 0x0E00) | (shift(word, 16 * H - ss) & 0x8000)) * eff16


@triton.jit
def g4_decode_words(word, sb, recip, R: tl.constexpr, C: tl.constexpr):
    """Words [R, C/8] (8 consecutive columns each) and their scale bytes -> fp32 values [R, C] in column order
    (e2m1 * scale / recip, before any rounding)."""
    sb = sb.to(tl.int32)
    # the byte's bf16(scale * 2^112) as fp32 bits, exponent lowered by 112: the E4M3 scale exactly (>= 2^-9)
    sval = tl.where(sb == 208, 0.0, ((sb << 20) + (118 << 23)).to(tl.float32, bitcast=True))
    eff16 = tl.math.div_rn(sval, recip) * 16384.0
    # joins add the fastest dimension last: i1, then i0, then h, so the flat index is 4 i1 + 2 i0 + h = 2i + h
    t0 = tl.join(tl.join(_g4_value(word, eff16, 0, 0), _g4_value(word, eff16, 2, 0)),
                 tl.join(_g4_value(word, eff16, 1, 0), _g4_value(word, eff16, 3, 0)))
    t1 = tl.join(tl.join(_g4_value(word, eff16, 0, 1), _g4_value(word, eff16, 2, 1)),
                 tl.join(_g4_value(word, eff16, 1, 1), _g4_value(word, eff16, 3, 1)))
    return tl.reshape(tl.join(t0, t1), (R, C))


@triton.jit
def _g4_dequant_kernel(wr_ptr, sr_ptr, recip_ptr, out_ptr, N, K, KC, BC: tl.constexpr):
    """Row tile pid_r (16 rows) x columns BC*pid_c .. of the g4 weight -> out [N, K]: each int32 word holds 8
    consecutive columns of one row, so a row's words are read once and its columns stored contiguously."""
    rt = tl.program_id(0)
    r = tl.arange(0, 16)
    q = tl.program_id(1) * (BC // 8) + tl.arange(0, BC // 8)  # 8-column group: kc, c, wsub
    hrow = (r // 8)[:, None]
    lane = (4 * (r % 8))[:, None] + ((q % 8) // 2)[None, :]  # 4 g + c
    base = ((rt * KC + (q // 8)[None, :]) * 32 + lane).to(tl.int64)
    inb = (q < KC * 8)[None, :]  # the last program's groups past the padded K
    word = tl.load(wr_ptr + base * 4 + 2 * hrow + (q % 2)[None, :], mask=inb, other=0)
    sb = tl.load(sr_ptr + base * 2 + hrow, mask=inb, other=0)
    v = g4_decode_words(word, sb, tl.load(recip_ptr), 16, BC)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        v = f32_to_bf16_rne(v)
    else:
        v = v.to(out_ptr.dtype.element_ty)
    row = rt * 16 + r[:, None]
    col = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    tl.store(out_ptr + row.to(tl.int64) * K + col, v, mask=(row < N) & (col < K))


@triton.jit
def _g4_dequant_gather_kernel(wr_ptr, sr_ptr, recip_ptr, out_ptr, N, K, KC, BC: tl.constexpr):
    """_g4_dequant_kernel's values, one gathered word per output element (the simpler decode: the fallback)."""
    rt = tl.program_id(0)
    r = tl.arange(0, 16)
    col = tl.program_id(1) * BC + tl.arange(0, BC)
    hrow = (r // 8)[:, None]
    g = (r % 8)[:, None]
    kc = (col // 64)[None, :]
    c = ((col % 64) // 16)[None, :]
    wsub = ((col % 16) // 8)[None, :]
    i = ((col % 8) // 2)[None, :]
    h = (col % 2)[None, :]
    base = ((rt * KC + kc) * 32 + 4 * g + c).to(tl.int64)
    inb = col[None, :] < KC * 64  # the last program's columns past the padded K
    word = tl.load(wr_ptr + base * 4 + 2 * hrow + wsub, mask=inb, other=0)
    sm = tl.where(i == 0, 0, tl.where(i == 1, 3, tl.where(i == 2, -3, 6)))
    ss = tl.where(i == 0, 0, tl.where(i == 1, 3, tl.where(i == 2, 1, 2)))
    code = ((word >> (6 + 16 * h - sm)) & 7) | (((word >> (15 + 16 * h - ss)) & 1) << 3)
    sb = tl.load(sr_ptr + base * 2 + hrow, mask=inb, other=0).to(tl.int32)
    # the byte's bf16(scale * 2^112) as fp32 bits, exponent lowered by 112: the E4M3 scale exactly (>= 2^-9)
    sval = tl.where(sb == 208, 0.0, ((sb << 20) + (118 << 23)).to(tl.float32, bitcast=True))
    v = e2m1_to_f32(code) * tl.math.div_rn(sval, tl.load(recip_ptr))
    if out_ptr.dtype.element_ty == tl.bfloat16:
        v = f32_to_bf16_rne(v)
    else:
        v = v.to(out_ptr.dtype.element_ty)
    row = rt * 16 + 8 * hrow + g
    tl.store(out_ptr + row.to(tl.int64) * K + col[None, :], v, mask=(row < N) & (col[None, :] < K))


def _launch_dequant(kernel, wr, sr, recip, out, n, k):
    kernel[(cdiv(n, 16), cdiv(k, 256))](wr, sr, recip, out, n, k, cdiv(k, 64), BC=256, num_warps=4)


_FAST_CHECKED: dict = {}  # (device, dtype) -> whether _g4_dequant_kernel agreed with the gather kernel there


def _fast_ok(wr, sr, recip, out, n, k) -> bool:
    """Once per (device, dtype): run the word-wise kernel and the gather kernel on this weight and compare bit for
    bit; a build error or a difference keeps the gather kernel for that device and dtype (with a warning)."""
    key = (out.device, out.dtype)
    ok = _FAST_CHECKED.get(key)
    if ok is not None:
        return ok
    if out.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # decided outside a graph capture (the comparison syncs)
    try:
        _launch_dequant(_g4_dequant_kernel, wr, sr, recip, out, n, k)
        ref = torch.empty_like(out)
        _launch_dequant(_g4_dequant_gather_kernel, wr, sr, recip, ref, n, k)
        ints = {2: torch.int16, 4: torch.int32}[out.element_size()]
        ok = torch.equal(out.view(ints), ref.view(ints))  # bit for bit (signed zeros, NaN)
        why = "its values differ"
    except Exception as e:  # noqa: BLE001 - a build failure of the fast variant on this device
        ok, why = False, f"{type(e).__name__}: {str(e)[-300:]}"
    if not ok:
        import warnings

        warnings.warn(f"nvfp4 g4 dequantize: the word-wise kernel failed its first-use check on {key} ({why}); "
                      "using the gather kernel", RuntimeWarning, stacklevel=3)
    _FAST_CHECKED[key] = ok
    return ok


_BOUND = LRU(512)  # (kernel, n, k, dtype, device) -> BoundLaunch: launches bound per shape, pointers per call


def dequantize_g4(wr, sr, global_scale, n: int, k: int, dtype=torch.bfloat16, out=None, kernel: str = "auto"):
    """The [n, k] weight of the g4 tensors in `dtype` (Triton; bit-identical to dequantize_g4_ref). No checks:
    callers validate once (check_g4). kernel: "auto" (word-wise after its first-use check), "words", "gather"."""
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=wr.device)
    rcp = recip(global_scale)
    if kernel == "auto":
        kernel = "words" if _fast_ok(wr, sr, rcp, out, n, k) else "gather"
    kern = _g4_dequant_kernel if kernel == "words" else _g4_dequant_gather_kernel
    bound = _BOUND.get_or((kernel, n, k, out.dtype, out.device),
                          lambda: BoundLaunch(kern, (cdiv(n, 16), cdiv(k, 256)), dict(BC=256, num_warps=4)))
    bound(wr, sr, rcp, out, n, k, cdiv(k, 64))
    return out


def dequantize_g4_traced(wr, sr, global_scale, n: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    """dequantize_g4 inside a call torch.compile traces (hfq's triton_ops): launched through
    torch.library.wrap_triton, so inductor's generated code makes the launch itself. The word-wise kernel where its
    first-use check passed for this device and dtype (check_dequant), else the gather kernel."""
    from torch.library import wrap_triton

    out = torch.empty((n, k), dtype=dtype, device=wr.device)
    kern = _g4_dequant_kernel if _FAST_CHECKED.get((out.device, dtype)) else _g4_dequant_gather_kernel
    _launch_dequant(wrap_triton(kern), wr, sr, recip(global_scale), out, n, k)
    return out


_CHECK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_dequant(device: torch.device) -> None:
    """Run dequantize_g4's first-use check (word-wise kernel vs gather kernel, bit for bit) for every float dtype on
    `device` now, on a small made-up weight, for the traced calls that cannot run it (dequantize_g4_traced).
    Once per device; nothing off CUDA, under the interpreter or during a graph capture."""
    if device.type != "cuda" or INTERPRET or not HAS_TRITON or torch.cuda.is_current_stream_capturing():
        return
    todo = [dt for dt in _CHECK_DTYPES if (device, dt) not in _FAST_CHECKED]
    if not todo:
        return
    n, k = 48, 320
    nw, ns = g4_numel(n, k)
    gen = torch.Generator(device=device).manual_seed(0)
    wr = torch.randint(-2**31, 2**31 - 1, (nw,), dtype=torch.int32, device=device, generator=gen)
    sr = torch.randint(0, 144, (ns,), dtype=torch.uint8, device=device, generator=gen)
    rcp = torch.full((1,), 0.5, device=device)
    for dt in todo:
        _fast_ok(wr, sr, rcp, torch.empty((n, k), dtype=dt, device=device), n, k)


def dequantizer(wr, sr, n: int, k: int):
    """dequantize_g4 for one weight, as a per-plan closure `run(recip, dtype) -> [n, k]` (its launches are bound
    per shape inside dequantize_g4)."""

    def run(recip, dtype):
        return dequantize_g4(wr, sr, recip, n, k, dtype)

    return run


def emulate(x: torch.Tensor, wr: torch.Tensor, sr: torch.Tensor, n: int, k: int, recip) -> torch.Tensor:
    """Torch emulation of _g4_kernel's arithmetic on the repacked layout (tests check repack + decode on CPU)."""
    nt, kc = cdiv(n, 16), cdiv(k, 64)
    w = wr.to(torch.int64) & 0xFFFFFFFF
    w = w.view(nt, kc, 8, 4, 2, 2)  # rt, kc, g, c, hrow, wsub
    sbits = (sr.to(torch.int32) << 4) + (230 << 7)
    sval = (sbits.to(torch.int16).view(torch.bfloat16).float()).view(nt, kc, 8, 4, 2)
    out = torch.zeros((nt, kc, 8, 4, 2, 2, 4, 2), dtype=torch.float32)  # ..., hrow, wsub, i, h
    for i in range(4):
        sm, ss = _G4_SM[i], _G4_SS[i]
        sh = (lambda v, a: (v << a) if a >= 0 else (v >> -a))
        o = ((sh(w, sm) & 0x01C001C0) | (sh(w, ss) & 0x80008000)) & 0xFFFFFFFF
        for h in range(2):
            half = ((o >> (16 * h)) & 0xFFFF).to(torch.int32)
            half = torch.where(half >= 2 ** 15, half - 2 ** 16, half).to(torch.int16)
            out[..., i, h] = half.view(torch.bfloat16).float() * sval[..., None]
    wd = out.permute(0, 4, 2, 1, 3, 5, 6, 7).reshape(nt * 16, kc * 64)  # rt,hrow,g | kc,c,wsub,i,h
    wd = wd[:n, :k].double() * (2.0 ** 14 / float(recip.reshape(-1)[0]))
    return x.double() @ wd.T


_CACHE: dict = {}


def repacked(packed: torch.Tensor, scale: torch.Tensor):
    """Lazily built repacked copy, cached per (packed, scale) tensor object and version (in-place updates rebuild)."""
    key = (id(packed), id(scale))
    ver = (packed._version, scale._version, packed.data_ptr(), scale.data_ptr())
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is packed and hit[1]() is scale and hit[2] == ver:
        return hit[3]
    if torch.cuda.is_current_stream_capturing():
        return None
    rep = repack(packed, scale)
    _CACHE[key] = (weakref.ref(packed), weakref.ref(scale), ver, rep)
    weakref.finalize(packed, _CACHE.pop, key, None)
    return rep


_CAPABLE: dict = {}  # cuda device index -> sm_80+ (torch.cuda.get_device_capability costs microseconds per call)


def _sm80(device: torch.device) -> bool:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _CAPABLE.get(idx)
    if ok is None:
        ok = _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (8, 0)
    return ok


def device_ok(device: torch.device) -> bool:
    """Whether the Gluon kernel runs on `device` (CUDA sm_80+, gluon available, no interpreter,
    SETTINGS.gluon): there NVFP4Linear keeps its weight in the g4 layout."""
    return (HAS_GLUON and not INTERPRET and device.type == "cuda" and SETTINGS.gluon
            and _sm80(device))


def supported(x2: torch.Tensor) -> bool:
    """Whether the Gluon kernel can take x2 (bf16, M <= FEW_ROWS, CUDA sm_80+, gluon available, SETTINGS.gluon)."""
    return (HAS_GLUON and not INTERPRET and x2.is_cuda and x2.dtype == torch.bfloat16 and x2.shape[0] <= FEW_ROWS
            and SETTINGS.gluon and _sm80(x2.device))


def default_config(m: int, n: int, k: int, sms: int) -> dict:
    """Heuristic config: 2 row tiles per warp, 4 warps, split-K until ~4 programs per SM (H100, M=8, CUDA graph:
    grouped gate/up 3584 -> 2x18944 37 us at split 2 vs 47 us unsplit; down_proj 20 vs 26 us at split 19 vs 10)."""
    bm = 8 if m <= 8 else (16 if m <= 16 else (32 if m <= 32 else 64))
    r, warps = 2, 4
    tiles = cdiv(cdiv(n, 16), r * warps) * cdiv(m, bm)
    kc = cdiv(k, 64)
    split = max(1, min(kc, cdiv(4 * sms, tiles)))
    return dict(kind="gluon", BM=bm, R=r, warps=warps, split=split)


_PER_CALL = ("x_ptr", "b_ptr", "stride_xm")  # what a plan's launch compares per call (launcher's `fixed`)


def launcher(m: int, n: int, k: int, cfg: dict, split: int, cps: int, has_bias: bool, serial: bool = False,
             fixed: bool = False):
    """run(x2, wr, sr, recip, bias, dst, y_stride, x_stride=None): launch() with the grid and meta-parameters of
    this (M, N, K, config, split) worked out once (per-shape plans keep it); x_stride: x2's row stride (default
    x2.stride(0); a plan passes K for any contiguous x). dst is y [M, N] (split 1) or fp32
    partials [split, M, N]; with `serial` and split > 1, dst is y and the launch sums its splits itself
    (_g4_serial_kernel, scratch from SPLIT_SCRATCH). `fixed`: a plan's launches, whose wr, sr and recip were
    checked once (g4 dtypes, 16-byte aligned), dst is allocator-made and y_stride is N: only x2, its row stride
    and the bias are compared per call."""
    nt, kc = cdiv(n, 16), cdiv(k, 64)
    bm, r, warps = cfg["BM"], cfg["R"], cfg.get("warps", 4)
    partial = split > 1
    grid = (cdiv(nt, r * warps), cdiv(m, bm), split)
    if serial and partial:
        sbound = pdl_bound(_g4_serial_kernel, grid, dict(BM=bm, R=r, HAS_BIAS=has_bias,
                                                         PREFETCH=bool(cfg.get("prefetch", True)), num_warps=warps),
                           check=_PER_CALL if fixed else None)
        tiles = grid[0] * grid[1]

        def run_serial(x2, wr, sr, recip, bias, dst, y_stride, x_stride=None):
            dev = x2.device
            part, cnt = SPLIT_SCRATCH.get(dev, split * m * n, tiles)
            sbound.pick(dev)(x2, wr, sr, recip, bias if bias is not None else recip, part, dst, cnt, m, n, k, kc,
                             nt, x2.stride(0) if x_stride is None else x_stride, y_stride, cps)

        return run_serial
    meta = dict(BM=bm, R=r, HAS_BIAS=has_bias and not partial, PARTIAL=partial,
                PREFETCH=bool(cfg.get("prefetch", True)), num_warps=warps)

    bound = pdl_bound(_g4_kernel, grid, meta, check=_PER_CALL if fixed else None)

    def run(x2, wr, sr, recip, bias, dst, y_stride, x_stride=None):
        bound.pick(x2.device)(x2, wr, sr, recip, bias if bias is not None else recip, dst, m, n, k, kc, nt,
                              x2.stride(0) if x_stride is None else x_stride, y_stride, cps)

    return run


def group_launcher(m: int, ns: tuple, k: int, cfg: dict, split: int, cps: int, has_bias: bool):
    """run(x2, members, dsts): one _g4_group_kernel launch for 2-3 weights sharing x2 [m, k]; members are
    (wr, sr, recip, bias) with bias None or not for all; dsts their outputs [m, n_g] (split 1, bias added) or
    partials [split, m, n_g] (split > 1, bias left to the reduce)."""
    kc = cdiv(k, 64)
    bm, r, warps = cfg["BM"], cfg["R"], cfg.get("warps", 4)
    tiles = [cdiv(cdiv(n, 16), r * warps) for n in ns]
    grid = (sum(tiles), cdiv(m, bm), split)
    g = len(ns)
    meta = dict(BM=bm, R=r, HAS_BIAS=has_bias and split == 1, PARTIAL=split > 1,
                PREFETCH=bool(cfg.get("prefetch", True)), G=g, num_warps=warps)
    n0, n1 = ns[0], ns[1]
    n2 = ns[2] if g == 3 else ns[1]
    t0, t1 = tiles[0], tiles[1]
    bound = pdl_bound(_g4_group_kernel, grid, meta)

    def run(x2, members, dsts):
        args = []
        for (wr, sr, recip, bias), dst in zip(members, dsts):
            args += [wr, sr, recip, bias if bias is not None else recip, dst]
        if g == 2:
            args += args[-5:]
        bound.pick(x2.device)(x2, *args, m, k, kc, n0, n1, n2, t0, t1, x2.stride(0), cps)

    return run


_LAUNCHERS = LRU(512)  # (M, N, K, config, split, cps, bias?) -> launcher(), shared by the plans of one shape


def bound_launcher(m: int, n: int, k: int, cfg: dict, split: int, cps: int, has_bias: bool, serial: bool = False,
                   fixed: bool = False):
    """launcher() of this shape and config, made once and kept (plans made per call, e.g. the ops', share it)."""
    key = (m, n, k, tuple(sorted(cfg.items())), split, cps, has_bias, serial, fixed)
    return _LAUNCHERS.get_or(key, lambda: launcher(m, n, k, cfg, split, cps, has_bias, serial, fixed))

"""Compile the wgmma kernels for sm_90 locally (no GPU): catches layout/API errors."""
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from hfq_kernels import nvfp4_wgmma as wg

def sig_of(kernel, args, consts):
    names = kernel.arg_names
    sig, cst = {}, {}
    for name, a in zip(names, args):
        if name in consts:
            continue
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + {torch.bfloat16: "bf16", torch.int32: "i32", torch.uint8: "u8", torch.float32: "fp32"}[a.dtype]
        elif isinstance(a, int):
            sig[name] = "i32"
        else:
            sig[name] = mangle_type(a)
    for k, v in consts.items():
        sig[k] = "constexpr"; cst[(names.index(k),)] = v
    return sig, cst

def build(kernel, args, consts, warps):
    sig, cst = sig_of(kernel, args, consts)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, a) in enumerate(zip(kernel.arg_names, args))
             if name not in consts and ((isinstance(a, torch.Tensor)) or (isinstance(a, int) and a % 16 == 0))}
    src = GluonASTSource(kernel, sig, constexprs=cst, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    print(kernel.fn.__name__, consts, "warps", warps, "regs", c.n_regs if hasattr(c, "n_regs") else "?",
          "smem", c.metadata.shared, "spills", getattr(c, "n_spills", "?"))
    return c

x = torch.zeros(256, 3584, dtype=torch.bfloat16)
wr = torch.zeros(1184 * 56 * 128, dtype=torch.int32); sr = torch.zeros(1184 * 56 * 64, dtype=torch.uint8); rc = torch.zeros(1)
import subprocess, os
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
def ptxas(c, tag):
    open(f"/tmp/{tag}.ptx", "w").write(c.asm["ptx"])
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f"/tmp/{tag}.ptx", "-o", f"/tmp/{tag}.cubin"], capture_output=True, text=True)
    print(tag, [l for l in (r.stdout + r.stderr).splitlines() if "Used" in l or "C75" in l or "rror" in l])
for bm, warps, stages in [(128, 4, 4), (64, 4, 4), (256, 8, 3), (128, 8, 4)]:
    wd, sd = wg._weight_descs(wr, sr, 18944, 3584, warps)
    args = [wg._desc(x, bm, 64, 128), wd, sd, rc, x, x, 256, 18944, 56, 18944]
    ptxas(build(wg._wg_linear_kernel, args, dict(HAS_BIAS=False, STAGES=stages), warps), f"fwd_{bm}_{warps}")
for bm, stages in [(128, 4), (256, 3)]:
    wd, sd = wg._weight_descs(wr, sr, 18944, 3584, 4)
    args = [wg._desc(x, bm, 64, 128), wd, sd, rc, x, 256, 3584, 56, 296, 296]
    ptxas(build(wg._wg_grad_kernel, args, dict(STAGES=stages, PARTIAL=False), 4), f"grad_{bm}")

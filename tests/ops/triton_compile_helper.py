"""Records the Triton kernel launches of moecomm.ops under the interpreter, and compiles them
with the real compiler for a Hopper GPU, on a machine with no GPU.

Why: the interpreter (TRITON_INTERPRET=1, what the CPU tests run) accepts programs the compiler
refuses (a plain Python global read inside a @triton.jit function compiled on an H200 only as
a CompilationError). Compiling needs no device: ``triton.compile`` lowers to PTX and runs the
bundled ptxas for a target named by hand.

Run as a script, in two processes (TRITON_INTERPRET is read when triton is imported):

    TRITON_INTERPRET=1 python triton_compile_helper.py record OUT.json
        calls the public ops over small inputs in every dtype they support, with each
        kernel's launcher wrapped: one record per distinct (kernel, signature, constexprs,
        attributes), the signature from Triton's own specialization of the real arguments
        (what the GPU launcher computes: ``*bf16``, ``i32``, 1 as a constexpr, divisibility).
    python triton_compile_helper.py compile KERNELS.py RECORDS.json OUT.json
        compiles each record against the @triton.jit functions of KERNELS.py (the real module,
        or a scratch copy of it) for sm_90; one result per record, the error's text on failure.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
import traceback
from pathlib import Path

# The target the compile step builds for: the H200 (Hopper, sm_90) the GPU runs use, warp 32.
TARGET = ("cuda", 90, 32)
# The package whose @triton.jit kernels are recorded (found by their decorator in its sources).
OPS_DIR = Path(__file__).resolve().parents[2] / "python" / "moecomm" / "ops"
# A compile error's text is kept to this many characters (its first lines name the cause).
ERROR_CHARS = 2000


def jit_modules() -> list[str]:
    """The modules of moecomm.ops that define @triton.jit functions."""
    return sorted(
        f"moecomm.ops.{p.stem}" for p in OPS_DIR.glob("*.py") if "@triton.jit" in p.read_text()
    )


def _jit_functions(module) -> dict:
    """name -> the module's own @triton.jit functions (JITFunction, or InterpretedFunction
    under the interpreter: both carry the Python function as ``fn``)."""
    out = {}
    for name, obj in vars(module).items():
        fn = getattr(obj, "fn", None)
        if callable(fn) and getattr(fn, "__module__", None) == module.__name__:
            out[name] = obj
    return out


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def _specialize(value) -> tuple[str, object]:
    """(type, key) of one non-constexpr argument as JITFunction.run derives it (specialize and
    align: the defaults): ``("*bf16", "D")`` for a 16-byte aligned bfloat16 tensor, ``("i32",
    "")``, ``("constexpr", 1)`` for the int 1. Triton's own function where it has it (3.8 on);
    else the same rules by hand around its ``mangle_type`` (the GPU image's older Triton)."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        return tuple(native_specialize_impl(BaseBackend, value, False, True, True))
    except (ImportError, TypeError):
        pass
    from triton.runtime.jit import mangle_type

    if isinstance(value, int) and not isinstance(value, bool):
        if value == 1:
            return "constexpr", 1
        return mangle_type(value), "D" if value % 16 == 0 else ""
    if hasattr(value, "data_ptr"):
        return mangle_type(value), "D" if value.data_ptr() % 16 == 0 else ""
    return mangle_type(value), None


class _Recorder:
    """Stands in for a kernel in its module: ``kernel[grid](*args, **kw)`` records the launch,
    then runs the kernel (under the interpreter) as before."""

    def __init__(self, kernel, name: str, records: dict) -> None:
        self.kernel, self.name, self.records = kernel, name, records
        self.params = list(inspect.signature(kernel.fn).parameters.values())

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.records.setdefault(*self._record(args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch

    def _record(self, args, kwargs) -> tuple[str, dict]:
        from triton.backends.compiler import BaseBackend

        bound = dict(zip([p.name for p in self.params], args, strict=False))
        bound.update(kwargs)
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(self.params):
            value = bound.get(p.name, p.default)
            if _is_constexpr(p):
                signature[p.name], constexprs[p.name] = "constexpr", value
                continue
            kind, key = _specialize(value)
            signature[p.name] = kind
            if kind == "constexpr":
                constexprs[p.name] = value
            elif isinstance(key, str) and BaseBackend.parse_attr(key):
                attrs[str(i)] = BaseBackend.parse_attr(key)
        rec = {"kernel": self.name, "signature": signature, "constexprs": constexprs}
        rec["attrs"] = attrs
        return json.dumps(rec, sort_keys=True), rec


def _launch_everything() -> None:
    """The public ops over small inputs: every kernel, each dtype path it takes."""
    import torch
    from moecomm.ops.quant import Encoding, quantize
    from moecomm.ops.triton_moe import triton_group_shrink, triton_grouped_mlp_contiguous

    g = torch.Generator().manual_seed(0)
    hidden, inter, experts = 160, 24, 3  # hidden > 128: two scale blocks per row
    counts = [5, 0, 17]
    offsets = torch.zeros(experts + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    n = sum(counts)
    x = torch.randn(n, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    scores = torch.rand(n, generator=g)
    triton_group_shrink(torch.tensor(counts, dtype=torch.int32), 16, max_tiles=8)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        wa, wb = w13.to(dtype), w2.to(dtype)
        for s in (None, scores):
            triton_grouped_mlp_contiguous(x.to(dtype), offsets, wa, wb, s)
        for enc in (Encoding.FP8_E4M3, Encoding.FP8_E4M3_B128, Encoding.INT8):
            q, xs = quantize(x, enc)
            triton_grouped_mlp_contiguous(q, offsets, wa, wb, scores, x_scales=xs)


def record(out: Path) -> None:
    records: dict[str, dict] = {}
    for name in jit_modules():
        module = importlib.import_module(name)
        for fname, kernel in _jit_functions(module).items():
            if not fname.startswith("_"):  # helpers are compiled inside the kernels
                setattr(module, fname, _Recorder(kernel, fname, records))
    _launch_everything()
    kernels = sorted(
        fname
        for name in jit_modules()
        for fname, obj in vars(importlib.import_module(name)).items()
        if isinstance(obj, _Recorder)
    )
    out.write_text(json.dumps({"kernels": kernels, "records": list(records.values())}, indent=1))


def compile_all(kernels_file: Path, records: list, out: Path) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    spec = importlib.util.spec_from_file_location(f"scratch_{kernels_file.stem}", kernels_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    results = []
    for rec in records:
        fn = getattr(module, rec["kernel"])
        attrs = {(int(i),): v for i, v in rec["attrs"].items()}
        try:
            src = triton.compiler.ASTSource(
                fn=fn, signature=rec["signature"], constexprs=rec["constexprs"], attrs=attrs
            )
            compiled = triton.compile(src, target=GPUTarget(*TARGET))
            results.append({"ok": True, "cubin_bytes": len(compiled.asm["cubin"])})
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
            results.append({"ok": False, "error": text[:ERROR_CHARS]})
    out.write_text(json.dumps(results, indent=1))


def main(argv: list[str]) -> int:
    if argv[:1] == ["record"] and len(argv) == 2:
        record(Path(argv[1]))
        return 0
    if argv[:1] == ["compile"] and len(argv) == 4:
        records = json.loads(Path(argv[2]).read_text())["records"]
        compile_all(Path(argv[1]), records, Path(argv[3]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Compile the Triton gather/scatter kernel ahead of time for real GPU targets, without a GPU.

Run as a script in a process WITHOUT TRITON_INTERPRET (the interpreter replaces the compiler):
``python tests/unit/aot_compile_kernels.py 80 90``. Triton bundles ptxas, so this lowers the
kernel, specialised for each direction (its ``GATHER`` constexpr) and word, through TTIR, TTGIR,
LLVM IR and PTX down to a cubin, and a lowering error fails it. Prints one JSON line per variant.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvstage.staging import triton_kernels as tk

#: machine word -> Triton pointer type of the region (and of the tensors behind the table)
WORDS = {"int64": "*i64", "int32": "*i32", "int16": "*i16", "uint8": "*u8"}
SCALARS = ("rows", "items_per_index", "heads", "h0", "span", "row_words")


def signature(fn, word: str) -> dict[str, str]:
    types = {"table_ptr": "*i64", "region_ptr": WORDS[word], "index_ptr": "*i64",
             **{name: "i32" for name in SCALARS}, "GATHER": "constexpr", "BLOCK_R": "constexpr",
             "BLOCK_W": "constexpr"}
    return {name: types[name] for name in fn.arg_names}  # KeyError: a new kernel argument


def main(caps: list[int]) -> None:
    block_r, block_w = tk.tile_shape(128)
    fn = tk.copy_rows_kernel
    for cap in caps:
        for direction in ("gather", "scatter"):
            for word in WORDS:
                src = ASTSource(fn, signature(fn, word),
                                {"GATHER": direction == "gather", "BLOCK_R": block_r, "BLOCK_W": block_w})
                k = triton.compile(src, target=GPUTarget("cuda", cap, 32))
                ptx = k.asm["ptx"]
                widths = sorted({int(b) for b in re.findall(r"st\.global(?:\.v\d)?\.b(\d+)", ptx)})
                print(json.dumps({
                    "cap": cap, "kernel": fn.__name__, "direction": direction, "word": word,
                    "cubin_elf": bytes(k.asm["cubin"][:4]) == b"\x7fELF", "cubin_bytes": len(k.asm["cubin"]),
                    "ptx_target": f".target sm_{cap}" in ptx, "ptx_entry": f".entry {fn.__name__}" in ptx,
                    "store_bits": widths, "ptx_sha256": hashlib.sha256(ptx.encode()).hexdigest(),
                }), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [80, 90])

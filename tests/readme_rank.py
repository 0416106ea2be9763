"""One rank of the README's embedding example, run as it stands in README.md.

    python tests/readme_rank.py ROLE BOOTSTRAP OUT.npz

Runs the example's common block, sets its BOOTSTRAP to the test's server, runs ROLE's block
(prefill or decode), then saves what the request moved as raw integers (no pickle): the K and V
rows of the request's pages (prefill: `pages`, decode: `dst_pages`) and the aux pool (prefill)
or the first token the decode read (decode).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from doc_snippets import readme_example  # noqa: E402


def main() -> None:
    role, bootstrap, out = sys.argv[1:4]
    parts = readme_example()
    ns: dict = {"__name__": "readme_example"}
    exec(compile(parts["common"], "README.md (common)", "exec"), ns)
    ns["BOOTSTRAP"] = bootstrap
    exec(compile(parts[role], f"README.md ({role})", "exec"), ns)
    pages = ns["pages" if role == "prefill" else "dst_pages"]
    page_size = ns["k"][0].shape[0] // ns["PAGES"]
    rows = torch.tensor([p * page_size + i for p in pages for i in range(page_size)])
    kv = torch.stack([t.index_select(0, rows) for t in ns["k"] + ns["v"]])
    saved = {"kv": kv.view(torch.int16).numpy()}
    if role == "prefill":
        saved["aux"] = ns["aux"].tensors[0].numpy()
    else:
        saved["first_token"] = np.array([ns["first_token"]])
    np.savez(out, **saved)


if __name__ == "__main__":
    main()

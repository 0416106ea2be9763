"""The SGLang adapter's tests run in the SGLang venv (`make test-sglang`); elsewhere (the main
venv of `make test`) there is no SGLang, and this folder is not collected at all."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("sglang") else ["*"]

"""The vLLM connector's tests run in .venv-vllm (`make test-vllm`); vLLM is not in .venv."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

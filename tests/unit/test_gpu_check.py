"""examples/gpu_check.py's step 5 (the SGLang adapter's scheduler-class tests with CUDA KV caches)
and its verdict rules, without a GPU: which Python runs the step, a step not run names its reason
and fails nothing, a failed step fails the check. The steps themselves are replaced here; they run
only on a GPU (`make gpu-check`)."""

from __future__ import annotations

import sys

import pytest
import torch

from kvstage.support import gpu_check
from kvstage.support.gpu_check import Outcome, SGLangProbe, StepResult


def test_the_first_python_with_sglang_and_cuda_runs_the_step():
    none, cpu, gpu = SGLangProbe("/a", "", True), SGLangProbe("/b", "0.5.23", False), SGLangProbe("/c", "0.5.23", True)
    assert gpu_check.choose_sglang([none, cpu, gpu]) is gpu
    assert gpu_check.choose_sglang([none]) == "SGLang not installed (tried /a)"
    why = gpu_check.choose_sglang([none, cpu])
    assert isinstance(why, str) and "SGLang 0.5.23 at /b" in why and "without CUDA" in why


def test_which_pythons_are_asked(tmp_path):
    venv = tmp_path / "python"
    assert gpu_check.sglang_pythons("/x/python", "/cur", venv) == ["/x/python"]
    assert gpu_check.sglang_pythons(None, "/cur", venv) == ["/cur"]
    venv.touch()
    assert gpu_check.sglang_pythons(None, "/cur", venv) == ["/cur", str(venv)]
    assert gpu_check.sglang_pythons(None, str(venv), venv) == [str(venv)]


def test_probe_of_a_python_without_sglang(tmp_path):
    """This venv has no SGLang; a Python that is not there, or answers nonsense, offers nothing."""
    assert gpu_check.probe_sglang(sys.executable) == SGLangProbe(sys.executable, "", False)
    assert gpu_check.probe_sglang(str(tmp_path / "none")) == SGLangProbe(str(tmp_path / "none"), "", False)
    answers = {"with-cuda": "0.5.23 True True", "cpu-torch": "0.5.23 False False", "nonsense": "Traceback"}
    for name, line in answers.items():
        (tmp_path / name).write_text(f"#!/bin/sh\necho {line}\n")
        (tmp_path / name).chmod(0o755)
    assert gpu_check.probe_sglang(str(tmp_path / "with-cuda")) == SGLangProbe(str(tmp_path / "with-cuda"), "0.5.23",
                                                                             True, True)
    assert gpu_check.probe_sglang(str(tmp_path / "cpu-torch")) == SGLangProbe(str(tmp_path / "cpu-torch"), "0.5.23",
                                                                             False, False)
    assert gpu_check.probe_sglang(str(tmp_path / "nonsense")).sglang == ""


def test_a_step_not_run_fails_nothing_and_says_why():
    ok, not_run = StepResult("kernels", Outcome.OK, 3.0), StepResult("sglang adapter", Outcome.NOT_RUN, why="SGLang not installed")
    assert gpu_check.verdict([ok, not_run]) == "PASS"
    assert gpu_check.verdict([ok, not_run, StepResult("transfer", Outcome.FAILED, 1.0)]) == "FAIL"
    assert gpu_check.step_line(not_run) == "gpu-check: sglang adapter: NOT RUN: SGLang not installed"
    line = gpu_check.verdict_line("H100", [ok, not_run], ["Mooncake on VRAM not run"])
    assert line == ("gpu-check: PASS on H100: kernels ok, sglang adapter NOT RUN (SGLang not installed); "
                    "Mooncake on VRAM not run")


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as far as main() asks, every step a command recorded instead of run."""
    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "FakeGPU")

    def step(name, cmd, env):
        ran.append((name, cmd, env))
        return StepResult(name, Outcome.FAILED if name in fail else Outcome.OK, 1.0)

    fail: set = set()
    monkeypatch.setattr(gpu_check, "step", step)
    return ran, fail


def test_without_sglang_the_step_is_not_run_and_the_check_passes(fake_gpu, monkeypatch, capsys):
    ran, _ = fake_gpu
    monkeypatch.setattr(gpu_check, "probe_sglang", lambda py: SGLangProbe(py, "", True))
    assert gpu_check.main(["--no-bench", "--sglang-python", "/no/sglang"]) == 0
    out = capsys.readouterr().out
    assert "gpu-check: sglang adapter: NOT RUN: SGLang not installed (tried /no/sglang)" in out
    assert ("gpu-check: PASS on FakeGPU: kernels ok, transfer ok, kernel benchmark ok, sglang adapter NOT RUN "
            "(SGLang not installed (tried /no/sglang))") in out
    assert [name for name, *_ in ran] == ["kernels", "transfer", "kernel benchmark"]


def test_with_sglang_the_cuda_tests_run_with_the_shims(fake_gpu, monkeypatch, capsys):
    ran, fail = fake_gpu
    monkeypatch.setattr(gpu_check, "probe_sglang", lambda py: SGLangProbe(py, "0.5.23", True))
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert gpu_check.main(["--no-bench", "--sglang-python", "/sgl/python"]) == 0
    name, cmd, env = ran[-1]
    assert name == "sglang adapter" and cmd[:3] == ["/sgl/python", "-m", "pytest"]
    assert cmd[-1] == "tests/sglang_adapter/test_cuda_scheduler_classes.py"   # no Mooncake CUDA build there
    assert env["PYTHONPATH"].split(":") == ["tests/sglang_adapter/shims", "/tmp/site"]
    monkeypatch.setattr(gpu_check, "probe_sglang", lambda py: SGLangProbe(py, "0.5.23", True, mooncake_cuda=True))
    assert gpu_check.main(["--no-bench", "--sglang-python", "/sgl/python"]) == 0
    assert ran[-1][1][-2:] == ["tests/sglang_adapter/test_cuda_scheduler_classes.py",
                               "tests/sglang_adapter/test_cuda_mooncake_scheduler_classes.py"]
    fail.add("sglang adapter")
    assert gpu_check.main(["--no-bench", "--sglang-python", "/sgl/python"]) == 1
    assert "gpu-check: FAIL on FakeGPU:" in capsys.readouterr().out.splitlines()[-1]


def test_the_named_test_modules_exist():
    from pathlib import Path
    root = Path(gpu_check.__file__).resolve().parent.parent
    assert (root / gpu_check.SGLANG_CUDA_TESTS).is_file() and (root / gpu_check.SGLANG_MOONCAKE_TESTS).is_file()
    assert (root / gpu_check.SGLANG_SHIMS / "sgl_kernel").is_dir()

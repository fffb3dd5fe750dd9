"""scripts/prune_torch_leftovers.py, the README test command's step that uninstalls the GPU
companions (``triton``, ``nvidia-*``, ``cuda-*``) a replaced PyTorch left behind.

The README's two commands in order: the main command installs PyPI's newest torch (a CUDA build,
with ``triton`` and the CUDA wheels); the test command's constraints replace it by the pinned CPU
build, and pip leaves the companions, required by nothing, behind; the suite then crashed where
``torch._dynamo`` imported that ``triton``. The pure-logic tests cover the rule on metadata; the
last test replays that sequence with pip in a fresh virtual environment on small wheels built
here (a real two-install run pulls several GB; ``scripts/readme_sequence.sh`` runs that one)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def _load():
    spec = importlib.util.spec_from_file_location("prune_torch_leftovers",
                                                  REPO / "scripts" / "prune_torch_leftovers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


prune = _load()
Dist = prune.Dist

# torch 2.14.1's Linux requirements on PyPI (its CUDA build) and the CUDA wheels' own
TORCH_CUDA = Dist("torch", "2.14.1", frozenset({"filelock", "sympy", "cuda-toolkit", "cuda-bindings",
                                                "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "triton"}), "pip", True)
TORCH_CPU = Dist("torch", "2.13.0+cpu", frozenset({"filelock", "sympy"}), "pip", False)
GPU_COMPANIONS = [
    Dist("triton", "3.8.0", frozenset(), "pip"),
    Dist("cuda-toolkit", "13.0.3", frozenset({"nvidia-cublas", "nvidia-cuda-runtime"}), "pip"),
    Dist("cuda-bindings", "13.0.3", frozenset({"cuda-pathfinder"}), "pip"),
    Dist("cuda-pathfinder", "1.3.0", frozenset(), "pip"),
    Dist("nvidia-cudnn-cu13", "9.24.0.43", frozenset({"nvidia-cublas"}), "pip"),
    Dist("nvidia-nccl-cu13", "2.30.7", frozenset(), "pip"),
    Dist("nvidia-cublas", "13.0.2", frozenset(), "pip"),
    Dist("nvidia-cuda-runtime", "13.0.96", frozenset(), "pip"),
]
OTHERS = [Dist("filelock", "3.20.0", frozenset(), "pip"), Dist("sympy", "1.14.0", frozenset({"mpmath"}), "pip"),
          Dist("mpmath", "1.3.0", frozenset(), "pip")]


def _names(dists):
    return [d.name for d in dists]


def test_a_replaced_cuda_torch_leaves_companions_that_all_go() -> None:
    left = prune.leftovers([TORCH_CPU, *GPU_COMPANIONS, *OTHERS])
    assert _names(left) == sorted(_names(GPU_COMPANIONS))


def test_a_cuda_torch_keeps_every_companion() -> None:
    """The main command's GPU environment is left as it is."""
    assert prune.leftovers([TORCH_CUDA, *GPU_COMPANIONS, *OTHERS]) == []


@pytest.mark.parametrize("keeper", [
    # a triton the user asked for by name
    Dist("triton", "3.8.0", frozenset(), "pip", requested=True),
    # installed by conda (pip would uninstall it behind conda's back)
    Dist("triton", "3.8.0", frozenset(), "conda"),
])
def test_a_companion_the_user_chose_stays(keeper) -> None:
    rest = [d for d in GPU_COMPANIONS if d.name != "triton"]
    left = prune.leftovers([TORCH_CPU, keeper, *rest, *OTHERS])
    assert "triton" not in _names(left) and len(left) == len(rest)


def test_a_requirement_under_any_marker_or_extra_keeps_a_companion() -> None:
    """TensorFlow's ``[and-cuda]`` extra and JAX's CUDA plugin name the CUDA wheels under an extra:
    the script keeps whatever any installed distribution names, installed extra or not."""
    tf = Dist("tensorflow", "2.21.0", frozenset({"nvidia-cublas", "nvidia-cudnn-cu13"}), "pip", True)
    left = _names(prune.leftovers([TORCH_CPU, tf, *GPU_COMPANIONS, *OTHERS]))
    assert "nvidia-cublas" not in left and "nvidia-cudnn-cu13" not in left
    assert "triton" in left and "nvidia-nccl-cu13" in left


def test_only_gpu_companions_are_ever_removed() -> None:
    """An orphan outside the family (a library the user installed and forgot) is not the script's."""
    orphans = [Dist("requests", "2.32.0", frozenset(), "pip"), Dist("tritonclient", "2.0", frozenset(), "pip"),
               Dist("nvidia-ml-py", "13.0", frozenset(), "pip")]
    left = _names(prune.leftovers([TORCH_CPU, *orphans, *OTHERS]))
    assert left == []
    assert prune.is_companion("pytorch_triton_rocm") and prune.is_companion("Triton")
    assert prune.is_companion("nvidia-cudnn-cu12") and prune.is_companion("nvidia_cuda_runtime")
    assert prune.is_companion("nvidia-cusparselt-cu13") and prune.is_companion("nvidia-nvshmem-cu13")
    assert not prune.is_companion("tritonclient") and not prune.is_companion("torch")
    assert not prune.is_companion("nvidia-ml-py") and not prune.is_companion("nvidia-dali-cuda120")


def _dist_info(site: Path, name: str, version: str, requires: list[str], installer: str | None = "pip",
               requested: bool = False) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    if installer is not None:
        (info / "INSTALLER").write_text(installer + "\n")
    if requested:
        (info / "REQUESTED").write_text("")


def test_installed_reads_metadata_installer_and_requested(tmp_path: Path) -> None:
    _dist_info(tmp_path, "torch", "2.13.0+cpu", ["filelock", 'optree>=0.13.0; extra == "optree"'], requested=True)
    _dist_info(tmp_path, "triton", "3.8.0", [])
    _dist_info(tmp_path, "nvidia_cudnn_cu13", "9.24.0.43", ["nvidia-cublas"], installer=None)
    found = {d.name: d for d in prune.installed([str(tmp_path)])}
    assert found["torch"].requires == {"filelock", "optree"} and found["torch"].requested
    assert found["triton"].installer == "pip" and not found["triton"].requested
    assert found["nvidia-cudnn-cu13"].installer == ""
    assert _names(prune.leftovers(found.values())) == ["triton"]  # not pip's: left alone
    assert prune.main(["--path", str(tmp_path)]) == 0  # lists only


# --- the sequence with pip, on small wheels -----------------------------------------------------

def _wheel(where: Path, name: str, version: str, requires: list[str]) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = where / f"{dist}-py3-none-any.whl"
    meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *[f"Requires-Dist: {r}" for r in requires]]) + "\n"
    wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}_pkg/__init__.py", "")
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL", wheel)
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pip_sequence_gpu_torch_then_pinned_cpu_torch_then_prune(tmp_path: Path) -> None:
    """As the README's commands run: a project whose extra takes the newest torch (here a stand-in,
    ``hvdtest-torch`` 2.0, that requires ``triton`` and a CUDA wheel that requires another), then
    the test command's install with a constraint pinning 1.0 (no GPU requirement): pip leaves the
    three companions; the script removes them, ``pip check`` is clean, and a second run finds
    nothing. Before, with 2.0 installed, the script keeps everything."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "hvdtest-torch", "2.0", ["triton==9.9", "nvidia-cudnn-hvdtest"])
    _wheel(wheels, "hvdtest-torch", "1.0", [])
    _wheel(wheels, "triton", "9.9", [])
    _wheel(wheels, "nvidia-cudnn-hvdtest", "1.0", ["nvidia-cublas-hvdtest"])
    _wheel(wheels, "nvidia-cublas-hvdtest", "1.0", [])
    _wheel(wheels, "hvdtest-app", "1.0", ["hvdtest-torch>=1.0"])
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=240)
    py = str(venv / "bin" / "python")
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONPATH": ""}
    env.pop("PIP_CONSTRAINT", None)

    def run(*args: str) -> str:
        res = subprocess.run([py, *args], env=env, capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, f"{args}: {res.stdout}\n{res.stderr}"
        return res.stdout

    def pip_list() -> set[str]:
        return {line.split()[0] for line in run("-m", "pip", "list", "--format=freeze").splitlines()
                for line in [line.replace("==", " ")]}

    script = str(REPO / "scripts" / "prune_torch_leftovers.py")
    run("-m", "pip", "install", "hvdtest-app")  # the main command: the newest torch, its companions
    assert {"triton", "nvidia-cudnn-hvdtest", "nvidia-cublas-hvdtest"} <= pip_list()
    assert "no GPU companion" in run(script)  # the GPU environment stays as it is
    assert {"triton", "nvidia-cudnn-hvdtest", "nvidia-cublas-hvdtest", "hvdtest-torch"} <= pip_list()
    (tmp_path / "ci.txt").write_text("hvdtest-torch==1.0\n")
    run("-m", "pip", "install", "hvdtest-app", "-c", str(tmp_path / "ci.txt"))  # the test command
    assert {"triton", "nvidia-cudnn-hvdtest", "nvidia-cublas-hvdtest"} <= pip_list()  # what pip leaves
    out = run(script)
    assert "triton==9.9" in out and "nvidia-cudnn-hvdtest==1.0" in out, out
    left = pip_list()
    assert not {"triton", "nvidia-cudnn-hvdtest", "nvidia-cublas-hvdtest"} & left, left
    assert {"hvdtest-app", "hvdtest-torch"} <= left
    run("-m", "pip", "check")
    assert "no GPU companion" in run(script)


def test_ci_runs_the_readmes_test_command_and_it_prunes_after_installing() -> None:
    """The README's test command prunes between its install and the suite (after the install: the
    torch it keeps is known), and ``.ci/run`` runs that step (each of the command's parts, in order:
    tests/unit/scripts/test_ci_script.py)."""
    readme = (REPO / "README.md").read_text().splitlines()
    (command,) = [line for line in readme if line.startswith('pip install -e ".[test,docs]"')]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "python scripts/prune_torch_leftovers.py" in ci, ".ci/run does not prune"
    parts = command.split(" && ")
    assert parts[0].startswith("pip install") and parts[1] == "python scripts/prune_torch_leftovers.py", parts
    assert parts[-1] == "python -m pytest -q tests", parts
    script = (REPO / "scripts" / "readme_sequence.sh").read_text()
    assert "README.md" in script and "prune_torch_leftovers.py" in script

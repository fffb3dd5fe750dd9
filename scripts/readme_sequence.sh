#!/usr/bin/env bash
# The README's two commands in order, as a newcomer runs them: a clean clone, one fresh virtual
# environment, the main command (its install pulls PyPI's newest PyTorch: a CUDA build, several GB),
# then the test command's install and its pruning step, `pip check`, and the tests named here
# (default: the elastic chaos file, where a stale triton crashed the suite, and the fast tier).
# Too slow for CI (two framework installs); tests/unit/scripts/test_prune_torch_leftovers.py
# replays the sequence on small wheels there.
#
#   scripts/readme_sequence.sh [--keep] [REPO] [-- PYTEST ARGS...]
#
# REPO: a path or URL to clone (default: this checkout; commit first, a clone takes commits only).
# The work folder (clone and venv) is removed at the end unless --keep.
set -euo pipefail
keep=0
if [[ "${1:-}" == "--keep" ]]; then keep=1; shift; fi
repo="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
[[ $# -gt 0 ]] && shift
[[ "${1:-}" == "--" ]] && shift
work="$(mktemp -d "${TMPDIR:-/tmp}/readme-sequence.XXXXXX")"
cleanup() { if [[ $keep == 0 ]]; then rm -rf "$work"; else echo "kept $work"; fi; }
trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH
git clone -q "$repo" "$work/clone"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
cd "$work/clone"
step() { echo; echo "== $*"; }
main_cmd=$(grep -m1 '^pip install ".\[torch,examples\]" && horovodrun' README.md)
test_cmd=$(grep -m1 '^pip install -e ".\[test,docs\]"' README.md)
install_part=${test_cmd% && python -m pytest*}
step "main command: $main_cmd"
bash -c "$main_cmd"
pip list 2>/dev/null | grep -Ei '^(torch|triton|nvidia-|cuda-)' || true
step "test command's install: $install_part"
bash -c "$install_part"
step "pip check"
pip check
pip list 2>/dev/null | grep -Ei '^(torch|triton|nvidia-|cuda-)' || true
python scripts/prune_torch_leftovers.py --dry-run | grep -q 'no GPU companion' \
  || { echo "GPU companions of another PyTorch are still installed"; exit 1; }
if [[ $# -gt 0 ]]; then
  step "python -m pytest $*"
  python -m pytest "$@"
else
  step "python -m pytest -q tests/elastic/test_elastic_chaos.py"
  python -m pytest -q tests/elastic/test_elastic_chaos.py
  step "python -m pytest -q -m 'not slow' tests"
  python -m pytest -q -m "not slow" tests
fi
echo "README sequence passed"

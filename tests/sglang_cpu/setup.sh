#!/usr/bin/env bash
# Test infrastructure: a virtual environment in which real SGLang (the version constraints-gpu.txt pins) serves on
# this CPU machine, for the tests that hold the engine client, weight sync and the CPU engine to what SGLang answers.
#    bash tests/sglang_cpu/setup.sh          # ~3.3 GB in .venv-sglang-cpu/, 3-5 min; a no-op when up to date
# SGLang goes in with --no-deps next to torch's CPU build and the frozen list in requirements.txt; the two stand-ins
# it needs on CPU (shims/: an import-only sgl_kernel, torchvision op schemas) are put on the servers' PYTHONPATH by
# the tests, never installed. SGLANG_CPU_VENV=DIR puts the environment elsewhere.
set -euo pipefail
HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
ROOT="$(cd -- "${HERE}/../.." && pwd)"
VENV="${SGLANG_CPU_VENV:-${ROOT}/.venv-sglang-cpu}"

pinned() {  # pinned NAME: the version constraints-gpu.txt pins
   sed -n "s/^$1==\([^ ]*\).*/\1/p" "${ROOT}/constraints-gpu.txt"
}
SGLANG="$(pinned sglang)"
ROUTER="$(pinned sglang-router)"
STAMP="sglang==${SGLANG} sglang-router==${ROUTER} $(sha256sum "${HERE}/requirements.txt" "${ROOT}/constraints.txt" | cut -c1-16 | tr '\n' ' ')"

if [[ -f "${VENV}/installed" && "$(cat "${VENV}/installed")" == "${STAMP}" ]]; then
   echo "SGLang ${SGLANG} test venv is up to date: ${VENV}"
   exit 0
fi
PYTHON="$(command -v python3.11 || command -v python3)"
rm -rf "${VENV}"
"${PYTHON}" -m venv "${VENV}"
"${VENV}/bin/pip" install -q --upgrade pip
"${VENV}/bin/pip" install -q -c "${ROOT}/constraints.txt" torch -r "${HERE}/requirements.txt"
"${VENV}/bin/pip" install -q --no-deps "sglang==${SGLANG}" "sglang-router==${ROUTER}"
echo "${STAMP}" >"${VENV}/installed"
echo "SGLang ${SGLANG} test venv ready: ${VENV}"

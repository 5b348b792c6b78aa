#!/usr/bin/env bash
# enginewire's campaign and fault matrix against vLLM 0.33's real SyncMPClient/AsyncMPClient
# (issue #33, docs/vllm.md), in one command:
#
#     bash scripts/vllm_harness.sh [RESULTS_DIR]          # default results/vllm
#
# Sets up (once) a separate environment with vLLM 0.33.0 and this checkout installed
# editable (VLLM_VENV, default ../vllm-venv beside the checkout; about 9.5 GB: vLLM pins
# torch 2.14; vllm._C need not import, the client layer does not use it), then runs:
#   1. tests/vllm (the wire profile against vLLM's own structs; both clients end to end);
#   2. the campaign on each client (CAMPAIGN_ARGS, default --examples 10 --steps 25 --seed 1);
#   3. the quick fault matrix on each client (the cells vLLM's declared contract rules out
#      are reported n/a, with the declaration; docs/vllm.md has the verdicts).
# Everything runs under nice (the campaign starts engines often). Exit status: 0 when
# every step ran, whatever it found (findings are the point); 1 when a step could not run.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VLLM_VENV:-$here/../vllm-venv}"
out="${1:-$here/results/vllm}"
campaign_args="${CAMPAIGN_ARGS:---examples 10 --steps 25 --seed 1}"
mkdir -p "$out"

if ! "$venv/bin/python" -c "import vllm.v1.engine.core_client" 2>/dev/null; then
  echo "== setting up $venv (vllm==0.33.0; minutes, ~9.5 GB)"
  python3 -m venv "$venv" || exit 1
  "$venv/bin/pip" install "vllm==0.33.0" || exit 1
fi
if ! "$venv/bin/python" -c "import enginewire.testing.vllm_factory, hypothesis, pytest" \
    2>/dev/null; then
  "$venv/bin/pip" install --no-deps -e "$here" || exit 1
  "$venv/bin/pip" install "hypothesis>=6.100" "pytest>=8" "pytest-timeout>=2.2" || exit 1
fi

py="$venv/bin/python"
ew="$venv/bin/enginewire"
status=0
cd "$here" || exit 1

echo "== tests/vllm"
nice -n 10 "$py" -m pytest tests/vllm -q -p no:cacheprovider 2>&1 | tee "$out/tests.txt"
[ "${PIPESTATUS[0]}" -le 1 ] || status=1

for kind in sync async; do
  echo "== campaign, vLLM $kind client"
  # shellcheck disable=SC2086
  nice -n 10 "$ew" campaign --client "$kind" \
    --factory "enginewire.testing.vllm_factory:vllm_$kind" $campaign_args \
    --results-dir "$out/campaign-$kind" 2>&1 | tee "$out/campaign-$kind.txt"
  [ "${PIPESTATUS[0]}" -le 1 ] || status=1
  echo "== fault matrix, vLLM $kind client"
  nice -n 10 "$ew" faults matrix --quick --client "$kind" \
    --factory "enginewire.testing.vllm_factory:vllm_$kind" \
    --results-dir "$out/matrix-$kind" 2>&1 | tee "$out/matrix-$kind.txt"
  [ "${PIPESTATUS[0]}" -le 1 ] || status=1
done
echo "== results in $out (docs/vllm.md says how to read them)"
exit "$status"

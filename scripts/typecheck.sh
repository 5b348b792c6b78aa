#!/usr/bin/env bash
# mypy cannot follow setuptools' editable-install finder for our package-dir mapping, so we
# lay the package out as it installs (symlinks) and check it there: the whole package, strict
# for spec/ and protocol/ (pyproject overrides).
set -euo pipefail
# A relative MYPY path (e.g. .venv/bin/mypy) means relative to where the caller stands.
if [[ -n "${MYPY:-}" && "$MYPY" == */* && "$MYPY" != /* ]]; then MYPY="$PWD/$MYPY"; fi
cd "$(dirname "$0")/.."
root=$PWD
stage=build/typecheck
rm -rf "$stage"; mkdir -p "$stage/enginewire"
for f in enginewire/*.py; do ln -s "$root/$f" "$stage/$f"; done
ln -s "$root/enginewire/_tools" "$stage/enginewire/_tools"
ln -s "$root/spec" "$stage/enginewire/spec"
ln -s "$root/protocol" "$stage/enginewire/protocol"
ln -s "$root/runtime" "$stage/enginewire/runtime"
ln -s "$root/model_tests" "$stage/enginewire/testing"
ln -s "$root/benchmarks" "$stage/enginewire/benchmarks"
cd "$stage"
"${MYPY:-$root/.venv/bin/mypy}" --config-file "$root/pyproject.toml" -p enginewire

#!/usr/bin/env bash
# `make molecule [SCENARIO=name]`: every molecule scenario (or one), each the full sequence (destroy, syntax, create,
# prepare, converge, idempotence, verify, destroy) against network-namespace SSH test hosts. Prints each scenario's
# time. Needs root (network namespaces, chroot).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH" ANSIBLE_FORCE_COLOR=0 PY_COLORS=0 NO_COLOR=1
scenarios=("$@")
if [ ${#scenarios[@]} -eq 0 ]; then
  for d in molecule/*/molecule.yml; do scenarios+=("$(basename "$(dirname "$d")")"); done
fi
summary=()
status=0
for s in "${scenarios[@]}"; do
  start=$(date +%s)
  if molecule test -s "$s"; then result=passed; else result=failed; status=1; fi
  summary+=("molecule: scenario $s $result in $(( $(date +%s) - start )) s")
done
printf '%s\n' "${summary[@]}"
exit $status

#!/usr/bin/env bash
# `make molecule [SCENARIO=name]`: every molecule scenario (or one), each the full sequence (destroy, syntax, create,
# prepare, converge, idempotence, verify, destroy) against network-namespace SSH test hosts. Prints each scenario's
# time. Needs root (network namespaces, chroot).
#
# MOLECULE_JOBS=N runs N scenarios at once (default 3: the three at once, so make test waits for the longest, not
# for two in a row; 1: one after another, output live). They share nothing but the wheelhouse, built here first:
# each has its own namespaces (scom-<scenario>-<host>), files (/var/tmp/sco-molecule/<scenario>/) and, below, its
# own SSH ControlMaster sockets (two scenarios' hosts may have the same ansible_host, and OpenSSH keys a master by
# host, port and user: it would carry one's commands to the other).
# Each scenario's output goes to .work/molecule/<scenario>.log, printed whole when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH" ANSIBLE_FORCE_COLOR=0 PY_COLORS=0 NO_COLOR=1
jobs=${MOLECULE_JOBS:-3}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "molecule: MOLECULE_JOBS=$jobs: expected a positive integer" >&2; exit 2; }
scenarios=("$@")
if [ ${#scenarios[@]} -eq 0 ]; then
  # every scenario but the opt-in ones (a file `opt-in` beside molecule.yml says why: hall-ha does not fit in CI's
  # time); those run when named (make molecule SCENARIO=hall-ha)
  for d in molecule/*/molecule.yml; do
    s=$(basename "$(dirname "$d")")
    if [ -f "molecule/$s/opt-in" ]; then
      echo "molecule: scenario $s left out (opt-in, run it by name: $(head -n1 "molecule/$s/opt-in"))"
      continue
    fi
    scenarios+=("$s")
  done
fi
# The wheels the roles install from, built for this checkout's sources (the scenarios' inventories read the
# variable: a shared name would be repointed by another checkout's run on the same machine). Built once, here,
# before scenarios running at once look for it.
SCO_MOLECULE_WHEELHOUSE=$("$VENV/bin/python" molecule/shared/hosts.py wheelhouse)
export SCO_MOLECULE_WHEELHOUSE
logs=$PWD/.work/molecule
mkdir -p "$logs"

stamp() {  # each line with the time it came; molecule's step lines (Executing/Executed) also into $1, in epoch s
  local l
  while IFS= read -r l; do
    printf '%(%T)T %s\n' -1 "$l"
    case $l in *"] Executing"* | *"] Executed"*) printf '%(%s)T %s\n' -1 "$l" >>"$1" ;; esac
  done
}

steps() {  # "converge 120 s, idempotence 80 s, ...": each step's time, from stamp's lines
  awk '{ if (match($0, /> [a-z_]+\]/)) { st = substr($0, RSTART + 2, RLENGTH - 3)
         if ($0 ~ /\] Executing/) t[st] = $1
         else if (st in t) { out = out sep st " " ($1 - t[st]) " s"; sep = ", "; delete t[st] } } }
       END { print out }' "$1"
}

one() {  # one scenario; its result line in $logs/<s>.result
  local s=$1 start result
  start=$(date +%s)
  mkdir -p "$logs/$s.cp"
  # a scenario's fresh controller (scenario local's offline install): made anew by its prepare.yml, removed here
  # because the scenario's own steps run with its ansible-playbook once it exists
  # A scenario's namespaces and /var/tmp/sco-molecule/<scenario>* paths are fixed by name (static inventories), so
  # two checkouts on one machine (a worktree and the CI clone) running one scenario at once would tear down each
  # other's hosts and controller venv: a machine-wide lock per scenario makes the second wait (an hour at most).
  # -o: the lock stays with flock, not with what molecule leaves running (ssh ControlPersist masters).
  mkdir -p /var/tmp/sco-molecule
  local rc=0
  : >"$logs/$s.steps"
  ANSIBLE_SSH_CONTROL_PATH_DIR="$logs/$s.cp" flock -o -E 75 -w "${MOLECULE_LOCK_WAIT:-3600}" \
    "/var/tmp/sco-molecule/.$s.lock" bash -c 'rm -rf "/var/tmp/sco-molecule/$1-controller" && molecule test -s "$1"' \
    scenario "$s" 2>&1 | stamp "$logs/$s.steps" || rc=${PIPESTATUS[0]}
  case $rc in
    0) result=passed ;;
    75) result="failed (another checkout held /var/tmp/sco-molecule/.$s.lock for ${MOLECULE_LOCK_WAIT:-3600} s)" ;;
    *) result=failed ;;
  esac
  echo "molecule: scenario $s $result in $(( $(date +%s) - start )) s ($(steps "$logs/$s.steps"))" >"$logs/$s.result"
}

rm -f "$logs"/*.result
if [ "$jobs" -eq 1 ] || [ ${#scenarios[@]} -eq 1 ]; then
  for s in "${scenarios[@]}"; do one "$s"; done
else
  start=$(date +%s)
  for s in "${scenarios[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    echo "molecule: scenario $s started (log: $logs/$s.log)"
    one "$s" >"$logs/$s.log" 2>&1 &
  done
  wait || true
  for s in "${scenarios[@]}"; do
    echo "=== molecule: scenario $s ==="
    cat "$logs/$s.log"
  done
  echo "molecule: ${#scenarios[@]} scenarios, $jobs at a time, in $(( $(date +%s) - start )) s"
fi
status=0
for s in "${scenarios[@]}"; do
  if [ -f "$logs/$s.result" ]; then cat "$logs/$s.result"; else echo "molecule: scenario $s: no result"; fi
  grep -q " passed in " "$logs/$s.result" 2>/dev/null || status=1
done
exit $status

#!/usr/bin/env bash
# `make sanity`: build the collection artifact as Galaxy would ship it, install it, and run ansible-test sanity on
# what was installed (Python 3.11). The only ignore entries are the licence header (tests/sanity/ignore-*.txt):
# the collection is Apache-2.0, validate-modules asks for a GPLv3 header.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
# outside the checkout: inside a git work tree ansible-test lists files through git and skips untracked ones
work=$(mktemp -d "${TMPDIR:-/tmp}/sco-sanity.XXXXXX")
trap 'rm -rf "$work"' EXIT
ansible-galaxy collection build collections/ansible_collections/sco/orchestrator --output-path "$work" --force
# --no-deps: sanity looks at this collection only (its dependencies come from Galaxy, out of reach here)
ansible-galaxy collection install --no-deps "$work"/sco-orchestrator-*.tar.gz -p "$work/tree" --force
# ansible-test bootstraps pip in its per-test venvs with a script from ci-files.testing.ansible.com, out of reach
# here: give it the stand-in (pip from ensurepip, the rest from the package index) under the name it looks for.
pip_version=$(python -c 'import re, ansible_test, pathlib; p = pathlib.Path(ansible_test.__file__).parent / "_internal/python_requirements.py"; print(re.search(r"pip=.([0-9.]+)", p.read_text()).group(1))')
cache="$HOME/.ansible/test/cache/get_pip_${pip_version//./_}.py"
if [ ! -s "$cache" ] || ! cmp -s scripts/get-pip-offline.py "$cache"; then
  if [ ! -s "$cache" ] || grep -q "Stand-in for pypa's get-pip.py" "$cache"; then
    mkdir -p "$(dirname "$cache")" && cp scripts/get-pip-offline.py "$cache"
  fi
fi
cd "$work/tree/ansible_collections/sco/orchestrator"
ansible-test sanity --python 3.11 --requirements --color no

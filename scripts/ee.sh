#!/usr/bin/env bash
# `make ee`: build the execution environment (ee/execution-environment.yml) with ansible-builder and podman, then
# prove it the way AWX uses it: ee/smoke/ee-smoke.yml (sco.orchestrator's contract_bundle and plan modules on
# localhost) runs through `ansible-runner transmit | worker (in the image) | process`, ansible-doc renders a module,
# the product's version is the collection's, and `ansible-galaxy collection list` shows sco.orchestrator and
# collections/requirements.yml's, and every Python distribution pip installed is pinned (the image's package list:
# .work/ee/packages.txt). ee/README.md has the details and the measured times.
#
# Environment:
#   EE_TAG         image to build (default localhost/sco-ee:<collection version>)
#   EE_BASE_IMAGE  base image; default: localhost/sco-ee-base:bookworm, made here from the Debian rootfs of the
#                  test hosts (no registry needed). Set it to pull one instead (then EE_PKGMGR too, e.g.
#                  EE_BASE_IMAGE=quay.io/centos/centos:stream9 EE_PKGMGR=/usr/bin/dnf).
#   EE_PKGMGR      the base image's package manager (default /usr/bin/apt-get with the local base)
#   EE_PYPKG       its packages of Python and pip (default "python3.11 python3-pip" with the local base)
#   EE_REBUILD_BASE=1  remake the local base image
#   EE_DEBIAN_PINS check (default): with the local Debian base, the build holds apt to constraints/ee-debian.txt's
#                  versions and fails unless the image's Debian packages are exactly that list; write: rewrite the
#                  list from the built image (on purpose: a Debian point release, a package added)
#
# Needs root (rootful podman) and installs podman and runc from apt when missing. What this machine needs, and why:
# - runc, not crun: crun 1.8 refuses hybrid cgroups (v1 controllers plus a cgroup2 mount) as here;
# - explicit ulimits: podman asks for nofile/nproc above the hard limits, refused without CAP_SYS_RESOURCE;
# - cgroupfs and a file event log: no systemd as PID 1;
# - host network for the build (pip reaches the package index, apt the Debian mirror), and the host's CA bundle
#   mounted read-only over the image's during the build (a TLS-inspecting egress proxy signs with a CA only the
#   host trusts); the image keeps Debian's bundle.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
VENV=${VENV:-.venv}
export PATH="$root/$VENV/bin:$PATH"
work=$root/.work/ee
mkdir -p "$work"
say() { printf 'ee: %s\n' "$*"; }
fail() { printf 'ee: FAILED: %s\n' "$*" >&2; exit 1; }

version=$(python -c 'import yaml; print(yaml.safe_load(open("collections/ansible_collections/sco/orchestrator/galaxy.yml"))["version"])')
tag=${EE_TAG:-localhost/sco-ee:$version}

[ "$(id -u)" = 0 ] || fail "run as root (rootful podman): sudo make ee"
debian_pins=${EE_DEBIAN_PINS:-check}
case $debian_pins in check | write) ;; *) fail "EE_DEBIAN_PINS=$debian_pins: expected check or write" ;; esac
if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
  say "apt-get install podman runc"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman runc >/dev/null
fi

# podman settings of this build only (CONTAINERS_CONF), not the machine's
nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
[ "$nofile" = unlimited ] || [ "$nofile" -gt 8192 ] && nofile=8192
[ "$nproc" = unlimited ] || [ "$nproc" -gt 8192 ] && nproc=8192
cat >"$work/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF=$work/containers.conf

# --- the base image ------------------------------------------------------------------------------------------------
base=${EE_BASE_IMAGE:-}
pkgmgr=${EE_PKGMGR:-}
pypkg=${EE_PYPKG:-}
if [ -z "$base" ]; then
  base=localhost/sco-ee-base:bookworm
  pkgmgr=${pkgmgr:-/usr/bin/apt-get}
  pypkg=${pypkg:-python3.11 python3-pip}
  if [ "${EE_REBUILD_BASE:-0}" = 1 ] || ! podman image exists "$base"; then
    rootfs=${SCO_TESTHOST_ROOTFS:-/var/cache/sco-testhost/rootfs}
    bash scripts/testhost-rootfs.sh "$rootfs"
    say "base image $base from $rootfs"
    # the shared rootfs is only read; its SSH host keys stay out of the image
    tar -C "$rootfs" --numeric-owner --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' \
      --exclude='./run/*' --exclude='./tmp/*' --exclude='./etc/ssh/ssh_host_*' --exclude='./.sco-complete' -c . |
      podman import --change 'CMD ["/bin/bash"]' - localhost/sco-ee-base:rootfs >/dev/null
    # package lists for bindep's packages; pip (Debian's, from PYPKG) told to trust the system's CA bundle rather
    # than the one it carries, so that mounting the host's bundle over it during a build is all a build needs
    printf '%s\n' 'FROM localhost/sco-ee-base:rootfs' 'RUN apt-get update -qq' \
      "RUN printf '[global]\\ncert = /etc/ssl/certs/ca-certificates.crt\\n' > /etc/pip.conf" >"$work/Containerfile.base"
    podman build --network host -q -f "$work/Containerfile.base" -t "$base" "$work" >/dev/null
    podman rmi localhost/sco-ee-base:rootfs >/dev/null
  fi
fi
say "base image $base${pkgmgr:+ (package manager $pkgmgr)}"

# --- what the build installs from this checkout ----------------------------------------------------------------------
# Artifacts replace ee/'s copies only when their contents changed (their archives carry build times), so that an
# unchanged checkout reuses every cached layer.
same() {  # same OLD NEW: the collection artifacts' MANIFEST.json (which hashes every file), the wheels' RECORD
  [ -f "$1" ] && python - "$1" "$2" <<'EOF'
import sys, tarfile, zipfile
def digest(p):
    if p.endswith(".whl"):
        with zipfile.ZipFile(p) as z:
            return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/RECORD")))
    with tarfile.open(p) as t:
        return t.extractfile("MANIFEST.json").read()
sys.exit(digest(sys.argv[1]) != digest(sys.argv[2]))
EOF
}
rm -rf "$work/dist"
ansible-galaxy collection build collections/ansible_collections/sco/orchestrator --output-path "$work/dist" --force >/dev/null
same ee/sco-orchestrator.tar.gz "$work/dist/sco-orchestrator-$version.tar.gz" ||
  cp "$work/dist/sco-orchestrator-$version.tar.gz" ee/sco-orchestrator.tar.gz
rm -rf build  # setuptools' scratch keeps modules moved since an earlier build: the wheel shipped them
pip wheel -q --no-deps -w "$work/dist" . 2>&1 | grep -v '^$' || true
whl=$(cd "$work/dist" && ls spot_capacity_orchestrator-"$version"-*.whl) || fail "no wheel of spot-capacity-orchestrator $version"
if ! same "ee/wheels/$whl" "$work/dist/$whl"; then
  rm -f ee/wheels/*.whl
  cp "$work/dist/$whl" ee/wheels/
fi

# The definition as shipped, except that collections named for Galaxy (out of reach here) come from local
# artifacts of an acceptable version: the ones of the `ansible` package in the venv, which the tests use.
rm -rf "$work/def" "$work/context" "$work/constraints"
cp -rp ee "$work/def"
# where the definition's ../constraints/control.txt (the pins of every pip in the build) resolves from the copy
mkdir -p "$work/constraints"
cp -p constraints/control.txt "$work/constraints/"
python - "$work/def" "$work/galaxy" <<'EOF'
import json, pathlib, shutil, subprocess, sys, tarfile
import yaml
from packaging.specifiers import SpecifierSet
import ansible_collections

d, cache = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])


def manifest(artifact):
    with tarfile.open(artifact) as t:
        return t.extractfile("MANIFEST.json").read()


req = yaml.safe_load((d / "requirements.yml").read_text())
for entry in req["collections"]:
    if entry.get("type") == "file":
        continue
    ns, name = entry["name"].split(".")
    found = [pathlib.Path(p) / ns / name for p in ansible_collections.__path__]
    found = [p for p in found if (p / "MANIFEST.json").is_file()]
    if not found:
        sys.exit(f"ee: FAILED: no artifact of {entry['name']} here (pip install ansible, or Galaxy)")
    src = found[0]
    have = json.loads((src / "MANIFEST.json").read_text())["collection_info"]["version"]
    want = str(entry.get("version", "*")).replace("*", "")
    if want and have not in SpecifierSet(want):
        sys.exit(f"ee: FAILED: {entry['name']} {have} in {src} is not {want} (ee/requirements.yml)")
    # rebuilt with ansible-galaxy from its installed files: the package leaves out some files FILES.json lists
    tree = d / "galaxy-src" / ns / name
    shutil.copytree(src, tree, ignore=shutil.ignore_patterns("__pycache__", "MANIFEST.json", "FILES.json"))
    info = json.loads((src / "MANIFEST.json").read_text())["collection_info"]
    (tree / "galaxy.yml").write_text(yaml.safe_dump({k: v for k, v in info.items() if v is not None}))
    subprocess.run(
        ["ansible-galaxy", "collection", "build", str(tree), "--output-path", str(d / "galaxy-src"), "--force"],
        check=True, stdout=subprocess.DEVNULL,
    )
    art = f"{ns}-{name}-{have}.tar.gz"
    cache.mkdir(exist_ok=True)  # kept while its contents are the same, as the layers built from it
    if not (cache / art).is_file() or manifest(cache / art) != manifest(d / "galaxy-src" / art):
        shutil.copy2(d / "galaxy-src" / art, cache / art)
    shutil.rmtree(d / "galaxy-src")
    (d / "galaxy").mkdir(exist_ok=True)
    shutil.copy2(cache / art, d / "galaxy" / art)
    print(f"ee: {entry['name']} {have} from {src}")
    entry.clear()
    entry.update(name=f"/build/galaxy/{art}", type="file")
(d / "requirements.yml").write_text(yaml.safe_dump(req, sort_keys=False))
defn = yaml.safe_load((d / "execution-environment.yml").read_text())
defn["additional_build_files"].append({"src": "galaxy", "dest": "galaxy"})
(d / "execution-environment.yml").write_text(yaml.safe_dump(defn, sort_keys=False))
EOF

# The Debian packages held at constraints/ee-debian.txt's versions (the local Debian base only: a pulled base's
# package manager is another's): an apt preferences file in the base stage, before anything apt installs, removed
# from the final image. With EE_DEBIAN_PINS=write nothing is held (the list is being remade from what apt finds).
if [ -z "${EE_BASE_IMAGE:-}" ] && [ "$debian_pins" = check ]; then
  mkdir -p "$work/def/apt"
  python -m sco_devkit.debian_pins preferences >"$work/def/apt/sco-ee-pins" || fail "constraints/ee-debian.txt (above)"
  python - "$work/def/execution-environment.yml" <<'EOF'
import sys
import yaml
path = sys.argv[1]
defn = yaml.safe_load(open(path))
defn["additional_build_files"].append({"src": "apt", "dest": "apt"})
steps = defn["additional_build_steps"]
steps["prepend_base"][:0] = ["COPY _build/apt/sco-ee-pins /etc/apt/preferences.d/sco-ee-pins"]
steps["append_final"].append("RUN rm -f /etc/apt/preferences.d/sco-ee-pins")
open(path, "w").write(yaml.safe_dump(defn, sort_keys=False))
EOF
fi

# --- build -----------------------------------------------------------------------------------------------------------
build_args=(--build-arg "EE_BASE_IMAGE=$base")
[ -n "$pkgmgr" ] && build_args+=(--build-arg "PKGMGR=$pkgmgr")
[ -n "$pypkg" ] && build_args+=(--build-arg "PYPKG=$pypkg")
# the host's trust (here: the TLS-inspecting egress proxy's CA) over the image's bundle, for the build only
# (the local Debian base's path; a pulled base is built with the image's own trust)
ca_mount=
[ -z "${EE_BASE_IMAGE:-}" ] && [ -f /etc/ssl/certs/ca-certificates.crt ] &&
  ca_mount="-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"
say "ansible-builder build -t $tag"
start=$(date +%s)
ansible-builder build -f "$work/def/execution-environment.yml" --context "$work/context" -t "$tag" \
  --container-runtime podman -v 2 "${build_args[@]}" \
  --extra-build-cli-args "--network host --force-rm $ca_mount" \
  >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; fail "ansible-builder build (log: $work/build.log)"; }
say "built $tag in $(($(date +%s) - start)) s ($(podman image inspect "$tag" --format '{{.Size}}' | awk '{printf "%d MB", $1/1e6}'))"

# --- prove it ------------------------------------------------------------------------------------------------------
# as AWX runs a job: the image's entrypoint, its user (1000), no network
run() { podman run --rm --network none "$@"; }
got=$(run "$tag" python3 -c 'import importlib.metadata as m; print(m.version("spot-capacity-orchestrator"))')
[ "$got" = "$version" ] || fail "spot-capacity-orchestrator in the image is $got, the collection is $version"
say "spot-capacity-orchestrator $got = collection $version"

run "$tag" ansible-galaxy collection list >"$work/collections.txt"
grep -Eq "^sco\.orchestrator +$version\b" "$work/collections.txt" || fail "no sco.orchestrator $version: $(cat "$work/collections.txt")"
for c in $(python -c 'import yaml; print(" ".join(c["name"] for c in yaml.safe_load(open("collections/requirements.yml"))["collections"]))'); do
  grep -Eq "^${c//./\\.} " "$work/collections.txt" || fail "no $c in the image: $(cat "$work/collections.txt")"
done
say "collections: $(grep -E '^(sco|kubernetes)\.' "$work/collections.txt" | awk '{print $1, $2}' | paste -sd, | sed 's/,/, /g')"

# What the image holds, for comparing two builds (ee/README.md, "Two builds, the same packages"): pip's view of
# every Python distribution, the collections, Debian's packages.
run "$tag" bash -c 'echo "## pip"; python3 -m pip list --format=freeze --disable-pip-version-check 2>/dev/null |
  LC_ALL=C sort; echo "## pip-installed (/usr/local)"; cd /usr/local/lib/python3*/dist-packages &&
  ls -d *.dist-info | LC_ALL=C sort; echo "## collections"; ansible-galaxy collection list 2>/dev/null;
  echo "## dpkg"; dpkg-query -W -f="\${Package} \${Version} \${Architecture}\n" | LC_ALL=C sort' >"$work/packages.txt"
# Every distribution pip installed is pinned (constraints/control.txt; dumb-init: ansible-builder pins it; the
# product: the collection's version), so the next build installs the same ones.
python - "$work/packages.txt" constraints/control.txt "$version" <<'EOF' || fail "pip installed what no constraint pins (above)"
import re, sys
from packaging.utils import canonicalize_name as canon
pins = {canon(n): v for n, _, v in (l.split("#")[0].strip().partition("==") for l in open(sys.argv[2])) if v}
pins |= {"dumb-init": "1.2.5", "spot-capacity-orchestrator": sys.argv[3]}
lines = open(sys.argv[1]).read().split("## pip-installed (/usr/local)\n", 1)[1].split("## ", 1)[0].split()
bad = []
for d in lines:
    name, version = re.fullmatch(r"(.+)-([^-]+)\.dist-info", d).groups()
    if pins.get(canon(name)) != version:
        bad.append(f"{name} {version} (pinned: {pins.get(canon(name), 'no')})")
for b in bad:
    print(f"ee: unpinned: {b}", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
say "packages: $(grep -c . "$work/packages.txt") lines in $work/packages.txt; every pip-installed distribution pinned"
# Every Debian package as constraints/ee-debian.txt pins it (the local Debian base), or the list rewritten
if [ -n "${EE_BASE_IMAGE:-}" ]; then
  say "Debian packages not checked: the base $base is not the local Debian one constraints/ee-debian.txt pins"
elif [ "$debian_pins" = write ]; then
  python -m sco_devkit.debian_pins write "$work/packages.txt"
else
  python -m sco_devkit.debian_pins check "$work/packages.txt" ||
    fail "the image's Debian packages are not constraints/ee-debian.txt's (above)"
fi

run "$tag" ansible-doc -t module sco.orchestrator.reclaim >"$work/reclaim-doc.txt" || fail "ansible-doc sco.orchestrator.reclaim"
grep -q "RETURN VALUES" "$work/reclaim-doc.txt" || fail "ansible-doc sco.orchestrator.reclaim: $(head "$work/reclaim-doc.txt")"
say "ansible-doc sco.orchestrator.reclaim renders"

# The job as AWX runs it (through receptor): `ansible-runner transmit` packs the private data dir, the image's
# `ansible-runner worker` runs it, `ansible-runner process` unpacks the events on this side.
pdd=$work/runner
rm -rf "$pdd"
mkdir -p "$pdd/project"
cp ee/smoke/ee-smoke.yml "$pdd/project/"
ansible-runner transmit "$pdd" -p ee-smoke.yml |
  podman run -i --rm --network none "$tag" ansible-runner worker --private-data-dir=/runner |
  ansible-runner process "$pdd" >"$work/smoke.log" 2>&1 ||
  { tail -40 "$work/smoke.log"; fail "ansible-runner worker in $tag (log: $work/smoke.log)"; }
python - "$pdd" <<'EOF' || { tail -40 "$work/smoke.log"; fail "the smoke job in $tag (log: $work/smoke.log)"; }
import json, pathlib, sys
events = [json.loads(p.read_text()) for p in pathlib.Path(sys.argv[1], "artifacts").rglob("job_events/*.json")]
events.sort(key=lambda e: e["counter"])
stats = [e["event_data"] for e in events if e.get("event") == "playbook_on_stats"]
tasks = [e["event_data"]["task"] for e in events if e.get("event") == "runner_on_ok"]
if len(stats) != 1 or stats[0]["failures"] or stats[0]["dark"] or "Plan in check mode" not in tasks:
    sys.exit(f"ee: tasks ok {tasks}, stats {stats}")
print(f"ee: AWX-style job (transmit | worker | process) in the image: {len(tasks)} tasks ok, no failure: {', '.join(tasks)}")
EOF
say "OK $tag (${SECONDS} s in all)"

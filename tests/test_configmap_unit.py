"""The ConfigMap the Kyverno policies read is published by the hall itself. Role control_loop
installs sco-contracts-configmap.service on the control host of a hall whose loop reads Kubernetes; this renders
the role's unit from its template with the role's own defaults (the Kubernetes API and the distributor's URL from
the hall's settings) and runs exactly its ExecStart (systemd's ${STATE_DIRECTORY} and ${CREDENTIALS_DIRECTORY}
filled in) against a real distributor and the Kubernetes API stand-in: the ConfigMap appears with the bundle's
serial, follows each new bundle, and a key taken off the trusted list stops being trusted."""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
from pathlib import Path

from sco.contract.compiler import compile_repo
from sco.contract.distributor import DistributorServer
from sco.contract.distributor import publish as publish_bundle
from sco.contract.signing import Keyring, generate, sign, write_keypair
from sco_devkit.standins.kube_apiserver import Identity, KubeApiStandIn
from tests.harness import render_with_roles, sample_repo, wait_for

BIN = Path(sys.executable).parent

RENDER = """
- name: The contracts ConfigMap publisher's unit, from role control_loop's template and defaults
  hosts: localhost
  gather_facts: false
  vars_files: ["{{ roles_dir }}/control_loop/defaults/main.yml", "{{ roles_dir }}/control_loop/vars/main.yml"]
  tasks:
    - name: Render
      ansible.builtin.template:
        src: "{{ roles_dir }}/control_loop/templates/sco-contracts-configmap.service.j2"
        dest: "{{ out }}/sco-contracts-configmap.service"
        mode: "0644"
    - name: Say whether the role would install it
      ansible.builtin.copy:
        content: "{{ control_loop_configmap_enabled | bool }}"
        dest: "{{ out }}/enabled"
        mode: "0644"
"""


def render(out: Path, **ev: object) -> Path:
    render_with_roles(out, RENDER, **ev)
    return out / "sco-contracts-configmap.service"


def exec_start(unit: Path, state: Path, creds: Path) -> list[str]:
    line = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    line = line.removeprefix("ExecStart=").replace("${STATE_DIRECTORY}", str(state))
    argv = shlex.split(line.replace("${CREDENTIALS_DIRECTORY}", str(creds)))
    assert argv[0] == "/opt/sco/bin/sco"  # the role's venv: the test's own venv runs the same command
    return [str(BIN / "sco"), *argv[1:]]


def test_the_roles_publisher_keeps_the_configmap_in_step_with_the_bundle(tmp_path: Path) -> None:
    key, stranger = generate(), generate()
    write_keypair(key, tmp_path / "hall.key", tmp_path / "hall.pub")
    keyring = Keyring([key.public])
    kube = KubeApiStandIn(tokens={"pub": Identity("system:serviceaccount:sco-system:sco-contract-publisher")}).start()
    root = tmp_path / "dist"
    publish_bundle(sign(compile_repo(sample_repo(), serial=3), [key]), root, keyring)
    dist = DistributorServer(root, ("127.0.0.1", 0))
    threading.Thread(target=dist.serve_forever, daemon=True).start()
    trust = tmp_path / "trusted"
    proc: subprocess.Popen[bytes] | None = None
    try:
        # a hall without Kubernetes gets no publisher
        off = render(
            tmp_path / "off",
            control_loop_hall="local",
            control_loop_kubernetes={},
            control_loop_configmap_bundle_url="",
        )
        assert (off.parent / "enabled").read_text() == "False"
        unit = render(
            tmp_path / "unit", control_loop_hall="local", control_loop_kubernetes={"url": kube.url},
            control_loop_configmap_bundle_url=f"{dist.url}/v1/halls/local/bundle.json",
            control_loop_configmap_interval=1, _control_loop_configmap_trust_dir=str(trust),
        )  # fmt: skip
        assert (unit.parent / "enabled").read_text() == "True"
        text = unit.read_text()
        assert "LoadCredential=token:/etc/sco/contract-publisher.token" in text and "DynamicUser=yes" in text
        trust.mkdir()
        (trust / "hall.pub").write_bytes((tmp_path / "hall.pub").read_bytes())  # what the role's copy task puts
        creds, state = tmp_path / "creds", tmp_path / "state"
        creds.mkdir()
        state.mkdir()
        (creds / "token").write_text("pub\n")
        log = open(tmp_path / "publisher.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(exec_start(unit, state, creds), stdout=log, stderr=log)

        def serial() -> str | None:
            assert proc is not None and proc.poll() is None, (tmp_path / "publisher.log").read_text()[-2000:]
            cm = kube.cluster.configmaps.get(("sco-system", "sco-contracts"))
            return cm["data"]["_serial"] if cm else None

        wait_for(lambda: serial() == "3", 30, "the ConfigMap published from serial 3")
        publish_bundle(sign(compile_repo(sample_repo(), serial=4), [key]), root, keyring)
        wait_for(lambda: serial() == "4", 30, "the ConfigMap following serial 4")
        # a bundle signed by a key the publisher does not trust is never published (the distributor would refuse
        # it too: written in place here, as a tampered mirror would)
        (root / "local" / "bundle.json").write_bytes(sign(compile_repo(sample_repo(), serial=5), [stranger]))
        import time

        time.sleep(3)  # three fetches at the 1 s interval
        assert serial() == "4"
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        dist.shutdown()
        dist.server_close()
        kube.stop()

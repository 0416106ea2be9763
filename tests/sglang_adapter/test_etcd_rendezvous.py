"""SGLang's prefill and decode ranks meeting in etcd (KVSTAGE_BOOTSTRAP=etcd://... on every
process, no kvstage rendezvous server): the prefill instance's SGLang bootstrap server publishes
its own namespace, its ranks register there, and the decode ranks find them by that address and
DP rank. A three-member etcd on localhost (support/etcd_cluster.py)."""

from __future__ import annotations

import pytest
import requests
from scenario import expect, requests_for, run

from kvstage.support.etcd_cluster import EtcdCluster


@pytest.fixture
def fleet(monkeypatch):
    """Before the bootstrap server (it reads KVSTAGE_BOOTSTRAP when it starts)."""
    with EtcdCluster(3) as ec:
        monkeypatch.setenv("KVSTAGE_BOOTSTRAP", ec.url("fleet"))
        yield ec


def test_prefill_and_decode_meet_in_etcd(tmp_path, model_dir, fleet, bootstrap_server):
    route = requests.get(f"http://127.0.0.1:{bootstrap_server}/kvstage/rendezvous", timeout=5).json()
    assert route["address"].startswith(fleet.url("fleet/prefill-")), route
    namespace = route["address"].rsplit("/", 2)[-2:]
    reqs = requests_for(5, 3, prefix={1: 1})
    results = run(tmp_path, model_dir, bootstrap_server, 1, 1, reqs)
    expect(results, reqs, lambda i: "Success")
    assert fleet.keys(f"/{'/'.join(namespace)}/ranks/") == [] and fleet.keys("/fleet/ranks/") == []  # all revoked

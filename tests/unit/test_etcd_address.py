"""Choosing the rendezvous by its address: etcd:// addresses, their options and credentials from
the environment, KVSTAGE_BOOTSTRAP, and that nothing of etcd is imported for a bootstrap server."""

import subprocess
import sys

import pytest

from kvstage.bootstrap.etcd_config import parse_etcd_url
from kvstage.bootstrap.rendezvous import check_address, rendezvous_key
from kvstage.transfer import EngineConfig


def test_endpoints_namespace_and_ttl():
    c = parse_etcd_url("etcd://h1:2379,10.0.0.2,[::1]:23/prod/kv?ttl=5", env={})
    assert c.endpoints == ("h1:2379", "10.0.0.2:2379", "[::1]:23")
    assert (c.namespace, c.ttl_s, c.user, c.secure) == ("prod/kv", 5, None, False)
    assert c.urls[1] == "http://10.0.0.2:2379" and c.display == "etcd://h1:2379,10.0.0.2:2379,[::1]:23/prod/kv"
    d = parse_etcd_url("etcd://h", env={})
    assert (d.namespace, d.ttl_s, d.endpoints) == ("kvstage", 10, ("h:2379",))


@pytest.mark.parametrize("addr, match", [
    ("etcd://", "empty endpoint"), ("etcd://h1,,h2/ns", "empty endpoint"), ("etcd://bad host!:1/ns", "not a host name"),
    ("etcd://h:0/ns", "port 1..65535"), ("etcd://u:pw@h:1/ns", "no user or password"),
    ("etcd://h:1/a b", "namespace segment"), ("etcd://h:1/ns?ttl=0", "ttl must be"), ("etcd://h:1/ns?ttl=x", "ttl"),
    ("etcd://h:1/ns?tls=1", "unknown option 'tls'"), ("http://h:1", "not an etcd address"),
])
def test_bad_etcd_addresses_say_what_is_wrong(addr, match):
    with pytest.raises(ValueError, match=match):
        parse_etcd_url(addr, env={})


def test_credentials_and_tls_from_the_environment(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    c = parse_etcd_url("etcd://h:1/ns", env={"KVSTAGE_ETCD_USER": "kv", "KVSTAGE_ETCD_PASSWORD_FILE": str(pw)})
    assert (c.user, c.password) == ("kv", "s3cret") and "s3cret" not in repr(c)
    with pytest.raises(ValueError, match="go together"):
        parse_etcd_url("etcd://h:1/ns", env={"KVSTAGE_ETCD_USER": "kv"})
    with pytest.raises(ValueError, match="not both"):
        parse_etcd_url("etcd://h:1/ns", env={"KVSTAGE_ETCD_USER": "kv", "KVSTAGE_ETCD_PASSWORD": "a",
                                            "KVSTAGE_ETCD_PASSWORD_FILE": str(pw)})
    with pytest.raises(ValueError, match="KVSTAGE_ETCD_CA_CERT"):
        parse_etcd_url("etcd://h:1/ns", env={"KVSTAGE_ETCD_CA_CERT": str(tmp_path / "missing")})
    tls = parse_etcd_url("etcd://h:1/ns", env={"KVSTAGE_ETCD_CA_CERT": str(pw)})
    assert tls.secure and tls.urls == ["https://h:1"]
    with pytest.raises(ValueError, match="go together"):
        parse_etcd_url("etcd://h:1/ns", env={"KVSTAGE_ETCD_CERT": str(pw)})


def test_rendezvous_addresses_and_keys():
    assert check_address("bootstrap", "etcd://h:1/ns") == "etcd://h:1/ns"
    assert check_address("bootstrap", "h:1") == "h:1"
    with pytest.raises(ValueError, match="etcd://"):
        check_address("bootstrap", "nohost")
    assert rendezvous_key("h:1") == rendezvous_key("tcp://h:1")
    assert rendezvous_key("etcd://h/ns") == rendezvous_key("etcd://h:2379/ns/") != rendezvous_key("etcd://h/ns?ttl=3")


def test_engine_config_takes_kvstage_bootstrap_when_none_is_given(monkeypatch):
    monkeypatch.delenv("KVSTAGE_BOOTSTRAP", raising=False)
    with pytest.raises(ValueError, match="KVSTAGE_BOOTSTRAP"):
        EngineConfig(role="prefill", engine_id="e").resolved()
    monkeypatch.setenv("KVSTAGE_BOOTSTRAP", "etcd://h1:2379,h2:2379/ns")
    assert EngineConfig(role="prefill", engine_id="e").resolved().bootstrap == "etcd://h1:2379,h2:2379/ns"
    assert EngineConfig(role="prefill", engine_id="e", bootstrap="h:1").resolved().bootstrap == "h:1"   # explicit wins
    monkeypatch.setenv("KVSTAGE_BOOTSTRAP", "etcd://h1/ns?ttl=nope")
    with pytest.raises(ValueError, match="KVSTAGE_BOOTSTRAP='etcd://h1/ns\\?ttl=nope': ttl"):
        EngineConfig(role="prefill", engine_id="e").resolved()


def test_a_bootstrap_server_deployment_imports_nothing_of_etcd():
    code = ("import sys, kvstage.bootstrap, kvstage.bootstrap.rendezvous, kvstage.bootstrap.__main__; "
            "from kvstage.bootstrap import open_rendezvous; open_rendezvous('127.0.0.1:9').close(); "
            "print(sorted(m for m in ('etcd3gw', 'requests') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]

"""Cluster resolvers: TF_CONFIG, torchrun and SLURM environments, and `resolve_cluster`."""

from __future__ import annotations

import json

import pytest

from meshfit.cluster import (
    ClusterInfo,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    expand_hostlist,
    resolve_cluster,
)


def _tf(cluster_spec, task_type="worker", index=0):
    return {"cluster": cluster_spec, "task": {"type": task_type, "index": index}}



def test_tf_config_workers_only_from_env(monkeypatch):
    config = _tf({"worker": ["localhost:12345", "localhost:23456"]}, index=1)
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    r = TFConfigClusterResolver()
    assert (r.task_type, r.task_id, r.rank, r.world_size, r.num_workers) == ("worker", 1, 1, 2, 2)
    assert not r.is_chief
    assert (r.master_addr, r.master_port, r.local_rank) == ("localhost", 12345, 1)
    assert r.init_method == "tcp://localhost:12345"
    assert r.cluster_spec() == {"worker": ["localhost:12345", "localhost:23456"]}
    assert TFConfigClusterResolver(_tf({"worker": ["a:1", "b:2"]}, index=0)).is_chief


def test_tf_config_chief_is_rank_zero_and_evaluator_has_no_rank():
    spec = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "evaluator": ["e:1"]}
    chief = TFConfigClusterResolver(json.dumps(_tf(spec, "chief", 0)))
    assert (chief.rank, chief.world_size, chief.num_workers, chief.is_chief) == (0, 3, 2, True)
    assert (chief.master_addr, chief.master_port) == ("c", 1)
    worker0 = TFConfigClusterResolver(_tf(spec, "worker", 0))
    assert (worker0.rank, worker0.task_id, worker0.is_chief, worker0.local_rank) == (1, 0, False, 0)
    worker1 = TFConfigClusterResolver(_tf(spec, "worker", 1))
    assert worker1.rank == 2
    evaluator = TFConfigClusterResolver(_tf(spec, "evaluator", 0))
    assert (evaluator.rank, evaluator.world_size, evaluator.is_chief, evaluator.task_type) == (None, 3, False,
                                                                                             "evaluator")
    assert evaluator.master_addr == "c"


def test_tf_config_ipv6_and_extra_keys():
    config = _tf({"worker": ["[::1]:1234", "[::1]:1235"]}, index=1)
    config["environment"] = "cloud"
    r = TFConfigClusterResolver(config)
    assert (r.master_addr, r.master_port, r.local_rank) == ("::1", 1234, 1)
    assert r.init_method == "tcp://[::1]:1234"


MALFORMED = [
    ("{not json", r"not valid JSON.*Expecting.*\{not json"),
    ('["a"]', r"expected a JSON object"),
    ({"task": {"type": "worker", "index": 0}}, r"missing the 'cluster' key"),
    ({"cluster": {"worker": ["a:1"]}}, r"missing the 'task' key"),
    (_tf(["a:1"]), r"cluster must be an object"),
    (_tf({"worker": "a:1"}), r"cluster\.worker must be a list"),
    (_tf({}), r"cluster is empty"),
    (_tf({"worker": []}), r"cluster is empty"),
    (_tf({"evaluator": ["e:1"]}, "evaluator"), r"no training tasks"),
    (_tf({"worker": ["a:1"], "ps": ["p:1"]}), r"cluster\.ps.*ParameterServerStrategy.*not"),
    (_tf({"worker": ["a:1"], "master": ["m:1"]}), r"unknown job 'master'"),
    (_tf({"worker": ["a:1"]}, "ps"), r"task\.type='ps'.*ParameterServerStrategy"),
    (_tf({"worker": ["a:1"]}, "boss"), r"task\.type='boss' is not a known task type"),
    (_tf({"worker": ["a:1"]}, "chief"), r"task\.type='chief' is not a job in the cluster.*Add cluster\.chief"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}, r"task\.index is missing"),
    (_tf({"worker": ["a:1"]}, index="0"), r"task\.index='0' is not an integer"),
    (_tf({"worker": ["a:1"]}, index=True), r"task\.index=True is not an integer"),
    (_tf({"worker": ["a:1", "b:1"]}, index=3),
     r"task\.index=3 is out of range for job 'worker' with 2 tasks.*Set task\.index to 0\.\.1"),
    (_tf({"worker": ["a:1"]}, index=-1), r"task\.index=-1 is out of range"),
    (_tf({"worker": ["hostonly"]}), r"cluster\.worker\[0\]='hostonly' has no port.*host:port"),
    (_tf({"worker": ["a:1", "b:http"]}), r"cluster\.worker\[1\]='b:http' has port 'http'.*1\.\.65535"),
    (_tf({"worker": ["a:70000"]}), r"port '70000'.*1\.\.65535"),
    (_tf({"worker": ["h:5\u00b2"]}), r"cluster\.worker\[0\]='h:5\u00b2' has port '5\u00b2'.*1\.\.65535"),
    (_tf({"worker": [":1"]}), r"empty host"),
    (_tf({"worker": ["a:1", "10.0.0 .2:1"]}), r"cluster\.worker\[1\]='10\.0\.0 \.2:1' has a host with spaces"),
    (_tf({"worker": ["my host:1"]}), r"cluster\.worker\[0\]='my host:1' has a host with spaces.*host:port"),
    (_tf({"worker": [" a:1"]}), r"has a host with spaces"),
    (_tf({"worker": ["a\t:1"]}), r"has a host with spaces or control characters"),
    (_tf({"worker": ["[::1 ]:1"]}), r"has a host with spaces"),
    (_tf({"worker": ["::1:5"]}), r"IPv6 address without brackets"),
    (_tf({"worker": ["[::1]"]}), r"no port after the bracketed"),
    (_tf({"worker": [123]}), r"cluster\.worker\[0\] must be a \"host:port\" string"),
    (_tf({"chief": ["a:1"], "worker": ["A:1"]}), r"cluster\.worker\[0\]='A:1' duplicates cluster\.chief\[0\]"),
    (_tf({"chief": ["a:1", "b:1"]}, "chief"), r"cluster\.chief has 2 addresses.*at most one chief"),
    (_tf({"worker": ["a:1"], "evaluator": ["e:1", "f:1"]}), r"at most one evaluator"),
    (_tf({"worker": ["a:1"]}) | {"task": "worker"}, r"task must be an object"),
]


@pytest.mark.parametrize("config, match", MALFORMED)
def test_tf_config_malformed(config, match):
    with pytest.raises(ValueError, match=match) as info:
        TFConfigClusterResolver(config)
    assert str(info.value).startswith("Invalid TF_CONFIG")


def test_tf_config_unset_and_wrong_argument_type(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        TFConfigClusterResolver()
    with pytest.raises(TypeError, match="tf_config"):
        TFConfigClusterResolver(42)


def test_tf_config_bad_json_echoes_at_most_200_chars():
    with pytest.raises(ValueError) as info:
        TFConfigClusterResolver("{" + "x" * 500)
    assert "x" * 199 in str(info.value) and "x" * 201 not in str(info.value)


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29400"}
    r = TorchrunClusterResolver(env)
    assert (r.task_type, r.task_id, r.rank, r.world_size, r.local_rank) == ("worker", 3, 3, 4, 1)
    assert (r.master_addr, r.master_port, r.is_chief) == ("n0", 29400, False)
    assert r.cluster_spec() == {"worker": ["n0:29400", None, None, None]}
    single = TorchrunClusterResolver({"RANK": "0", "WORLD_SIZE": "1"})
    assert (single.is_chief, single.master_addr, single.master_port, single.local_rank) == (
        True, "127.0.0.1", 29500, None)


@pytest.mark.parametrize("env, match", [
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"RANK=2 is out of range.*0\.\.1"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, r"WORLD_SIZE=0 is out of range"),
    ({"RANK": "0"}, r"WORLD_SIZE is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, r"MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}, r"MASTER_PORT is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "99999"}, r"MASTER_PORT=99999"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     r"LOCAL_RANK=-1 is out of range"),
])
def test_torchrun_environment_malformed(env, match):
    with pytest.raises(ValueError, match="Invalid torchrun environment: " + match):
        TorchrunClusterResolver(env)


def test_slurm_environment():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "big[1-4]", "SLURM_STEP_NODELIST": "node[03-04,7]"}
    r = SlurmClusterResolver(env)
    assert (r.rank, r.world_size, r.local_rank, r.is_chief) == (5, 8, 1, False)
    assert (r.master_addr, r.master_port) == ("node03", 29500)
    job_only = SlurmClusterResolver({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a,b",
                                     "MESHFIT_MASTER_PORT": "4000"})
    assert (job_only.master_addr, job_only.master_port, job_only.is_chief) == ("a", 4000, True)
    override = SlurmClusterResolver({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MESHFIT_MASTER_ADDR": "ib0"})
    assert override.master_addr == "ib0"


@pytest.mark.parametrize("env, match", [
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a"}, r"SLURM_PROCID=2 is out of range"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "two", "SLURM_JOB_NODELIST": "a"}, r"SLURM_NTASKS='two'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, r"SLURM_JOB_NODELIST.*MESHFIT_MASTER_ADDR"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-"}, r"unbalanced '\['"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a", "MESHFIT_MASTER_PORT": "0"},
     r"MESHFIT_MASTER_PORT=0 is out of range"),
])
def test_slurm_environment_malformed(env, match):
    with pytest.raises(ValueError, match=match):
        SlurmClusterResolver(env)


def test_expand_hostlist():
    assert expand_hostlist("node[01-03,7]") == ["node01", "node02", "node03", "node7"]
    assert expand_hostlist("a,b[9-10],c") == ["a", "b9", "b10", "c"]
    assert expand_hostlist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    with pytest.raises(ValueError, match="runs backwards"):
        expand_hostlist("n[5-3]")
    with pytest.raises(ValueError, match="cannot read range"):
        expand_hostlist("n[a-b]")


def test_simple_resolver_and_cluster_info_validation():
    r = SimpleClusterResolver(1, 3, master_port=1234, local_rank=1)
    assert (r.rank, r.task_id, r.world_size, r.is_chief, r.master_port, r.local_rank) == (1, 1, 3, False, 1234, 1)
    assert SimpleClusterResolver(0, 2, task_type="chief").is_chief
    assert SimpleClusterResolver(None, 2, task_type="evaluator").rank is None
    with pytest.raises(ValueError, match="a 'chief' task is rank 0"):
        SimpleClusterResolver(1, 2, task_type="chief")
    with pytest.raises(ValueError, match=r"Invalid `rank`.*0\.\.1"):
        SimpleClusterResolver(2, 2)
    with pytest.raises(ValueError, match="Invalid `task_type`"):
        SimpleClusterResolver(0, 2, task_type="ps")
    with pytest.raises(ValueError, match="evaluator has no training rank"):
        SimpleClusterResolver(0, 2, task_type="evaluator")
    with pytest.raises(ValueError, match="Invalid `master_port`"):
        SimpleClusterResolver(0, 2, master_port=0)
    info = r._info  # the resolved value object is frozen
    assert isinstance(info, ClusterInfo)
    with pytest.raises(AttributeError):
        info.rank = 0


def test_resolve_cluster_precedence():
    tf = json.dumps(_tf({"worker": ["a:1", "b:2"]}, index=1))
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "5"}
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "s[1-2]"}
    assert isinstance(resolve_cluster({"TF_CONFIG": tf, **torchrun, **slurm}), TFConfigClusterResolver)
    assert isinstance(resolve_cluster({"TF_CONFIG": "", **torchrun, **slurm}), TorchrunClusterResolver)
    assert isinstance(resolve_cluster(slurm), SlurmClusterResolver)
    assert resolve_cluster({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None
    assert resolve_cluster({"RANK": "0"}) is None
    assert resolve_cluster({}) is None
    with pytest.raises(ValueError, match="Invalid TF_CONFIG"):
        resolve_cluster({"TF_CONFIG": "{"})


def test_resolve_cluster_reads_os_environ(monkeypatch):
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_cluster() is None
    monkeypatch.setenv("TF_CONFIG", json.dumps(_tf({"worker": ["a:1"]})))
    assert resolve_cluster().world_size == 1


def test_cluster_spec_has_tf_methods(monkeypatch):
    # The seed's `_is_chief(task_type, task_id, cluster_spec)` reads `cluster_spec.as_dict()`.
    config = _tf({"chief": ["c:1"], "worker": ["a:1", "b:2"]}, index=1)
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    spec = TFConfigClusterResolver().cluster_spec()
    assert spec.as_dict() == {"chief": ["c:1"], "worker": ["a:1", "b:2"]}
    assert "chief" in spec.as_dict() and spec.jobs == ["chief", "worker"]
    assert spec.num_tasks("worker") == 2 and spec.task_address("worker", 1) == "b:2"
    spec.as_dict()["worker"].append("x:3")  # a copy
    assert spec.num_tasks("worker") == 2
    with pytest.raises(ValueError, match="job_name='ps'"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match="task_index=5"):
        spec.task_address("worker", 5)
